//! Write-latency percentiles in reports: a summary of an HDR histogram that every benchmark
//! renders the same way.

use serde::Serialize;
use slat_workload::LatencyHistogram;

/// Percentiles of one histogram of write latencies, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub max_ns: u64,
    pub mean_ns: f64,
}

impl LatencySummary {
    /// The percentiles of `h` (all zero when it is empty).
    pub fn of(h: &LatencyHistogram) -> LatencySummary {
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            p50_ns: h.value_at_quantile(0.50),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
            max_ns: h.max(),
            mean_ns: h.mean(),
        }
    }

    /// `n=…, p50 …, p99 …, p99.9 …, max …` with human units.
    pub fn line(&self) -> String {
        if self.count == 0 {
            return "no writes recorded".into();
        }
        format!(
            "n={}, p50 {}, p99 {}, p99.9 {}, max {}",
            self.count,
            ns(self.p50_ns),
            ns(self.p99_ns),
            ns(self.p999_ns),
            ns(self.max_ns)
        )
    }
}

/// A latency in the largest unit that keeps it readable.
pub fn ns(v: u64) -> String {
    match v {
        0..=9_999 => format!("{v} ns"),
        10_000..=9_999_999 => format!("{:.1} us", v as f64 / 1e3),
        _ => format!("{:.2} ms", v as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slat_workload::latency::{latency_histogram, record_latency};

    #[test]
    fn summarizes_and_renders() {
        let mut h = latency_histogram();
        assert_eq!(LatencySummary::of(&h).line(), "no writes recorded");
        for v in 1..=1000u64 {
            record_latency(&mut h, v * 1000);
        }
        let s = LatencySummary::of(&h);
        assert_eq!(s.count, 1000);
        assert!((499_000..=501_000).contains(&s.p50_ns), "{s:?}");
        assert!((989_000..=991_000).contains(&s.p99_ns), "{s:?}");
        assert!(s.max_ns >= 999_000);
        assert_eq!(ns(950), "950 ns");
        assert_eq!(ns(12_345), "12.3 us");
        assert_eq!(ns(12_345_678), "12.35 ms");
    }
}
