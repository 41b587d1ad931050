//! The real backend: [`Verbs`] on async-rdma 0.5 (GPL-3.0-only, hence the feature), and
//! `rdma://` set-up.
//!
//! Set-up: the listener accepts a TCP connection at `host:port`; each side creates an RC
//! queue pair (async-rdma in "raw" mode: no agent of its own consuming receives), sends its
//! queue pair endpoint (QP number, LID, GID) over the TCP connection and moves the queue pair
//! to ready-to-send with the peer's (`ibv_connect`). The protocol (`HELLO` first) then runs
//! over the queue pair. Device, port and GID index come from `HYPERFRAMES_RDMA_DEVICE`
//! (default: the first device), `HYPERFRAMES_RDMA_PORT` (default 1) and
//! `HYPERFRAMES_RDMA_GID_INDEX` (default 1, RoCE v2 on most hosts; 0 on InfiniBand).
//!
//! Before anything reaches async-rdma, the host is checked for RDMA devices (sysfs, then
//! `ibv_get_device_list`): without one, `bind`/`connect` fail with
//! [`ErrorKind::Unavailable`] and a message saying so, never a panic inside the library.
//!
//! What this backend does not do yet (see the README): async-rdma's `receive_raw` posts a
//! receive buffer of its own allocator per call, not the protocol's buffer (the protocol's
//! buffer is dropped and the received one used instead, so receives are not zero-copy into
//! our pool); the order of posting relies on the driver polling new operations in the order
//! it created them.

use std::alloc::Layout;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_rdma::{
    AccessFlag, ConnectionType, Gid, LocalMr, MrAccess, MrToken, QueuePairEndpointBuilder, Rdma,
    RdmaBuilder, RemoteMr,
};

use super::setup::{self, Endpoint, Placement};
use super::verbs::{
    Access, Completion, Region, RemoteRegion, Source, VerbOp, Verbs, VerbsError, WcStatus,
};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{AcceptHalf, Config, Parts};

/// The RDMA devices of this host (sysfs, then `ibv_get_device_list` through async-rdma), or
/// `Unavailable` saying there are none. Never calls into libibverbs when sysfs lists nothing.
pub(crate) fn devices() -> Result<Vec<String>> {
    let names = setup::sysfs_devices()?;
    match async_rdma::device::DeviceList::available() {
        Ok(list) if !list.is_empty() => Ok(names),
        Ok(_) => Err(setup::no_device("ibv_get_device_list returned no devices")),
        Err(e) => Err(setup::no_device(format!(
            "ibv_get_device_list failed: {e:#}"
        ))),
    }
}

fn io_verbs(op: VerbOp, e: &std::io::Error) -> VerbsError {
    let text = e.to_string();
    let status = if text.contains("RETRY_EXC") {
        WcStatus::RetryExceeded
    } else if text.contains("RNR") {
        WcStatus::RnrRetryExceeded
    } else if text.contains("FLUSH") {
        WcStatus::Flushed
    } else if text.contains("REM_ACCESS") {
        WcStatus::RemoteAccess
    } else if text.contains("LOC_LEN") {
        WcStatus::LocalLength
    } else if text.contains("LOC_PROT") {
        WcStatus::LocalProtection
    } else {
        WcStatus::Other
    };
    VerbsError::new(op, status).with_detail(text)
}

/// A buffer registered through async-rdma.
pub(crate) struct ArMr {
    mr: LocalMr,
}

impl Region for ArMr {
    fn len(&self) -> usize {
        self.mr.length()
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: a `LocalMr` is `length()` bytes at `addr()`, allocated and registered by
        // async-rdma and valid while it lives. Operations own the `ArMr` while they run (the
        // `Verbs` contract), so no DMA writes it while it is borrowed here.
        unsafe { std::slice::from_raw_parts(self.mr.addr() as *const u8, self.mr.length()) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` excludes every other local view.
        unsafe { std::slice::from_raw_parts_mut(self.mr.addr() as *mut u8, self.mr.length()) }
    }

    fn remote(&self, offset: usize, len: usize) -> RemoteRegion {
        RemoteRegion {
            addr: (self.mr.addr() + offset) as u64,
            len: len as u64,
            rkey: self.mr.rkey(),
        }
    }
}

/// [`Verbs`] over one async-rdma queue pair.
pub(crate) struct ArVerbs {
    rdma: Arc<Rdma>,
    name: String,
}

fn remote_mr(r: RemoteRegion) -> RemoteMr {
    RemoteMr::new(MrToken {
        addr: r.addr as usize,
        len: r.len as usize,
        rkey: r.rkey,
        ddl: SystemTime::now() + Duration::from_secs(365 * 24 * 3600),
        // IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
        access: 1 | 2 | 4,
    })
}

impl Verbs for ArVerbs {
    type Mr = ArMr;
    type Exposed = ArMr;

    fn register(&self, len: usize, access: Access) -> std::result::Result<ArMr, VerbsError> {
        let mut flags = AccessFlag::LocalWrite.into();
        if access.remote_read {
            flags |= AccessFlag::RemoteRead;
        }
        if access.remote_write {
            flags |= AccessFlag::RemoteWrite;
        }
        let layout = Layout::from_size_align(len.max(1), 64).map_err(|e| {
            VerbsError::new(VerbOp::Register, WcStatus::Other).with_detail(e.to_string())
        })?;
        self.rdma
            .alloc_local_mr_with_access(layout, flags)
            .map(|mr| ArMr { mr })
            .map_err(|e| {
                VerbsError::new(VerbOp::Register, WcStatus::NoMemory).with_detail(format!(
                    "{e:#} (is the locked-memory limit, `ulimit -l`, large enough?)"
                ))
            })
    }

    /// async-rdma registers only memory it allocates: the body is copied into a region it
    /// allocates for it, dropped at the `FIN`. Its allocator may carve that region from a
    /// larger registration, whose key then outlives the `FIN` (within this connection's
    /// protection domain): the per-body key of the sideway backend is not promised here.
    #[cfg_attr(not(feature = "cuda"), allow(clippy::infallible_destructuring_match))]
    fn expose(&self, src: Source) -> std::result::Result<(ArMr, RemoteRegion), VerbsError> {
        let bytes = match &src {
            Source::Host(b) => b,
            #[cfg(feature = "cuda")]
            Source::DmaBuf(_) => {
                return Err(
                    VerbsError::new(VerbOp::Register, WcStatus::Other).with_detail(
                        "async-rdma cannot register dma-buf memory (GPUDirect RDMA): use the \
                         sideway backend",
                    ),
                );
            }
        };
        let mut mr = self.register(src.len(), Access::REMOTE_READ)?;
        mr.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        let region = mr.remote(0, src.len());
        Ok((mr, region))
    }

    fn post_recv(&self, buf: ArMr) -> Completion<(ArMr, usize)> {
        let rdma = self.rdma.clone();
        let len = buf.len();
        Box::pin(async move {
            drop(buf);
            let layout = Layout::from_size_align(len.max(1), 64).map_err(|e| {
                VerbsError::new(VerbOp::Recv, WcStatus::Other).with_detail(e.to_string())
            })?;
            let mr = rdma
                .receive_raw(layout)
                .await
                .map_err(|e| io_verbs(VerbOp::Recv, &e))?;
            let n = mr.length();
            Ok((ArMr { mr }, n))
        })
    }

    fn post_send(&self, buf: ArMr, len: usize) -> Completion<ArMr> {
        let rdma = self.rdma.clone();
        Box::pin(async move {
            {
                let slice = buf
                    .mr
                    .get(0..len)
                    .ok_or_else(|| VerbsError::new(VerbOp::Send, WcStatus::LocalLength))?;
                rdma.send_raw(&slice)
                    .await
                    .map_err(|e| io_verbs(VerbOp::Send, &e))?;
            }
            Ok(buf)
        })
    }

    fn post_read(&self, mut buf: ArMr, remote: RemoteRegion) -> Completion<ArMr> {
        let rdma = self.rdma.clone();
        Box::pin(async move {
            {
                let rmr = remote_mr(remote);
                let mut slice = buf
                    .mr
                    .get_mut(0..remote.len as usize)
                    .ok_or_else(|| VerbsError::new(VerbOp::Read, WcStatus::LocalLength))?;
                rdma.read(&mut slice, &rmr)
                    .await
                    .map_err(|e| io_verbs(VerbOp::Read, &e))?;
            }
            Ok(buf)
        })
    }

    fn post_write(&self, buf: ArMr, remote: RemoteRegion) -> Completion<ArMr> {
        let rdma = self.rdma.clone();
        Box::pin(async move {
            {
                let mut rmr = remote_mr(remote);
                let slice = buf
                    .mr
                    .get(0..remote.len as usize)
                    .ok_or_else(|| VerbsError::new(VerbOp::Write, WcStatus::LocalLength))?;
                rdma.write(&slice, &mut rmr)
                    .await
                    .map_err(|e| io_verbs(VerbOp::Write, &e))?;
            }
            Ok(buf)
        })
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

// ---------------------------------------------------------------------------------------
// Set-up
// ---------------------------------------------------------------------------------------

fn builder(cfg: &super::RdmaConfig) -> Result<RdmaBuilder> {
    let place = Placement::from_env()?;
    let (port, gid) = (place.port, place.gid_index as usize);
    let depth = cfg.recv_slots + 16;
    let mut b = RdmaBuilder::default()
        .set_conn_type(ConnectionType::RCIBV)
        .set_raw(true)
        .set_port_num(port)
        .set_gid_index(gid)
        .set_qp_max_recv_wr(depth)
        .set_qp_max_send_wr(depth)
        .set_cq_size(depth * 2)
        .set_rnr_retry(7);
    if let Some(dev) = &place.device {
        b = b.set_dev(dev);
    }
    Ok(b)
}

/// Creates a queue pair and connects it with the peer's over `tcp`.
async fn handshake(
    tcp: &mut tokio::net::TcpStream,
    cfg: &super::RdmaConfig,
    t: Duration,
) -> Result<Rdma> {
    let mut rdma = builder(cfg)?.build().map_err(|e| {
        Error::new(
            ErrorKind::Unavailable,
            format!("opening the RDMA device: {e:#}"),
        )
    })?;
    let ep = rdma.get_qp_endpoint();
    let ours = Endpoint {
        qpn: *ep.qp_num(),
        lid: *ep.lid(),
        gid: *ep.gid().as_raw(),
    };
    let theirs = setup::exchange(tcp, ours, t).await?;
    let remote = QueuePairEndpointBuilder::default()
        .qp_num(theirs.qpn)
        .lid(theirs.lid)
        .gid(Gid::from_raw(theirs.gid))
        .build()
        .map_err(|e| Error::new(ErrorKind::Protocol, format!("rdma set-up: {e:#}")))?;
    rdma.ibv_connect(remote)
        .await
        .map_err(|e| Error::new(ErrorKind::Io, format!("connecting the queue pair: {e:#}")))?;
    Ok(rdma)
}

/// [`handshake`], as verbs, as the shared set-up takes it.
fn boxed_handshake<'a>(
    tcp: &'a mut tokio::net::TcpStream,
    cfg: &'a super::RdmaConfig,
    t: Duration,
    peer: &'a str,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<ArVerbs>> + Send + 'a>> {
    Box::pin(async move {
        let rdma = handshake(tcp, cfg, t).await?;
        Ok(ArVerbs {
            rdma: Arc::new(rdma),
            name: peer.to_owned(),
        })
    })
}

pub(crate) async fn connect(host: &str, port: u16, cfg: &Config) -> Result<Parts> {
    setup::connect(host, port, cfg, devices, boxed_handshake).await
}

pub(crate) async fn bind(
    host: &str,
    port: u16,
    cfg: &Config,
) -> Result<(Box<dyn AcceptHalf>, String)> {
    setup::bind(host, port, cfg, devices, boxed_handshake).await
}
