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
//! still in use on its side. Free blocks are reclaimed from the ends of the span, so a body
//! held for long keeps the blocks beside it from being reused until the span's ends reach it
//! (the sender then waits for room: backpressure).
//!
//! The live blocks form one span, extended and reclaimed at both ends (see [`ArenaProducer`]),
//! so freed memory is reused while it is still in the caches. When a block does not fit
//! before an end of the arena, the bytes up to that end are skipped; when the arena is empty,
//! allocation starts over at 0.

// The loom seam holds here: std's atomics are refused (clippy.toml).
#![deny(clippy::disallowed_types, clippy::disallowed_methods)]

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
    /// Arena offset of the block's start.
    offset: u64,
    len: u64,
    /// Skipped space at one end of the arena: no header, free at once.
    skip: bool,
    /// The producer's own hold, for a block lent out with `alloc_held`.
    hold: Option<Arc<Hold>>,
}

/// An end of the span of live blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Front,
    Back,
}

/// Blocks of at least this many bytes reclaim before they look for room, so that they can
/// take the place of a block freed just now: for them the caches matter more than the two
/// loads that costs.
const HOT_MIN: u64 = 4096;

/// The producer's allocator state.
///
/// The live blocks occupy one span of the arena, circularly: `[front, back)`, `used` bytes,
/// and the free space is the rest, also one span. A block is placed at either end of the
/// live span — after `back` or before `front` — and reclaimed at either end once free, so
/// the free space stays one span (a block fits whenever it fits in one piece of it: the same
/// room as a plain ring). A block goes before the front when it fits there without wrapping,
/// after the back otherwise, so the span keeps sliding back towards offset 0: a stream with
/// a few bodies in flight cycles through the same few blocks, which stay in the caches,
/// instead of walking the whole arena.
#[derive(Debug)]
pub(crate) struct ArenaProducer {
    len: u64,
    /// Offset of the first live byte (when `used > 0`).
    front: u64,
    /// Offset one past the last live byte.
    back: u64,
    used: u64,
    /// Live blocks and skips, from `front` to `back`.
    live: VecDeque<Live>,
}

impl ArenaProducer {
    pub(crate) fn new(len: u64) -> ArenaProducer {
        debug_assert!(len.is_multiple_of(BLOCK_ALIGN) && len > 0);
        ArenaProducer {
            len,
            front: 0,
            back: 0,
            used: 0,
            live: VecDeque::new(),
        }
    }

    /// True when a block for `payload` bytes can never fit (the body goes elsewhere).
    pub(crate) fn too_large(&self, payload: u64) -> bool {
        block_len(payload) > self.len
    }

    /// Where a block of `need` bytes would go at `end`: the bytes to skip at that end of the
    /// arena first, or `None` when it does not fit until blocks are reclaimed.
    fn fit(&self, end: End, need: u64) -> Option<u64> {
        let skip = match end {
            // After `back`; skip the rest of the arena when it does not fit before the end.
            End::Back if self.back + need > self.len => self.len - self.back,
            // Before `front` (at the arena's end when `front` is 0); skip the bytes before
            // `front` when it does not fit after offset 0.
            End::Front if self.front != 0 && self.front < need => self.front,
            _ => 0,
        };
        (self.used + skip + need <= self.len).then_some(skip)
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

    /// An end where a block of `need` bytes fits now, and its skip: before the front when it
    /// fits there without wrapping (towards offset 0), after the back otherwise.
    fn choose(&mut self, need: u64) -> Option<(End, u64)> {
        if self.used == 0 {
            // Empty: start over at offset 0.
            (self.front, self.back) = (0, 0);
        }
        let order = if self.used > 0 && self.front >= need {
            [End::Front, End::Back]
        } else {
            [End::Back, End::Front]
        };
        order
            .into_iter()
            .find_map(|end| self.fit(end, need).map(|skip| (end, skip)))
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
        if need >= HOT_MIN {
            self.reclaim(refs);
        }
        loop {
            if let Some((end, skip)) = self.choose(need) {
                let offset = self.put(end, skip, need, hold);
                // The block was free (count 0 seen with Acquire in `reclaim`, or never used):
                // nobody else touches its count until it is published.
                refs.refs(offset).store(count, Ordering::Relaxed);
                return Some(offset);
            }
            if !self.reclaim(refs) {
                return None;
            }
        }
    }

    /// Records a block of `need` bytes at `end`, after `skip` bytes; returns its offset.
    fn put(&mut self, end: End, skip: u64, need: u64, hold: Option<Arc<Hold>>) -> u64 {
        self.used += skip + need;
        match end {
            End::Back => {
                if skip > 0 {
                    self.live.push_back(Live {
                        offset: self.back,
                        len: skip,
                        skip: true,
                        hold: None,
                    });
                    self.back = 0;
                }
                let offset = self.back;
                self.live.push_back(Live {
                    offset,
                    len: need,
                    skip: false,
                    hold,
                });
                self.back = (offset + need) % self.len;
                if self.live.len() == 1 {
                    self.front = offset;
                }
                offset
            }
            End::Front => {
                if skip > 0 {
                    self.live.push_front(Live {
                        offset: 0,
                        len: skip,
                        skip: true,
                        hold: None,
                    });
                    self.front = 0;
                }
                let end = if self.front == 0 {
                    self.len
                } else {
                    self.front
                };
                let offset = end - need;
                self.live.push_front(Live {
                    offset,
                    len: need,
                    skip: false,
                    hold,
                });
                self.front = offset;
                if self.live.len() == 1 {
                    self.back = (offset + need) % self.len;
                }
                offset
            }
        }
    }

    /// True when two or more blocks the size of `payload` are in flight already: a third
    /// would go to memory the caches no longer hold. The sender then waits a little for one
    /// to come back (see `conn`), as a queue two deep would make it.
    pub(crate) fn deep(&mut self, refs: &impl BlockRefs, payload: u64) -> bool {
        let need = block_len(payload);
        if need < HOT_MIN || self.used < 2 * need {
            return false;
        }
        self.reclaim(refs);
        self.used >= 2 * need
    }

    /// True when a block for `payload` bytes could be allocated now (reclaiming first).
    pub(crate) fn has_room(&mut self, refs: &impl BlockRefs, payload: u64) -> bool {
        let need = block_len(payload);
        if need > self.len {
            return true; // never in the arena: not ours to wait for
        }
        loop {
            if self.choose(need).is_some() {
                return true;
            }
            if !self.reclaim(refs) {
                return false;
            }
        }
    }

    /// Reclaims free blocks at both ends of the live span. True when any space was freed.
    pub(crate) fn reclaim(&mut self, refs: &impl BlockRefs) -> bool {
        let free = |b: &Live| {
            // SYNC POINT with the `fetch_sub` in `release` and the store in `Hold::release`.
            b.skip
                || (!b.hold.as_ref().is_some_and(|h| h.held())
                    && refs.refs(b.offset).load(Ordering::Acquire) == 0)
        };
        let before = self.used;
        while let Some(b) = self.live.front().filter(|b| free(b)) {
            self.used -= b.len;
            self.front = (b.offset + b.len) % self.len;
            self.live.pop_front();
        }
        while let Some(b) = self.live.back().filter(|b| free(b)) {
            self.used -= b.len;
            self.back = b.offset;
            self.live.pop_back();
        }
        self.used != before
    }

    /// Bytes in live blocks (including skipped space).
    #[cfg(test)]
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// The live span's blocks as `(offset, len)`, front to back (skips included).
    #[cfg(test)]
    fn spans(&self) -> Vec<(u64, u64)> {
        self.live.iter().map(|b| (b.offset, b.len)).collect()
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
    fn allocates_releases_out_of_order_and_reclaims_at_the_ends() {
        let refs = HeapRefs::new(1024);
        let mut a = ArenaProducer::new(1024);
        let b1 = a.alloc(&refs, 100, 1).unwrap(); // 64 + 128
        let b2 = a.alloc(&refs, 100, 1).unwrap();
        let b3 = a.alloc(&refs, 100, 1).unwrap();
        assert_eq!((b1, b2, b3), (0, 192, 384));
        assert!(a.alloc(&refs, 400, 1).is_none(), "576 + 464 > 1024");
        // Releasing the middle one frees nothing: it is not at an end of the span.
        assert!(release(&refs, b2));
        assert!(!a.reclaim(&refs));
        assert!(a.alloc(&refs, 400, 1).is_none());
        // The last one is: the span shrinks to the first block, and the next block goes
        // after it (it does not fit before it).
        assert!(release(&refs, b3));
        assert_eq!(a.alloc(&refs, 400, 1), Some(192));
        assert!(release(&refs, b1));
        assert!(a.reclaim(&refs));
        assert_eq!(a.used(), 512);
    }

    #[test]
    fn wraps_with_a_skip() {
        let refs = HeapRefs::new(1024);
        let mut a = ArenaProducer::new(1024);
        let x = a.alloc(&refs, 600, 1).unwrap(); // 0..704
        let y = a.alloc(&refs, 100, 1).unwrap(); // 704..896
        assert!(release(&refs, x));
        // 300 bytes need 384: the freed front (0..704) takes them, before `y`.
        assert_eq!(a.alloc(&refs, 300, 1), Some(704 - 384));
        assert_eq!(a.used(), 384 + 192);
        // 500 bytes need 576: the span is 320..896, and neither after it (skip to 0, then
        // 320 bytes) nor before it (320 bytes) is there room.
        assert_eq!(a.alloc(&refs, 500, 1), None);
        assert!(release(&refs, y));
        // With `y` gone the span is 320..704: after it the end must be skipped (384 + 320 +
        // 576 > 1024), before it only 320 bytes. Still no room until the span shrinks.
        assert_eq!(a.alloc(&refs, 500, 1), None);
        let z = 704 - 384;
        assert!(release(&refs, z));
        assert!(a.alloc(&refs, 500, 1).is_some());
    }

    /// A stream with a few bodies in flight reuses the same few blocks near the start of the
    /// arena (the ones in the caches) instead of walking it; a deep one fills all of it.
    #[test]
    fn shallow_streams_reuse_hot_blocks() {
        let len = 64 * 1024;
        for depth in [1usize, 2, 3] {
            let refs = HeapRefs::new(len);
            let mut a = ArenaProducer::new(len);
            let mut flight = std::collections::VecDeque::new();
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..50 {
                if flight.len() == depth {
                    release(&refs, flight.pop_front().unwrap());
                }
                let b = a.alloc(&refs, 8000, 1).unwrap();
                seen.insert(b);
                flight.push_back(b);
            }
            // At most a block or two more than are in flight, all near the start.
            assert!(
                seen.len() <= depth + 2,
                "depth {depth}: blocks used {seen:?}"
            );
            let span = (depth as u64 + 2) * block_len(8000);
            assert!(seen.iter().all(|&o| o < span), "depth {depth}: {seen:?}");
        }
        let refs = HeapRefs::new(len);
        let mut a = ArenaProducer::new(len);
        let mut n = 0;
        while a.alloc(&refs, 4000, 1).is_some() {
            n += 1;
        }
        assert_eq!(n, len / block_len(4000));
    }

    proptest::proptest! {
        /// Random allocations and releases (in any order): live blocks never overlap and lie
        /// inside the arena, and once everything is released a block of any size that fits
        /// the arena can be allocated.
        #[test]
        fn blocks_never_overlap(
            ops in proptest::collection::vec((0u64..3000, 0usize..8, proptest::bool::ANY), 1..200),
        ) {
            let len = 16 * 1024;
            let refs = HeapRefs::new(len);
            let mut a = ArenaProducer::new(len);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (size, pick, alloc) in ops {
                if alloc || live.is_empty() {
                    if let Some(at) = a.alloc(&refs, size, 1) {
                        let span = (at, at + block_len(size));
                        proptest::prop_assert!(span.1 <= len, "{span:?} past the end");
                        for &(s, e) in &live {
                            proptest::prop_assert!(span.1 <= s || e <= span.0,
                                "{span:?} overlaps {:?}", (s, e));
                        }
                        live.push(span);
                    }
                } else {
                    let (s, _) = live.swap_remove(pick % live.len());
                    release(&refs, s);
                }
                // The allocator's own account covers every live block.
                let total: u64 = live.iter().map(|(s, e)| e - s).sum();
                proptest::prop_assert!(a.used() >= total);
                let spans = a.spans();
                proptest::prop_assert!(spans.iter().map(|(_, l)| l).sum::<u64>() == a.used());
            }
            for (s, _) in live.drain(..) {
                release(&refs, s);
            }
            proptest::prop_assert!(a.alloc(&refs, len - 64, 1).is_some());
        }
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
