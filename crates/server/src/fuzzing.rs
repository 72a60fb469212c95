//! A harness for fuzzing the native protocol's request handler end to end: bytes into a real
//! connection (`native::serve`) over a real broker with users and ACLs, as an anonymous client,
//! an ordinary user or an admin. Not part of the API; used by `fuzz/fuzz_targets/handler.rs`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{Config, Ctx, Server, auth};

pub struct Harness {
    rt: tokio::runtime::Runtime,
    ctx: Arc<Ctx>,
    dir: PathBuf,
    runs: AtomicU64,
}

/// Every this many runs, the queues and topics the inputs made are removed (bounded disk).
const CLEAR_EVERY: u64 = 500;

/// A harness's directory is this, its process id, `-` and its number in the process.
const DIR_PREFIX: &str = "petrel-fuzz-handler-";

/// Removes the directories of harnesses whose process is gone: libFuzzer ends a run with
/// `exit`, which runs no destructor, so each run's directory stays behind (Linux only, where
/// `/proc` says which processes live).
fn remove_dirs_of_ended_harnesses() {
    if !std::path::Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else { continue };
        let pid = rest.split_once('-').map_or(rest, |(pid, _)| pid);
        if pid.parse::<u32>().is_ok() && !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Harness {
    /// What the harness's server shares with its connections, for tests of the crate.
    #[cfg(test)]
    pub(crate) fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    pub fn new() -> Harness {
        remove_dirs_of_ended_harnesses();
        static HARNESSES: AtomicU64 = AtomicU64::new(0);
        let n = HARNESSES.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let mut users = petrel_broker::security::Users::default();
        users.add("tom", "tom's password", petrel_broker::security::Role::User).expect("a user");
        users.add("max", "max's password", petrel_broker::security::Role::Admin).expect("an admin");
        let users_file = dir.join("users.toml");
        users.save(&users_file).expect("the users file");
        let config = format!(
            r#"
            data = {data:?}
            native_addr = "127.0.0.1:0"
            memcache_addr = "off"
            http_addr = "off"
            shutdown_grace = "10ms"
            max_in_flight_per_connection = 16
            [security]
            users_file = {users_file:?}
            allow_plaintext_auth = true
            # One password check a minute: AUTH frames are fuzzed at full speed (refused by the
            # rate limit) instead of at Argon2's pace.
            auth_attempts_per_minute = 1
            auth_failure_delay = "0s"
            max_queues_per_user = 64
            [[security.acl]]
            kind = "queue"
            name = "secret*"
            user = "tom"
            access = "deny"
            [[security.acl]]
            kind = "function"
            name = "*"
            user = "tom"
            access = "exec-serve"
            "#,
            data = dir.join("data"),
        );
        let config: Config = toml::from_str(&config).expect("the harness's configuration");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime");
        let server = rt.block_on(Server::bind(config)).expect("a server");
        Harness { rt, ctx: Arc::clone(&server.ctx), dir, runs: AtomicU64::new(0) }
    }

    /// Feeds `input` to a new connection: its first byte says who the client is (0 anonymous,
    /// 1 the ordinary user, 2 the admin, by client certificate), the rest is what it sends. The
    /// server's answers are read and dropped; returns once the connection has ended.
    pub fn run(&self, input: &[u8]) {
        let Some((&who, bytes)) = input.split_first() else { return };
        let certificate_user = match who % 3 {
            0 => None,
            1 => Some("tom".to_owned()),
            _ => Some("max".to_owned()),
        };
        let peer = auth::Peer::tcp(([127, 0, 0, 1], 1).into(), false, certificate_user);
        let runs = self.runs.fetch_add(1, Ordering::Relaxed);
        let ctx = Arc::clone(&self.ctx);
        self.rt.block_on(async move {
            let (client, server) = tokio::io::duplex(64 * 1024);
            let (_stop_tx, stop) = tokio::sync::watch::channel(false);
            let conn = runs + 1;
            let serving = tokio::spawn(crate::native::serve(
                server,
                Arc::clone(&ctx),
                conn,
                stop,
                peer,
                ctx.handshake_deadline(),
            ));
            let (mut rd, mut wr) = tokio::io::split(client);
            let draining = tokio::spawn(async move {
                let mut sink = vec![0u8; 64 * 1024];
                while rd.read(&mut sink).await.is_ok_and(|n| n > 0) {}
            });
            let _ = wr.write_all(bytes).await;
            let _ = wr.shutdown().await;
            match tokio::time::timeout(Duration::from_secs(10), serving).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Ok(Err(e)) => panic!("the connection task failed: {e}"),
                Err(_) => panic!("the connection did not end within 10 s of its input"),
            }
            draining.abort();
            if runs % CLEAR_EVERY == CLEAR_EVERY - 1 {
                for name in ctx.broker.queue_names() {
                    let _ = ctx.broker.remove_queue(&name);
                }
                for name in ctx.broker.topic_names() {
                    let _ = ctx.broker.remove_topic(&name);
                }
            }
        });
    }
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use petrel_proto::{Message, QueueConfig, Request};

    use super::Harness;

    #[test]
    fn a_new_harness_removes_what_harnesses_that_ended_left_and_keeps_live_ones() {
        // No process has either id (pids stop at 2^22), nor is one the live parent of this test.
        let dead = std::env::temp_dir().join(format!("{}{}-0", super::DIR_PREFIX, u32::MAX));
        let live = std::env::temp_dir().join(format!("{}{}-0", super::DIR_PREFIX, std::os::unix::process::parent_id()));
        let other = std::env::temp_dir().join(format!("{}not-a-pid", super::DIR_PREFIX));
        for dir in [&dead, &live, &other] {
            // Another test's harness, starting meanwhile, may remove `dead` as it is being made.
            let made = (0..100).any(|_| std::fs::create_dir_all(dir.join("data")).is_ok());
            assert!(made, "{dir:?}");
        }
        let harness = Harness::new();
        assert!(!dead.exists(), "the directory of a process that is gone is removed");
        assert!(live.exists() && other.exists(), "a live process's directory, and a name without a pid, stay");
        drop(harness);
        for dir in [&live, &other] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    #[test]
    fn the_harness_serves_every_kind_of_client_and_ends_each_connection() {
        let harness = Harness::new();
        let requests = [
            Request::Hello { client: "fuzz".into(), features: 0 },
            Request::Auth { user: "tom".into(), password: "wrong".into() },
            Request::QueueCreate { name: "q".into(), config: Box::default() },
            Request::QueueCreate {
                name: "t".into(),
                config: Box::new(QueueConfig { temporary: true, ..QueueConfig::default() }),
            },
            Request::Offer { queue: "q".into(), timeout_ms: 0, messages: vec![Message::new(&b"m"[..])] },
            Request::Poll { queue: "q".into(), max: u32::MAX, timeout_ms: 50, visibility_ms: 1000 },
            Request::QueueStatus { name: "é".repeat(32_767) + "a" },
            Request::Offer { queue: "secret.q".into(), timeout_ms: 0, messages: vec![] },
            Request::Call { function: "f".into(), timeout_ms: 10, oneway: false, message: Box::default() },
            Request::QueueList,
        ];
        let mut bytes = Vec::new();
        for (id, r) in requests.iter().enumerate() {
            r.encode(id as u64, &mut bytes).unwrap();
        }
        for who in 0..3u8 {
            harness.run(&[who]);
            harness.run(&[&[who][..], &bytes].concat());
            harness.run(&[&[who][..], &bytes[..bytes.len() / 2]].concat());
        }
    }
}
