//! A queue's memory of idempotency keys: which keys it stored a message for, within a window
//! bounded by count and by time, so that a repeated offer (a producer's retry after a lost
//! answer) is answered with the original's id instead of being stored twice.
//!
//! Nothing here is written anywhere: a durable queue keeps each key in its message's own record
//! (durable with the message, by the same sync) and rebuilds this window from its log on open;
//! the queue's `dedup` consumer group trails the oldest remembered key so that retention keeps
//! those records after their messages are consumed (`Queue::on_log`).
//!
//! Layout, for a window larger than the caches (100,000 keys by default, up to 10 million): the
//! keys, oldest first, in a ring (`order`), each with its sequence number; and an index from a
//! key to its place in the ring, of slots (a 32-bit tag of the key's hash and a 32-bit ring
//! sequence), seven to a 64-byte bucket. A new key costs one cache miss (its bucket, looked up
//! and then written); forgetting the oldest key costs none, because a slot whose sequence has
//! left the ring is simply free (the index is never cleaned, only overwritten). A key whose home
//! bucket is full goes to the next one, and the buckets it passed count it (`overflow`), so that
//! a lookup goes on past a bucket only while keys that passed it are remembered.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};

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
        // The bytes written once, without `Hash for str`'s end marker: a lone write is its own
        // end (the hasher mixes the length in), and the marker cost a third of the hash.
        let one = |state: &foldhash::quality::RandomState| {
            let mut hasher = state.build_hasher();
            hasher.write(key.as_bytes());
            hasher.finish()
        };
        let [a, b] = &self.0;
        (u128::from(one(a)) << 64) | u128::from(one(b))
    }
}

/// Slots of a bucket of the index.
const SLOTS: usize = 7;
/// Lanes of a bucket's two arrays: its slots, and in the tags' last lane its `overflow` count.
const LANES: usize = SLOTS + 1;
/// The lanes that are slots, as bits.
const SLOT_BITS: u32 = (1 << SLOTS) - 1;
/// Buckets of the smallest index.
const MIN_BUCKETS: usize = 16;

/// One cache line of the index: seven slots, each a key's tag and its ring sequence. The tags
/// and the sequences are kept apart, as two arrays of 32-bit lanes, which the compiler compares
/// several at a time even on the x86-64 baseline (SSE2 has no 64-bit compare: slots of one
/// 64-bit word each were compared one by one, half of what placing a key cost).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Bucket {
    /// 0: never used; else a key's tag (never 0). The last lane is `overflow`: remembered keys
    /// that passed this bucket, full when they came, for a later one.
    tags: [u32; LANES],
    /// The ring sequence of the key whose tag the slot holds. A slot whose sequence is not in
    /// the ring is free. (The last lane is not used.)
    seqs: [u32; LANES],
}

impl Bucket {
    fn overflow(&self) -> u32 {
        self.tags[SLOTS]
    }

    fn overflow_mut(&mut self) -> &mut u32 {
        &mut self.tags[SLOTS]
    }

    /// The slots whose tag is `tag`, as bits (slot `i`: bit `i`).
    fn tagged(&self, tag: u32) -> u32 {
        lanes_where(|i| self.tags[i] == tag) & SLOT_BITS
    }

    /// The free slots of a ring of `len` keys whose first has sequence `first_seq`, as bits.
    fn free(&self, first_seq: u32, len: u32) -> u32 {
        lanes_where(|i| self.tags[i] == 0 || self.seqs[i].wrapping_sub(first_seq) >= len) & SLOT_BITS
    }
}

/// The lanes for which `f` holds, as bits: the eight tests made without a branch between them.
fn lanes_where(f: impl Fn(usize) -> bool) -> u32 {
    (0..LANES).fold(0, |bits, i| bits | (u32::from(f(i)) << i))
}

/// The keys a queue remembers, oldest first, and the index that finds them.
#[derive(Default)]
pub(crate) struct DedupWindow {
    hasher: KeyHasher,
    /// A power of two of buckets (none before the first key).
    buckets: Vec<Bucket>,
    order: VecDeque<Remembered>,
    /// Keys remembered per priority level (for the oldest key of a level, without a full scan).
    per_level: Vec<u64>,
    /// Keys forgotten since the window was made: the ring's front as a count that never wraps.
    /// Its low 32 bits are the ring sequence of `order[0]` (`first_seq`), which the index keeps.
    front: u64,
    /// Per level, a position (counted as `front` is) before which the ring holds no key of the
    /// level: where `oldest_id_at` looks from, so that each key is looked at once per level
    /// however often it is asked, not once per call.
    search_from: Vec<u64>,
    /// Keys forgotten since `take_forgotten` last looked.
    forgotten: bool,
}

impl std::fmt::Debug for DedupWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupWindow").field("keys", &self.order.len()).field("buckets", &self.buckets.len()).finish()
    }
}

#[derive(Debug)]
struct Remembered {
    /// Its `KeyHash`, as two words (a `u128` would align each entry to 16 bytes: 48, not 40).
    key: [u64; 2],
    /// The id of the message stored with it.
    id: u64,
    /// When it was stored, ns.
    at_ns: u64,
    /// How many buckets past its home bucket its slot is (each of them counts it in `overflow`).
    displaced: u32,
    level: u8,
}

fn words(key: KeyHash) -> [u64; 2] {
    [(key >> 64) as u64, key as u64]
}

impl Remembered {
    fn key(&self) -> KeyHash {
        (u128::from(self.key[0]) << 64) | u128::from(self.key[1])
    }
}

/// The tag a slot keeps of `key`: never 0, so that a used slot's never is.
fn tag(key: KeyHash) -> u32 {
    ((key >> 96) as u32) | 1
}

/// `key`'s home bucket among `buckets` (a power of two): from bits the tag does not use.
fn home(key: KeyHash, buckets: usize) -> usize {
    (key as u64 as usize) & (buckets - 1)
}

/// Puts `key` with sequence `seq` in the first free slot from its home bucket on, counting it in
/// each full bucket it passes; returns how many it passed. The index must have a free slot.
fn place(buckets: &mut [Bucket], key: KeyHash, seq: u32, first_seq: u32, len: u32) -> u32 {
    let mask = buckets.len() - 1;
    let mut b = home(key, buckets.len());
    for displaced in 0..buckets.len() as u32 {
        let bucket = &mut buckets[b];
        let free = bucket.free(first_seq, len);
        if free != 0 {
            let slot = free.trailing_zeros() as usize;
            (bucket.tags[slot], bucket.seqs[slot]) = (tag(key), seq);
            return displaced;
        }
        *bucket.overflow_mut() += 1;
        b = (b + 1) & mask;
    }
    unreachable!("the index is kept at most half full")
}

impl DedupWindow {
    pub fn new(levels: usize) -> DedupWindow {
        DedupWindow { per_level: vec![0; levels], search_from: vec![0; levels], ..DedupWindow::default() }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// The ring sequence of `order[0]`; `order[i]`'s is `first_seq() + i`, wrapping (the ring
    /// holds far fewer than 2³² keys, `config::MAX_DEDUP_WINDOW`).
    fn first_seq(&self) -> u32 {
        self.front as u32
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
        self.find(key).map(|i| self.order[i].id)
    }

    /// Reads what an offer of `keys` will use, all at once, so that the cache misses overlap
    /// instead of coming one after another as each step waits for the last: the home bucket of
    /// each key, and the oldest keys, which the new ones will push out of a window of
    /// `max_keys`.
    pub fn touch(&self, keys: &[Option<KeyHash>], max_keys: usize) {
        if self.buckets.is_empty() {
            return;
        }
        let mut folded = 0;
        let mut new = 0;
        for key in keys.iter().flatten() {
            folded ^= self.buckets[home(*key, self.buckets.len())].overflow();
            new += 1;
        }
        let forgotten = (self.order.len() + new).saturating_sub(max_keys).min(self.order.len());
        for oldest in self.order.range(..forgotten) {
            folded ^= oldest.displaced;
        }
        std::hint::black_box(folded);
    }

    /// Where `key` is in the ring, if remembered: its home bucket, then the next ones while keys
    /// passed them. A slot's tag is checked first, the whole key (in the ring) only on a match.
    fn find(&self, key: KeyHash) -> Option<usize> {
        if self.buckets.is_empty() {
            return None;
        }
        let (tag, whole, mask) = (tag(key), words(key), self.buckets.len() - 1);
        let mut b = home(key, self.buckets.len());
        for _ in 0..self.buckets.len() {
            let bucket = &self.buckets[b];
            let mut tagged = bucket.tagged(tag);
            while tagged != 0 {
                let i = bucket.seqs[tagged.trailing_zeros() as usize].wrapping_sub(self.first_seq()) as usize;
                tagged &= tagged - 1;
                if i < self.order.len() && self.order[i].key == whole {
                    return Some(i);
                }
            }
            if bucket.overflow() == 0 {
                return None;
            }
            b = (b + 1) & mask;
        }
        None
    }

    /// Remembers `key` (its `hash`) for the message `id` (at priority `level`), stored at
    /// `at_ns`: later than every key remembered before (the queue's lock orders offers).
    pub fn remember(&mut self, key: KeyHash, id: u64, level: usize, at_ns: u64) {
        debug_assert!(self.find(key).is_none(), "a remembered key is a repeat, never stored again");
        if (self.order.len() + 1) * 2 > self.buckets.len() * SLOTS {
            self.rebuild((self.buckets.len() * 2).max(MIN_BUCKETS));
        }
        let (first_seq, len) = (self.first_seq(), self.order.len() as u32);
        let displaced = place(&mut self.buckets, key, first_seq.wrapping_add(len), first_seq, len);
        self.per_level[level] += 1;
        self.order.push_back(Remembered { key: words(key), id, at_ns, displaced, level: level as u8 });
    }

    /// Forgets the oldest keys until `new` more fit in `max_keys`: called before an offer's new
    /// keys are remembered, so that the window holds at most `max_keys` after it too (not only
    /// once the next offer or tick evicts), unless the offer alone carries more.
    pub fn make_room(&mut self, max_keys: usize, new: usize) {
        while !self.order.is_empty() && self.order.len() + new > max_keys {
            self.forget_oldest();
        }
        // The ring grows by doubling up to `max_keys` exactly, not past it: once the window is
        // full, each new key then goes in the place of the key just forgotten, already in the
        // cache, not in a place last written a whole ring ago.
        let needed = self.order.len() + new;
        if needed > self.order.capacity() {
            let grown = (self.order.len() * 2).min(max_keys).max(needed);
            self.order.reserve_exact(grown - self.order.len());
        }
    }

    /// Makes a new index of `buckets` buckets for the keys in the ring.
    fn rebuild(&mut self, buckets: usize) {
        assert!(buckets.is_power_of_two() && self.order.len() * 2 <= buckets * SLOTS, "an index at most half full");
        self.buckets = vec![Bucket::default(); buckets];
        let (first_seq, len) = (self.first_seq(), self.order.len() as u32);
        for (i, k) in self.order.iter_mut().enumerate() {
            k.displaced = place(&mut self.buckets, k.key(), first_seq.wrapping_add(i as u32), first_seq, len);
        }
    }

    /// Remembers a key read back from a log on open, in the order the keys were stored, keeping
    /// at most `max_keys`: as `remember`, but a key seen again was stored again after it was
    /// forgotten, and so was every key before it (keys are forgotten oldest first).
    pub fn restore(&mut self, key: KeyHash, id: u64, level: usize, at_ns: u64, max_keys: usize) {
        if let Some(i) = self.find(key) {
            for _ in 0..=i {
                self.forget_oldest();
            }
        }
        self.make_room(max_keys.max(1), 1);
        self.remember(key, id, level, at_ns);
    }

    /// Forgets the oldest key: its slot is free from now on, as its sequence left the ring; only
    /// the buckets it passed are touched.
    fn forget_oldest(&mut self) {
        let Some(oldest) = self.order.pop_front() else { return };
        self.front += 1;
        if oldest.displaced > 0 {
            let (mut b, mask) = (home(oldest.key(), self.buckets.len()), self.buckets.len() - 1);
            for _ in 0..oldest.displaced {
                *self.buckets[b].overflow_mut() -= 1;
                b = (b + 1) & mask;
            }
        }
        self.per_level[usize::from(oldest.level)] -= 1;
        self.forgotten = true;
    }

    /// Forgets the oldest keys until at most `max_keys` remain, and those stored `window_ns` or
    /// more before `now_ns`. An index left mostly empty is made smaller (and the ring's room).
    pub fn evict(&mut self, max_keys: usize, window_ns: u64, now_ns: u64) {
        let before = self.order.len();
        while let Some(oldest) = self.order.front() {
            if self.order.len() <= max_keys && oldest.at_ns.saturating_add(window_ns) > now_ns {
                break;
            }
            self.forget_oldest();
        }
        if self.order.len() == before {
            return;
        }
        let mut buckets = self.buckets.len();
        while buckets > MIN_BUCKETS && self.order.len() * 16 < buckets * SLOTS {
            buckets /= 2;
        }
        if buckets < self.buckets.len() {
            self.rebuild(buckets);
            self.order.shrink_to(self.order.len() * 2);
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

    /// The id of the oldest key remembered at `level`, if any. Walks the ring from where the
    /// last call found the level's oldest key (or the ring's front, if that key was forgotten
    /// since) to the next key of the level: a level whose keys are few among many is walked past
    /// once, not at every tick.
    pub fn oldest_id_at(&mut self, level: usize) -> Option<u64> {
        if self.per_level[level] == 0 {
            return None;
        }
        // (A position the front has passed: from the front.)
        let from = self.search_from[level].saturating_sub(self.front) as usize;
        let found = self.order.range(from..).position(|k| usize::from(k.level) == level);
        let i = from + found.expect("a level with keys remembered has one in the ring");
        self.search_from[level] = self.front + i as u64;
        Some(self.order[i].id)
    }
}

/// The newest keys of one log, read back in the log's order when a queue opens: at most the
/// window's most (`max`), the older ones let go as newer come. The window a restart rebuilds
/// keeps only the newest `max` keys of all its logs, so a key older than a log's newest `max`
/// would be forgotten at once; not keeping it bounds what an open holds in memory by the window,
/// however many keyed records a backlog holds.
#[derive(Debug)]
pub(crate) struct RecentKeys<T> {
    max: usize,
    keys: VecDeque<T>,
}

impl<T> RecentKeys<T> {
    pub fn new(max: usize) -> RecentKeys<T> {
        RecentKeys { max, keys: VecDeque::new() }
    }

    /// Keeps `key`, newer than every key kept before, letting the oldest go past `max`.
    pub fn push(&mut self, key: T) {
        if self.max == 0 {
            return;
        }
        if self.keys.len() == self.max {
            self.keys.pop_front();
        }
        self.keys.push_back(key);
    }

    /// The keys kept, oldest first.
    pub fn into_vec(self) -> Vec<T> {
        self.keys.into()
    }
}

impl<T> Default for RecentKeys<T> {
    fn default() -> RecentKeys<T> {
        RecentKeys::new(0)
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
    fn a_full_window_holds_its_keys_in_a_ring_no_larger_than_the_window() {
        // (Doubling alone would have made room for 2,048.)
        let mut w = DedupWindow::new(1);
        for i in 0..6_000u64 {
            w.make_room(1_500, 1);
            w.remember(w.hash(&format!("k{i}")), i, 0, i);
        }
        assert_eq!((w.len(), w.order.capacity()), (1_500, 1_500));
        assert_eq!((w.get("k4499"), w.get("k4500"), w.get("k5999")), (None, Some(4_500), Some(5_999)));
        // So does one read back from the logs on open.
        let mut w = DedupWindow::new(1);
        for i in 0..6_000u64 {
            w.restore(w.hash(&format!("k{i}")), i, 0, i, 1_500);
        }
        assert_eq!((w.len(), w.order.capacity(), w.get("k4500")), (1_500, 1_500, Some(4_500)));
    }

    #[test]
    fn keys_read_back_in_order_end_as_they_were_remembered() {
        // Stored: a, b, c; a forgotten; a stored again; then d. Remembered then: b, c, a', d.
        let mut w = DedupWindow::new(1);
        for (i, key) in ["a", "b", "c", "a", "d"].iter().enumerate() {
            w.restore(w.hash(key), i as u64, 0, i as u64, 10);
        }
        assert_eq!((w.len(), w.get("a"), w.get("b")), (4, Some(3), Some(1)));
        let mut w = DedupWindow::new(1);
        for (i, key) in ["x", "b", "c", "x"].iter().enumerate() {
            w.restore(w.hash(key), i as u64, 0, i as u64, 2);
        }
        assert_eq!((w.len(), w.get("x"), w.get("b"), w.get("c")), (2, Some(3), None, Some(2)));
    }

    /// The index's invariants: each remembered key found at its place in the ring, and each
    /// bucket's `overflow` exactly the keys that passed it.
    fn check_index(w: &DedupWindow) {
        let mut overflow = vec![0u32; w.buckets.len()];
        for (i, k) in w.order.iter().enumerate() {
            let key = k.key();
            assert_eq!(w.find(key), Some(i));
            let home = home(key, w.buckets.len());
            for d in 0..k.displaced as usize {
                overflow[(home + d) % w.buckets.len()] += 1;
            }
        }
        assert_eq!(w.buckets.iter().map(Bucket::overflow).collect::<Vec<_>>(), overflow);
    }

    #[test]
    fn keys_that_share_a_home_bucket_overflow_and_are_forgotten_cleanly() {
        // Every key's low word is a multiple of 2²⁰: one home bucket for all, whatever the size.
        let key = |i: u64| (u128::from(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1) << 64) | (u128::from(i) << 20);
        let mut w = DedupWindow::new(1);
        for i in 0..200 {
            w.remember(key(i), i, 0, i);
            check_index(&w);
        }
        assert!(w.buckets.len() >= 64 && w.order.iter().map(|k| k.displaced).max() >= Some(20));
        for i in 0..200 {
            assert_eq!(w.get_hashed(key(i)), Some(i));
        }
        w.evict(50, u64::MAX, 0);
        check_index(&w);
        assert_eq!((w.get_hashed(key(149)), w.get_hashed(key(150))), (None, Some(150)));
        w.evict(0, u64::MAX, 0);
        assert!(w.buckets.iter().all(|b| b.overflow() == 0));
        assert_eq!(w.get_hashed(key(199)), None);
    }

    #[test]
    fn ring_sequences_wrap_around() {
        let mut w = DedupWindow::new(1);
        w.front = u64::from(u32::MAX - 100);
        for i in 0..1_000u64 {
            w.remember(w.hash(&format!("k{i}")), i, 0, i);
            w.evict(150, u64::MAX, 0);
            check_index(&w);
        }
        assert!(w.first_seq() < 1_000 - 150);
        assert_eq!((w.get("k849"), w.get("k850"), w.get("k999")), (None, Some(850), Some(999)));
    }

    #[test]
    fn an_emptied_window_gives_back_its_index() {
        let mut w = DedupWindow::new(1);
        for i in 0..100_000u64 {
            w.remember(w.hash(&format!("k{i}")), i, 0, i);
        }
        let big = w.buckets.len();
        assert!(big * SLOTS >= 200_000);
        w.evict(10, u64::MAX, 0);
        check_index(&w);
        assert!(w.buckets.len() * 16 <= big, "{} buckets after {big}", w.buckets.len());
        assert_eq!(w.get("k99990"), Some(99_990));
    }

    proptest::proptest! {
        /// A queue's logs read back on open, each keeping only its newest `max_keys` keys
        /// (`RecentKeys`), rebuild the window that all their keys rebuild: the same id for every
        /// key, repeats of forgotten keys included.
        #[test]
        fn only_each_logs_newest_keys_rebuild_the_same_window(
            stored in proptest::collection::vec((0usize..3, 0u16..40), 1..400),
            max_keys in 1usize..60,
        ) {
            // Record i, stored at time i in log `log` with key `key`.
            let hasher = KeyHasher::default();
            let key = |k: u16| hasher.hash(&format!("k{k}"));
            let all: Vec<(u64, u64, usize, KeyHash)> =
                stored.iter().enumerate().map(|(i, &(log, k))| (i as u64, i as u64, log, key(k))).collect();
            let mut recent: Vec<RecentKeys<(u64, u64, usize, KeyHash)>> = (0..3).map(|_| RecentKeys::new(max_keys)).collect();
            for &record in &all {
                recent[record.2].push(record);
            }
            let mut kept: Vec<_> = recent.into_iter().flat_map(RecentKeys::into_vec).collect();
            kept.sort_by_key(|&(at, id, ..)| (at, id));
            let rebuild = |keys: &[(u64, u64, usize, KeyHash)]| {
                let mut w = DedupWindow { hasher: hasher.clone(), ..DedupWindow::new(3) };
                for &(at, id, level, key) in keys {
                    w.restore(key, id, level, at, max_keys);
                }
                w
            };
            let (mut whole, mut trimmed) = (rebuild(&all), rebuild(&kept));
            proptest::prop_assert_eq!(whole.len(), trimmed.len());
            for k in 0..40 {
                proptest::prop_assert_eq!(whole.get_hashed(key(k)), trimmed.get_hashed(key(k)), "key k{}", k);
            }
            for level in 0..3 {
                proptest::prop_assert_eq!(whole.oldest_id_at(level), trimmed.oldest_id_at(level));
            }
        }

        /// The oldest key of each level, asked between keys remembered at random levels and
        /// forgotten from the front, is the first of its level in the ring (a plain walk), with
        /// the ring's sequences starting near their wrap.
        #[test]
        fn the_oldest_key_of_each_level_is_found_as_a_walk_finds_it(
            ops in proptest::collection::vec((0u8..3, 0usize..4), 1..2000),
            max_keys in 1usize..100,
        ) {
            let mut w = DedupWindow::new(4);
            w.front = u64::from(u32::MAX - 500);

            for (i, (op, level)) in ops.into_iter().enumerate() {
                match op {
                    0 | 1 => {
                        w.make_room(max_keys, 1);
                        w.remember(w.hash(&format!("k{i}")), i as u64, level, i as u64);
                    }
                    _ => {
                        let walked = w.order.iter().find(|k| usize::from(k.level) == level).map(|k| k.id);
                        proptest::prop_assert_eq!(w.oldest_id_at(level), walked);
                    }
                }
            }
        }

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
                            if op == 1 {
                                // Room first, as an offer makes it: at most `max_keys` after.
                                w.make_room(max_keys, 1);
                                while !model.is_empty() && model.len() + 1 > max_keys {
                                    model.pop_front();
                                }
                            }
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
                        w.restore(w.hash(&key), next_id, 0, next_id, max_keys);
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
            check_index(&w);
        }
    }
}
