//! Seed 004's coffee shop, with reply queues: customers put orders on a shared queue, each
//! naming its own temporary queue as `reply_to`; baristas take orders tentatively, make the
//! coffee, answer on the customer's queue, then acknowledge. Two customers, two baristas.
//!
//! cargo run -p petrel-client --example coffee [-- --server ADDR]

#[path = "common/mod.rs"]
mod common;

use std::time::Duration;

use petrel_client::{Client, Message, PollOptions, QueueConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (addr, _data) = common::server().await;
    let shop = Client::connect(addr.as_str()).await?;
    shop.create_queue("orders", QueueConfig { durable: true, ..QueueConfig::default() }).await?;

    let mut baristas = Vec::new();
    for name in ["ana", "ben"] {
        let client = Client::connect(addr.as_str()).await?;
        baristas.push(tokio::spawn(barista(client, name)));
    }
    let mut customers = Vec::new();
    for (customer, drinks) in [("carla", vec!["espresso", "latte"]), ("dan", vec!["mocha", "flat white", "cortado"])] {
        let client = Client::connect(addr.as_str()).await?;
        customers.push(tokio::spawn(order(client, customer, drinks)));
    }
    for c in customers {
        for line in c.await?? {
            println!("{line}");
        }
    }
    for b in baristas {
        b.abort();
    }
    Ok(())
}

/// Orders `drinks` and waits for each one on the customer's own temporary queue.
async fn order(client: Client, customer: &str, drinks: Vec<&str>) -> Result<Vec<String>, petrel_client::ClientError> {
    let replies = format!("replies.{customer}");
    // Temporary: it goes away with this connection.
    client.create_queue(&replies, QueueConfig { temporary: true, ..QueueConfig::default() }).await?;
    let orders = drinks
        .iter()
        .enumerate()
        .map(|(i, drink)| Message {
            reply_to: replies.clone(),
            request_id: format!("{customer}-{i}"),
            ..Message::new(drink.to_string())
        })
        .collect();
    client.offer("orders", orders, None).await?;
    let mut got = Vec::new();
    let wait = PollOptions { max: 10, timeout: Duration::from_secs(5), visibility: None };
    while got.len() < drinks.len() {
        let ready = client.poll(&replies, wait).await?;
        assert!(!ready.is_empty(), "a barista answers within 5 s");
        for d in ready {
            let m = d.message;
            got.push(format!("{customer} got order {}: {}", m.request_id, String::from_utf8_lossy(&m.payload)));
        }
    }
    got.sort();
    Ok(got)
}

/// Takes orders tentatively; the reply goes to the order's `reply_to`, then the order is acked.
async fn barista(client: Client, name: &'static str) -> Result<(), petrel_client::ClientError> {
    let take = PollOptions { max: 1, timeout: Duration::from_secs(1), visibility: Some(Duration::from_secs(30)) };
    loop {
        for d in client.poll("orders", take).await? {
            let drink = String::from_utf8_lossy(&d.message.payload).into_owned();
            let coffee = Message {
                request_id: d.message.request_id.clone(),
                subject: "coffee".into(),
                ..Message::new(format!("{drink}, made by {name}"))
            };
            client.offer(&d.message.reply_to, vec![coffee], None).await?;
            client.ack("orders", &[d.handle]).await?;
        }
    }
}
