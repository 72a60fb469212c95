//! Primitive encodings shared by every frame body: big-endian integers, length-prefixed strings
//! and byte strings. Decoding is bounds-checked and never panics.

use bytes::{BufMut, Bytes};

use crate::DecodeError;

pub(crate) struct Writer<'a> {
    pub out: &'a mut Vec<u8>,
}

impl Writer<'_> {
    pub fn u8(&mut self, v: u8) {
        self.out.put_u8(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.out.put_u16(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.out.put_u32(v);
    }
    pub fn u64(&mut self, v: u64) {
        self.out.put_u64(v);
    }
    /// A string: u16 length, UTF-8 bytes. Callers check the length (`Limits`) beforehand.
    pub fn str(&mut self, s: &str) {
        self.u16(s.len() as u16);
        self.out.put_slice(s.as_bytes());
    }
    /// A byte string: u32 length, bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.out.put_slice(b);
    }
}

/// Reads from a frame body. Byte strings are zero-copy slices of the body.
pub(crate) struct Reader {
    buf: Bytes,
}

impl Reader {
    pub fn new(buf: Bytes) -> Reader {
        Reader { buf }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<Bytes, DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated(what));
        }
        Ok(self.buf.split_to(n))
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take(2, what)?[..].try_into().unwrap()))
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(4, what)?[..].try_into().unwrap()))
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(8, what)?[..].try_into().unwrap()))
    }
    pub fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let len = self.u16(what)? as usize;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| DecodeError::BadUtf8(what))
    }
    pub fn bytes(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        let len = self.u32(what)? as usize;
        self.take(len, what)
    }
    /// A count of items that each take at least `min_item` bytes: refused up front if the body
    /// cannot hold that many, so a forged count cannot make the decoder allocate.
    pub fn count(&mut self, min_item: usize, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item) > self.buf.len() {
            return Err(DecodeError::Truncated(what));
        }
        Ok(n)
    }
    pub fn finish(self) -> Result<(), DecodeError> {
        if self.buf.is_empty() { Ok(()) } else { Err(DecodeError::TrailingBytes(self.buf.len())) }
    }
}
