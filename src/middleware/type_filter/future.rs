//! Future types.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;

use crate::middleware::BoxError;

pin_project! {
    /// Response future of [`TypeFilter`](super::TypeFilter): the inner service's, the
    /// fallback's, or an answer decided at `call` (a rejection, or the default response of a
    /// dropped message).
    pub struct ResponseFuture<T, F, G> {
        #[pin]
        kind: Kind<T, F, G>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<T, F, G> {
        Inner { #[pin] future: F },
        Fallback { #[pin] future: G },
        // The two answers decided at `call` are small, so the future is no larger than the
        // inner service's (a stored response would add its size to every call's future).
        Rejected { error: Option<BoxError> },
        Discarded { default: fn() -> T },
    }
}

impl<T, F, G> ResponseFuture<T, F, G> {
    pub(super) fn inner(future: F) -> Self {
        ResponseFuture {
            kind: Kind::Inner { future },
        }
    }

    pub(super) fn fallback(future: G) -> Self {
        ResponseFuture {
            kind: Kind::Fallback { future },
        }
    }

    pub(super) fn rejected(error: BoxError) -> Self {
        ResponseFuture {
            kind: Kind::Rejected { error: Some(error) },
        }
    }

    pub(super) fn discarded(default: fn() -> T) -> Self {
        ResponseFuture {
            kind: Kind::Discarded { default },
        }
    }
}

impl<T, F, G, E1, E2> Future for ResponseFuture<T, F, G>
where
    F: Future<Output = Result<T, E1>>,
    E1: Into<BoxError>,
    G: Future<Output = Result<T, E2>>,
    E2: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => Poll::Ready(ready!(future.poll(cx)).map_err(Into::into)),
            KindProj::Fallback { future } => {
                Poll::Ready(ready!(future.poll(cx)).map_err(Into::into))
            }
            KindProj::Rejected { error } => Poll::Ready(Err(error
                .take()
                .expect("ResponseFuture polled after completion"))),
            KindProj::Discarded { default } => Poll::Ready(Ok(default())),
        }
    }
}

/// The fallback future of a filter without a fallback ([`Reject`](super::Reject),
/// [`Discard`](super::Discard)): it cannot be made, so [`ResponseFuture`]'s fallback case
/// takes no room. (With the inner service's future type in its place, the two cases could not
/// share the inner future's spare values for the case tag: a tag word would go in front of
/// the inner future and every answer would be copied out of it shifted by a word, which the
/// next whole-value copy reads back with store-forwarding stalls.)
pub struct NoFallback<T, E> {
    never: std::convert::Infallible,
    _answer: std::marker::PhantomData<fn() -> Result<T, E>>,
}

impl<T, E> Future for NoFallback<T, E> {
    type Output = Result<T, E>;

    fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.never {}
    }
}

impl<T, E> std::fmt::Debug for NoFallback<T, E> {
    fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.never {}
    }
}

impl<T, F, G> std::fmt::Debug for ResponseFuture<T, F, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}
