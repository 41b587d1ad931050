//! Loopback probes through the library.

use hyperframes::{Context, ErrorKind, IoEngine, Message};
use std::time::Duration;

/// What a loopback connection through the library showed.
#[derive(Debug)]
pub(super) enum Probe {
    /// A message went through; for `tcp://`, the engine the context chose.
    Worked(Option<IoEngine>),
    /// The transport is not compiled into this build.
    NotBuilt,
    /// Something failed; the library's error.
    Failed(String),
}

const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds `url`, connects to it and sends one message across.
pub(super) async fn loopback(ctx: &Context, url: &str) -> Probe {
    let attempt = async {
        let mut listener = ctx.bind(url).await?;
        let at = listener.local_url().to_owned();
        let (accepted, connected) = tokio::join!(listener.accept(), ctx.connect(&at));
        let (mut server, mut client) = (accepted?, connected?);
        client
            .send(Message::new("hf.doctor")?.with_body(&b"ping"[..]))
            .await?;
        client.flush().await?;
        match server.recv().await {
            Some(Ok(msg)) if msg.body().as_bytes().is_some_and(|b| b[..] == b"ping"[..]) => {
                Ok(true)
            }
            Some(Err(e)) => Err(e),
            _ => Ok(false),
        }
    };
    match tokio::time::timeout(PROBE_TIMEOUT, attempt).await {
        Ok(Ok(true)) => Probe::Worked(ctx.io_engine()),
        Ok(Ok(false)) => Probe::Failed("the message did not arrive intact".to_owned()),
        Ok(Err(e)) if e.kind() == ErrorKind::UnsupportedScheme => Probe::NotBuilt,
        Ok(Err(e)) => Probe::Failed(e.to_string()),
        Err(_) => Probe::Failed(format!("no answer within {PROBE_TIMEOUT:?}")),
    }
}

/// A `tcp://` loopback connection on the I/O threads left to choose io_uring or epoll
/// (`Threads`, what `Auto` picks where no tokio runtime runs the connection inline).
pub(super) async fn probe_tcp() -> Probe {
    match Context::builder().io_engine(IoEngine::Threads).build() {
        Ok(ctx) => loopback(&ctx, "tcp://127.0.0.1:0").await,
        Err(e) => Probe::Failed(e.to_string()),
    }
}

/// A `shm://` loopback connection, through the runtime directory as `shm://NAME` uses it.
pub(super) async fn probe_shm() -> Probe {
    match Context::builder().build() {
        Ok(ctx) => loopback(&ctx, &format!("shm://hf-doctor-{}", std::process::id())).await,
        Err(e) => Probe::Failed(e.to_string()),
    }
}
