//! The `shm://` descriptor ring alone, between two threads: push (write + publish) and pop
//! (read + free) of one 128-byte descriptor at a time, next to crossbeam's `ArrayQueue` of
//! the same 128-byte items in the same group (a well-tuned bounded MPMC queue: the baseline).
//! Run with `cargo bench --bench ring`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use crossbeam_queue::ArrayQueue;
use hyperframes::bench_support::ring;

const CAPACITY: usize = 4096;

/// Pushes `n` items through a queue from this thread to a consumer thread; the time until the
/// consumer has popped the last one.
fn transfer<P, C>(n: u64, mut push: P, mut pop: C) -> Duration
where
    P: FnMut(u64) -> bool,
    C: FnMut() -> Option<u64> + Send + 'static,
{
    let consumer = std::thread::spawn(move || {
        let mut expected = 0u64;
        while expected < n {
            match pop() {
                Some(v) => {
                    assert_eq!(v, expected, "out of order");
                    expected += 1;
                }
                None => std::hint::spin_loop(),
            }
        }
    });
    let start = Instant::now();
    for i in 0..n {
        while !push(i) {
            std::hint::spin_loop();
        }
    }
    consumer.join().unwrap();
    start.elapsed()
}

fn bench_spsc(c: &mut Criterion) {
    let mut g = c.benchmark_group("ring_spsc_128B");
    g.throughput(Throughput::Elements(1))
        .sample_size(20)
        .measurement_time(Duration::from_secs(3));
    g.bench_function("hyperframes_ring", |b| {
        b.iter_custom(|n| {
            let (mut p, mut c) = ring(CAPACITY);
            transfer(n, |v| p.try_push(black_box(v)), move || c.try_pop())
        })
    });
    g.bench_function("crossbeam_array_queue", |b| {
        b.iter_custom(|n| {
            let q = Arc::new(ArrayQueue::<[u64; 16]>::new(CAPACITY));
            let qc = q.clone();
            transfer(
                n,
                |v| {
                    let mut item = [0u64; 16];
                    item[0] = black_box(v);
                    q.push(item).is_ok()
                },
                move || qc.pop().map(|item| item[0]),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench_spsc);
criterion_main!(benches);
