use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};

/// When appended records reach stable storage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Records live in the page cache: they survive a crash of the process, not of the machine.
    #[default]
    None,
    /// A background thread syncs at this interval: a machine crash loses at most that much.
    Interval(Duration),
    /// An append returns only once its record is on stable storage. Concurrent appends through a
    /// [`SharedLog`](crate::SharedLog) share one sync (group commit).
    Always,
}

impl FromStr for Durability {
    type Err = String;

    /// `none`, `always`, or `interval:MS` (milliseconds, fractions allowed: `interval:0.05`), from
    /// `MIN_SYNC_INTERVAL` to `MAX_SYNC_INTERVAL`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Durability::None),
            "always" => Ok(Durability::Always),
            _ => {
                let ms = s
                    .strip_prefix("interval:")
                    .and_then(|ms| ms.parse::<f64>().ok())
                    .filter(|ms| ms.is_finite() && *ms > 0.0)
                    .ok_or_else(|| format!("durability must be none, always or interval:MS, not {s:?}"))?;
                // (Checked as a number first: a duration of 1e300 ms does not exist, and the sync
                // thread adds it to the clock.)
                let (least, most) =
                    (MIN_SYNC_INTERVAL.as_secs_f64() * 1000.0, MAX_SYNC_INTERVAL.as_secs_f64() * 1000.0);
                if !(least..=most).contains(&ms) {
                    return Err(format!("a durability interval must be from {least} to {most} ms, not {s:?}"));
                }
                Ok(Durability::Interval(Duration::from_secs_f64(ms / 1000.0)))
            }
        }
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Durability::None => f.write_str("none"),
            Durability::Always => f.write_str("always"),
            Durability::Interval(d) => write!(f, "interval:{}", d.as_secs_f64() * 1000.0),
        }
    }
}

/// How a log is opened. Every limit has a default; `validate` says what is out of range.
#[derive(Clone, Debug)]
pub struct Options {
    /// Length of each segment file (its disk blocks are reserved as the writer reaches them).
    pub segment_bytes: u64,
    /// If set, the first segment has this size (at most `segment_bytes`) and each next one twice
    /// the last, up to `segment_bytes`: a log that stays small takes little disk. Default: 1 MiB
    /// (a new log of two records takes 1 MiB, not 256). `None`: every segment `segment_bytes`.
    pub initial_segment_bytes: Option<u64>,
    /// Largest record (payload + key + headers) accepted by `append`.
    pub max_record_bytes: usize,
    pub durability: Durability,
    /// Create the log when there is none: its directory and its first segment. Without it, a
    /// directory that holds no segment is refused (`Error::NotALog`).
    pub create: bool,
    /// Keep a map from each key to the last record with that key (`Reader::get_by_key`). It
    /// lives in memory and is rebuilt from the log on open (a walk over every frame header).
    pub key_index: bool,
    /// What may delete old records (nothing, by default).
    pub retention: crate::Retention,
    /// Resident memory allowed for mapped segments' pages; past it, the least recently used
    /// segments give their pages back. Logs opened with clones of one `Options` share it (a
    /// server gives all its queue logs one); `Options::default()` makes a new one of
    /// `DEFAULT_PAGE_BUDGET_BYTES`.
    pub page_budget: crate::PageBudget,
    /// Lock the log's directory (flock) while the writer lives, so a second writer in any
    /// process is refused. `false` only where something else guarantees a single writer, such
    /// as a server holding the lock of a directory that contains its logs: it saves the one
    /// descriptor a log otherwise keeps open.
    pub lock_directory: bool,
    /// Told how long each data sync (fdatasync) of a segment took.
    pub on_sync: SyncObserver,
}

/// Told the duration of every data sync of the logs opened with it (clones share it): a server
/// feeds its fsync latency histogram from it. None by default.
#[derive(Clone, Default)]
pub struct SyncObserver(Option<Arc<dyn Fn(Duration) + Send + Sync>>);

impl SyncObserver {
    pub fn new(observe: impl Fn(Duration) + Send + Sync + 'static) -> SyncObserver {
        SyncObserver(Some(Arc::new(observe)))
    }

    /// Runs `sync`, telling the observer how long it took.
    pub(crate) fn time<T>(&self, sync: impl FnOnce() -> T) -> T {
        let Some(observe) = &self.0 else { return sync() };
        let started = std::time::Instant::now();
        let result = sync();
        observe(started.elapsed());
        result
    }
}

impl fmt::Debug for SyncObserver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "SyncObserver(set)" } else { "SyncObserver(none)" })
    }
}

pub const DEFAULT_PAGE_BUDGET_BYTES: u64 = 1 << 30;

pub const DEFAULT_SEGMENT_BYTES: u64 = 256 << 20;
pub const DEFAULT_INITIAL_SEGMENT_BYTES: u64 = 1 << 20;
pub const MIN_SEGMENT_BYTES: u64 = 64 << 10;
/// Frame positions are stored in 32 bits (see `docs/format.md`).
pub const MAX_SEGMENT_BYTES: u64 = (4 << 30) - 4096;
pub const DEFAULT_MAX_RECORD_BYTES: usize = 16 << 20;
/// A frame's length has 29 bits (format 5): a record of this size and its header fit.
pub const MAX_MAX_RECORD_BYTES: usize = (1 << 29) - 64;
const _: () = assert!(MAX_MAX_RECORD_BYTES + 64 <= crate::frame::MAX_FRAME_LEN + 1);

impl Default for Options {
    fn default() -> Self {
        Options {
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            initial_segment_bytes: Some(DEFAULT_INITIAL_SEGMENT_BYTES),
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            durability: Durability::None,
            create: true,
            key_index: false,
            retention: crate::Retention::default(),
            page_budget: crate::PageBudget::new(DEFAULT_PAGE_BUDGET_BYTES),
            lock_directory: true,
            on_sync: SyncObserver::default(),
        }
    }
}

impl Options {
    /// The size of a new log's first segment.
    pub fn first_segment_bytes(&self) -> u64 {
        self.initial_segment_bytes.map_or(self.segment_bytes, |initial| initial.min(self.segment_bytes))
    }

    pub fn validate(&self) -> Result<()> {
        if !(MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(&self.segment_bytes)
            || !self.segment_bytes.is_multiple_of(4096)
        {
            return Err(Error::Config(format!(
                "segment_bytes must be a multiple of 4096 between {MIN_SEGMENT_BYTES} and {MAX_SEGMENT_BYTES}, not {}",
                self.segment_bytes
            )));
        }
        if let Some(initial) = self.initial_segment_bytes
            && (initial < MIN_SEGMENT_BYTES || !initial.is_multiple_of(4096))
        {
            return Err(Error::Config(format!(
                "initial_segment_bytes must be a multiple of 4096 of at least {MIN_SEGMENT_BYTES}, not {initial}"
            )));
        }
        if self.max_record_bytes == 0 || self.max_record_bytes > MAX_MAX_RECORD_BYTES {
            return Err(Error::Config(format!(
                "max_record_bytes must be between 1 and {MAX_MAX_RECORD_BYTES}, not {}",
                self.max_record_bytes
            )));
        }
        self.durability.check()
    }
}

/// The shortest `interval` durability: shorter, the one sync thread of the process would do
/// nothing but sync (zero made it spin).
pub const MIN_SYNC_INTERVAL: Duration = Duration::from_micros(10);

/// The longest `interval` durability read from text: about 31 years, far past any use (a queue's
/// definition on disk may say hours), and far from the clock's end when added to it.
pub const MAX_SYNC_INTERVAL: Duration = Duration::from_secs(1_000_000_000);

impl Durability {
    /// Whether a log or a consumer group may have this durability.
    pub(crate) fn check(self) -> Result<()> {
        match self {
            Durability::Interval(d) if d < MIN_SYNC_INTERVAL => Err(Error::Config(format!(
                "a durability interval must be at least {} µs (interval:0.01)",
                MIN_SYNC_INTERVAL.as_micros()
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A durability's text is checked before it becomes a duration: one too long for a
    /// `Duration` panicked (and a client's QUEUE_CREATE could send it), one too short passed
    /// here and left every log using it unopenable.
    #[test]
    fn durability_intervals_out_of_range_are_refused_not_a_panic() {
        assert_eq!("interval:0.05".parse::<Durability>(), Ok(Durability::Interval(Duration::from_micros(50))));
        // (Long ones stay valid: a queue's definition on disk may say so.)
        assert_eq!("interval:7200000".parse::<Durability>(), Ok(Durability::Interval(Duration::from_secs(7200))));
        for bad in ["interval:1e300", "interval:1e22", "interval:0.005", "interval:0", "interval:-1", "interval:nan"] {
            assert!(bad.parse::<Durability>().is_err(), "{bad}");
        }
    }
}
