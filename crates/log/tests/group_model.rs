//! Property test: random append / poll / ack / nack / seek / reopen sequences on a consumer
//! group, checked against a model of at-least-once delivery.
//!
//! The model keeps the set of acknowledged offsets and the committed position (lowest
//! unacknowledged). Each poll must return records that are not acknowledged, nacked ones first;
//! after a reopen, the group resumes at the committed position and never delivers an
//! acknowledged record again.

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
}

impl Model {
    fn ack(&mut self, o: u64) {
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
        let group_options = GroupOptions { max_pending: 64, ..GroupOptions::default() };
        let mut group = log.group("g", group_options).unwrap();
        let mut m = Model { len: 0, committed: 0, acked: BTreeSet::new(), pending: VecDeque::new(), nacked: BTreeSet::new(), next: 0 };
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
                    let result = group.poll(max, Duration::ZERO);
                    let got: Vec<u64> = match result {
                        Ok(batch) => batch.into_iter().map(|r| {
                            assert_eq!(r.payload, r.offset.to_le_bytes());
                            r.offset
                        }).collect(),
                        Err(petrel_log::Error::TooManyPending { .. }) => {
                            prop_assert!(m.pending.len() + m.acked.len() >= 64 || (m.next - m.committed) >= 64);
                            continue;
                        }
                        Err(e) => panic!("{e}"),
                    };
                    if let Some(&first_nacked) = m.nacked.first() {
                        prop_assert_eq!(&got, &vec![first_nacked], "a nacked record comes back first, alone");
                        m.nacked.remove(&first_nacked);
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
                    m = Model { len: m.len, committed: at, acked: BTreeSet::new(), pending: VecDeque::new(), nacked: BTreeSet::new(), next: at };
                }
                Op::SeekTime(t) => {
                    let t = t % (1_000 * (m.len + 2));
                    let at = group.seek(SeekTo::Time(t)).unwrap();
                    // Record o has timestamp 1000 (o + 1): the first at or after t.
                    let expected = t.div_ceil(1_000).saturating_sub(1).min(m.len);
                    prop_assert_eq!(at, expected);
                    m = Model { len: m.len, committed: at, acked: BTreeSet::new(), pending: VecDeque::new(), nacked: BTreeSet::new(), next: at };
                }
                Op::Reopen => {
                    drop(group);
                    drop(log);
                    log = Log::open(dir.path(), options()).unwrap();
                    group = log.group("g", group_options).unwrap();
                    prop_assert_eq!(group.committed(), m.committed);
                    // Unacknowledged records come again; acknowledged ones never do.
                    m.pending.clear();
                    m.nacked.clear();
                    m.next = m.committed;
                }
            }
        }
        // Drain: acknowledge what is pending, then every record never delivered comes, once,
        // in order, skipping the acknowledged ones; then the group has committed everything.
        for o in std::mem::take(&mut m.pending) {
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
        let expected: Vec<u64> = (m.next.max(m.committed)..m.len).filter(|o| !m.acked.contains(o)).collect();
        prop_assert_eq!(rest, expected);
        prop_assert_eq!(group.committed(), m.len);
    }
}
