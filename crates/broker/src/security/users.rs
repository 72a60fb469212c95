//! The users file: per user a name, a role and an Argon2id hash (a PHC string, so the salt and the
//! parameters travel with the hash). TOML, one `[[user]]` table per user; written by
//! `petrel user …`, read by the server at start and on reload.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use argon2::password_hash::phc::PasswordHash;
use argon2::{ARGON2ID_IDENT, Argon2, Params, PasswordHasher, PasswordVerifier};
use serde::{Deserialize, Serialize};

/// Longest user name, in bytes.
const MAX_NAME_LEN: usize = 64;
/// Longest password, in bytes: enough for any passphrase, and bounds what a client makes us hash.
const MAX_PASSWORD_LEN: usize = 1024;

/// What `verify` checks an unknown name against, so that it costs what a wrong password costs.
/// Made with the crate's default parameters (a test holds it to them) for a password nobody has.
const DUMMY_HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$laEPQX20wxLMpj5bSlDv3g$oBVpbsHUtJVd2OICDORGjf4jywLBquuFHIdTq0CDZfQ";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Admin,
    User,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Admin => "admin",
            Role::User => "user",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct User {
    pub name: String,
    pub role: Role,
    pub hash: String,
}

/// The file as TOML sees it.
#[derive(Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsersFile {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    user: Vec<User>,
}

/// The users of one file, by name. Every hash in it is a valid Argon2id PHC string.
#[derive(Clone, Debug, Default)]
pub struct Users {
    by_name: BTreeMap<String, User>,
}

impl Users {
    pub fn load(path: &Path) -> Result<Users, String> {
        let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Users::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Like `load`, but a missing file is an empty set (for `petrel user add` on a new file).
    pub fn load_or_empty(path: &Path) -> Result<Users, String> {
        match fs::metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Users::default()),
            _ => Users::load(path),
        }
    }

    fn parse(text: &str) -> Result<Users, String> {
        // Where and why, not toml's usual quote of the line: the line may hold a password hash,
        // and the error reaches whoever reads the server's reload status.
        let file: UsersFile = toml::from_str(text).map_err(|e| {
            let at = e.span().map(|span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                format!("line {line}, column {column}: ")
            });
            format!("{}{}", at.unwrap_or_default(), e.message().trim_end())
        })?;
        let mut users = Users::default();
        for user in file.user {
            Users::check_name(&user.name)?;
            check_hash(&user.hash).map_err(|e| format!("user {:?}: {e}", user.name))?;
            if users.by_name.contains_key(&user.name) {
                return Err(format!("user {:?} appears more than once", user.name));
            }
            users.by_name.insert(user.name.clone(), user);
        }
        Ok(users)
    }

    /// Changes the users file at `path` with `change` (a missing file is an empty set): loaded,
    /// changed and written again under an exclusive lock on `FILE.lock`, so that two edits at
    /// once (two `petrel user add`) each see the other's result instead of the last writing
    /// over the first's, or renaming the other's half-written temporary file. Returns the users
    /// as written.
    pub fn edit(path: &Path, change: impl FnOnce(&mut Users) -> Result<(), String>) -> Result<Users, String> {
        let lock_path = beside(path, ".lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| format!("{}: {e}", lock_path.display()))?;
        lock.lock().map_err(|e| format!("{}: {e}", lock_path.display()))?;
        let mut users = Users::load_or_empty(path)?;
        change(&mut users)?;
        users.save(path)?;
        Ok(users)
    }

    /// Writes the file atomically (a temporary file renamed over it), readable by its owner only.
    /// Two writers at once: `edit`.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        // A users file behind a symbolic link is written where the link points: renamed over the
        // link, the new file would replace the link and leave its target (which the server may
        // read) unchanged.
        let resolved = match fs::canonicalize(path) {
            Ok(real) => real,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => path.to_path_buf(),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let path = resolved.as_path();
        let file = UsersFile { user: self.by_name.values().cloned().collect() };
        let text = format!(
            "# Petrel users: edit with `petrel user add|passwd|remove`. Hashes are Argon2id PHC strings.\n\n{}",
            toml::to_string(&file).map_err(|e| format!("{}: {e}", path.display()))?
        );
        let tmp = temporary_path(path);
        write_private(&tmp, text.as_bytes())
            .and_then(|()| fs::rename(&tmp, path))
            .and_then(|()| sync_directory_of(path))
            .map_err(|e| {
                let _ = fs::remove_file(&tmp);
                format!("{}: {e}", path.display())
            })
    }

    pub fn add(&mut self, name: &str, password: &str, role: Role) -> Result<(), String> {
        Users::check_name(name)?;
        check_password(password)?;
        if self.by_name.contains_key(name) {
            return Err(format!("user {name:?} already exists (change the password with `petrel user passwd`)"));
        }
        let user = User { name: name.to_owned(), role, hash: hash_password(password) };
        self.by_name.insert(name.to_owned(), user);
        Ok(())
    }

    pub fn set_password(&mut self, name: &str, password: &str) -> Result<(), String> {
        check_password(password)?;
        let user = self.by_name.get_mut(name).ok_or_else(|| format!("no user {name:?}"))?;
        user.hash = hash_password(password);
        Ok(())
    }

    pub fn remove(&mut self, name: &str) -> Result<(), String> {
        self.by_name.remove(name).map(|_| ()).ok_or_else(|| format!("no user {name:?}"))
    }

    pub fn get(&self, name: &str) -> Option<&User> {
        self.by_name.get(name)
    }

    /// The users, by name.
    pub fn iter(&self) -> impl Iterator<Item = &User> {
        self.by_name.values()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Slow on purpose (Argon2): call it off the async runtime. `Some(role)` if the password is the user's.
    /// An unknown name costs the same as a wrong password (verify against a fixed dummy hash), so timing does not tell which.
    pub fn verify(&self, name: &str, password: &str) -> Option<Role> {
        // No user has such a password (`add` refuses it); refusing it whatever the name says nothing about the name.
        if check_password(password).is_err() {
            return None;
        }
        // (One whose hash costs too much to check is checked against the dummy, and refused.)
        let user = self.by_name.get(name).filter(|u| too_costly(&u.hash).is_none());
        let hash = user.map_or(DUMMY_HASH, |u| u.hash.as_str());
        let matches = PasswordHash::new(hash)
            .is_ok_and(|parsed| Argon2::default().verify_password(password.as_bytes(), &parsed).is_ok());
        user.filter(|_| matches).map(|u| u.role)
    }

    /// Whether `name` may be a user's name: 1–64 bytes of `A-Z a-z 0-9 . _ - @`.
    pub fn check_name(name: &str) -> Result<(), String> {
        if name == "*" {
            return Err("user name \"*\" is reserved: it means every user in ACLs".into());
        }
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@');
        if name.is_empty() || name.len() > MAX_NAME_LEN || !name.chars().all(allowed) {
            return Err(format!("bad user name {name:?}: 1 to {MAX_NAME_LEN} of the characters A-Z a-z 0-9 . _ - @"));
        }
        Ok(())
    }
}

/// An Argon2id PHC string with a fresh random salt and the crate's default parameters.
pub fn hash_password(password: &str) -> String {
    Argon2::default()
        .hash_password(password.as_bytes())
        .expect("Argon2id with default parameters hashes any password of at most 1024 bytes")
        .to_string()
}

fn check_password(password: &str) -> Result<(), String> {
    if password.is_empty() {
        return Err("empty password".into());
    }
    if password.len() > MAX_PASSWORD_LEN {
        return Err(format!("password longer than {MAX_PASSWORD_LEN} bytes"));
    }
    Ok(())
}

/// The costliest hash parameters a users file may hold (`petrel user` writes m=19456, t=2, p=1).
const MAX_HASH_MEMORY_KIB: u32 = 256 * 1024;
const MAX_HASH_PASSES: u32 = 16;
const MAX_HASH_LANES: u32 = 16;

/// Why `hash` costs more to check than the server spends on a login (`None`: it does not). Each
/// attempt against a user costs what its hash asks for: a hand-made one of gigabytes would let
/// any client exhaust the server's memory. Such a user cannot log in (`verify`); the file is
/// served all the same (so that `petrel user passwd` can set the password again).
pub fn too_costly(hash: &str) -> Option<String> {
    let params = PasswordHash::new(hash).ok().and_then(|parsed| Params::try_from(&parsed).ok())?;
    let over =
        params.m_cost() > MAX_HASH_MEMORY_KIB || params.t_cost() > MAX_HASH_PASSES || params.p_cost() > MAX_HASH_LANES;
    over.then(|| {
        format!(
            "hash parameters m={},t={},p={} exceed what the server checks (m ≤ {MAX_HASH_MEMORY_KIB} KiB, t ≤ {MAX_HASH_PASSES}, p ≤ {MAX_HASH_LANES}): logins are refused until the password is set again with `petrel user passwd`",
            params.m_cost(),
            params.t_cost(),
            params.p_cost()
        )
    })
}

/// Refuses what `verify` could not check: anything but Argon2id with usable parameters, salt and output.
fn check_hash(hash: &str) -> Result<(), String> {
    let bad = |why: String| format!("hash is not an Argon2id PHC string ($argon2id$v=19$m=…,t=…,p=…$SALT$HASH): {why}");
    let parsed = PasswordHash::new(hash).map_err(|e| bad(e.to_string()))?;
    if parsed.algorithm.as_str() != ARGON2ID_IDENT.as_str() {
        return Err(bad(format!("algorithm {}", parsed.algorithm)));
    }
    Params::try_from(&parsed).map_err(|e| bad(e.to_string()))?;
    if parsed.salt.is_none() || parsed.hash.is_none() {
        return Err(bad("no salt or no hash".into()));
    }
    Ok(())
}

/// `FILE.tmp`, beside `FILE` so that the rename stays on one file system.
fn temporary_path(path: &Path) -> PathBuf {
    beside(path, ".tmp")
}

/// `path` with `suffix` added to its name: a file beside it.
fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Creates `path` anew with mode 0600 (a leftover from a crash may have had another mode), writes
/// and fsyncs it.
fn write_private(path: &Path, contents: &[u8]) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    // The umask may have taken bits away from 0600; never added any.
    file.set_permissions(fs::Permissions::from_mode(0o600))?;
    file.write_all(contents)?;
    file.sync_all()
}

/// Makes a rename in the directory of `path` durable.
fn sync_directory_of(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A users file that does not parse is said to be bad where it is, without its text: the
    /// line may hold a hash, and the error reaches the server's reload status.
    #[test]
    fn a_file_that_does_not_parse_is_named_without_its_lines() {
        let text = "[[user]]\nname = \"tom\"\nhash = \"$argon2id$v=19$m=256,t=1,p=1$c2VjcmV0c2FsdA$aGFzaGhhc2g\n";
        let error = Users::parse(text).unwrap_err();
        assert!(error.starts_with("line 3, column"), "{error}");
        assert!(!error.contains("c2VjcmV0c2FsdA") && !error.contains("hash = "), "{error}");
    }

    /// Users with cheap hashes (Argon2id, 256 KiB, one pass), for tests that are not about the
    /// hashing: unoptimized (without the dev profile's opt-level for argon2), a hash with the
    /// default parameters takes most of a second.
    fn cheap_users(entries: &[(&str, &str, Role)]) -> Users {
        let argon2 = Argon2::from(Params::new(256, 1, 1, None).unwrap());
        let mut users = Users::default();
        for &(name, password, role) in entries {
            let hash = argon2.hash_password(password.as_bytes()).unwrap().to_string();
            users.by_name.insert(name.to_owned(), User { name: name.to_owned(), role, hash });
        }
        users
    }

    #[test]
    fn add_and_verify() {
        let mut users = Users::default();
        users.add("tom", "secret", Role::User).unwrap();
        users.add("max", "secret", Role::Admin).unwrap();
        assert_eq!(users.len(), 2);
        let (max, tom) = (users.get("max").unwrap(), users.get("tom").unwrap());
        assert!(max.hash.starts_with("$argon2id$v=19$m=19456,t=2,p=1$"), "{}", max.hash);
        assert_ne!(max.hash, tom.hash, "each user has their own salt");
        assert_eq!(users.verify("max", "secret"), Some(Role::Admin));
        assert_eq!(users.verify("tom", "secret "), None, "wrong password");
        assert_eq!(users.verify("ann", "secret"), None, "unknown user");
        // Refused without hashing.
        assert_eq!(users.verify("tom", ""), None);
        assert_eq!(users.verify("tom", &"x".repeat(MAX_PASSWORD_LEN + 1)), None);
        assert_eq!(users.iter().map(|u| u.name.as_str()).collect::<Vec<_>>(), ["max", "tom"], "by name");
    }

    #[test]
    fn verify_gives_the_role() {
        let users = cheap_users(&[("max", "max's secret", Role::Admin), ("tom", "tom's secret", Role::User)]);
        assert_eq!(users.verify("max", "max's secret"), Some(Role::Admin));
        assert_eq!(users.verify("tom", "tom's secret"), Some(Role::User));
        assert_eq!(users.verify("tom", "max's secret"), None, "another user's password");
    }

    #[test]
    fn dummy_hash_costs_what_a_users_hash_costs() {
        check_hash(DUMMY_HASH).unwrap();
        let parsed = PasswordHash::new(DUMMY_HASH).unwrap();
        let (dummy, default) = (Params::try_from(&parsed).unwrap(), Params::default());
        assert_eq!(
            (dummy.m_cost(), dummy.t_cost(), dummy.p_cost()),
            (default.m_cost(), default.t_cost(), default.p_cost())
        );
    }

    #[test]
    fn add_existing_set_password_remove() {
        let mut users = cheap_users(&[("max", "max's secret", Role::Admin), ("tom", "tom's secret", Role::User)]);
        let err = users.add("tom", "other", Role::Admin).unwrap_err();
        assert!(err.contains("already exists"), "{err}");
        assert_eq!(users.get("tom").unwrap().role, Role::User, "unchanged");

        let old_hash = users.get("tom").unwrap().hash.clone();
        users.set_password("tom", "new secret").unwrap();
        assert_ne!(users.get("tom").unwrap().hash, old_hash);
        assert_eq!(users.verify("tom", "new secret"), Some(Role::User));
        assert_eq!(users.verify("tom", "tom's secret"), None);
        assert!(users.set_password("ann", "x").unwrap_err().contains("no user"));
        assert!(users.set_password("tom", "").unwrap_err().contains("empty"));

        users.remove("tom").unwrap();
        assert!(users.get("tom").is_none());
        assert!(users.remove("tom").unwrap_err().contains("no user"));
        assert_eq!(users.len(), 1);
        assert!(!users.is_empty());
    }

    #[test]
    fn names_and_passwords_are_checked() {
        for good in ["a", "max", "Max.Power_1-2@example.com", &"x".repeat(MAX_NAME_LEN)] {
            Users::check_name(good).unwrap();
        }
        for bad in ["", "*", "a b", "ünïcode", "a/b", "a:b", "a*", &"x".repeat(MAX_NAME_LEN + 1), "tab\t"] {
            assert!(Users::check_name(bad).is_err(), "{bad:?}");
        }
        assert!(Users::check_name("*").unwrap_err().contains("every user"));
        let mut users = Users::default();
        // Refused before any hashing: these are cheap.
        assert!(users.add("a b", "secret", Role::User).unwrap_err().contains("bad user name"));
        assert!(users.add("*", "secret", Role::User).is_err());
        assert!(users.add("tom", "", Role::User).unwrap_err().contains("empty password"));
        assert!(users.add("tom", &"x".repeat(MAX_PASSWORD_LEN + 1), Role::User).unwrap_err().contains("longer"));
        assert!(users.is_empty());
    }

    #[test]
    fn a_users_file_behind_a_symbolic_link_is_written_where_it_points() {
        let dir = tempfile::tempdir().unwrap();
        let (real, link) = (dir.path().join("real.toml"), dir.path().join("users.toml"));
        fs::write(&real, "").unwrap();
        std::os::unix::fs::symlink(&real, &link).unwrap();
        cheap_users(&[("tom", "tom's secret", Role::User)]).save(&link).unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "still a link");
        assert!(fs::read_to_string(&real).unwrap().contains("tom"), "its target written");
    }

    #[test]
    fn save_and_load_round_trip_mode_0600_no_clear_passwords() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("users.toml");
        // An existing file with a looser mode: the saved one is 0600 all the same.
        fs::write(&path, "").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let users = cheap_users(&[("max", "max's secret", Role::Admin), ("tom", "tom's secret", Role::User)]);
        users.save(&path).unwrap();

        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        assert!(!temporary_path(&path).exists(), "the temporary file is renamed");
        let text = fs::read_to_string(&path).unwrap();
        assert!(!text.contains("secret"), "{text}");
        assert!(text.contains("[[user]]") && text.contains("role = \"admin\""), "{text}");

        let loaded = Users::load(&path).unwrap();
        assert_eq!(loaded.iter().collect::<Vec<_>>(), users.iter().collect::<Vec<_>>());
        assert_eq!(loaded.verify("max", "max's secret"), Some(Role::Admin));

        // Saving again (over a file that exists) keeps it whole.
        let mut fewer = loaded;
        fewer.remove("max").unwrap();
        fewer.save(&path).unwrap();
        assert_eq!(Users::load(&path).unwrap().iter().map(|u| u.name.as_str()).collect::<Vec<_>>(), ["tom"]);
    }

    #[test]
    fn missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none.toml");
        assert!(Users::load_or_empty(&path).unwrap().is_empty());
        let err = Users::load(&path).unwrap_err();
        assert!(err.contains("none.toml"), "{err}");
        // An empty set saves to a file that loads.
        Users::default().save(&path).unwrap();
        assert!(Users::load(&path).unwrap().is_empty());
    }

    #[test]
    fn a_hash_too_costly_to_check_is_served_but_logs_nobody_in() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("users.toml");
        let costly = "$argon2id$v=19$m=4194304,t=2,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA";
        fs::write(&path, format!("[[user]]\nname = \"max\"\nrole = \"admin\"\nhash = \"{costly}\"\n")).unwrap();
        let users = Users::load(&path).unwrap();
        assert!(too_costly(costly).is_some_and(|why| why.contains("m=4194304")));
        assert!(too_costly(DUMMY_HASH).is_none());
        // Refused without 4 GiB of hashing (this test would take that and seconds).
        assert_eq!(users.verify("max", "whatever-1"), None);
    }

    #[test]
    fn bad_files_are_errors_that_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("users.toml");
        let hash = DUMMY_HASH;
        let cases = [
            ("[[user]\nname = ", "TOML"),
            (
                &format!("[[user]]\nname = \"max\"\nrole = \"admin\"\nhash = \"{hash}\"\nshell = \"/bin/sh\"\n"),
                "unknown field",
            ),
            (&format!("[[users]]\nname = \"max\"\nrole = \"admin\"\nhash = \"{hash}\"\n"), "unknown field"),
            (
                &format!("[[user]]\nname = \"max\"\nrole = \"root\"\nhash = \"{hash}\"\n"),
                "line 3, column 8: unknown variant `root`",
            ),
            ("[[user]]\nname = \"max\"\nrole = \"admin\"\nhash = \"hunter2\"\n", "not an Argon2id"),
            (
                "[[user]]\nname = \"max\"\nrole = \"admin\"\nhash = \"$argon2i$v=19$m=19456,t=2,p=1$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaA\"\n",
                "not an Argon2id",
            ),
            (&format!("[[user]]\nname = \"a b\"\nrole = \"user\"\nhash = \"{hash}\"\n"), "bad user name"),
            (&format!("[[user]]\nname = \"max\"\nrole = \"user\"\nhash = \"{hash}\"\n").repeat(2), "more than once"),
        ];
        for (text, expected) in cases {
            fs::write(&path, text).unwrap();
            let err = Users::load(&path).unwrap_err();
            assert!(err.starts_with(&path.display().to_string()), "{err}");
            assert!(err.contains(expected) || expected == "TOML", "{text:?}: {err}");
        }
        // The same user, once, loads.
        fs::write(&path, format!("[[user]]\nname = \"max\"\nrole = \"user\"\nhash = \"{hash}\"\n")).unwrap();
        assert_eq!(Users::load(&path).unwrap().get("max").unwrap().role, Role::User);
    }
}
