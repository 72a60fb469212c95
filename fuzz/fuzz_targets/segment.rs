//! Recovery's scan of a segment on arbitrary bytes: never a panic, never past the end.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (end, _) = petrel_log::fuzzing::scan_segment(data, 7);
    assert!(end <= data.len());
});
