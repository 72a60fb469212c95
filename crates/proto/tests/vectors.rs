//! The test vectors in `tests/vectors/*.json` are the protocol's contract: bytes and their
//! meaning. Every vector must decode to its meaning and its meaning must encode to its bytes.
//!
//! To regenerate the files after a deliberate protocol change (and a version bump):
//! `PETREL_BLESS_VECTORS=1 cargo test -p petrel-proto --test vectors`.

use std::path::PathBuf;

use bytes::{Bytes, BytesMut};
use petrel_proto::{
    Delivery, FrameKind, GroupStats, Message, MessageKind, Push, QueueConfig, QueueStats, Request, Response, StartFrom,
    Status, TopicStats, compression, features, frame, hex, opcode,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Vector {
    name: String,
    description: String,
    kind: FrameKind,
    opcode: u16,
    request_id: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    request: Option<Request>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<Response>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    push: Option<Push>,
    hex: String,
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors")
}

fn full_message() -> Message {
    Message {
        id: 0,
        kind: MessageKind::Request,
        status: Status::Ok,
        durable: true,
        compressed: false,
        timestamp: 0,
        expires_at: 1_700_000_060_000_000_000,
        deliveries: 0,
        priority: 0,
        idempotency_key: Default::default(),
        deliver_at: 0,
        delay_ms: 0,
        request_id: "req-1".into(),
        subject: "coffee".into(),
        destination: "orders".into(),
        reply_to: "tmp.42".into(),
        mimetype: "text/plain".into(),
        charset: "UTF-8".into(),
        headers: vec![("priority".into(), Bytes::from_static(b"high"))],
        payload: Bytes::from_static(b"espresso"),
    }
}

fn request(name: &str, description: &str, id: u64, r: Request) -> Vector {
    let mut out = Vec::new();
    r.encode(id, &mut out).unwrap();
    Vector {
        name: name.into(),
        description: description.into(),
        kind: FrameKind::Request,
        opcode: r.opcode(),
        request_id: id,
        request: Some(r),
        response: None,
        push: None,
        hex: hex::encode(&out),
    }
}

fn response(name: &str, description: &str, op: u16, id: u64, r: Response) -> Vector {
    let mut out = Vec::new();
    r.encode(op, id, &mut out);
    Vector {
        name: name.into(),
        description: description.into(),
        kind: FrameKind::Response,
        opcode: op,
        request_id: id,
        request: None,
        response: Some(r),
        push: None,
        hex: hex::encode(&out),
    }
}

fn push(name: &str, description: &str, id: u64, p: Push) -> Vector {
    let mut out = Vec::new();
    p.encode(id, &mut out).unwrap();
    Vector {
        name: name.into(),
        description: description.into(),
        kind: FrameKind::Push,
        opcode: p.opcode(),
        request_id: id,
        request: None,
        response: None,
        push: Some(p),
        hex: hex::encode(&out),
    }
}

/// The cases the vector files are made from.
fn cases() -> Vec<Vector> {
    let q = |s: &str| s.to_string();
    vec![
        request(
            "hello",
            "first request on a connection; the client reads zstd payloads",
            1,
            Request::Hello { client: q("petrel-client/0.1"), features: features::ZSTD },
        ),
        request("auth", "authenticate as a user", 2, Request::Auth { user: q("tom"), password: q("3-kio") }),
        response(
            "hello_ok",
            "server name, its largest frame, and the features in force: AUTH required, zstd payloads",
            opcode::HELLO,
            1,
            Response::Hello {
                server: q("petrel/0.1.0"),
                max_frame: 16_842_752,
                features: features::AUTH_REQUIRED | features::ZSTD,
            },
        ),
        response("auth_ok", "authenticated", opcode::AUTH, 2, Response::Done),
        response(
            "auth_refused",
            "a wrong user name or password: one answer for both",
            opcode::AUTH,
            2,
            Response::error(Status::Unauthorized, "invalid user name or password"),
        ),
        request("ping", "an empty body", 2, Request::Ping),
        response("pong", "status OK, nothing else", opcode::PING, 2, Response::Pong),
        request(
            "queue_create_bounded_durable",
            "a durable queue of at most 1000 messages of at most 64 KiB, with a 60 s TTL, a dead-letter queue, and an fsync per offer",
            3,
            Request::QueueCreate {
                name: q("orders"),
                config: Box::new(QueueConfig {
                    max_items: 1000,
                    max_bytes: 0,
                    circular: false,
                    durable: true,
                    temporary: false,
                    ttl_ms: 60_000,
                    dead_letter: q("orders.dead"),
                    max_item_bytes: 65_536,
                    durability: q("always"),
                    max_deliveries: 0,
                    priorities: 0,
                    priority_share: 0,
                    dedup_window: 0,
                    dedup_window_ms: 0,
                    redelivery_delay_ms: 0,
                    redelivery_delay_max_ms: 0,
                }),
            },
        ),
        request(
            "queue_create_delivery_limit",
            "a durable queue whose messages go to a dead-letter queue after 5 deliveries: the extensions byte (1) and max_deliveries after durability",
            3,
            Request::QueueCreate {
                name: q("jobs"),
                config: Box::new(QueueConfig {
                    durable: true,
                    dead_letter: q("jobs.poison"),
                    max_deliveries: 5,
                    ..QueueConfig::default()
                }),
            },
        ),
        request(
            "queue_create_priorities_dedup",
            "a durable queue with 3 priority levels (a 20% share for the lower ones) that remembers 50,000 idempotency keys for 60 s: extensions 2|4|8|16 = 30, then priorities, priority_share, dedup_window and dedup_window_ms after durability",
            3,
            Request::QueueCreate {
                name: q("work"),
                config: Box::new(QueueConfig {
                    durable: true,
                    priorities: 3,
                    priority_share: 20,
                    dedup_window: 50_000,
                    dedup_window_ms: 60_000,
                    ..QueueConfig::default()
                }),
            },
        ),
        request(
            "queue_create_redelivery_backoff",
            "a durable queue whose returned messages come back after 500 ms, then 1 s, 2 s… at most 60 s: extensions 32|64 = 96, then redelivery_delay_ms and redelivery_delay_max_ms after durability",
            3,
            Request::QueueCreate {
                name: q("retries"),
                config: Box::new(QueueConfig {
                    durable: true,
                    redelivery_delay_ms: 500,
                    redelivery_delay_max_ms: 60_000,
                    ..QueueConfig::default()
                }),
            },
        ),
        response("queue_create_ok", "done", opcode::QUEUE_CREATE, 3, Response::Done),
        response(
            "queue_create_exists",
            "an error: status and reason",
            opcode::QUEUE_CREATE,
            3,
            Response::error(Status::Exists, "queue orders exists with another configuration"),
        ),
        request("queue_remove", "by name", 4, Request::QueueRemove { name: q("orders") }),
        request("queue_list", "an empty body", 5, Request::QueueList),
        response(
            "queue_list_ok",
            "a count, then names",
            opcode::QUEUE_LIST,
            5,
            Response::QueueList { names: vec![q("orders"), q("tmp.42")] },
        ),
        request("queue_status", "by name", 6, Request::QueueStatus { name: q("orders") }),
        response(
            "queue_status_ok",
            "eight counters, then the configuration",
            opcode::QUEUE_STATUS,
            6,
            Response::QueueStatus {
                stats: Box::new(QueueStats {
                    items: 3,
                    bytes: 24,
                    in_flight: 1,
                    total_offered: 10,
                    total_polled: 7,
                    expired: 1,
                    dropped: 0,
                    waiters: 2,
                    config: QueueConfig { max_items: 1000, ..QueueConfig::default() },
                    ..QueueStats::default()
                }),
            },
        ),
        response(
            "queue_status_delayed",
            "a queue holding 40 delayed messages: after the configuration, an extensions byte (1) and the delayed count",
            opcode::QUEUE_STATUS,
            6,
            Response::QueueStatus {
                stats: Box::new(QueueStats {
                    items: 3,
                    bytes: 344,
                    total_offered: 43,
                    config: QueueConfig { durable: true, ..QueueConfig::default() },
                    delayed: 40,
                    ..QueueStats::default()
                }),
            },
        ),
        request(
            "hello_answer_fields",
            "a client that reads the optional fields at the end of OFFERED (repeats) and QUEUE_STATUS (the figures after delayed): features 4 | 8",
            1,
            Request::Hello { client: q("my-client/2"), features: features::OFFER_REPEATS | features::QUEUE_FIGURES },
        ),
        response(
            "queue_status_figures",
            "for a client that asked for them (features 8): a durable queue's figures after the configuration, extensions 2|4|8|16|32|64 = 126 (acked, aborted, dead_lettered, deduplicated, dedup_keys, then the durability in force as a string)",
            opcode::QUEUE_STATUS,
            6,
            Response::QueueStatus {
                stats: Box::new(QueueStats {
                    items: 5,
                    bytes: 40,
                    total_offered: 9,
                    total_polled: 4,
                    config: QueueConfig { durable: true, max_deliveries: 3, ..QueueConfig::default() },
                    acked: 3,
                    aborted: 2,
                    dead_lettered: 1,
                    deduplicated: 7,
                    dedup_keys: 9,
                    durability_in_force: q("always"),
                    ..QueueStats::default()
                }),
            },
        ),
        response(
            "queue_status_memory_limit",
            "for a client that asked for the figures (features 8): a queue in memory with max_bytes 0 under the server's limit for such queues (64 MiB): extensions 128, then that limit",
            opcode::QUEUE_STATUS,
            6,
            Response::QueueStatus {
                stats: Box::new(QueueStats { max_bytes_in_force: 64 << 20, ..QueueStats::default() }),
            },
        ),
        request(
            "offer_one_plain",
            "one message with only a payload",
            7,
            Request::Offer { queue: q("orders"), timeout_ms: 0, messages: vec![Message::new(&b"hello"[..])] },
        ),
        request(
            "offer_priority_key",
            "one urgent message (priority 2) with an idempotency key, so that a retry of this offer is stored once: extensions 2|4 = 6, then the priority and the key after expires_at",
            7,
            Request::Offer {
                queue: q("work"),
                timeout_ms: 0,
                messages: vec![Message {
                    priority: 2,
                    idempotency_key: "order-1234".into(),
                    ..Message::new(&b"rush"[..])
                }],
            },
        ),
        request(
            "offer_delayed",
            "two messages handed out no earlier than a time (2026-11-24T12:00:00Z) and 1.5 s after the server accepts the offer: extensions 8 (deliver_at u64) and 16 (delay_ms u32) after expires_at",
            7,
            Request::Offer {
                queue: q("reminders"),
                timeout_ms: 0,
                messages: vec![
                    Message { deliver_at: 1_795_521_600_000_000_000, ..Message::new(&b"at noon"[..]) },
                    Message { delay_ms: 1_500, ..Message::new(&b"soon"[..]) },
                ],
            },
        ),
        request(
            "offer_compressed",
            "one message whose payload, \"espresso \" nine times (81 bytes), travels as a zstd frame (flags bit 1)",
            7,
            Request::Offer {
                queue: q("orders"),
                timeout_ms: 0,
                messages: vec![{
                    let mut m = Message::new("espresso ".repeat(9).into_bytes());
                    compression::compress(&mut m, 1);
                    assert!(m.compressed, "it shrinks");
                    m
                }],
            },
        ),
        request(
            "offer_batch_full_fields",
            "two messages, every field of the first set; waits up to 250 ms for room",
            8,
            Request::Offer {
                queue: q("orders"),
                timeout_ms: 250,
                messages: vec![full_message(), Message::new(Bytes::new())],
            },
        ),
        response(
            "offered",
            "ids of the accepted messages: first and count",
            opcode::OFFER,
            8,
            Response::Offered { first_id: 41, count: 2, repeats: 0 },
        ),
        response(
            "offered_repeats",
            "for a client that asked for it (features 4): an offer of three keyed messages of which one repeats a key the queue remembers, so two were stored (ids 41, 42) and repeats 1 follows the count",
            opcode::OFFER,
            8,
            Response::Offered { first_id: 41, count: 2, repeats: 1 },
        ),
        response(
            "offer_queue_full",
            "a bounded queue stayed full",
            opcode::OFFER,
            8,
            Response::error(Status::QueueFull, "orders is full (1000 messages)"),
        ),
        response(
            "offer_too_large",
            "the frame was over the limit; its request id is still answered",
            opcode::OFFER,
            9,
            Response::error(Status::TooLarge, "frame of 20000000 bytes exceeds the limit of 16842752"),
        ),
        request(
            "poll_tentative",
            "up to 10 messages, wait 1 s, take them tentatively for 30 s",
            10,
            Request::Poll { queue: q("orders"), max: 10, timeout_ms: 1000, visibility_ms: 30_000 },
        ),
        response(
            "polled",
            "a count, then handle and message for each",
            opcode::POLL,
            10,
            Response::Polled {
                deliveries: vec![Delivery {
                    handle: 7,
                    message: Message {
                        id: 41,
                        timestamp: 1_700_000_000_000_000_000,
                        destination: q("orders"),
                        payload: Bytes::from_static(b"hello"),
                        ..Message::default()
                    },
                }],
            },
        ),
        response(
            "polled_redelivered",
            "a message handed out for the third time: the extensions byte (1) and deliveries after expires_at",
            opcode::POLL,
            10,
            Response::Polled {
                deliveries: vec![Delivery {
                    handle: 9,
                    message: Message {
                        id: 41,
                        timestamp: 1_700_000_000_000_000_000,
                        deliveries: 3,
                        destination: q("orders"),
                        payload: Bytes::from_static(b"hello"),
                        ..Message::default()
                    },
                }],
            },
        ),
        response(
            "poll_empty",
            "nothing arrived before the timeout",
            opcode::POLL,
            10,
            Response::error(Status::QueueEmpty, ""),
        ),
        response(
            "poll_not_found",
            "no such queue",
            opcode::POLL,
            10,
            Response::error(Status::QueueNotFound, "no queue named orderz"),
        ),
        request(
            "ack",
            "acknowledge two tentative deliveries",
            11,
            Request::Ack { queue: q("orders"), handles: vec![7, 8] },
        ),
        response("acked", "how many handles were acknowledged", opcode::ACK, 11, Response::Acked { count: 2 }),
        request(
            "abort",
            "return a tentative delivery to the head",
            12,
            Request::Abort { queue: q("orders"), handles: vec![8], delay_ms: 0, unseen: false },
        ),
        request(
            "abort_delayed",
            "return a tentative delivery to be handed out again no earlier than 30 s from now: delay_ms after the handles",
            12,
            Request::Abort { queue: q("orders"), handles: vec![8], delay_ms: 30_000, unseen: false },
        ),
        request(
            "abort_unseen",
            "give back a delivery the client never saw (its poll was cancelled), to a server that granted features 16: delay_ms 0 then flags 1; its delivery is not counted",
            12,
            Request::Abort { queue: q("orders"), handles: vec![8], delay_ms: 0, unseen: true },
        ),
        response(
            "unsupported_opcode",
            "the answer to an opcode the server does not know",
            0x0777,
            13,
            Response::error(Status::Unsupported, "unknown opcode 0x0777"),
        ),
        request("topic_create", "a live topic", 20, Request::TopicCreate { name: q("prices"), durable: false }),
        request(
            "topic_create_durable",
            "a durable topic: a log that consumer groups replay",
            29,
            Request::TopicCreate { name: q("orders"), durable: true },
        ),
        request(
            "subscribe_group",
            "group billing of a durable topic, from offset 41, at most 500 unacknowledged",
            30,
            Request::Subscribe { topic: q("orders"), buffer: 500, group: q("billing"), from: StartFrom::Offset(41) },
        ),
        request(
            "topic_ack",
            "acknowledge two messages of subscription 4 by id",
            31,
            Request::TopicAck { subscription: 4, ids: vec![42, 43] },
        ),
        request("topic_list", "an empty body", 21, Request::TopicList),
        response(
            "topic_list_ok",
            "a count, then names",
            opcode::TOPIC_LIST,
            21,
            Response::TopicList { names: vec![q("prices")] },
        ),
        request("topic_status", "by name", 22, Request::TopicStatus { name: q("prices") }),
        response(
            "topic_status_ok",
            "durable, four counters, then each consumer group: name, committed, next_offset, lag, open",
            opcode::TOPIC_STATUS,
            22,
            Response::TopicStatus {
                stats: Box::new(TopicStats {
                    durable: true,
                    subscribers: 1,
                    published: 10,
                    delivered: 10,
                    slow_subscribers_ended: 0,
                    groups: vec![GroupStats { name: q("billing"), committed: 7, next_offset: 10, lag: 3, open: true }],
                }),
            },
        ),
        request(
            "subscribe",
            "subscribe, the server holding up to 1000 messages for this subscriber",
            22,
            Request::Subscribe { topic: q("prices"), buffer: 1000, group: q(""), from: StartFrom::Resume },
        ),
        response(
            "subscribed",
            "the subscription id: pushes carry it as their request id",
            opcode::SUBSCRIBE,
            22,
            Response::Subscribed { subscription: 3 },
        ),
        request(
            "publish",
            "one message to every subscriber",
            23,
            Request::Publish { topic: q("prices"), messages: vec![Message::new(&b"EUR 1.08"[..])] },
        ),
        response(
            "published",
            "how many subscribers it reached",
            opcode::PUBLISH,
            23,
            Response::Published { subscribers: 2 },
        ),
        push(
            "deliver",
            "a push for subscription 3: a count, then messages",
            3,
            Push::Deliver {
                messages: vec![Message {
                    timestamp: 1_700_000_000_000_000_000,
                    destination: q("prices"),
                    payload: Bytes::from_static(b"EUR 1.08"),
                    ..Message::default()
                }],
            },
        ),
        push(
            "subscription_end_slow",
            "the server ended subscription 3: it fell too far behind",
            3,
            Push::SubscriptionEnd { status: Status::SlowConsumer, reason: q("subscriber fell 1000 messages behind") },
        ),
        request("unsubscribe", "by subscription id", 24, Request::Unsubscribe { subscription: 3 }),
        request("serve", "this connection serves a function", 25, Request::Serve { function: q("coffee") }),
        request(
            "call",
            "a call with a 5 s timeout",
            26,
            Request::Call {
                function: q("coffee"),
                timeout_ms: 5000,
                oneway: false,
                message: Box::new(Message::new(&b"espresso"[..])),
            },
        ),
        push(
            "invoke",
            "the call pushed to a connection serving the function; the request id is the call's",
            9,
            Push::Invoke { function: q("coffee"), message: Box::new(Message::new(&b"espresso"[..])) },
        ),
        request(
            "return",
            "the function server's answer to call 9",
            27,
            Request::Return {
                call: 9,
                status: Status::Ok,
                error: q(""),
                message: Box::new(Message::new(&b"ready"[..])),
            },
        ),
        response(
            "reply",
            "the caller gets the reply",
            opcode::CALL,
            26,
            Response::Reply { message: Box::new(Message::new(&b"ready"[..])) },
        ),
        response(
            "call_not_found",
            "nobody serves the function",
            opcode::CALL,
            26,
            Response::error(Status::FunctionNotFound, "no server for function coffee"),
        ),
        response("call_oneway_done", "a oneway call was handed to a server", opcode::CALL, 28, Response::Done),
    ]
}

#[test]
fn vectors_decode_to_their_meaning_and_back() {
    if std::env::var_os("PETREL_BLESS_VECTORS").is_some() {
        std::fs::create_dir_all(dir()).unwrap();
        for v in cases() {
            let json = serde_json::to_string_pretty(&v).unwrap();
            std::fs::write(dir().join(format!("{}.json", v.name)), json + "\n").unwrap();
        }
    }
    let mut seen = 0;
    for entry in std::fs::read_dir(dir()).unwrap() {
        let path = entry.unwrap().path();
        let v: Vector = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let bytes = hex::decode(&v.hex).unwrap();
        let mut buf = BytesMut::from(&bytes[..]);
        let f = frame::decode(&mut buf, u32::MAX).unwrap().expect("a whole frame");
        assert!(buf.is_empty(), "{}: one frame exactly", v.name);
        assert_eq!((f.kind, f.opcode, f.request_id), (v.kind, v.opcode, v.request_id), "{}", v.name);
        let mut again = Vec::new();
        match (&v.request, &v.response, &v.push) {
            (Some(r), None, None) => {
                assert_eq!(&Request::decode(f.opcode, f.body).unwrap(), r, "{}: decode", v.name);
                r.encode(v.request_id, &mut again).unwrap();
            }
            (None, Some(r), None) => {
                assert_eq!(&Response::decode(f.opcode, f.body).unwrap(), r, "{}: decode", v.name);
                r.encode(v.opcode, v.request_id, &mut again);
            }
            (None, None, Some(p)) => {
                assert_eq!(&Push::decode(f.opcode, f.body).unwrap(), p, "{}: decode", v.name);
                p.encode(v.request_id, &mut again).unwrap();
            }
            _ => panic!("{}: a vector holds a request, a response or a push", v.name),
        }
        assert_eq!(hex::encode(&again), v.hex, "{}: encode", v.name);
        seen += 1;
    }
    assert_eq!(seen, cases().len(), "every case has its file (bless after adding one)");
}

#[test]
fn every_vector_in_the_files_is_the_one_the_code_makes() {
    for v in cases() {
        let on_disk: Vector =
            serde_json::from_str(&std::fs::read_to_string(dir().join(format!("{}.json", v.name))).unwrap()).unwrap();
        assert_eq!(on_disk, v, "{}", v.name);
    }
}
