//! Petrel's broker: destinations and their semantics, over `petrel-log`. It does no I/O of its
//! own beyond the logs and one definitions file, holds no sockets and runs no timers: protocols
//! call it, and the server waits (on each queue's `Notify`) and ticks it.
//!
//! Queues: bounded (refuse when full) or circular (drop the oldest), durable (a `petrel-log` per
//! queue, contents survive restarts) or in memory, temporary (owned by a connection), with
//! tentative reads (ack, abort, visibility timeout, disconnect), expiry with dead letters, and
//! fanout (offering to `q` also offers to every queue named `q+<child>`).

mod message;
mod queue;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

pub use message::Message;
pub use queue::{Delivery, Polled, Queue, QueueConfig, QueueStats};

use petrel_log::{Durability, Log, Options};
use serde::{Deserialize, Serialize};

/// Identifies a connection (or any consumer) for tentative reads and temporary queues.
pub type ConnId = u64;

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("no queue named {0:?}")]
    NotFound(String),
    #[error("queue {0:?} is full")]
    Full(String),
    #[error("queue {0:?} exists with another configuration")]
    Exists(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("message of {size} bytes exceeds the limit of {max}")]
    TooLarge { size: usize, max: usize },
    #[error("storage: {0}")]
    Storage(#[from] petrel_log::Error),
    #[error("definitions file: {0}")]
    Definitions(String),
}

/// Server-wide settings of the broker.
#[derive(Clone, Debug)]
pub struct BrokerOptions {
    /// Durability of durable queues' logs.
    pub durability: Durability,
    pub segment_bytes: u64,
    /// Largest message payload (plus headers) accepted.
    pub max_message_bytes: usize,
}

impl Default for BrokerOptions {
    fn default() -> Self {
        BrokerOptions { durability: Durability::None, segment_bytes: 64 << 20, max_message_bytes: 16 << 20 }
    }
}

#[derive(Serialize, Deserialize)]
struct Definition {
    name: String,
    config: QueueConfig,
}

pub struct Broker {
    dir: PathBuf,
    options: BrokerOptions,
    queues: RwLock<HashMap<String, Arc<Queue>>>,
    /// Serializes changes to the set of queues and their definitions file.
    definitions: Mutex<()>,
    next_handle: AtomicU64,
}

const DEFINITIONS: &str = "queues.json";

impl Broker {
    /// Opens the broker's data in `dir`: queue definitions, and the logs of durable queues.
    pub fn open(dir: impl AsRef<Path>, options: BrokerOptions) -> Result<Broker, BrokerError> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(dir.join("queues")).map_err(|e| BrokerError::Definitions(e.to_string()))?;
        let broker = Broker {
            dir,
            options,
            queues: RwLock::new(HashMap::new()),
            definitions: Mutex::new(()),
            next_handle: AtomicU64::new(1),
        };
        let path = broker.dir.join(DEFINITIONS);
        let defs: Vec<Definition> = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| BrokerError::Definitions(format!("{}: {e}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(BrokerError::Definitions(format!("{}: {e}", path.display()))),
        };
        for def in defs {
            let queue = broker.build(def.name.clone(), def.config, None)?;
            broker.queues.write().unwrap_or_else(|e| e.into_inner()).insert(def.name, Arc::new(queue));
        }
        Ok(broker)
    }

    fn build(&self, name: String, config: QueueConfig, owner: Option<ConnId>) -> Result<Queue, BrokerError> {
        if config.durable && !config.temporary {
            let options = Options {
                durability: self.options.durability,
                segment_bytes: self.options.segment_bytes,
                max_record_bytes: self.options.max_message_bytes + 64 * 1024,
                retention: petrel_log::Retention { delete_consumed: true, ..Default::default() },
                ..Options::default()
            };
            let log = Log::open(self.dir.join("queues").join(&name), options)?.into_shared();
            Queue::on_log(name, config, log)
        } else {
            Ok(Queue::in_memory(name, config, owner))
        }
    }

    /// Creates a queue, or returns the existing one if its configuration is the same.
    pub fn create_queue(
        &self,
        name: &str,
        config: QueueConfig,
        owner: Option<ConnId>,
    ) -> Result<Arc<Queue>, BrokerError> {
        check_name(name)?;
        if config.temporary && owner.is_none() {
            return Err(BrokerError::BadRequest("a temporary queue needs an owning connection".into()));
        }
        let _guard = self.definitions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(q) = self.queue(name) {
            return if q.config == config { Ok(q) } else { Err(BrokerError::Exists(name.to_owned())) };
        }
        let queue = Arc::new(self.build(name.to_owned(), config, owner)?);
        self.queues.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_owned(), Arc::clone(&queue));
        self.save_definitions()?;
        Ok(queue)
    }

    /// Removes a queue and its contents.
    pub fn remove_queue(&self, name: &str) -> Result<(), BrokerError> {
        let _guard = self.definitions.lock().unwrap_or_else(|e| e.into_inner());
        let queue = self
            .queues
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
            .ok_or_else(|| BrokerError::NotFound(name.to_owned()))?;
        self.save_definitions()?;
        queue.available.notify_waiters();
        if queue.config.durable && !queue.config.temporary {
            drop(queue);
            let _ = std::fs::remove_dir_all(self.dir.join("queues").join(name));
        }
        Ok(())
    }

    pub fn queue(&self, name: &str) -> Option<Arc<Queue>> {
        self.queues.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    fn get(&self, name: &str) -> Result<Arc<Queue>, BrokerError> {
        self.queue(name).ok_or_else(|| BrokerError::NotFound(name.to_owned()))
    }

    pub fn queue_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.queues.read().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect();
        names.sort();
        names
    }

    /// Offers to `name` (all or none), then a copy to each fanout child `name+…`. A child that is
    /// full drops its copy (counted in its `dropped`).
    pub fn offer(&self, name: &str, messages: Vec<Message>, now: u64) -> Result<(u64, u32), BrokerError> {
        for m in &messages {
            if m.size() as usize > self.options.max_message_bytes {
                return Err(BrokerError::TooLarge { size: m.size() as usize, max: self.options.max_message_bytes });
            }
        }
        let queue = self.get(name)?;
        let children = self.children(name);
        let copies = if children.is_empty() { None } else { Some(messages.clone()) };
        let accepted = queue.offer(messages, now)?;
        if let Some(copies) = copies {
            for child in children {
                if let Err(e) = child.offer(copies.clone(), now) {
                    tracing::debug!(queue = %child.name, error = %e, "fanout copy dropped");
                }
            }
        }
        Ok(accepted)
    }

    fn children(&self, name: &str) -> Vec<Arc<Queue>> {
        let prefix = format!("{name}+");
        self.queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(n, _)| n.starts_with(&prefix) && !n[prefix.len()..].contains('+'))
            .map(|(_, q)| Arc::clone(q))
            .collect()
    }

    /// Takes up to `max` messages (tentatively, with a visibility timeout). Expired messages it
    /// meets go to the queue's dead-letter queue.
    pub fn poll(
        &self,
        name: &str,
        max: usize,
        visibility: Option<Duration>,
        consumer: ConnId,
        now: u64,
    ) -> Result<Vec<Delivery>, BrokerError> {
        let queue = self.get(name)?;
        let mut next_handle = || self.next_handle.fetch_add(1, Ordering::Relaxed);
        let polled = queue.poll(max, visibility, consumer, now, &mut next_handle)?;
        self.dead_letter(&queue, polled.expired, now);
        Ok(polled.deliveries)
    }

    pub fn ack(&self, name: &str, handles: &[u64], consumer: ConnId) -> Result<u32, BrokerError> {
        self.get(name)?.ack(handles, consumer)
    }

    pub fn abort(&self, name: &str, handles: &[u64], consumer: ConnId) -> Result<u32, BrokerError> {
        self.get(name)?.abort(handles, consumer)
    }

    /// A connection closed: its tentative reads go back, its temporary queues go away.
    pub fn disconnect(&self, consumer: ConnId) {
        let queues: Vec<Arc<Queue>> = self.queues.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        for q in queues {
            if q.owner == Some(consumer) {
                let _ = self.remove_queue(&q.name);
            } else if let Err(e) = q.release(consumer) {
                tracing::error!(queue = %q.name, error = %e, "could not return tentative reads");
            }
        }
    }

    /// Periodic work: visibility timeouts and expiry. Call it every few tens of milliseconds.
    pub fn tick(&self, now: u64) {
        let queues: Vec<Arc<Queue>> = self.queues.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        for q in queues {
            match q.tick(now) {
                Ok(expired) => self.dead_letter(&q, expired, now),
                Err(e) => tracing::error!(queue = %q.name, error = %e, "tick failed"),
            }
        }
    }

    fn dead_letter(&self, from: &Queue, expired: Vec<Message>, now: u64) {
        if expired.is_empty() || from.config.dead_letter.is_empty() {
            return;
        }
        let expired = expired.into_iter().map(|m| Message { expires_at: 0, ..m }).collect();
        if let Err(e) = self.offer(&from.config.dead_letter, expired, now) {
            tracing::warn!(queue = %from.name, dead_letter = %from.config.dead_letter, error = %e, "expired messages lost");
        }
    }

    fn save_definitions(&self) -> Result<(), BrokerError> {
        let queues = self.queues.read().unwrap_or_else(|e| e.into_inner());
        let mut defs: Vec<Definition> = queues
            .values()
            .filter(|q| !q.config.temporary)
            .map(|q| Definition { name: q.name.clone(), config: q.config.clone() })
            .collect();
        defs.sort_by(|a, b| a.name.cmp(&b.name));
        let path = self.dir.join(DEFINITIONS);
        let tmp = path.with_extension("json.tmp");
        let json = serde_json::to_vec_pretty(&defs).expect("definitions serialize");
        std::fs::write(&tmp, json)
            .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| BrokerError::Definitions(format!("{}: {e}", path.display())))
    }
}

/// Queue names: 1–200 characters of `A-Z a-z 0-9 . _ - +` (`+` separates a fanout child).
pub fn check_name(name: &str) -> Result<(), BrokerError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
        && !name.starts_with(['.', '+']);
    if ok { Ok(()) } else { Err(BrokerError::BadRequest(format!("invalid queue name {name:?}"))) }
}
