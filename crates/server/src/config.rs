//! Server configuration: a TOML file, then flags on top. Every limit has a default that needs
//! neither.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use petrel_broker::QueueConfig;
use petrel_log::Durability;
use serde::{Deserialize, Deserializer};

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where queues and their definitions live.
    pub data: PathBuf,
    /// Native protocol over TCP; port 0 picks a free one.
    pub native_addr: SocketAddr,
    /// Native protocol over a Unix socket too, if set.
    pub unix_socket: Option<PathBuf>,
    /// The memcache (Kestrel) protocol; "off" (or no value) disables it.
    #[serde(deserialize_with = "listener")]
    pub memcache_addr: Option<SocketAddr>,
    /// Whether the memcache `shutdown` command stops the server (off: any client could).
    pub memcache_shutdown: bool,
    /// Largest frame accepted (the length field), bytes.
    pub max_frame_bytes: u32,
    /// Largest message (payload + headers) accepted, bytes.
    pub max_message_bytes: usize,
    /// Requests one connection may have in flight; past it, the server stops reading from it.
    pub max_in_flight_per_connection: usize,
    /// Responses buffered per connection before request handling waits for the client to read.
    pub max_queued_responses: usize,
    pub max_connections: usize,
    /// Durability of durable queues: "none", "always" or "interval:MS".
    pub durability: String,
    pub segment_bytes: u64,
    /// How long in-flight requests may take to finish on shutdown, e.g. "5s".
    pub shutdown_grace: String,
    /// A durable topic's log keeps at most this many bytes…
    pub topic_max_bytes: u64,
    /// …and messages at most this old, e.g. "7d" (older segments go; groups behind skip them).
    pub topic_max_age: String,
    /// Configuration of queues created by first use (memcache `set`/`get`) that no
    /// `[queues.NAME]` block names. Kestrel's defaults: durable, no limits.
    pub queue_defaults: toml::Table,
    /// Queues by name: created at startup with these settings (the defaults fill in the rest;
    /// a fanout child `a+b` with no block of its own takes `a`'s).
    pub queues: BTreeMap<String, toml::Table>,
}

pub const DEFAULT_NATIVE_ADDR: &str = "127.0.0.1:22134";
pub const DEFAULT_MEMCACHE_ADDR: &str = "127.0.0.1:22133";

/// A listener address, or "off".
pub fn parse_listener(text: &str) -> Result<Option<SocketAddr>, String> {
    match text {
        "off" | "" => Ok(None),
        _ => text.parse().map(Some).map_err(|e| format!("{text:?}: {e}")),
    }
}

fn listener<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    parse_listener(&String::deserialize(d)?).map_err(serde::de::Error::custom)
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data: PathBuf::from("petrel-data"),
            native_addr: DEFAULT_NATIVE_ADDR.parse().expect("valid address"),
            unix_socket: None,
            memcache_addr: Some(DEFAULT_MEMCACHE_ADDR.parse().expect("valid address")),
            memcache_shutdown: false,
            max_frame_bytes: petrel_proto::DEFAULT_MAX_FRAME,
            max_message_bytes: 16 << 20,
            max_in_flight_per_connection: 256,
            max_queued_responses: 1024,
            max_connections: 10_000,
            durability: "none".into(),
            segment_bytes: 64 << 20,
            shutdown_grace: "5s".into(),
            topic_max_bytes: 1 << 30,
            topic_max_age: "7d".into(),
            queue_defaults: toml::Table::new(),
            queues: BTreeMap::new(),
        }
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn durability(&self) -> Result<Durability, String> {
        self.durability.parse()
    }

    pub fn topic_max_age(&self) -> Result<std::time::Duration, String> {
        humantime::parse_duration(&self.topic_max_age).map_err(|e| format!("topic_max_age: {e}"))
    }

    pub fn shutdown_grace(&self) -> Result<std::time::Duration, String> {
        humantime::parse_duration(&self.shutdown_grace).map_err(|e| format!("shutdown_grace: {e}"))
    }

    /// The `[queue_defaults]` table over Kestrel's defaults (durable).
    fn defaults_table(&self) -> toml::Table {
        let mut table = toml::Table::new();
        table.insert("durable".into(), toml::Value::Boolean(true));
        table.extend(self.queue_defaults.clone());
        table
    }

    /// The configuration of queues created by first use.
    pub fn queue_defaults(&self) -> Result<QueueConfig, String> {
        toml::Value::Table(self.defaults_table()).try_into().map_err(|e| format!("queue_defaults: {e}"))
    }

    /// Every `[queues.NAME]` block over the defaults.
    pub fn queues(&self) -> Result<BTreeMap<String, QueueConfig>, String> {
        let defaults = self.defaults_table();
        let mut out = BTreeMap::new();
        for (name, block) in &self.queues {
            let mut table = defaults.clone();
            // A child inherits its parent's block, then applies its own.
            if let Some(parent) = petrel_broker::fanout_parent(name).and_then(|p| self.queues.get(p)) {
                table.extend(parent.clone());
            }
            table.extend(block.clone());
            let config: QueueConfig =
                toml::Value::Table(table).try_into().map_err(|e| format!("queues.{name}: {e}"))?;
            out.insert(name.clone(), config);
        }
        Ok(out)
    }

    pub fn validate(&self) -> Result<(), String> {
        self.durability()?;
        self.topic_max_age()?;
        self.queue_defaults()?;
        self.queues()?;
        self.shutdown_grace()?;
        if (self.max_frame_bytes as usize) < 1024 {
            return Err("max_frame_bytes must be at least 1024".into());
        }
        if self.max_message_bytes + 1024 > self.max_frame_bytes as usize {
            return Err("max_message_bytes must leave room for the rest of a frame (max_frame_bytes - 1024)".into());
        }
        if self.max_in_flight_per_connection == 0 || self.max_queued_responses == 0 || self.max_connections == 0 {
            return Err("connection limits must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_sets_what_it_names_and_unknown_keys_are_errors() {
        let dir = std::env::temp_dir().join(format!("petrel-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("petrel.toml");
        std::fs::write(
            &path,
            "data = \"/srv\"\ndurability = \"interval:5\"\nmax_message_bytes = 1048576\nmax_frame_bytes = 2097152\n",
        )
        .unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(c.data, PathBuf::from("/srv"));
        assert_eq!(c.durability().unwrap(), Durability::Interval(std::time::Duration::from_millis(5)));
        assert_eq!(c.native_addr.to_string(), DEFAULT_NATIVE_ADDR);
        c.validate().unwrap();
        std::fs::write(&path, "natve_addr = \"x\"\n").unwrap();
        assert!(Config::load(&path).unwrap_err().contains("natve_addr"));
        let bad = Config { max_message_bytes: 17 << 20, ..Config::default() };
        assert!(bad.validate().is_err(), "a message must fit in a frame");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn queue_blocks_fill_in_from_the_defaults_and_children_from_their_parent() {
        let c: Config = toml::from_str(
            r#"
            memcache_addr = "off"
            [queue_defaults]
            max_items = 100
            durability = "always"
            [queues.jobs]
            max_item_size = 512
            discard_old_when_full = true
            [queues."jobs+audit"]
            durable = false
            "#,
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.memcache_addr, None);
        let defaults = c.queue_defaults().unwrap();
        assert!(defaults.durable, "Kestrel's default: queues are journaled");
        assert_eq!((defaults.max_items, defaults.durability), (100, Some(Durability::Always)));
        let queues = c.queues().unwrap();
        let jobs = &queues["jobs"];
        assert_eq!((jobs.max_items, jobs.max_item_bytes, jobs.circular, jobs.durable), (100, 512, true, true));
        let audit = &queues["jobs+audit"];
        assert_eq!((audit.max_item_bytes, audit.circular, audit.durable), (512, true, false));
        let typo: Config = toml::from_str(
            "[queues.q]
max_itemz = 1
",
        )
        .unwrap();
        assert!(typo.validate().unwrap_err().contains("max_itemz"));
    }
}
