//! How a queue behaves: limits, persistence, expiry. Kept in the definitions file, set by the
//! native protocol's QUEUE_CREATE and by the server's configuration file (which also accepts
//! Kestrel's names for the same settings).

use petrel_log::Durability;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Zero and "" mean "no limit" / "none" throughout.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// The queue is full at this many messages.
    pub max_items: u64,
    /// The queue is full at this many bytes of payload and headers.
    #[serde(alias = "max_size")]
    pub max_bytes: u64,
    /// A bigger message is refused (the server's `max_message_bytes` applies as well).
    #[serde(alias = "max_item_size")]
    pub max_item_bytes: u64,
    /// When full, drop the oldest message to make room instead of refusing.
    #[serde(alias = "discard_old_when_full")]
    pub circular: bool,
    /// Kept in a `petrel-log`, surviving restarts.
    #[serde(alias = "keep_journal")]
    pub durable: bool,
    /// Removed when the connection that created it goes away.
    pub temporary: bool,
    /// Messages expire this long after they are offered, or sooner if they say so.
    #[serde(alias = "max_age_ms")]
    pub ttl_ms: u64,
    /// Expired messages move here instead of vanishing.
    #[serde(alias = "expire_to_queue")]
    pub dead_letter: String,
    /// Durability of a durable queue's log; unset, the server's.
    #[serde(serialize_with = "durability_out", deserialize_with = "durability_in")]
    pub durability: Option<Durability>,
}

impl QueueConfig {
    /// Whether a queue configured as `self` may take `other` while it lives: the same kind of
    /// queue (where its messages are kept and how durably), other limits, expiry or dead letters.
    pub fn changes_live_to(&self, other: &QueueConfig) -> bool {
        (self.durable, self.temporary, self.durability) == (other.durable, other.temporary, other.durability)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.dead_letter.is_empty() {
            return Ok(());
        }
        crate::check_name(&self.dead_letter).map_err(|e| format!("dead_letter: {e}"))
    }
}

fn durability_out<S: Serializer>(d: &Option<Durability>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&d.to_string()),
        None => s.serialize_str(""),
    }
}

fn durability_in<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Durability>, D::Error> {
    let text = String::deserialize(d)?;
    if text.is_empty() { Ok(None) } else { text.parse().map(Some).map_err(serde::de::Error::custom) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kestrel_names_and_durability_parse() {
        let c: QueueConfig = serde_json::from_str(
            r#"{"max_size": 10, "max_item_size": 5, "discard_old_when_full": true, "expire_to_queue": "late",
                "durability": "interval:10"}"#,
        )
        .unwrap();
        assert_eq!((c.max_bytes, c.max_item_bytes, c.circular), (10, 5, true));
        assert_eq!(c.dead_letter, "late");
        assert_eq!(c.durability, Some(Durability::Interval(std::time::Duration::from_millis(10))));
        let back: QueueConfig = serde_json::from_slice(&serde_json::to_vec(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(serde_json::from_str::<QueueConfig>(r#"{"durability": "sometimes"}"#).is_err());
        assert!(serde_json::from_str::<QueueConfig>(r#"{"max_itms": 1}"#).is_err());
        assert!(QueueConfig { dead_letter: "a/b".into(), ..QueueConfig::default() }.validate().is_err());
    }
}
