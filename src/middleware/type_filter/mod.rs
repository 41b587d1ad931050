//! Passes messages whose type matches a set of [`TypePattern`]s; what happens to the others is
//! a policy, and never silence.
//!
//! | policy | an unmatched message | the caller sees |
//! |---|---|---|
//! | [`Reject`] (default) | is refused | an [`Unmatched`] error that names the type and the patterns and carries the message back |
//! | [`Discard`] | is dropped, counted ([`FilterStats::dropped`]) and logged: a warning naming the type and the filter's patterns, at most one per interval (1 s by default) with the count since the last | the inner service's default response (`()` for a `Sender`, `None` for a handler, which [`serve`](crate::middleware::serve()) turns into an error reply when the message was a request); a service whose response has no default (a `Client`) cannot be given this policy |
//! | [`Fallback`] | goes to a second service | that service's response |
//!
//! Every unmatched message is counted ([`FilterStats::unmatched`]).
//!
//! The filter sees only the type, so it works the same on the send side (around a
//! [`Sender`](crate::Sender)) and on the receive side (around a handler given to
//! [`serve`](crate::middleware::serve())).
//!
//! ```
//! use hyperframes::middleware::{BoxError, TypeFilterLayer, type_filter::Unmatched};
//! use hyperframes::Message;
//! use tower::{Layer, Service, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let handler = service_fn(|m: Message| async move { Ok::<_, BoxError>(Some(m)) });
//! let mut svc = TypeFilterLayer::new(["video.frame", "ml.splitter.*"])?.layer(handler);
//!
//! let ok = svc.ready().await?.call(Message::new("ml.splitter.output")?).await?;
//! assert!(ok.is_some());
//!
//! let err = svc.ready().await?.call(Message::new("audio.frame")?).await.unwrap_err();
//! let unmatched = err.downcast::<Unmatched>().unwrap();
//! assert_eq!(unmatched.message_type(), "audio.frame");
//! assert_eq!(unmatched.patterns(), "[video.frame, ml.splitter.*]");
//! let _message_back = unmatched.into_message().unwrap();
//! # Ok(()) }
//! ```
//!
//! # Readiness
//! `poll_ready` is the inner service's (and, with a fallback, both services': a message's
//! destination is known only at `call`, as with tower's `Steer`). A message that is refused or
//! dropped leaves the inner service's readiness reserved for the next call.

mod error;
pub mod future;
mod layer;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tower::Service;

pub use self::error::Unmatched;
use self::future::{NoFallback, ResponseFuture};
pub use self::layer::TypeFilterLayer;
use super::BoxError;
use super::decisions::Decisions;
use super::log_limit::LogLimit;
use super::pattern::{PatternSet, TypePattern};
use crate::message::Message;

/// Policy: refuse an unmatched message with an [`Unmatched`] error.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reject;

/// Policy: drop an unmatched message, count it and log a rate-limited warning that names its
/// type and the filter's patterns. Requires the inner service's response to have a
/// `Default`, which is what the caller gets.
#[derive(Clone, Copy, Debug, Default)]
pub struct Discard;

/// Policy: hand an unmatched message to another service.
#[derive(Clone, Debug)]
pub struct Fallback<F> {
    service: F,
}

/// A service that passes messages whose type matches its patterns to the inner service; see
/// [the module docs](self).
pub struct TypeFilter<S, P = Reject> {
    inner: S,
    config: Arc<Config>,
    counters: Arc<Counters>,
    policy: P,
    /// Whether the last few types matched: a stream of one type matches once.
    decisions: Decisions<bool>,
}

#[derive(Debug)]
pub(super) struct Config {
    patterns: PatternSet,
    name: Option<Box<str>>,
    log: LogLimit,
}

impl Clone for Config {
    fn clone(&self) -> Config {
        Config {
            patterns: self.patterns.clone(),
            name: self.name.clone(),
            log: LogLimit::new(self.log.interval()),
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    unmatched: AtomicU64,
    dropped: AtomicU64,
    rejected: AtomicU64,
    to_fallback: AtomicU64,
}

/// Counters of a type filter, shared by every service its layer made. Cheap to clone; read
/// it from anywhere.
#[derive(Clone, Debug)]
pub struct FilterStats {
    counters: Arc<Counters>,
}

impl FilterStats {
    /// Messages that matched no pattern, whatever became of them.
    pub fn unmatched(&self) -> u64 {
        self.counters.unmatched.load(Ordering::Relaxed)
    }

    /// Unmatched messages dropped under [`Discard`].
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Unmatched messages refused under [`Reject`].
    pub fn rejected(&self) -> u64 {
        self.counters.rejected.load(Ordering::Relaxed)
    }

    /// Unmatched messages handed to the [`Fallback`].
    pub fn to_fallback(&self) -> u64 {
        self.counters.to_fallback.load(Ordering::Relaxed)
    }
}

impl Config {
    /// The filter's name as the `filter` label of its metrics, empty when it has none.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn label(&self) -> String {
        self.name.as_deref().unwrap_or_default().to_owned()
    }

    pub(super) fn new(patterns: PatternSet) -> Config {
        Config {
            patterns,
            name: None,
            log: LogLimit::new(Duration::from_secs(1)),
        }
    }

    /// `type filter "name" [a, b]` or `type filter [a, b]`.
    fn describe(&self) -> String {
        match &self.name {
            Some(n) => format!("type filter {n:?} {}", self.patterns.shown()),
            None => format!("type filter {}", self.patterns.shown()),
        }
    }
}

impl<S> TypeFilter<S, Reject> {
    /// Wraps `inner` in a filter on `patterns` with the [`Reject`] policy; see
    /// [`TypeFilterLayer`] for the other policies and settings.
    pub fn new<I>(inner: S, patterns: I) -> crate::error::Result<TypeFilter<S, Reject>>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Ok(TypeFilter {
            inner,
            config: Arc::new(Config::new(PatternSet::new(patterns)?)),
            counters: Arc::default(),
            policy: Reject,
            decisions: Decisions::new(),
        })
    }
}

impl<S, P> TypeFilter<S, P> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, to change.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The patterns.
    pub fn patterns(&self) -> &[TypePattern] {
        self.config.patterns.patterns()
    }

    /// The counters (shared with every service the same layer made).
    pub fn stats(&self) -> FilterStats {
        FilterStats {
            counters: self.counters.clone(),
        }
    }

    #[inline]
    fn matches(&mut self, msg: &Message) -> bool {
        let patterns = &self.config.patterns;
        self.decisions
            .get(msg.kind(), |kind| patterns.matches(kind))
    }

    #[cold]
    #[inline(never)]
    fn unmatched(&self, msg: &Message) {
        self.counters.unmatched.fetch_add(1, Ordering::Relaxed);
        crate::metrics::count!("hyperframes_filter_unmatched_total", 1, "filter" => self.config.label());
        tracing::trace!(
            "{}: message of type `{}` matches no pattern",
            self.config.describe(),
            msg.kind()
        );
    }

    #[cold]
    #[inline(never)]
    fn reject(&self, msg: Message) -> BoxError {
        self.unmatched(&msg);
        self.counters.rejected.fetch_add(1, Ordering::Relaxed);
        crate::metrics::count!("hyperframes_filter_rejected_total", 1, "filter" => self.config.label());
        Box::new(Unmatched {
            kind: msg.kind().clone(),
            patterns: self.config.patterns.shown().into(),
            filter: self.config.name.clone(),
            message: Some(msg),
        })
    }

    #[cold]
    #[inline(never)]
    fn discard(&self, msg: Message) {
        self.unmatched(&msg);
        let n = self.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        crate::metrics::count!("hyperframes_filter_discarded_total", 1, "filter" => self.config.label());
        if let Some(held_back) = self.config.log.allow() {
            let more = if held_back > 0 {
                format!(", {held_back} of them since the last warning")
            } else {
                String::new()
            };
            tracing::warn!(
                "{} dropped a message of type `{}`: the type matches none of the filter's \
                 patterns ({n} dropped so far{more}); if such messages were expected here, the \
                 sender's types and this filter disagree",
                self.config.describe(),
                msg.kind(),
            );
        }
    }
}

impl<S> Service<Message> for TypeFilter<S, Reject>
where
    S: Service<Message>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Response, S::Future, NoFallback<S::Response, S::Error>>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    #[inline(always)]
    fn call(&mut self, msg: Message) -> Self::Future {
        if self.matches(&msg) {
            ResponseFuture::inner(self.inner.call(msg))
        } else {
            ResponseFuture::rejected(self.reject(msg))
        }
    }
}

impl<S> Service<Message> for TypeFilter<S, Discard>
where
    S: Service<Message>,
    S::Response: Default,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Response, S::Future, NoFallback<S::Response, S::Error>>;

    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    #[inline(always)]
    fn call(&mut self, msg: Message) -> Self::Future {
        if self.matches(&msg) {
            ResponseFuture::inner(self.inner.call(msg))
        } else {
            self.discard(msg);
            ResponseFuture::discarded(S::Response::default)
        }
    }
}

impl<S, F> Service<Message> for TypeFilter<S, Fallback<F>>
where
    S: Service<Message>,
    S::Error: Into<BoxError>,
    F: Service<Message, Response = S::Response>,
    F::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Response, S::Future, F::Future>;

    /// Ready when both the inner service and the fallback are: which one a message goes to
    /// is known only at `call`. Polling a ready service again is allowed by tower's contract
    /// and keeps its reservation.
    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        let inner = self.inner.poll_ready(cx).map_err(Into::into)?;
        let fallback = self.policy.service.poll_ready(cx).map_err(Into::into)?;
        if inner.is_ready() && fallback.is_ready() {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    #[inline(always)]
    fn call(&mut self, msg: Message) -> Self::Future {
        if self.matches(&msg) {
            ResponseFuture::inner(self.inner.call(msg))
        } else {
            self.unmatched(&msg);
            self.counters.to_fallback.fetch_add(1, Ordering::Relaxed);
            crate::metrics::count!("hyperframes_filter_to_fallback_total", 1, "filter" => self.config.label());
            ResponseFuture::fallback(self.policy.service.call(msg))
        }
    }
}

impl<S: Clone, P: Clone> Clone for TypeFilter<S, P> {
    fn clone(&self) -> Self {
        TypeFilter {
            inner: self.inner.clone(),
            config: self.config.clone(),
            counters: self.counters.clone(),
            policy: self.policy.clone(),
            decisions: self.decisions.clone(),
        }
    }
}

impl<S: fmt::Debug, P: fmt::Debug> fmt::Debug for TypeFilter<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypeFilter")
            .field("patterns", &self.config.patterns.shown())
            .field("name", &self.config.name)
            .field("policy", &self.policy)
            .field("inner", &self.inner)
            .finish()
    }
}
