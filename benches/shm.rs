//! `shm://` between two processes: 64 B one-way latency (parking and busy-poll), 64 B message
//! rate (a `send` per message, and the `Sink` batching of `feed`), and 4 MiB bandwidth (an
//! ordinary buffer copied in, and a body filled in place with `Sender::alloc`) with the
//! receiver reading every byte — next to a memcpy of 4 MiB measured in the same run.
//! Run with `cargo bench --bench shm`.
//!
//! The peer is this binary re-executed (`HF_BENCH_PEER`). Rates and bandwidth are counted at
//! the receiver: the sender streams N messages and an end marker, the clock stops at the
//! peer's acknowledgement. A ratio summary is printed at the end.

use std::hint::black_box;
use std::time::{Duration, Instant};

mod common;

use bytes::Bytes;
use common::{Peer, record};
use criterion::{Criterion, Throughput};
use futures_util::SinkExt;
use hyperframes::{Context, Message};

const SMALL: usize = 64;
const BIG: usize = 4 << 20;

fn ctx(busy: bool) -> Context {
    Context::builder()
        .busy_poll(busy)
        .shm_segment(4096, 12 << 20)
        .build()
        .unwrap()
}

/// Reads every byte of `b` (sums it as words), as a consumer of the data would.
fn touch(b: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        s = s.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
    }
    s + words.remainder().iter().map(|&x| x as u64).sum::<u64>()
}

/// Writes every byte of `b`, as a producer computing its data would: word by word, through
/// the cache (not `memset`, which switches to non-temporal stores for large buffers and so
/// pushes the data out to memory just before the receiver reads it).
fn produce(b: &mut [u8], i: u64) {
    for (k, w) in b.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(i ^ k as u64).to_le_bytes());
    }
}

// ------------------------------------------------------------------ peer side

/// `sink`: count (and read) messages, answer `bench.end` with the count. `echo`: send back.
fn peer_main(spec: &str) {
    let (mode, rest) = spec.split_once(' ').unwrap();
    let (busy, url) = rest.split_once(' ').unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut ch = ctx(busy == "busy").connect(url).await.unwrap();
        println!("READY");
        let mut count = 0u64;
        let mut sum = 0u64;
        while let Some(m) = ch.recv().await {
            let Ok(m) = m else { return };
            if mode == "echo" {
                ch.send(m).await.unwrap();
            } else if m.kind() == "bench.end" {
                let ack = Message::new("bench.ack")
                    .unwrap()
                    .with_body(count.to_le_bytes().to_vec());
                ch.send(ack).await.unwrap();
                black_box(sum);
                count = 0;
            } else {
                sum = sum.wrapping_add(touch(m.body().as_bytes().unwrap()));
                count += 1;
            }
        }
    });
}

// ------------------------------------------------------------------ bench side

static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

async fn pair(mode: &str, busy: bool) -> (hyperframes::Channel, Peer) {
    let url = format!(
        "shm://bench-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let mut l = ctx(busy).bind(&url).await.unwrap();
    let spec = format!("{mode} {} {url}", if busy { "busy" } else { "park" });
    let peer = tokio::task::spawn_blocking(move || Peer::spawn(&[("HF_BENCH_PEER", &spec)]))
        .await
        .unwrap();
    (l.accept().await.unwrap(), peer)
}

async fn wait_ack(ch: &mut hyperframes::Channel, n: u64) {
    ch.send(Message::new("bench.end").unwrap()).await.unwrap();
    let ack = ch.recv().await.unwrap().unwrap();
    let got = u64::from_le_bytes(ack.body().as_bytes().unwrap()[..8].try_into().unwrap());
    assert_eq!(got, n, "the peer received {got} of {n}");
}

fn bench_latency(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let group = "shm_pingpong_64B";
    let mut g = c.benchmark_group(group);
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for busy in [false, true] {
        let name = if busy { "busy_poll" } else { "parking" };
        let (mut ch, _peer) = rt.block_on(pair("echo", busy));
        let msg = Message::new("bench.ping")
            .unwrap()
            .with_body(Bytes::from_static(&[1; SMALL]));
        g.bench_function(name, |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..n {
                        ch.send(msg.clone()).await.unwrap();
                        black_box(ch.recv().await.unwrap().unwrap());
                    }
                    start.elapsed()
                });
                record(group, name, d, n);
                d
            })
        });
    }
    g.finish();
}

fn bench_rate(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let group = "shm_rate_64B";
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(1))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    let msg = Message::new("bench.data")
        .unwrap()
        .with_body(Bytes::from_static(&[2; SMALL]));
    for (name, batched) in [("send_each", false), ("sink_feed", true)] {
        let (mut ch, _peer) = rt.block_on(pair("sink", false));
        g.bench_function(name, |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(async {
                    let start = Instant::now();
                    if batched {
                        for _ in 0..n {
                            ch.feed(msg.clone()).await.unwrap();
                        }
                        SinkExt::flush(&mut ch).await.unwrap();
                    } else {
                        for _ in 0..n {
                            ch.send(msg.clone()).await.unwrap();
                        }
                    }
                    wait_ack(&mut ch, n).await;
                    start.elapsed()
                });
                record(group, name, d, n);
                d
            })
        });
    }
    g.finish();
}

fn bench_bandwidth(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let group = "shm_bw_4MiB";
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Bytes(BIG as u64))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    // The baseline: memcpy of 4 MiB between two buffers of this process.
    common::bench_memcpy(&mut g, group, BIG);
    let body = Bytes::from(vec![5u8; BIG]);
    for (name, in_place) in [("copy_in", false), ("alloc_in_place", true)] {
        let (mut ch, _peer) = rt.block_on(pair("sink", false));
        g.bench_function(name, |b| {
            b.iter_custom(|n| {
                let d = rt.block_on(async {
                    let start = Instant::now();
                    for i in 0..n {
                        let m = Message::new("bench.data").unwrap();
                        let m = if in_place {
                            let mut b = ch.alloc(BIG).await.unwrap();
                            produce(&mut b, i); // produce the data where it is read
                            m.with_body(b.freeze())
                        } else {
                            m.with_body(body.clone())
                        };
                        ch.send(m).await.unwrap();
                    }
                    wait_ack(&mut ch, n).await;
                    start.elapsed()
                });
                record(group, name, d, n);
                d
            })
        });
    }
    g.finish();
}

fn summary() {
    let per_s = common::per_second;
    println!("\nsummary (same run)");
    for f in ["parking", "busy_poll"] {
        if let Some(r) = per_s("shm_pingpong_64B", f) {
            println!("  64 B one-way latency  {f:<15} {:>8.3} us", 1e6 / r / 2.0);
        }
    }
    for f in ["send_each", "sink_feed"] {
        if let Some(r) = per_s("shm_rate_64B", f) {
            println!("  64 B message rate     {f:<15} {:>8.2} M msg/s", r / 1e6);
        }
    }
    let memcpy = per_s("shm_bw_4MiB", "memcpy").map(|r| r * BIG as f64 / 1e9);
    for f in ["memcpy", "copy_in", "alloc_in_place"] {
        if let Some(r) = per_s("shm_bw_4MiB", f) {
            let gbs = r * BIG as f64 / 1e9;
            let ratio = memcpy.map(|m| gbs / m).unwrap_or(f64::NAN);
            println!("  4 MiB bandwidth       {f:<15} {gbs:>8.2} GB/s  ({ratio:.2}x memcpy)");
        }
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
    bench_latency(&mut c, &rt);
    bench_rate(&mut c, &rt);
    bench_bandwidth(&mut c, &rt);
    c.final_summary();
    summary();
}
