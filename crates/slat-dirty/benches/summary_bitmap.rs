//! `SummaryBitmap` beside vm-memory's `AtomicBitmap` (its public API, 4 KiB pages):
//! marking 1 / 16 / 64 / 256 contiguous pages, and a harvest of 0 %, 0.1 %, 1 % and 100 %
//! dirty pages spread evenly over 1 GiB and 64 GiB bitmaps (`take_words` against
//! `get_and_reset` plus the scan of its result a VMM then does). `cargo bench -p slat-dirty`
//! (a few seconds per group; add a group name to run one).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use slat_dirty::{SummaryBitmap, SUMMARY_BITMAP_PAGE};
use std::hint::black_box;
use std::num::NonZeroUsize;
use std::time::{Duration, Instant};
use vm_memory::bitmap::AtomicBitmap;

const PAGE: usize = 4096;
const GIB: usize = 1 << 30;

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
}

fn atomic(bytes: usize) -> AtomicBitmap {
    AtomicBitmap::new(bytes, NonZeroUsize::new(PAGE).unwrap_or(NonZeroUsize::MIN))
}

fn summary(bytes: usize) -> SummaryBitmap {
    SummaryBitmap::new(bytes, SUMMARY_BITMAP_PAGE).expect("allocate the bitmap")
}

/// One write of `pages` pages at page 1024 (word-aligned) of a 1 GiB bitmap, as vm-memory's
/// `mark_dirty` does it after the copy.
fn mark(c: &mut Criterion) {
    let mut g = c.benchmark_group("mark");
    let (a, s) = (atomic(GIB), summary(GIB));
    for pages in [1usize, 16, 64, 256] {
        let (offset, len) = (1024 * PAGE, pages * PAGE);
        g.bench_function(BenchmarkId::new("AtomicBitmap", pages), |b| {
            b.iter(|| a.set_addr_range(black_box(offset), black_box(len)))
        });
        g.bench_function(BenchmarkId::new("SummaryBitmap", pages), |b| {
            b.iter(|| s.set_addr_range(black_box(offset), black_box(len)))
        });
    }
    g.finish();
}

/// Marks `fraction` of the pages, evenly spaced (at most one run of contiguous pages per
/// stride); untimed.
fn dirty(bytes: usize, fraction: f64, set: impl Fn(usize, usize)) {
    let pages = bytes / PAGE;
    if fraction >= 1.0 {
        set(0, bytes);
    } else if fraction > 0.0 {
        let stride = (1.0 / fraction) as usize;
        (0..pages).step_by(stride).for_each(|p| set(p * PAGE, PAGE));
    }
}

/// Times `iters` harvests, each after `dirty` (untimed).
fn timed(iters: u64, prepare: impl Fn(), harvest: impl Fn() -> u64) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        prepare();
        let t = Instant::now();
        black_box(harvest());
        total += t.elapsed();
    }
    total
}

fn harvest(c: &mut Criterion) {
    for (name, bytes) in [("1GiB", GIB), ("64GiB", 64 * GIB)] {
        let mut g = c.benchmark_group(format!("harvest/{name}"));
        // Each 100 % sample re-marks 16 M pages of AtomicBitmap one atomic at a time (untimed,
        // ~0.1 s): few, flat samples keep the group to seconds.
        g.sample_size(10)
            .sampling_mode(criterion::SamplingMode::Flat);
        let (a, s) = (atomic(bytes), summary(bytes));
        for (label, fraction) in [("0%", 0.0), ("0.1%", 0.001), ("1%", 0.01), ("100%", 1.0)] {
            g.bench_function(BenchmarkId::new("AtomicBitmap", label), |b| {
                b.iter_custom(|iters| {
                    let prepare = || dirty(bytes, fraction, |o, l| a.set_addr_range(o, l));
                    // The words come back as a whole-bitmap Vec; the VMM then scans it.
                    let take = || {
                        let words = a.get_and_reset();
                        words.iter().map(|w| u64::from(w.count_ones())).sum()
                    };
                    timed(iters, prepare, take)
                })
            });
            g.bench_function(BenchmarkId::new("SummaryBitmap", label), |b| {
                b.iter_custom(|iters| {
                    let prepare = || dirty(bytes, fraction, |o, l| s.set_addr_range(o, l));
                    let take = || {
                        let mut n = 0u64;
                        s.take_words(|_, w| n += u64::from(w.count_ones()));
                        n
                    };
                    timed(iters, prepare, take)
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = config();
    targets = mark, harvest
}
criterion_main!(benches);
