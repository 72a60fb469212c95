//! Configuration reload (SIGHUP): the configuration file read again, what may change while the
//! server runs applied at once, the rest reported as waiting for a restart — in the log and in
//! `/api/v1/server`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use serde::Serialize;

use crate::{Config, Ctx};

/// The limits a reload may change, read where they apply (by connections opened after it).
pub(crate) struct LiveLimits {
    max_connections: AtomicUsize,
    max_connections_per_address: AtomicUsize,
    max_connections_per_user: AtomicUsize,
    /// 0: none.
    idle_timeout_ms: AtomicU64,
}

impl LiveLimits {
    pub fn new(config: &Config) -> LiveLimits {
        let limits = LiveLimits {
            max_connections: AtomicUsize::new(0),
            max_connections_per_address: AtomicUsize::new(0),
            max_connections_per_user: AtomicUsize::new(0),
            idle_timeout_ms: AtomicU64::new(0),
        };
        limits.set(config);
        limits
    }

    fn set(&self, config: &Config) {
        self.max_connections.store(config.max_connections, Ordering::Relaxed);
        self.max_connections_per_address.store(config.max_connections_per_address, Ordering::Relaxed);
        self.max_connections_per_user.store(config.security.max_connections_per_user, Ordering::Relaxed);
        let idle = config.idle_timeout().ok().flatten().map_or(0, |d| d.as_millis() as u64);
        self.idle_timeout_ms.store(idle, Ordering::Relaxed);
    }

    pub fn max_connections(&self) -> usize {
        self.max_connections.load(Ordering::Relaxed)
    }

    pub fn max_connections_per_address(&self) -> usize {
        self.max_connections_per_address.load(Ordering::Relaxed)
    }

    pub fn max_connections_per_user(&self) -> usize {
        self.max_connections_per_user.load(Ordering::Relaxed)
    }

    pub fn idle_timeout(&self) -> Option<Duration> {
        match self.idle_timeout_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }
}

/// Keys of the configuration file a reload applies (with the users file, always read again, and
/// the queue blocks, which the broker sorts into applied and waiting). Any other key that changed
/// waits for a restart.
const LIVE_KEYS: &[&str] = &[
    "max_connections",
    "max_connections_per_address",
    "idle_timeout",
    "max_memory_bytes",
    "security.users_file",
    "security.acl",
    "security.default_queue",
    "security.default_topic",
    "security.default_function",
    "security.max_connections_per_user",
    "security.tls_cert",
    "security.tls_key",
    "security.tls_client_ca",
];

/// A reload's outcome in a server started without a configuration file.
const NO_FILE: &str = "the server was started without --config: there is no file to read again \
    (damaged queues were looked at again)";

/// Tables whose every entry a reload applies.
const LIVE_TABLES: &[&str] = &["queue_defaults"];

/// What the last reload did, for `/api/v1/server`.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct ReloadStatus {
    /// Reloads tried since start.
    pub count: u64,
    /// Reloads of a file that could not be applied (nothing changed), since start.
    pub failures: u64,
    /// Unix time of the last one, ms (0: none yet).
    pub at_ms: u64,
    /// `ok`, or why nothing was applied.
    pub outcome: String,
    /// Keys changed and applied.
    pub applied: Vec<String>,
    /// Keys changed that take effect at the next start.
    pub needs_restart: Vec<String>,
    /// Keys that could not be applied, with why (a queue that could not be created).
    pub failed: Vec<String>,
    /// Queues not served since their files could not be opened, opened by this reload (repaired
    /// meanwhile).
    pub reopened: Vec<String>,
    /// Durable topics likewise.
    pub reopened_topics: Vec<String>,
}

#[derive(Default)]
pub(crate) struct ReloadState {
    pub status: ReloadStatus,
    /// The file as last read: what the next reload compares with.
    file: Option<toml::Table>,
    /// The file as the server started with it: what a key that needs a restart is compared
    /// with (a key changed and then set back needs none).
    started: Option<toml::Table>,
}

/// Reloads the configuration file while the server runs. Connections stay open; their next
/// requests are decided by the new users and ACLs, connections opened later by the new limits.
#[derive(Clone)]
pub struct Reloader {
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) path: Option<PathBuf>,
}

impl Reloader {
    /// The server was started with a configuration file (without one, a reload only opens
    /// damaged queues again, and its `Err` says so: nothing failed).
    pub fn has_file(&self) -> bool {
        self.path.is_some()
    }

    /// Reads the file again and applies it; the outcome is logged and kept for the API.
    pub fn reload(&self) -> Result<ReloadSummary, String> {
        // Without a file there is nothing to read again; damaged queues fixed by hand are still
        // looked at.
        let (result, without_file) = match &self.path {
            Some(path) => (self.apply(path), None),
            None => {
                let mut queues = petrel_broker::QueueChanges::default();
                self.ctx.broker.reopen_damaged(&mut queues);
                (Err(NO_FILE.to_owned()), Some(queues))
            }
        };
        let mut state = self.ctx.reload.lock().unwrap_or_else(|e| e.into_inner());
        state.status.count += 1;
        state.status.at_ms = crate::now_ns() / 1_000_000;
        match result {
            Ok((table, summary)) => {
                state.file = Some(table);
                state.status.outcome = "ok".into();
                state.status.applied = summary.applied.clone();
                state.status.needs_restart = summary.needs_restart.clone();
                state.status.failed = summary.failed.clone();
                state.status.reopened = summary.reopened.clone();
                state.status.reopened_topics = summary.reopened_topics.clone();
                Ok(summary)
            }
            Err(e) => {
                state.status.failures += u64::from(without_file.is_none());
                state.status.outcome = e.clone();
                state.status.applied.clear();
                state.status.needs_restart.clear();
                state.status.failed.clear();
                state.status.reopened.clear();
                state.status.reopened_topics.clear();
                if let Some(queues) = without_file {
                    state.status.failed = failed_keys(&queues).collect();
                    state.status.reopened = queues.reopened;
                    state.status.reopened_topics = queues.reopened_topics;
                }
                Err(e)
            }
        }
    }

    fn apply(&self, path: &Path) -> Result<(toml::Table, ReloadSummary), String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        // (toml's messages end with a newline: trimmed, for the log's line and the API's field.)
        let failed = |e: toml::de::Error| format!("{}: {}", path.display(), e.to_string().trim_end());
        let table: toml::Table = toml::from_str(&text).map_err(failed)?;
        // Its `[security]` files found from the file's directory, as at the start.
        let config = Config::from_file_text(path, &text)?;
        config.validate()?;
        // Everything is checked before anything is applied: a bad file changes nothing.
        let security = config.security.load()?;
        let tls = crate::load_tls(&config)?;
        let ctx = &self.ctx;
        if security.is_some() != ctx.broker.auth_enabled() || tls.is_some() != ctx.tls().is_some() {
            return Err("turning authentication or TLS on or off needs a restart".into());
        }
        // The broker checks every queue block before it changes any; all that follows cannot fail.
        let queues =
            ctx.broker.reconfigure_queues(config.queue_defaults()?, config.queues()?).map_err(|e| e.to_string())?;
        if let Some(security) = security {
            let before = ctx.broker.security();
            ctx.broker.set_security(security);
            // Connections whose user the new rules treat otherwise look at what they hold.
            if let (Some(before), Some(now)) = (before, ctx.broker.security()) {
                for conn in ctx.connections.list() {
                    if let Some(user) = conn.user()
                        && !before.same_rights(&now, &user)
                    {
                        conn.rights_changed();
                    }
                }
            }
        }
        ctx.http_logins.clear();
        *ctx.tls.write().unwrap_or_else(|e| e.into_inner()) = tls;
        ctx.limits.set(&config);
        ctx.broker.set_max_memory_bytes(config.max_memory_bytes);
        let (before, started) = {
            let state = ctx.reload.lock().unwrap_or_else(|e| e.into_inner());
            (state.file.clone().unwrap_or_default(), state.started.clone().unwrap_or_default())
        };
        let mut summary = ReloadSummary::default();
        let queue_key = |name: &String| format!("queues.{name}");
        // Queues waiting for a restart are listed until it comes, changed by this file or an earlier one.
        summary.needs_restart.extend(queues.needs_restart.iter().map(queue_key));
        summary.failed.extend(failed_keys(&queues));
        summary.reopened = queues.reopened;
        summary.reopened_topics = queues.reopened_topics;
        for key in changed_keys(&before, &table) {
            let (table_name, entry) = key.split_once('.').unwrap_or((&key, ""));
            let live = LIVE_KEYS.contains(&key.as_str()) || LIVE_TABLES.contains(&table_name);
            if table_name == "queues" {
                let name = entry.to_owned();
                let waits = queues.needs_restart.contains(&name) || queues.failed.iter().any(|(n, _)| *n == name);
                if table.get("queues").and_then(|q| q.get(entry)).is_none() {
                    // A block removed: a queue made by first use takes the defaults again (it was
                    // applied, `Broker::reconfigure_queues`); one made explicitly keeps its own.
                    if queues.applied.contains(&name) {
                        tracing::info!(queue = %name, "no longer named in the configuration file; made by first use, it takes [queue_defaults]");
                        summary.applied.push(key);
                    } else {
                        tracing::info!(queue = %name, "no longer named in the configuration file; it keeps its settings");
                    }
                } else if !waits {
                    summary.applied.push(key);
                }
            } else if live {
                summary.applied.push(key);
            }
        }
        // Keys that need a restart: those that differ from the file the server started with,
        // listed by every reload until the restart comes.
        for key in changed_keys(&started, &table) {
            let table_name = key.split_once('.').map_or(key.as_str(), |(t, _)| t);
            if table_name != "queues" && !LIVE_KEYS.contains(&key.as_str()) && !LIVE_TABLES.contains(&table_name) {
                summary.needs_restart.push(key);
            }
        }
        summary.needs_restart.sort();
        summary.needs_restart.dedup();
        Ok((table, summary))
    }

    /// Remembers the file as the server was started with it: what the first reload compares with.
    pub(crate) fn remember_file(&self) {
        let Some(path) = &self.path else { return };
        let table = std::fs::read_to_string(path).ok().and_then(|text| toml::from_str::<toml::Table>(&text).ok());
        let mut state = self.ctx.reload.lock().unwrap_or_else(|e| e.into_inner());
        state.started = table.clone();
        state.file = table;
    }
}

/// The queues a reload could not apply, as `queues.NAME: why`.
fn failed_keys(queues: &petrel_broker::QueueChanges) -> impl Iterator<Item = String> + '_ {
    queues.failed.iter().map(|(name, why)| format!("queues.{name}: {why}"))
}

/// The keys a reload found changed.
#[derive(Clone, Debug, Default)]
pub struct ReloadSummary {
    pub applied: Vec<String>,
    pub needs_restart: Vec<String>,
    pub failed: Vec<String>,
    /// Damaged queues opened again (by name).
    pub reopened: Vec<String>,
    /// Damaged durable topics opened again (by name).
    pub reopened_topics: Vec<String>,
}

/// Dotted keys whose values differ: top-level keys, and the entries of top-level tables
/// (`security.acl`, `queues.orders`, `queues.jobs.high` for a queue named "jobs.high"), whatever
/// changed inside them.
fn changed_keys(before: &toml::Table, after: &toml::Table) -> Vec<String> {
    let empty = toml::Table::new();
    let mut changed = Vec::new();
    for key in sorted_keys(before, after) {
        match (before.get(key), after.get(key)) {
            (a @ (None | Some(toml::Value::Table(_))), b @ (None | Some(toml::Value::Table(_)))) => {
                // A table added or removed: its entries changed, one by one.
                let a = a.and_then(toml::Value::as_table).unwrap_or(&empty);
                let b = b.and_then(toml::Value::as_table).unwrap_or(&empty);
                let entries = sorted_keys(a, b).into_iter().filter(|k| a.get(*k) != b.get(*k));
                changed.extend(entries.map(|k| format!("{key}.{k}")));
            }
            (a, b) if a != b => changed.push(key.clone()),
            _ => {}
        }
    }
    changed
}

fn sorted_keys<'a>(a: &'a toml::Table, b: &'a toml::Table) -> Vec<&'a String> {
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_keys_name_what_differs_down_to_a_table_entry() {
        let before: toml::Table = toml::from_str(
            "max_connections = 10\nidle_timeout = \"5m\"\n[security]\nusers_file = \"u\"\n[queues.orders]\nmax_items = 5\n[queues.logs]\ndurable = true\n",
        )
        .unwrap();
        let after: toml::Table = toml::from_str(
            "max_connections = 20\nidle_timeout = \"5m\"\nsegment_bytes = 1048576\n[security]\nusers_file = \"u\"\n[queues.orders]\nmax_items = 6\n[queues.logs]\ndurable = true\n",
        )
        .unwrap();
        assert_eq!(changed_keys(&before, &after), ["max_connections", "queues.orders", "segment_bytes"]);
        assert!(changed_keys(&after, &after).is_empty());
        let dotted: toml::Table = toml::from_str("[queues.\"jobs.high\"]\nmax_items = 1\n").unwrap();
        assert_eq!(
            changed_keys(&after, &dotted),
            [
                "idle_timeout",
                "max_connections",
                "queues.jobs.high",
                "queues.logs",
                "queues.orders",
                "security.users_file",
                "segment_bytes"
            ]
        );
    }
}
