//! Petrel's storage engine: a crash-safe, append-only log of memory-mapped
//! segment files.
//!
//! ```
//! use petrel_log::{Log, Options};
//!
//! let dir = tempfile::tempdir()?;
//! let mut log = Log::open(dir.path(), Options::default())?;
//! let first = log.append(b"hello")?;
//! log.append_batch(&[b"a".as_slice(), b"b"])?;
//!
//! let mut reader = log.reader();
//! let record = reader.get(first)?.expect("just appended");
//! assert_eq!(record.payload, b"hello");
//! let rest: Vec<Vec<u8>> = reader.read_batch(10)?.into_iter().map(|r| r.payload.to_vec()).collect();
//! assert_eq!(rest, [b"a".to_vec(), b"b".to_vec()]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The on-disk format and the recovery rules are in `docs/format.md`.
//!
//! # Map of the crate
//!
//! | file | owns |
//! | --- | --- |
//! | `log.rs` | [`Log`]: the single writer — open (with recovery), append, batch, roll |
//! | `shared.rs` | [`SharedLog`]: many producer threads through one writer |
//! | `state.rs` | what the writer, readers and groups share: segments, published end, wake-ups |
//! | `commit.rs` | durability: the group commit, poisoning on a failed sync |
//! | `syncer.rs` | the one background thread for `Durability::Interval` (logs and cursors) |
//! | `recovery.rs` | where a segment's valid records end; torn tail vs corruption (also for `verify`) |
//! | `segment.rs`, `directory.rs` | a segment file (header, disk reservation, sync); the directory's lock and listing |
//! | `frame.rs`, `checksum.rs` | the record frame's bytes: encode, decode, CRC32C; the CRC of a range from running checksums |
//! | `mmap.rs` | the only `unsafe`: the shared writable mapping of a segment |
//! | `reader.rs`, `index.rs`, `keys.rs` | reading by position, offset and time; the key index |
//! | `group.rs`, `cursor.rs` | consumer groups and their crash-safe cursor files |
//! | `simple_queue.rs` | [`SimpleQueue`]: a FIFO with one default group (the broker's queues are its own) |
//! | `retention.rs`, `resident.rs`, `prefault.rs` | deleting old segments; the page budget; faulting pages in ahead |
//! | `verify.rs` | offline check, dump and repair |
//! | `options.rs`, `error.rs`, `clock.rs` | settings, errors, record timestamps |

/// The README's Rust snippet, compiled and run as a doc test so that it cannot go stale.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

mod checksum;
mod clock;
mod commit;
mod cursor;
mod directory;
mod error;
mod frame;
mod group;
mod index;
mod keys;
mod log;
#[allow(unsafe_code)] // the one module that maps files; each block says why it is sound
mod mmap;
mod options;
mod prefault;
mod reader;
mod recovery;
mod resident;
mod retention;
mod segment;
mod shared;
mod simple_queue;
mod state;
mod syncer;
pub mod verify;

pub use cursor::{MAX_HELD, MAX_PENDING};
pub use error::{Error, FrameError, Reason, Result};
pub use frame::{FRAME_HEADER_LEN, Header, HeaderIter, Headers, Input, MAX_KEY_LEN, OwnedRecord, Record};
pub use group::{Appends, ConsumerGroup, GroupInfo, GroupOptions, SeekTo};
pub use log::Log;
pub use options::{
    DEFAULT_MAX_RECORD_BYTES, DEFAULT_PAGE_BUDGET_BYTES, DEFAULT_SEGMENT_BYTES, Durability, MAX_MAX_RECORD_BYTES,
    MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES, Options, SyncObserver,
};
pub use reader::{Batch, BatchIter, Reader};
pub use recovery::RecoveryReport;
pub use resident::PageBudget;
pub use retention::{Retention, RetentionReport};
pub use shared::SharedLog;
pub use simple_queue::{QUEUE_GROUP, SimpleQueue};
pub use state::LogStats;

/// Entry points for fuzzers and property tests of the decoders. Not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    use crate::frame::{self, Decoded, Format};

    /// Decodes arbitrary bytes as a frame of each format, the way readers and recovery do. Must
    /// never panic; returns the aligned length of a valid frame.
    pub fn decode_frame(bytes: &[u8]) -> Option<usize> {
        let mut found = None;
        for format in [Format::V1, Format::V2, Format::V3, Format::V4, Format::V5] {
            if let Ok(Decoded::Frame(record, len)) = frame::decode(format, bytes, bytes.len(), 7, 3) {
                // What decode accepted, the trusted decoder must read back the same.
                let (again, len_again) = frame::decode_checked_frame(format, bytes, 7, 3);
                assert_eq!((again, len_again), (record, len));
                assert_eq!(frame::peek_len(format, bytes), Some(len));
                assert_eq!(frame::peek_key(format, bytes), record.key);
                found = Some(len);
            }
        }
        found
    }

    /// Scans arbitrary bytes as a segment's data region of each format, and judges their format,
    /// the way recovery does. Must never panic; returns the end of the valid frames and the next
    /// offset (the current format).
    pub fn scan_segment(data: &[u8], start_offset: u64) -> (usize, u64) {
        for format in [Format::V1, Format::V2, Format::V3, Format::V4] {
            assert!(crate::recovery::scan(format, data, 0, start_offset).end <= data.len());
        }
        let scan = crate::recovery::scan(Format::CURRENT, data, 0, start_offset);
        assert!(scan.end <= data.len());
        // As for a segment whose header is damaged.
        crate::recovery::judge_format(data, start_offset);
        (scan.end, scan.next_offset)
    }

    /// Decodes arbitrary bytes as a segment header. Must never panic.
    pub fn decode_segment_header(bytes: &[u8; 64]) -> bool {
        crate::segment::SegmentHeader::decode(bytes).is_ok()
    }

    /// Reads arbitrary bytes as a consumer group's cursor file, as they are and with `slot_body`
    /// put in its first slot under a valid checksum (so that what follows the check is reached).
    /// Must never panic; returns the committed offsets read.
    pub fn read_cursor_file(bytes: &[u8], slot_body: &[u8]) -> (Option<u64>, Option<u64>) {
        let check = |file: &[u8]| {
            crate::cursor::read(file).map(|(_, state)| {
                // Acknowledged out of order above what is committed, ascending.
                assert!(state.acked_above.windows(2).all(|w| w[0] < w[1]));
                assert!(state.acked_above.first().is_none_or(|&o| o > state.committed));
                // Held below it, ascending.
                assert!(state.held.windows(2).all(|w| w[0] < w[1]));
                assert!(state.held.last().is_none_or(|&o| o < state.committed));
                state.committed
            })
        };
        const LEN: usize = crate::cursor::CURSOR_FILE_LEN;
        let mut file = vec![0u8; LEN];
        let n = bytes.len().min(LEN);
        file[..n].copy_from_slice(&bytes[..n]);
        let raw = check(&file);
        let mut file = vec![0u8; LEN];
        let body = &slot_body[..slot_body.len().min(LEN / 2 - 8)];
        file[..4].copy_from_slice(b"PCUR");
        file[8..8 + body.len()].copy_from_slice(body);
        let len = u32::from_le_bytes(file[24..28].try_into().unwrap()) as usize;
        let held = u32::from_le_bytes(file[28..32].try_into().unwrap()) as usize;
        let end = 32usize.saturating_add(len).saturating_add(held.saturating_mul(8)).min(LEN / 2);
        let crc = crate::checksum::crc32c(&file[8..end]);
        file[4..8].copy_from_slice(&crc.to_le_bytes());
        (raw, check(&file))
    }

    /// Decodes arbitrary bytes as a sealed segment's index file, as they are and with a valid
    /// header and checksum put before `entries`. Must never panic; returns how many entries each
    /// gave.
    pub fn decode_index_file(
        bytes: &[u8],
        entries: &[u8],
        base: u64,
        segment_len: usize,
    ) -> (Option<usize>, Option<usize>) {
        let check = |file: &[u8]| {
            crate::index::decode(file, base, segment_len).map(|entries| {
                assert!(entries.iter().all(|e| e.offset >= base && (e.pos as usize) < segment_len));
                entries.len()
            })
        };
        let raw = check(bytes);
        let mut file = b"PIDX".to_vec();
        file.extend_from_slice(&1u32.to_le_bytes());
        file.extend_from_slice(&base.to_le_bytes());
        file.extend_from_slice(&((entries.len() / 24) as u32).to_le_bytes());
        file.extend_from_slice(&crate::checksum::crc32c(&entries[..entries.len() / 24 * 24]).to_le_bytes());
        file.extend_from_slice(entries);
        (raw, check(&file))
    }
}
