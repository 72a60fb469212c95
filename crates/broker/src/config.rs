//! How a queue behaves: `petrel_proto::QueueConfig`, one type from QUEUE_CREATE to the
//! definitions file and the server's configuration file (which also accepts Kestrel's names for
//! the same settings). This file owns what the broker makes of it: validation, the durability
//! policy it names, and which changes a live queue may take.

use petrel_log::Durability;
pub use petrel_proto::QueueConfig;

/// `config` checked, with its durability policy spelled the one way `Durability` prints it (so
/// that two spellings of one policy are the same configuration).
pub fn checked(mut config: QueueConfig) -> Result<QueueConfig, String> {
    if let Some(durability) = durability_of(&config)? {
        config.durability = durability.to_string();
    }
    if !config.dead_letter.is_empty() {
        crate::check_name(&config.dead_letter).map_err(|e| format!("dead_letter: {e}"))?;
    }
    if config.max_deliveries != 0 && config.dead_letter.is_empty() {
        // A message at its limit would otherwise be dropped: say where it goes.
        return Err("max_deliveries needs a dead_letter queue for the messages that reach it".into());
    }
    Ok(config)
}

/// The durability policy `config` names for its log (`None`: the server's).
pub fn durability_of(config: &QueueConfig) -> Result<Option<Durability>, String> {
    match config.durability.as_str() {
        "" => Ok(None),
        policy => policy.parse().map(Some).map_err(|e| format!("durability: {e}")),
    }
}

/// Whether a queue configured as `from` may take `to` while it lives: the same kind of queue
/// (where its messages are kept and how durably), other limits, expiry or dead letters.
pub fn changes_live(from: &QueueConfig, to: &QueueConfig) -> bool {
    (from.durable, from.temporary, &from.durability) == (to.durable, to.temporary, &to.durability)
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
        let c = checked(c).unwrap();
        assert_eq!(durability_of(&c).unwrap(), Some(Durability::Interval(std::time::Duration::from_millis(10))));
        let spelled_otherwise = QueueConfig { durability: "interval:10.0".into(), ..c.clone() };
        assert_eq!(checked(spelled_otherwise).unwrap(), c, "one policy, one configuration");
        let back: QueueConfig = serde_json::from_slice(&serde_json::to_vec(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(checked(QueueConfig { durability: "sometimes".into(), ..QueueConfig::default() }).is_err());
        assert!(serde_json::from_str::<QueueConfig>(r#"{"max_itms": 1}"#).is_err());
        assert!(checked(QueueConfig { dead_letter: "a/b".into(), ..QueueConfig::default() }).is_err());
    }
}
