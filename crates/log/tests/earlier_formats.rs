//! Logs written by earlier formats are read, recovered, verified and appended to by today's code:
//! format 1 (`tests/fixtures/v1-log`, made by the writer of commit 70a0f89: 1,500 records over
//! four 64 KiB segments, some with keys and headers, and a group "g" that acknowledged the first
//! 100), format 2 (`tests/fixtures/v2-log`, the same records and group made by the writer of
//! commit 94eb0b8, over three segments), format 3 (`tests/fixtures/v3-log`, the same made by
//! the writer of commit 1cfb774) and format 4 (`tests/fixtures/v4-log`, the same made by the
//! writer of commit 657f772).

mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::{read_all, segments};
use petrel_log::{GroupOptions, Input, Log, MIN_SEGMENT_BYTES, Options, OwnedRecord, verify};

const RECORDS: u64 = 1500;

/// A fixture: the directory of a log written by an earlier format, and that format's version.
#[derive(Clone, Copy)]
struct Earlier {
    dir: &'static str,
    version: u32,
}

const V1: Earlier = Earlier { dir: "v1-log", version: 1 };
const V2: Earlier = Earlier { dir: "v2-log", version: 2 };
const V3: Earlier = Earlier { dir: "v3-log", version: 3 };
const V4: Earlier = Earlier { dir: "v4-log", version: 4 };
/// What today's writer writes.
const CURRENT_VERSION: u32 = 5;

/// Each test runs on each fixture.
macro_rules! on_each_fixture {
    ($($test:ident),* $(,)?) => {
        mod format_one { $(#[test] fn $test() { super::$test(super::V1) })* }
        mod format_two { $(#[test] fn $test() { super::$test(super::V2) })* }
        mod format_three { $(#[test] fn $test() { super::$test(super::V3) })* }
        mod format_four { $(#[test] fn $test() { super::$test(super::V4) })* }
    };
}

on_each_fixture!(
    reads_and_verifies_record_for_record,
    appends_after_its_segment_go_to_a_new_segment_of_the_current_format,
    a_torn_tail_is_cut_as_before,
    a_last_segment_with_a_damaged_header_is_judged_by_its_frames,
    an_empty_last_segment_takes_the_current_format_in_place,
);

fn fixture(earlier: Earlier) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(earlier.dir);
    for sub in ["", "groups", "index"] {
        fs::create_dir_all(dir.path().join(sub)).unwrap();
        for e in fs::read_dir(from.join(sub)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                fs::copy(e.path(), dir.path().join(sub).join(e.file_name())).unwrap();
            }
        }
    }
    dir
}

fn options() -> Options {
    Options { segment_bytes: MIN_SEGMENT_BYTES, initial_segment_bytes: None, key_index: true, ..Options::default() }
}

/// What the fixture's writer appended as record `i`.
fn expected(i: u64) -> OwnedRecord {
    OwnedRecord {
        offset: i,
        timestamp: 1_700_000_000_000_000_000 + i * 1000,
        key: i.is_multiple_of(3).then(|| format!("k{}", i % 10).into_bytes()),
        headers: if i.is_multiple_of(5) { vec![("h".to_owned(), i.to_le_bytes().to_vec())] } else { vec![] },
        payload: (0..(i * 37 % 200)).map(|j| (i * 31 + j) as u8).collect(),
    }
}

fn format_version(segment: &Path) -> u32 {
    u32::from_le_bytes(fs::read(segment).unwrap()[8..12].try_into().unwrap())
}

fn reads_and_verifies_record_for_record(earlier: Earlier) {
    let dir = fixture(earlier);
    let report = verify::verify(dir.path(), |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!((report.records, report.next_offset), (RECORDS, RECORDS));
    let all = read_all(&mut verify::open_read_only(dir.path()).unwrap());
    assert_eq!(all, (0..RECORDS).map(expected).collect::<Vec<_>>());

    let log = Log::open(dir.path(), options()).unwrap();
    assert_eq!(log.next_offset(), RECORDS);
    let mut reader = log.reader();
    assert_eq!(reader.get(777).unwrap().unwrap().to_owned(), expected(777));
    let mut got = Vec::new();
    reader.get_many(&[1499, 3, 940], |_, r| got.push(r.to_owned())).unwrap();
    assert_eq!(got, [expected(1499), expected(3), expected(940)]);
    assert_eq!(reader.get_by_key(b"k3").unwrap().unwrap().offset, 1473);
    assert_eq!(reader.offset_at_time(1_700_000_000_000_000_000 + 1000 * 1000 - 1).unwrap(), 1000);
    let mut group = log.group("g", GroupOptions::default()).unwrap();
    assert_eq!(group.committed(), 100);
    let batch = group.poll(10, Duration::ZERO).unwrap();
    assert_eq!(batch.into_iter().map(|r| r.offset).collect::<Vec<_>>(), (100..110).collect::<Vec<_>>());
}

fn appends_after_its_segment_go_to_a_new_segment_of_the_current_format(earlier: Earlier) {
    let dir = fixture(earlier);
    let before = segments(dir.path());
    let mut log = Log::open(dir.path(), options()).unwrap();
    for i in RECORDS..RECORDS + 10 {
        let e = expected(i);
        let headers: Vec<(&str, &[u8])> = e.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
        let input =
            Input { key: e.key.as_deref(), headers: &headers, payload: &e.payload, timestamp: Some(e.timestamp) };
        assert_eq!(log.append_with(&input).unwrap(), i);
    }
    drop(log);
    let after = segments(dir.path());
    assert_eq!(after.len(), before.len() + 1);
    assert!(before.iter().all(|s| format_version(s) == earlier.version));
    assert_eq!(format_version(after.last().unwrap()), CURRENT_VERSION);

    let report = verify::verify(dir.path(), |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let log = Log::open(dir.path(), options()).unwrap();
    assert_eq!(log.next_offset(), RECORDS + 10);
    assert_eq!(read_all(&mut log.reader()), (0..RECORDS + 10).map(expected).collect::<Vec<_>>());
    assert_eq!(log.reader().get_by_key(b"k3").unwrap().unwrap().offset, 1503);
}

fn a_torn_tail_is_cut_as_before(earlier: Earlier) {
    let dir = fixture(earlier);
    let last = segments(dir.path()).pop().unwrap();
    let mut bytes = fs::read(&last).unwrap();
    // The last record's frame ends where the zeros begin; tear its last 8 bytes.
    let end = bytes.iter().rposition(|&b| b != 0).unwrap() + 1;
    bytes[end - 8..end].fill(0);
    fs::write(&last, bytes).unwrap();
    let log = Log::open(dir.path(), options()).unwrap();
    assert_eq!(log.next_offset(), RECORDS - 1);
    assert!(log.recovery_report().torn_at.is_some());
    assert_eq!(read_all(&mut log.reader()), (0..RECORDS - 1).map(expected).collect::<Vec<_>>());
}

fn a_last_segment_with_a_damaged_header_is_judged_by_its_frames(earlier: Earlier) {
    let dir = fixture(earlier);
    let last = segments(dir.path()).pop().unwrap();
    let mut bytes = fs::read(&last).unwrap();
    bytes[9] ^= 0xff; // the format version: the header's CRC no longer matches
    fs::write(&last, &bytes).unwrap();
    let log = Log::open(dir.path(), options()).unwrap();
    assert_eq!(log.next_offset(), RECORDS);
    assert_eq!(read_all(&mut log.reader()), (0..RECORDS).map(expected).collect::<Vec<_>>());
    drop(log);

    // The first frame's magic (format 1; formats 2 and 3: its CRC) damaged too: the damage is
    // corruption before valid records, not a torn tail to cut. (A format-2 segment is then
    // judged of the current format, whose frames its frames also are: still valid frames after
    // a bad one.)
    let dir = fixture(earlier);
    let last = segments(dir.path()).pop().unwrap();
    let mut bytes = fs::read(&last).unwrap();
    bytes[9] ^= 0xff;
    bytes[64] ^= 0xff;
    fs::write(&last, &bytes).unwrap();
    let err = Log::open(dir.path(), options()).err().expect("must not open");
    let petrel_log::Error::Corrupt { position: 64, before_tail: true, .. } = &err else { panic!("{err}") };
    assert!(fs::read(&last).unwrap() == bytes, "the segment was changed");
    let report = verify::verify(dir.path(), |_, _| {}).unwrap();
    if earlier.version == 1 {
        // Format-1 frames say their offsets: verify reads on after the damage.
        assert_eq!(report.records, RECORDS - 1, "{:?}", report.problems);
    } else {
        assert!(report.problems.iter().any(|p| p.position == 64), "{:?}", report.problems);
    }
}

fn an_empty_last_segment_takes_the_current_format_in_place(earlier: Earlier) {
    let dir = fixture(earlier);
    let last = segments(dir.path()).pop().unwrap();
    let base: u64 = last.file_stem().unwrap().to_str().unwrap().parse().unwrap();
    // The last segment as it was when it was made: its header, then nothing.
    let mut bytes = fs::read(&last).unwrap();
    bytes[64..].fill(0);
    fs::write(&last, bytes).unwrap();
    let mut log = Log::open(dir.path(), options()).unwrap();
    assert_eq!(log.next_offset(), base);
    assert_eq!(log.append(b"first of the current format").unwrap(), base);
    drop(log);
    assert_eq!(segments(dir.path()).last(), Some(&last));
    assert_eq!(format_version(&last), CURRENT_VERSION);
    let log = Log::open(dir.path(), options()).unwrap();
    let all = read_all(&mut log.reader());
    assert_eq!(all.len() as u64, base + 1);
    assert_eq!(all[..base as usize], (0..base).map(expected).collect::<Vec<_>>()[..]);
    assert_eq!(all[base as usize].payload, b"first of the current format");
}
