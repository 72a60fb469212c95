//! The HTTP port's connections, as on the other ports: TLS when the client opens with a handshake
//! (and TLS is configured), plaintext otherwise unless `require_tls`. Handshakes run on tasks of
//! their own, so a slow one holds up nobody; finished connections reach axum through a bounded
//! channel.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_rustls::server::TlsStream;

use crate::{Ctx, stats, tls};

/// Handshakes under way at most; past it a new connection is closed at once.
const MAX_HANDSHAKES: usize = 256;
/// Connections accepted and not yet taken by axum.
const ACCEPTED_QUEUE: usize = 64;

/// Who is at the other end of an HTTP connection (axum's connect info).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Remote {
    pub addr: SocketAddr,
    pub tls: bool,
}

pub(super) enum HttpIo {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for HttpIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            HttpIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            HttpIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for HttpIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            HttpIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            HttpIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            HttpIo::Plain(s) => Pin::new(s).poll_flush(cx),
            HttpIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            HttpIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            HttpIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
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
                let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else { continue };
                let (ctx, tx) = (Arc::clone(&ctx), tx.clone());
                tokio::spawn(async move {
                    if let Some(io) = open(stream, addr, &ctx).await {
                        let _ = tx.send(io).await;
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
async fn open(stream: TcpStream, addr: SocketAddr, ctx: &Ctx) -> Option<(HttpIo, Remote)> {
    let _ = stream.set_nodelay(true);
    let limit = ctx.config.security.handshake_timeout().unwrap_or(Duration::from_secs(10));
    let mut first = [0u8; 1];
    match tokio::time::timeout(limit, stream.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        _ => return None,
    }
    if let Some(tls) = ctx.tls().filter(|_| first[0] == tls::HANDSHAKE_RECORD) {
        return match tokio::time::timeout(limit, tls.acceptor.accept(stream)).await {
            Ok(Ok(stream)) => {
                stats::add(&ctx.stats.tls_connections, 1);
                Some((HttpIo::Tls(Box::new(stream)), Remote { addr, tls: true }))
            }
            _ => {
                stats::add(&ctx.stats.tls_refused, 1);
                None
            }
        };
    }
    if ctx.config.security.require_tls {
        stats::add(&ctx.stats.tls_refused, 1);
        return None;
    }
    Some((HttpIo::Plain(stream), Remote { addr, tls: false }))
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
        Ok(Remote { addr: self.local, tls: false })
    }
}

impl Connected<IncomingStream<'_, HttpListener>> for Remote {
    fn connect_info(stream: IncomingStream<'_, HttpListener>) -> Remote {
        *stream.remote_addr()
    }
}
