//! A connection's input buffer, for both protocols.
//!
//! Small while its connection is quiet, so thousands of idle connections cost a few KiB each;
//! larger while it streams (reads that fill it double the next one, up to `STREAMING_BYTES`).
//! A request larger than that is read into a buffer of exactly its size, whose bytes are first
//! taken from the server's memory budget (`max_memory_bytes`): partial requests count in the
//! budget, a peer announcing one cannot make the server hold more than it may, and a message
//! kept from it (payloads are slices of the buffer, not copies) holds no more than its bytes.

use bytes::BytesMut;
use petrel_broker::{Broker, MemoryHold};

/// A quiet connection's buffer.
pub(crate) const QUIET_BYTES: usize = 4 << 10;
/// The largest read; requests larger than this get a buffer of their own.
pub(crate) const STREAMING_BYTES: usize = 64 << 10;
/// The largest request a client that has not logged in may send (when the server has users):
/// enough for a login, and never a buffer of its own.
pub(crate) const UNTRUSTED_BYTES: usize = STREAMING_BYTES;

/// The memory budget cannot hold the request being read: it is to be refused and skipped.
#[derive(Debug)]
pub(crate) struct OverBudget;

pub(crate) struct Input {
    pub buf: BytesMut,
    /// What the next read may bring.
    read_size: usize,
    /// Room the last `prepare` left, to see whether the read filled it.
    room: usize,
    /// The budget's bytes for the large request being read, while it is.
    held: Option<MemoryHold>,
}

impl Input {
    pub(crate) fn new() -> Input {
        Input { buf: BytesMut::new(), read_size: QUIET_BYTES, room: 0, held: None }
    }

    /// Makes room for the next read. `request`: the whole length of the request at the front of
    /// the buffer, when that is known and it has not all arrived.
    pub(crate) fn prepare(&mut self, request: Option<usize>, broker: &Broker) -> Result<(), OverBudget> {
        match request {
            Some(len) if len > STREAMING_BYTES => {
                if self.held.is_none() || self.buf.capacity() < len {
                    let hold = broker.hold_memory(len as u64).ok_or(OverBudget)?;
                    let mut own = BytesMut::with_capacity(len);
                    own.extend_from_slice(&self.buf);
                    self.buf = own;
                    self.held = Some(hold);
                }
            }
            _ => {
                self.taken();
                let want = request.unwrap_or(0).max(self.buf.len() + self.read_size);
                if self.buf.is_empty() && self.buf.capacity() > 2 * self.read_size {
                    // Quiet again after a burst: give the large buffer back.
                    self.buf = BytesMut::with_capacity(self.read_size);
                } else if self.buf.capacity() < want {
                    self.buf.reserve(want - self.buf.len());
                }
            }
        }
        self.room = self.buf.capacity() - self.buf.len();
        Ok(())
    }

    /// The request at the front of the buffer was taken whole: the budget's bytes for it go
    /// back before it is handled, so its answer never reaches a client ahead of them (a
    /// message kept from it counts in the budget on its own).
    pub(crate) fn taken(&mut self) {
        self.held = None;
    }

    /// A read brought `n` bytes.
    pub(crate) fn filled(&mut self, n: usize) {
        if n >= self.room && self.held.is_none() {
            self.read_size = (self.read_size * 2).min(STREAMING_BYTES);
        } else if n < self.read_size / 4 {
            self.read_size = (self.read_size / 2).max(QUIET_BYTES);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn broker(max_memory_bytes: u64) -> (tempfile::TempDir, Broker) {
        let dir = tempfile::tempdir().unwrap();
        let options = petrel_broker::BrokerOptions { max_memory_bytes, ..Default::default() };
        let broker = Broker::open(dir.path(), options).unwrap();
        (dir, broker)
    }

    #[test]
    fn quiet_connections_keep_a_small_buffer_and_busy_ones_grow_it() {
        let (_dir, broker) = broker(0);
        let mut input = Input::new();
        input.prepare(None, &broker).unwrap();
        assert!(input.buf.capacity() < 2 * QUIET_BYTES);
        // Reads that fill the room make the next one larger, up to STREAMING_BYTES.
        for _ in 0..10 {
            input.prepare(None, &broker).unwrap();
            let room = input.buf.capacity() - input.buf.len();
            input.buf.resize(input.buf.len() + room, 0);
            input.filled(room);
            input.buf.clear();
        }
        input.prepare(None, &broker).unwrap();
        assert!(input.buf.capacity() >= STREAMING_BYTES);
        // Small reads shrink it again.
        for _ in 0..10 {
            input.filled(10);
            input.buf.clear();
            input.prepare(None, &broker).unwrap();
        }
        assert!(input.buf.capacity() < 2 * QUIET_BYTES, "{}", input.buf.capacity());
    }

    #[test]
    fn a_large_request_gets_an_exact_buffer_held_in_the_budget() {
        let (_dir, broker) = broker(1 << 20);
        let mut input = Input::new();
        input.prepare(None, &broker).unwrap();
        input.buf.extend_from_slice(&[1; 100]);
        input.prepare(Some(300_000), &broker).unwrap();
        assert_eq!(&input.buf[..], &[1; 100][..], "what was read stays");
        assert!(input.buf.capacity() >= 300_000 && input.buf.capacity() < 300_000 + 4096);
        assert_eq!(broker.memory().0, 300_000);
        // Another connection's request does not fit beside it.
        let mut other = Input::new();
        assert!(other.prepare(Some(800_000), &broker).is_err());
        // Taken: the hold goes back.
        input.buf.clear();
        input.prepare(None, &broker).unwrap();
        assert_eq!(broker.memory().0, 0);
        other.prepare(Some(800_000), &broker).unwrap();
    }
}
