//! The descriptor ring of one direction: a lock-free single-producer single-consumer queue
//! of fixed-size [`Desc`]s in shared memory, with a sleep/wake protocol.
//!
//! `head` and `tail` are monotonic 64-bit counters (never wrap in practice); slot `i` is
//! `i & mask`. Only the producer writes `tail` and the slots at `tail`, only the consumer
//! writes `head`; each keeps a cached copy of the other's counter and rereads it only when
//! the cache says full (producer) or empty (consumer).
//!
//! Sleep/wake: a side that finds nothing to do raises its `*_sleeping` flag, fences, and
//! checks again before it parks on its eventfd; a side that changed the state fences, and
//! wakes the other (an eventfd write) only if its flag is raised — so under load no side makes
//! a system call per message. With both fences `SeqCst` at least one side sees the other's
//! store (Dekker): no wake-up is lost. The peer is another process that may be buggy: every
//! counter read from shared memory is checked before use.

use super::desc::{Desc, WORDS};
use crate::loom::Padded;
use crate::loom::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// One slot: a descriptor as sixteen words, each read and written with a relaxed atomic access
/// (ordered by `tail` and `head`). A misbehaving peer that writes a slot while we read it can
/// change the words we get — which `desc::check` then validates — but never races us: there is
/// no non-atomic access to shared memory the peer can write.
#[repr(C)]
pub(crate) struct Slot([AtomicU64; WORDS]);

impl Slot {
    pub(crate) fn new() -> Slot {
        Slot(std::array::from_fn(|_| AtomicU64::new(0)))
    }

    fn store(&self, words: &[u64; WORDS]) {
        for (slot, w) in self.0.iter().zip(words) {
            slot.store(*w, Ordering::Relaxed);
        }
    }

    fn load(&self) -> [u64; WORDS] {
        std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed))
    }
}

const _: () = assert!(std::mem::size_of::<Slot>() == 128);

/// The shared control block of one direction. All-zero bytes are its initial state.
#[repr(C)]
#[derive(Default)]
pub(crate) struct Control {
    /// Descriptors published. Written by the producer.
    pub(crate) tail: Padded<AtomicU64>,
    /// Descriptors consumed. Written by the consumer.
    pub(crate) head: Padded<AtomicU64>,
    /// 1: the consumer is parked (or about to) on the data eventfd.
    pub(crate) consumer_sleeping: Padded<AtomicU32>,
    /// 1: the producer is parked (or about to) on the space eventfd, waiting for ring slots or
    /// arena blocks.
    pub(crate) producer_sleeping: Padded<AtomicU32>,
    /// 1: the producer closed this direction (after its last publish).
    pub(crate) producer_closed: AtomicU32,
    /// 1: the consumer is gone (STOP): what is published from now on is not read.
    pub(crate) consumer_closed: AtomicU32,
    /// External bodies (memfds) the consumer has finished with. Written by the consumer.
    pub(crate) ext_released: Padded<AtomicU64>,
}

/// Where a ring's control block and slots live.
pub(crate) trait RingStore {
    fn control(&self) -> &Control;
    /// Slot `i & mask`.
    fn slot(&self, i: u64) -> &Slot;
    /// Number of slots, a power of two.
    fn capacity(&self) -> u64;
}

/// The peer broke the ring's invariants (counters out of range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corrupt(pub(crate) &'static str);

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// The producing end, owned by the `Sender`.
pub(crate) struct Producer<S> {
    store: S,
    /// Written slots, published or not.
    tail: u64,
    /// Slots published to the consumer.
    published: u64,
    /// `head` as last read.
    seen_head: u64,
}

impl<S: RingStore> Producer<S> {
    /// A producer over a fresh ring (`tail` and `head` 0).
    pub(crate) fn new(store: S) -> Producer<S> {
        Producer {
            store,
            tail: 0,
            published: 0,
            seen_head: 0,
        }
    }

    pub(crate) fn store(&self) -> &S {
        &self.store
    }

    fn refresh(&mut self) -> Result<(), Corrupt> {
        // SYNC POINT with the `head` store in `Consumer::consume`: the consumer has finished
        // reading the slots before `head` says they are free.
        let head = self.store.control().head.load(Ordering::Acquire);
        if head < self.seen_head || head > self.published {
            return Err(Corrupt(
                "the consumer's head moved backwards or past the tail",
            ));
        }
        self.seen_head = head;
        Ok(())
    }

    /// Free slots (rereading `head` only when the cached view has none).
    pub(crate) fn free(&mut self) -> Result<u64, Corrupt> {
        let cap = self.store.capacity();
        if self.tail - self.seen_head == cap {
            self.refresh()?;
        }
        Ok(cap - (self.tail - self.seen_head))
    }

    /// Writes `desc` into the next slot (not yet visible). Requires `free() > 0`.
    pub(crate) fn write(&mut self, desc: &Desc) {
        // Slot `tail` is outside the consumer's window `[head, published)` as long as `tail -
        // head < capacity`: the consumer reads only slots below the `tail` it loaded.
        assert!(
            self.tail - self.seen_head < self.store.capacity(),
            "ring write without a free slot"
        );
        self.store.slot(self.tail).store(&desc.encode());
        self.tail += 1;
    }

    /// Written but unpublished descriptors.
    pub(crate) fn unpublished(&self) -> u64 {
        self.tail - self.published
    }

    /// Makes the written descriptors visible. Returns whether the consumer sleeps and must be
    /// woken (its flag is cleared here, so only one wake-up is sent).
    pub(crate) fn publish(&mut self) -> bool {
        if self.tail == self.published {
            return false;
        }
        // SYNC POINT with the `tail` load in `Consumer::available`: the slot writes above
        // happen before the consumer reads them.
        self.store
            .control()
            .tail
            .store(self.tail, Ordering::Release);
        self.published = self.tail;
        wake_needed(&self.store.control().consumer_sleeping)
    }

    /// Before parking for room: raise the flag. Check for room again afterwards.
    pub(crate) fn prepare_park(&self) {
        announce_sleep(&self.store.control().producer_sleeping);
    }

    /// Room found after `prepare_park`: no wake-up needed.
    pub(crate) fn cancel_park(&self) {
        self.store
            .control()
            .producer_sleeping
            .store(0, Ordering::Relaxed);
    }

    /// Marks the direction closed after the last publish; returns whether to wake the consumer.
    pub(crate) fn close(&mut self) -> bool {
        self.publish();
        // SYNC POINT with the `producer_closed` load in `Consumer::is_finished`: every publish
        // happens before a consumer that sees the flag checks the tail again.
        self.store
            .control()
            .producer_closed
            .store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        self.store
            .control()
            .consumer_sleeping
            .swap(0, Ordering::AcqRel)
            == 1
    }

    /// True when the consumer said it is gone.
    pub(crate) fn consumer_closed(&self) -> bool {
        self.store.control().consumer_closed.load(Ordering::Acquire) == 1
    }
}

/// The consuming end, owned by the `Receiver`.
pub(crate) struct Consumer<S> {
    store: S,
    head: u64,
    /// `tail` as last read.
    seen_tail: u64,
}

impl<S: RingStore> Consumer<S> {
    pub(crate) fn new(store: S) -> Consumer<S> {
        Consumer {
            store,
            head: 0,
            seen_tail: 0,
        }
    }

    /// Descriptors ready to read (rereading `tail` only when the cached view has none).
    pub(crate) fn available(&mut self) -> Result<u64, Corrupt> {
        if self.seen_tail == self.head {
            // SYNC POINT with the `tail` store in `Producer::publish`.
            let tail = self.store.control().tail.load(Ordering::Acquire);
            if tail < self.seen_tail || tail - self.head > self.store.capacity() {
                return Err(Corrupt(
                    "the producer's tail moved backwards or past the ring",
                ));
            }
            self.seen_tail = tail;
        }
        Ok(self.seen_tail - self.head)
    }

    /// The `i`-th available descriptor (`i < available()`), copied out of shared memory (to be
    /// validated with `desc::check`: a misbehaving peer could still write the slot).
    pub(crate) fn read(&self, i: u64) -> Desc {
        assert!(self.head + i < self.seen_tail, "ring read past the tail");
        // The slot is in `[head, tail)`: published by the producer (Acquire in `available`)
        // and not written again by a well-behaved producer until `head` passes it.
        Desc::decode(&self.store.slot(self.head + i).load())
    }

    /// Frees the first `n` read descriptors' slots. Returns whether the producer sleeps and
    /// must be woken.
    pub(crate) fn consume(&mut self, n: u64) -> bool {
        debug_assert!(self.head + n <= self.seen_tail);
        self.head += n;
        // SYNC POINT with the `head` load in `Producer::refresh`.
        self.store
            .control()
            .head
            .store(self.head, Ordering::Release);
        wake_needed(&self.store.control().producer_sleeping)
    }

    /// Before parking for data: raise the flag. Check for data again afterwards.
    pub(crate) fn prepare_park(&self) {
        announce_sleep(&self.store.control().consumer_sleeping);
    }

    /// Data found after `prepare_park`.
    pub(crate) fn cancel_park(&self) {
        self.store
            .control()
            .consumer_sleeping
            .store(0, Ordering::Relaxed);
    }

    /// True when the producer closed and everything it published was read.
    pub(crate) fn is_finished(&mut self) -> Result<bool, Corrupt> {
        // SYNC POINT with the `producer_closed` store in `Producer::close`: read the flag
        // first, then the tail, so that a close seen here comes after every publish.
        let closed = self.store.control().producer_closed.load(Ordering::Acquire) == 1;
        Ok(closed && self.available()? == 0)
    }

    /// Tells the producer this end is gone.
    pub(crate) fn close(&self) {
        self.store
            .control()
            .consumer_closed
            .store(1, Ordering::Release);
    }
}

/// The sleeper's half of the protocol: raise the flag, then fence before re-checking.
fn announce_sleep(flag: &AtomicU32) {
    flag.store(1, Ordering::Relaxed);
    // SYNC POINT with the fence in `wake_needed`.
    fence(Ordering::SeqCst);
}

/// The notifier's half: after changing the state, fence, then look at the flag; clear it when
/// raised, so that a sleeper is woken once.
pub(crate) fn wake_needed(flag: &AtomicU32) -> bool {
    // SYNC POINT with the fence in `announce_sleep`.
    fence(Ordering::SeqCst);
    flag.load(Ordering::Relaxed) == 1 && flag.swap(0, Ordering::AcqRel) == 1
}

/// A ring in process memory: loom models, unit tests and the ring bench.
#[cfg(any(test, not(hyperframes_loom)))]
pub(crate) mod heap {
    use super::*;
    use std::sync::Arc;

    pub(crate) struct HeapRing {
        pub(crate) control: Control,
        pub(crate) slots: Vec<Slot>,
    }

    impl HeapRing {
        pub(crate) fn new(capacity: usize) -> Arc<HeapRing> {
            assert!(capacity.is_power_of_two());
            Arc::new(HeapRing {
                control: Control::default(),
                slots: (0..capacity).map(|_| Slot::new()).collect(),
            })
        }
    }

    impl RingStore for Arc<HeapRing> {
        fn control(&self) -> &Control {
            &self.control
        }
        fn slot(&self, i: u64) -> &Slot {
            &self.slots[(i as usize) & (self.slots.len() - 1)]
        }
        fn capacity(&self) -> u64 {
            self.slots.len() as u64
        }
    }
}

#[cfg(all(test, not(hyperframes_loom)))]
mod tests {
    use super::heap::HeapRing;
    use super::*;

    fn desc(n: u64) -> Desc {
        Desc {
            correlation: n,
            kind: Desc::MESSAGE,
            ..Desc::zeroed()
        }
    }

    #[test]
    fn fills_wraps_and_empties() {
        let ring = HeapRing::new(4);
        let mut p = Producer::new(ring.clone());
        let mut c = Consumer::new(ring.clone());
        let mut next = 0;
        for round in 0..5 {
            while p.free().unwrap() > 0 {
                p.write(&desc(next));
                next += 1;
            }
            assert_eq!(c.available().unwrap(), 0, "not published yet");
            p.publish();
            let n = c.available().unwrap();
            assert_eq!(n, 4);
            for i in 0..n {
                assert_eq!(c.read(i).correlation, round * 4 + i);
            }
            c.consume(n);
        }
    }

    #[test]
    fn corrupt_counters_are_detected() {
        let ring = HeapRing::new(4);
        let mut c = Consumer::new(ring.clone());
        ring.control.tail.store(100, Ordering::Relaxed);
        assert!(c.available().is_err());
        let ring = HeapRing::new(4);
        let mut p = Producer::new(ring.clone());
        for _ in 0..4 {
            p.write(&desc(0));
        }
        p.publish();
        ring.control.head.store(9, Ordering::Relaxed);
        assert!(p.free().is_err());
    }

    #[test]
    fn close_is_seen_after_the_last_message() {
        let ring = HeapRing::new(4);
        let mut p = Producer::new(ring.clone());
        let mut c = Consumer::new(ring.clone());
        p.write(&desc(1));
        p.close();
        assert!(!c.is_finished().unwrap());
        c.available().unwrap();
        c.consume(1);
        assert!(c.is_finished().unwrap());
    }
}

#[cfg(all(test, hyperframes_loom))]
mod loom_models {
    use super::heap::HeapRing;
    use super::*;
    use loom::sync::Notify;
    use std::sync::Arc as StdArc;

    /// Push and pop across a wrap-around: every descriptor arrives once, in order, with its
    /// contents (the slots' words are relaxed atomics: a missing Release/Acquire on `tail` or
    /// `head` lets loom hand the consumer stale words, which the assertion catches).
    #[test]
    fn push_pop_wraps_in_order() {
        loom::model(|| {
            let ring = HeapRing::new(2);
            let mut p = Producer::new(ring.clone());
            let mut c = Consumer::new(ring);
            let t = loom::thread::spawn(move || {
                let mut sent = 0;
                while sent < 3 {
                    if p.free().unwrap() > 0 {
                        p.write(&Desc {
                            correlation: sent,
                            ..Desc::zeroed()
                        });
                        sent += 1;
                        p.publish();
                    } else {
                        loom::thread::yield_now();
                    }
                }
            });
            let mut got = 0;
            while got < 3 {
                let n = c.available().unwrap();
                for i in 0..n {
                    assert_eq!(c.read(i).correlation, got + i);
                }
                c.consume(n);
                got += n;
                if n == 0 {
                    loom::thread::yield_now();
                }
            }
            t.join().unwrap();
        });
    }

    /// The sleep/wake protocol loses no wake-up: a consumer that parks (on a `Notify`
    /// standing in for the eventfd) is always woken for a message published concurrently,
    /// and a producer that parks for room is woken by the consumer. A lost wake-up would be a
    /// deadlock, which loom reports.
    #[test]
    fn sleep_wake_loses_no_wakeup() {
        loom::model(|| {
            let ring = HeapRing::new(1);
            let data = StdArc::new(Notify::new());
            let space = StdArc::new(Notify::new());
            let mut p = Producer::new(ring.clone());
            let mut c = Consumer::new(ring);
            let (data2, space2) = (data.clone(), space.clone());
            let t = loom::thread::spawn(move || {
                for n in 0..2u64 {
                    loop {
                        if p.free().unwrap() > 0 {
                            break;
                        }
                        p.prepare_park();
                        if p.free().unwrap() > 0 {
                            p.cancel_park();
                            break;
                        }
                        space2.wait();
                    }
                    p.write(&Desc {
                        correlation: n,
                        ..Desc::zeroed()
                    });
                    if p.publish() {
                        data2.notify();
                    }
                }
            });
            let mut got = 0;
            while got < 2 {
                let n = c.available().unwrap();
                if n > 0 {
                    assert_eq!(c.read(0).correlation, got);
                    got += 1;
                    if c.consume(1) {
                        space.notify();
                    }
                    continue;
                }
                c.prepare_park();
                if c.available().unwrap() > 0 {
                    c.cancel_park();
                    continue;
                }
                data.wait();
            }
            t.join().unwrap();
        });
    }

    /// A close raced with the last publish: the consumer sees every message before the end.
    #[test]
    fn close_after_publish_is_ordered() {
        loom::model(|| {
            let ring = HeapRing::new(2);
            let mut p = Producer::new(ring.clone());
            let mut c = Consumer::new(ring);
            let t = loom::thread::spawn(move || {
                p.write(&Desc {
                    correlation: 7,
                    ..Desc::zeroed()
                });
                p.close();
            });
            let mut got = Vec::new();
            loop {
                if c.is_finished().unwrap() {
                    break;
                }
                let n = c.available().unwrap();
                for i in 0..n {
                    got.push(c.read(i).correlation);
                }
                c.consume(n);
                loom::thread::yield_now();
            }
            assert_eq!(got, [7]);
            t.join().unwrap();
        });
    }
}
