//! The engine seam: one stream type over io_uring (tokio-uring) or epoll (tokio).
//!
//! Both take and give back owned buffers (completion style), so the connection driver above
//! is written once. tokio-uring is unmaintained upstream; keeping it to this file is what
//! makes it replaceable.

use std::io::{self, IoSlice};
use std::net::{Shutdown, SocketAddr};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use socket2::{SockRef, TcpKeepalive};
use tokio_uring::buf::BoundedBuf;

use crate::transport::IoEngine;

/// A connected TCP stream on one of the engines. Not `Send`: it lives on its I/O thread.
pub(crate) enum Stream {
    Uring(tokio_uring::net::TcpStream),
    Epoll(tokio::net::TcpStream),
}

impl Stream {
    /// Takes over a connected std stream. `engine` is `Uring` or `Epoll`.
    pub(crate) fn from_std(engine: IoEngine, s: std::net::TcpStream) -> io::Result<Stream> {
        match engine {
            IoEngine::Uring => {
                // io_uring completes blocking-mode sockets asynchronously; a non-blocking one
                // would bounce EAGAIN back to us.
                s.set_nonblocking(false)?;
                Ok(Stream::Uring(tokio_uring::net::TcpStream::from_std(s)))
            }
            _ => {
                s.set_nonblocking(true)?;
                Ok(Stream::Epoll(tokio::net::TcpStream::from_std(s)?))
            }
        }
    }

    /// Appends at most `max` bytes to `buf`, whose spare capacity must hold them.
    pub(crate) async fn read(
        &self,
        mut buf: BytesMut,
        max: usize,
    ) -> (io::Result<usize>, BytesMut) {
        debug_assert!(buf.capacity() - buf.len() >= max && max > 0);
        match self {
            Stream::Uring(s) => {
                let start = buf.len();
                let (res, slice) = s.read(buf.slice(start..start + max)).await;
                (res, slice.into_inner())
            }
            Stream::Epoll(s) => loop {
                if let Err(e) = s.readable().await {
                    return (Err(e), buf);
                }
                let mut limited = (&mut buf).limit(max);
                match s.try_read_buf(&mut limited) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    r => return (r, buf),
                }
            },
        }
    }

    /// One vectored write of `bufs`; returns how many bytes the kernel took.
    pub(crate) async fn writev(&self, bufs: Vec<Bytes>) -> (io::Result<usize>, Vec<Bytes>) {
        match self {
            Stream::Uring(s) => s.writev(bufs).await,
            Stream::Epoll(s) => {
                let res = {
                    let slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
                    loop {
                        if let Err(e) = s.writable().await {
                            break Err(e);
                        }
                        match s.try_write_vectored(&slices) {
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                            r => break r,
                        }
                    }
                };
                (res, bufs)
            }
        }
    }

    /// Writes all of `bufs`, advancing over partial writes without copying.
    pub(crate) async fn write_all(&self, mut bufs: Vec<Bytes>) -> io::Result<()> {
        while !bufs.is_empty() {
            // IOV_MAX is 1024 on Linux; batches are cut below that, this is the backstop.
            let rest = if bufs.len() > 1024 {
                bufs.split_off(1024)
            } else {
                Vec::new()
            };
            let (res, mut sent) = self.writev(bufs).await;
            let n = res?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            crate::wire::advance(&mut sent, n);
            sent.extend(rest);
            bufs = sent;
        }
        Ok(())
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Uring(s) => s.shutdown(how),
            Stream::Epoll(s) => SockRef::from(s).shutdown(how),
        }
    }
}

/// Socket options for every data connection: no Nagle, keepalive probing a silent peer.
pub(crate) fn tune(s: &std::net::TcpStream, keepalive: Option<Duration>) -> io::Result<()> {
    s.set_nodelay(true)?;
    if let Some(idle) = keepalive {
        let ka = TcpKeepalive::new()
            .with_time(idle)
            .with_interval(Duration::from_secs(1))
            .with_retries(3);
        // Not TCP_USER_TIMEOUT: Linux applies it to zero-window probes too, which would cut
        // a live but backpressuring receiver that pauses longer than the timeout.
        SockRef::from(s).set_tcp_keepalive(&ka)?;
    }
    Ok(())
}

/// Binds a listening socket: `SO_REUSEADDR` (restarts do not wait out TIME_WAIT), dual-stack
/// off for IPv6 so `[::]` and `0.0.0.0` can be bound side by side.
pub(crate) fn bind_std(addr: SocketAddr, backlog: i32) -> io::Result<std::net::TcpListener> {
    let domain = socket2::Domain::for_address(addr);
    let sock = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    if addr.is_ipv6() {
        sock.set_only_v6(true)?;
    }
    sock.set_reuse_address(true)?;
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(backlog)?;
    Ok(sock.into())
}
