//! Connection set-up shared by both ways of running tcp (I/O threads and inline): name
//! lookup, connect, listen, accept, handshake, and the listener half.

use std::future::Future;
use std::net::{Shutdown, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use socket2::SockRef;
use tokio::sync::mpsc;

use super::admission::{Admission, Ticket};
use super::conn::{self, Conn, TcpReceiver, TcpSender};
use super::sys::{self, Io};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;
use crate::transport::Endpoint;
use crate::transport::heartbeat::Liveness;
use crate::transport::{AcceptHalf, Config, Parts};
use crate::wire::{Batch, Control};

pub(super) async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    let ep = Endpoint::tcp(host, port);
    if let Some(addr) = ep.socket_addr() {
        return Ok(vec![addr]);
    }
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| Error::io(format!("resolving {ep}"), e))?
        .collect();
    if addrs.is_empty() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!("{ep}: the name has no addresses"),
        ));
    }
    Ok(addrs)
}

/// Connects to the first address of `host` that accepts, within the connect timeout each,
/// and sets the socket options.
pub(super) async fn connect_tcp(
    host: &str,
    port: u16,
    cfg: &Config,
) -> Result<tokio::net::TcpStream> {
    let mut last = None;
    for addr in resolve(host, port).await? {
        let url = Endpoint::from_socket_addr(addr);
        let attempt = async {
            let socket = if addr.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            let stream = socket.connect(addr).await?;
            sys::tune(SockRef::from(&stream), cfg.keepalive)?;
            Ok::<_, std::io::Error>(stream)
        };
        // The deadline covers the TCP connection; the handshake has its own.
        match tokio::time::timeout(cfg.connect_timeout, attempt).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) => last = Some(Error::io(format!("connecting to {url}"), e)),
            Err(_) => {
                last = Some(Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "connecting to {url}: no connection within {:?}",
                        cfg.connect_timeout
                    ),
                ))
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::new(ErrorKind::NotFound, "no address to connect to")))
}

pub(super) async fn bind_listener(
    host: &str,
    port: u16,
    cfg: &Config,
) -> Result<tokio::net::TcpListener> {
    let addr = resolve(host, port).await?[0];
    let backlog = cfg.accept_backlog.clamp(16, 4096) as i32;
    let std = sys::bind_std(addr, backlog)
        .map_err(|e| Error::io(format!("binding {}", Endpoint::from_socket_addr(addr)), e))?;
    tokio::net::TcpListener::from_std(std).map_err(|e| Error::io("registering the listener", e))
}

/// Accepts connections until `to` closes (the listener was dropped), handing each (with its
/// socket options set and its place taken: see [`Admission`]) to `adopt`. While the
/// listener holds its maximum of connections it accepts nothing (they wait in the kernel's
/// backlog); a connection from an address that holds its share is closed at once and counted
/// in `rejected`.
pub(super) async fn accept_loop<F, Fut>(
    listener: tokio::net::TcpListener,
    to: mpsc::Sender<Parts>,
    cfg: &Config,
    rejected: &AtomicU64,
    mut adopt: F,
) where
    F: FnMut(tokio::net::TcpStream, SocketAddr, Ticket) -> Fut,
    Fut: Future<Output = bool>,
{
    let admission = Admission::new(
        cfg.max_connections,
        cfg.max_connections_per_peer,
        cfg.max_handshakes,
    );
    let mut warned: Option<Instant> = None;
    let mut refused_since_warning = 0u64;
    loop {
        tokio::select! {
            () = to.closed() => return,
            () = admission.room() => {}
        }
        let accepted = tokio::select! {
            () = to.closed() => return,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: say so, and do not spin.
                tracing::warn!("accept failed: {e:#}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(e) = sys::tune(SockRef::from(&stream), cfg.keepalive) {
            tracing::warn!(peer = %peer, "dropping connection: setting socket options: {e:#}");
            continue;
        }
        let ticket = match admission.admit(peer.ip()) {
            Ok(t) => t,
            Err(why) => {
                // Closed before a byte is read; a flood is logged once a second, counted.
                rejected.fetch_add(1, Ordering::Relaxed);
                refused_since_warning += 1;
                if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    tracing::warn!(
                        peer = %peer,
                        "refused {refused_since_warning} connection(s) since the last warning: {why}"
                    );
                    warned = Some(Instant::now());
                    refused_since_warning = 0;
                }
                continue;
            }
        };
        if !adopt(stream, peer, ticket).await {
            return;
        }
    }
}

/// `parts` carrying `ticket`, whose handshake is done: the place is given back when the
/// channel's halves are gone.
pub(super) fn with_ticket(mut parts: Parts, mut ticket: Ticket) -> Parts {
    ticket.handshake_done();
    parts.keep_alive(Arc::new(ticket));
    parts
}

/// The hyperframes handshake over `stream`: the peer's limits, what the two sides do about
/// heartbeats, and the bytes that came after it. On failure the peer is told why when it
/// may be a hyperframes peer of another version (harmless for anyone else), and the socket
/// is shut down.
pub(super) async fn agree<S: Io>(stream: &S, cfg: &Config) -> Result<(Limits, Liveness, BytesMut)> {
    match conn::handshake(stream, cfg).await {
        Ok(r) => Ok(r),
        Err(e) => {
            if e.is_protocol() {
                let mut b = Batch::default();
                b.push_control(&Control::Error(e.to_string()));
                let _ =
                    tokio::time::timeout(Duration::from_millis(200), stream.write_all(b.take()))
                        .await;
            }
            // Shut the socket down before dropping it: on io_uring a read that timed out may
            // still be pending, and the descriptor is only closed once it completes.
            let _ = stream.shutdown(Shutdown::Both);
            Err(e)
        }
    }
}

/// Handshake and channel halves for a connected `stream`; returns the driver to run.
pub(super) async fn establish<S: Io>(
    stream: S,
    local: SocketAddr,
    peer: SocketAddr,
    cfg: &Config,
) -> Result<(Parts, impl Future<Output = ()> + use<S>)> {
    let (peer_limits, live, leftover) = agree(&stream, cfg).await?;
    let peer_url = Endpoint::from_socket_addr(peer).to_string();
    let conn = Arc::new(Conn::new(cfg).with_peer(&peer_url));
    let parts = Parts {
        tx: Box::new(TcpSender::new(conn.clone())),
        rx: Box::new(TcpReceiver::new(conn.clone())),
        transport: "tcp",
        local: Endpoint::from_socket_addr(local).to_string(),
        peer: peer_url.clone(),
        peer_limits,
        peer_identity: None,
        keepalive: None,
        setup: crate::transport::ChannelSetup::new(cfg, false),
    };
    let driver = conn::drive(conn, stream, leftover, cfg.clone(), live, peer_url);
    Ok((parts, driver))
}

/// The URL a listener bound to `local` reports: `tls://` when it secures what it accepts.
pub(super) fn listener_url(local: SocketAddr, tls: bool) -> String {
    #[cfg(feature = "tls")]
    if tls {
        return super::tls::url(local);
    }
    let _ = tls;
    Endpoint::from_socket_addr(local).to_string()
}

/// Local and peer address of a connected stream.
pub(super) fn addrs(s: &tokio::net::TcpStream) -> Result<(SocketAddr, SocketAddr)> {
    let local = s.local_addr().map_err(|e| Error::io("local address", e))?;
    let peer = s.peer_addr().map_err(|e| Error::io("peer address", e))?;
    Ok((local, peer))
}

/// Counts and logs a connection refused at the handshake.
pub(super) fn reject(rejected: &AtomicU64, peer: SocketAddr, e: &Error) {
    rejected.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(peer = %peer, "rejected connection: {e:#}");
}

/// The listener half: channels whose handshake completed wait here for `accept`.
pub(super) struct TcpAccept {
    pub(super) rx: mpsc::Receiver<Parts>,
    pub(super) rejected: Arc<AtomicU64>,
    /// Given to every accepted channel (the I/O threads, when they run it).
    pub(super) keepalive: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl AcceptHalf for TcpAccept {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        self.rx.poll_recv(cx).map(|p| match p {
            Some(mut parts) => {
                if let Some(machinery) = &self.keepalive {
                    // Beside the connection's own (its admission ticket).
                    parts.keep_alive(machinery.clone());
                }
                Ok(parts)
            }
            None => Err(Error::new(
                ErrorKind::Unavailable,
                "the listener's accept task has stopped (its runtime or I/O thread is gone)",
            )),
        })
    }

    fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}
