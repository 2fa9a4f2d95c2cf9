//! [`SummaryBitmap`]: a dirty bitmap for the VMM's own writes that marks a range with one
//! atomic per 64-page word and is harvested in O(dirty) through summary levels — with the
//! `vm-memory` feature, a `vm-memory` `Bitmap` backend, so `GuestMemoryMmap<SummaryBitmap>`
//! replaces `GuestMemoryMmap<AtomicBitmap>` (Firecracker's and Cloud Hypervisor's choice).
//!
//! # Levels
//!
//! `levels[0]` holds one bit per page; bit `b` of word `j` of `levels[n + 1]` says that word
//! `64 j + b` of `levels[n]` may hold marks, up to a level of one word (64 GiB of 4 KiB pages:
//! 262 144 words, then 4096, 64 and 1). A harvest starts at the top and swaps only the words
//! whose summary bit it took, so k dirty pages cost O(k × levels) word reads however large the
//! bitmap; `AtomicBitmap::get_and_reset` swaps every word.
//!
//! # Protocol (no mark lost, no page copied stale)
//!
//! 1. A marker writes guest memory, then sets its bits with one `AcqRel` `fetch_or` per word
//!    (every time: see below), then loads the summary bit above the word and, if it is clear,
//!    sets it with an `AcqRel` RMW and climbs; it stops at a bit it sees set.
//! 2. A harvest clears summary bits only by an `AcqRel` swap of the summary word, and then
//!    swaps every word below each bit it cleared, even one it expects to be zero.
//!
//! Take a marker's RMW `m` on a word, its later load `l` of the summary bit, and the last
//! swap `c` that cleared that bit, followed by the harvest's swap `r` of the word. If `r`
//! follows `m` in the word's modification order, `r` returns the mark and acquires `m`'s
//! release, so the copy that follows the harvest reads the data written before `m`. If `r`
//! precedes `m`, `m` reads from `r` or a later RMW (every write to a word is an RMW), so `c`
//! happens before `l`: the marker sees the bit cleared and sets it, or sees a later set, which
//! stays; the next harvest reaches the mark. The same holds level by level to the top. With a
//! load in place of either RMW the pair is the store-buffering pattern and both sides may read
//! stale values. `tests/loom_bitmap.rs` checks this under loom, with the harvest reading each
//! page it took (loom checks that read against the page's write); it fails if the take's swap
//! of a page word is relaxed, or a load and a store.
//!
//! A marker cannot skip the word's RMW when a load finds its bits set (as the engine's
//! pre-update mark does): vm-memory marks *after* the write, and a load that sees the bits
//! still set may be reading a value a harvest has already swapped away — the harvest then
//! copies the page before the write reaches it and the bits are gone. The engine marks before
//! the page becomes writable, and its second mark after the update is the RMW this bitmap
//! always takes.
//!
//! # Why not the engine's bitmap
//!
//! `slat`'s `DirtyBitmap` (`crates/slat/src/dirty/bitmap.rs`) uses the same summary rules but
//! is crate-private to the engine and carries engine-only paths (manual protection's CLEAR
//! with its summary re-read, the copy read, the bitmap switch's unshared take, the skip-if-set
//! mark) on the engine's `sync` switch. Sharing one implementation means a new crate under
//! both and re-running the engine's loom models and oracles against it; this bitmap keeps
//! rules 1 and 2 only, adds range marks, and has its own loom model.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

use crate::Error;
use std::num::NonZeroUsize;

/// The page size [`SummaryBitmap::default`] and vm-memory's `NewBitmap::with_len` use: the
/// 4 KiB pages of KVM's dirty log, which [`crate::Harvester::mark_summary_bitmap`] requires.
pub const SUMMARY_BITMAP_PAGE: NonZeroUsize = match NonZeroUsize::new(4096) {
    Some(n) => n,
    None => NonZeroUsize::MIN,
};

/// A dirty bitmap over `byte_size` bytes of guest memory, one bit per page, with summary
/// levels: [`mark_pages`](Self::mark_pages) costs one atomic per word,
/// [`take_words`](Self::take_words) reads only the words that hold marks.
///
/// # Example: in place of `AtomicBitmap` (feature `vm-memory`)
///
/// Guest memory whose writes through vm-memory (devices, the VMM) are tracked by this
/// bitmap, one per region; a harvest moves each region's marks into a [`crate::Harvester`]
/// (which also owes the pages KVM logged), reading only the dirty words.
///
/// ```
/// # #[cfg(feature = "vm-memory")]
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use slat_dirty::{Harvester, SummaryBitmap};
/// use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
/// # use slat_dirty::{DirtyLogSource, Error, LogMode, SlotInfo};
/// # use slat_addr::PageIndex;
/// # /// A log with nothing in it (a real VMM uses `Harvester::new` over its KVM slots).
/// # struct NoLog;
/// # impl DirtyLogSource for NoLog {
/// #     type Error = Error;
/// #     fn slots(&self) -> Vec<SlotInfo> { vec![SlotInfo { id: 0, pages: 256 }] }
/// #     fn mode(&self) -> LogMode { LogMode::Get }
/// #     fn get_log(&mut self, _: usize, _: &mut [u64]) -> Result<(), Error> { Ok(()) }
/// #     fn clear_log(&mut self, _: usize, _: PageIndex, _: u64, _: &[u64]) -> Result<(), Error> {
/// #         Ok(())
/// #     }
/// #     fn collect_ring(&mut self, _: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Error> {
/// #         Ok(0)
/// #     }
/// #     fn reset_rings(&mut self) -> Result<u64, Error> { Ok(0) }
/// # }
///
/// // Was `GuestMemoryMmap<AtomicBitmap>`: 1 MiB of guest RAM at 0 (memslot 0).
/// let mem: GuestMemoryMmap<SummaryBitmap> =
///     GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)])?;
/// # let mut harvester = Harvester::from_source(NoLog)?;
/// // A device writes 2 bytes across pages 4 and 5: both are marked.
/// mem.write_slice(&[1, 2], GuestAddress(0x4fff))?;
///
/// // Harvest: each region's bitmap (the `MmapRegion`'s) into the slot it backs.
/// for (slot, region) in mem.iter().enumerate() {
///     let bitmap: &SummaryBitmap = (**region).bitmap();
///     harvester.mark_summary_bitmap(slot, bitmap)?;
/// }
/// let set = harvester.take()?;
/// assert_eq!(set.ranges(0).collect::<Vec<_>>(), [(4, 2)]); // pages 4 and 5
/// // ... copy them, then:
/// set.commit();
/// # Ok(())
/// # }
/// # #[cfg(not(feature = "vm-memory"))]
/// # fn main() {}
/// ```
pub struct SummaryBitmap {
    /// `levels[0]`: one bit per page; `levels[n + 1]`: one bit per word of `levels[n]`.
    levels: Box<[Box<[AtomicU64]>]>,
    pages: usize,
    byte_size: usize,
    page_size: NonZeroUsize,
    /// The bits could not be allocated (only `NewBitmap::with_len`, which cannot fail, builds
    /// one): every page reads as dirty and every harvest reports every page, so no write is
    /// lost, at the price of copying everything.
    saturated: bool,
}

impl std::fmt::Debug for SummaryBitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the words: a 64 GiB bitmap has 262 144 of them.
        f.debug_struct("SummaryBitmap")
            .field("pages", &self.pages)
            .field("page_size", &self.page_size)
            .field("summary_levels", &self.summary_levels())
            .field("saturated", &self.saturated)
            .finish()
    }
}

impl Default for SummaryBitmap {
    /// An empty bitmap (no pages) of 4 KiB pages, as vm-memory's `AtomicBitmap::default`.
    fn default() -> Self {
        SummaryBitmap {
            levels: Box::new([]),
            pages: 0,
            byte_size: 0,
            page_size: SUMMARY_BITMAP_PAGE,
            saturated: false,
        }
    }
}

/// A zeroed level of `words` words, or none if the host cannot hold it.
fn level(words: usize) -> Option<Box<[AtomicU64]>> {
    let mut v = Vec::new();
    v.try_reserve_exact(words).ok()?;
    v.extend((0..words).map(|_| AtomicU64::new(0)));
    Some(v.into_boxed_slice())
}

/// Word `i` of a bitmap of `pages` bits with every page's bit set.
fn full_word(i: usize, pages: usize) -> u64 {
    let done = i.saturating_mul(64);
    match pages.saturating_sub(done) {
        n if n >= 64 => u64::MAX,
        n => (1u64 << n) - 1,
    }
}

/// How many words of a level the harvest prefetches the children of ahead of its swaps.
const AHEAD: usize = 4;

/// Asks the CPU to bring `w`'s cache line in (a hint; a no-op off x86-64 and under loom).
#[inline(always)]
fn prefetch(w: Option<&AtomicU64>) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    if let Some(w) = w {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch only hints: it cannot fault, and reads nothing the program sees.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(w).cast()) };
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = w;
}

impl SummaryBitmap {
    /// A clean bitmap for `byte_size` bytes of `page_size` pages (as vm-memory's
    /// `AtomicBitmap::new`). Fails ([`Error::Alloc`]) only if the host cannot allocate it.
    pub fn new(byte_size: usize, page_size: NonZeroUsize) -> Result<Self, Error> {
        let pages = byte_size.div_ceil(page_size.get());
        let refused = |words: usize| Error::Alloc {
            what: format!("the dirty bitmap of {pages} pages"),
            bytes: (words as u64).saturating_mul(8),
        };
        let words = pages.div_ceil(64);
        let mut levels = vec![level(words).ok_or_else(|| refused(words))?];
        while let Some(below) = levels.last().map(|l| l.len()).filter(|&n| n > 1) {
            let words = below.div_ceil(64);
            levels.push(level(words).ok_or_else(|| refused(words))?);
        }
        Ok(SummaryBitmap {
            levels: levels.into_boxed_slice(),
            pages,
            byte_size,
            page_size,
            saturated: false,
        })
    }

    /// `new`, or if the bits cannot be allocated, a bitmap that reports every page dirty
    /// (what `NewBitmap::with_len`, which cannot fail, returns).
    pub fn new_or_saturated(byte_size: usize, page_size: NonZeroUsize) -> Self {
        SummaryBitmap::new(byte_size, page_size).unwrap_or_else(|_| SummaryBitmap {
            levels: Box::new([]),
            pages: byte_size.div_ceil(page_size.get()),
            byte_size,
            page_size,
            saturated: true,
        })
    }

    /// Pages covered (bits).
    pub fn len(&self) -> usize {
        self.pages
    }

    /// Covers no page.
    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }

    /// Bytes covered.
    pub fn byte_size(&self) -> usize {
        self.byte_size
    }

    /// Bytes per page (per bit).
    pub fn page_size(&self) -> NonZeroUsize {
        self.page_size
    }

    /// Summary levels above the page bits (0 for at most 64 pages).
    pub fn summary_levels(&self) -> usize {
        self.levels.len().saturating_sub(1)
    }

    /// The bits could not be allocated: every page reads and harvests as dirty.
    pub fn is_saturated(&self) -> bool {
        self.saturated
    }

    /// Word `i` of `level`, or none past the end (a caller's offset past the bitmap marks
    /// nothing and reads as clean rather than panicking).
    #[inline]
    fn at(&self, level: usize, i: usize) -> Option<&AtomicU64> {
        self.levels.get(level).and_then(|l| l.get(i))
    }

    /// Marks `count` pages from page `first` dirty; pages past the end are ignored. One
    /// `fetch_or` per word the range touches, plus the summary step of rule 1 (usually one
    /// load). Call it after the write the marks stand for.
    #[inline]
    pub fn mark_pages(&self, first: usize, count: usize) {
        let end = first.saturating_add(count).min(self.pages);
        let mut p = first;
        while p < end {
            let bit = p % 64;
            let n = (64 - bit).min(end - p);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            if let Some(w) = self.at(0, p / 64) {
                // Always the RMW (the module documentation says why a set bit is no excuse).
                w.fetch_or(mask, Ordering::AcqRel);
                self.summarise(p / 64);
            }
            p += n;
        }
    }

    /// Marks the pages of `len` bytes from byte `offset` dirty (vm-memory's
    /// `AtomicBitmap::set_addr_range`): pages past the end, and a range that wraps the address
    /// space, are cut off.
    #[inline]
    pub fn set_addr_range(&self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let first = offset / self.page_size;
        let last = offset.saturating_add(len - 1) / self.page_size;
        self.mark_pages(first, (last - first).saturating_add(1));
    }

    /// Rule 1: an RMW just set bits of page word `i`; set the summary bits above it, stopping
    /// at one already set.
    #[inline]
    fn summarise(&self, mut i: usize) {
        let mut level = 0;
        while let Some(s) = self.at(level + 1, i / 64) {
            let bit = 1u64 << (i % 64);
            // Relaxed is enough: the RMW before it already acquired any harvest whose swap of
            // the word below preceded ours.
            if s.load(Ordering::Relaxed) & bit != 0 {
                return;
            }
            s.fetch_or(bit, Ordering::AcqRel);
            level += 1;
            i /= 64;
        }
    }

    /// Page `page` is marked.
    pub fn is_bit_set(&self, page: usize) -> bool {
        if self.saturated {
            return page < self.pages;
        }
        self.at(0, page / 64)
            .is_some_and(|w| w.load(Ordering::Acquire) & (1u64 << (page % 64)) != 0)
    }

    /// The page holding byte `offset` is marked.
    pub fn is_addr_set(&self, offset: usize) -> bool {
        self.is_bit_set(offset / self.page_size)
    }

    /// Takes every mark: hands each non-zero word of page bits to `f(word index, bits)`, in
    /// index order, and clears it, reading only the words the summary names. Returns the words
    /// read, summary words included (the harvest's cost). Page `64 × index + b` is dirty for
    /// each set bit `b`. Copy the pages after the call: each mark's write is visible by then.
    /// A [saturated](Self::is_saturated) bitmap hands over every page, every time (O(size)).
    pub fn take_words(&self, mut f: impl FnMut(usize, u64)) -> u64 {
        if self.saturated {
            let words = self.pages.div_ceil(64);
            (0..words).for_each(|i| f(i, full_word(i, self.pages)));
            return words as u64;
        }
        let mut reads = 0;
        let top = self.levels.len().saturating_sub(1);
        for i in 0..self.levels.get(top).map_or(0, |l| l.len()) {
            // The top has no summary above it: a zero word holds nothing to take, and a mark
            // that lands after this load stays for the next harvest.
            if self
                .at(top, i)
                .is_some_and(|w| w.load(Ordering::Relaxed) == 0)
            {
                reads += 1;
                continue;
            }
            self.descend(top, i, &mut reads, &mut f);
        }
        reads
    }

    /// Swaps word `i` of `level` with zero, then every word below its set bits (rule 2).
    fn descend(&self, level: usize, i: usize, reads: &mut u64, f: &mut impl FnMut(usize, u64)) {
        let Some(w) = self.at(level, i) else {
            return;
        };
        *reads += 1;
        // Unconditional: a load that finds the word zero could be the stale half of a
        // store-buffering pair with a marker that saw our summary bit still set.
        let v = w.swap(0, Ordering::AcqRel);
        match level {
            0 if v != 0 => f(i, v),
            0 => {}
            1 => self.take_pages(i, v, reads, f),
            _ => {
                // Sparse marks put each page word on its own cache line: while one child is
                // taken, the page words of the child AHEAD places on are fetched, so the
                // misses overlap instead of each waiting behind the previous swap.
                let mut ahead = v;
                for _ in 0..AHEAD {
                    ahead = self.prefetch_grandchildren(level, i, ahead);
                }
                let mut m = v;
                while m != 0 {
                    let b = m.trailing_zeros() as usize;
                    m &= m - 1;
                    ahead = self.prefetch_grandchildren(level, i, ahead);
                    self.descend(level - 1, i * 64 + b, reads, f);
                }
            }
        }
    }

    /// Rule 2 at level 1 (the bits `v` just swapped out of level-1 word `i`): swaps each page
    /// word below them and hands on the non-zero ones.
    #[inline]
    fn take_pages(&self, i: usize, v: u64, reads: &mut u64, f: &mut impl FnMut(usize, u64)) {
        let Some(words) = self.levels.first() else {
            return;
        };
        // Already fetched when a level above looked ahead; not when level 1 is the top.
        let mut m = v;
        while m != 0 {
            prefetch(words.get(i * 64 + m.trailing_zeros() as usize));
            m &= m - 1;
        }
        let mut m = v;
        while m != 0 {
            let j = i * 64 + m.trailing_zeros() as usize;
            m &= m - 1;
            if let Some(w) = words.get(j) {
                *reads += 1;
                let bits = w.swap(0, Ordering::AcqRel);
                if bits != 0 {
                    f(j, bits);
                }
            }
        }
    }

    /// Prefetches the words below the child of word `i` of `level` named by the lowest set bit
    /// of `ahead` (a relaxed peek: a hint, not a read of the harvest); returns `ahead` without
    /// that bit.
    #[inline]
    fn prefetch_grandchildren(&self, level: usize, i: usize, ahead: u64) -> u64 {
        if ahead == 0 {
            return 0;
        }
        let c = i * 64 + ahead.trailing_zeros() as usize;
        if let Some(w) = self.at(level - 1, c) {
            let mut m = w.load(Ordering::Relaxed);
            while m != 0 {
                prefetch(self.at(level - 2, c * 64 + m.trailing_zeros() as usize));
                m &= m - 1;
            }
        }
        ahead & (ahead - 1)
    }

    /// Clears every mark (a harvest whose pages are dropped).
    pub fn reset(&self) {
        self.take_words(|_, _| {});
    }
}

/// The vm-memory `Bitmap` backend: `GuestMemoryMmap<SummaryBitmap>`.
#[cfg(feature = "vm-memory")]
mod vm_memory_backend {
    use super::{SummaryBitmap, SUMMARY_BITMAP_PAGE};
    use vm_memory::bitmap::{Bitmap, NewBitmap, RefSlice, WithBitmapSlice};

    impl<'a> WithBitmapSlice<'a> for SummaryBitmap {
        type S = RefSlice<'a, Self>;
    }

    impl Bitmap for SummaryBitmap {
        fn mark_dirty(&self, offset: usize, len: usize) {
            self.set_addr_range(offset, len)
        }

        fn dirty_at(&self, offset: usize) -> bool {
            self.is_addr_set(offset)
        }

        fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
            RefSlice::new(self, offset)
        }
    }

    impl NewBitmap for SummaryBitmap {
        /// 4 KiB pages (KVM's dirty-log page, what the harvester merges), not the host's page
        /// size as `AtomicBitmap::with_len` takes.
        fn with_len(len: usize) -> Self {
            SummaryBitmap::new_or_saturated(len, SUMMARY_BITMAP_PAGE)
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn taken(b: &SummaryBitmap) -> (Vec<(usize, u64)>, u64) {
        let mut v = Vec::new();
        let reads = b.take_words(|i, w| v.push((i, w)));
        (v, reads)
    }

    #[test]
    fn levels_reach_one_word() {
        for (pages, levels) in [(0, 0), (64, 0), (65, 1), (64 * 64, 1), (64 * 64 + 1, 2)] {
            let b = SummaryBitmap::new(pages * 4096, SUMMARY_BITMAP_PAGE).unwrap();
            assert_eq!((b.len(), b.summary_levels()), (pages, levels));
        }
        // 64 GiB of 4 KiB pages: 262 144 words, then 4096, 64, 1.
        let b = SummaryBitmap::new(64 << 30, SUMMARY_BITMAP_PAGE).unwrap();
        assert_eq!(b.summary_levels(), 3);
    }

    #[test]
    fn a_range_takes_one_word_each_and_a_harvest_reads_only_them() {
        let b = SummaryBitmap::new(1 << 32, SUMMARY_BITMAP_PAGE).unwrap();
        b.mark_pages(60, 10);
        b.set_addr_range(10_000 * 64 * 4096 + 1, 1);
        let (words, reads) = taken(&b);
        assert_eq!(words, [(0, 0xf << 60), (1, 0x3f), (10_000, 1)]);
        // 16 384 words under 256, 4, 1: 3 words, their 2 level-1 words, 2 level-2, the top.
        assert_eq!(reads, 3 + 2 + 2 + 1);
        assert_eq!(taken(&b), (vec![], 1));
    }

    #[test]
    fn out_of_range_marks_are_cut_off() {
        let b = SummaryBitmap::new(130 * 4096, SUMMARY_BITMAP_PAGE).unwrap();
        b.mark_pages(128, usize::MAX);
        b.set_addr_range(usize::MAX, usize::MAX);
        b.set_addr_range(usize::MAX - 10, 5);
        b.mark_pages(usize::MAX, 1);
        assert!(!b.is_bit_set(usize::MAX) && !b.is_addr_set(usize::MAX));
        assert_eq!(taken(&b).0, [(2, 0b11)]);
        let byte = SummaryBitmap::new(100, NonZeroUsize::MIN).unwrap();
        byte.set_addr_range(0, usize::MAX);
        assert_eq!(taken(&byte).0, [(0, u64::MAX), (1, (1 << 36) - 1)]);
    }

    #[test]
    fn an_unallocatable_bitmap_is_saturated() {
        assert!(SummaryBitmap::new(usize::MAX, NonZeroUsize::MIN).is_err());
        let b = SummaryBitmap::new_or_saturated(usize::MAX, NonZeroUsize::MIN);
        assert!(b.is_saturated() && b.is_bit_set(5) && !b.is_bit_set(usize::MAX));
        let small = SummaryBitmap::new_or_saturated(70 * 4096, SUMMARY_BITMAP_PAGE);
        assert!(!small.is_saturated());
        assert_eq!(full_word(1, 70), 0x3f);
        assert_eq!(full_word(usize::MAX, 70), 0);
    }
}
