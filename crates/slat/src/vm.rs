//! The VM: the public face of the engine. It holds one part per concept — the page table
//! ([`crate::mmu`]), the memslots ([`crate::memslot`]), the dirty log ([`crate::dirty`]) — and
//! every public operation is a short method here that hands the parts its module needs to it.
//! No feature module names `Vm` (the layering test checks it): each works on the parts.

use crate::age::{self, AgeFlush, AgeReport, IdleBitmap, WorkingSet};
use crate::config::VmConfig;
use crate::direct_map::PrivateMemory;
use crate::dirty::{disable_logging, mark_page_dirty, DirtyLog, DirtyLogError, DirtyRing, LogOut};
use crate::format::{Level, PteFormat};
use crate::memslot::{
    HostRange, MemoryAttributeError, MemoryAttributes, MemslotError, MemslotFlags, MemslotSet,
    Memslots, SlotId,
};
use crate::mmu::flush::{FlushError, PendingFlush};
use crate::mmu::inspect::Audit;
use crate::mmu::Mmu;
use crate::stats::{Counters, Stats};
use crate::sync::{self, Arc, Mutex};
use slat_addr::{Gfn, Gpa, PageIndex};

/// A guest's second-stage MMU.
pub struct Vm<F: PteFormat = crate::format::Ept> {
    /// The page table, its lock, allocator and flush protocol.
    pub(crate) mmu: Mmu<F>,
    /// The published memslot set.
    pub(crate) slots: Memslots,
    /// How the VM logs dirty pages, and the vCPUs' rings.
    pub(crate) dirty: DirtyLog,
    /// Each vCPU's counters, summed by [`Self::stats`].
    pub(crate) vcpu_counters: Mutex<Vec<Arc<Counters>>>,
}

impl<F: PteFormat> Vm<F> {
    /// Creates a VM with an empty page table and no memslots.
    pub fn new(config: VmConfig) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Vm {
            mmu: Mmu::new(config),
            slots: Memslots::new(),
            dirty: DirtyLog::new(),
            vcpu_counters: Mutex::new(Vec::new()),
        })
    }

    /// The configuration the VM was created with.
    pub fn config(&self) -> &VmConfig {
        &self.mmu.config
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> Stats {
        let blocks = sync::lock(&self.vcpu_counters);
        Stats::sum(
            std::iter::once(&self.mmu.counters).chain(blocks.iter().map(|c| &**c)),
            self.mmu.alloc.live_pages(),
        )
    }

    /// The current memslot set.
    pub fn memslots(&self) -> Arc<MemslotSet> {
        self.slots.load()
    }

    // -----------------------------------------------------------------------------------------
    // The page table (`mmu`).

    /// Refuses a call that may flush from a thread the flush would wait for: one that holds
    /// a vCPU of this VM in guest mode ([`crate::GuestMode`]), or is an online host CPU of a
    /// direct map one of the slots binds. Every public operation that may flush checks this
    /// first and returns [`FlushError::OwnGuestMode`] (in its own error type) with nothing
    /// changed; see [`crate::Vcpu::slow_page_fault`] for the fault path.
    fn check_flush(&self) -> Result<(), FlushError> {
        self.mmu.flush.check_own::<F::Clock>()?;
        for slot in self.slots.load().slots() {
            if let Some(lease) = slot.private.as_ref().and_then(|p| p.lease.as_ref()) {
                lease.direct_map().check_flush()?;
            }
        }
        Ok(())
    }

    /// Flushes every vCPU's TLB and waits for the acknowledgements. Refused
    /// ([`FlushError::OwnGuestMode`]) from a thread holding a vCPU of this VM in guest mode:
    /// the wait would never end.
    pub fn flush_remote_tlbs(&self) -> Result<(), FlushError> {
        self.mmu.flush_remote_tlbs()
    }

    /// Performs the flush an operation owes, then hands its unlinked table pages to epoch
    /// reclamation. The only way to free table pages. Refused as [`Self::flush_remote_tlbs`]
    /// is; the flush is then still owed, and done by the next one that completes.
    pub fn complete_flush(&self, pending: PendingFlush) -> Result<(), FlushError> {
        self.mmu.try_complete_flush(pending)
    }

    /// Unmaps `[start_gfn, end_gfn)` under the exclusive MMU lock with one batched flush.
    /// Tables wholly inside the range are freed; a huge leaf that straddles an edge is zapped
    /// whole (it is only a cache of the memslot, the next fault rebuilds what is still needed).
    ///
    /// The flush completes *before* the lock is released, as in KVM's `kvm_zap_gfn_range`: a
    /// zapped entry is empty, and a fault that fills an empty entry owes no flush, so with the
    /// lock released first a fault could install a mapping of another size over the range
    /// while some vCPU still caches the old one (a TLB conflict abort on arm64).
    ///
    /// Refused, with nothing zapped, from a thread the flush would wait for
    /// ([`FlushError::OwnGuestMode`]).
    pub fn zap_gfn_range(&self, start_gfn: Gfn, end_gfn: Gfn) -> Result<(), FlushError> {
        self.check_flush()?;
        self.mmu.zap_gfn_range(start_gfn, end_gfn);
        Ok(())
    }

    /// Walks the whole table and counts leaves per level and linked tables (tests and
    /// debugging: compare with [`Self::stats`]). Takes the MMU lock exclusively.
    pub fn audit(&self) -> Audit {
        self.mmu.audit()
    }

    /// Checks the reverse map against the tree (tests; see ARCHITECTURE.md, "The reverse
    /// map"): every leaf is in it with its table, and nothing else; with `wrprot` `walk` it is
    /// empty. Returns the number of leaves, or what disagreed. Call it with no operation in
    /// flight.
    pub fn audit_rmap(&self) -> Result<u64, String> {
        self.mmu.audit_rmap()
    }

    /// The leaf mapping `gfn`, if any: (entry value, level). Lock-free read for tests and tools.
    pub fn lookup(&self, gfn: Gfn) -> Option<(u64, Level)> {
        self.mmu.lookup(gfn)
    }

    // -----------------------------------------------------------------------------------------
    // Memslots (`memslot`).

    /// Adds a memslot mapping `[gpa, gpa + size)` onto the first `size` bytes of `host`,
    /// which the slot keeps alive (see [`HostMemory`](crate::HostMemory)).
    pub fn add_memslot(
        &self,
        id: SlotId,
        gpa: Gpa,
        size: u64,
        host: HostRange,
        flags: MemslotFlags,
    ) -> Result<(), MemslotError> {
        self.check_flush()?;
        self.add_slot(id, gpa, size, host, None, flags)
    }

    /// Adds a memslot with a second, private backing (a guest_memfd-like pool): `host` backs
    /// the slot's shared pages, `private` its `PRIVATE` pages (see
    /// [`Self::set_memory_attributes`]); the slot keeps both alive. Every page starts shared.
    /// Such a slot refuses `LOG_DIRTY_PAGES` and `READONLY`, now and later, as KVM does for
    /// guest_memfd slots ([`MemslotError::PrivateIncompatibleFlags`]), and maps at 4 KiB.
    ///
    /// `private` is plain host memory (a [`HostRange`]), or a range of a host direct map's
    /// pool ([`crate::direct_map::DirectMap::bind`]): then a private fault first accepts its
    /// page (removes it from the direct map), and a conversion back to shared or the slot's
    /// deletion releases it. A pool range serves one slot only
    /// ([`MemslotError::PrivateAlreadyBound`]). Call this, [`Self::set_memory_attributes`]
    /// and [`Self::delete_memslot`] from a thread that is not an online
    /// [`crate::direct_map::HostCpu`]: they may wait for a kernel TLB flush.
    pub fn add_memslot_with_private(
        &self,
        id: SlotId,
        gpa: Gpa,
        size: u64,
        host: HostRange,
        private: impl Into<PrivateMemory>,
        flags: MemslotFlags,
    ) -> Result<(), MemslotError> {
        self.check_flush()?;
        self.add_slot(id, gpa, size, host, Some(private.into()), flags)
    }

    fn add_slot(
        &self,
        id: SlotId,
        gpa: Gpa,
        size: u64,
        host: HostRange,
        private: Option<PrivateMemory>,
        flags: MemslotFlags,
    ) -> Result<(), MemslotError> {
        let held = self.slots.lock::<F::Clock>();
        let get_log = self.mmu.config.get_log;
        self.slots.add(
            &held,
            &self.mmu,
            id,
            gpa,
            size,
            host,
            private,
            flags,
            |flags, npages| self.dirty.new_bitmap(get_log, flags, npages),
        )
    }

    /// `KVM_SET_MEMORY_ATTRIBUTES`: makes `[first_gfn, first_gfn + npages)` private
    /// (`attrs` = [`MemoryAttributes::PRIVATE`]) or shared (empty). The range must lie inside
    /// memslots with no hole, and `PRIVATE` needs a private backing in each slot it touches;
    /// otherwise a [`MemoryAttributeError`] and nothing changes. If any page changes kind,
    /// the range is zapped and the flush completed before this returns: afterwards no vCPU
    /// can use a mapping of the old kind, and the next fault maps the backing the attribute
    /// selects (or exits with [`crate::FaultOutcome::MemoryFault`] if its access disagrees).
    pub fn set_memory_attributes(
        &self,
        first_gfn: Gfn,
        npages: u64,
        attrs: MemoryAttributes,
    ) -> Result<(), MemoryAttributeError> {
        self.check_flush()?;
        let held = self.slots.lock::<F::Clock>();
        self.slots
            .set_attributes(&held, &self.mmu, first_gfn.raw(), npages, attrs)
    }

    /// Deletes a memslot; its mappings are zapped and flushed before this returns, so the host
    /// memory may be released afterwards.
    pub fn delete_memslot(&self, id: SlotId) -> Result<(), MemslotError> {
        self.check_flush()?;
        let held = self.slots.lock::<F::Clock>();
        self.slots.delete(&held, &self.mmu, id)
    }

    /// Moves a memslot to a new guest address (same host memory). The old range is zapped and
    /// flushed before this returns; while the move runs, neither range maps (faults on the old
    /// one retry, on the new one exit as MMIO, as in KVM).
    pub fn move_memslot(&self, id: SlotId, new_gpa: Gpa) -> Result<(), MemslotError> {
        self.check_flush()?;
        let held = self.slots.lock::<F::Clock>();
        self.slots.relocate(&held, &self.mmu, id, new_gpa)
    }

    /// Changes a memslot's flags: turning dirty logging on write-protects the slot (after an
    /// eager split, unless configured off); turning it off ends the log (its unharvested bits
    /// are dropped, as KVM frees the bitmap: harvest first) and recovers huge mappings.
    /// `READONLY` cannot change on an existing slot (KVM refuses it too): a read-only slot
    /// does not log, so the toggle would silently end and restart the log, losing the pages
    /// written before it. Delete and re-add the slot instead.
    pub fn set_memslot_flags(&self, id: SlotId, flags: MemslotFlags) -> Result<(), MemslotError> {
        self.check_flush()?;
        let held = self.slots.lock::<F::Clock>();
        let get_log = self.mmu.config.get_log;
        let change = self
            .slots
            .change_flags(&held, &self.mmu, id, flags, |flags, npages| {
                self.dirty.new_bitmap(get_log, flags, npages)
            })?;
        let Some(change) = change else {
            return Ok(());
        };
        let slot = &change.slot;
        if slot.is_logging() && !change.was_logging {
            self.dirty.enable_logging(&self.mmu, slot);
        } else if change.was_logging && !slot.is_logging() {
            disable_logging(&self.mmu, slot);
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Dirty logging (`dirty`).

    /// Sets manual dirty-log protection (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`): `flags` is a
    /// combination of [`crate::dirty::MANUAL_PROTECT_ENABLE`] and
    /// [`crate::dirty::INITIALLY_SET`], or 0 to turn it off. Refused while a slot logs,
    /// because it changes what GET and enabling logging mean.
    pub fn set_manual_dirty_log_protect(&self, flags: u32) -> Result<(), DirtyLogError> {
        self.check_flush()?;
        self.dirty
            .set_manual_protect::<F::Clock>(&self.slots, flags)
    }

    /// Enables per-vCPU dirty rings of `entries` entries (`KVM_CAP_DIRTY_LOG_RING`). Must come
    /// before any vCPU exists and while no slot logs. Without `with_bitmap` the slots get no
    /// bitmap and GET/CLEAR are refused; with it (`KVM_CAP_DIRTY_LOG_RING_WITH_BITMAP`) the
    /// bitmap collects marks made without a vCPU ([`Vm::mark_page_dirty`]).
    pub fn enable_dirty_ring(&self, entries: u32, with_bitmap: bool) -> Result<(), DirtyLogError> {
        self.check_flush()?;
        self.dirty
            .enable_ring(&self.mmu, &self.slots, entries, with_bitmap)
    }

    /// Every vCPU's dirty ring, in vCPU creation order (empty without the ring).
    pub fn dirty_rings(&self) -> Vec<Arc<DirtyRing>> {
        self.dirty.rings::<F::Clock>()
    }

    /// Turns on the bugs in `bits` (see `slat::dirty::inject`). For oracle tests only.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn inject_bugs(&self, bits: u32) {
        self.mmu.hooks.set(bits);
    }

    /// Marks the page at `gpa` dirty from outside any vCPU (a VMM or device write into guest
    /// memory), in the slot's bitmap. Returns whether the slot logs; refused without a bitmap.
    pub fn mark_page_dirty(&self, gpa: Gpa) -> Result<bool, DirtyLogError> {
        mark_page_dirty(&self.mmu, &self.slots, gpa)
    }

    /// KVM_GET_DIRTY_LOG: fills `out` with the slot's dirty bitmap (one bit per page,
    /// `ceil(npages / 64)` words) and returns the number of dirty pages.
    ///
    /// Without manual protection the bits are cleared, the pages they name write-protected and
    /// a remote flush completed before this returns (invariant 4), by per-word exchange or by
    /// the bitmap switch ([`crate::GetLogVariant`]). With manual protection the bitmap is only
    /// copied; [`Self::clear_dirty_log`] does the rest.
    pub fn get_dirty_log(&self, id: SlotId, out: &mut [u64]) -> Result<u64, DirtyLogError> {
        self.check_flush()?;
        let out = LogOut::Dense(out);
        self.dirty.get_dirty_log(&self.mmu, &self.slots, id, out)
    }

    /// [`Self::get_dirty_log`] that gives only the non-zero words, as `(word index, bits)` in
    /// index order (bit `b` of word `i` is page `64 i + b` of the slot), replacing `out`'s
    /// contents: the caller's memory follows the dirty pages, not the slot's size. The same
    /// harvest otherwise (clears and re-protects without manual protection, copies with it).
    pub fn get_dirty_log_sparse(
        &self,
        id: SlotId,
        out: &mut Vec<(usize, u64)>,
    ) -> Result<u64, DirtyLogError> {
        self.check_flush()?;
        let out = LogOut::Sparse(out);
        self.dirty.get_dirty_log(&self.mmu, &self.slots, id, out)
    }

    /// KVM_CLEAR_DIRTY_LOG: for pages `first_page + i` with bit `i` of `bitmap` set, clears
    /// their dirty bits and write-protects those whose bit was actually set, then completes a
    /// remote flush. `first_page` must be a multiple of 64 and `num_pages` too unless the range
    /// ends the slot; bits beyond `num_pages` are ignored. Needs manual protection. Returns the
    /// number of bits cleared.
    pub fn clear_dirty_log(
        &self,
        id: SlotId,
        first_page: PageIndex,
        num_pages: u64,
        bitmap: &[u64],
    ) -> Result<u64, DirtyLogError> {
        self.check_flush()?;
        self.dirty
            .clear_dirty_log(&self.mmu, &self.slots, id, first_page, num_pages, bitmap)
    }

    /// [`Self::clear_dirty_log`] of the words `(word index, bits)` (bit `b` of word `i` is page
    /// `64 i + b` of the slot), in any order, with one remote flush for the whole list. An
    /// index past the slot's bitmap is refused ([`DirtyLogError::WordOutOfRange`]) before
    /// anything is cleared; bits past the slot's last page are ignored. Returns the number of
    /// bits cleared.
    pub fn clear_dirty_log_sparse(
        &self,
        id: SlotId,
        words: &[(usize, u64)],
    ) -> Result<u64, DirtyLogError> {
        self.check_flush()?;
        self.dirty
            .clear_dirty_log_words(&self.mmu, &self.slots, id, words)
    }

    /// KVM_RESET_DIRTY_RINGS: frees every harvested ring entry and write-protects its page
    /// (runs of entries in one 64-page window share one walk), then completes a remote flush.
    /// Entries of slots deleted or no longer logging since they were pushed are dropped.
    /// Returns the number of entries reset.
    pub fn reset_dirty_rings(&self) -> Result<u64, DirtyLogError> {
        self.check_flush()?;
        self.dirty.reset_rings(&self.mmu, &self.slots)
    }

    // -----------------------------------------------------------------------------------------
    // Aging (`age`; the module documentation has the semantics).

    /// Ages `[start_gfn, end_gfn)` without flushing TLBs (Linux's `clear_young`, KVM's
    /// `kvm_age_gfn`): every young leaf becomes old, clearing A (A/D bits) or access-tracking it
    /// (no A/D bits). Before this returns, `on_dirty(first_gfn, pages)` receives the pages of
    /// every leaf the pass aged while it was dirty (all of a huge leaf's pages, also those
    /// outside the range, since they share its W bit; adjacent leaves in one call), so the
    /// dirty state that clearing W takes out of the tree is handed to the caller. Runs
    /// concurrently with faults; see [`AgeFlush`](crate::AgeFlush) for what TLB entries cached
    /// before the pass mean.
    pub fn clear_young(
        &self,
        start_gfn: Gfn,
        end_gfn: Gfn,
        mut on_dirty: impl FnMut(Gfn, u64),
    ) -> AgeReport {
        age::clear_young(&self.mmu, start_gfn.raw(), end_gfn.raw(), |g, n| {
            on_dirty(Gfn::new(g), n)
        })
    }

    /// [`Self::clear_young`], then a remote TLB flush if the range maps anything, so every
    /// access made after this returns is seen (Linux's `clear_flush_young`). Refused as
    /// [`Self::age_gfn_range`] is.
    pub fn clear_flush_young(
        &self,
        start_gfn: Gfn,
        end_gfn: Gfn,
        on_dirty: impl FnMut(Gfn, u64),
    ) -> Result<AgeReport, FlushError> {
        self.age_gfn_range(start_gfn, end_gfn, AgeFlush::Flush, on_dirty)
    }

    /// Ages `[start_gfn, end_gfn)`, flushing or not as `flush` says. With
    /// [`AgeFlush::Flush`], refused with nothing aged from a thread the flush would wait for
    /// ([`FlushError::OwnGuestMode`]); if `on_dirty` itself enters guest mode and keeps the
    /// token, the pass stands but its flush is deferred to the next one, and the same error
    /// says so.
    pub fn age_gfn_range(
        &self,
        start_gfn: Gfn,
        end_gfn: Gfn,
        flush: AgeFlush,
        mut on_dirty: impl FnMut(Gfn, u64),
    ) -> Result<AgeReport, FlushError> {
        let (start, end) = (start_gfn.raw(), end_gfn.raw());
        self.aged(flush, |mmu| {
            age::age_gfn_range(mmu, start, end, flush, |g, n| on_dirty(Gfn::new(g), n))
        })
    }

    /// Runs an aging pass that flushes as `flush` says, checked before and after (see
    /// [`Self::age_gfn_range`]).
    fn aged(
        &self,
        flush: AgeFlush,
        pass: impl FnOnce(&Mmu<F>) -> AgeReport,
    ) -> Result<AgeReport, FlushError> {
        if flush == AgeFlush::NoFlush {
            return Ok(pass(&self.mmu));
        }
        self.check_flush()?;
        let r = pass(&self.mmu);
        // Still holding a token now means holding it at the flush: it was deferred.
        self.check_flush()?;
        Ok(r)
    }

    /// Reports which leaves in `[start_gfn, end_gfn)` are young, changing nothing (KVM's
    /// `kvm_test_age_gfn`). A page accessed through a TLB entry cached before the last aging
    /// pass may still look old (see [`AgeFlush`](crate::AgeFlush)).
    pub fn test_young(&self, start_gfn: Gfn, end_gfn: Gfn) -> AgeReport {
        age::test_young(&self.mmu, start_gfn.raw(), end_gfn.raw())
    }

    /// Marks every page of `bitmap` idle and ages its range, flushing or not as `flush` says
    /// (page_idle writes use [`AgeFlush::NoFlush`]). `on_dirty` as in [`Self::clear_young`].
    /// Refused as [`Self::age_gfn_range`] is.
    pub fn mark_idle(
        &self,
        bitmap: &mut IdleBitmap,
        flush: AgeFlush,
        mut on_dirty: impl FnMut(Gfn, u64),
    ) -> Result<AgeReport, FlushError> {
        self.aged(flush, |mmu| {
            age::mark_idle(mmu, bitmap, flush, |g, n| on_dirty(Gfn::new(g), n))
        })
    }

    /// Clears the idle bit of every page whose leaf is young, i.e. was accessed since the
    /// range was marked idle (or was mapped since), and returns the pages still idle. Changes
    /// no entry, so reading twice gives the same answer unless the guest ran in between.
    pub fn read_idle(&self, bitmap: &mut IdleBitmap) -> u64 {
        age::read_idle(&self.mmu, bitmap)
    }

    /// How much of `bitmap`'s range was touched since [`Self::mark_idle`]: refreshes the
    /// bitmap with [`Self::read_idle`] and counts the pages that are no longer idle.
    pub fn working_set(&self, bitmap: &mut IdleBitmap) -> WorkingSet {
        age::working_set(&self.mmu, bitmap)
    }
}
