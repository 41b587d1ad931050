//! `shm://`: two processes on one host exchanging messages through shared memory.
//!
//! `shm://name` rendezvous at `$XDG_RUNTIME_DIR/hyperframes/name.sock` (or
//! `/tmp/hyperframes-<uid>/name.sock`), `shm:///abs/path.sock` at that path. The listener
//! creates a segment per connection (see `segment`) holding a descriptor ring (`ring`) and a
//! body arena (`arena`) per direction, and passes it with the eventfds over the socket
//! (`rendezvous`); the halves (`conn`) then read and write the segment directly.
//!
//! Needs a tokio runtime (with I/O enabled) in the caller: the halves park on eventfds
//! through `AsyncFd`, and a small task per connection watches the socket.

mod arena;
mod conn;
mod rendezvous;
pub(crate) mod ring;
mod segment;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::sync::mpsc;

use super::{AcceptHalf, Config, Parts};
use crate::error::Result;
use crate::{Error, ErrorKind};
use conn::{Eventfds, Shared, ShmReceiver, ShmSender};
use rendezvous::Hello;
use segment::{Geometry, Segment};

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

fn geometry(cfg: &Config) -> Geometry {
    Geometry {
        ring_entries: cfg.shm_ring_entries,
        arena_len: cfg.shm_arena_bytes,
    }
}

fn parts(
    sh: Arc<Shared>,
    cfg: &Config,
    url: &str,
    peer_limits: crate::Limits,
    peer: String,
) -> Parts {
    Parts {
        tx: Box::new(ShmSender::new(sh.clone())),
        rx: Box::new(ShmReceiver::new(sh, cfg.limits)),
        transport: "shm",
        local: url.to_owned(),
        peer,
        peer_limits,
        keepalive: None,
    }
}

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
    let cred = rendezvous::check_peer(&uds, cfg.shm_any_uid)?;
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
    let [memfd, a, b, c, d]: [std::os::fd::OwnedFd; 5] = fds.try_into().map_err(|v: Vec<_>| {
        Error::new(
            ErrorKind::Protocol,
            format!("shm handshake: expected 5 descriptors, got {}", v.len()),
        )
    })?;
    let seg = Segment::open(memfd)?;
    rendezvous::answer(&uds, Hello { limits: cfg.limits }).await?;
    let peer = format!("{url}#pid{}", cred.pid.as_raw_nonzero());
    let sh = Shared::start(
        seg,
        1,
        Eventfds([a, b, c, d]),
        uds,
        cfg.busy_poll,
        peer.clone(),
    )?;
    Ok(parts(sh, cfg, &url, hello.limits, peer))
}

pub(crate) async fn bind(name: &str, cfg: &Config) -> Result<(Box<dyn AcceptHalf>, String)> {
    let rt = runtime()?;
    let url = format!("shm://{name}");
    let path = socket_path(name)?;
    let (listener, file) = rendezvous::bind(&path)?;
    let (tx, rx) = mpsc::channel(cfg.accept_backlog);
    let rejected = Arc::new(AtomicU64::new(0));
    let (cfg, counter, spawner, local) = (cfg.clone(), rejected.clone(), rt.clone(), url.clone());
    rt.spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = tx.closed() => return,
                r = listener.accept() => r,
            };
            let uds = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(url = %local, "accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (tx, cfg, counter, local) =
                (tx.clone(), cfg.clone(), counter.clone(), local.clone());
            spawner.spawn(async move {
                match accept(uds, &cfg, &local).await {
                    Ok(parts) => {
                        let _ = tx.send(parts).await;
                    }
                    Err(e) => {
                        counter.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(url = %local, "rejected shared-memory connection: {e}");
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
    let cred = rendezvous::check_peer(&uds, cfg.shm_any_uid)?;
    let (seg, memfd) = Segment::create(geometry(cfg))?;
    let efds = Eventfds::new()?;
    let fds = {
        use std::os::fd::AsFd;
        [
            memfd.as_fd(),
            efds.0[0].as_fd(),
            efds.0[1].as_fd(),
            efds.0[2].as_fd(),
            efds.0[3].as_fd(),
        ]
        .map(|f| f.try_clone_to_owned())
    };
    let fds: Vec<_> = fds
        .into_iter()
        .collect::<std::io::Result<_>>()
        .map_err(|e| Error::io("duplicating descriptors", e))?;
    let borrowed: Vec<_> = fds.iter().map(std::os::fd::AsFd::as_fd).collect();
    let theirs = tokio::time::timeout(
        cfg.handshake_timeout,
        rendezvous::listener_hello(&uds, Hello { limits: cfg.limits }, &borrowed),
    )
    .await
    .map_err(|_| {
        Error::new(
            ErrorKind::TimedOut,
            format!("no shm handshake answer within {:?}", cfg.handshake_timeout),
        )
    })??;
    drop(fds);
    let peer = format!("{url}#pid{}", cred.pid.as_raw_nonzero());
    let sh = Shared::start(seg, 0, efds, uds, cfg.busy_poll, peer.clone())?;
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
