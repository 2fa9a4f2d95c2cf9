//! Turning logging on (write-protect or clear D on every leaf, after an eager split) and off
//! (huge mappings come back).

use super::rearm::rearm_range;
use super::DirtyLog;
use crate::config::RecoverVariant;
use crate::format::PteFormat;
use crate::huge_page::{recover_huge_pages, split_huge_pages};
use crate::memslot::Memslot;
use crate::mmu::flush::PendingFlush;
use crate::mmu::Mmu;
use slat_addr::PAGE_SIZE;

impl DirtyLog {
    /// Called with the slots lock held after a slot with logging on was published.
    pub(crate) fn enable_logging<F: PteFormat>(&self, mmu: &Mmu<F>, slot: &Memslot) {
        let mode = self.mode();
        if mode.manual() && mode.initially_set() && mode.uses_bitmap() {
            // Every bit starts set: the VMM will send everything anyway, and CLEAR protects
            // the pages it has sent, gradually.
            return;
        }
        let (start, end) = (slot.base_gfn, slot.end_gfn());
        // Drain fast-path fixes that read the memslots before this slot logged: they would not
        // mark, and their W 0→1 could land after the write-protect walk below found the leaf
        // already protected (left so by an earlier logging round). They run in guest mode, so a
        // completed flush means they are done; later ones see the logging slot. (Refused only
        // from a thread in guest mode, which the public entry refused before.)
        let _checked_at_entry = mmu.flush_remote_tlbs();
        let mut pending = PendingFlush::none();
        {
            let lock = mmu.lock.read::<F::Clock>();
            let w = mmu.lock.shared(&lock);
            if mmu.config.eager_split {
                split_huge_pages(mmu, w, start, end, &mut pending);
            }
            rearm_range(mmu, w, start, end, &mut pending);
        }
        // One flush, outside the MMU lock: the VMM cannot read the log before we return.
        pending.require();
        mmu.complete_flush(pending);
    }
}

/// Called with the slots lock held after a slot with logging off was published: the 4 KiB
/// mappings logging forced become huge again where the backing allows.
pub(crate) fn disable_logging<F: PteFormat>(mmu: &Mmu<F>, slot: &Memslot) {
    if slot.host_page_size <= PAGE_SIZE {
        return; // nothing bigger than 4 KiB can map it
    }
    match mmu.config.recover {
        // Faults in the range rebuild huge leaves as they come.
        RecoverVariant::OnFault => {}
        RecoverVariant::Zap => mmu.zap_gfn_range(slot.base_gfn, slot.end_gfn()),
        RecoverVariant::InPlace => {
            let mut pending = PendingFlush::none();
            {
                let lock = mmu.lock.read::<F::Clock>();
                recover_huge_pages(mmu, mmu.lock.shared(&lock), slot, &mut pending);
            }
            mmu.complete_flush(pending);
        }
    }
}
