//! The engine seam: the connection driver is written once against [`Io`], implemented over
//! io_uring (tokio-uring, on the context's I/O threads) and over epoll (tokio's reactor, on
//! the I/O threads or, inline, on the caller's runtime).
//!
//! Both take and give back owned buffers (completion style). tokio-uring is unmaintained
//! upstream; keeping it to this file is what makes it replaceable.

use std::io::{self, IoSlice};
use std::net::{Shutdown, SocketAddr};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use socket2::{SockRef, TcpKeepalive};
use tokio_uring::buf::BoundedBuf;

/// A connected TCP stream, as the driver uses it.
pub(crate) trait Io {
    /// Appends at most `max` bytes to `buf`, whose spare capacity must hold them.
    async fn read(&self, buf: BytesMut, max: usize) -> (io::Result<usize>, BytesMut);

    /// One vectored write of `bufs`; returns how many bytes the kernel took.
    async fn writev(&self, bufs: Vec<Bytes>) -> (io::Result<usize>, Vec<Bytes>);

    fn shutdown(&self, how: Shutdown) -> io::Result<()>;

    /// Writes all of `bufs`, advancing over partial writes without copying.
    async fn write_all(&self, mut bufs: Vec<Bytes>) -> io::Result<()> {
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
}

/// io_uring. Not `Send`: it lives on its I/O thread's tokio-uring runtime.
pub(crate) struct UringStream(tokio_uring::net::TcpStream);

impl UringStream {
    pub(crate) fn from_std(s: std::net::TcpStream) -> io::Result<UringStream> {
        // io_uring completes blocking-mode sockets asynchronously; a non-blocking one would
        // bounce EAGAIN back to us.
        s.set_nonblocking(false)?;
        Ok(UringStream(tokio_uring::net::TcpStream::from_std(s)))
    }
}

impl Io for UringStream {
    async fn read(&self, buf: BytesMut, max: usize) -> (io::Result<usize>, BytesMut) {
        debug_assert!(buf.capacity() - buf.len() >= max && max > 0);
        let start = buf.len();
        let (res, slice) = self.0.read(buf.slice(start..start + max)).await;
        (res, slice.into_inner())
    }

    async fn writev(&self, bufs: Vec<Bytes>) -> (io::Result<usize>, Vec<Bytes>) {
        self.0.writev(bufs).await
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.0.shutdown(how)
    }
}

/// epoll, through tokio's reactor. `Send`, so it can run inline on the caller's runtime.
pub(crate) struct EpollStream(tokio::net::TcpStream);

impl EpollStream {
    pub(crate) fn from_std(s: std::net::TcpStream) -> io::Result<EpollStream> {
        s.set_nonblocking(true)?;
        Ok(EpollStream(tokio::net::TcpStream::from_std(s)?))
    }

    pub(crate) fn new(s: tokio::net::TcpStream) -> EpollStream {
        EpollStream(s)
    }

    pub(crate) fn into_inner(self) -> tokio::net::TcpStream {
        self.0
    }
}

impl Io for EpollStream {
    async fn read(&self, mut buf: BytesMut, max: usize) -> (io::Result<usize>, BytesMut) {
        debug_assert!(buf.capacity() - buf.len() >= max && max > 0);
        loop {
            if let Err(e) = self.0.readable().await {
                return (Err(e), buf);
            }
            let mut limited = (&mut buf).limit(max);
            match self.0.try_read_buf(&mut limited) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return (r, buf),
            }
        }
    }

    async fn writev(&self, bufs: Vec<Bytes>) -> (io::Result<usize>, Vec<Bytes>) {
        let res = {
            let slices: Vec<IoSlice<'_>> = bufs.iter().map(|b| IoSlice::new(b)).collect();
            loop {
                if let Err(e) = self.0.writable().await {
                    break Err(e);
                }
                match self.0.try_write_vectored(&slices) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    r => break r,
                }
            }
        };
        (res, bufs)
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        SockRef::from(&self.0).shutdown(how)
    }
}

/// Socket options for every data connection: no Nagle, keepalive probing a silent peer.
pub(crate) fn tune(s: SockRef<'_>, keepalive: Option<Duration>) -> io::Result<()> {
    s.set_tcp_nodelay(true)?;
    if let Some(idle) = keepalive {
        let ka = TcpKeepalive::new()
            .with_time(idle)
            .with_interval(Duration::from_secs(1))
            .with_retries(3);
        // Not TCP_USER_TIMEOUT: Linux applies it to zero-window probes too, which would cut
        // a live but backpressuring receiver that pauses longer than the timeout.
        s.set_tcp_keepalive(&ka)?;
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
