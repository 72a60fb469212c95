//! The command line as a new user meets it: counts in words, JSON with bytes in base64 (the same
//! for `consume --json` and `log dump --json`), how many subscribers a publish reached, server
//! logs without colour codes off a terminal (or as JSON), and `produce` into bounded queues.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::Server;

const PETREL: &str = env!("CARGO_BIN_EXE_petrel");

fn run(args: &[&str], stdin: &str) -> (bool, String, String) {
    let out = common::petrel(args, stdin.as_bytes());
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn counts_in_words_json_in_base64_and_subscribers_reached() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    let (ok, _, err) = run(&["produce", "jobz", "--server", s], "hello\n");
    assert!(!ok && err.contains("no queue named \"jobz\""), "a typo creates nothing: {err}");
    let (ok, _, err) = run(&["produce", "jobs", "--create", "--server", s], "hello\n");
    assert!(ok && err.contains("1 message offered to jobs"), "{err}");
    let (ok, out, _) = run(&["consume", "jobs", "--json", "--server", s], "");
    assert!(ok);
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(json["payload_base64"], "aGVsbG8=", "{out}");
    // $PETREL_SERVER names the server when --server does not.
    let listed = Command::new(PETREL).args(["queue", "list"]).env("PETREL_SERVER", s).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&listed.stdout), "jobs\n", "{}", String::from_utf8_lossy(&listed.stderr));
    // A user named to a server without users is said to be unchecked, not silently taken.
    let unchecked = Command::new(PETREL)
        .args(["queue", "list", "--user", "ann", "--server", s])
        .env("PETREL_PASSWORD", "wrong")
        .output()
        .unwrap();
    assert!(unchecked.status.success());
    assert!(String::from_utf8_lossy(&unchecked.stderr).contains("authentication off: --user ann was not checked"));

    // The same field names and encoding as `log dump --json`.
    let log = dir.path().join("log");
    assert!(run(&["log", "append", log.to_str().unwrap()], "hello\n").0);
    let (_, dumped, _) = run(&["log", "dump", log.to_str().unwrap(), "--json"], "");
    let record: serde_json::Value = serde_json::from_str(dumped.trim()).unwrap();
    assert_eq!(record["payload_base64"], json["payload_base64"]);

    assert!(run(&["topic", "create", "news", "--server", s], "").0);
    let mut subscriber = Command::new(PETREL)
        .args(["topic", "subscribe", "news", "--count", "2", "--server", s])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut reached, mut err) = (false, String::new());
    for _ in 0..100 {
        // Until the subscription is in place, a publish reaches no one.
        let (ok, _, e) = run(&["topic", "publish", "news", "--server", s], "a\n");
        assert!(ok);
        err = e;
        if err.contains("each to 1 live subscriber") {
            reached = true;
            break;
        }
        assert!(err.contains("1 message published to news, each to 0 live subscribers"), "{err}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(reached, "{err}");
    assert!(run(&["topic", "publish", "news", "--server", s], "b\n").0);
    assert!(subscriber.wait().unwrap().success());
    // A durable topic keeps what no one listens to: said so, not only "0 subscribers".
    assert!(run(&["topic", "create", "audit", "--durable", "--server", s], "").0);
    let (ok, _, err) = run(&["topic", "publish", "audit", "--server", s], "a\nb\n");
    assert!(
        ok && err.contains(
            "2 messages published to audit, kept in its log for its consumer groups, each to 0 live subscribers"
        ),
        "{err}"
    );
    // A group reads them with their offsets, which --from takes.
    let (ok, out, _) = run(
        &["topic", "subscribe", "audit", "--group", "g", "--from", "1", "--count", "1", "--json", "--server", s],
        "",
    );
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(ok && json["offset"] == 1 && json["payload_base64"] == "Yg==", "{out}");
}

#[test]
fn server_logs_have_no_colour_codes_off_a_terminal_and_can_be_json() {
    let dir = tempfile::tempdir().unwrap();
    for (format, check) in [("text", 0), ("json", 1)] {
        let mut child = Command::new(PETREL)
            .args([
                "serve",
                "--log-format",
                format,
                "--native-addr",
                "127.0.0.1:0",
                "--memcache-addr",
                "127.0.0.1:0",
                "--http-addr",
                "off",
            ])
            .arg("--data")
            .arg(dir.path().join(format))
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut log = String::new();
        while !log.contains("listening") {
            assert!(stderr.read_line(&mut log).unwrap() > 0, "no listening line: {log}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let listening = log.lines().find(|l| l.contains("listening")).unwrap();
        assert!(!listening.contains('\u{1b}'), "no ANSI escapes: {listening:?}");
        assert!(!listening.contains("Some("), "addresses as addresses: {listening}");
        if check == 1 {
            let v: serde_json::Value = serde_json::from_str(listening).expect("one JSON object a line");
            assert_eq!(v["fields"]["message"], "listening");
        }
    }
}

#[test]
fn queue_subcommands_explain_themselves() {
    for sub in ["list", "remove", "status"] {
        let (ok, out, _) = run(&["queue", "--help"], "");
        assert!(ok);
        let line = out.lines().find(|l| l.trim_start().starts_with(sub)).unwrap();
        assert!(line.split_whitespace().count() > 1, "{sub} has a help text: {line:?}");
    }
}

/// Three lines into a queue of at most two: what fits goes at once, the rest waits for a consumer
/// (said on stderr); with no consumer, the wait ends at --timeout with the reason. A conflicting
/// --durable is an error, not a silent no-op.
#[test]
fn produce_into_a_bounded_queue_takes_what_fits_and_waits_for_room() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    assert!(run(&["queue", "create", "small", "--max-items", "2", "--server", s], "").0);
    let started = std::time::Instant::now();
    let (ok, _, err) = run(&["produce", "small", "--timeout", "1s", "--server", s], "a\nb\nc\n");
    assert!(!ok, "nobody consumes: the third line cannot go");
    assert!(err.contains("is full; waiting up to 1s"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(8), "bounded by --timeout, not 30 s");
    let (_, out, _) = run(&["consume", "small", "--server", s], "");
    assert_eq!(out, "a\nb\n");

    // With a consumer, everything arrives.
    let consumer = Command::new(PETREL)
        .args(["consume", "small", "--follow", "--count", "3", "--server", s])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, _, err) = run(&["produce", "small", "--server", s], "x\ny\nz\n");
    assert!(ok, "{err}");
    let out = consumer.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "x\ny\nz\n");

    // A circular queue offered more than it holds keeps the newest.
    assert!(run(&["queue", "create", "ring", "--max-items", "2", "--circular", "--server", s], "").0);
    assert!(run(&["produce", "ring", "--server", s], "1\n2\n3\n").0);
    assert_eq!(run(&["consume", "ring", "--server", s], "").1, "2\n3\n");

    assert!(run(&["queue", "create", "fast", "--in-memory", "--server", s], "").0);
    let (ok, _, err) = run(&["produce", "fast", "--durable", "--server", s], "d\n");
    assert!(!ok && err.contains("exists in memory"), "{err}");
}

/// `petrel reply` serves a function with a shell command, so `petrel call` can be tried without
/// writing a program.
#[test]
fn reply_serves_a_function_with_a_command() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    let serve = |function: &str, command: &str| {
        let mut child = Command::new(PETREL)
            .args(["reply", function, "--exec", command, "--count", "1", "--server", s])
            .env("PETREL_PASSWORD", "the-server-password")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        err.read_line(&mut line).unwrap();
        assert!(line.starts_with("serving"), "{line}");
        child
    };
    let shout = serve("shout", "tr a-z A-Z");
    let (ok, out, err) = run(&["call", "shout", "--data", "hello", "--server", s], "");
    assert!(ok, "{err}");
    assert_eq!(out, "HELLO\n");
    assert!(exited(shout), "--count 1: done after one call");

    // The handler does not see the password `petrel reply` logs in with.
    let env = serve("env", "env");
    let (ok, out, err) = run(&["call", "env", "--data", "x", "--server", s], "");
    assert!(ok && out.contains("PATH=") && !out.contains("the-server-password"), "{err}");
    assert!(exited(env));

    let failing = serve("fail", "echo oops >&2; exit 3");
    let (ok, _, err) = run(&["call", "fail", "--data", "x", "--server", s], "");
    assert!(!ok && err.contains("HANDLER_ERROR") && err.contains("oops"), "{err}");
    assert!(exited(failing));
}

fn exited(mut child: std::process::Child) -> bool {
    for _ in 0..250 {
        if let Some(status) = child.try_wait().unwrap() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    false
}

/// `consume --follow` and `topic subscribe --group` outlive a server restart: they say so on
/// stderr and reconnect with backoff, then go on where they were.
#[test]
fn followers_reconnect_when_the_server_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let addr = Server::free_addr();
    let server = Server::start_at(&addr, dir.path());
    assert!(run(&["queue", "create", "jobs", "--durable", "--server", &addr], "").0);
    assert!(run(&["topic", "create", "news", "--durable", "--server", &addr], "").0);
    let follower = |args: &[&str]| {
        Command::new(PETREL)
            .args(args)
            .args(["--server", &addr])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let consumer = follower(&["consume", "jobs", "--follow", "--ack", "--count", "2"]);
    let subscriber = follower(&["topic", "subscribe", "news", "--group", "g", "--from", "oldest", "--count", "2"]);
    assert!(run(&["produce", "jobs", "--server", &addr], "one\n").0);
    assert!(run(&["topic", "publish", "news", "--server", &addr], "first\n").0);
    // Killed once both followers have taken and acknowledged the first message (killed before,
    // a follower still connecting would fail, and one acknowledging would get it again).
    let started = std::time::Instant::now();
    loop {
        let (_, queue, _) = run(&["queue", "status", "jobs", "--server", &addr], "");
        let (_, stat, _) = run(&["stat", "--once", "--server", &addr], "");
        let group_lag =
            stat.lines().map(|l| l.split_whitespace().collect::<Vec<_>>()).find(|w| w.first() == Some(&"g"));
        if queue.contains("\"delivered\": 1")
            && queue.contains("\"open_reads\": 0")
            && group_lag.is_some_and(|w| w.get(2) == Some(&"0"))
        {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the followers took nothing:\n{queue}\n{stat}");
        std::thread::sleep(Duration::from_millis(50));
    }
    server.kill9();
    std::thread::sleep(Duration::from_millis(300));
    let server = Server::start_at(&addr, dir.path());
    assert!(run(&["produce", "jobs", "--server", &addr], "two\n").0);
    assert!(run(&["topic", "publish", "news", "--server", &addr], "second\n").0);
    for (child, expected) in [(consumer, "one\ntwo\n"), (subscriber, "first\nsecond\n")] {
        let started = std::time::Instant::now();
        let mut child = child;
        while child.try_wait().unwrap().is_none() {
            assert!(started.elapsed() < Duration::from_secs(20), "still waiting for {expected:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
        assert!(err.contains("reconnecting") && err.contains("connected to"), "{err}");
    }
    server.kill9();
}

/// A listener beyond loopback with authentication off is said loudly at startup.
#[test]
fn listening_beyond_loopback_without_users_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(PETREL)
        .args(["serve", "--native-addr", "0.0.0.0:0", "--memcache-addr", "off", "--http-addr", "off", "--data"])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("WARN") && err.contains("authentication off"), "{err}");
}

/// A produce that stops part way says how many lines it stored, so that a rerun need not offer
/// them again.
#[test]
fn a_produce_that_fails_part_way_says_how_many_lines_are_stored() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    assert!(run(&["queue", "create", "bq", "--max-items", "5", "--server", s], "").0);
    let lines: String = (1..=10).map(|i| format!("{i}\n")).collect();
    let (ok, _, err) = run(&["produce", "bq", "--timeout", "300ms", "--server", s], &lines);
    assert!(!ok);
    assert!(err.contains("5 messages offered to bq (the first 5 lines) before line 6 failed"), "{err}");
}

/// `petrel consume` whose output cannot be written (a reader downstream gone before it wrote)
/// leaves every message in the queue: it takes them tentatively and acknowledges them once
/// written. (Without `--ack` it removed a batch of 256 as it took them, and lost them.)
#[test]
fn a_consume_whose_output_is_closed_leaves_its_messages() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    assert!(run(&["queue", "create", "jobs", "--server", s], "").0);
    let lines: String = (1..=300).map(|i| format!("{i}\n")).collect();
    assert!(run(&["produce", "jobs", "--server", s], &lines).0);
    let mut consumer =
        Command::new(PETREL).args(["consume", "jobs", "--server", s]).stdout(Stdio::piped()).spawn().unwrap();
    drop(consumer.stdout.take()); // nobody reads: its first write fails
    consumer.wait().unwrap();
    // (Its tentative reads come back once the server sees its connection end.)
    common::wait_until("every message back", || {
        let (ok, status, _) = run(&["queue", "status", "jobs", "--server", s], "");
        ok && status.contains("\"messages\": 300")
    });
}

/// A publish that fails part way says how many lines went out, as a produce does (it said only
/// the error, and a rerun published them again).
#[test]
fn a_publish_that_fails_part_way_says_how_many_lines_went_out() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("petrel.toml");
    std::fs::write(&config, "max_message_bytes = 1024\n").unwrap();
    let server = Server::start_with(&dir.path().join("data"), &["--config", config.to_str().unwrap()]);
    let s = server.addr.as_str();
    assert!(run(&["topic", "create", "news", "--server", s], "").0);
    // The first batch of 1,024 lines goes out; the next holds a line too large.
    let mut lines: String = (1..=1024).map(|i| format!("{i}\n")).collect();
    lines.push_str(&"x".repeat(2000));
    lines.push('\n');
    let (ok, _, err) = run(&["topic", "publish", "news", "--server", s], &lines);
    assert!(!ok);
    assert!(err.contains("1024 messages published to news (the first 1024 lines) before line 1025 failed"), "{err}");
}

#[test]
fn a_bench_against_a_server_never_removes_a_queue_that_holds_messages() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    assert!(run(&["produce", "orders", "--create", "--server", s], "keep me\n").0);
    let (ok, _, err) = run(&["bench", "queue", "--server", s, "--queue", "orders", "--count", "100"], "");
    assert!(!ok && err.contains("queue \"orders\" holds 1 message:"), "{err}");
    let (ok, out, _) = run(&["consume", "orders", "--server", s], "");
    assert!(ok && out == "keep me\n", "still there: {out:?}");
    // Empty (as a stopped run leaves its own): replaced, and removed after the run.
    let (ok, _, err) = run(&["bench", "queue", "--server", s, "--queue", "orders", "--count", "100"], "");
    assert!(ok, "{err}");
    let (_, out, _) = run(&["queue", "list", "--server", s], "");
    assert!(!out.contains("orders"), "{out}");
    // A publish bench refuses a topic that exists (it removed it, a durable one's log and its
    // groups' cursors with it).
    assert!(run(&["topic", "create", "events", "--durable", "--server", s], "").0);
    assert!(run(&["topic", "publish", "events", "--server", s], "1\n2\n3\n").0);
    let bench = ["bench", "queue", "--mode", "publish", "--server", s, "--queue", "events", "--count", "10"];
    let (ok, _, err) = run(&bench, "");
    assert!(!ok && err.contains("topic \"events\" exists"), "{err}");
    let (_, out, _) = run(&["topic", "list", "--server", s], "");
    assert!(out.contains("events"), "{out}");
}

#[test]
fn consume_waits_for_a_message_as_long_as_asked_and_queue_settings_that_lose_messages_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    assert!(run(&["queue", "create", "later", "--server", s], "").0);
    let started = std::time::Instant::now();
    let (ok, out, _) = run(&["consume", "later", "--wait", "1500ms", "--server", s], "");
    assert!(ok && out.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(1500), "waited {:?}", started.elapsed());
    let consumer = Command::new(PETREL)
        .args(["consume", "later", "--count", "1", "--timeout", "20s", "--server", s])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(run(&["produce", "later", "--server", s], "came\n").0);
    let out = consumer.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "came\n");
    // Made on disk unless asked otherwise, as a queue made by first use is.
    let (_, status, _) = run(&["queue", "status", "later", "--server", s], "");
    assert!(status.contains("\"durable\": true"), "{status}");
    // Its figures are named as the HTTP API names them (it printed `items`, `in_flight`…).
    let figures: serde_json::Value = serde_json::from_str(&status).unwrap();
    for name in ["messages", "open_reads", "offered", "delivered", "acked", "delayed", "durability_in_force"] {
        assert!(figures.get(name).is_some(), "{name} in {status}");
    }
    assert!(run(&["queue", "create", "fast", "--in-memory", "--server", s], "").0);
    let (_, status, _) = run(&["queue", "status", "fast", "--server", s], "");
    assert!(status.contains("\"durable\": false"), "{status}");
    // A durability for a queue in memory is refused: it would keep nothing across a restart.
    let (ok, _, err) = run(&["queue", "create", "mem", "--in-memory", "--durability", "always", "--server", s], "");
    assert!(!ok && err.contains("cannot be used with"), "{err}");
    // A queue that is its own dead-letter queue is refused.
    let (ok, _, err) = run(&["queue", "create", "loop", "--ttl-ms", "100", "--dead-letter", "loop", "--server", s], "");
    assert!(!ok && err.contains("its own dead-letter queue"), "{err}");
}

/// A server that cannot start (its port is taken) leaves no data directory behind: a mistyped
/// `--data` that did not start does not become a directory to find later.
#[test]
fn a_server_that_cannot_start_makes_no_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let data = dir.path().join("fresh");
    let args = ["serve", "--data", data.to_str().unwrap(), "--native-addr", &port, "--memcache-addr", "off"];
    let (ok, _, err) = run(&[&args[..], &["--http-addr", "off"]].concat(), "");
    assert!(!ok && err.contains(&format!("bind {port}")), "{err}");
    assert!(!data.exists(), "no directory made");
}

/// What a new user got wrong, said plainly: a priority on a queue without levels, a name that
/// breaks the rules (which are given), and a first offer that fails (no "0 messages offered").
#[test]
fn mistakes_get_plain_answers() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    assert!(run(&["queue", "create", "jobs", "--server", s], "").0);
    let (ok, _, err) = run(&["produce", "jobs", "--priority", "5", "--server", s], "hi\n");
    assert!(ok && err.contains("has no priority levels: --priority is ignored"), "{err}");
    let (ok, _, err) = run(&["queue", "create", ".x", "--server", s], "");
    assert!(!ok && err.contains("not starting with '.' or '+'"), "{err}");
    assert!(run(&["queue", "create", "tiny", "--max-item-bytes", "2", "--server", s], "").0);
    let (ok, _, err) = run(&["produce", "tiny", "--server", s], "too long\n");
    assert!(!ok && !err.contains("0 messages offered") && err.contains("exceeds the limit of 2"), "{err}");
}

/// `consume` into a pipe nobody reads gives back what it did not print, its delivery not
/// counted: with `max_deliveries = 1` the messages stay in their queue. Before, the failed
/// write ended the command at once, the connection's end returned them as delivered, and every
/// one went to the dead-letter queue unprinted.
#[test]
fn consume_into_a_closed_pipe_leaves_its_messages_in_the_queue() {
    use petrel_client::QueueConfig;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let s = server.addr.as_str();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = |queue: &str| rt.block_on(async { server.client().await.queue_status(queue).await.unwrap().items });
    rt.block_on(async {
        let c = server.client().await;
        c.create_queue("dlq", QueueConfig::default()).await.unwrap();
        let limited = QueueConfig { max_deliveries: 1, dead_letter: "dlq".into(), ..QueueConfig::default() };
        c.create_queue("q", limited).await.unwrap();
        let messages = (0..10).map(|i| petrel_client::Message::new(format!("m{i}").into_bytes())).collect();
        c.offer("q", messages, None).await.unwrap();
    });
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(PETREL).args(["consume", "q", "--server", s]).stdout(writer).output().unwrap();
    assert!(out.stdout.is_empty());
    // (The connection's end returns what it held after the command exits.)
    let began = std::time::Instant::now();
    while status("q") < 10 && began.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!((status("q"), status("dlq")), (10, 0), "all back in the queue, none dead-lettered");
}

/// A failure is a failure even when nobody reads stderr, and a command whose work goes on past
/// what it prints does not end quietly when nobody reads stdout: before, any broken pipe, on
/// either, made every command exit 0 (`log append | head -1` appended one batch of its input).
#[test]
fn a_closed_pipe_turns_no_failure_into_success() {
    let closed = || {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        writer
    };
    let status = Command::new(PETREL)
        .args(["queue", "list", "--server", "127.0.0.1:1"])
        .stdout(Stdio::null())
        .stderr(closed())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2), "a server that cannot be reached");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let lines: String = (0..100_000).map(|i| format!("line {i}\n")).collect();
    let mut append = Command::new(PETREL)
        .args(["log", "append", d])
        .stdin(Stdio::piped())
        .stdout(closed())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = append.stdin.take().unwrap();
    let _ = std::io::Write::write_all(&mut stdin, lines.as_bytes());
    drop(stdin);
    assert!(!append.wait().unwrap().success(), "the append could not say what it stored");
}
