//! The decoders never panic on arbitrary bytes and never accept a frame whose CRC does not
//! match. (The same entry points are fuzzed by `fuzz/`.)

use petrel_log::fuzzing::{decode_frame, decode_segment_header, scan_segment};
use petrel_log::{Log, Options};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), offset in any::<u64>()) {
        let _ = decode_frame(&bytes);
        let (end, next) = scan_segment(&bytes, offset);
        prop_assert!(end <= bytes.len());
        prop_assert!(next >= offset);
        let mut header = [0u8; 64];
        let n = bytes.len().min(64);
        header[..n].copy_from_slice(&bytes[..n]);
        let _ = decode_segment_header(&header);
    }

    #[test]
    fn damaged_real_frames_are_rejected(payload in prop::collection::vec(any::<u8>(), 0..100), at in any::<usize>(), bit in 0u8..8) {
        let dir = tempfile::tempdir().unwrap();
        let mut log = Log::open(dir.path(), Options { segment_bytes: 65536, ..Options::default() }).unwrap();
        log.append(&payload).unwrap();
        drop(log);
        let seg = std::fs::read(dir.path().join("00000000000000000000.log")).unwrap();
        let frame_len = (16 + payload.len()).next_multiple_of(8);
        let mut frame = seg[64..64 + frame_len].to_vec();
        prop_assert_eq!(decode_frame(&frame), Some(frame_len));
        let at = at % (16 + payload.len());
        frame[at] ^= 1 << bit;
        prop_assert_eq!(decode_frame(&frame), None);
    }
}

/// Inputs the fuzzers found, kept as regressions.
#[test]
fn fuzz_findings_stay_fixed() {
    let found: &[&[u8]] = &[&[
        156, 38, 5, 54, 93, 0, 0, 0, 0, 0, 0, 80, 1, 15, 0, 0, 0, 0, 0, 84, 82, 49, 0, 0, 0, 255, 255, 255, 255, 0, 0,
        0, 0, 0, 80, 84, 82, 49, 227, 56, 210, 22, 111, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 80, 84, 82, 49, 0,
        0, 0, 82, 52, 0, 0, 0, 0, 0, 0, 0, 111, 0, 0, 0, 93, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]];
    for bytes in found {
        let _ = decode_frame(bytes);
        let (end, _) = scan_segment(bytes, 7);
        assert!(end <= bytes.len());
    }
}
