//! `hf`: the hyperframes command-line tool, a netcat for typed messages.
//!
//! ```text
//! hf listen tcp://127.0.0.1:5555 --count 2
//! hf send   tcp://127.0.0.1:5555 --type demo.hello --meta k=v --size 1KiB --count 2
//! hf doctor --json
//! ```
//!
//! * `hf listen URL` binds `URL`, prints `listening on <url>` on stderr (with the real port
//!   after binding port 0), accepts any number of connections at once and prints one JSON
//!   line per received message on stdout:
//!   `{"type":"demo.hello","meta":{"k":"v"},"len":1024,"sha256":"…"}` (metadata in the
//!   message's order). `--echo` sends every message back; `--count N` exits after `N`
//!   messages in all (once the open connections have closed, or after 5 s); otherwise it
//!   runs until Ctrl-C. A connection that fails is reported on stderr as
//!   `hf: connection from <peer>: <error>` and the others go on.
//! * `hf send URL --type T` connects and sends `--count` messages (default 1) of type `T`
//!   with the `--meta KEY=VALUE` entries and a body of `--size` bytes of a fixed pattern
//!   (byte `i` is `i % 251`) or the contents of `--file`, then closes its direction and
//!   waits (briefly, see `--linger`) for the peer to close its own.
//! * `hf request URL --type T` sends one request (same flags as `hf send`) through the
//!   library's `middleware::Client` and prints the reply as a JSON line (`--body`: its raw
//!   body); an error reply or no reply within `--timeout` exits 1.
//! * `hf bench` measures latency, message rate and bandwidth of every transport with the
//!   peer in a second process (see `bench/mod.rs`).
//! * `hf doctor` checks this host against the deployment checklist (io_uring, memlock, RDMA,
//!   GPUs, NUMA, MTU, CPU governor, huge pages, socket buffers, shared memory) and prints one
//!   finding per line with its fix; `--json` prints them as JSON lines. Always exit status 0.
//!
//! Errors are one line on stderr, `hf: error: <what>`. Exit status: 0 on success, 1 when
//! something failed at run time (connection refused or lost, unreadable file, address in
//! use), 2 for a malformed command line (clap's usage errors, and bad URLs, types, metadata
//! or sizes). Logging goes to stderr through `tracing`, filtered by `RUST_LOG` (default
//! `warn`); `HYPERFRAMES_IO=auto|inline|threads|uring|epoll` picks the TCP engine.

mod bench;
mod doctor;
mod listen;
mod output;
#[cfg(feature = "tower")]
mod request;
mod send;
mod tls;
mod units;

use std::fmt;

use clap::{Parser, Subcommand};

/// Printed after the top-level help.
const AFTER_HELP: &str = "\
Examples:
  hf listen tcp://127.0.0.1:5555 --count 2
  hf send tcp://127.0.0.1:5555 --type demo.hello --meta k=v --size 1KiB --count 2
  hf request tcp://127.0.0.1:5555 --type svc.lookup --meta key=42   # print the reply
  hf bench                  # latency, rate and bandwidth of every transport, on loopback
  hf doctor                 # is this host set up for speed? each finding with its fix

URLs: tcp://HOST:PORT (IPv6 in brackets: tcp://[::1]:5555; port 0 picks a free port when
listening), tls://HOST:PORT (tcp with TLS 1.3: --cert, --key, --ca), shm://NAME or
shm:///PATH.sock (two processes on this host, shared memory),
rdma://HOST:PORT (feature rdma). inproc://NAME lives inside one process: hf listen and
hf send refuse it, as no other process could reach it.

Security: tcp:// is neither authenticated nor encrypted; bind to 127.0.0.1 or a trusted
network, or use tls:// with certificates (mutual with --ca on the listener). shm:// admits
only this user's processes. rdma:// is as open as tcp://: trusted fabrics only.

Exit status: 0 success; 1 run-time failure (connection refused or lost, unreadable file,
address in use); 2 bad command line (unknown flag, bad URL, type, metadata or size).

Environment:
  RUST_LOG        log filter for stderr (default: warn), e.g. RUST_LOG=hyperframes=debug
  HYPERFRAMES_IO  TCP engine: auto (default: inline), inline, threads, uring or epoll";

/// Typed, zero-copy messaging from the command line.
///
/// `hf listen` prints every message it receives as a JSON line; `hf send` sends messages.
#[derive(Debug, Parser)]
#[command(
    name = "hf",
    version,
    propagate_version = true,
    subcommand_required = true,
    arg_required_else_help = true,
    after_help = AFTER_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Listen at a URL and print each received message as one JSON line on stdout.
    #[command(after_help = listen::AFTER_HELP)]
    Listen(listen::ListenArgs),
    /// Connect to a URL and send messages.
    #[command(after_help = send::AFTER_HELP)]
    Send(send::SendArgs),
    /// Send one request to a service and print its reply.
    #[cfg(feature = "tower")]
    #[command(after_help = request::AFTER_HELP)]
    Request(request::RequestArgs),
    /// Measure latency, message rate and bandwidth, with the peer in a second process.
    #[command(after_help = bench::AFTER_HELP)]
    Bench(bench::BenchArgs),
    /// Check this host for speed (io_uring, memlock, RDMA, GPUs, NUMA, MTU, buffers), with fixes
    #[command(after_help = doctor::AFTER_HELP)]
    Doctor(doctor::DoctorArgs),
}

/// Why `hf` stops with a non-zero status: one line for stderr and the status.
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    /// A bad command line (a value clap could not check): exit status 2.
    pub(crate) fn usage(message: impl fmt::Display) -> Failure {
        Failure {
            code: 2,
            message: format!("{message:#}"),
        }
    }

    /// A failure at run time: exit status 1.
    pub(crate) fn runtime(message: impl fmt::Display) -> Failure {
        Failure {
            code: 1,
            message: format!("{message:#}"),
        }
    }
}

/// Builds the context, reporting a bad `HYPERFRAMES_IO` (which `Context::new` would only log).
/// A setting out of range, from the command line or the environment, is a usage error
/// (status 2), as clap's own are.
pub(crate) fn build_context(
    builder: hyperframes::ContextBuilder,
) -> Result<hyperframes::Context, Failure> {
    builder.build().map_err(|e| match e.kind() {
        hyperframes::ErrorKind::Config => Failure::usage(e),
        _ => Failure::runtime(e),
    })
}

/// `hf listen` and `hf send` run in a process of their own: an `inproc://` name there can
/// never be reached by anyone else. Refused as a usage error, naming what to use instead.
pub(crate) fn reachable(url: &str) -> Result<(), Failure> {
    match hyperframes::Endpoint::parse(url)
        .map_err(Failure::usage)?
        .scheme()
    {
        "inproc" => Err(Failure::usage(format!(
            "{url}: inproc:// channels exist inside one process, and no other process can reach \
             this one's; use tcp://HOST:PORT, or shm://NAME between processes on this host"
        ))),
        _ => Ok(()),
    }
}

/// Runs `work` on a multi-threaded runtime.
fn multi_thread(work: impl Future<Output = Result<(), Failure>>) -> Result<(), Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start a runtime: {e:#}")))?
        .block_on(work)
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // Fails only when a subscriber is already set, which nothing else here does.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a terminal: a pipe or a log file gets plain lines (and the
        // workspace's unified features may turn tracing-subscriber's `ansi` on).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn main() {
    // Usage errors, --help and --version are clap's: it prints them and exits (2 or 0).
    let cli = Cli::parse();
    init_logging();
    let result = match cli.command {
        // The bench pins threads first, then builds its own single-threaded runtime.
        Command::Bench(args) => bench::main(args),
        Command::Listen(args) => multi_thread(listen::run(args)),
        Command::Send(args) => multi_thread(send::run(args)),
        #[cfg(feature = "tower")]
        Command::Request(args) => multi_thread(request::run(args)),
        Command::Doctor(args) => multi_thread(doctor::run(args)),
    };
    let code = match result {
        Ok(()) => 0,
        Err(f) => {
            eprintln!("hf: error: {}", f.message);
            f.code
        }
    };
    output::flush_stdout();
    // Exit here rather than unwinding the runtime: connection tasks may still be parked on
    // channels that the process is about to abandon, and nothing they hold needs dropping
    // (close() already handed everything to the kernel).
    std::process::exit(code.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
