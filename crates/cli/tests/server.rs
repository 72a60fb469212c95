//! The real `petrel serve` on a free loopback port, driven by the Rust client.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use petrel_client::{Client, ClientError, Message, PollOptions, QueueConfig, Status};

mod common;
use common::Server;

fn msg(s: &str) -> Message {
    Message::new(s.as_bytes().to_vec())
}

fn texts(ds: &[petrel_client::Delivery]) -> Vec<String> {
    ds.iter().map(|d| String::from_utf8_lossy(&d.message.payload).into_owned()).collect()
}

const TAKE: PollOptions = PollOptions { max: 100, timeout: Duration::ZERO, visibility: None };

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_competing_consumers_and_tentative_reads() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let a = server.client().await;
    let b = server.client().await;
    a.create_queue("q", QueueConfig::default()).await.unwrap();
    a.offer("q", (0..6).map(|i| msg(&format!("m{i}"))).collect(), None).await.unwrap();
    let first = a.poll("q", PollOptions { max: 2, ..TAKE }).await.unwrap();
    let second = b.poll("q", PollOptions { max: 2, ..TAKE }).await.unwrap();
    assert_eq!(texts(&first), ["m0", "m1"]);
    assert_eq!(texts(&second), ["m2", "m3"]);

    // A tentative read comes back when its consumer disconnects...
    let vis = PollOptions { max: 1, timeout: Duration::ZERO, visibility: Some(Duration::from_secs(60)) };
    let taken = b.poll("q", vis).await.unwrap();
    assert_eq!(texts(&taken), ["m4"]);
    drop(b);
    common::wait_until_async("the read to come back", || async { a.queue_status("q").await.unwrap().in_flight == 0 })
        .await;
    let again = a.poll("q", PollOptions { timeout: Duration::from_secs(5), ..vis }).await.unwrap();
    assert_eq!(texts(&again), ["m4"], "returned to the head when its consumer left");
    // ...and when its visibility timeout passes.
    let short = PollOptions { max: 1, timeout: Duration::ZERO, visibility: Some(Duration::from_millis(100)) };
    let m5 = a.poll("q", short).await.unwrap();
    assert_eq!(texts(&m5), ["m5"]);
    let back = a.poll("q", PollOptions { max: 1, timeout: Duration::from_secs(5), visibility: None }).await.unwrap();
    assert_eq!(texts(&back), ["m5"]);
    assert_eq!(a.ack("q", &[again[0].handle]).await.unwrap(), 1);
    assert!(a.poll("q", TAKE).await.unwrap().is_empty());
}

/// The message flag `durable` over the wire: kept (and synced) by a durable queue and a durable
/// topic, refused with BAD_REQUEST by an in-memory queue and a live topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_durable_flag_is_honoured_by_durable_destinations_and_refused_by_others() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("disk", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    c.create_queue("memory", QueueConfig::default()).await.unwrap();
    c.create_topic("live", false).await.unwrap();
    c.create_topic("kept", true).await.unwrap();
    let durable = || Message { durable: true, ..msg("d") };
    c.offer("disk", vec![durable()], None).await.unwrap();
    let refused = c.offer("memory", vec![durable()], None).await.unwrap_err();
    assert_eq!(refused.status(), Some(Status::BadRequest), "{refused}");
    assert!(refused.to_string().contains("durable queue"), "{refused}");
    c.publish("kept", vec![durable()]).await.unwrap();
    let refused = c.publish("live", vec![durable()]).await.unwrap_err();
    assert_eq!(refused.status(), Some(Status::BadRequest), "{refused}");
    let got = c.poll("disk", TAKE).await.unwrap();
    assert_eq!(texts(&got), ["d"]);
    assert!(!got[0].message.durable, "deliveries do not carry the flag");
    assert_eq!(c.queue_status("memory").await.unwrap().items, 0);
    // Calls and replies are never stored: a durable call is refused, and a durable reply is
    // refused with its caller told at once.
    let refused = c.call("f", durable(), Some(Duration::from_secs(5))).await.unwrap_err();
    assert_eq!(refused.status(), Some(Status::BadRequest), "{refused}");
    let server_side = server.client().await;
    server_side.serve("f", |_m: Message| async { Ok(Message { durable: true, ..msg("reply") }) }).await.unwrap();
    let started = std::time::Instant::now();
    let failed = c.call("f", msg("q"), Some(Duration::from_secs(30))).await.unwrap_err();
    assert_eq!(failed.status(), Some(Status::HandlerError), "{failed}");
    assert!(failed.to_string().contains("durable"), "{failed}");
    assert!(started.elapsed() < Duration::from_secs(10), "not left to its timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temporary_bounded_circular_expiry_and_fanout() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    let owner = server.client().await;
    owner.create_queue("reply.7", QueueConfig { temporary: true, ..QueueConfig::default() }).await.unwrap();
    assert!(c.list_queues().await.unwrap().contains(&"reply.7".to_string()));
    drop(owner);
    common::wait_until_async("the temporary queue to go with its connection", || async {
        !c.list_queues().await.unwrap().contains(&"reply.7".to_string())
    })
    .await;

    c.create_queue("small", QueueConfig { max_items: 2, ..QueueConfig::default() }).await.unwrap();
    c.offer("small", vec![msg("1"), msg("2")], None).await.unwrap();
    let full = c.offer("small", vec![msg("3")], Some(Duration::from_millis(50))).await.unwrap_err();
    assert_eq!(full.status(), Some(Status::QueueFull));
    // An offer that waits gets in once a poll makes room. Its first poll puts it on the wire;
    // the server takes a connection's requests in order, so once the PING behind it is
    // answered, the offer has found the queue full and is waiting.
    let offerer = server.client().await;
    let mut waiting = Box::pin(offerer.offer("small", vec![msg("3")], Some(Duration::from_secs(10))));
    assert!(futures::poll!(waiting.as_mut()).is_pending());
    offerer.ping().await.unwrap();
    c.poll("small", PollOptions { max: 1, ..TAKE }).await.unwrap();
    waiting.await.unwrap();

    c.create_queue("ring", QueueConfig { max_items: 2, circular: true, ..QueueConfig::default() }).await.unwrap();
    // More than the ring holds at once keeps the newest, as a circular queue does item by item.
    c.offer("ring", vec![msg("a"), msg("b"), msg("c")], None).await.unwrap();
    assert_eq!(texts(&c.poll("ring", TAKE).await.unwrap()), ["b", "c"]);
    c.offer("ring", vec![msg("a"), msg("b")], None).await.unwrap();
    c.offer("ring", vec![msg("c")], None).await.unwrap();
    assert_eq!(texts(&c.poll("ring", TAKE).await.unwrap()), ["b", "c"]);
    assert_eq!(c.queue_status("ring").await.unwrap().dropped, 2);

    c.create_queue("dead", QueueConfig::default()).await.unwrap();
    c.create_queue("short", QueueConfig { ttl_ms: 50, dead_letter: "dead".into(), ..QueueConfig::default() })
        .await
        .unwrap();
    c.offer("short", vec![msg("stale")], None).await.unwrap();
    // The broker's tick moves it to the dead letters once its 50 ms are up.
    let dead = c.poll("dead", PollOptions { max: 1, timeout: Duration::from_secs(5), visibility: None }).await;
    assert_eq!(texts(&dead.unwrap()), ["stale"]);
    assert!(c.poll("short", TAKE).await.unwrap().is_empty());

    for q in ["orders", "orders+audit"] {
        c.create_queue(q, QueueConfig::default()).await.unwrap();
    }
    c.offer("orders", vec![msg("o")], None).await.unwrap();
    assert_eq!(texts(&c.poll("orders+audit", TAKE).await.unwrap()), ["o"]);
    let missing = c.poll("nope", TAKE).await.unwrap_err();
    assert_eq!(missing.status(), Some(Status::QueueNotFound));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_bounded_queue_counts_open_reads_and_returned_ones_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let (a, b) = (server.client().await, server.client().await);
    let open = PollOptions { visibility: Some(Duration::from_secs(60)), ..TAKE };
    for durable in [false, true] {
        let q = format!("five-{durable}");
        a.create_queue(&q, QueueConfig { durable, max_items: 5, ..QueueConfig::default() }).await.unwrap();
        a.offer(&q, (0..5).map(|i| msg(&format!("m{i}"))).collect(), None).await.unwrap();
        let kept = a.poll(&q, PollOptions { max: 1, ..open }).await.unwrap();
        let taken = b.poll(&q, PollOptions { max: 4, ..open }).await.unwrap();
        assert_eq!(b.ack(&q, &taken.iter().map(|d| d.handle).collect::<Vec<_>>()).await.unwrap(), 4);
        let status = a.queue_status(&q).await.unwrap();
        assert_eq!((status.items, status.in_flight), (0, 1), "durable {durable}");
        for i in 0..5 {
            a.offer(&q, vec![msg(&format!("n{i}"))], None).await.unwrap();
        }
        assert_eq!(a.ack(&q, &[kept[0].handle]).await.unwrap(), 1);

        let q = format!("two-{durable}");
        a.create_queue(&q, QueueConfig { durable, max_items: 2, ..QueueConfig::default() }).await.unwrap();
        a.offer(&q, vec![msg("x"), msg("y")], None).await.unwrap();
        let taken = a.poll(&q, PollOptions { max: 2, ..open }).await.unwrap();
        assert_eq!(a.abort(&q, &taken.iter().map(|d| d.handle).collect::<Vec<_>>()).await.unwrap(), 2);
        assert_eq!(a.queue_status(&q).await.unwrap().items, 2, "durable {durable}");
        let full = a.offer(&q, vec![msg("z")], None).await.unwrap_err();
        assert_eq!(full.status(), Some(Status::QueueFull));
        assert_eq!(texts(&a.poll(&q, TAKE).await.unwrap()), ["x", "y"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_for_everything_answers_what_fits_the_advertised_frame() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "max_message_bytes = 65536\nmax_frame_bytes = 1048576\n").unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let c = server.client().await;
    for durable in [false, true] {
        let q = if durable { "disk" } else { "memory" };
        c.create_queue(q, QueueConfig { durable, ..QueueConfig::default() }).await.unwrap();
        for i in 0..40u8 {
            c.offer(q, vec![Message::new(vec![i; 60_000])], None).await.unwrap();
        }
        let mut seen = Vec::new();
        loop {
            let answer = c.poll(q, PollOptions { max: u32::MAX, ..TAKE }).await.unwrap();
            if answer.is_empty() {
                break;
            }
            let bytes: usize = answer.iter().map(|d| d.message.payload.len()).sum();
            assert!(bytes < 1_048_576, "{bytes} bytes of payload in one answer");
            let last = seen.len() + answer.len() == 40;
            assert!(answer.len() >= 15 || last, "an answer is filled, not one by one: {}", answer.len());
            seen.extend(answer.iter().map(|d| d.message.payload[0]));
        }
        assert_eq!(seen, (0..40).collect::<Vec<u8>>(), "all, in order, none twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_garbage_frames_are_answered_and_the_server_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("q", QueueConfig::default()).await.unwrap();
    // A 20 MB message: over the frame limit. TOO_LARGE, and the same connection still works.
    let big = c.offer("q", vec![Message::new(vec![7u8; 20 << 20])], None).await.unwrap_err();
    assert_eq!(big.status(), Some(Status::TooLarge), "{big}");
    c.offer("q", vec![msg("after")], None).await.unwrap();
    assert_eq!(texts(&c.poll("q", TAKE).await.unwrap()), ["after"]);

    // Garbage on another connection: a length shorter than a header. That connection is closed.
    let mut raw = std::net::TcpStream::connect(&server.addr).unwrap();
    raw.write_all(&[0, 0, 0, 3, 1, 2, 3, 4, 5, 6, 7]).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    let _ = raw.read_to_end(&mut rest);
    assert!(rest.is_empty(), "closed without an answer");
    // A whole frame with an unknown opcode: UNSUPPORTED, connection kept.
    let mut raw = std::net::TcpStream::connect(&server.addr).unwrap();
    raw.write_all(&[0, 0, 0, 12, 1, 0, 0x07, 0x77, 0, 0, 0, 0, 0, 0, 0, 9]).unwrap();
    let mut answer = [0u8; 17];
    raw.read_exact(&mut answer).unwrap();
    assert_eq!(&answer[6..16], &[0x07, 0x77, 0, 0, 0, 0, 0, 0, 0, 9]);
    assert_eq!(answer[16], Status::Unsupported as u8);
    // Everyone else is still served.
    c.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_offer_a_thousand_each_with_none_lost_or_repeated() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("load", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    let mut tasks = Vec::new();
    for client in 0..200 {
        let addr = server.addr.clone();
        tasks.push(tokio::spawn(async move {
            let c = Client::connect(addr.as_str()).await.unwrap();
            for batch in 0..10 {
                let messages = (0..100).map(|i| msg(&format!("{client}:{}", batch * 100 + i))).collect();
                c.offer("load", messages, Some(Duration::from_secs(30))).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut seen = HashSet::new();
    loop {
        let got = c.poll("load", PollOptions { max: 5000, ..TAKE }).await.unwrap();
        if got.is_empty() {
            break;
        }
        for d in got {
            assert!(seen.insert(d.message.payload.clone()), "duplicate {:?}", d.message.payload);
        }
    }
    assert_eq!(seen.len(), 200_000);
}

/// Offers to queues with durability `always` are answered by the server's per-queue waits for
/// the disk: 32 connections offering one at a time to two such queues at once each get every
/// answer, and every answered offer is there once after `kill -9`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_offers_to_two_always_queues_are_each_answered_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    let always = QueueConfig { durable: true, durability: "always".into(), ..QueueConfig::default() };
    for queue in ["sync-a", "sync-b"] {
        c.create_queue(queue, always.clone()).await.unwrap();
    }
    let mut tasks = Vec::new();
    for client in 0..32 {
        let addr = server.addr.clone();
        tasks.push(tokio::spawn(async move {
            let c = Client::connect(addr.as_str()).await.unwrap();
            for i in 0..40 {
                let queue = if (client + i) % 2 == 0 { "sync-a" } else { "sync-b" };
                c.offer(queue, vec![msg(&format!("{client}:{i}"))], None).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    drop(c);
    server.kill9();
    let server = Server::start(dir.path());
    let c = server.client().await;
    for (queue, parity) in [("sync-a", 0), ("sync-b", 1)] {
        let mut got: Vec<String> = Vec::new();
        loop {
            let batch = c.poll(queue, PollOptions { max: 1000, ..TAKE }).await.unwrap();
            if batch.is_empty() {
                break;
            }
            got.extend(texts(&batch));
        }
        got.sort();
        let mut expected: Vec<String> = (0..32)
            .flat_map(|client| {
                (0..40).filter(move |i| (client + i) % 2 == parity).map(move |i| format!("{client}:{i}"))
            })
            .collect();
        expected.sort();
        assert_eq!(got, expected, "{queue}: every answered offer, once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_messages_survive_kill_9_and_sigterm_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    for chunk in 0..10 {
        let batch = (0..100).map(|i| msg(&format!("job-{}", chunk * 100 + i))).collect();
        c.offer("jobs", batch, None).await.unwrap();
    }
    // Taken tentatively and never acknowledged: back as ordinary messages after the restart.
    let taken = c
        .poll("jobs", PollOptions { max: 5, timeout: Duration::ZERO, visibility: Some(Duration::from_secs(600)) })
        .await
        .unwrap();
    assert_eq!(taken.len(), 5);
    drop(c);
    server.kill9();

    let server = Server::start(dir.path());
    let c = server.client().await;
    let mut got = Vec::new();
    loop {
        let batch = c.poll("jobs", PollOptions { max: 300, ..TAKE }).await.unwrap();
        if batch.is_empty() {
            break;
        }
        got.extend(texts(&batch));
    }
    let expected: Vec<String> = (0..1000).map(|i| format!("job-{i}")).collect();
    assert_eq!(got, expected, "every durable message, in order");
    drop(c);
    let status = server.terminate();
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
    let _ = ClientError::Closed;
}

/// An OFFER of many messages is stored whole or not at all, across `kill -9` too: producers
/// offer batches of 1 to 300 messages (each saying its batch and place) until the server is
/// killed; after a restart the queue holds whole batches only, each in one piece, every
/// answered one among them. (`crates/log/tests/crash_batches.rs` kills a writer mid-batch far
/// more often; this is the same guarantee seen through the server.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_of_many_messages_survives_kill_9_whole_or_not_at_all() {
    fn batch_len(producer: u64, k: u64) -> usize {
        1 + ((producer * 7919 + k).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize % 300
    }
    fn payload(producer: u64, k: u64, i: usize) -> Vec<u8> {
        let mut p = format!("{producer}:{k}:{i}/{}:", batch_len(producer, k)).into_bytes();
        p.resize(p.len() + (k as usize * 131 + i * 17) % 2000, b'a' + (i % 26) as u8);
        p
    }
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    server
        .client()
        .await
        .create_queue("batches", QueueConfig { durable: true, ..QueueConfig::default() })
        .await
        .unwrap();
    let mut next = [0u64; 4];
    for round in 0..8u64 {
        let mut producers = Vec::new();
        for producer in 0..4u64 {
            let (addr, first) = (server.addr.clone(), next[producer as usize]);
            producers.push(tokio::spawn(async move {
                let c = Client::connect(addr.as_str()).await.unwrap();
                let mut answered = Vec::new();
                for k in first.. {
                    let batch = (0..batch_len(producer, k)).map(|i| Message::new(payload(producer, k, i))).collect();
                    match c.offer("batches", batch, None).await {
                        Ok(_) => answered.push(k),
                        Err(_) => return answered,
                    }
                }
                unreachable!()
            }));
        }
        tokio::time::sleep(Duration::from_millis(100 + round * 40)).await;
        server.kill9();
        let mut answered = Vec::new();
        for p in producers {
            answered.push(p.await.unwrap());
        }
        server = Server::start(dir.path());
        let c = server.client().await;
        let mut got = Vec::new();
        loop {
            let batch = c.poll("batches", PollOptions { max: 1000, ..TAKE }).await.unwrap();
            if batch.is_empty() {
                break;
            }
            got.extend(batch.into_iter().map(|d| d.message.payload.to_vec()));
        }
        // Whole batches, each in one piece: record i of a batch follows record i - 1.
        let mut at = 0;
        let mut stored = HashSet::new();
        while at < got.len() {
            let head =
                String::from_utf8_lossy(&got[at][..got[at].iter().position(|&b| b == b'/').unwrap()]).into_owned();
            let [producer, k, _]: [u64; 3] =
                head.split(':').map(|n| n.parse().unwrap()).collect::<Vec<_>>().try_into().unwrap();
            for i in 0..batch_len(producer, k) {
                assert!(
                    got.get(at + i) == Some(&payload(producer, k, i)),
                    "round {round}: message {i} of producer {producer}'s batch {k} is not where the batch's first was followed"
                );
            }
            at += batch_len(producer, k);
            stored.insert((producer, k));
            next[producer as usize] = next[producer as usize].max(k + 1);
        }
        for (producer, ks) in answered.iter().enumerate() {
            for &k in ks {
                assert!(
                    stored.contains(&(producer as u64, k)),
                    "round {round}: producer {producer}'s answered batch {k} is lost"
                );
                next[producer] = next[producer].max(k + 1);
            }
        }
    }
}

/// A poison message on a durable queue with `max_deliveries` 4: its consumers take it and go
/// away (each a return), the server is killed with `kill -9` between returns, and the message
/// reaches the dead-letter queue after exactly four deliveries, its count carried across the
/// restart; the message behind it is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_after_exactly_max_deliveries_across_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    let c = server.client().await;
    let config =
        QueueConfig { durable: true, max_deliveries: 4, dead_letter: "jobs.poison".into(), ..QueueConfig::default() };
    c.create_queue("jobs", config).await.unwrap();
    c.offer("jobs", vec![msg("poison"), msg("fine")], None).await.unwrap();
    drop(c);
    let tentative = PollOptions { max: 1, timeout: Duration::from_secs(5), visibility: Some(Duration::from_secs(600)) };
    let mut seen = Vec::new();
    for delivery in 1..=4u32 {
        let consumer = server.client().await;
        let d = consumer.poll("jobs", tentative).await.unwrap();
        assert_eq!(texts(&d), ["poison"], "delivery {delivery}");
        seen.push(d[0].message.deliveries);
        drop(consumer); // a consumer that dies on it: the read comes back
        let watcher = server.client().await;
        common::wait_until_async("the read to come back", || async {
            watcher.queue_status("jobs").await.unwrap().in_flight == 0
        })
        .await;
        drop(watcher);
        if delivery == 2 {
            server.kill9();
            server = Server::start(dir.path());
        }
    }
    assert_eq!(seen, [1, 2, 3, 4], "the count survives kill -9");
    let c = server.client().await;
    // The read is back (in_flight 0) a moment before its move to the dead-letter queue is done.
    common::wait_until_async("the dead letter", || async {
        c.queue_status("jobs.poison").await.is_ok_and(|s| s.items == 1)
    })
    .await;
    let moved = c.poll("jobs.poison", PollOptions { max: 10, ..TAKE }).await.unwrap();
    assert_eq!(texts(&moved), ["poison"], "in the dead-letter queue after exactly four deliveries");
    let header = |name: &str| moved[0].message.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.to_vec());
    assert_eq!(header("petrel-dead-letter-reason"), Some(b"max_deliveries".to_vec()));
    assert_eq!(header("petrel-deliveries"), Some(b"4".to_vec()));
    let rest = c.poll("jobs", PollOptions { max: 10, ..TAKE }).await.unwrap();
    assert_eq!((texts(&rest), rest[0].message.deliveries), (vec!["fine".to_string()], 1));
    let status = c.queue_status("jobs").await.unwrap();
    assert_eq!((status.items, status.in_flight, status.config.max_deliveries), (0, 0, 4));
}

/// Priorities against the real binary: a backlog of low-priority work, then two producers at
/// once (one low, one urgent), then `kill -9` and a restart; one consumer then takes everything.
/// Each level comes out in its producer's order, the urgent work ahead of the backlog, and the
/// backlog still gets its share (10 % of takes while urgent work waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priorities_with_two_producers_and_a_backlog_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("work", QueueConfig { durable: true, priorities: 3, ..QueueConfig::default() }).await.unwrap();
    let at = |priority: u8, text: String| Message { priority, ..msg(&text) };
    for chunk in 0..10 {
        let backlog = (0..100).map(|i| at(0, format!("low-{}", chunk * 100 + i))).collect();
        c.offer("work", backlog, None).await.unwrap();
    }
    let (low, urgent) = (server.client().await, server.client().await);
    let producer = |client: Client, priority: u8, name: &'static str, from: usize| async move {
        for i in from..from + 200 {
            client.offer("work", vec![at(priority, format!("{name}-{i}"))], None).await.unwrap();
        }
    };
    tokio::join!(producer(low, 0, "low", 1000), producer(urgent, 2, "urgent", 0));
    drop(c);
    server.kill9();
    let server = Server::start(dir.path());
    let c = server.client().await;
    let mut order = Vec::new();
    loop {
        let d = c.poll("work", PollOptions { max: 64, ..TAKE }).await.unwrap();
        if d.is_empty() {
            break;
        }
        order.extend(d.iter().map(|d| (d.message.priority, String::from_utf8_lossy(&d.message.payload).into_owned())));
    }
    assert_eq!(order.len(), 1400, "every message once");
    for (level, name, n) in [(0, "low", 1200), (2, "urgent", 200)] {
        let got: Vec<&String> = order.iter().filter(|(p, _)| *p == level).map(|(_, t)| t).collect();
        let expected: Vec<String> = (0..n).map(|i| format!("{name}-{i}")).collect();
        assert_eq!(got, expected.iter().collect::<Vec<_>>(), "level {level} in its producer's order");
    }
    let last_urgent = order.iter().rposition(|(p, _)| *p == 2).unwrap();
    let low_before = order[..last_urgent].iter().filter(|(p, _)| *p == 0).count();
    // The 200 urgent messages take 222 takes: 22 of them (one in ten) went to the backlog.
    assert_eq!((last_urgent + 1, low_before), (222, 22), "urgent first, the backlog's share kept");
}

/// Idempotent offers against the real binary: a producer's retries (the same keys) are stored
/// once and answered with the original ids, also after the messages were consumed and the server
/// was killed with `kill -9`; `petrel produce --key` run twice on the same lines stores each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_offers_with_one_key_are_stored_once_across_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("orders", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    let keyed = |i: usize| Message { idempotency_key: format!("order-{i}").into(), ..msg(&format!("order {i}")) };
    let mut ids = Vec::new();
    for i in 0..100 {
        ids.push(c.offer("orders", vec![keyed(i)], None).await.unwrap());
    }
    let taken = c.poll("orders", PollOptions { max: 50, ..TAKE }).await.unwrap();
    assert_eq!(taken.len(), 50);
    assert_eq!(taken[0].message.idempotency_key, "order-0", "a delivery carries its key");
    drop(c);
    server.kill9();
    let server = Server::start(dir.path());
    let c = server.client().await;
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(c.offer("orders", vec![keyed(i)], None).await.unwrap(), *id, "retry of order {i}");
    }
    let status = c.queue_status("orders").await.unwrap();
    assert_eq!((status.items, status.total_offered), (50, 0), "nothing stored twice");
    assert_eq!((status.deduplicated, status.dedup_keys), (100, 100), "{status:?}");
    // The answer says which were repeats: here one of two.
    let stored = c.offer_stored("orders", vec![keyed(3), keyed(200)], None).await.unwrap();
    assert_eq!(stored.repeats, 1);
    let taken = c.poll("orders", PollOptions { max: 1, ..TAKE }).await.unwrap();
    assert_eq!(texts(&taken), ["order 50"]);
    assert!(c.offer("orders", vec![keyed(100)], None).await.unwrap() > ids[99], "a new key is stored");
    let rest = c.poll("orders", PollOptions { max: 100, ..TAKE }).await.unwrap();
    let expected: Vec<String> = (51..100).chain([200, 100]).map(|i| format!("order {i}")).collect();
    assert_eq!(texts(&rest), expected);

    let produce = |addr: &str| {
        common::petrel(&["produce", "lines", "--server", addr, "--durable", "--key", "import-7"], b"a\nb\nc\n")
    };
    let said: Vec<String> = (0..2)
        .map(|_| {
            let out = produce(&server.addr);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stderr).trim().to_string()
        })
        .collect();
    assert_eq!(said[0], "3 messages offered to lines");
    assert_eq!(said[1], "3 messages offered to lines: 0 stored, 3 not stored again (their keys were offered before)");
    assert_eq!(c.queue_status("lines").await.unwrap().items, 3, "the second run stored nothing");
}

/// Runs `petrel ARGS MORE --json --data DATA`, which must succeed within a minute; its last line.
fn bench_json(args: &[&str], more: &[&str], data: &std::path::Path) -> serde_json::Value {
    let mut child = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(args)
        .args(more)
        .args(["--json", "--data"])
        .arg(data)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("petrel {args:?} {more:?} did not finish");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "petrel {args:?} {more:?}");
    serde_json::from_str(String::from_utf8(out.stdout).unwrap().lines().last().unwrap()).unwrap()
}

#[test]
fn bench_queue_runs_every_mode_and_prints_json() {
    let dir = tempfile::tempdir().unwrap();
    for protocol in ["native", "memcache"] {
        for mode in ["offer", "poll", "offer-poll", "publish", "call", "connect"] {
            if protocol == "memcache" && ["publish", "call", "connect"].contains(&mode) {
                continue;
            }
            let last = bench_json(
                &["bench", "queue", "--protocol", protocol, "--mode", mode, "--count", "3000", "--connections", "2"],
                &["--batch", "7", "--keys", "5", "--subscribers", "2"],
                dir.path(),
            );
            let expected = if mode == "publish" { 3000 * 2 } else { 3000 };
            assert_eq!(last["count"], expected, "{protocol} {mode}: {last}");
            assert!(last["msgs_per_sec"].as_f64().unwrap() > 0.0);
            assert!(last["latency_p99_us"].as_f64().unwrap() >= last["latency_p50_us"].as_f64().unwrap());
            if protocol == "memcache" && mode == "poll" {
                assert_eq!(last["hits"], 3000, "every item set is got back once: {last}");
            }
        }
    }
}

/// offer-poll with a count the offering connections do not share evenly: every message is
/// offered and polled (the remainder went by a connection's index among all connections, so
/// 5 connections and 503 messages offered 502 and the pollers waited for ever); with one
/// connection, refused (it would only offer).
#[test]
fn bench_offer_poll_shares_an_uneven_count_and_needs_two_connections() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["bench", "queue", "--mode", "offer-poll", "--connections", "5", "--count", "503"];
    let last = bench_json(&args, &[], &dir.path().join("a"));
    assert_eq!(last["count"], 503, "{last}");
    let out = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["bench", "queue", "--mode", "offer-poll", "--connections", "1", "--data"])
        .arg(dir.path().join("b"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--connections 2"), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unix_socket_serves_the_same_queues() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("petrel.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args([
            "serve",
            "--native-addr",
            "127.0.0.1:0",
            "--memcache-addr",
            "127.0.0.1:0",
            "--http-addr",
            "off",
            "--data",
        ])
        .arg(dir.path().join("data"))
        .arg("--unix-socket")
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let native = lines.next().unwrap().unwrap();
    let memcache = lines.next().unwrap().unwrap();
    assert!(memcache.starts_with("memcache 127.0.0.1:"), "{memcache}");
    let unix = lines.next().unwrap().unwrap();
    assert!(native.starts_with("native 127.0.0.1:"), "{native}");
    assert_eq!(unix, format!("unix {}", socket.display()));
    let over_unix = Client::connect_unix(&socket).await.unwrap();
    let over_tcp = Client::connect(native.strip_prefix("native ").unwrap()).await.unwrap();
    over_unix.create_queue("both", QueueConfig::default()).await.unwrap();
    over_tcp.offer("both", vec![msg("hi")], None).await.unwrap();
    assert_eq!(texts(&over_unix.poll("both", TAKE).await.unwrap()), ["hi"]);
    // The command line reaches it by its path, as `unix:PATH` or a path, alone or in a list;
    // TLS is refused there, said before connecting.
    let path = socket.to_str().unwrap();
    let cli = |args: &[&str], stdin: &[u8]| common::petrel(args, stdin);
    let out = cli(&["produce", "both", "--server", &format!("unix:{path}")], b"one\ntwo\n");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = cli(&["consume", "both", "--server", path], b"");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "one\ntwo\n", "{}", String::from_utf8_lossy(&out.stderr));
    let tcp = native.strip_prefix("native ").unwrap();
    let out = cli(&["queue", "list", "--server", &format!("{path},{tcp}")], b"");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "both\n", "{}", String::from_utf8_lossy(&out.stderr));
    let out = cli(&["queue", "list", "--server", path, "--tls-ca", path], b"");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("TLS on TCP only"));
    // A server on the data directory `data` and the Unix socket `path`.
    let serve = |data: &str, path: &std::path::Path| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_petrel"));
        command.args(["serve", "--native-addr", "127.0.0.1:0", "--memcache-addr", "off", "--http-addr", "off"]);
        command.arg("--data").arg(dir.path().join(data)).arg("--unix-socket").arg(path);
        command
    };
    // A second server (another data directory) does not take a live server's socket.
    let mut refused = serve("other", &socket).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let started = std::time::Instant::now();
    while refused.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = refused.kill(); // (one that took the socket runs on)
    let refused = refused.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("another server listens on it"), "{err}");
    assert!(!dir.path().join("other").exists(), "refused before its data directory was made");
    // Nor is a file that is not a socket taken for one, nor a socket made where no directory is.
    std::fs::write(dir.path().join("notes"), b"mine").unwrap();
    for (path, says) in [(dir.path().join("notes"), "not a socket"), (dir.path().join("no/such.sock"), "no directory")]
    {
        let out = serve("third", &path).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{err}");
    }
    assert_eq!(std::fs::read(dir.path().join("notes")).unwrap(), b"mine");
    assert!(!dir.path().join("third").exists());
    over_unix.ping().await.unwrap();
    assert!(Client::connect_unix(&socket).await.is_ok(), "still the first server's");
    drop((over_unix, over_tcp));
    Command::new("kill").args(["-KILL", &child.id().to_string()]).status().unwrap();
    child.wait().unwrap();
    assert!(socket.exists(), "left behind by a kill -9");
    // A socket file that nobody answers on is replaced.
    let mut child = serve("data", &socket).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("native "));
    assert_eq!(lines.next().unwrap().unwrap(), format!("unix {}", socket.display()));
    Client::connect_unix(&socket).await.unwrap().ping().await.unwrap();
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(child.wait().unwrap().success());
    assert!(!socket.exists(), "the socket file is removed on shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_carries_its_own_durability_and_item_limit_over_the_wire() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    let config =
        QueueConfig { durable: true, durability: "always".into(), max_item_bytes: 8, ..QueueConfig::default() };
    c.create_queue("audited", config.clone()).await.unwrap();
    let status = c.queue_status("audited").await.unwrap();
    assert_eq!((status.config.durability.as_str(), status.config.max_item_bytes), ("always", 8));
    c.offer("audited", vec![msg("small")], None).await.unwrap();
    let err = c.offer("audited", vec![msg("much too big")], None).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::TooLarge));
    let bad = QueueConfig { durability: "sometimes".into(), ..config };
    let err = c.create_queue("odd", bad).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::BadRequest));
    server.kill9();
    let server = Server::start(dir.path());
    let c = server.client().await;
    assert_eq!(c.queue_status("audited").await.unwrap().config.durability, "always", "kept with the definition");
    assert_eq!(texts(&c.poll("audited", TAKE).await.unwrap()), ["small"]);
}

/// A connection finds the queue it named last without asking the broker again; removing the
/// queue (from this connection or another) and making a new one of that name must still be
/// seen at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_removed_and_made_again_is_seen_by_a_connection_that_named_it_before() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let (c, admin) = (server.client().await, server.client().await);
    c.create_queue("r", QueueConfig::default()).await.unwrap();
    c.offer("r", vec![msg("old")], None).await.unwrap();
    for remover in [&admin, &c] {
        remover.remove_queue("r").await.unwrap();
        let gone = c.offer("r", vec![msg("lost")], None).await.unwrap_err();
        assert_eq!(gone.status(), Some(Status::QueueNotFound), "{gone}");
        let gone = c.poll("r", TAKE).await.unwrap_err();
        assert_eq!(gone.status(), Some(Status::QueueNotFound), "{gone}");
        admin.create_queue("r", QueueConfig::default()).await.unwrap();
        c.offer("r", vec![msg("new")], None).await.unwrap();
        assert_eq!(admin.queue_status("r").await.unwrap().items, 1, "into the new queue");
        assert_eq!(texts(&c.poll("r", TAKE).await.unwrap()), ["new"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_poll_counts_among_the_queue_s_waiters() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("w", QueueConfig::default()).await.unwrap();
    let poller = server.client().await;
    let wait = PollOptions { max: 1, timeout: Duration::from_secs(5), visibility: None };
    let poll = tokio::spawn(async move { poller.poll("w", wait).await.unwrap() });
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while c.queue_status("w").await.unwrap().waiters != 1 {
        assert!(std::time::Instant::now() < deadline, "the poll never counted as waiting");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.offer("w", vec![msg("x")], None).await.unwrap();
    assert_eq!(texts(&poll.await.unwrap()), ["x"]);
    assert_eq!(c.queue_status("w").await.unwrap().waiters, 0);
}

/// A name of 32,767 two-byte characters and one byte more: the server's error echoing it was
/// once cut inside a character, which panicked the connection's task, closed the connection and
/// skipped its cleanup. Now it is answered, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_multibyte_name_is_answered_and_the_connection_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    let other = server.client().await;
    c.create_queue("reply.own", QueueConfig { temporary: true, ..QueueConfig::default() }).await.unwrap();
    let name = "é".repeat(32_767) + "a";
    assert_eq!(name.len(), u16::MAX as usize);
    let answers = [c.queue_status(&name).await.map(|_| ()), c.poll(&name, TAKE).await.map(|_| ())];
    for answer in answers {
        let e = answer.unwrap_err();
        assert_eq!(e.status(), Some(Status::QueueNotFound), "{e}");
        assert!(e.to_string().len() < 200, "the name is not echoed whole: {e}");
    }
    c.ping().await.unwrap();
    assert!(other.list_queues().await.unwrap().contains(&"reply.own".to_string()));
    // Too long for the protocol: the client refuses to send it.
    let e = c.queue_status(&"a".repeat(70_000)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    drop(c);
    for _ in 0..500 {
        if !other.list_queues().await.unwrap().contains(&"reply.own".to_string()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the temporary queue outlived its connection");
}

/// A connection that says nothing is closed after the handshake timeout; one that said HELLO and
/// then nothing, after the idle timeout; one with a poll waiting is not idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_idle_connections_are_closed_busy_ones_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "idle_timeout = \"400ms\"\n[security]\nhandshake_timeout = \"200ms\"\n").unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let mut silent = std::net::TcpStream::connect(&server.addr).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = std::time::Instant::now();
    assert_eq!(silent.read(&mut [0u8; 16]).unwrap(), 0, "closed by the server");
    assert!(started.elapsed() < Duration::from_secs(3));
    // One that trickles a frame that never ends, a byte every 20 ms, is closed at the same
    // timeout: bytes are not a HELLO.
    let mut trickling = std::net::TcpStream::connect(&server.addr).unwrap();
    let started = std::time::Instant::now();
    let mut writer = trickling.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        for byte in [0u8, 0, 1, 0].into_iter().chain(std::iter::repeat(7)).take(250) {
            if writer.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    trickling.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(trickling.read(&mut [0u8; 16]).unwrap_or(0), 0, "closed by the server");
    assert!(started.elapsed() < Duration::from_secs(3), "closed after {:?}", started.elapsed());
    trickle.join().unwrap();
    // One that skipped HELLO and has a subscription under way: closed at the same timeout.
    let mut subscribed = std::net::TcpStream::connect(&server.addr).unwrap();
    let topic = petrel_proto::Request::TopicCreate { name: "t".into(), durable: false };
    let subscribe = petrel_proto::Request::Subscribe {
        topic: "t".into(),
        buffer: 0,
        group: String::new(),
        from: petrel_proto::StartFrom::Resume,
    };
    let mut frames = Vec::new();
    topic.encode(1, &mut frames).unwrap();
    subscribe.encode(2, &mut frames).unwrap();
    let started = std::time::Instant::now();
    subscribed.write_all(&frames).unwrap();
    subscribed.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answers = Vec::new();
    let _ = subscribed.read_to_end(&mut answers);
    assert!(answers.len() > 20, "both answered first: {} bytes", answers.len());
    assert!(started.elapsed() < Duration::from_secs(3), "closed after {:?}", started.elapsed());

    let idle = server.client().await;
    let busy = server.client().await;
    busy.create_queue("q", QueueConfig::default()).await.unwrap();
    let waiting = {
        let busy = busy.clone();
        tokio::spawn(async move {
            busy.poll("q", PollOptions { max: 1, timeout: Duration::from_secs(2), visibility: None }).await
        })
    };
    // Closed for silence: the three connections without HELLO, then the idle one.
    let memcache = server.memcache.clone();
    let closed = move || common::wait_until("the idle connection's close", || stat_at(&memcache, "idle_closed") == 4);
    tokio::task::spawn_blocking(closed).await.unwrap();
    assert!(matches!(idle.ping().await, Err(ClientError::Closed)), "the idle connection was closed");
    // Answered at its timeout, 2 s: five idle timeouts later, on a connection kept open for it.
    // (Once answered, the connection is idle again: the next idle check may close it.)
    assert!(waiting.await.unwrap().unwrap().is_empty(), "the waiting poll was answered, not cut off");
}

/// A memcache `stats` figure of the server's (bytes read and written count every protocol).
fn stat(server: &Server, name: &str) -> u64 {
    stat_at(&server.memcache, name)
}

/// `stat`, from the server whose memcache listener is at `memcache`.
fn stat_at(memcache: &str, name: &str) -> u64 {
    let mut s = std::net::TcpStream::connect(memcache).unwrap();
    s.write_all(b"stats\r\n").unwrap();
    let mut text = String::new();
    let mut reader = BufReader::new(s);
    while !text.ends_with("END\r\n") {
        reader.read_line(&mut text).unwrap();
    }
    let prefix = format!("STAT {name} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_travel_compressed_when_a_client_asks_and_arrive_as_sent() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let options = petrel_client::ClientOptions { compress_min_bytes: Some(1024), ..Default::default() };
    let zipped = Client::connect_with(&server.addr, &options).await.unwrap();
    let plain = server.client().await;
    let text = "every record is acknowledged at least once, in order; ".repeat(10_000).into_bytes();
    zipped.create_queue("q", QueueConfig::default()).await.unwrap();

    let read_before = stat(&server, "bytes_read");
    zipped.offer("q", vec![Message::new(text.clone()), Message::new(text.clone())], None).await.unwrap();
    let sent = stat(&server, "bytes_read") - read_before;
    assert!(sent < text.len() as u64 / 4, "two {} B texts took {sent} B on the wire", text.len());
    assert_eq!(zipped.queue_status("q").await.unwrap().bytes, 2 * text.len() as u64, "stored as sent");
    // A client that did not ask gets the payload as it is; one that did, compressed and restored.
    assert_eq!(plain.poll("q", PollOptions { max: 1, ..TAKE }).await.unwrap()[0].message.payload, text);
    // An answer is counted once its write returns, which may be just after the client read it:
    // wait until the count grows only by the `stats` answers themselves (a few KiB).
    let mut written_before = stat(&server, "bytes_written");
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = stat(&server, "bytes_written");
        let settled = now - written_before < 16 << 10;
        written_before = now;
        if settled {
            break;
        }
    }
    let got = zipped.poll("q", PollOptions { max: 1, ..TAKE }).await.unwrap();
    assert!(stat(&server, "bytes_written") - written_before < text.len() as u64 / 4);
    assert_eq!((got[0].message.payload.as_ref(), got[0].message.compressed), (&text[..], false));

    // Calls, both ways, and a topic's deliveries.
    plain.serve("echo", |m| async move { Ok(m) }).await.unwrap();
    let reply = zipped.call("echo", Message::new(text.clone()), Some(Duration::from_secs(5))).await.unwrap();
    assert_eq!(reply.payload, text);
    zipped.create_topic("t", false).await.unwrap();
    let mut sub = zipped.subscribe("t", 0).await.unwrap();
    plain.publish("t", vec![Message::new(text.clone())]).await.unwrap();
    let delivered = tokio::time::timeout(Duration::from_secs(5), sub.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(delivered.payload, text);

    // A compressed payload that unfolds past the limits is refused, and the connection goes on.
    let mut bomb = Message::new(vec![0u8; 32 << 20]);
    petrel_client::compression::compress(&mut bomb, 1);
    let refused = plain.offer("q", vec![bomb], None).await.unwrap_err();
    assert_eq!(refused.status(), Some(Status::BadRequest), "{refused}");
    plain.ping().await.unwrap();
}

/// Waits for `child` to exit, up to `limit`; kills it and says so if it did not.
fn exited_within(mut child: std::process::Child, limit: Duration) -> Result<std::process::Output, String> {
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            child.kill().unwrap();
            return Err(format!("still running after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child.wait_with_output().unwrap())
}

/// Two servers on one data directory (even one holding no durable queue) would delete each
/// other's queue definitions: the second is refused at startup.
#[test]
fn a_second_server_on_the_same_data_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = Server::start(dir.path());
    let second = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["serve", "--native-addr", "127.0.0.1:0", "--memcache-addr", "off", "--http-addr", "off", "--data"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = exited_within(second, Duration::from_secs(10)).expect("the second server stops at once");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another petrel server"), "{err}");
}

/// The CLI pointed at the memcache port, or at a closed one: an answer within seconds that names
/// the address and says what is wrong, not a silent hang.
#[test]
fn the_cli_at_the_wrong_port_says_what_answered() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = listener.local_addr().unwrap().to_string();
    drop(listener);
    // A port that takes connections and never answers (a server stopped with SIGSTOP, say).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    for (addr, expected) in [
        // (The memcache port refuses a binary frame at once, and closes.)
        (server.memcache.as_str(), "is it the memcache port"),
        (closed.as_str(), "refused"),
        (silent_addr.as_str(), "did not answer HELLO within"),
    ] {
        let child = Command::new(env!("CARGO_BIN_EXE_petrel"))
            .args(["queue", "list", "--server", addr])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = exited_within(child, Duration::from_secs(20)).expect("an answer, not a hang");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(addr) && err.contains(expected), "{addr}: {err}");
    }
}

/// A follower's poll for good whose answer is lost with its connection loses nothing: what the
/// poll took comes with the poll made again after the reconnect. (Taken for good, it was gone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followers_poll_for_good_whose_answer_is_lost_loses_nothing() {
    use petrel_client::{ClientOptions, Follower, Reconnect};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let admin = server.client().await;
    admin.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    admin.offer("jobs", vec![msg("one")], None).await.unwrap();
    // A proxy whose first connection passes the HELLO's answer, then ends at the next answer
    // (the poll's), which it never passes on; later connections pass everything.
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_addr = proxy.local_addr().unwrap().to_string();
    let upstream = server.addr.clone();
    std::thread::spawn(move || {
        for (n, client) in proxy.incoming().enumerate() {
            let Ok(client) = client else { return };
            let server = std::net::TcpStream::connect(&upstream).unwrap();
            let (mut from_client, mut to_server) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || drop(std::io::copy(&mut from_client, &mut to_server)));
            let (mut from_server, mut to_client) = (server, client);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                for answer in 1.. {
                    let Ok(k @ 1..) = from_server.read(&mut buf) else { break };
                    if n == 0 && answer == 2 {
                        let _ = from_server.shutdown(std::net::Shutdown::Both);
                        let _ = to_client.shutdown(std::net::Shutdown::Both);
                        break;
                    }
                    if to_client.write_all(&buf[..k]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    let reconnect = Reconnect { first_pause: Duration::from_millis(20), ..Reconnect::default() };
    let mut follower = Follower::connect(&proxy_addr, ClientOptions::default(), reconnect).await.unwrap();
    let for_good = PollOptions { max: 10, timeout: Duration::from_secs(5), visibility: None };
    let got = follower.poll("jobs", for_good).await.unwrap();
    let got: Vec<_> = got.iter().map(|d| (d.handle, d.message.payload.clone())).collect();
    assert_eq!(got, [(0, bytes::Bytes::from_static(b"one"))], "taken again after the reconnect");
    assert!(admin.poll("jobs", PollOptions::default()).await.unwrap().is_empty(), "and acknowledged");
}

/// The library's `Follower` outlives a server restart: a poll waits for the server and is made
/// again, an acknowledgement lost with the connection answers 0 and its message comes again, a
/// group subscription resumes where the group stands; each loss and return is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_reconnects_and_goes_on_where_it_was() {
    use petrel_client::{ConnectionEvent, Follower, Reconnect, StartFrom};
    let dir = tempfile::tempdir().unwrap();
    let addr = Server::free_addr();
    let server = Server::start_at(&addr, dir.path());
    let admin = server.client().await;
    admin.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    admin.create_topic("news", true).await.unwrap();
    admin.offer("jobs", vec![msg("one")], None).await.unwrap();
    admin.publish("news", vec![msg("first")]).await.unwrap();

    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let reconnect = {
        let events = std::sync::Arc::clone(&events);
        let on_event = move |e: ConnectionEvent<'_>| {
            events.lock().unwrap().push(match e {
                ConnectionEvent::Lost { .. } => "lost",
                ConnectionEvent::Connected { .. } => "connected",
            })
        };
        Reconnect {
            first_pause: Duration::from_millis(20),
            on_event: Some(std::sync::Arc::new(on_event)),
            ..Reconnect::default()
        }
    };
    let options = petrel_client::ClientOptions::default();
    let mut reader = Follower::connect(&addr, options.clone(), reconnect.clone()).await.unwrap();
    let mut group = Follower::connect(&addr, options, reconnect)
        .await
        .unwrap()
        .subscribe_group("news", "g", StartFrom::Oldest, 16)
        .await
        .unwrap();
    let take = PollOptions { max: 10, timeout: Duration::from_secs(2), visibility: Some(Duration::from_secs(60)) };
    let taken = reader.poll("jobs", take).await.unwrap();
    assert_eq!(texts(&taken), ["one"]);
    let first = group.next().await.unwrap().unwrap();
    assert_eq!(first.payload, "first");
    assert_eq!(group.ack(&[first.id]).await.unwrap(), 1);

    drop(admin);
    server.kill9();
    // The lost connection is seen by the acknowledgement: 0, and "one" comes again.
    assert_eq!(reader.ack("jobs", &[taken[0].handle]).await.unwrap(), 0);
    let restart = {
        let (addr, data) = (addr.clone(), dir.path().to_owned());
        let events = std::sync::Arc::clone(&events);
        tokio::spawn(async move {
            // Back once the reader has seen the server gone.
            common::wait_until_async("the reader to see the server gone", || {
                let lost = events.lock().unwrap().contains(&"lost");
                async move { lost }
            })
            .await;
            let server = Server::start_at(&addr, &data);
            let client = server.client().await;
            client.publish("news", vec![msg("second")]).await.unwrap();
            server
        })
    };
    let again = reader.poll("jobs", take).await.unwrap();
    assert_eq!(texts(&again), ["one"]);
    assert_eq!(reader.ack("jobs", &[again[0].handle]).await.unwrap(), 1);
    let server = restart.await.unwrap();
    let second = group.next().await.unwrap().unwrap();
    assert_eq!(second.payload, "second", "the group resumed after its acknowledged message");
    assert_eq!(group.ack(&[second.id]).await.unwrap(), 1);
    assert_eq!(*events.lock().unwrap(), ["lost", "connected", "lost", "connected"]);
    assert_eq!(server.client().await.queue_status("jobs").await.unwrap().items, 0);
}

/// A followed live subscription that fell behind says so (SLOW_CONSUMER) and then subscribes
/// again: what is published from then on comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_subscription_that_fell_behind_is_told_and_goes_on() {
    use petrel_client::{Follower, Reconnect};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let publisher = server.client().await;
    publisher.create_topic("ticks", false).await.unwrap();
    let follower =
        Follower::connect(&server.addr, petrel_client::ClientOptions::default(), Reconnect::default()).await.unwrap();
    let mut sub = follower.subscribe("ticks", 16).await.unwrap();
    for chunk in 0..10 {
        publisher.publish("ticks", (0..500).map(|i| msg(&format!("t{}", chunk * 500 + i))).collect()).await.unwrap();
    }
    let notice = loop {
        match tokio::time::timeout(Duration::from_secs(10), sub.next()).await.unwrap().expect("not ended") {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert_eq!(notice.status(), Some(Status::SlowConsumer), "{notice}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        // The next call subscribes again; publish until one arrives.
        let next = tokio::time::timeout(Duration::from_millis(200), sub.next());
        publisher.publish("ticks", vec![msg("after")]).await.unwrap();
        match next.await {
            Ok(Some(Ok(m))) if &m.payload[..] == b"after" => break,
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => panic!("the subscription ended"),
        }
        assert!(std::time::Instant::now() < deadline, "nothing after the notice");
    }
}

/// A client that did not ask for OFFERED's `repeats` and QUEUE_STATUS's later figures in HELLO
/// (one written before they existed) gets the answers as they were; one that asked gets them.
#[test]
fn answers_carry_repeats_and_figures_only_for_clients_that_asked() {
    use petrel_proto::{Request, Response, features};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    // An answer's body, raw.
    let body = |c: &mut std::net::TcpStream, request: Request| {
        c.write_all(&common::request_frame(&request, 2)).unwrap();
        let mut len = [0u8; 4];
        c.read_exact(&mut len).unwrap();
        let mut frame = vec![0u8; u32::from_be_bytes(len) as usize];
        c.read_exact(&mut frame).unwrap();
        frame.split_off(12)
    };
    let keyed = || Message { idempotency_key: "k".into(), ..msg("x") };
    let offer = || Request::Offer { queue: "q".into(), timeout_ms: 0, messages: vec![keyed(), keyed()] };
    let status = || Request::QueueStatus { name: "q".into() };
    for wanted in [0, features::OFFER_REPEATS | features::QUEUE_FIGURES] {
        let mut c = std::net::TcpStream::connect(&server.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let hello = body(&mut c, Request::Hello { client: "test".into(), features: wanted });
        let Response::Hello { features: granted, .. } =
            Response::decode(petrel_proto::opcode::HELLO, hello.into()).unwrap()
        else {
            panic!("not a hello")
        };
        assert_eq!(granted & (features::OFFER_REPEATS | features::QUEUE_FIGURES), wanted);
        if wanted == 0 {
            let create = Request::QueueCreate { name: "q".into(), config: Box::new(QueueConfig::default()) };
            body(&mut c, create);
        }
        // Two messages with one key: the second repeats the first (and, the second time, both
        // repeat the first time's).
        let offered = body(&mut c, offer());
        let status_body = body(&mut c, status());
        let stats = match Response::decode(petrel_proto::opcode::QUEUE_STATUS, status_body.clone().into()).unwrap() {
            Response::QueueStatus { stats } => stats,
            other => panic!("{other:?}"),
        };
        if wanted == 0 {
            assert_eq!(offered.len(), 1 + 8 + 4, "first_id and count only");
            assert_eq!(stats.deduplicated, 0, "not sent");
        } else {
            assert_eq!(offered.len(), 1 + 8 + 4 + 4, "then repeats");
            assert_eq!(&offered[13..], &2u32.to_be_bytes(), "both repeat the first offer's key");
            assert_eq!((stats.deduplicated, stats.dedup_keys), (3, 1));
            assert_eq!(stats.max_bytes_in_force, 256 << 20, "a queue in memory: the server's memory_queue_max_bytes");
        }
    }
}

/// A delivery given back unseen (a client's poll cancelled while its answer came) goes back as
/// if never handed out: with `max_deliveries` 1 it is not dead-lettered, its next delivery is
/// its first, and a redelivery delay does not hold it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_given_back_unseen_is_not_counted() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    for durable in [false, true] {
        let (name, dead) = (format!("work{durable}"), format!("dead{durable}"));
        let config = QueueConfig {
            durable,
            max_deliveries: 1,
            dead_letter: dead.clone(),
            redelivery_delay_ms: 60_000,
            ..QueueConfig::default()
        };
        c.create_queue(&name, config).await.unwrap();
        c.offer(&name, vec![msg("important")], None).await.unwrap();
        let open = PollOptions { max: 1, visibility: Some(Duration::from_secs(30)), ..PollOptions::default() };
        for _ in 0..3 {
            let taken = c.poll(&name, open).await.unwrap();
            assert_eq!((texts(&taken), taken[0].message.deliveries), (vec!["important".into()], 1), "{name}");
            assert_eq!(c.give_back_unseen(&name, &[taken[0].handle]).await.unwrap(), 1);
        }
        assert!(c.queue_status(&dead).await.is_err_and(|e| e.status() == Some(Status::QueueNotFound)), "none dead");
        // An ordinary abort counts: at the limit, it goes.
        let taken = c.poll(&name, open).await.unwrap();
        c.abort(&name, &[taken[0].handle]).await.unwrap();
        assert_eq!(texts(&c.poll(&dead, TAKE).await.unwrap()), ["important"]);
    }
}

/// Bytes of the segment files under `dir`, by the blocks they hold.
fn segment_blocks(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            total += segment_blocks(&path);
        } else if path.extension().is_some_and(|e| e == "log") {
            total += std::fs::metadata(&path).unwrap().blocks() * 512;
        }
    }
    total
}

/// A durable queue its consumers drained, left idle, gives its disk back by itself (the
/// server's tick), and takes offers as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_idle_queue_gives_its_disk_back() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_queue("spent", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    for _ in 0..40 {
        c.offer("spent", (0..100).map(|_| Message::new(vec![1u8; 1000])).collect(), None).await.unwrap();
    }
    let files = dir.path().join("queues/spent");
    let full = segment_blocks(&files);
    assert!(full > 2 << 20, "{full}");
    let mut got = 0;
    while got < 4000 {
        got += c.poll("spent", PollOptions { max: 1000, ..PollOptions::default() }).await.unwrap().len();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while segment_blocks(&files) > 256 << 10 {
        assert!(std::time::Instant::now() < deadline, "still {} bytes of {full}", segment_blocks(&files));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.offer("spent", vec![msg("again")], None).await.unwrap();
    assert_eq!(texts(&c.poll("spent", TAKE).await.unwrap()), ["again"]);
    // Counted on /metrics.
    let mut http = std::net::TcpStream::connect(&server.http).unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut scrape = String::new();
    http.read_to_string(&mut scrape).unwrap();
    let given_back: u64 = scrape
        .lines()
        .find_map(|l| l.strip_prefix("petrel_given_back_bytes_total "))
        .unwrap_or_else(|| panic!("no petrel_given_back_bytes_total in {scrape}"))
        .parse()
        .unwrap();
    assert!(given_back >= full - (256 << 10), "{given_back} bytes counted, {full} held");
}

/// A SIGTERM sent the moment the server announces its listeners stops it gracefully (exit 0):
/// the handlers were installed only once it ran, so one that came first ended it by the
/// signal's default action (seen once in a full run of the tests).
#[test]
fn a_sigterm_right_after_the_listeners_are_announced_stops_the_server_gracefully() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..20 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_petrel"))
            .args(["serve", "--native-addr", "127.0.0.1:0", "--memcache-addr", "off", "--http-addr", "off"])
            .arg("--data")
            .arg(dir.path().join(format!("data{round}")))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(lines.next().unwrap().unwrap().starts_with("native "));
        Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        let status = child.wait().unwrap();
        assert!(status.success(), "round {round}: {status}");
    }
}

/// Offers pipelined on one connection that wait for room in a full queue are stored in the
/// order sent, as room comes (each waited as a task of its own, and the one spawned later could
/// join the queue's line first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_offers_waiting_for_room_are_stored_in_the_order_sent() {
    use petrel_client::Request;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    for round in 0..5 {
        let queue = format!("one{round}");
        c.create_queue(&queue, QueueConfig { max_items: 1, ..QueueConfig::default() }).await.unwrap();
        c.offer(&queue, vec![msg("first")], None).await.unwrap();
        let offers: Vec<Request> = ["a", "b", "c"]
            .iter()
            .map(|p| Request::Offer { queue: queue.clone(), timeout_ms: 10_000, messages: vec![msg(p)] })
            .collect();
        let offering = {
            let c = c.clone();
            tokio::spawn(async move { c.pipeline(&offers).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await; // all three wait
        let taker = server.client().await;
        let mut got = Vec::new();
        for _ in 0..4 {
            let options = PollOptions { max: 1, timeout: Duration::from_secs(10), visibility: None };
            got.extend(texts(&taker.poll(&queue, options).await.unwrap()));
        }
        assert_eq!(got, ["first", "a", "b", "c"], "round {round}");
        for answer in offering.await.unwrap() {
            answer.unwrap();
        }
    }
}

/// Both ends of a client's connection probe it when silent (TCP keepalive), so that a peer gone
/// without a word (a host powered off, a cut link) is noticed: an established socket with a
/// keepalive timer (and nothing unacknowledged) shows timer 2 in /proc/net/tcp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_ends_of_a_connection_keep_it_alive() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.ping().await.unwrap();
    let port = server.addr.rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
    // Established (state 01) sockets with the server's port at one end: (the server's end?, timer).
    let ends = || -> Vec<(bool, String)> {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let port_of = |a: &str| u16::from_str_radix(a.rsplit_once(':').unwrap().1, 16).unwrap();
        table
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f[3] == "01" && (port_of(f[1]) == port || port_of(f[2]) == port))
            .map(|f| (port_of(f[1]) == port, f[5].split(':').next().unwrap().to_owned()))
            .collect()
    };
    // (Once what the ping sent is acknowledged: until then an end shows its retransmit timer.)
    common::wait_until("both ends with their keepalive timer", || {
        let ends = ends();
        ends.iter().any(|(server_end, _)| *server_end)
            && ends.iter().any(|(server_end, _)| !server_end)
            && ends.iter().all(|(_, timer)| timer == "02")
    });
}

/// A handle a client kept from before the server's restart names nothing of the new server's
/// (handles were counted from 1 again: an ACK of the old handle on the new connection settled
/// the new connection's read of another message, unseen by its consumer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_from_before_a_restart_acknowledges_nothing_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let addr = Server::free_addr();
    let server = Server::start_at(&addr, dir.path());
    let c = server.client().await;
    c.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }).await.unwrap();
    c.offer("jobs", vec![msg("a"), msg("b")], None).await.unwrap();
    let held = PollOptions { max: 1, timeout: Duration::ZERO, visibility: Some(Duration::from_secs(60)) };
    let before = c.poll("jobs", held).await.unwrap();
    drop(c);
    server.kill9();
    let server = Server::start_at(&addr, dir.path());
    let c = server.client().await;
    let after = c.poll("jobs", held).await.unwrap();
    assert_eq!(texts(&after), ["a"], "back after the restart");
    assert_eq!(c.ack("jobs", &[before[0].handle]).await.unwrap(), 0, "the old handle is none of the new reads");
    assert_eq!(c.queue_status("jobs").await.unwrap().in_flight, 1);
}
