//! Without the `tls` feature: the TLS session an engine may hold, which never exists (so the
//! engines have one code path, and the compiler removes the TLS side of it).

use std::io::{self, IoSlice};

use bytes::BytesMut;

/// Uninhabited: no value of it can be made.
pub(crate) enum Session {}

impl Session {
    pub(crate) fn take(
        &self,
        _cipher: &mut BytesMut,
        _buf: &mut BytesMut,
        _most: usize,
    ) -> io::Result<Option<usize>> {
        match *self {}
    }

    pub(crate) fn end_of_stream(&self) -> io::Result<()> {
        match *self {}
    }

    pub(crate) fn seal(&self, _bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match *self {}
    }

    pub(crate) fn write_to(&self, _sock: &tokio::net::TcpStream) -> io::Result<bool> {
        match *self {}
    }

    pub(crate) fn close_notify(&self) {
        match *self {}
    }
}

/// Uninhabited, like [`Session`]: a listener without TLS holds `None` of it.
#[derive(Clone, Debug)]
pub(crate) enum TlsConfig {}

impl TlsConfig {
    pub(crate) fn acceptor(&self) -> crate::error::Result<Session> {
        match *self {}
    }
}
