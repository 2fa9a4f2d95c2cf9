//! Table pages: 4 KiB-aligned arrays of 512 atomic entries, their allocator and the per-vCPU
//! caches faults allocate from.
//!
//! Entries hold host addresses of child tables, so a table page must never move or be freed
//! while anything can still reach it. Pages are freed only through [`TableAlloc::free_deferred`],
//! which the flush path calls after the remote TLB flush completed (invariant 2), and which then
//! waits for an epoch grace period so lock-free software walkers are done too.

use crate::clock::{Clock, Cost, RealTime};
use crate::format::ENTRIES_PER_TABLE;
use crate::sync::{self, AtomicU64, Guard, Ordering};
use slat_addr::{Gfn, Hva};
use std::ptr::NonNull;

/// One page of a second-stage page table.
///
/// Only [`TableAlloc`] makes them (`#[non_exhaustive]`: no other crate can, and in this crate
/// only this module does), always inside a `TableFrame`, so every `TablePage` is followed by
/// its `TableMeta` header.
#[repr(C, align(4096))]
#[non_exhaustive]
pub struct TablePage {
    /// The 512 entries, read and updated atomically by software and hardware walkers.
    pub entries: [AtomicU64; ENTRIES_PER_TABLE],
}

/// What a table page maps (KVM's `sp->gfn` and `sp->role.level`): written before the page is
/// published, read by lock-free rmap readers to validate a table address they were given.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct TableMeta {
    /// `first_gfn << 3 | level` (0 = not yet linked anywhere).
    packed: AtomicU64,
}

impl TableMeta {
    /// Packs a first gfn and a level.
    #[inline]
    pub(crate) fn pack(first_gfn: Gfn, level: u8) -> u64 {
        (first_gfn.raw() << 3) | level as u64
    }
    /// Records what the page maps. Called by the only owner of an unpublished page (or under
    /// the exclusive lock for the root); publication (a release CAS or store of the parent
    /// entry, or a release store of an rmap slot after it) makes it visible.
    #[inline]
    pub(crate) fn set(&self, first_gfn: Gfn, level: u8) {
        self.packed
            .store(Self::pack(first_gfn, level), Ordering::Relaxed);
    }
    /// The packed value (compare with [`Self::pack`]).
    #[inline]
    pub(crate) fn get(&self) -> u64 {
        self.packed.load(Ordering::Relaxed)
    }
}

/// The allocation unit: a table page and its header (8 KiB with the alignment; the header
/// cannot live inside the page, which hardware walkers read as 512 entries).
#[repr(C, align(4096))]
struct TableFrame {
    page: TablePage,
    meta: TableMeta,
    /// Under loom: where the page is in its life ([`loom_life`]). A `std` atomic: loom threads
    /// run on one OS thread, so it follows the model's schedule exactly and adds nothing to
    /// the model.
    #[cfg(loom)]
    life: std::sync::atomic::AtomicU8,
}

impl TablePage {
    /// The table page at host address `addr`.
    ///
    /// # Safety
    /// `addr` must be the address of a live `TablePage` that stays allocated for `'a`
    /// (the caller is pinned in the reclamation epoch or holds the MMU lock for write and has
    /// not freed it).
    #[inline]
    pub unsafe fn at<'a>(addr: Hva) -> &'a TablePage {
        // SAFETY: guaranteed by the caller (see above).
        let page = unsafe { &*addr.as_ptr::<TablePage>() };
        #[cfg(loom)]
        loom_life::check_use(page);
        page
    }

    /// Host address of this page (what a table entry stores).
    #[inline]
    pub fn addr(&self) -> Hva {
        Hva::from_ptr(self)
    }

    /// The page's header: which gfn range and level it maps.
    #[inline]
    pub(crate) fn meta(&self) -> &TableMeta {
        // SAFETY: a `TablePage` cannot be constructed outside this crate (non_exhaustive), this
        // crate constructs them only in this module, and only as the first field of a
        // `TableFrame` (repr(C)), so the header lives in the same allocation, after the page,
        // for as long as `self` does.
        unsafe { &(*(self as *const TablePage as *const TableFrame)).meta }
    }
}

/// A table page owned by nobody but the holder (in a cache, or unlinked and awaiting free).
#[derive(Debug)]
pub struct OwnedTable(NonNull<TablePage>);

// SAFETY: an OwnedTable is a unique owner of a heap page of atomics; moving it between threads is
// like moving a Box.
unsafe impl Send for OwnedTable {}

impl OwnedTable {
    /// Host address of the page.
    pub fn addr(&self) -> Hva {
        Hva::from_ptr(self.0.as_ptr())
    }
    /// The page (still exclusively ours; writes need no atomics but use them for uniformity).
    pub fn page(&self) -> &TablePage {
        // SAFETY: we own the allocation; it is live until `TableAlloc::free_now` consumes us.
        unsafe { self.0.as_ref() }
    }
    /// Takes ownership of a table page that was unlinked from the tree.
    ///
    /// # Safety
    /// `addr` must be a page allocated by a [`TableAlloc`] that is no longer linked anywhere and
    /// that nobody else will free.
    pub unsafe fn from_unlinked(addr: Hva) -> OwnedTable {
        // SAFETY: non-null by the caller's guarantee.
        let t = OwnedTable(unsafe { NonNull::new_unchecked(addr.as_ptr::<TablePage>()) });
        #[cfg(loom)]
        loom_life::advance(t.page(), loom_life::UNLINKED);
        t
    }
    /// Gives up ownership: the page is now linked into the tree.
    pub fn into_linked(self) -> Hva {
        let a = self.addr();
        std::mem::forget(self);
        a
    }
}

impl Drop for OwnedTable {
    fn drop(&mut self) {
        // Every page must go back through its allocator so the live count stays exact; a drop
        // here is a leak and a bug.
        debug_assert!(
            std::thread::panicking(),
            "OwnedTable dropped without being freed"
        );
    }
}

/// Allocates and frees table pages and counts them. Shared by a VM and its deferred frees.
#[derive(Debug)]
pub struct TableAlloc {
    live: AtomicU64,
    allocated: AtomicU64,
}

impl Default for TableAlloc {
    fn default() -> Self {
        Self::new()
    }
}

impl TableAlloc {
    /// A new allocator with no pages.
    pub fn new() -> Self {
        #[cfg(loom)]
        {
            crate::sync::epoch_model::touch();
            loom_life::touch();
        }
        TableAlloc {
            live: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
        }
    }

    /// A zeroed (all non-present) page.
    pub fn alloc(&self) -> OwnedTable {
        self.alloc_with::<RealTime>()
    }

    /// [`Self::alloc`], charged to clock `C`: the allocation, the zeroing and the counters.
    #[inline]
    pub fn alloc_with<C: Clock>(&self) -> OwnedTable {
        sync::fetch_add::<C, _>(&self.live, 1, Ordering::Relaxed);
        sync::fetch_add::<C, _>(&self.allocated, 1, Ordering::Relaxed);
        C::charge(Cost::TableAlloc, 1);
        C::charge(Cost::ZeroPage, 1);
        OwnedTable(alloc_zeroed_page())
    }

    /// Frees a page nobody can reach (never linked, or a cache being torn down).
    pub fn free_now(&self, t: OwnedTable) {
        let p = t.0;
        std::mem::forget(t);
        free_page(p);
        self.live.fetch_sub(1, Ordering::Relaxed);
    }

    /// Frees unlinked pages after every thread now pinned has unpinned. The caller has already
    /// completed the remote TLB flush that made the unlink visible to hardware walkers.
    pub(crate) fn free_deferred<C: Clock>(
        this: &crate::sync::Arc<Self>,
        guard: &Guard,
        pages: Vec<OwnedTable>,
    ) {
        if pages.is_empty() {
            return;
        }
        let alloc = this.clone();
        #[cfg(loom)]
        for t in &pages {
            loom_life::advance(t.page(), loom_life::FREE_PENDING);
        }
        let addrs: Vec<Hva> = pages.into_iter().map(OwnedTable::into_linked).collect();
        guard.defer_c::<C, _>(move || {
            for a in addrs {
                // SAFETY: the page was unlinked, flushed from every TLB and the grace period has
                // passed, so we are its only owner.
                alloc.free_now(unsafe { OwnedTable::from_unlinked(a) });
            }
        });
    }

    /// Pages allocated and not yet freed (linked, cached, or awaiting a grace period).
    pub fn live_pages(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// Pages ever allocated.
    pub fn allocated_pages(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }
}

#[cfg(not(loom))]
fn alloc_zeroed_page() -> NonNull<TablePage> {
    let layout = std::alloc::Layout::new::<TableFrame>();
    // SAFETY: the layout has non-zero size; all-zero bytes are a valid TableFrame (atomics of 0,
    // which is the non-present value of every format and an unset header). The page is the
    // frame's first field, so the pointer is the page's too.
    let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut TablePage;
    match NonNull::new(p) {
        Some(p) => p,
        None => std::alloc::handle_alloc_error(layout),
    }
}

#[cfg(not(loom))]
fn free_page(p: NonNull<TablePage>) {
    // SAFETY: `p` came from `alloc_zeroed_page` with the same layout and is freed exactly once.
    unsafe {
        std::alloc::dealloc(
            p.as_ptr() as *mut u8,
            std::alloc::Layout::new::<TableFrame>(),
        )
    }
}

#[cfg(loom)]
fn alloc_zeroed_page() -> NonNull<TablePage> {
    let b = Box::new(TableFrame {
        page: TablePage {
            entries: std::array::from_fn(|_| AtomicU64::new(0)),
        },
        meta: TableMeta {
            packed: AtomicU64::new(0),
        },
        life: std::sync::atomic::AtomicU8::new(loom_life::LIVE),
    });
    // SAFETY: Box::into_raw never returns null; the page is the frame's first field.
    unsafe { NonNull::new_unchecked(Box::into_raw(b) as *mut TablePage) }
}

/// Under loom a freed page is poisoned, not deallocated: its memory stays valid for the rest
/// of the execution, so a use after free is reported (by [`TablePage::at`]) instead of being
/// undefined behaviour in the checker. The frame goes to the execution's graveyard, which
/// deallocates it when the execution ends.
#[cfg(loom)]
fn free_page(p: NonNull<TablePage>) {
    // SAFETY: `p` came from `alloc_zeroed_page` and is never deallocated before the
    // execution's graveyard is dropped, so it is a live page.
    let page = unsafe { p.as_ref() };
    loom_life::free(page);
}

/// Loom's view of a table page's life: live → unlinked (an owner took it back from the tree)
/// → free pending (handed to the last grace period) → freed (poisoned). Per execution.
#[cfg(loom)]
pub(crate) mod loom_life {
    use super::{TableFrame, TablePage};
    use std::sync::atomic::Ordering::SeqCst;

    pub(crate) const LIVE: u8 = 0;
    pub(crate) const UNLINKED: u8 = 1;
    pub(crate) const FREE_PENDING: u8 = 2;
    pub(crate) const FREED: u8 = 3;

    #[derive(Default)]
    struct Report {
        /// Frames freed in this execution (deallocated when it ends).
        graveyard: Vec<usize>,
        /// The first use after free (or double free) seen.
        uaf: Option<String>,
        reads_unlinked: u64,
        reads_free_pending: u64,
    }

    struct Graveyard(std::sync::Mutex<Report>);

    impl Drop for Graveyard {
        fn drop(&mut self) {
            let r = self.0.get_mut().unwrap_or_else(|e| e.into_inner());
            for a in r.graveyard.drain(..) {
                // SAFETY: each frame came from `Box::into_raw` in `alloc_zeroed_page`, is in
                // the graveyard once (a double free is reported, not recorded twice), and the
                // execution that could reach it is over.
                drop(unsafe { Box::from_raw(a as *mut TableFrame) });
            }
            // A use after free not already reported by the model itself fails the execution.
            if let Some(m) = r.uaf.take() {
                if !std::thread::panicking() {
                    panic!("{m}");
                }
            }
        }
    }

    loom::lazy_static! {
        static ref GRAVEYARD: Graveyard = Graveyard(std::sync::Mutex::new(Report::default()));
    }

    fn report() -> std::sync::MutexGuard<'static, Report> {
        GRAVEYARD.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Initialises this execution's report from the VM's creator, before other threads can
    /// reach it: a loom lazy static's first access is a release that every later access
    /// acquires, which must not link threads the model would otherwise leave unordered.
    pub(crate) fn touch() {
        drop(report());
    }

    fn frame(page: &TablePage) -> &TableFrame {
        // SAFETY: every `TablePage` is the first field of a `TableFrame` (see `meta`).
        unsafe { &*(page as *const TablePage as *const TableFrame) }
    }

    fn life(page: &TablePage) -> u8 {
        frame(page).life.load(SeqCst)
    }

    pub(crate) fn advance(page: &TablePage, to: u8) {
        frame(page).life.fetch_max(to, SeqCst);
    }

    fn uaf(m: String) {
        let mut r = report();
        r.uaf.get_or_insert(m);
    }

    pub(crate) fn free(page: &TablePage) {
        let was = frame(page).life.swap(FREED, SeqCst);
        if was == FREED {
            uaf(format!(
                "use after free of table page {:#x}: freed twice",
                page.addr()
            ));
        } else {
            report().graveyard.push(page.addr().raw() as usize);
        }
    }

    pub(crate) fn check_use(page: &TablePage) {
        match life(page) {
            LIVE => {}
            // Coverage counts readers only, not the retire's own sweep.
            UNLINKED | FREE_PENDING if crate::sync::epoch_model::in_deferred() => {}
            UNLINKED => report().reads_unlinked += 1,
            FREE_PENDING => report().reads_free_pending += 1,
            _ => uaf(format!(
                "use after free of table page {:#x}: reached after its last grace period",
                page.addr()
            )),
        }
    }

    pub(crate) fn take_uaf() -> Option<String> {
        report().uaf.take()
    }

    pub(crate) fn reads() -> (u64, u64) {
        let r = report();
        (r.reads_unlinked, r.reads_free_pending)
    }
}

#[cfg(loom)]
impl TablePage {
    /// Loom only: the first use after free of a table page seen in this execution (a page
    /// reached through [`TablePage::at`] after it was freed, or freed twice), taken so the
    /// model reports it from its main thread. One not taken fails the execution at its end.
    pub fn loom_use_after_free() -> Option<String> {
        loom_life::take_uaf()
    }
    /// Loom only, coverage: pages reached through [`TablePage::at`] in this execution (outside
    /// deferred work) after they were unlinked, and after their free was handed to the last
    /// grace period.
    pub fn loom_reads_of_retiring_pages() -> (u64, u64) {
        loom_life::reads()
    }
    /// Loom only, coverage: deferred frees run by another thread than the one that deferred
    /// them, because that thread was still pinned.
    pub fn loom_frees_held_back() -> u64 {
        crate::sync::epoch_model::frees_held_back()
    }
}

/// Pages a vCPU keeps ready so a fault never allocates under the MMU lock.
#[derive(Debug, Default)]
pub struct PageCache {
    pages: Vec<OwnedTable>,
}

impl PageCache {
    /// Ensures at least `min` pages are cached (called before taking the MMU lock).
    /// Charged to clock `C`.
    #[inline]
    pub fn top_up<C: Clock>(&mut self, alloc: &TableAlloc, min: usize) {
        while self.pages.len() < min {
            self.pages.push(alloc.alloc_with::<C>());
        }
    }
    /// Takes a zeroed page.
    pub fn take(&mut self) -> Option<OwnedTable> {
        self.pages.pop()
    }
    /// Returns a page that lost an install race. Its entries are still all non-present except
    /// when it was filled for a split, so the caller zeroes those before returning them.
    pub fn put_back(&mut self, t: OwnedTable) {
        self.pages.push(t);
    }
    /// Frees every cached page.
    pub fn drain(&mut self, alloc: &TableAlloc) {
        for t in self.pages.drain(..) {
            alloc.free_now(t);
        }
    }
}
