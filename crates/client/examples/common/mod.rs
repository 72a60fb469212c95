// Shared by the examples: a server in this process on a free port, data in a temporary
// directory. Against a real server, connect to its address instead.

pub async fn local_server() -> (String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let config = petrel_server::Config {
        data: dir.path().to_path_buf(),
        native_addr: "127.0.0.1:0".parse().unwrap(),
        memcache_addr: None,
        ..petrel_server::Config::default()
    };
    let server = petrel_server::Server::bind(config).await.expect("server");
    let addr = server.native_addr().to_string();
    tokio::spawn(server.run(std::future::pending()));
    (addr, dir)
}
