//! What the two-process benches share: the peer (this binary re-executed, announcing itself
//! with `READY` on stdout) and the per-function totals behind their ratio summaries.

// Each bench uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The peer process, killed when dropped.
pub(crate) struct Peer(Child);

impl Peer {
    /// Re-executes this binary with `envs` and waits until it prints `READY`. Blocking: call it
    /// off the runtime when that runtime must answer the peer's handshake.
    pub(crate) fn spawn(envs: &[(&str, &str)]) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .envs(envs.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "READY");
        Peer(child)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Seconds and items per (group, function).
static TOTALS: Mutex<BTreeMap<(String, String), (f64, u64)>> = Mutex::new(BTreeMap::new());

/// Adds one measurement of `items` in `elapsed`.
pub(crate) fn record(group: &str, func: &str, elapsed: Duration, items: u64) {
    let mut t = TOTALS.lock().unwrap();
    let e = t.entry((group.into(), func.into())).or_insert((0.0, 0));
    e.0 += elapsed.as_secs_f64();
    e.1 += items;
}

/// Items per second measured for (group, function).
pub(crate) fn per_second(group: &str, func: &str) -> Option<f64> {
    let t = TOTALS.lock().unwrap();
    t.get(&(group.into(), func.into()))
        .map(|(s, n)| *n as f64 / s)
}

/// Every (group, function) measured, with items per second.
pub(crate) fn all() -> Vec<(String, String, f64)> {
    let t = TOTALS.lock().unwrap();
    t.iter()
        .map(|((g, f), (s, n))| (g.clone(), f.clone(), *n as f64 / s))
        .collect()
}

/// The baseline of a bandwidth group: memcpy of `len` bytes between two buffers of this
/// process, recorded as (group, "memcpy").
pub(crate) fn bench_memcpy<M: criterion::measurement::Measurement<Value = Duration>>(
    g: &mut criterion::BenchmarkGroup<'_, M>,
    group: &str,
    len: usize,
) {
    let src = vec![7u8; len];
    let mut dst = vec![0u8; len];
    g.bench_function("memcpy", |b| {
        b.iter_custom(|n| {
            let start = Instant::now();
            for _ in 0..n {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
            }
            let d = start.elapsed();
            record(group, "memcpy", d, n);
            d
        })
    });
}
