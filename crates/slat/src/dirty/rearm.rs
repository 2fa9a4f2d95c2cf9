//! Re-arming logging on leaves (so their next write is seen): whole ranges when logging is
//! enabled, and exactly the harvested pages in a harvest.

use super::DirtyTrack;
use crate::config::WrprotVariant;
use crate::format::{pages_per_entry, table_index, FrameStep, Level, PteFormat, ENTRIES_PER_TABLE};
use crate::huge_page::split_huge_pages;
use crate::mmu::flush::PendingFlush;
use crate::mmu::lock::{Exclusive, Shared, WriteGuard};
use crate::mmu::rmap::{validated, SlotRmap, RMAP_LEVELS};
use crate::mmu::table::TablePage;
use crate::mmu::walk::{round_down, Walk};
use crate::mmu::Mmu;
use crate::sync::{Arc, Guard, Ordering};
use slat_addr::{Gfn, Hva};

/// The value that re-arms logging on the 4 KiB leaf `old` (so its next write is seen), or
/// `None` if it is armed already: W cleared, or with hardware-dirty tracking D cleared.
#[inline]
fn rearmed<F: PteFormat>(mmu: &Mmu<F>, old: u64) -> Option<u64> {
    if !F::is_writable(old) {
        return None;
    }
    if mmu.config.dirty_track == DirtyTrack::HardwareDirty
        && F::HARDWARE_DIRTY
        && F::ad_enabled(old)
    {
        return F::is_dirty(old).then(|| F::clear_dirty(old));
    }
    Some(F::write_protect(old))
}

/// Arms logging on every leaf in `[start, end)`: 4 KiB leaves as [`rearmed`] says;
/// huge leaves (left when eager splitting is off) are write-protected whole, so their first
/// write faults and the slow path maps 4 KiB inside them.
pub(super) fn rearm_range<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    start: Gfn,
    end: Gfn,
    pending: &mut PendingFlush,
) {
    let guard = crate::sync::pin_c::<F::Clock>();
    let sink = mmu.sink();
    let mut it = Walk::<F>::new(&guard, mmu.root(), 1, start, end);
    while it.valid() {
        let old = it.old;
        if mmu.rmap.enabled() && F::is_present(old) && F::is_leaf(old, it.level) {
            // Enabling logging is where the rmap is made exact for the logged period.
            mmu.rmap_reassert(it.gfn, it.level, it.table());
        }
        let new = if !F::is_present(old) || !F::is_leaf(old, it.level) {
            None
        } else if it.level == 1 {
            rearmed(mmu, old)
        } else {
            F::is_writable(old).then(|| F::write_protect(old))
        };
        if let Some(new) = new {
            if mmu.set_spte(&mut it, new, w, sink, pending).is_err() {
                continue; // lost a race: re-examine the entry that won
            }
        }
        it.next();
    }
}

/// Re-arms logging ([`rearmed`]) on the 4 KiB pages `base_gfn + i` for each set bit
/// `i` of `mask`, under the exclusive MMU lock `lock` (`None`: `rmap-lockless`, which re-arms
/// without it, see [`rearm_masked_lockless`]). The leaf table holding them is found once
/// and remembered in `cursor` across calls, so a harvest descends once per leaf table that
/// holds dirty pages, and touches only the set bits' entries: the cost follows the dirty
/// pages. A huge leaf over the window (manual protect with INITIALLY_SET keeps huge leaves
/// until CLEAR) takes the general walk.
pub(super) fn rearm_masked<F: PteFormat>(
    mmu: &Mmu<F>,
    lock: Option<&WriteGuard<'_, F::Clock>>,
    cursor: &mut LeafCursor,
    base_gfn: Gfn,
    mask: u64,
    pending: &mut PendingFlush,
) {
    let Some(lock) = lock else {
        rearm_masked_lockless(mmu, base_gfn, mask, pending);
        return;
    };
    let w = mmu.lock.exclusive(lock);
    // The exclusive lock already keeps every table alive; the guard is what `Walk` asks for.
    let guard = crate::sync::pin_c::<F::Clock>();
    let sink = mmu.sink();
    // The slot's reverse map, found once per call (KVM's loop has its memslot in hand).
    let mut slot_rmap: Option<Arc<SlotRmap>> = None;
    let mut m = mask;
    while m != 0 {
        let gfn = base_gfn.plus(m.trailing_zeros() as u64);
        m &= m - 1;
        // `rmap-each` looks every page up, as KVM's legacy MMU does; the others reuse the
        // leaf table found for an earlier page of it.
        let reuse = mmu.config.wrprot != WrprotVariant::RmapEach;
        let t = match cursor.0 {
            Some((first, t))
                if reuse && gfn.raw().wrapping_sub(first.raw()) < ENTRIES_PER_TABLE as u64 =>
            {
                t
            }
            _ if mmu.config.wrprot.keeps_rmap() => match rmap_lookup(mmu, &mut slot_rmap, gfn) {
                RmapHit::Leaf4k(t) => {
                    cursor.0 = Some((round_down(gfn, ENTRIES_PER_TABLE as u64), t));
                    t
                }
                RmapHit::Huge => {
                    rearm_huge(mmu, w, gfn, pending);
                    cursor.0 = None;
                    continue;
                }
                RmapHit::None => {
                    cursor.0 = None;
                    continue;
                }
            },
            _ => {
                let it = Walk::<F>::to_leaf(&guard, mmu.root(), gfn);
                if !it.valid() || it.level != 1 {
                    if it.valid() && F::is_present(it.old) {
                        rearm_huge(mmu, w, gfn, pending);
                    }
                    cursor.0 = None;
                    continue;
                }
                cursor.0 = Some((round_down(gfn, ENTRIES_PER_TABLE as u64), it.table()));
                it.table()
            }
        };
        // SAFETY: `t` is a leaf table reached from the root under the exclusive MMU lock,
        // which this harvest holds throughout: nothing can unlink, let alone free, it.
        let sptep = &unsafe { TablePage::at(t) }.entries[table_index(gfn, 1)];
        let mut old = sptep.load(Ordering::Acquire);
        while F::is_present(old) {
            let Some(new) = rearmed(mmu, old) else {
                break;
            };
            if mmu
                .update_spte(sptep, 1, gfn, &mut old, new, w, sink, pending)
                .is_ok()
            {
                break;
            }
        }
    }
}

/// A huge leaf covers `gfn` in a window being re-armed: split it (eager splitting) and
/// re-arm the page, or write-protect the huge leaf whole.
#[cold]
fn rearm_huge<F: PteFormat>(mmu: &Mmu<F>, w: Exclusive<'_>, gfn: Gfn, pending: &mut PendingFlush) {
    let guard = crate::sync::pin_c::<F::Clock>();
    let sink = mmu.sink();
    let mut it = Walk::<F>::new(&guard, mmu.root(), 1, gfn, Gfn::new(gfn.raw() + 1));
    while it.valid() {
        let old = it.old;
        if !F::is_present(old) || !F::is_leaf(old, it.level) {
            it.next();
            continue;
        }
        if it.level > 1 && mmu.config.eager_split {
            split_huge_pages(mmu, w.cas(), it.gfn, it.entry_end(), pending);
            it.refresh();
            continue; // now a table: walk into it
        }
        let new = if it.level == 1 {
            rearmed(mmu, old)
        } else {
            F::is_writable(old).then(|| F::write_protect(old))
        };
        if let Some(new) = new {
            if mmu.set_spte(&mut it, new, w, sink, pending).is_err() {
                continue;
            }
        }
        it.next();
    }
}

/// The leaf table a harvest last descended to: (first GFN it maps, table address). Valid only
/// under the exclusive MMU lock that the harvest holds throughout (no table can be unlinked).
#[derive(Default)]
pub(super) struct LeafCursor(Option<(Gfn, Hva)>);

/// What the rmap says maps a gfn (variant `rmap`, under the exclusive MMU lock).
enum RmapHit {
    /// A 4 KiB leaf in this leaf table.
    Leaf4k(Hva),
    /// A huge leaf.
    Huge,
    /// Nothing: the rmap is exact (ARCHITECTURE.md, "The reverse map").
    None,
}

fn rmap_lookup<F: PteFormat>(
    mmu: &Mmu<F>,
    slot_rmap: &mut Option<Arc<SlotRmap>>,
    gfn: Gfn,
) -> RmapHit {
    if !slot_rmap.as_ref().is_some_and(|s| s.covers(gfn)) {
        *slot_rmap = mmu.rmap.find::<F::Clock>(gfn);
    }
    let Some(s) = slot_rmap.as_deref() else {
        return RmapHit::None;
    };
    for level in 1..=RMAP_LEVELS as Level {
        let Some(slot) = s.slot(gfn, level) else {
            continue;
        };
        // SAFETY: under the exclusive MMU lock no table is unlinked, let alone freed, and a
        // set slot names a page not yet freed (`Rmap::retire`); the lock holder is our caller.
        let Some(page) = (unsafe { validated(slot, gfn, level) }) else {
            continue;
        };
        let e = page.entries[table_index(gfn, level)].load(Ordering::Acquire);
        if F::is_present(e) && F::is_leaf(e, level) {
            return if level == 1 {
                RmapHit::Leaf4k(page.addr())
            } else {
                RmapHit::Huge
            };
        }
    }
    RmapHit::None
}

/// Variant `rmap-lockless`: re-arms the pages `base_gfn + i` for each set bit `i` of `mask`
/// without the MMU lock. Pinned in the epoch, each page is looked up in the rmap at every
/// level; a table whose header confirms the entry is trusted; W (or D) is cleared with one
/// compare-and-swap through the SPTE-update path, a huge leaf made read-only (never zapped
/// nor split here: the write that faults on it splits it). A lost race re-reads.
///
/// Why nothing is missed: a harvest consumed the page's mark before calling this. Every
/// writable leaf is in the rmap before the mark that follows it is set (a fault inserts after
/// its compare-and-swap and marks after that; a split inserts its leaves before publishing
/// them; the fast path only sets W on leaves already in it), so the mark we consumed was set
/// after the leaf was findable, and this lookup, which comes after the consumption, finds it
/// (the mark's release / the consumption's acquire order the rmap store before our load). A
/// leaf made writable after our lookup sets the mark again after doing so, and the next
/// harvest reports it. The caller completes a flush before returning (invariant 4).
fn rearm_masked_lockless<F: PteFormat>(
    mmu: &Mmu<F>,
    base_gfn: Gfn,
    mask: u64,
    pending: &mut PendingFlush,
) {
    let Some(s) = mmu.rmap.find::<F::Clock>(base_gfn) else {
        return;
    };
    let guard = crate::sync::pin_c::<F::Clock>();
    let mut m = mask;
    while m != 0 {
        let gfn = base_gfn.plus(m.trailing_zeros() as u64);
        m &= m - 1;
        protect_lockless(mmu, &s, &guard, gfn, pending);
    }
}

/// Re-arms whatever leaf the rmap names for `gfn`, at each level (see
/// [`rearm_masked_lockless`]); the guard proves the epoch pin.
///
/// A slot whose entry has become a table (a split published between the new leaves' slots
/// and the removal of the old one) is followed down: the split stores its new slots before
/// it removes the old one, so a reader that finds neither is not in that window.
fn protect_lockless<F: PteFormat>(
    mmu: &Mmu<F>,
    s: &SlotRmap,
    guard: &Guard,
    gfn: Gfn,
    pending: &mut PendingFlush,
) {
    // A compare-and-swap writer by type: no lock is held, so there is no other kind.
    let w = Shared::lockless(guard);
    for level in 1..=RMAP_LEVELS as Level {
        let Some(slot) = s.slot(gfn, level) else {
            continue;
        };
        // SAFETY: `guard` pins us; a set slot names a page whose free waits for a grace
        // period that starts after the slot is cleared (`Rmap::retire`).
        let Some(page) = (unsafe { validated(slot, gfn, level) }) else {
            continue;
        };
        let mut lvl = level;
        let mut sptep = &page.entries[table_index(gfn, lvl)];
        // Acquire: pairs with the release of whoever published the entry (and its table).
        let mut old = sptep.load(Ordering::Acquire);
        while lvl > 1 && F::is_present(old) && !F::is_leaf(old, lvl) {
            // SAFETY: a table entry read while pinned names a page not yet freed (invariant
            // 2: unlinked pages wait for a grace period that our pin holds back).
            let t = unsafe { TablePage::at(F::output_addr(old)) };
            lvl -= 1;
            sptep = &t.entries[table_index(gfn, lvl)];
            old = sptep.load(Ordering::Acquire);
        }
        let leaf = F::is_present(old) && F::is_leaf(old, lvl);
        protect_entry(mmu, w, sptep, lvl, gfn, old, pending);
        // Under loom: the page must still be allocated after the compare-and-swap too (a use
        // that outlived the pin would show here, not only at the lookup).
        #[cfg(loom)]
        crate::mmu::table::loom_life::check_use(page);
        if leaf {
            // The one leaf that maps `gfn` (the rmap is exact in a logged slot): no need to
            // look at the levels above.
            return;
        }
    }
}

/// Clears W (or D) on the leaf `sptep` at `level` (read as `old`) with compare-and-swaps,
/// re-reading after a lost race, until it is armed or no longer a leaf.
fn protect_entry<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    sptep: &crate::sync::AtomicU64,
    level: Level,
    gfn: Gfn,
    mut old: u64,
    pending: &mut PendingFlush,
) {
    let sink = mmu.sink();
    let first = round_down(gfn, pages_per_entry(level));
    loop {
        // Frozen (its table is being unlinked), a table (split since), or empty (zapped):
        // nothing this entry maps any more.
        if !F::is_present(old) || !F::is_leaf(old, level) {
            return;
        }
        let new = if level == 1 {
            rearmed(mmu, old)
        } else {
            F::is_writable(old).then(|| F::write_protect(old))
        };
        let Some(new) = new else {
            return;
        };
        if mmu
            .hooks
            .active(crate::test_hooks::inject::SKIP_LOCKLESS_CAS)
        {
            return;
        }
        // Invariant 1: a compare-and-swap against the value we read; on failure `old` is
        // the value that won and we look at it again.
        if mmu
            .update_spte(sptep, level, first, &mut old, new, w, sink, pending)
            .is_ok()
        {
            return;
        }
    }
}
