//! `petrel bench queue --mode publish|call`: topics and functions under load. `publish`
//! publishes `count` messages (`batch` per request, pipelined, from `connections` connections)
//! to a topic (durable with `--durable`) with `--subscribers` subscribers on their own
//! connections and measures messages delivered per second; `call` serves an `echo`
//! function on one connection, which answers each request with a two-byte acknowledgement, and
//! calls it from `connections` connections with `pipeline` calls in flight each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use petrel_client::{ClientError, Message, Request, Response};

use crate::bench_queue::{Mode, Outcome, QueueBench};
use crate::progress::{self, Unit};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

pub(crate) async fn bench(args: &QueueBench, addr: &str) -> Res<Outcome> {
    match args.mode {
        Mode::Publish => publish(args, addr).await,
        Mode::Call => call(args, addr).await,
        _ => unreachable!("queue modes are bench_queue's"),
    }
}

async fn publish(args: &QueueBench, addr: &str) -> Res<Outcome> {
    let topic = &args.queue;
    let publisher = args.connect(addr).await?;
    // A topic of its own: one that exists (a durable one holds a log and its groups' cursors)
    // is refused, never removed.
    if publisher.topic_status(topic).await.is_ok() {
        let why = format!(
            "topic {topic:?} exists: the bench makes a topic of its own and removes it when done; name another with --queue"
        );
        return Err(why.into());
    }
    publisher.create_topic(topic, args.durable).await?;
    let mut publishers = vec![publisher.clone()];
    for _ in 1..args.connections {
        publishers.push(args.connect(addr).await?);
    }
    let delivered_all = args.count * args.subscribers as u64;
    let bar = progress::bar(delivered_all, "delivered", Unit::Items);
    let mut subscribers = Vec::new();
    for _ in 0..args.subscribers {
        let client = args.connect(addr).await?;
        // Room for the whole run: this measures delivery, not the slow-subscriber policy.
        let mut sub = client.subscribe(topic, args.count.min(1 << 20) as u32).await?;
        let (count, bar) = (args.count, bar.clone());
        subscribers.push(tokio::spawn(async move {
            let _client = client;
            for _ in 0..count {
                match sub.next().await {
                    Some(Ok(_)) => bar.inc(1),
                    Some(Err(e)) => return Err(e),
                    None => return Err(ClientError::Closed),
                }
            }
            Ok(())
        }));
    }
    let payload = args.payload();
    let started = Instant::now();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut in_flight = FuturesUnordered::new();
    let (mut sent, mut requests) = (0, 0);
    while sent < args.count || !in_flight.is_empty() {
        while sent < args.count && in_flight.len() < args.pipeline * publishers.len() {
            let n = (args.count - sent).min(args.batch as u64) as usize;
            sent += n as u64;
            let c = publishers[requests % publishers.len()].clone();
            requests += 1;
            let (topic, messages) = (topic.clone(), vec![Message::new(payload.clone()); n]);
            in_flight.push(async move {
                let t = Instant::now();
                c.publish(&topic, messages).await.map(|_| t.elapsed())
            });
        }
        if let Some(done) = in_flight.next().await {
            let _ = hist.record(done?.as_micros().max(1) as u64);
        }
    }
    for s in subscribers {
        s.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if !args.keep {
        let _ = publisher.remove_topic(topic).await;
    }
    Ok(Outcome::new(delivered_all, hist.len(), delivered_all, secs, args.payload_bytes, &hist))
}

async fn call(args: &QueueBench, addr: &str) -> Res<Outcome> {
    let server = args.connect(addr).await?;
    let function = args.queue.clone();
    server.serve(&function, |_request: Message| async { Ok(Message::new(&b"ok"[..])) }).await?;
    let bar = progress::bar(args.count, "calls", Unit::Items);
    let payload = args.payload();
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..args.connections {
        let client = args.connect(addr).await?;
        let share = args.count / args.connections as u64 + u64::from((i as u64) < args.count % args.connections as u64);
        let (function, payload, bar, done, pipeline) =
            (function.clone(), payload.clone(), bar.clone(), Arc::clone(&done), args.pipeline);
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
            // Bursts of calls, two in flight, as the offer benchmark does; with --pipeline 1,
            // strictly one call at a time.
            let burst = pipeline.div_ceil(2);
            let mut in_flight = FuturesUnordered::new();
            let mut sent = 0u64;
            while sent < share || !in_flight.is_empty() {
                while sent < share && in_flight.len() * burst < pipeline {
                    let n = (share - sent).min(burst as u64) as usize;
                    sent += n as u64;
                    let requests: Vec<Request> = (0..n)
                        .map(|_| Request::Call {
                            function: function.clone(),
                            timeout_ms: 30_000,
                            oneway: false,
                            message: Box::new(Message::new(payload.clone())),
                        })
                        .collect();
                    let c = client.clone();
                    in_flight.push(async move {
                        let t = Instant::now();
                        for r in c.pipeline(&requests).await {
                            match r? {
                                Response::Reply { .. } => {}
                                Response::Error { status, message } => {
                                    return Err(ClientError::Status { status, message });
                                }
                                other => return Err(ClientError::Protocol(format!("unexpected answer {other:?}"))),
                            }
                        }
                        Ok::<_, ClientError>((t.elapsed(), requests.len() as u64))
                    });
                }
                if let Some(result) = in_flight.next().await {
                    let (latency, n) = result?;
                    let _ = hist.record_n(latency.as_micros().max(1) as u64, n);
                    bar.inc(n);
                    done.fetch_add(n, Ordering::Relaxed);
                }
            }
            Ok::<_, ClientError>(hist)
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for t in tasks {
        hist.add(t.await??)?;
    }
    let secs = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    server.close();
    let calls = done.load(Ordering::Relaxed);
    Ok(Outcome::new(calls, calls, calls, secs, args.payload_bytes, &hist))
}
