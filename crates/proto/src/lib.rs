//! Petrel's native wire protocol: the message model, the frame codec, and the request and
//! response bodies. Pure byte work: no I/O, no async runtime. `docs/protocol.md` specifies every
//! byte; `tests/vectors/*.json` pin them for clients in other languages.
//!
//! The map of the crate:
//! - `frame.rs`: the frame header and the length-prefixed framing (`frame::decode`);
//! - `op.rs`: requests, responses and pushes, their opcodes and bodies;
//! - `message.rs`: the wire's `Message`, queue configuration and statistics;
//! - `wire.rs`: the primitive encodings (integers, length-prefixed strings cut at characters);
//! - `compression.rs`: zstd payloads, and unfolding a request within a bound;
//! - `hex.rs`: hex text for the test vectors.

#![forbid(unsafe_code)]

pub mod compression;
pub mod frame;
pub mod hex;
mod message;
mod op;
mod wire;

pub use compact_str::CompactString;
pub use frame::{DEFAULT_MAX_FRAME, Frame, FrameError, FrameKind, PROTOCOL_VERSION};
pub use message::{HEADER_SIZE, Message, MessageKind, Status};
pub use op::{
    Delivery, GroupStats, Push, QueueConfig, QueueStats, Request, Response, StartFrom, TopicStats, features, opcode,
};
pub use wire::LARGE_PAYLOAD_BYTES;

/// Why a frame body could not be decoded. The frame itself was whole: the peer answers
/// BAD_REQUEST (or UNSUPPORTED for an unknown opcode) and the connection goes on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("body ends inside {0}")]
    Truncated(&'static str),
    #[error("{0} is not valid UTF-8")]
    BadUtf8(&'static str),
    #[error("invalid {0}")]
    BadValue(&'static str),
    #[error("{0} bytes after the end of the body")]
    TrailingBytes(usize),
    #[error("unknown opcode {0:#06x}")]
    UnknownOpcode(u16),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("a field is longer than its length prefix allows")]
    FieldTooLong,
    #[error("a frame is longer than its length field allows (4 GiB)")]
    FrameTooLong,
}
