//! The memcache port of the real `petrel serve`, over raw sockets: every malformed input gets its
//! error line and harms nobody else; items cross between the memcache and native protocols; and
//! items set or left open survive a `kill -9`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use petrel_client::{Message, PollOptions};

mod common;
use common::Server;

/// Kestrel's per-queue `stats` names, in its order.
const KESTREL_QUEUE_STATS: [&str; 16] = [
    "items",
    "bytes",
    "total_items",
    "logsize",
    "expired_items",
    "mem_items",
    "mem_bytes",
    "age",
    "discarded",
    "waiters",
    "open_transactions",
    "transactions",
    "canceled_transactions",
    "total_flushes",
    "journal_rewrites",
    "journal_rotations",
];

/// A raw memcache connection.
struct Conn(TcpStream);

impl Conn {
    fn open(server: &Server) -> Conn {
        let s = TcpStream::connect(&server.memcache).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Conn(s)
    }

    fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).unwrap();
    }

    /// Reads until the answer ends with `end` (or the server closes).
    fn until(&mut self, end: &[u8]) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 65536];
        while !got.ends_with(end) {
            match self.0.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => panic!("reading after {:?}: {e}", String::from_utf8_lossy(&got)),
            }
        }
        got
    }

    fn ask(&mut self, request: &[u8], end: &[u8]) -> String {
        self.send(request);
        String::from_utf8_lossy(&self.until(end)).into_owned()
    }

    /// True if the server closed the connection (reads EOF).
    fn closed(&mut self) -> bool {
        let mut buf = [0u8; 64];
        matches!(self.0.read(&mut buf), Ok(0) | Err(_))
    }
}

#[test]
fn malformed_input_gets_an_error_line_and_never_hurts_other_clients() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", &small_limits(dir.path())]);
    let mut bystander = Conn::open(&server);
    assert_eq!(bystander.ask(b"set calm 0 0 2\r\nok\r\n", b"\r\n"), "STORED\r\n");

    // (request, expected answer, whether the connection is closed after it)
    let cases: &[(&[u8], &str, bool)] = &[
        (b"frobnicate\r\n", "ERROR\r\n", false),
        (b"\r\n", "ERROR\r\n", false),
        (b"get\r\n", "CLIENT_ERROR get needs a key\r\n", false),
        (b"get q/opne\r\n", "CLIENT_ERROR unknown option \"opne\"\r\n", false),
        (b"set bad/name 0 0 1\r\nx\r\n", "CLIENT_ERROR bad queue name\r\n", false),
        (b"set q abc 0 1\r\nx\r\n", "CLIENT_ERROR bad flags\r\n", false),
        (b"set q 0 soon 1\r\nx\r\n", "CLIENT_ERROR bad exptime\r\n", false),
        (b"add q 0 0 1\r\nx\r\n", "CLIENT_ERROR add is not supported by a queue; use set\r\n", false),
        (b"delete\r\n", "CLIENT_ERROR delete needs a queue name\r\n", false),
        (b"shutdown\r\n", "CLIENT_ERROR shutdown is disabled (memcache_shutdown = true enables it)\r\n", false),
        (b"set q 0 0\r\n", "CLIENT_ERROR bad command line format\r\n", true),
        (b"set q 0 0 many\r\n", "CLIENT_ERROR bad data chunk\r\n", true),
        (b"set q 0 0 -5\r\n", "CLIENT_ERROR bad data chunk\r\n", true),
        (b"set q 0 0 2\r\nabcdef\r\n", "CLIENT_ERROR bad data chunk\r\n", true),
        (b"get /open\r\n", "CLIENT_ERROR empty queue name\r\n", true),
        (b"get q/open/peek\r\n", "CLIENT_ERROR conflicting options\r\n", true),
        (b"get q/abort/open\r\n", "CLIENT_ERROR conflicting options\r\n", true),
        (b"get q/t=later\r\n", "CLIENT_ERROR bad timeout\r\n", true),
        (b"quit\r\n", "", true),
    ];
    for &(request, answer, closes) in cases {
        let mut c = Conn::open(&server);
        let got = c.ask(request, b"\r\n");
        assert_eq!(got, answer, "answer to {:?}", String::from_utf8_lossy(request));
        if closes {
            assert!(c.closed(), "{:?} closes the connection", String::from_utf8_lossy(request));
        } else {
            assert_eq!(c.ask(b"version\r\n", b"\r\n"), "VERSION 0.1.0\r\n", "still usable");
        }
    }

    // A line longer than the limit closes that connection.
    let mut c = Conn::open(&server);
    let mut long = b"get ".to_vec();
    long.extend(vec![b'x'; 4000]);
    c.send(&long);
    assert_eq!(String::from_utf8_lossy(&c.until(b"\r\n")), "CLIENT_ERROR line too long\r\n");
    assert!(c.closed());

    // An item over the server's limit (64 KiB here) is read, thrown away and refused; the
    // connection stays in step.
    let mut c = Conn::open(&server);
    let mut big = b"set q 0 0 100000\r\n".to_vec();
    big.extend(vec![b'z'; 100_000]);
    big.extend_from_slice(b"\r\nset q 0 0 5\r\nsmall\r\n");
    c.send(&big);
    assert_eq!(
        String::from_utf8_lossy(&c.until(b"STORED\r\n")),
        "SERVER_ERROR object too large for cache\r\nSTORED\r\n"
    );
    // An item of exactly the limit with flags (kept beside it, a few bytes more): the same
    // answer as over the limit, not NOT_STORED.
    let exactly = [b"set q 16 0 65536\r\n".as_slice(), &[b'w'; 65536], b"\r\n"].concat();
    assert_eq!(c.ask(&exactly, b"\r\n"), "SERVER_ERROR object too large for cache\r\n");
    // Over the queue's own max_item_size (100 bytes for `tiny`): NOT_STORED, as Kestrel.
    assert_eq!(c.ask(&[b"set tiny 0 0 101\r\n".as_slice(), &[b'y'; 101], b"\r\n"].concat(), b"\r\n"), "NOT_STORED\r\n");
    assert_eq!(c.ask(b"get q\r\n", b"END\r\n"), "VALUE q 0 5\r\nsmall\r\nEND\r\n");

    // Random bytes: whatever the answers, the server stays up and the bystander unharmed.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..50 {
        let mut c = Conn::open(&server);
        let junk: Vec<u8> = (0..512)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 24) as u8
            })
            .collect();
        let _ = c.0.write_all(&junk);
    }
    assert_eq!(bystander.ask(b"get calm\r\n", b"END\r\n"), "VALUE calm 0 2\r\nok\r\nEND\r\n");
    assert_eq!(bystander.ask(b"get q\r\n", b"END\r\n"), "END\r\n", "no junk was stored as an item of q");
}

fn small_limits(dir: &std::path::Path) -> String {
    let path = dir.join("petrel.toml");
    std::fs::write(&path, "max_message_bytes = 65536\nmax_frame_bytes = 1048576\n[queues.tiny]\nmax_item_size = 100\n")
        .unwrap();
    path.to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_cross_between_the_memcache_and_native_protocols() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let mut mc = Conn::open(&server);
    assert_eq!(mc.ask(b"set shared 7 0 9\r\nfrom text\r\n", b"\r\n"), "STORED\r\n");
    let native = server.client().await;
    let take = PollOptions { max: 10, timeout: Duration::from_secs(1), visibility: None };
    let got = native.poll("shared", take).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(&got[0].message.payload[..], b"from text");
    let flags = got[0].message.headers.iter().find(|(n, _)| n == "memcache-flags").map(|(_, v)| v.to_vec());
    assert_eq!(flags.as_deref(), Some(&b"7"[..]), "memcache flags travel as a header");

    native.offer("shared", vec![Message::new(b"from binary".to_vec())], None).await.unwrap();
    assert_eq!(mc.ask(b"get shared\r\n", b"END\r\n"), "VALUE shared 0 11\r\nfrom binary\r\nEND\r\n");
    // A waiting memcache get is woken by a native offer (made once the get is parked).
    let offer = tokio::spawn(async move {
        common::wait_until_async("the memcache get to wait", || async {
            native.queue_status("shared").await.unwrap().waiters == 1
        })
        .await;
        native.offer("shared", vec![Message::new(b"late".to_vec())], None).await.unwrap();
    });
    let started = Instant::now();
    let got = tokio::task::spawn_blocking(move || mc.ask(b"get shared/t=5000\r\n", b"END\r\n")).await.unwrap();
    assert_eq!(got, "VALUE shared/t=5000 0 4\r\nlate\r\nEND\r\n");
    assert!(started.elapsed() < Duration::from_secs(4));
    offer.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_gets_are_served_oldest_first_and_a_batch_reaches_as_many_waiters() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let native = server.client().await;
    let waiters = |n: u64| {
        let native = &native;
        async move {
            common::wait_until_async(&format!("{n} gets to wait"), || async {
                native.queue_status("line").await.unwrap().waiters == n
            })
            .await
        }
    };
    let mut maker = Conn::open(&server);
    assert_eq!(maker.ask(b"get line\r\n", b"END\r\n"), "END\r\n", "the queue is made by its first use");
    // Six gets wait, each counted before the next one asks: their order is known.
    let mut line = Vec::new();
    for i in 0..6 {
        let mut c = Conn::open(&server);
        c.0.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        c.send(b"get line/t=30000\r\n");
        waiters(i + 1).await;
        line.push(c);
    }
    // One message at a time: each goes to the get that has waited longest. (All were woken for
    // each before, and which one won was the scheduler's choice.)
    for (i, mut c) in line.drain(..3).enumerate() {
        native.offer("line", vec![Message::new(format!("m{i}").into_bytes())], None).await.unwrap();
        waiters(5 - i as u64).await;
        let got = tokio::task::spawn_blocking(move || String::from_utf8_lossy(&c.until(b"END\r\n")).into_owned());
        assert_eq!(got.await.unwrap(), format!("VALUE line/t=30000 0 2\r\nm{i}\r\nEND\r\n"), "waiter {i}");
    }
    // Three messages in one offer reach the three left, in their order.
    let batch = (3..6).map(|i| Message::new(format!("m{i}").into_bytes())).collect();
    native.offer("line", batch, None).await.unwrap();
    for (i, mut c) in line.into_iter().enumerate().map(|(i, c)| (i + 3, c)) {
        let got = tokio::task::spawn_blocking(move || String::from_utf8_lossy(&c.until(b"END\r\n")).into_owned());
        assert_eq!(got.await.unwrap(), format!("VALUE line/t=30000 0 2\r\nm{i}\r\nEND\r\n"), "waiter {i}");
    }
    waiters(0).await;
}

#[test]
fn items_set_and_items_left_open_survive_kill_9_and_fanout_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data);
    let mut c = Conn::open(&server);
    assert_eq!(c.ask(b"get jobs+copy\r\n", b"END\r\n"), "END\r\n", "creates the fanout child");
    let n = 200;
    let mut pipeline = Vec::new();
    for i in 0..n {
        let item = format!("item-{i:04}");
        pipeline.extend_from_slice(format!("set jobs 0 0 {}\r\n{item}\r\n", item.len()).as_bytes());
    }
    c.send(&pipeline);
    let stored = c.until(&b"STORED\r\n".repeat(n));
    assert_eq!(stored.len(), n * 8);
    // Two items open on two connections, neither confirmed, then the server dies.
    let mut reader_a = Conn::open(&server);
    let mut reader_b = Conn::open(&server);
    assert_eq!(reader_a.ask(b"get jobs/open\r\n", b"END\r\n"), "VALUE jobs/open 0 9\r\nitem-0000\r\nEND\r\n");
    assert_eq!(reader_b.ask(b"get jobs/open\r\n", b"END\r\n"), "VALUE jobs/open 0 9\r\nitem-0001\r\nEND\r\n");
    assert_eq!(c.ask(b"get jobs\r\n", b"END\r\n"), "VALUE jobs 0 9\r\nitem-0002\r\nEND\r\n", "taken for good");
    server.kill9();

    let server = Server::start(&data);
    let mut c = Conn::open(&server);
    let mut got = Vec::new();
    loop {
        let answer = c.ask(b"get jobs\r\n", b"END\r\n");
        let Some(value) = answer.strip_prefix("VALUE jobs 0 9\r\n") else {
            assert_eq!(answer, "END\r\n");
            break;
        };
        got.push(value[..9].to_owned());
    }
    let mut want: Vec<String> = (0..n).filter(|&i| i != 2).map(|i| format!("item-{i:04}")).collect();
    want.sort();
    assert_eq!(got[..2], ["item-0000", "item-0001"], "the open items are back at the head");
    let mut sorted = got.clone();
    sorted.sort();
    assert_eq!(sorted, want, "every acknowledged item, once");
    // The child received every copy before the crash and keeps receiving after it.
    assert_eq!(c.ask(b"set jobs 0 0 5\r\nafter\r\n", b"\r\n"), "STORED\r\n");
    let mut copies = 0;
    while c.ask(b"get jobs+copy\r\n", b"END\r\n") != "END\r\n" {
        copies += 1;
    }
    assert_eq!(copies, n + 1);
}

#[test]
fn sets_to_queues_that_sync_each_offer_are_got_at_once_and_survive_kill_9_fanout_copies_too() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start_with(&data, &["--durability", "always"]);
    let mut c = Conn::open(&server);
    assert_eq!(c.ask(b"get jobs+copy\r\n", b"END\r\n"), "END\r\n", "creates the fanout child");
    let n = 50;
    let mut pipeline = Vec::new();
    for i in 0..n {
        pipeline.extend_from_slice(format!("set jobs 0 0 9\r\nitem-{i:04}\r\n").as_bytes());
    }
    c.send(&pipeline);
    assert_eq!(c.until(&b"STORED\r\n".repeat(n)).len(), n * 8);
    // STORED means on disk and visible: a get right after it finds the item.
    assert_eq!(c.ask(b"get jobs\r\n", b"END\r\n"), "VALUE jobs 0 9\r\nitem-0000\r\nEND\r\n");
    server.kill9();

    let server = Server::start_with(&data, &["--durability", "always"]);
    let mut c = Conn::open(&server);
    for (queue, first) in [("jobs", 1), ("jobs+copy", 0)] {
        for i in first..n {
            let want = format!("VALUE {queue} 0 9\r\nitem-{i:04}\r\nEND\r\n");
            assert_eq!(c.ask(format!("get {queue}\r\n").as_bytes(), b"END\r\n"), want);
        }
        assert_eq!(c.ask(format!("get {queue}\r\n").as_bytes(), b"END\r\n"), "END\r\n");
    }
}

#[test]
fn shutdown_over_memcache_stops_the_server_only_when_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "memcache_shutdown = true\n").unwrap();
    let mut server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let mut c = Conn::open(&server);
    assert_eq!(c.ask(b"set kept 0 0 1\r\nk\r\n", b"\r\n"), "STORED\r\n");
    c.send(b"shutdown\r\n");
    assert!(c.closed());
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let server = Server::start(&dir.path().join("data"));
    let mut c = Conn::open(&server);
    assert_eq!(c.ask(b"get kept\r\n", b"END\r\n"), "VALUE kept 0 1\r\nk\r\nEND\r\n");
}

/// A stop that ends a waiting get gives the client that then stops reading the shutdown's grace,
/// not its idle timeout: the answers to the requests read behind the get wait for it no longer.
/// (The get saw the stop, and the flushes after it waited for a change already seen: the
/// server waited for that client for the idle timeout, 10 minutes.)
#[test]
fn a_stop_ending_a_waiting_get_does_not_wait_on_a_client_that_stopped_reading() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "shutdown_grace = \"1s\"\n").unwrap();
    let mut server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let mut c = Conn::open(&server);
    let item = vec![b'x'; 1 << 20];
    let mut set = format!("set big 0 0 {}\r\n", item.len()).into_bytes();
    set.extend_from_slice(&item);
    set.extend_from_slice(b"\r\n");
    assert_eq!(c.ask(&set, b"\r\n"), "STORED\r\n");
    // A waiting get, then peeks of the megabyte, read ahead while the get waits; nothing read.
    let mut stalled = Conn::open(&server);
    rustix::net::sockopt::set_socket_recv_buffer_size(&stalled.0, 4096).unwrap();
    let mut requests = b"get empty/t=600000\r\n".to_vec();
    for _ in 0..1000 {
        requests.extend_from_slice(b"get big/peek\r\n");
    }
    stalled.send(&requests);
    std::thread::sleep(Duration::from_millis(300));
    let stopping = Instant::now();
    std::process::Command::new("kill").args(["-TERM", &server.child.id().to_string()]).status().unwrap();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(stopping.elapsed() < Duration::from_secs(20), "still running {:?} after the stop", stopping.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    drop(stalled);
}

/// Making a queue on its first use is file-system work (milliseconds on a busy disk). It must not
/// hold up connections that want something else, even while more connections than the server has
/// threads name the queue being made. Here the making is held for as long as the test likes: the
/// definition's temporary file is a named pipe, whose opening for writing waits for a reader.
/// (With the server's default durability, `none`, nothing syncs that file before it is renamed.)
#[test]
fn a_queue_made_on_first_use_holds_up_no_other_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let mut other = Conn::open(&server);
    assert_eq!(other.ask(b"set ready 0 0 1\r\nr\r\n", b"\r\n"), "STORED\r\n");
    let slow = dir.path().join("queues/slow");
    std::fs::create_dir_all(&slow).unwrap();
    let pipe = slow.join("queue.json.tmp");
    assert!(std::process::Command::new("mkfifo").arg(&pipe).status().unwrap().success());

    // More namers than the server has runtime threads (one per core): each could hold one.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut namers: Vec<Conn> = (0..cores.max(7) + 1).map(|_| Conn::open(&server)).collect();
    for (i, namer) in namers.iter_mut().enumerate() {
        namer.send(format!("set slow 0 0 1\r\n{i}\r\n").as_bytes());
    }
    // For a second, while the making waits: the other connection is answered at once each time
    // (the read times out after 10 s: the answer would only come once the making ends).
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        let version = other.ask(b"version\r\n", b"\r\n");
        // Three integers, as libmemcached and other clients parse a server's version.
        let numbers = version.strip_prefix("VERSION ").and_then(|v| v.strip_suffix("\r\n")).unwrap_or("");
        assert!(numbers.split('.').map(str::parse::<u8>).filter(Result::is_ok).count() == 3, "{version:?}");
        assert_eq!(other.ask(b"set ready 0 0 1\r\nr\r\n", b"\r\n"), "STORED\r\n");
        assert_eq!(other.ask(b"get ready\r\n", b"END\r\n"), "VALUE ready 0 1\r\nr\r\nEND\r\n");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The namers are still waiting for the queue: none has been answered.
    for namer in &mut namers {
        namer.0.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 16];
        let read = namer.0.read(&mut buf);
        assert!(matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock), "answered early: {read:?}");
        namer.0.set_nonblocking(false).unwrap();
    }

    // The making goes on once the pipe has a reader, and every namer's item is stored, once.
    // (Read on a thread of its own, so that a server that never opens the pipe fails the test
    // instead of hanging it.)
    let (read_tx, read_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut definition = String::new();
        let read = std::fs::File::open(&pipe).and_then(|mut f| f.read_to_string(&mut definition));
        let _ = read_tx.send(read.map(|_| definition));
    });
    let definition = read_rx.recv_timeout(Duration::from_secs(10)).expect("the making never wrote its definition");
    assert!(definition.unwrap().contains("\"slow\""));
    for namer in &mut namers {
        assert_eq!(namer.until(b"\r\n"), b"STORED\r\n");
    }
    let mut items: Vec<String> = (0..namers.len())
        .map(|_| {
            let got = other.ask(b"get slow\r\n", b"END\r\n");
            got.strip_prefix("VALUE slow 0 1\r\n").and_then(|v| v.strip_suffix("\r\nEND\r\n")).unwrap().to_owned()
        })
        .collect();
    let mut sent: Vec<String> = (0..namers.len()).map(|i| i.to_string()).collect();
    items.sort();
    sent.sort();
    assert_eq!(items, sent);
    assert_eq!(other.ask(b"get slow\r\n", b"END\r\n"), "END\r\n");
}

#[test]
fn a_get_whose_client_went_away_while_waiting_takes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let mut waiter = Conn::open(&server);
    waiter.send(b"get later/t=5000\r\n");
    let mut c = Conn::open(&server);
    // The waiter is parked (counted in `waiters`) before it goes away.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !c.ask(b"stats\r\n", b"END\r\n").contains("STAT queue_later_waiters 1\r\n") {
        assert!(Instant::now() < deadline, "the get never waited");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(waiter);
    common::wait_until("the gone client's get to stop waiting", || {
        c.ask(b"stats\r\n", b"END\r\n").contains("STAT queue_later_waiters 0\r\n")
    });
    assert_eq!(c.ask(b"set later 0 0 4\r\nitem\r\n", b"\r\n"), "STORED\r\n");
    assert_eq!(
        c.ask(b"get later\r\n", b"END\r\n"),
        "VALUE later 0 4\r\nitem\r\nEND\r\n",
        "not taken by the gone client"
    );
}

#[test]
fn stats_has_every_name_kestrel_printed_with_figures_that_follow_the_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    // The smallest segments (64 KiB), so that a few hundred KiB of items roll the logs; and one
    // queue in memory that may hold a quarter of the memory budget.
    std::fs::write(
        &config,
        "segment_bytes = 65536\nmax_memory_bytes = 4194304\n[queues.scratch]\ndurable = false\nmax_bytes = 1048576\n",
    )
    .unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let mut c = Conn::open(&server);
    assert_eq!(c.ask(b"get rolling+copy\r\n", b"END\r\n"), "END\r\n", "makes the fanout child (a miss)");
    let item = "x".repeat(2000);
    let sets = |n: usize| format!("set rolling 0 0 2000\r\n{item}\r\n").repeat(n).into_bytes();
    c.send(&sets(100));
    assert_eq!(c.until(&b"STORED\r\n".repeat(100)).len(), 100 * 8);
    for _ in 0..100 {
        assert!(c.ask(b"get rolling\r\n", b"END\r\n").starts_with("VALUE rolling 0 2000\r\n"));
    }
    // Everything before the active segment is consumed now: the next roll deletes it.
    c.send(&sets(40));
    assert_eq!(c.until(&b"STORED\r\n".repeat(40)).len(), 40 * 8);
    assert!(c.ask(b"get rolling/open\r\n", b"END\r\n").starts_with("VALUE rolling/open 0 2000\r\n"));

    let text = c.ask(b"stats\r\n", b"END\r\n");
    let lines: Vec<(&str, &str)> = text.lines().filter_map(|l| l.strip_prefix("STAT ")?.split_once(' ')).collect();
    let stats: std::collections::HashMap<&str, &str> = lines.iter().copied().collect();
    let value = |name: &str| *stats.get(name).unwrap_or_else(|| panic!("no STAT {name} in:\n{text}"));
    let num = |name: &str| value(name).parse::<u64>().unwrap_or_else(|e| panic!("STAT {name} {}: {e}", value(name)));

    // Kestrel's server-wide names, in Kestrel's order (Petrel's own come after them).
    let global = [
        "uptime",
        "time",
        "version",
        "curr_items",
        "total_items",
        "bytes",
        "reserved_memory_ratio",
        "curr_connections",
        "total_connections",
        "cmd_get",
        "cmd_set",
        "cmd_peek",
        "get_hits",
        "get_misses",
        "bytes_read",
        "bytes_written",
        "queue_creates",
        "queue_deletes",
        "queue_expires",
    ];
    let at: Vec<usize> = global
        .iter()
        .map(|name| lines.iter().position(|(n, _)| n == name).unwrap_or_else(|| panic!("no STAT {name}")))
        .collect();
    assert!(at.is_sorted(), "in Kestrel's order: {at:?}");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(num("time").abs_diff(now) < 60 && num("uptime") < 600);
    assert_eq!(value("version"), "0.1.0");
    assert_eq!(num("curr_items"), 39 + 140, "open items are not counted");
    assert_eq!(num("total_items"), 140 + 140, "fanout copies count in the child");
    assert_eq!(num("bytes"), (39 + 140) * 2000);
    // scratch's 1 MiB of the 4 MiB budget; durable queues reserve no memory.
    assert_eq!(value("reserved_memory_ratio"), "0.250");
    assert!(num("curr_connections") >= 1 && num("total_connections") >= 1);
    assert_eq!((num("cmd_get"), num("cmd_set"), num("cmd_peek")), (102, 140, 0));
    assert_eq!((num("get_hits"), num("get_misses")), (101, 1));
    assert!(num("bytes_read") > 140 * 2000 && num("bytes_written") > 101 * 2000);
    // rolling and rolling+copy by first use; scratch is configured, made at start.
    assert_eq!((num("queue_creates"), num("queue_deletes"), num("queue_expires")), (2, 0, 0));

    // Kestrel's per-queue names, in Kestrel's order, for durable and in-memory queues alike.
    let per_queue = KESTREL_QUEUE_STATS;
    for q in ["rolling", "rolling+copy", "scratch"] {
        let at: Vec<usize> = per_queue
            .iter()
            .map(|s| format!("queue_{q}_{s}"))
            .map(|name| lines.iter().position(|(n, _)| *n == name).unwrap_or_else(|| panic!("no STAT {name}")))
            .collect();
        assert!(at.is_sorted(), "{q}'s in Kestrel's order: {at:?}");
        num(&format!("queue_{q}_age"));
    }
    let q = |queue: &str, stat: &str| num(&format!("queue_{queue}_{stat}"));
    assert_eq!((q("rolling", "items"), q("rolling", "bytes")), (39, 39 * 2000));
    assert_eq!((q("rolling", "mem_items"), q("rolling", "mem_bytes")), (39, 39 * 2000));
    assert_eq!(q("rolling", "total_items"), 140);
    assert_eq!((q("rolling", "open_transactions"), q("rolling", "transactions")), (1, 1));
    assert_eq!((q("rolling", "canceled_transactions"), q("rolling", "expired_items")), (0, 0));
    assert_eq!((q("rolling", "discarded"), q("rolling", "waiters"), q("rolling", "total_flushes")), (0, 0, 0));
    assert!(q("rolling", "age") < 60_000, "ms since the open item was set");
    // 140 items of 2000 bytes need at least five 64 KiB segments: four rolls, in both logs.
    assert!(q("rolling", "journal_rotations") >= 4, "{text}");
    assert!(q("rolling+copy", "journal_rotations") >= 4, "{text}");
    // The parent's items were taken, so its consumed segments went; nobody read the child's.
    assert!(q("rolling", "journal_rewrites") >= 1, "{text}");
    assert_eq!(q("rolling+copy", "journal_rewrites"), 0);
    assert!(q("rolling", "logsize") > 0 && q("rolling", "logsize") < q("rolling+copy", "logsize"));
    assert_eq!((q("rolling+copy", "items"), q("rolling+copy", "open_transactions")), (140, 0));
    assert_eq!(value("queue_rolling_children"), "rolling+copy");
    assert!(!stats.contains_key("queue_rolling+copy_children") && !stats.contains_key("queue_scratch_children"));
    // In memory: no log.
    let scratch = ["logsize", "journal_rewrites", "journal_rotations", "items"].map(|s| q("scratch", s));
    assert_eq!(scratch, [0, 0, 0, 0]);

    // dump_stats: the same figures, grouped by queue.
    let dump = c.ask(b"dump_stats rolling\r\n", b"END\r\n");
    assert!(dump.starts_with("queue 'rolling' {\r\n") && dump.ends_with("}\r\nEND\r\n"), "{dump}");
    for s in per_queue {
        assert!(dump.contains(&format!("\r\n  {s}=")), "no {s} in {dump}");
    }
}

#[test]
fn kestrel_style_names_sets_nobody_hears_of_and_meta_commands() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("server.log");
    let server = Server::start_logged(&dir.path().join("data"), &[], &log);
    let mut c = Conn::open(&server);
    // Names other queues use with separators are queue names (`jobs:high` was refused).
    for name in ["jobs:high", "user@host", "region=eu,tier=1"] {
        let set = format!("set {name} 0 0 2\r\nok\r\n");
        assert_eq!(c.ask(set.as_bytes(), b"\r\n"), "STORED\r\n", "{name}");
        let got = c.ask(format!("get {name}\r\n").as_bytes(), b"END\r\n");
        assert_eq!(got, format!("VALUE {name} 0 2\r\nok\r\nEND\r\n"));
    }
    // A set that is not stored is counted, and logged when it said noreply (nobody else hears).
    c.send(b"set bad#name 0 0 1 noreply\r\nx\r\nset bad#name 0 0 1 noreply\r\ny\r\n");
    c.send(b"set fine 0 never 1 noreply\r\nz\r\n"); // refused as it is read: a bad exptime
    let stat = |c: &mut Conn, name: &str| -> u64 {
        let stats = c.ask(b"stats\r\n", b"END\r\n");
        let prefix = format!("STAT {name} ");
        stats.lines().find_map(|l| l.strip_prefix(prefix.as_str())).unwrap().trim().parse().unwrap()
    };
    assert_eq!(stat(&mut c, "set_refused"), 3);
    common::wait_until("the warning logged", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("noreply set was not stored") && text.contains("bad#name")
    });
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches("noreply set was not stored").count(), 1, "once a connection: {text}");
    // total_items counts over the server's life: a deleted queue's items stay in it.
    assert_eq!(stat(&mut c, "total_items"), 3);
    assert_eq!(c.ask(b"delete jobs:high\r\n", b"\r\n"), "DELETED\r\n");
    assert_eq!(stat(&mut c, "total_items"), 3);
    // A meta set's data block is skipped, never run as commands (it deleted the queue).
    assert_eq!(c.ask(b"set kept 0 0 1\r\nk\r\n", b"\r\n"), "STORED\r\n");
    let meta = c.ask(b"ms kept 11 T0\r\ndelete kept\r\n", b"\r\n");
    assert_eq!(meta, "CLIENT_ERROR meta commands are not supported: use set and get\r\n");
    assert_eq!(c.ask(b"get kept\r\n", b"END\r\n"), "VALUE kept 0 1\r\nk\r\nEND\r\n");
}

/// What stock clients do that a Kestrel server never saw: a pool that connects at its program's
/// start and sends its first command later than the handshake timeout (kept: a plain memcache
/// connection has no handshake); a command the server does not know sent with `noreply`
/// (pymemcache's `touch`: no `ERROR`, which the client would read as its next command's answer);
/// and Kestrel client libraries that take a per-queue stat's queue name as what comes before a
/// suffix they know (no stat of Petrel's own ends in one).
#[test]
fn early_connections_unknown_noreply_commands_and_stats_kestrel_clients_parse() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "[security]\nhandshake_timeout = \"200ms\"\n").unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let mut early = Conn::open(&server);
    std::thread::sleep(Duration::from_millis(700));
    assert!(early.ask(b"version\r\n", b"\r\n").starts_with("VERSION "), "kept past the handshake timeout");
    assert_eq!(early.ask(b"set jobs 0 0 2\r\nok\r\n", b"\r\n"), "STORED\r\n");
    // The server stays one answer per answered request.
    let answers = early.ask(b"touch jobs 10 noreply\r\nverbosity 1 noreply\r\nget jobs\r\n", b"END\r\n");
    assert_eq!(answers, "VALUE jobs 0 2\r\nok\r\nEND\r\n");
    assert_eq!(early.ask(b"touch jobs 10\r\n", b"\r\n"), "ERROR\r\n", "answered without noreply");
    // The per-queue stats' names end in Kestrel's suffixes only where they are Kestrel's stats.
    let kestrel = KESTREL_QUEUE_STATS;
    let stats = early.ask(b"stats\r\n", b"END\r\n");
    for line in stats.lines().filter_map(|l| l.strip_prefix("STAT queue_jobs_")) {
        let name = line.split(' ').next().unwrap();
        if !kestrel.contains(&name) {
            assert!(
                !kestrel.iter().any(|k| name.ends_with(&format!("_{k}"))),
                "queue_jobs_{name} would be read as a queue jobs_… by Kestrel's clients"
            );
        }
    }
    assert!(stats.contains("STAT queue_jobs_delayed 0\r\n"), "{stats}");
}
