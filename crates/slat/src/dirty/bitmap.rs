//! The per-memslot dirty bitmap: one bit per 4 KiB page, set by faults, harvested by the VMM.

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use slat_addr::PageIndex;

/// One bit per page of a memslot.
#[derive(Debug)]
pub struct DirtyBitmap {
    words: Box<[AtomicU64]>,
    npages: u64,
}

impl DirtyBitmap {
    /// A bitmap for `npages` pages, all clear or (INITIALLY_SET) all set. Crate-only: the
    /// engine sizes it from a memslot (host memory that exists), never from a bare count.
    pub(crate) fn new(npages: u64, all_set: bool) -> Self {
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

    /// Word `i`, or a word of no pages past the end: every public accessor takes a caller's
    /// index, and one past the end reads as clean and marks nothing rather than panicking.
    #[inline]
    fn at(&self, i: usize) -> Option<&AtomicU64> {
        self.words.get(i)
    }

    /// 64-bit words.
    pub fn nwords(&self) -> usize {
        self.words.len()
    }

    /// Marks page `rel` (slot-relative) dirty. Skips the locked RMW when the bit is already
    /// set, which is the common case for a page written again before the next harvest.
    #[inline]
    pub fn set(&self, rel: PageIndex) {
        let rel = rel.raw();
        let Some(w) = self.at((rel / 64) as usize) else {
            return;
        };
        let bit = 1u64 << (rel % 64);
        if w.load(Ordering::Relaxed) & bit == 0 {
            // Release: the mark is ordered before the SPTE update that makes the page writable
            // (the CAS that follows is AcqRel anyway; this keeps the bitmap self-consistent).
            w.fetch_or(bit, Ordering::AcqRel);
        }
    }

    /// Marks page `rel` again after the SPTE update that made it writable, always with the
    /// locked RMW. A plain load that still sees the first mark may be reading a value a
    /// harvest has already taken away (nothing orders that harvest's exchange before the
    /// load); skipping the RMW then leaves the page writable with its bit clear. With the RMW,
    /// either the harvest's exchange comes later in this word's modification order and
    /// acquires our release, so it sees the writable entry and its rmap slot and protects it,
    /// or it came earlier and the bit is set again for the next harvest (the lockless
    /// write-protect series' order, writable → rmap → dirty bit, needs the last step to be a
    /// real write).
    #[inline]
    pub fn set_after_update(&self, rel: PageIndex) {
        let rel = rel.raw();
        let bit = 1u64 << (rel % 64);
        if let Some(w) = self.at((rel / 64) as usize) {
            w.fetch_or(bit, Ordering::AcqRel);
        }
    }

    /// Page `rel` is marked.
    pub fn test(&self, rel: PageIndex) -> bool {
        let rel = rel.raw();
        self.at((rel / 64) as usize)
            .is_some_and(|w| w.load(Ordering::Acquire) & (1u64 << (rel % 64)) != 0)
    }

    /// Reads word `i` without clearing it.
    #[inline]
    pub fn word(&self, i: usize) -> u64 {
        self.at(i).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Atomically reads and clears word `i` (GET_DIRTY_LOG's per-word exchange).
    #[inline]
    pub fn take_word(&self, i: usize) -> u64 {
        let Some(w) = self.at(i) else {
            return 0;
        };
        if w.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        w.swap(0, Ordering::AcqRel)
    }

    /// Reads and clears word `i` with a plain load and store: only for a bitmap no marker can
    /// reach any more (the inactive side of a [`SlotBitmap`] after a switch and a drain).
    #[inline]
    pub fn take_word_unshared(&self, i: usize) -> u64 {
        let Some(w) = self.at(i) else {
            return 0;
        };
        let v = w.load(Ordering::Relaxed);
        if v != 0 {
            w.store(0, Ordering::Relaxed);
        }
        v
    }

    /// Clears the bits of `mask` in word `i`; returns the bits that were actually set.
    #[inline]
    pub fn clear_bits(&self, i: usize, mask: u64) -> u64 {
        self.at(i)
            .map_or(0, |w| w.fetch_and(!mask, Ordering::AcqRel) & mask)
    }

    /// Number of set bits.
    pub fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum()
    }
}

/// A memslot's dirty log as the fault path sees it: the bitmap marks go to, and for the
/// bitmap-switch harvest ([`crate::GetLogVariant::Switch`]) a second bitmap that harvests
/// swap with it.
///
/// The switch harvest flips `active`, waits until no marker can still be writing to the old
/// side (see `Vm::get_dirty_log`), and then reads and clears the old side with plain loads and
/// stores instead of one atomic exchange per word.
#[derive(Debug)]
pub struct SlotBitmap {
    maps: [DirtyBitmap; 2],
    active: AtomicU32,
}

impl SlotBitmap {
    /// A log for `npages` pages; `initially_set` starts every bit set (manual protect with
    /// INITIALLY_SET); `switch` allocates the second bitmap.
    pub(crate) fn new(npages: u64, initially_set: bool, switch: bool) -> Self {
        SlotBitmap {
            maps: [
                DirtyBitmap::new(npages, initially_set),
                DirtyBitmap::new(if switch { npages } else { 0 }, false),
            ],
            active: AtomicU32::new(0),
        }
    }

    /// The bitmap marks go to now.
    #[inline]
    pub fn active(&self) -> &DirtyBitmap {
        &self.maps[self.active.load(Ordering::Acquire) as usize]
    }

    /// Marks page `rel` (slot-relative) in the active bitmap.
    #[inline]
    pub fn set(&self, rel: PageIndex) {
        self.active().set(rel)
    }

    /// [`DirtyBitmap::set_after_update`] on the active bitmap.
    #[inline]
    pub fn set_after_update(&self, rel: PageIndex) {
        self.active().set_after_update(rel)
    }

    /// Pages covered.
    pub fn npages(&self) -> u64 {
        self.maps[0].npages()
    }

    /// 64-bit words per bitmap.
    pub fn nwords(&self) -> usize {
        self.maps[0].nwords()
    }

    /// Has a second bitmap to switch to.
    pub fn can_switch(&self) -> bool {
        self.maps[1].nwords() == self.maps[0].nwords()
    }

    /// Makes the other bitmap active; returns the one marks went to until now. The caller
    /// serialises switches (the slots lock) and must drain markers before reading the result.
    pub(crate) fn switch(&self) -> &DirtyBitmap {
        debug_assert!(self.can_switch());
        let old = self.active.load(Ordering::Relaxed);
        self.active.store(1 - old, Ordering::SeqCst);
        &self.maps[old as usize]
    }

    /// Set bits in both bitmaps.
    pub fn count(&self) -> u64 {
        self.maps[0].count() + self.maps[1].count()
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
        b.set(PageIndex::new(3));
        b.set(PageIndex::new(64));
        assert!(b.test(PageIndex::new(3)));
        assert_eq!(b.take_word(0), 1 << 3);
        assert_eq!(b.take_word(0), 0);
        assert_eq!(b.clear_bits(1, 0b11), 0b01);
        assert_eq!(b.count(), 0);
    }
}
