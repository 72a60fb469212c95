//! Between the wire's types (`petrel-proto`) and the broker's.

use petrel_broker as broker;
use petrel_proto as proto;

pub(crate) fn message_in(m: proto::Message) -> broker::Message {
    broker::Message {
        id: 0,
        kind: m.kind as u8,
        status: m.status as u8,
        timestamp: 0,
        expires_at: m.expires_at,
        request_id: m.request_id,
        subject: m.subject,
        destination: m.destination,
        reply_to: m.reply_to,
        mimetype: m.mimetype,
        charset: m.charset,
        headers: m.headers,
        payload: m.payload,
    }
}

pub(crate) fn message_out(m: broker::Message) -> proto::Message {
    proto::Message {
        id: m.id,
        kind: match m.kind {
            1 => proto::MessageKind::Request,
            2 => proto::MessageKind::Reply,
            3 => proto::MessageKind::Oneway,
            _ => proto::MessageKind::Message,
        },
        status: proto::Status::from_u8(m.status).unwrap_or(proto::Status::Ok),
        durable: false,
        compressed: false,
        timestamp: m.timestamp,
        expires_at: m.expires_at,
        request_id: m.request_id,
        subject: m.subject,
        destination: m.destination,
        reply_to: m.reply_to,
        mimetype: m.mimetype,
        charset: m.charset,
        headers: m.headers,
        payload: m.payload,
    }
}

/// `message_out`, its payload compressed for a connection that negotiated it (`Some(cutoff)`).
pub(crate) fn outgoing(m: broker::Message, compress: Option<usize>) -> proto::Message {
    let mut m = message_out(m);
    if let Some(min_bytes) = compress {
        proto::compression::compress(&mut m, min_bytes);
    }
    m
}

/// A queue configuration from the wire; a durability policy that does not parse is an error.
pub(crate) fn config_in(c: proto::QueueConfig) -> Result<broker::QueueConfig, String> {
    let durability = match c.durability.as_str() {
        "" => None,
        policy => Some(policy.parse()?),
    };
    Ok(broker::QueueConfig {
        max_items: c.max_items,
        max_bytes: c.max_bytes,
        max_item_bytes: c.max_item_bytes,
        circular: c.circular,
        durable: c.durable,
        temporary: c.temporary,
        ttl_ms: c.ttl_ms,
        dead_letter: c.dead_letter,
        durability,
    })
}

pub(crate) fn config_out(c: &broker::QueueConfig) -> proto::QueueConfig {
    proto::QueueConfig {
        max_items: c.max_items,
        max_bytes: c.max_bytes,
        circular: c.circular,
        durable: c.durable,
        temporary: c.temporary,
        ttl_ms: c.ttl_ms,
        dead_letter: c.dead_letter.clone(),
        max_item_bytes: c.max_item_bytes,
        durability: c.durability.map(|d| d.to_string()).unwrap_or_default(),
    }
}

pub(crate) fn stats_out(s: broker::QueueStats, c: &broker::QueueConfig) -> proto::QueueStats {
    proto::QueueStats {
        items: s.items,
        bytes: s.bytes,
        in_flight: s.in_flight,
        total_offered: s.total_offered,
        total_polled: s.total_polled,
        expired: s.expired,
        dropped: s.dropped,
        waiters: s.waiters,
        config: config_out(c),
    }
}

pub(crate) fn topic_stats_out(t: &broker::Topic) -> proto::TopicStats {
    let s = t.stats();
    let groups = t
        .groups()
        .into_iter()
        .map(|g| proto::GroupStats {
            name: g.name,
            committed: g.committed,
            next_offset: g.next_offset,
            lag: g.lag,
            open: g.open,
        })
        .collect();
    proto::TopicStats {
        durable: t.is_durable(),
        subscribers: s.subscribers,
        published: s.published,
        delivered: s.delivered,
        slow_subscribers_ended: s.slow_subscribers_ended,
        groups,
    }
}
