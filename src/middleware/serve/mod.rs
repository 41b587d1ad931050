//! [`serve()`]: accept channels and drive a handler service on each.
//!
//! A handler is a `Service<Message, Response = Option<Message>>`: `Some(reply)` goes back on
//! the same channel, with [`Flags::RESPONSE`](crate::Flags::RESPONSE) added and the
//! request's correlation id filled in when the handler left it 0, which is what a
//! [`Client`](crate::middleware::Client) waits for. One handler is made per channel by a
//! make-service (`tower::MakeService<Incoming, Message>`): `tower::make::Shared::new(svc)`
//! clones one service per channel; `tower::service_fn(|incoming: Incoming| async { .. })`
//! makes one from the connection's [`Incoming`] details.
//!
//! Per channel:
//! * **Backpressure.** A message is read, then the handler's `poll_ready` is awaited, then it
//!   is called; nothing more is read while the handler is not ready, or while
//!   [`max_in_flight`](Serve::max_in_flight) calls run (default 64), or while a reply waits
//!   for room in the channel. The transport's queues then fill and the peer's sends wait.
//! * **Errors.** A failed call is logged (rate-limited) and counted; if the message was a
//!   request ([`Flags::REQUEST`](crate::Flags::REQUEST)), the peer gets an error reply of type
//!   [`ERROR_TYPE`] carrying the error text and its kind, which a `Client` turns into an
//!   [`ErrorKind::Remote`] error whose [`remote_kind`](crate::Error::remote_kind) says
//!   what refused it (filter, schema, router, handler) — so a failure is tied to its
//!   request, and no client waits for a reply that will never come. A handler whose
//!   `poll_ready` fails ends its channel.
//! * **No request left waiting.** A request the handler answers with `Ok(None)` (a message
//!   dropped by a [`Discard`](crate::middleware::type_filter::Discard) filter, a handler that
//!   only consumes) gets an error reply saying so, counted in [`ServeStats::unanswered`];
//!   a message that is not a request gets nothing, as before.
//! * **Isolation.** Each channel runs in a task of its own: a failing or panicking handler or
//!   a broken connection ends that channel only, logged and counted
//!   ([`ServeStats::failed`]).
//!
//! **Shutdown** ([`ShutdownHandle::shutdown`] or [`Serve::with_graceful_shutdown`]): stop
//! accepting (the listener is dropped), then on every channel stop reading, finish the calls
//! in flight and send their replies, then close. Messages the peer sent that were not yet
//! read are dropped with the receiver, which tells the peer (its sends fail with
//! [`ErrorKind::Closed`]). Channels still busy after the
//! [`drain_timeout`](Serve::drain_timeout) (default 30 s) are cut off, with a warning.
//!
//! `serve` needs a tokio runtime with time enabled: channels run in tasks it spawns.
//!
//! ```
//! use hyperframes::middleware::{BoxError, serve};
//! use hyperframes::{Context, Message};
//! use tower::{make::Shared, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let ctx = Context::new();
//! let listener = ctx.bind("inproc://serve-doc").await?;
//! let echo = service_fn(|m: Message| async move { Ok::<_, BoxError>(Some(m)) });
//! let server = serve(listener, Shared::new(echo)).max_in_flight(16);
//! let (stop, stats) = (server.shutdown_handle(), server.stats());
//! let task = tokio::spawn(server.into_future());
//!
//! let mut ch = ctx.connect("inproc://serve-doc").await?;
//! ch.send(Message::new("demo.ping")?).await?;
//! assert_eq!(ch.recv().await.unwrap()?.kind(), "demo.ping");
//!
//! stop.shutdown();
//! task.await??; // stopped accepting, drained, closed
//! assert_eq!(stats.responses(), 1);
//! assert!(ch.recv().await.is_none()); // the server closed its direction
//! # Ok(()) }
//! ```

mod conn;

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::{BoxFuture, poll_fn};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower::{MakeService, Service};
use tracing::Instrument;

use super::BoxError;
use super::log_limit::LogLimit;
use crate::channel::{Channel, ChannelInfo, Listener};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Message;

/// The type of the error reply [`serve()`] sends for a failed request: the body is the error
/// text (UTF-8, at most 4 KiB), the metadata key `request-type` names the request's type,
/// `error-kind` classifies the failure by an [`ErrorKind::code`] (`invalid-type`: refused by
/// a type filter; `invalid-meta`: by a metadata schema; `not-found`: no route; a hyperframes
/// error's own kind; `service`: the handler failed or gave no reply), which a
/// [`Client`](crate::middleware::Client) returns as [`Error::remote_kind`]. The header
/// carries [`Flags::RESPONSE`](crate::Flags::RESPONSE) and the request's correlation id.
pub const ERROR_TYPE: &str = "hyperframes.error";

/// What a make-service learns about a new channel.
#[derive(Clone, Debug)]
pub struct Incoming {
    transport: &'static str,
    local_url: String,
    peer_url: String,
}

impl Incoming {
    fn new(info: &ChannelInfo) -> Incoming {
        Incoming {
            transport: info.transport(),
            local_url: info.local_url().to_owned(),
            peer_url: info.peer_url().to_owned(),
        }
    }

    /// The transport: `"tcp"`, `"inproc"`.
    pub fn transport(&self) -> &'static str {
        self.transport
    }

    /// This end's address.
    pub fn local_url(&self) -> &str {
        &self.local_url
    }

    /// The peer's address.
    pub fn peer_url(&self) -> &str {
        &self.peer_url
    }
}

#[derive(Debug)]
pub(crate) struct Counters {
    pub(super) accepted: Tally,
    active: AtomicU64,
    pub(super) failed: Tally,
    pub(super) calls: Tally,
    pub(super) responses: Tally,
    pub(super) errors: Tally,
    pub(super) unanswered: Tally,
    log: LogLimit,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            accepted: Tally::new("hyperframes_serve_channels_accepted_total"),
            active: AtomicU64::new(0),
            failed: Tally::new("hyperframes_serve_channels_failed_total"),
            calls: Tally::new("hyperframes_serve_calls_total"),
            responses: Tally::new("hyperframes_serve_responses_total"),
            errors: Tally::new("hyperframes_serve_errors_total"),
            unanswered: Tally::new("hyperframes_serve_unanswered_total"),
            log: LogLimit::new(Duration::from_secs(1)),
        }
    }
}

/// A count read through [`ServeStats`], and exported as the counter it was made with
/// (feature `metrics`; see [`crate::metrics`]).
pub(crate) struct Tally {
    n: AtomicU64,
    exported: crate::metrics::Counter,
}

impl Tally {
    fn new(name: &'static str) -> Tally {
        Tally {
            n: AtomicU64::new(0),
            exported: crate::metrics::Counter::new(name),
        }
    }

    #[inline]
    pub(super) fn one(&self) {
        self.add(1);
    }

    #[inline]
    pub(super) fn add(&self, n: u64) {
        self.n.fetch_add(n, Ordering::Relaxed);
        self.exported.add(n);
    }

    fn get(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.get().fmt(f)
    }
}

/// Counters of a running [`serve()`]. Cheap to clone; read it from anywhere.
#[derive(Clone, Debug, Default)]
pub struct ServeStats {
    counters: Arc<Counters>,
}

impl ServeStats {
    /// Channels accepted.
    pub fn accepted(&self) -> u64 {
        self.counters.accepted.get()
    }

    /// Channels being served now.
    pub fn active(&self) -> u64 {
        self.counters.active.load(Ordering::Relaxed)
    }

    /// Channels that ended in failure: a broken connection, a failed handler, a panic, a
    /// make-service error, cut off at the drain timeout.
    pub fn failed(&self) -> u64 {
        self.counters.failed.get()
    }

    /// Messages handed to handlers.
    pub fn calls(&self) -> u64 {
        self.counters.calls.get()
    }

    /// Replies sent (error replies included).
    pub fn responses(&self) -> u64 {
        self.counters.responses.get()
    }

    /// Calls that failed (and replies too large for the peer).
    pub fn errors(&self) -> u64 {
        self.counters.errors.get()
    }

    /// Requests ([`Flags::REQUEST`](crate::Flags::REQUEST)) whose handler answered `Ok(None)`
    /// — dropped by a [`Discard`](crate::middleware::type_filter::Discard) filter, say — and
    /// which got an error reply instead, so that the client does not wait for nothing.
    pub fn unanswered(&self) -> u64 {
        self.counters.unanswered.get()
    }
}

/// Triggers the graceful shutdown of a [`serve()`]. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ShutdownHandle {
    tx: Arc<watch::Sender<bool>>,
}

impl ShutdownHandle {
    /// Stop accepting, drain every channel, close. Returns at once; the serve future
    /// completes when the drain is done.
    pub fn shutdown(&self) {
        self.tx.send_replace(true);
    }

    /// True once shutdown was triggered.
    pub fn is_shutdown(&self) -> bool {
        *self.tx.borrow()
    }
}

/// Accepts channels from `listener` and drives a handler made by `make_service` on each;
/// see [the module docs](self). Configure the returned [`Serve`], then `.await` it (or spawn
/// `.into_future()`): it runs until shutdown, or until the listener fails.
pub fn serve<M>(listener: Listener, make_service: M) -> Serve<M> {
    Serve {
        listener,
        make_service,
        max_in_flight: 64,
        drain_timeout: Duration::from_secs(30),
        signal: None,
        shutdown: Arc::new(watch::channel(false).0),
        stats: ServeStats::default(),
    }
}

/// A configured server; see [`serve()`]. `.await` it, or spawn `.into_future()`.
#[must_use = "a Serve does nothing until awaited"]
pub struct Serve<M> {
    listener: Listener,
    make_service: M,
    max_in_flight: usize,
    drain_timeout: Duration,
    signal: Option<BoxFuture<'static, ()>>,
    shutdown: Arc<watch::Sender<bool>>,
    stats: ServeStats,
}

impl<M> Serve<M> {
    /// The most calls in flight per channel. Default 64.
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn max_in_flight(mut self, n: usize) -> Self {
        assert!(n > 0, "serve: max_in_flight must be at least 1");
        self.max_in_flight = n;
        self
    }

    /// How long a shutdown waits for channels to finish their calls before cutting them
    /// off. Default 30 s.
    pub fn drain_timeout(mut self, d: Duration) -> Self {
        self.drain_timeout = d;
        self
    }

    /// Shut down gracefully when `signal` completes (for example `tokio::signal::ctrl_c()`
    /// mapped to `()`), as well as on [`ShutdownHandle::shutdown`].
    pub fn with_graceful_shutdown<F>(mut self, signal: F) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.signal = Some(Box::pin(signal));
        self
    }

    /// A handle to trigger the shutdown.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            tx: self.shutdown.clone(),
        }
    }

    /// The counters.
    pub fn stats(&self) -> ServeStats {
        self.stats.clone()
    }

    /// The listener's address.
    pub fn local_url(&self) -> &str {
        self.listener.local_url()
    }
}

impl<M> fmt::Debug for Serve<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Serve")
            .field("listener", &self.listener)
            .field("max_in_flight", &self.max_in_flight)
            .field("drain_timeout", &self.drain_timeout)
            .finish()
    }
}

impl<M> IntoFuture for Serve<M>
where
    M: MakeService<Incoming, Message, Response = Option<Message>> + Send + 'static,
    M::MakeError: Into<BoxError> + Send + 'static,
    M::Future: Send + 'static,
    M::Service: Send + 'static,
    <M::Service as Service<Message>>::Future: Send + 'static,
    M::Error: Into<BoxError> + Send + 'static,
{
    type Output = Result<()>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

    /// Runs until shutdown (`Ok`) or until the listener or the make-service fails (`Err`,
    /// after draining the channels as a shutdown does).
    ///
    /// # Cancel safety
    /// Dropping the future is an abrupt stop, not a graceful one: the listener is dropped
    /// and every channel's task is aborted, with the calls in flight. Use
    /// [`ShutdownHandle::shutdown`] and await the future to drain.
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(run(self))
    }
}

async fn run<M>(serve: Serve<M>) -> Result<()>
where
    M: MakeService<Incoming, Message, Response = Option<Message>> + Send + 'static,
    M::MakeError: Into<BoxError> + Send + 'static,
    M::Future: Send + 'static,
    M::Service: Send + 'static,
    <M::Service as Service<Message>>::Future: Send + 'static,
    M::Error: Into<BoxError> + Send + 'static,
{
    let Serve {
        mut listener,
        mut make_service,
        max_in_flight,
        drain_timeout,
        signal,
        shutdown,
        stats,
    } = serve;
    let counters = stats.counters;
    let mut stop = shutdown.subscribe();
    let stopped_early = *stop.borrow_and_update();
    let mut signal = signal.unwrap_or_else(|| Box::pin(std::future::pending()));
    let mut channels = JoinSet::new();
    let local = listener.local_url().to_owned();

    let outcome = loop {
        if stopped_early {
            break Ok(());
        }
        tokio::select! {
            biased;
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow_and_update() {
                    break Ok(());
                }
            }
            () = &mut signal => break Ok(()),
            Some(done) = channels.join_next(), if !channels.is_empty() => note_panic(done, &counters),
            accepted = listener.accept() => match accepted {
                Ok(channel) => {
                    counters.accepted.one();
                    // A make-service that is slow to be ready must not hold up a shutdown.
                    let ready = tokio::select! {
                        biased;
                        _ = stop.changed() => None,
                        () = &mut signal => None,
                        r = poll_fn(|cx| make_service.poll_ready(cx)) => Some(r),
                    };
                    match ready {
                        None => break Ok(()), // the channel is dropped with the listener
                        Some(Err(e)) => {
                            break Err(Error::new(
                                ErrorKind::Service,
                                format!("serve {local}: the make-service failed; accepting no more channels"),
                            )
                            .with_source(e.into()));
                        }
                        Some(Ok(())) => {}
                    }
                    let making = make_service.make_service(Incoming::new(channel.info()));
                    let stop = shutdown.subscribe();
                    let counters = counters.clone();
                    channels.spawn(serve_one(channel, making, max_in_flight, stop, counters));
                }
                Err(e) => break Err(e),
            },
        }
    };

    drop(listener);
    shutdown.send_replace(true);
    let busy = channels.len();
    let drain = async {
        while let Some(done) = channels.join_next().await {
            note_panic(done, &counters);
        }
    };
    if tokio::time::timeout(drain_timeout, drain).await.is_err() {
        tracing::warn!(
            "serve {local}: {} of {busy} channels still busy after the drain timeout ({drain_timeout:?}); cutting them off",
            channels.len()
        );
        counters.failed.add(channels.len() as u64);
        channels.abort_all();
        while channels.join_next().await.is_some() {}
    }
    outcome
}

fn note_panic(done: std::result::Result<(), tokio::task::JoinError>, counters: &Counters) {
    if let Err(e) = done
        && e.is_panic()
    {
        counters.failed.one();
        tracing::error!("a channel's handler panicked; that channel is closed, the others go on");
    }
}

async fn serve_one<F, S, E>(
    channel: Channel,
    making: F,
    max_in_flight: usize,
    stop: watch::Receiver<bool>,
    counters: Arc<Counters>,
) where
    F: Future<Output = std::result::Result<S, E>>,
    E: Into<BoxError>,
    S: Service<Message, Response = Option<Message>>,
    S::Error: Into<BoxError>,
{
    let peer = channel.info().peer_url().to_owned();
    let span = channel.info().span().clone();
    async move {
        let svc = match making.await {
            Ok(svc) => svc,
            Err(e) => {
                counters.failed.one();
                tracing::warn!(
                    "no service for the channel with {peer}: {}; closing it",
                    e.into()
                );
                return;
            }
        };
        let active = Active::new(counters.clone());
        let result = conn::drive(channel, svc, max_in_flight, Some(stop), counters.clone()).await;
        drop(active);
        match result {
            Ok(()) => tracing::debug!("channel with {peer} done"),
            Err(e) => {
                counters.failed.one();
                tracing::warn!("channel with {peer} ended: {e:#}");
            }
        }
    }
    .instrument(span)
    .await
}

/// Counts a channel as active while it lives, whether it ends, panics or is aborted.
struct Active {
    counters: Arc<Counters>,
    _gauge: crate::metrics::Held,
}

impl Active {
    fn new(counters: Arc<Counters>) -> Active {
        counters.active.fetch_add(1, Ordering::Relaxed);
        Active {
            counters,
            _gauge: crate::metrics::Held::gauge("hyperframes_serve_channels_active"),
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.counters.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Drives `service` on one channel — one you connected, say — as [`serve()`] does on each
/// channel it accepts (at most 64 calls in flight): until the peer closes its direction
/// (then the calls in flight finish and this end closes), the channel breaks or the
/// handler's `poll_ready` fails (`Err`).
///
/// # Cancel safety
/// Dropping the future drops the channel (a close, as for any dropped channel) and the calls
/// in flight; a message received but not yet handed to the service is lost with it.
pub async fn serve_channel<S>(channel: Channel, service: S) -> Result<()>
where
    S: Service<Message, Response = Option<Message>>,
    S::Error: Into<BoxError>,
{
    conn::drive(channel, service, 64, None, Arc::default()).await
}
