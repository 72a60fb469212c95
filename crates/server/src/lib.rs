//! Petrel's server: listeners speaking the native protocol (TCP, Unix socket) and the memcache
//! protocol (TCP) over one broker. HTTP and TLS are to come, as more codecs over the same broker.

mod config;
mod convert;
#[doc(hidden)]
pub mod memcache;
mod native;
mod stats;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use config::{Config, DEFAULT_MEMCACHE_ADDR, DEFAULT_NATIVE_ADDR, parse_listener};
use petrel_broker::{Broker, BrokerOptions};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

/// What every connection of every protocol shares.
pub(crate) struct Ctx {
    pub broker: Arc<Broker>,
    pub config: Config,
    pub stats: stats::ServerStats,
    /// Notified when a client asks the server to stop (memcache `shutdown`, if allowed).
    pub shutdown: Notify,
}

/// A server with its listeners bound, ready to `run`.
pub struct Server {
    ctx: Arc<Ctx>,
    tcp: TcpListener,
    unix: Option<UnixListener>,
    memcache: Option<TcpListener>,
}

impl Server {
    /// Opens the broker's data and binds the listeners.
    pub async fn bind(config: Config) -> Result<Server, String> {
        config.validate()?;
        let options = BrokerOptions {
            durability: config.durability()?,
            segment_bytes: config.segment_bytes,
            max_message_bytes: config.max_message_bytes,
            queue_defaults: config.queue_defaults()?,
            queues: config.queues()?,
            topic_max_bytes: config.topic_max_bytes,
            topic_max_age: config.topic_max_age()?,
        };
        let broker = Broker::open(&config.data, options).map_err(|e| format!("{}: {e}", config.data.display()))?;
        let tcp =
            TcpListener::bind(config.native_addr).await.map_err(|e| format!("bind {}: {e}", config.native_addr))?;
        let unix = match &config.unix_socket {
            Some(path) => {
                let _ = std::fs::remove_file(path);
                Some(UnixListener::bind(path).map_err(|e| format!("bind {}: {e}", path.display()))?)
            }
            None => None,
        };
        let memcache = match config.memcache_addr {
            Some(addr) => Some(TcpListener::bind(addr).await.map_err(|e| format!("bind {addr}: {e}"))?),
            None => None,
        };
        let ctx = Ctx { broker: Arc::new(broker), config, stats: stats::ServerStats::new(), shutdown: Notify::new() };
        Ok(Server { ctx: Arc::new(ctx), tcp, unix, memcache })
    }

    pub fn native_addr(&self) -> SocketAddr {
        self.tcp.local_addr().expect("a bound listener has an address")
    }

    pub fn memcache_addr(&self) -> Option<SocketAddr> {
        self.memcache.as_ref().map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    /// Serves until `shutdown` completes; then stops accepting, lets requests in flight finish
    /// (up to the configured grace), and closes the broker (syncing durable queues).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), String> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let ctx = Arc::clone(&self.ctx);
        let ticker = {
            let broker = Arc::clone(&ctx.broker);
            let mut stop = stop_rx.clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_millis(20));
                loop {
                    tokio::select! {
                        _ = every.tick() => broker.tick(now_ns()),
                        _ = stop.changed() => return,
                    }
                }
            })
        };
        let next_conn = AtomicU64::new(1);
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            // Reap finished connections so the set stays bounded by the live ones.
            while connections.try_join_next().is_some() {}
            let full = connections.len() >= ctx.config.max_connections;
            tokio::select! {
                _ = &mut shutdown => break,
                _ = ctx.shutdown.notified() => break,
                accepted = accept_tcp(self.memcache.as_ref()), if !full => match accepted {
                    Ok(stream) => {
                        let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                        connections.spawn(memcache::serve(stream, Arc::clone(&ctx), conn, stop_rx.clone()));
                    }
                    Err(e) => tracing::warn!(error = %e, "accept failed"),
                },
                accepted = self.tcp.accept(), if !full => match accepted {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(conn, %peer, "connected");
                        connections.spawn(native::serve(stream, Arc::clone(&ctx), conn, stop_rx.clone()));
                    }
                    Err(e) => tracing::warn!(error = %e, "accept failed"),
                },
                accepted = accept_unix(self.unix.as_ref()), if !full => match accepted {
                    Ok(stream) => {
                        let conn = next_conn.fetch_add(1, Ordering::Relaxed);
                        connections.spawn(native::serve(stream, Arc::clone(&ctx), conn, stop_rx.clone()));
                    }
                    Err(e) => tracing::warn!(error = %e, "accept failed"),
                },
                Some(_) = connections.join_next(), if full => {}
            }
        }
        tracing::info!(connections = connections.len(), "shutting down");
        drop(self.tcp);
        drop(self.memcache);
        if let (Some(_), Some(path)) = (self.unix, &ctx.config.unix_socket) {
            let _ = std::fs::remove_file(path);
        }
        let _ = stop_tx.send(true);
        while connections.join_next().await.is_some() {}
        ticker.abort();
        Ok(())
    }
}

async fn accept_tcp(listener: Option<&TcpListener>) -> std::io::Result<tokio::net::TcpStream> {
    match listener {
        Some(l) => {
            let (stream, _) = l.accept().await?;
            let _ = stream.set_nodelay(true);
            Ok(stream)
        }
        None => std::future::pending().await,
    }
}

async fn accept_unix(listener: Option<&UnixListener>) -> std::io::Result<tokio::net::UnixStream> {
    match listener {
        Some(l) => l.accept().await.map(|(s, _)| s),
        None => std::future::pending().await,
    }
}

/// Now, in ns since the Unix epoch: the broker's clock for expiry, deadlines and timestamps.
pub(crate) fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}
