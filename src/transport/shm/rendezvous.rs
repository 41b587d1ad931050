//! Rendezvous over a Unix domain socket: where the socket lives, binding it (replacing a
//! stale socket, never anything else), checking the peer's credentials, and the hello exchange
//! that passes the segment's memfd and the two wake sockets with `SCM_RIGHTS`.
//!
//! ```text
//! connector                                listener
//!     ─── connect(path) ──────────────────────▶  accept; SO_PEERCRED: same uid?
//!     ◀── Hello{limits, heartbeat} + [memfd, data, space] ─  (the peer's ends of two socket pairs)
//!  SO_PEERCRED: same uid? check the descriptors, map + validate
//!     ─── Hello{limits, heartbeat} ───────────▶
//! ```
//!
//! The socket stays open for the connection's life: its end (EOF) is how each side learns
//! that the other process is gone, and bodies too large for the arena travel over it as
//! memfds of their own, each announced by an [`ExtRecord`].
//!
//! The wake sockets are `SOCK_SEQPACKET` pairs: each process holds its own end, so nothing the
//! peer does to its descriptors (clearing `O_NONBLOCK`, filling its queue) can make our wake-up
//! block — we send with `MSG_DONTWAIT` on an open file description the peer never had.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;

/// The size of a hello.
const HELLO_LEN: usize = 64;
const HELLO_MAGIC: [u8; 8] = *b"HFSHMHEL";
const HELLO_VERSION: u16 = HELLO_VERSION_WAKE_SOCKETS;
const HELLO_VERSION_WAKE_SOCKETS: u16 = 2;

/// The announcement of an external body on the rendezvous socket, with its memfd attached:
/// magic, sequence number, length (native-endian u64s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExtRecord {
    pub(crate) seq: u64,
    pub(crate) len: u64,
}

impl ExtRecord {
    pub(crate) const LEN: usize = 24;
    const MAGIC: [u8; 8] = *b"HFSHMEXT";

    pub(crate) fn encode(&self) -> [u8; ExtRecord::LEN] {
        let mut b = [0u8; ExtRecord::LEN];
        b[..8].copy_from_slice(&ExtRecord::MAGIC);
        b[8..16].copy_from_slice(&self.seq.to_ne_bytes());
        b[16..].copy_from_slice(&self.len.to_ne_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; ExtRecord::LEN]) -> Option<ExtRecord> {
        (b[..8] == ExtRecord::MAGIC).then(|| ExtRecord {
            seq: u64::from_ne_bytes(b[8..16].try_into().expect("8 bytes")),
            len: u64::from_ne_bytes(b[16..].try_into().expect("8 bytes")),
        })
    }
}

/// The directory `shm://name` sockets live in: `$XDG_RUNTIME_DIR/hyperframes`, or
/// `/tmp/hyperframes-<uid>`; created private (0700) when missing, and refused when another
/// user owns it or others can write it.
pub(crate) fn runtime_dir() -> Result<PathBuf> {
    let uid = rustix::process::geteuid().as_raw();
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if Path::new(&d).is_dir() => Path::new(&d).join("hyperframes"),
        _ => PathBuf::from(format!("/tmp/hyperframes-{uid}")),
    };
    match std::fs::create_dir(&dir) {
        Ok(()) => {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| Error::io(format!("securing {}", dir.display()), e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("creating {}", dir.display()), e)),
    }
    let meta = std::fs::symlink_metadata(&dir)
        .map_err(|e| Error::io(format!("inspecting {}", dir.display()), e))?;
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "{} is not a private directory of this user (owner {}, mode {:o}); \
                 use shm:///absolute/path.sock instead",
                dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(dir)
}

/// A bound socket file, removed when dropped (if it is still ours).
pub(crate) struct SocketFile {
    path: PathBuf,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

static BIND_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Binds `path`. The socket is bound under a temporary name in the same directory, given its
/// mode (0600, or 0666 when any user may connect: the credential check then decides), and
/// only then moved to `path` with `RENAME_NOREPLACE`, so it is never reachable with the wrong
/// mode and nothing at `path` is ever replaced. A socket left at `path` by a process that died
/// (nothing accepts on it) is removed first; a live one, or any file that is not a socket, is
/// refused.
pub(crate) fn bind(path: &Path, any_uid: bool) -> Result<(tokio::net::UnixListener, SocketFile)> {
    use std::os::unix::fs::FileTypeExt;
    let shown = path.display();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(
        ".hf{:x}.{:x}",
        std::process::id(),
        BIND_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&tmp); // ours, from a process with our pid that died
    let listener = std::os::unix::net::UnixListener::bind(&tmp)
        .map_err(|e| Error::io(format!("binding {shown}"), e))?;
    let placed = (|| {
        let mode = if any_uid { 0o666 } else { 0o600 };
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(format!("securing {shown}"), e))?;
        let mut replaced_stale = false;
        loop {
            match rustix::fs::renameat_with(
                rustix::fs::CWD,
                &tmp,
                rustix::fs::CWD,
                path,
                rustix::fs::RenameFlags::NOREPLACE,
            ) {
                Ok(()) => return Ok(()),
                Err(rustix::io::Errno::EXIST) if !replaced_stale => {
                    let meta = std::fs::symlink_metadata(path)
                        .map_err(|e| Error::io(format!("inspecting {shown}"), e))?;
                    if !meta.file_type().is_socket() {
                        return Err(Error::new(
                            ErrorKind::AddrInUse,
                            format!("{shown} exists and is not a socket; refusing to replace it"),
                        ));
                    }
                    if std::os::unix::net::UnixStream::connect(path).is_ok() {
                        return Err(Error::new(
                            ErrorKind::AddrInUse,
                            format!("{shown}: another process is listening there"),
                        ));
                    }
                    tracing::info!(path = %shown, "replacing a stale shared-memory socket");
                    std::fs::remove_file(path)
                        .map_err(|e| Error::io(format!("removing the stale {shown}"), e))?;
                    replaced_stale = true;
                }
                Err(rustix::io::Errno::EXIST) => {
                    return Err(Error::new(
                        ErrorKind::AddrInUse,
                        format!("{shown}: another process bound it meanwhile"),
                    ));
                }
                Err(e) => {
                    return Err(Error::io(format!("binding {shown}"), e.into()));
                }
            }
        }
    })();
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    let ino = std::fs::symlink_metadata(path)
        .map_err(|e| Error::io(format!("inspecting {shown}"), e))?
        .ino();
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("configuring the socket", e))?;
    let listener = tokio::net::UnixListener::from_std(listener)
        .map_err(|e| Error::io("registering the socket", e))?;
    Ok((
        listener,
        SocketFile {
            path: path.to_owned(),
            ino,
        },
    ))
}

/// A pair of connected wake sockets (`SOCK_SEQPACKET`, non-blocking, close-on-exec).
pub(crate) fn wake_pair() -> Result<(OwnedFd, OwnedFd)> {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| Error::io("creating a wake socket pair", e.into()))
}

/// Checks that a descriptor the listener passed is a wake socket: a Unix `SOCK_SEQPACKET`
/// socket. (Whatever its flags, every call on it passes `MSG_DONTWAIT`.)
pub(crate) fn check_wake_socket(fd: &OwnedFd) -> Result<()> {
    let bad = |what: &str| {
        Error::new(
            ErrorKind::Protocol,
            format!("shm handshake: a wake descriptor {what}"),
        )
    };
    match rustix::net::sockopt::socket_domain(fd) {
        Ok(rustix::net::AddressFamily::UNIX) => {}
        Ok(_) => return Err(bad("is not a Unix socket")),
        Err(_) => return Err(bad("is not a socket")),
    }
    if rustix::net::sockopt::socket_type(fd) != Ok(rustix::net::SocketType::SEQPACKET) {
        return Err(bad("is not a SOCK_SEQPACKET socket"));
    }
    Ok(())
}

/// The peer process's credentials; refuses a different user unless `any_uid`.
pub(crate) fn check_peer(s: &UnixStream, any_uid: bool) -> Result<rustix::net::UCred> {
    let cred = rustix::net::sockopt::socket_peercred(s)
        .map_err(|e| Error::io("reading the peer's credentials", e.into()))?;
    let ours = rustix::process::geteuid();
    if !any_uid && cred.uid != ours {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!(
                "peer process {} runs as uid {}, not {} (this side accepts its own user only)",
                cred.pid.as_raw_nonzero(),
                cred.uid.as_raw(),
                ours.as_raw()
            ),
        ));
    }
    Ok(cred)
}

/// A side's hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) limits: Limits,
    /// How often this side advances its heartbeat counter in the segment, in milliseconds
    /// (0: it does not; a peer that predates the field sends 0 here, as these bytes were
    /// reserved and zero).
    pub(crate) heartbeat_ms: u32,
}

impl Hello {
    pub(crate) fn new(cfg: &crate::transport::Config) -> Hello {
        Hello {
            limits: cfg.limits,
            heartbeat_ms: cfg.heartbeat.map_or(0, |d| {
                u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
            }),
        }
    }

    /// The interval the peer promised, if any.
    pub(crate) fn heartbeat(&self) -> Option<std::time::Duration> {
        (self.heartbeat_ms > 0).then(|| std::time::Duration::from_millis(self.heartbeat_ms.into()))
    }
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&HELLO_MAGIC);
        b[8..10].copy_from_slice(&HELLO_VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&self.limits.max_body.to_le_bytes());
        b[24..28].copy_from_slice(&self.limits.max_meta_bytes.to_le_bytes());
        b[28..30].copy_from_slice(&self.limits.max_meta_entries.to_le_bytes());
        b[32..36].copy_from_slice(&self.heartbeat_ms.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello> {
        let bad = |why: String| Error::new(ErrorKind::Protocol, format!("shm handshake: {why}"));
        if b[..8] != HELLO_MAGIC {
            return Err(bad(
                "not a hyperframes shared-memory peer (wrong magic)".into()
            ));
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != HELLO_VERSION {
            return Err(bad(format!(
                "peer speaks version {version}; this side speaks {HELLO_VERSION}"
            )));
        }
        let limits = Limits {
            max_body: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
            max_meta_bytes: u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")),
            max_meta_entries: u16::from_le_bytes([b[28], b[29]]),
        };
        let heartbeat_ms = u32::from_le_bytes(b[32..36].try_into().expect("4 bytes"));
        Ok(Hello {
            limits,
            heartbeat_ms,
        })
    }
}

/// Sends `bytes` with `fds` attached (to the first byte), waiting for room.
pub(crate) async fn send_with_fds(
    s: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        s.writable()
            .await
            .map_err(|e| Error::io("writing to the shm socket", e))?;
        let attach = if sent == 0 { fds } else { &[] };
        match s.try_io(Interest::WRITABLE, || {
            send_once(s.as_fd(), &bytes[sent..], attach).map_err(Into::into)
        }) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(Error::io("writing to the shm socket", e)),
        }
    }
    Ok(())
}

/// One `sendmsg`, non-blocking.
pub(crate) fn send_once(
    s: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> rustix::io::Result<usize> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(rustix::io::Errno::NOBUFS);
    }
    rustix::net::sendmsg(
        s,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
    )
}

/// One `recvmsg`, non-blocking: bytes read (0 at EOF) and the descriptors that came along.
/// Room is made for `max_fds` descriptors: the kernel closes any beyond (and we never hold
/// more than that many because of one message).
pub(crate) fn recv_once(
    s: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    max_fds: usize,
) -> rustix::io::Result<usize> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let room = rustix::cmsg_space!(ScmRights(max_fds.min(4)));
    let mut control = RecvAncillaryBuffer::new(&mut space[..room]);
    let msg = rustix::net::recvmsg(
        s,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
    )?;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    Ok(msg.bytes)
}

/// Reads exactly `N` bytes, collecting the descriptors that come with them.
async fn recv_exact<const N: usize>(s: &UnixStream, fds: &mut Vec<OwnedFd>) -> Result<[u8; N]> {
    let mut buf = [0u8; N];
    let mut got = 0;
    while got < N {
        s.readable()
            .await
            .map_err(|e| Error::io("reading from the shm socket", e))?;
        match s.try_io(Interest::READABLE, || {
            recv_once(s.as_fd(), &mut buf[got..], fds, 4).map_err(Into::into)
        }) {
            Ok(0) => {
                return Err(Error::new(
                    ErrorKind::ConnectionLost,
                    "the peer closed the shm socket during the handshake",
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(Error::io("reading from the shm socket", e)),
        }
    }
    Ok(buf)
}

/// Listener side: send our hello with the segment and eventfds, read the peer's.
pub(crate) async fn listener_hello(
    s: &UnixStream,
    ours: Hello,
    fds: &[BorrowedFd<'_>],
) -> Result<Hello> {
    send_with_fds(s, &ours.encode(), fds).await?;
    let mut stray = Vec::new();
    let theirs = recv_exact::<HELLO_LEN>(s, &mut stray).await?;
    Hello::decode(&theirs)
}

/// Connector side: read the listener's hello and its descriptors, answer with ours once the
/// caller validated them (`answer`).
pub(crate) async fn connector_hello(s: &UnixStream) -> Result<(Hello, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    let theirs = recv_exact::<HELLO_LEN>(s, &mut fds).await?;
    Ok((Hello::decode(&theirs)?, fds))
}

pub(crate) async fn answer(s: &UnixStream, ours: Hello) -> Result<()> {
    send_with_fds(s, &ours.encode(), &[]).await
}

#[cfg(all(test, not(hyperframes_loom)))]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trip_and_rejections() {
        let h = Hello {
            limits: Limits::default(),
            heartbeat_ms: 1500,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert_eq!(h.heartbeat(), Some(std::time::Duration::from_millis(1500)));
        // An older peer's reserved zeros: no heartbeats.
        let mut b = h.encode();
        b[32..36].fill(0);
        assert_eq!(Hello::decode(&b).unwrap().heartbeat(), None);
        let mut b = h.encode();
        b[0] = b'X';
        assert!(Hello::decode(&b).unwrap_err().to_string().contains("magic"));
        let mut b = h.encode();
        b[8] = 9;
        assert!(
            Hello::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("version")
        );
    }
}
