//! `petrel bench queue --server A,B,C`: the same load through the cluster client, to measure
//! what its routing costs next to one server reached directly. Each `--connections` is one
//! cluster client (a connection to every server); offers go to the servers in turn, polls take
//! from all of them and acknowledgements go back to where each message came from. A trailing
//! comma (`--server A,`) makes a cluster of one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use petrel_client::{Cluster, ClusterOptions, Message, PollOptions, QueueConfig};

use crate::bench_queue::{Mode, Outcome, QueueBench};
use crate::progress::{self, Unit};

pub async fn bench(args: &QueueBench, servers: &[&str]) -> Result<Outcome, Box<dyn std::error::Error>> {
    let options = ClusterOptions { client: args.client_options(), ..ClusterOptions::default() };
    let admin = Cluster::connect(servers, options.clone()).await?;
    for (_, status) in admin.queue_status(&args.queue).await {
        if let Ok(status) = status {
            crate::bench_queue::refuse_a_queue_in_use(&args.queue, &status)?;
        }
    }
    let _ = admin.remove_queue(&args.queue).await;
    let config = QueueConfig { durable: args.durable, priorities: args.priorities, ..QueueConfig::default() };
    admin.create_queue(&args.queue, config).await?;
    let payload = args.payload();
    if args.mode == Mode::Poll {
        let mut sent = 0;
        while sent < args.count {
            let n = (args.count - sent).min(1000);
            admin.offer(&args.queue, (0..n).map(|_| Message::new(payload.clone())).collect(), None).await?;
            sent += n;
        }
    }
    let offering = |i: usize| match args.mode {
        Mode::Offer => true,
        Mode::Poll => false,
        Mode::OfferPoll => i.is_multiple_of(2),
        _ => unreachable!("run() sends only queue modes here"),
    };
    let offerers = (0..args.connections).filter(|&i| offering(i)).count() as u64;
    // Every cluster connected before the clock starts: only the load is timed.
    let mut clusters = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        clusters.push(Cluster::connect(servers, options.clone()).await?);
    }
    let bar = progress::bar(args.count, &format!("{:?}", args.mode).to_lowercase(), Unit::Items);
    let polled = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, cluster) in clusters.into_iter().enumerate() {
        let (queue, payload, bar, polled) = (args.queue.clone(), payload.clone(), bar.clone(), Arc::clone(&polled));
        let (pipeline, batch, count, tentative) = (args.pipeline, args.batch, args.count, args.mode == Mode::OfferPoll);
        let offers = offering(i);
        // Its place among the offering connections: the remainder of `count` goes to the first.
        let rank = (0..i).filter(|&j| offering(j)).count() as u64;
        let share = if offers { count / offerers + u64::from(rank < count % offerers) } else { count };
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
            let mut in_flight = FuturesUnordered::new();
            let (mut sent, mut stop) = (0u64, false);
            loop {
                // Offers go out in bursts of half the pipeline, two bursts in flight, as the
                // single-server run sends them (`Cluster::offer_pipelined`).
                let burst = if offers { pipeline.div_ceil(2) } else { 1 };
                while !stop && in_flight.len() * burst < pipeline && (!offers || sent < share) {
                    let (c, queue) = (cluster.clone(), queue.clone());
                    let mut batches = Vec::new();
                    while offers && batches.len() < burst && sent < share {
                        let n = (share - sent).min(batch as u64);
                        sent += n;
                        batches.push((0..n).map(|_| Message::new(payload.clone())).collect::<Vec<_>>());
                    }
                    in_flight.push(async move {
                        let t = Instant::now();
                        let done = if offers {
                            let offered: u64 = batches.iter().map(|b| b.len() as u64).sum();
                            for r in c.offer_pipelined(&queue, batches).await {
                                r?;
                            }
                            offered
                        } else {
                            let visibility = tentative.then_some(Duration::from_secs(60));
                            let options =
                                PollOptions { max: batch as u32, timeout: Duration::from_millis(100), visibility };
                            let got = c.poll(&queue, options).await?;
                            if tentative && !got.is_empty() {
                                let handles: Vec<_> = got.iter().map(|d| d.handle).collect();
                                c.ack(&queue, &handles).await?;
                            }
                            got.len() as u64
                        };
                        Ok::<_, petrel_client::ClientError>((t.elapsed(), done, burst as u64))
                    });
                }
                let Some(result) = in_flight.next().await else { break };
                let (latency, done, requests) = result?;
                let _ = hist.record_n(latency.as_micros().max(1) as u64, requests);
                if !offers || !tentative {
                    bar.inc(done);
                }
                if !offers {
                    stop = polled.fetch_add(done, Ordering::Relaxed) + done >= count;
                }
                if stop && in_flight.is_empty() {
                    break;
                }
            }
            Ok::<_, petrel_client::ClientError>(hist)
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for t in tasks {
        hist.add(t.await??)?;
    }
    let secs = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let pollers = args.connections as u64 - offerers;
    let messages = if pollers > 0 { polled.load(Ordering::Relaxed).min(args.count) } else { args.count };
    if !args.keep {
        let _ = admin.remove_queue(&args.queue).await;
    }
    Ok(Outcome::new(messages, hist.len(), messages, secs, args.payload_bytes, &hist))
}
