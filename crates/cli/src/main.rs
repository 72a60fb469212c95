//! The `petrel` command.
//!
//! The map of the crate: `main.rs` parses the command line; `server_cmd.rs` runs `serve` and
//! the client commands (`produce`, `consume`, `queue`, …); `pubsub_cmd.rs` topics and functions;
//! `log_cmd.rs` `log verify/dump` and the embedded commands; `user_cmd.rs` users; `acl_cmd.rs` ACLs;
//! `stat_cmd.rs` `stat`; `bench*.rs` the benchmarks; `output.rs`, `lines.rs` and `progress.rs`
//! what the commands print.

#![forbid(unsafe_code)]

mod acl_cmd;
mod bench;
mod bench_cluster;
mod bench_memcache;
mod bench_pubsub;
mod bench_queue;
mod bench_soak;
mod lines;
mod log_cmd;
mod output;
mod progress;
mod pubsub_cmd;
mod server_cmd;
mod stat_cmd;
mod target;
mod user_cmd;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's allocator: the server allocates and frees a buffer or a message
/// per request, and glibc's trimming and consolidation (and the page faults that follow them)
/// cost more there than mimalloc's per-thread free lists.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Where data lives when no directory is given.
pub const DEFAULT_DATA_DIR: &str = "petrel-data";

#[derive(Parser)]
#[command(name = "petrel", version, about = "Petrel: a fast, durable message queue")]
struct Cli {
    /// Log lines on stderr as text (colours only on a terminal) or as one JSON object each.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Offline tools for a log directory.
    #[command(subcommand)]
    Log(log_cmd::LogCommand),
    /// Load generators that measure Petrel on this machine.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Run the server (until SIGTERM or SIGINT).
    Serve(server_cmd::ServeArgs),
    /// Offer each line of stdin to a queue (its line end, `\n` or `\r\n`, is not part of the message).
    Produce(server_cmd::ProduceArgs),
    /// Print messages taken from a queue, each acknowledged once written to stdout: what is
    /// not written (a closed pipe, a full disk) stays in the queue (exit status 3: read to its
    /// end, but a cluster's servers that were down were not read).
    Consume(server_cmd::ConsumeArgs),
    /// Create, list, remove and inspect queues.
    #[command(subcommand)]
    Queue(server_cmd::QueueCommand),
    /// Create, list and remove topics; publish to and subscribe to one.
    #[command(subcommand)]
    Topic(pubsub_cmd::TopicCommand),
    /// Call a function served by some client and print its reply.
    Call(pubsub_cmd::CallArgs),
    /// Serve a function from the command line: answer calls with a command's output.
    Reply(pubsub_cmd::ReplyArgs),
    /// A live view of the server's queues: depth, rates in and out, open reads.
    Stat(stat_cmd::StatArgs),
    /// Add, remove and list the users of a users file; change a password.
    #[command(subcommand)]
    User(user_cmd::UserCommand),
    /// What a configuration's ACLs say: its entries, and what a user may do to a destination.
    #[command(subcommand)]
    Acl(acl_cmd::AclCommand),
    /// Certificates: `cert dev` writes a CA, a server and a client certificate for development.
    #[command(subcommand)]
    Cert(user_cmd::CertCommand),
}

/// Whether a closed stdout fails this run: for commands whose exit status is their verdict or
/// whose work goes on past what they print (a verify, a repair, an append, certificates, the
/// server). For those that only print what they read, it ends them quietly (`| head`).
static STDOUT_MUST_STAY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn main() -> ExitCode {
    exit_quietly_on_broken_pipe();
    let cli = Cli::parse();
    let must_stay = matches!(
        cli.command,
        Command::Log(log_cmd::LogCommand::Verify { .. } | log_cmd::LogCommand::Repair { .. })
            | Command::Log(log_cmd::LogCommand::Append(_))
            | Command::Cert(_)
            | Command::Serve(_)
    );
    STDOUT_MUST_STAY.store(must_stay, std::sync::atomic::Ordering::Relaxed);
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let logs = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter);
    match cli.log_format {
        LogFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        LogFormat::Json => logs.json().init(),
    }
    let result = match cli.command {
        Command::Log(cmd) => log_cmd::run(cmd),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Serve(args) => server_cmd::serve(args),
        Command::Produce(args) => server_cmd::produce(args),
        Command::Consume(args) => server_cmd::consume(args),
        Command::Queue(cmd) => server_cmd::queue(cmd),
        Command::Topic(cmd) => pubsub_cmd::topic(cmd),
        Command::Call(args) => pubsub_cmd::call(args),
        Command::Reply(args) => pubsub_cmd::reply(args),
        Command::Stat(args) => stat_cmd::stat(args),
        Command::User(cmd) => user_cmd::user(cmd),
        Command::Acl(cmd) => acl_cmd::acl(cmd),
        Command::Cert(cmd) => user_cmd::cert(cmd),
    };
    let broken_pipe = |e: &(dyn std::error::Error + 'static)| {
        e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    };
    match result {
        Ok(code) => code,
        Err(e) if broken_pipe(e.as_ref()) && !STDOUT_MUST_STAY.load(std::sync::atomic::Ordering::Relaxed) => {
            ExitCode::SUCCESS
        }
        Err(e) => {
            // (A stderr nobody reads does not turn the failure into a panic.)
            let _ = writeln!(std::io::stderr(), "petrel: {e}");
            ExitCode::from(2)
        }
    }
}

/// `petrel … | head` closes our stdout early; `println!` then panics. That is not an error of
/// ours: end quietly, as other command-line tools do, unless the command's work or verdict
/// goes on past what it prints (`STDOUT_MUST_STAY`: exit 1). A stderr nobody reads is not
/// this case: a failure written there still exits as a failure.
fn exit_quietly_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.contains("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(i32::from(STDOUT_MUST_STAY.load(std::sync::atomic::Ordering::Relaxed)));
        }
        if message.contains("failed printing to stderr") {
            std::process::exit(2); // (the default hook would print it there too)
        }
        default(info);
    }));
}

/// The default data directory, relative to the working directory.
pub fn default_data_dir() -> PathBuf {
    PathBuf::from(DEFAULT_DATA_DIR)
}

/// A benchmark's own directory, `DATA/NAME-PID`. Removing it removes `DATA` too if the run made
/// it and nothing else is in it: a benchmark leaves no empty `./petrel-data` behind.
pub(crate) struct BenchDir {
    pub path: PathBuf,
    data: PathBuf,
    made_data: bool,
}

impl BenchDir {
    pub fn new(data: &std::path::Path, name: &str) -> BenchDir {
        BenchDir {
            path: data.join(format!("{name}-{}", std::process::id())),
            data: data.to_owned(),
            made_data: !data.exists(),
        }
    }

    pub fn remove(&self) -> std::io::Result<()> {
        if self.path.exists() {
            std::fs::remove_dir_all(&self.path)?;
        }
        if self.made_data {
            let _ = std::fs::remove_dir(&self.data); // only if empty
        }
        Ok(())
    }
}
