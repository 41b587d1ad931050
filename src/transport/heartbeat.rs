//! Heartbeats: how a frozen or vanished peer is told apart from an idle one.
//!
//! A kernel keeps answering for a process that is stopped, deadlocked or swapped out: its TCP
//! stack acknowledges, its shared memory stays mapped, so neither TCP keepalive nor a closed
//! socket ever says it is gone. So each side promises, at its handshake, to be heard from at
//! least every `interval` while it can write (a `HEARTBEAT` when it has nothing else to
//! send), and a side whose peer made that promise declares it lost after `misses` intervals
//! with nothing heard. Silence counts only while this side listens: a side that stopped
//! reading to backpressure the peer cannot hear it, and is not deceived by its own pause.
//!
//! The transports own the clock and the I/O; this module holds the arithmetic, so that it is
//! the same on every transport and testable without time passing.

use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind};
#[cfg(any(feature = "tcp", feature = "shm"))]
use {
    crate::transport::Config,
    futures_util::future::poll_fn,
    std::future::Future,
    std::pin::Pin,
    std::task::{Context, Poll},
};

/// What one connection does about heartbeats, settled once both handshakes are in.
#[cfg(any(feature = "tcp", feature = "shm"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Liveness {
    /// Send a heartbeat when nothing else went out for this long (set only when the peer
    /// understands heartbeats).
    pub(crate) send_every: Option<Duration>,
    /// How often the peer promised to be heard from, and after how many of those intervals
    /// of silence it is lost (set only when it promised).
    pub(crate) watch: Option<(Duration, u32)>,
    /// A peer that promised nothing is dropped after this much silence (the idle timeout).
    pub(crate) idle: Option<Duration>,
    /// How often the connection looks: half our interval, so that what we send is never
    /// further apart than the interval we announced (and at least four times per idle
    /// timeout).
    pub(crate) tick: Option<Duration>,
}

#[cfg(any(feature = "tcp", feature = "shm"))]
impl Liveness {
    /// For a connection with our settings in `cfg`, whose peer understands heartbeats (or
    /// not) and promised `peer_interval` (or nothing). Heartbeats off in `cfg` turn off both
    /// directions: we send none and expect none; a peer that promised none is held to the
    /// idle timeout whatever our own heartbeats.
    pub(crate) fn new(
        cfg: &Config,
        peer_understands: bool,
        peer_interval: Option<Duration>,
    ) -> Self {
        let ours = cfg.heartbeat;
        let idle = cfg.idle_timeout.filter(|_| peer_interval.is_none());
        let tick = match (ours.map(|o| o / 2), idle.map(|i| i / 4)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Liveness {
            send_every: ours.filter(|_| peer_understands),
            watch: ours.and(peer_interval).map(|p| (p, cfg.heartbeat_misses)),
            idle,
            tick: tick.map(|t| t.max(Duration::from_millis(1))),
        }
    }

    /// Whether the connection has anything to do on a tick.
    pub(crate) fn active(&self) -> bool {
        self.tick.is_some()
            && (self.send_every.is_some() || self.watch.is_some() || self.idle.is_some())
    }

    /// The silence watch: the peer's promise, or the idle timeout for a peer that made none.
    pub(crate) fn silence(&self, now: Instant) -> Option<Silence> {
        let limit = match self.watch {
            Some((interval, misses)) => Some(interval.saturating_mul(misses)),
            None => self.idle,
        };
        limit.map(|l| Silence::new(l, now))
    }

    /// The error both halves report when the peer was silent for `silent`. `who` names the
    /// channel: its transport and the peer's address.
    pub(crate) fn lost(&self, who: &str, silent: Duration) -> Error {
        match (self.watch, self.idle) {
            (None, Some(idle)) => Error::new(
                ErrorKind::ConnectionLost,
                format!(
                    "{who} sent nothing for {silent:.1?}; it promised no heartbeats, and a peer \
                     without them is dropped after {idle:?} of silence \
                     (ContextBuilder::idle_timeout)"
                ),
            ),
            (watch, _) => {
                let (interval, misses) = watch.unwrap_or_default();
                lost(who, silent, interval, misses)
            }
        }
    }
}

/// The error both halves report when the peer, which promised to be heard from every
/// `interval`, was silent for `silent` (more than `misses` intervals).
pub(crate) fn lost(who: &str, silent: Duration, interval: Duration, misses: u32) -> Error {
    Error::new(
        ErrorKind::ConnectionLost,
        format!(
            "{who} was silent for {silent:.1?}: nothing arrived, not even a heartbeat, \
             although it promised one at least every {interval:?} (lost after {misses} \
             intervals). Is it frozen (stopped, deadlocked, its runtime blocked) or cut off? \
             (ContextBuilder::heartbeat)"
        ),
    )
}

/// Tracks how long the peer has been silent while we listened.
#[derive(Debug)]
pub(crate) struct Silence {
    limit: Duration,
    /// The count of arrivals at the last look.
    seen: u64,
    /// Since when nothing arrived while we listened.
    since: Instant,
}

impl Silence {
    /// Silence longer than `limit` fails the peer; counted from `now`.
    pub(crate) fn new(limit: Duration, now: Instant) -> Silence {
        Silence {
            limit,
            seen: 0,
            since: now,
        }
    }

    /// Looks at time `now`. `heard` is a count that grows whenever something arrives from the
    /// peer (bytes, a frame, a heartbeat); `listening` whether this side is reading now (not
    /// holding back to backpressure the peer). `Err(silent)` once the peer has been silent
    /// longer than the limit.
    pub(crate) fn check(
        &mut self,
        now: Instant,
        heard: u64,
        listening: bool,
    ) -> Result<(), Duration> {
        if heard != self.seen || !listening {
            self.seen = heard;
            self.since = now;
            return Ok(());
        }
        let silent = now.saturating_duration_since(self.since);
        if silent > self.limit {
            return Err(silent);
        }
        Ok(())
    }
}

#[cfg(any(feature = "tcp", feature = "shm"))]
/// A periodic wake-up of a connection's loop: one timer for its whole life, re-armed when it
/// fires (no timer per read or write). Without a period it never fires.
pub(crate) struct Tick {
    sleep: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
}

#[cfg(any(feature = "tcp", feature = "shm"))]
impl Tick {
    pub(crate) fn new(period: Option<Duration>) -> Tick {
        Tick {
            sleep: period.map(|p| (Box::pin(tokio::time::sleep(p)), p)),
        }
    }

    /// Ready once per period (re-armed as it returns); pending for ever without one.
    pub(crate) fn poll_tick(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some((sleep, period)) = &mut self.sleep else {
            return Poll::Pending;
        };
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        let next = tokio::time::Instant::now() + *period;
        sleep.as_mut().reset(next);
        Poll::Ready(())
    }

    pub(crate) fn next(&mut self) -> impl Future<Output = ()> + '_ {
        poll_fn(|cx| self.poll_tick(cx))
    }
}

#[cfg(all(test, any(feature = "tcp", feature = "shm")))]
mod tests {
    use super::*;

    fn cfg(interval: Option<Duration>, misses: u32) -> Config {
        Config {
            heartbeat: interval,
            heartbeat_misses: misses,
            ..Config::default()
        }
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn settled_from_both_sides() {
        let on = cfg(Some(100 * MS), 5);
        let l = Liveness::new(&on, true, Some(300 * MS));
        assert_eq!(l.send_every, Some(100 * MS));
        assert_eq!(l.watch, Some((300 * MS, 5)));
        assert_eq!(l.idle, None);
        assert_eq!(l.tick, Some(50 * MS));
        assert!(l.active());
        // A peer that does not understand them gets none; one that promised nothing is
        // held to the idle timeout.
        let l = Liveness::new(&on, false, None);
        assert_eq!((l.send_every, l.watch), (None, None));
        assert_eq!(l.idle, Some(Duration::from_secs(120)));
        assert!(l.active());
        let t0 = Instant::now();
        let mut s = l.silence(t0).unwrap();
        assert_eq!(
            s.check(t0 + Duration::from_secs(121), 0, true),
            Err(Duration::from_secs(121))
        );
        let e = l.lost("tcp peer x", Duration::from_secs(121)).to_string();
        assert!(e.contains("idle_timeout"), "{e}");
        // Off on our side: neither, whatever the peer does.
        let l = Liveness::new(&cfg(None, 5), true, Some(MS));
        assert_eq!(l, Liveness::default());
        assert!(!l.active());
        // ... but a silent peer without heartbeats still meets the idle timeout; and with
        // none of either there is nothing to do.
        let l = Liveness::new(&cfg(None, 5), true, None);
        assert_eq!(
            (l.idle, l.tick),
            (
                Some(Duration::from_secs(120)),
                Some(Duration::from_secs(30))
            )
        );
        let off = Config {
            idle_timeout: None,
            ..cfg(None, 5)
        };
        assert!(!Liveness::new(&off, true, None).active());
    }

    #[test]
    fn silence_counts_only_while_listening() {
        let l = Liveness::new(&cfg(Some(100 * MS), 3), true, Some(100 * MS));
        let t0 = Instant::now();
        let mut s = l.silence(t0).unwrap();
        // Arrivals keep it alive however long the whole run.
        for i in 1..100u64 {
            assert_eq!(s.check(t0 + i as u32 * 200 * MS, i, true), Ok(()));
        }
        let t1 = t0 + 100 * 200 * MS;
        assert_eq!(s.check(t1, 100, true), Ok(()));
        assert_eq!(s.check(t1 + 300 * MS, 100, true), Ok(()), "at the limit");
        // Not listening (backpressure): the clock starts again when listening resumes.
        assert_eq!(s.check(t1 + 301 * MS, 100, false), Ok(()));
        assert_eq!(s.check(t1 + 5000 * MS, 100, false), Ok(()));
        assert_eq!(s.check(t1 + 5200 * MS, 100, true), Ok(()));
        assert_eq!(s.check(t1 + 5301 * MS, 100, true), Err(301 * MS));
        // The error names the peer, the silence and the promise.
        let e = l.lost("tcp peer 10.0.0.2:7000", 301 * MS);
        assert_eq!(e.kind(), ErrorKind::ConnectionLost);
        let text = e.to_string();
        assert!(
            text.contains("10.0.0.2:7000") && text.contains("301"),
            "{text}"
        );
    }
}
