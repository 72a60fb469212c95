//! Counters that go down as well as up (bytes and messages held, the memory budget). Going
//! below zero is an accounting bug: these assert, so that it is a crash at the fault — in tests
//! first — rather than a silent wrap to 2^64 that would look like a full queue or a spent budget
//! for ever after.

use std::sync::atomic::{AtomicU64, Ordering};

/// `*counter -= n`, asserting that it does not go below zero.
pub(crate) fn subtract(counter: &mut u64, n: u64, what: &str) {
    *counter = counter.checked_sub(n).unwrap_or_else(|| panic!("{what} would go below zero: {counter} - {n}"));
}

/// `counter -= n` on a shared counter, asserting that it did not go below zero. (Every
/// decrement matches an increment made before it, so the counter never dips even briefly.)
pub(crate) fn subtract_shared(counter: &AtomicU64, n: u64, what: &str) {
    let before = counter.fetch_sub(n, Ordering::Relaxed);
    assert!(before >= n, "{what} went below zero: {before} - {n}");
}
