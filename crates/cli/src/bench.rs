//! `petrel bench …`: measure Petrel on this machine. Results are printed for people, and with
//! `--json` the last line is one JSON object for scripts.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use petrel_log::{Durability, GroupOptions, Input, Log, MAX_PENDING, Options};

use crate::progress::{self, Unit};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// The embedded log: append N records, then read them all back.
    Log(LogBench),
    /// A queue on a server: offer, poll, or both at once, over many connections and pipelined.
    Queue(crate::bench_queue::QueueBench),
    /// A server under hostile load for minutes (idle connections, queues, floods nobody reads, a
    /// stalled subscriber): its memory, descriptors and a well-behaved client's rate.
    Soak(crate::bench_soak::SoakBench),
}

#[derive(Args)]
pub struct LogBench {
    /// Data directory; the benchmark works in a fresh subdirectory and removes it afterwards.
    #[arg(long, default_value_os_t = crate::default_data_dir())]
    data: PathBuf,
    /// Bytes of each record's payload.
    #[arg(long, default_value_t = 32)]
    payload_bytes: usize,
    /// Records to append.
    #[arg(long, default_value_t = 10_000_000)]
    count: u64,
    /// none, always, or interval:MS.
    #[arg(long, default_value = "none")]
    durability: Durability,
    /// Producer threads appending through one shared handle (group commit under `always`).
    #[arg(long, default_value_t = 1)]
    producers: u64,
    /// Records per append call (1 = one `append` per record).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Largest segment file of the log, bytes.
    #[arg(long, default_value_t = petrel_log::DEFAULT_SEGMENT_BYTES)]
    segment_bytes: u64,
    /// Give records keys `k0`…`k{N-1}` (round robin) and measure get-by-key (0 = no keys).
    #[arg(long, default_value_t = 0)]
    keys: u64,
    /// Random lookups per lookup phase (get by offset, key and time).
    #[arg(long, default_value_t = 1_000_000)]
    lookups: u64,
    /// Read the log back and poll + ack it in a second process, as a consumer of a queue would,
    /// after this one appended and closed it (the page cache warm, the mappings new).
    #[arg(long)]
    consumer_process: bool,
    /// (The second process of `--consumer-process`: read and poll + ack the log in this
    /// directory, appended by the first.)
    #[arg(long, hide = true, conflicts_with = "consumer_process")]
    consume: Option<PathBuf>,
    /// Keep the benchmark's log directory.
    #[arg(long)]
    keep: bool,
    /// Print the result as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: BenchCommand) -> Result<ExitCode, Box<dyn std::error::Error>> {
    match cmd {
        BenchCommand::Log(args) => log_bench(args),
        BenchCommand::Queue(args) => crate::bench_queue::run(args),
        BenchCommand::Soak(args) => crate::bench_soak::run(args),
    }
}

fn log_bench(args: LogBench) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if args.producers == 0 || args.batch == 0 || args.count == 0 {
        return Err("--producers, --batch and --count must be at least 1".into());
    }
    if args.producers > 1 && (args.batch > 1 || args.keys > 0) {
        return Err(
            "with --producers, each producer appends one record at a time, without keys: leave out --batch and --keys"
                .into(),
        );
    }
    if args.count < args.producers {
        return Err("--count must be at least --producers (each producer appends one record or more)".into());
    }
    if let Some(dir) = &args.consume {
        return consume_existing(&args, dir);
    }
    let bench_dir = crate::BenchDir::new(&args.data, "bench-log");
    let dir = bench_dir.path.clone();
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let options = Options {
        segment_bytes: args.segment_bytes,
        durability: args.durability,
        key_index: args.keys > 0,
        ..Options::default()
    };
    let payload = bench_payload(args.payload_bytes);
    let bar = progress::bar(args.count, "append", Unit::Items);

    let log = Log::open(&dir, options.clone())?;
    let started = Instant::now();
    let (log, appended) = if args.producers == 1 {
        let mut log = log;
        let batch: Vec<&[u8]> = vec![&payload; args.batch];
        let mut done = 0u64;
        let mut keys: Vec<String> = vec![String::new(); args.batch];
        while done < args.count {
            let n = (args.count - done).min(args.batch as u64);
            if args.keys > 0 {
                use std::fmt::Write;
                for (i, key) in keys[..n as usize].iter_mut().enumerate() {
                    key.clear();
                    write!(key, "k{}", (done + i as u64) % args.keys).unwrap();
                }
                let inputs: Vec<Input<'_>> = keys[..n as usize]
                    .iter()
                    .map(|key| Input { key: Some(key.as_bytes()), ..Input::payload(&payload) })
                    .collect();
                if n == 1 {
                    log.append_with(&inputs[0])?;
                } else {
                    log.append_batch_with(&inputs)?;
                }
                done += n;
                if done & 0xFFFF < n {
                    bar.set_position(done);
                }
                continue;
            }
            if n == 1 {
                log.append(&payload)?;
            } else {
                log.append_batch(&batch[..n as usize])?;
            }
            done += n;
            if done & 0xFFFF < n {
                bar.set_position(done);
            }
        }
        (log.into_shared(), done)
    } else {
        let log = log.into_shared();
        let threads: Vec<_> = (0..args.producers)
            .map(|p| {
                // The remainder of `count` goes to the first producers.
                let per = args.count / args.producers + u64::from(p < args.count % args.producers);
                let log = log.clone();
                let payload = payload.clone();
                let bar = bar.clone();
                std::thread::spawn(move || -> petrel_log::Result<u64> {
                    for i in 0..per {
                        log.append(&payload)?;
                        if i % 1024 == 0 {
                            bar.inc(1024.min(per - i));
                        }
                    }
                    Ok(per)
                })
            })
            .collect();
        let mut total = 0;
        for t in threads {
            total += t.join().map_err(|_| "producer thread panicked")??;
        }
        (log, total)
    };
    let append_secs = started.elapsed().as_secs_f64();
    let (syncs, frame_bytes) = (log.stats().syncs, log.stats().frame_bytes);
    bar.finish_and_clear();

    let (log, consumed) = if args.consumer_process {
        drop(log);
        let consumed = consume_in_child(&args, &dir, appended)?;
        (Log::open(&dir, options)?.into_shared(), consumed)
    } else {
        let consumed = consume(&log, appended, &payload)?;
        (log, consumed)
    };
    let Consumed { read_secs, poll_ack_secs, mut checksum, peak_rss_bytes: consumer_peak_rss } = consumed;
    let read = appended;

    // Random lookups.
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut reader = log.reader();
    let lookups = args.lookups;
    let started = Instant::now();
    for _ in 0..lookups {
        let offset = rng.below(appended);
        let record = reader.get(offset)?.ok_or("a record in the log was not found")?;
        checksum = checksum.wrapping_add(record.payload.len() as u64);
    }
    let get_by_offset_per_sec = lookups as f64 / started.elapsed().as_secs_f64();

    // The same, 64 random offsets per `get_many` (their cache misses overlap).
    let mut offsets = [0u64; 64];
    let started = Instant::now();
    let mut got = 0u64;
    for _ in 0..lookups.div_ceil(offsets.len() as u64) {
        offsets.iter_mut().for_each(|o| *o = rng.below(appended));
        reader.get_many(&offsets, |_, record| {
            got += 1;
            checksum = checksum.wrapping_add(record.payload.len() as u64);
        })?;
    }
    if got != lookups.div_ceil(offsets.len() as u64) * offsets.len() as u64 {
        return Err("get_many missed a record in the log".into());
    }
    let get_many_by_offset_per_sec = got as f64 / started.elapsed().as_secs_f64();

    let first_ts = reader.get(0)?.map_or(0, |r| r.timestamp);
    let last_ts = reader.get(appended - 1)?.map_or(0, |r| r.timestamp);
    let started = Instant::now();
    for _ in 0..lookups {
        let t = first_ts + rng.below(last_ts - first_ts + 1);
        let record = reader.get_by_time(t)?.ok_or("no record at or after a time inside the log")?;
        checksum = checksum.wrapping_add(record.offset);
    }
    let get_by_time_per_sec = lookups as f64 / started.elapsed().as_secs_f64();

    let get_by_key_per_sec = if args.keys > 0 {
        let names: Vec<String> = (0..args.keys.min(1 << 20)).map(|k| format!("k{k}")).collect();
        let started = Instant::now();
        for _ in 0..lookups {
            let key = &names[rng.below(names.len() as u64) as usize];
            let record = reader.get_by_key(key.as_bytes())?.ok_or("a key in the log was not found")?;
            checksum = checksum.wrapping_add(record.offset);
        }
        Some(lookups as f64 / started.elapsed().as_secs_f64())
    } else {
        None
    };
    std::hint::black_box(checksum);
    drop(reader);
    drop(log);
    let bytes_on_disk = disk_usage(&dir)?;
    if !args.keep {
        bench_dir.remove()?;
    }

    let mb = (appended * args.payload_bytes as u64) as f64 / 1e6;
    let result = serde_json::json!({
        "bench": "log",
        "payload_bytes": args.payload_bytes,
        "count": appended,
        "durability": args.durability.to_string(),
        "producers": args.producers,
        "batch": args.batch,
        "keys": args.keys,
        "append_secs": append_secs,
        "append_msgs_per_sec": appended as f64 / append_secs,
        "append_mb_per_sec": mb / append_secs,
        "read_secs": read_secs,
        "read_msgs_per_sec": read as f64 / read_secs,
        "read_mb_per_sec": mb / read_secs,
        "poll_ack_msgs_per_sec": appended as f64 / poll_ack_secs,
        "get_by_offset_per_sec": get_by_offset_per_sec,
        "get_many_by_offset_per_sec": get_many_by_offset_per_sec,
        "get_by_time_per_sec": get_by_time_per_sec,
        "get_by_key_per_sec": get_by_key_per_sec,
        "syncs": syncs,
        "bytes_on_disk": bytes_on_disk,
        "frame_bytes": frame_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "consumer_process": args.consumer_process,
        "consumer_peak_rss_bytes": consumer_peak_rss,
    });
    println!(
        "appended {appended} × {} B ({}, {} producer(s), batch {}): {:.0} msg/s, {:.1} MB/s",
        args.payload_bytes,
        args.durability,
        args.producers,
        args.batch,
        appended as f64 / append_secs,
        mb / append_secs
    );
    if syncs > 0 {
        println!("{syncs} syncs, {:.1} records per sync", appended as f64 / syncs as f64);
    }
    println!("read {read}: {:.0} msg/s, {:.1} MB/s", read as f64 / read_secs, mb / read_secs);
    println!(
        "poll+ack (one group): {:.0} msg/s; random get by offset {get_by_offset_per_sec:.0}/s ({get_many_by_offset_per_sec:.0}/s 64 at a time), by time {get_by_time_per_sec:.0}/s{}",
        appended as f64 / poll_ack_secs,
        get_by_key_per_sec.map(|k| format!(", by key {k:.0}/s")).unwrap_or_default()
    );
    println!(
        "on disk {bytes_on_disk} B (frames {frame_bytes} B, {:.1} B a record), peak RSS {} B",
        frame_bytes as f64 / appended.max(1) as f64,
        peak_rss_bytes()
    );
    if args.json {
        println!("{result}");
    }
    Ok(ExitCode::SUCCESS)
}

/// What reading a log back and polling + acking it through a group measured.
struct Consumed {
    read_secs: f64,
    poll_ack_secs: f64,
    /// Of what was read, for `black_box`.
    checksum: u64,
    /// Of the process that read.
    peak_rss_bytes: u64,
}

/// Reads the `appended` records of `log` (each `payload`) back in batches, checking them, then
/// polls and acknowledges every one through the group "bench".
fn consume(log: &petrel_log::SharedLog, appended: u64, payload: &[u8]) -> Result<Consumed, Box<dyn std::error::Error>> {
    let bar = progress::bar(appended, "read", Unit::Items);
    let mut reader = log.reader();
    let started = Instant::now();
    let mut read = 0u64;
    let mut checksum = 0u64;
    loop {
        let batch = reader.read_batch(4096)?;
        if batch.is_empty() {
            break;
        }
        read += batch.len() as u64;
        for record in batch {
            checksum = checksum
                .wrapping_add(record.payload.len() as u64 + record.payload.first().copied().unwrap_or(0) as u64);
        }
        if read & 0xFFFF < 4096 {
            bar.set_position(read);
        }
    }
    let read_secs = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if read != appended {
        return Err(format!("read {read} records but appended {appended}").into());
    }
    let expected = appended * (payload.len() as u64 + payload.first().copied().unwrap_or(0) as u64);
    if checksum != expected {
        return Err("records read back differ from those appended".into());
    }
    drop(reader);

    // Poll + ack of every record through one consumer group.
    let bar = progress::bar(appended, "poll+ack", Unit::Items);
    let mut group = log.group("bench", GroupOptions { max_pending: MAX_PENDING, ..GroupOptions::default() })?;
    let started = Instant::now();
    let mut polled = 0u64;
    let mut offsets = Vec::with_capacity(4096);
    loop {
        offsets.clear();
        let batch = group.poll(4096, Duration::ZERO)?;
        if batch.is_empty() {
            break;
        }
        for record in batch {
            checksum = checksum.wrapping_add(record.payload.len() as u64);
            offsets.push(record.offset);
        }
        for &offset in &offsets {
            group.ack(offset)?;
        }
        polled += offsets.len() as u64;
        if polled & 0xFFFF < 4096 {
            bar.set_position(polled);
        }
    }
    let poll_ack_secs = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if polled != appended || group.committed() != appended {
        return Err(format!("polled {polled} records of {appended}").into());
    }
    drop(group);
    Ok(Consumed { read_secs, poll_ack_secs, checksum, peak_rss_bytes: peak_rss_bytes() })
}

/// `consume`, in a second process of this program (`--consume DIR`), on the log this one
/// appended to `dir` and closed.
fn consume_in_child(args: &LogBench, dir: &Path, appended: u64) -> Result<Consumed, Box<dyn std::error::Error>> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["bench", "log", "--count", &appended.to_string(), "--payload-bytes", &args.payload_bytes.to_string()])
        .arg("--consume")
        .arg(dir)
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("the consumer process failed ({})", out.status).into());
    }
    let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_owned();
    let v: serde_json::Value =
        serde_json::from_str(&last).map_err(|e| format!("the consumer process said {last:?}: {e}"))?;
    let number = |k: &str| v[k].as_f64().ok_or_else(|| format!("the consumer process gave no {k}"));
    Ok(Consumed {
        read_secs: number("read_secs")?,
        poll_ack_secs: number("poll_ack_secs")?,
        checksum: 0,
        peak_rss_bytes: number("peak_rss_bytes")? as u64,
    })
}

/// The second process of `--consumer-process`: `consume` on the log in `dir`, one JSON line.
fn consume_existing(args: &LogBench, dir: &Path) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let payload = bench_payload(args.payload_bytes);
    let log = Log::open(dir, Options { segment_bytes: args.segment_bytes, ..Options::default() })?.into_shared();
    let c = consume(&log, args.count, &payload)?;
    std::hint::black_box(c.checksum);
    let result = serde_json::json!({
        "read_secs": c.read_secs,
        "poll_ack_secs": c.poll_ack_secs,
        "peak_rss_bytes": c.peak_rss_bytes,
    });
    println!("{result}");
    Ok(ExitCode::SUCCESS)
}

/// The payload every benchmark record carries.
fn bench_payload(bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i * 7 + 1) as u8).collect()
}

/// A small, fast, deterministic generator for lookup positions.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Bytes allocated on disk for the files in `dir`.
fn disk_usage(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() { disk_usage(&entry.path())? } else { meta.blocks() * 512 };
    }
    Ok(total)
}

/// High-water mark of resident memory (VmHWM), in bytes.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
