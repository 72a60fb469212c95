//! One queue: in memory or on a `petrel-log`, bounded or circular, with tentative reads that come
//! back unless acknowledged, and expiry.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::Duration;

use crate::waitlist::Waitlist;
use petrel_log::{ConsumerGroup, Durability, GroupOptions, MAX_PENDING, SharedLog};

use crate::dedup::DedupWindow;
use crate::delay::{self, DelayLog, Ready};
use crate::held::{DELAYED_OVERHEAD, HELD_OVERHEAD, Held, HeldQueue};
use crate::message::{self, Message, Placement};
use crate::{BrokerError, ConnId, Delivery, NumberMap, QueueConfig, QueueStats, config, counting, deliveries_of};

/// What the broker counts for a queue: more than QUEUE_STATUS carries (`Queue::status`), all of
/// it on the server's metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueCounters {
    pub items: u64,
    /// Bytes of the messages waiting and in flight.
    pub bytes: u64,
    pub in_flight: u64,
    pub in_flight_bytes: u64,
    pub total_offered: u64,
    pub total_polled: u64,
    pub expired: u64,
    /// Dropped to make room (circular), or fanout copies the queue refused.
    pub dropped: u64,
    /// Consumers waiting for a message.
    pub waiters: u64,
    /// Messages taken tentatively.
    pub opened: u64,
    /// Tentative reads returned to the queue (abort, visibility timeout, disconnect).
    pub aborted: u64,
    /// Tentative reads acknowledged (messages taken for good are not counted here).
    pub acked: u64,
    pub flushes: u64,
    /// Moved to the dead-letter queue after `max_deliveries` deliveries.
    pub dead_lettered: u64,
    /// Offered messages not stored because their idempotency key was remembered (repeats).
    pub deduplicated: u64,
    /// Expired or over `max_deliveries`, and not taken by the dead-letter queue (full, or
    /// failing): gone, each logged as a warning.
    pub dead_letters_lost: u64,
    /// Idempotency keys remembered now.
    pub dedup_keys: u64,
    /// Messages stored but not yet due: delayed offers and delayed redeliveries (not in
    /// `items`).
    pub delayed: u64,
    /// When the message most recently taken from the queue was offered, ns (0: none yet).
    pub last_taken_offered_at: u64,
}

/// A message taken tentatively and not yet acknowledged or returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenRead {
    /// What its consumer acknowledges or aborts it with.
    pub handle: u64,
    /// The message's id in the queue.
    pub message_id: u64,
    pub consumer: ConnId,
    /// When it was taken, ns since the epoch.
    pub taken_at_ns: u64,
    /// When it goes back to the queue unless acknowledged, ns since the epoch.
    pub deadline_ns: u64,
    pub bytes: u64,
}

/// What a poll gave, and the expired messages it stepped over (for the dead-letter queue).
#[derive(Debug, Default)]
pub struct Polled {
    pub deliveries: Vec<Delivery>,
    pub expired: Leaving,
}

/// Tentative reads put back: how many, and those that reached the queue's `max_deliveries` and
/// go to its dead-letter queue instead (with their delivery count).
#[derive(Debug, Default)]
pub(crate) struct Returned {
    pub count: u32,
    pub over_limit: Leaving,
}

/// What a tick takes out of a queue for its dead-letter queue.
#[derive(Debug, Default)]
pub(crate) struct DeadLetters {
    pub expired: Leaving,
    pub over_limit: Leaving,
}

/// Messages taken out of a queue for its dead-letter queue (expired, or at the delivery limit),
/// and, when it has one, what settles them in this queue once the dead-letter queue holds them
/// (`Queue::settle_left`). Until then a durable queue's records stay unacknowledged: a crash
/// between the two leaves a message where it was (handed out again, or dead-lettered twice),
/// never in neither queue.
#[derive(Default)]
pub struct Leaving {
    pub(crate) messages: Vec<Message>,
    takings: Vec<Taken>,
}

impl std::fmt::Debug for Leaving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leaving")
            .field("messages", &self.messages.len())
            .field("unsettled", &self.takings.len())
            .finish()
    }
}

impl Leaving {
    pub(crate) fn is_empty(&self) -> bool {
        self.messages.is_empty() && self.takings.is_empty()
    }

    /// The messages, and what settles them (`Queue::settle_left`).
    pub(crate) fn into_parts(self) -> (Vec<Message>, Unsettled) {
        (self.messages, Unsettled(self.takings))
    }
}

/// Messages on their way to a dead-letter queue, still unacknowledged in their own.
pub(crate) struct Unsettled(Vec<Taken>);

/// Function servers remembered per temporary queue as allowed to reply to it.
const MAX_REPLIERS: usize = 64;

/// Bytes of messages the server holds in memory (in-memory and temporary queues, messages
/// waiting for topic subscribers), against `BrokerOptions::max_memory_bytes`: a queue's message
/// counts its size and what holding it takes (`held::HELD_OVERHEAD`). Each queue's share
/// is settled whenever its lock is let go (see `Locked`), a subscriber's as messages are handed
/// to it and taken, so the sum is exact between operations.
#[derive(Debug, Default)]
pub struct MemoryBudget {
    used: AtomicU64,
    /// 0: no limit. Changed by a reload; holdings above a lowered limit stay until let go.
    max: AtomicU64,
}

impl MemoryBudget {
    pub fn new(max: u64) -> MemoryBudget {
        MemoryBudget { used: AtomicU64::new(0), max: AtomicU64::new(max) }
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    pub fn set_max(&self, max: u64) {
        self.max.store(max, Ordering::Relaxed);
    }

    /// Whether `bytes` more fit. Concurrent offers to different queues may pass together and
    /// overshoot by what they carry (each at most `max_message_bytes` × a batch).
    fn fits(&self, bytes: u64) -> bool {
        let max = self.max();
        max == 0 || self.used().saturating_add(bytes) <= max
    }

    /// Takes `bytes` from the budget if they fit, or whatever is left when `always`.
    pub(crate) fn reserve(&self, bytes: u64, always: bool) -> bool {
        let used = self.used.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let max = self.max();
        if max != 0 && used > max && !always {
            counting::subtract_shared(&self.used, bytes, "the memory budget");
            return false;
        }
        true
    }

    pub(crate) fn release(&self, bytes: u64) {
        counting::subtract_shared(&self.used, bytes, "the memory budget");
    }

    fn settle(&self, before: u64, after: u64) {
        if after > before {
            self.used.fetch_add(after - before, Ordering::Relaxed);
        } else {
            counting::subtract_shared(&self.used, before - after, "the memory budget");
        }
    }
}

/// Bytes taken from the memory budget for something outside the queues (a request being read
/// into memory); given back when dropped.
#[derive(Debug)]
pub struct MemoryHold {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl MemoryHold {
    /// `bytes` from `budget`, if they fit (or whether they fit or not, `always`: bytes already
    /// in memory, counted again).
    pub(crate) fn take(budget: &Arc<MemoryBudget>, bytes: u64, always: bool) -> Option<MemoryHold> {
        budget.reserve(bytes, always).then(|| MemoryHold { budget: Arc::clone(budget), bytes })
    }
}

impl Drop for MemoryHold {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

/// When the broker's tick next runs, and how to bring it forward: a queue whose work comes due
/// sooner (a delayed message, a visibility deadline, an expiry) lowers it, so that the tick runs
/// at that time rather than at its next regular beat (`BrokerOptions`' caller keeps the beat).
/// The ticker is a thread of its own that waits here (`wait_until`), not a task: a tick every
/// millisecond then wakes no thread of the caller's runtime. Work coming due wakes the ticker
/// only while it waits, and only when it comes due before the ticker's time: the wake-up is a
/// system call made under the offering queue's lock, and delayed offers come many to a tick.
#[derive(Debug)]
pub struct TickAlarm {
    /// When the ticker ticks next, ns: lowered by work that comes due sooner; `u64::MAX` while
    /// it ticks (`start_tick`), so that what comes due meanwhile lowers it.
    at: AtomicU64,
    /// The ticker is in `wait_until`, reading `at` no more until woken.
    waiting: std::sync::atomic::AtomicBool,
    /// Rung since the ticker last waited: it ticks at once (a ring while it ticks is not lost).
    rung: Mutex<bool>,
    bell: Condvar,
}

impl Default for TickAlarm {
    fn default() -> Self {
        TickAlarm {
            at: AtomicU64::new(u64::MAX),
            waiting: std::sync::atomic::AtomicBool::new(false),
            rung: Mutex::new(false),
            bell: Condvar::new(),
        }
    }
}

impl TickAlarm {
    /// A tick starts: what comes due from here on lowers the time of the next (what came due
    /// before, the tick finds in its queues).
    pub fn start_tick(&self) {
        self.at.store(u64::MAX, Ordering::SeqCst);
    }

    /// Waits until `planned_ns`, or until the earlier time that work came due for since the tick
    /// started (also while waiting), or until rung; `clock` tells the time, ns.
    pub fn wait_until(&self, planned_ns: u64, clock: impl Fn() -> u64) {
        self.at.fetch_min(planned_ns, Ordering::SeqCst);
        let mut rung = self.rung.lock().unwrap_or_else(|e| e.into_inner());
        // Set before `at` is read: work that lowers `at` after this sees it and wakes the wait;
        // work that lowered it before, this wait reads (both sides are sequentially consistent).
        self.waiting.store(true, Ordering::SeqCst);
        while !*rung {
            let (at, now) = (self.at.load(Ordering::SeqCst), clock());
            if now >= at {
                break;
            }
            let timeout = Duration::from_nanos(at - now);
            rung = self.bell.wait_timeout(rung, timeout).unwrap_or_else(|e| e.into_inner()).0;
        }
        self.waiting.store(false, Ordering::SeqCst);
        *rung = false;
    }

    /// Brings the next tick forward to now (also to end a ticker that is told to stop).
    pub fn ring(&self) {
        *self.rung.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.bell.notify_one();
    }

    fn ring_for(&self, due_ns: u64) {
        // Most calls change nothing (an offer delayed as the one before it): a read, no write.
        if due_ns < self.at.load(Ordering::Relaxed)
            && due_ns < self.at.fetch_min(due_ns, Ordering::SeqCst)
            && self.waiting.load(Ordering::SeqCst)
        {
            // Taken so that the ticker is in its wait (or past it) when notified.
            let _rung = self.rung.lock().unwrap_or_else(|e| e.into_inner());
            self.bell.notify_one();
        }
    }
}

/// When a queue's tick next has work, ns: lowered by whatever adds work, set by the tick.
#[derive(Debug)]
struct Due {
    at: AtomicU64,
    /// After a tick the disk failed, none before this (`TICK_RETRY_NS` later), whatever asks
    /// for one sooner: a failing disk is retried, not spun on. 0 once a tick went through.
    not_before: AtomicU64,
    alarm: Arc<TickAlarm>,
}

impl Due {
    fn lower(&self, due_ns: u64) {
        let due_ns = due_ns.max(self.not_before.load(Ordering::Relaxed));
        // Most calls lower nothing (each offer to a keyed queue asks): a read, no write.
        if due_ns < self.at.load(Ordering::Relaxed) {
            self.at.fetch_min(due_ns, Ordering::Relaxed);
        }
        self.alarm.ring_for(due_ns);
    }

    fn set(&self, due_ns: u64) {
        let due_ns = due_ns.max(self.not_before.load(Ordering::Relaxed));
        self.at.store(due_ns, Ordering::Relaxed);
        self.alarm.ring_for(due_ns);
    }

    /// `set` by the tick itself, which need not be rung: its caller asks every queue when it
    /// is next due.
    fn planned(&self, due_ns: u64) {
        self.at.store(due_ns, Ordering::Relaxed);
    }

    fn load(&self) -> u64 {
        self.at.load(Ordering::Relaxed)
    }
}

/// A queue's lock. Letting it go settles the queue's bytes with the memory budget and, when a
/// message left the head (a poll, a circular drop, an expiry), lets the tick know when the new
/// head expires: whatever changed the head, the tick learns it here.
struct Locked<'a> {
    guard: std::sync::MutexGuard<'a, Inner>,
    budget: Option<&'a MemoryBudget>,
    bytes_before: u64,
    due_ns: &'a Due,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        if let Some(budget) = self.budget {
            budget.settle(self.bytes_before, self.guard.held_bytes());
        }
        // One marker for the released delayed messages settled under the lock; if it cannot be
        // written now, the next tick tries again.
        if let Store::Log { delayed: Some(delay), .. } = &mut self.guard.store
            && delay.write_settled().is_err()
        {
            self.due_ns.lower(0);
        }
        if std::mem::take(&mut self.guard.head_taken) {
            // A head that cannot be read now (a storage error) is looked at by the next tick.
            let expiry = self.guard.head_expiry().unwrap_or(Some(0));
            if let Some(expiry) = expiry {
                self.due_ns.lower(expiry);
            }
        }
        // Once per plan: the tick plans the next itself.
        if !self.guard.give_back_planned
            && let Some(due) = self.guard.give_back_due()
        {
            self.guard.give_back_planned = true;
            self.due_ns.lower(due);
        }
    }
}

pub struct Queue {
    pub name: String,
    /// Replaced whole by a reload (`reconfigure`); what kind of queue it is never changes.
    config: RwLock<Arc<QueueConfig>>,
    /// In memory: the server's memory budget, and the bytes this queue holds at most when its
    /// configuration sets no `max_bytes`.
    memory: Option<(std::sync::Arc<MemoryBudget>, u64)>,
    /// For temporary queues: the connection that owns it.
    pub owner: Option<ConnId>,
    /// Made by first use: its configuration is the server's for its name (its block, its
    /// parent's, or the defaults), taken again at each start and reload (`config::following`).
    pub(crate) follows_defaults: bool,
    /// For temporary queues: connections that served a call naming this queue as its `reply_to`,
    /// and so may offer their replies to it (at most `MAX_REPLIERS`, the latest kept).
    repliers: Mutex<Vec<ConnId>>,
    inner: Mutex<Inner>,
    /// Consumers waiting for messages, first come, first served.
    pub(crate) available: Waitlist,
    /// Offers waiting for room, first come, first served.
    pub(crate) room: Waitlist,
    /// Set once the queue is removed, before its waiters are woken: a waiter that joins the
    /// line after that wake-up sees it instead.
    removed: AtomicBool,
    waiters: AtomicU64,
    /// The earliest time `tick` may have work (a visibility deadline, an expiry); changed only
    /// under the lock. The server ticks every queue every few milliseconds: most return at once.
    due_ns: Due,
    /// A durable queue's logs (one per priority level; none in memory), to wait for the disk
    /// without the queue's lock: after every offer when the logs sync each one (durability
    /// `always`), else after an offer of a message that asks to be durable before its answer
    /// (`Message::durable`).
    logs: Vec<SharedLog>,
    /// The log syncs every offer, and its records are handed out only once synced.
    syncs_every_offer: bool,
    /// A durable queue's delayed log once it has one (also in its `Store`), to wait for the disk
    /// without the queue's lock.
    delayed_log: Arc<OnceLock<SharedLog>>,
    /// Hashes idempotency keys as the queue's dedup window does, without its lock (the window is
    /// made with the queue and never replaced, so the two stay alike).
    key_hasher: crate::dedup::KeyHasher,
}

/// Opens (creating it if need be) a durable queue's delayed log.
pub(crate) type OpenDelayedLog = Box<dyn Fn() -> Result<SharedLog, BrokerError> + Send + Sync>;

/// Counts a consumer waiting on a queue while it lives (the queue's `waiters` figure).
pub(crate) struct CountedWaiter<'a>(&'a AtomicU64);

impl Drop for CountedWaiter<'_> {
    fn drop(&mut self) {
        counting::subtract_shared(self.0, 1, "a queue's waiting consumers");
    }
}

struct Inner {
    store: Store,
    in_flight: OpenReads,
    /// Messages waiting to be taken (not in flight): one exact count for both stores, changed
    /// where a message enters or leaves the ready set (`offer`, `next`, `put_back`,
    /// `drop_oldest`) and checked against the store in debug builds.
    waiting: u64,
    /// Bytes of the messages waiting and in flight.
    bytes: u64,
    /// Bytes of the delayed messages (counted in `bytes`) of a queue in memory; 0 on disk, where
    /// due messages are released without being read.
    delayed_bytes: u64,
    /// Records of the levels' logs taken out for the dead-letter queue and not yet settled
    /// (`Leaving`), or to be dropped (`take_out`): neither waiting nor in flight, but not
    /// acknowledged.
    leaving_records: u64,
    /// `waiting` per priority level (one entry without levels).
    waiting_at: Vec<u64>,
    /// Takes from the highest level in a row while a lower level had messages: one in every
    /// `config::lower_level_period` goes to the lower levels instead.
    takes_from_top: u32,
    /// A message left the head since the lock was taken (see `Locked`).
    head_taken: bool,
    dedup: DedupWindow,
    /// The time the last offer was stamped with: each offer's is later than the one before, so
    /// that offers on different levels (and the keys they stored) are in one order by time.
    last_stamp: u64,
    /// Messages stored but not yet due (neither waiting nor in flight).
    delayed: u64,
    /// A durable queue's message left for good (or a remembered key was forgotten) since its
    /// logs last gave their disk back, or since it was opened: the tick gives back what its
    /// consumers emptied (`Inner::give_back`).
    give_back: bool,
    /// `give_back_due` is in the tick's plan (set when the lock lowers the queue's due time
    /// for it, cleared by the tick, which plans it itself).
    give_back_planned: bool,
    /// When the tick last deleted what the consumers of a queue with a backlog emptied.
    retention_at: u64,
    counters: QueueCounters,
}

/// What `Queue::offer_unsynced` did.
#[derive(Debug)]
pub(crate) struct Stored {
    /// The id the offer is answered with: its first stored message's, or the first original's
    /// for an offer of repeats only.
    pub first: u64,
    /// Messages stored; the offer's count for one of repeats only.
    pub count: u32,
    /// Messages not stored because their idempotency key repeats one (`Repeats`).
    pub repeats: u32,
    /// The last record the answer waits for, if the queue syncs each offer.
    pub last: Option<Unsynced>,
}

/// An offer's last record, not yet known to be on disk: `Queue::wait_durable` waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unsynced {
    /// A priority level's log, or (one past the highest level) the delayed log.
    level: usize,
    offset: u64,
    /// Other logs of the queue (a bit per level, as `level` numbers them) that hold originals
    /// of the offer's repeats: the answer waits for them to be on disk too, as it would have
    /// waited for the originals' offer.
    also: u16,
}

/// `f` of the record at `offset` of a level's log, one not acknowledged (so not yet taken by
/// retention).
fn with_record<T>(
    log: &SharedLog,
    offset: u64,
    f: impl FnOnce(&petrel_log::Record<'_>) -> T,
) -> Result<T, BrokerError> {
    let mut reader = log.reader();
    let record = reader.get(offset)?.filter(|r| r.offset == offset);
    Ok(f(&record.expect("an unacknowledged record is in the log")))
}

#[cfg(test)]
thread_local! {
    /// Tests: `delay_returned` stops once the copies are made, as a crash there would (what the
    /// queue holds in memory is then wrong: its broker is only to be dropped and opened again).
    pub(crate) static CRASH_AFTER_DELAYED_COPIES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Counts a delivery of the message at `offset` of `lane`: in memory, and in a return marker
/// after it in the lane's log (the error if that could not be written).
fn count_in_lane(lane: &mut Lane, offset: u64) -> Result<(), BrokerError> {
    *lane.returns.entry(offset).or_default() += 1;
    let marker = message::append_returned(&lane.log, offset);
    lane.markers_unread += u64::from(marker.is_ok());
    marker.map(|_| ()).map_err(BrokerError::from)
}

/// The deliveries of a level's record `r` handed out now or last, this one included: those
/// before it was delayed (its record's), and those since (its return markers, in `returns`).
fn lane_deliveries(returns: &NumberMap<u32>, r: &petrel_log::Record<'_>) -> u32 {
    message::placement(r).deliveries.saturating_add(deliveries_of(returns, r.offset))
}

/// The logs of a durable queue of `levels` levels that hold the messages `ids`, a bit each, as
/// `Unsynced` numbers them (the delayed log is bit `levels`).
fn logs_holding(ids: &[u64], levels: usize) -> u16 {
    let slots = ids.iter().filter_map(|&id| message::queue_position(id));
    let slots = slots.map(|(level, _)| if level == message::DELAYED_TAG { levels } else { level });
    slots.filter(|&slot| slot < 16).fold(0, |bits, slot| bits | 1 << slot)
}

enum Store {
    /// The messages waiting at each priority level, in offer order, and the delayed ones by
    /// when they are due (and id). A message's `deliveries` counts its deliveries so far, here
    /// as in flight, and its `priority` is its level.
    Memory { levels: Vec<HeldQueue>, next_id: u64, delayed: BTreeMap<(u64, u64), Held> },
    /// One log per priority level, and the delayed messages' log once one was delayed.
    Log { lanes: Vec<Lane>, delayed: Option<Box<DelayLog>>, open_delayed: OpenDelayedLog },
}

/// One priority level of a durable queue: a log of its own, read in order by the queue's group.
struct Lane {
    log: SharedLog,
    group: Box<ConsumerGroup>,
    /// Trails the oldest idempotency key the queue remembers from this log, so that retention
    /// keeps the records that hold the keys (`dedup.rs`). Only while it remembers one: a group
    /// that stood still would keep every segment.
    dedup: Option<Box<ConsumerGroup>>,
    /// How many deliveries of each waiting or in-flight record ended with the message coming
    /// back (only those that did); rebuilt on open from the log's return markers. A copy's
    /// deliveries from before its delay are in its record (`lane_deliveries`): an entry per copy
    /// would grow with a backlog of messages returned with a delay.
    returns: NumberMap<u32>,
    /// Return markers not yet read past by the group: unacknowledged records that are not
    /// messages.
    markers_unread: u64,
    /// Records at or past this offset are not handed out yet: an offer appended them and waits
    /// for the disk (durability `always`), so a consumer never gets a message that a crash
    /// could still take back. `u64::MAX` for a queue that does not wait.
    visible_end: u64,
}

impl Lane {
    /// Whether its next record may not go out now: as many out as its group lets out, and none
    /// waiting to be delivered again (those go out regardless).
    fn held_back(&self) -> bool {
        self.group.would_block() && self.group.redeliveries() == 0
    }

    /// The record at the head, if it may be handed out (markers read past first; one that could
    /// not be, its group at its limit of open reads, is no message to show).
    fn head(&mut self) -> Result<Option<petrel_log::Record<'_>>, BrokerError> {
        skip_markers(&mut self.group, &mut self.markers_unread)?;
        let visible_end = self.visible_end;
        Ok(self.group.peek()?.filter(|r| r.offset < visible_end && message::control(r).is_none()))
    }

    /// Whether `head` would find a message: without reading it when no marker is unread and no
    /// record waits to be delivered again, as the next record is then a message (a poll asks
    /// each level, each take).
    fn has_head(&mut self) -> Result<bool, BrokerError> {
        if self.markers_unread > 0 || self.group.redeliveries() > 0 {
            return Ok(self.head()?.is_some());
        }
        let found = self.group.head_offset()?.is_some_and(|offset| offset < self.visible_end);
        #[cfg(debug_assertions)]
        {
            let read = self.head()?.is_some();
            debug_assert_eq!(found, read, "the head found by its offset is the one read");
        }
        Ok(found)
    }
}

/// The messages taken tentatively, by handle, and how many of them are released delayed messages
/// of each level (bounded as a level's log bounds its own: `MAX_PENDING`).
#[derive(Default)]
struct OpenReads {
    by_handle: NumberMap<InFlight>,
    released: Vec<usize>,
    /// Their bytes, all together.
    bytes: u64,
}

impl OpenReads {
    fn insert(&mut self, handle: u64, read: InFlight) {
        if let Taken::Released { level, .. } = read.item {
            if self.released.len() <= level {
                self.released.resize(level + 1, 0);
            }
            self.released[level] += 1;
        }
        self.bytes += read.bytes;
        let before = self.by_handle.insert(handle, read);
        assert!(before.is_none(), "a handle is given once");
    }

    fn remove(&mut self, handle: &u64) -> Option<InFlight> {
        let read = self.by_handle.remove(handle)?;
        if let Taken::Released { level, .. } = read.item {
            self.released[level] -= 1;
        }
        counting::subtract(&mut self.bytes, read.bytes, "open reads' bytes");
        Some(read)
    }

    /// Released delayed messages of `level` out tentatively.
    fn released_at(&self, level: usize) -> usize {
        self.released.get(level).copied().unwrap_or(0)
    }
}

impl std::ops::Deref for OpenReads {
    type Target = NumberMap<InFlight>;

    fn deref(&self) -> &Self::Target {
        &self.by_handle
    }
}

struct InFlight {
    consumer: ConnId,
    taken_at_ns: u64,
    deadline_ns: u64,
    bytes: u64,
    item: Taken,
}

enum Taken {
    Memory(Box<Held>),
    Log {
        level: usize,
        offset: u64,
    },
    /// A delayed message released to `level`, handed out from the delayed log.
    Released {
        level: usize,
        ready: Ready,
    },
}

impl Taken {
    /// The taken message's id in the queue.
    fn message_id(&self) -> u64 {
        match self {
            Taken::Memory(m) => m.id,
            Taken::Log { level, offset } => message::queue_id(*level, *offset),
            Taken::Released { ready, .. } => message::queue_id(message::DELAYED_TAG, ready.offset),
        }
    }

    fn level(&self) -> usize {
        match self {
            Taken::Memory(m) => m.priority as usize,
            Taken::Log { level, .. } | Taken::Released { level, .. } => *level,
        }
    }

    /// Where the message was in the queue, as a key that sorts as its levels do: by level, then
    /// by id in memory; on disk by log offset, a released message just before the record at
    /// its `after` (and after those released before it).
    fn place(&self) -> (usize, u64, bool, u64) {
        match self {
            Taken::Memory(m) => (m.priority as usize, m.id, false, 0),
            Taken::Log { level, offset } => (*level, *offset, true, 0),
            Taken::Released { level, ready } => (*level, ready.after, false, ready.seq()),
        }
    }
}

/// The group that reads a durable queue's messages.
const GROUP: &str = "broker";
/// How long after a tick the disk failed a queue's next tick comes at the soonest: not every
/// millisecond, with an error each time.
pub const TICK_RETRY_NS: u64 = 100_000_000;
/// How long a drained durable queue is offered nothing before its logs give their disk back
/// (`Inner::give_back`): long enough that a queue its consumers keep up with, drained between
/// most offers, does not start a new segment each time.
const GIVE_BACK_IDLE_NS: u64 = 2_000_000_000;
/// How often, at most, the segments the consumers of a queue with a backlog emptied are looked
/// for and deleted (`Inner::give_back`).
const RETENTION_EVERY_NS: u64 = 1_000_000_000;
/// The group that trails the idempotency keys a durable queue remembers.
const DEDUP_GROUP: &str = "dedup";
/// Offsets one `moved` marker of a flush names at most (a marker is one record).
const MARKER_OFFSETS: usize = 8192;

impl Queue {
    /// A queue in memory, its bytes counted in `budget`, at most `default_max_bytes` of them
    /// unless its configuration says otherwise.
    pub(crate) fn in_memory(
        name: String,
        config: QueueConfig,
        owner: Option<ConnId>,
        budget: std::sync::Arc<MemoryBudget>,
        default_max_bytes: u64,
    ) -> Queue {
        let levels = (0..config::levels_of(&config)).map(|_| HeldQueue::default()).collect();
        let store = Store::Memory { levels, next_id: 1, delayed: BTreeMap::new() };
        let dedup = DedupWindow::new(config::levels_of(&config));
        let mut queue = Queue::with_store(name, config, owner, store, dedup, 0);
        queue.memory = Some((budget, default_max_bytes));
        queue
    }

    /// A durable queue on `logs`, one per priority level (`config::levels_of`), and its delayed
    /// log if it has one (`open_delayed` makes one when a first message is delayed). Records not
    /// yet acknowledged by its group are the queue's contents, including those taken tentatively
    /// before a restart (records acknowledged out of order before it stay acknowledged).
    pub(crate) fn on_log(
        name: String,
        config: QueueConfig,
        logs: Vec<SharedLog>,
        delayed_log: Option<SharedLog>,
        open_delayed: OpenDelayedLog,
    ) -> Result<Queue, BrokerError> {
        assert_eq!(logs.len(), config::levels_of(&config), "one log per priority level");
        // What recovery kept is durable (opening a log under `always` syncs it).
        let syncs_every_offer = logs[0].durability() == Durability::Always;
        let (max_keys, _) = config::dedup_window_of(&config);
        let mut lanes = Vec::with_capacity(logs.len());
        let (mut keys, mut bytes, mut waiting_at) = (Vec::new(), 0, Vec::with_capacity(logs.len()));
        let mut window = DedupWindow::new(logs.len() + 1);
        let mut last_stamp = 0;
        // Delayed-log offsets the levels' logs hold copies of.
        let mut moved = HashSet::new();
        for (level, log) in logs.iter().enumerate() {
            let options = GroupOptions { max_pending: MAX_PENDING, ..GroupOptions::default() };
            let group = log.group(GROUP, options)?;
            let has_dedup = log.groups().iter().any(|g| g.name == DEDUP_GROUP);
            let dedup = if has_dedup { Some(Box::new(log.group(DEDUP_GROUP, GroupOptions::default())?)) } else { None };
            // Count the bytes waiting (they are not in the log's indexes), read the return
            // markers back into delivery counts, and the idempotency keys back into the window
            // (from where the `dedup` group stands, which may be before the queue's group).
            let mut reader = log.reader();
            reader.seek(dedup.as_ref().map_or(group.committed(), |d| d.committed().min(group.committed())));
            let (mut returns, mut markers_unread) = (NumberMap::<u32>::default(), 0);
            let mut recent = crate::dedup::RecentKeys::new(max_keys);
            loop {
                let batch = reader.read_batch(4096)?;
                if batch.is_empty() {
                    break;
                }
                // Every marker counts, read past or not: one naming a message not yet
                // acknowledged follows it, so it is at or after the committed offset too.
                for r in batch.into_iter() {
                    let acknowledged = group.is_acknowledged(r.offset);
                    match message::control(&r) {
                        Some(message::Control::Returned(of)) => {
                            if !acknowledged {
                                markers_unread += 1;
                            }
                            if !group.is_acknowledged(of) {
                                *returns.entry(of).or_default() += 1;
                            }
                        }
                        Some(message::Control::Moved(_) | message::Control::Released { .. }) => {}
                        None => {
                            if let Some(key) = message::idempotency_key(&r) {
                                let key = window.hash(&String::from_utf8_lossy(key));
                                recent.push((r.timestamp, message::queue_id(level, r.offset), level, key));
                            }
                            let placement = message::placement(&r);
                            moved.extend(placement.moved_from);
                            if !acknowledged {
                                bytes += message::record_size(&r);
                            }
                        }
                    }
                }
            }
            keys.extend(recent.into_vec());
            waiting_at.push(group.unacknowledged() - markers_unread);
            if let Some(last) = log.next_offset().checked_sub(1) {
                // (A record retention took reads as nothing: no offer to order after.)
                reader.seek(last);
                let batch = reader.read_batch(1)?;
                last_stamp = batch.into_iter().map(|r| r.timestamp).fold(last_stamp, u64::max);
            }
            let visible_end = if syncs_every_offer { log.next_offset() } else { u64::MAX };
            let group = Box::new(group);
            lanes.push(Lane { log: log.clone(), group, dedup, returns, markers_unread, visible_end });
        }
        let delayed_slot = lanes.len();
        let (mut delayed, mut delayed_count) = (None, 0);
        let delayed_log_handle = Arc::new(OnceLock::new());
        if let Some(log) = delayed_log {
            // A returned message's copy counts only if its original was acknowledged, or is gone
            // (past its log's end: lost with a tail a power loss took, the copy synced before).
            let original_waits = |id: u64| {
                message::queue_position(id).is_some_and(|(level, offset)| {
                    lanes.get(level).is_some_and(|l| offset < l.log.next_offset() && !l.group.is_acknowledged(offset))
                })
            };
            let (delay, reopened) =
                DelayLog::open(log.clone(), delay::MAX_TIMERS, lanes.len(), &moved, original_waits, max_keys)?;
            for (waiting, released) in waiting_at.iter_mut().zip(&reopened.released_at) {
                *waiting += released;
            }
            for (at, offset, key) in reopened.keys.into_vec() {
                keys.push((at, message::queue_id(message::DELAYED_TAG, offset), delayed_slot, window.hash(&key)));
            }
            bytes += reopened.bytes;
            delayed_count = reopened.pending;
            tracing::debug!(queue = %name, pending = reopened.pending, runs_held_at_most = reopened.runs_held_at_most, "delayed log opened");
            last_stamp = last_stamp.max(reopened.last_stamp);
            let _ = delayed_log_handle.set(log);
            delayed = Some(Box::new(delay));
        }
        // The keys in the order they were stored (by time; across levels at one time, by id);
        // those beyond the count forgotten now, those past their time by the first tick.
        keys.sort_by_key(|(at, id, ..)| (*at, *id));
        for &(at, id, level, key) in &keys {
            window.restore(key, id, level, at, max_keys);
        }
        // Keys come back from every record not yet consumed, also from before a log's `dedup`
        // group (a key forgotten before a larger window was configured, or a group whose
        // cursor a power loss took): each group goes back to the oldest key taken back from its
        // log, so that retention keeps that record and the next start finds the key again
        // however far the queue is consumed meanwhile.
        for (level, lane) in lanes.iter_mut().enumerate() {
            let Some((_, oldest)) = window.oldest_id_at(level).and_then(message::queue_position) else { continue };
            match &mut lane.dedup {
                Some(group) if group.committed() > oldest => {
                    group.seek(petrel_log::SeekTo::Offset(oldest))?;
                }
                Some(_) => {}
                None => {
                    let options = GroupOptions { start: petrel_log::SeekTo::Offset(oldest), ..GroupOptions::default() };
                    lane.dedup = Some(Box::new(lane.log.group(DEDUP_GROUP, options)?));
                }
            }
        }
        let made = Arc::clone(&delayed_log_handle);
        let open_delayed: OpenDelayedLog = Box::new(move || {
            let log = open_delayed()?;
            let _ = made.set(log.clone()); // for `wait_durable`, without the queue's lock
            Ok(log)
        });
        let store = Store::Log { lanes, delayed, open_delayed };
        let mut queue = Queue::with_store(name, config, None, store, window, bytes);
        queue.logs = logs;
        queue.syncs_every_offer = syncs_every_offer;
        queue.delayed_log = delayed_log_handle;
        let inner = queue.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        inner.waiting = waiting_at.iter().sum();
        inner.waiting_at = waiting_at;
        inner.last_stamp = last_stamp;
        inner.delayed = delayed_count;
        // A queue drained before a restart gives back what its logs kept.
        inner.give_back = true;
        inner.move_dedup_cursors()?;
        // What it holds may expire: the first tick looks, and sets when to look again.
        queue.due_ns.set(0);
        Ok(queue)
    }

    fn with_store(
        name: String,
        config: QueueConfig,
        owner: Option<ConnId>,
        store: Store,
        dedup: DedupWindow,
        bytes: u64,
    ) -> Queue {
        let levels = config::levels_of(&config);
        let key_hasher = dedup.hasher().clone();
        Queue {
            name,
            config: RwLock::new(Arc::new(config)),
            memory: None,
            owner,
            follows_defaults: false,
            repliers: Mutex::new(Vec::new()),
            inner: Mutex::new(Inner {
                store,
                in_flight: OpenReads::default(),
                waiting: 0,
                bytes,
                delayed_bytes: 0,
                leaving_records: 0,
                waiting_at: vec![0; levels],
                takes_from_top: 0,
                head_taken: false,
                dedup,
                last_stamp: 0,
                delayed: 0,
                give_back: false,
                give_back_planned: false,
                retention_at: 0,
                counters: QueueCounters::default(),
            }),
            available: Waitlist::default(),
            room: Waitlist::for_room(),
            removed: AtomicBool::new(false),
            waiters: AtomicU64::new(0),
            due_ns: Due {
                at: AtomicU64::new(u64::MAX),
                not_before: AtomicU64::new(0),
                alarm: Arc::new(TickAlarm::default()),
            },
            logs: Vec::new(),
            syncs_every_offer: false,
            delayed_log: Arc::new(OnceLock::new()),
            key_hasher,
        }
    }

    /// Whether the queue was made by first use, and so takes the server's configuration for
    /// its name at each start and reload (not its own, as a queue created explicitly has).
    pub fn follows_defaults(&self) -> bool {
        self.follows_defaults
    }

    /// The configuration in force (a reload may replace it between two calls).
    pub fn config(&self) -> Arc<QueueConfig> {
        Arc::clone(&self.config.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Puts `config` in force for what comes next: offers check the new limits and take the
    /// new `ttl_ms`, expiries go to the new dead-letter queue. Messages already in the queue
    /// stay, even above a lowered limit (offers are refused until it is under it again; a
    /// circular queue drops its oldest at its next offer), and keep the expiry they were given.
    /// Only a configuration of the same kind (`config::changes_live`) may replace it.
    pub(crate) fn reconfigure(&self, new: QueueConfig) {
        assert!(config::changes_live(&self.config(), &new), "a queue's kind never changes while it lives");
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new);
        // A raised limit may let waiting offers in.
        self.room.wake_all();
    }

    /// Lets `conn` offer replies to this temporary queue.
    pub(crate) fn grant_replier(&self, conn: ConnId) {
        let mut repliers = self.repliers.lock().unwrap_or_else(|e| e.into_inner());
        if !repliers.contains(&conn) {
            if repliers.len() == MAX_REPLIERS {
                repliers.remove(0);
            }
            repliers.push(conn);
        }
    }

    pub(crate) fn is_replier(&self, conn: ConnId) -> bool {
        self.repliers.lock().unwrap_or_else(|e| e.into_inner()).contains(&conn)
    }

    /// Marks the queue removed and wakes everyone waiting on it.
    pub(crate) fn mark_removed(&self) {
        {
            // Under the queue's lock: a tick working on the queue's files (`Inner::give_back`)
            // ends before the queue's directory is renamed away and a new queue of its name may
            // be made, and a later one sees the mark.
            let _inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            self.removed.store(true, Ordering::SeqCst);
        }
        self.available.wake_all();
        self.room.wake_all();
    }

    /// Whether the queue was removed (a waiter then looks its name up again).
    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::SeqCst)
    }

    /// Marks a consumer as waiting until the guard is dropped.
    pub(crate) fn waiting(&self) -> CountedWaiter<'_> {
        self.waiters.fetch_add(1, Ordering::Relaxed);
        CountedWaiter(&self.waiters)
    }

    /// Whether the queue keeps its messages in logs (a durable queue).
    pub fn on_disk(&self) -> bool {
        !self.logs.is_empty()
    }

    /// Bytes of a durable queue's log files (0 in memory).
    pub fn log_bytes(&self) -> u64 {
        self.log_stats().map_or(0, |s| s.segment_bytes)
    }

    /// A durable queue's log figures (segments, their bytes, syncs, rolls, retention passes),
    /// summed over its priority levels' logs (offsets: the first level's); `None` in memory.
    pub fn log_stats(&self) -> Option<petrel_log::LogStats> {
        let (first, rest) = self.logs.split_first()?;
        let mut total = first.stats();
        for log in rest {
            let s = log.stats();
            total.segments += s.segments;
            total.segment_bytes += s.segment_bytes;
            total.syncs += s.syncs;
            total.rolls += s.rolls;
            total.retention_removals += s.retention_removals;
        }
        Some(total)
    }

    /// In memory: the bytes this queue may hold at most (its `max_bytes`, else the server's
    /// default for memory queues; 0: no cap of its own, only the server's budget). `None` for a
    /// durable queue, whose messages are in its log's mapped segments.
    pub fn memory_cap(&self) -> Option<u64> {
        let (_, default) = self.memory.as_ref()?;
        let max_bytes = self.config().max_bytes;
        Some(if max_bytes != 0 { max_bytes } else { *default })
    }

    pub(crate) fn count_dropped(&self, n: u64) {
        self.lock().counters.dropped += n;
    }

    /// Counts messages of this queue that its dead-letter queue did not take (`dead_letters_lost`).
    pub(crate) fn count_dead_letters_lost(&self, n: u64) {
        self.lock().counters.dead_letters_lost += n;
    }

    fn lock(&self) -> Locked<'_> {
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let budget = self.memory.as_ref().map(|(budget, _)| &**budget);
        let bytes_before = if budget.is_some() { guard.held_bytes() } else { 0 };
        Locked { guard, budget, bytes_before, due_ns: &self.due_ns }
    }

    /// Adds `messages` at the tail, all or none: on success `messages` is emptied, on refusal it
    /// is left as it was (for a retry), but for repeats (below). Returns the first id and how
    /// many; dropped oldest messages of a circular queue are counted. An offer larger than a
    /// bounded queue can ever hold is `NeverFits`; a circular queue keeps its newest messages
    /// instead (the oldest of the offer are dropped too, counted, and are gone even if the rest
    /// is then refused).
    ///
    /// A message whose idempotency key the queue remembers is a repeat, and is not stored again
    /// (nor one whose key an earlier message of the same offer carries). An offer of repeats
    /// only is answered with the originals: the first one's id and the offer's count (a batch
    /// offered again gets the answer it got the first time). An offer mixing repeats and new
    /// messages stores the new ones and answers for them; if it is refused, `messages` is left
    /// whole, so that a retry is answered (and counted) for its repeats as the first try would be.
    pub fn offer(&self, messages: &mut Vec<Message>, now_ns: u64) -> Result<(u64, u32), BrokerError> {
        let stored = self.offer_unsynced(messages, None, now_ns, false)?;
        if let Some(last) = stored.last {
            self.wait_durable(last)?;
        }
        Ok((stored.first, stored.count))
    }

    /// `offer` without waiting for the disk. The messages are stored and counted at once, but
    /// when the log syncs every offer (durability `always`) they are handed to consumers only
    /// once `wait_durable` of the returned record has returned, and the offer may be answered
    /// only then. Appending under the queue's lock and waiting after it lets the offers of many
    /// producers share one sync.
    ///
    /// `mirror`, if given, holds copies of `messages` (a fanout's): it is left with the copies
    /// of those the queue stores, without those of repeats or of what a circular queue drops.
    ///
    /// `moved`: messages the server moves itself (dead letters), which the queue's
    /// `max_item_bytes` does not refuse: each was accepted once, and the headers the move adds
    /// must not make it lost.
    pub(crate) fn offer_unsynced(
        &self,
        messages: &mut Vec<Message>,
        mut mirror: Option<&mut Vec<Message>>,
        now_ns: u64,
        moved: bool,
    ) -> Result<Stored, BrokerError> {
        debug_assert!(mirror.as_ref().is_none_or(|m| m.len() == messages.len()));
        let config = self.config();
        let durable_asked = messages.iter().any(|m| m.durable);
        if durable_asked && !self.on_disk() {
            return Err(BrokerError::BadRequest(format!(
                "queue {:?} keeps its messages in memory: a message marked durable needs a durable queue",
                crate::shown(&self.name)
            )));
        }
        for m in messages.iter_mut() {
            // The queue's name is set on delivery; not stored with each message, nor counted
            // in its size (what is added to the queue's bytes is what its removal takes back).
            m.destination.clear();
        }
        let longest_text = messages.iter().map(crate::held::longest_text).max().unwrap_or(0);
        if longest_text > usize::from(u16::MAX) {
            return Err(BrokerError::BadRequest(format!(
                "a text field or header name of {longest_text} bytes: at most {}",
                u16::MAX
            )));
        }
        if let Some(m) = messages.iter().find(|m| m.idempotency_key.len() > config::MAX_IDEMPOTENCY_KEY_BYTES) {
            return Err(BrokerError::BadRequest(format!(
                "an idempotency key of {} bytes: at most {}",
                m.idempotency_key.len(),
                config::MAX_IDEMPOTENCY_KEY_BYTES
            )));
        }
        let levels = config::levels_of(&config);
        // The priority level the offer goes to: one per offer, so that its ids are consecutive.
        let level = match messages.first() {
            Some(m) if levels > 1 => {
                if messages.iter().any(|other| other.priority != m.priority) {
                    return Err(BrokerError::BadRequest(format!(
                        "queue {:?} has priority levels: the messages of one offer share one priority",
                        crate::shown(&self.name)
                    )));
                }
                (m.priority as usize).min(levels - 1)
            }
            _ => 0,
        };
        // Either all of an offer's messages are due now, or all later: its ids are consecutive,
        // among the waiting messages' or the delayed ones'.
        let mut delayed = None;
        for m in messages.iter() {
            let ahead = config::due_at(m, now_ns).saturating_sub(now_ns);
            if ahead > config::MAX_DELAY_NS {
                return Err(BrokerError::BadRequest(format!(
                    "a message delayed by more than {} days: deliver_at is in ns since the epoch, delay_ms in ms",
                    config::MAX_DELAY_NS / (24 * 3600 * 1_000_000_000)
                )));
            }
            if *delayed.get_or_insert(ahead > 0) != (ahead > 0) {
                return Err(BrokerError::BadRequest(
                    "the messages of one offer are all delayed (deliver_at, delay_ms) or none is".into(),
                ));
            }
        }
        let delayed = delayed.unwrap_or(false);
        let max_item = if moved { 0 } else { config.max_item_bytes };
        if let Some(m) = messages.iter().find(|m| max_item != 0 && m.size() > max_item) {
            return Err(BrokerError::TooLarge { size: m.size() as usize, max: max_item as usize });
        }
        let max_items = config.max_items;
        let max_bytes = match (&self.memory, config.max_bytes) {
            (Some((_, default)), 0) => *default,
            (_, configured) => configured,
        };
        let over = |n: u64, size: u64| (max_items != 0 && n > max_items) || (max_bytes != 0 && size > max_bytes);
        let mut size: u64 = messages.iter().map(Message::size).sum();
        if over(messages.len() as u64, size) {
            if !config.circular {
                // Waiting would not help: say so now, rather than QUEUE_FULL after a timeout.
                return Err(BrokerError::NeverFits(format!(
                    "an offer of {} messages ({size} bytes) can never fit queue {:?} (max_items {max_items}, max_bytes {max_bytes}): offer fewer at a time",
                    messages.len(),
                    crate::shown(&self.name)
                )));
            }
            // A circular queue keeps the newest: the oldest of the offer itself go first.
            let mut skip = 0;
            while skip < messages.len() && over((messages.len() - skip) as u64, size) {
                size -= messages[skip].size();
                skip += 1;
            }
            messages.drain(..skip);
            if let Some(mirror) = mirror.as_mut() {
                mirror.drain(..skip);
            }
            self.lock().counters.dropped += skip as u64;
        }
        // Each key hashed once, before the lock: the hash finds repeats and is what is remembered.
        let keyed = messages.iter().any(|m| !m.idempotency_key.is_empty());
        let mut hashes: Vec<Option<crate::dedup::KeyHash>> = match keyed {
            true => messages
                .iter()
                .map(|m| (!m.idempotency_key.is_empty()).then(|| self.key_hasher.hash(&m.idempotency_key)))
                .collect(),
            false => Vec::new(),
        };
        let (max_keys, window_ns) = config::dedup_window_of(&config);
        let mut inner = self.lock();
        // Logs holding originals of repeats among new messages: the answer waits for them too.
        let (mut repeated_in, mut repeats, mut repeated) = (0, 0, None);
        if keyed {
            inner.dedup.touch(&hashes, max_keys);
            inner.dedup.evict(max_keys, window_ns, now_ns);
            match inner.repeats(&hashes) {
                Repeats::None => {}
                Repeats::All(originals) => {
                    let n = messages.len() as u32;
                    inner.counters.deduplicated += u64::from(n);
                    messages.clear();
                    if let Some(mirror) = mirror.as_mut() {
                        mirror.clear();
                    }
                    drop(inner);
                    // Answered only once the originals are as durable as a new offer would be.
                    let last = *originals.iter().max().expect("an offer of repeats has some");
                    let unsynced = (self.syncs_every_offer || durable_asked)
                        .then(|| message::queue_position(last))
                        .flatten()
                        .filter(|_| self.on_disk())
                        .map(|(level, offset)| {
                            let level = if level == message::DELAYED_TAG { levels } else { level };
                            Unsynced { level, offset, also: logs_holding(&originals, levels) & !(1 << level) }
                        });
                    return Ok(Stored { first: originals[0], count: n, repeats: n, last: unsynced });
                }
                Repeats::Some(flags, originals) => {
                    repeated_in = logs_holding(&originals, levels);
                    repeats = flags.iter().filter(|r| **r).count() as u32;
                    size = messages.iter().zip(&flags).filter(|(_, r)| !**r).map(|(m, _)| m.size()).sum();
                    repeated = Some(flags);
                }
            }
        }
        // The messages stored, without the repeats: these are taken out of the offer only once
        // it fits, so that an offer refused as full (and retried, waiting for room) is retried
        // whole, and answered and counted for its repeats once.
        let n = messages.len() as u64 - u64::from(repeats);
        // What an in-memory queue would hold past the server's budget is refused; looked at once
        // the repeats are known (a retry made of repeats stores nothing, and is answered).
        if let Some((budget, _)) = &self.memory
            && !budget.fits(size + n * if delayed { DELAYED_OVERHEAD } else { HELD_OVERHEAD })
        {
            return Err(BrokerError::Limit(format!(
                "the server holds {} bytes in memory queues, its budget (max_memory_bytes {}): take messages, or use durable queues",
                budget.used(),
                budget.max()
            )));
        }
        // (`freed`: bytes of messages taken out to be dropped, still counted in `bytes`.)
        let fits = |inner: &Inner, freed: u64| {
            (max_items == 0 || inner.items() + inner.delayed + n <= max_items)
                && (max_bytes == 0 || inner.bytes.saturating_sub(freed) + size <= max_bytes)
        };
        if !fits(&inner, 0) {
            // A circular queue drops waiting messages to make room, and only when that makes
            // it: what is delayed or out with consumers stays, and an offer that would not fit
            // beside it is refused with nothing dropped.
            let fits_beside_the_rest = |inner: &Inner| {
                (max_items == 0 || inner.delayed + n <= max_items)
                    && (max_bytes == 0 || inner.in_flight_bytes() + inner.delayed_bytes + size <= max_bytes)
            };
            if !config.circular || !fits_beside_the_rest(&inner) {
                return Err(BrokerError::Full(self.name.clone()));
            }
            // The oldest are taken out until the offer fits, and dropped only then; if it never
            // does, all go back and nothing is dropped. Where the offer is known to fit once
            // enough go, those taken are dropped as their level's log stops letting more out
            // (one offer may need more than that). It is not known for a durable queue with
            // delayed messages and `max_bytes` (it releases due ones without reading them, so
            // its delayed bytes are not known apart), nor beside levels whose consumers' open
            // reads may stop their logs letting records out (`held_back`: their waiting
            // messages may not go) unless the offer fits beside those by count.
            let (held_back, held_back_levels) = inner.waiting_held_back();
            let known = (max_bytes == 0 || inner.delayed == 0 || !self.on_disk())
                && (held_back == 0 || (max_bytes == 0 && inner.delayed + held_back + n <= max_items));
            let (mut out, mut freed, mut own, mut passed_over) = (Vec::new(), 0, None, false);
            let refused = loop {
                if fits(&inner, freed) {
                    break None;
                }
                match inner.take_oldest(own, held_back_levels, &mut passed_over) {
                    Ok(Some((taken, size, level))) => {
                        freed += size;
                        // (A released message takes none of its level's log's open reads.)
                        if matches!(taken, Taken::Log { .. }) {
                            own = Some(level);
                        }
                        out.push((taken, size));
                    }
                    Ok(None) if known && !passed_over && !out.is_empty() => {
                        inner.drop_for_room(out.drain(..))?;
                        (freed, own) = (0, None);
                    }
                    Ok(None) => break Some(BrokerError::Full(self.name.clone())),
                    Err(e) => break Some(e),
                }
            };
            if let Some(e) = refused {
                // Newest first, so that each is its log's last read (`ConsumerGroup::unpoll`).
                inner.put_back_taken(out.into_iter().rev());
                return Err(e);
            }
            inner.drop_for_room(out)?;
        }
        if let Some(repeated) = repeated {
            inner.counters.deduplicated += u64::from(repeats);
            let mut it = repeated.iter();
            messages.retain(|_| !*it.next().expect("one flag per message"));
            let mut it = repeated.iter();
            hashes.retain(|_| !*it.next().expect("one flag per message"));
            if let Some(mirror) = mirror.as_mut() {
                let mut it = repeated.iter();
                mirror.retain(|_| !*it.next().expect("one flag per message"));
            }
        }
        let ttl_deadline = match config.ttl_ms {
            0 => u64::MAX,
            ttl => now_ns.saturating_add(ttl.saturating_mul(1_000_000)),
        };
        let stamp = now_ns.max(inner.last_stamp + 1);
        inner.last_stamp = stamp;
        let due_floor = match &inner.store {
            _ if !delayed => None,
            Store::Memory { delayed, .. } => delayed.last_key_value().map(|((due, _), _)| *due),
            Store::Log { delayed, .. } => delayed.as_ref().and_then(|delay| delay.latest_due()),
        };
        for m in messages.iter_mut() {
            m.timestamp = stamp;
            // The earlier of the message's own expiry and the queue's.
            if ttl_deadline != u64::MAX && (m.expires_at == 0 || m.expires_at > ttl_deadline) {
                m.expires_at = ttl_deadline;
            }
            m.priority = level as u8;
            m.deliver_at = match config::due_at(m, now_ns) {
                _ if !delayed => 0,
                // Counted from the offer (its clock read before the lock): due in offer order.
                due if m.delay_ms != 0 && due > m.deliver_at => delay::raised_due(due, due_floor),
                due => due,
            };
            m.delay_ms = 0;
        }
        let earliest_due = messages.iter().map(|m| m.deliver_at).min().filter(|_| delayed);
        let earliest_expiry = messages.iter().map(|m| m.expires_at).filter(|&e| e != 0).min();
        let delayed_slot = levels;
        if delayed && self.on_disk() {
            inner.delay_log()?;
        }
        let (first, last) = match (&mut inner.store, delayed) {
            (Store::Memory { levels, next_id, delayed: later }, delayed) => {
                let first = *next_id;
                for (i, mut m) in messages.drain(..).enumerate() {
                    m.id = first + i as u64;
                    m.deliveries = 0; // counted by this queue from now on
                    // A protocol's message may be a slice of a whole read buffer: a copy of its
                    // own keeps a small waiting message from holding the buffer in memory (its
                    // headers' values are copied into its `Held` with its other fields).
                    m.payload = bytes::Bytes::copy_from_slice(&m.payload);
                    match delayed {
                        true => drop(later.insert((m.deliver_at, m.id), Held::new(m))),
                        false => levels[level].push_back(Held::new(m)),
                    }
                }
                *next_id += n;
                (first, None)
            }
            (Store::Log { delayed: None, .. }, true) => unreachable!("made above"),
            (Store::Log { delayed: Some(delay), .. }, true) => {
                let placements = vec![Placement { priority: level as u8, ..Placement::default() }; messages.len()];
                let range = delay.append(messages, &placements)?;
                messages.clear();
                let also = repeated_in & !(1 << delayed_slot);
                let last = range.end.checked_sub(1).map(|offset| Unsynced { level: delayed_slot, offset, also });
                (message::queue_id(message::DELAYED_TAG, range.start), last)
            }
            (Store::Log { lanes, .. }, false) => {
                let lane = &mut lanes[level];
                if hashes.iter().any(Option::is_some) && lane.dedup.is_none() {
                    // The first key this log holds (since it last held none): keep it on disk.
                    // Made before the append (which starts at the log's end: its appends are
                    // made under this lock), so that a failure here stores nothing. After the
                    // append it would leave records stored whose keys are not remembered, and
                    // the producer's retry would store them again.
                    let start = petrel_log::SeekTo::Offset(lane.log.next_offset());
                    let options = GroupOptions { start, ..GroupOptions::default() };
                    lane.dedup = Some(Box::new(lane.log.group(DEDUP_GROUP, options)?));
                }
                let range = message::append_unsynced(&lane.log, messages)?;
                messages.clear();
                let also = repeated_in & !(1 << level);
                let last = range.end.checked_sub(1).map(|offset| Unsynced { level, offset, also });
                (message::queue_id(level, range.start), last)
            }
        };
        // A durable queue's delayed messages keep their keys in the delayed log (the slot after
        // the levels').
        let slot = if delayed && self.on_disk() { delayed_slot } else { level };
        if keyed {
            inner.dedup.make_room(max_keys, hashes.iter().flatten().count());
        }
        for (i, key) in hashes.iter().enumerate() {
            if let Some(key) = *key {
                inner.dedup.remember(key, first + i as u64, slot, stamp);
            }
        }
        if let Some(expiry) = inner.dedup_expiry(&config) {
            self.due_ns.lower(expiry);
        }
        if let Some(due) = earliest_due {
            inner.delayed += n;
            if !self.on_disk() {
                inner.delayed_bytes += size;
            }
            self.due_ns.lower(due);
        } else {
            inner.waiting += n;
            inner.waiting_at[level] += n;
        }
        inner.bytes += size;
        inner.counters.total_offered += n;
        if let Some(earliest) = earliest_expiry {
            self.due_ns.lower(earliest);
        }
        drop(inner);
        let unsynced = if self.syncs_every_offer || durable_asked { last } else { None };
        if !self.syncs_every_offer && !delayed {
            self.available.wake_one();
        }
        Ok(Stored { first, count: n as u32, repeats, last: unsynced })
    }

    /// Returns once the log's record `last` (an `offer_unsynced`'s) is on disk, and hands it
    /// and every record before it in its log to consumers. Blocks on the disk: not for an async
    /// runtime's own threads.
    pub(crate) fn wait_durable(&self, last: Unsynced) -> Result<(), BrokerError> {
        for level in (0..=self.logs.len()).filter(|l| last.also & 1 << l != 0) {
            // Originals of repeats, in another log: on disk up to its end now, which holds them.
            let log = if level == self.logs.len() { self.delayed_log.get() } else { self.logs.get(level) };
            if let Some(log) = log
                && let Some(end) = log.next_offset().checked_sub(1)
            {
                log.make_durable(end)?;
            }
        }
        if last.level == self.logs.len() {
            // Delayed messages: nothing to hand out until they are due (and moved, synced).
            let Some(log) = self.delayed_log.get() else { return Ok(()) };
            return Ok(log.make_durable(last.offset)?);
        }
        let Some(log) = self.logs.get(last.level) else { return Ok(()) };
        if !self.syncs_every_offer {
            // A message that asked to be durable; consumers have it already (the policy allows).
            return Ok(log.make_durable(last.offset)?);
        }
        log.wait_durable(last.offset)?;
        let mut inner = self.lock();
        if let Store::Log { lanes, .. } = &mut inner.store {
            // Syncs cover a prefix of the log: everything up to `offset` is durable now.
            let lane = &mut lanes[last.level];
            lane.visible_end = lane.visible_end.max(last.offset + 1);
        }
        // The head may have just become visible: let the tick learn when it expires (a tick in
        // between saw no head and may have set no time to look).
        inner.head_taken = true;
        drop(inner);
        self.available.wake_one();
        Ok(())
    }

    /// Takes up to `max` messages from the head, as many as fit `max_bytes` of answer (at least
    /// one); with a visibility timeout they are taken tentatively under handles from
    /// `next_handle`.
    pub fn poll(
        &self,
        max: usize,
        max_bytes: u64,
        visibility: Option<Duration>,
        consumer: ConnId,
        now_ns: u64,
        next_handle: &mut dyn FnMut() -> u64,
    ) -> Result<Polled, BrokerError> {
        let mut out = Polled::default();
        let config = self.config();
        let period = config::lower_level_period(&config);
        let dead_letter = !config.dead_letter.is_empty();
        let mut guard = self.lock();
        let inner = &mut *guard;
        let mut answer_bytes = 0u64;
        let taking = (|| -> Result<(), BrokerError> {
            while out.deliveries.len() < max {
                let Some((message, taken)) = inner.next(period)? else { break };
                let size = message.size();
                if message.is_expired(now_ns) {
                    counting::subtract(&mut inner.bytes, size, "a queue's bytes");
                    inner.counters.expired += 1;
                    inner.leave(&mut out.expired, message, taken, dead_letter)?;
                    continue;
                }
                // What the message adds to an answer: its bytes, its fields, its handle.
                let cost = message::answer_len_bound(&message) + self.name.len() as u64;
                if !out.deliveries.is_empty() && answer_bytes + cost > max_bytes {
                    inner.put_back(taken, false)?; // the head it was, not delivered; the next poll takes it
                    break;
                }
                answer_bytes += cost;
                inner.counters.last_taken_offered_at = message.timestamp;
                // A settle that fails has still taken the message in memory (as an
                // acknowledgement's): it is handed out all the same, and the poll ends there.
                let mut settled = Ok(());
                let handle = match visibility {
                    Some(v) => {
                        let handle = next_handle();
                        let deadline_ns = now_ns.saturating_add(u64::try_from(v.as_nanos()).unwrap_or(u64::MAX));
                        inner.counters.opened += 1;
                        let read = InFlight { consumer, taken_at_ns: now_ns, deadline_ns, bytes: size, item: taken };
                        inner.in_flight.insert(handle, read);
                        self.due_ns.lower(deadline_ns);
                        handle
                    }
                    None => {
                        settled = inner.settle(&taken);
                        counting::subtract(&mut inner.bytes, size, "a queue's bytes");
                        0
                    }
                };
                inner.counters.total_polled += 1;
                let message = Message { destination: self.name.clone(), ..message };
                out.deliveries.push(Delivery { handle, message });
                settled?;
            }
            Ok(())
        })();
        if let Err(e) = taking {
            if out.deliveries.is_empty() && out.expired.is_empty() {
                return Err(e);
            }
            // Messages taken already go on: to their consumer (taken for good, they would be
            // lost with the error; taken tentatively, out of reach until their timeout), and
            // expired ones to the dead-letter queue (dropped with the error, they were counted
            // nowhere). The error is logged, and the next poll meets it again if it lasts.
            tracing::error!(queue = %self.name, error = %e, "a poll stopped early: the messages it took are handed on");
        }
        drop(guard);
        if !out.deliveries.is_empty() || !out.expired.is_empty() {
            self.room.wake_one();
        }
        Ok(out)
    }

    /// Acknowledges tentative deliveries of `consumer`; returns how many were known.
    pub fn ack(&self, handles: &[u64], consumer: ConnId) -> Result<u32, BrokerError> {
        let mut inner = self.lock();
        // A level held back at its limit of records out has a head whose expiry was not
        // planned (`head_expiry`): planned once it may be taken again.
        inner.head_taken |= inner.any_level_held_back();
        let (mut n, mut failed) = (0, None);
        for h in handles {
            if inner.in_flight.get(h).is_some_and(|f| f.consumer == consumer) {
                let f = inner.in_flight.remove(h).expect("just seen");
                // A settle that fails has still acknowledged in memory (the log's group
                // writes its cursor, then syncs it): acknowledged, with the error reported.
                if let Err(e) = inner.settle(&f.item) {
                    failed.get_or_insert(e);
                }
                counting::subtract(&mut inner.bytes, f.bytes, "a queue's bytes");
                inner.counters.acked += 1;
                n += 1;
            }
        }
        // Messages wait that a level's log may have held back while too many were out
        // unacknowledged (`ConsumerGroup::poll`): pollers look again.
        let waiting = inner.waiting > 0;
        drop(inner);
        self.room.wake_one();
        if n > 0 && waiting {
            self.available.wake_one();
        }
        failed.map_or(Ok(n), Err)
    }

    /// Puts tentative deliveries of `consumer` back at the head of the queue, or, with a delay
    /// (`delay_ms`, else the queue's redelivery delay), among the delayed messages (those at the
    /// delivery limit go to the dead-letter queue: `Broker::abort`).
    pub(crate) fn abort(
        &self,
        handles: &[u64],
        consumer: ConnId,
        delay_ms: u32,
        now_ns: u64,
    ) -> Result<Returned, BrokerError> {
        self.put_back_reads(handles, Some(consumer), Some(delay_ms), now_ns)
    }

    /// Puts tentative deliveries of `consumer` back at the head as if they were never handed
    /// out: their consumer never saw them (a client library's poll cancelled while its answer
    /// was on the way). Their delivery is not counted, so neither a redelivery delay nor the
    /// delivery limit applies.
    pub(crate) fn give_back_unseen(&self, handles: &[u64], consumer: ConnId) -> Result<u32, BrokerError> {
        Ok(self.put_back_reads(handles, Some(consumer), None, 0)?.count)
    }

    /// The open reads, oldest first: `limit` of them, and how many there are.
    pub fn open_reads(&self, limit: usize) -> (u64, Vec<OpenRead>) {
        let inner = self.lock();
        let total = inner.in_flight.len() as u64;
        // The `limit` oldest, kept as they pass (the newest of them on top): a look at a few of a
        // million open reads copies and sorts a few, not the million, under the queue's lock.
        let mut oldest: std::collections::BinaryHeap<(u64, u64)> =
            std::collections::BinaryHeap::with_capacity(limit.min(inner.in_flight.len()) + 1);
        for (&handle, f) in inner.in_flight.iter() {
            let read = (f.taken_at_ns, handle);
            if oldest.len() < limit {
                oldest.push(read);
            } else if oldest.peek().is_some_and(|&newest| read < newest) {
                oldest.pop();
                oldest.push(read);
            }
        }
        let reads = oldest
            .into_sorted_vec()
            .into_iter()
            .filter_map(|(_, handle)| {
                let f = inner.in_flight.get(&handle)?;
                Some(OpenRead {
                    handle,
                    message_id: f.item.message_id(),
                    consumer: f.consumer,
                    taken_at_ns: f.taken_at_ns,
                    deadline_ns: f.deadline_ns,
                    bytes: f.bytes,
                })
            })
            .collect();
        (total, reads)
    }

    /// Puts an open read back at the head of the queue whoever took it (an operator's hand on
    /// a stuck consumer); its consumer's acknowledgement then finds nothing, as after a
    /// visibility timeout (see `Broker::return_read`).
    pub(crate) fn return_read(&self, handle: u64, now_ns: u64) -> Result<Returned, BrokerError> {
        self.put_back_reads(&[handle], None, Some(0), now_ns)
    }

    /// Puts open reads back: those of `consumer` among `handles`, or any of them. `delay_ms`:
    /// as ABORT's (`return_reads`); `None`: unseen, as if never handed out.
    fn put_back_reads(
        &self,
        handles: &[u64],
        consumer: Option<ConnId>,
        delay_ms: Option<u32>,
        now_ns: u64,
    ) -> Result<Returned, BrokerError> {
        let config = self.config();
        let mut inner = self.lock();
        let mut returned = Vec::new();
        for h in handles {
            if inner.in_flight.get(h).is_some_and(|f| consumer.is_none_or(|c| f.consumer == c)) {
                returned.push(inner.in_flight.remove(h).expect("just seen"));
            }
        }
        let n = returned.len() as u32;
        let over_limit = match delay_ms {
            Some(delay_ms) => inner.return_reads(&self.name, returned, &config, delay_ms, now_ns),
            None => {
                for read in returned {
                    inner.counters.aborted += 1;
                    if let Err(e) = inner.put_back(read.item, false) {
                        tracing::warn!(queue = %self.name, error = %e, "a message given back unseen");
                    }
                }
                Leaving::default()
            }
        };
        if n > 0 {
            // A returned message may carry an expiry: let the next tick look.
            self.due_ns.set(0);
        }
        drop(inner);
        if n > 0 {
            self.available.wake_one();
            // A circular queue's offer refused beside open reads may fit now, the returned
            // messages its oldest to drop.
            if !over_limit.is_empty() || self.config().circular {
                self.room.wake_one();
            }
        }
        Ok(Returned { count: n, over_limit })
    }

    /// Settles messages taken out for the dead-letter queue, now that it holds them (or has
    /// refused them, which the broker counts as lost): see `Leaving`.
    pub(crate) fn settle_left(&self, unsettled: Unsettled) {
        if unsettled.0.is_empty() {
            return;
        }
        let mut inner = self.lock();
        if self.is_removed() {
            // Its directory may be another queue's by now (see `mark_removed`).
            return;
        }
        inner.settle_leaving(unsettled.0);
    }

    /// Returns every tentative delivery of `consumer` (its connection closed).
    pub(crate) fn release(&self, consumer: ConnId, now_ns: u64) -> Result<Returned, BrokerError> {
        let handles: Vec<u64> =
            self.lock().in_flight.iter().filter(|(_, f)| f.consumer == consumer).map(|(h, _)| *h).collect();
        if handles.is_empty() {
            // (A disconnect asks every queue: most have nothing of the connection's.)
            return Ok(Returned::default());
        }
        self.abort(&handles, consumer, 0, now_ns)
    }

    /// Visibility timeouts that passed put their messages back (those at the delivery limit
    /// are given back, for the dead-letter queue); expired messages at the head are removed and
    /// given back too. A step the disk fails does not stop the others (a delayed message that
    /// cannot be moved does not keep reads from timing out), and what they give back is given
    /// back with the first error; after one, the queue's next tick is `TICK_RETRY_NS` later at
    /// the soonest.
    pub(crate) fn tick(&self, now_ns: u64) -> (DeadLetters, Option<BrokerError>, u64) {
        if !self.is_due(now_ns) {
            return (DeadLetters::default(), None, 0);
        }
        let config = self.config();
        let mut inner = self.lock();
        if self.is_removed() {
            // Its directory may be another queue's by now (see `mark_removed`).
            return (DeadLetters::default(), None, 0);
        }
        let mut failed = None;
        let moved = inner.move_due(now_ns).unwrap_or_else(|e| {
            failed.get_or_insert(e);
            0
        });
        let overdue: Vec<u64> =
            inner.in_flight.iter().filter(|(_, f)| f.deadline_ns <= now_ns).map(|(h, _)| *h).collect();
        let returned = overdue.iter().map(|h| inner.in_flight.remove(h).expect("just seen")).collect();
        let over_limit = inner.return_reads(&self.name, returned, &config, 0, now_ns);
        // Expired messages at the head of each level go (to the dead-letter queue), in memory
        // and on disk alike; ones behind an unexpired head wait until they reach it, as in
        // Kestrel.
        let mut expired = Leaving::default();
        let dead_letter = !config.dead_letter.is_empty();
        for level in 0..inner.waiting_at.len() {
            if let Err(e) = inner.drop_expired_heads(level, now_ns, &mut expired, dead_letter) {
                failed.get_or_insert(e);
            }
        }
        let (max_keys, window_ns) = config::dedup_window_of(&config);
        inner.dedup.evict(max_keys, window_ns, now_ns);
        if inner.dedup.take_forgotten() {
            // The records of forgotten keys may be all that kept segments.
            inner.give_back |= matches!(inner.store, Store::Log { .. });
            if let Err(e) = inner.move_dedup_cursors() {
                failed.get_or_insert(e);
            }
        }
        let (given_back, give_back_failed) = inner.give_back(&self.name, now_ns);
        if let Some(e) = give_back_failed {
            failed.get_or_insert(e);
        }
        let next = inner.next_due().unwrap_or_else(|e| {
            failed.get_or_insert(e);
            now_ns
        });
        let give_back = inner.give_back_due();
        inner.give_back_planned = give_back.is_some();
        let give_back = give_back.unwrap_or(u64::MAX);
        let mut due = next.min(inner.dedup_expiry(&config).unwrap_or(u64::MAX)).min(give_back);
        let not_before = if failed.is_some() { now_ns.saturating_add(TICK_RETRY_NS) } else { 0 };
        self.due_ns.not_before.store(not_before, Ordering::Relaxed);
        due = due.max(not_before);
        self.due_ns.planned(due);
        drop(inner);
        // (A failed step may have made messages waiting without counting them as moved.)
        if !overdue.is_empty() || moved > 0 || failed.is_some() {
            self.available.wake_one();
        }
        // (A circular queue's offer refused beside open reads or delayed messages may fit once
        // they are back or due: they are what it drops.)
        let circular_room = (!overdue.is_empty() || moved > 0) && config.circular;
        if !expired.is_empty() || !over_limit.is_empty() || circular_room {
            self.room.wake_one();
        }
        (DeadLetters { expired, over_limit }, failed, given_back)
    }

    /// When `tick` next has work (`u64::MAX`: none known).
    pub fn next_due(&self) -> u64 {
        self.due_ns.load()
    }

    /// The broker's alarm, rung when this queue's work comes due sooner than the tick planned.
    pub(crate) fn use_alarm(&mut self, alarm: Arc<TickAlarm>) {
        self.due_ns.alarm = alarm;
    }

    /// Whether `tick` may have work at `now`.
    pub fn is_due(&self, now_ns: u64) -> bool {
        now_ns >= self.due_ns.load()
    }

    /// Removes every waiting message (not those in flight).
    pub fn flush(&self) -> Result<u64, BrokerError> {
        let mut inner = self.lock();
        let mut n = inner.drop_delayed()? + inner.drop_released()?;
        while inner.drop_oldest()? {
            n += 1;
        }
        inner.give_back |= n > 0 && matches!(inner.store, Store::Log { .. });
        // (Each drop took its bytes off; what a level at its limit of open reads kept stays.)
        if inner.waiting == 0 && inner.delayed == 0 {
            inner.bytes = inner.in_flight_bytes();
        }
        inner.counters.flushes += 1;
        drop(inner);
        self.room.wake_one();
        Ok(n)
    }

    /// Makes the next sync of each of the queue's logs (its levels' and its delayed log, if it
    /// has them) fail as a disk's would, for tests (`tests/sync_failures.rs`).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn fail_next_syncs(&self) {
        self.logs.iter().chain(self.delayed_log.get()).for_each(SharedLog::fail_next_sync);
    }

    /// The queue's figures and configuration as QUEUE_STATUS answers them.
    pub fn status(&self) -> QueueStats {
        let (c, config) = (self.counters(), self.config());
        QueueStats {
            items: c.items,
            bytes: c.bytes,
            in_flight: c.in_flight,
            total_offered: c.total_offered,
            total_polled: c.total_polled,
            expired: c.expired,
            dropped: c.dropped,
            waiters: c.waiters,
            config: (*config).clone(),
            delayed: c.delayed,
            acked: c.acked,
            aborted: c.aborted,
            dead_lettered: c.dead_lettered,
            deduplicated: c.deduplicated,
            dedup_keys: c.dedup_keys,
            durability_in_force: self.logs.first().map(|log| log.durability().to_string()).unwrap_or_default(),
            max_bytes_in_force: match (&self.memory, config.max_bytes) {
                (Some((_, default)), 0) => *default,
                _ => 0,
            },
        }
    }

    pub fn counters(&self) -> QueueCounters {
        let inner = self.lock();
        QueueCounters {
            items: inner.items(),
            bytes: inner.bytes,
            in_flight: inner.in_flight.len() as u64,
            in_flight_bytes: inner.in_flight_bytes(),
            waiters: self.waiters.load(Ordering::Relaxed),
            dedup_keys: inner.dedup.len() as u64,
            delayed: inner.delayed,
            ..inner.counters.clone()
        }
    }

    /// The message at the head of the highest level that has one, left in place; expired
    /// messages before it are removed and returned (for the dead-letter queue), also those taken
    /// out before an error.
    pub fn peek(&self, now_ns: u64) -> (Result<Option<Message>, BrokerError>, Leaving) {
        let mut expired = Leaving::default();
        let dead_letter = !self.config().dead_letter.is_empty();
        let mut inner = self.lock();
        let head = (|| -> Result<Option<Message>, BrokerError> {
            loop {
                let Some(level) = inner.highest_level()? else { return Ok(None) };
                match inner.head_at(level)? {
                    // (One that cannot be taken now hides what is behind it until a tick takes it.)
                    Some(m) if m.is_expired(now_ns) => {
                        if !inner.expire_head(level, m, &mut expired, dead_letter)? {
                            return Ok(None);
                        }
                    }
                    other => return Ok(other.map(|m| Message { destination: self.name.clone(), ..m })),
                }
            }
        })();
        drop(inner);
        if !expired.is_empty() {
            self.room.wake_one();
        }
        (head, expired)
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        // A removed queue gives its bytes back.
        if let Some((budget, _)) = &self.memory {
            let bytes = self.inner.get_mut().unwrap_or_else(|e| e.into_inner()).held_bytes();
            budget.settle(bytes, 0);
        }
    }
}

/// What an offer's idempotency keys found (`Inner::repeats`).
enum Repeats {
    None,
    /// Every message is a repeat: the originals' ids, in the offer's order.
    All(Vec<u64>),
    /// Some are: which, and the ids of the originals found in the window.
    Some(Vec<bool>, Vec<u64>),
}

impl Inner {
    /// Nothing waits, is in flight or is delayed, and no key is remembered (its record must
    /// stay): every record of the queue's logs can go.
    fn drained(&self) -> bool {
        self.waiting == 0 && self.in_flight.is_empty() && self.delayed == 0 && self.dedup.len() == 0
    }

    /// When the tick is to give back the disk the queue's consumers emptied (`give_back`), if
    /// a message left for good since it last did: drained, once nothing was offered for
    /// `GIVE_BACK_IDLE_NS`; else `RETENTION_EVERY_NS` after it last looked. `None`: not now (a
    /// settle, or a key the window forgets, asks again).
    fn give_back_due(&self) -> Option<u64> {
        let due = match self.drained() {
            true => self.last_stamp.saturating_add(GIVE_BACK_IDLE_NS),
            false => self.retention_at.saturating_add(RETENTION_EVERY_NS),
        };
        self.give_back.then_some(due)
    }

    /// Gives back the disk the queue's consumers emptied. A queue with a backlog deletes the
    /// segments every message of which has left (`SharedLog::apply_retention`); a drained one
    /// that has been offered nothing for a while, those and its active segment when it has
    /// grown past the first size (`SharedLog::give_back`). Before, both waited until
    /// offers filled the active segment: a drained, idle queue kept up to twice
    /// `segment_bytes`, a restart gave nothing back, and consuming a backlog on a full disk
    /// (where a new segment cannot be made) freed nothing.
    ///
    /// Returns the bytes of segment files deleted, and the first failure.
    fn give_back(&mut self, queue: &str, now_ns: u64) -> (u64, Option<BrokerError>) {
        let Some(due) = self.give_back_due() else { return (0, None) };
        if now_ns < due {
            return (0, None);
        }
        self.give_back = false;
        let drained = self.drained();
        if !drained {
            self.retention_at = now_ns;
        }
        let Store::Log { lanes, delayed, .. } = &mut self.store else { return (0, None) };
        // Every log is tried, whatever one of them says. A failure (a full disk refusing the new
        // segment) is reported once and tried again at the next settle or start, not at every
        // tick: a retry loop would log it ten times a second.
        let mut given = petrel_log::RetentionReport::default();
        let mut failed = None;
        // Whether `report` removed segments; counted in `given`, or its error kept.
        fn count(
            given: &mut petrel_log::RetentionReport,
            failed: &mut Option<BrokerError>,
            report: Result<petrel_log::RetentionReport, petrel_log::Error>,
        ) -> bool {
            match report {
                Ok(report) => {
                    given.segments_removed += report.segments_removed;
                    given.bytes_removed += report.bytes_removed;
                    report.segments_removed > 0
                }
                Err(e) => {
                    failed.get_or_insert(BrokerError::from(e));
                    false
                }
            }
        }
        for lane in lanes.iter_mut() {
            if drained {
                // A return marker left at the tail (its message was delivered again and
                // acknowledged) is all that could keep the group from the log's end.
                if let Err(e) = skip_markers(&mut lane.group, &mut lane.markers_unread) {
                    failed.get_or_insert(e);
                    continue;
                }
            }
            let log = &lane.log;
            if count(&mut given, &mut failed, if drained { log.give_back() } else { log.apply_retention() }) {
                // Its readers may stand in a segment just deleted: let go, so that its disk goes.
                lane.group.let_go_of_segments();
                if let Some(dedup) = &mut lane.dedup {
                    dedup.let_go_of_segments();
                }
            }
        }
        if let Some(delay) = delayed.as_deref_mut() {
            let log = &delay.log;
            if count(&mut given, &mut failed, if drained { log.give_back() } else { log.apply_retention() }) {
                delay.let_go_of_segments();
            }
        }
        if given.segments_removed > 0 {
            let why = if drained { "drained and idle" } else { "emptied by its consumers" };
            tracing::debug!(queue = %crate::shown(queue), segments = given.segments_removed, bytes = given.bytes_removed, "segments deleted: {why}");
        }
        (given.bytes_removed, failed)
    }

    /// Which messages of an offer are repeats, by their keys (hashed; `None`: no key): their key
    /// is remembered, or an earlier message of the same offer carries it.
    fn repeats(&self, keys: &[Option<crate::dedup::KeyHash>]) -> Repeats {
        // Most offers repeat nothing: found without allocating when few keys are carried.
        if keys.len() <= 32
            && keys
                .iter()
                .enumerate()
                .all(|(i, key)| key.is_none_or(|k| self.dedup.get_hashed(k).is_none() && !keys[..i].contains(key)))
        {
            return Repeats::None;
        }
        let mut originals = Vec::with_capacity(keys.len());
        let mut repeated = Vec::with_capacity(keys.len());
        // A key carried twice in one offer: among a few, found by a scan; among many, by a set.
        let mut seen = (keys.len() > 32).then(|| {
            std::collections::HashSet::with_capacity_and_hasher(keys.len(), foldhash::fast::RandomState::default())
        });
        for (i, key) in keys.iter().enumerate() {
            let original = key.and_then(|k| self.dedup.get_hashed(k));
            originals.extend(original);
            let again = key.is_some_and(|k| match &mut seen {
                Some(seen) => !seen.insert(k),
                None => keys[..i].contains(key),
            });
            repeated.push(original.is_some() || again);
        }
        if originals.len() == keys.len() {
            Repeats::All(originals)
        } else if repeated.iter().any(|r| *r) {
            Repeats::Some(repeated, originals)
        } else {
            Repeats::None
        }
    }

    /// When the tick must next forget idempotency keys by time, if any are remembered.
    fn dedup_expiry(&self, config: &QueueConfig) -> Option<u64> {
        let (_, window_ns) = config::dedup_window_of(config);
        Some(self.dedup.next_expiry(window_ns)).filter(|&t| t != u64::MAX)
    }

    /// Moves each log's `dedup` group up to the oldest record holding a key the queue still
    /// remembers, so that retention may take what is before it; a log that holds no such key
    /// any more has its group removed.
    fn move_dedup_cursors(&mut self) -> Result<(), BrokerError> {
        let Store::Log { lanes, delayed, .. } = &mut self.store else { return Ok(()) };
        if let Some(delay) = delayed {
            let oldest_key = self.dedup.oldest_id_at(lanes.len()).and_then(message::queue_position);
            delay.repin(oldest_key.map(|(_, offset)| offset))?;
        }
        for (level, lane) in lanes.iter_mut().enumerate() {
            let oldest = self.dedup.oldest_id_at(level).and_then(message::queue_position).map(|(_, offset)| offset);
            match (oldest, &mut lane.dedup) {
                (Some(to), Some(group)) if to > group.committed() => {
                    group.seek(petrel_log::SeekTo::Offset(to))?;
                }
                (None, Some(_)) => {
                    lane.dedup = None; // closed first: only a closed group can be deleted
                    lane.log.delete_group(DEDUP_GROUP)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// When `tick` next has work: the earliest visibility deadline, or a head's expiry. (Only
    /// the heads': an offer lowers `due` with its own expiry, and `Locked` with a new head's.)
    fn next_due(&mut self) -> Result<u64, BrokerError> {
        let expiry = self.head_expiry()?;
        let delayed = match &self.store {
            Store::Memory { delayed, .. } => delayed.first_key_value().map(|((due, _), _)| *due),
            // A refill under way (or to begin) goes on at the next tick, at once.
            Store::Log { delayed: Some(d), .. } if d.refill_wanted() => Some(0),
            Store::Log { delayed, .. } => delayed.as_ref().and_then(|d| d.next_due()),
        };
        Ok(self.in_flight.values().map(|f| f.deadline_ns).chain(expiry).chain(delayed).min().unwrap_or(u64::MAX))
    }

    /// When the earliest-expiring message at the head of a level expires, if one does.
    fn head_expiry(&mut self) -> Result<Option<u64>, BrokerError> {
        let mut earliest = None;
        for level in 0..self.waiting_at.len() {
            if self.waiting_at[level] == 0 {
                continue; // nothing to read at that level's head
            }
            // A head that cannot be taken now (as many of its level's records out as its log
            // lets out) is not due: a tick could not take it out, and would come again at once,
            // every millisecond until an acknowledgement. The acknowledgement looks again
            // (`Queue::ack`).
            let expires_at = match self.ready_front(level)? {
                Some(_) if self.in_flight.released_at(level) >= MAX_PENDING => None,
                Some(ready) => Some(self.released_from().expires_at(ready.offset)?),
                None => match &mut self.store {
                    Store::Memory { levels, .. } => levels[level].front().map(|m| m.expires_at),
                    Store::Log { lanes, .. } if lanes[level].held_back() => None,
                    Store::Log { lanes, .. } => lanes[level].head()?.map(|r| message::expires_at(&r)),
                },
            };
            earliest = earliest.into_iter().chain(expires_at.filter(|&e| e != 0)).min();
        }
        Ok(earliest)
    }

    /// Whether a level's head may not be taken now: as many of its records out as its log (or
    /// its released delayed messages) lets out.
    fn any_level_held_back(&self) -> bool {
        let lanes_held = match &self.store {
            Store::Log { lanes, .. } => lanes.iter().any(Lane::held_back),
            Store::Memory { .. } => false,
        };
        lanes_held || (0..self.waiting_at.len()).any(|level| self.in_flight.released_at(level) >= MAX_PENDING)
    }

    /// The message at the head of `level`, left in place (its id and priority set).
    fn head_at(&mut self, level: usize) -> Result<Option<Message>, BrokerError> {
        if let Some(ready) = self.ready_front(level)? {
            return Ok(Some(self.released(level, ready)?));
        }
        Ok(match &mut self.store {
            Store::Memory { levels, .. } => levels[level].front().map(Held::to_message),
            Store::Log { lanes, .. } => lanes[level].head()?.map(|r| stored(level, &r)),
        })
    }

    /// The released delayed message of a durable queue's `level` that comes before its log's
    /// head, if one does: ahead of every record of the level's log from `ready.after` on.
    fn ready_front(&mut self, level: usize) -> Result<Option<Ready>, BrokerError> {
        let Store::Log { lanes, delayed, .. } = &mut self.store else { return Ok(None) };
        let Some(ready) = delayed.as_ref().and_then(|d| d.ready_front(level)) else { return Ok(None) };
        let lane = &mut lanes[level];
        if ready.after <= lane.group.committed() {
            return Ok(Some(ready)); // (every record before it is acknowledged: no head to read)
        }
        skip_markers(&mut lane.group, &mut lane.markers_unread)?;
        // (Whether or not the head may be handed out yet: it is ahead or not all the same.)
        let head = lane.group.peek()?.map(|r| r.offset);
        Ok(head.is_none_or(|head| ready.after <= head).then_some(ready))
    }

    /// The released delayed message `ready` of `level`, as a level's record reads (`stored`):
    /// its id the one it had delayed, its time the one it joined the level at.
    fn released(&mut self, level: usize, ready: Ready) -> Result<Message, BrokerError> {
        let m = self.released_from().message_at(ready.offset)?;
        Ok(Message {
            id: message::queue_id(message::DELAYED_TAG, ready.offset),
            priority: level as u8,
            timestamp: ready.stamp,
            ..m
        })
    }

    /// The highest level with a message to hand out now.
    fn highest_level(&mut self) -> Result<Option<usize>, BrokerError> {
        for level in (0..self.waiting_at.len()).rev() {
            if self.waiting_at[level] > 0 && self.has_head(level)? {
                return Ok(Some(level));
            }
        }
        Ok(None)
    }

    /// Whether `level` has a message to hand out now (on disk: one its offer is not still
    /// waiting to sync).
    fn has_head(&mut self, level: usize) -> Result<bool, BrokerError> {
        if self.ready_front(level)?.is_some() {
            return Ok(true);
        }
        Ok(match &mut self.store {
            Store::Memory { levels, .. } => !levels[level].is_empty(),
            Store::Log { lanes, .. } => lanes[level].has_head()?,
        })
    }

    /// When the message at the head of `level` was offered (`u64::MAX`: none to hand out).
    fn head_offered_at(&mut self, level: usize) -> Result<u64, BrokerError> {
        if self.waiting_at[level] == 0 {
            return Ok(u64::MAX);
        }
        if let Some(ready) = self.ready_front(level)? {
            return Ok(ready.stamp);
        }
        Ok(match &mut self.store {
            Store::Memory { levels, .. } => levels[level].front().map_or(u64::MAX, |m| m.timestamp),
            Store::Log { lanes, .. } => lanes[level].head()?.map_or(u64::MAX, |r| r.timestamp),
        })
    }

    /// The level the next take comes from: the highest with a message, but for one take in
    /// every `period` while lower levels have messages, which goes to the lower level whose
    /// head has waited longest (so that no level starves).
    fn choose_level(&mut self, period: u32) -> Result<Option<usize>, BrokerError> {
        let Some(top) = self.highest_level()? else { return Ok(None) };
        if !self.waiting_at[..top].iter().any(|&n| n > 0) {
            return Ok(Some(top));
        }
        self.takes_from_top += 1;
        if self.takes_from_top < period {
            return Ok(Some(top));
        }
        let mut oldest = (u64::MAX, top);
        for level in 0..top {
            let at = self.head_offered_at(level)?;
            if at < oldest.0 {
                oldest = (at, level);
            }
        }
        if oldest.1 != top {
            self.takes_from_top = 0;
        }
        Ok(Some(oldest.1))
    }

    /// What the queue's messages take of the server's memory budget (a queue in memory): their
    /// bytes, and what holding each takes.
    fn held_bytes(&self) -> u64 {
        self.bytes + (self.waiting + self.in_flight.len() as u64) * HELD_OVERHEAD + self.delayed * DELAYED_OVERHEAD
    }

    /// Bytes of the messages out with consumers (counted in `bytes`).
    fn in_flight_bytes(&self) -> u64 {
        debug_assert_eq!(self.in_flight.bytes, self.in_flight.values().map(|f| f.bytes).sum::<u64>());
        self.in_flight.bytes
    }

    /// Messages waiting (not in flight).
    fn items(&self) -> u64 {
        debug_assert_eq!(self.waiting, self.waiting_at.iter().sum::<u64>(), "a queue's count is its levels'");
        debug_assert_eq!(
            self.waiting,
            match &self.store {
                Store::Memory { levels, .. } => levels.iter().map(|l| l.len() as u64).sum(),
                Store::Log { lanes, delayed, .. } => {
                    let released_out = self.in_flight.released.iter().sum::<usize>() as u64;
                    debug_assert_eq!(
                        released_out,
                        self.in_flight.values().filter(|f| matches!(f.item, Taken::Released { .. })).count() as u64
                    );
                    lanes.iter().map(|l| l.group.unacknowledged() - l.markers_unread).sum::<u64>()
                        + delayed.as_ref().map_or(0, |d| d.ready_len())
                        + released_out
                        - self.in_flight.len() as u64
                        - self.leaving_records
                }
            },
            "a queue's count matches its store"
        );
        debug_assert_eq!(
            self.delayed,
            match &self.store {
                Store::Memory { delayed, .. } => delayed.len() as u64,
                Store::Log { delayed, .. } => delayed.as_ref().map_or(0, |d| d.pending()),
            },
            "a queue's delayed count matches its store"
        );
        self.waiting
    }

    /// The next message, from the level `choose_level` picks, taken out of the ready set (not
    /// yet settled), its `deliveries` counting this one.
    fn next(&mut self, period: u32) -> Result<Option<(Message, Taken)>, BrokerError> {
        let level = match self.waiting_at.len() {
            1 => 0,
            _ => match self.choose_level(period)? {
                Some(level) => level,
                None => return Ok(None),
            },
        };
        let taken = self.take_at(level)?;
        if taken.is_some() || self.waiting_at.len() == 1 {
            return Ok(taken);
        }
        // The level chosen has as many out as its log allows (it waits for acknowledgements):
        // the other levels' messages still go rather than none. On a lower level's turn (the
        // share), the other lower levels first, oldest head first, so that none starves behind
        // a blocked one; else the highest first.
        let top = (0..self.waiting_at.len()).rev().find(|&l| self.waiting_at[l] > 0).unwrap_or(level);
        let mut others = Vec::with_capacity(self.waiting_at.len());
        let candidates: Vec<usize> =
            (0..self.waiting_at.len()).filter(|&l| l != level && self.waiting_at[l] > 0).collect();
        for other in candidates {
            let order = match level < top && other < top {
                true => (0, self.head_offered_at(other)?),
                false => (1, u64::MAX - other as u64),
            };
            others.push((order, other));
        }
        others.sort_unstable();
        for (_, other) in others {
            if let Some(taken) = self.take_at(other)? {
                return Ok(Some(taken));
            }
        }
        Ok(None)
    }

    /// `next_at`, counted: the message taken is no longer waiting.
    fn take_at(&mut self, level: usize) -> Result<Option<(Message, Taken)>, BrokerError> {
        let next = self.next_at(level)?;
        if next.is_some() {
            counting::subtract(&mut self.waiting, 1, "a queue's waiting messages");
            counting::subtract(&mut self.waiting_at[level], 1, "a priority level's waiting messages");
            self.head_taken = true;
        }
        Ok(next)
    }

    fn next_at(&mut self, level: usize) -> Result<Option<(Message, Taken)>, BrokerError> {
        if let Some(ready) = self.ready_front(level)? {
            if self.in_flight.released_at(level) >= MAX_PENDING {
                return Ok(None); // (as many out as a level's log allows: it waits for acknowledgements)
            }
            let message = self.released(level, ready)?;
            let delay = self.released_from();
            let message = Message { deliveries: delay.deliveries(ready.offset)?, ..message };
            assert_eq!(delay.take_ready(level), Some(ready), "the front is taken");
            return Ok(Some((message, Taken::Released { level, ready })));
        }
        match &mut self.store {
            Store::Memory { levels, .. } => Ok(levels[level].pop_front().map(|mut m| {
                m.deliveries += 1;
                (m.to_message(), Taken::Memory(Box::new(m)))
            })),
            Store::Log { lanes, .. } => {
                let lane = &mut lanes[level];
                // A record an offer still waits to sync for stays where it is (peek and poll
                // pick the same record: a returned one first, else the next in the log).
                if lane.visible_end != u64::MAX && lane.head()?.is_none() {
                    return Ok(None);
                }
                skip_markers(&mut lane.group, &mut lane.markers_unread)?;
                match lane.group.poll(1, Duration::ZERO) {
                    Ok(batch) => Ok(batch.into_iter().next().map(|r| {
                        let deliveries = lane_deliveries(&lane.returns, &r);
                        let taken = Taken::Log { level, offset: r.offset };
                        (Message { deliveries, ..stored(level, &r) }, taken)
                    })),
                    Err(petrel_log::Error::TooManyPending { .. }) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    /// A taken message is gone for good.
    fn settle(&mut self, taken: &Taken) -> Result<(), BrokerError> {
        self.give_back |= matches!(self.store, Store::Log { .. });
        match (&mut self.store, taken) {
            (Store::Log { lanes, .. }, Taken::Log { level, offset }) => {
                let lane = &mut lanes[*level];
                lane.returns.remove(offset);
                Ok(lane.group.ack(*offset)?)
            }
            (Store::Log { delayed: Some(delay), .. }, Taken::Released { ready, .. }) => {
                delay.settle(ready.offset);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Tentative reads come back from their consumers: each goes back to the head (counted as
    /// returned), or among the delayed messages when it is to wait (`delay_ms`, else the
    /// queue's redelivery delay for its count), or, once handed out `max_deliveries` times (0:
    /// no limit), is settled and given back for the dead-letter queue with its count.
    ///
    /// Never leaves a read out of the queue: what the disk refuses (a delayed copy, a message to
    /// dead-letter read back) is logged and its read goes back to the head instead.
    fn return_reads(
        &mut self,
        queue: &str,
        mut reads: Vec<InFlight>,
        config: &QueueConfig,
        delay_ms: u32,
        now_ns: u64,
    ) -> Leaving {
        // In their places' order (they come from a map, in none): each goes back after the one
        // before it, so that putting back thousands moves nothing that is already back.
        reads.sort_by_key(|r| r.item.place());
        let max_deliveries = config.max_deliveries;
        let dead_letter = !config.dead_letter.is_empty();
        let mut over_limit = Leaving::default();
        let mut later = Vec::new();
        for read in reads {
            let deliveries = match self.deliveries(&read.item) {
                Ok(deliveries) => deliveries,
                Err(e) => {
                    self.put_back_anyway(queue, read.item, &e);
                    continue;
                }
            };
            if max_deliveries == 0 || deliveries < max_deliveries {
                self.counters.aborted += 1;
                let delay_ms = match delay_ms {
                    0 => config::redelivery_delay_ms(config, deliveries),
                    ms => u64::from(ms),
                };
                match delay_ms {
                    0 => self.put_back_logged(queue, read.item),
                    ms => later.push((read.item, now_ns.saturating_add(ms.saturating_mul(1_000_000)))),
                }
                continue;
            }
            let message = match &read.item {
                Taken::Memory(m) => Ok(m.to_message()),
                Taken::Log { level, offset } => self.read_stored(*level, *offset),
                Taken::Released { level, ready } => self.released(*level, *ready),
            };
            let message = match message {
                Ok(message) => message,
                Err(e) => {
                    self.put_back_anyway(queue, read.item, &e);
                    continue;
                }
            };
            counting::subtract(&mut self.bytes, read.bytes, "a queue's bytes");
            self.counters.dead_lettered += 1;
            // A settle that fails has still acknowledged in memory (see `ack`): the message
            // goes to the dead letters all the same.
            if let Err(e) = self.leave(&mut over_limit, Message { deliveries, ..message }, read.item, dead_letter) {
                tracing::error!(queue, error = %e, "a dead-lettered message's acknowledgement is not durable");
            }
        }
        self.delay_returned(queue, later);
        over_limit
    }

    /// How many times the taken message was handed out, this time included.
    fn deliveries(&mut self, taken: &Taken) -> Result<u32, BrokerError> {
        Ok(match (&mut self.store, taken) {
            (Store::Memory { .. }, Taken::Memory(m)) => m.deliveries,
            (Store::Log { lanes, .. }, Taken::Log { level, offset }) => {
                let lane = &lanes[*level];
                with_record(&lane.log, *offset, |r| lane_deliveries(&lane.returns, r))?
            }
            (Store::Log { delayed: Some(delay), .. }, Taken::Released { ready, .. }) => {
                delay.deliveries(ready.offset)?
            }
            _ => unreachable!("a queue's takings match its store"),
        })
    }

    /// A returned read goes back to the head because what was to be done with it failed.
    fn put_back_anyway(&mut self, queue: &str, taken: Taken, cause: &BrokerError) {
        tracing::warn!(queue, error = %cause, "a returned message goes back to the head instead");
        self.put_back_logged(queue, taken);
    }

    /// `put_back` of a delivered read, whose only failure (its return marker not written) is
    /// logged: the message is back all the same.
    fn put_back_logged(&mut self, queue: &str, taken: Taken) {
        if let Err(e) = self.put_back(taken, true) {
            tracing::warn!(queue, error = %e, "a returned message's delivery is counted in memory only");
        }
    }

    /// Returned messages wait among the delayed ones until they are due, each with the
    /// deliveries it had. On disk: each original's delivery counted by a marker, the copies
    /// appended to the delayed log (synced unless the policy is `none`), then the originals
    /// acknowledged in their level's log. A crash before the acknowledgements drops the copies
    /// at the next open (their originals still wait) and the markers keep the count; a crash
    /// after them keeps the copies, which carry it. What the disk refuses goes back to the head.
    fn delay_returned(&mut self, queue: &str, mut later: Vec<(Taken, u64)>) {
        if later.is_empty() {
            return;
        }
        // Those returned together are delayed in their levels' order (as they were waiting), so
        // that those due at one time come back in it: not in the order a map lists them.
        later.sort_by_key(|(taken, _)| taken.place());
        let n = later.len() as u64;
        if let Store::Memory { delayed, next_id, .. } = &mut self.store {
            for (taken, due) in later {
                let Taken::Memory(mut m) = taken else { unreachable!("a queue's takings match its store") };
                m.deliver_at = due;
                // Among those due at one time, in the order they were delayed (as on disk).
                self.delayed_bytes += m.size();
                delayed.insert((due, *next_id), *m);
                *next_id += 1;
            }
            self.delayed += n;
            return;
        }
        let copies = match self.delayed_copies(&later) {
            Ok(copies) => copies,
            Err(e) => {
                for (taken, _) in later {
                    self.put_back_anyway(queue, taken, &e);
                }
                return;
            }
        };
        // Counted before the copies exist (they were read with the count before this one).
        for (taken, _) in &later {
            if let Err(e) = self.count_delivery(taken) {
                tracing::warn!(queue, error = %e, "a delayed message's delivery is counted in its copy only");
            }
        }
        match self.copy_to_delayed(copies) {
            Ok(()) => {}
            Err((e, false)) => {
                for (taken, _) in later {
                    tracing::warn!(queue, error = %e, "a returned message goes back to the head instead");
                    // Its delivery counted already.
                    if let Err(e) = self.put_back(taken, false) {
                        tracing::warn!(queue, error = %e, "a returned message could not be put back");
                    }
                }
                return;
            }
            // In the delayed log, not synced: they stand for their originals (put back too,
            // each would come twice).
            Err((e, true)) => tracing::error!(queue, error = %e, "delayed copies of returned messages are not synced"),
        }
        #[cfg(test)]
        if CRASH_AFTER_DELAYED_COPIES.get() {
            return;
        }
        for (taken, _) in &later {
            if let Err(e) = self.settle(taken) {
                // Its copy is delayed; the original comes back after a restart (a copy whose
                // original is unacknowledged is dropped on open).
                tracing::error!(queue, error = %e, "a delayed message's original could not be acknowledged");
            }
        }
        self.delayed += n;
    }

    /// Appends `copies` to the delayed log. Fails with whether they were appended all the same
    /// (only their sync failed).
    fn copy_to_delayed(
        &mut self,
        (copies, placements): (Vec<Message>, Vec<Placement>),
    ) -> Result<(), (BrokerError, bool)> {
        let delay = self.delay_log().map_err(|e| (e, false))?;
        delay.append(&copies, &placements).map_err(|e| (e, false))?;
        if delay.log.durability() != Durability::None {
            // On disk before the originals are acknowledged: a crash keeps one or the other.
            delay.log.sync().map_err(|e| (e.into(), true))?;
        }
        Ok(())
    }

    /// The delayed copies of the returned messages `later`, each due at its time, with the
    /// deliveries its original had (this one included).
    fn delayed_copies(&mut self, later: &[(Taken, u64)]) -> Result<(Vec<Message>, Vec<Placement>), BrokerError> {
        let mut copies = Vec::with_capacity(later.len());
        let mut placements = Vec::with_capacity(later.len());
        for (taken, due) in later {
            let (message, deliveries) = match *taken {
                Taken::Log { level, offset } => {
                    let Store::Log { lanes, .. } = &self.store else { unreachable!("taken from a log") };
                    let lane = &lanes[level];
                    with_record(&lane.log, offset, |r| (stored(level, r), lane_deliveries(&lane.returns, r)))?
                }
                Taken::Released { level, ready } => {
                    let deliveries = self.released_from().deliveries(ready.offset)?;
                    (self.released(level, ready)?, deliveries)
                }
                Taken::Memory(_) => unreachable!("a queue's takings match its store"),
            };
            copies.push(Message { deliver_at: *due, ..message });
            placements.push(Placement {
                priority: taken.level() as u8,
                deliveries,
                copy: true,
                returned_from: Some(taken.message_id()),
                ..Placement::default()
            });
        }
        Ok((copies, placements))
    }

    /// The delayed log that released messages are handed out from (a queue with one taken
    /// from it has it).
    fn released_from(&mut self) -> &mut DelayLog {
        let Store::Log { delayed: Some(delay), .. } = &mut self.store else {
            unreachable!("released from a delayed log")
        };
        delay
    }

    /// A durable queue's delayed log, made at its first delayed message.
    fn delay_log(&mut self) -> Result<&mut DelayLog, BrokerError> {
        let Store::Log { lanes, delayed, open_delayed } = &mut self.store else { unreachable!("only a log has one") };
        Ok(match delayed {
            Some(delay) => delay,
            None => delayed.insert(Box::new(DelayLog::create(open_delayed()?, delay::MAX_TIMERS, lanes.len())?)),
        })
    }

    /// Hands the delayed messages due at `now_ns` to the tail of their levels (on disk, at most
    /// `delay::MAX_MOVES_PER_TICK` and `delay::MAX_MOVE_BYTES` at a time: copied to their levels'
    /// logs, synced unless the policy is `none`, then marked done in the delayed log). Returns
    /// how many.
    fn move_due(&mut self, now_ns: u64) -> Result<u64, BrokerError> {
        let mut moved_at = vec![0u64; self.waiting_at.len()];
        // A moved message joins its level now: stamped as an offer would be, so that its level
        // stays in time order (the share's turn picks the head that waited longest).
        let stamp = now_ns.max(self.last_stamp + 1);
        let mut after: Result<(), BrokerError> = Ok(());
        match &mut self.store {
            Store::Memory { levels, next_id, delayed } => {
                while let Some(entry) = delayed.first_entry()
                    && entry.key().0 <= now_ns
                {
                    let mut m = entry.remove();
                    counting::subtract(&mut self.delayed_bytes, m.size(), "a queue's delayed bytes");
                    // Among the waiting ones from now on: the next id keeps a level in id order.
                    m.timestamp = stamp;
                    m.id = *next_id;
                    *next_id += 1;
                    let level = m.priority as usize;
                    moved_at[level] += 1;
                    levels[level].push_back(m);
                }
            }
            Store::Log { lanes, delayed: Some(delay), .. } => {
                // Released where they are, unless too many runs of them wait: then copied.
                let afters: Vec<u64> = lanes.iter().map(|l| l.log.next_offset()).collect();
                match delay.release_due(now_ns, delay::MAX_RELEASES_PER_TICK, &afters, stamp)? {
                    // (Each behind its level's records still waiting to sync, if any: it waits for them.)
                    Some(released) => moved_at = released,
                    None => {
                        // Those beyond the tick's bytes wait for the next tick (at once: they are due).
                        let top = lanes.len() - 1;
                        let (due, copies) =
                            delay.take_due(now_ns, delay::MAX_MOVES_PER_TICK, top, delay::MAX_MOVE_BYTES)?;
                        // The originals on disk before their copies (as a release's marker waits for
                        // them): a power loss must not keep a copy whose original the delayed log
                        // lost, for its offset is taken again by a later delayed message, which the
                        // copy's `moved_from` would mark done on the next open.
                        let last = due.iter().map(|t| t.offset()).max();
                        if let Some(last) = last.filter(|_| delay.log.durability() != Durability::None)
                            && let Err(e) = delay.log.make_durable(last)
                        {
                            delay.untake(&due);
                            return Err(e.into());
                        }
                        // Level by level. The levels before `synced` have their copies on disk (as
                        // their durability has it), those before `appended` in their logs.
                        let (mut synced, mut appended, mut failed) = (0, 0, None);
                        for (level, lane) in lanes.iter_mut().enumerate() {
                            let range = match copies.append(&lane.log, level, stamp) {
                                Ok(range) => range,
                                Err(e) => {
                                    failed = Some(BrokerError::from(e));
                                    break;
                                }
                            };
                            appended = level + 1;
                            moved_at[level] = range.end - range.start;
                            // On disk before the originals are marked done: a crash keeps one or the
                            // other (and open tells which from the copy's `moved_from`).
                            if !range.is_empty()
                                && lane.log.durability() != Durability::None
                                && let Err(e) = lane.log.sync()
                            {
                                failed = Some(e.into());
                                break;
                            }
                            synced = level + 1;
                            if !range.is_empty() && lane.visible_end != u64::MAX {
                                lane.visible_end = lane.visible_end.max(range.end);
                            }
                        }
                        // Originals whose copies were not stored come due again, the next tick's
                        // first; those whose copies are on disk are done (a marker that cannot be
                        // written now is tried again at each release of the lock and tick, as for
                        // settled ones: until then a restart would take the originals again once
                        // their copies were acknowledged). Those of a level whose sync failed stay
                        // taken: a restart keeps the copy if it is on disk, else the original.
                        let levels_of = copies.copies().iter().map(|c| c.level);
                        let taken: Vec<_> = due.iter().copied().zip(levels_of).collect();
                        let again: Vec<_> = taken.iter().filter(|(_, l)| *l >= appended).map(|(t, _)| *t).collect();
                        delay.untake(&again);
                        let done: Vec<u64> =
                            taken.iter().filter(|(_, l)| *l < synced).map(|(t, _)| t.offset()).collect();
                        done.iter().for_each(|&offset| delay.settle(offset));
                        let marked = delay.write_settled().and_then(|()| match delay.log.durability() {
                            Durability::Always if !done.is_empty() => Ok(delay.log.sync()?),
                            _ => Ok(()),
                        });
                        if let Some(e) = failed.or(marked.err()) {
                            self.count_moved(moved_at, stamp);
                            return Err(e);
                        }
                    }
                }
                let oldest_key = self.dedup.oldest_id_at(lanes.len()).and_then(message::queue_position);
                // (What was released is counted whatever these do.)
                after = delay
                    .refill_step(delay::REFILL_SLICE)
                    .and_then(|_| delay.repin(oldest_key.map(|(_, offset)| offset)));
            }
            Store::Log { delayed: None, .. } => {}
        }
        let moved = self.count_moved(moved_at, stamp);
        after.map(|()| moved)
    }

    /// Counts messages `move_due` moved (`moved_at`: per level) as waiting at their levels.
    fn count_moved(&mut self, moved_at: Vec<u64>, stamp: u64) -> u64 {
        let moved: u64 = moved_at.iter().sum();
        if moved > 0 {
            self.last_stamp = stamp;
        }
        counting::subtract(&mut self.delayed, moved, "a queue's delayed messages");
        for (level, n) in moved_at.into_iter().enumerate() {
            self.waiting_at[level] += n;
        }
        self.waiting += moved;
        moved
    }

    /// Drops every delayed message (a flush); returns how many.
    fn drop_delayed(&mut self) -> Result<u64, BrokerError> {
        let n = self.delayed;
        match &mut self.store {
            Store::Memory { delayed, .. } => {
                let bytes = delayed.values().map(Held::size).sum();
                delayed.clear();
                counting::subtract(&mut self.bytes, bytes, "a queue's bytes");
                self.delayed_bytes = 0;
            }
            Store::Log { lanes, delayed: Some(delay), .. } => {
                let offsets = delay.delayed_offsets();
                let sizes = offsets.iter().map(|&o| delay.size_at(o));
                let sizes = sizes.collect::<Result<Vec<u64>, _>>()?;
                // A failure part way drops only those marked done; the others stay delayed.
                let (marked, failed) = delay.drop_delayed(&offsets, MARKER_OFFSETS);
                counting::subtract(&mut self.bytes, sizes[..marked].iter().sum(), "a queue's bytes");
                if let Some(e) = failed {
                    counting::subtract(&mut self.delayed, marked as u64, "a queue's delayed messages");
                    return Err(e);
                }
                // All are dropped: counted so before the pin moves, whether it can or not (a
                // cursor that fails to move keeps the log's segments a while, nothing more).
                self.delayed = 0;
                let oldest_key = self.dedup.oldest_id_at(lanes.len()).and_then(message::queue_position);
                delay.repin(oldest_key.map(|(_, offset)| offset))?;
            }
            Store::Log { delayed: None, .. } => {}
        }
        self.delayed = 0;
        Ok(n)
    }

    /// Drops every released delayed message waiting (a flush), and their bytes; returns how
    /// many.
    fn drop_released(&mut self) -> Result<u64, BrokerError> {
        let Store::Log { delayed: Some(delay), .. } = &mut self.store else { return Ok(0) };
        // Their sizes first: a record that cannot be read stops the flush before any is dropped
        // (dropped first, their bytes stayed counted for good).
        let sizes = delay.ready_offsets().into_iter().map(|o| delay.size_at(o)).collect::<Result<Vec<u64>, _>>()?;
        // A failure part way drops only those marked done (the first ones); the others stay
        // released.
        let (per_level, offsets, failed) = delay.drop_ready(MARKER_OFFSETS);
        let dropped = per_level.iter().sum::<u64>();
        for (waiting, n) in self.waiting_at.iter_mut().zip(per_level) {
            counting::subtract(waiting, n, "a priority level's waiting messages");
            counting::subtract(&mut self.waiting, n, "a queue's waiting messages");
        }
        self.head_taken |= dropped > 0;
        // Their bytes go with them (a flush that leaves messages waiting, behind a level at its
        // limit of open reads, does not count the bytes afresh).
        counting::subtract(&mut self.bytes, sizes[..offsets.len()].iter().sum(), "a queue's bytes");
        failed.map_or(Ok(dropped), Err)
    }

    /// The message stored at `offset` of a durable queue's log for `level`.
    fn read_stored(&self, level: usize, offset: u64) -> Result<Message, BrokerError> {
        let Store::Log { lanes, .. } = &self.store else { unreachable!("only a log stores by offset") };
        with_record(&lanes[level].log, offset, |r| stored(level, r))
    }

    /// A taken message goes back to the head of its level, among other returned ones in the
    /// order they were offered: a level is always in offer order, in memory as on disk (where
    /// the group redelivers the lowest offset first). `delivered`: it was handed out and came
    /// back (the delivery counts); else it never left (a poll's answer was full), and does not.
    fn put_back(&mut self, taken: Taken, delivered: bool) -> Result<(), BrokerError> {
        let level = taken.level();
        // The marker that counts the delivery may fail (the disk refused it): the message is
        // back all the same, its count kept in memory, and the error reported.
        let marker = match (&mut self.store, taken) {
            (Store::Memory { levels, .. }, Taken::Memory(mut m)) => {
                if !delivered {
                    m.deliveries -= 1;
                }
                // A level is sorted by id: offers append higher ids, and this keeps it so.
                levels[level].insert_by_id(*m);
                Ok(())
            }
            (Store::Log { lanes, .. }, Taken::Log { offset, .. }) => {
                // The marker first: a crash after it counts the delivery, one before it
                // redelivers anyway (nothing in flight survives a restart).
                let marker = if delivered { count_in_lane(&mut lanes[level], offset) } else { Ok(()) };
                // One that never left and was the last read is read again in order, taking
                // none of the log's open reads meanwhile.
                if delivered || !lanes[level].group.unpoll(offset) {
                    lanes[level].group.nack(offset)?;
                }
                marker
            }
            (Store::Log { delayed: Some(delay), .. }, Taken::Released { ready, .. }) => {
                delay.put_back_ready(level, ready, delivered)
            }
            _ => unreachable!("a queue's takings match its store"),
        };
        self.waiting += 1;
        self.waiting_at[level] += 1;
        marker
    }

    /// Counts a delivery of `taken`, still out, in a marker in its log (in memory as well,
    /// whether or not the marker could be written).
    fn count_delivery(&mut self, taken: &Taken) -> Result<(), BrokerError> {
        match (&mut self.store, taken) {
            (Store::Log { lanes, .. }, Taken::Log { level, offset }) => count_in_lane(&mut lanes[*level], *offset),
            (Store::Log { delayed: Some(delay), .. }, Taken::Released { ready, .. }) => {
                delay.count_delivery(ready.offset)
            }
            _ => unreachable!("only a log's takings are counted in markers"),
        }
    }

    /// Takes the messages at the head of `level` that expired by `now_ns` out into `expired`.
    fn drop_expired_heads(
        &mut self,
        level: usize,
        now_ns: u64,
        expired: &mut Leaving,
        dead_letter: bool,
    ) -> Result<(), BrokerError> {
        while let Some(head) = self.head_at(level)?
            && head.is_expired(now_ns)
        {
            if !self.expire_head(level, head, expired, dead_letter)? {
                break;
            }
        }
        Ok(())
    }

    /// Takes `head`, expired at the head of `level`, out into `expired`: with a dead-letter
    /// queue, taken and left unsettled until that queue has it (`Leaving`); without one,
    /// dropped. `false`: it stays where it is for now (the level has as many records out as its
    /// log allows, or an offer of it still waits for its sync): a later tick takes it.
    fn expire_head(
        &mut self,
        level: usize,
        head: Message,
        expired: &mut Leaving,
        dead_letter: bool,
    ) -> Result<bool, BrokerError> {
        if !dead_letter {
            let dropped = self.drop_head(level)?;
            if dropped {
                self.counters.expired += 1;
                expired.messages.push(head);
            }
            return Ok(dropped);
        }
        let Some((message, taken)) = self.take_at(level)? else { return Ok(false) };
        counting::subtract(&mut self.bytes, message.size(), "a queue's bytes");
        self.counters.expired += 1;
        self.leave(expired, head, taken, true)?;
        Ok(true)
    }

    /// Settles messages that were leaving for the dead-letter queue (`leave` counted them).
    fn settle_leaving(&mut self, takings: Vec<Taken>) {
        for taken in takings {
            let record = u64::from(matches!(taken, Taken::Log { .. }));
            counting::subtract(&mut self.leaving_records, record, "a queue's records leaving");
            if let Err(e) = self.settle(&taken) {
                tracing::error!(error = %e, "a dead-lettered message's acknowledgement is not durable");
            }
        }
    }

    /// `message`, taken for the dead-letter queue, into `leaving`: settled at once when the
    /// queue has no dead-letter queue (it just goes), else when that queue has it.
    fn leave(
        &mut self,
        leaving: &mut Leaving,
        message: Message,
        taken: Taken,
        dead_letter: bool,
    ) -> Result<(), BrokerError> {
        leaving.messages.push(message);
        if dead_letter {
            self.leaving_records += u64::from(matches!(taken, Taken::Log { .. }));
            leaving.takings.push(taken);
            return Ok(());
        }
        self.settle(&taken)
    }

    /// Waiting messages of the levels whose logs consumers' open reads may stop letting records
    /// out before all are taken (`ConsumerGroup::may_block`), and those levels (a bit each):
    /// room for an offer cannot count on them.
    fn waiting_held_back(&self) -> (u64, u16) {
        let Store::Log { lanes, .. } = &self.store else { return (0, 0) };
        let mut held_back = (0, 0);
        for (level, (lane, waiting)) in lanes.iter().zip(&self.waiting_at).enumerate() {
            if lane.group.may_block() {
                held_back = (held_back.0 + waiting, held_back.1 | 1 << level);
            }
        }
        held_back
    }

    /// Drops the oldest waiting message of the lowest level that gives one now (a flush passes
    /// over a level at its limit of open reads); `false` if there is none.
    fn drop_oldest(&mut self) -> Result<bool, BrokerError> {
        let Some((taken, size, _)) = self.take_oldest(None, 0, &mut false)? else { return Ok(false) };
        self.drop_taken([(taken, size)], &mut 0)?;
        Ok(true)
    }

    /// Takes out the oldest waiting message of the lowest level that gives one now (`take_out`),
    /// with its level. A level at its limit of open reads, which its consumers hold, is passed
    /// over (`passed_over` set unless it is among `held_back`, a bit a level), but not `own`:
    /// the level of the caller's last take of a record from its log, whose own takes may have
    /// brought it to its limit; there `None` is the answer, as a more urgent level's message must
    /// not go while that level's wait.
    fn take_oldest(
        &mut self,
        own: Option<usize>,
        held_back: u16,
        passed_over: &mut bool,
    ) -> Result<Option<(Taken, u64, usize)>, BrokerError> {
        for level in 0..self.waiting_at.len() {
            if self.waiting_at[level] == 0 {
                continue;
            }
            match self.take_out(level)? {
                Some((taken, size)) => return Ok(Some((taken, size, level))),
                None if own == Some(level) => return Ok(None),
                None => *passed_over |= held_back & 1 << level == 0,
            }
        }
        Ok(None)
    }

    /// Drops the message at the head of `level`; `false` if there is none now.
    fn drop_head(&mut self, level: usize) -> Result<bool, BrokerError> {
        let Some(taken) = self.take_out(level)? else { return Ok(false) };
        self.drop_taken([taken], &mut 0)?;
        Ok(true)
    }

    /// Takes the message at the head of `level` out, with its size, to drop (`drop_taken`) or
    /// put back (`put_back_taken`) under this same lock: whatever waits there, also a record
    /// whose offer still waits for its sync and a released message past the level's limit of
    /// reads out (a drop hands nothing out). `None`: nothing there, or the level's log lets no
    /// more of its records out until some are acknowledged.
    fn take_out(&mut self, level: usize) -> Result<Option<(Taken, u64)>, BrokerError> {
        let taken = if let Some(ready) = self.ready_front(level)? {
            let size = self.released_from().size_at(ready.offset)?;
            assert_eq!(self.released_from().take_ready(level), Some(ready), "the front is taken");
            (Taken::Released { level, ready }, size)
        } else {
            match &mut self.store {
                Store::Memory { levels, .. } => match levels[level].pop_front() {
                    Some(mut m) => {
                        // Counted as a take for a consumer is, which putting it back undoes.
                        m.deliveries += 1;
                        let size = m.size();
                        (Taken::Memory(Box::new(m)), size)
                    }
                    None => return Ok(None),
                },
                Store::Log { lanes, .. } => {
                    let lane = &mut lanes[level];
                    skip_markers(&mut lane.group, &mut lane.markers_unread)?;
                    let record = match lane.group.poll(1, Duration::ZERO) {
                        Ok(batch) => batch.into_iter().next().map(|r| (r.offset, message::record_size(&r))),
                        Err(petrel_log::Error::TooManyPending { .. }) => None,
                        Err(e) => return Err(e.into()),
                    };
                    let Some((offset, size)) = record else { return Ok(None) };
                    // Neither waiting nor out with a consumer until dropped or put back.
                    self.leaving_records += 1;
                    (Taken::Log { level, offset }, size)
                }
            }
        };
        counting::subtract(&mut self.waiting, 1, "a queue's waiting messages");
        counting::subtract(&mut self.waiting_at[level], 1, "a priority level's waiting messages");
        self.head_taken = true;
        Ok(Some(taken))
    }

    /// Drops messages `take_out` took, counting them in `dropped`: gone for good (expired,
    /// dropped for room, flushed), as settled ones are. One whose acknowledgement failed before
    /// it took (the log refuses changes) goes back with those after it, and the error says why.
    fn drop_taken(
        &mut self,
        taken: impl IntoIterator<Item = (Taken, u64)>,
        dropped: &mut u64,
    ) -> Result<(), BrokerError> {
        let mut rest = taken.into_iter();
        while let Some((taken, size)) = rest.next() {
            let record = u64::from(matches!(taken, Taken::Log { .. }));
            counting::subtract(&mut self.leaving_records, record, "a queue's records leaving");
            if let Err(e) = self.settle(&taken) {
                // An acknowledgement whose cursor could not be made durable took all the same.
                let gone = match (&self.store, &taken) {
                    (Store::Log { lanes, .. }, Taken::Log { level, offset }) => {
                        lanes[*level].group.is_acknowledged(*offset)
                    }
                    _ => false,
                };
                // Newest first, so that each is its log's last read (`ConsumerGroup::unpoll`).
                self.put_back_taken(rest.collect::<Vec<_>>().into_iter().rev());
                match gone {
                    true => {
                        counting::subtract(&mut self.bytes, size, "a queue's bytes");
                        *dropped += 1;
                    }
                    false => {
                        self.leaving_records += record;
                        self.put_back_taken([(taken, size)]);
                    }
                }
                return Err(e);
            }
            counting::subtract(&mut self.bytes, size, "a queue's bytes");
            *dropped += 1;
        }
        Ok(())
    }

    /// `drop_taken` for an offer's room: what goes counts in the queue's `dropped`, also when a
    /// drop fails part way.
    fn drop_for_room(&mut self, taken: impl IntoIterator<Item = (Taken, u64)>) -> Result<(), BrokerError> {
        let mut dropped = 0;
        let done = self.drop_taken(taken, &mut dropped);
        self.counters.dropped += dropped;
        done
    }

    /// Puts messages `take_out` took back in their places, undelivered.
    fn put_back_taken(&mut self, taken: impl IntoIterator<Item = (Taken, u64)>) {
        for (taken, _) in taken {
            let record = u64::from(matches!(taken, Taken::Log { .. }));
            counting::subtract(&mut self.leaving_records, record, "a queue's records leaving");
            let id = taken.message_id();
            if let Err(e) = self.put_back(taken, false) {
                // (Counting no delivery, only a record the log forgot it gave could fail.)
                tracing::error!(id, error = %e, "a message taken out could not be put back");
            }
        }
    }
}

/// The message a durable queue's log for `level` holds in `r`, with its queue id and priority.
fn stored(level: usize, r: &petrel_log::Record<'_>) -> Message {
    Message { id: message::queue_id(level, r.offset), priority: level as u8, ..message::from_record(r) }
}

/// Reads past the return markers at the head of a durable queue's group: they are not messages
/// (their counts were taken when they were written, or when the log was opened).
fn skip_markers(group: &mut ConsumerGroup, markers_unread: &mut u64) -> Result<(), BrokerError> {
    loop {
        let Some(head) = group.peek()? else { return Ok(()) };
        if message::control(&head).is_none() {
            return Ok(());
        }
        let offset = head.offset;
        let taken = match group.poll(1, Duration::ZERO) {
            Ok(batch) => batch.into_iter().next().map(|r| r.offset),
            // As many records out as the group allows: the marker waits for an acknowledgement.
            Err(petrel_log::Error::TooManyPending { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        assert_eq!(taken, Some(offset), "poll takes the record peek showed");
        group.ack(offset)?;
        counting::subtract(markers_unread, 1, "a queue's unread return markers");
    }
}
