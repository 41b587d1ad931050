//! A TCP connection run in the tasks that use it (`IoEngine::Inline`): no I/O thread, no
//! hand-off between tasks on the data path.
//!
//! ```text
//!  Sender task   encode into the write buffer ── writev ──▶ socket   (now, or in a batch)
//!  Receiver task ◀── decode ◀── read ──────────────────────── socket   (in its own poll)
//!  flusher task  what a sender left: a partial batch, a full socket, CLOSE / STOP / ERROR;
//!                after the receiver: the rest of the stream (STOP, ERROR, EOF); lingering
//! ```
//!
//! **Writes.** `send` encodes the frame into the shared write buffer ([`Batch`]: small
//! bodies next to their header, large ones as the caller's own `Bytes`) and then decides when
//! to write it. The first message sent after the sender's task has yielded (waited for
//! anything: a reply, a timer, the next request) goes out at once, from the sender's task
//! (one `writev`: a request or a reply waits for nothing); messages sent back to back,
//! without a yield in between, accumulate and go out when [`BATCH_MESSAGES`] or
//! [`BATCH_BYTES`] are pending, from the sender's task too, or when the task yields, from the
//! flusher (one `writev` for all of them). What marks the yield is the flusher running
//! (which it does only when the sender's task lets the runtime run it) or the Receiver
//! finding the socket empty (the request/response case, with no flusher run at all). So a
//! stream of small messages costs a system call per batch, and a ping-pong one per message,
//! with no thread between the application and the socket. A full socket is backpressure: `poll_ready` waits (the flusher waits for the
//! socket to take more and wakes it) once [`Config::send_queue`] messages or
//! [`Config::send_queue_bytes`] bytes are pending.
//!
//! **Reads.** The receiver reads into a 256 KiB buffer and decodes frames out of it without
//! copying (large bodies are read straight into a buffer of their own); it reads only when
//! polled, so a receiver that does not read backpressures the peer through TCP's window.
//! A receiver waiting for an answer (its connection wrote since its last wait) first asks
//! the socket again for up to 20 µs before it parks on epoll, so that in a request/response
//! exchange the answer is taken as it lands instead of after a sleep and a wake-up on each
//! side; the spin adapts, and stops on connections whose answers take longer (see [`Spin`]).
//! With `busy_poll` it never parks: it retries the read (a non-blocking `recv`) instead of
//! waiting on epoll, which saves the sleep and the wake-up of a parked thread per message.
//!
//! **Ending.** As in the I/O-thread engine (`conn`): the sender's close (or drop) writes
//! `CLOSE` after what it sent; a receiver dropped before the end owes the peer a `STOP`; a
//! protocol error is reported to the peer with `ERROR`; once both halves are gone the
//! flusher reads what the peer still sends until its EOF (at most `linger`), so that closing
//! never resets a connection whose last bytes the peer has not read.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::future::poll_fn;
use futures_util::task::AtomicWaker;
use socket2::SockRef;
use tokio::net::TcpStream;

use super::conn::FrameClock;
use super::tls::Session;
use crate::error::{Error, ErrorKind, Result};
use crate::message::Message;
use crate::transport::heartbeat::{Liveness, Silence, Tick};
use crate::transport::{Config, RecvHalf, SPIN, SendHalf};
use crate::wire::{Batch, Control, Decoder, Frame};

/// Pending messages written from the sender's own task without waiting for it to yield.
const BATCH_MESSAGES: usize = 1024;
/// ... or pending bytes.
const BATCH_BYTES: usize = 256 << 10;
/// Buffers per `writev` (Linux `IOV_MAX` is 1024).
const IOV_MAX: usize = 512;
/// Bytes read at a time into the shared receive buffer.
const READ_CHUNK: usize = 256 << 10;
/// Non-blocking reads a busy-polling receiver makes before it lets its task yield.
const SPIN_READS: u32 = 64;
/// How long a best-effort `ERROR` frame may take to go out.
const ERROR_WRITE: Duration = Duration::from_secs(1);

/// What the halves and the flusher share.
pub(super) struct Shared {
    stream: TcpStream,
    /// `tls://`: the session records are sealed and opened with.
    tls: Option<Arc<Session>>,
    w: Mutex<Writer>,
    /// The failure that ended the connection; the Sender reports it.
    error: OnceLock<Error>,
    /// The same failure for the Receiver, set only if the peer had not closed its direction
    /// cleanly before: a stream that ended cleanly stays clean.
    recv_error: OnceLock<Error>,
    /// The peer sent `STOP`: it no longer reads.
    peer_stopped: AtomicBool,
    /// The peer's direction has ended (its `CLOSE` was read); set by whoever reads.
    peer_closed: AtomicBool,
    /// Bytes written and messages taken out of the write buffer: the Sender's view of room
    /// without taking the lock (it knows what it appended).
    written: AtomicU64,
    taken: AtomicU64,
    /// The task sending has yielded since the last write (the flusher ran, or the Receiver
    /// parked), or nothing was written yet: the next message goes out at once.
    yielded: AtomicBool,
    /// Wakes the flusher: work was left for it.
    flusher: AtomicWaker,
    work: AtomicBool,
    /// Wakes the Sender: the flusher made progress, or the connection failed or was stopped.
    tx: AtomicWaker,
    sender_gone: AtomicBool,
    /// Messages the Sender accepted, stored when it goes.
    sender_accepted: AtomicU64,
    /// The Sender and the flusher that have ended: the second counts what was not written.
    ended: AtomicU8,
    /// The read side: used by the Receiver, and by the flusher while the Receiver is not
    /// waiting for data (or is gone).
    r: Mutex<ReadState>,
    /// The Receiver is parked waiting for data (registered with the socket, and here for
    /// what the flusher reads ahead).
    rx_parked: AtomicBool,
    rx: AtomicWaker,
    /// The Receiver is gone: what arrives is read and discarded by the flusher.
    receiver_gone: AtomicBool,
    busy_poll: bool,
    cfg: Config,
    peer: String,
}

/// The write side, shared by the Sender (which appends and writes), the flusher (which
/// writes what is left) and whoever ends the connection (control frames).
struct Writer {
    batch: Batch,
    /// Buffers taken out of the batch and not fully written yet, in order.
    out: Vec<Bytes>,
    /// Bytes appended and written: flush and backpressure compare them.
    appended: u64,
    written: u64,
    /// Where each frame appended and not completely written yet ends in the stream (oldest
    /// first; `true` for a message), the end of the last frame completely written, and how
    /// many messages were: what a connection that ends early did not send, and where the
    /// stream can take an `ERROR` frame.
    ends: VecDeque<(u64, bool)>,
    boundary: u64,
    msgs_written: u64,
    /// `tls://`: bytes sealed into records that wait in the session for the socket (they
    /// count as written once it took them).
    sealed: u64,
    stop_owed: bool,
    /// `CLOSE` is appended (the Sender closed or went).
    closing: bool,
    /// `CLOSE` is written.
    close_written: bool,
    /// A reason to tell the peer in an `ERROR` frame before closing.
    error_reason: Option<String>,
}

/// The result of writing what is pending.
enum Wrote {
    /// Everything appended is written.
    All,
    /// The socket took only part: wait until it is writable again.
    Blocked,
}

impl Writer {
    fn pending(&self) -> u64 {
        self.appended - self.written
    }

    /// Appends `msg`'s frame.
    #[inline]
    fn push(&mut self, msg: Message) {
        let before = self.batch.bytes();
        self.batch.push_message(msg);
        self.appended += (self.batch.bytes() - before) as u64;
        self.ends.push_back((self.appended, true));
    }

    /// Counts the messages whose last byte is now written.
    fn settle(&mut self) {
        let done = self.ends.partition_point(|&(end, _)| end <= self.written);
        for (end, message) in self.ends.drain(..done) {
            self.msgs_written += u64::from(message);
            self.boundary = end;
        }
    }

    fn push_control(&mut self, c: &Control) {
        let before = self.batch.bytes();
        self.batch.push_control(c);
        self.appended += (self.batch.bytes() - before) as u64;
        self.ends.push_back((self.appended, false));
    }

    /// Gives up what is pending but the rest of a frame the socket has taken in part (an
    /// `ERROR` frame written after a partial frame would be read by the peer as the rest of
    /// it: a message with a corrupted body), then appends `c`.
    fn abandon_for(&mut self, c: &Control) {
        // On `tls://` what is sealed is as good as written: the session sends it first.
        let at = self.written + self.sealed;
        let mut start = self.boundary;
        let mut rest = 0;
        for &(end, _) in &self.ends {
            if end > at {
                if at > start {
                    rest = end - at;
                }
                break;
            }
            start = end;
        }
        self.batch.take_into(&mut self.out);
        crate::wire::truncate(&mut self.out, rest as usize);
        self.appended = at + rest;
        self.ends.retain(|&(end, _)| end <= self.appended);
        self.push_control(c);
    }

    /// Writes what is pending without blocking (on `tls://`, sealed into records first).
    fn write(&mut self, sh: &Shared) -> io::Result<Wrote> {
        let stream = &sh.stream;
        let msgs = self.batch.messages() as u64;
        if msgs > 0 {
            sh.taken.fetch_add(msgs, Ordering::Release);
        }
        self.batch.take_into(&mut self.out);
        loop {
            if let Some(tls) = &sh.tls {
                // Records sealed before go first; their bytes count as written once the
                // kernel has them.
                if !tls.write_to(stream)? {
                    return Ok(Wrote::Blocked);
                }
                if self.sealed > 0 {
                    self.written += std::mem::take(&mut self.sealed);
                    sh.written.store(self.written, Ordering::Release);
                    self.settle();
                }
            }
            if self.out.is_empty() {
                break;
            }
            let mut iov = [IoSlice::new(&[]); 64];
            let n = self.out.len().min(iov.len());
            for (slot, b) in iov.iter_mut().zip(&self.out[..n]) {
                *slot = IoSlice::new(b);
            }
            let many: Vec<IoSlice<'_>>;
            let iov = if self.out.len() > iov.len() {
                many = self.out[..self.out.len().min(IOV_MAX)]
                    .iter()
                    .map(|b| IoSlice::new(b))
                    .collect();
                &many[..]
            } else {
                &iov[..n]
            };
            let res = match &sh.tls {
                None => stream.try_write_vectored(iov),
                Some(tls) => tls.seal(iov),
            };
            match res {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    crate::wire::advance(&mut self.out, n);
                    if sh.tls.is_some() {
                        self.sealed += n as u64;
                    } else {
                        self.written += n as u64;
                        sh.written.store(self.written, Ordering::Release);
                        self.settle();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Wrote::Blocked),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.closing {
            self.close_written = true;
        }
        Ok(Wrote::All)
    }
}

fn write_error(e: io::Error) -> Error {
    if matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
    ) {
        Error::new(ErrorKind::ConnectionLost, "the peer closed the connection").with_source(e)
    } else {
        Error::io("writing to the peer", e)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Writer> {
        self.w.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read_state(&self) -> MutexGuard<'_, ReadState> {
        self.r.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failed(&self) -> bool {
        self.error.get().is_some()
    }

    fn error(&self) -> Option<Error> {
        self.error.get().map(Error::duplicate)
    }

    /// Leaves work for the flusher.
    fn kick(&self) {
        // A flusher with work left already is woken or running: no second wake-up.
        if !self.work.swap(true, Ordering::AcqRel) {
            self.flusher.wake();
        }
    }

    /// Ends the connection with `err` (the first failure wins) and wakes everyone. With
    /// `tell_peer`, the flusher first sends the peer an `ERROR` frame (best effort).
    fn fail(&self, err: Error, tell_peer: bool) {
        if !self.peer_closed.load(Ordering::Acquire) {
            let _ = self.recv_error.set(err.duplicate());
        }
        let reason = tell_peer.then(|| err.to_string());
        if self.error.set(err).is_err() {
            return;
        }
        match reason {
            Some(r) => self.lock().error_reason = Some(r),
            // Nothing to say: shut down now, which also wakes a Receiver parked on a read.
            None => {
                let _ = SockRef::from(&self.stream).shutdown(Shutdown::Both);
            }
        }
        self.tx.wake();
        self.rx.wake();
        self.kick();
    }
}

/// Sets up a connection whose handshake is done: the two halves, and the flusher to spawn on
/// the caller's runtime. `src` holds bytes that arrived after the peer's handshake; on
/// `tls://`, `tls` is the session and the ciphertext read but not yet opened.
pub(super) fn start(
    stream: TcpStream,
    src: BytesMut,
    tls: Option<(Arc<Session>, BytesMut)>,
    cfg: &Config,
    live: Liveness,
    peer: String,
) -> (
    DirectSender,
    DirectReceiver,
    impl Future<Output = ()> + Send + 'static,
) {
    let (tls, cipher) = match tls {
        Some((session, cipher)) => (Some(session), cipher),
        None => (None, BytesMut::new()),
    };
    let sh = Arc::new(Shared {
        stream,
        tls,
        w: Mutex::new(Writer {
            batch: Batch::default(),
            out: Vec::new(),
            appended: 0,
            written: 0,
            ends: VecDeque::new(),
            boundary: 0,
            msgs_written: 0,
            sealed: 0,
            stop_owed: false,
            closing: false,
            close_written: false,
            error_reason: None,
        }),
        error: OnceLock::new(),
        recv_error: OnceLock::new(),
        peer_stopped: AtomicBool::new(false),
        peer_closed: AtomicBool::new(false),
        written: AtomicU64::new(0),
        taken: AtomicU64::new(0),
        yielded: AtomicBool::new(true),
        flusher: AtomicWaker::new(),
        work: AtomicBool::new(false),
        tx: AtomicWaker::new(),
        sender_gone: AtomicBool::new(false),
        sender_accepted: AtomicU64::new(0),
        ended: AtomicU8::new(0),
        r: Mutex::new(ReadState {
            dec: Decoder::new(cfg.limits),
            src,
            cipher,
            stall: None,
            clock: FrameClock::new(cfg),
            early: std::collections::VecDeque::new(),
            early_bytes: 0,
            end: None,
            heard: 0,
            spin: Spin::new(!cfg.busy_poll && spin_pays()),
        }),
        rx_parked: AtomicBool::new(false),
        rx: AtomicWaker::new(),
        receiver_gone: AtomicBool::new(false),
        busy_poll: cfg.busy_poll,
        cfg: cfg.clone(),
        peer,
    });
    let tx = DirectSender {
        sh: sh.clone(),
        accepted: 0,
        messages: 0,
        batch_full: false,
        kicked: false,
        closing: false,
    };
    let rx = DirectReceiver {
        sh: sh.clone(),
        done: false,
    };
    // Made before the future, so that dropping it unpolled (its runtime shut down before the
    // task ever ran) fails the connection too.
    let guard = FailOnDrop {
        sh: sh.clone(),
        armed: true,
    };
    (tx, rx, async move {
        let mut guard = guard;
        flusher(guard.sh.clone(), live).await;
        guard.armed = false;
    })
}

/// Fails the connection if its flusher is dropped before finishing (its runtime shut down),
/// so that the halves report it instead of waiting.
struct FailOnDrop {
    sh: Arc<Shared>,
    armed: bool,
}

impl Drop for FailOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.sh.fail(
                Error::new(
                    ErrorKind::Unavailable,
                    "the connection's runtime shut down (the inline engine runs on it)",
                ),
                false,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Sender
// ---------------------------------------------------------------------------------------

pub(super) struct DirectSender {
    sh: Arc<Shared>,
    /// Bytes appended when the last message was accepted (what `flush` waits for).
    accepted: u64,
    /// Messages accepted.
    messages: u64,
    /// The batch was full (in messages or bytes) when the last message was accepted: what
    /// `poll_submit` decides on without taking the writer's lock again. (A bool, decided
    /// under the lock: copying the batch's two counters out read them back as one 16-byte
    /// load right after `push` wrote them with two 8-byte stores, a store-forwarding stall
    /// that `perf annotate` put at a fifth of `start_send`.)
    batch_full: bool,
    /// This sender left work for the flusher and has not seen it run since (`yielded` is
    /// still unset): the flusher is woken or about to write, and writes what is appended
    /// before it takes the writer's lock, so a second `kick` per message is not needed.
    kicked: bool,
    closing: bool,
}

impl DirectSender {
    fn check(&self) -> Result<()> {
        super::conn::sender_check(self.sh.error(), self.closing, &self.sh.peer_stopped)
    }

    /// Writes what is pending now; `Ok(true)` when all of it was written.
    fn write_now(&self, w: &mut Writer) -> Result<bool> {
        match w.write(&self.sh) {
            Ok(Wrote::All) => Ok(true),
            Ok(Wrote::Blocked) => {
                // The flusher waits for the socket and carries on.
                self.sh.kick();
                Ok(false)
            }
            Err(e) => {
                let e = write_error(e);
                self.sh.fail(e.duplicate(), false);
                Err(e)
            }
        }
    }

    /// Waits until `done` holds for the writer (the flusher wakes us as it writes).
    fn poll_writer(
        &mut self,
        cx: &mut Context<'_>,
        done: impl Fn(&Writer) -> bool,
    ) -> Poll<Result<()>> {
        {
            let mut w = self.sh.lock();
            if done(&w) {
                return Poll::Ready(Ok(()));
            }
            if self.write_now(&mut w)? && done(&w) {
                return Poll::Ready(Ok(()));
            }
        }
        self.sh.tx.register(cx.waker());
        self.sh.kick();
        // Registered: a change from here on wakes us; one that came before is seen here.
        if let Some(e) = self.sh.error() {
            return Poll::Ready(Err(e));
        }
        if done(&self.sh.lock()) {
            return Poll::Ready(Ok(()));
        }
        Poll::Pending
    }
}

impl SendHalf for DirectSender {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.check()?;
        let (max_msgs, max_bytes) = (
            self.sh.cfg.send_queue.max(1),
            self.sh.cfg.send_queue_bytes as u64,
        );
        // Without the lock: bytes this sender appended and not yet written, messages not yet
        // taken into a write (control frames of others count only under the lock below).
        if self.accepted - self.sh.written.load(Ordering::Acquire).min(self.accepted) < max_bytes
            && self.messages - self.sh.taken.load(Ordering::Acquire) < max_msgs as u64
        {
            return Poll::Ready(Ok(()));
        }
        let room = |w: &Writer| w.pending() < max_bytes && w.batch.messages() < max_msgs;
        match self.poll_writer(cx, room) {
            Poll::Ready(r) => Poll::Ready(r.and_then(|()| self.check())),
            Poll::Pending => match self.check() {
                Err(e) => Poll::Ready(Err(e)),
                Ok(()) => Poll::Pending,
            },
        }
    }

    fn start_send(&mut self, msg: Message) -> Result<()> {
        if let Err(e) = self.check() {
            return Err(e.with_message(msg));
        }
        let mut w = self.sh.lock();
        w.push(msg);
        self.accepted = w.appended;
        self.batch_full = w.batch.messages() >= BATCH_MESSAGES || w.batch.bytes() >= BATCH_BYTES;
        self.messages += 1;
        Ok(())
    }

    /// Hands what was accepted to the socket: now when the connection was quiet or enough is
    /// pending, otherwise when this task yields (the flusher). Either way it is the
    /// transport's now.
    fn poll_submit(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        // Decided without the writer's lock, on what `start_send` saw under it: a stream of
        // small messages takes the lock once per message, and the flusher is kicked once
        // per yield rather than once per message (each of those is an atomic read-modify-
        // write, a few percent of a 64 B message's cost).
        if self.accepted <= self.sh.written.load(Ordering::Acquire) {
            return Poll::Ready(Ok(()));
        }
        // The flusher (or the Receiver finding the socket empty) marks the yield; only this
        // half clears the mark.
        let yielded = self.sh.yielded.load(Ordering::Relaxed);
        if yielded {
            self.sh.yielded.store(false, Ordering::Relaxed);
            self.kicked = false;
        }
        if yielded || self.batch_full {
            let mut w = self.sh.lock();
            if w.pending() == 0 {
                return Poll::Ready(Ok(()));
            }
            if self.write_now(&mut w)? {
                // All written: nothing for the flusher. A request/response exchange parks
                // its Receiver before the next send, which marks the yield.
                return Poll::Ready(Ok(()));
            }
            // The socket is full: `write_now` left the rest to the flusher.
            self.kicked = true;
            return Poll::Ready(Ok(()));
        }
        // The flusher runs when this task yields: it writes what is left, and its running
        // tells the next send that the task yielded. Kicked already and not run since: it
        // writes this message too (it marks `yielded` before it takes the lock, and this
        // message was appended under the lock before `yielded` was read above).
        if !self.kicked {
            self.sh.kick();
            self.kicked = true;
        }
        Poll::Ready(Ok(()))
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let target = self.accepted;
        self.poll_writer(cx, |w| w.written >= target)
    }

    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.closing {
            self.closing = true;
            let mut w = self.sh.lock();
            if !w.closing {
                w.closing = true;
                w.push_control(&Control::Close);
            }
        }
        match self.poll_writer(cx, |w| w.close_written) {
            Poll::Ready(Err(e)) if e.kind() == ErrorKind::Closed => Poll::Ready(Ok(())),
            other => other,
        }
    }
}

impl Drop for DirectSender {
    fn drop(&mut self) {
        // Drop is a close: the flusher writes what is pending and `CLOSE`, within `linger`.
        {
            let mut w = self.sh.lock();
            if !w.closing {
                w.closing = true;
                w.push_control(&Control::Close);
            }
        }
        self.sh
            .sender_accepted
            .store(self.messages, Ordering::Release);
        self.sh.sender_gone.store(true, Ordering::Release);
        self.sh.kick();
        self.sh.end_one();
    }
}

// ---------------------------------------------------------------------------------------
// Receiver
// ---------------------------------------------------------------------------------------

/// Where reading stands: the decoder (with any large body it is filling), the bytes read
/// and not decoded yet, the stall timer of a frame that is only partly there, and what the
/// flusher read ahead for the Receiver.
pub(super) struct ReadState {
    dec: Decoder,
    src: BytesMut,
    /// `tls://`: ciphertext read and not yet opened.
    cipher: BytesMut,
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The deadline of the frame that is only partly there.
    clock: FrameClock,
    /// Messages the flusher decoded while the Receiver was busy (bounded by the receive
    /// queue); the Receiver takes them first.
    early: std::collections::VecDeque<Message>,
    early_bytes: usize,
    /// How the peer's direction ended, when the flusher saw it first.
    end: Option<End>,
    /// Reads that returned bytes: grows whenever the peer is heard from.
    heard: u64,
    /// Whether the Receiver spins before it parks (see [`Spin`]).
    spin: Spin,
}

/// The Receiver's spin before it parks: when the socket is empty it asks it again for up to
/// [`SPIN`](crate::transport::SPIN) (non-blocking `recv`s) before it waits for epoll, so
/// that in a request/response exchange the answer is taken as it lands, without the sleep
/// and wake-up of a parked thread on both sides (the cost that set a 64 B ping-pong's
/// latency: ~30 µs of wake-up against a few µs of system calls on the measured host).
///
/// Only for an answer: the Receiver spins when its connection wrote something since its
/// last wait; one that only receives (a stream) parks, so that the sender's writes gather in
/// the socket and are read a batch at a time.
///
/// Adaptive, so that spins that do not pay stop: a spin that finds nothing costs one of
/// [`SPIN_CREDIT`] credits, a spin that catches the answer restores them all. With none
/// left the Receiver parks at once, and tries a spin again after 1, 2, 4 .. [`SPIN_BACKOFF`]
/// waits (back to full credit if that try catches the answer). So an idle client of a
/// server, or a peer on the same runtime thread (which cannot answer while this thread
/// spins), costs one spin per [`SPIN_BACKOFF`] + 1 waits once the credit is spent.
struct Spin {
    /// Spins left that may find nothing.
    credit: u8,
    /// What a spin that catches the answer restores: [`SPIN_CREDIT`], or 0 where spinning
    /// does not pay.
    full: u8,
    /// Without credit: answer waits to park through before the next try.
    skip: u8,
    /// Without credit: the waits between tries, doubled by each try that finds nothing.
    backoff: u8,
    /// The connection's bytes written when the Receiver last decided whether to spin.
    sent: u64,
}

/// Whether spinning can pay on this machine: only where the peer can run meanwhile. With
/// one CPU online the spin would hold the core the answer needs. (The machine's CPUs, not
/// this process's affinity: a process pinned to one core still has its peer on another.)
fn spin_pays() -> bool {
    static PAYS: OnceLock<bool> = OnceLock::new();
    *PAYS.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|list| cpus_in_list(list.trim()))
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .is_some_and(|n| n > 1)
    })
}

/// How many CPUs a kernel CPU list (`0-3,8,10-11`) names; `None` when it does not parse.
fn cpus_in_list(list: &str) -> Option<usize> {
    list.split(',').try_fold(0, |n, part| {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
        Some(n + b.checked_sub(a)? + 1)
    })
}

/// The pause between two `recv`s of a spinning Receiver (a `sched_yield`, then a spin).
const SPIN_GAP: Duration = Duration::from_micros(1);

/// Spins that find nothing before the Receiver parks at once.
const SPIN_CREDIT: u8 = 3;
/// Without credit, at most this many answer waits go by between two tries.
const SPIN_BACKOFF: u8 = 64;

impl Spin {
    fn new(on: bool) -> Spin {
        let full = if on { SPIN_CREDIT } else { 0 };
        Spin {
            credit: full,
            full,
            skip: 0,
            backoff: 0,
            sent: 0,
        }
    }

    /// Whether to spin in the wait that begins (`written`: the connection's bytes written).
    fn pays(&mut self, written: u64) -> bool {
        let answer = written != self.sent;
        self.sent = written;
        if !answer || self.full == 0 {
            return false;
        }
        if self.credit > 0 {
            return true;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// The spin caught the answer.
    fn caught(&mut self) {
        self.credit = self.full;
        self.backoff = 0;
        self.skip = 0;
    }

    /// The spin found nothing: the Receiver parks.
    fn missed(&mut self) {
        if self.credit > 0 {
            self.credit -= 1;
            if self.credit > 0 {
                return;
            }
        }
        self.backoff = (self.backoff * 2).clamp(1, SPIN_BACKOFF);
        self.skip = self.backoff;
    }
}

/// How the peer's direction ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Its `CLOSE` (the rest of the stream may still hold `STOP` or `ERROR`).
    Closed,
    /// Its EOF after `CLOSE`.
    Eof,
    /// The connection failed.
    Failed,
}

/// What a read step gave.
enum Got {
    Message(Message),
    /// The peer's `CLOSE`: its direction has ended.
    Closed,
    /// EOF after the peer's `CLOSE`.
    Eof,
}

impl ReadState {
    /// Decodes the next message or end of the peer's direction, reading as needed. Control
    /// frames are acted on here. `Err((e, tell_peer))` ends the connection.
    ///
    /// Without a context (the flusher reading ahead) it never registers with the socket: it
    /// returns `Pending` as soon as the socket has nothing.
    fn poll_next(
        &mut self,
        sh: &Shared,
        mut cx: Option<&mut Context<'_>>,
        busy: bool,
    ) -> Poll<std::result::Result<Got, (Error, bool)>> {
        let mut spins = 0;
        // While spinning before parking: until when (see `Spin`).
        let mut spin_until: Option<Instant> = None;
        let mut spun = false;
        loop {
            match self.dec.decode(&mut self.src) {
                Ok(Some(Frame::Message(_))) if sh.peer_closed.load(Ordering::Acquire) => {
                    return Poll::Ready(Err(protocol(
                        "the peer sent a message after its CLOSE frame",
                    )));
                }
                Ok(Some(Frame::Message(m))) => {
                    self.clock.boundary();
                    return Poll::Ready(Ok(Got::Message(m)));
                }
                Ok(Some(Frame::Control(Control::Close))) => {
                    sh.peer_closed.store(true, Ordering::Release);
                    return Poll::Ready(Ok(Got::Closed));
                }
                Ok(Some(Frame::Control(Control::Stop))) => {
                    sh.peer_stopped.store(true, Ordering::Release);
                    sh.tx.wake();
                    continue;
                }
                Ok(Some(Frame::Control(Control::Heartbeat))) => continue,
                Ok(Some(Frame::Control(Control::Error(reason)))) => {
                    return Poll::Ready(Err((
                        Error::new(
                            ErrorKind::Protocol,
                            format!(
                                "the peer closed the connection: {}",
                                crate::text::escape_untrusted(&reason)
                            ),
                        ),
                        false,
                    )));
                }
                Ok(None) => {}
                Err(e) => return Poll::Ready(Err(protocol(e))),
            }
            if sh.failed() {
                return Poll::Ready(Err((
                    Error::new(ErrorKind::Closed, "connection closed"),
                    false,
                )));
            }
            let mid_frame = !self.dec.is_at_boundary(&self.src);
            match self.read(sh, busy || spin_until.is_some()) {
                Ok(0) if mid_frame => {
                    return Poll::Ready(Err((
                        Error::new(
                            ErrorKind::ConnectionLost,
                            "peer closed the connection in the middle of a frame (truncated frame)",
                        ),
                        false,
                    )));
                }
                Ok(0) if sh.peer_closed.load(Ordering::Acquire) => {
                    return Poll::Ready(Ok(Got::Eof));
                }
                Ok(0) => {
                    return Poll::Ready(Err((
                        Error::new(
                            ErrorKind::ConnectionLost,
                            "peer closed the connection without closing the channel (did it exit or crash?)",
                        ),
                        false,
                    )));
                }
                Ok(n) => {
                    self.clock.read(n);
                    self.heard += 1;
                    if spin_until.take().is_some() {
                        self.spin.caught();
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The task waited for input: what it sends next answers it, and goes out
                    // at once (see `DirectSender::poll_submit`).
                    if cx.is_some() {
                        sh.yielded.store(true, Ordering::Relaxed);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Poll::Ready(Err((Error::io("reading from the peer", e), false))),
            }
            let Some(cx) = cx.as_deref_mut() else {
                return Poll::Pending;
            };
            if busy {
                spins += 1;
                if spins < SPIN_READS {
                    std::hint::spin_loop();
                    continue;
                }
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match spin_until {
                None if !spun && self.spin.pays(sh.written.load(Ordering::Relaxed)) => {
                    spun = true;
                    spin_until = Some(Instant::now() + SPIN);
                    continue;
                }
                Some(until) => {
                    let now = Instant::now();
                    if now < until {
                        // Ask the kernel again after a pause: a `recv` takes the socket's
                        // lock, which the peer's packets need too. The pause begins with a
                        // `sched_yield`: on a host with more runnable threads than cores the
                        // spin gives its core to them (the peer among them) instead of
                        // holding it; with nothing else to run it returns at once.
                        let next = (now + SPIN_GAP).min(until);
                        std::thread::yield_now();
                        while Instant::now() < next {
                            std::hint::spin_loop();
                        }
                        continue;
                    }
                    // Nothing came: park.
                    spin_until = None;
                    self.spin.missed();
                }
                None => {}
            }
            match sh.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err((Error::io("reading from the peer", e), false)));
                }
                Poll::Pending => {}
            }
            if mid_frame {
                let deadline = tokio::time::Instant::from_std(self.clock.deadline());
                let timer = self
                    .stall
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err((self.clock.expired(), true)));
                }
            } else {
                self.clock.boundary();
            }
            return Poll::Pending;
        }
    }

    /// One non-blocking read: into a large body's own buffer, or into the shared buffer.
    /// On `tls://`, what the socket gives is ciphertext: it is read into `cipher` and opened
    /// into the same places.
    fn read(&mut self, sh: &Shared, direct: bool) -> io::Result<usize> {
        let (buf, most): (&mut BytesMut, usize) = match self.dec.body_target() {
            // Never past the body: what follows it belongs to the next frame.
            Some((body, missing)) => (body, missing),
            None => {
                let want = self.dec.wanted(&self.src).max(4096);
                if self.src.capacity() - self.src.len() < want {
                    self.src.reserve(want.max(READ_CHUNK));
                }
                (&mut self.src, usize::MAX)
            }
        };
        let Some(tls) = &sh.tls else {
            return recv(&sh.stream, buf, most, direct);
        };
        loop {
            if let Some(n) = tls.take(&mut self.cipher, buf, most)? {
                return Ok(n);
            }
            if self.cipher.capacity() - self.cipher.len() < 4096 {
                self.cipher.reserve(READ_CHUNK);
            }
            if recv(&sh.stream, &mut self.cipher, usize::MAX, direct)? == 0 {
                tls.end_of_stream()?;
                return Ok(tls.take(&mut self.cipher, buf, most)?.unwrap_or(0));
            }
        }
    }
}

/// One non-blocking read from `stream` into the spare capacity of `buf` (at most `most`).
///
/// `direct`: a `recv` system call whatever tokio's readiness says. tokio answers
/// `WouldBlock` without asking the kernel once a read found the socket empty, until its
/// reactor polls epoll again; a busy-polling receiver must ask the kernel itself.
///
/// Otherwise the read runs inside `try_io`, and a short read (less than it asked for: the
/// socket is empty) clears tokio's readiness, as tokio's own `AsyncRead` for `TcpStream`
/// does: the next read then waits for epoll instead of asking the kernel only to hear
/// `EAGAIN` (a `recvfrom` per message in a ping-pong). `try_io` takes its snapshot of the
/// readiness *before* the read and clears only that one, so data that arrives after the
/// read is a newer event (on a multi-thread runtime the reactor may record it meanwhile)
/// and is not forgotten. (Clearing after the read, with a second `try_io`, lost such an
/// event: a stalled transfer on a multi-thread runtime, tests/channel.rs.) `try_io`'s docs
/// ask for `WouldBlock` only when the I/O itself would block; answering it after a short
/// read relies on what `try_io` does with it (clear the snapshot's readiness, and nothing
/// else), which is what tokio's own `PollEvented::poll_read` (`src/io/poll_evented.rs`,
/// tokio 1.x) does on `0 < n < len`.
fn recv(stream: &TcpStream, buf: &mut BytesMut, most: usize, direct: bool) -> io::Result<usize> {
    use bytes::BufMut;
    if buf.capacity() == buf.len() {
        // Callers reserve before reading; never hand `recv` an empty buffer (0 is EOF).
        buf.reserve(4096);
    }
    let spare = buf.spare_capacity_mut();
    let take = spare.len().min(most);
    let mut read = || SockRef::from(stream).recv(&mut spare[..take]);
    let n = if direct {
        read()?
    } else {
        let mut short = 0;
        let r = stream.try_io(tokio::io::Interest::READABLE, || {
            let n = read()?;
            if n > 0 && n < take {
                // Read, and the socket is empty: `WouldBlock` tells `try_io` to clear the
                // readiness it saw before the read; the bytes are returned below.
                short = n;
                return Err(io::Error::from(io::ErrorKind::WouldBlock));
            }
            Ok(n)
        });
        match r {
            Ok(n) => n,
            Err(_) if short > 0 => short,
            Err(e) => return Err(e),
        }
    };
    // SAFETY: `recv` initialised the first `n` bytes of the spare capacity (it returns how
    // many it wrote, at most the length it was given).
    unsafe { buf.advance_mut(n) };
    Ok(n)
}

fn protocol(e: impl std::fmt::Display) -> (Error, bool) {
    (Error::new(ErrorKind::Protocol, e.to_string()), true)
}

pub(super) struct DirectReceiver {
    sh: Arc<Shared>,
    done: bool,
}

/// Ends the Receiver's stream (`done` is its flag): what it returns from here on.
fn end_stream(done: &mut bool, sh: &Shared, end: End) -> Poll<Option<Result<Message>>> {
    *done = true;
    // The flusher reads the rest of the stream (STOP, ERROR, EOF) from here on.
    sh.kick();
    match end {
        End::Closed | End::Eof => Poll::Ready(None),
        End::Failed => Poll::Ready(sh.recv_error.get().map(|e| Err(e.duplicate()))),
    }
}

impl RecvHalf for DirectReceiver {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        if self.done {
            return Poll::Ready(None);
        }
        // Borrowed, not cloned: a reference count up and down per message is two atomic
        // read-modify-writes on the receive path.
        let DirectReceiver { sh, done } = self;
        let sh: &Shared = sh;
        sh.rx_parked.store(false, Ordering::Relaxed);
        let mut st = sh.read_state();
        if let Some(m) = st.early.pop_front() {
            let full = st.early.len() + 1 >= sh.cfg.recv_queue.max(1)
                || st.early_bytes >= sh.cfg.recv_queue_bytes;
            st.early_bytes -= m.body().len();
            if full {
                // The flusher stopped reading ahead for room: there is some now.
                sh.kick();
            }
            return Poll::Ready(Some(Ok(m)));
        }
        if let Some(end) = st.end {
            drop(st);
            return end_stream(done, sh, end);
        }
        match st.poll_next(sh, Some(cx), sh.busy_poll) {
            Poll::Ready(Ok(Got::Message(m))) => Poll::Ready(Some(Ok(m))),
            Poll::Ready(Ok(Got::Closed)) => {
                st.end = Some(End::Closed);
                drop(st);
                end_stream(done, sh, End::Closed)
            }
            Poll::Ready(Ok(Got::Eof)) => {
                st.end = Some(End::Eof);
                drop(st);
                end_stream(done, sh, End::Eof)
            }
            Poll::Ready(Err((e, tell_peer))) => {
                st.end = Some(End::Failed);
                drop(st);
                if !sh.failed() {
                    if e.kind() == ErrorKind::ConnectionLost {
                        tracing::debug!(peer = %sh.peer, "connection lost: {e:#}");
                    } else {
                        tracing::warn!(peer = %sh.peer, "closing connection: {e:#}");
                    }
                }
                sh.fail(e, tell_peer);
                end_stream(done, sh, End::Failed)
            }
            Poll::Pending => {
                // Registered with the socket: the flusher leaves reading to us meanwhile (and
                // wakes us if it read something all the same).
                sh.rx.register(cx.waker());
                sh.rx_parked.store(true, Ordering::Relaxed);
                Poll::Pending
            }
        }
    }
}

impl Drop for DirectReceiver {
    fn drop(&mut self) {
        if !self.done {
            // Tell the peer to stop sending (unless the stream already ended).
            self.sh.lock().stop_owed = true;
        }
        let discarded = {
            let mut st = self.sh.read_state();
            st.early_bytes = 0;
            std::mem::take(&mut st.early).len()
        };
        if discarded > 0 {
            self.sh.cfg.count.unread(discarded as u64);
            tracing::debug!(
                messages = discarded,
                "tcp receiver dropped with messages read ahead"
            );
        }
        self.sh.receiver_gone.store(true, Ordering::Release);
        self.sh.kick();
    }
}

// ---------------------------------------------------------------------------------------
// Flusher
// ---------------------------------------------------------------------------------------

/// The connection's task: writes what the Sender left and the control frames, reads ahead
/// while the Receiver is busy (so that a `STOP` or an `ERROR` is seen even by a side that
/// only sends) and after it is gone, and winds the connection down:
///
/// * the write side ends with `CLOSE` (the Sender's close or drop); it stays open after that
///   while the Receiver may still owe a `STOP`, then is shut down (FIN);
/// * the read side ends at the peer's EOF;
/// * once both halves are gone, whatever is left finishes within `linger`.
async fn flusher(sh: Arc<Shared>, live: Liveness) {
    let _ended = Ended(&sh);
    let mut write_shut = false;
    let mut discarded = 0u64;
    let mut linger_until: Option<tokio::time::Instant> = None;
    let mut tick = Tick::new(live.active().then_some(live.tick).flatten());
    let mut silence = live.silence(std::time::Instant::now());
    let mut written_at_tick = sh.written.load(Ordering::Relaxed);
    loop {
        let blocked = match write_owed(&sh) {
            Ok(b) => b,
            Err(e) => {
                sh.fail(write_error(e), false);
                true
            }
        };
        if sh.failed() {
            finish_failed(&sh).await;
            return;
        }
        let receiver_gone = sh.receiver_gone.load(Ordering::Acquire);
        let (reader_done, can_read) = {
            let st = sh.read_state();
            let reader_done = matches!(st.end, Some(End::Eof | End::Failed));
            let room = receiver_gone
                || (st.early.len() < sh.cfg.recv_queue.max(1)
                    && st.early_bytes < sh.cfg.recv_queue_bytes);
            (reader_done, !reader_done && room)
        };
        let receiver_finished = receiver_gone || {
            let st = sh.read_state();
            st.end.is_some() && st.early.is_empty()
        };
        if !write_shut && !blocked && receiver_finished && sh.lock().close_written {
            if let Some(tls) = &sh.tls {
                // Best effort: a FIN alone ends the stream as well (the CLOSE frame before it
                // is what says the end was clean).
                tls.close_notify();
                let _ = tls.write_to(&sh.stream);
            }
            let _ = SockRef::from(&sh.stream).shutdown(Shutdown::Write);
            write_shut = true;
        }
        if write_shut && reader_done {
            break;
        }
        if sh.sender_gone.load(Ordering::Acquire) && receiver_gone {
            // Nothing local uses the connection any more: finish within `linger`.
            let until =
                *linger_until.get_or_insert_with(|| tokio::time::Instant::now() + sh.cfg.linger);
            if tokio::time::Instant::now() >= until {
                tracing::debug!(peer = %sh.peer, "linger time over; closing");
                break;
            }
        }
        // Wait for work, for room in the socket, or for something to read while nobody else
        // is reading it.
        let readable = sh.stream.readable();
        tokio::pin!(readable);
        let mut ticked = false;
        let wait = poll_fn(|cx| {
            sh.flusher.register(cx.waker());
            if sh.work.swap(false, Ordering::AcqRel) || sh.failed() {
                return Poll::Ready(());
            }
            if tick.poll_tick(cx).is_ready() {
                ticked = true;
                return Poll::Ready(());
            }
            if blocked && sh.stream.poll_write_ready(cx).is_ready() {
                return Poll::Ready(());
            }
            let ours = receiver_gone || !sh.rx_parked.load(Ordering::Relaxed);
            if can_read && ours && readable.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            Poll::Pending
        });
        match linger_until {
            Some(until) => {
                let _ = tokio::time::timeout_at(until, wait).await;
            }
            None => wait.await,
        }
        if can_read && (receiver_gone || !sh.rx_parked.load(Ordering::Relaxed)) {
            read_ahead(&sh, &mut discarded);
        }
        if ticked {
            let listening = !reader_done && (can_read || sh.rx_parked.load(Ordering::Relaxed));
            on_tick(
                &sh,
                &live,
                silence.as_mut(),
                listening,
                &mut written_at_tick,
                write_shut,
            );
        }
    }
    if discarded > 0 {
        tracing::info!(peer = %sh.peer, discarded, "connection ended; messages no receiver read were discarded");
    }
    let _ = SockRef::from(&sh.stream).shutdown(Shutdown::Both);
    sh.tx.wake();
}

/// A heartbeat tick of the flusher: a `HEARTBEAT` if nothing was written since the last
/// tick (it counts as written, so while idle one goes out every other tick, an interval
/// apart), and the peer declared lost if it has been silent too long while we listened.
fn on_tick(
    sh: &Shared,
    live: &Liveness,
    silence: Option<&mut Silence>,
    listening: bool,
    written_at_tick: &mut u64,
    write_shut: bool,
) {
    if live.send_every.is_some() && !write_shut && !sh.failed() {
        let written = sh.written.load(Ordering::Relaxed);
        if written == *written_at_tick {
            {
                let mut w = sh.lock();
                if w.pending() == 0 {
                    w.push_control(&Control::Heartbeat);
                }
            }
            if let Err(e) = write_owed(sh) {
                sh.fail(write_error(e), false);
            }
        }
        *written_at_tick = sh.written.load(Ordering::Relaxed);
    }
    if let Some(s) = silence {
        // A Receiver holding the read state is reading right now: that is hearing.
        let heard = match sh.r.try_lock() {
            Ok(st) => st.heard,
            Err(_) => u64::MAX,
        };
        // Bytes waiting in the socket were heard too, even if nobody read them yet (a
        // Receiver whose task dropped its pending `next()` still counts as parked, and the
        // flusher leaves the socket to it).
        let mut one = [std::mem::MaybeUninit::<u8>::uninit()];
        let waiting = SockRef::from(&sh.stream).peek(&mut one).is_ok();
        if let Err(silent) = s.check(std::time::Instant::now(), heard, listening && !waiting) {
            let who = format!("the tcp peer {}", sh.peer);
            sh.fail(live.lost(&who, silent), true);
        }
    }
}

/// Reads what the socket has (never waiting): messages go to the Receiver's early queue
/// while there is room (or are discarded once it is gone), control frames are acted on.
fn read_ahead(sh: &Shared, discarded: &mut u64) {
    // The Receiver may be reading right now: then it is its turn.
    let Ok(mut st) = sh.r.try_lock() else {
        return;
    };
    let gone = sh.receiver_gone.load(Ordering::Acquire);
    let before = (st.early.len(), st.end);
    read_into(sh, &mut st, gone, discarded);
    if (st.early.len(), st.end) != before {
        drop(st);
        sh.rx.wake();
    }
}

fn read_into(sh: &Shared, st: &mut ReadState, gone: bool, discarded: &mut u64) {
    loop {
        if matches!(st.end, Some(End::Eof | End::Failed)) {
            return;
        }
        if !gone
            && (st.early.len() >= sh.cfg.recv_queue.max(1)
                || st.early_bytes >= sh.cfg.recv_queue_bytes)
        {
            return;
        }
        match st.poll_next(sh, None, false) {
            Poll::Ready(Ok(Got::Message(m))) => {
                if gone {
                    *discarded += 1;
                    sh.cfg.count.unread(1);
                } else {
                    st.early_bytes += m.body().len();
                    st.early.push_back(m);
                }
            }
            Poll::Ready(Ok(Got::Closed)) => {
                if st.end.is_none() {
                    st.end = Some(End::Closed);
                }
            }
            Poll::Ready(Ok(Got::Eof)) => st.end = Some(End::Eof),
            Poll::Ready(Err((e, tell_peer))) => {
                st.end = Some(End::Failed);
                if e.kind() != ErrorKind::ConnectionLost && !sh.failed() {
                    tracing::warn!(peer = %sh.peer, "closing connection: {e:#}");
                }
                sh.fail(e, tell_peer);
                return;
            }
            Poll::Pending => return,
        }
    }
}

/// Writes the owed `STOP` and whatever is pending; `Ok(true)` when the socket is full.
fn write_owed(sh: &Shared) -> io::Result<bool> {
    sh.yielded.store(true, Ordering::Relaxed);
    let mut w = sh.lock();
    if w.stop_owed {
        w.stop_owed = false;
        w.push_control(&Control::Stop);
    }
    let r = w.write(sh);
    drop(w);
    sh.tx.wake();
    Ok(matches!(r?, Wrote::Blocked))
}

/// After a failure: the `ERROR` frame owed to the peer (best effort, bounded), then shut
/// down.
/// Ends the flusher's part, however its future ends.
struct Ended<'a>(&'a Shared);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.end_one();
    }
}

impl Shared {
    /// The Sender or the flusher has ended; once both have, what the Sender accepted and
    /// was never completely written is counted as unsent.
    fn end_one(&self) {
        if self.ended.fetch_add(1, Ordering::AcqRel) == 1 {
            let written = self.lock().msgs_written;
            let unsent = self
                .sender_accepted
                .load(Ordering::Acquire)
                .saturating_sub(written);
            if unsent > 0 {
                tracing::warn!(peer = %self.peer, messages = unsent, "connection ended with messages the Sender accepted and never wrote (counted in Context::stats)");
                self.cfg.count.unsent(unsent);
            }
        }
    }
}

async fn finish_failed(sh: &Shared) {
    let reason = sh.lock().error_reason.take();
    if let Some(reason) = reason {
        sh.lock().abandon_for(&Control::Error(reason));
        let _ = tokio::time::timeout(ERROR_WRITE, async {
            loop {
                let r = sh.lock().write(sh);
                match r {
                    Ok(Wrote::Blocked) => {
                        if sh.stream.writable().await.is_err() {
                            return;
                        }
                    }
                    _ => return,
                }
            }
        })
        .await;
    }
    let _ = SockRef::from(&sh.stream).shutdown(Shutdown::Both);
    sh.tx.wake();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(cpus_in_list("0"), Some(1));
        assert_eq!(cpus_in_list("0-1"), Some(2));
        assert_eq!(cpus_in_list("0-3,8,10-11"), Some(7));
        assert_eq!(cpus_in_list("3-1"), None);
        assert_eq!(cpus_in_list(""), None);
        assert_eq!(cpus_in_list("x"), None);
    }

    #[test]
    fn spins_only_for_an_answer() {
        let mut spin = Spin::new(true);
        // Nothing written since the last wait: a stream's receiver parks.
        assert!(!spin.pays(0));
        // Written since: waiting for the answer.
        assert!(spin.pays(64));
        assert!(!spin.pays(64));
        assert!(spin.pays(128));
    }

    /// How many of `waits` answer waits spin when every spin finds nothing.
    fn spins_missing(spin: &mut Spin, written: &mut u64, waits: usize) -> usize {
        let mut spun = 0;
        for _ in 0..waits {
            *written += 64;
            if spin.pays(*written) {
                spun += 1;
                spin.missed();
            }
        }
        spun
    }

    #[test]
    fn spins_that_miss_back_off_and_one_that_catches_restores_the_credit() {
        let mut spin = Spin::new(true);
        let mut written = 0;
        // The credit, then tries after 1, 2, 4 .. SPIN_BACKOFF waits.
        let backoffs: Vec<usize> = std::iter::successors(Some(1), |b| Some(b * 2))
            .take_while(|&b| b <= usize::from(SPIN_BACKOFF))
            .collect();
        let waits = usize::from(SPIN_CREDIT) + backoffs.iter().map(|b| b + 1).sum::<usize>();
        assert_eq!(
            spins_missing(&mut spin, &mut written, waits),
            usize::from(SPIN_CREDIT) + backoffs.len()
        );
        // From then on one try per SPIN_BACKOFF + 1 waits: an idle client, or a peer on
        // this thread.
        let period = usize::from(SPIN_BACKOFF) + 1;
        assert_eq!(spins_missing(&mut spin, &mut written, period * 10), 10);
        // A try that catches the answer: full credit, no back-off.
        let mut spun = 0;
        while spun == 0 {
            written += 64;
            if spin.pays(written) {
                spun += 1;
                spin.caught();
            }
        }
        assert_eq!(spins_missing(&mut spin, &mut written, 3), 3);
    }

    #[test]
    fn off_never_spins() {
        let mut spin = Spin::new(false);
        spin.caught();
        assert!(!spin.pays(64));
    }
}
