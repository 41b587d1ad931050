//! `rdma://host:port`: RDMA (InfiniBand, RoCE) with a sans-IO protocol core.
//!
//! # Organization
//! * [`proto`] — the protocol, sans-IO: set-up exchange, eager sends into pre-posted
//!   receive buffers with credits, rendezvous by RDMA read for large bodies, `FIN`s. Its module
//!   docs are the wire specification.
//! * [`verbs`] — the [`Verbs`](verbs::Verbs) trait the protocol is driven over: register
//!   memory, post receive/send/read/write, completions as futures.
//! * [`pool`] — a bounded pool of registered buffers, reused, returned on drop.
//! * [`sim`] — simulated verbs (two queue pairs in memory) enforcing what a NIC enforces,
//!   with injectable faults: how CI tests the protocol.
//! * `driver` — the async shell: one task per connection, and the user halves.
//! * `sideway` — the hardware backend on sideway (MPL-2.0; rdma-core loaded at run time),
//!   behind a device check: the default.
//! * `async_rdma` — the second hardware backend, on async-rdma (GPL-3.0-only, feature
//!   `rdma-async-rdma`), chosen with `HYPERFRAMES_RDMA_BACKEND=async-rdma`.
//! * `setup` — what both share: the device check, the environment's settings, the TCP
//!   exchange that connects two queue pairs (the same bytes for both backends).
//!
//! `rdma+sim://name` runs the same transport over the simulation, inside one process (names
//! are per `Context`, as for `inproc://`): the channel API end to end without hardware.
//!
//! # This module in the API (feature `rdma`)
//! The testing and simulation seam of `rdma://`: the sans-IO protocol ([`proto`]), the verbs
//! trait it is driven over ([`verbs`]), the registered-buffer pool ([`pool`]) and the
//! simulated verbs with fault injection ([`sim`]), plus [`channel_pair`], which runs a pair of
//! [`Channel`]s over any verbs backend (the simulation, in tests), and [`devices`].
//! Applications use `rdma://` URLs and never need this module.

#[cfg(feature = "rdma-async-rdma")]
pub(crate) mod async_rdma;
pub(crate) mod cm;
pub(crate) mod driver;
pub mod pool;
pub mod proto;
pub(crate) mod setup;
pub(crate) mod sideway;
pub mod sim;
pub mod verbs;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::names::Names;
use super::{AcceptHalf, Config, Open, Parts};
use crate::channel::Channel;
use crate::error::{Error, ErrorKind, Result};
use driver::Driver;
pub use driver::RdmaConfig;
use verbs::Verbs;

/// `rdma://`'s settings of a context (set through `ContextBuilder::rdma_*`); the rest of
/// a connection's [`RdmaConfig`] comes from the context's common settings.
#[derive(Clone, Debug)]
pub(crate) struct RdmaSettings {
    pub(crate) recv_slots: u32,
    pub(crate) slot_size: u32,
    pub(crate) pool_bytes: u64,
    pub(crate) keepalive: std::time::Duration,
    pub(crate) gpudirect: bool,
}

impl Default for RdmaSettings {
    fn default() -> RdmaSettings {
        let d = RdmaConfig::default();
        RdmaSettings {
            recv_slots: d.recv_slots,
            slot_size: d.slot_size,
            pool_bytes: d.pool_bytes,
            keepalive: d.keepalive,
            gpudirect: d.gpudirect,
        }
    }
}

/// Checks the RDMA settings of `cfg` (by `ContextBuilder::build`).
pub(crate) fn validate(cfg: &Config) -> Result<()> {
    if cfg.rdma.keepalive.is_zero() {
        return Err(Error::new(
            ErrorKind::Config,
            "the rdma keepalive must be longer than zero",
        ));
    }
    config(cfg).validate()
}

/// The RDMA settings of a context.
pub(crate) fn config(cfg: &Config) -> RdmaConfig {
    RdmaConfig {
        recv_slots: cfg.rdma.recv_slots,
        slot_size: cfg.rdma.slot_size,
        pool_bytes: cfg.rdma.pool_bytes,
        send_queue: cfg.send_queue,
        recv_queue: cfg.recv_queue,
        recv_queue_bytes: cfg.recv_queue_bytes,
        keepalive: cfg.rdma.keepalive,
        gpudirect: cfg.rdma.gpudirect,
        heartbeat_misses: if cfg.heartbeat.is_some() {
            cfg.heartbeat_misses
        } else {
            0
        },
        handshake_timeout: cfg.handshake_timeout,
        limits: cfg.limits,
    }
}

/// A connected pair of channels over `a` and `b` (the two sides of one connection, such as
/// [`sim::pair`]), with `cfg` on both sides; each side waits at most `cfg.handshake_timeout`
/// for the other's `HELLO`. Needs a tokio runtime: each side runs a driver task. Both sides
/// post their receives before either sends.
pub async fn channel_pair<V: Verbs>(a: V, b: V, cfg: RdmaConfig) -> Result<(Channel, Channel)> {
    let t = cfg.handshake_timeout;
    let pa = prepare(Arc::new(a), cfg.clone(), "rdma-pair#b".into())?;
    let pb = prepare(Arc::new(b), cfg, "rdma-pair#a".into())?;
    let (sa, sb) = (pa.spawn(), pb.spawn());
    let (pa, pb) = tokio::join!(
        finish(sa, t, "rdma-pair#a".into()),
        finish(sb, t, "rdma-pair#b".into())
    );
    Ok((Channel::from_parts(pa?), Channel::from_parts(pb?)))
}

fn runtime() -> Result<()> {
    tokio::runtime::Handle::try_current()
        .map(|_| ())
        .map_err(|_| {
            Error::new(
                ErrorKind::Unavailable,
                "rdma:// needs a tokio runtime in the caller (a driver task runs each connection)",
            )
        })
}

/// Starts a connection's driver over `verbs` (receives are posted before this returns) and
/// waits for the peer's `HELLO` (at most `cfg.handshake_timeout`).
pub(crate) async fn establish<V: Verbs>(
    verbs: Arc<V>,
    cfg: RdmaConfig,
    setup: crate::transport::ChannelSetup,
    local: String,
    peer: String,
) -> Result<Parts> {
    let t = cfg.handshake_timeout;
    let mut p = prepare(verbs, cfg, peer)?;
    p.started.setup = setup;
    finish(p.spawn(), t, local).await
}

/// A driver whose receives are posted, not yet running.
pub(crate) struct Prepared {
    run: Pin<Box<dyn Future<Output = ()> + Send>>,
    started: Started,
}

impl Prepared {
    /// Runs the driver on the current tokio runtime.
    pub(crate) fn spawn(self) -> Started {
        tokio::spawn(self.run);
        self.started
    }
}

/// A driver started, halves made, `HELLO` not yet received.
pub(crate) struct Started {
    sh: Arc<driver::Shared>,
    tx: Box<dyn super::SendHalf>,
    rx: Box<dyn super::RecvHalf>,
    /// What the channel needs besides the halves: our own limit on bodies, and (in a
    /// context) where bodies from device memory land.
    setup: crate::transport::ChannelSetup,
}

/// Registers and posts a connection's buffers and makes its halves. Two sides in one process
/// are both prepared before either is spawned, so that no `HELLO` can find the other's
/// receive queue empty.
pub(crate) fn prepare<V: Verbs>(verbs: Arc<V>, cfg: RdmaConfig, peer: String) -> Result<Prepared> {
    runtime()?;
    let (drv, sh) = Driver::new(verbs.clone(), cfg.clone(), peer)?;
    // The halves exist before the driver runs: dropping them (a failed or cancelled set-up)
    // is what tells the driver to stop.
    let (tx, rx) = driver::halves(sh.clone(), verbs, &cfg);
    Ok(Prepared {
        run: Box::pin(drv),
        started: Started {
            sh,
            tx,
            rx,
            setup: crate::transport::ChannelSetup::with_max_body(cfg.limits.max_body),
        },
    })
}

pub(crate) async fn finish(
    s: Started,
    handshake_timeout: std::time::Duration,
    local: String,
) -> Result<Parts> {
    let peer = s.sh.peer().to_owned();
    let limits = tokio::time::timeout(
        handshake_timeout,
        std::future::poll_fn(|cx| s.sh.poll_hello(cx)),
    )
    .await
    .map_err(|_| {
        Error::new(
            ErrorKind::TimedOut,
            format!("no RDMA HELLO from {peer} within {handshake_timeout:?}"),
        )
    })??;
    Ok(Parts {
        tx: s.tx,
        rx: s.rx,
        transport: "rdma",
        local,
        peer,
        peer_limits: limits,
        peer_identity: None,
        keepalive: None,
        setup: s.setup,
    })
}

// ---------------------------------------------------------------------------------------
// rdma+sim://
// ---------------------------------------------------------------------------------------

/// `rdma+sim://` names of one context.
pub(crate) struct SimRegistry {
    cfg: Config,
    names: Arc<Names>,
}

impl SimRegistry {
    pub(crate) fn new(cfg: Config) -> SimRegistry {
        SimRegistry {
            names: Names::new("rdma+sim", cfg.accept_backlog),
            cfg,
        }
    }
}

pub(crate) fn sim_bind(
    reg: &Arc<SimRegistry>,
    name: &str,
) -> Result<(Box<dyn AcceptHalf>, String)> {
    config(&reg.cfg).validate()?;
    reg.names.bind(name)
}

pub(crate) async fn sim_connect(reg: &Arc<SimRegistry>, name: &str) -> Result<Parts> {
    let url = reg.names.url(name);
    let tx = reg.names.lookup(name)?;
    let cfg = config(&reg.cfg);
    let (a, b) = sim::pair(sim::SimConfig::default());
    let id = reg.names.next_id();
    // Both sides post their receives (in `start`) before either sends its HELLO.
    let mut client = prepare(Arc::new(a), cfg.clone(), format!("{url}#listener"))?;
    let mut server = prepare(Arc::new(b), cfg, format!("{url}#conn{id}"))?;
    let setup = crate::transport::ChannelSetup::new(&reg.cfg, false);
    client.started.setup = setup.clone();
    server.started.setup = setup;
    let (client, server) = (client.spawn(), server.spawn());
    let t = reg.cfg.handshake_timeout;
    let (c, s) = tokio::join!(
        finish(client, t, url.clone()),
        finish(server, t, url.clone())
    );
    let (c, s) = (c?, s?);
    tx.send(s).await.map_err(|_| {
        Error::new(
            ErrorKind::ConnectionRefused,
            format!("the listener at {url} is gone"),
        )
    })?;
    Ok(c)
}

// ---------------------------------------------------------------------------------------
// rdma:// on hardware
// ---------------------------------------------------------------------------------------

/// The hardware backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Sideway,
    #[cfg(feature = "rdma-async-rdma")]
    AsyncRdma,
}

/// `HYPERFRAMES_RDMA_BACKEND`: `sideway` (the default) or `async-rdma` (built with the
/// feature `rdma-async-rdma`).
fn backend() -> Result<Backend> {
    match std::env::var("HYPERFRAMES_RDMA_BACKEND").as_deref() {
        Err(_) | Ok("" | "sideway") => Ok(Backend::Sideway),
        #[cfg(feature = "rdma-async-rdma")]
        Ok("async-rdma" | "async_rdma") => Ok(Backend::AsyncRdma),
        Ok(v) => Err(Error::new(
            ErrorKind::Config,
            format!(
                "HYPERFRAMES_RDMA_BACKEND={v:?}: expected sideway{}",
                if cfg!(feature = "rdma-async-rdma") {
                    " or async-rdma"
                } else {
                    " (async-rdma needs the feature rdma-async-rdma)"
                }
            ),
        )),
    }
}

/// The RDMA devices of this host, as the chosen backend sees them, or an
/// [`ErrorKind::Unavailable`] error saying there are none (what `bind` and `connect` of
/// `rdma://` check first).
pub fn devices() -> Result<Vec<String>> {
    match backend()? {
        Backend::Sideway => sideway::devices(),
        #[cfg(feature = "rdma-async-rdma")]
        Backend::AsyncRdma => async_rdma::devices(),
    }
}

/// `rdma://` in the scheme table.
pub(crate) static RDMA: Open = Open {
    connect: |t, a| {
        Box::pin(async move {
            let (host, port) = a.as_host_port()?;
            connect(host, port, t.config()).await
        })
    },
    bind: |t, a| {
        Box::pin(async move {
            let (host, port) = a.as_host_port()?;
            bind(host, port, t.config()).await
        })
    },
};

/// `rdma+sim://` in the scheme table.
pub(crate) static RDMA_SIM: Open = Open {
    connect: |t, a| Box::pin(async move { sim_connect(&t.rdma_sim, a.as_name()?).await }),
    bind: |t, a| Box::pin(async move { sim_bind(&t.rdma_sim, a.as_name()?) }),
};

pub(crate) async fn connect(host: &str, port: u16, cfg: &Config) -> Result<Parts> {
    match backend()? {
        Backend::Sideway => sideway::connect(host, port, cfg).await,
        #[cfg(feature = "rdma-async-rdma")]
        Backend::AsyncRdma => async_rdma::connect(host, port, cfg).await,
    }
}

pub(crate) async fn bind(
    host: &str,
    port: u16,
    cfg: &Config,
) -> Result<(Box<dyn AcceptHalf>, String)> {
    match backend()? {
        Backend::Sideway => sideway::bind(host, port, cfg).await,
        #[cfg(feature = "rdma-async-rdma")]
        Backend::AsyncRdma => async_rdma::bind(host, port, cfg).await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::Poll;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::channel::Channel;
    use crate::message::Message;

    /// Polls `inner` until `frozen` is set, then never again (without dropping it): a
    /// driver whose process stopped. Its memory stays registered and the simulated NIC
    /// keeps answering reads of it, as a real one does.
    struct Freezable {
        inner: Pin<Box<dyn Future<Output = ()> + Send>>,
        frozen: Arc<AtomicBool>,
    }

    impl Future for Freezable {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
            if self.frozen.load(Ordering::Relaxed) {
                return Poll::Pending;
            }
            let r = self.inner.as_mut().poll(cx);
            if r.is_pending() {
                // Look again soon: the flag is not a waker.
                let w = cx.waker().clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    w.wake();
                });
            }
            r
        }
    }

    #[tokio::test]
    async fn a_frozen_peer_is_found_by_its_heartbeat_counter() {
        let cfg = RdmaConfig {
            keepalive: Duration::from_millis(20),
            heartbeat_misses: 4,
            ..RdmaConfig::default()
        };
        let (a, b) = sim::pair(sim::SimConfig::default());
        let pa = prepare(Arc::new(a), cfg.clone(), "rdma+sim://frozen#b".into()).unwrap();
        let pb = prepare(Arc::new(b), cfg, "rdma+sim://frozen#a".into()).unwrap();
        let sa = pa.spawn();
        let frozen = Arc::new(AtomicBool::new(false));
        tokio::spawn(Freezable {
            inner: pb.run,
            frozen: frozen.clone(),
        });
        let t = Duration::from_secs(5);
        let (ca, cb) = tokio::join!(finish(sa, t, "a".into()), finish(pb.started, t, "b".into()));
        let (mut ca, mut cb) = (
            Channel::from_parts(ca.unwrap()),
            Channel::from_parts(cb.unwrap()),
        );
        // Alive and idle for many times the limit (80 ms): the counter keeps it.
        tokio::time::sleep(Duration::from_millis(400)).await;
        ca.send(Message::new("still.here").unwrap()).await.unwrap();
        assert_eq!(cb.recv().await.unwrap().unwrap().kind(), "still.here");

        let at = Instant::now();
        frozen.store(true, Ordering::Relaxed);
        let e = tokio::time::timeout(t, ca.recv())
            .await
            .expect("a frozen peer must be found")
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::ConnectionLost, "{e:#}");
        assert!(e.to_string().contains("silent for"), "{e:#}");
        let e = ca.send(Message::new("x").unwrap()).await.unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::ConnectionLost, "{e:#}");
        assert!(at.elapsed() < t);
        drop(cb);
    }
}
