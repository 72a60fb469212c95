//! Queues made when first named (the memcache protocol's), off the runtime's threads.
//!
//! Making a durable queue is file-system work: a directory, a definition, a segment and a cursor,
//! 0.3 ms on a fresh ext4 and several ms on one that has just deleted many files. Done on a
//! runtime thread, it held up every connection that thread serves; and each connection naming the
//! same queue meanwhile waited on the broker's lock for it, holding up another thread — with 40
//! clients setting the same new key, the whole server. Now one blocking thread makes each queue,
//! and the connections that name it meanwhile wait for it as tasks, holding no thread.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use petrel_broker::security::Principal;
use petrel_broker::{BrokerError, Queue};
use tokio::sync::watch;

use crate::Ctx;

/// The queues being made for a first use, by name. An entry lives while its making runs, so this
/// holds at most one entry per creation under way.
#[derive(Default)]
pub(crate) struct FirstUse {
    /// Closed (its sender dropped) when the making has ended, made or failed.
    making: Mutex<HashMap<String, watch::Receiver<()>>>,
}

/// The queue `name`, made for `who` (counted as the broker's `queue_or_create_by` counts) if there
/// is none yet.
pub(crate) async fn queue_or_create(
    ctx: &Arc<Ctx>,
    who: Option<&Principal>,
    name: &str,
) -> Result<Arc<Queue>, BrokerError> {
    loop {
        if let Some(queue) = ctx.broker.queue(name) {
            return Ok(queue);
        }
        let turn = {
            let mut making = ctx.first_use.making.lock().unwrap_or_else(|e| e.into_inner());
            match making.get(name) {
                Some(made) => Turn::Wait(made.clone()),
                None => {
                    let (ended, made) = watch::channel(());
                    making.insert(name.to_owned(), made);
                    Turn::Make(ended)
                }
            }
        };
        let mut made = match turn {
            Turn::Wait(made) => made,
            Turn::Make(ended) => {
                let making = Making { ctx: Arc::clone(ctx), name: name.to_owned(), _ended: ended };
                let who = who.cloned();
                return crate::blocking(move || making.ctx.broker.queue_or_create_by(who.as_ref(), &making.name)).await;
            }
        };
        // Another connection is making it. Once that ends the queue is there, or the making
        // failed and this one tries again (and is told why, if it fails alike).
        let _ = made.changed().await;
    }
}

/// What a connection that finds no queue does: wait for the making under way, or make it.
enum Turn {
    Wait(watch::Receiver<()>),
    Make(watch::Sender<()>),
}

/// One making under way: when it ends (or is dropped unrun, at shutdown) its entry goes and the
/// connections waiting for it are woken, in that order.
struct Making {
    ctx: Arc<Ctx>,
    name: String,
    _ended: watch::Sender<()>,
}

impl Drop for Making {
    fn drop(&mut self) {
        self.ctx.first_use.making.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.name);
    }
}
