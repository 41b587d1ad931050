//! The I/O threads: their runtimes, the commands they take, and what they run for a
//! connect, a listener and an accepted connection.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Once, Weak};

use tokio::sync::{mpsc, oneshot};

use super::admission::Ticket;
use super::setup::{self, TcpAccept};
use super::sys::{EpollStream, Io, UringStream};
#[cfg(feature = "tls")]
use super::tls::TlsIo;
use super::tls::{Session, TlsConfig};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{AcceptHalf, Config, IoEngine, Parts};

enum Command {
    Connect {
        host: String,
        port: u16,
        /// Boxed: a TLS session is large, and a command is moved through a queue.
        tls: Option<Box<Session>>,
        reply: oneshot::Sender<Result<Parts>>,
    },
    Bind {
        host: String,
        port: u16,
        tls: Option<TlsConfig>,
        threads: Weak<IoThreads>,
        reply: oneshot::Sender<Result<(mpsc::Receiver<Parts>, SocketAddr)>>,
        rejected: Arc<AtomicU64>,
    },
    Adopt {
        stream: std::net::TcpStream,
        peer: SocketAddr,
        tls: Option<TlsConfig>,
        to: mpsc::Sender<Parts>,
        rejected: Arc<AtomicU64>,
        ticket: Ticket,
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

    pub(crate) async fn connect(
        &self,
        host: &str,
        port: u16,
        tls: Option<Session>,
    ) -> Result<Parts> {
        self.call(|reply| Command::Connect {
            host: host.to_owned(),
            port,
            tls: tls.map(Box::new),
            reply,
        })
        .await
    }

    pub(crate) async fn bind(
        self: &Arc<Self>,
        host: &str,
        port: u16,
        tls: Option<TlsConfig>,
    ) -> Result<(Box<dyn AcceptHalf>, String)> {
        let rejected = Arc::new(AtomicU64::new(0));
        let secure = tls.is_some();
        let (rx, local) = self
            .call(|reply| Command::Bind {
                host: host.to_owned(),
                port,
                tls,
                threads: Arc::downgrade(self),
                reply,
                rejected: rejected.clone(),
            })
            .await?;
        let half = TcpAccept {
            rx,
            rejected,
            keepalive: Some(self.clone()),
        };
        Ok((Box::new(half), setup::listener_url(local, secure)))
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
                    format!(
                        "io_uring is not available here ({e:#}); unset HYPERFRAMES_IO or set it to epoll"
                    ),
                )));
                return;
            }
            Err(e) => FALLBACK_LOGGED.call_once(|| {
                tracing::warn!("io_uring is not available ({e:#}); tcp:// runs on epoll");
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

type LocalDriver = Pin<Box<dyn Future<Output = ()>>>;

/// Handshakes on `engine` (TLS first on `tls://`); the driver is boxed so that every
/// engine and both kinds of stream give one type.
async fn establish(
    engine: IoEngine,
    std: std::net::TcpStream,
    cfg: &Config,
    tls: Option<Session>,
) -> Result<(Parts, LocalDriver)> {
    let local = std
        .local_addr()
        .map_err(|e| Error::io("local address", e))?;
    let peer = std.peer_addr().map_err(|e| Error::io("peer address", e))?;
    let registering = |e| Error::io("registering the socket", e);
    if engine == IoEngine::Uring {
        let s = UringStream::from_std(std).map_err(registering)?;
        secured(s, local, peer, cfg, tls).await
    } else {
        let s = EpollStream::from_std(std).map_err(registering)?;
        secured(s, local, peer, cfg, tls).await
    }
}

async fn secured<S: Io + 'static>(
    stream: S,
    local: SocketAddr,
    peer: SocketAddr,
    cfg: &Config,
    tls: Option<Session>,
) -> Result<(Parts, LocalDriver)> {
    match tls {
        None => {
            let (parts, driver) = setup::establish(stream, local, peer, cfg).await?;
            Ok((parts, Box::pin(driver)))
        }
        #[cfg(feature = "tls")]
        Some(session) => {
            let url = super::tls::url(peer);
            let io = TlsIo::handshake(stream, session, &url, cfg.handshake_timeout).await?;
            let session = io.session().clone();
            let (mut parts, driver) = setup::establish(io, local, peer, cfg)
                .await
                .map_err(|e| session.explain(e, &url))?;
            super::tls::label(&mut parts, &session, local, peer);
            Ok((parts, Box::pin(driver)))
        }
        #[cfg(not(feature = "tls"))]
        Some(session) => match session {},
    }
}

async fn serve(engine: IoEngine, mut cmds: mpsc::Receiver<Command>, cfg: Config) {
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(cmd) = cmds.recv().await {
        let cfg = cfg.clone();
        match cmd {
            Command::Connect {
                host,
                port,
                tls,
                reply,
            } => {
                tasks.spawn_local(async move {
                    let res = match setup::connect_tcp(&host, port, &cfg).await {
                        Ok(stream) => match stream.into_std() {
                            Ok(std) => establish(engine, std, &cfg, tls.map(|b| *b)).await,
                            Err(e) => Err(Error::io("taking the socket from the reactor", e)),
                        },
                        Err(e) => Err(e),
                    };
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
                tls,
                threads,
                reply,
                rejected,
            } => {
                let listener = match setup::bind_listener(&host, port, &cfg).await {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        continue;
                    }
                };
                let local = match listener.local_addr() {
                    Ok(a) => a,
                    Err(e) => {
                        let _ = reply.send(Err(Error::io("bound socket address", e)));
                        continue;
                    }
                };
                let (tx, rx) = mpsc::channel(cfg.accept_backlog);
                if reply.send(Ok((rx, local))).is_ok() {
                    tasks.spawn_local(async move {
                        let to = tx.clone();
                        let counter = rejected.clone();
                        setup::accept_loop(listener, tx, &cfg, &counter, |stream, peer, ticket| {
                            // Spread accepted connections over the threads.
                            let to = to.clone();
                            let rejected = rejected.clone();
                            let threads = threads.upgrade();
                            let tls = tls.clone();
                            async move {
                                let (Some(threads), Ok(stream)) = (threads, stream.into_std())
                                else {
                                    return false;
                                };
                                let cmd = Command::Adopt {
                                    stream,
                                    peer,
                                    tls,
                                    to,
                                    rejected,
                                    ticket,
                                };
                                threads.pick().send(cmd).await.is_ok()
                            }
                        })
                        .await;
                    });
                }
            }
            Command::Adopt {
                stream,
                peer,
                tls,
                to,
                rejected,
                ticket,
            } => {
                tasks.spawn_local(async move {
                    let made = match tls.as_ref().map(TlsConfig::acceptor).transpose() {
                        Ok(session) => establish(engine, stream, &cfg, session).await,
                        Err(e) => Err(e),
                    };
                    match made {
                        Ok((parts, driver)) => {
                            // Waits while the backlog is full; fails if the listener is gone,
                            // in which case dropping the parts closes the connection.
                            let _ = to.send(setup::with_ticket(parts, ticket)).await;
                            driver.await;
                        }
                        Err(e) => setup::reject(&rejected, peer, &e),
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
