//! Re-arming exactly what a harvest found, the cheapest way KVM offers.
//!
//! With manual protect, a harvest of k dirty pages re-arms them with CLEAR_DIRTY_LOG. One
//! CLEAR over the whole slot makes the kernel copy in and walk the slot's whole bitmap
//! (O(slot): 5.2 ms for a 512 MiB slot with every bit set, issue 18), while one CLEAR per
//! harvested 64-page chunk costs an ioctl each. [`clear_harvested_chunks`] issues one CLEAR
//! per run of harvested chunks, joining two chunks into one run when fewer than
//! [`CLEAR_GAP_WORDS`] clean words lie between them (walking a clean word in the kernel
//! costs a few nanoseconds, an ioctl about a microsecond). The ring needs no such choice: a
//! ring reset re-protects exactly the collected entries.

use slat_addr::PageIndex;

/// Clean 64-page words below which two harvested chunks share one CLEAR.
pub const CLEAR_GAP_WORDS: usize = 128;

/// Calls `clear(first page, pages, bitmap)` once per run of the harvested `words` (`(slot
/// word index, bits)`, in increasing index order as a harvest lists them; others are
/// sorted first) inside `first..first + pages`: each run starts at a word boundary and covers
/// whole words, except the last, which stops at `first + pages` (a CLEAR may end at the
/// slot's end only there). Runs are at most `scratch.len()` words (one word when `scratch`
/// is empty). Returns the number of calls.
pub fn clear_harvested_chunks<E>(
    first: PageIndex,
    pages: u64,
    words: &[(usize, u64)],
    scratch: &mut [u64],
    mut clear: impl FnMut(PageIndex, u64, &[u64]) -> Result<(), E>,
) -> Result<u64, E> {
    let (w0, end) = (first.raw().div_ceil(64), first.raw().saturating_add(pages));
    let mut inside: Vec<(usize, u64)> = words
        .iter()
        .copied()
        .filter(|&(i, bits)| {
            bits != 0 && (i as u64) >= w0 && (i as u64).checked_mul(64).is_some_and(|p| p < end)
        })
        .collect();
    if !inside.windows(2).all(|w| w[0].0 < w[1].0) {
        inside.sort_unstable_by_key(|&(i, _)| i);
    }
    let cap = scratch.len().max(1);
    let mut one = [0u64; 1];
    let mut calls = 0;
    let mut j = 0;
    while j < inside.len() {
        let start = inside[j].0;
        // Extend the run while the next harvested word is near enough and fits the buffer.
        let mut last = j;
        while let Some(&(next, _)) = inside.get(last + 1) {
            if next - inside[last].0 > CLEAR_GAP_WORDS || next - start >= cap {
                break;
            }
            last += 1;
        }
        let span = inside[last].0 - start + 1;
        let buf = if scratch.is_empty() {
            &mut one[..]
        } else {
            &mut scratch[..span]
        };
        buf.fill(0);
        for &(i, bits) in &inside[j..=last] {
            buf[i - start] |= bits;
        }
        let p0 = start as u64 * 64;
        let n = (span as u64 * 64).min(end - p0);
        clear(PageIndex::new(p0), n, buf)?;
        calls += 1;
        j = last + 1;
    }
    Ok(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_join_near_chunks_and_split_far_ones() {
        let mut scratch = vec![0u64; 1024];
        let words = [(0usize, 1u64), (2, 4), (500, 8), (511, 1 << 63)];
        let mut calls = Vec::new();
        let n = clear_harvested_chunks(
            PageIndex::new(0),
            512 * 64 - 10,
            &words,
            &mut scratch,
            |f, p, b: &[u64]| {
                calls.push((f.raw(), p, b.to_vec()));
                Ok::<(), ()>(())
            },
        )
        .unwrap();
        assert_eq!(n, 2);
        assert_eq!(calls[0], (0, 3 * 64, vec![1, 0, 4]));
        // The last run stops at the range's end, mid-word.
        assert_eq!(calls[1].0, 500 * 64);
        assert_eq!(calls[1].1, 512 * 64 - 10 - 500 * 64);
        assert_eq!(calls[1].2[0], 8);
    }

    #[test]
    fn an_empty_scratch_clears_word_by_word() {
        let words = [(3usize, 1u64), (4, 1)];
        let mut n_calls = 0;
        let n = clear_harvested_chunks(PageIndex::new(0), 1 << 20, &words, &mut [], |_, p, b| {
            assert!(p == 64 && b.len() == 1);
            n_calls += 1;
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!((n, n_calls), (2, 2));
    }
}
