//! [`Router`]: dispatches messages to services by type pattern, with a fallback.
//!
//! ```
//! use hyperframes::middleware::{BoxError, Router};
//! use hyperframes::Message;
//! use tower::{Service, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let reply = |text: &'static str| {
//!     service_fn(move |_m: Message| async move { Ok::<_, BoxError>(Some(Message::new(text)?)) })
//! };
//! let mut router = Router::new()
//!     .route("video.*", reply("got.video"))?
//!     .route("ml.splitter.**", reply("got.ml"))?
//!     .fallback(reply("got.other"));
//!
//! let r = router.ready().await?.call(Message::new("ml.splitter.out.3")?).await?;
//! assert_eq!(r.unwrap().kind(), "got.ml");
//! let r = router.ready().await?.call(Message::new("audio.frame")?).await?;
//! assert_eq!(r.unwrap().kind(), "got.other");
//! # Ok(()) }
//! ```
//!
//! # Readiness
//! Which route a message takes is known only at `call`, so `poll_ready` is `Ready` when every
//! route and the fallback are (as tower's `Steer` does): a route that is not ready holds up
//! the others. Give a route that may stall a queue of its own (`tower::buffer::Buffer`) to
//! keep it from blocking the rest. Whatever the routes reserved in `poll_ready` stays
//! reserved for the next call; nothing is reserved by the router itself.

mod error;

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use tower::util::BoxCloneService;
use tower::{Service, ServiceExt};

pub use self::error::NoRoute;
use super::BoxError;
use super::decisions::Decisions;
use super::pattern::TypePattern;
use crate::message::Message;

type Boxed<R> = BoxCloneService<Message, R, BoxError>;

/// Dispatches each message to the first route whose pattern matches its type, otherwise to
/// the fallback; without a fallback, refuses it with [`NoRoute`]. See [the module
/// docs](self).
///
/// Routes are boxed, so services of different types mix; each must be `Clone` (the router
/// is, so that [`serve`](crate::middleware::serve()) can make one per channel with
/// `tower::make::Shared`).
pub struct Router<R> {
    routes: Vec<(TypePattern, Boxed<R>)>,
    fallback: Option<Boxed<R>>,
    shown: Arc<str>,
    /// The route (index) the last few types took; `None` for the fallback.
    decisions: Decisions<Option<usize>>,
}

impl<R: Send + 'static> Router<R> {
    /// A router with no routes and no fallback.
    pub fn new() -> Router<R> {
        Router {
            routes: Vec::new(),
            fallback: None,
            shown: "[]".into(),
            decisions: Decisions::new(),
        }
    }

    /// Adds a route: messages whose type matches `pattern` (see [`TypePattern`]) and no
    /// earlier route go to `service`. Fails with
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) for a bad pattern.
    pub fn route<S>(mut self, pattern: &str, service: S) -> crate::error::Result<Router<R>>
    where
        S: Service<Message, Response = R> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
    {
        let pattern = TypePattern::new(pattern)?;
        self.routes.push((pattern, boxed(service)));
        self.decisions = Decisions::new();
        self.shown = format!(
            "[{}]",
            self.routes
                .iter()
                .map(|(p, _)| p.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
        .into();
        Ok(self)
    }

    /// Sets the service for messages that match no route.
    pub fn fallback<S>(mut self, service: S) -> Router<R>
    where
        S: Service<Message, Response = R> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
    {
        self.fallback = Some(boxed(service));
        self
    }

    /// The route patterns, in order.
    pub fn patterns(&self) -> impl Iterator<Item = &TypePattern> {
        self.routes.iter().map(|(p, _)| p)
    }
}

fn boxed<S, R>(service: S) -> Boxed<R>
where
    S: Service<Message, Response = R> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    BoxCloneService::new(service.map_err(Into::into))
}

impl<R: Send + 'static> Default for Router<R> {
    fn default() -> Self {
        Router::new()
    }
}

impl<R: Send + 'static> Service<Message> for Router<R> {
    type Response = R;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<R, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        let mut ready = true;
        for (_, s) in &mut self.routes {
            ready &= s.poll_ready(cx)?.is_ready();
        }
        if let Some(f) = &mut self.fallback {
            ready &= f.poll_ready(cx)?.is_ready();
        }
        if ready {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, msg: Message) -> Self::Future {
        let routes = &mut self.routes;
        let route = self.decisions.get(msg.kind(), |kind| {
            routes.iter().position(|(p, _)| p.matches(kind))
        });
        if let Some(i) = route {
            return routes[i].1.call(msg);
        }
        match &mut self.fallback {
            Some(f) => f.call(msg),
            None => {
                let err = NoRoute {
                    kind: msg.kind().clone(),
                    routes: self.shown.clone(),
                    message: Some(msg),
                };
                Box::pin(std::future::ready(Err(err.into())))
            }
        }
    }
}

impl<R> Clone for Router<R> {
    fn clone(&self) -> Self {
        Router {
            routes: self.routes.clone(),
            fallback: self.fallback.clone(),
            shown: self.shown.clone(),
            decisions: self.decisions.clone(),
        }
    }
}

impl<R> fmt::Debug for Router<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Router")
            .field("routes", &self.shown)
            .field("fallback", &self.fallback.is_some())
            .finish()
    }
}
