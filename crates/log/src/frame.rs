//! The record frame: how one record is laid out inside a segment. Pure byte work, no I/O.
//!
//! Five formats, chosen per segment by its header's version; the writer writes only the current
//! one (5) and readers read all five.
//!
//! ```text
//! format 5: the frames of format 4, and bit 29 of frame_len says the next frame belongs to the
//!           same batch (one append call): every frame of a batch but its last has it, so that
//!           recovery cuts a batch whose last frame a crash kept from being written whole.
//!           frame_len's length has 29 bits.
//!
//! format 4: the frames of format 3; only the writer's promise differs (a frame holds a
//!           timestamp when its time moved, never also for the sake of readers walking back)
//!
//! format 3 (8-byte header, 16 with a timestamp; frames are dense from the segment's base)
//! 0   4  crc32c       of bytes [4, frame_len): everything after this field, padding excluded
//! 4   4  frame_len    bits 0-29: header + body, without padding (u32 LE); bit 30: timestamp;
//!                     bit 31: extras
//! 8   8  [if timestamp: nanoseconds since the Unix epoch (u64 LE)]; a frame without one has
//!        the timestamp of the frame before it (the first frame of a segment always has one)
//! …   …  body, as in format 2 from byte 16
//!
//! format 2 (16-byte header; the offset is not stored: frames are dense from the segment's base)
//! 0   4  crc32c       of bytes [4, frame_len): everything after this field, padding excluded
//! 4   4  frame_len    bits 0-30: header + body, without padding (u32 LE); bit 31: extras
//! 8   8  timestamp    nanoseconds since the Unix epoch (u64 LE), non-decreasing within a log
//! 16  …  [if extras: u8 flags (bit 0: has headers; bit 1: has key; others 0),
//!         headers block if flag 0: u32 LE length L, then L bytes of entries,
//!         key if flag 1: u16 LE length, then the key]
//!        payload: the rest of frame_len
//! …   …  zero padding to the next multiple of 8
//!
//! format 1 (32-byte header)
//! 0   4  magic        b"PTR1"
//! 4   4  crc32c       of bytes [8, frame_len): everything after this field, padding excluded
//! 8   4  frame_len    header + headers block + key + payload, without padding (u32 LE)
//! 12  2  flags        bit 0: has headers; bit 1: has key; other bits reserved, must be 0
//! 14  2  key_len      (u16 LE, 0 without a key)
//! 16  8  offset       dense record offset (u64 LE)
//! 24  8  timestamp    nanoseconds since the Unix epoch (u64 LE)
//! 32  …  [headers block, if flag 0] [key, if flag 1: key_len bytes] payload
//! …   …  zero padding to the next multiple of 8
//! ```
//!
//! A header entry is `u16 LE name length, name (UTF-8), u32 LE value length, value`.

use crate::error::FrameError;

/// How the frames of a segment are laid out: the segment header's format version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    V1,
    V2,
    /// Frames of format 3 also promised a timestamp at least once in 16 frames, so that a
    /// reader landing on one without could walk back to it; format 4 drops the promise (readers
    /// find a record's time through the dense index, the sparse index, or a walk from the
    /// segment's start) and so leaves out timestamps that only kept it.
    V3,
    /// Frames of format 4 are one record each as far as recovery knows; format 5 marks the
    /// frames of a batch, so that a batch is kept or cut whole.
    V4,
    V5,
}

impl Format {
    /// What the writer writes.
    pub(crate) const CURRENT: Format = Format::V5;

    pub(crate) fn version(self) -> u32 {
        match self {
            Format::V1 => 1,
            Format::V2 => 2,
            Format::V3 => 3,
            Format::V4 => 4,
            Format::V5 => 5,
        }
    }

    pub(crate) fn from_version(version: u32) -> Option<Format> {
        match version {
            1 => Some(Format::V1),
            2 => Some(Format::V2),
            3 => Some(Format::V3),
            4 => Some(Format::V4),
            5 => Some(Format::V5),
            _ => None,
        }
    }

    /// Where in a frame the bytes its CRC covers start (they end at its unpadded length).
    pub(crate) fn checked_from(self) -> usize {
        match self {
            Format::V1 => 8,
            Format::V2 | Format::V3 | Format::V4 | Format::V5 => 4,
        }
    }

    /// The shortest header a frame of this format has.
    pub(crate) fn header_len(self) -> usize {
        match self {
            Format::V1 => V1_HEADER_LEN,
            Format::V2 => V2_HEADER_LEN,
            Format::V3 | Format::V4 | Format::V5 => FRAME_HEADER_LEN,
        }
    }

    /// Whether a frame may leave its timestamp out and take the previous frame's.
    pub(crate) fn inherits_time(self) -> bool {
        matches!(self, Format::V3 | Format::V4 | Format::V5)
    }

    /// Whether its frames say which belong to one batch.
    pub(crate) fn marks_batches(self) -> bool {
        self == Format::V5
    }
}

/// Header bytes of a frame in the current format without its timestamp (a frame with one has
/// `TIMESTAMP_LEN` more).
pub const FRAME_HEADER_LEN: usize = 8;
/// Bytes a timestamp adds to a frame's header in the current format.
pub const TIMESTAMP_LEN: usize = 8;
pub const FRAME_ALIGN: usize = 8;

const V1_MAGIC: [u8; 4] = *b"PTR1";
const V1_HEADER_LEN: usize = 32;
const V2_HEADER_LEN: usize = 16;
/// Formats 2 and 3: bit 31 of the length word says a flags byte starts the body.
const EXTRAS: u32 = 1 << 31;
const V2_LEN_MASK: u32 = !EXTRAS;
/// Format 3: bit 30 of the length word says the header holds a timestamp.
const TIME: u32 = 1 << 30;
const V3_LEN_MASK: u32 = !(EXTRAS | TIME);
/// Format 5: bit 29 of the length word says the next frame is of the same batch.
const CONTINUES: u32 = 1 << 29;
const V5_LEN_MASK: u32 = !(EXTRAS | TIME | CONTINUES);
/// Longest frame the current format can say (its length has 29 bits).
pub const MAX_FRAME_LEN: usize = V5_LEN_MASK as usize;

pub(crate) const FLAG_HEADERS: u8 = 1;
pub(crate) const FLAG_KEY: u8 = 2;
const KNOWN_FLAGS: u8 = FLAG_HEADERS | FLAG_KEY;

/// Largest key a record may carry.
pub const MAX_KEY_LEN: usize = u16::MAX as usize;

/// One header of a record: a name and an opaque value.
pub type Header<'a> = (&'a str, &'a [u8]);

/// What a caller appends: the payload with an optional key, headers and timestamp.
#[derive(Clone, Copy, Debug, Default)]
pub struct Input<'a> {
    pub key: Option<&'a [u8]>,
    pub headers: &'a [Header<'a>],
    pub payload: &'a [u8],
    /// Nanoseconds since the Unix epoch; `None` takes the current time. A timestamp earlier than
    /// the previous record's is raised to it, so time order and offset order agree.
    pub timestamp: Option<u64>,
}

impl<'a> Input<'a> {
    pub fn payload(payload: &'a [u8]) -> Self {
        Input { payload, ..Input::default() }
    }

    fn has_extras(&self) -> bool {
        self.key.is_some() || !self.headers.is_empty()
    }
}

pub(crate) fn align_up(n: usize) -> usize {
    (n + FRAME_ALIGN - 1) & !(FRAME_ALIGN - 1)
}

fn headers_block_len(headers: &[Header<'_>]) -> usize {
    if headers.is_empty() { 0 } else { 4 + headers.iter().map(|(n, v)| 2 + n.len() + 4 + v.len()).sum::<usize>() }
}

/// Unpadded length of the frame `input` encodes to (current format) with its timestamp; without
/// one it is `TIMESTAMP_LEN` shorter.
#[inline]
pub(crate) fn frame_len(input: &Input<'_>) -> usize {
    let header = FRAME_HEADER_LEN + TIMESTAMP_LEN;
    if !input.has_extras() {
        return header + input.payload.len();
    }
    header + 1 + headers_block_len(input.headers) + input.key.map_or(0, |k| 2 + k.len()) + input.payload.len()
}

/// Bytes of `input` that are the record itself (key, headers, payload), for the size limit.
pub(crate) fn record_len(input: &Input<'_>) -> usize {
    headers_block_len(input.headers) + input.key.map_or(0, <[u8]>::len) + input.payload.len()
}

/// Checks what `frame_len` cannot express: a key or header field too long for its length field.
pub(crate) fn check_input(input: &Input<'_>) -> Result<(), FrameError> {
    if input.key.is_some_and(|k| k.len() > MAX_KEY_LEN) {
        return Err(FrameError::KeyTooLong);
    }
    for (name, value) in input.headers {
        if name.len() > u16::MAX as usize || value.len() > u32::MAX as usize {
            return Err(FrameError::HeaderTooLong);
        }
    }
    Ok(())
}

/// Frames up to this length are assembled on the stack and copied into the segment whole.
const SMALL_FRAME: usize = 256;

/// Writes the frame for `input` (current format) at the start of `buf` (which must hold
/// `align_up(len)` bytes and be zero past the frame: segments are zero-filled) and returns the
/// aligned length. `len` is `frame_len(input)` with a timestamp, `TIMESTAMP_LEN` less without
/// (the frame then has the previous frame's). `continues`: the next frame is of the same batch.
#[inline]
pub(crate) fn encode(buf: &mut [u8], len: usize, timestamp: Option<u64>, continues: bool, input: &Input<'_>) -> usize {
    let aligned = align_up(len);
    if aligned <= SMALL_FRAME {
        // Checksumming bytes just stored to mapped memory stalls on store forwarding; a small
        // frame is checksummed where it is built, on the stack.
        let mut frame = [0u8; SMALL_FRAME];
        encode_in_place(&mut frame[..aligned], len, timestamp, continues, input);
        buf[..aligned].copy_from_slice(&frame[..aligned]);
    } else {
        encode_in_place(&mut buf[..aligned], len, timestamp, continues, input);
    }
    aligned
}

#[inline]
fn encode_in_place(buf: &mut [u8], len: usize, timestamp: Option<u64>, continues: bool, input: &Input<'_>) {
    let header = FRAME_HEADER_LEN + timestamp.map_or(0, |_| TIMESTAMP_LEN);
    debug_assert!(len == frame_len(input) - (FRAME_HEADER_LEN + TIMESTAMP_LEN - header));
    assert!(len <= MAX_FRAME_LEN, "a frame's length fits its field (max_record_bytes keeps it so)");
    let mut word = len as u32;
    if continues {
        word |= CONTINUES;
    }
    let mut at = header;
    if let Some(timestamp) = timestamp {
        word |= TIME;
        buf[FRAME_HEADER_LEN..header].copy_from_slice(&timestamp.to_le_bytes());
    }
    if input.has_extras() {
        word |= EXTRAS;
        let flags_at = at;
        let mut flags = 0u8;
        at += 1;
        if !input.headers.is_empty() {
            flags |= FLAG_HEADERS;
            let block = headers_block_len(input.headers);
            buf[at..at + 4].copy_from_slice(&((block - 4) as u32).to_le_bytes());
            at += 4;
            for (name, value) in input.headers {
                buf[at..at + 2].copy_from_slice(&(name.len() as u16).to_le_bytes());
                at += 2;
                buf[at..at + name.len()].copy_from_slice(name.as_bytes());
                at += name.len();
                buf[at..at + 4].copy_from_slice(&(value.len() as u32).to_le_bytes());
                at += 4;
                buf[at..at + value.len()].copy_from_slice(value);
                at += value.len();
            }
        }
        if let Some(key) = input.key {
            flags |= FLAG_KEY;
            buf[at..at + 2].copy_from_slice(&(key.len() as u16).to_le_bytes());
            at += 2;
            buf[at..at + key.len()].copy_from_slice(key);
            at += key.len();
        }
        buf[flags_at] = flags;
    }
    buf[at..len].copy_from_slice(input.payload);
    buf[4..8].copy_from_slice(&word.to_le_bytes());
    let crc = crate::checksum::crc32c(&buf[4..len]);
    buf[0..4].copy_from_slice(&crc.to_le_bytes());
}

/// A record read from the log. Borrows the segment mapping: copying is explicit (`to_owned`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record<'a> {
    pub offset: u64,
    /// Nanoseconds since the Unix epoch.
    pub timestamp: u64,
    pub key: Option<&'a [u8]>,
    pub headers: Headers<'a>,
    pub payload: &'a [u8],
}

impl Record<'_> {
    pub fn to_owned(&self) -> OwnedRecord {
        OwnedRecord {
            offset: self.offset,
            timestamp: self.timestamp,
            key: self.key.map(<[u8]>::to_vec),
            headers: self.headers.iter().map(|(n, v)| (n.to_owned(), v.to_vec())).collect(),
            payload: self.payload.to_vec(),
        }
    }
}

/// A record copied out of the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedRecord {
    pub offset: u64,
    pub timestamp: u64,
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub payload: Vec<u8>,
}

/// The headers of a record, decoded lazily. Validated when the frame was decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Headers<'a> {
    block: &'a [u8],
}

impl<'a> Headers<'a> {
    pub fn is_empty(&self) -> bool {
        self.block.is_empty()
    }

    pub fn iter(&self) -> HeaderIter<'a> {
        HeaderIter { rest: self.block }
    }

    /// The value of the first header called `name`.
    pub fn get(&self, name: &str) -> Option<&'a [u8]> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }
}

pub struct HeaderIter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for HeaderIter<'a> {
    type Item = Header<'a>;

    fn next(&mut self) -> Option<Self::Item> {
        // The block was checked by `validate_headers`, so these reads cannot fail.
        let (entry, rest) = split_header(self.rest).ok()??;
        self.rest = rest;
        Some(entry)
    }
}

/// Splits the first entry off a headers block. `Ok(None)` at the end of the block.
fn split_header(block: &[u8]) -> Result<Option<(Header<'_>, &[u8])>, FrameError> {
    if block.is_empty() {
        return Ok(None);
    }
    let name_len = u16::from_le_bytes(block.get(..2).ok_or(FrameError::BadHeaders)?.try_into().unwrap()) as usize;
    let name = block.get(2..2 + name_len).ok_or(FrameError::BadHeaders)?;
    let name = std::str::from_utf8(name).map_err(|_| FrameError::BadHeaders)?;
    let at = 2 + name_len;
    let value_len =
        u32::from_le_bytes(block.get(at..at + 4).ok_or(FrameError::BadHeaders)?.try_into().unwrap()) as usize;
    let value = block.get(at + 4..at + 4 + value_len).ok_or(FrameError::BadHeaders)?;
    Ok(Some(((name, value), &block[at + 4 + value_len..])))
}

fn validate_headers(block: &[u8]) -> Result<(), FrameError> {
    let mut rest = block;
    while let Some((_, next)) = split_header(rest)? {
        rest = next;
    }
    Ok(())
}

/// What `decode` found at a position.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decoded<'a> {
    /// A whole, checked frame and its aligned length.
    Frame(Record<'a>, usize),
    /// Zero bytes where a frame would start: nothing was ever written here.
    Empty,
}

/// Decodes and checks the frame at the start of `buf`. `max_len` bounds `frame_len`. `offset` is
/// the record expected there: a format-2 or 3 frame takes it (its offset is its place), a format-1
/// frame reports its own, which the caller compares. `prev_timestamp` is the timestamp of the
/// frame before, which a frame of format 3 on without its own takes (callers that cannot know it pass
/// 0 and do not use the record's timestamp, or resolve it with `own_timestamp` walks).
#[inline]
pub(crate) fn decode(
    format: Format,
    buf: &[u8],
    max_len: usize,
    offset: u64,
    prev_timestamp: u64,
) -> Result<Decoded<'_>, FrameError> {
    match format {
        Format::V2 | Format::V3 | Format::V4 | Format::V5 => decode_v2_v3(format, buf, max_len, offset, prev_timestamp),
        Format::V1 => decode_v1(buf, max_len, Checks::All),
    }
}

/// The header of a frame of format 2 on: its unpadded length, whether a flags byte starts its
/// body, where the body starts, its own timestamp if it has one, and (format 5) whether the next
/// frame is of the same batch.
#[derive(Clone, Copy)]
struct Head {
    len: usize,
    extras: bool,
    body: usize,
    timestamp: Option<u64>,
    continues: bool,
}

/// Reads the header of a frame of format 2 on (no CRC); `None` if its length is shorter than
/// its header, or `buf` shorter than the header.
#[inline]
fn head(format: Format, buf: &[u8]) -> Option<Head> {
    let word = u32::from_le_bytes(buf.get(4..8)?.try_into().unwrap());
    let extras = word & EXTRAS != 0;
    let (len, continues) = match format {
        Format::V5 => ((word & V5_LEN_MASK) as usize, word & CONTINUES != 0),
        Format::V3 | Format::V4 => ((word & V3_LEN_MASK) as usize, false),
        _ => ((word & V2_LEN_MASK) as usize, false),
    };
    let body = match format {
        Format::V3 | Format::V4 | Format::V5 if word & TIME != 0 => FRAME_HEADER_LEN + TIMESTAMP_LEN,
        Format::V3 | Format::V4 | Format::V5 => FRAME_HEADER_LEN,
        _ => V2_HEADER_LEN,
    };
    if len < body {
        return None;
    }
    let timestamp = match body > FRAME_HEADER_LEN {
        true => Some(u64::from_le_bytes(buf.get(8..16)?.try_into().unwrap())),
        false => None,
    };
    Some(Head { len, extras, body, timestamp, continues })
}

/// The first 8 bytes (checksum and length word) of the frame at the start of `buf` made the last
/// of its batch, if it says the next frame is of its batch (format 5); `None` otherwise. For
/// frames already checked: what `repair` keeps before the place it cuts the log is then whole.
pub(crate) fn ending_batch(format: Format, buf: &[u8]) -> Option<[u8; 8]> {
    let head = head(format, buf).filter(|h| h.continues && h.len <= buf.len())?;
    let word = u32::from_le_bytes(buf[4..8].try_into().unwrap()) & !CONTINUES;
    let mut checked = buf[4..head.len].to_vec();
    checked[..4].copy_from_slice(&word.to_le_bytes());
    let mut first = [0u8; 8];
    first[..4].copy_from_slice(&crate::checksum::crc32c(&checked).to_le_bytes());
    first[4..].copy_from_slice(&word.to_le_bytes());
    Some(first)
}

/// Whether the frame at the start of `buf` says the next frame is of its batch (format 5; never
/// in earlier formats). Reads the header only, no CRC: for frames already checked.
#[inline]
pub(crate) fn continues_batch(format: Format, buf: &[u8]) -> bool {
    format.marks_batches() && head(format, buf).is_some_and(|h| h.continues)
}

#[inline]
fn decode_v2_v3(
    format: Format,
    buf: &[u8],
    max_len: usize,
    offset: u64,
    prev_timestamp: u64,
) -> Result<Decoded<'_>, FrameError> {
    let Some(header) = buf.get(..format.header_len()) else {
        return if buf.iter().all(|&b| b == 0) { Ok(Decoded::Empty) } else { Err(FrameError::Truncated) };
    };
    if header[0..8] == [0; 8] {
        return Ok(Decoded::Empty);
    }
    let crc = u32::from_le_bytes(header[0..4].try_into().unwrap());
    let Some(head) = head(format, buf).filter(|h| h.len <= max_len) else {
        return Err(FrameError::BadLength);
    };
    // The padding too must be in `buf`, so that stepping over the frame stays inside it.
    if align_up(head.len) > buf.len() {
        return Err(FrameError::Truncated);
    }
    let frame = &buf[..head.len];
    if crate::checksum::crc32c(&frame[4..]) != crc {
        return Err(FrameError::BadChecksum);
    }
    let (key, headers, payload) = body(&frame[head.body..], head.extras, Checks::All)?;
    let timestamp = head.timestamp.unwrap_or(prev_timestamp);
    Ok(Decoded::Frame(Record { offset, timestamp, key, headers, payload }, align_up(head.len)))
}

/// A record's key, headers and payload.
type Body<'a> = (Option<&'a [u8]>, Headers<'a>, &'a [u8]);

/// Splits a format-2 or 3 body into key, headers and payload.
#[inline]
fn body(mut rest: &[u8], extras: bool, checks: Checks) -> Result<Body<'_>, FrameError> {
    let (mut key, mut headers) = (None, Headers::default());
    if extras {
        let (&flags, after) = rest.split_first().ok_or(FrameError::BadLength)?;
        if flags & !KNOWN_FLAGS != 0 {
            return Err(FrameError::UnknownFlags);
        }
        rest = after;
        if flags & FLAG_HEADERS != 0 {
            let block_len =
                u32::from_le_bytes(rest.get(..4).ok_or(FrameError::BadHeaders)?.try_into().unwrap()) as usize;
            let block = rest.get(4..4 + block_len).ok_or(FrameError::BadHeaders)?;
            if checks == Checks::All {
                validate_headers(block)?;
            }
            headers = Headers { block };
            rest = &rest[4 + block_len..];
        }
        if flags & FLAG_KEY != 0 {
            let key_len = u16::from_le_bytes(rest.get(..2).ok_or(FrameError::BadLength)?.try_into().unwrap()) as usize;
            key = Some(rest.get(2..2 + key_len).ok_or(FrameError::BadLength)?);
            rest = &rest[2 + key_len..];
        }
    }
    Ok((key, headers, rest))
}

/// What a decoder checks: everything, or only what reading the fields needs (a frame a reader
/// has already checked).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Checks {
    All,
    Layout,
}

fn decode_v1(buf: &[u8], max_len: usize, checks: Checks) -> Result<Decoded<'_>, FrameError> {
    let Some(head) = buf.get(..V1_HEADER_LEN) else {
        return if buf.iter().all(|&b| b == 0) { Ok(Decoded::Empty) } else { Err(FrameError::Truncated) };
    };
    if head[0..4] != V1_MAGIC {
        return if head[0..8] == [0; 8] { Ok(Decoded::Empty) } else { Err(FrameError::BadMagic) };
    }
    let crc = u32::from_le_bytes(head[4..8].try_into().unwrap());
    let len = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
    if len < V1_HEADER_LEN || len > max_len {
        return Err(FrameError::BadLength);
    }
    if align_up(len) > buf.len() {
        return Err(FrameError::Truncated);
    }
    let frame = &buf[..len];
    if checks == Checks::All && crate::checksum::crc32c(&frame[8..]) != crc {
        return Err(FrameError::BadChecksum);
    }
    let flags = u16::from_le_bytes(head[12..14].try_into().unwrap());
    if flags & !(KNOWN_FLAGS as u16) != 0 {
        return Err(FrameError::UnknownFlags);
    }
    let key_len = u16::from_le_bytes(head[14..16].try_into().unwrap()) as usize;
    let offset = u64::from_le_bytes(head[16..24].try_into().unwrap());
    let timestamp = u64::from_le_bytes(head[24..32].try_into().unwrap());
    let mut rest = &frame[V1_HEADER_LEN..];
    let mut headers = Headers::default();
    if flags & FLAG_HEADERS as u16 != 0 {
        let block_len = u32::from_le_bytes(rest.get(..4).ok_or(FrameError::BadHeaders)?.try_into().unwrap()) as usize;
        let block = rest.get(4..4 + block_len).ok_or(FrameError::BadHeaders)?;
        if checks == Checks::All {
            validate_headers(block)?;
        }
        headers = Headers { block };
        rest = &rest[4 + block_len..];
    }
    let key = if flags & FLAG_KEY as u16 != 0 {
        let key = rest.get(..key_len).ok_or(FrameError::BadLength)?;
        rest = &rest[key_len..];
        Some(key)
    } else if key_len != 0 {
        return Err(FrameError::BadLength);
    } else {
        None
    };
    Ok(Decoded::Frame(Record { offset, timestamp, key, headers, payload: rest }, align_up(len)))
}

/// A position where a frame may start, judged cheaply (no CRC): what the search for a valid frame
/// after a damaged one checks before checksumming.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// The claimed frame length, without padding; it fits in the bytes searched.
    pub len: usize,
    /// The CRC32C stored in the frame.
    pub crc: u32,
}

/// The frame of `format` that may start at the start of `buf`. A format-1 frame starts with its
/// magic, and its length must fit in `buf`. A format-2 or 3 frame has no magic: its length must fit,
/// the padding after it be zero and its flags byte, if it says it has one, known, which in random bytes about one position in 64 passes in a
/// 256 MiB segment (the length fits one time in 8; in a segment of 2 GiB or more, every time).
pub(crate) fn may_start(format: Format, buf: &[u8]) -> Option<Candidate> {
    let u32_at = |at: usize| Some(u32::from_le_bytes(buf.get(at..at + 4)?.try_into().unwrap()));
    match format {
        Format::V1 if buf.get(..4) != Some(&V1_MAGIC[..]) => None,
        Format::V1 => {
            let candidate = Candidate { len: u32_at(8)? as usize, crc: u32_at(4)? };
            (candidate.len >= V1_HEADER_LEN && candidate.len <= buf.len()).then_some(candidate)
        }
        Format::V2 | Format::V3 | Format::V4 | Format::V5 => {
            let head = head(format, buf)?;
            let candidate = Candidate { len: head.len, crc: u32_at(0)? };
            let padding = buf.get(candidate.len..align_up(candidate.len).min(buf.len()))?;
            // A flags byte, if the frame has one, inside it and with known flags only.
            let flags_known = !head.extras || (head.body < head.len && buf[head.body] & !KNOWN_FLAGS == 0);
            (flags_known && padding.iter().all(|&b| b == 0)).then_some(candidate)
        }
    }
}

/// Aligned length of the frame at the start of `buf`, judged by its length field (and, in
/// format 1, its magic) only, no CRC: for skipping over frames already known to be valid.
#[inline]
pub(crate) fn peek_len(format: Format, buf: &[u8]) -> Option<usize> {
    let len = match format {
        Format::V1 => {
            let head = buf.get(..V1_HEADER_LEN)?;
            if head[0..4] != V1_MAGIC {
                return None;
            }
            let len = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
            (len >= V1_HEADER_LEN).then_some(len)?
        }
        _ => head(format, buf)?.len,
    };
    (align_up(len) <= buf.len()).then(|| align_up(len))
}

/// Key of the frame at the start of `buf` (`None` without one), judged without the CRC.
pub(crate) fn peek_key(format: Format, buf: &[u8]) -> Option<&[u8]> {
    let len = peek_len(format, buf)?;
    match format {
        Format::V2 | Format::V3 | Format::V4 | Format::V5 => {
            let head = head(format, buf)?;
            let flags = *buf.get(head.body).filter(|_| head.extras)?;
            if flags & FLAG_KEY == 0 {
                return None;
            }
            let mut at = head.body + 1;
            if flags & FLAG_HEADERS != 0 {
                at += 4 + u32::from_le_bytes(buf.get(at..at + 4)?.try_into().unwrap()) as usize;
            }
            let key_len = u16::from_le_bytes(buf.get(at..at + 2)?.try_into().unwrap()) as usize;
            buf[..len].get(at + 2..at + 2 + key_len)
        }
        Format::V1 => {
            let flags = u16::from_le_bytes(buf[12..14].try_into().unwrap());
            if flags & FLAG_KEY as u16 == 0 {
                return None;
            }
            let key_len = u16::from_le_bytes(buf[14..16].try_into().unwrap()) as usize;
            let mut start = V1_HEADER_LEN;
            if flags & FLAG_HEADERS as u16 != 0 {
                start += 4 + u32::from_le_bytes(buf.get(start..start + 4)?.try_into().unwrap()) as usize;
            }
            buf.get(start..start + key_len)
        }
    }
}

/// Timestamp of the frame at the start of `buf`, judged by its length field (and, in format 1,
/// its magic) only (no CRC): its own, or `prev` (the frame before's) if it has none.
#[inline]
pub(crate) fn peek_timestamp(format: Format, buf: &[u8], prev: u64) -> Option<u64> {
    peek_len(format, buf)?;
    Some(own_timestamp(format, buf).unwrap_or(prev))
}

/// The timestamp the frame at the start of `buf` holds itself (every frame of formats 1 and 2;
/// `None` for a frame of format 3 on that takes the previous frame's, or if `buf` is too short). Reads
/// the header only, no CRC: for frames that were checked or whose length `peek_len` accepted.
#[inline]
pub(crate) fn own_timestamp(format: Format, buf: &[u8]) -> Option<u64> {
    match format {
        Format::V1 => Some(u64::from_le_bytes(buf.get(24..32)?.try_into().unwrap())),
        Format::V2 | Format::V3 | Format::V4 | Format::V5 => head(format, buf)?.timestamp,
    }
}

/// Decodes a frame that `decode` has already accepted (as record `offset`, after a frame of time
/// `prev_timestamp`), skipping the checks.
///
/// Panics (never undefined behaviour) if the bytes are not such a frame.
#[inline]
pub(crate) fn decode_checked_frame(
    format: Format,
    buf: &[u8],
    offset: u64,
    prev_timestamp: u64,
) -> (Record<'_>, usize) {
    if format == Format::V1 {
        return match decode_v1(buf, buf.len(), Checks::Layout) {
            Ok(Decoded::Frame(record, len)) => (record, len),
            _ => panic!("a frame that was checked no longer decodes"),
        };
    }
    let head = head(format, buf).expect("a frame that was checked no longer decodes");
    let (key, headers, payload) = body(&buf[head.body..head.len], head.extras, Checks::Layout)
        .expect("a frame that was checked no longer decodes");
    let timestamp = head.timestamp.unwrap_or(prev_timestamp);
    (Record { offset, timestamp, key, headers, payload }, align_up(head.len))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frame for `input`, with its own `timestamp` or (`None`) taking the previous frame's.
    fn encoded(input: &Input<'_>, timestamp: Option<u64>) -> (Vec<u8>, usize) {
        let len = frame_len(input) - timestamp.map_or(TIMESTAMP_LEN, |_| 0);
        let mut buf = vec![0u8; align_up(len) + 8];
        let aligned = encode(&mut buf, len, timestamp, false, input);
        buf.truncate(aligned + 8);
        (buf, len)
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
    }

    fn roundtrip(input: Input<'_>) {
        for own in [Some(7), None] {
            let (buf, len) = encoded(&input, own);
            let aligned = align_up(len);
            let Decoded::Frame(rec, n) = decode(Format::CURRENT, &buf, 1 << 20, 42, 5).unwrap() else {
                panic!("empty")
            };
            assert_eq!(n, aligned);
            assert_eq!((rec.offset, rec.timestamp), (42, own.unwrap_or(5)));
            assert_eq!(rec.key, input.key);
            assert_eq!(rec.payload, input.payload);
            assert_eq!(rec.headers.iter().collect::<Vec<_>>(), input.headers.to_vec());
            assert_eq!(decode_checked_frame(Format::CURRENT, &buf, 42, 5), (rec, n));
            assert_eq!(peek_len(Format::CURRENT, &buf), Some(aligned));
            assert_eq!(peek_key(Format::CURRENT, &buf), input.key);
            assert_eq!(peek_timestamp(Format::CURRENT, &buf, 5), Some(own.unwrap_or(5)));
            assert_eq!(own_timestamp(Format::CURRENT, &buf), own);
            assert_eq!(
                may_start(Format::CURRENT, &buf),
                Some(Candidate { len, crc: u32::from_le_bytes(buf[..4].try_into().unwrap()) })
            );
            assert_eq!(decode(Format::CURRENT, &buf[aligned..], 1 << 20, 43, 5).unwrap(), Decoded::Empty);
        }
    }

    #[test]
    fn encodes_and_decodes_every_shape() {
        roundtrip(Input::payload(b""));
        roundtrip(Input::payload(b"hello"));
        roundtrip(Input { key: Some(b""), ..Input::payload(b"x") });
        roundtrip(Input { key: Some(b"k1"), ..Input::payload(b"") });
        roundtrip(Input { headers: &[("a", b"1")], ..Input::payload(b"p") });
        roundtrip(Input { key: Some(b"k1"), headers: &[("a", b"1"), ("", b"")], payload: b"pp", timestamp: None });
    }

    #[test]
    fn a_small_record_costs_eight_bytes_of_header_when_the_time_has_not_moved() {
        assert_eq!(align_up(frame_len(&Input::payload(&[0; 32])) - TIMESTAMP_LEN), 40);
        assert_eq!(align_up(frame_len(&Input::payload(&[0; 32]))), 48);
        assert_eq!(align_up(frame_len(&Input::payload(&[0; 8])) - TIMESTAMP_LEN), 16);
    }

    #[test]
    fn the_documented_examples_are_exact() {
        let input = Input::payload(b"hello");
        let mut buf = [0u8; 24];
        assert_eq!(encode(&mut buf, frame_len(&input), Some(1_700_000_000_000_000_000), false, &input), 24);
        assert_eq!(hex(&buf), "4b c3 7a 1c 15 00 00 40 00 00 2a 36 fe 9c 97 17 68 65 6c 6c 6f 00 00 00");
        let mut buf = [0u8; 16];
        assert_eq!(encode(&mut buf, frame_len(&input) - TIMESTAMP_LEN, None, false, &input), 16);
        assert_eq!(hex(&buf), "36 43 64 f6 0d 00 00 00 68 65 6c 6c 6f 00 00 00");
        // The first of a batch of two (bit 29: the next frame is of its batch), then its last.
        let mut buf = [0u8; 24];
        assert_eq!(encode(&mut buf, frame_len(&input), Some(1_700_000_000_000_000_000), true, &input), 24);
        assert_eq!(hex(&buf), "e1 31 2b b8 15 00 00 60 00 00 2a 36 fe 9c 97 17 68 65 6c 6c 6f 00 00 00");
        assert!(continues_batch(Format::V5, &buf));
        let Decoded::Frame(rec, 24) = decode(Format::V5, &buf, 1 << 20, 3, 0).unwrap() else { panic!("not whole") };
        assert_eq!((rec.payload, rec.timestamp), (&b"hello"[..], 1_700_000_000_000_000_000));
        // Made the last of its batch, it is the frame written as one.
        let mut last = buf;
        last[..8].copy_from_slice(&ending_batch(Format::V5, &buf).unwrap());
        let mut alone = [0u8; 24];
        encode(&mut alone, frame_len(&input), Some(1_700_000_000_000_000_000), false, &input);
        assert_eq!(last, alone);
        assert_eq!(ending_batch(Format::V5, &alone), None);
        // Read as version 4, whose length has 30 bits, it claims 512 MiB more than it holds.
        assert_eq!(decode(Format::V4, &buf, 1 << 30, 3, 0), Err(FrameError::Truncated));
    }

    #[test]
    fn format_two_frames_still_decode() {
        // The example of format 2 in docs/format.md: "hello".
        let hex = "ee 50 35 51 15 00 00 00 00 00 2a 36 fe 9c 97 17 68 65 6c 6c 6f 00 00 00";
        let buf: Vec<u8> = hex.split_whitespace().map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
        let Decoded::Frame(rec, n) = decode(Format::V2, &buf, 1 << 20, 5, 0).unwrap() else { panic!("empty") };
        assert_eq!((rec.offset, rec.timestamp, rec.payload, n), (5, 1_700_000_000_000_000_000, &b"hello"[..], 24));
        assert_eq!(decode_checked_frame(Format::V2, &buf, 5, 0), (rec, n));
        assert_eq!(own_timestamp(Format::V2, &buf), Some(1_700_000_000_000_000_000));
        assert_eq!(peek_len(Format::V2, &buf), Some(24));
        // Read as format 3 it is another frame (no timestamp bit): its CRC covers the same
        // bytes, so only the segment header's version tells them apart.
        let mut bad = buf.clone();
        bad[20] ^= 1;
        assert_eq!(decode(Format::V2, &bad, 1 << 20, 5, 0), Err(FrameError::BadChecksum));
    }

    #[test]
    fn format_one_frames_still_decode() {
        // The example of format 1 in docs/format.md: record 5, "hello".
        let hex = "50 54 52 31 cd ee ba 80 25 00 00 00 00 00 00 00 05 00 00 00 00 00 00 00 \
                   00 00 2a 36 fe 9c 97 17 68 65 6c 6c 6f 00 00 00";
        let buf: Vec<u8> = hex.split_whitespace().map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
        let Decoded::Frame(rec, n) = decode(Format::V1, &buf, 1 << 20, 0, 0).unwrap() else { panic!("empty") };
        assert_eq!((rec.offset, rec.timestamp, rec.payload, n), (5, 1_700_000_000_000_000_000, &b"hello"[..], 40));
        assert_eq!(decode_checked_frame(Format::V1, &buf, 0, 0), (rec, n));
        let mut bad = buf.clone();
        bad[33] ^= 1;
        assert_eq!(decode(Format::V1, &bad, 1 << 20, 0, 0), Err(FrameError::BadChecksum));
    }

    #[test]
    fn every_single_byte_flip_is_detected() {
        let input = Input { key: Some(b"key"), headers: &[("h", b"v")], payload: b"payload!", timestamp: None };
        for own in [Some(9), None] {
            let (buf, len) = encoded(&input, own);
            for i in 0..len {
                for bit in 0..8 {
                    let mut bad = buf.clone();
                    bad[i] ^= 1 << bit;
                    let decoded = decode(Format::CURRENT, &bad, 1 << 20, 9, 0);
                    assert!(decoded.is_err(), "flip of byte {i} bit {bit} went unnoticed");
                }
            }
        }
    }

    #[test]
    fn every_truncation_is_detected() {
        let input = Input::payload(&[7u8; 100]);
        for own in [Some(1), None] {
            let (buf, len) = encoded(&input, own);
            for cut in 1..len {
                let mut torn = buf.clone();
                torn[cut..].fill(0);
                assert!(decode(Format::CURRENT, &torn, 1 << 20, 1, 0).is_err(), "zeroed from {cut} went unnoticed");
                assert!(decode(Format::CURRENT, &buf[..cut], 1 << 20, 1, 0).is_err(), "cut at {cut} went unnoticed");
            }
        }
    }

    #[test]
    fn oversized_length_is_rejected_before_reading() {
        let input = Input::payload(&[1u8; 64]);
        let (buf, _) = encoded(&input, Some(1));
        assert_eq!(decode(Format::CURRENT, &buf, 40, 1, 0), Err(FrameError::BadLength));
    }
}
