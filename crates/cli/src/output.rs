//! What the commands print that more than one of them prints: counts in words, and messages as
//! JSON. Bytes in JSON are base64 everywhere (`payload_base64`, header values), as in
//! `petrel log dump --json`.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use petrel_client::Message;

/// "1 message", "2 messages".
pub fn count(n: u64, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}

/// A time given as `text` (RFC 3339), in ns since the Unix epoch, as records and messages hold
/// it: refused before 1970 and past 2554.
pub fn unix_ns(text: &str) -> Result<u64, String> {
    let t = humantime::parse_rfc3339_weak(text).map_err(|e| format!("{text:?} is not a time (RFC 3339): {e}"))?;
    let ns = t.duration_since(std::time::UNIX_EPOCH).map_err(|e| format!("{text:?}: {e}"))?.as_nanos();
    u64::try_from(ns).map_err(|_| format!("{text:?}: past the last time a record can hold (2554)"))
}

/// A message as one JSON object: every field; bytes in base64.
pub fn message_json(m: &Message) -> serde_json::Value {
    let headers: serde_json::Map<String, serde_json::Value> =
        m.headers.iter().map(|(n, v)| (n.clone(), B64.encode(v).into())).collect();
    serde_json::json!({
        "id": m.id,
        "kind": format!("{:?}", m.kind).to_lowercase(),
        "timestamp": m.timestamp,
        "expires_at": m.expires_at,
        "deliveries": m.deliveries,
        "priority": m.priority,
        "idempotency_key": m.idempotency_key,
        "deliver_at": m.deliver_at,
        "request_id": m.request_id,
        "subject": m.subject,
        "destination": m.destination,
        "reply_to": m.reply_to,
        "mimetype": m.mimetype,
        "charset": m.charset,
        "durable": m.durable,
        "status": m.status.name(),
        "headers": headers,
        "payload_base64": B64.encode(&m.payload),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_json() {
        assert_eq!(count(1, "message"), "1 message");
        assert_eq!(count(0, "message"), "0 messages");
        let headers = vec![("h".into(), bytes::Bytes::from_static(b"v"))];
        let m = Message { headers, durable: true, ..Message::new(&b"hi"[..]) };
        let j = message_json(&m);
        assert_eq!((j["payload_base64"].as_str(), j["headers"]["h"].as_str()), (Some("aGk="), Some("dg==")));
        assert_eq!((j["durable"].as_bool(), j["status"].as_str()), (Some(true), Some("OK")));
    }
}
