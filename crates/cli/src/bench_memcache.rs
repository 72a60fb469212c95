//! `petrel bench queue --protocol memcache`: the same load over the memcache text protocol, with
//! a small pipelining client of its own. It speaks plain memcache (`set`, `get`), so it can be
//! pointed at memcached too (`--server`), for a ceiling on the same machine in the same run.
//!
//! Each connection works in rounds: `pipeline` requests written at once, then their answers read;
//! the latency recorded is that of a round. Queues (keys) are `QUEUE-0` … `QUEUE-{keys-1}`,
//! visited round robin.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::bench_queue::{Mode, Outcome, QueueBench};
use crate::progress::{self, Unit};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

pub(crate) async fn bench(args: &QueueBench, addr: &str) -> Result<Outcome, Box<dyn std::error::Error>> {
    let payload = vec![0x5au8; args.payload_bytes];
    if args.mode == Mode::Poll {
        let mut conn = Conn::connect(addr).await.map_err(|e| e.to_string())?;
        let mut left = args.count;
        let mut i = 0;
        while left > 0 {
            let n = left.min(1000) as usize;
            conn.sets(&args.queue, args.keys, &mut i, n, &payload).await.map_err(|e| e.to_string())?;
            left -= n as u64;
        }
    }
    let bar = progress::bar(args.count, &format!("{:?}", args.mode).to_lowercase(), Unit::Items);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.connections {
        let mut conn = Conn::connect(addr).await.map_err(|e| e.to_string())?;
        let (queue, keys, pipeline, count, mode) =
            (args.queue.clone(), args.keys, args.pipeline, args.count, args.mode);
        let (payload, bar, done) = (payload.clone(), bar.clone(), Arc::clone(&done));
        // Sets are shared out; gets go on until `count` items are taken (or the queues run dry).
        let share = count / args.connections as u64 + u64::from((c as u64) < count % args.connections as u64);
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
            let (mut requests, mut hits, mut sent) = (0u64, 0u64, 0u64);
            let mut next_key = c;
            loop {
                let round = Instant::now();
                let n = match mode {
                    Mode::Poll => pipeline,
                    _ => (share - sent).min(pipeline as u64) as usize,
                };
                if n == 0 {
                    break;
                }
                let mut key = next_key;
                if mode != Mode::Poll {
                    conn.sets(&queue, keys, &mut key, n, &payload).await?;
                    requests += n as u64;
                    sent += n as u64;
                }
                if mode != Mode::Offer {
                    let got = conn.gets(&queue, keys, &mut next_key, n).await?;
                    requests += n as u64;
                    hits += got;
                    bar.inc(got);
                    let total = done.fetch_add(got, Ordering::Relaxed) + got;
                    if mode == Mode::Poll && (total >= count || got == 0) {
                        let _ = hist.record(round.elapsed().as_micros().max(1) as u64);
                        break;
                    }
                } else {
                    next_key = key;
                    bar.inc(n as u64);
                }
                let _ = hist.record(round.elapsed().as_micros().max(1) as u64);
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((hist, requests, hits))
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut requests, mut hits) = (0, 0);
    for t in tasks {
        let (h, r, k) = t.await?.map_err(|e| e.to_string())?;
        hist.add(h)?;
        requests += r;
        hits += k;
    }
    let secs = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let messages = if args.mode == Mode::Offer { args.count } else { hits };
    Ok(Outcome::new(messages, requests, hits, secs, args.payload_bytes, &hist))
}

struct Conn {
    stream: TcpStream,
    out: Vec<u8>,
    input: BytesMut,
}

impl Conn {
    async fn connect(addr: &str) -> Res<Conn> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn { stream, out: Vec::with_capacity(64 * 1024), input: BytesMut::with_capacity(64 * 1024) })
    }

    /// `n` sets to the keys from `*key` on, pipelined; every one must be STORED.
    async fn sets(&mut self, queue: &str, keys: usize, key: &mut usize, n: usize, payload: &[u8]) -> Res<()> {
        self.out.clear();
        for _ in 0..n {
            use std::io::Write as _;
            write!(self.out, "set {queue}-{} 0 0 {}\r\n", *key % keys, payload.len())?;
            self.out.extend_from_slice(payload);
            self.out.extend_from_slice(b"\r\n");
            *key += 1;
        }
        self.stream.write_all(&self.out).await?;
        for _ in 0..n {
            let line = self.line().await?;
            if line != b"STORED" {
                return Err(format!("set answered {:?}", String::from_utf8_lossy(&line)).into());
            }
        }
        Ok(())
    }

    /// `n` gets from the keys from `*key` on, pipelined; returns how many gave an item.
    async fn gets(&mut self, queue: &str, keys: usize, key: &mut usize, n: usize) -> Res<u64> {
        self.out.clear();
        for _ in 0..n {
            use std::io::Write as _;
            write!(self.out, "get {queue}-{}\r\n", *key % keys)?;
            *key += 1;
        }
        self.stream.write_all(&self.out).await?;
        let mut hits = 0;
        for _ in 0..n {
            loop {
                let line = self.line().await?;
                if line == b"END" {
                    break;
                }
                let len = line
                    .strip_prefix(b"VALUE ")
                    .and_then(|rest| std::str::from_utf8(rest).ok()?.split(' ').nth(2)?.parse::<usize>().ok())
                    .ok_or_else(|| format!("get answered {:?}", String::from_utf8_lossy(&line)))?;
                self.fill(len + 2).await?;
                self.input.advance(len + 2);
                hits += 1;
            }
        }
        Ok(hits)
    }

    /// The next answer line, without its CRLF.
    async fn line(&mut self) -> Res<Vec<u8>> {
        loop {
            if let Some(end) = self.input.windows(2).position(|w| w == b"\r\n") {
                let line = self.input.split_to(end).to_vec();
                self.input.advance(2);
                return Ok(line);
            }
            self.read().await?;
        }
    }

    async fn fill(&mut self, n: usize) -> Res<()> {
        while self.input.len() < n {
            self.read().await?;
        }
        Ok(())
    }

    async fn read(&mut self) -> Res<()> {
        let read = tokio::time::timeout(Duration::from_secs(30), self.stream.read_buf(&mut self.input)).await??;
        if read == 0 {
            return Err("the server closed the connection".into());
        }
        Ok(())
    }
}
