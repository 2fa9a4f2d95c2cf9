//! Memslot operations: add, delete, move, change flags. Each runs under the slots lock (the
//! caller's guard is the proof) and publishes a new set; delete and move zap the old range and
//! complete its flush before they return.

use super::validate::{validate_flags, validate_host, validate_private_flags, validate_range};
use super::{
    AttributeBitmap, HostRange, Memslot, MemslotError, MemslotFlags, Memslots, PrivateBacking,
    SlotId,
};
use crate::direct_map::PrivateMemory;
use crate::dirty::bitmap::SlotBitmap;
use crate::format::PteFormat;
use crate::mmu::Mmu;
use crate::sync::Arc;
use slat_addr::{Gpa, PAGE_SHIFT};

/// The slots lock, held.
pub(crate) type SlotsHeld<'a, C> = crate::sync::MutexHeld<'a, (), C>;

/// A flag change that was published: the new slot, and whether the old one logged.
pub(crate) struct FlagChange {
    pub(crate) slot: Arc<Memslot>,
    pub(crate) was_logging: bool,
}

/// Whether a slot with these flags logs dirty pages (a read-only slot never does).
pub(crate) fn logs(flags: MemslotFlags) -> bool {
    flags.contains(MemslotFlags::LOG_DIRTY_PAGES) && !flags.contains(MemslotFlags::READONLY)
}

impl Memslots {
    /// Adds a slot, with a private backing if `private` is given (all its pages start
    /// shared); `bitmap(flags, npages)` makes its dirty bitmap, if it gets one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add<F: PteFormat>(
        &self,
        _held: &SlotsHeld<'_, F::Clock>,
        mmu: &Mmu<F>,
        id: SlotId,
        gpa: Gpa,
        size: u64,
        host: HostRange,
        private: Option<PrivateMemory>,
        flags: MemslotFlags,
        bitmap: impl FnOnce(MemslotFlags, u64) -> Option<Arc<SlotBitmap>>,
    ) -> Result<(), MemslotError> {
        let flags = validate_flags(id, flags)?;
        let cur = self.load();
        if cur.by_id(id).is_some() {
            return Err(MemslotError::DuplicateId { id });
        }
        validate_range::<F>(&cur, id, gpa, size, None)?;
        validate_host::<F>(id, size, &host)?;
        if let Some(p) = &private {
            validate_private_flags(id, flags)?;
            validate_host::<F>(id, size, &p.range)?;
            // Last: a lease taken by a slot that is then refused would be spent.
            if p.lease.as_ref().is_some_and(|l| !l.take_for_slot()) {
                return Err(MemslotError::PrivateAlreadyBound { id });
            }
        }
        let npages = size >> PAGE_SHIFT;
        let private = private.map(|p| PrivateBacking {
            host_addr: p.range.addr().raw(),
            host: p.range,
            lease: p.lease,
            attrs: Arc::new(AttributeBitmap::new(npages)),
        });
        let slot = Memslot {
            id,
            base_gfn: gpa.gfn(),
            npages,
            host_addr: host.addr(),
            host_page_size: host.page_size(),
            host,
            flags,
            dirty: bitmap(flags, npages),
            invalid: false,
            private,
        };
        // Before anything can map the range: its leaves go into this rmap.
        mmu.rmap.register(slot.base_gfn, npages);
        self.publish(mmu, |v| v.push(Arc::new(slot)));
        Ok(())
    }

    fn existing(&self, id: SlotId) -> Result<Arc<Memslot>, MemslotError> {
        self.load()
            .by_id(id)
            .cloned()
            .ok_or(MemslotError::UnknownSlot { id })
    }

    /// Deletes a slot, then zaps its range (flushed before this returns).
    pub(crate) fn delete<F: PteFormat>(
        &self,
        _held: &SlotsHeld<'_, F::Clock>,
        mmu: &Mmu<F>,
        id: SlotId,
    ) -> Result<(), MemslotError> {
        let slot = self.existing(id)?;
        self.publish(mmu, |v| v.retain(|s| s.id != id));
        mmu.zap_gfn_range(slot.base_gfn, slot.end_gfn());
        mmu.rmap.unregister(slot.base_gfn);
        // No guest maps the private pages any more: give them back to the host's direct map
        // now, on the VMM's thread (the lease's own drop may come later, anywhere).
        if let Some(lease) = slot.private.as_ref().and_then(|p| p.lease.as_ref()) {
            lease.release_range::<F::Clock>(0, slot.npages);
        }
        Ok(())
    }

    /// Moves a slot in three steps (see the comments).
    pub(crate) fn relocate<F: PteFormat>(
        &self,
        _held: &SlotsHeld<'_, F::Clock>,
        mmu: &Mmu<F>,
        id: SlotId,
        new_gpa: Gpa,
    ) -> Result<(), MemslotError> {
        let slot = self.existing(id)?;
        validate_range::<F>(&self.load(), id, new_gpa, slot.size(), Some(id))?;
        // Step 1: the old range stays published, invalid (KVM's `kvm_invalidate_memslot`).
        // A vCPU may still write through a leaf of the old range until the zap below has
        // flushed; with hardware-dirty tracking it logs that write by looking the gfn up, and
        // an invalid copy there is what it finds. Publishing the new range at once instead
        // dropped such marks (found by the churn oracle).
        let invalid = Arc::new(Memslot {
            invalid: true,
            ..(*slot).clone()
        });
        self.publish(mmu, |v| {
            v.retain(|s| s.id != id);
            v.push(invalid);
        });
        // Step 2: zap and flush under the MMU lock: afterwards no vCPU holds or walks a leaf
        // of the old range, so nothing can mark through it any more.
        mmu.zap_gfn_range(slot.base_gfn, slot.end_gfn());
        mmu.rmap.unregister(slot.base_gfn);
        mmu.rmap.register(new_gpa.gfn(), slot.npages);
        // Step 3: the new range. The log survives the move, as in KVM
        // (`kvm_prepare_memory_region` hands the old bitmap to the new slot): its bits are
        // slot-relative, and a page written before the move and not yet harvested must still
        // be reported after it.
        let moved = Arc::new(Memslot {
            base_gfn: new_gpa.gfn(),
            ..(*slot).clone()
        });
        self.publish(mmu, |v| {
            v.retain(|s| s.id != id);
            v.push(moved);
        });
        Ok(())
    }

    /// Publishes the slot with new flags (keeping its bitmap while it keeps logging, else
    /// taking `bitmap(flags, npages)`); `None` if the flags did not change. Turning logging on
    /// or off is the caller's next step.
    pub(crate) fn change_flags<F: PteFormat>(
        &self,
        _held: &SlotsHeld<'_, F::Clock>,
        mmu: &Mmu<F>,
        id: SlotId,
        flags: MemslotFlags,
        bitmap: impl FnOnce(MemslotFlags, u64) -> Option<Arc<SlotBitmap>>,
    ) -> Result<Option<FlagChange>, MemslotError> {
        let flags = validate_flags(id, flags)?;
        let slot = self.existing(id)?;
        if flags == slot.flags {
            return Ok(None);
        }
        if (flags ^ slot.flags).contains(MemslotFlags::READONLY) {
            return Err(MemslotError::ReadonlyChange { id });
        }
        if slot.has_private_backing() {
            validate_private_flags(id, flags)?;
        }
        let was_logging = slot.is_logging();
        let dirty = if was_logging && logs(flags) {
            slot.dirty.clone()
        } else {
            bitmap(flags, slot.npages)
        };
        let updated = Arc::new(Memslot {
            flags,
            dirty,
            ..(*slot).clone()
        });
        self.publish(mmu, |v| {
            v.retain(|s| s.id != id);
            v.push(updated.clone());
        });
        Ok(Some(FlagChange {
            slot: updated,
            was_logging,
        }))
    }
}
