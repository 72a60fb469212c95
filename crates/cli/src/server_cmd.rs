//! `petrel serve` and the commands that talk to a server: `produce`, `consume`, `queue …`.

use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::target::{Handle, Taken, Target};
use clap::{Args, Subcommand};
use petrel_client::blocking::{Client, Follower};
use petrel_client::{
    ClientError, ClientOptions, ConnectionEvent, Message, PollOptions, QueueConfig, Reconnect, Status, TlsOptions,
};
use petrel_server::{Config, DEFAULT_NATIVE_ADDR, Server};

type Res = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Args)]
pub struct ServeArgs {
    /// Data directory (default: ./petrel-data).
    #[arg(long)]
    data: Option<PathBuf>,
    /// TOML configuration file; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Native protocol address (default 127.0.0.1:22134; port 0 picks a free one; a host name
    /// is resolved).
    #[arg(long, value_parser = petrel_server::listen_address)]
    native_addr: Option<SocketAddr>,
    /// Also listen on this Unix socket.
    #[arg(long)]
    unix_socket: Option<PathBuf>,
    /// Memcache (Kestrel) protocol address (default 127.0.0.1:22133; port 0 picks a free one;
    /// "off" disables it).
    #[arg(long)]
    memcache_addr: Option<String>,
    /// HTTP address for metrics and health checks (default 127.0.0.1:22135; port 0 picks a free
    /// one; "off" disables it).
    #[arg(long)]
    http_addr: Option<String>,
    /// Durability of durable queues: none, always, interval:MS.
    #[arg(long)]
    durability: Option<String>,
}

/// Runs the server until SIGTERM or SIGINT; prints one line per listener on stdout once it
/// listens (`native <ip:port>`, `memcache <ip:port>`, `unix <path>`, `http <ip:port>`).
pub fn serve(args: ServeArgs) -> Res {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(d) = args.data {
        config.data = d;
    }
    if let Some(a) = args.native_addr {
        config.native_addr = a;
    }
    if let Some(u) = args.unix_socket {
        config.unix_socket = Some(u);
    }
    if let Some(m) = args.memcache_addr {
        config.memcache_addr = petrel_server::parse_listener(&m).map_err(|e| format!("--memcache-addr {e}"))?;
    }
    if let Some(h) = args.http_addr {
        config.http_addr = petrel_server::parse_listener(&h).map_err(|e| format!("--http-addr {e}"))?;
    }
    if let Some(d) = args.durability {
        config.durability = d;
    }
    raise_open_files_limit();
    let config_file = args.config.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let _file_size_signal = handle_file_size_signal();
        // Before the listeners are announced: a SIGTERM sent as soon as they are (a supervisor's
        // stop right after a start) ends the server gracefully, not by the signal's default.
        let stop = shutdown_signal()?;
        // So is a SIGHUP (a `systemctl reload`) during a long recovery: taken, not the signal's
        // default (the end of the process), and the reload made once the server is up.
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .inspect_err(|e| tracing::warn!(error = %e, "SIGHUP not handled: no reloads"))
            .ok();
        let unix = config.unix_socket.clone();
        let server = Server::bind(config).await?;
        if let Some(hup) = hup {
            tokio::spawn(reload_on_sighup(server.reloader(config_file), hup));
        }
        let mut out = io::stdout().lock();
        writeln!(out, "native {}", server.native_addr())?;
        if let Some(addr) = server.memcache_addr() {
            writeln!(out, "memcache {addr}")?;
        }
        if let Some(path) = unix {
            writeln!(out, "unix {}", path.display())?;
        }
        if let Some(addr) = server.http_addr() {
            writeln!(out, "http {addr}")?;
        }
        out.flush()?;
        drop(out);
        match server.memcache_addr() {
            Some(memcache) => tracing::info!(native = %server.native_addr(), %memcache, "listening"),
            None => tracing::info!(native = %server.native_addr(), "listening"),
        }
        server.run(stop).await?;
        tracing::info!("stopped");
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// A write past the file-size limit (`ulimit -f`, RLIMIT_FSIZE) raises SIGXFSZ, whose default
/// action ends the process without a word. Handled (the signal itself is ignored), the write
/// fails with EFBIG instead: an error of that one write, which the log reports (a segment that
/// cannot grow is made smaller, or the offer refused), as it does for a full disk.
fn handle_file_size_signal() -> Option<tokio::signal::unix::Signal> {
    let xfsz = tokio::signal::unix::SignalKind::from_raw(rustix::process::Signal::XFSZ.as_raw());
    tokio::signal::unix::signal(xfsz).inspect_err(|e| tracing::warn!(error = %e, "SIGXFSZ not handled")).ok()
}

/// Every connection and every durable queue (its lock, segments and cursor) holds files open: take
/// as many descriptors as the system allows this process, as memcached and NATS do.
pub(crate) fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(error = %e, "could not raise the open files limit");
        }
    }
}

/// On SIGHUP, reads the configuration file again: users, ACLs, certificates and the limits that
/// can change live are applied; what needs a restart is said (also in `/api/v1/server`).
async fn reload_on_sighup(reloader: petrel_server::Reloader, mut hup: tokio::signal::unix::Signal) {
    while hup.recv().await.is_some() {
        // The reload reads files and may create queues: off the runtime's threads.
        let reloading = reloader.clone();
        let reloaded = tokio::task::spawn_blocking(move || reloading.reload()).await;
        let Ok(reloaded) = reloaded else {
            tracing::error!("the reload stopped on a bug (a panic, above); the configuration in use is unchanged");
            continue;
        };
        match reloaded {
            Ok(summary) => {
                let applied = summary.applied.join(", ");
                tracing::info!(%applied, "configuration reloaded (users, ACLs, certificates and queue settings read again)");
                if !summary.needs_restart.is_empty() {
                    let keys = summary.needs_restart.join(", ");
                    tracing::warn!(%keys, "changed in the configuration file, applied at the next start");
                }
                for failed in &summary.failed {
                    tracing::error!(%failed, "not applied by the reload");
                }
            }
            // Started without a file: damaged queues were looked at again, and nothing failed.
            Err(e) if !reloader.has_file() => tracing::info!("{e}"),
            Err(e) => tracing::error!(error = %e, "reload failed; the previous settings stay"),
        }
    }
}

/// SIGTERM or SIGINT, handled from now on: the returned future ends at the first.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Where the server is and how to reach it. The password comes from the environment variable
/// `PETREL_PASSWORD`, never from the command line (which other users can see).
#[derive(Args)]
pub struct ServerArg {
    /// Server address: HOST or HOST:PORT (the port 22134 when not given), or a Unix socket's
    /// path (unix:PATH, or a path starting with /, ./ or ../); a comma list (A,B,C) is a cluster of
    /// independent servers: offers go to each in turn, reads take from all.
    #[arg(long, env = "PETREL_SERVER", default_value = DEFAULT_NATIVE_ADDR, value_parser = with_default_ports)]
    pub server: String,
    /// Authenticate as this user (password from $PETREL_PASSWORD).
    #[arg(long)]
    pub user: Option<String>,
    /// Speak TLS, trusting the server's certificate if it chains to this CA (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// A client certificate (PEM) for mutual TLS: it names the user. Needs --tls-key and
    /// --tls-ca.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// `--server`'s addresses, each with the native protocol's port if it names none.
fn with_default_ports(list: &str) -> Result<String, String> {
    let port = DEFAULT_NATIVE_ADDR.rsplit(':').next().expect("a default address with a port");
    let with_port = |addr: &str| -> Result<String, String> {
        let addr = addr.trim();
        if addr.is_empty() {
            return Err("an empty address".into());
        }
        if petrel_client::unix_socket_path(addr).is_some() {
            return Ok(addr.to_owned());
        }
        if addr.parse::<std::net::Ipv6Addr>().is_ok() {
            return Ok(format!("[{addr}]:{port}"));
        }
        // A port: after the last ':' of a name or IPv4 address, or after an IPv6 literal's ']'.
        let has_port = match addr.rsplit_once(':') {
            Some((host, _)) => !host.is_empty() && (addr.starts_with('[') == host.ends_with(']')),
            None => false,
        };
        Ok(if has_port { addr.to_owned() } else { format!("{addr}:{port}") })
    };
    Ok(list.split(',').map(with_port).collect::<Result<Vec<_>, _>>()?.join(","))
}

impl ServerArg {
    pub fn options(&self) -> Result<ClientOptions, String> {
        let password =
            match &self.user {
                Some(user) => Some(std::env::var("PETREL_PASSWORD").map_err(|_| {
                    format!("--user {user}: set the password in the environment variable PETREL_PASSWORD")
                })?),
                None => None,
            };
        let tls = self.tls_ca.as_ref().map(|ca| TlsOptions {
            ca: ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            server_name: None,
        });
        Ok(ClientOptions { user: self.user.clone(), password, tls, ..ClientOptions::default() })
    }

    /// A blocking client connected (and authenticated) as these flags say.
    pub fn connect(&self) -> Result<Client, Box<dyn std::error::Error>> {
        if self.is_cluster() {
            return Err(format!("--server {}: this command takes one server", self.server).into());
        }
        let client = Client::connect_with(&self.server, &self.options()?)?;
        // (A client certificate that logged the connection in clears the flag too.)
        if let Some(user) = &self.user
            && self.tls_cert.is_none()
            && !client.auth_required()
        {
            eprintln!("petrel: {} has authentication off: --user {user} was not checked", self.server);
        }
        if self.tls_cert.is_some() && self.user.is_none() && client.auth_required() {
            // A certificate it verified would have logged the connection in.
            eprintln!(
                "petrel: {} did not take the client certificate as a login (its [security] tls_client_ca must be the CA that signed it, and the certificate's name a user)",
                self.server
            );
        }
        Ok(client)
    }

    /// `--server` lists more than one server.
    pub fn is_cluster(&self) -> bool {
        self.server.contains(',')
    }

    /// The server, or the cluster `--server` lists.
    pub fn target(&self) -> Result<Target, Box<dyn std::error::Error>> {
        if !self.is_cluster() {
            return Ok(Target::One(self.connect()?));
        }
        Ok(Target::Many(petrel_client::blocking::Cluster::connect(&self.servers(), self.cluster_options()?)?))
    }

    /// The addresses `--server` lists.
    pub fn servers(&self) -> Vec<&str> {
        self.server.split(',').collect()
    }

    /// The cluster client's defaults with these flags' TLS and credentials.
    pub fn cluster_options(&self) -> Result<petrel_client::ClusterOptions, String> {
        let defaults = petrel_client::ClusterOptions::default();
        let client = ClientOptions { connect_timeout: defaults.client.connect_timeout, ..self.options()? };
        Ok(petrel_client::ClusterOptions { client, ..defaults })
    }

    /// A connection for reading that comes back when the server does: each loss and return is
    /// said on stderr; the pause between attempts doubles from 100 ms up to 5 s.
    pub fn follower(&self) -> Result<Follower, Box<dyn std::error::Error>> {
        let server = self.server.clone();
        let on_event = move |event: ConnectionEvent<'_>| match event {
            ConnectionEvent::Lost { error, .. } => {
                eprintln!("petrel: lost the connection to {server} ({error}); reconnecting")
            }
            ConnectionEvent::Connected { .. } => eprintln!("petrel: connected to {server} again"),
        };
        let reconnect = Reconnect { on_event: Some(std::sync::Arc::new(on_event)), ..Reconnect::default() };
        Ok(Follower::connect(&self.server, self.options()?, reconnect)?)
    }
}

#[derive(Args)]
pub struct ProduceArgs {
    /// The queue's name.
    queue: String,
    #[command(flatten)]
    server: ServerArg,
    /// Create the queue if it does not exist, on disk as `petrel queue create` makes it
    /// (without it or --durable, a queue that does not exist is an error: a typo creates
    /// nothing).
    #[arg(long)]
    create: bool,
    /// As --create, and an existing queue that is in memory only is an error.
    #[arg(long)]
    durable: bool,
    /// How long to wait for room in a full bounded queue, e.g. "10s" (said on stderr meanwhile).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// The messages' priority (in a queue with priority levels; higher is more urgent).
    #[arg(long, default_value_t = 0)]
    priority: u8,
    /// Idempotency keys: line N gets the key KEY:N, so that running the same command on the same
    /// input again stores no line twice (within the queue's dedup window).
    #[arg(long)]
    key: Option<String>,
    /// Hand the messages out no earlier than this long after the server takes them, e.g.
    /// "30s", "250ms" (whole ms, at most 49 days).
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
}

/// Offers each stdin line as a message; lines already waiting go as one batch. A bounded queue
/// takes what fits; the rest waits for room (up to --timeout) as consumers take messages.
pub fn produce(args: ProduceArgs) -> Res {
    let client = args.server.target()?;
    if args.durable || args.priority > 0 {
        let statuses = match &client {
            Target::One(c) => vec![c.queue_status(&args.queue)],
            Target::Many(c) => c.queue_status(&args.queue).into_iter().map(|(_, s)| s).collect(),
        };
        let mut warned = false;
        for status in statuses {
            match status {
                Ok(s) if args.durable && !s.config.durable => {
                    return Err(
                        format!("queue {} exists in memory: --durable cannot make it durable", args.queue).into()
                    );
                }
                Ok(s) if args.priority > 0 && s.config.priorities < 2 && !std::mem::replace(&mut warned, true) => {
                    eprintln!(
                        "petrel: queue {} has no priority levels: --priority is ignored (a queue made with --priorities N has them)",
                        args.queue
                    );
                }
                Ok(_) | Err(ClientError::Status { status: Status::QueueNotFound, .. }) => {}
                // A cluster's server that is down now: it is tried again as the offers go.
                Err(ClientError::Unavailable(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let delay_ms = match args.delay {
        Some(d) if d.as_millis() > u128::from(u32::MAX) => return Err("--delay: at most 49 days".into()),
        Some(d) => d.as_millis() as u32,
        None => 0,
    };
    let mut input = crate::lines::StdinLines::new(1024);
    let mut lines = Vec::new();
    let (mut sent, mut repeats) = (0u64, 0u64);
    loop {
        input.next_batch(&mut lines)?;
        if lines.is_empty() {
            break;
        }
        let batch: Vec<Message> = lines
            .drain(..)
            .enumerate()
            .map(|(i, line)| Message {
                priority: args.priority,
                delay_ms,
                idempotency_key: args
                    .key
                    .as_ref()
                    .map(|k| format!("{k}:{}", sent + i as u64 + 1).into())
                    .unwrap_or_default(),
                ..Message::new(line)
            })
            .collect();
        let n = batch.len() as u64;
        let offered = match offer_all(&client, &args, batch.clone()) {
            Err((0, ClientError::Status { status: Status::QueueNotFound, .. })) if args.create || args.durable => {
                match client.create_queue(&args.queue, QueueConfig { durable: true, ..QueueConfig::default() }) {
                    Ok(()) => {}
                    // A cluster with a server down: made on those up, where the lines go.
                    Err(e @ ClientError::Unavailable(_)) => eprintln!("petrel: warning: {e}"),
                    Err(e) => return Err(e.into()),
                }
                offer_all(&client, &args, batch)
            }
            Err((0, ClientError::Status { status: Status::QueueNotFound, .. })) => {
                return Err(format!(
                    "no queue named {:?}: create it (petrel queue create, or produce --create / --durable)",
                    args.queue
                )
                .into());
            }
            other => other,
        };
        match offered {
            Ok(repeated) => repeats += repeated,
            Err((accepted, e)) => {
                // Say what is stored, so that a rerun does not offer it again; an offer whose
                // answer was lost with its connection may have been stored too.
                let stored = sent + accepted;
                if stored > 0 {
                    eprintln!(
                        "{} offered to {} (the first {stored} lines) before line {} failed",
                        crate::output::count(stored, "message"),
                        args.queue,
                        stored + 1
                    );
                }
                if e.is_connection_lost() {
                    eprintln!(
                        "petrel: the connection was lost before the answer to lines {} to {}: they may be stored \
                         too{}",
                        stored + 1,
                        sent + n,
                        match &args.key {
                            Some(_) => " (a rerun with the same --key stores none of them twice)",
                            None => "",
                        }
                    );
                }
                return Err(e.into());
            }
        }
        sent += n;
    }
    match repeats {
        0 => eprintln!("{} offered to {}", crate::output::count(sent, "message"), args.queue),
        _ => eprintln!(
            "{} offered to {}: {} stored, {repeats} not stored again (their keys were offered before)",
            crate::output::count(sent, "message"),
            args.queue,
            sent - repeats
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// Offers `batch`: as one request, or, if the queue can never hold so many at once, one message
/// at a time. An error comes with how many of the batch were stored before it (in order).
/// Returns how many were repeats of keys the queue remembers (not stored again).
fn offer_all(client: &Target, args: &ProduceArgs, batch: Vec<Message>) -> Result<u64, (u64, ClientError)> {
    match offer_waiting(client, args, batch.clone()) {
        Err(ClientError::Status { status: Status::TooLarge, .. }) if batch.len() > 1 => {
            let mut repeats = 0;
            for (stored, m) in batch.into_iter().enumerate() {
                repeats += u64::from(offer_waiting(client, args, vec![m]).map_err(|e| (stored as u64, e))?);
            }
            Ok(repeats)
        }
        other => other.map(u64::from).map_err(|e| (0, e)),
    }
}

/// Offers `batch`; if the queue is full, says so on stderr and waits up to --timeout for room.
/// Returns how many were repeats.
fn offer_waiting(client: &Target, args: &ProduceArgs, batch: Vec<Message>) -> Result<u32, ClientError> {
    // Keyed lines go where the same command's went before (`--key` names the run).
    let route = args.key.as_deref();
    match client.offer(&args.queue, batch.clone(), None, route) {
        Err(ClientError::Status { status: Status::QueueFull, .. }) => {
            eprintln!(
                "petrel: queue {} is full; waiting up to {} for a consumer to make room",
                args.queue,
                humantime::format_duration(args.timeout)
            );
            client.offer(&args.queue, batch, Some(args.timeout), route)
        }
        other => other,
    }
}

#[derive(Args)]
pub struct ConsumeArgs {
    /// The queue's name.
    queue: String,
    #[command(flatten)]
    server: ServerArg,
    /// The default (kept so that scripts which say it go on working): messages are taken
    /// tentatively and acknowledged once written to stdout.
    #[arg(long, hide = true)]
    ack: bool,
    /// Stop after this many messages.
    #[arg(long)]
    count: Option<u64>,
    /// Keep waiting for messages instead of stopping when the queue is empty.
    #[arg(long)]
    follow: bool,
    /// When the queue is empty, wait this long for a message before stopping (e.g. 5s, 500ms;
    /// default: stop at once).
    #[arg(long, visible_alias = "timeout", value_parser = humantime::parse_duration, conflicts_with = "follow")]
    wait: Option<Duration>,
    /// One JSON object per message, with every field (payload and headers in base64, as
    /// `petrel log dump --json` prints them).
    #[arg(long)]
    json: bool,
}

/// How long `consume` holds what it took before acknowledging it (once written). Long, for a
/// slow reader downstream: a consumer that stops holds its messages no longer than its
/// connection, which a stop or a crash ends (they then go back at once).
const CONSUME_VISIBILITY: Duration = Duration::from_secs(600);
/// `consume` acknowledges what it wrote as it goes once a batch is this old, and writes no more
/// of it once it is `STOP_WRITING_AT` old: far enough from the visibility's end for a write that
/// waits on the reader downstream, and for a cluster's deliveries, which may reach it up to half
/// the visibility old (fetched ahead from one server, `Cluster::poll`).
const ACK_AS_WRITTEN_AT: Duration = Duration::from_secs(150);
const STOP_WRITING_AT: Duration = Duration::from_secs(225);
/// The most `consume` takes at a time; fewer once the reader downstream is slow (each batch
/// what it took in `BATCH_TIME`).
const MAX_CONSUME_BATCH: u64 = 256;
const BATCH_TIME: Duration = Duration::from_secs(75);

/// Acknowledges `written`; says on stderr what was held too long to be (it comes again).
/// `false`: not all of them were, and the batch's rest is back in the queue too.
fn acknowledge(reader: &mut Reader, queue: &str, written: &[Taken]) -> Result<bool, ClientError> {
    if written.is_empty() {
        return Ok(true);
    }
    let handles: Vec<Handle> = written.iter().map(|d| d.handle).collect();
    let acked = reader.ack(queue, &handles)? as usize;
    if acked < handles.len() {
        // Held past their visibility, or their connection lost: back in the queue, they will be
        // handed out again.
        eprintln!(
            "petrel: {} of {} messages written were not acknowledged (held past {} s, or their connection lost) and will be handed out again",
            handles.len() - acked,
            handles.len(),
            CONSUME_VISIBILITY.as_secs()
        );
    }
    Ok(acked == handles.len())
}

pub fn consume(args: ConsumeArgs) -> Res {
    // Following, a lost server is waited for (what the lost connection had taken tentatively
    // went back to the queue, so polling again elsewhere loses nothing); otherwise it ends.
    // A cluster follows on its own: a server that goes away is tried again in the background
    // while the others are read.
    let mut reader = match args.follow && !args.server.is_cluster() {
        true => Reader::Following(Box::new(args.server.follower()?)),
        false => Reader::Once(args.server.target()?),
    };
    let mut unavailable = false;
    let mut left = args.count.unwrap_or(u64::MAX);
    // Read until nothing came (not until `--count` was reached).
    let mut drained = false;
    let stdout = io::stdout();
    let mut out = stdout.lock();
    // With --wait: since the last message came (or the start), in polls of a second at most.
    let mut last_came = std::time::Instant::now();
    let mut batch = MAX_CONSUME_BATCH;
    while left > 0 {
        let waited = last_came.elapsed();
        let timeout = match (args.follow, args.wait) {
            (true, _) => Duration::from_secs(1),
            (false, Some(wait)) => wait.saturating_sub(waited).min(Duration::from_secs(1)),
            (false, None) => Duration::ZERO,
        };
        // Taken tentatively, and acknowledged once written: what a failed write (a closed pipe, a
        // full disk) or a lost connection leaves unwritten goes back to the queue. Written means
        // written to stdout: what a reader downstream never reads (`| head -1`) is acknowledged
        // too, so bound the take with --count there.
        let options = PollOptions { max: left.min(batch) as u32, timeout, visibility: Some(CONSUME_VISIBILITY) };
        let deliveries = match reader.poll(&args.queue, options) {
            Err(ClientError::Unavailable(why)) if args.follow => {
                if !std::mem::replace(&mut unavailable, true) {
                    eprintln!("petrel: {why}; waiting");
                }
                continue;
            }
            other => other?,
        };
        let taken_at = std::time::Instant::now();
        if std::mem::replace(&mut unavailable, false) {
            eprintln!("petrel: a server is back");
        }
        if deliveries.is_empty() {
            if args.follow || args.wait.is_some_and(|wait| last_came.elapsed() < wait) {
                continue;
            }
            drained = true;
            break;
        }
        last_came = std::time::Instant::now();
        // A reader downstream slow to take the batch: what is written is acknowledged as it
        // goes once the batch is `ACK_AS_WRITTEN_AT` old, and what is not written by
        // `STOP_WRITING_AT` is given back unseen (its delivery not counted), never printed twice.
        let (mut written, mut acked, mut held) = (0, 0, true);
        // Whether the failure (if any) came while a message was being written.
        let mut writing = false;
        let wrote = (|| -> std::io::Result<()> {
            for d in &deliveries {
                if !held || taken_at.elapsed() > STOP_WRITING_AT {
                    break;
                }
                writing = true;
                if args.json {
                    writeln!(out, "{}", crate::output::message_json(&d.message))?;
                } else {
                    out.write_all(&d.message.payload)?;
                    out.write_all(b"\n")?;
                }
                written += 1;
                writing = false;
                if taken_at.elapsed() > ACK_AS_WRITTEN_AT {
                    out.flush()?;
                    held = acknowledge(&mut reader, &args.queue, &deliveries[acked..written])
                        .map_err(std::io::Error::other)?;
                    acked = written;
                }
            }
            out.flush()
        })();
        if let Err(e) = wrote {
            // Stdout is written a line at a time: the messages before the failed one are out,
            // and acknowledged (as written ones are); those after it never began: they go back
            // unseen, their delivery not counted (with max_deliveries, they went to the
            // dead-letter queue unprinted). So does the one being written if the pipe is closed
            // (its reader is gone, and never read it whole); else it may be partly out and goes
            // back as delivered when the connection ends.
            let began = usize::from(writing && e.kind() != io::ErrorKind::BrokenPipe);
            if held {
                let _ = acknowledge(&mut reader, &args.queue, &deliveries[acked..written]);
                let rest: Vec<Handle> = deliveries.iter().skip(written + began).map(|d| d.handle).collect();
                if !rest.is_empty() {
                    let _ = reader.give_back_unseen(&args.queue, &rest);
                }
            }
            return Err(e.into());
        }
        held = held && acknowledge(&mut reader, &args.queue, &deliveries[acked..written])?;
        if held && written < deliveries.len() {
            let rest: Vec<Handle> = deliveries[written..].iter().map(|d| d.handle).collect();
            reader.give_back_unseen(&args.queue, &rest)?;
        }
        left -= written as u64;
        // The next batch what the reader downstream took in `BATCH_TIME` at this one's pace.
        let took = taken_at.elapsed().as_secs_f64().max(0.001);
        let paced = (written as f64 * BATCH_TIME.as_secs_f64() / took) as u64;
        batch = paced.clamp(1, MAX_CONSUME_BATCH);
    }
    // A cluster read to its end with servers down read only the others: said, and in the exit
    // status, so that a script draining a queue does not take it for empty.
    if let Reader::Once(target) = &reader
        && drained
    {
        let down = target.servers_down();
        if !down.is_empty() {
            eprintln!("petrel: not read, servers down: {}", down.join("; "));
            return Ok(ExitCode::from(3));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `consume`'s connection: one that ends with the server (or a cluster), or one that follows
/// its server.
enum Reader {
    Once(Target),
    Following(Box<Follower>),
}

impl Reader {
    fn poll(&mut self, queue: &str, options: PollOptions) -> Result<Vec<Taken>, ClientError> {
        match self {
            Reader::Once(target) => target.poll(queue, options),
            Reader::Following(follower) => Ok(follower
                .poll(queue, options)?
                .into_iter()
                .map(|d| Taken { handle: Handle::One(d.handle), message: d.message })
                .collect()),
        }
    }

    fn ack(&mut self, queue: &str, handles: &[Handle]) -> Result<u32, ClientError> {
        match self {
            Reader::Once(target) => target.ack(queue, handles),
            Reader::Following(follower) => follower.ack(queue, &crate::target::single_ids(handles)),
        }
    }

    fn give_back_unseen(&mut self, queue: &str, handles: &[Handle]) -> Result<u32, ClientError> {
        match self {
            Reader::Once(target) => target.give_back_unseen(queue, handles),
            Reader::Following(follower) => follower.give_back_unseen(queue, &crate::target::single_ids(handles)),
        }
    }
}

#[derive(Subcommand)]
pub enum QueueCommand {
    /// Create a queue (no-op if it exists with the same configuration).
    Create {
        /// The queue's name.
        name: String,
        #[command(flatten)]
        server: ServerArg,
        /// Keep the queue in memory only: faster, but it keeps nothing across a restart.
        /// Without it the queue's messages are kept on disk (a log), as a queue made by first
        /// use or a `[queues.NAME]` block is.
        #[arg(long, conflicts_with_all = ["durable", "durability"])]
        in_memory: bool,
        /// On disk: the default (kept so that scripts which say it go on working).
        #[arg(long, hide = true)]
        durable: bool,
        /// The queue is full at this many messages (0: no limit).
        #[arg(long, default_value_t = 0)]
        max_items: u64,
        /// The queue is full at this many bytes of payload, headers and text fields (0: no limit;
        /// a queue in memory then has the server's memory_queue_max_bytes).
        #[arg(long, default_value_t = 0)]
        max_bytes: u64,
        /// When full, drop the oldest message instead of refusing new ones.
        #[arg(long)]
        circular: bool,
        /// Messages expire this many ms after they are offered (0: never), moving to
        /// --dead-letter if given.
        #[arg(long, default_value_t = 0)]
        ttl_ms: u64,
        /// Where expired messages go, and those at --max-deliveries (a queue; not this one).
        #[arg(long, default_value = "", hide_default_value = true)]
        dead_letter: String,
        /// Refuse messages bigger than this (0: the server's limit only).
        #[arg(long, default_value_t = 0)]
        max_item_bytes: u64,
        /// When its log reaches the disk: none, always, interval:MS (default: the server's
        /// policy).
        #[arg(long, default_value = "", hide_default_value = true)]
        durability: String,
        /// A message handed out this many times that comes back again goes to --dead-letter
        /// (0: no limit).
        #[arg(long, default_value_t = 0)]
        max_deliveries: u32,
        /// Priority levels, 2–10 (0: none): polls take the highest level first.
        #[arg(long, default_value_t = 0)]
        priorities: u8,
        /// With --priorities: the percentage of takes (1–50) that go to lower levels while they
        /// wait (0: 10).
        #[arg(long, default_value_t = 0)]
        priority_share: u8,
        /// Idempotency keys remembered at most (0: 100,000).
        #[arg(long, default_value_t = 0)]
        dedup_window: u32,
        /// How long an idempotency key is remembered, ms (0: 120,000).
        #[arg(long, default_value_t = 0)]
        dedup_window_ms: u64,
        /// A message that comes back (aborted, timed out, its consumer gone) is handed out again
        /// no earlier than this many ms later (0: at once).
        #[arg(long, default_value_t = 0)]
        redelivery_delay_ms: u32,
        /// With --redelivery-delay-ms: double the delay at each further return, up to this many
        /// ms (0: the delay does not grow).
        #[arg(long, default_value_t = 0)]
        redelivery_delay_max_ms: u32,
    },
    /// List the queues (those this user may use).
    List {
        #[command(flatten)]
        server: ServerArg,
    },
    /// Remove a queue and every message in it.
    Remove {
        /// The queue's name.
        name: String,
        #[command(flatten)]
        server: ServerArg,
    },
    /// Show a queue's figures and configuration.
    Status {
        /// The queue's name.
        name: String,
        #[command(flatten)]
        server: ServerArg,
    },
}

pub fn queue(cmd: QueueCommand) -> Res {
    match cmd {
        QueueCommand::Create {
            name,
            server,
            in_memory,
            durable: _,
            max_items,
            max_bytes,
            circular,
            ttl_ms,
            dead_letter,
            max_item_bytes,
            durability,
            max_deliveries,
            priorities,
            priority_share,
            dedup_window,
            dedup_window_ms,
            redelivery_delay_ms,
            redelivery_delay_max_ms,
        } => {
            let config = QueueConfig {
                max_items,
                max_bytes,
                circular,
                durable: !in_memory,
                temporary: false,
                ttl_ms,
                dead_letter,
                max_item_bytes,
                durability,
                max_deliveries,
                priorities,
                priority_share,
                dedup_window,
                dedup_window_ms,
                redelivery_delay_ms,
                redelivery_delay_max_ms,
            };
            server.target()?.create_queue(&name, config)?;
        }
        QueueCommand::List { server } => {
            let target = server.target()?;
            for name in target.list_queues()? {
                println!("{name}");
            }
            if let Some(partial) = target.partial_listing() {
                return Ok(partial);
            }
        }
        QueueCommand::Remove { name, server } => server.target()?.remove_queue(&name)?,
        QueueCommand::Status { name, server } => {
            let s = server.target()?.queue_status(&name)?;
            println!("{}", serde_json::to_string_pretty(&s)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_server_without_a_port_gets_the_native_one() {
        let ports = |s| super::with_default_ports(s).unwrap();
        assert_eq!(ports("localhost"), "localhost:22134");
        assert_eq!(ports("db1:9000,db2"), "db1:9000,db2:22134");
        assert_eq!(ports("10.0.0.7"), "10.0.0.7:22134");
        assert_eq!(ports("[::1]"), "[::1]:22134");
        assert_eq!(ports("[::1]:7000"), "[::1]:7000");
        assert_eq!(ports("::1"), "[::1]:22134");
        assert!(super::with_default_ports("a,,b").is_err());
    }
}
