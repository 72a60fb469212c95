//! The frame decoder on arbitrary bytes: never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = petrel_log::fuzzing::decode_frame(data);
    if data.len() >= 64 {
        let _ = petrel_log::fuzzing::decode_segment_header(data[..64].try_into().unwrap());
    }
});
