//! `petrel user …` and `petrel cert dev` from the outside: the users file they write, what they
//! refuse, and certificates that rustls accepts for a mutually authenticated handshake.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection};

mod common;
use common::petrel;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn hash_of(file: &str, name: &str) -> String {
    let text = fs::read_to_string(file).unwrap();
    let start = text.find(&format!("name = \"{name}\"")).unwrap();
    let hash = &text[start..][text[start..].find("hash = \"").unwrap() + 8..];
    hash[..hash.find('"').unwrap()].to_owned()
}

#[test]
fn add_list_passwd_remove() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("users.toml");
    let f = file.to_str().unwrap();

    let out = petrel(&["user", "add", f, "max", "--admin"], b"zu*67\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("added max (admin)"), "{}", text(&out.stdout));
    // A Windows line ending is a line ending, not part of the password.
    let out = petrel(&["user", "add", f, "tom"], b"3-kio\r\n");
    assert!(out.status.success(), "{}", text(&out.stderr));

    let out = petrel(&["user", "list", f], b"");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "max admin\ntom user\n");

    assert_eq!(mode(&file), 0o600);
    let contents = fs::read_to_string(&file).unwrap();
    assert!(!contents.contains("zu*67") && !contents.contains("3-kio"), "{contents}");
    assert!(!contents.contains('\r'), "{contents}");
    assert!(hash_of(f, "tom").starts_with("$argon2id$"), "{contents}");

    let before = hash_of(f, "tom");
    let out = petrel(&["user", "passwd", f, "tom"], b"new-kio\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ne!(hash_of(f, "tom"), before);
    assert_eq!(mode(&file), 0o600);
    let out = petrel(&["user", "passwd", f, "ann"], b"x\n");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no user \"ann\""), "{}", text(&out.stderr));

    let out = petrel(&["user", "add", f, "tom"], b"again\n");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("already exists"), "{}", text(&out.stderr));
    assert_eq!(text(&petrel(&["user", "list", f], b"").stdout), "max admin\ntom user\n", "unchanged");

    let out = petrel(&["user", "remove", f, "tom"], b"");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&petrel(&["user", "list", f], b"").stdout), "max admin\n");
    let out = petrel(&["user", "remove", f, "tom"], b"");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no user \"tom\""), "{}", text(&out.stderr));
}

#[test]
fn bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("users.toml");
    let f = file.to_str().unwrap();

    for stdin in [&b"\n"[..], b"\r\n", b""] {
        let out = petrel(&["user", "add", f, "tom"], stdin);
        assert!(!out.status.success(), "{stdin:?}");
        assert!(text(&out.stderr).contains("empty password"), "{}", text(&out.stderr));
    }
    for name in ["a b", "*", "x/y", ""] {
        let out = petrel(&["user", "add", f, name], b"secret\n");
        assert!(!out.status.success(), "{name:?}");
        assert!(text(&out.stderr).contains("user name"), "{name:?}: {}", text(&out.stderr));
    }
    assert!(!file.exists(), "nothing written");

    let out = petrel(&["user", "list", f], b"");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains(f), "the missing file is named: {}", text(&out.stderr));

    fs::write(&file, "[[user]]\nname = \"max\"\nrole = \"admin\"\nhash = \"zu*67\"\n").unwrap();
    let out = petrel(&["user", "list", f], b"");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains(f) && err.contains("Argon2id"), "{err}");
}

fn certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path).unwrap().collect::<Result<_, _>>().unwrap()
}

fn key(path: &Path) -> PrivateKeyDer<'static> {
    PrivateKeyDer::from_pem_file(path).unwrap()
}

/// Moves TLS records from one side to the other; whether any moved.
fn pump(from: &mut Connection, to: &mut Connection) -> Result<bool, rustls::Error> {
    let mut records = Vec::new();
    while from.wants_write() {
        from.write_tls(&mut records).unwrap();
    }
    let mut unread = &records[..];
    while !unread.is_empty() {
        to.read_tls(&mut unread).unwrap();
        to.process_new_packets()?;
    }
    Ok(!records.is_empty())
}

fn handshake(client: &mut Connection, server: &mut Connection) -> Result<(), rustls::Error> {
    for _ in 0..10 {
        let moved = pump(client, server)? | pump(server, client)?;
        if !moved && !client.is_handshaking() && !server.is_handshaking() {
            return Ok(());
        }
    }
    panic!("the handshake does not end");
}

#[test]
fn cert_dev_writes_certificates_rustls_accepts_for_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let certs_dir = dir.path().join("new").join("certs");
    let out = petrel(&["cert", "dev", certs_dir.to_str().unwrap(), "--client-name", "alice.example"], b"");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for (name, mode_expected, header) in [
        ("ca.pem", 0o644, "-----BEGIN CERTIFICATE-----"),
        ("server.pem", 0o644, "-----BEGIN CERTIFICATE-----"),
        ("server.key", 0o600, "-----BEGIN PRIVATE KEY-----"),
        ("client.pem", 0o644, "-----BEGIN CERTIFICATE-----"),
        ("client.key", 0o600, "-----BEGIN PRIVATE KEY-----"),
    ] {
        let path = certs_dir.join(name);
        assert!(fs::read_to_string(&path).unwrap().starts_with(header), "{name}");
        assert_eq!(mode(&path), mode_expected, "{name}");
        assert!(stdout.contains(path.to_str().unwrap()), "{name} is reported: {stdout}");
    }
    let p = |name: &str| certs_dir.join(name);
    let client_cert = certs(&p("client.pem"));
    let client_der: &[u8] = client_cert[0].as_ref();
    assert!(client_der.windows(13).any(|w| w == b"alice.example"), "the client name is in the certificate");

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots.add(certs(&p("ca.pem")).remove(0)).unwrap();
    let roots = Arc::new(roots);
    let client_verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build().unwrap();
    let server_config = Arc::new(
        ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(certs(&p("server.pem")), key(&p("server.key")))
            .unwrap(),
    );
    let client_config = Arc::new(
        ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(client_cert.clone(), key(&p("client.key")))
            .unwrap(),
    );

    for server_name in ["localhost", "127.0.0.1", "::1"] {
        let name = ServerName::try_from(server_name).unwrap();
        let mut client = Connection::from(ClientConnection::new(client_config.clone(), name).unwrap());
        let mut server = Connection::from(ServerConnection::new(server_config.clone()).unwrap());
        handshake(&mut client, &mut server).unwrap_or_else(|e| panic!("{server_name}: {e}"));
        assert_eq!(server.peer_certificates().unwrap()[0], client_cert[0], "the server sees the client certificate");
    }

    // The server certificate is for those names only.
    let name = ServerName::try_from("example.com").unwrap();
    let mut client = Connection::from(ClientConnection::new(client_config, name).unwrap());
    let mut server = Connection::from(ServerConnection::new(server_config).unwrap());
    assert!(handshake(&mut client, &mut server).is_err());

    // A second run does not replace the CA (what it signed would no longer be trusted) unless
    // told to.
    let ca = std::fs::read(p("ca.pem")).unwrap();
    let again = petrel(&["cert", "dev", certs_dir.to_str().unwrap()], b"");
    assert!(!again.status.success() && text(&again.stderr).contains("--force"), "{}", text(&again.stderr));
    assert_eq!(std::fs::read(p("ca.pem")).unwrap(), ca, "left as it was");
    let forced = petrel(&["cert", "dev", certs_dir.to_str().unwrap(), "--force"], b"");
    assert!(forced.status.success(), "{}", text(&forced.stderr));
    assert_ne!(std::fs::read(p("ca.pem")).unwrap(), ca, "a new CA");
}

#[test]
fn cert_dev_refuses_a_client_name_no_user_could_have() {
    let dir = tempfile::tempdir().unwrap();
    let out = petrel(&["cert", "dev", dir.path().to_str().unwrap(), "--client-name", "two words"], b"");
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("--client-name"), "{}", text(&out.stderr));
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
}

/// Edits at once each see the others': eight `petrel user add` run together leave eight users
/// (each loaded the file, hashed for a while and wrote its own copy over the others').
#[test]
fn users_added_at_once_are_all_kept() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("users.toml");
    let f = file.to_str().unwrap().to_owned();
    let adds: Vec<_> = (0..8)
        .map(|i| {
            let f = f.clone();
            std::thread::spawn(move || petrel(&["user", "add", &f, &format!("user{i}")], b"pass-word-1\n"))
        })
        .collect();
    for add in adds {
        let out = add.join().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let out = petrel(&["user", "list", &f], b"");
    assert_eq!(text(&out.stdout).lines().count(), 8, "{}", text(&out.stdout));
    assert_eq!(mode(&file), 0o600);
}

/// At a terminal, `user add` shows nothing of the password typed, and asks for it twice: before,
/// the terminal showed it (and its scrollback and logs kept it), and a typo was stored unseen.
#[test]
fn a_password_typed_at_a_terminal_is_not_shown() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("users.toml");
    let petrel = env!("CARGO_BIN_EXE_petrel");
    // `script` runs the command on a terminal of its own, fed with what the shell types slowly
    // (each line once the prompt is up), and prints what the terminal shows.
    let typed = "(sleep 1; printf 'typed-s3cret\\n'; sleep 1; printf 'typed-s3cret\\n'; sleep 1)";
    let shell = format!("{typed} | script -qec '{petrel} user add {} ann' /dev/null", file.display());
    let out = std::process::Command::new("sh").args(["-c", &shell]).output().expect("sh and script (util-linux)");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("password for ann:") && shown.contains("again:"), "{shown}");
    assert!(!shown.contains("typed-s3cret"), "the password was shown: {shown}");
    assert!(std::fs::read_to_string(&file).unwrap().contains("ann"));
}

/// `cert dev --force` replaces the whole set or nothing: when one file cannot be written, the
/// certificates there are left as they were. Before, each was rewritten in place in turn, and a
/// failure part way left a new CA beside the old client certificate.
#[test]
fn cert_dev_force_replaces_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let d = certs.to_str().unwrap();
    assert!(petrel(&["cert", "dev", d], b"").status.success());
    let ca = fs::read(certs.join("ca.pem")).unwrap();
    // The client key cannot be written (a directory in its place), nor its new copy.
    fs::remove_file(certs.join("client.key")).unwrap();
    fs::create_dir(certs.join("client.key")).unwrap();
    assert!(!petrel(&["cert", "dev", d, "--force"], b"").status.success());
    assert_eq!(fs::read(certs.join("ca.pem")).unwrap(), ca, "the CA is the old one");
    fs::remove_dir(certs.join("client.key")).unwrap();
    fs::create_dir(certs.join(".client.key.tmp")).unwrap();
    fs::write(certs.join(".client.key.tmp/in-the-way"), b"").unwrap();
    assert!(!petrel(&["cert", "dev", d, "--force"], b"").status.success());
    assert_eq!(fs::read(certs.join("ca.pem")).unwrap(), ca, "the CA is the old one");
    assert!(!certs.join(".ca.pem.tmp").exists(), "nothing left aside");
    fs::remove_dir_all(certs.join(".client.key.tmp")).unwrap();
    assert!(petrel(&["cert", "dev", d, "--force"], b"").status.success());
    assert_ne!(fs::read(certs.join("ca.pem")).unwrap(), ca);
}
