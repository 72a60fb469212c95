//! Server configuration: a TOML file, then flags on top. Every limit has a default that needs
//! neither.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use petrel_broker::QueueConfig;
use petrel_broker::security::{Acl, AclEntry, Kind, Security, Users};
use petrel_log::Durability;
use serde::{Deserialize, Deserializer};

#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where queues and their definitions live.
    pub data: PathBuf,
    /// Native protocol over TCP; port 0 picks a free one.
    #[serde(deserialize_with = "listen_addr")]
    pub native_addr: SocketAddr,
    /// Native protocol over a Unix socket too, if set.
    pub unix_socket: Option<PathBuf>,
    /// The memcache (Kestrel) protocol; "off" (or no value) disables it.
    #[serde(deserialize_with = "listener")]
    pub memcache_addr: Option<SocketAddr>,
    /// Whether the memcache `shutdown` command stops the server (off: any client could).
    pub memcache_shutdown: bool,
    /// HTTP: Prometheus metrics and health checks (docs/http.md); "off" disables it.
    #[serde(deserialize_with = "listener")]
    pub http_addr: Option<SocketAddr>,
    /// `/metrics` answers without authentication even when authentication is on.
    pub http_open_metrics: bool,
    /// With authentication off, names (besides addresses and `localhost`) by which browsers may
    /// reach the admin API and the dashboard (`http::from_this_site`: DNS rebinding).
    pub http_allowed_hosts: Vec<String>,
    /// `/metrics` has series per queue (14 each); off, only server-wide ones (for servers with
    /// very many queues).
    pub metrics_per_queue: bool,
    /// Largest frame accepted (the length field), bytes.
    pub max_frame_bytes: u32,
    /// Largest message accepted, bytes: payload, headers and text fields (`Message::size`).
    pub max_message_bytes: usize,
    /// Payloads of at least this many bytes go out zstd-compressed to clients that asked for it
    /// in HELLO (0: never; compressed payloads from clients are always accepted).
    pub compress_min_bytes: usize,
    /// Requests one connection may have in flight; past it, the server stops reading from it.
    pub max_in_flight_per_connection: usize,
    /// Responses buffered per connection before request handling waits for the client to read.
    pub max_queued_responses: usize,
    /// Bytes of those at most (a client that stops reading holds no more of the server's memory).
    pub max_queued_response_bytes: usize,
    pub max_connections: usize,
    /// TCP connections one client address may hold open at once (0: no limit); past it, and past
    /// `max_connections`, a new connection is answered LIMIT_REACHED (memcache: SERVER_ERROR)
    /// and closed at once.
    pub max_connections_per_address: usize,
    /// Queues of all kinds (durable, in memory, temporary) the server holds at most; creating
    /// one more is refused with LIMIT_REACHED (0: no limit). Queues already on disk always open.
    pub max_queues: usize,
    /// Topics (live and durable) the server holds at most; creating one more is refused with
    /// LIMIT_REACHED (0: no limit). Durable topics already on disk always open.
    pub max_topics: usize,
    /// Bytes all in-memory (and temporary) queues together may hold; past it their offers are
    /// refused with LIMIT_REACHED (memcache: SERVER_ERROR). 0: no limit.
    pub max_memory_bytes: u64,
    /// Bytes an in-memory queue holds at most when its own configuration sets no `max_bytes`
    /// (QUEUE_FULL past it, as any bound). 0: only the budget above.
    pub memory_queue_max_bytes: u64,
    /// Bytes of messages held for one topic subscriber that has not taken them; past it the
    /// subscriber is ended with SLOW_CONSUMER (as past its buffer's message count).
    pub max_subscriber_bytes: u64,
    /// Resident memory of durable queues' and topics' mapped segment pages, all together; past
    /// it the least recently used give their pages back to the page cache (0: no limit).
    pub max_resident_bytes: u64,
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
    /// A connection with no request under way, no subscription and no served function is closed
    /// after this long without a byte from its client, e.g. "10m"; "0" never.
    pub idle_timeout: String,
    /// Users, ACLs, TLS and the limits that go with them (`docs/security.md`).
    pub security: SecurityConfig,
    /// How often the broker looks for expired messages, reads past their visibility timeout
    /// and calls past their deadline, ms: the precision of all three.
    pub tick_ms: u64,
    /// Messages one POLL takes at most, whatever it asks (bytes: at most a frame's worth).
    pub max_poll_messages: usize,
    /// How long a CALL waits for its reply when it names no timeout, ms.
    pub default_call_timeout_ms: u64,
    /// Messages held for a topic subscriber that names no buffer (a group subscriber's
    /// unacknowledged messages too, at most the log's limit of 8192).
    pub default_subscriber_buffer_messages: usize,
    /// The largest buffer a live subscriber may ask for, messages.
    pub max_subscriber_buffer_messages: usize,
    /// Topic subscriptions (live or through a consumer group) one connection may hold; past it
    /// a SUBSCRIBE is answered LIMIT_REACHED.
    pub max_subscriptions_per_connection: usize,
    /// Function names one connection may serve at once; past it a SERVE is answered
    /// LIMIT_REACHED.
    pub max_functions_per_connection: usize,
    /// Batches of TOPIC_ACK a group subscription holds before its task applies them; past it a
    /// TOPIC_ACK is answered LIMIT_REACHED (retry).
    pub max_group_acks_waiting: usize,
    /// How long a SUBSCRIBE waits for its consumer group to be let go by a subscription that is
    /// ending (a client that reconnected at once), ms; then EXISTS.
    pub group_release_wait_ms: u64,
    /// A DELIVER push holds at most this many messages…
    pub max_push_messages: usize,
    /// …and is sent once it holds this many bytes (or one message of more).
    pub max_push_bytes: u64,
    /// One write to a native connection's socket gathers at most this many bytes…
    pub max_write_batch_bytes: usize,
    /// …in at most this many answers and pushes.
    pub max_write_batch_chunks: usize,
    /// While a memcache `get` waits, the requests pipelined behind it are read up to this many
    /// bytes (to notice a client that went away); past it, TCP holds the rest.
    pub memcache_read_ahead_bytes: usize,
}

/// The `[security]` table. Authentication is on when `users_file` is set; TLS when `tls_cert`
/// and `tls_key` are.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// Users and their Argon2id hashes (`petrel user add`).
    pub users_file: Option<PathBuf>,
    /// The server's certificate chain and private key (PEM).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Client certificates that chain to these CAs (PEM) are verified, and name their user by
    /// their subject's common name (mutual TLS). Without it, clients send no certificate.
    pub tls_client_ca: Option<PathBuf>,
    /// Refuse connections that do not start TLS.
    pub require_tls: bool,
    /// Accept a password outside TLS from a loopback address or the Unix socket (never from
    /// elsewhere).
    pub allow_plaintext_auth: bool,
    /// Access of users without an ACL entry for a destination: `offer-poll`, `publish-subscribe`,
    /// `exec` (seed 004's defaults), or any narrower mode, or `deny`.
    pub default_queue: String,
    pub default_topic: String,
    pub default_function: String,
    pub acl: Vec<AclConfig>,
    /// Connections one user may hold at once (0: no limit).
    pub max_connections_per_user: usize,
    /// Queues an ordinary user may have created and not removed: its temporary queues and those
    /// made by first use over memcache (0: no limit). Admins are not counted.
    pub max_queues_per_user: usize,
    /// Authentication attempts (AUTH, a memcache login) one address may make per minute; past it
    /// attempts are refused without checking the password.
    pub auth_attempts_per_minute: u32,
    /// A failed attempt is answered after this long, e.g. "250ms".
    pub auth_failure_delay: String,
    /// How long a client has to finish the TLS handshake and say HELLO, e.g. "10s".
    pub handshake_timeout: String,
}

/// One `[[security.acl]]` entry.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AclConfig {
    /// `queue`, `topic` or `function`.
    pub kind: Kind,
    /// A name, `prefix*`, or `*`.
    pub name: String,
    /// A user name, or `*` for every user.
    pub user: String,
    pub access: String,
}

impl Default for SecurityConfig {
    fn default() -> Self {
        let acl = Acl::default();
        SecurityConfig {
            users_file: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            require_tls: false,
            allow_plaintext_auth: false,
            default_queue: acl.default_queue.to_string(),
            default_topic: acl.default_topic.to_string(),
            default_function: acl.default_function.to_string(),
            acl: Vec::new(),
            max_connections_per_user: 0,
            max_queues_per_user: 1000,
            auth_attempts_per_minute: 60,
            auth_failure_delay: "250ms".into(),
            handshake_timeout: "10s".into(),
        }
    }
}

impl SecurityConfig {
    /// The ACLs as configured.
    pub fn acl(&self) -> Result<Acl, String> {
        let acl = Acl {
            default_queue: self.default_queue.parse().map_err(|e| format!("security.default_queue: {e}"))?,
            default_topic: self.default_topic.parse().map_err(|e| format!("security.default_topic: {e}"))?,
            default_function: self.default_function.parse().map_err(|e| format!("security.default_function: {e}"))?,
            entries: self
                .acl
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    AclEntry::new(e.kind, &e.name, &e.user, &e.access)
                        .map_err(|err| format!("security.acl[{i}]: {err}"))
                })
                .collect::<Result<_, _>>()?,
        };
        acl.check_defaults().map_err(|e| format!("security.{e}"))?;
        Ok(acl)
    }

    /// The users and ACLs, read from their files now; `None` when authentication is off.
    pub fn load(&self) -> Result<Option<Security>, String> {
        let acl = self.acl()?;
        let Some(path) = &self.users_file else {
            if !self.acl.is_empty() {
                return Err("security.acl needs security.users_file: ACLs decide for users".into());
            }
            return Ok(None);
        };
        let users = Users::load(path).map_err(|e| format!("security.users_file: {e}"))?;
        warn_if_others_may_read(path);
        for user in users.iter() {
            if let Some(why) = petrel_broker::security::too_costly(&user.hash) {
                tracing::warn!(user = %user.name, "{why}");
            }
        }
        if users.is_empty() {
            return Err(format!("{}: no users (add one with `petrel user add`)", path.display()));
        }
        Ok(Some(Security { users, acl }))
    }

    pub fn auth_failure_delay(&self) -> Result<std::time::Duration, String> {
        humantime::parse_duration(&self.auth_failure_delay).map_err(|e| format!("security.auth_failure_delay: {e}"))
    }

    pub fn handshake_timeout(&self) -> Result<std::time::Duration, String> {
        let timeout = humantime::parse_duration(&self.handshake_timeout)
            .map_err(|e| format!("security.handshake_timeout: {e}"))?;
        // Zero would close every connection before its HELLO; an hour lets a socket sit idle
        // long enough, and more would overflow the deadline's clock.
        let (least, most) = (std::time::Duration::from_millis(100), std::time::Duration::from_secs(3600));
        if !(least..=most).contains(&timeout) {
            return Err(format!(
                "security.handshake_timeout must be between 100ms and 1h, not {:?}",
                self.handshake_timeout
            ));
        }
        Ok(timeout)
    }

    fn validate(&self) -> Result<(), String> {
        self.acl()?;
        self.auth_failure_delay()?;
        self.handshake_timeout()?;
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err("security.tls_cert and security.tls_key go together".into());
        }
        if self.tls_cert.is_none() && (self.require_tls || self.tls_client_ca.is_some()) {
            return Err("security.require_tls and security.tls_client_ca need tls_cert and tls_key".into());
        }
        if self.auth_attempts_per_minute == 0 {
            return Err("security.auth_attempts_per_minute must be at least 1".into());
        }
        Ok(())
    }
}

pub const DEFAULT_NATIVE_ADDR: &str = "127.0.0.1:22134";
pub const DEFAULT_MEMCACHE_ADDR: &str = "127.0.0.1:22133";
pub const DEFAULT_HTTP_ADDR: &str = "127.0.0.1:22135";

/// A listener address, or "off".
pub fn parse_listener(text: &str) -> Result<Option<SocketAddr>, String> {
    match text {
        "off" | "" => Ok(None),
        _ => listen_address(text).map(Some),
    }
}

/// An address to listen on: `IP:PORT`, or `HOST:PORT` with a name the host resolves (its first
/// address: `localhost:22134` is 127.0.0.1's or ::1's, as the resolver orders them).
pub fn listen_address(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    let wrong = |why: String| format!("{text:?}: {why} (an address like 127.0.0.1:22134 or localhost:22134)");
    std::net::ToSocketAddrs::to_socket_addrs(text)
        .map_err(|e| wrong(e.to_string()))?
        .next()
        .ok_or_else(|| wrong("the name has no address".into()))
}

fn listen_addr<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    listen_address(&String::deserialize(d)?).map_err(serde::de::Error::custom)
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
            http_addr: Some(DEFAULT_HTTP_ADDR.parse().expect("valid address")),
            http_open_metrics: false,
            http_allowed_hosts: Vec::new(),
            metrics_per_queue: true,
            max_frame_bytes: petrel_proto::DEFAULT_MAX_FRAME,
            max_message_bytes: 16 << 20,
            compress_min_bytes: 4096,
            max_in_flight_per_connection: 256,
            max_queued_responses: 1024,
            max_queued_response_bytes: 4 << 20,
            max_connections: 10_000,
            max_connections_per_address: 1_000,
            max_queues: 10_000,
            max_topics: 10_000,
            max_memory_bytes: 1 << 30,
            memory_queue_max_bytes: 256 << 20,
            max_subscriber_bytes: 64 << 20,
            max_resident_bytes: 1 << 30,
            durability: "none".into(),
            segment_bytes: 64 << 20,
            shutdown_grace: "5s".into(),
            topic_max_bytes: 1 << 30,
            topic_max_age: "7d".into(),
            queue_defaults: toml::Table::new(),
            queues: BTreeMap::new(),
            idle_timeout: "10m".into(),
            security: SecurityConfig::default(),
            tick_ms: 20,
            max_poll_messages: 10_000,
            default_call_timeout_ms: 30_000,
            default_subscriber_buffer_messages: 1024,
            max_subscriber_buffer_messages: 1 << 20,
            max_subscriptions_per_connection: 1024,
            max_functions_per_connection: 1024,
            max_group_acks_waiting: 1024,
            group_release_wait_ms: 200,
            max_push_messages: 256,
            max_push_bytes: 64 << 10,
            max_write_batch_bytes: 256 << 10,
            max_write_batch_chunks: 64,
            memcache_read_ahead_bytes: crate::input::STREAMING_BYTES,
        }
    }
}

impl Config {
    /// The configuration in the file at `path`. The files `[security]` names (users, TLS
    /// certificates and keys) are found from the configuration file's directory when relative,
    /// whatever directory the server starts in.
    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Config::from_file_text(path, &text)
    }

    /// The configuration `text`, read from the file at `path` (`load`; a reload reads the text
    /// once for this and for the table it compares).
    pub fn from_file_text(path: &Path, text: &str) -> Result<Config, String> {
        // (toml's messages end with a newline: trimmed, for the log's line and the API's field.)
        let mut config: Config =
            toml::from_str(text).map_err(|e| format!("{}: {}", path.display(), e.to_string().trim_end()))?;
        let dir = path.parent().unwrap_or(Path::new(""));
        let security = &mut config.security;
        for file in
            [&mut security.users_file, &mut security.tls_cert, &mut security.tls_key, &mut security.tls_client_ca]
        {
            if let Some(file) = file.as_mut().filter(|f| f.is_relative()) {
                *file = dir.join(&*file);
            }
        }
        Ok(config)
    }

    pub fn durability(&self) -> Result<Durability, String> {
        self.durability.parse()
    }

    pub fn topic_max_age(&self) -> Result<std::time::Duration, String> {
        duration("topic_max_age", &self.topic_max_age)
    }

    /// `None`: connections are never closed for idleness.
    pub fn idle_timeout(&self) -> Result<Option<std::time::Duration>, String> {
        if self.idle_timeout.trim() == "0" {
            return Ok(None);
        }
        // Kept in whole ms (where 0 means never): at least one.
        let timeout = duration("idle_timeout", &self.idle_timeout)?;
        within("idle_timeout", timeout, std::time::Duration::from_millis(1), LONGEST_IDLE).map(Some)
    }

    pub fn shutdown_grace(&self) -> Result<std::time::Duration, String> {
        // A stop waits this long for clients that do not read: at most a day.
        let grace = duration("shutdown_grace", &self.shutdown_grace)?;
        within("shutdown_grace", grace, std::time::Duration::ZERO, std::time::Duration::from_secs(24 * 3600))
    }

    /// The `[queue_defaults]` table over Kestrel's defaults (durable).
    fn defaults_table(&self) -> Result<toml::Table, String> {
        let mut table = toml::Table::new();
        table.insert("durable".into(), toml::Value::Boolean(true));
        layer(&mut table, &self.queue_defaults).map_err(|e| format!("queue_defaults: {e}"))?;
        Ok(table)
    }

    /// The configuration of queues created by first use.
    pub fn queue_defaults(&self) -> Result<QueueConfig, String> {
        toml::Value::Table(self.defaults_table()?).try_into().map_err(|e| format!("queue_defaults: {e}"))
    }

    /// Every `[queues.NAME]` block over the defaults.
    pub fn queues(&self) -> Result<BTreeMap<String, QueueConfig>, String> {
        let defaults = self.defaults_table()?;
        let mut out = BTreeMap::new();
        for (name, block) in &self.queues {
            let mut table = defaults.clone();
            // A child inherits its parent's block, then applies its own.
            if let Some(parent) = petrel_broker::fanout_parent(name).and_then(|p| self.queues.get(p)) {
                layer(&mut table, parent).map_err(|e| format!("queues.{name}: {e}"))?;
            }
            layer(&mut table, block).map_err(|e| format!("queues.{name}: {e}"))?;
            let config: QueueConfig =
                toml::Value::Table(table).try_into().map_err(|e| format!("queues.{name}: {e}"))?;
            out.insert(name.clone(), config);
        }
        Ok(out)
    }

    pub fn validate(&self) -> Result<(), String> {
        self.durability()?;
        self.topic_max_age()?;
        // A queue of the file belongs to no connection: a temporary one could never be made.
        if self.queue_defaults()?.temporary {
            return Err("queue_defaults: temporary is for a connection's own queues, made by QUEUE_CREATE".into());
        }
        if let Some(name) = self.queues()?.iter().find(|(_, q)| q.temporary).map(|(name, _)| name) {
            return Err(format!("queues.{name}: temporary is for a connection's own queues, made by QUEUE_CREATE"));
        }
        let log = petrel_log::Options { segment_bytes: self.segment_bytes, ..petrel_log::Options::default() };
        log.validate().map_err(|e| e.to_string())?;
        // A durable queue's record holds a message and up to 64 KiB of its fields.
        let most = petrel_log::MAX_MAX_RECORD_BYTES - 64 * 1024;
        if !(1..=most).contains(&self.max_message_bytes) {
            return Err(format!("max_message_bytes must be between 1 and {most}"));
        }
        self.shutdown_grace()?;
        self.idle_timeout()?;
        self.security.validate()?;
        if (self.max_frame_bytes as usize) < 1024 {
            return Err("max_frame_bytes must be at least 1024".into());
        }
        if self.max_message_bytes + 1024 > self.max_frame_bytes as usize {
            return Err("max_message_bytes must leave room for the rest of a frame (max_frame_bytes - 1024)".into());
        }
        if self.max_in_flight_per_connection == 0
            || self.max_queued_responses == 0
            || self.max_connections == 0
            || !(1..=u32::MAX as usize).contains(&self.max_queued_response_bytes)
        {
            return Err("connection limits must be at least 1".into());
        }
        // Counts that size a semaphore or a channel each (tokio takes at most 2^61 permits):
        // bounded far above any use, so that a mistyped one is refused, not a panic later.
        for (name, value) in [
            ("max_in_flight_per_connection", self.max_in_flight_per_connection),
            ("max_queued_responses", self.max_queued_responses),
            ("max_group_acks_waiting", self.max_group_acks_waiting),
            ("default_subscriber_buffer_messages", self.default_subscriber_buffer_messages),
            ("max_subscriber_buffer_messages", self.max_subscriber_buffer_messages),
        ] {
            if value > MAX_COUNT {
                return Err(format!("{name} must be at most {MAX_COUNT}"));
            }
        }
        for (name, value) in [
            ("tick_ms", self.tick_ms as usize),
            ("max_poll_messages", self.max_poll_messages),
            ("default_call_timeout_ms", self.default_call_timeout_ms as usize),
            ("default_subscriber_buffer_messages", self.default_subscriber_buffer_messages),
            ("max_subscriber_buffer_messages", self.max_subscriber_buffer_messages),
            ("max_subscriptions_per_connection", self.max_subscriptions_per_connection),
            ("max_functions_per_connection", self.max_functions_per_connection),
            ("max_group_acks_waiting", self.max_group_acks_waiting),
            ("max_push_messages", self.max_push_messages),
            ("max_push_bytes", self.max_push_bytes as usize),
            ("max_write_batch_bytes", self.max_write_batch_bytes),
            ("max_write_batch_chunks", self.max_write_batch_chunks),
        ] {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if !(1..=crate::input::STREAMING_BYTES).contains(&self.memcache_read_ahead_bytes) {
            // More would sit in memory outside `max_memory_bytes`, for every waiting get.
            return Err(format!("memcache_read_ahead_bytes must be between 1 and {}", crate::input::STREAMING_BYTES));
        }
        if (1..4096).contains(&self.max_subscriber_bytes) {
            // Each waiting message counts its bytes and a few hundred more for holding it: less
            // would end a subscriber at its first message.
            return Err("max_subscriber_bytes must be 0 (none) or at least 4096".into());
        }
        if self.tick_ms > 10_000 {
            return Err("tick_ms must be at most 10000 (expiry and timeouts fire no finer than it)".into());
        }
        if self.default_subscriber_buffer_messages > self.max_subscriber_buffer_messages {
            return Err("default_subscriber_buffer_messages must not exceed max_subscriber_buffer_messages".into());
        }
        if self.default_call_timeout_ms > u64::from(u32::MAX) {
            return Err("default_call_timeout_ms must fit a CALL's timeout field (u32 ms)".into());
        }
        Ok(())
    }
}

/// The most a count that sizes a semaphore or a channel may be (`Config::validate`).
const MAX_COUNT: usize = 1 << 30;

/// The longest `idle_timeout`: a thousand years ("100y" is a way to say never), well within the
/// u64 of ms it is kept as.
const LONGEST_IDLE: std::time::Duration = std::time::Duration::from_secs(1000 * 366 * 24 * 3600);

/// `value` if it is from `least` to `most`, else why not.
fn within(
    key: &str,
    value: std::time::Duration,
    least: std::time::Duration,
    most: std::time::Duration,
) -> Result<std::time::Duration, String> {
    match (least..=most).contains(&value) {
        true => Ok(value),
        false => Err(format!("{key} must be from {least:?} to {most:?}, not {value:?}")),
    }
}

/// The duration a configuration key `key` gives as `text` ("30s", "5m", "1h 30m", "7d").
fn duration(key: &str, text: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("{key}: {text:?} is not a duration like \"500ms\", \"30s\", \"5m\" or \"7d\" ({e})"))
}

/// Sets each of `upper`'s queue settings in `table`, replacing what `table` had for that setting
/// under either of its names (`QueueConfig::setting_name`). A setting given twice in `upper` (by
/// both names) is an error, as serde says of one given twice under one name. An `upper` that makes
/// the queue one in memory (`durable = false`) without a `durability` of its own drops the one
/// from below, which only a queue on disk takes.
pub(crate) fn layer(table: &mut toml::Table, upper: &toml::Table) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for (key, value) in upper {
        let setting = QueueConfig::setting_name(key);
        if !seen.insert(setting) {
            return Err(format!("{setting} is set twice (once as {key})"));
        }
        table.retain(|k, _| QueueConfig::setting_name(k) != setting);
        table.insert(setting.to_string(), value.clone());
    }
    if upper.iter().any(|(k, v)| QueueConfig::setting_name(k) == "durable" && v.as_bool() == Some(false))
        && !seen.contains("durability")
    {
        table.remove("durability");
    }
    Ok(())
}

/// A queue's configuration: `upper` (a JSON object: an HTTP request's body) over `lower`, as
/// `layer` puts a block over the defaults. `upper` alone must be a valid configuration (no key
/// unknown, none given twice).
pub(crate) fn queue_over(lower: &QueueConfig, upper: &[u8]) -> Result<QueueConfig, String> {
    let upper: toml::Table = match upper.iter().all(u8::is_ascii_whitespace) {
        true => toml::Table::new(),
        false => {
            serde_json::from_slice::<QueueConfig>(upper).map_err(|e| e.to_string())?;
            serde_json::from_slice(upper).map_err(|e| e.to_string())?
        }
    };
    let mut table = toml::Table::try_from(lower).map_err(|e| e.to_string())?;
    layer(&mut table, &upper)?;
    toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| e.to_string())
}

/// Warns (at start and at each reload) when others than the file's owner may read or write the
/// users file: its hashes are open to offline guessing, its users to whoever may edit it
/// (`petrel user` writes it `0600`).
fn warn_if_others_may_read(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            path = %path.display(),
            mode = format!("{:o}", meta.permissions().mode() & 0o777),
            "the users file may be read or written by others than its owner: chmod 600 it"
        );
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
        // The files [security] names: from the configuration file's directory when relative.
        let text = "[security]\nusers_file = \"users.toml\"\ntls_cert = \"/etc/petrel/cert.pem\"\n";
        std::fs::write(&path, text).unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(c.security.users_file, Some(dir.join("users.toml")));
        assert_eq!(c.security.tls_cert, Some(PathBuf::from("/etc/petrel/cert.pem")));
        let bad = Config { max_message_bytes: 17 << 20, ..Config::default() };
        assert!(bad.validate().is_err(), "a message must fit in a frame");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn limits_with_units_are_checked_at_startup() {
        Config::default().validate().unwrap();
        let error = |config: &str| toml::from_str::<Config>(config).unwrap().validate().unwrap_err();
        assert!(error("tick_ms = 0").contains("tick_ms must be at least 1"));
        assert!(error("tick_ms = 10001").contains("tick_ms must be at most 10000"));
        assert!(error("max_poll_messages = 0").contains("max_poll_messages"));
        assert!(error("max_push_bytes = 0").contains("max_push_bytes"));
        assert!(error("max_subscriber_bytes = 100").contains("max_subscriber_bytes must be 0 (none) or at least 4096"));
        let over = "default_subscriber_buffer_messages = 10\nmax_subscriber_buffer_messages = 5";
        assert!(error(over).contains("must not exceed max_subscriber_buffer_messages"));
        assert!(error("default_call_timeout_ms = 4294967296").contains("u32 ms"));
        for timeout in ["0", "10ms", "300000000000y"] {
            let e = error(&format!("[security]\nhandshake_timeout = \"{timeout}\""));
            assert!(e.contains("handshake_timeout must be between"), "{e}");
        }
        // Values a typo makes absurd are refused here, not a panic or a wrong meaning later: a
        // count past what a semaphore or channel takes, an idle timeout that rounds to 0 ms
        // ("never"), a grace whose deadline overflows the clock.
        for bad in [
            "max_in_flight_per_connection = 9007199254740993",
            "max_queued_responses = 9007199254740993",
            "max_group_acks_waiting = 9007199254740993",
            "idle_timeout = \"500us\"",
            "idle_timeout = \"2000y\"",
            "shutdown_grace = \"300000000000y\"",
        ] {
            let e = error(bad);
            assert!(e.contains("must be at most") || e.contains("must be from"), "{bad}: {e}");
        }
        let c: Config = toml::from_str("tick_ms = 5\nmax_poll_messages = 100").unwrap();
        c.validate().unwrap();
        assert_eq!((c.tick_ms, c.max_poll_messages), (5, 100));
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
        assert_eq!((defaults.max_items, defaults.durability), (100, "always".to_string()));
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

    #[test]
    fn kestrel_names_override_the_defaults_under_either_name() {
        // Kestrel's names for settings that a layer below spells the other way (the built-in
        // `durable`, a `[queue_defaults]` `max_bytes`): the upper layer wins, no "duplicate field".
        let c: Config = toml::from_str(
            r#"
            [queue_defaults]
            keep_journal = false
            max_bytes = 1000
            [queues.jobs]
            max_size = 10
            [queues.kept]
            keep_journal = true
            "#,
        )
        .unwrap();
        c.validate().unwrap();
        assert!(!c.queue_defaults().unwrap().durable);
        let queues = c.queues().unwrap();
        assert_eq!((queues["jobs"].max_bytes, queues["jobs"].durable), (10, false));
        assert_eq!((queues["kept"].max_bytes, queues["kept"].durable), (1000, true));
        for (text, says) in [
            ("[queue_defaults]\ntemporary = true\n", "queue_defaults: temporary"),
            ("[queues.t]\ntemporary = true\n", "queues.t: temporary"),
            ("segment_bytes = 1000\n", "segment_bytes must be a multiple of 4096"),
            ("max_message_bytes = 0\n", "max_message_bytes must be between 1 and 536805312"),
            ("max_message_bytes = 536805313\n", "max_message_bytes must be between 1 and 536805312"),
            ("idle_timeout = \"abc\"\n", "idle_timeout: \"abc\" is not a duration like"),
        ] {
            let c: Config = toml::from_str(text).unwrap();
            let err = c.validate().unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
        let twice: Config = toml::from_str("[queues.q]\nmax_size = 1\nmax_bytes = 2\n").unwrap();
        assert!(twice.validate().unwrap_err().contains("max_bytes is set twice"));
        // A block that makes its queue one in memory drops the defaults' durability (only a
        // queue on disk takes one); given in the block too, it stays (and is refused later).
        let c: Config = toml::from_str(
            "[queue_defaults]\ndurability = \"always\"\n[queues.fast]\nkeep_journal = false\n[queues.kept]\nmax_items = 1\n",
        )
        .unwrap();
        let queues = c.queues().unwrap();
        assert_eq!((queues["fast"].durable, queues["fast"].durability.as_str()), (false, ""));
        assert_eq!((queues["kept"].durable, queues["kept"].durability.as_str()), (true, "always"));
    }

    #[test]
    fn listeners_take_host_names() {
        let c: Config = toml::from_str("native_addr = \"localhost:0\"\nmemcache_addr = \"localhost:7\"\n").unwrap();
        assert!(c.native_addr.ip().is_loopback() && c.native_addr.port() == 0);
        assert_eq!(c.memcache_addr.map(|a| a.port()), Some(7));
        let err = listen_address("nowhere.invalid:1").unwrap_err();
        assert!(err.contains("an address like 127.0.0.1:22134"), "{err}");
        assert!(listen_address("localhost").is_err(), "a port is needed");
    }

    #[test]
    fn an_http_body_goes_over_the_defaults_as_a_block_does() {
        let defaults =
            QueueConfig { durable: true, durability: "always".into(), max_items: 5, ..QueueConfig::default() };
        let over = |body: &str| queue_over(&defaults, body.as_bytes());
        assert_eq!(over("").unwrap(), defaults);
        assert_eq!(over(" {} ").unwrap(), defaults);
        let memory = over(r#"{"keep_journal": false}"#).unwrap();
        assert_eq!((memory.durable, memory.durability.as_str(), memory.max_items), (false, "", 5));
        assert_eq!(over(r#"{"max_size": 9}"#).unwrap().max_bytes, 9);
        for (bad, says) in [
            (r#"{"max_bytes": 1, "max_bytes": 2}"#, "duplicate field"),
            (r#"{"max_size": 1, "max_bytes": 2}"#, "duplicate field"),
            (r#"{"max_itemz": 1}"#, "max_itemz"),
            ("[1]", "invalid type"),
        ] {
            let err = over(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
