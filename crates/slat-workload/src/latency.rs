//! Write latencies as a vCPU sees them, in nanoseconds, kept in HDR histograms so percentiles
//! are exact to three significant digits whatever the range (a fast-path write is tens of
//! nanoseconds, a write stalled behind a harvest can be milliseconds).
//!
//! What is recorded depends on what the machine can see: the simulated machine times each write
//! that took a fault (fault latency, entry to the write's completion); a real guest cannot tell
//! which of its writes exited, so it times every write with the TSC and the histogram holds all
//! of them (see [`WriteLatency`]).

use hdrhistogram::Histogram;

/// One vCPU's write latencies in nanoseconds.
pub type LatencyHistogram = Histogram<u64>;

/// The largest latency recorded exactly (one hour); longer ones are clamped to it.
pub const MAX_LATENCY_NS: u64 = 3_600_000_000_000;

/// An empty histogram covering 1 ns ..= [`MAX_LATENCY_NS`] with three significant digits.
pub fn latency_histogram() -> LatencyHistogram {
    // The bounds are constants that satisfy the crate's rules (low >= 1, high >= 2 * low,
    // sigfig <= 5), so construction cannot fail; fall back to an auto-resizing one regardless
    // rather than panic.
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3)
        .or_else(|_| Histogram::new(3))
        .unwrap_or_else(|_| Histogram::new(0).expect("sigfig 0 is always valid"))
}

/// Records `ns` once, clamping to the histogram's range (never fails, never panics).
pub fn record_latency(h: &mut LatencyHistogram, ns: u64) {
    let v = ns.clamp(1, MAX_LATENCY_NS);
    // `saturating_record` cannot fail within the bounds; it exists for auto-resizing ones.
    h.saturating_record(v);
}

/// Records `count` occurrences of `ns` (a guest's bucketed histogram, converted).
pub fn record_latency_n(h: &mut LatencyHistogram, ns: u64, count: u64) {
    if count == 0 {
        return;
    }
    let v = ns.clamp(1, MAX_LATENCY_NS);
    if h.record_n(v, count).is_err() {
        // Only a counter overflow can fail here; saturate instead.
        let _ = h.record_n(v, u64::MAX - h.len());
    }
}

/// What a machine measured as write latency, named so reports can say which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteLatency {
    /// Only writes that took a fault, from the fault's start to the write's completion
    /// (the simulated machine).
    Faults,
    /// Every write, timed by the guest itself with the TSC (a real guest).
    AllWrites,
}

impl WriteLatency {
    /// What the histogram holds, for reports.
    pub fn describe(self) -> &'static str {
        match self {
            WriteLatency::Faults => "faulting writes",
            WriteLatency::AllWrites => "every write, timed in-guest with the TSC",
        }
    }
}

/// Merges per-vCPU histograms into one.
pub fn merged(hs: &[LatencyHistogram]) -> LatencyHistogram {
    let mut all = latency_histogram();
    for h in hs {
        // Same bounds on both sides, so adding cannot fail; an error would only drop counts
        // that were out of range, which `record_latency` never lets in.
        let _ = all.add(h);
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_clamp_and_merge() {
        let mut a = latency_histogram();
        record_latency(&mut a, 0);
        record_latency(&mut a, 1_000);
        record_latency(&mut a, u64::MAX);
        let mut b = latency_histogram();
        record_latency_n(&mut b, 50_000, 3);
        record_latency_n(&mut b, 7, 0);
        let m = merged(&[a, b]);
        assert_eq!(m.len(), 6);
        assert_eq!(m.min(), 1);
        assert!(m.max() >= MAX_LATENCY_NS && m.max() <= MAX_LATENCY_NS + MAX_LATENCY_NS / 500);
        let p50 = m.value_at_quantile(0.5);
        assert!((49_950..=50_050).contains(&p50), "p50 {p50}");
    }
}
