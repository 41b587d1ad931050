//! The bench's own conversation over the channel it measures, and both of its sides.
//!
//! The runner (the side that prints the table) drives every point; the peer (`hf bench
//! --serve`, spawned by the runner on loopback) answers. Per point:
//!
//! ```text
//! runner                                     peer
//! hf.bench.start {pattern,size,verify,ms} →
//!                                         ← hf.bench.go
//! hf.bench.warm × warm-up                 →  (echoed for lat; read and dropped otherwise)
//! hf.bench.data × the run, correlation=seq →  (echoed for lat; counted, ordered, verified)
//! hf.bench.end {sent}                     →
//!                                         ← hf.bench.result (JSON: what arrived, when, CPU)
//! ```
//!
//! Rate and bandwidth are what the **peer** saw arrive, from the first measured message to the
//! last, so nothing that is merely queued at the sender counts. Every data message carries
//! its sequence number in the header's correlation id; the peer counts messages out of order
//! and, with verify, bodies whose content is wrong, and the runner fails the point when
//! anything was lost or damaged.

use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use hyperframes::{Body, Channel, Header, Message, MsgType};
use serde_json::json;

use super::stats::{self, Cpu, Intervals};

pub(crate) const START: &str = "hf.bench.start";
pub(crate) const GO: &str = "hf.bench.go";
pub(crate) const WARM: &str = "hf.bench.warm";
pub(crate) const DATA: &str = "hf.bench.data";
pub(crate) const END: &str = "hf.bench.end";
pub(crate) const RESULT: &str = "hf.bench.result";

/// What a point measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub(crate) enum Pattern {
    /// Ping-pong: one message out, its echo back; latency is half the round trip.
    Lat,
    /// Streaming small messages: messages per second at the receiver.
    Rate,
    /// Streaming large messages: bytes per second at the receiver.
    Bw,
}

impl Pattern {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Pattern::Lat => "lat",
            Pattern::Rate => "rate",
            Pattern::Bw => "bw",
        }
    }

    fn parse(s: &str) -> Option<Pattern> {
        match s {
            "lat" => Some(Pattern::Lat),
            "rate" => Some(Pattern::Rate),
            "bw" => Some(Pattern::Bw),
            _ => None,
        }
    }
}

/// How long to warm up before measuring.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Warmup {
    Messages(u64),
    Time(Duration),
}

/// The settings every point of a run shares.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub(crate) duration: Duration,
    pub(crate) warmup: Warmup,
    /// Verify every body's content at the receiver (always on for bw).
    pub(crate) verify: bool,
    /// Fill bodies in memory from `Sender::alloc` (the transport's own) instead of sending
    /// heap buffers.
    pub(crate) zero_copy: bool,
    /// Distinct heap buffers sent in turn (a power of two; `--buffers`).
    pub(crate) buffers: usize,
    /// Fixed offered load, messages per second.
    pub(crate) rate: Option<f64>,
    /// Bodies in memory of this device (`--device`).
    pub(crate) device: Option<super::device::Gpu>,
}

/// What one point measured.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// Messages measured (round trips for lat).
    pub(crate) messages: u64,
    pub(crate) seconds: f64,
    pub(crate) msgs_per_s: f64,
    pub(crate) gbytes_per_s: f64,
    /// Half round trips, in nanoseconds (lat only).
    pub(crate) latency: Option<Histogram<u64>>,
    /// Both processes (once when the peer is this process), over the measured part.
    pub(crate) cpu: Cpu,
    /// Messages per second in each interval of the run.
    pub(crate) rates: Vec<f64>,
    pub(crate) verified: bool,
}

type Failed = String;

fn lost(e: impl std::fmt::Display) -> Failed {
    e.to_string()
}

async fn next(ch: &mut Channel) -> Result<Message, Failed> {
    match ch.recv().await {
        Some(Ok(m)) => Ok(m),
        Some(Err(e)) => Err(lost(e)),
        None => Err("the peer closed the connection".into()),
    }
}

async fn expect(ch: &mut Channel, kind: &str) -> Result<Message, Failed> {
    let m = next(ch).await?;
    if m.kind().as_str() != kind {
        return Err(format!(
            "the peer answered {} where {kind} was expected",
            m.kind()
        ));
    }
    Ok(m)
}

fn meta_u64(m: &Message, key: &str) -> Result<u64, Failed> {
    m.meta()
        .get(key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{} without a numeric {key}", m.kind()))
}

// ------------------------------------------------------------------------ peer side

/// What the peer does with data while a point runs.
enum Mode {
    Echo,
    Sink { verify: bool },
}

/// The peer's record of one point.
struct Arrivals {
    mode: Mode,
    run: Duration,
    first: Option<(Instant, Cpu)>,
    last: Instant,
    intervals: Option<Intervals>,
    messages: u64,
    /// Messages counted into `intervals` (up to the last clock reading).
    clocked: u64,
    bytes: u64,
    next_seq: u64,
    out_of_order: u64,
    damaged: u64,
    sum: u64,
}

impl Arrivals {
    fn data(&mut self, m: &Message) {
        self.messages += 1;
        // The clock costs ~20 ns, a tenth of what a small message costs here: read it for the
        // first message, for large ones, and for every 16th small one (`result` reads it for
        // the rest).
        if self.first.is_none() || m.body().len() >= 4096 || self.messages.is_multiple_of(16) {
            self.clock(Instant::now());
        }
        let body = m.body();
        self.bytes += body.len() as u64;
        let seq = m.header().correlation;
        if seq != self.next_seq {
            self.out_of_order += 1;
        }
        self.next_seq = seq.wrapping_add(1);
        if let Mode::Sink { verify } = self.mode {
            match body.as_bytes() {
                Some(b) if verify => self.damaged += u64::from(!stats::check(b)),
                Some(b) => self.sum = self.sum.wrapping_add(stats::touch(b)),
                // In device memory: the first of the point is copied back and checked.
                None if verify && self.messages == 1 => {
                    let ok = super::device::check(body, stats::check).unwrap_or(true);
                    self.damaged += u64::from(!ok);
                }
                None => {}
            }
        }
    }

    /// Counts the messages since the last reading as arrived by `now`.
    fn clock(&mut self, now: Instant) {
        let (start, _) = *self.first.get_or_insert_with(|| (now, Cpu::now()));
        let run = self.run;
        self.intervals
            .get_or_insert_with(|| Intervals::for_run(start, run))
            .add(now, self.messages - self.clocked);
        self.clocked = self.messages;
        self.last = now;
    }

    fn result(&mut self, sent: u64) -> Bytes {
        if self.clocked < self.messages {
            self.clock(Instant::now());
        }
        let cpu = self
            .first
            .map(|(_, c)| Cpu::now().since(c))
            .unwrap_or_default();
        let seconds = self
            .first
            .map_or(0.0, |(t, _)| self.last.duration_since(t).as_secs_f64());
        let rates = self
            .intervals
            .as_ref()
            .map(|iv| iv.rates(self.last))
            .unwrap_or_default();
        std::hint::black_box(self.sum);
        let v = json!({
            "pid": std::process::id(),
            "sent": sent,
            "messages": self.messages,
            "bytes": self.bytes,
            "seconds": seconds,
            "rates": rates,
            "out_of_order": self.out_of_order,
            "damaged": self.damaged,
            "cpu": {"user_s": cpu.user_s, "sys_s": cpu.sys_s},
        });
        Bytes::from(v.to_string())
    }
}

/// Answers one runner on `ch` until it closes the connection.
pub(crate) async fn serve_channel(mut ch: Channel) -> Result<(), Failed> {
    let mut point: Option<Arrivals> = None;
    while let Some(m) = ch.recv().await {
        let m = m.map_err(lost)?;
        match (m.kind().as_str(), point.as_mut()) {
            (WARM, Some(p)) => {
                if matches!(p.mode, Mode::Echo) {
                    ch.send(m).await.map_err(lost)?;
                }
            }
            (DATA, Some(p)) => {
                p.data(&m);
                if matches!(p.mode, Mode::Echo) {
                    ch.send(m).await.map_err(lost)?;
                }
            }
            (START, _) => {
                let pattern = m
                    .meta()
                    .get("pattern")
                    .and_then(Pattern::parse)
                    .ok_or("hf.bench.start without a known pattern")?;
                let verify = m.meta().get("verify") == Some("1");
                let run = Duration::from_millis(meta_u64(&m, "ms")?);
                point = Some(Arrivals {
                    mode: match pattern {
                        Pattern::Lat => Mode::Echo,
                        Pattern::Rate | Pattern::Bw => Mode::Sink { verify },
                    },
                    run,
                    first: None,
                    last: Instant::now(),
                    intervals: None,
                    messages: 0,
                    clocked: 0,
                    bytes: 0,
                    next_seq: 0,
                    out_of_order: 0,
                    damaged: 0,
                    sum: 0,
                });
                ch.send(Message::new(GO).map_err(lost)?)
                    .await
                    .map_err(lost)?;
            }
            (END, Some(p)) => {
                let sent = meta_u64(&m, "sent")?;
                let result = Message::new(RESULT)
                    .map_err(lost)?
                    .with_body(p.result(sent));
                ch.send(result).await.map_err(lost)?;
                point = None;
            }
            (other, _) => return Err(format!("unexpected message {other} from the runner")),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------- runner side

/// Bodies to send: a few heap buffers holding the pattern (reused, as an application reuses
/// its buffers), or, with zero copy, memory from the transport filled in place each time.
struct Bodies {
    /// [`Settings::buffers`] host buffers, or device memory with `--device`.
    heap: Vec<Body>,
    size: usize,
    zero_copy: bool,
}

impl Bodies {
    fn new(size: usize, s: &Settings) -> Result<Bodies, Failed> {
        // A power of two (`--buffers` checks it), so picking one is a mask, not a division
        // per message.
        let count = if s.zero_copy { 0 } else { s.buffers };
        let heap = match &s.device {
            Some(gpu) => super::device::bodies(gpu, size, count, stats::fill)?,
            None => (0..count)
                .map(|_| {
                    let mut v = vec![0u8; size];
                    stats::fill(&mut v);
                    Body::from(v)
                })
                .collect(),
        };
        Ok(Bodies {
            heap,
            size,
            zero_copy: s.zero_copy,
        })
    }

    /// The message `seq`: built right here from a reused buffer, or, with zero copy, in memory
    /// the transport lends (which may have to wait for room).
    ///
    /// Without zero copy nothing is awaited: the message is built where the loop sends it,
    /// as an application would, instead of coming out of a future of its own (a 128-byte
    /// move more per message, and a harness that took a fifth of the sender's CPU in
    /// `perf` of the 64 B rate).
    async fn message(
        &self,
        tx: &mut hyperframes::Sender,
        kind: &MsgType,
        seq: u64,
    ) -> Result<Message, Failed> {
        if !self.zero_copy {
            return Ok(self.reused(kind, seq));
        }
        let mut b = tx.alloc(self.size).await.map_err(lost)?;
        stats::fill(&mut b);
        Ok(Self::build(kind, b.freeze(), seq))
    }

    /// The message `seq` on one of the reused buffers (not with zero copy).
    #[inline]
    fn reused(&self, kind: &MsgType, seq: u64) -> Message {
        Self::build(
            kind,
            self.heap[seq as usize & (self.heap.len() - 1)].clone(),
            seq,
        )
    }

    #[inline]
    fn build(kind: &MsgType, body: Body, seq: u64) -> Message {
        Message::from_parts(
            kind.clone(),
            Default::default(),
            body,
            Header {
                correlation: seq,
                ..Header::default()
            },
        )
    }
}

/// Waits until `at`: sleeping while it is far, yielding (spinning) for the last stretch, so a
/// paced sender is on time to the microsecond rather than to the timer's millisecond.
async fn pace(at: Instant) {
    loop {
        let now = Instant::now();
        if now >= at {
            return;
        }
        let left = at - now;
        if left > Duration::from_millis(2) {
            tokio::time::sleep(left - Duration::from_millis(1)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// The peer's `hf.bench.result`.
struct PeerResult {
    pid: u32,
    messages: u64,
    bytes: u64,
    seconds: f64,
    rates: Vec<f64>,
    out_of_order: u64,
    damaged: u64,
    cpu: Cpu,
}

async fn finish(ch: &mut Channel, sent: u64) -> Result<PeerResult, Failed> {
    let end = Message::new(END)
        .map_err(lost)?
        .with_meta("sent", sent)
        .map_err(lost)?;
    ch.send(end).await.map_err(lost)?;
    let m = expect(ch, RESULT).await?;
    let bad = || "hf.bench.result is not the JSON expected".to_owned();
    let body = m.body().as_bytes().ok_or_else(bad)?;
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|_| bad())?;
    let u = |k: &str| v[k].as_u64().ok_or_else(bad);
    let f = |v: &serde_json::Value| v.as_f64().ok_or_else(bad);
    Ok(PeerResult {
        pid: u("pid")? as u32,
        messages: u("messages")?,
        bytes: u("bytes")?,
        seconds: f(&v["seconds"])?,
        rates: v["rates"]
            .as_array()
            .ok_or_else(bad)?
            .iter()
            .map(f)
            .collect::<Result<_, _>>()?,
        out_of_order: u("out_of_order")?,
        damaged: u("damaged")?,
        cpu: Cpu {
            user_s: f(&v["cpu"]["user_s"])?,
            sys_s: f(&v["cpu"]["sys_s"])?,
        },
    })
}

impl PeerResult {
    /// Fails unless every message sent arrived, in order, intact.
    fn check(&self, sent: u64, what: &str) -> Result<(), Failed> {
        if self.messages != sent {
            return Err(format!(
                "{what}: sent {sent} messages but the peer received {} (lost {})",
                self.messages,
                sent.saturating_sub(self.messages)
            ));
        }
        if self.out_of_order > 0 {
            return Err(format!(
                "{what}: {} messages arrived out of order",
                self.out_of_order
            ));
        }
        if self.damaged > 0 {
            return Err(format!(
                "{what}: {} bodies failed verification",
                self.damaged
            ));
        }
        Ok(())
    }

    /// The peer's CPU time, unless the peer is this process (inproc), whose time the
    /// runner's own measurement already holds.
    fn cpu(&self) -> Cpu {
        if self.pid == std::process::id() {
            Cpu::default()
        } else {
            self.cpu
        }
    }
}

/// Runs one point on `ch`.
pub(crate) async fn run_point(
    ch: &mut Channel,
    pattern: Pattern,
    size: usize,
    s: &Settings,
) -> Result<Outcome, Failed> {
    let verify = s.verify || pattern == Pattern::Bw;
    let start = Message::new(START)
        .map_err(lost)?
        .with_meta("pattern", pattern.as_str())
        .and_then(|m| m.with_meta("verify", if verify { "1" } else { "0" }))
        .and_then(|m| m.with_meta("ms", s.duration.as_millis().to_string()))
        .map_err(lost)?;
    ch.send(start).await.map_err(lost)?;
    expect(ch, GO).await?;
    let what = format!("{} {} B", pattern.as_str(), size);
    let bodies = Bodies::new(size, s)?;
    let warm = MsgType::new(WARM).map_err(|e| e.to_string())?;
    let data = MsgType::new(DATA).map_err(|e| e.to_string())?;

    // Warm-up: the same traffic, not measured.
    let warm_started = Instant::now();
    let mut n = 0u64;
    while match s.warmup {
        Warmup::Messages(max) => n < max,
        Warmup::Time(d) => warm_started.elapsed() < d,
    } {
        let m = bodies.message(ch.halves_mut().0, &warm, n).await?;
        ch.send(m).await.map_err(lost)?;
        if pattern == Pattern::Lat {
            expect(ch, WARM).await?;
        }
        n += 1;
    }

    match pattern {
        Pattern::Lat => latency(ch, &bodies, &data, s, &what).await,
        Pattern::Rate | Pattern::Bw => stream(ch, &bodies, &data, s, verify, &what).await,
    }
}

async fn stream(
    ch: &mut Channel,
    bodies: &Bodies,
    data: &MsgType,
    s: &Settings,
    verify: bool,
    what: &str,
) -> Result<Outcome, Failed> {
    let cpu0 = Cpu::now();
    let t0 = Instant::now();
    let end = t0 + s.duration;
    let mut seq = 0u64;
    loop {
        match s.rate {
            Some(rate) => {
                let at = t0 + Duration::from_secs_f64(seq as f64 / rate);
                if at >= end {
                    break;
                }
                pace(at).await;
            }
            // Reading the clock costs ~20 ns: every 16th message is often enough.
            None if seq.is_multiple_of(16) && Instant::now() >= end => break,
            None => {}
        }
        let m = if bodies.zero_copy {
            bodies.message(ch.halves_mut().0, data, seq).await?
        } else {
            bodies.reused(data, seq)
        };
        ch.send(m).await.map_err(lost)?;
        seq += 1;
    }
    let peer = finish(ch, seq).await?;
    let cpu = Cpu::now().since(cpu0).plus(peer.cpu());
    peer.check(seq, what)?;
    if peer.messages < 2 || peer.seconds <= 0.0 {
        return Err(format!(
            "{what}: too few messages arrived to measure a rate; use a longer --duration"
        ));
    }
    // From the first arrival to the last: the first message starts the clock.
    let msgs_per_s = (peer.messages - 1) as f64 / peer.seconds;
    let per_msg = peer.bytes as f64 / peer.messages as f64;
    Ok(Outcome {
        messages: peer.messages,
        seconds: peer.seconds,
        msgs_per_s,
        gbytes_per_s: msgs_per_s * per_msg / 1e9,
        latency: None,
        cpu,
        rates: peer.rates,
        verified: verify && s.device.is_none(),
    })
}

async fn latency(
    ch: &mut Channel,
    bodies: &Bodies,
    data: &MsgType,
    s: &Settings,
    what: &str,
) -> Result<Outcome, Failed> {
    let mut hist = stats::histogram();
    let cpu0 = Cpu::now();
    let t0 = Instant::now();
    let end = t0 + s.duration;
    let mut intervals = Intervals::for_run(t0, s.duration);
    let sent = match s.rate {
        None => {
            // Closed loop: the next ping leaves when the last echo is back.
            let mut seq = 0u64;
            loop {
                let sent_at = Instant::now();
                if sent_at >= end {
                    break;
                }
                let m = if bodies.zero_copy {
                    bodies.message(ch.halves_mut().0, data, seq).await?
                } else {
                    bodies.reused(data, seq)
                };
                ch.send(m).await.map_err(lost)?;
                let back = next(ch).await?;
                let now = Instant::now();
                stats::record(&mut hist, (now - sent_at).as_nanos() as u64 / 2);
                intervals.add(now, 1);
                check_echo(&back, seq, s.verify, what)?;
                seq += 1;
            }
            seq
        }
        Some(rate) => {
            // Open loop at a fixed offered load: each ping has an intended send time, and its
            // latency counts from then, so a stall delays (and is charged to) every ping
            // behind it instead of quietly lowering the load (coordinated omission).
            let total = (s.duration.as_secs_f64() * rate).floor() as u64;
            let intended = |seq: u64| t0 + Duration::from_secs_f64(seq as f64 / rate);
            let (tx, rx) = ch.halves_mut();
            let sending = async {
                for seq in 0..total {
                    pace(intended(seq)).await;
                    let m = bodies.message(tx, data, seq).await?;
                    tx.send(m).await.map_err(lost)?;
                }
                Ok::<(), Failed>(())
            };
            let receiving = async {
                for seq in 0..total {
                    let back = match rx.recv().await {
                        Some(Ok(m)) => m,
                        Some(Err(e)) => return Err(lost(e)),
                        None => return Err("the peer closed the connection".into()),
                    };
                    let now = Instant::now();
                    stats::record(
                        &mut hist,
                        now.saturating_duration_since(intended(seq)).as_nanos() as u64 / 2,
                    );
                    intervals.add(now, 1);
                    check_echo(&back, seq, s.verify, what)?;
                }
                Ok(())
            };
            let (a, b) = tokio::join!(sending, receiving);
            a.and(b)?;
            total
        }
    };
    let seconds = t0.elapsed().as_secs_f64();
    let last = Instant::now();
    let peer = finish(ch, sent).await?;
    let cpu = Cpu::now().since(cpu0).plus(peer.cpu());
    peer.check(sent, what)?;
    if sent == 0 {
        return Err(format!(
            "{what}: no round trip completed; use a longer --duration"
        ));
    }
    let msgs_per_s = sent as f64 / seconds;
    Ok(Outcome {
        messages: sent,
        seconds,
        msgs_per_s,
        gbytes_per_s: msgs_per_s * bodies.size as f64 / 1e9,
        latency: Some(hist),
        cpu,
        rates: intervals.rates(last),
        verified: s.verify && s.device.is_none(),
    })
}

/// An echo must answer the ping it follows and, with verify, carry the body intact.
fn check_echo(back: &Message, seq: u64, verify: bool, what: &str) -> Result<(), Failed> {
    let got = back.header().correlation;
    if back.kind().as_str() != DATA || got != seq {
        return Err(format!(
            "{what}: {} {got} came back for ping {seq}",
            back.kind()
        ));
    }
    if verify && back.body().as_bytes().is_some_and(|b| !stats::check(b)) {
        return Err(format!(
            "{what}: the echo of ping {seq} failed verification"
        ));
    }
    Ok(())
}
