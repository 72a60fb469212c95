//! The memcache decoder on arbitrary bytes, fed in chunks whose size the input's first byte sets:
//! never a panic, never a request that consumes nothing and repeats forever.
#![no_main]
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use petrel_server::memcache::codec::{Decoder, Reject};

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, data)) = data.split_first() else { return };
    let mut decoder = Decoder::new(4096);
    let mut buf = BytesMut::new();
    for piece in data.chunks(usize::from(chunk).max(1)) {
        buf.extend_from_slice(piece);
        let mut answers = 0;
        while let Some(request) = decoder.decode(&mut buf) {
            answers += 1;
            assert!(answers <= data.len() + 1, "a decode that consumes nothing");
            if matches!(request, Err(Reject { close: true, .. })) {
                return;
            }
        }
    }
});
