//! The per-memslot dirty bitmap: one bit per 4 KiB page, set by faults, harvested by the VMM,
//! with summary levels above it so that a harvest reads only the words that hold marks.
//!
//! # Summary levels
//!
//! `levels[0]` is the bitmap; bit `b` of word `j` of `levels[n + 1]` says that word
//! `64 j + b` of `levels[n]` may hold marks. Levels are added until one has a single word, so
//! a 16 GiB slot (65 536 words) has three summary levels of 1024, 16 and 1 words, a 1 TiB
//! slot four. A harvest starts at the top word and descends only into words whose summary
//! bit it took: k dirty pages cost O(k × levels) words, not O(slot size); markers pay one
//! more load per first mark of a word (the summary bit is usually set already).
//!
//! The protocol, in three rules:
//! 1. A marker sets a bit with an `AcqRel` read-modify-write, then *summarises*: it loads the
//!    summary bit above and, if it is clear, sets it with an `AcqRel` RMW and goes on to the
//!    next level; it stops at a level whose bit it sees set.
//! 2. A harvest by exchange clears a summary bit only by an `AcqRel` swap of the summary word,
//!    and then swaps every word below a bit it cleared, even one it expects to be zero.
//! 3. CLEAR (manual protection) clears a summary bit only after its RMW left the word below
//!    zero; it then re-reads that word with an `AcqRel` RMW (`fetch_or(0)`) and sets the
//!    summary bit back (rule 1) if the word holds a mark.
//!
//! Why no mark is lost (when marking and harvesting stop, every set bit has its summary bit
//! set, so the next harvest finds it): take a marker's RMW `m` on a word, followed by its load
//! `l` of the summary bit, and the last clear `c` of that bit. The harvest or CLEAR that did
//! `c` then did an RMW `r` on the word (rule 2's swap, rule 3's re-read). If `r` follows `m`
//! in the word's modification order, `r` saw the mark: the harvest returned it, or CLEAR set
//! the summary bit back. If `r` precedes `m`, `m` reads from `r` or from an RMW after it
//! (every write to a shared word is an RMW), so `m` acquires `r`'s release and `c` happens
//! before `l`: `l` sees `c` or a later set, so the marker sets the bit itself or sees one set
//! after `c`, which stays. Both operations on the word must be RMWs for this: with a plain
//! load in either place, `m`/`l` against `c`/`r` is the store-buffering pattern, and both
//! sides may read the old values (the marker sees the stale summary bit, the harvest or CLEAR
//! sees the word still zero). `tests/loom_summary.rs` reports the lost mark when CLEAR's
//! re-read is a load; GET's case needs a summary bit left set over an emptied word by an
//! earlier race first, more preemptions than the models explore, so it rests on this
//! argument. The same argument holds level by level up to the top.
//!
//! The marker's skip (a word whose bit a load finds set takes no RMW and no summary step) is
//! the pre-update mark's (invariant 3): that bit was set by an RMW whose marker summarises
//! it, and [`DirtyBitmap::set_after_update`], which always takes the RMW and summarises, is
//! what invariant 4 relies on. A harvest that loads a summary word as zero and skips its swap
//! clears nothing, so it can only miss marks concurrent with it, which stay for the next.

use crate::clock::{Clock, RealTime};
use crate::sync::{self, AtomicU32, AtomicU64, Ordering};
use slat_addr::PageIndex;

/// One bit per page of a memslot, and the summary levels above them.
#[derive(Debug)]
pub struct DirtyBitmap {
    /// `levels[0]`: one bit per page; `levels[n + 1]`: one bit per word of `levels[n]`, up to
    /// a level of one word (a bitmap of at most one word has no summary).
    levels: Box<[Box<[AtomicU64]>]>,
    npages: u64,
}

/// How a harvest reads a word on its way down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
    /// Load only (manual protection's GET copies).
    Copy,
    /// Atomic exchange with zero (GET by exchange).
    Take,
    /// Load and store zero: a bitmap no marker can reach (the old side of a switch).
    TakeUnshared,
}

/// Word `i` of a level of `n` bits (or of `n` words of the level below), all bits of it that
/// exist set.
fn full_word(i: usize, n: u64) -> u64 {
    let done = i as u64 * 64;
    if done + 64 <= n {
        u64::MAX
    } else {
        (1u64 << (n - done)) - 1
    }
}

impl DirtyBitmap {
    /// A bitmap for `npages` pages, all clear or (INITIALLY_SET) all set. Crate-only: the
    /// engine sizes it from a memslot (host memory that exists), never from a bare count.
    pub(crate) fn new(npages: u64, all_set: bool) -> Self {
        let level = |bits: u64| -> Box<[AtomicU64]> {
            (0..bits.div_ceil(64) as usize)
                .map(|i| AtomicU64::new(if all_set { full_word(i, bits) } else { 0 }))
                .collect()
        };
        let mut levels = vec![level(npages)];
        while let Some(below) = levels.last().map(|l| l.len()).filter(|&n| n > 1) {
            levels.push(level(below as u64));
        }
        DirtyBitmap {
            levels: levels.into_boxed_slice(),
            npages,
        }
    }

    /// Pages covered.
    pub fn npages(&self) -> u64 {
        self.npages
    }

    /// The page bits.
    #[inline]
    fn bits(&self) -> &[AtomicU64] {
        self.levels.first().map_or(&[], |l| l)
    }

    /// Word `i` of `level`, or none past the end: every public accessor takes a caller's
    /// index, and one past the end reads as clean and marks nothing rather than panicking.
    #[inline]
    fn at(&self, level: usize, i: usize) -> Option<&AtomicU64> {
        self.levels.get(level).and_then(|l| l.get(i))
    }

    /// 64-bit words of page bits.
    pub fn nwords(&self) -> usize {
        self.bits().len()
    }

    /// Summary levels above the page bits.
    pub fn summary_levels(&self) -> usize {
        self.levels.len().saturating_sub(1)
    }

    /// Marks page `rel` (slot-relative) dirty. Skips the locked RMW when the bit is already
    /// set, which is the common case for a page written again before the next harvest (the
    /// module documentation says why the summary may be skipped with it).
    #[inline]
    pub fn set(&self, rel: PageIndex) {
        self.set_c::<RealTime>(rel)
    }

    /// [`Self::set`], reported to clock `C`.
    #[inline]
    pub(crate) fn set_c<C: Clock>(&self, rel: PageIndex) {
        let rel = rel.raw();
        let i = (rel / 64) as usize;
        let Some(w) = self.at(0, i) else {
            return;
        };
        let bit = 1u64 << (rel % 64);
        if sync::load::<C, _>(w, Ordering::Relaxed) & bit == 0 {
            // Release: the mark is ordered before the SPTE update that makes the page writable
            // (the CAS that follows is AcqRel anyway; this keeps the bitmap self-consistent).
            sync::fetch_or::<C, _>(w, bit, Ordering::AcqRel);
            self.summarise::<C>(0, i);
        }
    }

    /// Marks page `rel` again after the SPTE update that made it writable, always with the
    /// locked RMW. A plain load that still sees the first mark may be reading a value a
    /// harvest has already taken away (nothing orders that harvest's exchange before the
    /// load); skipping the RMW then leaves the page writable with its bit clear. With the RMW,
    /// either the harvest's exchange comes later in this word's modification order and
    /// acquires our release, so it sees the writable entry and its rmap slot and protects it,
    /// or it came earlier and the bit is set again, and summarised, for the next harvest
    /// (the lockless write-protect's order, writable → rmap → dirty bit, needs the last step to
    /// be a real write).
    #[inline]
    pub fn set_after_update(&self, rel: PageIndex) {
        self.set_after_update_c::<RealTime>(rel)
    }

    /// [`Self::set_after_update`], reported to clock `C`.
    #[inline]
    pub(crate) fn set_after_update_c<C: Clock>(&self, rel: PageIndex) {
        let rel = rel.raw();
        let i = (rel / 64) as usize;
        if let Some(w) = self.at(0, i) {
            sync::fetch_or::<C, _>(w, 1u64 << (rel % 64), Ordering::AcqRel);
            self.summarise::<C>(0, i);
        }
    }

    /// Rule 1 of the module documentation: an RMW just set a bit of word `i` of `level`; set
    /// the summary bits above it, stopping at one already set.
    #[inline]
    fn summarise<C: Clock>(&self, mut level: usize, mut i: usize) {
        while let Some(s) = self.at(level + 1, i / 64) {
            let bit = 1u64 << (i % 64);
            // Relaxed is enough: the RMW before this load, in program order, already acquired
            // any harvest or CLEAR whose RMW on the word below preceded ours.
            if sync::load::<C, _>(s, Ordering::Relaxed) & bit != 0 {
                return;
            }
            sync::fetch_or::<C, _>(s, bit, Ordering::AcqRel);
            level += 1;
            i /= 64;
        }
    }

    /// Page `rel` is marked.
    pub fn test(&self, rel: PageIndex) -> bool {
        let rel = rel.raw();
        self.at(0, (rel / 64) as usize)
            .is_some_and(|w| w.load(Ordering::Acquire) & (1u64 << (rel % 64)) != 0)
    }

    /// Reads word `i` of page bits without clearing it.
    #[inline]
    pub fn word(&self, i: usize) -> u64 {
        self.at(0, i).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Hands every non-zero word of page bits to `f(index, bits)`, in index order, reading
    /// only the words the summary names (`how` says whether they are cleared). Returns the
    /// words read, summary words included.
    pub(crate) fn harvest<C: Clock>(&self, how: Read, f: &mut dyn FnMut(usize, u64)) -> u64 {
        let mut reads = 0;
        let top = self.levels.len().saturating_sub(1);
        for i in 0..self.levels.get(top).map_or(0, |l| l.len()) {
            // The top has no summary above it, so a zero word need not be exchanged (rule 2
            // concerns words below a summary bit this harvest cleared).
            if how == Read::Take
                && self
                    .at(top, i)
                    .is_some_and(|w| sync::load::<C, _>(w, Ordering::Relaxed) == 0)
            {
                reads += 1;
                continue;
            }
            self.descend::<C>(how, top, i, &mut reads, f);
        }
        reads
    }

    /// Every word of page bits in index order, as KVM's GET loops read them: each word is
    /// loaded (the whole slot, not only what the summary names), and each non-zero one taken as
    /// `how` says (`Take`: exchanged with zero; `TakeUnshared`: a plain store of zero) and handed
    /// to `f(index, bits)`. Summary bits are left set: a summary may over-approximate, so the
    /// reads through it stay exact. Returns the words read.
    pub(crate) fn scan_all<C: Clock>(&self, how: Read, f: &mut dyn FnMut(usize, u64)) -> u64 {
        for (i, w) in self.bits().iter().enumerate() {
            // A word loaded as zero while a marker sets it keeps its bit for the next GET.
            let v = sync::load::<C, _>(w, Ordering::Relaxed);
            if v == 0 {
                continue;
            }
            let v = match how {
                Read::Copy => v,
                Read::Take => sync::swap::<C, _>(w, 0, Ordering::AcqRel),
                Read::TakeUnshared => {
                    sync::store::<C, _>(w, 0, Ordering::Relaxed);
                    v
                }
            };
            if v != 0 {
                f(i, v);
            }
        }
        self.nwords() as u64
    }

    /// Stores zero to every word of page bits (KVM's memset of its second bitmap). Only for a
    /// bitmap no marker writes to.
    pub(crate) fn zero_all<C: Clock>(&self) {
        for w in self.bits() {
            sync::store::<C, _>(w, 0, Ordering::Relaxed);
        }
    }

    /// Stores `bits` as word `i` of page bits (a buffer no marker writes to); nothing past the
    /// end.
    pub(crate) fn put<C: Clock>(&self, i: usize, bits: u64) {
        if let Some(w) = self.at(0, i) {
            sync::store::<C, _>(w, bits, Ordering::Relaxed);
        }
    }

    /// Reads word `i` of `level` as `how` says, then the words below its set bits.
    fn descend<C: Clock>(
        &self,
        how: Read,
        level: usize,
        i: usize,
        reads: &mut u64,
        f: &mut dyn FnMut(usize, u64),
    ) {
        let Some(w) = self.at(level, i) else {
            return;
        };
        *reads += 1;
        let v = match how {
            Read::Copy => sync::load::<C, _>(w, Ordering::Acquire),
            // Unconditional (rule 2): a load that finds the word zero could be the stale half
            // of a store-buffering pair with a marker that found our summary bit still set.
            Read::Take => sync::swap::<C, _>(w, 0, Ordering::AcqRel),
            Read::TakeUnshared => {
                let v = sync::load::<C, _>(w, Ordering::Relaxed);
                if v != 0 {
                    sync::store::<C, _>(w, 0, Ordering::Relaxed);
                }
                v
            }
        };
        if level == 0 {
            if v != 0 {
                f(i, v);
            }
            return;
        }
        let mut m = v;
        while m != 0 {
            let b = m.trailing_zeros() as usize;
            m &= m - 1;
            self.descend::<C>(how, level - 1, i * 64 + b, reads, f);
        }
    }

    /// Clears the bits of `mask` in word `i` of page bits; returns the bits that were actually
    /// set. If the word is now zero its summary bits are cleared too (rule 3). `reads` counts
    /// the words read.
    #[inline]
    pub(crate) fn clear_bits<C: Clock>(&self, i: usize, mask: u64, reads: &mut u64) -> u64 {
        let Some(w) = self.at(0, i) else {
            return 0;
        };
        *reads += 1;
        let prev = sync::fetch_and::<C, _>(w, !mask, Ordering::AcqRel);
        if prev & !mask == 0 {
            self.unsummarise::<C>(0, i, reads);
        }
        prev & mask
    }

    /// Rule 3: our RMW left word `i` of `level` zero. Clears the summary bit above it, re-reads
    /// the word with an RMW and sets the bit back if a marker got in; climbs while the summary
    /// word it cleared is zero.
    fn unsummarise<C: Clock>(&self, mut level: usize, mut i: usize, reads: &mut u64) {
        while let (Some(s), Some(w)) = (self.at(level + 1, i / 64), self.at(level, i)) {
            let bit = 1u64 << (i % 64);
            *reads += 1;
            if sync::load::<C, _>(s, Ordering::Relaxed) & bit == 0 {
                return;
            }
            let prev = sync::fetch_and::<C, _>(s, !bit, Ordering::AcqRel);
            *reads += 1;
            if sync::fetch_or::<C, _>(w, 0, Ordering::AcqRel) != 0 {
                sync::fetch_or::<C, _>(s, bit, Ordering::AcqRel);
                self.summarise::<C>(level + 1, i / 64);
                return;
            }
            if prev & !bit != 0 {
                return;
            }
            level += 1;
            i /= 64;
        }
    }

    /// Number of set bits (read through the summary).
    pub fn count(&self) -> u64 {
        let mut n = 0;
        self.harvest::<RealTime>(Read::Copy, &mut |_, w| n += w.count_ones() as u64);
        n
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
    /// Bytes of both bitmaps and their summary levels.
    pub(crate) fn heap_bytes(&self) -> u64 {
        let words = self.maps.iter().flat_map(|m| m.levels.iter());
        words.map(|l| l.len() as u64 * 8).sum()
    }

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
        self.active_c::<RealTime>()
    }

    /// [`Self::active`], reported to clock `C` (a load of the word a switch writes).
    #[inline]
    pub(crate) fn active_c<C: Clock>(&self) -> &DirtyBitmap {
        &self.maps[sync::load::<C, _>(&self.active, Ordering::Acquire) as usize]
    }

    /// The bitmap marks do not go to now (the exchange's buffer, or the switch's other side).
    #[inline]
    pub(crate) fn other<C: Clock>(&self) -> &DirtyBitmap {
        &self.maps[1 - sync::load::<C, _>(&self.active, Ordering::Acquire).min(1) as usize]
    }

    /// Marks page `rel` (slot-relative) in the active bitmap.
    #[inline]
    pub fn set(&self, rel: PageIndex) {
        self.set_c::<RealTime>(rel)
    }

    /// [`Self::set`], reported to clock `C`.
    #[inline]
    pub(crate) fn set_c<C: Clock>(&self, rel: PageIndex) {
        self.active_c::<C>().set_c::<C>(rel)
    }

    /// [`DirtyBitmap::set_after_update`] on the active bitmap.
    #[inline]
    pub fn set_after_update(&self, rel: PageIndex) {
        self.set_after_update_c::<RealTime>(rel)
    }

    /// [`Self::set_after_update`], reported to clock `C`.
    #[inline]
    pub(crate) fn set_after_update_c<C: Clock>(&self, rel: PageIndex) {
        self.active_c::<C>().set_after_update_c::<C>(rel)
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
    pub(crate) fn switch<C: Clock>(&self) -> &DirtyBitmap {
        debug_assert!(self.can_switch());
        let old = self.active.load(Ordering::Relaxed);
        sync::store::<C, _>(&self.active, 1 - old, Ordering::SeqCst);
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

    fn taken(b: &DirtyBitmap, how: Read) -> (Vec<(usize, u64)>, u64) {
        let mut v = Vec::new();
        let reads = b.harvest::<RealTime>(how, &mut |i, w| v.push((i, w)));
        (v, reads)
    }

    #[test]
    fn initially_set_covers_exactly_the_slot() {
        let b = DirtyBitmap::new(130, true);
        assert_eq!(b.nwords(), 3);
        assert_eq!(b.summary_levels(), 1);
        assert_eq!(b.count(), 130);
        assert_eq!(b.word(2), 0b11);
        assert_eq!(taken(&b, Read::Take).0.len(), 3);
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn levels_reach_one_word() {
        for (npages, levels) in [(0, 0), (64, 0), (65, 1), (64 * 64, 1), (64 * 64 + 1, 2)] {
            assert_eq!(DirtyBitmap::new(npages, false).summary_levels(), levels);
        }
        // 16 GiB of 4 KiB pages: 65 536 words, then 1024, 16, 1.
        assert_eq!(DirtyBitmap::new(1 << 22, false).summary_levels(), 3);
    }

    #[test]
    fn take_reads_only_marked_words_and_clears_them() {
        let b = DirtyBitmap::new(1 << 20, false);
        for p in [3, 64, 1 << 19, (1 << 20) - 1] {
            b.set(PageIndex::new(p));
        }
        b.set_after_update(PageIndex::new(65));
        assert!(b.test(PageIndex::new(3)));
        let (words, reads) = taken(&b, Read::Take);
        let expect = vec![
            (0, 1 << 3),
            (1, 0b11),
            (1 << 13, 1),
            ((1 << 14) - 1, 1 << 63),
        ];
        assert_eq!(words, expect);
        // 16384 words under 256, 4 and 1: the 4 words, their 3 level-1 words, 3 level-2
        // words (0, 2, 3) and the top.
        assert_eq!(reads, 4 + 3 + 3 + 1);
        assert_eq!(taken(&b, Read::Take), (vec![], 1));
    }

    #[test]
    fn clear_empties_the_summary_only_when_the_word_is_empty() {
        let b = DirtyBitmap::new(1 << 20, false);
        b.set(PageIndex::new(64 * 100));
        b.set(PageIndex::new(64 * 100 + 1));
        let mut reads = 0;
        assert_eq!(
            b.clear_bits::<crate::clock::RealTime>(100, 0b1, &mut reads),
            0b1
        );
        assert_eq!(taken(&b, Read::Copy).0, vec![(100, 0b10)]);
        assert_eq!(
            b.clear_bits::<crate::clock::RealTime>(100, 0b111, &mut reads),
            0b10
        );
        assert_eq!(
            b.clear_bits::<crate::clock::RealTime>(7, 0b1, &mut reads),
            0
        );
        assert_eq!(taken(&b, Read::Copy), (vec![], 1), "summary left set");
        // Past the end: nothing, no panic.
        assert_eq!(
            b.clear_bits::<crate::clock::RealTime>(usize::MAX, !0, &mut reads),
            0
        );
        b.set(PageIndex::new(u64::MAX));
        assert_eq!(b.count(), 0);
    }
}
