//! The verbs the protocol needs, as a trait: register memory, post receives, sends, RDMA
//! reads and writes, and learn of their completions as futures.
//!
//! Two backends implement it: the in-memory simulation ([`sim`](super::sim)), which is how CI
//! tests the protocol, and async-rdma on real hardware. The protocol core
//! ([`proto`](super::proto)) never sees a backend; the driver connects the two.
//!
//! # Ownership
//! Every operation takes the registered buffer it works on *by value* and hands it back on
//! completion, so a buffer cannot be reused, read or freed by us while the NIC may still
//! access it: the type system keeps the rule that verbs leave to the programmer. A buffer
//! is lost with its operation when the operation fails (the connection is over then).
//!
//! # Ordering
//! As on a reliable-connected queue pair: sends, reads and writes are executed in the order
//! they were posted, and each send lands in the oldest posted receive. The order in which
//! *completions are reported* is not promised across queues (a send's completion may be
//! seen after the peer's answer to it), and the driver must not rely on it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

/// A completion: resolves when the operation is done (or failed).
pub type Completion<T> = Pin<Box<dyn Future<Output = Result<T, VerbsError>> + Send + 'static>>;

/// Which operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum VerbOp {
    /// Opening the device, or connecting the queue pair.
    Connect,
    /// Registering (pinning) memory.
    Register,
    /// A posted receive.
    Recv,
    /// A send.
    Send,
    /// An RDMA read.
    Read,
    /// An RDMA write.
    Write,
}

impl fmt::Display for VerbOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            VerbOp::Connect => "connect",
            VerbOp::Register => "memory registration",
            VerbOp::Recv => "receive",
            VerbOp::Send => "send",
            VerbOp::Read => "RDMA read",
            VerbOp::Write => "RDMA write",
        })
    }
}

/// Why it failed: the work-completion statuses of ibverbs that the protocol can meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_LOC_LEN_ERR`: a message longer than the posted receive buffer, or a local
    /// range outside the buffer.
    LocalLength,
    /// `IBV_WC_LOC_PROT_ERR`: local memory not registered for this access.
    LocalProtection,
    /// `IBV_WC_REM_ACCESS_ERR`: the remote key is unknown, the range is outside the remote
    /// region, or the region does not allow the access.
    RemoteAccess,
    /// `IBV_WC_REM_INV_REQ_ERR`: the responder refused the request (its receive buffer was
    /// too small).
    RemoteInvalidRequest,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted, and the retries ran out.
    RnrRetryExceeded,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer did not answer (gone, link down).
    RetryExceeded,
    /// `IBV_WC_WR_FLUSH_ERR`: the queue pair is in the error state; posted work is flushed.
    Flushed,
    /// No RDMA device on this host.
    NoDevice,
    /// Registration refused (locked-memory limit, out of memory).
    NoMemory,
    /// Anything else the backend reports.
    Other,
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WcStatus::LocalLength => "local length error (IBV_WC_LOC_LEN_ERR)",
            WcStatus::LocalProtection => "local protection error (IBV_WC_LOC_PROT_ERR)",
            WcStatus::RemoteAccess => "remote access error (IBV_WC_REM_ACCESS_ERR)",
            WcStatus::RemoteInvalidRequest => "remote invalid request (IBV_WC_REM_INV_REQ_ERR)",
            WcStatus::RnrRetryExceeded => {
                "receiver not ready, retries exceeded (IBV_WC_RNR_RETRY_EXC_ERR)"
            }
            WcStatus::RetryExceeded => {
                "transport retries exceeded: the peer does not answer (IBV_WC_RETRY_EXC_ERR)"
            }
            WcStatus::Flushed => {
                "flushed: the queue pair is in the error state (IBV_WC_WR_FLUSH_ERR)"
            }
            WcStatus::NoDevice => "no RDMA device",
            WcStatus::NoMemory => "cannot register memory",
            WcStatus::Other => "failed",
        })
    }
}

/// A failed verb: which operation, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsError {
    /// The operation.
    pub op: VerbOp,
    /// The completion status.
    pub status: WcStatus,
    /// More words from the backend, if any.
    pub detail: String,
}

impl VerbsError {
    /// An error of `op` with `status`.
    pub fn new(op: VerbOp, status: WcStatus) -> VerbsError {
        VerbsError {
            op,
            status,
            detail: String::new(),
        }
    }

    /// The same, with more words.
    pub fn with_detail(mut self, detail: impl Into<String>) -> VerbsError {
        self.detail = detail.into();
        self
    }

    /// True when the error means the peer is gone (rather than a local mistake).
    pub fn is_peer_lost(&self) -> bool {
        matches!(
            self.status,
            WcStatus::RetryExceeded | WcStatus::RnrRetryExceeded | WcStatus::Flushed
        )
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.op, self.status)?;
        if !self.detail.is_empty() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for VerbsError {}

/// What the peer may do with a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Access {
    /// The peer may RDMA-read it.
    pub remote_read: bool,
    /// The peer may RDMA-write it.
    pub remote_write: bool,
}

impl Access {
    /// Local access only (send and receive buffers).
    pub const LOCAL: Access = Access {
        remote_read: false,
        remote_write: false,
    };
    /// The peer may read it (rendezvous sources).
    pub const REMOTE_READ: Access = Access {
        remote_read: true,
        remote_write: false,
    };
    /// The peer may read and write it.
    pub const REMOTE_RW: Access = Access {
        remote_read: true,
        remote_write: true,
    };
}

/// A region of the peer's registered memory, as the peer advertised it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Its address in the peer's address space (what verbs call the iova).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The remote key the peer registered it with.
    pub rkey: u32,
}

/// Registered memory: a buffer the NIC may access.
///
/// # Invariant for implementers
/// The memory stays valid and registered as long as the value lives. The slices are the
/// local CPU's view; a remote peer reaches the memory only through operations that own the
/// buffer at that moment, or through `rkey` when it was registered for remote access (the
/// protocol advertises an `rkey` only for buffers it no longer writes).
pub trait Region: Send + Sync + Unpin + 'static {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The contents.
    fn as_slice(&self) -> &[u8];
    /// The contents, to write.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// Where the peer finds `range` of it (for regions registered for remote access).
    fn remote(&self, offset: usize, len: usize) -> RemoteRegion;
}

/// Memory of ours the peer is to read once (a rendezvous body), registered on its own by
/// [`Verbs::expose`].
///
/// Each body gets a registration of its own, covering exactly its bytes and readable only
/// while the protocol lends it: the `rkey` the peer learns reaches nothing else and dies at
/// the peer's `FIN` (or when the connection ends). A pool buffer registered for remote read
/// and reused would hand the peer a key that, after the `FIN`, still reaches whatever the
/// buffer holds next. (So on the sideway backend and the simulation; async-rdma registers
/// only memory it allocates, and may carve it from a larger registration of its own: there
/// the key may outlive the `FIN`, within that connection's protection domain.)
#[derive(Debug)]
#[non_exhaustive]
pub enum Source {
    /// Host memory. The registration keeps the bytes (and so their memory) alive and
    /// unchanged: `Bytes` are immutable.
    Host(bytes::Bytes),
    /// Device memory as a dma-buf (GPUDirect RDMA).
    #[cfg(feature = "cuda")]
    DmaBuf(DmaBuf),
}

/// Device memory as a dma-buf, for `ibv_reg_dmabuf_mr` (GPUDirect RDMA): `len` bytes at
/// `offset` of the file `fd`. `keep` holds the memory; a registration keeps it (and the
/// descriptor) until it is dropped.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf.
    pub fd: std::os::fd::OwnedFd,
    /// Where the body starts in it.
    pub offset: u64,
    /// The body's length.
    pub len: usize,
    /// What keeps the memory alive (the device body).
    pub keep: Box<dyn std::any::Any + Send + Sync>,
}

impl Source {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Source::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            Source::DmaBuf(buf) => buf.len,
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The verbs of one connected queue pair.
///
/// Posting is synchronous and in order (the returned [`Completion`] is already posted when
/// this returns, for backends that can do so; see each backend); completion is a future.
pub trait Verbs: Send + Sync + 'static {
    /// A registered buffer of this backend.
    type Mr: Region;
    /// Memory lent to the peer by [`expose`](Verbs::expose): registered while it lives.
    type Exposed: Send + Sync + Unpin + 'static;

    /// Allocates and registers `len` bytes (zeroed) with `access`.
    fn register(&self, len: usize, access: Access) -> Result<Self::Mr, VerbsError>;

    /// Registers `src` for the peer to read (remote read only), the registration covering
    /// exactly its bytes; the region is where the peer finds them. Dropping the returned
    /// value deregisters it (the key is dead from then on) and lets go of the memory.
    fn expose(&self, src: Source) -> Result<(Self::Exposed, RemoteRegion), VerbsError>;

    /// Registers `buf` (device memory of ours) as a local buffer that reads land in: the
    /// peer's NIC writes device memory directly (GPUDirect RDMA on the receiving side). The
    /// returned buffer has no CPU view (`as_slice` may be empty) and keeps `buf` until it
    /// drops. Backends without dma-buf registration refuse (the default).
    #[cfg(feature = "cuda")]
    fn register_dmabuf(&self, buf: DmaBuf) -> Result<Self::Mr, VerbsError> {
        let _ = buf;
        Err(VerbsError::new(VerbOp::Register, WcStatus::Other)
            .with_detail(format!("{} cannot register dma-buf memory", self.name())))
    }

    /// Posts a receive into `buf`; completes with the buffer and the received length.
    fn post_recv(&self, buf: Self::Mr) -> Completion<(Self::Mr, usize)>;

    /// Posts a send of the first `len` bytes of `buf`.
    fn post_send(&self, buf: Self::Mr, len: usize) -> Completion<Self::Mr>;

    /// Posts an RDMA read of `remote` into the first `remote.len` bytes of `buf`.
    fn post_read(&self, buf: Self::Mr, remote: RemoteRegion) -> Completion<Self::Mr>;

    /// Posts an RDMA write of the first `remote.len` bytes of `buf` into `remote`.
    fn post_write(&self, buf: Self::Mr, remote: RemoteRegion) -> Completion<Self::Mr>;

    /// A short name for logs and errors ("sim", "mlx5_0:1").
    fn name(&self) -> String;
}
