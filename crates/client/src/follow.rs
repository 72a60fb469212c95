//! Readers that outlive their connection: when the server goes away (stops, restarts, drops the
//! connection), a [`Follower`] connects again with backoff and repeats what is safe to repeat.
//!
//! Only reads are followed. A poll taken again after a reconnect is safe: what the lost
//! connection had taken tentatively went back to the queue (a poll for good is taken tentatively
//! too, and acknowledged once its answer is in: see `Follower::poll`). A group subscription resumes where
//! the group stands: what was delivered and not acknowledged comes again (at least once). A live
//! subscription misses what was published while it was away. Offers are never repeated here: an
//! offer whose answer was lost may have been stored.

use std::sync::Arc;
use std::time::Duration;

use crate::{Client, ClientError, ClientOptions, Delivery, Message, PollOptions, StartFrom, Status, Subscription};

/// How long a follower's poll for good holds what it took before acknowledging it (at once,
/// unless its connection is lost, when the server gives it back with the connection).
const FOR_GOOD_VISIBILITY: Duration = Duration::from_secs(60);

/// Told of each loss and return of a follower's connection.
pub type EventHandler = Arc<dyn Fn(ConnectionEvent<'_>) + Send + Sync>;

/// How a follower waits for a server that went away, and whom it tells.
#[derive(Clone)]
pub struct Reconnect {
    /// The pause before the first attempt; each failed attempt doubles it, up to `max_pause`.
    pub first_pause: Duration,
    pub max_pause: Duration,
    /// Told of each loss and each return (the CLI says them on stderr).
    pub on_event: Option<EventHandler>,
}

impl Default for Reconnect {
    fn default() -> Self {
        Reconnect { first_pause: Duration::from_millis(100), max_pause: Duration::from_secs(5), on_event: None }
    }
}

/// The pause between tries of a consumer group another connection still holds (the server has
/// not yet seen that connection end): doubling from 100 ms up to 5 s.
pub(crate) struct HeldPause(Duration);

impl HeldPause {
    pub(crate) fn new() -> HeldPause {
        HeldPause(Duration::from_millis(100))
    }

    /// Sleeps the pause, and doubles it for the next try.
    pub(crate) async fn sleep(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Duration::from_secs(5));
    }
}

impl std::fmt::Debug for Reconnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconnect")
            .field("first_pause", &self.first_pause)
            .field("max_pause", &self.max_pause)
            .finish_non_exhaustive()
    }
}

/// What happened to a follower's connection.
#[derive(Debug)]
pub enum ConnectionEvent<'a> {
    /// The connection to `server` was lost with `error`; reconnecting.
    Lost { server: &'a str, error: &'a ClientError },
    /// Connected to `server` again.
    Connected { server: &'a str },
}

impl ClientError {
    /// The connection went away (the server stopped, restarted or dropped it), as opposed to
    /// an answer: connecting again may help.
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, ClientError::Io(_) | ClientError::Closed)
    }
}

/// A connection for reading a queue or a topic that comes back when its server does.
#[derive(Debug)]
pub struct Follower {
    server: String,
    options: ClientOptions,
    reconnect: Reconnect,
    client: Client,
    /// Seen lost by a call that does not reconnect itself (an acknowledgement); the next read does.
    lost: Option<ClientError>,
}

impl Follower {
    /// Connects to `server` as `Client::connect_with` does. The first connection is not retried:
    /// a wrong address or a refused password fail here, at once.
    pub async fn connect(server: &str, options: ClientOptions, reconnect: Reconnect) -> Result<Follower, ClientError> {
        let client = Client::connect_with(server, &options).await?;
        Ok(Follower { server: server.to_owned(), options, reconnect, client, lost: None })
    }

    /// The current connection, for what is not followed (offers, status); a reconnect replaces it.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Polls `queue`; a lost connection is waited for and the poll made again.
    ///
    /// A poll for good (no `visibility`) is taken tentatively and acknowledged as soon as its
    /// answer is in: taken for good, what a connection lost before the answer arrived had taken
    /// would be gone, while taken tentatively it goes back to the queue and comes with the poll
    /// made again. Its deliveries are handed out with handle 0, as a poll for good's are. If the
    /// acknowledgement fails (its connection lost, or the server's error), they are handed out
    /// all the same, and may come again (at least once, never lost).
    pub async fn poll(&mut self, queue: &str, options: PollOptions) -> Result<Vec<Delivery>, ClientError> {
        let for_good = options.visibility.is_none();
        let asked = PollOptions { visibility: Some(options.visibility.unwrap_or(FOR_GOOD_VISIBILITY)), ..options };
        loop {
            self.reconnect_if_lost().await?;
            match self.client.poll(queue, asked).await {
                Err(e) if e.is_connection_lost() => self.lost = Some(e),
                Ok(mut deliveries) if for_good && !deliveries.is_empty() => {
                    let handles: Vec<u64> = deliveries.iter().map(|d| d.handle).collect();
                    // (A server's error may still have acknowledged them: handed out, not lost.)
                    if let Err(e) = self.client.ack(queue, &handles).await
                        && e.is_connection_lost()
                    {
                        self.lost = Some(e);
                    }
                    deliveries.iter_mut().for_each(|d| d.handle = 0);
                    return Ok(deliveries);
                }
                other => return other,
            }
        }
    }

    /// Acknowledges tentative deliveries of the current connection. After a lost connection
    /// this answers 0: those deliveries went back to the queue and come again (at least once);
    /// the next poll reconnects.
    pub async fn ack(&mut self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
        if self.lost.is_some() {
            return Ok(0);
        }
        let answer = self.client.ack(queue, handles).await;
        self.zero_if_lost(answer)
    }

    /// `answer` of a request about the current connection's deliveries; a lost connection is
    /// noted (the next poll reconnects) and answers 0: they went back with it.
    fn zero_if_lost(&mut self, answer: Result<u32, ClientError>) -> Result<u32, ClientError> {
        match answer {
            Err(e) if e.is_connection_lost() => {
                self.lost = Some(e);
                Ok(0)
            }
            other => other,
        }
    }

    /// Gives back tentative deliveries of the current connection that the application never saw
    /// (`Client::give_back_unseen`). After a lost connection this answers 0: they went back
    /// with it.
    pub async fn give_back_unseen(&mut self, queue: &str, handles: &[u64]) -> Result<u32, ClientError> {
        if self.lost.is_some() {
            return Ok(0);
        }
        let answer = self.client.give_back_unseen(queue, handles).await;
        self.zero_if_lost(answer)
    }

    /// Subscribes to `topic` live (see `Client::subscribe`), again after each reconnect.
    pub async fn subscribe(self, topic: &str, buffer: u32) -> Result<FollowedSubscription, ClientError> {
        FollowedSubscription::start(self, topic, None, StartFrom::Resume, buffer).await
    }

    /// Reads durable `topic` as consumer group `group` from `from` (see `Client::subscribe_group`);
    /// after a reconnect, from where the group stands.
    pub async fn subscribe_group(
        self,
        topic: &str,
        group: &str,
        from: StartFrom,
        max_unacked: u32,
    ) -> Result<FollowedSubscription, ClientError> {
        FollowedSubscription::start(self, topic, Some(group.to_owned()), from, max_unacked).await
    }

    async fn reconnect_if_lost(&mut self) -> Result<(), ClientError> {
        let Some(lost) = self.lost.take() else { return Ok(()) };
        self.tell(ConnectionEvent::Lost { server: &self.server, error: &lost });
        self.client.close();
        let mut pause = self.reconnect.first_pause;
        loop {
            tokio::time::sleep(pause).await;
            match Client::connect_with(&self.server, &self.options).await {
                Ok(client) => {
                    self.client = client;
                    self.tell(ConnectionEvent::Connected { server: &self.server });
                    return Ok(());
                }
                // Anything but absence (a refused password, another service on the port) is
                // not waited out; a server at a connection limit is waited for as one away.
                Err(e) if e.is_connection_lost() || e.status() == Some(Status::LimitReached) => {
                    pause = (pause * 2).min(self.reconnect.max_pause)
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn tell(&self, event: ConnectionEvent<'_>) {
        if let Some(on_event) = &self.reconnect.on_event {
            on_event(event);
        }
    }
}

/// A topic subscription that subscribes again after a reconnect (see [`Follower`]).
#[derive(Debug)]
pub struct FollowedSubscription {
    follower: Follower,
    topic: String,
    group: Option<String>,
    buffer: u32,
    pub(crate) subscription: Option<Subscription>,
}

impl FollowedSubscription {
    async fn start(
        follower: Follower,
        topic: &str,
        group: Option<String>,
        from: StartFrom,
        buffer: u32,
    ) -> Result<FollowedSubscription, ClientError> {
        let mut followed =
            FollowedSubscription { follower, topic: topic.to_owned(), group, buffer, subscription: None };
        followed.subscription = Some(followed.subscribe(from).await?);
        Ok(followed)
    }

    async fn subscribe(&self, from: StartFrom) -> Result<Subscription, ClientError> {
        let client = &self.follower.client;
        match &self.group {
            Some(group) => client.subscribe_group(&self.topic, group, from, self.buffer).await,
            None => client.subscribe(&self.topic, self.buffer).await,
        }
    }

    /// The next message; `None` once the subscription is over (ended by `unsubscribe`, or by
    /// the server for a reason a reconnect does not cure, which is then the last item).
    /// A live subscription that fell behind (`SLOW_CONSUMER`) says so, and the next call
    /// subscribes again: what is published from then on comes.
    pub async fn next(&mut self) -> Option<Result<Message, ClientError>> {
        // Between tries of a consumer group still held by the connection the reconnect replaced.
        let mut held = HeldPause::new();
        loop {
            if let Some(subscription) = &mut self.subscription {
                match subscription.next().await {
                    Some(Err(e)) if e.is_connection_lost() => self.follower.lost = Some(e),
                    // The connection ended with a full buffer: the error did not fit.
                    None if self.follower.client.is_closed() => self.follower.lost = Some(ClientError::Closed),
                    Some(Err(e)) if e.status() == Some(Status::SlowConsumer) => {
                        self.subscription = None;
                        return Some(Err(e));
                    }
                    item => return item,
                }
                self.subscription = None;
            }
            if let Err(e) = self.follower.reconnect_if_lost().await {
                return Some(Err(e));
            }
            match self.subscribe(StartFrom::Resume).await {
                Ok(subscription) => self.subscription = Some(subscription),
                Err(e) if e.is_connection_lost() => self.follower.lost = Some(e),
                Err(e) if e.status() == Some(Status::Exists) && self.group.is_some() => held.sleep().await,
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Acknowledges group messages by id. After a lost connection this answers 0: they were not
    /// acknowledged and come again after the reconnect (at least once).
    pub async fn ack(&mut self, ids: &[u64]) -> Result<u32, ClientError> {
        let Some(subscription) = &self.subscription else { return Ok(0) };
        match subscription.ack(ids).await {
            Err(e) if e.is_connection_lost() => {
                self.follower.lost = Some(e);
                self.subscription = None;
                Ok(0)
            }
            other => other,
        }
    }

    /// Ends the subscription, waiting for the server to confirm.
    pub async fn unsubscribe(mut self) -> Result<(), ClientError> {
        match self.subscription.take() {
            Some(subscription) => subscription.unsubscribe().await,
            None => Ok(()),
        }
    }
}
