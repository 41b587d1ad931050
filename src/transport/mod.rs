//! Transports behind one seam.
//!
//! A transport produces, per connection, a [`SendHalf`] and a [`RecvHalf`] (and, per bound
//! address, an [`AcceptHalf`]); the channel layer wraps them into `Sender`, `Receiver`,
//! `Channel` and `Listener` and knows nothing else about them. Adding a transport means a
//! module here and one line in [`SCHEMES`] (plus a field of [`Transports`] if it keeps state
//! per context).

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;
use crate::message::{BodyMut, Message};
pub use endpoint::{Address, Endpoint};

pub(crate) mod endpoint;
#[cfg(any(feature = "tcp", feature = "shm", feature = "rdma"))]
pub(crate) mod heartbeat;
pub(crate) mod identity;
#[cfg(feature = "inproc")]
mod inproc;
#[cfg(any(feature = "inproc", feature = "rdma"))]
mod names;
pub(crate) mod pipe;
#[cfg(feature = "rdma")]
pub mod rdma;
#[cfg(feature = "shm")]
pub(crate) mod shm;
#[cfg(feature = "tcp")]
pub(crate) mod tcp;

/// How long a side waiting for its peer (data or room on `shm://` and `inproc://`, data on
/// `tcp://`'s inline engine) spins before it parks: long enough to catch a reply in a
/// request/response exchange (a round trip is a microsecond or two in memory, a few over
/// loopback TCP) without sleeping, short enough not to burn a core on an idle channel.
#[cfg(any(feature = "shm", feature = "inproc", feature = "tcp"))]
pub(crate) const SPIN: Duration = Duration::from_micros(20);

/// Checks `ready` in a loop for at most `limit`; `Ok(true)` as soon as it says yes, its
/// first error as it comes.
#[cfg(any(feature = "shm", feature = "inproc"))]
pub(crate) fn spin_until<E>(
    limit: Duration,
    mut ready: impl FnMut() -> std::result::Result<bool, E>,
) -> std::result::Result<bool, E> {
    let start = std::time::Instant::now();
    loop {
        for _ in 0..64 {
            if ready()? {
                return Ok(true);
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= limit {
            return Ok(false);
        }
    }
}

/// Which I/O engine `tcp://` runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum IoEngine {
    /// [`Inline`](IoEngine::Inline) when `bind`/`connect` is called inside a tokio runtime
    /// with I/O and timers enabled (`#[tokio::main]`, `Builder::enable_all`); elsewhere I/O
    /// threads on io_uring where the kernel allows it, epoll otherwise (one log line says so).
    ///
    /// Why: on the measured host the hand-off to an I/O thread and back cost more than the
    /// system calls themselves. A 64 B ping-pong took 16 µs p50 inline against 42 µs on I/O
    /// threads (a plain tokio `TcpStream`: 16 µs); streaming 64 B ran at 5.9 M msgs/s inline
    /// against 3.9 M; 4 MiB at 3.0-3.5 GB/s against 2.4-2.5. Since the inline Receiver
    /// spins briefly for an answer before it parks (see
    /// [`ContextBuilder::busy_poll`](crate::ContextBuilder::busy_poll)), the ping-pong takes
    /// ~5 µs inline (2026-12-07: 4.9 µs p50, tokio's loop 30 µs, I/O threads 58). Pick the I/O
    /// threads yourself to keep socket work off a busy application runtime, or for a channel
    /// that must outlive the runtime it was made in (an inline connection fails with
    /// `Unavailable` on both halves when its runtime shuts down).
    #[default]
    Auto,
    /// I/O threads owned by the context, on io_uring where the kernel allows it, epoll
    /// otherwise (one log line says so): what `Auto` picks outside a tokio runtime.
    Threads,
    /// I/O threads on io_uring (tokio-uring); connecting fails with `Unavailable` where it
    /// is refused.
    Uring,
    /// epoll (tokio's reactor), on the I/O threads.
    Epoll,
    /// epoll, with each connection run in the tasks that use its halves, on the caller's
    /// tokio runtime, instead of on an I/O thread: no cross-thread hand-off, so lower latency
    /// and a higher small-message rate; but the caller's runtime does the I/O work, and
    /// `bind`/`connect` must be called inside a tokio runtime (with I/O and timers), which must
    /// keep running while the channel is used.
    Inline,
}

impl IoEngine {
    /// Reads `HYPERFRAMES_IO` (`auto`, `inline`, `threads`, `uring`, `epoll`); unset means
    /// `Auto`.
    pub(crate) fn from_env() -> Result<IoEngine> {
        match std::env::var("HYPERFRAMES_IO") {
            Err(_) => Ok(IoEngine::Auto),
            Ok(v) => match v.to_ascii_lowercase().as_str() {
                "" | "auto" => Ok(IoEngine::Auto),
                "uring" | "io_uring" | "io-uring" => Ok(IoEngine::Uring),
                "epoll" => Ok(IoEngine::Epoll),
                "inline" => Ok(IoEngine::Inline),
                "threads" => Ok(IoEngine::Threads),
                _ => Err(Error::new(
                    ErrorKind::Config,
                    format!("HYPERFRAMES_IO={v:?}: expected auto, inline, threads, uring or epoll"),
                )),
            },
        }
    }
}

impl std::fmt::Display for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoEngine::Auto => "auto",
            IoEngine::Threads => "threads",
            IoEngine::Uring => "io_uring",
            IoEngine::Epoll => "epoll",
            IoEngine::Inline => "inline",
        })
    }
}

/// Everything a transport needs to know about its context's settings.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) limits: Limits,
    pub(crate) io_threads: usize,
    pub(crate) engine: IoEngine,
    pub(crate) send_queue: usize,
    pub(crate) send_queue_bytes: usize,
    pub(crate) recv_queue: usize,
    pub(crate) recv_queue_bytes: usize,
    pub(crate) accept_backlog: usize,
    pub(crate) max_connections: usize,
    pub(crate) max_connections_per_peer: usize,
    pub(crate) max_handshakes: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) stall_timeout: Duration,
    pub(crate) min_frame_rate: u64,
    pub(crate) keepalive: Option<Duration>,
    /// Our heartbeat interval (`None`: none sent, none expected) and how many of the peer's
    /// intervals of silence make it lost.
    pub(crate) heartbeat: Option<Duration>,
    pub(crate) heartbeat_misses: u32,
    /// How long a peer that promised no heartbeats may be silent while we read.
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) linger: Duration,
    pub(crate) busy_poll: bool,
    /// `shm://`'s own settings, kept in its folder.
    #[cfg(feature = "shm")]
    pub(crate) shm: shm::ShmConfig,
    /// `rdma://`'s own settings, kept in its folder.
    #[cfg(feature = "rdma")]
    pub(crate) rdma: rdma::RdmaSettings,
    /// Acknowledged delivery and reconnect (`connect_with`, `bind_sessions`).
    pub(crate) session: crate::session::SessionConfig,
    /// `tls://`: certificates and trust.
    #[cfg(feature = "tls")]
    pub(crate) tls: Option<tcp::tls::TlsConfig>,
    /// Where bodies sent from device memory land by default (`ContextBuilder::land_on`).
    #[cfg(feature = "cuda")]
    pub(crate) landing: Option<crate::device::Gpu>,
    /// The context's counters of messages lost to a channel's end (`Context::stats`).
    pub(crate) count: Count,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            limits: Limits::default(),
            io_threads: 1,
            engine: IoEngine::Auto,
            send_queue: 1024,
            send_queue_bytes: 16 << 20,
            recv_queue: 1024,
            recv_queue_bytes: 16 << 20,
            accept_backlog: 128,
            max_connections: 4096,
            max_connections_per_peer: 512,
            max_handshakes: 1024,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(15),
            min_frame_rate: 256 << 10,
            keepalive: Some(Duration::from_secs(10)),
            heartbeat: Some(Duration::from_secs(1)),
            heartbeat_misses: 10,
            idle_timeout: Some(Duration::from_secs(120)),
            linger: Duration::from_secs(5),
            busy_poll: false,
            #[cfg(feature = "shm")]
            shm: shm::ShmConfig::default(),
            #[cfg(feature = "rdma")]
            rdma: rdma::RdmaSettings::default(),
            session: crate::session::SessionConfig::default(),
            #[cfg(feature = "tls")]
            tls: None,
            #[cfg(feature = "cuda")]
            landing: None,
            count: Count::default(),
        }
    }
}

/// What a context counts across all its channels: messages that ended with a connection
/// instead of reaching the other side (read by [`Context::stats`](crate::Context::stats)).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    unsent: AtomicU64,
    unread: AtomicU64,
}

/// A connection's handle on its context's [`Counters`]. The connections under a session
/// do not count: the session resends what they did not deliver and counts, itself, only
/// what it gives up on.
#[derive(Clone, Debug)]
pub(crate) struct Count {
    to: Arc<Counters>,
    #[cfg_attr(
        not(any(feature = "tcp", feature = "shm", feature = "inproc")),
        allow(dead_code)
    )]
    connections: bool,
}

impl Default for Count {
    fn default() -> Count {
        Count {
            to: Arc::new(Counters::default()),
            connections: true,
        }
    }
}

impl Count {
    /// The same counters, not counted into by connections (those under sessions).
    pub(crate) fn for_sessions(&self) -> Count {
        self.muted()
    }

    /// The same counters, in which this connection counts nothing more (it has counted).
    pub(crate) fn muted(&self) -> Count {
        Count {
            to: self.to.clone(),
            connections: false,
        }
    }

    /// `n` messages a Sender had accepted were never handed over to the peer: the
    /// connection failed, or the Sender was dropped and `linger` ran out first.
    #[cfg_attr(not(any(feature = "tcp", feature = "shm")), allow(dead_code))]
    pub(crate) fn unsent(&self, n: u64) {
        if n > 0 && self.connections {
            self.to.unsent.fetch_add(n, Ordering::Relaxed);
            crate::metrics::count!("hyperframes_unsent_messages_total", n);
        }
    }

    /// `n` messages arrived after the Receiver was dropped and were discarded.
    #[cfg_attr(not(any(feature = "tcp", feature = "inproc")), allow(dead_code))]
    pub(crate) fn unread(&self, n: u64) {
        if n > 0 && self.connections {
            self.to.unread.fetch_add(n, Ordering::Relaxed);
            crate::metrics::count!("hyperframes_unread_messages_total", n);
        }
    }

    /// `n` messages a session gave up on with nobody left to hand them back to.
    pub(crate) fn session_unsent(&self, n: u64) {
        self.to.unsent.fetch_add(n, Ordering::Relaxed);
        crate::metrics::count!("hyperframes_unsent_messages_total", n);
    }

    pub(crate) fn read(&self) -> (u64, u64) {
        (
            self.to.unsent.load(Ordering::Relaxed),
            self.to.unread.load(Ordering::Relaxed),
        )
    }
}

/// The sending direction of one connection, as a transport implements it. Contract as
/// `futures_sink::Sink`: `start_send` only after `poll_ready` returned `Ready(Ok)`; it may
/// stage the message, which `submit` (or `poll_flush`) hands to the transport.
pub(crate) trait SendHalf: Send + Sync + 'static {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>>;
    fn start_send(&mut self, msg: Message) -> Result<()>;
    /// Hands staged messages to the transport. Ready once they are handed over (a transport
    /// writing into shared memory may have to wait for room).
    fn poll_submit(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>>;
    /// Takes back the last message accepted by `start_send` if it was not handed over yet
    /// (`poll_submit` was `Pending`), for `try_send`, which must not leave it behind.
    fn unstage(&mut self) -> Option<Message> {
        None
    }
    /// Memory for a body of `len` bytes, written in place: the transport's own (a shared
    /// memory arena) where it has any, the heap otherwise.
    fn poll_alloc(&mut self, _cx: &mut Context<'_>, len: usize) -> Poll<Result<BodyMut>> {
        Poll::Ready(Ok(BodyMut::zeroed(len)))
    }
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>>;
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>>;
    /// What will never be delivered, where the half knows (sessions); `None` elsewhere.
    fn take_unacknowledged(&mut self) -> Option<Vec<Message>> {
        None
    }
    /// `Some` when the half sends `body` from where it lies, without the channel staging
    /// it: `shm://` lends it over CUDA IPC when the receiver maps such memory, `rdma://` has
    /// the NIC read it (GPUDirect RDMA). The next `start_send` of a device body is that body.
    #[cfg(feature = "cuda")]
    fn takes_device(&mut self, _body: &crate::device::DeviceBody) -> Option<DeviceWay> {
        None
    }
}

/// How a sending half takes a device body as it is ([`SendHalf::takes_device`]).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceWay {
    /// `shm://`: the receiver maps the sender's memory.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    CudaIpc,
    /// `rdma://`: the NIC reads the device memory (registered as a dma-buf).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    GpuDirect,
}

/// The receiving direction of one connection. After `Ready(None)` or an error it keeps
/// returning `Ready(None)`.
pub(crate) trait RecvHalf: Send + Sync + 'static {
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Message>>>;
    /// Where bodies sent from device memory land (host memory when `None`), for a half that
    /// receives them whole (`shm://`'s CUDA IPC).
    #[cfg(feature = "cuda")]
    fn land_on(&mut self, _gpu: Option<&crate::device::Gpu>) {}
}

/// A bound address handing out connections.
pub(crate) trait AcceptHalf: Send + Sync + 'static {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>>;
    /// Connections refused before they became channels (failed handshakes).
    fn rejected(&self) -> u64;
}

/// A connection as a transport hands it over.
pub(crate) struct Parts {
    pub(crate) tx: Box<dyn SendHalf>,
    pub(crate) rx: Box<dyn RecvHalf>,
    pub(crate) transport: &'static str,
    pub(crate) local: String,
    pub(crate) peer: String,
    pub(crate) peer_limits: Limits,
    /// Who the peer proved to be (`tls://`).
    pub(crate) peer_identity: Option<Arc<identity::PeerIdentity>>,
    /// Keeps shared machinery (I/O threads) alive as long as the channel.
    pub(crate) keepalive: Option<Arc<dyn Any + Send + Sync>>,
    /// What the channel layer above the halves needs.
    pub(crate) setup: ChannelSetup,
}

/// What the channel layer needs to know of a connection besides its halves.
#[derive(Clone, Debug)]
pub(crate) struct ChannelSetup {
    /// The halves carry `Message` objects as they are (inproc, a session's application
    /// end): a device body passes through; elsewhere the channel stages it to host memory.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only device bodies ask
    pub(crate) moves_objects: bool,
    /// The largest body this end accepts: a body that arrives in pieces, as a whole.
    pub(crate) max_body: u64,
    /// Where bodies sent from device memory land (host memory when `None`).
    #[cfg(feature = "cuda")]
    pub(crate) landing: Option<crate::device::Gpu>,
}

impl ChannelSetup {
    pub(crate) fn new(cfg: &Config, moves_objects: bool) -> ChannelSetup {
        ChannelSetup {
            moves_objects,
            max_body: cfg.limits.max_body,
            #[cfg(feature = "cuda")]
            landing: cfg.landing.clone(),
        }
    }

    /// Byte-stream defaults for a connection made outside a context (`rdma::channel_pair`).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn with_max_body(max_body: u64) -> ChannelSetup {
        ChannelSetup {
            moves_objects: false,
            max_body,
            #[cfg(feature = "cuda")]
            landing: None,
        }
    }
}

#[cfg(feature = "tcp")] // the only transport that adds to it
impl Parts {
    /// Adds `what` to what the channel keeps alive (and drops with its last half).
    pub(crate) fn keep_alive(&mut self, what: Arc<dyn Any + Send + Sync>) {
        self.keepalive = Some(match self.keepalive.take() {
            Some(held) => Arc::new((held, what)),
            None => what,
        });
    }
}

/// One URL scheme: the transport it names, how its addresses are written, and the feature
/// that compiles it in.
pub(crate) struct Scheme {
    pub(crate) name: &'static str,
    pub(crate) feature: &'static str,
    /// Checks the address part of a URL (the whole URL for the error message).
    pub(crate) address: fn(url: &str, rest: &str) -> Result<Address>,
    /// The transport, where its feature is on.
    pub(crate) open: Option<&'static Open>,
}

/// A listener's accept half and its URL.
pub(crate) type Bound = (Box<dyn AcceptHalf>, String);

/// A transport's entry points, given the context's transports (for its per-context state and
/// the configuration) and an address in its shape.
pub(crate) struct Open {
    pub(crate) connect: for<'a> fn(&'a Transports, &'a Address) -> BoxFuture<'a, Result<Parts>>,
    pub(crate) bind: for<'a> fn(&'a Transports, &'a Address) -> BoxFuture<'a, Result<Bound>>,
}

/// An entry of [`SCHEMES`]: `open` exists only where `feature` is on.
macro_rules! scheme {
    ($name:literal, $feature:literal, $address:path, $open:path) => {
        Scheme {
            name: $name,
            feature: $feature,
            address: $address,
            #[cfg(feature = $feature)]
            open: Some(&$open),
            #[cfg(not(feature = $feature))]
            open: None,
        }
    };
}

/// Every scheme, compiled in or not (a URL of a scheme left out parses, and connecting to it
/// names the feature to enable). A new transport is its module and one line here.
pub(crate) static SCHEMES: &[Scheme] = &[
    scheme!("tcp", "tcp", endpoint::host_port, tcp::TCP),
    scheme!("tls", "tls", endpoint::host_port, tcp::TLS),
    scheme!("shm", "shm", endpoint::shm_name, shm::SHM),
    scheme!("inproc", "inproc", endpoint::name, inproc::INPROC),
    scheme!("rdma", "rdma", endpoint::host_port, rdma::RDMA),
    scheme!("rdma+sim", "rdma", endpoint::name, rdma::RDMA_SIM),
];

/// `tcp://, tls://, …`, for messages.
pub(crate) fn scheme_list() -> String {
    SCHEMES
        .iter()
        .map(|s| format!("{}://", s.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The transports of one context, with their per-context state.
pub(crate) struct Transports {
    cfg: Config,
    #[cfg(feature = "inproc")]
    inproc: Arc<inproc::Registry>,
    #[cfg(feature = "tcp")]
    tcp: tcp::Tcp,
    #[cfg(feature = "rdma")]
    rdma_sim: Arc<rdma::SimRegistry>,
    /// The same transports for the connections under sessions (made on first use): they
    /// share the names and counters, but their connections do not count what the session
    /// resends.
    sessions: std::sync::OnceLock<Arc<Transports>>,
}

impl Transports {
    pub(crate) fn new(cfg: Config) -> Transports {
        Transports {
            #[cfg(feature = "inproc")]
            inproc: Arc::new(inproc::Registry::new(cfg.clone())),
            #[cfg(feature = "tcp")]
            tcp: tcp::Tcp::new(cfg.clone()),
            #[cfg(feature = "rdma")]
            rdma_sim: Arc::new(rdma::SimRegistry::new(cfg.clone())),
            cfg,
            sessions: std::sync::OnceLock::new(),
        }
    }

    /// The transports sessions make their connections with.
    pub(crate) fn for_sessions(&self) -> Arc<Transports> {
        self.sessions
            .get_or_init(|| {
                let cfg = Config {
                    count: self.cfg.count.for_sessions(),
                    ..self.cfg.clone()
                };
                Arc::new(Transports {
                    #[cfg(feature = "inproc")]
                    inproc: self.inproc.clone(),
                    #[cfg(feature = "tcp")]
                    tcp: tcp::Tcp::new(cfg.clone()),
                    #[cfg(feature = "rdma")]
                    rdma_sim: self.rdma_sim.clone(),
                    cfg,
                    sessions: std::sync::OnceLock::new(),
                })
            })
            .clone()
    }

    pub(crate) fn config(&self) -> &Config {
        &self.cfg
    }

    /// The engine `tcp://` runs on, once it has started.
    pub(crate) fn tcp_engine(&self) -> Option<IoEngine> {
        #[cfg(feature = "tcp")]
        return self
            .tcp
            .engine()
            .or_else(|| self.sessions.get().and_then(|s| s.tcp.engine()));
        #[cfg(not(feature = "tcp"))]
        None
    }

    pub(crate) async fn connect(&self, ep: &Endpoint) -> Result<Parts> {
        (open(ep)?.connect)(self, ep.address()).await
    }

    pub(crate) async fn bind(&self, ep: &Endpoint) -> Result<Bound> {
        (open(ep)?.bind)(self, ep.address()).await
    }
}

/// The transport of `ep`'s scheme, or why this build has none.
fn open(ep: &Endpoint) -> Result<&'static Open> {
    let scheme = SCHEMES.iter().find(|s| s.name == ep.scheme());
    scheme.and_then(|s| s.open).ok_or_else(|| {
        let (name, feature) = scheme.map_or((ep.scheme(), "?"), |s| (s.name, s.feature));
        Error::new(
            ErrorKind::UnsupportedScheme,
            format!(
                "{ep}: the {name}:// transport is not compiled in (enable the `{feature}` feature)"
            ),
        )
    })
}
