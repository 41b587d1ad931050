//! The bounded pool of staging buffers of one `Gpu`.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use super::{Backend, HostMem, Staging};
use crate::error::Result;

/// Up to `buffers` host buffers of `chunk` bytes, made when first needed, kept for reuse.
/// A sender that finds none free waits until a transport drops one it has written.
pub(crate) struct Pool {
    staging: Staging,
    state: Mutex<State>,
}

struct State {
    free: Vec<Box<dyn HostMem>>,
    made: usize,
    waiters: Vec<Waker>,
}

impl Pool {
    pub(crate) fn new(staging: Staging) -> Pool {
        Pool {
            staging,
            state: Mutex::new(State {
                free: Vec::new(),
                made: 0,
                waiters: Vec::new(),
            }),
        }
    }

    pub(crate) fn staging(&self) -> Staging {
        self.staging
    }

    /// (made, in use).
    pub(crate) fn counts(&self) -> (usize, usize) {
        let st = self.state.lock().expect("not poisoned");
        (st.made, st.made - st.free.len())
    }

    /// A free buffer, a new one while fewer than `buffers` exist, or `Pending` until one is
    /// returned.
    pub(crate) fn poll_take(
        self: &Arc<Pool>,
        backend: &dyn Backend,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Pooled>> {
        let mut st = self.state.lock().expect("not poisoned");
        if let Some(mem) = st.free.pop() {
            return Poll::Ready(Ok(self.lend(mem)));
        }
        if st.made < self.staging.buffers {
            st.made += 1;
            drop(st);
            return Poll::Ready(match backend.alloc_host(self.staging.chunk) {
                Ok(mem) => Ok(self.lend(mem)),
                Err(e) => {
                    self.state.lock().expect("not poisoned").made -= 1;
                    Err(e)
                }
            });
        }
        if !st.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            st.waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }

    fn lend(self: &Arc<Pool>, mem: Box<dyn HostMem>) -> Pooled {
        Pooled {
            len: mem.len(),
            mem: Some(mem),
            pool: self.clone(),
        }
    }

    fn give_back(&self, mem: Box<dyn HostMem>) {
        let waiters = {
            let mut st = self.state.lock().expect("not poisoned");
            st.free.push(mem);
            std::mem::take(&mut st.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

/// A staging buffer lent by the pool; it goes back on drop. As a body chunk it is the owner
/// of a `Bytes` (`Bytes::from_owner`), so it returns when the transport has written it.
pub(crate) struct Pooled {
    mem: Option<Box<dyn HostMem>>,
    len: usize,
    pool: Arc<Pool>,
}

impl Pooled {
    fn mem(&self) -> &dyn HostMem {
        &**self.mem.as_ref().expect("present until drop")
    }

    /// Uses the first `len` bytes.
    pub(crate) fn set_len(&mut self, len: usize) {
        assert!(len <= self.mem().len(), "chunk larger than its buffer");
        self.len = len;
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.mem().as_ptr()
    }
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the buffer is valid for `mem().len() >= self.len` bytes for as long as
        // `self` holds it, and a `Pooled` is read only after the copy into it completed
        // (`Ticket::poll` hands it out then); nothing writes to it while it is lent out.
        unsafe { std::slice::from_raw_parts(self.mem().as_ptr(), self.len) }
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            self.pool.give_back(mem);
        }
    }
}
