//! Simulated verbs: two queue pairs connected in memory, for testing the protocol without
//! a NIC.
//!
//! The simulation enforces what a NIC enforces, so that a protocol bug shows up here as it
//! would on hardware:
//! * memory is reachable remotely only through a registered region's `rkey`, within its
//!   bounds and with the access it was registered with (`IBV_WC_REM_ACCESS_ERR` otherwise);
//!   a region is deregistered when its buffer is dropped;
//! * a send lands in the oldest posted receive; a message longer than that buffer fails both
//!   sides (`IBV_WC_LOC_LEN_ERR` at the receiver, `IBV_WC_REM_INV_REQ_ERR` at the sender);
//! * a send finding no posted receive is an RNR NAK: counted, then either parked until a
//!   receive is posted (`rnr_retry = 7`, "retry forever") or failed
//!   (`IBV_WC_RNR_RETRY_EXC_ERR`) when the configured retries are zero;
//! * an error moves the queue pair to the error state: what was posted is flushed
//!   (`IBV_WC_WR_FLUSH_ERR`) and so is everything posted later;
//! * a dead peer answers nothing: operations towards it fail with
//!   `IBV_WC_RETRY_EXC_ERR`, while receives already posted simply never complete (as on a
//!   real queue pair; the protocol's keepalive is what notices).
//!
//! Faults are injected per side through [`SimVerbs::faults`]: completion delays (slow
//! completions, and — with a range of delays — completions reported out of order across
//! operations), the n-th operation of a kind failing with a chosen status, and
//! [`SimVerbs::kill`] (the process behind this side dies).
//!
//! Data moves when an operation is posted (a copy, as the NIC's DMA would); the completion
//! is reported when the future is polled (after the injected delay, if any).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;

#[cfg(feature = "cuda")]
use super::verbs::DmaBuf;
use super::verbs::{
    Access, Completion, Region, RemoteRegion, Source, VerbOp, Verbs, VerbsError, WcStatus,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How the simulated queue pairs behave.
#[derive(Clone, Debug, Default)]
pub struct SimConfig {
    /// RNR retries: `None` retries forever (verbs' `rnr_retry = 7`: the send waits for a
    /// receive); `Some(n)` fails a send that finds no posted receive with
    /// `IBV_WC_RNR_RETRY_EXC_ERR` (time between retries is not simulated, so any finite count
    /// behaves as 0).
    pub rnr_retry: Option<u32>,
    /// Largest total of registered bytes per side (like `RLIMIT_MEMLOCK`); `None`: no limit.
    pub memlock: Option<u64>,
    /// RDMA reads and writes check keys, bounds and access but move no bytes (sends still
    /// deliver theirs). Only for measuring the protocol without the cost of the copy that
    /// stands in for the NIC's DMA; bodies arrive with unspecified contents.
    pub skip_bulk_data: bool,
}

/// Faults to inject on one side (see [`SimVerbs::faults`]).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Each completion of this side is reported after a delay drawn uniformly from this
    /// range: slow completions, and completions reported out of order.
    pub delay: Option<(Duration, Duration)>,
    /// The operation of this kind whose (0-based) index is `nth` fails with `status`, and
    /// the queue pair goes to the error state.
    pub fail: Option<(VerbOp, u64, WcStatus)>,
    /// Seed of the delay generator.
    pub seed: u64,
    /// This side's (simulated) NIC driver takes no dma-bufs: registering device memory
    /// (GPUDirect RDMA) fails, as on a kernel before 5.12 or without the GPU driver's
    /// support.
    pub no_dmabuf: bool,
}

/// Counters of one side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Sends that found no posted receive at the peer (RNR NAKs).
    pub rnr_naks: u64,
    /// Sends posted.
    pub sends: u64,
    /// Receives posted.
    pub recvs: u64,
    /// RDMA reads posted.
    pub reads: u64,
    /// RDMA writes posted.
    pub writes: u64,
    /// Bytes moved by this side's operations (send, read, write).
    pub bytes: u64,
    /// Bytes registered now.
    pub registered: u64,
    /// Most bytes registered at once.
    pub registered_peak: u64,
    /// Registrations made.
    pub registrations: u64,
    /// Memory lent to the peer through [`Verbs::expose`] so far (registrations of their own).
    pub exposures: u64,
    /// Bytes lent through [`Verbs::expose`] and registered now.
    pub exposed: u64,
    /// dma-buf registrations (device memory: lent, or as the target of reads).
    pub dmabufs: u64,
}

// ---------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------

/// A block of "pinned" memory: allocated here, or someone else's (then `owner` keeps it
/// alive): lent by [`Verbs::expose`] (never written), or device memory registered as the
/// target of reads (written only by the read that owns the buffer).
struct SimMem {
    ptr: NonNull<u8>,
    len: usize,
    owner: Option<Box<dyn Send + Sync>>,
}

// SAFETY: `SimMem` owns its allocation, or (lent memory) holds its owner, which is
// `Send + Sync`; access to the bytes follows the verbs ownership rules documented on
// `Region` (one owner writes, remote access only through operations; lent memory is
// registered for remote read only and never written).
unsafe impl Send for SimMem {}
// SAFETY: as above; shared access goes through raw-pointer copies made by operations that
// own the destination.
unsafe impl Sync for SimMem {}

impl SimMem {
    fn new(len: usize) -> SimMem {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(b).cast::<u8>()).unwrap_or(NonNull::dangling());
        SimMem {
            ptr,
            len,
            owner: None,
        }
    }

    /// `len` bytes at `ptr`, kept alive (and unchanged) by `owner`.
    fn lent(ptr: *const u8, len: usize, owner: Box<dyn Send + Sync>) -> SimMem {
        SimMem {
            ptr: NonNull::new(ptr.cast_mut()).unwrap_or(NonNull::dangling()),
            len,
            owner: Some(owner),
        }
    }

    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for SimMem {
    fn drop(&mut self) {
        if self.len == 0 || self.owner.is_some() {
            // Lent memory is its owner's to free (dropped with `self`).
            return;
        }
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of `len` bytes in
        // `new`, and are freed once, here.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ))
        });
    }
}

struct RegEntry {
    mem: Weak<SimMem>,
    access: Access,
}

/// A protection domain: the regions of one side, by rkey.
struct Pd {
    regions: Mutex<HashMap<u32, RegEntry>>,
    next_key: AtomicU32,
    registered: AtomicU64,
}

/// A registration in a protection domain: deregistered when dropped.
struct Reg {
    rkey: u32,
    len: usize,
    pd: Arc<Pd>,
    side: Arc<Side>,
}

impl Drop for Reg {
    fn drop(&mut self) {
        lock(&self.pd.regions).remove(&self.rkey);
        self.pd
            .registered
            .fetch_sub(self.len as u64, Ordering::Relaxed);
        lock(&self.side.stats).registered = self.pd.registered.load(Ordering::Relaxed);
    }
}

/// A registered buffer of the simulation.
pub struct SimMr {
    // Deregistered before the memory goes (field order).
    reg: Reg,
    mem: Arc<SimMem>,
}

impl fmt::Debug for SimMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SimMr(rkey {:#x}, {} bytes)",
            self.reg.rkey, self.mem.len
        )
    }
}

/// Memory of ours lent to the peer ([`Verbs::expose`]); deregistered when dropped.
pub struct SimExposed {
    // Deregistered before the memory is let go (field order). A read already under way
    // holds its own reference to the memory, as a NIC finishes a DMA it started.
    reg: Reg,
    mem: Arc<SimMem>,
}

impl fmt::Debug for SimExposed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SimExposed(rkey {:#x}, {} bytes)",
            self.reg.rkey, self.mem.len
        )
    }
}

impl Drop for SimExposed {
    fn drop(&mut self) {
        lock(&self.reg.side.stats).exposed -= self.mem.len as u64;
    }
}

impl Region for SimMr {
    fn len(&self) -> usize {
        self.mem.len
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by `mem`, alive while `self` is; writers are the owner
        // through `&mut self` (excluded here) and operations that own the buffer (so not
        // now, as `self` is borrowed).
        unsafe { std::slice::from_raw_parts(self.mem.ptr.as_ptr(), self.mem.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` excludes other local views. Remote readers
        // reach it only through an advertised rkey, which the protocol hands out for
        // buffers it no longer writes.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr.as_ptr(), self.mem.len) }
    }

    fn remote(&self, offset: usize, len: usize) -> RemoteRegion {
        RemoteRegion {
            addr: self.mem.addr() + offset as u64,
            len: len as u64,
            rkey: self.reg.rkey,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Completions
// ---------------------------------------------------------------------------------------

struct Slot<T> {
    val: Mutex<Option<Result<T, VerbsError>>>,
    waker: AtomicWaker,
}

impl<T> Slot<T> {
    fn new() -> Arc<Slot<T>> {
        Arc::new(Slot {
            val: Mutex::new(None),
            waker: AtomicWaker::new(),
        })
    }

    fn complete(&self, r: Result<T, VerbsError>) {
        *lock(&self.val) = Some(r);
        self.waker.wake();
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<T, VerbsError>> {
        if let Some(r) = lock(&self.val).take() {
            return Poll::Ready(r);
        }
        self.waker.register(cx.waker());
        match lock(&self.val).take() {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }
}

fn completion<T: Send + 'static>(slot: Arc<Slot<T>>, delay: Option<Duration>) -> Completion<T> {
    Box::pin(async move {
        let r = std::future::poll_fn(|cx| slot.poll(cx)).await;
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        r
    })
}

fn ready<T: Send + 'static>(r: Result<T, VerbsError>, delay: Option<Duration>) -> Completion<T> {
    let slot = Slot::new();
    slot.complete(r);
    completion(slot, delay)
}

// ---------------------------------------------------------------------------------------
// Queue pairs
// ---------------------------------------------------------------------------------------

struct PostedRecv {
    buf: SimMr,
    done: Arc<Slot<(SimMr, usize)>>,
}

struct ParkedSend {
    buf: SimMr,
    len: usize,
    done: Arc<Slot<SimMr>>,
}

#[derive(Default)]
struct QpState {
    rq: VecDeque<PostedRecv>,
    /// Sends from the peer waiting for a receive here (RNR, retrying forever).
    parked: VecDeque<ParkedSend>,
    error: bool,
}

/// One side: its queue pair, protection domain, faults and counters.
struct Side {
    qp: Mutex<QpState>,
    pd: Arc<Pd>,
    dead: AtomicBool,
    faults: Mutex<Faults>,
    counts: Mutex<HashMap<VerbOp, u64>>,
    rng: AtomicU64,
    stats: Mutex<SimStats>,
    /// The last regions lent through `expose`, for tests to play a peer that keeps keys.
    exposed_log: Mutex<VecDeque<RemoteRegion>>,
    cfg: SimConfig,
    name: &'static str,
}

/// How many lent regions a side remembers ([`SimVerbs::exposed_regions`]).
const EXPOSED_LOG: usize = 64;

impl Side {
    fn new(cfg: SimConfig, name: &'static str) -> Arc<Side> {
        Arc::new(Side {
            qp: Mutex::new(QpState::default()),
            pd: Arc::new(Pd {
                regions: Mutex::new(HashMap::new()),
                next_key: AtomicU32::new(0x1000),
                registered: AtomicU64::new(0),
            }),
            dead: AtomicBool::new(false),
            faults: Mutex::new(Faults::default()),
            counts: Mutex::new(HashMap::new()),
            rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            stats: Mutex::new(SimStats::default()),
            exposed_log: Mutex::new(VecDeque::new()),
            cfg,
            name,
        })
    }

    /// The delay for the next completion, if delays are injected.
    fn delay(&self) -> Option<Duration> {
        let (lo, hi) = lock(&self.faults).delay?;
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        let span = hi.saturating_sub(lo).as_nanos() as u64;
        Some(lo + Duration::from_nanos(if span == 0 { 0 } else { x % span }))
    }

    /// Counts an operation; the injected failure when it is the chosen one.
    fn injected(&self, op: VerbOp) -> Option<VerbsError> {
        let mut counts = lock(&self.counts);
        let n = counts.entry(op).or_insert(0);
        let idx = *n;
        *n += 1;
        match lock(&self.faults).fail {
            Some((fop, nth, status)) if fop == op && nth == idx => {
                Some(VerbsError::new(op, status).with_detail("injected by the simulation"))
            }
            _ => None,
        }
    }

    /// Moves the queue pair to the error state, flushing posted receives.
    fn set_error(&self) {
        let flushed = {
            let mut qp = lock(&self.qp);
            qp.error = true;
            std::mem::take(&mut qp.rq)
        };
        for r in flushed {
            r.done
                .complete(Err(VerbsError::new(VerbOp::Recv, WcStatus::Flushed)));
        }
    }

    fn in_error(&self) -> bool {
        self.dead.load(Ordering::Acquire) || lock(&self.qp).error
    }
}

/// One side of a simulated connection: implements [`Verbs`].
#[derive(Clone)]
pub struct SimVerbs {
    me: Arc<Side>,
    peer: Arc<Side>,
}

impl fmt::Debug for SimVerbs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimVerbs({})", self.me.name)
    }
}

/// Two connected sides.
pub fn pair(cfg: SimConfig) -> (SimVerbs, SimVerbs) {
    let a = Side::new(cfg.clone(), "sim-a");
    let b = Side::new(cfg, "sim-b");
    (
        SimVerbs {
            me: a.clone(),
            peer: b.clone(),
        },
        SimVerbs { me: b, peer: a },
    )
}

impl SimVerbs {
    /// Changes the faults injected on this side from now on.
    pub fn set_faults(&self, faults: Faults) {
        let seed = faults.seed;
        *lock(&self.me.faults) = faults;
        if seed != 0 {
            self.me.rng.store(seed, Ordering::Relaxed);
        }
    }

    /// The faults injected on this side.
    pub fn faults(&self) -> Faults {
        lock(&self.me.faults).clone()
    }

    /// The process behind this side dies: its queue pair answers nothing any more. Its own
    /// posted work is flushed; the peer's operations towards it fail with
    /// `IBV_WC_RETRY_EXC_ERR`, and sends of the peer parked here (RNR) fail too.
    pub fn kill(&self) {
        self.me.dead.store(true, Ordering::Release);
        let parked = std::mem::take(&mut lock(&self.me.qp).parked);
        for p in parked {
            p.done
                .complete(Err(VerbsError::new(VerbOp::Send, WcStatus::RetryExceeded)));
        }
        self.me.set_error();
    }

    /// This side's counters.
    pub fn stats(&self) -> SimStats {
        *lock(&self.me.stats)
    }

    /// The regions this side lent the peer through [`Verbs::expose`] (the last 64), oldest
    /// first: what a peer learned from our `RTS`s, for tests of what its keys still reach.
    pub fn exposed_regions(&self) -> Vec<RemoteRegion> {
        lock(&self.me.exposed_log).iter().copied().collect()
    }

    /// True once this side's queue pair is in the error state (or dead).
    pub fn in_error(&self) -> bool {
        self.me.in_error()
    }

    fn fail<T: Send + 'static>(&self, e: VerbsError) -> Completion<T> {
        self.me.set_error();
        ready(Err(e), self.me.delay())
    }

    /// The common checks of an operation of ours; `Some(completion)` when it fails now.
    fn precheck(&self, op: VerbOp) -> Option<VerbsError> {
        if self.me.in_error() {
            return Some(VerbsError::new(op, WcStatus::Flushed));
        }
        if let Some(e) = self.me.injected(op) {
            return Some(e);
        }
        if op != VerbOp::Recv && self.peer.dead.load(Ordering::Acquire) {
            return Some(
                VerbsError::new(op, WcStatus::RetryExceeded).with_detail("the peer is gone"),
            );
        }
        if matches!(op, VerbOp::Read | VerbOp::Write) && lock(&self.peer.qp).error {
            // A responder in the error state answers no request.
            return Some(
                VerbsError::new(op, WcStatus::RetryExceeded)
                    .with_detail("the peer's queue pair is in the error state"),
            );
        }
        None
    }

    /// Finds `remote` in the peer's protection domain, checks access and bounds.
    fn resolve(
        &self,
        op: VerbOp,
        remote: RemoteRegion,
    ) -> Result<(Arc<SimMem>, usize), VerbsError> {
        let regions = lock(&self.peer.pd.regions);
        let err = |why: &str| {
            Err(VerbsError::new(op, WcStatus::RemoteAccess).with_detail(why.to_owned()))
        };
        let Some(entry) = regions.get(&remote.rkey) else {
            return err("unknown rkey (not registered, or deregistered)");
        };
        let allowed = match op {
            VerbOp::Read => entry.access.remote_read,
            _ => entry.access.remote_write,
        };
        if !allowed {
            return err("the region is not registered for this remote access");
        }
        let Some(mem) = entry.mem.upgrade() else {
            return err("the region is gone");
        };
        let base = mem.addr();
        let end = remote.addr.checked_add(remote.len);
        match end {
            Some(end) if remote.addr >= base && end <= base + mem.len as u64 => {
                let off = (remote.addr - base) as usize;
                Ok((mem, off))
            }
            _ => err("range outside the registered region"),
        }
    }

    /// Registers `mem` with `access` in our protection domain.
    fn reg(&self, mem: &Arc<SimMem>, access: Access) -> Result<Reg, VerbsError> {
        if self.me.in_error() && self.me.dead.load(Ordering::Acquire) {
            return Err(VerbsError::new(VerbOp::Register, WcStatus::NoDevice).with_detail("dead"));
        }
        if let Some(e) = self.me.injected(VerbOp::Register) {
            return Err(e);
        }
        let (pd, len) = (&self.me.pd, mem.len);
        let now = pd.registered.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
        if let Some(limit) = self.me.cfg.memlock
            && now > limit
        {
            pd.registered.fetch_sub(len as u64, Ordering::Relaxed);
            return Err(
                VerbsError::new(VerbOp::Register, WcStatus::NoMemory).with_detail(format!(
                    "{len} bytes more would exceed the locked-memory limit of {limit}"
                )),
            );
        }
        let rkey = pd.next_key.fetch_add(1, Ordering::Relaxed);
        lock(&pd.regions).insert(
            rkey,
            RegEntry {
                mem: Arc::downgrade(mem),
                access,
            },
        );
        self.count(|s| {
            s.registrations += 1;
            s.registered = now;
            s.registered_peak = s.registered_peak.max(now);
        });
        Ok(Reg {
            rkey,
            len,
            pd: pd.clone(),
            side: self.me.clone(),
        })
    }

    fn count(&self, f: impl FnOnce(&mut SimStats)) {
        f(&mut lock(&self.me.stats));
    }
}

impl SimVerbs {
    /// A dma-buf's bytes, as the NIC would reach them: the file mapped (writable when it is
    /// the target of reads). The stand-in device exports a memfd; a GPU's dma-buf is not for
    /// the CPU to map, so the simulation refuses one it cannot map.
    #[cfg(feature = "cuda")]
    fn dmabuf(&self, buf: DmaBuf, write: bool) -> Result<SimMem, VerbsError> {
        let DmaBuf {
            fd,
            offset,
            len,
            keep,
        } = buf;
        let refused =
            |why: String| Err(VerbsError::new(VerbOp::Register, WcStatus::Other).with_detail(why));
        if lock(&self.me.faults).no_dmabuf {
            return refused("the (simulated) NIC's driver takes no dma-bufs".into());
        }
        self.count(|s| s.dmabufs += 1);
        #[cfg(feature = "shm")]
        {
            let Some(end) = offset.checked_add(len as u64) else {
                return refused(format!("a dma-buf range of {len} bytes at {offset}"));
            };
            let map = match crate::transport::shm::Mapping::new(&fd, end, write) {
                Ok(m) => m,
                Err(e) => return refused(format!("mapping the dma-buf: {e}")),
            };
            let ptr = map.base().wrapping_add(offset as usize);
            // The mapping, then what holds the memory, go when the region does.
            Ok(SimMem::lent(ptr, len, Box::new((map, fd, keep))))
        }
        #[cfg(not(feature = "shm"))]
        {
            let _ = (fd, offset, keep, write);
            refused(format!(
                "the simulation maps dma-bufs with `shm`'s mapping ({len} bytes)"
            ))
        }
    }
}

/// Copies `len` bytes between two simulated memories.
fn dma(src: &SimMem, src_off: usize, dst: &SimMem, dst_off: usize, len: usize) {
    debug_assert!(src_off + len <= src.len && dst_off + len <= dst.len);
    if len == 0 {
        return;
    }
    let (src_p, dst_p) = (
        src.ptr.as_ptr().wrapping_add(src_off),
        dst.ptr.as_ptr().wrapping_add(dst_off),
    );
    if len == 8 && src_p.align_offset(8) == 0 && dst_p.align_offset(8) == 0 {
        // An aligned 8-byte copy is atomic, as a NIC's is: a heartbeat counter its owner
        // advances while the peer reads it is read whole, without a data race.
        // SAFETY: both are in bounds (checked by the caller), 8-byte aligned, and every
        // concurrent access to such a counter is atomic (`Driver::beat`); other 8-byte
        // buffers are owned by the operation, so no one else touches them now.
        unsafe {
            let v = std::sync::atomic::AtomicU64::from_ptr(src_p.cast::<u64>())
                .load(std::sync::atomic::Ordering::Relaxed);
            std::sync::atomic::AtomicU64::from_ptr(dst_p.cast::<u64>())
                .store(v, std::sync::atomic::Ordering::Relaxed);
        }
        return;
    }
    // SAFETY: both ranges were bounds-checked by the caller against their allocations,
    // which are alive (`&SimMem`). The destination is owned by the operation doing the copy
    // (a posted receive, a read's local buffer) or registered for remote write; the source
    // is owned by the operation or registered for remote read, which the protocol does only
    // for buffers no one writes. `ptr::copy` tolerates overlap (a region read into itself).
    unsafe {
        std::ptr::copy(
            src.ptr.as_ptr().add(src_off),
            dst.ptr.as_ptr().add(dst_off),
            len,
        )
    }
}

impl Side {
    /// Delivers a send into the oldest posted receive. The queue pair lock is held by the
    /// caller (`qp`).
    fn deliver(
        qp: &mut QpState,
        recv: PostedRecv,
        sbuf: SimMr,
        len: usize,
        sdone: &Slot<SimMr>,
    ) -> bool {
        if len > recv.buf.mem.len {
            qp.error = true;
            recv.done
                .complete(Err(VerbsError::new(VerbOp::Recv, WcStatus::LocalLength)
                    .with_detail(format!(
                        "{len}-byte message into a {}-byte receive buffer",
                        recv.buf.mem.len
                    ))));
            sdone.complete(Err(VerbsError::new(
                VerbOp::Send,
                WcStatus::RemoteInvalidRequest,
            )
            .with_detail(
                "the message is longer than the peer's posted receive buffer",
            )));
            return false;
        }
        dma(&sbuf.mem, 0, &recv.buf.mem, 0, len);
        recv.done.complete(Ok((recv.buf, len)));
        sdone.complete(Ok(sbuf));
        true
    }
}

impl Verbs for SimVerbs {
    type Mr = SimMr;
    type Exposed = SimExposed;

    fn register(&self, len: usize, access: Access) -> Result<SimMr, VerbsError> {
        let mem = Arc::new(SimMem::new(len));
        let reg = self.reg(&mem, access)?;
        Ok(SimMr { reg, mem })
    }

    fn expose(&self, src: Source) -> Result<(SimExposed, RemoteRegion), VerbsError> {
        let mem = Arc::new(match src {
            Source::Host(bytes) => SimMem::lent(bytes.as_ptr(), bytes.len(), Box::new(bytes)),
            #[cfg(feature = "cuda")]
            Source::DmaBuf(buf) => self.dmabuf(buf, false)?,
        });
        let reg = self.reg(&mem, Access::REMOTE_READ)?;
        let region = RemoteRegion {
            addr: mem.addr(),
            len: mem.len as u64,
            rkey: reg.rkey,
        };
        self.count(|s| {
            s.exposures += 1;
            s.exposed += mem.len as u64;
        });
        {
            let mut log = lock(&self.me.exposed_log);
            if log.len() == EXPOSED_LOG {
                log.pop_front();
            }
            log.push_back(region);
        }
        Ok((SimExposed { reg, mem }, region))
    }

    #[cfg(feature = "cuda")]
    fn register_dmabuf(&self, buf: DmaBuf) -> Result<SimMr, VerbsError> {
        let mem = Arc::new(self.dmabuf(buf, true)?);
        let reg = self.reg(&mem, Access::LOCAL)?;
        Ok(SimMr { reg, mem })
    }

    fn post_recv(&self, buf: SimMr) -> Completion<(SimMr, usize)> {
        if let Some(e) = self.precheck(VerbOp::Recv) {
            return self.fail(e);
        }
        self.count(|s| s.recvs += 1);
        let done = Slot::new();
        let recv = PostedRecv {
            buf,
            done: done.clone(),
        };
        let mut qp = lock(&self.me.qp);
        if let Some(p) = qp.parked.pop_front() {
            // A send waited for this receive (RNR retry succeeded).
            let ok = Side::deliver(&mut qp, recv, p.buf, p.len, &p.done);
            drop(qp);
            if !ok {
                self.me.set_error();
            }
        } else {
            qp.rq.push_back(recv);
        }
        completion(done, self.me.delay())
    }

    fn post_send(&self, buf: SimMr, len: usize) -> Completion<SimMr> {
        if let Some(e) = self.precheck(VerbOp::Send) {
            return self.fail(e);
        }
        if len > buf.mem.len {
            return self.fail(VerbsError::new(VerbOp::Send, WcStatus::LocalLength));
        }
        self.count(|s| {
            s.sends += 1;
            s.bytes += len as u64;
        });
        let done = Slot::new();
        let mut pqp = lock(&self.peer.qp);
        if pqp.error {
            drop(pqp);
            return self.fail(
                VerbsError::new(VerbOp::Send, WcStatus::RetryExceeded)
                    .with_detail("the peer's queue pair is in the error state"),
            );
        }
        match pqp.rq.pop_front() {
            Some(recv) => {
                let ok = Side::deliver(&mut pqp, recv, buf, len, &done);
                drop(pqp);
                if !ok {
                    self.peer.set_error();
                    self.me.set_error();
                }
            }
            None => {
                self.count(|s| s.rnr_naks += 1);
                if self.me.cfg.rnr_retry.is_some() {
                    drop(pqp);
                    return self.fail(
                        VerbsError::new(VerbOp::Send, WcStatus::RnrRetryExceeded)
                            .with_detail("the peer had no receive posted"),
                    );
                }
                pqp.parked.push_back(ParkedSend {
                    buf,
                    len,
                    done: done.clone(),
                });
            }
        }
        completion(done, self.me.delay())
    }

    fn post_read(&self, buf: SimMr, remote: RemoteRegion) -> Completion<SimMr> {
        if let Some(e) = self.precheck(VerbOp::Read) {
            return self.fail(e);
        }
        let (mem, off) = match self.resolve(VerbOp::Read, remote) {
            Ok(x) => x,
            Err(e) => return self.fail(e),
        };
        let len = remote.len as usize;
        if len > buf.mem.len {
            return self.fail(
                VerbsError::new(VerbOp::Read, WcStatus::LocalLength)
                    .with_detail(format!("{len} bytes into a {}-byte buffer", buf.mem.len)),
            );
        }
        if !self.me.cfg.skip_bulk_data {
            dma(&mem, off, &buf.mem, 0, len);
        }
        self.count(|s| {
            s.reads += 1;
            s.bytes += len as u64;
        });
        ready(Ok(buf), self.me.delay())
    }

    fn post_write(&self, buf: SimMr, remote: RemoteRegion) -> Completion<SimMr> {
        if let Some(e) = self.precheck(VerbOp::Write) {
            return self.fail(e);
        }
        let (mem, off) = match self.resolve(VerbOp::Write, remote) {
            Ok(x) => x,
            Err(e) => return self.fail(e),
        };
        let len = remote.len as usize;
        if len > buf.mem.len {
            return self.fail(VerbsError::new(VerbOp::Write, WcStatus::LocalLength));
        }
        if !self.me.cfg.skip_bulk_data {
            dma(&buf.mem, 0, &mem, off, len);
        }
        self.count(|s| {
            s.writes += 1;
            s.bytes += len as u64;
        });
        ready(Ok(buf), self.me.delay())
    }

    fn name(&self) -> String {
        self.me.name.to_owned()
    }
}
