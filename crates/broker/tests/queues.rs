//! Queue semantics, with no sockets: the broker alone.

use std::time::Duration;

use petrel_broker::{Broker, BrokerError, BrokerOptions, Message, QueueConfig};

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
        assert_eq!(b.queue("q").unwrap().stats().total_polled, 4, "{config:?}");
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
        assert_eq!(b.abort("q", &[d[0].handle], 8).unwrap(), 0, "only the taker can abort");
        assert_eq!(b.abort("q", &[d[0].handle], 7).unwrap(), 1);
        // Back at the head.
        let d = b.poll("q", 1, VIS, 7, 0).unwrap();
        assert_eq!(payloads(&d), [b"a".to_vec()]);
        // The visibility timeout passes: back again.
        b.tick(200 * MS);
        let d = b.poll("q", 1, VIS, 9, 200 * MS).unwrap();
        assert_eq!(payloads(&d), [b"a".to_vec()]);
        // The consumer disconnects: back again.
        b.disconnect(9);
        let d = b.poll("q", 1, VIS, 10, 300 * MS).unwrap();
        assert_eq!(payloads(&d), [b"a".to_vec()]);
        assert_eq!(b.ack("q", &[d[0].handle], 10).unwrap(), 1);
        assert_eq!(b.ack("q", &[d[0].handle], 10).unwrap(), 0, "acked once");
        assert_eq!(payloads(&b.poll("q", 5, None, 10, 0).unwrap()), [b"b".to_vec(), b"c".to_vec()], "{config:?}");
        let stats = b.queue("q").unwrap().stats();
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
    b.disconnect(41);
    assert!(b.queue("reply.1").is_some());
    b.disconnect(42);
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
        assert!(matches!(b.offer("bounded", msgs(&["3", "4", "5"]), 0), Err(BrokerError::Full(_))), "all or none");
        b.offer("ring", msgs(&["1", "2"]), 0).unwrap();
        b.offer("ring", msgs(&["3"]), 0).unwrap();
        assert_eq!(b.queue("ring").unwrap().stats().dropped, 1);
        assert_eq!(
            payloads(&b.poll("ring", 5, None, 1, 0).unwrap()),
            [b"2".to_vec(), b"3".to_vec()],
            "durable: {durable}"
        );
    }
}

#[test]
fn expired_messages_go_to_the_dead_letter_queue() {
    for config in both() {
        let dir = tempfile::tempdir().unwrap();
        let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        b.create_queue("dead", QueueConfig::default(), None).unwrap();
        b.create_queue("q", QueueConfig { ttl_ms: 50, dead_letter: "dead".into(), ..config.clone() }, None).unwrap();
        let mut own = Message::new(&b"own-expiry"[..]);
        own.expires_at = 1_000 * MS;
        b.offer("q", vec![Message::new(&b"ttl"[..]), own], 0).unwrap();
        b.tick(10 * MS);
        assert_eq!(b.queue("q").unwrap().stats().items, 2, "nothing expired yet");
        let live = b.poll("q", 5, VIS, 1, 60 * MS).unwrap();
        assert_eq!(payloads(&live), [b"own-expiry".to_vec()], "{config:?}: the TTL one expired");
        let dead = b.poll("dead", 5, None, 1, 60 * MS).unwrap();
        assert_eq!(payloads(&dead), [b"ttl".to_vec()]);
        assert_eq!(b.queue("q").unwrap().stats().expired, 1);
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
    for q in ["orders", "orders+audit", "orders+billing"] {
        assert_eq!(payloads(&b.poll(q, 5, None, 1, 0).unwrap()), [b"o1".to_vec()], "{q}");
    }
    assert!(b.poll("orders+audit+deep", 5, None, 1, 0).unwrap().is_empty(), "children only, not grandchildren");
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
    assert_eq!(b.queue("jobs").unwrap().config.max_items, 100);
    assert!(b.poll("mem", 5, None, 1, 0).unwrap().is_empty(), "in-memory contents do not survive");
    let left = b.poll("jobs", 5, None, 1, 0).unwrap();
    assert_eq!(payloads(&left), [b"job-2".to_vec(), b"job-3".to_vec()]);
    assert!(matches!(b.create_queue("jobs", QueueConfig::default(), None), Err(BrokerError::Exists(_))));
    b.remove_queue("jobs").unwrap();
    assert!(matches!(b.poll("jobs", 1, None, 1, 0), Err(BrokerError::NotFound(_))));
    assert!(!dir.path().join("queues/jobs").exists());
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
