//! Topics and functions, with no sockets: the broker alone.

use std::sync::Arc;

use petrel_broker::{Broker, BrokerError, BrokerOptions, Called, Message};

fn broker() -> (Broker, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    (Broker::open(dir.path(), BrokerOptions::default()).unwrap(), dir)
}

type Outcome = Result<Message, BrokerError>;

/// A replier that hands the outcome to a oneshot channel.
fn replier() -> (petrel_broker::Replier, tokio::sync::oneshot::Receiver<Outcome>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    (Box::new(move |r| drop(tx.send(r))), rx)
}

const LONG: std::time::Duration = std::time::Duration::from_secs(60);

fn call(
    b: &Broker,
    f: &str,
    m: &str,
    oneway: bool,
) -> (Result<Called, BrokerError>, tokio::sync::oneshot::Receiver<Outcome>) {
    let (r, rx) = replier();
    (b.call(0, f, Message::new(m.to_owned()), oneway, 0, LONG, r), rx)
}

fn texts(sub: &mut petrel_broker::Subscription) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(m) = sub.try_recv() {
        out.push(String::from_utf8_lossy(&m.message.payload).into_owned());
    }
    sub.sent();
    out
}

/// A live topic hands on its publisher's message, but not the fields the server assigns or a
/// queue's delivery sets (an id, a delivery count, a delay).
#[test]
fn a_live_topic_does_not_hand_on_fields_the_server_sets() {
    let (b, _dir) = broker();
    b.create_topic("prices", false).unwrap();
    let mut sub = b.subscribe("prices", 1, 100).unwrap();
    let forged = Message { id: 77, deliveries: 3, delay_ms: 5, ..Message::new("x") };
    b.publish("prices", vec![forged], 9).unwrap();
    let got = sub.try_recv().unwrap();
    let m = &got.message;
    assert_eq!((m.id, m.deliveries, m.delay_ms, m.timestamp), (0, 0, 0, 9));
}

#[test]
fn every_subscriber_gets_every_message_and_a_slow_one_is_ended_alone() {
    let (b, _dir) = broker();
    assert!(matches!(b.publish("prices", vec![Message::new("x")], 0), Err(BrokerError::TopicNotFound(_))));
    b.create_topic("prices", false).unwrap();
    assert_eq!(b.publish("prices", vec![Message::new("before")], 0).unwrap(), 0, "nobody listens yet");
    let mut fast = b.subscribe("prices", 1, 100).unwrap();
    let mut slow = b.subscribe("prices", 2, 3).unwrap();
    for i in 0..5 {
        let reached = b.publish("prices", vec![Message::new(format!("p{i}"))], 0).unwrap();
        assert_eq!(reached, if i < 3 { 2 } else { 1 }, "message {i}");
    }
    assert_eq!(texts(&mut fast), ["p0", "p1", "p2", "p3", "p4"]);
    assert_eq!(texts(&mut slow), ["p0", "p1", "p2"], "what it had room for, then the end");
    assert!(slow.try_recv().is_none());
    assert!(matches!(slow.ended.get(), Some(petrel_broker::Ended::TooSlow(r)) if r.contains("behind")));
    let stats = b.topic("prices").unwrap().status();
    assert_eq!((stats.subscribers, stats.published, stats.slow_subscribers_ended), (1, 6, 1));

    b.unsubscribe(fast.id, 1);
    assert_eq!(b.publish("prices", vec![Message::new("after")], 0).unwrap(), 0);
    assert!(fast.ended.get().is_none(), "unsubscribed, not ended by the server");
    let other = b.subscribe("prices", 3, 10).unwrap();
    b.remove_topic("prices").unwrap();
    assert!(matches!(other.ended.get(), Some(petrel_broker::Ended::TopicRemoved(_))));
}

/// A message a subscription received stays counted until it is sent on (into its connection's
/// bounded outbox): subscribers of a connection that does not read each held one received
/// message outside the budget, however large.
#[test]
fn a_received_message_counts_in_the_memory_budget_until_it_is_sent_on() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { max_memory_bytes: 4 << 20, max_subscriber_bytes: 0, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    b.create_topic("news", false).unwrap();
    let mut subs: Vec<_> = (0..8).map(|i| b.subscribe("news", i, 16).unwrap()).collect();
    // Just under a megabyte each (a subscriber past the budget still takes that much).
    let almost_a_megabyte = (1 << 20) - 1024;
    b.publish("news", vec![Message::new(vec![7u8; almost_a_megabyte])], 0).unwrap();
    for sub in &mut subs {
        assert!(sub.try_recv().is_some());
    }
    assert!(b.memory().0 >= 8 * almost_a_megabyte as u64, "eight received, none sent on: {:?}", b.memory());
    let reached = b.publish("news", vec![Message::new(vec![7u8; almost_a_megabyte])], 0).unwrap();
    assert_eq!(reached, 0, "the budget is full: each subscriber holding a megabyte is ended");
    for sub in &mut subs {
        sub.sent();
    }
    drop(subs);
    assert_eq!(b.memory().0, 0, "every byte given back");
}

/// Past a full budget a subscriber takes at most a megabyte more, not a large message whatever
/// its size: 1,024 subscriptions of a connection that stopped reading each took a 16 MiB one.
#[test]
fn past_a_full_budget_no_subscriber_takes_a_large_message() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { max_memory_bytes: 4 << 20, max_subscriber_bytes: 0, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    b.create_topic("news", false).unwrap();
    let stalled = b.subscribe("news", 1, 64).unwrap();
    for _ in 0..4 {
        b.publish("news", vec![Message::new(vec![7u8; 900 << 10])], 0).unwrap();
    }
    let fresh: Vec<_> = (2..6).map(|i| b.subscribe("news", i, 64).unwrap()).collect();
    let before = b.memory().0;
    assert_eq!(b.publish("news", vec![Message::new(vec![7u8; 2 << 20])], 0).unwrap(), 0);
    assert_eq!(b.memory().0, before, "none took it");
    assert!(fresh.iter().all(|s| s.ended.get().is_some()));
    drop((stalled, fresh));
}

/// Messages waiting for subscribers count in the server's memory budget: when it is full, a
/// subscriber holding much is ended, one that keeps up goes on, and every byte comes back when
/// messages are taken or a subscription ends.
#[test]
fn subscriber_backlogs_count_in_the_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { max_memory_bytes: 4 << 20, max_subscriber_bytes: 0, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    b.create_topic("news", false).unwrap();
    let mut keeping_up = b.subscribe("news", 1, 1 << 20).unwrap();
    let stalled = b.subscribe("news", 2, 1 << 20).unwrap();
    let chunk = || vec![Message::new(vec![7u8; 64 << 10])];
    let mut reached = Vec::new();
    for _ in 0..100 {
        reached.push(b.publish("news", chunk(), 0).unwrap());
        assert_eq!(keeping_up.try_recv().map(|m| m.message.payload.len()), Some(64 << 10));
        keeping_up.sent();
    }
    assert!(b.memory().0 <= 4 << 20, "within the budget: {:?}", b.memory());
    let ended_at = reached.iter().position(|&n| n == 1).expect("the stalled subscriber was ended");
    assert!((55..=70).contains(&ended_at), "ended once it held the budget: after {ended_at} messages");
    assert!(
        matches!(stalled.ended.get(), Some(petrel_broker::Ended::TooSlow(r)) if r.contains("max_memory_bytes")),
        "{:?}",
        stalled.ended.get()
    );
    drop(stalled);
    assert_eq!(b.memory().0, 0, "the ended subscriber's backlog was given back");
    b.publish("news", chunk(), 0).unwrap();
    assert!(b.memory().0 > 0);
    drop(keeping_up);
    assert_eq!(b.memory().0, 0, "an ended subscription gives back what it never took");
}

/// Calls waiting for a server that does not take them count in the memory budget: oneway
/// calls (which free their caller at once) cannot pile up past it.
#[tokio::test]
async fn calls_waiting_for_their_server_count_in_the_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { max_memory_bytes: 4 << 20, ..BrokerOptions::default() }).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(256);
    b.serve("sink", 1, tx);
    let big = || Message::new(vec![0u8; 1 << 20]);
    let mut sent = 0;
    let refused = loop {
        let (r, _) = replier();
        match b.call(0, "sink", big(), true, 0, LONG, r) {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 10, "the budget holds four");
    };
    assert!(matches!(&refused, BrokerError::Limit(m) if m.contains("max_memory_bytes")), "{refused}");
    assert_eq!(sent, 3, "three of a megabyte and a bit fit in four");
    assert!(b.memory().0 <= 4 << 20);
    let (r, _) = replier();
    b.call(0, "sink", Message::new("tiny"), true, 0, LONG, r).expect("a small call goes all the same");
    let (r, _) = replier();
    let unserved = b.call(0, "nobody", big(), true, 0, LONG, r).err().expect("nothing serves it");
    assert!(matches!(unserved, BrokerError::FunctionNotFound(_)), "{unserved}");
    while rx.try_recv().is_ok() {}
    assert_eq!(b.memory().0, 0, "taken by the server's connection: given back");
}

/// A server with as many calls waiting for its answers as it may have is skipped: its
/// function's other servers take the calls, instead of it being handed calls it can only
/// refuse (a client answers a call past its handlers' queue HANDLER_ERROR).
#[tokio::test]
async fn a_server_behind_with_its_answers_is_skipped_for_the_others() {
    let (b, _dir) = broker();
    let (behind, mut behind_rx) = tokio::sync::mpsc::channel(4096);
    let (keeping_up, mut keeping_up_rx) = tokio::sync::mpsc::channel(4096);
    b.serve("f", 1, behind);
    b.serve("f", 2, keeping_up);
    let most = petrel_broker::MAX_CALLS_WAITING_PER_SERVER;
    let (mut replies, mut to_keeping_up) = (Vec::new(), 0);
    for _ in 0..3 * most {
        let (Ok(Called::Pending { .. }), reply) = call(&b, "f", "x", false) else { panic!("a server takes it") };
        replies.push(reply);
        // The one keeping up answers as calls come: it never has many waiting.
        while let Ok(inv) = keeping_up_rx.try_recv() {
            to_keeping_up += 1;
            assert!(b.reply(inv.call, 2, Ok(Message::new("done"))));
        }
    }
    let mut to_behind = 0;
    while behind_rx.try_recv().is_ok() {
        to_behind += 1;
    }
    assert_eq!((to_behind, to_keeping_up), (most, 2 * most));
}

#[tokio::test]
async fn calls_go_round_robin_to_servers_and_replies_come_back() {
    let (b, _dir) = broker();
    assert!(matches!(call(&b, "coffee", "x", false).0, Err(BrokerError::FunctionNotFound(_))));
    let (tx1, mut rx1) = tokio::sync::mpsc::channel(8);
    let (tx2, mut rx2) = tokio::sync::mpsc::channel(8);
    b.serve("coffee", 1, tx1);
    b.serve("coffee", 2, tx2);
    let (Ok(Called::Pending { call: first }), reply) = call(&b, "coffee", "espresso", false) else { panic!() };
    let (Ok(Called::Pending { call: second }), reply2) = call(&b, "coffee", "latte", false) else { panic!() };
    let inv1 = rx1.try_recv().unwrap();
    let inv2 = rx2.try_recv().unwrap();
    assert_eq!((inv1.call, inv2.call), (first, second), "one call each");
    assert!(!b.reply(first, 2, Ok(Message::new("wrong server"))), "only the server it went to answers");
    assert!(b.reply(first, 1, Ok(Message::new("ready"))));
    assert_eq!(&reply.await.unwrap().unwrap().payload[..], b"ready");
    b.reply(second, 2, Err("out of milk".into()));
    assert!(matches!(reply2.await.unwrap(), Err(BrokerError::Handler(m)) if m == "out of milk"));

    // A server that disconnects fails its calls.
    let (Ok(Called::Pending { .. }), reply) = call(&b, "coffee", "mocha", false) else { panic!() };
    let (Ok(Called::Pending { .. }), other) = call(&b, "coffee", "flat white", false) else { panic!() };
    b.disconnect(1, 1);
    b.disconnect(2, 1);
    assert!(matches!(reply.await.unwrap(), Err(BrokerError::Handler(_))));
    assert!(matches!(other.await.unwrap(), Err(BrokerError::Handler(_))));
    assert!(matches!(call(&b, "coffee", "x", false).0, Err(BrokerError::FunctionNotFound(_))));

    // A call nobody answers in time ends in Timeout at the tick after its deadline.
    let (tx3, _rx3) = tokio::sync::mpsc::channel(8);
    b.serve("slow", 3, tx3);
    let (r, late) = replier();
    let Ok(Called::Pending { call: c }) =
        b.call(0, "slow", Message::new("x"), false, 0, std::time::Duration::from_millis(5), r)
    else {
        panic!()
    };
    b.tick(1_000_000);
    let (r, mut early) = replier();
    b.call(0, "slow", Message::new("y"), false, 0, LONG, r).unwrap();
    b.tick(10_000_000);
    assert!(matches!(late.await.unwrap(), Err(BrokerError::Timeout(_))));
    assert!(early.try_recv().is_err(), "not before its deadline");
    assert!(!b.reply(c, 3, Ok(Message::new("too late"))), "a reply after the timeout finds nobody");

    // A caller that disconnects takes its calls with it: none waits out its timeout.
    let (r, _gone) = replier();
    let Ok(Called::Pending { call: c }) = b.call(7, "slow", Message::new("z"), false, 0, LONG, r) else { panic!() };
    let waiting = |b: &Broker| b.functions().iter().find(|f| f.name == "slow").map(|f| f.waiting);
    assert_eq!(waiting(&b), Some(2), "the one above, and this one");
    b.disconnect(7, 20_000_000);
    assert_eq!(waiting(&b), Some(1), "its caller's call is gone");
    assert!(!b.reply(c, 3, Ok(Message::new("for nobody"))), "its reply finds nobody");
}

#[test]
fn a_closure_serves_a_function_in_process() {
    let (b, _dir) = broker();
    b.serve_local(
        "upper",
        Arc::new(|m: Message| {
            if m.payload.is_empty() {
                return Err("nothing to shout".to_owned());
            }
            Ok(Message::new(String::from_utf8_lossy(&m.payload).to_uppercase()))
        }),
    );
    let (Ok(Called::Replied(reply)), _) = call(&b, "upper", "hi", false) else { panic!() };
    assert_eq!(&reply.payload[..], b"HI");
    assert!(matches!(call(&b, "upper", "", false).0, Err(BrokerError::Handler(_))));
    assert!(matches!(call(&b, "upper", "x", true).0.unwrap(), Called::Sent));
}

#[test]
fn a_durable_topic_keeps_its_messages_for_groups_that_resume_after_a_restart() {
    use petrel_broker::SeekTo;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_topic("orders", true).unwrap();
    assert!(matches!(b.create_topic("orders", false), Err(BrokerError::TopicExists(_, true))));
    b.publish("orders", (0..10).map(|i| Message::new(format!("o{i}"))).collect(), 0).unwrap();
    let topic = b.topic("orders").unwrap();
    let mut billing = topic.group("billing", Some(SeekTo::Oldest), 100).unwrap();
    let got = billing.poll(4, Duration::ZERO).unwrap();
    assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(billing.ack(&[1, 2]).unwrap(), 2);
    let mut audit = topic.group("audit", Some(SeekTo::Offset(8)), 100).unwrap();
    assert_eq!(audit.poll(10, Duration::ZERO).unwrap().len(), 2, "its own position: offsets 8 and 9");
    drop((billing, audit, topic));
    drop(b);

    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.topic_names(), ["orders"], "durable topics come back");
    let topic = b.topic("orders").unwrap();
    let mut billing = topic.group("billing", None, 100).unwrap();
    let again = billing.poll(100, Duration::ZERO).unwrap();
    let payloads: Vec<_> = again.iter().map(|m| String::from_utf8_lossy(&m.payload).into_owned()).collect();
    assert_eq!(payloads, ["o2", "o3", "o4", "o5", "o6", "o7", "o8", "o9"], "resumes after the acknowledged");
    let mut late = topic.group("late", None, 100).unwrap();
    assert!(late.poll(10, Duration::ZERO).unwrap().is_empty(), "a new group starts at the newest");
    b.remove_topic("orders").unwrap();
    assert!(!dir.path().join("topics/orders").exists());
}

#[test]
fn a_durable_topic_keeps_no_more_than_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { segment_bytes: 64 << 10, topic_max_bytes: 256 << 10, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    b.create_topic("firehose", true).unwrap();
    let payload = "x".repeat(1000);
    for _ in 0..20 {
        b.publish("firehose", (0..50).map(|_| Message::new(payload.clone())).collect(), 0).unwrap();
    }
    let on_disk: u64 = std::fs::read_dir(dir.path().join("topics/firehose"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(on_disk <= (256 << 10) + (64 << 10), "1 MB published, {on_disk} bytes kept");
    let topic = b.topic("firehose").unwrap();
    let mut g = topic.group("late", Some(petrel_broker::SeekTo::Oldest), 10).unwrap();
    let first = g.poll(1, std::time::Duration::ZERO).unwrap();
    assert!(first[0].id > 1, "the oldest messages are gone");
}

/// A cap of 0 is no cap, as for every other limit (it kept only the active segment).
#[test]
fn a_durable_topic_with_caps_of_zero_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions {
        segment_bytes: 64 << 10,
        topic_max_bytes: 0,
        topic_max_age: std::time::Duration::ZERO,
        ..BrokerOptions::default()
    };
    let b = Broker::open(dir.path(), options).unwrap();
    b.create_topic("firehose", true).unwrap();
    let payload = "x".repeat(1000);
    for _ in 0..20 {
        b.publish("firehose", (0..50).map(|_| Message::new(payload.clone())).collect(), 0).unwrap();
    }
    let topic = b.topic("firehose").unwrap();
    let mut g = topic.group("late", Some(petrel_broker::SeekTo::Oldest), 1000).unwrap();
    let (mut first, mut count) = (None, 0);
    loop {
        let batch = g.poll(1000, std::time::Duration::ZERO).unwrap();
        if batch.is_empty() {
            break;
        }
        first = first.or(Some(batch[0].id));
        count += batch.len();
        g.ack(&batch.iter().map(|m| m.id).collect::<Vec<_>>()).unwrap();
    }
    assert_eq!((first, count), (Some(1), 1000), "every message published is kept");
}

#[test]
fn a_durable_topic_whose_log_is_damaged_is_not_served_the_rest_is_and_a_repair_serves_it_again() {
    use petrel_broker::SeekTo;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_topic("orders", true).unwrap();
    b.create_topic("audit", true).unwrap();
    let payload = |i: usize| format!("order {i:04} {}", "x".repeat(100));
    b.publish("orders", (0..50).map(|i| Message::new(payload(i))).collect(), 0).unwrap();
    drop(b);
    let segment = dir.path().join("topics/orders/00000000000000000000.log");
    let mut bytes = std::fs::read(&segment).unwrap();
    bytes[64 + 20 * 150] ^= 0x5a; // a record in the middle, valid ones after it
    std::fs::write(&segment, &bytes).unwrap();

    // It stopped the whole start before.
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.topic_names(), ["audit"]);
    let damaged = b.damaged_topics();
    assert_eq!(damaged.len(), 1);
    assert!(damaged[0].0 == "orders" && damaged[0].1.contains("topics/orders"), "{damaged:?}");
    for e in [
        b.publish("orders", vec![Message::new("x")], 1).unwrap_err(),
        b.create_topic("orders", true).err().unwrap(),
        b.create_topic("orders", false).err().unwrap(),
        b.remove_topic("orders").unwrap_err(),
    ] {
        assert!(matches!(&e, BrokerError::Damaged { kind: "topic", name, .. } if name == "orders"), "{e}");
    }
    assert_eq!(std::fs::read(&segment).unwrap(), bytes, "its files are as they were");
    b.publish("audit", vec![Message::new("served")], 1).unwrap();

    // Fixed by hand (the bytes put back) it would be opened by a reload; here it stays damaged.
    let changes = b.reconfigure_queues(Default::default(), Default::default()).unwrap();
    assert!(changes.reopened_topics.is_empty() && b.damaged_topics().len() == 1);
    let report = b.repair_damaged_topic("orders").unwrap();
    assert!(report.next_offset > 0 && report.next_offset < 50, "{report:?}");
    assert!(b.damaged_topics().is_empty());
    let topic = b.topic("orders").unwrap();
    let mut all = topic.group("all", Some(SeekTo::Oldest), 100).unwrap();
    let got = all.poll(100, Duration::ZERO).unwrap();
    assert_eq!(got.len() as u64, report.next_offset, "every record before the damage");
    assert!(got.iter().enumerate().all(|(i, m)| m.payload == payload(i).as_bytes()));
    assert!(matches!(b.repair_damaged_topic("orders"), Err(BrokerError::BadRequest(_))), "served: not repaired");
}

#[test]
fn a_durable_topic_fixed_by_hand_is_opened_again_by_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    b.create_topic("orders", true).unwrap();
    b.publish("orders", (0..50).map(|i| Message::new(format!("order {i:04} {}", "x".repeat(100)))).collect(), 0)
        .unwrap();
    drop(b);
    let segment = dir.path().join("topics/orders/00000000000000000000.log");
    let good = std::fs::read(&segment).unwrap();
    let mut bad = good.clone();
    bad[64 + 20 * 150] ^= 0x5a;
    std::fs::write(&segment, &bad).unwrap();
    let b = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
    assert_eq!(b.damaged_topics().len(), 1);
    std::fs::write(&segment, &good).unwrap();
    let changes = b.reconfigure_queues(Default::default(), Default::default()).unwrap();
    assert_eq!(changes.reopened_topics, ["orders"]);
    assert!(b.damaged_topics().is_empty());
    assert_eq!(b.topic_names(), ["orders"]);
}

/// The segment files of a durable topic's log, by name.
fn segment_files(dir: &std::path::Path, topic: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("topics").join(topic))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".log"))
        .collect();
    names.sort();
    names
}

/// A durable topic nobody publishes to any more lets its messages go once they are past
/// `topic_max_age`, those in its active segment too (before, only segments sealed by later
/// publishes were looked at, so an idle topic kept its last messages for ever).
#[test]
fn an_idle_durable_topic_lets_its_messages_past_their_age_go() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { topic_max_age: std::time::Duration::from_secs(3600), ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    b.create_topic("old", true).unwrap();
    b.publish("old", (0..100).map(|i| Message::new(format!("m{i}"))).collect(), now - 7200 * 1_000_000_000).unwrap();
    b.create_topic("fresh", true).unwrap();
    b.publish("fresh", vec![Message::new("new")], now).unwrap();
    assert_eq!(segment_files(dir.path(), "old"), ["00000000000000000000.log"]);
    b.tick(now);
    assert_eq!(segment_files(dir.path(), "old"), ["00000000000000000100.log"], "past their age: gone");
    assert_eq!(segment_files(dir.path(), "fresh"), ["00000000000000000000.log"], "young: kept");
    // Published to again, it goes on from where it was.
    assert_eq!(b.publish("old", vec![Message::new("again")], now).unwrap(), 0);
    assert_eq!(segment_files(dir.path(), "old"), ["00000000000000000100.log"]);
}

/// A call and a reply are held to `max_message_bytes` as offers are: a call over it is refused,
/// and a reply over it reaches its caller as a handler error that says so.
#[tokio::test]
async fn calls_and_replies_over_the_message_limit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = Broker::open(dir.path(), BrokerOptions { max_message_bytes: 1024, ..BrokerOptions::default() }).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(8);
    b.serve("echo", 1, tx);
    let (r, _never) = replier();
    let big = Message::new(vec![7u8; 2048]);
    assert!(matches!(b.call(0, "echo", big.clone(), false, 0, LONG, r), Err(BrokerError::TooLarge { .. })));
    assert!(rx.try_recv().is_err(), "not handed to the server");
    let (Ok(Called::Pending { call }), reply) = call(&b, "echo", "small", false) else { panic!() };
    assert!(b.reply(call, 1, Ok(big)), "its caller is told");
    match reply.await.unwrap() {
        Err(BrokerError::Handler(why)) => assert!(why.contains("max_message_bytes") || why.contains("1024"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// A durable topic keeps at most `MAX_GROUPS_PER_TOPIC` consumer groups: a new name past it is
/// refused (`Limit`, saying how to remove some), one it has already opens as before.
#[test]
fn a_topic_keeps_a_bounded_number_of_consumer_groups() {
    let (b, _dir) = broker();
    let topic = b.create_topic("events", true).unwrap();
    let max = petrel_broker::MAX_GROUPS_PER_TOPIC;
    for i in 0..max {
        drop(topic.group(&format!("g{i}"), None, 16).unwrap());
    }
    match topic.group("one-more", None, 16) {
        Err(BrokerError::Limit(why)) => assert!(why.contains("consumer groups"), "{why}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(topic.group("g7", None, 16).unwrap());
    assert_eq!(topic.groups().len(), max);
}

/// At most `max_topics` topics are made; those already on disk open at start however many.
#[test]
fn at_most_max_topics_are_made_and_those_on_disk_always_open() {
    let dir = tempfile::tempdir().unwrap();
    let options = || BrokerOptions { max_topics: 2, ..BrokerOptions::default() };
    let b = Broker::open(dir.path(), options()).unwrap();
    b.create_topic("a", true).unwrap();
    b.create_topic("b", true).unwrap();
    b.create_topic("a", true).unwrap(); // one that exists is found, not made
    let e = b.create_topic("c", false).err().expect("a third is refused");
    assert!(matches!(&e, BrokerError::Limit(m) if m.contains("max_topics")), "{e}");
    drop(b);
    let b = Broker::open(dir.path(), BrokerOptions { max_topics: 1, ..options() }).unwrap();
    assert_eq!(b.topic_names(), ["a", "b"], "opened, past a smaller limit");
}

/// Publishes to a durable topic synced on every publish (`always`) wait for the disk outside the
/// subscribers' lock, several sharing a sync; a live subscriber still gets every message once, in
/// the order of the topic's log, each publisher's in the order it published them.
#[test]
fn concurrent_durable_publishes_reach_a_subscriber_in_the_log_s_order() {
    let dir = tempfile::tempdir().unwrap();
    let options = BrokerOptions { durability: petrel_log::Durability::Always, ..BrokerOptions::default() };
    let b = Arc::new(Broker::open(dir.path(), options).unwrap());
    b.create_topic("t", true).unwrap();
    let (publishers, each) = (8u32, 100u32);
    let mut sub = b.subscribe("t", 1, (publishers * each) as usize).unwrap();
    let threads: Vec<_> = (0..publishers)
        .map(|p| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                for i in 0..each {
                    let m = Message::new(format!("{p} {i}"));
                    assert_eq!(b.publish("t", vec![m], 1).unwrap(), 1);
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let mut last_id = 0;
    let mut next_of = vec![0u32; publishers as usize];
    for _ in 0..publishers * each {
        let d = sub.try_recv().expect("every message reached the subscriber");
        assert!(d.message.id > last_id, "in the log's order: {} after {last_id}", d.message.id);
        last_id = d.message.id;
        let text = String::from_utf8_lossy(&d.message.payload).into_owned();
        let (p, i) = text.split_once(' ').unwrap();
        let (p, i): (usize, u32) = (p.parse().unwrap(), i.parse().unwrap());
        assert_eq!(i, next_of[p], "publisher {p}'s in its order");
        next_of[p] += 1;
    }
    assert!(sub.try_recv().is_none(), "each once");
}
