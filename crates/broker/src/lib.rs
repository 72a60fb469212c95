//! Petrel's broker: destinations and their semantics, over `petrel-log`. It does no I/O of its
//! own beyond the logs and one definitions file, holds no sockets and runs no timers: protocols
//! call it, and the server waits (on each queue's `Notify`) and ticks it.
//!
//! Queues: bounded (refuse when full) or circular (drop the oldest), durable (a `petrel-log` per
//! queue, contents survive restarts) or in memory, temporary (owned by a connection), with
//! tentative reads (ack, abort, visibility timeout, disconnect), expiry with dead letters, and
//! fanout (offering to `q` also offers to every queue named `q+<child>`).
//!
//! Queue configuration comes from the queue's creator, or, for queues created by first use (the
//! memcache protocol) and for queues named in the server's configuration, from the broker's
//! options: a block per name, a fanout child inheriting its parent's, else the defaults.
//!
//! The map of the crate (each concept in the file that owns it):
//! - `lib.rs`: the `Broker` — the registry of queues and topics, their definitions file,
//!   offers, polls, calls and the tick; `BrokerError`, `BrokerOptions`;
//! - `config.rs`: what the broker makes of a queue's configuration (`petrel_proto::QueueConfig`):
//!   validation, its durability policy, which changes a live queue takes;
//! - `queue.rs`: one queue — in memory or over a log, tentative reads, expiry, the memory budget;
//! - `waiting.rs`: waiting on a queue for messages or room (`Broker::wait_on_queue`);
//! - `message.rs`: how a `petrel_proto::Message` is stored as a log record, id ↔ offset;
//! - `topic.rs`: topics — live subscribers, a durable topic's log and its consumer groups;
//! - `group_feed.rs`: a consumer group as a subscriber reads it, with its flow control;
//! - `function.rs`: functions — who serves a name, calls waiting for replies, timeouts;
//! - `security/`: users (Argon2id hashes), ACLs, who may do what;
//! - `counting.rs`: counters that go down as well as up, asserted never below zero.

#![forbid(unsafe_code)]

pub mod config;
mod counting;
mod dedup;
mod delay;
mod function;
mod group_feed;
mod held;
mod message;
mod queue;
pub mod security;
mod topic;
mod waiting;
mod waitlist;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::Duration;

/// A map keyed by numbers the server hands out itself (log offsets, delivery handles): hashed
/// with foldhash, several times cheaper than SipHash, which guards against keys an attacker
/// picks, and no client picks these.
pub(crate) type NumberMap<V> = HashMap<u64, V, foldhash::fast::RandomState>;

/// A durable queue's record `offset` handed out now or last, given how many times each record
/// came back (`returns`): its deliveries, this one included.
pub(crate) fn deliveries_of(returns: &NumberMap<u32>, offset: u64) -> u32 {
    returns.get(&offset).map_or(1, |n| n + 1)
}

pub use config::QueueConfig;
#[doc(hidden)]
pub use delay::limit_ready_runs;
pub use function::{
    CallObserver, Called, FunctionStats, FunctionStatus, Invocation, LocalHandler, MAX_CALLS_WAITING_PER_SERVER,
    Replier,
};
pub use group_feed::{GroupAcks, GroupFeed, GroupReader};
pub use held::HELD_OVERHEAD;
pub use message::{Message, MessageKind, Status, answer_len_bound, id_of, offset_of};
pub use petrel_log::SeekTo;
pub use petrel_proto::{Delivery, GroupStats, QueueStats, TopicStats};
pub use queue::{Leaving, MemoryBudget, MemoryHold, OpenRead, Polled, Queue, QueueCounters, TICK_RETRY_NS, TickAlarm};
pub use topic::{Delivered, Ended, MAX_GROUPS_PER_TOPIC, OpenGroup, Subscription, Topic};
pub use waiting::{WaitFor, Waited};

use security::{Action, Kind, Principal, Security};

use petrel_log::{Durability, Log, Options};
use serde::{Deserialize, Serialize};

/// Identifies a connection (or any consumer) for tentative reads and temporary queues.
pub type ConnId = u64;

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("no queue named {:?}", shown(.0))]
    NotFound(String),
    /// A durable topic's consumer group that does not exist (named by an admin request).
    #[error("topic {:?} has no consumer group {:?}", shown(.topic), shown(.group))]
    GroupNotFound { topic: String, group: String },
    #[error("queue {:?} is full", shown(.0))]
    Full(String),
    /// The queue (named first) exists as another (how, second: its settings that differ, or
    /// that it belongs to another connection).
    #[error("queue {:?} exists with another configuration: {}", shown(.0), .1)]
    Exists(String, String),
    /// A topic asked for with the other durability than the one of its name.
    #[error("topic {:?} exists and is {}: remove it first to make it anew", shown(.0), if *.1 { "durable" } else { "not durable" })]
    TopicExists(String, bool),
    /// Something held by another that is let go in a moment (a consumer group subscribed).
    #[error("{0}")]
    Held(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("message of {size} bytes exceeds the limit of {max}")]
    TooLarge { size: usize, max: usize },
    /// Shown with file names inside the data directory only (clients see this text; the
    /// server's absolute paths are not theirs to know). `Debug` has the whole error.
    #[error("storage: {}", storage_text(.0))]
    Storage(#[from] petrel_log::Error),
    #[error("definitions file: {0}")]
    Definitions(String),
    /// A queue or a durable topic (`kind`) whose files could not be opened at start (or at the
    /// last reload): not served, and not made anew under its name, until it is repaired.
    #[error(
        "{kind} {:?} is not served: its files could not be opened ({reason}); an admin may repair its logs in place (POST /api/v1/{kind}s/NAME/repair: each is cut at its first bad record), or fix its files and restart (or reload, for a queue)",
        shown(name)
    )]
    Damaged { kind: &'static str, name: String, reason: String },
    #[error("no topic named {:?}", shown(.0))]
    TopicNotFound(String),
    #[error("no server for function {:?}", shown(.0))]
    FunctionNotFound(String),
    /// The function's handler failed, or its server went away.
    #[error("{0}")]
    Handler(String),
    #[error("{0}")]
    Timeout(String),
    /// Not authenticated (or no longer a user).
    #[error("{0}")]
    Unauthorized(String),
    /// Authenticated, and not allowed to do this.
    #[error("{0}")]
    Forbidden(String),
    /// More than the queue can ever hold at once: waiting for room would not help.
    #[error("{0}")]
    NeverFits(String),
    /// A server-wide or per-user limit (queues, memory); the text names the setting.
    #[error("{0}")]
    Limit(String),
    #[error("data directory {} is in use by another petrel server (it is locked)", .0.display())]
    DataDirLocked(PathBuf),
}

impl BrokerError {
    /// The response status that reports this error.
    pub fn status(&self) -> Status {
        match self {
            BrokerError::NotFound(_) => Status::QueueNotFound,
            BrokerError::Full(_) => Status::QueueFull,
            BrokerError::Exists(..) | BrokerError::TopicExists(..) | BrokerError::Held(_) => Status::Exists,
            BrokerError::BadRequest(_) => Status::BadRequest,
            BrokerError::TooLarge { .. } | BrokerError::NeverFits(_) => Status::TooLarge,
            BrokerError::Storage(_)
            | BrokerError::Definitions(_)
            | BrokerError::Damaged { .. }
            | BrokerError::DataDirLocked(_) => Status::ServerError,
            BrokerError::TopicNotFound(_) | BrokerError::GroupNotFound { .. } => Status::TopicNotFound,
            BrokerError::FunctionNotFound(_) => Status::FunctionNotFound,
            BrokerError::Handler(_) => Status::HandlerError,
            BrokerError::Timeout(_) => Status::Timeout,
            BrokerError::Unauthorized(_) => Status::Unauthorized,
            BrokerError::Forbidden(_) => Status::Forbidden,
            BrokerError::Limit(_) => Status::LimitReached,
        }
    }
}

/// Where this broker's handles, subscription ids and call ids start: its start time in ns, so
/// that a handle a client kept from before a restart (and sends again on its new connection)
/// is none of this one's (counted from 1, an old handle named a new read of the new connection,
/// and its ACK settled a message its consumer never saw). The broker before it handed out
/// fewer ids than nanoseconds passed, so the ranges never meet (until the year 2554).
fn first_handle() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.as_nanos()).unwrap_or(1).max(1)
}

/// The header a dead letter carries: why it was moved (`expired` or `max_deliveries`).
pub const DEAD_LETTER_REASON: &str = "petrel-dead-letter-reason";
/// The header a message moved at its delivery limit carries: how many times it was handed out.
pub const DEAD_LETTER_DELIVERIES: &str = "petrel-deliveries";

/// Most headers a message may carry: the wire counts them in a `u16`, and a dead letter gets
/// two more (`DEAD_LETTER_REASON`, `DEAD_LETTER_DELIVERIES`).
pub const MAX_HEADERS: usize = u16::MAX as usize - 2;

/// Why a message went to its queue's dead-letter queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeadReason {
    Expired,
    MaxDeliveries,
}

impl DeadReason {
    fn as_str(self) -> &'static str {
        match self {
            DeadReason::Expired => "expired",
            DeadReason::MaxDeliveries => "max_deliveries",
        }
    }
}

/// A name as an error shows it: a client may send 64 KiB of one, and errors echo it back.
pub fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 64;
    if name.len() <= MAX {
        return name.into();
    }
    let mut end = MAX;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &name[..end]).into()
}

/// Server-wide settings of the broker.
#[derive(Clone, Debug)]
pub struct BrokerOptions {
    /// Durability of durable queues' logs, unless their configuration names one.
    pub durability: Durability,
    /// Largest segment of a durable queue's log. Segments start at `INITIAL_SEGMENT_BYTES` and
    /// double up to this, so thousands of small queues take little disk.
    pub segment_bytes: u64,
    /// Largest message payload (plus headers) accepted.
    pub max_message_bytes: usize,
    /// A poll's answer holds at most this many bytes of messages (a protocol's frame must hold
    /// it); the first message always goes, whatever its size.
    pub max_poll_bytes: u64,
    /// Configuration of queues created by first use, when no block below names them.
    pub queue_defaults: QueueConfig,
    /// Queues named in the server's configuration: created at open, and their configuration
    /// replaces the stored one.
    pub queues: BTreeMap<String, QueueConfig>,
    /// What a durable topic's log keeps (its oldest segments go past these; groups that had not
    /// read them skip them, counted); 0: no cap.
    pub topic_max_bytes: u64,
    pub topic_max_age: Duration,
    /// Users and ACLs; `None`: authentication is off and every connection may do everything.
    pub security: Option<Security>,
    /// Queues an ordinary user may have created and not yet removed (temporary ones, and those
    /// made by first use), counted since open; 0: no limit.
    pub max_queues_per_user: usize,
    /// Queues of all kinds the server holds at most (0: no limit); a creation past it is refused.
    /// Queues already on disk are opened at start whatever their number.
    pub max_queues: usize,
    /// Topics the server holds at most (0: no limit); a creation past it is refused. Durable
    /// topics already on disk are opened at start whatever their number.
    pub max_topics: usize,
    /// Bytes all in-memory queues together may hold (0: no limit); past it their offers are
    /// refused with `Limit`.
    pub max_memory_bytes: u64,
    /// Bytes an in-memory queue holds at most when its configuration sets no `max_bytes`
    /// (0: no limit of its own; the budget above still holds).
    pub memory_queue_max_bytes: u64,
    /// Bytes of messages the broker holds for one topic subscriber that has not taken them;
    /// past it the subscriber is ended as too slow, as past its buffer's message count.
    pub max_subscriber_bytes: u64,
    /// Resident memory all durable queue and topic logs together may hold in their segments'
    /// mapped pages (0: no limit); past it the least recently used segments give their pages
    /// back (to the page cache: nothing is lost, a later read faults them in again).
    pub max_resident_bytes: u64,
    /// Told the duration of every data sync of a durable log (the server's fsync histogram).
    pub on_sync: petrel_log::SyncObserver,
    /// Told each answered function call's duration (the server's latency histogram).
    pub on_call: CallObserver,
}

impl Default for BrokerOptions {
    fn default() -> Self {
        BrokerOptions {
            durability: Durability::None,
            segment_bytes: 64 << 20,
            max_message_bytes: 16 << 20,
            max_poll_bytes: 16 << 20,
            queue_defaults: QueueConfig::default(),
            queues: BTreeMap::new(),
            topic_max_bytes: 1 << 30,
            topic_max_age: Duration::from_secs(7 * 24 * 3600),
            security: None,
            max_queues_per_user: 0,
            max_queues: 0,
            max_topics: 0,
            max_memory_bytes: 0,
            max_resident_bytes: petrel_log::DEFAULT_PAGE_BUDGET_BYTES,
            on_sync: petrel_log::SyncObserver::default(),
            on_call: CallObserver::default(),
            memory_queue_max_bytes: 0,
            max_subscriber_bytes: 64 << 20,
        }
    }
}

pub const INITIAL_SEGMENT_BYTES: u64 = 128 << 10;

#[derive(Serialize, Deserialize)]
struct Definition {
    name: String,
    config: QueueConfig,
    /// Made by first use (`Queue::follows_defaults`); absent (false) in definitions written
    /// before it was recorded, which keep their configuration as they did.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    follows_defaults: bool,
}

pub struct Broker {
    dir: PathBuf,
    /// An exclusive flock(2) on the data directory, held while the broker lives: two servers on
    /// one directory would overwrite each other's definitions, whatever their queues are.
    _lock: std::fs::File,
    options: BrokerOptions,
    registry: RwLock<Registry>,
    /// Bytes held by in-memory queues, against `max_memory_bytes`.
    memory: Arc<MemoryBudget>,
    /// Small calls waiting for their servers while `memory` is full (`SMALL_CALLS_PAST_BUDGET`).
    small_calls_past_budget: Arc<MemoryBudget>,
    /// Pages of every durable log's segments, against `max_resident_bytes`.
    pages: petrel_log::PageBudget,
    /// Serializes changes to the set of queues and their definitions files; holds the names of
    /// queues being created, whose files are made outside it (`create_queue`), so that
    /// creations of different queues go on side by side.
    definitions: Mutex<HashSet<String>>,
    /// Woken when a creation ends (a name leaves `definitions`).
    creation_ended: Condvar,
    /// The options' `queue_defaults` and `queues`, as a reload last set them.
    configured: RwLock<Configured>,
    /// Queues whose files could not be opened (a damaged definition or log): the others are
    /// served meanwhile (`BrokerError::Damaged`); a repair or a reload tries them again.
    damaged: DamagedList,
    /// Durable topics whose logs could not be opened, likewise.
    damaged_topics: DamagedList,
    next_handle: AtomicU64,
    created: AtomicU64,
    removed: AtomicU64,
    /// What the queues removed since open had counted (`total_offered`, `total_polled` at their
    /// removal): server-wide totals add them, so that they never go back.
    removed_offered: AtomicU64,
    removed_polled: AtomicU64,
    /// Topics live in memory: at most once, gone with the server.
    topics: RwLock<HashMap<String, Arc<Topic>>>,
    /// Held while a topic's directory is worked on: a durable topic made (its log opened), one
    /// removed (its directory renamed away), the tick's retention of every topic. The registry's
    /// lock is held for its map only, so that the publishes, subscribes and disconnects that
    /// read it (on the server's runtime threads) never wait for the disk; and a topic made again
    /// under a removed one's name never has the old one's directory, nor retention's hands on it.
    topic_dirs: Mutex<()>,
    functions: function::Functions,
    /// Users and ACLs in force (replaced whole on reload); `None`: authentication is off.
    security: RwLock<Option<Arc<Security>>>,
    /// `security` is `Some`: checked first, so that with authentication off a request's checks
    /// take no lock (they are on every request's path). Never set back: a reload keeps it on.
    secured: AtomicBool,
    /// Requests refused by `authorize`.
    denials: AtomicU64,
    /// Queues created by ordinary users, for `max_queues_per_user`.
    created_by: Mutex<CreatedBy>,
    /// Rung by a queue whose work comes due before the next tick (`tick`'s caller waits on it).
    alarm: Arc<TickAlarm>,
    /// When `tick` last applied the durable topics' caps to their active segments.
    topics_given_back_at: AtomicU64,
    /// Bytes of segment files `tick` deleted (`given_back_bytes`).
    given_back: AtomicU64,
}

/// How often `tick` applies the durable topics' age caps to their active segments, which a topic
/// nobody publishes to would otherwise keep for ever (`SharedLog::give_back`).
const TOPIC_GIVE_BACK_EVERY_NS: u64 = 10_000_000_000;

/// A call this small (with what holding it takes) goes even when the memory budget is full (in-
/// memory queues may fill it), within `SMALL_CALLS_PAST_BUDGET` for all such calls together.
const SMALL_CALL_BYTES: u64 = 64 << 10;
/// What small calls may hold past a full memory budget, all together.
const SMALL_CALLS_PAST_BUDGET: u64 = 64 << 20;

/// A queue opened from its directory, or the name of one that could not be, and why.
type Opened = Result<Arc<Queue>, (String, BrokerError)>;

/// Names (of queues, or of topics) whose files could not be opened, each with why: not served,
/// and not made anew over those files.
#[derive(Default)]
struct DamagedList(RwLock<BTreeMap<String, String>>);

impl DamagedList {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, String>> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, String>> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&self, name: &str, why: String) {
        self.write().insert(name.to_owned(), why);
    }

    fn remove(&self, name: &str) -> Option<String> {
        self.write().remove(name)
    }

    fn contains(&self, name: &str) -> bool {
        self.read().contains_key(name)
    }

    fn names(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    fn list(&self) -> Vec<(String, String)> {
        self.read().iter().map(|(n, why)| (n.clone(), why.clone())).collect()
    }

    /// `Damaged` for `name` if it is listed (`kind`: what it is), else `missing`.
    fn error(&self, kind: &'static str, name: &str, missing: impl FnOnce() -> BrokerError) -> BrokerError {
        match self.read().get(name) {
            Some(reason) => BrokerError::Damaged { kind, name: name.to_owned(), reason: reason.clone() },
            None => missing(),
        }
    }
}

/// What an offer did (`Broker::offer_unsynced`).
#[must_use = "an offer is answered only after its wait"]
pub struct Offered {
    /// The id the offer is answered with: its first stored message's, or the first original's
    /// for an offer of repeats only (it gets the answer the originals got).
    pub first_id: u64,
    /// Messages stored; the offer's count for one of repeats only.
    pub count: u32,
    /// Messages not stored because their idempotency key repeats one the queue remembers (or
    /// one earlier in the offer).
    pub repeats: u32,
    /// What the answer waits for.
    pub unsynced: UnsyncedOffer,
}

/// An offer stored and not yet known to be on disk (`Broker::offer_unsynced`).
#[must_use = "an offer is answered only after its wait"]
#[derive(Default)]
pub struct UnsyncedOffer {
    /// The queue offered to and its last record, if its log syncs every offer.
    queue: Option<(Arc<Queue>, queue::Unsynced)>,
    /// The same for the fanout copies.
    children: Vec<(Arc<Queue>, queue::Unsynced)>,
}

impl UnsyncedOffer {
    /// Whether `wait` has nothing to wait for (no queue of the offer syncs each offer).
    pub fn is_durable(&self) -> bool {
        self.queue.is_none() && self.children.is_empty()
    }

    /// Which queue the offer waits for, as a number: offers with the same number share syncs
    /// (a server groups its waits by it).
    pub fn queue_id(&self) -> usize {
        let queue = self.queue.as_ref().or(self.children.first()).map(|(queue, _)| queue);
        queue.map_or(0, |q| Arc::as_ptr(q) as usize)
    }

    /// Blocks until the offer is on disk (one sync covers the offers of every producer that
    /// appended before it started), then hands its messages to consumers. A fanout copy that
    /// could not be synced is dropped, as one that could not be stored.
    pub fn wait(self) -> Result<(), BrokerError> {
        for (child, last) in self.children {
            if let Err(e) = child.wait_durable(last) {
                tracing::warn!(queue = %child.name, error = %e, "fanout copy not synced");
            }
        }
        match self.queue {
            Some((queue, last)) => queue.wait_durable(last),
            None => Ok(()),
        }
    }
}

/// Where a durable queue keeps priority `level`'s log, under its own directory (level 0's is the
/// queue's directory itself, as for a queue without levels).
fn level_dir(level: usize) -> String {
    format!("{LEVEL_DIR_PREFIX}{level}")
}

const LEVEL_DIR_PREFIX: &str = "priority-";

/// Where a durable queue keeps its delayed messages' log, under its own directory.
const DELAYED_DIR: &str = "delayed";

/// Says which users ACL entries name that the users file does not have (`Tom` for `tom`): their
/// entries apply to nobody (a deny so written denies nothing).
fn warn_of_unknown_acl_users(security: &Security) {
    let mut unknown: Vec<&str> = security
        .acl
        .entries
        .iter()
        .map(|e| e.user.as_str())
        .filter(|u| *u != "*" && security.users.get(u).is_none())
        .collect();
    unknown.sort_unstable();
    unknown.dedup();
    for user in unknown {
        tracing::warn!(
            user,
            "ACL entries name a user the users file does not have: they apply to nobody until it does"
        );
    }
}

/// Configuration of queues named in the server's configuration, and of those made by first use.
#[derive(Clone, Debug, Default)]
struct Configured {
    defaults: QueueConfig,
    queues: BTreeMap<String, QueueConfig>,
}

/// What `Broker::reconfigure_queues` did, by queue name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueChanges {
    /// Queues that took their new configuration at once.
    pub applied: Vec<String>,
    /// Queues named for the first time, created.
    pub created: Vec<String>,
    /// Queues whose new configuration changes their kind (durable, temporary, durability):
    /// they take it at the next start.
    pub needs_restart: Vec<String>,
    /// Queues that could not be created, and why.
    pub failed: Vec<(String, String)>,
    /// Queues not served since their files could not be opened, opened now (repaired).
    pub reopened: Vec<String>,
    /// Durable topics likewise.
    pub reopened_topics: Vec<String>,
}

/// Which user created which live queue, and how many each has.
#[derive(Default)]
struct CreatedBy {
    creator: HashMap<String, String>,
    count: HashMap<String, usize>,
}

impl Configured {
    /// Every block checked (see `config::checked`).
    fn checked(self) -> Result<Configured, BrokerError> {
        let mut queues = BTreeMap::new();
        for (name, config) in self.queues {
            check_name(&name)?;
            let config = config::checked_for(&name, config)
                .map_err(|e| BrokerError::BadRequest(format!("queue {name:?}: {e}")))?;
            queues.insert(name, config);
        }
        let defaults =
            config::checked(self.defaults).map_err(|e| BrokerError::BadRequest(format!("queue defaults: {e}")))?;
        Ok(Configured { defaults, queues })
    }
}

/// The queues, and for each fanout parent name the children that receive copies.
#[derive(Default)]
struct Registry {
    queues: HashMap<String, Arc<Queue>>,
    children: HashMap<String, Vec<Arc<Queue>>>,
}

impl Registry {
    fn insert(&mut self, queue: Arc<Queue>) {
        if let Some(parent) = fanout_parent(&queue.name) {
            self.children.entry(parent.to_owned()).or_default().push(Arc::clone(&queue));
        }
        self.queues.insert(queue.name.clone(), queue);
    }

    fn remove(&mut self, name: &str) -> Option<Arc<Queue>> {
        let queue = self.queues.remove(name)?;
        if let Some(parent) = fanout_parent(name)
            && let Some(children) = self.children.get_mut(parent)
        {
            children.retain(|c| !Arc::ptr_eq(c, &queue));
            if children.is_empty() {
                self.children.remove(parent);
            }
        }
        Some(queue)
    }
}

/// A fanout child's parent: the name up to its first `+` (`a+b` and `a+b+c` are children of `a`).
pub fn fanout_parent(name: &str) -> Option<&str> {
    name.split_once('+').map(|(parent, _)| parent)
}

/// Each queue that outlives its connection has a directory `queues/<name>/` holding its
/// definition (this file) and, if durable, its log.
const DEFINITION: &str = "queue.json";

impl Broker {
    /// Opens the broker's data in `dir`: queue definitions, and the logs of durable queues.
    pub fn open(dir: impl AsRef<Path>, mut options: BrokerOptions) -> Result<Broker, BrokerError> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(dir.join("queues")).map_err(|e| BrokerError::Definitions(e.to_string()))?;
        let lock =
            std::fs::File::open(&dir).map_err(|e| BrokerError::Definitions(format!("{}: {e}", dir.display())))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(BrokerError::DataDirLocked(dir)),
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(BrokerError::Definitions(format!("lock {}: {e}", dir.display())));
            }
        }
        let configured = Configured {
            defaults: std::mem::take(&mut options.queue_defaults),
            queues: std::mem::take(&mut options.queues),
        }
        .checked()?;
        let memory = Arc::new(MemoryBudget::new(options.max_memory_bytes));
        let pages = petrel_log::PageBudget::new(options.max_resident_bytes);
        let on_call = options.on_call.clone();
        let broker = Broker {
            dir,
            _lock: lock,
            options,
            registry: RwLock::new(Registry::default()),
            memory,
            small_calls_past_budget: Arc::new(MemoryBudget::new(SMALL_CALLS_PAST_BUDGET)),
            pages,
            definitions: Mutex::new(HashSet::new()),
            creation_ended: Condvar::new(),
            configured: RwLock::new(configured.clone()),
            damaged: DamagedList::default(),
            damaged_topics: DamagedList::default(),
            next_handle: AtomicU64::new(first_handle()),
            created: AtomicU64::new(0),
            removed: AtomicU64::new(0),
            removed_offered: AtomicU64::new(0),
            removed_polled: AtomicU64::new(0),
            topics: RwLock::new(HashMap::new()),
            topic_dirs: Mutex::new(()),
            functions: function::Functions::new(on_call),
            security: RwLock::new(None),
            secured: AtomicBool::new(false),
            denials: AtomicU64::new(0),
            created_by: Mutex::new(CreatedBy::default()),
            alarm: Arc::new(TickAlarm::default()),
            topics_given_back_at: AtomicU64::new(0),
            given_back: AtomicU64::new(0),
        };
        if let Some(security) = &broker.options.security {
            warn_of_unknown_acl_users(security);
        }
        *broker.security.write().unwrap_or_else(|e| e.into_inner()) = broker.options.security.clone().map(Arc::new);
        broker.secured.store(broker.options.security.is_some(), Ordering::Release);
        // The queues on disk, opened on several threads: a start is mostly waiting for the file
        // system's reads (a definition, a directory, a segment's header, a cursor per queue),
        // which overlap when several are asked for at once.
        let dirs = broker.queue_dirs()?;
        let opened = on_threads(OPENING_THREADS, &dirs, |dir| broker.open_queue(dir, &configured))?;
        for opened in opened.into_iter().flatten() {
            broker.adopt(opened);
        }
        for (name, config) in &configured.queues {
            // (Not over a damaged queue of that name: its files are kept for repair.)
            if broker.queue(name).is_none() && !broker.damaged.contains(name) {
                let made = broker.save_definition(name, config, false)?;
                let queue = broker.build(name.clone(), config.clone(), None, made)?;
                broker.write().insert(Arc::new(queue));
            }
        }
        broker.load_topics()?;
        Ok(broker)
    }

    /// Opens the queue whose directory is `dir`, with its configuration from `configured` where
    /// that names it (see `Broker::open`). A queue whose files cannot be opened (its definition
    /// or its log damaged, unreadable) comes back as `Err` with its name, to be listed as
    /// damaged while the others are served; a configuration it refuses fails the start.
    fn open_queue(&self, dir: &Path, configured: &Configured) -> Result<Option<Opened>, BrokerError> {
        let dir_name = || dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let def = match read_definition(dir) {
            Ok(Some(def)) => def,
            Ok(None) => return Ok(None),
            Err(e) => return Ok(Some(Err((dir_name(), e)))),
        };
        let (config, changed) = match configured.queues.get(&def.name) {
            Some(configured) if *configured != def.config => {
                tracing::info!(queue = %def.name, "configuration changed by the server's configuration file");
                if def.config.durable && !configured.durable && petrel_log::verify::holds_segments(dir) {
                    tracing::warn!(queue = %def.name, "the configuration file makes this durable queue one in memory: its log stays on disk, unread, and its messages out of reach until the queue is durable again");
                }
                (configured.clone(), true)
            }
            Some(_) => (def.config, false),
            None if def.follows_defaults => match self.followed(&def.name, &def.config) {
                Some(followed) => {
                    tracing::info!(queue = %def.name, "configuration changed by the server's queue defaults");
                    (followed, true)
                }
                None => (def.config, false),
            },
            None => (def.config, false),
        };
        let mut queue = match self.build(def.name.clone(), config.clone(), None, false) {
            Ok(queue) => queue,
            Err(e @ BrokerError::Storage(_)) => return Ok(Some(Err((def.name, e)))),
            Err(e) => return Err(e),
        };
        queue.follows_defaults = def.follows_defaults;
        // Stored only once the queue opened with it: a configuration the queue refuses (fewer
        // priority levels than its messages use) leaves the stored one, and the queue can
        // start again as it was once the file is put back.
        if changed {
            self.save_definition(&def.name, &config, def.follows_defaults)?;
        }
        Ok(Some(Ok(Arc::new(queue))))
    }

    /// Serves a queue `open_queue` opened, or lists it as damaged (and says so in the log).
    fn adopt(&self, opened: Opened) {
        match opened {
            Ok(queue) => {
                self.damaged.remove(&queue.name);
                self.write().insert(queue);
            }
            Err((name, e)) => {
                // Clients are told paths under the data directory (`DATA/queues/…`); the log says
                // where that is.
                tracing::error!(queue = %shown(&name), data = %self.dir.display(), error = %e, "queue not served: its files could not be opened; repair them in place (POST /api/v1/queues/NAME/repair), or fix them and reload");
                self.damaged.insert(&name, e.to_string());
            }
        }
    }

    /// Tries again to open the queues and durable topics listed as damaged (after an operator
    /// repaired them): those now served go in `changes.reopened` (`reopened_topics`), queues the
    /// configuration refuses in `changes.failed`.
    /// (A reload does this first; a server without a configuration file calls it on its own.)
    pub fn reopen_damaged(&self, changes: &mut QueueChanges) {
        let configured = self.configured.read().unwrap_or_else(|e| e.into_inner()).clone();
        for name in self.damaged.names() {
            let held = self.definitions_unless_creating(&name);
            if !self.damaged.contains(&name) {
                continue; // repaired meanwhile
            }
            match self.reopen_queue(&held, &name, &configured) {
                Ok(()) => changes.reopened.push(name),
                Err(BrokerError::Damaged { .. } | BrokerError::NotFound(_)) => {}
                Err(e) => changes.failed.push((name, e.to_string())),
            }
        }
        for name in self.damaged_topics.names() {
            if self.reopen_topic(&name).is_ok() {
                changes.reopened_topics.push(name);
            }
        }
    }

    /// Opens damaged queue `name` again, under the definitions' lock (`_held`: the caller found
    /// it listed under it, so that no one else opens it meanwhile): served (`Ok`), still damaged
    /// (`Damaged`, with why now), gone by hand (`NotFound`: no longer listed), or refused by its
    /// configuration (that error; still listed).
    fn reopen_queue(
        &self,
        _held: &MutexGuard<'_, HashSet<String>>,
        name: &str,
        configured: &Configured,
    ) -> Result<(), BrokerError> {
        match self.open_queue(&self.dir.join("queues").join(name), configured)? {
            Some(Ok(queue)) => {
                tracing::info!(queue = %shown(name), "queue opened again and served");
                self.adopt(Ok(queue));
                Ok(())
            }
            Some(Err((_, e))) => {
                self.damaged.insert(name, e.to_string());
                Err(self.missing(name))
            }
            None => {
                self.damaged.remove(name);
                Err(BrokerError::NotFound(name.to_owned()))
            }
        }
    }

    /// Opens damaged durable topic `name` again: served, or still listed (with why now, if its
    /// log is what failed).
    fn reopen_topic(&self, name: &str) -> Result<Arc<Topic>, BrokerError> {
        let Some(reason) = self.damaged_topics.remove(name) else { return Err(self.missing_topic(name)) };
        let opened = self.make_topic(name, true, false);
        match &opened {
            Ok(_) => tracing::info!(topic = %shown(name), "topic opened again and served"),
            Err(e @ BrokerError::Storage(_)) => self.damaged_topics.insert(name, e.to_string()),
            Err(_) => self.damaged_topics.insert(name, reason),
        }
        opened
    }

    /// Repairs the logs of damaged queue `name` in place, as `petrel log repair` does (each log
    /// is cut at its first bad record; damaged segment headers and cursors are written again),
    /// then serves it. Returns what each repair did, by log directory under the queue's (`""`:
    /// its first level's). A queue that is served is refused: its logs are open.
    pub fn repair_damaged(&self, name: &str) -> Result<Vec<(String, petrel_log::verify::RepairReport)>, BrokerError> {
        let held = self.definitions_unless_creating(name);
        if !self.damaged.contains(name) {
            return Err(match self.queue(name) {
                Some(_) => BrokerError::BadRequest(format!(
                    "queue {:?} is served: only a damaged queue is repaired",
                    shown(name)
                )),
                None => BrokerError::NotFound(name.to_owned()),
            });
        }
        let dir = self.dir.join("queues").join(name);
        let mut logs = vec![(String::new(), dir.clone())];
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| BrokerError::Definitions(format!("list {}: {e}", in_data_dir(&dir))))?;
        let mut subdirs: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n == DELAYED_DIR || n.starts_with(LEVEL_DIR_PREFIX))
            .collect();
        subdirs.sort();
        logs.extend(subdirs.into_iter().map(|n| (n.clone(), dir.join(n))));
        let mut repaired = Vec::new();
        for (log, path) in logs {
            if !petrel_log::verify::holds_segments(&path) {
                continue;
            }
            let report = petrel_log::verify::repair(&path)?;
            tracing::warn!(queue = %shown(name), log = %log, records_removed = report.records_removed,
                cut_at = ?report.cut_at.as_ref().map(|(file, pos)| format!("{} byte {pos}", in_data_dir(file))),
                "repaired a damaged queue's log");
            repaired.push((log, report));
        }
        let configured = self.configured.read().unwrap_or_else(|e| e.into_inner()).clone();
        self.reopen_queue(&held, name, &configured)?;
        Ok(repaired)
    }

    /// Queues not served because their files could not be opened, with why, by name.
    pub fn damaged_queues(&self) -> Vec<(String, String)> {
        self.damaged.list()
    }

    /// The error for a queue `name` that is not served: damaged, or not there.
    pub fn missing(&self, name: &str) -> BrokerError {
        self.damaged.error("queue", name, || BrokerError::NotFound(name.to_owned()))
    }

    /// The error for a topic `name` that is not served: damaged, or not there.
    pub fn missing_topic(&self, name: &str) -> BrokerError {
        self.damaged_topics.error("topic", name, || BrokerError::TopicNotFound(name.to_owned()))
    }

    /// Durable topics not served because their logs could not be opened, with why, by name.
    pub fn damaged_topics(&self) -> Vec<(String, String)> {
        self.damaged_topics.list()
    }

    /// Repairs the log of damaged durable topic `name` in place (as `repair_damaged` does a
    /// queue's) and serves it again.
    pub fn repair_damaged_topic(&self, name: &str) -> Result<petrel_log::verify::RepairReport, BrokerError> {
        let dirs = self.topic_dirs.lock().unwrap_or_else(|e| e.into_inner());
        if !self.damaged_topics.contains(name) {
            return Err(match self.topic(name) {
                Some(_) => BrokerError::BadRequest(format!(
                    "topic {:?} is served: only a damaged topic is repaired",
                    shown(name)
                )),
                None => BrokerError::TopicNotFound(name.to_owned()),
            });
        }
        // (A topic's groups may seek back over a damaged record: it is cut, not written again as
        // a record of zeros they would be handed as a message.)
        let report =
            petrel_log::verify::repair_with(self.dir.join("topics").join(name), petrel_log::verify::Replace::Never)?;
        drop(dirs); // (the reopen takes it)
        tracing::warn!(topic = %shown(name), records_removed = report.records_removed, "repaired a damaged topic's log");
        self.reopen_topic(name)?;
        Ok(report)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.registry.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The configuration a queue named `name` gets when it is created by first use. One that
    /// would name the queue its own dead-letter queue names none, and has no delivery limit
    /// (which needs one): defaults that name a dead-letter queue are the dead-letter queue's too
    /// when it is made by first use (by the first message moved to it), and refused, every dead
    /// letter would be lost.
    pub fn config_for(&self, name: &str) -> QueueConfig {
        let configured = self.configured.read().unwrap_or_else(|e| e.into_inner());
        let queues = &configured.queues;
        let mut config = queues
            .get(name)
            .or_else(|| fanout_parent(name).and_then(|p| queues.get(p)))
            .unwrap_or(&configured.defaults)
            .clone();
        if config.dead_letter == name {
            config.dead_letter.clear();
            config.max_deliveries = 0;
        }
        config
    }

    /// What queue `name`, made by first use and configured as `current`, takes from the server's
    /// configuration for its name now (`config::following`); `None` if that is what it has, or if
    /// the result is not a valid configuration (then it keeps its own, and the log says why).
    fn followed(&self, name: &str, current: &QueueConfig) -> Option<QueueConfig> {
        let wanted = config::following(current, &self.config_for(name));
        if wanted == *current {
            return None;
        }
        match config::checked_for(name, wanted) {
            Ok(wanted) => Some(wanted),
            Err(e) => {
                tracing::warn!(queue = %shown(name), error = %e, "the server's queue defaults do not fit this queue made by first use; it keeps its configuration");
                None
            }
        }
    }

    /// Puts a reloaded server configuration's queue blocks and defaults in force, after opening
    /// again the queues listed as damaged (`damaged_queues`: repaired meanwhile). Each named
    /// queue that exists takes its block at once if it stays the same kind of queue (limits,
    /// expiry, dead letters change live; see `Queue::reconfigure`), else at the next start; a
    /// named queue that does not exist is created. Queues made by first use from now on take
    /// the new defaults, and so do those made by first use before (`Queue::follows_defaults`),
    /// as across a restart; queues created explicitly keep their configuration. A queue whose
    /// block was removed keeps its configuration too, unless made by first use. Nothing changes
    /// if any block is invalid.
    pub fn reconfigure_queues(
        &self,
        defaults: QueueConfig,
        queues: BTreeMap<String, QueueConfig>,
    ) -> Result<QueueChanges, BrokerError> {
        let configured = Configured { defaults, queues }.checked()?;
        *self.configured.write().unwrap_or_else(|e| e.into_inner()) = configured.clone();
        let mut changes = QueueChanges::default();
        self.reopen_damaged(&mut changes);
        // Queues made by first use without a block of their own follow the defaults (or their
        // parent's block) as they are now.
        let followers: Vec<(String, QueueConfig)> = self
            .read()
            .queues
            .values()
            .filter(|q| q.follows_defaults && !configured.queues.contains_key(&q.name))
            .filter_map(|q| Some((q.name.clone(), self.followed(&q.name, &q.config())?)))
            .collect();
        for (name, config) in configured.queues.into_iter().chain(followers) {
            // Held while the queue is looked at and changed, so that a removal cannot come between
            // (taken once a creation of it under way has ended: the block applies to that queue).
            let guard = self.definitions_unless_creating(&name);
            let Some(queue) = self.queue(&name) else {
                drop(guard);
                match self.create_queue(&name, config, None) {
                    Ok(_) => changes.created.push(name),
                    Err(e) => changes.failed.push((name, e.to_string())),
                }
                continue;
            };
            let current = queue.config();
            if *current == config {
                continue;
            }
            if !config::changes_live(&current, &config) {
                changes.needs_restart.push(name);
                continue;
            }
            // The definition first, as at creation: a restart finds what is in force.
            if !config.temporary
                && let Err(e) = self.save_definition(&name, &config, queue.follows_defaults)
            {
                changes.failed.push((name, e.to_string()));
                continue;
            }
            queue.reconfigure(config);
            changes.applied.push(name);
        }
        Ok(changes)
    }

    /// The queue named `name`, created with `config_for(name)` if there is none (the memcache
    /// protocol's queues come into being when first named).
    pub fn queue_or_create(&self, name: &str) -> Result<Arc<Queue>, BrokerError> {
        if let Some(q) = self.queue(name) {
            return Ok(q);
        }
        match self.create(name, self.config_for(name), None, true) {
            Err(BrokerError::Exists(..)) => self.get(name),
            other => other,
        }
    }

    /// Builds a queue from its definition; `made`: its directory was made just now (by
    /// `save_definition`), so it holds nothing but the definition.
    fn build(
        &self,
        name: String,
        config: QueueConfig,
        owner: Option<ConnId>,
        made: bool,
    ) -> Result<Queue, BrokerError> {
        if config.durable && !config.temporary {
            let segment_bytes = self.options.segment_bytes;
            let options = Options {
                durability: self.durability_of(&config)?,
                segment_bytes,
                initial_segment_bytes: Some(INITIAL_SEGMENT_BYTES.min(segment_bytes)),
                max_record_bytes: self.options.max_message_bytes + 64 * 1024,
                retention: petrel_log::Retention { delete_consumed: true, ..Default::default() },
                // The data directory's lock (held by the broker) covers every log in it.
                lock_directory: false,
                page_budget: self.pages.clone(),
                on_sync: self.options.on_sync.clone(),
                ..Options::default()
            };
            let dir = self.dir.join("queues").join(&name);
            let levels = config::levels_of(&config);
            // What the queue's directory holds, listed once (asking for each name would cost a
            // lookup apiece), and not at all when it was made just now.
            let names: HashSet<std::ffi::OsString> = match made {
                true => HashSet::new(),
                false => match std::fs::read_dir(&dir) {
                    Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.file_name())).collect(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashSet::new(),
                    Err(e) => return Err(BrokerError::Definitions(format!("list {}: {e}", in_data_dir(&dir)))),
                },
            };
            // A level's log the configuration no longer has would hide its messages: refuse.
            if let Some(extra) = (levels..=config::MAX_PRIORITIES as usize)
                .find(|l| names.contains(std::ffi::OsStr::new(&level_dir(*l))))
            {
                return Err(BrokerError::BadRequest(format!(
                    "queue {:?} holds messages at priority {extra} on disk, but is configured with {levels} level(s): configure at least {} priorities",
                    shown(&name),
                    extra + 1
                )));
            }
            let mut logs = Vec::with_capacity(levels);
            for level in 0..levels {
                let log = match level {
                    // Its directory was made just now (`save_definition`): nothing to look for.
                    0 if made => Log::open_made(&dir, options.clone())?,
                    0 => Log::open(&dir, options.clone())?,
                    _ => Log::open(dir.join(level_dir(level)), options.clone())?,
                };
                logs.push(log.into_shared());
            }
            // The delayed messages' log: opened if the queue has one, else made at its first.
            let delayed_dir = dir.join(DELAYED_DIR);
            let delayed = match names.contains(std::ffi::OsStr::new(DELAYED_DIR)) {
                true => Some(Log::open(&delayed_dir, options.clone())?.into_shared()),
                false => None,
            };
            let open_delayed = Box::new(move || Ok(Log::open(&delayed_dir, options.clone())?.into_shared()));
            let mut queue = Queue::on_log(name, config, logs, delayed, open_delayed)?;
            queue.use_alarm(Arc::clone(&self.alarm));
            Ok(queue)
        } else {
            let memory = Arc::clone(&self.memory);
            let mut queue = Queue::in_memory(name, config, owner, memory, self.options.memory_queue_max_bytes);
            queue.use_alarm(Arc::clone(&self.alarm));
            Ok(queue)
        }
    }

    /// Creates a queue, or returns the existing one if its configuration is the same.
    pub fn create_queue(
        &self,
        name: &str,
        config: QueueConfig,
        owner: Option<ConnId>,
    ) -> Result<Arc<Queue>, BrokerError> {
        self.create(name, config, owner, false)
    }

    /// `create_queue`; `follows_defaults`: made by first use (`Queue::follows_defaults`).
    fn create(
        &self,
        name: &str,
        config: QueueConfig,
        owner: Option<ConnId>,
        follows_defaults: bool,
    ) -> Result<Arc<Queue>, BrokerError> {
        check_name(name)?;
        let config = config::checked_for(name, config).map_err(BrokerError::BadRequest)?;
        if config.temporary && owner.is_none() {
            return Err(BrokerError::BadRequest("a temporary queue needs an owning connection".into()));
        }
        let mut creating = self.definitions_unless_creating(name);
        if self.damaged.contains(name) {
            return Err(self.missing(name));
        }
        if let Some(q) = self.queue(name) {
            // The same queue again is fine; not another connection's temporary queue.
            return if *q.config() == config && q.owner == owner {
                Ok(q)
            } else if *q.config() == config {
                Err(BrokerError::Exists(name.to_owned(), "it is another connection's temporary queue".into()))
            } else {
                Err(BrokerError::Exists(name.to_owned(), config::differences(&q.config(), &config)))
            };
        }
        let (count, limit) = (self.read().queues.len() + creating.len(), self.options.max_queues);
        if limit != 0 && count >= limit {
            return Err(BrokerError::Limit(format!("the server has {count} queues, its limit (max_queues)")));
        }
        // Its files are made outside the lock (a creation is file-system work: a directory,
        // segment, index and cursor files), this name held meanwhile.
        creating.insert(name.to_owned());
        drop(creating);
        let creation = Creation::new(self, name);
        // The definition first: a crash right after it leaves an empty queue, never a log
        // nobody knows of.
        let built = match config.temporary {
            true => self.build(name.to_owned(), config.clone(), owner, false),
            false => self
                .save_definition(name, &config, follows_defaults)
                .and_then(|made| self.build(name.to_owned(), config.clone(), owner, made)),
        };
        let _creating = creation.end();
        let queue = match built {
            Ok(mut queue) => {
                queue.follows_defaults = follows_defaults;
                Arc::new(queue)
            }
            Err(e) => {
                // A creation that failed (a full disk, no descriptors) leaves nothing behind.
                if !config.temporary
                    && let Err(cleanup) = remove_dir(&self.dir.join("queues"), name)
                {
                    tracing::warn!(queue = %shown(name), error = %cleanup, "could not remove a failed queue's directory");
                }
                return Err(e);
            }
        };
        self.write().insert(Arc::clone(&queue));
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok(queue)
    }

    /// `create_queue` by `who`: an ordinary user's new queue counts against
    /// `max_queues_per_user` until it is removed. (An existing queue is found, not counted.)
    pub fn create_queue_by(
        &self,
        who: Option<&Principal>,
        name: &str,
        config: QueueConfig,
        owner: Option<ConnId>,
    ) -> Result<Arc<Queue>, BrokerError> {
        self.may_create(who, name, &config, owner.is_some())?;
        self.counted(who, name, || self.create_queue(name, config, owner))
    }

    /// `queue_or_create` by `who`, counted as `create_queue_by` is.
    pub fn queue_or_create_by(&self, who: Option<&Principal>, name: &str) -> Result<Arc<Queue>, BrokerError> {
        if let Some(q) = self.queue(name) {
            return Ok(q);
        }
        self.may_create(who, name, &QueueConfig::default(), false)?;
        self.counted(who, name, || self.queue_or_create(name))
    }

    /// What creating queue `name` with `config` reaches beyond the queue itself, checked
    /// against `who`'s rights (the right to create it is checked by the caller, and an owned
    /// temporary queue needs none): a fanout child gets copies of its parent's messages, so
    /// its creator must be allowed to poll the parent; a dead-letter queue receives messages,
    /// so its creator must be allowed to offer to it; and a temporary queue may not take a
    /// name meant for others: one an ACL entry refuses its creator, one the entries name for
    /// other users only, or one the configuration or a queue names as a dead-letter queue (a
    /// reply queue's name matches no entry and is allowed).
    fn may_create(
        &self,
        who: Option<&Principal>,
        name: &str,
        config: &QueueConfig,
        temporary: bool,
    ) -> Result<(), BrokerError> {
        let (Some(security), Some(principal)) = (self.security(), who) else { return Ok(()) };
        if security.users.get(&principal.user).is_some_and(|u| u.role == security::Role::Admin) {
            return Ok(());
        }
        if let Some(parent) = fanout_parent(name) {
            self.decide(who, Kind::Queue, parent, &[Action::Poll])?;
        }
        if !config.dead_letter.is_empty() {
            self.decide(who, Kind::Queue, &config.dead_letter, &[Action::Offer])?;
            // Made by first use when its first message comes, by nobody: a queue of a name
            // only an admin (or the configuration) chose, so that a user cannot make queues
            // beyond its rights and `max_queues_per_user` through it.
            if self.queue(&config.dead_letter).is_none() && !self.is_configured_dead_letter_queue(&config.dead_letter) {
                return Err(BrokerError::Forbidden(format!(
                    "dead-letter queue {:?} does not exist: it is made by first use only if the configuration names it; create it first",
                    shown(&config.dead_letter)
                )));
            }
        }
        // A temporary queue named as the parent of fanout children (whose parent is gone): its
        // offers would be copied into them.
        if temporary {
            for child in self.fanout_children(name) {
                self.decide(who, Kind::Queue, &child, &[Action::Offer])?;
            }
        }
        for action in [Action::Offer, Action::Poll].into_iter().filter(|_| temporary) {
            if security.acl.by_entries(&principal.user, Kind::Queue, name, action) == Some(false) {
                return Err(BrokerError::Forbidden(format!(
                    "user {:?} may not {action} queue {:?}, so may not make a temporary queue of that name",
                    principal.user,
                    shown(name)
                )));
            }
        }
        if temporary
            && (security.acl.meant_for_others(&principal.user, Kind::Queue, name) || self.is_dead_letter_queue(name))
        {
            return Err(BrokerError::Forbidden(format!(
                "queue {:?} is meant for others (the ACL names it for other users, or it is a dead-letter queue): user {:?} may not make a temporary queue of that name",
                shown(name),
                principal.user
            )));
        }
        Ok(())
    }

    /// Whether `name` is the dead-letter queue of the configuration's defaults, of a configured
    /// queue, or of a queue that exists.
    fn is_dead_letter_queue(&self, name: &str) -> bool {
        self.is_configured_dead_letter_queue(name)
            || self.read().queues.values().any(|q| q.config().dead_letter == name)
    }

    /// Whether the configuration names `name` as a dead-letter queue (its defaults', or a
    /// configured queue's).
    fn is_configured_dead_letter_queue(&self, name: &str) -> bool {
        let configured = self.configured.read().unwrap_or_else(|e| e.into_inner());
        let named = |config: &QueueConfig| config.dead_letter == name;
        named(&configured.defaults) || configured.queues.values().any(named)
    }

    fn counted(
        &self,
        who: Option<&Principal>,
        name: &str,
        create: impl FnOnce() -> Result<Arc<Queue>, BrokerError>,
    ) -> Result<Arc<Queue>, BrokerError> {
        let ordinary = match (self.security(), who) {
            (Some(security), Some(who)) => {
                security.users.get(&who.user).is_some_and(|u| u.role != security::Role::Admin)
            }
            _ => false,
        };
        if !ordinary || self.queue(name).is_some() {
            return create();
        }
        let user = &who.expect("ordinary users are principals").user;
        // Held across the creation, so that one user's concurrent creations cannot pass the limit.
        let mut created = self.created_by.lock().unwrap_or_else(|e| e.into_inner());
        let limit = self.options.max_queues_per_user;
        if limit > 0 && created.count.get(user).copied().unwrap_or(0) >= limit {
            return Err(BrokerError::Limit(format!(
                "user {user:?} has {limit} queues of its own already (max_queues_per_user)"
            )));
        }
        let queue = create()?;
        if !created.creator.contains_key(name) {
            created.creator.insert(name.to_owned(), user.clone());
            *created.count.entry(user.clone()).or_insert(0) += 1;
        }
        Ok(queue)
    }

    /// Removes a queue and its contents.
    pub fn remove_queue(&self, name: &str) -> Result<(), BrokerError> {
        self.remove_queue_if(name, None)
    }

    /// Removes queue `name` if it is `only` (when given): not another made under its name since.
    fn remove_queue_if(&self, name: &str, only: Option<&Arc<Queue>>) -> Result<(), BrokerError> {
        self.remove_queue_locked(name, only)?;
        let mut created = self.created_by.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(user) = created.creator.remove(name)
            && let Some(n) = created.count.get_mut(&user)
        {
            *n -= 1;
            if *n == 0 {
                created.count.remove(&user);
            }
        }
        Ok(())
    }

    fn remove_queue_locked(&self, name: &str, only: Option<&Arc<Queue>>) -> Result<(), BrokerError> {
        let _guard = self.definitions_unless_creating(name);
        let queue = {
            let mut registry = self.write();
            if only.is_some_and(|only| !registry.queues.get(name).is_some_and(|q| Arc::ptr_eq(q, only))) {
                return Err(self.missing(name));
            }
            registry.remove(name).ok_or_else(|| self.missing(name))?
        };
        let counted = queue.counters();
        self.removed_offered.fetch_add(counted.total_offered, Ordering::Relaxed);
        self.removed_polled.fetch_add(counted.total_polled, Ordering::Relaxed);
        // Release: whoever reads the new count (`queues_removed`) finds the queue gone.
        self.removed.fetch_add(1, Ordering::Release);
        // Whoever waits on it (for messages, or for room) learns that it is gone.
        queue.mark_removed();
        if !queue.config().temporary {
            drop(queue);
            remove_dir(&self.dir.join("queues"), name)?;
        }
        Ok(())
    }

    /// The definitions' lock, once no creation of `name` is under way.
    fn definitions_unless_creating(&self, name: &str) -> MutexGuard<'_, HashSet<String>> {
        let mut creating = self.definitions.lock().unwrap_or_else(|e| e.into_inner());
        while creating.contains(name) {
            creating = self.creation_ended.wait(creating).unwrap_or_else(|e| e.into_inner());
        }
        creating
    }

    pub fn queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.read().queues.get(name).cloned()
    }

    fn get(&self, name: &str) -> Result<Arc<Queue>, BrokerError> {
        self.queue(name).ok_or_else(|| self.missing(name))
    }

    pub fn queue_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.read().queues.keys().cloned().collect();
        names.sort();
        names
    }

    /// Queues created since open.
    pub fn queues_created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// Queues removed since open. While it stays the same, a queue found by its name is still
    /// the one of that name (connections keep the last one they named on that promise).
    pub fn queues_removed(&self) -> u64 {
        self.removed.load(Ordering::Acquire)
    }

    /// Messages offered to and taken from the queues removed since open (their counts at their
    /// removal), for totals over the server's life: add the live queues' to them.
    pub fn removed_queues_totals(&self) -> (u64, u64) {
        (self.removed_offered.load(Ordering::Relaxed), self.removed_polled.load(Ordering::Relaxed))
    }

    /// Changes `max_memory_bytes` (a reload): new offers see it at once.
    pub fn set_max_memory_bytes(&self, max: u64) {
        self.memory.set_max(max);
    }

    /// Bytes held by in-memory queues, and the budget for them (0: none).
    pub fn memory(&self) -> (u64, u64) {
        (self.memory.used(), self.memory.max())
    }

    /// Takes `bytes` from the memory budget (`max_memory_bytes`) for a request read into memory,
    /// until the hold is dropped; `None` when they do not fit.
    pub fn hold_memory(&self, bytes: u64) -> Option<MemoryHold> {
        MemoryHold::take(&self.memory, bytes, false)
    }

    /// `hold_memory` for bytes already in memory (counted again after a moment out of the
    /// budget): taken even past its limit.
    pub fn hold_memory_anyway(&self, bytes: u64) -> MemoryHold {
        MemoryHold::take(&self.memory, bytes, true).expect("taken whatever the limit")
    }

    /// Mapped segment bytes of durable logs counted against `max_resident_bytes` (an upper bound
    /// on their resident pages), and segments that gave their pages back to stay within it.
    pub fn resident_pages(&self) -> (u64, u64) {
        (self.pages.counted_bytes(), self.pages.releases())
    }

    /// The names of the queues that receive a copy of what is offered to `name`.
    pub fn fanout_children(&self, name: &str) -> Vec<String> {
        let mut names: Vec<String> =
            self.read().children.get(name).into_iter().flatten().map(|q| q.name.clone()).collect();
        names.sort();
        names
    }

    /// Offers to `name` (all or none), then a copy to each fanout child (`name+…`). A child that
    /// refuses its copy (full, or the message too big for it) is skipped, counted in its `dropped`.
    pub fn offer(&self, name: &str, mut messages: Vec<Message>, now_ns: u64) -> Result<(u64, u32), BrokerError> {
        let queue = self.get(name)?;
        self.offer_to(&queue, &mut messages, now_ns)
    }

    /// `offer` to a queue already looked up. On success `messages` is emptied; on refusal it is
    /// left as it was, for a retry. Blocks until the messages are as durable as their queues
    /// promise (see `offer_unsynced` for a caller that must not block).
    pub fn offer_to(
        &self,
        queue: &Arc<Queue>,
        messages: &mut Vec<Message>,
        now_ns: u64,
    ) -> Result<(u64, u32), BrokerError> {
        let offered = self.offer_unsynced(queue, messages, now_ns)?;
        offered.unsynced.wait()?;
        Ok((offered.first_id, offered.count))
    }

    /// `offer_to` without waiting for the disk: the answer to the offer waits for
    /// `UnsyncedOffer::wait` (which blocks; run it where blocking is allowed), and consumers
    /// get the messages only then. Offers appended one after the other keep their order
    /// whenever their waits end.
    pub fn offer_unsynced(
        &self,
        queue: &Arc<Queue>,
        messages: &mut Vec<Message>,
        now_ns: u64,
    ) -> Result<Offered, BrokerError> {
        for m in messages.iter() {
            self.check_size(m)?;
        }
        self.offer_sized_unsynced(queue, messages, now_ns, false)
    }

    /// `TooLarge` for a message over `max_message_bytes` (its payload, texts and headers): what
    /// any message a client hands the broker is held to, offered, published, called or replied.
    pub fn check_size(&self, m: &Message) -> Result<(), BrokerError> {
        match m.size() as usize {
            size if size > self.options.max_message_bytes => {
                Err(BrokerError::TooLarge { size, max: self.options.max_message_bytes })
            }
            _ if m.headers.len() > MAX_HEADERS => Err(BrokerError::BadRequest(format!(
                "a message has {} headers, more than the {MAX_HEADERS} a message may carry",
                m.headers.len()
            ))),
            _ => Ok(()),
        }
    }

    /// `offer_unsynced` of messages whose size was checked (or that the server moves itself: a
    /// dead letter carries a few headers more than the message it was, which was accepted).
    /// `moved`: see `Queue::offer_unsynced`.
    fn offer_sized_unsynced(
        &self,
        queue: &Arc<Queue>,
        messages: &mut Vec<Message>,
        now_ns: u64,
        moved: bool,
    ) -> Result<Offered, BrokerError> {
        let children = self.read().children.get(&queue.name).cloned();
        // Copies only of what the parent stores: an offer retried while the parent is full, or
        // a repeat of a keyed offer it stored before, must not give the children duplicates.
        let mut copies = children.as_ref().map(|_| messages.clone());
        let stored = queue.offer_unsynced(messages, copies.as_mut(), now_ns, moved)?;
        let mut unsynced =
            UnsyncedOffer { queue: stored.last.map(|last| (Arc::clone(queue), last)), children: Vec::new() };
        if let (Some(children), Some(copies)) = (children, copies.filter(|c| !c.is_empty())) {
            for child in children {
                let mut copies = copies.clone();
                // The parent took out the repeats: a child's own window (its configuration may
                // remember longer) must not drop a copy of a message the parent stored.
                copies.iter_mut().for_each(|m| m.idempotency_key.clear());
                if !child.on_disk() {
                    // Durable before the answer is the parent's promise; a child in memory keeps
                    // its copy as it keeps every message.
                    copies.iter_mut().for_each(|m| m.durable = false);
                }
                // One offer per run of one priority: a child with levels takes one priority an
                // offer, though its parent (without levels) took them mixed.
                while !copies.is_empty() {
                    let run = match config::levels_of(&child.config()) {
                        1 => copies.len(),
                        _ => copies.iter().take_while(|m| m.priority == copies[0].priority).count(),
                    };
                    let mut batch: Vec<Message> = copies.drain(..run).collect();
                    match child.offer_unsynced(&mut batch, None, now_ns, moved) {
                        Ok(queue::Stored { last: Some(last), .. }) => {
                            unsynced.children.push((Arc::clone(&child), last))
                        }
                        Ok(_) => {}
                        Err(e) => {
                            child.count_dropped(run as u64);
                            tracing::debug!(queue = %child.name, error = %e, "fanout copy dropped");
                        }
                    }
                }
            }
        }
        Ok(Offered { first_id: stored.first, count: stored.count, repeats: stored.repeats, unsynced })
    }

    /// Takes up to `max` messages (tentatively, with a visibility timeout). Expired messages it
    /// meets go to the queue's dead-letter queue.
    pub fn poll(
        &self,
        name: &str,
        max: usize,
        visibility: Option<Duration>,
        consumer: ConnId,
        now_ns: u64,
    ) -> Result<Vec<Delivery>, BrokerError> {
        let queue = self.get(name)?;
        self.poll_from(&queue, max, visibility, consumer, now_ns)
    }

    /// `poll` from a queue already looked up.
    pub fn poll_from(
        &self,
        queue: &Queue,
        max: usize,
        visibility: Option<Duration>,
        consumer: ConnId,
        now_ns: u64,
    ) -> Result<Vec<Delivery>, BrokerError> {
        let mut next_handle = || self.next_handle.fetch_add(1, Ordering::Relaxed);
        let polled = queue.poll(max, self.options.max_poll_bytes, visibility, consumer, now_ns, &mut next_handle)?;
        self.dead_letter(queue, polled.expired, DeadReason::Expired, now_ns);
        Ok(polled.deliveries)
    }

    /// The message at the head of `queue`, left there. Expired messages met on the way are
    /// removed (to the dead-letter queue).
    pub fn peek(&self, queue: &Queue, now_ns: u64) -> Result<Option<Message>, BrokerError> {
        let (head, expired) = queue.peek(now_ns);
        self.dead_letter(queue, expired, DeadReason::Expired, now_ns);
        head
    }

    pub fn ack(&self, name: &str, handles: &[u64], consumer: ConnId) -> Result<u32, BrokerError> {
        self.get(name)?.ack(handles, consumer)
    }

    /// Puts tentative deliveries of `consumer` back at the head, or to be handed out again no
    /// earlier than `delay_ms` from now (0: the queue's redelivery delay, if it has one); those
    /// handed out `max_deliveries` times go to the dead-letter queue instead. Returns how many
    /// were known.
    pub fn abort(
        &self,
        name: &str,
        handles: &[u64],
        consumer: ConnId,
        delay_ms: u32,
        now_ns: u64,
    ) -> Result<u32, BrokerError> {
        let queue = self.get(name)?;
        let returned = queue.abort(handles, consumer, delay_ms, now_ns)?;
        self.dead_letter(&queue, returned.over_limit, DeadReason::MaxDeliveries, now_ns);
        Ok(returned.count)
    }

    /// Puts tentative deliveries of `consumer` back as if never handed out: its client never
    /// saw them (`Queue::give_back_unseen`). Returns how many were known.
    pub fn give_back_unseen(&self, name: &str, handles: &[u64], consumer: ConnId) -> Result<u32, BrokerError> {
        self.get(name)?.give_back_unseen(handles, consumer)
    }

    /// Puts an open read of `queue` back whoever took it (an operator's hand on a stuck
    /// consumer; at the delivery limit, to the dead-letter queue). Returns whether it was open.
    pub fn return_read(&self, queue: &Arc<Queue>, handle: u64, now_ns: u64) -> Result<bool, BrokerError> {
        let returned = queue.return_read(handle, now_ns)?;
        self.dead_letter(queue, returned.over_limit, DeadReason::MaxDeliveries, now_ns);
        Ok(returned.count == 1)
    }

    /// Creates a topic, or finds the one of that name (`Exists` if it differs in durability).
    /// A durable topic keeps a log in `topics/<name>/` and comes back after a restart.
    pub fn create_topic(&self, name: &str, durable: bool) -> Result<Arc<Topic>, BrokerError> {
        self.make_topic(name, durable, true)
    }

    /// `create_topic`; `limited`: refused past `max_topics` (a topic made anew, not one already
    /// on disk opened at start or after a repair).
    fn make_topic(&self, name: &str, durable: bool, limited: bool) -> Result<Arc<Topic>, BrokerError> {
        check_name(name)?;
        if self.damaged_topics.contains(name) {
            return Err(self.missing_topic(name));
        }
        let existing = |topics: &HashMap<String, Arc<Topic>>| {
            topics.get(name).map(|t| match t.is_durable() == durable {
                true => Ok(Arc::clone(t)),
                false => Err(BrokerError::TopicExists(name.to_owned(), t.is_durable())),
            })
        };
        // (One that exists is found without waiting for the directories' lock: the tick's
        // retention may hold it a while.)
        if let Some(found) = existing(&self.topics.read().unwrap_or_else(|e| e.into_inner())) {
            return found;
        }
        let _dirs = self.topic_dirs.lock().unwrap_or_else(|e| e.into_inner());
        {
            let topics = self.topics.read().unwrap_or_else(|e| e.into_inner());
            if let Some(found) = existing(&topics) {
                return found;
            }
            // Each is a map entry, a status row and metric series, and a durable one a
            // directory, a segment and a mapping: bounded, as queues are. (Only a creation adds
            // one, and creations take turns: still true once the log is open.)
            let limit = self.options.max_topics;
            if limited && limit != 0 && topics.len() >= limit {
                return Err(BrokerError::Limit(format!(
                    "the server has {} topics, its limit (max_topics)",
                    topics.len()
                )));
            }
        }
        let log = if durable { Some(self.open_topic_log(name)?) } else { None };
        let topic = Arc::new(Topic::new(name.to_owned(), log));
        self.topics.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_owned(), Arc::clone(&topic));
        Ok(topic)
    }

    fn open_topic_log(&self, name: &str) -> Result<petrel_log::SharedLog, BrokerError> {
        let segment_bytes = self.options.segment_bytes;
        let options = Options {
            durability: self.options.durability,
            segment_bytes,
            initial_segment_bytes: Some(INITIAL_SEGMENT_BYTES.min(segment_bytes)),
            max_record_bytes: self.options.max_message_bytes + 64 * 1024,
            retention: petrel_log::Retention {
                delete_consumed: false,
                // 0: none, as for every other limit (a cap of 0 would delete all but the
                // active segment).
                max_bytes: Some(self.options.topic_max_bytes).filter(|&b| b != 0),
                max_age: Some(self.options.topic_max_age).filter(|a| !a.is_zero()),
            },
            lock_directory: false, // as for queues: the data directory's lock covers it
            page_budget: self.pages.clone(),
            on_sync: self.options.on_sync.clone(),
            ..Options::default()
        };
        Ok(Log::open(self.dir.join("topics").join(name), options)?.into_shared())
    }

    /// Reopens the durable topics found in `topics/`.
    fn load_topics(&self) -> Result<(), BrokerError> {
        let dir = self.dir.join("topics");
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(BrokerError::Definitions(format!("{}: {e}", dir.display()))),
        };
        for entry in entries {
            let name = entry.map_err(|e| BrokerError::Definitions(e.to_string()))?.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(REMOVED) {
                std::fs::remove_dir_all(dir.join(&*name)).map_err(|e| BrokerError::Definitions(e.to_string()))?;
            } else if check_name(&name).is_ok() {
                match self.make_topic(&name, true, false) {
                    Ok(_) => {}
                    // Its log damaged: listed, not served, kept for repair; the others go on.
                    Err(e @ BrokerError::Storage(_)) => {
                        tracing::error!(topic = %shown(&name), data = %self.dir.display(), error = %e, "topic not served: its log could not be opened; repair it (POST /api/v1/topics/NAME/repair, or `petrel log repair` with the server stopped)");
                        self.damaged_topics.insert(&name, e.to_string());
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Removes a topic (and a durable topic's log); its subscriptions end.
    pub fn remove_topic(&self, name: &str) -> Result<(), BrokerError> {
        let _dirs = self.topic_dirs.lock().unwrap_or_else(|e| e.into_inner());
        let topic = self.topics.write().unwrap_or_else(|e| e.into_inner()).remove(name);
        let topic = topic.ok_or_else(|| self.missing_topic(name))?;
        topic.end_subscriptions(Ended::TopicRemoved(format!("topic {name} was removed")));
        topic.end_group_readers();
        if topic.is_durable() {
            drop(topic);
            remove_dir(&self.dir.join("topics"), name)?;
        }
        Ok(())
    }

    pub fn topic(&self, name: &str) -> Option<Arc<Topic>> {
        self.topics.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    pub fn topic_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.topics.read().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect();
        names.sort();
        names
    }

    /// Hands the messages to every current subscriber of `topic`; returns how many got them.
    pub fn publish(&self, topic: &str, messages: Vec<Message>, now_ns: u64) -> Result<u32, BrokerError> {
        let t = self.topic(topic).ok_or_else(|| self.missing_topic(topic))?;
        self.publish_to(&t, messages, now_ns)
    }

    /// `publish` to a topic already looked up. Blocks on the disk when the topic is durable.
    pub fn publish_to(&self, topic: &Topic, messages: Vec<Message>, now_ns: u64) -> Result<u32, BrokerError> {
        let mut stamped = Vec::with_capacity(messages.len());
        for m in messages {
            self.check_size(&m)?;
            // What the server assigns, or a queue's delivery sets, never the publisher's.
            let clean = Message { id: 0, deliveries: 0, delay_ms: 0, ..m };
            stamped.push(Message { timestamp: now_ns, destination: topic.name.clone(), ..clean });
        }
        topic.publish(stamped)
    }

    /// A fresh id (subscriptions, calls, tentative reads share one counter).
    pub fn next_id(&self) -> u64 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    /// Subscribes `conn` to `topic`, the broker holding up to `buffer` messages for it.
    pub fn subscribe(&self, topic: &str, conn: ConnId, buffer: usize) -> Result<Subscription, BrokerError> {
        let t = self.topic(topic).ok_or_else(|| self.missing_topic(topic))?;
        Ok(t.subscribe(
            self.next_handle.fetch_add(1, Ordering::Relaxed),
            conn,
            buffer,
            self.options.max_subscriber_bytes,
            Arc::clone(&self.memory),
        ))
    }

    /// Ends a subscription of `conn`'s.
    pub fn unsubscribe(&self, subscription: u64, conn: ConnId) {
        let topics: Vec<Arc<Topic>> = self.topics.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        for t in topics {
            t.remove(|id, c| id == subscription && c == conn, None);
        }
    }

    /// `conn` serves calls of `function`, which reach it on `invocations`.
    pub fn serve(&self, function: &str, conn: ConnId, invocations: tokio::sync::mpsc::Sender<Invocation>) {
        self.functions.serve_remote(function, conn, invocations);
    }

    /// Every function served now: its servers and figures.
    pub fn functions(&self) -> Vec<FunctionStatus> {
        self.functions.list()
    }

    /// A closure in this process serves calls of `function` (the embedded use).
    pub fn serve_local(&self, function: &str, handler: LocalHandler) {
        self.functions.serve_local(function, handler);
    }

    pub fn unserve(&self, function: &str, conn: ConnId) {
        self.functions.unserve(Some(function), conn);
    }

    /// Stops `conn` serving every function: calls handed to it and not answered fail at once
    /// (as at `disconnect`, for a connection that reads no more but is not gone yet; its own
    /// calls still get their replies meanwhile).
    pub fn unserve_all(&self, conn: ConnId) {
        self.functions.unserve(None, conn);
    }

    /// Calls `function` with `message`: one of its servers, round robin. The call's bytes count
    /// in the memory budget until its server's connection takes it. A call handed to a
    /// connection ends in `reply`: the reply, a handler error, the server gone, or `Timeout`
    /// once `timeout` has passed (checked by `tick`).
    #[allow(clippy::too_many_arguments)] // each is a separate fact of one call; a struct would only rename them
    pub fn call(
        &self,
        caller: ConnId,
        function: &str,
        message: Message,
        oneway: bool,
        now_ns: u64,
        timeout: Duration,
        reply: Replier,
    ) -> Result<Called, BrokerError> {
        if message.durable {
            return Err(BrokerError::BadRequest(
                "a call is handed to its server, never stored: it cannot be marked durable".into(),
            ));
        }
        self.check_size(&message)?;
        // Held in memory until its server's connection takes it (a server that does not read
        // holds up to its channel's worth of calls): counted in the budget meanwhile, once the
        // function is found. A small call goes even when the budget is full (in-memory queues
        // may fill it), within a bounded allowance of its own.
        let size = message.size() + function::INVOCATION_OVERHEAD;
        let hold = || {
            let small = size <= SMALL_CALL_BYTES;
            MemoryHold::take(&self.memory, size, false)
                .or_else(|| small.then(|| MemoryHold::take(&self.small_calls_past_budget, size, false)).flatten())
                .ok_or_else(|| {
                    BrokerError::Limit(format!(
                        "a call of {size} bytes does not fit in the server's memory budget (max_memory_bytes) now"
                    ))
                })
        };
        let call = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let message =
            Message { timestamp: now_ns, destination: function.to_owned(), kind: MessageKind::Request, ..message };
        let deadline_ns = now_ns.saturating_add(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX));
        // The caller's own temporary reply queue becomes writable by the server that takes the call.
        let reply_queue = self.queue(&message.reply_to).filter(|q| q.owner == Some(caller));
        let (called, server) =
            self.functions.call((caller, function), (message, hold), oneway, call, (reply, deadline_ns))?;
        if let (Some(q), Some(server)) = (reply_queue, server) {
            q.grant_replier(server);
        }
        Ok(called)
    }

    /// A server's answer to `call`; `false` if nobody waits for it any more. A reply over
    /// `max_message_bytes` reaches its caller as a handler error saying so.
    pub fn reply(&self, call: u64, conn: ConnId, result: Result<Message, String>) -> bool {
        let result = match result {
            Ok(m) => match self.check_size(&m) {
                Ok(()) => Ok(m),
                Err(e) => Err(format!("the function's reply was refused: {e}")),
            },
            failed => failed,
        };
        self.functions.reply(call, conn, result)
    }

    /// A connection closed: its tentative reads go back, its temporary queues go away, its
    /// subscriptions end, its functions stop being served and calls waiting on it fail.
    /// `now_ns` dates what its returned reads bring to a dead-letter queue.
    pub fn disconnect(&self, consumer: ConnId, now_ns: u64) {
        let topics: Vec<Arc<Topic>> = self.topics.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        for t in topics {
            t.remove(|_, c| c == consumer, None);
        }
        self.functions.disconnect(consumer);
        let queues: Vec<Arc<Queue>> = self.read().queues.values().cloned().collect();
        for q in queues {
            if q.owner == Some(consumer) {
                // This one: a queue of the name made since (after an admin removed this one)
                // is someone else's.
                let _ = self.remove_queue_if(&q.name, Some(&q));
            } else {
                match q.release(consumer, now_ns) {
                    Ok(returned) => self.dead_letter(&q, returned.over_limit, DeadReason::MaxDeliveries, now_ns),
                    Err(e) => tracing::error!(queue = %q.name, error = %e, "could not return tentative reads"),
                }
            }
        }
    }

    /// Periodic work: visibility timeouts and expiry. Call it every few tens of milliseconds.
    ///
    /// Returns when a queue next has work (`u64::MAX`: none known); a queue whose work comes due
    /// sooner rings `alarm`. Call it then, or at the next regular beat, whichever is first.
    pub fn tick(&self, now_ns: u64) -> u64 {
        self.functions.expire(now_ns);
        let last = self.topics_given_back_at.load(Ordering::Relaxed);
        if now_ns >= last.saturating_add(TOPIC_GIVE_BACK_EVERY_NS) {
            self.topics_given_back_at.store(now_ns, Ordering::Relaxed);
            // Holding the topics' directories, which a removal holds until it has renamed the
            // topic's away: a topic made again under the name is never worked on as the old.
            let _dirs = self.topic_dirs.lock().unwrap_or_else(|e| e.into_inner());
            let topics: Vec<Arc<Topic>> =
                self.topics.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
            for topic in &topics {
                match topic.log.as_ref().map(|log| log.give_back()) {
                    Some(Ok(report)) => {
                        self.given_back.fetch_add(report.bytes_removed, Ordering::Relaxed);
                        if report.segments_removed > 0 {
                            topic.wake_group_readers();
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(topic = %shown(&topic.name), error = %e, "a durable topic's caps could not be applied; trying again in 10 s");
                    }
                    None => {}
                }
            }
        }
        // One pass over the queues: those due now, and when the others are (work coming due
        // sooner after this rings the alarm, which the caller set before the tick began). A
        // server with thousands of queues and one with delayed messages ticks every millisecond.
        let mut next = u64::MAX;
        let due: Vec<Arc<Queue>> = {
            let registry = self.read();
            let mut due = Vec::new();
            for q in registry.queues.values() {
                match q.next_due() {
                    at if at <= now_ns => due.push(Arc::clone(q)),
                    at => next = next.min(at),
                }
            }
            due
        };
        for q in &due {
            let (dead, failed, given_back) = q.tick(now_ns);
            self.given_back.fetch_add(given_back, Ordering::Relaxed);
            self.dead_letter(q, dead.over_limit, DeadReason::MaxDeliveries, now_ns);
            self.dead_letter(q, dead.expired, DeadReason::Expired, now_ns);
            if let Some(e) = failed {
                tracing::error!(queue = %q.name, error = %e, "tick failed; the queue's next one in 100 ms at the soonest");
            }
            next = next.min(q.next_due());
        }
        next
    }

    /// Rung when a queue's work comes due before the time `tick`'s caller last set on it.
    pub fn alarm(&self) -> Arc<TickAlarm> {
        Arc::clone(&self.alarm)
    }

    /// Whether authentication is on: every connection must then say who it is.
    pub fn auth_enabled(&self) -> bool {
        self.security().is_some()
    }

    /// The users and ACLs in force.
    pub fn security(&self) -> Option<Arc<Security>> {
        if !self.secured.load(Ordering::Acquire) {
            return None;
        }
        self.security.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the users and ACLs (a reload): connections already open keep their identity,
    /// and their next requests are decided by the new rules.
    pub fn set_security(&self, security: Security) {
        warn_of_unknown_acl_users(&security);
        *self.security.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(security));
        self.secured.store(true, Ordering::Release);
    }

    /// Requests refused by `authorize` since open.
    /// Bytes of segment files the tick deleted since open: what queues' consumers emptied, a
    /// drained queue's active segment, a durable topic's past its age cap (not those deleted at
    /// a segment roll).
    pub fn given_back_bytes(&self) -> u64 {
        self.given_back.load(Ordering::Relaxed)
    }

    pub fn denials(&self) -> u64 {
        self.denials.load(Ordering::Relaxed)
    }

    /// May `who` (`None`: not authenticated) do one of `actions` to the destination
    /// `kind`/`name`? The one place every protocol asks; the rules are in `security`'s
    /// documentation. A refusal is counted.
    pub fn authorize(
        &self,
        who: Option<&Principal>,
        kind: Kind,
        name: &str,
        actions: &[Action],
    ) -> Result<(), BrokerError> {
        let decided = self.decide(who, kind, name, actions);
        if decided.is_err() {
            self.denials.fetch_add(1, Ordering::Relaxed);
        }
        decided
    }

    /// `authorize` without counting: for filtering what a user is shown (lists).
    pub fn may(&self, who: Option<&Principal>, kind: Kind, name: &str, actions: &[Action]) -> bool {
        self.decide(who, kind, name, actions).is_ok()
    }

    /// Whether `who` is a user at all (authentication off: everyone is).
    pub fn authenticated(&self, who: Option<&Principal>) -> Result<(), BrokerError> {
        match self.security() {
            None => Ok(()),
            Some(security) => self.user_of(&security, who).map(|_| ()),
        }
    }

    fn user_of<'a>(&self, security: &'a Security, who: Option<&Principal>) -> Result<&'a security::User, BrokerError> {
        let Some(who) = who else { return Err(BrokerError::Unauthorized("authenticate first".into())) };
        security
            .users
            .get(&who.user)
            .ok_or_else(|| BrokerError::Unauthorized(format!("user {:?} no longer exists", who.user)))
    }

    fn decide(&self, who: Option<&Principal>, kind: Kind, name: &str, actions: &[Action]) -> Result<(), BrokerError> {
        let Some(security) = self.security() else { return Ok(()) };
        let user = self.user_of(&security, who)?;
        let who = who.expect("a user was found for it");
        if user.role == security::Role::Admin {
            return Ok(());
        }
        // Its owner (or a function's replier) may use a temporary queue whatever the entries
        // grant, unless one denies it, or, for a fanout child, its parent refuses the poll: a
        // reload can take either away after the queue was made. Its owner may always remove it.
        if kind == Kind::Queue
            && let Some(q) = self.queue(name)
            && q.owner.is_some()
            && (q.owner == Some(who.conn) || (actions.contains(&Action::Offer) && q.is_replier(who.conn)))
            && actions.iter().any(|&a| {
                a == Action::Manage
                    || !security.acl.denies(&who.user, kind, name)
                        && security.acl.parent_allows(&who.user, kind, name, a)
            })
        {
            return Ok(());
        }
        // A fanout child's parent is asked too (`Acl::parent_allows`), at every poll, not only
        // when the child is made, so that an ACL on the parent covers children made before it,
        // or by an admin.
        if actions.iter().any(|&a| {
            a != Action::Manage
                && security.acl.allows(&who.user, kind, name, a)
                && security.acl.parent_allows(&who.user, kind, name, a)
        }) {
            return Ok(());
        }
        let action = actions.first().copied().unwrap_or(Action::Manage);
        Err(BrokerError::Forbidden(format!("user {:?} may not {action} {kind} {:?}", who.user, shown(name))))
    }

    /// Moves messages taken out of `from` (expired, or at its delivery limit) to its
    /// dead-letter queue, made by first use like Kestrel's `expire_to_queue`. Each carries why
    /// in the header `petrel-dead-letter-reason` and, at the delivery limit, its count in
    /// `petrel-deliveries`; without a dead-letter queue, expired messages just go.
    ///
    /// Only once the dead-letter queue has them are they settled in `from` (see `Leaving`): a
    /// crash in between leaves them in `from`, to be handed out or dead-lettered again.
    fn dead_letter(&self, from: &Queue, leaving: Leaving, why: DeadReason, now_ns: u64) {
        let (messages, unsettled) = leaving.into_parts();
        self.hand_to_dead_letter_queue(from, messages, why, now_ns);
        from.settle_left(unsettled);
    }

    fn hand_to_dead_letter_queue(&self, from: &Queue, messages: Vec<Message>, why: DeadReason, now_ns: u64) {
        let dead_letter = &from.config().dead_letter;
        if messages.is_empty() || dead_letter.is_empty() {
            return;
        }
        let mut moved = messages
            .into_iter()
            .map(|mut m| {
                // In place of those of an earlier dead-lettering (a dead-letter queue's own dead
                // letters): a message carries two at most, within the wire's count (`MAX_HEADERS`).
                m.headers.retain(|(name, _)| name != DEAD_LETTER_REASON && name != DEAD_LETTER_DELIVERIES);
                m.headers.push((DEAD_LETTER_REASON.into(), why.as_str().into()));
                if why == DeadReason::MaxDeliveries {
                    m.headers.push((DEAD_LETTER_DELIVERIES.into(), m.deliveries.to_string().into()));
                }
                // Not a producer's offer: a key the dead-letter queue has seen (another message
                // moved there with it) must not make it drop this one.
                Message { expires_at: 0, idempotency_key: Default::default(), ..m }
            })
            .collect::<Vec<_>>();
        let lost = |n: usize, e: &BrokerError| {
            from.count_dead_letters_lost(n as u64);
            tracing::warn!(queue = %from.name, %dead_letter, error = %e, reason = why.as_str(), messages = n, "dead letters lost");
        };
        let to = match self.queue_or_create(dead_letter) {
            Ok(to) => to,
            Err(e) => return lost(moved.len(), &e),
        };
        // One offer per run of one priority (a queue with levels takes one priority per offer).
        while !moved.is_empty() {
            let run = moved.iter().take_while(|m| m.priority == moved[0].priority).count();
            let mut batch: Vec<Message> = moved.drain(..run).collect();
            let offered =
                self.offer_sized_unsynced(&to, &mut batch, now_ns, true).and_then(|offered| offered.unsynced.wait());
            if let Err(e) = offered {
                lost(run, &e);
            }
        }
    }

    /// The durability of the log of a queue configured as `config` (checked: see `config::checked`).
    fn durability_of(&self, config: &QueueConfig) -> Result<Durability, BrokerError> {
        let named = config::durability_of(config).map_err(BrokerError::BadRequest)?;
        Ok(named.unwrap_or(self.options.durability))
    }

    /// Writes a queue's definition (file, then rename); synced unless its durability is none.
    /// Returns whether it made the queue's directory (which then holds the definition alone).
    fn save_definition(&self, name: &str, config: &QueueConfig, follows_defaults: bool) -> Result<bool, BrokerError> {
        let dir = self.dir.join("queues").join(name);
        let path = dir.join(DEFINITION);
        let failed = |e: std::io::Error| BrokerError::Definitions(format!("{}: {e}", in_data_dir(&path)));
        let made = match std::fs::create_dir(&dir) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(&dir).map(|()| true).map_err(failed)?
            }
            Err(e) => return Err(failed(e)),
        };
        let tmp = path.with_extension("json.tmp");
        let def = Definition { name: name.to_owned(), config: config.clone(), follows_defaults };
        std::fs::write(&tmp, serde_json::to_vec_pretty(&def).expect("definitions serialize")).map_err(failed)?;
        let sync = self.durability_of(config)? != Durability::None;
        if sync {
            std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(failed)?;
        }
        std::fs::rename(&tmp, &path).map_err(failed)?;
        if sync {
            for d in [&dir, &self.dir.join("queues")] {
                std::fs::File::open(d).and_then(|f| f.sync_all()).map_err(failed)?;
            }
        }
        Ok(made)
    }

    /// The directories under `queues/`, by name, each a queue's if it holds a definition (see
    /// `read_definition`). Removals cut short by a crash are finished here.
    fn queue_dirs(&self) -> Result<Vec<PathBuf>, BrokerError> {
        let queues = self.dir.join("queues");
        let failed = |p: &Path, e: &dyn std::fmt::Display| BrokerError::Definitions(format!("{}: {e}", p.display()));
        let mut dirs = Vec::new();
        for entry in std::fs::read_dir(&queues).map_err(|e| failed(&queues, &e))? {
            let dir = entry.map_err(|e| failed(&queues, &e))?.path();
            if dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with(REMOVED)) {
                std::fs::remove_dir_all(&dir).map_err(|e| failed(&dir, &e))?;
                continue;
            }
            dirs.push(dir);
        }
        dirs.sort();
        Ok(dirs)
    }
}

/// The definition in a queue's directory. A directory without one (a creation cut short before
/// its definition was written) holds no message and is left alone.
fn read_definition(dir: &Path) -> Result<Option<Definition>, BrokerError> {
    let path = dir.join(DEFINITION);
    let failed = |e: &dyn std::fmt::Display| BrokerError::Definitions(format!("{}: {e}", path.display()));
    match std::fs::read(&path) {
        Ok(bytes) => {
            let def: Definition = serde_json::from_slice(&bytes).map_err(|e| failed(&e))?;
            // A copy of a queue's directory under another name (a backup left beside it) would
            // open that queue's log a second time: it is no queue of its own.
            if dir.file_name() != Some(std::ffi::OsStr::new(&def.name)) {
                tracing::warn!(dir = %dir.display(), queue = %shown(&def.name), "a definition of another queue's name; ignored");
                return Ok(None);
            }
            Ok(Some(def))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(dir = %dir.display(), "no queue definition; ignored");
            Ok(None)
        }
        Err(e) => Err(failed(&e)),
    }
}

/// Threads that open a server's queues when it starts: more than a small host's cores, because
/// on a cold start they mostly wait for the disk. (Their allocator pages stay with the process
/// when they end, free, until the allocator's next purges: 30 MB more resident right after a
/// start with 10,000 queues, 9 MB after two seconds of traffic.)
const OPENING_THREADS: usize = 8;

/// `work` done on each of `items` by this thread and up to `threads - 1` more, each taking the
/// next item not taken; the results in the items' order. After a failure no item past it is
/// begun, and the error returned is the first in the items' order (the same however the threads
/// fall). A thread the system refuses is done without.
fn on_threads<T: Sync, R: Send, E: Send>(
    threads: usize,
    items: &[T],
    work: impl Fn(&T) -> Result<R, E> + Sync,
) -> Result<Vec<R>, E> {
    let next = AtomicUsize::new(0);
    // The lowest item that failed (`usize::MAX`: none yet).
    let failed = AtomicUsize::new(usize::MAX);
    let worker = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= items.len() || i > failed.load(Ordering::Relaxed) {
                return done;
            }
            let result = work(&items[i]);
            if result.is_err() {
                failed.fetch_min(i, Ordering::Relaxed);
            }
            done.push((i, result));
        }
    };
    let mut done: Vec<(usize, Result<R, E>)> = std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads.min(items.len()))
            .map_while(|_| std::thread::Builder::new().spawn_scoped(scope, worker).ok())
            .collect();
        let mut done = worker();
        for helper in helpers {
            done.extend(helper.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
        }
        done
    });
    done.sort_unstable_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// A queue's creation under way: its name leaves the names being created when it ends, whether
/// it succeeded, failed or panicked, and whoever waits for it is woken.
struct Creation<'a> {
    broker: &'a Broker,
    name: &'a str,
    ended: bool,
}

impl<'a> Creation<'a> {
    fn new(broker: &'a Broker, name: &'a str) -> Creation<'a> {
        Creation { broker, name, ended: false }
    }

    /// Ends the creation; returns the definitions' lock, held.
    fn end(mut self) -> MutexGuard<'a, HashSet<String>> {
        self.ended = true;
        self.release()
    }

    /// Frees the name and wakes whoever waits for it.
    fn release(&self) -> MutexGuard<'a, HashSet<String>> {
        let mut creating = self.broker.definitions.lock().unwrap_or_else(|e| e.into_inner());
        creating.remove(self.name);
        self.broker.creation_ended.notify_all();
        creating
    }
}

impl Drop for Creation<'_> {
    fn drop(&mut self) {
        if !self.ended {
            drop(self.release()); // (a panic while the files were made)
        }
    }
}

/// The prefix of a queue's or topic's directory being removed; found at open, it is finished.
/// (Names cannot start with `.`.)
const REMOVED: &str = ".removed-";

/// Removes `parent/name`, renaming it out of the way first so that a crash midway never leaves
/// half a queue or topic where the next open would find it.
fn remove_dir(parent: &Path, name: &str) -> Result<(), BrokerError> {
    let dir = parent.join(name);
    let doomed = parent.join(format!("{REMOVED}{name}"));
    let failed = |e: std::io::Error| BrokerError::Definitions(format!("remove {}: {e}", in_data_dir(&dir)));
    let _ = std::fs::remove_dir_all(&doomed); // a leftover of an earlier removal
    std::fs::rename(&dir, &doomed).map_err(failed)?;
    std::fs::remove_dir_all(&doomed).map_err(failed)
}

/// A path as errors show it to clients: as it is under the data directory (from its `queues/` or
/// `topics/` on), or its last three parts; never where the data directory is.
fn in_data_dir(path: &Path) -> String {
    let parts: Vec<_> = path.components().map(|c| c.as_os_str().to_string_lossy()).collect();
    let from = parts.iter().rposition(|p| p == "queues" || p == "topics").unwrap_or(parts.len().saturating_sub(3));
    parts[from..].join("/")
}

fn storage_text(e: &petrel_log::Error) -> String {
    use petrel_log::Error::*;
    match e {
        Io { op, path, source } => format!("{op} {}: {source}", in_data_dir(path)),
        SegmentAllocation { path, size, source } => {
            format!("cannot allocate segment {} ({size} bytes): {source} — is the disk full?", in_data_dir(path))
        }
        Corrupt { file, position, reason, .. } => {
            // The log's directory (a cursor file is in its `groups/`), for the offline tools: under
            // the data directory, which clients are not told.
            let dir = file.parent().map(|d| if d.ends_with("groups") { d.parent().unwrap_or(d) } else { d });
            let tools = dir.map_or_else(String::new, |d| {
                format!(
                    " (`petrel log verify DATA/{0}` says what is damaged, `petrel log repair DATA/{0}` what it would do)",
                    in_data_dir(d)
                )
            });
            format!("corrupt log: {} at byte {position}: {reason}{tools}", in_data_dir(file))
        }
        Locked { path } => format!("log {} is open in another process", in_data_dir(path)),
        NotALog { path, reason } => format!("{} is not a Petrel log: {reason}", in_data_dir(path)),
        UnsupportedFormat { file, what } => {
            format!("segment {} is of a format this build does not read ({what})", in_data_dir(file))
        }
        other => other.to_string(),
    }
}

/// The punctuation a name may hold besides letters and digits: what names in other queues use
/// as separators (`jobs:high`, `user@host`, `region=eu`), and each safe unescaped in a file name,
/// a URL's path, a metric's label and a memcache key. Not `*` (ACL entries' wildcard), `/` (a
/// memcache read option), `%`, `?`, `#` (URLs) or quotes and brackets (HTML, TOML).
const NAME_PUNCTUATION: &[u8] = b"._-+:@=,";

/// Queue, topic and function names: 1–200 letters, digits and `NAME_PUNCTUATION`, not starting
/// with `.` or `+` (`+` separates a fanout child from its parent).
pub fn check_name(name: &str) -> Result<(), BrokerError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || NAME_PUNCTUATION.contains(&b))
        && !name.starts_with(['.', '+']);
    match ok {
        true => Ok(()),
        false => Err(BrokerError::BadRequest(format!(
            "invalid queue name {:?}: 1 to 200 of the letters a-z and A-Z, the digits and . _ - + : @ = , (a fanout child: parent+child), not starting with '.' or '+'",
            shown(name)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn durable_with_dead_letters(dir: &Path, q: QueueConfig) -> Broker {
        let b = Broker::open(dir, BrokerOptions::default()).unwrap();
        b.create_queue("dlq", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
        b.create_queue("q", QueueConfig { dead_letter: "dlq".into(), ..q }, None).unwrap();
        b
    }

    fn payloads_in(b: &Broker, queue: &str, now_ns: u64) -> Vec<Vec<u8>> {
        b.poll(queue, 10, None, 9, now_ns).unwrap().iter().map(|d| d.message.payload.to_vec()).collect()
    }

    /// A message at its delivery limit stays in its durable queue, unacknowledged, until the
    /// dead-letter queue has it: a crash in between (here the broker is dropped after the
    /// queue's half of an abort, before the hand-over) leaves it in the queue, never in neither.
    #[test]
    fn a_message_at_its_delivery_limit_is_in_one_queue_or_the_other_across_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let config = QueueConfig { durable: true, max_deliveries: 1, ..QueueConfig::default() };
        {
            let b = durable_with_dead_letters(dir.path(), config.clone());
            b.offer("q", vec![Message::new(&b"poison"[..])], MS).unwrap();
            let got = b.poll("q", 1, Some(Duration::from_secs(60)), 1, 2 * MS).unwrap();
            let returned = b.get("q").unwrap().abort(&[got[0].handle], 1, 0, 3 * MS).unwrap();
            assert_eq!(returned.over_limit.messages.len(), 1, "at its limit");
        }
        let b = durable_with_dead_letters(dir.path(), config.clone());
        assert_eq!(payloads_in(&b, "dlq", 4 * MS), Vec::<Vec<u8>>::new(), "the hand-over never happened");
        let got = b.poll("q", 1, Some(Duration::from_secs(60)), 1, 5 * MS).unwrap();
        assert_eq!(got.len(), 1, "still in its queue");
        // The whole abort this time: in the dead-letter queue, and settled in its own.
        b.abort("q", &[got[0].handle], 1, 0, 6 * MS).unwrap();
        drop(b);
        let b = durable_with_dead_letters(dir.path(), config);
        assert_eq!(payloads_in(&b, "q", 7 * MS), Vec::<Vec<u8>>::new(), "settled once handed over");
        assert_eq!(payloads_in(&b, "dlq", 8 * MS), [b"poison".to_vec()]);
    }

    /// An expired head that cannot be taken out now (its level has as many records out as its
    /// log allows) stays where it is, and a peek or a tick says nothing is wrong: it fell back
    /// to dropping it, which failed the same way, and lost what it had taken out before.
    #[test]
    fn an_expired_head_at_the_limit_of_records_out_waits_for_room() {
        let dir = tempfile::tempdir().unwrap();
        let b = durable_with_dead_letters(dir.path(), QueueConfig { durable: true, ..QueueConfig::default() });
        let q = b.get("q").unwrap();
        let n = petrel_log::MAX_PENDING;
        b.offer("q", (0..n).map(|i| Message::new(format!("m{i}").into_bytes())).collect(), MS).unwrap();
        let mut m = Message::new(&b"stale"[..]);
        m.expires_at = 10 * MS;
        b.offer("q", vec![m], MS).unwrap();
        let mut out = Vec::new();
        while out.len() < n {
            let got = b.poll("q", n - out.len(), Some(Duration::from_secs(60)), 1, 2 * MS).unwrap();
            assert!(!got.is_empty());
            out.extend(got.into_iter().map(|d| d.handle));
        }
        assert_eq!(b.peek(&q, 20 * MS).unwrap(), None, "nothing to show, and no error");
        let (_, failed, _) = q.tick(20 * MS);
        assert!(failed.is_none(), "{failed:?}");
        assert_eq!(q.status().items, 1, "the expired one waits");
        // For an acknowledgement, not for a tick: one due at once would come every millisecond.
        assert!(q.next_due() > 20 * MS, "due again at once: {}", q.next_due());
        b.ack("q", &out, 1).unwrap();
        assert!(q.next_due() <= 10 * MS, "due once it may be taken: {}", q.next_due());
        b.tick(30 * MS);
        assert_eq!(payloads_in(&b, "dlq", 40 * MS), [b"stale".to_vec()]);
        assert_eq!(q.status().items, 0);
    }

    /// Well below the limit of records out (200 open, the limit 8192), a head's expiry is planned
    /// as ever: the check of a level held back must not take "may stop" for "stops".
    #[test]
    fn a_head_s_expiry_is_planned_with_many_reads_open() {
        let dir = tempfile::tempdir().unwrap();
        let b = durable_with_dead_letters(dir.path(), QueueConfig { durable: true, ..QueueConfig::default() });
        let q = b.get("q").unwrap();
        b.offer("q", (0..200).map(|i| Message::new(format!("m{i}").into_bytes())).collect(), MS).unwrap();
        let mut m = Message::new(&b"stale"[..]);
        m.expires_at = 10 * MS;
        b.offer("q", vec![m], MS).unwrap();
        assert_eq!(b.poll("q", 200, Some(Duration::from_secs(60)), 1, 2 * MS).unwrap().len(), 200);
        q.tick(5 * MS);
        assert!(q.next_due() <= 10 * MS, "the head's expiry: {}", q.next_due());
    }

    /// A message returned with a redelivery delay is copied to the delayed log and then
    /// acknowledged where it was; a crash between the two drops the copy at the next open (its
    /// original still waits), and the original keeps the delivery counted: dead-lettered after
    /// exactly `max_deliveries` deliveries all the same. Both for a message in its level's log
    /// and for one released from the delayed log.
    #[test]
    fn a_delivery_returned_with_a_delay_is_counted_across_a_crash_before_its_copy_stands() {
        for released in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let config = QueueConfig { durable: true, max_deliveries: 2, ..QueueConfig::default() };
            let hour = Duration::from_secs(3600);
            {
                let b = durable_with_dead_letters(dir.path(), config.clone());
                let mut m = Message::new(&b"poison"[..]);
                if released {
                    m.delay_ms = 1; // due at once, then handed out from the delayed log
                }
                b.offer("q", vec![m], MS).unwrap();
                b.tick(10 * MS);
                let got = b.poll("q", 1, Some(hour), 1, 20 * MS).unwrap();
                assert_eq!(got.len(), 1);
                queue::CRASH_AFTER_DELAYED_COPIES.set(true);
                b.abort("q", &[got[0].handle], 1, 5, 30 * MS).unwrap();
                queue::CRASH_AFTER_DELAYED_COPIES.set(false);
            }
            let b = durable_with_dead_letters(dir.path(), config.clone());
            b.tick(100 * MS);
            let got = b.poll("q", 1, Some(hour), 1, 110 * MS).unwrap();
            assert_eq!(got.len(), 1, "released {released}: one of original and copy");
            assert_eq!(got[0].message.deliveries, 2, "released {released}: the delivery before the crash counts");
            b.abort("q", &[got[0].handle], 1, 0, 120 * MS).unwrap();
            assert_eq!(payloads_in(&b, "dlq", 130 * MS), [b"poison".to_vec()], "released {released}");
            assert_eq!(payloads_in(&b, "q", 140 * MS), Vec::<Vec<u8>>::new(), "released {released}");
        }
    }

    /// The same for a message that expired: taken out by the tick, it stays unacknowledged in
    /// its queue until the dead-letter queue has it.
    #[test]
    fn an_expired_message_is_in_one_queue_or_the_other_across_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let config = QueueConfig { durable: true, ..QueueConfig::default() };
        {
            let b = durable_with_dead_letters(dir.path(), config.clone());
            let mut m = Message::new(&b"stale"[..]);
            m.expires_at = 10 * MS;
            b.offer("q", vec![m, Message::new(&b"fresh"[..])], MS).unwrap();
            let (dead, failed, _) = b.get("q").unwrap().tick(20 * MS);
            assert!(failed.is_none());
            assert_eq!(dead.expired.messages.len(), 1, "expired");
        }
        let b = durable_with_dead_letters(dir.path(), config.clone());
        assert_eq!(payloads_in(&b, "dlq", 30 * MS), Vec::<Vec<u8>>::new(), "the hand-over never happened");
        // Met again by the next tick (or poll), and handed over this time.
        b.tick(40 * MS);
        assert_eq!(payloads_in(&b, "q", 50 * MS), [b"fresh".to_vec()]);
        drop(b);
        let b = durable_with_dead_letters(dir.path(), config);
        assert_eq!(payloads_in(&b, "q", 60 * MS), Vec::<Vec<u8>>::new());
        assert_eq!(payloads_in(&b, "dlq", 70 * MS), [b"stale".to_vec()]);
    }

    #[test]
    fn work_on_threads_comes_back_in_order_and_stops_at_the_first_failure() {
        let items: Vec<u64> = (0..1000).collect();
        let squares: Result<Vec<u64>, u64> = on_threads(8, &items, |&i| Ok(i * i));
        assert_eq!(squares.unwrap(), items.iter().map(|i| i * i).collect::<Vec<_>>());
        let begun = AtomicUsize::new(0);
        let failed = on_threads(8, &items, |&i| {
            begun.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_micros(100));
            if i % 100 == 37 { Err(i) } else { Ok(i) }
        });
        assert_eq!(failed, Err(37), "the first failure in the items' order");
        assert!(begun.into_inner() < 100, "work past a failure is not begun");
        assert_eq!(on_threads(8, &[] as &[u64], |&i| Ok::<_, ()>(i)), Ok(vec![]));
    }
}
