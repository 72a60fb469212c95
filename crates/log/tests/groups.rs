//! Consumer groups: positions that survive restarts, acknowledgements in any order, redelivery,
//! seeking, copying, and readers woken by the writer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use petrel_log::{Durability, Error, GroupOptions, Input, Log, MIN_SEGMENT_BYTES, Options, SeekTo};

const NOW: Duration = Duration::ZERO;

fn log_with(dir: &std::path::Path, n: u64) -> Log {
    let mut log = Log::open(dir, Options { segment_bytes: MIN_SEGMENT_BYTES, ..Options::default() }).unwrap();
    for i in log.next_offset()..n {
        log.append(format!("r{i}").as_bytes()).unwrap();
    }
    log
}

fn offsets(batch: petrel_log::Batch<'_>) -> Vec<u64> {
    batch.into_iter().map(|r| r.offset).collect()
}

#[test]
fn a_group_resumes_at_its_lowest_unacknowledged_record() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 100);
    let mut g = log.group("workers", GroupOptions::default()).unwrap();
    let got = offsets(g.poll(10, NOW).unwrap());
    assert_eq!(got, (0..10).collect::<Vec<_>>());
    for o in 0..4 {
        g.ack(o).unwrap();
    }
    assert_eq!((g.committed(), g.pending()), (4, 6));
    drop(g);
    drop(log);

    let log = log_with(dir.path(), 100);
    let mut g = log.group("workers", GroupOptions::default()).unwrap();
    assert_eq!(g.committed(), 4);
    assert_eq!(offsets(g.poll(3, NOW).unwrap()), [4, 5, 6]);
    assert_eq!(g.lag(), 96);
}

#[test]
fn out_of_order_acks_are_not_delivered_again_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 20);
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(g.poll(10, NOW).unwrap().len(), 10);
    for o in [1, 3, 4, 9] {
        g.ack(o).unwrap();
    }
    assert_eq!(g.committed(), 0);
    assert_eq!((g.lag(), g.unacknowledged()), (20, 16), "lag counts acknowledged records; unacknowledged does not");
    drop(g);
    drop(log);
    let log = log_with(dir.path(), 20);
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(g.unacknowledged(), 16, "the same after a restart");
    assert!([1, 3, 4, 9].iter().all(|&o| g.is_acknowledged(o)));
    assert!([0, 2, 5, 10, 19].iter().all(|&o| !g.is_acknowledged(o)));
    let mut seen = Vec::new();
    loop {
        let batch = offsets(g.poll(100, NOW).unwrap());
        if batch.is_empty() {
            break;
        }
        for &o in &batch {
            g.ack(o).unwrap();
        }
        seen.extend(batch);
    }
    assert_eq!(seen, [0, 2, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]);
    assert_eq!((g.committed(), g.unacknowledged()), (20, 0));
}

#[test]
fn a_nacked_record_comes_back_before_newer_ones() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 10);
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(offsets(g.poll(3, NOW).unwrap()), [0, 1, 2]);
    g.ack(0).unwrap();
    g.nack(2).unwrap();
    g.nack(1).unwrap();
    assert_eq!(offsets(g.poll(10, NOW).unwrap()), [1]);
    assert_eq!(offsets(g.poll(10, NOW).unwrap()), [2]);
    assert_eq!(offsets(g.poll(2, NOW).unwrap()), [3, 4]);
    assert!(matches!(g.nack(0), Err(Error::NotDelivered { .. })), "acked records cannot be nacked");
    assert!(matches!(g.ack(7), Err(Error::NotDelivered { .. })), "undelivered records cannot be acked");
    g.ack(0).unwrap(); // twice is fine
}

/// A record taken back with `unpoll` is read again in order and holds no open read meanwhile
/// (a `nack`ed one does until it is read again); only the last one read can be taken back.
#[test]
fn an_unpolled_record_is_read_again_in_order_and_frees_its_open_read() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 10);
    let mut g = log.group("g", GroupOptions { max_pending: 3, ..GroupOptions::default() }).unwrap();
    assert_eq!(offsets(g.poll(3, NOW).unwrap()), [0, 1, 2]);
    assert!(g.may_block());
    assert!(!g.unpoll(1), "not the last read");
    assert!(g.unpoll(2) && g.unpoll(1));
    assert!(!g.unpoll(1), "read back once");
    assert_eq!((g.pending(), g.may_block()), (1, false));
    g.ack(0).unwrap();
    assert!(!g.unpoll(0), "acknowledged");
    assert_eq!(offsets(g.poll(10, NOW).unwrap()), [1, 2, 3]);
    g.nack(3).unwrap();
    assert!(!g.unpoll(3), "returned to be read again first");
    assert_eq!(g.pending(), 3);
    // Acknowledged after it: stays acknowledged, stepped over once it is read again.
    let mut g = log.group("h", GroupOptions::default()).unwrap();
    assert_eq!(offsets(g.poll(3, NOW).unwrap()), [0, 1, 2]);
    g.ack(2).unwrap();
    assert!(g.unpoll(1));
    assert_eq!((g.pending(), g.unacknowledged()), (1, 9));
    assert_eq!(offsets(g.poll(10, NOW).unwrap()), [1]);
    assert_eq!(offsets(g.poll(10, NOW).unwrap()), (3..10).collect::<Vec<_>>());
    // More open reads than the window can hold as it moves on: `poll` may stop before the end.
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 200);
    let mut g = log.group("j", GroupOptions::default()).unwrap();
    g.poll(124, NOW).unwrap();
    assert!(!g.may_block());
    g.poll(1, NOW).unwrap();
    assert!(g.may_block());
    // Yet `poll` lets more out: `would_block` says so exactly, and only at `max_pending`.
    assert!(!g.would_block());
    assert_eq!(offsets(g.poll(10, NOW).unwrap()), (125..135).collect::<Vec<_>>());
    let mut g = log.group("k", GroupOptions { max_pending: 3, ..GroupOptions::default() }).unwrap();
    g.poll(2, NOW).unwrap();
    assert!(!g.would_block());
    g.poll(1, NOW).unwrap();
    assert!(g.would_block());
    assert!(matches!(g.poll(1, NOW), Err(Error::TooManyPending { .. })));
}

#[test]
fn seeking_by_offset_time_oldest_and_newest() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), Options { segment_bytes: MIN_SEGMENT_BYTES, ..Options::default() }).unwrap();
    for i in 0..3000u64 {
        log.append_with(&Input { timestamp: Some(1_000 + i * 10), ..Input::payload(&[0u8; 40]) }).unwrap();
    }
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(g.seek(SeekTo::Offset(2500)).unwrap(), 2500);
    assert_eq!(offsets(g.poll(1, NOW).unwrap()), [2500]);
    assert_eq!(g.seek(SeekTo::Time(1_000 + 1234 * 10)).unwrap(), 1234);
    assert_eq!(g.seek(SeekTo::Time(1_000 + 1234 * 10 - 5)).unwrap(), 1234, "first record at or after");
    assert_eq!(g.seek(SeekTo::Time(0)).unwrap(), 0);
    assert_eq!(g.seek(SeekTo::Time(u64::MAX)).unwrap(), 3000);
    assert_eq!(g.seek(SeekTo::Newest).unwrap(), 3000);
    assert!(g.poll(10, NOW).unwrap().is_empty());
    assert_eq!(g.seek(SeekTo::Oldest).unwrap(), 0);
    assert_eq!(g.seek(SeekTo::Offset(99_999)).unwrap(), 3000, "clamped to the end");
    // A new group can start anywhere.
    let opts = GroupOptions { start: SeekTo::Newest, ..GroupOptions::default() };
    assert_eq!(log.group("late", opts).unwrap().committed(), 3000);
}

#[test]
fn groups_are_listed_copied_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 50);
    let mut a = log.group("a", GroupOptions::default()).unwrap();
    a.poll(20, NOW).unwrap();
    for o in 0..15 {
        a.ack(o).unwrap();
    }
    assert!(matches!(log.group("a", GroupOptions::default()), Err(Error::GroupInUse(_))));
    log.copy_group("a", "b").unwrap();
    let mut b = log.group("b", GroupOptions::default()).unwrap();
    assert_eq!(b.committed(), 15);
    assert_eq!(offsets(b.poll(2, NOW).unwrap()), [15, 16]);
    drop(b);
    let names: Vec<_> = log.groups().into_iter().map(|g| (g.name, g.committed, g.open)).collect();
    assert_eq!(names, [("a".into(), 15, true), ("b".into(), 15, false)]);
    assert!(matches!(log.delete_group("a"), Err(Error::GroupInUse(_))));
    log.delete_group("b").unwrap();
    assert!(matches!(log.delete_group("b"), Err(Error::NoSuchGroup(_))));
    assert!(log.group("bad/name", GroupOptions::default()).is_err());
    drop(a);
    drop(log);
    let listed = petrel_log::verify::list_groups(dir.path()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].name.as_str(), listed[0].committed), ("a", 15));
}

#[test]
fn pending_records_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 100);
    let mut g = log.group("g", GroupOptions { max_pending: 8, ..GroupOptions::default() }).unwrap();
    assert_eq!(g.poll(100, NOW).unwrap().len(), 8);
    assert!(matches!(g.poll(1, NOW), Err(Error::TooManyPending { max: 8, .. })));
    g.ack(0).unwrap();
    assert_eq!(offsets(g.poll(100, NOW).unwrap()), [8]);
}

#[test]
fn a_waiting_poll_is_woken_by_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 0).into_shared();
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    let started = Instant::now();
    assert!(g.poll(1, Duration::from_millis(20)).unwrap().is_empty());
    assert!(started.elapsed() >= Duration::from_millis(20), "an empty poll waits out its timeout");
    let writer = {
        let log = log.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            log.append(b"late").unwrap();
        })
    };
    let started = Instant::now();
    let batch = g.poll(10, Duration::from_secs(30)).unwrap();
    assert_eq!(batch.into_iter().next().unwrap().payload, b"late");
    assert!(started.elapsed() < Duration::from_secs(30), "woken, not timed out");
    writer.join().unwrap();
}

#[test]
fn one_writer_and_several_readers_each_see_every_record_in_order() {
    const N: u64 = 200_000;
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 0).into_shared();
    let readers: Vec<_> = (0..3)
        .map(|r| {
            let mut groups: Vec<_> = (0..2)
                .map(|g| {
                    log.group(&format!("r{r}g{g}"), GroupOptions { max_pending: 512, ..Default::default() }).unwrap()
                })
                .collect();
            std::thread::spawn(move || {
                let mut next = vec![0u64; groups.len()];
                let deadline = Instant::now() + Duration::from_secs(60);
                while next.iter().any(|&n| n < N) {
                    assert!(Instant::now() < deadline, "readers fell behind for a minute");
                    for (g, group) in groups.iter_mut().enumerate() {
                        let got: Vec<(u64, Vec<u8>)> = group
                            .poll(256, Duration::from_millis(10))
                            .unwrap()
                            .into_iter()
                            .map(|r| (r.offset, r.payload.to_vec()))
                            .collect();
                        for (offset, payload) in got {
                            assert_eq!(offset, next[g], "in order, nothing missing or repeated");
                            assert_eq!(payload, offset.to_le_bytes());
                            group.ack(offset).unwrap();
                            next[g] += 1;
                        }
                    }
                }
            })
        })
        .collect();
    for i in 0..N {
        log.append(&i.to_le_bytes()).unwrap();
    }
    for r in readers {
        r.join().unwrap();
    }
    assert!(log.groups().iter().all(|g| g.committed == N));
}

/// Opens a log of `n` records whose syncs (its own and its cursors') are counted.
fn counted_log(dir: &std::path::Path, n: u64) -> (Log, Arc<AtomicU64>) {
    let syncs = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&syncs);
    let on_sync = petrel_log::SyncObserver::new(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
    });
    let options = Options { segment_bytes: MIN_SEGMENT_BYTES, on_sync, ..Options::default() };
    let mut log = Log::open(dir, options).unwrap();
    for i in 0..n {
        log.append(format!("r{i}").as_bytes()).unwrap();
    }
    (log, syncs)
}

#[test]
fn cursor_durability_always_syncs_each_ack_and_none_never_does() {
    let dir = tempfile::tempdir().unwrap();
    let (log, syncs) = counted_log(dir.path(), 10);
    assert_eq!(syncs.load(Ordering::Relaxed), 0, "the log itself syncs nothing under `none`");
    let opts = GroupOptions { durability: Durability::Always, ..GroupOptions::default() };
    let mut g = log.group("g", opts).unwrap();
    g.poll(10, NOW).unwrap();
    let before = syncs.load(Ordering::Relaxed);
    for offset in 0..3 {
        g.ack(offset).unwrap();
        assert_eq!(syncs.load(Ordering::Relaxed), before + offset + 1, "one sync per acknowledgement");
    }
    drop(g);
    // The same acknowledgements under `none`: not one sync, not even when the group closes.
    let opts = GroupOptions { durability: Durability::None, ..GroupOptions::default() };
    let mut h = log.group("h", opts).unwrap();
    h.poll(10, NOW).unwrap();
    let before = syncs.load(Ordering::Relaxed);
    for offset in 0..3 {
        h.ack(offset).unwrap();
    }
    drop(h);
    assert_eq!(syncs.load(Ordering::Relaxed), before, "`none` leaves the cursor to the page cache");
    let listed = petrel_log::verify::list_groups(dir.path()).unwrap();
    assert!(listed.iter().all(|g| g.committed == 3), "both cursors hold their acknowledgements: {listed:?}");
}

#[test]
fn the_queue_api_dequeues_in_order_and_remembers_across_reopens() {
    use petrel_log::SimpleQueue;
    let dir = tempfile::tempdir().unwrap();
    let mut q = SimpleQueue::open(dir.path(), Options::default()).unwrap();
    assert!(q.is_empty());
    assert!(q.dequeue().unwrap().is_none());
    for i in 0..10u8 {
        q.enqueue(&[i]).unwrap();
    }
    assert_eq!(q.dequeue().unwrap().unwrap().payload, [0]);
    assert_eq!(q.dequeue().unwrap().unwrap().payload, [1]);
    assert_eq!(q.peek().unwrap().unwrap().payload, [2]);
    assert_eq!(q.len(), 8);
    // A named consumer reads everything from the start, independently (seed 001's consumers).
    let mut other = q.group("audit", GroupOptions::default()).unwrap();
    assert_eq!(other.take(NOW).unwrap().unwrap().payload, [0]);
    drop(other);
    q.copy_group("audit", "audit-copy").unwrap();
    drop(q);
    let mut q = SimpleQueue::open(dir.path(), Options::default()).unwrap();
    assert_eq!(q.len(), 8);
    assert_eq!(q.dequeue().unwrap().unwrap().payload, [2]);
    assert_eq!(q.group("audit-copy", GroupOptions::default()).unwrap().committed(), 1);
    let mut n = 0;
    while q.dequeue().unwrap().is_some() {
        n += 1;
    }
    assert_eq!((n, q.len()), (7, 0));
}

#[test]
fn a_group_past_the_end_of_a_repaired_log_sees_new_records() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 10);
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    while g.take(NOW).unwrap().is_some() {}
    assert_eq!(g.committed(), 10);
    drop((g, log));
    cut_back_to_four_records(dir.path());
    let mut log = log_with(dir.path(), 0);
    log.append(b"after repair").unwrap();
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(g.take(NOW).unwrap().unwrap().payload, b"after repair");
}

#[test]
fn acknowledgements_past_the_end_of_a_repaired_log_do_not_hide_new_records() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 10);
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    let delivered = offsets(g.poll(10, NOW).unwrap());
    assert_eq!(delivered.len(), 10);
    // All but the first acknowledged: the cursor holds 1..10 above committed 0.
    for offset in 1..10 {
        g.ack(offset).unwrap();
    }
    drop((g, log));
    // Acknowledgements of 4..10 name records that will be gone.
    cut_back_to_four_records(dir.path());
    let mut log = log_with(dir.path(), 0);
    for i in 0..3 {
        log.append(format!("new {i}").as_bytes()).unwrap();
    }
    let info = log.groups().into_iter().find(|g| g.name == "g").unwrap();
    assert_eq!((info.committed, info.acked_above), (0, 3), "only acknowledgements of records left");
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    let mut got = Vec::new();
    while let Some(r) = g.take(NOW).unwrap() {
        got.push(r.payload.to_vec());
    }
    assert_eq!(got, [b"r0".to_vec(), b"new 0".to_vec(), b"new 1".to_vec(), b"new 2".to_vec()]);
}

/// Damages records 4 and 5 of a log made by `log_with` and cuts the log back to the 4 records
/// before them, as `petrel log repair` does. (Damage in one record that every group has passed
/// is replaced instead of cut: two records are needed for a cut.)
fn cut_back_to_four_records(dir: &std::path::Path) {
    let seg = dir.join("00000000000000000000.log");
    let mut bytes = std::fs::read(&seg).unwrap();
    for record in [&b"r4"[..], b"r5"] {
        let at = bytes.windows(2).position(|w| w == record).unwrap();
        bytes[at] ^= 1;
    }
    std::fs::write(&seg, bytes).unwrap();
    assert_eq!(petrel_log::verify::repair(dir).unwrap().next_offset, 4);
}

/// Polls and acknowledges `n` records one at a time; returns their offsets.
fn poll_and_ack(g: &mut petrel_log::ConsumerGroup, n: usize) -> Vec<u64> {
    let mut got = Vec::new();
    for _ in 0..n {
        let offset = offsets(g.poll(1, NOW).unwrap())[0];
        g.ack(offset).unwrap();
        got.push(offset);
    }
    got
}

#[test]
fn a_record_held_long_does_not_stop_the_group_and_stays_pending() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 1000);
    let mut g = log.group("g", GroupOptions { max_pending: 16, ..GroupOptions::default() }).unwrap();
    assert_eq!(offsets(g.poll(1, NOW).unwrap()), [0], "taken, and held by its consumer");
    // Others are read and acknowledged far past the window behind it.
    assert_eq!(poll_and_ack(&mut g, 500), (1..501).collect::<Vec<_>>());
    assert_eq!(g.committed(), 0, "the held record is the lowest unacknowledged one");
    assert_eq!((g.pending(), g.unacknowledged()), (1, 1000 - 500));
    assert!(!g.is_acknowledged(0) && g.is_acknowledged(1));
    let listed = &log.groups()[0];
    assert_eq!((listed.committed, listed.held), (0, 1));
    // Returned, it is delivered first; acknowledged, the group stands past everything acknowledged.
    g.nack(0).unwrap();
    assert_eq!(offsets(g.poll(5, NOW).unwrap()), [0]);
    g.ack(0).unwrap();
    assert_eq!((g.committed(), g.pending(), g.unacknowledged()), (501, 0, 499));
    assert_eq!(log.groups()[0].held, 0);
}

#[test]
fn a_held_record_is_delivered_first_after_a_restart_and_only_it() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 300);
    let mut g = log.group("g", GroupOptions { max_pending: 16, ..GroupOptions::default() }).unwrap();
    assert_eq!(offsets(g.poll(1, NOW).unwrap()), [0]);
    poll_and_ack(&mut g, 99);
    assert_eq!(offsets(g.poll(1, NOW).unwrap()), [100], "a second one taken, not held yet");
    drop(g);
    drop(log);
    let listed = petrel_log::verify::list_groups(dir.path()).unwrap();
    assert_eq!((listed[0].committed, listed[0].held), (0, 1));
    let log = log_with(dir.path(), 300);
    let mut g = log.group("g", GroupOptions { max_pending: 16, ..GroupOptions::default() }).unwrap();
    assert_eq!(g.unacknowledged(), 201);
    assert_eq!(poll_and_ack(&mut g, 201), [0].into_iter().chain(100..300).collect::<Vec<_>>());
    assert_eq!((g.committed(), g.unacknowledged()), (300, 0));
}

#[test]
fn held_records_are_bounded_by_what_a_cursor_holds() {
    let dir = tempfile::tempdir().unwrap();
    let max_pending = 200;
    let log = log_with(dir.path(), 2000);
    let mut g = log.group("g", GroupOptions { max_pending, ..GroupOptions::default() }).unwrap();
    // Every tenth record taken and kept, the rest acknowledged: each kept one is held in turn
    // (fewer than `max_pending` are pending: the window's length refuses, not their count).
    let mut kept = Vec::new();
    let refused = loop {
        match g.poll(1, NOW) {
            Ok(batch) => {
                let offset = offsets(batch)[0];
                if offset.is_multiple_of(10) {
                    kept.push(offset);
                } else {
                    g.ack(offset).unwrap();
                }
            }
            Err(e) => break e,
        }
    };
    assert!(matches!(refused, Error::TooManyPending { max: 200, .. }), "{refused}");
    assert_eq!(log.groups()[0].held, petrel_log::MAX_HELD);
    assert_eq!(g.pending(), kept.len());
    // One acknowledged, there is room again.
    g.ack(kept[0]).unwrap();
    assert!(g.poll(1, NOW).is_ok_and(|b| b.len() == 1));
    drop(g);
    drop(log);
    let log = log_with(dir.path(), 2000);
    let g = log.group("g", GroupOptions { max_pending, ..GroupOptions::default() }).unwrap();
    assert_eq!(g.committed(), kept[1], "what was held is there after a restart");
}

#[test]
fn a_groups_lag_counts_what_it_has_not_acknowledged_while_it_holds_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 1000);
    let mut g = log.group("g", GroupOptions { max_pending: 16, ..GroupOptions::default() }).unwrap();
    assert_eq!(offsets(g.poll(1, NOW).unwrap()), [0]);
    poll_and_ack(&mut g, 600);
    let info = &log.groups()[0];
    assert_eq!((info.committed, info.held), (0, 1));
    assert!(info.window_start > 500, "{}", info.window_start);
    assert_eq!(info.unacknowledged(log.next_offset()), g.unacknowledged());
    assert_eq!(g.unacknowledged(), 1000 - 600);
}

/// A cursor file whose bytes never reached the disk (a power loss soon after its group was
/// made: empty, or zeros where the file system allocated it) does not keep the log from
/// opening: the group starts again at the oldest record (delivered again, at least once). A
/// cursor with other bytes and no valid slot is still corruption.
#[test]
fn a_cursor_that_never_reached_the_disk_starts_its_group_again() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 20);
    let mut g = log.group("workers", GroupOptions::default()).unwrap();
    let got = offsets(g.poll(5, NOW).unwrap());
    got.iter().for_each(|&o| g.ack(o).unwrap());
    drop(g);
    drop(log);
    let cursor = dir.path().join("groups/workers.cursor");
    let len = std::fs::metadata(&cursor).unwrap().len();
    for bytes in [Vec::new(), vec![0u8; len as usize]] {
        std::fs::write(&cursor, &bytes).unwrap();
        let log = log_with(dir.path(), 20);
        let mut g = log.group("workers", GroupOptions::default()).unwrap();
        assert_eq!(g.committed(), 0, "{} bytes", bytes.len());
        assert_eq!(offsets(g.poll(3, NOW).unwrap()), [0, 1, 2]);
    }
    std::fs::write(&cursor, vec![0xA5u8; len as usize]).unwrap();
    assert!(matches!(Log::open(dir.path(), Options::default()), Err(Error::Corrupt { .. })));
}

/// `max_groups` bounds the groups a log makes, under the registry's lock: of eight threads each
/// making a new group with one place left, exactly one does; a group that exists still opens.
#[test]
fn max_groups_lets_exactly_one_of_many_openers_take_the_last_place() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(log_with(dir.path(), 10));
    let opts = GroupOptions { max_groups: 4, ..GroupOptions::default() };
    for g in 0..3 {
        drop(log.group(&format!("g{g}"), opts).unwrap());
    }
    let barrier = Arc::new(std::sync::Barrier::new(8));
    let openers: Vec<_> = (0..8)
        .map(|t| {
            let (log, barrier) = (Arc::clone(&log), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                match log.group(&format!("new{t}"), opts) {
                    Ok(_) => true,
                    Err(Error::TooManyGroups { groups: 4, max: 4 }) => false,
                    Err(e) => panic!("{e}"),
                }
            })
        })
        .collect();
    let made = openers.into_iter().map(|t| t.join().unwrap()).filter(|made| *made).count();
    assert_eq!(made, 1);
    assert_eq!(log.groups().len(), 4);
    drop(log.group("g1", opts).expect("a group that exists opens at the limit"));
}

/// Records held (out long) count toward `max_pending` with those in the window: a poll never
/// lets more out than `max_pending` in all.
#[test]
fn held_records_count_toward_max_pending() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 10);
    let mut g = log.group("g", GroupOptions { max_pending: 2, ..GroupOptions::default() }).unwrap();
    assert_eq!(offsets(g.poll(2, NOW).unwrap()), [0, 1]);
    g.ack(1).unwrap();
    // 0 is held as the window moves on; one more may go out, not two.
    assert_eq!(offsets(g.poll(10, NOW).unwrap()), [2]);
    assert_eq!(g.pending(), 2);
    assert!(matches!(g.poll(10, NOW), Err(Error::TooManyPending { .. })));
}

/// A timeout of `Duration::MAX` means "no limit", not a panic; a poll of none and one before an
/// end at or below a record to be delivered again hand out nothing.
#[test]
fn odd_but_legal_poll_arguments_are_taken_as_meant() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_with(dir.path(), 3);
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(offsets(g.poll(1, Duration::MAX).unwrap()), [0]);
    g.nack(0).unwrap();
    assert!(g.poll(0, NOW).unwrap().is_empty(), "none asked for");
    assert!(g.poll_before(5, usize::MAX, NOW, 0).unwrap().is_empty(), "0 is not before 0");
    assert_eq!(offsets(g.poll_before(5, usize::MAX, NOW, 1).unwrap()), [0], "delivered again");
    assert_eq!(offsets(g.poll_before(5, usize::MAX, NOW, 2).unwrap()), [1]);
    let mut taker = log.group("t", GroupOptions::default()).unwrap();
    assert_eq!(taker.take(Duration::MAX).unwrap().map(|r| r.offset), Some(0));
}

/// An acknowledgement made again after a restart, of a record acknowledged above the group's
/// position, is a no-op, as any acknowledgement made twice.
#[test]
fn an_acknowledgement_made_again_after_a_restart_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    {
        let log = log_with(dir.path(), 10);
        let mut g = log.group("g", GroupOptions::default()).unwrap();
        assert_eq!(offsets(g.poll(6, NOW).unwrap()), [0, 1, 2, 3, 4, 5]);
        g.ack(5).unwrap();
    }
    let log = log_with(dir.path(), 10);
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    g.ack(5).unwrap();
    assert!(matches!(g.ack(7), Err(Error::NotDelivered { .. })), "one never delivered still is refused");
}

/// `peek` finds the head past records a cap removed, as `poll` and `take` do: it found nothing
/// for good once the head's segment was gone.
#[test]
fn peek_looks_past_what_a_cap_removed() {
    let dir = tempfile::tempdir().unwrap();
    let cap = petrel_log::Retention { max_bytes: Some(2 * MIN_SEGMENT_BYTES), ..Default::default() };
    let options = Options { segment_bytes: MIN_SEGMENT_BYTES, retention: cap, ..Options::default() };
    let mut log = Log::open(dir.path(), options).unwrap();
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    let record = [7u8; 200];
    for _ in 0..2_000 {
        log.append(&record).unwrap();
    }
    log.apply_retention().unwrap();
    let first = log.first_offset();
    assert!(first > 0, "the cap removed the oldest segments");
    assert_eq!(g.peek().unwrap().map(|r| r.offset), Some(first));
}
