//! A shared-nothing cluster, Kestrel's way: N independent servers that never talk to each other,
//! and a client that spreads the work over them. A producer offers to any server (in turn, or
//! the one a key ranks first), a consumer takes from all of them; ordering holds per server only.
//!
//! Failures are the client's business here. A server that refuses connections, stops answering
//! within `request_timeout` or drops the connection is marked down: its connection is closed
//! (so what it handed out tentatively goes back to its queue), it is tried again in the
//! background with a doubling pause, and meanwhile its share goes to the others. An offer whose
//! answer was lost is sent again to the next server: at least once. A message offered with an
//! idempotency key can then exist on two servers; the server that got it twice drops the second
//! itself (its dedup window), and copies on two servers are told apart here, on the consuming
//! side: a key delivered from one server and then from another is a copy, acknowledged on its
//! server and not handed to the caller (within a window of keys, by count and by time). Only
//! this client's own deliveries are compared: two consumer processes can each get one copy.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::sync::{Notify, mpsc};

use crate::{
    Client, ClientError, ClientOptions, CompactString, Delivery, Message, PollOptions, QueueConfig, QueueStats,
    Request, Response, StartFrom, Status, Subscription,
};

/// How a cluster reaches its servers and how patient it is with them.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// TLS, credentials and compression, the same for every server.
    pub client: ClientOptions,
    /// A request unanswered this long (past whatever wait it asked for itself, such as a long
    /// poll's) marks its server down. Reconnection attempts wait at most this long too.
    pub request_timeout: Duration,
    /// The pause before a down server is tried again; it doubles with each failed attempt, up to
    /// `max_pause`.
    pub first_pause: Duration,
    pub max_pause: Duration,
    /// Idempotency keys this client remembers from its deliveries, to tell a copy on a second
    /// server from its original (0: no such check).
    pub duplicate_window: usize,
    /// How long a key is remembered.
    pub duplicate_window_time: Duration,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            client: ClientOptions { connect_timeout: Duration::from_secs(1), ..ClientOptions::default() },
            request_timeout: Duration::from_millis(500),
            first_pause: Duration::from_millis(100),
            max_pause: Duration::from_secs(5),
            duplicate_window: 100_000,
            duplicate_window_time: Duration::from_secs(600),
        }
    }
}

/// Where an offer went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offered {
    /// The server's place in the cluster's list.
    pub server: usize,
    /// The id of the first message, on that server.
    pub first_id: u64,
    /// Messages not stored there because they repeat an idempotency key it remembers.
    pub repeats: u32,
}

/// What acknowledges a delivery: its server, the connection it came on, and the server's handle.
/// A handle from a connection since lost counts for nothing (the message went back to its queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClusterHandle {
    pub server: usize,
    connection: u64,
    pub handle: u64,
}

/// A message taken from one of the cluster's servers.
#[derive(Clone, Debug)]
pub struct ClusterDelivery {
    pub handle: ClusterHandle,
    pub message: Message,
}

/// One server as the cluster sees it.
#[derive(Clone, Debug)]
pub struct ServerState {
    pub addr: String,
    pub up: bool,
    /// Why it was last marked down.
    pub last_error: Option<String>,
    /// How many times it was marked down.
    pub failures: u64,
    /// Functions the cluster serves that this server refused to serve (a user without the
    /// right there, say), each with its answer: when `serve` was called, or when the server
    /// last came back after a loss (each is asked again then).
    pub unserved: Vec<(String, String)>,
}

/// The cluster's own counts.
#[derive(Clone, Debug, Default)]
pub struct ClusterStats {
    pub servers: Vec<ServerState>,
    /// Offers sent again to another server after their answer was lost.
    pub offers_retried: u64,
    /// Deliveries dropped as copies of a message already delivered from another server.
    pub copies_dropped: u64,
}

/// A function's handler as the cluster keeps it, to serve it again on a server that comes back.
type Handler =
    Arc<dyn Fn(Message) -> std::pin::Pin<Box<dyn Future<Output = Result<Message, String>> + Send>> + Send + Sync>;

/// A server's connection: present while it is up. `connection` counts connections made, so a
/// failure seen on an old one does not mark a newer one down.
#[derive(Default)]
struct Link {
    client: Option<Client>,
    connection: u64,
    reconnecting: bool,
    last_error: Option<String>,
    failures: u64,
    /// `ServerState::unserved`.
    unserved: Vec<(String, String)>,
}

impl Link {
    /// Notes how serving `function` here went (`refusal`: why it is not served, if it is not).
    fn served(&mut self, function: &str, refusal: Option<String>) {
        self.unserved.retain(|(f, _)| f != function);
        if let Some(why) = refusal {
            self.unserved.push((function.to_owned(), why));
        }
    }
}

struct Member {
    addr: String,
    link: Mutex<Link>,
}

/// Deliveries of one kind of poll (queue, visibility) that arrived from waiting polls, and which
/// servers have such a poll waiting.
#[derive(Default)]
struct Parked {
    /// With when they were taken: kept past half their visibility timeout, they are given back
    /// (`sweep_later`).
    arrived: VecDeque<(Instant, ClusterDelivery)>,
    /// A task gives back what `arrived` keeps too long.
    sweeping: bool,
    waiting: HashSet<usize>,
    /// Callers of `poll` waiting for arrivals.
    callers: usize,
}

/// Counts a caller of `poll` among those waiting for `key`'s arrivals while it lives (also when
/// the caller's future is dropped).
struct WaitingCaller<'a> {
    shared: &'a Shared,
    key: &'a (String, u32),
}

impl<'a> WaitingCaller<'a> {
    fn new(shared: &'a Shared, key: &'a (String, u32)) -> Self {
        lock(&shared.parked).entry(key.clone()).or_default().callers += 1;
        WaitingCaller { shared, key }
    }
}

impl Drop for WaitingCaller<'_> {
    fn drop(&mut self) {
        if let Some(p) = lock(&self.shared.parked).get_mut(self.key) {
            p.callers -= 1;
        }
    }
}

/// Most messages one waiting poll asks a server for (it asks for what its callers want).
const MAX_PARKED: u32 = 1024;
/// The visibility timeout under which the cluster takes messages for a poll that takes them for
/// good (none of its own): they are acknowledged before they are handed to the caller, so that what
/// the cluster holds beyond them (kept for the next polls, or brought by a waiting poll after its
/// caller left) goes back to its queue if this process ends, instead of being lost.
const HELD_FOR_GOOD: Duration = Duration::from_secs(60);

/// What a turn among the servers is taken for: each kind of request goes round on its own, so
/// that a producer that offers and publishes (or polls and offers) in turn does not send every
/// offer to the same server.
#[derive(Clone, Copy)]
enum Turn {
    Offer,
    Poll,
    Publish,
    Call,
}

struct Shared {
    members: Vec<Member>,
    options: ClusterOptions,
    /// The next server in turn, per `Turn`.
    next: [AtomicUsize; 4],
    /// Rung when a server comes up or a waiting poll brings deliveries.
    changed: Notify,
    parked: Mutex<HashMap<(String, u32), Parked>>,
    seen: Mutex<SeenKeys>,
    served: Mutex<Vec<(String, Handler)>>,
    offers_retried: AtomicU64,
    copies_dropped: AtomicU64,
    /// Set by `Cluster::close`: no request is sent and no server reconnected after it.
    closed: AtomicBool,
}

impl Drop for Shared {
    /// The last handle is gone: close every connection (functions served on them stop).
    fn drop(&mut self) {
        for m in &self.members {
            if let Some(client) = lock(&m.link).client.take() {
                client.close();
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Server `i`'s connection, if it is up (none for a server this cluster does not have: a
    /// handle of another cluster's counts for nothing, as one of a lost connection does).
    fn current(&self, i: usize) -> Option<(Client, u64)> {
        let link = lock(&self.members.get(i)?.link);
        link.client.as_ref().map(|c| (c.clone(), link.connection))
    }

    /// Marks server `i` down after `error` on connection `connection` (unless a newer one is
    /// up already), closes that connection, and starts trying it again.
    fn mark_down(self: &Arc<Self>, i: usize, connection: u64, error: &ClientError) {
        let mut link = lock(&self.members[i].link);
        if link.connection != connection || link.client.is_none() {
            return;
        }
        if let Some(client) = link.client.take() {
            client.close();
        }
        link.failures += 1;
        link.last_error = Some(error.to_string());
        if !link.reconnecting && !self.closed.load(Ordering::Acquire) {
            link.reconnecting = true;
            tokio::spawn(reconnect(Arc::downgrade(self), i));
        }
    }

    /// Runs `request` on server `i`'s connection within the request timeout plus `wait`; a lost
    /// connection or no answer marks the server down.
    async fn on<T>(
        self: &Arc<Self>,
        i: usize,
        connection: u64,
        wait: Duration,
        request: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        let limit = self.options.request_timeout + wait;
        let result = crate::answer_within(limit, &self.members[i].addr, request).await;
        if let Err(e) = &result
            && e.is_connection_lost()
        {
            self.mark_down(i, connection, e);
        }
        result
    }

    /// The servers in the order to try them for `turn`: by rendezvous rank for a key (so a key
    /// stays on its server while that one is up, and adding a server moves only the keys it
    /// wins), else in turn from the next one.
    fn order(&self, key: Option<&[u8]>, turn: Turn) -> Vec<usize> {
        let n = self.members.len();
        match key {
            Some(key) => rank(key, self.members.iter().map(|m| m.addr.as_str())),
            None => {
                let start = self.next[turn as usize].fetch_add(1, Ordering::Relaxed);
                (0..n).map(|k| (start + k) % n).collect()
            }
        }
    }

    /// Waits up to the request timeout for any server to come up; false if none did.
    async fn wait_for_any(&self) -> bool {
        let deadline = tokio::time::Instant::now() + self.options.request_timeout;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.closed.load(Ordering::Acquire) {
                return false;
            }
            if (0..self.members.len()).any(|i| self.current(i).is_some()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return false;
            }
        }
    }

    /// Why no server could be used: each one's last error.
    fn unavailable(&self) -> ClientError {
        if self.closed.load(Ordering::Acquire) {
            return ClientError::Closed;
        }
        let reasons: Vec<String> = self
            .members
            .iter()
            .map(|m| {
                let link = lock(&m.link);
                format!("{}: {}", m.addr, link.last_error.as_deref().unwrap_or("down"))
            })
            .collect();
        ClientError::Unavailable(format!("no server is up ({})", reasons.join("; ")))
    }

    /// Sends `request` to the first server in `order` that answers; a server that fails before
    /// answering is marked down and the next one tried. `next_on` says which answers also pass
    /// the request on (a full queue, a function not served there). `Err` carries the last answer
    /// or, if none came, why no server was available.
    async fn first_answer(
        self: &Arc<Self>,
        order: &[usize],
        request: &Request,
        wait: Duration,
        next_on: impl Fn(&ClientError) -> bool,
    ) -> Result<(usize, Response), ClientError> {
        let mut last = None;
        for attempt in 0..2 {
            for &i in order {
                let Some((client, connection)) = self.current(i) else { continue };
                match self.on(i, connection, wait, client.request(request)).await {
                    Ok(response) => return Ok((i, response)),
                    Err(e) if e.is_connection_lost() => {
                        if matches!(request, Request::Offer { .. }) {
                            self.offers_retried.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(e) if next_on(&e) => last = Some(e),
                    Err(e) => return Err(e),
                }
            }
            if let Some(e) = last {
                return Err(e);
            }
            // None was up, or every one was lost on the way: wait a moment for one, once.
            if attempt == 0 && !Box::pin(self.wait_for_any()).await {
                break;
            }
        }
        Err(self.unavailable())
    }

    /// Sends `request` to every server that is up, at once.
    async fn to_all(self: &Arc<Self>, request: &Request) -> Vec<(usize, Result<Response, ClientError>)> {
        let sends = (0..self.members.len()).map(|i| async move {
            let result = match self.current(i) {
                Some((client, connection)) => self.on(i, connection, Duration::ZERO, client.request(request)).await,
                None => Err(ClientError::Unavailable(format!(
                    "{}: {}",
                    self.members[i].addr,
                    lock(&self.members[i].link).last_error.as_deref().unwrap_or("down")
                ))),
            };
            (i, result)
        });
        join_all(sends).await
    }

    /// Keeps the deliveries that are not copies of one already delivered from another server;
    /// copies are acknowledged on their server (if taken tentatively) and counted.
    fn drop_copies(self: &Arc<Self>, queue: &str, deliveries: Vec<ClusterDelivery>) -> Vec<ClusterDelivery> {
        if self.options.duplicate_window == 0 || deliveries.iter().all(|d| d.message.idempotency_key.is_empty()) {
            return deliveries;
        }
        let mut copies = Vec::new();
        let kept: Vec<ClusterDelivery> = {
            let mut seen = lock(&self.seen);
            deliveries
                .into_iter()
                .filter_map(|d| {
                    if d.message.idempotency_key.is_empty() || seen.first_from(queue, &d, &self.options) {
                        return Some(d);
                    }
                    copies.push(d.handle);
                    None
                })
                .collect()
        };
        if !copies.is_empty() {
            self.copies_dropped.fetch_add(copies.len() as u64, Ordering::Relaxed);
            let tentative: Vec<ClusterHandle> = copies.into_iter().filter(|h| h.handle != 0).collect();
            if !tentative.is_empty() {
                let (shared, queue) = (Arc::clone(self), queue.to_owned());
                tokio::spawn(async move {
                    let _ = settle(&shared, &queue, &tentative, Settle::Ack).await;
                });
            }
        }
        kept
    }
}

/// A number that differs from one client to the next (std's per-process random hash keys).
fn random_start() -> usize {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish() as usize
}

/// The servers (their places in `addrs`) ranked for `key`, best first: each server's score is a
/// hash of the key seeded by its address (xxh3, the same in every process and version, so
/// producers agree on where a key goes).
fn rank<'a>(key: &[u8], addrs: impl Iterator<Item = &'a str>) -> Vec<usize> {
    let score = |addr: &str| xxhash_rust::xxh3::xxh3_64_with_seed(key, xxhash_rust::xxh3::xxh3_64(addr.as_bytes()));
    let mut ranked: Vec<(u64, usize)> = addrs.enumerate().map(|(i, a)| (score(a), i)).collect();
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked.into_iter().map(|(_, i)| i).collect()
}

/// Marks server `i` down as soon as its connection `connection` ends, whether a request of
/// this client finds it lost or not: a client that only serves functions sends nothing, and its
/// functions would stay unserved there after the server restarted.
async fn watch(shared: Weak<Shared>, i: usize, connection: u64, client: Client) {
    client.closed().await;
    if let Some(shared) = shared.upgrade() {
        shared.mark_down(i, connection, &ClientError::Closed);
    }
}

/// Tries server `i` again with a doubling pause until it answers HELLO (and AUTH), then serves
/// the cluster's functions on it. Ends when the cluster is dropped.
async fn reconnect(shared: Weak<Shared>, i: usize) {
    let Some(first) = shared.upgrade() else { return };
    let (mut pause, max_pause) = (first.options.first_pause, first.options.max_pause);
    drop(first);
    loop {
        tokio::time::sleep(pause).await;
        let Some(shared) = shared.upgrade() else { return };
        let mut options = shared.options.client.clone();
        options.connect_timeout =
            options.connect_timeout.min(shared.options.request_timeout.max(Duration::from_millis(1)));
        let addr = shared.members[i].addr.clone();
        match Client::connect_with(&addr, &options).await {
            Ok(_) if shared.closed.load(Ordering::Acquire) => return,
            Ok(client) => {
                let served = lock(&shared.served).clone();
                let mut outcomes = Vec::with_capacity(served.len());
                // (A server just back may be slow for a moment: some patience before it is
                // taken for not answering.)
                let limit = shared.options.request_timeout.max(Duration::from_secs(5));
                let mut answers = true;
                for (function, handler) in served {
                    let outcome =
                        crate::answer_within(limit, &addr, client.serve(&function, move |m| handler(m))).await;
                    // A server that does not answer (or was lost again) is not up: tried again.
                    answers &= !outcome.as_ref().is_err_and(ClientError::is_connection_lost);
                    outcomes.push((function, outcome.err().map(|e| e.to_string())));
                }
                if !answers {
                    client.close();
                    lock(&shared.members[i].link).last_error = Some(format!("{addr} did not answer SERVE"));
                    pause = (pause * 2).min(max_pause);
                    continue;
                }
                {
                    let mut link = lock(&shared.members[i].link);
                    for (function, refusal) in outcomes {
                        link.served(&function, refusal);
                    }
                    // `close` takes the links' connections under this lock, so a connection
                    // made as it closed is closed here rather than kept.
                    if shared.closed.load(Ordering::Acquire) {
                        client.close();
                        return;
                    }
                    link.connection += 1;
                    tokio::spawn(watch(Arc::downgrade(&shared), i, link.connection, client.clone()));
                    link.client = Some(client);
                    link.reconnecting = false;
                }
                shared.changed.notify_waiters();
                return;
            }
            Err(e) => {
                lock(&shared.members[i].link).last_error = Some(e.to_string());
                pause = (pause * 2).min(max_pause);
            }
        }
    }
}

/// What to do with tentative deliveries.
#[derive(Clone, Copy)]
enum Settle {
    Ack,
    Abort(Duration),
    /// Back to the head as never handed out (the application never saw them: kept past their
    /// time, or still kept at the end), on a server that takes them so; else as `Abort`.
    GiveBack,
}

impl Settle {
    /// The request that settles `handles` of `queue` on one server, through `client`.
    fn request(self, client: &Client, queue: &str, handles: Vec<u64>) -> Request {
        let queue = queue.into();
        match self {
            Settle::Ack => Request::Ack { queue, handles },
            Settle::Abort(delay) => {
                let delay_ms = delay.as_millis().min(u128::from(u32::MAX)) as u32;
                Request::Abort { queue, handles, delay_ms, unseen: false }
            }
            Settle::GiveBack => Request::Abort { queue, handles, delay_ms: 0, unseen: client.returns_unseen() },
        }
    }
}

/// How long a delivery taken for polls of `key` stays with its server before it goes back (a
/// poll for good holds its deliveries tentatively, for `HELD_FOR_GOOD`).
fn kept_visibility(key: &(String, u32)) -> Duration {
    match key.1 {
        0 => HELD_FOR_GOOD,
        ms => Duration::from_millis(u64::from(ms)),
    }
}

/// Gives back what `key`'s arrivals keep past half their visibility, when that comes, as never
/// handed out: without it they waited for the next poll of the key, which may never come, and
/// their server took them back at their timeout as delivered (towards `max_deliveries`, and a
/// dead-letter queue, though the application never saw them). One task a key while it keeps
/// any, holding the cluster only weakly.
fn sweep_later(shared: &Arc<Shared>, key: &(String, u32)) {
    {
        let mut parked = lock(&shared.parked);
        let Some(p) = parked.get_mut(key) else { return };
        if p.sweeping || p.arrived.is_empty() {
            return;
        }
        p.sweeping = true;
    }
    let (weak, key) = (Arc::downgrade(shared), key.clone());
    let limit = kept_visibility(&key) / 2;
    tokio::spawn(async move {
        loop {
            let next = {
                let Some(shared) = weak.upgrade() else { return };
                let mut parked = lock(&shared.parked);
                let Some(p) = parked.get_mut(&key) else { return };
                let mut stale = Vec::new();
                while let Some((at, _)) = p.arrived.front()
                    && at.elapsed() > limit
                {
                    stale.extend(p.arrived.pop_front().map(|(_, d)| d));
                }
                let next = p.arrived.front().map(|(at, _)| *at + limit);
                p.sweeping = next.is_some();
                drop(parked);
                settle_unanswered(&shared, &key.0, &stale, Settle::GiveBack);
                next
            };
            let Some(next) = next else { return };
            tokio::time::sleep_until((next + Duration::from_millis(1)).into()).await;
        }
    });
}

/// Acknowledges or returns `handles`, each on its own server, all servers at once. Handles of a
/// connection since lost count for nothing (their messages went back to their queues).
/// `settle` without waiting for the answers, each server's on its current connection (those of
/// an ended connection went back already).
fn settle_unanswered(shared: &Shared, queue: &str, deliveries: &[ClusterDelivery], how: Settle) {
    let mut by_server: HashMap<(usize, u64), Vec<u64>> = HashMap::new();
    for d in deliveries {
        by_server.entry((d.handle.server, d.handle.connection)).or_default().push(d.handle.handle);
    }
    for ((i, connection), handles) in by_server {
        let Some((client, current)) = shared.current(i) else { continue };
        if current != connection {
            continue;
        }
        let request = how.request(&client, queue, handles);
        client.send_unanswered(&request);
    }
}

async fn settle(shared: &Arc<Shared>, queue: &str, handles: &[ClusterHandle], how: Settle) -> Result<u32, ClientError> {
    let send = |(i, (connection, handles)): (usize, (u64, Vec<u64>))| async move {
        let Some((client, current)) = shared.current(i) else { return Ok(0) };
        if current != connection {
            return Ok(0);
        }
        let request = how.request(&client, queue, handles);
        match shared.on(i, connection, Duration::ZERO, client.request(&request)).await {
            Ok(Response::Acked { count }) => Ok(count),
            Ok(other) => Err(crate::unexpected(other)),
            Err(e) if e.is_connection_lost() => Ok(0),
            Err(e) => Err(e),
        }
    };
    // All from one server (a poll's usually are): one request, awaited as it is.
    if let Some(first) = handles.first()
        && handles.iter().all(|h| h.server == first.server && h.connection == first.connection)
    {
        return send((first.server, (first.connection, handles.iter().map(|h| h.handle).collect()))).await;
    }
    // By server and connection: a server's handles from an earlier connection count nothing
    // (`send`), and must not keep those of its current one from being sent.
    let mut by_connection: HashMap<(usize, u64), Vec<u64>> = HashMap::new();
    for h in handles {
        by_connection.entry((h.server, h.connection)).or_default().push(h.handle);
    }
    let mut total = 0;
    let requests = by_connection.into_iter().map(|((server, connection), handles)| (server, (connection, handles)));
    for result in join_all(requests.map(send)).await {
        total += result?;
    }
    Ok(total)
}

/// Idempotency keys delivered lately, with the server each came from first; bounded by count
/// and by age (oldest forgotten first).
#[derive(Default)]
struct SeenKeys {
    by_key: HashMap<(String, CompactString), usize>,
    order: VecDeque<(Instant, (String, CompactString))>,
}

impl SeenKeys {
    /// True if `d` is the first delivery of its key or comes from the server that delivered it
    /// first (a redelivery); false for a copy from another server.
    fn first_from(&mut self, queue: &str, d: &ClusterDelivery, options: &ClusterOptions) -> bool {
        let now = Instant::now();
        while let Some((at, _)) = self.order.front()
            && (self.order.len() >= options.duplicate_window || now.duration_since(*at) > options.duplicate_window_time)
        {
            let (_, key) = self.order.pop_front().expect("front exists");
            self.by_key.remove(&key);
        }
        let key = (queue.to_owned(), d.message.idempotency_key.clone());
        match self.by_key.get(&key) {
            Some(&server) => server == d.handle.server,
            None => {
                self.by_key.insert(key.clone(), d.handle.server);
                self.order.push_back((now, key));
                true
            }
        }
    }
}

/// A client of N independent servers. Cheap to clone; dropping the last clone ends its
/// background work (reconnects, waiting polls, subscriptions).
#[derive(Clone)]
pub struct Cluster {
    shared: Arc<Shared>,
}

impl Cluster {
    /// Whether `other` is a handle to this same cluster (clones share everything).
    pub fn is_same(&self, other: &Cluster) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addrs: Vec<&str> = self.shared.members.iter().map(|m| m.addr.as_str()).collect();
        f.debug_struct("Cluster").field("servers", &addrs).finish_non_exhaustive()
    }
}

impl Cluster {
    /// Connects to every server at once. Succeeds if any one answers; the others are tried again
    /// in the background. A refused password or a TLS failure on any server is an error at once
    /// (it is a setting to fix, not a server to wait for), and so is an empty or repeated list.
    pub async fn connect(servers: &[impl AsRef<str>], options: ClusterOptions) -> Result<Cluster, ClientError> {
        let addrs: Vec<String> = servers.iter().map(|s| s.as_ref().trim().to_owned()).collect();
        if addrs.is_empty() || addrs.iter().any(String::is_empty) {
            return Err(ClientError::Invalid("no server address given".into()));
        }
        if addrs.iter().collect::<HashSet<_>>().len() != addrs.len() {
            return Err(ClientError::Invalid(format!("a server is listed twice in {}", addrs.join(","))));
        }
        let connects = addrs.iter().map(|addr| Client::connect_with(addr, &options.client));
        let mut results = join_all(connects).await;
        // A refused password or certificate is a setting to fix, not a server to wait for. (A
        // server that does not answer HELLO, stopped say, is a server to wait for, and so is one
        // at a connection limit: LIMIT_REACHED.)
        let fatal = |r: &Result<Client, ClientError>| match r {
            Err(ClientError::Status { status, .. }) => status != &Status::LimitReached,
            Err(ClientError::Tls(_)) => true,
            _ => false,
        };
        if let Some(at) = results.iter().position(fatal) {
            return Err(match results.swap_remove(at).expect_err("fatal is an error") {
                ClientError::Status { status, message } => {
                    ClientError::Status { status, message: format!("{}: {message}", addrs[at]) }
                }
                other => other,
            });
        }
        if results.iter().all(Result::is_err) {
            if results.len() == 1 {
                return Err(results.pop().expect("one").expect_err("failed"));
            }
            let reasons: Vec<String> =
                results.iter().zip(&addrs).map(|(r, a)| format!("{a}: {}", r.as_ref().expect_err("failed"))).collect();
            return Err(ClientError::Unavailable(format!("no server is up ({})", reasons.join("; "))));
        }
        let mut down = Vec::new();
        let members = results
            .into_iter()
            .zip(addrs)
            .enumerate()
            .map(|(i, (result, addr))| {
                let link = match result {
                    Ok(client) => Link { client: Some(client), connection: 1, ..Link::default() },
                    Err(e) => {
                        down.push(i);
                        Link { reconnecting: true, last_error: Some(e.to_string()), failures: 1, ..Link::default() }
                    }
                };
                Member { addr, link: Mutex::new(link) }
            })
            .collect();
        let shared = Arc::new(Shared {
            members,
            options,
            // Each client starts its turn at a server of its own, so that many short-lived
            // producers (one command each) spread their offers too.
            next: std::array::from_fn(|_| AtomicUsize::new(random_start())),
            changed: Notify::new(),
            parked: Mutex::default(),
            seen: Mutex::default(),
            served: Mutex::default(),
            offers_retried: AtomicU64::new(0),
            copies_dropped: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        });
        for i in down {
            tokio::spawn(reconnect(Arc::downgrade(&shared), i));
        }
        for i in 0..shared.members.len() {
            if let Some((client, connection)) = shared.current(i) {
                tokio::spawn(watch(Arc::downgrade(&shared), i, connection, client));
            }
        }
        Ok(Cluster { shared })
    }

    /// Gives back to their queues, as never handed out, the deliveries polls took beyond what
    /// their callers asked for and kept for the next polls: the application never saw them, so
    /// their delivery is not counted (closing without this returns them as a consumer gone,
    /// counted towards `max_deliveries`). The blocking cluster does it when it is dropped.
    pub async fn give_back_kept(&self) {
        let kept: Vec<(String, Vec<ClusterHandle>)> = lock(&self.shared.parked)
            .iter_mut()
            .map(|((queue, _), p)| (queue.clone(), p.arrived.drain(..).map(|(_, d)| d.handle).collect()))
            .filter(|(_, handles): &(String, Vec<ClusterHandle>)| !handles.is_empty())
            .collect();
        for (queue, handles) in kept {
            let _ = settle(&self.shared, &queue, &handles, Settle::GiveBack).await;
        }
    }

    /// Ends every connection and stops reconnecting: requests fail with `Closed` after it;
    /// tentative deliveries not acknowledged go back to their queues (counted as delivered:
    /// `give_back_kept` first for those the application never saw), functions stop being
    /// served, subscriptions end.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        for m in &self.shared.members {
            let mut link = lock(&m.link);
            if let Some(client) = link.client.take() {
                client.close();
            }
            link.last_error = Some("closed".into());
        }
        self.shared.changed.notify_waiters();
    }

    /// Whether `close` was called.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// The servers, in the order given.
    pub fn servers(&self) -> Vec<String> {
        self.shared.members.iter().map(|m| m.addr.clone()).collect()
    }

    /// Which servers are up, and the cluster's own counts.
    pub fn stats(&self) -> ClusterStats {
        let servers = self
            .shared
            .members
            .iter()
            .map(|m| {
                let link = lock(&m.link);
                ServerState {
                    addr: m.addr.clone(),
                    up: link.client.is_some(),
                    last_error: link.last_error.clone(),
                    failures: link.failures,
                    unserved: link.unserved.clone(),
                }
            })
            .collect();
        ClusterStats {
            servers,
            offers_retried: self.shared.offers_retried.load(Ordering::Relaxed),
            copies_dropped: self.shared.copies_dropped.load(Ordering::Relaxed),
        }
    }

    /// Offers `messages` (all or none) to the next server in turn; one that fails before
    /// answering is marked down and the offer goes to the next (at least once: give the messages
    /// idempotency keys to drop the copies). A full queue passes the offer on too; with a
    /// `timeout`, the last server tried waits that long for room.
    pub async fn offer(
        &self,
        queue: &str,
        messages: Vec<Message>,
        timeout: Option<Duration>,
    ) -> Result<Offered, ClientError> {
        self.offer_to(None, queue, messages, timeout).await
    }

    /// Many offers at once, all to the next server in turn, sent together as `Client::pipeline`
    /// sends them (the next call's go to the next server: spreading by the burst keeps each
    /// server's requests in few writes). An offer that fails before its answer, or finds its
    /// queue full, is then made again as `offer` makes it. One result per offer, in order.
    pub async fn offer_pipelined(&self, queue: &str, offers: Vec<Vec<Message>>) -> Vec<Result<Offered, ClientError>> {
        let shared = &self.shared;
        let mut results: Vec<Option<Result<Offered, ClientError>>> = (0..offers.len()).map(|_| None).collect();
        let requests: Vec<Request> = offers
            .into_iter()
            .map(|messages| Request::Offer { queue: queue.into(), timeout_ms: 0, messages })
            .collect();
        let mut again = Vec::new();
        match shared.order(None, Turn::Offer).into_iter().find_map(|i| shared.current(i).map(|(c, n)| (i, c, n))) {
            None => again = requests.into_iter().enumerate().collect(),
            Some((server, client, connection)) => {
                let answers = match shared
                    .on(server, connection, Duration::ZERO, async { Ok(client.pipeline(&requests).await) })
                    .await
                {
                    Ok(answers) => answers,
                    Err(_) => requests.iter().map(|_| Err(ClientError::Closed)).collect(),
                };
                for (k, (request, answer)) in requests.into_iter().zip(answers).enumerate() {
                    match answer {
                        Ok(Response::Error { status: Status::QueueFull, .. }) => again.push((k, request)),
                        Ok(Response::Error { status, message }) => {
                            results[k] = Some(Err(ClientError::Status { status, message }))
                        }
                        Ok(response) => results[k] = Some(offered(server, response)),
                        Err(e) if e.is_connection_lost() => {
                            shared.mark_down(server, connection, &e);
                            shared.offers_retried.fetch_add(1, Ordering::Relaxed);
                            again.push((k, request));
                        }
                        Err(e) => results[k] = Some(Err(e)),
                    }
                }
            }
        }
        for (k, request) in again {
            let Request::Offer { messages, .. } = request else { unreachable!("offers only") };
            results[k] = Some(self.offer_to(None, queue, messages, None).await);
        }
        results.into_iter().map(|r| r.expect("every offer answered")).collect()
    }

    /// `offer` to the server `key` ranks first among those up (rendezvous hashing): one key's
    /// messages stay in order on one server while it is up.
    pub async fn offer_by_key(
        &self,
        key: &[u8],
        queue: &str,
        messages: Vec<Message>,
        timeout: Option<Duration>,
    ) -> Result<Offered, ClientError> {
        self.offer_to(Some(key), queue, messages, timeout).await
    }

    async fn offer_to(
        &self,
        key: Option<&[u8]>,
        queue: &str,
        messages: Vec<Message>,
        timeout: Option<Duration>,
    ) -> Result<Offered, ClientError> {
        let order = self.shared.order(key, Turn::Offer);
        let full = |e: &ClientError| e.status() == Some(Status::QueueFull);
        // A server without the queue passes the offer on too (one made while it was down): the
        // offer fails for it only if no server has it.
        let passes_on = |e: &ClientError| full(e) || e.status() == Some(Status::QueueNotFound);
        // Every server but the last is asked without waiting, so a full one passes the offer on.
        let mut request = Request::Offer { queue: queue.into(), timeout_ms: 0, messages };
        // One server alone waits for room itself, and its answer is waited for as long.
        let mut wait = Duration::ZERO;
        if let Some(t) = timeout
            && order.len() == 1
        {
            set_offer_timeout(&mut request, t);
            wait = t;
        }
        let missing = |e: &ClientError| e.status() == Some(Status::QueueNotFound);
        match self.shared.first_answer(&order, &request, wait, passes_on).await {
            Ok((server, response)) => offered(server, response),
            // All full, or full where the others lack the queue (the last answer may be either):
            // wait for room on the first in the order that has the queue.
            Err(e) if passes_on(&e) && timeout.is_some() && order.len() > 1 => {
                let wait = timeout.unwrap_or_default();
                set_offer_timeout(&mut request, wait);
                let (server, response) = Box::pin(self.shared.first_answer(&order, &request, wait, missing)).await?;
                offered(server, response)
            }
            Err(e) => Err(e),
        }
    }

    /// Takes up to `options.max` messages from the servers: first from what earlier polls kept,
    /// else from every server that is up at once; with a timeout and nothing there, one waiting
    /// poll on every server (no busy loop). Deliveries beyond `max` are kept for the next poll of
    /// the same queue and visibility (taken tentatively, their visibility runs meanwhile).
    /// Copies of a message already delivered from another server are dropped (see the module's
    /// notes). An empty answer after the timeout is an empty vector; a queue that every server
    /// refuses is that refusal (`QUEUE_NOT_FOUND`); `Unavailable` if no server was up.
    ///
    /// Cancel safety: as `Client::poll`'s. Without a visibility timeout, a poll dropped while its
    /// messages are taken comes back with them later (they wait out a minute's visibility, or
    /// their connection's end), but one dropped while they are being acknowledged loses them;
    /// `poll_for_good_unacknowledged` and `ack` lose nothing.
    pub async fn poll(&self, queue: &str, options: PollOptions) -> Result<Vec<ClusterDelivery>, ClientError> {
        let for_good = options.visibility.is_none();
        let taken = match for_good {
            true => self.poll_for_good_unacknowledged(queue, options).await?,
            false => self.poll_held(queue, options, false).await?,
        };
        if for_good {
            // Taken for good once this returns (one round trip more; one lost connection's
            // messages went back to their queue and may come again: at least once).
            let handles: Vec<ClusterHandle> = taken.iter().map(|d| d.handle).collect();
            let _ = settle(&self.shared, queue, &handles, Settle::Ack).await;
        }
        Ok(taken)
    }

    /// A poll for good's messages, taken tentatively and not yet acknowledged (`options`'
    /// visibility is not used): for a caller that acknowledges them itself (`ack`) once they are
    /// in hand, so that being cut short in between (a signal) loses nothing. What it keeps for
    /// later is kept with what `poll` for good keeps.
    pub async fn poll_for_good_unacknowledged(
        &self,
        queue: &str,
        options: PollOptions,
    ) -> Result<Vec<ClusterDelivery>, ClientError> {
        self.poll_held(queue, PollOptions { visibility: Some(HELD_FOR_GOOD), ..options }, true).await
    }

    /// `poll`, under a visibility timeout always (`for_good`: the caller's poll had none, and
    /// what it takes is acknowledged as it is handed over).
    async fn poll_held(
        &self,
        queue: &str,
        options: PollOptions,
        for_good: bool,
    ) -> Result<Vec<ClusterDelivery>, ClientError> {
        let shared = &self.shared;
        let visibility_ms = match for_good {
            true => 0,
            false => options.visibility.map_or(0, |v| v.as_millis().clamp(1, u128::from(u32::MAX)) as u32),
        };
        let key = (queue.to_owned(), visibility_ms);
        let deadline = tokio::time::Instant::now() + options.timeout;
        let max = options.max.max(1) as usize;
        let now_options = PollOptions { timeout: Duration::ZERO, ..options };
        let mut first = true;
        let mut refused = HashSet::new();
        let mut any_up = false;
        loop {
            // Rung by arrivals and servers coming up: listened to from before the arrivals are
            // looked at, so that none is missed — but only once a poll may wait (the first pass
            // takes what is there; registering with `changed` costs a lock that 64 polls in
            // flight would share).
            let changed = shared.changed.notified();
            tokio::pin!(changed);
            if !first {
                changed.as_mut().enable();
            }
            let arrived = self.take_arrived(&key, max);
            if !arrived.is_empty() {
                return Ok(arrived);
            }
            if first {
                first = false;
                let up: Vec<(usize, Client, u64)> = shared
                    .order(None, Turn::Poll)
                    .into_iter()
                    .filter_map(|i| shared.current(i).map(|(c, n)| (i, c, n)))
                    .collect();
                any_up = !up.is_empty();
                // The next server in turn alone first, asked for what every server up would
                // have been asked for together (`max` each): while it has messages, a poll is
                // one request, what comes beyond `max` is kept for the next polls, and their
                // acknowledgements go to one server. Only when it has none are the others
                // asked, all at once (one round trip).
                let prefetch = PollOptions {
                    max: now_options.max.saturating_mul(up.len().max(1) as u32).min(MAX_PARKED),
                    ..now_options
                };
                let mut first_refusal = None;
                let (next, others) = up.split_at(up.len().min(1));
                for (servers, options) in [(next, prefetch), (others, now_options)] {
                    let mut taken = self.poll_now(queue, servers, options, &mut refused, &mut first_refusal).await;
                    if taken.is_empty() {
                        continue;
                    }
                    if taken.len() > max {
                        let now = Instant::now();
                        let kept = taken.drain(max..).map(|d| (now, d));
                        lock(&shared.parked).entry(key.clone()).or_default().arrived.extend(kept);
                        sweep_later(shared, &key);
                        shared.changed.notify_waiters();
                    }
                    let taken = shared.drop_copies(queue, taken);
                    if !taken.is_empty() {
                        return Ok(taken);
                    }
                    break; // only copies came: look at the arrivals again
                }
                if let Some(e) = first_refusal
                    && refused.len() == up.len()
                {
                    return Err(e);
                }
                // Look again, now listening for arrivals, before waiting.
                continue;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                if any_up || (0..shared.members.len()).any(|i| shared.current(i).is_some()) {
                    return Ok(Vec::new());
                }
                return Err(shared.unavailable());
            }
            let _waiting = WaitingCaller::new(shared, &key);
            self.park(&key, PollOptions { timeout: deadline - now, ..options }, &refused);
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }

    /// Polls `servers` at once without waiting; a server that refuses (no such queue there, not
    /// allowed) goes into `refused`, and the first refusal into `first_refusal`.
    async fn poll_now(
        &self,
        queue: &str,
        servers: &[(usize, Client, u64)],
        options: PollOptions,
        refused: &mut HashSet<usize>,
        first_refusal: &mut Option<ClientError>,
    ) -> Vec<ClusterDelivery> {
        let shared = &self.shared;
        async fn poll(
            shared: &Arc<Shared>,
            queue: &str,
            (i, client, connection): &(usize, Client, u64),
            options: PollOptions,
        ) -> (usize, u64, Result<Vec<Delivery>, ClientError>) {
            (*i, *connection, shared.on(*i, *connection, Duration::ZERO, client.poll(queue, options)).await)
        }
        // One server (the common case) is awaited as it is: `join_all` would move each poll's
        // whole future in and out of its slots, a cost per request that showed in profiles.
        let answers = match servers {
            [one] => vec![poll(shared, queue, one, options).await],
            _ => join_all(servers.iter().map(|s| poll(shared, queue, s, options))).await,
        };
        let mut taken = Vec::new();
        for (i, connection, answer) in answers {
            match answer {
                Ok(t) => taken.extend(deliveries(i, connection, t)),
                Err(e) if !e.is_connection_lost() => {
                    refused.insert(i);
                    first_refusal.get_or_insert(e);
                }
                Err(_) => {}
            }
        }
        taken
    }

    /// Up to `max` deliveries that waiting polls brought for `key`, copies dropped. Those kept
    /// past half their visibility timeout are given back to their queues (handed out so late,
    /// their server might hand them to another meanwhile), and those of a connection that has
    /// ended went back already.
    fn take_arrived(&self, key: &(String, u32), max: usize) -> Vec<ClusterDelivery> {
        let visibility = kept_visibility(key);
        let mut stale = Vec::new();
        let taken: Vec<ClusterDelivery> = {
            let mut parked = lock(&self.shared.parked);
            let Some(p) = parked.get_mut(key) else { return Vec::new() };
            let mut taken = Vec::new();
            while taken.len() < max
                && let Some((at, d)) = p.arrived.pop_front()
            {
                let current = self.shared.current(d.handle.server).map(|(_, c)| c);
                if current != Some(d.handle.connection) {
                    continue;
                }
                match at.elapsed() > visibility / 2 {
                    true => stale.push(d),
                    false => taken.push(d),
                }
            }
            taken
        };
        // Never seen by the application: their delivery is not counted.
        settle_unanswered(&self.shared, &key.0, &stale, Settle::GiveBack);
        if taken.is_empty() { taken } else { self.shared.drop_copies(&key.0, taken) }
    }

    /// Starts a waiting poll on every server that is up, not `refused`, and has none waiting for
    /// `key`, for as many messages as the callers waiting want (at most `MAX_PARKED`); what it
    /// brings goes to the arrivals and rings `changed`.
    fn park(&self, key: &(String, u32), options: PollOptions, refused: &HashSet<usize>) {
        for i in 0..self.shared.members.len() {
            if refused.contains(&i) {
                continue;
            }
            let Some((client, connection)) = self.shared.current(i) else { continue };
            let options = {
                let mut parked = lock(&self.shared.parked);
                let p = parked.entry(key.clone()).or_default();
                if !p.waiting.insert(i) {
                    continue;
                }
                let wanted = (p.callers as u32).saturating_mul(options.max.max(1)).clamp(1, MAX_PARKED);
                PollOptions { max: wanted, ..options }
            };
            let (shared, key) = (Arc::downgrade(&self.shared), key.clone());
            let strong = Arc::clone(&self.shared);
            tokio::spawn(async move {
                let taken = strong.on(i, connection, options.timeout, client.poll(&key.0, options)).await;
                drop(strong);
                if taken.as_ref().is_err_and(|e| !e.is_connection_lost()) {
                    // Refused at once (the queue went away there): hold the slot for the wait
                    // it was asked for, so that callers do not ask again and again.
                    tokio::time::sleep(options.timeout).await;
                }
                let Some(shared) = shared.upgrade() else { return };
                {
                    let mut parked = lock(&shared.parked);
                    let p = parked.entry(key.clone()).or_default();
                    p.waiting.remove(&i);
                    if let Ok(taken) = taken {
                        let now = Instant::now();
                        p.arrived.extend(deliveries(i, connection, taken).into_iter().map(|d| (now, d)));
                    }
                }
                sweep_later(&shared, &key);
                shared.changed.notify_waiters();
            });
        }
    }

    /// Acknowledges deliveries, each on its server; returns how many counted (those of a lost
    /// connection do not: they went back to their queue and come again).
    pub async fn ack(&self, queue: &str, handles: &[ClusterHandle]) -> Result<u32, ClientError> {
        settle(&self.shared, queue, handles, Settle::Ack).await
    }

    /// Returns deliveries to their queues, to be handed out again after `delay` (zero: at once,
    /// or after the queue's redelivery delay).
    pub async fn abort(&self, queue: &str, handles: &[ClusterHandle], delay: Duration) -> Result<u32, ClientError> {
        settle(&self.shared, queue, handles, Settle::Abort(delay)).await
    }

    /// Gives back deliveries the application never saw, each to its server, as
    /// `Client::give_back_unseen` does: back at the head, their delivery not counted.
    pub async fn give_back_unseen(&self, queue: &str, handles: &[ClusterHandle]) -> Result<u32, ClientError> {
        settle(&self.shared, queue, handles, Settle::GiveBack).await
    }

    /// Creates the queue on every server (a no-op where it exists alike). An error names the
    /// servers that failed and those that made it (`on_all`).
    pub async fn create_queue(&self, name: &str, config: QueueConfig) -> Result<(), ClientError> {
        self.on_all(&Request::QueueCreate { name: name.into(), config: Box::new(config) }).await
    }

    /// Removes the queue from every server.
    pub async fn remove_queue(&self, name: &str) -> Result<(), ClientError> {
        self.on_all(&Request::QueueRemove { name: name.into() }).await.map(|_| ())
    }

    /// The queues of the servers that are up, each name once, sorted.
    pub async fn list_queues(&self) -> Result<Vec<String>, ClientError> {
        self.union(&Request::QueueList).await
    }

    /// The queue's figures on each server (an error for one down or without it).
    pub async fn queue_status(&self, name: &str) -> Vec<(String, Result<QueueStats, ClientError>)> {
        let request = Request::QueueStatus { name: name.into() };
        self.shared
            .to_all(&request)
            .await
            .into_iter()
            .map(|(i, r)| {
                let stats = match r {
                    Ok(Response::QueueStatus { stats }) => Ok(*stats),
                    Ok(other) => Err(crate::unexpected(other)),
                    Err(e) => Err(e),
                };
                (self.shared.members[i].addr.clone(), stats)
            })
            .collect()
    }

    /// Creates the topic on every server.
    pub async fn create_topic(&self, name: &str, durable: bool) -> Result<(), ClientError> {
        self.on_all(&Request::TopicCreate { name: name.into(), durable }).await.map(|_| ())
    }

    /// Removes the topic from every server.
    pub async fn remove_topic(&self, name: &str) -> Result<(), ClientError> {
        self.on_all(&Request::TopicRemove { name: name.into() }).await.map(|_| ())
    }

    /// The topics of the servers that are up, each name once, sorted.
    pub async fn list_topics(&self) -> Result<Vec<String>, ClientError> {
        self.union(&Request::TopicList).await
    }

    /// Publishes to one server (the next in turn; the next after it if it fails before
    /// answering): its subscribers get the messages, and every cluster subscriber is one of
    /// them. Returns how many subscribers that server reached.
    pub async fn publish(&self, topic: &str, messages: Vec<Message>) -> Result<u32, ClientError> {
        let request = Request::Publish { topic: topic.into(), messages };
        match self
            .shared
            .first_answer(&self.shared.order(None, Turn::Publish), &request, Duration::ZERO, |_| false)
            .await?
        {
            (_, Response::Published { subscribers }) => Ok(subscribers),
            (_, other) => Err(crate::unexpected(other)),
        }
    }

    /// Subscribes to `topic` on every server, and again on each one that comes back after a
    /// loss (a live subscription: what was published there meanwhile is missed). `buffer` as
    /// for `Client::subscribe`, per server.
    pub async fn subscribe(&self, topic: &str, buffer: u32) -> Result<ClusterSubscription, ClientError> {
        self.follow(topic, None, buffer).await
    }

    /// Reads a durable topic as consumer group `group` on every server (each server's log and
    /// cursor are its own): from `from` at first, and where the group stands on a server that
    /// comes back after a loss (what it had delivered and not acknowledged comes again: at
    /// least once). `max_unacked` as for `Client::subscribe_group`, per server. Take messages
    /// with `next_delivery` and acknowledge them with `ClusterSubscription::ack`.
    pub async fn subscribe_group(
        &self,
        topic: &str,
        group: &str,
        from: StartFrom,
        max_unacked: u32,
    ) -> Result<ClusterSubscription, ClientError> {
        self.follow(topic, Some((group.to_owned(), from)), max_unacked).await
    }

    async fn follow(
        &self,
        topic: &str,
        group: Option<(String, StartFrom)>,
        buffer: u32,
    ) -> Result<ClusterSubscription, ClientError> {
        let n = self.shared.members.len();
        let (tx, rx) = mpsc::channel(crate::SUBSCRIPTION_BUFFER);
        let (ready_tx, mut ready_rx) = mpsc::channel(n);
        let current: Arc<Mutex<Vec<Option<Following>>>> = Arc::new(Mutex::new(vec![None; n]));
        let tasks = (0..n)
            .map(|i| {
                let follow = FollowTopic {
                    shared: Arc::clone(&self.shared),
                    i,
                    topic: topic.to_owned(),
                    group: group.clone(),
                    buffer,
                    current: Arc::clone(&current),
                    missing: false,
                };
                tokio::spawn(follow.run(tx.clone(), ready_tx.clone()))
            })
            .collect();
        drop(ready_tx);
        // Answer once each server has answered its first SUBSCRIBE (or was down): the first
        // error is the caller's (a topic that does not exist, a forbidden one).
        let request_timeout = self.shared.options.request_timeout;
        let subscription = ClusterSubscription { rx, tasks, current, request_timeout };
        while let Some(first) = ready_rx.recv().await {
            first?;
        }
        Ok(subscription)
    }

    /// Calls `function` on the next server in turn that serves it (a server that does not
    /// serve it, or fails before answering, passes the call on: a call whose answer was lost may
    /// run twice — give it a request id its handler can check).
    pub async fn call(
        &self,
        function: &str,
        message: Message,
        timeout: Option<Duration>,
    ) -> Result<Message, ClientError> {
        // Always a timeout of its own: the server's default (`default_call_timeout_ms`) may be
        // longer than what this waits, and a server still running a call would be taken for
        // down and the call made again elsewhere.
        let wait = timeout.unwrap_or(Duration::from_secs(30));
        let timeout_ms = wait.as_millis().clamp(1, u128::from(u32::MAX)) as u32;
        let request =
            Request::Call { function: function.into(), timeout_ms, oneway: false, message: Box::new(message) };
        let not_here = |e: &ClientError| e.status() == Some(Status::FunctionNotFound);
        match self.shared.first_answer(&self.shared.order(None, Turn::Call), &request, wait, not_here).await? {
            (_, Response::Reply { message }) => Ok(*message),
            (_, other) => Err(crate::unexpected(other)),
        }
    }

    /// Calls `function` without waiting for its reply: done once a server that serves it has
    /// the call (passed on as `call` is).
    pub async fn call_oneway(&self, function: &str, message: Message) -> Result<(), ClientError> {
        let request =
            Request::Call { function: function.into(), timeout_ms: 0, oneway: true, message: Box::new(message) };
        let not_here = |e: &ClientError| e.status() == Some(Status::FunctionNotFound);
        self.shared
            .first_answer(&self.shared.order(None, Turn::Call), &request, Duration::ZERO, not_here)
            .await
            .map(|_| ())
    }

    /// Serves `function` on every server, and again on each one that comes back after a loss.
    /// `Ok` once one server serves it; the servers that refused are named with their answers
    /// in `stats()` (`ServerState::unserved`). An `Err` leaves it served nowhere, now or when a
    /// server comes back. Serving a function again replaces its handler.
    pub async fn serve<F, Fut>(&self, function: &str, handler: F) -> Result<(), ClientError>
    where
        F: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Message, String>> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |m| Box::pin(handler(m)));
        {
            let mut served = lock(&self.shared.served);
            served.retain(|(f, _)| f != function);
            served.push((function.to_owned(), Arc::clone(&handler)));
        }
        let mut served = 0;
        let mut last = None;
        for i in 0..self.shared.members.len() {
            let Some((client, connection)) = self.shared.current(i) else { continue };
            let handler = Arc::clone(&handler);
            // Within the request timeout: a server stopped (not gone) is marked down, not waited for.
            let serving = client.serve(function, move |m| handler(m));
            let outcome = self.shared.on(i, connection, Duration::ZERO, serving).await;
            lock(&self.shared.members[i].link).served(function, outcome.as_ref().err().map(ToString::to_string));
            match outcome {
                Ok(()) => served += 1,
                Err(e) => last = Some(e),
            }
        }
        if served == 0 {
            // Not served: not to be served either when a server comes back (a caller retrying
            // would register it once a try).
            lock(&self.shared.served).retain(|(_, h)| !Arc::ptr_eq(h, &handler));
        }
        match (served, last) {
            (0, Some(e)) => Err(e),
            (0, None) => Err(self.shared.unavailable()),
            _ => Ok(()),
        }
    }

    /// Stops serving `function` on every server that is up, and on those that come back (calls
    /// already running still reply). A server down is not an error: it serves nothing of this
    /// client's when it is back.
    pub async fn unserve(&self, function: &str) -> Result<(), ClientError> {
        lock(&self.shared.served).retain(|(f, _)| f != function);
        for i in 0..self.shared.members.len() {
            let Some((client, connection)) = self.shared.current(i) else { continue };
            match self.shared.on(i, connection, Duration::ZERO, client.unserve(function)).await {
                Ok(()) => lock(&self.shared.members[i].link).served(function, None),
                Err(e) if e.is_connection_lost() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Sends `request` to every server. An error (of the kind of the first failure) names every
    /// server that failed and those that did the request anyway, "(done on A, B)": a queue
    /// created on two servers of three is there on two, whatever the third said.
    async fn on_all(&self, request: &Request) -> Result<(), ClientError> {
        let mut done = Vec::new();
        // Each failure's status (`None`: the server could not be reached) and text.
        let mut failures: Vec<(Option<petrel_proto::Status>, String)> = Vec::new();
        for (i, result) in self.shared.to_all(request).await {
            let addr = &self.shared.members[i].addr;
            match result {
                Ok(_) => done.push(addr.as_str()),
                Err(ClientError::Status { status, message }) => {
                    failures.push((Some(status), format!("{addr}: {message}")))
                }
                Err(ClientError::Unavailable(why)) => failures.push((None, why)),
                Err(e) => failures.push((None, format!("{addr}: {e}"))),
            }
        }
        let Some(&(first, _)) = failures.first() else { return Ok(()) };
        // The first failure's kind; every failure's text, the later ones with their status.
        let texts = failures.iter().enumerate().map(|(i, (status, text))| match status {
            Some(status) if i > 0 => format!("{status}: {text}"),
            _ => text.clone(),
        });
        let mut text = texts.collect::<Vec<_>>().join("; ");
        if !done.is_empty() {
            text.push_str(&format!(" (done on {})", done.join(", ")));
        }
        Err(match first {
            Some(status) => ClientError::Status { status, message: text },
            None => ClientError::Unavailable(text),
        })
    }

    /// The names every server that is up lists, once each, sorted.
    async fn union(&self, request: &Request) -> Result<Vec<String>, ClientError> {
        let mut names = std::collections::BTreeSet::new();
        let mut answered = false;
        for (_, result) in self.shared.to_all(request).await {
            match result {
                Ok(Response::QueueList { names: n } | Response::TopicList { names: n }) => {
                    answered = true;
                    names.extend(n);
                }
                Ok(other) => return Err(crate::unexpected(other)),
                Err(e @ ClientError::Status { .. }) => return Err(e),
                Err(_) => {}
            }
        }
        if !answered {
            return Err(self.shared.unavailable());
        }
        Ok(names.into_iter().collect())
    }
}

/// An offer's answer from server `server`.
fn offered(server: usize, response: Response) -> Result<Offered, ClientError> {
    match response {
        Response::Offered { first_id, repeats, .. } => Ok(Offered { server, first_id, repeats }),
        other => Err(crate::unexpected(other)),
    }
}

fn set_offer_timeout(request: &mut Request, timeout: Duration) {
    if let Request::Offer { timeout_ms, .. } = request {
        *timeout_ms = timeout.as_millis().min(u128::from(u32::MAX)) as u32;
    }
}

fn deliveries(server: usize, connection: u64, taken: Vec<Delivery>) -> Vec<ClusterDelivery> {
    taken
        .into_iter()
        .map(|d| ClusterDelivery { handle: ClusterHandle { server, connection, handle: d.handle }, message: d.message })
        .collect()
}

/// One server's part of a cluster subscription while it is subscribed: what acknowledges a
/// group's messages there.
#[derive(Clone)]
struct Following {
    client: Client,
    /// The server's address, for errors.
    addr: String,
    connection: u64,
    subscription: u64,
}

/// Keeps one server's part of a cluster subscription: subscribes while the server is up,
/// forwards its messages, and subscribes again after it comes back (a group where it stands).
/// It holds the cluster: the subscription's drop ends it.
struct FollowTopic {
    shared: Arc<Shared>,
    i: usize,
    topic: String,
    /// A consumer group and where it starts the first time.
    group: Option<(String, StartFrom)>,
    /// The live subscription's buffer, or the group's most unacknowledged messages.
    buffer: u32,
    current: Arc<Mutex<Vec<Option<Following>>>>,
    /// The topic was not found on the server when it came back (said once until found again).
    missing: bool,
}

impl FollowTopic {
    /// Says on `ready` how its first SUBSCRIBE went (or that the server was down).
    async fn run(
        mut self,
        tx: mpsc::Sender<Result<ClusterDelivery, ClientError>>,
        ready: mpsc::Sender<Result<(), ClientError>>,
    ) {
        let (shared, i) = (Arc::clone(&self.shared), self.i);
        let mut ready = Some(ready);
        // Between tries of a group still held by the connection this one replaces.
        let mut held = crate::follow::HeldPause::new();
        loop {
            let changed = shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if shared.closed.load(Ordering::Acquire) {
                return; // the cluster was closed: with every server's part ended, so is the stream
            }
            let Some((client, connection)) = shared.current(i) else {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Ok(())).await;
                }
                changed.await;
                continue;
            };
            let subscribing = async {
                match &self.group {
                    Some((group, from)) => client.subscribe_group(&self.topic, group, *from, self.buffer).await,
                    None => client.subscribe(&self.topic, self.buffer).await,
                }
            };
            let mut subscription: Subscription = match shared.on(i, connection, Duration::ZERO, subscribing).await {
                Ok(s) => s,
                Err(e) if e.is_connection_lost() => continue,
                Err(e) if ready.is_none() && e.status() == Some(Status::Exists) => {
                    held.sleep().await;
                    continue;
                }
                // Gone from a server that came back (a live topic does not outlive a restart):
                // said once, then looked for again, so that the server's part resumes when the
                // topic is made there again (it ended for good, silently in Python).
                Err(e) if ready.is_none() && e.status() == Some(Status::TopicNotFound) => {
                    if !std::mem::replace(&mut self.missing, true) && tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    tokio::select! {
                        () = tokio::time::sleep(self.shared.options.max_pause) => {}
                        () = tx.closed() => return,
                    }
                    continue;
                }
                Err(e) => {
                    if let Some(ready) = ready.take() {
                        let _ = ready.send(Err(e)).await;
                    } else {
                        let _ = tx.send(Err(e)).await;
                    }
                    return;
                }
            };
            if let Some((_, from)) = &mut self.group {
                *from = StartFrom::Resume; // after a loss, where the group stands
            }
            held = crate::follow::HeldPause::new();
            self.missing = false;
            let addr = self.shared.members[i].addr.clone();
            lock(&self.current)[i] = Some(Following { client, addr, connection, subscription: subscription.id });
            if let Some(ready) = ready.take() {
                let _ = ready.send(Ok(())).await;
            }
            let mut fell_behind = false;
            while let Some(item) = subscription.next().await {
                match item {
                    Ok(m) => {
                        let handle = ClusterHandle { server: i, connection, handle: m.id };
                        if tx.send(Ok(ClusterDelivery { handle, message: m })).await.is_err() {
                            return;
                        }
                    }
                    Err(e) if e.is_connection_lost() => break,
                    Err(e) if e.status() == Some(Status::SlowConsumer) => {
                        // Messages were missed there: said, and the server followed again.
                        if tx.send(Err(e)).await.is_err() {
                            return;
                        }
                        fell_behind = true;
                        break;
                    }
                    Err(e) => {
                        // This server's part ended (its topic removed, its log unreadable): its
                        // acknowledgements go nowhere from now on.
                        lock(&self.current)[i] = None;
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
            lock(&self.current)[i] = None;
            if !fell_behind {
                shared.mark_down(i, connection, &ClientError::Closed);
            }
        }
    }
}

/// A subscription to a topic on every server of a cluster: one stream of their messages.
/// Dropping it unsubscribes everywhere.
pub struct ClusterSubscription {
    rx: mpsc::Receiver<Result<ClusterDelivery, ClientError>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    current: Arc<Mutex<Vec<Option<Following>>>>,
    request_timeout: Duration,
}

impl ClusterSubscription {
    /// The next message from any server. An error says what went wrong on one server:
    /// `SLOW_CONSUMER`, messages were missed there and that server is followed again from now;
    /// any other ends that server's part (the others go on).
    pub async fn next(&mut self) -> Option<Result<Message, ClientError>> {
        Some(self.next_delivery().await?.map(|d| d.message))
    }

    /// The next message with what acknowledges it (for a consumer group: its server, and its
    /// id as the handle).
    pub async fn next_delivery(&mut self) -> Option<Result<ClusterDelivery, ClientError>> {
        self.rx.recv().await
    }

    /// Acknowledges a group's messages, each on its server; returns how many counted (those
    /// delivered on a connection since lost do not: they come again).
    pub async fn ack(&self, handles: &[ClusterHandle]) -> Result<u32, ClientError> {
        self.acks().ack(handles).await
    }

    /// What acknowledges this subscription's messages, apart from it (so that one task may
    /// acknowledge while another waits for the next message).
    pub fn acks(&self) -> ClusterAcks {
        ClusterAcks { current: Arc::clone(&self.current), request_timeout: self.request_timeout }
    }
}

/// Acknowledges a cluster group subscription's messages (`ClusterSubscription::acks`).
#[derive(Clone)]
pub struct ClusterAcks {
    current: Arc<Mutex<Vec<Option<Following>>>>,
    /// How long a server's answer is waited for (the cluster's `request_timeout`): one stopped
    /// server does not hold up the others' messages (its unanswered acknowledgements are as
    /// lost: its messages come again, at least once).
    request_timeout: Duration,
}

impl ClusterAcks {
    /// As `ClusterSubscription::ack`: every server's at once. An error of one server's (other
    /// than a lost connection, which counts none) is returned once all were sent: the other
    /// servers' acknowledgements are made all the same.
    pub async fn ack(&self, handles: &[ClusterHandle]) -> Result<u32, ClientError> {
        let servers: HashSet<usize> = handles.iter().map(|h| h.server).collect();
        let acks = servers.into_iter().filter_map(|i| {
            let f = lock(&self.current).get(i).cloned().flatten()?;
            let ids: Vec<u64> =
                handles.iter().filter(|h| h.server == i && h.connection == f.connection).map(|h| h.handle).collect();
            // (None: all delivered on a connection since lost, or by a part that ended.)
            (!ids.is_empty()).then_some(async move {
                let acked = f.client.ack_subscription(f.subscription, &ids);
                crate::answer_within(self.request_timeout, &f.addr, acked).await
            })
        });
        let (mut total, mut failed) = (0, None);
        for answer in join_all(acks).await {
            match answer {
                Ok(n) => total += n,
                Err(e) if e.is_connection_lost() => {}
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        failed.map_or(Ok(total), Err)
    }
}

impl Drop for ClusterSubscription {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_keeps_its_server_and_a_new_server_takes_only_the_keys_it_wins() {
        let three = ["10.0.0.1:22134", "10.0.0.2:22134", "10.0.0.3:22134"];
        let four = ["10.0.0.1:22134", "10.0.0.2:22134", "10.0.0.3:22134", "10.0.0.4:22134"];
        let (mut moved, mut per_server) = (0, [0; 3]);
        for k in 0..10_000 {
            let key = format!("order-{k}");
            let before = rank(key.as_bytes(), three.into_iter());
            assert_eq!(before, rank(key.as_bytes(), three.into_iter()), "the same ranking every time");
            per_server[before[0]] += 1;
            let after = rank(key.as_bytes(), four.into_iter());
            if after[0] != before[0] {
                assert_eq!(after[0], 3, "a key moves only to the new server");
                moved += 1;
            }
            // The next choice when the first is down is the key's second server, not any other.
            let without_first: Vec<usize> = after.iter().copied().filter(|&i| i != after[0]).collect();
            assert_eq!(without_first, after[1..]);
        }
        assert!((2_000..3_000).contains(&moved), "about a quarter of the keys move to a fourth server: {moved}");
        assert!(per_server.iter().all(|&n| (3_000..3_700).contains(&n)), "spread: {per_server:?}");
    }

    fn delivery(server: usize, key: &str) -> ClusterDelivery {
        ClusterDelivery {
            handle: ClusterHandle { server, connection: 1, handle: 7 },
            message: Message { idempotency_key: key.into(), ..Message::default() },
        }
    }

    #[test]
    fn a_key_from_a_second_server_is_a_copy_within_the_window() {
        let options = ClusterOptions { duplicate_window: 2, ..ClusterOptions::default() };
        let mut seen = SeenKeys::default();
        assert!(seen.first_from("q", &delivery(0, "a"), &options));
        assert!(seen.first_from("q", &delivery(0, "a"), &options), "a redelivery from the same server");
        assert!(!seen.first_from("q", &delivery(1, "a"), &options), "a copy from another server");
        assert!(seen.first_from("other", &delivery(1, "a"), &options), "keys are per queue");
        assert!(seen.first_from("q", &delivery(0, "b"), &options));
        // The window holds two keys: "a" in "q" is forgotten, so its copy is not recognised.
        assert!(seen.first_from("q", &delivery(1, "a"), &options));
        let by_time = ClusterOptions { duplicate_window_time: Duration::ZERO, ..ClusterOptions::default() };
        let mut seen = SeenKeys::default();
        assert!(seen.first_from("q", &delivery(0, "c"), &by_time));
        std::thread::sleep(Duration::from_millis(2));
        assert!(seen.first_from("q", &delivery(1, "c"), &by_time), "forgotten after its time");
    }
}
