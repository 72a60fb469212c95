//! The tasks waiting on a queue, served first come, first served.
//!
//! A consumer waiting for a message (or an offer waiting for room) takes a ticket once per wait
//! and keeps its place in line across wake-ups that found nothing. A change wakes **one** ticket,
//! the oldest not already woken: a message goes to the consumer that waited longest, and a
//! thousand waiters are not all woken for it. Wake-ups are passed along rather than counted:
//!
//! * a ticket that took something wakes the next one as it goes (`Ticket::took`), so a batch of
//!   messages, a sync or a tick that made several visible, reaches as many waiters as there are
//!   messages, one after another, and a wake-up for nothing costs one look;
//! * a ticket dropped after being woken, without taking (its caller gave up, timed out or went
//!   away at that moment), wakes the next one, so no wake-up is lost. In a line of offers
//!   waiting for room (`Waitlist::for_room`), so does one dropped after it used a wake-up to
//!   look and found nothing it could take: an offer that did not fit may leave room a smaller
//!   one behind it fits in. (Waiters for messages all want the same: one that found nothing
//!   leaves nothing for the next.)
//!
//! A ticket is registered *before* its holder looks at the queue, so a change made after the look
//! finds it in line (the look and the change both hold the queue's lock, which orders them).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

#[derive(Default)]
pub(crate) struct Waitlist {
    /// Tickets in line, read without the lock so that a change nobody waits for (most offers)
    /// costs one load.
    registered: AtomicUsize,
    line: Mutex<Line>,
    /// A ticket that looked and found nothing passes a wake-up on when it goes (offers waiting
    /// for room, whose needs differ).
    pass_on_looked: bool,
}

#[derive(Default)]
struct Line {
    next: u64,
    /// By arrival; at most one entry per live ticket.
    tickets: BTreeMap<u64, Slot>,
}

#[derive(Default)]
struct Slot {
    woken: bool,
    /// A wake-up was used to look (`arm` after one): the next in line looks when this goes.
    looked: bool,
    waker: Option<Waker>,
}

/// A place in a `Waitlist`'s line, given up when dropped.
pub(crate) struct Ticket<'a> {
    list: &'a Waitlist,
    seq: u64,
    took: bool,
}

impl Waitlist {
    fn line(&self) -> std::sync::MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A line of offers waiting for room.
    pub(crate) fn for_room() -> Waitlist {
        Waitlist { pass_on_looked: true, ..Waitlist::default() }
    }

    /// Joins the end of the line.
    pub(crate) fn register(&self) -> Ticket<'_> {
        let mut line = self.line();
        let seq = line.next;
        line.next += 1;
        line.tickets.insert(seq, Slot::default());
        self.registered.fetch_add(1, Ordering::SeqCst);
        Ticket { list: self, seq, took: false }
    }

    /// Wakes the oldest ticket not woken yet, if any.
    pub(crate) fn wake_one(&self) {
        if self.registered.load(Ordering::SeqCst) == 0 {
            return;
        }
        let waker = {
            let mut line = self.line();
            line.tickets.values_mut().find(|s| !s.woken).and_then(|slot| {
                slot.woken = true;
                slot.waker.take()
            })
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Wakes every ticket: for changes every waiter must see (the queue removed, its limits
    /// changed).
    pub(crate) fn wake_all(&self) {
        if self.registered.load(Ordering::SeqCst) == 0 {
            return;
        }
        let wakers: Vec<Waker> = {
            let mut line = self.line();
            line.tickets
                .values_mut()
                .filter_map(|slot| {
                    slot.woken = true;
                    slot.waker.take()
                })
                .collect()
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.registered.load(Ordering::SeqCst)
    }
}

impl Ticket<'_> {
    /// Forgets an earlier wake-up, before the holder looks again: a change after this wakes it
    /// anew.
    pub(crate) fn arm(&self) {
        if let Some(slot) = self.list.line().tickets.get_mut(&self.seq) {
            slot.looked |= slot.woken;
            slot.woken = false;
        }
    }

    /// Ready once woken since the last `arm`.
    pub(crate) fn poll_woken(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut line = self.list.line();
        let slot = line.tickets.get_mut(&self.seq).expect("a live ticket is in line");
        if slot.woken {
            return Poll::Ready(());
        }
        match &mut slot.waker {
            Some(w) => w.clone_from(cx.waker()),
            None => slot.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// The holder took what it waited for: the next in line looks too, as more may be there.
    pub(crate) fn took(mut self) {
        self.took = true;
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let slot = {
            let mut line = self.list.line();
            let slot = line.tickets.remove(&self.seq).expect("a live ticket is in line");
            self.list.registered.fetch_sub(1, Ordering::SeqCst);
            slot
        };
        if self.took || slot.woken || (slot.looked && self.list.pass_on_looked) {
            self.list.wake_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::task::Wake;

    use super::*;

    struct Flag(AtomicBool);

    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn waker() -> (Arc<Flag>, Waker) {
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        (Arc::clone(&flag), Waker::from(flag))
    }

    fn woken(flag: &Flag) -> bool {
        flag.0.swap(false, Ordering::SeqCst)
    }

    fn pending(t: &Ticket<'_>, w: &Waker) -> bool {
        t.poll_woken(&mut Context::from_waker(w)).is_pending()
    }

    #[test]
    fn one_wake_up_goes_to_the_oldest_ticket_and_is_passed_on_when_it_takes() {
        let list = Waitlist::default();
        let (tickets, flags): (Vec<_>, Vec<_>) = (0..3)
            .map(|_| {
                let t = list.register();
                let (flag, w) = waker();
                assert!(pending(&t, &w));
                (t, (flag, w))
            })
            .unzip();
        list.wake_one();
        assert_eq!(flags.iter().map(|(f, _)| woken(f)).collect::<Vec<_>>(), [true, false, false]);
        let mut tickets = tickets.into_iter();
        let first = tickets.next().unwrap();
        assert!(!pending(&first, &flags[0].1));
        first.took();
        assert_eq!(flags.iter().map(|(f, _)| woken(f)).collect::<Vec<_>>(), [false, true, false]);
        assert_eq!(list.len(), 2);
    }

    #[test]
    fn a_ticket_that_found_nothing_keeps_its_place() {
        let list = Waitlist::default();
        let a = list.register();
        let b = list.register();
        let ((fa, wa), (fb, wb)) = (waker(), waker());
        assert!(pending(&a, &wa) && pending(&b, &wb));
        list.wake_one();
        assert!(woken(&fa));
        // `a` looked, found nothing (another took it), and waits again: still first.
        a.arm();
        assert!(pending(&a, &wa));
        list.wake_one();
        assert!(woken(&fa) && !woken(&fb));
    }

    #[test]
    fn a_woken_ticket_dropped_without_taking_passes_the_wake_up_on() {
        let list = Waitlist::default();
        let a = list.register();
        let b = list.register();
        let ((_fa, wa), (fb, wb)) = (waker(), waker());
        assert!(pending(&a, &wa) && pending(&b, &wb));
        list.wake_one();
        drop(a);
        assert!(woken(&fb));
        // One that used its wake-up to look, found nothing and then went passes nothing on in
        // a line for messages (what it did not find, the next would not either)...
        let c = list.register();
        let (fc, wc) = waker();
        assert!(pending(&c, &wc));
        b.arm();
        drop(b);
        assert!(!woken(&fc));
        drop(c);
        // ...and passes it on in a line for room (an offer that did not fit: a smaller one
        // behind may).
        let room = Waitlist::for_room();
        let (a, b) = (room.register(), room.register());
        let ((_fa, wa), (fb, wb)) = (waker(), waker());
        assert!(pending(&a, &wa) && pending(&b, &wb));
        room.wake_one();
        a.arm();
        drop(a);
        assert!(woken(&fb));
        drop(b);
        // A ticket dropped never woken (its caller gave up) passes nothing on.
        let (d, e) = (list.register(), list.register());
        let ((_fd, wd), (fe, we)) = (waker(), waker());
        assert!(pending(&d, &wd) && pending(&e, &we));
        drop(d);
        assert!(!woken(&fe));
    }

    #[test]
    fn wake_all_wakes_every_ticket_and_an_empty_list_costs_nothing() {
        let list = Waitlist::default();
        list.wake_one();
        list.wake_all();
        let ts: Vec<_> = (0..4).map(|_| list.register()).collect();
        let ws: Vec<_> = (0..4).map(|_| waker()).collect();
        assert!(ts.iter().zip(&ws).all(|(t, (_, w))| pending(t, w)));
        list.wake_all();
        assert!(ws.iter().all(|(f, _)| woken(f)));
        assert!(ts.iter().zip(&ws).all(|(t, (_, w))| !pending(t, w)));
    }
}
