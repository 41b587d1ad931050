//! Rendezvous over a Unix domain socket: where the socket lives, binding it (replacing a
//! stale one), checking the peer's credentials, and the hello exchange that passes the
//! segment's memfd and the eventfds with `SCM_RIGHTS`.
//!
//! ```text
//! connector                                listener
//!     ─── connect(path) ────────────────────▶  accept; SO_PEERCRED: same uid?
//!     ◀── Hello{limits} + [memfd, 4 eventfds] ─
//!  SO_PEERCRED: same uid? map + validate
//!     ─── Hello{limits} ────────────────────▶
//! ```
//!
//! The socket stays open for the connection's life: its end (EOF) is how each side learns
//! that the other process is gone, and bodies too large for the arena travel over it as
//! memfds of their own.

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

use crate::error::Result;
use crate::wire::Limits;
use crate::{Error, ErrorKind};

/// The size of a hello.
const HELLO_LEN: usize = 64;
const HELLO_MAGIC: [u8; 8] = *b"HFSHMHEL";
const HELLO_VERSION: u16 = 1;
/// The size of an external-body record.
pub(crate) const EXT_LEN: usize = 16;
pub(crate) const EXT_MAGIC: [u8; 8] = *b"HFSHMEXT";

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

/// Binds `path`, replacing a stale socket left by a process that died (nothing accepts on
/// it), refusing one that is alive. The socket file is made 0600.
pub(crate) fn bind(path: &Path) -> Result<(tokio::net::UnixListener, SocketFile)> {
    let shown = path.display();
    let listener = match std::os::unix::net::UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => {
                    return Err(Error::new(
                        ErrorKind::AddrInUse,
                        format!("{shown}: another process is listening there"),
                    ));
                }
                Err(_) => {
                    tracing::info!(path = %shown, "replacing a stale shared-memory socket");
                    std::fs::remove_file(path)
                        .map_err(|e| Error::io(format!("removing the stale {shown}"), e))?;
                    std::os::unix::net::UnixListener::bind(path)
                        .map_err(|e| Error::io(format!("binding {shown}"), e))?
                }
            }
        }
        Err(e) => return Err(Error::io(format!("binding {shown}"), e)),
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("securing {shown}"), e))?;
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
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&HELLO_MAGIC);
        b[8..10].copy_from_slice(&HELLO_VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&self.limits.max_body.to_le_bytes());
        b[24..28].copy_from_slice(&self.limits.max_meta_bytes.to_le_bytes());
        b[28..30].copy_from_slice(&self.limits.max_meta_entries.to_le_bytes());
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
        Ok(Hello { limits })
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
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(8))];
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

/// One `recvmsg`, non-blocking: bytes read (0 at EOF) and any descriptors that came along.
pub(crate) fn recv_once(
    s: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> rustix::io::Result<usize> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
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
            recv_once(s.as_fd(), &mut buf[got..], fds).map_err(Into::into)
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
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
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
