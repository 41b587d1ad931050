//! The halves of a shared-memory connection. The `Sender` is the producer of its direction
//! and writes straight into the segment; the `Receiver` is the consumer of the other and
//! reads straight out of it: no I/O thread, no copy beyond the one into the arena (none for
//! bodies allocated in place), no system call per message under load.
//!
//! Waiting: a side that finds no data (Receiver) or no room (Sender) spins briefly, then
//! announces it sleeps and parks on its end of a wake socket pair through tokio's `AsyncFd`;
//! the other side sends a byte there only when the flag is up. `busy_poll` never parks. Wakes
//! from this process (a lease released, the peer gone, an external body arrived) go through
//! `AtomicWaker`s. A watcher task reads the rendezvous socket: memfds of external bodies
//! arrive there (checked and mapped on arrival, at most [`MAX_EXTERNAL`] at a time), and its
//! EOF means the peer process is gone.
//!
//! What the peer can do to us: write any byte of the segment at any time, and send anything
//! on the sockets. Every descriptor is copied out with atomic loads and checked
//! (`desc::check`) before anything is read through it; heads are copied out with atomic loads
//! before they are parsed; our allocator keeps its own references in process memory
//! (`arena::Hold`); our wake-ups cannot block (`MSG_DONTWAIT` on our own end of the socket
//! pairs). Bodies are zero-copy views of the arena only when `zero_copy` (the peer is trusted
//! not to write blocks it handed over); otherwise they are copied out on receive and
//! `Sender::alloc` lends heap memory.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{RecvFlags, SendFlags};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;

use super::arena::{self, ArenaProducer, BlockRefs, Hold};
use super::desc::{self, BodyPlace, Bounds, Desc, HeadPlace, Layout, Part};
use super::rendezvous::{self, ExtRecord};
use super::ring::{self, RingStore};
use super::segment::{Mapping, Segment, ShmArena, ShmRing};
use crate::error::{Error, ErrorKind, Result};
use crate::message::{Body, BodyMut, Header, LeaseTag, LentMut, Message};
use crate::message::{Limits, TypeCache};
use crate::transport::heartbeat::{Liveness, Tick};
use crate::transport::{Count, RecvHalf, SPIN, SendHalf, spin_until};

/// Bodies up to this size are copied out of the arena on receive (and their block freed at
/// once): cheaper than a lease, and it keeps small messages from pinning the arena.
const COPY_MAX: u64 = 1024;
/// Descriptors read before their slots are handed back to the producer (sooner when the ring
/// runs empty).
const BATCH: u64 = 64;
/// Descriptors written before the producer checks whether the consumer sleeps (it always
/// does before it waits or returns from a send).
const PUBLISH_EVERY: u64 = 64;
/// Small received parts (inline bodies, metadata) are copied into chunks of this size, one
/// allocation per chunk instead of one per part.
const CHUNK: usize = 16 << 10;
/// How long a sender with two large bodies in flight waits for one to come back before it
/// takes colder memory for a third (see `ArenaProducer::deep`): a body filled in memory the
/// receiver just read is read again from the caches, at several times memory speed.
const HOT_WAIT: Duration = Duration::from_micros(300);
/// External bodies (memfds) in flight per direction: sent and not yet released by the
/// receiver. The receiver fails a peer that sends more.
pub(crate) const MAX_EXTERNAL: u64 = 8;
/// Wake-up messages drained per wake (a flooding peer cannot keep us draining).
const WAKE_DRAIN: usize = 16;
/// Lease tags of shm arenas carry this bit, so they never match another transport's.
const REGION_SHM: u64 = 1 << 63;

/// What both halves (and the leases they hand out) share.
pub(crate) struct Shared {
    seg: Arc<Segment>,
    out_dir: usize,
    in_dir: usize,
    /// Our end of the data pair: our Receiver parks on it; our Sender wakes the peer's
    /// Receiver through it.
    data: AsyncFd<OwnedFd>,
    /// Our end of the space pair: our Sender parks on it; our Receiver (and its leases) wake
    /// the peer's Sender through it.
    space: AsyncFd<OwnedFd>,
    /// Wakes our Receiver from this process.
    rx_waker: AtomicWaker,
    /// Wakes our Sender from this process.
    tx_waker: AtomicWaker,
    uds: UnixStream,
    peer_gone: AtomicBool,
    /// Set when this side failed the connection for a protocol violation.
    fault: OnceLock<String>,
    /// Set when this side declared the peer lost: it stopped beating.
    silent: OnceLock<Error>,
    live: Liveness,
    external: Mutex<ExternalIn>,
    halves: AtomicU32,
    done: tokio::sync::Notify,
    busy_poll: bool,
    zero_copy: bool,
    max_body: u64,
    peer: String,
}

/// External bodies received: mapped, waiting for their descriptors.
#[derive(Default)]
struct ExternalIn {
    queue: VecDeque<(u64, Mapping)>,
    /// The sequence number the next one must carry.
    next_seq: u64,
    /// Received and not yet released (queued or held by the application).
    outstanding: u64,
}

/// How a connection's shared state is set up.
pub(crate) struct Setup {
    pub(crate) seg: Arc<Segment>,
    /// 0 for the listener.
    pub(crate) out_dir: usize,
    /// Our ends of the data and space wake pairs.
    pub(crate) data: OwnedFd,
    pub(crate) space: OwnedFd,
    pub(crate) uds: UnixStream,
    pub(crate) busy_poll: bool,
    pub(crate) zero_copy: bool,
    pub(crate) limits: Limits,
    /// Heartbeats, as both hellos settled them.
    pub(crate) live: Liveness,
    pub(crate) peer: String,
}

/// Wakes the peer through our end of a wake pair: never blocks. A full queue means a wake-up
/// is pending anyway; a closed peer is the watcher's to report.
fn wake(fd: &AsyncFd<OwnedFd>) {
    let _ = rustix::net::send(
        fd.get_ref(),
        &[1],
        SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
    );
}

impl Shared {
    /// Builds the halves' shared state. Registers the wake sockets with the current tokio
    /// runtime and starts the watcher on it.
    pub(crate) fn start(s: Setup) -> Result<Arc<Shared>> {
        let register = |fd: OwnedFd| {
            // SAFETY: an `OwnedFd` is a valid open descriptor that it never replaces, and it
            // stays inside the `AsyncFd` (never taken out) until the `AsyncFd` drops.
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| Error::io("registering a wake socket", e.into()))
        };
        let sh = Arc::new(Shared {
            out_dir: s.out_dir,
            in_dir: 1 - s.out_dir,
            seg: s.seg,
            data: register(s.data)?,
            space: register(s.space)?,
            rx_waker: AtomicWaker::new(),
            tx_waker: AtomicWaker::new(),
            uds: s.uds,
            peer_gone: AtomicBool::new(false),
            fault: OnceLock::new(),
            silent: OnceLock::new(),
            live: s.live,
            external: Mutex::new(ExternalIn::default()),
            halves: AtomicU32::new(2),
            done: tokio::sync::Notify::new(),
            busy_poll: s.busy_poll,
            zero_copy: s.zero_copy,
            max_body: s.limits.max_body,
            peer: s.peer,
        });
        tokio::spawn(watch(sh.clone()));
        Ok(sh)
    }

    fn out_ring(&self) -> ShmRing {
        self.seg.ring(self.out_dir)
    }

    fn in_ring(&self) -> ShmRing {
        self.seg.ring(self.in_dir)
    }

    fn gone(&self) -> bool {
        self.peer_gone.load(Ordering::Acquire)
    }

    /// The peer is gone (or failed): both halves are woken to report it.
    fn mark_gone(&self) {
        self.peer_gone.store(true, Ordering::Release);
        self.rx_waker.wake();
        self.tx_waker.wake();
    }

    /// Fails the connection for a protocol violation: the peer sees our end of the socket
    /// close, our halves report `why`.
    fn fail(&self, why: String) {
        tracing::warn!(peer = %self.peer, "closing shared-memory channel: {why}");
        let _ = self.fault.set(why);
        let _ = rustix::net::shutdown(&self.uds, rustix::net::Shutdown::Both);
        self.mark_gone();
    }

    /// The error a half reports once the peer is gone.
    fn gone_error(&self, what: &str) -> Error {
        if let Some(e) = self.silent.get() {
            return e.duplicate();
        }
        match self.fault.get() {
            Some(why) => corrupt(why),
            None => Error::new(
                ErrorKind::ConnectionLost,
                format!(
                    "the shared-memory peer {} {what} (did it exit or crash?)",
                    self.peer
                ),
            ),
        }
    }

    fn lock_external(&self) -> std::sync::MutexGuard<'_, ExternalIn> {
        self.external.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The peer's Sender may wait for room in our incoming direction.
    fn wake_peer_sender(&self) {
        if ring::wake_needed(&self.in_ring().control().producer_sleeping) {
            wake(&self.space);
        }
    }

    /// Checks and maps an external body announced on the socket.
    fn accept_external(&self, record: &[u8; ExtRecord::LEN], fd: Option<OwnedFd>) -> Result<()> {
        let rec = ExtRecord::decode(record)
            .ok_or_else(|| corrupt("malformed record on the rendezvous socket"))?;
        let fd = fd.ok_or_else(|| corrupt("an external-body record without its memfd"))?;
        let mut ext = self.lock_external();
        if ext.outstanding >= MAX_EXTERNAL {
            return Err(corrupt(format!(
                "more than {MAX_EXTERNAL} external bodies in flight"
            )));
        }
        if rec.seq != ext.next_seq {
            return Err(corrupt(format!(
                "external body {} where {} was expected",
                rec.seq, ext.next_seq
            )));
        }
        if rec.len == 0 || rec.len > self.max_body {
            return Err(corrupt(format!(
                "external body of {} bytes (max_body {})",
                rec.len, self.max_body
            )));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| corrupt("external body is not a memfd"))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE) {
            return Err(corrupt("external body memfd is not sealed"));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| Error::io("inspecting an external body", e.into()))?
            .st_size as u64;
        if size != rec.len {
            return Err(corrupt(format!(
                "external body is {size} bytes, announced {}",
                rec.len
            )));
        }
        let map = Mapping::new(&fd, rec.len, false)
            .map_err(|e| Error::io("mapping an external body", e))?;
        ext.queue.push_back((rec.seq, map));
        ext.next_seq += 1;
        ext.outstanding += 1;
        Ok(())
    }
}

/// Reads the rendezvous socket: external bodies' memfds, and EOF (the peer process is gone).
/// Beats our heartbeat counter in the segment and watches the peer's: a peer process that is
/// alive but not running (stopped, deadlocked, its runtime blocked) keeps its socket open and
/// its memory mapped, and is found only by its counter standing still.
async fn watch(sh: Arc<Shared>) {
    let mut record = [0u8; ExtRecord::LEN];
    let mut got = 0;
    let mut fds = Vec::new();
    let mut tick = Tick::new(sh.live.active().then_some(sh.live.tick).flatten());
    let mut silence = sh.live.silence(std::time::Instant::now());
    loop {
        tokio::select! {
            () = sh.done.notified() => return,
            r = sh.uds.readable() => if r.is_err() { break },
            () = tick.next() => {
                if sh.live.send_every.is_some() {
                    sh.out_ring().control().beat.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(s) = &mut silence {
                    let beat = sh.in_ring().control().beat.load(Ordering::Relaxed);
                    if let Err(silent) = s.check(std::time::Instant::now(), beat, true) {
                        let who = format!("the shared-memory peer {}", sh.peer);
                        let e = sh.live.lost(&who, silent);
                        tracing::warn!(peer = %sh.peer, "closing shared-memory channel: {e:#}");
                        let _ = sh.silent.set(e);
                        let _ = rustix::net::shutdown(&sh.uds, rustix::net::Shutdown::Both);
                        break;
                    }
                }
                continue;
            }
        }
        // At most one descriptor per record: the kernel closes any more that come along.
        let room = usize::from(fds.is_empty());
        let res = sh.uds.try_io(Interest::READABLE, || {
            rendezvous::recv_once(sh.uds.as_fd(), &mut record[got..], &mut fds, room)
                .map_err(Into::into)
        });
        match res {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                if got == ExtRecord::LEN {
                    got = 0;
                    if let Err(e) = sh.accept_external(&record, fds.pop()) {
                        sh.fail(e.to_string());
                        return;
                    }
                    sh.rx_waker.wake();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
    }
    sh.mark_gone();
}

/// Waits for a wake-up on one of our wake sockets: Ready once one came (drained). A closed
/// peer end means the peer is gone.
fn poll_wake(sh: &Shared, fd: &AsyncFd<OwnedFd>, cx: &mut Context<'_>) -> Poll<Result<()>> {
    match fd.poll_read_ready(cx) {
        Poll::Ready(Ok(mut guard)) => {
            let mut buf = [0u8; 8];
            for _ in 0..WAKE_DRAIN {
                match rustix::net::recv(fd.get_ref(), &mut buf[..], RecvFlags::DONTWAIT) {
                    Ok((0, _)) => {
                        sh.mark_gone();
                        break;
                    }
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(rustix::io::Errno::AGAIN) => {
                        guard.clear_ready();
                        break;
                    }
                    Err(_) => {
                        sh.mark_gone();
                        break;
                    }
                }
            }
            // The caller looks again; a spurious wake-up is harmless.
            Poll::Ready(Ok(()))
        }
        Poll::Ready(Err(e)) => Poll::Ready(Err(Error::io("waiting on a wake socket", e))),
        Poll::Pending => Poll::Pending,
    }
}

fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("the shared-memory peer broke the protocol: {what}"),
    )
}

// ---------------------------------------------------------------------------------------
// Sender
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NoRoom {
    Ring,
    Arena,
    External,
    Socket,
}

pub(crate) struct ShmSender {
    sh: Arc<Shared>,
    ring: ring::Producer<ShmRing>,
    arena: ArenaProducer,
    refs: ShmArena,
    /// Lease tag region of our outgoing arena.
    region: u64,
    /// Messages accepted by `start_send` that found no room yet, in order.
    staged: VecDeque<Message>,
    /// Arena bytes (head and body) of the last message handed back for lack of room:
    /// `poll_ready` waits for that much, so that a retry finds it.
    want: Option<u64>,
    external_sent: u64,
    /// The rest of an external-body record the socket took only part of.
    ext_record: Option<([u8; ExtRecord::LEN], usize)>,
    closed: bool,
    /// How long a dropped sender keeps delivering what it staged, in the background; `None`
    /// once it is that background delivery.
    linger: Option<Duration>,
    /// An empty stand-in left behind by `detach`: its drop does nothing.
    detached: bool,
    /// Where a dropped sender counts what it could not deliver.
    count: Count,
}

impl ShmSender {
    pub(crate) fn new(sh: Arc<Shared>, linger: Duration, count: Count) -> ShmSender {
        let refs = sh.seg.arena(sh.out_dir);
        ShmSender {
            ring: ring::Producer::new(sh.out_ring()),
            arena: ArenaProducer::new(refs.len()),
            region: REGION_SHM | (sh.seg.id() * 2 + sh.out_dir as u64),
            refs,
            sh,
            staged: VecDeque::new(),
            want: None,
            external_sent: 0,
            ext_record: None,
            closed: false,
            linger: Some(linger),
            detached: false,
            count,
        }
    }

    fn check(&self) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "sender closed"));
        }
        if self.ring.consumer_closed() {
            return Err(Error::new(
                ErrorKind::Closed,
                "the peer dropped its receiving half; nothing sent now would be read",
            ));
        }
        if self.sh.gone() {
            return Err(self.sh.gone_error("is gone"));
        }
        Ok(())
    }

    fn publish(&mut self) {
        if self.ring.publish() {
            wake(&self.sh.data);
        }
    }

    fn external_in_flight(&self) -> u64 {
        let released = self
            .ring
            .store()
            .control()
            .ext_released
            .load(crate::loom::sync::Ordering::Acquire);
        self.external_sent.saturating_sub(released)
    }

    /// Writes `msg` into the ring and arena, or hands it back with what was missing. Whatever
    /// is missing is found before anything of the message is written, except arena room for
    /// the body after its head took a block (that block is released again).
    fn write(&mut self, msg: Message) -> Result<std::result::Result<(), (Message, NoRoom)>> {
        if self.ring.free().map_err(corrupt)? == 0 {
            return Ok(Err((msg, NoRoom::Ring)));
        }
        let kind = msg.kind();
        let meta = msg.meta().as_wire();
        let head_len = kind.len() + meta.len();
        let header = msg.header();
        let body = msg.body();
        let body_len = body.len() as u64;
        let in_place = body
            .lease_tag()
            .filter(|t| t.region == self.region)
            .map(|t| t.offset);
        let plan = desc::plan(head_len, body_len, in_place.is_some(), self.refs.len());
        if plan.body == BodyPlace::External {
            if self.external_in_flight() >= MAX_EXTERNAL {
                return Ok(Err((msg, NoRoom::External)));
            }
            if !self.flush_record()? {
                return Ok(Err((msg, NoRoom::Socket)));
            }
        }
        let mut d = desc::Builder::new(
            Desc::MESSAGE,
            header.flags.bits(),
            kind.len() as u8,
            meta.len() as u32,
            header.correlation,
            body_len,
        );
        let head_block = match plan.head {
            HeadPlace::Inline => {
                d.inline(kind.as_bytes());
                d.inline(meta);
                None
            }
            HeadPlace::Block => {
                let Some(at) = self.arena.alloc(&self.refs, head_len as u64, 1) else {
                    return Ok(Err((msg, NoRoom::Arena)));
                };
                let p = desc::payload(at);
                self.refs.copy_in(p, kind.as_bytes());
                self.refs.copy_in(p + kind.len() as u64, meta);
                d.place(Desc::HEAD_IN_ARENA);
                d.head_at(at);
                Some(at)
            }
        };
        let bytes = || body.as_bytes().expect("host bodies only");
        match plan.body {
            BodyPlace::Empty => {}
            BodyPlace::Inline => {
                d.inline(bytes());
                d.place(Desc::BODY_INLINE);
            }
            BodyPlace::InPlace => {
                // Allocated in place in this arena (its hold is kept by the body we have):
                // the receiver takes a reference.
                let at = in_place.expect("planned in place");
                arena::retain(&self.refs, at);
                d.place(Desc::BODY_IN_ARENA);
                d.body_at(at);
            }
            BodyPlace::Copy => {
                self.wait_hot(body_len);
                let Some(at) = self.arena.alloc(&self.refs, body_len, 1) else {
                    if let Some(h) = head_block {
                        arena::release(&self.refs, h);
                    }
                    return Ok(Err((msg, NoRoom::Arena)));
                };
                self.refs.copy_in(desc::payload(at), bytes());
                d.place(Desc::BODY_IN_ARENA);
                d.body_at(at);
            }
            BodyPlace::External => {
                d.body_at(self.send_external(bytes())?);
                d.place(Desc::BODY_EXTERNAL);
            }
        }
        // The message (its body's reference count among it) goes before the slot is written:
        // a locked decrement after the slot's stores would wait for their cache lines.
        drop(msg);
        self.ring.write_words(d.words());
        if self.ring.unpublished() >= PUBLISH_EVERY {
            self.publish();
        }
        Ok(Ok(()))
    }

    /// A body too large for the arena: a sealed memfd of its own, passed over the socket with
    /// its record. Returns its sequence number. The record's first byte carries the memfd; if
    /// the socket takes only part of the record, the rest is kept and sent before anything
    /// else goes on the socket (the receiver waits for the whole record).
    fn send_external(&mut self, bytes: &Bytes) -> Result<u64> {
        let fd = rustix::fs::memfd_create(
            "hyperframes-body",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| Error::io("creating a memfd for a large body", e.into()))?;
        rustix::fs::ftruncate(&fd, bytes.len() as u64)
            .map_err(|e| Error::io("sizing a large body's memfd", e.into()))?;
        {
            let map = Mapping::new(&fd, bytes.len() as u64, true)
                .map_err(|e| Error::io("mapping a large body's memfd", e))?;
            // SAFETY: a fresh mapping of exactly `bytes.len()` bytes of a memfd nobody else has.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), map.base(), bytes.len()) };
        }
        // Immutable from here on: the receiver checks these seals.
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
        )
        .map_err(|e| Error::io("sealing a large body's memfd", e.into()))?;
        let seq = self.external_sent;
        let record = ExtRecord {
            seq,
            len: bytes.len() as u64,
        }
        .encode();
        match rendezvous::send_once(self.sh.uds.as_fd(), &record, &[fd.as_fd()]) {
            Ok(n) => {
                self.external_sent += 1;
                if n < ExtRecord::LEN {
                    self.ext_record = Some((record, n));
                }
                Ok(seq)
            }
            Err(e) => Err(Error::new(
                ErrorKind::ConnectionLost,
                format!("sending a large body to {}", self.sh.peer),
            )
            .with_source(std::io::Error::from(e))),
        }
    }

    /// Sends the rest of a partly sent record; true when none is left.
    fn flush_record(&mut self) -> Result<bool> {
        let Some((record, sent)) = &mut self.ext_record else {
            return Ok(true);
        };
        while *sent < ExtRecord::LEN {
            match rendezvous::send_once(self.sh.uds.as_fd(), &record[*sent..], &[]) {
                Ok(n) => *sent += n,
                Err(rustix::io::Errno::AGAIN) => return Ok(false),
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::ConnectionLost,
                        format!("sending a large body to {}", self.sh.peer),
                    )
                    .with_source(std::io::Error::from(e)));
                }
            }
        }
        self.ext_record = None;
        Ok(true)
    }

    /// Waits for what `why` lacked. Publishes first: the consumer must see everything written
    /// before we wait for it to free anything.
    fn poll_room(&mut self, cx: &mut Context<'_>, why: NoRoom) -> Poll<Result<()>> {
        self.publish();
        if why == NoRoom::Socket {
            return self
                .sh
                .uds
                .poll_write_ready(cx)
                .map_err(|e| Error::io("waiting on the shm socket", e));
        }
        let room = |this: &mut Self| -> Result<bool> {
            Ok(match why {
                NoRoom::Ring => this.ring.free().map_err(corrupt)? > 0,
                NoRoom::Arena => this.arena.reclaim(&this.refs),
                NoRoom::External => this.external_in_flight() < MAX_EXTERNAL,
                NoRoom::Socket => true,
            } || this.sh.gone()
                || this.ring.consumer_closed())
        };
        if spin_until(SPIN, || room(self))? {
            return Poll::Ready(Ok(()));
        }
        if self.sh.busy_poll {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        // Wakes from this process (our leases, the watcher) and from the peer (its sockets).
        self.sh.tx_waker.register(cx.waker());
        self.ring.prepare_park();
        if room(self)? {
            self.ring.cancel_park();
            return Poll::Ready(Ok(()));
        }
        poll_wake(&self.sh, &self.sh.space, cx)
    }

    /// Writes the staged messages in order, waiting for room; then publishes. Ready once every
    /// staged message is handed over (written and published); a record the socket took only
    /// part of is sent on by the next call, and waited for by `poll_flush`.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        while let Some(msg) = self.staged.pop_front() {
            match self.write(msg)? {
                Ok(()) => {}
                Err((msg, why)) => {
                    self.staged.push_front(msg);
                    match self.poll_room(cx, why) {
                        Poll::Ready(r) => {
                            r?;
                            self.check()?;
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
            }
        }
        self.flush_record()?;
        self.publish();
        Poll::Ready(Ok(()))
    }

    /// `poll_drain`, then the rest of a partly sent record.
    fn poll_drain_all(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            match self.poll_drain(cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            }
            if self.ext_record.is_none() {
                return Poll::Ready(Ok(()));
            }
            match self.poll_room(cx, NoRoom::Socket) {
                Poll::Ready(r) => {
                    r?;
                    self.check()?;
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Ready when the next message can be written: a free ring slot, and arena room for the
    /// message last handed back, if any.
    fn poll_room_for_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            let why = if self.ring.free().map_err(corrupt)? == 0 {
                NoRoom::Ring
            } else if let Some(want) = self.want
                && !self.arena.has_room(&self.refs, want)
            {
                NoRoom::Arena
            } else {
                self.want = None;
                return Poll::Ready(Ok(()));
            };
            match self.poll_room(cx, why) {
                Poll::Ready(r) => {
                    r?;
                    self.check()?;
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// With two large bodies in flight, spins up to [`HOT_WAIT`] for one to come back, so
    /// that the next goes where the caches still hold the memory.
    fn wait_hot(&mut self, payload: u64) {
        let Ok(_) = spin_until(HOT_WAIT, || {
            Ok::<_, Infallible>(!self.arena.deep(&self.refs, payload))
        });
    }

    /// Moves the sender's state out (for a background close), leaving an inert stand-in.
    fn detach(&mut self) -> ShmSender {
        let stand_in = ShmSender {
            sh: self.sh.clone(),
            ring: ring::Producer::new(self.sh.out_ring()),
            arena: ArenaProducer::new(self.refs.len()),
            refs: self.refs.clone(),
            region: self.region,
            staged: VecDeque::new(),
            want: None,
            external_sent: 0,
            ext_record: None,
            closed: true,
            linger: None,
            detached: true,
            count: self.count.clone(),
        };
        let mut moved = std::mem::replace(self, stand_in);
        moved.linger = None;
        moved
    }
}

impl SendHalf for ShmSender {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.staged.is_empty() {
            match self.poll_drain(cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            }
        }
        match self.poll_room_for_next(cx) {
            Poll::Ready(r) => Poll::Ready(r.and_then(|()| self.check())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn start_send(&mut self, msg: Message) -> Result<()> {
        // `poll_ready` checked the connection just before (the Sink contract); a peer that
        // went since then is reported on the next call.
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "sender closed").with_message(msg));
        }
        if !self.staged.is_empty() {
            self.staged.push_back(msg);
            return Ok(());
        }
        if let Err((msg, _)) = self.write(msg)? {
            self.staged.push_back(msg);
        }
        Ok(())
    }

    fn poll_submit(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.poll_drain(cx)
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.poll_drain_all(cx)
    }

    fn unstage(&mut self) -> Option<Message> {
        let m = self.staged.pop_back()?;
        let head = (m.kind().len() + m.meta().encoded_len()) as u64;
        let body = m.body().len() as u64;
        // The larger of the two blocks it needs (the head goes inline when it is small).
        self.want = Some(if head as usize > Desc::INLINE {
            head.max(body)
        } else {
            body
        });
        Some(m)
    }

    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.closed {
            return Poll::Ready(Ok(()));
        }
        match self.poll_drain_all(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) if e.kind() == ErrorKind::Closed => {}
            other => return other,
        }
        self.closed = true;
        if self.ring.close() {
            wake(&self.sh.data);
        }
        Poll::Ready(Ok(()))
    }

    fn poll_alloc(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<Result<BodyMut>> {
        self.check()?;
        if !self.sh.zero_copy || self.arena.too_large(len as u64) {
            // Heap memory: larger than the arena (sending copies it once into a memfd), or a
            // peer not trusted with views of our arena (sending copies it into the arena).
            return Poll::Ready(Ok(BodyMut::zeroed(len)));
        }
        self.wait_hot(len as u64);
        loop {
            if let Some((at, hold)) = self.arena.alloc_held(&self.refs, len as u64) {
                let ptr = self.refs.ptr(desc::payload(at), len as u64);
                return Poll::Ready(Ok(BodyMut::lent(Box::new(ArenaBodyMut {
                    lease: SendLease {
                        sh: self.sh.clone(),
                        hold,
                        ptr,
                        len,
                    },
                    tag: LeaseTag {
                        region: self.region,
                        offset: at,
                    },
                }))));
            }
            match self.poll_room(cx, NoRoom::Arena) {
                Poll::Ready(r) => {
                    r?;
                    self.check()?;
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for ShmSender {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        // Drop is a close: write what fits now; what does not is delivered in the background
        // (bounded by `linger`) when a runtime is there to do it.
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        let pending = match self.poll_close(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Ok(())) => false,
            Poll::Ready(Err(e)) => {
                if !self.staged.is_empty() {
                    self.count.unsent(self.staged.len() as u64);
                    tracing::warn!(
                        messages = self.staged.len(),
                        peer = %self.sh.peer,
                        "shm sender dropped: messages not sent: {e:#}"
                    );
                }
                false
            }
        };
        if pending {
            if let (Some(linger), Ok(rt)) = (self.linger, tokio::runtime::Handle::try_current()) {
                let mut rest = self.detach();
                rt.spawn(async move {
                    let close = futures_util::future::poll_fn(|cx| rest.poll_close(cx));
                    let result = tokio::time::timeout(linger, close).await;
                    let left = rest.staged.len();
                    if !matches!(result, Ok(Ok(()))) {
                        rest.count.unsent(left as u64);
                        // Counted once: not again by `rest`'s own drop below.
                        rest.count = rest.count.muted();
                    }
                    match result {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => tracing::warn!(
                            messages = left,
                            peer = %rest.sh.peer,
                            "dropped shm sender: messages not delivered: {e:#}"
                        ),
                        Err(_) => tracing::warn!(
                            messages = left,
                            peer = %rest.sh.peer,
                            "dropped shm sender: messages not delivered within the linger of {linger:?}"
                        ),
                    }
                });
                return;
            }
            self.count.unsent(self.staged.len() as u64);
            tracing::warn!(
                messages = self.staged.len(),
                peer = %self.sh.peer,
                "shm sender dropped outside a runtime while the peer's ring was full: messages not sent"
            );
        }
        if !self.closed && self.ring.close() {
            wake(&self.sh.data);
        }
        self.sh.half_dropped();
    }
}

impl Shared {
    /// One half is dropped; the watcher stops with the last.
    fn half_dropped(&self) {
        if self.halves.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }
}

/// The sender's hold on a block it allocated in place.
struct SendLease {
    sh: Arc<Shared>,
    hold: Arc<Hold>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `ptr` points into the segment's mapping, which `sh` keeps alive; the block is held
// for this lease (`hold`, in process memory) so the producer does not reuse it while the lease
// lives. Moving the lease to another thread moves nothing but that right.
unsafe impl Send for SendLease {}
// SAFETY: shared access only reads the block (see `Send`).
unsafe impl Sync for SendLease {}

impl AsRef<[u8]> for SendLease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes of a block held by this lease, inside the mapping (checked when
        // allocated); not written any more once frozen (the `ArenaBodyMut` is consumed by
        // `freeze`). Handed out only when the peer is trusted with our arena (`zero_copy`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for SendLease {
    fn drop(&mut self) {
        self.hold.release();
        self.sh.tx_waker.wake();
    }
}

struct ArenaBodyMut {
    lease: SendLease,
    tag: LeaseTag,
}

impl LentMut for ArenaBodyMut {
    fn as_slice(&self) -> &[u8] {
        self.lease.as_ref()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the block is held by this lease alone and not yet shared (it is frozen
        // before it is sent), and `&mut self` excludes other borrows.
        unsafe { std::slice::from_raw_parts_mut(self.lease.ptr, self.lease.len) }
    }

    fn freeze(self: Box<Self>) -> Body {
        Body::leased(Bytes::from_owner(self.lease), self.tag)
    }
}

// ---------------------------------------------------------------------------------------
// Receiver
// ---------------------------------------------------------------------------------------

pub(crate) struct ShmReceiver {
    sh: Arc<Shared>,
    ring: ring::Consumer<ShmRing>,
    refs: ShmArena,
    limits: Limits,
    bounds: Bounds,
    types: TypeCache,
    chunk: Chunk,
    done: bool,
}

/// Where small received parts are copied: a shared buffer split into `Bytes`, so a message
/// costs no allocation of its own (a part keeps its chunk alive while it lives).
#[derive(Default)]
struct Chunk(bytes::BytesMut);

impl Chunk {
    fn copy(&mut self, bytes: &[u8]) -> Bytes {
        if self.0.capacity() - self.0.len() < bytes.len() {
            self.0 = bytes::BytesMut::with_capacity(CHUNK.max(bytes.len()));
        }
        self.0.extend_from_slice(bytes);
        self.0.split().freeze()
    }
}

enum Step {
    Message(Message),
    /// An external body whose memfd has not arrived yet: nothing was taken.
    WaitExternal,
}

impl ShmReceiver {
    pub(crate) fn new(sh: Arc<Shared>, limits: Limits) -> ShmReceiver {
        let refs = sh.seg.arena(sh.in_dir);
        ShmReceiver {
            ring: ring::Consumer::new(sh.in_ring()),
            bounds: Bounds {
                max_meta_bytes: limits.max_meta_bytes,
                max_body: limits.max_body,
                arena_len: refs.len(),
            },
            refs,
            sh,
            limits,
            types: TypeCache::default(),
            chunk: Chunk::default(),
            done: false,
        }
    }

    /// Hands the slots read so far back to the producer.
    fn consume(&mut self) {
        if self.ring.consume() {
            wake(&self.sh.space);
        }
    }

    /// Decodes one descriptor: checked first, then its parts taken. Nothing is released or
    /// taken unless the whole message can be (an external body that has not arrived leaves
    /// the descriptor as it was, to be decoded again).
    fn decode(&mut self, w: &[u64; desc::WORDS]) -> Result<Step> {
        let l: Layout = desc::check_words(w, &self.bounds).map_err(corrupt)?;
        let external = match l.body {
            Part::External { seq, len } => {
                let mut ext = self.sh.lock_external();
                match ext.queue.front() {
                    None => return Ok(Step::WaitExternal),
                    Some((s, map)) if *s != seq || map.len() as u64 != len => {
                        return Err(corrupt(format!(
                            "external body {seq} of {len} bytes, but {s} of {} bytes came",
                            map.len()
                        )));
                    }
                    Some(_) => ext.queue.pop_front().map(|(_, map)| map),
                }
            }
            _ => None,
        };
        // The head, copied out of shared memory before it is parsed.
        let ShmReceiver {
            sh,
            refs,
            limits,
            types,
            chunk,
            ..
        } = self;
        let max_entries = limits.max_meta_entries;
        let inline = desc::inline_bytes(w);
        let head_block;
        let head_bytes = match l.head {
            Part::Inline { at, len } => &inline[at..at + len],
            Part::Block { block, len } => {
                head_block = refs.copy_out(desc::payload(block), len as usize);
                if arena::release(refs, block) {
                    sh.wake_peer_sender();
                }
                &head_block[..]
            }
            _ => unreachable!("desc::check places heads inline or in a block"),
        };
        let (kind, meta) = desc::head(head_bytes, l.type_len, types, max_entries, |m| {
            chunk.copy(m)
        })
        .map_err(corrupt)?;
        let body = match l.body {
            Part::Empty => Bytes::new(),
            Part::Inline { at, len } => chunk.copy(&inline[at..at + len]),
            Part::Block { block, len } => {
                let at = desc::payload(block);
                if len <= COPY_MAX || !sh.zero_copy {
                    let b = Bytes::from(refs.copy_out(at, len as usize));
                    if arena::release(refs, block) {
                        sh.wake_peer_sender();
                    }
                    b
                } else {
                    Bytes::from_owner(RecvLease {
                        sh: sh.clone(),
                        refs: refs.clone(),
                        block,
                        ptr: refs.ptr(at, len),
                        len: len as usize,
                    })
                }
            }
            Part::External { .. } => Bytes::from_owner(ExternalBody {
                map: external.expect("taken above"),
                sh: sh.clone(),
            }),
        };
        Ok(Step::Message(Message::from_parts(
            kind.clone(),
            meta,
            Body::from(body),
            Header {
                flags: l.flags,
                correlation: l.correlation,
            },
        )))
    }

    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        loop {
            if let Some(d) = self.ring.peek() {
                match self.decode(&d)? {
                    Step::Message(m) => {
                        self.ring.take();
                        if self.ring.taken() >= BATCH {
                            self.consume();
                        }
                        return Poll::Ready(Some(Ok(m)));
                    }
                    Step::WaitExternal => {
                        // The next descriptor's body is a memfd that has not come through the
                        // socket yet: the watcher wakes us when it does (or when the peer is
                        // gone).
                        self.consume();
                        self.sh.rx_waker.register(cx.waker());
                        if !self.sh.lock_external().queue.is_empty() {
                            continue;
                        }
                        if self.sh.gone() {
                            return Poll::Ready(Some(Err(self
                                .sh
                                .gone_error("went away while sending a large body"))));
                        }
                        return Poll::Pending;
                    }
                }
            }
            // Nothing ready: hand back the slots read so far before waiting.
            self.consume();
            if self.ring.is_finished() {
                return Poll::Ready(None);
            }
            if self.sh.gone() {
                // Published before the peer went? Take it first.
                if self.sh.fault.get().is_none() && self.ring.ready() {
                    continue;
                }
                return Poll::Ready(Some(Err(self
                    .sh
                    .gone_error("went away without closing the channel"))));
            }
            if spin_until(SPIN, || Ok::<_, Error>(self.ring.ready() || self.sh.gone()))? {
                continue;
            }
            if self.sh.busy_poll {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.sh.rx_waker.register(cx.waker());
            self.ring.prepare_park();
            if self.ring.ready() || self.ring.is_finished() || self.sh.gone() {
                self.ring.cancel_park();
                continue;
            }
            match poll_wake(&self.sh, &self.sh.data, cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl RecvHalf for ShmReceiver {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.poll_inner(cx) {
            Poll::Ready(Some(Ok(m))) => Poll::Ready(Some(Ok(m))),
            Poll::Ready(other) => {
                self.done = true;
                if let Some(Err(e)) = &other
                    && e.is_protocol()
                {
                    tracing::warn!(peer = %self.sh.peer, "closing shared-memory channel: {e:#}");
                    // Stop the peer: nothing it sends will be read.
                    self.ring.close();
                    wake(&self.sh.space);
                }
                Poll::Ready(other)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for ShmReceiver {
    fn drop(&mut self) {
        // STOP: the peer's Sender fails from now on. Wake it in case it waits for room.
        self.ring.close();
        wake(&self.sh.space);
        self.sh.half_dropped();
    }
}

/// The receiver's reference to a body in the peer's arena (only when `zero_copy`).
struct RecvLease {
    sh: Arc<Shared>,
    refs: ShmArena,
    block: u64,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `ptr` points into the mapping kept alive by `refs`; the block stays reserved for
// this lease (its reference count) so a well-behaved producer does not reuse it while the
// lease lives. Moving the lease to another thread moves nothing but that right.
unsafe impl Send for RecvLease {}

impl AsRef<[u8]> for RecvLease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes inside the arena (checked when received), published to us and
        // not written by a peer we trust with zero-copy views (`zero_copy`, the documented
        // trust model: a peer not trusted so gets copies instead) before we release it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for RecvLease {
    fn drop(&mut self) {
        if arena::release(&self.refs, self.block) {
            self.sh.wake_peer_sender();
        }
    }
}

/// A received body in a sealed memfd of its own: immutable, whatever the peer does.
struct ExternalBody {
    map: Mapping,
    sh: Arc<Shared>,
}

impl AsRef<[u8]> for ExternalBody {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the whole read-only mapping of a memfd sealed against writes and resizing
        // (checked on arrival), so its bytes cannot change while mapped.
        unsafe { std::slice::from_raw_parts(self.map.base(), self.map.len()) }
    }
}

impl Drop for ExternalBody {
    fn drop(&mut self) {
        // Ours first, then the peer's count: when the peer sees room and sends another, this
        // side has already counted this one out.
        self.sh.lock_external().outstanding -= 1;
        self.sh
            .in_ring()
            .control()
            .ext_released
            .fetch_add(1, crate::loom::sync::Ordering::Release);
        self.sh.wake_peer_sender();
    }
}
