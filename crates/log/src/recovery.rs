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
//! * A bad frame followed by a valid later frame is **corruption**, never silently cut: open fails
//!   with an error naming the file and byte position, and `petrel log repair` is the explicit way
//!   out.

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
    /// (`SEARCH_BUDGET`): taken as corruption, never cut.
    Undecided { error: FrameError, searched_to: usize },
}

/// Bytes of candidate frames the search after a bad frame may checksum before it gives up. A
/// format-2 frame has no magic, so in a damaged stretch (say a large record torn by a crash)
/// many positions look like the start of a frame, each to be checked over its whole claimed
/// length; this bounds that work (about a tenth of a second) and fails safe.
const SEARCH_BUDGET: usize = 1 << 30;

/// What the search after a bad frame found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Later {
    Nothing,
    /// A valid frame at `pos`, and its offset if the frame says it (format 1).
    Found {
        pos: usize,
        offset: Option<u64>,
    },
    /// The budget ran out at `pos`.
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
}

/// Scans `data` (a segment's data region) from relative position `start`, where record
/// `start_offset` is expected.
pub(crate) fn scan(format: Format, data: &[u8], start: usize, start_offset: u64) -> Scan {
    let mut pos = start;
    let mut next = start_offset;
    let mut records = 0;
    loop {
        let rest = &data[pos.min(data.len())..];
        if rest.is_empty() {
            return Scan { end: pos, next_offset: next, records, stop: Stop::Clean };
        }
        let error = match frame::decode(format, rest, rest.len(), next) {
            Ok(Decoded::Frame(rec, len)) if rec.offset == next => {
                pos += len;
                next += 1;
                records += 1;
                continue;
            }
            Ok(Decoded::Frame(..)) => FrameError::WrongOffset,
            Ok(Decoded::Empty) => {
                // Nothing was written here — unless a crash left a frame's body without its
                // header, which shows as non-zero bytes further on.
                let garbage_end = nonzero_extent(data, pos);
                let stop = if garbage_end == pos {
                    Stop::Clean
                } else {
                    classify(format, data, pos, next, garbage_end, FrameError::BadMagic)
                };
                return Scan { end: pos, next_offset: next, records, stop };
            }
            Err(e) => e,
        };
        let garbage_end = nonzero_extent(data, pos).max(pos + FRAME_ALIGN).min(data.len());
        let stop = classify(format, data, pos, next, garbage_end, error);
        return Scan { end: pos, next_offset: next, records, stop };
    }
}

fn classify(format: Format, data: &[u8], pos: usize, next: u64, garbage_end: usize, error: FrameError) -> Stop {
    match find_valid_after(format, data, pos + FRAME_ALIGN, next, SEARCH_BUDGET) {
        Later::Found { pos: later_pos, offset: later_offset } => Stop::Corrupt { error, later_pos, later_offset },
        Later::GaveUp { pos: searched_to } => Stop::Undecided { error, searched_to },
        Later::Nothing => Stop::Torn { error, garbage_end },
    }
}

/// The first valid frame at or after `from` (in format 1, whose offset is at least
/// `min_offset`), checksumming at most `budget` bytes of candidates.
pub(crate) fn find_valid_after(format: Format, data: &[u8], from: usize, min_offset: u64, budget: usize) -> Later {
    let mut pos = from.next_multiple_of(FRAME_ALIGN);
    let mut checked = 0;
    while pos + FRAME_ALIGN <= data.len() {
        if let Some(len) = frame::may_start(format, &data[pos..]) {
            checked += len;
            if checked > budget {
                return Later::GaveUp { pos };
            }
            if let Ok(Decoded::Frame(rec, _)) = frame::decode(format, &data[pos..], data.len() - pos, min_offset) {
                match format {
                    Format::V1 if rec.offset >= min_offset => return Later::Found { pos, offset: Some(rec.offset) },
                    Format::V1 => {}
                    Format::V2 => return Later::Found { pos, offset: None },
                }
            }
        }
        pos += FRAME_ALIGN;
    }
    Later::Nothing
}

/// End of the run of non-zero data starting at `pos`: the first 4 KiB-aligned page boundary after
/// which a whole page is zero (or the end of `data`). Returns `pos` if `[pos, next page)` and the
/// page after are zero.
pub(crate) fn nonzero_extent(data: &[u8], pos: usize) -> usize {
    const PAGE: usize = 4096;
    let mut last_nonzero = None;
    let mut at = pos;
    let mut zero_run_start = pos;
    while at < data.len() {
        let chunk_end = ((at / PAGE) + 1) * PAGE;
        let chunk = &data[at..chunk_end.min(data.len())];
        match chunk.iter().rposition(|&b| b != 0) {
            Some(i) => {
                last_nonzero = Some(at + i);
                zero_run_start = chunk_end;
            }
            None if chunk_end - zero_run_start >= PAGE => break,
            None => {}
        }
        at = chunk_end;
    }
    last_nonzero.map_or(pos, |i| i + 1)
}

/// Finds the end of the valid records of the active segment, cutting a torn tail.
/// Returns the position after the last valid frame and the next offset.
pub(crate) fn recover_active(
    seg: &Segment,
    writer: &mut DataWriter,
    report: &mut RecoveryReport,
) -> Result<(usize, u64)> {
    let header = seg.header();
    let (start, start_offset) = scan_start(seg, &header);
    let data = writer.unpublished_mut();
    let scan = scan(seg.format, data, start - SEGMENT_HEADER_LEN, start_offset);
    report.records_scanned = scan.records;
    let end = SEGMENT_HEADER_LEN + scan.end;
    match scan.stop {
        Stop::Clean => {}
        Stop::Torn { error, garbage_end } => {
            let cut = garbage_end - scan.end;
            tracing::warn!(file = %seg.path.display(), position = end, bytes = cut, %error,
                "cut the torn tail left by an interrupted append");
            data[scan.end..garbage_end].fill(0);
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
    if header.is_err() {
        seg.write_checkpoint(0, seg.base);
    }
    Ok((end, scan.next_offset))
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
            pos += encode(&mut data[pos..], frame_len(&input), off, &input);
        }
        starts.push(pos);
        (data, starts)
    }

    #[test]
    fn clean_segment_scans_to_its_end() {
        let (data, starts) = segment(10, b"abc");
        let s = scan(Format::V2, &data, 0, 0);
        assert_eq!(s, Scan { end: starts[10], next_offset: 10, records: 10, stop: Stop::Clean });
        let s = scan(Format::V2, &data, starts[4], 4);
        assert_eq!((s.end, s.next_offset, s.records), (starts[10], 10, 6));
    }

    #[test]
    fn torn_last_frame_is_cut_at_its_start() {
        let (data, starts) = segment(5, &[9u8; 40]);
        for cut in starts[4] + 1..starts[5] {
            let mut torn = data.clone();
            torn[cut..].fill(0);
            let s = scan(Format::V2, &torn, 0, 0);
            assert_eq!((s.end, s.next_offset), (starts[4], 4), "cut at {cut}");
            assert!(matches!(s.stop, Stop::Torn { .. }), "cut at {cut}: {:?}", s.stop);
        }
    }

    #[test]
    fn body_without_header_is_a_torn_tail() {
        let (mut data, starts) = segment(3, &[9u8; 100]);
        data[starts[2]..starts[2] + 16].fill(0);
        let s = scan(Format::V2, &data, 0, 0);
        assert_eq!(s.end, starts[2]);
        assert_eq!(s.stop, Stop::Torn { error: FrameError::BadMagic, garbage_end: starts[3] - 4 });
    }

    #[test]
    fn damage_before_a_valid_frame_is_corruption() {
        let (mut data, starts) = segment(5, b"hello world");
        data[starts[1] + 20] ^= 1;
        let s = scan(Format::V2, &data, 0, 0);
        assert_eq!(s.end, starts[1]);
        assert_eq!(s.stop, Stop::Corrupt { error: FrameError::BadChecksum, later_pos: starts[2], later_offset: None });
    }

    #[test]
    fn a_large_record_torn_in_random_bytes_is_a_torn_tail() {
        // A 1 MiB payload cut short in a 4 MiB segment: its header not yet written (a large
        // frame's header is stored last), half its bytes, then zeros.
        let (mut data, starts) = segment(3, b"before");
        data.resize(4 << 20, 0);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for b in &mut data[starts[3] + 16..starts[3] + 16 + (512 << 10)] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let s = scan(Format::V2, &data, 0, 0);
        assert_eq!((s.end, s.next_offset), (starts[3], 3));
        assert!(matches!(s.stop, Stop::Torn { .. }), "{:?}", s.stop);
    }

    #[test]
    fn the_search_after_a_bad_frame_gives_up_within_its_budget() {
        // Bytes made so that every other position claims a frame reaching to the end.
        let mut data = vec![0u8; 1 << 20];
        for at in (0..4096).step_by(16) {
            let len = (data.len() - at) as u32;
            data[at + 4..at + 8].copy_from_slice(&len.to_le_bytes());
            data[at] = 1; // a CRC that does not match
        }
        let later = find_valid_after(Format::V2, &data, 0, 0, 4 << 20);
        assert!(matches!(later, Later::GaveUp { pos } if pos < 4096), "{later:?}");
        assert_eq!(find_valid_after(Format::V2, &data, 8192, 0, 4 << 20), Later::Nothing);
    }

    #[test]
    fn nonzero_extent_finds_garbage_end() {
        let mut data = vec![0u8; 5 * 4096];
        assert_eq!(nonzero_extent(&data, 16), 16);
        data[100] = 1;
        data[4096 + 7] = 1;
        assert_eq!(nonzero_extent(&data, 16), 4096 + 8);
        assert_eq!(align_up(3), 8);
    }
}
