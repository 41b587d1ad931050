//! `inproc://name`: channels inside one process. A message moves through a bounded [`Pipe`]
//! per direction; the body is the sender's `Bytes`, never copied.
//!
//! Names are scoped to a [`Context`](crate::Context) (and its clones), as in ZeroMQ.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use tokio::sync::mpsc;

use super::pipe::{Pipe, Stager, Unbatcher};
use super::{AcceptHalf, Config, Parts, RecvHalf, SendHalf};
use crate::error::Result;
use crate::{Error, ErrorKind, Message};

pub(crate) struct Registry {
    cfg: Config,
    /// Bound names: the bind's id (so a listener only unregisters itself) and its backlog.
    names: Mutex<HashMap<String, (u64, mpsc::Sender<Parts>)>>,
    next_id: AtomicU64,
}

impl Registry {
    pub(crate) fn new(cfg: Config) -> Registry {
        Registry {
            cfg,
            names: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, mpsc::Sender<Parts>)>> {
        // The map stays consistent even if a holder panicked: every operation is one call.
        self.names.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub(crate) fn bind(reg: &Arc<Registry>, name: &str) -> Result<(Box<dyn AcceptHalf>, String)> {
    let url = format!("inproc://{name}");
    let mut names = reg.lock();
    if let Some((_, tx)) = names.get(name)
        && !tx.is_closed()
    {
        return Err(Error::new(
            ErrorKind::AddrInUse,
            format!("{url} is already bound in this context"),
        ));
    }
    let (tx, rx) = mpsc::channel(reg.cfg.accept_backlog.max(1));
    let id = reg.next_id.fetch_add(1, Ordering::Relaxed);
    names.insert(name.to_owned(), (id, tx));
    Ok((
        Box::new(InprocAccept {
            rx,
            id,
            name: name.to_owned(),
            reg: Arc::downgrade(reg),
        }),
        url,
    ))
}

pub(crate) async fn connect(reg: &Arc<Registry>, name: &str) -> Result<Parts> {
    let url = format!("inproc://{name}");
    let not_found = {
        let url = url.clone();
        move || {
            Error::new(
                ErrorKind::ConnectionRefused,
                format!("nothing is bound at {url} in this context"),
            )
        }
    };
    let Some((_, tx)) = reg.lock().get(name).cloned() else {
        return Err(not_found());
    };
    let cfg = &reg.cfg;
    let id = reg.next_id.fetch_add(1, Ordering::Relaxed);
    let up = Pipe::new(cfg.send_queue, cfg.send_queue_bytes);
    let down = Pipe::new(cfg.recv_queue, cfg.recv_queue_bytes);
    let peer_name = format!("inproc://{name}#{id}");
    let server = parts(&down, &up, cfg, url.clone(), peer_name.clone());
    let client = parts(&up, &down, cfg, peer_name, url);
    // Waits while the listener's backlog is full: connecting is backpressured too.
    tx.send(server).await.map_err(|_| not_found())?;
    Ok(client)
}

fn parts(out: &Arc<Pipe>, inp: &Arc<Pipe>, cfg: &Config, local: String, peer: String) -> Parts {
    Parts {
        tx: Box::new(InprocSender {
            out: Stager::new(out.clone()),
            closed: false,
        }),
        rx: Box::new(InprocReceiver {
            inp: Unbatcher::new(inp.clone()),
        }),
        transport: "inproc",
        local,
        peer,
        peer_limits: cfg.limits,
        keepalive: None,
    }
}

struct InprocAccept {
    rx: mpsc::Receiver<Parts>,
    id: u64,
    name: String,
    reg: Weak<Registry>,
}

impl AcceptHalf for InprocAccept {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        // The registry holds the sender while the listener lives, so `None` cannot happen
        // before drop; report it as closed rather than assume.
        self.rx
            .poll_recv(cx)
            .map(|p| p.ok_or_else(|| Error::new(ErrorKind::Closed, "inproc listener closed")))
    }

    fn rejected(&self) -> u64 {
        0
    }
}

impl Drop for InprocAccept {
    fn drop(&mut self) {
        if let Some(reg) = self.reg.upgrade() {
            let mut names = reg.lock();
            if names.get(&self.name).is_some_and(|(id, _)| *id == self.id) {
                names.remove(&self.name);
            }
        }
    }
}

struct InprocSender {
    out: Stager,
    closed: bool,
}

fn peer_gone() -> Error {
    Error::new(
        ErrorKind::Closed,
        "the peer's receiving half was dropped; nothing sent now would be read",
    )
}

impl SendHalf for InprocSender {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.closed {
            return Poll::Ready(Err(Error::new(ErrorKind::Closed, "sender closed")));
        }
        if self.out.pipe().is_rx_closed() {
            return Poll::Ready(Err(peer_gone()));
        }
        match self.out.poll_ready(cx) {
            Poll::Ready(()) if self.out.pipe().is_rx_closed() => Poll::Ready(Err(peer_gone())),
            Poll::Ready(()) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn start_send(&mut self, msg: Message) -> Result<()> {
        self.out.stage(msg);
        Ok(())
    }

    fn poll_submit(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.out.submit();
        Poll::Ready(Ok(()))
    }

    /// A handed-over message is in the peer's queue already.
    fn poll_flush(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.out.submit();
        Poll::Ready(Ok(()))
    }

    fn poll_close(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.closed {
            self.closed = true;
            self.out.close();
        }
        Poll::Ready(Ok(()))
    }
}

struct InprocReceiver {
    inp: Unbatcher,
}

impl RecvHalf for InprocReceiver {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        self.inp.poll_next(cx).map(|m| m.map(Ok))
    }
}

impl Drop for InprocReceiver {
    fn drop(&mut self) {
        let left = self.inp.pipe().len() + self.inp.buffered() as u64;
        if left > 0 {
            tracing::debug!(
                messages = left,
                "inproc receiver dropped with messages queued"
            );
        }
    }
}
