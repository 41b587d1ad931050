//! The RDMA protocol over simulated verbs (feature `rdma`): 4 MiB messages through the whole
//! stack — `Sender`, driver, protocol core, simulated RDMA read into a registered pool buffer,
//! `FIN`, `Receiver` — next to a memcpy of 4 MiB measured in the same run; and the 64 B
//! message rate of the eager path. Run with `cargo bench --bench rdma_sim --features rdma`.
//!
//! The simulation copies each body with a memcpy where a NIC would DMA it, so with data
//! moved the 4 MiB figure can at best approach memcpy, and it depends on whether the buffers
//! stay in the CPU's cache:
//! * `channel_alloc`: default settings (up to 16 MiB of bodies read ahead of the receiver,
//!   so several 4 MiB pool buffers take turns and fall out of cache);
//! * `channel_alloc_1deep`: `recv_queue_bytes` of one body (one pool buffer, reused hot);
//! * `channel_heap`: as `channel_alloc` with a body in ordinary heap memory (`Bytes`);
//! * `protocol_only`: the simulation checks keys and bounds but moves no body bytes — what
//!   the protocol, the driver and the channel cost per 4 MiB message, without the copy;
//! * with `--features rdma,cuda`, bodies in the stand-in device's memory (host memory
//!   handled as a device): `device_gpudirect` (registered as a dma-buf, the stand-in's memfd,
//!   and read from there), `device_staged` (`RdmaConfig::gpudirect` off: copied to host
//!   buffers in 1 MiB chunks by the staging pipeline, each chunk sent by rendezvous).
//!
//! Each body is registered where it lies for the peer's read (its own registration, until
//! the `FIN`), so both kinds of body are sent without a copy; the receiver drops each body
//! (returning its pool buffer) without reading it. A summary with ratios to memcpy is printed
//! at the end.

use std::hint::black_box;
use std::time::Instant;

mod common;

use common::{per_second, record};
use criterion::{Criterion, Throughput};
use hyperframes::rdma::sim::{self, SimConfig};
use hyperframes::rdma::{RdmaConfig, channel_pair};
use hyperframes::{Channel, Message, Receiver, Sender};

const BIG: usize = 4 << 20;
const SMALL: usize = 64;

fn pair(rt: &tokio::runtime::Runtime, cfg: RdmaConfig, sim: SimConfig) -> (Channel, Channel) {
    rt.block_on(async {
        let (a, b) = sim::pair(sim);
        channel_pair(a, b, cfg).await.unwrap()
    })
}

/// Streams `n` clones of `msg`; the clock stops when the receiver has taken the last.
fn stream(
    rt: &tokio::runtime::Runtime,
    tx: &mut Sender,
    rx: &mut Option<Receiver>,
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

/// A sender, a receiver and a 4 MiB body in the sender's registered memory.
struct Setup {
    tx: Sender,
    rx: Option<Receiver>,
    big: Message,
    _keep: (Receiver, Sender),
}

fn setup(rt: &tokio::runtime::Runtime, cfg: RdmaConfig, sim: SimConfig, heap: bool) -> Setup {
    let (a, b) = pair(rt, cfg, sim);
    let (mut tx, ra) = a.split();
    let (tb, rx) = b.split();
    let body = if heap {
        bytes::Bytes::from(vec![5u8; BIG]).into()
    } else {
        rt.block_on(async {
            let mut body = tx.alloc(BIG).await.unwrap();
            body.fill(5);
            body.freeze()
        })
    };
    Setup {
        tx,
        rx: Some(rx),
        big: Message::new("bench.big").unwrap().with_body(body),
        _keep: (ra, tb),
    }
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
    common::bench_memcpy(&mut g, group, BIG);
    let variants = [
        ("channel_alloc", RdmaConfig::default(), SimConfig::default()),
        ("channel_heap", RdmaConfig::default(), SimConfig::default()),
        (
            "channel_alloc_1deep",
            RdmaConfig {
                recv_queue_bytes: BIG,
                ..RdmaConfig::default()
            },
            SimConfig::default(),
        ),
        (
            "protocol_only",
            RdmaConfig::default(),
            SimConfig {
                skip_bulk_data: true,
                ..SimConfig::default()
            },
        ),
    ];
    let mut small_setup = None;
    #[cfg(feature = "cuda")]
    for (name, gpudirect) in [("device_gpudirect", true), ("device_staged", false)] {
        let cfg = RdmaConfig {
            gpudirect,
            ..RdmaConfig::default()
        };
        let mut s = setup(&rt, cfg, SimConfig::default(), true);
        let gpu = hyperframes::device::Gpu::stand_in();
        s.big = Message::new("bench.device")
            .unwrap()
            .with_body(gpu.upload(&vec![5u8; BIG]).unwrap());
        g.bench_function(name, |b| {
            b.iter_custom(|n| {
                let d = stream(&rt, &mut s.tx, &mut s.rx, &s.big, n);
                record(group, name, d, n);
                d
            })
        });
    }
    for (name, cfg, sim) in variants {
        let mut s = setup(&rt, cfg, sim, name == "channel_heap");
        g.bench_function(name, |b| {
            b.iter_custom(|n| {
                let d = stream(&rt, &mut s.tx, &mut s.rx, &s.big, n);
                record(group, name, d, n);
                d
            })
        });
        if name == "channel_alloc" {
            small_setup = Some(s);
        }
    }
    g.finish();

    let group = "rdma_sim_64B";
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(1));
    let small = Message::new("bench.small")
        .unwrap()
        .with_body(vec![1u8; SMALL]);
    let mut s = small_setup.expect("set up above");
    g.bench_function("channel_eager", |b| {
        b.iter_custom(|n| {
            let d = stream(&rt, &mut s.tx, &mut s.rx, &small, n);
            record(group, "channel_eager", d, n);
            d
        })
    });
    g.finish();
    c.final_summary();

    let gb = |v: f64| v * BIG as f64 / 1e9;
    if let Some(m) = per_second("rdma_sim_4MiB", "memcpy") {
        println!(
            "\nrdma_sim, 4 MiB messages (memcpy of 4 MiB: {:.1} GB/s)",
            gb(m)
        );
        for f in [
            "channel_alloc",
            "channel_heap",
            "channel_alloc_1deep",
            "protocol_only",
            "device_gpudirect",
            "device_staged",
        ] {
            if let Some(r) = per_second("rdma_sim_4MiB", f) {
                println!("  {f:<20} {:>7.1} GB/s  {:>5.2}x memcpy", gb(r), r / m);
            }
        }
    }
    if let Some(r) = per_second("rdma_sim_64B", "channel_eager") {
        println!(
            "rdma_sim 64 B: {:.2} M msg/s (eager path, send per message)",
            r / 1e6
        );
    }
}
