//! The key index (`Options::key_index`): each key → the offset of the last record with it, in
//! memory. Built at open by walking every frame header; the writer points keys as it appends.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::frame;
use crate::mmap::SEGMENT_HEADER_LEN;
use crate::segment::Segment;

pub(crate) struct KeyIndex(RwLock<HashMap<Box<[u8]>, u64>>);

impl KeyIndex {
    /// Walks every frame header of the log for its key.
    pub(crate) fn build(segments: &[Arc<Segment>]) -> KeyIndex {
        let mut keys = HashMap::new();
        for seg in segments {
            let data = seg.map.published().from(SEGMENT_HEADER_LEN);
            let mut at = 0;
            let mut offset = seg.base;
            while let Some(len) = frame::peek_len(seg.format, &data[at..]) {
                if let Some(key) = frame::peek_key(seg.format, &data[at..]) {
                    point(&mut keys, key, offset);
                }
                at += len;
                offset += 1;
            }
        }
        KeyIndex(RwLock::new(keys))
    }

    /// Points each key at its offset, in order (a later one wins).
    pub(crate) fn point<'a>(&self, keyed: impl IntoIterator<Item = (&'a [u8], u64)>) {
        let mut keys = self.0.write().unwrap_or_else(|e| e.into_inner());
        for (key, offset) in keyed {
            point(&mut keys, key, offset);
        }
    }

    /// Forgets the keys whose last record is before `first` (retention removed it): the index
    /// holds keys of records in the log only, however many distinct keys a long life appends.
    pub(crate) fn forget_before(&self, first: u64) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).retain(|_, offset| *offset >= first);
    }

    pub(crate) fn len(&self) -> usize {
        self.0.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The offset of the last record with `key`.
    pub(crate) fn get(&self, key: &[u8]) -> Option<u64> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).get(key).copied()
    }
}

/// Points `key` at `offset`, allocating only for a key not seen before.
#[inline]
fn point(keys: &mut HashMap<Box<[u8]>, u64>, key: &[u8], offset: u64) {
    match keys.get_mut(key) {
        Some(last) => *last = offset,
        None => {
            keys.insert(key.into(), offset);
        }
    }
}
