//! Checks every message against a [`MetaSchema`] before the inner service sees it.
//!
//! A message that breaks the schema is refused with a [`SchemaViolation`] that names its type,
//! the key and the rule, and carries the message back. The check needs only the message, so
//! the same layer guards both directions:
//!
//! * **send side**: around a [`Sender`](crate::Sender) (a `Service<Message, Response = ()>`),
//!   a bad message is refused before it reaches the wire;
//! * **receive side**: around a handler given to [`serve`](crate::middleware::serve()), a bad
//!   message never reaches the handler (`serve` logs and counts the error, and answers a
//!   request with an error reply).
//!
//! ```
//! use hyperframes::middleware::{BoxError, MetaSchema, MetaSchemaLayer, Value, meta_schema::SchemaViolation};
//! use hyperframes::{Context, Message};
//! use tower::{Layer, Service, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let ctx = Context::new();
//! let mut listener = ctx.bind("inproc://schema-doc").await?;
//! let (tx, _rx) = ctx.connect("inproc://schema-doc").await?.split();
//! let schema = MetaSchema::builder().require("frame", Value::integer()).build()?;
//! let mut tx = MetaSchemaLayer::new(schema).layer(tx);
//!
//! tx.ready().await?.call(Message::new("video.frame")?.with_meta("frame", "1")?).await?;
//! let err = tx.ready().await?.call(Message::new("video.frame")?).await.unwrap_err();
//! let v = err.downcast::<SchemaViolation>().unwrap();
//! assert_eq!(v.key(), Some("frame"));
//!
//! let mut peer = listener.accept().await?;
//! assert_eq!(peer.recv().await.unwrap()?.meta().get("frame"), Some("1")); // only the good one
//! # Ok(()) }
//! ```

mod error;
pub mod future;
mod layer;
mod schema;

use std::fmt;
use std::task::{Context, Poll};

use tower::Service;

pub use self::error::{Rule, SchemaViolation};
use self::future::ResponseFuture;
pub use self::layer::MetaSchemaLayer;
pub use self::schema::{MetaSchema, MetaSchemaBuilder, Value};
use super::BoxError;
use super::decisions::Decisions;
use crate::message::Message;

/// A service that passes only messages that follow its [`MetaSchema`]; see
/// [the module docs](self). (The schema has the name `MetaSchema`, so the service breaks
/// tower's `Foo`/`FooLayer` naming.)
#[derive(Clone)]
pub struct MetaSchemaService<S> {
    inner: S,
    schema: MetaSchema,
    /// Whether the last few types follow the naming rule (when the schema has one).
    naming: Decisions<bool>,
}

impl<S> MetaSchemaService<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, schema: MetaSchema) -> MetaSchemaService<S> {
        MetaSchemaService {
            inner,
            schema,
            naming: Decisions::new(),
        }
    }

    /// The schema.
    pub fn schema(&self) -> &MetaSchema {
        &self.schema
    }

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
}

impl<S> Service<Message> for MetaSchemaService<S>
where
    S: Service<Message>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    /// The inner service's readiness. A refused message leaves it reserved for the next
    /// call.
    #[inline]
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    #[inline(always)]
    fn call(&mut self, msg: Message) -> Self::Future {
        let schema = &self.schema;
        if self.naming.get(msg.kind(), |kind| schema.passes_type(kind))
            && schema.passes_meta(msg.meta())
        {
            return ResponseFuture::inner(self.inner.call(msg));
        }
        ResponseFuture::refused(refuse(schema, msg))
    }
}

/// The error for a message that breaks the schema, out of the way of the path that passes.
#[cold]
#[inline(never)]
fn refuse(schema: &MetaSchema, msg: Message) -> BoxError {
    crate::metrics::count!("hyperframes_schema_refused_total", 1);
    let mut v = schema.violation(&msg, None);
    tracing::debug!("refused: {v}");
    v.0.message = Some(msg);
    Box::new(v)
}

impl<S: fmt::Debug> fmt::Debug for MetaSchemaService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetaSchemaService")
            .field("schema", &self.schema)
            .field("inner", &self.inner)
            .finish()
    }
}
