//! Limits that one client must not be able to break, against the real binary with small
//! configured limits (so each test takes seconds): descriptors and queues, memory, connections,
//! threads, disk.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use petrel_client::{QueueConfig, Status};

mod common;
use common::{Server, read_response, request_frame};

fn config(dir: &Path, text: &str) -> String {
    let path = dir.join("petrel.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Sends a memcache request and reads one answer line (or a whole `VALUE … END`).
fn ask(conn: &mut TcpStream, request: &str) -> String {
    conn.write_all(request.as_bytes()).unwrap();
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        conn.read_exact(&mut byte).unwrap();
        answer.push(byte[0]);
        let text = String::from_utf8_lossy(&answer);
        if text.ends_with("\r\n") && (!text.starts_with("VALUE") || text.ends_with("END\r\n")) {
            return text.into_owned();
        }
    }
}

fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

#[test]
fn thousands_of_durable_queues_need_no_descriptor_each_and_max_queues_holds() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = config(dir.path(), "max_queues = 1500\n");
    // 128 descriptors: a server that kept ~3 per durable queue failed past ~40 queues.
    let limit = ["prlimit", "--nofile=128:128", "--"];
    let server = Server::start_under(&limit, &data, &["--config", &config]);
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for i in 0..1500 {
        assert_eq!(ask(&mut mc, &format!("set q{i} 0 0 5\r\nitem{}\r\n", i % 10)), "STORED\r\n", "queue {i}");
    }
    let open = descriptors(server.child.id());
    assert!(open < 40, "{open} descriptors open with 1500 durable queues");
    let refused = ask(&mut mc, "set one-too-many 0 0 1\r\nx\r\n");
    assert!(refused.starts_with("SERVER_ERROR") && refused.contains("max_queues"), "{refused}");
    assert!(!data.join("queues").join("one-too-many").exists(), "a refused creation leaves nothing behind");
    // The native protocol says LIMIT_REACHED.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = rt.block_on(async {
        let c = server.client().await;
        c.create_queue("native-one", QueueConfig::default()).await.unwrap_err().status()
    });
    assert_eq!(status, Some(Status::LimitReached));
    drop(mc);
    server.kill9();

    // It starts again on that data under the same descriptor limit, every queue there.
    let server = Server::start_under(&limit, &data, &["--config", &config]);
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for i in [0, 777, 1499] {
        assert_eq!(ask(&mut mc, &format!("get q{i}\r\n")), format!("VALUE q{i} 0 5\r\nitem{}\r\nEND\r\n", i % 10));
    }
}

#[test]
fn excess_connections_are_answered_at_once_per_address_and_in_total() {
    for (limits, setting) in [
        ("max_connections_per_address = 4\n", "max_connections_per_address"),
        ("max_connections = 4\nmax_connections_per_address = 0\n", "max_connections"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path(), &format!("{limits}idle_timeout = \"3s\"\n"));
        let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let mut held = Vec::new();
            for _ in 0..4 {
                held.push(server.client().await);
            }
            let started = std::time::Instant::now();
            let Err(refused) = petrel_client::Client::connect(server.addr.as_str()).await else { panic!("a fifth") };
            assert_eq!(refused.status(), Some(Status::LimitReached), "{refused}");
            assert!(refused.to_string().contains(setting), "{refused}");
            assert!(started.elapsed() < Duration::from_secs(2), "answered at once, not left in the backlog");
            let mut mc = TcpStream::connect(&server.memcache).unwrap();
            mc.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut mc), &mut line).unwrap();
            assert!(line.starts_with("SERVER_ERROR") && line.contains(setting), "{line:?}");
            // A place is free again once the server has seen a connection go: tried until then.
            let connect_soon = || async {
                let deadline = std::time::Instant::now() + Duration::from_secs(15);
                loop {
                    match petrel_client::Client::connect(server.addr.as_str()).await {
                        Ok(c) => return c,
                        Err(e) if std::time::Instant::now() > deadline => panic!("no place came free: {e}"),
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            };
            // A closed connection frees its place.
            held.pop().unwrap().close();
            held.push(connect_soon().await);
            // Idle connections (native and memcache) are closed after idle_timeout, and free theirs.
            for _ in 0..4 {
                held.push(connect_soon().await);
            }
        });
    }
}

#[test]
fn a_silent_memcache_connection_is_closed_after_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "idle_timeout = \"1s\"\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ask(&mut mc, "set q 0 0 1\r\nx\r\n"), "STORED\r\n");
    assert_eq!(ask(&mut mc, "get q/open\r\n"), "VALUE q/open 0 1\r\nx\r\nEND\r\n"); // the key as sent
    let started = std::time::Instant::now();
    let mut rest = Vec::new();
    mc.read_to_end(&mut rest).expect("closed by the server, not a read timeout");
    assert!(started.elapsed() < Duration::from_secs(3));
    // The item it held open went back to the queue.
    let mut again = TcpStream::connect(&server.memcache).unwrap();
    again.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ask(&mut again, "get q\r\n"), "VALUE q 0 1\r\nx\r\nEND\r\n");
}

#[test]
fn six_hundred_group_subscribers_all_get_deliveries_without_a_thread_each() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let threads = |pid: u32| std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let publisher = server.client().await;
        publisher.create_topic("events", true).await.unwrap();
        let mut clients = Vec::new();
        for _ in 0..6 {
            clients.push(server.client().await);
        }
        // More than tokio's 512 blocking threads: with a thread per group subscription the last
        // ones got their SUBSCRIBE answer and never a message.
        let mut subscriptions = Vec::new();
        for g in 0..600 {
            let client = &clients[g % clients.len()];
            let from = petrel_client::StartFrom::Oldest;
            subscriptions.push(client.subscribe_group("events", &format!("g{g}"), from, 16).await.unwrap());
        }
        let before = threads(server.child.id());
        assert!(before < 64, "{before} threads for 600 idle group subscriptions");
        publisher.publish("events", vec![petrel_client::Message::new(b"hello".to_vec())]).await.unwrap();
        for (g, sub) in subscriptions.iter_mut().enumerate() {
            let m = tokio::time::timeout(Duration::from_secs(10), sub.next()).await;
            let m = m.unwrap_or_else(|_| panic!("group {g} got nothing")).unwrap().unwrap();
            assert_eq!(&m.payload[..], b"hello");
            sub.ack(&[m.id]).await.unwrap();
        }
    });
}

fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn a_flood_of_small_messages_holds_about_the_memory_budget_not_many_times_it() {
    // Each 32-byte message was held as a whole `Message` (~450 bytes) and counted as 32: a 32 MiB
    // budget let the server grow by ~330 MiB. Now each counts what holding it takes, waiting or
    // delayed.
    for delay_ms in [0, 3_600_000] {
        let dir = tempfile::tempdir().unwrap();
        let budget: u64 = 32 << 20;
        let config = config(dir.path(), &format!("max_memory_bytes = {budget}\n"));
        let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let pid = server.child.id();
        let (stored, before) = rt.block_on(async {
            let c = server.client().await;
            c.create_queue("small", QueueConfig::default()).await.unwrap();
            // Counted from the first offer on: the connection's buffers are not the messages'.
            let batch =
                || (0..500).map(|_| petrel_client::Message { delay_ms, ..petrel_client::Message::new(vec![7u8; 32]) });
            c.offer("small", batch().collect(), None).await.unwrap();
            let before = resident_kib(pid);
            let mut stored = 500u64;
            loop {
                match c.offer("small", batch().collect(), None).await {
                    Ok(_) => stored += 500,
                    Err(e) => {
                        assert_eq!(e.status(), Some(Status::LimitReached), "{e}");
                        break (stored, before);
                    }
                }
                assert!(stored <= budget / 32, "more messages stored than their payloads fit the budget");
            }
        });
        let grown = resident_kib(pid).saturating_sub(before) * 1024;
        eprintln!(
            "{stored} messages of 32 bytes held (delayed {delay_ms} ms): the server grew by {grown} bytes, budget {budget}"
        );
        assert!(stored >= budget / 512, "{stored} messages stored: each counted more than 512 bytes");
        assert!(grown <= budget * 3 / 2, "{stored} messages of 32 bytes grew the server by {grown} bytes");
    }
}

#[test]
fn memory_queues_and_stalled_subscribers_stay_within_their_budgets() {
    let dir = tempfile::tempdir().unwrap();
    let config =
        config(dir.path(), "max_memory_bytes = 1048576\nmax_subscriber_bytes = 131072\nmax_queued_responses = 4\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        c.create_queue("flood", QueueConfig::default()).await.unwrap();
        let chunk = || vec![petrel_client::Message::new(vec![7u8; 16 * 1024])];
        let mut stored = 0;
        let refused = loop {
            match c.offer("flood", chunk(), None).await {
                Ok(_) => stored += 1,
                Err(e) => break e,
            }
            assert!(stored <= 64, "1 MiB holds 64 of 16 KiB; more were taken");
        };
        assert_eq!(refused.status(), Some(Status::LimitReached), "{refused}");
        assert!(refused.to_string().contains("max_memory_bytes"), "{refused}");
        assert!(stored >= 60, "{stored}");
        // Taking makes room again.
        c.poll("flood", petrel_client::PollOptions { max: 8, ..Default::default() }).await.unwrap();
        c.offer("flood", chunk(), None).await.unwrap();

        // A subscriber that reads nothing (a raw socket with a small receive buffer) is ended
        // once what waits for it passes the socket's buffers, the connection's few queued frames
        // and 128 KiB: the publisher's count of subscribers drops to zero.
        c.create_topic("news", false).await.unwrap();
        let _stalled = subscribe_and_read_nothing(&server, "news", 100_000);
        // Subscribed once a publish reaches it.
        let mut published = 0;
        while c.publish("news", vec![petrel_client::Message::new(vec![])]).await.unwrap() == 0 {
            published += 1;
            assert!(published < 1000, "the subscription never came");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut published = 0;
        while c.publish("news", vec![petrel_client::Message::new(vec![1u8; 16 * 1024])]).await.unwrap() > 0 {
            published += 1;
            assert!(published < 1000, "16 MB published and the stalled subscriber still held");
        }
        assert!(published > 8, "ended only after its buffers filled: {published}");
    });
}

#[test]
fn a_subscriber_that_reads_nothing_holds_about_its_bytes_however_small_the_messages() {
    // Empty messages counted as 0 bytes: a stalled subscriber held a million of them (~350 MB) and
    // was ended only when its buffer of messages was full.
    let dir = tempfile::tempdir().unwrap();
    let max: u64 = 32 << 20;
    let config = config(dir.path(), &format!("max_subscriber_bytes = {max}\n"));
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let pid = server.child.id();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (published, grown) = rt.block_on(async {
        let c = server.client().await;
        c.create_topic("chatter", false).await.unwrap();
        let _stalled = subscribe_and_read_nothing(&server, "chatter", 1 << 20);
        let empty = || (0..1000).map(|_| petrel_client::Message::new(vec![])).collect::<Vec<_>>();
        let mut tries = 0;
        while c.publish("chatter", empty()).await.unwrap() == 0 {
            tries += 1;
            assert!(tries < 1000, "the subscription never came");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = resident_kib(pid);
        let mut published = 1000u64;
        while c.publish("chatter", empty()).await.unwrap() > 0 {
            published += 1000;
            assert!(published < 1 << 20, "a full buffer of empty messages and the subscriber still held");
        }
        (published, resident_kib(pid).saturating_sub(before) * 1024)
    });
    eprintln!(
        "{published} empty messages published before the stalled subscriber was ended; the server grew by {grown} bytes"
    );
    // Beyond its own bytes: the connection's outbox (4 MiB) and the allocator's slack (~10 MiB here).
    assert!(grown <= 5 * max / 2, "{grown} bytes for a subscriber allowed {max}");
}

/// A subscriber to `topic` that reads nothing: a raw socket with a small receive buffer, its
/// HELLO and SUBSCRIBE (`buffer` messages) sent.
fn subscribe_and_read_nothing(server: &Server, topic: &str, buffer: u32) -> TcpStream {
    let mut stalled = TcpStream::connect(&server.addr).unwrap();
    rustix::net::sockopt::set_socket_recv_buffer_size(&stalled, 4096).unwrap();
    let mut hello = Vec::new();
    petrel_proto::Request::Hello { client: "stalled".into(), features: 0 }.encode(1, &mut hello).unwrap();
    let subscribe = petrel_proto::Request::Subscribe {
        topic: topic.into(),
        buffer,
        group: String::new(),
        from: petrel_proto::StartFrom::Resume,
    };
    subscribe.encode(2, &mut hello).unwrap();
    stalled.write_all(&hello).unwrap();
    stalled
}

#[test]
fn requests_being_read_count_in_the_memory_budget_on_both_ports() {
    use petrel_proto::{Message, Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_memory_bytes = 8388608\nmax_message_bytes = 8388608\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let connect = || greeted(&server);
    let offer = |bytes: usize| {
        let message = Message { payload: vec![7u8; bytes].into(), ..Message::default() };
        Request::Offer { queue: "big".into(), timeout_ms: 0, messages: vec![message] }
    };
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(ask(&mut mc, "set big 0 0 1\r\nx\r\n"), "STORED\r\n");
    // A 6 MiB offer, sent all but its last byte: the server holds 6 MiB of its 8 MiB budget.
    let mut held = connect();
    let six = request_frame(&offer(6 << 20), 2);
    held.write_all(&six[..six.len() - 1]).unwrap();
    // Once the server counts it (a fixed pause was too short on a loaded machine once).
    common::wait_until("the held request counted in the budget", || {
        mc.write_all(b"stats\r\n").unwrap();
        let (mut stats, mut reader) = (String::new(), std::io::BufReader::new(&mut mc));
        while !stats.ends_with("END\r\n") {
            std::io::BufRead::read_line(&mut reader, &mut stats).unwrap();
        }
        let queued = stats.lines().find_map(|l| l.strip_prefix("STAT memory_queued_bytes "));
        queued.and_then(|v| v.trim().parse::<u64>().ok()).is_some_and(|v| v >= 6 << 20)
    });
    // Another 6 MiB request does not fit beside it: refused when its header arrives, not held.
    let mut refused = connect();
    let other = request_frame(&offer(6 << 20), 3);
    refused.write_all(&other[..64]).unwrap();
    match read_response(&mut refused) {
        (3, Response::Error { status, message }) => {
            assert_eq!(status, Status::LimitReached);
            assert!(message.contains("max_memory_bytes"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Its bytes are skipped as they come, and the connection goes on.
    refused.write_all(&other[64..]).unwrap();
    refused.write_all(&request_frame(&Request::Ping, 4)).unwrap();
    assert!(matches!(read_response(&mut refused), (4, Response::Pong)));
    // The memcache port: a data block that does not fit is refused once its bytes are through.
    let block = vec![b'x'; 6 << 20];
    mc.write_all(b"set big 0 0 6291456\r\n").unwrap();
    mc.write_all(&block).unwrap();
    let answer = ask(&mut mc, "\r\n");
    assert!(answer.starts_with("SERVER_ERROR") && answer.contains("max_memory_bytes"), "{answer}");
    assert_eq!(ask(&mut mc, "set small 0 0 2\r\nok\r\n"), "STORED\r\n");
    // The held request completes and is accepted (into a durable queue: out of the budget),
    // and its 6 MiB are given back: a 3 MiB item fits.
    held.write_all(&six[six.len() - 1..]).unwrap();
    let answer = read_response(&mut held);
    assert!(matches!(answer, (2, Response::Offered { count: 1, .. })), "{answer:?}");
    let one = format!("set small 0 0 {}\r\n{}\r\n", 3 << 20, "y".repeat(3 << 20));
    assert_eq!(ask(&mut mc, &one), "STORED\r\n");
}

#[test]
fn a_queue_falls_back_to_smaller_segments_when_a_grown_one_does_not_fit() {
    // Files of at most 300 KiB (RLIMIT_FSIZE): a queue's segments grow 128 KiB, 256 KiB, 512 KiB…
    // and the third cannot be made; smaller ones still can, so offers go on. The server handles
    // the SIGXFSZ such a write raises itself (its default action killed it without a word).
    let dir = tempfile::tempdir().unwrap();
    let limit = ["bash", "-c", "ulimit -f 300; exec \"$0\" \"$@\""];
    let server = Server::start_under(&limit, &dir.path().join("data"), &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        c.create_queue("big", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
        for i in 0..2000u32 {
            let m = petrel_client::Message::new(format!("{i:01000}").into_bytes());
            c.offer("big", vec![m], None).await.unwrap_or_else(|e| panic!("offer {i}: {e}"));
        }
        let got = c.poll("big", petrel_client::PollOptions { max: 5000, ..Default::default() }).await.unwrap();
        assert_eq!(got.len(), 2000);
        assert!(got.iter().enumerate().all(|(i, d)| d.message.payload == format!("{i:01000}").as_bytes()));
    });
}

#[test]
fn requests_that_fail_in_the_server_are_counted_on_metrics_and_in_stats() {
    // Files of at most 300 KiB: a record of 400 KB fits no segment, a storage error, not the
    // client's (the server's message limit is higher). Each protocol's failure is counted.
    let dir = tempfile::tempdir().unwrap();
    let limit = ["bash", "-c", "ulimit -f 300; exec \"$0\" \"$@\""];
    let server = Server::start_under(&limit, &dir.path().join("data"), &[]);
    let failures = |server: &Server| {
        let mut http = TcpStream::connect(&server.http).unwrap();
        http.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        http.read_to_string(&mut text).unwrap();
        let count = |protocol: &str| -> u64 {
            let prefix = format!("petrel_request_failures_total{{protocol=\"{protocol}\"}} ");
            let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("{prefix} in {text}"));
            line[prefix.len()..].parse().unwrap()
        };
        (count("native"), count("memcache"), count("http"))
    };
    assert_eq!(failures(&server), (0, 0, 0));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        c.create_queue("q", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
        let big = petrel_client::Message::new(vec![b'x'; 400_000]);
        let err = c.offer("q", vec![big], None).await.unwrap_err();
        assert!(err.to_string().contains("SERVER_ERROR") || err.to_string().contains("server error"), "{err}");
        c.offer("q", vec![petrel_client::Message::new(&b"small"[..])], None).await.unwrap();
    });
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let set = format!("set q 0 0 400000\r\n{}\r\n", "y".repeat(400_000));
    assert!(ask(&mut mc, &set).starts_with("SERVER_ERROR"));
    assert_eq!(failures(&server), (1, 1, 0));
    // The admin API's: a queue whose directory cannot be made (a file in its place).
    std::fs::write(dir.path().join("data/queues/blocked"), b"in the way").unwrap();
    let mut http = TcpStream::connect(&server.http).unwrap();
    let put = "PUT /api/v1/queues/blocked HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    http.write_all(put.as_bytes()).unwrap();
    let mut answer = String::new();
    http.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.0 500"), "{answer}");
    assert_eq!(failures(&server), (1, 1, 1));
    mc.write_all(b"stats\r\n").unwrap();
    let mut text = String::new();
    let mut reader = std::io::BufReader::new(&mut mc);
    while !text.ends_with("END\r\n") {
        std::io::BufRead::read_line(&mut reader, &mut text).unwrap();
    }
    assert!(text.contains("STAT request_failures 3\r\n"), "{text}");
}

#[test]
fn stats_show_every_limit_the_memory_in_use_and_the_free_disk() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    mc.write_all(b"stats\r\n").unwrap();
    let mut text = String::new();
    let mut reader = std::io::BufReader::new(&mut mc);
    while !text.ends_with("END\r\n") {
        std::io::BufRead::read_line(&mut reader, &mut text).unwrap();
    }
    let stat = |name: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(&format!("STAT {name} "))).unwrap_or_else(|| panic!("{name}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(stat("limit_max_queues"), 10_000);
    assert_eq!(stat("limit_max_connections_per_address"), 1_000);
    assert_eq!(stat("limit_max_memory_bytes"), 1 << 30);
    assert_eq!(stat("memory_queued_bytes"), 0);
    assert_eq!(stat("limit_max_resident_bytes"), 1 << 30);
    assert_eq!(stat("resident_releases"), 0);
    assert!(stat("resident_counted_bytes") <= 1 << 30);
    assert!(stat("disk_free_bytes") > 0 && stat("disk_free_bytes") <= stat("disk_total_bytes"));
}

/// The soak benchmark, briefly: its server meets every kind of hostile load it makes (the
/// flooded in-memory queues reach the memory budget, the flooded durable ones their bound) and
/// keeps a handful of threads and a descriptor per connection while the well-behaved client is
/// served. (The full run, 10 minutes, is in docs/benchmarks.md.)
#[test]
fn the_soak_benchmark_runs_and_its_server_holds() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let args = ["bench", "soak", "--duration", "4s", "--baseline", "1s", "--queues", "100", "--connections", "300"];
    let out = common::petrel(&[&args[..], &["--max-memory-bytes", "33554432", "--json", "--data", data]].concat(), b"");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let n = |k: &str| report[k].as_f64().unwrap_or_else(|| panic!("{k} in {report}"));
    assert_eq!(n("connections"), 300.0);
    assert!(n("flood_limit_reached") > 0.0 && n("flood_queue_full") > 0.0, "{report}");
    assert!(n("load_min_pairs_per_sec") > 0.0, "the well-behaved client was served: {report}");
    assert!(n("peak_threads") < 32.0, "{report}");
    assert!(n("peak_fds") < 300.0 + 64.0, "a descriptor per connection, none per queue: {report}");
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "its data directory was removed");
}

#[test]
fn a_client_that_never_reads_its_answers_holds_neither_the_server_nor_its_stop() {
    use petrel_proto::Request;
    let dir = tempfile::tempdir().unwrap();
    let config =
        config(dir.path(), "max_queued_responses = 4\nmax_queued_response_bytes = 65536\nshutdown_grace = \"1s\"\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    // Pings by the million, never an answer read, from a socket with a small receive buffer:
    // the server's writes to it stop once the socket's buffers are full, then its reads from it.
    let mut stalled = TcpStream::connect(&server.addr).unwrap();
    rustix::net::sockopt::set_socket_recv_buffer_size(&stalled, 4096).unwrap();
    stalled.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut requests = request_frame(&Request::Hello { client: "stalled".into(), features: 0 }, 1);
    let ping = request_frame(&Request::Ping, 2);
    for _ in 0..4_000_000 {
        requests.extend_from_slice(&ping);
    }
    let requests_len = requests.len();
    let flood = std::thread::spawn(move || {
        let sent = stalled.write_all(&requests);
        (stalled, sent.is_err())
    });
    let (stalled, blocked) = flood.join().unwrap();
    assert!(blocked, "{} MB of requests all taken by a server that could not answer them", requests_len >> 20);
    // Everyone else is served meanwhile.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        c.create_queue("work", QueueConfig::default()).await.unwrap();
        c.offer("work", vec![petrel_client::Message::new(b"job".to_vec())], None).await.unwrap();
        let got = c.poll("work", petrel_client::PollOptions::default()).await.unwrap();
        assert_eq!(&got[0].message.payload[..], b"job");
    });
    // And the server stops when told, not waiting for that client to read.
    let started = std::time::Instant::now();
    let status = server.terminate();
    assert!(status.success(), "{status}");
    assert!(started.elapsed() < Duration::from_secs(15), "stopped after {:?}", started.elapsed());
    drop(stalled);
}

/// A function server that waits for a free request slot and sends RETURNs by the million while
/// its invocations back up unread: their answers wait for it in the server's memory, so the
/// server stops reading it until its answers go out. (It read on, answering every RETURN into a
/// buffer that grew without bound while the outbox was busy.)
#[test]
fn returns_from_a_client_that_does_not_read_are_not_answered_without_bound() {
    use petrel_proto::{Message, Request};
    let dir = tempfile::tempdir().unwrap();
    let config = config(
        dir.path(),
        "max_in_flight_per_connection = 2\nmax_queued_responses = 64\nmax_queued_response_bytes = 4194304\n",
    );
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut stalled = TcpStream::connect(&server.addr).unwrap();
    rustix::net::sockopt::set_socket_recv_buffer_size(&stalled, 4096).unwrap();
    stalled.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut requests = request_frame(&Request::Hello { client: "stalled".into(), features: 0 }, 1);
    requests.extend(request_frame(&Request::Serve { function: "f".into() }, 2));
    requests.extend(request_frame(&Request::QueueCreate { name: "empty".into(), config: Default::default() }, 3));
    stalled.write_all(&requests).unwrap();
    for id in 1..=3 {
        assert_eq!(read_response(&mut stalled).0, id);
    }
    // Its invocations, unread: they fill the sockets' buffers, then wait in its outbox.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        // (Once they back up, more are refused "busy": enough are on their way by then.)
        for _ in 0..64 {
            let _ = c.call_oneway("f", petrel_client::Message::new(vec![7u8; 64 << 10])).await;
        }
    });
    // Both slots held by polls waiting on an empty queue, a third poll waiting for a slot, then
    // RETURNs for calls nobody made (each answered with an error).
    let mut requests = Vec::new();
    for id in 4..7 {
        let poll = Request::Poll { queue: "empty".into(), max: 1, timeout_ms: 600_000, visibility_ms: 0 };
        requests.extend(request_frame(&poll, id));
    }
    let give_back = Request::Return {
        call: 12_345,
        status: Status::Ok,
        error: String::new(),
        message: Box::new(Message::new(b"r".to_vec())),
    };
    let one = request_frame(&give_back, 7);
    for _ in 0..(64 << 20) / one.len() {
        requests.extend_from_slice(&one);
    }
    let requests_len = requests.len();
    stalled.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let flood = std::thread::spawn(move || {
        let sent = stalled.write_all(&requests);
        (stalled, sent.is_err())
    });
    let (stalled, blocked) = flood.join().unwrap();
    assert!(blocked, "{} MB of RETURNs all taken from a client that reads nothing", requests_len >> 20);
    drop(stalled);
    drop(server);
}

/// A connection that polled for good the one message of queue `big`, `payload` (offered here),
/// whose answer has begun to arrive, none of it read but the HELLO's answer. Larger than the
/// sockets' buffers, the answer is written in part. `recv_buffer`: the client's receive buffer.
fn polling_a_big_message(server: &Server, payload: Vec<u8>, recv_buffer: Option<usize>) -> TcpStream {
    use petrel_proto::{Request, Response};
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        c.create_queue("big", QueueConfig::default()).await.unwrap();
        c.offer("big", vec![petrel_client::Message::new(payload)], None).await.unwrap();
    });
    let mut reader = TcpStream::connect(&server.addr).unwrap();
    if let Some(bytes) = recv_buffer {
        rustix::net::sockopt::set_socket_recv_buffer_size(&reader, bytes).unwrap();
    }
    let mut requests = request_frame(&Request::Hello { client: "slow".into(), features: 0 }, 1);
    requests.extend(request_frame(&Request::Poll { queue: "big".into(), max: 1, timeout_ms: 0, visibility_ms: 0 }, 2));
    reader.write_all(&requests).unwrap();
    reader.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(matches!(read_response(&mut reader), (1, Response::Hello { .. })));
    reader.peek(&mut [0u8; 16]).unwrap(); // the poll's answer has begun
    reader
}

/// An answer cut short by the stop goes on from where it was cut: a client that reads again
/// during the stop's grace gets the whole frame, once. (The server's stop gave up the write of
/// an answer half sent, and the stop's last flush sent it again from its first byte: the client
/// read half a frame, then the whole of it, and took the rest for frames of their own.)
#[test]
fn an_answer_half_written_when_the_server_stops_is_finished_not_sent_again() {
    use petrel_proto::Response;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "shutdown_grace = \"3s\"\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let payload: Vec<u8> = (0..15u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut reader = polling_a_big_message(&server, payload.clone(), None);
    let pid = server.child.id().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // Reading again within the grace: every byte after the hello's answer is the poll's answer.
    let mut got = Vec::new();
    reader.read_to_end(&mut got).unwrap();
    let mut answers = &got[..];
    let (id, answer) = read_response(&mut answers);
    let Response::Polled { deliveries: delivered } = answer else { panic!("{answer:?}") };
    assert_eq!((id, delivered.len()), (2, 1));
    assert!(delivered[0].message.payload == payload, "the payload came whole");
    assert!(answers.is_empty(), "{} bytes after the poll's answer", answers.len());
    drop(server);
}

/// A client that stops reading in the middle of an answer is closed at its idle timeout (and the
/// grace after it), its socket with it: the task finishing the half-written answer ends with the
/// connection, and nothing follows the half frame.
#[test]
fn a_client_that_stops_reading_mid_answer_is_closed_socket_and_all() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "idle_timeout = \"1s\"\nshutdown_grace = \"1s\"\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let reader = polling_a_big_message(&server, vec![5u8; 15 << 20], Some(4096));
    let open = descriptors(server.child.id());
    // Past the idle timeout and the grace, its socket is closed on the server's side.
    std::thread::sleep(Duration::from_secs(2));
    common::wait_until("the socket closed", || descriptors(server.child.id()) < open);
    drop(reader);
}

/// A call that times out while its caller's answers back up: the tick (a thread of its own, not
/// the runtime's) hands the TIMEOUT to a task that waits for room in the caller's outbox, and the
/// caller gets it once it reads again. (With the tick outside the runtime, starting that task
/// panicked, and the caller's connection stalled for good.)
#[test]
fn a_call_timed_out_by_the_tick_reaches_a_caller_whose_answers_back_up() {
    use petrel_proto::{Message, Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_queued_responses = 4\nmax_queued_response_bytes = 65536\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    // A function server that takes invocations and never answers them.
    let mut silent = TcpStream::connect(&server.addr).unwrap();
    let mut hello = request_frame(&Request::Hello { client: "silent".into(), features: 0 }, 1);
    hello.extend(request_frame(&Request::Serve { function: "slow".into() }, 2));
    silent.write_all(&hello).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(matches!(read_response(&mut silent), (1, Response::Hello { .. })));
    assert!(matches!(read_response(&mut silent), (2, Response::Done)));
    // The caller: a call with a 1 s limit, then pings by the million, no answer read (a small
    // receive buffer), so that its outbox is full when the call times out.
    let mut caller = TcpStream::connect(&server.addr).unwrap();
    rustix::net::sockopt::set_socket_recv_buffer_size(&caller, 4096).unwrap();
    caller.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut requests = request_frame(&Request::Hello { client: "caller".into(), features: 0 }, 1);
    let call = Request::Call {
        function: "slow".into(),
        timeout_ms: 1_000,
        oneway: false,
        message: Box::new(Message::new(b"anyone?".to_vec())),
    };
    requests.extend(request_frame(&call, 3));
    let ping = request_frame(&Request::Ping, 4);
    for _ in 0..4_000_000 {
        requests.extend_from_slice(&ping);
    }
    let flood = std::thread::spawn(move || {
        let sent = caller.write_all(&requests);
        (caller, sent.is_err())
    });
    let (caller, blocked) = flood.join().unwrap();
    assert!(blocked, "the server stopped reading a caller that does not read");
    std::thread::sleep(Duration::from_millis(1_500)); // past the call's limit, and a tick or two
    // Reading again: the TIMEOUT comes among the first answers (those queued before it).
    caller.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    rustix::net::sockopt::set_socket_recv_buffer_size(&caller, 1 << 20).unwrap(); // (4 KiB windows read slowly)
    let mut answers = std::io::BufReader::with_capacity(1 << 16, &caller);
    let mut pongs = 0u64;
    let answer = loop {
        match read_response(&mut answers) {
            (1, Response::Hello { .. }) => {}
            (3, answer) => break answer,
            (4, _) => pongs += 1,
            (_, other) => panic!("unexpected answer {other:?}"),
        }
        assert!(pongs < 1_000_000, "no answer to the call among the first million");
    };
    assert!(matches!(&answer, Response::Error { status: Status::Timeout, .. }), "{answer:?} after {pongs} pongs");
}

/// A poll or an offer left waiting by a client that then went away stops waiting: the poll takes
/// no message for nobody (the next consumer gets it), and the offer stores nothing once room
/// comes (its producer never had an answer and will send it again).
#[test]
fn requests_waiting_when_their_client_goes_away_take_and_store_nothing() {
    use petrel_proto::{Message, Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let connect = || greeted(&server);
    let message = |text: &str| Message { payload: text.as_bytes().to_vec().into(), ..Message::default() };
    let mut c = connect();
    let config = QueueConfig { durable: true, max_items: 1, ..QueueConfig::default() };
    c.write_all(&request_frame(&Request::QueueCreate { name: "jobs".into(), config: Box::new(config) }, 2)).unwrap();
    assert!(matches!(read_response(&mut c), (2, Response::Done)));

    // A poll for as long as the protocol allows, taking for good (no visibility timeout); then
    // its client goes.
    let mut gone = connect();
    let poll = Request::Poll { queue: "jobs".into(), max: 1, timeout_ms: u32::MAX, visibility_ms: 0 };
    gone.write_all(&request_frame(&poll, 2)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(gone);
    std::thread::sleep(Duration::from_millis(200));
    let offer =
        |text: &str, timeout_ms| Request::Offer { queue: "jobs".into(), timeout_ms, messages: vec![message(text)] };
    c.write_all(&request_frame(&offer("first", 0), 3)).unwrap();
    assert!(matches!(read_response(&mut c), (3, Response::Offered { count: 1, .. })));
    let poll_now = Request::Poll { queue: "jobs".into(), max: 1, timeout_ms: 1_000, visibility_ms: 0 };
    c.write_all(&request_frame(&poll_now, 4)).unwrap();
    match read_response(&mut c) {
        (4, Response::Polled { deliveries }) => assert_eq!(&deliveries[0].message.payload[..], b"first"),
        other => panic!("the message went to the client that left: {other:?}"),
    }

    // An offer waiting for room (the queue holds its one item), whose client then goes.
    c.write_all(&request_frame(&offer("fills it", 0), 5)).unwrap();
    assert!(matches!(read_response(&mut c), (5, Response::Offered { .. })));
    let mut gone = connect();
    gone.write_all(&request_frame(&offer("never answered", u32::MAX), 2)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drop(gone);
    std::thread::sleep(Duration::from_millis(200));
    c.write_all(&request_frame(&poll_now, 6)).unwrap();
    assert!(matches!(read_response(&mut c), (6, Response::Polled { .. })));
    std::thread::sleep(Duration::from_millis(200));
    let poll_short = Request::Poll { queue: "jobs".into(), max: 1, timeout_ms: 300, visibility_ms: 0 };
    c.write_all(&request_frame(&poll_short, 7)).unwrap();
    match read_response(&mut c) {
        (7, Response::Error { status, .. }) => assert_eq!(status, Status::QueueEmpty),
        other => panic!("the offer of a client that left was stored: {other:?}"),
    }
}

#[test]
fn offers_waiting_for_room_and_unfolded_payloads_count_in_the_memory_budget() {
    use petrel_proto::Response;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_memory_bytes = 8388608\n[queues.full]\ndurable = true\nmax_items = 1\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut c = greeted(&server);
    let offer = |payload: Vec<u8>, timeout_ms: u32| compressed_offer("full", payload, timeout_ms);
    c.write_all(&request_frame(&offer(b"first".to_vec(), 0), 2)).unwrap();
    assert!(matches!(read_response(&mut c), (2, Response::Offered { .. })));
    // Four offers of 3 MiB that travel as a few hundred bytes each, all waiting for room in the
    // full queue: two fit in the 8 MiB budget while they wait, the others are refused at once.
    let mut frames = Vec::new();
    for id in 10..14 {
        frames.extend(request_frame(&offer(vec![0u8; 3 << 20], 5_000), id));
    }
    assert!(frames.len() < 4096, "compressed: {} bytes", frames.len());
    let started = std::time::Instant::now();
    c.write_all(&frames).unwrap();
    for _ in 0..2 {
        match read_response(&mut c) {
            (id, Response::Error { status, message }) => {
                // (Which two depends on when the first offer last looked for room.)
                assert!(id > 10 && status == Status::LimitReached, "{id} {status:?} {message}");
                assert!(message.contains("max_memory_bytes"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(4), "refused at once, not at the offers' timeout");
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(ask(&mut mc, "get full\r\n"), "VALUE full 0 5\r\nfirst\r\nEND\r\n");
    // Room comes: one of the waiting offers goes in (whichever looks first).
    let (id, answer) = read_response(&mut c);
    assert!(matches!(answer, Response::Offered { .. }) && (id == 10 || id == 11), "{id} {answer:?}");
    // A payload that unfolds past what the budget has left (the other holds 3 MiB of it) is
    // refused before it is handled.
    c.write_all(&request_frame(&offer(vec![0u8; 6 << 20], 0), 20)).unwrap();
    match read_response(&mut c) {
        (20, Response::Error { status: Status::LimitReached, message }) => {
            assert!(message.contains("unfolds"), "{message}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn one_connection_holds_at_most_its_limit_of_subscriptions() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_subscriptions_per_connection = 3\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        c.create_topic("live", false).await.unwrap();
        c.create_topic("kept", true).await.unwrap();
        let first = c.subscribe("live", 0).await.unwrap();
        let _second = c.subscribe("live", 0).await.unwrap();
        let _third = c.subscribe_group("kept", "g", petrel_proto::StartFrom::Oldest, 0).await.unwrap();
        for refused in [
            c.subscribe("live", 0).await.err(),
            c.subscribe_group("kept", "h", petrel_proto::StartFrom::Oldest, 0).await.err(),
        ] {
            let e = refused.expect("a fourth subscription is refused");
            assert_eq!(e.status(), Some(Status::LimitReached), "{e}");
            assert!(e.to_string().contains("max_subscriptions_per_connection"), "{e}");
        }
        // Another connection has its own; one given back makes room.
        let other = server.client().await;
        other.subscribe("live", 0).await.unwrap();
        first.unsubscribe().await.unwrap();
        c.subscribe("live", 0).await.unwrap();
    });
}

#[test]
fn an_offer_that_waited_for_room_in_a_memory_queue_is_not_counted_twice_when_it_goes_in() {
    use petrel_proto::Response;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_memory_bytes = 8388608\n[queues.mem]\ndurable = false\nmax_items = 1\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut c = greeted(&server);
    let offer = |payload: Vec<u8>, timeout_ms: u32| compressed_offer("mem", payload, timeout_ms);
    c.write_all(&request_frame(&offer(b"first".to_vec(), 0), 2)).unwrap();
    assert!(matches!(read_response(&mut c), (2, Response::Offered { .. })));
    // 5 MiB waits for room (held in the 8 MiB budget); once room comes, the queue counts it
    // instead: it fits, though the two together would not.
    c.write_all(&request_frame(&offer(vec![0u8; 5 << 20], 5_000), 3)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(ask(&mut mc, "get mem\r\n"), "VALUE mem 0 5\r\nfirst\r\nEND\r\n");
    let answer = read_response(&mut c);
    assert!(matches!(answer, (3, Response::Offered { count: 1, .. })), "{answer:?}");
}

/// What a refused reply's test needs: a native connection serving function "f" (HELLO said), the
/// thread of a client calling it (its outcome and how long it waited), and the call's id as the
/// INVOKE pushed to the server named it.
type CallerOutcome = (Result<bytes::Bytes, petrel_client::ClientError>, Duration);

fn a_call_invoked(server: &Server) -> (TcpStream, std::thread::JoinHandle<CallerOutcome>, u64) {
    use petrel_proto::{Request, Response};
    let mut handler = greeted(server);
    handler.write_all(&request_frame(&Request::Serve { function: "f".into() }, 2)).unwrap();
    assert!(matches!(read_response(&mut handler), (2, Response::Done)));
    let addr = server.addr.clone();
    let caller = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let c = petrel_client::Client::connect(&addr).await.unwrap();
            let started = std::time::Instant::now();
            let called = c.call("f", petrel_client::Message::new(b"hi".to_vec()), Some(Duration::from_secs(60))).await;
            (called.map(|m| m.payload), started.elapsed())
        })
    });
    // The invocation's frame: its request id is the call's.
    let mut len = [0u8; 4];
    handler.read_exact(&mut len).unwrap();
    let mut frame = vec![0u8; u32::from_be_bytes(len) as usize];
    handler.read_exact(&mut frame).unwrap();
    (handler, caller, u64::from_be_bytes(frame[4..12].try_into().unwrap()))
}

/// The replier's RETURN (request id 3) was answered BAD_REQUEST, and its caller was refused at
/// once rather than left to its call's timeout.
fn refused_to_both(handler: &mut TcpStream, caller: std::thread::JoinHandle<CallerOutcome>) {
    use petrel_proto::Response;
    let (id, answer) = read_response(handler);
    assert!(id == 3 && matches!(answer, Response::Error { status: Status::BadRequest, .. }), "{answer:?}");
    let (called, took) = caller.join().unwrap();
    let e = called.unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
    assert!(took < Duration::from_secs(30), "the caller waited {took:?}");
}

/// A reply the server refuses before it reaches the function's broker (its compressed payload does
/// not unfold) is refused to its caller too, at once: the caller waited for its call's timeout.
#[test]
fn a_reply_refused_as_it_arrives_fails_its_call_at_once() {
    use petrel_proto::{Message, Request};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let (mut handler, caller, call) = a_call_invoked(&server);
    let garbled = Message { payload: b"not zstd at all".to_vec().into(), compressed: true, ..Message::default() };
    let reply = Request::Return { call, status: Status::Ok, error: String::new(), message: Box::new(garbled) };
    handler.write_all(&request_frame(&reply, 3)).unwrap();
    refused_to_both(&mut handler, caller);
}

/// A RETURN whose body does not decode (here cut short) is refused to its replier, and to its
/// caller at once when the call it names can be read from its first bytes: the caller waited for
/// its call's timeout.
#[test]
fn a_reply_that_does_not_decode_fails_its_call_at_once() {
    use petrel_proto::{Message, Request};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let (mut handler, caller, call) = a_call_invoked(&server);
    let reply = Request::Return {
        call,
        status: Status::Ok,
        error: String::new(),
        message: Box::new(Message::new(b"a reply".to_vec())),
    };
    let mut cut = request_frame(&reply, 3);
    cut.truncate(cut.len() - 3);
    let new_len = (cut.len() - 4) as u32;
    cut[..4].copy_from_slice(&new_len.to_be_bytes());
    handler.write_all(&cut).unwrap();
    refused_to_both(&mut handler, caller);
}

/// A native connection to `server` that said HELLO.
fn greeted(server: &Server) -> TcpStream {
    use petrel_proto::{Request, Response};
    let mut c = TcpStream::connect(&server.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(&request_frame(&Request::Hello { client: "test".into(), features: 0 }, 1)).unwrap();
    assert!(matches!(read_response(&mut c), (1, Response::Hello { .. })));
    c
}

/// An offer of many empty messages waiting for room counts what the messages take, not only
/// their bytes (none): 100,000 of them hold ~30 MB while they wait, and an 8 MiB budget refuses
/// them at once; ten wait as before.
#[test]
fn offers_of_many_small_messages_waiting_for_room_count_what_they_hold() {
    use petrel_proto::Response;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_memory_bytes = 8388608\n[queues.full]\ndurable = true\nmax_items = 100000\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut c = greeted(&server);
    let offer = |n: usize, timeout_ms: u32| petrel_proto::Request::Offer {
        queue: "full".into(),
        timeout_ms,
        messages: vec![petrel_proto::Message::default(); n],
    };
    for (id, n) in [(2, 1), (3, 99_999)] {
        c.write_all(&request_frame(&offer(n, 0), id)).unwrap();
        assert!(matches!(read_response(&mut c), (_, Response::Offered { .. })), "filled");
    }
    c.write_all(&request_frame(&offer(100_000, 5_000), 4)).unwrap();
    match read_response(&mut c) {
        (4, Response::Error { status: Status::LimitReached, message }) => {
            assert!(message.contains("max_memory_bytes"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Ten wait for room, and go in when it comes.
    c.write_all(&request_frame(&offer(10, 60_000), 5)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for _ in 0..10 {
        assert_eq!(ask(&mut mc, "get full\r\n"), "VALUE full 0 0\r\n\r\nEND\r\n");
    }
    assert!(matches!(read_response(&mut c), (5, Response::Offered { count: 10, .. })));
}

/// An offer of one message to `queue`, its `payload` compressed.
fn compressed_offer(queue: &str, payload: Vec<u8>, timeout_ms: u32) -> petrel_proto::Request {
    let mut message = petrel_proto::Message { payload: payload.into(), ..Default::default() };
    petrel_proto::compression::compress(&mut message, 1);
    petrel_proto::Request::Offer { queue: queue.into(), timeout_ms, messages: vec![message] }
}

#[test]
fn one_connection_serves_at_most_its_limit_of_functions() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_functions_per_connection = 2\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = server.client().await;
        let echo = |m: petrel_client::Message| async move { Ok(m) };
        c.serve("f1", echo).await.unwrap();
        c.serve("f2", echo).await.unwrap();
        // Serving a name again is no new name.
        c.serve("f2", echo).await.unwrap();
        let e = c.serve("f3", echo).await.expect_err("a third name is refused");
        assert_eq!(e.status(), Some(Status::LimitReached), "{e}");
        assert!(e.to_string().contains("max_functions_per_connection"), "{e}");
        // What was served goes on; one given back makes room.
        let caller = server.client().await;
        let reply = caller.call("f2", petrel_client::Message::new(&b"hi"[..]), None).await.unwrap();
        assert_eq!(&reply.payload[..], b"hi");
        let e = caller.call("f3", petrel_client::Message::new(&b"hi"[..]), None).await.expect_err("f3 is not served");
        assert_eq!(e.status(), Some(Status::FunctionNotFound), "{e}");
        c.unserve("f1").await.unwrap();
        c.serve("f3", echo).await.unwrap();
        let reply = caller.call("f3", petrel_client::Message::new(&b"again"[..]), None).await.unwrap();
        assert_eq!(&reply.payload[..], b"again");
    });
}

/// A Unix-socket connection past `max_connections` is told why, as a TCP one is (it was closed
/// without a word).
#[test]
fn a_unix_socket_connection_past_max_connections_is_told_why() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_connections = 1\n");
    let socket = dir.path().join("petrel.sock");
    let server =
        Server::start_with(&dir.path().join("data"), &["--config", &config, "--unix-socket", socket.to_str().unwrap()]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let _first = server.client().await;
        let e = petrel_client::Client::connect_unix(&socket).await.expect_err("refused");
        assert_eq!(e.status(), Some(Status::LimitReached), "{e}");
        assert!(e.to_string().contains("max_connections"), "{e}");
    });
}

/// With every permit of a connection held by waiting requests (two polls waiting a minute, at
/// `max_in_flight_per_connection = 2`), the answers already made go out before the reading
/// stops: a client that waits for one of them (a PONG here; an OFFERED it wants before it makes
/// what the polls wait for, in practice) got it only when a poll ended. And requests under way
/// are not idleness: the connection outlives `idle_timeout` while its polls wait.
#[test]
fn answers_ready_go_out_while_waiting_requests_hold_every_permit() {
    use petrel_proto::{Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_in_flight_per_connection = 2\nidle_timeout = \"1s\"\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut c = greeted(&server);
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut requests = request_frame(&Request::QueueCreate { name: "q".into(), config: Default::default() }, 2);
    let poll =
        |id| request_frame(&Request::Poll { queue: "q".into(), max: 1, timeout_ms: 3_000, visibility_ms: 0 }, id);
    requests.extend(poll(3));
    requests.extend(poll(4));
    requests.extend(request_frame(&Request::Ping, 5));
    requests.extend(poll(6)); // a third: its wait for a permit holds the reading
    c.write_all(&requests).unwrap();
    let started = std::time::Instant::now();
    assert_eq!(read_response(&mut c).0, 2, "the queue made");
    let (id, pong) = read_response(&mut c);
    assert_eq!((id, matches!(pong, Response::Pong)), (5, true), "{pong:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "the PONG waited {:?}", started.elapsed());
    // Then the polls end empty (past the 1 s idle timeout: the connection is not idle).
    let mut rest: Vec<u64> = (0..3).map(|_| read_response(&mut c).0).collect();
    rest.sort();
    assert_eq!(rest, [3, 4, 6]);
}

/// A client that goes away while its requests wait for a permit is noticed: its waiting polls
/// stop and take nothing for it (the wait for a permit read nothing, and its polls, taking for
/// good, took what came next for a client that was gone).
#[test]
fn a_client_gone_while_its_requests_wait_for_a_permit_takes_nothing() {
    use petrel_proto::Request;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_in_flight_per_connection = 2\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut c = greeted(&server);
    let mut requests = request_frame(&Request::QueueCreate { name: "q".into(), config: Default::default() }, 2);
    let poll =
        |id| request_frame(&Request::Poll { queue: "q".into(), max: 1, timeout_ms: 60_000, visibility_ms: 0 }, id);
    for id in 3..6 {
        requests.extend(poll(id));
    }
    c.write_all(&requests).unwrap();
    assert_eq!(read_response(&mut c).0, 2, "the queue made");
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let other = server.client().await;
        other.offer("q", vec![petrel_client::Message::new(&b"kept"[..])], None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let got = other.poll("q", petrel_client::PollOptions::default()).await.unwrap();
        assert_eq!(got.len(), 1, "no poll of the gone client took it");
    });
}

/// A frame header announcing more than `max_frame_bytes` while the connection's requests hold
/// every permit (the loop reads on, waiting for one): no room is made for it and nothing is
/// held of the memory budget (a gigabyte was held while the polls waited); it is refused
/// TOO_LARGE once its turn comes.
#[test]
fn an_oversized_frame_read_while_requests_wait_holds_nothing() {
    use petrel_proto::{Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "max_in_flight_per_connection = 2\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut c = greeted(&server);
    c.write_all(&request_frame(&Request::QueueCreate { name: "w".into(), config: Default::default() }, 2)).unwrap();
    assert!(matches!(read_response(&mut c), (2, Response::Done)));
    let poll =
        |id| request_frame(&Request::Poll { queue: "w".into(), max: 1, timeout_ms: 2_000, visibility_ms: 0 }, id);
    for id in 3..6 {
        c.write_all(&poll(id)).unwrap(); // the third waits for a permit
    }
    // A header of about a gigabyte (the rest never sent), opcode PING, request id 9.
    let mut header = (0x3fff_fff0u32).to_be_bytes().to_vec();
    header.extend_from_slice(&[1, 0, 0, 1]);
    header.extend_from_slice(&9u64.to_be_bytes());
    c.write_all(&header).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    mc.write_all(b"stats\r\n").unwrap();
    let (mut stats, mut reader) = (String::new(), std::io::BufReader::new(&mut mc));
    while !stats.ends_with("END\r\n") {
        std::io::BufRead::read_line(&mut reader, &mut stats).unwrap();
    }
    let queued = stats.lines().find_map(|l| l.strip_prefix("STAT memory_queued_bytes "));
    let queued: u64 = queued.unwrap().trim().parse().unwrap();
    assert!(queued < 1 << 20, "{queued} bytes held");
    // The polls end empty at their timeout, then the frame is refused.
    let mut answers: Vec<_> = (0..4).map(|_| read_response(&mut c)).collect();
    answers.sort_by_key(|a| a.0);
    assert!(matches!(&answers[3], (9, Response::Error { status: Status::TooLarge, .. })), "{answers:?}");
}

/// A DELIVER push holds messages together only while it stays within `max_push_bytes` (one
/// message alone may be larger): a small message and a large one behind it went out in one
/// frame longer than the frame size the server advertises, which a client may hold it to.
#[test]
fn a_large_message_goes_out_in_a_deliver_of_its_own() {
    use petrel_proto::{Message, Push, Request, Response};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let mut sub = greeted(&server);
    sub.write_all(&request_frame(&Request::TopicCreate { name: "t".into(), durable: false }, 2)).unwrap();
    assert!(matches!(read_response(&mut sub), (2, Response::Done)));
    let subscribe = Request::Subscribe {
        topic: "t".into(),
        buffer: 16,
        group: String::new(),
        from: petrel_proto::StartFrom::Resume,
    };
    sub.write_all(&request_frame(&subscribe, 3)).unwrap();
    assert!(matches!(read_response(&mut sub), (3, Response::Subscribed { .. })));
    let mut publisher = greeted(&server);
    let message = |bytes: usize| Message { payload: vec![7u8; bytes].into(), ..Message::default() };
    // Three rounds: a round whose second message comes after the subscriber's task has sent
    // the first would pass without the limit too.
    for round in 0..3 {
        let publish = Request::Publish { topic: "t".into(), messages: vec![message(60 << 10), message(1 << 20)] };
        publisher.write_all(&request_frame(&publish, 10 + round)).unwrap();
        assert!(matches!(read_response(&mut publisher), (_, Response::Published { subscribers: 1 })));
    }
    let mut per_frame = Vec::new();
    while per_frame.iter().sum::<usize>() < 6 {
        let mut len = [0u8; 4];
        sub.read_exact(&mut len).unwrap();
        let mut frame = vec![0u8; u32::from_be_bytes(len) as usize];
        sub.read_exact(&mut frame).unwrap();
        let opcode = u16::from_be_bytes([frame[2], frame[3]]);
        match Push::decode(opcode, bytes::Bytes::copy_from_slice(&frame[12..])).unwrap() {
            Push::Deliver { messages } => per_frame.push(messages.len()),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(per_frame, [1; 6]);
}

/// A memcache client that reads a large value slowly, but steadily, gets all of it: the idle
/// timeout counts from the last byte it took. Before, it counted from the start of the answer's
/// write, and the connection was closed mid-value (the item, taken for good, lost).
#[test]
fn a_memcache_client_reading_a_large_value_slowly_gets_all_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), "idle_timeout = \"1s\"\n");
    let server = Server::start_with(&dir.path().join("data"), &["--config", &config]);
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // A small receive buffer: the server's socket fills, and its write waits on this reader.
    rustix::net::sockopt::set_socket_recv_buffer_size(&mc, 16 << 10).unwrap();
    let value = vec![b'v'; 12 << 20];
    mc.write_all(format!("set big 0 0 {}\r\n", value.len()).as_bytes()).unwrap();
    mc.write_all(&value).unwrap();
    mc.write_all(b"\r\n").unwrap();
    let mut stored = [0u8; 8];
    mc.read_exact(&mut stored).unwrap();
    assert_eq!(&stored, b"STORED\r\n");
    mc.write_all(b"get big\r\n").unwrap();
    let head = format!("VALUE big 0 {}\r\n", value.len());
    let mut answer = vec![0u8; head.len() + value.len() + b"\r\nEND\r\n".len()];
    let started = std::time::Instant::now();
    // 64 KiB every 10 ms: about 2 s for the whole value, twice the idle timeout.
    for chunk in answer.chunks_mut(64 << 10) {
        mc.read_exact(chunk).expect("the value, not a close");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(started.elapsed() > Duration::from_millis(1_500), "read slower than the idle timeout");
    assert!(answer.starts_with(head.as_bytes()) && answer.ends_with(b"v\r\nEND\r\n"));
}
