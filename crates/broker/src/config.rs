//! How a queue behaves: `petrel_proto::QueueConfig`, one type from QUEUE_CREATE to the
//! definitions file and the server's configuration file (which also accepts Kestrel's names for
//! the same settings). This file owns what the broker makes of it: validation, the durability
//! policy it names, and which changes a live queue may take.

use petrel_log::Durability;
pub use petrel_proto::QueueConfig;

/// Most priority levels a queue may have.
pub const MAX_PRIORITIES: u8 = 10;
/// The share of takes that go to lower priority levels when a queue does not say (percent).
pub const DEFAULT_PRIORITY_SHARE: u8 = 10;
const MAX_PRIORITY_SHARE: u8 = 50;
/// Idempotency keys a queue remembers when its configuration does not say.
pub const DEFAULT_DEDUP_WINDOW: u32 = 100_000;
const MAX_DEDUP_WINDOW: u32 = 10_000_000;
/// How long a queue remembers an idempotency key when its configuration does not say, ms.
pub const DEFAULT_DEDUP_WINDOW_MS: u64 = 120_000;
const MAX_DEDUP_WINDOW_MS: u64 = 7 * 24 * 3600 * 1000;
/// The longest idempotency key a queue takes, bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 256;
/// The longest a message may be delayed, ns (a year).
pub const MAX_DELAY_NS: u64 = 365 * 24 * 3600 * 1_000_000_000;

/// `config` checked, with its durability policy spelled the one way `Durability` prints it (so
/// that two spellings of one policy are the same configuration).
pub fn checked(mut config: QueueConfig) -> Result<QueueConfig, String> {
    if let Some(durability) = durability_of(&config)? {
        config.durability = durability.to_string();
    }
    if !config.dead_letter.is_empty() {
        crate::check_name(&config.dead_letter).map_err(|e| format!("dead_letter: {e}"))?;
    }
    if !config.durable && !config.durability.is_empty() {
        // Else it would read as durable and keep nothing across a restart.
        return Err(format!(
            "durability {:?} is for a queue on disk: add durable (a queue in memory keeps nothing across a restart)",
            config.durability
        ));
    }
    if config.max_deliveries != 0 && config.dead_letter.is_empty() {
        // A message at its limit would otherwise be dropped: say where it goes.
        return Err("max_deliveries needs a dead_letter queue for the messages that reach it".into());
    }
    if config.priorities == 1 {
        config.priorities = 0; // one level is no levels: one spelling
    }
    if config.priorities > MAX_PRIORITIES {
        return Err(format!("priorities: at most {MAX_PRIORITIES} levels"));
    }
    if config.priority_share != 0 && config.priorities == 0 {
        return Err("priority_share needs priorities (2 or more levels)".into());
    }
    if config.priority_share > MAX_PRIORITY_SHARE {
        return Err(format!("priority_share: at most {MAX_PRIORITY_SHARE} (percent of takes)"));
    }
    if config.dedup_window > MAX_DEDUP_WINDOW {
        return Err(format!("dedup_window: at most {MAX_DEDUP_WINDOW} keys"));
    }
    if config.dedup_window_ms > MAX_DEDUP_WINDOW_MS {
        return Err(format!("dedup_window_ms: at most {MAX_DEDUP_WINDOW_MS} (7 days)"));
    }
    let (first, cap) = (config.redelivery_delay_ms, config.redelivery_delay_max_ms);
    if cap != 0 && (first == 0 || cap < first) {
        // (Also when there is no first delay: a cap on nothing is a mistake to point out.)
        return Err(
            "redelivery_delay_max_ms caps redelivery_delay_ms as it doubles: set both, the cap the larger".into()
        );
    }
    Ok(config)
}

/// `checked`, for the queue `name`: nor may it be its own dead-letter queue (an expired
/// message would come back to it, expire, and come back, for ever).
pub fn checked_for(name: &str, config: QueueConfig) -> Result<QueueConfig, String> {
    let config = checked(config)?;
    if config.dead_letter == name {
        return Err("dead_letter: a queue cannot be its own dead-letter queue".into());
    }
    Ok(config)
}

/// How `wanted` differs from `existing`, setting by setting: "max_items is 2, not 0, …".
pub fn differences(existing: &QueueConfig, wanted: &QueueConfig) -> String {
    let as_map = |c: &QueueConfig| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => unreachable!("a queue configuration is a JSON object"),
    };
    let (existing, wanted) = (as_map(existing), as_map(wanted));
    let differing: Vec<String> = existing
        .iter()
        .filter(|(key, value)| wanted.get(*key) != Some(*value))
        .map(|(key, value)| format!("{key} is {value}, not {}", wanted.get(key).unwrap_or(&serde_json::Value::Null)))
        .collect();
    differing.join(", ")
}

/// The priority levels of a queue configured so (1: no levels).
pub fn levels_of(config: &QueueConfig) -> usize {
    config.priorities.max(1) as usize
}

/// The percentage of takes that go to the lower priority levels while they have messages (0
/// for a queue without levels).
pub fn priority_share_of(config: &QueueConfig) -> u8 {
    match (config.priorities, config.priority_share) {
        (0 | 1, _) => 0,
        (_, 0) => DEFAULT_PRIORITY_SHARE,
        (_, share) => share,
    }
}

/// One take in this many goes to the lower priority levels while they have messages.
pub fn lower_level_period(config: &QueueConfig) -> u32 {
    100 / u32::from(priority_share_of(config).max(1))
}

/// The keys a queue remembers at most, and for how long (ns).
pub fn dedup_window_of(config: &QueueConfig) -> (usize, u64) {
    let keys = match config.dedup_window {
        0 => DEFAULT_DEDUP_WINDOW,
        n => n,
    };
    let ms = match config.dedup_window_ms {
        0 => DEFAULT_DEDUP_WINDOW_MS,
        ms => ms,
    };
    (keys as usize, ms * 1_000_000)
}

/// When a message offered at `now_ns` is due: the later of its `deliver_at` and `delay_ms`
/// after now (now or before: at once).
pub fn due_at(m: &petrel_proto::Message, now_ns: u64) -> u64 {
    let after_delay = match m.delay_ms {
        0 => 0,
        ms => now_ns.saturating_add(u64::from(ms) * 1_000_000),
    };
    m.deliver_at.max(after_delay)
}

/// How long a message that came back after its `deliveries`-th delivery waits before it is
/// handed out again, ms: `redelivery_delay_ms`, doubled for each delivery after the first up to
/// `redelivery_delay_max_ms` (without one, not doubled).
pub fn redelivery_delay_ms(config: &QueueConfig, deliveries: u32) -> u64 {
    let first = u64::from(config.redelivery_delay_ms);
    match config.redelivery_delay_max_ms {
        0 => first,
        max => {
            let doublings = deliveries.saturating_sub(1).min(63);
            first.saturating_mul(1u64 << doublings).min(u64::from(max))
        }
    }
}

/// The durability policy `config` names for its log (`None`: the server's).
pub fn durability_of(config: &QueueConfig) -> Result<Option<Durability>, String> {
    match config.durability.as_str() {
        "" => Ok(None),
        policy => policy.parse().map(Some).map_err(|e| format!("durability: {e}")),
    }
}

/// The configuration a queue made by first use, configured as `current`, takes from `wanted`
/// (the server's for its name: its block, its parent's, or the defaults): all of it but where
/// and how its messages are kept, which its files depend on (in memory or on disk, temporary,
/// its priority levels, and its durability if it is kept elsewhere than `wanted` says).
pub fn following(current: &QueueConfig, wanted: &QueueConfig) -> QueueConfig {
    let durability =
        if current.durable == wanted.durable { wanted.durability.clone() } else { current.durability.clone() };
    QueueConfig {
        durable: current.durable,
        temporary: current.temporary,
        priorities: current.priorities,
        durability,
        ..wanted.clone()
    }
}

/// Whether a queue configured as `from` may take `to` while it lives: the same kind of queue
/// (where its messages are kept, how durably, in how many priority levels), other limits,
/// expiry, dead letters, priority share or dedup window.
pub fn changes_live(from: &QueueConfig, to: &QueueConfig) -> bool {
    (from.durable, from.temporary, &from.durability, from.priorities)
        == (to.durable, to.temporary, &to.durability, to.priorities)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kestrel_names_and_durability_parse() {
        let c: QueueConfig = serde_json::from_str(
            r#"{"max_size": 10, "max_item_size": 5, "discard_old_when_full": true, "expire_to_queue": "late",
                "durability": "interval:10", "durable": true}"#,
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
        let in_memory = QueueConfig { durable: false, ..c.clone() };
        assert!(checked(in_memory).unwrap_err().contains("add durable"), "a durability for a queue that keeps nothing");
        let own = QueueConfig { dead_letter: "late".into(), ttl_ms: 100, ..QueueConfig::default() };
        assert!(checked_for("late", own.clone()).unwrap_err().contains("its own dead-letter queue"));
        assert!(checked_for("early", own).is_ok());
        assert_eq!(checked(QueueConfig { priorities: 1, ..QueueConfig::default() }).unwrap(), QueueConfig::default());
        for bad in [
            QueueConfig { priorities: 11, ..QueueConfig::default() },
            QueueConfig { priority_share: 10, ..QueueConfig::default() },
            QueueConfig { priorities: 3, priority_share: 51, ..QueueConfig::default() },
            QueueConfig { dedup_window: 10_000_001, ..QueueConfig::default() },
        ] {
            assert!(checked(bad).is_err());
        }
        let levels = QueueConfig { priorities: 3, priority_share: 25, ..QueueConfig::default() };
        assert_eq!((levels_of(&levels), lower_level_period(&levels)), (3, 4));
        assert_eq!(lower_level_period(&QueueConfig { priorities: 3, ..QueueConfig::default() }), 10);
        assert_eq!(dedup_window_of(&QueueConfig::default()), (100_000, 120_000_000_000));
        assert!(!changes_live(&QueueConfig::default(), &levels));
        let backoff = QueueConfig { redelivery_delay_ms: 100, redelivery_delay_max_ms: 1000, ..QueueConfig::default() };
        let delays: Vec<u64> = (1..=6).map(|n| redelivery_delay_ms(&backoff, n)).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(redelivery_delay_ms(&backoff, u32::MAX), 1000, "no overflow");
        let fixed = QueueConfig { redelivery_delay_ms: 100, ..QueueConfig::default() };
        assert_eq!((redelivery_delay_ms(&fixed, 1), redelivery_delay_ms(&fixed, 9)), (100, 100));
        assert_eq!(redelivery_delay_ms(&QueueConfig::default(), 3), 0);
        assert!(checked(QueueConfig { redelivery_delay_max_ms: 10, ..QueueConfig::default() }).is_err());
        assert!(
            checked(QueueConfig { redelivery_delay_ms: 20, redelivery_delay_max_ms: 10, ..QueueConfig::default() })
                .is_err()
        );
        assert!(changes_live(&QueueConfig::default(), &backoff));
    }
}
