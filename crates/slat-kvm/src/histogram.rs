//! The guest's write-latency histogram: the layout of each vCPU's histogram page, its buckets
//! (the guest code in [`crate::guest`] computes [`bucket`] in assembly), and its conversion
//! from TSC cycles into a nanosecond [`LatencyHistogram`].
//!
//! Buckets are log-linear in cycles: values below 16 have a bucket each; above, every power of
//! two `[2^m, 2^(m+1))` is split into 8 equal sub-buckets, so a bucket is never wider than 1/8
//! of the values in it (its midpoint is within 1/16 of any of them). With `s = msb(v) - 3` for
//! `v >= 16` (0 below), `bucket(v) = 8 s + (v >> s)`: `v >> s` is in `[8, 16)`, its low three
//! bits the sub-bucket. That is four instructions in the guest (`bsr`, `sub`, `shr`, `lea`) and
//! covers every u64 in [`BUCKETS`] = 496 buckets, whose counters fit one 4 KiB page.

use slat_workload::latency::{latency_histogram, record_latency, record_latency_n};
use slat_workload::LatencyHistogram;
use std::num::NonZeroU32;

/// Buckets per histogram: `bucket(u64::MAX) + 1`.
pub const BUCKETS: usize = 496;
/// Values below this have a bucket of their own.
pub const EXACT: u64 = 16;
/// Byte offset in the histogram page of bucket 0's counter (bucket `i` at `8 i`; all u64).
pub const COUNTS: u64 = 0;
/// Byte offset of the largest cycle count the guest measured.
pub const MAX: u64 = COUNTS + BUCKETS as u64 * 8;
/// Bytes of the page the host zeroes before a timed workload (counters and max).
pub const USED: u64 = MAX + 8;
/// Bytes per vCPU histogram page.
pub const PAGE: u64 = slat_addr::PAGE_SIZE;

const _: () = assert!(USED <= PAGE);

/// The bucket of `cycles` (the guest's assembly computes exactly this).
pub fn bucket(cycles: u64) -> usize {
    if cycles < EXACT {
        return cycles as usize;
    }
    let s = 63 - cycles.leading_zeros() - 3;
    (8 * s as u64 + (cycles >> s)) as usize
}

/// The values bucket `idx` holds, `lo..=hi`; `None` past the last bucket.
pub fn bucket_range(idx: usize) -> Option<(u64, u64)> {
    if idx >= BUCKETS {
        return None;
    }
    let idx = idx as u64;
    if idx < EXACT {
        return Some((idx, idx));
    }
    // idx = 8 s + q with q = v >> s in [8, 16): s = idx / 8 - 1.
    let s = idx / 8 - 1;
    let lo = (idx - 8 * s) << s;
    Some((lo, lo + ((1u64 << s) - 1)))
}

/// The value a count in bucket `idx` stands for: its midpoint (0 past the last bucket).
pub fn bucket_value(idx: usize) -> u64 {
    bucket_range(idx).map_or(0, |(lo, hi)| lo + (hi - lo) / 2)
}

/// `cycles` of a TSC ticking at `tsc_khz` kHz in nanoseconds (rounded down, saturating).
pub fn cycles_to_ns(cycles: u64, tsc_khz: NonZeroU32) -> u64 {
    let ns = u128::from(cycles) * 1_000_000 / u128::from(tsc_khz.get());
    u64::try_from(ns).unwrap_or(u64::MAX)
}

/// The nanosecond histogram of one vCPU's guest histogram: `counts[i]` writes at bucket `i`'s
/// midpoint, except in the bucket holding `max_cycles`: one write there is recorded as exactly
/// `max_cycles`, the others at the midpoint of the part of the bucket up to it (no write took
/// longer than the max). The words come from guest memory, so nothing about them is trusted:
/// counts past [`BUCKETS`] are ignored, sums saturate, and a `max_cycles` whose bucket is empty
/// (the guest never wrote it consistently) is left out rather than invented.
pub fn to_latency(counts: &[u64], max_cycles: u64, tsc_khz: NonZeroU32) -> LatencyHistogram {
    let mut h = latency_histogram();
    let max_bucket = bucket(max_cycles);
    let exact_max = counts.get(max_bucket).is_some_and(|&n| n > 0);
    for (i, &n) in counts.iter().enumerate().take(BUCKETS) {
        let (n, cycles) = match bucket_range(i) {
            Some((lo, _)) if exact_max && i == max_bucket => (n - 1, lo + (max_cycles - lo) / 2),
            _ => (n, bucket_value(i)),
        };
        record_latency_n(&mut h, cycles_to_ns(cycles, tsc_khz), n);
    }
    if exact_max {
        record_latency(&mut h, cycles_to_ns(max_cycles, tsc_khz));
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values around every bucket edge, and some in between.
    fn samples() -> Vec<u64> {
        let mut v: Vec<u64> = (0..1024).collect();
        for m in 4..64 {
            for k in 0..8u64 {
                let edge = (8 + k) << (m - 3);
                v.extend([edge - 1, edge, edge + 1, edge + (1 << (m - 3)) / 2]);
            }
        }
        v.extend([u64::MAX - 1, u64::MAX, 1 << 63, (1 << 63) - 1]);
        v.sort_unstable();
        v.dedup();
        v
    }

    #[test]
    fn buckets_are_monotonic_and_hold_their_values() {
        let mut last = 0;
        for v in samples() {
            let b = bucket(v);
            assert!(b >= last, "bucket({v}) = {b} < {last}");
            last = b;
            let (lo, hi) = bucket_range(b).unwrap();
            assert!(lo <= v && v <= hi, "{v} not in bucket {b} = {lo}..={hi}");
            let mid = bucket_value(b);
            assert!(lo <= mid && mid <= hi);
            // Relative error of the midpoint at most 1/16 (the width at most 1/8 of lo).
            assert!((hi - lo) <= lo / 8, "bucket {b} = {lo}..={hi} too wide");
            assert!(mid.abs_diff(v) <= v / 16, "{v} -> {mid}");
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        assert_eq!(bucket_range(BUCKETS), None);
    }

    #[test]
    fn buckets_tile_the_u64_range() {
        let mut next = 0u64;
        for b in 0..BUCKETS {
            let (lo, hi) = bucket_range(b).unwrap();
            assert_eq!(lo, next, "gap before bucket {b}");
            assert_eq!((bucket(lo), bucket(hi)), (b, b));
            next = hi.wrapping_add(1);
        }
        assert_eq!(next, 0, "the last bucket ends at u64::MAX");
    }

    #[test]
    fn conversion_keeps_counts_and_the_exact_max() {
        let khz = NonZeroU32::new(2_000_000).unwrap(); // 2 GHz: 2 cycles per ns
        let mut counts = vec![0u64; BUCKETS];
        counts[bucket(40)] = 10;
        counts[bucket(200_000)] = 2; // 100 µs
        let h = to_latency(&counts, 200_001, khz);
        assert_eq!(h.len(), 12);
        // The max is exact, and the other write of its bucket is not recorded above it.
        assert!(h.equivalent(h.max(), 100_000));
        assert_eq!(h.count_at(100_000), 1);
        assert_eq!(h.count_between(99_000, 99_300), 1);
        assert!(h.equivalent(h.min(), 20));
        // An inconsistent max (its bucket is empty) is left out; garbage counts saturate.
        let h = to_latency(&counts, 1 << 40, khz);
        assert_eq!(h.len(), 12);
        let mut junk = vec![u64::MAX; BUCKETS + 5];
        junk[0] = 3;
        let h = to_latency(&junk, u64::MAX, NonZeroU32::MIN);
        assert!(!h.is_empty());
        assert_eq!(cycles_to_ns(u64::MAX, NonZeroU32::MIN), u64::MAX);
    }
}
