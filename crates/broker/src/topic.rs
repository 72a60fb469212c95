//! Topics: every current subscriber gets every message published (at most once: a subscriber
//! that is gone misses what is published meanwhile). Each subscriber has a bounded buffer; one
//! that falls a whole buffer behind is ended, with the reason, and counted — a slow subscriber
//! never makes the server hold unbounded memory, and never slows the others.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::mpsc;

use crate::{ConnId, Message};

pub struct Topic {
    pub name: String,
    subscribers: Mutex<Vec<Subscriber>>,
    published: AtomicU64,
    delivered: AtomicU64,
    /// Subscribers ended for falling behind.
    slow: AtomicU64,
}

struct Subscriber {
    id: u64,
    conn: ConnId,
    tx: mpsc::Sender<Arc<Message>>,
    ended: Arc<OnceLock<Ended>>,
}

/// Why the broker ended a subscription.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It fell a whole buffer behind.
    TooSlow(String),
    TopicRemoved(String),
}

/// One subscriber's end: messages arrive on `messages`; when it yields `None`, `ended` says why
/// the broker ended it (unset: it was unsubscribed).
pub struct Subscription {
    pub id: u64,
    pub messages: mpsc::Receiver<Arc<Message>>,
    pub ended: Arc<OnceLock<Ended>>,
}

/// A topic's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicStats {
    pub subscribers: u64,
    pub published: u64,
    /// Messages handed to subscribers (one per subscriber per message).
    pub delivered: u64,
    pub slow_subscribers_ended: u64,
}

impl Topic {
    pub(crate) fn new(name: String) -> Topic {
        Topic {
            name,
            subscribers: Mutex::new(Vec::new()),
            published: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            slow: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Subscriber>> {
        self.subscribers.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn subscribe(&self, id: u64, conn: ConnId, buffer: usize) -> Subscription {
        let (tx, messages) = mpsc::channel(buffer.max(1));
        let ended = Arc::new(OnceLock::new());
        self.lock().push(Subscriber { id, conn, tx, ended: Arc::clone(&ended) });
        Subscription { id, messages, ended }
    }

    /// Hands each message to every subscriber; returns how many subscribers got them all.
    pub(crate) fn publish(&self, messages: &[Arc<Message>]) -> u32 {
        let mut subscribers = self.lock();
        let mut delivered = 0;
        subscribers.retain(|s| {
            for m in messages {
                match s.tx.try_send(Arc::clone(m)) {
                    Ok(()) => delivered += 1,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        let _ = s.ended.set(Ended::TooSlow(format!(
                            "subscriber fell {} messages behind on topic {}",
                            s.tx.max_capacity(),
                            self.name
                        )));
                        self.slow.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(topic = %self.name, subscription = s.id, "slow subscriber ended");
                        return false;
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return false,
                }
            }
            true
        });
        self.published.fetch_add(messages.len() as u64, Ordering::Relaxed);
        self.delivered.fetch_add(delivered, Ordering::Relaxed);
        subscribers.len() as u32
    }

    /// Removes subscriptions matching `which`; they end for `reason` if given.
    pub(crate) fn remove(&self, which: impl Fn(u64, ConnId) -> bool, reason: Option<Ended>) {
        self.lock().retain(|s| {
            let gone = which(s.id, s.conn);
            if gone && let Some(reason) = &reason {
                let _ = s.ended.set(reason.clone());
            }
            !gone
        });
    }

    pub fn stats(&self) -> TopicStats {
        TopicStats {
            subscribers: self.lock().len() as u64,
            published: self.published.load(Ordering::Relaxed),
            delivered: self.delivered.load(Ordering::Relaxed),
            slow_subscribers_ended: self.slow.load(Ordering::Relaxed),
        }
    }
}
