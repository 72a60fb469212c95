//! Who a connection is, and what it may do: users (a file of Argon2id hashes), roles, and access
//! control lists over queues, topics and functions. Every protocol asks this one place
//! (`Broker::authorize`), so a decision never depends on which port a client came in by.
//!
//! The rules, in order:
//! 1. an `admin` may do everything, including create and remove destinations;
//! 2. only an admin creates or removes queues and topics (`Action::Manage`), except a connection's
//!    own temporary queues, and queues made by first use (memcache) for a user who may use them;
//! 3. a temporary queue is usable by its owner, and offered to by the function server answering a
//!    call that named it as `reply_to`;
//! 4. otherwise the ACL entries that match the user (by name, or `*`), the kind and the name (by
//!    name, `prefix*`, or `*`) decide: any `deny` among them wins; else any entry that allows the
//!    action allows it; else, when entries matched, the action is denied (an entry for a user
//!    replaces the default); when none matched, the kind's default access decides.

mod users;

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
pub use users::{Role, User, Users, hash_password, too_costly};

use crate::ConnId;

/// What a destination is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Queue,
    Topic,
    Function,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Queue => "queue",
            Kind::Topic => "topic",
            Kind::Function => "function",
        })
    }
}

/// What a request does to a destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Offer,
    Poll,
    Publish,
    Subscribe,
    /// Call a function.
    Exec,
    /// Serve a function (receive its calls): a caller's requests reach whoever serves it.
    Serve,
    /// Create or remove a destination, flush all queues: admins only.
    Manage,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Offer => "offer to",
            Action::Poll => "poll",
            Action::Publish => "publish to",
            Action::Subscribe => "subscribe to",
            Action::Exec => "call",
            Action::Serve => "serve",
            Action::Manage => "create or remove",
        })
    }
}

/// An access mode, as seed 004 spells them (plus `serve` for functions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Offer,
    Poll,
    OfferPoll,
    Publish,
    Subscribe,
    PublishSubscribe,
    Exec,
    Serve,
    ExecServe,
    Deny,
}

impl Access {
    /// Whether this mode is one a destination of `kind` has.
    pub fn fits(self, kind: Kind) -> bool {
        use Access::*;
        match kind {
            Kind::Queue => matches!(self, Offer | Poll | OfferPoll | Deny),
            Kind::Topic => matches!(self, Publish | Subscribe | PublishSubscribe | Deny),
            Kind::Function => matches!(self, Exec | Serve | ExecServe | Deny),
        }
    }

    pub fn allows(self, action: Action) -> bool {
        use Access::*;
        matches!(
            (self, action),
            (Offer | OfferPoll, Action::Offer)
                | (Poll | OfferPoll, Action::Poll)
                | (Publish | PublishSubscribe, Action::Publish)
                | (Subscribe | PublishSubscribe, Action::Subscribe)
                | (Exec | ExecServe, Action::Exec)
                | (Serve | ExecServe, Action::Serve)
        )
    }
}

impl FromStr for Access {
    type Err = String;
    fn from_str(s: &str) -> Result<Access, String> {
        use Access::*;
        Ok(match s.trim_start_matches(':') {
            "offer" => Offer,
            "poll" => Poll,
            "offer-poll" => OfferPoll,
            "publish" => Publish,
            "subscribe" => Subscribe,
            "publish-subscribe" => PublishSubscribe,
            "exec" | "execute" => Exec,
            "serve" => Serve,
            "exec-serve" => ExecServe,
            "deny" => Deny,
            other => {
                return Err(format!(
                    "unknown access mode {other:?} (offer, poll, offer-poll, publish, subscribe, publish-subscribe, exec, serve, exec-serve, deny)"
                ));
            }
        })
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use Access::*;
        f.write_str(match self {
            Offer => "offer",
            Poll => "poll",
            OfferPoll => "offer-poll",
            Publish => "publish",
            Subscribe => "subscribe",
            PublishSubscribe => "publish-subscribe",
            Exec => "exec",
            Serve => "serve",
            ExecServe => "exec-serve",
            Deny => "deny",
        })
    }
}

/// One ACL entry: `user` (a name or `*`) has `access` to destinations of `kind` named `name`
/// (a name, `prefix*`, or `*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AclEntry {
    pub kind: Kind,
    pub name: String,
    pub user: String,
    pub access: Access,
}

impl AclEntry {
    pub fn new(kind: Kind, name: &str, user: &str, access: &str) -> Result<AclEntry, String> {
        let access: Access = access.parse()?;
        if !access.fits(kind) {
            return Err(format!("{access} is not an access mode of a {kind}"));
        }
        if name.is_empty() || name.strip_suffix('*').unwrap_or(name).contains('*') {
            return Err(format!("ACL name {name:?}: a name, a prefix ending in *, or *"));
        }
        if user.is_empty() {
            return Err("ACL entry without a user (a name, or * for every user)".into());
        }
        // A user no users file can hold (`tom*`, a space) would match nobody: a deny so written
        // would deny nothing.
        if user != "*"
            && let Err(why) = Users::check_name(user)
        {
            return Err(format!("ACL user {user:?}: a user's name, or * for every user ({why})"));
        }
        Ok(AclEntry { kind, name: name.to_owned(), user: user.to_owned(), access })
    }

    fn matches(&self, user: &str, kind: Kind, name: &str) -> bool {
        (self.user == "*" || self.user == user) && self.names(kind, name)
    }

    /// Whether the entry is about `name`, whoever it is for.
    fn names(&self, kind: Kind, name: &str) -> bool {
        self.kind == kind
            && match self.name.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => self.name == name,
            }
    }
}

/// The access control lists: a default per kind and the entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acl {
    pub default_queue: Access,
    pub default_topic: Access,
    pub default_function: Access,
    pub entries: Vec<AclEntry>,
}

impl Default for Acl {
    /// Seed 004's defaults: every user may use every destination; only admins manage them.
    fn default() -> Acl {
        Acl {
            default_queue: Access::OfferPoll,
            default_topic: Access::PublishSubscribe,
            default_function: Access::Exec,
            entries: Vec::new(),
        }
    }
}

impl Acl {
    /// Whether an ordinary user may do `action` to a destination (rules 4 above).
    pub fn allows(&self, user: &str, kind: Kind, name: &str, action: Action) -> bool {
        if let Some(decided) = self.by_entries(user, kind, name, action) {
            return decided;
        }
        let default = match kind {
            Kind::Queue => self.default_queue,
            Kind::Topic => self.default_topic,
            Kind::Function => self.default_function,
        };
        default.allows(action)
    }

    /// Whether the entries set `name` aside for other users: an entry allows it to another user
    /// by this very name (not by a prefix, not `*`), and none names it for `user` or everyone.
    /// A name that `user` may not take first.
    pub fn meant_for_others(&self, user: &str, kind: Kind, name: &str) -> bool {
        let exactly = |e: &&AclEntry| e.kind == kind && e.name == name;
        let mut for_others = false;
        for e in self.entries.iter().filter(exactly) {
            if e.user == "*" || e.user == user {
                return false;
            }
            for_others |= e.access != Access::Deny;
        }
        for_others
    }

    /// Whether the rights `name` has through its fanout parent allow `action` to `user`: a child
    /// holds copies of its parent's messages, so taking them needs the right to take the
    /// parent's as well, unless an entry gives the child by its own name (a consumer of one
    /// child only). Anything else is decided by the name alone (`allows`).
    pub fn parent_allows(&self, user: &str, kind: Kind, name: &str, action: Action) -> bool {
        match (kind, action, crate::fanout_parent(name)) {
            (Kind::Queue, Action::Poll, Some(parent)) => {
                self.allows(user, kind, parent, action) || self.names_exactly(user, kind, name, action)
            }
            _ => true,
        }
    }

    /// Whether an entry allows `action` on `name` to `user` (or everyone) by this very name.
    pub fn names_exactly(&self, user: &str, kind: Kind, name: &str, action: Action) -> bool {
        self.entries
            .iter()
            .any(|e| e.kind == kind && e.name == name && (e.user == "*" || e.user == user) && e.access.allows(action))
    }

    /// Whether an entry matching `user`, `kind` and `name` denies it everything.
    pub fn denies(&self, user: &str, kind: Kind, name: &str) -> bool {
        self.entries.iter().any(|e| e.access == Access::Deny && e.matches(user, kind, name))
    }

    /// What the entries matching `user`, `kind` and `name` decide for `action` (a deny among
    /// them wins); `None` when none matches (the kind's default decides).
    pub fn by_entries(&self, user: &str, kind: Kind, name: &str, action: Action) -> Option<bool> {
        let mut matched = false;
        let mut allowed = false;
        for entry in self.entries.iter().filter(|e| e.matches(user, kind, name)) {
            if entry.access == Access::Deny {
                return Some(false);
            }
            matched = true;
            allowed |= entry.access.allows(action);
        }
        matched.then_some(allowed)
    }

    pub fn check_defaults(&self) -> Result<(), String> {
        for (kind, access) in [
            (Kind::Queue, self.default_queue),
            (Kind::Topic, self.default_topic),
            (Kind::Function, self.default_function),
        ] {
            if !access.fits(kind) {
                return Err(format!("default_{kind}: {access} is not an access mode of a {kind}"));
            }
        }
        Ok(())
    }
}

/// The users and the ACLs in force: one snapshot, replaced whole on reload.
#[derive(Clone, Debug, Default)]
pub struct Security {
    pub users: Users,
    pub acl: Acl,
}

impl Security {
    /// Whether `user` has the same rights under `other` as under these rules: the same entry in
    /// the users file (role and password), the same defaults, and the same ACL entries naming
    /// it or every user. A reload tells the connections of users for whom it is not so, which
    /// end if their user is gone or they hold a subscription or serve a function.
    pub fn same_rights(&self, other: &Security, user: &str) -> bool {
        let theirs =
            |acl: &Acl| acl.entries.iter().filter(|e| e.user == "*" || e.user == user).cloned().collect::<Vec<_>>();
        self.users.get(user) == other.users.get(user)
            && (self.acl.default_queue, self.acl.default_topic, self.acl.default_function)
                == (other.acl.default_queue, other.acl.default_topic, other.acl.default_function)
            && theirs(&self.acl) == theirs(&other.acl)
    }
}

/// Who a connection is, once authenticated. The role is looked up at each decision, so a reload
/// that demotes or removes a user takes effect on connections already open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub user: String,
    pub conn: ConnId,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(defaults: [&str; 3], entries: &[(Kind, &str, &str, &str)]) -> Acl {
        Acl {
            default_queue: defaults[0].parse().unwrap(),
            default_topic: defaults[1].parse().unwrap(),
            default_function: defaults[2].parse().unwrap(),
            entries: entries.iter().map(|(k, n, u, a)| AclEntry::new(*k, n, u, a).unwrap()).collect(),
        }
    }

    #[test]
    fn acl_names_are_a_name_a_prefix_or_a_star_in_any_script() {
        for good in ["é", "commandes.é*", "*", "q"] {
            assert!(AclEntry::new(Kind::Queue, good, "tom", "poll").is_ok(), "{good}");
        }
        for bad in ["", "a*b", "**", "é*é"] {
            assert!(AclEntry::new(Kind::Queue, bad, "tom", "poll").is_err(), "{bad}");
        }
    }

    #[test]
    fn seed_queue_example_an_entry_replaces_the_default_for_its_user() {
        let a = acl(
            ["offer-poll", "publish-subscribe", "exec"],
            &[
                (Kind::Queue, "queue/1", "jak", "poll"),
                (Kind::Queue, "queue/1", "pax", "offer"),
                (Kind::Queue, "queue/1", "jon", "deny"),
            ],
        );
        assert!(a.allows("pax", Kind::Queue, "queue/1", Action::Offer));
        assert!(!a.allows("pax", Kind::Queue, "queue/1", Action::Poll));
        assert!(a.allows("jak", Kind::Queue, "queue/1", Action::Poll));
        assert!(!a.allows("jak", Kind::Queue, "queue/1", Action::Offer));
        assert!(!a.allows("jon", Kind::Queue, "queue/1", Action::Poll));
        assert!(a.allows("tom", Kind::Queue, "queue/1", Action::Offer), "no entry: the default");
        assert!(a.allows("jak", Kind::Queue, "queue/2", Action::Offer), "other queues: the default");
    }

    #[test]
    fn custom_default_deny_and_deny_wins_over_a_wildcard_allow() {
        let a = acl(
            ["deny", "deny", "deny"],
            &[
                (Kind::Queue, "queue/1", "tom", "poll"),
                (Kind::Queue, "queue/1", "max", "offer"),
                (Kind::Topic, "orders.*", "*", "publish-subscribe"),
                (Kind::Topic, "orders.secret", "ben", "deny"),
                (Kind::Function, "echo", "jak", "execute"),
            ],
        );
        assert!(a.allows("tom", Kind::Queue, "queue/1", Action::Poll));
        assert!(!a.allows("tom", Kind::Queue, "queue/1", Action::Offer));
        assert!(a.allows("max", Kind::Queue, "queue/1", Action::Offer));
        assert!(!a.allows("max", Kind::Queue, "queue/2", Action::Offer));
        assert!(a.allows("ben", Kind::Topic, "orders.eu", Action::Subscribe));
        assert!(!a.allows("ben", Kind::Topic, "orders.secret", Action::Subscribe), "deny wins");
        assert!(a.allows("ann", Kind::Topic, "orders.secret", Action::Publish));
        assert!(!a.allows("ann", Kind::Topic, "ordersX", Action::Publish));
        assert!(a.allows("jak", Kind::Function, "echo", Action::Exec));
        assert!(!a.allows("jak", Kind::Function, "echo", Action::Serve));
        assert!(!a.allows("jak", Kind::Function, "order", Action::Exec));
        assert!(!a.allows("jak", Kind::Queue, "x", Action::Manage), "no mode manages");
    }

    #[test]
    fn entries_are_checked() {
        assert!(AclEntry::new(Kind::Queue, "q", "tom", "publish").is_err());
        assert!(AclEntry::new(Kind::Function, "f", "tom", "poll").is_err());
        assert!(AclEntry::new(Kind::Queue, "a*b", "tom", "poll").is_err());
        assert!(AclEntry::new(Kind::Queue, "", "tom", "poll").is_err());
        assert!(AclEntry::new(Kind::Queue, "q", "", "poll").is_err());
        // A user no users file can hold would match nobody: a deny that denies nothing.
        for user in ["contractor-*", "tom ", " tom", "t*m"] {
            assert!(AclEntry::new(Kind::Queue, "q", user, "deny").is_err(), "{user:?}");
        }
        assert!(AclEntry::new(Kind::Queue, "q", "*", "deny").is_ok());
        assert!(AclEntry::new(Kind::Queue, "q", "tom", "read").is_err());
        assert_eq!(AclEntry::new(Kind::Queue, "*", "*", ":offer-poll").unwrap().access, Access::OfferPoll);
        for mode in ["offer", "poll", "offer-poll", "publish", "subscribe", "publish-subscribe", "exec", "serve"] {
            assert_eq!(mode.parse::<Access>().unwrap().to_string(), mode);
        }
    }
}
