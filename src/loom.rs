//! The concurrency seam: every atomic and `UnsafeCell` of the lock-free structures goes
//! through here, so that the same algorithms run against loom's model checker with
//! `RUSTFLAGS="--cfg hyperframes_loom"` (as tokio's `src/loom` does). Under loom the
//! structures live on the heap instead of in shared memory. (`UnsafeCell` is loom's, for the
//! models' own payload cells; shared memory is only ever accessed through atomics.)

#[cfg(hyperframes_loom)]
pub(crate) mod sync {
    pub(crate) use loom::cell::UnsafeCell;
    pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
}

#[cfg(not(hyperframes_loom))]
pub(crate) mod sync {
    pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
}

/// Aligns `T` to 128 bytes, the unit of false sharing on x86-64 (a pair of 64-byte lines is
/// prefetched together) and the cache line of Apple's ARM cores. `repr(C)` so that its layout
/// is fixed, for shared memory.
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}
