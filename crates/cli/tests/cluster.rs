//! The cluster client against three real `petrel serve` processes on their own addresses, one
//! of which fails in the middle of a load: killed (`kill -9`), stopped (SIGSTOP) or cut off
//! (its link down). Where this test may make network namespaces (root), each server is a host
//! of its own behind a veth pair on a bridge; otherwise each listens on its own loopback address
//! (127.0.0.2, …), and the cut-off case, which needs a link, is skipped with a note.
//!
//! Each case checks that every acknowledged offer is consumed, and consumed once: a message
//! counts as consumed when its acknowledgement was answered; one whose acknowledgement was lost
//! with its server may come again, and is then counted once. Copies of an offer retried on
//! another server are dropped by their idempotency key (no more than the offers retried could
//! make). It prints how long the producer's offers stalled while the client routed around the
//! failure.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use petrel_client::{Cluster, ClusterOptions, Message, PollOptions, QueueConfig};

const SERVERS: usize = 3;
const BATCH: usize = 10;
const PRODUCERS: usize = 2;
const PORT: u16 = 7411;

/// Where the servers live: namespaces on a bridge, or loopback addresses.
struct Net {
    /// (bridge, namespaces) when namespaces were made; removed on drop.
    namespaces: Option<(String, Vec<String>)>,
    ips: Vec<String>,
}

static NEXT_NET: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Net {
    fn new() -> Net {
        let n = NEXT_NET.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}{n}", std::process::id() % 100_000);
        let subnet = format!("10.{}.{}", 100 + n, std::process::id() % 250);
        let bridge = format!("pcb{id}");
        if std::env::var_os("PETREL_TEST_LOOPBACK").is_none() && ip(&["link", "add", &bridge, "type", "bridge"]) {
            let mut net = Net { namespaces: Some((bridge.clone(), Vec::new())), ips: Vec::new() };
            let ok = ip(&["addr", "add", &format!("{subnet}.254/24"), "dev", &bridge])
                && ip(&["link", "set", &bridge, "up"]);
            assert!(ok, "set up bridge {bridge}");
            for k in 0..SERVERS {
                let ns = format!("pcn{id}h{k}");
                let veth = format!("pcv{id}h{k}");
                let host_ip = format!("{subnet}.{}", k + 1);
                let ok = ip(&["netns", "add", &ns])
                    && ip(&["link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns])
                    && ip(&["link", "set", &veth, "master", &bridge, "up"])
                    && ip(&["-n", &ns, "addr", "add", &format!("{host_ip}/24"), "dev", "eth0"])
                    && ip(&["-n", &ns, "link", "set", "eth0", "up"])
                    && ip(&["-n", &ns, "link", "set", "lo", "up"]);
                net.namespaces.as_mut().unwrap().1.push(ns.clone());
                assert!(ok, "set up host {ns}");
                net.ips.push(host_ip);
            }
            return net;
        }
        let base = 2 + (n as usize) * SERVERS;
        Net { namespaces: None, ips: (0..SERVERS).map(|k| format!("127.0.0.{}", base + k)).collect() }
    }

    fn can_cut(&self) -> bool {
        self.namespaces.is_some()
    }

    /// Host `k`'s link down or up (namespaces only): its packets go nowhere, without a reset.
    fn set_link(&self, k: usize, up: bool) {
        let (bridge, namespaces) = self.namespaces.as_ref().expect("namespaces");
        let _ = bridge;
        let veth = namespaces[k].replacen("pcn", "pcv", 1);
        assert!(ip(&["link", "set", &veth, if up { "up" } else { "down" }]), "link {veth} {up}");
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if let Some((bridge, namespaces)) = &self.namespaces {
            for ns in namespaces {
                ip(&["netns", "del", ns]);
            }
            ip(&["link", "del", bridge]);
        }
    }
}

/// One `petrel serve` on host `k`.
struct Host {
    k: usize,
    addr: String,
    data: PathBuf,
    child: Option<Child>,
    out: Option<std::io::BufReader<std::process::ChildStdout>>,
}

impl Host {
    fn start(&mut self, net: &Net) {
        let petrel = std::env::var("PETREL_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_petrel").to_owned());
        let mut command = match &net.namespaces {
            Some((_, namespaces)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &namespaces[self.k], &petrel]);
                c
            }
            None => Command::new(&petrel),
        };
        let mut child = command
            .args([
                "serve",
                "--native-addr",
                &self.addr,
                "--memcache-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
            ])
            .arg("--data")
            .arg(&self.data)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start petrel serve");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(line.starts_with("native "), "{line:?}");
        self.out = Some(out); // kept open: the server prints more lines
        self.child = Some(child);
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        assert!(Command::new("kill").args([signal, &pid]).status().unwrap().success());
    }

    fn kill9(&mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = Command::new("kill").args(["-CONT", &child.id().to_string()]).status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    Kill,
    Stop,
    Cut,
}

/// What the producer saw.
#[derive(Default)]
struct Produced {
    /// Keys of the offers answered OK.
    acknowledged: HashSet<String>,
    /// Keys of every offer made.
    attempted: HashSet<String>,
    /// Offers that failed at the caller (every server failed) and were made again.
    failed_requests: u64,
    /// The longest an offer took, and the longest one begun while the fault lasted.
    slowest: Duration,
}

/// What the consumer saw: keys whose acknowledgement was answered (with how many times), and
/// keys whose acknowledgement was lost with their server.
#[derive(Default)]
struct Consumed {
    acknowledged: BTreeMap<String, u32>,
    ack_lost: HashSet<String>,
}

async fn run_case(fault: Fault) {
    let net = Net::new();
    if matches!(fault, Fault::Cut) && !net.can_cut() {
        eprintln!("cluster {fault:?}: skipped (no network namespaces here: cutting a link needs them)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut hosts: Vec<Host> = (0..SERVERS)
        .map(|k| Host {
            k,
            addr: format!("{}:{PORT}", net.ips[k]),
            data: dir.path().join(format!("host{k}")),
            child: None,
            out: None,
        })
        .collect();
    for h in &mut hosts {
        h.start(&net);
    }
    let addrs: Vec<String> = hosts.iter().map(|h| h.addr.clone()).collect();
    let options = ClusterOptions {
        request_timeout: Duration::from_millis(500),
        first_pause: Duration::from_millis(50),
        max_pause: Duration::from_millis(400),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::connect(&addrs, options).await.unwrap();
    cluster.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();

    let produced = Arc::new(Mutex::new(Produced::default()));
    let producing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    // Producers that offer back to back, so that the fault meets offers in flight.
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|id| {
            let (cluster, produced) = (cluster.clone(), Arc::clone(&produced));
            tokio::spawn(async move {
                let start = Instant::now();
                let mut n = 0u64;
                while start.elapsed() < Duration::from_secs(4) {
                    let keys: Vec<String> = (0..BATCH).map(|i| format!("p{id}m{}", n + i as u64)).collect();
                    n += BATCH as u64;
                    let batch: Vec<Message> = keys
                        .iter()
                        .map(|k| Message { idempotency_key: k.as_str().into(), ..Message::new(k.clone().into_bytes()) })
                        .collect();
                    produced.lock().unwrap().attempted.extend(keys.iter().cloned());
                    let began = Instant::now();
                    loop {
                        // One producer offers each batch whole, the other as two pipelined halves.
                        let offered = if id == 0 {
                            cluster.offer("jobs", batch.clone(), None).await.map(|_| ())
                        } else {
                            let halves = vec![batch[..BATCH / 2].to_vec(), batch[BATCH / 2..].to_vec()];
                            cluster
                                .offer_pipelined("jobs", halves)
                                .await
                                .into_iter()
                                .collect::<Result<Vec<_>, _>>()
                                .map(|_| ())
                        };
                        match offered {
                            Ok(()) => break,
                            Err(e) => {
                                // Every server failed: a producer tries again, with the same keys.
                                eprintln!("offer failed, trying again: {e}");
                                produced.lock().unwrap().failed_requests += 1;
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                    }
                    let mut p = produced.lock().unwrap();
                    p.slowest = p.slowest.max(began.elapsed());
                    p.acknowledged.extend(keys);
                }
            })
        })
        .collect();
    let producer = {
        let producing = Arc::clone(&producing);
        tokio::spawn(async move {
            for p in producers {
                p.await.unwrap();
            }
            producing.store(false, Ordering::Release);
        })
    };

    let consumed: Arc<Mutex<Consumed>> = Arc::default();
    let consumer = {
        let (cluster, consumed, producing, produced) =
            (cluster.clone(), Arc::clone(&consumed), Arc::clone(&producing), Arc::clone(&produced));
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            let options =
                PollOptions { max: 100, timeout: Duration::from_millis(200), visibility: Some(Duration::from_secs(5)) };
            loop {
                assert!(Instant::now() < deadline, "the consumer did not finish in 60 s");
                let deliveries = match cluster.poll("jobs", options).await {
                    Ok(d) => d,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let mut by_server: HashMap<usize, Vec<_>> = HashMap::new();
                for d in deliveries {
                    by_server.entry(d.handle.server).or_default().push(d);
                }
                for (_, ds) in by_server {
                    let handles: Vec<_> = ds.iter().map(|d| d.handle).collect();
                    let acked = cluster.ack("jobs", &handles).await.unwrap_or(0) as usize;
                    let mut c = consumed.lock().unwrap();
                    for d in ds {
                        let key = String::from_utf8(d.message.payload.to_vec()).unwrap();
                        assert_eq!(key, d.message.idempotency_key);
                        if acked == handles.len() {
                            *c.acknowledged.entry(key).or_default() += 1;
                        } else {
                            // Its acknowledgement was lost with the server: it may come again.
                            assert_eq!(acked, 0, "a group of one connection is acknowledged whole or not at all");
                            c.ack_lost.insert(key);
                        }
                    }
                }
                if producing.load(Ordering::Acquire) {
                    continue;
                }
                let all_in = {
                    let (p, c) = (produced.lock().unwrap(), consumed.lock().unwrap());
                    p.acknowledged.iter().all(|k| c.acknowledged.contains_key(k) || c.ack_lost.contains(k))
                };
                if all_in && drained(&cluster).await {
                    return;
                }
            }
        })
    };

    // The fault, 1 s into the load, for 1.5 s.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fault_began = Instant::now();
    match fault {
        Fault::Kill => hosts[1].kill9(),
        Fault::Stop => hosts[1].signal("-STOP"),
        Fault::Cut => net.set_link(1, false),
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    match fault {
        Fault::Kill => hosts[1].start(&net),
        Fault::Stop => hosts[1].signal("-CONT"),
        Fault::Cut => net.set_link(1, true),
    }
    let fault_lasted = fault_began.elapsed();
    producer.await.unwrap();
    consumer.await.unwrap();

    let stats = cluster.stats();
    let p = produced.lock().unwrap();
    let c = consumed.lock().unwrap();
    let (confirmed, maybe) = (&c.acknowledged, &c.ack_lost);
    let twice: Vec<_> = confirmed.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "{fault:?}: consumed more than once: {twice:?}");
    let missing: Vec<_> =
        p.acknowledged.iter().filter(|k| !confirmed.contains_key(*k) && !maybe.contains(*k)).collect();
    assert!(missing.is_empty(), "{fault:?}: acknowledged and never consumed: {missing:?}");
    for k in confirmed.keys().chain(maybe) {
        assert!(p.attempted.contains(k), "{fault:?}: consumed {k}, never offered");
    }
    let retried = stats.offers_retried + p.failed_requests;
    assert!(
        stats.copies_dropped <= retried * BATCH as u64,
        "{fault:?}: {} copies dropped, more than {retried} retried offers could make",
        stats.copies_dropped
    );
    assert!(stats.servers[1].failures >= 1, "{fault:?}: the failed server was never marked down");
    assert!(stats.servers.iter().all(|s| s.up), "{fault:?}: a server is still down: {:?}", stats.servers);
    eprintln!(
        "cluster {fault:?} ({}): {} offered in batches of {BATCH} by {PRODUCERS} producers, {} consumed once, {} whose ack was lost, \
         offers retried on another server {}, copies dropped {}, failed requests at the caller {}, \
         slowest offer {:?} (fault lasted {:?})",
        if net.can_cut() { "namespaces" } else { "loopback addresses" },
        p.acknowledged.len(),
        confirmed.len(),
        maybe.iter().filter(|k| !confirmed.contains_key(*k)).count(),
        stats.offers_retried,
        stats.copies_dropped,
        p.failed_requests,
        p.slowest,
        fault_lasted,
    );
}

/// No server holds a message of "jobs", waiting or taken (copies dropped are acknowledged in
/// the background, so this may take a moment).
async fn drained(cluster: &Cluster) -> bool {
    cluster.queue_status("jobs").await.into_iter().all(|(_, s)| s.is_ok_and(|s| s.items == 0 && s.in_flight == 0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_loses_no_acknowledged_message() {
    run_case(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_routed_around_and_its_messages_consumed_after() {
    run_case(Fault::Stop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_server_is_routed_around_and_its_messages_consumed_after() {
    run_case(Fault::Cut).await;
}

/// `produce --key` on a cluster: the same command on the same input again stores no line twice
/// (the run's lines go to the server its key ranks first, which remembers their keys; they went
/// to servers in turn, and the other server stored them again); `--create` with a server of the
/// list down makes the queue on the others and offers there (it failed and offered nothing).
#[test]
fn produce_on_a_cluster_keys_its_lines_to_one_server_and_creates_past_a_server_down() {
    use common::{Server, petrel};
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..2).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    let list = servers.iter().map(|s| s.addr.as_str()).collect::<Vec<_>>().join(",");
    let run = |args: &[&str], stdin: &[u8], on: &str| {
        let out = petrel(&[args, &["--server", on]].concat(), stdin);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
    };
    run(&["queue", "create", "jobs", "--durable"], b"", &list);
    for round in 0..6 {
        for key in ["nightly", "hourly"] {
            run(&["produce", "jobs", "--key", key], b"a\nb\nc\n", &list);
            let status: serde_json::Value =
                serde_json::from_str(&run(&["queue", "status", "jobs"], b"", &list).0).unwrap();
            let stored: u64 = servers.iter().map(|s| status[&s.addr]["messages"].as_u64().unwrap()).sum();
            assert!(stored <= 6, "round {round}: {stored} stored for two keyed runs of three lines: {status}");
        }
    }
    // A third address where no server listens.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down = closed.local_addr().unwrap().to_string();
    drop(closed);
    let with_down = format!("{list},{down}");
    let (_, err) = run(&["produce", "fresh", "--create"], b"x\ny\n", &with_down);
    assert!(err.contains(&down), "the server down is named: {err}");
    let status: serde_json::Value = serde_json::from_str(&run(&["queue", "status", "fresh"], b"", &list).0).unwrap();
    let stored: u64 = servers.iter().map(|s| status[&s.addr]["messages"].as_u64().unwrap_or(0)).sum();
    assert_eq!(stored, 2, "{status}");
    // Consumed past the server down, which is named, and exit status 3 (a script draining the
    // queue is told).
    let out = petrel(&["consume", "fresh", "--ack", "--server", &with_down], b"");
    let (lines, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(lines.lines().count(), 2, "{lines}");
    assert!(err.contains("servers down") && err.contains(&down), "{err}");
    // A listing past the server down lists the others', names it, and exits 3 (it was exit 0
    // with a partial list).
    for kind in ["queue", "topic"] {
        let out = petrel(&[kind, "list", "--server", &with_down], b"");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{kind} list: {err}");
        assert!(err.contains("servers down") && err.contains(&down), "{err}");
    }
    let out = petrel(&["queue", "list", "--server", &with_down], b"");
    assert!(String::from_utf8_lossy(&out.stdout).lines().any(|l| l == "fresh"), "the others' queues are listed");
}

/// `--server A,B,C` on the client commands: a queue made on every server, lines offered across
/// them and all consumed, figures per server; a topic subscribed on all; a function served on all.
#[test]
fn client_commands_take_a_list_of_servers() {
    use common::{Server, petrel};
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..3).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    let list = servers.iter().map(|s| s.addr.as_str()).collect::<Vec<_>>().join(",");
    let run = |args: &[&str], stdin: &[u8]| {
        let out = petrel(&[args, &["--server", &list]].concat(), stdin);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    run(&["queue", "create", "jobs", "--durable"], b"");
    assert_eq!(run(&["queue", "list"], b""), "jobs\n");
    // Many producers (one command each) spread over the servers.
    let mut lines = Vec::new();
    for p in 0..12 {
        let input: String = (0..25).map(|i| format!("p{p}-{i}\n")).collect();
        run(&["produce", "jobs"], input.as_bytes());
        lines.extend(input.lines().map(str::to_owned));
    }
    let status: serde_json::Value = serde_json::from_str(&run(&["queue", "status", "jobs"], b"")).unwrap();
    let items: Vec<u64> = servers.iter().map(|s| status[&s.addr]["messages"].as_u64().unwrap()).collect();
    assert_eq!(items.iter().sum::<u64>(), 300, "{status}");
    assert!(
        items.iter().filter(|&&n| n > 0).count() >= 2,
        "offers from 12 producers all went to one server: {items:?}"
    );
    // `stat`: one table of the servers' sums.
    let stat: serde_json::Value = serde_json::from_str(&run(&["stat", "--once", "--json"], b"")).unwrap();
    assert_eq!(stat["queues"][0]["name"], "jobs", "{stat}");
    assert_eq!(stat["queues"][0]["messages"], 300, "{stat}");
    assert_eq!(stat["queues"][0]["offered"], 300, "{stat}");
    assert_eq!(stat["servers"].as_array().unwrap().len(), 3, "{stat}");
    assert!(stat["servers"].as_array().unwrap().iter().all(|s| s["up"] == true), "{stat}");
    let mut consumed: Vec<String> = run(&["consume", "jobs", "--ack"], b"").lines().map(str::to_owned).collect();
    consumed.sort();
    lines.sort();
    assert_eq!(consumed, lines);

    // A topic: one subscriber on every server sees what is published to any of them.
    run(&["topic", "create", "news"], b"");
    let subscriber = std::process::Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["topic", "subscribe", "news", "--count", "3", "--server", &list])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = subscriber.id();
    let reader = std::thread::spawn(move || subscriber.wait_with_output().unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    // Published until it has three (it may subscribe after the first ones).
    while !reader.is_finished() {
        assert!(Instant::now() < deadline, "the cluster subscriber (pid {pid}) got fewer than 3 messages");
        run(&["topic", "publish", "news"], b"hello\n");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = reader.join().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), "hello\nhello\nhello\n");

    // A durable topic read by a consumer group on every server: what was printed is
    // acknowledged on its own server, so the next run gets only what came after.
    run(&["topic", "create", "events", "--durable"], b"");
    let input: String = (0..6).map(|i| format!("e{i}\n")).collect();
    for line in input.lines() {
        run(&["topic", "publish", "events"], format!("{line}\n").as_bytes()); // each to the next server
    }
    let sorted = |text: String| {
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        lines.sort();
        lines
    };
    let first = run(&["topic", "subscribe", "events", "--group", "g", "--from", "oldest", "--count", "6"], b"");
    assert_eq!(sorted(first), (0..6).map(|i| format!("e{i}")).collect::<Vec<_>>());
    run(&["topic", "publish", "events"], b"e6\ne7\n");
    run(&["topic", "publish", "events"], b"e8\n");
    let second = run(&["topic", "subscribe", "events", "--group", "g", "--count", "3"], b"");
    assert_eq!(sorted(second), ["e6", "e7", "e8"], "the group resumed after what it acknowledged, on every server");
    let stat: serde_json::Value = serde_json::from_str(&run(&["stat", "--once", "--json"], b"")).unwrap();
    let events = stat["topics"].as_array().unwrap().iter().find(|t| t["name"] == "events").unwrap().clone();
    assert_eq!(events["published"], 9, "{events}");
    assert_eq!(events["groups"][0]["lag"], 0, "{events}");
    assert_eq!(events["groups"][0]["next_offset"], 9, "offsets summed over the servers' logs: {events}");

    // A function served on every server answers a call made to any.
    let mut replier = std::process::Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["reply", "ping", "--text", "pong", "--count", "5", "--server", &list])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut answered = 0;
    while answered < 5 {
        assert!(Instant::now() < deadline, "calls through the cluster were not answered");
        let out = petrel(&["call", "ping", "--data", "x", "--server", &list], b"");
        if out.status.success() {
            assert_eq!(String::from_utf8_lossy(&out.stdout), "pong\n");
            answered += 1;
        } else {
            std::thread::sleep(Duration::from_millis(50)); // not served yet
        }
    }
    assert!(replier.wait().unwrap().success());

    // A server down: `stat` shows the others' sums and names it.
    let mut servers = servers;
    let down = servers.pop().unwrap();
    let down_addr = down.addr.clone();
    down.kill9();
    let table = run(&["stat", "--once"], b"");
    assert!(table.starts_with("3 servers, 2 up"), "{table}");
    assert!(table.contains(&format!("down: {down_addr}")), "{table}");
    assert!(table.lines().any(|l| l.starts_with("jobs ")), "{table}");

    // A queue made while one server is down: made on the others, and the error says which.
    let out = petrel(&["queue", "create", "later", "--durable", "--server", &list], b"");
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    let done = format!("(done on {}, {})", servers[0].addr, servers[1].addr);
    assert!(said.contains(&down_addr) && said.contains(&done), "{said}");
    // Listed from the others, the server down named and the list said partial (exit 3).
    let out = petrel(&["queue", "list", "--server", &list], b"");
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&down_addr));
    assert!(String::from_utf8_lossy(&out.stdout).lines().any(|l| l == "later"));
}

/// `petrel reply` serves its function again after its server restarts: a client that only serves
/// sends nothing, and it used to learn of the loss never (every call answered FUNCTION_NOT_FOUND
/// until the replier was restarted too).
#[test]
fn petrel_reply_serves_again_after_its_server_restarts() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("s"));
    let addr = server.addr.clone();
    /// The replier, ended however the test ends (it serves until stopped).
    struct Replier(Child);
    impl Drop for Replier {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _replier = Replier(
        Command::new(env!("CARGO_BIN_EXE_petrel"))
            .args(["reply", "ping", "--text", "pong", "--server", &addr])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let answered = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let out = common::petrel(&["call", "ping", "--data", "x", "--server", &addr], b"");
            if out.status.success() {
                assert_eq!(String::from_utf8_lossy(&out.stdout), "pong\n");
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {}", String::from_utf8_lossy(&out.stderr));
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    answered("served at first");
    server.kill9();
    let _server = Server::start_at(&addr, &dir.path().join("s"));
    answered("served again after the restart");
}

/// A function the cluster serves that a server refuses to serve (its user has no right to serve
/// there) is named in that server's state with the refusal: when served, and as it stands after
/// the server comes back from a loss. It used to go unsaid (`serve` answered `Ok` for the others).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_refuses_to_serve_a_function_is_named_in_the_cluster_state() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users.toml");
    assert!(common::petrel(&["user", "add", users.to_str().unwrap(), "tom"], b"S3cret-tom\n").status.success());
    let security = format!("[security]\nusers_file = {users:?}\nallow_plaintext_auth = true\n");
    let may_serve =
        "[[security.acl]]\nkind = \"function\"\nname = \"upper\"\nuser = \"tom\"\naccess = \"exec-serve\"\n";
    let (allows, refuses) = (dir.path().join("allows.toml"), dir.path().join("refuses.toml"));
    std::fs::write(&allows, format!("{security}{may_serve}")).unwrap();
    std::fs::write(&refuses, &security).unwrap();
    let config = |file: &PathBuf| ["--config".to_owned(), file.to_str().unwrap().to_owned()];
    let start = |k: usize, file: &PathBuf| {
        let args = config(file);
        Server::start_with(&dir.path().join(format!("s{k}")), &[&args[0], &args[1]])
    };
    let mut servers = vec![start(0, &allows), start(1, &refuses)];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let mut options = ClusterOptions::default();
    options.client.user = Some("tom".into());
    options.client.password = Some("S3cret-tom".into());
    let cluster = Cluster::connect(&addrs, options).await.unwrap();
    cluster.serve("upper", |m| async move { Ok(Message::new(m.payload.to_ascii_uppercase())) }).await.unwrap();
    let unserved = |cluster: &Cluster, k: usize| cluster.stats().servers[k].unserved.clone();
    assert!(unserved(&cluster, 0).is_empty());
    let refused = unserved(&cluster, 1);
    assert!(refused.len() == 1 && refused[0].0 == "upper" && refused[0].1.contains("FORBIDDEN"), "{refused:?}");

    // Each server comes back with the other's rules: the state follows.
    for (k, file) in [(1, &allows), (0, &refuses)] {
        let failures = cluster.stats().servers[k].failures;
        servers.remove(k).kill9();
        let args = config(file);
        servers.insert(k, Server::start_at_with(&addrs[k], &dir.path().join(format!("s{k}")), &[&args[0], &args[1]]));
        common::wait_until_async("the server to come back", || async {
            let state = &cluster.stats().servers[k];
            state.up && state.failures > failures
        })
        .await;
    }
    assert!(unserved(&cluster, 1).is_empty(), "{:?}", unserved(&cluster, 1));
    let refused = unserved(&cluster, 0);
    assert!(refused.len() == 1 && refused[0].0 == "upper" && refused[0].1.contains("FORBIDDEN"), "{refused:?}");
    let reply = cluster.call("upper", Message::new(&b"served on 1"[..]), Some(Duration::from_secs(5))).await.unwrap();
    assert_eq!(&reply.payload[..], b"SERVED ON 1");
}

/// A poll of a queue no server has is an error, as on one server; one that only some servers
/// have is read from those, waiting without asking the others again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_missing_on_some_servers() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..2).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    let addrs: Vec<&str> = servers.iter().map(|s| s.addr.as_str()).collect();
    let cluster = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let options = PollOptions { max: 10, timeout: Duration::from_millis(300), visibility: None };
    let e = cluster.poll("nowhere", options).await.unwrap_err();
    assert_eq!(e.status(), Some(petrel_client::Status::QueueNotFound), "{e}");

    servers[1].client().await.create_queue("half", QueueConfig::default()).await.unwrap();
    let began = Instant::now();
    assert!(cluster.poll("half", options).await.unwrap().is_empty());
    assert!(began.elapsed() >= Duration::from_millis(250), "the poll did not wait");
    assert!(servers[0].client().await.queue_status("half").await.is_err(), "server 0 has no such queue");
    let waiting = {
        let cluster = cluster.clone();
        tokio::spawn(
            async move { cluster.poll("half", PollOptions { timeout: Duration::from_secs(5), ..options }).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    servers[1].client().await.offer("half", vec![Message::new(&b"late"[..])], None).await.unwrap();
    let got = waiting.await.unwrap().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(&got[0].message.payload[..], b"late");
    assert_eq!(got[0].handle.server, 1);
}

/// A function the cluster could serve nowhere (every server down) is not served when a server
/// comes back: the `Err` said it was not served (the handler stayed registered, and each retry
/// registered it once more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_refused_everywhere_is_not_served_when_a_server_comes_back() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let addr = Server::free_addr();
    let server = Server::start_at(&addr, &dir.path().join("s"));
    let options = ClusterOptions { first_pause: Duration::from_millis(20), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&[addr.as_str()], options).await.unwrap();
    server.kill9();
    common::wait_until_async("the server seen down", || async {
        cluster.serve("f", |m| async move { Ok(m) }).await.is_err()
    })
    .await;
    let server = Server::start_at(&addr, &dir.path().join("s"));
    common::wait_until_async("the cluster back", || async { cluster.list_queues().await.is_ok() }).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let caller = server.client().await;
    let called = caller.call("f", Message::new(&b"x"[..]), Some(Duration::from_secs(2))).await;
    assert_eq!(called.unwrap_err().status(), Some(petrel_client::Status::FunctionNotFound));
}

/// A handle from a cluster of more servers counts for nothing in a smaller one, as a lost
/// connection's does (the smaller cluster indexed its servers with it, and panicked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_of_a_server_the_cluster_does_not_have_counts_for_nothing() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..2).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    let addrs: Vec<&str> = servers.iter().map(|s| s.addr.as_str()).collect();
    let both = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let first = Cluster::connect(&addrs[..1], ClusterOptions::default()).await.unwrap();
    let second = servers[1].client().await;
    second.create_queue("q", QueueConfig::default()).await.unwrap();
    second.offer("q", vec![Message::new(&b"m"[..])], None).await.unwrap();
    let options = PollOptions { max: 1, timeout: Duration::from_secs(5), visibility: Some(Duration::from_secs(60)) };
    let got = both.poll("q", options).await.unwrap();
    assert_eq!(got[0].handle.server, 1);
    assert_eq!(first.ack("q", &[got[0].handle]).await.unwrap(), 0);
    assert_eq!(both.ack("q", &[got[0].handle]).await.unwrap(), 1);
}

/// A server that accepts connections and never answers (stopped, say) does not stop the cluster
/// from connecting; keyed offers stay on one server; an abort returns a message to its server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_offers_aborts_and_a_silent_server_at_connect() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..2).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    // Its backlog accepts the connection; nobody ever reads HELLO.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let addrs = [servers[0].addr.as_str(), servers[1].addr.as_str(), silent_addr.as_str()];
    let cluster = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let stats = cluster.stats();
    assert!(stats.servers[0].up && stats.servers[1].up && !stats.servers[2].up, "{:?}", stats.servers);
    // Made on every server that is up; the error names the one that is not.
    let e = cluster.create_queue("jobs", QueueConfig::default()).await.unwrap_err();
    assert!(e.to_string().contains(&silent_addr), "{e}");
    assert_eq!(cluster.list_queues().await.unwrap(), ["jobs"]);

    let mut chosen = HashMap::new();
    // 40 keys, each twice: all on one of the two servers has a chance of 2⁻³⁹ (with 8 it was
    // 1 in 128, as the servers' ports are random).
    for k in 0..80 {
        let key = format!("customer-{}", k % 40);
        let offered =
            cluster.offer_by_key(key.as_bytes(), "jobs", vec![Message::new(key.clone())], None).await.unwrap();
        assert_eq!(*chosen.entry(key).or_insert(offered.server), offered.server, "a key stays on its server");
    }
    assert!(chosen.values().collect::<HashSet<_>>().len() == 2, "40 keys all on one server: {chosen:?}");

    let options = PollOptions { max: 1, timeout: Duration::from_secs(1), visibility: Some(Duration::from_secs(30)) };
    let taken = cluster.poll("jobs", options).await.unwrap();
    let server = taken[0].handle.server;
    let before = servers[server].client().await.queue_status("jobs").await.unwrap();
    assert_eq!(cluster.abort("jobs", &[taken[0].handle], Duration::ZERO).await.unwrap(), 1);
    let after = servers[server].client().await.queue_status("jobs").await.unwrap();
    assert_eq!((after.items, after.in_flight), (before.items + 1, before.in_flight - 1));
    drop(silent);
}

/// A poll that takes for good (no visibility timeout) loses nothing the cluster took beyond
/// what it handed over: what it kept for the next polls goes back to its queue when the
/// process goes away, and what it handed over does not come again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_poll_for_good_took_beyond_its_answer_is_not_lost() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..3).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    for s in &servers {
        let c = s.client().await;
        c.create_queue("jobs", QueueConfig::default()).await.unwrap();
        c.offer("jobs", (0..5).map(|i| Message::new(format!("j{i}").into_bytes())).collect(), None).await.unwrap();
    }
    let addrs: Vec<&str> = servers.iter().map(|s| s.addr.as_str()).collect();
    let cluster = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let options = PollOptions { max: 1, timeout: Duration::ZERO, visibility: None };
    let got = cluster.poll("jobs", options).await.unwrap();
    assert_eq!(got.len(), 1);
    drop(cluster); // the process ends, say, with what the cluster kept for later
    let mut left = 0;
    for s in &servers {
        let c = s.client().await;
        for _ in 0..100 {
            let status = c.queue_status("jobs").await.unwrap();
            if status.in_flight == 0 {
                left += status.items;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(left, 14, "all but the one handed over are in their queues again");
}

/// A cluster of one server waits for room as long as the offer says (the server waits, and its
/// answer is waited for as long), and does not take the wait for a dead server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_waits_for_room_as_long_as_the_offer_says() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("s"));
    let direct = server.client().await;
    direct.create_queue("full", QueueConfig { max_items: 1, ..QueueConfig::default() }).await.unwrap();
    direct.offer("full", vec![Message::new(&b"first"[..])], None).await.unwrap();
    let cluster = Cluster::connect(&[server.addr.as_str()], ClusterOptions::default()).await.unwrap();
    let offering = {
        let cluster = cluster.clone();
        tokio::spawn(async move {
            cluster.offer("full", vec![Message::new(&b"second"[..])], Some(Duration::from_secs(5))).await
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await; // longer than the request timeout
    let taken = direct.poll("full", PollOptions { max: 1, timeout: Duration::ZERO, visibility: None }).await.unwrap();
    assert_eq!(&taken[0].message.payload[..], b"first");
    offering.await.unwrap().expect("offered once room came");
    assert!(cluster.stats().servers.iter().all(|s| s.up), "the server was not taken for down");
}

/// A cluster subscriber that fell behind on one server is told (SLOW_CONSUMER) and follows that
/// server again from then on, rather than lose it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_subscriber_that_fell_behind_is_told_and_goes_on() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("s"));
    let publisher = server.client().await;
    publisher.create_topic("ticks", false).await.unwrap();
    let cluster = Cluster::connect(&[server.addr.as_str()], ClusterOptions::default()).await.unwrap();
    let mut sub = cluster.subscribe("ticks", 16).await.unwrap();
    for chunk in 0..10 {
        publisher
            .publish("ticks", (0..500).map(|i| Message::new(format!("t{}", chunk * 500 + i))).collect())
            .await
            .unwrap();
    }
    // It read nothing meanwhile: a prefix, then the notice.
    let notice = loop {
        match tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("an item").expect("not ended") {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert_eq!(notice.status(), Some(petrel_client::Status::SlowConsumer), "{notice}");
    // Followed again: what is published from now on arrives.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        publisher.publish("ticks", vec![Message::new(&b"after"[..])]).await.unwrap();
        match tokio::time::timeout(Duration::from_millis(200), sub.next()).await {
            Ok(Some(Ok(m))) if &m.payload[..] == b"after" => break,
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => panic!("the subscription ended"),
        }
        assert!(Instant::now() < deadline, "nothing after the notice");
    }
}

/// A live topic is gone from a server that restarts: the cluster subscription says so once and
/// looks for it again, and follows it there once it is made again (the server's part ended
/// for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_subscription_follows_a_live_topic_made_again_after_a_restart() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let addr = Server::free_addr();
    let server = Server::start_at(&addr, &dir.path().join("s"));
    server.client().await.create_topic("news", false).await.unwrap();
    let options = ClusterOptions { max_pause: Duration::from_millis(200), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&[addr.as_str()], options).await.unwrap();
    let mut sub = cluster.subscribe("news", 16).await.unwrap();
    server.kill9();
    let server = Server::start_at(&addr, &dir.path().join("s"));
    let publisher = server.client().await;
    let said = tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("told").expect("not ended");
    assert_eq!(said.unwrap_err().status(), Some(petrel_client::Status::TopicNotFound));
    publisher.create_topic("news", false).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        publisher.publish("news", vec![Message::new(&b"again"[..])]).await.unwrap();
        match tokio::time::timeout(Duration::from_millis(200), sub.next()).await {
            Ok(Some(Ok(m))) if &m.payload[..] == b"again" => break,
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => panic!("the subscription ended"),
        }
        assert!(Instant::now() < deadline, "not followed again");
    }
}

/// A server at its connection limit (LIMIT_REACHED to HELLO) is a server down, not a setting to
/// fix: the cluster connects to the others (it failed whole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_at_its_connection_limit_is_down_not_fatal() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("one.toml");
    std::fs::write(&config, "max_connections = 1\n").unwrap();
    let full = Server::start_with(&dir.path().join("s0"), &["--config", config.to_str().unwrap()]);
    let free = Server::start(&dir.path().join("s1"));
    let _holding = full.client().await;
    let addrs = [full.addr.as_str(), free.addr.as_str()];
    let cluster = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let stats = cluster.stats();
    assert!(!stats.servers[0].up && stats.servers[1].up, "{:?}", stats.servers);
    cluster.create_queue("q", QueueConfig::default()).await.unwrap_err(); // (made on the one up)
    assert_eq!(cluster.list_queues().await.unwrap(), ["q"]);
}

/// Two servers, each with queue "q" (`max_deliveries = 1`, dead letters to "dlq") holding two
/// messages.
async fn limited_pair(dir: &std::path::Path) -> Vec<common::Server> {
    let servers: Vec<common::Server> = (0..2).map(|k| common::Server::start(&dir.join(format!("s{k}")))).collect();
    let limited = QueueConfig { max_deliveries: 1, dead_letter: "dlq".into(), ..QueueConfig::default() };
    for s in &servers {
        let c = s.client().await;
        c.create_queue("dlq", QueueConfig::default()).await.unwrap();
        c.create_queue("q", limited.clone()).await.unwrap();
        c.offer("q", vec![Message::new("a"), Message::new("b")], None).await.unwrap();
    }
    servers
}

/// The messages in "q" and in "dlq" on all of `servers`.
async fn left_and_dead(servers: &[common::Server]) -> (u64, u64) {
    let (mut left, mut dead) = (0, 0);
    for s in servers {
        let c = s.client().await;
        left += c.queue_status("q").await.unwrap().items;
        dead += c.queue_status("dlq").await.unwrap().items;
    }
    (left, dead)
}

/// Messages a cluster poll took beyond what its caller asked for, kept for later polls, go back
/// unseen when the cluster ends: `consume --count 1` on two servers with `max_deliveries = 1`
/// dead-lettered the message it kept (its connection's end counted it as a delivery).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_kept_for_later_polls_go_back_unseen_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let servers = limited_pair(dir.path()).await;
    let list = format!("{},{}", servers[0].addr, servers[1].addr);
    let out = common::petrel(&["consume", "q", "--count", "1", "--server", &list], b"");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    let (left, dead) = left_and_dead(&servers).await;
    assert_eq!((left, dead), (3, 0), "the one printed is gone; the one kept is back, not dead-lettered");
}

/// A message a cluster poll kept for later polls goes back unseen at half its visibility even
/// if no poll of its queue comes: before, it waited for one, and its server took it back at its
/// timeout as delivered — with `max_deliveries = 1`, into the dead-letter queue unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_kept_for_later_polls_goes_back_unseen_when_no_poll_comes() {
    let dir = tempfile::tempdir().unwrap();
    let servers = limited_pair(dir.path()).await;
    let addrs: Vec<&str> = servers.iter().map(|s| s.addr.as_str()).collect();
    let cluster = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let options = PollOptions { max: 1, timeout: Duration::ZERO, visibility: Some(Duration::from_secs(1)) };
    let got = cluster.poll("q", options).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(cluster.ack("q", &[got[0].handle]).await.unwrap(), 1);
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (left, dead) = left_and_dead(&servers).await;
    assert_eq!((left, dead), (3, 0), "the kept one is back in its queue, not dead-lettered");
}

/// Offers and publishes made in turn each go round the servers on their own: with one counter
/// for both, on two servers every offer went to the same one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offers_between_publishes_still_go_round_the_servers() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..2).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    for s in &servers {
        let c = s.client().await;
        c.create_queue("q", QueueConfig::default()).await.unwrap();
        c.create_topic("t", false).await.unwrap();
    }
    let addrs: Vec<&str> = servers.iter().map(|s| s.addr.as_str()).collect();
    let cluster = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let mut offered_to = HashSet::new();
    for _ in 0..10 {
        offered_to.insert(cluster.offer("q", vec![Message::new("m")], None).await.unwrap().server);
        cluster.publish("t", vec![Message::new("p")]).await.unwrap();
    }
    assert_eq!(offered_to.len(), 2, "offers went to {offered_to:?}");
}

/// A cluster group subscription whose part on one server ended (its topic removed there) still
/// acknowledges the other servers' messages: before, the ended part's acknowledgement failed the
/// whole call, and, the servers taken in no set order, the others' were often never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_ack_goes_on_past_a_server_whose_part_ended() {
    use common::Server;
    let dir = tempfile::tempdir().unwrap();
    let servers: Vec<Server> = (0..2).map(|k| Server::start(&dir.path().join(format!("s{k}")))).collect();
    for s in &servers {
        s.client().await.create_topic("t", true).await.unwrap();
    }
    let addrs: Vec<&str> = servers.iter().map(|s| s.addr.as_str()).collect();
    let cluster = Cluster::connect(&addrs, ClusterOptions::default()).await.unwrap();
    let mut sub = cluster.subscribe_group("t", "g", petrel_client::StartFrom::Oldest, 100).await.unwrap();
    for s in &servers {
        s.client().await.publish("t", vec![Message::new("m")]).await.unwrap();
    }
    let mut handles = Vec::new();
    while handles.len() < 2 {
        let next = tokio::time::timeout(Duration::from_secs(10), sub.next_delivery()).await;
        handles.push(next.expect("a delivery").expect("the subscription goes on").unwrap().handle);
    }
    servers[0].client().await.remove_topic("t").await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), sub.next_delivery()).await;
    assert!(ended.expect("server 0's part says it ended").expect("the subscription goes on").is_err());
    assert_eq!(sub.ack(&handles).await.unwrap(), 1, "server 1's message acknowledged");
}
