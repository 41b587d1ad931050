//! Driving a handler on one channel.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use futures_util::StreamExt;
use futures_util::future::poll_fn;
use futures_util::stream::FuturesUnordered;
use pin_project_lite::pin_project;
use tokio::sync::watch;
use tower::Service;
use tracing::Instrument;

use super::{Counters, ERROR_TYPE};
use crate::channel::{Channel, Sender};
use crate::error::{Error, ErrorKind, Result};
use crate::message::{Flags, Header, Message, MsgType};
use crate::middleware::BoxError;

/// What a response needs from its request, and the span its call runs in.
struct Request {
    header: Header,
    kind: MsgType,
    span: tracing::Span,
}

pin_project! {
    /// A call in flight, with what its reply needs from the request.
    struct Call<F> {
        request: Option<Request>,
        #[pin]
        future: F,
    }
}

impl<F: Future> Future for Call<F> {
    type Output = (Request, F::Output);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let span = &this
            .request
            .as_ref()
            .expect("Call polled after completion")
            .span;
        let out = ready!(span.in_scope(|| this.future.poll(cx)));
        Poll::Ready((
            this.request.take().expect("Call polled after completion"),
            out,
        ))
    }
}

/// The longest error text put in an error reply, in bytes.
const MAX_ERROR_TEXT: usize = 4096;

/// How an error reply classifies `err` (its `error-kind`): the middleware's refusals by what
/// they refused, a hyperframes error by its kind, anything else the handler's failure.
fn classify(err: &BoxError) -> ErrorKind {
    use crate::middleware::{
        meta_schema::SchemaViolation, router::NoRoute, type_filter::Unmatched,
    };
    if let Some(e) = err.downcast_ref::<crate::error::Error>() {
        e.kind()
    } else if err.is::<Unmatched>() {
        ErrorKind::InvalidType
    } else if err.is::<SchemaViolation>() {
        ErrorKind::InvalidMeta
    } else if err.is::<NoRoute>() {
        ErrorKind::NotFound
    } else {
        ErrorKind::Service
    }
}

/// The error reply to a failed request: see [`ERROR_TYPE`].
pub(crate) fn error_reply(request_kind: &MsgType, correlation: u64, err: &BoxError) -> Message {
    let code = classify(err).code();
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    if text.len() > MAX_ERROR_TEXT {
        let mut at = MAX_ERROR_TEXT;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
    }
    let msg = Message::new(MsgType::from_static(ERROR_TYPE))
        .expect("a valid static type")
        .with_body(text)
        .with_header(Header {
            flags: Flags::RESPONSE,
            correlation,
        });
    // A type is at most 255 bytes of key-safe characters, so this cannot fail; stay silent
    // rather than panic if it ever did.
    msg.clone()
        .with_meta("request-type", request_kind.as_str())
        .and_then(|m| m.with_meta("error-kind", code))
        .unwrap_or(msg)
}

/// Runs `svc` on `channel` until the peer closes, the channel breaks, the service fails, or
/// shutdown (then: stop reading, finish the calls in flight, close).
///
/// A message is received *before* the service's readiness is polled, so an idle channel
/// holds no reservation; at most one received message waits for readiness, and at most
/// `max_in_flight` calls run at once. Meanwhile nothing more is read, so the transport's
/// receive queue fills and the peer is backpressured.
///
/// The first call in flight lives in this future's own (pinned) state and only the others go
/// to a `FuturesUnordered`, so a channel carrying one request at a time allocates nothing per
/// request; the shutdown signal is one long-lived future polled last (to wake an idle loop),
/// and a flag checked at every turn, not a new registration with the watch channel each time.
pub(super) async fn drive<S>(
    channel: Channel,
    svc: S,
    max_in_flight: usize,
    shutdown: Option<watch::Receiver<bool>>,
    stats: Arc<Counters>,
) -> Result<()>
where
    S: Service<Message, Response = Option<Message>>,
    S::Error: Into<BoxError>,
{
    let span = channel.info().span().clone();
    drive_in_span(channel, svc, max_in_flight, shutdown, stats)
        .instrument(span)
        .await
}

async fn drive_in_span<S>(
    channel: Channel,
    mut svc: S,
    max_in_flight: usize,
    shutdown: Option<watch::Receiver<bool>>,
    stats: Arc<Counters>,
) -> Result<()>
where
    S: Service<Message, Response = Option<Message>>,
    S::Error: Into<BoxError>,
{
    let peer = channel.info().peer_url().to_owned();
    let (mut tx, mut rx) = channel.split();
    let mut first: Pin<&mut Option<Call<S::Future>>> = pin!(None);
    let mut in_flight: FuturesUnordered<Call<S::Future>> = FuturesUnordered::new();
    let mut waiting: Option<Message> = None;
    let mut reading = true;
    // Without a shutdown signal (`serve_channel`), nothing is polled for one.
    let (mut shutdown_seen, mut stop_signal) = match shutdown {
        Some(s) => (Some(s.clone()), Some(s)),
        None => (None, None),
    };
    let mut draining = shutdown_seen
        .as_mut()
        .is_some_and(|s| *s.borrow_and_update());
    let listening = stop_signal.is_some();
    let mut stop = pin!(async move {
        if let Some(signal) = stop_signal.as_mut() {
            // An error means the server is gone: shut down as well.
            let _ = signal.wait_for(|stop| *stop).await;
        }
    });
    let mut outcome = Ok(());

    loop {
        // The flag, checked at every turn (an atomic load): the `stop` branch comes last, so
        // under load it may not be polled, and it is there to wake an idle loop.
        if !draining
            && let Some(seen) = shutdown_seen.as_mut()
            && seen.has_changed().unwrap_or(true)
        {
            draining = seen.has_changed().is_err() || *seen.borrow_and_update();
        }
        // The common case without a turn of the select below: a received message whose
        // handler is ready is called at once, and a call that finishes at its first poll
        // (a handler that does not wait) is answered at once.
        if waiting.is_some() && first.is_none() {
            match poll_fn(|cx| Poll::Ready(svc.poll_ready(cx))).await {
                Poll::Ready(Ok(())) => {
                    let call = start(&mut svc, waiting.take().expect("a waiting message"), &stats);
                    first.set(Some(call));
                    let mut call = first.as_mut().as_pin_mut().expect("just set");
                    if let Poll::Ready((req, result)) =
                        poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await
                    {
                        first.set(None);
                        if let Some(reply) = reply_to(&peer, &stats, &req, result)
                            && let Err(e) = match try_reply(&mut tx, &stats, reply) {
                                Ok(()) => Ok(()),
                                Err(e) => reply_slowly(&mut tx, &peer, &stats, &req, e).await,
                            }
                        {
                            outcome = Err(e);
                            break;
                        }
                    }
                }
                Poll::Ready(Err(e)) => {
                    outcome = Err(not_ready(&peer, e));
                    break;
                }
                Poll::Pending => {} // the select below waits for it
            }
        }
        let busy = usize::from(first.is_some()) + in_flight.len();
        let accepting = reading && !draining && waiting.is_none() && busy < max_in_flight;
        if !accepting && waiting.is_none() && busy == 0 {
            break;
        }
        let done = tokio::select! {
            biased;
            done = poll_fn(|cx| match first.as_mut().as_pin_mut() {
                Some(call) => call.poll(cx),
                None => Poll::Pending,
            }), if first.is_some() => {
                first.set(None);
                Some(done)
            }
            Some(done) = in_flight.next() => Some(done),
            ready = poll_fn(|cx| svc.poll_ready(cx)), if waiting.is_some() => match ready {
                Ok(()) => {
                    let call = start(&mut svc, waiting.take().expect("a waiting message"), &stats);
                    if first.is_none() {
                        first.set(Some(call));
                    } else {
                        in_flight.push(call);
                    }
                    None
                }
                Err(e) => {
                    outcome = Err(not_ready(&peer, e));
                    break;
                }
            },
            next = rx.recv(), if accepting => {
                match next {
                    Some(Ok(msg)) => waiting = Some(msg),
                    Some(Err(e)) => {
                        // Finish what is in flight (its replies will likely fail too), then end.
                        reading = false;
                        outcome = Err(e);
                    }
                    None => reading = false,
                }
                None
            }
            () = &mut stop, if listening && !draining => {
                draining = true;
                None
            }
            else => break,
        };
        if let Some((req, result)) = done
            && let Some(reply) = reply_to(&peer, &stats, &req, result)
            && let Err(e) = match try_reply(&mut tx, &stats, reply) {
                Ok(()) => Ok(()),
                Err(e) => reply_slowly(&mut tx, &peer, &stats, &req, e).await,
            }
        {
            outcome = Err(e);
            break;
        }
    }
    if let Some(msg) = waiting.take() {
        tracing::warn!(
            "a message of type `{}` from {peer} was received but not handled: the channel ended",
            msg.kind()
        );
    }
    // Calls still in flight here are abandoned only on error (the loop drains them otherwise).
    first.set(None);
    drop(in_flight);
    let closed = tx.close().await;
    outcome.and(match closed {
        // The peer may have gone first; that is the end of the channel, not a failure.
        Err(e) if e.is_closed() => Ok(()),
        other => other,
    })
}

/// Calls the service with `msg`, keeping what the reply needs from the request.
///
/// The call runs in a span `hf.process` (level DEBUG, a child of the channel's) with the
/// fields of OpenTelemetry's messaging conventions for processing a received message:
/// `messaging.operation.type` (`"process"`), `messaging.destination.name` (the type),
/// `messaging.message.conversation_id` (the correlation id, 0 for none) and
/// `messaging.message.body.size`. Disabled, it costs a load and a compare.
fn start<S: Service<Message>>(svc: &mut S, msg: Message, stats: &Counters) -> Call<S::Future> {
    let header = msg.header();
    let span = tracing::debug_span!(
        target: "hyperframes",
        "hf.process",
        messaging.operation.type = "process",
        messaging.destination.name = %msg.kind(),
        messaging.message.conversation_id = header.correlation,
        messaging.message.body.size = msg.body().len(),
    );
    let req = Request {
        header,
        kind: msg.kind().clone(),
        span,
    };
    stats.calls.one();
    let future = req.span.in_scope(|| svc.call(msg));
    Call {
        request: Some(req),
        future,
    }
}

/// The end of a channel whose handler's `poll_ready` failed.
fn not_ready(peer: &str, e: impl Into<BoxError>) -> Error {
    Error::new(
        ErrorKind::Service,
        format!("the handler of the channel with {peer} failed and can take no more messages"),
    )
    .with_source(e.into())
}

/// What a finished call sends back, if anything: its response, marked as one and
/// correlated, or an error reply to a request whose handler failed or gave none (counted,
/// and a failure logged at a bounded rate).
fn reply_to<E: Into<BoxError>>(
    peer: &str,
    stats: &Counters,
    req: &Request,
    result: std::result::Result<Option<Message>, E>,
) -> Option<Message> {
    match result {
        Ok(Some(mut resp)) => {
            let h = resp.header_mut();
            h.flags = h.flags.union(Flags::RESPONSE);
            if h.correlation == 0 {
                h.correlation = req.header.correlation;
            }
            Some(resp)
        }
        Ok(None) if !req.header.flags.contains(Flags::REQUEST) => None,
        Ok(None) => Some(unanswered(peer, stats, req)),
        Err(e) => failed(peer, stats, req, e.into()),
    }
}

/// The error reply to a request its handler gave no reply to: the client waits for one.
#[cold]
fn unanswered(peer: &str, stats: &Counters, req: &Request) -> Message {
    stats.unanswered.one();
    req.span.in_scope(|| {
        tracing::debug!(
            "the handler gave no reply to a request of type `{}` from {peer}; answering with an error",
            req.kind
        )
    });
    let why: BoxError =
        "the handler gave no reply to this request (a filter may have dropped it)".into();
    error_reply(&req.kind, req.header.correlation, &why)
}

/// A failed call: counted, logged at a bounded rate, and answered with an error reply when
/// it was a request.
#[cold]
fn failed(peer: &str, stats: &Counters, req: &Request, e: BoxError) -> Option<Message> {
    stats.errors.one();
    if let Some(held) = stats.log.allow() {
        req.span.in_scope(|| {
            tracing::warn!(
                held_back = held,
                "handler failed on a message of type `{}` from {peer}: {e:#}{}",
                req.kind,
                if held > 0 {
                    format!(" ({held} more failures since the last warning)")
                } else {
                    String::new()
                },
            )
        });
    }
    if !req.header.flags.contains(Flags::REQUEST) {
        return None;
    }
    Some(error_reply(&req.kind, req.header.correlation, &e))
}

/// Hands `reply` to the channel if it has room now: the path of nearly every reply, with no
/// future to build. A body in device memory is not tried here (the channel sends it in
/// pieces, which only [`Sender::send`] sees through). `Err` carries the reply back for
/// [`reply_slowly`].
#[inline]
fn try_reply(tx: &mut Sender, stats: &Counters, reply: Message) -> Result<()> {
    if reply.body().as_bytes().is_none() {
        return Err(Error::new(ErrorKind::Full, "a body in device memory").with_message(reply));
    }
    tx.try_send(reply)?;
    stats.responses.one();
    Ok(())
}

/// The reply [`try_reply`] could not hand over at once: waits for room, or, when it is too
/// large for the peer, answers a request with an error reply instead. `Err` only when the
/// channel can carry nothing more.
async fn reply_slowly(
    tx: &mut Sender,
    peer: &str,
    stats: &Counters,
    req: &Request,
    mut e: Error,
) -> Result<()> {
    let sent = match e.kind() {
        ErrorKind::Full => match e.take_message() {
            Some(reply) => tx.send(reply).await,
            None => return Err(e),
        },
        _ => Err(e),
    };
    match sent {
        Ok(()) => {
            stats.responses.one();
            Ok(())
        }
        Err(mut e) if e.kind() == ErrorKind::LimitExceeded => {
            // Too large for the peer: this reply is lost, the channel is fine.
            stats.errors.one();
            req.span
                .in_scope(|| tracing::warn!("response to {peer} not sent: {e:#}"));
            if req.header.flags.contains(Flags::REQUEST) {
                drop(e.take_message());
                let reason: BoxError = e.into();
                let _ = tx
                    .send(error_reply(&req.kind, req.header.correlation, &reason))
                    .await;
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}
