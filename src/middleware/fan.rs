//! Fan-out and fan-in: redistributing messages across channels.
//!
//! [`FanOut`] is a `Sink<Message>` over several [`Sender`]s with one of three policies:
//!
//! | policy | a message goes to | when a destination is full |
//! |---|---|---|
//! | [`broadcast`](FanOut::broadcast) | every destination; the body is shared (`Bytes` clones), never copied | the fan-out waits for it: nothing is dropped, the slowest consumer sets the pace |
//! | [`round_robin`](FanOut::round_robin) | the next destination in turn that has room | it is skipped: the others take the load (ZeroMQ PUSH) |
//! | [`key_hash`](FanOut::key_hash) | the destination chosen by a metadata value's hash, so one key always lands on one destination | the fan-out waits for it when a message is for it |
//!
//! Backpressure is per destination and nothing is lost silently: a message that cannot be
//! handed over yet is *parked* at its destination (one at most each), and `poll_ready` is
//! `Pending` until parked messages are handed over. Like any `Sink`, `start_send` may leave
//! messages staged until `poll_flush` (`SinkExt::send` flushes, `feed` does not).
//!
//! [`FanIn`] is a `Stream` merging several [`Receiver`]s, yielding each message with the key
//! of the source it came from. It polls sources in turn, so a busy source cannot starve the
//! others; a source that ends or fails is dropped from the set (its error is yielded first)
//! and the others go on; the stream ends when every source has.
//!
//! ```
//! use futures_util::{SinkExt, StreamExt};
//! use hyperframes::middleware::{FanIn, FanOut};
//! use hyperframes::{Context, Message};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> hyperframes::Result<()> {
//! let ctx = Context::new();
//! let mut listener = ctx.bind("inproc://fan-doc").await?;
//! let (mut senders, mut receivers) = (Vec::new(), Vec::new());
//! for _ in 0..3 {
//!     let (tx, _) = ctx.connect("inproc://fan-doc").await?.split();
//!     let (_, rx) = listener.accept().await?.split();
//!     senders.push(tx);
//!     receivers.push(rx);
//! }
//! let mut out = FanOut::key_hash(senders, "shard")?;
//! let mut merged: FanIn = receivers.into_iter().collect();
//! for shard in ["a", "b", "a"] {
//!     out.feed(Message::new("work.item")?.with_meta("shard", shard)?).await?;
//! }
//! out.close().await?;
//! let mut from = Vec::new();
//! while let Some((source, msg)) = merged.next().await {
//!     from.push((source, msg?.meta().get("shard").unwrap().to_owned()));
//! }
//! assert_eq!(from.len(), 3);
//! let a: Vec<_> = from.iter().filter(|(_, s)| s == "a").map(|(src, _)| *src).collect();
//! assert_eq!(a[0], a[1]); // one key, one destination
//! # Ok(()) }
//! ```

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures_core::Stream;
use futures_sink::Sink;
use futures_util::task::noop_waker_ref;

use crate::channel::{Receiver, Sender};
use crate::error::{Error, ErrorKind, Result};
use crate::message::{Message, Meta};

/// A `Sink<Message>` over several channels; see [the module docs](self).
pub struct FanOut {
    dests: Vec<Dest>,
    policy: Policy,
    /// Round-robin: where the next search for a ready destination starts.
    cursor: usize,
    /// Round-robin: the destination `poll_ready` found ready.
    chosen: Option<usize>,
    dropped_destinations: u64,
}

struct Dest {
    tx: Sender,
    parked: Option<Message>,
}

enum Policy {
    Broadcast,
    RoundRobin,
    KeyHash(Box<str>),
}

/// 64-bit FNV-1a: stable across processes and releases, so a key maps to the same
/// destination index everywhere.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The destination's index and peer in an error, keeping the kind and the message.
fn dest_error(i: usize, tx: &Sender, mut e: Error) -> Error {
    let msg = e.take_message();
    let out = Error::new(
        e.kind(),
        format!("fan-out destination {i} ({})", tx.info().peer_url()),
    )
    .with_source(e);
    match msg {
        Some(m) => out.with_message(m),
        None => out,
    }
}

impl FanOut {
    fn new(senders: impl IntoIterator<Item = Sender>, policy: Policy) -> Result<FanOut> {
        let dests: Vec<Dest> = senders
            .into_iter()
            .map(|tx| Dest { tx, parked: None })
            .collect();
        if dests.is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                "a fan-out needs at least one destination",
            ));
        }
        Ok(FanOut {
            dests,
            policy,
            cursor: 0,
            chosen: None,
            dropped_destinations: 0,
        })
    }

    /// Every message to every destination; the slowest sets the pace. The body is shared
    /// between the copies of the message, not copied. A destination that fails fails the
    /// fan-out.
    pub fn broadcast(senders: impl IntoIterator<Item = Sender>) -> Result<FanOut> {
        FanOut::new(senders, Policy::Broadcast)
    }

    /// Each message to the next destination in turn that has room; a full one is skipped. A
    /// destination that fails is dropped from the rotation with a warning (see
    /// [`dropped_destinations`](Self::dropped_destinations)); the fan-out fails when none is
    /// left.
    pub fn round_robin(senders: impl IntoIterator<Item = Sender>) -> Result<FanOut> {
        FanOut::new(senders, Policy::RoundRobin)
    }

    /// Each message to destination [`destination_of`](Self::destination_of)`(value of
    /// key)`: one key value, one destination, in order. A message without the key is refused
    /// with [`ErrorKind::InvalidMeta`] (and handed back in the error). A destination that
    /// fails fails the fan-out. Fails with [`ErrorKind::Config`] for an invalid key.
    pub fn key_hash(senders: impl IntoIterator<Item = Sender>, key: &str) -> Result<FanOut> {
        Meta::new()
            .insert(key, "")
            .map_err(|e| Error::new(ErrorKind::Config, format!("fan-out key {key:?}: {e:#}")))?;
        FanOut::new(senders, Policy::KeyHash(key.into()))
    }

    /// The destination index for a key value: FNV-1a of its bytes modulo the number of
    /// destinations (stable across processes and releases).
    pub fn destination_of(&self, value: &str) -> usize {
        (fnv1a(value.as_bytes()) % self.dests.len() as u64) as usize
    }

    /// The number of destinations.
    pub fn len(&self) -> usize {
        self.dests.len()
    }

    /// True when no destination is left (round-robin, after every one failed).
    pub fn is_empty(&self) -> bool {
        self.dests.is_empty()
    }

    /// The destinations' senders, in order.
    pub fn senders(&self) -> impl Iterator<Item = &Sender> {
        self.dests.iter().map(|d| &d.tx)
    }

    /// Destinations dropped from a round-robin rotation because they failed.
    pub fn dropped_destinations(&self) -> u64 {
        self.dropped_destinations
    }

    /// The senders back, with any message still parked handed over if there is room now;
    /// the parked messages that could not be are returned with them.
    pub fn into_senders(mut self) -> (Vec<Sender>, Vec<Message>) {
        let mut cx = Context::from_waker(noop_waker_ref());
        let _ = self.poll_parked(&mut cx);
        let mut left = Vec::new();
        let senders = std::mem::take(&mut self.dests)
            .into_iter()
            .map(|d| {
                left.extend(d.parked);
                d.tx
            })
            .collect();
        (senders, left)
    }

    /// Hands parked messages over where there is room; `Ready(Ok)` when none is left.
    fn poll_parked(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut blocked = false;
        for (i, d) in self.dests.iter_mut().enumerate() {
            if d.parked.is_none() {
                continue;
            }
            match Pin::new(&mut d.tx).poll_ready(cx) {
                Poll::Ready(Ok(())) => {
                    let msg = d.parked.take().expect("a parked message");
                    if let Err(e) = Pin::new(&mut d.tx).start_send(msg) {
                        return Poll::Ready(Err(dest_error(i, &d.tx, e)));
                    }
                }
                Poll::Ready(Err(e)) => {
                    let msg = d.parked.take().expect("a parked message");
                    return Poll::Ready(Err(dest_error(i, &d.tx, e.with_message(msg))));
                }
                Poll::Pending => blocked = true,
            }
        }
        if blocked {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    }

    /// Round-robin: finds the next destination with room, dropping failed ones.
    fn poll_choose(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.chosen.is_some() {
            return Poll::Ready(Ok(()));
        }
        'search: loop {
            let n = self.dests.len();
            if n == 0 {
                return Poll::Ready(Err(Error::new(
                    ErrorKind::Closed,
                    "every destination of the round-robin fan-out failed",
                )));
            }
            for k in 0..n {
                let i = (self.cursor + k) % n;
                match Pin::new(&mut self.dests[i].tx).poll_ready(cx) {
                    Poll::Ready(Ok(())) => {
                        self.chosen = Some(i);
                        return Poll::Ready(Ok(()));
                    }
                    Poll::Ready(Err(e)) => {
                        let d = self.dests.remove(i);
                        self.dropped_destinations += 1;
                        tracing::warn!(
                            "round-robin fan-out: destination {i} ({}) failed and leaves the rotation ({} left): {e:#}",
                            d.tx.info().peer_url(),
                            self.dests.len()
                        );
                        self.cursor = i;
                        continue 'search;
                    }
                    Poll::Pending => {}
                }
            }
            return Poll::Pending;
        }
    }

    /// Hands `msg` to destination `i` if it has room now, parks it there otherwise.
    fn offer(&mut self, i: usize, msg: Message) -> Result<()> {
        let d = &mut self.dests[i];
        if d.parked.is_some() {
            return Err(Error::new(
                ErrorKind::Full,
                format!("fan-out destination {i}: start_send without a successful poll_ready"),
            )
            .with_message(msg));
        }
        let mut cx = Context::from_waker(noop_waker_ref());
        match Pin::new(&mut d.tx).poll_ready(&mut cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut d.tx)
                .start_send(msg)
                .map_err(|e| dest_error(i, &d.tx, e)),
            Poll::Ready(Err(e)) => Err(dest_error(i, &d.tx, e.with_message(msg))),
            Poll::Pending => {
                d.parked = Some(msg);
                Ok(())
            }
        }
    }
}

impl Sink<Message> for FanOut {
    type Error = Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_parked(cx))?;
        match this.policy {
            Policy::RoundRobin => this.poll_choose(cx),
            Policy::Broadcast | Policy::KeyHash(_) => Poll::Ready(Ok(())),
        }
    }

    fn start_send(self: Pin<&mut Self>, msg: Message) -> Result<()> {
        let this = self.get_mut();
        match &this.policy {
            Policy::Broadcast => {
                let last = this.dests.len() - 1;
                for i in 0..last {
                    this.offer(i, msg.clone())?;
                }
                this.offer(last, msg)
            }
            Policy::RoundRobin => {
                let Some(i) = this.chosen.take() else {
                    return Err(Error::new(
                        ErrorKind::Full,
                        "round-robin fan-out: start_send without a successful poll_ready",
                    )
                    .with_message(msg));
                };
                this.cursor = i + 1;
                let d = &mut this.dests[i];
                Pin::new(&mut d.tx)
                    .start_send(msg)
                    .map_err(|e| dest_error(i, &d.tx, e))
            }
            Policy::KeyHash(key) => {
                let Some(value) = msg.meta().get(key) else {
                    return Err(Error::new(
                        ErrorKind::InvalidMeta,
                        format!(
                            "key-hash fan-out: a message of type `{}` has no metadata key `{key}`",
                            msg.kind()
                        ),
                    )
                    .with_message(msg));
                };
                let i = this.destination_of(value);
                this.offer(i, msg)
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_parked(cx))?;
        let mut pending = false;
        for (i, d) in this.dests.iter_mut().enumerate() {
            match Pin::new(&mut d.tx).poll_flush(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(dest_error(i, &d.tx, e))),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        ready!(self.as_mut().poll_flush(cx))?;
        let mut pending = false;
        for (i, d) in self.get_mut().dests.iter_mut().enumerate() {
            match Pin::new(&mut d.tx).poll_close(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(dest_error(i, &d.tx, e))),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    }
}

impl Drop for FanOut {
    fn drop(&mut self) {
        let parked = self.dests.iter().filter(|d| d.parked.is_some()).count();
        if parked > 0 {
            tracing::warn!(
                "fan-out dropped with {parked} messages not handed over (poll_flush or close first)"
            );
        }
    }
}

impl fmt::Debug for FanOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policy = match &self.policy {
            Policy::Broadcast => "broadcast".to_owned(),
            Policy::RoundRobin => "round-robin".to_owned(),
            Policy::KeyHash(k) => format!("key-hash({k})"),
        };
        f.debug_struct("FanOut")
            .field("policy", &policy)
            .field("destinations", &self.dests.len())
            .finish()
    }
}

/// A `Stream` merging several receivers, each message tagged with its source's key; see
/// [the module docs](self). Keys are `usize` indexes when collected from an iterator of
/// receivers, or anything `Clone` given to [`push`](FanIn::push).
pub struct FanIn<K = usize> {
    sources: Vec<(K, Receiver)>,
    next: usize,
}

impl<K> FanIn<K> {
    /// No sources (the stream ends at once unless some are pushed).
    pub fn new() -> FanIn<K> {
        FanIn {
            sources: Vec::new(),
            next: 0,
        }
    }

    /// Adds a source, whose messages come tagged with `key`.
    pub fn push(&mut self, key: K, rx: Receiver) {
        self.sources.push((key, rx));
    }

    /// Sources still open.
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    /// True when every source has ended.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }
}

impl<K> Default for FanIn<K> {
    fn default() -> Self {
        FanIn::new()
    }
}

impl FromIterator<Receiver> for FanIn<usize> {
    /// Sources keyed by their position: 0, 1, 2, …
    fn from_iter<I: IntoIterator<Item = Receiver>>(iter: I) -> Self {
        FanIn {
            sources: iter.into_iter().enumerate().collect(),
            next: 0,
        }
    }
}

impl<K: Clone + Unpin> Stream for FanIn<K> {
    type Item = (K, Result<Message>);

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            let n = this.sources.len();
            if n == 0 {
                return Poll::Ready(None);
            }
            let start = this.next % n;
            let mut ended = None;
            for k in 0..n {
                let i = (start + k) % n;
                match Pin::new(&mut this.sources[i].1).poll_next(cx) {
                    Poll::Ready(Some(item)) => {
                        this.next = i + 1;
                        return Poll::Ready(Some((this.sources[i].0.clone(), item)));
                    }
                    Poll::Ready(None) => {
                        ended = Some(i);
                        break;
                    }
                    Poll::Pending => {}
                }
            }
            match ended {
                // Drop it and look again: the sources after it were not polled.
                Some(i) => {
                    this.sources.remove(i);
                    this.next = i;
                }
                None => return Poll::Pending,
            }
        }
    }
}

impl<K: fmt::Debug> fmt::Debug for FanIn<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FanIn")
            .field(
                "sources",
                &self.sources.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .finish()
    }
}
