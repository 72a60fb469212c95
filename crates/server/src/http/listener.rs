//! The HTTP port's connections, as on the other ports: TLS when the client opens with a handshake
//! (and TLS is configured), plaintext otherwise unless `require_tls`. Handshakes run on tasks of
//! their own, so a slow one holds up nobody; finished connections reach axum through a bounded
//! channel.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_rustls::server::TlsStream;

use crate::{Ctx, stats, tls};

/// Handshakes under way at most; past it a new connection is closed at once.
const MAX_HANDSHAKES: usize = 256;
/// HTTP connections open at most (handshakes included); past it a new one is closed at once.
/// Scrapers, dashboards and scripts need a few; the bound keeps idle or slow clients from
/// taking the descriptors the other ports need.
const MAX_CONNECTIONS: usize = 512;
/// A connection that moves no byte either way for this long is closed: one that stopped in the
/// middle of a request, or a kept-alive one left idle.
const IDLE: Duration = Duration::from_secs(60);
/// A request is read within this long of its first byte, or its connection is closed: a client
/// that sends a request a byte at a time (each byte restarting `IDLE`) holds its place no
/// longer. Its handler's time is not counted (`Working`): a repair of a large log takes longer.
pub(super) const REQUEST: Duration = Duration::from_secs(10);
/// HTTP connections one address holds at most (handshakes included): one host's slow clients
/// leave room for the others' (a probe, a scrape).
const MAX_PER_ADDRESS: usize = 64;
/// Connections accepted and not yet taken by axum.
const ACCEPTED_QUEUE: usize = 64;

/// Who is at the other end of an HTTP connection (axum's connect info).
#[derive(Clone, Debug)]
pub(crate) struct Remote {
    pub addr: SocketAddr,
    pub tls: bool,
    /// Requests of the connection whose handler is at work (`Working`): its time limits wait.
    pub working: Arc<AtomicUsize>,
}

impl Remote {
    fn new(addr: SocketAddr, tls: bool) -> Remote {
        Remote { addr, tls, working: Arc::default() }
    }
}

/// A request read whole and being handled: while one lives, its connection is not closed for
/// silence or slowness (a repair of a large log takes longer than `REQUEST`, and no byte moves).
pub(crate) struct Working(Arc<AtomicUsize>);

impl Working {
    pub(crate) fn start(remote: &Remote) -> Working {
        remote.working.fetch_add(1, Ordering::AcqRel);
        Working(Arc::clone(&remote.working))
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// One HTTP connection: its stream, closed after `IDLE` without a byte either way, and its place
/// among the `MAX_CONNECTIONS`.
pub(super) struct HttpIo {
    stream: Stream,
    /// The connection's `Remote::working`.
    working: Arc<AtomicUsize>,
    idle: Pin<Box<tokio::time::Sleep>>,
    /// Since bytes came that no byte written has answered yet: `REQUEST` from then.
    unanswered: Option<Pin<Box<tokio::time::Sleep>>>,
    _open: OwnedSemaphorePermit,
    _address: AddressSlot,
}

impl HttpIo {
    fn new(stream: Stream, working: Arc<AtomicUsize>, open: OwnedSemaphorePermit, address: AddressSlot) -> HttpIo {
        let idle = Box::pin(tokio::time::sleep(IDLE));
        HttpIo { stream, working, idle, unanswered: None, _open: open, _address: address }
    }

    /// `polled`, the stream's answer: a byte moved restarts the idle time; waiting past it is
    /// an error (hyper then closes the connection).
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
        moved: impl Fn(&T) -> bool,
    ) -> Poll<io::Result<T>> {
        if self.working.load(Ordering::Acquire) > 0 {
            // A handler at work: its time counts neither as silence nor as a slow request (both
            // start again from here once it is done).
            self.idle.as_mut().reset(tokio::time::Instant::now() + IDLE);
            self.unanswered = None;
            return polled;
        }
        match polled {
            Poll::Ready(Ok(done)) => {
                if moved(&done) {
                    self.idle.as_mut().reset(tokio::time::Instant::now() + IDLE);
                }
                Poll::Ready(Ok(done))
            }
            Poll::Pending if self.idle.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "an HTTP connection idle too long")))
            }
            Poll::Pending if self.unanswered.as_mut().is_some_and(|late| late.as_mut().poll(cx).is_ready()) => {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "an HTTP request not complete in time")))
            }
            other => other,
        }
    }
}

impl AsyncRead for HttpIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = match &mut this.stream {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        let read = buf.filled().len() > before;
        if read && this.unanswered.is_none() {
            this.unanswered = Some(Box::pin(tokio::time::sleep(REQUEST)));
        }
        this.watch(cx, polled, |_| read)
    }
}

impl AsyncWrite for HttpIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = match &mut this.stream {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        };
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.unanswered = None; // answered (a TLS handshake's bytes went before it was made)
        }
        this.watch(cx, polled, |&n| n > 0)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = match &mut this.stream {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        };
        this.watch(cx, polled, |_| false)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// An address's place among its `MAX_PER_ADDRESS` connections, given back when dropped.
struct AddressSlot {
    counts: Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>,
    ip: std::net::IpAddr,
}

impl AddressSlot {
    fn take(
        counts: &Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>,
        ip: std::net::IpAddr,
    ) -> Option<AddressSlot> {
        let mut map = counts.lock().unwrap_or_else(|e| e.into_inner());
        let count = map.entry(ip).or_insert(0);
        if *count >= MAX_PER_ADDRESS {
            return None;
        }
        *count += 1;
        Some(AddressSlot { counts: Arc::clone(counts), ip })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = map.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

pub(super) struct HttpListener {
    accepted: mpsc::Receiver<(HttpIo, Remote)>,
    local: SocketAddr,
}

impl HttpListener {
    /// Accepts on `listener` (on a task of its own) until `stop`.
    pub fn start(listener: TcpListener, ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) -> io::Result<HttpListener> {
        let local = listener.local_addr()?;
        let (tx, accepted) = mpsc::channel(ACCEPTED_QUEUE);
        let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let open_connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let per_address = Arc::new(std::sync::Mutex::new(HashMap::new()));
        tokio::spawn(async move {
            loop {
                let (stream, addr) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(e) => {
                            // Out of descriptors, most likely: wait instead of spinning.
                            tracing::warn!(error = %e, "HTTP accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    _ = stop.changed() => return,
                };
                // (Refused at a limit: counted with the other ports' refusals.)
                let refused = || crate::stats::add(&ctx.stats.connections_refused, 1);
                let Some(address) = AddressSlot::take(&per_address, addr.ip()) else {
                    refused();
                    continue;
                };
                let Ok(open_permit) = Arc::clone(&open_connections).try_acquire_owned() else {
                    refused();
                    continue;
                };
                let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
                    refused();
                    continue;
                };
                let (ctx, tx) = (Arc::clone(&ctx), tx.clone());
                tokio::spawn(async move {
                    if let Some((stream, remote)) = open(stream, addr, &ctx).await {
                        let io = HttpIo::new(stream, Arc::clone(&remote.working), open_permit, address);
                        let _ = tx.send((io, remote)).await;
                    }
                    drop(permit);
                });
            }
        });
        Ok(HttpListener { accepted, local })
    }
}

/// TLS if the connection opens with a handshake and TLS is configured; plaintext unless the
/// server requires TLS. `None`: closed, refused, or silent past `handshake_timeout`.
async fn open(stream: TcpStream, addr: SocketAddr, ctx: &Ctx) -> Option<(Stream, Remote)> {
    let _ = stream.set_nodelay(true);
    let limit = ctx.handshake_timeout();
    let mut first = [0u8; 1];
    match tokio::time::timeout(limit, stream.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return None,
    }
    if let Some(tls) = ctx.tls().filter(|_| first[0] == tls::HANDSHAKE_RECORD) {
        return match tokio::time::timeout(limit, tls.acceptor.accept(stream)).await {
            Ok(Ok(stream)) => {
                stats::add(&ctx.stats.tls_connections, 1);
                Some((Stream::Tls(Box::new(stream)), Remote::new(addr, true)))
            }
            _ => {
                stats::add(&ctx.stats.tls_refused, 1);
                None
            }
        };
    }
    if ctx.config.security.require_tls {
        stats::add(&ctx.stats.tls_refused, 1);
        // Said in HTTP, as the other ports say it in their protocols, then closed.
        let mut stream = stream;
        let reason = "this server requires TLS: use https://\n";
        let answer = format!(
            "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reason}",
            reason.len()
        );
        let _ = tokio::time::timeout(limit, tokio::io::AsyncWriteExt::write_all(&mut stream, answer.as_bytes())).await;
        return None;
    }
    Some((Stream::Plain(stream), Remote::new(addr, false)))
}

impl Listener for HttpListener {
    type Io = HttpIo;
    type Addr = Remote;

    async fn accept(&mut self) -> (HttpIo, Remote) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accepting task ended (the server stops): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Remote> {
        Ok(Remote::new(self.local, false))
    }
}

impl Connected<IncomingStream<'_, HttpListener>> for Remote {
    fn connect_info(stream: IncomingStream<'_, HttpListener>) -> Remote {
        stream.remote_addr().clone()
    }
}
