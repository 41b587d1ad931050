//! Future types.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use super::Slot;
use crate::error::{Error, Result};
use crate::message::Message;

/// Response future of [`Client`](super::Client): the reply to one request. Dropping it
/// cancels the request: its slot is freed at once and a reply that comes later is discarded
/// and counted.
pub struct ResponseFuture {
    state: State,
}

enum State {
    /// In flight; the slot is freed (and the request forgotten) when the state leaves.
    Waiting(Slot),
    Failed(Option<Error>),
    Done,
}

impl ResponseFuture {
    pub(super) fn waiting(slot: Slot) -> Self {
        ResponseFuture {
            state: State::Waiting(slot),
        }
    }

    pub(super) fn failed(err: Error) -> Self {
        ResponseFuture {
            state: State::Failed(Some(err)),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<Message>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Message>> {
        let this = self.get_mut();
        let out = match &mut this.state {
            State::Waiting(slot) => ready!(slot.poll_reply(cx)),
            State::Failed(err) => Err(err.take().expect("ResponseFuture polled after completion")),
            State::Done => panic!("ResponseFuture polled after completion"),
        };
        // Frees the slot now, not when the caller drops the future: another request may
        // have to take over reading the channel.
        this.state = State::Done;
        Poll::Ready(out)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.state {
            State::Waiting(_) => "ResponseFuture(waiting)",
            State::Failed(_) => "ResponseFuture(failed)",
            State::Done => "ResponseFuture(done)",
        })
    }
}
