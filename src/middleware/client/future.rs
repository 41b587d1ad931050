//! Future types.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::sync::oneshot;

use super::Slot;
use crate::{Error, ErrorKind, Message, Result};

/// Response future of [`Client`](super::Client): the reply to one request. Dropping it
/// cancels the request: its slot is freed at once and a reply that comes later is discarded
/// and counted.
pub struct ResponseFuture {
    state: State,
}

enum State {
    Waiting {
        reply: oneshot::Receiver<Result<Message>>,
        _slot: Slot,
    },
    Failed(Option<Error>),
}

impl ResponseFuture {
    pub(super) fn waiting(reply: oneshot::Receiver<Result<Message>>, slot: Slot) -> Self {
        ResponseFuture {
            state: State::Waiting { reply, _slot: slot },
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
        match &mut self.get_mut().state {
            State::Waiting { reply, .. } => Poll::Ready(match ready!(Pin::new(reply).poll(cx)) {
                Ok(result) => result,
                // The reader never drops a waiter without answering it; be explicit anyway.
                Err(_) => Err(Error::new(
                    ErrorKind::Closed,
                    "the client's reader stopped before the reply came",
                )),
            }),
            State::Failed(err) => Poll::Ready(Err(err
                .take()
                .expect("ResponseFuture polled after completion"))),
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.state {
            State::Waiting { .. } => "ResponseFuture(waiting)",
            State::Failed(_) => "ResponseFuture(failed)",
        })
    }
}
