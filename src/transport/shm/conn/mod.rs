//! The halves of a shared-memory connection: the state they share and the watcher task
//! (here), the sending half (`send`), the receiving half (`recv`); the descriptor format and
//! its checks are the sans-IO `desc` module beside. The `Sender` is the producer of its direction
//! and writes straight into the segment; the `Receiver` is the consumer of the other and
//! reads straight out of it: no I/O thread, no copy beyond the one into the arena (none for
//! bodies allocated in place), no system call per message under load.
//!
//! Waiting: a side that finds no data (Receiver) or no room (Sender) spins briefly, then
//! announces it sleeps and parks on its end of a wake socket pair through tokio's `AsyncFd`;
//! the other side sends a byte there only when the flag is up. `busy_poll` never parks. Wakes
//! from this process (a lease released, the peer gone, an external body arrived) go through
//! `AtomicWaker`s. A watcher task reads the rendezvous socket: memfds of external bodies
//! arrive there (checked and mapped on arrival, at most [`MAX_EXTERNAL`] at a time), and its
//! EOF means the peer process is gone.
//!
//! What the peer can do to us: write any byte of the segment at any time, and send anything
//! on the sockets. Every descriptor is copied out with atomic loads and checked
//! (`desc::check`) before anything is read through it; heads are copied out with atomic loads
//! before they are parsed; our allocator keeps its own references in process memory
//! (`arena::Hold`); our wake-ups cannot block (`MSG_DONTWAIT` on our own end of the socket
//! pairs). Bodies are zero-copy views of the arena only when `zero_copy` (the peer is trusted
//! not to write blocks it handed over); otherwise they are copied out on receive and
//! `Sender::alloc` lends heap memory.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;
use rustix::fs::SealFlags;
use rustix::net::{RecvFlags, SendFlags};
use tokio::io::Interest;
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::net::UnixStream;

use super::rendezvous::{self, ExtRecord};
use super::ring::{self, RingStore};
use super::segment::{Mapping, Segment, ShmRing};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;
use crate::transport::heartbeat::{Liveness, Tick};

#[cfg(feature = "cuda")]
mod lend;
mod recv;
mod send;

pub(crate) use recv::ShmReceiver;
pub(crate) use send::ShmSender;

/// External bodies (memfds) in flight per direction: sent and not yet released by the
/// receiver. The receiver fails a peer that sends more.
pub(crate) const MAX_EXTERNAL: u64 = 8;
/// Wake-up messages drained per wake (a flooding peer cannot keep us draining).
const WAKE_DRAIN: usize = 16;

/// What both halves (and the leases they hand out) share.
pub(crate) struct Shared {
    seg: Arc<Segment>,
    out_dir: usize,
    in_dir: usize,
    /// Our end of the data pair: our Receiver parks on it; our Sender wakes the peer's
    /// Receiver through it.
    data: AsyncFd<OwnedFd>,
    /// Our end of the space pair: our Sender parks on it; our Receiver (and its leases) wake
    /// the peer's Sender through it.
    space: AsyncFd<OwnedFd>,
    /// Wakes our Receiver from this process.
    rx_waker: AtomicWaker,
    /// Wakes our Sender from this process.
    tx_waker: AtomicWaker,
    uds: UnixStream,
    peer_gone: AtomicBool,
    /// Set when this side failed the connection for a protocol violation.
    fault: OnceLock<String>,
    /// Set when this side declared the peer lost: it stopped beating.
    silent: OnceLock<Error>,
    live: Liveness,
    external: Mutex<ExternalIn>,
    halves: AtomicU32,
    done: tokio::sync::Notify,
    busy_poll: bool,
    zero_copy: bool,
    max_body: u64,
    peer: String,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    peer_pid: u32,
    /// Device bodies lent to the peer (CUDA IPC), by slot of our direction's device table.
    #[cfg(feature = "cuda")]
    lent: Mutex<lend::Lent>,
    /// Told when the first body is lent: the watcher listens for releases from then on.
    #[cfg(feature = "cuda")]
    lending_changed: tokio::sync::Notify,
}

/// External bodies received: mapped, waiting for their descriptors.
#[derive(Default)]
struct ExternalIn {
    queue: VecDeque<(u64, Mapping)>,
    /// The sequence number the next one must carry.
    next_seq: u64,
    /// Received and not yet released (queued or held by the application).
    outstanding: u64,
}

/// How a connection's shared state is set up.
pub(crate) struct Setup {
    pub(crate) seg: Arc<Segment>,
    /// 0 for the listener.
    pub(crate) out_dir: usize,
    /// Our ends of the data and space wake pairs.
    pub(crate) data: OwnedFd,
    pub(crate) space: OwnedFd,
    pub(crate) uds: UnixStream,
    pub(crate) busy_poll: bool,
    pub(crate) zero_copy: bool,
    pub(crate) limits: Limits,
    /// Heartbeats, as both hellos settled them.
    pub(crate) live: Liveness,
    pub(crate) peer: String,
    /// The peer process (its credentials on the socket).
    pub(crate) peer_pid: u32,
}

/// Wakes the peer through our end of a wake pair: never blocks. A full queue means a wake-up
/// is pending anyway; a closed peer is the watcher's to report.
fn wake(fd: &AsyncFd<OwnedFd>) {
    let _ = rustix::net::send(
        fd.get_ref(),
        &[1],
        SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
    );
}

impl Shared {
    /// Builds the halves' shared state. Registers the wake sockets with the current tokio
    /// runtime and starts the watcher on it.
    pub(crate) fn start(s: Setup) -> Result<Arc<Shared>> {
        let register = |fd: OwnedFd| {
            // SAFETY: an `OwnedFd` is a valid open descriptor that it never replaces, and it
            // stays inside the `AsyncFd` (never taken out) until the `AsyncFd` drops.
            unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| Error::io("registering a wake socket", e.into()))
        };
        let sh = Arc::new(Shared {
            out_dir: s.out_dir,
            in_dir: 1 - s.out_dir,
            seg: s.seg,
            data: register(s.data)?,
            space: register(s.space)?,
            rx_waker: AtomicWaker::new(),
            tx_waker: AtomicWaker::new(),
            uds: s.uds,
            peer_gone: AtomicBool::new(false),
            fault: OnceLock::new(),
            silent: OnceLock::new(),
            live: s.live,
            external: Mutex::new(ExternalIn::default()),
            halves: AtomicU32::new(2),
            done: tokio::sync::Notify::new(),
            busy_poll: s.busy_poll,
            zero_copy: s.zero_copy,
            max_body: s.limits.max_body,
            peer: s.peer,
            peer_pid: s.peer_pid,
            #[cfg(feature = "cuda")]
            lent: Mutex::default(),
            #[cfg(feature = "cuda")]
            lending_changed: tokio::sync::Notify::new(),
        });
        tokio::spawn(watch(sh.clone()));
        Ok(sh)
    }

    fn out_ring(&self) -> ShmRing {
        self.seg.ring(self.out_dir)
    }

    fn in_ring(&self) -> ShmRing {
        self.seg.ring(self.in_dir)
    }

    fn gone(&self) -> bool {
        self.peer_gone.load(Ordering::Acquire)
    }

    /// The peer is gone (or failed): both halves are woken to report it.
    fn mark_gone(&self) {
        self.peer_gone.store(true, Ordering::Release);
        self.rx_waker.wake();
        self.tx_waker.wake();
    }

    /// Fails the connection for a protocol violation: the peer sees our end of the socket
    /// close, our halves report `why`.
    fn fail(&self, why: String) {
        tracing::warn!(peer = %self.peer, "closing shared-memory channel: {why}");
        let _ = self.fault.set(why);
        // Our side only: the peer sees it close; its closing, in turn, is what says it let go
        // of what we lent it.
        let _ = rustix::net::shutdown(&self.uds, rustix::net::Shutdown::Write);
        self.mark_gone();
    }

    /// The error a half reports once the peer is gone.
    fn gone_error(&self, what: &str) -> Error {
        if let Some(e) = self.silent.get() {
            return e.duplicate();
        }
        match self.fault.get() {
            Some(why) => corrupt(why),
            None => Error::new(
                ErrorKind::ConnectionLost,
                format!(
                    "the shared-memory peer {} {what} (did it exit or crash?)",
                    self.peer
                ),
            ),
        }
    }

    fn lock_external(&self) -> std::sync::MutexGuard<'_, ExternalIn> {
        self.external.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The peer's Sender may wait for room in our incoming direction.
    fn wake_peer_sender(&self) {
        if ring::wake_needed(&self.in_ring().control().producer_sleeping) {
            wake(&self.space);
        }
    }

    /// Checks and maps an external body announced on the socket.
    fn accept_external(&self, record: &[u8; ExtRecord::LEN], fd: Option<OwnedFd>) -> Result<()> {
        let rec = ExtRecord::decode(record)
            .ok_or_else(|| corrupt("malformed record on the rendezvous socket"))?;
        let fd = fd.ok_or_else(|| corrupt("an external-body record without its memfd"))?;
        let mut ext = self.lock_external();
        if ext.outstanding >= MAX_EXTERNAL {
            return Err(corrupt(format!(
                "more than {MAX_EXTERNAL} external bodies in flight"
            )));
        }
        if rec.seq != ext.next_seq {
            return Err(corrupt(format!(
                "external body {} where {} was expected",
                rec.seq, ext.next_seq
            )));
        }
        if rec.len == 0 || rec.len > self.max_body {
            return Err(corrupt(format!(
                "external body of {} bytes (max_body {})",
                rec.len, self.max_body
            )));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| corrupt("external body is not a memfd"))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE) {
            return Err(corrupt("external body memfd is not sealed"));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| Error::io("inspecting an external body", e.into()))?
            .st_size as u64;
        if size != rec.len {
            return Err(corrupt(format!(
                "external body is {size} bytes, announced {}",
                rec.len
            )));
        }
        let map = Mapping::new(&fd, rec.len, false)
            .map_err(|e| Error::io("mapping an external body", e))?;
        ext.queue.push_back((rec.seq, map));
        ext.next_seq += 1;
        ext.outstanding += 1;
        Ok(())
    }
}

/// Reads the rendezvous socket: external bodies' memfds, and EOF (the peer process is gone).
/// Beats our heartbeat counter in the segment and watches the peer's: a peer process that is
/// alive but not running (stopped, deadlocked, its runtime blocked) keeps its socket open and
/// its memory mapped, and is found only by its counter standing still. While device bodies
/// are lent (feature `cuda`) it also listens on the space socket, where the peer says it
/// released one, and drops our reference to each released body.
async fn watch(sh: Arc<Shared>) {
    let ended = watch_peer(&sh).await;
    if let Ended::Peer = ended {
        sh.mark_gone();
    }
    // Our halves may be gone, or the connection failed, while the peer still maps bodies we
    // lent: they are kept until it gives them back or its end of the socket closes.
    #[cfg(feature = "cuda")]
    linger(&sh).await;
    if let Ended::Peer = ended {
        // Nothing reads the socket from here on: what the peer still sends fails at once
        // instead of filling the socket and blocking it.
        let _ = rustix::net::shutdown(&sh.uds, rustix::net::Shutdown::Read);
    }
}

/// Why the watcher stopped watching.
enum Ended {
    /// Our last half was dropped.
    Halves,
    /// The peer is gone, silent or failed.
    Peer,
}

async fn watch_peer(sh: &Shared) -> Ended {
    let mut record = [0u8; ExtRecord::LEN];
    let mut got = 0;
    let mut fds = Vec::new();
    let mut tick = Tick::new(sh.live.active().then_some(sh.live.tick).flatten());
    let mut silence = sh.live.silence(std::time::Instant::now());
    loop {
        #[cfg(feature = "cuda")]
        let lending = sh.lending();
        #[cfg(not(feature = "cuda"))]
        let lending = false;
        tokio::select! {
            () = sh.done.notified() => return Ended::Halves,
            r = sh.uds.readable() => if r.is_err() { return Ended::Peer },
            () = lent_changed(sh) => continue,
            r = sh.space.readable(), if lending => {
                let Ok(mut guard) = r else { return Ended::Peer };
                let open = take_releases(sh, &mut guard);
                // Drained here, so the Sender (parked on the same socket, or about to) is
                // woken in process: it registered before it looked for room.
                sh.tx_waker.wake();
                if !open {
                    return Ended::Peer;
                }
                continue;
            }
            () = tick.next() => {
                if sh.live.send_every.is_some() {
                    sh.out_ring().control().beat.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(s) = &mut silence {
                    let beat = sh.in_ring().control().beat.load(Ordering::Relaxed);
                    if let Err(silent) = s.check(std::time::Instant::now(), beat, true) {
                        let who = format!("the shared-memory peer {}", sh.peer);
                        let e = sh.live.lost(&who, silent);
                        tracing::warn!(peer = %sh.peer, "closing shared-memory channel: {e:#}");
                        let _ = sh.silent.set(e);
                        // Our side only: its closing is what says the peer let go of what
                        // we lent it.
                        let _ = rustix::net::shutdown(&sh.uds, rustix::net::Shutdown::Write);
                        return Ended::Peer;
                    }
                }
                continue;
            }
        }
        // At most one descriptor per record: the kernel closes any more that come along.
        let room = usize::from(fds.is_empty());
        let res = sh.uds.try_io(Interest::READABLE, || {
            rendezvous::recv_once(sh.uds.as_fd(), &mut record[got..], &mut fds, room)
                .map_err(Into::into)
        });
        match res {
            // The peer closed its end (`linger` sees it too, and lets go of what was lent).
            Ok(0) => return Ended::Peer,
            Ok(n) => {
                got += n;
                if got == ExtRecord::LEN {
                    got = 0;
                    if let Err(e) = sh.accept_external(&record, fds.pop()) {
                        sh.fail(e.to_string());
                        return Ended::Peer;
                    }
                    sh.rx_waker.wake();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return Ended::Peer,
        }
    }
}

/// Takes the peer's wake-ups on the space socket and drops what it released (while bodies
/// are lent). False when the peer's end of the pair closed.
fn take_releases(sh: &Shared, guard: &mut AsyncFdReadyGuard<'_, OwnedFd>) -> bool {
    let drained = drain(sh, guard.get_inner());
    if drained == Some(true) {
        guard.clear_ready();
    }
    #[cfg(feature = "cuda")]
    sh.sweep_lent();
    drained.is_some()
}

/// While bodies are lent after the connection ended for us: sweeps what the peer gives
/// back, lets go of everything when its socket closes (its process, or its last mapping, is
/// gone). What it still sends on the socket is read and dropped (descriptors passed along
/// are closed by the kernel: no room for them).
#[cfg(feature = "cuda")]
async fn linger(sh: &Shared) {
    let mut buf = [0u8; 512];
    while sh.lending() {
        tokio::select! {
            r = sh.uds.readable() => {
                if r.is_err() {
                    break;
                }
                let res = sh.uds.try_io(Interest::READABLE, || {
                    rustix::net::recv(sh.uds.as_fd(), &mut buf, RecvFlags::DONTWAIT)
                        .map(|(n, _)| n)
                        .map_err(Into::into)
                });
                match res {
                    Ok(0) => break,
                    Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => break,
                    _ => {}
                }
            }
            r = sh.space.readable() => {
                let Ok(mut guard) = r else { break };
                if !take_releases(sh, &mut guard) {
                    break;
                }
            }
        }
    }
    sh.release_all_lent();
}

/// Waits for a wake-up on one of our wake sockets: Ready once one came (drained). A closed
/// peer end means the peer is gone.
fn poll_wake(sh: &Shared, fd: &AsyncFd<OwnedFd>, cx: &mut Context<'_>) -> Poll<Result<()>> {
    match fd.poll_read_ready(cx) {
        Poll::Ready(Ok(mut guard)) => {
            if drain(sh, fd.get_ref()) == Some(true) {
                guard.clear_ready();
            }
            // The caller looks again; a spurious wake-up is harmless.
            Poll::Ready(Ok(()))
        }
        Poll::Ready(Err(e)) => Poll::Ready(Err(Error::io("waiting on a wake socket", e))),
        Poll::Pending => Poll::Pending,
    }
}

/// Reads up to [`WAKE_DRAIN`] wake-ups from one of our wake sockets: `Some(true)` when it is
/// empty now (its readiness may be cleared), `Some(false)` when more may wait, `None` when
/// the peer's end closed (the peer is marked gone).
fn drain(sh: &Shared, fd: &OwnedFd) -> Option<bool> {
    let mut buf = [0u8; 8];
    for _ in 0..WAKE_DRAIN {
        match rustix::net::recv(fd, &mut buf[..], RecvFlags::DONTWAIT) {
            Ok((0, _)) => {
                sh.mark_gone();
                return None;
            }
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => return Some(true),
            Err(_) => {
                sh.mark_gone();
                return None;
            }
        }
    }
    Some(false)
}

/// Completes when the first device body is lent (never without the feature).
#[cfg(feature = "cuda")]
async fn lent_changed(sh: &Shared) {
    sh.lending_changed.notified().await;
}

#[cfg(not(feature = "cuda"))]
async fn lent_changed(_: &Shared) {
    std::future::pending::<()>().await;
}

fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("the shared-memory peer broke the protocol: {what}"),
    )
}

impl Shared {
    /// One half is dropped; the watcher stops with the last.
    fn half_dropped(&self) {
        if self.halves.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }
}
