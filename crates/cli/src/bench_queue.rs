//! `petrel bench queue`: load on a server's queue. Without `--server`, it starts a server in this
//! process (data in a fresh directory under `--data`, removed afterwards).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use petrel_client::{Client, Message, PollOptions, QueueConfig, Request, Response};

use crate::progress::{self, Unit};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Offer `count` messages.
    Offer,
    /// Fill the queue with `count` messages (not timed), then poll them all.
    Poll,
    /// Offer and poll at once (half the connections each); polls take tentatively and ack.
    OfferPoll,
    /// Publish `count` messages to a topic (named by --queue) with --subscribers subscribers;
    /// counts messages delivered.
    Publish,
    /// Call an echo function (named by --queue) served on its own connection; counts calls.
    Call,
    /// Open `count` connections (TLS handshake with --tls-ca, HELLO, AUTH with --user), up to
    /// --connections at once; counts handshakes.
    Connect,
}

/// A value as the command line spells it (`offer-poll`).
fn value_name(value: impl ValueEnum) -> String {
    value.to_possible_value().map_or_else(String::new, |v| v.get_name().to_owned())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Protocol {
    Native,
    /// The memcache text protocol (`set` / `get`); works against memcached too, for comparison.
    Memcache,
}

#[derive(Args)]
pub struct QueueBench {
    #[arg(long, value_enum, default_value = "offer")]
    pub(crate) mode: Mode,
    #[arg(long, value_enum, default_value = "native")]
    pub(crate) protocol: Protocol,
    /// Memcache: spread over this many queues (keys) `QUEUE-0` … (round robin per connection).
    #[arg(long, default_value_t = 1)]
    pub(crate) keys: usize,
    /// Publish: subscribers, each on its own connection.
    #[arg(long, default_value_t = 1)]
    pub(crate) subscribers: usize,
    /// A running server; without it, one is started in this process. A comma list (A,B,C) is a
    /// cluster, driven through the cluster client (`A,` is a cluster of one).
    #[arg(long)]
    pub(crate) server: Option<String>,
    /// Data directory for the in-process server.
    #[arg(long, default_value_os_t = crate::default_data_dir())]
    pub(crate) data: PathBuf,
    /// The queue the run makes, and removes after it (unless --keep). An empty one of this name
    /// (a run's that was stopped) is replaced; one holding messages is refused, never removed.
    /// With --mode publish, the topic: one that exists is refused. With --mode call, the
    /// function the run serves (its calls go to any server of it: name one nobody serves).
    #[arg(long, default_value = "bench")]
    pub(crate) queue: String,
    /// A durable queue (on disk) rather than one in memory.
    #[arg(long)]
    pub(crate) durable: bool,
    /// A queue with this many priority levels; each offer goes to the next level in turn.
    #[arg(long, default_value_t = 0)]
    pub(crate) priorities: u8,
    /// Each message with an idempotency key of its own (the queue remembers them: its dedup
    /// window).
    #[arg(long)]
    pub(crate) idempotency_keys: bool,
    /// Each message delayed this many ms (handed out no earlier).
    #[arg(long, default_value_t = 0)]
    pub(crate) delay_ms: u32,
    /// Leave the queue and what it holds when done (to look at the server's memory).
    #[arg(long)]
    pub(crate) keep: bool,
    /// Bytes of each message's payload.
    #[arg(long, default_value_t = 32)]
    pub(crate) payload_bytes: usize,
    /// Messages in all.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) count: u64,
    /// Connections, each driven by its own task.
    #[arg(long, default_value_t = 1)]
    pub(crate) connections: usize,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 64)]
    pub(crate) pipeline: usize,
    /// Messages per offer request (and most per poll).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// Print the result as one JSON object on the last line.
    #[arg(long)]
    pub(crate) json: bool,
    /// Payloads of English-like text instead of one repeated byte (for --compress-min-bytes).
    #[arg(long)]
    pub(crate) text: bool,
    /// Ask for zstd compression of payloads of at least this many bytes (both ways).
    #[arg(long)]
    pub(crate) compress_min_bytes: Option<usize>,
    /// With --server: authenticate as this user (password from $PETREL_PASSWORD).
    #[arg(long)]
    pub(crate) user: Option<String>,
    /// With --server: speak TLS, trusting the server's certificate if it chains to this CA.
    #[arg(long, value_name = "FILE")]
    pub(crate) tls_ca: Option<PathBuf>,
}

impl QueueBench {
    pub(crate) fn client_options(&self) -> petrel_client::ClientOptions {
        let password = self.user.as_ref().map(|_| std::env::var("PETREL_PASSWORD").unwrap_or_default());
        let tls = self.tls_ca.as_ref().map(|ca| petrel_client::TlsOptions { ca: ca.clone(), ..Default::default() });
        petrel_client::ClientOptions {
            user: self.user.clone(),
            password,
            tls,
            compress_min_bytes: self.compress_min_bytes,
            ..Default::default()
        }
    }

    /// This run's payload, made once and shared by every message (static: the many copies of it
    /// cost no shared reference count).
    pub(crate) fn payload(&self) -> bytes::Bytes {
        let bytes = if self.text { text(self.payload_bytes) } else { vec![0x5a; self.payload_bytes] };
        bytes::Bytes::from_static(Vec::leak(bytes))
    }

    /// A connection to `addr` with this run's TLS and credentials.
    pub(crate) async fn connect(&self, addr: &str) -> Result<Client, petrel_client::ClientError> {
        Client::connect_with(addr, &self.client_options()).await
    }
}

/// `len` bytes of text that compresses about as English prose does (a fixed pseudo-random walk
/// over a small vocabulary: not one repeated phrase).
fn text(len: usize) -> Vec<u8> {
    const WORDS: &[&str] = &[
        "the",
        "queue",
        "message",
        "order",
        "of",
        "and",
        "to",
        "a",
        "server",
        "client",
        "durable",
        "log",
        "is",
        "in",
        "that",
        "for",
        "with",
        "coffee",
        "latte",
        "ready",
        "customer",
        "barista",
        "consumer",
        "group",
        "offset",
        "segment",
        "acknowledged",
        "retry",
        "delivery",
        "at",
        "least",
        "once",
        "every",
        "record",
    ];
    let mut out = Vec::with_capacity(len + 16);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(WORDS[(state % WORDS.len() as u64) as usize].as_bytes());
        out.push(if state.is_multiple_of(11) { b'.' } else { b' ' });
    }
    out.truncate(len);
    out
}

/// Opens `count` connections, `connections` at a time; each a handshake (TLS, HELLO, AUTH).
async fn connects(args: &QueueBench, addr: &str) -> Result<Outcome, Box<dyn std::error::Error>> {
    let options = args.client_options();
    let next = Arc::new(AtomicU64::new(0));
    let bar = progress::bar(args.count, "connect", Unit::Items);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.connections {
        let (options, next, addr, count, bar) =
            (options.clone(), Arc::clone(&next), addr.to_owned(), args.count, bar.clone());
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
            while next.fetch_add(1, Ordering::Relaxed) < count {
                let began = Instant::now();
                let client = Client::connect_with(&addr, &options).await?;
                client.close();
                hist.record(began.elapsed().as_micros().max(1) as u64).expect("in bounds");
                bar.inc(1);
            }
            Ok::<_, petrel_client::ClientError>(hist)
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
    for t in tasks {
        hist.add(t.await??)?;
    }
    bar.finish_and_clear();
    Ok(Outcome::new(args.count, args.count, args.count, started.elapsed().as_secs_f64(), 0, &hist))
}

/// The bench's runtime. Against a server in another process: a thread per connection, up to the
/// cores (one connection on one thread, as redis-benchmark runs: no wake-up of another thread
/// for each answer). A server started in this process shares the runtime: every core.
fn client_runtime(external_server: bool, connections: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match if external_server { connections.min(cores) } else { cores } {
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        threads => tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build(),
    }
}

pub fn run(args: QueueBench) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if [args.connections, args.pipeline, args.batch, args.keys, args.subscribers].contains(&0) || args.count == 0 {
        return Err("--connections, --pipeline, --batch, --keys, --subscribers and --count must be at least 1".into());
    }
    if args.protocol == Protocol::Memcache && matches!(args.mode, Mode::Publish | Mode::Call | Mode::Connect) {
        return Err("--mode publish, call and connect are native-protocol modes".into());
    }
    if args.protocol == Protocol::Native && args.mode == Mode::OfferPoll && args.connections < 2 {
        // Half the connections offer, half poll: one alone would only offer.
        return Err("--mode offer-poll needs --connections 2 or more (half offer, half poll)".into());
    }
    // Subscribers and the function's server are connections of this process too.
    let serving = match args.mode {
        Mode::Publish => args.subscribers,
        Mode::Call => 1,
        _ => 0,
    };
    let rt = client_runtime(args.server.is_some(), args.connections + serving)?;
    rt.block_on(async move {
        let (addr, local) = match &args.server {
            Some(a) => (a.clone(), None),
            None => {
                let dir = crate::BenchDir::new(&args.data, "bench-server");
                let mut config = petrel_server::Config {
                    data: dir.path.clone(),
                    native_addr: "127.0.0.1:0".parse()?,
                    memcache_addr: Some("127.0.0.1:0".parse()?),
                    http_addr: None,
                    ..petrel_server::Config::default()
                };
                // Memcache queues come into being by first use, with the defaults.
                config.queue_defaults.insert("durable".into(), args.durable.into());
                let server = petrel_server::Server::bind(config).await?;
                let addr = match args.protocol {
                    Protocol::Native => server.native_addr(),
                    Protocol::Memcache => server.memcache_addr().expect("asked for"),
                }
                .to_string();
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let task = tokio::spawn(server.run(async move {
                    let _ = stopped.await;
                }));
                (addr, Some((dir, stop, task)))
            }
        };
        let cluster: Vec<&str> = addr.split(',').filter(|a| !a.is_empty()).collect();
        let cpu_before = process_cpu_secs();
        let result = match args.protocol {
            Protocol::Native if addr.contains(',') => match args.mode {
                Mode::Offer | Mode::Poll | Mode::OfferPoll => crate::bench_cluster::bench(&args, &cluster).await,
                _ => Err("a cluster (--server A,B,C) is measured with --mode offer, poll or offer-poll".into()),
            },
            Protocol::Native if matches!(args.mode, Mode::Publish | Mode::Call) => {
                crate::bench_pubsub::bench(&args, &addr).await
            }
            Protocol::Native if args.mode == Mode::Connect => connects(&args, &addr).await,
            Protocol::Native => bench(&args, &addr).await,
            Protocol::Memcache => crate::bench_memcache::bench(&args, &addr).await,
        };
        // This process's CPU per message: the client's own cost when the server runs elsewhere.
        let client_cpu_us = (process_cpu_secs() - cpu_before) * 1e6;
        if let Some((dir, stop, task)) = local {
            let _ = stop.send(());
            let _ = task.await;
            let _ = dir.remove();
        }
        let result = result?;
        let (mode, protocol) = (value_name(args.mode), value_name(args.protocol));
        let servers = match cluster.len() {
            n if n > 1 => format!(" to each of {n} servers"),
            _ => String::new(),
        };
        let connections = match args.connections {
            1 => "1 connection".to_owned(),
            n => format!("{n} connections"),
        };
        println!(
            "{mode}: {} × {} B over {connections}{servers} ({protocol}), pipeline {}, batch {}: {:.0} msg/s, {:.1} MB/s; request latency p50 {:.1} µs, p99 {:.1} µs, p999 {:.1} µs",
            result.messages, args.payload_bytes, args.pipeline, args.batch,
            result.msgs_per_sec, result.mb_per_sec, result.p50_us, result.p99_us, result.p999_us
        );
        let client_cpu_us_per_msg = client_cpu_us / result.messages.max(1) as f64;
        if args.server.is_some() {
            println!("client CPU {client_cpu_us_per_msg:.2} µs per message (user + system, all its threads)");
        }
        if args.protocol == Protocol::Memcache {
            println!("{} requests ({:.0} per second), {} gets answered with an item", result.requests, result.requests as f64 / result.secs, result.hits);
        }
        if args.json {
            println!("{}", serde_json::json!({
                "bench": "queue",
                "mode": mode,
                "protocol": protocol,
                "keys": args.keys,
                "requests": result.requests,
                "requests_per_sec": result.requests as f64 / result.secs,
                "hits": result.hits,
                "payload_bytes": args.payload_bytes,
                "count": result.messages,
                "connections": args.connections,
                "pipeline": args.pipeline,
                "batch": args.batch,
                "durable": args.durable,
                "secs": result.secs,
                "msgs_per_sec": result.msgs_per_sec,
                "mb_per_sec": result.mb_per_sec,
                "latency_p50_us": result.p50_us,
                "latency_p99_us": result.p99_us,
                "latency_p999_us": result.p999_us,
                "client_cpu_us_per_msg": if args.server.is_some() { Some(client_cpu_us_per_msg) } else { None },
            }));
        }
        Ok::<_, Box<dyn std::error::Error>>(ExitCode::SUCCESS)
    })
}

pub(crate) struct Outcome {
    /// Messages offered (offer mode) or taken (poll modes).
    pub messages: u64,
    /// Requests sent (memcache: every set and get).
    pub requests: u64,
    /// Memcache gets answered with an item.
    pub hits: u64,
    pub secs: f64,
    pub msgs_per_sec: f64,
    pub mb_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

impl Outcome {
    pub(crate) fn new(
        messages: u64,
        requests: u64,
        hits: u64,
        secs: f64,
        payload: usize,
        hist: &Histogram<u64>,
    ) -> Self {
        Outcome {
            messages,
            requests,
            hits,
            secs,
            msgs_per_sec: messages as f64 / secs,
            mb_per_sec: (messages * payload as u64) as f64 / 1e6 / secs,
            p50_us: hist.value_at_quantile(0.50) as f64,
            p99_us: hist.value_at_quantile(0.99) as f64,
            p999_us: hist.value_at_quantile(0.999) as f64,
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Role {
    Offer,
    Poll,
}

/// A bench makes its own queue: it replaces an empty one of that name, never one with messages.
pub(crate) fn refuse_a_queue_in_use(name: &str, status: &petrel_client::QueueStats) -> Result<(), String> {
    let held = status.items + status.in_flight + status.delayed;
    if held == 0 {
        return Ok(());
    }
    Err(format!(
        "queue {name:?} holds {}: the bench makes a queue of its own and removes it when done; \
         name another with --queue",
        crate::output::count(held, "message")
    ))
}

async fn bench(args: &QueueBench, addr: &str) -> Result<Outcome, Box<dyn std::error::Error>> {
    let admin = args.connect(addr).await?;
    if let Ok(status) = admin.queue_status(&args.queue).await {
        refuse_a_queue_in_use(&args.queue, &status)?;
        let _ = admin.remove_queue(&args.queue).await;
    }
    let config = QueueConfig { durable: args.durable, priorities: args.priorities, ..QueueConfig::default() };
    admin.create_queue(&args.queue, config).await?;
    let payload = args.payload();
    if args.mode == Mode::Poll {
        fill(args, &admin, &payload).await?;
    }
    let roles: Vec<Role> = (0..args.connections)
        .map(|i| match args.mode {
            Mode::Offer => Role::Offer,
            Mode::Poll => Role::Poll,
            Mode::OfferPoll if i % 2 == 0 => Role::Offer,
            Mode::OfferPoll => Role::Poll,
            Mode::Publish | Mode::Call | Mode::Connect => unreachable!("bench_pubsub's modes and connects"),
        })
        .collect();
    let offerers = roles.iter().filter(|r| **r == Role::Offer).count() as u64;
    let pollers = roles.iter().filter(|r| **r == Role::Poll).count() as u64;
    // Every connection made (and logged in) before the clock starts: only the load is timed.
    let mut clients = Vec::with_capacity(roles.len());
    for _ in &roles {
        clients.push(args.connect(addr).await?);
    }
    let bar = progress::bar(args.count, &format!("{:?}", args.mode).to_lowercase(), Unit::Items);
    let polled = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for ((i, role), client) in roles.iter().copied().enumerate().zip(clients) {
        // Its place among the offering connections: the remainder of `count` goes to the first.
        let rank = roles[..i].iter().filter(|r| **r == Role::Offer).count() as u64;
        let (queue, payload, bar, polled) = (args.queue.clone(), payload.clone(), bar.clone(), Arc::clone(&polled));
        let (pipeline, batch, count, mode) = (args.pipeline, args.batch, args.count, args.mode);
        let (levels, keys, delay_ms) = (u64::from(args.priorities.max(1)), args.idempotency_keys, args.delay_ms);
        let mut offers = 0u64;
        // Each offering connection sends its share; pollers together take `count`.
        let share = if role == Role::Offer { count / offerers + u64::from(rank < count % offerers) } else { count };
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
            let mut in_flight = FuturesUnordered::new();
            let mut sent = 0u64;
            let mut stop = false;
            let tentative = mode == Mode::OfferPoll;
            loop {
                // Offers go out in bursts of `burst` requests, two bursts in flight (so the
                // connection never idles between them), as redis-benchmark -P does; each request
                // has its own frame and answer.
                let burst = if role == Role::Offer { pipeline.div_ceil(2) } else { 1 };
                while !stop && in_flight.len() * burst < pipeline && (role == Role::Poll || sent < share) {
                    let c = client.clone();
                    let (queue, payload) = (queue.clone(), payload.clone());
                    let requests: Vec<Request> = (0..burst)
                        .take_while(|_| role == Role::Offer)
                        .map_while(|_| {
                            let n = (share - sent).min(batch as u64) as usize;
                            let priority = (offers % levels) as u8;
                            offers += 1;
                            let messages = (sent..sent + n as u64)
                                .map(|seq| Message {
                                    priority,
                                    delay_ms,
                                    idempotency_key: if keys { bench_key(i as u64, seq) } else { Default::default() },
                                    ..Message::new(payload.clone())
                                })
                                .collect();
                            sent += n as u64;
                            (n > 0).then(|| Request::Offer { queue: queue.clone(), timeout_ms: 60_000, messages })
                        })
                        .collect();
                    in_flight.push(async move {
                        let t = Instant::now();
                        let done = match role {
                            Role::Offer => {
                                let mut offered = 0;
                                for r in c.pipeline(&requests).await {
                                    match r? {
                                        Response::Offered { count, .. } => offered += u64::from(count),
                                        Response::Error { status, message } => {
                                            return Err(petrel_client::ClientError::Status { status, message });
                                        }
                                        other => {
                                            let e = format!("unexpected answer {other:?}");
                                            return Err(petrel_client::ClientError::Protocol(e));
                                        }
                                    }
                                }
                                offered
                            }
                            Role::Poll => {
                                let visibility = tentative.then_some(Duration::from_secs(60));
                                let timeout = Duration::from_millis(100);
                                let got =
                                    c.poll(&queue, PollOptions { max: batch as u32, timeout, visibility }).await?;
                                if tentative && !got.is_empty() {
                                    let handles: Vec<u64> = got.iter().map(|d| d.handle).collect();
                                    c.ack(&queue, &handles).await?;
                                }
                                got.len() as u64
                            }
                        };
                        Ok::<_, petrel_client::ClientError>((t.elapsed(), done, role, requests.len() as u64))
                    });
                }
                let Some(result) = in_flight.next().await else { break };
                let (latency, done, role, requests) = result?;
                let _ = hist.record_n(latency.as_micros().max(1) as u64, requests.max(1));
                if role == Role::Poll || mode == Mode::Offer {
                    bar.inc(done);
                }
                if role == Role::Poll {
                    let total = polled.fetch_add(done, Ordering::Relaxed) + done;
                    // Enough taken: let the polls in flight finish, send no more.
                    stop = total >= count;
                }
                if stop && in_flight.is_empty() {
                    break;
                }
            }
            Ok::<_, petrel_client::ClientError>(hist)
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for t in tasks {
        hist.add(t.await??)?;
    }
    let secs = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let messages = if pollers > 0 { polled.load(Ordering::Relaxed).min(args.count) } else { args.count };
    if !args.keep {
        let _ = admin.remove_queue(&args.queue).await;
    }
    Ok(Outcome::new(messages, hist.len(), messages, secs, args.payload_bytes, &hist))
}

/// The idempotency key of connection `connection`'s message `seq`: "connection.seq" in hex,
/// written without `format!` and kept inline (at most 24 bytes), whose machinery and allocation
/// would cost the client (which shares the machine's cores with the server) more than the rest
/// of a keyed message.
fn bench_key(connection: u64, seq: u64) -> petrel_client::CompactString {
    fn hex(key: &mut [u8; 33], len: &mut usize, n: u64) {
        for d in (0..(64 - n.leading_zeros()).div_ceil(4).max(1)).rev() {
            key[*len] = b"0123456789abcdef"[(n >> (4 * d)) as usize & 15];
            *len += 1;
        }
    }
    let (mut key, mut len) = ([0u8; 33], 0);
    hex(&mut key, &mut len, connection);
    key[len] = b'.';
    len += 1;
    hex(&mut key, &mut len, seq);
    std::str::from_utf8(&key[..len]).expect("hex digits").into()
}

#[test]
fn bench_keys_are_hex_and_distinct_per_connection() {
    assert_eq!((bench_key(0, 0).as_str(), bench_key(1, 0x1f2e).as_str()), ("0.0", "1.1f2e"));
    assert_eq!(bench_key(15, u64::MAX), "f.ffffffffffffffff");
}

/// Offers `count` messages in batches of 1000, untimed: with the run's priorities (a level per
/// batch in turn), keys and delay.
async fn fill(args: &QueueBench, client: &Client, payload: &bytes::Bytes) -> Result<(), Box<dyn std::error::Error>> {
    let levels = u64::from(args.priorities.max(1));
    let mut sent = 0;
    while sent < args.count {
        let n = (args.count - sent).min(1000);
        let priority = (sent / 1000 % levels) as u8;
        let messages = (sent..sent + n)
            .map(|seq| Message {
                priority,
                delay_ms: args.delay_ms,
                idempotency_key: if args.idempotency_keys { format!("fill.{seq}").into() } else { Default::default() },
                ..Message::new(payload.clone())
            })
            .collect();
        client.offer(&args.queue, messages, None).await?;
        sent += n;
    }
    Ok(())
}

/// CPU time this process has used, all threads, user and system, in seconds.
fn process_cpu_secs() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}
