//! A durable queue's delayed messages: a log of their own (`delayed/` under the queue's
//! directory), in the order they were offered or returned, and what the queue keeps in memory to
//! hand each one to its level's log when it is due.
//!
//! Memory is bounded whatever the number of delayed messages: the timers hold the earliest-due
//! `cap` of them (16 bytes each, in a `TimerSet`); the rest are "spilled", known only to be due later
//! than every one held, and found again by reading the log when the timers run low — a slice of
//! the log per tick (`REFILL_SLICE`), so that a refill never holds the queue for long, while the
//! held timers go on coming due. Beside that,
//! one bit per record of the log from the oldest one not yet done ("done": moved to its level's
//! log, or dropped by a flush; markers are done too). Retention takes what is before the oldest
//! record still needed (`repin`).
//!
//! A due message is copied to its level's log and then marked done here by a `moved` marker; the
//! copy names the record it came from, so a crash between the two is repaired on open (the copy
//! counts, the original is marked done). A message returned with a delay is copied here from its
//! level's log, then acknowledged there; the copy names its original, and on open a copy whose
//! original is still unacknowledged is dropped (the original is handed out again, only without
//! its delay).

use std::collections::{BTreeSet, BinaryHeap, HashSet, VecDeque};

use petrel_log::{ConsumerGroup, GroupOptions, SeekTo, SharedLog};

use crate::BrokerError;
use crate::message::{self, Message, Placement};

/// Delayed messages a queue's timers hold at most; later ones are found again in its log.
pub(crate) const MAX_TIMERS: usize = 65_536;
/// Due messages one tick moves from a queue's delayed log at most (the rest on the next tick, at
/// once): one tick's work under the queue's lock stays bounded.
pub(crate) const MAX_MOVES_PER_TICK: usize = 16_384;
/// Bytes of due messages one tick holds in memory at most while it copies them (and at least
/// one message): large messages move a few per tick.
pub(crate) const MAX_MOVE_BYTES: usize = 32 << 20;
/// How long a tick reads the log for a refill at most (and then at least 256 records, so that
/// it ends): the queue's lock is held that long, and ticks come every millisecond while a
/// refill goes on.
pub(crate) const REFILL_SLICE: std::time::Duration = std::time::Duration::from_micros(500);
/// The group that marks where a delayed log is still needed.
const PIN_GROUP: &str = "broker";

/// A sorted set of timers, (due, offset), cheap when they come in due order: those at or after
/// the latest of an ordered run join its end (O(1), and so do their pops from the front); only
/// one due earlier than the run's end goes into a B-tree. Messages with one delay for all — most
/// delayed offers — then never touch the tree; a mix of delays sends the shorter ones there.
/// Each part is sorted, so the set's first and last are the smaller first and the larger last.
#[derive(Debug, Default)]
struct TimerSet {
    run: VecDeque<(u64, u64)>,
    tree: BTreeSet<(u64, u64)>,
}

impl TimerSet {
    fn len(&self) -> usize {
        self.run.len() + self.tree.len()
    }

    fn insert(&mut self, key: (u64, u64)) {
        match self.run.back() {
            Some(&end) if key < end => {
                self.tree.insert(key);
            }
            _ => self.run.push_back(key),
        }
    }

    fn first(&self) -> Option<&(u64, u64)> {
        match (self.run.front(), self.tree.first()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn last(&self) -> Option<&(u64, u64)> {
        match (self.run.back(), self.tree.last()) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    fn pop_first(&mut self) -> Option<(u64, u64)> {
        match (self.run.front(), self.tree.first()) {
            (Some(a), Some(b)) if b < a => self.tree.pop_first(),
            (Some(_), _) => self.run.pop_front(),
            (None, _) => self.tree.pop_first(),
        }
    }

    /// Puts back keys just popped from the front, in the order they were popped: each is no
    /// later than every key left, so they go back to the run's front.
    fn unpop(&mut self, popped: &[(u64, u64)]) {
        debug_assert!(popped.is_sorted(), "popped in order");
        debug_assert!(popped.last().zip(self.first()).is_none_or(|(p, f)| p <= f), "popped from the front");
        popped.iter().rev().for_each(|&k| self.run.push_front(k));
    }

    fn pop_last(&mut self) -> Option<(u64, u64)> {
        match (self.run.back(), self.tree.last()) {
            (Some(a), Some(b)) if b > a => self.tree.pop_last(),
            (Some(_), _) => self.run.pop_back(),
            (None, _) => self.tree.pop_last(),
        }
    }

    fn clear(&mut self) {
        self.run.clear();
        self.tree.clear();
    }
}

impl Extend<(u64, u64)> for TimerSet {
    fn extend<I: IntoIterator<Item = (u64, u64)>>(&mut self, keys: I) {
        keys.into_iter().for_each(|k| self.insert(k));
    }
}

/// The earliest-due delayed messages, at most `cap` of them, as (due, offset).
#[derive(Debug)]
pub(crate) struct Timers {
    held: TimerSet,
    /// Delayed messages not held: each due later than every one held (or, when none is held,
    /// unknown).
    spilled: u64,
    cap: usize,
    /// A refill under way: what is spilled meanwhile goes to it too (the log is read only up to
    /// where it ended when the refill began).
    refilling: Option<Refill>,
}

impl Timers {
    pub fn new(cap: usize) -> Timers {
        assert!(cap >= 4, "room for a few timers");
        Timers { held: TimerSet::default(), spilled: 0, cap, refilling: None }
    }

    fn spill(&mut self, key: (u64, u64)) {
        self.spilled += 1;
        if let Some(refill) = &mut self.refilling {
            refill.add_spilled(key);
        }
    }

    pub fn len(&self) -> u64 {
        self.held.len() as u64 + self.spilled
    }

    pub fn insert(&mut self, due: u64, offset: u64) {
        let key = (due, offset);
        if self.spilled == 0 && self.held.len() < self.cap {
            self.held.insert(key);
            return;
        }
        // Only one due before the latest held may be held: a spilled one may be due before it.
        match self.held.last() {
            Some(&latest) if key < latest => {
                self.held.insert(key);
                if self.held.len() > self.cap {
                    let latest = self.held.pop_last().expect("over the cap, so not empty");
                    self.spill(latest);
                }
            }
            _ => self.spill(key),
        }
    }

    /// When the earliest held message is due (`None`: none held).
    pub fn next_due(&self) -> Option<u64> {
        self.held.first().map(|(due, _)| *due)
    }

    /// The earliest held message, as (due, offset), if it is due at `now_ns`.
    pub fn pop_due(&mut self, now_ns: u64) -> Option<(u64, u64)> {
        match self.held.first() {
            Some(&(due, _)) if due <= now_ns => self.held.pop_first(),
            _ => None,
        }
    }

    /// Holds again timers just taken with `pop_due` (no insert since): they were the earliest,
    /// so they stay held whatever is spilled, and a tick that moved only some of them finds the
    /// rest at once.
    fn unpop(&mut self, popped: &[(u64, u64)]) {
        self.held.unpop(popped);
    }

    /// Whether the held timers ran low while some are spilled, and no refill is under way
    /// (half the cap: the held half lasts while the refill reads the log).
    pub fn wants_refill(&self) -> bool {
        self.spilled > 0 && self.held.len() <= self.cap / 2 && self.refilling.is_none()
    }

    /// Holds the earliest of the spilled ones again, from `pending`: every delayed message not
    /// done, held or not, as (due, offset).
    #[cfg(test)]
    pub fn refill(&mut self, pending: impl Iterator<Item = (u64, u64)>) {
        self.start_refill();
        pending.for_each(|key| self.consider(key));
        self.finish_refill();
    }

    fn start_refill(&mut self) {
        let room = self.cap - self.held.len();
        let best = BinaryHeap::with_capacity(room + 1);
        self.refilling = Some(Refill { latest_held: self.held.last().copied(), room, best, spilled: 0 });
    }

    /// A pending delayed message read from the log during a refill.
    fn consider(&mut self, key: (u64, u64)) {
        let refill = self.refilling.as_mut().expect("a refill under way");
        if refill.latest_held.is_none_or(|latest| key > latest) {
            refill.add_spilled(key);
        }
    }

    fn finish_refill(&mut self) {
        let refill = self.refilling.take().expect("a refill under way");
        debug_assert_eq!(refill.spilled, self.spilled, "every spilled timer is pending in the log");
        self.spilled = refill.spilled - refill.best.len() as u64;
        // Each later than every one held: in order, they join the run's end.
        self.held.extend(refill.best.into_sorted_vec());
        // Those delayed meanwhile may have filled the held ones: the latest are spilled again
        // (later than every one left held, and than those still spilled).
        while self.held.len() > self.cap {
            self.held.pop_last();
            self.spilled += 1;
        }
    }

    pub fn clear(&mut self) {
        self.held.clear();
        self.spilled = 0;
        self.refilling = None;
    }
}

/// A refill in progress: the earliest `room` of the spilled timers seen so far (a max-heap).
#[derive(Debug)]
struct Refill {
    latest_held: Option<(u64, u64)>,
    room: usize,
    best: BinaryHeap<(u64, u64)>,
    spilled: u64,
}

impl Refill {
    /// A spilled delayed message: from the log, or spilled since the refill began.
    fn add_spilled(&mut self, key: (u64, u64)) {
        self.spilled += 1;
        self.best.push(key);
        if self.best.len() > self.room {
            self.best.pop();
        }
    }
}

/// Which records of a delayed log are done, from `base` on (all before it are).
#[derive(Debug, Default)]
pub(crate) struct Done {
    base: u64,
    words: VecDeque<u64>,
    /// Records covered from `base` on.
    len: u64,
}

impl Done {
    fn starting_at(base: u64) -> Done {
        Done { base, ..Done::default() }
    }

    fn end(&self) -> u64 {
        self.base + self.len
    }

    /// The next record of the log, done or not.
    fn push(&mut self, done: bool) {
        if self.len.is_multiple_of(64) {
            self.words.push_back(0);
        }
        self.len += 1;
        if done {
            self.set(self.end() - 1);
        }
    }

    fn set(&mut self, offset: u64) {
        if offset < self.base {
            return;
        }
        assert!(offset < self.end(), "a delayed log's record is covered before it is marked done");
        let i = offset - self.base;
        self.words[(i / 64) as usize] |= 1 << (i % 64);
    }

    fn is_done(&self, offset: u64) -> bool {
        if offset < self.base {
            return true;
        }
        let i = offset - self.base;
        i < self.len && self.words[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// The oldest record not done (`end` if all are), dropping the words before it.
    fn first_pending(&mut self) -> u64 {
        while self.words.len() > 1 && self.words[0] == u64::MAX {
            self.words.pop_front();
            self.base += 64;
            self.len -= 64;
        }
        let first = self.base + u64::from(self.words.front().map_or(0, |w| w.trailing_ones()));
        first.min(self.end())
    }

    /// The records not done, oldest first.
    fn pending(&self) -> impl Iterator<Item = u64> + '_ {
        (self.base..self.end()).filter(|o| !self.is_done(*o))
    }
}

/// A durable queue's delayed log and its timers.
pub(crate) struct DelayLog {
    pub log: SharedLog,
    /// Stands at the oldest record still needed: retention takes what is before it.
    pin: ConsumerGroup,
    timers: Timers,
    done: Done,
    /// A refill's reading of the log: the next offset, and where the log ended when it began.
    scan: Option<(u64, u64)>,
}

/// What opening a delayed log found.
#[derive(Debug, Default)]
pub(crate) struct Reopened {
    /// Delayed messages not done.
    pub pending: u64,
    /// Their bytes (`Message::size`).
    pub bytes: u64,
    /// Idempotency keys its records hold: (when stored, offset, key).
    pub keys: Vec<(u64, u64, String)>,
    /// The time of its last record (0: none).
    pub last_stamp: u64,
}

impl DelayLog {
    /// A new, empty delayed log.
    pub fn create(log: SharedLog, cap: usize) -> Result<DelayLog, BrokerError> {
        let pin = log.group(PIN_GROUP, GroupOptions::default())?;
        let done = Done::starting_at(log.next_offset());
        Ok(DelayLog { log, pin, timers: Timers::new(cap), done, scan: None })
    }

    /// Opens a delayed log that may hold messages. `moved`: offsets its levels' logs hold copies
    /// of; `original_waits(id)`: whether the level's record with queue id `id` (a returned
    /// message's original) is still unacknowledged.
    pub fn open(
        log: SharedLog,
        cap: usize,
        moved: &HashSet<u64>,
        original_waits: impl Fn(u64) -> bool,
    ) -> Result<(DelayLog, Reopened), BrokerError> {
        let pin = log.group(PIN_GROUP, GroupOptions::default())?;
        let start = pin.committed();
        let mut done = Done::starting_at(start);
        // First the markers (each follows the records it names), then the messages.
        for_each_record(&log, start, |r| {
            assert_eq!(r.offset, done.end(), "a log's offsets are dense");
            match message::control(r) {
                Some(message::Control::Moved(offsets)) => {
                    done.push(true);
                    offsets.into_iter().for_each(|o| done.set(o));
                }
                Some(message::Control::Returned(_)) => done.push(true),
                None => done.push(moved.contains(&r.offset)),
            }
        })?;
        let mut reopened = Reopened::default();
        let mut timers = Timers::new(cap);
        let mut repaired = Vec::new();
        for_each_record(&log, start, |r| {
            if message::control(r).is_some() {
                return;
            }
            if let Some(key) = message::idempotency_key(r) {
                reopened.keys.push((r.timestamp, r.offset, String::from_utf8_lossy(key).into_owned()));
            }
            if done.is_done(r.offset) {
                return;
            }
            let placement = message::placement(r);
            if moved.contains(&r.offset) || placement.returned_from.is_some_and(&original_waits) {
                repaired.push(r.offset);
                return;
            }
            timers.insert(message::deliver_at(r), r.offset);
            reopened.pending += 1;
            reopened.bytes += message::from_record(r).size();
        })?;
        if let Some(last) = log.next_offset().checked_sub(1) {
            let mut reader = log.reader();
            reader.seek(last);
            reopened.last_stamp = reader.read_batch(1)?.into_iter().map(|r| r.timestamp).max().unwrap_or(0);
        }
        let mut delay = DelayLog { log, pin, timers, done, scan: None };
        // Copies the levels' logs hold, and returned copies whose original stayed: done now.
        delay.mark_done(&repaired)?;
        Ok((delay, reopened))
    }

    /// Whether a refill is under way (`refill_step` goes on with it).
    pub fn refilling(&self) -> bool {
        self.scan.is_some()
    }

    /// Delayed messages not done.
    pub fn pending(&self) -> u64 {
        self.timers.len()
    }

    /// When the earliest delayed message is due (`None`: none is held; see `refill`).
    pub fn next_due(&self) -> Option<u64> {
        self.timers.next_due()
    }

    /// Appends `messages` (each with its `deliver_at` set) with their placements.
    pub fn append(
        &mut self,
        messages: &[Message],
        placements: &[Placement],
    ) -> Result<std::ops::Range<u64>, BrokerError> {
        let range = message::append_placed(&self.log, messages, placements)?;
        assert_eq!(range.start, self.done.end(), "only the queue appends to its delayed log");
        for (m, offset) in messages.iter().zip(range.clone()) {
            debug_assert!(m.deliver_at != 0, "a delayed message says when it is due");
            self.done.push(false);
            self.timers.insert(m.deliver_at, offset);
        }
        Ok(range)
    }

    /// Up to `max` timers due at `now_ns`, earliest first, as (due, offset), taken out of the
    /// timers (`take_due` puts back what it does not move).
    fn pop_due(&mut self, now_ns: u64, max: usize) -> Vec<(u64, u64)> {
        std::iter::from_fn(|| self.timers.pop_due(now_ns)).take(max).collect()
    }

    /// The delayed messages due at `now_ns`, earliest first: at most `max` of them, and as many
    /// as fit in `max_bytes` (at least one). Returns their offsets and their copies for their
    /// levels (`top` the highest); they stay pending until `mark_done`. Those due but beyond the
    /// bytes stay held, the first ones the next call takes.
    pub fn take_due(
        &mut self,
        now_ns: u64,
        max: usize,
        top: usize,
        max_bytes: usize,
    ) -> Result<(Vec<u64>, message::DueCopies), BrokerError> {
        /// Records read at a time: past the bytes, at most this many are read for nothing.
        const READ_AT_A_TIME: usize = 64;
        let taken = self.pop_due(now_ns, max);
        let mut offsets: Vec<u64> = taken.iter().map(|&(_, offset)| offset).collect();
        let mut copies = message::DueCopies::default();
        let mut reader = self.log.reader();
        let mut full = false;
        for chunk in offsets.chunks(READ_AT_A_TIME) {
            let mut found = 0;
            let read = reader.get_many(chunk, |_, r| {
                found += 1;
                // In order: once one does not fit, none after it is taken either.
                full = full || (!copies.copies().is_empty() && copies.bytes() + r.payload.len() > max_bytes);
                if !full {
                    copies.add(&r, top);
                }
            });
            if let Err(e) = read {
                self.timers.unpop(&taken);
                return Err(e.into());
            }
            assert_eq!(found, chunk.len(), "a pending delayed record is in the log");
            if full {
                break;
            }
        }
        let moving = copies.copies().len();
        self.timers.unpop(&taken[moving..]);
        offsets.truncate(moving);
        Ok((offsets, copies))
    }

    /// The delayed messages at `offsets`, with their placements (one reader for them all).
    pub fn read(&self, offsets: &[u64]) -> Result<Vec<(Message, Placement)>, BrokerError> {
        let mut reader = self.log.reader();
        let mut out = Vec::with_capacity(offsets.len());
        for &offset in offsets {
            if reader.position() != offset {
                reader.seek(offset);
            }
            let batch = reader.read_batch(1)?;
            let r = batch.into_iter().next().filter(|r| r.offset == offset);
            let r = r.expect("a pending delayed record is in the log");
            out.push((message::from_record(&r), message::placement(&r)));
        }
        Ok(out)
    }

    /// Marks the delayed messages at `offsets` done (taken out of the timers before), in one
    /// marker.
    pub fn mark_done(&mut self, offsets: &[u64]) -> Result<(), BrokerError> {
        if offsets.is_empty() {
            return Ok(());
        }
        let marker = message::append_moved(&self.log, offsets)?;
        assert_eq!(marker, self.done.end(), "only the queue appends to its delayed log");
        self.done.push(true);
        offsets.iter().for_each(|&o| self.done.set(o));
        Ok(())
    }

    /// Holds the earliest spilled timers again once the held ones ran low, reading the log's
    /// pending records for at most `slice` (and at least 256 of them) at a time: a refill reads
    /// every one, the price of bounded memory, paid once per cap/2 due messages. Returns whether
    /// a refill is under way.
    pub fn refill_step(&mut self, slice: std::time::Duration) -> Result<bool, BrokerError> {
        if self.scan.is_none() {
            if !self.timers.wants_refill() {
                return Ok(false);
            }
            self.timers.start_refill();
            self.scan = Some((self.done.first_pending(), self.log.next_offset()));
        }
        let (mut next, end) = self.scan.expect("a refill under way");
        let mut reader = self.log.reader();
        reader.seek(next);
        let started = std::time::Instant::now();
        while next < end {
            if next != self.scan.expect("a refill under way").0 && started.elapsed() >= slice {
                break; // (a batch at least per step)
            }
            let batch = reader.read_batch(256)?;
            if batch.is_empty() {
                break; // (retention cannot take pending records: the pin stands before them)
            }
            for r in batch.into_iter().take_while(|r| r.offset < end) {
                if !self.done.is_done(r.offset) && message::control(&r).is_none() {
                    self.timers.consider((message::deliver_at(&r), r.offset));
                }
                next = r.offset + 1;
            }
        }
        if next < end {
            self.scan = Some((next, end));
            return Ok(true);
        }
        self.scan = None;
        self.timers.finish_refill();
        Ok(false)
    }

    /// Every pending delayed message's offset, the timers cleared (a flush drops them all; the
    /// caller marks them done).
    pub fn drain(&mut self) -> Vec<u64> {
        self.timers.clear();
        self.scan = None;
        self.done.pending().collect()
    }

    /// Lets retention take what is before the oldest record still needed: the oldest pending,
    /// or `oldest_key` (the oldest offset holding a remembered idempotency key), the earlier.
    pub fn repin(&mut self, oldest_key: Option<u64>) -> Result<(), BrokerError> {
        let needed = self.done.first_pending().min(oldest_key.unwrap_or(u64::MAX));
        if needed > self.pin.committed() {
            self.pin.seek(SeekTo::Offset(needed))?;
        }
        Ok(())
    }
}

/// Calls `f` with each record of `log` from `start` to its end.
fn for_each_record(log: &SharedLog, start: u64, mut f: impl FnMut(&petrel_log::Record<'_>)) -> Result<(), BrokerError> {
    let mut reader = log.reader();
    reader.seek(start);
    loop {
        let batch = reader.read_batch(4096)?;
        if batch.is_empty() {
            return Ok(());
        }
        batch.into_iter().for_each(|r| f(&r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_hold_the_earliest_and_find_the_spilled_again() {
        let mut timers = Timers::new(8);
        let mut all: Vec<(u64, u64)> = (0..100u64).map(|o| ((o * 7919) % 101, o)).collect();
        for &(due, offset) in &all {
            timers.insert(due, offset);
        }
        assert_eq!(timers.len(), 100);
        all.sort_unstable();
        let mut out = Vec::new();
        let mut pending: BTreeSet<(u64, u64)> = all.iter().copied().collect();
        while let Some((_, offset)) = timers.pop_due(u64::MAX) {
            let key = *pending.iter().find(|k| k.1 == offset).unwrap();
            pending.remove(&key);
            out.push(key);
            if timers.wants_refill() {
                timers.refill(pending.iter().copied());
            }
            // New ones keep arriving, some due before the spilled ones.
            if out.len() == 20 {
                timers.insert(50, 1000);
                timers.insert(1000, 1001);
                pending.extend([(50, 1000), (1000, 1001)]);
                all.extend([(50, 1000), (1000, 1001)]);
            }
        }
        assert_eq!(timers.len(), 0);
        let mut sorted = out.clone();
        sorted.sort_unstable();
        assert_eq!(out.len(), 102);
        // In due order, except for the late arrival: it is held as soon as it comes (due 50 <
        // the latest held), so it comes out in its place among those not yet handed out.
        assert_eq!(out, sorted);
    }

    /// A refill read a few records per step while messages come due and new ones are delayed
    /// (some due before the spilled ones, some after): each comes out once, in due order.
    #[test]
    fn a_refill_read_in_slices_misses_nothing_delayed_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let log = petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(log, 8).unwrap();
        let message = |due: u64| Message { deliver_at: due, ..Message::new(due.to_be_bytes().to_vec()) };
        let offer = |delay: &mut DelayLog, dues: &[u64]| {
            let messages: Vec<Message> = dues.iter().map(|&d| message(d)).collect();
            delay.append(&messages, &vec![Placement::default(); messages.len()]).unwrap();
        };
        let dues: Vec<u64> = (0..600u64).map(|i| 1_000 + (i * 37) % 600 * 10).collect();
        offer(&mut delay, &dues);
        let mut expected: Vec<u64> = dues.clone();
        let (mut out, mut now, mut refills) = (Vec::new(), 1_000, 0);
        while out.len() < expected.len() {
            let due: Vec<u64> = delay.pop_due(now, 4).into_iter().map(|(_, offset)| offset).collect();
            for (m, _) in delay.read(&due).unwrap() {
                out.push(m.deliver_at);
            }
            delay.mark_done(&due).unwrap();
            if delay.refilling() {
                refills += 1;
            }
            delay.refill_step(std::time::Duration::ZERO).unwrap(); // one batch a step
            if out.len() == 10 {
                // Delayed during a refill: one due soon, one among the spilled, one last.
                let more = [now + 5, 3_005, 50_000];
                offer(&mut delay, &more);
                expected.extend(more);
            }
            if due.is_empty() && !delay.refilling() {
                now += 5;
            }
        }
        assert!(refills > 3, "refills went on over several steps");
        assert_eq!(delay.pending(), 0);
        expected.sort_unstable();
        assert_eq!(out, expected, "each once, in due order");
    }

    #[test]
    fn done_bits_trim_from_the_front() {
        let mut done = Done::starting_at(10);
        for i in 0..200 {
            done.push(i % 3 == 0);
        }
        assert_eq!(done.first_pending(), 11);
        for o in 10..150 {
            done.set(o);
        }
        assert_eq!(done.first_pending(), 150);
        assert!(done.words.len() <= 2, "words before the first pending are dropped");
        assert!(done.is_done(5) && done.is_done(151) && !done.is_done(150) && !done.is_done(152));
        assert_eq!(done.pending().count(), (150..210).filter(|o| (o - 10) % 3 != 0).count());
    }

    #[test]
    fn due_messages_beyond_a_ticks_bytes_wait_for_the_next_tick_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let log = petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        // Room for four timers: six of the ten messages are spilled to begin with.
        let mut delay = DelayLog::create(log, 4).unwrap();
        let messages: Vec<Message> =
            (0..10u8).map(|i| Message { deliver_at: 1_000, ..Message::new(vec![i; 1000]) }).collect();
        delay.append(&messages, &vec![Placement::default(); messages.len()]).unwrap();
        let (mut moved, mut per_tick, mut refills) = (Vec::new(), Vec::new(), 0);
        while delay.pending() > 0 {
            if delay.next_due().is_none() {
                refills += 1;
                while delay.refill_step(std::time::Duration::ZERO).unwrap() {}
            }
            let (offsets, copies) = delay.take_due(2_000, MAX_MOVES_PER_TICK, 0, 2_500).unwrap();
            let n = copies.copies().len();
            assert!(n >= 1 && copies.bytes() <= 2_500, "at least one, and within the bytes");
            assert_eq!(offsets.len(), n);
            moved.extend_from_slice(&offsets);
            delay.mark_done(&offsets).unwrap();
            per_tick.push(n);
        }
        assert_eq!(per_tick, [2; 5]);
        assert_eq!(moved, (0..10).collect::<Vec<u64>>(), "in due order, none twice");
        // What a tick could not move stayed held: a refill only when the four held ran out.
        assert_eq!(refills, 2);
        // A message larger than the tick's bytes still moves, alone.
        delay.append(&[Message { deliver_at: 1_000, ..Message::new(vec![9; 4000]) }], &[Placement::default()]).unwrap();
        assert_eq!(delay.take_due(2_000, MAX_MOVES_PER_TICK, 0, 2_500).unwrap().0.len(), 1);
    }

    proptest::proptest! {
        /// Against a B-tree alone: the same first, last and length after every operation, for
        /// timers that come mostly in order (as a constant delay gives) and sometimes not.
        #[test]
        fn a_timer_set_orders_as_a_btree_does(
            ops in proptest::collection::vec((0u8..6, 0u64..50), 1..400),
        ) {
            let (mut set, mut model) = (TimerSet::default(), BTreeSet::new());
            let mut clock = 0;
            for (offset, (op, jitter)) in ops.into_iter().enumerate() {
                match op {
                    0..=2 => {
                        clock += 1;
                        let key = (clock + jitter.saturating_sub(40), offset as u64);
                        set.insert(key);
                        model.insert(key);
                    }
                    3 => proptest::prop_assert_eq!(set.pop_first(), model.pop_first()),
                    4 => proptest::prop_assert_eq!(set.pop_last(), model.pop_last()),
                    _ => {
                        let more = [(jitter, 10_000 + offset as u64), (clock, 20_000 + offset as u64)];
                        set.extend(more);
                        model.extend(more);
                    }
                }
                proptest::prop_assert_eq!(set.first(), model.first());
                proptest::prop_assert_eq!(set.last(), model.last());
                proptest::prop_assert_eq!(set.len(), model.len());
            }
        }
    }
}
