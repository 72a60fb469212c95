//! A tick whose copies of due delayed messages cannot be stored: those messages stay delayed and
//! move at a later tick, once their level's log takes them (not only after a restart). Its own
//! test binary: it makes every due message a copy (`limit_ready_runs`), for the whole process.

use petrel_broker::{Broker, BrokerOptions, Message, QueueConfig};

const MS: u64 = 1_000_000;

#[test]
fn due_messages_whose_copies_cannot_be_stored_move_at_a_later_tick() {
    petrel_broker::limit_ready_runs(0);
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { segment_bytes: 64 << 10, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options.clone()).unwrap();
    let q = b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    // 40 KiB each: the level's first segment (64 KiB) holds one, so the copy needs the next.
    let big = |tag: u8| vec![tag; 40 << 10];
    b.offer("q", vec![Message { delay_ms: 1, ..Message::new(big(1)) }], 0).unwrap();
    b.offer("q", vec![Message::new(big(2))], 0).unwrap();
    // In the way of the next segment's file (written there first): a directory.
    let blocker = dir.path().join("queues/q/00000000000000000001.log.tmp");
    std::fs::create_dir(&blocker).unwrap();
    b.tick(2 * MS);
    let status = q.status();
    assert_eq!((status.delayed, status.items), (1, 1), "the copy was not stored: still delayed");
    let got = b.poll("q", 10, None, 1, 2 * MS).unwrap();
    assert_eq!(got.iter().map(|d| d.message.payload[0]).collect::<Vec<_>>(), [2]);
    // What asks for a tick sooner (a returned read) waits for the retry too: a failing disk is
    // not ticked every millisecond.
    b.offer("q", vec![Message::new(vec![3])], 2 * MS).unwrap();
    let taken = b.poll("q", 1, Some(std::time::Duration::from_secs(60)), 1, 2 * MS).unwrap();
    assert_eq!(b.abort("q", &[taken[0].handle], 1, 0, 2 * MS).unwrap(), 1);
    assert!(q.next_due() >= 2 * MS + petrel_broker::TICK_RETRY_NS, "due at {}", q.next_due());
    assert_eq!(b.poll("q", 1, None, 1, 2 * MS).unwrap()[0].message.payload[0], 3);

    std::fs::remove_dir(&blocker).unwrap();
    b.tick(3 * MS);
    assert_eq!(q.status().delayed, 1, "not before the retry after a failed tick");
    let retry = 2 * MS + petrel_broker::TICK_RETRY_NS;
    b.tick(retry);
    let got = b.poll("q", 10, None, 1, retry).unwrap();
    assert_eq!(got.iter().map(|d| d.message.payload[0]).collect::<Vec<_>>(), [1], "moved at the next tick");
    assert_eq!(q.status().delayed, 0);
    drop(q);
    drop(b);
    // Once, across a reopen.
    let b = Broker::open(dir.path(), options).unwrap();
    assert!(b.poll("q", 10, None, 1, retry + MS).unwrap().is_empty());
}

/// A read returned with a delay whose copy the disk refuses (here the delayed log cannot be
/// made) goes back to the head at once: before, it was out of the queue until a restart.
#[test]
fn a_read_returned_with_a_delay_the_disk_refuses_comes_back_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    let q = b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    b.offer("q", vec![Message::new(b"job".to_vec())], 0).unwrap();
    // In the way of the delayed log's directory: a file.
    std::fs::write(dir.path().join("queues/q/delayed"), b"").unwrap();
    let got = b.poll("q", 1, Some(std::time::Duration::from_secs(60)), 1, 0).unwrap();
    assert_eq!(b.abort("q", &[got[0].handle], 1, 5_000, MS).unwrap(), 1);
    let status = q.status();
    assert_eq!((status.items, status.in_flight, status.delayed), (1, 0, 0), "back, not delayed");
    let again = b.poll("q", 1, None, 2, 2 * MS).unwrap();
    assert_eq!(
        again.iter().map(|d| (&d.message.payload[..], d.message.deliveries)).collect::<Vec<_>>(),
        [(&b"job"[..], 2)]
    );
}
