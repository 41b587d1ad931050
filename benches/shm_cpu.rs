//! The CPU cost of the `shm://` data path alone: both ends of one connection on one thread,
//! so that no cache line crosses cores and nothing waits — what is left is the work the
//! library does per message on each side (building the descriptor, checking it, building
//! the received `Message`). A 64 B message: `send` and `recv` one at a time (what the latency
//! path pays), and `feed` 64 then `recv` 64 (the rate path). Run with
//! `cargo bench --bench shm_cpu`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput};
use futures_util::SinkExt;
use hyperframes::{Context, Header, Message, MsgType};

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ctx = Context::builder()
        .shm_segment(4096, 4 << 20)
        .build()
        .unwrap();
    let url = format!("shm://bench-cpu-{}", std::process::id());
    let (mut a, mut b) = rt.block_on(async {
        let mut l = ctx.bind(&url).await.unwrap();
        let (a, b) = tokio::join!(ctx.connect(&url), l.accept());
        (a.unwrap(), b.unwrap())
    });
    let kind = MsgType::new("hf.bench.data").unwrap();
    let body = Bytes::from(vec![7u8; 64]);
    let msg = |seq: u64| {
        Message::from_parts(
            kind.clone(),
            Default::default(),
            body.clone().into(),
            Header {
                correlation: seq,
                ..Header::default()
            },
        )
    };
    let mut g = c.benchmark_group("shm_one_thread_64B");
    g.throughput(Throughput::Elements(1))
        .measurement_time(Duration::from_secs(3));
    g.bench_function("send_then_recv", |bench| {
        bench.iter_custom(|n| {
            rt.block_on(async {
                let t = Instant::now();
                for i in 0..n {
                    a.send(msg(i)).await.unwrap();
                    let m = b.recv().await.unwrap().unwrap();
                    assert_eq!(m.header().correlation, i);
                }
                t.elapsed()
            })
        })
    });
    g.bench_function("feed64_then_recv64", |bench| {
        bench.iter_custom(|n| {
            rt.block_on(async {
                let t = Instant::now();
                let mut i = 0;
                while i < n {
                    let k = (n - i).min(64);
                    for j in 0..k {
                        a.feed(msg(i + j)).await.unwrap();
                    }
                    a.flush().await.unwrap();
                    for j in 0..k {
                        let m = b.recv().await.unwrap().unwrap();
                        assert_eq!(m.header().correlation, i + j);
                    }
                    i += k;
                }
                t.elapsed()
            })
        })
    });
    g.finish();
    c.final_summary();
}
