//! A durable queue's delayed messages: a log of their own (`delayed/` under the queue's
//! directory), in the order they were offered or returned, and what the queue keeps in memory to
//! hand each one out when it is due.
//!
//! Memory is bounded whatever the number of delayed messages: the timers hold the earliest-due
//! `cap` of them (16 bytes each, in a `TimerSet`); the rest are "spilled", known only to be due later
//! than every one held, and found again by reading the log when the timers run low — a slice of
//! the log per tick (`REFILL_SLICE`), so that a refill never holds the queue for long, while the
//! held timers go on coming due. Beside that,
//! two bits per record of the log from the oldest one not yet done ("done": acknowledged, moved
//! to its level's log, or dropped; markers are done too) — done, and released. Retention takes
//! what is before the oldest record still needed (`repin`).
//!
//! A due message is "released" to its level: a `released` marker records, for a tick's due
//! messages of one level, their offsets (as runs), the level's log end they join after, and the
//! time they joined it. They are handed out from this log, in their place among the level's
//! records (`Ready`), and marked done here when acknowledged; a restart reads the markers back
//! and puts them where they were. A due message is written once. Released messages waiting are
//! held as runs of consecutive offsets (one per tick and level when they come due in offer
//! order); past `MAX_READY_RUNS` runs, due messages are copied to their level's log instead.
//!
//! A copied message is marked done here by a `moved` marker after its copy; the copy names the
//! record it came from, so a crash between the two is repaired on open (the copy counts, the
//! original is marked done). A message returned with a delay is copied here from where it was
//! (its level's log, or this one), then acknowledged there; the copy names its original, and on
//! open a copy whose original is still unacknowledged is dropped (the original is handed out
//! again, only without its delay).

use std::collections::{BTreeSet, BinaryHeap, HashSet, VecDeque};

use petrel_log::{ConsumerGroup, Durability, GroupOptions, SeekTo, SharedLog};

use crate::message::{self, Message, Placement};
use crate::{BrokerError, NumberMap};

/// Delayed messages a queue's timers hold at most; later ones are found again in its log.
pub(crate) const MAX_TIMERS: usize = 65_536;
/// Due messages one tick copies from a queue's delayed log at most (the rest on the next tick, at
/// once): one tick's work under the queue's lock stays bounded.
pub(crate) const MAX_MOVES_PER_TICK: usize = 16_384;
/// Due messages one tick releases at most: a release writes no message, only a few bits and a
/// run each, so a tick releases more than it would copy (and keeps up with a fast producer
/// whose messages the tick finds due together).
pub(crate) const MAX_RELEASES_PER_TICK: usize = 65_536;
/// Bytes of due messages one tick holds in memory at most while it copies them (and at least
/// one message): large messages move a few per tick.
pub(crate) const MAX_MOVE_BYTES: usize = 32 << 20;
/// How long a tick reads the log for a refill at most (and then at least 256 records, so that
/// it ends): the queue's lock is held that long, and ticks come every millisecond while a
/// refill goes on.
pub(crate) const REFILL_SLICE: std::time::Duration = std::time::Duration::from_micros(500);
/// Runs of released messages a queue holds at most (40 bytes each) before due messages are
/// copied to their levels' logs instead (a tick may add its own runs beyond it).
pub(crate) const MAX_READY_RUNS: usize = 65_536;
/// `MAX_READY_RUNS`, unless a test lowered it to see due messages copied too.
static READY_RUNS_LIMIT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(MAX_READY_RUNS);

/// Lowers `MAX_READY_RUNS` for this process: for tests of the copies a queue falls back to.
pub fn limit_ready_runs(max: usize) {
    READY_RUNS_LIMIT.store(max, std::sync::atomic::Ordering::Relaxed);
}
/// Runs one release writes at most (12 bytes each in its markers).
const MAX_RUNS_PER_RELEASE: usize = 1024;
/// The group that marks where a delayed log is still needed.
const PIN_GROUP: &str = "broker";

/// Bits of a timer's slot below its level.
const LEVEL_SHIFT: u32 = 56;

/// A timer's second half: the delayed record's offset, and in the top byte the level it goes to,
/// so that a due message's level is known without reading it. Timers due at one time come out
/// by level, and by offset within a level: the order that counts.
fn slot(level: usize, offset: u64) -> u64 {
    debug_assert!(offset < 1 << LEVEL_SHIFT && level < 256, "a level in a byte, an offset below it");
    ((level as u64) << LEVEL_SHIFT) | offset
}

/// How much later than asked a delayed message may be made due, so that it comes due in offer
/// order (`raised_due`).
pub(crate) const MAX_DUE_RAISE_NS: u64 = 1_000_000;

/// When a message delayed by `delay_ms` to `due` comes due, given the latest due of the queue's
/// delayed messages (`DelayLog::latest_due`): at that latest one if it is less than
/// `MAX_DUE_RAISE_NS` later. Producers offering at once read their clocks before they take the
/// queue's lock, so with one delay for all, a message offered after another is often due a few
/// µs before it; raised, it comes due with it, after it. Then the offsets a tick releases are
/// consecutive (one run of ready messages, where interleaved dues made hundreds, and then copies
/// once `MAX_READY_RUNS` were waiting), and the timer joins the end of the ordered run. No
/// message comes due earlier than asked. (The caller keeps a `deliver_at` as asked.)
pub(crate) fn raised_due(due: u64, latest_due: Option<u64>) -> u64 {
    match latest_due {
        Some(latest) if latest > due && latest - due < MAX_DUE_RAISE_NS => latest,
        _ => due,
    }
}

/// How far from the end of the timers' ordered run a timer may join it (each place a move).
const RUN_INSERT_REACH: usize = 256;

/// A timer slot's (level, offset).
fn unslot(slot: u64) -> (usize, u64) {
    ((slot >> LEVEL_SHIFT) as usize, slot & ((1 << LEVEL_SHIFT) - 1))
}

/// A sorted set of timers, (due, slot), cheap when they come in due order: those at or after
/// the latest of an ordered run join its end (O(1), and so do their pops from the front), and
/// so do those due among its last `RUN_INSERT_REACH`; only one due earlier than those goes into
/// a B-tree. Messages with one delay for all — most delayed offers — then never touch the tree,
/// even from several producers at once; a mix of delays sends the shorter ones there. Each part
/// is sorted, so the set's first and last are the smaller first and the larger last.
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
        // Just before the run's end, it goes into the run: producers offering at once take the
        // queue's lock in another order than their clocks' (each reads it before the lock), so
        // one's messages come a little before the other's last ones. The run's end is in the
        // cache, and a few moves cost less than the tree.
        let end = self.run.len();
        if self.run.back().is_none_or(|&last| key > last) {
            self.run.push_back(key);
            return;
        }
        // Its place among the run's last `RUN_INSERT_REACH` (a binary search): keys before
        // `lo` are smaller than it, from `hi` on larger.
        let (mut lo, mut hi) = (end.saturating_sub(RUN_INSERT_REACH), end);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.run[mid] < key {
                true => lo = mid + 1,
                false => hi = mid,
            }
        }
        if lo == 0 || self.run[lo - 1] < key {
            self.run.insert(lo, key);
        } else {
            self.tree.insert(key);
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

    /// The keys due at `now_ns` at the run's front, at most `max`, when the tree holds none:
    /// they are then the set's first, in order. (`None` while the tree holds some: the two
    /// parts' keys interleave, and are taken one at a time with `pop_first`.)
    fn run_due(&self, now_ns: u64, max: usize) -> Option<impl Iterator<Item = (u64, u64)> + '_> {
        if !self.tree.is_empty() {
            return None;
        }
        let due = self.run.partition_point(|&(due, _)| due <= now_ns).min(max);
        Some(self.run.iter().take(due).copied())
    }

    /// Removes the run's first `n` keys (seen with `run_due`).
    fn take_run_front(&mut self, n: usize) {
        assert!(self.tree.is_empty() && n <= self.run.len(), "taken from the run's due front");
        self.run.drain(..n);
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

/// The earliest-due delayed messages, at most `cap` of them, as (due, slot): a slot is the
/// record's offset with the level it is released to in its top byte (`slot`).
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

    pub fn insert(&mut self, due: u64, slot: u64) {
        let key = (due, slot);
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

    /// When the latest held message is due (`None`: none held).
    pub fn latest_due(&self) -> Option<u64> {
        self.held.last().map(|(due, _)| *due)
    }

    /// The earliest held message, as (due, slot), if it is due at `now_ns`.
    pub fn pop_due(&mut self, now_ns: u64) -> Option<(u64, u64)> {
        match self.held.first() {
            Some(&(due, _)) if due <= now_ns => self.held.pop_first(),
            _ => None,
        }
    }

    /// The held timers due at `now_ns`, at most `max`, earliest first, left in place, when they
    /// can be seen without taking them (see `TimerSet::run_due`); `take_due_front` then takes
    /// those used.
    pub fn due_in_place(&self, now_ns: u64, max: usize) -> Option<impl Iterator<Item = (u64, u64)> + '_> {
        self.held.run_due(now_ns, max)
    }

    /// Takes the first `n` timers seen with `due_in_place`.
    pub fn take_due_front(&mut self, n: usize) {
        self.held.take_run_front(n);
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
    /// done, held or not, as (due, slot).
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

/// Which records of a delayed log are done, and which are released to their level (due, handed
/// out from the log, not yet done), from `base` on (all before it are done).
#[derive(Debug, Default)]
pub(crate) struct Done {
    base: u64,
    words: VecDeque<u64>,
    /// One bit per record as in `words`: released.
    released: VecDeque<u64>,
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
            self.released.push_back(0);
        }
        self.len += 1;
        if done {
            self.set(self.end() - 1);
        }
    }

    /// The word and bit of `offset`, if it is covered and not before `base`.
    fn bit(&self, offset: u64) -> Option<(usize, u64)> {
        let i = offset.checked_sub(self.base).filter(|&i| i < self.len)?;
        Some(((i / 64) as usize, 1 << (i % 64)))
    }

    fn set(&mut self, offset: u64) {
        if offset < self.base {
            return;
        }
        assert!(offset < self.end(), "a delayed log's record is covered before it is marked done");
        let (word, bit) = self.bit(offset).expect("covered");
        self.words[word] |= bit;
    }

    fn set_released(&mut self, offset: u64) {
        if offset < self.base {
            return;
        }
        assert!(offset < self.end(), "a delayed log's record is covered before it is released");
        let (word, bit) = self.bit(offset).expect("covered");
        self.released[word] |= bit;
    }

    /// `set_released` for the `n` records from `start`, a word at a time.
    fn set_released_run(&mut self, start: u64, n: u32) {
        let end = start + u64::from(n);
        assert!(end <= self.end(), "a delayed log's record is covered before it is released");
        if end <= self.base {
            return;
        }
        let mut i = start.max(self.base) - self.base;
        while i < end - self.base {
            let (word, bit) = ((i / 64) as usize, i % 64);
            let bits = (64 - bit).min(end - self.base - i);
            self.released[word] |= (u64::MAX >> (64 - bits)) << bit;
            i += bits;
        }
    }

    fn is_done(&self, offset: u64) -> bool {
        offset < self.base || self.bit(offset).is_some_and(|(word, bit)| self.words[word] & bit != 0)
    }

    fn is_released(&self, offset: u64) -> bool {
        self.bit(offset).is_some_and(|(word, bit)| self.released[word] & bit != 0)
    }

    /// The oldest record not done (`end` if all are), dropping the words before it.
    fn first_pending(&mut self) -> u64 {
        while self.words.len() > 1 && self.words[0] == u64::MAX {
            self.words.pop_front();
            self.released.pop_front();
            self.base += 64;
            self.len -= 64;
        }
        let first = self.base + u64::from(self.words.front().map_or(0, |w| w.trailing_ones()));
        first.min(self.end())
    }

    /// The oldest record neither done nor released (`end` if none), a word at a time.
    fn first_delayed(&self) -> u64 {
        let words = self.words.iter().zip(&self.released).map(|(d, r)| d | r);
        let mut first = self.base;
        for w in words {
            if w != u64::MAX {
                return (first + u64::from(w.trailing_ones())).min(self.end());
            }
            first += 64;
        }
        self.end()
    }

    /// The records neither done nor released (the delayed messages not yet due), oldest first.
    fn delayed(&self) -> impl Iterator<Item = u64> + '_ {
        (self.base..self.end()).filter(|o| !self.is_done(*o) && !self.is_released(*o))
    }
}

/// A released message waiting (or handed out): where it is in the delayed log, and its place in
/// its level — after the level's records before `after`, and after the messages released to the
/// level before it (`seq`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ready {
    pub offset: u64,
    pub after: u64,
    /// When it joined its level (its time as a waiting message, as an offer's).
    pub stamp: u64,
    seq: u64,
}

/// Released messages of one tick and level with consecutive offsets (and so consecutive `seq`).
#[derive(Clone, Copy, Debug)]
struct Run {
    seq: u64,
    start: u64,
    len: u32,
    after: u64,
    stamp: u64,
}

impl Ready {
    /// Its order among the messages released to its level.
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// What one release takes: each level's due messages in due order, consecutive offsets as one
/// run, at most `MAX_RUNS_PER_RELEASE` runs (so that the markers stay small records).
struct ReleasePlan {
    runs: Vec<Vec<(u64, u32)>>,
    run_count: usize,
    /// Timers taken.
    taken: usize,
    /// The largest offset taken.
    last: u64,
}

impl ReleasePlan {
    fn new(levels: usize) -> ReleasePlan {
        ReleasePlan { runs: vec![Vec::new(); levels], run_count: 0, taken: 0, last: 0 }
    }

    /// Takes the timer `key` (due, slot); `false`, taking nothing, when it would start a run
    /// beyond `MAX_RUNS_PER_RELEASE`.
    fn add(&mut self, key: (u64, u64)) -> bool {
        let (level, offset) = unslot(key.1);
        match self.runs[level].last_mut() {
            Some((start, n)) if *start + u64::from(*n) == offset && *n < u32::MAX => *n += 1,
            _ if self.run_count == MAX_RUNS_PER_RELEASE => return false,
            _ => {
                self.runs[level].push((offset, 1));
                self.run_count += 1;
            }
        }
        self.taken += 1;
        self.last = self.last.max(offset);
        true
    }
}

impl Run {
    /// Whether `next` continues this run: the next sequence and offset, released together, and
    /// room to grow.
    fn joins(&self, next: &Run) -> bool {
        self.seq + u64::from(self.len) == next.seq
            && self.start + u64::from(self.len) == next.start
            && (self.after, self.stamp) == (next.after, next.stamp)
            && self.len.checked_add(next.len).is_some()
    }

    fn first(&self) -> Ready {
        Ready { offset: self.start, after: self.after, stamp: self.stamp, seq: self.seq }
    }
}

/// The released messages waiting at each level, in the order they are handed out.
#[derive(Clone, Debug)]
struct ReadyRuns {
    levels: Vec<(VecDeque<Run>, u64)>,
    runs: usize,
    len: u64,
}

impl ReadyRuns {
    fn new(levels: usize) -> ReadyRuns {
        ReadyRuns { levels: (0..levels).map(|_| (VecDeque::new(), 0)).collect(), runs: 0, len: 0 }
    }

    /// Released messages at `start`, `start + 1` … join `level`'s end.
    fn push(&mut self, level: usize, start: u64, len: u32, after: u64, stamp: u64) {
        let (runs, next_seq) = &mut self.levels[level];
        let seq = *next_seq;
        *next_seq += u64::from(len);
        self.len += u64::from(len);
        let run = Run { seq, start, len, after, stamp };
        match runs.back_mut() {
            Some(r) if r.joins(&run) => r.len += len,
            _ => {
                runs.push_back(run);
                self.runs += 1;
            }
        }
    }

    fn front(&self, level: usize) -> Option<Ready> {
        self.levels[level].0.front().map(Run::first)
    }

    fn pop(&mut self, level: usize) -> Option<Ready> {
        let runs = &mut self.levels[level].0;
        let run = runs.front_mut()?;
        let first = run.first();
        run.start += 1;
        run.seq += 1;
        run.len -= 1;
        if run.len == 0 {
            runs.pop_front();
            self.runs -= 1;
        }
        self.len -= 1;
        Some(first)
    }

    /// A message taken from `level` comes back to its place (by `seq`).
    fn put_back(&mut self, level: usize, ready: Ready) {
        let runs = &mut self.levels[level].0;
        self.len += 1;
        let at = runs.partition_point(|r| r.seq < ready.seq);
        debug_assert!(runs.get(at).is_none_or(|r| r.seq > ready.seq), "a taken message is in no run");
        let one = Run { seq: ready.seq, start: ready.offset, len: 1, after: ready.after, stamp: ready.stamp };
        // Joined to the run before it, the run after it, or both (messages come back in any
        // order: joining one side only would leave a run per message).
        let before = at.checked_sub(1).filter(|&b| runs[b].joins(&one));
        let after = runs.get(at).is_some_and(|r| one.joins(r));
        match (before, after) {
            (Some(b), true) if u64::from(runs[b].len) + 1 + u64::from(runs[at].len) <= u64::from(u32::MAX) => {
                runs[b].len += 1 + runs[at].len;
                runs.remove(at);
                self.runs -= 1;
            }
            (Some(b), _) => runs[b].len += 1,
            (None, true) => {
                let r = &mut runs[at];
                r.seq -= 1;
                r.start -= 1;
                r.len += 1;
            }
            (None, false) => {
                runs.insert(at, one);
                self.runs += 1;
            }
        }
    }

    fn len_at(&self, level: usize) -> u64 {
        self.levels[level].0.iter().map(|r| u64::from(r.len)).sum()
    }

    /// Every waiting one's offset, in the order `drain` gives them.
    fn offsets(&self) -> Vec<u64> {
        let runs = self.levels.iter().flat_map(|(runs, _)| runs);
        runs.flat_map(|r| r.start..r.start + u64::from(r.len)).collect()
    }

    /// Every waiting one's offset, none left, and how many each level had.
    fn drain(&mut self) -> (Vec<u64>, Vec<u64>) {
        let mut out = Vec::with_capacity(self.len as usize);
        let mut per_level = Vec::with_capacity(self.levels.len());
        for (runs, _) in &mut self.levels {
            let before = out.len();
            for r in runs.drain(..) {
                out.extend(r.start..r.start + u64::from(r.len));
            }
            per_level.push((out.len() - before) as u64);
        }
        (self.runs, self.len) = (0, 0);
        (out, per_level)
    }
}

/// A durable queue's delayed log, its timers and its released messages.
pub(crate) struct DelayLog {
    pub log: SharedLog,
    /// Stands at the oldest record still needed: retention takes what is before it.
    pin: ConsumerGroup,
    timers: Timers,
    done: Done,
    ready: ReadyRuns,
    /// How many deliveries of each released record not done ended with the message coming back
    /// here (only those that did): its `Returned` markers. What a copy carried from before its
    /// delay is in its record (`DELIVERIES`), read when asked: an entry per such copy would
    /// grow with every message returned with a delay, which the timers' bound is to prevent.
    returns: NumberMap<u32>,
    /// A refill's reading of the log: the next offset, and where the log ended when it began.
    scan: Option<(u64, u64)>,
    /// Reads released messages as they are handed out: mostly one after another, so that the
    /// next is where this reader stands.
    reader: petrel_log::Reader,
    /// Released messages gone for good (`settle`) whose `ctl.moved` marker is not written yet:
    /// one marker names all that one hold of the queue's lock settles (`write_settled`).
    settled: Vec<u64>,
    /// The time of the log's last record, or later: a message due before it needs its due
    /// time in a header (`message::append_delayed`).
    time_floor: u64,
}

/// What opening a delayed log found.
/// A timer `take_due` took: (due, slot).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TakenTimer((u64, u64));

impl TakenTimer {
    /// The delayed record it was for.
    pub fn offset(self) -> u64 {
        unslot(self.0.1).1
    }
}

#[derive(Debug, Default)]
pub(crate) struct Reopened {
    /// Delayed messages not yet due (or not yet released).
    pub pending: u64,
    /// Released messages waiting or handed out before the restart, per level.
    pub released_at: Vec<u64>,
    /// The bytes of both (`Message::size`).
    pub bytes: u64,
    /// The newest idempotency keys its records hold (`open`'s `keep_keys` at most): (when
    /// stored, offset, key).
    pub keys: crate::dedup::RecentKeys<(u64, u64, String)>,
    /// The latest time a message of the queue was stamped with that its records say (0: none):
    /// when released messages joined their level, when keys were stored. (A delayed record's
    /// own time is when it is due, `message::KEY_STORED_AT`.)
    pub last_stamp: u64,
    /// Released runs held at most while the markers were read (what opening it took in memory
    /// besides its bits: `RUNS_HELD_WHILE_OPENING`).
    pub runs_held_at_most: usize,
}

/// Released runs an open holds before it lets go of those a later marker named done: a log
/// pinned by one old message holds every run released since (each 40 bytes here, most long
/// done), and an open keeps at most about this many, or twice those still waiting.
const RUNS_HELD_WHILE_OPENING: usize = 65_536;

impl DelayLog {
    /// A new, empty delayed log for a queue of `levels` priority levels.
    pub fn create(log: SharedLog, cap: usize, levels: usize) -> Result<DelayLog, BrokerError> {
        let pin = log.group(PIN_GROUP, GroupOptions::default())?;
        let done = Done::starting_at(log.next_offset());
        let ready = ReadyRuns::new(levels);
        let reader = log.reader();
        let returns = NumberMap::default();
        let time_floor = last_time(&log)?;
        Ok(DelayLog {
            log,
            pin,
            timers: Timers::new(cap),
            done,
            ready,
            returns,
            scan: None,
            reader,
            settled: Vec::new(),
            time_floor,
        })
    }

    /// Opens a delayed log that may hold messages, for a queue of `levels` priority levels.
    /// `moved`: offsets its levels' logs hold copies of; `original_waits(id)`: whether the
    /// level's record with queue id `id` (a returned message's original) is still
    /// unacknowledged.
    pub fn open(
        log: SharedLog,
        cap: usize,
        levels: usize,
        moved: &HashSet<u64>,
        original_waits: impl Fn(u64) -> bool,
        keep_keys: usize,
    ) -> Result<(DelayLog, Reopened), BrokerError> {
        let pin = log.group(PIN_GROUP, GroupOptions::default())?;
        let start = pin.committed();
        let top = levels - 1;
        let mut done = Done::starting_at(start);
        let mut returns = NumberMap::<u32>::default();
        // Released runs in the order they were released: (level, after, stamp, start, end).
        let mut released: Vec<(usize, u64, u64, u64, u64)> = Vec::new();
        let (mut let_go_at, mut runs_held_at_most) = (RUNS_HELD_WHILE_OPENING, 0);
        let mut last_stamp = 0;
        // First the markers (each follows the records it names), then the messages.
        for_each_record(&log, start, |r| {
            assert_eq!(r.offset, done.end(), "a log's offsets are dense");
            // (A marker names records before it: one naming others is damage, and ignored.)
            let before = done.end();
            match message::control(r) {
                Some(message::Control::Moved(offsets)) => {
                    offsets.into_iter().filter(|&o| o < before).for_each(|o| done.set(o));
                    done.push(true);
                }
                Some(message::Control::Returned(of)) => {
                    *returns.entry(of).or_default() += 1;
                    done.push(true);
                }
                Some(message::Control::Released { level, after, stamp, runs }) => {
                    last_stamp = last_stamp.max(stamp);
                    for (first, count) in runs {
                        let end = first.saturating_add(u64::from(count)).min(before);
                        // Each once, in the first marker that names it.
                        let fresh: Vec<u64> = (first..end).filter(|&o| !done.is_released(o)).collect();
                        fresh.iter().for_each(|&o| done.set_released(o));
                        for part in fresh.chunk_by(|a, b| a + 1 == *b) {
                            let (start, next) = (part[0], part[part.len() - 1] + 1);
                            released.push((usize::from(level).min(top), after, stamp, start, next));
                        }
                    }
                    runs_held_at_most = runs_held_at_most.max(released.len());
                    if released.len() >= let_go_at {
                        // Done offsets at either end of a run go (the runs are rebuilt from the
                        // offsets not done below), and with them the runs done whole.
                        released.retain_mut(|(_, _, _, start, end)| {
                            while *start < *end && done.is_done(*start) {
                                *start += 1;
                            }
                            while *end > *start && done.is_done(*end - 1) {
                                *end -= 1;
                            }
                            start < end
                        });
                        let_go_at = RUNS_HELD_WHILE_OPENING.max(2 * released.len());
                    }
                    done.push(true);
                }
                // (A copy a level's log holds is found below, and written down as repaired.)
                None => done.push(false),
            }
        })?;
        let keys = crate::dedup::RecentKeys::new(keep_keys);
        let mut reopened =
            Reopened { released_at: vec![0; levels], keys, runs_held_at_most, last_stamp, ..Reopened::default() };
        let mut timers = Timers::new(cap);
        let mut repaired = Vec::new();
        for_each_record(&log, start, |r| {
            if message::control(r).is_some() {
                return;
            }
            if let Some(key) = message::idempotency_key(r) {
                let stored_at = message::key_stored_at(r);
                reopened.last_stamp = reopened.last_stamp.max(stored_at);
                reopened.keys.push((stored_at, r.offset, String::from_utf8_lossy(key).into_owned()));
            }
            if done.is_done(r.offset) {
                return;
            }
            let placement = message::placement(r);
            // A returned copy's original: in a level's log, or released from this one.
            let original_stays = placement.returned_from.is_some_and(|id| match message::queue_position(id) {
                Some((message::DELAYED_TAG, of)) => !done.is_done(of),
                _ => original_waits(id),
            });
            if moved.contains(&r.offset) || original_stays {
                repaired.push(r.offset);
                return;
            }
            reopened.bytes += message::record_size(r);
            if !done.is_released(r.offset) {
                let level = usize::from(placement.priority).min(top);
                timers.insert(message::due_at(r), slot(level, r.offset));
                reopened.pending += 1;
            }
        })?;
        // Repaired ones are done (the marker is written below), released or not.
        repaired.iter().for_each(|&o| done.set(o));
        // The released ones not done, back where they were, in the order they were released.
        let mut ready = ReadyRuns::new(levels);
        for (level, after, stamp, first, end) in released {
            let mut run: Option<(u64, u32)> = None;
            for o in (first..end).map(Some).chain([None]) {
                match (o.filter(|&o| !done.is_done(o)), &mut run) {
                    (Some(o), Some((start, n))) if *start + u64::from(*n) == o => *n += 1,
                    (next, _) => {
                        if let Some((start, n)) = run.take() {
                            ready.push(level, start, n, after, stamp);
                        }
                        run = next.map(|o| (o, 1));
                    }
                }
            }
        }
        reopened.released_at = (0..levels).map(|level| ready.len_at(level)).collect();
        returns.retain(|&o, _| !done.is_done(o));
        let time_floor = last_time(&log)?;
        let reader = log.reader();
        let settled = Vec::new();
        let mut delay = DelayLog { log, pin, timers, done, ready, returns, scan: None, reader, settled, time_floor };
        // Copies the levels' logs hold, and returned copies whose original stayed: done now.
        delay.mark_done(&repaired)?;
        Ok((delay, reopened))
    }

    /// Whether a refill is under way (`refill_step` goes on with it).
    pub fn refilling(&self) -> bool {
        self.scan.is_some()
    }

    /// Whether `refill_step` has work now: a refill under way, or one to begin (the held timers
    /// ran low while some are spilled, as after a flush or a refill the disk cut short, when no
    /// held timer may be left to bring the next tick).
    pub fn refill_wanted(&self) -> bool {
        self.refilling() || self.timers.wants_refill()
    }

    /// Delayed messages not yet due (or not yet released).
    pub fn pending(&self) -> u64 {
        self.timers.len()
    }

    /// Released messages waiting (not handed out).
    pub fn ready_len(&self) -> u64 {
        self.ready.len
    }

    /// When the earliest delayed message is due (`None`: none is held; see `refill`).
    pub fn next_due(&self) -> Option<u64> {
        self.timers.next_due()
    }

    /// When the latest delayed message held is due (`None`: none is held).
    pub fn latest_due(&self) -> Option<u64> {
        self.timers.latest_due()
    }

    /// How many levels released messages go to (a placement above them goes to the highest).
    fn levels(&self) -> usize {
        self.ready.levels.len()
    }

    /// Appends `messages` (each with its `deliver_at` set) with their placements.
    pub fn append(
        &mut self,
        messages: &[Message],
        placements: &[Placement],
    ) -> Result<std::ops::Range<u64>, BrokerError> {
        let range = message::append_delayed(&self.log, messages, placements, &mut self.time_floor)?;
        assert_eq!(range.start, self.done.end(), "only the queue appends to its delayed log");
        let top = self.levels() - 1;
        for ((m, p), offset) in messages.iter().zip(placements).zip(range.clone()) {
            debug_assert!(m.deliver_at != 0, "a delayed message says when it is due");
            self.done.push(false);
            self.timers.insert(m.deliver_at, slot(usize::from(p.priority).min(top), offset));
        }
        Ok(range)
    }

    /// Up to `max` timers due at `now_ns`, earliest first, as (due, slot), taken out of the
    /// timers (the callers put back what they do not use).
    fn pop_due(&mut self, now_ns: u64, max: usize) -> Vec<(u64, u64)> {
        std::iter::from_fn(|| self.timers.pop_due(now_ns)).take(max).collect()
    }

    /// Releases the delayed messages due at `now_ns` (at most `max`) to their levels: each joins
    /// its level after `afters[level]` (that log's end now) at time `stamp`, and is handed out
    /// from here. Synced first unless the policy is `none`: a consumer never gets a message a
    /// crash could take back. Returns how many per level; `None`, with nothing taken, when the
    /// released messages waiting are at `MAX_READY_RUNS` runs (the caller copies them instead).
    pub fn release_due(
        &mut self,
        now_ns: u64,
        max: usize,
        afters: &[u64],
        stamp: u64,
    ) -> Result<Option<Vec<u64>>, BrokerError> {
        if self.ready.runs >= READY_RUNS_LIMIT.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(None);
        }
        let mut counts = vec![0u64; self.levels()];
        let mut plan = ReleasePlan::new(self.levels());
        // The due timers are taken once the markers are written. Most often they can be looked
        // at in place first (one delay for all: the timers' ordered run), and are then taken
        // with one cut of the run, which keeps the time the queue's lock is held short (a tick
        // releases a millisecond's offers at once); else each is popped, and put back on a
        // failure.
        let mut popped = Vec::new();
        let in_place = match self.timers.due_in_place(now_ns, max) {
            Some(mut due) => {
                due.all(|key| plan.add(key)); // up to the first that would start a run too many
                true
            }
            None => false,
        };
        while !in_place
            && popped.len() < max
            && let Some(key) = self.timers.pop_due(now_ns)
        {
            if !plan.add(key) {
                self.timers.unpop(&[key]); // (the next tick's first, at once)
                break;
            }
            popped.push(key);
        }
        if plan.taken == 0 {
            return Ok(Some(counts));
        }
        // Durable first (under `always` they are: no sync), and the markers appended together
        // or not at all: on a failure every message taken stays delayed, and nothing was counted.
        let synced = match self.log.durability() {
            Durability::None => Ok(()),
            _ => self.log.make_durable(plan.last),
        };
        let written = synced.map_err(BrokerError::from).and_then(|()| {
            let releases: Vec<message::Release<'_>> = (plan.runs.iter().enumerate())
                .filter(|(_, r)| !r.is_empty())
                .map(|(level, r)| message::Release { level: level as u8, after: afters[level], runs: r })
                .collect();
            self.time_floor = self.time_floor.max(stamp);
            Ok(message::append_released(&self.log, stamp, &releases)?)
        });
        let written = match written {
            Ok(range) => range,
            Err(e) => {
                self.timers.unpop(&popped);
                return Err(e);
            }
        };
        if in_place {
            self.timers.take_due_front(plan.taken);
        }
        assert_eq!(written.start, self.done.end(), "only the queue appends to its delayed log");
        written.for_each(|_| self.done.push(true));
        for (level, runs) in plan.runs.iter().enumerate() {
            for &(start, n) in runs {
                self.done.set_released_run(start, n);
                self.ready.push(level, start, n, afters[level], stamp);
                counts[level] += u64::from(n);
            }
        }
        Ok(Some(counts))
    }

    /// The next released message of `level`, left in place.
    pub fn ready_front(&self, level: usize) -> Option<Ready> {
        self.ready.front(level)
    }

    /// Takes the next released message of `level` (handed out, or dropped).
    pub fn take_ready(&mut self, level: usize) -> Option<Ready> {
        self.ready.pop(level)
    }

    /// A released message taken from `level` comes back to its place. `delivered`: it was
    /// handed out and came back, which counts (a `Returned` marker first, as in a level's log).
    pub fn put_back_ready(&mut self, level: usize, ready: Ready, delivered: bool) -> Result<(), BrokerError> {
        // Back in its place whether or not the marker that counts the delivery could be
        // written (without it, the count is kept in memory only; the error is reported).
        self.ready.put_back(level, ready);
        match delivered {
            true => self.count_delivery(ready.offset),
            false => Ok(()),
        }
    }

    /// Counts a delivery of the released message at `offset`: in memory, and in a return
    /// marker (the error if that could not be written).
    pub fn count_delivery(&mut self, offset: u64) -> Result<(), BrokerError> {
        *self.returns.entry(offset).or_default() += 1;
        let marker = message::append_returned(&self.log, offset)?;
        assert_eq!(marker, self.done.end(), "only the queue appends to its delayed log");
        self.done.push(true);
        Ok(())
    }

    /// The delayed message at `offset` (one not done).
    pub fn message_at(&mut self, offset: u64) -> Result<Message, BrokerError> {
        self.with_record(offset, message::from_delayed_record)
    }

    /// The size of the delayed message at `offset` (one not done), without decoding it.
    pub fn size_at(&mut self, offset: u64) -> Result<u64, BrokerError> {
        self.with_record(offset, message::record_size)
    }

    /// When the delayed message at `offset` (one not done) expires (0: never), without decoding
    /// the rest: the tick and every poll look at the head's expiry.
    pub fn expires_at(&mut self, offset: u64) -> Result<u64, BrokerError> {
        self.with_record(offset, message::expires_at)
    }

    /// `f` of the record at `offset`, one not done, read by the reader kept for them.
    fn with_record<T>(&mut self, offset: u64, f: impl FnOnce(&petrel_log::Record<'_>) -> T) -> Result<T, BrokerError> {
        let r = self.reader.get(offset)?.filter(|r| r.offset == offset);
        Ok(f(&r.expect("a delayed record not done is in the log")))
    }

    /// The deliveries of the record at `offset` (one not done) handed out now or last, this one
    /// included: those before its delay (its record's), and those since.
    pub fn deliveries(&mut self, offset: u64) -> Result<u32, BrokerError> {
        let before = self.with_record(offset, |r| message::placement(r).deliveries)?;
        Ok(before.saturating_add(crate::deliveries_of(&self.returns, offset)))
    }

    /// Every released message's offset, in the order `drop_ready` drops them.
    pub fn ready_offsets(&self) -> Vec<u64> {
        self.ready.offsets()
    }

    /// Drops every released message waiting (a flush), marking them done in markers of at
    /// most `per_marker`. Returns how many each level had dropped, the offsets dropped, and the
    /// error that stopped it: those not marked then stay released, in their places.
    pub fn drop_ready(&mut self, per_marker: usize) -> (Vec<u64>, Vec<u64>, Option<BrokerError>) {
        let before = self.ready.clone();
        let (offsets, per_level) = self.ready.drain();
        let (marked, failed) = self.mark_done_in_markers(&offsets, per_marker);
        let Some(e) = failed else { return (per_level, offsets, None) };
        // The marked ones are the first in level order: taken from the front again.
        self.ready = before;
        let mut dropped = vec![0; per_level.len()];
        let mut left = marked;
        for (level, &n) in per_level.iter().enumerate() {
            while dropped[level] < n && left > 0 {
                self.ready.pop(level).expect("a marked message was released");
                dropped[level] += 1;
                left -= 1;
            }
        }
        (dropped, offsets[..marked].to_vec(), Some(e))
    }

    /// The delayed messages due at `now_ns`, earliest first: at most `max` of them, and as many
    /// as fit in `max_bytes` (at least one). Returns their timers and their copies for their
    /// levels (`top` the highest); they stay pending until `mark_done`, or held again with
    /// `untake`. Those due but beyond the bytes stay held, the first ones the next call takes.
    pub fn take_due(
        &mut self,
        now_ns: u64,
        max: usize,
        top: usize,
        max_bytes: usize,
    ) -> Result<(Vec<TakenTimer>, message::DueCopies), BrokerError> {
        /// Records read at a time: past the bytes, at most this many are read for nothing.
        const READ_AT_A_TIME: usize = 64;
        let taken = self.pop_due(now_ns, max);
        let offsets: Vec<u64> = taken.iter().map(|&(_, s)| unslot(s).1).collect();
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
        Ok((taken[..moving].iter().map(|&key| TakenTimer(key)).collect(), copies))
    }

    /// Holds again timers `take_due` took (earliest first; nothing inserted since), whose
    /// copies were not stored: the first the next tick takes.
    pub fn untake(&mut self, taken: &[TakenTimer]) {
        let keys: Vec<(u64, u64)> = taken.iter().map(|t| t.0).collect();
        self.timers.unpop(&keys);
    }

    /// Marks the delayed messages at `offsets` done (taken out of the timers or the released
    /// ones before), in as few markers as the log's record limit allows.
    pub fn mark_done(&mut self, offsets: &[u64]) -> Result<(), BrokerError> {
        let (_, failed) = self.mark_done_in_markers(offsets, usize::MAX);
        failed.map_or(Ok(()), Err)
    }

    /// Offsets one marker names at most: `per_marker`, within what one record of the log may
    /// hold (8 bytes an offset). A marker larger than that could never be written: its messages
    /// would stay taken but not done, and come again after a restart.
    fn offsets_per_marker(&self, per_marker: usize) -> usize {
        let room = self.log.max_record_bytes().saturating_sub(message::MARKER_OVERHEAD_BYTES) / 8;
        per_marker.min(room).max(1)
    }

    /// Marks the delayed messages at `offsets` done in one marker.
    fn mark_done_once(&mut self, offsets: &[u64]) -> Result<(), BrokerError> {
        if offsets.is_empty() {
            return Ok(());
        }
        let marker = message::append_moved(&self.log, offsets)?;
        assert_eq!(marker, self.done.end(), "only the queue appends to its delayed log");
        self.done.push(true);
        for o in offsets {
            self.done.set(*o);
            self.returns.remove(o);
        }
        Ok(())
    }

    /// The released message at `offset`, taken, is gone for good: marked done by the next
    /// `write_settled`, with the others settled meanwhile.
    pub fn settle(&mut self, offset: u64) {
        self.settled.push(offset);
    }

    /// Writes the markers of the messages settled since the last call. On a failure those not
    /// marked stay to be written by the next call (until then they are neither waiting nor done:
    /// a restart hands them out again).
    pub fn write_settled(&mut self) -> Result<(), BrokerError> {
        let mut settled = std::mem::take(&mut self.settled);
        let (marked, failed) = self.mark_done_in_markers(&settled, usize::MAX);
        settled.drain(..marked); // (its room kept for the next hold of the lock)
        self.settled = settled;
        failed.map_or(Ok(()), Err)
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
            // From the oldest record neither done nor released: released ones may stand long
            // before it (waiting for a consumer), and are not read again for nothing.
            self.scan = Some((self.done.first_delayed(), self.log.next_offset()));
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
                if !self.done.is_done(r.offset) && !self.done.is_released(r.offset) && message::control(&r).is_none() {
                    let level = usize::from(message::placement(&r).priority).min(self.levels() - 1);
                    self.timers.consider((message::due_at(&r), slot(level, r.offset)));
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

    /// Every delayed message's offset not yet due (or not released): what a flush drops.
    pub fn delayed_offsets(&self) -> Vec<u64> {
        self.done.delayed().collect()
    }

    /// Marks the delayed messages at `offsets` (from `delayed_offsets`, in order) done, in
    /// markers of at most `per_marker`; returns how many are marked, and the error that stopped
    /// it. The timers are cleared once all are; if some are not, the timers are found again by a
    /// refill from the log (so that none of those left is lost until a restart).
    pub fn drop_delayed(&mut self, offsets: &[u64], per_marker: usize) -> (usize, Option<BrokerError>) {
        let (marked, failed) = self.mark_done_in_markers(offsets, per_marker);
        self.timers.clear();
        self.scan = None;
        if failed.is_some() {
            self.timers.spilled = (offsets.len() - marked) as u64;
        }
        (marked, failed)
    }

    /// `mark_done` of `offsets` in markers of at most `per_marker` (and what a record holds), in
    /// order; returns how many are marked, and the error that stopped it.
    fn mark_done_in_markers(&mut self, offsets: &[u64], per_marker: usize) -> (usize, Option<BrokerError>) {
        let mut marked = 0;
        for chunk in offsets.chunks(self.offsets_per_marker(per_marker)) {
            if let Err(e) = self.mark_done_once(chunk) {
                return (marked, Some(e));
            }
            marked += chunk.len();
        }
        (marked, None)
    }

    /// Lets go of the segments its readers stand in (see `ConsumerGroup::let_go_of_segments`).
    pub fn let_go_of_segments(&mut self) {
        self.reader = self.log.reader();
        self.pin.let_go_of_segments();
    }

    /// Lets retention take what is before the oldest record still needed: the oldest pending,
    /// or `oldest_key` (the oldest offset holding a remembered idempotency key), the earlier.
    pub fn repin(&mut self, oldest_key: Option<u64>) -> Result<(), BrokerError> {
        let needed = self.done.first_pending().min(oldest_key.unwrap_or(u64::MAX));
        if needed > self.pin.committed() {
            self.pin.seek(SeekTo::Offset(needed))?;
            // A fresh reader: the one kept would hold on to a segment retention may now take.
            self.reader = self.log.reader();
        }
        Ok(())
    }
}

/// The time of `log`'s last record (0: none).
fn last_time(log: &SharedLog) -> Result<u64, BrokerError> {
    let Some(last) = log.next_offset().checked_sub(1) else { return Ok(0) };
    let mut reader = log.reader();
    reader.seek(last);
    Ok(reader.read_batch(1)?.into_iter().map(|r| r.timestamp).max().unwrap_or(0))
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
    fn released_messages_put_back_in_any_order_make_their_run_whole_again() {
        for order in [vec![0, 1, 2, 3, 4, 5], vec![5, 4, 3, 2, 1, 0], vec![3, 0, 5, 1, 4, 2]] {
            let mut ready = ReadyRuns::new(1);
            ready.push(0, 100, 6, 7, 8);
            let taken: Vec<Ready> = (0..6).map(|_| ready.pop(0).unwrap()).collect();
            assert_eq!((ready.runs, ready.len), (0, 0));
            for &i in &order {
                ready.put_back(0, taken[i]);
            }
            assert_eq!((ready.runs, ready.len), (1, 6), "put back in the order {order:?}");
            let again: Vec<Ready> = (0..6).map(|_| ready.pop(0).unwrap()).collect();
            assert_eq!(again, taken, "each in its place");
        }
    }

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
        let mut delay = DelayLog::create(log, 8, 1).unwrap();
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
            for &offset in &due {
                out.push(delay.message_at(offset).unwrap().deliver_at);
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

    /// A copy delayed after earlier deliveries keeps their count in its record, not in memory
    /// (a thousand such copies take no entry): the count is read back when asked, with the
    /// returns since added, and the same after a reopen.
    #[test]
    fn a_delayed_copys_earlier_deliveries_are_read_from_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let open = || petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(open(), 8, 1).unwrap();
        let messages: Vec<Message> =
            (0..1000).map(|_| Message { deliver_at: 10, timestamp: 500, ..Message::new(vec![0; 4]) }).collect();
        delay.append(&messages, &vec![Placement { deliveries: 3, ..Placement::default() }; 1000]).unwrap();
        assert!(delay.returns.is_empty(), "nothing in memory per copy");
        assert_eq!(delay.deliveries(999).unwrap(), 4, "three before, this one");
        assert!(delay.release_due(10, 2_000, &[0], 1_000).unwrap().is_some());
        let taken = delay.take_ready(0).unwrap();
        delay.put_back_ready(0, taken, true).unwrap();
        assert_eq!((delay.deliveries(taken.offset).unwrap(), delay.returns.len()), (5, 1));
        drop(delay);
        let (mut delay, _) = DelayLog::open(open(), 8, 1, &HashSet::new(), |_| false, 100).unwrap();
        assert_eq!(delay.returns.len(), 1);
        assert_eq!((delay.deliveries(taken.offset).unwrap(), delay.deliveries(999).unwrap()), (5, 4));
    }

    /// Released messages come out by release, and back to their place whatever the order they
    /// come back in; a run is split and mended as they go and come; a restart puts them back
    /// where they were, and one done meanwhile is left out.
    #[test]
    fn released_messages_keep_their_places_through_takes_returns_and_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let open = || petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(open(), 8, 2).unwrap();
        let message = |due: u64, level: u8| Message { deliver_at: due, timestamp: 500, ..Message::new(vec![level; 4]) };
        let placement = |level: u8| Placement { priority: level, ..Placement::default() };
        // Offsets 0–5: level 1, 0, 1, 1, 0, 1; all due at 10 but 5, due at 20.
        let levels = [1u8, 0, 1, 1, 0, 1];
        let dues = [10, 10, 10, 10, 10, 20];
        let messages: Vec<Message> = levels.iter().zip(dues).map(|(&l, d)| message(d, l)).collect();
        delay.append(&messages, &levels.iter().map(|&l| placement(l)).collect::<Vec<_>>()).unwrap();
        assert_eq!(delay.release_due(10, 100, &[7, 3], 1_000).unwrap(), Some(vec![2, 3]));
        assert_eq!((delay.pending(), delay.ready_len()), (1, 5));
        assert_eq!(delay.release_due(20, 100, &[7, 4], 2_000).unwrap(), Some(vec![0, 1]));
        let order = |delay: &DelayLog, level| {
            let mut ready = delay.ready.clone();
            std::iter::from_fn(|| ready.pop(level)).map(|r| (r.offset, r.after, r.stamp)).collect::<Vec<_>>()
        };
        assert_eq!(order(&delay, 1), [(0, 3, 1_000), (2, 3, 1_000), (3, 3, 1_000), (5, 4, 2_000)]);
        assert_eq!(order(&delay, 0), [(1, 7, 1_000), (4, 7, 1_000)]);
        // Take three of level 1, give back the third and the first (a second delivery each).
        let taken: Vec<Ready> = (0..3).map(|_| delay.take_ready(1).unwrap()).collect();
        delay.put_back_ready(1, taken[2], true).unwrap();
        delay.put_back_ready(1, taken[0], true).unwrap();
        assert_eq!(order(&delay, 1).iter().map(|r| r.0).collect::<Vec<_>>(), [0, 3, 5]);
        assert_eq!(
            (delay.deliveries(0).unwrap(), delay.deliveries(2).unwrap(), delay.deliveries(3).unwrap()),
            (2, 1, 2)
        );
        // The second is acknowledged; the rest wait across a reopen, in their places.
        delay.mark_done(&[taken[1].offset]).unwrap();
        let taken = delay.take_ready(0).unwrap(); // handed out when the server stops
        assert_eq!(taken.offset, 1);
        drop(delay);
        let (mut delay, reopened) = DelayLog::open(open(), 8, 2, &HashSet::new(), |_| false, 100).unwrap();
        assert_eq!((reopened.pending, reopened.released_at.clone()), (0, vec![2, 3]));
        assert_eq!(order(&delay, 1), [(0, 3, 1_000), (3, 3, 1_000), (5, 4, 2_000)]);
        assert_eq!(order(&delay, 0), [(1, 7, 1_000), (4, 7, 1_000)]);
        assert_eq!(
            (delay.deliveries(0).unwrap(), delay.deliveries(3).unwrap(), delay.deliveries(1).unwrap()),
            (2, 2, 1)
        );
        assert_eq!(reopened.last_stamp, 2_000, "a release's time is its marker's");
    }

    /// Repairs on open are written down: a record a level's copy names is done for good, also
    /// once the copy is gone (a second restart); a returned copy whose original still waits is
    /// dropped even if it was released; a marker naming records after it (damage) is ignored.
    #[test]
    fn repairs_on_open_hold_across_a_second_restart_and_a_released_copy_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let open = || petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(open(), 8, 1).unwrap();
        let message = |due: u64| Message { deliver_at: due, timestamp: 500, ..Message::new(&b"m"[..]) };
        let returned = Placement { returned_from: Some(message::queue_id(0, 7)), ..Placement::default() };
        // 0: a returned copy, released; 1: copied to its level before the crash (its marker
        // lost); 2: a delayed message.
        delay.append(&[message(10), message(20)], &[returned, Placement::default()]).unwrap();
        assert_eq!(delay.release_due(10, 100, &[3], 1_000).unwrap(), Some(vec![1]));
        delay.append(&[message(50)], &[Placement::default()]).unwrap();
        message::append_moved(&delay.log, &[1_000]).unwrap(); // names a record not yet written
        drop(delay);
        let moved: HashSet<u64> = [1].into();
        let (delay, reopened) = DelayLog::open(open(), 8, 1, &moved, |id| id == message::queue_id(0, 7), 100).unwrap();
        // 0 counts as its original, 1 as its copy: neither waits here.
        assert_eq!((reopened.pending, reopened.released_at.clone(), delay.ready_len()), (1, vec![0], 0));
        drop(delay);
        let (delay, reopened) = DelayLog::open(open(), 8, 1, &HashSet::new(), |_| false, 100).unwrap();
        assert_eq!((reopened.pending, reopened.released_at, delay.ready_len()), (1, vec![0], 0), "written down");
    }

    /// A delayed record's time is when it is due, so that most need no `da` header; one due
    /// before the record ahead of it (whose time the log will not go below) keeps `da`, and a
    /// keyed one says when its key was stored. A reopen reads back each due time, each key's
    /// time, and a last stamp that is no due time in the future.
    #[test]
    fn a_delayed_record_is_timed_when_due_and_reopens_with_every_due_and_key_time() {
        let dir = tempfile::tempdir().unwrap();
        let open = || petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(open(), 8, 1).unwrap();
        let message = |due: u64| Message { deliver_at: due, timestamp: 500, ..Message::new(&b"m"[..]) };
        let keyed = Message { idempotency_key: "k".into(), timestamp: 600, ..message(40) };
        let dues = [100, 100, 250, 90, 300];
        let mut messages: Vec<Message> = dues.iter().map(|&d| message(d)).collect();
        messages.push(keyed);
        delay.append(&messages, &vec![Placement::default(); messages.len()]).unwrap();
        let mut reader = delay.log.reader();
        let records: Vec<(u64, bool, Option<Vec<u8>>)> = (reader.read_batch(10).unwrap().into_iter())
            .map(|r| (r.timestamp, r.headers.get("da").is_some(), r.headers.get("ka").map(<[u8]>::to_vec)))
            .collect();
        let ka = Some(600u64.to_be_bytes().to_vec());
        let expected = [
            (100, false, None),
            (100, false, None),
            (250, false, None),
            (250, true, None),
            (300, false, None),
            (300, true, ka),
        ];
        assert_eq!(records, expected, "a header only where the record's time is not its due");
        drop((reader, delay));
        let (mut delay, reopened) = DelayLog::open(open(), 8, 1, &HashSet::new(), |_| false, 100).unwrap();
        let mut due = Vec::new();
        while let Some((at, slot)) = delay.timers.pop_due(u64::MAX) {
            due.push((at, unslot(slot).1));
        }
        assert_eq!(due, [(40, 5), (90, 3), (100, 0), (100, 1), (250, 2), (300, 4)]);
        let keys = reopened.keys.into_vec();
        assert_eq!(keys, [(600, 5, "k".to_string())], "the key's time is its offer's");
        assert_eq!(reopened.last_stamp, 600, "no due time: offers after a restart are stamped from now");
        assert_eq!(delay.message_at(3).unwrap().deliver_at, 90);
        assert_eq!(delay.message_at(4).unwrap().deliver_at, 300);
        // A copy for its level says when it was due, as the delayed record it came from.
        let mut copies = message::DueCopies::default();
        let r = delay.reader.get(0).unwrap().unwrap();
        copies.add(&r, 0);
        let level_dir = tempfile::tempdir().unwrap();
        let level = petrel_log::Log::open(level_dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        copies.append(&level, 0, 1_000).unwrap();
        let mut reader = level.reader();
        let copy = reader.read_batch(1).unwrap().into_iter().next().unwrap();
        assert_eq!((copy.timestamp, message::from_record(&copy).deliver_at), (1_000, 100));
    }

    /// Every held timer released while later ones are spilled: no held timer says when to look
    /// again, and the refill that finds the spilled ones asks for a tick itself (a queue ticks at
    /// once while `refill_wanted`), or they would wait for an unrelated offer.
    #[test]
    fn a_refill_is_wanted_when_the_held_timers_ran_out() {
        let dir = tempfile::tempdir().unwrap();
        let log = petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(log, 8, 1).unwrap();
        let messages: Vec<Message> =
            (1..=20).map(|due| Message { deliver_at: due, timestamp: 500, ..Message::new(&b"m"[..]) }).collect();
        delay.append(&messages, &vec![Placement::default(); 20]).unwrap();
        assert_eq!(delay.release_due(8, 100, &[0], 8).unwrap().map(|v| v.iter().sum::<u64>()), Some(8));
        assert_eq!((delay.next_due(), delay.refill_wanted()), (None, true), "none held, twelve spilled");
        while delay.refill_step(std::time::Duration::from_millis(10)).unwrap() {}
        assert_eq!((delay.next_due(), delay.refill_wanted()), (Some(9), false));
    }

    /// A log pinned by one message not yet due holds every release since; opening it holds
    /// the runs of those not done, not all of them (and the released ones waiting come back).
    #[test]
    fn an_open_lets_go_of_released_runs_a_later_marker_named_done() {
        let dir = tempfile::tempdir().unwrap();
        let open = || petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(open(), 8, 1).unwrap();
        let message = |due: u64| Message { deliver_at: due, timestamp: 500, ..Message::new(&b"m"[..]) };
        delay.append(&[message(u64::MAX / 2)], &[Placement::default()]).unwrap(); // the pin
        const N: u64 = 3 * RUNS_HELD_WHILE_OPENING as u64 / 2;
        let mut taken = Vec::new();
        for due in 1..=N {
            delay.append(&[message(due)], &[Placement::default()]).unwrap();
            assert!(delay.release_due(due, 100, &[0], due).unwrap().is_some(), "one run a release");
            taken.push(delay.take_ready(0).unwrap().offset);
            if taken.len() == 1_000 || due == N {
                let mut batch = std::mem::take(&mut taken);
                if due == N {
                    batch.truncate(batch.len() - 2); // the last two stay handed out
                }
                delay.mark_done(&batch).unwrap();
            }
        }
        drop(delay);
        let (delay, reopened) = DelayLog::open(open(), 8, 1, &HashSet::new(), |_| false, 100).unwrap();
        assert!(
            reopened.runs_held_at_most <= RUNS_HELD_WHILE_OPENING,
            "{} runs held for {N} releases",
            reopened.runs_held_at_most
        );
        assert_eq!((reopened.pending, reopened.released_at, delay.ready_len()), (1, vec![2], 2), "the last two wait");
    }

    /// A release writes at most `MAX_RUNS_PER_RELEASE` runs; the rest is released next, in order.
    #[test]
    fn a_release_of_scattered_messages_is_split_into_small_markers() {
        let dir = tempfile::tempdir().unwrap();
        let log = petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        let mut delay = DelayLog::create(log, 4 * MAX_RUNS_PER_RELEASE, 2).unwrap();
        // Levels alternate: no two offsets of a level are consecutive, each is a run of its own.
        let n = 3 * MAX_RUNS_PER_RELEASE as u64;
        let messages: Vec<Message> = (0..n).map(|_| Message { deliver_at: 10, ..Message::new(&b"m"[..]) }).collect();
        let placements: Vec<Placement> =
            (0..n).map(|i| Placement { priority: (i % 2) as u8, ..Placement::default() }).collect();
        delay.append(&messages, &placements).unwrap();
        let mut released = Vec::new();
        while delay.pending() > 0 {
            let counts = delay.release_due(10, usize::MAX, &[0, 0], 1_000).unwrap().unwrap();
            released.push(counts.iter().sum::<u64>());
        }
        assert_eq!(released, [MAX_RUNS_PER_RELEASE as u64; 3]);
        let mut level0 = Vec::new();
        while let Some(r) = delay.take_ready(0) {
            level0.push(r.offset);
        }
        assert_eq!(level0, (0..n).step_by(2).collect::<Vec<_>>(), "in order across releases");
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
        assert_eq!(done.delayed().count(), (150..210).filter(|o| (o - 10) % 3 != 0).count());
        // Released ones are pending but not delayed: the first delayed is past them.
        assert_eq!(done.first_delayed(), 150);
        (150..200).for_each(|o| done.set_released(o));
        assert_eq!((done.first_pending(), done.first_delayed()), (150, 200));
        assert!(done.is_released(150) && !done.is_released(200) && !done.is_released(5));
        (200..210).for_each(|o| done.set_released(o));
        assert_eq!(done.first_delayed(), done.end());
        assert_eq!(done.delayed().count(), 0);
    }

    #[test]
    fn released_runs_mark_the_same_bits_as_one_offset_at_a_time() {
        for (start, n) in [(0, 1), (3, 61), (5, 200), (63, 2), (64, 64), (70, 130), (2, 7), (190, 10), (0, 200)] {
            let (mut runs, mut ones) = (Done::starting_at(5), Done::starting_at(5));
            for _ in 0..200 {
                runs.push(false);
                ones.push(false);
            }
            let n = n.min(205 - start);
            runs.set_released_run(start, n as u32);
            (start..start + n).for_each(|o| ones.set_released(o));
            assert_eq!(runs.released, ones.released, "run of {n} from {start}");
        }
    }

    #[test]
    fn due_messages_beyond_a_ticks_bytes_wait_for_the_next_tick_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let log = petrel_log::Log::open(dir.path(), petrel_log::Options::default()).unwrap().into_shared();
        // Room for four timers: six of the ten messages are spilled to begin with.
        let mut delay = DelayLog::create(log, 4, 1).unwrap();
        let messages: Vec<Message> =
            (0..10u8).map(|i| Message { deliver_at: 1_000, ..Message::new(vec![i; 1000]) }).collect();
        delay.append(&messages, &vec![Placement::default(); messages.len()]).unwrap();
        let (mut moved, mut per_tick, mut refills) = (Vec::new(), Vec::new(), 0);
        let mut untaken: Option<Vec<u64>> = None;
        while delay.pending() > 0 {
            if delay.next_due().is_none() {
                refills += 1;
                while delay.refill_step(std::time::Duration::ZERO).unwrap() {}
            }
            let (taken, copies) = delay.take_due(2_000, MAX_MOVES_PER_TICK, 0, 2_500).unwrap();
            let n = copies.copies().len();
            assert!(n >= 1 && copies.bytes() <= 2_500, "at least one, and within the bytes");
            assert_eq!(taken.len(), n);
            if untaken.is_none() {
                // Copies not stored (a failed append): held again, the next take's first.
                untaken = Some(taken.iter().map(|t| t.offset()).collect::<Vec<_>>());
                delay.untake(&taken);
                continue;
            }
            let offsets: Vec<u64> = taken.iter().map(|t| t.offset()).collect();
            if let Some(first) = untaken.take_if(|first| !first.is_empty()) {
                assert_eq!(offsets, first, "taken again first");
                untaken = Some(Vec::new());
            }
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
        /// timers that come mostly in order (as a constant delay gives) and sometimes not; and
        /// the due keys seen in place are the B-tree's first ones, taken as they would be popped.
        #[test]
        fn a_timer_set_orders_as_a_btree_does(
            ops in proptest::collection::vec((0u8..7, 0u64..50), 1..400),
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
                    6 => {
                        let (now, max) = (clock.saturating_sub(jitter % 8), (jitter % 5) as usize);
                        let Some(due) = set.run_due(now, max) else {
                            proptest::prop_assert!(!set.tree.is_empty());
                            continue;
                        };
                        let due: Vec<_> = due.collect();
                        let expected: Vec<_> = model.iter().copied().take_while(|k| k.0 <= now).take(max).collect();
                        proptest::prop_assert_eq!(&due, &expected);
                        set.take_run_front(due.len());
                        for k in &due {
                            model.remove(k);
                        }
                    }
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
