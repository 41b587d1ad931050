//! Acknowledged delivery and reconnect: channels that survive a broken connection.
//!
//! An ordinary [`Channel`](crate::Channel) is one connection: when it breaks, both halves fail
//! with [`ErrorKind::ConnectionLost`](crate::ErrorKind::ConnectionLost) and messages in flight
//! are gone without anyone knowing which. A **session** channel is a `Channel` too (the same
//! type, Sink and Stream, `split`, backpressure), over any transport, with three additions:
//!
//! * **Sequence numbers and acknowledgements.** Every message is numbered; the receiving side
//!   acknowledges, in batches, the messages it has put in its application's receive queue:
//!   after every [`SessionConfig::ack_every`] messages, and whenever it has read all that had
//!   arrived (so a quiet channel is acknowledged at once, a busy one in batches; an
//!   acknowledgement rides in the same write as any data going the other way). The sender
//!   keeps each message (a reference count: the body is not copied) until it is
//!   acknowledged, at most [`SessionConfig::window`] of them and
//!   [`SessionConfig::window_bytes`] of bodies: beyond that `send` waits, which is
//!   backpressure as on any channel.
//! * **Reconnect and resend.** The side that connected ([`Context::connect_with`](crate::Context::connect_with)) reconnects
//!   after the connection breaks, with the [`Reconnect`] policy's backoff; both sides then say
//!   what they have received and resend, in order, what the other lacks; the receiver drops
//!   anything it has already delivered (by sequence number). The side that listens
//!   ([`Context::bind_sessions`](crate::Context::bind_sessions)) keeps the session for [`SessionConfig::resume_within`]
//!   waiting for that reconnect. Meanwhile sends go on until the window is full.
//! * **Nothing lost unknowingly.** When a session ends without its messages delivered (the
//!   policy gave up, the listener's wait ran out, the peer dropped its receiver), both halves
//!   fail and [`Sender::take_unacknowledged`](crate::Sender::take_unacknowledged) hands back,
//!   in order, every message not acknowledged (the peer may have received some whose
//!   acknowledgement was lost with the connection: what it did not receive is among them).
//!   [`Sender::flush`](crate::Sender::flush) on a session waits until every message sent so
//!   far is acknowledged.
//!
//! # What is guaranteed
//!
//! | event | guarantee |
//! |---|---|
//! | the connection breaks (network, relay, peer's NIC), both processes live | every message delivered exactly once, in order, after the reconnect; none lost |
//! | the policy gives up, or the listener's `resume_within` passes | both halves fail; the unacknowledged messages are in `take_unacknowledged` |
//! | the listening process crashes and restarts (same address) | the connecting side learns the session is gone, resends every message the old process had not acknowledged (it may have delivered some: **at least once** for those), and receives a [`RESET_TYPE`] message listing the requests it resent; acknowledged messages were in the old process's receive queue and are gone with it |
//! | the connecting process crashes | the listening side's session fails after `resume_within`; its unacknowledged messages are in `take_unacknowledged` |
//! | both halves dropped while the connection is down | the session goes on trying for the context's [`linger`](crate::ContextBuilder::linger) (5 s), then drops what is left with a warning: nobody is left to hand it back to |
//!
//! "Acknowledged" means the message reached the peer's receive queue (at most
//! [`ContextBuilder::recv_queue`](crate::ContextBuilder::recv_queue) messages), not that the
//! application has read it: a crash loses what that queue held. Messages are kept in memory
//! only: nothing is written to disk.
//!
//! # Costs
//!
//! One metadata entry per message (`hf.seq`, about 12 bytes, counted against the peer's
//! metadata limits, which the session's `peer_limits` shrink accordingly), one
//! acknowledgement per `ack_every` messages, and one hand-off between the application's
//! halves and the task that drives the session. Keep sessions for what must not be lost;
//! the plain channel is the fast path.
//!
//! # Reserved names
//!
//! Message types under `hf.session.` and the metadata key `hf.seq` belong to the session
//! protocol: sending them on a session channel fails with
//! [`ErrorKind::InvalidType`](crate::ErrorKind::InvalidType) /
//! [`InvalidMeta`](crate::ErrorKind::InvalidMeta).
//!
//! ```no_run
//! use std::time::Duration;
//! use hyperframes::session::Reconnect;
//! # async fn f() -> hyperframes::Result<()> {
//! let ctx = hyperframes::Context::new();
//! let policy = Reconnect::exponential(Duration::from_millis(50), Duration::from_secs(5)).limit(20);
//! let mut ch = ctx.connect_with("tcp://10.0.0.2:5555", policy).await?;
//! ch.send(hyperframes::Message::new("ml.batch")?).await?;
//! ch.flush().await?; // acknowledged by the peer
//! # Ok(()) }
//! ```

mod driver;
mod halves;
mod listener;
mod proto;

use std::time::Duration;

pub(crate) use driver::connect;
pub(crate) use listener::bind;
pub use proto::RESET_TYPE;
#[cfg(feature = "tower")]
pub(crate) use proto::reset_ids;

/// How a session's connecting side reconnects: exponential backoff with jitter, a cap on the
/// delay, and a limit on attempts in a row.
#[derive(Clone, Debug, PartialEq)]
pub struct Reconnect {
    initial: Duration,
    max: Duration,
    jitter: f64,
    limit: Option<u32>,
}

impl Reconnect {
    /// Never reconnect: acknowledged delivery only. When the connection breaks, both halves
    /// fail and [`Sender::take_unacknowledged`](crate::Sender::take_unacknowledged) has every
    /// message not acknowledged.
    pub fn never() -> Reconnect {
        Reconnect {
            initial: Duration::ZERO,
            max: Duration::ZERO,
            jitter: 0.0,
            limit: Some(0),
        }
    }

    /// Wait `initial` before the first attempt, doubling after each failed one up to `max`;
    /// each delay is drawn at random from its upper 25% (jitter, so that many clients of one
    /// server do not come back in step). No limit on attempts until [`limit`](Self::limit).
    pub fn exponential(initial: Duration, max: Duration) -> Reconnect {
        Reconnect {
            initial,
            max: max.max(initial),
            jitter: 0.25,
            limit: None,
        }
    }

    /// Give up after `attempts` failed attempts in a row (the session then fails).
    pub fn limit(mut self, attempts: u32) -> Reconnect {
        self.limit = Some(attempts);
        self
    }

    /// The fraction of each delay drawn at random, `0.0` (none) to `1.0`; default 0.25.
    pub fn jitter(mut self, fraction: f64) -> Reconnect {
        self.jitter = fraction.clamp(0.0, 1.0);
        self
    }

    /// Whether attempt `n` (1-based) may be made.
    fn allows(&self, n: u32) -> bool {
        self.limit.is_none_or(|l| n <= l)
    }

    /// The delay before attempt `n` (1-based), given a random `r` in [0, 1).
    fn delay(&self, n: u32, r: f64) -> Duration {
        let base = self
            .initial
            .saturating_mul(1u32 << (n.saturating_sub(1)).min(20))
            .min(self.max);
        base.mul_f64(1.0 - self.jitter * r)
    }
}

/// Settings of the sessions a context makes ([`ContextBuilder::session`](crate::ContextBuilder::session)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    pub(crate) window: usize,
    pub(crate) window_bytes: u64,
    pub(crate) ack_every: u64,
    pub(crate) resume_within: Duration,
}

impl Default for SessionConfig {
    fn default() -> SessionConfig {
        SessionConfig {
            window: 1024,
            window_bytes: 16 << 20,
            ack_every: 64,
            resume_within: Duration::from_secs(30),
        }
    }
}

impl SessionConfig {
    /// The most messages sent and not yet acknowledged (default 1024); `send` waits beyond.
    /// They are kept by reference count (bodies are not copied), but a body kept is memory
    /// held: see [`window_bytes`](Self::window_bytes).
    pub fn window(mut self, messages: usize) -> SessionConfig {
        self.window = messages.max(1);
        self
    }

    /// The most body bytes sent and not yet acknowledged (default 16 MiB, as the send
    /// queue); one message is always admitted, however large.
    pub fn window_bytes(mut self, bytes: u64) -> SessionConfig {
        self.window_bytes = bytes;
        self
    }

    /// Acknowledge at least every this many delivered messages (default 64) while they keep
    /// arriving; keep it below the peer's window.
    pub fn ack_every(mut self, messages: u64) -> SessionConfig {
        self.ack_every = messages.max(1);
        self
    }

    /// How long the listening side keeps a session whose connection broke, waiting for its
    /// peer to reconnect (default 30 s); then the session fails.
    pub fn resume_within(mut self, d: Duration) -> SessionConfig {
        self.resume_within = d;
        self
    }
}

/// Reads a message as a session's driver would (for the fuzz targets): true if accepted.
pub(crate) fn fuzz_classify(msg: crate::message::Message) -> bool {
    proto::classify(msg).is_ok()
}

/// A random number for session ids and jitter: std's per-process random hash keys, over a
/// counter and the clock (no dependency for what needs no cryptographic strength; a session
/// id is not a credential: on `tls://` a reconnect must also present the same certificate).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter_below_it() {
        let p = Reconnect::exponential(Duration::from_millis(10), Duration::from_millis(100));
        assert_eq!(p.delay(1, 0.0), Duration::from_millis(10));
        assert_eq!(p.delay(2, 0.0), Duration::from_millis(20));
        assert_eq!(p.delay(4, 0.0), Duration::from_millis(80));
        assert_eq!(p.delay(5, 0.0), Duration::from_millis(100));
        assert_eq!(p.delay(40, 0.0), Duration::from_millis(100));
        let j = p.delay(3, 0.999);
        assert!(
            j > Duration::from_millis(30) && j <= Duration::from_millis(40),
            "{j:?}"
        );
        assert!(p.allows(1_000_000));
        let l = p.clone().limit(3);
        assert!(l.allows(3) && !l.allows(4));
        assert!(!Reconnect::never().allows(1));
    }

    #[test]
    fn random_numbers_differ() {
        let a: Vec<u64> = (0..100).map(|_| random_u64()).collect();
        let mut b = a.clone();
        b.sort_unstable();
        b.dedup();
        assert_eq!(b.len(), a.len());
    }
}
