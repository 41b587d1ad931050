//! [`Client`]: a channel as a `Service<Message, Response = Message>`, pairing each request
//! with its reply by the header's correlation id.
//!
//! Many requests may be in flight at once; replies may come in any order. The client sets
//! each request's header to [`Flags::REQUEST`] and a fresh correlation id; the peer (for
//! example [`serve()`](crate::middleware::serve())) answers with
//! [`Flags::RESPONSE`] and the same id. There is no reader task: a response future being
//! polled reads the channel itself and hands each reply it finds to its request (waking it),
//! so a reply reaches its caller without a hop through another task. Messages that arrive
//! while no request is in flight wait in the channel (backpressure on the peer) until the
//! next request reads them.
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
//!   with [`ErrorKind::Remote`]; [`Error::remote_kind`](crate::Error::remote_kind) tells what
//!   on the server refused or failed it.
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
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::task::AtomicWaker;
use tower::Service;

use self::future::ResponseFuture;
use super::log_limit::LogLimit;
use super::serve::ERROR_TYPE;
use crate::channel::{Channel, Receiver, Sender};
use crate::error::{Error, ErrorKind, Result};
use crate::message::{Flags, Header, Message};

/// A channel as a request/response service; see [the module docs](self).
pub struct Client {
    tx: Sender,
    inner: Arc<Inner>,
    next_id: u64,
    max_in_flight: usize,
    /// A slot taken by `poll_ready` for the next `call`.
    reserved: bool,
}

/// Correlation ids are a counter: hashing them is a multiply (SipHash per insert and
/// removal cost more than the rest of the bookkeeping).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

struct Inner {
    peer: String,
    /// The requests in flight and the channel's receiving half, under one lock: a response
    /// future being polled takes it, finds its reply or reads the channel (handing the
    /// replies of others to them on the way), and lets go. Every critical section is a few
    /// map operations and at most [`READS_PER_POLL`] non-blocking receives.
    shared: Mutex<Shared>,
    /// Slots taken: reserved by `poll_ready` or held by a response future.
    in_flight: AtomicUsize,
    /// The client's `poll_ready` waiting for a slot (only the client polls: it is not Clone).
    slot_waker: AtomicWaker,
    /// Set by `poll_ready` before it registers in `slot_waker`: a freed slot wakes it only
    /// then (a wake is two atomic operations, which every request would pay otherwise).
    slot_wanted: AtomicBool,
    failed: AtomicBool,
    discarded: AtomicU64,
    unsolicited: AtomicU64,
    log: LogLimit,
}

/// A bound on the messages one poll takes from the channel, so a flood of other replies
/// cannot hold a task; past it, the poll yields and comes back.
const READS_PER_POLL: usize = 64;

/// The requests in flight: the first in a field of its own, the others in a map, so a client
/// that makes one request at a time never hashes.
#[derive(Default)]
struct Pending {
    one: Option<(u64, Entry)>,
    more: HashMap<u64, Entry, BuildHasherDefault<IdHasher>>,
}

impl Pending {
    fn insert(&mut self, id: u64, entry: Entry) {
        match self.one {
            None => self.one = Some((id, entry)),
            Some(_) => {
                self.more.insert(id, entry);
            }
        }
    }

    #[inline]
    fn get_mut(&mut self, id: u64) -> Option<&mut Entry> {
        match &mut self.one {
            Some((k, e)) if *k == id => Some(e),
            _ if self.more.is_empty() => None,
            _ => self.more.get_mut(&id),
        }
    }

    #[inline]
    fn remove(&mut self, id: u64) -> Option<Entry> {
        if matches!(&self.one, Some((k, _)) if *k == id) {
            return self.one.take().map(|(_, e)| e);
        }
        if self.more.is_empty() {
            return None;
        }
        self.more.remove(&id)
    }

    fn len(&self) -> usize {
        usize::from(self.one.is_some()) + self.more.len()
    }

    fn is_empty(&self) -> bool {
        self.one.is_none() && self.more.is_empty()
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (&u64, &mut Entry)> {
        self.one
            .iter_mut()
            .map(|(k, e)| (&*k, e))
            .chain(self.more.iter_mut())
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.iter_mut().map(|(_, e)| e)
    }
}

/// A request in flight: whether its reply came (it waits in [`Shared::answered`]), and the
/// waker of its response future. Small, so the map moves a few words per request, not a
/// message.
struct Entry {
    answered: bool,
    waker: Option<Waker>,
}

struct Shared {
    /// The channel's receiving half, read by the response futures themselves (there is no
    /// reader task). `None` once it ended.
    rx: Option<Receiver>,
    pending: Pending,
    /// Replies (or failures) handed to requests in flight by another request's read, until
    /// they take them: at most one per entry in `pending`, and usually empty (a request that
    /// reads its own reply returns it at once).
    answered: Vec<(u64, Result<Message>)>,
    failure: Option<Error>,
    /// The request whose waker the receiver holds (it polled last and got `Pending`): when it
    /// leaves, another request must take over reading, or the others would wait forever.
    reader: Option<u64>,
    /// The waker of the last request that left, for the next one from the same task to take
    /// instead of a clone (a task making one request after another wakes the same way). It
    /// holds a reference to that task until the next request or the client's end.
    spare: Option<Waker>,
}

impl Inner {
    fn shared(&self) -> MutexGuard<'_, Shared> {
        // Every critical section leaves the state consistent at each step: it stays usable
        // even if a holder panicked.
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failure(&self) -> Option<Error> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.shared().failure.as_ref().map(Error::duplicate)
    }

    fn try_take_slot(&self, max: usize) -> bool {
        self.in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    fn release_slot(&self) {
        // SeqCst, paired with `poll_ready`'s store of `slot_wanted` then retry: either this
        // load sees its store, or its retry sees this decrement.
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.slot_wanted.load(Ordering::SeqCst) && self.slot_wanted.swap(false, Ordering::SeqCst)
        {
            self.slot_waker.wake();
        }
    }

    /// What a received message means: `Some((id, result))` for a reply, `None` (counted and
    /// logged, or a session reset applied to `sh`) for a message that is not one.
    fn classify(&self, sh: &mut Shared, msg: Message) -> Option<(u64, Result<Message>)> {
        let header = msg.header();
        if !header.flags.contains(Flags::RESPONSE) {
            if msg.kind() == crate::session::RESET_TYPE && header.flags == Flags::NONE {
                self.on_reset(sh, &msg);
                return None;
            }
            let n = self.unsolicited.fetch_add(1, Ordering::Relaxed) + 1;
            crate::metrics::count!("hyperframes_client_unsolicited_total", 1);
            if self.log.allow().is_some() {
                tracing::warn!(
                    "client of {}: discarded a message of type `{}` that is not a reply ({n} so far); a Client only takes replies",
                    self.peer,
                    msg.kind()
                );
            }
            return None;
        }
        Some((header.correlation, self.reply_result(msg)))
    }

    /// A reply as its request's result: an error reply from `serve` fails it.
    #[inline]
    fn reply_result(&self, msg: Message) -> Result<Message> {
        if msg.kind() == ERROR_TYPE {
            Err(remote_error(&self.peer, &msg))
        } else {
            Ok(msg)
        }
    }

    /// The server lost the session (it restarted): the requests it is not being sent again
    /// may or may not have been handled, and their replies will never come. Fail them.
    #[cold]
    fn on_reset(&self, sh: &mut Shared, msg: &Message) {
        let resent: std::collections::HashSet<u64> = crate::session::reset_ids(msg).collect();
        let mut failed = 0;
        for (id, e) in sh.pending.iter_mut() {
            if e.answered || resent.contains(id) {
                continue;
            }
            e.answered = true;
            sh.answered.push((
                *id,
                Err(Error::new(
                    ErrorKind::ConnectionLost,
                    format!(
                        "{} lost the session after it received request {id} (it restarted?): the request may or may not have been handled",
                        self.peer
                    ),
                )),
            ));
            failed += 1;
            // Waking under the lock: a wake only schedules the task (it polls later).
            if let Some(w) = e.waker.take() {
                w.wake();
            }
        }
        tracing::warn!(
            "client of {}: the server lost the session; {failed} requests failed, {} sent again",
            self.peer,
            resent.len()
        );
    }

    /// Hands the reply `id` to its request and wakes it; counts it when the request is gone.
    fn deliver(&self, sh: &mut Shared, id: u64, result: Result<Message>) {
        match sh.pending.get_mut(id) {
            Some(entry) if !entry.answered => {
                entry.answered = true;
                sh.answered.push((id, result));
                if let Some(w) = entry.waker.take() {
                    w.wake();
                }
            }
            _ => {
                self.discarded.fetch_add(1, Ordering::Relaxed);
                crate::metrics::count!("hyperframes_client_discarded_replies_total", 1);
                tracing::debug!(
                    "client of {}: discarded reply {id}: its request was cancelled",
                    self.peer,
                );
            }
        }
    }

    /// Fails every request in flight, and every later one, with `err`.
    fn fail(&self, sh: &mut Shared, err: Error) {
        sh.failure = Some(err.duplicate());
        sh.reader = None;
        let n = sh.pending.len();
        if n > 0 {
            tracing::debug!(
                "client of {}: failing {n} requests in flight: {err:#}",
                self.peer
            );
        }
        for (id, e) in sh.pending.iter_mut() {
            if !e.answered {
                e.answered = true;
                sh.answered.push((*id, Err(err.duplicate())));
            }
            if let Some(w) = e.waker.take() {
                w.wake();
            }
        }
        self.failed.store(true, Ordering::Release);
        self.slot_waker.wake();
    }

    /// Request `id` leaves (answered or cancelled): forget it, and if the receiver may hold
    /// its waker (it is the reader), or no request is known to be reading (it may have taken
    /// its own reply from the channel last), wake another request to read in its place. A
    /// wake too many costs a poll; one too few would leave the others waiting forever.
    fn leave(&self, sh: &mut Shared, id: u64) {
        match sh.pending.remove(id) {
            Some(Entry { answered, waker }) => {
                if answered {
                    // Cancelled after another request delivered its reply: drop the reply.
                    drop(take_answer(&mut sh.answered, id));
                }
                if let Some(w) = waker {
                    sh.spare = Some(w);
                }
            }
            None => return,
        }
        if sh.reader.is_none_or(|r| r == id) && !sh.pending.is_empty() {
            sh.reader = None;
            if let Some(w) = sh
                .pending
                .values_mut()
                .find(|e| !e.answered && e.waker.is_some())
                .and_then(|e| e.waker.take())
            {
                w.wake();
            }
        }
    }

    /// The reply to request `id`: taken from its entry if another request delivered it, else
    /// read from the channel (handing the replies of others to them on the way). A request
    /// that gets its reply leaves here, under the same lock.
    fn poll_reply(&self, id: u64, cx: &mut Context<'_>) -> Poll<Result<Message>> {
        let mut guard = self.shared();
        let sh = &mut *guard;
        let Some(entry) = sh.pending.get_mut(id) else {
            return Poll::Ready(Err(Error::new(
                ErrorKind::Closed,
                "the request is no longer in flight",
            )));
        };
        if entry.answered {
            return self.take_answered(sh, id);
        }
        for _ in 0..READS_PER_POLL {
            let Some(receiver) = sh.rx.as_mut() else {
                // Ended: `fail` has answered every entry, ours too.
                return self.take_answered(sh, id);
            };
            match receiver.poll_next_unpin(cx) {
                // Our own reply, the common case: returned without a detour.
                Poll::Ready(Some(Ok(msg)))
                    if msg.header().correlation == id
                        && msg.header().flags.contains(Flags::RESPONSE) =>
                {
                    self.leave(sh, id);
                    return Poll::Ready(self.reply_result(msg));
                }
                Poll::Ready(Some(Ok(msg))) => {
                    if let Some((got, result)) = self.classify(sh, msg) {
                        self.deliver(sh, got, result);
                    }
                }
                Poll::Ready(end) => {
                    let err = match end {
                        Some(Err(e)) => e,
                        _ => Error::new(
                            ErrorKind::Closed,
                            format!(
                                "{} closed the channel; no more replies will come",
                                self.peer
                            ),
                        ),
                    };
                    sh.rx = None;
                    self.fail(sh, err);
                    return self.take_answered(sh, id);
                }
                Poll::Pending => {
                    // The receiver holds our waker now; the entry holds it too, for whoever
                    // reads next (another request re-registers the receiver with its own)
                    // to deliver our reply, or to hand the reading back to us when it leaves.
                    let entry = sh.pending.get_mut(id).expect("our entry, under the lock");
                    match &entry.waker {
                        Some(w) if w.will_wake(cx.waker()) => {}
                        _ => {
                            entry.waker = match sh.spare.take() {
                                Some(w) if w.will_wake(cx.waker()) => Some(w),
                                _ => Some(cx.waker().clone()),
                            }
                        }
                    }
                    sh.reader = Some(id);
                    return Poll::Pending;
                }
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    fn take_answered(&self, sh: &mut Shared, id: u64) -> Poll<Result<Message>> {
        let reply = take_answer(&mut sh.answered, id);
        if let Some(e) = sh.pending.get_mut(id) {
            e.answered = false; // taken: `leave` has nothing to drop
        }
        self.leave(sh, id);
        match reply {
            Some(reply) => Poll::Ready(reply),
            None => Poll::Ready(Err(Error::new(
                ErrorKind::Closed,
                "the channel ended before the reply came",
            ))),
        }
    }
}

/// The reply handed to request `id`, taken out of `answered`.
fn take_answer(answered: &mut Vec<(u64, Result<Message>)>, id: u64) -> Option<Result<Message>> {
    let at = answered.iter().position(|(got, _)| *got == id)?;
    Some(answered.swap_remove(at).1)
}

#[cold]
fn remote_error(peer: &str, msg: &Message) -> Error {
    let text = msg
        .body()
        .as_bytes()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .unwrap_or_default();
    let kind = msg.meta().get("request-type").unwrap_or("?");
    let remote_kind = msg.meta().get("error-kind").and_then(ErrorKind::from_code);
    // Both are the peer's words: escaped, so that printing the error cannot drive a terminal.
    Error::new(
        ErrorKind::Remote,
        format!(
            "{peer} failed the request of type `{}`: {}",
            crate::text::escape_untrusted(kind),
            crate::text::escape_untrusted(&text)
        ),
    )
    .with_remote_kind(remote_kind)
}

/// A taken slot, with the request's entry in the pending map while it has one; freed on
/// drop.
struct Slot {
    inner: Arc<Inner>,
    /// The request's id while its entry is in the pending map (`None` once it left).
    id: Option<u64>,
}

impl Slot {
    fn poll_reply(&mut self, cx: &mut Context<'_>) -> Poll<Result<Message>> {
        let id = self.id.expect("a waiting slot has an id");
        let out = self.inner.poll_reply(id, cx);
        if out.is_ready() {
            // `poll_reply` took the entry out with its reply.
            self.id = None;
        }
        out
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            // Cancelled while waiting.
            self.inner.leave(&mut self.inner.shared(), id);
        }
        self.inner.release_slot();
    }
}

impl Client {
    /// Wraps `channel`. No task is spawned: the response futures read the replies
    /// themselves, so the reply reaches the caller without a hop through another task.
    pub fn new(channel: Channel) -> Client {
        let peer = channel.info().peer_url().to_owned();
        let (tx, rx) = channel.split();
        let inner = Arc::new(Inner {
            peer,
            shared: Mutex::new(Shared {
                rx: Some(rx),
                pending: Pending::default(),
                answered: Vec::new(),
                failure: None,
                reader: None,
                spare: None,
            }),
            in_flight: AtomicUsize::new(0),
            slot_waker: AtomicWaker::new(),
            slot_wanted: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            discarded: AtomicU64::new(0),
            unsolicited: AtomicU64::new(0),
            log: LogLimit::new(Duration::from_secs(1)),
        });
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
                self.inner.slot_wanted.store(true, Ordering::SeqCst);
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
        // Through the Sender's own `Service` readiness, so that the room found here is the
        // next `call`'s (see the `Sender`'s reservation).
        Service::<Message>::poll_ready(&mut self.tx, cx)
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
        {
            let mut sh = self.inner.shared();
            if let Some(e) = &sh.failure {
                return ResponseFuture::failed(e.duplicate().with_message(msg));
            }
            sh.pending.insert(
                id,
                Entry {
                    answered: false,
                    waker: None,
                },
            );
        }
        slot.id = Some(id);
        if let Err(e) = crate::middleware::sender::send_reserved(&mut self.tx, msg) {
            return ResponseFuture::failed(e);
        }
        ResponseFuture::waiting(slot)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.disarm();
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
