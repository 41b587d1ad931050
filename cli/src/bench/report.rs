//! What `hf bench` prints: one table row and one JSON line per point.

use serde_json::{Value, json};

use super::proto::{Outcome, Pattern};
use super::stats;

/// One measured point.
#[derive(Debug)]
pub(crate) struct Row {
    pub(crate) transport: String,
    pub(crate) pattern: Pattern,
    pub(crate) size: usize,
    pub(crate) outcome: Outcome,
    pub(crate) busy_poll: bool,
    pub(crate) zero_copy: bool,
    /// `--buffers`: distinct heap buffers the sender sent in turn.
    pub(crate) buffers: usize,
    /// `--device`, as given.
    pub(crate) device: Option<String>,
    pub(crate) offered: Option<f64>,
}

/// Latency percentiles in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Percentiles {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) p999: f64,
    pub(crate) max: f64,
}

impl Row {
    pub(crate) fn percentiles(&self) -> Option<Percentiles> {
        let h = self.outcome.latency.as_ref()?;
        let us = |ns: u64| ns as f64 / 1e3;
        Some(Percentiles {
            p50: us(h.value_at_quantile(0.5)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
        })
    }

    pub(crate) fn spread_pct(&self) -> Option<f64> {
        stats::spread_pct(&self.outcome.rates)
    }

    /// The line `--json` writes for this point.
    pub(crate) fn json(&self) -> Value {
        let o = &self.outcome;
        let lat = self.percentiles().map_or(
            Value::Null,
            |p| json!({"p50": p.p50, "p99": p.p99, "p999": p.p999, "max": p.max}),
        );
        json!({
            "transport": self.transport,
            "pattern": self.pattern.as_str(),
            "size": self.size,
            "messages": o.messages,
            "seconds": o.seconds,
            "msgs_per_s": o.msgs_per_s,
            "gbytes_per_s": o.gbytes_per_s,
            "lat_us": lat,
            // getrusage counts microseconds.
            "cpu": {"user_s": micro(o.cpu.user_s), "sys_s": micro(o.cpu.sys_s)},
            "busy_poll": self.busy_poll,
            "zero_copy": self.zero_copy,
            "buffers": self.buffers,
            "device": self.device,
            "verified": o.verified,
            "offered_msgs_per_s": self.offered,
            "per_second": o.rates,
            "spread_pct": self.spread_pct(),
        })
    }
}

fn micro(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// `n` bytes as a size label: `64 B`, `32 KiB`, `4 MiB`, or plain bytes when not exact.
pub(crate) fn size_label(n: usize) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{} {unit}", n >> shift);
        }
    }
    format!("{n} B")
}

/// A count per second with an SI prefix: `812`, `23.4 k`, `10.2 M`.
fn per_s(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Microseconds with three significant digits or so.
fn us(x: f64) -> String {
    if x < 10.0 {
        format!("{x:.2}")
    } else if x < 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.0}")
    }
}

/// CPU cost: per message for lat and rate, per GB for bandwidth.
fn cpu(row: &Row) -> String {
    let o = &row.outcome;
    let total = o.cpu.total();
    if row.pattern == Pattern::Bw {
        let gb = o.gbytes_per_s * o.seconds;
        if gb > 0.0 {
            return format!("{:.2} s/GB", total / gb);
        }
    } else if o.messages > 0 {
        return format!("{:.2} µs/msg", total / o.messages as f64 * 1e6);
    }
    "-".into()
}

pub(crate) const HEADER: &str = "transport  pattern     size      msgs/s      GB/s   p50 µs   p99 µs p99.9 µs   max µs           CPU  spread  checked";

/// The table row for a point.
pub(crate) fn line(row: &Row) -> String {
    let o = &row.outcome;
    let (p50, p99, p999, max) = match row.percentiles() {
        Some(p) => (us(p.p50), us(p.p99), us(p.p999), us(p.max)),
        None => ("-".into(), "-".into(), "-".into(), "-".into()),
    };
    let spread = row
        .spread_pct()
        .map_or_else(|| "-".into(), |s| format!("±{:.0}%", s / 2.0));
    let checked = if o.verified { "content" } else { "order" };
    format!(
        "{:<10} {:<7} {:>8} {:>11} {:>9.3} {:>8} {:>8} {:>8} {:>8} {:>13} {:>7}  {}",
        row.transport,
        row.pattern.as_str(),
        size_label(row.size),
        per_s(o.msgs_per_s),
        o.gbytes_per_s,
        p50,
        p99,
        p999,
        max,
        cpu(row),
        spread,
        checked,
    )
}

/// A row for a point that failed.
pub(crate) fn failed_line(transport: &str, pattern: Pattern, size: usize, why: &str) -> String {
    format!(
        "{:<10} {:<7} {:>8}  FAILED: {why}",
        transport,
        pattern.as_str(),
        size_label(size)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::stats::Cpu;

    fn row(pattern: Pattern, with_latency: bool) -> Row {
        let latency = with_latency.then(|| {
            let mut h = stats::histogram();
            for ns in 1..=1000u64 {
                stats::record(&mut h, ns * 1000); // 1 µs .. 1 ms
            }
            h
        });
        Row {
            transport: "shm".into(),
            pattern,
            size: 4 << 20,
            outcome: Outcome {
                messages: 1000,
                seconds: 2.0,
                msgs_per_s: 500.0,
                gbytes_per_s: 2.097152,
                latency,
                cpu: Cpu {
                    user_s: 1.5,
                    sys_s: 0.5,
                },
                rates: vec![490.0, 510.0],
                verified: true,
            },
            busy_poll: false,
            zero_copy: true,
            buffers: 8,
            device: None,
            offered: None,
        }
    }

    #[test]
    fn json_has_the_documented_fields() {
        let v = row(Pattern::Bw, false).json();
        for key in [
            "transport",
            "pattern",
            "size",
            "messages",
            "seconds",
            "msgs_per_s",
            "gbytes_per_s",
            "lat_us",
            "cpu",
            "busy_poll",
            "zero_copy",
            "buffers",
            "verified",
        ] {
            assert!(v.get(key).is_some(), "no {key} in {v}");
        }
        assert_eq!(v["pattern"], "bw");
        assert_eq!(v["size"], 4194304);
        assert!(v["lat_us"].is_null());
        assert_eq!(v["cpu"]["user_s"], 1.5);
        assert_eq!(v["zero_copy"], true);
        let s = v["spread_pct"].as_f64().unwrap();
        assert!((s - 4.0).abs() < 1e-9, "{s}");
    }

    #[test]
    fn latency_percentiles_in_microseconds() {
        let r = row(Pattern::Lat, true);
        let p = r.percentiles().unwrap();
        assert!((p.p50 - 500.0).abs() < 1.0, "{p:?}");
        assert!((p.p99 - 990.0).abs() < 1.0, "{p:?}");
        assert!((p.max - 1000.0).abs() < 1.0, "{p:?}");
        let v = r.json();
        assert!((v["lat_us"]["p999"].as_f64().unwrap() - 999.0).abs() < 1.0);
    }

    #[test]
    fn table_cells() {
        assert_eq!(size_label(64), "64 B");
        assert_eq!(size_label(32 << 10), "32 KiB");
        assert_eq!(size_label(4 << 20), "4 MiB");
        assert_eq!(size_label(1000), "1000 B");
        assert_eq!(per_s(10_234_567.0), "10.23 M");
        assert_eq!(per_s(23_456.0), "23.5 k");
        // 2 s of CPU for 2.097152 GB/s × 2 s: 0.48 s per GB.
        assert_eq!(cpu(&row(Pattern::Bw, false)), "0.48 s/GB");
        assert_eq!(cpu(&row(Pattern::Rate, false)), "2000.00 µs/msg");
        let l = line(&row(Pattern::Bw, false));
        assert!(l.starts_with("shm        bw         4 MiB"), "{l}");
        assert!(l.contains("±2%") && l.ends_with("content"), "{l}");
    }
}
