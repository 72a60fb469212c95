//! `petrel stat`: a live view of a server's queues (depth, rates in and out, open reads) and topics
//! (publish rate, subscribers, each consumer group's lag), over the native protocol, like `nats
//! top` and `kafka-consumer-groups`; `--once --json` for scripts (the fields of the HTTP API's
//! `/api/v1/queues` and `/api/v1/topics`, docs/http.md). Given a cluster (`--server A,B,C`), one
//! table of the servers' sums, with the servers that are down named above it.

use std::collections::HashMap;
use std::io::{self, IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use petrel_client::blocking::Client;
use petrel_client::{ClientError, QueueStats, TopicStats, answer_within};
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
    /// One JSON object per sample: `{"queues": [...], "topics": [...]}`, with the fields of
    /// /api/v1/queues and /api/v1/topics (and `offered_per_sec`, `delivered_per_sec`,
    /// `published_per_sec` from the second sample on).
    #[arg(long)]
    json: bool,
    /// Time between samples.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Only queues and topics whose names start with this.
    #[arg(long, default_value = "")]
    prefix: String,
}

/// One queue at one moment.
struct Sample {
    name: String,
    stats: QueueStats,
}

/// One topic at one moment.
struct TopicSample {
    name: String,
    stats: TopicStats,
}

/// A server `stat` watches, with its connection while it is up.
struct Watched {
    addr: String,
    client: Option<Client>,
    /// Why it is down.
    error: Option<String>,
}

/// How long one request of a sample may wait for its answer: a server that stopped answering
/// (SIGSTOP, a cut link) is marked down instead of freezing the whole view. (Per request: a
/// server with thousands of queues takes a while to sample, and is not down.)
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// One server's queues and topics at one moment.
fn sample_server(client: &Client, prefix: &str) -> Result<(Vec<Sample>, Vec<TopicSample>), ClientError> {
    client.block_on(sample_server_now(client.inner(), prefix))
}

async fn sample_server_now(
    client: &petrel_client::Client,
    prefix: &str,
) -> Result<(Vec<Sample>, Vec<TopicSample>), ClientError> {
    let mut samples = Vec::new();
    for name in answer_within(REQUEST_TIMEOUT, "the server", client.list_queues())
        .await?
        .into_iter()
        .filter(|n| n.starts_with(prefix))
    {
        match answer_within(REQUEST_TIMEOUT, "the server", client.queue_status(&name)).await {
            Ok(stats) => samples.push(Sample { name, stats }),
            // Removed between the list and its status.
            Err(e) if e.status() == Some(petrel_client::Status::QueueNotFound) => {}
            Err(e) => return Err(e),
        }
    }
    let mut topics = Vec::new();
    for name in answer_within(REQUEST_TIMEOUT, "the server", client.list_topics())
        .await?
        .into_iter()
        .filter(|n| n.starts_with(prefix))
    {
        match answer_within(REQUEST_TIMEOUT, "the server", client.topic_status(&name)).await {
            Ok(stats) => topics.push(TopicSample { name, stats }),
            Err(e) if e.status() == Some(petrel_client::Status::TopicNotFound) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((samples, topics))
}

/// Every watched server's queues and topics at one moment, summed by name over the servers
/// that answered; a server that fails is marked down (and tried again at the next sample).
fn sample(
    watched: &mut [Watched],
    options: &petrel_client::ClientOptions,
    prefix: &str,
) -> (Vec<Sample>, Vec<TopicSample>) {
    let mut queues: HashMap<String, QueueStats> = HashMap::new();
    let mut topics: HashMap<String, TopicStats> = HashMap::new();
    for w in watched.iter_mut() {
        if w.client.is_none() {
            match Client::connect_with(&w.addr, options) {
                Ok(c) => (w.client, w.error) = (Some(c), None),
                Err(e) => w.error = Some(e.to_string()),
            }
        }
        let Some(client) = &w.client else { continue };
        match sample_server(client, prefix) {
            Ok((qs, ts)) => {
                for q in qs {
                    // The configuration shown is the first server's.
                    let config = || QueueStats {
                        config: q.stats.config.clone(),
                        durability_in_force: q.stats.durability_in_force.clone(),
                        max_bytes_in_force: q.stats.max_bytes_in_force,
                        ..QueueStats::default()
                    };
                    add_queue(queues.entry(q.name).or_insert_with(config), &q.stats);
                }
                for t in ts {
                    add_topic(topics.entry(t.name).or_default(), t.stats);
                }
            }
            Err(e) => (w.client, w.error) = (None, Some(e.to_string())),
        }
    }
    let mut samples: Vec<Sample> = queues.into_iter().map(|(name, stats)| Sample { name, stats }).collect();
    let mut topics: Vec<TopicSample> = topics.into_iter().map(|(name, stats)| TopicSample { name, stats }).collect();
    samples.sort_by(|a, b| a.name.cmp(&b.name));
    topics.sort_by(|a, b| a.name.cmp(&b.name));
    (samples, topics)
}

/// Adds one server's figures of a queue to the sum.
fn add_queue(sum: &mut QueueStats, one: &QueueStats) {
    sum.items += one.items;
    sum.bytes += one.bytes;
    sum.in_flight += one.in_flight;
    sum.total_offered += one.total_offered;
    sum.total_polled += one.total_polled;
    sum.expired += one.expired;
    sum.dropped += one.dropped;
    sum.waiters += one.waiters;
    sum.delayed += one.delayed;
    sum.acked += one.acked;
    sum.aborted += one.aborted;
    sum.dead_lettered += one.dead_lettered;
    sum.deduplicated += one.deduplicated;
    sum.dedup_keys += one.dedup_keys;
}

/// Adds one server's figures of a topic to the sum; a consumer group's offsets and lag are
/// summed over the servers' logs (each server's log has offsets of its own), and it is open if
/// a subscriber reads through it anywhere.
fn add_topic(sum: &mut TopicStats, one: TopicStats) {
    sum.durable |= one.durable;
    sum.subscribers += one.subscribers;
    sum.published += one.published;
    sum.delivered += one.delivered;
    sum.slow_subscribers_ended += one.slow_subscribers_ended;
    for g in one.groups {
        match sum.groups.iter_mut().find(|s| s.name == g.name) {
            Some(s) => {
                s.committed += g.committed;
                s.next_offset += g.next_offset;
                s.lag += g.lag;
                s.open |= g.open;
            }
            None => sum.groups.push(g),
        }
    }
}

pub fn stat(args: StatArgs) -> Res {
    let cluster = args.server.is_cluster();
    let options = if cluster { args.server.cluster_options()?.client } else { args.server.options()? };
    let mut watched: Vec<Watched> = args
        .server
        .servers()
        .into_iter()
        .map(str::trim)
        .filter(|addr| !addr.is_empty()) // `A,` is a cluster of one
        .map(|addr| Watched { addr: addr.to_owned(), client: None, error: None })
        .collect();
    if !cluster {
        // One server: one that cannot be reached is an error, as for every other command.
        watched[0].client = Some(args.server.connect()?);
    }
    let mut previous: HashMap<String, (u64, u64)> = HashMap::new();
    let mut previous_published: HashMap<String, u64> = HashMap::new();
    let mut previous_at = Instant::now();
    // Which servers answered the last sample: a rate is a difference of sums over the same
    // servers only (one coming back would add its whole count to a second's rate).
    let mut previous_up: Vec<bool> = Vec::new();
    let live = io::stdout().is_terminal() && !args.json && !args.once;
    loop {
        let (samples, topics) = sample(&mut watched, &options, &args.prefix);
        if let Some(error) = watched.iter().find_map(|w| w.error.as_ref()).filter(|_| !cluster) {
            return Err(error.clone().into());
        }
        if watched.iter().all(|w| w.client.is_none()) {
            let reasons: Vec<String> =
                watched.iter().map(|w| format!("{}: {}", w.addr, w.error.as_deref().unwrap_or("down"))).collect();
            return Err(format!("no server could be reached ({})", reasons.join("; ")).into());
        }
        let now = Instant::now();
        let secs = now.duration_since(previous_at).as_secs_f64();
        let up: Vec<bool> = watched.iter().map(|w| w.client.is_some()).collect();
        let same_servers = up == previous_up;
        // No rate across a change of servers, nor for a counter that went back (a queue removed
        // and made again, a server restarted): `-` rather than a figure that is not one.
        let per_sec = |now: u64, before: u64| (same_servers && now >= before).then(|| (now - before) as f64 / secs);
        let rates = |s: &Sample| {
            let (offered, delivered) = previous.get(&s.name)?;
            Some((per_sec(s.stats.total_offered, *offered)?, per_sec(s.stats.total_polled, *delivered)?))
        };
        let published_rate = |t: &TopicSample| per_sec(t.stats.published, *previous_published.get(&t.name)?);
        let mut out = io::stdout().lock();
        if args.json {
            let queues: Vec<Value> = samples.iter().map(|s| queue_json(s, rates(s))).collect();
            let topics: Vec<Value> = topics.iter().map(|t| topic_json(t, published_rate(t))).collect();
            let mut sample = json!({ "queues": queues, "topics": topics });
            if cluster {
                let servers: Vec<Value> = watched
                    .iter()
                    .map(|w| json!({"server": w.addr, "up": w.client.is_some(), "error": w.error}))
                    .collect();
                sample["servers"] = json!(servers);
            }
            writeln!(out, "{sample}")?;
        } else {
            if live {
                write!(out, "\x1b[2J\x1b[H")?; // clear the terminal, as top does
            }
            if cluster {
                let up = watched.iter().filter(|w| w.client.is_some()).count();
                let servers = crate::output::count(watched.len() as u64, "server");
                write!(out, "{servers}, {up} up (figures are their sums)")?;
                for w in watched.iter().filter(|w| w.client.is_none()) {
                    write!(out, "; down: {} ({})", w.addr, w.error.as_deref().unwrap_or("?"))?;
                }
                writeln!(out)?;
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
            if !topics.is_empty() {
                writeln!(out)?;
                writeln!(
                    out,
                    "{:<32} {:<20} {:>12} {:>11} {:>10} {:>10}",
                    "topic", "group", "published", "subscribers", "lag", "in/s"
                )?;
            }
            for t in &topics {
                let st = &t.stats;
                let rate = published_rate(t).map_or_else(|| "-".to_owned(), |r| format!("{r:.0}"));
                writeln!(
                    out,
                    "{:<32} {:<20} {:>12} {:>11} {:>10} {:>10}",
                    t.name, "-", st.published, st.subscribers, "-", rate
                )?;
                for g in &st.groups {
                    let reader = if g.open { "1" } else { "0" };
                    writeln!(out, "{:<32} {:<20} {:>12} {:>11} {:>10} {:>10}", "", g.name, "", reader, g.lag, "")?;
                }
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
        previous_published = topics.iter().map(|t| (t.name.clone(), t.stats.published)).collect();
        previous_at = now;
        previous_up = up;
        std::thread::sleep(args.interval);
    }
}

fn queue_json(s: &Sample, rates: Option<(f64, f64)>) -> Value {
    let mut q = queue_figures(&s.name, &s.stats);
    if let Some((offered, delivered)) = rates {
        q["offered_per_sec"] = json!(offered);
        q["delivered_per_sec"] = json!(delivered);
    }
    q
}

/// A queue's figures as `petrel queue status` and `stat --json` print them: named as the HTTP
/// API's `/api/v1/queues/NAME` names them (`docs/http.md`), one vocabulary wherever a user looks.
pub(crate) fn queue_figures(name: &str, st: &QueueStats) -> Value {
    let (dedup_keys, dedup_ns) = petrel_broker::config::dedup_window_of(&st.config);
    json!({
        "name": name,
        "config": st.config,
        "messages": st.items,
        "bytes": st.bytes,
        "open_reads": st.in_flight,
        "waiters": st.waiters,
        "offered": st.total_offered,
        "delivered": st.total_polled,
        "expired": st.expired,
        "dropped": st.dropped,
        "aborted": st.aborted,
        "acked": st.acked,
        "dead_lettered": st.dead_lettered,
        "deduplicated": st.deduplicated,
        "dedup_keys": st.dedup_keys,
        "delayed": st.delayed,
        "durability_in_force": st.durability_in_force,
        "max_bytes_in_force": st.max_bytes_in_force,
        // What the configuration's 0s ("the default") stand for: the broker's defaults, which
        // are this build's and the server's (one binary).
        "dedup_window_in_force": dedup_keys,
        "dedup_window_ms_in_force": dedup_ns / 1_000_000,
        "priority_share_in_force": petrel_broker::config::priority_share_of(&st.config),
    })
}

fn topic_json(t: &TopicSample, published_per_sec: Option<f64>) -> Value {
    let st = &t.stats;
    let mut topic = json!({
        "name": t.name,
        "durable": st.durable,
        "subscribers": st.subscribers,
        "published": st.published,
        "delivered": st.delivered,
        "slow_subscribers_ended": st.slow_subscribers_ended,
        // The wire's group fields are the API's: name, committed, next_offset, lag, open.
        "groups": st.groups,
    });
    if let Some(rate) = published_per_sec {
        topic["published_per_sec"] = json!(rate);
    }
    topic
}
