//! Deciding where the valid records of a segment end.
//!
//! The rules, also in `docs/format.md`:
//!
//! * Frames are read one after another from a known-good start (the segment start, or the
//!   checkpoint recorded after a sync), each checked for magic, length, CRC, flags and the
//!   expected offset.
//! * Eight zero bytes where a frame would start end the segment: nothing was written there.
//! * A bad frame is a **torn tail** when no valid frame with a later offset follows it anywhere in
//!   the segment: an append that was cut short by a crash. Its bytes are never acknowledged
//!   (acknowledgement follows the write, and for `Always` the sync), so they are cut.
//! * A bad frame followed by a valid later frame is **corruption**, never silently cut: open fails
//!   with an error naming the file and byte position, and `petrel log repair` is the explicit way
//!   out.

use crate::error::FrameError;
use crate::frame::{self, Decoded, FRAME_ALIGN, FRAME_MAGIC};

/// How a scan ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Zero bytes (or the end of the segment) after the last frame; nothing to cut.
    Clean,
    /// A torn tail starting at `end`: `garbage_end` is where its non-zero bytes end.
    Torn { error: FrameError, garbage_end: usize },
    /// A bad frame at `end` with a valid frame (`later_offset` at `later_pos`) after it.
    Corrupt { error: FrameError, later_pos: usize, later_offset: u64 },
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
pub(crate) fn scan(data: &[u8], start: usize, start_offset: u64) -> Scan {
    let mut pos = start;
    let mut next = start_offset;
    let mut records = 0;
    loop {
        let rest = &data[pos.min(data.len())..];
        if rest.is_empty() {
            return Scan { end: pos, next_offset: next, records, stop: Stop::Clean };
        }
        let error = match frame::decode(rest, rest.len()) {
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
                    classify(data, pos, next, garbage_end, FrameError::BadMagic)
                };
                return Scan { end: pos, next_offset: next, records, stop };
            }
            Err(e) => e,
        };
        let garbage_end = nonzero_extent(data, pos).max(pos + FRAME_ALIGN).min(data.len());
        let stop = classify(data, pos, next, garbage_end, error);
        return Scan { end: pos, next_offset: next, records, stop };
    }
}

fn classify(data: &[u8], pos: usize, next: u64, garbage_end: usize, error: FrameError) -> Stop {
    match find_valid_after(data, pos + FRAME_ALIGN, next) {
        Some((later_pos, later_offset)) => Stop::Corrupt { error, later_pos, later_offset },
        None => Stop::Torn { error, garbage_end },
    }
}

/// The first valid frame at or after `from` whose offset is at least `min_offset`.
pub(crate) fn find_valid_after(data: &[u8], from: usize, min_offset: u64) -> Option<(usize, u64)> {
    let mut pos = from.next_multiple_of(FRAME_ALIGN);
    while pos + FRAME_ALIGN <= data.len() {
        if data[pos..pos + 4] == FRAME_MAGIC
            && let Ok(Decoded::Frame(rec, _)) = frame::decode(&data[pos..], data.len() - pos)
            && rec.offset >= min_offset
        {
            return Some((pos, rec.offset));
        }
        pos += FRAME_ALIGN;
    }
    None
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
            pos += encode(&mut data[pos..], frame_len(&input), off, off, &input);
        }
        starts.push(pos);
        (data, starts)
    }

    #[test]
    fn clean_segment_scans_to_its_end() {
        let (data, starts) = segment(10, b"abc");
        let s = scan(&data, 0, 0);
        assert_eq!(s, Scan { end: starts[10], next_offset: 10, records: 10, stop: Stop::Clean });
        let s = scan(&data, starts[4], 4);
        assert_eq!((s.end, s.next_offset, s.records), (starts[10], 10, 6));
    }

    #[test]
    fn torn_last_frame_is_cut_at_its_start() {
        let (data, starts) = segment(5, &[9u8; 40]);
        for cut in starts[4] + 1..starts[5] {
            let mut torn = data.clone();
            torn[cut..].fill(0);
            let s = scan(&torn, 0, 0);
            assert_eq!((s.end, s.next_offset), (starts[4], 4), "cut at {cut}");
            assert!(matches!(s.stop, Stop::Torn { .. }), "cut at {cut}: {:?}", s.stop);
        }
    }

    #[test]
    fn body_without_header_is_a_torn_tail() {
        let (mut data, starts) = segment(3, &[9u8; 100]);
        data[starts[2]..starts[2] + 32].fill(0);
        let s = scan(&data, 0, 0);
        assert_eq!(s.end, starts[2]);
        assert_eq!(s.stop, Stop::Torn { error: FrameError::BadMagic, garbage_end: starts[3] - 4 });
    }

    #[test]
    fn damage_before_a_valid_frame_is_corruption() {
        let (mut data, starts) = segment(5, b"hello world");
        data[starts[1] + 40] ^= 1;
        let s = scan(&data, 0, 0);
        assert_eq!(s.end, starts[1]);
        assert_eq!(s.stop, Stop::Corrupt { error: FrameError::BadChecksum, later_pos: starts[2], later_offset: 2 });
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
