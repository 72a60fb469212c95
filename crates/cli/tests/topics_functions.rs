//! Topics and functions through the real `petrel serve`, with the Rust client.

use std::time::{Duration, Instant};

use petrel_client::{Client, ClientError, Message, Status};

mod common;
use common::Server;

fn text(m: &Message) -> String {
    String::from_utf8_lossy(&m.payload).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subscriber_gets_every_message_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let publisher = server.client().await;
    assert_eq!(
        publisher.publish("prices", vec![Message::new("x")]).await.unwrap_err().status(),
        Some(Status::TopicNotFound)
    );
    publisher.create_topic("prices", false).await.unwrap();
    assert_eq!(publisher.list_topics().await.unwrap(), ["prices"]);
    let mut subs = Vec::new();
    for _ in 0..3 {
        let c = server.client().await;
        let sub = c.subscribe("prices", 0).await.unwrap();
        subs.push((c, sub));
    }
    let n = 2000;
    for batch in 0..(n / 100) {
        let messages = (0..100).map(|i| Message::new(format!("p{}", batch * 100 + i))).collect();
        assert_eq!(publisher.publish("prices", messages).await.unwrap(), 3);
    }
    for (_, sub) in &mut subs {
        for i in 0..n {
            let m = tokio::time::timeout(Duration::from_secs(10), sub.next()).await.unwrap().unwrap().unwrap();
            assert_eq!(text(&m), format!("p{i}"));
            assert_eq!(m.destination, "prices");
        }
    }
    // Unsubscribing (or dropping) stops the pushes; the others go on.
    let (_c, first) = subs.remove(0);
    first.unsubscribe().await.unwrap();
    assert_eq!(publisher.publish("prices", vec![Message::new("late")]).await.unwrap(), 2);
    publisher.remove_topic("prices").await.unwrap();
    for (_, sub) in &mut subs {
        assert_eq!(text(&sub.next().await.unwrap().unwrap()), "late");
        let end = sub.next().await.unwrap().unwrap_err();
        assert_eq!(end.status(), Some(Status::TopicNotFound), "removing the topic ends its subscriptions");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_subscriber_is_ended_and_the_others_get_everything() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let publisher = server.client().await;
    publisher.create_topic("ticks", false).await.unwrap();
    let fast_client = server.client().await;
    let n: u64 = 200_000;
    // Room for everything: whatever the publisher's pace, this one is never behind by its buffer.
    let mut fast = fast_client.subscribe("ticks", n as u32).await.unwrap();
    let slow_client = server.client().await;
    let mut slow = slow_client.subscribe("ticks", 16).await.unwrap();
    let reader = tokio::spawn(async move {
        for i in 0..n {
            let m = tokio::time::timeout(Duration::from_secs(20), fast.next()).await.unwrap().unwrap().unwrap();
            assert_eq!(text(&m), i.to_string());
        }
    });
    for batch in 0..(n / 1000) {
        let messages = (0..1000).map(|i| Message::new((batch * 1000 + i).to_string())).collect();
        publisher.publish("ticks", messages).await.unwrap();
    }
    reader.await.unwrap();
    // The slow one (which read nothing meanwhile) got a prefix, in order, then the end.
    let mut got = 0u64;
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(10), slow.next()).await.unwrap() {
            Some(Ok(m)) => {
                assert_eq!(text(&m), got.to_string());
                got += 1;
            }
            Some(Err(e)) => break e,
            None => panic!("ended without a reason"),
        }
    };
    assert_eq!(end.status(), Some(Status::SlowConsumer), "{end}");
    assert!(got < n, "it fell behind before the end ({got} of {n})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_round_trip_oneway_async_timeout_not_found_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let caller = server.client().await;
    let err = caller.call("echo", Message::new("x"), None).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::FunctionNotFound));

    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let servers: Vec<Client> = futures_join(2, &server).await;
    for (i, s) in servers.iter().enumerate() {
        let seen_tx = seen_tx.clone();
        s.serve("echo", move |m: Message| {
            let seen_tx = seen_tx.clone();
            async move {
                let body = text(&m);
                let _ = seen_tx.send((i, body.clone()));
                match body.as_str() {
                    "fail" => Err("asked to fail".to_owned()),
                    "slow" => {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        Ok(Message::new("too late"))
                    }
                    _ => Ok(Message::new(format!("echo {body}"))),
                }
            }
        })
        .await
        .unwrap();
    }
    // Round trip, round robin between the two servers.
    for i in 0..4 {
        let reply = caller.call("echo", Message::new(format!("hi {i}")), None).await.unwrap();
        assert_eq!(text(&reply), format!("echo hi {i}"));
    }
    let mut by_server = [0, 0];
    while let Ok((s, _)) = seen.try_recv() {
        by_server[s] += 1;
    }
    assert_eq!(by_server, [2, 2]);
    // Async: many calls in flight at once on one connection.
    let calls: Vec<_> = (0..50).map(|i| caller.call("echo", Message::new(format!("a{i}")), None)).collect();
    let replies = futures_all(calls).await;
    for (i, r) in replies.into_iter().enumerate() {
        assert_eq!(text(&r.unwrap()), format!("echo a{i}"));
    }
    // Oneway: done once handed over; the handler still runs.
    caller.call_oneway("echo", Message::new("fire")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok((_, body)) = seen.try_recv()
            && body == "fire"
        {
            break;
        }
        assert!(Instant::now() < deadline, "the oneway call never reached a handler");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A handler error, and a timeout.
    let err = caller.call("echo", Message::new("fail"), None).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Status { status: Status::HandlerError, message } if message == "asked to fail")
    );
    let started = Instant::now();
    let err = caller.call("echo", Message::new("slow"), Some(Duration::from_millis(300))).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::Timeout));
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_go_both_ways_byte_for_byte_among_small_ones() {
    // Payloads from 64 KiB up leave the encoded frame and go out after it in the same vectored
    // write, from where they were read: calls, their INVOKE pushes, returns and replies.
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let (caller, replier) = (server.client().await, server.client().await);
    replier
        .serve("reverse", |m: Message| async move {
            let mut payload = m.payload.to_vec();
            payload.reverse();
            Ok(Message::new(payload))
        })
        .await
        .unwrap();
    let payload = |i: usize| -> Vec<u8> {
        let len = [0, 5, (64 << 10) - 1, 64 << 10, 300_000, 5 << 20][i % 6];
        (0..len).map(|j| (i * 131 + j * 7 + j / 251) as u8).collect()
    };
    let calls: Vec<_> = (0..24).map(|i| caller.call("reverse", Message::new(payload(i)), None)).collect();
    for (i, reply) in futures_all(calls).await.into_iter().enumerate() {
        let mut expected = payload(i);
        expected.reverse();
        assert!(reply.unwrap().payload == expected, "call {i}: {} bytes", expected.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_server_that_disconnects_fails_its_calls_instead_of_hanging() {
    a_server_gone_with_a_call_in_hand(false).await;
}

/// The same with a call of the serving connection's own still waiting (a handler that calls
/// another function): the calls it was handed fail at once, not after the connection's graces
/// for its own call (two of `shutdown_grace`, 5 s each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_server_gone_with_its_own_call_waiting_fails_its_calls_at_once() {
    a_server_gone_with_a_call_in_hand(true).await;
}

/// A connection serving `stuck` closes with a call of it in hand (and, `own_call`, with a call
/// of its own waiting for a reply that never comes): the caller gets HANDLER_ERROR at once.
async fn a_server_gone_with_a_call_in_hand(own_call: bool) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let never = server.client().await;
    never.serve("never", |_m: Message| std::future::pending::<Result<Message, String>>()).await.unwrap();
    let handler_conn = server.client().await;
    let (got_tx, got) = tokio::sync::oneshot::channel::<()>();
    let got_tx = std::sync::Mutex::new(Some(got_tx));
    handler_conn
        .serve("stuck", move |_m: Message| {
            if let Some(tx) = got_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            std::future::pending::<Result<Message, String>>()
        })
        .await
        .unwrap();
    let own = handler_conn.clone();
    let own_call = own_call.then(|| {
        tokio::spawn(async move { own.call("never", Message::new("y"), Some(Duration::from_secs(30))).await })
    });
    let caller = server.client().await;
    let call =
        tokio::spawn(async move { caller.call("stuck", Message::new("x"), Some(Duration::from_secs(30))).await });
    got.await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await; // its own call is on its way too
    // The serving connection goes away with the call in its hands.
    handler_conn.close();
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(20), call).await.unwrap().unwrap().unwrap_err();
    assert_eq!(err.status(), Some(Status::HandlerError), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    if let Some(own_call) = own_call {
        own_call.abort();
    }
}

/// A connection that serves a function and has as many calls waiting as it may: a handler of
/// those calls calls the connection's own function back, and its reply (a RETURN, read while
/// the connection's next CALL waits for a place) is handled, not left unread until every call
/// timed out (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_sent_while_the_connection_waits_for_a_place_is_handled() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "max_in_flight_per_connection = 2\n").unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let x = server.client().await;
    x.serve("f", |m: Message| async move { Ok(m) }).await.unwrap();
    let y = server.client().await;
    let y_calls = server.client().await;
    y.serve("g", move |m: Message| {
        let y_calls = y_calls.clone();
        async move { y_calls.call("f", m, Some(Duration::from_secs(30))).await.map_err(|e| e.to_string()) }
    })
    .await
    .unwrap();
    let started = Instant::now();
    // Two hold the places, the third waits for one, the fourth is read behind it: the RETURNs
    // come behind both.
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let x = x.clone();
            tokio::spawn(async move { x.call("g", Message::new(format!("c{i}")), Some(Duration::from_secs(30))).await })
        })
        .collect();
    for (i, call) in calls.into_iter().enumerate() {
        let reply = tokio::time::timeout(Duration::from_secs(20), call).await.unwrap().unwrap().unwrap();
        assert_eq!(text(&reply), format!("c{i}"));
    }
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

/// A Rust handler that panics fails its own call with HANDLER_ERROR; the function goes on being
/// served (the panic ended the task that ran every call: later calls got "no longer served").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_fails_its_call_and_serving_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let worker = server.client().await;
    worker
        .serve("fragile", |m: Message| async move {
            if m.payload.as_ref() == b"boom" {
                panic!("a handler's bug");
            }
            Ok(m)
        })
        .await
        .unwrap();
    let caller = server.client().await;
    let timeout = Some(Duration::from_secs(10));
    let err = caller.call("fragile", Message::new("boom"), timeout).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::HandlerError), "{err}");
    assert!(err.to_string().contains("panicked"), "{err}");
    let reply = caller.call("fragile", Message::new("fine"), timeout).await.unwrap();
    assert_eq!(text(&reply), "fine");
}

async fn futures_join(n: usize, server: &Server) -> Vec<Client> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(server.client().await);
    }
    out
}

async fn futures_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    let handles: Vec<_> = futures.into_iter().map(Box::pin).collect();
    for h in handles {
        out.push(h.await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coffee_order_pattern_with_reply_queues_two_clients_two_workers() {
    use petrel_client::{PollOptions, QueueConfig};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server
        .client()
        .await
        .create_queue("orders", QueueConfig { durable: true, ..QueueConfig::default() })
        .await
        .unwrap();
    let mut workers = Vec::new();
    let total = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for name in ["w1", "w2"] {
        let c = server.client().await;
        let total = std::sync::Arc::clone(&total);
        workers.push(tokio::spawn(async move {
            let take =
                PollOptions { max: 1, timeout: Duration::from_millis(200), visibility: Some(Duration::from_secs(30)) };
            let mut made = 0;
            while let Ok(ds) = c.poll("orders", take).await {
                for d in ds {
                    let reply = Message {
                        request_id: d.message.request_id.clone(),
                        ..Message::new(format!("{} by {name}", text(&d.message)))
                    };
                    c.offer(&d.message.reply_to, vec![reply], None).await.unwrap();
                    c.ack("orders", &[d.handle]).await.unwrap();
                    made += 1;
                    total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                if total.load(std::sync::atomic::Ordering::Relaxed) >= 20 {
                    break;
                }
            }
            made
        }));
    }
    let mut customers = Vec::new();
    for who in ["alice", "bob"] {
        let c = server.client().await;
        customers.push(tokio::spawn(async move {
            let replies = format!("replies.{who}");
            c.create_queue(&replies, QueueConfig { temporary: true, ..QueueConfig::default() }).await.unwrap();
            let orders = (0..10)
                .map(|i| Message {
                    reply_to: replies.clone(),
                    request_id: format!("{who}-{i}"),
                    ..Message::new("latte")
                })
                .collect();
            c.offer("orders", orders, None).await.unwrap();
            let mut ids = Vec::new();
            while ids.len() < 10 {
                let wait = PollOptions { max: 10, timeout: Duration::from_secs(5), visibility: None };
                let got = c.poll(&replies, wait).await.unwrap();
                assert!(!got.is_empty(), "{who} waited 5 s for coffee");
                for d in got {
                    assert!(text(&d.message).starts_with("latte by w"));
                    ids.push(d.message.request_id);
                }
            }
            ids.sort();
            let mut want: Vec<String> = (0..10).map(|i| format!("{who}-{i}")).collect();
            want.sort();
            assert_eq!(ids, want, "each of {who}'s orders answered once, on {who}'s own queue");
            c.close();
        }));
    }
    for c in customers {
        c.await.unwrap();
    }
    let made: usize = futures_all(workers).await.into_iter().map(|r| r.unwrap()).sum();
    assert_eq!(made, 20);
    // The reply queues were temporary: gone with their customers.
    let deadline = Instant::now() + Duration::from_secs(5);
    let admin = server.client().await;
    while admin.list_queues().await.unwrap() != ["orders"] {
        assert!(Instant::now() < deadline, "temporary reply queues outlived their connections");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn the_cli_publishes_subscribes_and_calls() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let petrel = |args: &[&str]| {
        let out =
            Command::new(env!("CARGO_BIN_EXE_petrel")).args(args).args(["--server", &server.addr]).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    petrel(&["topic", "create", "news"]);
    assert_eq!(petrel(&["topic", "list"]), "news\n");
    let mut sub = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["topic", "subscribe", "news", "--count", "2", "--server", &server.addr])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Publish until the subscriber is there (it subscribes after starting).
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(10);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = rt.block_on(server.client());
    while rt.block_on(client.publish("news", vec![])).unwrap() == 0 {
        assert!(Instant::now() < deadline, "the subscriber never subscribed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut publish = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["topic", "publish", "news", "--server", &server.addr])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    publish.stdin.take().unwrap().write_all(b"first\nsecond\n").unwrap();
    assert!(publish.wait().unwrap().success());
    assert_eq!(lines.next().unwrap().unwrap(), "first");
    assert_eq!(lines.next().unwrap().unwrap(), "second");
    assert!(sub.wait().unwrap().success());

    rt.block_on(client.serve("shout", |m: Message| async move { Ok(Message::new(text(&m).to_uppercase())) })).unwrap();
    assert_eq!(petrel(&["call", "shout", "--data", "hello"]), "HELLO\n");
    let out = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["call", "nobody", "--data", "x", "--server", &server.addr])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("FUNCTION_NOT_FOUND"), "{out:?}");
}

async fn take(sub: &mut petrel_client::Subscription, n: usize) -> Vec<Message> {
    let mut out = Vec::new();
    for i in 0..n {
        let next = tokio::time::timeout(Duration::from_secs(10), sub.next()).await;
        let m = next.unwrap_or_else(|_| panic!("{sub:?}: message {i} of {n} did not come"));
        out.push(m.unwrap().unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_topics_replay_from_an_offset_or_a_time_and_groups_keep_their_own_pace() {
    use petrel_client::StartFrom;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_topic("orders", true).await.unwrap();
    c.publish("orders", (0..50).map(|i| Message::new(format!("o{i}"))).collect()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let midpoint = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    tokio::time::sleep(Duration::from_millis(30)).await;
    c.publish("orders", (50..100).map(|i| Message::new(format!("o{i}"))).collect()).await.unwrap();

    let mut from_offset = c.subscribe_group("orders", "audit", StartFrom::Offset(90), 100).await.unwrap();
    let got = take(&mut from_offset, 10).await;
    assert_eq!(got.iter().map(text).collect::<Vec<_>>(), (90..100).map(|i| format!("o{i}")).collect::<Vec<_>>());
    assert_eq!(got[0].id, 91, "a message's id is its offset + 1");

    let mut from_time = c.subscribe_group("orders", "late", StartFrom::Time(midpoint), 100).await.unwrap();
    assert_eq!(text(&take(&mut from_time, 1).await[0]), "o50", "the first published at or after the time");

    // Two groups from the oldest, at their own pace; acks limit what is in flight.
    let a_client = server.client().await;
    let mut a = a_client.subscribe_group("orders", "billing", StartFrom::Oldest, 10).await.unwrap();
    let b_client = server.client().await;
    let mut b = b_client.subscribe_group("orders", "shipping", StartFrom::Oldest, 100).await.unwrap();
    let first = take(&mut a, 10).await;
    assert!(tokio::time::timeout(Duration::from_millis(300), a.next()).await.is_err(), "10 unacknowledged: no more");
    assert_eq!(a.ack(&first.iter().map(|m| m.id).collect::<Vec<_>>()).await.unwrap(), 10);
    assert_eq!(text(&take(&mut a, 1).await[0]), "o10", "more after the acks");
    let all_b = take(&mut b, 100).await;
    assert_eq!(text(&all_b[99]), "o99");
    assert_eq!(b.ack(&all_b.iter().map(|m| m.id).collect::<Vec<_>>()).await.unwrap(), 100);
    // A second subscriber of a group that is being read is refused.
    let err = c.subscribe_group("orders", "billing", StartFrom::Resume, 10).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::Exists));
    // Live subscribers of a durable topic get new messages too.
    let mut live = c.subscribe("orders", 0).await.unwrap();
    c.publish("orders", vec![Message::new("o100")]).await.unwrap();
    assert_eq!(text(&take(&mut live, 1).await[0]), "o100");
    assert_eq!(text(&take(&mut b, 1).await[0]), "o100");
}

/// Publishes pipelined on one connection to a durable topic are stored in the order they were
/// sent (each is stored on a blocking thread of its own, which could start before the last's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_publishes_to_a_durable_topic_are_stored_in_order() {
    use petrel_client::{Request, StartFrom};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_topic("ordered", true).await.unwrap();
    let n = 400;
    let requests: Vec<Request> = (0..n)
        .map(|i| Request::Publish { topic: "ordered".into(), messages: vec![Message::new(format!("m{i}"))] })
        .collect();
    for answer in c.pipeline(&requests).await {
        answer.unwrap();
    }
    let mut sub = c.subscribe_group("ordered", "reader", StartFrom::Oldest, 1000).await.unwrap();
    let got: Vec<String> = take(&mut sub, n).await.iter().map(text).collect();
    assert_eq!(got, (0..n).map(|i| format!("m{i}")).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_resumes_after_kill_9_with_nothing_acknowledged_delivered_again() {
    use petrel_client::StartFrom;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data);
    let c = server.client().await;
    c.create_topic("events", true).await.unwrap();
    c.publish("events", (0..100).map(|i| Message::new(format!("e{i}"))).collect()).await.unwrap();
    let mut sub = c.subscribe_group("events", "indexer", StartFrom::Oldest, 50).await.unwrap();
    let got = take(&mut sub, 50).await;
    // Acknowledge the first 30 (and one out of order), then the server dies.
    let mut acked: Vec<u64> = got[..30].iter().map(|m| m.id).collect();
    acked.push(got[40].id);
    assert_eq!(sub.ack(&acked).await.unwrap(), 31);
    server.kill9();

    let server = Server::start(&data);
    let c = server.client().await;
    assert_eq!(c.list_topics().await.unwrap(), ["events"]);
    let mut sub = c.subscribe_group("events", "indexer", StartFrom::Resume, 100).await.unwrap();
    let again: Vec<String> = take(&mut sub, 69).await.iter().map(text).collect();
    let want: Vec<String> = (30..100).filter(|&i| i != 40).map(|i| format!("e{i}")).collect();
    assert_eq!(again, want, "from the first unacknowledged, the out-of-order ack remembered");
    assert!(tokio::time::timeout(Duration::from_millis(300), sub.next()).await.is_err(), "and nothing else");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_can_be_subscribed_again_at_once_after_unsubscribe_or_reconnect() {
    use petrel_client::StartFrom;
    let dir = tempfile::tempdir().unwrap();
    // The wait for the ending subscription to let the group go, longer than the default 200 ms:
    // on a loaded machine the server may see the closed connection later than that.
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "group_release_wait_ms = 10000\n").unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let c = server.client().await;
    c.create_topic("jobs", true).await.unwrap();
    c.publish("jobs", (0..3).map(|i| Message::new(format!("j{i}"))).collect()).await.unwrap();
    let mut sub = c.subscribe_group("jobs", "w", StartFrom::Oldest, 10).await.unwrap();
    let first = take(&mut sub, 1).await;
    sub.ack(&[first[0].id]).await.unwrap();
    sub.unsubscribe().await.unwrap();
    let mut sub = c.subscribe_group("jobs", "w", StartFrom::Resume, 10).await.unwrap();
    assert_eq!(text(&take(&mut sub, 1).await[0]), "j1", "resumed after the acknowledged one");
    // The connection goes away with j1 unacknowledged; a new one takes the group at once.
    c.close();
    let c2 = server.client().await;
    let mut sub = c2.subscribe_group("jobs", "w", StartFrom::Resume, 10).await.unwrap();
    assert_eq!(take(&mut sub, 2).await.iter().map(text).collect::<Vec<_>>(), ["j1", "j2"]);
}

/// A subscriber whose client-side buffer fills does not stop its connection: a group subscriber
/// allowed more unacknowledged messages than the client buffers by default acknowledges each as
/// it reads it, and a live subscriber that offers to a queue for each message it reads goes on
/// (ended with SLOW_CONSUMER if it falls too far behind, never stuck).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_subscription_buffer_does_not_stop_the_connections_other_answers() {
    use petrel_proto::StartFrom;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let publisher = server.client().await;
    publisher.create_topic("events", true).await.unwrap();
    for chunk in 0..6 {
        publisher
            .publish("events", (0..500).map(|i| Message::new(format!("e{}", chunk * 500 + i))).collect())
            .await
            .unwrap();
    }
    let consumer = server.client().await;
    let mut sub = consumer.subscribe_group("events", "g", StartFrom::Oldest, 3000).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // all 3,000 pushed meanwhile
    let read_and_ack = async {
        for i in 0..3000 {
            let m = sub.next().await.unwrap().unwrap();
            assert_eq!(text(&m), format!("e{i}"));
            sub.ack(&[m.id]).await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read_and_ack).await.expect("acknowledgements answered");

    // Live: 3,000 pushed before the subscriber reads; it offers one message per message read.
    publisher.create_topic("live", false).await.unwrap();
    publisher.create_queue("out", petrel_client::QueueConfig::default()).await.unwrap();
    let mut live = consumer.subscribe("live", 4000).await.unwrap();
    for chunk in 0..6 {
        publisher
            .publish("live", (0..500).map(|i| Message::new(format!("l{}", chunk * 500 + i))).collect())
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let relay = async {
        let mut relayed = 0;
        while let Some(m) = live.next().await {
            match m {
                Ok(m) => {
                    consumer.offer("out", vec![m], None).await.unwrap();
                    relayed += 1;
                    if relayed == 3000 {
                        break;
                    }
                }
                Err(e) => {
                    assert_eq!(e.status(), Some(Status::SlowConsumer), "{e}");
                    break;
                }
            }
        }
        relayed
    };
    let relayed = tokio::time::timeout(Duration::from_secs(30), relay).await.expect("the relay never stuck");
    assert!(relayed > 0);
    consumer.ping().await.unwrap();
}

/// A SUBSCRIBE whose caller gave up before its answer came (a timeout around it, a cancelled
/// task) leaves no subscription behind: the consumer group is free for the next subscribe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribe_given_up_before_its_answer_leaves_no_subscription() {
    use petrel_proto::StartFrom;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_topic("events", true).await.unwrap();
    {
        // Sent (the first poll queues the request), then given up before any answer can come.
        let subscribing = c.subscribe_group("events", "g", StartFrom::Oldest, 10);
        tokio::pin!(subscribing);
        tokio::select! {
            biased;
            _ = &mut subscribing => panic!("answered before it was given up"),
            () = std::future::ready(()) => {}
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut sub = c.subscribe_group("events", "g", StartFrom::Oldest, 10).await.expect("the group is free");
    c.publish("events", vec![Message::new("one")]).await.unwrap();
    assert_eq!(text(&sub.next().await.unwrap().unwrap()), "one");
}

/// Removing a durable topic ends its consumer-group subscriptions with TOPIC_NOT_FOUND, as it
/// ends live ones (protocol.md); they waited for appends that never came, holding the deleted
/// segments' disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_durable_topic_ends_its_group_subscriptions() {
    use petrel_client::StartFrom;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let c = server.client().await;
    c.create_topic("orders", true).await.unwrap();
    c.publish("orders", vec![Message::new("o1")]).await.unwrap();
    let mut sub = c.subscribe_group("orders", "billing", StartFrom::Oldest, 0).await.unwrap();
    assert_eq!(text(&take(&mut sub, 1).await[0]), "o1");
    c.remove_topic("orders").await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("the subscription ends");
    let e = end.expect("told why").expect_err("an end, not a message");
    assert_eq!(e.status(), Some(Status::TopicNotFound), "{e}");
}

/// A group subscription dropped on a thread with no async runtime lets its group go: before, its
/// drop could not unsubscribe there, and the group stayed held (EXISTS to its next reader) for
/// as long as the connection lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_subscription_dropped_outside_the_runtime_lets_its_group_go() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let first = server.client().await;
    first.create_topic("t", true).await.unwrap();
    let oldest = petrel_client::StartFrom::Oldest;
    let sub = first.subscribe_group("t", "g", oldest, 10).await.unwrap();
    std::thread::spawn(move || drop(sub)).join().unwrap();
    let next = server.client().await;
    let began = Instant::now();
    loop {
        match next.subscribe_group("t", "g", oldest, 10).await {
            Ok(_) => break,
            Err(e) => assert!(began.elapsed() < Duration::from_secs(5), "the group is still held: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
