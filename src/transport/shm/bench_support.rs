//! Not part of the API: internals that `benches/` measure on their own (re-exported as
//! `hyperframes::bench_support`, hidden). The `shm://` descriptor ring between two threads of
//! one process, one descriptor per push, published at once, as the `shm://` sender does for a
//! message sent alone.

use std::sync::Arc;

use crate::transport::shm::desc::Desc;
use crate::transport::shm::ring::heap::HeapRing;
use crate::transport::shm::ring::{Consumer, Producer};

/// The producing end.
pub struct RingProducer(Producer<Arc<HeapRing>>);
/// The consuming end.
pub struct RingConsumer(Consumer<Arc<HeapRing>>);

/// A ring of `capacity` (a power of two) descriptors of 128 bytes.
pub fn ring(capacity: usize) -> (RingProducer, RingConsumer) {
    let r = HeapRing::new(capacity);
    (
        RingProducer(Producer::new(r.clone())),
        RingConsumer(Consumer::new(r)),
    )
}

impl RingProducer {
    /// Writes and publishes a descriptor carrying `v` (with the wake-up check a send
    /// makes); false when the ring is full.
    pub fn try_push(&mut self, v: u64) -> bool {
        if self.0.free().unwrap_or(0) == 0 {
            return false;
        }
        self.0.write(&Desc {
            correlation: v,
            kind: Desc::MESSAGE,
            ..Desc::zeroed()
        });
        self.0.publish();
        true
    }
}

impl RingConsumer {
    /// Reads and frees the next descriptor, returning what it carries.
    pub fn try_pop(&mut self) -> Option<u64> {
        let d = self.0.peek()?;
        self.0.take();
        self.0.consume();
        Some(Desc::decode(&d).correlation)
    }
}
