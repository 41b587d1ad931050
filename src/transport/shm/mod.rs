//! `shm://`: two processes on one host exchanging messages through shared memory.
//!
//! `shm://name` rendezvous at `$XDG_RUNTIME_DIR/hyperframes/name.sock` (or
//! `/tmp/hyperframes-<uid>/name.sock`), `shm:///abs/path.sock` at that path. The listener
//! creates a segment per connection (see `segment`) holding a descriptor ring (`ring`) and a
//! body arena (`arena`) per direction, and passes it with two wake sockets over the socket
//! (`rendezvous`); the halves (`conn`) then read and write the segment directly. `desc` is the
//! descriptor format and its checks, sans-IO.
//!
//! Needs a tokio runtime (with I/O enabled) in the caller: the halves park on the wake sockets
//! through `AsyncFd`, and a small task per connection watches the socket.
//!
//! # Trust
//!
//! The peer is another process that maps the same memory and can write any of it at any time.
//! Whatever it does, it cannot make this side read or write outside the segment, hand out one
//! block twice, block a thread, or hold more than a bounded number of descriptors: every
//! descriptor and head is copied out atomically and checked, the allocator's own references
//! live in process memory, wake-ups never block, and external bodies are bounded and checked
//! on arrival. What a misbehaving peer *can* do is corrupt or withhold the messages it sends
//! and stall the connection — as any peer can on any transport.
//!
//! Zero-copy bodies are different: a received `Bytes` that views the peer's arena (or a
//! `Sender::alloc` block of ours that the peer can reach) is only sound if the peer does not
//! write the block while we hold it. So zero-copy views are used only with a peer trusted not
//! to (`ContextBuilder::shm_zero_copy`); by default that is a peer of the same user — which
//! could write our memory through `/proc/<pid>/mem` or `ptrace` anyway — and not one accepted
//! with `shm_allow_any_user`. Without zero copy, bodies are copied out on receive (with atomic
//! loads) and `alloc` lends heap memory. Bodies larger than the arena travel as memfds sealed
//! against writing, immutable either way.

mod arena;
#[cfg(not(hyperframes_loom))]
pub mod bench_support;
mod conn;
pub(crate) mod desc;
mod device;
mod rendezvous;
pub(crate) mod ring;
mod segment;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::sync::{Semaphore, mpsc};

use super::{AcceptHalf, Config, Open, Parts};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::heartbeat::Liveness;
use conn::{Setup, Shared, ShmReceiver, ShmSender};
use rendezvous::Hello;
/// A shared mapping of a file (the stand-in device maps its memfds with it).
#[cfg(feature = "cuda")]
pub(crate) use segment::Mapping;
use segment::{Geometry, Segment};

/// Handshakes a listener runs at once; further connections wait in the kernel's backlog. Each
/// costs a segment (sparse until used) and four descriptors until it completes or times out.
const HANDSHAKES: usize = 32;

fn runtime() -> Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        Error::new(
            ErrorKind::Unavailable,
            "shm:// needs a tokio runtime in the caller (it parks on eventfds with tokio's AsyncFd)",
        )
    })
}

/// The socket path of `shm://name` (a name, or an absolute path).
fn socket_path(name: &str) -> Result<PathBuf> {
    if name.starts_with('/') {
        return Ok(PathBuf::from(name));
    }
    Ok(rendezvous::runtime_dir()?.join(format!("{name}.sock")))
}

/// `shm://`'s settings of a context (set through `ContextBuilder::shm_*`).
#[derive(Clone, Debug)]
pub(crate) struct ShmConfig {
    /// Descriptors per direction of the segments this side creates (a power of two).
    pub(crate) ring_entries: u32,
    /// Body arena bytes per direction (a multiple of 4 KiB).
    pub(crate) arena_bytes: u64,
    /// Peers of any user admitted, not only this process's own.
    pub(crate) any_uid: bool,
    /// Zero-copy views of shared memory; `None`: for same-user peers only.
    pub(crate) zero_copy: Option<bool>,
    /// Device bodies the peer lends are mapped (CUDA IPC); `None`: as `zero_copy`.
    #[cfg(feature = "cuda")]
    pub(crate) cuda_ipc: Option<bool>,
}

impl Default for ShmConfig {
    fn default() -> ShmConfig {
        ShmConfig {
            ring_entries: 4096,
            arena_bytes: 32 << 20,
            any_uid: false,
            zero_copy: None,
            #[cfg(feature = "cuda")]
            cuda_ipc: None,
        }
    }
}

impl ShmConfig {
    /// Checked by `ContextBuilder::build`.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::new(ErrorKind::Config, what));
        if !self.ring_entries.is_power_of_two() || self.ring_entries > 1 << 20 {
            return bad(format!(
                "shm ring entries is {}; use a power of two up to 2^20",
                self.ring_entries
            ));
        }
        if self.arena_bytes < 4096
            || !self.arena_bytes.is_multiple_of(4096)
            || self.arena_bytes > 1 << 40
        {
            return bad(format!(
                "shm arena is {} bytes; use a multiple of 4096 between 4 KiB and 1 TiB",
                self.arena_bytes
            ));
        }
        Ok(())
    }
}

fn geometry(cfg: &Config) -> Geometry {
    Geometry {
        ring_entries: cfg.shm.ring_entries,
        arena_len: cfg.shm.arena_bytes,
    }
}

fn parts(
    sh: Arc<Shared>,
    cfg: &Config,
    url: &str,
    peer_limits: crate::message::Limits,
    peer: String,
) -> Parts {
    Parts {
        tx: Box::new(ShmSender::new(sh.clone(), cfg.linger, cfg.count.clone())),
        rx: Box::new(ShmReceiver::new(sh, cfg.limits, maps_device_bodies(cfg))),
        transport: "shm",
        local: url.to_owned(),
        peer,
        peer_limits,
        peer_identity: None,
        keepalive: None,
        setup: super::ChannelSetup::new(cfg, false),
    }
}

/// Whether device bodies the peer lends are mapped (CUDA IPC): like zero copy, memory the
/// peer can write is handed to the application.
fn maps_device_bodies(cfg: &Config) -> bool {
    #[cfg(feature = "cuda")]
    return cfg.shm.cuda_ipc.unwrap_or_else(|| zero_copy(cfg));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = cfg;
        false
    }
}

/// Whether bodies are zero-copy views of shared memory (see *Trust*).
fn zero_copy(cfg: &Config) -> bool {
    cfg.shm.zero_copy.unwrap_or(!cfg.shm.any_uid)
}

/// `shm://` in the scheme table.
pub(crate) static SHM: Open = Open {
    connect: |t, a| Box::pin(async move { connect(a.as_name()?, t.config()).await }),
    bind: |t, a| Box::pin(async move { bind(a.as_name()?, t.config()).await }),
};

pub(crate) async fn connect(name: &str, cfg: &Config) -> Result<Parts> {
    runtime()?;
    let url = format!("shm://{name}");
    let path = socket_path(name)?;
    let uds = tokio::net::UnixStream::connect(&path).await.map_err(|e| {
        let kind = e.kind();
        let err = Error::io(format!("connecting to {url} ({})", path.display()), e);
        if kind == std::io::ErrorKind::NotFound {
            Error::new(
                ErrorKind::ConnectionRefused,
                format!(
                    "nothing listens at {url} ({} does not exist)",
                    path.display()
                ),
            )
        } else {
            err
        }
    })?;
    let cred = rendezvous::check_peer(&uds, cfg.shm.any_uid)?;
    let (hello, fds) =
        tokio::time::timeout(cfg.handshake_timeout, rendezvous::connector_hello(&uds))
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "no shm handshake from {url} within {:?}",
                        cfg.handshake_timeout
                    ),
                )
            })??;
    let [memfd, data, space]: [std::os::fd::OwnedFd; 3] = fds.try_into().map_err(|v: Vec<_>| {
        Error::new(
            ErrorKind::Protocol,
            format!("shm handshake: expected 3 descriptors, got {}", v.len()),
        )
    })?;
    rendezvous::check_wake_socket(&data)?;
    rendezvous::check_wake_socket(&space)?;
    let seg = Segment::open(memfd)?;
    rendezvous::answer(&uds, Hello::new(cfg)).await?;
    let peer = format!("{url}#pid{}", cred.pid.as_raw_nonzero());
    let sh = Shared::start(Setup {
        seg,
        out_dir: 1,
        data,
        space,
        uds,
        busy_poll: cfg.busy_poll,
        zero_copy: zero_copy(cfg),
        limits: cfg.limits,
        live: Liveness::new(cfg, true, hello.heartbeat()),
        peer: peer.clone(),
        peer_pid: cred.pid.as_raw_nonzero().get() as u32,
    })?;
    Ok(parts(sh, cfg, &url, hello.limits, peer))
}

pub(crate) async fn bind(name: &str, cfg: &Config) -> Result<(Box<dyn AcceptHalf>, String)> {
    let rt = runtime()?;
    let url = format!("shm://{name}");
    let path = socket_path(name)?;
    let (listener, file) = rendezvous::bind(&path, cfg.shm.any_uid)?;
    let (tx, rx) = mpsc::channel(cfg.accept_backlog);
    let rejected = Arc::new(AtomicU64::new(0));
    let (cfg, counter, spawner, local) = (cfg.clone(), rejected.clone(), rt.clone(), url.clone());
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES));
    rt.spawn(async move {
        loop {
            // A permit per connection until it is handed over (or refused): bounds the
            // handshakes in progress and the connections waiting for `accept`.
            let permit = tokio::select! {
                () = tx.closed() => return,
                p = handshakes.clone().acquire_owned() => p.expect("never closed"),
            };
            let accepted = tokio::select! {
                () = tx.closed() => return,
                r = listener.accept() => r,
            };
            let uds = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(url = %local, "accept failed: {e:#}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (tx, cfg, counter, local) =
                (tx.clone(), cfg.clone(), counter.clone(), local.clone());
            spawner.spawn(async move {
                let _permit = permit;
                match accept(uds, &cfg, &local).await {
                    Ok(parts) => {
                        let _ = tx.send(parts).await;
                    }
                    Err(e) => {
                        counter.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(url = %local, "rejected shared-memory connection: {e:#}");
                    }
                }
            });
        }
    });
    // The socket file goes with the listener: dropping it frees the name at once.
    Ok((
        Box::new(ShmAccept {
            rx,
            rejected,
            _file: file,
        }),
        url,
    ))
}

async fn accept(uds: tokio::net::UnixStream, cfg: &Config, url: &str) -> Result<Parts> {
    let cred = rendezvous::check_peer(&uds, cfg.shm.any_uid)?;
    let (seg, memfd) = Segment::create(geometry(cfg))?;
    let (data, data_theirs) = rendezvous::wake_pair()?;
    let (space, space_theirs) = rendezvous::wake_pair()?;
    let theirs = {
        use std::os::fd::AsFd;
        let fds = [memfd.as_fd(), data_theirs.as_fd(), space_theirs.as_fd()];
        tokio::time::timeout(
            cfg.handshake_timeout,
            rendezvous::listener_hello(&uds, Hello::new(cfg), &fds),
        )
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::TimedOut,
                format!("no shm handshake answer within {:?}", cfg.handshake_timeout),
            )
        })??
    };
    // The peer's ends are the peer's alone from here on.
    drop((memfd, data_theirs, space_theirs));
    let peer = format!("{url}#pid{}", cred.pid.as_raw_nonzero());
    let sh = Shared::start(Setup {
        seg,
        out_dir: 0,
        data,
        space,
        uds,
        busy_poll: cfg.busy_poll,
        zero_copy: zero_copy(cfg),
        limits: cfg.limits,
        live: Liveness::new(cfg, true, theirs.heartbeat()),
        peer: peer.clone(),
        peer_pid: cred.pid.as_raw_nonzero().get() as u32,
    })?;
    Ok(parts(sh, cfg, url, theirs.limits, peer))
}

struct ShmAccept {
    rx: mpsc::Receiver<Parts>,
    rejected: Arc<AtomicU64>,
    _file: rendezvous::SocketFile,
}

impl AcceptHalf for ShmAccept {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        self.rx.poll_recv(cx).map(|p| {
            p.ok_or_else(|| {
                Error::new(
                    ErrorKind::Unavailable,
                    "the shm listener's accept task has stopped (its runtime shut down)",
                )
            })
        })
    }

    fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}
