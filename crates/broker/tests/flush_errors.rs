//! A flush whose `moved` markers cannot all be written (the delayed log cannot make its next
//! segment): it drops only the messages it marked done; the others stay, delayed or released,
//! and are delivered (before, they were gone from the queue until a restart, and still counted).

use std::path::Path;

use petrel_broker::{Broker, BrokerOptions, Message, QueueConfig};

const MS: u64 = 1_000_000;
const COUNT: u64 = 20_002;

/// Directories in the way of every segment file the delayed log of queue `q` could make next.
fn block_next_segments(data: &Path) -> Vec<std::path::PathBuf> {
    let dir = data.join("queues/q/delayed");
    let newest = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str()?.strip_suffix(".log")?.parse::<u64>().ok())
        .max()
        .unwrap();
    // The newest segment holds fewer records than this.
    let blockers: Vec<_> = (newest + 1..newest + 100).map(|base| dir.join(format!("{base:020}.log.tmp"))).collect();
    blockers.iter().for_each(|b| std::fs::create_dir(b).unwrap());
    blockers
}

/// `COUNT` delayed messages, the last two large: the second does not fit after the first and
/// starts a segment of its own (1 MiB), which leaves a little under 100 KiB after it. A flush's
/// `moved` marker names 8192 offsets in 64 KiB: the first fits there, the second needs the
/// next segment.
fn offer_delayed(b: &Broker, delay_ms: u32, at: u64) {
    for batch in 0..(COUNT - 2) / 1000 {
        let messages =
            (0..1000).map(|i| Message { delay_ms, ..Message::new(format!("{}", batch * 1000 + i).into_bytes()) });
        b.offer("q", messages.collect(), at).unwrap();
    }
    for _ in 0..2 {
        b.offer("q", vec![Message { delay_ms, ..Message::new(vec![1u8; (1 << 20) - (100 << 10)]) }], at).unwrap();
    }
}

fn poll_all(b: &Broker, at: u64) -> u64 {
    let mut n = 0;
    loop {
        let got = b.poll("q", 5000, None, 1, at).unwrap().len() as u64;
        if got == 0 {
            return n;
        }
        n += got;
    }
}

fn broker(dir: &Path) -> Broker {
    Broker::open(dir, BrokerOptions { segment_bytes: 1 << 20, ..BrokerOptions::default() }).unwrap()
}

#[test]
fn delayed_messages_a_failed_flush_did_not_drop_still_come_due() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path());
    let q = b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    offer_delayed(&b, 3_600_000, MS);
    let blockers = block_next_segments(dir.path());
    assert!(q.flush().is_err(), "the flush could not write all its markers");
    let left = q.status().delayed;
    assert_eq!(left, COUNT - 8192, "the first marker's messages are dropped, the others left");
    blockers.iter().for_each(|b| std::fs::remove_dir(b).unwrap());
    // Due an hour later: the tick finds them again (their timers were cleared by the flush).
    let later = 3_700_000 * MS;
    for step in 0..50 {
        b.tick(later + step * MS);
    }
    assert_eq!(poll_all(&b, later + 100 * MS), left, "every message not dropped is delivered");
    assert_eq!(q.status().items, 0);
}

#[test]
fn released_messages_a_failed_flush_did_not_drop_are_still_handed_out() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path());
    let q = b.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }, None).unwrap();
    offer_delayed(&b, 1, MS);
    let mut now = 3 * MS;
    while q.status().delayed > 0 {
        b.tick(now);
        now += MS;
        assert!(now < 10_000 * MS, "released at the ticks");
    }
    assert_eq!(q.status().items, COUNT);
    let blockers = block_next_segments(dir.path());
    assert!(q.flush().is_err(), "the flush could not write all its markers");
    let left = q.status().items;
    assert_eq!(left, COUNT - 8192, "the first marker's messages are dropped, the others left");
    blockers.iter().for_each(|b| std::fs::remove_dir(b).unwrap());
    assert_eq!(poll_all(&b, now), left, "every message not dropped is handed out");
    assert_eq!(q.status().items, 0);
    drop(q);
    drop(b);
    // Those handed out (no visibility timeout: gone) and those dropped stay gone.
    let b = broker(dir.path());
    assert_eq!(poll_all(&b, now), 0);
}
