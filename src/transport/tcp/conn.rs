//! One TCP connection: the state its user halves share with its driver on the I/O thread,
//! the halves themselves, and the driver (handshake, read loop, write loop).
//!
//! ```text
//!  user task(s)                            I/O thread (one task per connection)
//!  TcpSender ──batches──▶ out pipe ──▶ write loop ──writev──▶ socket
//!  TcpReceiver ◀─batches── inp pipe ◀── read loop  ◀──read─── socket
//! ```
//!
//! Both pipes are bounded. The write loop drains everything queued into one vectored write
//! (small frames coalesced, large bodies as iovecs of their own); the read loop decodes every
//! frame of a read zero-copy, hands them over as one batch, and pauses reading while `inp` is
//! full, which backpressures the peer through TCP's window.

use std::future::Future;
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use futures_util::future::poll_fn;

use super::sys::Io;
use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;
use crate::message::Message;
use crate::transport::heartbeat::{Liveness, Tick};
use crate::transport::pipe::{Consumer, Item, Pipe, Producer, Signal, Stager, Unbatcher};
use crate::transport::{Config, Count, RecvHalf, SendHalf};
use crate::wire::{Batch, Capabilities, Control, Decoder, Frame, HANDSHAKE_LEN, Handshake};

/// Bytes read into the shared receive buffer at a time (many small frames per read).
const READ_CHUNK: usize = 256 << 10;
/// Bytes read at a time while waiting for the peer's handshake.
const HANDSHAKE_READ: usize = 1024;
/// A write batch is cut at this many iovecs (Linux IOV_MAX is 1024)...
const BATCH_MAX_IOVECS: usize = 512;
/// ...or this many bytes.
const BATCH_MAX_BYTES: usize = 4 << 20;
/// Most messages the read loop hands over in one batch.
const DELIVER_MAX: usize = 256;

/// What a connection's user halves and its driver share.
pub(crate) struct Conn {
    /// Sender → write loop.
    out: Arc<Pipe>,
    /// Read loop → Receiver.
    inp: Arc<Pipe>,
    /// The failure that ended the connection; the Sender reports it.
    error: OnceLock<Error>,
    /// The same failure for the Receiver, set only if the peer had not closed its direction
    /// cleanly before: a stream that ended cleanly stays clean.
    recv_error: OnceLock<Error>,
    /// A reason to send the peer in an `ERROR` frame before closing.
    notify_peer: Mutex<Option<String>>,
    /// Messages the write loop has handed to the kernel.
    written: AtomicU64,
    /// The `CLOSE` frame is written.
    close_done: AtomicBool,
    /// The peer sent `STOP`: it no longer reads.
    peer_stopped: AtomicBool,
    /// Our Receiver is gone before the stream ended: the write loop owes the peer a `STOP`.
    stop_owed: AtomicBool,
    /// The write loop has finished (and shut down the write side).
    writer_done: AtomicBool,
    /// The read loop has finished.
    reader_done: AtomicBool,
    /// Messages received that no Receiver will see (it was dropped).
    discarded: AtomicU64,
    /// Messages the Sender accepted, stored when it goes.
    sender_accepted: AtomicU64,
    /// The Sender and the driver that have ended: the second counts what was not written.
    ends: AtomicU8,
    /// The user halves are gone (set by their drops, which then notify `gone`).
    sender_dropped: AtomicBool,
    receiver_dropped: AtomicBool,
    gone: tokio::sync::Notify,
    count: Count,
    peer: String,
}

impl Conn {
    pub(crate) fn new(cfg: &Config) -> Conn {
        Conn {
            out: Pipe::new(cfg.send_queue, cfg.send_queue_bytes),
            inp: Pipe::new(cfg.recv_queue, cfg.recv_queue_bytes),
            error: OnceLock::new(),
            recv_error: OnceLock::new(),
            notify_peer: Mutex::new(None),
            written: AtomicU64::new(0),
            close_done: AtomicBool::new(false),
            peer_stopped: AtomicBool::new(false),
            stop_owed: AtomicBool::new(false),
            writer_done: AtomicBool::new(false),
            reader_done: AtomicBool::new(false),
            discarded: AtomicU64::new(0),
            sender_accepted: AtomicU64::new(0),
            ends: AtomicU8::new(0),
            sender_dropped: AtomicBool::new(false),
            receiver_dropped: AtomicBool::new(false),
            gone: tokio::sync::Notify::new(),
            count: cfg.count.clone(),
            peer: String::new(),
        }
    }

    /// Names the peer in what the connection reports when it ends.
    pub(crate) fn with_peer(mut self, peer: &str) -> Conn {
        self.peer = peer.to_owned();
        self
    }

    /// The Sender or the driver has ended; once both have, what the Sender accepted and the
    /// write loop never wrote is counted as unsent.
    fn end_one(&self) {
        if self.ends.fetch_add(1, Ordering::AcqRel) == 1 {
            let unsent = self
                .sender_accepted
                .load(Ordering::Acquire)
                .saturating_sub(self.written.load(Ordering::Acquire));
            if unsent > 0 {
                tracing::warn!(peer = %self.peer, messages = unsent, "connection ended with messages the Sender accepted and never wrote (counted in Context::stats)");
                self.count.unsent(unsent);
            }
        }
    }

    fn error(&self) -> Option<Error> {
        self.error.get().map(Error::duplicate)
    }

    fn failed(&self) -> bool {
        self.error.get().is_some()
    }

    /// Ends the connection with `err` (the first failure wins) and wakes everyone. Called
    /// only from the driver's task (its loops, or its drop guard).
    pub(crate) fn fail(&self, err: Error, tell_peer: bool) {
        let reason = tell_peer.then(|| err.to_string());
        if !self.inp.is_tx_closed() {
            // The read loop, the only other closer of `inp`, runs in this same task: no race.
            let _ = self.recv_error.set(err.duplicate());
        }
        if self.error.set(err).is_ok()
            && let Some(r) = reason
        {
            *self.notify_peer.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        }
        self.inp.close_tx();
        // Releases a Sender waiting for room: it looks again and finds the error.
        self.out.close_rx();
        self.wake_all();
    }

    fn wake_all(&self) {
        self.out.to_producer.wake();
        self.out.to_consumer.wake();
        self.inp.to_producer.wake();
        self.inp.to_consumer.wake();
    }
}

// ---------------------------------------------------------------------------------------
// User halves
// ---------------------------------------------------------------------------------------

pub(crate) struct TcpSender {
    conn: Arc<Conn>,
    out: Stager,
    /// Messages accepted so far (compared with `Conn::written` by flush).
    accepted: u64,
    closing: bool,
}

impl TcpSender {
    pub(crate) fn new(conn: Arc<Conn>) -> TcpSender {
        TcpSender {
            out: Stager::new(conn.out.clone()),
            conn,
            accepted: 0,
            closing: false,
        }
    }

    fn check(&self) -> Result<()> {
        sender_check(self.conn.error(), self.closing, &self.conn.peer_stopped)
    }

    /// Waits for `done`, re-checked after arming the wake-up; fails with the connection.
    fn poll_until(
        &mut self,
        cx: &mut Context<'_>,
        done: impl Fn(&Conn) -> bool,
    ) -> Poll<Result<()>> {
        let conn = &self.conn;
        conn.out.to_producer.poll_until(cx, || {
            if done(conn) {
                Some(Ok(()))
            } else {
                conn.error().map(Err)
            }
        })
    }
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        // (`out` hands over what it staged and closes the pipe when it drops, after this.)
        self.conn
            .sender_accepted
            .store(self.accepted, Ordering::Release);
        self.conn.end_one();
        self.conn.sender_dropped.store(true, Ordering::Release);
        self.conn.gone.notify_one();
    }
}

impl SendHalf for TcpSender {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.check()?;
        match self.out.poll_ready(cx) {
            // Woken by a failure or STOP as well as by room: look again.
            Poll::Ready(()) => Poll::Ready(self.check()),
            // The waker is registered now: a failure or STOP that came before (and so woke
            // nobody) is visible here, one that comes after wakes us.
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
        self.out.stage(msg);
        self.accepted += 1;
        Ok(())
    }

    fn poll_submit(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.out.submit();
        Poll::Ready(Ok(()))
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.out.submit();
        let accepted = self.accepted;
        self.poll_until(cx, |c| c.written.load(Ordering::Acquire) >= accepted)
    }

    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.closing {
            self.closing = true;
            self.out.close();
        }
        self.poll_until(cx, |c| c.close_done.load(Ordering::Acquire))
    }
}

pub(crate) struct TcpReceiver {
    conn: Arc<Conn>,
    inp: Unbatcher,
    done: bool,
}

impl TcpReceiver {
    pub(crate) fn new(conn: Arc<Conn>) -> TcpReceiver {
        TcpReceiver {
            inp: Unbatcher::new(conn.inp.clone()),
            conn,
            done: false,
        }
    }
}

impl RecvHalf for TcpReceiver {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.inp.poll_next(cx) {
            Poll::Ready(Some(m)) => Poll::Ready(Some(Ok(m))),
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(self.conn.recv_error.get().map(|e| Err(e.duplicate())))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        // (`inp` closes the pipe when it drops, after this.)
        let left = self.inp.pipe().len() + self.inp.buffered() as u64;
        if left > 0 {
            self.conn.discarded.fetch_add(left, Ordering::Relaxed);
            self.conn.count.unread(left);
        }
        if !self.done {
            // Tell the peer to stop sending (unless the stream already ended).
            self.conn.stop_owed.store(true, Ordering::Release);
        }
        // The write loop may be waiting for this half to go (after its CLOSE).
        self.conn.out.to_consumer.wake();
        self.conn.receiver_dropped.store(true, Ordering::Release);
        self.conn.gone.notify_one();
    }
}

// ---------------------------------------------------------------------------------------
// Driver (on the I/O thread)
// ---------------------------------------------------------------------------------------

/// Sends our handshake and reads the peer's. Returns the peer's limits, what the two sides
/// do about heartbeats, and any bytes that arrived after its handshake (frames may follow
/// it immediately).
pub(crate) async fn handshake<S: Io>(
    stream: &S,
    cfg: &Config,
) -> Result<(Limits, Liveness, BytesMut)> {
    let fut = async {
        let mut ours = BytesMut::with_capacity(HANDSHAKE_LEN);
        Handshake::new(cfg.limits)
            .with_heartbeat(cfg.heartbeat)
            .encode(&mut ours);
        stream
            .write_all(vec![ours.freeze()])
            .await
            .map_err(|e| Error::io("sending the handshake", e))?;
        // Small: a peer that connects and says nothing holds this for the handshake timeout
        // (a handshake is 40 bytes; the frames after it get the large buffer).
        let mut buf = BytesMut::with_capacity(HANDSHAKE_READ);
        loop {
            match Handshake::decode(&buf) {
                Ok(Some((hs, n))) => {
                    bytes::Buf::advance(&mut buf, n);
                    let understands = hs.capabilities.contains(Capabilities::HEARTBEAT);
                    let live = Liveness::new(cfg, understands, hs.heartbeat());
                    return Ok((hs.limits, live, buf));
                }
                Ok(None) => {}
                Err(e) => {
                    let why = match buf.first() {
                        // A TLS record: handshake (22) or alert (21), version 3.x.
                        Some(22 | 21) if buf.get(1) == Some(&3) => {
                            "; the peer speaks TLS: use tls:// on both sides"
                        }
                        _ => "",
                    };
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("handshake: {e:#}{why}"),
                    ));
                }
            }
            if buf.capacity() == buf.len() {
                buf.reserve(HANDSHAKE_READ);
            }
            let spare = buf.capacity() - buf.len();
            let (res, b) = stream.read(buf, spare).await;
            buf = b;
            match res {
                Ok(0) => {
                    return Err(Error::new(
                        ErrorKind::ConnectionLost,
                        "peer closed the connection during the handshake",
                    ));
                }
                Ok(_) => {}
                Err(e) => return Err(Error::io("reading the handshake", e)),
            }
        }
    };
    match tokio::time::timeout(cfg.handshake_timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            ErrorKind::TimedOut,
            format!(
                "no handshake from the peer within {:?}",
                cfg.handshake_timeout
            ),
        )),
    }
}

/// Runs a connection until both directions are finished or it fails.
///
/// How it ends when nothing fails:
/// * the write loop sends what the Sender queued, then `CLOSE` once the Sender is closed or
///   dropped. It keeps the write side open after that until our Receiver is gone (sending the
///   `STOP` it owes, if any) or the peer has finished, then shuts it down (FIN);
/// * the read loop hands messages to the Receiver until the peer's `CLOSE`, then keeps reading
///   (only `STOP` or `ERROR` may follow) until the peer's EOF;
/// * once both user halves are gone and the write loop is done, the read loop drains what the
///   peer still sends until its EOF (for at most `linger`), so that closing the socket never
///   resets a connection whose last bytes the peer has not read yet (a reset destroys them).
pub(crate) fn drive<S: Io>(
    conn: Arc<Conn>,
    stream: S,
    src: BytesMut,
    cfg: Config,
    live: Liveness,
    peer: String,
) -> impl Future<Output = ()> {
    // Made before the future, so that dropping it unpolled (its runtime shut down before the
    // task ever ran) fails the connection too.
    let guard = FailOnDrop {
        conn: conn.clone(),
        armed: true,
    };
    run(guard, conn, stream, src, cfg, live, peer)
}

async fn run<S: Io>(
    mut guard: FailOnDrop,
    conn: Arc<Conn>,
    stream: S,
    src: BytesMut,
    cfg: Config,
    live: Liveness,
    peer: String,
) {
    let reader = async {
        let mut inp = Producer::new(conn.inp.clone());
        let read = read_loop(&conn, &mut inp, &stream, src, &cfg, &live, &peer);
        if let Err((e, tell_peer)) = read.await {
            if conn.failed() {
                // The write side failed first and said why; this is the reader stopping.
            } else if e.kind() != ErrorKind::ConnectionLost {
                tracing::warn!(peer = %peer, "closing connection: {e:#}");
            } else {
                tracing::debug!(peer = %peer, "connection lost: {e:#}");
            }
            conn.fail(e, tell_peer);
        }
        inp.close();
        conn.reader_done.store(true, Ordering::Release);
        conn.out.to_consumer.wake(); // the write loop may be waiting for the reader
    };
    let writer = async {
        let mut out = Consumer::new(conn.out.clone());
        if let Err(e) = write_loop(&conn, &mut out, &stream, &live).await {
            tracing::debug!(peer = %peer, "write side failed: {e:#}");
            conn.fail(e, false);
        }
        conn.writer_done.store(true, Ordering::Release);
        conn.inp.to_producer.wake(); // the read loop may be waiting for the writer
    };
    let both = futures_util::future::join(reader, writer);
    tokio::pin!(both);
    tokio::select! {
        biased;
        _ = &mut both => {}
        () = orphaned(&conn, cfg.linger) => {
            // Nobody uses the connection and the peer does not take what is left: stop, and
            // count what did not go out (`end_one`).
            tracing::debug!(peer = %peer, linger = ?cfg.linger, "both halves gone and the connection not finished within the linger time; closing");
            conn.fail(
                Error::new(
                    ErrorKind::TimedOut,
                    format!("both halves dropped and the connection not finished within the linger of {:?}", cfg.linger),
                ),
                false,
            );
            both.await;
        }
    }
    guard.armed = false;
    let discarded = conn.discarded.load(Ordering::Relaxed);
    if discarded > 0 {
        tracing::info!(peer = %peer, discarded, "connection ended; messages no receiver read were discarded");
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Ready `linger` after both user halves are gone.
async fn orphaned(conn: &Conn, linger: Duration) {
    loop {
        let notified = conn.gone.notified();
        if conn.sender_dropped.load(Ordering::Acquire)
            && conn.receiver_dropped.load(Ordering::Acquire)
        {
            break;
        }
        notified.await;
    }
    tokio::time::sleep(linger).await;
}

/// Fails the connection if its driver is dropped before finishing (its I/O thread or
/// runtime shut down, or it panicked), so that the user halves report it instead of waiting.
struct FailOnDrop {
    conn: Arc<Conn>,
    armed: bool,
}

impl Drop for FailOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.conn.fail(
                Error::new(
                    ErrorKind::Unavailable,
                    "the connection's driver stopped: its I/O thread or runtime shut down",
                ),
                false,
            );
        }
        self.conn.end_one();
    }
}

/// Both user halves are gone and the write loop is done.
fn local_done(c: &Conn) -> bool {
    c.inp.is_rx_closed() && c.writer_done.load(Ordering::Acquire)
}

/// Ready when the read loop must stop reading frames: the connection failed, or
/// [`local_done`].
fn poll_stop(conn: &Conn, cx: &mut Context<'_>) -> Poll<()> {
    conn.inp
        .to_producer
        .poll_until(cx, || (conn.failed() || local_done(conn)).then_some(()))
}

/// The error type of the loops: the error, and whether to tell the peer about it.
type LoopError = (Error, bool);

fn protocol(e: impl std::fmt::Display) -> LoopError {
    (Error::new(ErrorKind::Protocol, e.to_string()), true)
}

fn stopped() -> LoopError {
    (Error::new(ErrorKind::Closed, "connection closed"), false)
}

async fn read_loop<S: Io>(
    conn: &Conn,
    inp: &mut Producer,
    stream: &S,
    mut src: BytesMut,
    cfg: &Config,
    live: &Liveness,
    peer: &str,
) -> Result<(), LoopError> {
    let mut dec = Decoder::new(cfg.limits);
    let mut clock = FrameClock::new(cfg);
    // Silence is the time a read has been waiting: reads issued is the count that grows
    // when something arrives (a read completes, the next is issued). While the Receiver's
    // queue is full no read is in flight and the tick is not polled: not listening.
    let mut silence = live.silence(std::time::Instant::now());
    let mut tick = Tick::new(silence.is_some().then_some(live.tick).flatten());
    let mut reads: u64 = 0;
    let batch_max = DELIVER_MAX.min(cfg.recv_queue).max(1);
    let mut batch: Vec<Message> = Vec::new();
    let mut peer_closed = false;
    loop {
        // Hand out every complete frame, in batches.
        loop {
            let frame = dec.decode(&mut src);
            if !matches!(frame, Ok(Some(Frame::Message(_)))) || batch.len() >= batch_max {
                deliver(conn, inp, &mut batch)
                    .await
                    .map_err(|()| stopped())?;
            }
            match frame {
                Ok(Some(Frame::Message(_))) if peer_closed => {
                    return Err(protocol("the peer sent a message after its CLOSE frame"));
                }
                Ok(Some(Frame::Message(m))) => batch.push(m),
                Ok(Some(Frame::Control(Control::Close))) => {
                    // The Receiver ends here; keep reading for a STOP or the EOF.
                    peer_closed = true;
                    inp.close();
                }
                Ok(Some(Frame::Control(Control::Stop))) => {
                    conn.peer_stopped.store(true, Ordering::Release);
                    conn.out.to_producer.wake();
                }
                Ok(Some(Frame::Control(Control::Heartbeat))) => {}
                Ok(Some(Frame::Control(Control::Error(reason)))) => {
                    return Err((
                        Error::new(
                            ErrorKind::Protocol,
                            format!(
                                "the peer closed the connection: {}",
                                crate::text::escape_untrusted(&reason)
                            ),
                        ),
                        false,
                    ));
                }
                Ok(None) => break,
                Err(e) => return Err(protocol(e)),
            }
        }
        if conn.failed() {
            return Err(stopped());
        }
        if local_done(conn) {
            return drain(conn, stream, cfg).await;
        }
        let mid_frame = !dec.is_at_boundary(&src);
        if !mid_frame {
            clock.boundary();
        }
        let read = async {
            if let Some((body, missing)) = dec.body_target() {
                // A large body: read straight into its own buffer.
                let b = std::mem::take(body);
                let (res, b) = stream.read(b, missing).await;
                if let Some((body, _)) = dec.body_target() {
                    *body = b;
                }
                res
            } else {
                let want = dec.wanted(&src).max(4096);
                if src.capacity() - src.len() < want {
                    src.reserve(want.max(READ_CHUNK));
                }
                let spare = src.capacity() - src.len();
                let (res, s) = stream.read(std::mem::take(&mut src), spare).await;
                src = s;
                res
            }
        };
        let deadline = mid_frame.then(|| clock.deadline());
        let timed = async {
            match deadline {
                Some(at) => tokio::time::timeout_at(at.into(), read).await.ok(),
                None => Some(read.await),
            }
        };
        tokio::pin!(timed);
        reads += 1;
        let res = loop {
            tokio::select! {
                biased;
                // The read in flight is abandoned with its buffer: from here on only failing
                // or draining, neither of which decodes again.
                () = poll_fn(|cx| poll_stop(conn, cx)) => {
                    if conn.failed() {
                        return Err(stopped());
                    }
                    return drain(conn, stream, cfg).await;
                }
                r = &mut timed => break r,
                () = tick.next() => {
                    if let Some(s) = &mut silence
                        && let Err(silent) = s.check(std::time::Instant::now(), reads, true)
                    {
                        let who = format!("the tcp peer {peer}");
                        return Err((live.lost(&who, silent), true));
                    }
                }
            }
        };
        match res {
            None => return Err((clock.expired(), true)),
            Some(Ok(0)) if mid_frame => {
                return Err((
                    Error::new(
                        ErrorKind::ConnectionLost,
                        "peer closed the connection in the middle of a frame (truncated frame)",
                    ),
                    false,
                ));
            }
            Some(Ok(0)) if peer_closed => return Ok(()),
            Some(Ok(0)) => {
                return Err((
                    Error::new(
                        ErrorKind::ConnectionLost,
                        "peer closed the connection without closing the channel (did it exit or crash?)",
                    ),
                    false,
                ));
            }
            Some(Ok(n)) => clock.read(n),
            Some(Err(e)) => return Err((Error::io("reading from the peer", e), false)),
        }
    }
}

/// Nothing local will read or write any more: reads and discards what the peer still sends
/// until its EOF, for at most `linger`, so that the socket is not closed with unread data
/// (which makes the kernel reset the connection and can destroy what the peer has received
/// from us but not read yet).
async fn drain<S: Io>(conn: &Conn, stream: &S, cfg: &Config) -> Result<(), LoopError> {
    const CHUNK: usize = 64 << 10;
    let deadline = tokio::time::Instant::now() + cfg.linger;
    let mut buf = BytesMut::with_capacity(CHUNK);
    let mut bytes = 0usize;
    loop {
        buf.clear();
        let read = stream.read(std::mem::take(&mut buf), CHUNK);
        let res = tokio::select! {
            biased;
            () = poll_fn(|cx| poll_failed(&conn.inp.to_producer, conn, cx)) => return Ok(()),
            r = tokio::time::timeout_at(deadline, read) => r,
        };
        match res {
            Ok((Ok(n), b)) if n > 0 => {
                bytes += n;
                buf = b;
            }
            Ok(_) => return Ok(()), // EOF or an error: the peer is done either way
            Err(_) => {
                tracing::debug!(bytes, "peer still sending after the linger time; closing");
                return Ok(());
            }
        }
    }
}

/// Ready once the connection has failed; waits on `signal`, which `Conn::fail` wakes.
fn poll_failed(signal: &Signal, conn: &Conn, cx: &mut Context<'_>) -> Poll<()> {
    signal.poll_until(cx, || conn.failed().then_some(()))
}

/// Hands the decoded `batch` to the Receiver, waiting for room (which pauses reading and so
/// backpressures the peer). Counts it as discarded when the Receiver is gone. `Err` when the
/// connection failed.
async fn deliver(conn: &Conn, inp: &mut Producer, batch: &mut Vec<Message>) -> Result<(), ()> {
    if batch.is_empty() {
        return Ok(());
    }
    poll_fn(|cx| {
        if conn.failed() {
            return Poll::Ready(Err(()));
        }
        inp.poll_room(cx).map(Ok)
    })
    .await?;
    if conn.inp.is_rx_closed() {
        conn.count.unread(batch.len() as u64);
        let n = conn
            .discarded
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        if n == 0 {
            tracing::warn!(kind = %batch[0].kind(), "receiver dropped: discarding incoming messages (the peer was sent STOP)");
        }
        batch.clear();
        return Ok(());
    }
    let item = if batch.len() == 1 {
        Item::One(batch.pop().expect("one message"))
    } else {
        Item::Many(std::mem::replace(batch, Vec::with_capacity(16)))
    };
    inp.push(item).map_err(|_| ())
}

enum Work {
    Ready,
    Closed,
    Failed,
}

/// Waits until there is something for the write loop.
fn poll_work(conn: &Conn, cx: &mut Context<'_>) -> Poll<Work> {
    conn.out.to_consumer.poll_until(cx, || {
        if conn.failed() {
            Some(Work::Failed)
        } else if !conn.out.is_empty() || conn.stop_owed.load(Ordering::Acquire) {
            Some(Work::Ready)
        } else if conn.out.is_tx_closed() && conn.out.is_empty() {
            Some(Work::Closed)
        } else {
            None
        }
    })
}

enum AfterClose {
    Stop,
    Done,
    Failed,
}

/// After our `CLOSE`: waits until a `STOP` is owed, or nothing more can be (our Receiver is
/// gone, or the peer finished), or the connection failed.
fn poll_after_close(conn: &Conn, cx: &mut Context<'_>) -> Poll<AfterClose> {
    conn.out.to_consumer.poll_until(cx, || {
        if conn.failed() {
            Some(AfterClose::Failed)
        } else if conn.stop_owed.swap(false, Ordering::AcqRel) {
            Some(AfterClose::Stop)
        } else if conn.inp.is_rx_closed() || conn.reader_done.load(Ordering::Acquire) {
            Some(AfterClose::Done)
        } else {
            None
        }
    })
}

/// Writes `bufs` unless the connection fails first. `Ok(false)`: it failed; the socket is
/// shut down, which also ends a write stuck on a peer that does not read.
async fn send<S: Io>(conn: &Conn, stream: &S, bufs: Vec<bytes::Bytes>) -> Result<bool> {
    tokio::select! {
        biased;
        () = poll_fn(|cx| poll_failed(&conn.out.to_consumer, conn, cx)) => {
            let _ = stream.shutdown(Shutdown::Both);
            Ok(false)
        }
        r = stream.write_all(bufs) => r.map(|()| true).map_err(|e| {
            if e.kind() == io::ErrorKind::BrokenPipe || e.kind() == io::ErrorKind::ConnectionReset {
                Error::new(ErrorKind::ConnectionLost, "the peer closed the connection")
                    .with_source(e)
            } else {
                Error::io("writing to the peer", e)
            }
        }),
    }
}

async fn write_loop<S: Io>(
    conn: &Conn,
    out: &mut Consumer,
    stream: &S,
    live: &Liveness,
) -> Result<()> {
    let mut batch = Batch::default();
    let mut written: u64 = 0;
    // Messages popped but not yet in a batch (a popped item larger than the batch's room).
    let mut leftover = Vec::new().into_iter();
    let mut beat = Beat::new(live);
    loop {
        if leftover.len() == 0 {
            let work = tokio::select! {
                biased;
                w = poll_fn(|cx| poll_work(conn, cx)) => w,
                () = beat.tick.next() => {
                    if beat.owed() && !beat.send(conn, stream, &mut batch).await? {
                        return Ok(());
                    }
                    continue;
                }
            };
            match work {
                Work::Failed => {
                    let reason = conn
                        .notify_peer
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .take();
                    if let Some(reason) = reason {
                        // Best effort, bounded: the peer may not be reading.
                        batch.take();
                        batch.push_control(&Control::Error(reason));
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            stream.write_all(batch.take()),
                        )
                        .await;
                    }
                    return Ok(());
                }
                Work::Closed => break,
                Work::Ready => {}
            }
        }
        // Drain what is queued into one batch.
        if conn.stop_owed.swap(false, Ordering::AcqRel) {
            batch.push_control(&Control::Stop);
        }
        let room = |b: &Batch| b.chunk_count() < BATCH_MAX_IOVECS && b.bytes() < BATCH_MAX_BYTES;
        while room(&batch) {
            if let Some(m) = leftover.next() {
                batch.push_message(m);
                continue;
            }
            match out.pop() {
                Some(Item::One(m)) => batch.push_message(m),
                Some(Item::Many(v)) => leftover = v.into_iter(),
                None => break,
            }
        }
        out.notify_producer(); // room was freed
        let n = batch.messages() as u64;
        if !send(conn, stream, batch.take()).await? {
            return Ok(());
        }
        beat.wrote();
        written += n;
        conn.written.store(written, Ordering::Release);
        conn.out.to_producer.notify(); // flush progress
    }
    // Closing: CLOSE, then keep the write side open while a STOP may still be owed.
    batch.push_control(&Control::Close);
    if !send(conn, stream, batch.take()).await? {
        return Ok(());
    }
    conn.close_done.store(true, Ordering::Release);
    conn.out.to_producer.wake();
    beat.wrote();
    loop {
        // Heartbeats go on after CLOSE: the peer may still be sending to us, and must be
        // able to tell a frozen side from one that has nothing to say.
        let next = tokio::select! {
            biased;
            a = poll_fn(|cx| poll_after_close(conn, cx)) => a,
            () = beat.tick.next() => {
                if beat.owed() && !beat.send(conn, stream, &mut batch).await? {
                    return Ok(());
                }
                continue;
            }
        };
        match next {
            AfterClose::Failed => return Ok(()),
            AfterClose::Stop => {
                batch.push_control(&Control::Stop);
                if !send(conn, stream, batch.take()).await? {
                    return Ok(());
                }
                beat.wrote();
            }
            AfterClose::Done => break,
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
    Ok(())
}

/// The write loop's heartbeat: owed when nothing was written during a whole tick.
struct Beat {
    tick: Tick,
    on: bool,
    /// Something was written since the last tick.
    wrote: bool,
}

impl Beat {
    fn new(live: &Liveness) -> Beat {
        Beat {
            tick: Tick::new(live.send_every.and(live.tick)),
            on: live.send_every.is_some(),
            wrote: false,
        }
    }

    fn wrote(&mut self) {
        self.wrote = true;
    }

    /// On a tick: whether a heartbeat is owed (and the next tick starts afresh).
    fn owed(&mut self) -> bool {
        self.on && !std::mem::replace(&mut self.wrote, false)
    }

    /// Writes a `HEARTBEAT` (which counts as written: while idle, one goes out every other
    /// tick, one interval apart); `Ok(false)` when the connection failed meanwhile.
    async fn send<S: Io>(&mut self, conn: &Conn, stream: &S, batch: &mut Batch) -> Result<bool> {
        batch.push_control(&Control::Heartbeat);
        self.wrote = true;
        send(conn, stream, batch.take()).await
    }
}

/// Whether a tcp `Sender` may send: the connection's error first, then its own close, then a
/// `STOP` from the peer (both engines answer the same).
pub(super) fn sender_check(
    error: Option<Error>,
    closing: bool,
    peer_stopped: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    if let Some(e) = error {
        return Err(e);
    }
    if closing {
        return Err(Error::new(ErrorKind::Closed, "sender closed"));
    }
    if peer_stopped.load(Ordering::Acquire) {
        return Err(Error::new(
            ErrorKind::Closed,
            "the peer dropped its receiving half; nothing sent now would be read",
        ));
    }
    Ok(())
}

/// The deadline of the frame being received. Between frames a connection may be idle for
/// ever; once part of a frame is here, the rest must come at `min_frame_rate` on average
/// since then, with the stall timeout to spare: a frame of `b` bytes so far that began `t`
/// ago fails once `t > stall_timeout + b / min_frame_rate`. A peer trickling a byte now and
/// then into a large body cannot hold its buffer (a per-read timeout let it), and a slow
/// but steady link still gets all the time its bytes need.
pub(super) struct FrameClock {
    started: Option<std::time::Instant>,
    bytes: u64,
    grace: Duration,
    min_rate: u64,
}

impl FrameClock {
    pub(super) fn new(cfg: &Config) -> FrameClock {
        FrameClock {
            started: None,
            bytes: 0,
            grace: cfg.stall_timeout,
            min_rate: cfg.min_frame_rate.max(1),
        }
    }

    /// `n` bytes arrived.
    pub(super) fn read(&mut self, n: usize) {
        if self.started.is_some() {
            self.bytes += n as u64;
        }
    }

    /// No frame is in progress (a whole one was taken, or none has begun).
    pub(super) fn boundary(&mut self) {
        self.started = None;
        self.bytes = 0;
    }

    /// When the frame in progress must have come whole (it starts now if it has not).
    pub(super) fn deadline(&mut self) -> std::time::Instant {
        let started = *self.started.get_or_insert_with(std::time::Instant::now);
        let allowance = Duration::from_secs_f64(self.bytes as f64 / self.min_rate as f64);
        started + self.grace + allowance.min(Duration::from_secs(86_400))
    }

    /// The error once the deadline passed.
    pub(super) fn expired(&self) -> Error {
        let waited = self.started.map(|s| s.elapsed()).unwrap_or_default();
        Error::new(
            ErrorKind::TimedOut,
            format!(
                "peer stalled in the middle of a frame: {} bytes in {waited:.1?}, slower than \
                 the minimum of {} bytes/s after a grace of {:?} (ContextBuilder::stall_timeout, \
                 min_frame_rate)",
                self.bytes, self.min_rate, self.grace
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::task::noop_waker_ref;

    /// The interleaving a review found: the Sender's check passes, the connection fails
    /// (waking nobody yet), then the Sender waits for room. The wait must see the failure.
    #[test]
    fn a_failure_between_check_and_wait_releases_the_sender() {
        let cfg = Config {
            send_queue: 1,
            ..Config::default()
        };
        let conn = Arc::new(Conn::new(&cfg));
        let mut tx = TcpSender::new(conn.clone());
        let mut cx = Context::from_waker(noop_waker_ref());
        assert!(matches!(tx.poll_ready(&mut cx), Poll::Ready(Ok(()))));
        tx.start_send(Message::new("t").unwrap()).unwrap();
        assert!(tx.poll_submit(&mut cx).is_ready()); // the pipe (one message) is full now
        assert!(tx.check().is_ok());
        conn.fail(Error::new(ErrorKind::ConnectionLost, "gone"), false);
        assert!(
            tx.out.poll_ready(&mut cx).is_ready(),
            "the wait for room sees it"
        );
        match tx.poll_ready(&mut cx) {
            Poll::Ready(Err(e)) => assert_eq!(e.kind(), ErrorKind::ConnectionLost),
            other => panic!("expected the failure, got {other:?}"),
        }
    }
}
