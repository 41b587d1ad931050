//! The body arena of one direction: a circular allocator in shared memory whose blocks are
//! released by reference count, in any order, and reclaimed by the producer in allocation
//! order.
//!
//! A block is a 64-byte header (its reference count, alone on its cache line) and the payload,
//! rounded up to 64 bytes. Only the producer allocates and reclaims, keeping the list of live
//! blocks in its own memory. The shared count is the consumer's: one reference per descriptor
//! that points at the block, dropped when the receiver is done with it. The producer's own
//! references — a block it lent out with `Sender::alloc` and that the application still holds
//! — are [`Hold`]s in process memory, which the peer cannot reach: a block is reused only when
//! its hold is released **and** its shared count is zero. So a misbehaving consumer can hold
//! blocks (the sender waits, which is backpressure) or release them early (which corrupts only
//! what that consumer reads), but it can never make the producer hand out a block that is
//! still in use on its side. The producer reclaims free blocks from the oldest on, so a body
//! held for long delays reuse of everything after it.
//!
//! When a block does not fit before the end of the arena, the rest of the arena is skipped and
//! the block starts again at offset 0; when the arena is empty, allocation starts over at 0.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::loom::sync::{AtomicU32, Ordering};

/// Bytes of a block header; also the alignment of blocks and payloads.
pub(crate) const BLOCK_ALIGN: u64 = 64;

/// Where the blocks' reference counts live.
pub(crate) trait BlockRefs {
    /// The reference count of the block at `offset` (a multiple of [`BLOCK_ALIGN`] below
    /// `len()`).
    fn refs(&self, offset: u64) -> &AtomicU32;
    /// The arena's size in bytes, a multiple of [`BLOCK_ALIGN`].
    fn len(&self) -> u64;
}

/// The bytes a block for `payload` bytes takes.
pub(crate) fn block_len(payload: u64) -> u64 {
    BLOCK_ALIGN + payload.div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN
}

/// Drops one reference to the block at `offset`. True when it was the last (the block is
/// free; a producer waiting for room may have to be woken).
pub(crate) fn release(refs: &impl BlockRefs, offset: u64) -> bool {
    // SYNC POINT with the `refs` load in `ArenaProducer::reclaim`: everything this side did
    // with the payload happens before the producer reuses the block.
    refs.refs(offset).fetch_sub(1, Ordering::Release) == 1
}

/// Adds one reference to the block at `offset` (a descriptor that points at a block the
/// producer holds).
pub(crate) fn retain(refs: &impl BlockRefs, offset: u64) {
    refs.refs(offset).fetch_add(1, Ordering::Relaxed);
}

/// The producer's own reference to a block it lent out, in process memory.
#[derive(Debug)]
pub(crate) struct Hold(AtomicU32);

impl Hold {
    /// Lets the producer reuse the block (once the consumer is done with it too).
    pub(crate) fn release(&self) {
        // SYNC POINT with the `held` load in `ArenaProducer::reclaim`: what the holder wrote
        // or read happens before the block is reused.
        self.0.store(0, Ordering::Release);
    }

    fn held(&self) -> bool {
        self.0.load(Ordering::Acquire) != 0
    }
}

/// Checks that a block announced by the peer lies inside the arena: `offset` aligned and the
/// header plus `payload` bytes within bounds. Returns the payload's offset.
pub(crate) fn validate(len: u64, offset: u64, payload: u64) -> Option<u64> {
    let end = offset.checked_add(BLOCK_ALIGN)?.checked_add(payload)?;
    (offset.is_multiple_of(BLOCK_ALIGN) && end <= len).then_some(offset + BLOCK_ALIGN)
}

#[derive(Debug)]
struct Live {
    /// Position (monotonic, not wrapped) of the block's start.
    start: u64,
    len: u64,
    /// Skipped space at the end of the arena: no header, free at once.
    skip: bool,
    /// The producer's own hold, for a block lent out with `alloc_held`.
    hold: Option<Arc<Hold>>,
}

/// The producer's allocator state.
#[derive(Debug)]
pub(crate) struct ArenaProducer {
    len: u64,
    /// Next allocation position (monotonic).
    alloc: u64,
    /// Everything before this position is free.
    reclaimed: u64,
    live: VecDeque<Live>,
}

impl ArenaProducer {
    pub(crate) fn new(len: u64) -> ArenaProducer {
        debug_assert!(len.is_multiple_of(BLOCK_ALIGN) && len > 0);
        ArenaProducer {
            len,
            alloc: 0,
            reclaimed: 0,
            live: VecDeque::new(),
        }
    }

    /// True when a block for `payload` bytes can never fit (the body goes elsewhere).
    pub(crate) fn too_large(&self, payload: u64) -> bool {
        block_len(payload) > self.len
    }

    /// Where a block of `need` bytes would go now: the bytes to skip at the end of the arena
    /// first, or `None` when it does not fit until blocks are reclaimed.
    fn fit(&self, need: u64) -> Option<u64> {
        let pos = self.alloc % self.len;
        let skip = if pos + need > self.len {
            self.len - pos
        } else {
            0
        };
        (self.alloc + skip + need - self.reclaimed <= self.len).then_some(skip)
    }

    /// Allocates a block for `payload` bytes whose shared count starts at `count` (the
    /// consumer's references); returns its offset, or `None` when there is no room even after
    /// reclaiming.
    pub(crate) fn alloc(&mut self, refs: &impl BlockRefs, payload: u64, count: u32) -> Option<u64> {
        self.place(refs, payload, count, None)
    }

    /// Allocates a block for `payload` bytes that the producer holds (shared count zero): it
    /// is not reused before the returned [`Hold`] is released.
    pub(crate) fn alloc_held(
        &mut self,
        refs: &impl BlockRefs,
        payload: u64,
    ) -> Option<(u64, Arc<Hold>)> {
        let hold = Arc::new(Hold(AtomicU32::new(1)));
        let at = self.place(refs, payload, 0, Some(hold.clone()))?;
        Some((at, hold))
    }

    fn place(
        &mut self,
        refs: &impl BlockRefs,
        payload: u64,
        count: u32,
        hold: Option<Arc<Hold>>,
    ) -> Option<u64> {
        let need = block_len(payload);
        if need > self.len {
            return None;
        }
        loop {
            if let Some(skip) = self.fit(need) {
                if skip > 0 {
                    self.live.push_back(Live {
                        start: self.alloc,
                        len: skip,
                        skip: true,
                        hold: None,
                    });
                    self.alloc += skip;
                }
                let offset = self.alloc % self.len;
                // The block was free (count 0 seen with Acquire in `reclaim`, or never used):
                // nobody else touches its count until it is published.
                refs.refs(offset).store(count, Ordering::Relaxed);
                self.live.push_back(Live {
                    start: self.alloc,
                    len: need,
                    skip: false,
                    hold,
                });
                self.alloc += need;
                return Some(offset);
            }
            if !self.reclaim(refs) {
                return None;
            }
        }
    }

    /// True when a block for `payload` bytes could be allocated now (reclaiming first).
    pub(crate) fn has_room(&mut self, refs: &impl BlockRefs, payload: u64) -> bool {
        let need = block_len(payload);
        if need > self.len {
            return true; // never in the arena: not ours to wait for
        }
        loop {
            if self.fit(need).is_some() {
                return true;
            }
            if !self.reclaim(refs) {
                return false;
            }
        }
    }

    /// Reclaims free blocks from the oldest on. True when any space was freed.
    pub(crate) fn reclaim(&mut self, refs: &impl BlockRefs) -> bool {
        let before = self.reclaimed;
        while let Some(b) = self.live.front() {
            // SYNC POINT with the `fetch_sub` in `release` and the store in `Hold::release`.
            if !b.skip
                && (b.hold.as_ref().is_some_and(|h| h.held())
                    || refs.refs(b.start % self.len).load(Ordering::Acquire) != 0)
            {
                break;
            }
            self.reclaimed = b.start + b.len;
            self.live.pop_front();
        }
        if self.live.is_empty() {
            // Empty: start over at offset 0, so that no skip is needed for a while.
            let rest = self.alloc % self.len;
            if rest != 0 {
                self.alloc += self.len - rest;
            }
            self.reclaimed = self.alloc;
        }
        self.reclaimed != before
    }

    /// Bytes in live blocks (including skipped space).
    #[cfg(test)]
    pub(crate) fn used(&self) -> u64 {
        self.alloc - self.reclaimed
    }
}

/// An arena's reference counts in process memory: loom models and unit tests.
#[cfg(test)]
pub(crate) mod heap {
    use super::*;

    pub(crate) struct HeapRefs(pub(crate) Vec<AtomicU32>);

    impl HeapRefs {
        pub(crate) fn new(len: u64) -> HeapRefs {
            HeapRefs((0..len / BLOCK_ALIGN).map(|_| AtomicU32::new(0)).collect())
        }
    }

    impl BlockRefs for HeapRefs {
        fn refs(&self, offset: u64) -> &AtomicU32 {
            &self.0[(offset / BLOCK_ALIGN) as usize]
        }
        fn len(&self) -> u64 {
            self.0.len() as u64 * BLOCK_ALIGN
        }
    }

    impl<T: BlockRefs> BlockRefs for std::sync::Arc<T> {
        fn refs(&self, offset: u64) -> &AtomicU32 {
            (**self).refs(offset)
        }
        fn len(&self) -> u64 {
            (**self).len()
        }
    }
}

#[cfg(all(test, not(hyperframes_loom)))]
mod tests {
    use super::heap::HeapRefs;
    use super::*;

    #[test]
    fn allocates_releases_out_of_order_and_reclaims_in_order() {
        let refs = HeapRefs::new(1024);
        let mut a = ArenaProducer::new(1024);
        let b1 = a.alloc(&refs, 100, 1).unwrap(); // 64 + 128
        let b2 = a.alloc(&refs, 100, 1).unwrap();
        let b3 = a.alloc(&refs, 100, 1).unwrap();
        assert_eq!((b1, b2, b3), (0, 192, 384));
        assert!(a.alloc(&refs, 400, 1).is_none(), "576 + 464 > 1024");
        // Releasing the second and third does not free space: the first still holds it.
        assert!(release(&refs, b2));
        assert!(release(&refs, b3));
        assert!(!a.reclaim(&refs));
        assert!(a.alloc(&refs, 400, 1).is_none());
        assert!(release(&refs, b1));
        // Now everything is free: the allocator starts over at 0.
        assert_eq!(a.alloc(&refs, 400, 1), Some(0));
    }

    #[test]
    fn wraps_with_a_skip() {
        let refs = HeapRefs::new(1024);
        let mut a = ArenaProducer::new(1024);
        let x = a.alloc(&refs, 600, 1).unwrap(); // 0..704
        let y = a.alloc(&refs, 100, 1).unwrap(); // 704..896
        assert!(release(&refs, x));
        // 300 bytes need 384: they do not fit in 896..1024, so the tail is skipped.
        assert_eq!(a.alloc(&refs, 300, 1), Some(0));
        assert_eq!(a.used(), (1024 - 704) + 384);
        assert!(release(&refs, y));
    }

    #[test]
    fn held_blocks_wait_for_the_hold_and_the_consumer() {
        let refs = HeapRefs::new(512);
        let mut a = ArenaProducer::new(512);
        let (b, hold) = a.alloc_held(&refs, 64).unwrap();
        retain(&refs, b); // a descriptor points at it
        // 64 + 448 bytes do not fit beside the held 128-byte block...
        assert!(a.alloc(&refs, 400, 1).is_none());
        hold.release();
        assert!(
            a.alloc(&refs, 400, 1).is_none(),
            "the consumer still reads it"
        );
        assert!(release(&refs, b));
        // ...and do once both let go of it.
        assert_eq!(a.alloc(&refs, 400, 1), Some(0));
    }

    /// A peer that zeroes (or wraps) the shared count of a block the producer still holds
    /// cannot make the producer hand the block out again.
    #[test]
    fn a_peer_cannot_free_a_held_block() {
        let refs = HeapRefs::new(4096);
        let mut a = ArenaProducer::new(4096);
        let (held, hold) = a.alloc_held(&refs, 2000).unwrap();
        for forged in [0, u32::MAX] {
            refs.refs(held).store(forged, Ordering::Relaxed);
            assert!(
                a.alloc(&refs, 2500, 1).is_none(),
                "count forged to {forged}"
            );
        }
        refs.refs(held).store(0, Ordering::Relaxed);
        hold.release();
        assert_eq!(a.alloc(&refs, 2500, 1), Some(0));
    }

    #[test]
    fn validation() {
        assert_eq!(validate(1024, 0, 960), Some(64));
        assert_eq!(validate(1024, 0, 961), None);
        assert_eq!(validate(1024, 32, 1), None);
        assert_eq!(validate(1024, u64::MAX - 63, 1), None);
        assert!(ArenaProducer::new(1024).too_large(961));
    }
}

#[cfg(all(test, hyperframes_loom))]
mod loom_models {
    use super::heap::HeapRefs;
    use super::*;
    use crate::loom::sync::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64;

    /// Blocks released by another thread, out of order, are reused only after the release:
    /// the producer writes each block's payload (an `UnsafeCell` per block, so that loom
    /// reports a write racing the consumer's read) and the consumer reads it before releasing.
    #[test]
    fn release_happens_before_reuse() {
        loom::model(|| {
            const LEN: u64 = 4 * BLOCK_ALIGN; // room for two blocks of 64 bytes
            let refs = Arc::new(HeapRefs::new(LEN));
            let payload: Arc<Vec<UnsafeCell<u64>>> =
                Arc::new((0..LEN / BLOCK_ALIGN).map(|_| UnsafeCell::new(0)).collect());
            // Hand-off of offsets and values, standing in for the descriptor ring.
            let mailbox: Arc<Vec<AtomicU64>> =
                Arc::new((0..3).map(|_| AtomicU64::new(u64::MAX)).collect());
            let (r2, p2, m2) = (refs.clone(), payload.clone(), mailbox.clone());
            let consumer = loom::thread::spawn(move || {
                // Take the first two messages, release them in reverse order.
                let mut offs = Vec::new();
                for i in 0..2 {
                    let off = loop {
                        let v = m2[i].load(Ordering::Acquire);
                        if v != u64::MAX {
                            break v;
                        }
                        loom::thread::yield_now();
                    };
                    let unit = (off / BLOCK_ALIGN) as usize;
                    // SAFETY: the block is published to us; the producer does not write it
                    // until we release it (what loom checks).
                    let v = p2[unit].with(|p| unsafe { *p });
                    assert_eq!(v, i as u64 + 1);
                    offs.push(off);
                }
                release(&*r2, offs[1]);
                release(&*r2, offs[0]);
            });
            let mut a = ArenaProducer::new(LEN);
            for i in 0..3u64 {
                let off = loop {
                    if let Some(o) = a.alloc(&*refs, 64, 1) {
                        break o;
                    }
                    loom::thread::yield_now();
                };
                let unit = (off / BLOCK_ALIGN) as usize;
                // SAFETY: a freshly allocated block is ours alone until published.
                payload[unit].with_mut(|p| unsafe { *p = i + 1 });
                if (i as usize) < 2 {
                    mailbox[i as usize].store(off, Ordering::Release);
                }
            }
            consumer.join().unwrap();
        });
    }

    /// A block lent out with `alloc_held` is reused only after its hold is released by the
    /// thread that holds it, and that thread's writes happen before the reuse.
    #[test]
    fn hold_release_happens_before_reuse() {
        loom::model(|| {
            const LEN: u64 = 2 * BLOCK_ALIGN; // room for one block of 64 bytes
            let refs = HeapRefs::new(LEN);
            let payload = Arc::new(UnsafeCell::new(0u64));
            let mut a = ArenaProducer::new(LEN);
            let (first, hold) = a.alloc_held(&refs, 64).unwrap();
            let p2 = payload.clone();
            let holder = loom::thread::spawn(move || {
                // SAFETY: the block is held for this thread until it releases the hold.
                p2.with_mut(|p| unsafe { *p = 7 });
                hold.release();
            });
            let again = loop {
                if let Some(o) = a.alloc(&refs, 64, 1) {
                    break o;
                }
                loom::thread::yield_now();
            };
            assert_eq!(again, first);
            // SAFETY: reused only after the holder released it (what loom checks).
            payload.with_mut(|p| unsafe { *p = 8 });
            holder.join().unwrap();
        });
    }
}
