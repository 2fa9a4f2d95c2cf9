//! Dirty logging: which guest pages were written since the last harvest.
//!
//! Enabling logging on a memslot splits its huge leaves (eagerly, by default) and
//! write-protects every leaf while keeping MMU-writable, so the first write to each page takes
//! a fault that the lock-free fast path fixes and logs. A harvest follows invariant 4:
//! snapshot-and-clear the bitmap, write-protect exactly the pages it returned, complete a remote
//! flush, and only then return.

mod bitmap;

pub use bitmap::DirtyBitmap;

use crate::flush::PendingFlush;
use crate::format::PteFormat;
use crate::memslot::{Memslot, MemslotError, SlotId};
use crate::sync::{self, pin, Ordering};
use crate::vm::{UpdateMode, Vm};
use crate::walk::Walk;

impl<F: PteFormat> Vm<F> {
    /// Called with the slots lock held after a slot with logging on was published.
    pub(crate) fn enable_dirty_logging(&self, slot: &Memslot) {
        let (start, end) = (slot.base_gfn, slot.end_gfn());
        let mut pending = PendingFlush::none();
        {
            let _lock = self.mmu_lock.read();
            if self.config.eager_split {
                self.split_huge_pages(start, end, &mut pending);
            }
            self.write_protect_range(start, end, &mut pending);
        }
        // One flush, outside the MMU lock: the VMM cannot read the log before we return.
        pending.require();
        self.complete_flush(pending);
    }

    /// Called with the slots lock held after a slot with logging off was published: the 4 KiB
    /// mappings logging forced are dropped so faults rebuild huge ones where the backing allows.
    pub(crate) fn disable_dirty_logging(&self, slot: &Memslot) {
        if slot.host_page_size > crate::format::PAGE_SIZE {
            self.zap_gfn_range(slot.base_gfn, slot.end_gfn());
        }
    }

    /// Replaces every huge leaf in `[start, end)` with a table of equivalent smaller leaves,
    /// down to 4 KiB. Runs under the MMU lock in read mode, racing with faults (CAS; a lost
    /// race re-reads and retries). No flush: old and new translations are identical.
    fn split_huge_pages(&self, start: u64, end: u64, pending: &mut PendingFlush) {
        let guard = pin();
        let sink = self.sink();
        let mut it = Walk::<F>::new(&guard, self.root(), 2, start, end);
        while it.valid() {
            let old = it.old;
            if F::is_present(old) && F::is_leaf(old, it.level) && it.level > 1 {
                let child = self.alloc.alloc();
                for (i, e) in child.page().entries.iter().enumerate() {
                    e.store(F::split_child(old, it.level, i), Ordering::Relaxed);
                }
                let addr = child.addr();
                match self.set_spte(
                    &mut it,
                    F::make_table(addr),
                    UpdateMode::Shared,
                    sink,
                    pending,
                ) {
                    Ok(()) => {
                        child.into_linked();
                        sink.inc(crate::stats::Stat::Splits);
                    }
                    Err(_) => {
                        self.alloc.free_now(child);
                        continue; // re-examine the entry that won
                    }
                }
            }
            it.next();
        }
    }

    /// Clears W (keeping MMU-writable) on every writable leaf in `[start, end)`.
    fn write_protect_range(&self, start: u64, end: u64, pending: &mut PendingFlush) {
        let guard = pin();
        let sink = self.sink();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, start, end);
        while it.valid() {
            let old = it.old;
            if F::is_present(old)
                && F::is_leaf(old, it.level)
                && F::is_writable(old)
                && self
                    .set_spte(
                        &mut it,
                        F::write_protect(old),
                        UpdateMode::Shared,
                        sink,
                        pending,
                    )
                    .is_err()
            {
                continue; // lost a race: re-examine the entry that won
            }
            it.next();
        }
    }

    /// Write-protects the 4 KiB pages `base_gfn + i` for each set bit `i` of `mask`, walking
    /// only the leaf table that holds them.
    fn write_protect_masked(&self, base_gfn: u64, mask: u64, pending: &mut PendingFlush) {
        if mask == 0 {
            return;
        }
        let start = base_gfn + mask.trailing_zeros() as u64;
        let end = base_gfn + 64 - mask.leading_zeros() as u64;
        let guard = pin();
        let sink = self.sink();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, start, end);
        while it.valid() {
            let old = it.old;
            let bit = it.gfn.wrapping_sub(base_gfn);
            let wanted = it.level > 1 || (bit < 64 && mask & (1 << bit) != 0);
            if wanted
                && F::is_present(old)
                && F::is_leaf(old, it.level)
                && F::is_writable(old)
                && self
                    .set_spte(
                        &mut it,
                        F::write_protect(old),
                        UpdateMode::Exclusive,
                        sink,
                        pending,
                    )
                    .is_err()
            {
                continue; // lost a race: re-examine the entry that won
            }
            it.next();
        }
    }

    /// KVM_GET_DIRTY_LOG without manual protection: copies the slot's dirty bitmap into `out`
    /// (one bit per page, `ceil(npages / 64)` words), clears it, write-protects the pages it
    /// returned and completes a remote flush before returning (invariant 4). Words that are
    /// zero cost one load: the work is proportional to the dirty pages.
    pub fn get_dirty_log(&self, id: SlotId, out: &mut [u64]) -> Result<u64, MemslotError> {
        let _s = sync::lock(&self.slots_lock);
        let set = self.slots.load_full();
        let slot = set.by_id(id).ok_or(MemslotError::UnknownSlot { id })?;
        let bitmap = slot.dirty.as_ref().ok_or(MemslotError::NotLogging { id })?;
        let need = bitmap.nwords();
        if out.len() < need {
            return Err(MemslotError::BitmapTooSmall {
                id,
                need,
                have: out.len(),
            });
        }
        let mut dirty = 0u64;
        let mut pending = PendingFlush::none();
        {
            let _lock = self.mmu_lock.write();
            for (i, o) in out.iter_mut().enumerate().take(need) {
                let mask = bitmap.take_word(i);
                *o = mask;
                if mask != 0 {
                    dirty += mask.count_ones() as u64;
                    self.write_protect_masked(slot.base_gfn + 64 * i as u64, mask, &mut pending);
                }
            }
        }
        if dirty > 0 {
            pending.require();
        }
        self.complete_flush(pending);
        Ok(dirty)
    }
}
