//! A persistent queue, the shape of an mmap'd arena queue: enqueue at the tail, dequeue from the
//! head, named consumers with their own positions, and a copy of a consumer.
//!
//! cargo run -p petrel-log --example queue

use std::time::Duration;

use petrel_log::{GroupOptions, Options, SimpleQueue};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut queue = SimpleQueue::open(dir.path(), Options::default())?;
    for word in ["alpha", "beta", "gamma", "delta"] {
        queue.enqueue(word.as_bytes())?;
    }
    println!("{} items queued", queue.len());

    let first = queue.dequeue()?.expect("not empty");
    println!("dequeued {:?} (offset {})", String::from_utf8_lossy(first.payload), first.offset);
    let head = queue.peek()?.expect("not empty");
    println!("next is {:?}", String::from_utf8_lossy(head.payload));

    // A named consumer reads the same items from the start, independently of the queue's head.
    let mut audit = queue.group("audit", GroupOptions::default())?;
    while let Some(item) = audit.take(Duration::ZERO)? {
        println!("audit saw {:?}", String::from_utf8_lossy(item.payload));
        if item.offset == 1 {
            break;
        }
    }
    drop(audit);
    // A copy starts where the original stands.
    queue.copy_group("audit", "audit-replay")?;
    let replay = queue.group("audit-replay", GroupOptions::default())?;
    println!("the copy starts at offset {}", replay.committed());
    drop(replay);

    // Close and reopen: the queue remembers its head.
    drop(queue);
    let mut queue = SimpleQueue::open(dir.path(), Options::default())?;
    let len = queue.len();
    let next = queue.dequeue()?.map(|r| String::from_utf8_lossy(r.payload).into_owned());
    println!("after reopening: {len} items, next {next:?}");
    Ok(())
}
