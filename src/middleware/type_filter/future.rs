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
        Ready { output: Option<Result<T, BoxError>> },
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

    pub(super) fn ready(output: Result<T, BoxError>) -> Self {
        ResponseFuture {
            kind: Kind::Ready {
                output: Some(output),
            },
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

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Inner { future } => Poll::Ready(ready!(future.poll(cx)).map_err(Into::into)),
            KindProj::Fallback { future } => {
                Poll::Ready(ready!(future.poll(cx)).map_err(Into::into))
            }
            KindProj::Ready { output } => Poll::Ready(
                output
                    .take()
                    .expect("ResponseFuture polled after completion"),
            ),
        }
    }
}

impl<T, F, G> std::fmt::Debug for ResponseFuture<T, F, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}
