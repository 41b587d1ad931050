//! The concurrency seam: every atomic and `UnsafeCell` of the lock-free structures goes
//! through here, so that the same algorithms run against loom's model checker with
//! `RUSTFLAGS="--cfg hyperframes_loom"` (as tokio's `src/loom` does). Under loom the
//! structures live on the heap instead of in shared memory. (`UnsafeCell` is loom's, for the
//! models' own payload cells; shared memory is only ever accessed through atomics.)

#[cfg(hyperframes_loom)]
pub(crate) mod sync {
    pub(crate) use loom::cell::UnsafeCell;
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};

    /// loom's waker cell, with the signature of futures' (`register` by reference).
    #[derive(Debug, Default)]
    pub(crate) struct AtomicWaker(loom::future::AtomicWaker);

    impl AtomicWaker {
        pub(crate) fn new() -> AtomicWaker {
            AtomicWaker(loom::future::AtomicWaker::new())
        }

        pub(crate) fn register(&self, waker: &std::task::Waker) {
            self.0.register_by_ref(waker);
        }

        pub(crate) fn wake(&self) {
            self.0.wake();
        }
    }
}

/// Outside loom: std's atomics and futures' waker cell, each in a `repr(transparent)` newtype
/// (the same layout, for shared memory; `Deref` gives their methods). The newtypes are what
/// keeps the seam: clippy.toml disallows std's atomic types, `fence` and `UnsafeCell`, and
/// the lock-free modules deny that lint, so code there that names std's own would not build
/// (while these, being other types, pass).
#[cfg(not(hyperframes_loom))]
#[cfg_attr(not(feature = "shm"), allow(unused_imports, dead_code))]
#[allow(clippy::disallowed_types, clippy::disallowed_methods)]
pub(crate) mod sync {
    pub(crate) use std::sync::atomic::Ordering;

    macro_rules! atomic {
        ($name:ident, $t:ty) => {
            #[doc = concat!("std's `", stringify!($name), "`, through the seam.")]
            #[repr(transparent)]
            #[derive(Debug, Default)]
            pub(crate) struct $name(std::sync::atomic::$name);

            impl $name {
                pub(crate) const fn new(v: $t) -> $name {
                    $name(std::sync::atomic::$name::new(v))
                }
            }

            impl std::ops::Deref for $name {
                type Target = std::sync::atomic::$name;
                #[inline(always)]
                fn deref(&self) -> &Self::Target {
                    &self.0
                }
            }
        };
    }

    atomic!(AtomicBool, bool);
    atomic!(AtomicU32, u32);
    atomic!(AtomicU64, u64);

    /// std's `UnsafeCell` with loom's interface (`with`, `with_mut`: the pointer is only
    /// handed to a closure, so that loom can track each access), through the seam.
    #[repr(transparent)]
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) const fn new(v: T) -> UnsafeCell<T> {
            UnsafeCell(std::cell::UnsafeCell::new(v))
        }

        #[inline(always)]
        pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        #[inline(always)]
        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }

    /// std's `fence`, through the seam.
    #[inline(always)]
    pub(crate) fn fence(order: Ordering) {
        std::sync::atomic::fence(order);
    }

    /// futures' `AtomicWaker`, through the seam.
    #[derive(Debug, Default)]
    pub(crate) struct AtomicWaker(futures_util::task::AtomicWaker);

    impl AtomicWaker {
        pub(crate) fn new() -> AtomicWaker {
            AtomicWaker(futures_util::task::AtomicWaker::new())
        }

        #[inline(always)]
        pub(crate) fn register(&self, waker: &std::task::Waker) {
            self.0.register(waker);
        }

        #[inline(always)]
        pub(crate) fn wake(&self) {
            self.0.wake();
        }
    }
}

/// Aligns `T` to 128 bytes, the unit of false sharing on x86-64 (a pair of 64-byte lines is
/// prefetched together) and the cache line of Apple's ARM cores. `repr(C)` so that its layout
/// is fixed, for shared memory.
#[cfg_attr(not(feature = "shm"), allow(dead_code))]
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}
