//! Petrel's storage engine: a crash-safe, append-only log of preallocated, memory-mapped
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

mod error;
mod frame;
mod log;
mod mmap;
mod options;
mod prefault;
mod reader;
mod recovery;
mod segment;
mod shared;
pub mod verify;

pub use error::{Error, FrameError, Reason, Result};
pub use frame::{FRAME_HEADER_LEN, Header, HeaderIter, Headers, Input, MAX_KEY_LEN, OwnedRecord, Record};
pub use log::{Log, LogStats, RecoveryReport};
pub use options::{
    DEFAULT_MAX_RECORD_BYTES, DEFAULT_SEGMENT_BYTES, Durability, MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES, Options,
};
pub use reader::{Batch, BatchIter, Reader};
pub use shared::SharedLog;
