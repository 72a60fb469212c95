//! The memcache text protocol (Kestrel's queue dialect) on one connection: `set` offers to a
//! queue, `get` polls it, with `/t=`, `/open`, `/close`, `/abort` and `/peek`. Requests are
//! answered one after another, in order; a client may pipeline them, and the answers to what it
//! sent together go out in one write. The queues are the broker's, shared with the native
//! protocol; a queue comes into being when first named, configured by `Broker::config_for`.

pub mod codec;

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use petrel_broker::security::{Action, Kind};
use petrel_broker::{BrokerError, ConnId, Message, Queue, WaitFor, Waited};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use crate::auth::{self, Authenticated, Peer};
use crate::input::Input;
use crate::stats::add;
use crate::{Ctx, now_ns};
use codec::{Command, Decoder, GetOptions, Reject};

/// The server's version as `version` and `stats` give it: numbers only, `major.minor.micro`, as
/// memcached's and Kestrel's, which client libraries parse (libmemcached reads three integers,
/// and took `petrel-0.1.0` for a failed read).
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The header that carries a memcache item's flags (when not 0), so they reach its reader.
pub const FLAGS_HEADER: &str = "memcache-flags";
/// Answers are written once this many bytes are waiting, even mid-pipeline.
const FLUSH_AT: usize = 64 * 1024;

/// Why a waiting `get` stopped before it had an item.
enum GetEnd {
    /// Its time ran out, or the server is shutting down: answered as a miss.
    Miss,
    /// The client went away.
    Closed,
    /// A reload took the right to poll the queue away: answered with the refusal.
    Refused(BrokerError),
}

/// Whether the connection goes on after a request.
#[derive(PartialEq, Eq)]
enum Flow {
    Continue,
    Close,
}

struct Session<S> {
    ctx: Arc<Ctx>,
    /// This connection in the server's registry: what it has read, written and asked.
    connection: crate::connections::Registered,
    conn: ConnId,
    stream: S,
    input: Input,
    out: Vec<u8>,
    /// Bytes at the start of `out` already written (by a flush cut short: see `flush`).
    out_sent: usize,
    /// This connection's open (tentatively read) item per queue: its broker handle.
    open: HashMap<String, u64>,
    shutdown: watch::Receiver<bool>,
    peer: Peer,
    /// When authentication is on: who logged in (with a first `set` of `user password`, or a
    /// client certificate).
    authenticated: Option<Authenticated>,
    denials: auth::Denials,
    /// A `noreply` set on this connection was not stored and logged as a warning.
    warned_noreply: bool,
    /// Once the server stops: when the client's time to read its answers ends (one grace for
    /// all the flushes after the stop, however many requests were read ahead).
    stop_deadline: Option<tokio::time::Instant>,
}

/// Serves one connection until the client quits or goes away, a request makes the stream
/// untrustworthy, or the server shuts down. Items it left open go back to their queues.
/// `log_in_by`: the deadline of a login, on a server with users, counted from the connection's
/// start (`Ctx::handshake_deadline`).
pub(crate) async fn serve<S>(
    stream: S,
    ctx: Arc<Ctx>,
    conn: ConnId,
    shutdown: watch::Receiver<bool>,
    peer: Peer,
    log_in_by: tokio::time::Instant,
) where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let connection = crate::connections::Registry::open(&ctx, conn, &peer, "memcache");
    let _disconnect = crate::Disconnect { broker: Arc::clone(&ctx.broker), conn };
    let mut decoder = Decoder::new(ctx.config.max_message_bytes);
    let mut s = Session {
        ctx,
        connection,
        conn,
        stream,
        input: Input::new(),
        out: Vec::with_capacity(crate::input::QUIET_BYTES),
        out_sent: 0,
        open: HashMap::new(),
        shutdown,
        peer,
        authenticated: None,
        denials: auth::Denials::default(),
        warned_noreply: false,
        stop_deadline: None,
    };
    if let Some(certified) = auth::with_certificate(&s.ctx, &s.peer, conn) {
        match certified {
            Ok(a) => {
                s.connection.set_user(&a.principal.user);
                s.authenticated = Some(a);
            }
            Err(reason) => tracing::info!(conn, reason, "client certificate not accepted; a login may follow"),
        }
    }
    let idle_timeout = s.ctx.limits.idle_timeout();
    // With users, a login must come within the handshake timeout of the connection's start.
    let mut rights = s.connection.entry().rights();
    'serve: loop {
        while let Some(request) = decoder.decode(&mut s.input.buf) {
            let flow = match request {
                // The memory budget's hold on a large item goes once it is handled (a set may
                // wait for its queue's making meanwhile) and before its answer goes out.
                Ok(command) => {
                    let flow = s.execute(command).await;
                    s.input.taken();
                    flow
                }
                Err(_) if s.authenticated.is_none() && s.ctx.broker.auth_enabled() => {
                    // Before a login, a line that does not parse is refused as any other
                    // request is: nothing of it is counted, logged or read on (a `set` header
                    // naming 4 GB would have been skipped until the handshake timeout).
                    s.connection.request();
                    s.line(
                        "CLIENT_ERROR authentication required: first `set` any key with the data `<user> <password>`",
                    );
                    Flow::Close
                }
                Err(reject) => {
                    if reject.set {
                        let why = reject.reply.clone();
                        s.not_stored(None, &why, reject.noreply);
                    }
                    if reject.answered() {
                        s.line(&reject.reply);
                    }
                    if reject.close { Flow::Close } else { Flow::Continue }
                }
            };
            if flow == Flow::Close || (s.out.len() >= FLUSH_AT && !s.flush().await) {
                break 'serve;
            }
        }
        if !s.flush().await || *s.shutdown.borrow() {
            break;
        }
        let trusted = s.ctx.trusts(s.authenticated.is_some());
        let incomplete = decoder.incomplete(s.input.buf.len());
        if !trusted && incomplete.is_some_and(|len| len > crate::input::UNTRUSTED_BYTES) {
            // Before a login, no large item is read into memory (a login is a few bytes): the
            // connection ends, as it does for any other request before a login.
            s.line("CLIENT_ERROR authentication required");
            break;
        }
        if s.input.prepare(incomplete, &s.ctx.broker).is_err() {
            decoder.refuse_incomplete(Reject::keep(
                "SERVER_ERROR the item does not fit in the server's memory budget (max_memory_bytes) now",
            ));
            continue;
        }
        let quiet_until = match trusted {
            true => idle_timeout.map(|d| tokio::time::Instant::now() + d),
            false => Some(log_in_by),
        };
        tokio::select! {
            read = s.stream.read_buf(&mut s.input.buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    s.input.filled(n);
                    add(&s.ctx.stats.bytes_read, n as u64);
                    s.connection.received(n);
                }
            },
            _ = s.shutdown.changed() => break,
            _ = rights.changed() => {
                // A memcache connection holds no grants: it ends only if its user is gone.
                let who = s.authenticated.as_ref().map(|a| &a.principal);
                if s.ctx.broker.authenticated(who).is_err() {
                    tracing::info!(conn, "closing a memcache connection whose user a reload removed");
                    break;
                }
            }
            // Silent for too long, or no login in time (open items go back to their queues as
            // on any close).
            _ = crate::sleep_until_or_never(quiet_until) => {
                add(&s.ctx.stats.idle_closed, 1);
                tracing::debug!(conn, "closing an idle memcache connection");
                break;
            }
        }
    }
    s.flush().await;
    // Bounded: a TLS close writes its last record, which a client that stopped reading never
    // takes (the connection's open items go back only once this returns).
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), s.stream.shutdown()).await;
}

impl<S: AsyncRead + AsyncWrite + Unpin> Session<S> {
    fn line(&mut self, text: &str) {
        self.out.extend_from_slice(text.as_bytes());
        self.out.extend_from_slice(b"\r\n");
    }

    /// Writes the answers out; `false` if the client is gone. A client that stops reading them
    /// holds this no longer than it may be silent (before a login, the handshake timeout), from
    /// the last byte it took, nor more than the shutdown grace past a shutdown: then the
    /// connection ends. (One that reads a large answer slowly is not cut: each write it takes
    /// starts its time again.)
    async fn flush(&mut self) -> bool {
        if self.out.is_empty() {
            return true;
        }
        let stall = match self.ctx.trusts(self.authenticated.is_some()) {
            true => self.ctx.limits.idle_timeout(),
            false => Some(self.ctx.handshake_timeout()),
        };
        let grace = self.ctx.config.shutdown_grace().unwrap_or(std::time::Duration::from_secs(5));
        // A stop seen already (by a waiting get, or an earlier flush) ends the grace it began.
        let mut stopping = *self.shutdown.borrow();
        let mut deadline = match stopping {
            true => Some(*self.stop_deadline.get_or_insert_with(|| tokio::time::Instant::now() + grace)),
            false => stall.map(|d| tokio::time::Instant::now() + d),
        };
        // A write at a time, what it wrote counted at once (`out_sent`): a flush cancelled
        // between writes (a blocking get's wait ends when an item comes) leaves only what is
        // still to go, never bytes sent already (they went out twice).
        let ok = loop {
            // Once all is taken, a flush: a TLS stream may still hold the last records of what
            // it took (its write returns once it has the bytes, not once they are sent), and
            // nothing else would send them before the client's next request, which waits for
            // them.
            let flushing = self.out_sent == self.out.len();
            let (stream, rest) = (&mut self.stream, &self.out[self.out_sent..]);
            let step = async move {
                match flushing {
                    true => stream.flush().await.map(|()| None),
                    false => stream.write(rest).await.map(Some),
                }
            };
            let written = tokio::select! {
                written = step => written,
                _ = crate::sleep_until_or_never(deadline) => {
                    if !stopping {
                        add(&self.ctx.stats.idle_closed, 1); // closed for silence, as the loop closes it
                    }
                    break false;
                }
                _ = self.shutdown.changed(), if !stopping => {
                    // Stopping: the client has the shutdown's grace to read the rest.
                    stopping = true;
                    deadline = Some(*self.stop_deadline.get_or_insert_with(|| tokio::time::Instant::now() + grace));
                    continue;
                }
            };
            match written {
                Ok(None) => break true,
                Ok(Some(0)) | Err(_) => break false,
                Ok(Some(n)) => {
                    self.out_sent += n;
                    add(&self.ctx.stats.bytes_written, n as u64);
                    self.connection.sent(n);
                    if !stopping {
                        deadline = stall.map(|d| tokio::time::Instant::now() + d);
                    }
                }
            }
        };
        self.out.clear();
        self.out_sent = 0;
        if self.out.capacity() > crate::input::STREAMING_BYTES {
            // After a large answer: a quiet connection keeps a small buffer.
            self.out = Vec::with_capacity(crate::input::QUIET_BYTES);
        }
        ok
    }

    /// Asks the broker whether this connection may do one of `actions` to `kind`/`name`; a
    /// refusal is answered (`CLIENT_ERROR`) here, unless the request said `noreply`.
    fn authorize(&mut self, kind: Kind, name: &str, actions: &[Action], noreply: bool) -> bool {
        let principal = self.authenticated.as_ref().map(|a| &a.principal);
        let Err(e) = auth::authorize(&self.ctx, self.conn, principal, &mut self.denials, kind, name, actions) else {
            return true;
        };
        if !noreply {
            self.line(&server_error(&e));
        }
        false
    }

    /// Counts a `set` not stored. Sent with `noreply`, nobody else learns of it: the first such
    /// on a connection is logged as a warning (later ones at debug, so a client cannot flood
    /// the log).
    fn not_stored(&mut self, queue: Option<&str>, why: &str, noreply: bool) {
        add(&self.ctx.stats.set_refused, 1);
        let queue = petrel_broker::shown(queue.unwrap_or("(refused before it was read)"));
        match noreply && !std::mem::replace(&mut self.warned_noreply, true) {
            true => {
                tracing::warn!(conn = self.conn, %queue, why, "a noreply set was not stored (later ones on this connection are logged at debug level)")
            }
            false => tracing::debug!(conn = self.conn, %queue, why, noreply, "a set was not stored"),
        }
    }

    /// The fanout children of `parent` this connection may see.
    fn visible_children(&self, parent: &str) -> Vec<String> {
        self.ctx.broker.fanout_children(parent).into_iter().filter(|c| self.may_see(c)).collect()
    }

    /// Whether this connection may see the queue `name` (in `stats`).
    fn may_see(&self, name: &str) -> bool {
        let principal = self.authenticated.as_ref().map(|a| &a.principal);
        self.ctx.broker.may(principal, Kind::Queue, name, &[Action::Offer, Action::Poll])
    }

    /// Before a login, when authentication is on: memcached's text-protocol convention, a first
    /// `set` (of any key) whose data is `user password`. Anything else ends the connection.
    async fn login(&mut self, command: Command) -> Flow {
        match command {
            Command::Set { data, noreply, .. } => {
                let text = String::from_utf8_lossy(&data);
                let (user, password) = text.split_once(' ').unwrap_or((&text, ""));
                match auth::with_password(&self.ctx, &self.peer, self.conn, user.to_owned(), password.to_owned()).await
                {
                    Ok(a) => {
                        self.connection.set_user(&a.principal.user);
                        self.authenticated = Some(a);
                        if !noreply {
                            self.line("STORED");
                        }
                        Flow::Continue
                    }
                    Err(reason) => {
                        self.line(&format!("CLIENT_ERROR authentication failed: {reason}"));
                        Flow::Close
                    }
                }
            }
            Command::Version => {
                self.line(&format!("VERSION {VERSION}"));
                Flow::Continue
            }
            Command::Quit => Flow::Close,
            _ => {
                self.line(
                    "CLIENT_ERROR authentication required: first `set` any key with the data `<user> <password>`",
                );
                Flow::Close
            }
        }
    }

    async fn execute(&mut self, command: Command) -> Flow {
        self.connection.request();
        self.ctx.stats.memcache_request(command.name());
        if self.authenticated.is_none() && self.ctx.broker.auth_enabled() {
            return self.login(command).await;
        }
        let needs = match &command {
            // A get's right to poll is checked by `get`, after its `/close` or `/abort`, which need
            // none.
            Command::FlushExpired { queue } => Some((queue.as_str(), Action::Poll)),
            Command::Set { queue, .. } => Some((queue.as_str(), Action::Offer)),
            Command::Delete { queue, .. } | Command::Flush { queue, .. } => Some((queue.as_str(), Action::Manage)),
            Command::FlushAll { .. } | Command::FlushAllExpired | Command::Shutdown => Some(("*", Action::Manage)),
            _ => None,
        };
        if let Some((name, action)) = needs
            && !self.authorize(Kind::Queue, name, &[action], command.noreply())
        {
            if let Command::Set { queue, noreply, .. } = &command {
                self.not_stored(Some(queue), "not allowed", *noreply);
            }
            return Flow::Continue;
        }
        match command {
            Command::Get { key, queue, options, cas } => return self.get(key, &queue, options, cas).await,
            Command::Set { queue, flags, exptime, data, noreply } => {
                let reply = self.set(&queue, flags, exptime, data).await;
                if reply != "STORED" {
                    self.not_stored(Some(&queue), &reply, noreply);
                }
                if !noreply {
                    self.line(&reply);
                }
            }
            Command::OtherStorage { verb, noreply } => {
                if !noreply {
                    self.line(&format!("CLIENT_ERROR {verb} is not supported by a queue; use set"));
                }
            }
            Command::Delete { queue, noreply } => {
                // Off the runtime's threads, as the flushes below: these delete files.
                let broker = Arc::clone(&self.ctx.broker);
                let name = queue.clone();
                let removed = crate::blocking(move || broker.remove_queue(&name)).await;
                // Its open item went with it, also when its files could not be deleted after.
                if self.ctx.broker.queue(&queue).is_none() {
                    self.open.remove(&queue);
                }
                match removed {
                    Ok(()) | Err(BrokerError::NotFound(_)) if !noreply => self.line("DELETED"),
                    Ok(()) | Err(BrokerError::NotFound(_)) => {}
                    Err(e) if !noreply => self.line(&server_error(&e)),
                    Err(_) => {}
                }
            }
            Command::Flush { queue, noreply } => {
                let flushed = match self.ctx.broker.queue(&queue) {
                    Some(q) => crate::blocking(move || q.flush()).await.map(drop),
                    None => Ok(()),
                };
                match flushed {
                    _ if noreply => {}
                    Err(e) => self.line(&server_error(&e)),
                    Ok(()) => self.line("END"),
                }
            }
            Command::FlushAll { memcached_style, noreply } => {
                let broker = Arc::clone(&self.ctx.broker);
                // Every queue is flushed that can be; the first failure is the answer (as a
                // `flush` of one queue answers its failure).
                let flushed = crate::blocking(move || {
                    let mut first_failure = Ok(());
                    for name in broker.queue_names() {
                        if let Some(q) = broker.queue(&name)
                            && let Err(e) = q.flush()
                        {
                            tracing::error!(queue = %name, error = %e, "flush failed");
                            if first_failure.is_ok() {
                                first_failure = Err(e);
                            }
                        }
                    }
                    first_failure
                });
                let flushed = flushed.await;
                if !noreply {
                    match flushed {
                        // Kestrel's own sentence, unless the client sent memcached's delay
                        // argument and so expects memcached's `OK`.
                        Ok(()) => self.line(if memcached_style { "OK" } else { "Flushed all queues." }),
                        Err(e) => self.line(&server_error(&e)),
                    }
                }
            }
            Command::FlushExpired { queue } => {
                let n = self.flush_expired(&queue);
                self.line(&n.to_string());
            }
            Command::FlushAllExpired => {
                let n: u64 = self.ctx.broker.queue_names().iter().map(|q| self.flush_expired(q)).sum();
                self.line(&n.to_string());
            }
            Command::Version => self.line(&format!("VERSION {VERSION}")),
            Command::Shutdown => {
                if self.ctx.config.memcache_shutdown {
                    tracing::info!(conn = self.conn, "shutdown requested over memcache");
                    self.ctx.shutdown.notify_one();
                    return Flow::Close;
                }
                self.line("CLIENT_ERROR shutdown is disabled (memcache_shutdown = true enables it)");
            }
            Command::Quit => return Flow::Close,
            Command::Stats => self.stats(),
            Command::DumpStats { queues } => self.dump_stats(&queues),
            Command::Unknown { verb, noreply } => {
                tracing::debug!(conn = self.conn, verb, "unknown memcache command");
                if !noreply {
                    self.line("ERROR");
                }
            }
        }
        Flow::Continue
    }

    async fn set(&mut self, queue: &str, flags: u32, exptime: i64, data: Bytes) -> String {
        add(&self.ctx.stats.cmd_set, 1);
        if petrel_broker::check_name(queue).is_err() {
            return "CLIENT_ERROR bad queue name".into();
        }
        let now = now_ns();
        let mut message = Message::new(data);
        message.expires_at = expires_at(exptime, now);
        if flags != 0 {
            message.headers.push((FLAGS_HEADER.into(), Bytes::from(flags.to_string())));
        }
        // Over the server's limit (the flags, kept beside the item, count some bytes of it): the
        // line memcached gives, as for a data block over it. (Over a queue's own limits, below:
        // Kestrel's NOT_STORED.)
        if self.ctx.broker.check_size(&message).is_err() {
            return "SERVER_ERROR object too large for cache".into();
        }
        let who = self.authenticated.as_ref().map(|a| &a.principal);
        let offered = crate::first_use::queue_or_create(&self.ctx, who, queue)
            .await
            .and_then(|q| self.ctx.broker.offer_unsynced(&q, &mut vec![message], now));
        // A queue that syncs each offer: STORED once on disk, waited for off the runtime.
        let synced = match offered {
            Ok(offered) => crate::wait_durable(offered.unsynced).await,
            Err(e) => Err(e),
        };
        match synced {
            Ok(()) => "STORED".into(),
            // Over the queue's own limits (Kestrel's answer).
            Err(BrokerError::Full(_) | BrokerError::TooLarge { .. } | BrokerError::NeverFits(_)) => "NOT_STORED".into(),
            Err(e) => server_error(&e),
        }
    }

    async fn get(&mut self, key: Bytes, name: &str, o: GetOptions, cas: bool) -> Flow {
        if petrel_broker::check_name(name).is_err() {
            self.line("CLIENT_ERROR bad queue name");
            return Flow::Continue;
        }
        let broker = Arc::clone(&self.ctx.broker);
        // Watched from here, before the rules are looked at below: a reload from now on is seen
        // by the wait (a user it removed ends the connection; see `gave_up`).
        let (mut rights, mut watching_rights) = (self.connection.entry().rights(), true);
        // Closing or aborting the item this connection holds open needs no right (as the native
        // ACK and ABORT): it touches only what the connection took. A `/close/open` whose open
        // is refused has closed its item.
        // An abort the broker could not apply (a storage error) keeps the item open: the client
        // may try again, and a second `/open` is still refused.
        if o.abort {
            if let Some(handle) = self.open.remove(name)
                && let Err(e) = broker.abort(name, &[handle], self.conn, 0, now_ns())
                && !matches!(e, BrokerError::NotFound(_))
            {
                self.open.insert(name.to_owned(), handle);
                self.line(&server_error(&e));
                return Flow::Continue;
            }
            self.line("END");
            return Flow::Continue;
        }
        if o.close {
            // An acknowledgement whose write failed has still acknowledged the item (in memory:
            // it is no longer open, and comes back only after a restart): said, and not kept
            // open (a later `/abort` or disconnect would give back nothing).
            if let Some(handle) = self.open.remove(name)
                && let Err(e) = broker.ack(name, &[handle], self.conn)
                && !matches!(e, BrokerError::NotFound(_))
            {
                self.line(&server_error(&e));
                return Flow::Continue;
            }
            if !o.open {
                self.line("END");
                return Flow::Continue;
            }
        }
        if !self.authorize(Kind::Queue, name, &[Action::Poll], false) {
            return Flow::Continue;
        }
        if self.open.contains_key(name) && !o.peek {
            // One open item per queue per connection: a second open, or a plain get while one is
            // open, is an error that ends the connection (which returns the open item).
            self.line("ERROR");
            return Flow::Close;
        }
        let stats = &self.ctx.stats;
        add(if o.peek { &stats.cmd_peek } else { &stats.cmd_get }, 1);
        let deadline = Instant::now() + Duration::from_millis(u64::from(o.timeout_ms));
        let who = self.authenticated.as_ref().map(|a| &a.principal);
        let queue = match crate::first_use::queue_or_create(&self.ctx, who, name).await {
            Ok(queue) => queue,
            Err(e) => {
                self.line(&server_error(&e));
                return Flow::Continue;
            }
        };
        let conn = self.conn;
        let take = |queue: &Arc<Queue>| {
            let now = now_ns();
            if o.peek {
                broker.peek(queue, now).map(|m| m.map(|m| (0, m)))
            } else {
                let visibility = o.open.then_some(Duration::MAX);
                broker
                    .poll_from(queue, 1, visibility, conn, now)
                    .map(|d| d.into_iter().next().map(|d| (d.handle, d.message)))
            }
        };
        // While waiting: answers so far go out, and requests pipelined behind this one are read
        // ahead (what is read is decoded after this get), to notice a client that went away, or
        // a user a reload removed (whose connection ends, as between requests).
        let gave_up = async {
            if Instant::now() >= deadline || *self.shutdown.borrow() {
                return GetEnd::Miss;
            }
            if !self.flush().await {
                return GetEnd::Closed;
            }
            loop {
                let reading = self.input.buf.len() < self.ctx.config.memcache_read_ahead_bytes;
                if reading {
                    let _ = self.input.prepare(None, &self.ctx.broker);
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline.into()) => return GetEnd::Miss,
                    // (The stop's value, not its change: the flush above may have seen the change.)
                    _ = self.shutdown.wait_for(|stop| *stop) => return GetEnd::Miss,
                    changed = rights.changed(), if watching_rights => {
                        watching_rights = changed.is_ok(); // (gone with the server only)
                        let who = self.authenticated.as_ref().map(|a| &a.principal);
                        if self.ctx.broker.authenticated(who).is_err() {
                            tracing::info!(conn, "closing a memcache connection whose user a reload removed");
                            return GetEnd::Closed;
                        }
                        let (ctx, denials) = (&self.ctx, &mut self.denials);
                        if let Err(e) = auth::authorize(ctx, conn, who, denials, Kind::Queue, name, &[Action::Poll]) {
                            return GetEnd::Refused(e);
                        }
                    }
                    read = self.stream.read_buf(&mut self.input.buf), if reading => match read {
                        // The client went away: stop waiting, so no item is taken for nobody.
                        Ok(0) | Err(_) => return GetEnd::Closed,
                        Ok(n) => {
                            self.input.filled(n);
                            add(&self.ctx.stats.bytes_read, n as u64);
                            self.connection.received(n);
                        }
                    },
                }
            }
        };
        match broker.wait_on_queue(queue, WaitFor::Messages, take, gave_up).await {
            Ok(Waited::Ready((handle, message))) => {
                if o.open {
                    self.open.insert(name.to_owned(), handle);
                }
                add(&self.ctx.stats.get_hits, 1);
                self.value(&key, &message, cas);
            }
            Ok(Waited::Stopped(GetEnd::Closed)) => return Flow::Close,
            Ok(Waited::Stopped(GetEnd::Refused(e))) => self.line(&server_error(&e)),
            // A queue removed while the get waited is a miss, as an empty one is.
            Ok(Waited::Stopped(GetEnd::Miss)) | Err(BrokerError::NotFound(_)) => {
                add(&self.ctx.stats.get_misses, 1);
                self.line("END");
            }
            Err(e) => self.line(&server_error(&e)),
        }
        Flow::Continue
    }

    fn value(&mut self, key: &[u8], m: &Message, cas: bool) {
        let flags = m
            .headers
            .iter()
            .find(|(name, _)| name == FLAGS_HEADER)
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u32>().ok())
            .unwrap_or(0);
        self.out.extend_from_slice(b"VALUE ");
        self.out.extend_from_slice(key);
        let _ = write!(self.out, " {flags} {}", m.payload.len());
        if cas {
            let _ = write!(self.out, " {}", m.id);
        }
        self.out.extend_from_slice(b"\r\n");
        self.out.extend_from_slice(&m.payload);
        self.out.extend_from_slice(b"\r\nEND\r\n");
    }

    fn flush_expired(&self, name: &str) -> u64 {
        let Some(q) = self.ctx.broker.queue(name) else { return 0 };
        let before = q.counters().expired;
        if let Err(e) = self.ctx.broker.peek(&q, now_ns()) {
            tracing::error!(queue = name, error = %e, "flush_expired failed");
        }
        q.counters().expired - before
    }

    fn stats(&mut self) {
        let ctx = Arc::clone(&self.ctx);
        let broker = &ctx.broker;
        let queues: Vec<Arc<Queue>> =
            broker.queue_names().iter().filter(|n| self.may_see(n)).filter_map(|n| broker.queue(n)).collect();
        // Children this connection may not see are left out of `children` as the queues are.
        let per_queue: Vec<_> = queues.iter().map(|q| (q, q.counters(), self.visible_children(&q.name))).collect();
        let s = &ctx.stats;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let mut put = |name: &str, value: &dyn std::fmt::Display| {
            let _ = write!(self.out, "STAT {name} {value}\r\n");
        };
        put("uptime", &s.started.elapsed().as_secs());
        put("time", &now.as_secs());
        put("version", &VERSION);
        put("curr_items", &per_queue.iter().map(|(_, st, _)| st.items).sum::<u64>());
        // Over the server's life: removed queues' items stay counted (as Kestrel's did); with
        // authentication on they are left out, as the queues a connection may not see are.
        let removed_offered = if broker.auth_enabled() { 0 } else { broker.removed_queues_totals().0 };
        put("total_items", &(removed_offered + per_queue.iter().map(|(_, st, _)| st.total_offered).sum::<u64>()));
        put("bytes", &per_queue.iter().map(|(_, st, _)| st.bytes - st.in_flight_bytes).sum::<u64>());
        put("reserved_memory_ratio", &format!("{:.3}", reserved_memory_ratio(broker, &queues)));
        put("curr_connections", &get(&s.curr_connections));
        put("total_connections", &get(&s.total_connections));
        put("cmd_get", &get(&s.cmd_get));
        put("cmd_set", &get(&s.cmd_set));
        put("cmd_peek", &get(&s.cmd_peek));
        put("get_hits", &get(&s.get_hits));
        put("get_misses", &get(&s.get_misses));
        put("bytes_read", &get(&s.bytes_read));
        put("bytes_written", &get(&s.bytes_written));
        put("queue_creates", &broker.queues_created());
        put("queue_deletes", &broker.queues_removed());
        put("queue_expires", &0);
        put("tls_connections", &get(&s.tls_connections));
        put("tls_refused", &get(&s.tls_refused));
        put("auth_successes", &get(&s.auth_successes));
        put("auth_failures", &get(&s.auth_failures));
        put("auth_rate_limited", &get(&s.auth_rate_limited));
        put("acl_denials", &broker.denials());
        put("connections_refused", &get(&s.connections_refused));
        put("idle_closed", &get(&s.idle_closed));
        put("set_refused", &get(&s.set_refused));
        put("request_failures", &crate::stats::request_failures().iter().sum::<u64>());
        put("queues_damaged", &broker.damaged_queues().len());
        // The limits a reload changes as they are now; the rest as the server started.
        let limits = &ctx.config;
        put("limit_max_connections", &ctx.limits.max_connections());
        put("limit_max_connections_per_address", &ctx.limits.max_connections_per_address());
        put("limit_max_connections_per_user", &ctx.limits.max_connections_per_user());
        put("limit_max_queues", &limits.max_queues);
        put("limit_max_topics", &limits.max_topics);
        let (memory_queued, memory_max) = ctx.broker.memory();
        put("limit_max_memory_bytes", &memory_max);
        put("memory_queued_bytes", &memory_queued);
        let (resident, releases) = ctx.broker.resident_pages();
        put("limit_max_resident_bytes", &limits.max_resident_bytes);
        put("resident_counted_bytes", &resident);
        put("resident_releases", &releases);
        // The data directory's file system: what is left for segments (a full disk refuses
        // offers to durable queues with SERVER_ERROR).
        if let Ok(fs) = rustix::fs::statvfs(&ctx.config.data) {
            put("disk_free_bytes", &(fs.f_bavail * fs.f_frsize));
            put("disk_total_bytes", &(fs.f_blocks * fs.f_frsize));
        }
        put("limit_max_queues_per_user", &limits.security.max_queues_per_user);
        put("limit_max_in_flight_per_connection", &limits.max_in_flight_per_connection);
        put("limit_max_subscriptions_per_connection", &limits.max_subscriptions_per_connection);
        put("limit_max_functions_per_connection", &limits.max_functions_per_connection);
        put("limit_max_message_bytes", &limits.max_message_bytes);
        put("limit_auth_attempts_per_minute", &limits.security.auth_attempts_per_minute);
        // Whole seconds: a stats value is one token.
        put("limit_idle_timeout_seconds", &ctx.limits.idle_timeout().map_or(0, |d| d.as_secs()));
        for (q, st, children) in &per_queue {
            for (stat, value) in queue_stats(q, st, children) {
                put(&format!("queue_{}_{stat}", q.name), &value);
            }
        }
        self.line("END");
    }

    fn dump_stats(&mut self, names: &[String]) {
        let broker = Arc::clone(&self.ctx.broker);
        let names = if names.is_empty() { broker.queue_names() } else { names.to_vec() };
        let names: Vec<String> = names.into_iter().filter(|n| self.may_see(n)).collect();
        for name in names {
            let Some(q) = broker.queue(&name) else { continue };
            let _ = write!(self.out, "queue '{name}' {{\r\n");
            let children = self.visible_children(&name);
            for (stat, value) in queue_stats(&q, &q.counters(), &children) {
                let _ = write!(self.out, "  {stat}={value}\r\n");
            }
            self.line("}");
        }
        self.line("END");
    }
}

/// A queue's figures under Kestrel's names (`children`: its fanout children to name).
fn queue_stats(q: &Queue, st: &petrel_broker::QueueCounters, children: &[String]) -> Vec<(&'static str, String)> {
    let age_ms = if st.items == 0 || st.last_taken_offered_at == 0 {
        0
    } else {
        now_ns().saturating_sub(st.last_taken_offered_at) / 1_000_000
    };
    // Kestrel counts open items apart from the queue's items and bytes.
    let bytes = st.bytes - st.in_flight_bytes;
    // In memory: no log, every log figure 0 (as Kestrel's for a queue without a journal).
    let log = q.log_stats().unwrap_or_default();
    let mut out = vec![
        ("items", st.items.to_string()),
        ("bytes", bytes.to_string()),
        ("total_items", st.total_offered.to_string()),
        ("logsize", log.segment_bytes.to_string()),
        ("expired_items", st.expired.to_string()),
        ("mem_items", st.items.to_string()),
        ("mem_bytes", bytes.to_string()),
        ("age", age_ms.to_string()),
        ("discarded", st.dropped.to_string()),
        ("waiters", st.waiters.to_string()),
        ("open_transactions", st.in_flight.to_string()),
        // Not Kestrel's: stored, not yet due (a native offer's delay, a redelivery delay).
        // Not `delayed_items`: Kestrel clients take a stat's queue name as what comes before a
        // suffix they know (`_items`), and would list a queue `NAME_delayed`.
        ("delayed", st.delayed.to_string()),
        ("transactions", st.opened.to_string()),
        ("canceled_transactions", st.aborted.to_string()),
        ("total_flushes", st.flushes.to_string()),
        // Kestrel rewrote a journal down to its live items; a log gets the same effect when
        // retention deletes segments every reader is past.
        ("journal_rewrites", log.retention_removals.to_string()),
        // Kestrel moved on to a new journal file; a log to a new segment.
        ("journal_rotations", log.rolls.to_string()),
    ];
    if !children.is_empty() {
        out.push(("children", children.join(",")));
    }
    out
}

/// Kestrel's `reserved_memory_ratio`: the memory its queues could hold (each queue's
/// `max_memory_size`) over the JVM's heap. Here: what the in-memory queues among `queues` may
/// hold (each one's byte cap, the whole budget for one without) over the server's memory budget
/// for them (`max_memory_bytes`); 0 without a budget. Durable queues count nothing: their
/// messages are in mapped segments, under `max_resident_bytes` instead.
fn reserved_memory_ratio(broker: &petrel_broker::Broker, queues: &[Arc<Queue>]) -> f64 {
    let budget = broker.memory().1;
    if budget == 0 {
        return 0.0;
    }
    let reserved: u64 = queues
        .iter()
        .filter_map(|q| q.memory_cap())
        .map(|cap| if cap == 0 { budget } else { cap.min(budget) })
        .fold(0u64, u64::saturating_add);
    reserved as f64 / budget as f64
}

fn server_error(e: &BrokerError) -> String {
    match e {
        BrokerError::BadRequest(reason) | BrokerError::Unauthorized(reason) | BrokerError::Forbidden(reason) => {
            format!("CLIENT_ERROR {reason}")
        }
        BrokerError::NotFound(_)
        | BrokerError::Full(_)
        | BrokerError::TooLarge { .. }
        | BrokerError::NeverFits(_)
        | BrokerError::Limit(_)
        | BrokerError::Exists(..)
        | BrokerError::TopicExists(..)
        | BrokerError::Held(_) => {
            format!("SERVER_ERROR {e}")
        }
        BrokerError::TopicNotFound(_)
        | BrokerError::GroupNotFound { .. }
        | BrokerError::FunctionNotFound(_)
        | BrokerError::Handler(_)
        | BrokerError::Timeout(_) => {
            format!("SERVER_ERROR {e}")
        }
        BrokerError::Storage(_)
        | BrokerError::Definitions(_)
        | BrokerError::Damaged { .. }
        | BrokerError::DataDirLocked(_) => {
            crate::log_request_failure("memcache", e);
            format!("SERVER_ERROR {e}")
        }
    }
}

/// memcache's expiry in seconds, as Kestrel reads it: 0 never; below 1,000,000 relative to now;
/// from there on a Unix time; negative already expired.
fn expires_at(exptime: i64, now: u64) -> u64 {
    const NS: i64 = 1_000_000_000;
    match exptime {
        0 => 0,
        e if e < 0 => 1,
        e if e < 1_000_000 => now.saturating_add(e as u64 * NS as u64),
        e => (e as u64).saturating_mul(NS as u64).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::expires_at;

    /// A blocking get's wait writes the answers before it (here a `stats`) while it waits, and
    /// ends when an item comes, cancelling that write if the client reads slowly: what was
    /// written by then must not go out again with the rest (it did, and the client read the
    /// first part of the stats twice).
    #[test]
    fn answers_cut_short_by_an_item_arriving_go_out_once() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let harness = crate::fuzzing::Harness::new();
        let ctx = std::sync::Arc::clone(harness.ctx());
        let rt = tokio::runtime::Runtime::new().unwrap();
        let got = rt.block_on(async move {
            ctx.broker.create_queue("slowq", petrel_broker::QueueConfig::default(), None).unwrap();
            let (mut client, server) = tokio::io::duplex(64);
            let (_stop, stop) = tokio::sync::watch::channel(false);
            let peer = crate::auth::Peer::tcp(([127, 0, 0, 1], 1).into(), false, Some("max".into()));
            let serving = tokio::spawn(super::serve(
                server,
                std::sync::Arc::clone(&ctx),
                1,
                stop,
                peer,
                ctx.handshake_deadline(),
            ));
            client.write_all(b"stats\r\nget slowq/t=5000\r\n").await.unwrap();
            // The stats are written 64 bytes at a time as this reads; read a little, then let
            // an item end the wait in the middle of the write.
            let mut got = vec![0u8; 100];
            client.read_exact(&mut got).await.unwrap();
            ctx.broker.offer("slowq", vec![petrel_broker::Message::new(&b"x"[..])], 0).unwrap();
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&got).contains("VALUE slowq") || !got.ends_with(b"END\r\n") {
                let n = tokio::time::timeout(std::time::Duration::from_secs(10), client.read(&mut buf))
                    .await
                    .expect("the answers come")
                    .unwrap();
                assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&buf[..n]);
            }
            drop(client);
            let _ = serving.await;
            String::from_utf8(got).unwrap()
        });
        assert_eq!(got.matches("STAT uptime ").count(), 1, "{got}");
        assert_eq!(got.matches("\r\nEND\r\n").count(), 2, "{got}");
        assert!(got.ends_with("END\r\nVALUE slowq/t=5000 0 1\r\nx\r\nEND\r\n"), "{got}");
    }

    #[test]
    fn expiry_follows_memcache_rules() {
        let now = 1_700_000_000 * 1_000_000_000u64;
        assert_eq!(expires_at(0, now), 0);
        assert_eq!(expires_at(5, now), now + 5_000_000_000);
        assert_eq!(expires_at(1_800_000_000, now), 1_800_000_000 * 1_000_000_000);
        assert!(expires_at(-1, now) < now && expires_at(-1, now) != 0);
    }
}
