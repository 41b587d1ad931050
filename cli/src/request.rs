//! `hf request`: send one request, print the reply.

use std::time::Duration;

use clap::Args;
use hyperframes::middleware::Client;
use hyperframes::{Context, Flags, Header};
use tower::{Service, ServiceExt};

use crate::output::json_line;
use crate::send::{MessageArgs, build, connect};
use crate::{Failure, build_context};

/// Printed after `hf request --help`.
pub(crate) const AFTER_HELP: &str = "\
Sends one message flagged as a request (Flags::REQUEST, with a correlation id) and waits for
the reply that carries the same id, as the library's middleware::Client does. The reply is
printed on stdout as one JSON line, as hf listen prints messages:
  {\"type\":\"demo.pong\",\"meta\":{\"k\":\"v\"},\"len\":1024,\"sha256\":\"<hex of the body>\"}
or, with --body, its body's raw bytes alone.

A service built with middleware::serve answers a request it refuses or fails with an error
reply: hf prints `hf: error: <peer> failed the request ...: <its text> (<kind>)` on stderr
and exits 1, as it does when no reply comes within --timeout. `hf listen --echo` answers
every request with the request itself.

Examples:
  hf request tcp://127.0.0.1:5555 --type svc.lookup --meta key=42
  hf request tls://node-7:5555 -t model.infer --file input.bin --body --ca cluster-ca.crt > out.bin";

/// Arguments of `hf request`.
#[derive(Debug, Args)]
pub(crate) struct RequestArgs {
    /// Where the service listens: tcp://HOST:PORT, tls://HOST:PORT, shm://NAME or
    /// shm:///PATH.sock.
    #[arg(value_name = "URL")]
    url: String,

    #[command(flatten)]
    message: MessageArgs,

    /// How long to wait for the reply, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    timeout: f64,

    /// Write the reply's body to stdout, raw, instead of the JSON line.
    #[arg(long)]
    body: bool,

    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

/// Runs `hf request`.
pub(crate) async fn run(args: RequestArgs) -> Result<(), Failure> {
    crate::reachable(&args.url)?;
    args.tls.check(&args.url, false)?;
    let (kind, meta, source) = args.message.parse()?;
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        return Err(Failure::usage(format!(
            "bad --timeout {}: expected a number of seconds, more than 0",
            args.timeout
        )));
    }
    let wait = Duration::from_secs_f64(args.timeout.min(1e9));

    let ctx = build_context(args.tls.apply(Context::builder())?)?;
    let ch = connect(&ctx, &args.url).await?;
    let peer = ch.info().peer_url().to_owned();
    let request = build(&ch, kind, meta, source)?;
    let mut client = Client::new(ch);
    let call = async { client.ready().await?.call(request).await };
    let reply = match tokio::time::timeout(wait, call).await {
        Err(_) => {
            return Err(Failure::runtime(format!(
                "no reply from {peer} within {wait:?} (is it a service? hf listen --echo answers requests)"
            )));
        }
        Ok(Err(e)) => {
            let kind = e
                .remote_kind()
                .map_or_else(String::new, |k| format!(" ({})", k.code()));
            return Err(Failure::runtime(format!("{e:#}{kind}")));
        }
        Ok(Ok(reply)) => reply,
    };
    if args.body {
        use std::io::Write as _;
        let bytes = reply.body().as_bytes().cloned().unwrap_or_default();
        let mut out = std::io::stdout().lock();
        out.write_all(&bytes)
            .and_then(|()| out.flush())
            .map_err(|e| Failure::runtime(format!("writing the reply to stdout: {e}")))?;
    } else {
        println!("{}", json_line(&reply));
    }
    // Close our direction; the reply is in hand, so how the peer takes it does not matter.
    let _ = tokio::time::timeout(Duration::from_secs(1), client.sender_mut().close()).await;
    Ok(())
}

/// The reply `hf listen --echo` sends for `msg`: the message itself, and for a request, the
/// same message flagged as its response (same correlation id), so a client takes it.
pub(crate) fn echo_of(msg: hyperframes::Message) -> hyperframes::Message {
    let header = msg.header();
    if !header.flags.contains(Flags::REQUEST) {
        return msg;
    }
    let flags = header.flags.without(Flags::REQUEST).union(Flags::RESPONSE);
    msg.with_header(Header { flags, ..header })
}
