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

pub(crate) fn config_in(c: proto::QueueConfig) -> broker::QueueConfig {
    broker::QueueConfig {
        max_items: c.max_items,
        max_bytes: c.max_bytes,
        circular: c.circular,
        durable: c.durable,
        temporary: c.temporary,
        ttl_ms: c.ttl_ms,
        dead_letter: c.dead_letter,
        ..broker::QueueConfig::default()
    }
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
