//! Requests and responses: what each opcode's body holds. Specified byte by byte in
//! `docs/protocol.md`; `tests/vectors/` pins every shape.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::frame::{self, FrameKind};
use crate::message::{MESSAGE_MIN_LEN, Message, Status};
use crate::wire::{Reader, Writer, present};
use crate::{DecodeError, EncodeError};

/// Bits of HELLO's `features`: what a client can do (request) and what the connection does
/// (response).
pub mod features {
    /// Response: this server requires AUTH (or a client certificate) before other requests.
    pub const AUTH_REQUIRED: u32 = 1;
    /// Request: the client reads zstd-compressed payloads. Response: both sides may send them.
    pub const ZSTD: u32 = 2;
    /// Request: the client reads OFFERED's `repeats`. Response: the server sends it.
    pub const OFFER_REPEATS: u32 = 4;
    /// Request: the client reads QUEUE_STATUS's figures after `delayed` (bits 1–7 of their
    /// extensions byte). Response: the server sends them.
    pub const QUEUE_FIGURES: u32 = 8;
    /// Request: the client may give deliveries back unseen (ABORT's flags). Response: the
    /// server takes them so.
    pub const RETURN_UNSEEN: u32 = 16;
}

pub mod opcode {
    pub const HELLO: u16 = 0x0001;
    pub const PING: u16 = 0x0002;
    /// Authenticates the connection with a user name and password.
    pub const AUTH: u16 = 0x0003;
    pub const QUEUE_CREATE: u16 = 0x0100;
    pub const QUEUE_REMOVE: u16 = 0x0101;
    pub const QUEUE_LIST: u16 = 0x0102;
    pub const QUEUE_STATUS: u16 = 0x0103;
    pub const OFFER: u16 = 0x0110;
    pub const POLL: u16 = 0x0111;
    pub const ACK: u16 = 0x0112;
    pub const ABORT: u16 = 0x0113;
    pub const TOPIC_CREATE: u16 = 0x0200;
    pub const TOPIC_REMOVE: u16 = 0x0201;
    pub const TOPIC_LIST: u16 = 0x0202;
    pub const TOPIC_STATUS: u16 = 0x0203;
    pub const PUBLISH: u16 = 0x0210;
    pub const SUBSCRIBE: u16 = 0x0211;
    pub const UNSUBSCRIBE: u16 = 0x0212;
    pub const TOPIC_ACK: u16 = 0x0213;
    pub const SERVE: u16 = 0x0300;
    pub const UNSERVE: u16 = 0x0301;
    pub const CALL: u16 = 0x0310;
    pub const RETURN: u16 = 0x0311;
    /// Push: messages for a subscription (request id = the subscription).
    pub const DELIVER: u16 = 0x0280;
    /// Push: the server ended a subscription (request id = the subscription).
    pub const SUBSCRIPTION_END: u16 = 0x0281;
    /// Push: a call for a function this connection serves (request id = the call).
    pub const INVOKE: u16 = 0x0380;
}

/// How a queue behaves. Zero means "no limit" / "none" throughout. The same type is a queue's
/// definition on disk and in the server's configuration file, which also takes Kestrel's names
/// for these settings (the aliases); a name that is neither is an error, not ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// The queue is full at this many messages.
    pub max_items: u64,
    /// The queue is full at this many bytes of payload and headers.
    #[serde(alias = "max_size")]
    pub max_bytes: u64,
    /// When full, drop the oldest message instead of refusing the new one.
    #[serde(alias = "discard_old_when_full")]
    pub circular: bool,
    /// Kept on disk (a `petrel-log`), surviving restarts.
    #[serde(alias = "keep_journal")]
    pub durable: bool,
    /// Owned by the connection that created it and removed when it closes.
    pub temporary: bool,
    /// Messages expire this long after they are offered (unless they carry their own expiry).
    #[serde(alias = "max_age_ms")]
    pub ttl_ms: u64,
    /// Expired messages move to this queue instead of vanishing.
    #[serde(alias = "expire_to_queue")]
    pub dead_letter: String,
    /// A bigger message is refused with TOO_LARGE (0: the server's limit only).
    #[serde(alias = "max_item_size")]
    pub max_item_bytes: u64,
    /// A durable queue's log durability: `""` (the server's), `"none"`, `"always"` or
    /// `"interval:MS"`.
    pub durability: String,
    /// A message handed out this many times and then returned (aborted, its visibility timeout
    /// passed, its consumer gone) goes to `dead_letter` instead of back to the head (0: no
    /// limit).
    pub max_deliveries: u32,
    /// Priority levels (2–10; 0: none): polls take the highest level that has a message, in
    /// offer order within a level.
    pub priorities: u8,
    /// With `priorities`: the percentage of takes (1–50; 0: 10) that go to the lower levels'
    /// longest-waiting message while they have one, so that no level starves.
    pub priority_share: u8,
    /// Idempotency keys remembered at most (0: 100,000): a message offered with a key the queue
    /// remembers is stored once.
    pub dedup_window: u32,
    /// How long an idempotency key is remembered, ms (0: 120,000).
    pub dedup_window_ms: u64,
    /// A message that comes back (aborted without a delay of its own, its visibility timeout
    /// passed, its consumer gone) is handed out again no earlier than this many ms later (0: at
    /// once).
    pub redelivery_delay_ms: u32,
    /// With `redelivery_delay_ms`: each further return doubles the delay, up to this many ms (0:
    /// the delay does not grow).
    pub redelivery_delay_max_ms: u32,
}

impl QueueConfig {
    /// Kestrel's names for settings (the serde aliases above), each beside the setting it names.
    pub const KESTREL_NAMES: [(&'static str, &'static str); 6] = [
        ("max_size", "max_bytes"),
        ("discard_old_when_full", "circular"),
        ("keep_journal", "durable"),
        ("max_age_ms", "ttl_ms"),
        ("expire_to_queue", "dead_letter"),
        ("max_item_size", "max_item_bytes"),
    ];

    /// The setting a configuration key names: Kestrel's name for it taken to ours. Layers of
    /// configuration (the built-in defaults, `[queue_defaults]`, a queue's block, an HTTP body)
    /// are merged by setting, so that an upper layer overrides a lower one however either spells
    /// it (merged by key, `durable` below and `keep_journal` above are one field given twice).
    pub fn setting_name(key: &str) -> &str {
        Self::KESTREL_NAMES.iter().find(|(kestrel, _)| *kestrel == key).map_or(key, |(_, ours)| ours)
    }
}

/// Items a list's decoding makes room for before it has read any: a count is checked against
/// the bytes left (`Reader::count`), but an item in memory is larger than its least encoding.
const LIST_PREALLOCATED: usize = 1024;

/// `n` items decoded one after another, each pushed where it stays (collecting an iterator of
/// `Result`s grows the vector from nothing and moves every message, a few hundred bytes, twice
/// more: it showed in the server's profile of batched offers).
fn decode_list<T>(n: usize, mut item: impl FnMut() -> Result<T, DecodeError>) -> Result<Vec<T>, DecodeError> {
    let mut items = Vec::with_capacity(n.min(LIST_PREALLOCATED));
    for _ in 0..n {
        items.push(item()?);
    }
    Ok(items)
}

/// ABORT's flags byte: the deliveries go back unseen (`Request::Abort::unseen`).
const ABORT_UNSEEN: u8 = 1;

const FLAG_CIRCULAR: u8 = 1;
const FLAG_DURABLE: u8 = 2;
const FLAG_TEMPORARY: u8 = 4;

/// The extensions byte of a queue configuration: which optional fields follow `durability`, in
/// bit order; a field is present exactly when it is not zero.
const QUEUE_EXT_MAX_DELIVERIES: u8 = 1;
const QUEUE_EXT_PRIORITIES: u8 = 2;
const QUEUE_EXT_PRIORITY_SHARE: u8 = 4;
const QUEUE_EXT_DEDUP_WINDOW: u8 = 8;
const QUEUE_EXT_DEDUP_WINDOW_MS: u8 = 16;
const QUEUE_EXT_REDELIVERY_DELAY_MS: u8 = 32;
const QUEUE_EXT_REDELIVERY_DELAY_MAX_MS: u8 = 64;
const QUEUE_EXT_KNOWN: u8 = QUEUE_EXT_MAX_DELIVERIES
    | QUEUE_EXT_PRIORITIES
    | QUEUE_EXT_PRIORITY_SHARE
    | QUEUE_EXT_DEDUP_WINDOW
    | QUEUE_EXT_DEDUP_WINDOW_MS
    | QUEUE_EXT_REDELIVERY_DELAY_MS
    | QUEUE_EXT_REDELIVERY_DELAY_MAX_MS;

impl QueueConfig {
    fn encode(&self, w: &mut Writer<'_>) -> Result<(), EncodeError> {
        w.u64(self.max_items);
        w.u64(self.max_bytes);
        let mut flags = 0;
        for (on, bit) in
            [(self.circular, FLAG_CIRCULAR), (self.durable, FLAG_DURABLE), (self.temporary, FLAG_TEMPORARY)]
        {
            if on {
                flags |= bit;
            }
        }
        w.u8(flags);
        let mut extensions = 0;
        for (present, bit) in [
            (self.max_deliveries != 0, QUEUE_EXT_MAX_DELIVERIES),
            (self.priorities != 0, QUEUE_EXT_PRIORITIES),
            (self.priority_share != 0, QUEUE_EXT_PRIORITY_SHARE),
            (self.dedup_window != 0, QUEUE_EXT_DEDUP_WINDOW),
            (self.dedup_window_ms != 0, QUEUE_EXT_DEDUP_WINDOW_MS),
            (self.redelivery_delay_ms != 0, QUEUE_EXT_REDELIVERY_DELAY_MS),
            (self.redelivery_delay_max_ms != 0, QUEUE_EXT_REDELIVERY_DELAY_MAX_MS),
        ] {
            if present {
                extensions |= bit;
            }
        }
        w.u8(extensions);
        w.u64(self.ttl_ms);
        w.str(&self.dead_letter)?;
        w.u64(self.max_item_bytes);
        w.str(&self.durability)?;
        if self.max_deliveries != 0 {
            w.u32(self.max_deliveries);
        }
        if self.priorities != 0 {
            w.u8(self.priorities);
        }
        if self.priority_share != 0 {
            w.u8(self.priority_share);
        }
        if self.dedup_window != 0 {
            w.u32(self.dedup_window);
        }
        if self.dedup_window_ms != 0 {
            w.u64(self.dedup_window_ms);
        }
        if self.redelivery_delay_ms != 0 {
            w.u32(self.redelivery_delay_ms);
        }
        if self.redelivery_delay_max_ms != 0 {
            w.u32(self.redelivery_delay_max_ms);
        }
        Ok(())
    }

    fn decode(r: &mut Reader) -> Result<QueueConfig, DecodeError> {
        let max_items = r.u64("max_items")?;
        let max_bytes = r.u64("max_bytes")?;
        let flags = r.u8("queue flags")?;
        if flags & !(FLAG_CIRCULAR | FLAG_DURABLE | FLAG_TEMPORARY) != 0 {
            return Err(DecodeError::BadValue("queue flags"));
        }
        let extensions = r.u8("queue extensions")?;
        if extensions & !QUEUE_EXT_KNOWN != 0 {
            return Err(DecodeError::BadValue("queue extensions"));
        }
        let mut config = QueueConfig {
            max_items,
            max_bytes,
            circular: flags & FLAG_CIRCULAR != 0,
            durable: flags & FLAG_DURABLE != 0,
            temporary: flags & FLAG_TEMPORARY != 0,
            ttl_ms: r.u64("ttl_ms")?,
            dead_letter: r.str("dead_letter")?,
            max_item_bytes: r.u64("max_item_bytes")?,
            durability: r.str("durability")?,
            ..QueueConfig::default()
        };
        if extensions & QUEUE_EXT_MAX_DELIVERIES != 0 {
            config.max_deliveries = present(r.u32("max_deliveries")?, "max_deliveries (present, so not 0)")?;
        }
        if extensions & QUEUE_EXT_PRIORITIES != 0 {
            config.priorities = present(r.u8("priorities")?, "priorities (present, so not 0)")?;
        }
        if extensions & QUEUE_EXT_PRIORITY_SHARE != 0 {
            config.priority_share = present(r.u8("priority_share")?, "priority_share (present, so not 0)")?;
        }
        if extensions & QUEUE_EXT_DEDUP_WINDOW != 0 {
            config.dedup_window = present(r.u32("dedup_window")?, "dedup_window (present, so not 0)")?;
        }
        if extensions & QUEUE_EXT_DEDUP_WINDOW_MS != 0 {
            config.dedup_window_ms = present(r.u64("dedup_window_ms")?, "dedup_window_ms (present, so not 0)")?;
        }
        if extensions & QUEUE_EXT_REDELIVERY_DELAY_MS != 0 {
            config.redelivery_delay_ms =
                present(r.u32("redelivery_delay_ms")?, "redelivery_delay_ms (present, so not 0)")?;
        }
        if extensions & QUEUE_EXT_REDELIVERY_DELAY_MAX_MS != 0 {
            config.redelivery_delay_max_ms =
                present(r.u32("redelivery_delay_max_ms")?, "redelivery_delay_max_ms (present, so not 0)")?;
        }
        Ok(config)
    }
}

/// A queue's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QueueStats {
    /// Messages waiting (not counting those taken tentatively).
    pub items: u64,
    pub bytes: u64,
    /// Taken tentatively, not yet acknowledged.
    pub in_flight: u64,
    pub total_offered: u64,
    pub total_polled: u64,
    pub expired: u64,
    /// Dropped by a circular queue to make room.
    pub dropped: u64,
    /// Pollers waiting for a message right now.
    pub waiters: u64,
    pub config: QueueConfig,
    /// Messages stored but not yet due (delayed offers, delayed redeliveries): not in `items`.
    pub delayed: u64,
    /// The figures below go only to a client that asked for them (`features::QUEUE_FIGURES`).
    /// Tentative reads acknowledged.
    pub acked: u64,
    /// Tentative reads returned (aborted, visibility timeout passed, consumer gone).
    pub aborted: u64,
    /// Moved to the dead-letter queue at `max_deliveries`.
    pub dead_lettered: u64,
    /// Offered messages not stored: their idempotency key was remembered.
    pub deduplicated: u64,
    /// Idempotency keys remembered now.
    pub dedup_keys: u64,
    /// A durable queue's log durability in force (its own, or the server's when its
    /// configuration's is empty); empty for a queue in memory.
    pub durability_in_force: String,
    /// The byte limit in force when the configuration's `max_bytes` is 0 but one applies (a
    /// queue in memory: the server's `memory_queue_max_bytes`); else 0.
    pub max_bytes_in_force: u64,
}

/// The extensions byte after a queue's figures and configuration: which optional figures
/// follow, in bit order, each present exactly when not zero; the byte itself only when one is
/// (so that a queue's figures without any encode as they did before it).
const STATS_EXT_DELAYED: u8 = 1;
const STATS_EXT_ACKED: u8 = 2;
const STATS_EXT_ABORTED: u8 = 4;
const STATS_EXT_DEAD_LETTERED: u8 = 8;
const STATS_EXT_DEDUPLICATED: u8 = 16;
const STATS_EXT_DEDUP_KEYS: u8 = 32;
const STATS_EXT_DURABILITY: u8 = 64;
const STATS_EXT_MAX_BYTES: u8 = 128;

impl QueueStats {
    fn encode(&self, w: &mut Writer<'_>) -> Result<(), EncodeError> {
        for v in [
            self.items,
            self.bytes,
            self.in_flight,
            self.total_offered,
            self.total_polled,
            self.expired,
            self.dropped,
            self.waiters,
        ] {
            w.u64(v);
        }
        self.config.encode(w)?;
        let figures = [
            (STATS_EXT_DELAYED, self.delayed),
            (STATS_EXT_ACKED, self.acked),
            (STATS_EXT_ABORTED, self.aborted),
            (STATS_EXT_DEAD_LETTERED, self.dead_lettered),
            (STATS_EXT_DEDUPLICATED, self.deduplicated),
            (STATS_EXT_DEDUP_KEYS, self.dedup_keys),
        ];
        let mut bits = figures.iter().filter(|(_, v)| *v != 0).fold(0, |bits, (bit, _)| bits | bit);
        if !self.durability_in_force.is_empty() {
            bits |= STATS_EXT_DURABILITY;
        }
        if self.max_bytes_in_force != 0 {
            bits |= STATS_EXT_MAX_BYTES;
        }
        if bits != 0 {
            w.u8(bits);
        }
        for (_, v) in figures.iter().filter(|(_, v)| *v != 0) {
            w.u64(*v);
        }
        if !self.durability_in_force.is_empty() {
            w.str(&self.durability_in_force)?;
        }
        if self.max_bytes_in_force != 0 {
            w.u64(self.max_bytes_in_force);
        }
        Ok(())
    }

    /// These figures without those only a client that asked for them reads
    /// (`features::QUEUE_FIGURES`).
    pub fn without_later_figures(self) -> QueueStats {
        QueueStats {
            acked: 0,
            aborted: 0,
            dead_lettered: 0,
            deduplicated: 0,
            dedup_keys: 0,
            durability_in_force: String::new(),
            max_bytes_in_force: 0,
            ..self
        }
    }

    fn decode(r: &mut Reader) -> Result<QueueStats, DecodeError> {
        QueueStats {
            items: r.u64("items")?,
            bytes: r.u64("bytes")?,
            in_flight: r.u64("in_flight")?,
            total_offered: r.u64("total_offered")?,
            total_polled: r.u64("total_polled")?,
            expired: r.u64("expired")?,
            dropped: r.u64("dropped")?,
            waiters: r.u64("waiters")?,
            config: QueueConfig::decode(r)?,
            ..QueueStats::default()
        }
        .decode_figures(r)
    }

    /// The optional figures after the configuration (`STATS_EXT_*`), if any.
    fn decode_figures(mut self, r: &mut Reader) -> Result<QueueStats, DecodeError> {
        if r.is_empty() {
            return Ok(self);
        }
        let bits = r.u8("queue figures extensions")?;
        if bits == 0 {
            return Err(DecodeError::BadValue("queue figures extensions (present, so not 0)"));
        }
        for (bit, figure, what) in [
            (STATS_EXT_DELAYED, &mut self.delayed, "delayed (present, so not 0)"),
            (STATS_EXT_ACKED, &mut self.acked, "acked (present, so not 0)"),
            (STATS_EXT_ABORTED, &mut self.aborted, "aborted (present, so not 0)"),
            (STATS_EXT_DEAD_LETTERED, &mut self.dead_lettered, "dead_lettered (present, so not 0)"),
            (STATS_EXT_DEDUPLICATED, &mut self.deduplicated, "deduplicated (present, so not 0)"),
            (STATS_EXT_DEDUP_KEYS, &mut self.dedup_keys, "dedup_keys (present, so not 0)"),
        ] {
            if bits & bit != 0 {
                *figure = present(r.u64(what)?, what)?;
            }
        }
        if bits & STATS_EXT_DURABILITY != 0 {
            self.durability_in_force =
                present(r.str("durability_in_force")?, "durability_in_force (present, so not empty)")?;
        }
        if bits & STATS_EXT_MAX_BYTES != 0 {
            self.max_bytes_in_force = present(r.u64("max_bytes_in_force")?, "max_bytes_in_force (present, so not 0)")?;
        }
        Ok(self)
    }
}

/// A topic's figures, and its consumer groups (a durable topic's).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TopicStats {
    pub durable: bool,
    /// Subscriptions without a group, now.
    pub subscribers: u64,
    pub published: u64,
    /// Messages handed to subscribers without a group (one per subscriber per message).
    pub delivered: u64,
    /// Subscribers ended as too slow.
    pub slow_subscribers_ended: u64,
    pub groups: Vec<GroupStats>,
}

/// Where a consumer group of a durable topic stands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct GroupStats {
    pub name: String,
    /// The lowest offset the group has not acknowledged (a message's id is its offset + 1).
    pub committed: u64,
    /// The offset the topic's next message will get.
    pub next_offset: u64,
    /// Messages from `committed` on, delivered or not: not yet acknowledged by the group.
    pub lag: u64,
    /// A subscriber reads through the group now.
    pub open: bool,
}

impl TopicStats {
    fn encode(&self, w: &mut Writer<'_>) -> Result<(), EncodeError> {
        w.u8(u8::from(self.durable));
        for v in [self.subscribers, self.published, self.delivered, self.slow_subscribers_ended] {
            w.u64(v);
        }
        w.u32(self.groups.len() as u32);
        for g in &self.groups {
            w.str(&g.name)?;
            w.u64(g.committed);
            w.u64(g.next_offset);
            w.u64(g.lag);
            w.u8(u8::from(g.open));
        }
        Ok(())
    }

    fn decode(r: &mut Reader) -> Result<TopicStats, DecodeError> {
        let bool = |r: &mut Reader, what| match r.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::BadValue(what)),
        };
        let durable = bool(r, "durable")?;
        let (subscribers, published) = (r.u64("subscribers")?, r.u64("published")?);
        let (delivered, slow_subscribers_ended) = (r.u64("delivered")?, r.u64("slow_subscribers_ended")?);
        // A group takes at least its name's length and 25 bytes.
        let n = r.count(2 + 25, "group count")?;
        let groups = (0..n)
            .map(|_| {
                Ok(GroupStats {
                    name: r.str("group")?,
                    committed: r.u64("committed")?,
                    next_offset: r.u64("next_offset")?,
                    lag: r.u64("lag")?,
                    open: bool(r, "open")?,
                })
            })
            .collect::<Result<_, DecodeError>>()?;
        Ok(TopicStats { durable, subscribers, published, delivered, slow_subscribers_ended, groups })
    }
}

/// A message delivered by `Poll`, with the handle that acknowledges or aborts it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// 0 when the poll took the message for good (no visibility timeout).
    pub handle: u64,
    pub message: Message,
}

/// Where a group subscription starts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "at", content = "value", rename_all = "snake_case")]
pub enum StartFrom {
    /// Where the group stands (a new group: the newest message).
    #[default]
    Resume,
    Oldest,
    Newest,
    /// This offset (a message's id is its offset + 1).
    Offset(u64),
    /// The first message published at or after this time (ns since the Unix epoch).
    Time(u64),
}

impl StartFrom {
    fn encode(&self, w: &mut Writer<'_>) {
        let (kind, value) = match *self {
            StartFrom::Resume => (0, 0),
            StartFrom::Oldest => (1, 0),
            StartFrom::Newest => (2, 0),
            StartFrom::Offset(o) => (3, o),
            StartFrom::Time(t) => (4, t),
        };
        w.u8(kind);
        w.u64(value);
    }

    fn decode(r: &mut Reader) -> Result<StartFrom, DecodeError> {
        let kind = r.u8("from")?;
        let value = r.u64("from value")?;
        Ok(match kind {
            // (Their value is unused, so 0.)
            0..=2 if value != 0 => return Err(DecodeError::BadValue("from value")),
            0 => StartFrom::Resume,
            1 => StartFrom::Oldest,
            2 => StartFrom::Newest,
            3 => StartFrom::Offset(value),
            4 => StartFrom::Time(value),
            _ => return Err(DecodeError::BadValue("from")),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The first request on a connection. `features`: `features::*` bits the client supports.
    Hello {
        client: String,
        features: u32,
    },
    Ping,
    /// Authenticates as `user`. Answered DONE, or UNAUTHORIZED (one answer for a wrong name or a
    /// wrong password).
    Auth {
        user: String,
        password: String,
    },
    QueueCreate {
        name: String,
        config: Box<QueueConfig>,
    },
    QueueRemove {
        name: String,
    },
    QueueList,
    QueueStatus {
        name: String,
    },
    /// Adds messages at the tail, all or none; waits up to `timeout_ms` for room in a full
    /// bounded queue.
    Offer {
        queue: String,
        timeout_ms: u32,
        messages: Vec<Message>,
    },
    /// Takes up to `max` messages from the head, waiting up to `timeout_ms` for the first. With
    /// `visibility_ms` > 0 they are taken tentatively: not acknowledged in time (or by a closed
    /// connection) they go back to the head.
    Poll {
        queue: String,
        max: u32,
        timeout_ms: u32,
        visibility_ms: u32,
    },
    Ack {
        queue: String,
        handles: Vec<u64>,
    },
    /// Returns tentatively taken messages to the head of the queue, or, with `delay_ms`, hands
    /// them out again no earlier than that many ms from now (0: the queue's
    /// `redelivery_delay_ms`).
    Abort {
        queue: String,
        handles: Vec<u64>,
        delay_ms: u32,
        /// The client never saw these deliveries (its poll was cancelled while the answer came):
        /// they go back as if never handed out, their delivery not counted. Only to a server
        /// that granted `features::RETURN_UNSEEN`; never with a `delay_ms`.
        #[serde(default)]
        unseen: bool,
    },
    /// A durable topic keeps a log that consumer groups read and replay.
    TopicCreate {
        name: String,
        durable: bool,
    },
    TopicRemove {
        name: String,
    },
    TopicList,
    TopicStatus {
        name: String,
    },
    /// Delivers the messages to every current subscriber of the topic.
    Publish {
        topic: String,
        messages: Vec<Message>,
    },
    /// Starts pushing the topic's messages (DELIVER frames) to this connection. Without a
    /// `group`, live messages: `buffer` is what the server may hold for this subscriber (0: the
    /// server's default), and one that falls further behind is ended with SUBSCRIPTION_END. With
    /// a `group` (durable topics), the group's messages from `from`, at most `buffer`
    /// unacknowledged at a time; acknowledge with TOPIC_ACK.
    Subscribe {
        topic: String,
        buffer: u32,
        group: String,
        from: StartFrom,
    },
    /// Acknowledges a group subscription's messages by id.
    TopicAck {
        subscription: u64,
        ids: Vec<u64>,
    },
    Unsubscribe {
        subscription: u64,
    },
    /// This connection serves calls of `function` (INVOKE frames, answered with RETURN).
    Serve {
        function: String,
    },
    Unserve {
        function: String,
    },
    /// Calls a function: answered with its reply, or TIMEOUT after `timeout_ms` (0: the server's
    /// default). A oneway call is answered once a server has it, with no reply.
    Call {
        function: String,
        timeout_ms: u32,
        oneway: bool,
        message: Box<Message>,
    },
    /// A function server's answer to the INVOKE `call`: a status (OK, or HANDLER_ERROR with
    /// `error`) and the reply.
    Return {
        call: u64,
        status: Status,
        error: String,
        message: Box<Message>,
    },
}

impl Request {
    pub fn opcode(&self) -> u16 {
        use opcode::*;
        match self {
            Request::Hello { .. } => HELLO,
            Request::Ping => PING,
            Request::Auth { .. } => AUTH,
            Request::QueueCreate { .. } => QUEUE_CREATE,
            Request::QueueRemove { .. } => QUEUE_REMOVE,
            Request::QueueList => QUEUE_LIST,
            Request::QueueStatus { .. } => QUEUE_STATUS,
            Request::Offer { .. } => OFFER,
            Request::Poll { .. } => POLL,
            Request::Ack { .. } => ACK,
            Request::Abort { .. } => ABORT,
            Request::TopicCreate { .. } => TOPIC_CREATE,
            Request::TopicRemove { .. } => TOPIC_REMOVE,
            Request::TopicList => TOPIC_LIST,
            Request::TopicStatus { .. } => TOPIC_STATUS,
            Request::Publish { .. } => PUBLISH,
            Request::Subscribe { .. } => SUBSCRIBE,
            Request::Unsubscribe { .. } => UNSUBSCRIBE,
            Request::TopicAck { .. } => TOPIC_ACK,
            Request::Serve { .. } => SERVE,
            Request::Unserve { .. } => UNSERVE,
            Request::Call { .. } => CALL,
            Request::Return { .. } => RETURN,
        }
    }

    /// Appends this request as a whole frame to `out`.
    pub fn encode(&self, request_id: u64, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.encode_with(request_id, out, false).map(|_| ())
    }

    /// `encode`, except that the payload of a CALL or RETURN of at least `LARGE_PAYLOAD_BYTES`
    /// is left out of `out` and returned: the frame's last bytes, to be written right after
    /// `out`'s (a vectored write), never copied.
    pub fn encode_split(&self, request_id: u64, out: &mut Vec<u8>) -> Result<Option<Bytes>, EncodeError> {
        self.encode_with(request_id, out, matches!(self, Request::Call { .. } | Request::Return { .. }))
    }

    fn encode_with(&self, request_id: u64, out: &mut Vec<u8>, split: bool) -> Result<Option<Bytes>, EncodeError> {
        match self {
            Request::Offer { messages, .. } | Request::Publish { messages, .. } => {
                messages.iter().try_for_each(Message::check)?;
            }
            Request::Call { message, .. } | Request::Return { message, .. } => message.check()?,
            _ => {}
        }
        let at = frame::start(out, FrameKind::Request, self.opcode(), request_id);
        let mut w = if split { Writer::deferring(out) } else { Writer::new(out) };
        let encoded = self.encode_body(&mut w).and_then(|()| w.finish(at));
        if encoded.is_err() {
            out.truncate(at); // no half frame left behind
        }
        encoded
    }

    fn encode_body(&self, w: &mut Writer<'_>) -> Result<(), EncodeError> {
        match self {
            Request::Hello { client, features } => {
                w.str(client)?;
                w.u32(*features);
            }
            Request::Auth { user, password } => {
                w.str(user)?;
                w.str(password)?;
            }
            Request::Ping | Request::QueueList | Request::TopicList => {}
            Request::TopicCreate { name, durable } => {
                w.str(name)?;
                w.u8(u8::from(*durable));
            }
            Request::TopicRemove { name } | Request::TopicStatus { name } => w.str(name)?,
            Request::Publish { topic, messages } => {
                w.str(topic)?;
                w.u32(messages.len() as u32);
                for m in messages {
                    m.encode(w);
                }
            }
            Request::Subscribe { topic, buffer, group, from } => {
                w.str(topic)?;
                w.u32(*buffer);
                w.str(group)?;
                from.encode(w);
            }
            Request::TopicAck { subscription, ids } => {
                w.u64(*subscription);
                w.u32(ids.len() as u32);
                for id in ids {
                    w.u64(*id);
                }
            }
            Request::Unsubscribe { subscription } => w.u64(*subscription),
            Request::Serve { function } | Request::Unserve { function } => w.str(function)?,
            Request::Call { function, timeout_ms, oneway, message } => {
                w.str(function)?;
                w.u32(*timeout_ms);
                w.u8(u8::from(*oneway));
                message.encode(w);
            }
            Request::Return { call, status, error, message } => {
                w.u64(*call);
                w.u8(*status as u8);
                w.text(error);
                message.encode(w);
            }
            Request::QueueCreate { name, config } => {
                w.str(name)?;
                config.encode(w)?;
            }
            Request::QueueRemove { name } | Request::QueueStatus { name } => w.str(name)?,
            Request::Offer { queue, timeout_ms, messages } => {
                w.str(queue)?;
                w.u32(*timeout_ms);
                w.u32(messages.len() as u32);
                for m in messages {
                    m.encode(w);
                }
            }
            Request::Poll { queue, max, timeout_ms, visibility_ms } => {
                w.str(queue)?;
                w.u32(*max);
                w.u32(*timeout_ms);
                w.u32(*visibility_ms);
            }
            Request::Ack { queue, handles } => {
                w.str(queue)?;
                w.u32(handles.len() as u32);
                for h in handles {
                    w.u64(*h);
                }
            }
            Request::Abort { queue, handles, delay_ms, unseen } => {
                w.str(queue)?;
                w.u32(handles.len() as u32);
                for h in handles {
                    w.u64(*h);
                }
                // Optional last fields: delay_ms present when not 0 or when flags follow, flags
                // present when not 0.
                if *delay_ms != 0 || *unseen {
                    w.u32(*delay_ms);
                }
                if *unseen {
                    w.u8(ABORT_UNSEEN);
                }
            }
        }
        Ok(())
    }

    /// The call a RETURN's body answers (its first field), read without decoding the rest: a
    /// RETURN that does not decode is refused to its caller too, not left to its timeout.
    pub fn return_call(body: &[u8]) -> Option<u64> {
        Some(u64::from_be_bytes(body.get(..8)?.try_into().ok()?))
    }

    /// Decodes a request body. An unknown opcode is `DecodeError::UnknownOpcode`.
    pub fn decode(opcode: u16, body: Bytes) -> Result<Request, DecodeError> {
        use opcode::*;
        let mut r = Reader::new(body);
        let request = match opcode {
            HELLO => Request::Hello { client: r.str("client")?, features: r.u32("features")? },
            AUTH => Request::Auth { user: r.str("user")?, password: r.str("password")? },
            PING => Request::Ping,
            QUEUE_CREATE => {
                Request::QueueCreate { name: r.str("name")?, config: Box::new(QueueConfig::decode(&mut r)?) }
            }
            QUEUE_REMOVE => Request::QueueRemove { name: r.str("name")? },
            QUEUE_LIST => Request::QueueList,
            QUEUE_STATUS => Request::QueueStatus { name: r.str("name")? },
            OFFER => {
                let queue = r.str("queue")?;
                let timeout_ms = r.u32("timeout_ms")?;
                let n = r.count(MESSAGE_MIN_LEN, "message count")?;
                let messages = decode_list(n, || Message::decode(&mut r))?;
                Request::Offer { queue, timeout_ms, messages }
            }
            POLL => Request::Poll {
                queue: r.str("queue")?,
                max: r.u32("max")?,
                timeout_ms: r.u32("timeout_ms")?,
                visibility_ms: r.u32("visibility_ms")?,
            },
            ACK | ABORT => {
                let queue = r.str("queue")?;
                let n = r.count(8, "handle count")?;
                let handles = (0..n).map(|_| r.u64("handle")).collect::<Result<_, _>>()?;
                if opcode == ACK {
                    Request::Ack { queue, handles }
                } else {
                    let delay_ms = if r.is_empty() { None } else { Some(r.u32("delay_ms")?) };
                    let flags = match r.is_empty() {
                        true => 0,
                        false => present(r.u8("abort flags")?, "abort flags (present, so not 0)")?,
                    };
                    if flags & !ABORT_UNSEEN != 0 {
                        return Err(DecodeError::BadValue("abort flags"));
                    }
                    let unseen = flags & ABORT_UNSEEN != 0;
                    match (delay_ms, unseen) {
                        (Some(0), false) => return Err(DecodeError::BadValue("delay_ms (present, so not 0)")),
                        (Some(1..), true) => return Err(DecodeError::BadValue("an unseen return takes no delay_ms")),
                        _ => {}
                    }
                    Request::Abort { queue, handles, delay_ms: delay_ms.unwrap_or(0), unseen }
                }
            }
            TOPIC_CREATE => Request::TopicCreate {
                name: r.str("name")?,
                durable: match r.u8("durable")? {
                    0 => false,
                    1 => true,
                    _ => return Err(DecodeError::BadValue("durable")),
                },
            },
            TOPIC_REMOVE => Request::TopicRemove { name: r.str("name")? },
            TOPIC_LIST => Request::TopicList,
            TOPIC_STATUS => Request::TopicStatus { name: r.str("name")? },
            PUBLISH => {
                let topic = r.str("topic")?;
                let n = r.count(MESSAGE_MIN_LEN, "message count")?;
                let messages = decode_list(n, || Message::decode(&mut r))?;
                Request::Publish { topic, messages }
            }
            SUBSCRIBE => Request::Subscribe {
                topic: r.str("topic")?,
                buffer: r.u32("buffer")?,
                group: r.str("group")?,
                from: StartFrom::decode(&mut r)?,
            },
            TOPIC_ACK => {
                let subscription = r.u64("subscription")?;
                let n = r.count(8, "id count")?;
                Request::TopicAck { subscription, ids: (0..n).map(|_| r.u64("id")).collect::<Result<_, _>>()? }
            }
            UNSUBSCRIBE => Request::Unsubscribe { subscription: r.u64("subscription")? },
            SERVE => Request::Serve { function: r.str("function")? },
            UNSERVE => Request::Unserve { function: r.str("function")? },
            CALL => Request::Call {
                function: r.str("function")?,
                timeout_ms: r.u32("timeout_ms")?,
                oneway: match r.u8("oneway")? {
                    0 => false,
                    1 => true,
                    _ => return Err(DecodeError::BadValue("oneway")),
                },
                message: Box::new(Message::decode(&mut r)?),
            },
            RETURN => Request::Return {
                call: r.u64("call")?,
                status: Status::from_u8(r.u8("status")?)?,
                error: r.str("error")?,
                message: Box::new(Message::decode(&mut r)?),
            },
            other => return Err(DecodeError::UnknownOpcode(other)),
        };
        r.finish()?;
        Ok(request)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    /// Any request that did not succeed: a status other than OK and a short reason.
    Error {
        status: Status,
        message: String,
    },
    /// `features`: `features::*` bits in force on this connection.
    Hello {
        server: String,
        max_frame: u32,
        features: u32,
    },
    Pong,
    /// Success with nothing to say (create, remove).
    Done,
    QueueList {
        names: Vec<String>,
    },
    QueueStatus {
        stats: Box<QueueStats>,
    },
    Offered {
        first_id: u64,
        count: u32,
        /// Messages of the offer not stored because they repeat an idempotency key (remembered,
        /// or earlier in the same offer). Sent only to a client that asked for it
        /// (`features::OFFER_REPEATS`), and only when not 0.
        #[serde(default)]
        repeats: u32,
    },
    Polled {
        deliveries: Vec<Delivery>,
    },
    /// How many handles were acknowledged (or aborted) — unknown or expired ones are not counted.
    Acked {
        count: u32,
    },
    TopicList {
        names: Vec<String>,
    },
    TopicStatus {
        stats: Box<TopicStats>,
    },
    /// How many subscribers each message reached.
    Published {
        subscribers: u32,
    },
    Subscribed {
        subscription: u64,
    },
    /// A function's reply.
    Reply {
        message: Box<Message>,
    },
}

/// What the server sends unasked: subscription deliveries and function invocations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Push {
    /// Messages for the subscription in the frame's request id.
    Deliver { messages: Vec<Message> },
    /// The server ended the subscription in the frame's request id (SUBSCRIPTION_END): a slow
    /// subscriber, a removed topic.
    SubscriptionEnd { status: Status, reason: String },
    /// A call of `function` (a function this connection serves); the request id is the call's,
    /// to answer with RETURN.
    Invoke { function: String, message: Box<Message> },
}

impl Push {
    pub fn opcode(&self) -> u16 {
        match self {
            Push::Deliver { .. } => opcode::DELIVER,
            Push::SubscriptionEnd { .. } => opcode::SUBSCRIPTION_END,
            Push::Invoke { .. } => opcode::INVOKE,
        }
    }

    /// Appends this push as a whole frame to `out`; `id` is the subscription or the call. A push
    /// too long for a frame leaves `out` as it was.
    pub fn encode(&self, id: u64, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.encode_with(id, out, false).map(|_| ())
    }

    /// `encode`, except that the payload of an INVOKE of at least `LARGE_PAYLOAD_BYTES` is left
    /// out of `out` and returned: the frame's last bytes, to be written right after `out`'s.
    pub fn encode_split(&self, id: u64, out: &mut Vec<u8>) -> Result<Option<Bytes>, EncodeError> {
        self.encode_with(id, out, matches!(self, Push::Invoke { .. }))
    }

    fn encode_with(&self, id: u64, out: &mut Vec<u8>, split: bool) -> Result<Option<Bytes>, EncodeError> {
        let at = frame::start(out, FrameKind::Push, self.opcode(), id);
        let mut w = if split { Writer::deferring(out) } else { Writer::new(out) };
        match self {
            Push::Deliver { messages } => {
                w.u32(messages.len() as u32);
                for m in messages {
                    m.encode(&mut w);
                }
            }
            Push::SubscriptionEnd { status, reason } => {
                w.u8(*status as u8);
                w.text(reason);
            }
            Push::Invoke { function, message } => {
                w.text(function); // a name the server checked when it was served
                message.encode(&mut w);
            }
        }
        let encoded = w.finish(at);
        if encoded.is_err() {
            out.truncate(at);
        }
        encoded
    }

    /// A DELIVER frame for subscription `id` from messages already encoded (`Message::encode_to`):
    /// the same bytes as `Push::Deliver`, for a server that encodes a message once for all the
    /// subscribers it goes to.
    pub fn encode_deliver<M: AsRef<[u8]>>(id: u64, encoded: &[M], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let at = frame::start(out, FrameKind::Push, opcode::DELIVER, id);
        out.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
        for m in encoded {
            out.extend_from_slice(m.as_ref());
        }
        frame::finish(out, at).inspect_err(|_| out.truncate(at))
    }

    pub fn decode(opcode: u16, body: Bytes) -> Result<Push, DecodeError> {
        let mut r = Reader::new(body);
        let push = match opcode {
            opcode::DELIVER => {
                let n = r.count(MESSAGE_MIN_LEN, "message count")?;
                Push::Deliver { messages: decode_list(n, || Message::decode(&mut r))? }
            }
            opcode::SUBSCRIPTION_END => {
                Push::SubscriptionEnd { status: Status::from_u8(r.u8("status")?)?, reason: r.str("reason")? }
            }
            opcode::INVOKE => {
                Push::Invoke { function: r.str("function")?, message: Box::new(Message::decode(&mut r)?) }
            }
            other => return Err(DecodeError::UnknownOpcode(other)),
        };
        r.finish()?;
        Ok(push)
    }
}

impl Response {
    pub fn error(status: Status, message: impl Into<String>) -> Response {
        Response::Error { status, message: message.into() }
    }

    /// Appends this response to the request `opcode`/`request_id` as a whole frame to `out`. A
    /// response with a field too long for the wire becomes a SERVER_ERROR, never a broken frame.
    pub fn encode(&self, opcode: u16, request_id: u64, out: &mut Vec<u8>) {
        self.encode_with(opcode, request_id, out, false);
    }

    /// `encode`, except that the payload of a REPLY of at least `LARGE_PAYLOAD_BYTES` is left out
    /// of `out` and returned: the frame's last bytes, to be written right after `out`'s.
    pub fn encode_split(&self, opcode: u16, request_id: u64, out: &mut Vec<u8>) -> Option<Bytes> {
        self.encode_with(opcode, request_id, out, matches!(self, Response::Reply { .. }))
    }

    fn encode_with(&self, opcode: u16, request_id: u64, out: &mut Vec<u8>, split: bool) -> Option<Bytes> {
        let at = frame::start(out, FrameKind::Response, opcode, request_id);
        let mut w = if split { Writer::deferring(out) } else { Writer::new(out) };
        let Ok(deferred) = self.encode_body(&mut w).and_then(|()| w.finish(at)) else {
            out.truncate(at);
            let error = Response::error(Status::ServerError, "the answer is too long for the protocol");
            error.encode(opcode, request_id, out);
            return None;
        };
        deferred
    }

    fn encode_body(&self, w: &mut Writer<'_>) -> Result<(), EncodeError> {
        match self {
            Response::Error { status, message } => {
                w.u8(*status as u8);
                w.text(message);
            }
            ok => {
                w.u8(Status::Ok as u8);
                match ok {
                    Response::Error { .. } => unreachable!(),
                    Response::Hello { server, max_frame, features } => {
                        w.text(server);
                        w.u32(*max_frame);
                        w.u32(*features);
                    }
                    Response::Pong | Response::Done => {}
                    Response::QueueList { names } | Response::TopicList { names } => {
                        w.u32(names.len() as u32);
                        for n in names {
                            w.str(n)?;
                        }
                    }
                    Response::Published { subscribers } => w.u32(*subscribers),
                    Response::Subscribed { subscription } => w.u64(*subscription),
                    Response::Reply { message } => message.encode(w),
                    Response::QueueStatus { stats } => stats.encode(w)?,
                    Response::TopicStatus { stats } => stats.encode(w)?,
                    Response::Offered { first_id, count, repeats } => {
                        w.u64(*first_id);
                        w.u32(*count);
                        if *repeats != 0 {
                            w.u32(*repeats);
                        }
                    }
                    Response::Polled { deliveries } => {
                        w.u32(deliveries.len() as u32);
                        for d in deliveries {
                            w.u64(d.handle);
                            d.message.encode(w);
                        }
                    }
                    Response::Acked { count } => w.u32(*count),
                }
            }
        }
        Ok(())
    }

    /// Decodes the response to a request with `opcode`.
    pub fn decode(opcode: u16, body: Bytes) -> Result<Response, DecodeError> {
        use opcode::*;
        let mut r = Reader::new(body);
        let status = Status::from_u8(r.u8("status")?)?;
        let response = if status != Status::Ok {
            Response::Error { status, message: r.str("error message")? }
        } else {
            match opcode {
                HELLO => Response::Hello {
                    server: r.str("server")?,
                    max_frame: r.u32("max_frame")?,
                    features: r.u32("features")?,
                },
                PING => Response::Pong,
                QUEUE_CREATE | QUEUE_REMOVE => Response::Done,
                QUEUE_LIST => {
                    let n = r.count(2, "name count")?;
                    Response::QueueList { names: (0..n).map(|_| r.str("name")).collect::<Result<_, _>>()? }
                }
                QUEUE_STATUS => Response::QueueStatus { stats: Box::new(QueueStats::decode(&mut r)?) },
                OFFER => Response::Offered {
                    first_id: r.u64("first_id")?,
                    count: r.u32("count")?,
                    repeats: match r.is_empty() {
                        true => 0,
                        false => present(r.u32("repeats")?, "repeats (present, so not 0)")?,
                    },
                },
                POLL => {
                    let n = r.count(8 + MESSAGE_MIN_LEN, "delivery count")?;
                    let deliveries = decode_list(n, || {
                        Ok(Delivery { handle: r.u64("handle")?, message: Message::decode(&mut r)? })
                    })?;
                    Response::Polled { deliveries }
                }
                ACK | ABORT | TOPIC_ACK => Response::Acked { count: r.u32("count")? },
                TOPIC_CREATE | TOPIC_REMOVE | UNSUBSCRIBE | SERVE | UNSERVE | RETURN | AUTH => Response::Done,
                TOPIC_LIST => {
                    let n = r.count(2, "name count")?;
                    Response::TopicList { names: (0..n).map(|_| r.str("name")).collect::<Result<_, _>>()? }
                }
                TOPIC_STATUS => Response::TopicStatus { stats: Box::new(TopicStats::decode(&mut r)?) },
                PUBLISH => Response::Published { subscribers: r.u32("subscribers")? },
                SUBSCRIBE => Response::Subscribed { subscription: r.u64("subscription")? },
                // A oneway call is answered with nothing after the status.
                CALL if r.is_empty() => Response::Done,
                CALL => Response::Reply { message: Box::new(Message::decode(&mut r)?) },
                other => return Err(DecodeError::UnknownOpcode(other)),
            }
        };
        r.finish()?;
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::{QueueConfig, Request, opcode};

    #[test]
    fn a_return_s_call_is_read_from_its_first_bytes_as_decode_reads_it() {
        let reply = Request::Return {
            call: 0x0102_0304_0506_0708,
            status: crate::Status::HandlerError,
            error: "no".into(),
            message: Box::default(),
        };
        let mut frame = Vec::new();
        reply.encode(9, &mut frame).unwrap();
        let body = &frame[4 + crate::frame::HEADER_LEN..];
        assert!(matches!(
            Request::decode(opcode::RETURN, Bytes::copy_from_slice(body)).unwrap(),
            Request::Return { call: 0x0102_0304_0506_0708, .. }
        ));
        assert_eq!(Request::return_call(body), Some(0x0102_0304_0506_0708));
        assert_eq!(Request::return_call(&body[..7]), None);
    }

    #[test]
    fn each_kestrel_name_sets_the_setting_it_is_said_to() {
        let value = |key: &str| match key {
            "circular" | "durable" | "discard_old_when_full" | "keep_journal" => serde_json::json!(true),
            "dead_letter" | "expire_to_queue" => serde_json::json!("dead"),
            _ => serde_json::json!(7),
        };
        for (kestrel, ours) in QueueConfig::KESTREL_NAMES {
            let by =
                |key: &str| -> QueueConfig { serde_json::from_value(serde_json::json!({ key: value(key) })).unwrap() };
            assert_eq!(by(kestrel), by(ours), "{kestrel} names {ours}");
            assert_ne!(by(ours), QueueConfig::default(), "{ours} is a setting");
            assert_eq!(QueueConfig::setting_name(kestrel), ours);
        }
        assert_eq!(QueueConfig::setting_name("max_items"), "max_items");
    }

    /// A SUBSCRIBE's start with no use for its value (resume, oldest, newest) has it 0; other
    /// values are refused, as every unused field's are.
    #[test]
    fn a_start_without_a_value_has_it_zero() {
        let subscribe = |kind: u8, value: u64| {
            let mut b = vec![0, 1, b't', 0, 0, 0, 8, 0, 1, b'g', kind];
            b.extend_from_slice(&value.to_be_bytes());
            Request::decode(opcode::SUBSCRIBE, Bytes::from(b))
        };
        assert!(subscribe(1, 0).is_ok());
        assert!(subscribe(3, 7).is_ok());
        for kind in 0..=2 {
            assert!(subscribe(kind, 7).is_err(), "kind {kind}");
        }
    }

    #[test]
    fn an_abort_s_optional_fields_have_one_encoding_each() {
        let body = |tail: &[u8]| {
            let mut b = vec![0, 1, b'q', 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 8];
            b.extend_from_slice(tail);
            Request::decode(opcode::ABORT, Bytes::from(b))
        };
        let abort = |delay_ms, unseen| Request::Abort { queue: "q".into(), handles: vec![8], delay_ms, unseen };
        assert_eq!(body(&[]).unwrap(), abort(0, false));
        assert_eq!(body(&[0, 0, 0, 5]).unwrap(), abort(5, false));
        assert_eq!(body(&[0, 0, 0, 0, 1]).unwrap(), abort(0, true));
        for refused in [&[0, 0, 0, 0][..], &[0, 0, 0, 5, 1], &[0, 0, 0, 0, 0], &[0, 0, 0, 0, 2]] {
            assert!(body(refused).is_err(), "{refused:?}");
        }
        for request in [abort(0, false), abort(5, false), abort(0, true)] {
            let mut out = Vec::new();
            request.encode(1, &mut out).unwrap();
            assert_eq!(Request::decode(opcode::ABORT, Bytes::copy_from_slice(&out[16..])).unwrap(), request);
        }
    }
}
