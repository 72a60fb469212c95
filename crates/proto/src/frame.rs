//! Frames: the unit on the wire. A length prefix, a fixed header, a body.
//!
//! ```text
//! 0   4  length      u32 BE: bytes after this field (12 + body)
//! 4   1  version     1
//! 5   1  kind        0 request, 1 response, 2 push (server to client, unrequested)
//! 6   2  opcode      u16 BE
//! 8   8  request id  u64 BE, chosen by the client, echoed by the response
//! 16  …  body
//! ```

use bytes::{Buf, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

pub const PROTOCOL_VERSION: u8 = 1;
/// Bytes of header after the length prefix.
pub const HEADER_LEN: usize = 12;
/// Most a decoder reserves at a time for a frame still arriving.
const RESERVE_STEP: usize = 256 << 10;
/// Default largest frame (length field) a peer accepts: 16 MiB of payload plus room for the rest.
pub const DEFAULT_MAX_FRAME: u32 = (16 << 20) + (64 << 10);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrameKind {
    Request,
    Response,
    Push,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub opcode: u16,
    pub request_id: u64,
    pub body: Bytes,
}

/// Why the bytes in a buffer are not a frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length field is smaller than a header: the stream cannot be trusted any more.
    #[error("malformed frame: length {0} is shorter than a header")]
    Malformed(u32),
    /// Larger than the limit. The frame (`len` bytes after the prefix) can be skipped, and the
    /// connection kept: the header, when already buffered, tells whom to answer.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: u32, max: u32, request_id: Option<u64>, opcode: Option<u16> },
    /// A whole frame of a protocol version or kind this side does not speak.
    #[error("unsupported frame: version {version}, kind {kind}")]
    Unsupported { version: u8, kind: u8, request_id: u64, opcode: u16 },
}

/// Takes one frame off the front of `buf` if it holds a whole one. `Ok(None)`: need more bytes.
/// On `TooLarge`, nothing is consumed: the caller skips `4 + len` bytes as they arrive.
pub fn decode(buf: &mut BytesMut, max: u32) -> Result<Option<Frame>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes(buf[..4].try_into().unwrap());
    if (len as usize) < HEADER_LEN {
        return Err(FrameError::Malformed(len));
    }
    if len > max {
        let (request_id, opcode) = if buf.len() >= 16 {
            (Some(u64::from_be_bytes(buf[8..16].try_into().unwrap())), Some(u16::from_be_bytes([buf[6], buf[7]])))
        } else {
            (None, None)
        };
        return Err(FrameError::TooLarge { len, max, request_id, opcode });
    }
    if buf.len() < 4 + len as usize {
        // Room for the next part only: a peer that announces a large frame and sends little of
        // it must not make this side allocate what it announced.
        buf.reserve((4 + len as usize - buf.len()).min(RESERVE_STEP));
        return Ok(None);
    }
    let mut frame = buf.split_to(4 + len as usize);
    frame.advance(4);
    let version = frame.get_u8();
    let kind = frame.get_u8();
    let opcode = frame.get_u16();
    let request_id = frame.get_u64();
    let kind = match (version, kind) {
        (PROTOCOL_VERSION, 0) => FrameKind::Request,
        (PROTOCOL_VERSION, 1) => FrameKind::Response,
        (PROTOCOL_VERSION, 2) => FrameKind::Push,
        _ => return Err(FrameError::Unsupported { version, kind, request_id, opcode }),
    };
    Ok(Some(Frame { kind, opcode, request_id, body: frame.freeze() }))
}

/// Appends a frame with `body` to `out`.
pub fn encode(out: &mut Vec<u8>, kind: FrameKind, opcode: u16, request_id: u64, body: &[u8]) {
    out.reserve(4 + HEADER_LEN + body.len());
    out.extend_from_slice(&((HEADER_LEN + body.len()) as u32).to_be_bytes());
    out.push(PROTOCOL_VERSION);
    out.push(match kind {
        FrameKind::Request => 0,
        FrameKind::Response => 1,
        FrameKind::Push => 2,
    });
    out.extend_from_slice(&opcode.to_be_bytes());
    out.extend_from_slice(&request_id.to_be_bytes());
    out.extend_from_slice(body);
}

/// Starts a frame in `out` whose body the caller appends, then `finish_frame` fixes the length.
/// Avoids building the body in a separate buffer.
pub fn start(out: &mut Vec<u8>, kind: FrameKind, opcode: u16, request_id: u64) -> usize {
    let at = out.len();
    encode(out, kind, opcode, request_id, &[]);
    at
}

/// Sets the length of the frame started at `at` to what has been appended since; a frame longer
/// than the length field can say is refused (never wrapped into a shorter, wrong length).
pub fn finish(out: &mut [u8], at: usize) -> Result<(), crate::EncodeError> {
    finish_before(out, at, 0)
}

/// `finish` for a frame whose last `after` bytes are written after `out`'s (a payload left out:
/// `Writer::finish`).
pub(crate) fn finish_before(out: &mut [u8], at: usize, after: usize) -> Result<(), crate::EncodeError> {
    let len = u32::try_from(out.len() - at - 4 + after).map_err(|_| crate::EncodeError::FrameTooLong)?;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_longer_than_its_length_field_is_refused_not_wrapped() {
        // calloc'd pages: the 4 GiB are never touched, so this costs no memory.
        let mut out = vec![0u8; u32::MAX as usize + 5];
        assert!(matches!(finish(&mut out, 0), Err(crate::EncodeError::FrameTooLong)));
        assert_eq!(out[..4], [0, 0, 0, 0], "nothing written");
        let mut small = Vec::new();
        let at = start(&mut small, FrameKind::Response, 1, 7);
        small.extend_from_slice(b"body");
        finish(&mut small, at).unwrap();
        assert_eq!(u32::from_be_bytes(small[..4].try_into().unwrap()) as usize, small.len() - 4);
    }
}
