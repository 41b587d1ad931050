//! The descriptor ring of one direction: a lock-free single-producer single-consumer queue
//! of fixed-size descriptors in shared memory, with a sleep/wake protocol.
//!
//! Each slot carries a sequence number in its first word: the producer writes the rest of
//! the slot, then stores `i + 1` there (Release) for message `i`, which publishes it; the
//! consumer polls the word of the slot it expects next (Acquire) and reads the slot once it
//! holds `head + 1`. So a message costs the consumer one cache-line transfer of the slot
//! (both lines arrive together, see [`Slot::ready`]) instead of a shared tail counter first
//! and the slot after. `head` (messages consumed) is written by the consumer, in batches, and
//! read by the producer only when its cached copy says the ring is full. Slot `i` is
//! `i & mask`; the counters are 64 bits and never wrap in practice.
//!
//! Sleep/wake: a side that finds nothing to do raises its `*_sleeping` flag, fences, and
//! checks again before it parks; a side that changed the state fences, and wakes the other
//! only if its flag is raised — so under load no side makes a system call per message. With
//! both fences `SeqCst` at least one side sees the other's store (Dekker): no wake-up is
//! lost. The producer runs that check once per batch of writes (`publish`), not per slot.
//!
//! The peer is another process that may be buggy or hostile: a slot whose sequence number is
//! not the expected one is simply not ready (a peer that never publishes stalls, as any peer
//! can), `head` is checked before use, and every descriptor is validated by `desc::check`.

// The loom seam holds here: std's atomics are refused (clippy.toml).
#![deny(clippy::disallowed_types, clippy::disallowed_methods)]

use super::desc::{Desc, WORDS};
use crate::loom::Padded;
use crate::loom::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// One slot: a sequence number and a descriptor's fifteen words, each read and written with
/// an atomic access. A misbehaving peer that writes a slot while we read it can change the
/// words we get — which `desc::check` then validates — but never races us: there is no
/// non-atomic access to shared memory the peer can write.
#[repr(C)]
pub(crate) struct Slot([AtomicU64; WORDS]);

impl Slot {
    pub(crate) fn new() -> Slot {
        Slot(std::array::from_fn(|_| AtomicU64::new(0)))
    }

    /// Writes the descriptor's words, then publishes them with sequence number `seq`.
    fn publish(&self, words: &[u64; WORDS], seq: u64) {
        for (slot, w) in self.0[1..].iter().zip(&words[1..]) {
            slot.store(*w, Ordering::Relaxed);
        }
        // SYNC POINT with the `seq` load in `ready`: the words above happen before a consumer
        // that sees `seq` reads them.
        self.0[0].store(seq, Ordering::Release);
    }

    /// True when the slot holds sequence number `seq`. Also touches the slot's second cache
    /// line, so that when the producer has written both, the consumer's next poll fetches
    /// them together rather than the second one after the first.
    fn ready(&self, seq: u64) -> bool {
        std::hint::black_box(self.0[WORDS / 2].load(Ordering::Relaxed));
        // SYNC POINT with the `seq` store in `publish`.
        self.0[0].load(Ordering::Acquire) == seq
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
    /// Descriptors consumed. Written by the consumer.
    pub(crate) head: Padded<AtomicU64>,
    /// 1: the consumer is parked (or about to) on its wake socket.
    pub(crate) consumer_sleeping: Padded<AtomicU32>,
    /// 1: the producer is parked (or about to), waiting for ring slots or arena blocks.
    pub(crate) producer_sleeping: Padded<AtomicU32>,
    /// 1: the producer closed this direction (after its last publish).
    pub(crate) producer_closed: AtomicU32,
    /// 1: the consumer is gone (STOP): what is published from now on is not read.
    pub(crate) consumer_closed: AtomicU32,
    /// External bodies (memfds) the consumer has finished with. Written by the consumer.
    pub(crate) ext_released: Padded<AtomicU64>,
    /// The producer side's heartbeat: a counter its process advances every half heartbeat
    /// interval while it runs (whatever it sends). Written by the producer's side.
    pub(crate) beat: Padded<AtomicU64>,
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
    /// Slots written (and published).
    tail: u64,
    /// Slots written since the last wake-up check.
    unchecked: u64,
    /// `head` as last read.
    seen_head: u64,
}

impl<S: RingStore> Producer<S> {
    /// A producer over a fresh ring.
    pub(crate) fn new(store: S) -> Producer<S> {
        Producer {
            store,
            tail: 0,
            unchecked: 0,
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
        if head < self.seen_head || head > self.tail {
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

    /// Writes `desc` into the next slot and publishes it. Requires `free() > 0`. The consumer
    /// may be parked: call [`publish`](Self::publish) before waiting or returning to the
    /// application, and at least every so many writes.
    pub(crate) fn write(&mut self, desc: &Desc) {
        self.write_words(&desc.encode());
    }

    /// [`write`](Self::write) of a descriptor's words (word 0 is the ring's).
    pub(crate) fn write_words(&mut self, words: &[u64; WORDS]) {
        // Slot `tail` is outside the consumer's window `[head, tail)` as long as `tail - head
        // < capacity`: the consumer reads only slots it has seen published.
        assert!(
            self.tail - self.seen_head < self.store.capacity(),
            "ring write without a free slot"
        );
        self.store.slot(self.tail).publish(words, self.tail + 1);
        self.tail += 1;
        self.unchecked += 1;
    }

    /// Slots written since the last wake-up check.
    pub(crate) fn unpublished(&self) -> u64 {
        self.unchecked
    }

    /// The wake-up check after writes: whether the consumer sleeps and must be woken (its
    /// flag is cleared here, so only one wake-up is sent).
    pub(crate) fn publish(&mut self) -> bool {
        if self.unchecked == 0 {
            return false;
        }
        self.unchecked = 0;
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
        self.unchecked = 0;
        // SYNC POINT with the `producer_closed` load in `Consumer::is_finished`: every publish
        // happens before a consumer that sees the flag looks at the next slot again.
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
    /// Descriptors consumed and announced to the producer.
    head: u64,
    /// Descriptors read since (not yet announced).
    read: u64,
}

impl<S: RingStore> Consumer<S> {
    pub(crate) fn new(store: S) -> Consumer<S> {
        Consumer {
            store,
            head: 0,
            read: 0,
        }
    }

    /// True when the next descriptor is published.
    pub(crate) fn ready(&self) -> bool {
        let i = self.head + self.read;
        self.store.slot(i).ready(i + 1)
    }

    /// The next descriptor's words, copied out of shared memory (to be validated with
    /// `desc::check_words`: a misbehaving peer could still write the slot), if it is
    /// published. It stays in the ring until [`take`](Self::take).
    #[inline]
    pub(crate) fn peek(&self) -> Option<[u64; WORDS]> {
        let i = self.head + self.read;
        let slot = self.store.slot(i);
        // The slot is published (Acquire in `ready`) and not written again by a well-behaved
        // producer until `head` passes it.
        slot.ready(i + 1).then(|| slot.load())
    }

    /// Moves past the descriptor `peek` returned. Its slot is freed for the producer at the
    /// next [`consume`](Self::consume).
    pub(crate) fn take(&mut self) {
        self.read += 1;
    }

    /// Descriptors taken and not yet freed.
    pub(crate) fn taken(&self) -> u64 {
        self.read
    }

    /// Frees the slots of the descriptors taken. Returns whether the producer sleeps and must
    /// be woken.
    pub(crate) fn consume(&mut self) -> bool {
        if self.read == 0 {
            return false;
        }
        self.head += self.read;
        self.read = 0;
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
    pub(crate) fn is_finished(&self) -> bool {
        // SYNC POINT with the `producer_closed` store in `Producer::close`: read the flag
        // first, then the slot, so that a close seen here comes after every publish.
        self.store.control().producer_closed.load(Ordering::Acquire) == 1 && !self.ready()
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

    /// Takes every published descriptor, returning their correlation ids.
    fn drain<S: RingStore>(c: &mut Consumer<S>) -> Vec<u64> {
        let mut got = Vec::new();
        while let Some(d) = c.peek() {
            got.push(Desc::decode(&d).correlation);
            c.take();
        }
        c.consume();
        got
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
            assert_eq!(
                drain(&mut c),
                (round * 4..round * 4 + 4).collect::<Vec<_>>()
            );
            assert!(
                c.peek().is_none(),
                "a slot of the last lap is not ready again"
            );
        }
    }

    #[test]
    fn slots_free_only_when_consumed() {
        let ring = HeapRing::new(2);
        let mut p = Producer::new(ring.clone());
        let mut c = Consumer::new(ring.clone());
        p.write(&desc(0));
        p.write(&desc(1));
        assert_eq!(p.free().unwrap(), 0);
        c.peek().unwrap();
        c.take();
        assert_eq!(p.free().unwrap(), 0, "taken, not yet consumed");
        c.consume();
        assert_eq!(p.free().unwrap(), 1);
    }

    #[test]
    fn a_forged_head_or_sequence_number_is_caught_or_ignored() {
        let ring = HeapRing::new(4);
        let mut p = Producer::new(ring.clone());
        for _ in 0..4 {
            p.write(&desc(0));
        }
        ring.control.head.store(9, Ordering::Relaxed);
        assert!(p.free().is_err(), "head past the tail");
        // A sequence number from another lap (or any other) is simply not ready.
        let ring = HeapRing::new(4);
        let c = Consumer::new(ring.clone());
        ring.slots[0].0[0].store(5, Ordering::Relaxed);
        assert!(c.peek().is_none());
        ring.slots[0].0[0].store(1, Ordering::Relaxed);
        assert!(c.peek().is_some());
    }

    #[test]
    fn close_is_seen_after_the_last_message() {
        let ring = HeapRing::new(4);
        let mut p = Producer::new(ring.clone());
        let mut c = Consumer::new(ring.clone());
        p.write(&desc(1));
        p.close();
        assert!(!c.is_finished());
        assert_eq!(drain(&mut c), [1]);
        assert!(c.is_finished());
    }
}

#[cfg(all(test, hyperframes_loom))]
mod loom_models {
    use super::heap::HeapRing;
    use super::*;
    use loom::sync::Notify;
    use std::sync::Arc as StdArc;

    /// Push and pop across a wrap-around: every descriptor arrives once, in order, with its
    /// contents (the slots' words are relaxed atomics: a missing Release/Acquire on the
    /// sequence number or on `head` lets loom hand the consumer stale words, which the
    /// assertion catches).
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
                    } else {
                        loom::thread::yield_now();
                    }
                }
            });
            let mut got = 0;
            while got < 3 {
                match c.peek() {
                    Some(d) => {
                        assert_eq!(Desc::decode(&d).correlation, got);
                        c.take();
                        c.consume();
                        got += 1;
                    }
                    None => loom::thread::yield_now(),
                }
            }
            t.join().unwrap();
        });
    }

    /// The sleep/wake protocol loses no wake-up: a consumer that parks (on a `Notify`
    /// standing in for the wake socket) is always woken for a message published
    /// concurrently, and a producer that parks for room is woken by the consumer. A lost
    /// wake-up would be a deadlock, which loom reports.
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
                if let Some(d) = c.peek() {
                    assert_eq!(Desc::decode(&d).correlation, got);
                    got += 1;
                    c.take();
                    if c.consume() {
                        space.notify();
                    }
                    continue;
                }
                c.prepare_park();
                if c.ready() {
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
                if c.is_finished() {
                    break;
                }
                while let Some(d) = c.peek() {
                    got.push(Desc::decode(&d).correlation);
                    c.take();
                }
                c.consume();
                loom::thread::yield_now();
            }
            assert_eq!(got, [7]);
            t.join().unwrap();
        });
    }
}
