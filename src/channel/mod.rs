//! Channels: `Context` → `Listener` / `Channel` → `Sender` + `Receiver`.
//!
//! See the crate docs, *Channel semantics*, for what every transport guarantees.

mod context;
pub(crate) mod device;
mod listener;

pub use context::{Context, ContextBuilder, ContextStats};
pub use listener::Listener;

use std::any::Any;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context as TaskContext, Poll};

use crossbeam_utils::CachePadded;
use futures_core::Stream;
use futures_sink::Sink;
use futures_util::future::poll_fn;
use futures_util::task::noop_waker_ref;
use std::future::Future;

use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;
use crate::message::Message;
use crate::transport::identity::PeerIdentity;
use crate::transport::{Parts, RecvHalf, SendHalf};

pub use crate::transport::IoEngine;

/// What a channel is connected to.
pub struct ChannelInfo {
    id: u64,
    transport: &'static str,
    local: String,
    peer: String,
    peer_limits: Limits,
    peer_identity: Option<Arc<PeerIdentity>>,
    span: tracing::Span,
    /// What the Sender and the Receiver counted, each on a cache line of its own.
    sent: CachePadded<Tally>,
    received: CachePadded<Tally>,
    /// The paths the device bodies sent took.
    #[cfg(feature = "cuda")]
    device: DeviceTally,
    _open: crate::metrics::Held,
    _keepalive: Option<Arc<dyn Any + Send + Sync>>,
}

/// What one channel carried, as its halves counted it. Read with [`ChannelInfo::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChannelStats {
    /// Messages the [`Sender`] handed to the transport (a `send` that completed, a `feed`, a
    /// `try_send` that returned `Ok`); a cancelled `send` that took its message back is not
    /// counted. Handed over is not yet delivered: see [`ContextStats`] for what a dropped
    /// Sender never wrote, and [sessions](crate::session) for acknowledged delivery.
    pub sent: u64,
    /// Their body bytes.
    pub sent_bytes: u64,
    /// Messages the [`Receiver`] yielded to the application.
    pub received: u64,
    /// Their body bytes.
    pub received_bytes: u64,
}

/// The paths of device bodies; `DeviceTally` keeps the last as its number (0: none yet).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
#[repr(u8)]
enum DevicePath {
    InProcess = 1,
    Staged = 2,
    Lent = 3,
    GpuDirect = 4,
}

/// Names of the paths of device bodies, by their number.
#[cfg(feature = "cuda")]
const DEVICE_PATHS: [&str; 5] = ["", "in-process", "staged", "cuda-ipc", "gpudirect"];

/// Bodies in device memory a [`Sender`] sent, by path. Read with
/// [`ChannelInfo::device_bodies`]; the paths are described at [`ChannelInfo::device_path`].
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceBodies {
    /// Handed over as they are: `"in-process"` (`inproc://`, or a session, which stages them
    /// on its connection).
    pub in_process: u64,
    /// Copied through host buffers: `"staged"`.
    pub staged: u64,
    /// Mapped by the receiver: `"cuda-ipc"`.
    pub lent: u64,
    /// Read by the NIC from device memory: `"gpudirect"`.
    pub gpudirect: u64,
}

/// The last path a device body took (0: none yet) and a count per path, written by the
/// Sender only.
#[cfg(feature = "cuda")]
#[derive(Default)]
struct DeviceTally {
    last: std::sync::atomic::AtomicU8,
    counts: [AtomicU64; 4],
}

#[cfg(feature = "cuda")]
impl DeviceTally {
    /// A body of `len` bytes took `path`; empty ones are not told.
    fn note(&self, path: DevicePath, len: u64) {
        if len == 0 {
            return;
        }
        self.last.store(path as u8, Ordering::Relaxed);
        let c = &self.counts[path as usize - 1];
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// A message count and a byte count written by one half only (a load and a store, no
/// read-modify-write on the hot path), read by anyone.
#[derive(Default)]
struct Tally {
    messages: AtomicU64,
    bytes: AtomicU64,
}

impl Tally {
    /// Only the owning half calls this (`&mut` on it serialises the calls).
    #[inline]
    fn add(&self, messages: u64, bytes: u64) {
        let m = self.messages.load(Ordering::Relaxed).wrapping_add(messages);
        self.messages.store(m, Ordering::Relaxed);
        let b = self.bytes.load(Ordering::Relaxed).wrapping_add(bytes);
        self.bytes.store(b, Ordering::Relaxed);
    }

    /// Takes back a message counted by [`add`](Self::add) (a send that took it back).
    fn undo(&self, bytes: u64) {
        self.add(1u64.wrapping_neg(), bytes.wrapping_neg());
    }

    fn read(&self) -> (u64, u64) {
        (
            self.messages.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

impl ChannelInfo {
    /// The transport: `"tcp"`, `"tls"`, `"shm"`, `"inproc"`, `"rdma"` (also for `rdma+sim://`).
    pub fn transport(&self) -> &'static str {
        self.transport
    }

    /// How the last body in device memory sent on this channel travelled: `"in-process"`
    /// (`inproc://`: the receiver gets the sender's device memory itself), `"cuda-ipc"`
    /// (`shm://` to a receiver that lands bodies on a device: it maps the sender's memory,
    /// which stays allocated until the receiver drops the body), `"gpudirect"` (`rdma://`:
    /// the NIC reads the body from device memory, registered as a dma-buf, into the
    /// receiver's device memory where it lands there, into host memory otherwise), or `"staged"` (copied to
    /// host buffers in chunks, each chunk sent while the next is copied). Before the first,
    /// the usual path of the transport: `"in-process"` on `inproc://`, `"staged"` elsewhere.
    /// See [`crate::device`].
    #[cfg(feature = "cuda")]
    pub fn device_path(&self) -> &'static str {
        let last = match self.device.last.load(Ordering::Relaxed) {
            0 if self.transport == "inproc" => DevicePath::InProcess as u8,
            0 => DevicePath::Staged as u8,
            p => p,
        };
        DEVICE_PATHS[usize::from(last)]
    }

    /// How many bodies in device memory the [`Sender`] sent by each path (bodies of 0 bytes
    /// are not counted): a path that is slower than the one expected shows here, not only
    /// in a log line.
    #[cfg(feature = "cuda")]
    pub fn device_bodies(&self) -> DeviceBodies {
        let n = |p: DevicePath| self.device.counts[p as usize - 1].load(Ordering::Relaxed);
        DeviceBodies {
            in_process: n(DevicePath::InProcess),
            staged: n(DevicePath::Staged),
            lent: n(DevicePath::Lent),
            gpudirect: n(DevicePath::GpuDirect),
        }
    }

    /// This end's address, as a URL.
    pub fn local_url(&self) -> &str {
        &self.local
    }

    /// The peer's address, as a URL.
    pub fn peer_url(&self) -> &str {
        &self.peer
    }

    /// What the peer accepts (from its handshake); `send` refuses what exceeds it.
    pub fn peer_limits(&self) -> &Limits {
        &self.peer_limits
    }

    /// Who the peer proved to be with its certificate, on `tls://` (a client always learns
    /// the server's; a server the client's under mutual TLS); `None` elsewhere.
    pub fn peer_identity(&self) -> Option<&PeerIdentity> {
        self.peer_identity.as_deref()
    }

    pub(crate) fn peer_identity_arc(&self) -> Option<Arc<PeerIdentity>> {
        self.peer_identity.clone()
    }

    /// The channel's `tracing` span, `hf.channel` at level INFO, with the fields of
    /// OpenTelemetry's messaging and network conventions: `messaging.system`
    /// (`"hyperframes"`), `network.transport` (`tcp`, `unix` for shm, `inproc`, `rdma`),
    /// `network.local.address` and `network.peer.address` (the two URLs) and `hf.channel.id`
    /// (the number in `Debug`). `middleware::serve` (feature `tower`) runs each channel's
    /// handler in it; a task of your own that owns a channel can do the same with
    /// `tracing::Instrument`:
    ///
    /// ```no_run
    /// # async fn f(ch: hyperframes::Channel) {
    /// use tracing::Instrument;
    /// let span = ch.info().span().clone();
    /// tokio::spawn(async move { /* … use ch … */ drop(ch) }.instrument(span));
    /// # }
    /// ```
    ///
    /// Disabled (free) where no subscriber takes INFO spans of target `hyperframes`.
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// Messages and body bytes sent and received on this channel so far. Counting costs
    /// each half a load and a store per message on a cache line it owns.
    pub fn stats(&self) -> ChannelStats {
        let (sent, sent_bytes) = self.sent.read();
        let (received, received_bytes) = self.received.read();
        ChannelStats {
            sent,
            sent_bytes,
            received,
            received_bytes,
        }
    }
}

/// The channel's span; see [`ChannelInfo::span`].
fn channel_span(id: u64, transport: &'static str, local: &str, peer: &str) -> tracing::Span {
    let network = match transport {
        "tcp" | "tls" => "tcp",
        "shm" => "unix",
        other => other,
    };
    tracing::info_span!(
        target: "hyperframes",
        "hf.channel",
        messaging.system = "hyperframes",
        network.transport = network,
        network.protocol.name = transport,
        network.local.address = local,
        network.peer.address = peer,
        hf.channel.id = id,
    )
}

/// A channel's totals reach the `metrics` recorder when it ends (both halves gone): counting
/// every message through the facade would cost a recorder call each.
impl Drop for ChannelInfo {
    fn drop(&mut self) {
        let s = self.stats();
        let transport = self.transport;
        crate::metrics::count!("hyperframes_messages_sent_total", s.sent, "transport" => transport);
        crate::metrics::count!("hyperframes_message_bytes_sent_total", s.sent_bytes, "transport" => transport);
        crate::metrics::count!("hyperframes_messages_received_total", s.received, "transport" => transport);
        crate::metrics::count!("hyperframes_message_bytes_received_total", s.received_bytes, "transport" => transport);
    }
}

impl fmt::Debug for ChannelInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelInfo")
            .field("id", &self.id)
            .field("transport", &self.transport)
            .field("local", &self.local)
            .field("peer", &self.peer)
            .field("peer_identity", &self.peer_identity)
            .finish()
    }
}

static NEXT_CHANNEL_ID: AtomicU64 = AtomicU64::new(1);

/// A full-duplex channel: a `Sink<Message>` and a `Stream<Item = Result<Message>>`.
///
/// [`split`](Channel::split) it to send and receive from different tasks; the halves share no
/// lock. See [the crate docs](crate#channel-semantics) for ordering, backpressure, close
/// and failure.
pub struct Channel {
    tx: Sender,
    rx: Receiver,
}

/// The sending half of a [`Channel`]. A `Sink<Message>`; dropping it closes the direction.
pub struct Sender {
    half: Box<dyn SendHalf>,
    info: Arc<ChannelInfo>,
    /// Room found by the `tower::Service` readiness and not used since: the next
    /// `Service::call` hands its message over without asking the transport again.
    pub(crate) reserved: bool,
    #[cfg(feature = "cuda")]
    stage: device::Stage,
}

/// The receiving half of a [`Channel`]. A `Stream<Item = Result<Message>>` that ends after
/// the peer closed, or after yielding the error that ended the connection.
pub struct Receiver {
    half: Box<dyn RecvHalf>,
    info: Arc<ChannelInfo>,
    asm: device::Assembler,
    /// Receives since the last one that spent tokio's budget.
    unbudgeted: u8,
}

/// Halves of two different channels given to [`Sender::reunite`]; both are handed back.
pub struct ReuniteError(pub Sender, pub Receiver);

impl fmt::Debug for ReuniteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReuniteError(..)")
    }
}

impl fmt::Display for ReuniteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tried to reunite halves of different channels")
    }
}

impl std::error::Error for ReuniteError {}

impl From<ReuniteError> for Error {
    fn from(_: ReuniteError) -> Error {
        Error::new(
            ErrorKind::Mismatch,
            "tried to reunite halves of different channels",
        )
    }
}

impl Channel {
    pub(crate) fn from_parts(parts: Parts) -> Channel {
        let id = NEXT_CHANNEL_ID.fetch_add(1, Ordering::Relaxed);
        let span = channel_span(id, parts.transport, &parts.local, &parts.peer);
        let info = Arc::new(ChannelInfo {
            id,
            transport: parts.transport,
            local: parts.local,
            peer: parts.peer,
            peer_limits: parts.peer_limits,
            peer_identity: parts.peer_identity,
            span,
            sent: CachePadded::default(),
            received: CachePadded::default(),
            #[cfg(feature = "cuda")]
            device: DeviceTally::default(),
            _open: crate::metrics::Held::channel(parts.transport),
            _keepalive: parts.keepalive,
        });
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut rx = parts.rx;
        #[cfg(feature = "cuda")]
        rx.land_on(parts.setup.landing.as_ref());
        Channel {
            tx: Sender {
                half: parts.tx,
                info: info.clone(),
                reserved: false,
                #[cfg(feature = "cuda")]
                stage: device::Stage::new(&parts.setup),
            },
            rx: Receiver {
                half: rx,
                info,
                asm: device::Assembler::new(&parts.setup),
                unbudgeted: 0,
            },
        }
    }

    /// Splits into a sending and a receiving half, each `Send + 'static`, free of cost (the
    /// channel is already two halves).
    pub fn split(self) -> (Sender, Receiver) {
        (self.tx, self.rx)
    }

    /// Both halves, borrowed: to send and receive from one task (for example in `select!`).
    pub fn halves_mut(&mut self) -> (&mut Sender, &mut Receiver) {
        (&mut self.tx, &mut self.rx)
    }

    /// What the channel is connected to.
    pub fn info(&self) -> &ChannelInfo {
        &self.tx.info
    }

    /// See [`Sender::send`].
    // The Sender's future itself, not one around it: an `async fn` here would move the
    // message (and the result) once more per call.
    pub fn send(&mut self, msg: Message) -> impl Future<Output = Result<()>> + Send + '_ {
        self.tx.send(msg)
    }

    /// See [`Sender::alloc`].
    pub async fn alloc(&mut self, len: usize) -> Result<crate::message::BodyMut> {
        self.tx.alloc(len).await
    }

    /// See [`Sender::flush`].
    pub async fn flush(&mut self) -> Result<()> {
        self.tx.flush().await
    }

    /// See [`Sender::close`]. Half-closes: receiving goes on.
    pub async fn close(&mut self) -> Result<()> {
        self.tx.close().await
    }

    /// See [`Receiver::recv`].
    pub fn recv(&mut self) -> impl Future<Output = Option<Result<Message>>> + Send + '_ {
        self.rx.recv()
    }
}

impl Sender {
    pub(crate) fn poll_ready_inner(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        #[cfg(feature = "cuda")]
        std::task::ready!(self.stage.poll_drive(&mut *self.half, cx))?;
        self.half.poll_ready(cx)
    }

    fn start_send_inner(&mut self, msg: Message) -> Result<()> {
        // Whichever way it came, this message takes the room a reservation saw.
        self.reserved = false;
        if msg
            .header()
            .flags
            .intersects(crate::message::Flags::CHANNEL)
        {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "message of type {} not sent: its header sets flags the channel reserves \
                     for itself ({:?})",
                    msg.kind(),
                    msg.header().flags
                ),
            )
            .with_message(msg));
        }
        if let Err(e) = self.info.peer_limits.check(&msg) {
            return Err(Error::new(
                ErrorKind::LimitExceeded,
                format!(
                    "message of type {} not sent to {}: {e:#}",
                    msg.kind(),
                    self.info.peer
                ),
            )
            .with_message(msg));
        }
        let bytes = msg.body().len() as u64;
        #[cfg(feature = "cuda")]
        let mut path = None;
        #[cfg(feature = "cuda")]
        if let Some(device) = msg.body().as_device() {
            if !self.stage.wants(&msg) {
                path = Some(DevicePath::InProcess);
            } else if let Some(way) = self.half.takes_device(device) {
                // The half takes it as it is.
                path = Some(match way {
                    crate::transport::DeviceWay::CudaIpc => DevicePath::Lent,
                    crate::transport::DeviceWay::GpuDirect => DevicePath::GpuDirect,
                });
            } else {
                self.stage.start(&mut *self.half, msg, &self.info.peer)?;
                self.info.device.note(DevicePath::Staged, bytes);
                self.info.sent.add(1, bytes);
                return Ok(());
            }
        }
        self.half.start_send(msg)?;
        #[cfg(feature = "cuda")]
        if let Some(p) = path {
            self.info.device.note(p, bytes);
        }
        self.info.sent.add(1, bytes);
        Ok(())
    }

    /// Hands over the rest of a device body in progress, then what the transport staged.
    #[cfg(feature = "cuda")]
    fn poll_submit_inner(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        #[cfg(feature = "cuda")]
        std::task::ready!(self.stage.poll_drive(&mut *self.half, cx))?;
        self.half.poll_submit(cx)
    }

    fn poll_flush_inner(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        #[cfg(feature = "cuda")]
        std::task::ready!(self.stage.poll_drive(&mut *self.half, cx))?;
        self.half.poll_flush(cx)
    }

    fn poll_close_inner(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        // A closed direction has no room for anyone.
        self.reserved = false;
        #[cfg(feature = "cuda")]
        std::task::ready!(self.stage.poll_drive(&mut *self.half, cx))?;
        self.half.poll_close(cx)
    }

    /// Waits for room, then hands `msg` to the transport. It does not wait for the write to
    /// the kernel: the transport writes on its own, batching what has accumulated; use
    /// [`flush`](Self::flush) to wait for that. (`SinkExt::send`, by contrast, flushes after
    /// each message, which costs a wait for the write per message.)
    ///
    /// Errors: [`ErrorKind::LimitExceeded`] when the message exceeds the peer's limits (the
    /// message is in [`Error::take_message`] and the channel stays usable);
    /// [`ErrorKind::ConnectionLost`] / [`ErrorKind::Closed`] when the channel is gone.
    ///
    /// # Cancel safety
    /// If the future is dropped before it completes, the message was not handed over and is
    /// dropped with the future; nothing of it was sent. To wait for room in a `select!`
    /// without giving up a message, use [`ready`](Self::ready) (cancel safe) and then
    /// [`try_send`](Self::try_send). One exception: a body in device memory that the channel
    /// stages (feature `cuda`) is sent in pieces once announced; a cancelled `send` leaves the
    /// rest to the next call on this `Sender` (`send`, `ready`, `flush`, `close`), which
    /// finishes it first.
    pub async fn send(&mut self, msg: Message) -> Result<()> {
        poll_fn(|cx| self.poll_ready_inner(cx)).await?;
        self.start_send_inner(msg)?;
        #[cfg(feature = "cuda")]
        if self.stage.busy() {
            return poll_fn(|cx| self.poll_submit_inner(cx)).await;
        }
        // Accepted; if this future is dropped before the transport has taken the message (a
        // shared-memory arena without room yet), take it back: a cancelled send sent nothing.
        let mut submit = Unstage {
            half: &mut *self.half,
            sent: &self.info.sent,
            armed: true,
        };
        let r = poll_fn(|cx| submit.half.poll_submit(cx)).await;
        submit.armed = false;
        r
    }

    /// Memory for a body of `len` bytes, to fill in place and send without a copy: a block of
    /// the shared-memory arena on `shm://` (waiting for room, which is backpressure), heap
    /// memory on other transports. Fails with [`ErrorKind::LimitExceeded`] when `len` exceeds
    /// what the peer accepts.
    ///
    /// ```no_run
    /// # async fn f(tx: &mut hyperframes::Sender) -> hyperframes::Result<()> {
    /// let mut body = tx.alloc(4 << 20).await?;
    /// body.fill(7); // produce the data where the receiver will read it
    /// tx.send(hyperframes::Message::new("frame")?.with_body(body.freeze())).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Cancel safe: memory not yet handed out is not taken.
    pub async fn alloc(&mut self, len: usize) -> Result<crate::message::BodyMut> {
        let max = self.info.peer_limits.max_body;
        if len as u64 > max {
            return Err(Error::new(
                ErrorKind::LimitExceeded,
                format!(
                    "a body of {len} bytes exceeds the max_body of {max} that {} accepts",
                    self.info.peer
                ),
            ));
        }
        poll_fn(|cx| self.half.poll_alloc(cx, len)).await
    }

    /// Waits until a message can be handed over without waiting.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn ready(&mut self) -> Result<()> {
        poll_fn(|cx| self.poll_ready_inner(cx)).await
    }

    /// Hands `msg` over if there is room now; otherwise fails with [`ErrorKind::Full`] and the
    /// message in [`Error::take_message`]. For producers that would rather drop (and count)
    /// than wait. A body in device memory that the channel stages is announced here and its
    /// pieces follow at the next calls on this `Sender` (while they do, `try_send` is
    /// [`ErrorKind::Full`]).
    pub fn try_send(&mut self, msg: Message) -> Result<()> {
        let mut cx = TaskContext::from_waker(noop_waker_ref());
        match self.poll_ready_inner(&mut cx) {
            Poll::Ready(Ok(())) => self.send_now(msg),
            Poll::Ready(Err(e)) => Err(e.with_message(msg)),
            Poll::Pending => Err(Error::new(
                ErrorKind::Full,
                format!("the send queue to {} is full", self.info.peer),
            )
            .with_message(msg)),
        }
    }

    /// [`try_send`](Self::try_send) once the half has said it has room.
    pub(crate) fn send_now(&mut self, msg: Message) -> Result<()> {
        let mut cx = TaskContext::from_waker(noop_waker_ref());
        self.start_send_inner(msg)?;
        match self.half.poll_submit(&mut cx) {
            Poll::Ready(r) => r,
            // Accepted but not handed over (a shared-memory arena without room): take it
            // back rather than leave it waiting for a later call.
            Poll::Pending => match self.half.unstage() {
                Some(m) => {
                    self.info.sent.undo(m.body().len() as u64);
                    Err(Error::new(
                        ErrorKind::Full,
                        format!("no room for the message to {} now", self.info.peer),
                    )
                    .with_message(m))
                }
                None => Ok(()),
            },
        }
    }

    /// Waits until every message sent so far has reached the kernel's socket buffer (tcp) or
    /// the peer's queue (inproc).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is lost by dropping it, and a later call waits for the same.
    pub async fn flush(&mut self) -> Result<()> {
        poll_fn(|cx| self.poll_flush_inner(cx)).await
    }

    /// Flushes, then finishes this direction: the peer's `Receiver` ends after the messages
    /// sent before. Receiving on the other half goes on. Dropping the `Sender` closes too,
    /// without waiting.
    ///
    /// # Cancel safety
    /// Cancel safe: the close has begun and completes in the background.
    pub async fn close(&mut self) -> Result<()> {
        poll_fn(|cx| self.poll_close_inner(cx)).await
    }

    /// What the channel is connected to.
    pub fn info(&self) -> &ChannelInfo {
        &self.info
    }

    /// On a [session](crate::session) channel, takes the messages the peer never
    /// acknowledged, in the order they were sent, once they will not be sent again: after
    /// the session failed (the connection was lost and not resumed) or the peer dropped its
    /// receiver. The peer may have received some of them (an acknowledgement can be lost with
    /// the connection): what it did not receive is among them, so nothing is lost unknowingly.
    /// Empty while the session lives; `None` on other channels, which do not know what the
    /// peer received.
    pub fn take_unacknowledged(&mut self) -> Option<Vec<Message>> {
        self.half.take_unacknowledged()
    }

    /// Puts the halves of one channel back together.
    #[allow(clippy::result_large_err)]
    pub fn reunite(self, rx: Receiver) -> std::result::Result<Channel, ReuniteError> {
        if Arc::ptr_eq(&self.info, &rx.info) {
            Ok(Channel { tx: self, rx })
        } else {
            Err(ReuniteError(self, rx))
        }
    }
}

/// A device body cut off by the drop is reported: its receiver sees the connection end in
/// the middle of the body, as an error.
#[cfg(feature = "cuda")]
impl Drop for Sender {
    fn drop(&mut self) {
        if let Some((sent, len)) = self.stage.pending_bytes() {
            tracing::warn!(
                peer = %self.info.peer, sent, len,
                "a Sender was dropped in the middle of a body sent from device memory: the rest \
                 is not sent, and the receiver gets an error"
            );
        }
    }
}

/// Receives per unit of tokio's budget. tokio's channels spend one per receive; a forced yield
/// costs the current-thread scheduler an `epoll_wait` (it polls its driver before running the
/// task again), which at one every 128 receives cost 10-15 % of the 64 B tcp message rate
/// (`hf bench --pin 0,1`: 5.0-5.5 M/s against 5.9-6.1 without a budget, 5.5-5.8 with one unit
/// per 4 receives).
const COOP_EVERY: u8 = 4;

/// A receiving half that has ended (after a violation the channel layer found).
struct Ended;

impl RecvHalf for Ended {
    fn poll_recv(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Option<Result<Message>>> {
        Poll::Ready(None)
    }
}

/// Takes back, on drop, a message a transport accepted but has not taken yet (and its
/// count).
struct Unstage<'a> {
    half: &'a mut dyn SendHalf,
    sent: &'a Tally,
    armed: bool,
}

impl Drop for Unstage<'_> {
    fn drop(&mut self) {
        if self.armed
            && let Some(m) = self.half.unstage()
        {
            self.sent.undo(m.body().len() as u64);
        }
    }
}

impl Receiver {
    /// The next message; `None` once the peer closed its sending direction (after every
    /// message it sent before), or after the error that ended the connection was returned.
    ///
    /// # Cancel safety
    /// Cancel safe: a message is taken from the queue only when the future completes.
    pub fn recv(&mut self) -> impl Future<Output = Option<Result<Message>>> + Send + '_ {
        // The poll function as it is: an `async fn` around it moved each message once more.
        poll_fn(move |cx| self.poll_recv_inner(cx))
    }

    /// Spends the task's tokio budget, a unit every [`COOP_EVERY`] receives: a loop that
    /// always finds a message waiting still yields now and then (every 512 receives), so that
    /// the tasks it shares its runtime with run, among them the connection's own (its writes,
    /// its heartbeats) and a session's driver. Without it a consumer busy with a full queue on
    /// a current-thread runtime kept them off the CPU until the peer declared it silent.
    #[inline]
    fn poll_recv_inner(&mut self, cx: &mut TaskContext<'_>) -> Poll<Option<Result<Message>>> {
        // The unit is taken before polling (an exhausted budget yields here) and given back
        // when nothing came (dropped without `made_progress`), so only receives count.
        let coop = if self.unbudgeted >= COOP_EVERY - 1 {
            Some(std::task::ready!(tokio::task::coop::poll_proceed(cx)))
        } else {
            None
        };
        let got = match self.half.poll_recv(cx) {
            Poll::Ready(Some(Ok(m))) if self.asm.passes(&m) => Poll::Ready(Some(Ok(m))),
            Poll::Pending => return Poll::Pending,
            other => self.assemble(other, cx),
        };
        if got.is_ready() {
            match coop {
                Some(coop) => {
                    coop.made_progress();
                    self.unbudgeted = 0;
                }
                None => self.unbudgeted += 1,
            }
        }
        if let Poll::Ready(Some(Ok(m))) = &got {
            self.info.received.add(1, m.body().len() as u64);
        }
        got
    }

    /// Everything but an ordinary message: pieces of a body sent from device memory, the
    /// end of the stream, errors.
    #[cold]
    fn assemble(
        &mut self,
        mut next: Poll<Option<Result<Message>>>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Message>>> {
        loop {
            let m = match next {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(m))) => m,
                Poll::Ready(Some(Err(e))) => {
                    return Poll::Ready(Some(Err(self.asm.end().unwrap_or(e))));
                }
                Poll::Ready(None) => return Poll::Ready(self.asm.end().map(Err)),
            };
            if self.asm.passes(&m) {
                return Poll::Ready(Some(Ok(m)));
            }
            match self.asm.take(m) {
                Ok(Some(m)) => return Poll::Ready(Some(Ok(m))),
                Ok(None) => {}
                // The stream position is lost: this error ends the stream.
                Err(e) => {
                    self.half = Box::new(Ended);
                    return Poll::Ready(Some(Err(e)));
                }
            }
            next = self.half.poll_recv(cx);
        }
    }

    /// Where bodies sent from device memory land on this channel: in memory of `gpu`, or
    /// (`None`) in host memory. The default is the context's
    /// [`ContextBuilder::land_on`](crate::ContextBuilder::land_on). Bodies that already
    /// live in device memory on arrival (`inproc://` hands over the sender's) stay where they
    /// are.
    #[cfg(feature = "cuda")]
    pub fn land_on(&mut self, gpu: Option<crate::device::Gpu>) {
        self.half.land_on(gpu.as_ref());
        self.asm.landing = gpu;
    }

    /// What the channel is connected to.
    pub fn info(&self) -> &ChannelInfo {
        &self.info
    }

    /// Puts the halves of one channel back together.
    #[allow(clippy::result_large_err)]
    pub fn reunite(self, tx: Sender) -> std::result::Result<Channel, ReuniteError> {
        tx.reunite(self)
    }
}

/// `start_send` stages up to 64 messages (or 256 KiB of bodies) in the `Sender` and hands
/// them to the transport in one step, when the stage is full or at `poll_flush`; so
/// `SinkExt::feed` / `send_all` move small messages at the highest rate. [`Sender::send`]
/// hands each message over at once.
impl Sink<Message> for Sender {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_ready_inner(cx)
    }

    fn start_send(self: Pin<&mut Self>, msg: Message) -> Result<()> {
        self.get_mut().start_send_inner(msg)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_flush_inner(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_close_inner(cx)
    }
}

impl Stream for Receiver {
    type Item = Result<Message>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Result<Message>>> {
        self.get_mut().poll_recv_inner(cx)
    }
}

impl Sink<Message> for Channel {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        Pin::new(&mut self.get_mut().tx).poll_ready(cx)
    }

    fn start_send(self: Pin<&mut Self>, msg: Message) -> Result<()> {
        Pin::new(&mut self.get_mut().tx).start_send(msg)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        Pin::new(&mut self.get_mut().tx).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        Pin::new(&mut self.get_mut().tx).poll_close(cx)
    }
}

impl Stream for Channel {
    type Item = Result<Message>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Result<Message>>> {
        Pin::new(&mut self.get_mut().rx).poll_next(cx)
    }
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Channel").field(&*self.tx.info).finish()
    }
}

impl fmt::Debug for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Sender").field(&*self.info).finish()
    }
}

impl fmt::Debug for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Receiver").field(&*self.info).finish()
    }
}
