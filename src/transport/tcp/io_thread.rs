//! The I/O threads: their runtimes, the commands they take, and what they run for a
//! connect, a listener and an accepted connection.

use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Once, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::conn::{self, Conn, TcpReceiver, TcpSender};
use super::sys::{self, Stream};
use crate::error::Result;
use crate::transport::{AcceptHalf, Config, IoEngine, Parts};
use crate::url::Endpoint;
use crate::wire::{Batch, Control};
use crate::{Error, ErrorKind};

enum Command {
    Connect {
        host: String,
        port: u16,
        reply: oneshot::Sender<Result<Parts>>,
    },
    Bind {
        host: String,
        port: u16,
        threads: Weak<IoThreads>,
        reply: oneshot::Sender<Result<(mpsc::Receiver<Parts>, SocketAddr)>>,
        rejected: Arc<AtomicU64>,
    },
    Adopt {
        stream: std::net::TcpStream,
        peer: SocketAddr,
        to: mpsc::Sender<Parts>,
        rejected: Arc<AtomicU64>,
    },
}

/// The I/O threads of one context. Dropping the last reference closes their command queues;
/// each thread then lets its connections finish (up to the linger time) and exits.
pub(crate) struct IoThreads {
    cmds: Vec<mpsc::Sender<Command>>,
    next: AtomicUsize,
    engine: IoEngine,
}

static FALLBACK_LOGGED: Once = Once::new();

impl IoThreads {
    pub(crate) fn start(cfg: &Config) -> Result<Arc<IoThreads>> {
        let mut cmds = Vec::with_capacity(cfg.io_threads);
        let mut engines = Vec::with_capacity(cfg.io_threads);
        for i in 0..cfg.io_threads {
            let (tx, rx) = mpsc::channel(256);
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let thread_cfg = cfg.clone();
            std::thread::Builder::new()
                .name(format!("hyperframes-io-{i}"))
                .spawn(move || thread_main(thread_cfg, rx, ready_tx))
                .map_err(|e| Error::io("starting an I/O thread", e))?;
            let engine = ready_rx
                .recv()
                .map_err(|_| Error::new(ErrorKind::Unavailable, "an I/O thread died at start"))??;
            cmds.push(tx);
            engines.push(engine);
        }
        Ok(Arc::new(IoThreads {
            cmds,
            next: AtomicUsize::new(0),
            engine: engines[0],
        }))
    }

    pub(crate) fn engine(&self) -> IoEngine {
        self.engine
    }

    fn pick(&self) -> &mpsc::Sender<Command> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.cmds.len();
        &self.cmds[i]
    }

    async fn call<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T>>) -> Command) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.pick().send(make(tx)).await.map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    pub(crate) async fn connect(&self, host: &str, port: u16) -> Result<Parts> {
        self.call(|reply| Command::Connect {
            host: host.to_owned(),
            port,
            reply,
        })
        .await
    }

    pub(crate) async fn bind(
        self: &Arc<Self>,
        host: &str,
        port: u16,
    ) -> Result<(Box<dyn AcceptHalf>, String)> {
        let rejected = Arc::new(AtomicU64::new(0));
        let (rx, local) = self
            .call(|reply| Command::Bind {
                host: host.to_owned(),
                port,
                threads: Arc::downgrade(self),
                reply,
                rejected: rejected.clone(),
            })
            .await?;
        let half = TcpAccept {
            rx,
            rejected,
            threads: self.clone(),
        };
        Ok((
            Box::new(half),
            Endpoint::from_socket_addr(local).to_string(),
        ))
    }
}

fn stopped() -> Error {
    Error::new(
        ErrorKind::Unavailable,
        "the context's I/O thread has stopped",
    )
}

fn thread_main(
    cfg: Config,
    cmds: mpsc::Receiver<Command>,
    ready: std::sync::mpsc::Sender<Result<IoEngine>>,
) {
    if cfg.engine != IoEngine::Epoll {
        match tokio_uring::Runtime::new(tokio_uring::builder().entries(1024)) {
            Ok(rt) => {
                let _ = ready.send(Ok(IoEngine::Uring));
                rt.block_on(serve(IoEngine::Uring, cmds, cfg));
                return;
            }
            Err(e) if cfg.engine == IoEngine::Uring => {
                let _ = ready.send(Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("io_uring is not available here ({e}); unset HYPERFRAMES_IO or set it to epoll"),
                )));
                return;
            }
            Err(e) => FALLBACK_LOGGED.call_once(|| {
                tracing::warn!("io_uring is not available ({e}); tcp:// runs on epoll");
            }),
        }
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(Error::io("starting the epoll runtime", e)));
            return;
        }
    };
    let _ = ready.send(Ok(IoEngine::Epoll));
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, serve(IoEngine::Epoll, cmds, cfg));
}

async fn serve(engine: IoEngine, mut cmds: mpsc::Receiver<Command>, cfg: Config) {
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(cmd) = cmds.recv().await {
        let cfg = cfg.clone();
        match cmd {
            Command::Connect { host, port, reply } => {
                tasks.spawn_local(async move {
                    let res = connect(engine, &host, port, &cfg).await;
                    match res {
                        Ok((parts, driver)) => {
                            // If the caller gave up, dropping `parts` closes both halves and the
                            // driver winds the connection down cleanly.
                            let _ = reply.send(Ok(parts));
                            driver.await;
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                });
            }
            Command::Bind {
                host,
                port,
                threads,
                reply,
                rejected,
            } => match bind(&host, port, &cfg).await {
                Ok(listener) => {
                    let local = listener.local_addr().ok();
                    let (tx, rx) = mpsc::channel(cfg.accept_backlog);
                    let Some(local) = local else {
                        let _ = reply.send(Err(Error::new(
                            ErrorKind::Io,
                            "bound socket has no local address",
                        )));
                        continue;
                    };
                    if reply.send(Ok((rx, local))).is_ok() {
                        tasks.spawn_local(accept_loop(listener, tx, threads, rejected));
                    }
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::Adopt {
                stream,
                peer,
                to,
                rejected,
            } => {
                tasks.spawn_local(async move {
                    match establish(engine, stream, &cfg).await {
                        Ok((parts, driver)) => {
                            // Waits while the backlog is full; fails if the listener is gone,
                            // in which case dropping the parts closes the connection.
                            let _ = to.send(parts).await;
                            driver.await;
                        }
                        Err(e) => {
                            rejected.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(peer = %peer, "rejected connection: {e}");
                        }
                    }
                });
            }
        }
        while tasks.try_join_next().is_some() {}
    }
    // The context and every channel and listener are gone: let the connections finish
    // sending what they have, within the linger time.
    let linger = cfg.linger;
    let _ =
        tokio::time::timeout(linger, async { while tasks.join_next().await.is_some() {} }).await;
}

async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    let ep = Endpoint::Tcp {
        host: host.to_owned(),
        port,
    };
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

async fn connect(
    engine: IoEngine,
    host: &str,
    port: u16,
    cfg: &Config,
) -> Result<(Parts, impl Future<Output = ()> + use<>)> {
    let mut last = None;
    for addr in resolve(host, port).await? {
        let url = Endpoint::from_socket_addr(addr);
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        };
        let attempt = async {
            let stream = socket?.connect(addr).await?;
            stream.into_std()
        };
        // The deadline covers the TCP connection; the handshake has its own.
        match tokio::time::timeout(cfg.connect_timeout, attempt).await {
            Ok(Ok(std)) => return establish(engine, std, cfg).await,
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

/// Socket options, handshake, and the channel halves; returns the driver to run.
async fn establish(
    engine: IoEngine,
    std: std::net::TcpStream,
    cfg: &Config,
) -> Result<(Parts, impl Future<Output = ()> + use<>)> {
    let local = std
        .local_addr()
        .map_err(|e| Error::io("local address", e))?;
    let peer = std.peer_addr().map_err(|e| Error::io("peer address", e))?;
    sys::tune(&std, cfg.keepalive).map_err(|e| Error::io("setting socket options", e))?;
    let stream =
        Stream::from_std(engine, std).map_err(|e| Error::io("registering the socket", e))?;
    let (peer_limits, leftover) = match conn::handshake(&stream, cfg).await {
        Ok(r) => r,
        Err(e) => {
            if e.is_protocol() {
                // Tell a hyperframes peer of another version why; harmless for anyone else.
                let mut b = Batch::default();
                b.push_control(&Control::Error(e.to_string()));
                let _ =
                    tokio::time::timeout(Duration::from_millis(200), stream.write_all(b.take()))
                        .await;
            }
            // Shut the socket down before dropping it: on io_uring a read that timed out may
            // still be pending, and the descriptor is only closed once it completes.
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return Err(e);
        }
    };
    let conn = Arc::new(Conn::new(cfg));
    let peer_url = Endpoint::from_socket_addr(peer).to_string();
    let parts = Parts {
        tx: Box::new(TcpSender::new(conn.clone())),
        rx: Box::new(TcpReceiver::new(conn.clone())),
        transport: "tcp",
        local: Endpoint::from_socket_addr(local).to_string(),
        peer: peer_url.clone(),
        peer_limits,
        keepalive: None,
    };
    let driver = conn::drive(conn, Rc::new(stream), leftover, cfg.clone(), peer_url);
    Ok((parts, driver))
}

async fn bind(host: &str, port: u16, cfg: &Config) -> Result<tokio::net::TcpListener> {
    let addr = resolve(host, port).await?[0];
    let backlog = cfg.accept_backlog.clamp(16, 4096) as i32;
    let std = sys::bind_std(addr, backlog)
        .map_err(|e| Error::io(format!("binding {}", Endpoint::from_socket_addr(addr)), e))?;
    tokio::net::TcpListener::from_std(std).map_err(|e| Error::io("registering the listener", e))
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    to: mpsc::Sender<Parts>,
    threads: Weak<IoThreads>,
    rejected: Arc<AtomicU64>,
) {
    loop {
        let accepted = tokio::select! {
            () = to.closed() => return,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: say so, and do not spin.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        let Some(threads) = threads.upgrade() else {
            return;
        };
        let cmd = Command::Adopt {
            stream,
            peer,
            to: to.clone(),
            rejected: rejected.clone(),
        };
        if threads.pick().send(cmd).await.is_err() {
            return;
        }
    }
}

struct TcpAccept {
    rx: mpsc::Receiver<Parts>,
    rejected: Arc<AtomicU64>,
    threads: Arc<IoThreads>,
}

impl AcceptHalf for TcpAccept {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        self.rx.poll_recv(cx).map(|p| match p {
            Some(mut parts) => {
                parts.keepalive = Some(self.threads.clone());
                Ok(parts)
            }
            None => Err(stopped()),
        })
    }

    fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}
