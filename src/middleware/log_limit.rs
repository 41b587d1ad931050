//! Rate limiting for warnings that a stream of messages could repeat many times a second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Lets one log line through per interval and counts those held back, so the next line can
/// say how many there were. Shared by the clones of one middleware; lock free.
#[derive(Debug)]
pub(crate) struct LogLimit {
    start: Instant,
    interval_ns: u64,
    /// Nanoseconds since `start` before which no line is let through; 0 lets the first one.
    next_ns: AtomicU64,
    held_back: AtomicU64,
}

impl LogLimit {
    pub(crate) fn new(interval: Duration) -> LogLimit {
        LogLimit {
            start: Instant::now(),
            interval_ns: interval.as_nanos().min(u64::MAX as u128) as u64,
            next_ns: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
        }
    }

    /// The interval.
    pub(crate) fn interval(&self) -> Duration {
        Duration::from_nanos(self.interval_ns)
    }

    /// `Some(held back since the last line)` when a line may be logged now.
    pub(crate) fn allow(&self) -> Option<u64> {
        self.allow_at(self.start.elapsed().as_nanos().min(u64::MAX as u128) as u64)
    }

    /// [`allow`](Self::allow) at `now` nanoseconds after creation.
    fn allow_at(&self, now: u64) -> Option<u64> {
        let next = self.next_ns.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ns
                .compare_exchange(
                    next,
                    now.saturating_add(self.interval_ns).max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.held_back.swap(0, Ordering::Relaxed));
        }
        self.held_back.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_passes_then_one_per_interval() {
        let l = LogLimit::new(Duration::from_secs(3600));
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
        let l = LogLimit::new(Duration::ZERO);
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), Some(0));
    }

    #[test]
    fn counts_what_it_held_back() {
        let l = LogLimit::new(Duration::from_nanos(100));
        assert_eq!(l.allow_at(10), Some(0));
        for t in [20, 50, 109] {
            assert_eq!(l.allow_at(t), None);
        }
        assert_eq!(l.allow_at(110), Some(3));
        assert_eq!(l.allow_at(150), None);
        assert_eq!(l.allow_at(210), Some(1));
    }
}
