//! Server-wide counters, shared by every protocol (per-queue figures live in the broker).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub(crate) struct ServerStats {
    pub started: Instant,
    pub curr_connections: AtomicU64,
    pub total_connections: AtomicU64,
    /// Memcache `get`s that tried to remove an item (peeks excluded).
    pub cmd_get: AtomicU64,
    pub cmd_set: AtomicU64,
    /// Memcache `set`s not stored (refused, or failed), answered or sent with `noreply`.
    pub set_refused: AtomicU64,
    pub cmd_peek: AtomicU64,
    pub get_hits: AtomicU64,
    pub get_misses: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub tls_connections: AtomicU64,
    /// Plaintext connections refused by `require_tls`, TLS handshakes that failed or timed out.
    pub tls_refused: AtomicU64,
    pub auth_successes: AtomicU64,
    pub auth_failures: AtomicU64,
    /// Attempts refused by `auth_attempts_per_minute` without a password check.
    pub auth_rate_limited: AtomicU64,
    /// Connections refused or closed by a limit (`max_connections_per_user`, idle timeout).
    pub connections_refused: AtomicU64,
    pub idle_closed: AtomicU64,
    /// Native requests read, by `NATIVE_COMMANDS` (the last: unknown opcodes).
    pub native_requests: [AtomicU64; NATIVE_COMMANDS.len() + 1],
    /// Memcache commands read, by `MEMCACHE_COMMANDS`.
    pub memcache_requests: [AtomicU64; MEMCACHE_COMMANDS.len()],
}

/// Requests that failed in the server itself (storage errors: a full disk, a failed sync, a
/// definition that could not be written), answered `SERVER_ERROR` and logged (at most a line a
/// second), by `FAILURE_PROTOCOLS`. Process-wide, as the log lines' limit is: counted where a
/// failure is logged, which knows no server (one server per process outside tests).
static REQUEST_FAILURES: [AtomicU64; FAILURE_PROTOCOLS.len()] = [const { AtomicU64::new(0) }; FAILURE_PROTOCOLS.len()];
pub(crate) const FAILURE_PROTOCOLS: [&str; 3] = ["native", "memcache", "http"];

pub(crate) fn count_request_failure(protocol: &str) {
    let i = FAILURE_PROTOCOLS.iter().position(|p| *p == protocol).expect("a protocol that logs failures");
    REQUEST_FAILURES[i].fetch_add(1, Ordering::Relaxed);
}

/// Requests that failed in the server, by `FAILURE_PROTOCOLS`.
pub(crate) fn request_failures() -> [u64; FAILURE_PROTOCOLS.len()] {
    std::array::from_fn(|i| REQUEST_FAILURES[i].load(Ordering::Relaxed))
}

/// The native protocol's request opcodes and their names in `petrel_requests_total`.
pub(crate) const NATIVE_COMMANDS: [(u16, &str); 23] = {
    use petrel_proto::opcode::*;
    [
        (HELLO, "hello"),
        (PING, "ping"),
        (AUTH, "auth"),
        (QUEUE_CREATE, "queue_create"),
        (QUEUE_REMOVE, "queue_remove"),
        (QUEUE_LIST, "queue_list"),
        (QUEUE_STATUS, "queue_status"),
        (OFFER, "offer"),
        (POLL, "poll"),
        (ACK, "ack"),
        (ABORT, "abort"),
        (TOPIC_CREATE, "topic_create"),
        (TOPIC_REMOVE, "topic_remove"),
        (TOPIC_LIST, "topic_list"),
        (TOPIC_STATUS, "topic_status"),
        (PUBLISH, "publish"),
        (SUBSCRIBE, "subscribe"),
        (UNSUBSCRIBE, "unsubscribe"),
        (TOPIC_ACK, "topic_ack"),
        (SERVE, "serve"),
        (UNSERVE, "unserve"),
        (CALL, "call"),
        (RETURN, "return"),
    ]
};

/// The memcache commands counted in `petrel_requests_total` ("other": anything else).
pub(crate) const MEMCACHE_COMMANDS: [&str; 13] = [
    "get",
    "set",
    "delete",
    "flush",
    "flush_all",
    "flush_expired",
    "flush_all_expired",
    "stats",
    "dump_stats",
    "version",
    "shutdown",
    "quit",
    "other",
];

impl ServerStats {
    pub fn new() -> ServerStats {
        ServerStats {
            started: Instant::now(),
            curr_connections: AtomicU64::new(0),
            total_connections: AtomicU64::new(0),
            cmd_get: AtomicU64::new(0),
            cmd_set: AtomicU64::new(0),
            set_refused: AtomicU64::new(0),
            cmd_peek: AtomicU64::new(0),
            get_hits: AtomicU64::new(0),
            get_misses: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            tls_connections: AtomicU64::new(0),
            tls_refused: AtomicU64::new(0),
            auth_successes: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            auth_rate_limited: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            idle_closed: AtomicU64::new(0),
            native_requests: std::array::from_fn(|_| AtomicU64::new(0)),
            memcache_requests: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// Counts a native request by its opcode.
    pub fn native_request(&self, opcode: u16) {
        let i = NATIVE_COMMANDS.iter().position(|(op, _)| *op == opcode).unwrap_or(NATIVE_COMMANDS.len());
        self.native_requests[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a memcache command by its name in `MEMCACHE_COMMANDS`.
    pub fn memcache_request(&self, command: &str) {
        let last = MEMCACHE_COMMANDS.len() - 1;
        let i = MEMCACHE_COMMANDS.iter().position(|c| *c == command).unwrap_or(last);
        self.memcache_requests[i].fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}
