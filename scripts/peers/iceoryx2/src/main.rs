//! iox2-bench: iceoryx2 (publish-subscribe over shared memory) measured the way `hf bench`
//! measures hyperframes, so that `scripts/compare.py` can print both in one run.
//!
//! ```text
//! iox2-bench --pattern lat|rate|bw [--size BYTES] [--duration SECS] [--pin A,B] [--buffer N]
//! ```
//!
//! The runner (this process) spawns its peer (this binary again, hidden role `__peer`) and
//! talks to it over two channels: iceoryx2 services for the data, and the peer's stdout pipe
//! for control lines (READY, GO, RESULT ...). Every sample carries a `u64` user header: the
//! sequence number, with flag bits for warm-up samples and for the final END sample, which
//! also carries how many measured samples were sent.
//!
//! * lat: ping-pong on two services; each side busy-polls `receive()`. Half the round trip.
//! * rate: the runner publishes `size`-byte samples as fast as it can; the peer counts them.
//!   Rate = (messages - 1) / (last arrival - first arrival), at the receiver.
//! * bw: as rate, but every sample is filled word by word in place in the loaned shared
//!   memory and every byte is checked by the peer; GB/s (1e9 B/s) at the receiver.
//!
//! Exactly one JSON line goes to stdout; errors go to stderr with exit status 1.

use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use iceoryx2::port::publisher::Publisher;
use iceoryx2::port::subscriber::Subscriber;
use iceoryx2::port::update_connections::UpdateConnections;
use iceoryx2::port::{BackpressureAction, LoanError};
use iceoryx2::prelude::*;
use iceoryx2::sample::Sample;
use iceoryx2::service::port_factory::publish_subscribe::PortFactory as PubSubFactory;

type Svc = ipc::Service;
type Pub = Publisher<Svc, [u8], u64>;
type Sub = Subscriber<Svc, [u8], u64>;
type Received = Sample<Svc, [u8], u64>;
type Factory = PubSubFactory<Svc, [u8], u64>;
type Error = Box<dyn std::error::Error>;

const IOX2_VERSION: &str = env!("IOX2_VERSION");

/// User-header flag: a warm-up sample (echoed or read, never counted).
const WARM: u64 = 1 << 63;
/// User-header flag: the last sample; the low bits hold how many measured samples were sent.
const END: u64 = 1 << 62;
const SEQ: u64 = END - 1;

const WARMUP: Duration = Duration::from_millis(500);
/// How long to wait for the peer to start, connect, or answer before giving up.
const PATIENCE: Duration = Duration::from_secs(10);
/// How long a publisher retries a full subscriber queue before failing the send.
const BACKPRESSURE_LIMIT: Duration = Duration::from_secs(10);

/// Set by SIGINT/SIGTERM (and, in the peer, by the runner's death through PDEATHSIG): every
/// wait loop checks it, so both processes drop their iceoryx2 ports and leave no resources.
static STOP: AtomicBool = AtomicBool::new(false);

/// Sends that found the subscriber's queue full and had to wait, and those whose wait went
/// on into iceoryx2's sleeping phase: reported so that a low rate can be explained.
static BLOCKED: AtomicU64 = AtomicU64::new(0);
static SLEPT: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn install_signal_handlers() {
    // SAFETY: a handler that only stores to an atomic is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
    }
}

fn interrupted() -> Result<(), Error> {
    if STOP.load(Ordering::Relaxed) {
        return Err("interrupted".into());
    }
    Ok(())
}

fn pin(cpu: usize) -> Result<(), Error> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(format!("bad CPU {cpu}").into());
    }
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0, ..) pins the calling thread,
    // which is the only one (called first thing in main, before iceoryx2 starts anything).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(format!("cannot pin to CPU {cpu}: {}", io::Error::last_os_error()).into());
        }
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pattern {
    Lat,
    Rate,
    Bw,
}

impl Pattern {
    fn parse(s: &str) -> Result<Pattern, Error> {
        match s {
            "lat" => Ok(Pattern::Lat),
            "rate" => Ok(Pattern::Rate),
            "bw" => Ok(Pattern::Bw),
            _ => Err(format!("bad --pattern {s:?}: expected lat, rate or bw").into()),
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Pattern::Lat => "lat",
            Pattern::Rate => "rate",
            Pattern::Bw => "bw",
        }
    }

    fn default_size(self) -> usize {
        match self {
            Pattern::Lat | Pattern::Rate => 64,
            Pattern::Bw => 4 << 20,
        }
    }

    /// Subscriber queue depth: how many samples may be in flight before the publisher has
    /// to retry. One is all a ping-pong needs; a deep queue lets a small-message stream run
    /// without the publisher waiting at every sample; a few 4 MiB samples keep a pipeline.
    fn default_buffer(self) -> usize {
        match self {
            Pattern::Lat => 1,
            Pattern::Rate => 256,
            Pattern::Bw => 4,
        }
    }
}

const USAGE: &str = "\
usage: iox2-bench --pattern lat|rate|bw [--size BYTES] [--duration SECS] [--pin A,B] [--buffer N]
  --size      message size (default: 64 for lat and rate, 4194304 for bw)
  --duration  seconds measured, after a 0.5 s warm-up (default 2)
  --pin A,B   pin this process to CPU A and the peer process to CPU B
  --buffer N  subscriber queue depth (default: lat 1, rate 256, bw 4)
Prints one JSON line on stdout.";

struct Opts {
    pattern: Pattern,
    size: usize,
    duration: Duration,
    pin: Option<(usize, usize)>,
    buffer: usize,
}

fn parse_opts(args: &[String]) -> Result<Opts, Error> {
    let mut pattern = None;
    let mut size = None;
    let mut duration = 2.0f64;
    let mut pin = None;
    let mut buffer = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (key, inline) = match a.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        if key == "-h" || key == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let mut value = || -> Result<String, Error> {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| format!("{key} needs a value").into())
        };
        match key {
            "--pattern" => pattern = Some(Pattern::parse(&value()?)?),
            "--size" => size = Some(parse_num::<usize>(key, &value()?)?),
            "--duration" => duration = parse_num::<f64>(key, &value()?)?,
            "--buffer" => buffer = Some(parse_num::<usize>(key, &value()?)?),
            "--pin" => {
                let v = value()?;
                let (a, b) = v
                    .split_once(',')
                    .ok_or_else(|| format!("bad --pin {v:?}: expected A,B"))?;
                pin = Some((parse_num(key, a)?, parse_num(key, b)?));
            }
            _ => return Err(format!("unknown argument {a:?}\n{USAGE}").into()),
        }
    }
    let pattern = pattern.ok_or_else(|| format!("--pattern is required\n{USAGE}"))?;
    let size = size.unwrap_or(pattern.default_size());
    if size == 0 {
        return Err("--size must be at least 1".into());
    }
    if !(duration.is_finite() && duration > 0.0) {
        return Err("--duration must be a positive number of seconds".into());
    }
    let buffer = buffer.unwrap_or(pattern.default_buffer());
    if buffer == 0 {
        return Err("--buffer must be at least 1".into());
    }
    Ok(Opts {
        pattern,
        size,
        duration: Duration::from_secs_f64(duration),
        pin,
        buffer,
    })
}

fn parse_num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, Error> {
    v.trim()
        .parse()
        .map_err(|_| format!("bad {key} {v:?}: not a number").into())
}

// ---------------------------------------------------------------------------------------
// iceoryx2 plumbing shared by both processes

fn node(role: &str) -> Result<Node<Svc>, Error> {
    // The built-in defaults, whatever iceoryx2.toml the host may have: resources under
    // /tmp/iceoryx2 and /dev/shm/iox2_*. No signal handler of iceoryx2's: ours (above)
    // sets STOP, which every loop here checks.
    let name: NodeName = format!("iox2-bench-{role}").as_str().try_into()?;
    Ok(NodeBuilder::new()
        .name(&name)
        .config(&Config::default())
        .signal_handling_mode(SignalHandlingMode::Disabled)
        .create::<Svc>()?)
}

/// Both sides open the service with the same settings, so that whichever comes first creates
/// it and the other's requirements match. No safe overflow: a full queue makes the publisher
/// retry (see `publisher`), it never overwrites an unread sample.
fn service(node: &Node<Svc>, name: &str, buffer: usize) -> Result<Factory, Error> {
    let name: ServiceName = name.try_into()?;
    Ok(node
        .service_builder(&name)
        .publish_subscribe::<[u8]>()
        .user_header::<u64>()
        .payload_alignment(Alignment::new(8).expect("power of two"))
        .enable_safe_overflow(false)
        .subscriber_max_buffer_size(buffer)
        .subscriber_max_borrowed_samples(2)
        .history_size(0)
        .max_publishers(1)
        .max_subscribers(1)
        .max_nodes(2)
        .open_or_create()?)
}

/// RetryUntilDelivered: a send to a full queue waits (iceoryx2 spins, yields, then sleeps)
/// until the subscriber has taken a sample. The handler keeps that retry but gives up after
/// BACKPRESSURE_LIMIT or on a signal, so a stuck peer cannot hang the runner.
fn publisher(svc: &Factory, size: usize, other: Other) -> Result<Pub, Error> {
    Ok(svc
        .publisher_builder()
        .initial_max_slice_len(size)
        .max_loaned_samples(2)
        .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
        .set_backpressure_handler(move |info: &iceoryx2::port::BackpressureInfo| {
            if info.retries == 0 {
                BLOCKED.fetch_add(1, Ordering::Relaxed);
            } else if info.retries == 10_000 {
                // iceoryx2's adaptive wait yields 10 000 times, then sleeps (100 µs, later 10 ms).
                SLEPT.fetch_add(1, Ordering::Relaxed);
            }
            let give_up = STOP.load(Ordering::Relaxed)
                || info.elapsed_time > BACKPRESSURE_LIMIT
                || (info.retries % 256 == 255 && !other.alive());
            if give_up {
                BackpressureAction::DiscardDataAndFail
            } else {
                BackpressureAction::Retry
            }
        })
        .create()?)
}

/// The other process, as seen from a publisher waiting on a full queue: a dead subscriber
/// process is not noticed by iceoryx2 until its node is cleaned up, so the wait asks.
#[derive(Clone, Copy)]
enum Other {
    /// The runner's view: the peer, its child.
    Child(libc::pid_t),
    /// The peer's view: the runner, its parent.
    Parent(libc::pid_t),
}

impl Other {
    fn alive(self) -> bool {
        match self {
            Other::Child(pid) => {
                // WNOWAIT: look without reaping, so that `Child::try_wait` still works.
                // SAFETY: siginfo_t is plain data.
                let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
                let r = unsafe {
                    libc::waitid(
                        libc::P_PID,
                        pid as libc::id_t,
                        &mut info,
                        libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                    )
                };
                // Running: r == 0 and si_pid == 0. Exited (zombie): si_pid == pid.
                r == 0 && unsafe { info.si_pid() } == 0
            }
            // SAFETY: getppid cannot fail.
            Other::Parent(pid) => (unsafe { libc::getppid() }) == pid,
        }
    }
}

fn subscriber(svc: &Factory, buffer: usize) -> Result<Sub, Error> {
    Ok(svc.subscriber_builder().buffer_size(buffer).create()?)
}

/// The word at index `k` of every body: the same pattern `hf bench` writes.
#[inline(always)]
fn word(k: usize) -> u64 {
    0x9E37_79B9_7F4A_7C15u64 ^ k as u64
}

/// Writes the pattern into the loaned (uninitialised) shared memory in place, word by word
/// through the cache, as a producer computing its data would.
fn fill(p: &mut [MaybeUninit<u8>]) {
    let len = p.len();
    let base = p.as_mut_ptr() as *mut u8;
    let words = len / 8;
    for k in 0..words {
        // SAFETY: k * 8 + 8 <= len.
        unsafe { (base.add(k * 8) as *mut u64).write_unaligned(word(k).to_le()) };
    }
    for i in words * 8..len {
        // SAFETY: i < len.
        unsafe { base.add(i).write(i as u8) };
    }
}

/// Whether `b` holds the pattern; reads every byte, without an early exit.
fn check(b: &[u8]) -> bool {
    let mut diff = 0u64;
    let mut words = b.chunks_exact(8);
    for (k, w) in (&mut words).enumerate() {
        diff |= u64::from_le_bytes(w.try_into().expect("chunks of 8")) ^ word(k);
    }
    let base = (b.len() / 8) * 8;
    for (i, &x) in words.remainder().iter().enumerate() {
        diff |= u64::from(x ^ (base + i) as u8);
    }
    diff == 0
}

/// Reads every word of `b` (a sum nobody looks at), as `hf bench`'s receiver does when it
/// does not verify.
fn touch(b: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        s = s.wrapping_add(u64::from_le_bytes(w.try_into().expect("chunks of 8")));
    }
    s + words.remainder().iter().map(|&x| u64::from(x)).sum::<u64>()
}

enum Body<'a> {
    /// Fill with the pattern, in place.
    Pattern,
    /// Copy these bytes (the echo of a ping).
    Echo(&'a [u8]),
}

/// Loans a `size`-byte sample, writes the header and the body in place and sends it.
/// Returns how many subscribers got it (0 means the peer is gone).
#[inline]
fn send(p: &Pub, size: usize, header: u64, body: Body) -> Result<usize, Error> {
    let mut s = loop {
        match p.loan_slice_uninit(size) {
            Ok(s) => break s,
            // Cannot happen with iceoryx2's own sizing of the data segment; kept as a retry,
            // not a failure, should a subscriber be slow to return its samples.
            Err(LoanError::OutOfMemory) => {
                interrupted()?;
                std::hint::spin_loop();
            }
            Err(e) => return Err(format!("loan: {e}").into()),
        }
    };
    *s.user_header_mut() = header;
    let s = match body {
        Body::Pattern => {
            fill(s.payload_mut());
            // SAFETY: fill wrote every byte.
            unsafe { s.assume_init() }
        }
        Body::Echo(b) => s.write_from_slice(b),
    };
    s.send().map_err(|e| match e {
        iceoryx2::port::SendError::UnableToDeliver => {
            "send: the subscriber's queue stayed full (its process exited, hung, or was \
             interrupted)"
                .into()
        }
        e => format!("send: {e}").into(),
    })
}

/// Busy-polls `sub` until a sample arrives. Every 64 Ki empty polls it looks at the clock,
/// at STOP and at `alive` (which checks the other process).
fn spin_receive(
    sub: &Sub,
    timeout: Duration,
    alive: &mut dyn FnMut() -> Result<(), Error>,
) -> Result<Received, Error> {
    let mut polls = 0u32;
    let mut deadline: Option<Instant> = None;
    loop {
        if let Some(s) = sub.receive().map_err(|e| format!("receive: {e}"))? {
            return Ok(s);
        }
        polls = polls.wrapping_add(1);
        if polls & 0xFFFF == 0 {
            interrupted()?;
            alive()?;
            let now = Instant::now();
            if now >= *deadline.get_or_insert(now + timeout) {
                return Err(format!("nothing arrived for {timeout:?}").into());
            }
        }
        std::hint::spin_loop();
    }
}

// ---------------------------------------------------------------------------------------
// the runner

/// The spawned peer: its stdout is read line by line (with timeouts, through poll), and it
/// is ended (SIGTERM, then SIGKILL) if the runner leaves before it has exited by itself.
struct Peer {
    child: Option<Child>,
    out: ChildStdout,
    buf: Vec<u8>,
}

impl Peer {
    fn spawn(opts: &Opts, service: &str) -> Result<Peer, Error> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.arg("__peer")
            .args(["--pattern", opts.pattern.as_str()])
            .args(["--size", &opts.size.to_string()])
            .args(["--buffer", &opts.buffer.to_string()])
            .args(["--service", service])
            .args(["--parent", &std::process::id().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some((_, b)) = opts.pin {
            cmd.args(["--cpu", &b.to_string()]);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the peer: {e}"))?;
        let out = child.stdout.take().expect("piped");
        Ok(Peer {
            child: Some(child),
            out,
            buf: Vec::new(),
        })
    }

    fn pid(&self) -> libc::pid_t {
        self.child.as_ref().map_or(0, |c| c.id() as libc::pid_t)
    }

    fn alive(&mut self) -> Result<(), Error> {
        if let Some(c) = self.child.as_mut() {
            if let Some(st) = c.try_wait()? {
                self.child = None;
                return Err(format!("the peer exited early ({st})").into());
            }
        }
        Ok(())
    }

    /// The next line from the peer, or an error on timeout, EOF or a signal.
    fn line(&mut self, timeout: Duration) -> Result<String, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return Ok(String::from_utf8_lossy(&line[..pos]).into_owned());
            }
            interrupted()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(format!("the peer did not answer within {timeout:?}").into());
            }
            let ms = (deadline - now).as_millis().clamp(1, 100) as libc::c_int;
            let mut pfd = libc::pollfd {
                fd: self.out.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r <= 0 {
                continue; // timeout slice or EINTR
            }
            let mut tmp = [0u8; 4096];
            match self.out.read(&mut tmp) {
                Ok(0) => {
                    let st = self.wait(Duration::from_secs(2)).ok();
                    return Err(match st {
                        Some(st) => format!("the peer exited ({st})"),
                        None => "the peer closed its stdout".to_string(),
                    }
                    .into());
                }
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn expect(&mut self, word: &str, timeout: Duration) -> Result<String, Error> {
        let line = self.line(timeout)?;
        if line.split_whitespace().next() == Some(word) {
            Ok(line)
        } else {
            Err(format!("expected {word} from the peer, got {line:?}").into())
        }
    }

    /// Waits for the peer to exit by itself; kills it after `timeout`.
    fn wait(&mut self, timeout: Duration) -> Result<ExitStatus, Error> {
        let mut child = self.child.take().ok_or("the peer was already reaped")?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = child.try_wait()? {
                return Ok(st);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let st = child.wait()?;
                return Err(format!("the peer did not exit in time; killed ({st})").into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // Ask first (the peer drops its ports on SIGTERM), then kill.
        // SAFETY: signalling our own child, which has not been reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// What one run measured.
#[derive(Default)]
struct Outcome {
    messages: u64,
    sent: u64,
    warm: u64,
    lost: u64,
    bad: u64,
    window_s: f64,
    msgs_per_s: Option<f64>,
    gbytes_per_s: Option<f64>,
    round_trips_per_s: Option<f64>,
    lat_p50_us: Option<f64>,
    lat_p99_us: Option<f64>,
    blocked_sends: Option<u64>,
    slept_sends: Option<u64>,
}

fn run(opts: &Opts) -> Result<Outcome, Error> {
    let node = node("runner")?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    // Unique per run: nothing from an earlier (or a concurrent) run can be opened by mistake.
    let base = format!("hf-bench/iox2/{}-{nanos}", std::process::id());
    match opts.pattern {
        Pattern::Lat => {
            let ping_svc = service(&node, &format!("{base}/ping"), opts.buffer)?;
            let pong_svc = service(&node, &format!("{base}/pong"), opts.buffer)?;
            let pong = subscriber(&pong_svc, opts.buffer)?;
            let mut peer = Peer::spawn(opts, &base)?;
            let ping = publisher(&ping_svc, opts.size, Other::Child(peer.pid()))?;
            peer.expect("READY", PATIENCE)?;
            connected(&ping_svc, &pong_svc, &mut peer)?;
            ping.update_connections()?;
            let out = latency(opts, &ping, &pong, &mut peer)?;
            let line = peer.expect("RESULT", PATIENCE)?;
            finish(&mut peer)?;
            let echoed = field(&line, "echoed")?;
            if echoed != out.sent + out.warm {
                return Err(
                    format!("the peer echoed {echoed} of {} pings", out.sent + out.warm).into(),
                );
            }
            Ok(out)
        }
        Pattern::Rate | Pattern::Bw => {
            let svc = service(&node, &format!("{base}/data"), opts.buffer)?;
            let mut peer = Peer::spawn(opts, &base)?;
            let publ = publisher(&svc, opts.size, Other::Child(peer.pid()))?;
            peer.expect("READY", PATIENCE)?;
            connected(&svc, &svc, &mut peer)?;
            publ.update_connections()?;
            stream(opts, &publ, &mut peer)
        }
    }
}

/// Waits until the peer's subscriber (on `to_peer`) and publisher (on `from_peer`) are
/// registered with the services.
fn connected(to_peer: &Factory, from_peer: &Factory, peer: &mut Peer) -> Result<(), Error> {
    let deadline = Instant::now() + PATIENCE;
    while to_peer.dynamic_config().number_of_subscribers() < 1
        || from_peer.dynamic_config().number_of_publishers() < 1
    {
        interrupted()?;
        peer.alive()?;
        if Instant::now() >= deadline {
            return Err("the peer's ports did not connect".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn finish(peer: &mut Peer) -> Result<(), Error> {
    let st = peer.wait(PATIENCE)?;
    if !st.success() {
        return Err(format!("the peer failed ({st})").into());
    }
    Ok(())
}

fn field(line: &str, key: &str) -> Result<u64, Error> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .ok_or_else(|| format!("no {key} in the peer's {line:?}"))?
        .parse()
        .map_err(|_| format!("bad {key} in the peer's {line:?}").into())
}

fn float_field(line: &str, key: &str) -> Result<f64, Error> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .ok_or_else(|| format!("no {key} in the peer's {line:?}"))?
        .parse()
        .map_err(|_| format!("bad {key} in the peer's {line:?}").into())
}

fn latency(opts: &Opts, ping: &Pub, pong: &Sub, peer: &mut Peer) -> Result<Outcome, Error> {
    let mut alive = || peer.alive();
    let mut round = |header: u64, timeout: Duration| -> Result<(), Error> {
        if send(ping, opts.size, header, Body::Pattern)? == 0 {
            return Err("the peer's subscriber is gone".into());
        }
        let back = spin_receive(pong, timeout, &mut alive)?;
        if *back.user_header() != header || back.payload().len() != opts.size {
            return Err(format!(
                "ping {header:#x} answered by {:#x} ({} B)",
                back.user_header(),
                back.payload().len()
            )
            .into());
        }
        Ok(())
    };

    // Warm-up, not recorded; the first round trip also proves both directions connected.
    let mut warm = 0u64;
    let t = Instant::now();
    while warm == 0 || t.elapsed() < WARMUP {
        round(WARM | warm, PATIENCE)?;
        warm += 1;
    }
    let expected =
        (warm as f64 / WARMUP.as_secs_f64() * opts.duration.as_secs_f64() * 1.5) as usize;
    let mut rtt_ns: Vec<u32> = Vec::with_capacity(expected.min(1 << 28));

    // Measured: each round trip timed from before the loan to after the echo arrived.
    let t0 = Instant::now();
    let end = t0 + opts.duration;
    let mut seq = 0u64;
    loop {
        let a = Instant::now();
        if a >= end {
            break;
        }
        round(seq, PATIENCE)?;
        let b = Instant::now();
        rtt_ns.push((b - a).as_nanos().min(u32::MAX as u128) as u32);
        seq += 1;
    }
    let window = t0.elapsed().as_secs_f64();
    // END: the peer stops without echoing.
    send(ping, opts.size, END | seq, Body::Pattern)?;

    rtt_ns.sort_unstable();
    let pct = |q: f64| -> Option<f64> {
        if rtt_ns.is_empty() {
            return None;
        }
        let i = ((q * rtt_ns.len() as f64).ceil() as usize).clamp(1, rtt_ns.len()) - 1;
        Some(rtt_ns[i] as f64 / 2.0 / 1000.0)
    };
    Ok(Outcome {
        messages: seq,
        sent: seq,
        warm,
        lost: 0,
        bad: 0,
        window_s: window,
        round_trips_per_s: Some(seq as f64 / window),
        lat_p50_us: pct(0.50),
        lat_p99_us: pct(0.99),
        ..Outcome::default()
    })
}

fn stream(opts: &Opts, publ: &Pub, peer: &mut Peer) -> Result<Outcome, Error> {
    // Handshake: the first warm-up sample, sent until a subscriber takes it; the peer says
    // GO when it has received it, so both ends of the connection exist.
    let deadline = Instant::now() + PATIENCE;
    while send(publ, opts.size, WARM, Body::Pattern)? == 0 {
        interrupted()?;
        peer.alive()?;
        if Instant::now() >= deadline {
            return Err("no subscriber took the first sample".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    peer.expect("GO", PATIENCE)?;

    let gone = || -> Error { "the peer's subscriber is gone".into() };
    // The clock costs ~20 ns: read it every 16th small sample, every large one.
    let mask: u64 = if opts.size >= 4096 { 0 } else { 15 };

    let t = Instant::now();
    let mut warm = 1u64;
    loop {
        if warm & mask == 0 && t.elapsed() >= WARMUP {
            break;
        }
        if send(publ, opts.size, WARM | warm, Body::Pattern)? == 0 {
            return Err(gone());
        }
        warm += 1;
    }

    BLOCKED.store(0, Ordering::Relaxed);
    SLEPT.store(0, Ordering::Relaxed);
    let t0 = Instant::now();
    let end = t0 + opts.duration;
    let mut seq = 0u64;
    loop {
        if seq & mask == 0 {
            if Instant::now() >= end {
                break;
            }
            interrupted()?;
        }
        if send(publ, opts.size, seq, Body::Pattern)? == 0 {
            return Err(gone());
        }
        seq += 1;
    }
    let blocked = BLOCKED.load(Ordering::Relaxed);
    let slept = SLEPT.load(Ordering::Relaxed);
    if send(publ, opts.size, END | seq, Body::Pattern)? == 0 {
        return Err(gone());
    }

    let line = peer.expect("RESULT", PATIENCE)?;
    finish(peer)?;
    let messages = field(&line, "messages")?;
    let sent = field(&line, "sent")?;
    let bad = field(&line, "bad")?;
    let seconds = float_field(&line, "seconds")?;
    if sent != seq {
        return Err(format!("the peer read sent={sent} from END, the runner sent {seq}").into());
    }
    if messages < 2 || seconds <= 0.0 {
        return Err("too few samples arrived to measure a rate; use a longer --duration".into());
    }
    if bad > 0 {
        return Err(format!("{bad} of {messages} samples arrived with wrong content").into());
    }
    if messages < sent {
        eprintln!(
            "iox2-bench: warning: {} of {sent} samples were lost",
            sent - messages
        );
    }
    // From the first arrival to the last: the first sample starts the clock.
    let rate = (messages - 1) as f64 / seconds;
    Ok(Outcome {
        messages,
        sent,
        lost: sent.saturating_sub(messages),
        bad,
        window_s: seconds,
        msgs_per_s: Some(rate),
        gbytes_per_s: Some(rate * opts.size as f64 / 1e9),
        blocked_sends: Some(blocked),
        slept_sends: Some(slept),
        ..Outcome::default()
    })
}

fn json_num(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:?}"),
        _ => "null".to_string(),
    }
}

fn json_int(v: Option<u64>) -> String {
    v.map_or_else(|| "null".to_string(), |x| x.to_string())
}

fn round(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

fn runner(args: &[String]) -> Result<String, Error> {
    let opts = parse_opts(args)?;
    if let Some((a, _)) = opts.pin {
        pin(a)?;
    }
    let o = run(&opts)?;
    Ok(format!(
        "{{\"tool\":\"iceoryx2\",\"version\":\"{IOX2_VERSION}\",\"pattern\":\"{}\",\"size\":{},\
\"duration_s\":{},\"messages\":{},\"lost\":{},\"msgs_per_s\":{},\"gbytes_per_s\":{},\
\"lat_p50_us\":{},\"lat_p99_us\":{},\"round_trips_per_s\":{},\"sent\":{},\"bad\":{},\
\"window_s\":{},\"buffer\":{},\"blocked_sends\":{},\"slept_sends\":{},\"pin\":{}}}",
        opts.pattern.as_str(),
        opts.size,
        json_num(Some(opts.duration.as_secs_f64())),
        o.messages,
        o.lost,
        json_num(o.msgs_per_s.map(|x| round(x, 1))),
        json_num(o.gbytes_per_s.map(|x| round(x, 4))),
        json_num(o.lat_p50_us.map(|x| round(x, 4))),
        json_num(o.lat_p99_us.map(|x| round(x, 4))),
        json_num(o.round_trips_per_s.map(|x| round(x, 1))),
        o.sent,
        o.bad,
        json_num(Some(round(o.window_s, 6))),
        opts.buffer,
        json_int(o.blocked_sends),
        json_int(o.slept_sends),
        match opts.pin {
            Some((a, b)) => format!("[{a},{b}]"),
            None => "null".to_string(),
        },
    ))
}

// ---------------------------------------------------------------------------------------
// the peer

struct PeerOpts {
    pattern: Pattern,
    size: usize,
    buffer: usize,
    service: String,
    parent: libc::pid_t,
    cpu: Option<usize>,
}

fn parse_peer_opts(args: &[String]) -> Result<PeerOpts, Error> {
    let get = |key: &str| -> Option<String> {
        args.iter()
            .position(|a| a == key)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let need = |v: Option<String>, key: &str| v.ok_or_else(|| format!("peer: {key} missing"));
    Ok(PeerOpts {
        pattern: Pattern::parse(&need(get("--pattern"), "--pattern")?)?,
        size: parse_num("--size", &need(get("--size"), "--size")?)?,
        buffer: parse_num("--buffer", &need(get("--buffer"), "--buffer")?)?,
        service: need(get("--service"), "--service")?,
        parent: parse_num("--parent", &need(get("--parent"), "--parent")?)?,
        cpu: get("--cpu").map(|c| parse_num("--cpu", &c)).transpose()?,
    })
}

fn say(line: &str) -> Result<(), Error> {
    let mut out = io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

fn peer(args: &[String]) -> Result<(), Error> {
    let o = parse_peer_opts(args)?;
    // SIGTERM when the runner dies (the handler sets STOP); and if it died before this
    // line, getppid() already differs.
    // SAFETY: plain prctl/getppid calls.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
    let parent = o.parent;
    let mut alive = move || -> Result<(), Error> {
        // SAFETY: getppid cannot fail.
        if unsafe { libc::getppid() } != parent {
            return Err("the runner is gone".into());
        }
        Ok(())
    };
    alive()?;
    if let Some(cpu) = o.cpu {
        pin(cpu)?;
    }
    let node = node("peer")?;
    // While the runner lives the peer waits: the runner has its own timeouts.
    let idle = Duration::from_secs(3600);
    match o.pattern {
        Pattern::Lat => {
            let ping_svc = service(&node, &format!("{}/ping", o.service), o.buffer)?;
            let pong_svc = service(&node, &format!("{}/pong", o.service), o.buffer)?;
            let ping = subscriber(&ping_svc, o.buffer)?;
            let pong = publisher(&pong_svc, o.size, Other::Parent(parent))?;
            say("READY")?;
            let mut echoed = 0u64;
            loop {
                let s = spin_receive(&ping, idle, &mut alive)?;
                let h = *s.user_header();
                if h & END != 0 {
                    break;
                }
                send(&pong, s.payload().len(), h, Body::Echo(s.payload()))?;
                drop(s);
                echoed += 1;
            }
            say(&format!("RESULT echoed={echoed}"))?;
        }
        Pattern::Rate | Pattern::Bw => {
            let svc = service(&node, &format!("{}/data", o.service), o.buffer)?;
            let sub = subscriber(&svc, o.buffer)?;
            say("READY")?;
            let verify = o.pattern == Pattern::Bw;
            let big = o.size >= 4096;
            let mut said_go = false;
            let mut first: Option<Instant> = None;
            let mut last = Instant::now();
            let mut messages = 0u64;
            let mut clocked = 0u64;
            let mut next_seq = 0u64;
            let mut gaps = 0u64;
            let mut bad = 0u64;
            let mut warm = 0u64;
            let mut sum = 0u64;
            let sent;
            loop {
                let s = spin_receive(&sub, idle, &mut alive)?;
                let h = *s.user_header();
                if h & END != 0 {
                    if clocked < messages {
                        last = Instant::now();
                    }
                    sent = h & SEQ;
                    break;
                }
                let ok = if verify {
                    check(s.payload())
                } else {
                    sum = sum.wrapping_add(touch(s.payload()));
                    true
                };
                drop(s);
                if h & WARM != 0 {
                    warm += 1;
                    if !said_go {
                        say("GO")?;
                        said_go = true;
                    }
                    continue;
                }
                messages += 1;
                bad += u64::from(!ok);
                if h != next_seq {
                    gaps += 1;
                }
                next_seq = h.wrapping_add(1);
                if first.is_none() || big || messages & 15 == 0 {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last = now;
                    clocked = messages;
                }
            }
            std::hint::black_box(sum);
            let seconds = first.map_or(0.0, |f| last.duration_since(f).as_secs_f64());
            say(&format!(
                "RESULT messages={messages} sent={sent} gaps={gaps} bad={bad} warm={warm} \
seconds={seconds}"
            ))?;
        }
    }
    Ok(())
}

fn main() {
    install_signal_handlers();
    // iceoryx2 logs to stderr; only warnings and errors unless IOX2_LOG_LEVEL says otherwise.
    set_log_level_from_env_or(LogLevel::Warn);
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("__peer") {
        if let Err(e) = peer(&args[1..]) {
            eprintln!("iox2-bench (peer): {e}");
            std::process::exit(1);
        }
        return;
    }
    match runner(&args) {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("iox2-bench: {e}");
            std::process::exit(1);
        }
    }
}
