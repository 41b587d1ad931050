//! hyperframes: typed, zero-copy, full-duplex messaging for datacenter networks.
//!
//! A [`Message`] has a dotted [`MsgType`] (`ml.splitter.output`), a small [`Meta`] map (the
//! address on the envelope) and a [`Body`] (the parcel) that travels without user-space
//! copies. A [`Channel`] is full duplex: a [`futures_sink::Sink`] of messages and a
//! [`futures_core::Stream`] of results, which [`Channel::split`] turns into a [`Sender`] and a
//! [`Receiver`] that live in different tasks. Transports are chosen by URL:
//!
//! | scheme | transport |
//! |---|---|
//! | `tcp://host:port` | TCP in the tasks that use it inside a tokio runtime; elsewhere on io_uring I/O threads, epoll where io_uring is refused |
//! | `tls://host:port` | `tcp://` with TLS 1.3 and certificates, mutual if asked (feature `tls`; see `TlsConfig`) |
//! | `inproc://name` | inside one process; bodies move as `Bytes` |
//! | `shm://name` | two processes on one host, through shared memory |
//! | `rdma://host:port` | RDMA (InfiniBand, RoCE), feature `rdma` (sideway, rdma-core loaded at run time; `rdma-async-rdma` adds the async-rdma backend, a GPL-3.0 build) |
//! | `rdma+sim://name` | the RDMA protocol over simulated verbs in one process (feature `rdma`; see the `rdma` module) |
//!
//! ```no_run
//! use hyperframes::{Context, Message};
//!
//! # async fn demo() -> hyperframes::Result<()> {
//! let ctx = Context::new();
//! let mut listener = ctx.bind("tcp://127.0.0.1:0").await?;
//! let url = listener.local_url().to_owned();
//! tokio::spawn(async move {
//!     let mut ch = listener.accept().await?;
//!     while let Some(msg) = ch.recv().await {
//!         ch.send(msg?).await?; // echo
//!     }
//!     Ok::<(), hyperframes::Error>(())
//! });
//! let (mut tx, mut rx) = ctx.connect(&url).await?.split();
//! tx.send(Message::new("demo.hello")?.with_body("hi")).await?;
//! let echo = rx.recv().await.expect("echo")?;
//! assert_eq!(echo.kind(), "demo.hello");
//! # Ok(()) }
//! ```
//!
//! # Channel semantics
//!
//! The same on every transport:
//! * **Ordering**: messages arrive in the order they were sent, per channel and direction.
//! * **Delivery**: [`Sender::send`] returns when the message is handed to the transport (written
//!   to the socket or queued to go out with the next write on tcp, in the peer's ring or queue
//!   on shm and inproc); [`Sender::flush`] when every message
//!   sent so far has reached the kernel (tcp) or the peer's queue (inproc). Nothing is ever
//!   partially sent: a message is on the wire whole or not at all.
//! * **Backpressure**: every queue is bounded (in messages and bytes, see
//!   [`ContextBuilder`]). `poll_ready` is `Pending` while the transport is full, so a slow
//!   receiver slows its sender down, through TCP's own flow control on `tcp://`.
//! * **Half close**: [`Sender::close`] (or dropping the `Sender`) finishes this direction; the
//!   peer's `Receiver` yields the messages sent before it, then ends (`None`). The other
//!   direction stays open.
//! * **Failure**: when the peer dies or the connection breaks, both halves report an error at
//!   their next poll ([`ErrorKind::ConnectionLost`]): the
//!   `Receiver` after the messages that arrived before the failure, the `Sender` at once.
//!   A peer that closes cleanly is not an error; one that vanishes mid-stream is.
//! * **Dropping the `Receiver`** tells the peer (tcp: a `STOP` frame): the peer's `Sender`
//!   fails with [`ErrorKind::Closed`] instead of sending into the
//!   void. Messages already in flight are discarded, counted and logged.
//!
//! # Organization
//! * [`message`] — `Message`, `MsgType`, `Meta`, `Body` (serde forms with feature `serde`).
//! * [`wire`] — the byte format of stream transports, sans-IO, specified in its docs.
//! * the channel layer — [`Context`], [`Listener`], [`Channel`], [`Sender`], [`Receiver`].
//! * [`middleware`] (feature `tower`, on by default) — everything message-shaped as a
//!   `tower::Service<Message>`: type filters, metadata schemas, a router, `serve` for
//!   listeners, a request/response `Client`, fan-out and fan-in.
//! * `device` (feature `cuda`) — bodies in GPU memory: `Gpu`, `DeviceBody`, how each
//!   transport carries them, and a host stand-in for testing without a GPU.
//! * `metrics` (feature `metrics`) — counters and gauges through the `metrics` facade, for
//!   Prometheus or OpenTelemetry exporters; every channel also has a `tracing` span
//!   ([`ChannelInfo::span`]).
//! * the transports, private, each behind the same two traits.

#![warn(missing_docs)]
// docs.rs builds with every feature and shows which one each item needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("hyperframes supports 64-bit targets only");

mod channel;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod device;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod loom;
pub mod message;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod middleware;
pub mod session;
mod text;
mod transport;
pub mod wire;

#[cfg(feature = "cuda")]
pub use channel::DeviceBodies;
pub use channel::{
    Channel, ChannelInfo, ChannelStats, Context, ContextBuilder, ContextStats, IoEngine, Listener,
    Receiver, ReuniteError, Sender,
};
pub use error::{Error, ErrorKind, Result};
pub use message::{Body, BodyMut, Flags, Header, Limits, Location, Message, Meta, MsgType};
pub use text::escape_untrusted;
pub use transport::identity::PeerIdentity;
#[cfg(feature = "tls")]
pub use transport::tcp::tls::TlsConfig;
pub use transport::{Address, Endpoint};

#[cfg(feature = "rdma")]
#[cfg_attr(docsrs, doc(cfg(feature = "rdma")))]
pub use transport::rdma;

/// The README's Rust examples, compiled as doctests (`cargo test --doc --all-features`).
#[cfg(all(doctest, feature = "tls", feature = "tower"))]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;

/// Not part of the API: internals that `benches/` measure on their own.
#[doc(hidden)]
#[cfg(all(feature = "shm", not(hyperframes_loom)))]
pub use transport::shm::bench_support;
