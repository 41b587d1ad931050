//! The sending half: the producer of its direction's descriptor ring and body arena, writing
//! straight into the segment (or sending a body as a memfd of its own when the arena cannot
//! hold it), and the leases of blocks allocated in place (`Sender::alloc`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use rustix::fs::{MemfdFlags, SealFlags};

use super::{MAX_EXTERNAL, Shared, corrupt, poll_wake, wake};
use crate::error::{Error, ErrorKind, Result};
use crate::message::{Body, BodyMut, LeaseTag, LentMut, Message};
use crate::transport::shm::arena::{self, ArenaProducer, BlockRefs, Hold};
use crate::transport::shm::desc::{self, BodyPlace, Desc, HeadPlace};
use crate::transport::shm::rendezvous::{self, ExtRecord};
use crate::transport::shm::ring::{self, RingStore};
use crate::transport::shm::segment::{Mapping, ShmArena, ShmRing};
use crate::transport::{Count, SPIN, SendHalf, spin_until};

/// True for a body in device memory (which reaches the half only to be lent).
fn is_device(body: &Body) -> bool {
    #[cfg(feature = "cuda")]
    return body.as_device().is_some();
    #[cfg(not(feature = "cuda"))]
    return {
        let _ = body;
        false
    };
}

/// Descriptors written before the producer checks whether the consumer sleeps (it always
/// does before it waits or returns from a send).
const PUBLISH_EVERY: u64 = 64;
/// How long a sender with two large bodies in flight waits for one to come back before it
/// takes colder memory for a third (see `ArenaProducer::deep`): a body filled in memory the
/// receiver just read is read again from the caches, at several times memory speed.
const HOT_WAIT: Duration = Duration::from_micros(300);
/// Lease tags of shm arenas carry this bit, so they never match another transport's.
const REGION_SHM: u64 = 1 << 63;

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
    /// Device bodies accepted for lending (`takes_device`), in the order they are staged:
    /// each has its handle and a reserved slot.
    #[cfg(feature = "cuda")]
    prepared: VecDeque<crate::transport::shm::device::DeviceRecord>,
    #[cfg(feature = "cuda")]
    told: super::lend::Told,
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
            #[cfg(feature = "cuda")]
            prepared: VecDeque::new(),
            #[cfg(feature = "cuda")]
            told: Default::default(),
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

    /// [`write_one`](Self::write_one); after an error (the connection is broken) no prepared
    /// device body is left to be matched with a later message.
    fn write(&mut self, msg: Message) -> Result<std::result::Result<(), (Message, NoRoom)>> {
        let r = self.write_one(msg);
        #[cfg(feature = "cuda")]
        if r.is_err() {
            self.prepared.clear();
        }
        r
    }

    /// Writes `msg` into the ring and arena, or hands it back with what was missing. Whatever
    /// is missing is found before anything of the message is written, except arena room for
    /// the body after its head took a block (that block is released again).
    fn write_one(&mut self, msg: Message) -> Result<std::result::Result<(), (Message, NoRoom)>> {
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
        // A device body here is lent (`takes_device` said so): only its head is placed.
        let lent = is_device(body);
        let plan = desc::plan(
            head_len,
            if lent { 0 } else { body_len },
            in_place.is_some(),
            self.refs.len(),
        );
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
            BodyPlace::Empty if lent => {
                if let Err(e) = self.lend(&mut d, body) {
                    if let Some(h) = head_block {
                        arena::release(&self.refs, h);
                    }
                    return Err(e);
                }
            }
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

    /// Lends the device body `body` in a slot of the device table (its handle was prepared
    /// by `takes_device`).
    #[cfg(feature = "cuda")]
    fn lend(&mut self, d: &mut desc::Builder, body: &Body) -> Result<()> {
        // `takes_device` prepared every device body it let through, unless an error broke
        // the connection since (`write` then drops what was prepared).
        let rec = self.prepared.pop_front().ok_or_else(|| {
            Error::new(
                ErrorKind::ConnectionLost,
                format!(
                    "the channel to {} failed before a device body was lent",
                    self.sh.peer
                ),
            )
        })?;
        let slot = self
            .sh
            .lend(body.as_device().expect("a device body"), &rec)?;
        d.place(Desc::BODY_DEVICE);
        d.body_at(slot);
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn lend(&mut self, _: &mut desc::Builder, _: &Body) -> Result<()> {
        unreachable!("device bodies exist with the `cuda` feature only")
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
            #[cfg(feature = "cuda")]
            prepared: VecDeque::new(),
            #[cfg(feature = "cuda")]
            told: Default::default(),
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
            if is_device(msg.body()) {
                // `takes_device` prepared it: not sent, not lent.
                #[cfg(feature = "cuda")]
                self.prepared.pop_back();
            }
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

    #[cfg(feature = "cuda")]
    fn takes_device(
        &mut self,
        body: &crate::device::DeviceBody,
    ) -> Option<crate::transport::DeviceWay> {
        let rec = super::lend::prepare(&self.sh, body, self.prepared.len(), &mut self.told)?;
        self.prepared.push_back(rec);
        Some(crate::transport::DeviceWay::CudaIpc)
    }

    fn unstage(&mut self) -> Option<Message> {
        let m = self.staged.pop_back()?;
        let head = (m.kind().len() + m.meta().encoded_len()) as u64;
        let body = if is_device(m.body()) {
            #[cfg(feature = "cuda")]
            self.prepared.pop_back();
            0
        } else {
            m.body().len() as u64
        };
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
