//! Deciding where the valid records of a segment end.
//!
//! The rules, also in `docs/format.md`:
//!
//! * Frames are read one after another from a known-good start (the segment start, or the
//!   checkpoint recorded after a sync), each checked for length, CRC and flags (and, in format 1,
//!   magic and the expected offset).
//! * Eight zero bytes where a frame would start end the segment: nothing was written there.
//! * A bad frame is a **torn tail** when no valid frame (in format 1, of a later offset) follows it
//!   anywhere in the segment: an append that was cut short by a crash. Its bytes are never acknowledged
//!   (acknowledgement follows the write, and for `Always` the sync), so they are cut.
//! * A batch (format 5: frames that say the next is of their batch) whose last frame is not
//!   there whole is part of the torn tail, from its first frame on: its append did not return, and
//!   a batch is kept whole or not at all.
//! * A bad frame followed by a valid later frame is **corruption**, never silently cut: open fails
//!   with an error naming the file and byte position, and `petrel log repair` is the explicit way
//!   out.
//! * A segment whose header is damaged is judged by its frames (`judge_format`); one whose intact
//!   header names an unknown format is refused before any of this (`segment.rs`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

use crate::checksum;
use crate::error::{Error, FrameError, Reason, Result};
use crate::frame::{self, Decoded, FRAME_ALIGN, Format};
use crate::mmap::{DataWriter, SEGMENT_HEADER_LEN};
use crate::segment::{self, Segment};

/// What opening a log found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub segments: usize,
    /// Records checked from the last durable checkpoint to the end.
    pub records_scanned: u64,
    /// Bytes of an incomplete last append that were cut, if any.
    pub torn_bytes_cut: u64,
    /// Position of the cut in the last segment.
    pub torn_at: Option<u64>,
    /// Leftover temporary files of an interrupted segment creation that were removed.
    pub leftovers_removed: usize,
}

/// How a scan ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Zero bytes (or the end of the segment) after the last frame; nothing to cut.
    Clean,
    /// A torn tail starting at `end`: `garbage_end` is where its non-zero bytes end.
    Torn { error: FrameError, garbage_end: usize },
    /// A bad frame at `end` with a valid frame at `later_pos` after it: record `later_offset` in
    /// format 1; in format 2 a frame does not say its offset, and how many records the damage
    /// took is not known.
    Corrupt { error: FrameError, later_pos: usize, later_offset: Option<u64> },
    /// A bad frame at `end`, and the search for a valid frame after it gave up at `searched_to`
    /// (`MAX_OPEN_CANDIDATES`): taken as corruption, never cut.
    Undecided { error: FrameError, searched_to: usize },
}

/// Candidate frames the search after a bad frame may have open (claimed, not yet checksummed to
/// their end) at once before it gives up and fails safe. In a 256 MiB segment uniformly random
/// bytes make about one format-5 candidate per 250 bytes (a length that fits: 1 in 2, its length
/// having 29 bits; zero padding: 1 in 8; no flags byte or a known one: 1 in 2), each claiming up
/// to the rest of the segment, so this covers about 512 MiB of them (1 GiB in formats 3 and 4,
/// whose lengths have 30 bits; 256 MiB in a segment of 512 MiB or more, where every length
/// fits). It bounds the search's memory (16 bytes a candidate: 64 MiB at most with the heap's
/// growth), as one pass over the segment bounds its time.
const MAX_OPEN_CANDIDATES: usize = 2 << 20;

/// What the search after a bad frame found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Later {
    Nothing,
    /// A valid frame at `pos`, and its offset if the frame says it (format 1).
    Found {
        pos: usize,
        offset: Option<u64>,
    },
    /// Too many candidates were open at once at `pos`.
    GaveUp {
        pos: usize,
    },
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Scan {
    /// Position (relative to the start of `data`) one past the last valid frame.
    pub end: usize,
    /// Offset of the record after the last valid one.
    pub next_offset: u64,
    /// Valid records seen by this scan.
    pub records: u64,
    pub stop: Stop,
    /// With a `Corrupt` or `Undecided` stop: where the batch that the frames before `end` are
    /// of started, if its last frame was not among them (with the other stops, such frames are
    /// in the torn tail already).
    pub unfinished: Option<Mark>,
}

/// A place in a scan: its position, the record expected there, and the records seen before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mark {
    pub pos: usize,
    pub offset: u64,
    pub records: u64,
}

/// Scans `data` (a segment's data region) from relative position `start`, where record
/// `start_offset` is expected.
pub(crate) fn scan(format: Format, data: &[u8], start: usize, start_offset: u64) -> Scan {
    scan_with_hole(format, data, start, start_offset, 0..0)
}

/// `scan` of the last segment of a log that another process may be appending to (the read-only
/// tools beside a running server). That writer writes frames in order, so a frame read half
/// written can have whole frames after it by the time the search for them reads on: a frame
/// that reads as damaged before a valid one is read again, from `data()` called anew, and the
/// scan goes on if it has become whole. Damage stays where it is; a write moves on. A frame
/// still damaged after `REREADS` more looks, a few milliseconds apart (a writer descheduled or
/// faulting in the middle of a large frame), is reported.
pub(crate) fn scan_beside_writer<'a>(
    format: Format,
    data: impl Fn() -> &'a [u8],
    start: usize,
    start_offset: u64,
) -> Scan {
    const REREADS: usize = 5;
    let mut whole = scan(format, data(), start, start_offset);
    let mut rereads = 0;
    while matches!(whole.stop, Stop::Corrupt { .. }) && rereads < REREADS {
        // The frames after it were read after this one: what the writer wrote before them is
        // to be seen now (the fence keeps the compiler from reusing the first reading).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let at = Mark { pos: whole.end, offset: whole.next_offset, records: whole.records };
        let again = scan_on(format, data(), at, whole.unfinished, 0..0);
        // Still damaged where it was. (A frame now whole that begins a batch whose end is not
        // written yet ends the scan where it did too, but as a torn tail: that is news.)
        if matches!(again.stop, Stop::Corrupt { .. }) && again.end == whole.end {
            rereads += 1;
            std::thread::sleep(std::time::Duration::from_millis(rereads as u64 * 2));
            continue;
        }
        rereads = 0;
        whole = again;
    }
    whole
}

/// `scan`, told that `hole` (relative to `data`) is a hole of the file: it reads as zeros, and
/// the check for bytes after the last frame does not read it (a read would fault its pages in,
/// and the kernel read ahead around them: a whole small segment for each idle queue a server
/// opens).
pub(crate) fn scan_with_hole(format: Format, data: &[u8], start: usize, start_offset: u64, hole: Range<usize>) -> Scan {
    scan_on(format, data, Mark { pos: start, offset: start_offset, records: 0 }, None, hole)
}

/// Scans on from `at`, inside the batch that started at `unfinished` if one is given.
fn scan_on(format: Format, data: &[u8], at: Mark, mut unfinished: Option<Mark>, hole: Range<usize>) -> Scan {
    let Mark { mut pos, offset: mut next, mut records } = at;
    let stop = loop {
        let rest = &data[pos.min(data.len())..];
        if rest.is_empty() {
            break Stop::Clean;
        }
        // A first word in the hole is zeros, as a read would find: records that end on a page
        // boundary leave the check to `nonzero_extent` without a read.
        let decoded = match hole.start <= pos && (pos + FRAME_ALIGN).min(data.len()) <= hole.end {
            true => Ok(Decoded::Empty),
            false => frame::decode(format, rest, rest.len(), next, 0),
        };
        let error = match decoded {
            Ok(Decoded::Frame(rec, len)) if rec.offset == next => {
                match frame::continues_batch(format, rest) {
                    true => _ = unfinished.get_or_insert(Mark { pos, offset: next, records }),
                    false => unfinished = None,
                }
                pos += len;
                next += 1;
                records += 1;
                continue;
            }
            Ok(Decoded::Frame(..)) => FrameError::WrongOffset,
            Ok(Decoded::Empty) => {
                // Nothing was written here — unless a crash left a frame's body without its
                // header, which shows as non-zero bytes further on.
                let garbage_end = nonzero_extent(data, pos, hole);
                break match garbage_end == pos {
                    true => Stop::Clean,
                    false => classify(format, data, pos, next, garbage_end, FrameError::BadMagic),
                };
            }
            Err(e) => e,
        };
        let garbage_end = nonzero_extent(data, pos, hole).max(pos + FRAME_ALIGN).min(data.len());
        break classify(format, data, pos, next, garbage_end, error);
    };
    let scan = Scan { end: pos, next_offset: next, records, stop, unfinished: None };
    match (unfinished, &scan.stop) {
        (None, _) => scan,
        // Damage after them stays damage: the frames before it are reported as they are.
        (Some(_), Stop::Corrupt { .. } | Stop::Undecided { .. }) => Scan { unfinished, ..scan },
        // The frames of a batch whose last frame is missing are part of the torn tail: the
        // append that wrote them did not return, and a batch is kept whole or not at all.
        (Some(batch), Stop::Clean) => cut_to(batch, scan.end),
        (Some(batch), &Stop::Torn { garbage_end, .. }) => cut_to(batch, garbage_end),
    }
}

/// A scan that ends at `batch`, with what follows up to `garbage_end` a torn tail.
fn cut_to(batch: Mark, garbage_end: usize) -> Scan {
    Scan {
        end: batch.pos,
        next_offset: batch.offset,
        records: batch.records,
        stop: Stop::Torn { error: FrameError::UnfinishedBatch, garbage_end },
        unfinished: None,
    }
}

fn classify(format: Format, data: &[u8], pos: usize, next: u64, garbage_end: usize, error: FrameError) -> Stop {
    match find_valid_after(format, data, pos + FRAME_ALIGN, next, MAX_OPEN_CANDIDATES) {
        Later::Found { pos: later_pos, offset: later_offset } => Stop::Corrupt { error, later_pos, later_offset },
        Later::GaveUp { pos: searched_to } => Stop::Undecided { error, searched_to },
        Later::Nothing => Stop::Torn { error, garbage_end },
    }
}

/// The first valid frame at or after `from` (in format 1, whose offset is at least
/// `min_offset`), with at most `max_open` candidates open at once.
///
/// One pass: a running checksum goes through the bytes once, and a candidate's claimed frame is
/// checked when the pass reaches its end (`checksum::of_range`), so the work is the segment's
/// length plus a few multiplications per candidate, however long their claims.
pub(crate) fn find_valid_after(format: Format, data: &[u8], from: usize, min_offset: u64, max_open: usize) -> Later {
    assert!(data.len() <= u32::MAX as usize, "a segment is smaller than 4 GiB");
    let mut search = Search {
        format,
        data,
        min_offset,
        at: from,
        running: checksum::Running::new(),
        open: BinaryHeap::new(),
        found: None,
    };
    let mut pos = from.next_multiple_of(FRAME_ALIGN);
    while search.found.is_none() && pos + FRAME_ALIGN <= data.len() {
        if let Some(candidate) = frame::may_start(format, &data[pos..]) {
            search.open_candidate(pos, candidate);
            if search.open.len() > max_open {
                return Later::GaveUp { pos };
            }
        }
        pos += FRAME_ALIGN;
    }
    search.close_until(data.len());
    match search.found {
        Some((pos, offset)) => Later::Found { pos, offset },
        None => Later::Nothing,
    }
}

/// The state of `find_valid_after`'s pass.
struct Search<'a> {
    format: Format,
    data: &'a [u8],
    min_offset: u64,
    /// The running checksum is the CRC32C of `data[base..at]`, for a base moved forward whenever
    /// nothing is open, so that stretches without candidates are not read.
    at: usize,
    running: checksum::Running,
    /// Candidates not yet checked, the earliest end first.
    open: BinaryHeap<Reverse<Open>>,
    /// The earliest valid frame found, and its offset in format 1.
    found: Option<(usize, Option<u64>)>,
}

/// A candidate frame not yet checked: 16 bytes (segments are smaller than 4 GiB).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Open {
    /// Where its claimed frame ends (unpadded); first, so that the heap orders by it.
    end: u32,
    start: u32,
    /// The running checksum where its checksummed bytes start.
    running_before: u32,
    crc: u32,
}

impl Search<'_> {
    fn run_to(&mut self, to: usize) {
        self.running.update(&self.data[self.at..to]);
        self.at = to;
    }

    fn open_candidate(&mut self, start: usize, candidate: frame::Candidate) {
        let checked_from = start + self.format.checked_from();
        self.close_until(checked_from);
        if self.found.is_some() {
            return;
        }
        if self.open.is_empty() {
            (self.at, self.running) = (checked_from, checksum::Running::new());
        } else {
            self.run_to(checked_from);
        }
        let (end, start) = ((start + candidate.len) as u32, start as u32);
        self.open.push(Reverse(Open { end, start, running_before: self.running.value(), crc: candidate.crc }));
    }

    /// Checks the open candidates that end at or before `until`, in the order of their ends. Once
    /// a valid frame is found, only candidates starting before it still matter.
    fn close_until(&mut self, until: usize) {
        while let Some(Reverse(next)) = self.open.peek()
            && next.end as usize <= until
        {
            let Reverse(Open { end, start, running_before, crc }) = self.open.pop().expect("peeked");
            let (end, start) = (end as usize, start as usize);
            // Once a valid frame is found, only candidates starting before it matter (skipped
            // here rather than removed when it is found: nested frames would make that quadratic;
            // and not checksummed up to their ends for nothing).
            if self.found.is_some_and(|(found, _)| start >= found) {
                continue;
            }
            self.run_to(end);
            let checked_len = end - start - self.format.checked_from();
            if checksum::of_range(running_before, self.running.value(), checked_len) != crc {
                continue;
            }
            // The checksum matches: decode it whole (flags, headers, format 1's offset).
            let Ok(Decoded::Frame(record, _)) =
                frame::decode(self.format, &self.data[start..], self.data.len() - start, self.min_offset, 0)
            else {
                continue;
            };
            self.found = match self.format {
                Format::V1 if record.offset < self.min_offset => continue,
                Format::V1 => Some((start, Some(record.offset))),
                Format::V2 | Format::V3 | Format::V4 | Format::V5 => Some((start, None)),
            };
        }
    }
}

/// The format of a segment whose header is damaged, judged by its data region `data` (whose
/// first record would be `base`): the current format if it starts with a valid format-3 frame
/// holding its timestamp (a segment's first always does, and a format-2 frame never sets that
/// bit; or format 4, for a segment of format 3 or 4 holding a frame of 512 MiB or more, below),
/// format 2 if with a valid
/// format-2 frame; else format 1 if a valid format-1 frame of a record from `base` on is anywhere
/// in it (they start with a magic, so the search is cheap); else the current format.
///
/// Judging by the first bytes alone would take a format-1 segment whose first frame is damaged
/// too for format 3, and cut all its records as a torn tail. A wrong judgement the other way
/// only makes open refuse (format-1 frames inside a later format's payloads, or a format-2
/// segment whose first frame is damaged too: read as format 3, a bad frame followed by valid
/// ones is corruption, never a cut).
pub(crate) fn judge_format(data: &[u8], base: u64) -> Format {
    let starts_with_timed_frame = |format| {
        matches!(frame::decode(format, data, data.len(), base, 0), Ok(Decoded::Frame(..)))
            && frame::own_timestamp(format, data).is_some()
    };
    if starts_with_timed_frame(Format::CURRENT) || starts_with_timed_frame(Format::V4) {
        // Formats 3 to 5 share their frames but for format 5's batch bit, which is part of the
        // length of an earlier format's frame of 512 MiB or more: each reads the other's such
        // frames as damaged. The format whose frames read further is the segment's (format 5 if
        // neither: then they read alike).
        return match valid_frames_end(Format::V4, data, base) > valid_frames_end(Format::CURRENT, data, base) {
            true => Format::V4,
            false => Format::CURRENT,
        };
    }
    if let Ok(Decoded::Frame(..)) = frame::decode(Format::V2, data, data.len(), base, 0) {
        return Format::V2;
    }
    match find_valid_after(Format::V1, data, 0, base, MAX_OPEN_CANDIDATES) {
        Later::Nothing => Format::CURRENT,
        // Too many format-1 magics to check is taken as format 1: its scan refuses rather
        // than cuts what it cannot decide.
        Later::Found { .. } | Later::GaveUp { .. } => Format::V1,
    }
}

/// Where the valid frames of `format` from the start of `data` end (no search past a bad one).
fn valid_frames_end(format: Format, data: &[u8], base: u64) -> usize {
    let (mut pos, mut offset) = (0, base);
    while let Ok(Decoded::Frame(_, len)) = frame::decode(format, &data[pos..], data.len() - pos, offset, 0) {
        (pos, offset) = (pos + len, offset + 1);
    }
    pos
}

/// End of the run of non-zero data starting at `pos`: the first 4 KiB-aligned page boundary after
/// which a whole page is zero (or the end of `data`). Returns `pos` if `[pos, next page)` and the
/// page after are zero. Bytes in `hole` are zeros, and are not read.
pub(crate) fn nonzero_extent(data: &[u8], pos: usize, hole: Range<usize>) -> usize {
    const PAGE: usize = 4096;
    let mut last_nonzero = None;
    let mut at = pos;
    let mut zero_run_start = pos;
    while at < data.len() {
        let chunk_end = (((at / PAGE) + 1) * PAGE).min(data.len());
        // The chunk's bytes outside the hole: before it, and after it.
        let before = at..chunk_end.min(hole.start).max(at);
        let after = hole.end.clamp(at, chunk_end)..chunk_end;
        let last = |r: Range<usize>| data[r.clone()].iter().rposition(|&b| b != 0).map(|i| r.start + i);
        match last(after).or_else(|| last(before)) {
            Some(i) => {
                last_nonzero = Some(i);
                zero_run_start = chunk_end;
            }
            None if chunk_end - zero_run_start >= PAGE => break,
            None => {}
        }
        at = chunk_end;
    }
    last_nonzero.map_or(pos, |i| i + 1)
}

/// What recovery found at the end of the active segment.
pub(crate) struct Recovered {
    /// Position after the last valid frame.
    pub end: usize,
    pub next_offset: u64,
    /// Whether the page holding `end` is data on disk (not in a hole), so that the writer may
    /// finish it without reserving its block first.
    pub end_page_on_disk: bool,
}

/// Finds the end of the valid records of the active segment, cutting a torn tail.
pub(crate) fn recover_active(seg: &Segment, writer: &mut DataWriter, report: &mut RecoveryReport) -> Result<Recovered> {
    let header = seg.header();
    let (start, start_offset) = scan_start(seg, &header);
    // The hole after the checkpoint's page, if the file has one (where a closed log gave back
    // the blocks past its records, and where blocks were never reserved); the scan takes the
    // part of it from the checkpoint on.
    let file_hole = seg.hole_after(start / segment::PAGE * segment::PAGE);
    let hole = file_hole.start.max(start) - SEGMENT_HEADER_LEN..file_hole.end.max(start) - SEGMENT_HEADER_LEN;
    let scan = scan_with_hole(seg.format, writer.unpublished(), start - SEGMENT_HEADER_LEN, start_offset, hole);
    report.records_scanned = scan.records;
    let end = SEGMENT_HEADER_LEN + scan.end;
    match scan.stop {
        Stop::Clean => {}
        Stop::Torn { error, garbage_end } => {
            let cut = garbage_end - scan.end;
            tracing::warn!(file = %seg.path.display(), position = end, bytes = cut, %error,
                "cut the torn tail left by an interrupted append");
            writer.zero(scan.end, garbage_end);
            report.torn_bytes_cut = cut as u64;
            report.torn_at = Some(end as u64);
        }
        Stop::Corrupt { error, later_pos, later_offset } => {
            return Err(corrupt_before_valid(seg, end, scan.next_offset, error, later_pos, later_offset));
        }
        Stop::Undecided { error, searched_to } => {
            return Err(corrupt_undecided(seg, end, scan.next_offset, error, searched_to));
        }
    }
    if let Ok(h) = &header
        && h.checkpoint_pos > end as u64
    {
        return Err(cut_below_checkpoint(seg, end, scan.next_offset, h));
    }
    if header.is_err() {
        seg.write_checkpoint(0, seg.base);
    }
    // Only a hole found says the file system tells holes at all: one without `SEEK_HOLE` reports
    // the whole file as data (an empty hole at its end), and so does an error (`0..0`).
    let end_page_on_disk = !file_hole.is_empty() && file_hole.start >= end.next_multiple_of(segment::PAGE);
    Ok(Recovered { end, next_offset: scan.next_offset, end_page_on_disk })
}

/// The valid frames of a segment end at `end`, before its durable checkpoint: records that were
/// synced and acknowledged are gone (the file was cut short or its end overwritten after the
/// fact). A crash cannot do this, so it is never taken for a torn tail.
pub(crate) fn cut_below_checkpoint(
    seg: &Segment,
    end: usize,
    next_offset: u64,
    header: &segment::SegmentHeader,
) -> Error {
    Error::Corrupt {
        file: seg.path.clone(),
        position: end as u64,
        offset: Some(next_offset),
        reason: Reason::Other(below_checkpoint(end, next_offset, header)),
        before_tail: true,
    }
}

/// Says what a segment cut below its checkpoint lost.
pub(crate) fn below_checkpoint(end: usize, next_offset: u64, header: &segment::SegmentHeader) -> String {
    format!(
        "the valid records end at byte {end}, before the segment's durable checkpoint at byte {} (record {}): \
         records {next_offset}..{} were synced and acknowledged, and the file no longer holds them (cut short or \
         overwritten)",
        header.checkpoint_pos, header.checkpoint_offset, header.checkpoint_offset
    )
}

pub(crate) fn corrupt_before_valid(
    seg: &Segment,
    end: usize,
    next_offset: u64,
    error: FrameError,
    later_pos: usize,
    later_offset: Option<u64>,
) -> Error {
    let later = later_offset.map_or_else(|| "record".to_owned(), |o| format!("record {o}"));
    Error::Corrupt {
        file: seg.path.clone(),
        position: end as u64,
        offset: Some(next_offset),
        reason: Reason::Other(format!(
            "{error}, yet a valid {later} follows at byte {}",
            SEGMENT_HEADER_LEN + later_pos
        )),
        before_tail: true,
    }
}

pub(crate) fn corrupt_undecided(
    seg: &Segment,
    end: usize,
    next_offset: u64,
    error: FrameError,
    searched_to: usize,
) -> Error {
    Error::Corrupt {
        file: seg.path.clone(),
        position: end as u64,
        offset: Some(next_offset),
        reason: Reason::Other(format!(
            "{error}, and whether valid records follow it was not decided (the search stopped at byte {}): \
             taken as damage, not cut",
            SEGMENT_HEADER_LEN + searched_to
        )),
        before_tail: true,
    }
}

/// Where recovery of the last segment starts: its durable checkpoint when the header has a
/// sane one, else the start of the segment.
pub(crate) fn scan_start(seg: &Segment, header: &Result<segment::SegmentHeader, String>) -> (usize, u64) {
    match header {
        Ok(h)
            if h.checkpoint_pos as usize >= SEGMENT_HEADER_LEN
                && (h.checkpoint_pos as usize) <= seg.map.len()
                && h.checkpoint_pos % frame::FRAME_ALIGN as u64 == 0 =>
        {
            (h.checkpoint_pos as usize, h.checkpoint_offset)
        }
        Ok(_) => (SEGMENT_HEADER_LEN, seg.base),
        Err(reason) => {
            tracing::warn!(file = %seg.path.display(), %reason, "segment header unreadable; rescanning the segment");
            (SEGMENT_HEADER_LEN, seg.base)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Input, align_up, encode, frame_len};

    fn segment(n: u64, payload: &[u8]) -> (Vec<u8>, Vec<usize>) {
        let mut data = vec![0u8; 1 << 16];
        let mut pos = 0;
        let mut starts = vec![];
        for off in 0..n {
            let input = Input::payload(payload);
            starts.push(pos);
            pos += encode(&mut data[pos..], frame_len(&input), Some(off), false, &input);
        }
        starts.push(pos);
        (data, starts)
    }

    #[test]
    fn clean_segment_scans_to_its_end() {
        let (data, starts) = segment(10, b"abc");
        let s = scan(Format::CURRENT, &data, 0, 0);
        assert_eq!(s, Scan { end: starts[10], next_offset: 10, records: 10, stop: Stop::Clean, unfinished: None });
        let s = scan(Format::CURRENT, &data, starts[4], 4);
        assert_eq!((s.end, s.next_offset, s.records), (starts[10], 10, 6));
    }

    #[test]
    fn torn_last_frame_is_cut_at_its_start() {
        let (data, starts) = segment(5, &[9u8; 40]);
        for cut in starts[4] + 1..starts[5] {
            let mut torn = data.clone();
            torn[cut..].fill(0);
            let s = scan(Format::CURRENT, &torn, 0, 0);
            assert_eq!((s.end, s.next_offset), (starts[4], 4), "cut at {cut}");
            assert!(matches!(s.stop, Stop::Torn { .. }), "cut at {cut}: {:?}", s.stop);
        }
    }

    #[test]
    fn body_without_header_is_a_torn_tail() {
        let (mut data, starts) = segment(3, &[9u8; 100]);
        data[starts[2]..starts[2] + 16].fill(0);
        let s = scan(Format::CURRENT, &data, 0, 0);
        assert_eq!(s.end, starts[2]);
        assert_eq!(s.stop, Stop::Torn { error: FrameError::BadMagic, garbage_end: starts[3] - 4 });
    }

    #[test]
    fn damage_before_a_valid_frame_is_corruption() {
        let (mut data, starts) = segment(5, b"hello world");
        data[starts[1] + 20] ^= 1;
        let s = scan(Format::CURRENT, &data, 0, 0);
        assert_eq!(s.end, starts[1]);
        assert_eq!(s.stop, Stop::Corrupt { error: FrameError::BadChecksum, later_pos: starts[2], later_offset: None });
    }

    /// `scan_beside_writer` over `first` at its first reading and `then` at every later one;
    /// with how many readings it took.
    fn scan_reading_twice(first: &[u8], then: &[u8]) -> (Scan, usize) {
        let readings = std::cell::Cell::new(0);
        let data = || {
            readings.set(readings.get() + 1);
            if readings.get() == 1 { first } else { then }
        };
        let s = scan_beside_writer(Format::CURRENT, data, 0, 0);
        (s, readings.get())
    }

    #[test]
    fn beside_a_writer_a_frame_read_half_written_is_read_again_and_damage_stays_damage() {
        // The first reading caught record 1 half written and records 2..5 whole after it; the
        // next reading finds record 1 whole: the scan goes on to the end.
        let (whole, starts) = segment(5, b"hello world");
        let mut caught = whole.clone();
        caught[starts[1]..starts[2]].fill(0);
        caught[starts[1] + 20] = 7;
        let (s, readings) = scan_reading_twice(&caught, &whole);
        assert_eq!((s.end, s.next_offset, s.records, &s.stop), (starts[5], 5, 5, &Stop::Clean));
        assert_eq!(readings, 2);

        // Damage reads the same every time: reported where it is, after a few more looks.
        let mut damaged = whole.clone();
        damaged[starts[1] + 20] ^= 1;
        let s = scan_beside_writer(Format::CURRENT, || &damaged[..], 0, 0);
        assert_eq!((s.end, s.next_offset), (starts[1], 1));
        assert_eq!(s.stop, Stop::Corrupt { error: FrameError::BadChecksum, later_pos: starts[2], later_offset: None });
    }

    /// A segment of batches of the sizes given, each frame `payload`; and where each frame
    /// starts, with the end after the last.
    fn batches(sizes: &[usize], payload: &[u8]) -> (Vec<u8>, Vec<usize>) {
        let mut data = vec![0u8; 1 << 16];
        let (mut pos, mut starts, mut off) = (0, vec![], 0);
        for &n in sizes {
            for i in 0..n {
                let input = Input::payload(payload);
                starts.push(pos);
                // (A time with no zero byte: a frame cut anywhere short of its end is changed.)
                pos += encode(&mut data[pos..], frame_len(&input), Some(u64::MAX - off), i + 1 < n, &input);
                off += 1;
            }
        }
        starts.push(pos);
        (data, starts)
    }

    #[test]
    fn a_batch_whose_last_frame_is_missing_is_cut_whole() {
        // Batches of 1, 3 and 4 records (0; 1..4; 4..8).
        let (data, starts) = batches(&[1, 3, 4], b"a record of a batch");
        let s = scan(Format::CURRENT, &data, 0, 0);
        assert_eq!((s.end, s.next_offset, s.records, &s.stop), (starts[8], 8, 8, &Stop::Clean));
        // Written up to record 5, 6 or 7 of the last batch, or torn inside record 7: the batch
        // goes, the ones before it stay.
        for cut in [starts[5], starts[6], starts[7], starts[7] + 9, starts[8] - 8] {
            let mut torn = data.clone();
            torn[cut..].fill(0);
            let s = scan(Format::CURRENT, &torn, 0, 0);
            assert_eq!((s.end, s.next_offset, s.records), (starts[4], 4, 4), "cut at {cut}");
            let Stop::Torn { error: FrameError::UnfinishedBatch, garbage_end } = s.stop else { panic!("{:?}", s.stop) };
            assert!(garbage_end > torn.iter().rposition(|&b| b != 0).unwrap(), "cut at {cut}");
        }
        // From a checkpoint inside the first batches, the same.
        let mut torn = data.clone();
        torn[starts[6]..].fill(0);
        let s = scan(Format::CURRENT, &torn, starts[1], 1);
        assert_eq!((s.end, s.next_offset, s.records), (starts[4], 4, 3));
    }

    #[test]
    fn damage_after_an_unfinished_batch_stays_damage_and_says_where_the_batch_began() {
        let (mut data, starts) = batches(&[2, 3, 1], b"hello world");
        data[starts[3] + 20] ^= 1; // inside the second batch, valid frames after it
        let s = scan(Format::CURRENT, &data, 0, 0);
        assert_eq!((s.end, s.next_offset), (starts[3], 3));
        assert_eq!(s.stop, Stop::Corrupt { error: FrameError::BadChecksum, later_pos: starts[4], later_offset: None });
        assert_eq!(s.unfinished, Some(Mark { pos: starts[2], offset: 2, records: 2 }));
    }

    #[test]
    fn beside_a_writer_a_batch_read_half_written_is_cut_from_its_start() {
        // The first reading caught record 3 (of the batch 2..5) half written and record 4 whole;
        // by the next one the writer had died in record 5: the batch goes from record 2 on.
        let (whole, starts) = batches(&[2, 4], b"hello world");
        let mut caught = whole.clone();
        caught[starts[3]..starts[4]].fill(0);
        caught[starts[3] + 20] = 7;
        caught[starts[5]..].fill(0);
        let mut later = whole.clone();
        later[starts[5] + 8..].fill(0);
        let (s, readings) = scan_reading_twice(&caught, &later);
        assert_eq!((s.end, s.next_offset, s.records, readings), (starts[2], 2, 2, 2));
        assert!(matches!(s.stop, Stop::Torn { error: FrameError::UnfinishedBatch, .. }), "{:?}", s.stop);
    }

    #[test]
    fn beside_a_writer_a_half_written_first_frame_of_a_batch_is_read_again_and_cut_with_it() {
        // The first reading caught record 2, the first of the batch 2..5, half written and record
        // 3 whole; by the next one records 2 and 3 are whole and 4 not written: the batch is cut
        // from record 2, as recovery would cut it, not reported as damage.
        let (whole, starts) = batches(&[2, 3], b"hello world");
        let mut caught = whole.clone();
        caught[starts[2]..starts[3]].fill(0);
        caught[starts[2] + 20] = 7;
        caught[starts[4]..].fill(0);
        let mut later = whole.clone();
        later[starts[4]..].fill(0);
        let (s, readings) = scan_reading_twice(&caught, &later);
        assert_eq!((s.end, s.next_offset, s.records), (starts[2], 2, 2));
        assert!(matches!(s.stop, Stop::Torn { error: FrameError::UnfinishedBatch, .. }), "{:?}", s.stop);
        assert_eq!(readings, 2, "read again once, not until it gives up");
    }

    #[test]
    fn a_segment_whose_header_is_damaged_is_judged_by_how_far_each_format_reads_its_frames() {
        // Format 5's batches read as damage in format 4 (bit 29 is a length bit there).
        let (data, _) = batches(&[1, 3, 1], b"judged");
        assert_eq!(judge_format(&data, 0), Format::V5);
        // A format-4 frame of 512 MiB or more has that bit in its length: format 5 reads it as
        // damaged, format 4 whole.
        let input = Input::payload(b"");
        let len = frame::MAX_FRAME_LEN + 1 + 64;
        let mut data = vec![0u8; frame::align_up(len) + 4096];
        encode(&mut data, frame_len(&input), Some(1), false, &input);
        data[4..8].copy_from_slice(&((len as u32) | 1 << 30).to_le_bytes()); // a timestamp, and `len`
        let crc = crate::checksum::crc32c(&data[4..len]);
        data[..4].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(judge_format(&data, 0), Format::V4);
        assert_eq!(scan(Format::V4, &data, 0, 0).next_offset, 1);
    }

    fn random_bytes(out: &mut [u8], seed: u64) {
        let mut x = seed | 1;
        for b in out {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }

    /// A large payload cut short in a segment of `segment_bytes`: its header not yet written (a
    /// large frame's header is stored last), `written` bytes of it, then zeros.
    fn torn_large_record(segment_bytes: usize, written: usize) -> (Vec<u8>, Vec<usize>) {
        let (mut data, starts) = segment(3, b"before");
        data.resize(segment_bytes, 0);
        random_bytes(&mut data[starts[3] + 16..starts[3] + 16 + written], 0x9e37_79b9_7f4a_7c15);
        (data, starts)
    }

    /// A scan of `torn_large_record(segment_bytes, written)` cuts the torn record and the
    /// garbage it left, and keeps the three records before it.
    fn assert_torn_tail(segment_bytes: usize, written: usize) {
        let (data, starts) = torn_large_record(segment_bytes, written);
        let s = scan(Format::CURRENT, &data, 0, 0);
        assert_eq!((s.end, s.next_offset), (starts[3], 3));
        assert_eq!(s.stop, Stop::Torn { error: FrameError::BadMagic, garbage_end: starts[3] + 16 + written });
    }

    #[test]
    fn a_large_record_torn_in_random_bytes_is_a_torn_tail() {
        assert_torn_tail(4 << 20, 512 << 10);
    }

    #[test]
    fn a_large_record_torn_in_random_bytes_of_a_full_size_segment_is_a_torn_tail() {
        // In a 256 MiB segment about one position in 64 of random bytes claims a frame of up to
        // the rest of the segment: 128 K candidates claiming 128 MiB each on average. A search
        // that checksummed each claim on its own would read terabytes (and used to give up).
        assert_torn_tail(256 << 20, 64 << 20);
    }

    #[test]
    fn damage_inside_a_large_record_before_valid_ones_is_corruption_at_the_first_valid_frame() {
        // A 1 MiB random payload with a byte flipped, then small valid frames: the search must
        // find the first of them, among the candidates in the random bytes.
        let mut data = vec![0u8; 8 << 20];
        let mut payload = vec![0u8; 1 << 20];
        random_bytes(&mut payload, 42);
        let mut pos = 0;
        let mut starts = vec![];
        for off in 0..6u64 {
            let input = if off == 1 { Input::payload(&payload) } else { Input::payload(b"small") };
            starts.push(pos);
            pos += encode(&mut data[pos..], frame_len(&input), Some(off), false, &input);
        }
        data[starts[1] + 1000] ^= 0x40;
        let s = scan(Format::CURRENT, &data, 0, 0);
        assert_eq!(s.end, starts[1]);
        assert_eq!(s.stop, Stop::Corrupt { error: FrameError::BadChecksum, later_pos: starts[2], later_offset: None });
    }

    #[test]
    fn the_search_after_a_bad_frame_gives_up_with_too_many_open_candidates() {
        // Bytes made so that every other position claims a frame reaching to the end.
        let mut data = vec![0u8; 1 << 20];
        for at in (0..4096).step_by(16) {
            let len = (data.len() - at) as u32;
            data[at + 4..at + 8].copy_from_slice(&len.to_le_bytes());
            data[at] = 1; // a CRC that does not match
        }
        assert_eq!(find_valid_after(Format::CURRENT, &data, 0, 0, 100), Later::GaveUp { pos: 100 * 16 });
        assert_eq!(find_valid_after(Format::CURRENT, &data, 0, 0, 256), Later::Nothing);
        assert_eq!(find_valid_after(Format::CURRENT, &data, 8192, 0, 1), Later::Nothing);
    }

    /// The search as it would be without the running checksum: each candidate checked on its
    /// own (the cost the one-pass search avoids).
    fn first_valid_by_rereading(data: &[u8], from: usize) -> Later {
        let mut pos = from.next_multiple_of(FRAME_ALIGN);
        while pos + FRAME_ALIGN <= data.len() {
            if frame::may_start(Format::CURRENT, &data[pos..]).is_some()
                && let Ok(Decoded::Frame(..)) = frame::decode(Format::CURRENT, &data[pos..], data.len() - pos, 0, 0)
            {
                return Later::Found { pos, offset: None };
            }
            pos += FRAME_ALIGN;
        }
        Later::Nothing
    }

    /// One piece of a made-up segment.
    #[derive(Clone, Debug)]
    enum Piece {
        Frame(Vec<u8>),
        /// A frame that says the next is of its batch.
        Continued(Vec<u8>),
        /// A frame whose payload is a frame: the inner one ends first, the outer starts first.
        Nested(Vec<u8>),
        /// A frame with one bit flipped.
        Damaged(Vec<u8>, usize),
        /// 8-byte words, some of them with a length that fits (so that they are candidates).
        Garbage(Vec<(u32, u32)>),
        Zeros(usize),
    }

    fn piece() -> impl proptest::strategy::Strategy<Value = Piece> {
        use proptest::prelude::*;
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300).prop_map(Piece::Frame),
            prop::collection::vec(any::<u8>(), 0..300).prop_map(Piece::Continued),
            prop::collection::vec(any::<u8>(), 0..300).prop_map(Piece::Nested),
            (prop::collection::vec(any::<u8>(), 0..300), any::<usize>()).prop_map(|(p, at)| Piece::Damaged(p, at)),
            prop::collection::vec((any::<u32>(), prop_oneof![any::<u32>(), 16u32..2000]), 1..100)
                .prop_map(Piece::Garbage),
            (1usize..100).prop_map(|n| Piece::Zeros(n * 8)),
        ]
    }

    /// The data region of a segment made of `pieces`, one after another.
    fn made_up_segment(pieces: &[Piece]) -> Vec<u8> {
        let mut data = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Frame(payload) | Piece::Continued(payload) | Piece::Damaged(payload, _) => {
                    let input = Input::payload(payload);
                    // Frames with and without their own timestamp.
                    let (len, time) = match payload.len() % 2 {
                        0 => (frame_len(&input), Some(1)),
                        _ => (frame_len(&input) - frame::TIMESTAMP_LEN, None),
                    };
                    let at = data.len();
                    data.resize(at + align_up(len), 0);
                    encode(&mut data[at..], len, time, matches!(piece, Piece::Continued(_)), &input);
                    if let Piece::Damaged(_, bit) = piece {
                        let bit = bit % (len * 8);
                        data[at + bit / 8] ^= 1 << (bit % 8);
                    }
                }
                Piece::Nested(payload) => {
                    let inner = Input::payload(payload);
                    let mut bytes = vec![0u8; align_up(frame_len(&inner))];
                    encode(&mut bytes, frame_len(&inner), Some(1), false, &inner);
                    let outer = Input::payload(&bytes);
                    let at = data.len();
                    data.resize(at + align_up(frame_len(&outer)), 0);
                    encode(&mut data[at..], frame_len(&outer), Some(1), false, &outer);
                }
                Piece::Garbage(words) => {
                    for (a, b) in words {
                        data.extend_from_slice(&a.to_le_bytes());
                        data.extend_from_slice(&b.to_le_bytes());
                    }
                }
                Piece::Zeros(n) => data.resize(data.len() + n, 0),
            }
        }
        data
    }

    proptest::proptest! {
        /// A hole is only a promise of zeros: where the bytes are zeros, knowing it changes
        /// nothing a scan finds.
        #[test]
        fn a_scan_told_of_a_hole_finds_what_reading_it_finds(
            pieces in proptest::collection::vec(piece(), 1..30),
            hole_start in 0usize..3 * 4096,
            hole_len in 0usize..3 * 4096,
        ) {
            let mut data = made_up_segment(&pieces);
            data.resize(data.len() + 4096, 0);
            let hole = hole_start.min(data.len())..(hole_start + hole_len).min(data.len());
            data[hole.clone()].fill(0);
            proptest::prop_assert_eq!(scan_with_hole(Format::CURRENT, &data, 0, 0, hole), scan(Format::CURRENT, &data, 0, 0));
        }

        #[test]
        fn the_one_pass_search_finds_what_checking_each_candidate_finds(
            pieces in proptest::collection::vec(piece(), 1..30),
            from in 0usize..4096,
        ) {
            let data = made_up_segment(&pieces);
            let from = from.min(data.len());
            proptest::prop_assert_eq!(
                find_valid_after(Format::CURRENT, &data, from, 0, usize::MAX),
                first_valid_by_rereading(&data, from)
            );
        }

        /// Wherever a crash stops the writer, a scan keeps the batches written whole and
        /// nothing of the one it stopped in.
        #[test]
        fn a_scan_keeps_whole_batches_wherever_the_writing_stopped(
            sizes in proptest::collection::vec(1usize..6, 1..12),
            payload_len in 0usize..60,
            cut in 0usize..1 << 16,
        ) {
            let (data, starts) = batches(&sizes, &vec![0xa5; payload_len]);
            let cut = cut % (starts[starts.len() - 1] + 1);
            let mut torn = data.clone();
            torn[cut..].fill(0);
            // The batches whose every frame ends by the cut (its padding is zeros anyway).
            let (mut kept, mut first) = (0, 0);
            for &n in &sizes {
                if unpadded_end(&data, starts[first + n - 1]) > cut {
                    break;
                }
                first += n;
                kept = first;
            }
            let s = scan(Format::CURRENT, &torn, 0, 0);
            proptest::prop_assert_eq!((s.end, s.next_offset), (starts[kept], kept as u64));
        }
    }

    /// Where the frame at `pos` of `data` ends, without its padding.
    fn unpadded_end(data: &[u8], pos: usize) -> usize {
        pos + (u32::from_le_bytes(data[pos + 4..pos + 8].try_into().unwrap()) & ((1 << 29) - 1)) as usize
    }

    #[test]
    fn nonzero_extent_finds_garbage_end() {
        let mut data = vec![0u8; 5 * 4096];
        assert_eq!(nonzero_extent(&data, 16, 0..0), 16);
        data[100] = 1;
        data[4096 + 7] = 1;
        assert_eq!(nonzero_extent(&data, 16, 0..0), 4096 + 8);
        // A hole is zeros without a read: a byte there is not looked at.
        assert_eq!(nonzero_extent(&data, 16, 4032..5 * 4096), 101);
        assert_eq!(nonzero_extent(&data, 16, 4096..4096 + 7), 4096 + 8);
        assert_eq!(nonzero_extent(&data, 16, 4096 + 7..4096 + 8), 101);
        assert_eq!(align_up(3), 8);
    }
}
