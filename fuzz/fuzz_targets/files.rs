//! The log's small files on arbitrary bytes: a consumer group's cursor file and a sealed
//! segment's index file, each as the bytes are and again under a valid checksum (so that the
//! checks after it are reached too). Never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 12 {
        return;
    }
    let base = u64::from_le_bytes(data[..8].try_into().unwrap()) % (1 << 40);
    let segment_len = u32::from_le_bytes(data[8..12].try_into().unwrap()) as usize;
    let rest = &data[12..];
    let _ = petrel_log::fuzzing::read_cursor_file(rest, rest);
    let _ = petrel_log::fuzzing::decode_index_file(rest, rest, base, segment_len);
});
