//! `IoEngine::Inline`: tcp without I/O threads. A connection runs in the tasks that use it,
//! on the caller's tokio runtime, over epoll (see `direct`): no thread and no task between
//! the application and the socket on the data path. Needs a tokio runtime with I/O and time
//! enabled in the caller; the halves must be polled while that runtime runs.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tokio::runtime::Handle;
use tokio::sync::mpsc;

use std::net::SocketAddr;

use super::direct;
use super::setup::{self, TcpAccept};
use super::sys::EpollStream;
#[cfg(feature = "tls")]
use super::tls::TlsIo;
use super::tls::{Session, TlsConfig};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Endpoint;
use crate::transport::{AcceptHalf, Config, Parts};

fn runtime() -> Result<Handle> {
    Handle::try_current().map_err(|_| {
        Error::new(
            ErrorKind::Unavailable,
            "the inline I/O engine runs on the caller's tokio runtime, and there is none here \
             (use the default engine, which has its own I/O threads)",
        )
    })
}

/// Whether the caller runs in a tokio runtime that can drive sockets and timers (what
/// `IoEngine::Auto` needs to run a connection inline).
///
/// tokio has no query for its drivers, and using a disabled one panics; the probe catches
/// that panic (the panic hook still prints it: a runtime built without `enable_all` is a
/// mistake worth a line) and the connection goes to the I/O threads instead.
pub(super) fn runtime_usable() -> bool {
    if Handle::try_current().is_err() {
        return false;
    }
    let probe = std::panic::catch_unwind(|| -> bool {
        drop(tokio::time::sleep(std::time::Duration::ZERO));
        let Ok((a, _b)) = std::os::unix::net::UnixDatagram::pair() else {
            return false;
        };
        a.set_nonblocking(true).is_ok() && tokio::net::UnixDatagram::from_std(a).is_ok()
    });
    let usable = probe.unwrap_or(false);
    if !usable {
        tracing::warn!(
            "tcp: this tokio runtime has I/O or timers disabled (Builder::enable_all): \
             connections run on I/O threads instead"
        );
    }
    usable
}

/// Handshakes (TLS first on `tls://`), then the halves; the connection's flusher is spawned
/// on `rt`.
async fn establish(
    rt: &Handle,
    stream: tokio::net::TcpStream,
    local: SocketAddr,
    peer: SocketAddr,
    cfg: &Config,
    tls: Option<Session>,
) -> Result<Parts> {
    let stream = EpollStream::new(stream);
    let (stream, secured, peer_limits, live, leftover) = match tls {
        None => {
            let (limits, live, leftover) = setup::agree(&stream, cfg).await?;
            (stream, None, limits, live, leftover)
        }
        #[cfg(feature = "tls")]
        Some(session) => {
            let url = super::tls::url(peer);
            let io = TlsIo::handshake(stream, session, &url, cfg.handshake_timeout).await?;
            let agreed = setup::agree(&io, cfg).await;
            let (limits, live, leftover) = agreed.map_err(|e| io.session().explain(e, &url))?;
            let (stream, session, cipher) = io.into_parts();
            (stream, Some((session, cipher)), limits, live, leftover)
        }
        #[cfg(not(feature = "tls"))]
        Some(session) => match session {},
    };
    let peer_url = Endpoint::from_socket_addr(peer).to_string();
    #[cfg(feature = "tls")]
    let session = secured.as_ref().map(|(s, _)| s.clone());
    let (tx, rx, flusher) = direct::start(
        stream.into_inner(),
        leftover,
        secured,
        cfg,
        live,
        peer_url.clone(),
    );
    rt.spawn(flusher);
    #[allow(unused_mut)] // only `tls://` relabels it
    let mut parts = Parts {
        tx: Box::new(tx),
        rx: Box::new(rx),
        transport: "tcp",
        local: Endpoint::from_socket_addr(local).to_string(),
        peer: peer_url,
        peer_limits,
        peer_identity: None,
        keepalive: None,
        setup: crate::transport::ChannelSetup::new(cfg, false),
    };
    #[cfg(feature = "tls")]
    if let Some(session) = session {
        super::tls::label(&mut parts, &session, local, peer);
    }
    Ok(parts)
}

pub(super) async fn connect(
    host: &str,
    port: u16,
    cfg: &Config,
    tls: Option<Session>,
) -> Result<Parts> {
    let rt = runtime()?;
    let stream = setup::connect_tcp(host, port, cfg).await?;
    let (local, peer) = setup::addrs(&stream)?;
    establish(&rt, stream, local, peer, cfg, tls).await
}

pub(super) async fn bind(
    host: &str,
    port: u16,
    cfg: &Config,
    tls: Option<TlsConfig>,
) -> Result<(Box<dyn AcceptHalf>, String)> {
    let rt = runtime()?;
    let secure = tls.is_some();
    let listener = setup::bind_listener(host, port, cfg).await?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("bound socket address", e))?;
    let (tx, rx) = mpsc::channel(cfg.accept_backlog);
    let rejected = Arc::new(AtomicU64::new(0));
    let cfg = cfg.clone();
    let counter = rejected.clone();
    let spawner = rt.clone();
    rt.spawn(async move {
        let to = tx.clone();
        let refused = counter.clone();
        setup::accept_loop(listener, tx, &cfg, &refused, |stream, peer, ticket| {
            let (to, cfg, counter) = (to.clone(), cfg.clone(), counter.clone());
            let session = tls.as_ref().map(TlsConfig::acceptor).transpose();
            spawner.spawn(async move {
                let Ok((local, _)) = setup::addrs(&stream) else {
                    return;
                };
                let rt = Handle::current();
                let made = match session {
                    Ok(session) => establish(&rt, stream, local, peer, &cfg, session).await,
                    Err(e) => Err(e),
                };
                match made {
                    // Waits while the backlog is full; if the listener is gone, dropping the
                    // parts closes the connection.
                    Ok(parts) => {
                        let _ = to.send(setup::with_ticket(parts, ticket)).await;
                    }
                    Err(e) => setup::reject(&counter, peer, &e),
                }
            });
            std::future::ready(true)
        })
        .await;
    });
    let half = TcpAccept {
        rx,
        rejected,
        keepalive: None,
    };
    Ok((Box::new(half), setup::listener_url(local, secure)))
}
