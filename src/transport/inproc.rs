//! `inproc://name`: channels inside one process. A message moves through a bounded [`Pipe`]
//! per direction; the body is the sender's `Bytes`, never copied.
//!
//! Names are scoped to a [`Context`](crate::Context) (and its clones), as in ZeroMQ.
//!
//! A side that finds nothing to receive, or no room to send, spins for up to [`SPIN`] before
//! it parks, when the other side last ran on another thread: a reply in a request/response
//! exchange then arrives as a cache-line hand-off, not as a wake-up through the peer's
//! runtime. With `busy_poll` it never parks: after the spin it yields to its runtime and
//! looks again.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::names::Names;
use super::pipe::{Pipe, Stager, Unbatcher};
use super::{AcceptHalf, Config, Count, Open, Parts, RecvHalf, SPIN, SendHalf, spin_until};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Message;

pub(crate) struct Registry {
    cfg: Config,
    names: Arc<Names>,
}

impl Registry {
    pub(crate) fn new(cfg: Config) -> Registry {
        Registry {
            names: Names::new("inproc", cfg.accept_backlog),
            cfg,
        }
    }
}

/// `inproc://` in the scheme table.
pub(crate) static INPROC: Open = Open {
    connect: |t, a| Box::pin(async move { connect(&t.inproc, a.as_name()?).await }),
    bind: |t, a| Box::pin(async move { bind(&t.inproc, a.as_name()?) }),
};

pub(crate) fn bind(reg: &Arc<Registry>, name: &str) -> Result<(Box<dyn AcceptHalf>, String)> {
    reg.names.bind(name)
}

pub(crate) async fn connect(reg: &Arc<Registry>, name: &str) -> Result<Parts> {
    let url = reg.names.url(name);
    let tx = reg.names.lookup(name)?;
    let cfg = &reg.cfg;
    let id = reg.names.next_id();
    let up = Pipe::new(cfg.send_queue, cfg.send_queue_bytes);
    let down = Pipe::new(cfg.recv_queue, cfg.recv_queue_bytes);
    let peer_name = format!("{url}#{id}");
    let server = parts(&down, &up, cfg, url.clone(), peer_name.clone());
    let client = parts(&up, &down, cfg, peer_name, url);
    // Waits while the listener's backlog is full: connecting is backpressured too.
    tx.send(server).await.map_err(|_| reg.names.refused(name))?;
    Ok(client)
}

fn parts(out: &Arc<Pipe>, inp: &Arc<Pipe>, cfg: &Config, local: String, peer: String) -> Parts {
    Parts {
        tx: Box::new(InprocSender {
            out: Stager::new(out.clone()),
            closed: false,
            busy_poll: cfg.busy_poll,
        }),
        rx: Box::new(InprocReceiver {
            inp: Unbatcher::new(inp.clone()),
            busy_poll: cfg.busy_poll,
            count: cfg.count.clone(),
        }),
        transport: "inproc",
        local,
        peer,
        peer_limits: cfg.limits,
        peer_identity: None,
        keepalive: None,
        setup: super::ChannelSetup::new(cfg, true),
    }
}

struct InprocSender {
    out: Stager,
    closed: bool,
    busy_poll: bool,
}

fn peer_gone() -> Error {
    Error::new(
        ErrorKind::Closed,
        "the peer's receiving half was dropped; nothing sent now would be read",
    )
}

impl InprocSender {
    fn spin_for_room(&mut self) -> bool {
        let Ok(room) = spin_until(SPIN, || Ok::<_, Infallible>(self.out.ready()));
        room
    }
}

impl SendHalf for InprocSender {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.closed {
            return Poll::Ready(Err(Error::new(ErrorKind::Closed, "sender closed")));
        }
        if self.out.pipe().is_rx_closed() {
            return Poll::Ready(Err(peer_gone()));
        }
        let room =
            self.out.ready() || (self.out.pipe().consumer_elsewhere() && self.spin_for_room());
        if !room && self.busy_poll {
            cx.waker().wake_by_ref();
            return Poll::Pending;
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
    busy_poll: bool,
    count: Count,
}

impl InprocReceiver {
    fn spin_for_data(&self) -> bool {
        let Ok(ready) = spin_until(SPIN, || Ok::<_, Infallible>(self.inp.ready()));
        ready
    }
}

impl RecvHalf for InprocReceiver {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        let ready =
            self.inp.ready() || (self.inp.pipe().producer_elsewhere() && self.spin_for_data());
        if !ready && self.busy_poll {
            // Let the runtime run its other tasks, then look again; never park.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.inp.poll_next(cx).map(|m| m.map(Ok))
    }
}

impl Drop for InprocReceiver {
    fn drop(&mut self) {
        let left = self.inp.pipe().len() + self.inp.buffered() as u64;
        if left > 0 {
            self.count.unread(left);
            tracing::debug!(
                messages = left,
                "inproc receiver dropped with messages queued"
            );
        }
    }
}
