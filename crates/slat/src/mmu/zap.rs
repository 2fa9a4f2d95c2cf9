//! Zap: unmapping a GFN range under the exclusive MMU lock, flushed before the lock is
//! released.

use super::flush::PendingFlush;
use super::lock::WriteGuard;
use super::table::TablePage;
use super::walk::Walk;
use super::Mmu;
use crate::format::PteFormat;
use slat_addr::Gfn;

impl<F: PteFormat> Mmu<F> {
    /// Unmaps `[start_gfn, end_gfn)` under the exclusive MMU lock with one batched flush.
    /// Tables wholly inside the range are freed; a huge leaf that straddles an edge is zapped
    /// whole (it is only a cache of the memslot, the next fault rebuilds what is still needed).
    ///
    /// The flush completes *before* the lock is released, as in KVM's `kvm_zap_gfn_range`. A
    /// zapped entry is empty, and a fault that fills an empty entry owes no flush; if the
    /// lock were released first, a fault could install a mapping of another size over the
    /// range (a 4 KiB leaf where a 2 MiB leaf was, with logging on) while some vCPU still
    /// caches the old one: two translations of one address, which arm64 forbids (a TLB
    /// conflict abort; break-before-make's "break" is only complete after the flush). Faults
    /// do not wait for vCPUs in guest mode, and vCPUs do not need the lock to acknowledge,
    /// so flushing under the lock cannot deadlock.
    pub fn zap_gfn_range(&self, start_gfn: Gfn, end_gfn: Gfn) {
        let mut lock = self.lock.write::<F::Clock>();
        let pending = self.zap_locked(&mut lock, start_gfn, end_gfn);
        self.complete_flush(pending);
        drop(lock);
    }

    pub(crate) fn zap_locked(
        &self,
        lock: &mut WriteGuard<'_, F::Clock>,
        start: Gfn,
        end: Gfn,
    ) -> PendingFlush {
        const YIELD_EVERY: u32 = 4096;
        let mut pending = PendingFlush::none();
        let guard = crate::sync::pin_c::<F::Clock>();
        let root = self.root;
        // SAFETY: the root lives as long as the VM.
        let mut it = Walk::<F>::new(&guard, unsafe { TablePage::at(root) }, 1, start, end);
        let mut visited = 0u32;
        while it.valid() {
            visited += 1;
            if visited % YIELD_EVERY == 0 && it.can_yield() {
                // Flush before letting faults in, as KVM does, so no vCPU keeps using a
                // translation of memory the caller is about to release.
                let p = std::mem::take(&mut pending);
                self.complete_flush(p);
                lock.bump();
                // Entries on the saved path may have been freed meanwhile: restart from the
                // root at the first GFN not yet visited.
                it.mark_yielded();
                it.next();
                continue;
            }
            let old = it.old;
            if F::is_present(old)
                && (F::is_leaf(old, it.level) || (it.gfn >= start && it.entry_end() <= end))
            {
                let _ = self.set_spte(
                    &mut it,
                    F::NON_PRESENT,
                    self.lock.exclusive(lock),
                    self.sink(),
                    &mut pending,
                );
            }
            it.next();
        }
        pending
    }
}
