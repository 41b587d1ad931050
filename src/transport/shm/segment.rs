//! The shared segment of one connection: a sealed memfd holding, per direction, the ring's
//! control block and descriptors and the body arena, behind a header both sides validate.
//!
//! ```text
//! 0        SegmentHeader, one page: magic "HYPERSHM", version, sizes, and for each direction
//!          the offsets of its control block, slots and arena (all u64/u32 native-endian)
//! dir[d]   Control (head, sleep and close flags), then the DeviceTable (device bodies lent
//!          to the peer, see `device`), rounded up to a page
//! + slots  ring_entries × 128-byte descriptors (see `desc`)
//! + arena  arena_len bytes, page aligned: blocks of a 64-byte header (reference count)
//!          and the payload
//! ```
//!
//! Direction 0 carries listener → connector, direction 1 connector → listener. The memfd is
//! sealed against shrinking and growing, and the opener checks the seals, so a peer cannot
//! truncate the file under our mapping (which would turn our next access into SIGBUS).
//!
//! Access to the mapping: the peer can write any byte of it at any time. Everything we read
//! that the peer may write goes through atomics (the control block, the slots' words, the
//! block counts) or an atomic word copy ([`ShmArena::copy_out`]); plain references into the
//! mapping are handed out only for bodies when the peer is trusted with them (see the module
//! docs of `shm`). Every pointer computed here is bounds-checked in release builds too.

// The loom seam holds here: std's atomics are refused (clippy.toml).
#![deny(clippy::disallowed_types, clippy::disallowed_methods)]

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::arena::{BLOCK_ALIGN, BlockRefs};
use super::device::DeviceTable;
use super::ring::{Control, RingStore, Slot};
use crate::error::{Error, ErrorKind};
use crate::loom::sync::{AtomicU32, AtomicU64, Ordering};

const MAGIC: [u8; 8] = *b"HYPERSHM";
const VERSION: u32 = 5;
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
    /// Size of a `DeviceTable`, which follows the control block at `table_offset`.
    table_len: u32,
    arena_len: u64,
    /// Offset of each direction's control block.
    dir: [u64; 2],
    /// Offsets of the slots and of the arena, from the start of a direction.
    slots_offset: u64,
    arena_offset: u64,
}

/// Sizes of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) ring_entries: u32,
    pub(crate) arena_len: u64,
}

impl Geometry {
    /// Where a direction's device table is, after its control block.
    fn table_offset() -> u64 {
        (std::mem::size_of::<Control>() as u64).next_multiple_of(BLOCK_ALIGN)
    }

    fn control_area() -> u64 {
        (Self::table_offset() + std::mem::size_of::<DeviceTable>() as u64).next_multiple_of(PAGE)
    }

    fn slots_len(&self) -> u64 {
        self.ring_entries as u64 * std::mem::size_of::<Slot>() as u64
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

    /// A pointer to `offset`, for a `T` that fits before the end (checked).
    fn at<T>(&self, offset: u64) -> *mut T {
        let end = offset.checked_add(std::mem::size_of::<T>() as u64);
        assert!(
            end.is_some_and(|e| e <= self.len as u64),
            "shared-memory access out of the mapping"
        );
        debug_assert!(
            (self.ptr.as_ptr() as usize + offset as usize)
                .is_multiple_of(std::mem::align_of::<T>())
        );
        // SAFETY: in bounds (checked above), so the pointer stays inside the mapping.
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

// A process-wide counter, outside the protocol (and a `static`, which loom's atomics cannot be).
#[allow(clippy::disallowed_types)]
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
            desc_len: std::mem::size_of::<Slot>() as u32,
            control_len: std::mem::size_of::<Control>() as u32,
            table_len: std::mem::size_of::<DeviceTable>() as u32,
            arena_len: geometry.arena_len,
            dir: [geometry.dir_offset(0), geometry.dir_offset(1)],
            slots_offset: Geometry::control_area(),
            arena_offset: geometry.arena_offset(),
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
            || h.desc_len as usize != std::mem::size_of::<Slot>()
            || h.control_len as usize != std::mem::size_of::<Control>()
            || h.table_len as usize != std::mem::size_of::<DeviceTable>()
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
            || h.slots_offset != Geometry::control_area()
            || h.arena_offset != geometry.arena_offset()
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

impl ShmRing {
    /// The direction's device table.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn devices(&self) -> &DeviceTable {
        // SAFETY: the table lies inside the direction's control area (validated geometry:
        // `table_offset` + its size is within `control_area`), is aligned (64 bytes) and only
        // accessed through its atomics; all-zero bytes are its initial state; the mapping
        // lives as long as `self.seg`.
        unsafe {
            &*self
                .seg
                .map
                .at::<DeviceTable>(self.base + Geometry::table_offset())
        }
    }
}

impl RingStore for ShmRing {
    fn control(&self) -> &Control {
        // SAFETY: the control block lies at the direction's base (validated geometry), is
        // aligned (page) and only accessed through its atomics; the mapping lives as long
        // as `self.seg`.
        unsafe { &*self.seg.map.at::<Control>(self.base) }
    }

    fn slot(&self, i: u64) -> &Slot {
        let offset = self.base + Geometry::control_area() + (i & self.mask) * 128;
        // SAFETY: slot `i & mask` is inside the ring (validated geometry; `at` checks the
        // bounds), 128-byte aligned; a `Slot` is sixteen atomics, valid for any bits.
        unsafe { &*self.seg.map.at::<Slot>(offset) }
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
    /// A pointer to `len` bytes at `offset` of the arena (checked to lie inside it).
    pub(crate) fn ptr(&self, offset: u64, len: u64) -> *mut u8 {
        let arena_len = self.seg.geometry.arena_len;
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= arena_len),
            "arena access out of bounds"
        );
        // The arena lies inside the mapping (validated geometry); `at` checks it again.
        self.seg.map.at::<u8>(self.base + offset)
    }

    /// Copies `len` bytes at `offset` (8-byte aligned) out of the arena with relaxed atomic
    /// loads of whole words: a peer that writes them at the same time changes what we read,
    /// never our memory's soundness. The last word is read whole; it lies inside the arena,
    /// whose length is a multiple of 64.
    pub(crate) fn copy_out(&self, offset: u64, len: usize) -> Vec<u8> {
        let words = len.div_ceil(8);
        assert!(offset.is_multiple_of(8), "unaligned arena copy");
        let src = self.ptr(offset, words as u64 * 8).cast::<AtomicU64>();
        let mut out = vec![0u8; words * 8];
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            // SAFETY: word `i` lies in the range checked by `ptr`, 8-byte aligned (arena and
            // offset are), and shared memory is only ever accessed atomically here.
            let w = unsafe { &*src.add(i) }.load(Ordering::Relaxed);
            chunk.copy_from_slice(&w.to_ne_bytes());
        }
        out.truncate(len);
        out
    }

    /// Copies `bytes` into the payload at `offset`, of a block this side allocated and has
    /// not published (so no well-behaved peer reads it yet).
    pub(crate) fn copy_in(&self, offset: u64, bytes: &[u8]) {
        let dst = self.ptr(offset, bytes.len() as u64);
        // SAFETY: `dst` spans `bytes.len()` bytes inside the arena (checked); `bytes` is
        // process memory, so the two do not overlap. Only a misbehaving peer could touch the
        // block now, and what it could change is what it reads.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
    }
}

impl BlockRefs for ShmArena {
    fn refs(&self, offset: u64) -> &AtomicU32 {
        assert!(offset.is_multiple_of(BLOCK_ALIGN), "unaligned block");
        let p = self.ptr(offset, BLOCK_ALIGN).cast::<AtomicU32>();
        // SAFETY: a block header is 64-byte aligned inside the arena (checked by `ptr`); its
        // first four bytes are the reference count, only ever accessed atomically.
        unsafe { &*p }
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
            .head
            .store(3, crate::loom::sync::Ordering::Release);
        assert_eq!(
            other
                .ring(1)
                .control()
                .head
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
        assert!(e.to_string().contains("magic"), "{e:#}");

        let plain = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&plain, 1 << 20).unwrap();
        let e = Segment::open(plain).err().unwrap();
        assert!(e.to_string().contains("not"), "{e:#}");
    }
}
