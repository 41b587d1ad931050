//! The CUDA device, on cudarc's driver API (libcuda loaded at run time).

use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError, result, sys};

use super::{Backend, Done, HostMem, Keep, Live, LiveGuard, Mem, check_range};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Location;

fn unavailable(what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("CUDA is not available: {what} (run `hf doctor` to check this host)"),
    )
}

fn failed(what: &str, e: DriverError) -> Error {
    Error::new(ErrorKind::Io, format!("CUDA: {what}: {e:?}"))
}

/// Loads libcuda and starts the driver, once. cudarc panics on its first call when libcuda
/// is missing, so nothing of it is called before this succeeded.
fn driver() -> Result<()> {
    static STARTED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            // SAFETY: only tries to load the library by its usual names (dlopen); nothing of
            // it is called.
            if !unsafe { sys::is_culib_present() } {
                return Err(
                    "libcuda.so could not be loaded (no NVIDIA driver on this host?)".into(),
                );
            }
            result::init().map_err(|e| format!("the CUDA driver did not start: {e:?}"))
        })
        .clone()
        .map_err(unavailable)
}

/// The number of CUDA devices, or [`ErrorKind::Unavailable`] saying why there are none to
/// use (no libcuda, a driver that does not start).
pub fn cuda_device_count() -> Result<usize> {
    driver()?;
    let n = result::device::get_count().map_err(|e| unavailable(format!("{e:?}")))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(super) fn open(ordinal: usize) -> Result<Arc<dyn Backend>> {
    let n = cuda_device_count()?;
    if ordinal >= n {
        return Err(unavailable(format!(
            "there is no CUDA device {ordinal} ({n} found)"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| failed("creating a context", e))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| failed("creating a stream", e))?;
    Ok(Arc::new(Cuda {
        ctx,
        stream,
        ordinal,
        live: Live::default(),
    }))
}

/// Allocations that may be lent over CUDA IPC are made in multiples of this.
const IPC_GRANULE: usize = 2 << 20;

/// Where `slice` lies (its device pointer) in the allocation it was carved from (base and
/// size), with its stream's context bound: what is exported (IPC handles, dma-bufs) is the
/// whole allocation.
#[cfg(any(feature = "shm", feature = "rdma"))]
fn allocation(slice: &CudaSlice<u8>) -> Result<(sys::CUdeviceptr, sys::CUdeviceptr, usize)> {
    let stream = slice.stream();
    bind(stream)?;
    let (ptr, _record) = slice.device_ptr(stream);
    let (mut base, mut size) = (0, 0);
    // SAFETY: out-pointers to locals; `ptr` is device memory of the bound context.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| failed("finding a body's allocation", e))?;
    Ok((ptr, base, size))
}

struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    live: Live,
}

struct CudaMem {
    /// `Some` until drop.
    slice: Option<CudaSlice<u8>>,
    /// How the memory goes when the body drops.
    owner: Owner,
    _live: LiveGuard,
    /// Dropped after the memory is released (`Drop` below runs first).
    _keep: Option<Keep>,
}

/// Who frees a body's memory.
enum Owner {
    /// cudarc (`CudaSlice`'s drop): memory the application allocated.
    Cudarc,
    /// We do, with `cuMemFree`: memory of `Gpu::alloc` (from `cuMemAlloc`, which CUDA IPC
    /// can export, unlike memory of the stream-ordered pools).
    Alloc,
    /// A mapping of another process's memory (`cuIpcOpenMemHandle` of this base address),
    /// closed with `cuIpcCloseMemHandle`.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    Mapped(sys::CUdeviceptr),
}

impl CudaMem {
    fn slice(&self) -> &CudaSlice<u8> {
        self.slice.as_ref().expect("present until drop")
    }
}

impl Mem for CudaMem {
    fn len(&self) -> usize {
        self.slice().len()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        let Some(slice) = self.slice.take() else {
            return;
        };
        if matches!(self.owner, Owner::Cudarc) {
            return drop(slice);
        }
        let stream = slice.stream().clone();
        // Waits for the copies cudarc tracked, and gives up its ownership of the pointer.
        let ptr = slice.leak();
        let _ = bind(&stream);
        // What was queued on the body's stream may still read it.
        let _ = stream.synchronize();
        let freed = match self.owner {
            // SAFETY: allocated by `cuMemAlloc` in `alloc`, freed once, nothing queued on it.
            Owner::Alloc => unsafe { result::free_sync(ptr) },
            // SAFETY: `base` was opened by `cuIpcOpenMemHandle` in `import` and is closed
            // once; nothing queued on it.
            Owner::Mapped(base) => unsafe { sys::cuIpcCloseMemHandle(base) }.result(),
            Owner::Cudarc => Ok(()),
        };
        if let Err(e) = freed {
            tracing::warn!(error = ?e, "CUDA: releasing device memory failed");
        }
    }
}

pub(super) fn slice_of(mem: &dyn Mem) -> Option<&CudaSlice<u8>> {
    mem.as_any().downcast_ref::<CudaMem>().map(CudaMem::slice)
}

pub(super) fn wrap(backend: &dyn Backend, slice: CudaSlice<u8>) -> Result<Arc<dyn Mem>> {
    let cuda = backend.as_any().downcast_ref::<Cuda>();
    match (backend.location(), cuda) {
        (Location::Cuda { ordinal }, Some(cuda))
            if ordinal as usize == slice.context().ordinal() =>
        {
            Ok(Arc::new(CudaMem {
                slice: Some(slice),
                owner: Owner::Cudarc,
                _live: cuda.live.guard(),
                _keep: None,
            }))
        }
        (other, _) => Err(Error::new(
            ErrorKind::Mismatch,
            format!(
                "memory of CUDA device {} cannot be a body of {other:?}",
                slice.context().ordinal()
            ),
        )),
    }
}

fn bind(stream: &CudaStream) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| failed("binding the context", e))
}

fn mine(mem: &dyn Mem) -> Result<&CudaMem> {
    mem.as_any().downcast_ref::<CudaMem>().ok_or_else(|| {
        Error::new(
            ErrorKind::Mismatch,
            "a device body of another device was given to a CUDA device",
        )
    })
}

/// Completes the `Done` given to `cuLaunchHostFunc`. It runs on a driver thread and calls
/// nothing of CUDA (which a host function must not).
unsafe extern "C" fn on_done(arg: *mut c_void) {
    // SAFETY: `arg` is the `Arc<Done>` leaked by `start_copy_out` for exactly this call.
    let done = unsafe { Arc::from_raw(arg.cast_const().cast::<Done>()) };
    done.complete(None);
}

impl Backend for Cuda {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn location(&self) -> Location {
        Location::Cuda {
            ordinal: self.ordinal as u32,
        }
    }

    fn describe(&self) -> String {
        format!("CUDA device {}", self.ordinal)
    }

    fn alloc(&self, len: usize) -> Result<Arc<dyn Mem>> {
        if len == 0 {
            let slice = self
                .stream
                .alloc_zeros::<u8>(0)
                .map_err(|e| failed("allocating an empty body", e))?;
            return Ok(Arc::new(CudaMem {
                slice: Some(slice),
                owner: Owner::Cudarc,
                _live: self.live.guard(),
                _keep: None,
            }));
        }
        bind(&self.stream)?;
        // `cuMemAlloc`, not the stream-ordered pool cudarc would use: CUDA IPC exports only
        // the former. Rounded up to 2 MiB: IPC shares the whole block a small allocation was
        // carved from (CUDA programming guide, "Interprocess Communication"), which would
        // show the peer other bodies of ours.
        let rounded = len.div_ceil(IPC_GRANULE).saturating_mul(IPC_GRANULE);
        // SAFETY: a plain allocation in the bound context, owned by the `CudaMem` below.
        let ptr = unsafe { result::malloc_sync(rounded) }
            .map_err(|e| failed(&format!("allocating {len} bytes"), e))?;
        // SAFETY: `ptr` is a live allocation of at least `len` bytes of this context; the
        // slice gives it back with `leak` in `CudaMem::drop`, which frees it.
        let slice = unsafe { self.stream.upgrade_device_ptr::<u8>(ptr, len) };
        let mut mem = CudaMem {
            slice: Some(slice),
            owner: Owner::Alloc,
            _live: self.live.guard(),
            _keep: None,
        };
        // Through cudarc, so that its event tracking orders the zeroing before work on the
        // slice on other streams.
        self.stream
            .memset_zeros(mem.slice.as_mut().expect("just made"))
            .map_err(|e| failed("zeroing new device memory", e))?;
        Ok(Arc::new(mem))
    }

    fn live(&self) -> usize {
        self.live.count()
    }

    #[cfg(feature = "shm")]
    fn ipc_kind(&self) -> u8 {
        super::IPC_CUDA
    }

    #[cfg(feature = "shm")]
    fn export(&self, mem: &Arc<dyn Mem>) -> Result<super::IpcHandle> {
        let m = mine(&**mem)?;
        let slice = m.slice();
        let stream = slice.stream();
        // The handle names the whole allocation: where the body lies in it.
        let (ptr, base, _size) = allocation(slice)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is the start of an allocation of this context; the handle is an
        // out-pointer to a local. Memory of a stream-ordered pool is refused here (an
        // error: the body is staged instead).
        unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
            .result()
            .map_err(|e| failed("exporting device memory (cuIpcGetMemHandle)", e))?;
        // Queued writes to the body are done before the peer reads it.
        stream
            .synchronize()
            .map_err(|e| failed("waiting for writes to a body", e))?;
        Ok(super::IpcHandle {
            kind: super::IPC_CUDA,
            handle: handle.reserved.map(|c| c as u8),
            offset: ptr - base,
            len: slice.len() as u64,
        })
    }

    /// `cuMemGetHandleForAddressRange` over the body's whole allocation (the range must be
    /// page-aligned: allocations are whole 2 MiB blocks, see `alloc`). Drivers without
    /// dma-buf export (before 11.7, or the GPU's `DMA_BUF_SUPPORTED` attribute 0) are
    /// `Unavailable`, checked before the call, and the body is staged.
    #[cfg(feature = "rdma")]
    fn dmabuf(&self, mem: &Arc<dyn Mem>, sync: bool) -> Result<super::DmaBuf> {
        use std::os::fd::FromRawFd;
        // cudarc resolves a symbol when first called and panics when the driver lacks it:
        // check the driver's version (dma-buf export is 11.7's) and the device first.
        let mut version = 0;
        // SAFETY: an out-pointer to a local; `cuDriverGetVersion` is in every driver.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| failed("reading the driver's version", e))?;
        if version < 11070 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "the CUDA driver (API {}.{}) exports no dma-bufs: 11.7 or later is needed",
                    version / 1000,
                    version % 1000 / 10
                ),
            ));
        }
        let supported = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            .map_err(|e| failed("asking the device about dma-bufs", e))?;
        if supported == 0 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "this GPU (or its driver) does not export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)",
            ));
        }
        let m = mine(&**mem)?;
        let slice = m.slice();
        let stream = slice.stream();
        let (ptr, base, size) = allocation(slice)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the handle is an out-pointer to a local `int` (what the dma-buf handle type
        // writes); `base..base + size` is one allocation of the bound context.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&raw mut fd).cast(),
                base,
                size,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(|e| failed("exporting device memory as a dma-buf", e))?;
        if fd < 0 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "CUDA returned no dma-buf descriptor",
            ));
        }
        // SAFETY: a descriptor the driver just opened for us, owned from here on.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        if sync {
            // Queued writes to the body are done before the NIC reads it.
            stream
                .synchronize()
                .map_err(|e| failed("waiting for writes to a body", e))?;
        }
        Ok(super::DmaBuf {
            fd,
            offset: ptr - base,
            len: slice.len(),
        })
    }

    /// `cuFlushGPUDirectRDMAWrites` (CUDA 11.3+; `dmabuf` checked 11.7 for this memory):
    /// where the GPU does not order a NIC's writes before later work, this does.
    #[cfg(feature = "rdma")]
    fn written_by_nic(&self, mem: &Arc<dyn Mem>) -> Result<()> {
        let m = mine(&**mem)?;
        bind(m.slice().stream())?;
        // SAFETY: plain enums; the context of the memory is bound to this thread.
        unsafe {
            sys::cuFlushGPUDirectRDMAWrites(
                sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
        }
        .result()
        .map_err(|e| failed("making a NIC's writes visible to the device", e))
    }

    #[cfg(feature = "shm")]
    fn import(&self, h: &super::IpcHandle, _peer: u32, keep: Keep) -> Result<Arc<dyn Mem>> {
        if h.kind != super::IPC_CUDA || h.len == 0 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "not a CUDA IPC handle of a body: kind {}, {} bytes",
                    h.kind, h.len
                ),
            ));
        }
        bind(&self.stream)?;
        let handle = sys::CUipcMemHandle {
            reserved: h.handle.map(|b| b as std::ffi::c_char),
        };
        let mut base = 0;
        // SAFETY: an out-pointer to a local; the driver checks the handle.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| failed("mapping a peer's device memory (cuIpcOpenMemHandle)", e))?;
        // Close it again if the body does not fit the allocation.
        let mut size = 0;
        let mut start = 0;
        // SAFETY: out-pointers to locals; `base` is mapped in the bound context.
        let range = unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) }.result();
        // The body, from the mapped base, within the block the driver reports around it.
        let fits = range.is_ok()
            && base
                .checked_add(h.offset)
                .and_then(|at| at.checked_add(h.len))
                .zip(start.checked_add(size as u64))
                .is_some_and(|(end, block_end)| base >= start && end <= block_end);
        if !fits {
            // SAFETY: opened above, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(base) };
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "a CUDA IPC handle for {} bytes at {} of an allocation of {size}",
                    h.len, h.offset
                ),
            ));
        }
        let len = h.len as usize; // within an allocation
        // SAFETY: `base + offset` is mapped for `len` bytes (checked); `CudaMem::drop` takes
        // it back with `leak` and closes the mapping, never frees it.
        let slice = unsafe { self.stream.upgrade_device_ptr::<u8>(base + h.offset, len) };
        Ok(Arc::new(CudaMem {
            slice: Some(slice),
            owner: Owner::Mapped(base),
            _live: self.live.guard(),
            _keep: Some(keep),
        }))
    }

    fn alloc_host(&self, len: usize) -> Result<Box<dyn HostMem>> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| failed("binding the context", e))?;
        // SAFETY: a plain pinned allocation in the bound context; freed by `Pinned::drop`.
        let ptr = unsafe { result::malloc_host(len, 0) }
            .map_err(|e| failed(&format!("pinning {len} bytes of host memory"), e))?;
        Ok(Box::new(Pinned {
            ptr: ptr.cast::<u8>(),
            len,
            ctx: self.ctx.clone(),
        }))
    }

    unsafe fn start_copy_out(
        &self,
        src: &Arc<dyn Mem>,
        offset: usize,
        dst: *mut u8,
        len: usize,
        done: Arc<Done>,
    ) -> Result<()> {
        let m = mine(&**src)?;
        check_range(offset, len, m.slice().len())?;
        // The copy goes on the body's own stream: after whatever wrote it there. The raw
        // calls below need its context current on this thread.
        let stream = m.slice().stream();
        bind(stream)?;
        let (ptr, _record) = m.slice().device_ptr(stream);
        // SAFETY: the caller keeps `dst` valid for `len` bytes and untouched until `done`
        // completes, which the host function queued after the copy does; the range of the
        // source was checked and `src` is kept alive by the caller's ticket.
        unsafe {
            result::memcpy_dtoh_async(
                std::slice::from_raw_parts_mut(dst, len),
                ptr + offset as u64,
                stream.cu_stream(),
            )
        }
        .map_err(|e| failed("copying to the host", e))?;
        let arg = Arc::into_raw(done).cast_mut().cast::<c_void>();
        // SAFETY: the stream is live (the body holds it); `on_done` takes back the `Arc`
        // leaked into `arg`, once.
        let queued =
            unsafe { result::stream::launch_host_function(stream.cu_stream(), on_done, arg) };
        if let Err(e) = queued {
            // SAFETY: not queued, so `on_done` will not run: take the `Arc` back here.
            drop(unsafe { Arc::from_raw(arg.cast_const().cast::<Done>()) });
            // The copy is queued; wait for it so that the caller may free `dst`.
            let _ = stream.synchronize();
            return Err(failed("queueing the completion", e));
        }
        Ok(())
    }

    fn copy_in(&self, dst: &dyn Mem, offset: usize, src: &[u8]) -> Result<()> {
        let m = mine(dst)?;
        check_range(offset, src.len(), m.slice().len())?;
        let stream = m.slice().stream();
        bind(stream)?;
        let (ptr, _record) = m.slice().device_ptr(stream);
        // SAFETY: the range was checked; from pageable memory the driver has taken `src`
        // when the call returns, and `finish_copy_in` waits for the copy to land.
        unsafe { result::memcpy_htod_async(ptr + offset as u64, src, stream.cu_stream()) }
            .map_err(|e| failed("copying to the device", e))
    }

    fn copy_device(&self, src: &dyn Mem, dst: &dyn Mem) -> Result<()> {
        let (src, dst) = (mine(src)?, mine(dst)?);
        check_range(0, src.slice().len(), dst.slice().len())?;
        // What wrote `src` on its own stream first, then the copy on `dst`'s.
        src.slice()
            .stream()
            .synchronize()
            .map_err(|e| failed("waiting for writes to a body", e))?;
        let stream = dst.slice().stream();
        bind(stream)?;
        let (from, _r) = src.slice().device_ptr(stream);
        let (to, _w) = dst.slice().device_ptr(stream);
        // SAFETY: both ranges are live device memory of `len` bytes (checked), distinct
        // (the caller checked); the synchronize below waits for the copy.
        unsafe { result::memcpy_dtod_async(to, from, src.slice().len(), stream.cu_stream()) }
            .map_err(|e| failed("copying on the device", e))?;
        stream
            .synchronize()
            .map_err(|e| failed("waiting for a copy on the device", e))
    }

    fn finish_copy_in(&self, dst: &dyn Mem) -> Result<()> {
        mine(dst)?
            .slice()
            .stream()
            .synchronize()
            .map_err(|e| failed("waiting for copies to the device", e))
    }
}

/// Page-locked host memory from `cuMemHostAlloc`.
struct Pinned {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: `Pinned` owns its allocation; it is written only by the copy engine under
// `start_copy_out`'s contract and read after that copy completed.
unsafe impl Send for Pinned {}
// SAFETY: as above: shared references only read, after the write completed.
unsafe impl Sync for Pinned {}

impl HostMem for Pinned {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `cuMemHostAlloc` in this context, freed once; no copy uses it
        // (tickets wait for theirs before the buffer returns to the pool).
        if let Err(e) = unsafe { result::free_host(self.ptr.cast::<c_void>()) } {
            tracing::warn!(error = ?e, "CUDA: freeing pinned host memory failed");
        }
    }
}
