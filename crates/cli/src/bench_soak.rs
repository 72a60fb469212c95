//! `petrel bench soak`: a server under hostile load for a long while. It starts `petrel serve` as
//! a child process with a memory budget, measures a well-behaved client on the idle server, then
//! opens many idle connections and queues, floods queues nobody reads and a topic whose
//! subscriber never reads, and measures the same client again while watching the server's
//! resident memory, descriptors and threads from `/proc`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use petrel_client::{Client, ClientError, Message, PollOptions, QueueConfig, Status};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Args)]
pub struct SoakBench {
    /// How long the hostile load runs.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// How long the well-behaved client is measured on the idle server first.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    baseline: Duration,
    /// Durable queues made (and flooded, with no consumer) besides the well-behaved client's.
    #[arg(long, default_value_t = 10_000)]
    queues: usize,
    /// Idle connections held open (from 127.0.1.x, 500 per address: under the per-address limit).
    #[arg(long, default_value_t = 5_000)]
    connections: usize,
    /// The server's memory budget (`max_memory_bytes`).
    #[arg(long, default_value_t = 512 << 20)]
    max_memory_bytes: u64,
    /// The server's budget for durable logs' resident pages (`max_resident_bytes`).
    #[arg(long, default_value_t = 256 << 20)]
    max_resident_bytes: u64,
    /// Each flooded durable queue's bound (`max_bytes`): the flood fills the disk to
    /// queues × this, then meets QUEUE_FULL.
    #[arg(long, default_value_t = 256 << 10)]
    queue_max_bytes: u64,
    /// Bytes per second the floods send in all (half to durable queues, a quarter each to
    /// in-memory queues and the topic); 0: as fast as they can, which on a machine shared with
    /// the server measures its CPU more than its limits.
    #[arg(long, default_value_t = 64 << 20)]
    flood_bytes_per_sec: u64,
    /// The server's data directory goes in a fresh subdirectory here, removed afterwards.
    #[arg(long, default_value_os_t = crate::default_data_dir())]
    data: PathBuf,
    /// Print the report as one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

/// Offer-then-poll pairs of the well-behaved client, each with this many at once.
const GOOD_TASKS: usize = 4;
const GOOD_PAYLOAD: usize = 1024;
/// Windows the well-behaved client's rate is measured in (shorter in a short run).
fn window(duration: Duration) -> Duration {
    (duration / 4).clamp(Duration::from_secs(1), Duration::from_secs(10))
}
/// Idle connections per source address (the server's default per-address limit is 1,000).
const PER_ADDRESS: usize = 500;

pub fn run(args: SoakBench) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if args.connections.div_ceil(PER_ADDRESS) > 250 {
        return Err("--connections: at most 125,000".into());
    }
    if args.baseline < Duration::from_millis(100) {
        // The load's figures are ratios to it.
        return Err("--baseline must be at least 100ms".into());
    }
    crate::server_cmd::raise_open_files_limit();
    let bench_dir = crate::BenchDir::new(&args.data, "bench-soak");
    let dir = bench_dir.path.clone();
    std::fs::create_dir_all(&dir)?;
    let result = (|| -> Res<Report> {
        let server = ServerProcess::start(&dir, &args)?;
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        rt.block_on(soak(&args, &server.addr, server.child.id()))
    })();
    let _ = bench_dir.remove();
    let report = result.map_err(|e| e as Box<dyn std::error::Error>)?;
    report.print(&args);
    Ok(ExitCode::SUCCESS)
}

struct ServerProcess {
    child: Child,
    addr: String,
}

impl ServerProcess {
    fn start(dir: &Path, args: &SoakBench) -> Res<ServerProcess> {
        let config = dir.join("soak.toml");
        // Room for the flooded queues and the benchmark's own few beside them.
        let text = format!(
            "max_memory_bytes = {}\nmax_resident_bytes = {}\nmax_queues = {}\ndurability = \"none\"\n",
            args.max_memory_bytes,
            args.max_resident_bytes,
            args.queues + 16
        );
        std::fs::write(&config, text)?;
        let mut child = Command::new(std::env::current_exe()?)
            .args(["serve", "--native-addr", "127.0.0.1:0", "--memcache-addr", "off", "--http-addr", "off", "--data"])
            .arg(dir.join("data"))
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("native ") else {
            let _ = child.kill();
            return Err(format!("petrel serve said {line:?}").into());
        };
        Ok(ServerProcess { addr: addr.to_owned(), child })
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The server's footprint, read from `/proc/PID`.
#[derive(Clone, Copy, Default, Debug)]
struct Footprint {
    rss_anon: u64,
    rss_file: u64,
    fds: u64,
    threads: u64,
}

impl Footprint {
    fn read(pid: u32) -> Footprint {
        let mut f = Footprint::default();
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            for line in status.lines() {
                let mut words = line.split_whitespace();
                let (Some(name), Some(value)) = (words.next(), words.next()) else { continue };
                let value: u64 = value.parse().unwrap_or(0);
                match name {
                    "RssAnon:" => f.rss_anon = value * 1024,
                    "RssFile:" => f.rss_file = value * 1024,
                    "Threads:" => f.threads = value,
                    _ => {}
                }
            }
        }
        f.fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
        f
    }

    fn max(self, o: Footprint) -> Footprint {
        Footprint {
            rss_anon: self.rss_anon.max(o.rss_anon),
            rss_file: self.rss_file.max(o.rss_file),
            fds: self.fds.max(o.fds),
            threads: self.threads.max(o.threads),
        }
    }
}

/// What the hostile clients were answered.
#[derive(Default)]
struct Answers {
    accepted: AtomicU64,
    queue_full: AtomicU64,
    limit_reached: AtomicU64,
    other: AtomicU64,
}

impl Answers {
    fn count<T>(&self, result: &Result<T, ClientError>, messages: u64) {
        let counter = match result {
            Ok(_) => &self.accepted,
            Err(e) => match e.status() {
                Some(Status::QueueFull) => &self.queue_full,
                Some(Status::LimitReached) => &self.limit_reached,
                _ => &self.other,
            },
        };
        counter.fetch_add(messages, Ordering::Relaxed);
    }
}

struct Report {
    baseline_pairs_per_sec: f64,
    /// The well-behaved client's rate in each window of the hostile phase.
    windows: Vec<f64>,
    idle: Footprint,
    /// With the queues made and the idle connections open, before the floods.
    set_up: Footprint,
    peak: Footprint,
    setup_secs: f64,
    connections_open: usize,
    answers: Arc<Answers>,
}

impl Report {
    fn print(&self, args: &SoakBench) {
        let min = self.windows.iter().copied().fold(f64::INFINITY, f64::min);
        let mean = self.windows.iter().sum::<f64>() / self.windows.len().max(1) as f64;
        let a = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "soak: {} durable queues, {} idle connections (set up in {:.0} s), {:?} of floods at {} + stalled subscribers",
            args.queues,
            self.connections_open,
            self.setup_secs,
            args.duration,
            match args.flood_bytes_per_sec {
                0 => "full speed".to_owned(),
                rate => format!("{:.0} MiB/s", mib(rate)),
            }
        );
        println!(
            "well-behaved client: idle {:.0} pairs/s; under load mean {:.0} ({:.2}), worst {:?} window {:.0} ({:.2})",
            self.baseline_pairs_per_sec,
            mean,
            mean / self.baseline_pairs_per_sec,
            window(args.duration),
            min,
            min / self.baseline_pairs_per_sec
        );
        println!(
            "server with the queues and idle connections, before the floods: anonymous RSS {:.0} MiB, {} descriptors",
            mib(self.set_up.rss_anon),
            self.set_up.fds
        );
        println!(
            "server peak: anonymous RSS {:.0} MiB (budget max_memory_bytes {:.0} MiB; idle {:.0} MiB), file-backed RSS {:.0} MiB (budget max_resident_bytes {:.0} MiB), {} descriptors (idle {}), {} threads",
            mib(self.peak.rss_anon),
            mib(args.max_memory_bytes),
            mib(self.idle.rss_anon),
            mib(self.peak.rss_file),
            mib(args.max_resident_bytes),
            self.peak.fds,
            self.idle.fds,
            self.peak.threads
        );
        println!(
            "flood answers (messages): {} accepted, {} QUEUE_FULL, {} LIMIT_REACHED, {} other",
            a(&self.answers.accepted),
            a(&self.answers.queue_full),
            a(&self.answers.limit_reached),
            a(&self.answers.other),
        );
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "queues": args.queues,
                    "connections": self.connections_open,
                    "duration_secs": args.duration.as_secs_f64(),
                    "flood_bytes_per_sec": args.flood_bytes_per_sec,
                    "baseline_pairs_per_sec": self.baseline_pairs_per_sec,
                    "load_mean_pairs_per_sec": mean,
                    "load_min_pairs_per_sec": min,
                    "load_mean_ratio": mean / self.baseline_pairs_per_sec,
                    "load_min_ratio": min / self.baseline_pairs_per_sec,
                    "max_memory_bytes": args.max_memory_bytes,
                    "max_resident_bytes": args.max_resident_bytes,
                    "peak_rss_anon_bytes": self.peak.rss_anon,
                    "peak_rss_file_bytes": self.peak.rss_file,
                    "idle_rss_anon_bytes": self.idle.rss_anon,
                    "set_up_rss_anon_bytes": self.set_up.rss_anon,
                    "set_up_fds": self.set_up.fds,
                    "peak_fds": self.peak.fds,
                    "idle_fds": self.idle.fds,
                    "peak_threads": self.peak.threads,
                    "flood_accepted": a(&self.answers.accepted),
                    "flood_queue_full": a(&self.answers.queue_full),
                    "flood_limit_reached": a(&self.answers.limit_reached),
                    "flood_other": a(&self.answers.other),
                })
            );
        }
    }
}

async fn soak(args: &SoakBench, addr: &str, pid: u32) -> Res<Report> {
    let good = Client::connect(addr).await?;
    good.create_queue("good", QueueConfig { durable: true, ..QueueConfig::default() }).await?;
    let pairs = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Its own thread and runtime: the floods' tasks in this process must not be what slows it.
    let good_thread = {
        let (addr, pairs, stop) = (addr.to_owned(), Arc::clone(&pairs), Arc::clone(&stop));
        std::thread::spawn(move || -> Result<(), String> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
            rt.block_on(async move {
                let client = Client::connect(addr.as_str()).await.map_err(|e| e.to_string())?;
                let loops =
                    (0..GOOD_TASKS).map(|_| well_behaved(client.clone(), Arc::clone(&pairs), Arc::clone(&stop)));
                for done in futures::future::join_all(loops).await {
                    done.map_err(|e| format!("the well-behaved client: {e}"))?;
                }
                Ok(())
            })
        })
    };
    // Warm up, then the idle baseline.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = pairs.load(Ordering::Relaxed);
    tokio::time::sleep(args.baseline).await;
    let baseline_pairs_per_sec = (pairs.load(Ordering::Relaxed) - before) as f64 / args.baseline.as_secs_f64();
    let idle = Footprint::read(pid);

    // The hostile setup: queues, then idle connections (not timed against the client).
    let setup = Instant::now();
    let admin = Client::connect(addr).await?;
    let names: Vec<String> = (0..args.queues).map(|i| format!("flood-{i}")).collect();
    let config = QueueConfig { durable: true, max_bytes: args.queue_max_bytes, ..QueueConfig::default() };
    for chunk in names.chunks(64) {
        let made = futures::future::join_all(chunk.iter().map(|n| admin.create_queue(n, config.clone()))).await;
        made.into_iter().collect::<Result<Vec<_>, _>>()?;
    }
    for i in 0..4 {
        admin.create_queue(&format!("flood-memory-{i}"), QueueConfig::default()).await?;
    }
    admin.create_topic("news", false).await?;
    let idle_clients = open_idle_connections(addr, args.connections).await?;
    let connections_open = idle_clients.len();
    let setup_secs = setup.elapsed().as_secs_f64();
    let set_up = Footprint::read(pid);

    let answers = Arc::new(Answers::default());
    let flooding = Arc::new(AtomicBool::new(true));
    let rate = args.flood_bytes_per_sec;
    let hostile = vec![
        tokio::spawn(flood_durable(addr.to_owned(), names, rate / 2, Arc::clone(&answers), Arc::clone(&flooding))),
        tokio::spawn(flood_memory(addr.to_owned(), rate / 4, Arc::clone(&answers), Arc::clone(&flooding))),
        tokio::spawn(flood_topic(addr.to_owned(), rate / 4, Arc::clone(&answers), Arc::clone(&flooding))),
        tokio::spawn(stalled_subscribers(addr.to_owned(), Arc::clone(&flooding))),
    ];
    let keepalive = tokio::spawn(keep_alive(idle_clients, Arc::clone(&flooding)));

    let started = Instant::now();
    let mut peak = idle;
    let mut windows = Vec::new();
    let mut window_start = (Instant::now(), pairs.load(Ordering::Relaxed));
    while started.elapsed() < args.duration {
        tokio::time::sleep(Duration::from_secs(1)).await;
        peak = peak.max(Footprint::read(pid));
        let now = Instant::now();
        if now - window_start.0 >= window(args.duration) {
            let done = pairs.load(Ordering::Relaxed);
            windows.push((done - window_start.1) as f64 / (now - window_start.0).as_secs_f64());
            window_start = (now, done);
        }
    }
    flooding.store(false, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    good_thread.join().map_err(|_| "the well-behaved client panicked")??;
    for task in hostile {
        task.await??;
    }
    drop(keepalive.await?);
    // A new connection (the first ones may have been closed as idle meanwhile, as they should).
    let after = Client::connect(addr).await.map_err(|e| format!("the server did not accept after the soak: {e}"))?;
    after.ping().await.map_err(|e| format!("the server did not answer after the soak: {e}"))?;
    drop(good);
    Ok(Report { baseline_pairs_per_sec, windows, idle, set_up, peak, setup_secs, connections_open, answers })
}

/// The client whose service should not suffer: offers one message to its own durable queue and
/// takes one, again and again.
async fn well_behaved(client: Client, pairs: Arc<AtomicU64>, stop: Arc<AtomicBool>) -> Result<(), ClientError> {
    let payload = bytes::Bytes::from(vec![0x67; GOOD_PAYLOAD]);
    let take = PollOptions { max: 1, timeout: Duration::from_secs(1), visibility: None };
    while !stop.load(Ordering::Relaxed) {
        client.offer("good", vec![Message::new(payload.clone())], None).await?;
        if !client.poll("good", take).await?.is_empty() {
            pairs.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// `count` connections that say HELLO and then nothing, from 127.0.1.1, 127.0.1.2, … with
/// `PER_ADDRESS` each.
async fn open_idle_connections(addr: &str, count: usize) -> Res<Vec<Client>> {
    let server: std::net::SocketAddr = addr.parse()?;
    let mut clients = Vec::with_capacity(count);
    for chunk_start in (0..count).step_by(100) {
        let opening = (chunk_start..(chunk_start + 100).min(count)).map(|i| async move {
            let source = std::net::Ipv4Addr::new(127, 0, 1, 1 + (i / PER_ADDRESS) as u8);
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind((source, 0).into())?;
            let stream = socket.connect(server).await?;
            Client::over(stream).await.map_err(|e| std::io::Error::other(e.to_string()))
        });
        for opened in futures::future::join_all(opening).await {
            clients.push(opened?);
        }
    }
    Ok(clients)
}

/// Idle connections ping every two minutes, so that the idle timeout (10 min) leaves them be.
async fn keep_alive(clients: Vec<Client>, running: Arc<AtomicBool>) -> Vec<Client> {
    let mut last = Instant::now();
    while running.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if last.elapsed() >= Duration::from_secs(120) {
            for chunk in clients.chunks(500) {
                futures::future::join_all(chunk.iter().map(Client::ping)).await;
            }
            last = Instant::now();
        }
    }
    clients
}

/// Offers batches of 1 KiB messages round robin over the flooded durable queues, 32 requests in
/// flight, until told to stop; nobody takes them.
async fn flood_durable(
    addr: String,
    names: Vec<String>,
    rate: u64,
    answers: Arc<Answers>,
    running: Arc<AtomicBool>,
) -> Res<()> {
    let client = Client::connect(addr.as_str()).await?;
    let payload = bytes::Bytes::from(vec![0x66; 1024]);
    let next = Arc::new(AtomicU64::new(0));
    let workers = (0..32).map(|_| {
        let (client, names, answers, running, next, payload) =
            (client.clone(), &names, &answers, &running, Arc::clone(&next), payload.clone());
        let mut pace = Pace::new(rate / 32, 16 << 10);
        async move {
            while running.load(Ordering::Relaxed) {
                pace.wait().await;
                let i = next.fetch_add(1, Ordering::Relaxed) as usize % names.len().max(1);
                let Some(name) = names.get(i) else { break };
                let result = client.offer(name, vec![Message::new(payload.clone()); 16], None).await;
                answers.count(&result, 16);
                if matches!(&result, Err(e) if e.is_connection_lost()) {
                    break;
                }
            }
        }
    });
    futures::future::join_all(workers).await;
    Ok(())
}

/// Offers 64 KiB messages to in-memory queues with no consumer: they fill to their bound and the
/// server's memory budget, and past it every offer is refused.
async fn flood_memory(addr: String, rate: u64, answers: Arc<Answers>, running: Arc<AtomicBool>) -> Res<()> {
    let client = Client::connect(addr.as_str()).await?;
    let payload = bytes::Bytes::from(vec![0x6d; 64 << 10]);
    let workers = (0..8).map(|w| {
        let (client, answers, running, payload) = (client.clone(), &answers, &running, payload.clone());
        let mut pace = Pace::new(rate / 8, 256 << 10);
        async move {
            let queue = format!("flood-memory-{}", w % 4);
            while running.load(Ordering::Relaxed) {
                pace.wait().await;
                let result = client.offer(&queue, vec![Message::new(payload.clone()); 4], None).await;
                answers.count(&result, 4);
                if matches!(&result, Err(e) if e.is_connection_lost()) {
                    break;
                }
            }
        }
    });
    futures::future::join_all(workers).await;
    Ok(())
}

/// Publishes 16 KiB messages to the topic the stalled subscribers hold (8 a request: a request
/// larger than 64 KiB is held in the memory budget while it is read, so a full budget refuses it).
async fn flood_topic(addr: String, rate: u64, answers: Arc<Answers>, running: Arc<AtomicBool>) -> Res<()> {
    let client = Client::connect(addr.as_str()).await?;
    let payload = bytes::Bytes::from(vec![0x74; 16 << 10]);
    let mut pace = Pace::new(rate, 128 << 10);
    while running.load(Ordering::Relaxed) {
        pace.wait().await;
        let result = client.publish("news", vec![Message::new(payload.clone()); 8]).await;
        answers.count(&result, 8);
        if let Err(e) = result
            && e.is_connection_lost()
        {
            return Err(e.into());
        }
    }
    Ok(())
}

/// Subscribers that never read, with the largest message buffer a client may ask for: each is
/// replaced every 20 s (two at a time), so there is always one filling up.
async fn stalled_subscribers(addr: String, running: Arc<AtomicBool>) -> Res<()> {
    use tokio::io::AsyncWriteExt;
    let mut held = std::collections::VecDeque::new();
    while running.load(Ordering::Relaxed) {
        let mut stream = tokio::net::TcpStream::connect(addr.as_str()).await?;
        let mut frames = Vec::new();
        petrel_proto::Request::Hello { client: "stalled".into(), features: 0 }.encode(1, &mut frames)?;
        let subscribe = petrel_proto::Request::Subscribe {
            topic: "news".into(),
            buffer: 1 << 20,
            group: String::new(),
            from: petrel_proto::StartFrom::Resume,
        };
        subscribe.encode(2, &mut frames)?;
        stream.write_all(&frames).await?;
        held.push_back(stream);
        if held.len() > 2 {
            held.pop_front();
        }
        let until = Instant::now() + Duration::from_secs(20);
        while running.load(Ordering::Relaxed) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Holds one flooder to `bytes_per_sec` in requests of `request_bytes` (0: no pause).
struct Pace(Option<tokio::time::Interval>);

impl Pace {
    fn new(bytes_per_sec: u64, request_bytes: u64) -> Pace {
        Pace((bytes_per_sec > 0).then(|| {
            let period = Duration::from_secs_f64(request_bytes as f64 / bytes_per_sec as f64);
            let mut interval = tokio::time::interval(period.max(Duration::from_micros(10)));
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        }))
    }

    async fn wait(&mut self) {
        if let Some(interval) = &mut self.0 {
            interval.tick().await;
        }
    }
}
