//! The shared segment of one connection: a sealed memfd holding, per direction, the ring's
//! control block and descriptors and the body arena, behind a header both sides validate.
//!
//! ```text
//! 0       SegmentHeader (magic "HYPERSHM", version, sizes, direction offsets), one page
//! dir[d]  Control (head, tail, sleep and close flags), rounded up to a page
//!         ring_entries × Desc (128 bytes each)
//!         arena (arena_len bytes, page aligned)
//! ```
//!
//! Direction 0 carries listener → connector, direction 1 connector → listener. The memfd is
//! sealed against shrinking and growing, and the opener checks the seals, so a peer cannot
//! truncate the file under our mapping (which would turn our next access into SIGBUS).

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::arena::{BLOCK_ALIGN, BlockRefs};
use super::ring::{Control, Desc, RingStore};
use crate::loom::sync::{AtomicU32, UnsafeCell};
use crate::{Error, ErrorKind};

const MAGIC: [u8; 8] = *b"HYPERSHM";
const VERSION: u32 = 1;
const PAGE: u64 = 4096;

/// The segment header. Plain data written once by the creator before the segment is shared.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SegmentHeader {
    magic: [u8; 8],
    version: u32,
    header_len: u32,
    total_len: u64,
    ring_entries: u32,
    desc_len: u32,
    control_len: u32,
    _reserved: u32,
    arena_len: u64,
    dir: [u64; 2],
}

/// Sizes of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) ring_entries: u32,
    pub(crate) arena_len: u64,
}

impl Geometry {
    fn control_area() -> u64 {
        (std::mem::size_of::<Control>() as u64).next_multiple_of(PAGE)
    }

    fn slots_len(&self) -> u64 {
        self.ring_entries as u64 * std::mem::size_of::<Desc>() as u64
    }

    fn arena_offset(&self) -> u64 {
        (Self::control_area() + self.slots_len()).next_multiple_of(PAGE)
    }

    fn dir_len(&self) -> u64 {
        self.arena_offset() + self.arena_len
    }

    fn total_len(&self) -> u64 {
        PAGE + 2 * self.dir_len()
    }

    fn dir_offset(&self, d: usize) -> u64 {
        PAGE + d as u64 * self.dir_len()
    }

    /// Checks the sizes, as the creator configured them or as a peer announced them.
    fn check(&self) -> Result<(), &'static str> {
        if !self.ring_entries.is_power_of_two() || self.ring_entries > 1 << 20 {
            return Err("ring entries must be a power of two up to 2^20");
        }
        if self.arena_len < PAGE || !self.arena_len.is_multiple_of(PAGE) || self.arena_len > 1 << 40
        {
            return Err("the arena must be a multiple of 4 KiB between 4 KiB and 1 TiB");
        }
        Ok(())
    }
}

/// A shared mapping, unmapped when the last user drops it.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is ordinary process memory shared with another process; this type only
// hands out raw pointers, and every access through them follows the ring/arena protocols,
// which use atomics or exclusive ownership. Unmapping happens once, in `Drop`.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: `&Mapping` gives nothing but the base pointer and length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd`, shared, readable and (if `write`) writable.
    pub(crate) fn new(fd: impl AsFd, len: u64, write: bool) -> std::io::Result<Mapping> {
        let len = usize::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let prot = if write {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a fresh mapping at an address the kernel chooses (null hint) aliases no Rust
        // object. `len` is the size of the file (checked by the callers against `fstat`), and
        // the file is sealed against shrinking, so every byte stays backed.
        let ptr =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0) }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(std::io::ErrorKind::Other)?;
        Ok(Mapping { ptr, len })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A pointer to `offset`, for a `T` that fits before the end.
    fn at<T>(&self, offset: u64) -> *mut T {
        debug_assert!(offset as usize + std::mem::size_of::<T>() <= self.len);
        debug_assert!(
            (self.ptr.as_ptr() as usize + offset as usize)
                .is_multiple_of(std::mem::align_of::<T>())
        );
        // SAFETY: in bounds (asserted above; callers compute offsets from a validated
        // geometry), so the pointer stays inside the mapping.
        unsafe { self.ptr.as_ptr().add(offset as usize).cast::<T>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what `mmap` returned, unmapped only here; every
        // borrow of the mapping is tied to an `Arc<Mapping>` that is gone by now.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A mapped, validated segment.
pub(crate) struct Segment {
    map: Mapping,
    geometry: Geometry,
    /// Process-unique number, to recognise bodies allocated in this segment's arenas.
    id: u64,
}

static NEXT_SEGMENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(what, e)
}

fn io_rustix(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error {
    move |e| Error::io(what, e.into())
}

fn bad(what: impl Into<String>) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("shared-memory segment rejected: {}", what.into()),
    )
}

impl Segment {
    /// Creates, sizes, seals and initialises a segment. Returns it and its memfd (to pass).
    pub(crate) fn create(geometry: Geometry) -> Result<(Arc<Segment>, OwnedFd), Error> {
        geometry
            .check()
            .map_err(|e| Error::new(ErrorKind::Config, e))?;
        let fd = rustix::fs::memfd_create(
            "hyperframes-shm",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(io_rustix(
            "creating the shared-memory segment (memfd_create)",
        ))?;
        let total = geometry.total_len();
        rustix::fs::ftruncate(&fd, total).map_err(io_rustix("sizing the shared-memory segment"))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(io_rustix("sealing the shared-memory segment"))?;
        let map =
            Mapping::new(&fd, total, true).map_err(io("mapping the shared-memory segment"))?;
        let header = SegmentHeader {
            magic: MAGIC,
            version: VERSION,
            header_len: std::mem::size_of::<SegmentHeader>() as u32,
            total_len: total,
            ring_entries: geometry.ring_entries,
            desc_len: std::mem::size_of::<Desc>() as u32,
            control_len: std::mem::size_of::<Control>() as u32,
            _reserved: 0,
            arena_len: geometry.arena_len,
            dir: [geometry.dir_offset(0), geometry.dir_offset(1)],
        };
        // SAFETY: offset 0 is page aligned and a page long; nobody else maps the file yet.
        // The rest of the file is zero (fresh memfd), which is the initial state of `Control`,
        // the descriptors and the block counts.
        unsafe { map.at::<SegmentHeader>(0).write(header) };
        Ok((
            Arc::new(Segment {
                map,
                geometry,
                id: NEXT_SEGMENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            }),
            fd,
        ))
    }

    /// Maps and validates a segment received from the peer.
    pub(crate) fn open(fd: OwnedFd) -> Result<Arc<Segment>, Error> {
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| bad("the file descriptor is not a sealable memfd"))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(bad("the memfd is not sealed against resizing"));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(io_rustix("inspecting the shared-memory segment"))?
            .st_size as u64;
        if size < PAGE {
            return Err(bad(format!("{size} bytes is too small for a header")));
        }
        let head_map = Mapping::new(&fd, PAGE, false).map_err(io("mapping the segment header"))?;
        // SAFETY: one page is mapped and the header is smaller; it is plain data (any bit
        // pattern is a valid value), read once with a volatile copy and then validated.
        let h = unsafe { head_map.at::<SegmentHeader>(0).read_volatile() };
        drop(head_map);
        if h.magic != MAGIC {
            return Err(bad(format!("wrong magic {:?}", h.magic)));
        }
        if h.version != VERSION {
            return Err(bad(format!(
                "version {} (this side speaks {VERSION})",
                h.version
            )));
        }
        if h.header_len as usize != std::mem::size_of::<SegmentHeader>()
            || h.desc_len as usize != std::mem::size_of::<Desc>()
            || h.control_len as usize != std::mem::size_of::<Control>()
        {
            return Err(bad("its layout differs from this build's"));
        }
        let geometry = Geometry {
            ring_entries: h.ring_entries,
            arena_len: h.arena_len,
        };
        geometry.check().map_err(bad)?;
        if h.total_len != geometry.total_len()
            || h.total_len != size
            || h.dir != [geometry.dir_offset(0), geometry.dir_offset(1)]
        {
            return Err(bad("its sizes do not add up"));
        }
        let map = Mapping::new(&fd, size, true).map_err(io("mapping the shared-memory segment"))?;
        Ok(Arc::new(Segment {
            map,
            geometry,
            id: NEXT_SEGMENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }))
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    #[cfg(test)]
    pub(crate) fn arena_len(&self) -> u64 {
        self.geometry.arena_len
    }

    /// The ring of direction `d`.
    pub(crate) fn ring(self: &Arc<Self>, d: usize) -> ShmRing {
        ShmRing {
            seg: self.clone(),
            base: self.geometry.dir_offset(d),
            mask: self.geometry.ring_entries as u64 - 1,
        }
    }

    /// The arena of direction `d`.
    pub(crate) fn arena(self: &Arc<Self>, d: usize) -> ShmArena {
        ShmArena {
            seg: self.clone(),
            base: self.geometry.dir_offset(d) + self.geometry.arena_offset(),
        }
    }
}

/// One direction's ring in a segment.
#[derive(Clone)]
pub(crate) struct ShmRing {
    seg: Arc<Segment>,
    base: u64,
    mask: u64,
}

impl RingStore for ShmRing {
    fn control(&self) -> &Control {
        // SAFETY: the control block lies at the direction's base (validated geometry), is
        // aligned (page) and only accessed through its atomics; the mapping lives as long
        // as `self.seg`.
        unsafe { &*self.seg.map.at::<Control>(self.base) }
    }

    fn slot(&self, i: u64) -> &UnsafeCell<Desc> {
        let offset = self.base + Geometry::control_area() + (i & self.mask) * 128;
        // SAFETY: slot `i & mask` is inside the ring (validated geometry), 128-byte aligned;
        // `UnsafeCell<Desc>` has `Desc`'s layout, and the ring protocol decides who accesses
        // it (see `ring::Producer::write` and `ring::Consumer::read`).
        unsafe { &*self.seg.map.at::<UnsafeCell<Desc>>(offset) }
    }

    fn capacity(&self) -> u64 {
        self.mask + 1
    }
}

/// One direction's arena in a segment.
#[derive(Clone)]
pub(crate) struct ShmArena {
    seg: Arc<Segment>,
    base: u64,
}

impl ShmArena {
    /// The payload bytes `[offset, offset + len)` of the arena (offsets validated by the
    /// caller with `arena::validate`).
    pub(crate) fn ptr(&self, offset: u64) -> *mut u8 {
        debug_assert!(offset <= self.seg.geometry.arena_len);
        // SAFETY: within the arena (caller-validated), hence within the mapping.
        unsafe { self.seg.map.base().add((self.base + offset) as usize) }
    }
}

impl BlockRefs for ShmArena {
    fn refs(&self, offset: u64) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(BLOCK_ALIGN) && offset < self.seg.geometry.arena_len);
        // SAFETY: a block header is 64-byte aligned inside the arena (validated offset); its
        // first four bytes are the reference count, only ever accessed atomically.
        unsafe { &*self.seg.map.at::<AtomicU32>(self.base + offset) }
    }

    fn len(&self) -> u64 {
        self.seg.geometry.arena_len
    }
}

#[cfg(all(test, not(hyperframes_loom)))]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry {
            ring_entries: 8,
            arena_len: 64 << 10,
        }
    }

    #[test]
    fn create_then_open_sees_the_same_memory() {
        let (seg, fd) = Segment::create(geometry()).unwrap();
        let other = Segment::open(fd.try_clone().unwrap()).unwrap();
        seg.ring(1)
            .control()
            .tail
            .store(3, crate::loom::sync::Ordering::Release);
        assert_eq!(
            other
                .ring(1)
                .control()
                .tail
                .load(crate::loom::sync::Ordering::Acquire),
            3
        );
        assert_eq!(other.arena_len(), 64 << 10);
    }

    #[test]
    fn corrupted_or_unsealed_segments_are_rejected() {
        let (seg, fd) = Segment::create(geometry()).unwrap();
        // SAFETY: test-only: scribble on the magic of a segment nobody else uses.
        unsafe { *seg.map.base() = b'X' };
        let e = Segment::open(fd).err().unwrap();
        assert!(e.to_string().contains("magic"), "{e}");

        let plain = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 1 << 20).unwrap();
        let e = Segment::open(plain).err().unwrap();
        assert!(e.to_string().contains("not"), "{e}");
    }
}
