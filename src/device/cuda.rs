//! The CUDA device, on cudarc's driver API (libcuda loaded at run time).

use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError, result, sys};

use super::{Backend, Done, HostMem, Mem, check_range};
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
    }))
}

struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
}

struct CudaMem {
    slice: CudaSlice<u8>,
}

impl Mem for CudaMem {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

pub(super) fn slice_of(mem: &dyn Mem) -> Option<&CudaSlice<u8>> {
    mem.as_any().downcast_ref::<CudaMem>().map(|m| &m.slice)
}

pub(super) fn wrap(backend: &dyn Backend, slice: CudaSlice<u8>) -> Result<Arc<dyn Mem>> {
    match backend.location() {
        Location::Cuda { ordinal } if ordinal as usize == slice.context().ordinal() => {
            Ok(Arc::new(CudaMem { slice }))
        }
        other => Err(Error::new(
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
    fn location(&self) -> Location {
        Location::Cuda {
            ordinal: self.ordinal as u32,
        }
    }

    fn describe(&self) -> String {
        format!("CUDA device {}", self.ordinal)
    }

    fn alloc(&self, len: usize) -> Result<Arc<dyn Mem>> {
        let slice = self
            .stream
            .alloc_zeros::<u8>(len)
            .map_err(|e| failed(&format!("allocating {len} bytes"), e))?;
        Ok(Arc::new(CudaMem { slice }))
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
        check_range(offset, len, m.slice.len())?;
        // The copy goes on the body's own stream: after whatever wrote it there. The raw
        // calls below need its context current on this thread.
        let stream = m.slice.stream();
        bind(stream)?;
        let (ptr, _record) = m.slice.device_ptr(stream);
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
        check_range(offset, src.len(), m.slice.len())?;
        let stream = m.slice.stream();
        bind(stream)?;
        let (ptr, _record) = m.slice.device_ptr(stream);
        // SAFETY: the range was checked; from pageable memory the driver has taken `src`
        // when the call returns, and `finish_copy_in` waits for the copy to land.
        unsafe { result::memcpy_htod_async(ptr + offset as u64, src, stream.cu_stream()) }
            .map_err(|e| failed("copying to the device", e))
    }

    fn finish_copy_in(&self, dst: &dyn Mem) -> Result<()> {
        mine(dst)?
            .slice
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
