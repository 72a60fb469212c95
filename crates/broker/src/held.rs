//! A message waiting in a queue kept in memory, in the few words most messages need.
//!
//! A `Message` is ~280 bytes of fields, most of them empty strings for a queue's messages; held
//! as such, a 32-byte message took ~450 bytes of the server's memory while the memory budget
//! counted 32. A `Held` message keeps what every message has (ids, times, counts, payload) inline
//! and the rest (texts, headers, idempotency key) encoded in one allocation, none when all are
//! empty.

use std::collections::VecDeque;

use bytes::Bytes;
use petrel_proto::{Message, MessageKind, Status};

/// Bytes the memory budget counts for each message a queue holds in memory besides its own
/// (`Message::size`, which counts its texts and headers too): its `Held`, its share of the
/// queue's chunks, and the rounding of its payload's allocation and of its other fields'.
pub const HELD_OVERHEAD: u64 = (std::mem::size_of::<Held>() + 40) as u64;

/// As `HELD_OVERHEAD`, for a delayed message: held in a B-tree by due time, whose nodes are
/// about half full when filled in order (as delayed messages mostly come).
pub const DELAYED_OVERHEAD: u64 = (2 * (std::mem::size_of::<Held>() + 16) + 40) as u64;

/// Messages a chunk of a `HeldQueue` holds once full (a put-back message may pass it: messages
/// taken and returned go back to their place; a chunk past twice this is split).
const CHUNK: usize = 1024;

/// A queue's waiting messages in memory, in id order: chunks of `CHUNK`, each grown as it fills,
/// so that a growing backlog takes a chunk at a time. (A ring that doubles its room as it grows
/// holds its old and new rooms at once while it copies, and a memory allocator may keep the old:
/// a backlog took up to three times its messages.)
#[derive(Debug, Default)]
pub(crate) struct HeldQueue {
    chunks: VecDeque<VecDeque<Held>>,
    len: usize,
}

impl HeldQueue {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn front(&self) -> Option<&Held> {
        self.chunks.front().and_then(VecDeque::front)
    }

    /// Adds `m`, whose id is higher than every one held.
    pub fn push_back(&mut self, m: Held) {
        debug_assert!(self.chunks.back().and_then(VecDeque::back).is_none_or(|last| last.id < m.id));
        if self.chunks.back().is_none_or(|c| c.len() >= CHUNK) {
            // Grown as it fills (a few messages take a few slots, not a whole chunk's).
            self.chunks.push_back(VecDeque::new());
        }
        self.chunks.back_mut().expect("made above").push_back(m);
        self.len += 1;
    }

    pub fn pop_front(&mut self) -> Option<Held> {
        let chunk = self.chunks.front_mut()?;
        let m = chunk.pop_front();
        if chunk.is_empty() {
            self.chunks.pop_front();
        }
        self.len -= usize::from(m.is_some());
        m
    }

    /// Puts `m` back at its place by id (a message taken and returned).
    pub fn insert_by_id(&mut self, m: Held) {
        // The first chunk whose last id is higher; else the last chunk (or a new one).
        let at = self.chunks.partition_point(|c| c.back().is_some_and(|last| last.id < m.id));
        if at == self.chunks.len() {
            return self.push_back(m);
        }
        let chunk = &mut self.chunks[at];
        let i = chunk.partition_point(|waiting| waiting.id < m.id);
        chunk.insert(i, m);
        self.len += 1;
        if chunk.len() > 2 * CHUNK {
            // Many put back into one chunk (a disconnect's thousands of reads): split, so that
            // an insert moves at most a chunk's worth, not the whole backlog's.
            let tail = chunk.split_off(chunk.len() / 2);
            chunk.shrink_to_fit();
            self.chunks.insert(at + 1, tail);
        }
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = &Held> {
        self.chunks.iter().flatten()
    }
}

#[derive(Debug)]
pub(crate) struct Held {
    pub id: u64,
    pub timestamp: u64,
    pub expires_at: u64,
    pub deliver_at: u64,
    pub deliveries: u32,
    pub priority: u8,
    kind: MessageKind,
    status: Status,
    /// Bit 0: durable; bit 1: compressed.
    flags: u8,
    /// The fields most queue messages leave empty, encoded (`encode_rare`); none when all are.
    rare: Option<Box<[u8]>>,
    pub payload: Bytes,
}

const DURABLE: u8 = 1;
const COMPRESSED: u8 = 2;

/// The longest of `m`'s text fields and header names: at most `u16::MAX` for a queue to hold it
/// (as on the wire, where each has a u16 length).
pub(crate) fn longest_text(m: &Message) -> usize {
    let names = m.headers.iter().map(|(n, _)| n.len());
    m.texts().iter().map(|t| t.len()).chain(names).max().unwrap_or(0)
}

/// `m`'s text fields and headers as one allocation, or `None` when all are empty: the number of
/// headers (u32), each text as a u16 length and its bytes, then each header as u16 name length,
/// name, u32 value length, value. (The count first, so that `Held::size` needs no walk.)
/// (Lengths fit: a queue refuses a longer text or header name (`longest_text`), as the wire
/// carries each with a u16 length, and each header value with a u32.)
fn encode_rare(m: &Message) -> Option<Box<[u8]>> {
    if m.texts().iter().all(|t| t.is_empty()) && m.headers.is_empty() {
        return None;
    }
    let len = 4
        + m.texts().iter().map(|t| 2 + t.len()).sum::<usize>()
        + m.headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&u32::try_from(m.headers.len()).expect("a header count fits a u32").to_le_bytes());
    for text in m.texts() {
        out.extend_from_slice(&u16::try_from(text.len()).expect("a text field fits a u16 length").to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    }
    for (name, value) in &m.headers {
        out.extend_from_slice(&u16::try_from(name.len()).expect("a header name fits a u16 length").to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&u32::try_from(value.len()).expect("a header value fits a u32 length").to_le_bytes());
        out.extend_from_slice(value);
    }
    debug_assert_eq!(out.len(), len);
    Some(out.into_boxed_slice())
}

/// Sets `m`'s text fields and headers from `encode_rare`'s bytes.
fn decode_rare(mut rare: &[u8], m: &mut Message) {
    fn take<'a>(rare: &mut &'a [u8], n: usize) -> &'a [u8] {
        let (head, rest) = rare.split_at(n);
        *rare = rest;
        head
    }
    fn text(rare: &mut &[u8]) -> String {
        let len = u16::from_le_bytes(take(rare, 2).try_into().expect("2 bytes"));
        String::from_utf8(take(rare, usize::from(len)).to_vec()).expect("encoded from a String")
    }
    let headers = u32::from_le_bytes(take(&mut rare, 4).try_into().expect("4 bytes"));
    m.set_texts(std::array::from_fn(|_| text(&mut rare)));
    for _ in 0..headers {
        let name = text(&mut rare);
        let len = u32::from_le_bytes(take(&mut rare, 4).try_into().expect("4 bytes")) as usize;
        m.headers.push((name, Bytes::copy_from_slice(take(&mut rare, len))));
    }
}

impl Held {
    /// Holds `m` (its `delay_ms` is dropped: a held message's due time is `deliver_at`).
    pub fn new(m: Message) -> Held {
        Held {
            id: m.id,
            timestamp: m.timestamp,
            expires_at: m.expires_at,
            deliver_at: m.deliver_at,
            deliveries: m.deliveries,
            priority: m.priority,
            kind: m.kind,
            status: m.status,
            flags: if m.durable { DURABLE } else { 0 } | if m.compressed { COMPRESSED } else { 0 },
            rare: encode_rare(&m),
            payload: m.payload,
        }
    }

    /// The message, as a copy (the payload shared, not copied).
    pub fn to_message(&self) -> Message {
        let mut m = Message {
            id: self.id,
            kind: self.kind,
            status: self.status,
            durable: self.flags & DURABLE != 0,
            compressed: self.flags & COMPRESSED != 0,
            timestamp: self.timestamp,
            expires_at: self.expires_at,
            deliveries: self.deliveries,
            priority: self.priority,
            deliver_at: self.deliver_at,
            ..Message::new(self.payload.clone())
        };
        if let Some(rare) = &self.rare {
            decode_rare(rare, &mut m);
        }
        m
    }

    /// Its bytes as `Message::size` counts them: the payload and the rest it carries (the
    /// encoding's bytes but for its lengths: the header count, 2 for each text, 6 for each header).
    pub fn size(&self) -> u64 {
        let rare = self.rare.as_deref().map_or(0, |r| {
            let headers = u32::from_le_bytes([r[0], r[1], r[2], r[3]]) as usize;
            r.len() - 4 - 2 * Message::TEXT_FIELDS - 6 * headers + petrel_proto::HEADER_SIZE * headers
        });
        (self.payload.len() + rare) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_message_comes_back_as_it_was_given() {
        let plain = Message { id: 7, timestamp: 9, deliveries: 2, priority: 1, ..Message::new(&b"payload"[..]) };
        let full = Message {
            kind: MessageKind::Request,
            status: Status::HandlerError,
            durable: true,
            compressed: true,
            expires_at: 11,
            deliver_at: 13,
            idempotency_key: "k".into(),
            request_id: "r".into(),
            subject: "s".into(),
            destination: "d".into(),
            reply_to: "q".into(),
            mimetype: "text/plain".into(),
            charset: "utf-8".into(),
            headers: vec![("h".into(), Bytes::from_static(b"v"))],
            ..plain.clone()
        };
        for m in [plain, full] {
            let held = Held::new(m.clone());
            assert_eq!(held.to_message(), m);
            assert_eq!(held.size(), m.size());
        }
        assert!(Held::new(Message::new(&b"x"[..])).rare.is_none(), "a plain message holds no box");
        let keyed = Held::new(Message { idempotency_key: "order-17".into(), ..Message::new(&b"x"[..]) });
        assert_eq!(keyed.rare.as_ref().map(|r| r.len()), Some(4 + 7 * 2 + 8));
        assert!(std::mem::size_of::<Held>() <= 88, "{} bytes", std::mem::size_of::<Held>());
    }

    /// Thousands of messages put back in no order (a disconnect's reads, from a map) keep every
    /// chunk within twice its size: one chunk took them all, and each insert moved the backlog.
    #[test]
    fn many_put_back_in_any_order_keep_chunks_bounded() {
        let mut q = HeldQueue::default();
        let n = 20 * CHUNK as u64;
        let mut ids: Vec<u64> = (1..=n).collect();
        // A fixed shuffle (a multiplicative step through the ids).
        ids.sort_by_key(|id| id.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20);
        for id in ids {
            q.insert_by_id(Held::new(Message { id, ..Message::default() }));
        }
        assert_eq!(q.len(), n as usize);
        assert!(q.iter().map(|m| m.id).eq(1..=n), "in id order");
        let largest = q.chunks.iter().map(VecDeque::len).max().unwrap();
        assert!(largest <= 2 * CHUNK, "a chunk of {largest}");
    }

    proptest::proptest! {
        /// Against a `VecDeque` kept sorted: the same messages in the same order, through pushes,
        /// pops and put-backs across chunk boundaries.
        #[test]
        fn a_held_queue_keeps_id_order_as_a_sorted_deque_does(ops in proptest::collection::vec(0u8..3, 1..6000)) {
            let (mut q, mut model, mut next_id) = (HeldQueue::default(), VecDeque::new(), 0u64);
            let mut taken = Vec::new();
            for op in ops {
                match op {
                    0 => {
                        next_id += 1;
                        q.push_back(Held::new(Message { id: next_id, ..Message::default() }));
                        model.push_back(next_id);
                    }
                    1 => {
                        let m = q.pop_front().map(|m| m.id);
                        proptest::prop_assert_eq!(m, model.pop_front());
                        taken.extend(m);
                    }
                    _ => {
                        if let Some(id) = taken.pop() {
                            q.insert_by_id(Held::new(Message { id, ..Message::default() }));
                            let at = model.partition_point(|&w| w < id);
                            model.insert(at, id);
                        }
                    }
                }
                proptest::prop_assert_eq!(q.len(), model.len());
                proptest::prop_assert_eq!(q.front().map(|m| m.id), model.front().copied());
            }
            proptest::prop_assert!(q.iter().map(|m| m.id).eq(model.iter().copied()));
        }
    }
}
