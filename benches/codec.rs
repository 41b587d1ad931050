//! The sans-IO codec alone: encoding frames into a write batch and decoding them from a
//! byte stream, per body size, next to a `memcpy` of the same bytes in the same group (the
//! floor any codec that touches the bytes pays). Run with `cargo bench --bench codec`.
//!
//! Large bodies are not copied by the encoder (they become iovecs of their own) nor by the
//! decoder (they become views of the read buffer), so for them the codec should beat memcpy
//! by far; for small ones the header work dominates.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use hyperframes::wire::{Batch, Decoder, Frame};
use hyperframes::{Limits, Message};

const SIZES: [usize; 4] = [64, 4 << 10, 64 << 10, 1 << 20];

fn message(size: usize) -> Message {
    Message::new("bench.codec")
        .unwrap()
        .with_meta("frame", "12345")
        .unwrap()
        .with_body(Bytes::from(vec![0xa5u8; size]))
}

/// Enough messages of `size` for about 4 MiB of stream (at least 4).
fn count(size: usize) -> usize {
    ((4 << 20) / size).max(4)
}

fn encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec_encode");
    for size in SIZES {
        let n = count(size);
        let msg = message(size);
        g.throughput(Throughput::Bytes((size * n) as u64));
        g.bench_with_input(BenchmarkId::new("hyperframes", size), &msg, |b, msg| {
            let mut batch = Batch::default();
            b.iter(|| {
                for _ in 0..n {
                    batch.push_message(msg.clone());
                }
                black_box(batch.take());
            })
        });
        let body = msg.body().as_bytes().unwrap().clone();
        g.bench_with_input(BenchmarkId::new("memcpy", size), &body, |b, body| {
            let mut dst = vec![0u8; body.len()];
            b.iter(|| {
                for _ in 0..n {
                    dst.copy_from_slice(body);
                    black_box(&dst);
                }
            })
        });
    }
    g.finish();
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec_decode");
    for size in SIZES {
        let n = count(size);
        let msg = message(size);
        let mut batch = Batch::default();
        for _ in 0..n {
            batch.push_message(msg.clone());
        }
        let stream: Vec<u8> = batch
            .take()
            .iter()
            .flat_map(|c| c.iter().copied())
            .collect();
        g.throughput(Throughput::Bytes((size * n) as u64));
        g.bench_with_input(
            BenchmarkId::new("hyperframes", size),
            &stream,
            |b, stream| {
                b.iter(|| {
                    let mut src = BytesMut::from(&stream[..]);
                    let mut dec = Decoder::new(Limits::default());
                    let mut got = 0;
                    while let Some(Frame::Message(m)) = dec.decode(&mut src).unwrap() {
                        black_box(&m);
                        got += 1;
                    }
                    assert_eq!(got, n);
                })
            },
        );
        g.bench_with_input(BenchmarkId::new("memcpy", size), &stream, |b, stream| {
            // The same copy the hyperframes case pays to fill its source buffer.
            b.iter(|| black_box(BytesMut::from(&stream[..])))
        });
    }
    g.finish();
}

criterion_group!(benches, encode, decode);
criterion_main!(benches);
