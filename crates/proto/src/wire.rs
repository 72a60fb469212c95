//! Primitive encodings shared by every frame body: big-endian integers, length-prefixed strings
//! and byte strings. Decoding is bounds-checked and never panics.

use bytes::{Buf, BufMut, Bytes};

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

    fn need(&self, n: usize, what: &'static str) -> Result<(), DecodeError> {
        if self.buf.len() < n { Err(DecodeError::Truncated(what)) } else { Ok(()) }
    }

    // Fixed-size fields and strings are read in place: no `Bytes` handle (and no reference count
    // on the frame's buffer) per field.
    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.need(1, what)?;
        Ok(self.buf.get_u8())
    }
    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        self.need(2, what)?;
        Ok(self.buf.get_u16())
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.need(4, what)?;
        Ok(self.buf.get_u32())
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.need(8, what)?;
        Ok(self.buf.get_u64())
    }
    pub fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let len = self.u16(what)? as usize;
        self.need(len, what)?;
        let text = std::str::from_utf8(&self.buf[..len]).map_err(|_| DecodeError::BadUtf8(what))?.to_owned();
        self.buf.advance(len);
        Ok(text)
    }
    pub fn bytes(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        let len = self.u32(what)? as usize;
        self.need(len, what)?;
        Ok(self.buf.split_to(len))
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
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    pub fn finish(self) -> Result<(), DecodeError> {
        if self.buf.is_empty() { Ok(()) } else { Err(DecodeError::TrailingBytes(self.buf.len())) }
    }
}
