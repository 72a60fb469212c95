//! Payload compression on the wire (seed 004's cutoff, with zstd): a sender that negotiated
//! `features::ZSTD` in HELLO compresses payloads of at least its cutoff and sets the message's
//! `compressed` flag; the receiver restores them before anyone else sees them. A payload that
//! does not shrink is sent as it is.

use bytes::Bytes;

use crate::{DecodeError, Message, Push, Request, Response};

/// zstd's level 1: a few hundred MB/s per core, most of the gain on text.
const LEVEL: i32 = 1;

thread_local! {
    // A zstd context costs more to make than a small payload costs to compress: one per thread,
    // kept. (`None` if zstd could not allocate one: then payloads go uncompressed.)
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        std::cell::RefCell::new(zstd::bulk::Compressor::new(LEVEL).ok());
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        std::cell::RefCell::new(zstd::bulk::Decompressor::new().ok());
}

/// Compresses `m`'s payload if it is at least `min_bytes` and compressing makes it smaller.
pub fn compress(m: &mut Message, min_bytes: usize) {
    if m.compressed || m.payload.len() < min_bytes || m.payload.is_empty() {
        return;
    }
    let packed = COMPRESSOR.with_borrow_mut(|c| c.as_mut().and_then(|c| c.compress(&m.payload).ok()));
    if let Some(packed) = packed
        && packed.len() < m.payload.len()
    {
        m.payload = Bytes::from(packed);
        m.compressed = true;
    }
}

/// Restores a compressed payload; one that would exceed `max_bytes`, or is not zstd, is an error
/// (the size is never taken on trust: decompression stops at `max_bytes`).
pub fn decompress(m: &mut Message, max_bytes: usize) -> Result<(), DecodeError> {
    if !m.compressed {
        return Ok(());
    }
    // The frame must record its size (the protocol says so), and the room made is that size,
    // checked against `max_bytes` first: room for `max_bytes` for every frame that did not say
    // would let many small payloads hold the limit each. The decoder refuses a frame whose
    // content is not the size it recorded.
    let declared = zstd::zstd_safe::get_frame_content_size(&m.payload)
        .ok()
        .flatten()
        .ok_or(DecodeError::BadValue("compressed payload (not a zstd frame that records its content size)"))?;
    let room = usize::try_from(declared).ok().filter(|&n| n <= max_bytes);
    let plain = room
        .and_then(|n| DECOMPRESSOR.with_borrow_mut(|d| d.as_mut().and_then(|d| d.decompress(&m.payload, n).ok())))
        .ok_or(DecodeError::BadValue("compressed payload (not zstd, or larger than the limit)"))?;
    m.payload = Bytes::from(plain);
    m.compressed = false;
    Ok(())
}

/// How many bytes restoring `messages`' compressed payloads adds at most: what their zstd
/// frames say they hold (`max_total` for one that does not say), less their compressed bytes,
/// and at most `max_total`, which `decompress_all` never passes.
pub fn unfolded_growth(messages: &[Message], max_total: u64) -> u64 {
    let declared = messages.iter().filter(|m| m.compressed).map(|m| {
        let plain = zstd::zstd_safe::get_frame_content_size(&m.payload).ok().flatten().unwrap_or(max_total);
        plain.saturating_sub(m.payload.len() as u64)
    });
    declared.fold(0u64, u64::saturating_add).min(max_total)
}

/// The messages a request carries, to compress or restore in place.
pub fn request_messages(r: &mut Request) -> &mut [Message] {
    match r {
        Request::Offer { messages, .. } | Request::Publish { messages, .. } => messages,
        Request::Call { message, .. } | Request::Return { message, .. } => std::slice::from_mut(message),
        _ => &mut [],
    }
}

/// Restores every compressed payload in `messages`, at most `max_total` bytes of them in all: a
/// frame of small compressed payloads must not unfold into more than the receiver accepts.
pub fn decompress_all<'a>(
    messages: impl IntoIterator<Item = &'a mut Message>,
    max_total: usize,
) -> Result<(), DecodeError> {
    let mut left = max_total;
    for m in messages {
        decompress(m, left)?;
        left = left.saturating_sub(m.payload.len());
    }
    Ok(())
}

/// Restores every compressed payload in a response (at most `max_total` bytes in all).
pub fn decompress_response(r: &mut Response, max_total: usize) -> Result<(), DecodeError> {
    match r {
        Response::Polled { deliveries } => decompress_all(deliveries.iter_mut().map(|d| &mut d.message), max_total),
        Response::Reply { message } => decompress(message, max_total),
        _ => Ok(()),
    }
}

/// Restores every compressed payload in a push (at most `max_total` bytes in all).
pub fn decompress_push(p: &mut Push, max_total: usize) -> Result<(), DecodeError> {
    match p {
        Push::Deliver { messages } => decompress_all(messages.iter_mut(), max_total),
        Push::Invoke { message, .. } => decompress(message, max_total),
        Push::SubscriptionEnd { .. } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_shrinks_and_comes_back_and_limits_hold() {
        let text = "the quick brown fox jumps over the lazy dog; ".repeat(200);
        let mut m = Message::new(text.clone().into_bytes());
        compress(&mut m, 1024);
        assert!(m.compressed && m.payload.len() < text.len() / 5, "{}", m.payload.len());
        let mut too_big = m.clone();
        assert!(decompress(&mut too_big, text.len() - 1).is_err(), "the limit is enforced");
        decompress(&mut m, text.len()).unwrap();
        assert!(!m.compressed);
        assert_eq!(m.payload, text.as_bytes());
        // Under the cutoff, or incompressible: sent as it is.
        let mut small = Message::new(&b"tiny"[..]);
        compress(&mut small, 1024);
        assert!(!small.compressed);
        let noise: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let mut random = Message::new(noise);
        compress(&mut random, 1024);
        assert!(!random.compressed || random.payload.len() < 4096);
        let mut forged = Message { compressed: true, ..Message::new(&b"not zstd"[..]) };
        assert!(decompress(&mut forged, 1 << 20).is_err());
        // A frame that does not record its size (a streaming encoder's: the one-byte payload
        // "x", raw) is refused: room for the whole limit would be made for it.
        let unsized_frame = [0x28, 0xB5, 0x2F, 0xFD, 0x00, 0x00, 0x09, 0x00, 0x00, 0x78];
        let mut unsized_message = Message { compressed: true, ..Message::new(unsized_frame.to_vec()) };
        assert!(zstd::stream::decode_all(&unsized_frame[..]).unwrap() == b"x", "a valid frame");
        assert!(decompress(&mut unsized_message, 16 << 20).is_err());
        // One that records a size and holds more (a second frame after it) is refused too.
        let mut first = zstd::bulk::compress(b"ab", 3).unwrap();
        first.extend_from_slice(&unsized_frame);
        let mut two_frames = Message { compressed: true, ..Message::new(first) };
        assert!(decompress(&mut two_frames, 16 << 20).is_err());
        // Many small bombs: each within the per-message limit, all together over the total.
        let mut bomb = Message::new(vec![0u8; 1 << 20]);
        compress(&mut bomb, 1);
        assert!(bomb.payload.len() < 1024);
        let declared = (1 << 20) - bomb.payload.len() as u64;
        assert_eq!(unfolded_growth(std::slice::from_ref(&bomb), 4 << 20), declared, "what its frame declares");
        let mut many = vec![bomb; 8];
        assert_eq!(unfolded_growth(&many, 4 << 20), 4 << 20, "at most the limit");
        assert!(decompress_all(many.iter_mut(), 4 << 20).is_err());
    }
}
