//! `petrel topic …` and `petrel call`: topics and functions against a server.

use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;
use petrel_client::{Message, StartFrom};

use crate::server_cmd::ServerArg;
use crate::target::Target;

type Res = Result<ExitCode, Box<dyn std::error::Error>>;

#[derive(Subcommand)]
pub enum TopicCommand {
    /// Create a topic (no-op if it exists with the same durability).
    Create {
        /// The topic's name.
        name: String,
        #[command(flatten)]
        server: ServerArg,
        /// Keep a log of everything published, for consumer groups (`subscribe --group`).
        #[arg(long)]
        durable: bool,
    },
    /// List the topics.
    List {
        #[command(flatten)]
        server: ServerArg,
    },
    /// Remove a topic; its subscriptions end.
    Remove {
        /// The topic's name.
        name: String,
        #[command(flatten)]
        server: ServerArg,
    },
    /// Publish each line of stdin to every current subscriber.
    Publish {
        /// The topic's name.
        name: String,
        #[command(flatten)]
        server: ServerArg,
    },
    /// Print the topic's messages as they are published, one payload per line.
    Subscribe {
        /// The topic's name.
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
        /// printed, and the group resumes after the last acknowledged one next time. With a
        /// list of servers, the group reads every server's log (an offset in --from is each
        /// server's).
        #[arg(long)]
        group: Option<String>,
        /// With --group: where to start: oldest, newest, an offset, or a time (RFC 3339);
        /// default: where the group stands (a new group: the newest, so that only messages
        /// published from now on come; `--from oldest` reads what the log holds).
        #[arg(long, value_parser = parse_from)]
        from: Option<StartFrom>,
        /// One JSON object per message, with every field (payload and headers in base64).
        #[arg(long)]
        json: bool,
    },
}

pub fn topic(cmd: TopicCommand) -> Res {
    match cmd {
        TopicCommand::Create { name, server, durable } => server.target()?.create_topic(&name, durable)?,
        TopicCommand::List { server } => {
            let target = server.target()?;
            for name in target.list_topics()? {
                println!("{name}");
            }
            if let Some(partial) = target.partial_listing() {
                return Ok(partial);
            }
        }
        TopicCommand::Remove { name, server } => server.target()?.remove_topic(&name)?,
        TopicCommand::Publish { name, server } => {
            let client = server.target()?;
            let mut input = crate::lines::StdinLines::new(1024);
            let (mut lines, mut sent) = (Vec::new(), 0u64);
            // How many subscribers the messages reached: the fewest and the most of any batch.
            let mut reached: Option<(u32, u32)> = None;
            loop {
                input.next_batch(&mut lines)?;
                if lines.is_empty() {
                    break;
                }
                let batch = lines.len() as u64;
                let n = match client.publish(&name, lines.drain(..).map(Message::new).collect()) {
                    Ok(n) => n,
                    Err(e) => {
                        // Say what went out, so that a rerun does not publish it again.
                        if sent > 0 {
                            eprintln!(
                                "{} published to {name} (the first {sent} lines) before line {} failed",
                                crate::output::count(sent, "message"),
                                sent + 1
                            );
                        }
                        if e.is_connection_lost() {
                            eprintln!(
                                "petrel: the connection was lost before the answer to lines {} to {}: they may have gone out too",
                                sent + 1,
                                sent + batch
                            );
                        }
                        return Err(e.into());
                    }
                };
                sent += batch;
                reached = Some(reached.map_or((n, n), |(lo, hi)| (lo.min(n), hi.max(n))));
            }
            let subscribers = match reached {
                Some((lo, hi)) if lo == hi => {
                    format!(", each to {}", crate::output::count(u64::from(hi), "live subscriber"))
                }
                Some((lo, hi)) => format!(", each to {lo} to {hi} live subscribers"),
                None => String::new(),
            };
            // A durable topic keeps what is published whoever listens, and its consumer groups read
            // it there (they are not counted as live subscribers): "0 subscribers" alone would read
            // as lost.
            let kept = match sent > 0 && client.topic_is_durable(&name) == Some(true) {
                true => ", kept in its log for its consumer groups",
                false => "",
            };
            eprintln!("{} published to {name}{kept}{subscribers}", crate::output::count(sent, "message"));
        }
        TopicCommand::Subscribe { name, server, count, buffer, json, group, from } => {
            if group.is_none() && from.is_some() {
                return Err("--from needs --group".into());
            }
            let mut left = count.unwrap_or(u64::MAX);
            let mut out = io::stdout().lock();
            // A server that goes away is waited for: a group resumes where it stands (what was
            // printed and not acknowledged comes again: at least once); a live subscription
            // misses what was published meanwhile.
            if server.is_cluster() {
                // Every server's messages, each server subscribed again when it comes back; a
                // group's messages acknowledged on their server once printed.
                let Target::Many(cluster) = server.target()? else { unreachable!("a list is a cluster") };
                let mut subscription = match &group {
                    Some(g) => cluster.subscribe_group(&name, g, from.unwrap_or_default(), buffer)?,
                    None => cluster.subscribe(&name, buffer)?,
                };
                while left > 0 {
                    let Some(d) = subscription.next_delivery() else { break };
                    let d = d?;
                    print_message(&mut out, &d.message, json, group.is_some())?;
                    left -= 1;
                    if group.is_some() {
                        subscription.ack(&[d.handle])?;
                    }
                }
                return Ok(ExitCode::SUCCESS);
            }
            let follower = server.follower()?;
            let mut subscription = match &group {
                Some(g) => follower.subscribe_group(&name, g, from.unwrap_or_default(), buffer)?,
                None => follower.subscribe(&name, buffer)?,
            };
            while left > 0 {
                let Some(m) = subscription.next() else { break };
                let m = m?;
                print_message(&mut out, &m, json, group.is_some())?;
                left -= 1;
                if group.is_some() {
                    subscription.ack(&[m.id])?;
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a message's payload as a line, or the whole message as JSON; one a group read from
/// the topic's log with its `offset` (what `--from` takes; its id is the offset + 1).
fn print_message(out: &mut impl Write, m: &Message, json: bool, from_log: bool) -> io::Result<()> {
    if json {
        let mut j = crate::output::message_json(m);
        if from_log {
            j["offset"] = m.id.saturating_sub(1).into();
        }
        writeln!(out, "{j}")?;
    } else {
        out.write_all(&m.payload)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

fn parse_from(text: &str) -> Result<StartFrom, String> {
    Ok(match text {
        "oldest" => StartFrom::Oldest,
        "newest" => StartFrom::Newest,
        _ => match text.parse::<u64>() {
            Ok(offset) => StartFrom::Offset(offset),
            Err(_) => StartFrom::Time(
                crate::output::unix_ns(text).map_err(|e| format!("{e} (nor oldest, newest, an offset)"))?,
            ),
        },
    })
}

#[derive(clap::Args)]
pub struct CallArgs {
    /// The function's name.
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
    let client = args.server.target()?;
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

#[derive(clap::Args)]
pub struct ReplyArgs {
    /// The function to serve.
    function: String,
    #[command(flatten)]
    server: ServerArg,
    /// Answer each call with this shell command's output: the request's payload on its stdin,
    /// the reply its stdout; a non-zero exit is a HANDLER_ERROR with its stderr.
    #[arg(long)]
    exec: Option<String>,
    /// Answer each call with this text (when there is no --exec); default: the request itself.
    #[arg(long, conflicts_with = "exec")]
    text: Option<String>,
    /// Stop after this many calls (default: serve until interrupted).
    #[arg(long)]
    count: Option<u64>,
}

/// Serves a function from the command line (as `nats reply` does), until interrupted or
/// `--count` calls: a way to try `petrel call` without writing a program.
pub fn reply(args: ReplyArgs) -> Res {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        // On every server listed, and again on one that comes back after a loss.
        let client = petrel_client::Cluster::connect(&args.server.servers(), args.server.cluster_options()?).await?;
        let answered = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let (exec, text, done) = (args.exec.clone(), args.text.clone(), std::sync::Arc::clone(&answered));
        client
            .serve(&args.function, move |request: Message| {
                let (exec, text, done) = (exec.clone(), text.clone(), std::sync::Arc::clone(&done));
                async move {
                    let reply = match (exec, text) {
                        (Some(command), _) => run_handler(&command, &request.payload).await,
                        (None, Some(text)) => Ok(text.into_bytes()),
                        (None, None) => Ok(request.payload.to_vec()),
                    };
                    done.add_permits(1);
                    reply.map(Message::new)
                }
            })
            .await?;
        eprintln!("serving {} (Ctrl-C to stop)", args.function);
        let served = async {
            match args.count {
                Some(n) => drop(answered.acquire_many(u32::try_from(n).unwrap_or(u32::MAX)).await),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = served => tokio::time::sleep(Duration::from_millis(100)).await, // the last reply goes out
            _ = tokio::signal::ctrl_c() => {}
        }
        drop(client);
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Runs `command` with `input` on its stdin: its stdout, or its stderr as the error.
async fn run_handler(command: &str, input: &[u8]) -> Result<Vec<u8>, String> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new("sh")
        .args(["-c", command])
        // The server's password is this process's, not the handler's: a handler that prints its
        // environment (or a tool it runs that logs it) would hand it to every caller.
        .env_remove("PETREL_PASSWORD")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("{command}: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped");
    let input = input.to_vec();
    let feeding = tokio::spawn(async move {
        let _ = stdin.write_all(&input).await; // a command may not read it all
    });
    let out = child.wait_with_output().await.map_err(|e| format!("{command}: {e}"))?;
    let _ = feeding.await;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(format!("{command}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}
