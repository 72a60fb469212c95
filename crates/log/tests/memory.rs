//! Bounded memory: reading a log ten times larger than the resident budget keeps the process's
//! file-backed resident memory within the budget plus a small constant. Its own test binary, so
//! no other test's mappings are counted (and its tests run one at a time).

use petrel_log::{Log, Options, PageBudget};

/// A field of /proc/self/status, in bytes.
fn status(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().trim_end_matches("kB").trim().parse().unwrap())
        .unwrap();
    kb * 1024
}

/// The tests measure the whole process: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Resident pages of file mappings.
fn rss_file() -> u64 {
    status("RssFile:")
}

#[test]
fn reading_a_log_ten_times_the_budget_stays_within_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const SEGMENT: u64 = 1 << 20;
    const BUDGET: u64 = 4 << 20;
    let dir = tempfile::tempdir().unwrap();
    let opts = Options { segment_bytes: SEGMENT, page_budget: PageBudget::new(BUDGET), ..Options::default() };
    let baseline = rss_file();
    let mut log = Log::open(dir.path(), opts.clone()).unwrap();
    let payload = vec![7u8; 1000];
    for _ in 0..42_000 {
        log.append(&payload).unwrap();
    }
    let after_write = rss_file().saturating_sub(baseline);
    drop(log);

    let log = Log::open(dir.path(), opts).unwrap();
    assert!(log.stats().segments >= 40, "a log of 40 segments, ten times the budget");
    let mut reader = log.reader();
    let mut peak = 0;
    let mut n = 0u64;
    loop {
        let batch = reader.read_batch(256).unwrap();
        if batch.is_empty() {
            break;
        }
        n += batch.len() as u64;
        for r in batch {
            assert_eq!(r.payload.len(), 1000);
        }
        peak = peak.max(rss_file().saturating_sub(baseline));
    }
    assert_eq!(n, 42_000);
    // Budget, plus the active segment (prefaulted whole), plus slack for the segment being read.
    let limit = BUDGET + 3 * SEGMENT;
    eprintln!("file-backed RSS above baseline: after writing {after_write} B, reading peak {peak} B, limit {limit} B");
    assert!(after_write <= limit, "writing kept {after_write} B resident");
    assert!(peak <= limit, "reading kept {peak} B resident");

    // Random reads all over the log build per-segment position indexes (a 256 KiB chunk each);
    // segments that give their pages back drop those too, so anonymous memory stays bounded.
    drop(reader);
    let anon_before = status("RssAnon:");
    let mut reader = log.reader();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut file_peak = 0;
    for i in 0..2_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let offset = x % 42_000;
        assert_eq!(reader.get(offset).unwrap().unwrap().offset, offset);
        if i % 50 == 0 {
            file_peak = file_peak.max(rss_file().saturating_sub(baseline));
        }
    }
    let anon_growth = status("RssAnon:").saturating_sub(anon_before);
    eprintln!("random reads: file-backed peak {file_peak} B, anonymous growth {anon_growth} B");
    assert!(file_peak <= limit, "random reads kept {file_peak} B resident");
    assert!(anon_growth < 4 << 20, "indexes of released segments must go: grew {anon_growth} B");
}

#[test]
fn logs_sharing_a_page_budget_stay_within_it_together() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const SEGMENT: u64 = 1 << 20;
    const BUDGET: u64 = 8 << 20;
    const LOGS: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let budget = PageBudget::new(BUDGET);
    let opts = Options {
        segment_bytes: SEGMENT,
        initial_segment_bytes: None,
        page_budget: budget.clone(),
        lock_directory: false,
        ..Options::default()
    };
    let baseline = rss_file();
    // 40 logs of 3 segments each (120 MiB mapped) written in turns, all open at once.
    let mut logs: Vec<Log> =
        (0..LOGS).map(|i| Log::open(dir.path().join(format!("q{i}")), opts.clone()).unwrap()).collect();
    let payload = vec![3u8; 4000];
    let mut peak = 0;
    for round in 0..600 {
        for log in &mut logs {
            log.append(&payload).unwrap();
        }
        if round % 20 == 0 {
            peak = peak.max(rss_file().saturating_sub(baseline));
            assert!(budget.counted_bytes() <= BUDGET + SEGMENT, "counted {} B", budget.counted_bytes());
        }
    }
    let mapped: u64 = logs.iter().map(|l| l.stats().segment_bytes).sum();
    assert!(mapped >= 10 * BUDGET, "the logs map {mapped} B, ten times the budget");
    // The budget, plus the segment being used, plus what the prefault thread may fault in again
    // right after a release.
    let limit = BUDGET + 4 * SEGMENT;
    eprintln!(
        "{LOGS} logs, {mapped} B mapped: file-backed RSS peak {peak} B, limit {limit} B, {} releases",
        budget.releases()
    );
    assert!(peak <= limit, "the logs kept {peak} B resident together");

    // Every record reads back after its pages were given back.
    for log in &logs {
        let mut reader = log.reader();
        let mut n = 0;
        while let Some(r) = reader.read_next().unwrap() {
            assert_eq!(r.payload, &payload[..]);
            n += 1;
        }
        assert_eq!(n, 600);
    }
    // Closed logs stop counting.
    drop(logs);
    assert_eq!(budget.counted_bytes(), 0);
}
