//! A durable queue and a reliable-read worker loop (seed 004's durable queue, seed 002's
//! tentative reads): each job is taken tentatively and acknowledged only when done; a job that
//! fails is aborted and comes back at the head for the next attempt.
//!
//! cargo run -p petrel-client --example reliable_worker [-- --server ADDR]

#[path = "common/mod.rs"]
mod common;

use std::time::Duration;

use petrel_client::{Client, Message, PollOptions, QueueConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (addr, _data) = common::server().await;
    let producer = Client::connect(addr.as_str()).await?;
    producer.create_queue("jobs", QueueConfig { durable: true, ..QueueConfig::default() }).await?;
    let jobs =
        (1..=5).map(|i| Message { subject: "resize".into(), ..Message::new(format!("image-{i}.png")) }).collect();
    producer.offer("jobs", jobs, None).await?;

    let worker = Client::connect(addr.as_str()).await?;
    let take = PollOptions { max: 1, timeout: Duration::from_millis(200), visibility: Some(Duration::from_secs(30)) };
    let mut failed_once = false;
    loop {
        let Some(job) = worker.poll("jobs", take).await?.pop() else { break };
        let name = String::from_utf8_lossy(&job.message.payload).into_owned();
        if name == "image-3.png" && !failed_once {
            failed_once = true;
            println!("{name}: failed, returning it to the queue");
            worker.abort("jobs", &[job.handle]).await?;
            continue;
        }
        println!("{name}: {} done", job.message.subject);
        worker.ack("jobs", &[job.handle]).await?;
    }
    let stats = producer.queue_status("jobs").await?;
    println!("left: {} waiting, {} in flight", stats.items, stats.in_flight);
    Ok(())
}
