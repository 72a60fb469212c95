//! The real `petrel serve`, started on free loopback ports for a test and killed with it.

#![allow(dead_code)] // each test file uses its part

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

/// Runs `petrel ARGS` with `stdin`, to its end. (A command that refuses before reading stdin
/// may be gone already: a broken pipe there is fine.)
pub fn petrel(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Written from a thread of its own while the output is read: a command that writes much
    // before it has read all its input (`log append` prints each offset) would otherwise fill
    // its output pipe while this waited to write the rest of the input.
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    let writer = std::thread::spawn(move || drop(input.write_all(&stdin)));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    out
}

pub struct Server {
    pub child: Child,
    /// The native protocol's address.
    pub addr: String,
    pub memcache: String,
    /// The HTTP listener's address (metrics, health checks).
    pub http: String,
}

impl Server {
    pub fn start(data: &Path) -> Server {
        Server::start_with(data, &[])
    }

    /// Starts with more flags; returns once the server printed its listeners.
    pub fn start_with(data: &Path, args: &[&str]) -> Server {
        Server::start_under(&[], data, args)
    }

    /// Starts as an argument of `wrapper` (e.g. `prlimit --nofile=64 --`), with more flags.
    pub fn start_under(wrapper: &[&str], data: &Path, args: &[&str]) -> Server {
        Server::spawn(wrapper, "127.0.0.1:0", data, args)
    }

    /// Starts with its native listener on `addr` (to start again on the same address).
    pub fn start_at(addr: &str, data: &Path) -> Server {
        Server::spawn(&[], addr, data, &[])
    }

    /// `start_at`, with more flags.
    #[allow(dead_code)] // not every test file uses it
    pub fn start_at_with(addr: &str, data: &Path, args: &[&str]) -> Server {
        Server::spawn(&[], addr, data, args)
    }

    /// Starts with more flags, its log (at `info`) written to `log`.
    #[allow(dead_code)]
    pub fn start_logged(data: &Path, args: &[&str], log: &Path) -> Server {
        Server::spawn_logging(&[], "127.0.0.1:0", data, args, Some(log))
    }

    fn spawn(wrapper: &[&str], native_addr: &str, data: &Path, args: &[&str]) -> Server {
        Server::spawn_logging(wrapper, native_addr, data, args, None)
    }

    fn spawn_logging(wrapper: &[&str], native_addr: &str, data: &Path, args: &[&str], log: Option<&Path>) -> Server {
        // PETREL_BIN: another build of the server (a release one, to measure it).
        let petrel = std::env::var("PETREL_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_petrel").to_owned());
        let petrel = petrel.as_str();
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(petrel);
                c
            }
            None => Command::new(petrel),
        };
        let mut child = command
            .args([
                "serve",
                "--native-addr",
                native_addr,
                "--memcache-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
            ])
            .arg("--data")
            .arg(data)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(match log {
                Some(path) => Stdio::from(std::fs::File::create(path).expect("the log file")),
                None => Stdio::null(),
            })
            .envs(log.map(|_| ("RUST_LOG", "info")))
            .spawn()
            .expect("start petrel serve");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut next = |kind: &str| {
            // (A Unix socket's line, when one is asked for, is passed over: its path is known.)
            let line =
                lines.find(|l| l.as_ref().map_or(true, |l| !l.starts_with("unix "))).expect("a listener line").unwrap();
            line.strip_prefix(kind).unwrap_or_else(|| panic!("expected {kind:?}, got {line:?}")).trim().to_owned()
        };
        let addr = next("native ");
        let memcache = next("memcache ");
        let http = next("http ");
        Server { child, addr, memcache, http }
    }

    pub async fn client(&self) -> petrel_client::Client {
        petrel_client::Client::connect(self.addr.as_str()).await.unwrap()
    }

    /// A free loopback address for `start_at`.
    /// A free address to start a server at (and again after it stops), below the range the
    /// kernel picks outgoing ports from: while the server is down, a port from that range may be
    /// taken by another socket, or a client reconnecting to it may be given it as its own port
    /// and connect to itself.
    pub fn free_addr() -> String {
        let first = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
            .unwrap_or(32768);
        let span = u32::from(first.saturating_sub(10_000));
        if span < 100 {
            // An unusual range: take what the kernel gives.
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            return listener.local_addr().unwrap().to_string();
        }
        // From a place of its own (tests start servers at once), then each port in turn.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let start = nanos.wrapping_add(std::process::id().wrapping_mul(7_919)) % span;
        for i in 0..span {
            let port = 10_000 + ((start + i) % span) as u16;
            if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                return listener.local_addr().unwrap().to_string();
            }
        }
        panic!("no free port between 10000 and {first}")
    }

    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn terminate(mut self) -> std::process::ExitStatus {
        Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        self.child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `done` holds, checking every few milliseconds; fails the test, saying `what`,
/// after 10 s. For a test that must wait on something it can observe instead of sleeping.
#[allow(dead_code)]
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "waited 10 s for {what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// `wait_until` for async conditions.
#[allow(dead_code)]
pub async fn wait_until_async<F: std::future::Future<Output = bool>>(what: &str, mut done: impl FnMut() -> F) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done().await {
        assert!(std::time::Instant::now() < deadline, "waited 10 s for {what}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Writes one request frame; returns its bytes for a test that sends them in parts.
pub fn request_frame(request: &petrel_proto::Request, id: u64) -> Vec<u8> {
    let mut out = Vec::new();
    request.encode(id, &mut out).unwrap();
    out
}

/// Reads one response frame: its request id and what it says.
pub fn read_response(conn: &mut impl std::io::Read) -> (u64, petrel_proto::Response) {
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).unwrap();
    let mut frame = vec![0u8; u32::from_be_bytes(len) as usize];
    conn.read_exact(&mut frame).unwrap();
    let opcode = u16::from_be_bytes([frame[2], frame[3]]);
    let id = u64::from_be_bytes(frame[4..12].try_into().unwrap());
    let body = bytes::Bytes::copy_from_slice(&frame[12..]);
    (id, petrel_proto::Response::decode(opcode, body).unwrap())
}
