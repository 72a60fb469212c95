//! Offer and poll, with a bounded queue and a circular one (seed 004's queue quick start).
//!
//! cargo run -p petrel-client --example offer_poll [-- --server ADDR]

#[path = "common/mod.rs"]
mod common;

use std::time::Duration;

use petrel_client::{Client, Message, PollOptions, QueueConfig, Status};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (addr, _data) = common::server().await;
    let client = Client::connect(addr.as_str()).await?;

    client.create_queue("orders", QueueConfig { max_items: 3, ..QueueConfig::default() }).await?;
    for i in 1..=3 {
        client.offer("orders", vec![Message::new(format!("order {i}"))], None).await?;
    }
    match client.offer("orders", vec![Message::new("order 4")], Some(Duration::from_millis(100))).await {
        Err(e) if e.status() == Some(Status::QueueFull) => println!("bounded queue is full: {e}"),
        other => println!("unexpected: {other:?}"),
    }
    for d in client.poll("orders", PollOptions { max: 10, ..PollOptions::default() }).await? {
        println!("polled {}", String::from_utf8_lossy(&d.message.payload));
    }

    client.create_queue("ticker", QueueConfig { max_items: 2, circular: true, ..QueueConfig::default() }).await?;
    for price in ["101", "102", "103"] {
        client.offer("ticker", vec![Message::new(price)], None).await?;
    }
    let latest = client.poll("ticker", PollOptions { max: 10, ..PollOptions::default() }).await?;
    let prices: Vec<_> = latest.iter().map(|d| String::from_utf8_lossy(&d.message.payload).into_owned()).collect();
    println!("circular queue kept the newest: {prices:?}");
    Ok(())
}
