//! The message every destination carries, and the response statuses.

use bytes::Bytes;
use compact_str::CompactString;
use serde::{Deserialize, Serialize};

use crate::DecodeError;
use crate::wire::{Reader, Writer, present};

/// Why a request succeeded or not. One byte on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[repr(u8)]
pub enum Status {
    #[default]
    Ok = 0,
    BadRequest = 1,
    ServerError = 2,
    HandlerError = 3,
    QueueNotFound = 4,
    QueueEmpty = 5,
    QueueFull = 6,
    TopicNotFound = 7,
    FunctionNotFound = 8,
    Unauthorized = 9,
    Forbidden = 10,
    TooLarge = 11,
    Timeout = 12,
    Unsupported = 13,
    Exists = 14,
    /// A subscriber fell too far behind and the server ended its subscription.
    SlowConsumer = 15,
    /// A server-wide or per-user limit was reached (the reason names it): queues, connections,
    /// memory. Unlike QUEUE_FULL it is not about one queue's bound.
    LimitReached = 16,
}

impl Status {
    pub fn from_u8(v: u8) -> Result<Status, DecodeError> {
        use Status::*;
        let status = match v {
            0 => Ok,
            1 => BadRequest,
            2 => ServerError,
            3 => HandlerError,
            4 => QueueNotFound,
            5 => QueueEmpty,
            6 => QueueFull,
            7 => TopicNotFound,
            8 => FunctionNotFound,
            9 => Unauthorized,
            10 => Forbidden,
            11 => TooLarge,
            12 => Timeout,
            13 => Unsupported,
            14 => Exists,
            15 => SlowConsumer,
            16 => LimitReached,
            _ => return Err(DecodeError::BadValue("status")),
        };
        Result::Ok(status)
    }

    pub fn name(self) -> &'static str {
        use Status::*;
        match self {
            Ok => "OK",
            BadRequest => "BAD_REQUEST",
            ServerError => "SERVER_ERROR",
            HandlerError => "HANDLER_ERROR",
            QueueNotFound => "QUEUE_NOT_FOUND",
            QueueEmpty => "QUEUE_EMPTY",
            QueueFull => "QUEUE_FULL",
            TopicNotFound => "TOPIC_NOT_FOUND",
            FunctionNotFound => "FUNCTION_NOT_FOUND",
            Unauthorized => "UNAUTHORIZED",
            Forbidden => "FORBIDDEN",
            TooLarge => "TOO_LARGE",
            Timeout => "TIMEOUT",
            Unsupported => "UNSUPPORTED",
            Exists => "EXISTS",
            SlowConsumer => "SLOW_CONSUMER",
            LimitReached => "LIMIT_REACHED",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a message is for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum MessageKind {
    #[default]
    Message = 0,
    Request = 1,
    Reply = 2,
    Oneway = 3,
}

impl MessageKind {
    pub fn from_u8(v: u8) -> Result<MessageKind, DecodeError> {
        Ok(match v {
            0 => MessageKind::Message,
            1 => MessageKind::Request,
            2 => MessageKind::Reply,
            3 => MessageKind::Oneway,
            _ => return Err(DecodeError::BadValue("message kind")),
        })
    }
}

/// A message. Strings are empty when unset; times are nanoseconds since the Unix epoch, 0 when
/// unset (`timestamp` is set by the server when the message is accepted).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Message {
    /// Assigned by the server; 0 from clients.
    pub id: u64,
    pub kind: MessageKind,
    /// For replies: how the request went.
    pub status: Status,
    pub durable: bool,
    /// The payload is zstd-compressed (flag bit 1). Connections compress and decompress
    /// (`compression`), so applications never see it set.
    pub compressed: bool,
    pub timestamp: u64,
    pub expires_at: u64,
    /// On a delivery from a queue: how many times the message has been handed out, this time
    /// included (1 the first time). 0 elsewhere; the server ignores it on offers.
    pub deliveries: u32,
    /// Its priority level in a queue with `priorities` (higher is more urgent; clamped to the
    /// queue's highest level, 0 in a queue without levels). Delivered as stored.
    pub priority: u8,
    /// A producer's key for this offer: a queue stores a message with a key it has seen within
    /// its dedup window once, and answers a repeat with the original's id. Delivered as stored.
    pub idempotency_key: CompactString,
    /// Handed out no earlier than this, ns since the epoch (0: at once). On a delivery: when a
    /// delayed message became due (0 for one that was never delayed).
    pub deliver_at: u64,
    /// On an offer: handed out no earlier than this many ms after the server accepts it (the
    /// later of this and `deliver_at`; the server's clock, so a producer's skew does not matter).
    /// 0 on deliveries.
    pub delay_ms: u32,
    pub request_id: String,
    pub subject: String,
    pub destination: String,
    pub reply_to: String,
    pub mimetype: String,
    pub charset: String,
    #[serde(with = "crate::hex::headers")]
    pub headers: Vec<(String, Bytes)>,
    #[serde(with = "crate::hex::bytes")]
    pub payload: Bytes,
}

/// What a header counts in a message's `size` beyond its name and value: about what holding one
/// takes in memory (its entry and its name's allocation).
pub const HEADER_SIZE: usize = 64;

/// Fewest bytes an encoded message takes (all strings and the payload empty).
pub(crate) const MESSAGE_MIN_LEN: usize = 8 + 4 + 8 + 8 + 6 * 2 + 2 + 4;

const FLAG_DURABLE: u8 = 1;
const FLAG_ZSTD: u8 = 2;

/// The extensions byte: which optional fields follow `expires_at`, in bit order. A field is
/// present exactly when it is not zero (so an encoder that knows none writes 0, the byte's old
/// "reserved").
const EXT_DELIVERIES: u8 = 1;
const EXT_PRIORITY: u8 = 2;
const EXT_IDEMPOTENCY_KEY: u8 = 4;
const EXT_DELIVER_AT: u8 = 8;
const EXT_DELAY_MS: u8 = 16;
const EXT_KNOWN: u8 = EXT_DELIVERIES | EXT_PRIORITY | EXT_IDEMPOTENCY_KEY | EXT_DELIVER_AT | EXT_DELAY_MS;

impl Message {
    pub fn new(payload: impl Into<Bytes>) -> Message {
        Message { payload: payload.into(), ..Message::default() }
    }

    /// How many text fields a message has (`texts`).
    pub const TEXT_FIELDS: usize = 7;

    /// The text fields, always in this order.
    pub fn texts(&self) -> [&str; Self::TEXT_FIELDS] {
        [
            &self.idempotency_key,
            &self.request_id,
            &self.subject,
            &self.destination,
            &self.reply_to,
            &self.mimetype,
            &self.charset,
        ]
    }

    /// Sets the text fields, given in `texts`' order.
    pub fn set_texts(&mut self, texts: [String; Self::TEXT_FIELDS]) {
        let [key, request_id, subject, destination, reply_to, mimetype, charset] = texts;
        self.idempotency_key = key.into();
        (self.request_id, self.subject, self.destination) = (request_id, subject, destination);
        (self.reply_to, self.mimetype, self.charset) = (reply_to, mimetype, charset);
    }

    /// Bytes counted against a queue's limits (`max_bytes`, `max_item_bytes`) and the server's
    /// memory budget: the payload, the text fields, and each header's name and value and
    /// `HEADER_SIZE` more (what holding a header takes: counted as nothing, 65,535 empty headers
    /// a message held megabytes outside every budget).
    pub fn size(&self) -> u64 {
        let texts = self.texts().iter().map(|t| t.len()).sum::<usize>();
        let headers = self.headers.iter().map(|(n, v)| n.len() + v.len() + HEADER_SIZE).sum::<usize>();
        (self.payload.len() + texts + headers) as u64
    }

    /// Whether the message's own expiry (`expires_at`, 0: none) has passed at `now_ns`.
    pub fn is_expired(&self, now_ns: u64) -> bool {
        self.expires_at != 0 && self.expires_at <= now_ns
    }

    /// Bytes this message takes on the wire.
    pub fn encoded_len(&self) -> usize {
        MESSAGE_MIN_LEN
            + if self.deliveries != 0 { 4 } else { 0 }
            + if self.priority != 0 { 1 } else { 0 }
            + if self.idempotency_key.is_empty() { 0 } else { 2 + self.idempotency_key.len() }
            + if self.deliver_at != 0 { 8 } else { 0 }
            + if self.delay_ms != 0 { 4 } else { 0 }
            + [&self.request_id, &self.subject, &self.destination, &self.reply_to, &self.mimetype, &self.charset]
                .iter()
                .map(|s| s.len())
                .sum::<usize>()
            + self.headers.iter().map(|(n, v)| 2 + n.len() + 4 + v.len()).sum::<usize>()
            + self.payload.len()
    }

    /// Whether every field fits its length prefix.
    pub(crate) fn check(&self) -> Result<(), crate::EncodeError> {
        if self.texts().iter().any(|s| s.len() > u16::MAX as usize)
            || self.headers.len() > u16::MAX as usize
            || self.headers.iter().any(|(n, v)| n.len() > u16::MAX as usize || v.len() > u32::MAX as usize)
            || self.payload.len() > u32::MAX as usize
        {
            return Err(crate::EncodeError::FieldTooLong);
        }
        Ok(())
    }

    /// Appends this message's encoding (as it appears inside OFFER, POLL, DELIVER…) to `out`.
    pub fn encode_to(&self, out: &mut Vec<u8>) {
        self.encode(&mut Writer::new(out));
    }

    /// Which optional fields follow `expires_at` (each present exactly when not zero).
    fn extensions(&self) -> u8 {
        let mut bits = 0;
        for (present, bit) in [
            (self.deliveries != 0, EXT_DELIVERIES),
            (self.priority != 0, EXT_PRIORITY),
            (!self.idempotency_key.is_empty(), EXT_IDEMPOTENCY_KEY),
            (self.deliver_at != 0, EXT_DELIVER_AT),
            (self.delay_ms != 0, EXT_DELAY_MS),
        ] {
            if present {
                bits |= bit;
            }
        }
        bits
    }

    pub(crate) fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.id);
        w.u8(self.kind as u8);
        w.u8(self.status as u8);
        w.u8(if self.durable { FLAG_DURABLE } else { 0 } | if self.compressed { FLAG_ZSTD } else { 0 });
        w.u8(self.extensions());
        w.u64(self.timestamp);
        w.u64(self.expires_at);
        if self.deliveries != 0 {
            w.u32(self.deliveries);
        }
        if self.priority != 0 {
            w.u8(self.priority);
        }
        if !self.idempotency_key.is_empty() {
            w.text(&self.idempotency_key);
        }
        if self.deliver_at != 0 {
            w.u64(self.deliver_at);
        }
        if self.delay_ms != 0 {
            w.u32(self.delay_ms);
        }
        for s in [&self.request_id, &self.subject, &self.destination, &self.reply_to, &self.mimetype, &self.charset] {
            w.text(s); // within its prefix: `check` on the way out, the decoder on the way in
        }
        w.u16(self.headers.len() as u16);
        for (name, value) in &self.headers {
            w.text(name);
            w.bytes(value);
        }
        w.payload(&self.payload);
    }

    pub(crate) fn decode(r: &mut Reader) -> Result<Message, DecodeError> {
        let id = r.u64("message id")?;
        let kind = MessageKind::from_u8(r.u8("message kind")?)?;
        let status = Status::from_u8(r.u8("message status")?)?;
        let flags = r.u8("message flags")?;
        if flags & !(FLAG_DURABLE | FLAG_ZSTD) != 0 {
            return Err(DecodeError::BadValue("message flags"));
        }
        let extensions = r.u8("message extensions")?;
        if extensions & !EXT_KNOWN != 0 {
            return Err(DecodeError::BadValue("message extensions"));
        }
        let timestamp = r.u64("timestamp")?;
        let expires_at = r.u64("expires_at")?;
        // Each optional field as its bit says, never its zero when present.
        let deliveries = if extensions & EXT_DELIVERIES != 0 {
            present(r.u32("deliveries")?, "deliveries (present, so not 0)")?
        } else {
            0
        };
        let priority = if extensions & EXT_PRIORITY != 0 {
            present(r.u8("priority")?, "priority (present, so not 0)")?
        } else {
            0
        };
        let idempotency_key = if extensions & EXT_IDEMPOTENCY_KEY != 0 {
            present(r.compact_str("idempotency_key")?, "idempotency_key (present, so not empty)")?
        } else {
            CompactString::default()
        };
        let deliver_at = if extensions & EXT_DELIVER_AT != 0 {
            present(r.u64("deliver_at")?, "deliver_at (present, so not 0)")?
        } else {
            0
        };
        let delay_ms = if extensions & EXT_DELAY_MS != 0 {
            present(r.u32("delay_ms")?, "delay_ms (present, so not 0)")?
        } else {
            0
        };
        let request_id = r.str("request_id")?;
        let subject = r.str("subject")?;
        let destination = r.str("destination")?;
        let reply_to = r.str("reply_to")?;
        let mimetype = r.str("mimetype")?;
        let charset = r.str("charset")?;
        let count = r.u16("header count")? as usize;
        let mut headers = Vec::with_capacity(count.min(64));
        for _ in 0..count {
            headers.push((r.str("header name")?, r.bytes("header value")?));
        }
        let payload = r.bytes("payload")?;
        Ok(Message {
            id,
            kind,
            status,
            durable: flags & FLAG_DURABLE != 0,
            compressed: flags & FLAG_ZSTD != 0,
            timestamp,
            expires_at,
            deliveries,
            priority,
            idempotency_key,
            deliver_at,
            delay_ms,
            request_id,
            subject,
            destination,
            reply_to,
            mimetype,
            charset,
            headers,
            payload,
        })
    }
}
