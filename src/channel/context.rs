//! `Context`: settings, I/O threads and transport state shared by channels.

use std::sync::Arc;
use std::time::Duration;

use super::{Channel, Listener};
use crate::error::{Error, ErrorKind, Result};
use crate::message::Limits;
use crate::transport::Endpoint;
use crate::transport::{Config, IoEngine, Transports};

/// The root object: holds the settings, the I/O threads (started on first use of `tcp://`)
/// and the `inproc://` names. Cheap to clone; clones share everything.
///
/// The I/O threads live as long as the context or any channel or listener made from it.
/// A context works from any executor: `bind` and `connect` hand their work to its I/O
/// threads, so it is safe to use from `#[tokio::main]` (multi-thread or current-thread)
/// without nesting runtimes.
#[derive(Clone)]
pub struct Context {
    inner: Arc<Transports>,
}

impl Default for Context {
    fn default() -> Context {
        Context::new()
    }
}

impl Context {
    /// A context with default settings (see [`ContextBuilder`]). An unreadable
    /// `HYPERFRAMES_IO` is logged and ignored here; [`ContextBuilder::build`] reports it.
    pub fn new() -> Context {
        match Context::builder().build() {
            Ok(ctx) => ctx,
            Err(e) => {
                tracing::warn!("{e:#}; using defaults");
                Context {
                    inner: Arc::new(Transports::new(Config::default())),
                }
            }
        }
    }

    /// A builder for settings other than the defaults.
    pub fn builder() -> ContextBuilder {
        ContextBuilder {
            cfg: Config::default(),
            env_engine: IoEngine::from_env(),
        }
    }

    /// Listens at `url` (`tcp://0.0.0.0:5555`, `tcp://[::1]:0`, `inproc://name`). Port 0
    /// picks a free port: [`Listener::local_url`] tells which.
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped before completion, nothing stays bound.
    pub async fn bind(&self, url: &str) -> Result<Listener> {
        let ep = Endpoint::parse(url)?;
        let (half, local_url) = self.inner.bind(&ep).await?;
        Ok(Listener::new(half, local_url))
    }

    /// Connects to a listener at `url` and completes the handshake.
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped before completion, a connection that was being set up is
    /// closed.
    pub async fn connect(&self, url: &str) -> Result<Channel> {
        let ep = Endpoint::parse(url)?;
        let parts = self.inner.connect(&ep).await?;
        Ok(Channel::from_parts(parts))
    }

    /// Connects a [session](crate::session) to a listener made with
    /// [`bind_sessions`](Self::bind_sessions): a `Channel` whose messages are acknowledged
    /// by the peer and resent after a broken connection, which `policy` reconnects.
    ///
    /// The first connection is made once: its error is returned as [`connect`](Self::connect)
    /// would return it. Must be called inside a tokio runtime (with timers), which drives the
    /// session and must keep running while it is used.
    ///
    /// # Cancel safety
    /// As [`connect`](Self::connect).
    pub async fn connect_with(
        &self,
        url: &str,
        policy: crate::session::Reconnect,
    ) -> Result<Channel> {
        let ep = Endpoint::parse(url)?;
        crate::session::connect(self.inner.for_sessions(), ep, policy).await
    }

    /// Listens at `url` for [sessions](crate::session) (peers that call
    /// [`connect_with`](Self::connect_with)). `accept` yields each new session once; a peer
    /// reconnecting to a session it has resumes it, unseen by `accept`. A connection that does
    /// not open a session within the handshake timeout is counted in `rejected` and dropped.
    /// Must be called inside a tokio runtime, which drives the sessions.
    pub async fn bind_sessions(&self, url: &str) -> Result<Listener> {
        let ep = Endpoint::parse(url)?;
        crate::session::bind(&self.inner.for_sessions(), &ep).await
    }

    /// The limits this context enforces on what it receives (and advertises to peers).
    pub fn limits(&self) -> &Limits {
        &self.inner.config().limits
    }

    /// The engine `tcp://` runs on: `None` before the first `tcp://` bind or connect; then
    /// `Inline` once a connection or listener ran inline, else `Uring` or `Epoll` (the I/O
    /// threads').
    pub fn io_engine(&self) -> Option<IoEngine> {
        self.inner.tcp_engine()
    }

    /// What this context's channels lost when they ended, counted since it was made: the
    /// way to learn what a dropped [`Sender`](crate::Sender) or
    /// [`Receiver`](crate::Receiver) left behind, which no call can return.
    pub fn stats(&self) -> ContextStats {
        let (unsent, unread) = self.inner.config().count.read();
        ContextStats { unsent, unread }
    }
}

/// Counters of a [`Context`], from [`Context::stats`].
///
/// A `Sender` dropped with messages still queued goes on delivering them in the background
/// for the context's [`linger`](ContextBuilder::linger) (5 s) once the channel's other half
/// is gone too (shm: from the drop of the Sender); a connection that fails ends that early. What could not be delivered then is counted here (and logged at `warn`).
/// Closing with [`Sender::close`](crate::Sender::close) instead reports the failure to the
/// caller.
///
/// The counts are of messages not handed over to the peer's side: written to its socket
/// (tcp, tls) or its ring (shm). A message that was may still be lost with a peer that dies
/// before reading it; only [sessions](crate::session) acknowledge delivery. The connections
/// under a session do not count here: the session resends what they did not deliver, and
/// counts in `unsent` only what it gives up on once its Sender is gone (nobody can
/// [take it back](crate::Sender::take_unacknowledged)).
///
/// Where each transport counts:
///
/// | | tcp, tls | shm | inproc | rdma |
/// |---|---|---|---|---|
/// | `unsent` | yes | yes | never any: a dropped Sender's messages stay queued for the Receiver | not yet |
/// | `unread` | yes | no: what is left in the ring when the Receiver goes is not counted (the peer's Sender fails with `STOP`) | yes | not yet |
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContextStats {
    /// Messages a `send`, `feed` or `try_send` accepted that were never handed over (all of
    /// their bytes, on tcp: on the I/O thread engines, a message of a write the kernel took
    /// only part of counts, although the peer may get it).
    pub unsent: u64,
    /// Messages that arrived for a Receiver already dropped, read and discarded.
    pub unread: u64,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", self.inner.config())
            .finish()
    }
}

/// Settings for a [`Context`]. Every setter documents its default.
#[derive(Debug)]
#[must_use]
pub struct ContextBuilder {
    cfg: Config,
    env_engine: Result<IoEngine>,
}

impl ContextBuilder {
    /// Where bodies sent from device memory land on this context's channels: in memory of
    /// `gpu` (a handler gets a device body without staging by hand), or host memory (the
    /// default). [`Receiver::land_on`](crate::Receiver::land_on) changes it per channel.
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn land_on(mut self, gpu: crate::device::Gpu) -> Self {
        self.cfg.landing = Some(gpu);
        self
    }

    /// Receive limits advertised to peers and enforced on what arrives. Default:
    /// [`Limits::default`] (64 MiB bodies, 4 KiB / 32 entries of metadata).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.cfg.limits = limits;
        self
    }

    /// Largest body accepted, in bytes. Default 64 MiB; at most 1 TiB.
    pub fn max_body(mut self, bytes: u64) -> Self {
        self.cfg.limits.max_body = bytes;
        self
    }

    /// Largest encoded metadata accepted, in bytes. Default 4096.
    pub fn max_meta_bytes(mut self, bytes: u32) -> Self {
        self.cfg.limits.max_meta_bytes = bytes;
        self
    }

    /// Most metadata entries accepted. Default 32.
    pub fn max_meta_entries(mut self, entries: u16) -> Self {
        self.cfg.limits.max_meta_entries = entries;
        self
    }

    /// Number of I/O threads for `tcp://` (connections are spread over them). Default 1.
    pub fn io_threads(mut self, n: usize) -> Self {
        self.cfg.io_threads = n;
        self
    }

    /// The I/O engine. Default: `HYPERFRAMES_IO` if set (`auto`, `inline`, `threads`, `uring`,
    /// `epoll`), else [`IoEngine::Auto`]. Setting it here overrides the environment.
    pub fn io_engine(mut self, engine: IoEngine) -> Self {
        self.cfg.engine = engine;
        self.env_engine = Ok(engine);
        self
    }

    /// Messages and body bytes queued per channel between a `Sender` and its transport.
    /// Default 1024 messages, 16 MiB (one larger message is always admitted).
    pub fn send_queue(mut self, messages: usize, bytes: usize) -> Self {
        self.cfg.send_queue = messages;
        self.cfg.send_queue_bytes = bytes;
        self
    }

    /// Messages and body bytes received and queued per channel before reading from the
    /// peer pauses (which backpressures the peer). Default 1024 messages, 16 MiB.
    pub fn recv_queue(mut self, messages: usize, bytes: usize) -> Self {
        self.cfg.recv_queue = messages;
        self.cfg.recv_queue_bytes = bytes;
        self
    }

    /// Connections accepted but not yet taken by [`Listener::accept`]. Default 128.
    pub fn accept_backlog(mut self, n: usize) -> Self {
        self.cfg.accept_backlog = n;
        self
    }

    /// Deadline for establishing a connection. Default 10 s.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.cfg.connect_timeout = d;
        self
    }

    /// The most connections one `tcp://` listener holds at once, handshakes in progress
    /// included. While it holds them all it accepts nothing more: new connections wait in the
    /// kernel's backlog (and time out there) until one ends. Default 4096.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.cfg.max_connections = n;
        self
    }

    /// The most connections one peer address may hold at one `tcp://` listener, so that one
    /// host cannot take every place; a connection past it is closed at once (before a byte
    /// is read) and counted in [`Listener::rejected`](crate::Listener::rejected). Default
    /// 512. (Every local client shares one address, `127.0.0.1`.)
    pub fn max_connections_per_peer(mut self, n: usize) -> Self {
        self.cfg.max_connections_per_peer = n;
        self
    }

    /// The most handshakes (TLS and hyperframes) one `tcp://` or `tls://` listener runs at
    /// once: while that many connections have not finished theirs, it accepts nothing more
    /// (new connections wait in the kernel's backlog), so a flood of connections that open
    /// and say nothing, or start a TLS handshake and stall, holds at most this many places,
    /// each for at most [`handshake_timeout`](Self::handshake_timeout), and cannot make the
    /// listener run thousands of key exchanges at once. Connections that finished their
    /// handshake do not count. Default 1024.
    pub fn max_handshakes(mut self, n: usize) -> Self {
        self.cfg.max_handshakes = n;
        self
    }

    /// Deadline for the peer's handshake after the connection is up (on `tls://`, the TLS
    /// handshake and then ours, each within it). Default 5 s.
    pub fn handshake_timeout(mut self, d: Duration) -> Self {
        self.cfg.handshake_timeout = d;
        self
    }

    /// How long a peer may stall in the middle of a frame before the connection is closed
    /// with [`ErrorKind::TimedOut`]: the grace of the frame deadline (see
    /// [`min_frame_rate`](Self::min_frame_rate)). Idle time between frames is never limited.
    /// Default 15 s.
    pub fn stall_timeout(mut self, d: Duration) -> Self {
        self.cfg.stall_timeout = d;
        self
    }

    /// The slowest a frame may arrive, in bytes per second on average since its first bytes
    /// (`tcp://`): a frame of `b` bytes so far that began `t` ago fails with
    /// [`ErrorKind::TimedOut`] once `t > stall_timeout + b / min_frame_rate`. A peer
    /// trickling bytes into a large body cannot hold its buffer for ever, and a steady link
    /// at this rate or faster never trips it. Default 256 KiB/s.
    pub fn min_frame_rate(mut self, bytes_per_second: u64) -> Self {
        self.cfg.min_frame_rate = bytes_per_second;
        self
    }

    /// TCP keepalive idle time, after which a silent peer is probed (every second, three
    /// times) and declared lost. `None` disables. Default 10 s.
    pub fn keepalive(mut self, idle: Option<Duration>) -> Self {
        self.cfg.keepalive = idle;
        self
    }

    /// Heartbeats (`tcp://`, `shm://`, `rdma://`): each side is heard from at least every
    /// `interval` while it can write (a 24-byte `HEARTBEAT` frame on tcp, a counter in the
    /// shared segment on shm, when it has nothing else to send; on rdma a counter in the
    /// region the peer's keepalive reads, advanced every
    /// `rdma_keepalive` instead), and a peer that promised so is declared lost
    /// after `misses` of its intervals with nothing heard: both halves fail with
    /// [`ErrorKind::ConnectionLost`] naming the peer and how long it was silent. Silence
    /// counts only while this side reads, so a receiver that stops reading (backpressure)
    /// never fails its peer for it.
    ///
    /// This is what finds a peer that is alive to the kernel but not running: stopped
    /// (SIGSTOP, a debugger), deadlocked, or with its runtime blocked; TCP keepalive and a
    /// closed socket only find a dead host or process. `None` turns it off both ways (we send
    /// none and watch for none); each side decides for itself, from what the other
    /// announced in its handshake.
    ///
    /// Default: every 1 s, lost after 10 (10 to 10.5 s): a peer must stall a whole 10 s to
    /// be dropped, longer than a long garbage-collection or swap pause, while a frozen peer is
    /// found about as fast as keepalive finds a dead host; it costs one small write per idle
    /// second per direction. With inline tcp (`IoEngine::Inline`) heartbeats come from the
    /// connection's task on your runtime: a task that blocks that runtime for longer than
    /// the limit looks frozen to the peer, as it is. Misses at least 2; the interval 1 ms
    /// to 1 h.
    pub fn heartbeat(mut self, interval: Option<Duration>, misses: u32) -> Self {
        self.cfg.heartbeat = interval;
        self.cfg.heartbeat_misses = misses;
        self
    }

    /// How long a peer that promised no heartbeats (it turned them off, or predates them)
    /// may send nothing while this side reads, before both halves fail with
    /// [`ErrorKind::ConnectionLost`] (`tcp://`, `tls://`, `shm://`). Peers that promised
    /// heartbeats are held to their promise instead (see [`heartbeat`](Self::heartbeat)), so
    /// this only reclaims connections nobody speaks on: abandoned, or held open on purpose
    /// to take a listener's places. As with heartbeats, silence counts only while this side
    /// reads. `None` keeps such connections for ever. Default 120 s; at least 1 ms.
    pub fn idle_timeout(mut self, idle: Option<Duration>) -> Self {
        self.cfg.idle_timeout = idle;
        self
    }

    /// Settings of [sessions](crate::session): window, acknowledgement batch, how long a
    /// listener waits for a session's peer to reconnect. Default:
    /// [`SessionConfig::default`](crate::session::SessionConfig).
    pub fn session(mut self, cfg: crate::session::SessionConfig) -> Self {
        self.cfg.session = cfg;
        self
    }

    /// How long a dropped channel goes on delivering what its Sender left, in the
    /// background: on tcp and tls once both halves are gone, on shm from the Sender's drop,
    /// for a session once both halves are gone and it has no connection; the tcp I/O
    /// threads also keep flushing for this long after the last user of the context is gone.
    /// What is still undelivered then is counted in [`Context::stats`]. Default 5 s.
    pub fn linger(mut self, d: Duration) -> Self {
        self.cfg.linger = d;
        self
    }

    /// Never park: a side waiting for data or room keeps checking where the wait is, trading
    /// a core per waiting task for the lowest latency. `shm://` polls the ring instead of
    /// sleeping on its wake socket; `tcp://` on the inline engine calls `recv` again instead
    /// of waiting for epoll (the I/O-thread engines ignore it); `inproc://` checks the queue.
    /// Between checks the task yields to its runtime, so other tasks still run.
    ///
    /// Default off: `shm://` and `inproc://` spin for 20 µs (when the peer runs on another
    /// thread), then park; `tcp://` on the inline engine spins for 20 µs (non-blocking
    /// `recv`s a microsecond apart, yielding its thread to the OS in between) only when it
    /// waits for an answer (it wrote since it last waited); after three spins that caught
    /// nothing it parks at once, trying a spin again after 1, 2, 4 .. 64 waits, until one
    /// catches the answer; on a machine with one CPU it parks at once. A spinning wait holds
    /// its runtime thread for up to those 20 µs.
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.cfg.busy_poll = on;
        self
    }

    /// The shared-memory segment this side creates for each `shm://` connection it accepts:
    /// descriptors per direction (a power of two; default 4096) and body arena bytes per
    /// direction (a multiple of 4 KiB; default 32 MiB). Bodies larger than the arena travel
    /// as memfds of their own.
    #[cfg(feature = "shm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
    pub fn shm_segment(mut self, ring_entries: u32, arena_bytes: u64) -> Self {
        self.cfg.shm.ring_entries = ring_entries;
        self.cfg.shm.arena_bytes = arena_bytes;
        self
    }

    /// Accept `shm://` peers running as any user. Default: only this process's own user
    /// (checked with `SO_PEERCRED`). With it, the socket of `shm:///path.sock` is made
    /// connectable by every user (mode 0666; put it in a directory they can reach), and
    /// bodies are copied on receive unless [`shm_zero_copy`](Self::shm_zero_copy) says
    /// otherwise.
    #[cfg(feature = "shm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
    pub fn shm_allow_any_user(mut self, allow: bool) -> Self {
        self.cfg.shm.any_uid = allow;
        self
    }

    /// Whether `shm://` bodies are zero-copy views of the shared memory: received bodies read
    /// straight from the peer's arena and [`Sender::alloc`](crate::Sender::alloc) lends
    /// blocks of ours. That is only sound if the peer never writes a block it handed over or
    /// does not own, so it is for a trusted peer: by default, a peer running as this user
    /// (which could write this process's memory anyway), not one admitted with
    /// [`shm_allow_any_user`](Self::shm_allow_any_user). Off: received bodies are copied out
    /// of the arena and `alloc` lends heap memory (one copy each way). Bodies larger than the
    /// arena are sealed memfds, immutable, and never copied on receive.
    #[cfg(feature = "shm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "shm")))]
    pub fn shm_zero_copy(mut self, on: bool) -> Self {
        self.cfg.shm.zero_copy = Some(on);
        self
    }

    /// Whether device bodies a `shm://` peer sends are mapped from its memory (CUDA IPC; see
    /// [`crate::device`]) when a channel lands bodies on a device, rather than staged through
    /// host memory. Like [`shm_zero_copy`](Self::shm_zero_copy), it hands the application
    /// memory the peer can write, so by default it is on for a peer of this user and off for
    /// one admitted with [`shm_allow_any_user`](Self::shm_allow_any_user). Off also where the
    /// peers cannot map each other's device memory (containers without a shared IPC
    /// namespace, GPUs without peer access): a body that cannot be mapped ends the channel.
    #[cfg(all(feature = "shm", feature = "cuda"))]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "shm", feature = "cuda"))))]
    pub fn shm_cuda_ipc(mut self, on: bool) -> Self {
        self.cfg.shm.cuda_ipc = Some(on);
        self
    }

    /// `rdma://` (feature `rdma`): receive buffers posted per connection (the peer's
    /// credits; default 64) and their size in bytes (default 8704). Messages whose type,
    /// metadata and body fit one buffer go in one send; larger bodies by rendezvous (the
    /// receiver reads them with RDMA read). The size must hold the largest type and metadata
    /// (`max_meta_bytes` + 319 bytes).
    #[cfg(feature = "rdma")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rdma")))]
    pub fn rdma_buffers(mut self, slots: u32, slot_bytes: u32) -> Self {
        self.cfg.rdma.recv_slots = slots;
        self.cfg.rdma.slot_size = slot_bytes;
        self
    }

    /// `rdma://` (feature `rdma`): registered memory each connection may pin for bodies, in
    /// bytes, per direction: bodies lent to the peer by rendezvous (each registered where it
    /// lies until the peer has read it) and the pool bodies are received into (registered as
    /// needed and reused). Default 256 MiB; at least one `max_body` (rounded up to a power of
    /// two). When it is used up, senders wait (backpressure), nothing fails.
    #[cfg(feature = "rdma")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rdma")))]
    pub fn rdma_pool_bytes(mut self, bytes: u64) -> Self {
        self.cfg.rdma.pool_bytes = bytes;
        self
    }

    /// `rdma://` with device bodies (features `rdma` and `cuda`): whether the NIC reads a
    /// device body straight from device memory, registered as a dma-buf (GPUDirect RDMA:
    /// `ChannelInfo::device_path` says `"gpudirect"`). Default on; it takes effect where the
    /// device exports dma-bufs and the NIC's driver registers them, and bodies are staged
    /// through host memory otherwise (said once per channel in the log). Turn it off where
    /// the GPU and the NIC sit under different PCIe root complexes or sockets, where reading
    /// the GPU across them can be slower than staging.
    #[cfg(feature = "rdma")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rdma")))]
    pub fn rdma_gpudirect(mut self, on: bool) -> Self {
        self.cfg.rdma.gpudirect = on;
        self
    }

    /// `rdma://` (feature `rdma`): how long a connection may be idle before the peer is
    /// probed with an RDMA read (a dead peer fails it: `ConnectionLost` on both halves).
    /// Default 1 s.
    #[cfg(feature = "rdma")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rdma")))]
    pub fn rdma_keepalive(mut self, idle: Duration) -> Self {
        self.cfg.rdma.keepalive = idle;
        self
    }

    /// Certificates and trust for `tls://` (feature `tls`): what this side proves and whom it
    /// accepts; see [`TlsConfig`](crate::TlsConfig). Without it, binding or connecting to
    /// `tls://` fails with [`ErrorKind::Config`]. Default: none.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls(mut self, tls: crate::transport::tcp::tls::TlsConfig) -> Self {
        self.cfg.tls = Some(tls);
        self
    }

    /// Checks the settings and makes the context.
    pub fn build(mut self) -> Result<Context> {
        self.cfg.engine = self.env_engine?;
        let c = &self.cfg;
        let bad = |what: String| Err(Error::new(ErrorKind::Config, what));
        if c.io_threads == 0 || c.io_threads > 256 {
            return bad(format!("io_threads is {}; use 1 to 256", c.io_threads));
        }
        if c.limits.max_body > Limits::MAX_BODY_CEILING {
            return bad(format!(
                "max_body is {}; at most {} (1 TiB)",
                c.limits.max_body,
                Limits::MAX_BODY_CEILING
            ));
        }
        if c.send_queue == 0 || c.recv_queue == 0 || c.accept_backlog == 0 {
            return bad("queue sizes and the accept backlog must be at least 1".into());
        }
        if c.min_frame_rate == 0 {
            return bad("min_frame_rate must be at least 1 byte per second".into());
        }
        if c.max_connections == 0 || c.max_connections_per_peer == 0 || c.max_handshakes == 0 {
            return bad(
                "max_connections, max_connections_per_peer and max_handshakes must be at least 1"
                    .into(),
            );
        }
        if c.send_queue > 1 << 20 || c.recv_queue > 1 << 20 {
            return bad("queues hold at most 1 Mi messages".into());
        }
        if c.handshake_timeout.is_zero() || c.connect_timeout.is_zero() || c.stall_timeout.is_zero()
        {
            return bad("timeouts must be longer than zero".into());
        }
        if let Some(d) = c.heartbeat
            && !(Duration::from_millis(1)..=Duration::from_secs(3600)).contains(&d)
        {
            return bad(format!(
                "heartbeat interval {d:?}: use 1 ms to 1 h, or None"
            ));
        }
        if c.idle_timeout.is_some_and(|d| d < Duration::from_millis(1)) {
            return bad("the idle timeout must be at least 1 ms, or None".into());
        }
        if c.heartbeat_misses < 2 {
            return bad("heartbeat misses must be at least 2".into());
        }
        // Each transport checks its own settings.
        #[cfg(feature = "shm")]
        c.shm.validate()?;
        #[cfg(feature = "rdma")]
        crate::transport::rdma::validate(c)?;
        Ok(Context {
            inner: Arc::new(Transports::new(self.cfg)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_validates() {
        assert_eq!(
            Context::builder().io_threads(0).build().unwrap_err().kind(),
            ErrorKind::Config
        );
        assert_eq!(
            Context::builder()
                .max_body(u64::MAX)
                .build()
                .unwrap_err()
                .kind(),
            ErrorKind::Config
        );
        let ctx = Context::builder().max_meta_entries(4).build().unwrap();
        assert_eq!(ctx.limits().max_meta_entries, 4);
        assert_eq!(ctx.io_engine(), None);
    }

    /// The shm settings are checked by the shm transport's own `validate`, through `build`.
    #[cfg(feature = "shm")]
    #[test]
    fn builder_validates_the_shm_settings() {
        for (entries, arena, says) in [
            (3, 1 << 20, "power of two"),
            (1 << 21, 1 << 20, "power of two"),
            (256, 4097, "multiple of 4096"),
            (256, 0, "multiple of 4096"),
        ] {
            let err = Context::builder()
                .shm_segment(entries, arena)
                .build()
                .unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config);
            assert!(err.to_string().contains(says), "{err}");
        }
        assert!(Context::builder().shm_segment(16, 64 << 10).build().is_ok());
    }
}
