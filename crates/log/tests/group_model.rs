//! Property test: random append / poll / ack / nack / seek / reopen sequences on a consumer
//! group, checked against a model of at-least-once delivery.
//!
//! The model keeps the set of acknowledged offsets and the committed position (lowest
//! unacknowledged). Each poll must return records that are not acknowledged, nacked ones first;
//! after a reopen, the group resumes at the committed position and never delivers an
//! acknowledged record again. It also keeps the records the group's window moved over while
//! they stayed unacknowledged (held): they count as pending, and come back first after a reopen.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use petrel_log::{GroupOptions, Log, MIN_SEGMENT_BYTES, Options, SeekTo};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Append(u8),
    Poll(usize),
    /// Acknowledge the i-th pending record (modulo the count).
    Ack(usize),
    Nack(usize),
    Seek(u64),
    SeekTime(u64),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u8..40).prop_map(Op::Append),
        6 => (1usize..20).prop_map(Op::Poll),
        8 => any::<usize>().prop_map(Op::Ack),
        2 => any::<usize>().prop_map(Op::Nack),
        1 => any::<u64>().prop_map(Op::Seek),
        1 => any::<u64>().prop_map(Op::SeekTime),
        2 => Just(Op::Reopen),
    ]
}

struct Model {
    len: u64,
    /// Lowest offset not acknowledged.
    committed: u64,
    /// Acknowledged offsets at or above `committed`.
    acked: BTreeSet<u64>,
    /// Delivered and not acknowledged, in delivery order.
    pending: VecDeque<u64>,
    /// Nacked, to come back first.
    nacked: BTreeSet<u64>,
    /// Next offset never delivered since the last open or seek.
    next: u64,
    /// Unacknowledged offsets below the window's start (`base`).
    held: BTreeSet<u64>,
}

const MAX_PENDING: usize = 8;

impl Model {
    fn at(committed: u64, len: u64) -> Model {
        Model {
            len,
            committed,
            acked: BTreeSet::new(),
            pending: VecDeque::new(),
            nacked: BTreeSet::new(),
            next: committed,
            held: BTreeSet::new(),
        }
    }

    /// Where the group's window starts: the lowest unacknowledged offset that is not held.
    fn base(&self) -> u64 {
        (self.committed..self.next).find(|o| !self.acked.contains(o) && !self.held.contains(o)).unwrap_or(self.next)
    }

    /// Delivered and unacknowledged, as the group counts them: in its window, and held.
    fn pending_count(&self) -> usize {
        (self.base()..self.next).filter(|o| !self.acked.contains(o)).count() + self.held.len()
    }

    /// What a poll does before it reads: refuses (`false`), or holds the oldest records while
    /// the window is full.
    fn make_room(&mut self) -> bool {
        // (Records acknowledged before a reopen are stepped over first.)
        while self.acked.contains(&self.next) {
            self.next += 1;
        }
        if self.pending_count() >= MAX_PENDING {
            return false;
        }
        while (self.next - self.base()) as usize >= MAX_PENDING && self.held.len() < petrel_log::MAX_HELD {
            let oldest = self.base();
            self.held.insert(oldest);
        }
        ((self.next - self.base()) as usize) < MAX_PENDING
    }
}

impl Model {
    fn ack(&mut self, o: u64) {
        self.held.remove(&o);
        self.acked.insert(o);
        self.pending.retain(|&p| p != o);
        self.nacked.remove(&o);
        while self.acked.remove(&self.committed) {
            self.committed += 1;
        }
    }
}

fn options() -> Options {
    Options { segment_bytes: MIN_SEGMENT_BYTES, ..Options::default() }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_group_delivers_at_least_once_and_never_repeats_an_ack(ops in prop::collection::vec(op(), 1..80)) {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(dir.path(), options()).unwrap();
        let group_options = GroupOptions { max_pending: MAX_PENDING, ..GroupOptions::default() };
        let mut group = log.group("g", group_options).unwrap();
        let mut m = Model::at(0, 0);
        for op in ops {
            match op {
                Op::Append(n) => {
                    for _ in 0..n {
                        // Timestamps 1000 ns apart, so time seeks have exact answers.
                        let payload = m.len.to_le_bytes();
                        let input = petrel_log::Input { timestamp: Some(1_000 * (m.len + 1)), ..petrel_log::Input::payload(&payload) };
                        log.append_with(&input).unwrap();
                        m.len += 1;
                    }
                }
                Op::Poll(max) => {
                    let room = m.nacked.first().is_some() || m.make_room();
                    let result = group.poll(max, Duration::ZERO);
                    let got: Vec<u64> = match result {
                        Ok(batch) => batch.into_iter().map(|r| {
                            assert_eq!(r.payload, r.offset.to_le_bytes());
                            r.offset
                        }).collect(),
                        Err(petrel_log::Error::TooManyPending { .. }) => {
                            prop_assert!(!room, "refused with room");
                            continue;
                        }
                        Err(e) => panic!("{e}"),
                    };
                    prop_assert!(room, "a poll past the limit");
                    prop_assert_eq!(group.committed(), m.committed);
                    if let Some(&first_nacked) = m.nacked.first() {
                        prop_assert_eq!(&got, &vec![first_nacked], "a nacked record comes back first, alone");
                        m.nacked.remove(&first_nacked);
                        if !m.pending.contains(&first_nacked) {
                            m.pending.push_back(first_nacked); // held before a reopen: delivered now
                        }
                        continue;
                    }
                    for &o in &got {
                        prop_assert!(!m.acked.contains(&o) && o >= m.committed, "acknowledged record {} delivered again", o);
                        prop_assert!(o >= m.next, "new records come in order");
                        m.pending.push_back(o);
                        m.next = o + 1;
                    }
                    // Everything skipped over must have been acknowledged already.
                    prop_assert!(got.len() <= max);
                    prop_assert!(m.next - m.base() <= MAX_PENDING as u64, "the window holds what was delivered");
                    prop_assert_eq!(group.pending(), m.pending_count());
                    prop_assert!(m.pending_count() <= MAX_PENDING, "held ones count toward max_pending");
                }
                Op::Ack(i) => {
                    if !m.pending.is_empty() {
                        let o = m.pending[i % m.pending.len()];
                        group.ack(o).unwrap();
                        m.ack(o);
                        prop_assert_eq!(group.committed(), m.committed);
                    }
                }
                Op::Nack(i) => {
                    let candidates: Vec<u64> = m.pending.iter().copied().filter(|o| !m.nacked.contains(o)).collect();
                    if !candidates.is_empty() {
                        let o = candidates[i % candidates.len()];
                        group.nack(o).unwrap();
                        m.nacked.insert(o);
                    }
                }
                Op::Seek(to) => {
                    let to = to % (m.len + 2);
                    let at = group.seek(SeekTo::Offset(to)).unwrap();
                    prop_assert_eq!(at, to.min(m.len));
                    m = Model::at(at, m.len);
                }
                Op::SeekTime(t) => {
                    let t = t % (1_000 * (m.len + 2));
                    let at = group.seek(SeekTo::Time(t)).unwrap();
                    // Record o has timestamp 1000 (o + 1): the first at or after t.
                    let expected = t.div_ceil(1_000).saturating_sub(1).min(m.len);
                    prop_assert_eq!(at, expected);
                    m = Model::at(at, m.len);
                }
                Op::Reopen => {
                    drop(group);
                    drop(log);
                    log = Log::open(dir.path(), options()).unwrap();
                    group = log.group("g", group_options).unwrap();
                    prop_assert_eq!(group.committed(), m.committed);
                    // Unacknowledged records come again, held ones first; acknowledged ones never do.
                    prop_assert_eq!(group.pending(), m.held.len());
                    m.pending.clear();
                    m.nacked = m.held.clone();
                    m.next = m.base();
                }
            }
        }
        // Drain: acknowledge what is pending, then every record never delivered comes, once,
        // in order, skipping the acknowledged ones; then the group has committed everything.
        for o in std::mem::take(&mut m.pending) {
            group.ack(o).unwrap();
            m.ack(o);
        }
        while let Some(&o) = m.nacked.first() {
            // Held before a reopen and not delivered since: first, one at a time.
            let got: Vec<u64> = group.poll(64, Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
            prop_assert_eq!(got, vec![o]);
            group.ack(o).unwrap();
            m.ack(o);
        }
        let mut rest = Vec::new();
        loop {
            let batch: Vec<u64> = group.poll(64, Duration::ZERO).unwrap().into_iter().map(|r| r.offset).collect();
            if batch.is_empty() {
                break;
            }
            for &o in &batch {
                group.ack(o).unwrap();
            }
            rest.extend(batch);
        }
        prop_assert!(m.held.is_empty());
        let expected: Vec<u64> = (m.next.max(m.committed)..m.len).filter(|o| !m.acked.contains(o)).collect();
        prop_assert_eq!(rest, expected);
        prop_assert_eq!(group.committed(), m.len);
    }
}
