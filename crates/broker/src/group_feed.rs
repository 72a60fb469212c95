//! A durable topic's consumer group as a subscriber reads it.
//!
//! `GroupReader` polls and acknowledges through the group's cursor. `GroupFeed` is the flow
//! control of a subscription over one: acknowledgements first (they make room), never more
//! than `max_pending` messages unacknowledged, and, when there is nothing to hand out, a wait
//! for the one thing that can change that — an acknowledgement, or an append to the topic.
//!
//! The feed's `step` reads the log and writes the cursor, so it blocks: a protocol runs it where
//! blocking is allowed. Its `wait` only awaits in-memory signals, so it may run anywhere.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use petrel_log::ConsumerGroup;
use tokio::sync::{Notify, mpsc, oneshot};

use crate::{BrokerError, MemoryHold, Message, message};

/// Counts a durable topic's appends and wakes the readers waiting for one; says how far the log
/// may be read (its publishes' records once on disk as their log's durability says: a group
/// never hands out a record that a crash, or its publish's failed sync, may take back), and when
/// the topic was removed (its readers' subscriptions end).
pub(crate) struct Appends {
    count: AtomicU64,
    notify: Notify,
    removed: AtomicBool,
    /// Records before this offset may be read.
    visible_end: AtomicU64,
}

impl Appends {
    /// For a log whose records before `visible_end` may be read.
    pub(crate) fn new(visible_end: u64) -> Appends {
        Appends {
            count: AtomicU64::new(0),
            notify: Notify::new(),
            removed: AtomicBool::new(false),
            visible_end: AtomicU64::new(visible_end),
        }
    }

    /// Records before `end` may be read now; readers are woken.
    pub(crate) fn visible_up_to(&self, end: u64) {
        self.visible_end.fetch_max(end, Ordering::AcqRel);
        self.happened();
    }

    fn visible_end(&self) -> u64 {
        self.visible_end.load(Ordering::Acquire)
    }

    pub(crate) fn happened(&self) {
        self.count.fetch_add(1, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// The topic is removed: its readers are woken to find it so.
    pub(crate) fn remove(&self) {
        self.removed.store(true, Ordering::Release);
        self.happened();
    }

    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    fn seen(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    /// Returns once the topic is removed.
    async fn removal(&self) {
        loop {
            let mut woken = pin!(self.notify.notified());
            woken.as_mut().enable();
            if self.is_removed() {
                return;
            }
            woken.await;
        }
    }

    /// Returns once an append has happened since the count was `seen`.
    async fn since(&self, seen: u64) {
        loop {
            let mut appended = pin!(self.notify.notified());
            appended.as_mut().enable();
            if self.seen() != seen {
                return;
            }
            appended.await;
        }
    }
}

/// Wakes whoever waits for a topic's groups to be let go (see `Topic::group_when_free`).
pub(crate) struct Released(pub(crate) Arc<Notify>);

impl Drop for Released {
    fn drop(&mut self) {
        self.0.notify_waiters();
    }
}

/// A consumer group of a durable topic: polls the topic's log and acknowledges by message id
/// (offset + 1). Blocking: its calls read the log and write the group's cursor.
pub struct GroupReader {
    // Declared before `released`: fields drop in order, so the group is let go in the log
    // before anyone waiting for it is woken.
    group: ConsumerGroup,
    topic: String,
    appends: Arc<Appends>,
    _released: Released,
}

impl GroupReader {
    pub(crate) fn new(group: ConsumerGroup, topic: String, appends: Arc<Appends>, released: Released) -> Self {
        GroupReader { group, topic, appends, _released: released }
    }

    /// Up to `max` messages, waiting up to `timeout` for the first; none while `max_pending`
    /// are unacknowledged.
    pub fn poll(&mut self, max: usize, timeout: Duration) -> Result<Vec<Message>, BrokerError> {
        self.poll_within(max, usize::MAX, timeout)
    }

    /// `poll`, of at most about `max_bytes` (at least one message): what is read is copied.
    pub fn poll_within(
        &mut self,
        max: usize,
        max_bytes: usize,
        timeout: Duration,
    ) -> Result<Vec<Message>, BrokerError> {
        match self.group.poll_before(max, max_bytes, timeout, self.appends.visible_end()) {
            Ok(batch) if batch.is_empty() => {
                // Read to the end: the segment it ends in may be one retention deleted (an idle
                // topic past its age cap, `Topic::wake_group_readers`), kept mapped, and its disk
                // with it, until a reader lets go.
                self.group.let_go_of_segments();
                Ok(Vec::new())
            }
            Ok(batch) => Ok(batch
                .into_iter()
                .map(|r| Message { destination: self.topic.clone(), ..message::from_record(&r) })
                .collect()),
            Err(petrel_log::Error::TooManyPending { .. }) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// Acknowledges messages by id; ids never delivered are ignored. Returns how many counted.
    pub fn ack(&mut self, ids: &[u64]) -> Result<u32, BrokerError> {
        let mut counted = 0;
        for &id in ids {
            let Some(offset) = message::offset_of(id) else { continue };
            match self.group.ack(offset) {
                Ok(()) => counted += 1,
                Err(petrel_log::Error::NotDelivered { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(counted)
    }

    /// Messages delivered and not yet acknowledged.
    pub fn pending(&self) -> usize {
        self.group.pending()
    }

    /// Messages out with this reader's subscriber: those delivered and not acknowledged, less
    /// those to be handed out again (an earlier subscription's, which may have been allowed more
    /// out than this one: they count here once handed out again).
    pub fn out(&self) -> usize {
        self.group.pending() - self.group.redeliveries()
    }
}

/// Acknowledgements sent to a feed, and where to say how many counted.
struct GroupAck {
    ids: Vec<u64>,
    counted: oneshot::Sender<u32>,
    /// The memory budget's hold on `ids` while they wait (up to a frame's worth a batch).
    _held: Option<MemoryHold>,
}

/// A subscription through a consumer group: hands out what the group may deliver now.
pub struct GroupFeed {
    reader: GroupReader,
    max_pending: usize,
    acks: mpsc::Receiver<GroupAck>,
    /// Acknowledgements taken while waiting, applied by the next step.
    received: Vec<GroupAck>,
    /// The topic's append count before the last read: an append since then is worth a look.
    appends_seen: u64,
    /// The last step found `max_pending` unacknowledged: only an acknowledgement helps.
    at_limit: bool,
}

/// The subscriber's side of a feed: sends acknowledgements. Dropping it ends the feed.
#[derive(Clone)]
pub struct GroupAcks(mpsc::Sender<GroupAck>);

impl GroupAcks {
    /// Hands `ids` to the feed; the receiver says how many counted once they are applied (it
    /// fails if the feed ended first). At most `max_acks_waiting` batches wait: past that,
    /// `Limit`. `held`: the memory budget's hold on the ids, let go once they are applied.
    pub fn send(&self, ids: Vec<u64>, held: Option<MemoryHold>) -> Result<oneshot::Receiver<u32>, BrokerError> {
        let (counted, answer) = oneshot::channel();
        self.0.try_send(GroupAck { ids, counted, _held: held }).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                BrokerError::Limit("too many acknowledgements waiting for this subscription; retry".into())
            }
            mpsc::error::TrySendError::Closed(_) => BrokerError::BadRequest("the subscription ended".into()),
        })?;
        Ok(answer)
    }
}

impl GroupFeed {
    /// A feed over `reader` with at most `max_pending` messages unacknowledged and at most
    /// `max_acks_waiting` batches of acknowledgements queued for it.
    pub fn new(reader: GroupReader, max_pending: usize, max_acks_waiting: usize) -> (GroupFeed, GroupAcks) {
        assert!(max_pending > 0 && max_acks_waiting > 0);
        let (tx, acks) = mpsc::channel(max_acks_waiting);
        let feed = GroupFeed { reader, max_pending, acks, received: Vec::new(), appends_seen: 0, at_limit: false };
        (feed, GroupAcks(tx))
    }

    /// Applies the acknowledgements received, then reads up to `max_batch` messages that may go
    /// out now, of about `max_bytes` at most (at least one message; they are copied, and wait in
    /// memory for the connection to take them): `None` when nothing may go; `wait`, then step
    /// again. Blocking.
    pub fn step(&mut self, max_batch: usize, max_bytes: usize) -> Result<Option<Vec<Message>>, BrokerError> {
        if self.reader.appends.is_removed() {
            return Err(BrokerError::TopicNotFound(self.reader.topic.clone()));
        }
        // Read before the poll, so that an append during it is seen by `wait`.
        self.appends_seen = self.reader.appends.seen();
        loop {
            match self.acks.try_recv() {
                Ok(ack) => self.received.push(ack),
                Err(mpsc::error::TryRecvError::Empty) => break,
                // The subscriber is gone (UNSUBSCRIBE, its connection's end): nothing more goes
                // out, and `wait` says the feed is over.
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.apply_received()?;
                    return Ok(None);
                }
            }
        }
        self.apply_received()?;
        let out = self.reader.out();
        self.at_limit = out >= self.max_pending;
        if self.at_limit {
            return Ok(None);
        }
        let messages = self.reader.poll_within((self.max_pending - out).min(max_batch), max_bytes, Duration::ZERO)?;
        Ok((!messages.is_empty()).then_some(messages))
    }

    /// Applies the acknowledgements received, answering each with how many counted.
    fn apply_received(&mut self) -> Result<(), BrokerError> {
        for GroupAck { ids, counted, .. } in std::mem::take(&mut self.received) {
            let n = self.reader.ack(&ids)?;
            let _ = counted.send(n);
        }
        Ok(())
    }

    /// Waits until a step may hand out more: an acknowledgement arrived, or the topic was
    /// appended to (unless the group is at its limit), or removed. `false`: the subscriber
    /// dropped its `GroupAcks`, so the subscription is over.
    pub async fn wait(&mut self) -> bool {
        let at_limit = self.at_limit;
        let appends = Arc::clone(&self.reader.appends);
        let seen = self.appends_seen;
        // At its limit only an acknowledgement helps, or the topic's removal (its end).
        let mut woken = pin!(async {
            match at_limit {
                true => appends.removal().await,
                false => appends.since(seen).await,
            }
        });
        let acks = &mut self.acks;
        let ack = std::future::poll_fn(|cx| {
            if let Poll::Ready(ack) = acks.poll_recv(cx) {
                return Poll::Ready(Some(ack));
            }
            if woken.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await;
        match ack {
            Some(Some(ack)) => {
                self.received.push(ack);
                true
            }
            Some(None) => false,
            None => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Broker, BrokerOptions, SeekTo};

    fn topic_with(messages: usize) -> (tempfile::TempDir, Arc<Broker>) {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), BrokerOptions::default()).unwrap());
        broker.create_topic("t", true).unwrap();
        for i in 0..messages {
            broker.publish("t", vec![Message::new(format!("m{i}").into_bytes())], 0).unwrap();
        }
        (dir, broker)
    }

    fn payloads(messages: &[Message]) -> Vec<String> {
        messages.iter().map(|m| String::from_utf8(m.payload.to_vec()).unwrap()).collect()
    }

    /// A subscription through a group that read an idle topic to its end is woken when the
    /// topic's age cap deletes its segment, and lets go of it: its disk goes back at once.
    #[tokio::test]
    async fn a_feed_lets_go_of_a_segment_the_age_cap_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let options = BrokerOptions { topic_max_age: Duration::from_secs(3600), ..BrokerOptions::default() };
        let broker = Broker::open(dir.path(), options).unwrap();
        broker.create_topic("t", true).unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        let old = now - 7200 * 1_000_000_000;
        broker.publish("t", (0..10).map(|i| Message::new(format!("m{i}").into_bytes())).collect(), old).unwrap();
        let reader = broker.topic("t").unwrap().group("g", Some(SeekTo::Oldest), 64).unwrap();
        let (mut feed, _acks) = GroupFeed::new(reader, 64, 4);
        let read = feed.step(256, usize::MAX).unwrap().expect("the ten messages");
        assert_eq!(read.len(), 10, "read, not acknowledged: the age cap deletes them all the same");
        let topic_dir = dir.path().join("topics/t").canonicalize().unwrap();
        let deleted_but_mapped = || {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            maps.lines().filter(|l| l.contains(topic_dir.to_str().unwrap()) && l.ends_with("(deleted)")).count()
        };
        broker.tick(now);
        assert!(deleted_but_mapped() > 0, "the feed's group still stands in the deleted segment");
        let woken = tokio::time::timeout(Duration::from_secs(10), feed.wait()).await;
        assert_eq!(woken.ok(), Some(true), "the deletion wakes the feed");
        assert!(feed.step(256, usize::MAX).unwrap().is_none(), "nothing new");
        assert_eq!(deleted_but_mapped(), 0, "and it let go of the segment");
    }

    /// A step copies what it reads and holds it until the connection takes it: large
    /// messages come a few at a time (at least one), not a whole batch of them.
    #[tokio::test]
    async fn a_feed_step_reads_about_max_bytes_at_most() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        broker.create_topic("t", true).unwrap();
        broker.publish("t", (0..10).map(|_| Message::new(vec![1u8; 100_000])).collect(), 0).unwrap();
        let reader = broker.topic("t").unwrap().group("g", Some(SeekTo::Oldest), 64).unwrap();
        let (mut feed, _acks) = GroupFeed::new(reader, 64, 4);
        let first = feed.step(256, 250_000).unwrap().unwrap();
        assert_eq!(first.len(), 3, "past 250,000 bytes with the third");
        let one = feed.step(256, 1).unwrap().unwrap();
        assert_eq!(one.len(), 1, "one however large");
        let rest = feed.step(256, usize::MAX).unwrap().unwrap();
        assert_eq!(rest.len(), 6);
    }

    /// A feed at its limit of unacknowledged messages still ends when its topic is removed (it
    /// waited for an acknowledgement only).
    #[tokio::test]
    async fn a_feed_at_its_limit_ends_when_its_topic_is_removed() {
        let (_dir, broker) = topic_with(3);
        let reader = broker.topic("t").unwrap().group("g", Some(SeekTo::Oldest), 1).unwrap();
        let (mut feed, _acks) = GroupFeed::new(reader, 1, 4);
        assert_eq!(feed.step(256, usize::MAX).unwrap().unwrap().len(), 1);
        assert!(feed.step(256, usize::MAX).unwrap().is_none(), "at its limit");
        let remove = {
            let broker = Arc::clone(&broker);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                broker.remove_topic("t").unwrap();
            })
        };
        let woken = tokio::time::timeout(Duration::from_secs(10), feed.wait()).await;
        assert_eq!(woken.ok(), Some(true), "the removal wakes it");
        let end = feed.step(256, usize::MAX).expect_err("its topic is gone");
        assert!(matches!(end, BrokerError::TopicNotFound(_)), "{end}");
        remove.await.unwrap();
    }

    #[tokio::test]
    async fn a_feed_hands_out_at_most_max_pending_until_acknowledged() {
        let (_dir, broker) = topic_with(5);
        let reader = broker.topic("t").unwrap().group("g", Some(SeekTo::Oldest), 2).unwrap();
        let (mut feed, acks) = GroupFeed::new(reader, 2, 4);
        let first = feed.step(256, usize::MAX).unwrap().expect("two messages may go out");
        assert_eq!(payloads(&first), ["m0", "m1"]);
        assert!(feed.step(256, usize::MAX).unwrap().is_none(), "two unacknowledged: nothing more");
        // At the limit, an append does not end the wait; an acknowledgement does.
        broker.publish("t", vec![Message::new(&b"m5"[..])], 0).unwrap();
        let waiting = tokio::time::timeout(Duration::from_millis(50), feed.wait()).await;
        assert!(waiting.is_err(), "an append does not help a group at its limit");
        let counted = acks.send(vec![first[0].id, 999], None).unwrap();
        assert!(feed.wait().await, "an acknowledgement ends the wait");
        let next = feed.step(256, usize::MAX).unwrap().expect("room for one");
        assert_eq!(counted.await.unwrap(), 1, "the id never delivered does not count");
        assert_eq!(payloads(&next), ["m2"]);
        // The subscriber acknowledges all it has and goes (UNSUBSCRIBE): room, but for nobody.
        let counted = acks.send(vec![first[1].id, next[0].id], None).unwrap();
        drop(acks);
        assert!(feed.step(256, usize::MAX).unwrap().is_none(), "its subscriber gone, nothing more goes out");
        assert_eq!(counted.await.unwrap(), 2, "its last acknowledgements applied");
        assert!(!feed.wait().await, "the subscriber's end dropped: the feed is over");
    }

    /// Messages a subscription left unacknowledged with a larger buffer, some held by the group
    /// (acknowledged around), are handed out again to the next subscription with a smaller one,
    /// one buffer's worth at a time (its limit was asserted, and the feed ended).
    #[test]
    fn a_smaller_buffer_hands_out_again_what_a_larger_one_left() {
        let (_dir, broker) = topic_with(7);
        let topic = broker.topic("t").unwrap();
        {
            let (mut feed, acks) = GroupFeed::new(topic.group("g", Some(SeekTo::Oldest), 3).unwrap(), 3, 4);
            let mut step = |ack: &[usize]| {
                let got = feed.step(256, usize::MAX).unwrap().unwrap();
                let ids: Vec<u64> = ack.iter().map(|&i| got[i].id).collect();
                if !ids.is_empty() {
                    acks.send(ids, None).unwrap();
                }
                payloads(&got)
            };
            assert_eq!(step(&[1, 2]), ["m0", "m1", "m2"]);
            assert_eq!(step(&[1]), ["m3", "m4"]);
            assert_eq!(step(&[0]), ["m5"]);
            assert_eq!(step(&[]), ["m6"]);
        }
        let (mut feed, acks) = GroupFeed::new(topic.group("g", None, 1).unwrap(), 1, 4);
        let mut again = Vec::new();
        while let Some(got) = feed.step(256, usize::MAX).unwrap() {
            assert_eq!(got.len(), 1, "one out at a time");
            acks.send(vec![got[0].id], None).unwrap();
            again.extend(payloads(&got));
        }
        again.sort();
        assert_eq!(again, ["m0", "m3", "m6"], "each left unacknowledged, handed out again");
    }

    #[test]
    fn acknowledgements_past_the_feed_s_limit_are_refused_until_it_takes_them() {
        let (_dir, broker) = topic_with(2);
        let reader = broker.topic("t").unwrap().group("g", Some(SeekTo::Oldest), 8).unwrap();
        let (mut feed, acks) = GroupFeed::new(reader, 8, 1);
        let delivered = feed.step(256, usize::MAX).unwrap().unwrap();
        let first = acks.send(vec![delivered[0].id], None).unwrap();
        assert!(
            matches!(acks.send(vec![delivered[1].id], None), Err(BrokerError::Limit(_))),
            "one batch waits at most"
        );
        assert!(feed.step(256, usize::MAX).unwrap().is_none(), "nothing new; the acknowledgement is applied");
        assert_eq!(first.blocking_recv().unwrap(), 1);
        let second = acks.send(vec![delivered[1].id], None).unwrap();
        feed.step(256, usize::MAX).unwrap();
        assert_eq!(second.blocking_recv().unwrap(), 1, "room again once the feed took the first");
        drop(feed);
        assert!(matches!(acks.send(vec![1], None), Err(BrokerError::BadRequest(_))), "the feed has ended");
    }

    #[tokio::test]
    async fn a_caught_up_feed_wakes_for_an_append_made_after_its_last_step() {
        let (_dir, broker) = topic_with(0);
        let reader = broker.topic("t").unwrap().group("g", None, 16).unwrap();
        let (mut feed, _acks) = GroupFeed::new(reader, 16, 4);
        assert!(feed.step(256, usize::MAX).unwrap().is_none(), "nothing published yet");
        // Published between the step and the wait: the wait must not miss it.
        broker.publish("t", vec![Message::new(&b"late"[..])], 0).unwrap();
        assert!(feed.wait().await);
        assert_eq!(payloads(&feed.step(256, usize::MAX).unwrap().unwrap()), ["late"]);
    }

    #[tokio::test]
    async fn a_group_held_by_an_ending_subscription_is_taken_once_let_go() {
        let (_dir, broker) = topic_with(1);
        let topic = broker.topic("t").unwrap();
        let held = topic.group("g", Some(SeekTo::Oldest), 8).unwrap();
        let run = |open: crate::topic::OpenGroup| std::future::ready(open());
        let gave_up = topic.group_when_free("g", None, 8, tokio::time::sleep(Duration::from_millis(20)), run).await;
        assert!(matches!(gave_up, Err(BrokerError::Held(_))), "still held when the wait ran out");
        let letting_go = tokio::spawn(async move {
            tokio::task::yield_now().await;
            drop(held);
        });
        let taken = topic.group_when_free("g", None, 8, std::future::pending(), run).await;
        assert!(taken.is_ok(), "taken once the other reader dropped it: {:?}", taken.err());
        letting_go.await.unwrap();
    }
}
