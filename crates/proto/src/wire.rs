//! Primitive encodings shared by every frame body: big-endian integers, length-prefixed strings
//! and byte strings. Decoding is bounds-checked and never panics.

use bytes::{Buf, BufMut, Bytes};

use crate::{DecodeError, EncodeError};

/// Payloads at least this long can be left out of an encoded frame that ends with them (a call,
/// its reply, an INVOKE push, a RETURN), to be written after the frame's other bytes by the same vectored
/// write rather than copied into them.
pub const LARGE_PAYLOAD_BYTES: usize = 64 << 10;

pub(crate) struct Writer<'a> {
    out: &'a mut Vec<u8>,
    /// Whether `payload` may leave a large payload out (only for a frame it ends).
    may_defer: bool,
    /// The payload left out: nothing may be written after it.
    deferred: Option<Bytes>,
}

impl<'a> Writer<'a> {
    pub fn new(out: &'a mut Vec<u8>) -> Writer<'a> {
        Writer { out, may_defer: false, deferred: None }
    }

    /// A writer for a frame that ends with one message, whose large payload it leaves out.
    pub fn deferring(out: &'a mut Vec<u8>) -> Writer<'a> {
        Writer { out, may_defer: true, deferred: None }
    }

    /// Sets the length of the frame started at `at` (`frame::start`), the payload left out
    /// included, and returns that payload: the frame's last bytes, to be written after `out`'s.
    pub fn finish(self, at: usize) -> Result<Option<Bytes>, EncodeError> {
        crate::frame::finish_before(self.out, at, self.deferred.as_ref().map_or(0, Bytes::len))?;
        Ok(self.deferred)
    }

    /// Where the next field goes.
    fn out(&mut self) -> &mut Vec<u8> {
        debug_assert!(self.deferred.is_none(), "nothing is written after a deferred payload");
        self.out
    }
}

impl Writer<'_> {
    pub fn u8(&mut self, v: u8) {
        self.out().put_u8(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.out().put_u16(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.out().put_u32(v);
    }
    pub fn u64(&mut self, v: u64) {
        self.out().put_u64(v);
    }
    /// Free text (an error's reason, a server's name): u16 length, UTF-8 bytes. Text longer than
    /// a length prefix allows is cut at the last character boundary that fits, never inside one.
    pub fn text(&mut self, s: &str) {
        let s = truncate_utf8(s, u16::MAX as usize);
        self.u16(s.len() as u16);
        self.out().put_slice(s.as_bytes());
    }
    /// A field that must arrive whole (a name, a message's string): too long is an error, not a
    /// cut, so the peer never acts on a name other than the one the caller gave.
    pub fn str(&mut self, s: &str) -> Result<(), EncodeError> {
        if s.len() > u16::MAX as usize {
            return Err(EncodeError::FieldTooLong);
        }
        self.text(s);
        Ok(())
    }
    /// A byte string: u32 length, bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.out().put_slice(b);
    }
    /// A message's payload, its last field: `bytes`, or, from a `deferring` writer and at least
    /// `LARGE_PAYLOAD_BYTES` long, its length only, the bytes kept in `deferred`.
    pub fn payload(&mut self, b: &Bytes) {
        if self.may_defer && b.len() >= LARGE_PAYLOAD_BYTES {
            self.u32(b.len() as u32);
            self.deferred = Some(b.clone());
        } else {
            self.bytes(b);
        }
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
        self.text(what)
    }
    /// `str`, kept inline when short (`CompactString`): no allocation for most keys.
    pub fn compact_str(&mut self, what: &'static str) -> Result<compact_str::CompactString, DecodeError> {
        self.text(what)
    }
    /// A text: u16 length, UTF-8 bytes.
    fn text<T: for<'a> From<&'a str>>(&mut self, what: &'static str) -> Result<T, DecodeError> {
        let len = self.u16(what)? as usize;
        if len == 0 {
            return Ok(T::from("")); // most of a message's fields: nothing to check or copy
        }
        self.need(len, what)?;
        let text = std::str::from_utf8(&self.buf[..len]).map_err(|_| DecodeError::BadUtf8(what))?.into();
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

/// An optional field that is present: never its zero (see the extensions bytes).
pub(crate) fn present<T: Default + PartialEq>(value: T, what: &'static str) -> Result<T, DecodeError> {
    if value == T::default() { Err(DecodeError::BadValue(what)) } else { Ok(value) }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_on_a_character_boundary() {
        // Two-byte characters up to one byte short of the limit, then one more: the cut must
        // not fall inside the last `é`.
        let long = "é".repeat(32_767) + "éa";
        let mut out = Vec::new();
        Writer::new(&mut out).text(&long);
        let len = u16::from_be_bytes([out[0], out[1]]) as usize;
        assert_eq!(len, 65_534);
        assert!(std::str::from_utf8(&out[2..]).is_ok());
        assert_eq!(truncate_utf8("aé", 2), "a");
        assert_eq!(truncate_utf8("ab", 5), "ab");
        let mut out = Vec::new();
        assert_eq!(Writer::new(&mut out).str(&long), Err(EncodeError::FieldTooLong));
    }
}
