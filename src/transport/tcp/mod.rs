//! `tcp://`: TCP run in the tasks that use it, or on I/O threads owned by the context.
//!
//! Two ways to drive a connection, picked by [`IoEngine`]:
//!
//! - [`IoEngine::Inline`] (what `Auto` picks inside a tokio runtime): each connection runs
//!   in the tasks that poll its halves, over the caller's tokio reactor (see `inline` and
//!   `direct`). A message goes from the application to `writev` and from `recv` to the
//!   application with no thread or task between them.
//! - I/O threads (`Threads`, what `Auto` picks outside a tokio runtime; `Uring`, `Epoll`): each runs
//!   its own single-threaded runtime (tokio-uring's, or tokio's current-thread for epoll) and
//!   drives its connections as local tasks. User halves talk to them only through the bounded
//!   pipes of [`conn::Conn`] (ZeroMQ's I/O-thread model), so user code may run on any
//!   executor, and the I/O thread batches: everything a sender queued while the previous
//!   write was in flight goes out in the next single vectored write. Control-plane work
//!   (name lookup, connect, listen, accept) uses tokio's reactor on the same threads; only the
//!   data path (read, writev) goes through io_uring.
//!
//! Why `Auto` prefers inline where it can: on the measured host (README, "Performance") the
//! hand-off to an I/O thread and back cost more than the whole system call path. A 64 B
//! ping-pong took 42 µs p50 on io_uring threads and 16 µs inline (a plain tokio `TcpStream`
//! 16 µs); 64 B streaming ran at 3.9 and 5.9 M msgs/s; 4 MiB at 2.4-2.5 GB/s on threads and
//! 3.0-3.5 inline.
//!
//! Why not io_uring driven directly on the inline path: `benches/uring_vs_epoll.rs` (a 64 B
//! ping-pong, one pinned thread per side) measured io_uring with the answer and the next wait
//! in one `io_uring_enter` at 1.05x tokio's epoll reactor, and blocking sockets with no event
//! loop at 0.90x: the cost of a hop is the kernel waking the parked peer, not the system
//! calls around it. What removes it is not parking (`busy_poll`). The I/O-thread engines keep
//! tokio-uring behind the `Io` seam.

mod admission;
mod conn;
mod direct;
mod inline;
mod io_thread;
mod setup;
mod sys;
#[cfg(feature = "tls")]
pub(crate) mod tls;
#[cfg(not(feature = "tls"))]
#[path = "tls_off.rs"]
mod tls;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::transport::{AcceptHalf, Config, IoEngine, Open, Parts};

use io_thread::IoThreads;

/// The per-context tcp transport: I/O threads started on first use.
pub(crate) struct Tcp {
    cfg: Config,
    threads: Mutex<Option<Arc<IoThreads>>>,
    /// A connection or listener ran inline (what [`Tcp::engine`] reports).
    ran_inline: AtomicBool,
}

impl Tcp {
    pub(crate) fn new(cfg: Config) -> Tcp {
        Tcp {
            cfg,
            threads: Mutex::new(None),
            ran_inline: AtomicBool::new(false),
        }
    }

    /// Whether this bind or connect runs inline: asked for, or `Auto` inside a tokio runtime
    /// that can drive sockets and timers.
    fn inline(&self) -> bool {
        let inline = match self.cfg.engine {
            IoEngine::Inline => true,
            IoEngine::Auto => inline::runtime_usable(),
            _ => false,
        };
        if inline {
            self.ran_inline.store(true, Ordering::Relaxed);
        }
        inline
    }

    fn threads(&self) -> Result<Arc<IoThreads>> {
        let mut slot = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = &*slot {
            return Ok(t.clone());
        }
        let t = IoThreads::start(&self.cfg)?;
        *slot = Some(t.clone());
        Ok(t)
    }

    pub(crate) fn engine(&self) -> Option<IoEngine> {
        if self.ran_inline.load(Ordering::Relaxed) {
            return Some(IoEngine::Inline);
        }
        let slot = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|t| t.engine())
    }

    /// Connects to `host:port`; with `tls`, runs TLS over the connection (`tls://`).
    pub(crate) async fn connect(
        &self,
        host: &str,
        port: u16,
        tls: Option<tls::Session>,
    ) -> Result<Parts> {
        if self.inline() {
            return inline::connect(host, port, &self.cfg, tls).await;
        }
        let threads = self.threads()?;
        let mut parts = threads.connect(host, port, tls).await?;
        parts.keepalive = Some(threads);
        Ok(parts)
    }

    /// Listens at `host:port`; with `tls`, every accepted connection runs TLS (`tls://`).
    pub(crate) async fn bind(
        &self,
        host: &str,
        port: u16,
        tls: Option<tls::TlsConfig>,
    ) -> Result<(Box<dyn AcceptHalf>, String)> {
        if self.inline() {
            return inline::bind(host, port, &self.cfg, tls).await;
        }
        let threads = self.threads()?;
        threads.bind(host, port, tls).await
    }
}

/// `tcp://` in the scheme table.
pub(crate) static TCP: Open = Open {
    connect: |t, a| {
        Box::pin(async move {
            let (host, port) = a.as_host_port()?;
            t.tcp.connect(host, port, None).await
        })
    },
    bind: |t, a| {
        Box::pin(async move {
            let (host, port) = a.as_host_port()?;
            t.tcp.bind(host, port, None).await
        })
    },
};

/// `tls://` in the scheme table.
#[cfg(feature = "tls")]
pub(crate) static TLS: Open = Open {
    connect: |t, a| {
        Box::pin(async move {
            let (host, port) = a.as_host_port()?;
            let session = tls::client(t.config(), host)?;
            t.tcp.connect(host, port, Some(session)).await
        })
    },
    bind: |t, a| {
        Box::pin(async move {
            let (host, port) = a.as_host_port()?;
            let tls = tls::server(t.config())?;
            t.tcp.bind(host, port, Some(tls)).await
        })
    },
};
