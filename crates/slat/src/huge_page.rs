//! Huge-page split (dirty logging needs 4 KiB leaves) and recovery (logging stopped: put the
//! huge leaves back so the guest runs with few TLB misses again).

use crate::format::{Level, PteFormat};
use crate::memslot::Memslot;
use crate::mmu::flush::PendingFlush;
use crate::mmu::lock::Shared;
use crate::mmu::table::TablePage;
use crate::mmu::walk::Walk;
use crate::mmu::Mmu;
use crate::stats::Stat;
use crate::sync::Ordering;
use slat_addr::Hva;

/// The split is a table operation (`mmu::split`): the direct map uses it too.
pub(crate) use crate::mmu::split::split_huge_pages;

/// In-place huge-page recovery (KVM 6.12's `recover_huge_pages_range`): every table in the
/// slot whose whole range the slot may map with one leaf of the table's level is replaced
/// by that leaf, with one compare-and-swap, under the MMU lock in read mode. The huge leaf
/// takes its permissions from the first leaf found below (so write protection and access
/// tracking carry over and the fast path fixes them as usual). Tables nobody mapped
/// anything in are left alone. The unlinked tables go to `pending`; the caller flushes once.
/// With break-before-make each table is rebuilt as a block in the configured
/// [`RebuildOrder`](crate::RebuildOrder) instead, with its own flush. Returns the number of tables replaced.
pub(crate) fn recover_huge_pages<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    slot: &Memslot,
    pending: &mut PendingFlush,
) -> u64 {
    debug_assert!(!slot.is_logging());
    let guard = crate::sync::pin_c::<F::Clock>();
    let sink = mmu.sink();
    let mut recovered = 0;
    let mut it = Walk::<F>::new(&guard, mmu.root(), 2, slot.base_gfn, slot.end_gfn());
    while it.valid() {
        let old = it.old;
        let candidate = F::is_present(old)
            && it.level <= F::MAX_LEAF_LEVEL
            && !F::is_leaf(old, it.level)
            && slot.max_level_raw::<F>(it.gfn.raw()) >= it.level;
        if candidate {
            if let Some(leaf) = first_leaf::<F>(F::output_addr(old), it.level - 1) {
                let huge = F::make_huge(leaf, it.level);
                debug_assert_eq!(F::output_addr(huge), Hva::new(slot.hva_raw(it.gfn.raw())));
                if mmu
                    .replace_spte(&mut it, huge, false, w, sink, pending)
                    .is_err()
                {
                    continue; // re-examine the entry that won
                }
                sink.inc::<F::Clock>(Stat::Recoveries);
                recovered += 1;
            }
        }
        it.next();
    }
    recovered
}

/// The first present leaf in the table at `addr` (of `level`) or below it.
fn first_leaf<F: PteFormat>(addr: Hva, level: Level) -> Option<u64> {
    // SAFETY: the caller read a present entry pointing here inside its reclamation guard; an
    // unlinked table stays allocated until every such guard is gone.
    let t = unsafe { TablePage::at(addr) };
    for e in t.entries.iter() {
        let v = e.load(Ordering::Acquire);
        if !F::is_present(v) {
            continue;
        }
        if F::is_leaf(v, level) {
            return Some(v);
        }
        if let Some(l) = first_leaf::<F>(F::output_addr(v), level - 1) {
            return Some(l);
        }
    }
    None
}
