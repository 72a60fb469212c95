// Shared by the examples: the server to talk to. `--server ADDR` names a running one (as
// `cargo run -p petrel-client --example offer_poll -- --server 127.0.0.1:22134`); without it, a
// server starts in this process on a free port, its data in a temporary directory.

pub async fn server() -> (String, Option<tempfile::TempDir>) {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--server") {
        let addr = args.get(at + 1).expect("--server needs an address, e.g. 127.0.0.1:22134");
        return (addr.clone(), None);
    }
    let dir = tempfile::tempdir().expect("temporary directory");
    let config = petrel_server::Config {
        data: dir.path().to_path_buf(),
        native_addr: "127.0.0.1:0".parse().unwrap(),
        memcache_addr: None,
        http_addr: None,
        ..petrel_server::Config::default()
    };
    let server = petrel_server::Server::bind(config).await.expect("server");
    let addr = server.native_addr().to_string();
    tokio::spawn(server.run(std::future::pending()));
    (addr, Some(dir))
}
