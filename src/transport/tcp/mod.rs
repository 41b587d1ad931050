//! `tcp://`: TCP on I/O threads owned by the context, io_uring (tokio-uring) by default,
//! epoll where io_uring is refused.
//!
//! Each I/O thread runs its own single-threaded runtime (tokio-uring's, or tokio's
//! current-thread for epoll) and drives its connections as local tasks. User halves talk to
//! them only through the bounded pipes of [`conn::Conn`] (ZeroMQ's I/O-thread model), so
//! user code may run on any executor, and the I/O thread batches: everything a sender
//! queued while the previous write was in flight goes out in the next single vectored write.
//!
//! Control-plane work (name lookup, connect, listen, accept) uses tokio's reactor on the
//! same threads; only the data path (read, writev) goes through io_uring.
//!
//! [`IoEngine::Inline`] runs each connection in the tasks that use it instead, on the
//! caller's runtime (see `inline` and `direct`).

mod conn;
mod direct;
mod inline;
mod io_thread;
mod setup;
mod sys;

use std::sync::{Arc, Mutex};

use crate::error::Result;
use crate::transport::{AcceptHalf, Config, IoEngine, Parts};

use io_thread::IoThreads;

/// The per-context tcp transport: I/O threads started on first use.
pub(crate) struct Tcp {
    cfg: Config,
    threads: Mutex<Option<Arc<IoThreads>>>,
}

impl Tcp {
    pub(crate) fn new(cfg: Config) -> Tcp {
        Tcp {
            cfg,
            threads: Mutex::new(None),
        }
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
        if self.cfg.engine == IoEngine::Inline {
            return Some(IoEngine::Inline);
        }
        let slot = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|t| t.engine())
    }

    pub(crate) async fn connect(&self, host: &str, port: u16) -> Result<Parts> {
        if self.cfg.engine == IoEngine::Inline {
            return inline::connect(host, port, &self.cfg).await;
        }
        let threads = self.threads()?;
        let mut parts = threads.connect(host, port).await?;
        parts.keepalive = Some(threads);
        Ok(parts)
    }

    pub(crate) async fn bind(
        &self,
        host: &str,
        port: u16,
    ) -> Result<(Box<dyn AcceptHalf>, String)> {
        if self.cfg.engine == IoEngine::Inline {
            return inline::bind(host, port, &self.cfg).await;
        }
        let threads = self.threads()?;
        threads.bind(host, port).await
    }
}
