//! Host memory handled as a device, with a copy engine of its own (a thread), so the device
//! paths run — and are tested — without a GPU.

use std::any::Any;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use super::{Backend, Done, HostMem, Mem, check_range};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Location;

pub(super) struct StandIn {
    engine: OnceLock<mpsc::Sender<Job>>,
}

struct Memory {
    bytes: Mutex<Box<[u8]>>,
}

impl Mem for Memory {
    fn len(&self) -> usize {
        self.bytes.lock().expect("not poisoned").len()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A copy queued on the engine, in stream order.
struct Job {
    src: Arc<dyn Mem>,
    offset: usize,
    dst: Dst,
    len: usize,
    done: Arc<Done>,
}

struct Dst(*mut u8);
// SAFETY: the pointer is written only by the engine thread, and the caller of
// `start_copy_out` keeps the memory valid and untouched until `done` completes.
unsafe impl Send for Dst {}

impl StandIn {
    pub(super) fn new() -> StandIn {
        StandIn {
            engine: OnceLock::new(),
        }
    }

    /// The copy engine's queue, started when first needed.
    fn engine(&self) -> &mpsc::Sender<Job> {
        self.engine.get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name("hf-standin-copy".into())
                .spawn(move || {
                    for job in rx {
                        let src = job
                            .src
                            .as_any()
                            .downcast_ref::<Memory>()
                            .expect("own memory");
                        let bytes = src.bytes.lock().expect("not poisoned");
                        // SAFETY: `start_copy_out`'s contract: `dst` is valid for `len` bytes
                        // and untouched until `done` completes; the range of `src` was checked
                        // when the job was queued.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes[job.offset..job.offset + job.len].as_ptr(),
                                job.dst.0,
                                job.len,
                            )
                        };
                        drop(bytes);
                        job.done.complete(None);
                    }
                });
            if let Err(e) = spawned {
                // The queue's receiver went with the closure: every copy fails with an error.
                tracing::warn!(error = %e, "the stand-in device's copy thread did not start");
            }
            tx
        })
    }
}

fn mine(mem: &dyn Mem) -> Result<&Memory> {
    mem.as_any().downcast_ref::<Memory>().ok_or_else(|| {
        Error::new(
            ErrorKind::Mismatch,
            "a device body of another device was given to the stand-in device",
        )
    })
}

impl Backend for StandIn {
    fn location(&self) -> Location {
        Location::StandIn
    }

    fn describe(&self) -> String {
        "stand-in device (host memory)".into()
    }

    fn alloc(&self, len: usize) -> Result<Arc<dyn Mem>> {
        Ok(Arc::new(Memory {
            bytes: Mutex::new(vec![0u8; len].into_boxed_slice()),
        }))
    }

    fn alloc_host(&self, len: usize) -> Result<Box<dyn HostMem>> {
        Ok(Box::new(Host::new(len)))
    }

    unsafe fn start_copy_out(
        &self,
        src: &Arc<dyn Mem>,
        offset: usize,
        dst: *mut u8,
        len: usize,
        done: Arc<Done>,
    ) -> Result<()> {
        mine(&**src)?;
        check_range(offset, len, src.len())?;
        let job = Job {
            src: src.clone(),
            offset,
            dst: Dst(dst),
            len,
            done,
        };
        self.engine().send(job).map_err(|_| {
            Error::new(
                ErrorKind::Io,
                "the stand-in device's copy thread is not running",
            )
        })
    }

    fn copy_in(&self, dst: &dyn Mem, offset: usize, src: &[u8]) -> Result<()> {
        let dst = mine(dst)?;
        let mut bytes = dst.bytes.lock().expect("not poisoned");
        check_range(offset, src.len(), bytes.len())?;
        bytes[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn finish_copy_in(&self, dst: &dyn Mem) -> Result<()> {
        mine(dst).map(drop)
    }
}

/// A staging buffer on the heap.
struct Host {
    ptr: *mut u8,
    len: usize,
}

impl Host {
    fn new(len: usize) -> Host {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        Host {
            ptr: Box::into_raw(b).cast::<u8>(),
            len,
        }
    }
}

// SAFETY: `Host` owns its allocation; it is written through `as_ptr` only by the copy engine
// under `start_copy_out`'s contract and read afterwards, never concurrently.
unsafe impl Send for Host {}
// SAFETY: as above: shared references only read, after the write completed.
unsafe impl Sync for Host {}

impl HostMem for Host {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `Box::into_raw` of a `[u8]` of `len` bytes and is freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}
