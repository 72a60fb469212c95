//! What a client command talks to: one server, or a cluster when `--server` lists several
//! (`A,B,C`). The commands use this one surface; a cluster spreads offers, takes from every
//! server, and routes acknowledgements to where each message came from.

use std::time::Duration;

use petrel_client::blocking::{Client, Cluster};
use petrel_client::{ClientError, ClusterHandle, Message, PollOptions, QueueConfig};

pub enum Target {
    One(Client),
    Many(Cluster),
}

/// Where a message taken tentatively is acknowledged.
#[derive(Clone, Copy, Debug)]
pub enum Handle {
    One(u64),
    Many(ClusterHandle),
}

pub struct Taken {
    pub handle: Handle,
    pub message: Message,
}

/// The same call on either kind of target (the two have methods of the same names and types).
macro_rules! on_either {
    ($target:expr, $c:ident => $call:expr) => {
        match $target {
            Target::One($c) => $call,
            Target::Many($c) => $call,
        }
    };
}

/// A single server's handles among `handles`.
pub fn single_ids(handles: &[Handle]) -> Vec<u64> {
    handles.iter().filter_map(|h| if let Handle::One(id) = h { Some(*id) } else { None }).collect()
}

/// A cluster's handles among `handles`.
fn cluster_ids(handles: &[Handle]) -> Vec<ClusterHandle> {
    handles.iter().filter_map(|h| if let Handle::Many(id) = h { Some(*id) } else { None }).collect()
}

impl Target {
    /// Offers `messages` (all or none); returns how many repeat an idempotency key the queue
    /// remembers, and so were not stored again. On a cluster, offers with the same `route` go
    /// to the same server while it is up (a queue remembers the keys it stored itself: the
    /// same keyed offers again must reach the same server to be known), others in turn.
    pub fn offer(
        &self,
        queue: &str,
        messages: Vec<Message>,
        timeout: Option<Duration>,
        route: Option<&str>,
    ) -> Result<u32, ClientError> {
        match (self, route) {
            (Target::One(c), _) => c.offer_stored(queue, messages, timeout).map(|stored| stored.repeats),
            (Target::Many(c), None) => c.offer(queue, messages, timeout).map(|offered| offered.repeats),
            (Target::Many(c), Some(route)) => {
                c.offer_by_key(route.as_bytes(), queue, messages, timeout).map(|offered| offered.repeats)
            }
        }
    }

    pub fn poll(&self, queue: &str, options: PollOptions) -> Result<Vec<Taken>, ClientError> {
        Ok(match self {
            Target::One(c) => c
                .poll(queue, options)?
                .into_iter()
                .map(|d| Taken { handle: Handle::One(d.handle), message: d.message })
                .collect(),
            Target::Many(c) => c
                .poll(queue, options)?
                .into_iter()
                .map(|d| Taken { handle: Handle::Many(d.handle), message: d.message })
                .collect(),
        })
    }

    pub fn ack(&self, queue: &str, handles: &[Handle]) -> Result<u32, ClientError> {
        match self {
            Target::One(c) => c.ack(queue, &single_ids(handles)),
            Target::Many(c) => c.ack(queue, &cluster_ids(handles)),
        }
    }

    /// Gives back deliveries never printed: back at the head, their delivery not counted.
    pub fn give_back_unseen(&self, queue: &str, handles: &[Handle]) -> Result<u32, ClientError> {
        match self {
            Target::One(c) => c.give_back_unseen(queue, &single_ids(handles)),
            Target::Many(c) => c.give_back_unseen(queue, &cluster_ids(handles)),
        }
    }

    /// After a listing: on a cluster with servers down, names them on stderr and returns the
    /// exit status that says the list is partial (3, as `consume` says a partial drain).
    pub fn partial_listing(&self) -> Option<std::process::ExitCode> {
        let down = self.servers_down();
        if down.is_empty() {
            return None;
        }
        eprintln!("petrel: not listed, servers down: {}", down.join("; "));
        Some(std::process::ExitCode::from(3))
    }

    /// The servers of a cluster that are down now, with why (none for one server: its loss is
    /// an error of the call itself).
    pub fn servers_down(&self) -> Vec<String> {
        match self {
            Target::One(_) => Vec::new(),
            Target::Many(c) => c
                .stats()
                .servers
                .into_iter()
                .filter(|s| !s.up)
                .map(|s| match s.last_error {
                    Some(why) => format!("{} ({why})", s.addr),
                    None => s.addr,
                })
                .collect(),
        }
    }

    pub fn create_queue(&self, name: &str, config: QueueConfig) -> Result<(), ClientError> {
        on_either!(self, c => c.create_queue(name, config))
    }

    pub fn remove_queue(&self, name: &str) -> Result<(), ClientError> {
        on_either!(self, c => c.remove_queue(name))
    }

    pub fn list_queues(&self) -> Result<Vec<String>, ClientError> {
        on_either!(self, c => c.list_queues())
    }

    /// The queue's figures as JSON: one server's, or an object of each server's (an error
    /// as `{"error": …}`).
    pub fn queue_status(&self, name: &str) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
        Ok(match self {
            Target::One(c) => crate::stat_cmd::queue_figures(name, &c.queue_status(name)?),
            Target::Many(c) => {
                let mut each = serde_json::Map::new();
                let mut first_error = None;
                for (addr, stats) in c.queue_status(name) {
                    let value = match stats {
                        Ok(s) => crate::stat_cmd::queue_figures(name, &s),
                        Err(e) => {
                            let value = serde_json::json!({ "error": e.to_string() });
                            first_error.get_or_insert(e);
                            value
                        }
                    };
                    each.insert(addr, value);
                }
                // No server has it (or none answered): a failure, as for one server.
                if let Some(e) = first_error.filter(|_| each.values().all(|v| v.get("error").is_some())) {
                    return Err(e.into());
                }
                serde_json::Value::Object(each)
            }
        })
    }

    /// Whether topic `name` keeps a log (on a cluster: not asked, `None`).
    pub fn topic_is_durable(&self, name: &str) -> Option<bool> {
        match self {
            Target::One(c) => c.topic_status(name).ok().map(|s| s.durable),
            Target::Many(_) => None,
        }
    }

    pub fn create_topic(&self, name: &str, durable: bool) -> Result<(), ClientError> {
        on_either!(self, c => c.create_topic(name, durable))
    }

    pub fn remove_topic(&self, name: &str) -> Result<(), ClientError> {
        on_either!(self, c => c.remove_topic(name))
    }

    pub fn list_topics(&self) -> Result<Vec<String>, ClientError> {
        on_either!(self, c => c.list_topics())
    }

    pub fn publish(&self, topic: &str, messages: Vec<Message>) -> Result<u32, ClientError> {
        on_either!(self, c => c.publish(topic, messages))
    }

    pub fn call(&self, function: &str, message: Message, timeout: Option<Duration>) -> Result<Message, ClientError> {
        on_either!(self, c => c.call(function, message, timeout))
    }

    pub fn call_oneway(&self, function: &str, message: Message) -> Result<(), ClientError> {
        on_either!(self, c => c.call_oneway(function, message))
    }
}
