use std::fmt;
use std::io;
use std::path::PathBuf;

/// Why bytes at a position are not a valid frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic")]
    BadMagic,
    #[error("frame length out of range")]
    BadLength,
    #[error("frame runs past the end of the segment")]
    Truncated,
    #[error("CRC32C mismatch")]
    BadChecksum,
    #[error("unknown flag bits")]
    UnknownFlags,
    #[error("malformed headers block")]
    BadHeaders,
    #[error("unexpected offset")]
    WrongOffset,
    #[error("key longer than 65535 bytes")]
    KeyTooLong,
    #[error("header name longer than 65535 bytes or value longer than 4 GiB")]
    HeaderTooLong,
    #[error("a batch's last frame is missing")]
    UnfinishedBatch,
}

/// Everything that can go wrong in the log. Each variant says what to do about it in its text.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op} {}: {source}", path.display())]
    Io { op: &'static str, path: PathBuf, source: io::Error },

    #[error("log {} is already open for writing by another process (its directory is locked)", path.display())]
    Locked { path: PathBuf },

    #[error("cannot allocate segment {} ({size} bytes): {source} — is the disk full?", path.display())]
    SegmentAllocation { path: PathBuf, size: u64, source: io::Error },

    #[error("record of {size} bytes exceeds the maximum of {max} bytes")]
    RecordTooLarge { size: usize, max: usize },

    #[error("invalid record: {0}")]
    InvalidRecord(FrameError),

    #[error("corrupt log: {} at byte {position}{}: {reason}{}", file.display(),
        offset.map(|o| format!(" (record {o})")).unwrap_or_default(),
        if *before_tail { " — this is not a torn tail; run `petrel log verify` and `petrel log repair`" } else { "" })]
    Corrupt { file: PathBuf, position: u64, offset: Option<u64>, reason: Reason, before_tail: bool },

    #[error("segment {} is of a format this build does not read ({what}): it was written by a newer \
        Petrel, which must open it (nothing was changed)", file.display())]
    UnsupportedFormat { file: PathBuf, what: String },

    #[error("log is poisoned after a failed sync, nothing more can be written or trusted in this process: {0}")]
    Poisoned(String),

    #[error("consumer group {0:?} is already open in this process")]
    GroupInUse(String),

    #[error("the log has {groups} consumer groups, the most it was opened to keep ({max})")]
    TooManyGroups { groups: usize, max: usize },

    #[error("consumer group {0:?} does not exist")]
    NoSuchGroup(String),

    #[error("consumer group {group:?} has {max} records delivered and unacknowledged: acknowledge some first")]
    TooManyPending { group: String, max: usize },

    #[error("record {offset} is not pending in consumer group {group:?} (never delivered, or already acknowledged)")]
    NotDelivered { group: String, offset: u64 },

    #[error("invalid configuration: {0}")]
    Config(String),

    #[error("log directory {} is not a Petrel log: {reason}", path.display())]
    NotALog { path: PathBuf, reason: String },
}

/// What is wrong with corrupt bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    Frame(FrameError),
    Gap { expected: u64, found: u64 },
    Missing { expected: u64 },
    Other(String),
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Frame(e) => write!(f, "{e}"),
            Reason::Gap { expected, found } => {
                write!(f, "expected record {expected}, found {found}")
            }
            Reason::Missing { expected } => write!(f, "record {expected} is missing"),
            Reason::Other(s) => f.write_str(s),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}

/// Corruption found in `file` at byte `position` (record `offset`, if known).
pub(crate) fn corrupt(file: &std::path::Path, position: u64, offset: Option<u64>, reason: Reason) -> Error {
    Error::Corrupt { file: file.to_path_buf(), position, offset, reason, before_tail: true }
}
