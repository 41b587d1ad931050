//! A bounded single-producer single-consumer queue of messages with wakers on both ends.
//!
//! It is the hand-off between a user half and the task that does its I/O (or, for inproc,
//! between the two user halves). Bounded twice: by messages and by body bytes queued, so
//! neither a fast sender nor a flood of large received bodies grows memory without limit.
//! One message is always admitted into an empty pipe, however large.
//!
//! Wake protocol (no lost wake-ups): a side that finds nothing to do registers its waker and
//! then checks again; the other side changes the state and then wakes. The queue itself is
//! crossbeam's `ArrayQueue` (Vyukov's bounded queue), whose push/pop are release/acquire
//! synchronisation points, so a message pushed before a wake is visible after it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use crossbeam_queue::ArrayQueue;
use futures_util::task::AtomicWaker;

use crate::Message;

pub(crate) struct Pipe {
    queue: ArrayQueue<Message>,
    /// Body bytes in `queue`.
    bytes: AtomicUsize,
    max_bytes: usize,
    /// The consumer's waker: items arrived, or the producer closed.
    rx_waker: AtomicWaker,
    /// The producer's waker: room freed, the consumer closed, or (for transports that use
    /// it) progress the producer waits for.
    tx_waker: AtomicWaker,
    tx_closed: AtomicBool,
    rx_closed: AtomicBool,
}

impl Pipe {
    pub(crate) fn new(capacity: usize, max_bytes: usize) -> Pipe {
        Pipe {
            queue: ArrayQueue::new(capacity.max(1)),
            bytes: AtomicUsize::new(0),
            max_bytes,
            rx_waker: AtomicWaker::new(),
            tx_waker: AtomicWaker::new(),
            tx_closed: AtomicBool::new(false),
            rx_closed: AtomicBool::new(false),
        }
    }

    // ---- producer side ----

    fn has_room(&self) -> bool {
        let len = self.queue.len();
        len == 0
            || (len < self.queue.capacity() && self.bytes.load(Ordering::Acquire) < self.max_bytes)
    }

    /// Ready when a message may be pushed.
    pub(crate) fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.has_room() {
            return Poll::Ready(());
        }
        self.tx_waker.register(cx.waker());
        if self.has_room() || self.is_rx_closed() {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Pushes `msg`; gives it back when the pipe is full (the caller skipped `poll_room`).
    #[allow(clippy::result_large_err)]
    pub(crate) fn push(&self, msg: Message) -> Result<(), Message> {
        let len = msg.body().len();
        self.bytes.fetch_add(len, Ordering::AcqRel);
        if let Err(msg) = self.queue.push(msg) {
            self.bytes.fetch_sub(len, Ordering::AcqRel);
            return Err(msg);
        }
        self.rx_waker.wake();
        Ok(())
    }

    /// The producer is done; the consumer drains what is queued, then sees the end.
    pub(crate) fn close_tx(&self) {
        // SYNC POINT with the `tx_closed` load in `poll_pop`/`try_closed`: every push before
        // this store is visible to a consumer that observes `true`.
        self.tx_closed.store(true, Ordering::Release);
        self.rx_waker.wake();
    }

    pub(crate) fn is_rx_closed(&self) -> bool {
        self.rx_closed.load(Ordering::Acquire)
    }

    /// Registers the producer's waker (for waits on state other than room).
    pub(crate) fn register_tx(&self, cx: &mut Context<'_>) {
        self.tx_waker.register(cx.waker());
    }

    pub(crate) fn wake_tx(&self) {
        self.tx_waker.wake();
    }

    // ---- consumer side ----

    /// Pops one message without waking the producer (batching consumers wake once).
    pub(crate) fn try_pop_quiet(&self) -> Option<Message> {
        let msg = self.queue.pop()?;
        self.bytes.fetch_sub(msg.body().len(), Ordering::AcqRel);
        Some(msg)
    }

    /// Next message; `Ready(None)` once the producer closed and the queue is drained.
    pub(crate) fn poll_pop(&self, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        if let Some(m) = self.try_pop_quiet() {
            self.tx_waker.wake();
            return Poll::Ready(Some(m));
        }
        self.rx_waker.register(cx.waker());
        // SYNC POINT with the `tx_closed` store in `close_tx`: read the flag before the queue.
        let closed = self.tx_closed.load(Ordering::Acquire);
        if let Some(m) = self.try_pop_quiet() {
            self.tx_waker.wake();
            return Poll::Ready(Some(m));
        }
        if closed {
            return Poll::Ready(None);
        }
        Poll::Pending
    }

    /// True when the producer closed and nothing is left.
    pub(crate) fn is_drained_and_closed(&self) -> bool {
        self.tx_closed.load(Ordering::Acquire) && self.queue.is_empty()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Registers the consumer's waker (for waits on state other than items).
    pub(crate) fn register_rx(&self, cx: &mut Context<'_>) {
        self.rx_waker.register(cx.waker());
    }

    pub(crate) fn wake_rx(&self) {
        self.rx_waker.wake();
    }

    /// The consumer is gone; the producer's next `poll_room` returns and it should check
    /// [`is_rx_closed`](Self::is_rx_closed).
    pub(crate) fn close_rx(&self) {
        self.rx_closed.store(true, Ordering::Release);
        self.tx_waker.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use futures_util::task::noop_waker_ref;

    fn msg(n: usize) -> Message {
        Message::new("t")
            .unwrap()
            .with_body(Bytes::from(vec![0u8; n]))
    }

    #[test]
    fn bounded_by_count_and_bytes_but_admits_one_large() {
        let mut cx = Context::from_waker(noop_waker_ref());
        let p = Pipe::new(2, 100);
        assert!(p.poll_room(&mut cx).is_ready());
        p.push(msg(1000)).unwrap(); // larger than max_bytes, admitted into an empty pipe
        assert!(p.poll_room(&mut cx).is_pending());
        assert!(matches!(p.poll_pop(&mut cx), Poll::Ready(Some(_))));
        p.push(msg(10)).unwrap();
        p.push(msg(10)).unwrap();
        assert!(p.poll_room(&mut cx).is_pending(), "count bound");
        assert!(p.push(msg(1)).is_err());
        p.close_tx();
        assert!(matches!(p.poll_pop(&mut cx), Poll::Ready(Some(_))));
        assert!(matches!(p.poll_pop(&mut cx), Poll::Ready(Some(_))));
        assert!(matches!(p.poll_pop(&mut cx), Poll::Ready(None)));
    }

    #[test]
    fn rx_close_releases_a_waiting_producer() {
        let mut cx = Context::from_waker(noop_waker_ref());
        let p = Pipe::new(1, 100);
        p.push(msg(1)).unwrap();
        assert!(p.poll_room(&mut cx).is_pending());
        p.close_rx();
        assert!(p.poll_room(&mut cx).is_ready());
        assert!(p.is_rx_closed());
    }
}
