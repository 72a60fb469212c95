//! A batch survives a crash whole or not at all. A child process (this test binary, run again
//! in the role of `child_appends_batches_until_killed`) appends batches of known shape back to
//! back and prints each one's number once `append_batch` returned; the test kills it with SIGKILL
//! at random moments. After each kill the log must hold whole batches only, in order, byte for
//! byte, every acknowledged batch among them; and appending goes on after it.
//!
//! `PETREL_CRASH_ITERATIONS` sets the number of kills (default 24).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use petrel_log::{Durability, Log, Options};

/// Set in the child's environment: the log's directory.
const CHILD_DIR: &str = "PETREL_BATCH_CHILD_DIR";
/// Set in the child's environment: the number of its first batch.
const CHILD_FIRST: &str = "PETREL_BATCH_CHILD_FIRST";
/// Kills on one log before the test starts another.
const KILLS_PER_LOG: usize = 3;

fn options() -> Options {
    // Small segments, so that batches often start a new one (a batch never straddles two).
    Options { segment_bytes: 1 << 20, durability: Durability::None, ..Options::default() }
}

/// A small deterministic generator (the test needs no randomness of quality).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// How many records batch `k` has: 1 to 200.
fn batch_len(k: u64) -> u64 {
    let mut x = k.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    1 + next(&mut x) % 200
}

/// Record `i` of batch `k`: says where it belongs, then 0 to 1,000 bytes made from both.
fn record(k: u64, i: u64) -> Vec<u8> {
    let mut r = format!("{k}:{i}/{}:", batch_len(k)).into_bytes();
    let mut x = (k << 16 | i).wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let filler = next(&mut x) % 1001;
    r.extend((0..filler).map(|_| next(&mut x) as u8));
    r
}

#[test]
#[ignore = "the child process of a_batch_survives_kill_9_whole_or_not_at_all, run by it"]
fn child_appends_batches_until_killed() {
    let dir = std::env::var(CHILD_DIR).expect("run by a_batch_survives_kill_9_whole_or_not_at_all");
    let first: u64 = std::env::var(CHILD_FIRST).unwrap().parse().unwrap();
    let mut log = Log::open(dir, options()).unwrap();
    let mut out = std::io::stdout().lock();
    for k in first.. {
        let records: Vec<Vec<u8>> = (0..batch_len(k)).map(|i| record(k, i)).collect();
        log.append_batch(&records).unwrap();
        writeln!(out, "{k}").unwrap();
        out.flush().unwrap();
    }
}

/// Runs a child appending from batch `first` into `dir`, kills it `kill_after` after its first
/// batch; returns the batches it said it appended.
fn run_and_kill(dir: &Path, first: u64, kill_after: Duration) -> Vec<u64> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_appends_batches_until_killed", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR, dir)
        .env(CHILD_FIRST, first.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        // The harness's own lines ("running 1 test") are not numbers.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(k) = line.trim().parse::<u64>() {
                let _ = tx.send(k);
            }
        }
    });
    let first_ack = rx.recv_timeout(Duration::from_secs(60)).expect("the child appends");
    std::thread::sleep(kill_after);
    child.kill().unwrap();
    child.wait().unwrap();
    reader.join().unwrap();
    std::iter::once(first_ack).chain(rx.try_iter()).collect()
}

/// Checks that `dir`'s log holds batches `0..` whole and in order, each record byte for byte,
/// ending with a whole batch; returns the number of the next batch.
fn check_whole_batches(log: &Log) -> u64 {
    let mut reader = log.reader();
    let (mut k, mut i) = (0, 0);
    while let Some(r) = reader.read_next().unwrap() {
        assert!(r.payload == record(k, i), "record {}: expected record {i} of batch {k}", r.offset);
        i += 1;
        if i == batch_len(k) {
            (k, i) = (k + 1, 0);
        }
    }
    assert_eq!(i, 0, "the log ends inside batch {k}: {i} of its {} records are there", batch_len(k));
    k
}

#[test]
fn a_batch_survives_kill_9_whole_or_not_at_all() {
    let kills: usize = std::env::var("PETREL_CRASH_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(24);
    // The kills' moments differ from run to run.
    let mut x = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().subsec_nanos() as u64 | 1;
    let (mut cut, mut acknowledged) = (0, 0);
    for round in 0..kills.div_ceil(KILLS_PER_LOG) {
        let dir = tempfile::tempdir().unwrap();
        let mut next_batch = 0;
        for _ in 0..KILLS_PER_LOG {
            let kill_after = Duration::from_millis(next(&mut x) % 30);
            let acked = run_and_kill(dir.path(), next_batch, kill_after);
            let log = Log::open(dir.path(), options()).unwrap();
            cut += log.recovery_report().torn_at.is_some() as usize;
            let end = check_whole_batches(&log);
            let last_acked = *acked.last().unwrap();
            assert!(end > last_acked, "round {round}: batch {last_acked} was acknowledged, the log ends before it");
            acknowledged += acked.len();
            next_batch = end;
        }
        // Appends go on after the last kill's cut, and read back.
        let mut log = Log::open(dir.path(), options()).unwrap();
        let records: Vec<Vec<u8>> = (0..batch_len(next_batch)).map(|i| record(next_batch, i)).collect();
        log.append_batch(&records).unwrap();
        drop(log);
        assert_eq!(check_whole_batches(&Log::open(dir.path(), options()).unwrap()), next_batch + 1);
    }
    eprintln!("{kills} kills, {acknowledged} batches acknowledged, {cut} unfinished batches or frames cut");
}
