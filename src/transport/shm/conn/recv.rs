//! The receiving half: the consumer of the other direction's ring, which copies out and
//! checks every descriptor (`desc::check`) before reading through it, and hands bodies out as
//! copies or as leases of the arena (and of external memfds) released on drop.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;

use super::{Shared, corrupt, poll_wake, wake};
use crate::error::{Error, Result};
use crate::message::{Body, Header, Message};
use crate::message::{Limits, TypeCache};
use crate::transport::shm::arena::{self, BlockRefs};
use crate::transport::shm::desc::{self, Bounds, Layout, Part};
use crate::transport::shm::ring::{self, RingStore};
use crate::transport::shm::segment::{Mapping, ShmArena, ShmRing};
use crate::transport::{RecvHalf, SPIN, spin_until};

/// Bodies up to this size are copied out of the arena on receive (and their block freed at
/// once): cheaper than a lease, and it keeps small messages from pinning the arena.
const COPY_MAX: u64 = 1024;
/// Descriptors read before their slots are handed back to the producer (sooner when the ring
/// runs empty).
const BATCH: u64 = 64;
/// Small received parts (inline bodies, metadata) are copied into chunks of this size, one
/// allocation per chunk instead of one per part.
const CHUNK: usize = 16 << 10;

pub(crate) struct ShmReceiver {
    sh: Arc<Shared>,
    ring: ring::Consumer<ShmRing>,
    refs: ShmArena,
    limits: Limits,
    bounds: Bounds,
    types: TypeCache,
    chunk: Chunk,
    done: bool,
    /// Where device bodies land, and the device that maps those the peer lends.
    #[cfg(feature = "cuda")]
    landing: super::lend::Landing,
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
    /// `lend`: device bodies the peer lends are mapped (this side says it maps them when it
    /// lands on a device); otherwise they come staged.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn new(sh: Arc<Shared>, limits: Limits, lend: bool) -> ShmReceiver {
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
            #[cfg(feature = "cuda")]
            landing: super::lend::Landing::new(lend),
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
            #[cfg(feature = "cuda")]
            landing,
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
            Part::Empty => Body::new(),
            Part::Inline { at, len } => Body::from(chunk.copy(&inline[at..at + len])),
            Part::Block { block, len } => {
                let at = desc::payload(block);
                Body::from(if len <= COPY_MAX || !sh.zero_copy {
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
                })
            }
            Part::External { .. } => Body::from(Bytes::from_owner(ExternalBody {
                map: external.expect("taken above"),
                sh: sh.clone(),
            })),
            #[cfg(feature = "cuda")]
            Part::Device { slot, len } => landing.take(sh, slot, len)?,
            #[cfg(not(feature = "cuda"))]
            Part::Device { .. } => {
                return Err(corrupt(
                    "a device body lent, which this build (without `cuda`) never asks for",
                ));
            }
        };
        Ok(Step::Message(Message::from_parts(
            kind.clone(),
            meta,
            body,
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
    #[cfg(feature = "cuda")]
    fn land_on(&mut self, gpu: Option<&crate::device::Gpu>) {
        self.landing.set(&self.sh, gpu);
    }

    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.poll_inner(cx) {
            Poll::Ready(Some(Ok(m))) => Poll::Ready(Some(Ok(m))),
            Poll::Ready(other) => {
                self.done = true;
                if let Some(Err(e)) = &other {
                    if e.is_protocol() {
                        tracing::warn!(peer = %self.sh.peer, "closing shared-memory channel: {e:#}");
                    }
                    // Stop the peer: nothing it sends will be read (it fails instead of
                    // waiting for room that never comes).
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
