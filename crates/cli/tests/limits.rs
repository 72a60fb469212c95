//! Limits that one client must not be able to break, against the real binary with small
//! configured limits (so each test takes seconds): descriptors and queues, memory, connections,
//! threads, disk.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use petrel_client::{QueueConfig, Status};

mod common;
use common::Server;

fn config(dir: &Path, text: &str) -> String {
    let path = dir.join("petrel.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Sends a memcache request and reads one answer line (or a whole `VALUE … END`).
fn ask(conn: &mut TcpStream, request: &str) -> String {
    conn.write_all(request.as_bytes()).unwrap();
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        conn.read_exact(&mut byte).unwrap();
        answer.push(byte[0]);
        let text = String::from_utf8_lossy(&answer);
        if text.ends_with("\r\n") && (!text.starts_with("VALUE") || text.ends_with("END\r\n")) {
            return text.into_owned();
        }
    }
}

fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

#[test]
fn thousands_of_durable_queues_need_no_descriptor_each_and_max_queues_holds() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = config(dir.path(), "max_queues = 1500\n");
    // 128 descriptors: a server that kept ~3 per durable queue failed past ~40 queues.
    let limit = ["prlimit", "--nofile=128:128", "--"];
    let server = Server::start_under(&limit, &data, &["--config", &config]);
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for i in 0..1500 {
        assert_eq!(ask(&mut mc, &format!("set q{i} 0 0 5\r\nitem{}\r\n", i % 10)), "STORED\r\n", "queue {i}");
    }
    let open = descriptors(server.child.id());
    assert!(open < 40, "{open} descriptors open with 1500 durable queues");
    let refused = ask(&mut mc, "set one-too-many 0 0 1\r\nx\r\n");
    assert!(refused.starts_with("SERVER_ERROR") && refused.contains("max_queues"), "{refused}");
    assert!(!data.join("queues").join("one-too-many").exists(), "a refused creation leaves nothing behind");
    // The native protocol says LIMIT_REACHED.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = rt.block_on(async {
        let c = server.client().await;
        c.create_queue("native-one", QueueConfig::default()).await.unwrap_err().status()
    });
    assert_eq!(status, Some(Status::LimitReached));
    drop(mc);
    server.kill9();

    // It starts again on that data under the same descriptor limit, every queue there.
    let server = Server::start_under(&limit, &data, &["--config", &config]);
    let mut mc = TcpStream::connect(&server.memcache).unwrap();
    mc.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for i in [0, 777, 1499] {
        assert_eq!(ask(&mut mc, &format!("get q{i}\r\n")), format!("VALUE q{i} 0 5\r\nitem{}\r\nEND\r\n", i % 10));
    }
}
