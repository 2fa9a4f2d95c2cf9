//! Huge-page split: a huge leaf becomes a table of the equivalent smaller leaves, published
//! with one compare-and-swap (dirty logging needs 4 KiB leaves; the host direct map splits to
//! remove one page).

use super::flush::PendingFlush;
use super::lock::Shared;
use super::walk::Walk;
use super::Mmu;
use crate::format::PteFormat;
use crate::stats::Stat;
use crate::sync::Ordering;
use slat_addr::Gfn;

/// Replaces every huge leaf in `[start, end)` with a table of equivalent smaller leaves,
/// down to 4 KiB (a 1 GiB leaf becomes 2 MiB leaves, which the pre-order walk then visits
/// and splits in turn). Updates are compare-and-swaps (`w`), so this runs under the MMU lock
/// in either mode, racing with faults; a lost race re-reads the entry. No flush where the
/// format allows both translations at once (they are identical); with break-before-make
/// each block is invalidated and flushed before its table goes in (KVM arm64's
/// `kvm_pgtable_stage2_split`), and no cache maintenance: the memory is mapped already.
/// Returns the number of leaves split.
pub(crate) fn split_huge_pages<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    start: Gfn,
    end: Gfn,
    pending: &mut PendingFlush,
) -> u64 {
    let guard = crate::sync::pin_c::<F::Clock>();
    let sink = mmu.sink();
    let mut splits = 0;
    let mut it = Walk::<F>::new(&guard, mmu.root(), 2, start, end);
    while it.valid() {
        let old = it.old;
        if F::is_present(old) && it.level > 1 && F::is_leaf(old, it.level) {
            // Filled before it is reachable, so plain stores suffice.
            let child = mmu.alloc.alloc_with::<F::Clock>();
            for (i, e) in child.page().entries.iter().enumerate() {
                e.store(F::split_child(old, it.level, i), Ordering::Relaxed);
            }
            let table = F::make_table(child.addr());
            match mmu.replace_spte(&mut it, table, false, w, sink, pending) {
                Ok(()) => {
                    child.into_linked();
                    sink.inc::<F::Clock>(Stat::Splits);
                    splits += 1;
                }
                Err(_) => {
                    for e in child.page().entries.iter() {
                        e.store(F::NON_PRESENT, Ordering::Relaxed);
                    }
                    mmu.alloc.free_now(child);
                    continue; // re-examine the entry that won
                }
            }
        }
        it.next();
    }
    splits
}
