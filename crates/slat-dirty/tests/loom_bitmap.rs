//! Loom models of `SummaryBitmap`'s word/summary protocol (`src/summary_bitmap.rs`): a VMM
//! thread writes pages and marks them as vm-memory does (data first, then one `fetch_or` per
//! word and the summary step) while the host takes the bitmap. No mark may be lost — each
//! page is in this take or the next, exactly once — and a page taken is read after its write
//! (loom reports a data race on the page's cell if the take does not order the write before
//! the read). The marked range crosses a word and a level-1 summary word. Marks made before
//! the race either share the run's words, so every summary bit above them is set and the
//! word's RMW is all that orders the marker against the take, or sit in a sibling word, so
//! the take clears summary bits the marker may find still set.
//! `RUSTFLAGS="--cfg loom" cargo test -p slat-dirty --test loom_bitmap --release`.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;
use slat_dirty::SummaryBitmap;
use std::num::NonZeroUsize;

/// 66 words of page bits: two summary levels (2 words, then 1). One byte per page.
const PAGES: usize = 66 * 64;
/// The marker's run: pages 4094..4098, words 63 and 64 (level-1 words 0 and 1).
const RUN: std::ops::Range<usize> = 4094..4098;
/// In the run's words 63 and 64: their summary bits are set before the race.
const SAME_WORDS: [usize; 2] = [63 * 64, 64 * 64 + 10];
/// In word 65, a sibling of word 64 under level-1 word 1.
const SIBLING: [usize; 1] = [65 * 64 + 3];

/// The pages of the run, as guest memory: written by the marker, read by the harvest.
struct Memory {
    bitmap: SummaryBitmap,
    pages: Vec<UnsafeCell<u8>>,
}

// SAFETY: each page's cell is written only by the thread that owns the page and read by a
// harvest after it took the page's mark; loom checks that those accesses are ordered.
unsafe impl Sync for Memory {}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// The bitmap with `before` marked, and the run's pages unwritten.
fn memory(before: &[usize]) -> Arc<Memory> {
    let bitmap = SummaryBitmap::new(PAGES, NonZeroUsize::MIN).expect("a small bitmap");
    before.iter().for_each(|&p| bitmap.mark_pages(p, 1));
    let pages = RUN.map(|_| UnsafeCell::new(0)).collect();
    Arc::new(Memory { bitmap, pages })
}

/// Writes the run's pages, then marks them with one call (vm-memory's order).
fn write_run(m: &Memory, first: usize, count: usize) {
    for p in first..first + count {
        // SAFETY: only this thread writes the page; loom checks the harvest's read against it.
        m.pages[p - RUN.start].with_mut(|v| unsafe { *v = 1 });
    }
    m.bitmap.mark_pages(first, count);
}

/// Takes the bitmap; reads every page of the run it took, which must hold its write.
fn take(m: &Memory) -> Vec<usize> {
    let mut got = Vec::new();
    m.bitmap.take_words(|w, mut bits| {
        while bits != 0 {
            let p = w * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if RUN.contains(&p) {
                // SAFETY: a read loom orders against the marker's write (or reports the race).
                let v = m.pages[p - RUN.start].with(|v| unsafe { *v });
                assert_eq!(v, 1, "page {p} taken before its write");
            }
            got.push(p);
        }
    });
    got
}

/// Every page of the run and of `before` taken exactly once across `takes`.
fn exactly_once(before: &[usize], takes: Vec<Vec<usize>>) {
    let mut all: Vec<usize> = takes.into_iter().flatten().collect();
    all.sort_unstable();
    let mut expect: Vec<usize> = RUN.chain(before.iter().copied()).collect();
    expect.sort_unstable();
    assert_eq!(all, expect, "a mark lost or taken twice");
}

/// The marker writes and marks the whole run while the host takes, twice.
fn run_vs_take(before: &'static [usize]) {
    model(move || {
        let m = memory(before);
        let marker = {
            let m = m.clone();
            thread::spawn(move || write_run(&m, RUN.start, RUN.len()))
        };
        let first = take(&m);
        marker.join().unwrap();
        exactly_once(before, vec![first, take(&m)]);
    });
}

#[test]
fn a_run_across_words_with_marked_words_survives_a_take() {
    run_vs_take(&SAME_WORDS);
}

#[test]
fn a_run_across_words_beside_a_marked_sibling_survives_a_take() {
    run_vs_take(&SIBLING);
}

#[test]
fn two_markers_sharing_a_summary_bit_survive_a_take() {
    model(|| {
        let m = memory(&SAME_WORDS);
        // Pages 4094..4096 (word 63) and 4096..4098 (word 64) from two threads.
        let threads: Vec<_> = [(RUN.start, 2), (RUN.start + 2, 2)]
            .into_iter()
            .map(|(first, count)| {
                let m = m.clone();
                thread::spawn(move || write_run(&m, first, count))
            })
            .collect();
        let first = take(&m);
        for t in threads {
            t.join().unwrap();
        }
        exactly_once(&SAME_WORDS, vec![first, take(&m)]);
    });
}

#[test]
fn a_mark_survives_two_racing_takes() {
    model(|| {
        let m = memory(&SIBLING);
        let marker = {
            let m = m.clone();
            thread::spawn(move || write_run(&m, RUN.start + 2, 1))
        };
        let taker = {
            let m = m.clone();
            thread::spawn(move || take(&m))
        };
        let first = take(&m);
        marker.join().unwrap();
        let second = taker.join().unwrap();
        let mut all = vec![first, second, take(&m)];
        // Only page 4096 of the run was written here; count the rest as written too.
        all.push(vec![RUN.start, RUN.start + 1, RUN.start + 3]);
        exactly_once(&SIBLING, all);
    });
}
