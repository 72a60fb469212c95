//! Queue semantics, with no sockets: the broker alone.

use std::time::Duration;

use petrel_broker::{Broker, BrokerError, BrokerOptions, Message, Offered, QueueChanges, QueueConfig};

const MS: u64 = 1_000_000;
const VIS: Option<Duration> = Some(Duration::from_millis(100));

fn payloads(ds: &[petrel_broker::Delivery]) -> Vec<Vec<u8>> {
    ds.iter().map(|d| d.message.payload.to_vec()).collect()
}

fn msgs(items: &[&str]) -> Vec<Message> {
    items.iter().map(|s| Message::new(s.as_bytes().to_vec())).collect()
}

fn both() -> [QueueConfig; 2] {
    [QueueConfig::default(), QueueConfig { durable: true, ..QueueConfig::default() }]
}

#[test]
fn fifo_and_competing_consumers_in_memory_and_on_disk() {
    for config in both() {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", config.clone(), None).unwrap();
        assert_eq!(b.offer("q", msgs(&["a", "b", "c", "d"]), 1).unwrap(), (1, 4));
        let first = b.poll("q", 2, None, 1, 2).unwrap();
        let second = b.poll("q", 5, None, 2, 2).unwrap();
        assert_eq!(payloads(&first), [b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(payloads(&second), [b"c".to_vec(), b"d".to_vec()]);
        assert_eq!(first[0].message.id, 1);
        assert_eq!(first[0].message.destination, "q");
        assert!(b.poll("q", 1, None, 1, 3).unwrap().is_empty());
        assert_eq!(b.queue("q").unwrap().counters().total_polled, 4, "{config:?}");
    }
}

#[test]
fn tentative_reads_come_back_on_abort_timeout_and_disconnect() {
    for config in both() {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", config.clone(), None).unwrap();
        b.offer("q", msgs(&["a", "b", "c"]), 0).unwrap();
        let d = b.poll("q", 1, VIS, 7, 0).unwrap();
        assert_eq!(payloads(&d), [b"a".to_vec()]);
        assert_eq!(b.abort("q", &[d[0].handle], 8, 0, 2).unwrap(), 0, "only the taker can abort");
        assert_eq!(b.abort("q", &[d[0].handle], 7, 0, 2).unwrap(), 1);
        // Back at the head.
        let d = b.poll("q", 1, VIS, 7, 0).unwrap();
        assert_eq!(payloads(&d), [b"a".to_vec()]);
        // The visibility timeout passes: back again.
        b.tick(200 * MS);
        let d = b.poll("q", 1, VIS, 9, 200 * MS).unwrap();
        assert_eq!(payloads(&d), [b"a".to_vec()]);
        // The consumer disconnects: back again.
        b.disconnect(9, 1);
        let d = b.poll("q", 1, VIS, 10, 300 * MS).unwrap();
        assert_eq!(payloads(&d), [b"a".to_vec()]);
        assert_eq!(b.ack("q", &[d[0].handle], 10).unwrap(), 1);
        assert_eq!(b.ack("q", &[d[0].handle], 10).unwrap(), 0, "acked once");
        assert_eq!(payloads(&b.poll("q", 5, None, 10, 0).unwrap()), [b"b".to_vec(), b"c".to_vec()], "{config:?}");
        let stats = b.queue("q").unwrap().counters();
        assert_eq!((stats.items, stats.in_flight), (0, 0));
    }
}

#[test]
fn temporary_queues_vanish_with_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let temp = QueueConfig { temporary: true, ..QueueConfig::default() };
    assert!(matches!(b.create_queue("reply.1", temp.clone(), None), Err(BrokerError::BadRequest(_))));
    b.create_queue("reply.1", temp, Some(42)).unwrap();
    b.offer("reply.1", msgs(&["x"]), 0).unwrap();
    b.disconnect(41, 1);
    assert!(b.queue("reply.1").is_some());
    b.disconnect(42, 1);
    assert!(b.queue("reply.1").is_none());
    drop(b);
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert!(b.queue_names().is_empty(), "temporary queues are not persisted");
}

#[test]
fn bounded_queues_refuse_and_circular_ones_drop_the_oldest() {
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("bounded", QueueConfig { max_items: 2, durable, ..QueueConfig::default() }, None).unwrap();
        b.create_queue("ring", QueueConfig { max_items: 2, circular: true, durable, ..QueueConfig::default() }, None)
            .unwrap();
        b.offer("bounded", msgs(&["1", "2"]), 0).unwrap();
        assert!(matches!(b.offer("bounded", msgs(&["3"]), 0), Err(BrokerError::Full(_))));
        assert!(matches!(b.offer("bounded", msgs(&["3", "4"]), 0), Err(BrokerError::Full(_))), "all or none");
        // More than the queue can ever hold: refused at once as such, not as full.
        assert!(matches!(b.offer("bounded", msgs(&["3", "4", "5"]), 0), Err(BrokerError::NeverFits(_))));
        b.offer("ring", msgs(&["1", "2"]), 0).unwrap();
        b.offer("ring", msgs(&["3"]), 0).unwrap();
        assert_eq!(b.queue("ring").unwrap().counters().dropped, 1);
        assert_eq!(
            payloads(&b.poll("ring", 5, None, 1, 0).unwrap()),
            [b"2".to_vec(), b"3".to_vec()],
            "durable: {durable}"
        );
        // A circular queue offered more than it holds keeps the newest, as its name promises.
        b.offer("ring", msgs(&["4"]), 0).unwrap();
        assert_eq!(b.offer("ring", msgs(&["5", "6", "7"]), 0).unwrap().1, 2);
        assert_eq!(b.queue("ring").unwrap().counters().dropped, 3);
        assert_eq!(payloads(&b.poll("ring", 5, None, 1, 0).unwrap()), [b"6".to_vec(), b"7".to_vec()]);
    }
}

/// A circular queue drops waiting messages only when that makes room: an offer that would not
/// fit beside what is delayed, or out with consumers, is refused with nothing dropped (the
/// waiting messages were dropped, and the offer refused all the same).
#[test]
fn a_circular_queue_drops_nothing_for_an_offer_it_cannot_take() {
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        let ring = QueueConfig { max_items: 2, circular: true, durable, ..QueueConfig::default() };
        b.create_queue("ring", ring, None).unwrap();
        let later = Message { delay_ms: 60_000, ..Message::new(&b"later"[..]) };
        b.offer("ring", vec![later], MS).unwrap();
        b.offer("ring", msgs(&["waiting"]), MS).unwrap();
        let refused = b.offer("ring", msgs(&["x", "y"]), MS);
        assert!(matches!(refused, Err(BrokerError::Full(_))), "durable {durable}: {refused:?}");
        assert_eq!(b.queue("ring").unwrap().counters().dropped, 0, "durable {durable}");
        assert_eq!(payloads(&b.poll("ring", 5, None, 1, 2 * MS).unwrap()), [b"waiting".to_vec()]);
        // One that fits once the waiting one is dropped goes in, as before.
        b.offer("ring", msgs(&["w2"]), 3 * MS).unwrap();
        b.offer("ring", msgs(&["z"]), 4 * MS).unwrap();
        assert_eq!(b.queue("ring").unwrap().counters().dropped, 1);
        assert_eq!(payloads(&b.poll("ring", 5, None, 1, 5 * MS).unwrap()), [b"z".to_vec()]);
    }
}

/// A circular queue with `max_bytes` keeps its delayed messages' bytes: an offer that would
/// fit once every waiting message is dropped, were it not for them, is refused with nothing
/// dropped (the waiting messages were dropped one by one, and the offer refused all the same).
#[test]
fn a_circular_queue_drops_nothing_for_an_offer_its_delayed_bytes_keep_out() {
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        let ring = QueueConfig { max_bytes: 100, circular: true, durable, ..QueueConfig::default() };
        b.create_queue("ring", ring, None).unwrap();
        let bytes = |c: u8, n: usize| Message::new(vec![c; n]);
        b.offer("ring", vec![Message { delay_ms: 60_000, ..bytes(b'd', 60) }], MS).unwrap();
        b.offer("ring", vec![bytes(b'w', 10), bytes(b'v', 10)], MS).unwrap();
        // 60 delayed + 45 > 100 whatever is dropped.
        let refused = b.offer("ring", vec![bytes(b'x', 45)], 2 * MS);
        assert!(matches!(refused, Err(BrokerError::Full(_))), "durable {durable}: {refused:?}");
        assert_eq!(b.queue("ring").unwrap().counters().dropped, 0, "durable {durable}");
        // 60 + 20 + 25 > 100, and 60 + 10 + 25 is not: the oldest goes, and only it.
        b.offer("ring", vec![bytes(b'y', 25)], 3 * MS).unwrap();
        assert_eq!(b.queue("ring").unwrap().counters().dropped, 1, "durable {durable}");
        let got = payloads(&b.poll("ring", 5, None, 1, 4 * MS).unwrap());
        assert_eq!(got, [vec![b'v'; 10], vec![b'y'; 25]], "durable {durable}");
    }
}

/// An in-memory circular queue knows its delayed messages' bytes, and no longer counts a
/// message's once it is due and waiting: it is dropped for an offer like any waiting one.
#[test]
fn a_circular_queue_drops_a_delayed_message_once_it_is_due() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let ring = QueueConfig { max_bytes: 100, circular: true, ..QueueConfig::default() };
    b.create_queue("ring", ring, None).unwrap();
    b.offer("ring", vec![Message { delay_ms: 1, ..Message::new(vec![b'd'; 60]) }], MS).unwrap();
    assert!(matches!(b.offer("ring", vec![Message::new(vec![b'x'; 50])], MS), Err(BrokerError::Full(_))));
    b.tick(10 * MS);
    b.offer("ring", vec![Message::new(vec![b'y'; 50])], 11 * MS).unwrap();
    assert_eq!(b.queue("ring").unwrap().counters().dropped, 1);
    assert_eq!(payloads(&b.poll("ring", 5, None, 1, 12 * MS).unwrap()), [vec![b'y'; 50]]);
}

/// An in-memory circular queue counts a message returned with a delay among its delayed bytes,
/// and forgets the delayed bytes a flush drops.
#[test]
fn a_circular_queue_counts_returned_delayed_messages_and_forgets_flushed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let ring = QueueConfig { max_bytes: 100, circular: true, ..QueueConfig::default() };
    b.create_queue("ring", ring, None).unwrap();
    b.offer("ring", vec![Message::new(vec![b'r'; 60])], MS).unwrap();
    let d = b.poll("ring", 1, Some(Duration::from_secs(60)), 1, 2 * MS).unwrap();
    assert_eq!(b.abort("ring", &[d[0].handle], 1, 60_000, 3 * MS).unwrap(), 1);
    b.offer("ring", vec![Message::new(vec![b'w'; 20])], 4 * MS).unwrap();
    // 60 returned and delayed + 45 > 100 whatever is dropped.
    assert!(matches!(b.offer("ring", vec![Message::new(vec![b'x'; 45])], 5 * MS), Err(BrokerError::Full(_))));
    assert_eq!(b.queue("ring").unwrap().counters().dropped, 0);
    b.queue("ring").unwrap().flush().unwrap();
    b.offer("ring", vec![Message::new(vec![b'y'; 30])], 6 * MS).unwrap();
    b.offer("ring", vec![Message::new(vec![b'z'; 80])], 7 * MS).unwrap();
    assert_eq!(b.queue("ring").unwrap().counters().dropped, 1);
    assert_eq!(payloads(&b.poll("ring", 5, None, 1, 8 * MS).unwrap()), [vec![b'z'; 80]]);
}

/// A circular queue drops as many of its oldest as an offer needs, more than its log lets out
/// unacknowledged at once (`MAX_PENDING`) too.
#[test]
fn a_circular_queue_drops_more_than_its_log_lets_out_for_one_large_offer() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let ring = QueueConfig { max_bytes: 100_000, circular: true, durable: true, ..QueueConfig::default() };
    b.create_queue("ring", ring, None).unwrap();
    let small: Vec<Message> = (0..9_500).map(|i| Message::new(format!("{i:010}").into_bytes())).collect();
    b.offer("ring", small, MS).unwrap();
    b.offer("ring", vec![Message::new(vec![b'L'; 90_000])], 2 * MS).unwrap();
    let q = b.queue("ring").unwrap();
    assert_eq!(q.counters().dropped, 8_500, "85,000 bytes of the oldest made room");
    const { assert!(8_500 > petrel_log::MAX_PENDING) };
    let got = b.poll("ring", 2_000, None, 1, 3 * MS).unwrap();
    assert_eq!((got.len(), &got[0].message.payload[..]), (1_001, &b"0000008500"[..]));
    assert_eq!(got[1_000].message.payload.len(), 90_000);
}

/// `n` messages at priority `level`, their payloads "level.i".
fn at_level(level: u8, n: usize) -> Vec<Message> {
    (0..n).map(|i| Message { priority: level, ..Message::new(format!("{level}.{i}").into_bytes()) }).collect()
}

/// A durable circular queue "q" of two levels and `max_items`, whose level `held` its consumers
/// hold at its log's limit of open reads: 8,192 offered (`max_items` at a time) and read, none
/// acknowledged. Returns the reads' handles.
fn circular_with_a_held_level(max_items: u64, held: u8) -> (tempfile::TempDir, Broker, Vec<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let config = QueueConfig { durable: true, priorities: 2, circular: true, max_items, ..QueueConfig::default() };
    b.create_queue("q", config, None).unwrap();
    let mut open = Vec::new();
    while open.len() < petrel_log::MAX_PENDING {
        let n = (petrel_log::MAX_PENDING - open.len()).min(max_items as usize);
        b.offer("q", at_level(held, n), MS).unwrap();
        let hour = Some(Duration::from_secs(3600));
        open.extend(b.poll("q", n, hour, 1, 2 * MS).unwrap().into_iter().map(|d| d.handle));
    }
    (dir, b, open)
}

/// A full circular queue whose least urgent level its consumers hold at its limit of open reads
/// (its waiting messages cannot go now) drops more urgent ones only if that makes room: it
/// dropped them one by one, then refused the offer all the same.
#[test]
fn a_circular_queue_drops_nothing_for_an_offer_that_a_blocked_level_keeps_out() {
    let (_dir, b, _) = circular_with_a_held_level(8, 0);
    b.offer("q", at_level(0, 5), 3 * MS).unwrap();
    b.offer("q", at_level(1, 3), 4 * MS).unwrap();
    // 8 waiting: 4 more fit only if 4 go, and only the 3 urgent ones can.
    let refused = b.offer("q", at_level(1, 4), 5 * MS);
    assert!(matches!(refused, Err(BrokerError::Full(_))), "{refused:?}");
    assert_eq!(b.queue("q").unwrap().counters().dropped, 0, "nothing dropped for an offer refused");
    // One more fits once one goes: the oldest of the level that can give one.
    b.offer("q", vec![Message { priority: 1, ..Message::new(&b"last"[..]) }], 6 * MS).unwrap();
    assert_eq!(b.queue("q").unwrap().counters().dropped, 1);
    let got = b.poll("q", 10, None, 1, 7 * MS);
    assert_eq!(texts(&got.unwrap()[..3]), ["1.1", "1.2", "last"]);
}

/// An offer that needs more than a level's log lets out at once, in a circular queue where a
/// more urgent level's consumers hold theirs at the limit: dropped for only if it fits beside
/// that level's waiting messages (it dropped 8,192, then refused).
#[test]
fn a_circular_queue_drops_past_its_log_s_limit_only_for_an_offer_that_fits() {
    let limit = petrel_log::MAX_PENDING;
    let (_dir, b, _) = circular_with_a_held_level(limit as u64 + 13, 1);
    // The urgent level's 8,192 out with consumers and 5 waiting; 8,208 waiting below.
    b.offer("q", at_level(1, 5), 3 * MS).unwrap();
    b.offer("q", at_level(0, limit + 8), 4 * MS).unwrap();
    // 8,209 fit beside the 5 only with 8,214 waiting: refused, nothing dropped.
    let refused = b.offer("q", at_level(1, limit + 9), 5 * MS);
    assert!(matches!(refused, Err(BrokerError::Full(_))), "{refused:?}");
    assert_eq!(b.queue("q").unwrap().counters().dropped, 0);
    assert_eq!(b.queue("q").unwrap().status().items, limit as u64 + 13);
    // 8,208 do: the whole lower level goes for them.
    b.offer("q", at_level(1, limit + 8), 6 * MS).unwrap();
    assert_eq!(b.queue("q").unwrap().counters().dropped, limit as u64 + 8);
    assert_eq!(b.queue("q").unwrap().status().items, limit as u64 + 13);
}

/// The same with the held level below the one that makes room: passed over, and the offer that
/// fits beside its waiting messages by count still gets its room (it was refused).
#[test]
fn a_circular_queue_passes_over_a_held_level_below_and_drops_past_its_log_s_limit() {
    let limit = petrel_log::MAX_PENDING;
    let (_dir, b, _) = circular_with_a_held_level(limit as u64 + 13, 0);
    b.offer("q", at_level(0, 5), 3 * MS).unwrap();
    b.offer("q", at_level(1, limit + 8), 4 * MS).unwrap();
    b.offer("q", at_level(1, limit + 8), 5 * MS).unwrap();
    assert_eq!(b.queue("q").unwrap().counters().dropped, limit as u64 + 8);
    let got = b.poll("q", 1, None, 1, 6 * MS).unwrap();
    assert_eq!(texts(&got), ["1.0"]);
}

/// A message released at the head of a level its consumers hold at its log's limit goes for an
/// offer, and so does the next level's oldest, without taking the level for the offer's own
/// (it dropped the released one, then refused).
#[test]
fn a_circular_queue_drops_a_released_message_of_a_blocked_level_and_goes_on() {
    let (_dir, b, open) = circular_with_a_held_level(6, 0);
    let hour = Some(Duration::from_secs(3600));
    // One returned with a delay (its read closed), another read in its place: the level is held
    // at its limit again, and the returned one comes due at its head.
    assert_eq!(b.abort("q", &open[..1], 1, 1, 3 * MS).unwrap(), 1);
    b.offer("q", at_level(0, 1), 3 * MS).unwrap();
    assert_eq!(b.poll("q", 1, hour, 1, 3 * MS).unwrap().len(), 1);
    b.tick(10 * MS);
    b.offer("q", at_level(0, 3), 11 * MS).unwrap();
    b.offer("q", at_level(1, 2), 12 * MS).unwrap();
    let before = b.queue("q").unwrap().counters().dropped;
    assert_eq!(b.queue("q").unwrap().status().items, 6, "the released one, 3 held back, 2 urgent");
    b.offer("q", vec![Message { priority: 1, ..Message::new(&b"new"[..]) }; 2], 13 * MS).unwrap();
    assert_eq!(b.queue("q").unwrap().counters().dropped - before, 2, "the released one and 1.0");
    let got = b.poll("q", 3, None, 1, 14 * MS).unwrap();
    assert_eq!(texts(&got), ["1.1", "new", "new"]);
}

/// A level of a durable queue with as many messages out as its log allows (8,192 read and not
/// yet acknowledged) waits for acknowledgements; the other levels' messages still go (every
/// poll chose the blocked level and came back empty).
#[test]
fn a_level_at_its_limit_of_open_reads_does_not_hold_up_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let config = QueueConfig { durable: true, priorities: 2, ..QueueConfig::default() };
    b.create_queue("q", config, None).unwrap();
    let urgent = |n: usize| (0..n).map(|_| Message { priority: 1, ..Message::new(&b"u"[..]) }).collect::<Vec<_>>();
    b.offer("q", urgent(petrel_log::MAX_PENDING + 100), MS).unwrap();
    let hour = Some(Duration::from_secs(3600));
    let mut out = 0;
    while out < petrel_log::MAX_PENDING {
        out += b.poll("q", 1000, hour, 1, 2 * MS).unwrap().len();
    }
    b.offer("q", (0..5).map(|_| Message::new(&b"plain"[..])).collect(), 3 * MS).unwrap();
    let got = b.poll("q", 5, hour, 1, 4 * MS).unwrap();
    assert_eq!(payloads(&got), vec![b"plain".to_vec(); 5], "the lower level's, while the top one waits");
}

/// A flush passes over a level at its limit of open reads (its head cannot be taken now) and
/// empties the others, and the queue's bytes stay right: they were reset to the open reads'
/// alone, and taking the level's messages later went below zero.
#[test]
fn a_flush_passes_over_a_level_at_its_limit_and_keeps_the_counts_right() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let config = QueueConfig { durable: true, priorities: 2, ..QueueConfig::default() };
    b.create_queue("q", config, None).unwrap();
    let low = (0..petrel_log::MAX_PENDING + 5).map(|_| Message::new(&b"low"[..])).collect::<Vec<_>>();
    b.offer("q", low, MS).unwrap();
    let hour = Some(Duration::from_secs(3600));
    let mut open = Vec::new();
    while open.len() < petrel_log::MAX_PENDING {
        open.extend(b.poll("q", 1000, hour, 1, 2 * MS).unwrap().into_iter().map(|d| d.handle));
    }
    b.offer("q", (0..3).map(|_| Message { priority: 1, ..Message::new(&b"high"[..]) }).collect(), 3 * MS).unwrap();
    assert_eq!(b.queue("q").unwrap().flush().unwrap(), 3, "the level above, not the one at its limit");
    b.ack("q", &open, 1).unwrap();
    let rest = b.poll("q", 10, None, 1, 4 * MS).unwrap();
    assert_eq!(payloads(&rest), vec![b"low".to_vec(); 5]);
    assert_eq!(b.queue("q").unwrap().status().bytes, 0);
}

#[test]
fn expired_messages_go_to_the_dead_letter_queue() {
    for config in both() {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("dead", QueueConfig::default(), None).unwrap();
        b.create_queue("q", QueueConfig { ttl_ms: 50, dead_letter: "dead".into(), ..config.clone() }, None).unwrap();
        let mut early = Message::new(&b"own-early"[..]);
        early.expires_at = 30 * MS;
        let mut late = Message::new(&b"own-late"[..]);
        late.expires_at = 1_000 * MS;
        b.offer("q", vec![Message::new(&b"ttl"[..]), early, late], 0).unwrap();
        b.tick(10 * MS);
        assert_eq!(b.queue("q").unwrap().counters().items, 3, "nothing expired yet");
        let live = b.poll("q", 5, VIS, 1, 40 * MS).unwrap();
        assert_eq!(payloads(&live), [b"ttl".to_vec(), b"own-late".to_vec()], "{config:?}: the early one expired");
        b.abort("q", &live.iter().map(|d| d.handle).collect::<Vec<_>>(), 1, 0, 2).unwrap();
        let live = b.poll("q", 5, VIS, 1, 60 * MS).unwrap();
        assert!(live.is_empty(), "{config:?}: the queue's TTL caps a later expiry of the message's own");
        let dead = b.poll("dead", 5, None, 1, 60 * MS).unwrap();
        assert_eq!(payloads(&dead), [b"own-early".to_vec(), b"ttl".to_vec(), b"own-late".to_vec()]);
        assert_eq!(b.queue("q").unwrap().counters().expired, 3);
    }
}

/// A dead-letter queue's `max_item_bytes` does not refuse a dead letter (the headers the move
/// adds made one larger than the limit, and it was lost); what a full one cannot take is counted
/// as lost in the source queue.
#[test]
fn dead_letters_pass_their_queue_s_item_limit_and_what_a_full_one_refuses_is_counted() {
    for config in both() {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("dead", QueueConfig { max_item_bytes: 10, max_items: 1, ..QueueConfig::default() }, None)
            .unwrap();
        let q = b.create_queue("q", QueueConfig { ttl_ms: 50, dead_letter: "dead".into(), ..config.clone() }, None);
        let q = q.unwrap();
        b.offer("q", vec![Message::new(&b"ten bytes!"[..])], 0).unwrap();
        b.tick(60 * MS);
        let dead = b.poll("dead", 5, VIS, 1, 60 * MS).unwrap();
        assert_eq!(payloads(&dead), [b"ten bytes!".to_vec()], "{config:?}");
        assert_eq!(q.counters().dead_letters_lost, 0);
        // "dead" holds one (taken, not acknowledged) and takes no more.
        b.offer("q", vec![Message::new(&b"a"[..]), Message::new(&b"b"[..])], 70 * MS).unwrap();
        b.tick(200 * MS);
        assert_eq!((q.counters().expired, q.counters().dead_letters_lost), (3, 2), "{config:?}");
    }
}

/// Kestrel's delay queue: items expire into another queue without anyone reading the first. The
/// broker's tick moves them, for durable queues as for those in memory, and after a reopen.
#[test]
fn the_tick_sweeps_expired_messages_without_a_reader_in_memory_and_on_disk() {
    for config in both() {
        let dir = tempfile::tempdir().unwrap();
        let queue = QueueConfig { ttl_ms: 50, dead_letter: "ready".into(), ..config.clone() };
        {
            let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
            b.create_queue("ready", config.clone(), None).unwrap();
            b.create_queue("delay", queue.clone(), None).unwrap();
            b.offer("delay", msgs(&["a", "b"]), 0).unwrap();
            b.tick(10 * MS);
            assert_eq!(b.queue("delay").unwrap().counters().items, 2);
            b.tick(60 * MS);
            let delay = b.queue("delay").unwrap().counters();
            assert_eq!((delay.items, delay.bytes, delay.expired), (0, 0, 2), "{config:?}");
            assert_eq!(b.queue("ready").unwrap().counters().items, 2, "{config:?}: moved by the tick alone");
            b.offer("delay", msgs(&["c"]), 100 * MS).unwrap();
        }
        if !config.durable {
            continue;
        }
        // Reopened: what waits on disk is swept by the first tick once due.
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.tick(120 * MS);
        assert_eq!(b.queue("delay").unwrap().counters().items, 1);
        b.tick(200 * MS);
        assert_eq!(b.queue("delay").unwrap().counters().items, 0);
        assert_eq!(
            payloads(&b.poll("ready", 5, None, 1, 200 * MS).unwrap()),
            [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]
        );
    }
}

#[test]
fn fanout_children_get_copies() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    for q in ["orders", "orders+audit", "orders+billing", "orders+audit+deep"] {
        b.create_queue(q, QueueConfig::default(), None).unwrap();
    }
    b.offer("orders", msgs(&["o1"]), 0).unwrap();
    // As in Kestrel, a child's parent is the name before the first `+`.
    for q in ["orders", "orders+audit", "orders+billing", "orders+audit+deep"] {
        assert_eq!(payloads(&b.poll(q, 5, None, 1, 0).unwrap()), [b"o1".to_vec()], "{q}");
    }
    b.offer("orders+audit", msgs(&["direct"]), 0).unwrap();
    assert!(b.poll("orders+audit+deep", 5, None, 1, 0).unwrap().is_empty(), "a child has no children");
    assert!(b.poll("orders", 5, None, 1, 0).unwrap().is_empty(), "nor reaches its parent");
    b.remove_queue("orders+billing").unwrap();
    assert_eq!(b.fanout_children("orders"), ["orders+audit", "orders+audit+deep"]);
}

/// A parent without priority levels takes an offer of mixed priorities; a child with levels gets
/// every copy, each at its level (it takes one priority an offer: the whole copy was refused,
/// and counted dropped).
#[test]
fn a_fanout_child_with_levels_gets_every_copy_of_a_mixed_offer() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    for durable in [false, true] {
        let (parent, child) = if durable { ("dp", "dp+w") } else { ("mp", "mp+w") };
        b.create_queue(parent, QueueConfig { durable, ..QueueConfig::default() }, None).unwrap();
        b.create_queue(child, QueueConfig { durable, priorities: 3, ..QueueConfig::default() }, None).unwrap();
        let mut offer = msgs(&["low", "high", "high too", "low too"]);
        offer[1].priority = 2;
        offer[2].priority = 2;
        b.offer(parent, offer, 0).unwrap();
        assert_eq!(payloads(&b.poll(child, 10, None, 1, 0).unwrap()), [&b"high"[..], b"high too", b"low", b"low too"]);
        assert_eq!(b.queue(child).unwrap().counters().dropped, 0);
    }
}

#[test]
fn durable_queues_and_definitions_survive_a_restart_with_tentative_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("jobs", QueueConfig { durable: true, max_items: 100, ..QueueConfig::default() }, None).unwrap();
        b.create_queue("mem", QueueConfig::default(), None).unwrap();
        let mut m = Message::new(&b"job-1"[..]);
        m.subject = "build".into();
        m.headers = vec![("attempt".into(), bytes::Bytes::from_static(b"1"))];
        b.offer("jobs", vec![m, Message::new(&b"job-2"[..]), Message::new(&b"job-3"[..])], 5).unwrap();
        b.offer("mem", msgs(&["gone"]), 5).unwrap();
        let taken = b.poll("jobs", 1, None, 1, 6).unwrap(); // job-1 taken for good
        assert_eq!(taken[0].message.subject, "build");
        b.poll("jobs", 1, VIS, 1, 6).unwrap(); // job-2 tentative, never acked
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.queue_names(), ["jobs", "mem"]);
    assert_eq!(b.queue("jobs").unwrap().config().max_items, 100);
    assert!(b.poll("mem", 5, None, 1, 0).unwrap().is_empty(), "in-memory contents do not survive");
    let left = b.poll("jobs", 5, None, 1, 0).unwrap();
    assert_eq!(payloads(&left), [b"job-2".to_vec(), b"job-3".to_vec()]);
    let Err(err) = b.create_queue("jobs", QueueConfig::default(), None) else { panic!("made again") };
    assert!(matches!(err, BrokerError::Exists(..)));
    // Saying how: each setting that differs.
    assert!(
        err.to_string().ends_with("another configuration: durable is true, not false, max_items is 100, not 0"),
        "{err}"
    );
    b.remove_queue("jobs").unwrap();
    assert!(matches!(b.poll("jobs", 1, None, 1, 0), Err(BrokerError::NotFound(_))));
    assert!(!dir.path().join("queues/jobs").exists());
}

/// A broker opens its queues on several threads: every queue comes back with its messages, and
/// a damaged definition is a clear error naming its file (the first in name order, however the
/// threads fall).
#[test]
fn many_queues_come_back_after_a_restart_and_a_damaged_definition_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..40).map(|i| format!("q{i:02}")).collect();
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        for (i, name) in names.iter().enumerate() {
            b.create_queue(name, QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
            let items: Vec<String> = (0..=i).map(|n| format!("{name}-{n}")).collect();
            b.offer(name, items.iter().map(|s| Message::new(s.as_bytes().to_vec())).collect(), 1).unwrap();
        }
    }
    // A copy of a queue's definition under another directory's name is no queue of its own.
    let queues = dir.path().join("queues");
    std::fs::create_dir(queues.join("q05.bak")).unwrap();
    std::fs::copy(queues.join("q05/queue.json"), queues.join("q05.bak/queue.json")).unwrap();
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        assert_eq!(b.queue_names(), names);
        for (i, name) in names.iter().enumerate() {
            let expected: Vec<Vec<u8>> = (0..=i).map(|n| format!("{name}-{n}").into_bytes()).collect();
            assert_eq!(payloads(&b.poll(name, 100, None, 1, 2).unwrap()), expected, "{name}");
        }
    }
    // Damaged definitions: those queues are not served, the others are.
    Broker::open(dir.path(), BrokerOptions::default()).unwrap().offer("q07", msgs(&["kept"]), 3).unwrap();
    let definition = |name: &str| dir.path().join("queues").join(name).join("queue.json");
    let good = std::fs::read(definition("q07")).unwrap();
    for damaged in ["q31", "q07"] {
        std::fs::write(definition(damaged), b"{\"name\": ").unwrap();
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let damaged: Vec<(String, String)> = b.damaged_queues();
    assert_eq!(damaged.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["q07", "q31"]);
    assert!(damaged[0].1.contains("q07/queue.json"), "{damaged:?}");
    assert_eq!(b.queue_names().len(), 38);
    b.offer("q08", msgs(&["served"]), 4).unwrap();
    assert_eq!(payloads(&b.poll("q08", 100, None, 1, 5).unwrap()), [b"served".to_vec()], "the others are served");
    for e in [
        b.offer("q07", msgs(&["x"]), 0).unwrap_err(),
        b.create_queue("q07", QueueConfig::default(), None).err().unwrap(),
        b.queue_or_create("q07").err().unwrap(),
        b.remove_queue("q07").unwrap_err(),
    ] {
        assert!(
            matches!(&e, BrokerError::Damaged { kind: "queue", name, reason } if name == "q07" && reason.contains("q07/queue.json")),
            "{e}"
        );
        assert_eq!(e.status(), petrel_proto::Status::ServerError);
    }
    // Repaired (one of the two), a reload serves it again, its messages as they were.
    std::fs::write(definition("q07"), good).unwrap();
    let changes = b.reconfigure_queues(QueueConfig::default(), Default::default()).unwrap();
    assert_eq!(changes.reopened, ["q07"]);
    assert_eq!(b.damaged_queues().len(), 1);
    assert_eq!(payloads(&b.poll("q07", 100, None, 1, 6).unwrap()), [b"kept".to_vec()]);
}

#[test]
fn bad_names_and_oversized_messages_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { max_message_bytes: 10, ..BrokerOptions::default() }).unwrap();
    for bad in ["", "a/b", ".hidden", "+x", "sp ace"] {
        assert!(b.create_queue(bad, QueueConfig::default(), None).is_err(), "{bad:?}");
    }
    b.create_queue("q", QueueConfig::default(), None).unwrap();
    assert!(matches!(
        b.offer("q", vec![Message::new(vec![0u8; 11])], 0),
        Err(BrokerError::TooLarge { size: 11, max: 10 })
    ));
    assert!(matches!(b.offer("nope", msgs(&["x"]), 0), Err(BrokerError::NotFound(_))));
}

#[test]
fn queues_made_by_first_use_take_their_configuration_from_the_options() {
    let dir = tempfile::tempdir().unwrap();
    let jobs = QueueConfig { durable: true, max_items: 2, ..QueueConfig::default() };
    let options = BrokerOptions {
        queue_defaults: QueueConfig { max_items: 5, ..QueueConfig::default() },
        queues: [("jobs".to_owned(), jobs.clone())].into(),
        ..BrokerOptions::default()
    };
    let b = Broker::open(dir.path(), options.clone()).unwrap();
    assert_eq!(b.queue_names(), ["jobs"], "a configured queue exists from the start");
    assert_eq!(b.queue_or_create("other").unwrap().config().max_items, 5, "the defaults");
    assert_eq!(*b.queue_or_create("jobs+audit").unwrap().config(), jobs, "a child takes its parent's block");
    b.offer("jobs", msgs(&["a", "b"]), 0).unwrap();
    assert!(matches!(b.offer("jobs", msgs(&["c"]), 0), Err(BrokerError::Full(_))));
    let big = QueueConfig { max_item_bytes: 3, ..QueueConfig::default() };
    b.create_queue("small", big, None).unwrap();
    assert!(matches!(b.offer("small", msgs(&["four"]), 0), Err(BrokerError::TooLarge { .. })));
    drop(b);

    // The file's configuration wins over the stored one at the next open; contents stay.
    let bigger = QueueConfig { max_items: 10, ..jobs };
    let options = BrokerOptions { queues: [("jobs".to_owned(), bigger.clone())].into(), ..options };
    let b = Broker::open(dir.path(), options).unwrap();
    assert_eq!(*b.queue("jobs").unwrap().config(), bigger);
    b.offer("jobs", msgs(&["c"]), 0).unwrap();
    assert_eq!(payloads(&b.poll("jobs", 5, None, 1, 0).unwrap()), [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
}

#[test]
fn queues_made_by_first_use_follow_the_defaults_across_restarts_and_reloads_created_ones_keep_theirs() {
    let dir = tempfile::tempdir().unwrap();
    let defaults = |max_items| QueueConfig { durable: true, max_items, ..QueueConfig::default() };
    let options = |d: QueueConfig| BrokerOptions { queue_defaults: d, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options(defaults(2))).unwrap();
    assert!(b.queue_or_create("auto").unwrap().follows_defaults());
    let pinned = b.create_queue("pinned", defaults(2), None).unwrap();
    assert!(!pinned.follows_defaults(), "created explicitly, even with the defaults' values");
    b.offer("auto", msgs(&["a", "b"]), 0).unwrap();
    assert!(matches!(b.offer("auto", msgs(&["c"]), 0), Err(BrokerError::Full(_))));
    drop((pinned, b));

    // A restart with other defaults: the queue made by first use takes them, contents kept;
    // where and how its messages are kept (in memory, levels) stays as it was.
    let changed = QueueConfig { durable: false, priorities: 3, ttl_ms: 60_000, ..defaults(5) };
    let b = Broker::open(dir.path(), options(changed.clone())).unwrap();
    let auto = b.queue("auto").unwrap();
    assert!(auto.follows_defaults(), "still, after a restart");
    assert_eq!((auto.config().max_items, auto.config().ttl_ms), (5, 60_000));
    assert_eq!((auto.config().durable, auto.config().priorities), (true, 0), "its files depend on these");
    assert_eq!(b.queue("pinned").unwrap().config().max_items, 2, "created explicitly: its own");
    b.offer("auto", msgs(&["c"]), 0).unwrap();
    assert_eq!(payloads(&b.poll("auto", 5, None, 1, 0).unwrap()), [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);

    // A reload: the limits change live; a durability, only at the next start.
    let changes = b.reconfigure_queues(QueueConfig { max_items: 7, ..changed.clone() }, Default::default()).unwrap();
    assert_eq!(changes.applied, ["auto"]);
    assert_eq!(b.queue("auto").unwrap().config().max_items, 7);
    assert_eq!(b.queue("pinned").unwrap().config().max_items, 2);
    let always = QueueConfig { durable: true, durability: "always".into(), ..defaults(7) };
    let changes = b.reconfigure_queues(always.clone(), Default::default()).unwrap();
    assert_eq!((changes.applied.len(), changes.needs_restart.clone()), (0, vec!["auto".to_owned()]));
    drop(b);
    let b = Broker::open(dir.path(), options(always)).unwrap();
    assert_eq!(b.queue("auto").unwrap().config().durability, "always");
    // Defaults that name the queue its own dead-letter queue: it takes them, without that.
    drop(b);
    let own = QueueConfig { dead_letter: "auto".into(), ..defaults(9) };
    let b = Broker::open(dir.path(), options(own)).unwrap();
    assert_eq!(b.queue("auto").unwrap().config().max_items, 9);
    assert_eq!(b.queue("auto").unwrap().config().dead_letter, "");
}

/// Defaults that name a dead-letter queue: the dead-letter queue, made by the first message moved
/// to it, takes them too, but not as its own dead-letter queue (refused so, it was never made,
/// and every dead letter was lost).
#[test]
fn a_dead_letter_queue_made_by_first_use_from_defaults_naming_it_takes_its_dead_letters() {
    let dir = tempfile::tempdir().unwrap();
    let defaults =
        QueueConfig { durable: true, max_deliveries: 1, dead_letter: "dlq".into(), ..QueueConfig::default() };
    let b = Broker::open(dir.path(), BrokerOptions { queue_defaults: defaults, ..BrokerOptions::default() }).unwrap();
    b.queue_or_create("jobs").unwrap();
    b.offer("jobs", msgs(&["poison"]), 1_000).unwrap();
    let taken = b.poll("jobs", 1, VIS, 1, 2_000).unwrap();
    b.abort("jobs", &[taken[0].handle], 1, 0, 3_000).unwrap();
    assert_eq!(payloads(&b.poll("dlq", 5, None, 2, 4_000).unwrap()), [b"poison".to_vec()]);
    let dlq = b.queue("dlq").unwrap().config();
    assert_eq!(
        (dlq.dead_letter.as_str(), dlq.max_deliveries),
        ("", 0),
        "no delivery limit without a dead-letter queue"
    );
    assert_eq!(b.queue("jobs").unwrap().counters().dead_letters_lost, 0);
}

#[test]
fn a_reload_changes_queue_limits_live_and_waits_for_a_restart_to_change_their_kind() {
    let dir = tempfile::tempdir().unwrap();
    let jobs = QueueConfig { durable: true, max_items: 2, ..QueueConfig::default() };
    let mem = QueueConfig { max_items: 1, ..QueueConfig::default() };
    let options = BrokerOptions {
        queues: [("jobs".to_owned(), jobs.clone()), ("mem".to_owned(), mem.clone())].into(),
        ..BrokerOptions::default()
    };
    let b = Broker::open(dir.path(), options.clone()).unwrap();
    b.offer("jobs", msgs(&["a", "b"]), 0).unwrap();
    assert!(matches!(b.offer("jobs", msgs(&["c"]), 0), Err(BrokerError::Full(_))));
    b.offer("mem", msgs(&["x"]), 0).unwrap();

    // Bad blocks change nothing.
    let bad = [("jobs".to_owned(), QueueConfig { dead_letter: "a/b".into(), ..jobs.clone() })].into();
    assert!(matches!(b.reconfigure_queues(QueueConfig::default(), bad), Err(BrokerError::BadRequest(_))));
    assert_eq!(*b.queue("jobs").unwrap().config(), jobs);

    let bigger = QueueConfig { max_items: 3, ttl_ms: 1, ..jobs.clone() };
    let on_disk = QueueConfig { durable: true, ..mem.clone() };
    let fresh = QueueConfig { max_items: 7, ..QueueConfig::default() };
    let defaults = QueueConfig { max_items: 9, ..QueueConfig::default() };
    let queues =
        [("jobs".to_owned(), bigger.clone()), ("mem".to_owned(), on_disk.clone()), ("fresh".to_owned(), fresh)];
    let changes = b.reconfigure_queues(defaults, queues.into()).unwrap();
    assert_eq!(
        changes,
        QueueChanges {
            applied: vec!["jobs".into()],
            created: vec!["fresh".into()],
            needs_restart: vec!["mem".into()],
            failed: vec![],
            reopened: vec![],
            reopened_topics: vec![]
        }
    );
    // The raised limit lets a third in; the new ttl applies to offers from now on.
    b.offer("jobs", msgs(&["c"]), 10).unwrap();
    assert!(matches!(b.offer("jobs", msgs(&["d"]), 10), Err(BrokerError::Full(_))));
    assert_eq!(b.queue("fresh").unwrap().config().max_items, 7, "a queue named for the first time exists");
    assert_eq!(b.queue_or_create("other").unwrap().config().max_items, 9, "first use takes the new defaults");
    assert_eq!(*b.queue("mem").unwrap().config(), mem, "a change of kind waits for a restart");
    assert_eq!(payloads(&b.poll("jobs", 5, None, 1, 5_000_000).unwrap()), [b"a".to_vec(), b"b".to_vec()], "c expired");
    drop(b);

    // The next open finds the reloaded configuration stored with the queue, and applies the
    // change of kind from the file.
    let options = BrokerOptions { queues: [("mem".to_owned(), on_disk.clone())].into(), ..options };
    let b = Broker::open(dir.path(), options).unwrap();
    assert_eq!(*b.queue("jobs").unwrap().config(), bigger);
    assert_eq!(*b.queue("mem").unwrap().config(), on_disk);
}

#[test]
fn open_reads_are_listed_oldest_first_and_an_operator_can_return_one() {
    for config in both() {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", config, None).unwrap();
        b.offer("q", msgs(&["a", "bb", "ccc"]), 0).unwrap();
        let first = b.poll("q", 1, VIS, 7, 10 * MS).unwrap();
        let second = b.poll("q", 1, VIS, 8, 20 * MS).unwrap();
        let q = b.queue("q").unwrap();
        let (total, reads) = q.open_reads(10);
        assert_eq!(total, 2);
        let seen: Vec<_> =
            reads.iter().map(|r| (r.handle, r.message_id, r.consumer, r.taken_at_ns, r.deadline_ns)).collect();
        let expected = [
            (first[0].handle, first[0].message.id, 7, 10 * MS, 110 * MS),
            (second[0].handle, second[0].message.id, 8, 20 * MS, 120 * MS),
        ];
        assert_eq!(seen, expected);
        assert_eq!(q.open_reads(1), (2, vec![reads[0].clone()]), "the oldest first, within the limit");

        // The operator returns the stuck one: it is first again, and its consumer's ack finds nothing.
        assert!(b.return_read(&q, first[0].handle, 2).unwrap());
        assert!(!b.return_read(&q, first[0].handle, 2).unwrap(), "returned once");
        assert_eq!(b.ack("q", &[first[0].handle], 7).unwrap(), 0);
        assert_eq!(payloads(&b.poll("q", 1, None, 9, 30 * MS).unwrap()), [b"a".to_vec()]);
        assert_eq!(q.open_reads(10).0, 1);
        assert_eq!(q.counters().aborted, 1);

        // Many, taken out of order in time: any limit gives the oldest, oldest first.
        let many: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
        b.offer("q", msgs(&many.iter().map(String::as_str).collect::<Vec<_>>()), 0).unwrap();
        for i in 0..40u64 {
            b.poll("q", 1, VIS, 10, (40 + (i * 17) % 40) * MS).unwrap();
        }
        let (total, all) = q.open_reads(1000);
        assert!(total >= 40 && all.is_sorted_by_key(|r| (r.taken_at_ns, r.handle)), "{all:?}");
        for limit in [0, 1, 7, 39] {
            assert_eq!(q.open_reads(limit).1, all[..limit].to_vec(), "limit {limit}");
        }
    }
}

#[test]
fn a_durable_queue_remembers_messages_taken_out_of_order_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = QueueConfig { durable: true, ..QueueConfig::default() };
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", config, None).unwrap();
        b.offer("q", msgs(&["open", "taken", "left"]), 0).unwrap();
        b.poll("q", 1, VIS, 1, 0).unwrap();
        b.poll("q", 1, None, 2, 0).unwrap();
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let all = b.poll("q", 10, None, 1, 0).unwrap();
    assert_eq!(payloads(&all), [b"open".to_vec(), b"left".to_vec()], "the taken one is not delivered again");
}

#[test]
fn a_removal_cut_short_by_a_crash_is_finished_at_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("kept", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
        b.create_topic("kept-topic", true).unwrap();
    }
    // What a crash between the rename and the deletion leaves behind.
    for leftover in ["queues/.removed-gone", "topics/.removed-gone-topic"] {
        std::fs::create_dir_all(dir.path().join(leftover).join("groups")).unwrap();
        std::fs::write(dir.path().join(leftover).join("queue.json"), b"{}").unwrap();
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.queue_names(), ["kept"]);
    assert_eq!(b.topic_names(), ["kept-topic"]);
    assert!(!dir.path().join("queues/.removed-gone").exists());
    assert!(!dir.path().join("topics/.removed-gone-topic").exists());
    // Removing again over a leftover of the same name works too.
    std::fs::create_dir_all(dir.path().join("queues/.removed-kept")).unwrap();
    b.remove_queue("kept").unwrap();
    assert!(!dir.path().join("queues/kept").exists());
}

#[test]
fn a_poll_answer_holds_what_fits_its_byte_limit_and_the_rest_stays_in_order() {
    for config in both() {
        for visibility in [None, VIS] {
            let dir = tempfile::tempdir().unwrap();
            let options = BrokerOptions { max_poll_bytes: 10_000, ..BrokerOptions::default() };
            let b = Broker::open(dir.path(), options).unwrap();
            b.create_queue("q", config.clone(), None).unwrap();
            let big: Vec<Message> = (0..10u8).map(|i| Message::new(vec![i; 3_000])).collect();
            b.offer("q", big, 1).unwrap();
            let mut seen = Vec::new();
            let mut now = 2;
            loop {
                let answer = b.poll("q", usize::MAX, visibility, 1, now).unwrap();
                if answer.is_empty() {
                    break;
                }
                let bytes: u64 = answer.iter().map(|d| petrel_broker::answer_len_bound(&d.message)).sum();
                assert!(bytes <= 10_000, "{bytes} bytes in one answer, {config:?}");
                assert_eq!(answer.len(), 3, "as many as fit");
                seen.extend(answer.iter().map(|d| d.message.payload[0]));
                if visibility.is_some() {
                    let handles: Vec<u64> = answer.iter().map(|d| d.handle).collect();
                    assert_eq!(b.ack("q", &handles, 1).unwrap(), handles.len() as u32);
                }
                now += 1;
                if seen.len() == 9 {
                    break;
                }
            }
            assert_eq!(seen, (0..9).collect::<Vec<u8>>());
            // One message larger than the limit still goes, alone: the limit never starves a queue.
            b.offer("q", vec![Message::new(vec![9; 20_000])], now).unwrap();
            let sizes = |answer: Vec<petrel_broker::Delivery>| {
                answer.iter().map(|d| d.message.payload.len()).collect::<Vec<_>>()
            };
            assert_eq!(
                sizes(b.poll("q", usize::MAX, None, 1, now).unwrap()),
                [3_000],
                "the tenth; the big one does not fit beside it"
            );
            assert_eq!(sizes(b.poll("q", usize::MAX, None, 1, now).unwrap()), [20_000]);
            assert_eq!(b.queue("q").unwrap().counters().items, 0, "{config:?}");
        }
    }
}

#[test]
fn a_queue_whose_log_cannot_be_made_leaves_nothing_behind_and_errors_name_no_absolute_path() {
    let dir = tempfile::tempdir().unwrap();
    // A segment size the log refuses: creating a durable queue fails after its definition.
    let b = Broker::open(dir.path(), BrokerOptions { segment_bytes: 1000, ..BrokerOptions::default() }).unwrap();
    let e = b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).err().unwrap();
    assert!(!dir.path().join("queues").join("q").exists(), "{e}");
    assert!(b.queue("q").is_none());

    // A storage error as a client sees it: the file inside the data directory, not where that is.
    let b = Broker::open(dir.path().join("other"), BrokerOptions::default()).unwrap();
    b.create_queue("d", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let segment = std::fs::read_dir(dir.path().join("other/queues/d"))
        .unwrap()
        .flatten()
        .find(|e| e.path().extension().is_some_and(|x| x == "log"))
        .unwrap()
        .path();
    let text = BrokerError::Storage(petrel_log::Error::Io {
        op: "sync segment",
        path: segment.clone(),
        source: std::io::Error::from_raw_os_error(28),
    })
    .to_string();
    assert!(!text.contains(dir.path().to_str().unwrap()), "{text}");
    assert!(text.contains("queues/d/") && text.contains("No space left"), "{text}");
    let text =
        BrokerError::Storage(petrel_log::Error::UnsupportedFormat { file: segment, what: "format version 3".into() })
            .to_string();
    assert!(!text.contains(dir.path().to_str().unwrap()), "{text}");
    assert!(text.contains("queues/d/") && text.contains("format version 3"), "{text}");
}

#[test]
fn in_memory_queues_share_a_memory_budget_and_give_it_back() {
    let dir = tempfile::tempdir().unwrap();
    // A message of 1000 bytes counts them and what holding it takes; a queue's own bound counts
    // its messages' bytes alone.
    let each = 1000 + petrel_broker::HELD_OVERHEAD;
    let options =
        BrokerOptions { max_memory_bytes: 10 * each, memory_queue_max_bytes: 6_000, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    for q in ["a", "b"] {
        b.create_queue(q, QueueConfig::default(), None).unwrap();
    }
    b.create_queue("disk", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let kib = || vec![Message::new(vec![0u8; 1000])];
    for _ in 0..6 {
        b.offer("a", kib(), 1).unwrap();
    }
    assert!(matches!(b.offer("a", kib(), 1), Err(BrokerError::Full(_))), "a queue's default bound");
    for _ in 0..4 {
        b.offer("b", kib(), 1).unwrap();
    }
    assert_eq!(b.memory(), (10 * each, 10 * each));
    assert!(matches!(b.offer("b", kib(), 1), Err(BrokerError::Limit(_))), "the server's budget");
    b.offer("disk", kib(), 1).unwrap(); // durable queues are not in it
    // Taken tentatively, a message still counts; acknowledged, it is given back.
    let taken = b.poll("a", 2, VIS, 1, 2).unwrap();
    assert_eq!(b.memory().0, 10 * each);
    b.ack("a", &taken.iter().map(|d| d.handle).collect::<Vec<_>>(), 1).unwrap();
    assert_eq!(b.memory().0, 8 * each);
    b.offer("b", kib(), 1).unwrap();
    b.queue("b").unwrap().flush().unwrap();
    assert_eq!(b.memory().0, 4 * each);
    b.remove_queue("a").unwrap();
    assert_eq!(b.memory().0, 0, "a removed queue gives its bytes back");
}

/// Empty headers are not free: each counts what holding it takes, in a queue's bytes and the
/// memory budget (65,535 empty headers a message held megabytes counted as nothing).
#[test]
fn empty_headers_count_what_holding_them_takes() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { max_memory_bytes: 1 << 30, ..BrokerOptions::default() }).unwrap();
    b.create_queue("q", QueueConfig::default(), None).unwrap();
    let empty_headers = (0..10_000).map(|_| (String::new(), bytes::Bytes::new())).collect();
    b.offer("q", vec![Message { headers: empty_headers, ..Message::default() }], 1).unwrap();
    let counted = b.queue("q").unwrap().status().bytes;
    assert_eq!(counted, 10_000 * petrel_proto::HEADER_SIZE as u64);
    assert!(b.memory().0 >= counted);
}

/// What an offer adds to a queue's bytes and to the memory budget, taking its messages gives back
/// exactly, whatever fields they carry (a destination, which the queue does not keep, counted
/// when offered and not when taken, made the budget fill up with nothing in it); a text too long
/// for a queue to hold is refused whole.
#[test]
fn a_queues_bytes_and_the_memory_budget_come_back_to_zero_whatever_the_messages_carry() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { max_memory_bytes: 1 << 30, ..BrokerOptions::default() }).unwrap();
    for durable in [false, true] {
        let name = if durable { "disk" } else { "memory" };
        b.create_queue(name, QueueConfig { durable, ..QueueConfig::default() }, None).unwrap();
        let full = Message {
            destination: "somewhere else".into(),
            subject: "s".into(),
            reply_to: "r".into(),
            idempotency_key: "k".into(),
            headers: vec![("h".into(), bytes::Bytes::from_static(b"value"))],
            ..Message::new(&b"payload"[..])
        };
        b.offer(name, vec![full, Message::new(&b"plain"[..])], 1).unwrap();
        let offered = b.queue(name).unwrap().status().bytes;
        // (A header counts its name, its value and what holding it takes.)
        let header = 1 + 5 + petrel_proto::HEADER_SIZE as u64;
        assert_eq!(offered, (7 + 1 + 1 + 1 + header) + 5, "{name}: the destination is not the queue's to count");
        let taken = b.poll(name, 10, VIS, 1, 2).unwrap();
        assert_eq!(taken.len(), 2);
        b.ack(name, &taken.iter().map(|d| d.handle).collect::<Vec<_>>(), 1).unwrap();
        assert_eq!(b.queue(name).unwrap().status().bytes, 0, "{name}");
        assert_eq!(b.memory().0, 0, "{name}");
        let long = Message { subject: "x".repeat(70_000), ..Message::new(&b"x"[..]) };
        let refused = b.offer(name, vec![Message::new(&b"ok"[..]), long], 1);
        assert!(matches!(refused, Err(BrokerError::BadRequest(ref e)) if e.contains("65535")), "{refused:?}");
        assert_eq!(b.queue(name).unwrap().status().items, 0, "{name}: nothing of a refused offer is stored");
    }
}

#[test]
fn offers_to_a_queue_that_syncs_each_offer_share_syncs_and_are_handed_out_only_once_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { durability: petrel_log::Durability::Always, ..BrokerOptions::default() };
    let b = std::sync::Arc::new(Broker::open(dir.path(), options).unwrap());
    let q = b.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();

    // Stored and counted, but not handed out before the wait.
    let Offered { first_id: first, count, unsynced, .. } = b.offer_unsynced(&q, &mut msgs(&["a", "b"]), 0).unwrap();
    assert_eq!((first, count, unsynced.is_durable()), (1, 2, false));
    assert_eq!(q.counters().items, 2);
    assert!(b.poll("jobs", 5, None, 1, 0).unwrap().is_empty(), "not yet on disk");
    assert!(q.peek(0).0.unwrap().is_none());
    unsynced.wait().unwrap();
    assert_eq!(payloads(&b.poll("jobs", 5, None, 1, 0).unwrap()), [b"a".to_vec(), b"b".to_vec()]);

    // Many producers: the queue's lock is not held across a sync, so syncs cover several offers.
    let syncs_before = q.log_stats().unwrap().syncs;
    let (producers, each) = (16, 50);
    std::thread::scope(|s| {
        for p in 0..producers {
            let b = &b;
            s.spawn(move || {
                let q = b.queue("jobs").unwrap();
                for i in 0..each {
                    b.offer_to(&q, &mut msgs(&[&format!("{p}-{i}")]), 0).unwrap();
                }
            });
        }
    });
    let syncs = q.log_stats().unwrap().syncs - syncs_before;
    let offers = (producers * each) as u64;
    assert!(syncs <= offers / 2, "{syncs} syncs for {offers} offers");
    let taken = b.poll("jobs", 10_000, None, 1, 0).unwrap();
    assert_eq!(taken.len() as u64, offers, "every offer, once");
    // Each producer's offers in its order.
    for p in 0..producers {
        let mine: Vec<Vec<u8>> =
            payloads(&taken).into_iter().filter(|m| m.starts_with(format!("{p}-").as_bytes())).collect();
        let expected: Vec<Vec<u8>> = (0..each).map(|i| format!("{p}-{i}").into_bytes()).collect();
        assert_eq!(mine, expected);
    }
}

/// A log's first keyed offer makes the log's `dedup` group before it stores anything: an offer
/// whose group cannot be made stores nothing, and its retry stores the message once.
#[test]
fn a_keyed_offer_that_cannot_make_its_dedup_group_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    // In the way of the group's cursor file (written there first): a directory.
    let blocker = dir.path().join("queues/jobs/groups/dedup.cursor.tmp");
    std::fs::create_dir_all(&blocker).unwrap();
    let keyed = || vec![Message { idempotency_key: "once".into(), ..Message::new(&b"x"[..]) }];
    assert!(b.offer("jobs", keyed(), 1).is_err());
    assert_eq!(b.queue("jobs").unwrap().counters().items, 0);
    std::fs::remove_dir(&blocker).unwrap();
    b.offer("jobs", keyed(), 2).unwrap();
    drop(b);
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(payloads(&b.poll("jobs", 10, None, 1, 3).unwrap()), [b"x".to_vec()], "stored once");
}

/// A retried offer whose originals are in two priority levels' logs, neither yet on disk, is
/// answered only once both are: it syncs both logs, not only the one of its last original.
#[test]
fn a_repeat_of_originals_in_two_levels_waits_for_both_logs() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { durability: petrel_log::Durability::Always, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    let config = QueueConfig { durable: true, priorities: 2, ..QueueConfig::default() };
    let q = b.create_queue("jobs", config, None).unwrap();
    let keyed = |key: &str, priority| Message { idempotency_key: key.into(), priority, ..Message::new(&b"x"[..]) };
    let Offered { first_id: low_id, unsynced: low, .. } = b.offer_unsynced(&q, &mut vec![keyed("k1", 0)], 0).unwrap();
    let high = b.offer_unsynced(&q, &mut vec![keyed("k2", 1)], 0).unwrap().unsynced;
    let syncs = q.log_stats().unwrap().syncs;
    let Offered { first_id, count, repeats, unsynced: again } =
        b.offer_unsynced(&q, &mut vec![keyed("k1", 1), keyed("k2", 1)], 0).unwrap();
    assert_eq!((first_id, count, repeats), (low_id, 2, 2), "answered with the originals");
    again.wait().unwrap();
    assert_eq!(q.log_stats().unwrap().syncs - syncs, 2, "both levels' logs synced before the answer");
    low.wait().unwrap();
    high.wait().unwrap();
    assert_eq!(q.counters().items, 2, "stored once");

    // A repeat beside a new message: the new one's log and the original's.
    let low = b.offer_unsynced(&q, &mut vec![keyed("k3", 0)], 0).unwrap().unsynced;
    let syncs = q.log_stats().unwrap().syncs;
    let Offered { count, repeats, unsynced: mixed, .. } =
        b.offer_unsynced(&q, &mut vec![keyed("k3", 1), keyed("k4", 1)], 0).unwrap();
    assert_eq!((count, repeats), (1, 1), "the new message alone stored");
    mixed.wait().unwrap();
    assert_eq!(q.log_stats().unwrap().syncs - syncs, 2, "both levels' logs synced before the answer");
    low.wait().unwrap();
    assert_eq!(q.counters().items, 4);
}

#[test]
fn a_message_that_becomes_visible_after_a_tick_still_expires_on_time() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { durability: petrel_log::Durability::Always, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    let config = QueueConfig { durable: true, ttl_ms: 10, dead_letter: "dead".into(), ..QueueConfig::default() };
    let q = b.create_queue("q", config, None).unwrap();
    let unsynced = b.offer_unsynced(&q, &mut msgs(&["soon stale"]), 0).unwrap().unsynced;
    b.tick(MS); // sees no head yet: the message waits for the disk
    unsynced.wait().unwrap();
    b.tick(20 * MS);
    assert_eq!(payloads(&b.poll("dead", 5, None, 1, 20 * MS).unwrap()), [b"soon stale".to_vec()]);
}

/// `Message::durable` asks for the disk before the answer, whatever the log's policy: one sync
/// for an offer that asks, none for one that does not (policy `none`); a queue or topic that
/// keeps nothing on disk refuses it, as does a call; deliveries do not carry it.
#[test]
fn a_message_marked_durable_is_synced_before_its_offer_returns_and_refused_where_nothing_is_kept() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let syncs = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&syncs);
    let options = BrokerOptions {
        durability: petrel_log::Durability::None,
        on_sync: petrel_log::SyncObserver::new(move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        }),
        ..BrokerOptions::default()
    };
    let b = Broker::open(dir.path(), options).unwrap();
    b.create_queue("disk", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    b.create_queue("disk+copy", QueueConfig::default(), None).unwrap(); // a fanout child in memory
    b.create_queue("memory", QueueConfig::default(), None).unwrap();
    let durable = |payload: &str| Message { durable: true, ..Message::new(payload.as_bytes().to_vec()) };

    let before = syncs.load(Ordering::SeqCst);
    b.offer("disk", msgs(&["plain"]), 1).unwrap();
    assert_eq!(syncs.load(Ordering::SeqCst), before, "policy none: an ordinary offer is not synced");
    b.offer("disk", vec![durable("kept")], 1).unwrap();
    assert_eq!(syncs.load(Ordering::SeqCst), before + 1, "one sync for the offer that asked");
    let copies = b.queue("disk+copy").unwrap().counters();
    assert_eq!((copies.items, copies.dropped), (2, 0), "the child in memory takes its copy without the flag");

    let refused = b.offer("memory", vec![durable("x")], 1).unwrap_err();
    assert!(matches!(refused, BrokerError::BadRequest(ref why) if why.contains("durable queue")), "{refused}");
    assert_eq!(b.queue("memory").unwrap().counters().items, 0, "nothing stored");

    let polled = b.poll("disk", 10, None, 1, 2).unwrap();
    assert_eq!(payloads(&polled), [b"plain".to_vec(), b"kept".to_vec()]);
    assert!(polled.iter().all(|d| !d.message.durable), "deliveries do not carry the flag");

    b.create_topic("live", false).unwrap();
    assert!(matches!(b.publish("live", vec![durable("x")], 1), Err(BrokerError::BadRequest(_))));
    b.create_topic("kept", true).unwrap();
    let before = syncs.load(Ordering::SeqCst);
    b.publish("kept", vec![durable("t")], 1).unwrap();
    assert_eq!(syncs.load(Ordering::SeqCst), before + 1, "a durable topic syncs a message that asks");

    let replier: petrel_broker::Replier = Box::new(|_| {});
    let call = b.call(1, "f", durable("req"), false, 1, Duration::from_secs(1), replier);
    assert!(matches!(call, Err(BrokerError::BadRequest(_))), "a call is never stored");
}

/// `max_deliveries`: each delivery is counted on the message; the delivery that reaches the
/// limit and comes back (abort, visibility timeout, disconnect) moves the message to the
/// dead-letter queue with the reason and count in headers; other messages are untouched. On
/// disk, the count survives reopening the broker.
#[test]
fn a_message_returned_max_deliveries_times_goes_to_the_dead_letter_queue_with_its_count() {
    let dead = |b: &Broker| b.queue("jobs.dead").map_or(0, |q| q.counters().items);
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let config =
            QueueConfig { durable, max_deliveries: 3, dead_letter: "jobs.dead".into(), ..QueueConfig::default() };
        let mut b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("jobs", config.clone(), None).unwrap();
        b.offer("jobs", msgs(&["poison", "fine"]), 1).unwrap();
        // Delivery 1, aborted; delivery 2, its visibility timeout passes.
        let d = b.poll("jobs", 1, VIS, 7, 2).unwrap();
        assert_eq!((payloads(&d), d[0].message.deliveries), (vec![b"poison".to_vec()], 1), "durable {durable}");
        assert_eq!(b.abort("jobs", &[d[0].handle], 7, 0, 3).unwrap(), 1);
        let d = b.poll("jobs", 1, VIS, 7, 4).unwrap();
        assert_eq!(d[0].message.deliveries, 2, "durable {durable}");
        b.tick(4 + 200 * MS);
        if durable {
            // The count survives a restart (in-flight reads do not: delivery 3 starts afresh).
            drop(b);
            b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        }
        // Delivery 3, its consumer goes away: the limit.
        let d = b.poll("jobs", 1, VIS, 8, 5).unwrap();
        assert_eq!((payloads(&d), d[0].message.deliveries), (vec![b"poison".to_vec()], 3), "durable {durable}");
        assert_eq!(dead(&b), 0);
        b.disconnect(8, 1);
        assert_eq!(dead(&b), 1, "durable {durable}: moved at the third return");
        let moved = b.poll("jobs.dead", 1, None, 9, 6).unwrap();
        let header = |name: &str| {
            moved[0]
                .message
                .headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        assert_eq!(payloads(&moved), [b"poison".to_vec()]);
        assert_eq!(header(petrel_broker::DEAD_LETTER_REASON).as_deref(), Some("max_deliveries"));
        assert_eq!(header(petrel_broker::DEAD_LETTER_DELIVERIES).as_deref(), Some("3"));
        assert_eq!(moved[0].message.deliveries, 1, "a fresh count in the dead-letter queue");
        let q = b.queue("jobs").unwrap();
        assert_eq!((q.counters().dead_lettered, q.counters().items), (1, 1), "durable {durable}");
        // The other message was never returned: its first delivery, then acknowledged.
        let d = b.poll("jobs", 1, VIS, 7, 7).unwrap();
        assert_eq!((payloads(&d), d[0].message.deliveries), (vec![b"fine".to_vec()], 1));
        b.ack("jobs", &[d[0].handle], 7).unwrap();
        assert_eq!(q.counters().items, 0, "durable {durable}: the return markers are not messages");
        assert!(b.poll("jobs", 1, None, 7, 8).unwrap().is_empty());
        if durable {
            drop((q, b));
            let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
            assert_eq!(b.queue("jobs").unwrap().counters().items, 0, "nothing comes back after a reopen");
            assert_eq!(dead(&b), 0);
        }
    }
    // An operator's return of a stuck read counts as a delivery that came back.
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let once = QueueConfig { max_deliveries: 1, dead_letter: "jobs.dead".into(), ..QueueConfig::default() };
    let q = b.create_queue("jobs", once, None).unwrap();
    b.offer("jobs", msgs(&["stuck"]), 1).unwrap();
    let d = b.poll("jobs", 1, VIS, 7, 2).unwrap();
    assert!(b.return_read(&q, d[0].handle, 3).unwrap());
    assert_eq!((q.counters().items, dead(&b)), (0, 1), "returned at its limit: dead-lettered");
    let nowhere = QueueConfig { max_deliveries: 2, ..QueueConfig::default() };
    assert!(matches!(b.create_queue("q", nowhere, None), Err(BrokerError::BadRequest(e)) if e.contains("dead_letter")));
}

fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

fn at(priority: u8, items: &[&str]) -> Vec<Message> {
    msgs(items).into_iter().map(|m| Message { priority, ..m }).collect()
}

fn keyed(pairs: &[(&str, &str)]) -> Vec<Message> {
    pairs
        .iter()
        .map(|(key, p)| Message { idempotency_key: (*key).into(), ..Message::new(p.as_bytes().to_vec()) })
        .collect()
}

#[test]
fn polls_take_the_highest_priority_first_in_offer_order_within_a_level_across_a_restart() {
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        // A share of 25 %: one take in four goes to a lower level while one waits.
        let config = QueueConfig { durable, priorities: 3, priority_share: 25, ..QueueConfig::default() };
        let mut b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("work", config.clone(), None).unwrap();
        let (low_first, _) = b.offer("work", at(0, &["low-1", "low-2"]), 1).unwrap();
        b.offer("work", at(9, &["urgent-1"]), 2).unwrap(); // above the highest level: clamped to it
        b.offer("work", at(1, &["mid-1"]), 3).unwrap();
        b.offer("work", at(2, &["urgent-2", "urgent-3", "urgent-4", "urgent-5"]), 4).unwrap();
        let mixed = vec![Message { priority: 2, ..Message::new(&b"x"[..]) }, Message::new(&b"y"[..])];
        assert!(matches!(b.offer("work", mixed, 5), Err(BrokerError::BadRequest(e)) if e.contains("one priority")));
        if durable {
            drop(b);
            b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
            assert!(dir.path().join("queues/work/priority-2").is_dir());
        }
        let q = b.queue("work").unwrap();
        assert_eq!(q.counters().items, 8, "durable {durable}");
        let d = b.poll("work", 8, VIS, 1, 6).unwrap();
        // Three from the top, then the lower levels' longest waiting (low-1, offered first),
        // then the top again (two left), then the next highest level, then the lowest.
        let got: Vec<String> = d.iter().map(|d| String::from_utf8_lossy(&d.message.payload).into_owned()).collect();
        assert_eq!(
            got,
            ["urgent-1", "urgent-2", "urgent-3", "low-1", "urgent-4", "urgent-5", "mid-1", "low-2"],
            "durable {durable}"
        );
        assert_eq!(d[0].message.priority, 2);
        assert_eq!((d[3].message.priority, d[3].message.id), (0, low_first));
        let ids: std::collections::HashSet<u64> = d.iter().map(|d| d.message.id).collect();
        assert_eq!(ids.len(), 8, "ids are unique across levels");
        // An aborted message goes back to the head of its own level.
        let urgent = d.iter().find(|d| d.message.payload == "urgent-3").unwrap();
        let low = d.iter().find(|d| d.message.payload == "low-2").unwrap();
        b.abort("work", &[low.handle, urgent.handle], 1, 0, 7).unwrap();
        // (The share's turn comes first: three takes from the top since low-1.)
        let again = b.poll("work", 2, None, 1, 8).unwrap();
        assert_eq!(payloads(&again), [b"low-2".to_vec(), b"urgent-3".to_vec()], "durable {durable}");
        assert_eq!((again[0].message.deliveries, again[1].message.deliveries), (2, 2));
        let rest: Vec<u64> =
            d.iter().filter(|x| x.handle != low.handle && x.handle != urgent.handle).map(|d| d.handle).collect();
        assert_eq!(b.ack("work", &rest, 1).unwrap(), 6);
        assert_eq!(q.counters().items, 0);
        // The number of levels is the queue's kind: a reload cannot change it.
        let fewer = QueueConfig { priorities: 2, ..config.clone() };
        assert!(!petrel_broker::config::changes_live(&config, &fewer));
    }
}

#[test]
fn a_durable_queue_reopened_with_fewer_levels_than_its_logs_is_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        let config = QueueConfig { durable: true, priorities: 3, ..QueueConfig::default() };
        b.create_queue("work", config, None).unwrap();
        b.offer("work", at(2, &["urgent"]), 1).unwrap();
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.remove_queue("work").unwrap();
    std::fs::create_dir_all(dir.path().join("queues/work/priority-2")).unwrap();
    let plain = QueueConfig { durable: true, ..QueueConfig::default() };
    let Err(refused) = b.create_queue("work", plain, None) else { panic!("opened with fewer levels") };
    assert!(refused.to_string().contains("priority 2"), "{refused}");
}

#[test]
fn a_start_refused_for_a_configuration_keeps_the_stored_one() {
    // A configuration file with fewer levels than the queue's messages use is refused; the
    // stored definition was rewritten all the same, so the queue could not start again without
    // that very block put back exactly.
    let dir = tempfile::tempdir().unwrap();
    let three = QueueConfig { durable: true, priorities: 3, ..QueueConfig::default() };
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("work", three.clone(), None).unwrap();
        b.offer("work", at(2, &["urgent"]), 1).unwrap();
    }
    let fewer = QueueConfig { priorities: 2, ..three.clone() };
    let configured = |config: &QueueConfig| BrokerOptions {
        queues: [("work".to_owned(), config.clone())].into_iter().collect(),
        ..BrokerOptions::default()
    };
    let Err(refused) = Broker::open(dir.path(), configured(&fewer)) else { panic!("opened with fewer levels") };
    assert!(refused.to_string().contains("priority 2"), "{refused}");
    // Without the block (the stored definition applies), the queue opens as it was.
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(*b.queue("work").unwrap().config(), three);
    assert_eq!(payloads(&b.poll("work", 10, None, 1, 2).unwrap()), [b"urgent".to_vec()]);
}

#[test]
fn a_repeated_idempotency_key_is_stored_once_and_answered_with_the_original_id_across_a_restart() {
    // Real time: a durable queue's records carry the log's clock, and keys rebuilt from them too.
    let t0 = now_ns();
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let config = QueueConfig { durable, dedup_window: 3, dedup_window_ms: 1_000, ..QueueConfig::default() };
        let mut b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("orders", config, None).unwrap();
        let first = b.offer("orders", keyed(&[("a", "A"), ("b", "B")]), t0 + MS).unwrap();
        assert_eq!(first, (1, 2));
        // The same batch again: the same answer, nothing stored.
        assert_eq!(b.offer("orders", keyed(&[("a", "A"), ("b", "B")]), t0 + 2 * MS).unwrap(), first);
        // A repeat alone; a message without a key is never a repeat.
        assert_eq!(b.offer("orders", keyed(&[("b", "B")]), t0 + 3 * MS).unwrap(), (2, 1));
        assert_eq!(b.offer("orders", msgs(&["plain"]), t0 + 3 * MS).unwrap(), (3, 1));
        // A batch mixing a repeat and new messages (one key twice): only the new one is stored.
        assert_eq!(b.offer("orders", keyed(&[("a", "A"), ("c", "C"), ("c", "C2")]), t0 + 4 * MS).unwrap(), (4, 1));
        let q = b.queue("orders").unwrap();
        assert_eq!((q.counters().items, q.counters().deduplicated), (4, 5), "durable {durable}");
        // Consumed messages' keys are still remembered.
        let d = b.poll("orders", 10, None, 1, t0 + 5 * MS).unwrap();
        assert_eq!(payloads(&d), [b"A".to_vec(), b"B".to_vec(), b"plain".to_vec(), b"C".to_vec()]);
        assert_eq!(d[0].message.idempotency_key, "a", "a delivery carries its key");
        if durable {
            drop((q, b));
            b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        }
        let q = b.queue("orders").unwrap();
        assert_eq!(q.counters().dedup_keys, 3, "durable {durable}: a, b, c rebuilt from the log");
        assert_eq!(b.offer("orders", keyed(&[("c", "C")]), t0 + 6 * MS).unwrap(), (4, 1), "durable {durable}");
        // The window holds three keys: a fourth forgets the oldest (a), at once.
        b.offer("orders", keyed(&[("d", "D")]), t0 + 7 * MS).unwrap();
        assert_eq!(q.counters().dedup_keys, 3, "durable {durable}: never more than the window");
        let again = b.offer("orders", keyed(&[("a", "A")]), t0 + 8 * MS).unwrap();
        assert_eq!(again, (6, 1), "durable {durable}: a is new again");
        // And after the window's time (1 s) every key is forgotten, by the tick.
        b.tick(t0 + 2_000 * MS);
        assert_eq!(q.counters().dedup_keys, 0);
        assert_eq!(b.offer("orders", keyed(&[("d", "D")]), t0 + 2_001 * MS).unwrap(), (7, 1));
        let too_long = keyed(&[(&"k".repeat(257), "x")]);
        assert!(matches!(b.offer("orders", too_long, t0 + 2_002 * MS), Err(BrokerError::BadRequest(_))));
    }
}

/// A key a start took back from the log stays remembered at the next: a larger window
/// configured after the window forgot a key brings it back from its record at a restart, and
/// from then on the record is kept for it, so that consuming the queue does not make a later
/// start forget a key still inside the window.
#[test]
fn a_key_a_restart_took_back_from_the_log_is_remembered_at_the_next_one_too() {
    let dir = tempfile::tempdir().unwrap();
    let short = QueueConfig { durable: true, dedup_window_ms: 50, ..QueueConfig::default() };
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_queue("orders", short.clone(), None).unwrap();
    assert_eq!(b.offer("orders", keyed(&[("a", "A")]), now_ns()).unwrap(), (1, 1));
    std::thread::sleep(Duration::from_millis(100));
    b.offer("orders", keyed(&[("b", "B"), ("c", "C")]), now_ns()).unwrap();
    b.tick(now_ns());
    assert_eq!(b.queue("orders").unwrap().counters().dedup_keys, 2, "a forgotten by time");
    let longer = QueueConfig { dedup_window_ms: 60_000, ..short };
    b.reconfigure_queues(QueueConfig::default(), [("orders".to_owned(), longer)].into()).unwrap();
    drop(b);
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.queue("orders").unwrap().counters().dedup_keys, 3, "a, back from its record");
    assert_eq!(b.poll("orders", 10, None, 1, now_ns()).unwrap().len(), 3, "all consumed");
    drop(b);
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.queue("orders").unwrap().counters().dedup_keys, 3, "a still remembered");
    assert_eq!(b.offer("orders", keyed(&[("a", "A")]), now_ns()).unwrap(), (1, 1), "a repeat of a");
}

#[test]
fn a_key_twice_in_a_large_offer_is_stored_once() {
    // Past 32 keys an offer's own repeats are found by a set rather than a scan.
    let t0 = now_ns();
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_queue("orders", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let keys: Vec<String> = (0..40).map(|i| format!("k{}", i % 39)).collect();
    let pairs: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "x")).collect();
    assert_eq!(b.offer("orders", keyed(&pairs), t0 + MS).unwrap(), (1, 39));
    assert_eq!(b.queue("orders").unwrap().counters().deduplicated, 1);
}

#[test]
fn keys_that_older_builds_stored_as_a_header_are_remembered_on_open() {
    let t0 = now_ns();
    let dir = tempfile::tempdir().unwrap();
    let config = QueueConfig { durable: true, ..QueueConfig::default() };
    Broker::open(dir.path(), BrokerOptions::default()).unwrap().create_queue("orders", config, None).unwrap();
    {
        // A record as builds before the fifth session wrote a keyed offer: the key in "ik".
        let mut log = petrel_log::Log::open(dir.path().join("queues/orders"), petrel_log::Options::default()).unwrap();
        let headers = [("ik", &b"old-key"[..])];
        let input = petrel_log::Input { key: None, headers: &headers, payload: b"old", timestamp: Some(t0) };
        log.append_with(&input).unwrap();
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.queue("orders").unwrap().counters().dedup_keys, 1);
    assert_eq!(b.offer("orders", keyed(&[("old-key", "again")]), t0 + MS).unwrap(), (1, 1), "a repeat");
    assert_eq!(b.offer("orders", keyed(&[("new-key", "new")]), t0 + MS).unwrap(), (2, 1));
    let d = b.poll("orders", 10, None, 1, t0 + 2 * MS).unwrap();
    assert_eq!(payloads(&d), [b"old".to_vec(), b"new".to_vec()]);
    assert_eq!((d[0].message.idempotency_key.as_str(), d[1].message.idempotency_key.as_str()), ("old-key", "new-key"));
}

#[test]
fn a_durable_queue_keeps_the_records_of_remembered_keys_on_disk_after_they_are_consumed() {
    let t0 = now_ns();
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { segment_bytes: 64 * 1024, ..BrokerOptions::default() };
    let config = QueueConfig { durable: true, dedup_window: 1_000_000, ..QueueConfig::default() };
    let payload = "p".repeat(1000);
    {
        let b = Broker::open(dir.path(), options.clone()).unwrap();
        b.create_queue("orders", config.clone(), None).unwrap();
        b.offer("orders", keyed(&[("first", &payload)]), t0 + MS).unwrap();
        // Enough to roll many segments, all consumed: retention could take the first one.
        for i in 0..300 {
            b.offer("orders", msgs(&[&payload]), t0 + MS + i).unwrap();
            b.poll("orders", 10, None, 1, t0 + MS + i).unwrap();
        }
        b.poll("orders", 10, None, 1, t0 + 2 * MS).unwrap();
    }
    let b = Broker::open(dir.path(), options.clone()).unwrap();
    let dedup_group = dir.path().join("queues/orders/groups/dedup.cursor");
    assert!(dedup_group.exists(), "a group keeps the records of remembered keys");
    assert_eq!(b.offer("orders", keyed(&[("first", &payload)]), t0 + 3 * MS).unwrap(), (1, 1), "still remembered");
    // Once the key is forgotten, the dedup group moves on and retention takes the old segments.
    let q = b.queue("orders").unwrap();
    let before = q.log_stats().unwrap().segments;
    b.tick(t0 + 3 * MS + 121_000 * MS);
    assert_eq!(q.counters().dedup_keys, 0);
    assert!(!dedup_group.exists(), "no key left: no group (one standing still would keep every segment)");
    for i in 0..100 {
        b.offer("orders", msgs(&[&payload]), t0 + 200_000 * MS + i).unwrap();
        b.poll("orders", 10, None, 1, t0 + 200_000 * MS + i).unwrap();
    }
    assert!(q.log_stats().unwrap().segments < before, "{} segments, {before} before", q.log_stats().unwrap().segments);
}

#[test]
fn a_repeat_is_answered_only_once_its_original_is_as_durable_as_the_repeat_asks() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let syncs = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&syncs);
    let options = BrokerOptions {
        durability: petrel_log::Durability::None,
        on_sync: petrel_log::SyncObserver::new(move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        }),
        ..BrokerOptions::default()
    };
    let b = Broker::open(dir.path(), options).unwrap();
    b.create_queue("orders", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let before = syncs.load(Ordering::SeqCst);
    assert_eq!(b.offer("orders", keyed(&[("a", "A")]), 1).unwrap(), (1, 1));
    assert_eq!(syncs.load(Ordering::SeqCst), before, "policy none: the original is not synced");
    let retry = vec![Message { durable: true, ..keyed(&[("a", "A")]).remove(0) }];
    assert_eq!(b.offer("orders", retry, 2).unwrap(), (1, 1), "the original's id");
    assert_eq!(syncs.load(Ordering::SeqCst), before + 1, "the repeat that asks for the disk syncs the original");
    assert_eq!(b.queue("orders").unwrap().counters().items, 1);
}

#[test]
fn dead_letters_of_several_priorities_reach_a_dead_letter_queue_with_levels() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let levels = QueueConfig { priorities: 3, ..QueueConfig::default() };
    b.create_queue("late", levels.clone(), None).unwrap();
    b.create_queue("work", QueueConfig { dead_letter: "late".into(), ..levels }, None).unwrap();
    let expiring =
        |priority: u8, text: &str| Message { priority, expires_at: 5 * MS, ..Message::new(text.as_bytes().to_vec()) };
    b.offer("work", vec![expiring(0, "low")], MS).unwrap();
    b.offer("work", vec![expiring(2, "urgent")], MS).unwrap();
    b.tick(10 * MS); // both expire in one tick: one move, two priorities
    let moved = b.poll("late", 10, None, 1, 11 * MS).unwrap();
    assert_eq!(payloads(&moved), [b"urgent".to_vec(), b"low".to_vec()], "both moved, each at its level");
}

fn delayed(ms: u32, items: &[&str]) -> Vec<Message> {
    msgs(items).into_iter().map(|m| Message { delay_ms: ms, ..m }).collect()
}

fn texts(ds: &[petrel_broker::Delivery]) -> Vec<String> {
    ds.iter().map(|d| String::from_utf8_lossy(&d.message.payload).into_owned()).collect()
}

/// The ticker waits on the broker's alarm: a ring is kept until it waits (none is lost while it
/// ticks), a wait without one lasts until its planned time, work that came due during the tick
/// shortens the wait to its time (without waking anyone), a delayed offer due before the
/// planned tick wakes a waiting ticker from another thread, and one due after it does not.
#[test]
fn the_tick_alarm_ends_the_tickers_wait_when_work_comes_due_sooner() {
    use std::time::Instant;
    let dir = tempfile::tempdir().unwrap();
    let b = std::sync::Arc::new(Broker::open(dir.path(), BrokerOptions::default()).unwrap());
    b.create_queue("q", QueueConfig::default(), None).unwrap();
    let alarm = b.alarm();
    alarm.ring();
    let t = Instant::now();
    alarm.wait_until(now_ns() + 30_000 * MS, now_ns);
    assert!(t.elapsed() < Duration::from_secs(10), "a ring before the wait ends it at once");
    let t = Instant::now();
    alarm.wait_until(now_ns() + 30 * MS, now_ns);
    assert!(t.elapsed() >= Duration::from_millis(30), "the ring was taken: this wait lasts until its time");

    // Due after the planned tick: the wait lasts until its time.
    alarm.start_tick();
    b.offer("q", delayed(120_000, &["after the tick"]), now_ns()).unwrap();
    let t = Instant::now();
    alarm.wait_until(now_ns() + 30 * MS, now_ns);
    assert!(t.elapsed() >= Duration::from_millis(30), "due after the planned tick: no earlier end");
    // Due during the tick, before its planned next: the wait ends then.
    alarm.start_tick();
    b.offer("q", delayed(100, &["during the tick"]), now_ns()).unwrap();
    let t = Instant::now();
    alarm.wait_until(now_ns() + 60_000 * MS, now_ns);
    assert!(t.elapsed() >= Duration::from_millis(90), "not before it is due: {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(10), "due before the planned tick: the wait ends then");
    // Due while the ticker waits, before its planned next: it is woken.
    alarm.start_tick();
    let offerer = {
        let b = std::sync::Arc::clone(&b);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            b.offer("q", delayed(100, &["before the tick"]), now_ns()).unwrap();
        })
    };
    let t = Instant::now();
    alarm.wait_until(now_ns() + 60_000 * MS, now_ns);
    assert!(t.elapsed() >= Duration::from_millis(100), "not before it is due: {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(10), "due before the planned tick: woken");
    offerer.join().unwrap();
}

#[test]
fn delayed_messages_are_invisible_until_due_then_join_the_tail_across_a_restart() {
    let t0 = now_ns();
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let config = QueueConfig { durable, priorities: 2, ..QueueConfig::default() };
        let mut b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", config, None).unwrap();
        b.offer("q", msgs(&["now-1"]), t0).unwrap();
        let (later_id, n) = b.offer("q", delayed(100, &["later-1", "later-2"]), t0).unwrap();
        assert_eq!(n, 2);
        let at = vec![Message { deliver_at: t0 + 50 * MS, priority: 1, ..Message::new(&b"sooner"[..]) }];
        b.offer("q", at, t0).unwrap();
        // A deliver_at already past is no delay.
        b.offer("q", vec![Message { deliver_at: t0 - MS, ..Message::new(&b"now-2"[..]) }], t0).unwrap();
        let mixed = vec![Message::new(&b"x"[..]), Message { delay_ms: 5, ..Message::new(&b"y"[..]) }];
        assert!(matches!(b.offer("q", mixed, t0), Err(BrokerError::BadRequest(e)) if e.contains("delayed")));
        let too_late = vec![Message { deliver_at: t0 + 400 * 24 * 3600 * 1000 * MS, ..Message::new(&b"z"[..]) }];
        assert!(matches!(b.offer("q", too_late, t0), Err(BrokerError::BadRequest(_))));
        let st = b.queue("q").unwrap().status();
        assert_eq!((st.items, st.delayed, st.bytes), (2, 3, 30), "durable {durable}");
        assert_eq!(texts(&b.poll("q", 10, None, 1, t0 + MS).unwrap()), ["now-1", "now-2"]);
        b.tick(t0 + 49 * MS);
        assert!(b.poll("q", 10, None, 1, t0 + 49 * MS).unwrap().is_empty(), "durable {durable}: not due yet");
        if durable {
            drop(b);
            b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
            assert!(dir.path().join("queues/q/delayed").is_dir());
            let st = b.queue("q").unwrap().status();
            assert_eq!((st.items, st.delayed, st.bytes), (0, 3, 20), "delayed messages survive a restart");
        }
        b.tick(t0 + 50 * MS);
        let d = b.poll("q", 10, None, 1, t0 + 50 * MS).unwrap();
        assert_eq!(texts(&d), ["sooner"], "durable {durable}");
        assert_eq!((d[0].message.deliver_at, d[0].message.priority, d[0].message.deliveries), (t0 + 50 * MS, 1, 1));
        b.tick(t0 + 100 * MS);
        let d = b.poll("q", 10, None, 1, t0 + 100 * MS).unwrap();
        assert_eq!(texts(&d), ["later-1", "later-2"], "durable {durable}");
        assert_eq!(d[0].message.deliver_at, t0 + 100 * MS);
        // In memory it joins its level with an id there; on disk it is handed out from the
        // delayed log, with the id the offer gave it.
        assert_eq!(d[0].message.id == later_id, durable, "durable {durable}");
        let st = b.queue("q").unwrap().status();
        assert_eq!((st.items, st.delayed, st.bytes, st.total_offered), (0, 0, 0, if durable { 0 } else { 5 }));
    }
}

/// Producers offering at once read their clocks before the queue's lock: a message delayed
/// after another but due a little (under 1 ms) before it comes due with it, and after it (so
/// that a tick releases them as one run, in offer order). One due a whole ms or more before
/// keeps its time, and so does a `deliver_at`; none comes due before it asked.
#[test]
fn delayed_offers_out_of_clock_order_come_due_in_offer_order_and_never_early() {
    let t0 = now_ns();
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", QueueConfig { durable, ..QueueConfig::default() }, None).unwrap();
        b.offer("q", delayed(10, &["a1", "a2"]), t0 + 300_000).unwrap(); // due t0 + 10.3 ms
        b.offer("q", delayed(10, &["b1", "b2"]), t0).unwrap(); // asked t0 + 10 ms
        b.offer("q", delayed(8, &["c"]), t0).unwrap(); // asked t0 + 8 ms
        let at = vec![Message { deliver_at: t0 + 10 * MS + 100_000, ..Message::new(&b"d"[..]) }];
        b.offer("q", at, t0).unwrap();
        b.tick(t0 + 10 * MS + 100_000);
        let d = b.poll("q", 10, None, 1, t0 + 10 * MS + 100_000).unwrap();
        assert_eq!(texts(&d), ["c", "d"], "durable {durable}");
        assert_eq!((d[0].message.deliver_at, d[1].message.deliver_at), (t0 + 8 * MS, t0 + 10 * MS + 100_000));
        b.tick(t0 + 10 * MS + 300_000);
        let d = b.poll("q", 10, None, 1, t0 + 10 * MS + 300_000).unwrap();
        assert_eq!(texts(&d), ["a1", "a2", "b1", "b2"], "durable {durable}");
        assert!(d.iter().all(|x| x.message.deliver_at == t0 + 10 * MS + 300_000));
    }
}

/// Released delayed messages taken for good are marked done in one `ctl.moved` marker per
/// hold of the queue's lock, not one each, and stay done across a restart; peeked, a released
/// message shows the deliveries a waiting one does (none yet), and polled, this one.
#[test]
fn released_messages_taken_together_are_marked_done_together_and_peek_as_waiting_ones_do() {
    let t0 = now_ns();
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let items: Vec<String> = (0..100).map(|i| i.to_string()).collect();
    b.offer("q", delayed(1, &items.iter().map(String::as_str).collect::<Vec<_>>()), t0).unwrap();
    b.tick(t0 + 2 * MS); // all released: one `ctl.released` marker
    let head = b.peek(&b.queue("q").unwrap(), t0 + 2 * MS).unwrap().unwrap();
    assert_eq!((&head.payload[..], head.deliveries), (&b"0"[..], 0));
    let got = b.poll("q", 100, None, 1, t0 + 2 * MS).unwrap();
    assert_eq!((got.len(), got[0].message.deliveries), (100, 1));
    drop(b);
    let delayed_log = petrel_log::Log::open(dir.path().join("queues/q/delayed"), petrel_log::Options::default());
    assert_eq!(delayed_log.unwrap().next_offset(), 100 + 1 + 1, "the messages, one release, one marker for all");
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.tick(t0 + 3 * MS);
    assert!(b.poll("q", 100, None, 1, t0 + 3 * MS).unwrap().is_empty(), "done for good");
    assert_eq!(b.queue("q").unwrap().status().items, 0);
}

/// Due messages handed out from a durable queue's delayed log are bounded in flight as a level's
/// log bounds its own: a consumer that takes and never acknowledges holds at most
/// `MAX_PENDING` of them, and gets more as it acknowledges.
#[test]
fn released_delayed_messages_in_flight_are_bounded_as_a_levels_are() {
    let t0 = now_ns();
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let n = petrel_log::MAX_PENDING + 1_000;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
        let batch = chunk.iter().map(|i| Message { delay_ms: 1, ..Message::new(i.to_string().into_bytes()) }).collect();
        b.offer("q", batch, t0).unwrap();
    }
    b.tick(t0 + 2 * MS);
    let vis = Some(Duration::from_secs(60));
    let taken = b.poll("q", n, vis, 1, t0 + 2 * MS).unwrap();
    assert_eq!(taken.len(), petrel_log::MAX_PENDING, "no more out than a level's log allows");
    assert_eq!(texts(&taken[..2]), ["0", "1"]);
    assert!(b.poll("q", 10, vis, 1, t0 + 2 * MS).unwrap().is_empty());
    let handles: Vec<u64> = taken[..10].iter().map(|d| d.handle).collect();
    assert_eq!(b.ack("q", &handles, 1).unwrap(), 10);
    let more = b.poll("q", 100, vis, 1, t0 + 2 * MS).unwrap();
    assert_eq!(texts(&more[..1]), [petrel_log::MAX_PENDING.to_string()], "in order, once acknowledged");
    assert_eq!(more.len(), 10);
}

#[test]
fn a_returned_message_waits_its_delay_doubling_to_a_cap_counted_to_its_dead_letter_across_a_restart() {
    let t0 = now_ns();
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let config = QueueConfig {
            durable,
            redelivery_delay_ms: 100,
            redelivery_delay_max_ms: 300,
            max_deliveries: 5,
            dead_letter: "dlq".into(),
            ..QueueConfig::default()
        };
        let mut b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", config, None).unwrap();
        b.create_queue("dlq", QueueConfig::default(), None).unwrap();
        b.offer("q", keyed(&[("k", "job")]), t0).unwrap();
        b.offer("q", msgs(&["other"]), t0).unwrap();
        let vis = Some(Duration::from_secs(3600));
        // Take it, give it back: 100 ms (the first delay), while "other" goes on.
        let mut now = t0;
        let take = |b: &Broker, now: u64| {
            let d = b.poll("q", 1, vis, 1, now).unwrap();
            assert_eq!(texts(&d), ["job"], "durable {durable} at {}", (now - t0) / MS);
            (d[0].handle, d[0].message.deliveries)
        };
        let (mut h, deliveries) = take(&b, now);
        assert_eq!(deliveries, 1);
        let mut expected = vec![];
        // Due 100 ms after the first return, 200 after the second, an abort's own delay wins,
        // then 800 capped at 300.
        for (explicit, wait) in [(0, 100), (0, 200), (1_000, 1_000), (0, 300)] {
            b.abort("q", &[h], 1, explicit, now).unwrap();
            if expected.is_empty() {
                let st = b.queue("q").unwrap().status();
                assert_eq!((st.items, st.delayed, st.in_flight), (1, 1, 0));
                assert_eq!(texts(&b.poll("q", 5, None, 2, now).unwrap()), ["other"]);
            }
            b.tick(now + (wait - 1) * MS);
            let early = b.poll("q", 1, vis, 1, now + (wait - 1) * MS).unwrap();
            assert!(early.is_empty(), "durable {durable}: early after {wait}: {:?}", texts(&early));
            now += wait * MS;
            if durable && explicit != 0 {
                drop(b);
                b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
                b.create_queue("dlq", QueueConfig::default(), None).unwrap();
            }
            b.tick(now);
            let (next, deliveries) = take(&b, now);
            (h, _) = (next, expected.push(deliveries));
        }
        // The fifth delivery comes back: to the dead-letter queue, at once.
        b.abort("q", &[h], 1, 0, now).unwrap();
        assert_eq!(expected, [2, 3, 4, 5], "durable {durable}: the count crosses the delays and the restart");
        let dead = b.poll("dlq", 5, None, 3, now).unwrap();
        assert_eq!(texts(&dead), ["job"], "durable {durable}");
        let count = dead[0].message.headers.iter().find(|(n, _)| n == petrel_broker::DEAD_LETTER_DELIVERIES);
        assert_eq!(count.map(|(_, v)| v.to_vec()), Some(b"5".to_vec()));
        let st = b.queue("q").unwrap().status();
        assert_eq!((st.items, st.delayed, st.in_flight, st.bytes), (0, 0, 0, 0), "durable {durable}");
        // Its key went with none of the copies: still the original's.
        assert_eq!(b.offer("q", keyed(&[("k", "job")]), now).unwrap(), (1, 1), "durable {durable}");
    }
}

#[test]
fn a_flush_drops_delayed_messages_too_and_full_counts_them() {
    let t0 = now_ns();
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", QueueConfig { durable, max_items: 3, ..QueueConfig::default() }, None).unwrap();
        b.offer("q", delayed(1_000, &["a", "b"]), t0).unwrap();
        b.offer("q", msgs(&["c"]), t0).unwrap();
        assert!(matches!(b.offer("q", msgs(&["d"]), t0), Err(BrokerError::Full(_))), "durable {durable}");
        assert_eq!(b.queue("q").unwrap().flush().unwrap(), 3);
        let st = b.queue("q").unwrap().status();
        assert_eq!((st.items, st.delayed, st.bytes), (0, 0, 0), "durable {durable}");
        b.tick(t0 + 2_000 * MS);
        assert!(b.poll("q", 5, None, 1, t0 + 2_000 * MS).unwrap().is_empty(), "durable {durable}: flushed for good");
        drop(b);
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        if durable {
            assert_eq!(b.queue("q").unwrap().status().delayed, 0, "flushed for good, across a restart");
        }
    }
}

/// The record a crash can leave behind: a copy in a level's log of a delayed message whose
/// `moved` marker was not written, or a delayed copy of a returned message whose original was
/// not acknowledged. Open repairs each so that the message is handed out once.
#[test]
fn open_repairs_a_copy_left_by_a_crash_between_the_copy_and_its_mark() {
    use petrel_log::{Input, Log, Options};
    let t0 = now_ns();
    let dir = tempfile::tempdir().unwrap();
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
        b.offer("q", delayed(60_000, &["moved"]), t0).unwrap(); // delayed log offset 0
        b.offer("q", msgs(&["taken"]), t0).unwrap(); // level 0 offset 0, id 1
        b.poll("q", 1, Some(Duration::from_secs(60)), 1, t0).unwrap(); // in flight at the "crash"
    }
    let options = || Options { lock_directory: false, ..Options::default() };
    let number = |v: u64| v.to_be_bytes();
    {
        // The copy of delayed offset 0 made it to level 0's log; its marker did not.
        let level = Log::open(dir.path().join("queues/q"), options()).unwrap().into_shared();
        let (from, due) = (number(0), number(t0));
        let headers = [("da", &due[..]), ("dm", &from[..])];
        level.append_with(&Input { key: None, headers: &headers, payload: b"moved", timestamp: None }).unwrap();
        // A delayed copy of "taken" made it to the delayed log; its original was not acknowledged.
        let delayed = Log::open(dir.path().join("queues/q/delayed"), options()).unwrap().into_shared();
        let (of, due, deliveries) = (number(1), number(t0 + 60_000 * MS), 1u32.to_be_bytes());
        let headers = [("da", &due[..]), ("dv", &deliveries[..]), ("rf", &of[..])];
        delayed.append_with(&Input { key: None, headers: &headers, payload: b"taken", timestamp: None }).unwrap();
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let st = b.queue("q").unwrap().status();
    assert_eq!((st.items, st.delayed), (2, 0), "each message once, where it can be handed out");
    assert_eq!(texts(&b.poll("q", 5, None, 1, t0).unwrap()), ["taken", "moved"]);
    b.tick(t0 + 120_000 * MS);
    assert!(b.poll("q", 5, None, 1, t0 + 120_000 * MS).unwrap().is_empty(), "and never again");
    drop(b);
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let st = b.queue("q").unwrap().status();
    assert_eq!((st.items, st.delayed), (0, 0), "the repairs were written down");
}

#[test]
fn many_delayed_messages_come_out_in_due_order_past_the_timers_memory() {
    // More than the timers hold (65,536), due in an order unlike their offers'.
    let t0 = now_ns();
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_queue("q", QueueConfig { durable: true, durability: "none".into(), ..QueueConfig::default() }, None)
        .unwrap();
    let n: u64 = 100_000;
    let due = |i: u64| t0 + (1 + (i * 7_919) % n) * MS / 10; // a permutation over 10 s, 0.1 ms apart
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let batch =
            chunk.iter().map(|&i| Message { deliver_at: due(i), ..Message::new(i.to_be_bytes().to_vec()) }).collect();
        b.offer("q", batch, t0).unwrap();
    }
    assert_eq!(b.queue("q").unwrap().status().delayed, n);
    let mut last_due = 0;
    let mut seen = 0;
    let mut now = t0;
    while seen < n {
        // A tick a millisecond, as the server's while a refill of the timers goes on (it reads
        // the log a slice per tick).
        now += MS;
        b.tick(now);
        loop {
            let d = b.poll("q", 1000, None, 1, now).unwrap();
            if d.is_empty() {
                break;
            }
            for x in &d {
                let i = u64::from_be_bytes(x.message.payload[..].try_into().unwrap());
                assert_eq!(x.message.deliver_at, due(i));
                assert!(due(i) <= now, "never early");
                assert!(due(i) + MS > now, "moved by the first tick after it was due");
                assert!(due(i) >= last_due, "in due order");
                last_due = due(i);
                seen += 1;
            }
        }
    }
    assert_eq!(b.queue("q").unwrap().status().delayed, 0);
}

/// Queues are created by first use from many connections at once: each name once, whoever
/// names it first, the others given that queue; creations of different names go on side by side
/// (their files are made outside the broker's lock), within `max_queues`.
#[test]
fn queues_created_at_once_by_many_threads_are_each_made_once_within_the_limit() {
    for max_queues in [0, 30] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions { max_queues, ..BrokerOptions::default() }).unwrap();
        let made: Vec<Vec<Option<std::sync::Arc<petrel_broker::Queue>>>> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..8)
                .map(|t| {
                    let b = &b;
                    s.spawn(move || {
                        // Each thread names the same 50 queues, in an order of its own.
                        let durable = QueueConfig { durable: true, ..QueueConfig::default() };
                        let name = |i: usize| format!("q{}", (i * 7 + t * 13) % 50);
                        (0..50).map(|i| b.create_queue(&name(i), durable.clone(), None).ok()).collect()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let expected = if max_queues == 0 { 50 } else { 30 };
        assert_eq!(b.queue_names().len(), expected, "max_queues {max_queues}");
        assert_eq!(b.queues_created(), expected as u64);
        for (t, queues) in made.iter().enumerate() {
            for (i, q) in queues.iter().enumerate() {
                let name = format!("q{}", (i * 7 + t * 13) % 50);
                match (q, b.queue(&name)) {
                    (Some(q), Some(kept)) => assert!(std::sync::Arc::ptr_eq(q, &kept), "one queue per name"),
                    (None, _) => assert!(max_queues != 0, "refused only past the limit"),
                    (Some(_), None) => panic!("{name} handed out but not kept"),
                }
            }
        }
        drop(b);
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        assert_eq!(b.queue_names().len(), expected, "each defined once on disk");
    }
}

#[test]
fn fanout_children_get_no_copy_of_a_repeat_the_parent_did_not_store() {
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("orders", QueueConfig { durable, ..QueueConfig::default() }, None).unwrap();
        // The child remembers keys for one second only: it cannot catch the repeat itself.
        let child = QueueConfig { durable, dedup_window_ms: 1_000, ..QueueConfig::default() };
        b.create_queue("orders+audit", child, None).unwrap();
        let t0 = now_ns();
        let (first, _) = b.offer("orders", keyed(&[("k", "a")]), t0).unwrap();
        // The producer retries two seconds later: a repeat, and one new message beside it.
        b.offer("orders", keyed(&[("k", "a"), ("l", "b")]), t0 + 2_000 * MS).unwrap();
        let (again, _) = b.offer("orders", keyed(&[("k", "a")]), t0 + 3_000 * MS).unwrap();
        assert_eq!(again, first, "answered with the original's id");
        let t = t0 + 4_000 * MS;
        assert_eq!(payloads(&b.poll("orders", 10, None, 1, t).unwrap()), [b"a".to_vec(), b"b".to_vec()]);
        let copies = payloads(&b.poll("orders+audit", 10, None, 1, t).unwrap());
        assert_eq!(copies, [b"a".to_vec(), b"b".to_vec()], "durable {durable}");
    }
}

/// The other way round: a parent that forgets a key sooner than its child stores the key's new
/// message, and the child gets its copy (its own, longer window dropped it as a repeat).
#[test]
fn a_fanout_child_gets_every_message_its_parent_stores_whatever_its_own_window() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_queue("orders", QueueConfig { dedup_window_ms: 1_000, ..QueueConfig::default() }, None).unwrap();
    b.create_queue("orders+audit", QueueConfig::default(), None).unwrap(); // remembers 2 minutes
    let t0 = now_ns();
    b.offer("orders", keyed(&[("k", "a")]), t0).unwrap();
    b.offer("orders", keyed(&[("k", "b")]), t0 + 10_000 * MS).unwrap(); // the parent forgot k
    let t = t0 + 11_000 * MS;
    assert_eq!(payloads(&b.poll("orders", 10, None, 1, t).unwrap()), [b"a".to_vec(), b"b".to_vec()]);
    assert_eq!(payloads(&b.poll("orders+audit", 10, None, 1, t).unwrap()), [b"a".to_vec(), b"b".to_vec()]);
}

#[test]
fn a_dead_letter_of_a_message_at_the_size_limit_is_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { max_message_bytes: 100, ..BrokerOptions::default() }).unwrap();
    let config = QueueConfig { ttl_ms: 10, dead_letter: "dead".into(), ..QueueConfig::default() };
    b.create_queue("q", config, None).unwrap();
    b.offer("q", vec![Message::new(vec![7u8; 100])], MS).unwrap();
    b.tick(20 * MS);
    let dead = b.poll("dead", 5, None, 1, 21 * MS).unwrap();
    assert_eq!(dead.len(), 1, "moved, though its reason header takes it past the limit");
    assert_eq!(dead[0].message.payload.len(), 100);
}

#[test]
fn a_connection_cannot_take_over_another_connections_temporary_queue() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let temporary = QueueConfig { temporary: true, ..QueueConfig::default() };
    b.create_queue("reply", temporary.clone(), Some(42)).unwrap();
    assert!(b.create_queue("reply", temporary.clone(), Some(42)).is_ok(), "its owner again: fine");
    assert!(matches!(b.create_queue("reply", temporary, Some(43)), Err(BrokerError::Exists(..))));
}

/// One consumer keeps a read open (an hour's visibility) while others take far more than a
/// level's log lets be pending: they are not stopped (before, the queue looked empty to them
/// after 8191 more), and the held message stays, across a restart too.
#[test]
fn a_read_held_long_does_not_stop_a_durable_queue_for_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let config = QueueConfig { durable: true, ..QueueConfig::default() };
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("q", config, None).unwrap();
        b.offer("q", msgs(&["held"]), 0).unwrap();
        let held = b.poll("q", 1, Some(Duration::from_secs(3600)), 1, 0).unwrap();
        assert_eq!(payloads(&held), [b"held".to_vec()]);
        let mut taken = 0;
        for batch in 0..20 {
            let messages = (0..1000).map(|i| Message::new(format!("m{}", batch * 1000 + i).into_bytes()));
            b.offer("q", messages.collect(), 0).unwrap();
            loop {
                let got = b.poll("q", 100, None, 2, 0).unwrap();
                if got.is_empty() {
                    break;
                }
                taken += got.len();
            }
            assert_eq!(taken, (batch + 1) * 1000, "every message offered is taken");
        }
        let status = b.queue("q").unwrap().status();
        assert_eq!((status.items, status.in_flight), (0, 1), "the held one");
    }
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let all = b.poll("q", 10, None, 1, 0).unwrap();
    assert_eq!(payloads(&all), [b"held".to_vec()], "it alone comes back");
}

/// An offer mixing a repeat with a new message, refused while the queue is full, is left whole:
/// retried once there is room, it is answered for its repeat, which is counted once.
#[test]
fn a_keyed_offer_refused_as_full_is_retried_whole() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    for durable in [false, true] {
        let name = format!("q{durable}");
        let q = b.create_queue(&name, QueueConfig { durable, max_items: 2, ..QueueConfig::default() }, None).unwrap();
        let keyed = |key: &str| Message { idempotency_key: key.into(), ..Message::new(key.as_bytes().to_vec()) };
        b.offer(&name, vec![keyed("a"), Message::new(&b"x"[..])], 0).unwrap();
        let mut offer = vec![keyed("a"), keyed("b")];
        assert!(matches!(b.offer_unsynced(&q, &mut offer, 0), Err(BrokerError::Full(_))));
        assert_eq!((offer.len(), q.counters().deduplicated), (2, 0), "left whole, nothing counted");
        assert_eq!(payloads(&b.poll(&name, 1, None, 1, 0).unwrap()), [b"a".to_vec()]);
        let offered = b.offer_unsynced(&q, &mut offer, 0).unwrap();
        assert_eq!((offered.count, offered.repeats, q.counters().deduplicated), (1, 1, 1), "durable {durable}");
        offered.unsynced.wait().unwrap();
        assert_eq!(payloads(&b.poll(&name, 5, None, 1, 0).unwrap()), [b"x".to_vec(), b"b".to_vec()]);
    }
}

#[test]
fn a_damaged_priority_level_is_repaired_in_place_with_the_queues_other_logs() {
    // `repair_damaged` finds every log of a queue: its first level's in its directory, the
    // others' in `priority-N`.
    let dir = tempfile::tempdir().unwrap();
    let config = QueueConfig { durable: true, priorities: 2, ..QueueConfig::default() };
    let payload = |i: usize| format!("urgent {i:04} {}", "u".repeat(100));
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("work", config, None).unwrap();
        b.offer("work", at(0, &["low"]), 1).unwrap();
        for i in 0..50 {
            b.offer("work", vec![Message { priority: 1, ..Message::new(payload(i)) }], 2).unwrap();
        }
    }
    let segment = dir.path().join("queues/work/priority-1/00000000000000000000.log");
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[64 + 20 * 150] ^= 0x5a; // a record in the middle, valid ones after it
    std::fs::write(&segment, &bytes).unwrap();

    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.damaged_queues().len(), 1);
    let repaired = b.repair_damaged("work").unwrap();
    let logs: Vec<&str> = repaired.iter().map(|(log, _)| log.as_str()).collect();
    assert_eq!(logs, ["", "priority-1"], "each log of the queue, the damaged one cut");
    assert_eq!(repaired[0].1.cut_at, None, "the first level's log was whole");
    let kept = repaired[1].1.next_offset as usize;
    assert!(kept > 0 && kept < 50, "{repaired:?}");
    let got = payloads(&b.poll("work", 100, None, 1, 3).unwrap());
    let (low, urgent): (Vec<Vec<u8>>, Vec<Vec<u8>>) = got.into_iter().partition(|p| p == b"low");
    assert_eq!(low.len(), 1, "the first level's message is there");
    let before_the_damage = (0..kept).map(|i| payload(i).into_bytes()).collect::<Vec<_>>();
    assert!(urgent == before_the_damage, "the urgent ones before the damage, in order: {} of {kept}", urgent.len());
}

#[test]
fn two_repairs_of_one_damaged_queue_at_once_open_it_once() {
    // The repair holds the definitions' lock from its check to the queue's opening: the second
    // finds the queue served, rather than open its logs a second time.
    let dir = tempfile::tempdir().unwrap();
    {
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("work", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
        for i in 0..50 {
            b.offer("work", at(0, &[&format!("job {i:04} {}", "j".repeat(100))]), 1).unwrap();
        }
    }
    let segment = dir.path().join("queues/work/00000000000000000000.log");
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[64 + 20 * 150] ^= 0x5a;
    std::fs::write(&segment, &bytes).unwrap();

    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.damaged_queues().len(), 1);
    let outcomes: Vec<bool> = std::thread::scope(|s| {
        let repairs: Vec<_> = (0..2).map(|_| s.spawn(|| b.repair_damaged("work").is_ok())).collect();
        repairs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(outcomes.iter().filter(|ok| **ok).count(), 1, "{outcomes:?}");
    assert!(b.damaged_queues().is_empty());
    let kept = b.poll("work", 100, None, 1, 3).unwrap().len();
    assert!(kept > 0 && kept < 50, "{kept}");
}

/// Bytes of the segment files under `dir`, by the blocks they hold.
fn segment_blocks(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            total += segment_blocks(&path);
        } else if path.extension().is_some_and(|e| e == "log") {
            total += std::fs::metadata(&path).unwrap().blocks() * 512;
        }
    }
    total
}

/// Offers 4,000 messages of 1,000 bytes to `q`, one a nanosecond from `t0`; returns the bytes
/// its segment files (in `files`) then hold.
fn offer_4_mb(b: &Broker, files: &std::path::Path, t0: u64) -> u64 {
    for i in 0..4000 {
        b.offer("q", vec![Message::new(vec![7u8; 1000])], t0 + i).unwrap();
    }
    segment_blocks(files)
}

/// A durable queue that its consumers drained, and that is then offered nothing for two
/// seconds, gives its disk back: the segments emptied since its last roll and its grown active
/// segment go, and offers go on after. One that still holds a message keeps the segment it is
/// in, and one offered to within the two seconds its active segment. Before, a drained queue
/// kept them until offers filled its active segment, across restarts too.
#[test]
fn a_drained_idle_durable_queue_gives_its_disk_back() {
    let dir = tempfile::tempdir().unwrap();
    let options = || BrokerOptions { segment_bytes: 4 << 20, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options()).unwrap();
    b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let (files, t0) = (dir.path().join("queues/q"), 1_000 * MS);
    let full = offer_4_mb(&b, &files, t0);
    assert!(full > 3 << 20, "{full}");
    let last_offer = t0 + 3999;
    assert_eq!(b.poll("q", 3999, None, 1, last_offer).unwrap().len(), 3999);
    b.tick(last_offer + 1_500 * MS);
    let waiting = segment_blocks(&files);
    assert!(
        waiting < full && waiting >= 1 << 20,
        "a message waits: its segment stays, the emptied ones go ({waiting})"
    );
    assert_eq!(b.poll("q", 10, None, 1, last_offer + 1_500 * MS).unwrap().len(), 1);
    b.tick(last_offer + 1_900 * MS);
    assert_eq!(segment_blocks(&files), waiting, "drained, but offered to under two seconds ago");
    b.tick(last_offer + 2_001 * MS);
    let left = segment_blocks(&files);
    assert!(left <= 128 << 10, "drained and idle: {left} bytes of segments left of {full}");
    // Offers go on, with the next ids.
    assert_eq!(b.offer("q", msgs(&["after"]), last_offer + 3_000 * MS).unwrap(), (4001, 1));
    let after = b.poll("q", 10, None, 1, last_offer + 3_000 * MS).unwrap();
    assert_eq!((payloads(&after), after[0].message.id), (vec![b"after".to_vec()], 4001));
    drop(b);
    let b = Broker::open(dir.path(), options()).unwrap();
    assert!(b.poll("q", 10, None, 1, last_offer + 4_000 * MS).unwrap().is_empty(), "nothing comes back");
    assert_eq!(b.offer("q", msgs(&["later"]), last_offer + 4_000 * MS).unwrap(), (4002, 1));
}

/// A durable queue whose consumers work through a backlog has the segments they emptied
/// deleted within about a second, while the rest waits (before, only when the queue's log next
/// started a segment: consuming on a full disk, where none can be made, freed nothing).
#[test]
fn segments_a_backlog_s_consumers_emptied_go_while_the_rest_waits() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { segment_bytes: 1 << 20, ..BrokerOptions::default() }).unwrap();
    b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let (files, t0) = (dir.path().join("queues/q"), 1_000 * MS);
    let full = offer_4_mb(&b, &files, t0);
    // Three quarters consumed, one message at a time (each poll its own lock).
    for i in 0..3000 {
        assert_eq!(b.poll("q", 1, None, 1, t0 + 4000 + i).unwrap().len(), 1);
    }
    let now = t0 + 10_000 * MS;
    b.tick(now);
    let left = segment_blocks(&files);
    assert!(left < full / 2, "{left} bytes of segments left of {full}, a quarter waiting");
    assert_eq!(b.poll("q", 2000, None, 1, now).unwrap().len(), 1000, "what waits is all there");
}

/// Segment files of `dir` that this process still maps after they were deleted: their disk is
/// not given back until they are unmapped.
fn deleted_but_mapped(dir: &std::path::Path) -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let dir = dir.canonicalize().unwrap();
    maps.lines().filter(|l| l.contains(dir.to_str().unwrap()) && l.ends_with("(deleted)")).map(str::to_owned).collect()
}

/// Drained by expiry, or with its last message returned once (a marker at the log's tail)
/// before it was taken for good, a queue gives its disk back all the same, and no deleted
/// segment stays mapped (a consumer group's reader, or the prefault thread, kept the last one).
#[test]
fn a_queue_drained_by_expiry_or_after_a_return_gives_its_disk_back_unmapped() {
    for case in ["expiry", "return"] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions { segment_bytes: 4 << 20, ..BrokerOptions::default() }).unwrap();
        let ttl_ms = if case == "expiry" { 10 } else { 0 };
        b.create_queue("q", QueueConfig { durable: true, ttl_ms, ..QueueConfig::default() }, None).unwrap();
        let (files, t0) = (dir.path().join("queues/q"), 1_000 * MS);
        let full = offer_4_mb(&b, &files, t0);
        let last_offer = t0 + 3999;
        if case == "expiry" {
            b.tick(last_offer + 20 * MS);
            assert_eq!(b.queue("q").unwrap().counters().expired, 4000);
        } else {
            assert_eq!(b.poll("q", 3999, None, 1, last_offer).unwrap().len(), 3999);
            let open = b.poll("q", 1, VIS, 1, last_offer).unwrap();
            assert_eq!(b.abort("q", &[open[0].handle], 1, 0, last_offer).unwrap(), 1);
            let again = b.poll("q", 10, VIS, 1, last_offer).unwrap();
            assert_eq!(again.len(), 1);
            assert_eq!(b.ack("q", &[again[0].handle], 1).unwrap(), 1);
        }
        b.tick(last_offer + 2_100 * MS);
        let left = segment_blocks(&files);
        assert!(left <= 128 << 10, "{case}: {left} bytes of segments left of {full}");
        assert_eq!(deleted_but_mapped(&files), Vec::<String>::new(), "{case}");
    }
}

/// A message carries at most `MAX_HEADERS` headers (the wire counts them in a `u16`), and a dead
/// letter moved on again replaces its dead-letter headers instead of adding two more each time:
/// one with 65,535 headers dead-lettered grew past the count, and its POLL answer could not be
/// decoded after the message was taken.
#[test]
fn headers_stay_within_the_wire_count_through_dead_letter_queues() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let once = |to: &str| QueueConfig { max_deliveries: 1, dead_letter: to.into(), ..QueueConfig::default() };
    b.create_queue("a", once("b"), None).unwrap();
    b.create_queue("b", once("c"), None).unwrap();
    let many = Message { headers: vec![("h".into(), "v".into()); petrel_broker::MAX_HEADERS + 1], ..Message::new("x") };
    let refused = b.offer("a", vec![many], 1).unwrap_err();
    assert!(matches!(&refused, BrokerError::BadRequest(m) if m.contains("headers")), "{refused}");
    let most = Message { headers: vec![("h".into(), "v".into()); petrel_broker::MAX_HEADERS], ..Message::new("x") };
    b.offer("a", vec![most], 1).unwrap();
    for (queue, conn) in [("a", 7), ("b", 8)] {
        assert_eq!(b.poll(queue, 1, VIS, conn, 2).unwrap().len(), 1);
        b.disconnect(conn, 3); // its one delivery came back: on to the next queue
    }
    let moved = b.poll("c", 1, None, 9, 4).unwrap();
    let headers = &moved[0].message.headers;
    assert_eq!(headers.len(), petrel_broker::MAX_HEADERS + 2);
    assert_eq!(headers.iter().filter(|(n, _)| n == petrel_broker::DEAD_LETTER_REASON).count(), 1);
}

/// A producer's retry made of repeats is answered with the originals' ids when the memory
/// budget is full: it stores nothing (it was refused LIMIT_REACHED, and the producer could not
/// learn that its first offer was stored).
#[test]
fn a_retry_of_repeats_is_answered_when_the_memory_budget_is_full() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { max_memory_bytes: 8192, ..BrokerOptions::default() }).unwrap();
    b.create_queue("mem", QueueConfig::default(), None).unwrap();
    let original = || vec![Message { idempotency_key: "k".into(), ..Message::new(vec![7u8; 256]) }];
    let (first, _) = b.offer("mem", original(), MS).unwrap();
    let mut filler = 0;
    while b.offer("mem", vec![Message::new(vec![7u8; 256])], MS).is_ok() {
        filler += 1;
    }
    assert!(filler > 0);
    let (again, _) = b.offer("mem", original(), 2 * MS).expect("answered, not refused");
    assert_eq!(again, first);
    let new = Message { idempotency_key: "new".into(), ..Message::new(vec![7u8; 256]) };
    let refused = b.offer("mem", vec![new], 3 * MS).unwrap_err();
    assert!(matches!(refused, BrokerError::Limit(_)), "{refused}");
}

/// Every file under `dir` whose bytes hold `needle`: that run of bytes overwritten with `with`.
fn overwrite_in_files(dir: &std::path::Path, needle: &[u8], with: &[u8]) -> usize {
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            n += overwrite_in_files(&path, needle, with);
            continue;
        }
        let mut bytes = std::fs::read(&path).unwrap();
        if let Some(at) = bytes.windows(needle.len()).position(|w| w == needle) {
            bytes[at..at + with.len()].copy_from_slice(with);
            std::fs::write(&path, bytes).unwrap();
            n += 1;
        }
    }
    n
}

/// A poll (or a peek) takes an expired message out for the dead-letter queue, then fails to read
/// the next (its record damaged): the expired one still reaches the dead-letter queue. Before,
/// the error dropped it, gone from both queues and counted nowhere as lost.
#[test]
fn a_poll_that_fails_after_taking_an_expired_message_still_hands_it_to_the_dead_letter_queue() {
    for peek in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("dead", QueueConfig::default(), None).unwrap();
        let config = QueueConfig { durable: true, dead_letter: "dead".into(), ..QueueConfig::default() };
        let q = b.create_queue("q", config, None).unwrap();
        let mut early = Message::new(&b"expiring-message"[..]);
        early.expires_at = 30 * MS;
        b.offer("q", vec![early, Message::new(&b"damaged-message"[..])], 0).unwrap();
        assert_eq!(overwrite_in_files(&dir.path().join("queues/q"), b"damaged-message", b"DAMAGED"), 1);
        if peek {
            let head = b.peek(&q, 40 * MS);
            assert!(head.as_ref().is_ok_and(Option::is_none) || head.is_err(), "{head:?}");
        } else {
            let polled = b.poll("q", 5, None, 1, 40 * MS);
            assert!(polled.as_ref().is_ok_and(Vec::is_empty) || polled.is_err(), "{polled:?}");
        }
        let dead = b.poll("dead", 5, None, 1, 40 * MS).unwrap();
        assert_eq!(payloads(&dead), [b"expiring-message".to_vec()], "peek {peek}");
        assert_eq!((q.counters().expired, q.counters().dead_letters_lost), (1, 0));
    }
}

/// Released delayed messages taken for good in numbers whose `moved` marker would be larger
/// than a record of the log may be (its limit follows `max_message_bytes`): they are marked done
/// in several markers, and stay taken across a restart. Before, the one marker could never be
/// written, and a restart handed all of them out again.
#[test]
fn many_released_messages_taken_at_once_stay_taken_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { max_message_bytes: 1024, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options.clone()).unwrap();
    b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let count = 10_000;
    let delayed = (0..count).map(|i| Message { delay_ms: 1, ..Message::new(format!("{i}").into_bytes()) });
    b.offer("q", delayed.collect(), 0).unwrap();
    let mut at = 2 * MS;
    let mut taken = 0;
    while taken < count {
        b.tick(at);
        let got = b.poll("q", count, None, 1, at).unwrap().len();
        assert!(got > 0 || at < 1_000 * MS, "released and taken: {taken}");
        taken += got;
        at += MS;
    }
    drop(b);
    let b = Broker::open(dir.path(), options).unwrap();
    b.tick(at);
    assert_eq!(b.poll("q", count, None, 1, at).unwrap().len(), 0, "taken for good before the restart");
}

/// A flush that cannot read one of the released delayed messages it would drop (its record
/// damaged) leaves the queue's counts as they were: its items and its bytes go together. Before,
/// the messages were dropped and then their sizes read: the error left their bytes counted for
/// good in a queue with no items.
#[test]
fn a_flush_that_cannot_read_a_released_message_keeps_items_and_bytes_together() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let q = b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    let delayed = |text: &str| Message { delay_ms: 1, ..Message::new(text.as_bytes().to_vec()) };
    b.offer("q", vec![delayed("released-first"), delayed("released-damaged")], 0).unwrap();
    b.tick(2 * MS);
    assert_eq!((q.status().delayed, q.status().items), (0, 2), "released");
    assert_eq!(overwrite_in_files(&dir.path().join("queues/q"), b"released-damaged", b"DAMAGED"), 1);
    let flushed = q.flush();
    let status = q.status();
    assert_eq!(status.items == 0, status.bytes == 0, "{flushed:?}: {status:?}");
}
