//! How a durable queue or topic stores a message as a `petrel-log` record, and the id ↔ offset
//! mapping. The message itself is `petrel_proto::Message`: one model from the wire to the log
//! (the memcache protocol maps onto it too).

use bytes::Bytes;
use petrel_log::{Input, Record, SharedLog};
pub use petrel_proto::{Message, MessageKind, Status};

/// The bytes a message takes in a protocol's answer, at most: its native encoding and a fixed
/// part for what an answer adds around it (a delivery handle, a memcache `VALUE` line). For
/// fitting answers into frames.
pub fn answer_len_bound(m: &Message) -> u64 {
    m.encoded_len() as u64 + 64
}

// A stored message is a log record: the payload is the payload, the timestamp is the log's, the
// offset gives the id, the idempotency key is the record's key, and every other field that is
// set becomes a record header. Names are short; user headers are prefixed with "h.".
const KIND: &str = "k";
const STATUS: &str = "st";
const EXPIRES: &str = "x";
const REQUEST_ID: &str = "r";
const SUBJECT: &str = "s";
const DESTINATION: &str = "d";
const REPLY_TO: &str = "rt";
const MIMETYPE: &str = "m";
const CHARSET: &str = "c";
/// Where builds before the key became the record's key kept it (still read).
const IDEMPOTENCY_KEY: &str = "ik";
const DELIVER_AT: &str = "da";
/// In a durable queue's delayed log, a message record's time is when it is due, not when it was
/// offered (a released message takes the time it joins its level, so the offer's time is not
/// needed): that saves the `da` header, most of what a delayed offer cost beyond a plain one.
/// The log keeps its records' times in order, so a message due before the record before it
/// still has `da` (its record's time is then the later one); and a record that holds the
/// queue's idempotency key says when the key was stored in `ka`, for the window's time. Builds
/// before this one wrote `da` on every delayed record, its time the offer's: read the same.
const KEY_STORED_AT: &str = "ka";
const USER: &str = "h.";

// Where a durable queue's message moves between its logs (a delayed one to its level's log when
// due, a returned one to the delayed log), the new record is a copy, and says so: its key is
// stored as the header "ikm" (only the record an offer stored has a key, the one the queue
// remembers), and it names the record it was copied from, so that a crash between the copy and
// the mark that the original moved never hands a message out twice. A delayed record keeps its priority level
// and the deliveries it had so far.
const MOVED_KEY: &str = "ikm";
const PRIORITY: &str = "p";
const DELIVERIES: &str = "dv";
const MOVED_FROM: &str = "dm";
const RETURNED_FROM: &str = "rf";

// A durable queue's log also holds control records, which are not messages: a "returned" marker
// says that the message at the offset it names came back from a delivery (aborted, timed out,
// its consumer gone), so that a message's delivery count survives a restart. The count is read
// back by scanning the unacknowledged part of the log on open (markers always follow the
// message they name). A control record has no payload and one header.
const RETURNED: &str = "ctl.returned";
// In a durable queue's delayed log, a "moved" marker lists the offsets of delayed messages that
// were copied to their level's log (or dropped by a flush): they are done here.
const MOVED: &str = "ctl.moved";
// In a durable queue's delayed log, a "released" marker says that delayed messages came due and
// joined a priority level where they are: handed out from the delayed log itself, each placed
// after the level's records before `after` (its log's end then), timed `stamp`. They stay in
// the delayed log until done (a `moved` marker: acknowledged, dead-lettered, expired, dropped).
// The value: level (1 byte), after (8), stamp (8), then runs of offsets as start (8), count (4).
const RELEASED: &str = "ctl.released";

/// Appends a marker: the message at log offset `of` came back from a delivery. Not synced:
/// like the queue's cursor it survives a process crash, and the next sync covers it.
pub(crate) fn append_returned(log: &SharedLog, of: u64) -> petrel_log::Result<u64> {
    let value = of.to_be_bytes();
    let headers = [(RETURNED, &value[..])];
    // No time of its own (the log gives it its previous record's): the records' times stay the
    // times their messages were offered.
    let input = Input { key: None, headers: &headers, payload: &[], timestamp: Some(0) };
    Ok(log.append_batch_unsynced(&[input])?.start)
}

/// What a `moved` marker's record takes besides its offsets (8 bytes each), at most: the frame,
/// its header block and the header's name, with room to spare.
pub(crate) const MARKER_OVERHEAD_BYTES: usize = 256;

/// Appends a marker to a durable queue's delayed log: the delayed messages at `offsets` are
/// done there. Not synced (see `append_returned`).
pub(crate) fn append_moved(log: &SharedLog, offsets: &[u64]) -> petrel_log::Result<u64> {
    let value: Vec<u8> = offsets.iter().flat_map(|o| o.to_be_bytes()).collect();
    let headers = [(MOVED, &value[..])];
    let input = Input { key: None, headers: &headers, payload: &[], timestamp: Some(0) };
    Ok(log.append_batch_unsynced(&[input])?.start)
}

/// What a `released` marker says: the delayed messages in `runs` (start, count) joined `level`
/// after its log's offset `after`.
pub(crate) struct Release<'a> {
    pub level: u8,
    pub after: u64,
    pub runs: &'a [(u64, u32)],
}

/// Appends a marker per release to a durable queue's delayed log, together or not at all, each
/// timed `stamp`, when the messages joined their levels. Not synced (see `append_returned`): lost
/// to a crash, they come due again on open and are released again.
pub(crate) fn append_released(
    log: &SharedLog,
    stamp: u64,
    releases: &[Release<'_>],
) -> petrel_log::Result<std::ops::Range<u64>> {
    let values: Vec<Vec<u8>> = releases
        .iter()
        .map(|Release { level, after, runs }| {
            let mut value = Vec::with_capacity(17 + runs.len() * 12);
            value.push(*level);
            value.extend_from_slice(&after.to_be_bytes());
            value.extend_from_slice(&stamp.to_be_bytes());
            for (start, count) in runs.iter() {
                value.extend_from_slice(&start.to_be_bytes());
                value.extend_from_slice(&count.to_be_bytes());
            }
            value
        })
        .collect();
    let headers: Vec<[(&str, &[u8]); 1]> = values.iter().map(|v| [(RELEASED, &v[..])]).collect();
    // Timed as its messages joined their level (or later: a due time before it), and `stamp`
    // kept in its value, which a restart reads so that the queue's offers after it are timed
    // later.
    let inputs: Vec<Input<'_>> =
        headers.iter().map(|h| Input { key: None, headers: h, payload: &[], timestamp: Some(stamp) }).collect();
    log.append_batch_unsynced(&inputs)
}

/// For a control record, what it says; `None` for a message.
pub(crate) fn control(r: &Record<'_>) -> Option<Control> {
    let (name, value) = r.headers.iter().next()?;
    if !r.payload.is_empty() {
        return None;
    }
    match name {
        RETURNED => Some(Control::Returned(u64::from_be_bytes(value.try_into().ok()?))),
        MOVED if value.len() % 8 == 0 => Some(Control::Moved(
            value.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes"))).collect(),
        )),
        RELEASED if value.len() >= 17 && (value.len() - 17) % 12 == 0 => {
            let number = |b: &[u8]| u64::from_be_bytes(b.try_into().expect("8 bytes"));
            let runs = value[17..]
                .chunks_exact(12)
                .map(|c| (number(&c[..8]), u32::from_be_bytes(c[8..].try_into().expect("4 bytes"))))
                .collect();
            Some(Control::Released { level: value[0], after: number(&value[1..9]), stamp: number(&value[9..17]), runs })
        }
        _ => None,
    }
}

/// A control record of a durable queue's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Control {
    /// The message at this offset came back from a delivery.
    Returned(u64),
    /// The delayed messages at these offsets are done (moved, or flushed).
    Moved(Vec<u64>),
    /// The delayed messages in these runs (start, count) joined `level` after its log's offset
    /// `after`, at time `stamp`.
    Released { level: u8, after: u64, stamp: u64, runs: Vec<(u64, u32)> },
}

/// What a record of a durable queue says beyond its message: where a delayed message goes, and
/// what a copy was copied from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Placement {
    /// The priority level a delayed message goes to when due.
    pub priority: u8,
    /// Deliveries the message had before it was copied (a returned one).
    pub deliveries: u32,
    /// A copy: its key is not one the queue remembers from this record.
    pub copy: bool,
    /// In a level's log: the delayed log's offset it was moved from.
    pub moved_from: Option<u64>,
    /// In the delayed log: the queue id of the level's record it was returned from.
    pub returned_from: Option<u64>,
}

/// The placement `r` records.
pub(crate) fn placement(r: &Record<'_>) -> Placement {
    let mut p = Placement::default();
    for (name, value) in r.headers.iter() {
        let number = || value.try_into().map(u64::from_be_bytes).ok();
        match name {
            PRIORITY => p.priority = value.first().copied().unwrap_or(0),
            DELIVERIES => p.deliveries = value.try_into().map(u32::from_be_bytes).unwrap_or(0),
            MOVED_KEY => p.copy = true,
            MOVED_FROM => p.moved_from = number(),
            RETURNED_FROM => p.returned_from = number(),
            _ => {}
        }
    }
    p
}

/// When the message that the delayed log's record `r` holds is due, without decoding the rest:
/// its `da` header, else its time (`KEY_STORED_AT`).
pub(crate) fn due_at(r: &Record<'_>) -> u64 {
    r.headers.get(DELIVER_AT).and_then(|v| v.try_into().ok()).map_or(r.timestamp, u64::from_be_bytes)
}

/// When the idempotency key that the delayed log's record `r` holds was stored: its `ka`
/// header, else (an older build's record) its time.
pub(crate) fn key_stored_at(r: &Record<'_>) -> u64 {
    r.headers.get(KEY_STORED_AT).and_then(|v| v.try_into().ok()).map_or(r.timestamp, u64::from_be_bytes)
}

/// The message that the delayed log's record `r` holds, its `deliver_at` set. Its time is the
/// record's, which is not when it was offered (`KEY_STORED_AT`): a caller gives it the time it
/// joined its level.
pub(crate) fn from_delayed_record(r: &Record<'_>) -> Message {
    Message { deliver_at: due_at(r), ..from_record(r) }
}

/// One header of a record being written: a fixed name, or `h.` + a message header's name; a
/// value borrowed from the message, or a number held here. Nothing is allocated for a message
/// without headers of its own.
struct RecordHeader<'m> {
    name: std::borrow::Cow<'m, str>,
    value: HeaderValue<'m>,
}

enum HeaderValue<'m> {
    Borrowed(&'m [u8]),
    /// Big-endian, in the last `len` bytes.
    Number {
        bytes: [u8; 8],
        len: usize,
    },
}

impl<'m> RecordHeader<'m> {
    fn fixed(name: &'static str, value: HeaderValue<'m>) -> Self {
        RecordHeader { name: name.into(), value }
    }
}

impl HeaderValue<'_> {
    fn u8(v: u8) -> Self {
        HeaderValue::Number { bytes: u64::from(v).to_be_bytes(), len: 1 }
    }

    fn u32(v: u32) -> Self {
        HeaderValue::Number { bytes: u64::from(v).to_be_bytes(), len: 4 }
    }

    fn u64(v: u64) -> Self {
        HeaderValue::Number { bytes: v.to_be_bytes(), len: 8 }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            HeaderValue::Borrowed(b) => b,
            HeaderValue::Number { bytes, len } => &bytes[8 - len..],
        }
    }
}

/// Adds the record headers that store `m`'s fields (all but the payload, id and timestamp) to
/// `out`; its `deliver_at` only if `with_due` (see `KEY_STORED_AT` for when it is not).
fn record_headers<'m>(m: &'m Message, with_due: bool, out: &mut Vec<RecordHeader<'m>>) {
    if m.kind != MessageKind::Message {
        out.push(RecordHeader::fixed(KIND, HeaderValue::u8(m.kind as u8)));
    }
    if m.status != Status::Ok {
        out.push(RecordHeader::fixed(STATUS, HeaderValue::u8(m.status as u8)));
    }
    if m.expires_at != 0 {
        out.push(RecordHeader::fixed(EXPIRES, HeaderValue::u64(m.expires_at)));
    }
    if with_due && m.deliver_at != 0 {
        out.push(RecordHeader::fixed(DELIVER_AT, HeaderValue::u64(m.deliver_at)));
    }
    for (name, value) in [
        (REQUEST_ID, &m.request_id),
        (SUBJECT, &m.subject),
        (DESTINATION, &m.destination),
        (REPLY_TO, &m.reply_to),
        (MIMETYPE, &m.mimetype),
        (CHARSET, &m.charset),
    ] {
        if !value.is_empty() {
            out.push(RecordHeader::fixed(name, HeaderValue::Borrowed(value.as_bytes())));
        }
    }
    for (name, value) in &m.headers {
        out.push(RecordHeader { name: format!("{USER}{name}").into(), value: HeaderValue::Borrowed(value) });
    }
}

/// Appends `messages` to `log` without waiting for the disk (see `SharedLog::wait_durable`).
pub(crate) fn append_unsynced(log: &SharedLog, messages: &[Message]) -> petrel_log::Result<std::ops::Range<u64>> {
    append_placed(log, messages, &[])
}

/// `append_unsynced`, each message with its placement (none: as `append_unsynced`).
pub(crate) fn append_placed(
    log: &SharedLog,
    messages: &[Message],
    placements: &[Placement],
) -> petrel_log::Result<std::ops::Range<u64>> {
    append_records(log, messages, placements, None)
}

/// Appends delayed `messages` (each with its `deliver_at` set) to a durable queue's delayed log
/// `log`, with their placements, each record timed when it is due (`KEY_STORED_AT`), without
/// waiting for the disk. `time_floor`: the time of the log's last record, or later (the log
/// makes no record's time earlier than it), raised to the records' times here.
pub(crate) fn append_delayed(
    log: &SharedLog,
    messages: &[Message],
    placements: &[Placement],
    time_floor: &mut u64,
) -> petrel_log::Result<std::ops::Range<u64>> {
    debug_assert_eq!(placements.len(), messages.len(), "one placement per delayed message");
    append_records(log, messages, placements, Some(time_floor))
}

/// `append_placed`, or `append_delayed` with its `time_floor`.
fn append_records(
    log: &SharedLog,
    messages: &[Message],
    placements: &[Placement],
    mut time_floor: Option<&mut u64>,
) -> petrel_log::Result<std::ops::Range<u64>> {
    debug_assert!(placements.is_empty() || placements.len() == messages.len(), "one placement per message");
    // Every message's headers in one list; message i's are `owned[starts[i]..starts[i + 1]]`.
    let mut owned: Vec<RecordHeader<'_>> = Vec::new();
    let mut starts = Vec::with_capacity(messages.len() + 1);
    for (i, m) in messages.iter().enumerate() {
        starts.push(owned.len());
        let p = placements.get(i);
        let keeps_key = !m.idempotency_key.is_empty() && !p.is_some_and(|p| p.copy);
        let with_due = match time_floor.as_deref_mut() {
            None => true,
            Some(floor) => {
                // Its record's time is when it is due: 0 would make it due at the log's last time.
                assert!(m.deliver_at != 0, "a delayed message says when it is due");
                // (Raised before the append: should it fail part way, the floor is still no
                // lower than the log's last time.)
                let earlier = m.deliver_at < *floor;
                *floor = (*floor).max(m.deliver_at);
                if keeps_key {
                    owned.push(RecordHeader::fixed(KEY_STORED_AT, HeaderValue::u64(m.timestamp)));
                }
                earlier
            }
        };
        record_headers(m, with_due, &mut owned);
        let Some(p) = p else { continue };
        if p.copy && !m.idempotency_key.is_empty() {
            owned.push(RecordHeader::fixed(MOVED_KEY, HeaderValue::Borrowed(m.idempotency_key.as_bytes())));
        }
        if p.priority != 0 {
            owned.push(RecordHeader::fixed(PRIORITY, HeaderValue::u8(p.priority)));
        }
        if p.deliveries != 0 {
            owned.push(RecordHeader::fixed(DELIVERIES, HeaderValue::u32(p.deliveries)));
        }
        for (name, value) in [(MOVED_FROM, p.moved_from), (RETURNED_FROM, p.returned_from)] {
            if let Some(v) = value {
                owned.push(RecordHeader::fixed(name, HeaderValue::u64(v)));
            }
        }
    }
    starts.push(owned.len());
    let views: Vec<(&str, &[u8])> = owned.iter().map(|h| (h.name.as_ref(), h.value.bytes())).collect();
    let delayed = time_floor.is_some();
    let inputs: Vec<Input<'_>> = messages
        .iter()
        .enumerate()
        // In a level's log the record's time is the message's (when it was offered), as in a
        // queue in memory; the log keeps its records' times in order whatever it is given.
        .map(|(i, m)| Input {
            key: (!m.idempotency_key.is_empty() && !placements.get(i).is_some_and(|p| p.copy))
                .then_some(m.idempotency_key.as_bytes()),
            headers: &views[starts[i]..starts[i + 1]],
            payload: &m.payload,
            timestamp: match delayed {
                true => Some(m.deliver_at),
                false => (m.timestamp != 0).then_some(m.timestamp),
            },
        })
        .collect();
    log.append_batch_unsynced(&inputs)
}

/// Delayed records come due, copied for their levels' logs as they are stored: their headers
/// and payload bytes are never decoded into a `Message` (a due message costs a copy of its
/// bytes, not a struct, a string per field and a second encoding). Each copy's placement is
/// what `append_placed` gives a copy: its key renamed, its deliveries kept, the delayed log's
/// offset it came from named.
#[derive(Debug, Default)]
pub(crate) struct DueCopies {
    /// Every copy's header names and values and payload, one after another.
    bytes: Vec<u8>,
    /// (name, value) of each header, as ranges of `bytes`; copy i's are `headers[copies[i].headers]`.
    headers: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>,
    copies: Vec<DueCopy>,
}

#[derive(Debug)]
pub(crate) struct DueCopy {
    /// The level whose log the copy goes to.
    pub level: usize,
    headers: std::ops::Range<usize>,
    payload: std::ops::Range<usize>,
}

impl DueCopies {
    pub fn copies(&self) -> &[DueCopy] {
        &self.copies
    }

    /// The bytes held for the copies.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }

    fn push_bytes(&mut self, b: &[u8]) -> std::ops::Range<usize> {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(b);
        start..self.bytes.len()
    }

    fn push_header(&mut self, name: &str, value: &[u8]) {
        let name = self.push_bytes(name.as_bytes());
        let value = self.push_bytes(value);
        self.headers.push((name, value));
    }

    /// Adds a copy of the delayed log's record `r`, for the level its placement names (at most
    /// `top`).
    pub fn add(&mut self, r: &Record<'_>, top: usize) {
        let first = self.headers.len();
        let (mut level, mut deliveries) = (0, 0);
        for (name, value) in r.headers.iter() {
            let name = match name {
                // The copy's time is when it joined its level: its due time is a header there,
                // and its key is not the queue's to remember.
                DELIVER_AT | KEY_STORED_AT => continue,
                // Placement: what the copy keeps is written below, the rest is the delayed log's.
                PRIORITY => {
                    level = usize::from(value.first().copied().unwrap_or(0)).min(top);
                    continue;
                }
                DELIVERIES => {
                    deliveries = value.try_into().map(u32::from_be_bytes).unwrap_or(0);
                    continue;
                }
                MOVED_FROM | RETURNED_FROM => continue,
                IDEMPOTENCY_KEY => MOVED_KEY, // (an older build's record)
                name => name,
            };
            self.push_header(name, value);
        }
        self.push_header(DELIVER_AT, &due_at(r).to_be_bytes());
        if deliveries != 0 {
            self.push_header(DELIVERIES, &deliveries.to_be_bytes());
        }
        if let Some(key) = r.key {
            self.push_header(MOVED_KEY, key);
        }
        self.push_header(MOVED_FROM, &r.offset.to_be_bytes());
        let payload = self.push_bytes(r.payload);
        self.copies.push(DueCopy { level, headers: first..self.headers.len(), payload });
    }

    /// Appends the copies for `level` to `log`, in the order they were added, each with the time
    /// `stamp` (a due message joins its level as an offer would).
    pub fn append(&self, log: &SharedLog, level: usize, stamp: u64) -> petrel_log::Result<std::ops::Range<u64>> {
        let name = |r: &std::ops::Range<usize>| {
            std::str::from_utf8(&self.bytes[r.clone()]).expect("copied from a record's header name, which is UTF-8")
        };
        // The headers of this level's copies only, each copy's a range of `views`.
        let of_level: Vec<&DueCopy> = self.copies.iter().filter(|c| c.level == level).collect();
        let mut views: Vec<(&str, &[u8])> = Vec::new();
        let mut spans = Vec::with_capacity(of_level.len());
        for c in &of_level {
            let start = views.len();
            views.extend(self.headers[c.headers.clone()].iter().map(|(n, v)| (name(n), &self.bytes[v.clone()])));
            spans.push(start..views.len());
        }
        let inputs: Vec<Input<'_>> = of_level
            .iter()
            .zip(spans)
            .map(|(c, span)| Input {
                key: None,
                headers: &views[span],
                payload: &self.bytes[c.payload.clone()],
                timestamp: Some(stamp),
            })
            .collect();
        if inputs.is_empty() {
            return Ok(log.next_offset()..log.next_offset());
        }
        log.append_batch_unsynced(&inputs)
    }
}

/// When the message stored in `r` expires (0: never), without decoding the rest.
pub(crate) fn expires_at(r: &Record<'_>) -> u64 {
    r.headers
        .iter()
        .find(|(name, _)| *name == EXPIRES)
        .and_then(|(_, v)| v.try_into().ok())
        .map_or(0, u64::from_be_bytes)
}

/// The id of the message stored at log offset `offset`: ids start at 1, so that 0 can mean
/// "none" on the wire. The one place this mapping is written (see `offset_of`).
pub fn id_of(offset: u64) -> u64 {
    offset + 1
}

/// Bits of a durable queue's message id below its priority level.
const LEVEL_SHIFT: u32 = 56;

/// The id of the message stored at `offset` of a durable queue's log for priority `level`: the
/// level in the top byte, so that ids are unique across a queue's logs (and level 0's are
/// `id_of`'s, as in a queue without levels).
pub(crate) fn queue_id(level: usize, offset: u64) -> u64 {
    debug_assert!(offset < 1 << LEVEL_SHIFT, "a queue's log holds fewer than 2^56 records");
    ((level as u64) << LEVEL_SHIFT) | id_of(offset)
}

/// The top byte of the ids of a durable queue's delayed messages (in its delayed log).
pub(crate) const DELAYED_TAG: usize = 0xFF;

/// The priority level and log offset of a durable queue's message `id` (`None` for 0).
pub(crate) fn queue_position(id: u64) -> Option<(usize, u64)> {
    let level = (id >> LEVEL_SHIFT) as usize;
    offset_of(id & ((1 << LEVEL_SHIFT) - 1)).map(|offset| (level, offset))
}

/// The idempotency key stored in `r` (not a copy's), without decoding the rest.
pub(crate) fn idempotency_key<'a>(r: &Record<'a>) -> Option<&'a [u8]> {
    r.key.or_else(|| r.headers.get(IDEMPOTENCY_KEY))
}

/// The log offset of the message with id `id` (`None` for 0, which no message has).
pub fn offset_of(id: u64) -> Option<u64> {
    id.checked_sub(1)
}

/// `from_record(r).size()` without making the message (its payload copied, a `String` a field):
/// what a record's message counts in its queue's bytes, for a drop, an expiry or a restart's
/// count of every record.
pub(crate) fn record_size(r: &Record<'_>) -> u64 {
    // As `from_record` reads them: bytes that are not UTF-8 replaced, the last of a field kept.
    let text = |v: &[u8]| String::from_utf8_lossy(v).len();
    let mut texts = [0usize; Message::TEXT_FIELDS];
    texts[0] = r.key.map_or(0, text);
    let mut headers = 0;
    for (name, value) in r.headers.iter() {
        let field = match name {
            IDEMPOTENCY_KEY | MOVED_KEY => 0,
            REQUEST_ID => 1,
            SUBJECT => 2,
            DESTINATION => 3,
            REPLY_TO => 4,
            MIMETYPE => 5,
            CHARSET => 6,
            other => {
                if let Some(user) = other.strip_prefix(USER) {
                    headers += user.len() + value.len() + petrel_proto::HEADER_SIZE;
                }
                continue;
            }
        };
        texts[field] = text(value);
    }
    (r.payload.len() + texts.iter().sum::<usize>() + headers) as u64
}

/// The message stored in `r`, with its id. `durable` is not stored: it asks, on the way in, for
/// the disk before the answer, and a delivery does not carry it. A kind or status byte this
/// version does not know (a newer one wrote it) reads as the default.
pub(crate) fn from_record(r: &Record<'_>) -> Message {
    let mut m = Message {
        id: id_of(r.offset),
        timestamp: r.timestamp,
        payload: Bytes::copy_from_slice(r.payload),
        ..Message::default()
    };
    let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
    if let Some(key) = r.key {
        m.idempotency_key = String::from_utf8_lossy(key).into();
    }
    for (name, value) in r.headers.iter() {
        match name {
            KIND => m.kind = value.first().and_then(|&k| MessageKind::from_u8(k).ok()).unwrap_or_default(),
            STATUS => m.status = value.first().and_then(|&s| Status::from_u8(s).ok()).unwrap_or_default(),
            EXPIRES => m.expires_at = value.try_into().map(u64::from_be_bytes).unwrap_or(0),
            REQUEST_ID => m.request_id = text(value),
            SUBJECT => m.subject = text(value),
            DESTINATION => m.destination = text(value),
            REPLY_TO => m.reply_to = text(value),
            MIMETYPE => m.mimetype = text(value),
            CHARSET => m.charset = text(value),
            IDEMPOTENCY_KEY | MOVED_KEY => m.idempotency_key = String::from_utf8_lossy(value).into(),
            DELIVER_AT => m.deliver_at = value.try_into().map(u64::from_be_bytes).unwrap_or(0),
            other => {
                if let Some(user) = other.strip_prefix(USER) {
                    m.headers.push((user.to_owned(), Bytes::copy_from_slice(value)));
                }
            }
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `record_size` is what the message read back counts, whatever fields it has: a queue's
    /// bytes are added by the message and taken off by the record.
    #[test]
    fn a_record_s_size_is_its_message_s() {
        let dir = tempfile::tempdir().unwrap();
        let log = petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let full = Message {
            request_id: "r-1".into(),
            subject: "sub".into(),
            destination: "dest".into(),
            reply_to: "reply".into(),
            mimetype: "text/plain".into(),
            charset: "utf-8".into(),
            idempotency_key: "key-1".into(),
            expires_at: 77,
            deliver_at: 88,
            headers: vec![("a".into(), Bytes::from_static(b"1")), ("bb".into(), Bytes::from_static(&[0xFF, 0]))],
            ..Message::new(&b"payload"[..])
        };
        let messages = [Message::new(&b""[..]), Message::new(vec![7u8; 5000]), full.clone(), full];
        let placements = [
            Placement::default(),
            Placement { priority: 2, deliveries: 3, ..Placement::default() },
            Placement::default(),
            // A copy: its key is a header, not the record's key.
            Placement { copy: true, moved_from: Some(5), ..Placement::default() },
        ];
        let range = append_placed(&log, &messages, &placements).unwrap();
        let mut reader = log.reader();
        for (offset, m) in range.zip(&messages) {
            let r = reader.get(offset).unwrap().unwrap();
            assert_eq!(record_size(&r), from_record(&r).size(), "offset {offset}");
            assert_eq!(record_size(&r), m.size(), "offset {offset}");
        }
        // Records this version does not write, read as `from_record` reads them: bytes that are
        // not UTF-8, a key and a key header (the last wins), a field twice, an empty user header
        // name, a kind and a status, a control record.
        let odd: [&[(&str, &[u8])]; 4] = [
            &[(REQUEST_ID, &[0xFF, 0xFE, b'a']), (SUBJECT, b"one"), (SUBJECT, b"three"), (USER, b"v")],
            &[(MOVED_KEY, b"k22"), (KIND, &[200]), (STATUS, &[1])],
            &[(IDEMPOTENCY_KEY, &[0xC3]), (MOVED_KEY, b"k333"), ("h.h.x", b"yz")],
            &[(RETURNED, b"")],
        ];
        for headers in odd {
            for key in [None, Some(&b"k1"[..])] {
                let input = Input { key, headers, payload: b"p", timestamp: None };
                let offset = log.append_batch_unsynced(&[input]).unwrap().start;
                let r = reader.get(offset).unwrap().unwrap();
                assert_eq!(record_size(&r), from_record(&r).size(), "{headers:?} {key:?}");
            }
        }
    }
}
