//! `petrel stat`: a live view of a server's queues (depth, rates in and out, open reads), over the
//! native protocol, like `nats top`; `--once --json` for scripts (the fields of the HTTP API's
//! `/api/v1/queues`, docs/http.md).

use std::collections::HashMap;
use std::io::{self, IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use petrel_client::QueueStats;
use serde_json::{Value, json};

use crate::server_cmd::ServerArg;

type Res = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Args)]
pub struct StatArgs {
    #[command(flatten)]
    server: ServerArg,
    /// One sample, then stop.
    #[arg(long)]
    once: bool,
    /// One JSON object per sample: `{"queues": [...]}`, each with the fields of /api/v1/queues
    /// (and `offered_per_sec`, `delivered_per_sec` from the second sample on).
    #[arg(long)]
    json: bool,
    /// Time between samples.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Only queues whose names start with this.
    #[arg(long, default_value = "")]
    prefix: String,
}

/// One queue at one moment.
struct Sample {
    name: String,
    stats: QueueStats,
}

pub fn stat(args: StatArgs) -> Res {
    let client = args.server.connect()?;
    let mut previous: HashMap<String, (u64, u64)> = HashMap::new();
    let mut previous_at = Instant::now();
    let live = io::stdout().is_terminal() && !args.json && !args.once;
    loop {
        let mut samples = Vec::new();
        for name in client.list_queues()?.into_iter().filter(|n| n.starts_with(&args.prefix)) {
            match client.queue_status(&name) {
                Ok(stats) => samples.push(Sample { name, stats }),
                // Removed between the list and its status.
                Err(e) if e.status() == Some(petrel_client::Status::QueueNotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        samples.sort_by(|a, b| a.name.cmp(&b.name));
        let now = Instant::now();
        let secs = now.duration_since(previous_at).as_secs_f64();
        let rates = |s: &Sample| {
            let (offered, delivered) = previous.get(&s.name)?;
            let per_sec = |now: u64, before: u64| now.saturating_sub(before) as f64 / secs;
            Some((per_sec(s.stats.total_offered, *offered), per_sec(s.stats.total_polled, *delivered)))
        };
        let mut out = io::stdout().lock();
        if args.json {
            let queues: Vec<Value> = samples.iter().map(|s| queue_json(s, rates(s))).collect();
            writeln!(out, "{}", json!({ "queues": queues }))?;
        } else {
            if live {
                write!(out, "\x1b[2J\x1b[H")?; // clear the terminal, as top does
            }
            writeln!(
                out,
                "{:<32} {:>10} {:>12} {:>10} {:>8} {:>10} {:>10}",
                "queue", "messages", "bytes", "open", "waiters", "in/s", "out/s"
            )?;
            for s in &samples {
                let (rate_in, rate_out) = match rates(s) {
                    Some((i, o)) => (format!("{i:.0}"), format!("{o:.0}")),
                    None => ("-".into(), "-".into()),
                };
                let st = &s.stats;
                writeln!(
                    out,
                    "{:<32} {:>10} {:>12} {:>10} {:>8} {:>10} {:>10}",
                    s.name, st.items, st.bytes, st.in_flight, st.waiters, rate_in, rate_out
                )?;
            }
            if !live && !args.once {
                writeln!(out)?;
            }
        }
        out.flush()?;
        drop(out);
        if args.once {
            return Ok(ExitCode::SUCCESS);
        }
        previous = samples.iter().map(|s| (s.name.clone(), (s.stats.total_offered, s.stats.total_polled))).collect();
        previous_at = now;
        std::thread::sleep(args.interval);
    }
}

fn queue_json(s: &Sample, rates: Option<(f64, f64)>) -> Value {
    let st = &s.stats;
    let mut q = json!({
        "name": s.name,
        "messages": st.items,
        "bytes": st.bytes,
        "open_reads": st.in_flight,
        "waiters": st.waiters,
        "offered": st.total_offered,
        "delivered": st.total_polled,
        "expired": st.expired,
        "dropped": st.dropped,
    });
    if let Some((offered, delivered)) = rates {
        q["offered_per_sec"] = json!(offered);
        q["delivered_per_sec"] = json!(delivered);
    }
    q
}
