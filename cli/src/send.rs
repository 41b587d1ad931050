//! `hf send`: connect, send messages, close.

use std::io::{self, Read as _};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use hyperframes::{Body, Channel, Context, Endpoint, ErrorKind, Header, Message, Meta, MsgType};

use crate::units::{SIZE_HELP, human_bytes, parse_size};
use crate::{Failure, build_context};

/// Printed after `hf send --help`.
pub(crate) const AFTER_HELP: &str = "\
The body is empty unless --size or --file says otherwise. A --size body is a fixed pattern:
byte i is (i mod 251), so a listener can check it by its SHA-256.

Messages are queued without waiting for each write; at the end hf closes its direction
(which waits until everything is in the kernel), then waits up to --linger seconds for the
peer to close its own (draining anything it echoed meanwhile) and exits 0. Nothing is
printed on stdout.

tls:// needs --ca (the CA that signed the server's certificate, which must name the URL's
host or --server-name), and --cert and --key where the listener asks for a client
certificate.

Examples:
  hf send tcp://127.0.0.1:5555 --type demo.hello --meta k=v --size 1KiB --count 2
  hf send tls://node-7:5555 -t demo.hello --ca cluster-ca.crt --cert me.crt --key me.key
  hf send tcp://127.0.0.1:5555 -t logs.line --file /var/log/syslog
  echo hi | hf send tcp://127.0.0.1:5555 -t demo.stdin --file -";

/// Arguments of `hf send`.
#[derive(Debug, Args)]
pub(crate) struct SendArgs {
    /// Where to connect: tcp://HOST:PORT, tls://HOST:PORT, shm://NAME or shm:///PATH.sock.
    #[arg(value_name = "URL")]
    url: String,

    #[command(flatten)]
    message: MessageArgs,

    /// How many messages to send (each with the same type, metadata and body).
    #[arg(short = 'n', long, value_name = "N", default_value_t = 1)]
    count: u64,

    /// After sending, how long to wait for the peer to close its side, in seconds
    ///
    /// What the peer sends meanwhile (echoes) is read and discarded. 0 exits right after the
    /// close, even if the peer is still sending, which makes the kernel reset the
    /// connection.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    linger: f64,

    /// Print a summary on stderr when done.
    #[arg(short, long)]
    verbose: bool,

    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

/// The message `hf send` and `hf request` make: type, metadata and body.
#[derive(Debug, Args)]
pub(crate) struct MessageArgs {
    /// The message type: a dotted name such as demo.hello (segments of A-Z a-z 0-9 _ -).
    #[arg(short = 't', long = "type", value_name = "TYPE")]
    kind: String,

    /// A metadata entry, KEY=VALUE (repeatable)
    ///
    /// Entries keep their order; the first '=' splits. Keys are 1 to 64 bytes of
    /// A-Z a-z 0-9 _ - and dots; values are UTF-8.
    #[arg(short, long, value_name = "KEY=VALUE")]
    meta: Vec<String>,

    /// Body of SIZE bytes of a fixed pattern (byte i is i mod 251); e.g. 0, 64, 4k, 1MiB.
    #[arg(short, long, value_name = "SIZE", conflicts_with = "file", long_help = format!(
        "Body of SIZE bytes of a fixed pattern (byte i is i mod 251). {SIZE_HELP}"
    ))]
    size: Option<String>,

    /// Body read from a file ('-' for stdin).
    #[arg(short, long, value_name = "PATH")]
    file: Option<PathBuf>,
}

impl MessageArgs {
    /// Type, metadata and where the body comes from, checked before connecting.
    pub(crate) fn parse(&self) -> Result<(MsgType, Meta, BodySource), Failure> {
        let kind = MsgType::new(&self.kind)
            .map_err(|e| Failure::usage(format!("bad --type {:?}: {e:#}", self.kind)))?;
        Ok((kind, parse_meta(&self.meta)?, read_body(self)?))
    }
}

/// Builds a body of `len` bytes of the pattern `i % 251`.
fn pattern(len: usize) -> Bytes {
    let cycle: Vec<u8> = (0..251u8).collect();
    let mut body = Vec::with_capacity(len);
    while body.len() < len {
        let take = cycle.len().min(len - body.len());
        body.extend_from_slice(&cycle[..take]);
    }
    Bytes::from(body)
}

/// Parses `KEY=VALUE` entries into a `Meta`, in order.
fn parse_meta(entries: &[String]) -> Result<Meta, Failure> {
    let mut meta = Meta::new();
    for entry in entries {
        let Some((key, value)) = entry.split_once('=') else {
            return Err(Failure::usage(format!(
                "bad --meta {entry:?}: expected KEY=VALUE"
            )));
        };
        meta.insert(key, value)
            .map_err(|e| Failure::usage(format!("bad --meta {entry:?}: {e:#}")))?;
    }
    Ok(meta)
}

/// Where the body comes from, checked before connecting.
pub(crate) enum BodySource {
    Pattern(u64),
    Bytes(Bytes),
}

impl BodySource {
    fn len(&self) -> u64 {
        match self {
            BodySource::Pattern(n) => *n,
            BodySource::Bytes(b) => b.len() as u64,
        }
    }
}

fn read_body(args: &MessageArgs) -> Result<BodySource, Failure> {
    if let Some(size) = &args.size {
        let n = parse_size(size).map_err(|e| Failure::usage(format!("bad --size {e:#}")))?;
        return Ok(BodySource::Pattern(n));
    }
    let Some(path) = &args.file else {
        return Ok(BodySource::Pattern(0));
    };
    let read = if path.as_os_str() == "-" {
        let mut buf = Vec::new();
        io::stdin().lock().read_to_end(&mut buf).map(|_| buf)
    } else {
        std::fs::read(path)
    };
    read.map(|b| BodySource::Bytes(Bytes::from(b)))
        .map_err(|e| Failure::runtime(format!("cannot read --file {}: {e:#}", path.display())))
}

/// Connects to `url`, saying what to check when nothing listens there.
pub(crate) async fn connect(ctx: &Context, url: &str) -> Result<Channel, Failure> {
    let ch = ctx.connect(url).await.map_err(|e| {
        let shm = Endpoint::parse(url).is_ok_and(|ep| ep.scheme() == "shm");
        if e.kind() == ErrorKind::ConnectionRefused && !shm {
            Failure::runtime(format!(
                "cannot connect to {url}: connection refused (is anything listening there?)"
            ))
        } else {
            // shm: the library names the socket path it tried (it depends on
            // XDG_RUNTIME_DIR), which is what to check.
            Failure::runtime(format!("cannot connect to {url}: {e:#}"))
        }
    })?;
    tracing::info!(peer = %ch.info().peer_url(), "connected");
    Ok(ch)
}

/// The message, checked against the peer's limits before its body is built.
pub(crate) fn build(
    ch: &Channel,
    kind: MsgType,
    meta: Meta,
    source: BodySource,
) -> Result<Message, Failure> {
    let peer = ch.info().peer_url();
    let head = Message::from_parts(kind, meta, Body::new(), Header::default());
    let limits = *ch.info().peer_limits();
    limits
        .check(&head)
        .map_err(|e| Failure::runtime(format!("{peer} refuses these messages: {e:#}")))?;
    if source.len() > limits.max_body {
        return Err(Failure::runtime(format!(
            "{peer} refuses these messages: body of {} exceeds its max_body of {}",
            human_bytes(source.len()),
            human_bytes(limits.max_body)
        )));
    }
    let body = match source {
        BodySource::Pattern(n) => pattern(n as usize),
        BodySource::Bytes(b) => b,
    };
    Ok(head.with_body(body))
}

/// Runs `hf send`.
pub(crate) async fn run(args: SendArgs) -> Result<(), Failure> {
    // Everything that can be checked without the peer is checked before connecting.
    crate::reachable(&args.url)?;
    args.tls.check(&args.url, false)?;
    let (kind, meta, source) = args.message.parse()?;
    if !(args.linger.is_finite() && args.linger >= 0.0) {
        return Err(Failure::usage(format!(
            "bad --linger {}: expected a number of seconds, 0 or more",
            args.linger
        )));
    }
    let linger = Duration::from_secs_f64(args.linger.min(1e9));

    let ctx = build_context(args.tls.apply(Context::builder())?)?;
    let started = Instant::now();
    let ch = connect(&ctx, &args.url).await?;
    let peer = ch.info().peer_url().to_owned();
    let msg = build(&ch, kind, meta, source)?;
    let body_len = msg.body().len();

    let (mut tx, mut rx) = ch.split();
    // Read whatever the peer sends (an echo) while sending: a peer that echoes must never
    // be stuck on a full queue towards us, and unread data at exit would make the kernel
    // reset the connection.
    let drain = tokio::spawn(async move {
        let mut received = 0u64;
        while let Some(next) = rx.recv().await {
            match next {
                Ok(_) => received += 1,
                Err(e) => return (received, Some(e)),
            }
        }
        (received, None)
    });

    let lost = |e: hyperframes::Error| Failure::runtime(format!("sending to {peer}: {e:#}"));
    for _ in 0..args.count {
        tx.send(msg.clone()).await.map_err(lost)?;
    }
    tx.close().await.map_err(lost)?;
    let sent_in = started.elapsed();

    // Everything is in the kernel. Give the peer a moment to finish reading and close its
    // side; what happens to the connection from here on does not change the outcome.
    let echoed = match tokio::time::timeout(linger, drain).await {
        Ok(Ok((received, None))) => {
            tracing::debug!(%peer, received, "the peer closed its side");
            Some(received)
        }
        Ok(Ok((received, Some(e)))) => {
            tracing::debug!(%peer, received, "after the close: {e:#}");
            Some(received)
        }
        Ok(Err(join)) => {
            tracing::debug!("receiving task failed: {join}");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, ?linger, "the peer did not close its side in time");
            None
        }
    };
    if args.verbose {
        let echoed = echoed.map_or_else(String::new, |n| format!("; received {n} back"));
        eprintln!(
            "hf: sent {} message{} of {} ({} in all) to {peer} in {:.3?}{echoed}",
            args.count,
            if args.count == 1 { "" } else { "s" },
            human_bytes(body_len as u64),
            human_bytes(body_len as u64 * args.count),
            sent_in,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_i_mod_251() {
        let b = pattern(600);
        assert_eq!(b.len(), 600);
        assert!(b.iter().enumerate().all(|(i, &x)| x as usize == i % 251));
        assert!(pattern(0).is_empty());
    }

    #[test]
    fn meta_entries() {
        let m = parse_meta(&["k=v".into(), "expr=a=b".into(), "empty=".into()]).unwrap();
        assert_eq!(
            m.iter().collect::<Vec<_>>(),
            [("k", "v"), ("expr", "a=b"), ("empty", "")]
        );
        assert!(parse_meta(&["novalue".into()]).is_err());
        assert!(parse_meta(&["bad key=v".into()]).is_err());
        assert!(parse_meta(&["=v".into()]).is_err());
    }
}
