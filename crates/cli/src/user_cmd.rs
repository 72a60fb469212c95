//! `petrel user …` (the users file) and `petrel cert dev` (certificates for development and tests).

use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, IsTerminal, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Subcommand;
use petrel_broker::security::{Role, Users};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

type Res = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Subcommand)]
pub enum UserCommand {
    /// Add a user (creating FILE if missing); the password is one line on stdin.
    Add {
        /// The users file (TOML; `security.users_file` in the server's configuration).
        file: PathBuf,
        /// The user's name.
        name: String,
        /// An administrator: may do everything, including create and remove destinations.
        #[arg(long)]
        admin: bool,
    },
    /// Change a user's password; the new one is one line on stdin.
    Passwd {
        /// The users file.
        file: PathBuf,
        /// The user's name.
        name: String,
    },
    /// Remove a user.
    Remove {
        /// The users file.
        file: PathBuf,
        /// The user's name.
        name: String,
    },
    /// List the users and their roles.
    List {
        /// The users file.
        file: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum CertCommand {
    /// Write a self-signed CA and a server and a client certificate signed by it, for development:
    /// ca.pem, server.pem, server.key (localhost, 127.0.0.1, ::1), client.pem, client.key.
    Dev {
        /// Where to write them (created if missing).
        dir: PathBuf,
        /// The client certificate's subject CN: the user a connection presenting it is.
        #[arg(long, default_value = "client")]
        client_name: String,
        /// Replace the files of those names already in DIR (a new CA: certificates signed by the
        /// old one are no longer trusted by what trusts the new one).
        #[arg(long)]
        force: bool,
    },
}

pub fn user(cmd: UserCommand) -> Res {
    match cmd {
        UserCommand::Add { file, name, admin } => {
            let users = Users::load_or_empty(&file)?;
            // Checked before asking for a password that could not be used.
            Users::check_name(&name)?;
            if users.get(&name).is_some() {
                return Err(
                    format!("{}: user {name:?} already exists (use `petrel user passwd`)", file.display()).into()
                );
            }
            let password = read_password(&name)?;
            let role = if admin { Role::Admin } else { Role::User };
            // (Added to the file as it is now: another edit may have come meanwhile.)
            drop(users);
            Users::edit(&file, |users| users.add(&name, &password, role))?;
            println!("added {name} ({role}) to {}", file.display());
        }
        UserCommand::Passwd { file, name } => {
            if Users::load(&file)?.get(&name).is_none() {
                return Err(format!("{}: no user {name:?}", file.display()).into());
            }
            let password = read_password(&name)?;
            Users::edit(&file, |users| {
                users.set_password(&name, &password).map_err(|e| format!("{}: {e}", file.display()))
            })?;
            println!("changed the password of {name} in {}", file.display());
        }
        UserCommand::Remove { file, name } => {
            Users::load(&file)?; // (a missing file is an error here, not an empty set)
            let users =
                Users::edit(&file, |users| users.remove(&name).map_err(|e| format!("{}: {e}", file.display())))?;
            println!("removed {name} from {}", file.display());
            if users.is_empty() {
                eprintln!("petrel: {} has no users left: a server refuses to start with it", file.display());
            }
        }
        UserCommand::List { file } => {
            let users = Users::load(&file)?;
            let mut out = io::stdout().lock();
            for user in users.iter() {
                writeln!(out, "{} {}", user.name, user.role)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One line from stdin, without its line ending; never from argv, where `ps` and shell history
/// would show it. At a terminal it is not shown as it is typed, and asked twice (a typo would
/// be stored unseen).
fn read_password(name: &str) -> Result<String, String> {
    if !io::stdin().is_terminal() {
        return read_password_line();
    }
    let first = read_unseen(&format!("password for {name}: "))?;
    let again = read_unseen("again: ")?;
    if first != again {
        return Err("the two passwords typed differ".into());
    }
    Ok(first)
}

/// A line of stdin, the terminal's echo off while it is typed (back on however the read ends).
fn read_unseen(prompt: &str) -> Result<String, String> {
    use rustix::termios::{LocalModes, OptionalActions, tcgetattr, tcsetattr};
    eprint!("{prompt}");
    let _ = io::stderr().flush();
    let stdin = io::stdin();
    let shown = tcgetattr(&stdin).map_err(|e| format!("the terminal's settings: {e}"))?;
    let mut unseen = shown.clone();
    unseen.local_modes.remove(LocalModes::ECHO);
    tcsetattr(&stdin, OptionalActions::Flush, &unseen).map_err(|e| format!("turning the echo off: {e}"))?;
    let read = read_password_line();
    let _ = tcsetattr(&stdin, OptionalActions::Now, &shown);
    eprintln!(); // (the line's end was not shown either)
    read
}

fn read_password_line() -> Result<String, String> {
    let mut line = String::new();
    io::stdin().lock().read_line(&mut line).map_err(|e| format!("reading the password from stdin: {e}"))?;
    let password = line.strip_suffix('\n').map_or(line.as_str(), |l| l.strip_suffix('\r').unwrap_or(l));
    if password.is_empty() {
        return Err("empty password (give it as one line on stdin)".into());
    }
    Ok(password.to_owned())
}

pub fn cert(cmd: CertCommand) -> Res {
    let CertCommand::Dev { dir, client_name, force } = cmd;
    // The CN names a user: one the users file could never hold would authenticate no one.
    Users::check_name(&client_name).map_err(|e| format!("--client-name: {e}"))?;
    const NAMES: [&str; 5] = ["ca.pem", "server.pem", "server.key", "client.pem", "client.key"];
    let present: Vec<&str> = NAMES.into_iter().filter(|name| dir.join(name).exists()).collect();
    if !force && !present.is_empty() {
        return Err(format!(
            "{} already holds {}: --force replaces them (with a new CA, whose trust certificates signed by the old one lose)",
            dir.display(),
            present.join(", ")
        )
        .into());
    }
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;

    let now = rcgen::date_time_ymd(1970, 1, 1) + SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?;
    const DAY: Duration = Duration::from_secs(24 * 60 * 60);
    let validity = |params: &mut CertificateParams| {
        // A day of slack for clocks that lag.
        params.not_before = now - DAY;
        params.not_after = now + 3652 * DAY;
    };

    let mut ca_params = CertificateParams::new(Vec::new())?;
    ca_params.distinguished_name.push(DnType::CommonName, "Petrel development CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    validity(&mut ca_params);
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let ca = Issuer::new(ca_params, ca_key);

    let mut server_params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned(), "::1".to_owned()])?;
    server_params.distinguished_name.push(DnType::CommonName, "localhost");
    server_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    server_params.use_authority_key_identifier_extension = true;
    validity(&mut server_params);
    let server_key = KeyPair::generate()?;
    let server_cert = server_params.signed_by(&server_key, &ca)?;

    let mut client_params = CertificateParams::new(Vec::new())?;
    client_params.distinguished_name.push(DnType::CommonName, client_name.as_str());
    client_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    client_params.use_authority_key_identifier_extension = true;
    validity(&mut client_params);
    let client_key = KeyPair::generate()?;
    let client_cert = client_params.signed_by(&client_key, &ca)?;

    let files = [
        ("ca.pem", ca_cert.pem(), 0o644, "CA certificate (trust it: client `ca`, server `tls_client_ca`)".to_owned()),
        ("server.pem", server_cert.pem(), 0o644, "server certificate for localhost, 127.0.0.1, ::1".to_owned()),
        ("server.key", server_key.serialize_pem(), 0o600, "server private key".to_owned()),
        ("client.pem", client_cert.pem(), 0o644, format!("client certificate for user {client_name}")),
        ("client.key", client_key.serialize_pem(), 0o600, "client private key".to_owned()),
    ];
    // The whole set or nothing: each written aside first, then all put in place (a CA of one
    // run beside a client certificate of another trusts nothing, and a server reloading meanwhile
    // must not read a key half written).
    let aside = |name: &str| dir.join(format!(".{name}.tmp"));
    if let Some(name) = NAMES.iter().find(|name| dir.join(name).is_dir()) {
        return Err(format!("{}: a directory, where the {name} file goes", dir.join(name).display()).into());
    }
    for (name, contents, mode, _) in &files {
        let path = aside(name);
        write_with_mode(&path, contents.as_bytes(), *mode).map_err(|e| {
            files.iter().for_each(|(name, ..)| drop(fs::remove_file(aside(name))));
            format!("{}: {e}", path.display())
        })?;
    }
    for (name, ..) in &files {
        let path = dir.join(name);
        fs::rename(aside(name), &path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    fs::File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Said once all are in place (a stdout that fails must not stop the set half replaced).
    let mut out = io::stdout().lock();
    for (name, _, _, what) in &files {
        writeln!(out, "wrote {}: {what}", dir.join(name).display())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `path` (a new file: one left by an earlier run is replaced) with exactly `mode`: set
/// before anything is written, so a key is never readable by others even for a moment.
fn write_with_mode(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = OpenOptions::new().write(true).create_new(true).mode(mode).open(path)?;
    file.set_permissions(fs::Permissions::from_mode(mode))?;
    file.write_all(contents)?;
    file.sync_all()
}
