//! A bounded single-producer single-consumer hand-off of messages between two threads, with
//! wake-ups, built for message rate.
//!
//! It connects a user half to the task doing its I/O (or, for inproc, two user halves). The
//! costs that dominate small-message rate between two cores are cache lines that both sides
//! write, so:
//!
//! * **Batches.** An item is one message or a `Vec` of them: a sender hands over what
//!   `Sink::start_send` staged in one step, the I/O thread hands over everything it decoded
//!   from one read in one step. The per-item costs (a queue slot, a wake-up check) are paid
//!   per batch.
//! * **Counters owned by one side.** Messages and body bytes pushed are written only by the
//!   producer, those popped only by the consumer, each on its own cache line; the producer
//!   keeps a cached copy of the consumer's counters and rereads them only when its copy says
//!   the pipe is full (the technique of Aeron's and LMAX's position counters).
//! * **Wake only a side that sleeps.** A side about to sleep raises a flag; the other side
//!   checks the flag (a plain load) after each change and wakes only when it is raised.
//!
//! Bounded by messages and by body bytes. One batch is always admitted into an empty pipe,
//! however large, and a producer that found room may push one batch past the bounds (a
//! batch is at most what one read or one `Sink` staging holds).

// The loom seam holds here: std's atomics are refused (clippy.toml).
#![deny(clippy::disallowed_types, clippy::disallowed_methods)]
// tcp, inproc and sessions each use part of this module; a build without some of them
// leaves the rest.
#![cfg_attr(not(all(feature = "tcp", feature = "inproc")), allow(dead_code))]

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::task::{Context, Poll};

use crossbeam_utils::CachePadded;

// Every atomic and cell of the protocol through the seam, so that `loom_models` below checks
// it.
use crate::loom::sync::{AtomicBool, AtomicU64, AtomicWaker, Ordering, UnsafeCell, fence};

use crate::message::Message;

/// What travels through a pipe: one message, or a batch (never empty).
#[derive(Debug)]
pub(crate) enum Item {
    One(Message),
    Many(Vec<Message>),
}

impl Item {
    fn counts(&self) -> (u64, u64) {
        match self {
            Item::One(m) => (1, m.body().len() as u64),
            Item::Many(v) => (
                v.len() as u64,
                v.iter().map(|m| m.body().len() as u64).sum(),
            ),
        }
    }
}

/// A waker with a "sleeping" flag, so that notifying a side that is busy costs a load.
///
/// Protocol (Dekker's, with two `SeqCst` fences): the waiter registers its waker, raises the
/// flag, fences, then re-checks its condition before returning `Pending`; the notifier makes
/// the condition true, fences, then reads the flag. Of the two fenced store→load sequences at
/// least one sees the other's store, so either the waiter sees the change or the notifier
/// sees the flag: no wake-up is lost.
pub(crate) struct Signal {
    sleeping: AtomicBool,
    waker: AtomicWaker,
}

impl Signal {
    fn new() -> Signal {
        Signal {
            sleeping: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        }
    }

    /// Waiter: announce sleep. Re-check the condition afterwards.
    pub(crate) fn arm(&self, cx: &mut Context<'_>) {
        self.waker.register(cx.waker());
        self.sleeping.store(true, Ordering::Relaxed);
        // SYNC POINT with the fence in `notify`: orders the flag store before the re-check.
        fence(Ordering::SeqCst);
    }

    /// Waiter: the re-check succeeded, no need to be woken.
    pub(crate) fn disarm(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
    }

    /// Notifier: after changing the state the waiter waits on.
    pub(crate) fn notify(&self) {
        // SYNC POINT with the fence in `arm`: orders the state change before the flag load.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) && self.sleeping.swap(false, Ordering::AcqRel) {
            self.waker.wake();
        }
    }

    /// Waits for `check` to give a value: checks, and if nothing, arms and checks again
    /// (the waiter's half of the protocol in one place).
    pub(crate) fn poll_until<T>(
        &self,
        cx: &mut Context<'_>,
        mut check: impl FnMut() -> Option<T>,
    ) -> Poll<T> {
        if let Some(v) = check() {
            return Poll::Ready(v);
        }
        self.arm(cx);
        match check() {
            Some(v) => {
                self.disarm();
                Poll::Ready(v)
            }
            None => Poll::Pending,
        }
    }

    /// Wakes the waiter whether or not it announced sleep (for rare events: close, failure).
    pub(crate) fn wake(&self) {
        self.sleeping.store(false, Ordering::Relaxed);
        self.waker.wake();
    }
}

/// The items in flight: a bounded single-producer single-consumer ring with a sequence number
/// per slot. The producer writes the item of position `pos` into slot `pos % cap` and then
/// sets the slot's sequence to `pos + 1`; the consumer takes it once it sees that sequence.
/// The consumer never writes a slot: it says how far it has read with its item counter
/// ([`Counters::items`]), which the producer reads only when its cached copy says the ring
/// is full. So each message costs the line of its slot, moved once from the producer's core
/// to the consumer's, and a consumer that finds the ring empty watches that slot, not a
/// counter the producer rewrites with every push. (crossbeam's `ArrayQueue`, used before,
/// is multi-producer: a compare-and-swap of the shared tail per push, slots the consumer
/// marks free, and an emptiness check that reads both ends, which a spinning consumer turned
/// into a tug of war over the producer's lines on every message: 2.2 M 64 B messages/s
/// between two cores against 3.7-4.6 M with this ring, `hf bench --transport inproc`.)
struct Ring {
    slots: Box<[Slot]>,
}

/// Aligned to a cache line, the sequence after the item: the producer's writes to the next
/// slot share no line with the one the consumer is reading or watching (unaligned 144-byte
/// slots cost a third of the message rate: 3.6-4.3 M/s against 4.4-5.4 M/s aligned).
#[repr(C, align(64))]
struct Slot {
    item: UnsafeCell<MaybeUninit<Item>>,
    /// The position whose item is in the slot, plus one (0: none yet).
    seq: AtomicU64,
}

// SAFETY: a slot's item is accessed by one side at a time. The producer writes the slot of
// position `pos` only once the consumer's item counter (Acquired) is past `pos - cap`: the
// consumer moved the item of the lap before out before it stored that counter (Release).
// The consumer reads it only once the slot's sequence (Acquired) is `pos + 1`: the producer
// wrote the item before it stored that sequence (Release). `Item` is `Send`, so it may be
// written on one thread and taken on another.
unsafe impl Sync for Ring {}

/// A side's place in the ring: its position and the index of that position's slot.
#[derive(Clone, Copy, Debug, Default)]
struct Place {
    pos: u64,
    idx: usize,
}

impl Place {
    fn advance(&mut self, cap: usize) {
        self.pos += 1;
        self.idx += 1;
        if self.idx == cap {
            self.idx = 0;
        }
    }
}

impl Ring {
    fn new(cap: usize) -> Ring {
        Ring {
            slots: (0..cap)
                .map(|_| Slot {
                    seq: AtomicU64::new(0),
                    item: UnsafeCell::new(MaybeUninit::uninit()),
                })
                .collect(),
        }
    }

    fn cap(&self) -> u64 {
        self.slots.len() as u64
    }

    /// Producer only, once the consumer's item counter says the slot of `at` is free.
    fn push(&self, at: &mut Place, item: Item) {
        let slot = &self.slots[at.idx];
        // SAFETY: the slot is free (the caller checked the consumer's counter, see `impl Sync
        // for Ring`), and only the producer (`&mut` on its place) writes slots; an item left
        // there was moved out by the consumer, so overwriting drops nothing.
        slot.item.with_mut(|p| unsafe { (*p).write(item) });
        // SYNC POINT with the Acquire load in `ready`: the item is written before the
        // consumer may read it.
        slot.seq.store(at.pos + 1, Ordering::Release);
        at.advance(self.slots.len());
    }

    /// Consumer only: whether the item of `at` is in.
    fn ready(&self, at: &Place) -> bool {
        self.slots[at.idx].seq.load(Ordering::Acquire) == at.pos + 1
    }

    /// Consumer only: takes the item at `at`, if it is in. The caller then stores its item
    /// counter (Release), which frees the slot.
    fn pop(&self, at: &mut Place) -> Option<Item> {
        if !self.ready(at) {
            return None;
        }
        let slot = &self.slots[at.idx];
        // SAFETY: the sequence (Acquired in `ready`) says the producer wrote this position's
        // item, and it will not write the slot again before our item counter says we are
        // past it; reading moves the item out (the slot's bytes are dead from here on).
        let item = slot.item.with(|p| unsafe { (*p).assume_init_read() });
        at.advance(self.slots.len());
        Some(item)
    }

    /// Drops the items of positions `from..to` (those pushed and never popped), with both
    /// sides gone.
    fn drop_unread(&mut self, from: u64, to: u64) {
        let cap = self.cap();
        for pos in from..to {
            let slot = &self.slots[(pos % cap) as usize];
            if slot.seq.load(Ordering::Relaxed) == pos + 1 {
                // SAFETY: `&mut self`: nobody else uses the ring; the item of `pos` was
                // written (its sequence says so) and not taken (the consumer's counter is at
                // `from`).
                slot.item.with_mut(|p| unsafe { (*p).assume_init_drop() });
            }
        }
    }
}

/// Written by one side only: messages and body bytes it has pushed or popped, and the
/// thread it last did so from.
#[derive(Default)]
struct Counters {
    msgs: AtomicU64,
    bytes: AtomicU64,
    /// Items (ring positions): the consumer's frees the ring's slots.
    items: AtomicU64,
    thread: AtomicU64,
}

/// A number naming the calling thread; never 0.
fn thread_tag() -> u64 {
    // A process-wide counter, outside the protocol (and a `static`, which loom's atomics
    // cannot be).
    #[allow(clippy::disallowed_types)]
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    thread_local!(static TAG: u64 = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    TAG.with(|t| *t)
}

pub(crate) struct Pipe {
    ring: Ring,
    pushed: CachePadded<Counters>,
    popped: CachePadded<Counters>,
    max_msgs: u64,
    max_bytes: u64,
    /// The consumer waits on this: items arrived, or the producer closed.
    pub(crate) to_consumer: Signal,
    /// The producer waits on this: room freed, the consumer closed, or (for transports that
    /// use it) progress the producer waits for.
    pub(crate) to_producer: Signal,
    tx_closed: AtomicBool,
    rx_closed: AtomicBool,
}

impl Pipe {
    pub(crate) fn new(max_msgs: usize, max_bytes: usize) -> Arc<Pipe> {
        let max_msgs = max_msgs.max(1);
        Arc::new(Pipe {
            // One slot more than the message bound: a producer's staged batch always has one.
            ring: Ring::new(max_msgs + 1),
            pushed: CachePadded::new(Counters::default()),
            popped: CachePadded::new(Counters::default()),
            max_msgs: max_msgs as u64,
            max_bytes: max_bytes as u64,
            to_consumer: Signal::new(),
            to_producer: Signal::new(),
            tx_closed: AtomicBool::new(false),
            rx_closed: AtomicBool::new(false),
        })
    }

    pub(crate) fn is_rx_closed(&self) -> bool {
        self.rx_closed.load(Ordering::Acquire)
    }

    pub(crate) fn is_tx_closed(&self) -> bool {
        self.tx_closed.load(Ordering::Acquire)
    }

    /// Nothing queued (from any thread; the consumer's own check is
    /// [`Consumer::is_empty`]).
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends the producing side from anywhere (the producer's owner, or a connection that
    /// failed): the consumer drains what is queued, then sees the end.
    pub(crate) fn close_tx(&self) {
        // SYNC POINT with the `tx_closed` load in `Consumer::poll_pop`: every push before this
        // store is visible to a consumer that observes `true`.
        self.tx_closed.store(true, Ordering::Release);
        self.to_consumer.wake();
    }

    /// Ends the consuming side: a producer waiting for room is released and should check
    /// [`is_rx_closed`](Self::is_rx_closed).
    pub(crate) fn close_rx(&self) {
        self.rx_closed.store(true, Ordering::Release);
        self.to_producer.wake();
    }

    /// Whether the producer last pushed from a thread other than the caller's: only then
    /// can a consumer spinning here see it push (on one thread, spinning only delays it).
    pub(crate) fn producer_elsewhere(&self) -> bool {
        self.pushed.thread.load(Ordering::Relaxed) != thread_tag()
    }

    /// Whether the consumer last popped from a thread other than the caller's.
    pub(crate) fn consumer_elsewhere(&self) -> bool {
        self.popped.thread.load(Ordering::Relaxed) != thread_tag()
    }

    /// Messages queued now (approximate while both sides run).
    pub(crate) fn len(&self) -> u64 {
        // The consumer may count a pop before the producer's count of that push is visible.
        let popped = self.popped.msgs.load(Ordering::Acquire);
        self.pushed
            .msgs
            .load(Ordering::Acquire)
            .saturating_sub(popped)
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        let from = self.popped.items.load(Ordering::Relaxed);
        let to = self.pushed.items.load(Ordering::Relaxed);
        self.ring.drop_unread(from, to);
    }
}

/// The producing end. Owned by one task.
pub(crate) struct Producer {
    pipe: Arc<Pipe>,
    at: Place,
    pushed_msgs: u64,
    pushed_bytes: u64,
    /// The consumer's counters as last read.
    seen_popped_msgs: u64,
    seen_popped_bytes: u64,
    seen_popped_items: u64,
}

impl Producer {
    pub(crate) fn new(pipe: Arc<Pipe>) -> Producer {
        Producer {
            pipe,
            at: Place::default(),
            pushed_msgs: 0,
            pushed_bytes: 0,
            seen_popped_msgs: 0,
            seen_popped_bytes: 0,
            seen_popped_items: 0,
        }
    }

    pub(crate) fn pipe(&self) -> &Pipe {
        &self.pipe
    }

    fn room_in(&self, popped_msgs: u64, popped_bytes: u64) -> bool {
        let msgs = self.pushed_msgs - popped_msgs;
        msgs == 0
            || (msgs < self.pipe.max_msgs && self.pushed_bytes - popped_bytes < self.pipe.max_bytes)
    }

    fn refresh(&mut self) -> bool {
        self.seen_popped_msgs = self.pipe.popped.msgs.load(Ordering::Acquire);
        self.seen_popped_bytes = self.pipe.popped.bytes.load(Ordering::Acquire);
        self.room_in(self.seen_popped_msgs, self.seen_popped_bytes)
    }

    /// True when a batch may be pushed now.
    pub(crate) fn has_room(&mut self) -> bool {
        self.room_in(self.seen_popped_msgs, self.seen_popped_bytes) || self.refresh()
    }

    /// Ready when a batch may be pushed, or when the consumer is gone (check
    /// [`Pipe::is_rx_closed`]).
    pub(crate) fn poll_room(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.has_room() || self.pipe.is_rx_closed() {
            return Poll::Ready(());
        }
        self.pipe.to_producer.arm(cx);
        if self.refresh() || self.pipe.is_rx_closed() {
            self.pipe.to_producer.disarm();
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Pushes `item`; gives it back when every slot is taken (the caller skipped
    /// [`poll_room`](Self::poll_room) more than once).
    #[allow(clippy::result_large_err)]
    pub(crate) fn push(&mut self, item: Item) -> Result<(), Item> {
        let (msgs, bytes) = item.counts();
        let cap = self.pipe.ring.cap();
        if self.at.pos - self.seen_popped_items >= cap {
            // SYNC POINT with the Release store in `Consumer::pop`: the consumer moved out
            // the items it counted before the slots are written again.
            self.seen_popped_items = self.pipe.popped.items.load(Ordering::Acquire);
            if self.at.pos - self.seen_popped_items >= cap {
                return Err(item);
            }
        }
        self.pipe.ring.push(&mut self.at, item);
        self.pushed_msgs += msgs;
        self.pushed_bytes += bytes;
        // Only this side writes these; the consumer reads them only for `Pipe::len`.
        self.pipe
            .pushed
            .msgs
            .store(self.pushed_msgs, Ordering::Release);
        self.pipe
            .pushed
            .bytes
            .store(self.pushed_bytes, Ordering::Release);
        self.pipe.pushed.items.store(self.at.pos, Ordering::Relaxed);
        let tag = thread_tag();
        if self.pipe.pushed.thread.load(Ordering::Relaxed) != tag {
            self.pipe.pushed.thread.store(tag, Ordering::Relaxed);
        }
        self.pipe.to_consumer.notify();
        Ok(())
    }

    /// The producer is done; the consumer drains what is queued, then sees the end.
    pub(crate) fn close(&self) {
        self.pipe.close_tx();
    }
}

/// The consuming end. Owned by one task.
pub(crate) struct Consumer {
    pipe: Arc<Pipe>,
    at: Place,
    popped_msgs: u64,
    popped_bytes: u64,
}

impl Consumer {
    pub(crate) fn new(pipe: Arc<Pipe>) -> Consumer {
        Consumer {
            pipe,
            at: Place::default(),
            popped_msgs: 0,
            popped_bytes: 0,
        }
    }

    pub(crate) fn pipe(&self) -> &Pipe {
        &self.pipe
    }

    /// Pops one item without notifying the producer; call
    /// [`notify_producer`](Self::notify_producer) after a run of pops.
    pub(crate) fn pop(&mut self) -> Option<Item> {
        let item = self.pipe.ring.pop(&mut self.at)?;
        let (msgs, bytes) = item.counts();
        self.popped_msgs += msgs;
        self.popped_bytes += bytes;
        self.pipe
            .popped
            .msgs
            .store(self.popped_msgs, Ordering::Release);
        self.pipe
            .popped
            .bytes
            .store(self.popped_bytes, Ordering::Release);
        // SYNC POINT with the Acquire load in `Producer::push`: frees the slot just read.
        self.pipe.popped.items.store(self.at.pos, Ordering::Release);
        let tag = thread_tag();
        if self.pipe.popped.thread.load(Ordering::Relaxed) != tag {
            self.pipe.popped.thread.store(tag, Ordering::Relaxed);
        }
        Some(item)
    }

    /// Nothing to pop now: a look at the next slot only.
    pub(crate) fn is_empty(&self) -> bool {
        !self.pipe.ring.ready(&self.at)
    }

    pub(crate) fn notify_producer(&self) {
        self.pipe.to_producer.notify();
    }

    /// The next item; `Ready(None)` once the producer closed and the queue is drained.
    pub(crate) fn poll_pop(&mut self, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        if let Some(item) = self.pop() {
            self.notify_producer();
            return Poll::Ready(Some(item));
        }
        self.pipe.to_consumer.arm(cx);
        // SYNC POINT with the `tx_closed` store in `Producer::close`: read the flag before the
        // queue, so that a close seen here comes after every push it follows.
        let closed = self.pipe.is_tx_closed();
        if let Some(item) = self.pop() {
            self.pipe.to_consumer.disarm();
            self.notify_producer();
            return Poll::Ready(Some(item));
        }
        if closed {
            self.pipe.to_consumer.disarm();
            return Poll::Ready(None);
        }
        Poll::Pending
    }

    /// The consumer is gone; a producer waiting for room is released and should check
    /// [`Pipe::is_rx_closed`].
    pub(crate) fn close(&self) {
        self.pipe.close_rx();
    }
}

/// A producer that stages messages and hands them over in batches, for `Sink` senders.
///
/// `Sink::start_send` may buffer until `poll_flush` (the `Sink` contract); staging up to
/// [`Self::MAX_MSGS`] messages or [`Self::MAX_BYTES`] body bytes turns a run of small sends
/// into one hand-off. A staged batch always owns a queue slot (reserved by `poll_ready`), so
/// handing it over never fails — not even on drop.
pub(crate) struct Stager {
    producer: Producer,
    staged: Vec<Message>,
    staged_bytes: usize,
}

impl Stager {
    pub(crate) const MAX_MSGS: usize = 64;
    pub(crate) const MAX_BYTES: usize = 256 << 10;

    pub(crate) fn new(pipe: Arc<Pipe>) -> Stager {
        Stager {
            producer: Producer::new(pipe),
            staged: Vec::new(),
            staged_bytes: 0,
        }
    }

    pub(crate) fn pipe(&self) -> &Pipe {
        self.producer.pipe()
    }

    /// Ready when one more message may be staged (or the consumer is gone: check
    /// [`Pipe::is_rx_closed`]).
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.staged.len() >= Self::MAX_MSGS || self.staged_bytes >= Self::MAX_BYTES {
            self.submit();
        }
        if !self.staged.is_empty() {
            return Poll::Ready(()); // the staged batch holds a slot already
        }
        self.producer.poll_room(cx)
    }

    /// Whether [`poll_ready`](Self::poll_ready) would be ready now, without arming anything.
    pub(crate) fn ready(&mut self) -> bool {
        let full = self.staged.len() >= Self::MAX_MSGS || self.staged_bytes >= Self::MAX_BYTES;
        (!self.staged.is_empty() && !full)
            || self.producer.has_room()
            || self.producer.pipe().is_rx_closed()
    }

    /// Stages `msg`. Only after `poll_ready` returned `Ready`.
    pub(crate) fn stage(&mut self, msg: Message) {
        self.staged_bytes += msg.body().len();
        self.staged.push(msg);
    }

    /// Hands the staged messages over.
    pub(crate) fn submit(&mut self) {
        let item = match self.staged.len() {
            0 => return,
            1 => Item::One(self.staged.pop().expect("one staged message")),
            _ => Item::Many(std::mem::take(&mut self.staged)),
        };
        self.staged_bytes = 0;
        // The slot was reserved by `poll_ready`: with at most `max_msgs` messages queued there
        // are at most `max_msgs` items, and the queue has `max_msgs + 1` slots.
        if let Err(item) = self.producer.push(item) {
            // Unreachable unless `stage` was called without `poll_ready` (a broken Sink
            // contract); say so loudly rather than lose messages silently.
            let n = match &item {
                Item::One(_) => 1,
                Item::Many(v) => v.len(),
            };
            tracing::error!(
                messages = n,
                "send queue full at hand-over: messages dropped (start_send without poll_ready?)"
            );
            debug_assert!(false, "a staged batch found no slot");
        }
    }

    pub(crate) fn close(&mut self) {
        self.submit();
        self.producer.close();
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        self.close();
    }
}

/// A consumer that takes batches and hands out messages one by one, for receivers.
pub(crate) struct Unbatcher {
    consumer: Consumer,
    current: std::vec::IntoIter<Message>,
}

impl Unbatcher {
    pub(crate) fn new(pipe: Arc<Pipe>) -> Unbatcher {
        Unbatcher {
            consumer: Consumer::new(pipe),
            current: Vec::new().into_iter(),
        }
    }

    pub(crate) fn pipe(&self) -> &Pipe {
        self.consumer.pipe()
    }

    /// The next message; `Ready(None)` once the producer closed and everything was taken.
    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        if let Some(m) = self.current.next() {
            return Poll::Ready(Some(m));
        }
        match self.consumer.poll_pop(cx) {
            Poll::Ready(Some(Item::One(m))) => Poll::Ready(Some(m)),
            Poll::Ready(Some(Item::Many(v))) => {
                self.current = v.into_iter();
                Poll::Ready(self.current.next())
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Whether [`poll_next`](Self::poll_next) would be ready now, without arming anything.
    pub(crate) fn ready(&self) -> bool {
        self.current.len() > 0 || !self.consumer.is_empty() || self.pipe().is_tx_closed()
    }

    /// Messages taken from the pipe and not handed out yet.
    pub(crate) fn buffered(&self) -> usize {
        self.current.len()
    }

    pub(crate) fn close(&self) {
        self.consumer.close();
    }
}

impl Drop for Unbatcher {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(all(test, not(hyperframes_loom)))]
mod tests {
    use super::*;
    use bytes::Bytes;
    use futures_util::task::noop_waker_ref;

    fn msg(n: usize) -> Message {
        Message::new("t")
            .unwrap()
            .with_body(Bytes::from(vec![0u8; n]))
    }

    fn cx() -> Context<'static> {
        Context::from_waker(noop_waker_ref())
    }

    #[test]
    fn bounded_by_count_and_bytes_but_admits_one_large() {
        let pipe = Pipe::new(2, 100);
        let mut p = Producer::new(pipe.clone());
        let mut c = Consumer::new(pipe.clone());
        assert!(p.poll_room(&mut cx()).is_ready());
        p.push(Item::One(msg(1000))).unwrap(); // larger than max_bytes, into an empty pipe
        assert!(p.poll_room(&mut cx()).is_pending());
        assert!(matches!(c.poll_pop(&mut cx()), Poll::Ready(Some(_))));
        assert!(p.poll_room(&mut cx()).is_ready());
        p.push(Item::Many(vec![msg(10), msg(10)])).unwrap();
        assert!(p.poll_room(&mut cx()).is_pending(), "count bound");
        p.close();
        assert!(matches!(c.poll_pop(&mut cx()), Poll::Ready(Some(Item::Many(v))) if v.len() == 2));
        assert!(matches!(c.poll_pop(&mut cx()), Poll::Ready(None)));
    }

    #[test]
    fn consumer_close_releases_a_waiting_producer() {
        let pipe = Pipe::new(1, 100);
        let mut p = Producer::new(pipe.clone());
        let c = Consumer::new(pipe.clone());
        p.push(Item::One(msg(1))).unwrap();
        assert!(p.poll_room(&mut cx()).is_pending());
        c.close();
        assert!(p.poll_room(&mut cx()).is_ready());
        assert!(pipe.is_rx_closed());
    }

    #[test]
    fn stager_batches_and_never_loses_a_staged_batch() {
        let pipe = Pipe::new(4, 1 << 20);
        let mut s = Stager::new(pipe.clone());
        let mut u = Unbatcher::new(pipe.clone());
        let mut sent = 0;
        // Fill until the stager blocks: staged batches keep their slot.
        while s.poll_ready(&mut cx()).is_ready() {
            s.stage(msg(sent));
            sent += 1;
            assert!(sent < 1000);
        }
        drop(s); // hands over the last staged batch and closes
        let mut got = 0;
        while let Poll::Ready(Some(m)) = u.poll_next(&mut cx()) {
            assert_eq!(m.body().len(), got);
            got += 1;
        }
        assert_eq!(got, sent);
    }

    #[test]
    fn threads_hand_off_everything_in_order() {
        let pipe = Pipe::new(16, 1 << 20);
        let mut s = Stager::new(pipe.clone());
        let mut u = Unbatcher::new(pipe);
        const N: usize = 200_000;
        let t = std::thread::spawn(move || {
            let mut seen = 0usize;
            futures_executor_block_on(std::future::poll_fn(|cx| {
                loop {
                    match u.poll_next(cx) {
                        Poll::Ready(Some(m)) => {
                            let i = m.meta().get("i").unwrap().parse::<usize>().unwrap();
                            assert_eq!(i, seen);
                            seen += 1;
                        }
                        Poll::Ready(None) => return Poll::Ready(seen),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            }))
        });
        let mut i = 0;
        futures_executor_block_on(std::future::poll_fn(|cx| {
            while i < N {
                match s.poll_ready(cx) {
                    Poll::Ready(()) => {
                        let m = Message::new("t")
                            .unwrap()
                            .with_meta("i", i.to_string())
                            .unwrap();
                        s.stage(m);
                        if i % 3 == 0 {
                            s.submit();
                        }
                        i += 1;
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
            Poll::Ready(())
        }));
        drop(s);
        assert_eq!(t.join().unwrap(), N);
    }

    /// Polls a future to completion on this thread, parking between polls.
    fn futures_executor_block_on<F: std::future::Future>(f: F) -> F::Output {
        use std::task::Wake;
        struct Unpark(std::thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut f = std::pin::pin!(f);
        loop {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
            std::thread::park();
        }
    }
}

/// The wake-up protocol under loom's model checker (`RUSTFLAGS="--cfg hyperframes_loom"
/// cargo test --release --lib loom_models`): every interleaving of the two sides' atomic
/// operations, up to loom's preemption bound. A lost wake-up leaves `block_on` parked with
/// nothing left to run, which loom reports as a deadlock; a missing Release/Acquire or
/// fence lets it show a side a stale counter or flag; a slot written while the other side
/// still reads it is a race on loom's cell.
#[cfg(all(test, hyperframes_loom))]
mod loom_models {
    use super::*;
    use futures_util::future::poll_fn;
    use loom::future::block_on;

    fn msg() -> Message {
        Message::new("t").unwrap()
    }

    /// Pops until the producer closes; returns how many messages came.
    fn drain(c: &mut Consumer) -> usize {
        let mut n = 0;
        while let Some(item) = block_on(poll_fn(|cx| c.poll_pop(cx))) {
            n += match item {
                Item::One(_) => 1,
                Item::Many(v) => v.len(),
            };
        }
        n
    }

    /// A consumer that sleeps is woken by a push made concurrently, and by the close after
    /// it, and sees the push before the end.
    #[test]
    fn a_sleeping_consumer_is_woken_by_push_and_close() {
        loom::model(|| {
            let pipe = Pipe::new(4, 1 << 20);
            let mut p = Producer::new(pipe.clone());
            let mut c = Consumer::new(pipe);
            let t = loom::thread::spawn(move || {
                p.push(Item::One(msg())).unwrap();
                p.close();
            });
            assert_eq!(drain(&mut c), 1);
            t.join().unwrap();
        });
    }

    /// A producer that waits for room (a pipe of one message) is woken by the consumer's
    /// pop, every time: both messages arrive.
    #[test]
    fn a_producer_waiting_for_room_is_woken_by_the_pop() {
        loom::model(|| {
            let pipe = Pipe::new(1, 1 << 20);
            let mut p = Producer::new(pipe.clone());
            let mut c = Consumer::new(pipe);
            let t = loom::thread::spawn(move || {
                for _ in 0..2 {
                    block_on(poll_fn(|cx| p.poll_room(cx)));
                    assert!(!p.pipe().is_rx_closed());
                    p.push(Item::One(msg())).unwrap();
                }
                p.close();
            });
            assert_eq!(drain(&mut c), 2);
            t.join().unwrap();
        });
    }

    /// A producer waiting for room is released when the consumer goes away instead.
    #[test]
    fn a_producer_waiting_for_room_is_released_by_the_consumers_close() {
        loom::model(|| {
            let pipe = Pipe::new(1, 1 << 20);
            let mut p = Producer::new(pipe.clone());
            let c = Consumer::new(pipe);
            p.push(Item::One(msg())).unwrap();
            let t = loom::thread::spawn(move || c.close());
            block_on(poll_fn(|cx| p.poll_room(cx)));
            assert!(p.pipe().is_rx_closed() || p.has_room());
            t.join().unwrap();
        });
    }

    /// The ring's slots are reused lap after lap (a pipe of one message has two slots; three
    /// pushes wrap around) without the producer writing a slot the consumer is still reading
    /// (loom's cells report that as a race), and the items come out in order.
    #[test]
    fn slots_are_reused_only_once_read_and_items_stay_in_order() {
        loom::model(|| {
            let pipe = Pipe::new(1, 1 << 20);
            let mut p = Producer::new(pipe.clone());
            let mut c = Consumer::new(pipe);
            let t = loom::thread::spawn(move || {
                for i in 0..3 {
                    block_on(poll_fn(|cx| p.poll_room(cx)));
                    let m = Message::new("t").unwrap().with_meta("i", i).unwrap();
                    p.push(Item::One(m)).unwrap();
                }
                p.close();
            });
            let mut next = 0;
            while let Some(item) = block_on(poll_fn(|cx| c.poll_pop(cx))) {
                let Item::One(m) = item else {
                    panic!("one message per item")
                };
                assert_eq!(m.meta().get("i"), Some(next.to_string().as_str()));
                next += 1;
            }
            assert_eq!(next, 3);
            t.join().unwrap();
        });
    }
}
