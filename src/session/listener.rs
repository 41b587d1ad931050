//! The listening side: a listener whose connections are sessions, new or resumed.
//!
//! A task accepts connections from the transport's listener and reads each one's hello (one
//! task per connection, bounded by the handshake timeout): a new session id makes a new
//! session, handed to `accept`; a known one hands the connection to that session's driver.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use tokio::sync::mpsc;

use super::driver;
use super::proto::{self, Control, Hello};
use crate::channel::{Channel, Listener};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Endpoint;
use crate::transport::{AcceptHalf, Config, Parts, Transports};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new connection for a live session, waiting for its driver.
#[derive(Default)]
pub(crate) struct Attach {
    slot: Mutex<Option<(Channel, Hello)>>,
    waker: AtomicWaker,
}

impl Attach {
    fn put(&self, conn: Channel, hello: Hello) {
        // A newer connection replaces one the driver has not taken yet.
        *lock(&self.slot) = Some((conn, hello));
        self.waker.wake();
    }

    pub(crate) fn take(&self, cx: &mut Context<'_>) -> Option<(Channel, Hello)> {
        self.waker.register(cx.waker());
        lock(&self.slot).take()
    }
}

struct Entry {
    attach: Arc<Attach>,
    /// The certificate the session's first connection presented (`tls://`): a reconnect
    /// must present the same one.
    identity: Option<Vec<u8>>,
}

/// The live sessions of one listener.
pub(crate) struct Registry {
    sessions: Mutex<HashMap<u128, Entry>>,
    max: usize,
}

impl Registry {
    pub(crate) fn remove(&self, id: u128) {
        lock(&self.sessions).remove(&id);
    }
}

struct SessionAccept {
    rx: mpsc::Receiver<Parts>,
    raw: Arc<Mutex<Listener>>,
    rejected: Arc<AtomicU64>,
}

impl AcceptHalf for SessionAccept {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(parts)) => Poll::Ready(Ok(parts)),
            Poll::Ready(None) => Poll::Ready(Err(Error::new(
                ErrorKind::Closed,
                "the session listener's accept task stopped",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn rejected(&self) -> u64 {
        lock(&self.raw).rejected() + self.rejected.load(Ordering::Relaxed)
    }
}

/// [`Context::bind_sessions`](crate::Context::bind_sessions).
pub(crate) async fn bind(transports: &Arc<Transports>, ep: &Endpoint) -> Result<Listener> {
    let (half, local_url) = transports.bind(ep).await?;
    let cfg = transports.config().clone();
    let raw = Arc::new(Mutex::new(Listener::new(half, local_url.clone())));
    let (tx, rx) = mpsc::channel(cfg.accept_backlog.max(1));
    let registry = Arc::new(Registry {
        sessions: Mutex::new(HashMap::new()),
        max: cfg.max_connections,
    });
    let rejected = Arc::new(AtomicU64::new(0));
    tokio::spawn(accept_loop(
        raw.clone(),
        tx,
        registry,
        cfg,
        rejected.clone(),
    ));
    Ok(Listener::new(
        Box::new(SessionAccept { rx, raw, rejected }),
        local_url,
    ))
}

async fn accept_loop(
    raw: Arc<Mutex<Listener>>,
    tx: mpsc::Sender<Parts>,
    registry: Arc<Registry>,
    cfg: Config,
    rejected: Arc<AtomicU64>,
) {
    loop {
        // Polling the listener takes nothing until a connection is ready: cancel safe.
        let accept = futures_util::future::poll_fn(|cx| lock(&raw).poll_accept_channel(cx));
        let conn = tokio::select! {
            _ = tx.closed() => return, // the Listener was dropped
            r = accept => r,
        };
        match conn {
            Ok(conn) => {
                tokio::spawn(handshake(
                    conn,
                    tx.clone(),
                    registry.clone(),
                    cfg.clone(),
                    rejected.clone(),
                ));
            }
            Err(e) => {
                tracing::warn!("session listener: {e:#}; it stops");
                return;
            }
        }
    }
}

/// Reads a connection's hello and sends it where it belongs.
async fn handshake(
    mut conn: Channel,
    tx: mpsc::Sender<Parts>,
    registry: Arc<Registry>,
    cfg: Config,
    rejected: Arc<AtomicU64>,
) {
    let peer = conn.info().peer_url().to_owned();
    let refuse = |why: &dyn std::fmt::Display| {
        rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("session listener: {peer} refused: {why}");
    };
    let hello = match first_hello(&mut conn, cfg.handshake_timeout).await {
        Ok(h) => h,
        Err(e) => return refuse(&format_args!("{e:#}")),
    };
    let identity = conn
        .info()
        .peer_identity()
        .map(|p| p.certificate_der().to_vec());
    let attach = {
        let mut sessions = lock(&registry.sessions);
        if let Some(e) = sessions.get(&hello.id) {
            if e.identity != identity {
                drop(sessions);
                return refuse(&"a reconnect to a session with another certificate");
            }
            e.attach.put(conn, hello);
            return;
        }
        if sessions.len() >= registry.max {
            drop(sessions);
            return refuse(&format_args!("{} sessions live already", registry.max));
        }
        let attach = Arc::new(Attach::default());
        sessions.insert(
            hello.id,
            Entry {
                attach: attach.clone(),
                identity,
            },
        );
        attach
    };
    // A new session (or one this process never knew: it restarted since).
    if let Err(e) = conn.send(proto::welcome(false, 0)).await {
        registry.remove(hello.id);
        return refuse(&format_args!("{e:#}"));
    }
    let app = driver::accept(hello.id, conn, &cfg, attach, registry.clone());
    if tx.send(app).await.is_err() {
        // The Listener is gone; the session's halves drop with the message.
        registry.remove(hello.id);
    }
}

async fn first_hello(conn: &mut Channel, timeout: Duration) -> Result<Hello> {
    let first = tokio::time::timeout(timeout, conn.recv())
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::TimedOut,
                format!("no session hello within {timeout:?}"),
            )
        })?;
    match first {
        Some(Ok(m)) => match proto::classify(m)? {
            Control::Hello(h) => Ok(h),
            other => Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "expected a session hello, got {other:?} (is the peer using connect_with?)"
                ),
            )),
        },
        Some(Err(e)) => Err(e),
        None => Err(Error::new(
            ErrorKind::Closed,
            "closed before its session hello",
        )),
    }
}
