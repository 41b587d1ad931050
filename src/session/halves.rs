//! The application's halves of a session: pipes to and from the task that drives it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;

use super::proto;
use crate::error::{Error, ErrorKind, Result};
use crate::message::Message;
use crate::transport::pipe::{Stager, Unbatcher};
use crate::transport::{RecvHalf, SendHalf};

/// What the driver tells the application's halves.
#[derive(Default)]
pub(crate) struct Shared {
    /// User messages the peer acknowledged, in total (the sender's `flush` waits on it).
    pub(crate) acked: AtomicU64,
    /// The close (FIN) was acknowledged.
    pub(crate) fin_acked: AtomicBool,
    /// Set before the driver closes the pipes for good; the error both halves report.
    failed: AtomicBool,
    failure: Mutex<Option<Error>>,
    /// Why sending is over while receiving goes on (the peer dropped its receiver).
    send_failure: Mutex<Option<Error>>,
    unacked: Mutex<Vec<Message>>,
    /// The sender waiting in `flush` or `close`.
    pub(crate) progress: AtomicWaker,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// The session is over with `err`; `unacked` go back to the application.
    pub(crate) fn fail(&self, err: Error, unacked: Vec<Message>) {
        lock(&self.unacked).extend(unacked);
        lock(&self.failure).get_or_insert(err);
        self.failed.store(true, Ordering::Release);
        self.progress.wake();
    }

    /// Sending is over (`err`); receiving goes on.
    pub(crate) fn fail_send(&self, err: Error, unacked: Vec<Message>) {
        lock(&self.unacked).extend(unacked);
        lock(&self.send_failure).get_or_insert(err);
        self.progress.wake();
    }

    fn failure(&self) -> Option<Error> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.failure).as_ref().map(Error::duplicate)
    }

    fn send_failure(&self) -> Option<Error> {
        self.failure()
            .or_else(|| lock(&self.send_failure).as_ref().map(Error::duplicate))
    }
}

pub(crate) struct SessionSender {
    pub(crate) out: Stager,
    pub(crate) shared: Arc<Shared>,
    /// User messages handed to the pipe.
    pub(crate) submitted: u64,
    pub(crate) staged: u64,
    pub(crate) closed: bool,
}

impl SessionSender {
    fn gone(&self) -> Error {
        self.shared
            .send_failure()
            .unwrap_or_else(|| Error::new(ErrorKind::Closed, "the session's driver stopped"))
    }

    fn submit(&mut self) {
        self.out.submit();
        self.submitted += std::mem::take(&mut self.staged);
    }

    /// Ready once the driver reports `done`; an error if the session failed.
    fn poll_progress(
        &mut self,
        cx: &mut Context<'_>,
        done: impl Fn(&Shared) -> bool,
    ) -> Poll<Result<()>> {
        self.submit();
        if done(&self.shared) {
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = self.shared.send_failure() {
            return Poll::Ready(Err(e));
        }
        self.shared.progress.register(cx.waker());
        if done(&self.shared) {
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = self.shared.send_failure() {
            return Poll::Ready(Err(e));
        }
        Poll::Pending
    }
}

impl SendHalf for SessionSender {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.closed {
            return Poll::Ready(Err(Error::new(ErrorKind::Closed, "sender closed")));
        }
        if self.out.pipe().is_rx_closed() {
            return Poll::Ready(Err(self.gone()));
        }
        match self.out.poll_ready(cx) {
            Poll::Ready(()) if self.out.pipe().is_rx_closed() => Poll::Ready(Err(self.gone())),
            Poll::Ready(()) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn start_send(&mut self, msg: Message) -> Result<()> {
        if let Err(e) = proto::check_outgoing(&msg) {
            return Err(e.with_message(msg));
        }
        self.out.stage(msg);
        self.staged += 1;
        Ok(())
    }

    fn poll_submit(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.submit();
        Poll::Ready(Ok(()))
    }

    /// Waits until the peer acknowledged every message sent so far.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let want = self.submitted + self.staged;
        self.poll_progress(cx, |s| s.acked.load(Ordering::Acquire) >= want)
    }

    /// Closes the direction and waits until the peer acknowledged the close (and so every
    /// message before it).
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.closed {
            self.closed = true;
            self.submit();
            self.out.close();
        }
        self.poll_progress(cx, |s| s.fin_acked.load(Ordering::Acquire))
    }

    fn take_unacknowledged(&mut self) -> Option<Vec<Message>> {
        Some(std::mem::take(&mut *lock(&self.shared.unacked)))
    }
}

pub(crate) struct SessionReceiver {
    pub(crate) inp: Unbatcher,
    pub(crate) shared: Arc<Shared>,
    pub(crate) done: bool,
}

impl RecvHalf for SessionReceiver {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.inp.poll_next(cx) {
            Poll::Ready(Some(m)) => Poll::Ready(Some(Ok(m))),
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(self.shared.failure().map(Err))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
