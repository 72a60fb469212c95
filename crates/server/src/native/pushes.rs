//! The tasks that push to one connection: one per topic subscription (live or through a
//! consumer group), one for the invocations of the functions it serves. They share the
//! connection's writer through its bounded outbox; when the writer cannot keep up, a push task
//! waits, and its own bounded channel from the broker fills (a live subscriber is then ended by
//! the broker with SLOW_CONSUMER, a call goes to another server or fails).

use std::collections::{HashMap, HashSet};

use petrel_broker::{GroupAcks, Invocation};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::connection::{Closed, Connection};

#[derive(Default)]
pub(super) struct Pushes {
    pub subscriptions: HashMap<u64, JoinHandle<()>>,
    /// Group subscriptions: the feed's acknowledgements (dropping them ends the task), its task.
    pub groups: HashMap<u64, (GroupAcks, JoinHandle<()>)>,
    pub invocations: Option<(mpsc::Sender<Invocation>, JoinHandle<()>)>,
    /// The function names this connection serves (at most `max_functions_per_connection`).
    pub served: HashSet<String>,
    /// New subscriptions wait for these before their first push, so that the client has the
    /// SUBSCRIBE answer (still in the connection's answers) before any delivery.
    answered: Vec<oneshot::Sender<()>>,
}

impl Pushes {
    /// Whether the connection holds something its rights granted once and that runs on: a
    /// subscription, a group subscription, calls of served functions. (Subscriptions the server
    /// ended, and an invocation task left with no function served, hold nothing.)
    pub fn holds_grants(&mut self) -> bool {
        self.forget_ended();
        !self.subscriptions.is_empty() || !self.groups.is_empty() || !self.served.is_empty()
    }

    /// Lets go of the subscriptions whose task ended (SLOW_CONSUMER, TOPIC_NOT_FOUND): they
    /// push nothing more.
    pub fn forget_ended(&mut self) {
        self.subscriptions.retain(|_, task| !task.is_finished());
        self.groups.retain(|_, (_, task)| !task.is_finished());
    }

    /// A gate for a new subscription's task: opened once the answers before it have gone to the
    /// writer.
    pub fn after_answers(&mut self) -> oneshot::Receiver<()> {
        let (go, answered) = oneshot::channel();
        self.answered.push(go);
        answered
    }

    /// Hands the connection's answers to its writer, then lets new subscriptions push.
    pub async fn flush<S: AsyncRead + AsyncWrite + Send + 'static>(
        &mut self,
        connection: &mut Connection<S>,
    ) -> Result<(), Closed> {
        let sent = connection.flush().await;
        for go in self.answered.drain(..) {
            let _ = go.send(());
        }
        sent
    }

    /// Nothing pushes to this connection: it may be closed for idleness.
    pub fn is_empty(&mut self) -> bool {
        !self.holds_grants()
    }

    pub fn stop(&mut self) {
        for (_, task) in self.subscriptions.drain() {
            task.abort();
        }
        self.groups.clear();
        if let Some((_, task)) = self.invocations.take() {
            task.abort();
        }
        self.served.clear();
    }
}

/// Pushes hold at most a frame's worth of messages or one message (itself at most
/// `max_message_bytes`, well under a frame's 4 GiB), so this does not happen; if it did, the
/// push is left out (its buffer is empty) and said in the log, rather than sent with a wrong
/// length: `None` then, else what the encoding returned.
pub(super) fn not_sent_if_too_long<T>(encoded: Result<T, petrel_proto::EncodeError>) -> Option<T> {
    encoded.inspect_err(|e| tracing::error!(error = %e, "a push was not sent")).ok()
}
