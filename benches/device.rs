//! The staging pipeline of device bodies (feature `cuda`) against a plain copy: a 64 MiB
//! body from the stand-in device (host memory, copies on a thread of its own) staged in
//! chunks through the pooled buffers, as a channel stages it, versus one `memcpy` of 64 MiB.
//! The ratio shows whether the pipeline (chunking, pool, completions, hand-over) costs more
//! than the copies themselves.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use hyperframes::device::{Gpu, Staging};

const LEN: usize = 64 << 20;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let src = vec![7u8; LEN];
    let mut g = c.benchmark_group("device_staging_64MiB");
    g.throughput(Throughput::Bytes(LEN as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));

    let mut dst = vec![0u8; LEN];
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });

    for chunk in [256 << 10, 1 << 20, 4 << 20] {
        let gpu = Gpu::stand_in()
            .with_staging(Staging { chunk, buffers: 8 })
            .unwrap();
        let body = gpu.upload(&src).unwrap();
        g.bench_function(format!("staged_{}KiB", chunk >> 10), |b| {
            b.iter(|| {
                rt.block_on(hyperframes::device::stage_into(body.clone(), |piece| {
                    black_box(&piece);
                }))
                .unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
