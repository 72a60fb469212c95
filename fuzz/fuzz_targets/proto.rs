//! The native protocol's decoders on arbitrary bytes: frames, then every request and response
//! body. Never a panic.
#![no_main]
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use petrel_proto::{Push, Request, Response, frame};

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(f)) = frame::decode(&mut buf, 1 << 20) {
        let _ = Request::decode(f.opcode, f.body.clone());
        let _ = Push::decode(f.opcode, f.body.clone());
        let _ = Response::decode(f.opcode, f.body);
    }
    if data.len() >= 2 {
        let op = u16::from_be_bytes([data[0], data[1]]);
        let _ = Request::decode(op, bytes::Bytes::copy_from_slice(&data[2..]));
        let _ = Response::decode(op, bytes::Bytes::copy_from_slice(&data[2..]));
        let _ = Push::decode(op, bytes::Bytes::copy_from_slice(&data[2..]));
    }
});
