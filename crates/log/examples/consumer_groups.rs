//! Consumer groups on a log: a producer, two independent groups, at-least-once delivery with
//! acknowledgements, a negative acknowledgement that redelivers, and seeking.
//!
//! cargo run -p petrel-log --example consumer_groups

use std::time::Duration;

use petrel_log::{Durability, GroupOptions, Log, Options, SeekTo};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let log = Log::open(
        dir.path(),
        Options { durability: Durability::Interval(Duration::from_millis(5)), ..Options::default() },
    )?
    .into_shared();

    // A producer thread; consumers are woken as records arrive (no polling loop spins).
    let producer = {
        let log = log.clone();
        std::thread::spawn(move || -> petrel_log::Result<()> {
            for i in 0..10 {
                log.append(format!("order {i}").as_bytes())?;
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok(())
        })
    };

    // Cursor durability `Always`: an acknowledgement is on disk when `ack` returns.
    let workers_opts = GroupOptions { durability: Durability::Always, ..GroupOptions::default() };
    let mut workers = log.group("workers", workers_opts)?;
    let mut analytics = log.group("analytics", GroupOptions::default())?;

    let mut processed = 0;
    let mut retried = false;
    while processed < 10 {
        let batch: Vec<(u64, String)> = workers
            .poll(4, Duration::from_secs(1))?
            .into_iter()
            .map(|r| (r.offset, String::from_utf8_lossy(r.payload).into_owned()))
            .collect();
        for (offset, order) in batch {
            if offset == 3 && !retried {
                println!("workers: {order} failed, asking for it again");
                workers.nack(offset)?;
                retried = true;
                continue;
            }
            println!("workers: processed {order}");
            workers.ack(offset)?;
            processed += 1;
        }
    }
    producer.join().expect("producer")?;

    // The other group has its own position: it still has everything to read.
    println!("analytics lag: {} records", analytics.lag());
    analytics.seek(SeekTo::Offset(7))?;
    let tail: Vec<u64> = analytics.poll(10, Duration::ZERO)?.into_iter().map(|r| r.offset).collect();
    println!("analytics after seeking to 7: {tail:?}");
    for info in log.groups() {
        println!("group {}: committed {}", info.name, info.committed);
    }
    Ok(())
}
