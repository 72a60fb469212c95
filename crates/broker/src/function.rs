//! Functions: request/reply. Servers of a function name are connections (reached through a
//! bounded channel of invocations) or closures in this process; a call goes to one of them,
//! round robin, and its reply comes back to the caller by call id. A server that goes away
//! fails the calls it had, so no caller waits for nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::{BrokerError, ConnId, MemoryHold, Message, MessageKind};

/// A function served in this process: the request in, the reply (or a handler error) out.
pub type LocalHandler = Arc<dyn Fn(Message) -> Result<Message, String> + Send + Sync>;

/// A call for a connection serving `function`, to answer with `Broker::reply`.
#[derive(Debug)]
pub struct Invocation {
    pub call: u64,
    pub function: String,
    pub message: Message,
    /// The call's bytes in the memory budget, given back when the invocation is dropped (once
    /// its connection has taken it).
    pub memory: MemoryHold,
}

/// What a waiting invocation takes of the memory budget besides its message's bytes.
pub(crate) const INVOCATION_OVERHEAD: u64 = (std::mem::size_of::<Invocation>() + 64) as u64;

/// Takes a call's outcome: the reply, a handler error, the server gone, or the deadline passed.
/// Called once, from whichever of those comes first (without the broker's locks held).
pub type Replier = Box<dyn FnOnce(Result<Message, BrokerError>) + Send>;

/// What became of a call.
pub enum Called {
    /// Answered at once (a function served in this process).
    Replied(Box<Message>),
    /// Handed to a connection; its `Replier` will have the outcome.
    Pending { call: u64 },
    /// A oneway call handed to a server.
    Sent,
}

enum Server {
    Remote {
        conn: ConnId,
        invocations: mpsc::Sender<Invocation>,
        /// Its calls handed out and not yet answered (`MAX_CALLS_WAITING_PER_SERVER`).
        waiting: Arc<AtomicUsize>,
    },
    Local(LocalHandler),
}

/// Calls of a function one connection may have been handed and not yet answered: past it, the
/// function's other servers take its calls (or they fail as busy), as when its channel is full.
/// A client whose handlers fall behind is skipped this way rather than handed calls it could
/// only refuse (the Rust client holds 2,048 of a function: 1,024 running, 1,024 waiting).
pub const MAX_CALLS_WAITING_PER_SERVER: usize = 1024;

/// One of a server's calls waiting for its answer: counted while it lives.
struct WaitingCall(Arc<AtomicUsize>);

impl Drop for WaitingCall {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A function's figures, kept while anything serves it (counting again from zero if it is
/// served again after none did).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FunctionStats {
    /// Calls routed to a server.
    pub calls: u64,
    /// Calls answered with a handler error, failed by their server going away, or refused
    /// because every server was busy.
    pub errors: u64,
    /// Calls that got no reply before their deadline.
    pub timeouts: u64,
}

/// A served function: who serves it and its figures.
#[derive(Clone, Debug)]
pub struct FunctionStatus {
    pub name: String,
    /// The connections serving it; `None` for a server in this process.
    pub servers: Vec<Option<ConnId>>,
    /// Calls handed to a server and not yet answered.
    pub waiting: u64,
    pub stats: FunctionStats,
}

/// Told the function's name and how long each answered call took (a server's latency histogram).
#[derive(Clone, Default)]
pub struct CallObserver(Option<Arc<ObserveCall>>);

type ObserveCall = dyn Fn(&str, Duration) + Send + Sync;

impl CallObserver {
    pub fn new(observe: impl Fn(&str, Duration) + Send + Sync + 'static) -> CallObserver {
        CallObserver(Some(Arc::new(observe)))
    }

    fn observe(&self, function: &str, took: Duration) {
        if let Some(observe) = &self.0 {
            observe(function, took);
        }
    }
}

impl std::fmt::Debug for CallObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "CallObserver(set)" } else { "CallObserver(none)" })
    }
}

#[derive(Default)]
struct Servers {
    list: Vec<Server>,
    next: usize,
    stats: FunctionStats,
}

/// A call made and not yet answered: its reply goes through `reply`, or a timeout does.
struct PendingCall {
    function: String,
    server: ConnId,
    /// The connection that made the call: when it goes, so does the call (nobody reads the
    /// reply, and it would otherwise wait its whole timeout, up to 49 days).
    caller: ConnId,
    started: Instant,
    deadline_ns: u64,
    reply: Replier,
    /// Counts it among its server's waiting calls until it is answered, fails or times out.
    _counted: WaitingCall,
}

#[derive(Default)]
pub(crate) struct Functions {
    servers: Mutex<HashMap<String, Servers>>,
    waiting: Mutex<HashMap<u64, PendingCall>>,
    observer: CallObserver,
}

/// What became of a call, for the function's figures.
#[derive(Clone, Copy)]
enum Outcome {
    Replied,
    Failed,
    TimedOut,
}

impl Functions {
    pub(crate) fn new(observer: CallObserver) -> Functions {
        Functions { observer, ..Functions::default() }
    }

    /// Every served function, by name.
    pub(crate) fn list(&self) -> Vec<FunctionStatus> {
        let servers = self.servers.lock().unwrap_or_else(|e| e.into_inner());
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let mut list: Vec<FunctionStatus> = servers
            .iter()
            .map(|(name, s)| FunctionStatus {
                name: name.clone(),
                servers: s
                    .list
                    .iter()
                    .map(|server| match server {
                        Server::Remote { conn, .. } => Some(*conn),
                        Server::Local(_) => None,
                    })
                    .collect(),
                waiting: waiting.values().filter(|w| &w.function == name).count() as u64,
                stats: s.stats,
            })
            .collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    /// Counts a call's outcome in its function's figures (gone if nothing serves it any more).
    /// A reply takes no lock here: it only tells the observer.
    fn settle(&self, function: &str, outcome: Outcome, took: Option<Duration>) {
        if !matches!(outcome, Outcome::Replied) {
            let mut servers = self.servers.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(s) = servers.get_mut(function) {
                match outcome {
                    Outcome::Failed => s.stats.errors += 1,
                    Outcome::TimedOut => s.stats.timeouts += 1,
                    Outcome::Replied => unreachable!("answered above"),
                }
            }
        }
        if let Some(took) = took {
            self.observer.observe(function, took);
        }
    }

    pub(crate) fn serve_remote(&self, function: &str, conn: ConnId, invocations: mpsc::Sender<Invocation>) {
        let mut servers = self.servers.lock().unwrap_or_else(|e| e.into_inner());
        let entry = servers.entry(function.to_owned()).or_default();
        if !entry.list.iter().any(|s| matches!(s, Server::Remote { conn: c, .. } if *c == conn)) {
            entry.list.push(Server::Remote { conn, invocations, waiting: Arc::default() });
        }
    }

    pub(crate) fn serve_local(&self, function: &str, handler: LocalHandler) {
        let mut servers = self.servers.lock().unwrap_or_else(|e| e.into_inner());
        servers.entry(function.to_owned()).or_default().list.push(Server::Local(handler));
    }

    /// Stops `conn` serving `function` (every function if `None`) and fails the calls it had.
    pub(crate) fn unserve(&self, function: Option<&str>, conn: ConnId) {
        let mut servers = self.servers.lock().unwrap_or_else(|e| e.into_inner());
        servers.retain(|name, s| {
            if function.is_none_or(|f| f == name) {
                s.list.retain(|server| !matches!(server, Server::Remote { conn: c, .. } if *c == conn));
            }
            !s.list.is_empty()
        });
        drop(servers);
        if function.is_none() {
            for w in self.take_waiting(|w| w.server == conn) {
                self.settle(&w.function, Outcome::Failed, None);
                (w.reply)(Err(BrokerError::Handler("the function's server disconnected".into())));
            }
        }
    }

    /// `conn` is gone: it serves nothing (the calls handed to it fail), and its own calls waiting
    /// for replies are forgotten (their replier finds nobody when it answers).
    pub(crate) fn disconnect(&self, conn: ConnId) {
        self.unserve(None, conn);
        drop(self.take_waiting(|w| w.caller == conn));
    }

    /// Calls whose deadline passed are answered `Timeout`.
    pub(crate) fn expire(&self, now_ns: u64) {
        for w in self.take_waiting(|w| w.deadline_ns <= now_ns) {
            self.settle(&w.function, Outcome::TimedOut, None);
            (w.reply)(Err(BrokerError::Timeout("no reply before the call's deadline".into())));
        }
    }

    fn take_waiting(&self, which: impl Fn(&PendingCall) -> bool) -> Vec<PendingCall> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let calls: Vec<u64> = waiting.iter().filter(|(_, w)| which(w)).map(|(c, _)| *c).collect();
        calls.into_iter().filter_map(|c| waiting.remove(&c)).collect()
    }

    /// Hands the call to one of the function's servers. `reply` (with its deadline, ns) gets
    /// the outcome of a call handed to a connection; it is dropped unused otherwise. Also says
    /// which connection took the call (none for a server in this process).
    pub(crate) fn call(
        &self,
        (caller, function): (ConnId, &str),
        (message, hold): (Message, impl FnOnce() -> Result<MemoryHold, BrokerError>),
        oneway: bool,
        call: u64,
        reply: (Replier, u64),
    ) -> Result<(Called, Option<ConnId>), BrokerError> {
        let mut servers = self.servers.lock().unwrap_or_else(|e| e.into_inner());
        let not_found = || BrokerError::FunctionNotFound(function.to_owned());
        let entry = servers.get_mut(function).ok_or_else(not_found)?;
        // The call's bytes in the memory budget (`Broker::call`), once there is a server for it.
        let memory = hold()?;
        entry.stats.calls += 1;
        let mut message = Some(message);
        let mut reply = Some(reply);
        // Round robin; a server whose channel is full or closed is skipped.
        for _ in 0..entry.list.len() {
            let i = entry.next % entry.list.len();
            entry.next = entry.next.wrapping_add(1);
            match &entry.list[i] {
                Server::Local(handler) => {
                    let handler = Arc::clone(handler);
                    drop(servers);
                    let started = Instant::now();
                    let answer = handler(message.take().expect("not yet sent"));
                    let outcome = if answer.is_ok() { Outcome::Replied } else { Outcome::Failed };
                    self.settle(function, outcome, Some(started.elapsed()));
                    let answer = answer.map_err(BrokerError::Handler)?;
                    return Ok((if oneway { Called::Sent } else { Called::Replied(Box::new(answer)) }, None));
                }
                Server::Remote { conn, invocations, waiting: server_waiting } => {
                    if !oneway && server_waiting.load(Ordering::Relaxed) >= MAX_CALLS_WAITING_PER_SERVER {
                        continue; // behind with its answers: busy, as a full channel is
                    }
                    // Its place in the server's channel first: once the call is registered,
                    // a timeout or a reply may take it at any moment, so nothing after that
                    // may fail and hand it to another server.
                    let Ok(place) = invocations.try_reserve() else { continue };
                    // Registered before it is sent: the reply may come back at once.
                    if !oneway {
                        let (r, deadline_ns) = reply.take().expect("registered once");
                        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
                        let w = PendingCall {
                            function: function.to_owned(),
                            server: *conn,
                            caller,
                            started: Instant::now(),
                            deadline_ns,
                            reply: r,
                            _counted: {
                                server_waiting.fetch_add(1, Ordering::Relaxed);
                                WaitingCall(Arc::clone(server_waiting))
                            },
                        };
                        waiting.insert(call, w);
                    }
                    let message = message.take().expect("not yet sent");
                    place.send(Invocation { call, function: function.to_owned(), message, memory });
                    return Ok((if oneway { Called::Sent } else { Called::Pending { call } }, Some(*conn)));
                }
            }
        }
        entry.stats.errors += 1;
        Err(BrokerError::Handler(format!("every server of {function} is busy or gone")))
    }
    /// A server answered `call`; `false` if no caller waits for it (timed out, or not its call).
    pub(crate) fn reply(&self, call: u64, conn: ConnId, result: Result<Message, String>) -> bool {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        match waiting.get(&call) {
            Some(w) if w.server == conn => {
                let w = waiting.remove(&call).expect("just seen");
                drop(waiting);
                let outcome = if result.is_ok() { Outcome::Replied } else { Outcome::Failed };
                self.settle(&w.function, outcome, Some(w.started.elapsed()));
                (w.reply)(result.map(|m| Message { kind: MessageKind::Reply, ..m }).map_err(BrokerError::Handler));
                true
            }
            _ => false,
        }
    }
}
