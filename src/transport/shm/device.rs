//! Device bodies lent to the peer process (CUDA IPC, feature `cuda`): the table in the
//! segment that says which are still mapped, and the record that names each.
//!
//! A body in device memory does not leave the device on `shm://` when the receiver lands
//! bodies on a device of the same kind: the sender exports its allocation (an
//! [`IpcHandle`](crate::device)), writes the handle into a free slot of its direction's table,
//! sets the slot's count to 1 and sends a descriptor with `BODY_DEVICE` and the slot number.
//! The receiver maps the handle (`cuIpcOpenMemHandle`) and hands out a device body over that
//! mapping; when the application drops it, the mapping is closed, the count goes back to 0
//! and the sender's process is woken on its space socket, where its watcher task drops its
//! reference to the body (the sender's memory is not freed or reused before). At most
//! [`DEVICE_SLOTS`] bodies are lent at a time per direction; a body sent while every slot is
//! taken is staged instead, and said so.
//!
//! ```text
//! DeviceTable  landing: u64 (the kind of handle the receiver of this direction maps; 0: none)
//!              slots[DEVICE_SLOTS]: count u32, 0 u32, record 11 × u64
//! record       kind, handle (64 bytes, 8 words), offset, length
//! ```
//!
//! The table is shared memory the peer can write at any time: a record is copied out with
//! atomic loads and checked before use, and the sender keeps its references in process
//! memory. A receiver that zeroes a count early only loses the memory it maps (the sender
//! may free it); a receiver that never does keeps its slots, and the sender stages.

// The loom seam holds here: std's atomics are refused (clippy.toml).
#![deny(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::loom::sync::{AtomicU32, AtomicU64, Ordering};

/// Device bodies lent at a time per direction.
pub(crate) const DEVICE_SLOTS: usize = 256;

const RECORD_WORDS: usize = 11;

/// One lent body.
#[repr(C)]
pub(crate) struct DeviceSlot {
    /// 1 while the receiver maps the body; the receiver stores 0 when it is done.
    refs: AtomicU32,
    _pad: AtomicU32,
    record: [AtomicU64; RECORD_WORDS],
}

/// The device bodies of one direction.
#[repr(C)]
pub(crate) struct DeviceTable {
    /// The kind of handle the receiver of this direction maps (`device::IPC_*`); 0 when it
    /// lands bodies in host memory. Written by the receiver.
    landing: AtomicU64,
    slots: [DeviceSlot; DEVICE_SLOTS],
}

// (loom's atomics are larger: the layout holds for the real ones.)
#[cfg(not(hyperframes_loom))]
const _: () = assert!(std::mem::size_of::<DeviceSlot>() == 96);

/// What names a lent body: the device kind, the handle, where the body is in the allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceRecord {
    pub(crate) kind: u8,
    pub(crate) handle: [u8; 64],
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl DeviceRecord {
    fn words(&self) -> [u64; RECORD_WORDS] {
        let mut w = [0u64; RECORD_WORDS];
        w[0] = u64::from(self.kind);
        for (word, bytes) in w[1..9].iter_mut().zip(self.handle.chunks_exact(8)) {
            *word = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
        }
        w[9] = self.offset;
        w[10] = self.len;
        w
    }

    /// A record from its words; `None` when the kind does not fit a byte.
    fn from_words(w: &[u64; RECORD_WORDS]) -> Option<DeviceRecord> {
        let mut handle = [0u8; 64];
        for (bytes, word) in handle.chunks_exact_mut(8).zip(&w[1..9]) {
            bytes.copy_from_slice(&word.to_le_bytes());
        }
        Some(DeviceRecord {
            kind: u8::try_from(w[0]).ok()?,
            handle,
            offset: w[9],
            len: w[10],
        })
    }
}

impl DeviceSlot {
    /// The sender lends the slot: the record, then the count.
    fn lend(&self, rec: &DeviceRecord) {
        for (a, w) in self.record.iter().zip(rec.words()) {
            a.store(w, Ordering::Relaxed);
        }
        self.refs.store(1, Ordering::Relaxed);
    }

    fn is_free(&self) -> bool {
        // SYNC POINT with the `refs` store in `release`: the receiver's use of the record
        // and of the mapping happens before the sender reuses the slot or frees the memory.
        self.refs.load(Ordering::Acquire) == 0
    }

    fn read(&self) -> Option<DeviceRecord> {
        let w = std::array::from_fn(|k| self.record[k].load(Ordering::Relaxed));
        DeviceRecord::from_words(&w)
    }

    fn release(&self) {
        // SYNC POINT with the `refs` load in `is_free`.
        self.refs.store(0, Ordering::Release);
    }
}

impl DeviceTable {
    /// The receiver says which handles it maps (0: none).
    pub(crate) fn set_landing(&self, kind: u8) {
        self.landing.store(u64::from(kind), Ordering::Release);
    }

    /// What the receiver maps; a value out of range (a peer's scribble) is none.
    pub(crate) fn landing(&self) -> u8 {
        u8::try_from(self.landing.load(Ordering::Acquire)).unwrap_or(0)
    }

    /// True when the receiver is done with slot `i` (or never took it).
    pub(crate) fn is_free(&self, i: usize) -> bool {
        self.slots[i].is_free()
    }

    /// The sender lends slot `i`. The descriptor that names the slot is published after
    /// (Release), so the receiver sees the record and the count.
    pub(crate) fn lend(&self, i: usize, rec: &DeviceRecord) {
        self.slots[i].lend(rec);
    }

    /// The receiver reads slot `i` (checked below [`DEVICE_SLOTS`] by the descriptor check),
    /// after the descriptor that names it.
    pub(crate) fn read(&self, i: usize) -> Option<DeviceRecord> {
        self.slots[i].read()
    }

    /// The receiver is done with slot `i`.
    pub(crate) fn release(&self, i: usize) {
        self.slots[i].release();
    }
}

#[cfg(all(test, not(hyperframes_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_record_survives_its_words() {
        let mut handle = [0u8; 64];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = i as u8 ^ 0xa5;
        }
        let rec = DeviceRecord {
            kind: 2,
            handle,
            offset: 1 << 33,
            len: 12345,
        };
        assert_eq!(DeviceRecord::from_words(&rec.words()), Some(rec));
        let mut w = rec.words();
        w[0] = 256;
        assert_eq!(DeviceRecord::from_words(&w), None);
    }
}

#[cfg(all(test, hyperframes_loom))]
mod loom_models {
    use super::*;
    use crate::loom::sync::UnsafeCell;
    use loom::sync::Arc;

    fn slot() -> DeviceSlot {
        DeviceSlot {
            refs: AtomicU32::new(0),
            _pad: AtomicU32::new(0),
            record: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    fn rec(n: u8) -> DeviceRecord {
        DeviceRecord {
            kind: 1,
            handle: [n; 64],
            offset: u64::from(n),
            len: u64::from(n) * 10,
        }
    }

    /// A slot is lent, its descriptor published; the receiver reads the record, uses the
    /// lent memory and releases the slot, while the sender sweeps, frees the memory (here:
    /// writes it, which loom checks against the receiver's read) and lends the slot again.
    /// The memory is touched by the sender only after the receiver's last use of it, and the
    /// receiver reads the first record whole.
    #[test]
    fn lent_memory_is_freed_only_after_the_receiver_let_go() {
        loom::model(|| {
            let slot = Arc::new(slot());
            // Stands for the descriptor's sequence word (`ring::Slot`).
            let published = Arc::new(AtomicU64::new(0));
            // Stands for the device memory lent.
            let memory = Arc::new(UnsafeCell::new(7u64));
            slot.lend(&rec(1));
            published.store(1, Ordering::Release);
            let (s, p, m) = (slot.clone(), published.clone(), memory.clone());
            let receiver = loom::thread::spawn(move || {
                assert_eq!(p.load(Ordering::Acquire), 1);
                assert_eq!(s.read(), Some(rec(1)));
                // SAFETY: loom's cell checks this read against the sender's write.
                assert_eq!(m.with(|v| unsafe { *v }), 7);
                s.release();
            });
            if slot.is_free() {
                // SAFETY: as above.
                memory.with_mut(|v| unsafe { *v = 0 });
                slot.lend(&rec(2));
            }
            receiver.join().unwrap();
        });
    }
}
