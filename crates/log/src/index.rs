//! The sparse index of a segment: one entry per `INDEX_STEP` bytes of frames, giving the offset,
//! position and timestamp of the first frame starting in that stretch. Finding any offset, or the
//! first record at or after a time, is a binary search plus a walk over less than `INDEX_STEP`
//! bytes of frame headers — never a scan of the segment.
//!
//! Kept in memory; written to `index/<base>.idx` when a segment is sealed, read back on open, and
//! rebuilt from the frames whenever the file is missing or damaged. It is never the only copy of
//! anything.
//!
//! ```text
//! index file, little-endian:
//! 0   4  magic       b"PIDX"
//! 4   4  version     1
//! 8   8  base offset of the segment
//! 16  4  entries     N
//! 20  4  crc32c      of the N entries
//! 24  …  N × { u64 offset, u32 position, u32 reserved (0), u64 timestamp }
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};

use crate::frame::{self, Format};
use crate::mmap::SEGMENT_HEADER_LEN;

/// Bytes of frames between index entries: a time lookup walks at most this far over frame
/// headers (about 400 small frames, under a microsecond), and the index files take 24 bytes per
/// 16 KiB (0.15 % of the log; at 4 KiB, their 0.6 % was most of what a log of small records took
/// beyond its frames).
pub(crate) const INDEX_STEP: usize = 16 << 10;
pub(crate) const INDEX_DIR: &str = "index";
const MAGIC: [u8; 4] = *b"PIDX";
const FILE_HEADER: usize = 24;
const ENTRY_LEN: usize = 24;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub offset: u64,
    pub pos: u32,
    pub timestamp: u64,
}

#[derive(Default)]
pub(crate) struct SparseIndex {
    /// `None` until built (sealed segments are indexed on first use).
    entries: RwLock<Option<Vec<Entry>>>,
}

impl SparseIndex {
    pub(crate) fn ready(entries: Vec<Entry>) -> SparseIndex {
        SparseIndex { entries: RwLock::new(Some(entries)) }
    }

    pub(crate) fn is_built(&self) -> bool {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Adds an entry (the writer, in order).
    pub(crate) fn push(&self, entry: Entry) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        entries.get_or_insert_with(Vec::new).push(entry);
    }

    pub(crate) fn set(&self, built: Vec<Entry>) {
        *self.entries.write().unwrap_or_else(|e| e.into_inner()) = Some(built);
    }

    /// The last entry at or before `offset`.
    pub(crate) fn at_or_before(&self, offset: u64) -> Option<Entry> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let entries = entries.as_ref()?;
        let i = entries.partition_point(|e| e.offset <= offset);
        i.checked_sub(1).map(|i| entries[i])
    }

    /// The stretch that holds the first record at or after time `t`: the last entry with a
    /// timestamp before `t`, and the offset of the entry after it (that record's, at the latest),
    /// each if there is one.
    pub(crate) fn stretch_before_time(&self, t: u64) -> (Option<Entry>, Option<u64>) {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let Some(entries) = entries.as_ref() else { return (None, None) };
        let i = entries.partition_point(|e| e.timestamp < t);
        (i.checked_sub(1).map(|i| entries[i]), entries.get(i).map(|e| e.offset))
    }

    /// Forgets the entries (a sealed segment giving back memory); `ensure_index` reloads them.
    pub(crate) fn unload(&self) {
        *self.entries.write().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Drops entries for records at or after `offset` (a batch that was not published).
    pub(crate) fn truncate_from(&self, offset: u64) {
        if let Some(entries) = self.entries.write().unwrap_or_else(|e| e.into_inner()).as_mut() {
            entries.retain(|e| e.offset < offset);
        }
    }

    pub(crate) fn entries(&self) -> Vec<Entry> {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default()
    }
}

/// What a walk over a segment's frame headers built, and where it stopped.
pub(crate) struct Walk {
    pub entries: Vec<Entry>,
    /// Position (relative to `SEGMENT_HEADER_LEN`) where no further frame header was found.
    pub end: usize,
    /// The record after the last frame walked.
    pub next_offset: u64,
}

/// Builds the entries for the frames in `data` (a segment's published bytes from `SEGMENT_HEADER_LEN`),
/// starting at record `base`, walking frame headers only.
pub(crate) fn build(format: Format, data: &[u8], base: u64) -> Walk {
    let mut entries = Vec::with_capacity(data.len() / INDEX_STEP + 1);
    let mut at = 0;
    let mut offset = base;
    let mut next_entry = 0;
    let mut timestamp = 0;
    while let (Some(len), Some(time)) =
        (frame::peek_len(format, &data[at..]), frame::peek_timestamp(format, &data[at..], timestamp))
    {
        timestamp = time;
        if at >= next_entry {
            entries.push(Entry { offset, pos: (SEGMENT_HEADER_LEN + at) as u32, timestamp });
            next_entry = at + INDEX_STEP;
        }
        at += len;
        offset += 1;
    }
    Walk { entries, end: at, next_offset: offset }
}

pub(crate) fn file_path(dir: &Path, base: u64) -> PathBuf {
    dir.join(INDEX_DIR).join(format!("{base:020}.idx"))
}

/// Writes the index file of segment `base` (temporary file, rename). Best effort: the index can
/// always be rebuilt, so a failure is only logged.
pub(crate) fn save(dir: &Path, base: u64, entries: &[Entry]) {
    let path = file_path(dir, base);
    let tmp = path.with_extension("idx.tmp");
    let result = std::fs::create_dir_all(dir.join(INDEX_DIR))
        .and_then(|()| std::fs::write(&tmp, encode(base, entries)))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = result {
        tracing::warn!(file = %path.display(), error = %e, "could not write index file; it will be rebuilt");
    }
}

/// Removes the index file of segment `base`, if any; whether there was one.
pub(crate) fn remove(dir: &Path, base: u64) -> bool {
    std::fs::remove_file(file_path(dir, base)).is_ok()
}

pub(crate) fn encode(base: u64, entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FILE_HEADER + entries.len() * ENTRY_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&base.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    for e in entries {
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.pos.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&e.timestamp.to_le_bytes());
    }
    let crc = crate::checksum::crc32c(&out[FILE_HEADER..]);
    out[20..24].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Entries from an index file, if it is whole, belongs to `base`, and is consistent with a
/// segment of `segment_len` bytes.
pub(crate) fn decode(bytes: &[u8], base: u64, segment_len: usize) -> Option<Vec<Entry>> {
    let head = bytes.get(..FILE_HEADER)?;
    let n = u32::from_le_bytes(head[16..20].try_into().unwrap()) as usize;
    let body = bytes.get(FILE_HEADER..FILE_HEADER + n * ENTRY_LEN)?;
    let ok = head[0..4] == MAGIC
        && u32::from_le_bytes(head[4..8].try_into().unwrap()) == 1
        && u64::from_le_bytes(head[8..16].try_into().unwrap()) == base
        && crate::checksum::crc32c(body) == u32::from_le_bytes(head[20..24].try_into().unwrap());
    if !ok {
        return None;
    }
    let entries: Vec<Entry> = body
        .chunks_exact(ENTRY_LEN)
        .map(|c| Entry {
            offset: u64::from_le_bytes(c[0..8].try_into().unwrap()),
            pos: u32::from_le_bytes(c[8..12].try_into().unwrap()),
            timestamp: u64::from_le_bytes(c[16..24].try_into().unwrap()),
        })
        .collect();
    let sane = entries
        .iter()
        .all(|e| e.offset >= base && (e.pos as usize) >= SEGMENT_HEADER_LEN && (e.pos as usize) < segment_len)
        && entries
            .windows(2)
            .all(|w| w[0].offset < w[1].offset && w[0].pos < w[1].pos && w[0].timestamp <= w[1].timestamp);
    sane.then_some(entries)
}

/// Records per time group: the dense index keeps the time of every group's first record, in
/// the cache line that holds the group's positions (8 bytes of time and 14 × 4 of positions).
pub(crate) const TIME_GROUP: usize = 14;

/// Groups per chunk of a dense index: 4 KiB, so a log with few records (one of thousands of
/// queue logs) holds a page for them, not a segment's worth. The first chunk's records are
/// split further: its first `FIRST_GROUPS` groups are a chunk of their own (256 bytes, for a
/// queue that holds a few messages at a time), the rest of it the next.
const CHUNK_GROUPS: usize = 64;
const CHUNK: usize = CHUNK_GROUPS * TIME_GROUP;
const FIRST_GROUPS: usize = 4;
const FIRST: usize = FIRST_GROUPS * TIME_GROUP;

/// The chunk that holds the `i`-th record, and the record's place in it. (Chunks start on
/// group boundaries, so a record's place in its group is `i % TIME_GROUP` in any chunk.)
#[inline]
fn chunk_of(i: usize) -> (usize, usize) {
    if i < FIRST {
        (0, i)
    } else if i < CHUNK {
        (1, i - FIRST)
    } else {
        (i / CHUNK + 1, i % CHUNK)
    }
}

/// Groups of the `c`-th chunk.
fn groups_in(c: usize) -> usize {
    match c {
        0 => FIRST_GROUPS,
        1 => CHUNK_GROUPS - FIRST_GROUPS,
        _ => CHUNK_GROUPS,
    }
}

/// The bit of a dense index entry that says its frame holds its own timestamp.
const TIME_BIT: u32 = 1;
const _: () = assert!(frame::FRAME_ALIGN > TIME_BIT as usize);

/// One group of a dense index, one cache line: the time of its first record and the positions
/// of its records, so that a random read misses the cache (and the TLB) once for both.
#[repr(C, align(64))]
#[derive(Default)]
struct Group {
    time: AtomicU64,
    positions: [AtomicU32; TIME_GROUP],
}
const _: () = assert!(std::mem::size_of::<Group>() == 64);

/// One chunk of a dense index: the groups of its records (`chunk_of`).
struct Chunk {
    groups: Box<[Group]>,
}

impl Chunk {
    fn new(groups: usize) -> Chunk {
        Chunk { groups: (0..groups).map(|_| Group::default()).collect() }
    }

    /// The position entry of the chunk's `r`-th record.
    #[inline]
    fn position(&self, r: usize) -> &AtomicU32 {
        &self.groups[r / TIME_GROUP].positions[r % TIME_GROUP]
    }
}

/// Where a record's timestamp is, as far as the dense index knows (`DenseIndex::time_of`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TimeOf {
    /// This is it: no frame since its group's first holds a timestamp of its own.
    Known(u64),
    /// The frame at this position holds it (possibly the record's own).
    HeldAt(usize),
    /// The record is not in the index.
    Unknown,
}

/// The position of every record of a segment, for random access in one step. Filled by the
/// writer as it appends (the active segment) or by one walk over the frames on first use (a
/// sealed segment). Lives in memory only: rebuilding it is a sequential walk of frame headers.
/// Chunks are allocated as records arrive, so memory follows the records, not the segment size.
///
/// Frames start on `FRAME_ALIGN` boundaries, so an entry's low bit is free: it is set when the
/// frame holds its own timestamp. A frame of format 3 on without one takes the time of the nearest
/// frame before it that has one. To find that time without reading frames, the index also
/// keeps the time of every `TIME_GROUP`-th record (in the same line): a record whose group
/// has no frame holding a time between its first and the record takes that group's time;
/// otherwise the marked frame, found among entries in the looked-up one's cache line, holds it.
///
/// Only entries of the segment's published records are to be trusted: past them are the
/// writer's next ones, or those of a batch it discarded (`Log::discard_unpublished`).
pub(crate) struct DenseIndex {
    chunks: Box<[OnceLock<Chunk>]>,
    built: OnceLock<()>,
}

impl DenseIndex {
    /// An index for a segment of `segment_len` bytes (no frame is shorter than its header).
    pub(crate) fn new(segment_len: usize, format: Format) -> DenseIndex {
        let records = segment_len / format.header_len() + 1;
        DenseIndex {
            chunks: (0..=chunk_of(records - 1).0).map(|_| Default::default()).collect(),
            built: Default::default(),
        }
    }

    /// Records the position of the `i`-th record, whether its frame holds its own timestamp,
    /// and its time (the writer, before publishing it).
    #[inline]
    pub(crate) fn set(&self, i: usize, pos: usize, holds_time: bool, time: u64) {
        debug_assert!(pos.is_multiple_of(frame::FRAME_ALIGN) && pos > 0 && pos <= u32::MAX as usize);
        let (c, r) = chunk_of(i);
        let chunk = self.chunks[c].get_or_init(|| Chunk::new(groups_in(c)));
        if i.is_multiple_of(TIME_GROUP) {
            chunk.groups[r / TIME_GROUP].time.store(time, Ordering::Relaxed);
        }
        chunk.position(r).store(pos as u32 | holds_time as u32, Ordering::Relaxed);
    }

    /// The `i`-th entry as stored (0 = unknown).
    #[inline]
    fn entry(&self, i: usize) -> u32 {
        let (c, r) = chunk_of(i);
        match self.chunks.get(c).and_then(|c| c.get()) {
            Some(chunk) => chunk.position(r).load(Ordering::Relaxed),
            None => 0,
        }
    }

    /// Position of the `i`-th record, if known.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<usize> {
        let entry = self.entry(i);
        (entry != 0).then_some((entry & !TIME_BIT) as usize)
    }

    /// Where the `i`-th record's timestamp is.
    #[inline]
    pub(crate) fn time_of(&self, i: usize) -> TimeOf {
        let (c, r) = chunk_of(i);
        let Some(chunk) = self.chunks.get(c).and_then(|c| c.get()) else { return TimeOf::Unknown };
        // Records are set in order: with the `i`-th, its group's first and that one's time are.
        if chunk.position(r).load(Ordering::Relaxed) == 0 {
            return TimeOf::Unknown;
        }
        let first = r / TIME_GROUP * TIME_GROUP;
        for j in (first + 1..=r).rev() {
            let entry = chunk.position(j).load(Ordering::Relaxed);
            if entry & TIME_BIT != 0 {
                return TimeOf::HeldAt((entry & !TIME_BIT) as usize);
            }
        }
        TimeOf::Known(chunk.groups[r / TIME_GROUP].time.load(Ordering::Relaxed))
    }

    /// Starts loading what `get(i)` and `time_of(i)` read into the cache (see
    /// `Reader::get_many`).
    #[inline]
    pub(crate) fn prefetch(&self, i: usize) {
        let (c, r) = chunk_of(i);
        if let Some(chunk) = self.chunks.get(c).and_then(|c| c.get()) {
            crate::mmap::prefetch(&chunk.groups[r / TIME_GROUP]);
        }
    }

    /// Fills the index from the frames in `data` (a segment's published bytes from
    /// `SEGMENT_HEADER_LEN`), once.
    pub(crate) fn build_once(&self, format: Format, data: &[u8]) {
        self.built.get_or_init(|| {
            let (mut at, mut i, mut time) = (0, 0, 0);
            while let Some(len) = frame::peek_len(format, &data[at..]) {
                let own = frame::own_timestamp(format, &data[at..]);
                time = own.unwrap_or(time);
                self.set(i, SEGMENT_HEADER_LEN + at, own.is_some(), time);
                at += len;
                i += 1;
            }
        });
    }

    /// Whether the index holds every published record (`build_once` ran, or the writer fills it).
    pub(crate) fn is_built(&self) -> bool {
        self.built.get().is_some()
    }

    /// Marks the index as complete (the writer maintains it from here on).
    pub(crate) fn mark_built(&self) {
        let _ = self.built.set(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_index_knows_where_each_time_is() {
        const G: usize = TIME_GROUP;
        let index = DenseIndex::new(1 << 20, Format::CURRENT);
        // Record i at 64 + 40 i; records 0, 5, 2G, FIRST + 3 and CHUNK + 6 hold their own time, i + 100
        // for record i; the others take the time before them.
        let holds = |i: usize| [0, 5, 2 * G, FIRST + 3, CHUNK + 6].contains(&i);
        let mut time = 0;
        for i in 0..CHUNK + 40 {
            if holds(i) {
                time = i as u64 + 100;
            }
            index.set(i, SEGMENT_HEADER_LEN + 40 * i, holds(i), time);
        }
        let pos = |i: usize| SEGMENT_HEADER_LEN + 40 * i;
        assert_eq!(index.get(5), Some(pos(5)), "the mark is not part of the position");
        assert_eq!(index.time_of(0), TimeOf::Known(100), "a group's first record: its group's time");
        assert_eq!(index.time_of(4), TimeOf::Known(100));
        assert_eq!(index.time_of(5), TimeOf::HeldAt(pos(5)), "a frame that holds one holds its own");
        assert_eq!(index.time_of(G - 1), TimeOf::HeldAt(pos(5)), "after a holder inside the group");
        assert_eq!(index.time_of(G), TimeOf::Known(105), "a time carried into the next group");
        assert_eq!(index.time_of(2 * G), TimeOf::Known(2 * G as u64 + 100));
        assert_eq!(index.time_of(3 * G + 3), TimeOf::Known(2 * G as u64 + 100));
        assert_eq!(index.time_of(FIRST + 2), TimeOf::Known(2 * G as u64 + 100), "across the first chunk");
        assert_eq!(index.time_of(FIRST + 4), TimeOf::HeldAt(pos(FIRST + 3)));
        assert_eq!(index.time_of(CHUNK + 5), TimeOf::Known(FIRST as u64 + 103), "across a chunk");
        assert_eq!(index.time_of(CHUNK + 7), TimeOf::HeldAt(pos(CHUNK + 6)));
        assert_eq!(index.time_of(CHUNK + G), TimeOf::Known(CHUNK as u64 + 106));
        assert_eq!(index.time_of(CHUNK + 40), TimeOf::Unknown, "past the records");
        assert_eq!(index.time_of(5 * CHUNK), TimeOf::Unknown, "past the chunks");
        // Every record against a model: the latest frame holding a time since its group's
        // first, else its group's first record's time (in every chunk, the small first ones
        // included).
        let times: Vec<u64> = (0..CHUNK + 40)
            .scan(0, |t, i| {
                *t = if holds(i) { i as u64 + 100 } else { *t };
                Some(*t)
            })
            .collect();
        for i in 0..CHUNK + 40 {
            let first = i / G * G;
            let expected = match (first + 1..=i).rev().find(|&j| holds(j)) {
                Some(j) => TimeOf::HeldAt(pos(j)),
                None => TimeOf::Known(times[first]),
            };
            assert_eq!(index.time_of(i), expected, "record {i}");
            assert_eq!(index.get(i), Some(pos(i)), "record {i}");
        }
        assert_eq!(chunk_of(FIRST - 1), (0, FIRST - 1));
        assert_eq!(chunk_of(FIRST), (1, 0));
        assert_eq!(chunk_of(CHUNK - 1), (1, CHUNK - FIRST - 1));
        assert_eq!(chunk_of(CHUNK), (2, 0));
        assert_eq!(chunk_of(3 * CHUNK + 5), (4, 5));
    }

    #[test]
    fn files_round_trip_and_damage_is_refused() {
        let entries = vec![Entry { offset: 10, pos: 64, timestamp: 5 }, Entry { offset: 80, pos: 4200, timestamp: 9 }];
        let bytes = encode(10, &entries);
        assert_eq!(decode(&bytes, 10, 1 << 16), Some(entries));
        assert_eq!(decode(&bytes, 11, 1 << 16), None, "another segment's index");
        assert_eq!(decode(&bytes, 10, 4000), None, "positions past the segment");
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert_eq!(decode(&bad, 10, 1 << 16), None, "byte {i}");
        }
        assert_eq!(decode(&bytes[..bytes.len() - 1], 10, 1 << 16), None);
    }
}
