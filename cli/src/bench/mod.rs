//! `hf bench`: latency, message rate and bandwidth of every transport, with the peer in a
//! second process, measured at the receiver.
//!
//! On loopback (the default) the runner spawns `hf bench --serve URL --once` for each
//! transport (inproc, which cannot cross processes, gets a second thread instead), connects,
//! runs each point (see [`proto`] for the conversation), and prints a row per point. Across
//! machines, `hf bench --serve URL` on one and `hf bench --connect URL` on the other do the
//! same without the spawning.

/// A line on stdout. A closed stdout (`hf bench | head`) does not stop the run: the JSON and
/// plot files are still written.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod device;
mod plot;
mod proto;
mod report;
mod stats;

use std::io::{BufRead, BufReader, Write as _};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Args;
use hyperframes::{Context, Endpoint, ErrorKind};
use indicatif::{ProgressBar, ProgressStyle};

use crate::Failure;
use crate::units::parse_size;
use proto::{Pattern, Settings, Warmup};
use report::Row;

/// Printed after `hf bench --help`.
pub(crate) const AFTER_HELP: &str = "\
With no options: every transport available (inproc, tcp, tls, shm; rdma where a device exists)
on loopback, with the peer in a second process, through the standard points: latency (ping-
pong, 64 B), message rate (64 B and 32 KiB streaming) and bandwidth (4 MiB).

What the columns mean:
  msgs/s, GB/s   what arrived at the receiver (and was checked) per second, from the first
                 measured message to the last; for lat, round trips per second
  p50 .. max     latency, half the round trip (as ucx_perftest reports it); with --rate,
                 counted from each ping's intended send time, so stalls are not hidden
  CPU            user + system time of both processes, per message (per GB for bw)
  spread         how far the per-second rates stray from their mean (±half the range)
  checked        content: every body's bytes were verified; order: sequence numbers only

Examples:
  hf bench
  hf bench --transport shm --pattern bw --size 64..4MiB --zero-copy --plot shm.svg
  hf bench --transport tcp --pattern lat --rate 20000 --duration 5
  hf bench --json results.jsonl
  hf bench --serve tcp://0.0.0.0:7000         (on host A)
  hf bench --connect tcp://hostA:7000         (on host B)
  hf bench --serve tls://0.0.0.0:7000 --cert a.crt --key a.key --ca ca.crt
  hf bench --connect tls://hostA:7000 --cert b.crt --key b.key --ca ca.crt

On loopback, tls uses throwaway certificates made for the run (both ends present one:
mutual TLS), unless --cert, --key and --ca are given.";

/// `--buffers` by default: enough distinct bodies that large ones come from memory.
const BUFFERS: usize = 8;

/// Arguments of `hf bench`.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Transports to measure, comma-separated: inproc, tcp, tls, shm, rdma [default: all
    /// available]
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    transport: Vec<String>,

    /// What to measure: lat, rate, bw or all (comma-separated) [default: the standard points]
    #[arg(long, value_name = "PATTERN", value_delimiter = ',')]
    pattern: Vec<PatternArg>,

    /// Message sizes, comma-separated: 64, 32KiB, 4MiB; A..B sweeps powers of two
    /// [default: 64 for lat, 64 and 32KiB for rate, 4MiB for bw]
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    size: Vec<String>,

    /// Seconds measured per point, after the warm-up.
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    duration: f64,

    /// Warm-up before each point: a number of messages (500) or a time (0.5s).
    #[arg(long, value_name = "N|SECS", default_value = "0.5s")]
    warmup: String,

    /// Spin instead of parking while waiting (both processes): lowest latency, a busy core.
    #[arg(long)]
    busy_poll: bool,

    /// Fill bodies in place in the transport's memory (Sender::alloc) instead of sending
    /// heap buffers (shm: no copy at all).
    #[arg(long)]
    zero_copy: bool,

    /// The receiver checks every body's content (always on for bw).
    #[arg(long)]
    verify: bool,

    /// Distinct heap buffers the sender sends in turn, a power of two up to 64 (the memcpy
    /// baseline copies from as many): 8 keeps large bodies out of the caches, as an
    /// application's fresh data would be; 1 sends one buffer again and again, hot in the
    /// cache, as iperf3 does.
    #[arg(long, value_name = "N", default_value_t = BUFFERS)]
    buffers: usize,

    /// Send bodies in device memory: cuda (device 0), cuda:N, or stand-in (host memory
    /// handled as a device); the peer lands them on the same kind of device. Their content
    /// is checked on the first of each point only (a copy back per body would be the
    /// measurement). Needs hf built with `--features cuda`.
    #[arg(long, value_name = "DEVICE", conflicts_with = "zero_copy")]
    device: Option<String>,

    /// With --device: shm:// stages device bodies instead of lending them over CUDA IPC (to
    /// compare the two paths).
    #[arg(long, requires = "device")]
    no_cuda_ipc: bool,

    /// With --device: rdma:// stages device bodies instead of having the NIC read them from
    /// device memory (GPUDirect RDMA), to compare the two paths.
    #[arg(long, requires = "device")]
    no_gpudirect: bool,

    /// A fixed offered load in messages per second, instead of as fast as possible.
    #[arg(long, value_name = "MSGS_PER_S")]
    rate: Option<f64>,

    /// Pin this process to the first CPU and the peer to the second: --pin 0,1.
    #[arg(long, value_name = "CPU,CPU", value_delimiter = ',')]
    pin: Vec<usize>,

    /// Also write one JSON object per point, one per line, to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Also plot bandwidth and rate against size, and latency percentiles, as an SVG.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// Be the peer: listen at URL and answer runners (`hf bench --connect`), one at a time.
    #[arg(long, value_name = "URL", conflicts_with_all = ["connect", "transport", "json", "plot"])]
    serve: Option<String>,

    /// Run the points against a peer started with `hf bench --serve` (on another host).
    #[arg(long, value_name = "URL", conflicts_with = "transport")]
    connect: Option<String>,

    /// With --serve: answer one runner, then exit (how the runner spawns its peer).
    #[arg(long, requires = "serve", hide = true)]
    once: bool,

    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PatternArg {
    Lat,
    Rate,
    Bw,
    All,
}

/// The transports `hf bench` tries when `--transport` is not given, in order.
const TRANSPORTS: [&str; 5] = ["inproc", "tcp", "tls", "shm", "rdma"];

/// Where the runner's peer listens for `transport`, on this host.
fn local_url(transport: &str) -> Option<String> {
    Some(match transport {
        "inproc" => "inproc://hf-bench".into(),
        "tcp" => "tcp://127.0.0.1:0".into(),
        "tls" => "tls://127.0.0.1:0".into(),
        "shm" => format!("shm://hf-bench-{}", std::process::id()),
        "rdma" => "rdma://127.0.0.1:0".into(),
        _ => return None,
    })
}

/// `64`, `4MiB`, or `A..B` (every power of two from A up to B).
fn parse_sizes(items: &[String]) -> Result<Vec<usize>, Failure> {
    let bad = |e: String| Failure::usage(format!("bad --size {e:#}"));
    let mut sizes = Vec::new();
    for item in items {
        if let Some((a, b)) = item.split_once("..") {
            let (a, b) = (parse_size(a).map_err(bad)?, parse_size(b).map_err(bad)?);
            if a > b {
                return Err(bad(format!("{item:?}: the range runs backwards")));
            }
            let mut s = a.max(1).next_power_of_two();
            if a == 0 {
                sizes.push(0);
            }
            while s <= b {
                sizes.push(s);
                s *= 2;
            }
        } else {
            sizes.push(parse_size(item).map_err(bad)?);
        }
    }
    let sizes: Vec<usize> = sizes
        .into_iter()
        .map(|s| usize::try_from(s).map_err(|_| bad(format!("{s} does not fit in memory"))))
        .collect::<Result<_, _>>()?;
    if sizes.len() > 64 {
        return Err(bad(format!("{} sizes; at most 64 per run", sizes.len())));
    }
    Ok(sizes)
}

/// `500` (messages) or `0.5s` / `2s` (time).
fn parse_warmup(text: &str) -> Result<Warmup, Failure> {
    let t = text.trim();
    let bad = || {
        Failure::usage(format!(
            "bad --warmup {text:?}: expected a number of messages (500) or seconds (0.5s)"
        ))
    };
    if let Some(secs) = t.strip_suffix('s') {
        let s: f64 = secs.trim().parse().map_err(|_| bad())?;
        if !(s.is_finite() && (0.0..=3600.0).contains(&s)) {
            return Err(bad());
        }
        return Ok(Warmup::Time(Duration::from_secs_f64(s)));
    }
    t.parse().map(Warmup::Messages).map_err(|_| bad())
}

/// The points to run, in order.
fn points(args: &BenchArgs) -> Result<Vec<(Pattern, usize)>, Failure> {
    let sizes = parse_sizes(&args.size)?;
    let mut patterns: Vec<Pattern> = Vec::new();
    for p in &args.pattern {
        match p {
            PatternArg::Lat => patterns.push(Pattern::Lat),
            PatternArg::Rate => patterns.push(Pattern::Rate),
            PatternArg::Bw => patterns.push(Pattern::Bw),
            PatternArg::All => patterns.extend([Pattern::Lat, Pattern::Rate, Pattern::Bw]),
        }
    }
    if patterns.is_empty() {
        patterns = vec![Pattern::Lat, Pattern::Rate, Pattern::Bw];
    }
    patterns.sort();
    patterns.dedup();
    let mut out = Vec::new();
    for p in patterns {
        let defaults: &[usize] = match p {
            Pattern::Lat => &[64],
            Pattern::Rate => &[64, 32 << 10],
            Pattern::Bw => &[4 << 20],
        };
        let list = if sizes.is_empty() { defaults } else { &sizes };
        out.extend(list.iter().map(|&s| (p, s)));
    }
    Ok(out)
}

fn settings(args: &BenchArgs) -> Result<Settings, Failure> {
    if !(args.duration.is_finite() && (0.01..=3600.0).contains(&args.duration)) {
        return Err(Failure::usage(format!(
            "bad --duration {}: expected seconds between 0.01 and 3600",
            args.duration
        )));
    }
    if let Some(r) = args.rate
        && !(r.is_finite() && r > 0.0 && r <= 1e9)
    {
        return Err(Failure::usage(format!(
            "bad --rate {r}: expected messages per second above 0"
        )));
    }
    if !(args.buffers.is_power_of_two() && args.buffers <= 64) {
        return Err(Failure::usage(format!(
            "bad --buffers {}: expected a power of two from 1 to 64",
            args.buffers
        )));
    }
    Ok(Settings {
        duration: Duration::from_secs_f64(args.duration),
        buffers: args.buffers,
        warmup: parse_warmup(&args.warmup)?,
        verify: args.verify,
        zero_copy: args.zero_copy,
        rate: args.rate,
        device: args.device.as_deref().map(device::open).transpose()?,
    })
}

/// Pins the calling thread, and so every thread it starts afterwards, to `cpu`.
fn pin(cpu: usize) -> Result<(), Failure> {
    let mut set = rustix::thread::CpuSet::new();
    if cpu >= rustix::thread::CpuSet::MAX_CPU {
        return Err(Failure::usage(format!("bad --pin {cpu}: no such CPU")));
    }
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)
        .map_err(|e| Failure::runtime(format!("cannot pin to CPU {cpu}: {e:#}")))
}

fn context(
    args: &BenchArgs,
    tls: &crate::tls::TlsArgs,
    gpu: Option<&device::Gpu>,
) -> Result<Context, Failure> {
    let b = device::land(
        Context::builder().busy_poll(args.busy_poll),
        gpu,
        !args.no_cuda_ipc,
        !args.no_gpudirect,
    );
    crate::build_context(tls.apply(b)?)
}

/// Runs `hf bench`. Builds its own single-threaded runtime after pinning, so that every
/// thread (the runtime's, and the transports' I/O threads) inherits the pinning.
pub(crate) fn main(args: BenchArgs) -> Result<(), Failure> {
    if args.pin.len() > 2 {
        return Err(Failure::usage(
            "bad --pin: at most two CPUs (this process, the peer)",
        ));
    }
    if let Some(&cpu) = args.pin.first() {
        pin(cpu)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start a runtime: {e:#}")))?;
    rt.block_on(async {
        match &args.serve {
            Some(url) => serve(&args, url).await,
            None => run(&args).await,
        }
    })
}

// ------------------------------------------------------------------------ the peer

async fn serve(args: &BenchArgs, url: &str) -> Result<(), Failure> {
    Endpoint::parse(url).map_err(Failure::usage)?;
    args.tls.check(url, true)?;
    let gpu = args.device.as_deref().map(device::open).transpose()?;
    let ctx = context(args, &args.tls, gpu.as_ref())?;
    let mut listener = ctx
        .bind(url)
        .await
        .map_err(|e| Failure::runtime(format!("cannot listen at {url}: {e:#}")))?;
    // The runner waits for this line (stdout is line-buffered).
    say!("hf bench: serving {}", listener.local_url());
    loop {
        let accepted = if args.once {
            // A runner that died before connecting must not leave its peer behind.
            tokio::time::timeout(Duration::from_secs(30), listener.accept())
                .await
                .map_err(|_| Failure::runtime("no runner connected within 30 s"))?
        } else {
            listener.accept().await
        };
        let ch = accepted.map_err(|e| Failure::runtime(format!("accepting at {url}: {e:#}")))?;
        let peer = ch.info().peer_url().to_owned();
        let served = proto::serve_channel(ch).await;
        match (served, args.once) {
            (Ok(()), true) => return Ok(()),
            (Err(e), true) => return Err(Failure::runtime(format!("runner {peer}: {e:#}"))),
            (Ok(()), false) => eprintln!("hf bench: runner {peer} done"),
            (Err(e), false) => eprintln!("hf bench: runner {peer}: {e:#}"),
        }
    }
}

/// The peer process spawned for one transport: `hf bench --serve URL --once`, killed if it
/// outlives its use.
struct PeerProcess(Child);

impl PeerProcess {
    /// Starts the peer and returns it with the URL it listens at.
    fn spawn(
        url: &str,
        args: &BenchArgs,
        tls: &crate::tls::TlsArgs,
    ) -> Result<(PeerProcess, String), Failure> {
        let exe = std::env::current_exe()
            .map_err(|e| Failure::runtime(format!("cannot find the hf executable: {e:#}")))?;
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "--serve", url, "--once"]);
        if args.busy_poll {
            cmd.arg("--busy-poll");
        }
        if let Some(d) = &args.device {
            cmd.arg(format!("--device={d}"));
        }
        if args.no_gpudirect {
            cmd.arg("--no-gpudirect");
        }
        if args.no_cuda_ipc {
            cmd.arg("--no-cuda-ipc");
        }
        if let Some(cpu) = args.pin.get(1) {
            cmd.arg(format!("--pin={cpu}"));
        }
        if crate::tls::is_tls(url) {
            cmd.args(tls.to_args());
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Failure::runtime(format!("cannot start the peer process: {e:#}")))?;
        let stdout = child.stdout.take().expect("piped");
        let peer = PeerProcess(child);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut first = String::new();
            let _ = BufReader::new(stdout).read_line(&mut first);
            let _ = tx.send(first);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .map_err(|_| Failure::runtime("the peer process did not start listening in 20 s"))?;
        match line.trim_end().strip_prefix("hf bench: serving ") {
            Some(at) => Ok((peer, at.to_owned())),
            None => Err(Failure::runtime(format!(
                "the peer process could not listen at {url} (its error is above)"
            ))),
        }
    }

    /// Waits (briefly) for the peer to exit after the runner closed the connection.
    fn finish(mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.0.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(format!("the peer process failed ({status})")),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => return Err("the peer process did not exit; killed it".into()),
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The peer of one transport: a process, or a thread for inproc.
enum Peer {
    Process(PeerProcess),
    Thread(std::thread::JoinHandle<Result<(), String>>),
}

impl Peer {
    fn finish(self) -> Result<(), String> {
        match self {
            Peer::Process(p) => p.finish(),
            Peer::Thread(t) => t
                .join()
                .map_err(|_| "the peer thread panicked".to_owned())?,
        }
    }
}

/// Starts the peer for `transport` on this host.
async fn start_peer(
    ctx: &Context,
    transport: &str,
    args: &BenchArgs,
    tls: &crate::tls::TlsArgs,
) -> Result<(Peer, String), Failure> {
    let url = local_url(transport).ok_or_else(|| {
        Failure::usage(format!(
            "bad --transport {transport:?}: expected inproc, tcp, tls, shm or rdma"
        ))
    })?;
    if transport == "inproc" {
        // One process by definition: the peer is a second thread with its own runtime.
        let mut listener = ctx
            .bind(&url)
            .await
            .map_err(|e| Failure::runtime(format!("cannot listen at {url}: {e:#}")))?;
        let at = listener.local_url().to_owned();
        let pin_to = args.pin.get(1).copied();
        let thread = std::thread::spawn(move || {
            if let Some(cpu) = pin_to {
                pin(cpu).map_err(|f| f.message)?;
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async move {
                let ch = listener.accept().await.map_err(|e| e.to_string())?;
                proto::serve_channel(ch).await
            })
        });
        return Ok((Peer::Thread(thread), at));
    }
    let (p, at) = PeerProcess::spawn(&url, args, tls)?;
    Ok((Peer::Process(p), at))
}

/// Whether this build and host can run `transport` at all; `Err` says why not.
async fn available(ctx: &Context, transport: &str) -> Result<(), String> {
    let Some(url) = local_url(transport) else {
        return Err("unknown transport (expected inproc, tcp, tls, shm or rdma)".into());
    };
    let url = match transport {
        "inproc" => return Ok(()),
        // Not the name the peer will bind, which this probe might still hold.
        "shm" => format!("shm://hf-bench-probe-{}", std::process::id()),
        _ => url,
    };
    match ctx.bind(&url).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == ErrorKind::UnsupportedScheme => Err(format!(
            "not in this build: build hf with `--features {transport}`"
        )),
        Err(e) => Err(e.to_string()),
    }
}

// ---------------------------------------------------------------------- the runner

/// memcpy in this process, in GB/s, from the same working set the sender uses (`buffers`
/// `size` buffers in turn: by default eight, so large ones come from memory, not the cache)
/// into one buffer: the ceiling for a transport that copies once.
fn memcpy_gbytes_per_s(size: usize, buffers: usize) -> f64 {
    let sources: Vec<Vec<u8>> = (0..buffers)
        .map(|_| {
            let mut v = vec![0u8; size];
            stats::fill(&mut v);
            v
        })
        .collect();
    let mut dst = vec![0u8; size];
    let started = Instant::now();
    let mut n = 0usize;
    while started.elapsed() < Duration::from_millis(300) || n < buffers {
        dst.copy_from_slice(std::hint::black_box(&sources[n % buffers]));
        std::hint::black_box(&dst);
        n += 1;
    }
    (n * size) as f64 / started.elapsed().as_secs_f64() / 1e9
}

async fn run(args: &BenchArgs) -> Result<(), Failure> {
    let settings = settings(args)?;
    let points = points(args)?;
    if let Some(url) = &args.connect {
        args.tls.check(url, false)?;
    }
    // On loopback, tls:// runs on certificates made for the run unless some were given.
    #[cfg(feature = "tls")]
    let throwaway = match args.connect.is_none() && !args.tls.given() {
        true => Some(crate::tls::Throwaway::new()?),
        false => None,
    };
    #[cfg(feature = "tls")]
    let tls = throwaway.as_ref().map_or(&args.tls, |t| &t.args).clone();
    #[cfg(not(feature = "tls"))]
    let tls = args.tls.clone();
    let ctx = context(args, &tls, settings.device.as_ref())?;

    // What to run against: a remote peer, or a local one per transport.
    let mut targets: Vec<(String, Option<String>)> = Vec::new();
    let mut notes = Vec::new();
    if let Some(url) = &args.connect {
        let ep = Endpoint::parse(url).map_err(Failure::usage)?;
        targets.push((ep.scheme().to_owned(), Some(url.clone())));
    } else {
        let asked = !args.transport.is_empty();
        let list: Vec<String> = if asked {
            let list: Vec<String> = args
                .transport
                .iter()
                .map(|t| t.trim().to_ascii_lowercase())
                .collect();
            if let Some(t) = list.iter().find(|t| local_url(t).is_none()) {
                return Err(Failure::usage(format!(
                    "bad --transport {t:?}: expected inproc, tcp, tls, shm or rdma"
                )));
            }
            list
        } else {
            TRANSPORTS.iter().map(|t| (*t).to_owned()).collect()
        };
        for t in list {
            match available(&ctx, &t).await {
                Ok(()) => targets.push((t, None)),
                Err(why) if asked => {
                    return Err(Failure::runtime(format!("--transport {t}: {why}")));
                }
                Err(why) => notes.push(format!("{t}: skipped ({why})")),
            }
        }
    }

    say!(
        "hf bench: {} per point after {} warm-up; peer in a second process{}; \
         rates counted at the receiver",
        secs(settings.duration),
        match settings.warmup {
            Warmup::Time(d) => secs(d),
            Warmup::Messages(n) => format!("{n}-message"),
        },
        if args.connect.is_some() {
            " (remote)"
        } else {
            " (inproc: a second thread)"
        },
    );
    for n in &notes {
        say!("  {n}");
    }
    say!("{}", report::HEADER);

    let total = (targets.len() * points.len()) as u64;
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("a valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(120));

    let mut rows: Vec<Row> = Vec::new();
    let mut failures = 0usize;
    let mut engines = Vec::new();
    let mut notes_after = Vec::new();
    let point_limit = settings.duration
        + match settings.warmup {
            Warmup::Time(d) => d,
            Warmup::Messages(_) => Duration::ZERO,
        }
        + Duration::from_secs(60);
    for (transport, remote) in &targets {
        let (peer, url) = match remote {
            Some(url) => (None, url.clone()),
            None => match start_peer(&ctx, transport, args, &tls).await {
                Ok((p, url)) => (Some(p), url),
                Err(f) => {
                    bar.suspend(|| say!("{transport}: cannot start the peer: {}", f.message));
                    failures += 1;
                    bar.inc(points.len() as u64);
                    continue;
                }
            },
        };
        let mut ch = match ctx.connect(&url).await {
            Ok(ch) => ch,
            Err(e) => {
                bar.suspend(|| say!("{transport}: cannot connect to {url}: {e:#}"));
                failures += 1;
                bar.inc(points.len() as u64);
                continue;
            }
        };
        if (transport == "tcp" || transport == "tls")
            && let Some(engine) = ctx.io_engine()
        {
            engines.push(format!("{transport} ran on {engine}"));
        }
        let mut broken = false;
        for &(pattern, size) in &points {
            if broken {
                bar.inc(1);
                continue;
            }
            bar.set_message(format!(
                "{transport} {} {}",
                pattern.as_str(),
                report::size_label(size)
            ));
            let r = tokio::time::timeout(
                point_limit,
                proto::run_point(&mut ch, pattern, size, &settings),
            )
            .await
            .unwrap_or_else(|_| Err(format!("no result within {}", secs(point_limit))));
            match r {
                Ok(outcome) => {
                    let row = Row {
                        transport: transport.clone(),
                        pattern,
                        size,
                        outcome,
                        busy_poll: args.busy_poll,
                        zero_copy: args.zero_copy,
                        buffers: args.buffers,
                        device: args.device.clone(),
                        offered: args.rate,
                    };
                    bar.suspend(|| say!("{}", report::line(&row)));
                    rows.push(row);
                }
                Err(why) => {
                    bar.suspend(|| say!("{}", report::failed_line(transport, pattern, size, &why)));
                    failures += 1;
                    // The conversation is out of step now: the rest of this transport's
                    // points are skipped.
                    broken = true;
                }
            }
            bar.inc(1);
        }
        if settings.device.is_some() {
            notes_after.push(format!("{transport}: {}", device::paths(ch.info())));
        }
        let _ = ch.close().await;
        drop(ch);
        if let Some(peer) = peer
            && let Err(e) = peer.finish()
        {
            bar.suspend(|| say!("{transport}: {e:#}"));
        }
    }
    bar.finish_and_clear();

    // The ceiling for bandwidth, measured now: one memcpy in this process, or a copy on the
    // device for device bodies.
    if let Some(size) = rows
        .iter()
        .filter(|r| r.pattern == Pattern::Bw)
        .map(|r| r.size)
        .max()
    {
        let (what, gbytes_per_s) = match &settings.device {
            Some(gpu) => (
                format!(
                    "device-to-device copy of {} on {}",
                    report::size_label(size),
                    args.device.as_deref().unwrap_or_default()
                ),
                device::copy_gbytes_per_s(gpu, size),
            ),
            None => (
                format!(
                    "memcpy of {} from {}, in one process",
                    report::size_label(size),
                    match settings.buffers {
                        1 => "1 buffer again and again".to_string(),
                        n => format!("{n} buffers in turn"),
                    }
                ),
                Ok(memcpy_gbytes_per_s(size, settings.buffers)),
            ),
        };
        match gbytes_per_s {
            Ok(base) => {
                let ratios: Vec<String> = rows
                    .iter()
                    .filter(|r| r.pattern == Pattern::Bw && r.size == size)
                    .map(|r| format!("{} {:.2}×", r.transport, r.outcome.gbytes_per_s / base))
                    .collect();
                say!(
                    "baseline: {what}: {base:.2} GB/s; bw {} against it: {}",
                    report::size_label(size),
                    ratios.join(", ")
                );
            }
            Err(e) => say!("baseline: the {what} failed: {e}"),
        }
    }
    for e in engines.iter().chain(&notes_after) {
        say!("note: {e:#}");
    }

    if let Some(path) = &args.json {
        let mut out = String::new();
        for r in &rows {
            out.push_str(&r.json().to_string());
            out.push('\n');
        }
        std::fs::write(path, out)
            .map_err(|e| Failure::runtime(format!("cannot write {}: {e:#}", path.display())))?;
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "hf bench {}: {}",
            if args.connect.is_some() {
                "remote"
            } else {
                "loopback"
            },
            settings_label(args)
        );
        plot::write_svg(path, &rows, &title)
            .map_err(|e| Failure::runtime(format!("cannot plot to {}: {e:#}", path.display())))?;
    }
    let _ = std::io::stdout().flush();
    if failures > 0 {
        return Err(Failure::runtime(format!(
            "{failures} point{} failed (see above)",
            if failures == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn settings_label(args: &BenchArgs) -> String {
    let mut parts = vec![format!("{} s per point", args.duration)];
    if args.busy_poll {
        parts.push("busy-poll".into());
    }
    if args.zero_copy {
        parts.push("zero-copy".into());
    }
    if args.buffers != BUFFERS {
        parts.push(format!("{} buffers", args.buffers));
    }
    if let Some(d) = &args.device {
        parts.push(format!("device bodies ({d})"));
    }
    if args.no_cuda_ipc {
        parts.push("no CUDA IPC".into());
    }
    if args.no_gpudirect {
        parts.push("no GPUDirect".into());
    }
    if let Some(r) = args.rate {
        parts.push(format!("offered {r} msg/s"));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn args(line: &[&str]) -> BenchArgs {
        let mut v = vec!["hf-bench"];
        v.extend_from_slice(line);
        Wrap::try_parse_from(v).unwrap().args
    }

    #[test]
    fn standard_points() {
        let p = points(&args(&[])).unwrap();
        assert_eq!(
            p,
            [
                (Pattern::Lat, 64),
                (Pattern::Rate, 64),
                (Pattern::Rate, 32 << 10),
                (Pattern::Bw, 4 << 20)
            ]
        );
    }

    #[test]
    fn sizes_and_sweeps() {
        assert_eq!(
            parse_sizes(&["64".into(), "32KiB".into(), "4MiB".into()]).unwrap(),
            [64, 32 << 10, 4 << 20]
        );
        let sweep = parse_sizes(&["64..4MiB".into()]).unwrap();
        assert_eq!(sweep.len(), 17);
        assert_eq!((sweep[0], sweep[16]), (64, 4 << 20));
        assert_eq!(parse_sizes(&["0..4".into()]).unwrap(), [0, 1, 2, 4]);
        assert!(parse_sizes(&["4MiB..64".into()]).is_err());
        assert!(parse_sizes(&["1..1G".into(), "1..1G".into(), "1..1G".into()]).is_err());
        let p = points(&args(&["--pattern", "bw,lat", "--size", "1k,2k"])).unwrap();
        assert_eq!(
            p,
            [
                (Pattern::Lat, 1024),
                (Pattern::Lat, 2048),
                (Pattern::Bw, 1024),
                (Pattern::Bw, 2048)
            ]
        );
    }

    #[test]
    fn warmup_and_settings() {
        assert_eq!(parse_warmup("500").unwrap(), Warmup::Messages(500));
        assert_eq!(
            parse_warmup("0.5s").unwrap(),
            Warmup::Time(Duration::from_millis(500))
        );
        assert!(parse_warmup("soon").is_err());
        assert!(parse_warmup("-1s").is_err());
        assert!(settings(&args(&["--duration", "0"])).is_err());
        assert!(settings(&args(&["--rate", "0"])).is_err());
        assert!(settings(&args(&["--rate", "1000"])).is_ok());
    }
}
