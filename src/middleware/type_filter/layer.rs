//! The layer.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower::Layer;

use super::{Config, Counters, Discard, Fallback, FilterStats, Reject, TypeFilter};
use crate::middleware::decisions::Decisions;
use crate::middleware::log_limit::LogLimit;
use crate::middleware::pattern::PatternSet;

/// Applies [`TypeFilter`] to services; the builder of its settings.
///
/// ```
/// use hyperframes::middleware::TypeFilterLayer;
///
/// let layer = TypeFilterLayer::new(["video_frame"])?.named("video-rx").discard();
/// let stats = layer.stats(); // read `stats.dropped()` from anywhere
/// # let _ = stats;
/// # Ok::<(), hyperframes::Error>(())
/// ```
pub struct TypeFilterLayer<P = Reject> {
    config: Arc<Config>,
    counters: Arc<Counters>,
    policy: P,
}

impl TypeFilterLayer<Reject> {
    /// A filter passing the types that match any of `patterns` (see
    /// [`TypePattern`](crate::middleware::TypePattern) for the syntax), with the [`Reject`]
    /// policy. Fails with [`ErrorKind::Config`](crate::ErrorKind::Config) naming a bad
    /// pattern, or when there is none.
    pub fn new<I>(patterns: I) -> crate::error::Result<TypeFilterLayer<Reject>>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        Ok(TypeFilterLayer {
            config: Arc::new(Config::new(PatternSet::new(patterns)?)),
            counters: Arc::default(),
            policy: Reject,
        })
    }
}

impl<P> TypeFilterLayer<P> {
    /// A name for log lines and errors, to tell filters apart (`"video-rx"`).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.config).name = Some(name.into().into_boxed_str());
        self
    }

    /// The shortest time between two warnings about dropped messages (policy [`Discard`]);
    /// the next warning says how many were dropped meanwhile. Default 1 s.
    pub fn warn_interval(mut self, interval: Duration) -> Self {
        Arc::make_mut(&mut self.config).log = LogLimit::new(interval);
        self
    }

    /// Refuse unmatched messages with an [`Unmatched`](super::Unmatched) error (the default).
    pub fn reject(self) -> TypeFilterLayer<Reject> {
        self.with_policy(Reject)
    }

    /// Drop unmatched messages, counting them and logging rate-limited warnings.
    pub fn discard(self) -> TypeFilterLayer<Discard> {
        self.with_policy(Discard)
    }

    /// Hand unmatched messages to `service` (cloned into each filter the layer makes).
    pub fn fallback<F>(self, service: F) -> TypeFilterLayer<Fallback<F>> {
        self.with_policy(Fallback { service })
    }

    fn with_policy<Q>(self, policy: Q) -> TypeFilterLayer<Q> {
        TypeFilterLayer {
            config: self.config,
            counters: self.counters,
            policy,
        }
    }

    /// The counters, shared by every filter this layer makes.
    pub fn stats(&self) -> FilterStats {
        FilterStats {
            counters: self.counters.clone(),
        }
    }
}

impl<S, P: Clone> Layer<S> for TypeFilterLayer<P> {
    type Service = TypeFilter<S, P>;

    fn layer(&self, inner: S) -> TypeFilter<S, P> {
        TypeFilter {
            inner,
            config: self.config.clone(),
            counters: self.counters.clone(),
            policy: self.policy.clone(),
            decisions: Decisions::new(),
        }
    }
}

impl<P: Clone> Clone for TypeFilterLayer<P> {
    fn clone(&self) -> Self {
        TypeFilterLayer {
            config: self.config.clone(),
            counters: self.counters.clone(),
            policy: self.policy.clone(),
        }
    }
}

impl<P: fmt::Debug> fmt::Debug for TypeFilterLayer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypeFilterLayer")
            .field("patterns", &self.config.patterns.shown())
            .field("name", &self.config.name)
            .field("policy", &self.policy)
            .finish()
    }
}
