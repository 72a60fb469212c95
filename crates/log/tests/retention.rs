//! Retention: consumed segments go when every group is past them; byte and age caps move groups
//! that are behind, counting what they skipped; disk space really comes back.

use std::path::Path;
use std::time::Duration;

use petrel_log::{GroupOptions, Input, Log, MIN_SEGMENT_BYTES, Options, Retention};

fn du(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .map(|p| std::fs::metadata(p).unwrap().blocks() * 512)
        .sum()
}

fn opts(retention: Retention) -> Options {
    Options { segment_bytes: MIN_SEGMENT_BYTES, retention, ..Options::default() }
}

#[test]
fn consumed_segments_are_deleted_once_every_group_is_past_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), opts(Retention { delete_consumed: true, ..Default::default() })).unwrap();
    // No group yet: nothing counts as consumed.
    for i in 0..3000u64 {
        log.append(&[i as u8; 100]).unwrap();
    }
    assert_eq!(log.first_offset(), 0);
    let stats = log.stats();
    assert!(stats.rolls > 0 && stats.rolls == stats.segments as u64 - 1, "a roll per segment after the first");
    assert_eq!(stats.retention_removals, 0, "retention ran at each roll and removed nothing");
    let mut fast = log.group("fast", GroupOptions { max_pending: 8192, ..Default::default() }).unwrap();
    let mut slow = log.group("slow", GroupOptions::default()).unwrap();
    while let Some(r) = fast.take(Duration::ZERO).unwrap() {
        let _ = r.offset;
    }
    let before = du(dir.path());
    log.apply_retention().unwrap();
    assert_eq!(log.first_offset(), 0, "the slow group still needs everything");
    for _ in 0..1500 {
        slow.take(Duration::ZERO).unwrap().unwrap();
    }
    let report = log.apply_retention().unwrap();
    assert!(report.segments_removed > 0 && report.records_skipped == 0, "{report:?}");
    assert_eq!(log.stats().retention_removals, 1, "one pass removed segments (the one before removed none)");
    let first = log.first_offset();
    assert!(first > 0 && first <= 1500, "only what both groups passed: {first}");
    assert!(du(dir.path()) < before, "disk space is returned");
    assert_eq!(log.reader().read_next().unwrap().unwrap().offset, first);
    assert_eq!(slow.take(Duration::ZERO).unwrap().unwrap().offset, 1500);
}

/// A group that could not be opened (its cursor file could not be written) holds no position:
/// it does not make every segment count as consumed.
#[test]
fn a_group_that_failed_to_open_does_not_consume_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), opts(Retention { delete_consumed: true, ..Default::default() })).unwrap();
    // In the way of the group's cursor file (written there first): a directory.
    std::fs::create_dir_all(dir.path().join("groups/late.cursor.tmp")).unwrap();
    assert!(log.group("late", GroupOptions::default()).is_err());
    for i in 0..3000u64 {
        log.append(&[i as u8; 100]).unwrap();
    }
    assert!(log.stats().rolls > 0);
    assert_eq!(log.first_offset(), 0, "nothing deleted: no group has read anything");
    assert_eq!(log.stats().retention_removals, 0);
}

#[test]
fn a_byte_cap_moves_a_lagging_group_and_counts_the_skip() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 4 * MIN_SEGMENT_BYTES;
    let mut log = Log::open(dir.path(), opts(Retention { max_bytes: Some(cap), ..Default::default() })).unwrap();
    for i in 0..100u64 {
        log.append(&i.to_le_bytes().repeat(8)).unwrap();
    }
    let mut reader_group = log.group("lagging", GroupOptions::default()).unwrap();
    for _ in 0..5 {
        reader_group.take(Duration::ZERO).unwrap().unwrap();
    }
    drop(reader_group);
    let mut open_group = log.group("open", GroupOptions::default()).unwrap();
    for i in 0..20_000u64 {
        log.append(&i.to_le_bytes().repeat(8)).unwrap();
    }
    assert!(du(dir.path()) <= cap, "{} > {cap}", du(dir.path()));
    let first = log.first_offset();
    assert!(first > 0);
    // The open group notices on its next poll and moves to the oldest record.
    let batch: Vec<u64> = open_group.poll(3, Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
    assert_eq!(batch, [first, first + 1, first + 2]);
    let infos = log.groups();
    let lagging = infos.iter().find(|g| g.name == "lagging").unwrap();
    assert_eq!(lagging.committed, first, "a closed group's cursor is moved");
    assert_eq!(lagging.skipped, first - 5, "and what it lost is counted");
    assert_eq!(infos.iter().find(|g| g.name == "open").unwrap().skipped, first);
    drop(open_group);
    drop(log);
    let log = Log::open(dir.path(), opts(Retention::default())).unwrap();
    assert_eq!(log.group("lagging", GroupOptions::default()).unwrap().committed(), first);
}

/// A reader and a group still inside a segment when a byte cap removes it and the segments after
/// it read on from the oldest record left: no false "missing record", and each record the group
/// hands out is counted where it is (its acknowledgement is taken).
#[test]
fn readers_inside_segments_a_cap_removed_go_on_from_the_oldest_record_left() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 3 * MIN_SEGMENT_BYTES;
    let mut log = Log::open(dir.path(), opts(Retention { max_bytes: Some(cap), ..Default::default() })).unwrap();
    for i in 0..100u64 {
        log.append(&i.to_le_bytes().repeat(8)).unwrap();
    }
    let mut reader = log.reader();
    assert_eq!(reader.read_next().unwrap().unwrap().offset, 0);
    let mut group = log.group("g", GroupOptions::default()).unwrap();
    let first_two: Vec<u64> = group.poll(2, Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
    assert_eq!(first_two, [0, 1]);
    group.ack(0).unwrap();
    group.ack(1).unwrap();
    // Many segments more: the first ones go while both stand in the first.
    for i in 0..20_000u64 {
        log.append(&i.to_le_bytes().repeat(8)).unwrap();
    }
    let first = log.first_offset();
    assert!(first > 1000, "segments after the first went too: {first}");
    let mut last = 0;
    while let Some(r) = reader.read_next().unwrap() {
        assert!(r.offset > last, "{} after {last}", r.offset);
        last = r.offset;
    }
    assert_eq!(last, log.next_offset() - 1, "read to the end");
    let mut handed = 0u64;
    loop {
        let offsets: Vec<u64> = group.poll(512, Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
        if offsets.is_empty() {
            break;
        }
        for offset in offsets {
            assert!(offset >= first || offset < 100, "{offset}");
            group.ack(offset).unwrap();
            handed += 1;
        }
    }
    assert!(handed >= log.next_offset() - first, "every record left handed out: {handed}");
    assert_eq!(group.committed(), log.next_offset());
}

#[test]
fn an_age_cap_deletes_old_segments() {
    let dir = tempfile::tempdir().unwrap();
    let mut log =
        Log::open(dir.path(), opts(Retention { max_age: Some(Duration::from_secs(3600)), ..Default::default() }))
            .unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let two_hours_ago = now - 7200 * 1_000_000_000;
    for _ in 0..2000 {
        log.append_with(&Input { timestamp: Some(two_hours_ago), ..Input::payload(&[1; 100]) }).unwrap();
    }
    for _ in 0..2000 {
        log.append(&[2; 100]).unwrap();
    }
    log.apply_retention().unwrap();
    let first = log.first_offset();
    assert!(first > 0 && first <= 2000, "old segments gone, recent kept: {first}");
    let r = log.reader().read_next().unwrap().unwrap().to_owned();
    assert!(r.offset >= first);
}

/// An age cap beyond what 64 bits of nanoseconds hold (about 585 years, a way of saying "never")
/// deletes nothing: it was cut to its low 64 bits (600 years to about 15), and deleted segments of
/// records stamped 20 years ago.
#[test]
fn an_age_cap_too_long_for_nanoseconds_deletes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let centuries = Duration::from_secs(600 * 365 * 86_400);
    let mut log = Log::open(dir.path(), opts(Retention { max_age: Some(centuries), ..Default::default() })).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let twenty_years_ago = now - 20 * 365 * 86_400 * 1_000_000_000;
    for _ in 0..4000 {
        log.append_with(&Input { timestamp: Some(twenty_years_ago), ..Input::payload(&[1; 100]) }).unwrap();
    }
    log.apply_retention().unwrap();
    assert_eq!(log.first_offset(), 0, "nothing is 600 years old");
}

/// `count` records of 64 bytes, and group `name` that has acknowledged all but the first.
fn acked_all_but_the_first(log: &mut Log, name: &str, count: u64) -> petrel_log::ConsumerGroup {
    for i in 0..count {
        log.append(&i.to_le_bytes().repeat(8)).unwrap();
    }
    let mut g = log.group(name, GroupOptions { max_pending: 8192, ..Default::default() }).unwrap();
    let mut seen = 0;
    while seen < count {
        let offsets: Vec<u64> = g.poll(1000, Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
        seen += offsets.len() as u64;
        for o in offsets.into_iter().filter(|&o| o != 0) {
            g.ack(o).unwrap();
        }
    }
    g
}

/// Appends until retention has removed the first segment.
fn append_until_the_first_segment_goes(log: &mut Log) -> u64 {
    while log.first_offset() == 0 {
        log.append(&[9u8; 64]).unwrap();
    }
    log.first_offset()
}

#[test]
fn acknowledgements_ahead_of_a_closed_groups_cursor_outlive_retention() {
    let dir = tempfile::tempdir().unwrap();
    let mut log =
        Log::open(dir.path(), opts(Retention { max_bytes: Some(4 * MIN_SEGMENT_BYTES), ..Default::default() }))
            .unwrap();
    let g = acked_all_but_the_first(&mut log, "g", 3000);
    drop(g);
    let first = append_until_the_first_segment_goes(&mut log);
    assert!(first > 0 && first < 3000, "{first}");
    let info = log.groups().into_iter().find(|g| g.name == "g").unwrap();
    assert_eq!((info.committed, info.acked_above), (3000, 0), "moved over the records it acknowledged");
    let mut g = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(g.take(Duration::ZERO).unwrap().unwrap().offset, 3000, "no acknowledged record again");
}

#[test]
fn an_open_group_catching_up_with_retention_steps_over_what_it_acknowledged_before() {
    let dir = tempfile::tempdir().unwrap();
    let mut log =
        Log::open(dir.path(), opts(Retention { max_bytes: Some(4 * MIN_SEGMENT_BYTES), ..Default::default() }))
            .unwrap();
    drop(acked_all_but_the_first(&mut log, "g", 3000));
    // Open again: its acknowledgements are to be stepped over, as retention removes the head.
    let mut g = log.group("g", GroupOptions { max_pending: 8192, ..Default::default() }).unwrap();
    let first = append_until_the_first_segment_goes(&mut log);
    assert!(first > 0 && first < 3000, "{first}");
    assert_eq!(g.take(Duration::ZERO).unwrap().unwrap().offset, 3000, "no acknowledged record again");
    g.ack(3000).unwrap();
    drop(g);
    let info = log.groups().into_iter().find(|g| g.name == "g").unwrap();
    assert_eq!((info.committed, info.acked_above), (3001, 0));
}

#[test]
fn a_group_closed_before_it_noticed_retention_counts_its_loss_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut log =
        Log::open(dir.path(), opts(Retention { max_bytes: Some(4 * MIN_SEGMENT_BYTES), ..Default::default() }))
            .unwrap();
    let g = log.group("g", GroupOptions::default()).unwrap();
    let first = append_until_the_first_segment_goes(&mut log);
    drop(g);
    let g = log.group("g", GroupOptions::default()).unwrap();
    let info = log.groups().into_iter().find(|g| g.name == "g").unwrap();
    assert_eq!(info.skipped, first, "counted by retention, not again when opened");
    drop(g);
}

#[test]
fn a_held_record_keeps_its_segment_until_it_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), opts(Retention { delete_consumed: true, ..Default::default() })).unwrap();
    for i in 0..3000u64 {
        log.append(&[i as u8; 100]).unwrap();
    }
    let mut g = log.group("g", GroupOptions { max_pending: 16, ..Default::default() }).unwrap();
    assert_eq!(g.poll(1, Duration::ZERO).unwrap().into_iter().next().map(|r| r.offset), Some(0));
    for _ in 1..3000 {
        let offset = g.poll(1, Duration::ZERO).unwrap().into_iter().next().unwrap().offset;
        g.ack(offset).unwrap();
    }
    log.apply_retention().unwrap();
    assert_eq!(log.first_offset(), 0, "the held record's segment stays, and those after it");
    g.ack(0).unwrap();
    log.apply_retention().unwrap();
    assert!(log.first_offset() > 0, "acknowledged, it goes with the rest");
}

/// A byte cap that removes a held record counts that record lost, not every record the group
/// acknowledged after it; the group's lag counts only what it has not acknowledged.
#[test]
fn a_cap_removing_a_held_record_counts_one_loss_and_lag_counts_what_is_unacknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 4 * MIN_SEGMENT_BYTES;
    let mut log = Log::open(dir.path(), opts(Retention { max_bytes: Some(cap), ..Default::default() })).unwrap();
    let mut g = log.group("g", GroupOptions { max_pending: 16, ..Default::default() }).unwrap();
    log.append(&[0u8; 64]).unwrap();
    assert_eq!(g.poll(1, Duration::ZERO).unwrap().into_iter().next().map(|r| r.offset), Some(0), "held");
    let last = loop {
        let last = log.append(&[1u8; 64]).unwrap();
        if log.first_offset() > 0 {
            break last;
        }
        let offset = g.poll(1, Duration::ZERO).unwrap().into_iter().next().unwrap().offset;
        g.ack(offset).unwrap();
    };
    let info = &log.groups()[0];
    assert_eq!((info.committed, info.held, info.skipped), (0, 1, 0), "nothing it had not read was removed");
    assert_eq!(info.unacknowledged(log.next_offset()), 2, "the held one and the newest");
    // Its next poll steps over the held record retention took: one loss.
    let next = g.poll(1, Duration::ZERO).unwrap().into_iter().next().unwrap().offset;
    assert_eq!(next, last);
    let info = &log.groups()[0];
    assert_eq!((info.held, info.skipped), (0, 1));
    assert_eq!(g.committed(), last);
}

/// A log that every group has read and acknowledged to its end gives its disk back at once: its
/// grown active segment is sealed and deleted with the others, the next one starts at the first
/// size, and appends and the group go on where they were, across a reopen too. Before, a drained
/// log kept its active segment (and what it had emptied since its last roll) until appends
/// filled that segment.
#[test]
fn a_drained_log_gives_back_its_active_segment_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options {
        segment_bytes: 4 << 20,
        initial_segment_bytes: Some(MIN_SEGMENT_BYTES),
        retention: Retention { delete_consumed: true, ..Default::default() },
        ..Options::default()
    };
    let mut log = Log::open(dir.path(), options.clone()).unwrap();
    let mut group = log.group("g", GroupOptions { max_pending: 8192, ..Default::default() }).unwrap();
    let count = 40_000u64; // 200 bytes each: segments grow to 4 MiB
    for i in 0..count {
        log.append(&i.to_le_bytes().repeat(25)).unwrap();
    }
    let (segments, grown) = (log.stats().segments, du(dir.path()));
    assert!(segments > 3 && grown > 4 << 20, "{segments} segments, {grown} bytes");
    let report = log.give_back().unwrap();
    assert_eq!((report.segments_removed, log.stats().segments), (0, segments), "nothing read: nothing goes");
    // All but the last record: still not drained.
    for n in 0..count - 1 {
        assert_eq!(group.take(Duration::ZERO).unwrap().unwrap().offset, n);
    }
    log.give_back().unwrap();
    assert_eq!(log.stats().segments, 1, "the emptied sealed segments go");
    assert!(
        log.first_offset() < count - 1 && du(dir.path()) > 1 << 20,
        "the active segment stays while a record waits"
    );
    assert_eq!(group.take(Duration::ZERO).unwrap().unwrap().offset, count - 1);
    let report = log.give_back().unwrap();
    assert_eq!(log.stats().segments, 1, "only the new, small active segment: {report:?}");
    assert!(report.segments_removed >= 1 && report.records_removed > 0, "{report:?}");
    assert!(du(dir.path()) <= MIN_SEGMENT_BYTES, "{} bytes of segments left", du(dir.path()));
    assert_eq!(log.first_offset(), count);
    let again = log.give_back().unwrap();
    assert_eq!((again.segments_removed, log.stats().segments), (0, 1), "a small active segment stays");
    // Appends and the group go on.
    assert_eq!(log.append(b"after").unwrap(), count);
    assert_eq!(group.take(Duration::ZERO).unwrap().unwrap().payload, b"after");
    assert!(group.take(Duration::ZERO).unwrap().is_none());
    drop(group);
    drop(log);
    let log = Log::open(dir.path(), options).unwrap();
    assert_eq!((log.first_offset(), log.next_offset()), (count, count + 1));
    let mut group = log.group("g", GroupOptions::default()).unwrap();
    assert!(group.take(Duration::ZERO).unwrap().is_none(), "everything was acknowledged");
}

/// A log no longer written to whose newest record is past the age cap gives its active segment
/// back too (a topic nobody publishes to); a group that had not read its records counts them as
/// skipped, and appends go on after.
#[test]
fn an_idle_log_past_its_age_cap_gives_back_its_active_segment() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options {
        segment_bytes: 1 << 20,
        initial_segment_bytes: Some(MIN_SEGMENT_BYTES),
        retention: Retention { max_age: Some(Duration::from_secs(3600)), ..Default::default() },
        ..Options::default()
    };
    let mut log = Log::open(dir.path(), options).unwrap();
    let group = log.group("reader", GroupOptions::default()).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let two_hours_ago = now - 7200 * 1_000_000_000;
    for _ in 0..100 {
        log.append_with(&Input { timestamp: Some(two_hours_ago), ..Input::payload(&[1; 100]) }).unwrap();
    }
    assert_eq!(log.apply_retention().unwrap().segments_removed, 0, "the active segment is not retention's");
    let report = log.give_back().unwrap();
    assert_eq!((report.records_removed, report.records_skipped), (100, 100), "{report:?}");
    assert_eq!((log.first_offset(), log.next_offset(), log.stats().segments), (100, 100, 1));
    assert_eq!(log.give_back().unwrap().segments_removed, 0, "an empty active segment stays");
    drop(group);
    assert_eq!(log.groups()[0].skipped, 100);
    assert_eq!(log.append(b"new").unwrap(), 100);
    assert_eq!(log.give_back().unwrap().segments_removed, 0, "a recent record stays");
    assert_eq!(log.reader().read_next().unwrap().unwrap().payload, b"new");
}

/// The key index forgets the keys of records retention removed: a log appending distinct keys
/// for ever held every one in memory.
#[test]
fn the_key_index_forgets_keys_of_removed_records() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 4 * MIN_SEGMENT_BYTES;
    let options = Options { key_index: true, ..opts(Retention { max_bytes: Some(cap), ..Default::default() }) };
    let mut log = Log::open(dir.path(), options).unwrap();
    for i in 0..20_000u64 {
        let key = format!("order-{i}");
        log.append_with(&Input { key: Some(key.as_bytes()), headers: &[], payload: &[7; 64], timestamp: None })
            .unwrap();
    }
    let stats = log.stats();
    assert!(stats.retention_removals > 0, "the cap removed segments");
    let in_log = (stats.next_offset - stats.first_offset) as usize;
    assert!(stats.keys_indexed <= in_log, "{} keys indexed for {in_log} records", stats.keys_indexed);
    assert!(log.reader().get_by_key(b"order-0").unwrap().is_none());
    assert!(log.reader().get_by_key(b"order-19999").unwrap().is_some());
}
