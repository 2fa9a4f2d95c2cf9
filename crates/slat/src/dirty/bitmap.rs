//! The per-memslot dirty bitmap: one bit per 4 KiB page, set by faults, harvested by the VMM.

use crate::sync::{AtomicU64, Ordering};

/// One bit per page of a memslot.
#[derive(Debug)]
pub struct DirtyBitmap {
    words: Box<[AtomicU64]>,
    npages: u64,
}

impl DirtyBitmap {
    /// A bitmap for `npages` pages, all clear or (INITIALLY_SET) all set.
    pub fn new(npages: u64, all_set: bool) -> Self {
        let nwords = npages.div_ceil(64) as usize;
        let words: Box<[AtomicU64]> = (0..nwords)
            .map(|i| {
                let v = if !all_set {
                    0
                } else if (i as u64 + 1) * 64 <= npages {
                    u64::MAX
                } else {
                    (1u64 << (npages % 64)) - 1
                };
                AtomicU64::new(v)
            })
            .collect();
        DirtyBitmap { words, npages }
    }

    /// Pages covered.
    pub fn npages(&self) -> u64 {
        self.npages
    }

    /// 64-bit words.
    pub fn nwords(&self) -> usize {
        self.words.len()
    }

    /// Marks page `rel` (slot-relative) dirty. Skips the locked RMW when the bit is already
    /// set, which is the common case for a page written again before the next harvest.
    #[inline]
    pub fn set(&self, rel: u64) {
        let w = &self.words[(rel / 64) as usize];
        let bit = 1u64 << (rel % 64);
        if w.load(Ordering::Relaxed) & bit == 0 {
            // Release: the mark is ordered before the SPTE update that makes the page writable
            // (the CAS that follows is AcqRel anyway; this keeps the bitmap self-consistent).
            w.fetch_or(bit, Ordering::AcqRel);
        }
    }

    /// Page `rel` is marked.
    pub fn test(&self, rel: u64) -> bool {
        self.words[(rel / 64) as usize].load(Ordering::Acquire) & (1u64 << (rel % 64)) != 0
    }

    /// Reads word `i` without clearing it.
    #[inline]
    pub fn word(&self, i: usize) -> u64 {
        self.words[i].load(Ordering::Acquire)
    }

    /// Atomically reads and clears word `i` (GET_DIRTY_LOG's per-word exchange).
    #[inline]
    pub fn take_word(&self, i: usize) -> u64 {
        if self.words[i].load(Ordering::Relaxed) == 0 {
            return 0;
        }
        self.words[i].swap(0, Ordering::AcqRel)
    }

    /// Clears the bits of `mask` in word `i`; returns the bits that were actually set.
    #[inline]
    pub fn clear_bits(&self, i: usize, mask: u64) -> u64 {
        self.words[i].fetch_and(!mask, Ordering::AcqRel) & mask
    }

    /// Number of set bits.
    pub fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn initially_set_covers_exactly_the_slot() {
        let b = DirtyBitmap::new(130, true);
        assert_eq!(b.nwords(), 3);
        assert_eq!(b.count(), 130);
        assert_eq!(b.word(2), 0b11);
    }

    #[test]
    fn take_word_clears_and_returns() {
        let b = DirtyBitmap::new(128, false);
        b.set(3);
        b.set(64);
        assert!(b.test(3));
        assert_eq!(b.take_word(0), 1 << 3);
        assert_eq!(b.take_word(0), 0);
        assert_eq!(b.clear_bits(1, 0b11), 0b01);
        assert_eq!(b.count(), 0);
    }
}
