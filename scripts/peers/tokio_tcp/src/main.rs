//! tokio-tcp-bench: a plain `tokio::net::TcpStream` over loopback, two processes, measured the
//! way `hf bench` measures hyperframes, so that scripts/compare.py can put the figures side by
//! side.
//!
//! ```text
//! tokio-tcp-bench --pattern lat|rate|bw --size BYTES --duration SECS [--pin A,B] [--port N]
//! ```
//!
//! The runner (this process) re-executes itself as the peer (hidden `--peer-role`), pinned to
//! the second CPU of `--pin` while the runner is pinned to the first. The peer listens on
//! 127.0.0.1 and prints `READY <port>`; only then does the runner connect. Each process runs
//! a current-thread tokio runtime.
//!
//! The framing is a minimal copy of hyperframes' own: a 24-byte little-endian header (u32
//! type length, u32 meta length, u64 body length, u64 correlation id), the type string (13
//! bytes: `hf.bench.warm` / `hf.bench.data`), no meta, then the body. The receiver reads the
//! header, then the type, then the body into a `Vec` of its own. Writers go through a 64 KiB
//! `BufWriter` (header+type+body of small messages gathered in its buffer; a body at least as
//! large as the buffer bypasses it, so 4 MiB bodies are not copied), readers through a
//! 256 KiB `BufReader`.
//!
//! ```text
//! runner                                   peer
//! hf.bench.warm x 0.5 s                →   (echoed for lat; read and dropped otherwise)
//! hf.bench.data x the run, corr = seq  →   (echoed for lat; counted, order checked)
//! hf.bench.end, corr = sent            →
//!                                      ←   hf.bench.result (what arrived, and when)
//! ```

use std::io::{BufRead, Write as _};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

const HEADER: usize = 24;
const WARM: &[u8] = b"hf.bench.warm";
const DATA: &[u8] = b"hf.bench.data";
const END: &[u8] = b"hf.bench.end";
const RESULT: &[u8] = b"hf.bench.result";
const MAX_TYPE: usize = 64;
const MAX_BODY: u64 = 1 << 30;
const WARMUP: Duration = Duration::from_millis(500);
/// Distinct send buffers, rotated, so that large ones do not all stay in the cache (as
/// `hf bench` does).
const NBUFS: usize = 8;
const WRITE_BUF: usize = 64 << 10;
const READ_BUF: usize = 256 << 10;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Pattern {
    Lat,
    Rate,
    Bw,
}

impl Pattern {
    fn as_str(self) -> &'static str {
        match self {
            Pattern::Lat => "lat",
            Pattern::Rate => "rate",
            Pattern::Bw => "bw",
        }
    }
}

struct Args {
    pattern: Pattern,
    size: usize,
    duration: Duration,
    pin: Option<(usize, usize)>,
    port: u16,
    /// `--peer-role PID`: this process is the peer of runner PID.
    peer_of: Option<u32>,
}

const USAGE: &str = "usage: tokio-tcp-bench --pattern lat|rate|bw --size BYTES --duration SECS \
                     [--pin A,B] [--port N]";

fn parse_args() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let (mut pattern, mut size, mut duration, mut pin, mut port, mut peer_of) =
        (None, None, None, None, 0u16, None);
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        let v = it
            .next()
            .ok_or_else(|| format!("{a} needs a value\n{USAGE}"))?;
        let bad = || format!("bad {a} {v:?}\n{USAGE}");
        match a.as_str() {
            "--pattern" => {
                pattern = Some(match v.as_str() {
                    "lat" => Pattern::Lat,
                    "rate" => Pattern::Rate,
                    "bw" => Pattern::Bw,
                    _ => return Err(bad()),
                })
            }
            "--size" => size = Some(v.parse::<usize>().map_err(|_| bad())?),
            "--duration" => {
                let s = v.parse::<f64>().map_err(|_| bad())?;
                if !(s > 0.0 && s < 1e6) {
                    return Err(bad());
                }
                duration = Some(Duration::from_secs_f64(s));
            }
            "--pin" => {
                let (x, y) = v.split_once(',').ok_or_else(bad)?;
                pin = Some((
                    x.trim().parse().map_err(|_| bad())?,
                    y.trim().parse().map_err(|_| bad())?,
                ));
            }
            "--port" => port = v.parse().map_err(|_| bad())?,
            "--peer-role" => peer_of = Some(v.parse().map_err(|_| bad())?),
            _ => return Err(format!("unknown argument {a}\n{USAGE}")),
        }
    }
    let size = size.ok_or(USAGE)?;
    if size as u64 > MAX_BODY {
        return Err(format!("--size: at most {MAX_BODY} bytes"));
    }
    Ok(Args {
        pattern: pattern.ok_or(USAGE)?,
        size,
        duration: match (duration, peer_of) {
            (Some(d), _) => d,
            (None, Some(_)) => Duration::ZERO,
            (None, None) => return Err(USAGE.into()),
        },
        pin,
        port,
        peer_of,
    })
}

fn pin(cpu: usize) -> Result<(), String> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(format!("bad CPU {cpu}"));
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the call only reads it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        return Err(format!(
            "cannot pin to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

// ------------------------------------------------------------------------ framing

/// One received message: its type and a body in a buffer of its own.
struct Frame {
    kind: [u8; MAX_TYPE],
    kind_len: usize,
    corr: u64,
    body: Vec<u8>,
}

impl Frame {
    fn kind(&self) -> &[u8] {
        &self.kind[..self.kind_len]
    }
}

fn io_err(what: &str, e: std::io::Error) -> String {
    format!("{what}: {e}")
}

async fn read_msg(r: &mut BufReader<OwnedReadHalf>) -> Result<Frame, String> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).await.map_err(|e| io_err("read", e))?;
    let kind_len = u32::from_le_bytes(h[0..4].try_into().unwrap()) as usize;
    let meta_len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
    let body_len = u64::from_le_bytes(h[8..16].try_into().unwrap());
    let corr = u64::from_le_bytes(h[16..24].try_into().unwrap());
    if kind_len > MAX_TYPE || meta_len > 1 << 16 || body_len > MAX_BODY {
        return Err(format!(
            "bad header: type {kind_len} B, meta {meta_len} B, body {body_len} B"
        ));
    }
    let mut kind = [0u8; MAX_TYPE];
    r.read_exact(&mut kind[..kind_len])
        .await
        .map_err(|e| io_err("read", e))?;
    if meta_len > 0 {
        let mut meta = vec![0u8; meta_len];
        r.read_exact(&mut meta)
            .await
            .map_err(|e| io_err("read", e))?;
    }
    let mut body = vec![0u8; body_len as usize];
    r.read_exact(&mut body)
        .await
        .map_err(|e| io_err("read", e))?;
    Ok(Frame {
        kind,
        kind_len,
        corr,
        body,
    })
}

/// Writes one message into the `BufWriter` (flushing is the caller's business).
async fn write_msg(
    w: &mut BufWriter<OwnedWriteHalf>,
    kind: &[u8],
    corr: u64,
    body: &[u8],
) -> Result<(), String> {
    let mut h = [0u8; HEADER + 16];
    h[0..4].copy_from_slice(&(kind.len() as u32).to_le_bytes());
    h[8..16].copy_from_slice(&(body.len() as u64).to_le_bytes());
    h[16..24].copy_from_slice(&corr.to_le_bytes());
    h[HEADER..HEADER + kind.len()].copy_from_slice(kind);
    w.write_all(&h[..HEADER + kind.len()])
        .await
        .map_err(|e| io_err("write", e))?;
    w.write_all(body).await.map_err(|e| io_err("write", e))
}

async fn flush(w: &mut BufWriter<OwnedWriteHalf>) -> Result<(), String> {
    w.flush().await.map_err(|e| io_err("write", e))
}

fn split(s: TcpStream) -> (BufReader<OwnedReadHalf>, BufWriter<OwnedWriteHalf>) {
    let (r, w) = s.into_split();
    (
        BufReader::with_capacity(READ_BUF, r),
        BufWriter::with_capacity(WRITE_BUF, w),
    )
}

/// Reads every word of `b` (a sum nobody looks at).
fn touch(b: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        s = s.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
    }
    s + words.remainder().iter().map(|&x| u64::from(x)).sum::<u64>()
}

// ------------------------------------------------------------------------ peer side

async fn peer(pattern: Pattern, port: u16) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|e| io_err("bind", e))?;
    let port = l.local_addr().map_err(|e| io_err("bind", e))?.port();
    // Listening: tell the runner.
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY {port}").map_err(|e| io_err("stdout", e))?;
        out.flush().map_err(|e| io_err("stdout", e))?;
    }
    let (s, _) = l.accept().await.map_err(|e| io_err("accept", e))?;
    drop(l);
    s.set_nodelay(true).map_err(|e| io_err("nodelay", e))?;
    let (mut r, mut w) = split(s);

    let (mut warm, mut messages, mut bytes, mut out_of_order, mut sum) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut first, mut last, mut clocked): (Option<Instant>, Option<Instant>, u64) =
        (None, None, 0);
    let echo = pattern == Pattern::Lat;
    loop {
        let f = read_msg(&mut r).await?;
        match f.kind() {
            WARM => {
                warm += 1;
                if echo {
                    write_msg(&mut w, WARM, f.corr, &f.body).await?;
                    flush(&mut w).await?;
                } else if pattern == Pattern::Bw {
                    sum = sum.wrapping_add(touch(&f.body));
                }
            }
            DATA => {
                if f.corr != messages {
                    out_of_order += 1;
                }
                messages += 1;
                bytes += f.body.len() as u64;
                if echo {
                    write_msg(&mut w, DATA, f.corr, &f.body).await?;
                    flush(&mut w).await?;
                    continue;
                }
                if pattern == Pattern::Bw {
                    sum = sum.wrapping_add(touch(&f.body));
                }
                // The clock costs ~20 ns: read it for the first message, for every large
                // one and every 16th small one; the end marker clocks the rest (as hf bench).
                if first.is_none() || f.body.len() >= 4096 || messages.is_multiple_of(16) {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last = Some(now);
                    clocked = messages;
                }
            }
            END => break,
            k => {
                return Err(format!(
                    "unexpected message {:?}",
                    String::from_utf8_lossy(k)
                ))
            }
        }
    }
    if clocked < messages {
        last = Some(Instant::now());
    }
    let span_ns = match (first, last) {
        (Some(a), Some(b)) => b.duration_since(a).as_nanos() as u64,
        _ => 0,
    };
    std::hint::black_box(sum);
    let result = format!("{messages} {bytes} {span_ns} {warm} {out_of_order}");
    write_msg(&mut w, RESULT, 0, result.as_bytes()).await?;
    flush(&mut w).await?;
    let _ = w.shutdown().await;
    Ok(())
}

// ------------------------------------------------------------------------ runner side

/// The peer process: killed (and reaped) unless it has been seen to exit.
struct PeerGuard(Option<Child>);

impl Drop for PeerGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl PeerGuard {
    /// Waits (up to `within`) for the peer to exit by itself; an error if it fails or hangs.
    fn finish(&mut self, within: Duration) -> Result<(), String> {
        let c = self.0.as_mut().expect("a peer");
        let deadline = Instant::now() + within;
        loop {
            match c.try_wait() {
                Ok(Some(st)) => {
                    self.0 = None;
                    return if st.success() {
                        Ok(())
                    } else {
                        Err(format!("the peer failed: {st}"))
                    };
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => return Err("the peer did not exit".into()),
                Err(e) => return Err(format!("waiting for the peer: {e}")),
            }
        }
    }
}

/// Spawns the peer and waits for it to listen; returns it and its port.
fn spawn_peer(a: &Args) -> Result<(PeerGuard, u16), String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "--peer-role",
        &std::process::id().to_string(),
        "--pattern",
        a.pattern.as_str(),
        "--size",
        &a.size.to_string(),
        "--port",
        &a.port.to_string(),
    ]);
    if let Some((x, y)) = a.pin {
        cmd.args(["--pin", &format!("{x},{y}")]);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("spawn the peer: {e}"))?;
    let stdout = child.stdout.take().expect("piped");
    let mut guard = PeerGuard(Some(child));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the peer did not start listening within 10 s".to_string())?;
    match line
        .trim()
        .strip_prefix("READY ")
        .and_then(|p| p.parse().ok())
    {
        Some(port) => Ok((guard, port)),
        None => {
            let _ = guard.finish(Duration::from_secs(1));
            Err("the peer exited before listening".into())
        }
    }
}

struct Outcome {
    sent: u64,
    /// From the peer: measured messages, their body bytes, first-to-last span, warm-up
    /// messages, out-of-order ones.
    received: u64,
    bytes: u64,
    span: Duration,
    out_of_order: u64,
    /// Latency only: round trips (ns) and the runner's measured span.
    rtt_ns: Vec<u64>,
    runner_span: Duration,
}

async fn run(a: &Args, port: u16) -> Result<Outcome, String> {
    let s = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| io_err("connect", e))?;
    s.set_nodelay(true).map_err(|e| io_err("nodelay", e))?;
    let (mut r, mut w) = split(s);
    let bodies: Vec<Vec<u8>> = (0..NBUFS)
        .map(|k| (0..a.size).map(|i| (i * 31 + k) as u8).collect())
        .collect();
    let large = a.size >= 4096;
    let mut sent = 0u64;
    let mut rtt_ns = Vec::new();
    let mut runner_span = Duration::ZERO;

    if a.pattern == Pattern::Lat {
        let t = Instant::now();
        let mut k = 0u64;
        while t.elapsed() < WARMUP {
            write_msg(&mut w, WARM, k, &bodies[k as usize % NBUFS]).await?;
            flush(&mut w).await?;
            let f = read_msg(&mut r).await?;
            if f.kind() != WARM || f.corr != k {
                return Err("bad warm-up echo".into());
            }
            k += 1;
        }
        rtt_ns.reserve(1 << 16);
        let t0 = Instant::now();
        let end = t0 + a.duration;
        loop {
            let s0 = Instant::now();
            if s0 >= end {
                break;
            }
            write_msg(&mut w, DATA, sent, &bodies[sent as usize % NBUFS]).await?;
            flush(&mut w).await?;
            let f = read_msg(&mut r).await?;
            let s1 = Instant::now();
            if f.kind() != DATA || f.corr != sent || f.body.len() != a.size {
                return Err(format!("bad echo of ping {sent}"));
            }
            rtt_ns.push((s1 - s0).as_nanos() as u64);
            sent += 1;
        }
        runner_span = t0.elapsed();
    } else {
        let t = Instant::now();
        let mut k = 0u64;
        loop {
            if (large || k.is_multiple_of(16)) && t.elapsed() >= WARMUP {
                break;
            }
            write_msg(&mut w, WARM, k, &bodies[k as usize % NBUFS]).await?;
            k += 1;
        }
        let end = Instant::now() + a.duration;
        loop {
            if (large || sent.is_multiple_of(16)) && Instant::now() >= end {
                break;
            }
            write_msg(&mut w, DATA, sent, &bodies[sent as usize % NBUFS]).await?;
            sent += 1;
        }
    }
    write_msg(&mut w, END, sent, &[]).await?;
    flush(&mut w).await?;
    let f = read_msg(&mut r).await?;
    if f.kind() != RESULT {
        return Err("the peer sent no result".into());
    }
    let text = String::from_utf8_lossy(&f.body).into_owned();
    let v: Vec<u64> = text
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(u64::MAX))
        .collect();
    if v.len() != 5 || v.contains(&u64::MAX) {
        return Err(format!("bad result from the peer: {text:?}"));
    }
    Ok(Outcome {
        sent,
        received: v[0],
        bytes: v[1],
        span: Duration::from_nanos(v[2]),
        out_of_order: v[4],
        rtt_ns,
        runner_span,
    })
}

fn num(x: Option<f64>, decimals: usize) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{v:.decimals$}"),
        _ => "null".into(),
    }
}

fn runner(a: &Args) -> Result<i32, String> {
    // Pin first: every thread of this process (the runtime's included) inherits the CPU.
    if let Some((cpu, _)) = a.pin {
        pin(cpu)?;
    }
    // Spawned from the main thread, which lives until the end (the peer's death signal
    // follows the thread that spawned it).
    let (mut peer, port) = spawn_peer(a)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let limit = a.duration + WARMUP + Duration::from_secs(60);
    let o = rt
        .block_on(async { tokio::time::timeout(limit, run(a, port)).await })
        .map_err(|_| "the run timed out".to_string())??;
    drop(rt);
    peer.finish(Duration::from_secs(5))?;

    let lost = o.sent as i64 - o.received as i64;
    let (messages, seconds, msgs, gb, p50, p99);
    if a.pattern == Pattern::Lat {
        let mut rtt = o.rtt_ns;
        rtt.sort_unstable();
        let n = rtt.len();
        let pick = |q: f64| (n > 0).then(|| rtt[((n as f64 * q) as usize).min(n - 1)] as f64 / 2e3);
        messages = o.sent;
        seconds = o.runner_span.as_secs_f64();
        msgs = (n > 0).then(|| n as f64 / seconds);
        gb = None;
        p50 = (n > 0).then(|| rtt[(n - 1) / 2] as f64 / 2e3);
        p99 = pick(0.99);
    } else {
        messages = o.received;
        seconds = o.span.as_secs_f64();
        let rate = (o.received >= 2 && seconds > 0.0).then(|| (o.received - 1) as f64 / seconds);
        msgs = rate;
        gb = rate.map(|r| r * o.bytes as f64 / o.received as f64 / 1e9);
        p50 = None;
        p99 = None;
    }
    println!(
        "{{\"tool\":\"tokio\",\"version\":\"{}\",\"pattern\":\"{}\",\"size\":{},\"messages\":{},\
         \"lost\":{},\"seconds\":{:.6},\"msgs_per_s\":{},\"gbytes_per_s\":{},\"lat_p50_us\":{},\
         \"lat_p99_us\":{}}}",
        env!("TOKIO_VERSION"),
        a.pattern.as_str(),
        a.size,
        messages,
        lost,
        seconds,
        num(msgs, 1),
        num(gb, 6),
        num(p50, 3),
        num(p99, 3),
    );
    let _ = std::io::stdout().flush();
    if lost != 0 || o.out_of_order != 0 {
        eprintln!(
            "tokio-tcp-bench: the peer received {} of {} messages, {} out of order",
            o.received, o.sent, o.out_of_order
        );
        return Ok(1);
    }
    if a.pattern != Pattern::Lat && o.received < 2 {
        eprintln!("tokio-tcp-bench: too few messages to measure a rate; use a longer --duration");
        return Ok(1);
    }
    Ok(0)
}

fn peer_main(a: &Args, parent: u32) -> Result<i32, String> {
    // Die with the runner, whatever kills it.
    // SAFETY: plain system calls with constant arguments.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() as u32 != parent {
            return Err("the runner is gone".into());
        }
    }
    if let Some((_, cpu)) = a.pin {
        pin(cpu)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(peer(a.pattern, a.port))?;
    Ok(0)
}

fn main() {
    let code = match parse_args() {
        Err(e) => {
            eprintln!("tokio-tcp-bench: {e}");
            2
        }
        Ok(a) => {
            let r = match a.peer_of {
                Some(parent) => peer_main(&a, parent),
                None => runner(&a),
            };
            r.unwrap_or_else(|e| {
                let who = if a.peer_of.is_some() { " peer" } else { "" };
                eprintln!("tokio-tcp-bench{who}: {e}");
                1
            })
        }
    };
    std::process::exit(code);
}
