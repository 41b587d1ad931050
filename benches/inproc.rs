//! `inproc://` between two tasks of one runtime: 64 B round trips and 64 B streaming, next to
//! a pair of `tokio::sync::mpsc` channels doing the same in the same group (the baseline: the
//! least an in-process message hop costs on tokio). Run with `cargo bench --bench inproc`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use hyperframes::{Channel, Context, Message};

const SMALL: [u8; 64] = [3; 64];

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A connected pair; the far end runs `peer` on its own task.
async fn pair<F, Fut>(name: &str, peer: F) -> Channel
where
    F: FnOnce(Channel) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let ctx = Context::new();
    let url = format!("inproc://{name}");
    let mut l = ctx.bind(&url).await.unwrap();
    let ch = ctx.connect(&url).await.unwrap();
    let far = l.accept().await.unwrap();
    tokio::spawn(peer(far));
    ch
}

fn message() -> Message {
    Message::new("bench.data")
        .unwrap()
        .with_body(Bytes::from_static(&SMALL))
}

fn bench_round_trip(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("inproc_round_trip_64B");
    g.sample_size(20).measurement_time(Duration::from_secs(3));
    let mut ch = rt.block_on(pair("rt", |mut far| async move {
        while let Some(Ok(m)) = far.recv().await {
            if far.send(m).await.is_err() {
                return;
            }
        }
    }));
    let msg = message();
    g.bench_function("hyperframes_inproc", |b| {
        b.iter_custom(|n| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..n {
                    ch.send(msg.clone()).await.unwrap();
                    black_box(ch.recv().await.unwrap().unwrap());
                }
                start.elapsed()
            })
        })
    });
    let (to_tx, mut to_rx) = tokio::sync::mpsc::channel::<Bytes>(1024);
    let (back_tx, mut back_rx) = tokio::sync::mpsc::channel::<Bytes>(1024);
    rt.spawn(async move {
        while let Some(b) = to_rx.recv().await {
            if back_tx.send(b).await.is_err() {
                return;
            }
        }
    });
    g.bench_function("tokio_mpsc_pair", |b| {
        b.iter_custom(|n| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..n {
                    to_tx.send(Bytes::from_static(&SMALL)).await.unwrap();
                    black_box(back_rx.recv().await.unwrap());
                }
                start.elapsed()
            })
        })
    });
    g.finish();
}

fn bench_stream(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("inproc_stream_64B");
    g.throughput(Throughput::Elements(1))
        .sample_size(20)
        .measurement_time(Duration::from_secs(3));
    // The peer counts what arrives and answers `bench.end` with the count.
    let mut ch = rt.block_on(pair("stream", |mut far| async move {
        let mut count = 0u64;
        while let Some(Ok(m)) = far.recv().await {
            if m.kind() == "bench.end" {
                let ack = Message::new("bench.ack")
                    .unwrap()
                    .with_body(count.to_le_bytes().to_vec());
                if far.send(ack).await.is_err() {
                    return;
                }
                count = 0;
            } else {
                count += 1;
            }
        }
    }));
    let msg = message();
    g.bench_function("hyperframes_inproc", |b| {
        b.iter_custom(|n| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..n {
                    ch.send(msg.clone()).await.unwrap();
                }
                ch.send(Message::new("bench.end").unwrap()).await.unwrap();
                let ack = ch.recv().await.unwrap().unwrap();
                let got =
                    u64::from_le_bytes(ack.body().as_bytes().unwrap()[..8].try_into().unwrap());
                assert_eq!(got, n);
                start.elapsed()
            })
        })
    });
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<Bytes>>(1024);
    let (ack_tx, mut ack_rx) = tokio::sync::mpsc::channel::<u64>(1);
    rt.spawn(async move {
        let mut count = 0u64;
        while let Some(item) = rx.recv().await {
            match item {
                Some(b) => {
                    black_box(b);
                    count += 1;
                }
                None => {
                    if ack_tx.send(count).await.is_err() {
                        return;
                    }
                    count = 0;
                }
            }
        }
    });
    g.bench_function("tokio_mpsc", |b| {
        b.iter_custom(|n| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..n {
                    tx.send(Some(Bytes::from_static(&SMALL))).await.unwrap();
                }
                tx.send(None).await.unwrap();
                assert_eq!(ack_rx.recv().await.unwrap(), n);
                start.elapsed()
            })
        })
    });
    g.finish();
}

criterion_group!(benches, bench_round_trip, bench_stream);
criterion_main!(benches);
