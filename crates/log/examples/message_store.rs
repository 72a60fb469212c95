//! The log as a keyed, timed message store: the last message with a key, the first message at or
//! after a time, and any message by offset.
//!
//! cargo run -p petrel-log --example message_store

use petrel_log::{Input, Log, Options};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut log = Log::open(dir.path(), Options { key_index: true, ..Options::default() })?;
    let t0 = 1_700_000_000_000_000_000u64;
    let updates = [("alice", "online", 0), ("bob", "away", 10), ("alice", "busy", 20), ("carol", "online", 30)];
    for (who, status, seconds) in updates {
        let at = t0 + seconds * 1_000_000_000;
        log.append_with(&Input {
            key: Some(who.as_bytes()),
            headers: &[("content-type", b"text/plain")],
            payload: status.as_bytes(),
            timestamp: Some(at),
        })?;
    }
    let mut reader = log.reader();
    let alice = reader.get_by_key(b"alice")?.expect("alice has a status");
    println!("alice is {} (offset {})", String::from_utf8_lossy(alice.payload), alice.offset);
    let since = reader.get_by_time(t0 + 15 * 1_000_000_000)?.expect("a record after 15 s");
    println!(
        "first update at or after 15 s: {} is {}",
        String::from_utf8_lossy(since.key.unwrap_or_default()),
        String::from_utf8_lossy(since.payload)
    );
    let first = reader.get(0)?.expect("offset 0");
    println!("offset 0 has header content-type = {:?}", first.headers.get("content-type").map(String::from_utf8_lossy));
    Ok(())
}
