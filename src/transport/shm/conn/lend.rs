//! Device bodies lent to the peer through CUDA IPC (feature `cuda`; the protocol is in
//! `shm::device`): what the sender keeps until the receiver is done, and the receiver's
//! mapping that says so when it drops.

use std::sync::Arc;

use super::{Shared, corrupt, wake};
use crate::device::{DeviceBody, Gpu, IPC_CUDA, IpcHandle};
use crate::error::{Error, Result};
use crate::message::Body;
use crate::transport::shm::device::{DEVICE_SLOTS, DeviceRecord};

/// The sender's references to the bodies it lent, by slot: a body stays allocated until the
/// receiver has released its slot (or is gone).
pub(super) struct Lent {
    bodies: Vec<Option<DeviceBody>>,
    in_use: usize,
}

impl Default for Lent {
    fn default() -> Lent {
        Lent {
            bodies: vec![None; DEVICE_SLOTS],
            in_use: 0,
        }
    }
}

impl Shared {
    fn lock_lent(&self) -> std::sync::MutexGuard<'_, Lent> {
        self.lent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops the bodies whose slots the receiver released. Returns the slots free now.
    pub(super) fn sweep_lent(&self) -> usize {
        let table = self.out_ring();
        let table = table.devices();
        let mut done = Vec::new();
        let free = {
            let mut lent = self.lock_lent();
            if lent.in_use > 0 {
                for (i, b) in lent.bodies.iter_mut().enumerate() {
                    if b.is_some() && table.is_free(i) {
                        done.extend(b.take());
                    }
                }
                lent.in_use -= done.len();
            }
            DEVICE_SLOTS - lent.in_use
        };
        // Freed outside the lock: a device free may wait for the device.
        drop(done);
        free
    }

    /// True while bodies are lent: the watcher then listens for releases.
    pub(super) fn lending(&self) -> bool {
        self.lock_lent().in_use > 0
    }

    /// The receiver is gone: whatever it mapped is unmapped with its process or its channel.
    pub(super) fn release_all_lent(&self) {
        let bodies = std::mem::take(&mut *self.lock_lent());
        drop(bodies);
    }

    /// Lends `body` in a free slot, under `rec`. The caller reserved the slot
    /// ([`ShmSender`](super::ShmSender)'s `takes_device`), so one is free unless the peer
    /// wrote counts it was never lent.
    pub(super) fn lend(&self, body: &DeviceBody, rec: &DeviceRecord) -> Result<u64> {
        let ring = self.out_ring();
        let table = ring.devices();
        let mut lent = self.lock_lent();
        let slot = (0..DEVICE_SLOTS)
            .find(|&i| lent.bodies[i].is_none() && table.is_free(i))
            .ok_or_else(|| corrupt("the peer holds device-table slots it was never lent"))?;
        table.lend(slot, rec);
        lent.bodies[slot] = Some(body.clone());
        lent.in_use += 1;
        let first = lent.in_use == 1;
        drop(lent);
        if first {
            // The watcher listens for releases from now on.
            self.lending_changed.notify_one();
        }
        Ok(slot as u64)
    }
}

/// How long a sender whose receiver holds every slot waits for one before it stages.
const LEND_WAIT: std::time::Duration = std::time::Duration::from_micros(200);

/// The sender's side: `Some(record)` when `body` can be lent to the receiver now (it maps
/// this kind of device memory, a slot is free beyond the `reserved` ones, the device exports
/// it); `None` to stage it. Says once per channel why a body is staged.
pub(super) fn prepare(
    sh: &Shared,
    body: &DeviceBody,
    reserved: usize,
    told: &mut Told,
) -> Option<DeviceRecord> {
    let backend = body.gpu().backend();
    let kind = backend.ipc_kind();
    if kind == 0 || body.is_empty() || sh.out_ring().devices().landing() != kind {
        return None;
    }
    if kind == IPC_CUDA && sh.peer_pid == std::process::id() {
        // CUDA does not open a handle in the process that made it.
        if !told.same_process {
            told.same_process = true;
            tracing::info!(
                peer = %sh.peer,
                path = "staged",
                "the shm:// peer is this process, where CUDA IPC does not open: device bodies \
                 are staged (use inproc:// within a process)"
            );
        }
        return None;
    }
    // A receiver that drops bodies as fast as they come frees a slot within microseconds: wait
    // that long for one (its count is read straight from the table) before staging.
    let Ok(freed) = crate::transport::spin_until(LEND_WAIT, || {
        Ok::<_, std::convert::Infallible>(sh.sweep_lent() > reserved)
    });
    if !freed {
        if !told.full {
            told.full = true;
            tracing::warn!(
                peer = %sh.peer,
                lent = DEVICE_SLOTS,
                "the receiver holds {DEVICE_SLOTS} device bodies lent over CUDA IPC: further \
                 ones are staged through host memory until it drops some"
            );
        }
        return None;
    }
    match backend.export(body.mem()) {
        Ok(h) => {
            if !told.lent {
                told.lent = true;
                tracing::info!(
                    peer = %sh.peer,
                    path = "cuda-ipc",
                    "device bodies to this peer are lent over CUDA IPC: they stay on the device"
                );
            }
            Some(DeviceRecord {
                kind: h.kind,
                handle: h.handle,
                offset: h.offset,
                len: h.len,
            })
        }
        Err(e) => {
            if !told.export {
                told.export = true;
                tracing::warn!(
                    peer = %sh.peer,
                    error = %e,
                    "a device body could not be lent over CUDA IPC: it is staged through host \
                     memory (see hyperframes::device for what can be lent)"
                );
            }
            None
        }
    }
}

/// What the sender has said about its device bodies, to say each once.
#[derive(Default)]
pub(super) struct Told {
    lent: bool,
    same_process: bool,
    full: bool,
    export: bool,
}

/// The receiver's side: where device bodies land, and the devices that map lent ones.
pub(super) struct Landing {
    /// Lent bodies may be mapped at all (`ContextBuilder::shm_cuda_ipc`).
    allowed: bool,
    /// Where the application wants bodies sent from device memory.
    now: Option<Gpu>,
    /// By kind of handle, the last device this side told the peer it maps: bodies the peer
    /// lent before a change of landing are mapped with it.
    maps: [Option<Gpu>; 3],
}

impl Landing {
    pub(super) fn new(allowed: bool) -> Landing {
        Landing {
            allowed,
            now: None,
            maps: Default::default(),
        }
    }

    /// The application changed where bodies land: the peer is told which kind this side maps.
    pub(super) fn set(&mut self, sh: &Shared, gpu: Option<&Gpu>) {
        let kind = gpu
            .filter(|_| self.allowed)
            .map_or(0, |g| g.backend().ipc_kind());
        if let Some(slot) = self.maps.get_mut(usize::from(kind)).filter(|_| kind != 0) {
            *slot = gpu.cloned();
        }
        self.now = gpu.cloned();
        sh.in_ring().devices().set_landing(kind);
    }

    /// The body lent in `slot`, `len` bytes long (a checked descriptor's), as a message body:
    /// device memory mapped from the peer, or a copy in host memory when this side lands
    /// bodies there now.
    pub(super) fn take(&self, sh: &Arc<Shared>, slot: usize, len: u64) -> Result<Body> {
        // Given back to the peer when this drops: on every error below too.
        let borrowed = Borrowed {
            sh: sh.clone(),
            slot,
        };
        let rec = sh
            .in_ring()
            .devices()
            .read(slot)
            .filter(|r| r.len == len)
            .ok_or_else(|| {
                corrupt(format!(
                    "device-table slot {slot} does not hold a body of {len} bytes"
                ))
            })?;
        let gpu = self
            .maps
            .get(usize::from(rec.kind))
            .and_then(Option::as_ref)
            .filter(|_| rec.kind != 0)
            .ok_or_else(|| {
                corrupt(format!(
                    "a device body of kind {} lent, which this side never said it maps",
                    rec.kind
                ))
            })?;
        let handle = IpcHandle {
            kind: rec.kind,
            handle: rec.handle,
            offset: rec.offset,
            len: rec.len,
        };
        let body =
            crate::device::import(gpu, &handle, sh.peer_pid, Box::new(borrowed)).map_err(|e| {
                // Nothing more is lent to a side that cannot map it (what is in flight fails
                // the same way).
                sh.in_ring().devices().set_landing(0);
                let what = format!(
                    "a device body of {len} bytes lent by {} over CUDA IPC could not be mapped \
                     on {gpu:?}, so the channel ends (a receiver that lands in host memory gets \
                     bodies staged instead)",
                    sh.peer
                );
                tracing::error!(peer = %sh.peer, error = %e, "{what}");
                Error::new(e.kind(), what).with_source(e)
            })?;
        if self.now.is_none() {
            // Host memory was asked for since the peer lent it: copy, and give it back.
            return Ok(Body::from(body.to_host()?));
        }
        Ok(Body::from(body))
    }
}

/// A slot of the peer's device table this side maps: released when the mapping is closed.
struct Borrowed {
    sh: Arc<Shared>,
    slot: usize,
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        self.sh.in_ring().devices().release(self.slot);
        // The peer's watcher drops its reference now (it listens while it lends).
        wake(&self.sh.space);
    }
}
