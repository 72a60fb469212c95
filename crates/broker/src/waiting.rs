//! Waiting on a queue: for a message to take, or for room to offer into. Every protocol that
//! blocks (a native POLL or OFFER with a timeout, a memcache `get` with `/t=`) waits here, so the
//! one subtle part — joining the line (`waitlist.rs`) *before* looking, so that a change between
//! the look and the wait is never missed — is written once. Waiters are served in the order
//! they came.
//!
//! The broker runs no timers: the caller says when to give up with a future of its own (a
//! deadline, a shutdown, a closed socket), and learns which of its reasons ended the wait.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use crate::{Broker, BrokerError, Queue};

/// What a wait is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitFor {
    /// Messages to take (the waiter counts in the queue's `waiters` figure meanwhile).
    Messages,
    /// Room to offer into.
    Room,
}

/// How a wait ended.
#[derive(Debug)]
pub enum Waited<T, Why> {
    /// The attempt succeeded.
    Ready(T),
    /// The caller's stop future finished first, with its reason.
    Stopped(Why),
}

impl Broker {
    /// Calls `attempt` on `queue` until it returns something, waking only when the queue may
    /// have changed in the way `what` names, or until `stop` finishes.
    ///
    /// Waiters are woken one at a time, oldest first (`waitlist.rs`). A queue removed while the
    /// caller waits is looked up again by name: `NotFound`, or the queue made anew under it. An
    /// error from `attempt` ends the wait.
    pub async fn wait_on_queue<T, Why>(
        &self,
        queue: Arc<Queue>,
        what: WaitFor,
        mut attempt: impl FnMut(&Arc<Queue>) -> Result<Option<T>, BrokerError>,
        stop: impl Future<Output = Why>,
    ) -> Result<Waited<T, Why>, BrokerError> {
        let mut stop = pin!(stop);
        let mut queue = queue;
        loop {
            {
                let line = match what {
                    WaitFor::Messages => &queue.available,
                    WaitFor::Room => &queue.room,
                };
                // In line before the first look, and kept across looks that find nothing: a
                // change after a look still wakes this ticket, and it stays ahead of later ones.
                let ticket = line.register();
                if !queue.is_removed() {
                    let mut counted = None;
                    loop {
                        ticket.arm();
                        match attempt(&queue) {
                            Ok(Some(ready)) => {
                                ticket.took();
                                return Ok(Waited::Ready(ready));
                            }
                            Ok(None) => {}
                            // (The change it was woken for, if it was, goes to the next in line:
                            // an attempt refused, say its right taken away, took nothing.)
                            Err(e) => {
                                ticket.took();
                                return Err(e);
                            }
                        }
                        if what == WaitFor::Messages && counted.is_none() {
                            counted = Some(queue.waiting());
                        }
                        let stopped = std::future::poll_fn(|cx| {
                            if let Poll::Ready(why) = stop.as_mut().poll(cx) {
                                return Poll::Ready(Some(why));
                            }
                            ticket.poll_woken(cx).map(|()| None)
                        })
                        .await;
                        if let Some(why) = stopped {
                            return Ok(Waited::Stopped(why));
                        }
                        if queue.is_removed() {
                            break;
                        }
                    }
                }
            }
            // Removed while waiting: gone (`NotFound`), or made anew under its name.
            queue = self.get(&queue.name)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{BrokerOptions, Message, QueueConfig};

    fn broker() -> (tempfile::TempDir, Arc<Broker>) {
        let dir = tempfile::tempdir().unwrap();
        let broker = Broker::open(dir.path(), BrokerOptions::default()).unwrap();
        broker.create_queue("q", QueueConfig::default(), None).unwrap();
        (dir, Arc::new(broker))
    }

    /// A broker with queue "full": one item, at its limit.
    fn full_queue() -> (tempfile::TempDir, Arc<Broker>) {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), BrokerOptions::default()).unwrap());
        broker.create_queue("full", QueueConfig { max_items: 1, ..QueueConfig::default() }, None).unwrap();
        broker.offer("full", vec![Message::new(&b"first"[..])], 0).unwrap();
        (dir, broker)
    }

    /// An attempt that offers `messages`, `None` while the queue is full.
    fn offer_into<'a>(
        broker: &'a Broker,
        messages: &'a mut Vec<Message>,
    ) -> impl FnMut(&Arc<Queue>) -> Result<Option<crate::Offered>, BrokerError> + 'a {
        move |q| match broker.offer_unsynced(q, messages, 0) {
            Err(BrokerError::Full(_)) => Ok(None),
            other => other.map(Some),
        }
    }

    fn take_one(broker: &Broker) -> impl FnMut(&Arc<Queue>) -> Result<Option<Message>, BrokerError> + '_ {
        move |q| Ok(broker.poll_from(q, 1, None, 1, 0)?.pop().map(|d| d.message))
    }

    #[tokio::test]
    async fn a_message_offered_while_waiting_ends_the_wait_and_the_waiter_was_counted() {
        let (_dir, broker) = broker();
        let offerer = Arc::clone(&broker);
        let offering = tokio::spawn(async move {
            let q = offerer.queue("q").unwrap();
            while q.counters().waiters == 0 {
                tokio::task::yield_now().await;
            }
            offerer.offer("q", vec![Message::new(&b"late"[..])], 0).unwrap();
        });
        let waited = broker.wait_on_queue(
            broker.queue("q").unwrap(),
            WaitFor::Messages,
            take_one(&broker),
            std::future::pending::<()>(),
        );
        match waited.await.unwrap() {
            Waited::Ready(m) => assert_eq!(&m.payload[..], b"late"),
            Waited::Stopped(()) => panic!("stopped without a reason to"),
        }
        offering.await.unwrap();
        assert_eq!(broker.queue("q").unwrap().counters().waiters, 0, "the waiter is no longer counted");
    }

    /// An offer waiting for room that is woken, does not fit, and then gives up passes on the
    /// wake-up it used: a smaller offer behind it gets the room at once, not at its timeout.
    #[tokio::test]
    async fn a_younger_offer_gets_in_once_an_older_one_that_did_not_fit_gives_up() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), BrokerOptions::default()).unwrap());
        broker.create_queue("q", QueueConfig { max_items: 2, ..QueueConfig::default() }, None).unwrap();
        broker.offer("q", vec![Message::new(&b"1"[..]), Message::new(&b"2"[..])], 0).unwrap();
        let older = {
            let broker = Arc::clone(&broker);
            tokio::spawn(async move {
                let mut two = vec![Message::new(&b"a"[..]), Message::new(&b"b"[..])];
                let q = broker.queue("q").unwrap();
                let gives_up = tokio::time::sleep(Duration::from_millis(200));
                let waited = broker.wait_on_queue(q, WaitFor::Room, offer_into(&broker, &mut two), gives_up);
                matches!(waited.await, Ok(Waited::Stopped(())))
            })
        };
        // (Offers waiting for room are not counted in `waiters`: a few turns of this
        // single-threaded runtime let each task reach its wait.)
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let younger = {
            let broker = Arc::clone(&broker);
            tokio::spawn(async move {
                let mut one = vec![Message::new(&b"c"[..])];
                let q = broker.queue("q").unwrap();
                let patience = tokio::time::sleep(Duration::from_secs(10));
                let waited = broker.wait_on_queue(q, WaitFor::Room, offer_into(&broker, &mut one), patience);
                matches!(waited.await, Ok(Waited::Ready(_)))
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(broker.poll("q", 1, None, 1, 0).unwrap().len(), 1, "room for one: the older offer is woken");
        assert!(older.await.unwrap(), "the older offer gave up");
        let got_in = tokio::time::timeout(Duration::from_secs(2), younger).await;
        assert!(matches!(got_in, Ok(Ok(true))), "the younger offer was left waiting beside room");
    }

    /// A circular queue's offer refused beside an open read (it cannot drop a message out with
    /// a consumer) gets in once the read comes back, dropping it: before, only consumers were
    /// woken, and the offer waited for its timeout.
    #[tokio::test]
    async fn a_circular_offer_waiting_beside_an_open_read_gets_in_when_it_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let broker = Arc::new(Broker::open(dir.path(), BrokerOptions::default()).unwrap());
        let ring = QueueConfig { circular: true, max_bytes: 10, ..QueueConfig::default() };
        broker.create_queue("ring", ring, None).unwrap();
        broker.offer("ring", vec![Message::new(&b"12345678"[..])], 0).unwrap();
        let out = broker.poll("ring", 1, Some(Duration::from_secs(60)), 1, 0).unwrap();
        let offering = {
            let broker = Arc::clone(&broker);
            tokio::spawn(async move {
                let mut m = vec![Message::new(&b"abcde"[..])];
                let q = broker.queue("ring").unwrap();
                let patience = tokio::time::sleep(Duration::from_secs(10));
                let waited = broker.wait_on_queue(q, WaitFor::Room, offer_into(&broker, &mut m), patience);
                matches!(waited.await, Ok(Waited::Ready(_)))
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(broker.abort("ring", &[out[0].handle], 1, 0, 0).unwrap(), 1);
        let got_in = tokio::time::timeout(Duration::from_secs(2), offering).await;
        assert!(matches!(got_in, Ok(Ok(true))), "not woken by the read's return");
    }

    /// A waiter woken first whose attempt fails (its right to poll taken away, say) takes
    /// nothing: the next in line is woken for the message, not left to its timeout.
    #[tokio::test]
    async fn a_waiter_whose_attempt_fails_passes_its_wake_up_on() {
        let (_dir, broker) = broker();
        let q = broker.queue("q").unwrap();
        let (first, second) = (Arc::clone(&broker), Arc::clone(&broker));
        let refused = tokio::spawn(async move {
            let mut looked = false;
            let attempt = move |_: &Arc<Queue>| match std::mem::replace(&mut looked, true) {
                false => Ok(None::<()>),
                true => Err(BrokerError::Forbidden("no longer allowed".into())),
            };
            first
                .wait_on_queue(first.queue("q").unwrap(), WaitFor::Messages, attempt, std::future::pending::<()>())
                .await
        });
        while q.counters().waiters < 1 {
            tokio::task::yield_now().await;
        }
        let taker = tokio::spawn(async move {
            let waited = second.wait_on_queue(
                second.queue("q").unwrap(),
                WaitFor::Messages,
                take_one(&second),
                tokio::time::sleep(Duration::from_secs(5)),
            );
            waited.await.map(|w| matches!(w, Waited::Ready(_)))
        });
        while q.counters().waiters < 2 {
            tokio::task::yield_now().await;
        }
        broker.offer("q", vec![Message::new(&b"m"[..])], 0).unwrap();
        assert!(matches!(refused.await.unwrap(), Err(BrokerError::Forbidden(_))));
        assert!(taker.await.unwrap().unwrap(), "the next in line took the message at once");
    }

    #[tokio::test]
    async fn the_stop_future_says_why_the_wait_ended() {
        let (_dir, broker) = broker();
        let waited = broker.wait_on_queue(broker.queue("q").unwrap(), WaitFor::Messages, take_one(&broker), async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            "deadline"
        });
        assert!(matches!(waited.await.unwrap(), Waited::Stopped("deadline")));
    }

    #[tokio::test]
    async fn a_queue_removed_while_waiting_ends_the_wait_with_not_found() {
        let (_dir, broker) = broker();
        let remover = Arc::clone(&broker);
        let removing = tokio::spawn(async move {
            while remover.queue("q").unwrap().counters().waiters == 0 {
                tokio::task::yield_now().await;
            }
            remover.remove_queue("q").unwrap();
        });
        let waited = broker.wait_on_queue(
            broker.queue("q").unwrap(),
            WaitFor::Messages,
            take_one(&broker),
            std::future::pending::<()>(),
        );
        assert!(matches!(waited.await, Err(BrokerError::NotFound(_))));
        removing.await.unwrap();
    }

    #[tokio::test]
    async fn a_wait_on_a_queue_removed_before_it_began_ends_with_not_found() {
        // The caller looked the queue up, then it was removed before the wait joined its line:
        // the removal's wake-up came too early for this waiter.
        let (_dir, broker) = broker();
        let stale = broker.queue("q").unwrap();
        broker.remove_queue("q").unwrap();
        let waited = broker.wait_on_queue(stale, WaitFor::Messages, |_| Ok(None::<()>), async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            "deadline"
        });
        let waited = tokio::time::timeout(Duration::from_secs(2), waited).await.expect("not left to its deadline");
        assert!(matches!(waited, Err(BrokerError::NotFound(_))));
    }

    #[tokio::test]
    async fn offers_waiting_for_room_get_in_in_the_order_they_came() {
        let (_dir, broker) = full_queue();
        let waiting_offer = |payload: &'static [u8]| {
            let broker = Arc::clone(&broker);
            tokio::spawn(async move {
                let mut messages = vec![Message::new(payload)];
                let waited = broker.wait_on_queue(
                    broker.queue("full").unwrap(),
                    WaitFor::Room,
                    offer_into(&broker, &mut messages),
                    std::future::pending::<()>(),
                );
                assert!(matches!(waited.await, Ok(Waited::Ready(_))));
            })
        };
        // One thread: each task runs to its wait before the next is spawned.
        let mut offers = Vec::new();
        for payload in [&b"a"[..], b"b", b"c"] {
            offers.push(waiting_offer(payload));
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        }
        let mut got = Vec::new();
        for _ in 0..4 {
            let polled = broker.poll_from(&broker.queue("full").unwrap(), 1, None, 1, 0).unwrap();
            got.extend(polled.into_iter().map(|d| d.message.payload.to_vec()));
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(got, [&b"first"[..], b"a", b"b", b"c"]);
        for offer in offers {
            offer.await.unwrap();
        }
    }

    #[tokio::test]
    async fn an_offer_waiting_for_room_in_a_queue_removed_meanwhile_ends_with_not_found() {
        let (_dir, broker) = full_queue();
        let remover = Arc::clone(&broker);
        let removing = tokio::spawn(async move {
            // Once the offer below has found the queue full and waits.
            tokio::time::sleep(Duration::from_millis(50)).await;
            remover.remove_queue("full").unwrap();
        });
        let mut second = vec![Message::new(&b"second"[..])];
        let waited = broker.wait_on_queue(
            broker.queue("full").unwrap(),
            WaitFor::Room,
            offer_into(&broker, &mut second),
            tokio::time::sleep(Duration::from_secs(10)),
        );
        let waited = tokio::time::timeout(Duration::from_secs(5), waited).await.expect("woken by the removal");
        assert!(matches!(waited, Err(BrokerError::NotFound(_))), "not NotFound");
        removing.await.unwrap();
    }
}
