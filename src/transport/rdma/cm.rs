//! `rdma://` set-up through rdma_cm (librdmacm, as sideway wraps it): the field's standard
//! way to connect two RC queue pairs, and this backend's first choice.
//!
//! rdma_cm resolves the peer's IP address to a device, a port and a route (on RoCE the GID
//! follows from the address, so `HYPERFRAMES_RDMA_DEVICE` / `_PORT` / `_GID_INDEX` are not
//! needed), and exchanges the queue-pair numbers in its own connection messages. The queue
//! pair is ours (created on the device rdma_cm chose) and moved through INIT, RTR and RTS
//! with the attributes rdma_cm computes, raised where the protocol needs more: remote read
//! and write access, up to [`READS_IN_FLIGHT`] RDMA reads each way (as the device allows),
//! retries as the TCP set-up sets them. (sideway's connection parameters carry only the
//! queue-pair number: rdma_cm tells the peer one read each way, which its own attributes
//! raise as ours do.) Then the protocol's `HELLO` runs over the queue pair, as after the TCP set-up.
//!
//! The listener takes both: rdma_cm connection requests at `host:port` (rdma_cm's own port
//! space, beside the kernel's TCP ports) and the TCP set-up exchange at the same `host:port`.
//! A connecting side tries rdma_cm first and falls back to the TCP exchange, saying so in the
//! log, when rdma_cm is not there (no `/dev/infiniband/rdma_cm`, no librdmacm) or fails
//! before the peer accepts: the address is not on an RDMA interface, no route, or the peer
//! refuses or does not answer (a listener on the async-rdma backend, which has only the TCP
//! exchange).
//! `HYPERFRAMES_RDMA_SETUP=tcp` skips rdma_cm.
//!
//! Like the rest of this backend, this has not run on a NIC yet: CI has none, and soft-RoCE
//! cannot be loaded there.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use sideway::ibverbs::queue_pair::{QueuePairAttribute, QueuePairState};
use sideway::rdmacm::communication_manager::{
    ConnectionParameter, Event, EventChannel, EventType, GetEventErrorKind, Identifier, PortSpace,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use super::RdmaConfig;
#[cfg(doc)]
use super::sideway::READS_IN_FLIGHT;
use super::sideway::{ChannelFd, Device, SwVerbs, readable, remote_access};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{AcceptHalf, Config, Parts};

/// How `rdma://` connections are set up: `HYPERFRAMES_RDMA_SETUP` = `cm` (the default:
/// rdma_cm, the TCP exchange where it is missing or refused) or `tcp`.
pub(super) fn wanted() -> Result<bool> {
    setup_choice(std::env::var("HYPERFRAMES_RDMA_SETUP").ok().as_deref())
}

fn setup_choice(v: Option<&str>) -> Result<bool> {
    match v {
        None | Some("cm") => Ok(true),
        Some("tcp") => Ok(false),
        Some(v) => Err(Error::new(
            ErrorKind::Config,
            format!("HYPERFRAMES_RDMA_SETUP={v:?}: expected cm or tcp"),
        )),
    }
}

/// An rdma_cm event channel, awaited through tokio.
pub(super) struct Events {
    fd: AsyncFd<ChannelFd<EventChannel>>,
}

fn cm_failed(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Io, format!("rdma_cm: {what}: {e:#}"))
}

impl Events {
    /// A non-blocking event channel; `Unavailable` where rdma_cm is not there.
    pub(super) fn new() -> Result<Events> {
        let ch = EventChannel::new().map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!(
                    "rdma_cm is not available ({e:#}: needs librdmacm.so.1 and \
                     /dev/infiniband/rdma_cm)"
                ),
            )
        })?;
        ch.set_nonblocking(true)
            .map_err(|e| cm_failed("making the event channel non-blocking", e))?;
        let fd = readable(ch).map_err(|e| Error::io("registering the rdma_cm event channel", e))?;
        Ok(Events { fd })
    }

    fn channel(&self) -> &Arc<EventChannel> {
        &self.fd.get_ref().0
    }

    /// The next event.
    async fn next(&self) -> Result<Event> {
        loop {
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(|e| Error::io("waiting on the rdma_cm event channel", e))?;
            match self.channel().get_cm_event() {
                Ok(ev) => return Ok(ev),
                Err(e) if matches!(e.0, GetEventErrorKind::NoEvent) => guard.clear_ready(),
                Err(e) => return Err(cm_failed("reading an event", e)),
            }
        }
    }

    /// The next event, which must be `want`; within `t`.
    async fn expect(&self, want: EventType, t: Duration, what: &str) -> Result<Event> {
        let ev = tokio::time::timeout(t, self.next()).await.map_err(|_| {
            Error::new(
                ErrorKind::TimedOut,
                format!("rdma_cm: {what}: no answer within {t:?}"),
            )
        })??;
        if ev.event_type() == want {
            return Ok(ev);
        }
        let kind = match ev.event_type() {
            EventType::Rejected | EventType::Unreachable | EventType::ConnectError => {
                ErrorKind::ConnectionRefused
            }
            _ => ErrorKind::Io,
        };
        Err(Error::new(
            kind,
            format!(
                "rdma_cm: {what}: {:?} (status {})",
                ev.event_type(),
                ev.status()
            ),
        ))
    }
}

/// The attributes rdma_cm computes for moving to `state`, raised where the protocol needs
/// more (as the TCP set-up sets them).
fn attr(id: &Identifier, state: QueuePairState, reads: u8) -> Result<QueuePairAttribute> {
    let mut a = id
        .get_qp_attr(state)
        .map_err(|e| cm_failed(&format!("queue-pair attributes for {state:?}"), e))?;
    match state {
        QueuePairState::Init => {
            a.setup_access_flags(remote_access());
        }
        QueuePairState::ReadyToReceive => {
            a.setup_max_dest_read_atomic(reads).setup_min_rnr_timer(12);
        }
        _ => {
            a.setup_timeout(14)
                .setup_retry_cnt(7)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(reads);
        }
    }
    Ok(a)
}

/// A queue pair on the device rdma_cm chose for `id`, in the INIT state.
fn queue_pair(id: &Identifier, cfg: &RdmaConfig, peer: &str) -> Result<SwVerbs> {
    let ctx = id.get_device_context().ok_or_else(|| {
        Error::new(
            ErrorKind::Unavailable,
            "rdma_cm found no RDMA device for this address; run `hf doctor`",
        )
    })?;
    let pd = ctx
        .alloc_pd()
        .map_err(|e| cm_failed("allocating a protection domain", e))?;
    let port = id.port();
    let dev = Device {
        ctx,
        pd,
        port,
        gid_index: 0,
        name: format!("rdma_cm port {port}"),
    };
    let verbs = SwVerbs::new(&dev, cfg.recv_slots + 16, peer)?;
    verbs.modify(
        &attr(id, QueuePairState::Init, verbs.reads())?,
        "moving the queue pair to INIT",
    )?;
    Ok(verbs)
}

fn params(verbs: &SwVerbs) -> ConnectionParameter {
    let mut p = ConnectionParameter::default();
    p.setup_qp_number(verbs.qp_number());
    p
}

/// Why the rdma_cm set-up failed, and whether the TCP set-up exchange may be tried instead.
pub(super) struct Failed {
    pub(super) error: Error,
    /// True when the peer has not accepted an rdma_cm connection: the address is not on an
    /// RDMA interface, no route, the peer refused or did not answer (a listener without
    /// rdma_cm, or on the async-rdma backend).
    pub(super) before_accept: bool,
}

/// The active side: address and route resolution, our queue pair, the connection request,
/// and on the peer's answer our queue pair moved to RTS.
pub(super) async fn connect(
    events: Events,
    to: SocketAddr,
    cfg: &RdmaConfig,
    t: Duration,
    peer: &str,
) -> std::result::Result<SwVerbs, Failed> {
    let (id, mut verbs, events) =
        request(events, to, cfg, t, peer)
            .await
            .map_err(|error| Failed {
                error,
                before_accept: true,
            })?;
    let late = |error| Failed {
        error,
        before_accept: false,
    };
    let reads = verbs.reads();
    verbs
        .modify(
            &attr(&id, QueuePairState::ReadyToReceive, reads).map_err(late)?,
            "moving the queue pair to RTR",
        )
        .map_err(late)?;
    verbs
        .modify(
            &attr(&id, QueuePairState::ReadyToSend, reads).map_err(late)?,
            "moving the queue pair to RTS",
        )
        .map_err(late)?;
    id.establish()
        .map_err(|e| late(cm_failed("establishing the connection", e)))?;
    // Later events (the peer's disconnect) are not needed: the protocol's keepalive and
    // heartbeat find a peer that is gone.
    verbs.keep(Box::new((id, events)));
    Ok(verbs)
}

/// [`connect`] up to the peer's acceptance: the identifier, our queue pair in INIT, and
/// the event channel.
async fn request(
    events: Events,
    to: SocketAddr,
    cfg: &RdmaConfig,
    t: Duration,
    peer: &str,
) -> Result<(Arc<Identifier>, SwVerbs, Events)> {
    let id = events
        .channel()
        .create_id(PortSpace::Tcp)
        .map_err(|e| cm_failed("creating an identifier", e))?;
    let ms = t.min(Duration::from_secs(60));
    id.resolve_addr(None, to, ms)
        .map_err(|e| cm_failed(&format!("resolving {to}"), e))?;
    events
        .expect(EventType::AddressResolved, t, &format!("resolving {to}"))
        .await?;
    id.resolve_route(ms)
        .map_err(|e| cm_failed(&format!("resolving a route to {to}"), e))?;
    events
        .expect(
            EventType::RouteResolved,
            t,
            &format!("resolving a route to {to}"),
        )
        .await?;
    let verbs = queue_pair(&id, cfg, peer)?;
    id.connect(params(&verbs))
        .map_err(|e| cm_failed(&format!("connecting to {to}"), e))?;
    events
        .expect(
            EventType::ConnectResponse,
            t,
            &format!("connecting to {to}"),
        )
        .await?;
    Ok((id, verbs, events))
}

/// The passive side of one connection request: our queue pair on the device the request
/// came in on, moved to RTS, then the request accepted.
fn accept_one(id: Arc<Identifier>, cfg: &RdmaConfig, peer: &str) -> Result<SwVerbs> {
    let mut verbs = queue_pair(&id, cfg, peer)?;
    verbs.modify(
        &attr(&id, QueuePairState::ReadyToReceive, verbs.reads())?,
        "moving the queue pair to RTR",
    )?;
    verbs.modify(
        &attr(&id, QueuePairState::ReadyToSend, verbs.reads())?,
        "moving the queue pair to RTS",
    )?;
    id.accept(params(&verbs))
        .map_err(|e| cm_failed("accepting a connection", e))?;
    verbs.keep(Box::new(id));
    Ok(verbs)
}

/// Listens for rdma_cm connection requests at `at`: each accepted one is set up in a task
/// of its own, bounded as the TCP listener's (`accept_backlog`), and comes out of the
/// returned half.
pub(super) fn listen(at: SocketAddr, cfg: &Config) -> Result<Box<dyn AcceptHalf>> {
    let events = Events::new()?;
    let id = events
        .channel()
        .create_id(PortSpace::Tcp)
        .map_err(|e| cm_failed("creating an identifier", e))?;
    id.bind_addr(at)
        .map_err(|e| cm_failed(&format!("binding {at}"), e))?;
    let backlog = cfg.accept_backlog.max(1);
    id.listen(i32::try_from(backlog).unwrap_or(i32::MAX))
        .map_err(|e| cm_failed(&format!("listening at {at}"), e))?;
    let rcfg = super::config(cfg);
    let setup = crate::transport::ChannelSetup::new(cfg, false);
    let (tx, rx) = mpsc::channel(backlog);
    let setups = Arc::new(tokio::sync::Semaphore::new(backlog));
    let local_url = format!("rdma://{at}");
    static PEERS: AtomicU64 = AtomicU64::new(1);
    tokio::spawn(async move {
        let _listening = id;
        loop {
            let ev = tokio::select! {
                () = tx.closed() => return,
                ev = events.next() => match ev {
                    Ok(ev) => ev,
                    Err(e) => {
                        tracing::warn!(url = %local_url, "rdma_cm listener stopped: {e:#}");
                        return;
                    }
                },
            };
            if ev.event_type() != EventType::ConnectRequest {
                // The accepted connections' own events (established, disconnected) come
                // here too; the protocol does without them.
                continue;
            }
            let Some(child) = ev.cm_id() else { continue };
            drop(ev);
            let Ok(permit) = setups.clone().try_acquire_owned() else {
                // Too many set-ups in progress: dropping the identifier refuses it.
                tracing::warn!(url = %local_url, "rdma_cm connection request refused: {backlog} set-ups in progress");
                continue;
            };
            let peer = format!(
                "{local_url} (rdma_cm peer {})",
                PEERS.fetch_add(1, Ordering::Relaxed)
            );
            let verbs = match accept_one(child, &rcfg, &peer) {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(url = %local_url, "rejected RDMA connection: {e:#}");
                    continue;
                }
            };
            let (tx, rcfg, local_url, setup) =
                (tx.clone(), rcfg.clone(), local_url.clone(), setup.clone());
            tokio::spawn(async move {
                let r =
                    super::establish(Arc::new(verbs), rcfg, setup, local_url.clone(), peer).await;
                super::setup::hand_over(r, permit, &tx, &local_url).await;
            });
        }
    });
    Ok(Box::new(super::setup::Accepted {
        rx,
        task: "rdma_cm",
    }))
}

/// Connections set up either way, rdma_cm's first.
pub(super) struct Both {
    pub(super) cm: Box<dyn AcceptHalf>,
    pub(super) tcp: Box<dyn AcceptHalf>,
}

impl AcceptHalf for Both {
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Parts>> {
        if let Poll::Ready(Ok(p)) = self.cm.poll_accept(cx) {
            return Poll::Ready(Ok(p));
        }
        self.tcp.poll_accept(cx)
    }

    fn rejected(&self) -> u64 {
        self.cm.rejected() + self.tcp.rejected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setup_choice() {
        assert!(setup_choice(None).unwrap());
        assert!(setup_choice(Some("cm")).unwrap());
        assert!(!setup_choice(Some("tcp")).unwrap());
        let e = setup_choice(Some("ib")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("expected cm or tcp"), "{e}");
    }

    /// Where rdma_cm is missing (CI), opening it is a typed error, never a panic; where it
    /// is there, the channel opens.
    #[tokio::test]
    async fn rdma_cm_is_there_or_unavailable() {
        match Events::new() {
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                assert!(e.to_string().contains("rdma_cm"), "{e}");
            }
        }
    }
}
