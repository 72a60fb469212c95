//! `petrel acl …`: what a configuration's ACLs decide, read from its file as the server reads it
//! (`[security]`: the defaults, the `[[security.acl]]` entries and the users file's roles).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Subcommand, ValueEnum};
use petrel_broker::security::{Action, Kind, Role, Users};

type Res = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Subcommand)]
pub enum AclCommand {
    /// The defaults and the entries, in the order the configuration gives them.
    List {
        /// The server's configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// What USER may do to the KIND named NAME, and what decided it.
    Check {
        /// The server's configuration file.
        #[arg(long)]
        config: PathBuf,
        /// The user's name.
        user: String,
        /// What NAME is.
        kind: KindArg,
        /// The queue's, topic's or function's name.
        name: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum KindArg {
    Queue,
    Topic,
    Function,
}

pub fn acl(cmd: AclCommand) -> Res {
    match cmd {
        AclCommand::List { config } => {
            let config = petrel_server::Config::load(&config)?;
            let acl = config.security.acl()?;
            if config.security.users_file.is_none() {
                eprintln!(
                    "petrel: authentication is off in this file (no security.users_file): everyone may do everything; these rules apply once it is on"
                );
            }
            println!("default queue     {}", acl.default_queue);
            println!("default topic     {}", acl.default_topic);
            println!("default function  {}", acl.default_function);
            for e in &acl.entries {
                println!("{:<9} {:<24} {:<16} {}", e.kind.to_string(), e.name, e.user, e.access);
            }
            Ok(ExitCode::SUCCESS)
        }
        AclCommand::Check { config, user, kind, name } => {
            let config = petrel_server::Config::load(&config)?;
            let acl = config.security.acl()?;
            let role = match &config.security.users_file {
                Some(path) => match Users::load(path)?.get(&user) {
                    Some(u) => Some(u.role),
                    None => return Err(format!("no user {user:?} in {}", path.display()).into()),
                },
                None => None,
            };
            let (kind, actions) = match kind {
                KindArg::Queue => (Kind::Queue, [Action::Offer, Action::Poll]),
                KindArg::Topic => (Kind::Topic, [Action::Publish, Action::Subscribe]),
                KindArg::Function => (Kind::Function, [Action::Exec, Action::Serve]),
            };
            for action in actions {
                let (allowed, why) = match role {
                    None => (true, "authentication is off (no users file)".to_owned()),
                    Some(Role::Admin) => (true, "an admin".to_owned()),
                    Some(_) => match acl.by_entries(&user, kind, &name, action) {
                        _ if !acl.parent_allows(&user, kind, &name, action) => {
                            (false, "a fanout child: not allowed to poll its parent".to_owned())
                        }
                        Some(allowed) => (allowed, "an ACL entry for it".to_owned()),
                        None => (acl.allows(&user, kind, &name, action), format!("the default for a {kind}")),
                    },
                };
                // The verb alone ("offer", not the sentence's "offer to"), as the docs list them.
                let verb = action.to_string().trim_end_matches(" to").to_owned();
                println!("{verb:<10} {:<8} ({why})", if allowed { "allowed" } else { "denied" });
            }
            let manage = matches!(role, None | Some(Role::Admin));
            println!("{:<10} {:<8} (admins only)", "manage", if manage { "allowed" } else { "denied" });
            Ok(ExitCode::SUCCESS)
        }
    }
}
