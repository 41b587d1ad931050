//! What a measurement is made of: the body pattern and its check, CPU time from
//! `getrusage`, and the per-interval counts behind the spread.

use std::time::{Duration, Instant};

/// The word written at word `k` of every body: a constant pattern, so a receiver can check
/// any body without knowing which one it is. Messages carry their sequence number in the
/// header's correlation id, which catches reordering and loss.
/// (An XOR with the index, not a hash of it: the check must run at memory speed, so that it
/// measures the transport and not itself.)
#[inline]
fn word(k: usize) -> u64 {
    0x9E37_79B9_7F4A_7C15u64 ^ k as u64
}

/// Writes the pattern into `b`, word by word through the cache, as a producer computing its
/// data would (not `memset`, whose non-temporal stores would push a large body out to memory
/// just before the receiver reads it).
pub(crate) fn fill(b: &mut [u8]) {
    let base = (b.len() / 8) * 8;
    let mut words = b.chunks_exact_mut(8);
    for (k, w) in (&mut words).enumerate() {
        w.copy_from_slice(&word(k).to_le_bytes());
    }
    let tail = words.into_remainder();
    for (i, x) in tail.iter_mut().enumerate() {
        *x = (base + i) as u8;
    }
}

/// Whether `b` holds the pattern [`fill`] writes. Reads every byte, as a consumer would.
pub(crate) fn check(b: &[u8]) -> bool {
    // The differences are OR-ed together without an early exit: a loop the compiler
    // vectorizes, costing the same whatever the content, like reading it.
    let mut diff = 0u64;
    let mut words = b.chunks_exact(8);
    for (k, w) in (&mut words).enumerate() {
        diff |= u64::from_le_bytes(w.try_into().expect("chunks of 8")) ^ word(k);
    }
    let base = (b.len() / 8) * 8;
    for (i, &x) in words.remainder().iter().enumerate() {
        diff |= u64::from(x ^ (base + i) as u8);
    }
    diff == 0
}

/// Reads every word of `b` (a sum nobody looks at): what a receiver does with a body when
/// `--verify` is off, so that bandwidth always counts data that was read.
pub(crate) fn touch(b: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        s = s.wrapping_add(u64::from_le_bytes(w.try_into().expect("chunks of 8")));
    }
    s + words.remainder().iter().map(|&x| u64::from(x)).sum::<u64>()
}

/// User and system CPU seconds this process has used so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Cpu {
    pub(crate) user_s: f64,
    pub(crate) sys_s: f64,
}

impl Cpu {
    /// `getrusage(RUSAGE_SELF)`: every thread of this process, microsecond resolution.
    pub(crate) fn now() -> Cpu {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: `ru` points to writable memory of the size of `rusage`, which getrusage
        // fills; RUSAGE_SELF is a valid `who`, so the call cannot fail.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
        if rc != 0 {
            return Cpu::default();
        }
        // SAFETY: getrusage returned 0, so it initialised the whole struct (and zeroed()
        // already made every byte a valid value).
        let ru = unsafe { ru.assume_init() };
        let secs = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
        Cpu {
            user_s: secs(ru.ru_utime),
            sys_s: secs(ru.ru_stime),
        }
    }

    /// The CPU time used since `earlier`.
    pub(crate) fn since(self, earlier: Cpu) -> Cpu {
        Cpu {
            user_s: (self.user_s - earlier.user_s).max(0.0),
            sys_s: (self.sys_s - earlier.sys_s).max(0.0),
        }
    }

    pub(crate) fn plus(self, other: Cpu) -> Cpu {
        Cpu {
            user_s: self.user_s + other.user_s,
            sys_s: self.sys_s + other.sys_s,
        }
    }

    pub(crate) fn total(self) -> f64 {
        self.user_s + self.sys_s
    }
}

/// Counts per fixed interval from a start instant, for the per-second spread of a run.
#[derive(Debug)]
pub(crate) struct Intervals {
    start: Instant,
    width: Duration,
    counts: Vec<u64>,
}

impl Intervals {
    /// Intervals of one second, or a quarter of the run when it is shorter than 3 s (so
    /// that a short run still shows a spread).
    pub(crate) fn for_run(start: Instant, duration: Duration) -> Intervals {
        let width = if duration >= Duration::from_secs(3) {
            Duration::from_secs(1)
        } else {
            (duration / 4).max(Duration::from_millis(10))
        };
        Intervals {
            start,
            width,
            counts: Vec::new(),
        }
    }

    /// Counts `n` events at `at`.
    #[inline]
    pub(crate) fn add(&mut self, at: Instant, n: u64) {
        let i =
            (at.saturating_duration_since(self.start).as_nanos() / self.width.as_nanos()) as usize;
        // Bounded: a run ends after its duration, and the last partial interval is dropped.
        if i >= self.counts.len() {
            if i > 100_000 {
                return;
            }
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += n;
    }

    /// Events per second in each complete interval up to `end`.
    pub(crate) fn rates(&self, end: Instant) -> Vec<f64> {
        let full =
            (end.saturating_duration_since(self.start).as_nanos() / self.width.as_nanos()) as usize;
        let secs = self.width.as_secs_f64();
        self.counts
            .iter()
            .take(full)
            .map(|&n| n as f64 / secs)
            .collect()
    }
}

/// `(max - min) / mean` of `rates`, in percent; `None` with fewer than two intervals.
pub(crate) fn spread_pct(rates: &[f64]) -> Option<f64> {
    if rates.len() < 2 {
        return None;
    }
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    if mean <= 0.0 {
        return None;
    }
    let max = rates.iter().copied().fold(f64::MIN, f64::max);
    let min = rates.iter().copied().fold(f64::MAX, f64::min);
    Some((max - min) / mean * 100.0)
}

/// A latency histogram in nanoseconds, 3 significant digits, 1 ns to 100 s.
pub(crate) fn histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid bounds")
}

/// Records `ns`, clamped into the histogram's range.
#[inline]
pub(crate) fn record(h: &mut hdrhistogram::Histogram<u64>, ns: u64) {
    h.saturating_record(ns.max(1));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_checks_and_catches_damage() {
        for len in [0usize, 1, 7, 8, 9, 64, 4099] {
            let mut b = vec![0u8; len];
            fill(&mut b);
            assert!(check(&b), "len {len}");
            if len > 0 {
                b[len / 2] ^= 1;
                assert!(!check(&b), "len {len}: a flipped bit passed");
            }
        }
        // All zeroes (an unwritten buffer) is not the pattern.
        assert!(!check(&[0u8; 64]));
    }

    #[test]
    fn cpu_time_moves_forward() {
        let a = Cpu::now();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let d = Cpu::now().since(a);
        assert!(d.total() > 0.0, "{d:?}");
    }

    #[test]
    fn intervals_and_spread() {
        let t0 = Instant::now();
        let mut iv = Intervals::for_run(t0, Duration::from_secs(4));
        for k in 0..10 {
            iv.add(t0 + Duration::from_millis(100 * k), 1); // 10 in the first second
        }
        for k in 0..20 {
            iv.add(t0 + Duration::from_millis(1000 + 50 * k), 1); // 20 in the second
        }
        iv.add(t0 + Duration::from_millis(2500), 1); // a partial third
        let rates = iv.rates(t0 + Duration::from_millis(2600));
        assert_eq!(rates, [10.0, 20.0]);
        let s = spread_pct(&rates).unwrap();
        assert!((s - 66.666).abs() < 0.01, "{s}");
        assert_eq!(spread_pct(&[5.0]), None);
    }
}
