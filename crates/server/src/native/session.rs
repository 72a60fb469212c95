//! Who is on a native connection, and the requests about that: HELLO, PING, AUTH; and the
//! checks every other request passes first (logged in, allowed by the ACLs).

use std::sync::Arc;

use petrel_broker::security::{Action, Kind, Principal};
use petrel_broker::{BrokerError, ConnId, Queue};
use petrel_proto::{Request, Response, Status, features};

use crate::Ctx;
use crate::auth::{self, Authenticated, Peer};
use crate::connections::Registered;

pub(super) struct Session {
    pub conn: ConnId,
    pub peer: Peer,
    /// Said HELLO: the connection is past its handshake (and its shorter timeout).
    pub greeted: bool,
    authenticated: Option<Authenticated>,
    denials: auth::Denials,
    /// Negotiated in HELLO: payloads of at least this many bytes go out zstd-compressed.
    pub compress: Option<usize>,
    /// Negotiated in HELLO: the optional fields this client reads at the end of answers
    /// (`features::OFFER_REPEATS`, `features::QUEUE_FIGURES`).
    pub reads: u32,
    /// The queue this connection named last, and `Broker::queues_removed` when it was found:
    /// found again without the broker's lock and hash while no queue has been removed since.
    /// Weak, so that a removed queue's log closes with its last request, not with this session.
    last_queue: Option<(std::sync::Weak<Queue>, u64)>,
    /// Ends (its sender dropped) when the connection stops reading: a request still waiting
    /// then stops waiting, so that nothing is taken or stored for a client that is gone.
    pub closed: tokio::sync::watch::Receiver<()>,
    /// Per durable topic, this connection's publishes to it (each runs on a blocking thread of
    /// its own, which may start before the one before it): stored in the order sent, while
    /// publishes to different topics go on side by side.
    pub durable_publishes: InTurn,
    /// Per queue, this connection's offers waiting for room in it: a later offer of the
    /// connection with a timeout waits its turn before it looks for room, rather than take room
    /// that came for an earlier one (pipelined offers are stored in the order sent).
    pub offers_waiting: InTurn,
}

/// Requests of one connection that must be done in the order they came, per name (a queue, a
/// topic): each waits for the one before it under the same name.
#[derive(Default)]
pub(super) struct InTurn(std::collections::HashMap<String, tokio::sync::oneshot::Receiver<()>>);

impl InTurn {
    /// Whether a request under `name` is still under way.
    pub fn busy(&mut self, name: &str) -> bool {
        self.forget_done();
        self.0.contains_key(name)
    }

    /// A new request's turn under `name`: what ends when the one before it is done (`None`: none
    /// is), and what it drops once done itself.
    pub fn take_turn(
        &mut self,
        name: &str,
    ) -> (Option<tokio::sync::oneshot::Receiver<()>>, tokio::sync::oneshot::Sender<()>) {
        self.forget_done();
        let (done, next) = tokio::sync::oneshot::channel();
        (self.0.insert(name.to_owned(), next), done)
    }

    /// Names whose last request is done (its sender dropped) go: at most one entry per request
    /// under way.
    fn forget_done(&mut self) {
        use tokio::sync::oneshot::error::TryRecvError;
        self.0.retain(|_, before| matches!(before.try_recv(), Err(TryRecvError::Empty)));
    }
}

impl Session {
    /// A new connection's session, logged in already if its client certificate names a user.
    pub fn new(
        ctx: &Arc<Ctx>,
        conn: ConnId,
        peer: Peer,
        registered: &Registered,
        closed: tokio::sync::watch::Receiver<()>,
    ) -> Session {
        let mut session = Session {
            conn,
            peer,
            greeted: false,
            authenticated: None,
            denials: auth::Denials::default(),
            compress: None,
            reads: 0,
            last_queue: None,
            closed,
            durable_publishes: InTurn::default(),
            offers_waiting: InTurn::default(),
        };
        if let Some(certified) = auth::with_certificate(ctx, &session.peer, conn) {
            match certified {
                Ok(a) => {
                    registered.set_user(&a.principal.user);
                    session.authenticated = Some(a);
                }
                Err(reason) => tracing::info!(conn, reason, "client certificate not accepted; a password may follow"),
            }
        }
        session
    }

    /// The queue called `name`, if there is one (the broker's `queue`, remembered for the next
    /// request: most connections name one queue again and again).
    pub fn queue(&mut self, ctx: &Ctx, name: &str) -> Option<Arc<Queue>> {
        let removed = ctx.broker.queues_removed();
        if let Some((last, found_at)) = &self.last_queue
            && *found_at == removed
            && let Some(queue) = last.upgrade()
            && queue.name == name
        {
            return Some(queue);
        }
        let queue = ctx.broker.queue(name)?;
        self.last_queue = Some((Arc::downgrade(&queue), removed));
        Some(queue)
    }

    /// Whether this connection may send what it likes (within the server's limits): it
    /// logged in, or the server has no users. Before that, requests are small (`input.rs`).
    pub fn trusted(&self, ctx: &Ctx) -> bool {
        ctx.trusts(self.authenticated.is_some())
    }

    pub fn principal(&self) -> Option<&Principal> {
        self.authenticated.as_ref().map(|a| &a.principal)
    }

    /// `Err`: why this connection may not make `request` (not logged in, or not allowed by the
    /// ACLs).
    pub fn admit(&mut self, ctx: &Ctx, request: &Request) -> Result<(), BrokerError> {
        if !matches!(request, Request::Hello { .. } | Request::Ping | Request::Auth { .. }) {
            ctx.broker.authenticated(self.principal())?;
        }
        if let Some((kind, name, actions)) = needs(request) {
            let principal = self.authenticated.as_ref().map(|a| &a.principal);
            auth::authorize(ctx, self.conn, principal, &mut self.denials, kind, name, actions)?;
        }
        Ok(())
    }

    pub fn hello(&mut self, ctx: &Ctx, wanted: u32) -> Response {
        self.greeted = true;
        let mut features = 0;
        // What this HELLO asks for is what is in force, a later one's too (a second HELLO
        // without ZSTD turns compression off for what is answered from now on; subscriptions
        // and served functions keep what they began with).
        self.compress = (wanted & features::ZSTD != 0 && ctx.config.compress_min_bytes > 0)
            .then_some(ctx.config.compress_min_bytes);
        if self.compress.is_some() {
            features |= features::ZSTD;
        }
        if ctx.broker.auth_enabled() && self.authenticated.is_none() {
            features |= features::AUTH_REQUIRED;
        }
        self.reads = wanted & (features::OFFER_REPEATS | features::QUEUE_FIGURES);
        features |= self.reads | (wanted & features::RETURN_UNSEEN);
        Response::Hello {
            server: format!("petrel/{}", env!("CARGO_PKG_VERSION")),
            max_frame: ctx.config.max_frame_bytes,
            features,
        }
    }

    /// Checks a password (slowly, and rate-limited per address); answered before the requests
    /// pipelined behind it are read.
    pub async fn auth(&mut self, ctx: &Arc<Ctx>, registered: &Registered, user: String, password: String) -> Response {
        if !ctx.broker.auth_enabled() {
            return Response::Done;
        }
        match auth::with_password(ctx, &self.peer, self.conn, user, password).await {
            Ok(a) => {
                registered.set_user(&a.principal.user);
                self.authenticated = Some(a);
                Response::Done
            }
            Err(reason) => Response::error(Status::Unauthorized, reason),
        }
    }
}

/// What a request touches, for the ACL check: the destination and the actions any of which
/// allows it. `None`: nothing beyond an authenticated user (or this connection's own handles).
fn needs(request: &Request) -> Option<(Kind, &str, &'static [Action])> {
    use Action::*;
    Some(match request {
        Request::QueueCreate { config, .. } if config.temporary => return None,
        Request::QueueCreate { name, .. } | Request::QueueRemove { name } => (Kind::Queue, name, &[Manage]),
        Request::QueueStatus { name } => (Kind::Queue, name, &[Offer, Poll]),
        Request::Offer { queue, .. } => (Kind::Queue, queue, &[Offer]),
        Request::Poll { queue, .. } => (Kind::Queue, queue, &[Poll]),
        Request::TopicCreate { name, .. } | Request::TopicRemove { name } => (Kind::Topic, name, &[Manage]),
        Request::Publish { topic, .. } => (Kind::Topic, topic, &[Publish]),
        Request::Subscribe { topic, .. } => (Kind::Topic, topic, &[Subscribe]),
        Request::TopicStatus { name } => (Kind::Topic, name, &[Publish, Subscribe]),
        Request::Serve { function } => (Kind::Function, function, &[Serve]),
        Request::Call { function, .. } => (Kind::Function, function, &[Exec]),
        Request::Hello { .. }
        | Request::Ping
        | Request::Auth { .. }
        | Request::QueueList
        | Request::TopicList
        | Request::Ack { .. }
        | Request::Abort { .. }
        | Request::TopicAck { .. }
        | Request::Unsubscribe { .. }
        | Request::Unserve { .. }
        | Request::Return { .. } => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue removed while something still holds it (so the session's weak reference to it
    /// still upgrades) and made again under its name: the session finds the new one, because it
    /// sees that the broker has removed a queue since it found the old one.
    #[test]
    fn a_queue_removed_while_still_held_and_made_again_is_found_anew() {
        let harness = crate::fuzzing::Harness::new();
        let ctx = harness.ctx();
        let peer = Peer::unix(None);
        let registered = crate::connections::Registry::open(ctx, 1, &peer, "native");
        let (_reading, closed) = tokio::sync::watch::channel(());
        let mut session = Session::new(ctx, 1, peer, &registered, closed);
        let config = petrel_proto::QueueConfig { durable: false, ..Default::default() };

        let old = ctx.broker.create_queue("q", config.clone(), None).unwrap();
        assert!(Arc::ptr_eq(&session.queue(ctx, "q").unwrap(), &old));
        ctx.broker.remove_queue("q").unwrap();
        assert!(session.queue(ctx, "q").is_none());
        let new = ctx.broker.create_queue("q", config, None).unwrap();
        let found = session.queue(ctx, "q").unwrap();
        assert!(Arc::ptr_eq(&found, &new), "the removed queue, still held elsewhere, was found");
        assert!(Arc::ptr_eq(&session.queue(ctx, "q").unwrap(), &new), "and remembered");
        drop(old);
    }
}
