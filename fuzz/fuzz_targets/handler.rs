//! The native protocol's request handler end to end: any bytes, sent by an anonymous client, an
//! ordinary user or an admin, into a real connection over a real broker with users and ACLs
//! (the AUTH path among them). Never a panic, never a connection that outlives its input.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use petrel_server::fuzzing::Harness;

static HARNESS: OnceLock<Harness> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    HARNESS.get_or_init(Harness::new).run(data);
});
