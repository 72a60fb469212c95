//! A consumer group's cursor file: where the group is, kept crash-safe in two checksummed slots.
//!
//! ```text
//! file: 4096 bytes = slot A (bytes 0..2048) + slot B (2048..4096)
//! slot, little-endian:
//! 0   4  magic        b"PCUR"
//! 4   4  crc32c       of bytes [8, 32 + bitmap length + 8 × held)
//! 8   8  sequence     the slot with the higher sequence and a good CRC is current
//! 16  8  committed    every record below it is acknowledged, except the held ones
//! 24  4  bitmap len   bytes of bitmap in use (0 ..= 1024)
//! 28  4  held         records below committed not acknowledged (0 ..= 124; files before it: 0)
//! 32  …  bitmap       bit i (byte i/8, bit i%8) set: record committed + 1 + i is acknowledged
//! …   8× held offsets  ascending, each below committed
//! ```
//!
//! A held record is one delivered long ago and still not acknowledged while the group went on
//! past `MAX_PENDING` later records: the group's window moves over it and the slot names it
//! instead, so that one slow consumer does not stop the others (`ConsumerGroup::poll`).
//!
//! A new state is written to the slot not holding the current one, so a write torn by a crash
//! leaves the previous state readable in the other slot.

use crate::error::FrameError;

pub(crate) const CURSOR_FILE_LEN: usize = 4096;
const SLOT_LEN: usize = CURSOR_FILE_LEN / 2;
const SLOT_HEADER: usize = 32;
const MAGIC: [u8; 4] = *b"PCUR";
/// Largest bitmap a slot holds: acknowledgements at most this many bits past `committed`.
pub(crate) const MAX_BITMAP_BYTES: usize = 1024;
/// Most records a group may have delivered and not yet acknowledged.
pub const MAX_PENDING: usize = MAX_BITMAP_BYTES * 8;
/// Most records below `committed` a slot names as unacknowledged (what a slot has room for
/// beside the longest bitmap).
pub const MAX_HELD: usize = (SLOT_LEN - SLOT_HEADER - MAX_BITMAP_BYTES) / 8;

/// What a cursor records.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CursorState {
    pub committed: u64,
    /// Offsets above `committed` acknowledged out of order, ascending.
    pub acked_above: Vec<u64>,
    /// Offsets below `committed` not acknowledged, ascending (at most `MAX_HELD`).
    pub held: Vec<u64>,
}

impl CursorState {
    /// This state in a log that holds records `first..end` (retention removed those before,
    /// or a repair cut those after): acknowledgements of records outside it dropped, and
    /// `committed` inside it, moved over the acknowledged records in a row at its start.
    pub(crate) fn within(mut self, first: u64, end: u64) -> CursorState {
        debug_assert!(first <= end);
        self.committed = self.committed.clamp(first, end);
        let committed = self.committed;
        self.held.retain(|&o| o >= first && o < committed);
        self.acked_above.retain(|&o| o >= committed && o < end);
        let in_a_row = self.acked_above.iter().zip(committed..).take_while(|(o, c)| *o == c).count();
        self.acked_above.drain(..in_a_row);
        self.committed += in_a_row as u64;
        self
    }

    /// The lowest offset not acknowledged (`lowest_unacknowledged`).
    pub(crate) fn lowest_unacknowledged(&self) -> u64 {
        lowest_unacknowledged(self.committed, &self.held)
    }
}

/// The lowest offset not acknowledged of a group at `committed` that holds `held` (ascending,
/// each below it): where the group resumes after a restart, and what retention keeps.
pub(crate) fn lowest_unacknowledged(committed: u64, held: &[u64]) -> u64 {
    held.first().copied().unwrap_or(committed)
}

/// Encodes a state (`committed`, its `bitmap`, and the `held` offsets below it, ascending) with
/// `seq` into the slot `seq` selects; returns the slot's range in the file.
pub(crate) fn write(file: &mut [u8], seq: u64, committed: u64, bitmap: &[u8], held: &[u64]) -> std::ops::Range<usize> {
    assert!(bitmap.len() <= MAX_BITMAP_BYTES, "cursor bitmap too long");
    assert!(held.len() <= MAX_HELD, "too many held records for a slot");
    let start = (seq % 2) as usize * SLOT_LEN;
    let held_at = SLOT_HEADER + bitmap.len();
    let slot = &mut file[start..start + held_at + 8 * held.len()];
    slot[8..16].copy_from_slice(&seq.to_le_bytes());
    slot[16..24].copy_from_slice(&committed.to_le_bytes());
    slot[24..28].copy_from_slice(&(bitmap.len() as u32).to_le_bytes());
    slot[28..32].copy_from_slice(&(held.len() as u32).to_le_bytes());
    slot[SLOT_HEADER..held_at].copy_from_slice(bitmap);
    for (i, &offset) in held.iter().enumerate() {
        debug_assert!(offset < committed, "a held record is below committed");
        slot[held_at + 8 * i..held_at + 8 * (i + 1)].copy_from_slice(&offset.to_le_bytes());
    }
    let crc = crate::checksum::crc32c(&slot[8..]);
    slot[4..8].copy_from_slice(&crc.to_le_bytes());
    slot[0..4].copy_from_slice(&MAGIC);
    start..start + slot.len()
}

fn read_slot(slot: &[u8]) -> Result<(u64, CursorState), FrameError> {
    if slot[0..4] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    let len = u32::from_le_bytes(slot[24..28].try_into().unwrap()) as usize;
    let held_len = u32::from_le_bytes(slot[28..32].try_into().unwrap()) as usize;
    if len > MAX_BITMAP_BYTES || held_len > MAX_HELD {
        return Err(FrameError::BadLength);
    }
    let held_at = SLOT_HEADER + len;
    let body = &slot[8..held_at + 8 * held_len];
    if crate::checksum::crc32c(body) != u32::from_le_bytes(slot[4..8].try_into().unwrap()) {
        return Err(FrameError::BadChecksum);
    }
    let seq = u64::from_le_bytes(slot[8..16].try_into().unwrap());
    let committed = u64::from_le_bytes(slot[16..24].try_into().unwrap());
    if committed.checked_add(8 * len as u64).is_none() {
        // Acknowledgements past the last offset there can be: no writer made this slot.
        return Err(FrameError::BadLength);
    }
    let bitmap = &slot[SLOT_HEADER..SLOT_HEADER + len];
    let acked_above =
        (0..len * 8).filter(|i| bitmap[i / 8] & (1 << (i % 8)) != 0).map(|i| committed + 1 + i as u64).collect();
    let held: Vec<u64> = slot[held_at..held_at + 8 * held_len]
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    if !held.windows(2).all(|w| w[0] < w[1]) || held.last().is_some_and(|&h| h >= committed) {
        // Held records are named once each, in order, below committed: no writer made this slot.
        return Err(FrameError::BadLength);
    }
    Ok((seq, CursorState { committed, acked_above, held }))
}

/// The current state in a cursor file and its sequence number; `None` when neither slot is valid.
pub(crate) fn read(file: &[u8]) -> Option<(u64, CursorState)> {
    if file.len() < CURSOR_FILE_LEN {
        return None;
    }
    let a = read_slot(&file[..SLOT_LEN]).ok();
    let b = read_slot(&file[SLOT_LEN..]).ok();
    match (a, b) {
        (Some(a), Some(b)) => Some(if a.0 >= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Bitmap bytes for `acked_above` relative to `committed`.
pub(crate) fn bitmap(committed: u64, acked_above: impl IntoIterator<Item = u64>, out: &mut Vec<u8>) {
    out.clear();
    for offset in acked_above {
        let i = (offset - committed - 1) as usize;
        if out.len() <= i / 8 {
            out.resize(i / 8 + 1, 0);
        }
        out[i / 8] |= 1 << (i % 8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_within_a_log_keeps_only_what_the_log_holds() {
        let state =
            |committed, acked_above: &[u64]| CursorState { committed, acked_above: acked_above.to_vec(), held: vec![] };
        assert_eq!(state(2, &[4, 5, 9]).within(0, 20), state(2, &[4, 5, 9]), "nothing to change");
        assert_eq!(state(2, &[4, 5, 9]).within(4, 20), state(6, &[9]), "over the acknowledged ones in a row");
        assert_eq!(state(2, &[4, 5, 9]).within(3, 20), state(3, &[4, 5, 9]));
        assert_eq!(state(2, &[4, 5, 9]).within(0, 5), state(2, &[4]), "none past the end");
        assert_eq!(state(30, &[]).within(0, 5), state(5, &[]), "committed at the end at most");
        assert_eq!(state(2, &[4, 5]).within(0, 4), state(2, &[]));
        assert_eq!(state(0, &[1, 2, 3]).within(1, 3), state(3, &[]));
    }

    #[test]
    fn the_newest_valid_slot_wins_and_a_torn_one_is_ignored() {
        let mut file = vec![0u8; CURSOR_FILE_LEN];
        assert_eq!(read(&file), None);
        write(&mut file, 1, 10, &[], &[]);
        let mut bm = Vec::new();
        bitmap(12, [14, 20], &mut bm);
        let range = write(&mut file, 2, 12, &bm, &[]);
        assert_eq!(read(&file), Some((2, CursorState { committed: 12, acked_above: vec![14, 20], held: vec![] })));
        // Tear the newest slot at every byte: the previous state comes back.
        for at in range.clone() {
            let mut torn = file.clone();
            torn[at] ^= 0x55;
            assert_eq!(read(&torn).map(|(s, c)| (s, c.committed)), Some((1, 10)), "byte {at}");
        }
    }

    #[test]
    fn a_slot_whose_acknowledgements_pass_the_last_offset_is_not_valid() {
        let mut file = vec![0u8; CURSOR_FILE_LEN];
        write(&mut file, 1, 10, &[], &[]);
        write(&mut file, 2, u64::MAX - 3, &[0xff], &[]);
        assert_eq!(read(&file).map(|(s, c)| (s, c.committed)), Some((1, 10)), "the other slot");
        write(&mut file, 4, u64::MAX - 8, &[0xff], &[]); // the last bit: offset 2⁶⁴ − 1
        assert_eq!(read(&file).map(|(s, c)| (s, c.acked_above.len())), Some((4, 8)), "just fits");
    }

    #[test]
    fn held_records_round_trip_and_a_slot_without_them_reads_as_before() {
        let mut file = vec![0u8; CURSOR_FILE_LEN];
        let mut bm = Vec::new();
        bitmap(100, [103], &mut bm);
        write(&mut file, 1, 100, &bm, &[7u64, 40, 99]);
        let held = CursorState { committed: 100, acked_above: vec![103], held: vec![7, 40, 99] };
        assert_eq!(read(&file), Some((1, held.clone())));
        assert_eq!(held.lowest_unacknowledged(), 7);
        assert_eq!(held.clone().within(40, 200).held, vec![40, 99], "retention took the first");
        // A slot as files before held records were written it: the field is 0, read as none.
        write(&mut file, 2, 5, &[], &[]);
        assert_eq!(read(&file), Some((2, CursorState { committed: 5, acked_above: vec![], held: vec![] })));
        // As many as a slot holds beside the longest bitmap.
        let full = vec![0xffu8; MAX_BITMAP_BYTES];
        let held: Vec<u64> = (0..MAX_HELD as u64).collect();
        let range = write(&mut file, 3, 1_000, &full, &held);
        assert_eq!(range.len(), SLOT_LEN, "the slot is full");
        let (_, state) = read(&file).expect("a valid slot");
        assert_eq!((state.held.len(), state.acked_above.len()), (MAX_HELD, MAX_PENDING));
    }

    #[test]
    fn a_slot_naming_held_records_out_of_order_or_above_committed_is_not_valid() {
        let mut file = vec![0u8; CURSOR_FILE_LEN];
        write(&mut file, 1, 10, &[], &[]);
        // (Written by hand: `write` asserts what a reader checks.)
        for held in [[3u64, 3], [5, 4], [4, 10]] {
            let mut bad = file.clone();
            let slot = &mut bad[..SLOT_LEN];
            slot[8..16].copy_from_slice(&2u64.to_le_bytes());
            slot[16..24].copy_from_slice(&10u64.to_le_bytes());
            slot[28..32].copy_from_slice(&2u32.to_le_bytes());
            slot[32..40].copy_from_slice(&held[0].to_le_bytes());
            slot[40..48].copy_from_slice(&held[1].to_le_bytes());
            let crc = crate::checksum::crc32c(&slot[8..48]);
            slot[4..8].copy_from_slice(&crc.to_le_bytes());
            slot[0..4].copy_from_slice(&MAGIC);
            assert_eq!(read(&bad).map(|(s, _)| s), Some(1), "{held:?}: the other slot");
        }
    }
}
