//! A [`Sender`] seen as a `tower::Service<Message, Response = ()>`.

use std::future::{Ready, ready};
use std::task::{Context, Poll};

use tower::Service;

use crate::channel::Sender;
use crate::error::Error;
use crate::message::Message;

/// A `Sender` is a service that hands each message to the transport, so the layers that guard
/// handlers guard the send side too.
///
/// * `poll_ready` is the sender's readiness: `Pending` while the transport's queue is full
///   (backpressure), an error once the channel is gone.
/// * `call` hands the message over at once, as [`Sender::send`] does (the returned future is
///   already complete); it does not wait for the kernel. To flush or close, reach the
///   `Sender` through the layers' `get_mut()` and call [`Sender::flush`] /
///   [`Sender::close`]; dropping the service closes the direction after what was sent.
///
/// # Reservation
/// A `Sender` has one producer (itself), and only the transport's consumer changes its queue
/// while it waits, by freeing room. So the room `poll_ready` found is still there at `call`:
/// the reservation holds no resource and needs no release — dropping the service, or never
/// calling, after `poll_ready` costs nothing (tower#408's "disarm" is a no-op here). So the
/// `call` after a ready `poll_ready` does not ask the transport for room a second time; a
/// message sent any other way in between (`send`, `try_send`, the `Sink`), or closing,
/// cancels the reservation. A peer that goes away between `poll_ready` and `call` is
/// reported by the next `poll_ready`, as for a message handed over just before it went
/// (the same as the `Sink`'s `poll_ready` and `start_send`).
///
/// Tower's contract is to call `poll_ready` before each `call`. A `call` without it does not
/// panic and loses nothing: it checks for room again and, if there is none, fails with
/// [`ErrorKind::Full`](crate::ErrorKind::Full) and the message in
/// [`Error::take_message`] (what [`Sender::try_send`] does). A message over the peer's
/// limits fails with [`ErrorKind::LimitExceeded`](crate::ErrorKind::LimitExceeded), the
/// message likewise handed back.
impl Service<Message> for Sender {
    type Response = ();
    type Error = Error;
    type Future = Ready<Result<(), Error>>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        let ready = self.poll_ready_inner(cx);
        self.reserved = matches!(ready, Poll::Ready(Ok(())));
        ready
    }

    /// With the room `poll_ready` found (see [Reservation](#reservation)), the message goes
    /// straight to the transport; without it, `call` asks for room first, as `try_send` does.
    #[inline]
    fn call(&mut self, msg: Message) -> Self::Future {
        ready(send_reserved(self, msg))
    }
}

/// Hands `msg` over with the room the `Service` readiness reserved, or, without a
/// reservation, as [`Sender::try_send`] does.
#[inline]
pub(crate) fn send_reserved(tx: &mut Sender, msg: Message) -> Result<(), Error> {
    if std::mem::take(&mut tx.reserved) {
        tx.send_now(msg)
    } else {
        tx.try_send(msg)
    }
}
