//! `Listener`: accepted connections as channels.

use std::fmt;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use futures_core::Stream;
use futures_util::future::poll_fn;

use super::Channel;
use crate::error::Result;
use crate::transport::AcceptHalf;

/// A bound address. Accepted connections arrive as [`Channel`]s, from
/// [`accept`](Listener::accept) or as a `Stream`.
///
/// Connections are accepted and their handshakes run in the background, each on its own, so
/// one slow or hostile peer never holds up the others; a connection whose handshake fails is
/// logged, counted in [`rejected`](Listener::rejected) and dropped. Up to the context's
/// accept backlog of ready channels wait for `accept`. Dropping the listener stops listening.
pub struct Listener {
    half: Box<dyn AcceptHalf>,
    local_url: String,
}

impl Listener {
    pub(crate) fn new(half: Box<dyn AcceptHalf>, local_url: String) -> Listener {
        Listener { half, local_url }
    }

    /// The next connection, handshake done.
    ///
    /// An error means the listener itself failed (its I/O thread stopped); failures of single
    /// connections do not surface here.
    ///
    /// # Cancel safety
    /// Cancel safe: a connection is taken from the backlog only when the future completes.
    pub async fn accept(&mut self) -> Result<Channel> {
        let parts = poll_fn(|cx| self.half.poll_accept(cx)).await?;
        Ok(Channel::from_parts(parts))
    }

    pub(crate) fn poll_accept_channel(
        &mut self,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Result<Channel>> {
        self.half
            .poll_accept(cx)
            .map(|r| r.map(Channel::from_parts))
    }

    /// The bound address as a URL, with the real port after binding port 0
    /// (`tcp://127.0.0.1:40123`).
    pub fn local_url(&self) -> &str {
        &self.local_url
    }

    /// Connections dropped before they became channels: failed or timed-out handshakes.
    pub fn rejected(&self) -> u64 {
        self.half.rejected()
    }
}

impl Stream for Listener {
    type Item = Result<Channel>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Result<Channel>>> {
        self.get_mut()
            .half
            .poll_accept(cx)
            .map(|r| Some(r.map(Channel::from_parts)))
    }
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("local_url", &self.local_url)
            .finish()
    }
}
