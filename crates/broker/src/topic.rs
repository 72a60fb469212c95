//! Topics: every current subscriber gets every message published (at most once: a subscriber
//! that is gone misses what is published meanwhile). Each subscriber has a bounded buffer; one
//! that falls a whole buffer behind is ended, with the reason, and counted — a slow subscriber
//! never makes the server hold unbounded memory, and never slows the others.
//!
//! A durable topic also keeps a `petrel-log` of everything published: named consumer groups
//! read it from any offset or time, at their own pace, acknowledge, and resume where they left
//! off after a disconnect or a restart (at least once).

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::Poll;

use petrel_log::{GroupOptions, SeekTo, SharedLog};
use tokio::sync::{Notify, mpsc};

use crate::group_feed::{Appends, GroupReader};
use crate::{BrokerError, ConnId, MemoryBudget, Message, message};
use petrel_proto::{GroupStats, TopicStats};

/// Consumer groups a durable topic keeps at most (`Topic::group`).
pub const MAX_GROUPS_PER_TOPIC: usize = 1024;

pub struct Topic {
    pub name: String,
    /// A durable topic's log.
    pub(crate) log: Option<SharedLog>,
    subscribers: Mutex<Vec<Subscriber>>,
    published: AtomicU64,
    delivered: AtomicU64,
    /// Subscribers ended for falling behind.
    slow: AtomicU64,
    /// Counted and woken after each append to a durable topic's log: group readers wait on it.
    appends: Arc<Appends>,
    /// Woken when a group reader is let go: a subscriber may be waiting for its group.
    released: Arc<Notify>,
    /// Set (under `subscribers`' lock) when the topic is removed: a subscription made after, by
    /// a SUBSCRIBE that found the topic just before, ends at once for this reason.
    removed: OnceLock<Ended>,
    /// A durable topic's publishes each take a turn as they append (the next turn to give), and
    /// hand their messages to the live subscribers in turn once they are on disk (`Turn`): the
    /// wait for the disk holds neither the subscribers' lock (a subscribe, a listing, a
    /// disconnect) nor the next publish, whose append joins the same sync.
    appending: Mutex<u64>,
    /// The turn whose messages go to the live subscribers next.
    delivering: Mutex<u64>,
    turn_passed: Condvar,
}

/// The opening of a consumer group, for `Topic::group_when_free`'s caller to run.
pub type OpenGroup = Box<dyn FnOnce() -> Result<GroupReader, BrokerError> + Send>;

/// A durable topic's publish's turn to hand its messages to the live subscribers: `wait` for it;
/// dropped, it passes to the next (waited for first if it was not: a publish that failed, or
/// panicked, between its append and its delivery must not hold up the ones after it).
struct Turn<'t> {
    topic: &'t Topic,
    turn: u64,
    taken: bool,
}

impl Turn<'_> {
    fn wait(&mut self) {
        let mut delivering = self.topic.delivering.lock().unwrap_or_else(|e| e.into_inner());
        while *delivering != self.turn {
            delivering = self.topic.turn_passed.wait(delivering).unwrap_or_else(|e| e.into_inner());
        }
        self.taken = true;
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if !self.taken {
            self.wait();
        }
        *self.topic.delivering.lock().unwrap_or_else(|e| e.into_inner()) = self.turn + 1;
        self.topic.turn_passed.notify_all();
    }
}

struct Subscriber {
    id: u64,
    conn: ConnId,
    tx: mpsc::Sender<Arc<Delivered>>,
    ended: Arc<OnceLock<Ended>>,
    /// Bytes of messages sent on `tx` and not yet taken, at most `max_bytes`.
    queued: Arc<Queued>,
    max_bytes: u64,
}

/// A subscriber whose budget is full is ended only if it would hold more than this: one that
/// keeps up still gets its messages (the budget may be overshot by this per subscriber, not by
/// a large message each: 1,024 subscribers of one stalled connection took 16 MiB each).
const SMALL_BACKLOG: u64 = 1 << 20;

/// The bytes waiting for one subscriber, counted in the server's memory budget too. Every
/// `add` is matched by one `take`: by the receiver once it sent them on (`Subscription::sent`),
/// by the publisher when the receiver is gone, or by the subscription's end for what it never
/// took.
struct Queued {
    bytes: AtomicU64,
    budget: Arc<MemoryBudget>,
}

impl Queued {
    /// Counts `size` bytes more, if the budget has room or this subscriber holds little.
    fn add(&self, size: u64) -> bool {
        let small = self.bytes.load(Ordering::Relaxed) + size <= SMALL_BACKLOG;
        if !self.budget.reserve(size, small) {
            return false;
        }
        self.bytes.fetch_add(size, Ordering::Relaxed);
        true
    }

    fn take(&self, size: u64) {
        crate::counting::subtract_shared(&self.bytes, size, "a subscriber's queued bytes");
        self.budget.release(size);
    }

    fn load(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// A published message as every subscriber gets it: shared, with room for a protocol's encoding
/// of it, made by the first subscriber's connection and reused by all the others.
pub struct Delivered {
    pub message: Message,
    pub encoded: OnceLock<bytes::Bytes>,
}

/// What a message waiting for a subscriber takes of the memory budget besides its bytes: the
/// shared `Delivered` and its counts, the subscriber's slot for it, allocation rounding. (Counted
/// as its bytes alone, a subscriber reading nothing held a million empty messages, ~350 MB,
/// counted as nothing.)
const DELIVERED_OVERHEAD: u64 = (std::mem::size_of::<Delivered>() + 16 + 8 + 32) as u64;

impl Delivered {
    /// What it takes of a subscriber's bytes (`max_subscriber_bytes`) and the memory budget.
    fn held_size(&self) -> u64 {
        self.message.size() + DELIVERED_OVERHEAD
    }
}

/// Why the broker ended a subscription.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It fell a whole buffer behind.
    TooSlow(String),
    TopicRemoved(String),
}

/// One subscriber's end: messages arrive on `messages`; when it yields `None`, `ended` says why
/// the broker ended it (unset: it was unsubscribed).
pub struct Subscription {
    pub id: u64,
    messages: mpsc::Receiver<Arc<Delivered>>,
    pub ended: Arc<OnceLock<Ended>>,
    queued: Arc<Queued>,
    /// Bytes of messages received and not yet `sent`: still counted as queued.
    received: u64,
}

impl Subscription {
    /// The next message, waiting for one; `None` once the subscription ended. Its bytes stay
    /// counted (the subscriber's and the memory budget) until `sent`.
    pub async fn recv(&mut self) -> Option<Arc<Delivered>> {
        let m = self.messages.recv().await?;
        self.received += m.held_size();
        Some(m)
    }

    /// The next message if one is waiting (counted until `sent`, as `recv`'s).
    pub fn try_recv(&mut self) -> Option<Arc<Delivered>> {
        let m = self.messages.try_recv().ok()?;
        self.received += m.held_size();
        Some(m)
    }

    /// The messages received so far are on their way (in the connection's bounded outbox):
    /// their bytes are given back. Until then a subscriber whose connection does not read
    /// holds them counted, so that many such subscribers cannot hold a large message each
    /// outside the budget.
    pub fn sent(&mut self) {
        self.queued.take(std::mem::take(&mut self.received));
    }

    /// `sent`, but for `kept`, received and held back for the next frame: still counted.
    pub fn sent_but(&mut self, kept: &Delivered) {
        let kept = kept.held_size();
        self.queued.take(self.received - kept);
        self.received = kept;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // No more sends after this (the channel is closed), but one may be under way: drain
        // what arrived and give its bytes back; a publisher whose send fails takes its own.
        self.messages.close();
        while let Ok(m) = self.messages.try_recv() {
            self.queued.take(m.held_size());
        }
        self.sent();
    }
}

impl Topic {
    /// Wakes the topic's consumer-group readers as an append would: after retention deleted
    /// segments, so that one standing in a deleted segment moves on and lets go of it (a file
    /// still mapped keeps its disk) rather than at the next publish.
    pub(crate) fn wake_group_readers(&self) {
        self.appends.happened();
    }

    /// The topic is removed: its consumer-group subscriptions end at their next step (woken
    /// now), and no new one begins.
    pub(crate) fn end_group_readers(&self) {
        self.appends.remove();
    }

    pub(crate) fn new(name: String, log: Option<SharedLog>) -> Topic {
        let visible_end = log.as_ref().map_or(0, SharedLog::next_offset);
        Topic {
            name,
            log,
            subscribers: Mutex::new(Vec::new()),
            published: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            slow: AtomicU64::new(0),
            appends: Arc::new(Appends::new(visible_end)),
            released: Arc::default(),
            removed: OnceLock::new(),
            appending: Mutex::new(0),
            delivering: Mutex::new(0),
            turn_passed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Subscriber>> {
        self.subscribers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A subscriber for whom the broker holds up to `buffer` messages and `max_bytes` bytes.
    pub(crate) fn subscribe(
        &self,
        id: u64,
        conn: ConnId,
        buffer: usize,
        max_bytes: u64,
        budget: Arc<MemoryBudget>,
    ) -> Subscription {
        let (tx, messages) = mpsc::channel(buffer.max(1));
        let ended = Arc::new(OnceLock::new());
        let queued = Arc::new(Queued { bytes: AtomicU64::new(0), budget });
        let subscriber = Subscriber { id, conn, tx, ended: Arc::clone(&ended), queued: Arc::clone(&queued), max_bytes };
        let mut subscribers = self.lock();
        match self.removed.get() {
            Some(reason) => drop(ended.set(reason.clone())), // (its sender dropped: it ends)
            None => subscribers.push(subscriber),
        }
        drop(subscribers);
        Subscription { id, messages, ended, queued, received: 0 }
    }

    /// Makes the next sync of a durable topic's log fail as a disk's would, for tests
    /// (`tests/sync_failures.rs`).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn fail_next_syncs(&self) {
        self.log.iter().for_each(SharedLog::fail_next_sync);
    }

    pub fn is_durable(&self) -> bool {
        self.log.is_some()
    }

    /// Appends the messages to a durable topic's log (each gets its offset + 1 as id), then
    /// hands each to every live subscriber; returns how many subscribers got them all.
    /// A message marked `durable` is on disk before this returns, whatever the log's policy; a
    /// live topic refuses it. Blocks on the disk when the topic is durable.
    pub(crate) fn publish(&self, mut messages: Vec<Message>) -> Result<u32, BrokerError> {
        let durable_asked = messages.iter().any(|m| m.durable);
        if durable_asked && self.log.is_none() {
            return Err(BrokerError::BadRequest(format!(
                "topic {:?} is live (nothing is kept): a message marked durable needs a durable topic",
                crate::shown(&self.name)
            )));
        }
        let mut turn = None;
        if let Some(log) = &self.log {
            let range = {
                let mut next = self.appending.lock().unwrap_or_else(|e| e.into_inner());
                let range = message::append_unsynced(log, &messages)?;
                turn = Some(Turn { topic: self, turn: *next, taken: false });
                *next += 1;
                range
            };
            // Other publishes append meanwhile, and the next sync covers them too.
            let synced = match range.end.checked_sub(1) {
                Some(last) => log.wait_durable(last).and_then(|()| match durable_asked {
                    true => log.make_durable(last),
                    false => Ok(()),
                }),
                None => Ok(()),
            };
            turn.as_mut().expect("taken above").wait();
            synced?;
            let first = range.start;
            for (i, m) in messages.iter_mut().enumerate() {
                m.id = message::id_of(first + i as u64);
                m.durable = false; // asked on the way in; not carried by deliveries
            }
            // In turn: the groups read no record before those ahead of it are on disk too.
            self.appends.visible_up_to(range.end);
        }
        let mut subscribers = self.lock();
        let messages: Vec<Arc<Delivered>> =
            messages.into_iter().map(|message| Arc::new(Delivered { message, encoded: OnceLock::new() })).collect();
        let mut delivered = 0;
        subscribers.retain(|s| {
            for m in &messages {
                let size = m.held_size();
                // Too slow: a whole buffer of bytes waits for it, or of messages.
                let reason = if s.max_bytes != 0 && s.queued.load() + size > s.max_bytes {
                    format!("subscriber fell {} bytes behind on topic {}", s.max_bytes, self.name)
                } else if !s.queued.add(size) {
                    // (Counted before it is sent, so the receiver's subtraction never comes first.)
                    format!(
                        "subscriber holds {} bytes of topic {} and the server's memory budget (max_memory_bytes {}) is full",
                        s.queued.load(),
                        self.name,
                        s.queued.budget.max()
                    )
                } else {
                    match s.tx.try_send(Arc::clone(m)) {
                        Ok(()) => {
                            delivered += 1;
                            continue;
                        }
                        Err(e) => {
                            s.queued.take(size);
                            match e {
                                mpsc::error::TrySendError::Full(_) => format!(
                                    "subscriber fell {} messages behind on topic {}",
                                    s.tx.max_capacity(),
                                    self.name
                                ),
                                mpsc::error::TrySendError::Closed(_) => return false,
                            }
                        }
                    }
                };
                let _ = s.ended.set(Ended::TooSlow(reason));
                self.slow.fetch_add(1, Ordering::Relaxed);
                tracing::info!(topic = %self.name, subscription = s.id, "slow subscriber ended");
                return false;
            }
            true
        });
        self.published.fetch_add(messages.len() as u64, Ordering::Relaxed);
        self.delivered.fetch_add(delivered, Ordering::Relaxed);
        let reached = subscribers.len() as u32;
        drop(subscribers);
        drop(turn); // (once delivered: the next publish's messages come after these)
        Ok(reached)
    }

    /// Opens consumer group `group` of a durable topic, positioned by `from` (`None`: where the
    /// group stands; a new group starts at the newest message).
    pub fn group(&self, group: &str, from: Option<SeekTo>, max_pending: usize) -> Result<GroupReader, BrokerError> {
        let Some(log) = &self.log else {
            return Err(BrokerError::BadRequest(format!(
                "topic {} is not durable: it has no consumer groups",
                self.name
            )));
        };
        crate::check_name(group)?;
        if self.appends.is_removed() {
            return Err(BrokerError::TopicNotFound(self.name.clone()));
        }
        // Each group is a cursor file, a row of the topic's status and series on /metrics, kept
        // until an admin removes it: a client naming new groups again and again is stopped.
        let options = GroupOptions {
            max_pending,
            start: SeekTo::Newest,
            max_groups: MAX_GROUPS_PER_TOPIC,
            ..GroupOptions::default()
        };
        let mut g = log.group(group, options).map_err(|e| match e {
            petrel_log::Error::TooManyGroups { groups, .. } => BrokerError::Limit(format!(
                "topic {} has {groups} consumer groups, the most a topic keeps: remove some (DELETE /api/v1/topics/{}/groups/NAME) before naming a new one",
                self.name, self.name
            )),
            e => e.into(),
        })?;
        // From here whoever lets the group go wakes a subscriber waiting for it.
        let released = crate::group_feed::Released(Arc::clone(&self.released));
        if let Some(to) = from
            && let Err(e) = g.seek(to)
        {
            drop(g); // let go, then wake
            drop(released);
            return Err(e.into());
        }
        Ok(GroupReader::new(g, self.name.clone(), Arc::clone(&self.appends), released))
    }

    /// `group`, waiting while a subscription that is ending still holds it, until `stop`
    /// finishes (then the group-in-use error). For a client that reconnects and subscribes again
    /// before its old connection's subscription has let the group go. Each attempt opens the
    /// group's cursor (files, perhaps a sync, an index for a seek by time): `blocking` runs it
    /// where blocking is allowed (the server's blocking threads).
    pub async fn group_when_free<B, F>(
        self: &Arc<Self>,
        group: &str,
        from: Option<SeekTo>,
        max_pending: usize,
        stop: impl Future<Output = ()>,
        blocking: B,
    ) -> Result<GroupReader, BrokerError>
    where
        B: Fn(OpenGroup) -> F,
        F: Future<Output = Result<GroupReader, BrokerError>>,
    {
        let mut stop = pin!(stop);
        loop {
            let mut released = pin!(self.released.notified());
            // Registered before the attempt: a reader let go after it still wakes us.
            released.as_mut().enable();
            let (topic, name) = (Arc::clone(self), group.to_owned());
            match blocking(Box::new(move || topic.group(&name, from, max_pending))).await {
                Err(BrokerError::Storage(petrel_log::Error::GroupInUse(_))) => {}
                other => return other,
            }
            let stopped = std::future::poll_fn(|cx| {
                if stop.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(true);
                }
                released.as_mut().poll(cx).map(|()| false)
            })
            .await;
            if stopped {
                return Err(self.group_in_use(group));
            }
        }
    }

    /// A durable topic's consumer groups (none for a topic without a log).
    /// Where each consumer group of a durable topic stands (none for a live topic).
    pub fn groups(&self) -> Vec<GroupStats> {
        let Some(log) = &self.log else { return Vec::new() };
        let next_offset = log.next_offset();
        log.groups()
            .into_iter()
            .map(|g| GroupStats {
                lag: g.unacknowledged(next_offset),
                name: g.name,
                committed: g.committed,
                next_offset,
                open: g.open,
            })
            .collect()
    }

    /// Moves an existing group (not subscribed now) to `to`: what comes before counts as
    /// acknowledged, what comes after as never delivered. Returns the offset it now stands at.
    pub fn reset_group(&self, group: &str, to: SeekTo) -> Result<u64, BrokerError> {
        let log = self.log_of_groups()?;
        match log.groups().iter().find(|g| g.name == group) {
            None => return Err(self.no_group(group)),
            Some(g) if g.open => return Err(self.group_in_use(group)),
            Some(_) => {}
        }
        let options = GroupOptions { start: SeekTo::Newest, ..GroupOptions::default() };
        let mut g = log.group(group, options).map_err(|e| match e {
            petrel_log::Error::GroupInUse(_) => self.group_in_use(group),
            e => e.into(),
        })?;
        let at = g.seek(to);
        drop(g);
        // Let go: a subscriber that waited for the group meanwhile is woken.
        self.released.notify_waiters();
        Ok(at?)
    }

    fn no_group(&self, group: &str) -> BrokerError {
        BrokerError::GroupNotFound { topic: self.name.clone(), group: group.to_owned() }
    }

    /// Deletes a group (not while subscribed): its position is forgotten.
    pub fn remove_group(&self, group: &str) -> Result<(), BrokerError> {
        let log = self.log_of_groups()?;
        match log.groups().iter().find(|g| g.name == group) {
            None => Err(self.no_group(group)),
            Some(g) if g.open => Err(self.group_in_use(group)),
            Some(_) => Ok(log.delete_group(group)?),
        }
    }

    fn log_of_groups(&self) -> Result<&SharedLog, BrokerError> {
        self.log.as_ref().ok_or_else(|| {
            BrokerError::BadRequest(format!("topic {} is not durable: it has no consumer groups", self.name))
        })
    }

    fn group_in_use(&self, group: &str) -> BrokerError {
        BrokerError::Held(format!("consumer group {group} of topic {} is subscribed now", self.name))
    }

    /// The topic is removed: every subscription ends for `reason`, and so does any made after.
    pub(crate) fn end_subscriptions(&self, reason: Ended) {
        let mut subscribers = self.lock();
        let _ = self.removed.set(reason.clone());
        for s in subscribers.drain(..) {
            let _ = s.ended.set(reason.clone());
        }
    }

    /// Removes subscriptions matching `which`; they end for `reason` if given.
    pub(crate) fn remove(&self, which: impl Fn(u64, ConnId) -> bool, reason: Option<Ended>) {
        self.lock().retain(|s| {
            let gone = which(s.id, s.conn);
            if gone && let Some(reason) = &reason {
                let _ = s.ended.set(reason.clone());
            }
            !gone
        });
    }

    /// The topic's figures and groups, as TOPIC_STATUS answers them.
    pub fn status(&self) -> TopicStats {
        TopicStats {
            durable: self.is_durable(),
            subscribers: self.lock().len() as u64,
            published: self.published.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            slow_subscribers_ended: self.slow.load(Ordering::Relaxed),
            groups: self.groups(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A consumer group reads a publish's records only once the publish made them visible (on
    /// disk as the log's durability says), not as soon as they are appended: a crash, or the
    /// publish's failed sync, could take back what it was handed, and its publisher retries.
    #[test]
    fn a_group_reads_no_record_its_publish_has_not_made_visible() {
        let dir = tempfile::tempdir().unwrap();
        let log = petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let topic = Topic::new("t".into(), Some(log.clone()));
        let mut group = topic.group("g", Some(SeekTo::Oldest), 100).unwrap();
        topic.publish(vec![Message::new(&b"one"[..])]).unwrap();
        // A publish that appended and waits for its sync.
        let range = message::append_unsynced(&log, &[Message::new(&b"two"[..])]).unwrap();
        let read = |group: &mut GroupReader| -> Vec<bytes::Bytes> {
            group.poll(10, std::time::Duration::ZERO).unwrap().into_iter().map(|m| m.payload).collect()
        };
        assert_eq!(read(&mut group), [&b"one"[..]]);
        assert!(read(&mut group).is_empty(), "appended, not yet synced");
        topic.appends.visible_up_to(range.end);
        assert_eq!(read(&mut group), [&b"two"[..]]);
    }

    /// A SUBSCRIBE that found the topic just before it was removed: its subscription ends at
    /// once, saying why (it was added to the removed topic and then never heard of again).
    #[test]
    fn a_subscription_made_after_its_topic_was_removed_ends_at_once() {
        let topic = Topic::new("t".into(), None);
        let budget = Arc::new(MemoryBudget::new(1 << 20));
        let before = topic.subscribe(1, 1, 8, 0, Arc::clone(&budget));
        topic.end_subscriptions(Ended::TopicRemoved("topic t was removed".into()));
        let mut after = topic.subscribe(2, 1, 8, 0, budget);
        assert!(matches!(before.ended.get(), Some(Ended::TopicRemoved(_))));
        assert!(matches!(after.ended.get(), Some(Ended::TopicRemoved(_))));
        assert!(after.try_recv().is_none());
        assert_eq!(topic.status().subscribers, 0);
    }
}
