//! Seed 004's other two modes: topics (every subscriber gets every message; a durable topic's
//! consumer groups replay it) and functions (request/reply between clients).
//!
//! cargo run -p petrel-client --example topics_functions [-- --server ADDR]

#[path = "common/mod.rs"]
mod common;

use std::time::Duration;

use petrel_client::{Client, Message, StartFrom};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (addr, _data) = common::server().await;
    let client = Client::connect(addr.as_str()).await?;

    // A live topic: two subscribers, each gets every message.
    client.create_topic("prices", false).await?;
    let mut a = client.subscribe("prices", 0).await?;
    let mut b = Client::connect(addr.as_str()).await?.subscribe("prices", 0).await?;
    let reached = client.publish("prices", vec![Message::new("EUR 1.08"), Message::new("EUR 1.09")]).await?;
    println!("published to {reached} subscribers");
    for sub in [&mut a, &mut b] {
        for _ in 0..2 {
            let m = sub.next().await.expect("a message")?;
            println!("subscription {} got {}", sub.id, String::from_utf8_lossy(&m.payload));
        }
    }

    // A durable topic: a consumer group reads from the oldest message, acknowledges, and a
    // later subscription of the same group resumes after what it acknowledged.
    client.create_topic("orders", true).await?;
    client.publish("orders", (1..=5).map(|i| Message::new(format!("order {i}"))).collect()).await?;
    let mut billing = client.subscribe_group("orders", "billing", StartFrom::Oldest, 100).await?;
    for _ in 0..3 {
        let m = billing.next().await.expect("a message")?;
        println!("billing handles {} (id {})", String::from_utf8_lossy(&m.payload), m.id);
        billing.ack(&[m.id]).await?;
    }
    billing.unsubscribe().await?;
    let mut billing = client.subscribe_group("orders", "billing", StartFrom::Resume, 100).await?;
    let next = billing.next().await.expect("a message")?;
    println!("billing resumes at {}", String::from_utf8_lossy(&next.payload));

    // A function: one client serves it, another calls it.
    let server = Client::connect(addr.as_str()).await?;
    server
        .serve("greet", |m: Message| async move {
            Ok(Message::new(format!("hello, {}", String::from_utf8_lossy(&m.payload))))
        })
        .await?;
    let reply = client.call("greet", Message::new("petrel"), Some(Duration::from_secs(5))).await?;
    println!("{}", String::from_utf8_lossy(&reply.payload));
    let missing = client.call("nobody", Message::new("?"), None).await.unwrap_err();
    println!("calling a function nobody serves: {missing}");
    Ok(())
}
