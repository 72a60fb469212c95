//! The codec under bad input and arbitrary messages: clear errors, never a panic, never an
//! allocation a forged count asks for.

use bytes::{Bytes, BytesMut};
use petrel_proto::{
    DecodeError, FrameError, FrameKind, Message, MessageKind, Request, Response, Status, frame, opcode,
};
use proptest::prelude::*;

fn offer(messages: Vec<Message>) -> Vec<u8> {
    let mut out = Vec::new();
    Request::Offer { queue: "q".into(), timeout_ms: 5, messages }.encode(99, &mut out).unwrap();
    out
}

#[test]
fn pipelined_frames_come_out_one_by_one_and_partial_ones_wait() {
    let mut bytes = Vec::new();
    Request::Ping.encode(1, &mut bytes).unwrap();
    Request::QueueList.encode(2, &mut bytes).unwrap();
    bytes.extend_from_slice(&offer(vec![Message::new(&b"x"[..])]));
    for split in 0..bytes.len() {
        let mut buf = BytesMut::new();
        let mut ids = Vec::new();
        for chunk in [&bytes[..split], &bytes[split..]] {
            buf.extend_from_slice(chunk);
            while let Some(f) = frame::decode(&mut buf, 1 << 20).unwrap() {
                assert_eq!(f.kind, FrameKind::Request);
                Request::decode(f.opcode, f.body).unwrap();
                ids.push(f.request_id);
            }
        }
        assert_eq!(ids, [1, 2, 99], "split at {split}");
    }
}

#[test]
fn an_oversized_frame_is_refused_with_its_request_id() {
    let bytes = offer(vec![Message::new(vec![0u8; 5000])]);
    let mut buf = BytesMut::from(&bytes[..]);
    match frame::decode(&mut buf, 1000) {
        Err(FrameError::TooLarge { len, max: 1000, request_id: Some(99), opcode: Some(opcode::OFFER) }) => {
            assert_eq!(len as usize, bytes.len() - 4)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(buf.len(), bytes.len(), "nothing consumed: the caller skips it");
}

#[test]
fn malformed_and_unsupported_frames_are_errors() {
    let mut buf = BytesMut::from(&[0u8, 0, 0, 5, 1, 0, 0, 1, 0][..]);
    assert_eq!(frame::decode(&mut buf, 1 << 20), Err(FrameError::Malformed(5)));
    let mut bytes = Vec::new();
    Request::Ping.encode(7, &mut bytes).unwrap();
    bytes[4] = 9; // version
    let mut buf = BytesMut::from(&bytes[..]);
    assert!(matches!(frame::decode(&mut buf, 1 << 20), Err(FrameError::Unsupported { version: 9, request_id: 7, .. })));
    assert_eq!(Request::decode(0x0777, Bytes::new()), Err(DecodeError::UnknownOpcode(0x0777)));
}

#[test]
fn every_truncated_body_is_an_error() {
    let mut full = Message::new(&b"payload"[..]);
    full.subject = "s".into();
    full.headers = vec![("h".into(), Bytes::from_static(b"v"))];
    let bytes = offer(vec![full.clone(), full]);
    let body = Bytes::copy_from_slice(&bytes[16..]);
    for cut in 0..body.len() {
        assert!(Request::decode(opcode::OFFER, body.slice(..cut)).is_err(), "cut at {cut}");
    }
    let mut long = body.to_vec();
    long.push(0);
    assert_eq!(Request::decode(opcode::OFFER, long.into()), Err(DecodeError::TrailingBytes(1)));
}

#[test]
fn a_forged_count_does_not_allocate() {
    // An offer claiming 4 billion messages in a 10-byte body.
    let mut body = vec![0, 1, b'q', 0, 0, 0, 0];
    body.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(Request::decode(opcode::OFFER, body.into()), Err(DecodeError::Truncated(_))));
    let mut ack = vec![0, 1, b'q'];
    ack.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(Request::decode(opcode::ACK, ack.into()), Err(DecodeError::Truncated(_))));
}

#[test]
fn invalid_values_are_errors() {
    let mut m = Message::new(&b""[..]);
    m.kind = MessageKind::Reply;
    let mut bytes = offer(vec![m]);
    let kind_at = 16 + 3 + 4 + 4 + 8; // frame header, queue "q", timeout, count, id
    bytes[kind_at] = 200;
    assert_eq!(
        Request::decode(opcode::OFFER, Bytes::copy_from_slice(&bytes[16..])),
        Err(DecodeError::BadValue("message kind"))
    );
    let mut out = Vec::new();
    Response::error(Status::QueueFull, "full").encode(opcode::OFFER, 1, &mut out);
    out[16] = 250;
    assert_eq!(
        Response::decode(opcode::OFFER, Bytes::copy_from_slice(&out[16..])),
        Err(DecodeError::BadValue("status"))
    );
}

fn message() -> impl Strategy<Value = Message> {
    (
        any::<u64>(),
        0u8..4,
        any::<(bool, bool)>(),
        (any::<(u64, u64, u32)>(), any::<u8>(), ".{0,12}", any::<(u64, u32)>()),
        prop::collection::vec(".{0,12}", 6),
        prop::collection::vec((".{0,8}", prop::collection::vec(any::<u8>(), 0..16)), 0..4),
        prop::collection::vec(any::<u8>(), 0..200),
    )
        .prop_map(
            |(
                id,
                kind,
                (durable, compressed),
                ((timestamp, expires_at, deliveries), priority, key, (deliver_at, delay_ms)),
                s,
                headers,
                payload,
            )| {
                Message {
                    id,
                    kind: [MessageKind::Message, MessageKind::Request, MessageKind::Reply, MessageKind::Oneway]
                        [kind as usize],
                    status: Status::Ok,
                    durable,
                    compressed,
                    timestamp,
                    expires_at,
                    deliveries,
                    priority,
                    idempotency_key: key.into(),
                    deliver_at,
                    delay_ms,
                    request_id: s[0].clone(),
                    subject: s[1].clone(),
                    destination: s[2].clone(),
                    reply_to: s[3].clone(),
                    mimetype: s[4].clone(),
                    charset: s[5].clone(),
                    headers: headers.into_iter().map(|(n, v)| (n, v.into())).collect(),
                    payload: payload.into(),
                }
            },
        )
}

proptest! {
    #[test]
    fn messages_round_trip(messages in prop::collection::vec(message(), 0..5)) {
        let bytes = offer(messages.clone());
        let mut buf = BytesMut::from(&bytes[..]);
        let f = frame::decode(&mut buf, u32::MAX).unwrap().unwrap();
        let Request::Offer { messages: back, .. } = Request::decode(f.opcode, f.body).unwrap() else { panic!() };
        prop_assert_eq!(back.len(), messages.len());
        for (a, b) in back.iter().zip(&messages) {
            prop_assert_eq!(a, b);
            prop_assert!(a.encoded_len() > 0);
        }
        prop_assert_eq!(bytes.len(), 16 + 3 + 8 + messages.iter().map(Message::encoded_len).sum::<usize>());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300), op in prop::sample::select(vec![0x0001u16, 0x0002, 0x0100, 0x0101, 0x0102, 0x0103, 0x0110, 0x0111, 0x0112, 0x0113, 0x0999])) {
        let _ = Request::decode(op, Bytes::from(bytes.clone()));
        let _ = Response::decode(op, Bytes::from(bytes.clone()));
        let mut buf = BytesMut::from(&bytes[..]);
        while let Ok(Some(_)) = frame::decode(&mut buf, 1 << 16) {}
    }
}

#[test]
fn a_deliver_frame_from_encoded_messages_is_the_same_bytes() {
    let messages = vec![Message::new(&b"one"[..]), Message { subject: "s".into(), ..Message::new(&b"two"[..]) }];
    let mut whole = Vec::new();
    petrel_proto::Push::Deliver { messages: messages.clone() }.encode(9, &mut whole).unwrap();
    let encoded: Vec<Vec<u8>> = messages
        .iter()
        .map(|m| {
            let mut v = Vec::new();
            m.encode_to(&mut v);
            v
        })
        .collect();
    let mut pieces = Vec::new();
    petrel_proto::Push::encode_deliver(9, &encoded, &mut pieces).unwrap();
    assert_eq!(pieces, whole);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A frame encoded with its large payload left out, then that payload, is the frame `encode`
    /// makes; a small payload is never left out, and no other frame leaves one out.
    #[test]
    fn a_frame_with_its_payload_left_out_is_the_same_bytes(
        base in message(),
        large in any::<bool>(),
        fill in any::<u8>(),
    ) {
        let len = if large { petrel_proto::LARGE_PAYLOAD_BYTES + fill as usize } else { fill as usize };
        let message = Box::new(Message { payload: vec![fill; len].into(), ..base });
        let join = |mut head: Vec<u8>, tail: Option<Bytes>| {
            prop_assert_eq!(tail.is_some(), large);
            head.extend_from_slice(&tail.unwrap_or_default());
            Ok(head)
        };
        let requests = [
            Request::Call { function: "f".into(), timeout_ms: 5, oneway: false, message: message.clone() },
            Request::Return { call: 7, status: Status::Ok, error: String::new(), message: message.clone() },
        ];
        for request in requests {
            let (mut whole, mut head) = (Vec::new(), vec![1, 2, 3]);
            request.encode(9, &mut whole).unwrap();
            let tail = request.encode_split(9, &mut head).unwrap();
            prop_assert_eq!(&join(head, tail)?[3..], &whole[..]);
        }
        let push = petrel_proto::Push::Invoke { function: "f".into(), message: message.clone() };
        let (mut whole, mut head) = (Vec::new(), Vec::new());
        push.encode(4, &mut whole).unwrap();
        let tail = push.encode_split(4, &mut head).unwrap();
        prop_assert_eq!(join(head, tail)?, whole);
        let reply = Response::Reply { message: message.clone() };
        let (mut whole, mut head) = (Vec::new(), Vec::new());
        reply.encode(opcode::CALL, 4, &mut whole);
        let tail = reply.encode_split(opcode::CALL, 4, &mut head);
        prop_assert_eq!(join(head, tail)?, whole);
        let offer = Request::Offer { queue: "q".into(), timeout_ms: 5, messages: vec![*message] };
        prop_assert_eq!(offer.encode_split(9, &mut Vec::new()).unwrap(), None);
    }
}
