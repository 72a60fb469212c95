//! The README's 30-second tour, run top to bottom (in a temporary directory, with the benchmark
//! lines shortened), so that it cannot break unnoticed. It uses the default ports, as a new
//! user's first server does.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_readme_tour_runs_top_to_bottom() {
    let readme = include_str!("../../../README.md");
    let tour = readme.split("## 30-second tour").nth(1).expect("a tour section");
    let tour = tour.split("```sh\n").nth(1).and_then(|t| t.split("```").next()).expect("a sh block");
    let dir = tempfile::tempdir().unwrap();
    let here = format!("{}/", dir.path().display());
    let mut script = String::from("set -euo pipefail\n");
    for line in tour.lines() {
        if line.starts_with("cargo build") {
            continue; // the test's own build is on PATH
        }
        // The README waits for the server and the replier with sleeps, which a loaded machine
        // can outlast: here each waits until it is there.
        let line = line
            .replace(" & sleep 1 ", " & until (exec 3<>/dev/tcp/127.0.0.1/22134) 2>/dev/null; do sleep 0.1; done; ")
            .replace(
                "sleep 0.5; petrel call shout --data hi ",
                "until petrel call shout --data hi 2>/dev/null; do sleep 0.1; done ",
            )
            .replace("/tmp/", &here)
            .replace("petrel bench queue", "petrel bench queue --count 20000 --data .")
            .replace("--count 10000000", "--count 100000");
        script.push_str(&line);
        script.push('\n');
    }
    script.push_str("kill $(jobs -p) 2>/dev/null || true\nwait\n");
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_petrel")).parent().unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    // In a process group of its own, so that a tour that hangs is ended with its server (which
    // would otherwise keep the default ports from later runs).
    let mut child = Command::new("bash")
        .process_group(0)
        .args(["-c", &script])
        .current_dir(dir.path())
        .env("PATH", path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(180) {
            let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
            child.kill().unwrap();
            panic!("the tour did not finish in 3 minutes:\n{script}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // A tour that failed half-way leaves its background server running, holding the output's
    // pipes (and the default ports): ended with the group before the output is read to its end.
    let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the tour failed:\n{script}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    for expected in
        ["native 127.0.0.1:22134", "a\nb\n", "HI\n", "VALUE mail/open 0 5\r\nhello\r\nEND", "hello", "world"]
    {
        assert!(stdout.contains(expected), "{expected:?} missing from:\n{stdout}");
    }
}
