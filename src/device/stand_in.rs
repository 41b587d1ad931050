//! Host memory handled as a device, with a copy engine of its own (a thread), so the device
//! paths run — and are tested — without a GPU.
//!
//! Its memory is shared with other processes the way CUDA IPC shares device memory (with
//! `shm`): [`export`](Backend::export) moves a block into a memfd and hands out a 64-byte
//! handle naming it (`/proc/<pid>/fd/<fd>`, checked by inode), which another process of the
//! same user maps with [`import`](Backend::import). As with CUDA, the exporter keeps the
//! block alive for as long as the importer uses it, and neither side reads the other's
//! writes except through copies.

use std::any::Any;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::{Backend, Done, HostMem, Keep, Live, LiveGuard, Mem, check_range};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Location;

pub(super) struct StandIn {
    engine: OnceLock<mpsc::Sender<Job>>,
    live: Live,
}

struct Memory {
    store: Mutex<Store>,
    /// The body: `len` bytes at `offset` of the store.
    offset: usize,
    len: usize,
    _live: LiveGuard,
    /// Dropped after `store` (fields drop in order): after the memory is unmapped.
    _keep: Option<Keep>,
}

/// Where a block's bytes are.
enum Store {
    Heap(Box<[u8]>),
    /// In a memfd, mapped: exported, or imported from another process.
    #[cfg(feature = "shm")]
    Shared(ipc::Shared),
}

impl Store {
    /// The first byte of the allocation.
    fn base(&mut self) -> *mut u8 {
        match self {
            Store::Heap(b) => b.as_mut_ptr(),
            #[cfg(feature = "shm")]
            Store::Shared(s) => s.base(),
        }
    }
}

impl Memory {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `f` of the memfd the allocation lives in, moving it there first (when first lent).
    #[cfg(feature = "shm")]
    fn shared<T>(&self, f: impl FnOnce(&ipc::Shared) -> Result<T>) -> Result<T> {
        let mut store = self.lock();
        if let Store::Heap(bytes) = &*store {
            let shared = ipc::Shared::create(bytes)?;
            *store = Store::Shared(shared);
        }
        let Store::Shared(shared) = &*store else {
            unreachable!("moved to a memfd above")
        };
        f(shared)
    }

    /// Copies `len` bytes at `offset` of the body to `dst`.
    ///
    /// # Safety
    /// `dst` is valid for writes of `len` bytes; the range was checked against the body.
    unsafe fn read(&self, offset: usize, dst: *mut u8, len: usize) {
        let mut store = self.lock();
        // SAFETY: the store holds `self.offset + self.len` bytes and the caller checked the
        // range; device memory shared with another process is only ever copied, as on a
        // GPU (a peer writing a body it has sent is that application's race, not ours).
        unsafe { std::ptr::copy_nonoverlapping(store.base().add(self.offset + offset), dst, len) };
    }

    /// Copies `src` to `offset` of the body (the range checked by the caller).
    fn write(&self, offset: usize, src: &[u8]) {
        let mut store = self.lock();
        // SAFETY: as in `read`; the range was checked against the body.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                store.base().add(self.offset + offset),
                src.len(),
            )
        };
    }
}

impl Mem for Memory {
    fn len(&self) -> usize {
        self.len
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
            live: Live::default(),
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
                        // SAFETY: `start_copy_out`'s contract: `dst` is valid for `len` bytes
                        // and untouched until `done` completes; the range of `src` was checked
                        // when the job was queued.
                        unsafe { src.read(job.offset, job.dst.0, job.len) };
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
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn location(&self) -> Location {
        Location::StandIn
    }

    fn describe(&self) -> String {
        "stand-in device (host memory)".into()
    }

    fn alloc(&self, len: usize) -> Result<Arc<dyn Mem>> {
        Ok(Arc::new(Memory {
            store: Mutex::new(Store::Heap(vec![0u8; len].into_boxed_slice())),
            offset: 0,
            len,
            _live: self.live.guard(),
            _keep: None,
        }))
    }

    fn live(&self) -> usize {
        self.live.count()
    }

    #[cfg(feature = "shm")]
    fn ipc_kind(&self) -> u8 {
        super::IPC_STAND_IN
    }

    #[cfg(feature = "shm")]
    fn export(&self, mem: &Arc<dyn Mem>) -> Result<super::IpcHandle> {
        let m = mine(&**mem)?;
        Ok(super::IpcHandle {
            kind: super::IPC_STAND_IN,
            handle: m.shared(ipc::Shared::handle)?,
            offset: m.offset as u64,
            len: m.len as u64,
        })
    }

    /// The memfd the body moves into when first lent (as for [`export`](Self::export)),
    /// standing in for the dma-buf a GPU driver exports.
    #[cfg(all(feature = "shm", feature = "rdma"))]
    fn dmabuf(&self, mem: &Arc<dyn Mem>, _sync: bool) -> Result<super::DmaBuf> {
        let m = mine(&**mem)?;
        Ok(super::DmaBuf {
            fd: m.shared(ipc::Shared::dup_fd)?,
            offset: m.offset as u64,
            len: m.len,
        })
    }

    #[cfg(feature = "shm")]
    fn import(&self, h: &super::IpcHandle, peer: u32, keep: Keep) -> Result<Arc<dyn Mem>> {
        let shared = ipc::Shared::open(h, peer)?;
        Ok(Arc::new(Memory {
            store: Mutex::new(Store::Shared(shared)),
            offset: h.offset as usize, // within the mapping: `open` checked
            len: h.len as usize,
            _live: self.live.guard(),
            _keep: Some(keep),
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
        check_range(offset, src.len(), dst.len)?;
        dst.write(offset, src);
        Ok(())
    }

    fn finish_copy_in(&self, dst: &dyn Mem) -> Result<()> {
        mine(dst).map(drop)
    }

    fn copy_device(&self, src: &dyn Mem, dst: &dyn Mem) -> Result<()> {
        let (src, dst) = (mine(src)?, mine(dst)?);
        check_range(0, src.len, dst.len)?;
        // Locked in address order: two copies in opposite directions cannot deadlock.
        let (s, d) = if std::ptr::from_ref(src) < std::ptr::from_ref(dst) {
            let s = src.lock();
            (s, dst.lock())
        } else {
            let d = dst.lock();
            (src.lock(), d)
        };
        let (mut s, mut d) = (s, d);
        // SAFETY: distinct blocks (the caller checked), each valid for its offset plus
        // `len` bytes, both locked; `dst` holds at least `src.len` bytes (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                s.base().add(src.offset),
                d.base().add(dst.offset),
                src.len,
            )
        };
        Ok(())
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

/// Stand-in memory in a memfd, the way another process reaches it.
#[cfg(feature = "shm")]
mod ipc {
    use std::os::fd::{AsRawFd, OwnedFd};

    use rustix::fs::{MemfdFlags, Mode, OFlags, SealFlags};

    use crate::device::{IPC_STAND_IN, IpcHandle};
    use crate::error::{Error, ErrorKind, Result};
    use crate::transport::shm::Mapping;

    /// A memfd mapped shared, read and write (`shm`'s own mapping, unmapped on drop).
    pub(super) struct Shared {
        /// The exporter's memfd, named by its handle; an importer needs only the mapping.
        fd: Option<OwnedFd>,
        map: Mapping,
    }

    fn io(what: &str) -> impl Fn(rustix::io::Errno) -> Error + '_ {
        move |e| Error::io(format!("stand-in device: {what}"), e.into())
    }

    impl Shared {
        /// A memfd holding a copy of `bytes` (not empty: an empty body is never lent).
        pub(super) fn create(bytes: &[u8]) -> Result<Shared> {
            let fd = rustix::fs::memfd_create(
                "hyperframes-stand-in",
                MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
            )
            .map_err(io("creating a memfd"))?;
            rustix::fs::ftruncate(&fd, bytes.len() as u64).map_err(io("sizing a memfd"))?;
            // Its size is fixed: an importer's mapping cannot be cut short under it (SIGBUS).
            rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
                .map_err(io("sealing a memfd"))?;
            let shared = Shared::map(fd, bytes.len() as u64)?;
            // SAFETY: a fresh mapping of `bytes.len()` bytes nobody else has yet.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), shared.base(), bytes.len()) };
            Ok(shared)
        }

        /// Maps all `len` bytes of `fd` (its size, set or checked by the callers).
        fn map(fd: OwnedFd, len: u64) -> Result<Shared> {
            let map = Mapping::new(&fd, len, true)
                .map_err(|e| Error::io("stand-in device: mapping a memfd", e))?;
            Ok(Shared { fd: Some(fd), map })
        }

        pub(super) fn base(&self) -> *mut u8 {
            self.map.base()
        }

        /// A descriptor of the memfd of our own memory (not of memory mapped from a peer).
        #[cfg(feature = "rdma")]
        pub(super) fn dup_fd(&self) -> Result<OwnedFd> {
            let fd = self.fd.as_ref().ok_or_else(|| {
                Error::new(
                    ErrorKind::Unavailable,
                    "stand-in device: memory mapped from another process is not lent on",
                )
            })?;
            fd.try_clone()
                .map_err(|e| Error::io("stand-in device: duplicating a memfd", e))
        }

        /// pid, descriptor, device and inode of the memfd, and its size.
        pub(super) fn handle(&self) -> Result<[u8; 64]> {
            // Like CUDA, which does not export memory it mapped from another process.
            let fd = self.fd.as_ref().ok_or_else(|| {
                Error::new(
                    ErrorKind::Unavailable,
                    "stand-in device: memory mapped from another process is not lent on",
                )
            })?;
            let st = rustix::fs::fstat(fd).map_err(io("inspecting a memfd"))?;
            let mut h = [0u8; 64];
            h[..4].copy_from_slice(
                &rustix::process::getpid()
                    .as_raw_nonzero()
                    .get()
                    .to_ne_bytes(),
            );
            h[4..8].copy_from_slice(&fd.as_raw_fd().to_ne_bytes());
            h[8..16].copy_from_slice(&st.st_dev.to_ne_bytes());
            h[16..24].copy_from_slice(&st.st_ino.to_ne_bytes());
            h[24..32].copy_from_slice(&(self.map.len() as u64).to_ne_bytes());
            Ok(h)
        }

        /// Maps the memfd a handle of process `peer` names, checking it is that process's,
        /// that file, sealed to its size, and that it holds the body.
        pub(super) fn open(h: &IpcHandle, peer: u32) -> Result<Shared> {
            let word = |at: usize| u64::from_ne_bytes(h.handle[at..at + 8].try_into().expect("8"));
            let pid = u32::from_ne_bytes(h.handle[..4].try_into().expect("4"));
            let fd = i32::from_ne_bytes(h.handle[4..8].try_into().expect("4"));
            let (dev, ino, size) = (word(8), word(16), word(24));
            if h.kind != IPC_STAND_IN
                || pid != peer
                || h.offset.checked_add(h.len).is_none_or(|end| end > size)
                || usize::try_from(size).is_err()
            {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("a stand-in device handle that does not add up: {h:?}"),
                ));
            }
            let path = format!("/proc/{pid}/fd/{fd}");
            let file =
                rustix::fs::open(path.as_str(), OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
                    .map_err(|e| {
                        Error::new(
                            ErrorKind::Unavailable,
                            format!(
                                "stand-in device: cannot open the peer's memory at {path} (has it \
                             exited?)"
                            ),
                        )
                        .with_source(std::io::Error::from(e))
                    })?;
            let st = rustix::fs::fstat(&file).map_err(io("inspecting a peer's memfd"))?;
            let sealed = rustix::fs::fcntl_get_seals(&file)
                .is_ok_and(|s| s.contains(SealFlags::SHRINK | SealFlags::GROW));
            if st.st_dev != dev || st.st_ino != ino || st.st_size as u64 != size || !sealed {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("stand-in device: {path} is not the sealed memory the handle names"),
                ));
            }
            let mut shared = Shared::map(file, size)?;
            // The mapping holds the memory: no descriptor kept per lent body.
            shared.fd = None;
            Ok(shared)
        }
    }
}
