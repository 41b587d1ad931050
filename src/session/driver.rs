//! The task that drives one session: numbers, keeps, writes and resends what the
//! application sends; checks, orders and acknowledges what arrives; reconnects.
//!
//! It is one future, polled by the runtime the session was made on, that owns the current
//! connection and both pipes to the application's halves. Each poll runs every step that can
//! make progress (take from the application, read, deliver, write, acknowledge, flush) until
//! none can; every step that returns `Pending` has registered the waker.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_core::Stream;
use futures_sink::Sink;
use tokio::time::Sleep;

use super::halves::{SessionReceiver, SessionSender, Shared};
use super::listener::{Attach, Registry};
use super::proto::{self, Control, Hello};
use super::{Reconnect, SessionConfig, random_u64};
use crate::channel::Channel;
use crate::error::{Error, ErrorKind, Result};
use crate::message::{Flags, Message};
use crate::transport::Endpoint;
use crate::transport::pipe::{Pipe, Stager, Unbatcher};
use crate::transport::{Config, Count, Parts, Transports};

/// Messages read from the connection in one poll before the driver lets its runtime run
/// other tasks.
const READ_BUDGET: usize = 512;

/// A message kept until the peer acknowledges it.
struct Outgoing {
    seq: u64,
    /// Stamped with `hf.seq` (the FIN is a control message).
    msg: Message,
    user: bool,
}

type Opening = Pin<Box<dyn Future<Output = Result<(Channel, bool, u64)>> + Send>>;

enum Link {
    Up(Channel),
    /// Connecting side: waiting before attempt `n`.
    Backoff(Pin<Box<Sleep>>, u32),
    /// Connecting side: attempt `n` under way.
    Connecting(Opening, u32),
    /// Listening side: waiting for the peer to come back, until the deadline.
    Waiting(Pin<Box<Sleep>>),
}

enum Role {
    Client {
        transports: Arc<Transports>,
        ep: Endpoint,
        policy: Reconnect,
    },
    Server {
        attach: Arc<Attach>,
        registry: Arc<Registry>,
    },
}

pub(crate) struct Driver {
    id: u128,
    peer: String,
    role: Role,
    cfg: SessionConfig,
    handshake_timeout: Duration,
    shared: Arc<Shared>,
    /// The application's messages to send.
    up: Unbatcher,
    /// Received messages for the application.
    down: Stager,
    down_closed: bool,
    link: Link,
    /// When the connection was last lost (for the log line on resume).
    lost_at: Option<Instant>,
    /// Sent and not acknowledged, in sequence order (contiguous numbers).
    out: VecDeque<Outgoing>,
    /// Their body bytes.
    out_bytes: u64,
    /// The last sequence number given out.
    next_seq: u64,
    /// The last sequence number written on the current connection.
    sent: u64,
    fin_queued: bool,
    fin_acked: bool,
    /// The peer dropped its receiver: sending is over.
    stopped: bool,
    /// The last sequence number accepted from the peer.
    delivered: u64,
    /// The last one in the application's queue (what acknowledgements say).
    in_app: u64,
    /// Accepted, waiting for room in the application's queue (with their numbers).
    held: VecDeque<(Option<u64>, Message)>,
    acked_sent: u64,
    peer_fin: bool,
    stop_sent: bool,
    /// Messages written since the last flush.
    dirty: bool,
    duplicates: u64,
    /// Both application halves are gone while the connection is down: how long to go on
    /// trying to deliver what is left (the context's `linger`).
    orphaned: Option<Pin<Box<Sleep>>>,
    linger: Duration,
    /// Where a session that gives up with its Sender gone counts what it drops.
    count: Count,
    finished: bool,
}

/// The application's `Channel` and the driver's ends of its pipes.
fn app_channel(raw: &Channel, cfg: &Config) -> (Parts, Unbatcher, Stager, Arc<Shared>) {
    let up = Pipe::new(cfg.send_queue, cfg.send_queue_bytes);
    let down = Pipe::new(cfg.recv_queue, cfg.recv_queue_bytes);
    let shared = Arc::new(Shared::default());
    let info = raw.info();
    let mut limits = *info.peer_limits();
    limits.max_meta_entries = limits.max_meta_entries.saturating_sub(1);
    limits.max_meta_bytes = limits.max_meta_bytes.saturating_sub(proto::SEQ_META_BYTES);
    let parts = Parts {
        tx: Box::new(SessionSender {
            out: Stager::new(up.clone()),
            shared: shared.clone(),
            submitted: 0,
            staged: 0,
            closed: false,
        }),
        rx: Box::new(SessionReceiver {
            inp: Unbatcher::new(down.clone()),
            shared: shared.clone(),
            done: false,
        }),
        transport: info.transport(),
        local: info.local_url().to_owned(),
        peer: info.peer_url().to_owned(),
        peer_limits: limits,
        peer_identity: info.peer_identity_arc(),
        keepalive: None,
        setup: crate::transport::ChannelSetup::new(cfg, true),
    };
    (parts, Unbatcher::new(up), Stager::new(down), shared)
}

/// Opens one connection of the session: connect, hello, welcome.
async fn open(
    transports: Arc<Transports>,
    ep: Endpoint,
    hello: Hello,
    timeout: Duration,
) -> Result<(Channel, bool, u64)> {
    let parts = transports.connect(&ep).await?;
    let mut ch = Channel::from_parts(parts);
    ch.send(proto::hello(hello)).await?;
    ch.flush().await?;
    let first = tokio::time::timeout(timeout, ch.recv())
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::TimedOut,
                format!(
                    "{ep}: no session welcome within {timeout:?} (does the peer listen with bind_sessions?)"
                ),
            )
        })?;
    match first {
        Some(Ok(m)) => match proto::classify(m)? {
            Control::Welcome { known, delivered } => Ok((ch, known, delivered)),
            other => Err(Error::new(
                ErrorKind::Protocol,
                format!("{ep}: expected a session welcome, got {other:?}"),
            )),
        },
        Some(Err(e)) => Err(e),
        None => Err(Error::new(
            ErrorKind::ConnectionLost,
            format!("{ep}: the peer closed the connection before welcoming the session"),
        )),
    }
}

/// [`Context::connect_with`](crate::Context::connect_with).
pub(crate) async fn connect(
    transports: Arc<Transports>,
    ep: Endpoint,
    policy: Reconnect,
) -> Result<Channel> {
    let cfg = transports.config().clone();
    let id = (u128::from(random_u64()) << 64) | u128::from(random_u64());
    let hello = Hello {
        id,
        resume: false,
        delivered: 0,
    };
    let (raw, _known, _) =
        open(transports.clone(), ep.clone(), hello, cfg.handshake_timeout).await?;
    let (app, up, down, shared) = app_channel(&raw, &cfg);
    let driver = Driver::new(
        id,
        raw,
        Role::Client {
            transports,
            ep,
            policy,
        },
        &cfg,
        up,
        down,
        shared,
    );
    tokio::spawn(driver);
    Ok(Channel::from_parts(app))
}

/// A new session on the listening side, over its first connection (welcome sent).
pub(crate) fn accept(
    id: u128,
    raw: Channel,
    cfg: &Config,
    attach: Arc<Attach>,
    registry: Arc<Registry>,
) -> Parts {
    let (app, up, down, shared) = app_channel(&raw, cfg);
    let driver = Driver::new(
        id,
        raw,
        Role::Server { attach, registry },
        cfg,
        up,
        down,
        shared,
    );
    tokio::spawn(driver);
    app
}

impl Driver {
    fn new(
        id: u128,
        raw: Channel,
        role: Role,
        cfg: &Config,
        up: Unbatcher,
        down: Stager,
        shared: Arc<Shared>,
    ) -> Driver {
        Driver {
            id,
            peer: raw.info().peer_url().to_owned(),
            role,
            cfg: cfg.session.clone(),
            handshake_timeout: cfg.handshake_timeout,
            shared,
            up,
            down,
            down_closed: false,
            link: Link::Up(raw),
            lost_at: None,
            out: VecDeque::new(),
            out_bytes: 0,
            next_seq: 0,
            sent: 0,
            fin_queued: false,
            fin_acked: false,
            stopped: false,
            delivered: 0,
            in_app: 0,
            held: VecDeque::new(),
            acked_sent: 0,
            peer_fin: false,
            stop_sent: false,
            dirty: false,
            duplicates: 0,
            orphaned: None,
            linger: cfg.linger,
            count: cfg.count.clone(),
            finished: false,
        }
    }

    fn first_unacked(&self) -> u64 {
        self.next_seq - self.out.len() as u64 + 1
    }

    /// Takes the application's messages into the window.
    fn pull_from_app(&mut self, cx: &mut Context<'_>) -> bool {
        let mut did = false;
        while !self.fin_queued
            && !self.stopped
            && self.out.len() < self.cfg.window
            && (self.out.is_empty() || self.out_bytes < self.cfg.window_bytes)
        {
            match self.up.poll_next(cx) {
                Poll::Ready(Some(msg)) => {
                    self.out_bytes += msg.body().len() as u64;
                    self.next_seq += 1;
                    let seq = self.next_seq;
                    self.out.push_back(Outgoing {
                        seq,
                        msg: proto::stamp(msg, seq),
                        user: true,
                    });
                }
                Poll::Ready(None) => {
                    self.next_seq += 1;
                    let seq = self.next_seq;
                    self.out.push_back(Outgoing {
                        seq,
                        msg: proto::fin(seq),
                        user: false,
                    });
                    self.fin_queued = true;
                }
                Poll::Pending => break,
            }
            did = true;
        }
        did
    }

    /// The peer has everything up to `seq`.
    fn on_ack(&mut self, seq: u64) -> Result<()> {
        if seq > self.next_seq {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "session protocol: {} acknowledged message {seq}, but only {} were sent",
                    self.peer, self.next_seq
                ),
            ));
        }
        let mut users = 0;
        while self.out.front().is_some_and(|o| o.seq <= seq) {
            let o = self.out.pop_front().expect("checked");
            self.out_bytes -= o.msg.body().len() as u64;
            if o.user {
                users += 1;
            } else {
                self.fin_acked = true;
                self.shared.fin_acked.store(true, Ordering::Release);
            }
        }
        self.sent = self.sent.max(seq);
        if users > 0 {
            self.shared.acked.fetch_add(users, Ordering::AcqRel);
        }
        if users > 0 || self.fin_acked {
            self.shared.progress.wake();
        }
        Ok(())
    }

    /// Accepts a numbered message from the peer (dropping one already delivered).
    fn accept_numbered(&mut self, seq: u64) -> Result<bool> {
        if seq <= self.delivered {
            self.duplicates += 1;
            return Ok(false);
        }
        if seq != self.delivered + 1 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "session protocol: {} sent message {seq} after {}",
                    self.peer, self.delivered
                ),
            ));
        }
        self.delivered = seq;
        Ok(true)
    }

    fn on_message(&mut self, msg: Message, cx: &mut Context<'_>) -> Result<()> {
        match proto::classify(msg)? {
            Control::Data(seq, msg) => {
                if self.accept_numbered(seq)? && !self.stop_sent {
                    self.hand_to_app(Some(seq), msg, cx);
                }
            }
            Control::Fin(seq) => {
                if self.accept_numbered(seq)? {
                    self.peer_fin = true;
                    if self.held.is_empty() {
                        self.in_app = seq;
                    } else {
                        // Counted as delivered once what precedes it is.
                        self.held.push_back((Some(seq), fin_marker()));
                    }
                }
            }
            Control::Ack(seq) => self.on_ack(seq)?,
            Control::Stop => self.on_stop(),
            other => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("session protocol: {} sent {other:?} mid-session", self.peer),
                ));
            }
        }
        Ok(())
    }

    /// Stages `msg` in the application's queue, or holds it while that is full.
    fn hand_to_app(&mut self, seq: Option<u64>, msg: Message, cx: &mut Context<'_>) {
        if self.down.pipe().is_rx_closed() {
            return; // the application dropped its receiver; the peer is told (STOP)
        }
        if self.held.is_empty() && self.down.poll_ready(cx).is_ready() {
            self.down.stage(msg);
            if let Some(s) = seq {
                self.in_app = s;
            }
        } else {
            self.held.push_back((seq, msg));
        }
    }

    /// The peer dropped its receiver: what it has not acknowledged goes back to the
    /// application, and sending ends.
    fn on_stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let unacked = self.take_unacked_out();
        let n = unacked.len();
        self.shared.fail_send(
            Error::new(
                ErrorKind::Closed,
                format!(
                    "{} dropped its receiving half; {n} messages it had not acknowledged are in take_unacknowledged",
                    self.peer
                ),
            ),
            unacked,
        );
        // After the error is in place: the application's sender reads it once it sees this.
        self.up.close();
    }

    /// Every message not acknowledged, unnumbered, in order: the window, then what the
    /// application handed over after it.
    fn take_unacked_out(&mut self) -> Vec<Message> {
        self.out_bytes = 0;
        let mut v: Vec<Message> = self
            .out
            .drain(..)
            .filter(|o| o.user)
            .map(|o| proto::unstamp(o.msg))
            .collect();
        self.sent = self.next_seq;
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        while let Poll::Ready(Some(m)) = self.up.poll_next(&mut cx) {
            v.push(m);
        }
        v
    }

    /// Hands held messages to the application's queue, and ends it after the peer's FIN.
    fn deliver(&mut self, cx: &mut Context<'_>) -> bool {
        let mut did = false;
        if self.down.pipe().is_rx_closed() {
            did = !self.held.is_empty();
            self.held.clear();
        }
        while let Some((seq, msg)) = self.held.front() {
            let (seq, fin) = (*seq, is_fin_marker(msg));
            if !fin && self.down.poll_ready(cx).is_pending() {
                break;
            }
            let (_, msg) = self.held.pop_front().expect("checked");
            if !fin {
                self.down.stage(msg);
            }
            if let Some(s) = seq {
                self.in_app = s;
            }
            did = true;
        }
        self.down.submit();
        if self.peer_fin && self.held.is_empty() && !self.down_closed {
            self.down.close();
            self.down_closed = true;
            did = true;
        }
        did
    }

    fn conn(&mut self) -> &mut Channel {
        match &mut self.link {
            Link::Up(conn) => conn,
            _ => unreachable!("called while connected"),
        }
    }

    /// Reads, writes, acknowledges and flushes on the current connection. `Ok(false)` when
    /// the read budget ran out (poll again soon).
    fn poll_conn(&mut self, cx: &mut Context<'_>, did: &mut bool) -> Result<bool> {
        // Read while nothing waits for room in the application's queue.
        let mut idle = false;
        let mut read = 0;
        while self.held.is_empty() {
            if read == READ_BUDGET {
                break;
            }
            match Pin::new(&mut self.conn().halves_mut().1).poll_next(cx) {
                Poll::Ready(Some(Ok(m))) => self.on_message(m, cx)?,
                Poll::Ready(Some(Err(e))) => return Err(e),
                Poll::Ready(None) => {
                    return Err(Error::new(
                        ErrorKind::ConnectionLost,
                        format!("{} closed the connection in mid-session", self.peer),
                    ));
                }
                Poll::Pending => {
                    idle = true;
                    break;
                }
            }
            read += 1;
            *did = true;
        }
        *did |= self.deliver(cx);
        // Write what this connection has not carried yet.
        let first = self.first_unacked();
        while self.sent < self.next_seq {
            let idx = (self.sent + 1 - first) as usize;
            let msg = self.out[idx].msg.clone();
            if !self.write(cx, msg)? {
                break;
            }
            self.sent += 1;
            *did = true;
        }
        // Acknowledge: enough owed, or reading stopped (nothing more now, or the
        // application's queue is full), the peer's FIN, or for free beside data written.
        let owed = self.in_app - self.acked_sent;
        let stalled = idle || !self.held.is_empty();
        if owed > 0 && (owed >= self.cfg.ack_every || stalled || self.dirty || self.peer_fin) {
            let upto = self.in_app;
            if self.write(cx, proto::ack(upto))? {
                self.acked_sent = upto;
                *did = true;
            }
        }
        // The application dropped its receiver: tell the peer to stop sending.
        if self.down.pipe().is_rx_closed()
            && !self.stop_sent
            && !self.down_closed
            && self.write(cx, proto::stop())?
        {
            self.stop_sent = true;
            self.held.clear();
            *did = true;
        }
        if self.dirty {
            match Pin::new(&mut self.conn().halves_mut().0).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.dirty = false,
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => {}
            }
        }
        Ok(read < READ_BUDGET)
    }

    /// Writes `msg` if the connection has room now (`false`: it has not; the waker is
    /// registered).
    fn write(&mut self, cx: &mut Context<'_>, msg: Message) -> Result<bool> {
        let tx = &mut self.conn().halves_mut().0;
        match Pin::new(&mut *tx).poll_ready(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => return Ok(false),
        }
        Pin::new(&mut *tx).start_send(msg)?;
        self.dirty = true;
        Ok(true)
    }

    /// The connection broke: reconnect (connecting side) or wait for the peer (listening
    /// side).
    fn lost(&mut self, err: Error) {
        self.dirty = false;
        self.sent = self.first_unacked() - 1;
        self.lost_at = Some(Instant::now());
        match &self.role {
            Role::Client { policy, .. } => {
                if policy.allows(1) {
                    tracing::warn!(
                        session = %format_args!("{:032x}", self.id),
                        "session with {}: {err:#}; reconnecting ({} messages to resend)",
                        self.peer,
                        self.out.len()
                    );
                    self.link = Link::Backoff(
                        Box::pin(tokio::time::sleep(policy.delay(1, random_unit()))),
                        1,
                    );
                } else {
                    self.give_up(format_args!("lost ({err:#}); no reconnect"));
                }
            }
            Role::Server { .. } => {
                tracing::warn!(
                    session = %format_args!("{:032x}", self.id),
                    "session with {}: {err:#}; waiting {:?} for it to reconnect",
                    self.peer,
                    self.cfg.resume_within
                );
                self.link = Link::Waiting(Box::pin(tokio::time::sleep(self.cfg.resume_within)));
            }
        }
    }

    /// The connection is gone for good (`why`): both halves fail with `ConnectionLost`,
    /// saying how many messages wait in `take_unacknowledged`.
    fn give_up(&mut self, why: std::fmt::Arguments<'_>) {
        let left = self.out.iter().filter(|o| o.user).count();
        let err = Error::new(
            ErrorKind::ConnectionLost,
            format!(
                "session with {}: {why}; {left} messages not acknowledged are in take_unacknowledged",
                self.peer
            ),
        );
        self.fail(err);
    }

    /// The session is over: both halves fail with `err`, and every message not
    /// acknowledged goes back to the application.
    fn fail(&mut self, err: Error) {
        let unacked = self.take_unacked_out();
        if self.up.pipe().is_tx_closed() {
            // Nobody can take them back: they are lost, and counted.
            self.count.session_unsent(unacked.len() as u64);
        }
        self.held.clear();
        self.shared.fail(err, unacked);
        self.up.close();
        self.down.close();
        self.down_closed = true;
        self.finish();
    }

    fn finish(&mut self) {
        self.finished = true;
        if let Role::Server { registry, .. } = &self.role {
            registry.remove(self.id);
        }
        if self.duplicates > 0 {
            tracing::debug!(
                duplicates = self.duplicates,
                "session with {}: dropped messages delivered before",
                self.peer
            );
        }
    }

    /// Resumes on `conn`: the peer has everything up to `peer_delivered`.
    fn resumed(&mut self, conn: Channel, peer_delivered: u64) -> Result<()> {
        self.on_ack(peer_delivered)?;
        self.sent = self.first_unacked() - 1;
        self.acked_sent = self.in_app;
        if let Some(at) = self.lost_at.take() {
            tracing::info!(
                session = %format_args!("{:032x}", self.id),
                "session with {} resumed after {:?}; resending {} messages",
                self.peer,
                at.elapsed(),
                self.next_seq - self.sent
            );
        }
        self.link = Link::Up(conn);
        Ok(())
    }

    /// The listening side lost the session (it restarted): number what is left from 1, and
    /// tell the application which requests go again.
    fn reset(&mut self) {
        let mut requests = Vec::new();
        for (i, o) in self.out.iter_mut().enumerate() {
            o.seq = i as u64 + 1;
            let msg = proto::unstamp(std::mem::replace(&mut o.msg, proto::stop()));
            if o.user && msg.header().flags.contains(Flags::REQUEST) {
                requests.push(msg.header().correlation);
            }
            o.msg = if o.user {
                proto::stamp(msg, o.seq)
            } else {
                proto::fin(o.seq)
            };
        }
        self.next_seq = self.out.len() as u64;
        self.sent = 0;
        self.delivered = 0;
        self.in_app = 0;
        self.acked_sent = 0;
        self.peer_fin = false;
        for (seq, _) in self.held.iter_mut() {
            *seq = None;
        }
        tracing::warn!(
            session = %format_args!("{:032x}", self.id),
            "{} no longer knows this session (it restarted?): resending {} messages; {} requests go again",
            self.peer,
            self.out.len(),
            requests.len()
        );
        self.held
            .push_back((None, proto::reset(&self.peer, &requests)));
    }

    /// Connecting, backing off, waiting for the peer.
    fn poll_link(&mut self, cx: &mut Context<'_>) -> bool {
        match &mut self.link {
            Link::Up(_) => false,
            Link::Backoff(sleep, n) => {
                if sleep.as_mut().poll(cx).is_pending() {
                    return false;
                }
                let n = *n;
                let Role::Client { transports, ep, .. } = &self.role else {
                    unreachable!("only the connecting side backs off")
                };
                let hello = Hello {
                    id: self.id,
                    resume: true,
                    delivered: self.in_app,
                };
                let fut = open(
                    transports.clone(),
                    ep.clone(),
                    hello,
                    self.handshake_timeout,
                );
                self.link = Link::Connecting(Box::pin(fut), n);
                true
            }
            Link::Connecting(fut, n) => {
                let n = *n;
                match fut.as_mut().poll(cx) {
                    Poll::Pending => false,
                    Poll::Ready(Ok((conn, known, peer_delivered))) => {
                        if !known {
                            self.reset();
                        }
                        if let Err(e) = self.resumed(conn, if known { peer_delivered } else { 0 }) {
                            self.fail(e);
                        }
                        true
                    }
                    Poll::Ready(Err(e)) => {
                        let Role::Client { policy, .. } = &self.role else {
                            unreachable!("only the connecting side connects")
                        };
                        if policy.allows(n + 1) {
                            tracing::debug!(
                                "session with {}: attempt {n} failed: {e:#}",
                                self.peer
                            );
                            let d = policy.delay(n + 1, random_unit());
                            self.link = Link::Backoff(Box::pin(tokio::time::sleep(d)), n + 1);
                        } else {
                            self.give_up(format_args!(
                                "gave up after {n} attempts to reconnect ({e:#})"
                            ));
                        }
                        true
                    }
                }
            }
            Link::Waiting(deadline) => {
                if deadline.as_mut().poll(cx).is_pending() {
                    return false;
                }
                let within = self.cfg.resume_within;
                self.give_up(format_args!("the peer did not reconnect within {within:?}"));
                true
            }
        }
    }

    /// Listening side: a new connection of this session.
    fn poll_attach(&mut self, cx: &mut Context<'_>) -> bool {
        let Role::Server { attach, .. } = &self.role else {
            return false;
        };
        let Some((mut conn, hello)) = attach.take(cx) else {
            return false;
        };
        if hello.delivered > self.next_seq {
            tracing::warn!(
                "session with {}: a reconnect claimed message {} of {}; refused",
                self.peer,
                hello.delivered,
                self.next_seq
            );
            return true;
        }
        // The reply goes first on the new connection, which has room for one message.
        if let Err(e) = conn
            .halves_mut()
            .0
            .try_send(proto::welcome(true, self.in_app))
        {
            tracing::debug!("session with {}: welcome not sent: {e:#}", self.peer);
            return true;
        }
        self.dirty = true;
        if let Err(e) = self.resumed(conn, hello.delivered) {
            self.fail(e);
        }
        true
    }

    /// Nobody is left to report to (both application halves dropped) and the connection is
    /// down: try for `linger`, then give up, saying what is lost. True when it gave up.
    fn poll_orphaned(&mut self, cx: &mut Context<'_>) -> bool {
        let gone = self.up.pipe().is_tx_closed() && self.down.pipe().is_rx_closed();
        if !gone || matches!(self.link, Link::Up(_)) {
            self.orphaned = None;
            return false;
        }
        let linger = self.linger;
        let timer = self
            .orphaned
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(linger)));
        if timer.as_mut().poll(cx).is_pending() {
            return false;
        }
        let left = self.out.iter().filter(|o| o.user).count();
        tracing::warn!(
            session = %format_args!("{:032x}", self.id),
            "session with {}: both halves dropped and no connection for {linger:?}: {left} messages not acknowledged are dropped",
            self.peer
        );
        self.fail(Error::new(ErrorKind::Closed, "session abandoned"));
        true
    }

    /// Both directions are finished: our FIN acknowledged (or the peer stopped us), the
    /// peer's FIN delivered (or we stopped it), and nothing left to write.
    fn done(&self) -> bool {
        (self.fin_acked || self.stopped)
            && ((self.peer_fin && self.down_closed) || self.stop_sent)
            && !self.dirty
    }
}

fn random_unit() -> f64 {
    (random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Stands in `held` for the peer's FIN (ends the application's queue after what precedes).
fn fin_marker() -> Message {
    proto::fin(0)
}

fn is_fin_marker(msg: &Message) -> bool {
    msg.kind() == proto::FIN
}

impl Future for Driver {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        loop {
            if this.finished {
                return Poll::Ready(());
            }
            let mut did = this.poll_attach(cx);
            did |= this.poll_link(cx);
            if this.finished {
                return Poll::Ready(());
            }
            if this.poll_orphaned(cx) {
                return Poll::Ready(());
            }
            did |= this.pull_from_app(cx);
            if matches!(this.link, Link::Up(_)) {
                match this.poll_conn(cx, &mut did) {
                    Ok(true) => {}
                    Ok(false) => {
                        // Let the runtime run other tasks; come back at once.
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    Err(e) => {
                        this.lost(e);
                        did = true;
                    }
                }
            } else {
                did |= this.deliver(cx);
            }
            if this.done() {
                // Dropping the connection closes it; the peer is done too (it has our
                // acknowledgement of its FIN, or our STOP).
                this.finish();
                return Poll::Ready(());
            }
            if !did {
                return Poll::Pending;
            }
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if !self.finished {
            // The runtime shut down under the session: say so on both halves.
            self.shared.fail(
                Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "session with {}: the runtime that drove it shut down",
                        self.peer
                    ),
                ),
                Vec::new(),
            );
            if let Role::Server { registry, .. } = &self.role {
                registry.remove(self.id);
            }
        }
    }
}
