//! The halves of a shared-memory connection. The `Sender` is the producer of its direction
//! and writes straight into the segment; the `Receiver` is the consumer of the other and
//! reads straight out of it: no I/O thread, no copy beyond the one into the arena (none for
//! bodies allocated in place), no system call per message under load.
//!
//! Waiting: a side that finds no data (Receiver) or no room (Sender) spins briefly, then
//! announces it sleeps and parks on an eventfd through tokio's `AsyncFd`; the other side
//! writes that eventfd only when the flag is up. `busy_poll` never parks. A watcher task
//! reads the rendezvous socket: memfds of external bodies arrive there, and its EOF means the
//! peer process is gone; it then wakes both halves through their own eventfds.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use rustix::fs::{MemfdFlags, SealFlags};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;

use super::arena::{self, ArenaProducer, BlockRefs};
use super::rendezvous::{self, EXT_LEN, EXT_MAGIC};
use super::ring::{self, Desc, RingStore};
use super::segment::{Mapping, Segment, ShmArena, ShmRing};
use crate::error::Result;
use crate::message::{Body, BodyMut, Flags, Header, LeaseTag, LentMut, Meta};
use crate::transport::{RecvHalf, SendHalf};
use crate::wire::{Limits, TypeCache};
use crate::{Error, ErrorKind, Message};

/// Bodies up to this size are copied out of the arena on receive (and their block freed at
/// once): cheaper than a lease, and it keeps small messages from pinning the arena.
const COPY_MAX: u64 = 1024;
/// Descriptors taken per receive batch.
const BATCH: u64 = 64;
/// Descriptors written before they are published without waiting for a flush.
const PUBLISH_EVERY: u64 = 64;
/// How long a side waiting for data or room spins before it parks: long enough to catch a
/// reply in a request/response exchange (a round trip is a microsecond or two) without
/// sleeping, short enough not to burn a core on an idle channel.
const SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// Spins until `ready` or [`SPIN`] has passed; true when ready.
fn spin_until(mut ready: impl FnMut() -> Result<bool>) -> Result<bool> {
    let start = std::time::Instant::now();
    loop {
        for _ in 0..64 {
            if ready()? {
                return Ok(true);
            }
            crate::loom::sync::spin_hint();
        }
        if start.elapsed() >= SPIN {
            return Ok(false);
        }
    }
}
/// External bodies (memfds) in flight per direction.
const MAX_EXTERNAL: u64 = 8;

/// What both halves (and the leases they hand out) share.
pub(crate) struct Shared {
    seg: Arc<Segment>,
    out_dir: usize,
    in_dir: usize,
    /// Ours, parked on by our Receiver; written by the peer's Sender (and our watcher).
    in_data: AsyncFd<OwnedFd>,
    /// Ours, parked on by our Sender; written by the peer's Receiver, our leases, our watcher.
    out_space: AsyncFd<OwnedFd>,
    /// The peer's: wakes its Receiver.
    out_data: OwnedFd,
    /// The peer's: wakes its Sender.
    in_space: OwnedFd,
    uds: UnixStream,
    peer_gone: AtomicBool,
    external: Mutex<VecDeque<OwnedFd>>,
    external_waker: AtomicWaker,
    halves: AtomicU32,
    done: tokio::sync::Notify,
    busy_poll: bool,
    peer: String,
}

/// The four eventfds of a connection, as passed in the hello (`[d0 data, d0 space, d1 data,
/// d1 space]`).
pub(crate) struct Eventfds(pub(crate) [OwnedFd; 4]);

impl Eventfds {
    pub(crate) fn new() -> Result<Eventfds> {
        let one = || {
            rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )
            .map_err(|e| Error::io("creating an eventfd", e.into()))
        };
        Ok(Eventfds([one()?, one()?, one()?, one()?]))
    }
}

fn signal(fd: BorrowedFd<'_>) {
    // Only EAGAIN (counter at its maximum, a wake-up pending anyway) can fail here.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

fn drain(fd: BorrowedFd<'_>) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

impl Shared {
    /// Builds the halves' shared state; `out_dir` is 0 for the listener. Registers the
    /// eventfds with the current tokio runtime and starts the watcher on it.
    pub(crate) fn start(
        seg: Arc<Segment>,
        out_dir: usize,
        efds: Eventfds,
        uds: UnixStream,
        busy_poll: bool,
        peer: String,
    ) -> Result<Arc<Shared>> {
        let [d0_data, d0_space, d1_data, d1_space] = efds.0;
        let in_dir = 1 - out_dir;
        let (out_data, out_space, in_data, in_space) = if out_dir == 0 {
            (d0_data, d0_space, d1_data, d1_space)
        } else {
            (d1_data, d1_space, d0_data, d0_space)
        };
        let register = |fd: OwnedFd| {
            // SAFETY: an `OwnedFd` is a valid open descriptor that it never replaces, and it
            // stays inside the `AsyncFd` (never taken out) until the `AsyncFd` drops.
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| Error::io("registering an eventfd", e.into()))
        };
        let sh = Arc::new(Shared {
            seg,
            out_dir,
            in_dir,
            in_data: register(in_data)?,
            out_space: register(out_space)?,
            out_data,
            in_space,
            uds,
            peer_gone: AtomicBool::new(false),
            external: Mutex::new(VecDeque::new()),
            external_waker: AtomicWaker::new(),
            halves: AtomicU32::new(2),
            done: tokio::sync::Notify::new(),
            busy_poll,
            peer,
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

    /// One half is dropped; the watcher stops with the last.
    fn half_dropped(&self) {
        if self.halves.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }

    /// Our Sender may wait for room: wake it if it said it sleeps.
    fn wake_own_sender(&self) {
        if ring::wake_needed(&self.out_ring().control().producer_sleeping) {
            signal(self.out_space.get_ref().as_fd());
        }
    }

    /// The peer's Sender may wait for room in our incoming direction.
    fn wake_peer_sender(&self) {
        if ring::wake_needed(&self.in_ring().control().producer_sleeping) {
            signal(self.in_space.as_fd());
        }
    }
}

/// Reads the rendezvous socket: external bodies' memfds, and EOF (the peer process is gone).
async fn watch(sh: Arc<Shared>) {
    let mut record = [0u8; EXT_LEN];
    let mut got = 0;
    let mut fds = Vec::new();
    loop {
        tokio::select! {
            () = sh.done.notified() => return,
            r = sh.uds.readable() => if r.is_err() { break },
        }
        let res = sh.uds.try_io(Interest::READABLE, || {
            rendezvous::recv_once(sh.uds.as_fd(), &mut record[got..], &mut fds).map_err(Into::into)
        });
        match res {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                if got == EXT_LEN {
                    got = 0;
                    if record[..8] != EXT_MAGIC || fds.len() != 1 {
                        tracing::warn!(peer = %sh.peer, "malformed record on the shm socket; closing");
                        break;
                    }
                    sh.external
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_back(fds.remove(0));
                    sh.external_waker.wake();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => break,
        }
    }
    sh.peer_gone.store(true, Ordering::Release);
    signal(sh.in_data.get_ref().as_fd());
    signal(sh.out_space.get_ref().as_fd());
    sh.external_waker.wake();
}

/// Waits on one of our eventfds: Ready once it was written (and is drained).
fn poll_eventfd(fd: &AsyncFd<OwnedFd>, cx: &mut Context<'_>) -> Poll<Result<()>> {
    match fd.poll_read_ready(cx) {
        Poll::Ready(Ok(mut guard)) => {
            // Edge-triggered: drain the counter and re-arm, then report the wake-up (the caller
            // looks again; a spurious wake-up is harmless).
            drain(fd.get_ref().as_fd());
            guard.clear_ready();
            Poll::Ready(Ok(()))
        }
        Poll::Ready(Err(e)) => Poll::Ready(Err(Error::io("waiting on an eventfd", e))),
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
    /// At most one message that found no room at `start_send`.
    staged: VecDeque<Message>,
    /// Arena bytes (head and body) of the last message handed back for lack of room:
    /// `poll_ready` waits for that much, so that a retry finds it.
    want: Option<u64>,
    external_sent: u64,
    closed: bool,
}

impl ShmSender {
    pub(crate) fn new(sh: Arc<Shared>) -> ShmSender {
        let refs = sh.seg.arena(sh.out_dir);
        ShmSender {
            ring: ring::Producer::new(sh.out_ring()),
            arena: ArenaProducer::new(refs.len()),
            region: sh.seg.id() * 2 + sh.out_dir as u64,
            refs,
            sh,
            staged: VecDeque::new(),
            want: None,
            external_sent: 0,
            closed: false,
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
            return Err(Error::new(
                ErrorKind::ConnectionLost,
                format!(
                    "the shared-memory peer {} is gone (process exited?)",
                    self.sh.peer
                ),
            ));
        }
        Ok(())
    }

    fn publish(&mut self) {
        if self.ring.publish() {
            signal(self.sh.out_data.as_fd());
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

    /// Writes `msg` into the ring and arena, or hands it back with what was missing.
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
        let mut d = Desc {
            kind: Desc::MESSAGE,
            flags: header.flags.bits(),
            type_len: kind.len() as u8,
            place: 0,
            meta_len: meta.len() as u32,
            correlation: header.correlation,
            body_len,
            body_at: 0,
            head_at: 0,
            inline: [0; Desc::INLINE],
        };
        let mut head_block = None;
        if head_len <= Desc::INLINE {
            d.inline[..kind.len()].copy_from_slice(kind.as_bytes());
            d.inline[kind.len()..head_len].copy_from_slice(meta);
        } else {
            let Some(at) = self.arena.alloc(&self.refs, head_len as u64, 1) else {
                return Ok(Err((msg, NoRoom::Arena)));
            };
            let p = self.refs.ptr(at + arena::BLOCK_ALIGN);
            // SAFETY: a freshly allocated block of `head_len` payload bytes, ours alone until
            // published.
            unsafe {
                std::ptr::copy_nonoverlapping(kind.as_bytes().as_ptr(), p, kind.len());
                std::ptr::copy_nonoverlapping(meta.as_ptr(), p.add(kind.len()), meta.len());
            }
            d.place |= Desc::HEAD_IN_ARENA;
            d.head_at = at;
            head_block = Some(at);
        }
        let undo = |this: &mut Self| {
            if let Some(at) = head_block {
                arena::release(&this.refs, at);
            }
        };
        if body_len > 0 && head_block.is_none() && head_len + body_len as usize <= Desc::INLINE {
            // Small enough to ride in the descriptor: no arena block at all.
            let bytes = body.as_bytes().expect("host bodies only");
            d.inline[head_len..head_len + bytes.len()].copy_from_slice(bytes);
            d.place |= Desc::BODY_INLINE;
        } else if body_len > 0 {
            let bytes = body.as_bytes().expect("host bodies only");
            match body.lease_tag() {
                Some(LeaseTag { region, offset }) if region == self.region => {
                    // Allocated in place in this arena: the receiver takes a reference.
                    arena::retain(&self.refs, offset);
                    d.place |= Desc::BODY_IN_ARENA;
                    d.body_at = offset;
                }
                _ if self.arena.too_large(body_len) => {
                    if self.external_in_flight() >= MAX_EXTERNAL {
                        undo(self);
                        return Ok(Err((msg, NoRoom::External)));
                    }
                    match self.send_external(bytes)? {
                        Some(seq) => {
                            d.place |= Desc::BODY_EXTERNAL;
                            d.body_at = seq;
                        }
                        None => {
                            undo(self);
                            return Ok(Err((msg, NoRoom::Socket)));
                        }
                    }
                }
                _ => {
                    let Some(at) = self.arena.alloc(&self.refs, body_len, 1) else {
                        undo(self);
                        return Ok(Err((msg, NoRoom::Arena)));
                    };
                    // SAFETY: a freshly allocated block of `body_len` payload bytes, ours
                    // alone until published; `bytes` is other memory.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            bytes.as_ptr(),
                            self.refs.ptr(at + arena::BLOCK_ALIGN),
                            bytes.len(),
                        )
                    };
                    d.place |= Desc::BODY_IN_ARENA;
                    d.body_at = at;
                }
            }
        }
        self.ring.write(&d);
        if self.ring.unpublished() >= PUBLISH_EVERY {
            self.publish();
        }
        Ok(Ok(()))
    }

    /// A body too large for the arena: a sealed memfd of its own, passed over the socket.
    /// `None` when the socket has no room now.
    fn send_external(&mut self, bytes: &Bytes) -> Result<Option<u64>> {
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
            // SAFETY: a fresh private mapping of exactly `bytes.len()` bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), map.base(), bytes.len()) };
        }
        // Immutable from here on: the receiver checks these seals.
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL,
        )
        .map_err(|e| Error::io("sealing a large body's memfd", e.into()))?;
        let seq = self.external_sent;
        let mut record = [0u8; EXT_LEN];
        record[..8].copy_from_slice(&EXT_MAGIC);
        record[8..].copy_from_slice(&seq.to_le_bytes());
        match rendezvous::send_once(self.sh.uds.as_fd(), &record, &[fd.as_fd()]) {
            Ok(n) if n == EXT_LEN => {
                self.external_sent += 1;
                Ok(Some(seq))
            }
            Ok(_) => Err(corrupt("partial write of an external-body record")),
            Err(rustix::io::Errno::AGAIN) => Ok(None),
            Err(e) => Err(Error::new(
                ErrorKind::ConnectionLost,
                format!("sending a large body to {}", self.sh.peer),
            )
            .with_source(std::io::Error::from(e))),
        }
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
        if spin_until(|| room(self))? {
            return Poll::Ready(Ok(()));
        }
        if self.sh.busy_poll {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.ring.prepare_park();
        if room(self)? {
            self.ring.cancel_park();
            return Poll::Ready(Ok(()));
        }
        poll_eventfd(&self.sh.out_space, cx)
    }

    /// Writes the staged message(s), waiting for room; then publishes.
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
        self.publish();
        Poll::Ready(Ok(()))
    }
}

impl ShmSender {
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
}

impl SendHalf for ShmSender {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.check()?;
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
        if let Err(e) = self.check() {
            return Err(e.with_message(msg));
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
        self.poll_drain(cx)
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
        match self.poll_drain(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) if e.kind() == ErrorKind::Closed => {}
            other => return other,
        }
        self.closed = true;
        if self.ring.close() {
            signal(self.sh.out_data.as_fd());
        }
        Poll::Ready(Ok(()))
    }

    fn poll_alloc(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<Result<BodyMut>> {
        self.check()?;
        if self.arena.too_large(len as u64) {
            // Larger than the arena: heap memory; sending copies it once into a memfd.
            return Poll::Ready(Ok(BodyMut::zeroed(len)));
        }
        loop {
            if let Some(at) = self.arena.alloc(&self.refs, len as u64, 1) {
                return Poll::Ready(Ok(BodyMut::lent(Box::new(ArenaBodyMut {
                    lease: SendLease {
                        sh: self.sh.clone(),
                        refs: self.refs.clone(),
                        at,
                        ptr: self.refs.ptr(at + arena::BLOCK_ALIGN),
                        len,
                    },
                    region: self.region,
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
        // Drop is a close: write what fits without waiting, then mark the end.
        while let Some(msg) = self.staged.pop_front() {
            if let Ok(Err((msg, _))) = self.write(msg) {
                self.staged.push_front(msg);
                break;
            }
        }
        if !self.staged.is_empty() && !self.closed {
            tracing::warn!(
                messages = self.staged.len(),
                peer = %self.sh.peer,
                "shm sender dropped while the peer's ring was full: messages not sent (close() waits for room)"
            );
        }
        if !self.closed && self.ring.close() {
            signal(self.sh.out_data.as_fd());
        }
        self.sh.half_dropped();
    }
}

/// The sender's reference to a block it allocated in place.
struct SendLease {
    sh: Arc<Shared>,
    refs: ShmArena,
    at: u64,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `ptr` points into the mapping kept alive by `refs`; the block is reserved for this
// lease (reference count held) so no other party writes it while the lease lives, except the
// owner of the `ArenaBodyMut` through `&mut`.
unsafe impl Send for SendLease {}
// SAFETY: shared access only reads the block (see `Send`).
unsafe impl Sync for SendLease {}

impl AsRef<[u8]> for SendLease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes of a block held by this lease, inside the mapping; not written
        // any more once frozen (the `ArenaBodyMut` is consumed by `freeze`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for SendLease {
    fn drop(&mut self) {
        if arena::release(&self.refs, self.at) {
            self.sh.wake_own_sender();
        }
    }
}

struct ArenaBodyMut {
    lease: SendLease,
    region: u64,
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
        let tag = LeaseTag {
            region: self.region,
            offset: self.lease.at,
        };
        Body::leased(Bytes::from_owner(self.lease), tag)
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
    types: TypeCache,
    batch: VecDeque<Message>,
    external_next: u64,
    done: bool,
}

enum Step {
    Message(Message),
    /// An external body whose memfd has not arrived yet.
    WaitExternal,
}

impl ShmReceiver {
    pub(crate) fn new(sh: Arc<Shared>, limits: Limits) -> ShmReceiver {
        ShmReceiver {
            ring: ring::Consumer::new(sh.in_ring()),
            refs: sh.seg.arena(sh.in_dir),
            sh,
            limits,
            types: TypeCache::default(),
            batch: VecDeque::new(),
            external_next: 0,
            done: false,
        }
    }

    fn release(&self, at: u64) {
        if arena::release(&self.refs, at) {
            self.sh.wake_peer_sender();
        }
    }

    /// Decodes one descriptor, validating everything the peer wrote.
    fn decode(&mut self, d: &Desc) -> Result<Step> {
        if d.kind != Desc::MESSAGE {
            return Err(corrupt(format!("descriptor kind {}", d.kind)));
        }
        let flags = Flags::from_bits(d.flags).ok_or_else(|| corrupt("reserved flag bits"))?;
        let type_len = d.type_len as usize;
        let meta_len = d.meta_len as usize;
        if type_len == 0 || d.meta_len > self.limits.max_meta_bytes {
            return Err(corrupt(format!(
                "type of {type_len} bytes, metadata of {meta_len} bytes (max {})",
                self.limits.max_meta_bytes
            )));
        }
        if d.body_len > self.limits.max_body {
            return Err(corrupt(format!(
                "body of {} bytes exceeds max_body of {}",
                d.body_len, self.limits.max_body
            )));
        }
        // An external body whose memfd has not come through the socket yet: wait before
        // anything is taken or released, so that decoding the descriptor again later (when
        // the memfd is there) does not release its head block a second time.
        if d.place & Desc::BODY_EXTERNAL != 0
            && self
                .sh
                .external
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
        {
            return Ok(Step::WaitExternal);
        }
        let arena_len = self.refs.len();
        // The head, copied out of shared memory before it is validated.
        let head_len = type_len + meta_len;
        let head: Vec<u8>;
        let head_bytes: &[u8] = if d.place & Desc::HEAD_IN_ARENA != 0 {
            let at = arena::validate(arena_len, d.head_at, head_len as u64)
                .ok_or_else(|| corrupt("head block out of the arena"))?;
            let mut v = vec![0u8; head_len];
            // SAFETY: `[at, at + head_len)` lies inside the arena (validated); copied out at
            // once, so later writes by a misbehaving peer cannot change what we validate.
            unsafe { std::ptr::copy_nonoverlapping(self.refs.ptr(at), v.as_mut_ptr(), head_len) };
            self.release(d.head_at);
            head = v;
            &head
        } else {
            if head_len > Desc::INLINE {
                return Err(corrupt("inline head longer than the descriptor"));
            }
            &d.inline[..head_len]
        };
        let kind = self
            .types
            .get(&head_bytes[..type_len])
            .map_err(|e| corrupt(format!("type: {e}")))?;
        let meta_raw = &head_bytes[type_len..];
        Meta::validate_wire(meta_raw, self.limits.max_meta_entries as usize)
            .map_err(|e| corrupt(format!("metadata: {e}")))?;
        let meta = if meta_raw.is_empty() {
            Meta::new()
        } else {
            Meta::from_valid_wire(Bytes::copy_from_slice(meta_raw))
        };
        let body = match d.place & (Desc::BODY_IN_ARENA | Desc::BODY_EXTERNAL | Desc::BODY_INLINE) {
            0 if d.body_len == 0 => Bytes::new(),
            Desc::BODY_INLINE => {
                if d.place & Desc::HEAD_IN_ARENA != 0
                    || head_len as u64 + d.body_len > Desc::INLINE as u64
                {
                    return Err(corrupt("inline body does not fit the descriptor"));
                }
                Bytes::copy_from_slice(&d.inline[head_len..head_len + d.body_len as usize])
            }
            Desc::BODY_IN_ARENA => {
                let at = arena::validate(arena_len, d.body_at, d.body_len)
                    .ok_or_else(|| corrupt("body block out of the arena"))?;
                let ptr = self.refs.ptr(at);
                let len = d.body_len as usize;
                if d.body_len <= COPY_MAX {
                    // SAFETY: inside the arena (validated), published to us and not reused by
                    // the producer before we release it just below.
                    let b = Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
                    self.release(d.body_at);
                    b
                } else {
                    Bytes::from_owner(RecvLease {
                        sh: self.sh.clone(),
                        refs: self.refs.clone(),
                        at: d.body_at,
                        ptr,
                        len,
                    })
                }
            }
            Desc::BODY_EXTERNAL => {
                if d.body_at != self.external_next {
                    return Err(corrupt("external bodies out of order"));
                }
                let fd = self
                    .sh
                    .external
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .pop_front();
                let Some(fd) = fd else {
                    return Err(corrupt("external body vanished from the queue"));
                };
                self.external_next += 1;
                self.open_external(fd, d.body_len)?
            }
            _ => return Err(corrupt("inconsistent body placement")),
        };
        Ok(Step::Message(Message::from_parts(
            kind,
            meta,
            Body::from(body),
            Header {
                flags,
                correlation: d.correlation,
            },
        )))
    }

    fn open_external(&self, fd: OwnedFd, len: u64) -> Result<Bytes> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| corrupt("external body is not a memfd"))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE) {
            return Err(corrupt("external body memfd is not sealed"));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| Error::io("inspecting an external body", e.into()))?
            .st_size as u64;
        if size != len {
            return Err(corrupt(format!(
                "external body is {size} bytes, announced {len}"
            )));
        }
        let map =
            Mapping::new(&fd, len, false).map_err(|e| Error::io("mapping an external body", e))?;
        Ok(Bytes::from_owner(ExternalBody {
            map,
            sh: self.sh.clone(),
        }))
    }

    /// Takes up to a batch of published descriptors into `batch`.
    fn fill(&mut self) -> Result<Filled> {
        let n = self.ring.available().map_err(corrupt)?.min(BATCH);
        let mut taken = 0;
        let mut waiting = false;
        for i in 0..n {
            let d = self.ring.read(i);
            match self.decode(&d)? {
                Step::Message(m) => self.batch.push_back(m),
                Step::WaitExternal => {
                    waiting = true;
                    break;
                }
            }
            taken += 1;
        }
        if taken > 0 && self.ring.consume(taken) {
            signal(self.sh.in_space.as_fd());
        }
        Ok(if taken > 0 {
            Filled::Some
        } else if waiting {
            Filled::WaitExternal
        } else {
            Filled::Empty
        })
    }

    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        loop {
            if let Some(m) = self.batch.pop_front() {
                return Poll::Ready(Some(Ok(m)));
            }
            match self.fill()? {
                Filled::Some => continue,
                Filled::WaitExternal => {
                    // The next descriptor's body is a memfd that has not come through the
                    // socket yet: the watcher wakes us when it does (or when the peer is gone).
                    self.sh.external_waker.register(cx.waker());
                    if !self
                        .sh
                        .external
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .is_empty()
                    {
                        continue;
                    }
                    if self.sh.gone() {
                        return Poll::Ready(Some(Err(Error::new(
                            ErrorKind::ConnectionLost,
                            "the shared-memory peer went away while sending a large body",
                        ))));
                    }
                    return Poll::Pending;
                }
                Filled::Empty => {}
            }
            if self.ring.is_finished().map_err(corrupt)? {
                return Poll::Ready(None);
            }
            if self.sh.gone() {
                // Published before the peer went? Take it first.
                if self.ring.available().map_err(corrupt)? > 0 {
                    continue;
                }
                return Poll::Ready(Some(Err(Error::new(
                    ErrorKind::ConnectionLost,
                    format!(
                        "the shared-memory peer {} went away without closing the channel (did it exit or crash?)",
                        self.sh.peer
                    ),
                ))));
            }
            if spin_until(|| Ok(self.ring.available().map_err(corrupt)? > 0 || self.sh.gone()))? {
                continue;
            }
            if self.sh.busy_poll {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.ring.prepare_park();
            if self.ring.available().map_err(corrupt)? > 0
                || self.ring.is_finished().map_err(corrupt)?
                || self.sh.gone()
            {
                self.ring.cancel_park();
                continue;
            }
            match poll_eventfd(&self.sh.in_data, cx) {
                Poll::Ready(r) => r?,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

enum Filled {
    Some,
    Empty,
    WaitExternal,
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
                    tracing::warn!(peer = %self.sh.peer, "closing shared-memory channel: {e}");
                    // Stop the peer: nothing it sends will be read.
                    self.ring.close();
                    signal(self.sh.in_space.as_fd());
                }
                Poll::Ready(other)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for ShmReceiver {
    fn drop(&mut self) {
        let queued = self.batch.len();
        if queued > 0 {
            tracing::debug!(
                messages = queued,
                "shm receiver dropped with messages taken but not read"
            );
        }
        // STOP: the peer's Sender fails from now on. Wake it in case it waits for room.
        self.ring.close();
        signal(self.sh.in_space.as_fd());
        self.sh.half_dropped();
    }
}

/// The receiver's reference to a body in the peer's arena.
struct RecvLease {
    sh: Arc<Shared>,
    refs: ShmArena,
    at: u64,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `ptr` points into the mapping kept alive by `refs`; the block stays reserved for
// this lease (its reference count) so the producer does not reuse it while the lease lives.
unsafe impl Send for RecvLease {}

impl AsRef<[u8]> for RecvLease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes inside the arena (validated when received), published to us and
        // not reused before this lease releases the block. A well-behaved producer does not
        // write a published block; a misbehaving one can change the bytes, not their bounds.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for RecvLease {
    fn drop(&mut self) {
        if arena::release(&self.refs, self.at) {
            self.sh.wake_peer_sender();
        }
    }
}

/// A received body in a sealed memfd of its own.
struct ExternalBody {
    map: Mapping,
    sh: Arc<Shared>,
}

impl AsRef<[u8]> for ExternalBody {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the whole read-only mapping of a memfd sealed against writes and resizing.
        unsafe { std::slice::from_raw_parts(self.map.base(), self.map.len()) }
    }
}

impl Drop for ExternalBody {
    fn drop(&mut self) {
        self.sh
            .in_ring()
            .control()
            .ext_released
            .fetch_add(1, crate::loom::sync::Ordering::Release);
        self.sh.wake_peer_sender();
    }
}
