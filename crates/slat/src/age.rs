//! Aging: which guest pages were accessed since they were last aged; documented on
//! [`AgeFlush`].

use crate::format::{pages_per_entry, table_index, Level, PteFormat};
use crate::mmu::flush::PendingFlush;
use crate::mmu::lock::Shared;
use crate::mmu::table::TablePage;
use crate::mmu::walk::Walk;
use crate::mmu::Mmu;
use crate::sync::{AtomicU64, Ordering};
use slat_addr::{Gfn, PAGE_SHIFT};

/// Guest pages (64 MiB) an aging pass covers per acquisition of the MMU lock (read mode).
pub const CHUNK_PAGES: u64 = 1 << 14;

/// Compare-and-swap attempts on one leaf before an aging pass leaves it young.
const AGE_RETRIES: u32 = 4;

/// Whether clearing young state also flushes the vCPUs' TLBs.
///
/// # Aging
///
/// Aging: which guest pages were accessed since they were last aged, for memory overcommit,
/// swap and working-set estimation (KVM's `kvm_age_gfn` / `kvm_test_age_gfn`, and the idle page
/// tracking that `access_tracking_perf_test` drives through them).
///
/// A leaf is *young* when it was accessed since it was last aged ([`PteFormat::is_accessed`]).
/// Aging makes it old with [`PteFormat::mark_access_tracked`], in one of two hardware modes,
/// chosen per leaf by [`crate::VmConfig::ad_bits`]:
///
/// - **A/D bits enabled**: aging clears the Accessed bit; the hardware walker sets it again (and
///   Dirty on a write) with an atomic update the next time it fills a TLB entry from the leaf.
///   Nothing faults.
/// - **A/D bits disabled**: aging *access-tracks* the leaf: R and X are saved in software bits
///   and R, W, X cleared, so the next access faults, and the lock-free fast path
///   ([`crate::Vcpu::fast_page_fault`]) restores the saved permissions (and W as well for a write to an
///   MMU-writable leaf, logging the page first in a dirty-logged slot). W is not saved: it comes
///   back through the same fast path as dirty-log write protection.
///
/// **Dirty state is never lost.** A leaf is dirty when its Dirty bit is set (A/D enabled) or it
/// is writable (A/D disabled, KVM's `is_dirty_spte`). Clearing A keeps D; access-tracking clears
/// W, so every pass that ages a dirty leaf hands its pages to the caller's `on_dirty` first (as
/// KVM calls `kvm_set_pfn_dirty`). The dirty *log* needs nothing from aging: a writable leaf in
/// a logged slot always has its log mark pending (set before W, invariant 3), and every harvest
/// that consumes a mark completes a remote flush, so a stale writable TLB entry left by aging
/// is flushed before that harvest returns (invariant 4 holds).
///
/// **Flushing.** [`crate::Vm::clear_young`] does not flush TLBs, like Linux's `clear_young` notifier
/// (page_idle, MGLRU) and KVM's x86 `clear_flush_young` (which elides the flush): a vCPU keeps
/// using translations it cached before the pass, so
/// - with A/D bits, accesses through a cached entry do not set A again: those pages look idle
///   although they were used (an underestimate of the working set, bounded by TLB reach);
/// - without A/D bits, accesses through a cached entry do not fault, with the same effect, and a
///   cached *writable* entry keeps allowing writes after W was cleared. Those writes are
///   invisible to later aging passes (the leaf is already old and not writable), so a caller
///   that tracks host dirtiness must treat pages passed to `on_dirty` as dirty until it unmaps
///   them ([`crate::Vm::zap_gfn_range`], which flushes) before cleaning them, as Linux's writeback does
///   through the invalidate notifier.
///
/// [`crate::Vm::clear_flush_young`] completes a remote flush whenever the range maps anything (also
/// when every leaf was already old: translations cached since an earlier `clear_young` would
/// otherwise survive it), so every access made after it returns is seen by the next test or
/// aging pass.
///
/// **Concurrency.** A pass holds the MMU lock in read mode, one chunk of [`CHUNK_PAGES`] pages
/// at a time, and changes each leaf with a compare-and-swap against the value it read (through
/// the VM's one SPTE-update function), so faults — which share the lock — run alongside it, and
/// so do the lock-free fast path and the hardware walker. Not lock-free like KVM 6.14's aging:
/// holders of the exclusive lock (zaps, harvest re-arms) update entries only hardware and the
/// fast path may touch with plain stores (`PteFormat::needs_atomic_update`), which a lock-free
/// ager would race with. Between chunks the lock is released, so a waiting exclusive holder
/// gets in and a pass never holds the lock for long; each chunk is finished before the next,
/// so the pass always makes progress. A lost race re-reads the entry: a fault or the hardware
/// walker made it young again (age it again), a zap removed it (skip it), a split made it a
/// table (walk into it). After a few lost races in a row on one leaf the pass leaves it
/// young, as KVM does: it is evidently in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AgeFlush {
    /// `clear_young`: no flush (page_idle, MGLRU; what KVM does on x86). Cheap; accesses
    /// through translations cached before the pass go unseen (see [`AgeFlush`]).
    #[default]
    NoFlush,
    /// `clear_flush_young`: complete a remote flush if the range maps anything, so every later
    /// access is seen.
    Flush,
}

impl AgeFlush {
    /// Name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            AgeFlush::NoFlush => "clear_young",
            AgeFlush::Flush => "clear_flush_young",
        }
    }
}

/// What one aging or test pass over a GFN range found. Page counts are 4 KiB pages inside the
/// range (a huge leaf that straddles an edge counts only its pages inside).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgeReport {
    /// Pages mapped by a leaf.
    pub mapped_pages: u64,
    /// Pages whose leaf was young when the pass reached it.
    pub young_pages: u64,
    /// Leaves that were young (a huge leaf counts once).
    pub young_leaves: u64,
    /// Leaves this pass made old (0 for a test pass).
    pub aged_leaves: u64,
    /// Pages of aged leaves that were dirty, each also passed to `on_dirty`: every page of
    /// such a leaf, inside the range or not (a huge leaf's pages share its dirty state).
    pub dirty_pages: u64,
    /// Leaves left young because they kept changing under the pass (four lost
    /// compare-and-swaps in a row).
    pub contended_leaves: u64,
    /// Chunks the pass took the MMU lock for: it releases the lock (yields) after each.
    pub yields: u64,
    /// A remote TLB flush was completed ([`AgeFlush::Flush`] and something is mapped).
    pub flushed: bool,
}

impl AgeReport {
    fn add_young(&mut self, pages: u64) {
        self.young_pages += pages;
        self.young_leaves += 1;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// Report young leaves, change nothing (`test_age`).
    Test,
    /// Report young leaves and make them old (`age`).
    Age,
}

/// The leaf may have been written since it was mapped (or its D bit last cleared): Dirty set
/// (A/D enabled), or writable (A/D disabled; KVM's `is_dirty_spte`). [`PteFormat::is_dirty`]
/// alone counts every leaf without A/D bits as dirty, which is right for dirty logging's
/// harvest but would report pages aging found read-only.
#[inline]
fn leaf_dirty<F: PteFormat>(pte: u64) -> bool {
    if F::ad_enabled(pte) {
        F::is_dirty(pte)
    } else {
        F::is_writable(pte)
    }
}

/// Why an idle bitmap cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdleError {
    /// Zero pages.
    #[error("an idle bitmap needs at least one page")]
    Empty,
    /// The range leaves the guest physical address space of the format.
    #[error("pages [{start_gfn:#x}, +{npages}) extend beyond the {max_gfn:#x} guest frames the format can map")]
    OutOfRange {
        /// First GFN asked for.
        start_gfn: Gfn,
        /// Pages asked for.
        npages: u64,
        /// Guest frames the format translates (one past the last).
        max_gfn: Gfn,
    },
    /// The bitmap could not be allocated (one bit per page: 2^40 pages take 128 GiB).
    #[error("cannot allocate an idle bitmap of {npages} pages")]
    Alloc {
        /// Pages asked for.
        npages: u64,
    },
}

/// Idle page tracking for a range of guest pages (Linux's `/sys/kernel/mm/page_idle/bitmap`,
/// one bit per 4 KiB guest page, owned by the caller).
///
/// [`crate::Vm::mark_idle`] sets every bit and ages the range; [`crate::Vm::read_idle`] clears the bit of
/// every page whose leaf was accessed since, and [`crate::Vm::working_set`] turns that into the
/// fraction touched. A page that is not mapped stays idle (nothing could access it without a
/// fault mapping it young). Huge leaves have one Accessed state for all their pages, so
/// touching one page of a 2 MiB leaf makes all 512 non-idle, as with Linux's transparent huge
/// pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdleBitmap {
    start_gfn: u64,
    npages: u64,
    words: Vec<u64>,
}

impl IdleBitmap {
    /// A bitmap for `npages` pages from `start_gfn`, every page not idle.
    pub fn new<F: PteFormat>(start: Gfn, npages: u64) -> Result<Self, IdleError> {
        let start_gfn = start.raw();
        let max_gfn = 1u64 << (F::MAX_PHYS_BITS - PAGE_SHIFT);
        if npages == 0 {
            return Err(IdleError::Empty);
        }
        if start_gfn >= max_gfn || npages > max_gfn - start_gfn {
            return Err(IdleError::OutOfRange {
                start_gfn: start,
                npages,
                max_gfn: Gfn::new(max_gfn),
            });
        }
        // Fallible: the size is the caller's, and an infallible allocation aborts on failure.
        let n = usize::try_from(npages.div_ceil(64)).map_err(|_| IdleError::Alloc { npages })?;
        let mut words = Vec::new();
        words
            .try_reserve_exact(n)
            .map_err(|_| IdleError::Alloc { npages })?;
        words.resize(n, 0);
        Ok(IdleBitmap {
            start_gfn,
            npages,
            words,
        })
    }

    /// First GFN covered.
    pub fn start_gfn(&self) -> Gfn {
        Gfn::new(self.start_gfn)
    }

    /// Pages covered.
    pub fn npages(&self) -> u64 {
        self.npages
    }

    /// One past the last GFN covered.
    pub fn end_gfn(&self) -> Gfn {
        // Checked in `new`: below the format's frame limit.
        Gfn::new(self.start_gfn + self.npages)
    }

    /// The bits: bit `i % 64` of word `i / 64` is page `start_gfn + i`, 1 = idle.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Whether `gfn` is idle, or `None` outside the bitmap.
    pub fn is_idle(&self, gfn: Gfn) -> Option<bool> {
        let i = gfn
            .raw()
            .checked_sub(self.start_gfn)
            .filter(|&i| i < self.npages)?;
        Some(self.words[(i / 64) as usize] & (1 << (i % 64)) != 0)
    }

    /// Pages currently idle.
    pub fn idle_pages(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }

    fn set_all(&mut self) {
        self.words.iter_mut().for_each(|w| *w = u64::MAX);
        let tail = self.npages % 64;
        if tail != 0 {
            if let Some(last) = self.words.last_mut() {
                *last = (1u64 << tail) - 1;
            }
        }
    }

    /// Clears the bits of GFNs `[lo, hi)` (inside the bitmap).
    fn clear_range(&mut self, lo: u64, hi: u64) {
        let (mut i, end) = (lo - self.start_gfn, hi - self.start_gfn);
        while i < end {
            let bit = i % 64;
            let n = (64 - bit).min(end - i);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            self.words[(i / 64) as usize] &= !mask;
            i += n;
        }
    }
}

/// How much of a range was touched since it was marked idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkingSet {
    /// Pages accessed since the range was marked idle.
    pub touched_pages: u64,
    /// Pages in the range.
    pub total_pages: u64,
}

impl WorkingSet {
    /// `touched_pages / total_pages`, in `[0, 1]`.
    pub fn fraction(&self) -> f64 {
        if self.total_pages == 0 {
            0.0
        } else {
            self.touched_pages as f64 / self.total_pages as f64
        }
    }
}

/// Ages `[start_gfn, end_gfn)` without flushing TLBs (Linux's `clear_young`, KVM's
/// `kvm_age_gfn`): every young leaf becomes old, clearing A (A/D bits) or access-tracking it
/// (no A/D bits). Before this returns, `on_dirty(first_gfn, pages)` receives the pages of
/// every leaf the pass aged while it was dirty (all of a huge leaf's pages, also those
/// outside the range, since they share its W bit; adjacent leaves in one call), so the
/// dirty state that clearing W takes out of the tree is handed to the caller. Runs
/// concurrently with faults; see the module documentation for what TLB entries cached
/// before the pass mean.
pub(crate) fn clear_young<F: PteFormat>(
    mmu: &Mmu<F>,
    start_gfn: u64,
    end_gfn: u64,
    on_dirty: impl FnMut(u64, u64),
) -> AgeReport {
    age_gfn_range(mmu, start_gfn, end_gfn, AgeFlush::NoFlush, on_dirty)
}

/// Ages `[start_gfn, end_gfn)`, flushing or not as `flush` says.
pub(crate) fn age_gfn_range<F: PteFormat>(
    mmu: &Mmu<F>,
    start_gfn: u64,
    end_gfn: u64,
    flush: AgeFlush,
    on_dirty: impl FnMut(u64, u64),
) -> AgeReport {
    let mut pending = PendingFlush::none();
    let mut r = age_walk(
        mmu,
        start_gfn,
        end_gfn,
        Op::Age,
        &mut pending,
        |_, _| {},
        on_dirty,
    );
    // Aging only changes leaves into leaves: no table leaves the tree, so nothing waits for
    // this flush to be freed, and skipping it (clear_young) leaks nothing. What it costs
    // is only the visibility of accesses through cached translations.
    debug_assert!(pending.graveyard.is_empty());
    match flush {
        AgeFlush::NoFlush => drop(pending),
        AgeFlush::Flush => {
            // Whenever anything is mapped, even if every leaf was old already: a leaf aged
            // by an earlier clear_young may still be cached, and accesses through it would
            // stay unseen (Linux flushes only young entries and has that blind spot).
            if r.mapped_pages > 0 {
                pending.require();
                r.flushed = true;
            }
            mmu.complete_flush(pending);
        }
    }
    r
}

/// Reports which leaves in `[start_gfn, end_gfn)` are young, changing nothing (KVM's
/// `kvm_test_age_gfn`). A page accessed through a TLB entry cached before the last aging
/// pass may still look old (see the module documentation).
pub(crate) fn test_young<F: PteFormat>(mmu: &Mmu<F>, start_gfn: u64, end_gfn: u64) -> AgeReport {
    let mut pending = PendingFlush::none();
    let r = age_walk(
        mmu,
        start_gfn,
        end_gfn,
        Op::Test,
        &mut pending,
        |_, _| {},
        |_, _| {},
    );
    debug_assert!(!pending.is_needed());
    drop(pending);
    r
}

/// Marks every page of `bitmap` idle and ages its range, flushing or not as `flush` says
/// (page_idle writes use [`AgeFlush::NoFlush`]). `on_dirty` as in [`clear_young`].
pub(crate) fn mark_idle<F: PteFormat>(
    mmu: &Mmu<F>,
    bitmap: &mut IdleBitmap,
    flush: AgeFlush,
    on_dirty: impl FnMut(u64, u64),
) -> AgeReport {
    bitmap.set_all();
    age_gfn_range(
        mmu,
        bitmap.start_gfn,
        bitmap.end_gfn().raw(),
        flush,
        on_dirty,
    )
}

/// Clears the idle bit of every page whose leaf is young, i.e. was accessed since the
/// range was marked idle (or was mapped since), and returns the pages still idle. Changes
/// no entry, so reading twice gives the same answer unless the guest ran in between.
pub(crate) fn read_idle<F: PteFormat>(mmu: &Mmu<F>, bitmap: &mut IdleBitmap) -> u64 {
    let mut pending = PendingFlush::none();
    let (start, end) = (bitmap.start_gfn, bitmap.end_gfn().raw());
    age_walk(
        mmu,
        start,
        end,
        Op::Test,
        &mut pending,
        |first, pages| bitmap.clear_range(first, first + pages),
        |_, _| {},
    );
    debug_assert!(!pending.is_needed());
    drop(pending);
    bitmap.idle_pages()
}

/// How much of `bitmap`'s range was touched since [`mark_idle`]: refreshes the
/// bitmap with [`read_idle`] and counts the pages that are no longer idle.
pub(crate) fn working_set<F: PteFormat>(mmu: &Mmu<F>, bitmap: &mut IdleBitmap) -> WorkingSet {
    let idle = read_idle(mmu, bitmap);
    WorkingSet {
        touched_pages: bitmap.npages - idle,
        total_pages: bitmap.npages,
    }
}

/// The one aging walk: visits every leaf in `[start, end)`, calls `young(first, pages)`
/// with the in-range GFNs of each young one and, for [`Op::Age`], makes it old with a
/// compare-and-swap through [`Mmu::update_spte`].
///
/// The walk stops at level 2: a huge leaf is handled where the walker finds it, and a table
/// of 4 KiB leaves is swept entry by entry in a plain loop over the table page (stepping the
/// general iterator through 512 leaves costs more than the compare-and-swaps themselves).
fn age_walk<F: PteFormat>(
    mmu: &Mmu<F>,
    start: u64,
    end: u64,
    op: Op,
    pending: &mut PendingFlush,
    young: impl FnMut(u64, u64),
    on_dirty: impl FnMut(u64, u64),
) -> AgeReport {
    let end = end.min(1u64 << (F::MAX_PHYS_BITS - PAGE_SHIFT));
    let mut p = AgePass {
        mmu,
        op,
        start,
        end,
        chunk: start,
        pending,
        // Neighbouring leaves are reported as one run: one call per run rather than per
        // leaf.
        young: Runs::new(young),
        on_dirty: Runs::new(on_dirty),
        r: AgeReport::default(),
    };
    while p.chunk < end {
        let chunk_end = end.min(p.chunk.saturating_add(CHUNK_PAGES));
        // The MMU lock in read mode, per chunk: faults run alongside (they share it), and
        // exclusive holders (zaps, harvest re-arms) may rely on no software writer but the
        // fast path racing with them (their plain stores, `needs_atomic_update`). Dropped
        // between chunks so a waiting exclusive holder gets in; each chunk is finished
        // before the next, so the pass always progresses.
        let lock = mmu.lock.read::<F::Clock>();
        let w = mmu.lock.shared(&lock);
        let guard = crate::sync::pin_c::<F::Clock>();
        let mut it = Walk::<F>::new(
            &guard,
            mmu.root(),
            2,
            Gfn::new(p.chunk),
            Gfn::new(chunk_end),
        );
        while it.valid() {
            let old = it.old;
            if !F::is_present(old) {
                it.next();
            } else if F::is_leaf(old, it.level) {
                // `false`: lost a race; `it.old` holds the value that won (young again,
                // zapped, or a table now, which the next round sweeps).
                let sptep = it.sptep();
                let (level, gfn) = (it.level, it.gfn);
                if p.leaf(w, sptep, level, gfn.raw(), &mut it.old) {
                    it.next();
                }
            } else if it.level == 2 {
                let lo = it.gfn.raw().max(p.chunk);
                let hi = it.entry_end().raw().min(chunk_end);
                // SAFETY: a table reached from the root through present entries under
                // the guard (and the read lock): it stays allocated while the guard lives,
                // even if unlinked meanwhile (then its entries are frozen, and every
                // compare-and-swap on them fails).
                let t = unsafe { TablePage::at(F::output_addr(old)) };
                p.sweep_table(w, t, lo, hi);
                it.next();
            } else {
                it.next();
            }
        }
        // The walk (which borrows the guard) and the guard end before the lock does.
        drop(guard);
        drop(lock);
        p.r.yields += 1;
        p.chunk = chunk_end;
    }
    p.young.finish();
    p.on_dirty.finish();
    p.r
}

/// The state of one aging or test pass.
struct AgePass<'a, F: PteFormat, Y: FnMut(u64, u64), D: FnMut(u64, u64)> {
    mmu: &'a Mmu<F>,
    op: Op,
    start: u64,
    end: u64,
    /// First GFN of the chunk being walked.
    chunk: u64,
    pending: &'a mut PendingFlush,
    young: Runs<Y>,
    on_dirty: Runs<D>,
    r: AgeReport,
}

impl<F: PteFormat, Y: FnMut(u64, u64), D: FnMut(u64, u64)> AgePass<'_, F, Y, D> {
    /// Ages the 4 KiB leaves for GFNs `[lo, hi)` of the level-1 table `t`, in a plain loop
    /// over the table page.
    #[inline(always)]
    fn sweep_table(&mut self, w: Shared<'_>, t: &TablePage, lo: u64, hi: u64) {
        for gfn in lo..hi {
            let sptep = &t.entries[table_index(Gfn::new(gfn), 1)];
            let mut cur = sptep.load(Ordering::Acquire);
            // A 4 KiB entry that is present is a leaf; one that went away under a
            // lost race (zapped, frozen) has nothing left to age.
            if F::is_present(cur) {
                self.leaf(w, sptep, 1, gfn, &mut cur);
            }
        }
    }

    /// Deals with the entry at `sptep` (level `level`, first GFN `gfn`), whose value the caller
    /// read into `old`: if it is a leaf, counts it, and for an aging pass makes it old.
    /// Returns false if a compare-and-swap lost a race and the refreshed `old` is no longer a
    /// leaf (the caller re-examines it); after [`AGE_RETRIES`] losses in a row on a leaf,
    /// gives up and counts it young.
    // Always inlined: the sweep of a leaf table calls it with a constant level, which prunes
    // most of it; a call per entry would cost as much as the entry's compare-and-swap.
    #[inline(always)]
    fn leaf(
        &mut self,
        w: Shared<'_>,
        sptep: &AtomicU64,
        level: Level,
        gfn: u64,
        old: &mut u64,
    ) -> bool {
        let mut lost = 0;
        loop {
            let cur = *old;
            if !F::is_present(cur) || !F::is_leaf(cur, level) {
                return false;
            }
            let entry_end = gfn + pages_per_entry(level);
            let lo = gfn.max(self.start);
            let hi = entry_end.min(self.end);
            if lo < self.chunk {
                // A huge leaf that began in an earlier chunk was dealt with there.
                return true;
            }
            let pages = hi - lo;
            let young = if !F::is_accessed(cur) {
                false
            } else if self.op == Op::Test {
                true
            } else {
                let new = F::mark_access_tracked(cur);
                let sink = self.mmu.sink();
                match self.mmu.update_spte(
                    sptep,
                    level,
                    Gfn::new(gfn),
                    old,
                    new,
                    w,
                    sink,
                    self.pending,
                ) {
                    Ok(()) => {
                        self.r.aged_leaves += 1;
                        if leaf_dirty::<F>(cur) {
                            // The whole leaf: a huge leaf straddling the range has one W
                            // for all its pages, and access-tracking clears it for all.
                            let n = entry_end - gfn;
                            self.r.dirty_pages += n;
                            self.on_dirty.add(gfn, n);
                        }
                        true
                    }
                    Err(_) => {
                        lost += 1;
                        if lost < AGE_RETRIES {
                            continue;
                        }
                        self.r.contended_leaves += 1;
                        true
                    }
                }
            };
            self.r.mapped_pages += pages;
            if young {
                self.r.add_young(pages);
                self.young.add(lo, pages);
            }
            return true;
        }
    }
}

/// Coalesces `(first_gfn, pages)` reports of adjacent ranges into one call per run.
struct Runs<C: FnMut(u64, u64)> {
    run: Option<(u64, u64)>,
    call: C,
}

impl<C: FnMut(u64, u64)> Runs<C> {
    fn new(call: C) -> Self {
        Runs { run: None, call }
    }

    #[inline(always)]
    fn add(&mut self, first: u64, pages: u64) {
        match &mut self.run {
            Some((f, n)) if *f + *n == first => *n += pages,
            _ => {
                if let Some((f, n)) = self.run.replace((first, pages)) {
                    (self.call)(f, n);
                }
            }
        }
    }

    fn finish(&mut self) {
        if let Some((f, n)) = self.run.take() {
            (self.call)(f, n);
        }
    }
}
