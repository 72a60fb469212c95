//! A connection's answers and pushes waiting for its writer, bounded in chunks and in bytes: a
//! client that stops reading holds at most `max_queued_responses` chunks and
//! `max_queued_response_bytes` bytes of them (one chunk larger than that waits for an empty
//! outbox and then goes alone), and whoever produces more waits.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{Semaphore, mpsc};

pub(crate) use mpsc::error::TrySendError;

/// Bytes for the connection's writer: whole frames, then the large payload that ends the last of
/// them, left out of it when it was encoded (`encode_split`) so that the same vectored write
/// sends it from where it was read, not from a copy.
#[derive(Debug, Default)]
pub(crate) struct Chunk {
    pub frames: Vec<u8>,
    pub payload: Bytes,
}

impl Chunk {
    pub(crate) fn len(&self) -> usize {
        self.frames.len() + self.payload.len()
    }
}

impl From<Vec<u8>> for Chunk {
    fn from(frames: Vec<u8>) -> Chunk {
        Chunk { frames, payload: Bytes::new() }
    }
}

/// The producing side; cheap to clone.
#[derive(Clone)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<Chunk>,
    /// Permits are bytes of room.
    room: Arc<Semaphore>,
    max_bytes: usize,
    /// Chunks written so far (`written`): whether the client reads at all.
    written: Arc<std::sync::atomic::AtomicU64>,
}

/// The writer's side.
pub(crate) struct Outgoing {
    rx: mpsc::Receiver<Chunk>,
    room: Arc<Semaphore>,
    max_bytes: usize,
    written: Arc<std::sync::atomic::AtomicU64>,
}

pub(crate) fn outbox(max_chunks: usize, max_bytes: usize) -> (Outbox, Outgoing) {
    assert!(max_chunks > 0 && max_bytes > 0 && max_bytes <= u32::MAX as usize);
    let (tx, rx) = mpsc::channel(max_chunks);
    let room = Arc::new(Semaphore::new(max_bytes));
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    (
        Outbox { tx, room: Arc::clone(&room), max_bytes, written: Arc::clone(&written) },
        Outgoing { rx, room, max_bytes, written },
    )
}

/// The bytes of room a chunk takes: its length, at most the whole outbox.
fn cost(chunk: &Chunk, max_bytes: usize) -> u32 {
    chunk.len().min(max_bytes) as u32
}

/// The writer is gone.
#[derive(Debug)]
pub(crate) struct Closed;

impl Outbox {
    /// Queues `chunk`, waiting for room.
    pub(crate) async fn send(&self, chunk: impl Into<Chunk>) -> Result<(), Closed> {
        let chunk = chunk.into();
        self.reserve(chunk.len()).await?.send(chunk);
        Ok(())
    }

    /// Room for a chunk of `bytes`, in line with the other senders: the chunk's place, then its
    /// bytes, and nothing to wait for after the bytes are taken. Dropped (a wait given up),
    /// all it took is given back.
    pub(crate) async fn reserve(&self, bytes: usize) -> Result<Reserved<'_>, Closed> {
        let place = self.tx.reserve().await.map_err(|_| Closed)?;
        let cost = bytes.min(self.max_bytes) as u32;
        let room = self.room.acquire_many(cost).await.map_err(|_| Closed)?;
        Ok(Reserved { place, room, cost, max_bytes: self.max_bytes })
    }

    /// Chunks the writer has written so far: unchanged while something waits, the client is
    /// not reading.
    pub(crate) fn chunks_written(&self) -> u64 {
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Nothing is queued or being written: bytes written to the connection now come after all
    /// that was sent here.
    pub(crate) fn is_idle(&self) -> bool {
        self.room.available_permits() == self.max_bytes
    }

    /// Queues `chunk` if there is room now.
    pub(crate) fn try_send(&self, chunk: impl Into<Chunk>) -> Result<(), TrySendError<Chunk>> {
        let chunk = chunk.into();
        let cost = cost(&chunk, self.max_bytes);
        let Ok(permits) = self.room.try_acquire_many(cost) else {
            return Err(if self.tx.is_closed() { TrySendError::Closed(chunk) } else { TrySendError::Full(chunk) });
        };
        permits.forget();
        self.tx.try_send(chunk).inspect_err(|_| self.room.add_permits(cost as usize))
    }
}

/// Room taken for a chunk (`Outbox::reserve`).
pub(crate) struct Reserved<'a> {
    place: mpsc::Permit<'a, Chunk>,
    room: tokio::sync::SemaphorePermit<'a>,
    cost: u32,
    max_bytes: usize,
}

impl Reserved<'_> {
    /// Queues `chunk`, of the bytes reserved: the writer gives back what it took.
    pub(crate) fn send(self, chunk: Chunk) {
        assert_eq!(cost(&chunk, self.max_bytes), self.cost, "a chunk of the bytes reserved");
        self.room.forget();
        self.place.send(chunk);
    }
}

/// The writer is gone: whoever waits for room, or would, is told so rather than left waiting for
/// chunks that will never be written.
impl Drop for Outgoing {
    fn drop(&mut self) {
        self.room.close();
    }
}

impl Outgoing {
    /// The next chunk, waiting for one. Its bytes stay taken until it is `written`.
    pub(crate) async fn recv(&mut self) -> Option<Chunk> {
        self.rx.recv().await
    }

    /// The next chunk if one is waiting.
    pub(crate) fn try_recv(&mut self) -> Option<Chunk> {
        self.rx.try_recv().ok()
    }

    /// `chunk`, received, is written: its bytes are room again.
    pub(crate) fn written(&self, chunk: &Chunk) {
        self.room.add_permits(cost(chunk, self.max_bytes) as usize);
        self.written.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bounded_in_bytes_and_chunks() {
        let (outbox, mut outgoing) = outbox(8, 100);
        outbox.try_send(vec![0; 60]).unwrap();
        assert!(matches!(outbox.try_send(vec![0; 60]), Err(TrySendError::Full(_))), "over the bytes");
        outbox.try_send(vec![0; 40]).unwrap();
        let first = outgoing.try_recv().unwrap();
        assert_eq!(first.len(), 60);
        assert!(matches!(outbox.try_send(vec![0; 1]), Err(TrySendError::Full(_))), "room only once written");
        outgoing.written(&first);
        // A chunk larger than the outbox waits for it to empty, then goes alone.
        let big = tokio::spawn({
            let outbox = outbox.clone();
            async move { outbox.send(vec![0; 500]).await }
        });
        tokio::task::yield_now().await;
        assert!(!big.is_finished());
        let second = outgoing.recv().await.unwrap();
        assert_eq!(second.len(), 40);
        assert!(!outbox.is_idle());
        outgoing.written(&second);
        big.await.unwrap().unwrap();
        let big = outgoing.recv().await.unwrap();
        assert_eq!(big.len(), 500);
        outgoing.written(&big);
        assert!(outbox.is_idle());
        for _ in 0..8 {
            outbox.try_send(vec![0; 1]).unwrap();
        }
        assert!(matches!(outbox.try_send(vec![0; 1]), Err(TrySendError::Full(_))), "over the chunks");
        drop(outgoing);
        assert!(outbox.send(vec![0; 1]).await.is_err());
        // The 8 chunks never written keep their room: a send that needs more is told the writer
        // is gone instead of waiting for ever.
        let waited = tokio::time::timeout(std::time::Duration::from_secs(5), outbox.send(vec![0; 100])).await;
        assert!(matches!(waited, Ok(Err(Closed))), "{waited:?}");
        assert!(matches!(outbox.try_send(vec![0; 100]), Err(TrySendError::Closed(_))));
    }

    /// A send aborted while it waits (a subscription's task ended by UNSUBSCRIBE) takes no room
    /// with it: the outbox empties whole, and a chunk as large as it still goes.
    #[tokio::test]
    async fn a_send_cancelled_while_it_waits_gives_its_room_back() {
        let (outbox, mut outgoing) = outbox(8, 100);
        for _ in 0..8 {
            outbox.try_send(vec![0; 1]).unwrap();
        }
        let waiting = tokio::spawn({
            let outbox = outbox.clone();
            async move { outbox.send(vec![0; 10]).await }
        });
        tokio::task::yield_now().await;
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        while let Some(chunk) = outgoing.try_recv() {
            outgoing.written(&chunk);
        }
        assert!(outbox.is_idle(), "every byte back");
        outbox.send(vec![0; 100]).await.unwrap();
        assert_eq!(outgoing.recv().await.unwrap().len(), 100);
    }
}
