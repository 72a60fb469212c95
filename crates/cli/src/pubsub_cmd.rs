//! `petrel topic …` and `petrel call`: topics and functions against a server.

use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use petrel_client::{Message, StartFrom};

use crate::server_cmd::ServerArg;

type Res = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Subcommand)]
pub enum TopicCommand {
    /// Create a topic (no-op if it exists).
    Create {
        name: String,
        #[command(flatten)]
        server: ServerArg,
        /// Keep a log of everything published, for consumer groups (`subscribe --group`).
        #[arg(long)]
        durable: bool,
    },
    List {
        #[command(flatten)]
        server: ServerArg,
    },
    /// Remove a topic; its subscriptions end.
    Remove {
        name: String,
        #[command(flatten)]
        server: ServerArg,
    },
    /// Publish each line of stdin to every current subscriber.
    Publish {
        name: String,
        #[command(flatten)]
        server: ServerArg,
    },
    /// Print the topic's messages as they are published, one payload per line.
    Subscribe {
        name: String,
        #[command(flatten)]
        server: ServerArg,
        /// Stop after this many messages.
        #[arg(long)]
        count: Option<u64>,
        /// Messages the server may hold for this subscriber before ending it (0: its default);
        /// with --group, most messages unacknowledged at once.
        #[arg(long, default_value_t = 0)]
        buffer: u32,
        /// Read a durable topic as this consumer group: each message is acknowledged once
        /// printed, and the group resumes after the last acknowledged one next time.
        #[arg(long)]
        group: Option<String>,
        /// With --group: where to start: oldest, newest, an offset, or a time (RFC 3339);
        /// default: where the group stands.
        #[arg(long, value_parser = parse_from)]
        from: Option<StartFrom>,
        /// One JSON object per message, with every field (payload and headers in base64).
        #[arg(long)]
        json: bool,
    },
}

pub fn topic(cmd: TopicCommand) -> Res {
    match cmd {
        TopicCommand::Create { name, server, durable } => server.connect()?.create_topic(&name, durable)?,
        TopicCommand::List { server } => {
            for name in server.connect()?.list_topics()? {
                println!("{name}");
            }
        }
        TopicCommand::Remove { name, server } => server.connect()?.remove_topic(&name)?,
        TopicCommand::Publish { name, server } => {
            let client = server.connect()?;
            let mut input = crate::lines::StdinLines::new(1024);
            let (mut lines, mut sent) = (Vec::new(), 0u64);
            // How many subscribers the messages reached: the fewest and the most of any batch.
            let mut reached: Option<(u32, u32)> = None;
            loop {
                input.next_batch(&mut lines)?;
                if lines.is_empty() {
                    break;
                }
                sent += lines.len() as u64;
                let n = client.publish(&name, lines.drain(..).map(Message::new).collect())?;
                reached = Some(reached.map_or((n, n), |(lo, hi)| (lo.min(n), hi.max(n))));
            }
            let subscribers = match reached {
                Some((lo, hi)) if lo == hi => {
                    format!(", each to {}", crate::output::count(u64::from(hi), "subscriber"))
                }
                Some((lo, hi)) => format!(", each to {lo} to {hi} subscribers"),
                None => String::new(),
            };
            eprintln!("{} published to {name}{subscribers}", crate::output::count(sent, "message"));
        }
        TopicCommand::Subscribe { name, server, count, buffer, json, group, from } => {
            let client = server.connect()?;
            let mut left = count.unwrap_or(u64::MAX);
            let mut out = io::stdout().lock();
            let mut sub = match &group {
                Some(g) => client.subscribe_group(&name, g, from.unwrap_or_default(), buffer)?,
                None if from.is_some() => return Err("--from needs --group".into()),
                None => client.subscribe(&name, buffer)?,
            };
            while left > 0 {
                let Some(m) = sub.next() else { break };
                let m = m?;
                let id = m.id;
                if json {
                    writeln!(out, "{}", crate::output::message_json(&m))?;
                } else {
                    out.write_all(&m.payload)?;
                    out.write_all(b"\n")?;
                }
                out.flush()?;
                if group.is_some() {
                    sub.ack(&[id])?;
                }
                left -= 1;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn parse_from(text: &str) -> Result<StartFrom, String> {
    Ok(match text {
        "oldest" => StartFrom::Oldest,
        "newest" => StartFrom::Newest,
        _ => match text.parse::<u64>() {
            Ok(offset) => StartFrom::Offset(offset),
            Err(_) => {
                let t = humantime::parse_rfc3339_weak(text)
                    .map_err(|e| format!("{text:?}: not oldest, newest, an offset or a time ({e})"))?;
                let ns = t.duration_since(std::time::UNIX_EPOCH).map_err(|e| e.to_string())?.as_nanos();
                StartFrom::Time(ns as u64)
            }
        },
    })
}

#[derive(clap::Args)]
pub struct CallArgs {
    function: String,
    #[command(flatten)]
    server: ServerArg,
    /// The request's payload (default: stdin).
    #[arg(long)]
    data: Option<String>,
    /// How long to wait for the reply, e.g. "500ms", "5s" (default: the server's, 30 s).
    #[arg(long)]
    timeout: Option<humantime::Duration>,
    /// Do not wait for a reply.
    #[arg(long)]
    oneway: bool,
}

/// Calls a function and prints its reply's payload.
pub fn call(args: CallArgs) -> Res {
    let payload = match args.data {
        Some(d) => d.into_bytes(),
        None => {
            let mut buf = Vec::new();
            io::Read::read_to_end(&mut io::stdin(), &mut buf)?;
            buf
        }
    };
    let client = args.server.connect()?;
    if args.oneway {
        client.call_oneway(&args.function, Message::new(payload))?;
        return Ok(ExitCode::SUCCESS);
    }
    let timeout = args.timeout.map(Duration::from);
    let reply = client.call(&args.function, Message::new(payload), timeout)?;
    let mut out = io::stdout().lock();
    out.write_all(&reply.payload)?;
    if !reply.payload.ends_with(b"\n") {
        out.write_all(b"\n")?;
    }
    Ok(ExitCode::SUCCESS)
}
