//! Who is connected: one entry per open connection of either protocol, with what it has done so
//! far (`/api/v1/connections`, the dashboard), and the server's count of connections.
//!
//! Each connection counts into its own entry (uncontended atomics); the registry's lock is
//! taken only when a connection opens or closes and when someone lists them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use petrel_broker::ConnId;

use crate::Ctx;
use crate::auth::Peer;

/// One open connection.
pub(crate) struct Connection {
    pub id: ConnId,
    /// `ip:port`, or `unix` for the Unix socket.
    pub peer: String,
    pub protocol: &'static str,
    pub tls: bool,
    pub opened: Instant,
    /// The authenticated user, once there is one.
    user: Mutex<Option<String>>,
    /// Requests read (frames, or memcache commands).
    pub requests: AtomicU64,
    pub received_bytes: AtomicU64,
    pub sent_bytes: AtomicU64,
    /// Moved on by a reload that changed its user's rights (or removed the user). Each request
    /// is decided by the rules in force, but what a connection holds (its subscriptions, the
    /// functions it serves) was granted by the old ones: the connection looks again, and ends if
    /// its user is gone or it holds any (its client logs in again under the new rules).
    rights: tokio::sync::watch::Sender<u64>,
}

impl Connection {
    /// Tells the connection that its user's rights changed (`rights`).
    pub fn rights_changed(&self) {
        self.rights.send_modify(|generation| *generation += 1);
    }

    /// What `rights_changed` moves on.
    pub fn rights(&self) -> tokio::sync::watch::Receiver<u64> {
        self.rights.subscribe()
    }

    pub fn set_user(&self, user: &str) {
        *self.user.lock().unwrap_or_else(|e| e.into_inner()) = Some(user.to_owned());
    }

    pub fn user(&self) -> Option<String> {
        self.user.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn received(&self, n: usize) {
        self.received_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn sent(&self, n: usize) {
        self.sent_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Default)]
pub(crate) struct Registry {
    open: Mutex<HashMap<ConnId, Arc<Connection>>>,
}

impl Registry {
    /// Registers a connection (and counts it in the server's figures) while the guard lives.
    pub fn open(ctx: &Arc<Ctx>, id: ConnId, peer: &Peer, protocol: &'static str) -> Registered {
        let entry = Arc::new(Connection {
            id,
            peer: peer.addr.map_or_else(|| "unix".to_owned(), |a| a.to_string()),
            protocol,
            tls: peer.tls,
            opened: Instant::now(),
            user: Mutex::new(None),
            requests: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
            sent_bytes: AtomicU64::new(0),
            rights: tokio::sync::watch::Sender::new(0),
        });
        ctx.stats.curr_connections.fetch_add(1, Ordering::Relaxed);
        ctx.stats.total_connections.fetch_add(1, Ordering::Relaxed);
        ctx.connections.lock().insert(id, Arc::clone(&entry));
        Registered { ctx: Arc::clone(ctx), entry }
    }

    /// The open connection `id`, if it is open.
    pub fn get(&self, id: ConnId) -> Option<Arc<Connection>> {
        self.lock().get(&id).cloned()
    }

    /// Every open connection, oldest first.
    pub fn list(&self) -> Vec<Arc<Connection>> {
        let mut all: Vec<Arc<Connection>> = self.lock().values().cloned().collect();
        all.sort_by_key(|c| c.id);
        all
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ConnId, Arc<Connection>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A connection's place in the registry; leaving it (dropped, also by a panic) removes it.
pub(crate) struct Registered {
    ctx: Arc<Ctx>,
    entry: Arc<Connection>,
}

impl Registered {
    pub fn entry(&self) -> &Arc<Connection> {
        &self.entry
    }
}

impl std::ops::Deref for Registered {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        &self.entry
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.ctx.connections.lock().remove(&self.entry.id);
        self.ctx.stats.curr_connections.fetch_sub(1, Ordering::Relaxed);
    }
}
