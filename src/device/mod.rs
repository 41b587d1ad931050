//! Bodies in GPU memory (feature `cuda`): send from device memory, receive into it.
//!
//! A [`Gpu`] is a device and the stream its copies run on; a [`DeviceBody`] is device memory
//! that a [`Message`](crate::Message) carries as its body (`Message::with_body(device_body)`).
//! What happens to it depends on the channel ([`ChannelInfo::device_path`](crate::ChannelInfo::device_path)):
//!
//! | transport | path | what moves |
//! |---|---|---|
//! | `inproc://` | `"in-process"` | the `DeviceBody` itself: the receiver gets the same memory |
//! | `shm://`, to a receiver that lands bodies on a device | `"cuda-ipc"` | a handle: the receiver maps the sender's memory (`cuIpcOpenMemHandle`), which stays allocated until the receiver drops the body |
//! | `rdma://` (feature `rdma`) | `"gpudirect"` | the peer's NIC reads the body from device memory, registered as a dma-buf (`ibv_reg_dmabuf_mr`) for exactly its bytes until the peer's `FIN`; a receiver that lands on a device has a body of 1 MiB or more read straight into device memory of its own (also a dma-buf; smaller ones into host memory, copied to the device when taken: device memory comes in 2 MiB blocks), one that does not into host memory |
//! | `tcp://`, `tls://`, sessions; `shm://` and `rdma://` otherwise | `"staged"` | the body is copied to pinned host buffers in chunks, each chunk sent while the next is copied |
//!
//! A staged body is announced by a frame with [`Flags::DEVICE`](crate::Flags::DEVICE) and sent
//! in chunks of [`Staging::chunk`] bytes from a pool of [`Staging::buffers`] pinned buffers
//! per `Gpu` (a bounded pool: a sender waits for a buffer the transport has finished with).
//! The receiving channel puts the chunks back together: into device memory when its
//! [`Receiver::land_on`](crate::Receiver::land_on) (or [`ContextBuilder::land_on`](crate::ContextBuilder::land_on))
//! names a `Gpu`, into one host buffer otherwise, so a handler gets a device body back
//! without staging by hand.
//!
//! On `shm://`, a body is lent over CUDA IPC when the receiving end lands bodies on a device
//! of the same kind; the sender keeps a reference to it (at most 256 per direction) until
//! the receiver has dropped the body and closed its mapping, or its process is gone — after
//! the sender's channel is dropped too, for as long as the sender's tokio runtime runs (the
//! connection's watcher task holds them). It is
//! staged instead — and a log line says why, once per channel — when the receiver lands in
//! host memory, holds 256 lent bodies already, is the same process (CUDA does not open its
//! own handles there: use `inproc://`), or the memory cannot be exported (memory of a
//! stream-ordered pool, as cudarc's `alloc_zeros` may give: use [`Gpu::alloc`] /
//! [`Gpu::upload`], which allocate with `cuMemAlloc`). A receiver that switches to host
//! memory after a body was lent gets a copy. A handle is opened per body (UCX caches them;
//! not done yet).
//!
//! On `rdma://`, a body is staged instead — said once per channel in the log — when the
//! device does not export dma-bufs (CUDA before 11.7, or a GPU without the attribute), the
//! NIC's driver does not take them, the backend is async-rdma, or
//! [`ContextBuilder::rdma_gpudirect(false)`](crate::ContextBuilder::rdma_gpudirect). On the
//! receiving side, where device memory cannot be registered, the body is read into host
//! memory and copied to the device when the Receiver takes it (said once per channel); a
//! body read ahead into device memory goes to host memory if the Receiver has switched
//! there when it takes it.
//!
//! # Without a GPU
//! libcuda is loaded when first needed: a program built with the feature starts and runs on a
//! host without it, and [`Gpu::cuda`] returns [`ErrorKind::Unavailable`]
//! saying what is missing. [`Gpu::stand_in`] is host memory handled as a device — the same
//! chunking, pool and ordering, copies on a thread of its own — for testing device code on
//! hosts (and CI runners) without one.

mod cuda;
mod pool;
mod stand_in;

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::task::AtomicWaker;

use crate::error::{Error, ErrorKind, Result};
use crate::message::Location;

pub use cuda::cuda_device_count;

/// Stages `body` through the pipeline a channel uses (chunks copied to the `Gpu`'s pooled
/// host buffers, `DEPTH` copies in flight) and hands each chunk to `each`, in order: what the
/// `device` benchmark measures against a plain copy. Not a stable API.
#[doc(hidden)]
pub async fn stage_into(
    body: DeviceBody,
    each: impl FnMut(Bytes) + Send + Sync + 'static,
) -> Result<()> {
    crate::channel::device::drain(body, each).await
}
pub(crate) use pool::{Pool, Pooled};

/// How device bodies are staged through host memory on the transports that need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staging {
    /// Bytes per chunk: the unit of each device↔host copy and of each frame. Default 1 MiB.
    pub chunk: usize,
    /// Pinned buffers of `chunk` bytes per [`Gpu`], allocated when first needed and kept:
    /// the most staged bytes in flight. Default 8.
    pub buffers: usize,
}

impl Default for Staging {
    fn default() -> Staging {
        Staging {
            chunk: 1 << 20,
            buffers: 8,
        }
    }
}

/// A device, the stream its copies are ordered on, and its pool of staging buffers. Cheap
/// to clone (shared).
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<GpuInner>,
}

struct GpuInner {
    backend: Arc<dyn Backend>,
    pool: Arc<Pool>,
}

impl Gpu {
    /// The CUDA device `ordinal`, on a stream of its own.
    ///
    /// Fails with [`ErrorKind::Unavailable`] when libcuda cannot be loaded, the driver does
    /// not start, or there is no such device (the error says which; `hf doctor` checks the
    /// host).
    pub fn cuda(ordinal: usize) -> Result<Gpu> {
        Ok(Gpu::new(cuda::open(ordinal)?, Staging::default()))
    }

    /// Host memory standing in for a device: every device path (chunked staging through a
    /// bounded pool, landing, ordering) runs as it would on a GPU, with copies done by a
    /// thread of its own. Bodies report [`Location::StandIn`].
    pub fn stand_in() -> Gpu {
        Gpu::new(Arc::new(stand_in::StandIn::new()), Staging::default())
    }

    /// The same device with another staging configuration (and a pool of its own).
    ///
    /// Fails with [`ErrorKind::Config`] when `chunk` or `buffers` is 0.
    pub fn with_staging(&self, staging: Staging) -> Result<Gpu> {
        if staging.chunk == 0 || staging.buffers == 0 {
            return Err(Error::new(
                ErrorKind::Config,
                format!("staging needs a chunk and a buffer count above 0, got {staging:?}"),
            ));
        }
        Ok(Gpu::new(self.inner.backend.clone(), staging))
    }

    fn new(backend: Arc<dyn Backend>, staging: Staging) -> Gpu {
        Gpu {
            inner: Arc::new(GpuInner {
                backend,
                pool: Arc::new(Pool::new(staging)),
            }),
        }
    }

    /// The staging configuration.
    pub fn staging(&self) -> Staging {
        self.inner.pool.staging()
    }

    /// Where bodies of this device live.
    pub fn location(&self) -> Location {
        self.inner.backend.location()
    }

    /// Device memory of `len` bytes (zeroed).
    pub fn alloc(&self, len: usize) -> Result<DeviceBody> {
        Ok(DeviceBody {
            mem: self.inner.backend.alloc(len)?,
            gpu: self.clone(),
        })
    }

    /// Copies `bytes` into new device memory; returns when the copy is complete.
    pub fn upload(&self, bytes: &[u8]) -> Result<DeviceBody> {
        let body = self.alloc(bytes.len())?;
        self.inner.backend.copy_in(&*body.mem, 0, bytes)?;
        self.inner.backend.finish_copy_in(&*body.mem)?;
        Ok(body)
    }

    /// Blocks of device memory of this device alive in this process: allocated, wrapped or
    /// mapped from a peer (`shm://`'s CUDA IPC), and not yet freed or unmapped. A body sent
    /// over CUDA IPC stays allocated on the sending side until the receiver drops it.
    pub fn live_blocks(&self) -> usize {
        self.inner.backend.live()
    }

    /// Staging buffers this `Gpu` has allocated, and how many of them are in use now.
    pub fn staging_in_use(&self) -> (usize, usize) {
        self.inner.pool.counts()
    }

    /// A device body over CUDA memory that cudarc allocated on this device (on any of its
    /// streams: copies of the body are queued on that stream, after what wrote it there).
    /// Fails with [`ErrorKind::Mismatch`] for memory of another device or the stand-in.
    pub fn wrap_cuda(&self, slice: cudarc::driver::CudaSlice<u8>) -> Result<DeviceBody> {
        Ok(DeviceBody {
            mem: cuda::wrap(&*self.inner.backend, slice)?,
            gpu: self.clone(),
        })
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.inner.backend
    }

    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.inner.pool
    }
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.inner.backend.describe())
            .field("staging", &self.staging())
            .finish()
    }
}

/// Device memory carried as a message body. Cloning shares the memory.
#[derive(Clone)]
pub struct DeviceBody {
    mem: Arc<dyn Mem>,
    gpu: Gpu,
}

impl DeviceBody {
    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// True when the body is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory is.
    pub fn location(&self) -> Location {
        self.gpu.location()
    }

    /// The device it is on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Copies the body to host memory; returns when the copy is complete.
    pub fn to_host(&self) -> Result<Bytes> {
        let mut out = vec![0u8; self.len()];
        self.gpu.backend().copy_out_blocking(&self.mem, &mut out)?;
        Ok(Bytes::from(out))
    }

    /// Copies `src`, a body of the same length on the same device, into this one; returns
    /// when the copy is complete. Fails with [`ErrorKind::Mismatch`] for another device or
    /// another length.
    pub fn copy_from(&self, src: &DeviceBody) -> Result<()> {
        if !Arc::ptr_eq(&self.gpu.inner.backend, &src.gpu.inner.backend) || self.len() != src.len()
        {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!(
                    "cannot copy {src:?} of {:?} into {self:?} of {:?}",
                    src.gpu, self.gpu
                ),
            ));
        }
        if self.same_memory(src) || self.is_empty() {
            return Ok(());
        }
        self.gpu.backend().copy_device(&*src.mem, &*self.mem)
    }

    /// The cudarc slice, when the body is CUDA memory: to launch kernels on it.
    pub fn as_cuda(&self) -> Option<&cudarc::driver::CudaSlice<u8>> {
        cuda::slice_of(&*self.mem)
    }

    /// True when both are the same device memory.
    pub fn same_memory(&self, other: &DeviceBody) -> bool {
        Arc::ptr_eq(&self.mem, &other.mem)
    }

    pub(crate) fn mem(&self) -> &Arc<dyn Mem> {
        &self.mem
    }
}

impl fmt::Debug for DeviceBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBody({} bytes, {:?})", self.len(), self.location())
    }
}

/// What another process needs to map device memory of this one (CUDA IPC): which kind of
/// device, an opaque handle to the allocation, and where the body lies in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "shm"), allow(dead_code))] // only shm:// lends device memory
pub(crate) struct IpcHandle {
    /// [`IPC_STAND_IN`] or [`IPC_CUDA`].
    pub(crate) kind: u8,
    /// `cuIpcGetMemHandle`'s 64 bytes, or the stand-in's own.
    pub(crate) handle: [u8; 64],
    /// The body's offset in the allocation the handle maps.
    pub(crate) offset: u64,
    /// The body's length.
    pub(crate) len: u64,
}

/// Device memory as a dma-buf, for the NIC to reach it (GPUDirect RDMA): the file, where
/// the body lies in it, and its length.
#[cfg(feature = "rdma")]
#[derive(Debug)]
pub(crate) struct DmaBuf {
    pub(crate) fd: std::os::fd::OwnedFd,
    pub(crate) offset: u64,
    pub(crate) len: usize,
}

/// Held by memory mapped from another process, dropped after it is unmapped.
pub(crate) type Keep = Box<dyn Any + Send + Sync>;

/// A device body over memory process `peer` lent (`shm://`'s CUDA IPC), mapped on `gpu`;
/// `keep` is dropped once the mapping is closed.
#[cfg(feature = "shm")]
pub(crate) fn import(gpu: &Gpu, handle: &IpcHandle, peer: u32, keep: Keep) -> Result<DeviceBody> {
    Ok(DeviceBody {
        mem: gpu.backend().import(handle, peer, keep)?,
        gpu: gpu.clone(),
    })
}

/// [`IpcHandle::kind`] of the stand-in device.
#[cfg_attr(not(feature = "shm"), allow(dead_code))]
pub(crate) const IPC_STAND_IN: u8 = 1;
/// [`IpcHandle::kind`] of CUDA devices.
#[cfg_attr(not(feature = "shm"), allow(dead_code))]
pub(crate) const IPC_CUDA: u8 = 2;

/// Device memory of one backend.
pub(crate) trait Mem: Send + Sync + 'static {
    fn len(&self) -> usize;
    fn as_any(&self) -> &dyn Any;
}

/// Host memory a backend allocates for staging (pinned on CUDA). Its bytes are written by
/// the device's copy engine through [`as_ptr`](HostMem::as_ptr) and read after that copy is
/// complete.
pub(crate) trait HostMem: Send + Sync + 'static {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
}

/// What a device does for the channel: allocate, and copy in both directions.
pub(crate) trait Backend: Send + Sync + 'static {
    fn as_any(&self) -> &dyn Any;
    fn location(&self) -> Location;
    fn describe(&self) -> String;
    fn alloc(&self, len: usize) -> Result<Arc<dyn Mem>>;
    fn alloc_host(&self, len: usize) -> Result<Box<dyn HostMem>>;
    /// Starts copying `len` bytes at `offset` of `src` to `dst`, in stream order after the
    /// copies started before; `done` is completed (from any thread) when they are there.
    ///
    /// # Safety
    /// `dst` is valid for writes of `len` bytes, and neither read nor freed until `done` is
    /// complete.
    unsafe fn start_copy_out(
        &self,
        src: &Arc<dyn Mem>,
        offset: usize,
        dst: *mut u8,
        len: usize,
        done: Arc<Done>,
    ) -> Result<()>;
    /// Copies `src` to `dst` at `offset`; `src` may be reused on return (the copy to the
    /// device may still be in flight: [`finish_copy_in`](Backend::finish_copy_in) waits).
    fn copy_in(&self, dst: &dyn Mem, offset: usize, src: &[u8]) -> Result<()>;
    /// Waits until the copies into `dst` are complete.
    fn finish_copy_in(&self, dst: &dyn Mem) -> Result<()>;
    /// Copies all of `src` to `dst` (distinct memory of one length) and waits.
    fn copy_device(&self, src: &dyn Mem, dst: &dyn Mem) -> Result<()>;

    /// The [`IpcHandle::kind`] of the handles this device exports and opens; 0 when it
    /// does neither.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    fn ipc_kind(&self) -> u8 {
        0
    }

    /// A handle another process opens with [`import`](Backend::import) to map `mem`. The
    /// caller keeps `mem` alive until that process has closed it.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    fn export(&self, _mem: &Arc<dyn Mem>) -> Result<IpcHandle> {
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "{} does not share memory between processes",
                self.describe()
            ),
        ))
    }

    /// Maps memory process `peer` exported; unmapped when the returned memory drops, and
    /// `keep` dropped after that (whatever tells the exporter it may free the memory).
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    fn import(&self, _handle: &IpcHandle, _peer: u32, _keep: Keep) -> Result<Arc<dyn Mem>> {
        Err(Error::new(
            ErrorKind::Unavailable,
            format!("{} does not map memory of other processes", self.describe()),
        ))
    }

    /// `mem` as a dma-buf (for registration with an RDMA NIC); with `sync`, once the writes
    /// queued to it are done (memory the NIC reads; fresh memory it writes needs no wait).
    /// The caller keeps `mem` alive while the NIC may reach it.
    #[cfg(feature = "rdma")]
    fn dmabuf(&self, _mem: &Arc<dyn Mem>, _sync: bool) -> Result<DmaBuf> {
        Err(Error::new(
            ErrorKind::Unavailable,
            format!("{} does not export memory as a dma-buf", self.describe()),
        ))
    }

    /// A NIC finished writing `mem` (an RDMA read into it completed): makes those writes
    /// visible to work the device does next.
    #[cfg(feature = "rdma")]
    fn written_by_nic(&self, _mem: &Arc<dyn Mem>) -> Result<()> {
        Ok(())
    }

    /// Device memory of this device alive in this process: allocated, wrapped or mapped
    /// from a peer, and not yet freed or unmapped.
    fn live(&self) -> usize;

    /// Copies all of `src` to `out` and waits.
    fn copy_out_blocking(&self, src: &Arc<dyn Mem>, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let done = Arc::new(Done::default());
        // SAFETY: `out` is valid for its length and is neither read nor dropped before
        // `done` completes: `wait` below blocks until then.
        unsafe { self.start_copy_out(src, 0, out.as_mut_ptr(), out.len(), done.clone())? };
        done.wait()
    }
}

/// How many blocks of device memory a backend has alive; each block holds a [`LiveGuard`].
#[derive(Clone, Default)]
pub(crate) struct Live(Arc<AtomicUsize>);

impl Live {
    pub(crate) fn count(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    pub(crate) fn guard(&self) -> LiveGuard {
        self.0.fetch_add(1, Ordering::Relaxed);
        LiveGuard(self.0.clone())
    }
}

/// One live block, counted until it drops.
pub(crate) struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Checks that a copy of `len` bytes at `offset` lies within a body of `total`.
fn check_range(offset: usize, len: usize, total: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > total) {
        return Err(Error::new(
            ErrorKind::LimitExceeded,
            format!("a copy of {len} bytes at {offset} is outside a device body of {total}"),
        ));
    }
    Ok(())
}

/// The completion of a copy, signalled from the thread that finished it.
#[derive(Default)]
pub(crate) struct Done {
    flag: AtomicBool,
    waker: AtomicWaker,
    error: Mutex<Option<String>>,
    blocked: Mutex<bool>,
    cv: Condvar,
}

impl Done {
    pub(crate) fn complete(&self, error: Option<String>) {
        if error.is_some() {
            *self.error.lock().expect("not poisoned") = error;
        }
        self.flag.store(true, Ordering::Release);
        *self.blocked.lock().expect("not poisoned") = true;
        self.cv.notify_all();
        self.waker.wake();
    }

    fn is_done(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    fn result(&self) -> Result<()> {
        match self.error.lock().expect("not poisoned").take() {
            Some(e) => Err(Error::new(
                ErrorKind::Io,
                format!("device copy failed: {e}"),
            )),
            None => Ok(()),
        }
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.is_done() {
            self.waker.register(cx.waker());
            if !self.is_done() {
                return Poll::Pending;
            }
        }
        Poll::Ready(self.result())
    }

    pub(crate) fn wait(&self) -> Result<()> {
        let mut done = self.blocked.lock().expect("not poisoned");
        while !*done {
            done = self.cv.wait(done).expect("not poisoned");
        }
        drop(done);
        self.result()
    }
}

/// A copy to a staging buffer in flight: the buffer comes back when it is complete.
pub(crate) struct Ticket {
    buf: Option<Pooled>,
    done: Arc<Done>,
    /// The source stays allocated until the copy is complete.
    _src: Arc<dyn Mem>,
}

impl Ticket {
    /// Starts copying `len` bytes at `offset` of `body` into `buf`.
    pub(crate) fn start(
        body: &DeviceBody,
        offset: usize,
        mut buf: Pooled,
        len: usize,
    ) -> Result<Ticket> {
        buf.set_len(len);
        let done = Arc::new(Done::default());
        // SAFETY: `buf` holds at least `len` bytes (`set_len` checks) and is owned by the
        // ticket, which neither reads nor frees it before `done` completes: `poll` hands it
        // out only then, and `drop` waits for it.
        unsafe {
            body.gpu.backend().start_copy_out(
                body.mem(),
                offset,
                buf.as_mut_ptr(),
                len,
                done.clone(),
            )?
        };
        Ok(Ticket {
            buf: Some(buf),
            done,
            _src: body.mem().clone(),
        })
    }

    /// The filled buffer, once the copy is complete.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Pooled>> {
        match self.done.poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => Poll::Ready(r.map(|()| self.buf.take().expect("polled once"))),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.buf.is_some() && !self.done.is_done() {
            // The copy engine may still write into the buffer: wait before it is reused.
            let _ = self.done.wait();
        }
    }
}
