//! The default hardware backend: [`Verbs`] on sideway (MPL-2.0), and `rdma://` set-up.
//!
//! sideway binds rdma-core through rdma-mummy-sys, which loads `libibverbs.so.1` with
//! `dlopen` when the process starts: building needs no RDMA headers or libraries, and on a
//! host without them every verb answers an error (the device check below turns it into
//! [`ErrorKind::Unavailable`]), never a failed start or a panic.
//!
//! One connection is one RC queue pair with one completion queue and its completion channel.
//! Posting is synchronous and in order (the queue pair behind a mutex, held for the post
//! only). Every posted buffer moves into the table of work in flight, keyed by work-request
//! id, and comes back with its completion: no buffer can be freed or reused while the NIC may
//! touch it, even if the operation's future is dropped. A reaper task per connection waits
//! on the completion channel's descriptor through tokio's [`AsyncFd`], then drains the
//! completion queue in batches and answers each operation's future. Set-up goes through
//! rdma_cm ([`cm`](super::cm)), or the TCP exchange of [`setup`](super::setup) where rdma_cm
//! is missing or refused.
//!
//! What needs hardware to be checked: everything after the device check. The protocol above
//! this backend is the one the simulated verbs test; this file is the translation to verbs.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, GenericCompletionQueue,
    PollCompletionQueueError,
};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
    SetScatterGatherEntry, WorkRequestFlags,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use super::setup::{self, Endpoint, Placement};
#[cfg(feature = "cuda")]
use super::verbs::DmaBuf;
use super::verbs::{
    Access, Completion, Region, RemoteRegion, Source, VerbOp, Verbs, VerbsError, WcStatus,
};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{AcceptHalf, Config, Parts};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The RDMA devices of this host: sysfs first (nothing loaded when it lists none), then
/// `ibv_get_device_list` through rdma-core.
pub(crate) fn devices() -> Result<Vec<String>> {
    let names = setup::sysfs_devices()?;
    match DeviceList::new() {
        Ok(list) if !list.is_empty() => Ok(names),
        Ok(_) => Err(setup::no_device("ibv_get_device_list returned no devices")),
        Err(e) => Err(setup::no_device(format!(
            "ibv_get_device_list failed: {e:#} (is rdma-core's libibverbs.so.1 installed?)"
        ))),
    }
}

/// `IBV_WC_*` statuses as the protocol knows them.
fn wc_status(status: u32) -> WcStatus {
    match status {
        1 => WcStatus::LocalLength,
        4 => WcStatus::LocalProtection,
        5 => WcStatus::Flushed,
        9 => WcStatus::RemoteInvalidRequest,
        10 => WcStatus::RemoteAccess,
        12 => WcStatus::RetryExceeded,
        13 => WcStatus::RnrRetryExceeded,
        _ => WcStatus::Other,
    }
}

fn verbs_failed(op: VerbOp, e: impl std::fmt::Display) -> VerbsError {
    VerbsError::new(op, WcStatus::Other).with_detail(e.to_string())
}

/// Memory registered with the device: allocated here, or (GPUDirect RDMA, the target of
/// reads) device memory registered as a dma-buf, which has no CPU view. Fields drop in
/// order: the registration goes before the memory it covers.
pub(crate) struct SwMr {
    mr: Arc<MemoryRegion>,
    mem: Option<Box<[u8]>>,
    /// The address the work requests name (the iova of a dma-buf).
    addr: u64,
    len: usize,
    #[cfg(feature = "cuda")]
    _device: Option<DmaBuf>,
}

impl Region for SwMr {
    fn len(&self) -> usize {
        self.len
    }

    fn as_slice(&self) -> &[u8] {
        self.mem.as_deref().unwrap_or(&[])
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.as_deref_mut().unwrap_or(&mut [])
    }

    fn remote(&self, offset: usize, len: usize) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr + offset as u64,
            len: len as u64,
            rkey: self.mr.rkey(),
        }
    }
}

impl SwVerbs {
    /// Registers `buf` with `access`; the peer and the work requests address it by its
    /// offset (the iova keeps the offset's place in its page, as the NIC's translation
    /// wants).
    ///
    /// # Safety
    /// `buf`'s memory stays valid, `offset..offset + len` within it, until the returned
    /// registration is dropped.
    #[cfg(feature = "cuda")]
    unsafe fn reg_dmabuf(
        &self,
        buf: &DmaBuf,
        access: AccessFlags,
    ) -> std::result::Result<Arc<MemoryRegion>, VerbsError> {
        use std::os::fd::AsRawFd;
        let (fd, offset) = (buf.fd.as_raw_fd(), buf.offset);
        // SAFETY: as the caller promises.
        unsafe { self.pd.reg_dmabuf_mr(offset, buf.len, offset, fd, access) }.map_err(|e| {
            VerbsError::new(VerbOp::Register, WcStatus::NoMemory).with_detail(format!(
                "{e:#} (GPUDirect RDMA needs an RDMA driver that takes dma-bufs, Linux \
                     5.12+ and rdma-core 34+, and a GPU driver that exports them; run `hf doctor`)"
            ))
        })
    }
}

/// Memory of ours lent to the peer ([`Verbs::expose`]). Fields drop in order: the
/// registration goes before the memory it covers is let go.
pub(crate) struct SwExposed {
    _mr: Arc<MemoryRegion>,
    _mem: Source,
}

/// What a completion hands back: the buffer and the bytes received, or why it failed.
type Answer = std::result::Result<(SwMr, usize), VerbsError>;

/// A posted operation: its buffer (owned here until the NIC is done with it) and who waits.
struct Inflight {
    buf: SwMr,
    op: VerbOp,
    tx: oneshot::Sender<Answer>,
}

type Table = Arc<Mutex<HashMap<u64, Inflight>>>;

/// An open device: context, protection domain and where on it.
pub(super) struct Device {
    pub(super) ctx: Arc<DeviceContext>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) port: u8,
    pub(super) gid_index: u32,
    pub(super) name: String,
}

fn open(p: &Placement) -> Result<Device> {
    devices()?;
    let unavailable = |what: &str, e: &dyn std::fmt::Display| {
        Error::new(ErrorKind::Unavailable, format!("{what}: {e:#}"))
    };
    let list = DeviceList::new().map_err(|e| unavailable("listing RDMA devices", &e))?;
    let dev = list
        .iter()
        .find(|d| p.device.as_deref().is_none_or(|want| d.name() == want))
        .ok_or_else(|| {
            setup::no_device(format!(
                "HYPERFRAMES_RDMA_DEVICE={:?} is not among this host's devices",
                p.device.as_deref().unwrap_or("")
            ))
        })?;
    let name = dev.name();
    let ctx = dev
        .open()
        .map_err(|e| unavailable(&format!("opening {name}"), &e))?;
    let pd = ctx
        .alloc_pd()
        .map_err(|e| unavailable(&format!("allocating a protection domain on {name}"), &e))?;
    Ok(Device {
        ctx,
        pd,
        port: p.port,
        gid_index: p.gid_index,
        name: format!("{name}:{}", p.port),
    })
}

/// What the peer may do on our queue pair: read and write the regions we advertise.
pub(super) fn remote_access() -> AccessFlags {
    AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite
}

/// Outstanding RDMA reads a side asks to have, and to serve ([`SwVerbs::reads`] caps it by
/// the device's limits).
pub(super) const READS_IN_FLIGHT: u8 = 16;

/// A channel of sideway's (completion, rdma_cm events), as [`AsyncFd`] sees it: holding
/// the channel keeps its descriptor open for as long as the `AsyncFd` lives.
pub(super) struct ChannelFd<T>(pub(super) Arc<T>);

impl<T: AsRawFd> AsRawFd for ChannelFd<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// `ch`'s descriptor (non-blocking), awaited for reading through tokio.
pub(super) fn readable<T: AsRawFd>(ch: Arc<T>) -> std::io::Result<AsyncFd<ChannelFd<T>>> {
    // SAFETY: `ChannelFd` owns the channel, so the descriptor stays open and the same for the
    // whole life of the `AsyncFd`, and `as_raw_fd` always returns it.
    unsafe { AsyncFd::register_with_interest(ChannelFd(ch), tokio::io::Interest::READABLE) }
        .map_err(Into::into)
}

/// [`Verbs`] over one sideway queue pair. Fields drop in order: the queue pair (no DMA after
/// it is destroyed) before the buffers of what was in flight.
pub(crate) struct SwVerbs {
    qp: Mutex<BasicQueuePair>,
    inflight: Table,
    pd: Arc<ProtectionDomain>,
    next: AtomicU64,
    reaper: tokio::task::JoinHandle<()>,
    name: String,
    /// Outstanding RDMA reads each way: [`READS_IN_FLIGHT`], or less where the device
    /// allows less (`max_qp_rd_atom`, `max_qp_init_rd_atom`).
    reads: u8,
    /// What the connection's set-up must keep for as long as the queue pair lives (its
    /// rdma_cm identifier).
    _setup: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl Drop for SwVerbs {
    fn drop(&mut self) {
        self.reaper.abort();
    }
}

impl SwVerbs {
    /// A queue pair on `dev` (in the RESET state), its completion queue, and the reaper task
    /// (spawned on the current runtime). `depth`: work requests per direction.
    pub(super) fn new(dev: &Device, depth: u32, peer: &str) -> Result<SwVerbs> {
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            Error::new(ErrorKind::Io, format!("{what} on {}: {e:#}", dev.name))
        };
        let ch = dev
            .ctx
            .create_comp_channel()
            .map_err(|e| failed("creating a completion channel", &e))?;
        ch.set_nonblocking(true)
            .map_err(|e| failed("making the completion channel non-blocking", &e))?;
        let cq = dev
            .ctx
            .create_cq_builder()
            .setup_cqe(depth * 2)
            .setup_comp_channel(&ch, 0)
            .build()
            .map_err(|e| failed("creating a completion queue", &e))?;
        let qp = dev
            .pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(depth)
            .setup_max_recv_wr(depth)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(GenericCompletionQueue::from(cq.clone()))
            .setup_recv_cq(GenericCompletionQueue::from(cq.clone()))
            .build()
            .map_err(|e| failed("creating a queue pair", &e))?;
        let caps = dev
            .ctx
            .query_device()
            .map_err(|e| failed("querying the device's limits", &e))?;
        let reads = [
            i64::from(READS_IN_FLIGHT),
            i64::from(caps.max_qp_rd_atom()),
            i64::from(caps.max_qp_init_rd_atom()),
        ]
        .into_iter()
        .min()
        .unwrap_or(1)
        .clamp(1, i64::from(READS_IN_FLIGHT)) as u8;
        let fd = readable(ch).map_err(|e| Error::io("registering the completion channel", e))?;
        let inflight: Table = Arc::default();
        let reaper = tokio::spawn(reap(cq, fd, inflight.clone(), peer.to_owned()));
        Ok(SwVerbs {
            qp: Mutex::new(qp),
            inflight,
            pd: dev.pd.clone(),
            next: AtomicU64::new(1),
            reaper,
            name: dev.name.clone(),
            reads,
            _setup: None,
        })
    }

    /// Keeps `what` (the set-up's rdma_cm identifier) for as long as the queue pair.
    pub(super) fn keep(&mut self, what: Box<dyn std::any::Any + Send + Sync>) {
        self._setup = Some(what);
    }

    /// Outstanding RDMA reads each way, within the device's limits.
    pub(super) fn reads(&self) -> u8 {
        self.reads
    }

    /// The queue pair's number.
    pub(super) fn qp_number(&self) -> u32 {
        lock(&self.qp).qp_number()
    }

    /// Moves the queue pair with `attr`; `what` names the step in an error.
    pub(super) fn modify(&self, attr: &QueuePairAttribute, what: &str) -> Result<()> {
        lock(&self.qp)
            .modify(attr)
            .map_err(|e| Error::new(ErrorKind::Io, format!("{what} on {}: {e:#}", self.name)))
    }

    /// Moves the queue pair to INIT for the TCP set-up exchange; our endpoint for the peer.
    fn init_for_exchange(&self, dev: &Device) -> Result<Endpoint> {
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            Error::new(ErrorKind::Io, format!("{what} on {}: {e:#}", dev.name))
        };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(dev.port)
            .setup_access_flags(remote_access());
        self.modify(&attr, "moving the queue pair to INIT")?;
        let port = dev
            .ctx
            .query_port(dev.port)
            .map_err(|e| failed(&format!("querying port {}", dev.port), &e))?;
        let gid = dev
            .ctx
            .query_gid(dev.port, dev.gid_index)
            .map_err(|e| failed(&format!("reading GID index {}", dev.gid_index), &e))?;
        Ok(Endpoint {
            qpn: self.qp_number(),
            lid: port.lid(),
            gid: gid.raw,
        })
    }

    /// Moves the queue pair to ready-to-receive and ready-to-send with the peer's `ep`.
    fn connect(&self, ep: &Endpoint, dev: &Device) -> Result<()> {
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            Error::new(ErrorKind::Io, format!("{what} on {}: {e:#}", dev.name))
        };
        let gid = Gid { raw: ep.gid };
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(ep.lid)
            .setup_port(dev.port)
            .setup_service_level(0)
            .setup_grh_src_gid_index(dev.gid_index as u8)
            .setup_grh_dest_gid(&gid)
            .setup_grh_hop_limit(64);
        let mut qp = lock(&self.qp);
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(Mtu::Mtu1024)
            .setup_dest_qp_num(ep.qpn)
            .setup_rq_psn(0)
            .setup_max_dest_read_atomic(self.reads)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        qp.modify(&rtr)
            .map_err(|e| failed("moving the queue pair to RTR", &e))?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(0)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(self.reads);
        qp.modify(&rts)
            .map_err(|e| failed("moving the queue pair to RTS", &e))?;
        Ok(())
    }

    /// Posts `op` on `buf` (`len` bytes; `remote` for reads and writes); the answer comes
    /// through the returned receiver.
    fn post(
        &self,
        op: VerbOp,
        buf: SwMr,
        len: usize,
        remote: Option<RemoteRegion>,
    ) -> oneshot::Receiver<Answer> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (lkey, addr) = (buf.mr.lkey(), buf.addr);
        let len = len.min(buf.len()) as u32;
        let (tx, rx) = oneshot::channel();
        lock(&self.inflight).insert(id, Inflight { buf, op, tx });
        let posted = {
            let mut qp = lock(&self.qp);
            match op {
                VerbOp::Recv => {
                    let mut g = qp.start_post_recv();
                    // SAFETY: `addr..addr + len` lies in the buffer registered under `lkey`,
                    // which the in-flight table owns until this work request completes.
                    unsafe { g.construct_wr(id).setup_sge(lkey, addr, len) };
                    g.post().map_err(|e| e.to_string())
                }
                _ => {
                    let mut g = qp.start_post_send();
                    let wr = g.construct_wr(id, WorkRequestFlags::Signaled);
                    let wr = match (op, remote) {
                        (VerbOp::Read, Some(r)) => wr.setup_read(r.rkey, r.addr),
                        (VerbOp::Write, Some(r)) => wr.setup_write(r.rkey, r.addr),
                        _ => wr.setup_send(),
                    };
                    // SAFETY: as for receives: the table owns the buffer until completion.
                    unsafe { wr.setup_sge(lkey, addr, len) };
                    g.post().map_err(|e| e.to_string())
                }
            }
        };
        if let Err(e) = posted
            && let Some(w) = lock(&self.inflight).remove(&id)
        {
            // Never posted: the buffer is ours again, and dropped with the error.
            let _ =
                w.tx.send(Err(verbs_failed(op, format!("posting failed: {e:#}"))));
        }
        rx
    }

    fn completion(op: VerbOp, rx: oneshot::Receiver<Answer>) -> Completion<(SwMr, usize)> {
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(VerbsError::new(op, WcStatus::Flushed)
                    .with_detail("the connection's completion queue is gone"))
            })
        })
    }
}

/// Drains the completion queue: answers every completed operation. `Err` when the queue
/// cannot be polled any more.
fn drain(cq: &BasicCompletionQueue, table: &Table) -> std::result::Result<(), String> {
    loop {
        match cq.start_poll() {
            Ok(poller) => {
                let mut t = lock(table);
                for wc in poller {
                    let Some(w) = t.remove(&wc.wr_id()) else {
                        continue;
                    };
                    let answer = if wc.status() == 0 {
                        Ok((w.buf, wc.byte_len() as usize))
                    } else {
                        // The NIC is done with the buffer (the request completed, in error):
                        // it is dropped here.
                        Err(
                            VerbsError::new(w.op, wc_status(wc.status())).with_detail(format!(
                                "work completion status {}, vendor error {:#x}",
                                wc.status(),
                                wc.vendor_err()
                            )),
                        )
                    };
                    let _ = w.tx.send(answer);
                }
            }
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The connection's reaper: arm the completion queue, wait on the channel, drain.
async fn reap(
    cq: Arc<BasicCompletionQueue>,
    fd: AsyncFd<ChannelFd<CompletionChannel>>,
    table: Table,
    peer: String,
) {
    let ch = &fd.get_ref().0;
    let fatal = loop {
        if let Err(e) = drain(&cq, &table) {
            break e;
        }
        // SAFETY: the completion queue is alive (`cq` holds it) for the call.
        if unsafe { rdma_mummy_sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0) } != 0 {
            break "arming the completion queue failed".to_owned();
        }
        // What completed before the arm raised no event: take it now.
        if let Err(e) = drain(&cq, &table) {
            break e;
        }
        let mut guard = match fd.readable().await {
            Ok(g) => g,
            Err(e) => break format!("waiting on the completion channel: {e:#}"),
        };
        let mut events = 0u32;
        loop {
            let mut ev_cq = std::ptr::null_mut();
            let mut ev_ctx = std::ptr::null_mut();
            // SAFETY: the channel is alive (`ch`) and non-blocking: this returns -1 at once
            // when no event is queued.
            let got = unsafe {
                rdma_mummy_sys::ibv_get_cq_event(
                    ch.comp_channel().as_ptr(),
                    &mut ev_cq,
                    &mut ev_ctx,
                )
            };
            if got != 0 {
                break;
            }
            events += 1;
        }
        if events > 0 {
            // SAFETY: acknowledges the events just taken for this (live) completion queue.
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq.cq().as_ptr(), events) };
        }
        guard.clear_ready();
    };
    tracing::warn!(peer = %peer, "rdma completion queue failed: {fatal}");
    // Nothing will complete any more. The buffers of what is still posted are leaked rather
    // than freed under a queue pair that might still write them.
    for (_, w) in lock(&table).drain() {
        let op = w.op;
        std::mem::forget(w.buf);
        let _ = w.tx.send(Err(verbs_failed(op, &fatal)));
    }
}

impl Verbs for SwVerbs {
    type Mr = SwMr;
    type Exposed = SwExposed;

    fn register(&self, len: usize, access: Access) -> std::result::Result<SwMr, VerbsError> {
        let mut flags = AccessFlags::LocalWrite;
        if access.remote_read {
            flags |= AccessFlags::RemoteRead;
        }
        if access.remote_write {
            flags |= AccessFlags::RemoteWrite;
        }
        let mut mem = vec![0u8; len.max(1)].into_boxed_slice();
        // SAFETY: `mem` is `mem.len()` bytes we own; it lives in the returned `SwMr`, whose
        // field order drops the registration before the memory.
        let mr = unsafe { self.pd.reg_mr(mem.as_mut_ptr() as usize, mem.len(), flags) }.map_err(
            |e| {
                VerbsError::new(VerbOp::Register, WcStatus::NoMemory).with_detail(format!(
                    "{e:#} (is the locked-memory limit, `ulimit -l`, large enough?)"
                ))
            },
        )?;
        Ok(SwMr {
            mr,
            addr: mem.as_ptr() as u64,
            len: mem.len(),
            mem: Some(mem),
            #[cfg(feature = "cuda")]
            _device: None,
        })
    }

    fn expose(&self, src: Source) -> std::result::Result<(SwExposed, RemoteRegion), VerbsError> {
        let refused = |e: &dyn std::fmt::Display, hint: &str| {
            VerbsError::new(VerbOp::Register, WcStatus::NoMemory)
                .with_detail(format!("{e:#} ({hint})"))
        };
        if src.is_empty() {
            return Err(VerbsError::new(VerbOp::Register, WcStatus::Other)
                .with_detail("an empty body is not lent"));
        }
        let (mr, addr, len) = match &src {
            Source::Host(b) => {
                let (addr, len) = (b.as_ptr() as u64, b.len());
                // SAFETY: `addr..addr + len` are the bytes of `src`, immutable and kept alive
                // by the returned `SwExposed`, whose field order drops the registration
                // first. Remote read is the only access granted: neither we nor the peer
                // write them through it.
                let mr = unsafe { self.pd.reg_mr(addr as usize, len, AccessFlags::RemoteRead) }
                    .map_err(|e| {
                        refused(&e, "is the locked-memory limit, `ulimit -l`, large enough?")
                    })?;
                (mr, addr, len)
            }
            #[cfg(feature = "cuda")]
            Source::DmaBuf(buf) => {
                // SAFETY: `src` keeps the dma-buf's memory alive and its descriptor open
                // until the returned `SwExposed` drops, registration first.
                let mr = unsafe { self.reg_dmabuf(buf, AccessFlags::RemoteRead) }?;
                (mr, buf.offset, buf.len)
            }
        };
        let region = RemoteRegion {
            addr,
            len: len as u64,
            rkey: mr.rkey(),
        };
        Ok((SwExposed { _mr: mr, _mem: src }, region))
    }

    #[cfg(feature = "cuda")]
    fn register_dmabuf(&self, buf: DmaBuf) -> std::result::Result<SwMr, VerbsError> {
        // SAFETY: `buf` keeps the dma-buf's memory alive and its descriptor open until the
        // returned `SwMr` drops, registration first; reads into it are posted only by the
        // driver, which owns the buffer while they run.
        let mr = unsafe { self.reg_dmabuf(&buf, AccessFlags::LocalWrite) }?;
        Ok(SwMr {
            mr,
            mem: None,
            addr: buf.offset,
            len: buf.len,
            _device: Some(buf),
        })
    }

    fn post_recv(&self, buf: SwMr) -> Completion<(SwMr, usize)> {
        let len = buf.len();
        SwVerbs::completion(VerbOp::Recv, self.post(VerbOp::Recv, buf, len, None))
    }

    fn post_send(&self, buf: SwMr, len: usize) -> Completion<SwMr> {
        let done = SwVerbs::completion(VerbOp::Send, self.post(VerbOp::Send, buf, len, None));
        Box::pin(async move { done.await.map(|(b, _)| b) })
    }

    fn post_read(&self, buf: SwMr, remote: RemoteRegion) -> Completion<SwMr> {
        let len = remote.len as usize;
        let rx = self.post(VerbOp::Read, buf, len, Some(remote));
        let done = SwVerbs::completion(VerbOp::Read, rx);
        Box::pin(async move { done.await.map(|(b, _)| b) })
    }

    fn post_write(&self, buf: SwMr, remote: RemoteRegion) -> Completion<SwMr> {
        let len = remote.len as usize;
        let rx = self.post(VerbOp::Write, buf, len, Some(remote));
        let done = SwVerbs::completion(VerbOp::Write, rx);
        Box::pin(async move { done.await.map(|(b, _)| b) })
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

// ---------------------------------------------------------------------------------------
// Set-up
// ---------------------------------------------------------------------------------------

/// Opens the device, creates a queue pair and connects it with the peer's over `tcp`.
async fn handshake(
    tcp: &mut tokio::net::TcpStream,
    cfg: &super::RdmaConfig,
    t: Duration,
    peer: &str,
) -> Result<SwVerbs> {
    let dev = open(&Placement::from_env()?)?;
    let verbs = SwVerbs::new(&dev, cfg.recv_slots + 16, peer)?;
    let ours = verbs.init_for_exchange(&dev)?;
    let theirs = setup::exchange(tcp, ours, t).await?;
    verbs.connect(&theirs, &dev)?;
    Ok(verbs)
}

/// [`handshake`], as the shared set-up takes it.
fn boxed_handshake<'a>(
    tcp: &'a mut tokio::net::TcpStream,
    cfg: &'a super::RdmaConfig,
    t: Duration,
    peer: &'a str,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<SwVerbs>> + Send + 'a>> {
    Box::pin(handshake(tcp, cfg, t, peer))
}

/// `rdma://host:port`: through rdma_cm where it is there and the peer takes it (see
/// [`cm`](super::cm)), through the TCP set-up exchange otherwise.
pub(crate) async fn connect(host: &str, port: u16, cfg: &Config) -> Result<Parts> {
    devices()?;
    let url = format!("rdma://{host}:{port}");
    if super::cm::wanted()? {
        match super::cm::Events::new() {
            Ok(events) => {
                let rcfg = super::config(cfg);
                rcfg.validate()?;
                let to = tokio::net::lookup_host((host, port))
                    .await
                    .map_err(|e| Error::io(format!("resolving {url}"), e))?
                    .next()
                    .ok_or_else(|| {
                        Error::new(ErrorKind::Config, format!("{url}: no address for {host}"))
                    })?;
                match super::cm::connect(events, to, &rcfg, cfg.handshake_timeout, &url).await {
                    Ok(verbs) => {
                        let setup = crate::transport::ChannelSetup::new(cfg, false);
                        return super::establish(Arc::new(verbs), rcfg, setup, url.clone(), url)
                            .await;
                    }
                    Err(f) if f.before_accept => tracing::info!(
                        %url, "rdma_cm set-up failed ({:#}); trying the TCP set-up exchange",
                        f.error
                    ),
                    Err(f) => return Err(f.error),
                }
            }
            Err(e) => {
                tracing::info!(%url, "{e:#}; using the TCP set-up exchange")
            }
        }
    }
    setup::connect(host, port, cfg, devices, boxed_handshake).await
}

/// An `rdma://host:port` listener: the TCP set-up exchange at `host:port`, and rdma_cm at the
/// same address where it is there.
pub(crate) async fn bind(
    host: &str,
    port: u16,
    cfg: &Config,
) -> Result<(Box<dyn AcceptHalf>, String)> {
    let (tcp, url) = setup::bind(host, port, cfg, devices, boxed_handshake).await?;
    if !super::cm::wanted()? {
        return Ok((tcp, url));
    }
    let at: std::net::SocketAddr = url
        .strip_prefix("rdma://")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| Error::new(ErrorKind::Io, format!("rdma listener address {url:?}")))?;
    match super::cm::listen(at, cfg) {
        Ok(cm) => Ok((Box::new(super::cm::Both { cm, tcp }), url)),
        Err(e) => {
            tracing::info!(%url, "{e:#}; accepting the TCP set-up exchange only");
            Ok((tcp, url))
        }
    }
}
