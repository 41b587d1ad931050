//! The async shell: one task per connection drives the protocol core over a verbs backend,
//! and the user halves talk to it through a small shared state.
//!
//! The driver owns the [`Connection`], the receive and send buffers, the in-flight
//! operations (a `FuturesUnordered` of completions) and the rendezvous bodies the peer may
//! still read, each registered on its own for exactly its bytes until the peer's `FIN`.
//! Each wake-up it: takes completions and feeds them to the core; hands messages from the
//! `Sender` to the core while the core may queue (credits) and the bodies lent stay within
//! the registered-memory budget (a body is registered where it is: no copy); fetches announced bodies
//! into pool buffers while the pool has room; moves delivered messages to the `Receiver`
//! while its queue has room (a full queue stops reposting receives, which stops the peer's
//! credits: backpressure end to end); transmits what the core gives.
//!
//! A keepalive RDMA read of the peer's 8-byte keepalive region runs when the connection has
//! been idle for the keepalive interval: a dead peer answers no read, the read fails with
//! "transport retries exceeded", and both halves report `ConnectionLost` (a queue pair with
//! only receives posted would otherwise never notice). The region is also the peer's
//! heartbeat: its driver advances the counter there every keepalive interval while it runs.
//! A NIC answers reads for a process that is stopped or deadlocked, so a read that succeeds
//! is not enough: a counter that stands still for `heartbeat_misses` of the peer's
//! intervals (while we are idle, so probing) fails the connection as a frozen peer.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::task::AtomicWaker;

use super::pool::{Lease, Pool, PoolError};
use super::proto::{self, Connection, Params, ProtoError, ReadRequest};
use super::verbs::{Access, Region, RemoteRegion, Source, Verbs, VerbsError};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;
use crate::message::{Flags, Message};
use crate::transport::heartbeat::{self, Silence};
use crate::transport::{RecvHalf, SendHalf};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Settings of one RDMA connection.
#[derive(Clone, Debug)]
pub struct RdmaConfig {
    /// Receive buffers posted (the peer's credits). Default 64.
    pub recv_slots: u32,
    /// Bytes per receive buffer: messages up to this size (header, type, meta, body) go
    /// eagerly in one send; larger bodies by rendezvous. Default 8 KiB + 512.
    pub slot_size: u32,
    /// Registered-memory budget for bodies, per connection and per direction, so that
    /// neither direction can starve the other: bodies sent by rendezvous (each registered
    /// where it lies, for exactly its bytes, until the peer has read it; sending waits while
    /// the budget is lent out), and a pool of buffers for bodies received (registered once,
    /// reused). Default 256 MiB each.
    pub pool_bytes: u64,
    /// Messages queued between the `Sender` and the driver. Default 64.
    pub send_queue: usize,
    /// Messages delivered and not yet taken by the `Receiver`. Default 64.
    pub recv_queue: usize,
    /// Body bytes received (or being read) and not yet taken by the `Receiver`; one body is
    /// always admitted. Default 16 MiB: a receiver that keeps up then reuses a few pool
    /// buffers, which stay in the CPU's cache.
    pub recv_queue_bytes: usize,
    /// Idle time after which the peer is probed, and how often this side's heartbeat
    /// counter advances. Default 1 s.
    pub keepalive: Duration,
    /// Intervals of the peer's heartbeat counter standing still (seen by the probes) after
    /// which it is declared frozen; 0 turns the watch off (and the counter: the `HELLO`
    /// then announces none). Default 10.
    pub heartbeat_misses: u32,
    /// How long set-up waits for the peer's `HELLO` once both queue pairs are connected.
    /// Default 5 s (a context's [`handshake_timeout`](crate::ContextBuilder::handshake_timeout)).
    pub handshake_timeout: Duration,
    /// What this side accepts.
    pub limits: Limits,
    /// Device bodies (feature `cuda`) are read by the NIC from device memory registered as
    /// a dma-buf (GPUDirect RDMA) where the device exports one and the NIC's driver takes it;
    /// otherwise, or when off, they are staged through host memory. Default on. Off where
    /// the GPU and the NIC sit under different PCIe root complexes or sockets, where reading
    /// the GPU across them can be slower than staging.
    pub gpudirect: bool,
}

impl Default for RdmaConfig {
    fn default() -> RdmaConfig {
        RdmaConfig {
            recv_slots: 64,
            slot_size: 8192 + 512,
            pool_bytes: 256 << 20,
            send_queue: 64,
            recv_queue: 64,
            recv_queue_bytes: 16 << 20,
            keepalive: Duration::from_secs(1),
            heartbeat_misses: 10,
            handshake_timeout: Duration::from_secs(5),
            limits: Limits::default(),
            gpudirect: true,
        }
    }
}

impl RdmaConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        let bad = |s: String| Err(Error::new(ErrorKind::Config, s));
        if !(proto::MIN_SLOTS..=1 << 16).contains(&self.recv_slots) {
            return bad(format!(
                "rdma recv_slots is {}; use 4 to 65536",
                self.recv_slots
            ));
        }
        let need = proto::RTS_FIXED as u64 + 255 + u64::from(self.limits.max_meta_bytes);
        if u64::from(self.slot_size) < need || self.slot_size > 1 << 24 {
            return bad(format!(
                "rdma slot_size is {}; use {need} (an RTS with the largest type and metadata) to 16 MiB",
                self.slot_size
            ));
        }
        let body_class = super::pool::class_of(self.limits.max_body as usize) as u64;
        if self.pool_bytes < body_class {
            return bad(format!(
                "the rdma pool of {} bytes cannot hold one body of max_body {} ({body_class} bytes registered)",
                self.pool_bytes, self.limits.max_body
            ));
        }
        if self.send_queue == 0 || self.recv_queue == 0 {
            return bad("rdma queues must hold at least one message".into());
        }
        if self.handshake_timeout.is_zero() {
            return bad("the rdma handshake timeout must be longer than zero".into());
        }
        Ok(())
    }
}

/// State shared by the driver and the user halves.
pub(crate) struct Shared {
    st: Mutex<St>,
    driver: AtomicWaker,
    peer: String,
}

#[derive(Default)]
struct St {
    outq: VecDeque<Message>,
    inq: VecDeque<Message>,
    tx_waker: Option<Waker>,
    rx_waker: Option<Waker>,
    hello_waker: Option<Waker>,
    error: Option<Error>,
    tx_closing: bool,
    close_done: bool,
    tx_gone: bool,
    rx_gone: bool,
    peer_finished: bool,
    peer_stopped: bool,
    backlog: usize,
    peer_limits: Option<Limits>,
    exited: bool,
    /// Body bytes in `inq`.
    inq_bytes: usize,
    /// Registrations of the device bodies in `outq` (GPUDirect RDMA), in their order: the
    /// `Sender` registers each as it takes it (`takes_device`), the driver lends it.
    #[cfg(feature = "cuda")]
    device_lent: VecDeque<(Box<dyn std::any::Any + Send + Sync>, RemoteRegion)>,
    /// Where the Receiver lands bodies from device memory (host memory when `None`).
    #[cfg(feature = "cuda")]
    landing: Option<crate::device::Gpu>,
}

impl St {
    fn wake_tx(&mut self) {
        if let Some(w) = self.tx_waker.take() {
            w.wake();
        }
    }
    fn wake_rx(&mut self) {
        if let Some(w) = self.rx_waker.take() {
            w.wake();
        }
    }
}

enum Done<M> {
    Recv(std::result::Result<(M, usize), VerbsError>),
    Send(std::result::Result<M, VerbsError>),
    Read(u64, std::result::Result<M, VerbsError>),
    Keepalive(std::result::Result<M, VerbsError>),
}

type OpFuture<M> = Pin<Box<dyn Future<Output = Done<M>> + Send>>;

/// Bodies from the peer's device memory smaller than this are read into host memory (and
/// copied to the device when the Receiver takes them): device memory is allocated in whole
/// blocks (2 MiB on CUDA), and this bounds what the bodies read ahead of the Receiver take
/// there to twice what `recv_queue_bytes` counts.
#[cfg(feature = "cuda")]
const DEVICE_READ_MIN: u64 = 1 << 20;

/// Why a body cannot be read into device memory.
#[cfg(feature = "cuda")]
enum NoTarget {
    /// No device memory now (this body only).
    Memory(Error),
    /// The device does not export it, or the NIC does not register it (any body).
    Registration(Error),
}

/// Where a body being read lands.
enum Target<V: Verbs> {
    /// A buffer of the receive pool.
    Lease(Lease<V>),
    /// Device memory of ours, registered as a dma-buf (GPUDirect RDMA into the device); the
    /// registration (the read's buffer) is dropped when the read completes.
    #[cfg(feature = "cuda")]
    Device(crate::device::DeviceBody),
}

impl<V: Verbs> Target<V> {
    /// The body's length.
    fn len(&self) -> usize {
        match self {
            Target::Lease(lease) => lease.len(),
            #[cfg(feature = "cuda")]
            Target::Device(body) => body.len(),
        }
    }
}

/// A body of ours the peer may read, registered on its own until its `FIN`.
enum Held<V: Verbs> {
    /// Host memory ([`Verbs::expose`]).
    Host(#[allow(dead_code)] V::Exposed),
    /// Device memory registered as a dma-buf by the `Sender`.
    #[cfg(feature = "cuda")]
    Device(#[allow(dead_code)] Box<dyn std::any::Any + Send + Sync>),
}

/// `body`'s memory as a dma-buf that holds `body` (with `sync`, once the writes queued to it
/// are done).
#[cfg(feature = "cuda")]
fn dmabuf_of(body: &crate::device::DeviceBody, sync: bool) -> Result<super::verbs::DmaBuf> {
    let buf = body.gpu().backend().dmabuf(body.mem(), sync)?;
    Ok(super::verbs::DmaBuf {
        fd: buf.fd,
        offset: buf.offset,
        len: buf.len,
        keep: Box::new(body.clone()),
    })
}

/// `m` with its body copied from device memory to host memory.
#[cfg(feature = "cuda")]
fn device_to_host(m: Message) -> Result<Message> {
    let (kind, meta, body, header) = m.into_parts();
    let bytes = match body.as_device() {
        Some(d) => d.to_host()?,
        None => return Ok(Message::from_parts(kind, meta, body, header)),
    };
    Ok(Message::from_parts(kind, meta, bytes.into(), header))
}

/// A message whose body came from device memory, as the channel sends such a body in
/// pieces: an announcement of its length with the message's type, metadata and header
/// (and `DEVICE`, with `MORE` unless it is empty), then the body as one piece (none when
/// empty).
fn device_wire_form(m: Message) -> (Message, Option<Message>) {
    use crate::message::{Body, Header, Meta};
    let (kind, meta, body, header) = m.into_parts();
    let total = body.len() as u64;
    let more = if total > 0 { Flags::MORE } else { Flags::NONE };
    let announce = Message::from_parts(
        kind.clone(),
        meta,
        Body::from(total.to_le_bytes().to_vec()),
        Header {
            flags: header.flags.union(Flags::DEVICE).union(more),
            ..header
        },
    );
    let piece =
        (total > 0).then(|| Message::from_parts(kind, Meta::new(), body, Header::default()));
    (announce, piece)
}

/// Follows the channel's wire form of bodies staged from device memory through the messages
/// sent, in order (`staging`: inside one): true when a message with `flags` is a piece of one.
fn staged_piece(staging: &mut bool, flags: Flags) -> bool {
    let announce = flags.contains(Flags::DEVICE);
    let piece = *staging && !announce;
    *staging = (announce || piece) && flags.contains(Flags::MORE);
    piece
}

/// The connection task.
pub(crate) struct Driver<V: Verbs> {
    verbs: Arc<V>,
    conn: Connection,
    rx_pool: Pool<V>,
    sh: Arc<Shared>,
    ops: FuturesUnordered<OpFuture<V::Mr>>,
    cfg: RdmaConfig,
    send_free: Vec<V::Mr>,
    send_total: usize,
    inflight: usize,
    recv_held: VecDeque<(V::Mr, usize)>,
    /// Rendezvous bodies of ours the peer may read, each registered on its own
    /// ([`Verbs::expose`]) until its `FIN`: the key dies with the entry.
    held: HashMap<u64, (Held<V>, usize)>,
    /// Bytes in `held` (at most `pool_bytes`, but always one body).
    held_bytes: usize,
    /// Inside a body staged from device memory (the channel's wire form: an announcement
    /// with `DEVICE | MORE`, then pieces until one without `MORE`), whose pieces are buffers
    /// of the GPU's staging pool.
    staging: bool,
    reads_waiting: VecDeque<ReadRequest>,
    reading: HashMap<u64, Target<V>>,
    /// Bodies from the peer's device memory are read into device memory of ours where the
    /// Receiver lands there (off after the first refusal).
    #[cfg(feature = "cuda")]
    dmabuf_rx: bool,
    /// Body bytes of the reads posted and not yet completed.
    reading_bytes: usize,
    /// Our heartbeat: a counter at `beat_addr`, in this region, which the peer reads. Kept
    /// alive here and never borrowed again after the address is taken.
    _beat_src: V::Mr,
    beat_addr: usize,
    beat: u64,
    /// The peer's heartbeat, once its `HELLO` promised one: how long it stood still.
    silence: Option<Silence>,
    ka_buf: Option<V::Mr>,
    ka_timer: Pin<Box<tokio::time::Sleep>>,
    ka_in_flight: bool,
    /// A flush seen: the queue pair is in the error state. The failure is reported once the
    /// operation that caused it completed (so the error names it), or when nothing else is
    /// in flight.
    flushed: Option<Error>,
    active: bool,
    stopped: bool,
}

fn verbs_error(e: VerbsError, peer: &str) -> Error {
    if e.is_peer_lost() {
        Error::new(
            ErrorKind::ConnectionLost,
            format!("the RDMA peer {peer} is lost: {e:#}"),
        )
    } else {
        Error::new(ErrorKind::Io, format!("RDMA connection to {peer}: {e:#}"))
    }
}

fn proto_error(e: ProtoError, peer: &str) -> Error {
    let kind = if e.is_limit() {
        ErrorKind::LimitExceeded
    } else {
        ErrorKind::Protocol
    };
    Error::new(
        kind,
        format!("the RDMA peer {peer} broke the protocol: {e:#}"),
    )
}

impl<V: Verbs> Driver<V> {
    /// Registers the buffers, posts the receives and queues the `HELLO`. Posting happens
    /// here, before the driver runs, so that a peer's first message finds them.
    pub(crate) fn new(
        verbs: Arc<V>,
        cfg: RdmaConfig,
        peer: String,
    ) -> Result<(Driver<V>, Arc<Shared>)> {
        cfg.validate()?;
        let reg = |len: usize, access: Access| {
            verbs
                .register(len, access)
                .map_err(|e| verbs_error(e, &peer))
        };
        // 16 bytes, so that an aligned 8-byte counter fits whatever the backend's alignment.
        let mut beat_src = reg(16, Access::REMOTE_READ)?;
        let beat_off = beat_src.as_slice().as_ptr().align_offset(8);
        // The counter's address, taken once, before the region is advertised: from then on
        // it is written only through this pointer, atomically (see `beat`).
        let beat_addr = beat_src.as_mut_slice()[beat_off..beat_off + 8].as_mut_ptr() as usize;
        let ka_buf = reg(8, Access::LOCAL)?;
        let beat_ms = if cfg.heartbeat_misses > 0 {
            u32::try_from(cfg.keepalive.as_millis())
                .unwrap_or(u32::MAX)
                .max(1)
        } else {
            0
        };
        let params = Params {
            recv_slots: cfg.recv_slots,
            slot_size: cfg.slot_size,
            limits: cfg.limits,
            keepalive: beat_src.remote(beat_off, 8),
            beat_ms,
        };
        let ops = FuturesUnordered::new();
        for _ in 0..cfg.recv_slots {
            let buf = reg(cfg.slot_size as usize, Access::LOCAL)?;
            ops.push(recv_op(&*verbs, buf));
        }
        // RDMA read targets need local write access only.
        let rx_pool = Pool::new(verbs.clone(), cfg.pool_bytes, Access::LOCAL);
        let sh = Arc::new(Shared {
            st: Mutex::new(St::default()),
            driver: AtomicWaker::new(),
            peer,
        });
        let d = Driver {
            conn: Connection::new(params),
            rx_pool,
            sh: sh.clone(),
            ops,
            send_free: Vec::new(),
            send_total: 0,
            inflight: 0,
            recv_held: VecDeque::new(),
            held: HashMap::new(),
            held_bytes: 0,
            staging: false,
            reads_waiting: VecDeque::new(),
            reading: HashMap::new(),
            #[cfg(feature = "cuda")]
            dmabuf_rx: cfg.gpudirect,
            reading_bytes: 0,
            _beat_src: beat_src,
            beat_addr,
            beat: 0,
            silence: None,
            ka_buf: Some(ka_buf),
            ka_timer: Box::pin(tokio::time::sleep(cfg.keepalive)),
            ka_in_flight: false,
            flushed: None,
            active: false,
            stopped: false,
            cfg,
            verbs,
        };
        Ok((d, sh))
    }

    /// Device memory of `len` bytes on `gpu`, registered as the target of a read.
    #[cfg(feature = "cuda")]
    fn device_target(
        &self,
        gpu: &crate::device::Gpu,
        len: usize,
    ) -> std::result::Result<(crate::device::DeviceBody, V::Mr), NoTarget> {
        let body = gpu.alloc(len).map_err(NoTarget::Memory)?;
        // Fresh memory: no writes queued to wait for.
        let buf = dmabuf_of(&body, false).map_err(NoTarget::Registration)?;
        let mr = self
            .verbs
            .register_dmabuf(buf)
            .map_err(|e| NoTarget::Registration(verbs_error(e, &self.sh.peer)))?;
        Ok((body, mr))
    }

    /// Posts the read of `r` (the front of `reads_waiting`) into `mr`, which is `target`'s.
    fn start_read(&mut self, r: ReadRequest, mr: V::Mr, target: Target<V>) {
        self.reads_waiting.pop_front();
        self.reading_bytes += target.len();
        self.reading.insert(r.rid, target);
        self.inflight += 1;
        let rid = r.rid;
        let fut = self.verbs.post_read(mr, r.body);
        self.ops
            .push(Box::pin(async move { Done::Read(rid, fut.await) }));
    }

    /// `bytes` copied to memory of their own, registered for the peer to read.
    fn expose_copy(
        &self,
        bytes: &[u8],
    ) -> std::result::Result<(V::Exposed, RemoteRegion), VerbsError> {
        self.verbs
            .expose(Source::Host(Bytes::copy_from_slice(bytes)))
    }

    fn fail(&mut self, e: Error) -> Poll<()> {
        tracing::debug!(peer = %self.sh.peer, "rdma connection failed: {e:#}");
        let mut st = lock(&self.sh.st);
        if st.error.is_none() {
            st.error = Some(e);
        }
        st.exited = true;
        st.wake_tx();
        st.wake_rx();
        if let Some(w) = st.hello_waker.take() {
            w.wake();
        }
        Poll::Ready(())
    }

    /// One pass over everything; true when anything happened.
    fn step(&mut self, cx: &mut Context<'_>) -> std::result::Result<bool, Error> {
        let peer = self.sh.peer.clone();
        let mut progress = false;

        // Completions.
        while let Poll::Ready(Some(done)) = self.ops.poll_next_unpin(cx) {
            progress = true;
            // Our own probe is not traffic: it must not restart the silence it measures.
            if !matches!(done, Done::Keepalive(_)) {
                self.active = true;
            }
            // A flushed operation did not fail by itself: remember, and look for the cause.
            let flushed = match &done {
                Done::Recv(Err(e))
                | Done::Send(Err(e))
                | Done::Read(_, Err(e))
                | Done::Keepalive(Err(e))
                    if e.status == super::verbs::WcStatus::Flushed =>
                {
                    Some(e.clone())
                }
                _ => None,
            };
            if let Some(e) = flushed {
                match &done {
                    Done::Send(_) | Done::Read(..) => self.inflight -= 1,
                    Done::Keepalive(_) => self.ka_in_flight = false,
                    Done::Recv(_) => {}
                }
                if self.flushed.is_none() {
                    self.flushed = Some(verbs_error(e, &peer));
                }
                continue;
            }
            match done {
                Done::Recv(r) => {
                    let (buf, len) = r.map_err(|e| verbs_error(e, &peer))?;
                    let len = len.min(buf.len());
                    let len = proto::frame_len(&buf.as_slice()[..len]).map_or(len, |n| n.min(len));
                    self.recv_held.push_back((buf, len));
                }
                Done::Send(r) => {
                    self.inflight -= 1;
                    self.send_free.push(r.map_err(|e| verbs_error(e, &peer))?);
                }
                Done::Read(rid, r) => {
                    self.inflight -= 1;
                    let mr = r.map_err(|e| verbs_error(e, &peer))?;
                    let Some(target) = self.reading.remove(&rid) else {
                        continue;
                    };
                    self.reading_bytes = self.reading_bytes.saturating_sub(target.len());
                    let body: crate::message::Body = match target {
                        Target::Lease(mut lease) => {
                            lease.put_mr(mr);
                            Bytes::from_owner(lease).into()
                        }
                        #[cfg(feature = "cuda")]
                        Target::Device(body) => {
                            // The NIC is done writing: the registration goes first, then
                            // its writes are made visible to the device's own work.
                            drop(mr);
                            body.gpu()
                                .backend()
                                .written_by_nic(body.mem())
                                .map_err(|e| Error::new(e.kind(), format!("{e:#} ({peer})")))?;
                            body.into()
                        }
                    };
                    self.conn
                        .handle_read_done(rid, body)
                        .map_err(|e| proto_error(e, &peer))?;
                }
                Done::Keepalive(r) => {
                    self.ka_in_flight = false;
                    let buf = r.map_err(|e| verbs_error(e, &peer))?;
                    let mut v = [0u8; 8];
                    v.copy_from_slice(&buf.as_slice()[..8]);
                    self.ka_buf = Some(buf);
                    self.heard(u64::from_ne_bytes(v), true)?;
                }
            }
        }
        if self.flushed.is_some() {
            if self.inflight == 0 && !self.ka_in_flight {
                return Err(self.flushed.take().expect("checked"));
            }
            // Post nothing more; wait for the operations in flight to report.
            return Ok(progress);
        }

        // Received messages: all of them, at once. Control messages take effect now (a `FIN`
        // frees our buffers even while our Receiver is not read); messages wait in the core
        // until the Receiver's queue has room, and are acknowledged (freeing the peer's
        // credits) only then: that is the backpressure, and it bounds what waits here.
        let mut st = lock(&self.sh.st);
        while let Some((buf, len)) = self.recv_held.pop_front() {
            let r = self.conn.handle_recv(&buf.as_slice()[..len]);
            self.ops.push(recv_op(&*self.verbs, buf));
            r.map_err(|e| proto_error(e, &peer))?;
            progress = true;
            // Count announced bodies at once, so the byte bound holds within this loop.
            self.reads_waiting
                .extend(std::iter::from_fn(|| self.conn.poll_read()));
            if st.peer_limits.is_none()
                && let Some(l) = self.conn.peer_limits_for_sending()
            {
                st.peer_limits = Some(l);
                if let Some(w) = st.hello_waker.take() {
                    w.wake();
                }
            }
        }

        // The user's half-close and receiver drop.
        if st.rx_gone && !self.stopped {
            self.stopped = true;
            self.conn.stop();
            st.inq.clear();
            st.inq_bytes = 0;
            progress = true;
        }

        // Messages from the Sender.
        if self.conn.peer().is_some() {
            while self.conn.can_queue() {
                let Some(msg) = st.outq.front() else { break };
                #[cfg(feature = "cuda")]
                if msg.body().as_device().is_some() {
                    // GPUDirect: the NIC reads the body from device memory, registered by
                    // the Sender (bounded by the send queue, not by `pool_bytes`).
                    let Some((reg, region)) = st.device_lent.pop_front() else {
                        return Err(Error::new(
                            ErrorKind::Mismatch,
                            "a device body reached the RDMA driver without its registration",
                        ));
                    };
                    let msg = st.outq.pop_front().expect("front exists");
                    staged_piece(&mut self.staging, msg.header().flags);
                    let rid = self.conn.send_rendezvous(msg, region);
                    self.held
                        .insert(rid, (Held::Device(reg), region.len as usize));
                    self.held_bytes += region.len as usize;
                    progress = true;
                    st.wake_tx();
                    continue;
                }
                if self.conn.is_eager(msg) {
                    let msg = st.outq.pop_front().expect("front exists");
                    staged_piece(&mut self.staging, msg.header().flags);
                    self.conn.send_eager(msg);
                } else {
                    let len = msg.body().len();
                    if len as u64 > self.cfg.pool_bytes {
                        return Err(Error::new(
                            ErrorKind::LimitExceeded,
                            format!(
                                "a {len}-byte body exceeds the registered-memory budget of {} \
                                 bytes (pool_bytes)",
                                self.cfg.pool_bytes
                            ),
                        ));
                    }
                    if self.held_bytes > 0 && (self.held_bytes + len) as u64 > self.cfg.pool_bytes {
                        // Backpressure until the peer's FINs let go of bodies it read (their
                        // arrival runs this step again).
                        break;
                    }
                    let bytes: &[u8] = msg.body().as_bytes().map_or(&[], |b| b.as_ref());
                    let (exposed, region) = if staged_piece(&mut self.staging, msg.header().flags) {
                        // A buffer of the GPU's staging pool, which every channel on that GPU
                        // shares: copied, so that it returns at once (as on every other
                        // transport) instead of when the peer has read it.
                        self.expose_copy(bytes).map_err(|e| verbs_error(e, &peer))?
                    } else {
                        let lent = msg.body().as_bytes().cloned().unwrap_or_default();
                        match self.verbs.expose(Source::Host(lent)) {
                            Ok(x) => x,
                            Err(e) => {
                                // Memory the NIC cannot register where it lies (a special
                                // mapping): a copy in ordinary memory.
                                tracing::debug!(
                                    peer = %peer,
                                    "rdma: a body is copied, its memory cannot be registered: {e}"
                                );
                                self.expose_copy(bytes).map_err(|e| verbs_error(e, &peer))?
                            }
                        }
                    };
                    let msg = st.outq.pop_front().expect("front exists");
                    let rid = self.conn.send_rendezvous(msg, region);
                    self.held.insert(rid, (Held::Host(exposed), len));
                    self.held_bytes += len;
                }
                progress = true;
                st.wake_tx();
            }
            if st.tx_closing && st.outq.is_empty() && !self.conn.close_sent() {
                self.conn.close();
            }
        }
        drop(st);

        // Bodies to fetch, while the pool has room.
        self.reads_waiting
            .extend(std::iter::from_fn(|| self.conn.poll_read()));
        while let Some(r) = self.reads_waiting.front().copied() {
            // Read ahead of the Receiver by at most `recv_queue_bytes` (at least one body).
            let queued = lock(&self.sh.st).inq_bytes;
            if (queued > 0 || self.reading_bytes > 0)
                && queued + self.reading_bytes >= self.cfg.recv_queue_bytes
            {
                break;
            }
            #[cfg(feature = "cuda")]
            let landing = if r.device && r.body.len >= DEVICE_READ_MIN && self.dmabuf_rx {
                lock(&self.sh.st).landing.clone()
            } else {
                None
            };
            #[cfg(feature = "cuda")]
            if let Some(gpu) = &landing {
                match self.device_target(gpu, r.body.len as usize) {
                    Ok((body, mr)) => {
                        self.start_read(r, mr, Target::Device(body));
                        progress = true;
                        continue;
                    }
                    Err(NoTarget::Memory(e)) => tracing::warn!(
                        peer = %peer, bytes = r.body.len,
                        "rdma: no device memory for a body from the peer's device memory: it \
                         is read into host memory ({e:#})"
                    ),
                    Err(NoTarget::Registration(e)) => {
                        self.dmabuf_rx = false;
                        tracing::info!(
                            peer = %peer,
                            "rdma: bodies from the peer's device memory are read into host \
                             memory and copied to the device when taken: {e:#}"
                        );
                    }
                }
            }
            let lease = match self.rx_pool.try_alloc(r.body.len as usize) {
                Ok(Some(l)) => l,
                Ok(None) => {
                    self.rx_pool.notify_on_release(cx.waker());
                    break;
                }
                Err(PoolError::TooLarge { .. }) => {
                    return Err(Error::new(
                        ErrorKind::LimitExceeded,
                        format!("an RDMA body of {} bytes exceeds the pool", r.body.len),
                    ));
                }
                Err(PoolError::Register(e)) => return Err(verbs_error(e, &peer)),
            };
            let mut lease = lease;
            let mr = lease.take_mr().expect("fresh lease");
            self.start_read(r, mr, Target::Lease(lease));
            progress = true;
        }

        // Rendezvous bodies the peer is done with.
        while let Some(rid) = self.conn.poll_release() {
            // Deregistered here: from now on the peer's key for it reaches nothing.
            if let Some((_, len)) = self.held.remove(&rid) {
                self.held_bytes -= len;
            }
            progress = true;
        }

        // Transmit.
        // Never larger than ours, whatever the peer announced (see `send_slot`).
        let peer_slot = self.conn.send_slot();
        while self.conn.wants_transmit() {
            let buf = match self.send_free.pop() {
                Some(b) if b.len() >= peer_slot => b,
                _ if self.send_total < self.cfg.recv_slots as usize + 2 => {
                    self.send_total += 1;
                    self.verbs
                        .register(peer_slot.max(proto::HELLO_LEN), Access::LOCAL)
                        .map_err(|e| verbs_error(e, &peer))?
                }
                _ => break,
            };
            let mut buf = buf;
            let Some(n) = self.conn.poll_transmit(buf.as_mut_slice()) else {
                self.send_free.push(buf);
                break;
            };
            self.inflight += 1;
            let fut = self.verbs.post_send(buf, n);
            self.ops
                .push(Box::pin(async move { Done::Send(fut.await) }));
            progress = true;
        }

        // Deliver.
        let mut st = lock(&self.sh.st);
        let mut delivered = false;
        while st.inq.len() < self.cfg.recv_queue {
            let Some((m, from_device)) = self.conn.poll_delivery() else {
                break;
            };
            if self.stopped {
                continue;
            }
            if from_device && m.body().location() == crate::message::Location::Host {
                // Read into host memory: in the channel's wire form of a body from device
                // memory (an announcement, then the body as one piece), so that the
                // Receiver's channel lands it where it lands such bodies when it takes it.
                let (announce, piece) = device_wire_form(m);
                for m in std::iter::once(announce).chain(piece) {
                    st.inq_bytes += m.body().len();
                    st.inq.push_back(m);
                }
            } else {
                st.inq_bytes += m.body().len();
                st.inq.push_back(m);
            }
            delivered = true;
        }
        if delivered {
            st.wake_rx();
            progress = true;
        }
        let backlog = self.conn.queued() + st.outq.len();
        if backlog != st.backlog {
            st.backlog = backlog;
            st.wake_tx();
        }
        if self.conn.close_sent() && !st.close_done {
            st.close_done = true;
            st.wake_tx();
        }
        if self.conn.peer_finished() && !st.peer_finished {
            st.peer_finished = true;
            st.wake_rx();
        }
        if self.conn.peer_stopped() && !st.peer_stopped {
            st.peer_stopped = true;
            st.wake_tx();
        }
        Ok(progress)
    }

    /// Both directions are over and nothing of ours is in use by the peer or the NIC.
    fn finished(&self) -> bool {
        self.conn.close_sent()
            && self.conn.peer_closed()
            && (self.conn.inbox_len() == 0 || self.stopped)
            && self.conn.outstanding() == 0
            && self.conn.queued() == 0
            && self.inflight == 0
            && self.recv_held.is_empty()
            && self.reads_waiting.is_empty()
            && self.reading.is_empty()
    }

    /// The peer's heartbeat counter read `beat` (`probed`), or traffic came (not probed:
    /// the silence starts again). `Err` once the counter stood still too long.
    fn heard(&mut self, beat: u64, probed: bool) -> Result<()> {
        if self.silence.is_none()
            && self.cfg.heartbeat_misses > 0
            && let Some(p) = self.conn.peer()
            && p.beat_ms > 0
        {
            let interval = Duration::from_millis(p.beat_ms.into());
            let limit = interval.saturating_mul(self.cfg.heartbeat_misses);
            self.silence = Some(Silence::new(limit, std::time::Instant::now()));
        }
        let Some(s) = &mut self.silence else {
            return Ok(());
        };
        if let Err(silent) = s.check(std::time::Instant::now(), beat, probed) {
            let p = self.conn.peer().copied().expect("watched after HELLO");
            let who = format!("the RDMA peer {}", self.sh.peer);
            let interval = Duration::from_millis(p.beat_ms.into());
            return Err(heartbeat::lost(
                &who,
                silent,
                interval,
                self.cfg.heartbeat_misses,
            ));
        }
        Ok(())
    }

    /// Advances our heartbeat counter, where the peer reads it: every pass of the driver,
    /// so that it moves while the driver runs, busy or woken by the keepalive timer.
    fn beat(&mut self) {
        self.beat += 1;
        let ptr = self.beat_addr as *mut u64;
        // SAFETY: `ptr` is 8-byte aligned (`align_offset`) and in bounds of `_beat_src`,
        // registered memory this driver keeps for the connection's life and never borrows
        // after taking the address. The peer's NIC (or the simulation's 8-byte atomic copy)
        // reads it concurrently: the store is atomic, so a read sees the old or the new count.
        let counter = unsafe { std::sync::atomic::AtomicU64::from_ptr(ptr) };
        counter.store(self.beat, std::sync::atomic::Ordering::Relaxed);
    }

    fn keepalive(&mut self, cx: &mut Context<'_>) -> Result<()> {
        if self.ka_timer.as_mut().poll(cx).is_pending() {
            return Ok(());
        }
        let idle = !std::mem::take(&mut self.active);
        if !idle {
            // Traffic is proof of life: the silence starts again.
            self.heard(0, false)?;
        }
        if idle
            && let Some(p) = self.conn.peer().copied()
            && let Some(buf) = self.ka_buf.take()
        {
            let fut = self.verbs.post_read(buf, p.keepalive);
            self.ka_in_flight = true;
            self.ops
                .push(Box::pin(async move { Done::Keepalive(fut.await) }));
        }
        let next = tokio::time::Instant::now() + self.cfg.keepalive;
        self.ka_timer.as_mut().reset(next);
        // Register the timer's waker.
        let _ = self.ka_timer.as_mut().poll(cx);
        Ok(())
    }
}

fn recv_op<V: Verbs>(verbs: &V, buf: V::Mr) -> OpFuture<V::Mr> {
    let fut = verbs.post_recv(buf);
    Box::pin(async move { Done::Recv(fut.await) })
}

impl<V: Verbs> Future for Driver<V> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        this.sh.driver.register(cx.waker());
        loop {
            if this.cfg.heartbeat_misses > 0 {
                this.beat();
            }
            match this.step(cx) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => return this.fail(e),
            }
            if this.finished() {
                let mut st = lock(&this.sh.st);
                st.exited = true;
                st.wake_tx();
                st.wake_rx();
                return Poll::Ready(());
            }
            {
                let st = lock(&this.sh.st);
                if st.tx_gone && st.rx_gone && this.conn.peer().is_none() {
                    // Nobody will use a connection whose set-up never finished.
                    drop(st);
                    return this.fail(Error::new(ErrorKind::Closed, "the channel was dropped"));
                }
            }
            if let Err(e) = this.keepalive(cx) {
                return this.fail(e);
            }
            return Poll::Pending;
        }
    }
}

impl Shared {
    fn wake_driver(&self) {
        self.driver.wake();
    }

    /// Waits for the peer's `HELLO`; its limits.
    pub(crate) fn poll_hello(&self, cx: &mut Context<'_>) -> Poll<Result<Limits>> {
        let mut st = lock(&self.st);
        if let Some(e) = &st.error {
            return Poll::Ready(Err(e.duplicate()));
        }
        if let Some(l) = st.peer_limits {
            return Poll::Ready(Ok(l));
        }
        st.hello_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// The peer this connects to.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }
}

// ---------------------------------------------------------------------------------------
// User halves
// ---------------------------------------------------------------------------------------

pub(crate) struct RdmaSender<V: Verbs> {
    sh: Arc<Shared>,
    send_queue: usize,
    pool_bytes: u64,
    #[cfg(feature = "cuda")]
    device: DeviceSend<V>,
    #[cfg(not(feature = "cuda"))]
    _verbs: std::marker::PhantomData<V>,
}

/// What the `Sender` needs for GPUDirect RDMA: the verbs to register device bodies with,
/// and the registration of the body `takes_device` accepted, for `start_send`.
#[cfg(feature = "cuda")]
struct DeviceSend<V: Verbs> {
    verbs: Arc<V>,
    on: bool,
    prepared: Option<(Box<dyn std::any::Any + Send + Sync>, RemoteRegion)>,
}

impl<V: Verbs> RdmaSender<V> {
    pub(crate) fn new(sh: Arc<Shared>, verbs: Arc<V>, cfg: &RdmaConfig) -> RdmaSender<V> {
        #[cfg(not(feature = "cuda"))]
        let _ = verbs;
        RdmaSender {
            sh,
            send_queue: cfg.send_queue,
            pool_bytes: cfg.pool_bytes,
            #[cfg(feature = "cuda")]
            device: DeviceSend {
                verbs,
                on: cfg.gpudirect,
                prepared: None,
            },
            #[cfg(not(feature = "cuda"))]
            _verbs: std::marker::PhantomData,
        }
    }

    fn check(&self, st: &St) -> Result<()> {
        if let Some(e) = &st.error {
            return Err(e.duplicate());
        }
        if st.tx_closing {
            return Err(Error::new(ErrorKind::Closed, "sender closed"));
        }
        if st.peer_stopped {
            return Err(Error::new(
                ErrorKind::Closed,
                "the peer dropped its receiving half; nothing sent now would be read",
            ));
        }
        Ok(())
    }
}

impl<V: Verbs> SendHalf for RdmaSender<V> {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut st = lock(&self.sh.st);
        self.check(&st)?;
        if st.outq.len() < self.send_queue {
            return Poll::Ready(Ok(()));
        }
        st.tx_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn start_send(&mut self, msg: Message) -> Result<()> {
        // What `takes_device` registered goes with this message, or with the error.
        #[cfg(feature = "cuda")]
        let prepared = self.device.prepared.take();
        if msg.body().len() as u64 > self.pool_bytes {
            return Err(Error::new(
                ErrorKind::LimitExceeded,
                format!(
                    "a {}-byte body exceeds this rdma:// connection's registered-memory budget \
                     of {} bytes (ContextBuilder::rdma_pool_bytes)",
                    msg.body().len(),
                    self.pool_bytes
                ),
            )
            .with_message(msg));
        }
        let mut st = lock(&self.sh.st);
        if let Err(e) = self.check(&st) {
            return Err(e.with_message(msg));
        }
        #[cfg(feature = "cuda")]
        if msg.body().as_device().is_some() {
            let Some(reg) = prepared else {
                return Err(Error::new(
                    ErrorKind::Mismatch,
                    "a device body handed to rdma:// without takes_device",
                )
                .with_message(msg));
            };
            // One rendezvous; its RTS says the body is in device memory, so the peer may read
            // it into device memory of its own.
            st.outq.push_back(msg);
            st.device_lent.push_back(reg);
            st.backlog += 1;
            drop(st);
            self.sh.wake_driver();
            return Ok(());
        }
        st.outq.push_back(msg);
        st.backlog += 1;
        drop(st);
        self.sh.wake_driver();
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn takes_device(
        &mut self,
        body: &crate::device::DeviceBody,
    ) -> Option<crate::transport::DeviceWay> {
        let d = &mut self.device;
        d.prepared = None;
        if !d.on || body.is_empty() {
            return None;
        }
        let lent = dmabuf_of(body, true)
            .map_err(|e| e.to_string())
            .and_then(|buf| {
                d.verbs
                    .expose(Source::DmaBuf(buf))
                    .map_err(|e| e.to_string())
            });
        match lent {
            Ok((reg, region)) => {
                d.prepared = Some((Box::new(reg), region));
                Some(crate::transport::DeviceWay::GpuDirect)
            }
            Err(e) => {
                // Not tried again on this channel: what refused (the device's driver, the
                // NIC's) would refuse the next body too, after the same blocking calls.
                d.on = false;
                tracing::info!(
                    peer = %self.sh.peer,
                    "rdma: device bodies are staged through host memory, not read by the \
                     NIC from the device (GPUDirect RDMA): {e}"
                );
                None
            }
        }
    }

    fn poll_submit(&mut self, _cx: &mut Context<'_>) -> Poll<Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut st = lock(&self.sh.st);
        if let Some(e) = &st.error {
            return Poll::Ready(Err(e.duplicate()));
        }
        if st.backlog == 0 && st.outq.is_empty() {
            return Poll::Ready(Ok(()));
        }
        if st.peer_stopped {
            return Poll::Ready(Err(Error::new(
                ErrorKind::Closed,
                "the peer dropped its receiving half",
            )));
        }
        st.tx_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut st = lock(&self.sh.st);
        if !st.tx_closing {
            st.tx_closing = true;
            drop(st);
            self.sh.wake_driver();
            st = lock(&self.sh.st);
        }
        if st.close_done || st.peer_stopped {
            return Poll::Ready(Ok(()));
        }
        if let Some(e) = &st.error {
            return Poll::Ready(Err(e.duplicate()));
        }
        st.tx_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl<V: Verbs> Drop for RdmaSender<V> {
    fn drop(&mut self) {
        let mut st = lock(&self.sh.st);
        st.tx_gone = true;
        st.tx_closing = true;
        drop(st);
        self.sh.wake_driver();
    }
}

pub(crate) struct RdmaReceiver {
    sh: Arc<Shared>,
    done: bool,
}

impl RdmaReceiver {
    pub(crate) fn new(sh: Arc<Shared>) -> RdmaReceiver {
        RdmaReceiver { sh, done: false }
    }
}

impl RecvHalf for RdmaReceiver {
    #[cfg(feature = "cuda")]
    fn land_on(&mut self, gpu: Option<&crate::device::Gpu>) {
        lock(&self.sh.st).landing = gpu.cloned();
    }

    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let mut st = lock(&self.sh.st);
        if let Some(m) = st.inq.pop_front() {
            st.inq_bytes -= m.body().len();
            #[cfg(feature = "cuda")]
            let to_host = st.landing.is_none();
            drop(st);
            self.sh.wake_driver();
            #[cfg(feature = "cuda")]
            if to_host && m.body().as_device().is_some() {
                // Read into device memory before this Receiver switched to host memory.
                return Poll::Ready(Some(device_to_host(m)));
            }
            return Poll::Ready(Some(Ok(m)));
        }
        if let Some(e) = &st.error {
            self.done = true;
            return Poll::Ready(Some(Err(e.duplicate())));
        }
        if st.peer_finished {
            self.done = true;
            return Poll::Ready(None);
        }
        if st.exited {
            self.done = true;
            return Poll::Ready(Some(Err(Error::new(
                ErrorKind::ConnectionLost,
                format!("the RDMA connection to {} ended", self.sh.peer),
            ))));
        }
        st.rx_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for RdmaReceiver {
    fn drop(&mut self) {
        lock(&self.sh.st).rx_gone = true;
        self.sh.wake_driver();
    }
}

/// Builds the halves for a driver that is running.
pub(crate) fn halves<V: Verbs>(
    sh: Arc<Shared>,
    verbs: Arc<V>,
    cfg: &RdmaConfig,
) -> (Box<dyn SendHalf>, Box<dyn RecvHalf>) {
    (
        Box::new(RdmaSender::new(sh.clone(), verbs, cfg)),
        Box::new(RdmaReceiver::new(sh)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_pieces_are_told_from_other_messages() {
        let (dm, m, n) = (Flags::DEVICE.union(Flags::MORE), Flags::MORE, Flags::NONE);
        let mut staging = false;
        let mut seen = |f| staged_piece(&mut staging, f);
        // A message, a staged body of three pieces, a message, an empty device body, a
        // body sent in one piece (GPUDirect), a message.
        let flags = [n, dm, m, m, n, Flags::REQUEST, Flags::DEVICE, n, dm, n, n];
        let want = [
            false, false, true, true, true, false, false, false, false, true, false,
        ];
        let got: Vec<bool> = flags.iter().map(|&f| seen(f)).collect();
        assert_eq!(got, want);
    }
}
