//! Snapshot and reset of guest memory, as snapshot fuzzers (Nyx, snapchange, wtf) and

use crate::snapshot_copy::{crossover_fraction, RegionCopy};
use slat_addr::PAGE_SIZE;
use slat_addr::{Hva, PageIndex};
use std::ptr::NonNull;

/// Why a snapshot operation was refused. Nothing has been written when one is returned,
/// except by [`Snapshot::reset`] for [`SnapshotError::Shape`], which is checked first too.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// A region that is empty, not a whole number of pages, or too large for this host.
    #[error("guest region at {addr:#x} of {len} bytes: {reason}")]
    Region {
        /// Host address given.
        addr: Hva,
        /// Length given.
        len: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// A region index past the last region.
    #[error("region {region} does not exist ({regions} regions)")]
    NoRegion {
        /// Index given.
        region: usize,
        /// Regions there are.
        regions: usize,
    },
    /// A page index past the end of its region (from a list, or a bit set in a bitmap).
    #[error("page {page} is past the end of region {region} ({pages} pages)")]
    PageOutOfRange {
        /// The region.
        region: usize,
        /// The page index given.
        page: PageIndex,
        /// Pages in the region.
        pages: u64,
    },
    /// A bitmap longer than its region needs.
    #[error(
        "a bitmap of {words} words from page {first} does not fit region {region} ({pages} pages)"
    )]
    BitmapLength {
        /// The region.
        region: usize,
        /// First page the bitmap's bit 0 stands for.
        first: PageIndex,
        /// Words given.
        words: usize,
        /// Pages in the region.
        pages: u64,
    },
    /// A page set or child built for regions of other sizes than this snapshot's.
    #[error("{0}")]
    Shape(String),
    /// A copy of guest memory could not be allocated (a typed error, not an abort).
    #[error("cannot allocate {bytes} bytes for a snapshot's copy of guest memory")]
    Alloc {
        /// Bytes asked for.
        bytes: u64,
    },
    /// Guest memory differs from the snapshot.
    #[error("guest memory differs from the snapshot: region {region}, page {page}, byte {byte}")]
    Mismatch {
        /// The region.
        region: usize,
        /// The first differing page.
        page: PageIndex,
        /// Its first differing byte.
        byte: u64,
    },
}

/// Host memory holding guest pages, as a snapshot copies and resets it.
#[derive(Debug)]
pub struct GuestRegion {
    addr: NonNull<u8>,
    pages: u64,
}

// SAFETY: a `GuestRegion` is an address and a length; the contract of `GuestRegion::new`
// makes the memory valid from any thread, and every access through it takes `&mut` or goes
// through a `Snapshot`, which is not `Sync`.
unsafe impl Send for GuestRegion {}

impl GuestRegion {
    /// The `len` bytes of host memory at `addr`, a whole number of 4 KiB pages.
    ///
    /// # Safety
    ///
    /// The caller promises that `[addr, addr + len)` is mapped, readable and writable, and
    /// stays mapped for as long as this region or any [`Snapshot`] built from it exists; and
    /// that nobody else (vCPUs, device threads, another snapshot of the same memory) writes it
    /// while a snapshot is [taken](Snapshot::take), [reset](Snapshot::reset) or
    /// [verified](Snapshot::verify) — stop the vCPUs first.
    pub unsafe fn new(addr: *mut u8, len: u64) -> Result<Self, SnapshotError> {
        let bad = |reason| SnapshotError::Region {
            addr: Hva::from_ptr(addr),
            len,
            reason,
        };
        let addr = NonNull::new(addr).ok_or_else(|| bad("null address"))?;
        if len == 0 || len % PAGE_SIZE != 0 {
            return Err(bad("the length must be a non-zero multiple of 4 KiB"));
        }
        // Slices are limited to isize::MAX bytes, and the end must not wrap.
        if isize::try_from(len).is_err() || (addr.as_ptr() as u64).checked_add(len).is_none() {
            return Err(bad("the region does not fit the address space"));
        }
        Ok(GuestRegion {
            addr,
            pages: len / PAGE_SIZE,
        })
    }

    /// Pages in the region.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Bytes in the region.
    pub fn len(&self) -> u64 {
        self.pages * PAGE_SIZE
    }

    /// Never true: a region has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Host address of the region.
    pub fn addr(&self) -> Hva {
        Hva::from_ptr(self.addr.as_ptr())
    }

    /// The region's bytes.
    fn bytes(&self) -> &[u8] {
        // SAFETY: mapped and readable for `len` bytes (≤ isize::MAX, checked in `new`), and
        // not written while a snapshot reads it, by `new`'s contract.
        unsafe { std::slice::from_raw_parts(self.addr.as_ptr(), self.len() as usize) }
    }

    /// Zeroes page `page`, which the caller has bounds-checked.
    fn zero_page(&self, page: u64) {
        debug_assert!(page < self.pages);
        // SAFETY: `page < pages`, so the page lies inside the mapped, writable region
        // (`new`'s contract), and nobody else writes it during a reset (same contract).
        unsafe {
            std::ptr::write_bytes(
                self.addr.as_ptr().add((page * PAGE_SIZE) as usize),
                0,
                PAGE_SIZE as usize,
            )
        }
    }

    /// Writes pages `first..first + pages` (bounds-checked by the caller) from `src` (that
    /// many pages), or zeroes them when `src` is `None`.
    fn write_run(&self, first: u64, pages: u64, src: Option<&[u8]>) {
        debug_assert!(first + pages <= self.pages);
        let len = (pages * PAGE_SIZE) as usize;
        // SAFETY: the run lies inside the mapped, writable region (`new`'s contract, bounds
        // checked by the caller), nobody else writes it during a reset (same contract), and
        // `src` is a snapshot's own buffer of `len` bytes, so the two do not overlap.
        unsafe {
            let dst = self.addr.as_ptr().add((first * PAGE_SIZE) as usize);
            match src {
                Some(s) => std::ptr::copy_nonoverlapping(s.as_ptr(), dst, len.min(s.len())),
                None => std::ptr::write_bytes(dst, 0, len),
            }
        }
    }

    /// Copies `src` (one page) over page `page`, which the caller has bounds-checked.
    fn write_page(&self, page: u64, src: &[u8]) {
        debug_assert!(page < self.pages && src.len() == PAGE_SIZE as usize);
        // SAFETY: `page < pages`, so the page lies inside the mapped, writable region
        // (`new`'s contract); nobody else writes it during a reset (same contract), and `src`
        // is a snapshot's own buffer, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.addr.as_ptr().add((page * PAGE_SIZE) as usize),
                PAGE_SIZE as usize,
            )
        }
    }
}

/// Byte range of page `page` in a buffer of pages.
fn page_range(page: u64) -> std::ops::Range<usize> {
    let start = (page * PAGE_SIZE) as usize;
    start..start + PAGE_SIZE as usize
}

/// The pages of one region to copy back: a bitmap for dedup, a list for the work.
#[derive(Debug, Clone)]
struct RegionMarks {
    pages: u64,
    bits: Vec<u64>,
    list: Vec<u64>,
}

impl RegionMarks {
    fn new(pages: u64) -> Self {
        RegionMarks {
            pages,
            bits: vec![0; pages.div_ceil(64) as usize],
            list: Vec::new(),
        }
    }

    /// Marks `page` (< pages) once.
    fn mark(&mut self, page: u64) {
        let (w, b) = ((page / 64) as usize, 1u64 << (page % 64));
        if self.bits[w] & b == 0 {
            self.bits[w] |= b;
            self.list.push(page);
        }
    }

    fn contains(&self, page: u64) -> bool {
        page < self.pages && self.bits[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    /// Empties the set in O(listed pages).
    fn clear(&mut self) {
        for &p in &self.list {
            self.bits[(p / 64) as usize] = 0;
        }
        self.list.clear();
    }
}

/// Pages to copy back, per region, each at most once. Build one with
/// [`Snapshot::dirty_pages`] (sized for the snapshot's regions).
#[derive(Debug, Clone)]
pub struct DirtyPages {
    regions: Vec<RegionMarks>,
}

impl DirtyPages {
    /// An empty set over regions of these page counts. Not public: a bitmap is allocated per
    /// region, so the counts must be those of regions that exist ([`Snapshot::dirty_pages`]),
    /// never a number a caller made up (2^60 pages would abort the process).
    fn new(region_pages: &[u64]) -> Self {
        DirtyPages {
            regions: region_pages.iter().map(|&p| RegionMarks::new(p)).collect(),
        }
    }

    fn region_mut(&mut self, region: usize) -> Result<&mut RegionMarks, SnapshotError> {
        let regions = self.regions.len();
        self.regions
            .get_mut(region)
            .ok_or(SnapshotError::NoRegion { region, regions })
    }

    /// Adds page `page` of region `region` (again is a no-op).
    pub fn add_page(&mut self, region: usize, page: PageIndex) -> Result<(), SnapshotError> {
        let r = self.region_mut(region)?;
        if page.raw() >= r.pages {
            return Err(SnapshotError::PageOutOfRange {
                region,
                page,
                pages: r.pages,
            });
        }
        r.mark(page.raw());
        Ok(())
    }

    /// Adds the pages whose bits are set in `bitmap` (bit `i` = page `first + i` of
    /// `region`): a GET_DIRTY_LOG bitmap, a [`crate::DirtySet`]'s, a VMM's own. A bit past the
    /// region refuses the whole bitmap, before any page of it is added; words past the region
    /// are accepted only if zero (KVM rounds bitmaps up to 64 pages).
    pub fn add_bitmap(
        &mut self,
        region: usize,
        first: PageIndex,
        bitmap: &[u64],
    ) -> Result<(), SnapshotError> {
        let r = self.region_mut(region)?;
        let pages = r.pages;
        let too_long = SnapshotError::BitmapLength {
            region,
            first,
            words: bitmap.len(),
            pages,
        };
        let first = first.raw();
        let room = pages.checked_sub(first).ok_or(too_long.clone())?;
        if (bitmap.len() as u64) > room.div_ceil(64) {
            return Err(too_long);
        }
        if let Some(page) = Self::first_bit_at_or_past(bitmap, room) {
            return Err(SnapshotError::PageOutOfRange {
                region,
                page: PageIndex::new(first + page),
                pages,
            });
        }
        for (w, &word) in bitmap.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                r.mark(first + w as u64 * 64 + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        }
        Ok(())
    }

    /// The first set bit at index ≥ `limit` (the bitmap has at most `limit.div_ceil(64)`
    /// words, so only the last word can hold one).
    fn first_bit_at_or_past(bitmap: &[u64], limit: u64) -> Option<u64> {
        let last = bitmap.len().checked_sub(1)?;
        let base = last as u64 * 64;
        let valid = limit - base; // 1..=64: the words before the last are all below `limit`.
        let beyond = if valid >= 64 {
            0
        } else {
            bitmap[last] & !((1u64 << valid) - 1)
        };
        (beyond != 0).then(|| base + u64::from(beyond.trailing_zeros()))
    }

    /// Adds every page of a [`crate::DirtySet`], its slot `i` taken as region `i`, reading
    /// only the set's non-zero words ([`crate::DirtySet::words`]): O(dirty pages). A page past
    /// its region refuses that region's pages before any of them is added.
    pub fn add_dirty_set<S: crate::DirtyLogSource>(
        &mut self,
        set: &crate::DirtySet<'_, S>,
    ) -> Result<(), SnapshotError> {
        let mut i = 0;
        while set.bitmap(i).is_some() {
            let r = self.region_mut(i)?;
            let pages = r.pages;
            for (w, bits) in set.words(i) {
                let top = w as u64 * 64 + 63 - u64::from(bits.leading_zeros());
                if top >= pages {
                    let page = PageIndex::new(top);
                    return Err(SnapshotError::PageOutOfRange {
                        region: i,
                        page,
                        pages,
                    });
                }
            }
            for (w, mut bits) in set.words(i) {
                while bits != 0 {
                    r.mark(w as u64 * 64 + u64::from(bits.trailing_zeros()));
                    bits &= bits - 1;
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// Whether page `page` of `region` is in the set.
    pub fn contains(&self, region: usize, page: PageIndex) -> bool {
        let page = page.raw();
        self.regions.get(region).is_some_and(|r| r.contains(page))
    }

    /// Pages in the set.
    pub fn len(&self) -> u64 {
        self.regions.iter().map(|r| r.list.len() as u64).sum()
    }

    /// True if no page is in the set.
    pub fn is_empty(&self) -> bool {
        self.regions.iter().all(|r| r.list.is_empty())
    }

    /// The pages of `region`, in the order they were first added (empty past the last).
    pub fn pages(&self, region: usize) -> &[u64] {
        self.regions.get(region).map_or(&[], |r| r.list.as_slice())
    }

    /// Empties the set, in O(pages in it).
    pub fn clear(&mut self) {
        self.regions.iter_mut().for_each(RegionMarks::clear);
    }

    /// Page counts of the regions.
    fn shape(&self) -> impl Iterator<Item = u64> + '_ {
        self.regions.iter().map(|r| r.pages)
    }
}

/// A full copy of guest memory regions.
///
/// sandboxes (Hyperlight) do it: copy guest memory once while the vCPUs are stopped, run the
/// guest, then copy back **only the pages it dirtied**, so a reset costs O(dirty pages), not
/// O(RAM).
///
/// No KVM ioctl here: a [`Snapshot`] is host memory plus page sets, so it works for any VMM
/// and for slat's simulated machine alike. The pieces:
///
/// - [`GuestRegion`]: host memory the caller vouches for (`unsafe fn` [`GuestRegion::new`],
///   like [`crate::Memslot::register`]), in 4 KiB pages.
/// - [`Snapshot::take`]: one owned copy per region, of its non-zero pages only (a page that
///   was all zero is restored by zeroing it), so a large, mostly untouched guest costs about
///   the memory it has touched, not its size.
/// - [`DirtyPages`]: the pages to copy back, deduplicated — a bitmap per region for the
///   dedup and a list of page indices for the work, so adding, resetting and clearing cost
///   O(dirty pages) (adding a whole bitmap costs its words). Fed from GET_DIRTY_LOG bitmaps
///   ([`DirtyPages::add_bitmap`]), a [`crate::DirtySet`] ([`DirtyPages::add_dirty_set`]),
///   ring entries or page lists ([`DirtyPages::add_page`]); every index is bounds-checked.
/// - [`Snapshot::reset`]: copies the listed pages back and empties the set — or, when they
///   are more than [`Snapshot::crossover_pages`], copies everything back, which is cheaper
///   there (the crossover is measured once per process: [`crate::crossover_fraction`]).
/// - [`ChildSnapshot`] (incremental, [`Snapshot::child`]): only the pages dirtied since the
///   base, the base for every other page; reset to the child or back to the base.
/// - [`Snapshot::verify`] / [`ChildSnapshot::verify`]: guest memory against the snapshot,
///   byte for byte.
///
/// # Ordering: re-arm, then copy
///
/// A reset is a harvest followed by a copy, and the harvest must **re-arm the log before the
/// copy** — GET_DIRTY_LOG without manual protect (which clears and write-protects),
/// CLEAR_DIRTY_LOG with it, RESET_DIRTY_RINGS for rings, [`crate::Harvester::take`] — exactly
/// as a [`crate::DirtySet`] is copied only after `take` re-armed the log:
///
/// - re-arm, then copy: a guest (or DMA, vhost) write that lands after the re-arm is logged,
///   so the next reset restores it; one that lands between the re-arm and the copy of its page
///   is overwritten by the copy and logged as well, so the next reset merely copies that page
///   again. Nothing can stay different from the snapshot without being listed.
/// - copy, then re-arm: a write that lands after the copy of its page and before the re-arm is
///   erased from the log by the re-arm. The page now differs from the snapshot and no later
///   harvest lists it: every later reset leaves it wrong, silently.
///
/// With the vCPUs stopped for the reset (as the callers here do) no guest write can race it;
/// the order still matters for writes the VMM's own threads make, and it costs nothing.
/// A reset's host writes are not logged (KVM logs guest writes only), which is what a reset
/// wants: the restored page equals the snapshot.
///
///
/// Not `Sync`: a reset writes guest memory through `&self`, so one thread at a time.
#[derive(Debug)]
pub struct Snapshot {
    regions: Vec<GuestRegion>,
    copies: Vec<RegionCopy>,
    /// A reset of at least this many pages copies everything back instead.
    crossover: u64,
    _not_sync: std::marker::PhantomData<std::cell::Cell<()>>,
}

/// What one reset did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResetStats {
    /// Pages copied back.
    pub pages: u64,
    /// Pages copied from a child snapshot's own pages (0 for a base snapshot).
    pub from_child: u64,
    /// Of `pages`, those written back by zeroing (all zero in the snapshot).
    pub zeroed: u64,
    /// Whether the reset copied the whole snapshot back (the dirty pages were at least
    /// [`Snapshot::crossover_pages`], or [`Snapshot::reset_all`]): every page was written,
    /// `pages` still counts the listed ones (all of them for `reset_all`).
    pub full: bool,
}

impl Snapshot {
    /// Copies every region (stop the vCPUs first: [`GuestRegion::new`]'s contract).
    pub fn take(regions: Vec<GuestRegion>) -> Result<Snapshot, SnapshotError> {
        if regions.is_empty() {
            return Err(SnapshotError::Shape(
                "a snapshot needs at least one region".into(),
            ));
        }
        let copies = regions
            .iter()
            .map(|r| RegionCopy::take(r.bytes(), r.addr()))
            .collect::<Result<_, _>>()?;
        let pages: u64 = regions.iter().map(GuestRegion::pages).sum();
        // Rounded up, so a fraction of 1 (the full copy never cheaper) never switches.
        let crossover = ((pages as f64 * crossover_fraction()).ceil() as u64).max(1);
        Ok(Snapshot {
            regions,
            copies,
            crossover: if crossover_fraction() >= 1.0 {
                u64::MAX
            } else {
                crossover
            },
            _not_sync: std::marker::PhantomData,
        })
    }

    /// The regions, in index order.
    pub fn regions(&self) -> &[GuestRegion] {
        &self.regions
    }

    /// Pages in all regions.
    pub fn pages(&self) -> u64 {
        self.regions.iter().map(GuestRegion::pages).sum()
    }

    /// Pages whose contents the snapshot holds: those that were not all zero when it was
    /// taken (its memory is about this many pages, plus 4 bytes per page of index).
    pub fn held_pages(&self) -> u64 {
        self.copies.iter().map(RegionCopy::held_pages).sum()
    }

    /// A [`Self::reset`] of at least this many pages copies the whole snapshot back instead
    /// of page by page: [`crate::crossover_fraction`] of [`Self::pages`], measured on this
    /// machine; `u64::MAX` when the full copy never wins.
    pub fn crossover_pages(&self) -> u64 {
        self.crossover
    }

    /// Sets the crossover ([`Self::crossover_pages`]): `u64::MAX` always copies page by page,
    /// 0 always copies everything.
    pub fn set_crossover_pages(&mut self, pages: u64) {
        self.crossover = pages;
    }

    /// An empty page set sized for this snapshot's regions.
    pub fn dirty_pages(&self) -> DirtyPages {
        let pages: Vec<u64> = self.regions.iter().map(GuestRegion::pages).collect();
        DirtyPages::new(&pages)
    }

    /// Refuses a page set built for other regions.
    fn check_shape(&self, dirty: &DirtyPages) -> Result<(), SnapshotError> {
        if dirty
            .shape()
            .eq(self.regions.iter().map(GuestRegion::pages))
        {
            Ok(())
        } else {
            Err(SnapshotError::Shape(format!(
                "the page set covers regions of {:?} pages, the snapshot {:?}",
                dirty.shape().collect::<Vec<_>>(),
                self.regions
                    .iter()
                    .map(GuestRegion::pages)
                    .collect::<Vec<_>>()
            )))
        }
    }

    /// Page `page` of region `region` as snapshotted (both in bounds).
    fn page(&self, region: usize, page: u64) -> &[u8] {
        self.copies[region].page(page).0
    }

    /// Copies every page of `dirty` back from the snapshot and empties `dirty`. `dirty` must
    /// list every page written since guest memory last equalled this snapshot (harvested
    /// after re-arming the log: module docs). O(pages in `dirty`) — unless they are at least
    /// [`Self::crossover_pages`], where copying everything back ([`Self::reset_all`]) costs
    /// less, and is done instead (`full` in the stats).
    pub fn reset(&self, dirty: &mut DirtyPages) -> Result<ResetStats, SnapshotError> {
        self.check_shape(dirty)?;
        if dirty.len() >= self.crossover {
            let listed = dirty.len();
            dirty.clear();
            return Ok(ResetStats {
                pages: listed,
                ..self.reset_all()
            });
        }
        let mut stats = ResetStats::default();
        for (i, marks) in dirty.regions.iter().enumerate() {
            let (region, copy) = (&self.regions[i], &self.copies[i]);
            for &p in &marks.list {
                match copy.page(p) {
                    (_, true) => {
                        region.zero_page(p);
                        stats.zeroed += 1;
                    }
                    (src, false) => region.write_page(p, src),
                }
            }
            stats.pages += marks.list.len() as u64;
        }
        dirty.clear();
        Ok(stats)
    }

    /// Copies all of guest memory back (what a reset without dirty tracking costs): runs of
    /// held pages by one copy each, runs of zero pages by one zeroing each. Zeroing faults
    /// in pages the guest never touched: on a large, mostly untouched guest this costs host
    /// memory a per-page [`Self::reset`] does not.
    pub fn reset_all(&self) -> ResetStats {
        let mut stats = ResetStats {
            full: true,
            ..ResetStats::default()
        };
        for (r, copy) in self.regions.iter().zip(&self.copies) {
            for (first, pages, src) in copy.runs() {
                r.write_run(first, pages, src);
                stats.zeroed += if src.is_none() { pages } else { 0 };
            }
        }
        stats.pages = self.pages();
        stats
    }

    /// Compares guest memory with the snapshot byte for byte; the first difference is
    /// [`SnapshotError::Mismatch`].
    pub fn verify(&self) -> Result<(), SnapshotError> {
        for (i, (r, copy)) in self.regions.iter().zip(&self.copies).enumerate() {
            for (p, page) in r.bytes().chunks_exact(PAGE_SIZE as usize).enumerate() {
                if let Some(byte) = first_difference(page, copy.page(p as u64).0) {
                    return Err(mismatch(i, p as u64 * PAGE_SIZE + byte));
                }
            }
        }
        Ok(())
    }

    /// An incremental snapshot over this one: copies now the pages in `since_base` (every
    /// page written since guest memory last equalled this snapshot), and takes every other
    /// page from this snapshot. `since_base` is left as it was.
    pub fn child(&self, since_base: &DirtyPages) -> Result<ChildSnapshot<'_>, SnapshotError> {
        self.check_shape(since_base)?;
        let layers = since_base
            .regions
            .iter()
            .enumerate()
            .map(|(i, marks)| ChildRegion::copy(&self.regions[i], marks))
            .collect::<Result<_, _>>()?;
        Ok(ChildSnapshot { base: self, layers })
    }
}

/// A [`SnapshotError::Mismatch`] at byte `byte` of region `region`.
fn mismatch(region: usize, byte: u64) -> SnapshotError {
    SnapshotError::Mismatch {
        region,
        page: PageIndex::new(byte / PAGE_SIZE),
        byte: byte % PAGE_SIZE,
    }
}

/// The first index where `a` and `b` (same length) differ, a page at a time (memcmp).
fn first_difference(a: &[u8], b: &[u8]) -> Option<u64> {
    let chunk = PAGE_SIZE as usize;
    a.chunks(chunk)
        .zip(b.chunks(chunk))
        .enumerate()
        .find(|(_, (x, y))| x != y)
        .and_then(|(page, (x, y))| {
            let byte = x.iter().zip(y.iter()).position(|(p, q)| p != q)?;
            Some((page * chunk + byte) as u64)
        })
}

/// A child's own pages of one region: which, and their contents.
#[derive(Debug)]
struct ChildRegion {
    marks: RegionMarks,
    /// Page `marks.list[j]`'s contents at `j * PAGE_SIZE`.
    data: Box<[u8]>,
    /// `marks.list` sorted, with each page's index into `data`, for lookups.
    sorted: Vec<(u64, usize)>,
}

impl ChildRegion {
    fn copy(region: &GuestRegion, marks: &RegionMarks) -> Result<Self, SnapshotError> {
        let bytes = region.bytes();
        // At most the region's size, which exists: the product cannot overflow.
        let len = marks.list.len() * PAGE_SIZE as usize;
        let mut data = Vec::new();
        data.try_reserve_exact(len)
            .map_err(|_| SnapshotError::Alloc { bytes: len as u64 })?;
        for &p in &marks.list {
            data.extend_from_slice(&bytes[page_range(p)]);
        }
        let mut sorted: Vec<(u64, usize)> = marks
            .list
            .iter()
            .enumerate()
            .map(|(j, &p)| (p, j))
            .collect();
        sorted.sort_unstable();
        Ok(ChildRegion {
            marks: marks.clone(),
            data: data.into(),
            sorted,
        })
    }

    /// The child's copy of `page`, if the child has one.
    fn page(&self, page: u64) -> Option<&[u8]> {
        if !self.marks.contains(page) {
            return None;
        }
        let j = self.sorted.binary_search_by_key(&page, |&(p, _)| p).ok()?;
        Some(&self.data[page_range(self.sorted[j].1 as u64)])
    }
}

/// An incremental snapshot: the pages dirtied between its base and its taking, the base for
/// the rest ([`Snapshot::child`]). Resets go to the child or back to the base.
#[derive(Debug)]
pub struct ChildSnapshot<'b> {
    base: &'b Snapshot,
    layers: Vec<ChildRegion>,
}

impl ChildSnapshot<'_> {
    /// The base snapshot.
    pub fn base(&self) -> &Snapshot {
        self.base
    }

    /// Pages the child holds itself.
    pub fn own_pages(&self) -> u64 {
        self.layers.iter().map(|l| l.marks.list.len() as u64).sum()
    }

    /// An empty page set sized for the regions.
    pub fn dirty_pages(&self) -> DirtyPages {
        self.base.dirty_pages()
    }

    /// The page as this child has it.
    fn page(&self, region: usize, page: u64) -> &[u8] {
        self.layers[region]
            .page(page)
            .unwrap_or_else(|| self.base.page(region, page))
    }

    /// Resets to the child: `dirty` lists every page written since guest memory last equalled
    /// the child. Empties `dirty`.
    pub fn reset(&self, dirty: &mut DirtyPages) -> Result<ResetStats, SnapshotError> {
        self.base.check_shape(dirty)?;
        let mut stats = ResetStats::default();
        for (i, marks) in dirty.regions.iter().enumerate() {
            for &p in &marks.list {
                let own = self.layers[i].page(p);
                self.base.regions[i].write_page(p, own.unwrap_or_else(|| self.base.page(i, p)));
                stats.from_child += u64::from(own.is_some());
            }
            stats.pages += marks.list.len() as u64;
        }
        dirty.clear();
        Ok(stats)
    }

    /// Adds the child's own pages to `dirty`: the pages where child and base differ.
    fn add_own_pages(&self, dirty: &mut DirtyPages) -> Result<(), SnapshotError> {
        self.base.check_shape(dirty)?;
        for (i, layer) in self.layers.iter().enumerate() {
            for &p in &layer.marks.list {
                dirty.regions[i].mark(p);
            }
        }
        Ok(())
    }

    /// Resets to the base, from memory that last equalled the child plus the writes in
    /// `dirty` (the child's own pages are added). Empties `dirty`.
    pub fn reset_to_base(&self, dirty: &mut DirtyPages) -> Result<ResetStats, SnapshotError> {
        self.add_own_pages(dirty)?;
        self.base.reset(dirty)
    }

    /// Resets to the child, from memory that last equalled the base plus the writes in
    /// `dirty` (the child's own pages are added). Empties `dirty`.
    pub fn reset_from_base(&self, dirty: &mut DirtyPages) -> Result<ResetStats, SnapshotError> {
        self.add_own_pages(dirty)?;
        self.reset(dirty)
    }

    /// Compares guest memory with the child (its own pages, the base's elsewhere) byte for
    /// byte.
    pub fn verify(&self) -> Result<(), SnapshotError> {
        for (i, r) in self.base.regions.iter().enumerate() {
            let bytes = r.bytes();
            for p in 0..r.pages {
                let range = page_range(p);
                if let Some(b) = first_difference(&bytes[range.clone()], self.page(i, p)) {
                    return Err(mismatch(i, p * PAGE_SIZE + b));
                }
            }
        }
        Ok(())
    }
}
