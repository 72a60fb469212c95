//! A queue's memory of idempotency keys: which keys it stored a message for, within a window
//! bounded by count and by time, so that a repeated offer (a producer's retry after a lost
//! answer) is answered with the original's id instead of being stored twice.
//!
//! Nothing here is written anywhere: a durable queue keeps each key in its message's own record
//! (durable with the message, by the same sync) and rebuilds this window from its log on open;
//! the queue's `dedup` consumer group trails the oldest remembered key so that retention keeps
//! those records after their messages are consumed (`Queue::on_log`).

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

/// A key as the window knows it: two independently seeded 64-bit hashes of its bytes. Keeping
/// the hash instead of the key means no allocation per key and one cache miss fewer per lookup
/// (the key's bytes are not fetched to compare), which is most of what a keyed offer costs. Two
/// keys are taken for one only if both hashes agree: with a million keys remembered, a new key
/// is mistaken for a remembered one with a chance of about 3 × 10⁻³³ per offer. The seeds are
/// random per window and never leave the process, so a producer cannot aim for a collision.
pub(crate) type KeyHash = u128;

/// Hashes keys as a window knows them (`KeyHash`), with seeds random per window. A copy hashes
/// alike, so that an offer's keys are hashed before the queue's lock is taken.
#[derive(Clone, Debug, Default)]
pub(crate) struct KeyHasher([foldhash::quality::RandomState; 2]);

impl KeyHasher {
    pub fn hash(&self, key: &str) -> KeyHash {
        let [a, b] = &self.0;
        (u128::from(a.hash_one(key)) << 64) | u128::from(b.hash_one(key))
    }
}

/// The keys a queue remembers, oldest first.
#[derive(Debug, Default)]
pub(crate) struct DedupWindow {
    hasher: KeyHasher,
    /// foldhash, seeded per process (the key hashes are random already).
    ids: HashMap<KeyHash, u64, foldhash::fast::RandomState>,
    order: VecDeque<Remembered>,
    /// Keys remembered per priority level (for the oldest key of a level, without a full scan).
    per_level: Vec<u64>,
    /// Keys forgotten since `take_forgotten` last looked.
    forgotten: bool,
}

#[derive(Debug)]
struct Remembered {
    key: KeyHash,
    /// The id of the message stored with it.
    id: u64,
    level: usize,
    /// When it was stored, ns.
    at_ns: u64,
}

impl DedupWindow {
    pub fn new(levels: usize) -> DedupWindow {
        DedupWindow { per_level: vec![0; levels], ..DedupWindow::default() }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// What the window knows keys by.
    pub fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    /// What the window knows `key` by.
    pub fn hash(&self, key: &str) -> KeyHash {
        self.hasher.hash(key)
    }

    /// The id of the message stored with `key`, if remembered.
    #[cfg(test)]
    pub fn get(&self, key: &str) -> Option<u64> {
        self.get_hashed(self.hash(key))
    }

    /// The id of the message stored with the key hashed to `key`, if remembered.
    pub fn get_hashed(&self, key: KeyHash) -> Option<u64> {
        self.ids.get(&key).copied()
    }

    /// Remembers `key` (its `hash`) for the message `id` (at priority `level`), stored at
    /// `at_ns`: later than every key remembered before (the queue's lock orders offers).
    pub fn remember(&mut self, key: KeyHash, id: u64, level: usize, at_ns: u64) {
        let earlier = self.ids.insert(key, id);
        debug_assert!(earlier.is_none(), "a remembered key is a repeat, never stored again");
        self.per_level[level] += 1;
        self.order.push_back(Remembered { key, id, level, at_ns });
    }

    /// Remembers a key read back from a log on open, in the order the keys were stored, keeping
    /// at most `max_keys`: as `remember`, but a key seen again was stored again after it was
    /// forgotten, and so was every key before it (keys are forgotten oldest first).
    pub fn restore(&mut self, key: &str, id: u64, level: usize, at_ns: u64, max_keys: usize) {
        let key = self.hash(key);
        if self.ids.contains_key(&key) {
            while let Some(oldest) = self.order.front()
                && self.ids.contains_key(&key)
            {
                let oldest_is_key = oldest.key == key;
                self.forget_oldest();
                if oldest_is_key {
                    break;
                }
            }
        }
        self.remember(key, id, level, at_ns);
        while self.order.len() > max_keys {
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        let Some(oldest) = self.order.pop_front() else { return };
        // (One lookup: a key stored again since, under a later id, is put back.)
        if let Some(id) = self.ids.remove(&oldest.key)
            && id != oldest.id
        {
            self.ids.insert(oldest.key, id);
        }
        self.per_level[oldest.level] -= 1;
        self.forgotten = true;
    }

    /// Forgets the oldest keys until at most `max_keys` remain, and those stored `window_ns` or
    /// more before `now_ns`.
    pub fn evict(&mut self, max_keys: usize, window_ns: u64, now_ns: u64) {
        while let Some(oldest) = self.order.front() {
            if self.order.len() <= max_keys && oldest.at_ns.saturating_add(window_ns) > now_ns {
                break;
            }
            self.forget_oldest();
        }
    }

    /// When the oldest key is forgotten by time (`u64::MAX`: no key).
    pub fn next_expiry(&self, window_ns: u64) -> u64 {
        self.order.front().map_or(u64::MAX, |k| k.at_ns.saturating_add(window_ns))
    }

    /// Whether keys were forgotten since the last call (the `dedup` cursors may move on).
    pub fn take_forgotten(&mut self) -> bool {
        std::mem::take(&mut self.forgotten)
    }

    /// The id of the oldest key remembered at `level`, if any. Walks from the oldest key until
    /// it finds one of the level: short unless the level's keys are few among many.
    pub fn oldest_id_at(&self, level: usize) -> Option<u64> {
        if self.per_level[level] == 0 {
            return None;
        }
        self.order.iter().find(|k| k.level == level).map(|k| k.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_forgotten_by_count_and_by_time() {
        let mut w = DedupWindow::new(2);
        for i in 0..5u64 {
            w.remember(w.hash(&format!("k{i}")), 100 + i, (i % 2) as usize, i * 1_000);
        }
        assert_eq!(w.get("k3"), Some(103));
        assert_eq!(w.oldest_id_at(1), Some(101));
        w.evict(3, u64::MAX, 10_000);
        assert_eq!((w.len(), w.get("k1"), w.get("k2")), (3, None, Some(102)));
        assert!(w.take_forgotten() && !w.take_forgotten());
        assert_eq!(w.next_expiry(5_000), 7_000);
        w.evict(3, 5_000, 8_000); // k2 (at 2,000) and k3 (at 3,000) are 5 µs old by 8,000
        assert_eq!((w.len(), w.get("k3"), w.get("k4")), (1, None, Some(104)));
        assert_eq!((w.oldest_id_at(0), w.oldest_id_at(1)), (Some(104), None));
    }

    #[test]
    fn keys_read_back_in_order_end_as_they_were_remembered() {
        // Stored: a, b, c; a forgotten; a stored again; then d. Remembered then: b, c, a', d.
        let mut w = DedupWindow::new(1);
        for (i, key) in ["a", "b", "c", "a", "d"].iter().enumerate() {
            w.restore(key, i as u64, 0, i as u64, 10);
        }
        assert_eq!((w.len(), w.get("a"), w.get("b")), (4, Some(3), Some(1)));
        let mut w = DedupWindow::new(1);
        for (i, key) in ["x", "b", "c", "x"].iter().enumerate() {
            w.restore(key, i as u64, 0, i as u64, 2);
        }
        assert_eq!((w.len(), w.get("x"), w.get("b"), w.get("c")), (2, Some(3), None, Some(2)));
    }

    proptest::proptest! {
        /// Against a model that removes each forgotten key from its map at once: the same ids
        /// for every key asked about, through repeats of forgotten keys and restores.
        #[test]
        fn the_window_answers_as_a_map_that_forgets_at_once(
            ops in proptest::collection::vec((0u8..4, 0u16..300, 1usize..150), 1..3000),
        ) {
            let mut w = DedupWindow::new(1);
            let mut model: VecDeque<(String, u64)> = VecDeque::new();
            let mut next_id = 0;
            for (op, key, max_keys) in ops {
                let key = format!("k{key}");
                match op {
                    0 | 1 => {
                        if !model.iter().any(|(k, _)| *k == key) {
                            w.remember(w.hash(&key), next_id, 0, next_id);
                            model.push_back((key.clone(), next_id));
                            next_id += 1;
                        }
                    }
                    2 => {
                        w.evict(max_keys, u64::MAX, 0);
                        while model.len() > max_keys {
                            model.pop_front();
                        }
                    }
                    _ => {
                        w.restore(&key, next_id, 0, next_id, max_keys);
                        if let Some(i) = model.iter().position(|(k, _)| *k == key) {
                            model.drain(..=i);
                        }
                        model.push_back((key.clone(), next_id));
                        while model.len() > max_keys {
                            model.pop_front();
                        }
                        next_id += 1;
                    }
                }
                let expected = model.iter().find(|(k, _)| *k == key).map(|(_, id)| *id);
                proptest::prop_assert_eq!(w.get(&key), expected);
                proptest::prop_assert_eq!(w.len(), model.len());
            }
            for (k, id) in &model {
                proptest::prop_assert_eq!(w.get(k), Some(*id));
            }
        }
    }
}
