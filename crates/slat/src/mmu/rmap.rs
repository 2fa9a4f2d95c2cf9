//! The reverse map: per memslot and level, gfn → the table page whose entry maps it.
//!
//! One slot per (memslot, level, gfn aligned to the level): this engine has one table per VM and
//! no aliases, so a gfn has at most one leaf per level (see ARCHITECTURE.md, "The reverse map").
//! A slot holds the host address of the table page, or 0; the entry is
//! `page.entries[table_index(gfn, level)]`. Only the SPTE-update path (`spte.rs`) writes slots.
//! Harvests look pages up here instead of walking the tree, with or without the MMU lock (the
//! lockless write-protect series, "KVM: MMU: locklessly write-protect").
//!
//! Readers without the MMU lock are pinned in the epoch and check the table's header
//! ([`super::table::TableMeta`]) before they trust the entry. Table pages the rmap may name are
//! retired in two grace periods ([`Rmap::retire`]) so a slot never names freed memory.

use super::table::{OwnedTable, TableAlloc, TableMeta, TablePage};
use crate::clock::Clock;
use crate::format::{pages_per_entry, FrameStep, Level};
use crate::sync::{self, pin, Arc, AtomicU64, Ordering, Published};
use slat_addr::{Gfn, Hva};

/// Levels that can hold leaves (4 KiB, 2 MiB, 1 GiB).
pub(crate) const RMAP_LEVELS: usize = 3;

/// The rmap of one memslot's gfn range.
pub(crate) struct SlotRmap {
    base_gfn: Gfn,
    npages: u64,
    /// Per level (index 0 = 4 KiB): one slot per level-aligned block overlapping the range.
    levels: [Box<[AtomicU64]>; RMAP_LEVELS],
}

impl SlotRmap {
    fn new(base_gfn: Gfn, npages: u64) -> Self {
        let levels = std::array::from_fn(|i| {
            let n = Self::blocks(base_gfn, npages, i as Level + 1);
            (0..n).map(|_| AtomicU64::new(0)).collect::<Box<[_]>>()
        });
        SlotRmap {
            base_gfn,
            npages,
            levels,
        }
    }

    fn blocks(base_gfn: Gfn, npages: u64, level: Level) -> usize {
        if npages == 0 {
            return 0;
        }
        let base_gfn = base_gfn.raw();
        let sh = pages_per_entry(level).trailing_zeros();
        (((base_gfn + npages - 1) >> sh) - (base_gfn >> sh) + 1) as usize
    }

    /// One past the last gfn.
    pub(crate) fn end_gfn(&self) -> Gfn {
        self.base_gfn.plus(self.npages)
    }

    pub(crate) fn covers(&self, gfn: Gfn) -> bool {
        gfn >= self.base_gfn && gfn < self.end_gfn()
    }

    /// The slot for the `level` entry whose range starts at (or contains) `gfn`.
    #[inline]
    pub(crate) fn slot(&self, gfn: Gfn, level: Level) -> Option<&AtomicU64> {
        if !(1..=RMAP_LEVELS as Level).contains(&level) {
            return None;
        }
        let sh = pages_per_entry(level).trailing_zeros();
        let i = (gfn.raw() >> sh).checked_sub(self.base_gfn.raw() >> sh)?;
        self.levels[level as usize - 1].get(i as usize)
    }

    /// Every non-empty slot: (first gfn of the entry, level, table address).
    pub(crate) fn entries(&self) -> impl Iterator<Item = (Gfn, Level, Hva)> + '_ {
        self.levels.iter().enumerate().flat_map(move |(li, v)| {
            let level = li as Level + 1;
            let sh = pages_per_entry(level).trailing_zeros();
            let first = self.base_gfn.raw() >> sh;
            v.iter().enumerate().filter_map(move |(i, s)| {
                let t = s.load(Ordering::Acquire);
                (t != 0).then_some((Gfn::new((first + i as u64) << sh), level, Hva::new(t)))
            })
        })
    }
}

/// Every memslot's rmap, published like the memslot set (registration happens under the slots
/// lock; the SPTE-update path reads it without locks).
pub(crate) struct Rmap {
    enabled: bool,
    set: Published<Vec<Arc<SlotRmap>>>,
    /// Slots still set when their range was unregistered (after its zap): leaks, must stay 0.
    leaked: AtomicU64,
}

impl Rmap {
    pub(crate) fn new(enabled: bool) -> Self {
        Rmap {
            enabled,
            set: Published::new(Vec::new()),
            leaked: AtomicU64::new(0),
        }
    }

    /// Bytes of the slots of every registered range (0 when the rmap is not kept: nothing is
    /// allocated for it).
    pub(crate) fn heap_bytes(&self) -> u64 {
        let set = self.set.load_full();
        let levels = set.iter().flat_map(|s| s.levels.iter());
        levels.map(|l| l.len() as u64 * 8).sum()
    }

    /// The rmap is kept (`wrprot` is `rmap`, `rmap-each` or `rmap-lockless`).
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Registers a gfn range before anything can map it (memslot add, the new range of a move).
    pub(crate) fn register(&self, base_gfn: Gfn, npages: u64) {
        if !self.enabled {
            return;
        }
        let mut v: Vec<Arc<SlotRmap>> = (*self.set.load_full()).clone();
        v.push(Arc::new(SlotRmap::new(base_gfn, npages)));
        self.set.store(Arc::new(v));
    }

    /// Unregisters a range after it was zapped and flushed (memslot delete, the old range of a
    /// move). Slots still set are counted in [`Self::leaked`].
    pub(crate) fn unregister(&self, base_gfn: Gfn) {
        if !self.enabled {
            return;
        }
        let mut v: Vec<Arc<SlotRmap>> = (*self.set.load_full()).clone();
        let mut left = 0;
        v.retain(|s| {
            if s.base_gfn == base_gfn {
                left += s.entries().count() as u64;
                false
            } else {
                true
            }
        });
        self.set.store(Arc::new(v));
        self.leaked.fetch_add(left, Ordering::Relaxed);
    }

    /// Slots found still set when their range was unregistered (see [`Self::unregister`]).
    pub(crate) fn leaked(&self) -> u64 {
        self.leaked.load(Ordering::Relaxed)
    }

    /// Runs `f` on the slot of (`gfn`, `level`), if a registered range holds it. No reference
    /// count is touched: every fault that installs a leaf comes through here.
    #[inline]
    fn with_slot<C: Clock>(&self, gfn: Gfn, level: Level, f: impl FnOnce(&AtomicU64)) {
        if !self.enabled {
            return;
        }
        self.set.with_c::<C, _>(|v| {
            if let Some(slot) = v
                .iter()
                .find(|s| s.covers(gfn))
                .and_then(|s| s.slot(gfn, level))
            {
                f(slot)
            }
        })
    }

    /// The rmap of the range holding `gfn`.
    #[inline]
    pub(crate) fn find<C: Clock>(&self, gfn: Gfn) -> Option<Arc<SlotRmap>> {
        if !self.enabled {
            return None;
        }
        self.set
            .load_full_c::<C>()
            .iter()
            .find(|s| s.covers(gfn))
            .cloned()
    }

    /// Every registered range.
    pub(crate) fn all(&self) -> Arc<Vec<Arc<SlotRmap>>> {
        self.set.load_full()
    }

    /// A leaf appeared at `level` for `gfn` in `table`. Release: a reader that sees the table
    /// address sees the table's header and the leaf that was published before this.
    #[inline]
    pub(crate) fn insert<C: Clock>(&self, gfn: Gfn, level: Level, table: Hva) {
        self.with_slot::<C>(gfn, level, |slot| {
            sync::store::<C, _>(slot, table.raw(), Ordering::Release)
        });
    }

    /// Like [`Self::insert`], but only into an empty slot (a split racing other splits of the
    /// same leaf, before its compare-and-swap).
    #[inline]
    pub(crate) fn claim<C: Clock>(&self, gfn: Gfn, level: Level, table: Hva) {
        self.with_slot::<C>(gfn, level, |slot| {
            let t = table.raw();
            let _ = sync::cas::<C, _>(slot, 0, t, Ordering::AcqRel, Ordering::Relaxed);
        });
    }

    /// The leaf at `level` for `gfn` in `table` went away. Only clears a slot that still names
    /// `table`: another table may already have taken over the gfn (a split's new leaves).
    #[inline]
    pub(crate) fn remove<C: Clock>(&self, gfn: Gfn, level: Level, table: Hva) {
        self.with_slot::<C>(gfn, level, |slot| {
            let t = table.raw();
            let _ = sync::cas::<C, _>(slot, t, 0, Ordering::AcqRel, Ordering::Relaxed);
        });
    }

    /// Hands unlinked, flushed table pages to reclamation. Without the rmap: one grace period.
    /// With it: after a first grace period — every thread that could still insert one of these
    /// pages into a slot (inserters are pinned while they hold a table) is gone — clear every
    /// slot still naming a page, then free after a second grace period, which waits for readers
    /// that took the address before the clearing.
    pub(crate) fn retire<C: Clock>(
        this: &Arc<Self>,
        alloc: &Arc<TableAlloc>,
        pages: Vec<OwnedTable>,
    ) {
        if pages.is_empty() {
            return;
        }
        let guard = sync::pin_c::<C>();
        if !this.enabled {
            TableAlloc::free_deferred::<C>(alloc, &guard, pages);
            guard.flush();
            return;
        }
        let addrs: Vec<Hva> = pages.into_iter().map(OwnedTable::into_linked).collect();
        let rmap = this.clone();
        let alloc = alloc.clone();
        guard.defer_c::<C, _>(move || {
            for &a in &addrs {
                // SAFETY: the page is unlinked and flushed but not freed: only the closure
                // deferred below frees it.
                rmap.sweep(unsafe { TablePage::at(a) });
            }
            // SAFETY: each address is an unlinked page we took ownership of above.
            let pages = addrs
                .into_iter()
                .map(|a| unsafe { OwnedTable::from_unlinked(a) })
                .collect();
            // Runs wherever the epoch collector runs: not charged to a simulated CPU.
            let g = pin();
            TableAlloc::free_deferred::<crate::clock::RealTime>(&alloc, &g, pages);
            g.flush();
        });
        guard.flush();
    }

    /// Clears every slot that still names `page` (see [`Self::retire`]).
    fn sweep(&self, page: &TablePage) {
        let packed = page.meta().get();
        let level = (packed & 7) as Level;
        if level == 0 || level as usize > RMAP_LEVELS {
            return; // never linked, or a table of tables only
        }
        let first = packed >> 3;
        let step = pages_per_entry(level);
        let addr = page.addr();
        for i in 0..crate::format::ENTRIES_PER_TABLE as u64 {
            self.remove::<crate::clock::RealTime>(Gfn::new(first + i * step), level, addr);
        }
    }
}

/// What a lock-free reader found for (`gfn`, `level`): the table whose header confirms it maps
/// that entry, or `None`.
///
/// # Safety
/// The caller is pinned in the reclamation epoch for as long as it uses the returned page.
#[inline]
pub(crate) unsafe fn validated<'a>(
    slot: &AtomicU64,
    gfn: Gfn,
    level: Level,
) -> Option<&'a TablePage> {
    // Acquire: pairs with the inserter's release store, so the header and the leaf it
    // published are visible.
    let t = slot.load(Ordering::Acquire);
    if t == 0 {
        return None;
    }
    // SAFETY: a slot names only pages not yet freed, or pages whose free waits for a grace
    // period that began after the slot was cleared ([`Rmap::retire`]); the caller is pinned.
    let page = unsafe { TablePage::at(Hva::new(t)) };
    let first = super::walk::round_down(gfn, pages_per_entry(level + 1));
    (page.meta().get() == TableMeta::pack(first, level)).then_some(page)
}
