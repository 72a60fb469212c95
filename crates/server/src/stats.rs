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
}

impl ServerStats {
    pub fn new() -> ServerStats {
        ServerStats {
            started: Instant::now(),
            curr_connections: AtomicU64::new(0),
            total_connections: AtomicU64::new(0),
            cmd_get: AtomicU64::new(0),
            cmd_set: AtomicU64::new(0),
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
        }
    }

    /// Counts a connection while the guard lives.
    pub fn connection(&self) -> Connection<'_> {
        self.curr_connections.fetch_add(1, Ordering::Relaxed);
        self.total_connections.fetch_add(1, Ordering::Relaxed);
        Connection(self)
    }
}

pub(crate) struct Connection<'a>(&'a ServerStats);

impl Drop for Connection<'_> {
    fn drop(&mut self) {
        self.0.curr_connections.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}
