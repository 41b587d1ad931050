//! `hf listen`: accept connections, print what arrives, optionally echo it back.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use hyperframes::{Channel, Context};
use tokio::task::JoinSet;

use crate::output::{Printer, json_line};
#[cfg(feature = "tower")]
use crate::request::echo_of;
use crate::units::{human_bytes, parse_size};
use crate::{Failure, build_context};

/// Printed after `hf listen --help`.
pub(crate) const AFTER_HELP: &str = "\
Output: one JSON object per message and line on stdout, flushed at once:
  {\"type\":\"demo.hello\",\"meta\":{\"k\":\"v\"},\"len\":1024,\"sha256\":\"<hex of the body>\"}
with the metadata in the order the sender set it. On stderr: `listening on <url>` once bound
(with the real port when URL asks for port 0), and `hf: connection from <peer>: <error>`
when a connection fails (its peer died, or broke the protocol); listening goes on.

Text the peer chose (metadata values, its error reasons) is printed escaped: control
characters, C1 controls and bidi overrides come out as \\u escapes, never raw.

Security: tcp:// has no authentication and no encryption: anyone who can reach the port can
send to it and read the echoes. Listen on 127.0.0.1 unless the network is trusted, or use
tls:// (TLS 1.3): --cert and --key prove this listener, and with --ca every client must
present a certificate that CA signed (mutual TLS). Each connection's verified client
certificate is named on stderr.

Examples:
  hf listen tcp://127.0.0.1:0                 # any free port; see stderr for which
  hf listen tcp://127.0.0.1:5555 --echo --count 10
  hf listen tls://0.0.0.0:5555 --cert node.crt --key node.key --ca cluster-ca.crt";

/// How long, once `--count` is reached, open connections get to end cleanly.
const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// Arguments of `hf listen`.
#[derive(Debug, Args)]
pub(crate) struct ListenArgs {
    /// Where to listen: tcp://HOST:PORT (port 0 picks a free one), tls://HOST:PORT,
    /// shm://NAME or shm:///PATH.sock.
    #[arg(value_name = "URL")]
    url: String,

    /// Exit (status 0) after printing N messages in all connections [default: run until
    /// Ctrl-C]
    ///
    /// Connections still open then get up to 5 s to close cleanly; what they send meanwhile
    /// is not printed.
    #[arg(short = 'n', long, value_name = "N")]
    count: Option<u64>,

    /// Send every received message back on its channel.
    #[arg(short, long)]
    echo: bool,

    /// Largest message body accepted (advertised to peers, which refuse to send more).
    #[arg(long, value_name = "SIZE", default_value = "64MiB", long_help = format!(
        "Largest message body accepted (advertised to peers, which refuse to send more). {}",
        crate::units::SIZE_HELP
    ))]
    max_body: String,

    /// tcp://, tls://: the most connections held at once, handshakes included; past it new
    /// ones wait in the kernel's backlog
    #[arg(long, value_name = "N", default_value_t = 4096)]
    max_connections: usize,

    /// tcp://, tls://: the most connections one peer address may hold; more are closed
    /// unread and counted
    #[arg(long, value_name = "N", default_value_t = 512)]
    max_per_peer: usize,

    /// tcp://, tls://: the most handshakes running at once (each has 5 s)
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_handshakes: usize,

    /// Drop a connection whose peer, having promised no heartbeats, sends nothing for SECS;
    /// 0: never
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    idle_timeout: f64,

    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

/// Runs `hf listen`.
pub(crate) async fn run(args: ListenArgs) -> Result<(), Failure> {
    crate::reachable(&args.url)?;
    args.tls.check(&args.url, true)?;
    let max_body =
        parse_size(&args.max_body).map_err(|e| Failure::usage(format!("bad --max-body {e:#}")))?;
    if !(args.idle_timeout >= 0.0 && args.idle_timeout <= 1e9) {
        return Err(Failure::usage(format!(
            "bad --idle-timeout {}: expected seconds, 0 for never",
            args.idle_timeout
        )));
    }
    let idle = (args.idle_timeout > 0.0).then(|| Duration::from_secs_f64(args.idle_timeout));
    let builder = Context::builder()
        .max_body(max_body)
        .max_connections(args.max_connections)
        .max_connections_per_peer(args.max_per_peer)
        .max_handshakes(args.max_handshakes)
        .idle_timeout(idle);
    let ctx = build_context(args.tls.apply(builder)?)?;
    let mut listener = ctx
        .bind(&args.url)
        .await
        .map_err(|e| Failure::runtime(format!("cannot listen on {}: {e:#}", args.url)))?;
    // Catch Ctrl-C from now on, before saying that we listen.
    let interrupted = interrupted()?;
    eprintln!("listening on {}", listener.local_url());
    tracing::info!(
        url = listener.local_url(),
        max_body = %human_bytes(max_body),
        "listening"
    );

    let printer = Arc::new(Printer::new(args.count));
    let finished = printer.finished();
    tokio::pin!(finished, interrupted);
    let mut connections = JoinSet::new();
    let end = loop {
        tokio::select! {
            biased;
            end = &mut finished => break end,
            () = &mut interrupted => return Ok(()),
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let ch = accepted.map_err(|e| {
                    Failure::runtime(format!("listener on {} failed: {e:#}", listener.local_url()))
                })?;
                connections.spawn(serve(ch, printer.clone(), args.echo));
            }
        }
    };
    // The count is reached: refuse new connections, and give the open ones a moment to end
    // cleanly (each reads on until its peer closes), so that a sender that sent exactly
    // what was counted sees a clean close rather than a vanished peer.
    drop(listener);
    let drained = tokio::time::timeout(DRAIN_GRACE, async {
        while connections.join_next().await.is_some() {}
    });
    tokio::select! {
        _ = drained => {}
        () = &mut interrupted => {}
    }
    end
}

/// Completes at the next SIGINT (Ctrl-C). The handler is installed by this call, so a
/// signal that comes while the caller is busy elsewhere is not lost.
#[cfg(unix)]
fn interrupted() -> Result<impl Future<Output = ()>, Failure> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut sigint = signal(SignalKind::interrupt())
        .map_err(|e| Failure::runtime(format!("cannot catch Ctrl-C: {e:#}")))?;
    Ok(async move {
        sigint.recv().await;
    })
}

/// Completes at the next Ctrl-C.
#[cfg(not(unix))]
fn interrupted() -> Result<impl Future<Output = ()>, Failure> {
    Ok(async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot catch Ctrl-C: {e:#}");
            std::future::pending::<()>().await;
        }
    })
}

/// Without `hf request` (feature tower), an echo is the message itself.
#[cfg(not(feature = "tower"))]
fn echo_of(msg: hyperframes::Message) -> hyperframes::Message {
    msg
}

/// Prints (and echoes) what one connection sends until it closes or fails. Once the
/// printer takes no more lines, it closes its sending side and reads on, discarding, until
/// the peer closes.
async fn serve(ch: Channel, printer: Arc<Printer>, echo: bool) {
    let peer = ch.info().peer_url().to_owned();
    tracing::info!(%peer, "connection accepted");
    if let Some(id) = ch.info().peer_identity() {
        // The peer's own text, escaped by Display.
        eprintln!("hf: connection from {peer}: certificate {id}");
    }
    let (mut tx, mut rx) = ch.split();
    let mut echoing = echo;
    let mut printing = true;
    let mut received = 0u64;
    while let Some(next) = rx.recv().await {
        let msg = match next {
            Ok(msg) => msg,
            Err(e) => {
                eprintln!("hf: connection from {peer}: {e:#}");
                return;
            }
        };
        received += 1;
        if !printing {
            continue;
        }
        let line = json_line(&msg);
        // Echo before printing, so that when this line is the last one `--count` waits for,
        // the echo has reached the kernel before the process exits.
        if echoing {
            let sent = async {
                tx.send(echo_of(msg)).await?;
                tx.flush().await
            };
            if let Err(e) = sent.await {
                // A broken connection is reported once, by the receiving side, next; a peer
                // that stopped receiving is worth a line of its own. Either way, keep
                // printing what arrives.
                if e.is_connection_lost() {
                    tracing::debug!(%peer, "cannot echo: {e:#}");
                } else {
                    eprintln!("hf: connection from {peer}: cannot echo: {e:#}");
                }
                echoing = false;
            }
        }
        if !printer.print(&line) {
            printing = false;
            // Nothing more comes from this side.
            let _ = tx.close().await;
        }
    }
    tracing::info!(%peer, received, "connection closed by the peer");
    // Dropping `tx` closes too, without waiting; with echoes, wait until they are all in
    // the kernel.
    if echoing && printing {
        let _ = tx.close().await;
    }
}
