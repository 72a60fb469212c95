//! `petrel log …`: verify, dump, append and repair a log directory.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use clap::{Args, Subcommand};
use petrel_log::verify::{self, ProblemKind};
use petrel_log::{Durability, GroupOptions, Log, Options, Record};

use crate::progress::{self, Unit};

#[derive(Subcommand)]
pub enum LogCommand {
    /// Check every frame of every segment and list each problem (exit 1 if any is corruption).
    Verify { dir: PathBuf },
    /// Print records: a table, or one JSON object per line with --json.
    Dump(DumpArgs),
    /// Append each line of stdin as a record; print each offset once acknowledged.
    Append(AppendArgs),
    /// List the consumer groups: committed offset, lag, records acknowledged ahead of it.
    Groups { dir: PathBuf },
    /// Print records of a consumer group and acknowledge each one after printing it.
    Consume(ConsumeArgs),
    /// Truncate the log at its first bad frame (needs --yes).
    Repair {
        /// The log's directory (a server's queue keeps its log in DATA/queues/NAME).
        dir: PathBuf,
        /// Confirm: records from the first bad frame to the end are deleted.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
pub struct DumpArgs {
    /// The log's directory (a server's queue keeps its log in DATA/queues/NAME).
    dir: PathBuf,
    /// First offset to print (default: the oldest).
    #[arg(long)]
    from: Option<u64>,
    /// Print at most this many records.
    #[arg(long)]
    count: Option<u64>,
    /// Start where this consumer group stands (its lowest unacknowledged record).
    #[arg(long, conflicts_with_all = ["from", "since"])]
    group: Option<String>,
    /// Only records with this key (UTF-8).
    #[arg(long)]
    key: Option<String>,
    /// Start at the first record at or after this time: RFC 3339 (2026-11-22T10:00:00Z) or
    /// nanoseconds since the Unix epoch.
    #[arg(long, value_parser = parse_time, conflicts_with = "from")]
    since: Option<u64>,
    /// One JSON object per line: offset, timestamp, key_base64, headers, payload_base64.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ConsumeArgs {
    /// The log's directory (a server's queue keeps its log in DATA/queues/NAME).
    dir: PathBuf,
    /// The consumer group (made, at the oldest record, if the log has none of this name).
    #[arg(long)]
    group: String,
    /// Stop after this many records (default: when the log has no more).
    #[arg(long)]
    count: Option<u64>,
    /// When acknowledgements are durable: none, always, or interval:MS. With `always`, each
    /// printed record is durably acknowledged before the next one is printed.
    #[arg(long, default_value = "none")]
    cursor_durability: Durability,
    /// Wait this long for new records before stopping (e.g. 500ms, 10s).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    wait: std::time::Duration,
    /// One JSON object per record (payload in base64), as `petrel log dump --json` prints them.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct AppendArgs {
    /// The log's directory (a server's queue keeps its log in DATA/queues/NAME).
    dir: PathBuf,
    /// none, always, or interval:MS.
    #[arg(long, default_value = "none")]
    durability: Durability,
    /// Bytes preallocated per segment file.
    #[arg(long, default_value_t = petrel_log::DEFAULT_SEGMENT_BYTES)]
    segment_bytes: u64,
}

pub fn run(cmd: LogCommand) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let dir = match &cmd {
        LogCommand::Verify { dir } | LogCommand::Groups { dir } | LogCommand::Repair { dir, .. } => dir.clone(),
        LogCommand::Dump(args) => args.dir.clone(),
        LogCommand::Append(args) => args.dir.clone(),
        LogCommand::Consume(args) => args.dir.clone(),
    };
    let result = match cmd {
        LogCommand::Verify { dir } => verify_cmd(dir),
        LogCommand::Dump(args) => dump(args),
        LogCommand::Append(args) => append(args),
        LogCommand::Groups { dir } => groups(dir),
        LogCommand::Consume(args) => consume(args),
        LogCommand::Repair { dir, yes } => repair(dir, yes),
    };
    result.map_err(|e| point_into_data_dir(e, &dir))
}

/// A server's data directory is not a log, but holds one per queue and durable topic: an error
/// about it says where they are.
fn point_into_data_dir(e: Box<dyn std::error::Error>, dir: &std::path::Path) -> Box<dyn std::error::Error> {
    let not_a_log = matches!(e.downcast_ref::<petrel_log::Error>(), Some(petrel_log::Error::NotALog { .. }));
    if not_a_log && (dir.join("queues").is_dir() || dir.join("topics").is_dir()) {
        let at = dir.display();
        return format!("{e}; {at} looks like a server's data directory: each durable queue's log is {at}/queues/NAME, each durable topic's {at}/topics/NAME").into();
    }
    e
}

fn verify_cmd(dir: PathBuf) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let bar = progress::bar(0, "verify", Unit::Bytes);
    let report = verify::verify(&dir, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    println!(
        "{}: {}, records {}..{}, {} in {} bytes of frames",
        dir.display(),
        crate::output::count(report.segments as u64, "segment"),
        report.first_offset,
        report.next_offset,
        crate::output::count(report.records as u64, "valid record"),
        report.frame_bytes
    );
    for p in &report.problems {
        let kind = match p.kind {
            ProblemKind::Corrupt => "CORRUPT",
            ProblemKind::TornTail => "torn tail",
            ProblemKind::Header => "BAD HEADER",
            ProblemKind::Cursor => "BAD CURSOR",
        };
        let offset = p.offset.map(|o| format!(" record {o}")).unwrap_or_default();
        println!("{kind}: {} byte {}{offset}: {}", p.file.display(), p.position, p.detail);
    }
    if report.is_clean() {
        println!("ok");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("corrupt: `petrel log repair {}` says what it would do; with --yes it does it", dir.display());
        Ok(ExitCode::from(1))
    }
}

fn dump(args: DumpArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mut reader = verify::open_read_only(&args.dir)?;
    if let Some(from) = args.from {
        reader.seek(from);
    }
    if let Some(since) = args.since {
        let at = reader.offset_at_time(since)?;
        reader.seek(at);
    }
    if let Some(name) = &args.group {
        let (groups, unreadable) = verify::list_readable_groups(&args.dir)?;
        if let Some((_, why)) = unreadable.iter().find(|(g, _)| g == name) {
            return Err(format!("consumer group {name:?}: {why}").into());
        }
        let group = groups
            .into_iter()
            .find(|g| &g.name == name)
            .ok_or_else(|| format!("no consumer group {name:?} in {}", args.dir.display()))?;
        reader.seek(group.committed);
    }
    let key = args.key.as_deref().map(str::as_bytes);
    let mut left = args.count.unwrap_or(u64::MAX);
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    if !args.json {
        writeln!(out, "{:>12}  {:<30}  {:<16}  {:>9}  first bytes  [headers]", "offset", "time", "key", "size")?;
    }
    while left > 0 {
        let batch = reader.read_batch(left.min(1024) as usize)?;
        if batch.is_empty() {
            break;
        }
        for record in batch {
            if key.is_some() && record.key != key {
                continue;
            }
            if left == 0 {
                break;
            }
            left -= 1;
            if args.json {
                writeln!(out, "{}", record_json(&record))?;
            } else {
                writeln!(out, "{}", record_row(&record))?;
            }
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

pub fn record_json(r: &Record<'_>) -> serde_json::Value {
    let headers: serde_json::Map<String, serde_json::Value> =
        r.headers.iter().map(|(n, v)| (n.to_owned(), B64.encode(v).into())).collect();
    serde_json::json!({
        "offset": r.offset,
        "timestamp": r.timestamp,
        "key_base64": r.key.map(|k| B64.encode(k)),
        "headers": headers,
        "payload_base64": B64.encode(r.payload),
    })
}

/// `--since`: RFC 3339, or nanoseconds since the Unix epoch.
fn parse_time(s: &str) -> Result<u64, String> {
    if let Ok(ns) = s.parse::<u64>() {
        return Ok(ns);
    }
    crate::output::unix_ns(s).map_err(|e| format!("{e} (nor nanoseconds)"))
}

/// Where each group stands; shown for a damaged log too (its end as verify finds it, a damaged
/// cursor named as such), which is when an operator weighs what a repair will do.
fn groups(dir: PathBuf) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let end = match verify::open_read_only(&dir) {
        Ok(reader) => reader.end_offset(),
        Err(_) => verify::verify(&dir, |_, _| {})?.next_offset,
    };
    let (groups, unreadable) = verify::list_readable_groups(&dir)?;
    println!("{:<24} {:>14} {:>14} {:>12} {:>6}", "group", "committed", "lag", "acked ahead", "held");
    for g in groups {
        let lag = g.unacknowledged(end);
        println!("{:<24} {:>14} {:>14} {:>12} {:>6}", g.name, g.committed, lag, g.acked_above, g.held);
    }
    for (name, why) in &unreadable {
        println!("{name:<24} unreadable cursor: {why}");
    }
    Ok(if unreadable.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Prints records of a group, acknowledging each after it is printed and flushed.
fn consume(args: ConsumeArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let _server_kept_out = not_served(&args.dir)?;
    let log = Log::open(&args.dir, Options { create: false, ..Options::default() })?;
    let options = GroupOptions { durability: args.cursor_durability, ..GroupOptions::default() };
    let mut group = log.group(&args.group, options)?;
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let mut left = args.count.unwrap_or(u64::MAX);
    let mut offsets = Vec::with_capacity(64);
    while left > 0 {
        offsets.clear();
        let batch = group.poll(left.min(64) as usize, args.wait)?;
        if batch.is_empty() {
            break;
        }
        // Print everything, then acknowledge one by one: printing borrows the batch.
        let mut lines = Vec::with_capacity(batch.len());
        for record in batch {
            lines.push(if args.json { record_json(&record).to_string() } else { record_row(&record) });
            offsets.push(record.offset);
        }
        for (line, &offset) in lines.iter().zip(&offsets) {
            writeln!(out, "{line}")?;
            out.flush()?;
            group.ack(offset)?;
            left -= 1;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn record_row(r: &Record<'_>) -> String {
    let time = humantime::format_rfc3339_micros(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(r.timestamp));
    let key = r.key.map(|k| printable(k, 16)).unwrap_or_else(|| "-".into());
    // The headers' names: what tells a queue's control records (a `ctl.returned` marker, no
    // payload) from its messages, and a message's fields kept as headers.
    let names: Vec<String> = r.headers.iter().map(|(name, _)| printable(name.as_bytes(), 24)).collect();
    let headers = if names.is_empty() { String::new() } else { format!("  [{}]", names.join(", ")) };
    format!(
        "{:>12}  {:<30}  {:<16}  {:>9}  {}{headers}",
        r.offset,
        time.to_string(),
        key,
        r.payload.len(),
        printable(r.payload, 32)
    )
}

/// Up to `max` bytes, printable ASCII as is, the rest as `\xNN`.
fn printable(bytes: &[u8], max: usize) -> String {
    let mut s: String = bytes.iter().take(max).flat_map(|&b| std::ascii::escape_default(b)).map(char::from).collect();
    if bytes.len() > max {
        s.push('…');
    }
    s
}

/// The locks of the data directories of servers that `dir` (a log) may be part of, held while
/// a command writes to it: a running server holds its data directory's lock (and not its queue
/// logs' own), so a command that wrote to one of its logs would write under it, and the
/// server's next append would write over what the command appended. Refused if a server runs
/// there; held meanwhile, so that none starts.
fn not_served(dir: &std::path::Path) -> Result<Vec<std::fs::File>, Box<dyn std::error::Error>> {
    let mut held = Vec::new();
    // A queue's log is `DATA/queues/NAME` (or `…/NAME/priority-K`, `…/NAME/delayed`), a
    // topic's `DATA/topics/NAME`: its data directory is two or three levels up, above `queues`
    // or `topics`.
    // Its real path: `..` and symbolic links resolved (`../jobs` from a sibling queue's
    // directory, or a link to a queue's, named no `queues` among the two levels above).
    let dir = std::fs::canonicalize(dir).or_else(|_| std::path::absolute(dir))?;
    for kind in dir.ancestors().skip(1).take(2) {
        let Some(data) = kind.parent().filter(|_| kind.ends_with("queues") || kind.ends_with("topics")) else {
            continue;
        };
        let Ok(lock) = std::fs::File::open(data) else { continue };
        match lock.try_lock() {
            Ok(()) => held.push(lock),
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(format!(
                    "a running petrel server holds {} (whose log {} is): stop it first (a queue or topic the server \
                     lists as damaged, in /api/v1/server, is repaired in place by POST /api/v1/queues/NAME/repair \
                     or /api/v1/topics/NAME/repair)",
                    data.display(),
                    dir.display()
                )
                .into());
            }
            Err(std::fs::TryLockError::Error(_)) => {}
        }
    }
    Ok(held)
}

/// Appends stdin lines. Lines already waiting are appended as one batch, then acknowledged
/// together under the durability policy, then their offsets are printed and flushed: a printed
/// offset is a record that survives what the policy promises.
fn append(args: AppendArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let _server_kept_out = not_served(&args.dir)?;
    let options = Options { segment_bytes: args.segment_bytes, durability: args.durability, ..Options::default() };
    let mut log = Log::open(&args.dir, options)?;
    let mut input = crate::lines::StdinLines::new(4096);
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let mut lines: Vec<Vec<u8>> = Vec::new();
    loop {
        input.next_batch(&mut lines)?;
        if lines.is_empty() {
            break;
        }
        let range = log.append_batch(&lines)?;
        for offset in range {
            writeln!(out, "{offset}")?;
        }
        out.flush()?;
    }
    log.close()?;
    Ok(ExitCode::SUCCESS)
}

fn repair(dir: PathBuf, yes: bool) -> Result<ExitCode, Box<dyn std::error::Error>> {
    // A server's durable topic (`DATA/topics/NAME`): its groups may seek back, so no damaged
    // record is written again as a record of zeros they would be handed.
    let under_topics = dir.canonicalize().ok().is_some_and(|d| {
        let parent = d.parent();
        // (Not a sub-log of a queue named "topics": `DATA/queues/topics/delayed`.)
        parent.is_some_and(|p| p.ends_with("topics"))
            && !parent.and_then(Path::parent).is_some_and(|g| g.ends_with("queues"))
    });
    let replace = if under_topics { verify::Replace::Never } else { verify::Replace::Passed };
    if !yes {
        let report = verify::verify(&dir, |_, _| {})?;
        if report.problems.is_empty() {
            println!("{}: nothing to repair", dir.display());
            return Ok(ExitCode::SUCCESS);
        }
        // What `verify::repair` does, problem by problem: headers and cursors are written again;
        // the log is cut at its first bad frame.
        for p in &report.problems {
            match p.kind {
                ProblemKind::Header => println!("would rewrite the header of {} (its records stay)", p.file.display()),
                ProblemKind::Cursor => println!(
                    "would start the group of {} again at record {} (records after its lost position come again)",
                    p.file.display(),
                    report.first_offset
                ),
                ProblemKind::Corrupt | ProblemKind::TornTail => {}
            }
        }
        let plan = verify::plan_with(&dir, &report, replace)?;
        for r in &plan.replace {
            println!(
                "would write record {} in {} at byte {} again as a record of zeros (every consumer group has passed it; the records after it stay)",
                r.offset,
                r.file.display(),
                r.position
            );
        }
        if let Some(p) = &plan.cut {
            let from = p.offset.map_or("an unknown record".into(), |o| format!("record {o}"));
            match p.is_segment_gap() {
                // (Records missing before a segment: it cannot follow the one before.)
                true => println!(
                    "would delete {} and every later segment ({}): the log would end before {from}",
                    p.file.display(),
                    p.detail
                ),
                false => println!(
                    "would truncate {} at byte {} and delete everything from {from} to the log's end (record {}), later segments included",
                    p.file.display(),
                    p.position,
                    report.next_offset
                ),
            }
        }
        println!("run again with --yes to do it");
        return Ok(ExitCode::from(1));
    }
    let _server_kept_out = not_served(&dir)?;
    let report = verify::repair_with(&dir, replace)?;
    for offset in &report.records_replaced {
        println!("record {offset} written again as a record of zeros (every consumer group had passed it)");
    }
    match &report.cut_at {
        Some((file, 0)) => println!(
            "deleted {} and every later segment: records were missing before it; removed {} intact records ({} segments); the log now ends before record {}",
            file.display(),
            report.records_removed,
            report.segments_removed,
            report.next_offset
        ),
        Some((file, pos)) => println!(
            "truncated {} at byte {pos}: removed the damaged records there and {} intact records after them ({} later segments); the log now ends before record {}",
            file.display(),
            report.records_removed,
            report.segments_removed,
            report.next_offset
        ),
        None if report.records_replaced.is_empty()
            && report.headers_rewritten == 0
            && report.groups_restarted.is_empty() =>
        {
            println!("{}: nothing to repair", dir.display())
        }
        None if report.records_replaced.is_empty() => {
            println!("no bad frames; {} segment headers rewritten", report.headers_rewritten)
        }
        None => println!("no records removed; {} segment headers rewritten", report.headers_rewritten),
    }
    if report.cut_at.is_some() && report.headers_rewritten > 0 {
        println!("{} segment headers rewritten", report.headers_rewritten);
    }
    for group in &report.groups_restarted {
        println!("group {group:?} starts again at the oldest record on disk (its cursor was unreadable)");
    }
    // Said by a verify of the result, not assumed: a repair that left damage exits 1.
    let after = verify::verify(&dir, |_, _| {})?;
    let left: Vec<_> = after.problems.iter().filter(|p| p.kind != ProblemKind::TornTail).collect();
    for p in &left {
        eprintln!("still damaged: {} at byte {}: {}", p.file.display(), p.position, p.detail);
    }
    Ok(if left.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
