//! `petrel log …` from the outside: the commands scripts rely on.

use std::process::{Command, Stdio};

mod common;
use common::petrel;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn append_dump_verify_and_repair() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = petrel(&["log", "append", d, "--durability", "always"], b"alpha\nbeta\n\ngamma");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "0\n1\n2\n3\n");

    let out = petrel(&["log", "dump", d, "--json", "--from", "1", "--count", "2"], b"");
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["offset"], 1);
    assert_eq!(lines[0]["payload_base64"], "YmV0YQ==");
    assert_eq!(lines[1]["payload_base64"], "");
    assert!(lines[0]["key_base64"].is_null());
    assert!(lines[0]["timestamp"].as_u64().unwrap() > 1_600_000_000_000_000_000);

    let out = petrel(&["log", "dump", d], b"");
    let table = text(&out.stdout);
    assert!(table.contains("alpha") && table.contains("gamma"), "{table}");

    let out = petrel(&["log", "verify", d], b"");
    assert!(out.status.success(), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("4 valid records"));

    // Damage record 1 ("beta"); records 2 and 3 follow it, so this is corruption, not a tail.
    let seg = dir.path().join("00000000000000000000.log");
    let mut bytes = std::fs::read(&seg).unwrap();
    let at = bytes.windows(4).position(|w| w == b"beta").unwrap();
    bytes[at] = b'B';
    std::fs::write(&seg, &bytes).unwrap();

    let out = petrel(&["log", "verify", d], b"");
    assert_eq!(out.status.code(), Some(1));
    let report = text(&out.stdout);
    assert!(report.contains("CORRUPT") && report.contains("record 1"), "{report}");

    // Reading reaches the damaged frame and says where it is.
    let out = petrel(&["log", "dump", d], b"");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("corrupt") && err.contains("00000000000000000000.log") && err.contains("record 1"), "{err}");

    let out = petrel(&["log", "repair", d], b"");
    assert!(text(&out.stdout).contains("--yes"));
    let out = petrel(&["log", "repair", d, "--yes"], b"");
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("and 2 intact records after them"), "{}", text(&out.stdout));

    let out = petrel(&["log", "append", d], b"delta\n");
    assert_eq!(text(&out.stdout), "1\n");
}

#[test]
fn bench_log_prints_one_json_object_last() {
    // Read back and polled in this process, and in a second one (`--consumer-process`).
    for consumer_process in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["bench", "log", "--data", dir.path().to_str().unwrap(), "--count", "20000"];
        args.extend(["--segment-bytes", "1048576", "--json"]);
        if consumer_process {
            args.push("--consumer-process");
        }
        let out = petrel(&args, b"");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        for key in [
            "append_msgs_per_sec",
            "append_mb_per_sec",
            "read_msgs_per_sec",
            "poll_ack_msgs_per_sec",
            "bytes_on_disk",
            "peak_rss_bytes",
            "consumer_peak_rss_bytes",
        ] {
            assert!(last[key].as_f64().unwrap() > 0.0, "{key} in {last}");
        }
        assert_eq!((&last["count"], &last["consumer_process"]), (&20000.into(), &consumer_process.into()));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the bench cleans up after itself");
    }
}

#[test]
fn a_reader_that_stops_early_is_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let lines: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
    assert!(petrel(&["log", "append", d], lines.as_bytes()).status.success());
    // `petrel log dump DIR | head -1`: stdout closes after one line.
    let mut child = Command::new(env!("CARGO_BIN_EXE_petrel"))
        .args(["log", "dump", d])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 10];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}: {}", out.status, text(&out.stderr));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}

/// The `log` commands that write refuse a log a running server holds (the server's next append
/// would write over theirs), and one that reads a group does not make a log where there is none.
#[test]
fn log_commands_that_write_keep_off_a_running_servers_logs_and_make_no_log() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = common::Server::start(&data);
    let mut mc = std::net::TcpStream::connect(&server.memcache).unwrap();
    std::io::Write::write_all(&mut mc, b"set jobs 0 0 2\r\nhi\r\n").unwrap();
    let mut answer = [0u8; 8];
    std::io::Read::read_exact(&mut mc, &mut answer).unwrap();
    assert_eq!(&answer, b"STORED\r\n");
    let queue_log = data.join("queues/jobs");
    let queue_log = queue_log.to_str().unwrap();
    // The same log by a roundabout path, and by a link: its real path is what counts.
    let roundabout = format!("{}/queues/jobs/../jobs", data.display());
    let link = dir.path().join("jobs-link");
    std::os::unix::fs::symlink(data.join("queues/jobs"), &link).unwrap();
    let link = link.to_str().unwrap();
    for args in [
        vec!["log", "append", queue_log],
        vec!["log", "consume", queue_log, "--group", "g"],
        vec!["log", "repair", queue_log, "--yes"],
        vec!["log", "append", &roundabout],
        vec!["log", "append", link],
    ] {
        let out = petrel(&args, b"zz\n");
        assert!(!out.status.success(), "{args:?}");
        assert!(text(&out.stderr).contains("running petrel server"), "{args:?}: {}", text(&out.stderr));
        assert!(out.stdout.is_empty(), "{args:?} acknowledged nothing");
    }
    // A read opened and given back: the queue's log gets a control record for it, which a dump
    // shows by its header's name (it has no payload).
    for (ask, answer) in
        [("get jobs/open\r\n", "VALUE jobs/open 0 2\r\nhi\r\nEND\r\n"), ("get jobs/abort\r\n", "END\r\n")]
    {
        std::io::Write::write_all(&mut mc, ask.as_bytes()).unwrap();
        let mut got = vec![0u8; answer.len()];
        std::io::Read::read_exact(&mut mc, &mut got).unwrap();
        assert_eq!(text(&got), answer);
    }
    drop(server);
    let out = petrel(&["log", "dump", queue_log], b"");
    let rows: Vec<String> = text(&out.stdout).lines().skip(1).map(str::to_owned).collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(rows[0].contains(" hi") && rows[1].ends_with("  [ctl.returned]"), "{rows:?}");
    // Stopped: the same append goes in.
    let out = petrel(&["log", "append", queue_log], b"zz\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The data directory itself is not a log: the error says where the logs are.
    let out = petrel(&["log", "verify", data.to_str().unwrap()], b"");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("/queues/NAME"), "{}", text(&out.stderr));

    let plain = dir.path().join("notes");
    std::fs::create_dir(&plain).unwrap();
    std::fs::write(plain.join("notes.txt"), b"mine").unwrap();
    let out = petrel(&["log", "consume", plain.to_str().unwrap(), "--group", "g"], b"");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("not a Petrel log"), "{}", text(&out.stderr));
    let left: Vec<_> = std::fs::read_dir(&plain).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["notes.txt"], "nothing made there");
}

#[test]
fn a_time_past_what_a_record_can_hold_is_refused_not_wrapped() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    assert!(petrel(&["log", "append", log.to_str().unwrap()], b"a\nb\n").status.success());
    let out = petrel(&["log", "dump", log.to_str().unwrap(), "--since", "2600-01-01T00:00:00Z"], b"");
    assert!(!out.status.success(), "{}", text(&out.stdout));
    assert!(text(&out.stderr).contains("2554"), "{}", text(&out.stderr));
}
