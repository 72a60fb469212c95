//! Who is on a connection: a password checked against the users file (off the async runtime:
//! Argon2 is slow on purpose), or a verified client certificate. Both protocols authenticate
//! here; what an authenticated user may do is the broker's to decide (`Broker::authorize`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use petrel_broker::ConnId;
use petrel_broker::security::{Action, Kind, Principal};

use crate::Ctx;
use crate::stats::add;
use crate::window::FixedWindow;

/// Destinations whose denial a connection logged already: each once per connection, at most
/// `MAX_LOGGED_DENIALS` of them (a client probing names cannot flood the log).
#[derive(Default)]
pub(crate) struct Denials(std::collections::HashSet<(Kind, String)>);

const MAX_LOGGED_DENIALS: usize = 64;

/// Asks the broker whether `principal` on connection `conn` may do one of `actions` to
/// `kind`/`name`: the one check both protocols make; a denial is logged once per destination.
pub(crate) fn authorize(
    ctx: &Ctx,
    conn: ConnId,
    principal: Option<&Principal>,
    denials: &mut Denials,
    kind: Kind,
    name: &str,
    actions: &[Action],
) -> Result<(), petrel_broker::BrokerError> {
    let Err(e) = ctx.broker.authorize(principal, kind, name, actions) else { return Ok(()) };
    if denials.0.len() < MAX_LOGGED_DENIALS && denials.0.insert((kind, name.to_owned())) {
        let user = principal.map(|p| p.user.clone());
        // Names as the client sent them, escaped (`?`): control characters do not reach the log.
        tracing::warn!(conn, user, %kind, name = ?petrel_broker::shown(name), reason = %e, "request denied");
    }
    Err(e)
}

/// What the server knows of a connection's other end before it says anything.
#[derive(Clone, Debug)]
pub(crate) struct Peer {
    /// `None` for the Unix socket.
    pub addr: Option<SocketAddr>,
    pub tls: bool,
    /// The common name of a verified client certificate.
    pub certificate_user: Option<String>,
    /// On the Unix socket: the user id of the process at the other end, if the kernel says.
    pub unix_uid: Option<u32>,
}

impl Peer {
    /// A TCP peer at `addr`.
    pub fn tcp(addr: SocketAddr, tls: bool, certificate_user: Option<String>) -> Peer {
        Peer { addr: Some(addr), tls, certificate_user, unix_uid: None }
    }

    /// A peer on the Unix socket, run by the user `uid`.
    pub fn unix(uid: Option<u32>) -> Peer {
        Peer { addr: None, tls: false, certificate_user: None, unix_uid: uid }
    }

    /// What its authentication attempts count against.
    fn attempts_source(&self) -> Source {
        match self.addr {
            Some(addr) => Source::Ip(source(addr.ip())),
            None => Source::UnixUser(self.unix_uid),
        }
    }

    /// On this machine: a loopback address or the Unix socket.
    pub fn is_local(&self) -> bool {
        self.addr.is_none_or(|a| a.ip().is_loopback())
    }
}

/// One answer for every failure, so a client cannot tell a wrong name from a wrong password.
pub(crate) const INVALID: &str = "invalid user name or password";

/// Authentication attempts per source per minute (a fixed window each): an IPv4 address, or an
/// IPv6 /64 (what one host is given: counting its addresses one by one would give it 2⁶⁴ tries a
/// minute).
pub(crate) struct AttemptLimiter {
    windows: Mutex<HashMap<Source, FixedWindow>>,
}

/// What attempts count against: an address (`source`), or a local user on the Unix socket (each
/// its own window: one local user's guesses do not use up another's tries).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    Ip(IpAddr),
    UnixUser(Option<u32>),
}

/// Sources remembered at most; past it, windows that ended are dropped, then those with the
/// fewest attempts (never the busiest: a guesser's own window outlives the addresses it spends
/// to fill the table).
const MAX_TRACKED_ADDRESSES: usize = 10_000;

/// The source an attempt from `ip` counts against: the address, or an IPv6 address's /64 (one
/// host may have all of it: counting its addresses one by one would give it 2⁶⁴ tries).
fn source(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
        v4 => v4,
    }
}

impl AttemptLimiter {
    pub fn new() -> AttemptLimiter {
        AttemptLimiter { windows: Mutex::new(HashMap::new()) }
    }

    /// Counts an attempt from `addr`; `false` if it is over `per_minute`.
    fn admit(&self, addr: Source, per_minute: u32) -> bool {
        let now = Instant::now();
        let minute = Duration::from_secs(60);
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        if windows.len() >= MAX_TRACKED_ADDRESSES && !windows.contains_key(&addr) {
            windows.retain(|_, window| !window.ended(now, minute));
            if windows.len() >= MAX_TRACKED_ADDRESSES {
                // All of the fewest attempts at once: a table filled one attempt an address at a
                // time empties in one pass, not one address per new one.
                let fewest = windows.values().map(FixedWindow::count).min().unwrap_or(0);
                windows.retain(|_, window| window.count() > fewest);
            }
        }
        windows.entry(addr).or_insert(FixedWindow::new(now)).admit(now, minute, per_minute)
    }
}

/// Holds one of a user's connections (for `max_connections_per_user`) while it lives.
pub(crate) struct UserConnection {
    ctx: Arc<Ctx>,
    user: String,
}

impl Drop for UserConnection {
    fn drop(&mut self) {
        let mut counts = self.ctx.user_connections.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.user);
            }
        }
    }
}

/// A connection that proved who it is.
pub(crate) struct Authenticated {
    pub principal: Principal,
    pub _held: UserConnection,
}

/// Password checks at once: one per core (a check is CPU-bound), at least 2.
pub(crate) fn max_password_checks() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).max(2)
}

/// The refusal of a login past `auth_attempts_per_minute` (HTTP answers it `429`).
pub(crate) const RATE_LIMITED: &str = "too many authentication attempts from this address; try again in a minute";

/// Checks `user`/`password` for the connection `conn` from `peer`. `Err` is the reason to give
/// the client; failures are counted, rate-limited per address, and answered after a delay.
pub(crate) async fn with_password(
    ctx: &Arc<Ctx>,
    peer: &Peer,
    conn: ConnId,
    user: String,
    password: String,
) -> Result<Authenticated, String> {
    verify_password(ctx, peer, conn, &user, password).await?;
    admit(ctx, conn, user)
}

/// Checks `user`'s password, as `with_password` does, without counting a connection of the
/// user's (an HTTP request is none: it logs in for itself, and `max_connections_per_user` does
/// not apply to it). Successes are the caller's to count.
pub(crate) async fn verify_password(
    ctx: &Arc<Ctx>,
    peer: &Peer,
    conn: ConnId,
    user: &str,
    password: String,
) -> Result<(), String> {
    let Some(security) = ctx.broker.security() else { return Err("authentication is off on this server".into()) };
    let settings = &ctx.config.security;
    let plaintext_allowed = settings.allow_plaintext_auth && peer.is_local();
    if !(peer.tls || plaintext_allowed) {
        add(&ctx.stats.auth_failures, 1);
        return Err("a password is accepted only over TLS (allow_plaintext_auth permits it on loopback)".into());
    }
    if !ctx.auth_attempts.admit(peer.attempts_source(), settings.auth_attempts_per_minute) {
        add(&ctx.stats.auth_rate_limited, 1);
        return Err(RATE_LIMITED.into());
    }
    let (name, known) = (user.to_owned(), security.users.get(user).is_some());
    // A turn (the semaphore is never closed), held by the check itself: a request dropped
    // meanwhile (an HTTP client gone) does not give it back while the hash still runs.
    let turn =
        Arc::clone(&ctx.password_checks).acquire_owned().await.map_err(|_| "the server is stopping".to_string())?;
    let checked = Arc::clone(&security);
    let verified = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        checked.users.verify(&name, &password)
    })
    .await;
    // A reload during the check that changed the user's password (or removed the user) makes
    // it void: the old password must not log in once the new one is in place.
    let now = ctx.broker.security();
    let unchanged =
        now.as_ref().and_then(|s| s.users.get(user)).map(|u| &u.hash) == security.users.get(user).map(|u| &u.hash);
    if !matches!(verified, Ok(Some(_))) || !unchanged {
        add(&ctx.stats.auth_failures, 1);
        // An unknown name is not logged: it may be a password typed in its place.
        match known {
            true => {
                tracing::info!(conn, user = ?petrel_broker::shown(user), peer = ?peer.addr, "authentication failed: wrong password")
            }
            false => tracing::info!(conn, peer = ?peer.addr, "authentication failed: no such user"),
        }
        tokio::time::sleep(settings.auth_failure_delay().unwrap_or(Duration::from_millis(250))).await;
        return Err(INVALID.into());
    }
    Ok(())
}

/// The user a verified client certificate names, if the users file knows it.
pub(crate) fn with_certificate(ctx: &Arc<Ctx>, peer: &Peer, conn: ConnId) -> Option<Result<Authenticated, String>> {
    let user = peer.certificate_user.clone()?;
    let security = ctx.broker.security()?;
    if security.users.get(&user).is_none() {
        add(&ctx.stats.auth_failures, 1);
        tracing::info!(conn, user = ?petrel_broker::shown(&user), "client certificate names no known user");
        return Some(Err(format!(
            "the client certificate's user {:?} is not in the users file",
            petrel_broker::shown(&user)
        )));
    }
    Some(admit(ctx, conn, user))
}

fn admit(ctx: &Arc<Ctx>, conn: ConnId, user: String) -> Result<Authenticated, String> {
    let max = ctx.limits.max_connections_per_user();
    let mut counts = ctx.user_connections.lock().unwrap_or_else(|e| e.into_inner());
    let n = counts.entry(user.clone()).or_insert(0);
    if max > 0 && *n >= max {
        add(&ctx.stats.connections_refused, 1);
        return Err(format!("user {user:?} has {max} connections already (max_connections_per_user)"));
    }
    *n += 1;
    drop(counts);
    add(&ctx.stats.auth_successes, 1);
    tracing::debug!(conn, user = %user, "authenticated");
    let held = UserConnection { ctx: Arc::clone(ctx), user: user.clone() };
    Ok(Authenticated { principal: Principal { user, conn }, _held: held })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> Source {
        Source::Ip(source(text.parse().unwrap()))
    }

    /// An IPv6 host's /64 is one source; a table filled from many addresses keeps the busiest
    /// source's count (it was cleared, which let a guesser start again).
    #[test]
    fn attempts_count_per_ipv6_64_and_a_full_table_keeps_the_busiest() {
        let limiter = AttemptLimiter::new();
        for _ in 0..5 {
            assert!(limiter.admit(ip("2001:db8::1"), 5));
        }
        assert!(!limiter.admit(ip("2001:db8::2"), 5), "the same /64");
        assert!(!limiter.admit(ip("2001:db8:0:0:ffff::9"), 5), "the same /64");
        assert!(limiter.admit(ip("2001:db8:0:1::1"), 5), "another /64");
        assert!(!limiter.admit(ip("2001:db8::3"), 5));
        for i in 0..2 * MAX_TRACKED_ADDRESSES as u32 {
            let v4 = std::net::Ipv4Addr::from(0x0a00_0000 + i);
            limiter.admit(Source::Ip(IpAddr::V4(v4)), 5);
        }
        assert!(!limiter.admit(ip("2001:db8::1"), 5), "still over its limit");
        assert!(limiter.windows.lock().unwrap().len() <= MAX_TRACKED_ADDRESSES);
        // An IPv4 address seen as IPv6 (a dual-stack listener) is the IPv4 source.
        for _ in 0..5 {
            assert!(limiter.admit(ip("192.0.2.7"), 5));
        }
        assert!(!limiter.admit(ip("::ffff:192.0.2.7"), 5));
        // On the Unix socket, each local user has a window of its own.
        let (alice, bob) = (Peer::unix(Some(1000)), Peer::unix(Some(1001)));
        for _ in 0..5 {
            assert!(limiter.admit(alice.attempts_source(), 5));
        }
        assert!(!limiter.admit(alice.attempts_source(), 5));
        assert!(limiter.admit(bob.attempts_source(), 5), "another user's tries are not used up");
    }
}
