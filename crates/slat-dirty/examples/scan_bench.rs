//! How fast [`slat_dirty::ranges`] scans bitmaps the size of a 512 GiB guest's (16 MiB of
//! bitmap: 2^27 pages of 4 KiB): clean (GB/s of bitmap scanned), fully dirty (one run), and
//! half dirty in alternating bits (the worst case: one run per page pair).
//!
//! `cargo run --release -p slat-dirty --example scan_bench [GiB of guest]` (12288 GiB = 12 TiB
//! gives a 384 MiB bitmap, larger than any cache).

use std::hint::black_box;
use std::time::Instant;

fn time(label: &str, words: &[u64], pages: u64, reps: u32) {
    let mut best = f64::INFINITY;
    let mut runs = 0;
    for _ in 0..reps {
        let t = Instant::now();
        let (n, sum) = slat_dirty::ranges(black_box(words), pages)
            .fold((0u64, 0u64), |(n, s), (_, len)| (n + 1, s + len));
        let dt = t.elapsed().as_secs_f64();
        black_box(sum);
        runs = n;
        best = best.min(dt);
    }
    let bytes = words.len() as f64 * 8.0;
    println!(
        "{label:<22} {:>8.3} ms  {:>7.1} GB/s of bitmap  ({runs} runs, best of {reps})",
        best * 1e3,
        bytes / best / 1e9
    );
}

fn main() {
    let gib: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(512);
    let pages = gib << (30 - 12);
    let words = pages.div_ceil(64) as usize;
    println!(
        "guest of {gib} GiB: {pages} pages, bitmap of {} MiB",
        (words * 8) >> 20
    );
    // Written, not just allocated: untouched zeroed memory maps one shared zero page, which
    // would stay in L1 and flatter the scan.
    let mut clean = vec![1u64; words];
    clean.iter_mut().for_each(|w| *w = black_box(0));
    time("0% dirty", &clean, pages, 20);
    let full = vec![u64::MAX; words];
    time("100% dirty", &full, pages, 20);
    let sparse: Vec<u64> = (0..words)
        .map(|i| if i % 4096 == 0 { 1 } else { 0 })
        .collect();
    time("1 page per 1 MiB word", &sparse, pages, 20);
    let half = vec![0x5555_5555_5555_5555u64; words];
    time("50% (alternate pages)", &half, pages, 3);
}
