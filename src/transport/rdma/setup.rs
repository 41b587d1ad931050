//! What both hardware backends share: the device check, the settings read from the
//! environment, the set-up exchange over TCP that connects two queue pairs, and the TCP
//! connect and listener around it (each backend brings only its handshake).
//!
//! Set-up: the listener accepts a TCP connection at `host:port`; each side creates an RC
//! queue pair, sends its endpoint (QP number, LID, GID) over the TCP connection, and moves
//! the queue pair to ready-to-send with the peer's. The protocol (`HELLO` first) then runs
//! over the queue pair. The format is the same for both backends, so a side on one may
//! connect to a side on the other:
//!
//! ```text
//! offset size field
//!      0    8 magic "HFRDMAOB"
//!      8    2 version 1          10 2 reserved (0)
//!     12    4 QP number          16 2 LID       18 2 reserved (0)
//!     20   16 GID (raw)          (36 bytes)
//! ```

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::RdmaConfig;
use super::verbs::Verbs;
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{AcceptHalf, Config, Parts};

/// Where the kernel lists RDMA devices.
const SYSFS: &str = "/sys/class/infiniband";

/// What says there is no RDMA device, and what to do about it.
pub(crate) fn no_device(why: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!(
            "no RDMA device on this host: {why}; rdma:// needs an InfiniBand or RoCE NIC \
             (or soft-RoCE: `rdma link add rxe0 type rxe netdev <if>`); run `hf doctor` for details"
        ),
    )
}

/// The RDMA devices the kernel lists (names under `/sys/class/infiniband`), or
/// `Unavailable` saying there are none. Reads sysfs only: nothing is loaded.
pub(crate) fn sysfs_devices() -> Result<Vec<String>> {
    let mut names: Vec<String> = match std::fs::read_dir(Path::new(SYSFS)) {
        Ok(dir) => dir
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(e) => return Err(no_device(format!("{SYSFS} cannot be read ({e:#})"))),
    };
    names.sort();
    if names.is_empty() {
        return Err(no_device(format!("{SYSFS} is empty")));
    }
    Ok(names)
}

/// A setting from the environment, or `default`.
pub(crate) fn env<T: std::str::FromStr>(name: &str, default: T) -> Result<T> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => v.parse().map_err(|_| {
            Error::new(
                ErrorKind::Config,
                format!("{name}={v:?} is not a valid value"),
            )
        }),
    }
}

/// Device, port and GID index: `HYPERFRAMES_RDMA_DEVICE` (default: the first device),
/// `HYPERFRAMES_RDMA_PORT` (default 1), `HYPERFRAMES_RDMA_GID_INDEX` (default 1, RoCE v2 on
/// most hosts; 0 on InfiniBand).
#[derive(Clone, Debug)]
pub(crate) struct Placement {
    pub(crate) device: Option<String>,
    pub(crate) port: u8,
    pub(crate) gid_index: u32,
}

impl Placement {
    pub(crate) fn from_env() -> Result<Placement> {
        Ok(Placement {
            device: std::env::var("HYPERFRAMES_RDMA_DEVICE").ok(),
            port: env("HYPERFRAMES_RDMA_PORT", 1)?,
            gid_index: env("HYPERFRAMES_RDMA_GID_INDEX", 1)?,
        })
    }
}

/// One side's queue pair, as the other needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub(crate) qpn: u32,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
}

const OOB_MAGIC: [u8; 8] = *b"HFRDMAOB";
const OOB_VERSION: u16 = 1;
const OOB_LEN: usize = 36;

impl Endpoint {
    fn encode(&self) -> [u8; OOB_LEN] {
        let mut b = [0u8; OOB_LEN];
        b[..8].copy_from_slice(&OOB_MAGIC);
        b[8..10].copy_from_slice(&OOB_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.qpn.to_le_bytes());
        b[16..18].copy_from_slice(&self.lid.to_le_bytes());
        b[20..36].copy_from_slice(&self.gid);
        b
    }

    fn decode(b: &[u8; OOB_LEN]) -> Result<Endpoint> {
        let bad = |why: String| Error::new(ErrorKind::Protocol, format!("rdma set-up: {why}"));
        if b[..8] != OOB_MAGIC {
            return Err(bad("the peer is not a hyperframes rdma:// endpoint".into()));
        }
        let v = u16::from_le_bytes([b[8], b[9]]);
        if v != OOB_VERSION {
            return Err(bad(format!(
                "set-up version {v}, this side speaks {OOB_VERSION}"
            )));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[20..36]);
        Ok(Endpoint {
            qpn: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
            lid: u16::from_le_bytes([b[16], b[17]]),
            gid,
        })
    }
}

/// Sends `ours` and reads the peer's endpoint over `tcp`, within `t`.
pub(crate) async fn exchange(tcp: &mut TcpStream, ours: Endpoint, t: Duration) -> Result<Endpoint> {
    let mut theirs = [0u8; OOB_LEN];
    tokio::time::timeout(t, async {
        tcp.write_all(&ours.encode()).await?;
        tcp.read_exact(&mut theirs).await.map(|_| ())
    })
    .await
    .map_err(|_| {
        Error::new(
            ErrorKind::TimedOut,
            format!("no rdma set-up answer within {t:?}"),
        )
    })?
    .map_err(|e| Error::io("rdma set-up exchange", e))?;
    Endpoint::decode(&theirs)
}

/// A backend's part of the set-up: over the TCP stream to `peer`, its queue pair created and
/// connected with the peer's (see [`exchange`]), as verbs.
pub(crate) type Handshake<V> = for<'a> fn(
    &'a mut TcpStream,
    &'a RdmaConfig,
    Duration,
    &'a str,
) -> Pin<Box<dyn Future<Output = Result<V>> + Send + 'a>>;

/// `rdma://host:port` from this side: the device check, the TCP connection, the backend's
/// handshake, then the protocol's.
pub(crate) async fn connect<V: Verbs>(
    host: &str,
    port: u16,
    cfg: &Config,
    devices: fn() -> Result<Vec<String>>,
    handshake: Handshake<V>,
) -> Result<Parts> {
    devices()?;
    let rcfg = super::config(cfg);
    rcfg.validate()?;
    let url = format!("rdma://{host}:{port}");
    let mut tcp = tokio::time::timeout(cfg.connect_timeout, TcpStream::connect((host, port)))
        .await
        .map_err(|_| Error::new(ErrorKind::TimedOut, format!("connecting to {url}")))?
        .map_err(|e| Error::io(format!("connecting to {url}"), e))?;
    let verbs = handshake(&mut tcp, &rcfg, cfg.handshake_timeout, &url).await?;
    let setup = crate::transport::ChannelSetup::new(cfg, false);
    super::establish(Arc::new(verbs), rcfg, setup, url.clone(), url).await
}

/// An `rdma://host:port` listener: TCP connections accepted, each set up with the backend's
/// handshake in a task of its own. Set-ups in progress are bounded (`accept_backlog`): each
/// opens a queue pair and pins its buffers before the peer has proved anything.
pub(crate) async fn bind<V: Verbs>(
    host: &str,
    port: u16,
    cfg: &Config,
    devices: fn() -> Result<Vec<String>>,
    handshake: Handshake<V>,
) -> Result<(Box<dyn AcceptHalf>, String)> {
    devices()?;
    let rcfg = super::config(cfg);
    rcfg.validate()?;
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| Error::io(format!("binding rdma://{host}:{port}"), e))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("rdma listener address", e))?;
    let url = format!("rdma://{local}");
    let (tx, rx) = mpsc::channel(cfg.accept_backlog.max(1));
    let setups = Arc::new(tokio::sync::Semaphore::new(cfg.accept_backlog.max(1)));
    let t = cfg.handshake_timeout;
    let setup = crate::transport::ChannelSetup::new(cfg, false);
    let local_url = url.clone();
    tokio::spawn(async move {
        loop {
            let Ok(permit) = setups.clone().acquire_owned().await else {
                return;
            };
            let (mut tcp, from) = tokio::select! {
                () = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(url = %local_url, "accept failed: {e:#}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let (tx, rcfg, local_url, setup) =
                (tx.clone(), rcfg.clone(), local_url.clone(), setup.clone());
            tokio::spawn(async move {
                let peer = format!("rdma://{from}");
                let r = async {
                    let verbs = handshake(&mut tcp, &rcfg, t, &peer).await?;
                    super::establish(
                        Arc::new(verbs),
                        rcfg,
                        setup,
                        local_url.clone(),
                        peer.clone(),
                    )
                    .await
                }
                .await;
                hand_over(r, permit, &tx, &local_url).await;
            });
        }
    });
    Ok((Box::new(Accepted { rx, task: "rdma" }), url))
}

/// The end of one accepted connection's set-up: its permit returned, then the connection
/// handed to the acceptor, or the failure logged.
pub(crate) async fn hand_over(
    r: Result<Parts>,
    permit: tokio::sync::OwnedSemaphorePermit,
    tx: &mpsc::Sender<Parts>,
    local_url: &str,
) {
    drop(permit);
    match r {
        Ok(parts) => {
            let _ = tx.send(parts).await;
        }
        Err(e) => tracing::warn!(url = %local_url, "rejected RDMA connection: {e:#}"),
    }
}

/// The accepted connections of a listener's accept task ([`bind`], rdma_cm's), set up.
pub(crate) struct Accepted {
    pub(crate) rx: mpsc::Receiver<Parts>,
    /// Names the task in the error once it has stopped.
    pub(crate) task: &'static str,
}

impl AcceptHalf for Accepted {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        let task = self.task;
        self.rx.poll_recv(cx).map(|p| {
            p.ok_or_else(|| {
                Error::new(
                    ErrorKind::Unavailable,
                    format!("the {task} accept task has stopped"),
                )
            })
        })
    }

    fn rejected(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trip_and_rejections() {
        let ep = Endpoint {
            qpn: 0x12_3456,
            lid: 7,
            gid: [9; 16],
        };
        let b = ep.encode();
        assert_eq!(Endpoint::decode(&b).unwrap(), ep);
        let mut bad = b;
        bad[0] = b'X';
        assert_eq!(
            Endpoint::decode(&bad).unwrap_err().kind(),
            ErrorKind::Protocol
        );
        let mut bad = b;
        bad[8] = 2;
        assert!(
            Endpoint::decode(&bad)
                .unwrap_err()
                .to_string()
                .contains("version 2")
        );
    }
}
