//! The RDMA protocol over simulated verbs (feature `rdma`): 4 MiB messages through the whole
//! stack — `Sender`, driver, protocol core, simulated RDMA read into a registered pool buffer,
//! `FIN`, `Receiver` — next to a memcpy of 4 MiB measured in the same run; and the 64 B
//! message rate of the eager path. Run with `cargo bench --bench rdma_sim --features rdma`.
//!
//! The simulation moves bytes with a memcpy where a NIC would DMA them, so the 4 MiB figure
//! can at best approach the memcpy baseline: the ratio shows what the protocol, the driver
//! and the channel cost on top of the one copy the data needs. Bodies are allocated in
//! registered memory (`Sender::alloc`) and sent without a copy; the receiver drops each body
//! (returning its pool buffer) without reading it. A ratio summary is printed at the end.

use std::hint::black_box;
use std::time::Instant;

mod common;

use common::{per_second, record};
use criterion::{Criterion, Throughput};
use hyperframes::rdma::sim::{self, SimConfig};
use hyperframes::rdma::{RdmaConfig, channel_pair};
use hyperframes::{Channel, Message};

const BIG: usize = 4 << 20;
const SMALL: usize = 64;

fn pair(rt: &tokio::runtime::Runtime) -> (Channel, Channel) {
    rt.block_on(async {
        let (a, b) = sim::pair(SimConfig::default());
        channel_pair(a, b, RdmaConfig::default()).await.unwrap()
    })
}

fn stream(
    rt: &tokio::runtime::Runtime,
    tx: &mut hyperframes::Sender,
    rx: &mut Option<hyperframes::Receiver>,
    msg: &Message,
    n: u64,
) -> std::time::Duration {
    rt.block_on(async {
        let mut r = rx.take().unwrap();
        let reader = tokio::spawn(async move {
            for _ in 0..n {
                black_box(r.recv().await.unwrap().unwrap());
            }
            r
        });
        let start = Instant::now();
        for _ in 0..n {
            tx.send(msg.clone()).await.unwrap();
        }
        *rx = Some(reader.await.unwrap());
        start.elapsed()
    })
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    let group = "rdma_sim_4MiB";
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Bytes(BIG as u64));
    let src = vec![7u8; BIG];
    let mut dst = vec![0u8; BIG];
    g.bench_function("memcpy", |b| {
        b.iter_custom(|n| {
            let start = Instant::now();
            for _ in 0..n {
                dst.copy_from_slice(black_box(&src));
                black_box(&dst);
            }
            let d = start.elapsed();
            record(group, "memcpy", d, n);
            d
        })
    });
    let (a, b) = pair(&rt);
    let (mut tx, _ra) = a.split();
    let (_tb, rx) = b.split();
    let mut rx = Some(rx);
    let body = rt.block_on(async {
        let mut body = tx.alloc(BIG).await.unwrap();
        body.fill(5);
        body.freeze()
    });
    let msg = Message::new("bench.big").unwrap().with_body(body);
    g.bench_function("channel_alloc", |b| {
        b.iter_custom(|n| {
            let d = stream(&rt, &mut tx, &mut rx, &msg, n);
            record(group, "channel_alloc", d, n);
            d
        })
    });
    g.finish();

    let group = "rdma_sim_64B";
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(1));
    let small = Message::new("bench.small")
        .unwrap()
        .with_body(vec![1u8; SMALL]);
    g.bench_function("channel_eager", |b| {
        b.iter_custom(|n| {
            let d = stream(&rt, &mut tx, &mut rx, &small, n);
            record(group, "channel_eager", d, n);
            d
        })
    });
    g.finish();
    c.final_summary();

    let gb = |v: f64| v * BIG as f64 / 1e9;
    if let (Some(m), Some(r)) = (
        per_second("rdma_sim_4MiB", "memcpy"),
        per_second("rdma_sim_4MiB", "channel_alloc"),
    ) {
        println!(
            "\nrdma_sim 4 MiB: {:.1} GB/s through the simulated protocol, memcpy {:.1} GB/s, ratio {:.2}",
            gb(r),
            gb(m),
            r / m
        );
    }
    if let Some(r) = per_second("rdma_sim_64B", "channel_eager") {
        println!("rdma_sim 64 B: {:.2} M msg/s (eager)", r / 1e6);
    }
}
