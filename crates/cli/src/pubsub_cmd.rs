//! `petrel topic …` and `petrel call`: topics and functions against a server.

use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use petrel_client::Message;
use petrel_client::blocking::Client;

use crate::server_cmd::ServerArg;

type Res = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Subcommand)]
pub enum TopicCommand {
    /// Create a topic (no-op if it exists).
    Create {
        name: String,
        #[command(flatten)]
        server: ServerArg,
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
        /// Messages the server may hold for this subscriber before ending it (0: its default).
        #[arg(long, default_value_t = 0)]
        buffer: u32,
        /// One JSON object per message, with every field.
        #[arg(long)]
        json: bool,
    },
}

pub fn topic(cmd: TopicCommand) -> Res {
    match cmd {
        TopicCommand::Create { name, server } => Client::connect(&server.server)?.create_topic(&name)?,
        TopicCommand::List { server } => {
            for name in Client::connect(&server.server)?.list_topics()? {
                println!("{name}");
            }
        }
        TopicCommand::Remove { name, server } => Client::connect(&server.server)?.remove_topic(&name)?,
        TopicCommand::Publish { name, server } => {
            let client = Client::connect(&server.server)?;
            let mut input = crate::lines::StdinLines::new(1024);
            let (mut lines, mut sent) = (Vec::new(), 0u64);
            loop {
                input.next_batch(&mut lines)?;
                if lines.is_empty() {
                    break;
                }
                sent += lines.len() as u64;
                client.publish(&name, lines.drain(..).map(Message::new).collect())?;
            }
            eprintln!("{sent} messages published to {name}");
        }
        TopicCommand::Subscribe { name, server, count, buffer, json } => {
            let client = Client::connect(&server.server)?;
            let mut left = count.unwrap_or(u64::MAX);
            let mut out = io::stdout().lock();
            let mut sub = client.subscribe(&name, buffer)?;
            while left > 0 {
                let Some(m) = sub.next() else { break };
                let m = m?;
                if json {
                    writeln!(out, "{}", serde_json::to_string(&m)?)?;
                } else {
                    out.write_all(&m.payload)?;
                    out.write_all(b"\n")?;
                }
                out.flush()?;
                left -= 1;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
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
    let client = Client::connect(&args.server.server)?;
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
