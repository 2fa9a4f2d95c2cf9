//! A snapshot's copy of one region, holding only the pages that were not all zero, and the
//! per-page-or-full-copy crossover measured on this machine.
//!
//! Why sparse: a fuzzer's guest is mostly never-touched RAM. A dense copy of a 16 GiB guest
//! needs 16 GiB of host memory, and faulting it in; reading a never-touched anonymous page
//! maps the shared zero page, so a take that keeps only non-zero pages costs about the memory
//! the guest has really touched. A reset writes a zero page back by zeroing it.

use crate::snapshot::SnapshotError;
use slat_addr::{Hva, PAGE_SIZE};
use std::sync::OnceLock;
use std::time::Instant;

const PS: usize = PAGE_SIZE as usize;

/// `index` value of a page that was all zero when the snapshot was taken.
const ZERO: u32 = u32::MAX;

/// What a reset of an all-zero snapshot page reads: zeros.
pub(crate) static ZERO_PAGE: [u8; PS] = [0; PS];

/// Whether a page is all zero (an OR-reduction the compiler vectorises).
fn is_zero(page: &[u8]) -> bool {
    page.chunks(64)
        .all(|c| c.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// One region's contents at the snapshot: the non-zero pages, in page order.
#[derive(Debug)]
pub(crate) struct RegionCopy {
    /// Per page, its index in `data` (in pages), or [`ZERO`].
    index: Vec<u32>,
    /// The non-zero pages, back to back, in page order, from `data[start]`: a page boundary
    /// (a heap buffer starts 16 bytes past one, and a copy whose source straddles pages is
    /// measurably slower than an aligned one).
    data: Vec<u8>,
    start: usize,
}

impl RegionCopy {
    /// Copies the non-zero pages of `bytes` (a whole number of pages, the region at `addr`).
    pub(crate) fn take(bytes: &[u8], addr: Hva) -> Result<Self, SnapshotError> {
        let pages = bytes.len() / PS;
        if u32::try_from(pages).is_err() {
            return Err(SnapshotError::Region {
                addr,
                len: bytes.len() as u64,
                reason: "a snapshot region holds at most 2^32 - 1 pages",
            });
        }
        let mut index = Vec::new();
        index
            .try_reserve_exact(pages)
            .map_err(|_| SnapshotError::Alloc {
                bytes: (pages * 4) as u64,
            })?;
        let mut held = 0u32;
        for page in bytes.chunks_exact(PS) {
            if is_zero(page) {
                index.push(ZERO);
            } else {
                index.push(held);
                held += 1;
            }
        }
        // At most the region's size plus a page, which exists: no overflow.
        let len = held as usize * PS + PS;
        let mut data: Vec<u8> = Vec::new();
        data.try_reserve_exact(len)
            .map_err(|_| SnapshotError::Alloc { bytes: len as u64 })?;
        let start = data.as_ptr().align_offset(PS).min(PS);
        data.resize(start, 0);
        for (page, &i) in bytes.chunks_exact(PS).zip(&index) {
            if i != ZERO {
                data.extend_from_slice(page);
            }
        }
        Ok(RegionCopy { index, data, start })
    }

    /// Pages whose contents the copy holds (the non-zero ones).
    pub(crate) fn held_pages(&self) -> u64 {
        ((self.data.len() - self.start) / PS) as u64
    }

    /// Page `page` (in bounds) as snapshotted, and whether it was all zero.
    pub(crate) fn page(&self, page: u64) -> (&[u8], bool) {
        match self.index.get(page as usize) {
            Some(&i) if i != ZERO => {
                let start = self.start + i as usize * PS;
                (&self.data[start..start + PS], false)
            }
            _ => (&ZERO_PAGE, true),
        }
    }

    /// Runs of the region in page order: `(first page, pages, Some(bytes))` for consecutive
    /// held pages (consecutive in `data` too), `(first, pages, None)` for zero pages.
    pub(crate) fn runs(&self) -> impl Iterator<Item = (u64, u64, Option<&[u8]>)> + '_ {
        let n = self.index.len();
        let mut p = 0usize;
        std::iter::from_fn(move || {
            let first = p;
            let start = *self.index.get(first)?;
            p += 1;
            while p < n {
                let i = self.index[p];
                let continues = if start == ZERO {
                    i == ZERO
                } else {
                    i != ZERO && i as usize == start as usize + (p - first)
                };
                if !continues {
                    break;
                }
                p += 1;
            }
            let len = (p - first) as u64;
            let bytes = (start != ZERO).then(|| {
                let s = self.start + start as usize * PS;
                &self.data[s..s + len as usize * PS]
            });
            Some((first as u64, len, bytes))
        })
    }
}

/// Full copy over per-page copy, per page, as measured once in this process
/// ([`crossover_fraction`]).
static FRACTION: OnceLock<f64> = OnceLock::new();

/// The dirty fraction of a region above which copying all of it back costs less than copying
/// the dirty pages one by one: `full copy ns per page / per-page copy ns per page`, measured
/// once per process between two warm 4 MiB buffers (the first call takes a few
/// milliseconds). In `(0, 1]`; 1 means the full copy never wins.
pub fn crossover_fraction() -> f64 {
    *FRACTION.get_or_init(measure_fraction)
}

/// Pages measured per trial: 4 MiB, inside a typical L3 like a reset's working set.
const TRIAL_PAGES: usize = 1024;

fn measure_fraction() -> f64 {
    let mut src = vec![0x5au8; TRIAL_PAGES * PS];
    let mut dst = vec![0xa5u8; TRIAL_PAGES * PS];
    // A page order that defeats the prefetcher as a scattered dirty set does: stride 7
    // (coprime with the page count) through the buffer.
    let order: Vec<usize> = (0..TRIAL_PAGES).map(|i| (i * 7) % TRIAL_PAGES).collect();
    let (mut per_page, mut full) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        let t = Instant::now();
        for &p in &order {
            dst[p * PS..(p + 1) * PS].copy_from_slice(&src[p * PS..(p + 1) * PS]);
        }
        std::hint::black_box(&mut dst);
        per_page = per_page.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        full = full.min(t.elapsed().as_secs_f64());
        src[0] ^= 1;
    }
    if per_page <= 0.0 || !(full / per_page).is_finite() {
        return 1.0;
    }
    (full / per_page).clamp(0.01, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_non_zero_pages_and_runs_cover_the_region() {
        let mut bytes = vec![0u8; 6 * PS];
        for p in [1usize, 2, 4] {
            bytes[p * PS + 7] = p as u8;
        }
        let c = RegionCopy::take(&bytes, Hva::new(0)).unwrap();
        assert_eq!(c.held_pages(), 3);
        assert!(c.page(0).1 && !c.page(1).1 && c.page(5).1);
        assert_eq!(c.page(4).0[7], 4);
        let runs: Vec<(u64, u64, bool)> = c.runs().map(|(f, n, b)| (f, n, b.is_some())).collect();
        assert_eq!(
            runs,
            vec![
                (0, 1, false),
                (1, 2, true),
                (3, 1, false),
                (4, 1, true),
                (5, 1, false)
            ]
        );
    }

    #[test]
    fn crossover_is_a_fraction() {
        let f = crossover_fraction();
        assert!(f > 0.0 && f <= 1.0, "{f}");
    }
}
