//! A data directory written by the server before log format 2 (`tests/fixtures/v1-data`, by the
//! build of commit 70a0f89: a durable queue `orders` offered "message 1" … "message 50" with
//! idempotency keys, the first ten consumed with acknowledgements, then the server stopped) is
//! served by today's server: the forty messages left come in order, new offers go on after them,
//! and all of it survives a `kill -9` and a restart.

mod common;

use std::path::Path;

use common::{Server, petrel};

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn consume(server: &Server, count: usize) -> Vec<String> {
    let out = petrel(&["consume", "--server", &server.addr, "--ack", "--count", &count.to_string(), "orders"], b"");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_owned).collect()
}

fn segment_versions(queue: &Path) -> Vec<u32> {
    let mut segments: Vec<_> = std::fs::read_dir(queue)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    segments.sort();
    segments.iter().map(|s| u32::from_le_bytes(std::fs::read(s).unwrap()[8..12].try_into().unwrap())).collect()
}

#[test]
fn a_data_directory_of_format_one_is_served_and_appended_to() {
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1-data"), dir.path());
    let queue = dir.path().join("queues/orders");
    assert_eq!(segment_versions(&queue), [1]);

    let server = Server::start(dir.path());
    assert_eq!(consume(&server, 5), (11..=15).map(|i| format!("message {i}")).collect::<Vec<_>>());
    let out = petrel(&["produce", "--server", &server.addr, "orders"], b"after 1\nafter 2\n");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    server.kill9();
    assert_eq!(segment_versions(&queue), [1, 5], "new offers go to a segment of the current format");

    let server = Server::start(dir.path());
    let mut expected: Vec<String> = (16..=50).map(|i| format!("message {i}")).collect();
    expected.extend(["after 1".to_owned(), "after 2".to_owned()]);
    assert_eq!(consume(&server, expected.len()), expected);
    drop(server);
    let verify = petrel(&["log", "verify", queue.to_str().unwrap()], b"");
    assert!(verify.status.success(), "{}", String::from_utf8_lossy(&verify.stdout));
}
