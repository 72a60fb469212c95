//! Crash safety, by killing real processes: `petrel log append` is killed with SIGKILL at random
//! moments while it appends, and every record it acknowledged must be there afterwards, byte for
//! byte, with dense offsets and appending resuming where it stopped.
//!
//! `PETREL_CRASH_ITERATIONS` sets the number of kills per test (default 30).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use petrel_log::{Log, Options};
use rand::RngExt;

fn petrel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_petrel"))
}

/// Opens the log, waiting out `Locked`: another test thread may be between fork and exec of a
/// child that briefly holds a copy of our lock's file descriptor.
fn open(dir: &Path, options: Options) -> Log {
    for _ in 0..100 {
        match Log::open(dir, options.clone()) {
            Err(petrel_log::Error::Locked { .. }) => std::thread::sleep(Duration::from_millis(10)),
            other => return other.unwrap(),
        }
    }
    panic!("{} stayed locked", dir.display());
}

fn iterations() -> usize {
    std::env::var("PETREL_CRASH_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(30)
}

/// What a child is sent as record `n` of iteration `iter` (a line: no newline in it).
type LineFn = fn(usize, usize, &mut rand::rngs::ThreadRng) -> Vec<u8>;

/// A line for record `n` of iteration `iter`: printable, no newline, length from 1 byte to 20 KB
/// so that frames span pages and segments roll often.
fn line(iter: usize, n: usize, rng: &mut rand::rngs::ThreadRng) -> Vec<u8> {
    let len = if rng.random_range(0..10) == 0 { rng.random_range(1000..20_000) } else { rng.random_range(1..200) };
    let mut l = format!("{iter}:{n}:").into_bytes();
    l.extend((0..len).map(|_| rng.random_range(b' '..=b'~')));
    l
}

/// A line of 1 to 8 MiB of random bytes (no `\n` or `\r`): a large binary record, whose frame is
/// written payload first and header last. Cut from a pool made once, so that the test feeds the
/// child faster than it appends.
fn large_binary_line(iter: usize, n: usize, rng: &mut rand::rngs::ThreadRng) -> Vec<u8> {
    static POOL: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let pool = POOL.get_or_init(|| {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut pool: Vec<u8> = (0..2 << 20)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()
            })
            .collect();
        // (No line end either: `log append` takes `\n` and `\r\n` as one, so a line whose last
        // byte was `\r` was stored without it, and this test failed once in a few dozen runs.)
        pool.iter_mut().filter(|b| **b == b'\n' || **b == b'\r').for_each(|b| *b = b'.');
        pool
    });
    let len = rng.random_range(1 << 20..8 << 20);
    let from = rng.random_range(0..pool.len() - len);
    let mut l = format!("{iter}:{n}:").into_bytes();
    l.extend_from_slice(&pool[from..from + len]);
    l
}

/// One append child of a crash test.
struct Child<'a> {
    dir: &'a Path,
    durability: &'a str,
    segment_bytes: u64,
    line: LineFn,
}

/// Runs one append child, kills it after `kill_after`, returns the lines it was sent (in order)
/// and the offsets it acknowledged.
fn run_and_kill(child: &Child<'_>, iter: usize, kill_after: Duration) -> (Vec<Vec<u8>>, Vec<u64>) {
    let line = child.line;
    let mut child = petrel()
        .args(["log", "append"])
        .arg(child.dir)
        .args(["--durability", child.durability, "--segment-bytes", &child.segment_bytes.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start petrel log append");
    let stdout = child.stdout.take().unwrap();
    let (acked_tx, acked_rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            acked_tx.send(l.parse::<u64>().expect("offsets on stdout")).unwrap();
        }
    });
    let mut stdin = child.stdin.take().unwrap();
    let (sent_tx, sent_rx) = mpsc::channel();
    let writer = std::thread::spawn(move || {
        let mut rng = rand::rng();
        for n in 0.. {
            let l = line(iter, n, &mut rng);
            let mut framed = l.clone();
            framed.push(b'\n');
            // Recorded before writing: a line may be appended even if the write then fails.
            sent_tx.send(l).unwrap();
            if stdin.write_all(&framed).is_err() {
                break;
            }
            if n % 16 == 0 {
                let _ = stdin.flush();
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    });
    // The random moment counts from the first acknowledgement, so a slow start on a loaded
    // machine does not turn the kill into one before anything happened.
    let first = acked_rx.recv_timeout(Duration::from_secs(30)).ok();
    std::thread::sleep(kill_after);
    child.kill().expect("SIGKILL");
    child.wait().unwrap();
    reader.join().unwrap();
    writer.join().unwrap();
    (sent_rx.try_iter().collect(), first.into_iter().chain(acked_rx.try_iter()).collect())
}

/// Kills appending children again and again; checks after each kill that every acknowledged
/// record is there, byte for byte. Returns how many acknowledged records recovery had to find by
/// scanning past the last durable checkpoint (summed over the kills).
fn crash_loop(durability: &str) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::rng();
    let mut total_acked = 0;
    let mut acked_found_by_scanning = 0;
    let mut torn = 0;
    let mut unacked_survivors = 0;
    for iter in 0..iterations() {
        let start = if iter == 0 { 0 } else { open(dir.path(), Options::default()).next_offset() };
        let kill_after = Duration::from_millis(rng.random_range(0..40));
        let child = Child { dir: dir.path(), durability, segment_bytes: 65536, line };
        let (sent, acked) = run_and_kill(&child, iter, kill_after);
        let log = open(dir.path(), Options::default());
        let report = log.recovery_report();
        torn += report.torn_at.is_some() as usize;
        let end = log.next_offset();
        let unacked = end.saturating_sub(start + acked.len() as u64);
        unacked_survivors += unacked;
        if durability == "always" {
            // Each acknowledgement followed a sync that moved the durable checkpoint past it:
            // recovery re-checks only records that were never acknowledged.
            assert!(
                report.records_scanned <= unacked,
                "iteration {iter}: recovery scanned {} records past the checkpoint, but only {unacked} were unacknowledged",
                report.records_scanned
            );
        }
        acked_found_by_scanning += report.records_scanned.saturating_sub(unacked);
        check_acknowledged(&log, iter, start, &sent, &acked);
        total_acked += acked.len();
    }
    eprintln!(
        "{durability}: {} kills, {total_acked} records acknowledged, {unacked_survivors} written but unacknowledged, {torn} torn tails cut",
        iterations()
    );
    assert!(total_acked > iterations(), "the children should have acknowledged records before being killed");
    acked_found_by_scanning
}

/// Checks, after a kill, that the child's acknowledged offsets were dense from `start`, that each
/// acknowledged record is in `log` byte for byte, and that every record up to its end is readable
/// and is a line that was sent.
fn check_acknowledged(log: &Log, iter: usize, start: u64, sent: &[Vec<u8>], acked: &[u64]) {
    for (i, &offset) in acked.iter().enumerate() {
        assert_eq!(offset, start + i as u64, "iteration {iter}: acknowledged offsets are dense");
    }
    let end = log.next_offset();
    assert!(
        end >= start + acked.len() as u64,
        "iteration {iter}: acknowledged records lost ({end} < {})",
        start + acked.len() as u64
    );
    let mut reader = log.reader();
    reader.seek(start);
    let mut offset = start;
    while let Some(record) = reader.read_next().unwrap() {
        assert_eq!(record.offset, offset);
        let expected = &sent[(offset - start) as usize];
        assert!(record.payload == &expected[..], "iteration {iter}: record {offset} differs from the line sent");
        offset += 1;
    }
    assert_eq!(offset, end, "iteration {iter}: every record up to the end is readable");
}

#[test]
fn kill_9_with_durability_always_loses_no_acknowledged_record_and_each_was_checkpointed() {
    // What `always` adds over `none` (surviving a machine crash) cannot be seen by killing a
    // process; what can: every acknowledged record was under a durable checkpoint (asserted
    // after each kill), so none had to be found by scanning.
    assert_eq!(crash_loop("always"), 0);
}

#[test]
fn kill_9_with_durability_none_loses_no_acknowledged_record_kept_only_by_the_page_cache() {
    // The page cache survives the death of the process, and that is all `none` promises: no
    // sync, no checkpoint, so recovery finds the acknowledged records by scanning them.
    let found_by_scanning = crash_loop("none");
    assert!(found_by_scanning > 0, "under `none` acknowledged records lie past the last checkpoint");
}

#[test]
fn kill_9_mid_append_of_large_binary_records_in_a_full_size_segment_cuts_only_the_torn_tail() {
    // A large frame's payload is written before its header, so a kill in the middle leaves
    // megabytes of random bytes with no header. In a 256 MiB segment about one position in 64 of
    // them looks like the start of a frame claiming up to the rest of the segment: recovery
    // must still decide that no valid frame follows and cut them, not refuse to open.
    let mut rng = rand::rng();
    let (mut kills, mut large_tails_cut) = (0, 0);
    while kills < 12 || (large_tails_cut < 2 && kills < 40) {
        let dir = tempfile::tempdir().unwrap();
        // The log starts with a full-size segment (not the small first one a new log gets),
        // which the child appends to.
        let full_size = Options { segment_bytes: 256 << 20, initial_segment_bytes: None, ..Options::default() };
        open(dir.path(), full_size).append(b"first").unwrap();
        let child = Child { dir: dir.path(), durability: "none", segment_bytes: 256 << 20, line: large_binary_line };
        let (sent, acked) = run_and_kill(&child, kills, Duration::from_millis(rng.random_range(0..60)));
        let log = open(dir.path(), Options::default());
        assert_eq!(log.recovery_report().segments, 1, "the child appended to the full-size segment");
        large_tails_cut += (log.recovery_report().torn_bytes_cut >= 64 << 10) as usize;
        check_acknowledged(&log, kills, 1, &sent, &acked);
        kills += 1;
    }
    eprintln!("{kills} kills, {large_tails_cut} torn tails of 64 KiB or more cut");
    assert!(large_tails_cut > 0, "no kill landed in the middle of a large append in {kills} tries");
}

/// Runs `petrel log append` in `script` (bash, with `$PETREL` and `$LOG` set), feeding it
/// `lines` (before line `pause_before`, waiting until every earlier line is acknowledged, so that
/// they are a batch of their own); returns its exit status, stdout offsets and stderr.
fn append_in(script: &str, log: &Path, lines: Vec<Vec<u8>>, pause_before: usize) -> (bool, Vec<u64>, String) {
    let mut child = Command::new("bash")
        .args(["-c", script])
        .env("PETREL", env!("CARGO_BIN_EXE_petrel"))
        .env("LOG", log)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (acked_tx, acked_rx) = std::sync::mpsc::channel::<u64>();
    let reader = std::thread::spawn(move || {
        let mut acked = Vec::new();
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { break };
            acked.push(line.parse().unwrap());
            let _ = acked_tx.send(acked[acked.len() - 1]);
        }
        acked
    });
    let writer = std::thread::spawn(move || {
        for (i, l) in lines.into_iter().enumerate() {
            if i == pause_before {
                let _ = stdin.flush();
                // Until the lines before are acknowledged (or the append ended).
                for _ in 0..pause_before {
                    if acked_rx.recv_timeout(Duration::from_secs(60)).is_err() {
                        break;
                    }
                }
            }
            if stdin.write_all(&l).and_then(|_| stdin.write_all(b"\n")).is_err() {
                break;
            }
        }
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let acked = reader.join().unwrap();
    (out.status.success(), acked, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn check_after_full_disk(log: &Path, ok: bool, acked: &[u64], stderr: &str, payload: impl Fn(u64) -> Vec<u8>) {
    assert!(!ok, "the append must fail");
    assert!(stderr.contains("cannot allocate segment") && stderr.contains("disk full"), "{stderr}");
    assert!(acked.len() > 100, "records before the failure were acknowledged");
    let names: Vec<_> = std::fs::read_dir(log).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(names.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")), "no half-made segment: {names:?}");
    let log = open(log, Options { segment_bytes: 65536, ..Options::default() });
    assert!(log.next_offset() >= acked.len() as u64);
    let mut reader = log.reader();
    for &offset in acked {
        assert_eq!(reader.get(offset).unwrap().unwrap().payload, payload(offset));
    }
}

/// A script for `append_in` that appends with `petrel log append LOG ARGS` on a tmpfs of
/// `size` in a private mount namespace (a real full disk), and copies the log out to `$LOG`
/// before the namespace (and its tmpfs) goes away.
fn append_on_tmpfs(size: &str, args: &str) -> String {
    format!(
        r#"exec unshare -rm bash -c '
        mnt=$(mktemp -d) && mount -t tmpfs -o size={size} tmpfs "$mnt" || exit 99
        "$PETREL" log append "$mnt/log" {args}; rc=$?
        cp -r "$mnt/log" "$LOG"; exit $rc'"#
    )
}

#[test]
fn a_full_disk_is_a_clear_error_and_leaves_a_readable_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let script = append_on_tmpfs("400k", "--segment-bytes 65536");
    let payload = |n: u64| format!("record {n} {}", "x".repeat(100)).into_bytes();
    let (ok, acked, stderr) = append_in(&script, &log, (0..20_000).map(payload).collect(), usize::MAX);
    check_after_full_disk(&log, ok, &acked, &stderr, payload);
}

#[test]
fn a_disk_that_fills_in_the_middle_of_a_segment_is_a_clear_error_too() {
    // A 2.5 MiB tmpfs and the default segment sizes: the log's second segment (2 MiB) is made
    // with its first page reserved (the rest does not fit), and the disk fills while the
    // writer reserves more.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let script = append_on_tmpfs("2560k", "");
    let payload = |n: u64| format!("record {n} {}", "x".repeat(100)).into_bytes();
    let (ok, acked, stderr) = append_in(&script, &log, (0..40_000).map(payload).collect(), usize::MAX);
    let mut segments: Vec<_> = std::fs::read_dir(&log)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    segments.sort();
    let lens: Vec<u64> = segments.iter().map(|p| std::fs::metadata(p).unwrap().len()).collect();
    check_after_full_disk(&log, ok, &acked, &stderr, payload);
    // The second segment got its whole length though the disk had less room than that: it
    // reserved its first page only, not a halved length.
    assert_eq!(lens, [1 << 20, 2 << 20], "segment lengths");
    assert!(acked.len() > 12_000, "the disk filled in the second segment: {} acknowledged", acked.len());
}

#[test]
fn a_file_size_limit_is_a_clear_error_too() {
    // RLIMIT_FSIZE (100 KiB) stops the preallocation of the segment that a 120 KB record needs,
    // with EFBIG; SIGXFSZ is ignored so that is an error return, not a kill.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let script = r#"ulimit -f 100; trap '' XFSZ; exec "$PETREL" log append "$LOG" --segment-bytes 65536"#;
    let payload = |n: u64| {
        if n == 1000 { vec![b'y'; 120_000] } else { format!("small {n}").into_bytes() }
    };
    let (ok, acked, stderr) = append_in(script, &log, (0..2000).map(payload).collect(), 1000);
    check_after_full_disk(&log, ok, &acked, &stderr, payload);
    assert_eq!(acked.len(), 1000, "everything before the big record, nothing after it");
}

/// Runs `petrel log consume` (cursor durability `always`) and kills it after `kill_after`;
/// returns the offsets it printed, in order.
fn consume_and_kill(dir: &Path, kill_after: Duration) -> Vec<u64> {
    let mut child = petrel()
        .args(["log", "consume"])
        .arg(dir)
        .args(["--group", "g", "--cursor-durability", "always", "--json", "--wait", "10s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start petrel log consume");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            let v: serde_json::Value = serde_json::from_str(&l).expect("one JSON record per line");
            tx.send(v["offset"].as_u64().unwrap()).unwrap();
        }
    });
    // Kill at a random moment after it started printing (opening a big log takes a while on a
    // loaded machine, and a kill before the first record tests nothing).
    let first = rx.recv_timeout(Duration::from_secs(30)).ok();
    std::thread::sleep(kill_after);
    child.kill().expect("SIGKILL");
    child.wait().unwrap();
    reader.join().unwrap();
    first.into_iter().chain(rx.try_iter()).collect()
}

#[test]
fn kill_9_while_consuming_redelivers_only_the_unacknowledged() {
    const RECORDS: u64 = 100_000;
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = open(dir.path(), Options::default());
        for i in 0..RECORDS {
            log.append(format!("record {i}").as_bytes()).unwrap();
        }
    }
    let mut rng = rand::rng();
    let mut committed = 0;
    let mut delivered_twice = 0;
    let kills = (iterations() * 2 / 3).max(20);
    for iter in 0..kills {
        let printed = consume_and_kill(dir.path(), Duration::from_millis(rng.random_range(0..40)));
        // Each run starts exactly where the last one's acknowledgements ended: nothing
        // unacknowledged is skipped, nothing acknowledged comes again.
        if let Some(&first) = printed.first() {
            assert_eq!(first, committed, "kill {iter}: the run resumed at the committed offset");
        }
        for (i, &o) in printed.iter().enumerate() {
            assert_eq!(o, committed + i as u64, "kill {iter}: records in order");
        }
        let log = open(dir.path(), Options::default());
        let now = log.groups().into_iter().find(|g| g.name == "g").map_or(0, |g| g.committed);
        if let Some(&last) = printed.last() {
            // Every printed record but the last was durably acknowledged before the next was
            // printed; the last may or may not have been.
            assert!(now == last || now == last + 1, "kill {iter}: committed {now} after printing up to {last}");
            delivered_twice += (now == last) as usize;
        } else {
            assert_eq!(now, committed);
        }
        committed = now;
    }
    eprintln!("{kills} kills: committed {committed} of {RECORDS}, {delivered_twice} records to be delivered again");
    assert!(committed > 0, "the consumers made progress");
}
