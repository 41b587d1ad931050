//! A bounded pool of registered buffers, reused.
//!
//! Registering memory pins pages and programs the NIC's translation tables: far too slow to
//! do per message, and the reason UCX and libfabric keep registration caches fed by
//! malloc/mmap hooks (whose leaks and corruption users report). This pool is the explicit
//! alternative: buffers are registered once, in power-of-two size classes, handed out as
//! [`Lease`]s, and come back to the pool when the lease drops (for received bodies: when the
//! last `Bytes` pointing into them drops). No hooks, no global state.
//!
//! The pool is bounded by a byte budget (registered bytes, cached or in use). When a request
//! does not fit, cached buffers of other sizes are deregistered to make room; when it still
//! does not fit, [`Pool::poll_alloc`] is `Pending` until a lease returns: exhaustion is
//! backpressure, never a failure. A request larger than the whole budget fails at once.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use super::verbs::{Access, Region, Verbs, VerbsError};

/// The smallest buffer the pool registers.
pub const MIN_CLASS: usize = 4096;

static POOL_IDS: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The size class (a power of two, at least [`MIN_CLASS`]) that holds `len` bytes.
pub fn class_of(len: usize) -> usize {
    len.max(MIN_CLASS).next_power_of_two()
}

/// Counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes registered now (in use and cached).
    pub registered: u64,
    /// Bytes leased out now.
    pub in_use: u64,
    /// Registrations made (a new buffer).
    pub registrations: u64,
    /// Leases served from a cached buffer.
    pub reuses: u64,
    /// Cached buffers deregistered to make room for another size.
    pub evictions: u64,
    /// Times a request had to wait for a lease to return.
    pub waits: u64,
}

struct State<M> {
    free: HashMap<usize, Vec<M>>,
    cached: u64,
    in_use: u64,
    waiters: Vec<Waker>,
    stats: PoolStats,
}

struct Inner<V: Verbs> {
    verbs: Arc<V>,
    budget: u64,
    access: Access,
    id: u64,
    state: Mutex<State<V::Mr>>,
}

/// A bounded pool of registered buffers of one backend. Cheap to clone (shared).
pub struct Pool<V: Verbs> {
    inner: Arc<Inner<V>>,
}

impl<V: Verbs> Clone for Pool<V> {
    fn clone(&self) -> Pool<V> {
        Pool {
            inner: self.inner.clone(),
        }
    }
}

impl<V: Verbs> fmt::Debug for Pool<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("budget", &self.inner.budget)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<V: Verbs> Pool<V> {
    /// A pool registering at most `budget` bytes through `verbs`, with `access`.
    pub fn new(verbs: Arc<V>, budget: u64, access: Access) -> Pool<V> {
        Pool {
            inner: Arc::new(Inner {
                verbs,
                budget,
                access,
                id: POOL_IDS.fetch_add(1, Ordering::Relaxed),
                state: Mutex::new(State {
                    free: HashMap::new(),
                    cached: 0,
                    in_use: 0,
                    waiters: Vec::new(),
                    stats: PoolStats::default(),
                }),
            }),
        }
    }

    /// A process-unique id of this pool.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.inner.budget
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        let st = lock(&self.inner.state);
        let mut s = st.stats;
        s.in_use = st.in_use;
        s.registered = st.in_use + st.cached;
        s
    }

    /// A lease of at least `len` bytes, or `None` when the budget is used up now (try again
    /// once a lease returns; see [`poll_alloc`](Pool::poll_alloc)).
    ///
    /// Fails when `len` exceeds the whole budget, or when registration fails.
    pub fn try_alloc(&self, len: usize) -> Result<Option<Lease<V>>, PoolError> {
        let class = class_of(len);
        if class as u64 > self.inner.budget {
            return Err(PoolError::TooLarge {
                len,
                budget: self.inner.budget,
            });
        }
        let mut st = lock(&self.inner.state);
        if let Some(mr) = st.free.get_mut(&class).and_then(Vec::pop) {
            st.cached -= class as u64;
            st.in_use += class as u64;
            st.stats.reuses += 1;
            return Ok(Some(self.lease(mr, class, len)));
        }
        // Make room by deregistering cached buffers of other sizes.
        while st.in_use + st.cached + class as u64 > self.inner.budget && st.cached > 0 {
            let Some((&c, _)) = st.free.iter().find(|(_, v)| !v.is_empty()) else {
                break;
            };
            if let Some(mr) = st.free.get_mut(&c).and_then(Vec::pop) {
                st.cached -= c as u64;
                st.stats.evictions += 1;
                drop(mr);
            }
        }
        if st.in_use + class as u64 > self.inner.budget
            || st.in_use + st.cached + class as u64 > self.inner.budget
        {
            return Ok(None);
        }
        st.in_use += class as u64;
        st.stats.registrations += 1;
        drop(st);
        match self.inner.verbs.register(class, self.inner.access) {
            Ok(mr) => Ok(Some(self.lease(mr, class, len))),
            Err(e) => {
                lock(&self.inner.state).in_use -= class as u64;
                Err(PoolError::Register(e))
            }
        }
    }

    /// Like [`try_alloc`](Pool::try_alloc), waiting (with `cx`'s waker) while the budget is
    /// used up.
    pub fn poll_alloc(
        &self,
        cx: &mut Context<'_>,
        len: usize,
    ) -> Poll<Result<Lease<V>, PoolError>> {
        if let Some(l) = self.try_alloc(len)? {
            return Poll::Ready(Ok(l));
        }
        {
            let mut st = lock(&self.inner.state);
            st.stats.waits += 1;
            if !st.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                st.waiters.push(cx.waker().clone());
            }
        }
        // A lease may have returned between the attempt and the registration.
        match self.try_alloc(len)? {
            Some(l) => Poll::Ready(Ok(l)),
            None => Poll::Pending,
        }
    }

    /// Wakes `waker` when a lease returns.
    pub fn notify_on_release(&self, waker: &Waker) {
        let mut st = lock(&self.inner.state);
        if !st.waiters.iter().any(|w| w.will_wake(waker)) {
            st.waiters.push(waker.clone());
        }
    }

    fn lease(&self, mr: V::Mr, class: usize, len: usize) -> Lease<V> {
        Lease {
            mr: Some(mr),
            class,
            len,
            pool: self.inner.clone(),
        }
    }
}

/// Why the pool refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The request exceeds the pool's whole budget.
    #[error("a {len}-byte buffer exceeds the registered-memory pool of {budget} bytes")]
    TooLarge {
        /// Requested bytes.
        len: usize,
        /// The pool's budget.
        budget: u64,
    },
    /// Registration failed.
    #[error(transparent)]
    Register(VerbsError),
}

/// A registered buffer leased from a [`Pool`]; it returns to the pool when dropped.
///
/// `len` is the useful length (the buffer itself is a whole size class). While an
/// operation owns the buffer ([`take_mr`](Lease::take_mr)), the lease still counts it against
/// the budget; [`put_mr`](Lease::put_mr) gives it back.
pub struct Lease<V: Verbs> {
    mr: Option<V::Mr>,
    class: usize,
    len: usize,
    pool: Arc<Inner<V>>,
}

impl<V: Verbs> fmt::Debug for Lease<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lease({} of {} bytes)", self.len, self.class)
    }
}

impl<V: Verbs> Lease<V> {
    /// The useful length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the useful length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the useful length (at most the buffer's size).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.class, "length beyond the buffer");
        self.len = len;
    }

    /// The registered buffer, when no operation owns it.
    pub fn mr(&self) -> Option<&V::Mr> {
        self.mr.as_ref()
    }

    /// The registered buffer, to write, when no operation owns it.
    pub fn mr_mut(&mut self) -> Option<&mut V::Mr> {
        self.mr.as_mut()
    }

    /// Takes the buffer out for an operation.
    pub fn take_mr(&mut self) -> Option<V::Mr> {
        self.mr.take()
    }

    /// Puts the buffer back after its operation completed.
    pub fn put_mr(&mut self, mr: V::Mr) {
        self.mr = Some(mr);
    }

    /// The useful bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.mr {
            Some(mr) => &mr.as_slice()[..self.len],
            None => &[],
        }
    }

    /// The useful bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.mr {
            Some(mr) => &mut mr.as_mut_slice()[..self.len],
            None => &mut [],
        }
    }
}

impl<V: Verbs> AsRef<[u8]> for Lease<V> {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl<V: Verbs> Drop for Lease<V> {
    fn drop(&mut self) {
        let waiters = {
            let mut st = lock(&self.pool.state);
            st.in_use -= self.class as u64;
            if let Some(mr) = self.mr.take() {
                // Back to the cache; it is deregistered (dropped) when the pool goes or
                // another size needs the room.
                st.cached += self.class as u64;
                st.free.entry(self.class).or_default().push(mr);
            }
            std::mem::take(&mut st.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::sim::{self, SimConfig};

    fn pool(budget: u64) -> (Pool<sim::SimVerbs>, sim::SimVerbs) {
        let (a, _b) = sim::pair(SimConfig::default());
        (
            Pool::new(Arc::new(a.clone()), budget, Access::REMOTE_READ),
            a,
        )
    }

    #[test]
    fn reuses_bounds_evicts_and_refuses_oversize() {
        let (p, verbs) = pool(64 << 10);
        assert_eq!(class_of(1), MIN_CLASS);
        assert_eq!(class_of(5000), 8192);
        let a = p.try_alloc(30_000).unwrap().unwrap();
        assert_eq!(a.len(), 30_000);
        let b = p.try_alloc(30_000).unwrap().unwrap();
        // 2 x 32 KiB: the budget is used up; a third waits.
        assert!(p.try_alloc(1).unwrap().is_none());
        drop(a);
        let c = p.try_alloc(20_000).unwrap().unwrap();
        assert_eq!(p.stats().reuses, 1, "the returned 32 KiB buffer is reused");
        drop((b, c));
        // Another size: cached buffers are deregistered to make room.
        let d = p.try_alloc(60_000).unwrap().unwrap();
        assert!(p.stats().evictions >= 2);
        assert!(verbs.stats().registered <= 64 << 10);
        drop(d);
        assert!(matches!(
            p.try_alloc((64 << 10) + 1),
            Err(PoolError::TooLarge { .. })
        ));
    }

    #[test]
    fn waiting_allocation_is_woken_by_a_release() {
        let (p, _v) = pool(8192);
        let held = p.try_alloc(8192).unwrap().unwrap();
        let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let waker = Waker::from(Arc::new(Flag(woken.clone())));
        let mut cx = Context::from_waker(&waker);
        assert!(p.poll_alloc(&mut cx, 100).is_pending());
        assert!(!woken.load(Ordering::SeqCst));
        drop(held);
        assert!(woken.load(Ordering::SeqCst));
        assert!(p.poll_alloc(&mut cx, 100).is_ready());
        assert_eq!(p.stats().waits, 1);
    }
}
