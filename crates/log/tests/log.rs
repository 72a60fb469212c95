//! The log's contract, checked through its public API on real files.

mod common;

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::{read_all, segments, set_format_version};
use petrel_log::verify::{self, ProblemKind};
use petrel_log::{Durability, Error, Input, Log, MIN_SEGMENT_BYTES, Options, OwnedRecord};

fn small(durability: Durability) -> Options {
    Options { segment_bytes: MIN_SEGMENT_BYTES, durability, ..Options::default() }
}

/// Payload of record `i`: its length varies, its bytes depend on `i`.
fn payload(i: u64) -> Vec<u8> {
    let len = (i * 7919 % 300) as usize;
    (0..len).map(|j| (i as usize * 31 + j) as u8).collect()
}

#[test]
fn appends_and_reads_back_across_segments_and_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    for i in 0..3000u64 {
        let key = format!("k{}", i % 10);
        let input = Input {
            key: (i % 3 == 0).then_some(key.as_bytes()),
            headers: if i % 5 == 0 { &[("h", b"v"), ("empty", b"")] } else { &[] },
            payload: &payload(i),
            timestamp: None,
        };
        assert_eq!(log.append_with(&input).unwrap(), i);
    }
    let range = log.append_batch(&[b"x".as_slice(), b"y", b""]).unwrap();
    assert_eq!(range, 3000..3003);
    assert!(segments(dir.path()).len() > 5, "small segments must roll");

    let check = |records: &[OwnedRecord]| {
        assert_eq!(records.len(), 3003);
        let mut last_ts = 0;
        for (i, r) in records.iter().enumerate().take(3000) {
            let i = i as u64;
            assert_eq!(r.offset, i);
            assert_eq!(r.payload, payload(i));
            assert_eq!(r.key.is_some(), i.is_multiple_of(3));
            assert_eq!(r.headers.len(), if i.is_multiple_of(5) { 2 } else { 0 });
            assert!(r.timestamp >= last_ts);
            last_ts = r.timestamp;
        }
        assert_eq!(records[3001].payload, b"y");
    };
    check(&read_all(&mut log.reader()));
    let mut reader = log.reader();
    for offset in [0, 1, 777, 2999, 1500, 3002] {
        assert_eq!(reader.get(offset).unwrap().unwrap().offset, offset);
    }
    assert!(reader.get(3003).unwrap().is_none());
    drop(log);

    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert_eq!(log.next_offset(), 3003);
    check(&read_all(&mut log.reader()));
    assert_eq!(log.append(b"after reopen").unwrap(), 3003);
    assert_eq!(log.reader().get(3003).unwrap().unwrap().payload, b"after reopen");
}

#[test]
fn a_second_writer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _log = Log::open(dir.path(), Options::default()).unwrap();
    let err = Log::open(dir.path(), Options::default()).err().expect("second open must fail");
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    // Offline readers need no lock.
    verify::open_read_only(dir.path()).unwrap();
}

/// A consumer group writes its cursor file: it keeps the directory locked after its writer is
/// dropped, so that a second writer cannot open the group beside it (two mappings writing one
/// cursor). A reader writes nothing and does not.
#[test]
fn a_consumer_group_keeps_the_directory_locked_after_its_writer_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::open(dir.path(), Options::default()).unwrap();
    let group = log.group("workers", petrel_log::GroupOptions::default()).unwrap();
    let reader = log.reader();
    drop(log);
    let err = Log::open(dir.path(), Options::default()).err().expect("the group holds the lock");
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    drop(group);
    let log = Log::open(dir.path(), Options::default()).unwrap();
    drop(reader);
    // A group syncing every nanosecond would keep the process's sync thread spinning.
    let spinning = petrel_log::GroupOptions {
        durability: Durability::Interval(std::time::Duration::from_nanos(1)),
        ..petrel_log::GroupOptions::default()
    };
    let err = log.group("spinning", spinning).err().expect("refused");
    assert!(matches!(err, Error::Config(_)), "{err}");
    let every_ms = petrel_log::GroupOptions {
        durability: Durability::Interval(std::time::Duration::from_millis(1)),
        ..petrel_log::GroupOptions::default()
    };
    drop(log.group("every-ms", every_ms).unwrap());
    drop(log);
}

#[test]
fn limits_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options { max_record_bytes: 1000, ..small(Durability::None) };
    let mut log = Log::open(dir.path(), opts).unwrap();
    let err = log.append(&[0u8; 1001]).unwrap_err();
    assert!(matches!(err, Error::RecordTooLarge { size: 1001, max: 1000 }), "{err}");
    // A batch is checked whole before anything is written.
    let err = log.append_batch(&[vec![1u8; 10], vec![2u8; 2000]]).unwrap_err();
    assert!(matches!(err, Error::RecordTooLarge { .. }));
    assert_eq!(log.next_offset(), 0);
    let key = vec![0u8; 70_000];
    let err = log.append_with(&Input { key: Some(&key), ..Input::payload(b"") }).unwrap_err();
    assert!(matches!(err, Error::RecordTooLarge { .. } | Error::InvalidRecord(_)), "{err}");
    assert!(Log::open(dir.path().join("x"), Options { segment_bytes: 1000, ..Options::default() }).is_err());
}

#[test]
fn a_record_larger_than_a_segment_gets_a_segment_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let big = vec![0xabu8; 200_000];
    log.append(b"before").unwrap();
    assert_eq!(log.append(&big).unwrap(), 1);
    log.append(b"after").unwrap();
    drop(log);
    let log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let records = read_all(&mut log.reader());
    assert_eq!(records[1].payload, big);
    assert_eq!(records[2].payload, b"after");
}

#[test]
fn timestamps_never_go_backwards() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), Options::default()).unwrap();
    log.append_with(&Input { timestamp: Some(5_000), ..Input::payload(b"a") }).unwrap();
    log.append_with(&Input { timestamp: Some(1_000), ..Input::payload(b"b") }).unwrap();
    log.append(b"c").unwrap();
    let r = read_all(&mut log.reader());
    assert_eq!(r[0].timestamp, 5_000);
    assert_eq!(r[1].timestamp, 5_000, "an earlier timestamp is raised to the previous one");
    assert!(r[2].timestamp > 1_600_000_000_000_000_000, "current time in ns");
    // Nor across a reopen: the last record's time is where the next one starts from.
    let last = r[2].timestamp;
    drop(log);
    let mut log = Log::open(dir.path(), Options::default()).unwrap();
    log.append_with(&Input { timestamp: Some(0), ..Input::payload(b"d") }).unwrap();
    assert_eq!(read_all(&mut log.reader())[3].timestamp, last, "raised to the time before the reopen");
}

/// Writes `n` equal-sized records to a fresh log; returns the position of each frame.
fn fixed_log(dir: &Path, n: u64, len: usize) -> Vec<u64> {
    let mut log = Log::open(dir, small(Durability::None)).unwrap();
    for i in 0..n {
        log.append(&vec![i as u8 + 1; len]).unwrap();
    }
    drop(log);
    frame_starts(&segments(dir)[0])
}

/// Where the frames of a segment file start, and where the last one ends (with its padding):
/// frames with and without their own timestamp differ in length.
fn frame_starts(segment: &Path) -> Vec<u64> {
    let bytes = fs::read(segment).unwrap();
    let mut starts = vec![64u64];
    loop {
        let at = *starts.last().unwrap() as usize;
        match unpadded_len(&bytes, at) {
            0 => return starts,
            len => starts.push((at + len as usize).next_multiple_of(8) as u64),
        }
    }
}

/// The unpadded length of the frame at `at` (format 3), 0 where none is.
fn unpadded_len(bytes: &[u8], at: usize) -> u64 {
    bytes.get(at + 4..at + 8).map_or(0, |w| (u32::from_le_bytes(w.try_into().unwrap()) & 0x3fff_ffff) as u64)
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_torn_last_frame_is_cut_at_every_byte_position() {
    let base = tempfile::tempdir().unwrap();
    let pristine = base.path().join("pristine");
    let starts = fixed_log(&pristine, 20, 45);
    let seg = segments(&pristine).pop().unwrap();
    let name = seg.file_name().unwrap().to_owned();
    let last = starts[19];
    let end = last + unpadded_len(&fs::read(&seg).unwrap(), last as usize);
    for cut in last + 1..end {
        for truncate in [false, true] {
            let work = base.path().join(format!("w{cut}{truncate}"));
            copy_dir(&pristine, &work);
            let file = work.join(&name);
            if truncate {
                fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(cut).unwrap();
            } else {
                let mut bytes = fs::read(&file).unwrap();
                bytes[cut as usize..end as usize].fill(0);
                fs::write(&file, bytes).unwrap();
            }
            let mut log = Log::open(&work, small(Durability::None)).unwrap();
            assert_eq!(log.next_offset(), 19, "cut at {cut} (truncate: {truncate})");
            assert_eq!(log.recovery_report().torn_at, Some(last));
            let records = read_all(&mut log.reader());
            assert_eq!(records.len(), 19);
            assert!(records.iter().all(|r| r.payload == vec![r.offset as u8 + 1; 45]));
            assert_eq!(log.append(b"next").unwrap(), 19);
            drop(log);
            let log = Log::open(&work, small(Durability::None)).unwrap();
            assert_eq!(log.recovery_report().torn_at, None, "the cut is clean on the next open");
            assert_eq!(read_all(&mut log.reader())[19].payload, b"next");
            fs::remove_dir_all(&work).unwrap();
        }
    }
}

/// A repair that cuts the log inside a batch keeps the batch's records before the damage: they
/// were appended and acknowledged whole, and only a crash's unfinished batch is cut whole.
#[test]
fn a_repair_inside_a_batch_keeps_its_records_before_the_damage() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), Options::default()).unwrap();
    let batches: [Vec<Vec<u8>>; 2] = [
        (0..10).map(|i| format!("first batch, record {i}").into_bytes()).collect(),
        (0..50).map(|i| format!("second batch, record {i:02}: {}", "x".repeat(40)).into_bytes()).collect(),
    ];
    for batch in &batches {
        log.append_batch(batch).unwrap();
    }
    drop(log);
    // Damage record 30 of the second batch (offset 40): valid records follow it.
    let seg = &segments(dir.path())[0];
    let mut bytes = fs::read(seg).unwrap();
    let at = bytes.windows(26).position(|w| w == b"second batch, record 30: x").unwrap();
    bytes[at + 3] ^= 0x20;
    fs::write(seg, &bytes).unwrap();
    assert!(matches!(Log::open(dir.path(), Options::default()), Err(Error::Corrupt { .. })));

    let report = verify::repair(dir.path()).unwrap();
    assert_eq!(report.next_offset, 40, "{report:?}");
    let mut log = Log::open(dir.path(), Options::default()).unwrap();
    assert_eq!(log.next_offset(), 40, "the 30 records before the damage stay");
    let kept: Vec<Vec<u8>> = read_all(&mut log.reader()).into_iter().map(|r| r.payload).collect();
    assert_eq!(kept, batches.iter().flatten().take(40).cloned().collect::<Vec<_>>());
    assert_eq!(log.append_batch(&[b"after the repair"]).unwrap(), 40..41);
}

#[test]
fn a_flipped_byte_in_a_sealed_segment_is_reported_then_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    for i in 0..2000u64 {
        log.append(&payload(i)).unwrap();
    }
    drop(log);
    let segs = segments(dir.path());
    assert!(segs.len() >= 3);
    let victim = &segs[1];
    let mut bytes = fs::read(victim).unwrap();
    let at = 64 + 32 * 1024 + 8; // somewhere inside the segment's frames
    bytes[at] ^= 0x40;
    fs::write(victim, &bytes).unwrap();

    // Opening does not scan sealed segments; reading them checks every frame.
    let log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let mut reader = log.reader();
    let err = loop {
        match reader.read_batch(100) {
            Ok(b) if b.is_empty() => panic!("corruption went unnoticed"),
            Ok(_) => {}
            Err(e) => break e,
        }
    };
    let Error::Corrupt { file, position, offset, .. } = &err else { panic!("{err}") };
    assert_eq!(file, victim);
    assert!(*position <= at as u64 && *position + 400 > at as u64, "{err}");
    let bad_offset = offset.unwrap();
    assert!(err.to_string().contains(&victim.display().to_string()));
    // A batch of lookups checks every frame too: the records before the damaged one come, then
    // the error names it.
    let mut got = Vec::new();
    let err = reader.get_many(&[0, bad_offset - 1, bad_offset, 1], |i, r| got.push((i, r.offset))).unwrap_err();
    assert_eq!(got, [(0, 0), (1, bad_offset - 1)]);
    let Error::Corrupt { file, offset, .. } = &err else { panic!("{err}") };
    assert_eq!((file, *offset), (victim, Some(bad_offset)));
    drop(log);

    let report = verify::verify(dir.path(), |_, _| {}).unwrap();
    assert!(!report.is_clean());
    let problem = &report.problems[0];
    assert_eq!((problem.kind, &problem.file, problem.offset), (ProblemKind::Corrupt, victim, Some(bad_offset)));
    assert_eq!(report.records, 1999, "only the damaged record is unreadable");

    let repaired = verify::repair(dir.path()).unwrap();
    assert_eq!(repaired.records_removed, 2000 - bad_offset - 1);
    assert_eq!(repaired.next_offset, bad_offset);
    assert!(verify::verify(dir.path(), |_, _| {}).unwrap().problems.is_empty());
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert_eq!(log.next_offset(), bad_offset);
    let records = read_all(&mut log.reader());
    assert_eq!(records.len() as u64, bad_offset);
    assert!(records.iter().all(|r| r.payload == payload(r.offset)));
    assert_eq!(log.append(b"resumed").unwrap(), bad_offset);
}

#[test]
fn damage_before_valid_frames_in_the_last_segment_fails_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let starts = fixed_log(dir.path(), 50, 20);
    let seg = segments(dir.path()).pop().unwrap();
    let mut bytes = fs::read(&seg).unwrap();
    bytes[starts[10] as usize + 20] ^= 1;
    fs::write(&seg, &bytes).unwrap();
    let err = Log::open(dir.path(), small(Durability::None)).err().expect("must not open");
    let Error::Corrupt { file, position, offset, before_tail: true, .. } = &err else { panic!("{err}") };
    assert_eq!((file, *position, *offset), (&seg, starts[10], Some(10)));
    assert!(verify::open_read_only(dir.path()).is_err());
    let repaired = verify::repair(dir.path()).unwrap();
    assert_eq!(repaired.records_removed, 39);
    assert_eq!(Log::open(dir.path(), small(Durability::None)).unwrap().next_offset(), 10);
}

#[test]
fn a_last_segment_cut_below_its_durable_checkpoint_is_damage_not_a_torn_tail() {
    // Under `always` every record was synced and acknowledged, and the checkpoint says so: a file
    // that ends inside those records lost them after the fact. Open and verify took it for a torn
    // tail before, and the log opened without them.
    for truncate in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(dir.path(), small(Durability::Always)).unwrap();
        for i in 0..50u64 {
            log.append(&[i as u8 + 1; 20]).unwrap();
        }
        drop(log);
        let seg = segments(dir.path()).pop().unwrap();
        let starts = frame_starts(&seg);
        let cut = starts[30] + 3; // inside record 30
        if truncate {
            fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(cut).unwrap();
        } else {
            let mut bytes = fs::read(&seg).unwrap();
            bytes[cut as usize..starts[50] as usize].fill(0);
            fs::write(&seg, bytes).unwrap();
        }
        // Recovery reads from the checkpoint on (where the file is zeros now); the records
        // before it must still be found missing.
        for _ in 0..2 {
            let err = Log::open(dir.path(), small(Durability::Always)).err().expect("must not open");
            let Error::Corrupt { file, position, offset, before_tail: true, .. } = &err else { panic!("{err}") };
            assert_eq!((file, *position, *offset), (&seg, starts[30], Some(30)), "truncate: {truncate}");
            assert!(err.to_string().contains("records 30..50"), "{err}");
        }
        let report = verify::verify(dir.path(), |_, _| {}).unwrap();
        assert!(!report.is_clean(), "truncate: {truncate}: {:?}", report.problems);
        let problem = &report.problems[0];
        assert_eq!((problem.kind, &problem.file, problem.offset), (ProblemKind::Corrupt, &seg, Some(30)));
        assert_eq!(problem.position, starts[30]);
        assert!(problem.detail.contains("records 30..50"), "{}", problem.detail);

        let repaired = verify::repair(dir.path()).unwrap();
        assert_eq!(repaired.next_offset, 30);
        assert!(verify::verify(dir.path(), |_, _| {}).unwrap().problems.is_empty());
        let mut log = Log::open(dir.path(), small(Durability::Always)).unwrap();
        assert_eq!(log.next_offset(), 30);
        assert!(read_all(&mut log.reader()).iter().all(|r| r.payload == vec![r.offset as u8 + 1; 20]));
        assert_eq!(log.append(b"resumed").unwrap(), 30);
    }
}

#[test]
fn a_damaged_record_every_group_has_passed_is_replaced_and_the_records_after_it_stay() {
    // Record 10 of 50 damaged (a flipped payload byte), after the only group acknowledged 30:
    // repair used to cut the log there, taking the 20 records nobody had read yet with it.
    let dir = tempfile::tempdir().unwrap();
    let starts = fixed_log(dir.path(), 50, 20);
    {
        let log = Log::open(dir.path(), small(Durability::None)).unwrap();
        let mut g = log.group("g", petrel_log::GroupOptions::default()).unwrap();
        let offsets: Vec<u64> = g.poll(30, std::time::Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
        for o in offsets {
            g.ack(o).unwrap();
        }
        assert_eq!(g.committed(), 30);
    }
    let seg = segments(dir.path()).pop().unwrap();
    let mut bytes = fs::read(&seg).unwrap();
    bytes[starts[11] as usize - 5] ^= 0x04; // the end of record 10's payload
    fs::write(&seg, &bytes).unwrap();

    let report = verify::verify(dir.path(), |_, _| {}).unwrap();
    let problem = &report.problems[0];
    assert_eq!((problem.kind, problem.offset, problem.records_lost), (ProblemKind::Corrupt, Some(10), Some(1)));
    assert!(problem.detail.contains("record 10 lost"), "{}", problem.detail);
    assert_eq!(report.next_offset, 50, "the records after it are counted under their offsets");
    let plan = verify::plan(dir.path(), &report).unwrap();
    assert_eq!((plan.replace.len(), plan.cut.is_none()), (1, true));
    // A topic's log (whose groups may seek back over it) is cut there instead.
    let topic_plan = verify::plan_with(dir.path(), &report, verify::Replace::Never).unwrap();
    assert_eq!((topic_plan.replace.len(), topic_plan.cut.as_ref().and_then(|c| c.offset)), (0, Some(10)));
    let repaired = verify::repair(dir.path()).unwrap();
    assert_eq!((repaired.records_replaced, repaired.records_removed, repaired.cut_at), (vec![10], 0, None));
    assert!(verify::verify(dir.path(), |_, _| {}).unwrap().problems.is_empty());
    let after = fs::read(&seg).unwrap();
    assert_eq!(after[starts[11] as usize..], bytes[starts[11] as usize..], "the frames after it are as they were");

    let log = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert_eq!(log.next_offset(), 50);
    let records = read_all(&mut log.reader());
    assert_eq!(records.len(), 50);
    for r in &records {
        match r.offset {
            10 => assert!(r.payload.iter().all(|&b| b == 0), "a record of zeros in its place"),
            o => assert_eq!(r.payload, vec![o as u8 + 1; 20]),
        }
    }
    assert!(records.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    let mut g = log.group("g", petrel_log::GroupOptions::default()).unwrap();
    let next: Vec<u64> = g.poll(100, std::time::Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
    assert_eq!(next, (30..50).collect::<Vec<_>>(), "the group goes on where it was");
}

#[test]
fn damage_in_a_record_a_group_has_not_passed_or_across_two_records_is_still_cut() {
    for (acked, two_records) in [(5, false), (30, true)] {
        let dir = tempfile::tempdir().unwrap();
        let starts = fixed_log(dir.path(), 50, 20);
        {
            let log = Log::open(dir.path(), small(Durability::None)).unwrap();
            let mut g = log.group("g", petrel_log::GroupOptions::default()).unwrap();
            let offsets: Vec<u64> =
                g.poll(acked, std::time::Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
            offsets.into_iter().for_each(|o| g.ack(o).unwrap());
        }
        let seg = segments(dir.path()).pop().unwrap();
        let mut bytes = fs::read(&seg).unwrap();
        bytes[starts[11] as usize - 5] ^= 0x04;
        if two_records {
            bytes[starts[11] as usize + 6] ^= 0x01; // record 11's length word too
        }
        fs::write(&seg, &bytes).unwrap();
        let repaired = verify::repair(dir.path()).unwrap();
        assert!(repaired.records_replaced.is_empty(), "acked {acked}, two records {two_records}");
        assert_eq!(repaired.next_offset, 10);
        assert_eq!(Log::open(dir.path(), small(Durability::None)).unwrap().next_offset(), 10);
    }
}

#[test]
fn a_damaged_header_of_the_last_segment_is_rewritten_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    fixed_log(dir.path(), 50, 20);
    let seg = segments(dir.path()).pop().unwrap();
    let mut bytes = fs::read(&seg).unwrap();
    bytes[33] ^= 0x10; // the creation time: the header's CRC no longer matches
    fs::write(&seg, &bytes).unwrap();
    assert_eq!(verify::verify(dir.path(), |_, _| {}).unwrap().problems.len(), 1);
    let log = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert_eq!(log.next_offset(), 50);
    assert_eq!(log.recovery_report().torn_at, None);
    assert!(read_all(&mut log.reader()).iter().enumerate().all(|(i, r)| r.payload == vec![i as u8 + 1; 20]));
    drop(log);
    assert!(verify::verify(dir.path(), |_, _| {}).unwrap().problems.is_empty());
}

/// A writer appending batches of 20 records (record `o` is `o % 20` repeated `40 + o % 20 * 13`
/// times) to the log in `dir` on a thread of its own, until told to stop; returns once the log
/// has a segment.
fn appending_beside(dir: &Path) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (path, stop) = (dir.to_path_buf(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut log = Log::open(&path, small(Durability::None)).unwrap();
            let batch: Vec<Vec<u8>> = (0..20).map(|i| vec![i as u8; 40 + i * 13]).collect();
            while !stop.load(Ordering::Relaxed) {
                log.append_batch(&batch).unwrap();
                std::thread::sleep(std::time::Duration::from_micros(20)); // tens of MB, not GBs
            }
        })
    };
    while !verify::holds_segments(dir) {
        std::thread::yield_now();
    }
    (stop, writer)
}

#[test]
fn verify_beside_a_writer_does_not_take_a_write_in_progress_for_damage() {
    // A record half written while the next one is whole looked like damage before valid frames
    // ("CORRUPT … bad magic; records from N on lost"), in a few runs of 30 beside a server.
    let dir = tempfile::tempdir().unwrap();
    let (stop, writer) = appending_beside(dir.path());
    let started = std::time::Instant::now();
    for run in (0..40).take_while(|_| started.elapsed() < std::time::Duration::from_secs(3)) {
        let report = verify::verify(dir.path(), |_, _| {}).unwrap();
        assert!(report.is_clean(), "run {run}: {:?}", report.problems);
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
}

#[test]
fn reading_beside_a_writer_does_not_take_a_write_in_progress_for_damage() {
    // What `petrel log dump` and `groups` open: a read-only log of what is written so far.
    let dir = tempfile::tempdir().unwrap();
    let (stop, writer) = appending_beside(dir.path());
    let started = std::time::Instant::now();
    let mut runs = 0;
    while started.elapsed() < std::time::Duration::from_secs(3) {
        let mut reader = verify::open_read_only(dir.path()).unwrap_or_else(|e| panic!("run {runs}: {e}"));
        let records = read_all(&mut reader);
        assert!(records.iter().all(|r| r.payload == vec![(r.offset % 20) as u8; 40 + (r.offset % 20) as usize * 13]));
        runs += 1;
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(runs > 0);
}

#[test]
fn an_unreadable_cursor_is_reported_by_verify_and_its_group_restarted_by_repair() {
    // Both slots of a cursor damaged: the log does not open. verify said "ok" and repair "no bad
    // frames", so nothing but deleting the file by hand brought the log back.
    let dir = tempfile::tempdir().unwrap();
    fixed_log(dir.path(), 50, 20);
    {
        let log = Log::open(dir.path(), small(Durability::None)).unwrap();
        let mut group = log.group("workers", petrel_log::GroupOptions::default()).unwrap();
        let taken: Vec<u64> =
            group.poll(10, std::time::Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
        for offset in taken {
            group.ack(offset).unwrap();
        }
        assert_eq!(group.committed(), 10);
    }
    let cursor = dir.path().join("groups").join("workers.cursor");
    // (Damaged: bytes that are no slot. Zeros are a cursor that never reached the disk, which
    // starts its group again without a repair: groups.rs.)
    fs::write(&cursor, vec![0xA5u8; 4096]).unwrap();
    assert!(Log::open(dir.path(), small(Durability::None)).is_err());
    let report = verify::verify(dir.path(), |_, _| {}).unwrap();
    assert!(!report.is_clean());
    assert_eq!(report.problems.len(), 1);
    assert_eq!((report.problems[0].kind, &report.problems[0].file), (ProblemKind::Cursor, &cursor));
    // The read-only tools still show the log (`petrel log dump`), and name the damaged group
    // (`petrel log groups`), which is what an operator looks at before a repair.
    assert_eq!(read_all(&mut verify::open_read_only(dir.path()).unwrap()).len(), 50);
    assert!(verify::list_groups(dir.path()).is_err());
    let (readable, unreadable) = verify::list_readable_groups(dir.path()).unwrap();
    assert!(readable.is_empty());
    assert_eq!(unreadable.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>(), ["workers"]);
    let repaired = verify::repair(dir.path()).unwrap();
    assert_eq!((repaired.groups_restarted.as_slice(), repaired.records_removed), (&["workers".to_owned()][..], 0));
    assert!(verify::verify(dir.path(), |_, _| {}).unwrap().problems.is_empty());
    // At the oldest record on disk: what it had acknowledged comes again, nothing is lost.
    let log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let mut group = log.group("workers", petrel_log::GroupOptions::default()).unwrap();
    assert_eq!(group.committed(), 0);
    assert_eq!(group.poll(100, std::time::Duration::ZERO).unwrap().len(), 50);
}

#[test]
fn a_segment_of_an_unknown_format_version_is_refused_and_left_as_it_is() {
    // A newer build's segment: its header intact, its version unknown here. Taking it for a
    // damaged header would rescan its frames in a format they are not in and cut them.
    for which in ["last", "sealed"] {
        let dir = tempfile::tempdir().unwrap();
        fixed_log(dir.path(), 250, 400);
        let all = segments(dir.path());
        assert!(which == "last" || all.len() > 1);
        let seg = if which == "last" { all.last() } else { all.first() }.unwrap().clone();
        set_format_version(&seg, 6);
        let before = fs::read(&seg).unwrap();
        let err = Log::open(dir.path(), small(Durability::None)).err().expect("must not open");
        let Error::UnsupportedFormat { file, what } = &err else { panic!("{which}: {err}") };
        assert_eq!((file, what.as_str()), (&seg, "format version 6"), "{which}");
        assert!(err.to_string().contains("newer Petrel"), "{err}");
        assert!(matches!(verify::verify(dir.path(), |_, _| {}), Err(Error::UnsupportedFormat { .. })));
        assert!(matches!(verify::repair(dir.path()), Err(Error::UnsupportedFormat { .. })));
        assert!(matches!(verify::open_read_only(dir.path()).err(), Some(Error::UnsupportedFormat { .. })));
        assert!(fs::read(&seg).unwrap() == before, "{which}: the segment was changed");
    }
}

#[test]
fn a_segment_file_longer_than_any_segment_is_refused_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    fixed_log(dir.path(), 50, 20);
    let seg = segments(dir.path()).pop().unwrap();
    // Junk appended past the largest length a segment can have (sparse: no disk is used).
    fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(petrel_log::MAX_SEGMENT_BYTES + 8192).unwrap();
    let err = Log::open(dir.path(), small(Durability::None)).err().expect("must not open");
    assert!(matches!(&err, Error::Corrupt { file, position: 0, .. } if file == &seg), "{err}");
    assert!(verify::verify(dir.path(), |_, _| {}).is_err());
}

#[test]
fn a_lookup_by_time_beside_the_writer_never_returns_an_older_record() {
    // Looks for times just past the log's end while the writer appends: a record written at
    // the end after the lookup found none there must not be returned as the first at or after.
    const N: u64 = 300_000;
    let time = |i: u64| 1_000_000 + 10 * i;
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let looker = {
        let mut reader = log.reader();
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut lookups = 0u64;
            while !done.load(Ordering::Acquire) {
                let t = time(reader.end_offset()) + 5 + 10 * (lookups % 4);
                if let Some(r) = reader.get_by_time(t).unwrap() {
                    assert!(r.timestamp >= t, "record {} at {} for a lookup of {t}", r.offset, r.timestamp);
                }
                lookups += 1;
            }
            lookups
        })
    };
    for i in 0..N {
        log.append_with(&Input { timestamp: Some(time(i)), ..Input::payload(&i.to_le_bytes()) }).unwrap();
    }
    done.store(true, Ordering::Release);
    assert!(looker.join().unwrap() > 0);
}

#[test]
fn readers_on_other_threads_see_every_record_while_the_writer_appends() {
    const N: u64 = 100_000;
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let mut reader = log.reader();
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let mut next = 0u64;
                while next < N {
                    let batch = reader.read_batch(50).unwrap();
                    if batch.is_empty() {
                        assert!(!done.load(Ordering::Acquire) || reader.end_offset() > next, "lost records");
                        std::thread::yield_now();
                        continue;
                    }
                    for r in batch {
                        assert_eq!(r.offset, next);
                        assert_eq!(r.payload, &next.to_le_bytes()[..((next % 8) as usize + 1)]);
                        next += 1;
                    }
                }
            })
        })
        .collect();
    let mut i = 0u64;
    while i < N {
        if i.is_multiple_of(3) {
            let batch: Vec<Vec<u8>> =
                (i..(i + 5).min(N)).map(|j| j.to_le_bytes()[..(j % 8) as usize + 1].to_vec()).collect();
            i = log.append_batch(&batch).unwrap().end;
        } else {
            log.append(&i.to_le_bytes()[..(i % 8) as usize + 1]).unwrap();
            i += 1;
        }
    }
    done.store(true, Ordering::Release);
    for r in readers {
        r.join().unwrap();
    }
}

#[test]
fn shared_log_appends_from_many_threads_with_group_commit() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::open(dir.path(), small(Durability::Always)).unwrap().into_shared();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                (0..100u64).map(|i| log.append(format!("{t}:{i}").as_bytes()).unwrap()).collect::<Vec<_>>()
            })
        })
        .collect();
    let mut offsets: Vec<u64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    offsets.sort_unstable();
    assert_eq!(offsets, (0..800).collect::<Vec<_>>());
    let records = read_all(&mut log.reader());
    for t in 0..8 {
        let mine: Vec<_> = records
            .iter()
            .filter_map(|r| {
                std::str::from_utf8(&r.payload)
                    .unwrap()
                    .strip_prefix(&format!("{t}:"))
                    .map(|s| s.parse::<u64>().unwrap())
            })
            .collect();
        assert_eq!(mine, (0..100).collect::<Vec<_>>(), "each thread's records in its order");
    }
}

#[test]
fn group_commit_covers_everyone_who_arrived_during_a_sync_with_one_more_sync() {
    const PRODUCERS: u64 = 8;
    let dir = tempfile::tempdir().unwrap();
    let armed = Arc::new(AtomicBool::new(false));
    let appended = Arc::new(AtomicU64::new(0));
    let held = Arc::new(AtomicBool::new(false));
    let (armed_in, appended_in, held_in) = (Arc::clone(&armed), Arc::clone(&appended), Arc::clone(&held));
    // The first sync after opening is held until every producer has appended: all of them wait
    // for a sync while it runs.
    let on_sync = petrel_log::SyncObserver::new(move |_| {
        if armed_in.load(Ordering::SeqCst) && !held_in.swap(true, Ordering::SeqCst) {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while appended_in.load(Ordering::SeqCst) < PRODUCERS {
                assert!(std::time::Instant::now() < deadline, "the producers never appended");
                std::thread::yield_now();
            }
        }
    });
    let log = Log::open(dir.path(), Options { on_sync, ..small(Durability::Always) }).unwrap().into_shared();
    let before = log.stats().syncs;
    armed.store(true, Ordering::SeqCst);
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let (log, appended) = (log.clone(), Arc::clone(&appended));
            std::thread::spawn(move || {
                let payload = p.to_le_bytes();
                let input = Input { key: None, headers: &[], payload: &payload, timestamp: None };
                let offset = log.append_batch_unsynced(&[input]).unwrap().start;
                appended.fetch_add(1, Ordering::SeqCst);
                log.wait_durable(offset).unwrap();
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    let syncs = log.stats().syncs - before;
    // The held sync covers whoever had appended when it started; everyone else appended before
    // it ended, so the next sync covers them all. Without group commit: one sync each.
    assert!(
        (1..=2).contains(&syncs),
        "{PRODUCERS} producers took {syncs} syncs; the sync under way and one more cover them all"
    );
    assert!(held.load(Ordering::SeqCst), "a sync was held");
}

#[test]
fn interval_durability_stops_cleanly_and_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let opts = small(Durability::Interval(std::time::Duration::from_millis(2)));
    let mut log = Log::open(dir.path(), opts.clone()).unwrap();
    for i in 0..5000u64 {
        log.append(&payload(i)).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(10));
    log.close().unwrap();
    let log = Log::open(dir.path(), opts).unwrap();
    assert_eq!(read_all(&mut log.reader()).len(), 5000);
}

/// Threads of this process with `name` (Linux: /proc/self/task/*/comm).
fn threads_named(name: &str) -> usize {
    fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let comm = fs::read_to_string(t.as_ref().unwrap().path().join("comm")).unwrap_or_default();
            comm.trim_end() == name
        })
        .count()
}

#[test]
fn interval_durability_syncs_many_logs_and_cursors_from_one_thread() {
    let dirs: Vec<_> = (0..40).map(|_| tempfile::tempdir().unwrap()).collect();
    let every = std::time::Duration::from_millis(5);
    let mut logs: Vec<Log> =
        dirs.iter().map(|d| Log::open(d.path(), small(Durability::Interval(every))).unwrap()).collect();
    let group_options = petrel_log::GroupOptions { durability: Durability::Interval(every), ..Default::default() };
    let mut groups: Vec<_> = logs.iter().map(|l| l.group("g", group_options).unwrap()).collect();
    for (log, group) in logs.iter_mut().zip(&mut groups) {
        log.append(b"one").unwrap();
        let offset = group.poll(1, std::time::Duration::ZERO).unwrap().first_offset();
        group.ack(offset).unwrap();
    }
    // Nobody calls sync: the background thread makes every log durable.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while logs.iter().any(|l| l.stats().syncs == 0) {
        assert!(std::time::Instant::now() < deadline, "a log was never synced in the background");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(threads_named("petrel-log-sync"), 1, "one sync thread for 40 logs and 40 cursors");
    assert_eq!(threads_named("petrel-cursor-s"), 0);
}

#[test]
fn a_leftover_segment_from_an_interrupted_roll_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    fixed_log(dir.path(), 3, 10);
    fs::write(dir.path().join("00000000000000000003.log.tmp"), b"half made").unwrap();
    let log = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert_eq!(log.recovery_report().leftovers_removed, 1);
    assert_eq!(log.next_offset(), 3);
}

#[test]
fn index_files_are_written_used_and_rebuilt_when_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    for i in 0..5000u64 {
        log.append_with(&Input { timestamp: Some(10 * i), ..Input::payload(&payload(i)) }).unwrap();
    }
    drop(log);
    let index_dir = dir.path().join("index");
    let mut files: Vec<_> = fs::read_dir(&index_dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.len() >= 5, "sealed segments have index files");
    // Damage one, delete another: both are rebuilt from the frames.
    let mut bytes = fs::read(&files[1]).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&files[1], bytes).unwrap();
    fs::remove_file(&files[2]).unwrap();
    let log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let mut reader = log.reader();
    for offset in (0..5000).rev().step_by(7) {
        let r = reader.get(offset).unwrap().unwrap();
        assert_eq!((r.offset, r.payload), (offset, &payload(offset)[..]));
    }
    for t in [0, 5, 10, 12_345, 49_990, 49_991].into_iter().chain((0..50_000).step_by(97)) {
        assert_eq!(reader.offset_at_time(t).unwrap(), t.div_ceil(10).min(5000));
    }
    assert!(files[2].exists(), "a missing index file is written again");
}

#[test]
fn the_key_index_finds_the_last_record_with_a_key_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options { key_index: true, ..small(Durability::None) };
    let mut log = Log::open(dir.path(), opts.clone()).unwrap();
    for i in 0..3000u64 {
        let key = format!("user-{}", i % 100);
        let headers: &[(&str, &[u8])] = if i % 2 == 0 { &[("h", b"v")] } else { &[] };
        log.append_with(&Input { key: Some(key.as_bytes()), headers, payload: &i.to_le_bytes(), timestamp: None })
            .unwrap();
    }
    let keyed: Vec<Input<'_>> = vec![Input { key: Some(b"batch"), ..Input::payload(b"1") }; 3];
    log.append_batch_with(&keyed).unwrap();
    let check = |log: &Log| {
        let mut reader = log.reader();
        let r = reader.get_by_key(b"user-7").unwrap().unwrap();
        assert_eq!(r.offset, 2907);
        assert_eq!(r.payload, 2907u64.to_le_bytes());
        assert_eq!(reader.get_by_key(b"batch").unwrap().unwrap().offset, 3002);
        assert!(reader.get_by_key(b"nobody").unwrap().is_none());
    };
    check(&log);
    drop(log);
    check(&Log::open(dir.path(), opts).unwrap());
    let plain = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert!(plain.reader().get_by_key(b"user-7").is_err(), "off unless asked for");
}

#[test]
fn segments_grow_from_the_initial_size_and_reopen_keeps_the_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options {
        segment_bytes: 4 * MIN_SEGMENT_BYTES,
        initial_segment_bytes: Some(MIN_SEGMENT_BYTES),
        ..Options::default()
    };
    let mut log = Log::open(dir.path(), opts.clone()).unwrap();
    for i in 0..4000u64 {
        log.append(&payload(i)).unwrap();
    }
    drop(log);
    let sizes: Vec<u64> = segments(dir.path()).iter().map(|p| fs::metadata(p).unwrap().len()).collect();
    assert!(sizes.len() >= 4, "{sizes:?}");
    assert_eq!(&sizes[..3], &[MIN_SEGMENT_BYTES, 2 * MIN_SEGMENT_BYTES, 4 * MIN_SEGMENT_BYTES]);
    assert!(sizes[3..].iter().all(|&s| s == 4 * MIN_SEGMENT_BYTES), "capped at segment_bytes: {sizes:?}");
    let log = Log::open(dir.path(), opts).unwrap();
    let got = read_all(&mut log.reader());
    assert_eq!(got.len(), 4000);
    assert!(got.iter().enumerate().all(|(i, r)| r.payload == payload(i as u64)));
    let bad = Options { initial_segment_bytes: Some(8 * MIN_SEGMENT_BYTES), ..Options::default() };
    assert!(bad.validate().is_ok(), "below segment_bytes is fine");
    let capped =
        Options { segment_bytes: MIN_SEGMENT_BYTES, initial_segment_bytes: Some(2 * MIN_SEGMENT_BYTES), ..bad };
    assert_eq!(capped.first_segment_bytes(), MIN_SEGMENT_BYTES, "an initial size above segment_bytes is capped");
    let odd = Options { initial_segment_bytes: Some(MIN_SEGMENT_BYTES + 1), ..Options::default() };
    assert!(odd.validate().is_err());
}

/// A new log starts small and grows: two records take a megabyte, not a 256 MiB segment.
#[test]
fn a_new_log_of_two_records_takes_little_disk() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), Options::default()).unwrap();
    log.append(b"hello").unwrap();
    log.append(b"world").unwrap();
    drop(log);
    let on_disk: u64 = segments(dir.path()).iter().map(|p| fs::metadata(p).unwrap().len()).sum();
    assert!(on_disk <= 1 << 20, "{on_disk} bytes");
}

/// Disk blocks (not file lengths) of the files in `dir`.
fn blocks_on_disk(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    segments(dir).iter().map(|p| fs::metadata(p).unwrap().blocks() * 512).sum()
}

/// A full-size segment takes the disk its records take, not its length: the writer reserves
/// blocks ahead of itself as it goes and gives back those past its end on close; a reopened
/// log goes on reserving where it stopped, and every record reads back.
#[test]
fn a_segment_takes_the_disk_its_records_take() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options { segment_bytes: 256 << 20, initial_segment_bytes: None, ..Options::default() };
    let record = |i: u64| format!("record {i:>10} {}", "x".repeat(90)).into_bytes();
    let mut log = Log::open(dir.path(), options.clone()).unwrap();
    for i in 0..400_000 {
        log.append(&record(i)).unwrap();
    }
    let records_take = 400_000 * 120; // 8-byte header, 111 bytes of payload, padded to 8
    let while_open = blocks_on_disk(dir.path());
    assert!(while_open > records_take && while_open < records_take + (64 << 20), "{while_open} bytes");
    drop(log);
    let closed = blocks_on_disk(dir.path());
    let file_len: u64 = segments(dir.path()).iter().map(|p| fs::metadata(p).unwrap().len()).sum();
    assert_eq!(file_len, 256 << 20, "one full-size segment");
    assert!(closed >= records_take && closed < records_take + (1 << 20), "{closed} bytes after close");

    let mut log = Log::open(dir.path(), options).unwrap();
    for i in 400_000..800_000 {
        log.append(&record(i)).unwrap();
    }
    drop(log);
    let closed = blocks_on_disk(dir.path());
    assert!(closed >= 2 * records_take && closed < 2 * records_take + (1 << 20), "{closed} bytes after reopen");
    let log = Log::open(dir.path(), Options::default()).unwrap();
    let mut reader = log.reader();
    for i in (0..800_000).step_by(997) {
        assert_eq!(reader.get(i).unwrap().unwrap().payload, record(i), "record {i}");
    }
    assert_eq!(log.next_offset(), 800_000);
}

/// A log in `dir` (1 MiB segments) holding one record, closed: its options and its segment.
fn closed_log_of_one_record(dir: &Path) -> (Options, std::path::PathBuf) {
    let options = Options { initial_segment_bytes: Some(1 << 20), ..Options::default() };
    let mut log = Log::open(dir, options.clone()).unwrap();
    log.append(b"one record").unwrap();
    drop(log);
    (options, segments(dir).pop().unwrap())
}

/// Reopening a log faults in the pages its records take, and not the empty rest of its segment:
/// recovery's look for bytes after the last record skips the file's hole there (before, it
/// read the page after the records, and the kernel read the whole segment around it: 64 KiB
/// mapped and 128 KiB of page cache for each idle queue a server opened).
#[test]
fn reopening_a_log_maps_only_the_pages_its_records_take() {
    let dir = tempfile::tempdir().unwrap();
    let (options, segment) = closed_log_of_one_record(dir.path());
    let log = Log::open(dir.path(), options).unwrap();
    // The mapping's resident size, from /proc/self/smaps (each mapping's line, then its fields).
    let smaps = fs::read_to_string("/proc/self/smaps").unwrap();
    let name = segment.to_str().unwrap();
    let mut lines = smaps.lines().skip_while(|l| !l.ends_with(name));
    assert!(lines.next().is_some(), "{name} is mapped");
    let rss_kib: u64 = lines
        .find_map(|l| l.strip_prefix("Rss:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap();
    assert!(rss_kib <= 8, "{rss_kib} KiB of a one-record segment mapped");
    assert_eq!(log.reader().get(0).unwrap().unwrap().payload, b"one record");
}

/// Opening and closing a log that is not written to leaves its segment file as it was: no
/// reservation asked for at open (recovery saw the writer's page on disk) and nothing punched out
/// at close (the file holds no blocks past its records). Each would change the file's times, a
/// metadata write for every idle queue at every start and stop of a server.
#[test]
fn an_idle_log_opened_and_closed_leaves_its_segment_as_it_was() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let (options, segment) = closed_log_of_one_record(dir.path());
    let times = |m: &fs::Metadata| (m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec());
    let before = fs::metadata(&segment).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    for _ in 0..2 {
        let log = Log::open(dir.path(), options.clone()).unwrap();
        assert_eq!(log.next_offset(), 1);
        drop(log);
    }
    let after = fs::metadata(&segment).unwrap();
    assert_eq!(times(&after), times(&before), "the segment's times");
    assert_eq!(after.blocks(), before.blocks(), "the segment's blocks");
    // And a log that appends after a reopen still reserves, and gives back, as it goes.
    let mut log = Log::open(dir.path(), options).unwrap();
    for _ in 0..2000 {
        log.append(&[7u8; 100]).unwrap();
    }
    drop(log);
    let blocks = fs::metadata(&segment).unwrap().blocks() * 512;
    assert!((2000 * 112..2000 * 112 + (64 << 10)).contains(&blocks), "{blocks} bytes of blocks");
}

/// A segment sealed early, because the next record did not fit in what was left, gives back the
/// blocks its writer had reserved past its last frame.
#[test]
fn a_segment_sealed_early_gives_back_what_it_did_not_use() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options {
        segment_bytes: 64 << 20,
        initial_segment_bytes: None,
        max_record_bytes: 80 << 20,
        ..Options::default()
    };
    let mut log = Log::open(dir.path(), options).unwrap();
    // 3 MB of records: the writer has reserved blocks some 48 MiB ahead of them.
    for i in 0..3000u32 {
        log.append(&[i as u8; 1000]).unwrap();
    }
    let large = vec![7u8; 70 << 20];
    log.append(&large).unwrap();
    let first = segments(dir.path())[0].clone();
    use std::os::unix::fs::MetadataExt;
    let blocks = fs::metadata(&first).unwrap().blocks() * 512;
    assert!(blocks < 4 << 20, "the first segment holds 3 MB of records and {blocks} bytes of disk");
    drop(log);
    let log = Log::open(dir.path(), Options::default()).unwrap();
    let mut reader = log.reader();
    assert_eq!(reader.get(2999).unwrap().unwrap().payload, &[(2999 % 256) as u8; 1000][..]);
    assert_eq!(reader.get(3000).unwrap().unwrap().payload, &large[..]);
}

/// Many writing logs share one prefault thread: a process with a thousand queue logs must not
/// hold a thousand threads (each used to start its own at its first segment roll).
#[test]
fn many_writing_logs_share_one_prefault_thread() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options { segment_bytes: MIN_SEGMENT_BYTES, ..Options::default() };
    let mut logs: Vec<Log> =
        (0..64).map(|i| Log::open(dir.path().join(format!("log-{i}")), opts.clone()).unwrap()).collect();
    for log in &mut logs {
        for i in 0..(2 * MIN_SEGMENT_BYTES / 256) {
            log.append(&[i as u8; 240]).unwrap();
        }
        assert!(segments(log.dir()).len() >= 2, "each log rolled at least once");
    }
    let prefault_threads = fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let comm = fs::read_to_string(t.as_ref().unwrap().path().join("comm")).unwrap_or_default();
            comm.starts_with("petrel-log-pref")
        })
        .count();
    assert!(prefault_threads <= 1, "{prefault_threads} prefault threads for 64 logs");
    drop(logs);
}

#[test]
fn timestamps_shared_by_frames_read_back_by_every_path() {
    // Runs of records with one timestamp: the first frame of a run stores it, and the others
    // take it from the frame before.
    let dir = tempfile::tempdir().unwrap();
    let time = |i: u64| 1_700_000_000_000_000_000 + (i / 40) * 1000;
    let opts = || Options { segment_bytes: MIN_SEGMENT_BYTES, initial_segment_bytes: None, ..small(Durability::None) };
    let mut log = Log::open(dir.path(), opts()).unwrap();
    let n = 20_000;
    for i in 0..n {
        let payload = (i as u32).to_le_bytes();
        log.append_with(&Input { timestamp: Some(time(i)), ..Input::payload(&payload) }).unwrap();
    }
    assert!(segments(dir.path()).len() > 2, "sealed segments too");
    let starts = frame_starts(&segments(dir.path())[0]);
    // A 4-byte payload: 16 bytes without a timestamp, 24 with one (the first frame of a run of
    // 40, and the segment's first).
    let sizes: Vec<u64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    let with_time = sizes.iter().filter(|&&s| s == 24).count();
    assert_eq!(with_time + sizes.iter().filter(|&&s| s == 16).count(), sizes.len());
    let runs = (0..sizes.len() as u64).filter(|&i| i == 0 || time(i) != time(i - 1)).count();
    assert_eq!(with_time, runs, "{with_time} of {}", sizes.len());
    for reopened in [false, true] {
        if reopened {
            drop(log);
            log = Log::open(dir.path(), opts()).unwrap();
        }
        let all = read_all(&mut log.reader());
        assert!(all.iter().all(|r| r.timestamp == time(r.offset)), "reopened: {reopened}");
        let mut reader = log.reader();
        for i in (0..n).step_by(7).chain([n - 1, 0, 39, 40, 41]) {
            assert_eq!(reader.get(i).unwrap().unwrap().timestamp, time(i), "get {i}");
        }
        let offsets: Vec<u64> = (0..n).rev().step_by(3).collect();
        let mut got = 0;
        reader
            .get_many(&offsets, |k, r| {
                assert_eq!(r.timestamp, time(offsets[k]), "get_many {}", offsets[k]);
                got += 1;
            })
            .unwrap();
        assert_eq!(got, offsets.len());
        for i in (0..n).step_by(40) {
            assert_eq!(reader.offset_at_time(time(i)).unwrap(), i);
            assert_eq!(reader.offset_at_time(time(i) + 1).unwrap(), (i + 40).min(n));
        }
        reader.seek(1234);
        assert_eq!(reader.read_batch(3).unwrap().into_iter().map(|r| r.timestamp).collect::<Vec<_>>(), [time(1234); 3]);
    }
    // Appends after a reopen go on taking the time of the frame before only within the run.
    assert_eq!(log.append_with(&Input { timestamp: Some(time(n - 1)), ..Input::payload(b"x") }).unwrap(), n);
    assert_eq!(log.reader().get(n).unwrap().unwrap().timestamp, time(n - 1));
}

#[test]
fn a_time_lookup_finds_the_same_record_with_and_without_the_dense_index() {
    // Times in runs of uneven length: the lookup walks frame headers from a sparse index entry
    // in a segment whose dense index is not built, and searches the dense index where it is.
    let dir = tempfile::tempdir().unwrap();
    let opts = || Options { segment_bytes: MIN_SEGMENT_BYTES, initial_segment_bytes: None, ..small(Durability::None) };
    let time = |i: u64| 1_700_000_000_000_000_000 + (i / 7 + i / 13) * 1000;
    let mut log = Log::open(dir.path(), opts()).unwrap();
    let n = 6_000u64;
    for i in 0..n {
        log.append_with(&Input { timestamp: Some(time(i)), ..Input::payload(&[i as u8; 20]) }).unwrap();
    }
    assert!(segments(dir.path()).len() > 2);
    drop(log);
    let expected = |t: u64| (0..n).find(|&i| time(i) >= t).unwrap_or(n);
    let probes: Vec<u64> =
        (0..n).step_by(5).flat_map(|i| [time(i) - 1, time(i), time(i) + 1]).chain([0, u64::MAX]).collect();
    let log = Log::open(dir.path(), opts()).unwrap();
    let mut reader = log.reader();
    for &t in &probes {
        assert_eq!(reader.offset_at_time(t).unwrap(), expected(t), "walked, t {t}");
    }
    // A read by offset in each segment builds its dense index.
    for i in (0..n).step_by(500) {
        reader.get(i).unwrap().unwrap();
    }
    for &t in &probes {
        assert_eq!(reader.offset_at_time(t).unwrap(), expected(t), "searched, t {t}");
    }
}

#[test]
fn records_stamped_by_the_clock_share_a_stored_time_within_its_resolution() {
    // A busy writer's records less than 100 µs after the time the frames before them take are
    // stamped with that time, and their frames leave it out: a 32-byte record takes 40 bytes.
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let n = 1000;
    let before = now();
    for i in 0..n {
        log.append(&[i as u8; 32]).unwrap();
    }
    let after = now();
    let times: Vec<u64> = read_all(&mut log.reader()).iter().map(|r| r.timestamp).collect();
    assert_eq!(times.len(), n);
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "times in order");
    assert!(times[0] >= before && times[n - 1] <= after, "{before} <= {times:?} <= {after}");
    let starts = frame_starts(&segments(dir.path())[0]);
    let sizes: Vec<u64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    let stored = sizes.iter().filter(|&&s| s == 48).count();
    assert_eq!(stored + sizes.iter().filter(|&&s| s == 40).count(), n, "{sizes:?}");
    // A frame holds each distinct time once, and distinct times are 100 µs apart at least.
    let mut distinct = times.clone();
    distinct.dedup();
    assert_eq!(stored, distinct.len());
    assert!(distinct.windows(2).all(|w| w[1] - w[0] >= 100_000), "{distinct:?}");
    assert!(stored as u64 <= 1 + (after - before) / 100_000, "{stored} times stored in {} ns", after - before);
    // A caller's own time is stored as it is, however close to the one before.
    let given = times[n - 1] + 1;
    log.append_with(&Input { timestamp: Some(given), ..Input::payload(b"x") }).unwrap();
    assert_eq!(log.reader().get(n as u64).unwrap().unwrap().timestamp, given);
}

#[test]
fn a_reader_seeking_past_a_failed_batch_finds_the_records_written_later() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    for i in 0..10u64 {
        log.append(&payload(i)).unwrap();
    }
    // A reader inside the active segment, entered while it had no successor.
    let mut reader = log.reader();
    assert_eq!(reader.read_next().unwrap().unwrap().offset, 0);
    // A batch that overflows the segment, whose roll cannot make the next segment (a
    // directory in the way of every file it could create).
    let blockers: Vec<_> = (10..2200u64).map(|base| dir.path().join(format!("{base:020}.log.tmp"))).collect();
    for b in &blockers {
        fs::create_dir(b).unwrap();
    }
    let many = vec![[7u8; 24]; 2100]; // 32 bytes a frame: more than the segment's 64 KiB
    assert!(log.append_batch(&many).is_err());
    assert_eq!(log.next_offset(), 10, "a failed batch appends nothing");
    for b in &blockers {
        fs::remove_dir(b).unwrap();
    }
    // Records 10.. now live in a new segment, after one too large for the old one's room.
    log.append(&vec![1u8; 60 << 10]).unwrap();
    for i in 11..100u64 {
        log.append(&payload(i)).unwrap();
    }
    assert!(segments(dir.path()).len() >= 2);
    for offset in [12, 50, 99, 11, 10] {
        reader.seek(offset);
        let record = reader.read_next().unwrap().unwrap();
        assert_eq!(record.offset, offset);
        assert_eq!(record.payload, if offset == 10 { vec![1u8; 60 << 10] } else { payload(offset) });
    }
}

#[test]
fn a_first_record_larger_than_the_first_segment_reaches_readers_already_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options::default();
    let mut log = Log::open(dir.path(), options.clone()).unwrap();
    let mut reader = log.reader();
    assert!(reader.read_next().unwrap().is_none(), "an empty log");
    let big = vec![3u8; 2 << 20];
    log.append(&big).unwrap();
    log.append(b"after").unwrap();
    let first = reader.read_next().unwrap().expect("the reader sees the first record");
    assert_eq!((first.offset, first.payload.len()), (0, big.len()));
    assert_eq!(reader.read_next().unwrap().unwrap().payload, b"after");
    assert_eq!(segments(dir.path()).len(), 1, "the empty first segment was replaced");
    let on_disk = std::fs::metadata(&segments(dir.path())[0]).unwrap().len();
    assert_eq!(options.page_budget.counted_bytes(), on_disk, "the page budget counts only the segment there is");
    drop(reader);
    drop(log);
    let log = Log::open(dir.path(), Options::default()).unwrap();
    let all = read_all(&mut log.reader());
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].payload, big);
}

#[test]
fn a_segment_is_synced_before_its_successor_exists() {
    // If the next segment's file existed first, a power cut before the sync would leave a
    // sealed segment short of its successor's base: a gap that no reader gets past.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let files_at_syncs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&files_at_syncs);
    let options = Options {
        on_sync: petrel_log::SyncObserver::new(move |_| seen.lock().unwrap().push(segments(&path).len())),
        // Syncs only when a segment is sealed.
        ..small(Durability::Interval(std::time::Duration::from_secs(3600)))
    };
    let mut log = Log::open(dir.path(), options).unwrap();
    for i in 0..2000u64 {
        log.append(&payload(i)).unwrap();
    }
    let files = segments(dir.path()).len();
    assert!(files > 3, "small segments roll");
    let seen = files_at_syncs.lock().unwrap().clone();
    assert_eq!(seen, (1..files).collect::<Vec<_>>(), "segment files when each sealed segment was synced");
}

#[test]
fn a_reader_waiting_in_a_replaced_segment_reads_on_after_its_successors_came() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), Options { segment_bytes: 4 << 20, ..Options::default() }).unwrap();
    let mut reader = log.reader();
    assert!(reader.read_next().unwrap().is_none(), "an empty log");
    // The first record replaces the empty first segment; then the writer rolls twice before
    // the reader looks again.
    log.append(&vec![3u8; 2 << 20]).unwrap();
    for i in 1..3000u64 {
        log.append(&vec![i as u8; 2000]).unwrap();
    }
    assert!(segments(dir.path()).len() >= 2, "rolled");
    let mut expected = 0;
    while let Some(r) = reader.read_next().unwrap() {
        assert_eq!(r.offset, expected);
        expected += 1;
    }
    assert_eq!(expected, 3000);
}

#[test]
fn a_directory_holds_segments_once_a_log_writes_one() {
    let dir = tempfile::tempdir().unwrap();
    assert!(!verify::holds_segments(dir.path()), "empty");
    std::fs::write(dir.path().join("notes.log.txt"), b"x").unwrap();
    assert!(!verify::holds_segments(dir.path()), "not a segment's name");
    let mut log = Log::open(dir.path(), Options::default()).unwrap();
    log.append(b"r").unwrap();
    assert!(verify::holds_segments(dir.path()));
    assert!(!verify::holds_segments(dir.path().join("missing")));
}

#[test]
fn a_log_made_in_a_directory_just_made_is_a_log_and_never_replaces_one() {
    let dir = tempfile::tempdir().unwrap();
    let made = dir.path().join("q");
    fs::create_dir(&made).unwrap();
    fs::write(made.join("queue.json"), b"{}").unwrap(); // the caller's own file beside it
    let mut log = Log::open_made(&made, small(Durability::None)).unwrap();
    log.append_batch(&[b"one".as_slice(), b"two"]).unwrap();
    let mut group = log.group("workers", Default::default()).unwrap();
    let polled: Vec<Vec<u8>> =
        group.poll(10, std::time::Duration::ZERO).unwrap().into_iter().map(|r| r.payload.to_vec()).collect();
    assert_eq!(polled, vec![b"one".to_vec(), b"two".to_vec()]);
    group.ack(0).unwrap();
    drop(group);
    log.close().unwrap();

    // Opened the ordinary way, it is the same log, its group where it was.
    let log = Log::open(&made, small(Durability::None)).unwrap();
    assert_eq!(
        read_all(&mut log.reader()).iter().map(|r| r.payload.clone()).collect::<Vec<_>>(),
        [b"one".to_vec(), b"two".to_vec()]
    );
    assert_eq!(log.groups().iter().map(|g| (g.name.as_str(), g.committed)).collect::<Vec<_>>(), [("workers", 1)]);
    drop(log);

    // Told wrongly that the directory is new, it refuses rather than write over the log.
    let before = fs::read(made.join("00000000000000000000.log")).unwrap();
    assert!(Log::open_made(&made, small(Durability::None)).is_err());
    assert_eq!(fs::read(made.join("00000000000000000000.log")).unwrap(), before);
    let log = Log::open(&made, small(Durability::None)).unwrap();
    assert_eq!(log.next_offset(), 2);
}

/// Under `none`, a sync asked for a record (`make_durable`, `sync`: a message marked durable)
/// syncs the segments sealed since the last one too, and the directory (their successors'
/// names): it synced the active segment alone and called every earlier record durable, so a
/// record in a segment sealed meanwhile was answered durable though never synced.
#[test]
fn a_sync_under_none_covers_the_segments_sealed_since_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let syncs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&syncs);
    let options = Options {
        on_sync: petrel_log::SyncObserver::new(move |_| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }),
        initial_segment_bytes: None,
        ..small(Durability::None)
    };
    let log = Log::open(dir.path(), options).unwrap().into_shared();
    let first = log.append(b"the durable one").unwrap();
    while log.stats().segments < 3 {
        log.append(&[7u8; 1024]).unwrap();
    }
    assert_eq!(syncs.load(std::sync::atomic::Ordering::Relaxed), 0, "none syncs nothing by itself");
    log.make_durable(first).unwrap();
    let after = syncs.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(after, 3, "the two sealed segments and the active one");
    // Once synced, not again.
    let last = log.append(b"another").unwrap();
    log.make_durable(last).unwrap();
    assert_eq!(syncs.load(std::sync::atomic::Ordering::Relaxed), after + 1, "the active segment alone");
}

/// A power loss that kept the pages of later frames and lost earlier ones leaves valid frames
/// past the end recovery finds (it stops at the zeros); they are gone after the open, so that
/// appends do not write between them and a later open does not read them as records.
#[test]
fn frames_a_crash_left_past_the_end_are_gone_after_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let options = || Options {
        segment_bytes: 1 << 20,
        initial_segment_bytes: None,
        durability: Durability::None,
        ..Options::default()
    };
    let mut log = Log::open(dir.path(), options()).unwrap();
    for i in 0..200u64 {
        log.append(&[(i % 250) as u8 + 1; 1000]).unwrap();
    }
    drop(log);
    let files = segments(dir.path());
    assert_eq!(files.len(), 1);
    let path = &files[0];
    let mut bytes = fs::read(path).unwrap();
    let find = |bytes: &[u8], v: u8| bytes.windows(1000).position(|w| w.iter().all(|&b| b == v)).unwrap();
    let (p50, p51) = (find(&bytes, 51), find(&bytes, 52));
    let frame_start = p50 - ((p51 - p50) - 1000);
    // The pages from record 50's frame on, for two pages more, never reached the disk (the
    // scan takes such a run of zeros for the end; a shorter one, with valid frames after it, is
    // a bad frame before good ones, which stops the open).
    let gap_end = (frame_start / 4096 + 3) * 4096;
    bytes[frame_start..gap_end].fill(0);
    fs::write(path, &bytes).unwrap();
    let mut log = Log::open(dir.path(), options()).unwrap();
    assert_eq!(log.next_offset(), 50, "recovery stops at the zeros");
    // At once, not only at a clean close (which a second crash would not reach).
    let after = fs::read(path).unwrap();
    assert!(after[frame_start..].iter().all(|&b| b == 0), "no byte past the end but zeros");
    for _ in 0..30 {
        log.append(&[7u8; 1000]).unwrap();
    }
    drop(log);
    assert_eq!(Log::open(dir.path(), options()).unwrap().next_offset(), 80, "nothing old comes back");
}

/// A segment that is the active one again (the segments after it lost) has its index file from
/// its seal removed at open: the writer will write over what it describes, and a later seal's
/// file lost with a power loss would leave the old one to be read.
#[test]
fn the_active_segment_keeps_no_index_file_from_an_earlier_seal() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    while log.stats().segments < 2 {
        log.append(&[1; 100]).unwrap();
    }
    let sealed_at = log.stats().next_offset - 1;
    drop(log);
    let index_file = dir.path().join("index").join(format!("{:020}.idx", 0));
    assert!(index_file.exists(), "the seal wrote the first segment's index");
    // The second segment lost (as to a crash before it reached the disk).
    let second = segments(dir.path()).into_iter().max().unwrap();
    std::fs::remove_file(second).unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert!(!index_file.exists(), "the first segment is active again: its old index file is gone");
    assert_eq!(log.next_offset(), sealed_at);
    log.append(b"after").unwrap();
    assert_eq!(log.reader().get(sealed_at).unwrap().unwrap().payload, b"after");
}

/// A log written under `none` (its sealed segments and their names never synced) and opened
/// again under `always`: the open's sync covers those segments, not only the active one, before
/// any append is acknowledged as durable.
#[test]
fn reopening_under_a_syncing_policy_syncs_what_the_last_session_left_unsynced() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), Options { segment_bytes: MIN_SEGMENT_BYTES, ..Options::default() }).unwrap();
    let payload = vec![7u8; 4096];
    while log.stats().segments < 3 {
        log.append(&payload).unwrap();
    }
    drop(log);
    let syncs = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&syncs);
    let on_sync = petrel_log::SyncObserver::new(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
    });
    let options =
        Options { segment_bytes: MIN_SEGMENT_BYTES, durability: Durability::Always, on_sync, ..Options::default() };
    let log = Log::open(dir.path(), options).unwrap();
    let sealed = log.stats().segments as u64 - 1;
    assert!(
        syncs.load(Ordering::Relaxed) > sealed,
        "{} syncs for {sealed} sealed segments and the active one",
        syncs.load(Ordering::Relaxed)
    );
}

/// A segment missing in the middle (its records gone): verify names the gap; repair deletes the
/// segments after it, which cannot follow the ones before, and the log then reads and appends on
/// from the end of those. (It kept the first of them empty under its name: the gap stayed, no
/// record could be read past it, and the next append took that segment's base.)
#[test]
fn a_gap_between_segments_is_repaired_by_ending_the_log_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    for i in 0..2000u64 {
        log.append(&payload(i)).unwrap();
    }
    drop(log);
    let segs = segments(dir.path());
    assert!(segs.len() >= 4, "{segs:?}");
    fs::remove_file(&segs[1]).unwrap();
    let report = verify::verify(dir.path(), |_, _| {}).unwrap();
    let gap = report.problems.iter().find(|p| p.kind == ProblemKind::Corrupt).expect("the gap is reported");
    assert_eq!(gap.file, segs[2], "{gap:?}");
    let base = |p: &Path| p.file_name().unwrap().to_string_lossy().split('.').next().unwrap().parse::<u64>().unwrap();
    let end = base(&segs[1]);
    let repaired = verify::repair(dir.path()).unwrap();
    assert_eq!(repaired.next_offset, end);
    assert_eq!(repaired.segments_removed, segs.len() - 2);
    assert!(verify::verify(dir.path(), |_, _| {}).unwrap().problems.is_empty(), "no gap is left");
    let mut log = Log::open(dir.path(), small(Durability::None)).unwrap();
    assert_eq!(log.next_offset(), end);
    assert_eq!(log.append(b"after").unwrap(), end, "appends go on from the end of what stayed");
    let all = read_all(&mut log.reader());
    assert_eq!(all.len() as u64, end + 1);
    assert!(all.iter().take(end as usize).enumerate().all(|(i, r)| r.payload == payload(i as u64)));
}
