//! hyperframes over `tcp://127.0.0.1` against a plain tokio `TcpStream` doing the same
//! length-prefixed framing, two processes, in one run: 64 B message rate, 4 MiB bandwidth and
//! 64 B round-trip latency; and the inline engine over a session (`connect_with`: numbered,
//! acknowledged messages) to show what acknowledged delivery costs. Run with
//! `cargo bench --bench tcp_vs_tokio`.
//!
//! The peer is this binary re-executed (`HF_BENCH_PEER`). Rates are measured at the
//! receiver: the sender streams N messages and an end marker, and the clock stops when the
//! peer acknowledges that all N arrived. A summary of ratios against the baseline measured
//! in the same run is printed at the end.
//!
//! The baseline is what a competent user writes by hand: `[u32 length][payload]` frames
//! through a 64 KiB `BufWriter` (large payloads bypass the buffer, so nothing is copied) and a
//! 256 KiB `BufReader`, each received payload in a buffer of its own.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Peer, record};
use criterion::{Criterion, Throughput};
use hyperframes::{Context, IoEngine, Message};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

const RATE_SIZE: usize = 64;
const BW_SIZE: usize = 4 << 20;

// ------------------------------------------------------------------ peer side

fn peer_main(spec: &str) {
    let mut it = spec.split(' ');
    let (kind, mode, url) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        match kind {
            "hf" => hf_peer(mode, url, false).await,
            "hf-session" => hf_peer(mode, url, true).await,
            _ => tokio_peer(mode, url).await,
        }
    });
}

/// `sink`: count messages, answer each `bench.end` with a `bench.ack` carrying the count.
/// `echo`: send every message back.
/// `session`: over a session (`connect_with`), acknowledged in batches.
async fn hf_peer(mode: &str, url: &str, session: bool) {
    let engine = match std::env::var("HYPERFRAMES_IO").as_deref() {
        Ok("epoll") => IoEngine::Epoll,
        Ok("inline") => IoEngine::Inline,
        _ => IoEngine::Uring,
    };
    let ctx = Context::builder().io_engine(engine).build().unwrap();
    let mut ch = if session {
        let never = hyperframes::session::Reconnect::never();
        ctx.connect_with(url, never).await.unwrap()
    } else {
        ctx.connect(url).await.unwrap()
    };
    println!("READY");
    let mut count = 0u64;
    while let Some(m) = ch.recv().await {
        let Ok(m) = m else { return };
        if mode == "echo" {
            ch.send(m).await.unwrap();
        } else if m.kind() == "bench.end" {
            let ack = Message::new("bench.ack")
                .unwrap()
                .with_body(count.to_le_bytes().to_vec());
            ch.send(ack).await.unwrap();
            count = 0;
        } else {
            count += 1;
        }
    }
}

async fn tokio_peer(mode: &str, url: &str) {
    let addr = url.trim_start_matches("tcp://");
    let s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    println!("READY");
    let (r, w) = s.into_split();
    let mut r = BufReader::with_capacity(256 << 10, r);
    let mut w = BufWriter::with_capacity(64 << 10, w);
    let mut count = 0u64;
    loop {
        let Ok(len) = r.read_u32_le().await else {
            return;
        };
        if len == u32::MAX {
            // end marker
            w.write_u32_le(8).await.unwrap();
            w.write_all(&count.to_le_bytes()).await.unwrap();
            w.flush().await.unwrap();
            count = 0;
            continue;
        }
        let mut body = vec![0u8; len as usize];
        r.read_exact(&mut body).await.unwrap();
        if mode == "echo" {
            w.write_u32_le(len).await.unwrap();
            w.write_all(&body).await.unwrap();
            w.flush().await.unwrap();
        } else {
            count += 1;
        }
    }
}

// ------------------------------------------------------------------ bench side

fn spawn_peer(kind: &str, mode: &str, url: &str, engine: Option<&str>) -> Peer {
    let spec = format!("{kind} {mode} {url}");
    let mut envs = vec![("HF_BENCH_PEER", spec.as_str())];
    if let Some(e) = engine {
        envs.push(("HYPERFRAMES_IO", e));
    }
    Peer::spawn(&envs)
}

/// Engines, and whether over a session (acknowledged delivery: its cost against the plain
/// inline channel).
const VARIANTS: [(IoEngine, bool); 4] = [
    (IoEngine::Uring, false),
    (IoEngine::Epoll, false),
    (IoEngine::Inline, false),
    (IoEngine::Inline, true),
];

fn variant_name(engine: IoEngine, session: bool) -> String {
    let suffix = if session { "_session" } else { "" };
    format!("hyperframes_{}{suffix}", engine_name(engine))
}

fn engine_name(e: IoEngine) -> &'static str {
    match e {
        IoEngine::Epoll => "epoll",
        IoEngine::Inline => "inline",
        _ => "uring",
    }
}

/// A hyperframes channel to a freshly spawned peer; a session when `session`.
async fn hf_pair(engine: IoEngine, mode: &str, session: bool) -> (hyperframes::Channel, Peer) {
    let ctx = Context::builder().io_engine(engine).build().unwrap();
    let mut l = if session {
        ctx.bind_sessions("tcp://127.0.0.1:0").await.unwrap()
    } else {
        ctx.bind("tcp://127.0.0.1:0").await.unwrap()
    };
    // Wait for the peer off the runtime: inline, this runtime answers its handshake.
    let (mode, url) = (mode.to_owned(), l.local_url().to_owned());
    let kind = if session { "hf-session" } else { "hf" };
    let peer = tokio::task::spawn_blocking(move || {
        spawn_peer(kind, &mode, &url, Some(engine_name(engine)))
    })
    .await
    .unwrap();
    (l.accept().await.unwrap(), peer)
}

async fn tokio_pair(mode: &str) -> (TcpStream, Peer) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("tcp://{}", l.local_addr().unwrap());
    let peer = spawn_peer("tokio", mode, &url, None);
    let (s, _) = l.accept().await.unwrap();
    s.set_nodelay(true).unwrap();
    (s, peer)
}

/// Streams `n` messages of `body` and waits for the peer's count.
async fn hf_stream(ch: &mut hyperframes::Channel, body: &Bytes, n: u64) -> Duration {
    let msg = Message::new("bench.data").unwrap().with_body(body.clone());
    let start = Instant::now();
    for _ in 0..n {
        ch.send(msg.clone()).await.unwrap();
    }
    ch.send(Message::new("bench.end").unwrap()).await.unwrap();
    let ack = ch.recv().await.unwrap().unwrap();
    let elapsed = start.elapsed();
    let got = u64::from_le_bytes(ack.body().as_bytes().unwrap()[..8].try_into().unwrap());
    assert_eq!(got, n, "peer received {got} of {n}");
    elapsed
}

struct TokioConn {
    r: BufReader<tokio::net::tcp::OwnedReadHalf>,
    w: BufWriter<tokio::net::tcp::OwnedWriteHalf>,
}

impl TokioConn {
    fn new(s: TcpStream) -> TokioConn {
        let (r, w) = s.into_split();
        TokioConn {
            r: BufReader::with_capacity(256 << 10, r),
            w: BufWriter::with_capacity(64 << 10, w),
        }
    }
}

async fn tokio_stream(c: &mut TokioConn, body: &Bytes, n: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        c.w.write_u32_le(body.len() as u32).await.unwrap();
        c.w.write_all(body).await.unwrap();
    }
    c.w.write_u32_le(u32::MAX).await.unwrap();
    c.w.flush().await.unwrap();
    let len = c.r.read_u32_le().await.unwrap();
    let mut ack = vec![0u8; len as usize];
    c.r.read_exact(&mut ack).await.unwrap();
    let elapsed = start.elapsed();
    assert_eq!(u64::from_le_bytes(ack[..8].try_into().unwrap()), n);
    elapsed
}

fn bench_streaming(c: &mut Criterion, rt: &tokio::runtime::Runtime, group: &str, size: usize) {
    let body = Bytes::from(vec![0x5au8; size]);
    let mut g = c.benchmark_group(group);
    g.throughput(if size >= 1 << 20 {
        Throughput::Bytes(size as u64)
    } else {
        Throughput::Elements(1)
    });
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for (engine, session) in VARIANTS {
        let name = variant_name(engine, session);
        let (mut ch, _peer) = rt.block_on(hf_pair(engine, "sink", session));
        g.bench_function(&name, |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(hf_stream(&mut ch, &body, n));
                record(group, &name, d, n);
                d
            })
        });
    }
    let (s, _peer) = rt.block_on(tokio_pair("sink"));
    let mut conn = TokioConn::new(s);
    g.bench_function("tokio_tcpstream", |b| {
        b.iter_custom(|n| {
            let d = rt.block_on(tokio_stream(&mut conn, &body, n));
            record(group, "tokio_tcpstream", d, n);
            d
        })
    });
    g.finish();
}

fn bench_latency(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let group = "tcp_pingpong_64B";
    let body = Bytes::from(vec![1u8; RATE_SIZE]);
    let mut g = c.benchmark_group(group);
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for (engine, session) in VARIANTS {
        let name = variant_name(engine, session);
        let (mut ch, _peer) = rt.block_on(hf_pair(engine, "echo", session));
        let msg = Message::new("bench.ping").unwrap().with_body(body.clone());
        g.bench_function(&name, |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..n {
                        ch.send(msg.clone()).await.unwrap();
                        ch.recv().await.unwrap().unwrap();
                    }
                    start.elapsed()
                });
                record(group, &name, d, n);
                d
            })
        });
    }
    let (s, _peer) = rt.block_on(tokio_pair("echo"));
    let mut conn = TokioConn::new(s);
    g.bench_function("tokio_tcpstream", |b| {
        b.iter_custom(|n| {
            let d = rt.block_on(async {
                let mut buf = [0u8; RATE_SIZE];
                let start = Instant::now();
                for _ in 0..n {
                    conn.w.write_u32_le(RATE_SIZE as u32).await.unwrap();
                    conn.w.write_all(&body).await.unwrap();
                    conn.w.flush().await.unwrap();
                    let len = conn.r.read_u32_le().await.unwrap();
                    conn.r.read_exact(&mut buf[..len as usize]).await.unwrap();
                }
                start.elapsed()
            });
            record(group, "tokio_tcpstream", d, n);
            d
        })
    });
    g.finish();
}

fn summary() {
    println!("\nsummary (same run; ratio = hyperframes / tokio baseline, >1 is better for rates)");
    let all = common::all();
    for (g, f, per_s) in &all {
        let base = common::per_second(g, "tokio_tcpstream");
        let (value, unit) = if g.contains("bw") {
            (per_s * BW_SIZE as f64 / 1e9, "GB/s")
        } else if g.contains("pingpong") {
            (1e6 / per_s / 2.0, "us one-way")
        } else {
            (per_s / 1e6, "M msg/s")
        };
        let ratio = base.map(|b| per_s / b).unwrap_or(f64::NAN);
        println!("  {g:<20} {f:<22} {value:>9.3} {unit:<11} ratio {ratio:.2}");
    }
}

fn main() {
    if let Ok(spec) = std::env::var("HF_BENCH_PEER") {
        peer_main(&spec);
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut c = Criterion::default().configure_from_args();
    bench_streaming(&mut c, &rt, "tcp_rate_64B", RATE_SIZE);
    bench_streaming(&mut c, &rt, "tcp_bw_4MiB", BW_SIZE);
    bench_latency(&mut c, &rt);
    c.final_summary();
    summary();
}
