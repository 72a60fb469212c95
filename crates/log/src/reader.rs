//! Reading records: sequentially, in batches, or by offset. Records borrow the segment mapping.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::error::corrupt;
use crate::error::{Reason, Result};
use crate::frame::{self, Decoded, Format, Record};
use crate::index::TimeOf;
use crate::mmap::SEGMENT_HEADER_LEN;
use crate::segment::Segment;
use crate::state::LogState;

/// A cursor over the log that sees only complete, published records. Independent of the writer
/// and of other readers; move it to any thread.
pub struct Reader {
    shared: Arc<LogState>,
    /// Segment holding `next`, once located.
    seg: Option<Arc<Segment>>,
    /// The dense position index of `seg`, once a seek needed it.
    positions: Option<Arc<crate::index::DenseIndex>>,
    /// Base offset of the segment after `seg` when it was located (`u64::MAX` if none).
    seg_end: u64,
    /// Position of record `next` in `seg`.
    pos: usize,
    next: u64,
    /// Timestamp of the record before `next` in `seg`, once known: what a frame without its own
    /// (format 3 on) takes.
    time: Option<u64>,
}

impl Reader {
    pub(crate) fn new(shared: Arc<LogState>) -> Reader {
        let next = shared.first_offset();
        Reader { shared, seg: None, positions: None, seg_end: u64::MAX, pos: 0, next, time: None }
    }

    /// Offset of the record the next read returns.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// Offset of the oldest record in the log.
    pub fn first_offset(&self) -> u64 {
        self.shared.first_offset()
    }

    /// One past the newest published record.
    pub fn end_offset(&self) -> u64 {
        self.shared.next_offset()
    }

    /// Moves to `offset` (to the oldest record if it is older, to the end if it is newer).
    pub fn seek(&mut self, offset: u64) {
        let offset = offset.clamp(self.first_offset(), self.end_offset());
        if offset == self.next && self.seg.is_some() {
            return;
        }
        self.next = offset;
        // Within the current segment's records, the dense index gives the position with no lock
        // taken. While the segment was active when entered (`seg_end` unknown), only its
        // published ones: past them the index's entries may be a discarded batch's (a failed
        // roll), and the record may be in a later segment.
        if let Some(seg) = &self.seg
            && offset >= seg.base
            && offset < if self.seg_end != u64::MAX { self.seg_end } else { seg.base + seg.tail().1 }
            && let Some(pos) = self.positions.get_or_insert_with(|| seg.positions()).get((offset - seg.base) as usize)
        {
            self.pos = pos;
            self.time = None;
            return;
        }
        self.leave();
    }

    /// Positions the reader in `seg`, counting it as a user of that segment's pages.
    fn enter(&mut self, seg: Arc<Segment>) {
        self.leave();
        seg.users.fetch_add(1, Ordering::AcqRel);
        // `seg_end` is set before entering: a segment with a successor is sealed.
        if self.seg_end != u64::MAX {
            self.shared.options().page_budget.touch(&seg, crate::resident::Use::Sealed);
        }
        self.seg = Some(seg);
    }

    fn leave(&mut self) {
        self.positions = None;
        self.time = None;
        if let Some(seg) = self.seg.take() {
            seg.users.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The next record, or `None` at the end of the log.
    pub fn read_next(&mut self) -> Result<Option<Record<'_>>> {
        Ok(self.read_batch(1)?.into_iter().next())
    }

    /// The record at `offset`, or `None` if it is not in the log. Leaves the reader after it.
    pub fn get(&mut self, offset: u64) -> Result<Option<Record<'_>>> {
        if offset < self.first_offset() || offset >= self.end_offset() {
            return Ok(None);
        }
        self.seek(offset);
        // Retention may have taken it since the look above (the seek then lands on the new first
        // record): that other record is not the one asked for.
        Ok(self.read_next()?.filter(|r| r.offset == offset))
    }

    /// The records at `offsets`, each passed to `found` with its index in `offsets`, in that
    /// order; offsets not in the log are skipped. For random offsets in a log larger than the
    /// CPU's caches this is several times faster than a `get` per offset: each lookup is two
    /// cache misses in a row (its position in the dense index, then its frame), and here the
    /// lookups ahead have theirs in flight while the current one is checked. Every frame is
    /// checked (CRC, offset) as `get` does. The reader's position does not move.
    pub fn get_many(&mut self, offsets: &[u64], mut found: impl FnMut(usize, Record<'_>)) -> Result<()> {
        self.shared.check_poison()?;
        let (first, end) = (self.first_offset(), self.end_offset());
        let segments: Vec<Arc<Segment>> = self.shared.segments().clone();
        let mut indexes: Vec<Option<Arc<crate::index::DenseIndex>>> = vec![None; segments.len()];
        let budget = &self.shared.options().page_budget;
        // The dense index of segment `s`, built on first use (and its pages counted as used).
        fn index_of<'a>(
            indexes: &'a mut [Option<Arc<crate::index::DenseIndex>>],
            segments: &[Arc<Segment>],
            budget: &crate::resident::PageBudget,
            s: usize,
        ) -> &'a crate::index::DenseIndex {
            indexes[s].get_or_insert_with(|| {
                if s + 1 < segments.len() {
                    budget.touch(&segments[s], crate::resident::Use::Sealed);
                }
                segments[s].positions()
            })
        }
        let segment_of = |offset: u64| -> Option<usize> {
            if offset < first || offset >= end {
                return None;
            }
            // Retention may have removed the oldest segments since `first` was read.
            segments.partition_point(|s| s.base <= offset).checked_sub(1)
        };
        // Lookup i has its position (and its group's time) prefetched at step i, its frame at
        // step i + AHEAD (with the frame it takes its timestamp from, if the index does not know
        // it and it is not its own), and is checked at step
        // i + 2 × AHEAD; `located` holds the frames in between.
        const AHEAD: usize = 8;
        let mut located = [None::<(usize, usize, TimeOf)>; 2 * AHEAD];
        for step in 0..offsets.len() + 2 * AHEAD {
            if let Some(&offset) = offsets.get(step)
                && let Some(s) = segment_of(offset)
            {
                let positions = index_of(&mut indexes, &segments, budget, s);
                let i = (offset - segments[s].base) as usize;
                positions.prefetch(i);
            }
            if let Some(i) = step.checked_sub(AHEAD)
                && let Some(&offset) = offsets.get(i)
            {
                located[i % located.len()] = match segment_of(offset) {
                    Some(s) => {
                        let seg = &segments[s];
                        let positions = index_of(&mut indexes, &segments, budget, s);
                        let i = (offset - seg.base) as usize;
                        let (pos, time) = match positions.get(i) {
                            Some(pos) => (pos, positions.time_of(i)),
                            None => (locate(self.shared.dir(), seg, offset)?, TimeOf::Unknown),
                        };
                        let published = seg.map.published();
                        published.prefetch(pos);
                        // A small frame often straddles two cache lines.
                        published.prefetch((pos + 63).min(published.end() - 1));
                        if let TimeOf::HeldAt(holder) = time
                            && holder != pos
                            && seg.format.inherits_time()
                        {
                            published.prefetch(holder);
                            published.prefetch((holder + frame::FRAME_HEADER_LEN).min(published.end() - 1));
                        }
                        Some((s, pos, time))
                    }
                    None => None,
                };
            }
            if let Some(i) = step.checked_sub(2 * AHEAD)
                && let Some((s, pos, time)) = located[i % located.len()].take()
            {
                let seg = &segments[s];
                let published = seg.map.published();
                let data = published.from(pos);
                let expected = offsets[i];
                let reason = match frame::decode(seg.format, data, data.len(), expected, 0) {
                    Ok(Decoded::Frame(mut record, _)) if record.offset == expected => {
                        if seg.format.inherits_time() && frame::own_timestamp(seg.format, data).is_none() {
                            record.timestamp = seg.time_before_from(time, expected);
                        }
                        found(i, record);
                        continue;
                    }
                    Ok(Decoded::Frame(record, _)) => Reason::Gap { expected, found: record.offset },
                    Ok(Decoded::Empty) => Reason::Missing { expected },
                    Err(e) => Reason::Frame(e),
                };
                return Err(corrupt(&seg.path, pos as u64, Some(expected), reason));
            }
        }
        Ok(())
    }

    /// The last record with `key`, with the key index (`Options::key_index`); `None` if no
    /// record has that key.
    pub fn get_by_key(&mut self, key: &[u8]) -> Result<Option<Record<'_>>> {
        let Some(keys) = self.shared.keys() else {
            return Err(crate::Error::Config("the key index is off: open the log with Options::key_index".into()));
        };
        match keys.get(key) {
            Some(offset) => self.get(offset),
            None => Ok(None),
        }
    }

    /// The first record at or after time `t` (ns since the Unix epoch).
    pub fn get_by_time(&mut self, t: u64) -> Result<Option<Record<'_>>> {
        let offset = self.offset_at_time(t)?;
        // Where the lookup answered "the end", a record the writer put there since may be older
        // than `t`: none was at or after `t` when the lookup began, so none is the answer then.
        Ok(self.get(offset)?.filter(|r| r.timestamp >= t))
    }

    /// Up to `max` consecutive records, all from one segment (so possibly fewer than `max` even
    /// when more follow). Every record is checked (CRC, offset) before it is returned. An empty
    /// batch means the end of the log.
    pub fn read_batch(&mut self, max: usize) -> Result<Batch<'_>> {
        self.read_batch_within(max, usize::MAX)
    }

    /// `read_batch`, stopping once the records read take `max_bytes` of frames (at least one
    /// record, however large): for a reader that copies what it reads.
    pub fn read_batch_within(&mut self, max: usize, max_bytes: usize) -> Result<Batch<'_>> {
        self.shared.check_poison()?;
        if max == 0 || !self.advance()? {
            return Ok(Batch::default());
        }
        let seg = self.seg.as_ref().expect("advance located a segment");
        let data = seg.map.published().from(self.pos);
        let first = self.next;
        // The time a first frame without its own takes: known from the last read, or found.
        let first_time = match self.time {
            Some(time) => time,
            None if seg.format.inherits_time() && frame::own_timestamp(seg.format, data).is_none() => {
                seg.time_before(self.positions.get_or_insert_with(|| seg.positions()), first)
            }
            None => 0,
        };
        let mut time = first_time;
        let mut at = 0;
        let mut count = 0;
        while count < max
            && (count == 0 || at < max_bytes)
            && at + frame::FRAME_ALIGN <= data.len()
            && data[at..at + 8] != [0; 8]
        {
            let expected = first + count as u64;
            let reason = match frame::decode(seg.format, &data[at..], data.len() - at, expected, time) {
                Ok(Decoded::Frame(rec, len)) if rec.offset == expected => {
                    time = rec.timestamp;
                    at += len;
                    count += 1;
                    continue;
                }
                Ok(Decoded::Frame(rec, _)) => Reason::Gap { expected, found: rec.offset },
                Ok(Decoded::Empty) => unreachable!("checked for zero bytes above"),
                Err(e) => Reason::Frame(e),
            };
            if count > 0 {
                break; // return the good records; the next call reports the bad one
            }
            return Err(corrupt(&seg.path, (self.pos + at) as u64, Some(expected), reason));
        }
        self.pos += at;
        self.next += count as u64;
        if count > 0 {
            self.time = Some(time);
        }
        Ok(Batch { data: &data[..at], format: seg.format, first, first_time, count })
    }

    /// Offset of the first record with a timestamp at or after `t` (ns since the Unix epoch), or
    /// the end of the log if there is none. Timestamps never decrease along the log, so this is
    /// a binary search over segments, then one over the segment's dense index if it is built,
    /// else a walk over frame headers from the sparse index's entry.
    pub fn offset_at_time(&mut self, t: u64) -> Result<u64> {
        // The end first: every record below it is in a segment of the list taken after it (the
        // list only grows at its end), so a roll meanwhile cannot put `limit` past the records
        // of the segment searched.
        let end = self.end_offset();
        let segments: Vec<Arc<Segment>> = self.shared.segments().clone();
        let first_ts =
            |seg: &Segment| frame::peek_timestamp(seg.format, seg.map.published().from(SEGMENT_HEADER_LEN), 0);
        // Segments whose first record is older than `t`; the answer is in the last of them, or is
        // the first record of the segment after.
        let older = segments.partition_point(|s| first_ts(s).is_some_and(|ts| ts < t));
        let Some(seg) = older.checked_sub(1).map(|i| &segments[i]) else {
            return Ok(self.first_offset());
        };
        let limit = segments.get(older).map_or(end, |next| next.base);
        seg.ensure_index(self.shared.dir());
        let published = seg.map.published();
        // The entry's timestamp is its frame's, which that frame may take from the one before.
        let (before, next_entry) = seg.index.stretch_before_time(t);
        let (mut pos, mut offset, mut time) = match before {
            Some(e) if (e.pos as usize) < published.end() => (e.pos as usize, e.offset, e.timestamp),
            _ => (SEGMENT_HEADER_LEN, seg.base, 0),
        };
        // With the dense index built, a binary search over the records of the stretch: a few
        // index lines (and a frame or two) instead of a walk over up to `INDEX_STEP` bytes.
        // (An entry of a record published after `end` was read starts at or past `limit`: the
        // walk below answers `limit`, as it would without the entry.)
        if let Some(positions) = seg.positions_if_built().filter(|_| offset < limit) {
            let stop = next_entry.unwrap_or(limit).min(limit);
            // (A record the index does not hold: the walk instead.)
            if let Some(found) = first_at_or_after(offset, stop, t, |o| seg.timestamp_in(&positions, o)) {
                return Ok(found);
            }
        }
        while offset < limit {
            let bytes = published.from(pos);
            let Some(len) = frame::peek_len(seg.format, bytes) else {
                return Err(corrupt(&seg.path, pos as u64, Some(offset), Reason::Missing { expected: offset }));
            };
            time = frame::own_timestamp(seg.format, bytes).unwrap_or(time);
            if time >= t {
                return Ok(offset);
            }
            pos += len;
            offset += 1;
        }
        Ok(limit)
    }

    /// The offset of the record the next read returns, if one is there now: where this reader
    /// stands once it has stepped over records retention removed.
    pub(crate) fn next_readable(&mut self) -> Result<Option<u64>> {
        Ok(self.advance()?.then_some(self.next))
    }

    /// Makes `seg`/`pos` point at record `next`; `false` at the end of the log.
    fn advance(&mut self) -> Result<bool> {
        loop {
            let Some(seg) = &self.seg else {
                // Records removed by retention are stepped over.
                self.next = self.next.max(self.shared.first_offset());
                let Some(seg) = self.shared.segment_for(self.next) else {
                    return Ok(false);
                };
                self.pos = locate(self.shared.dir(), &seg, self.next)?;
                self.seg_end = self.shared.segment_after(seg.base).map_or(u64::MAX, |s| s.base);
                self.enter(seg);
                continue;
            };
            let published = seg.map.published();
            if self.pos + frame::FRAME_ALIGN <= published.end() && published.from(self.pos)[..8] != [0; 8] {
                return Ok(true);
            }
            // At the end of this segment's data: move on if the writer has rolled. The writer
            // publishes a segment's last frame before it adds the next segment, so once a next
            // segment is seen, a second look at `published_end` is final.
            if seg.replaced.load(Ordering::Acquire) {
                // The writer put a larger segment of the same base in its place (which may have
                // successors by now).
                self.leave();
                continue;
            }
            let Some(after) = self.shared.segment_after(seg.base) else {
                return Ok(false);
            };
            if seg.map.published_end() != published.end() {
                continue;
            }
            if after.base != self.next && self.next < self.shared.first_offset() {
                // Retention removed the segments from `next` on while this reader was still in
                // the one before them: step over what it removed, as a reader outside any
                // segment does.
                self.leave();
                continue;
            }
            if after.base != self.next {
                return Err(corrupt(
                    &seg.path,
                    self.pos as u64,
                    Some(self.next),
                    Reason::Missing { expected: self.next },
                ));
            }
            self.seg_end = self.shared.segment_after(after.base).map_or(u64::MAX, |s| s.base);
            self.enter(after);
            self.pos = SEGMENT_HEADER_LEN;
            self.time = None;
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.leave();
    }
}

/// The first of records `lo..hi` (their times non-decreasing) whose time is at or after `t`, or
/// `hi` if none is: a binary search; `None` if `time_of` does not know a record it is asked for.
fn first_at_or_after(mut lo: u64, mut hi: u64, t: u64, time_of: impl Fn(u64) -> Option<u64>) -> Option<u64> {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if time_of(mid)? < t {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    Some(lo)
}

/// Position of record `offset` in `seg`: from the sparse index entry at or before it, a walk
/// over frame headers (or straight from the tail when `offset` is the next to be written).
fn locate(dir: &std::path::Path, seg: &Segment, offset: u64) -> Result<usize> {
    let (tail_pos, tail_records) = seg.tail();
    if tail_records > 0 && offset == seg.base + tail_records {
        return Ok(tail_pos);
    }
    if let Some(pos) = seg.position_of(offset) {
        return Ok(pos);
    }
    seg.ensure_index(dir);
    let published = seg.map.published();
    let (mut pos, mut at) = match seg.index.at_or_before(offset) {
        Some(e) if (e.pos as usize) < published.end() => (e.pos as usize, e.offset),
        _ => (SEGMENT_HEADER_LEN, seg.base),
    };
    while at < offset {
        let bytes = published.from(pos);
        match frame::peek_len(seg.format, bytes) {
            Some(len) => pos += len,
            None => break,
        }
        at += 1;
    }
    if at != offset {
        return Err(corrupt(&seg.path, pos as u64, Some(at), Reason::Missing { expected: offset }));
    }
    Ok(pos)
}

/// Consecutive checked records from one segment. Iterating decodes them again without the CRC
/// (already checked) and allocates nothing.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    data: &'a [u8],
    format: Format,
    first: u64,
    /// The time the first frame takes if it holds none (format 3 on).
    first_time: u64,
    count: usize,
}

impl Default for Batch<'_> {
    fn default() -> Self {
        Batch { data: &[], format: Format::CURRENT, first: 0, first_time: 0, count: 0 }
    }
}

impl<'a> Batch<'a> {
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Offset of the first record (meaningless when empty).
    pub fn first_offset(&self) -> u64 {
        self.first
    }

    /// Bytes the batch spans in the segment (frames with padding).
    pub fn frame_bytes(&self) -> usize {
        self.data.len()
    }
}

impl<'a> IntoIterator for Batch<'a> {
    type Item = Record<'a>;
    type IntoIter = BatchIter<'a>;

    fn into_iter(self) -> BatchIter<'a> {
        BatchIter { rest: self.data, format: self.format, next: self.first, time: self.first_time, left: self.count }
    }
}

pub struct BatchIter<'a> {
    rest: &'a [u8],
    format: Format,
    next: u64,
    /// Timestamp of the record before `next`.
    time: u64,
    left: usize,
}

impl<'a> Iterator for BatchIter<'a> {
    type Item = Record<'a>;

    #[inline]
    fn next(&mut self) -> Option<Record<'a>> {
        if self.left == 0 {
            return None;
        }
        let (record, len) = frame::decode_checked_frame(self.format, self.rest, self.next, self.time);
        self.time = record.timestamp;
        self.rest = &self.rest[len..];
        self.next += 1;
        self.left -= 1;
        Some(record)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for BatchIter<'_> {}
