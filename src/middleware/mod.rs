//! Tower middleware: everything message-shaped is a `tower::Service<Message>`.
//!
//! A handler of incoming messages is a `Service<Message, Response = Option<Message>>` (the
//! response, if any, goes back on the same channel); a [`Sender`](crate::Sender) is a
//! `Service<Message, Response = ()>`; a [`Client`] is a `Service<Message, Response =
//! Message>` that pairs each request with its reply. So the same layers guard both
//! directions, and tower's own (`timeout`, `concurrency_limit`, `buffer`, `retry`,
//! `balance`, …) compose with ours:
//!
//! | piece | what |
//! |---|---|
//! | [`TypeFilterLayer`] | passes types matching [`TypePattern`]s (`ml.splitter.*`); unmatched ones are rejected, go to a fallback, or are dropped *and counted and logged* |
//! | [`MetaSchemaLayer`] | checks metadata against a [`MetaSchema`]: allowed and required keys, value rules, type naming |
//! | [`Router`] | dispatches by type pattern to services, with a fallback |
//! | [`serve()`] | accepts channels from a [`Listener`](crate::Listener) and drives a handler per channel: backpressure, bounded in-flight calls, graceful shutdown |
//! | [`Client`] | requests and replies paired by the header's correlation id, many in flight |
//! | [`FanOut`] / [`FanIn`] | a sink over several channels (broadcast, round-robin, key-hash) and a stream merging several, tagged by source |
//!
//! The middleware knows no transport: it uses the public channel API only.
//!
//! ```
//! use hyperframes::middleware::{self, BoxError, MetaSchema, MetaSchemaLayer, TypeFilterLayer, Value};
//! use hyperframes::{Context, Message};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let ctx = Context::new();
//! let listener = ctx.bind("inproc://middleware-doc").await?;
//! let schema = MetaSchema::builder().require("name", Value::any().max_len(32)).build()?;
//!
//! // A server: layers around an async handler, one per accepted channel.
//! let handler = ServiceBuilder::new()
//!     .layer(TypeFilterLayer::new(["greet.*"])?)
//!     .layer(MetaSchemaLayer::new(schema))
//!     .service(service_fn(|req: Message| async move {
//!         let name = req.meta().get("name").unwrap_or("?").to_owned();
//!         Ok::<_, BoxError>(Some(Message::new("greet.reply")?.with_body(format!("hello {name}"))))
//!     }));
//! let server = middleware::serve(listener, tower::make::Shared::new(handler));
//! let shutdown = server.shutdown_handle();
//! let server = tokio::spawn(server.into_future());
//!
//! // A client: requests paired with replies by correlation id.
//! let mut client = middleware::Client::new(ctx.connect("inproc://middleware-doc").await?);
//! let reply = client.ready().await?.call(Message::new("greet.hello")?.with_meta("name", "ada")?).await?;
//! assert_eq!(reply.body().as_bytes().unwrap(), "hello ada");
//!
//! shutdown.shutdown();
//! server.await??;
//! # Ok(()) }
//! ```
//!
//! # Readiness and reservations
//! Tower's contract (from `tower-service`): `poll_ready` must return `Ready(Ok)` before each
//! `call`, and *may reserve shared resources that the next `call` consumes*; a service must
//! release them if it is dropped before `call`. Every service here documents what its
//! `poll_ready` reserves. Two pitfalls this module avoids, and that users of it should too:
//! * **Ready, then clone.** A clone of a service is not ready because the original was:
//!   never call `poll_ready` on one and `call` on a clone (use `ServiceExt::oneshot` on the
//!   clone, or `std::mem::replace` the ready one out). [`serve()`] makes one service per
//!   channel and calls the instance it polled.
//! * **A reservation held while idle.** [`serve()`] receives a message *before* it polls the
//!   handler's readiness, so an idle channel holds no permit of a shared limit; a service
//!   that routes by message ([`Router`], a [`TypeFilter`] with a fallback) must have all its
//!   candidates ready, as tower's `Steer` does.

#![forbid(unsafe_code)]

pub mod client;
mod decisions;
pub mod fan;
mod log_limit;
pub mod meta_schema;
mod pattern;
pub mod router;
mod sender;
pub mod serve;
pub mod type_filter;

pub use self::client::{Client, ClientStats};
pub use self::fan::{FanIn, FanOut};
pub use self::meta_schema::{MetaSchema, MetaSchemaLayer, MetaSchemaService, Value};
pub use self::pattern::TypePattern;
pub use self::router::Router;
pub use self::serve::{Incoming, Serve, ServeStats, ShutdownHandle, serve, serve_channel};
pub use self::type_filter::{FilterStats, TypeFilter, TypeFilterLayer};

/// The error type that middleware erases errors to, as tower's own middleware does.
pub use tower::BoxError;
