//! [`Client`]: a channel as a `Service<Message, Response = Message>`, pairing each request
//! with its reply by the header's correlation id.
//!
//! Many requests may be in flight at once; replies may come in any order. The client sets
//! each request's header to [`Flags::REQUEST`] and a fresh correlation id; the peer (for
//! example [`serve()`](crate::middleware::serve())) answers with
//! [`Flags::RESPONSE`] and the same id. A task spawned by [`Client::new`] reads the channel
//! and hands each reply to its request.
//!
//! * **Slots.** At most [`max_in_flight`](Client::max_in_flight) requests are in flight
//!   (default 1024); `poll_ready` waits for a free slot and for room in the channel. A slot
//!   is freed when the response future completes *or is dropped*: a cancelled request (a
//!   timeout, a dropped `select!` branch) frees its slot at once.
//! * **Late replies.** A reply to a cancelled request is discarded and counted
//!   ([`ClientStats::discarded_replies`]), never leaked; so are messages that are not
//!   replies at all ([`ClientStats::unsolicited`]).
//! * **Failure.** When the channel breaks or the peer closes it, every request in flight
//!   fails with that error (no hang), and so does every later call. An error reply from
//!   `serve` (type [`ERROR_TYPE`]) fails its request
//!   with [`ErrorKind::Remote`].
//!
//! The client is not `Clone` (it owns the channel's [`Sender`]): share it with
//! `tower::buffer::Buffer`, which also lets `retry` clone it. Tower's `timeout`,
//! `concurrency_limit`, `buffer`, `retry` and `balance` compose as with any service:
//!
//! ```
//! use std::time::Duration;
//! use hyperframes::middleware::{BoxError, Client, serve_channel};
//! use hyperframes::{Context, Message};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let ctx = Context::new();
//! let mut listener = ctx.bind("inproc://client-doc").await?;
//! let client_side = ctx.connect("inproc://client-doc").await?;
//! let server_side = listener.accept().await?;
//! let echo = service_fn(|m: Message| async move { Ok::<_, BoxError>(Some(m)) });
//! tokio::spawn(serve_channel(server_side, echo));
//!
//! let client = Client::new(client_side);
//! let stats = client.stats();
//! let mut svc = ServiceBuilder::new()
//!     .buffer(64)
//!     .timeout(Duration::from_secs(5))
//!     .concurrency_limit(16)
//!     .service(client);
//! let reply = svc.ready().await?.call(Message::new("demo.echo")?.with_body("hi")).await?;
//! assert_eq!(reply.body().as_bytes().unwrap(), "hi");
//! assert_eq!(stats.in_flight(), 0);
//! # Ok(()) }
//! ```
//!
//! # Reservation
//! `poll_ready` reserves a slot, held until the next `call` consumes it or the client is
//! dropped; [`disarm`](Client::disarm) gives it back without calling (tower#408). A `call`
//! without `poll_ready` does not panic: it takes a slot if one is free, and otherwise fails
//! with [`ErrorKind::Full`], handing the message back.

pub mod future;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;
use tower::Service;

use self::future::ResponseFuture;
use super::log_limit::LogLimit;
use super::serve::ERROR_TYPE;
use crate::{Channel, Error, ErrorKind, Flags, Header, Message, Receiver, Result, Sender};

/// A channel as a request/response service; see [the module docs](self).
pub struct Client {
    tx: Sender,
    inner: Arc<Inner>,
    next_id: u64,
    max_in_flight: usize,
    /// A slot taken by `poll_ready` for the next `call`.
    reserved: bool,
}

type Waiter = oneshot::Sender<Result<Message>>;

struct Inner {
    peer: String,
    state: Mutex<State>,
    /// Slots taken: reserved by `poll_ready` or held by a response future.
    in_flight: AtomicUsize,
    /// The client's `poll_ready` waiting for a slot (only the client polls: it is not Clone).
    slot_waker: AtomicWaker,
    failed: AtomicBool,
    discarded: AtomicU64,
    unsolicited: AtomicU64,
    client_alive: AtomicBool,
    reader: Mutex<Option<AbortHandle>>,
    log: LogLimit,
}

struct State {
    pending: HashMap<u64, Waiter>,
    failure: Option<Error>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section is a single map operation: the state stays consistent even
        // if a holder panicked.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failure(&self) -> Option<Error> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.state().failure.as_ref().map(Error::duplicate)
    }

    fn try_take_slot(&self, max: usize) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    fn release_slot(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.slot_waker.wake();
    }

    /// Hands a received message to the request it answers.
    fn deliver(&self, msg: Message) {
        let header = msg.header();
        if !header.flags.contains(Flags::RESPONSE) {
            let n = self.unsolicited.fetch_add(1, Ordering::Relaxed) + 1;
            if self.log.allow().is_some() {
                tracing::warn!(
                    "client of {}: discarded a message of type `{}` that is not a reply ({n} so far); a Client only takes replies",
                    self.peer,
                    msg.kind()
                );
            }
            return;
        }
        let waiter = self.state().pending.remove(&header.correlation);
        let Some(waiter) = waiter else {
            self.discarded.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                "client of {}: discarded reply {} of type `{}`: its request was cancelled",
                self.peer,
                header.correlation,
                msg.kind()
            );
            return;
        };
        let result = if msg.kind() == ERROR_TYPE {
            Err(remote_error(&self.peer, &msg))
        } else {
            Ok(msg)
        };
        if waiter.send(result).is_err() {
            // Cancelled between the lookup and now.
            self.discarded.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Fails every request in flight, and every later one, with `err`.
    fn fail(&self, err: Error) {
        let waiters: Vec<Waiter> = {
            let mut st = self.state();
            let waiters = st.pending.drain().map(|(_, w)| w).collect();
            st.failure = Some(err.duplicate());
            waiters
        };
        self.failed.store(true, Ordering::Release);
        if !waiters.is_empty() {
            tracing::debug!(
                "client of {}: failing {} requests in flight: {err}",
                self.peer,
                waiters.len()
            );
        }
        for w in waiters {
            let _ = w.send(Err(err.duplicate()));
        }
        self.slot_waker.wake();
    }

    /// Stops the reader once nobody can want a reply any more.
    fn maybe_stop_reader(&self) {
        if self.client_alive.load(Ordering::Acquire) || !self.state().pending.is_empty() {
            return;
        }
        let reader = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(r) = reader {
            r.abort();
        }
    }
}

fn remote_error(peer: &str, msg: &Message) -> Error {
    let text = msg
        .body()
        .as_bytes()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default();
    let kind = msg.meta().get("request-type").unwrap_or("?");
    Error::new(
        ErrorKind::Remote,
        format!("{peer} failed the request of type `{kind}`: {text}"),
    )
}

/// A taken slot, with the request's entry in the pending map once it has one; freed on drop.
struct Slot {
    inner: Arc<Inner>,
    id: Option<u64>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.inner.state().pending.remove(&id);
        }
        self.inner.release_slot();
        self.inner.maybe_stop_reader();
    }
}

async fn read_replies(mut rx: Receiver, inner: Arc<Inner>) {
    let end = loop {
        match rx.recv().await {
            Some(Ok(msg)) => inner.deliver(msg),
            Some(Err(e)) => break e,
            None => {
                break Error::new(
                    ErrorKind::Closed,
                    format!(
                        "{} closed the channel; no more replies will come",
                        inner.peer
                    ),
                );
            }
        }
    };
    inner.fail(end);
}

impl Client {
    /// Wraps `channel`, spawning the task that reads its replies on the current tokio
    /// runtime. The task ends when the peer closes the channel or it breaks, or once the
    /// client and every response future are dropped.
    ///
    /// # Panics
    /// Outside a tokio runtime (as `tokio::spawn` does).
    pub fn new(channel: Channel) -> Client {
        let peer = channel.info().peer_url().to_owned();
        let (tx, rx) = channel.split();
        let inner = Arc::new(Inner {
            peer,
            state: Mutex::new(State {
                pending: HashMap::new(),
                failure: None,
            }),
            in_flight: AtomicUsize::new(0),
            slot_waker: AtomicWaker::new(),
            failed: AtomicBool::new(false),
            discarded: AtomicU64::new(0),
            unsolicited: AtomicU64::new(0),
            client_alive: AtomicBool::new(true),
            reader: Mutex::new(None),
            log: LogLimit::new(Duration::from_secs(1)),
        });
        let reader = tokio::spawn(read_replies(rx, inner.clone()));
        *inner.reader.lock().unwrap_or_else(|p| p.into_inner()) = Some(reader.abort_handle());
        Client {
            tx,
            inner,
            next_id: 1,
            max_in_flight: 1024,
            reserved: false,
        }
    }

    /// The most requests in flight at once. Default 1024.
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn max_in_flight(mut self, n: usize) -> Client {
        assert!(n > 0, "Client: max_in_flight must be at least 1");
        self.max_in_flight = n;
        self
    }

    /// Counters and the number in flight; a handle to keep after the client went into a
    /// `Buffer` or other layers.
    pub fn stats(&self) -> ClientStats {
        ClientStats {
            inner: self.inner.clone(),
        }
    }

    /// Gives back the slot a successful `poll_ready` reserved, without calling.
    pub fn disarm(&mut self) {
        if std::mem::take(&mut self.reserved) {
            self.inner.release_slot();
        }
    }

    /// The channel's sending half: to [`flush`](Sender::flush) or [`close`](Sender::close)
    /// it. (Replies to requests in flight still arrive after a close.)
    pub fn sender_mut(&mut self) -> &mut Sender {
        &mut self.tx
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        // 0 means "no correlation"; after 2^64 - 1 requests, wrap past it.
        self.next_id = self.next_id.wrapping_add(1).max(1);
        id
    }
}

impl Service<Message> for Client {
    type Response = Message;
    type Error = Error;
    type Future = ResponseFuture;

    /// Ready with a slot reserved and room in the channel; an error once the channel failed.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(e) = self.inner.failure() {
            self.disarm();
            return Poll::Ready(Err(e));
        }
        if !self.reserved {
            if !self.inner.try_take_slot(self.max_in_flight) {
                self.inner.slot_waker.register(cx.waker());
                if !self.inner.try_take_slot(self.max_in_flight) {
                    return match self.inner.failure() {
                        Some(e) => Poll::Ready(Err(e)),
                        None => Poll::Pending,
                    };
                }
            }
            self.reserved = true;
        }
        self.tx.poll_ready_inner(cx)
    }

    fn call(&mut self, mut msg: Message) -> ResponseFuture {
        if !std::mem::take(&mut self.reserved) && !self.inner.try_take_slot(self.max_in_flight) {
            return ResponseFuture::failed(
                Error::new(
                    ErrorKind::Full,
                    format!(
                        "Client::call without poll_ready, and all {} request slots are taken",
                        self.max_in_flight
                    ),
                )
                .with_message(msg),
            );
        }
        let mut slot = Slot {
            inner: self.inner.clone(),
            id: None,
        };
        let id = self.next_id();
        *msg.header_mut() = Header {
            flags: Flags::REQUEST,
            correlation: id,
        };
        let (waiter, reply) = oneshot::channel();
        {
            let mut st = self.inner.state();
            if let Some(e) = &st.failure {
                return ResponseFuture::failed(e.duplicate().with_message(msg));
            }
            st.pending.insert(id, waiter);
        }
        slot.id = Some(id);
        if let Err(e) = self.tx.try_send(msg) {
            return ResponseFuture::failed(e);
        }
        ResponseFuture::waiting(reply, slot)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.disarm();
        self.inner.client_alive.store(false, Ordering::Release);
        self.inner.maybe_stop_reader();
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("peer", &self.inner.peer)
            .field("in_flight", &self.inner.in_flight.load(Ordering::Relaxed))
            .field("max_in_flight", &self.max_in_flight)
            .finish()
    }
}

/// Counters of a [`Client`]. Cheap to clone; read it from anywhere.
#[derive(Clone)]
pub struct ClientStats {
    inner: Arc<Inner>,
}

impl ClientStats {
    /// Slots taken now: requests awaiting a reply (and a reservation made by `poll_ready`).
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Acquire)
    }

    /// Replies that arrived for no waiting request (it was cancelled) and were discarded.
    pub fn discarded_replies(&self) -> u64 {
        self.inner.discarded.load(Ordering::Relaxed)
    }

    /// Messages received that were not replies (no [`Flags::RESPONSE`]), discarded.
    pub fn unsolicited(&self) -> u64 {
        self.inner.unsolicited.load(Ordering::Relaxed)
    }

    /// True once the channel failed or closed: every call fails from then on.
    pub fn is_failed(&self) -> bool {
        self.inner.failed.load(Ordering::Acquire)
    }
}

impl fmt::Debug for ClientStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientStats")
            .field("in_flight", &self.in_flight())
            .field("discarded_replies", &self.discarded_replies())
            .field("unsolicited", &self.unsolicited())
            .finish()
    }
}
