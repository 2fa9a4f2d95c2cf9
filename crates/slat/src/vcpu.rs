//! A vCPU bound to its VM: guest mode, flush requests, the fault handlers and its dirty ring.

use crate::dirty::{log_hardware_dirty, DirtyRing};
use crate::fault::{fast_page_fault, slow_page_fault, Fault, FaultOutcome, VcpuState};
use crate::format::PteFormat;
use crate::mmu::flush::{GuestMode, VcpuLink};
use crate::mmu::table::PageCache;
use crate::stats::Counters;
use crate::sync::{self, Arc};
use crate::vm::Vm;
use slat_addr::Gfn;

/// A vCPU of one VM: its table-page cache, memslot hint, counters and flush link, and the VM
/// it belongs to. The fault handlers are its methods, so a vCPU can only ever fault on, mark
/// dirty pages in and be flushed by its own VM. Dropping it removes it from the VM's flush
/// protocol (its dirty ring stays with the VM: unharvested entries are still owed).
pub struct Vcpu<F: PteFormat = crate::format::Ept> {
    vm: std::sync::Arc<Vm<F>>,
    state: VcpuState,
}

impl<F: PteFormat> Vm<F> {
    /// Creates a vCPU of this VM. Flushes from now on wait for it whenever it is in guest
    /// mode; dropping it removes it.
    pub fn create_vcpu(self: &std::sync::Arc<Self>, id: u32) -> Vcpu<F> {
        let ring = self.dirty.new_vcpu_ring();
        let link = Arc::new(VcpuLink::new());
        let counters = Arc::new(Counters::default());
        self.mmu.flush.join::<F::Clock>(link.clone());
        sync::lock_c::<F::Clock, _>(&self.vcpu_counters).push(counters.clone());
        Vcpu {
            vm: self.clone(),
            state: VcpuState {
                id,
                cache: PageCache::default(),
                slot_hint: self.slots.hint(),
                counters,
                link,
                ring,
            },
        }
    }
}

impl<F: PteFormat> Vcpu<F> {
    /// The vCPU index.
    pub fn id(&self) -> u32 {
        self.state.id
    }

    /// The VM this vCPU belongs to.
    pub fn vm(&self) -> &std::sync::Arc<Vm<F>> {
        &self.vm
    }

    /// Enters guest mode: from now until the returned token (and any other token of this
    /// vCPU) is dropped, every remote flush waits for this vCPU to acknowledge it, which it
    /// does in [`Self::service_requests`] between accesses. Service
    /// [`GuestMode::requests_at_entry`] before the first access.
    #[inline]
    pub fn enter_guest(&mut self) -> GuestMode<F::Clock> {
        VcpuLink::enter_guest(&self.state.link)
    }

    /// True while a [`GuestMode`] token of this vCPU lives.
    #[inline]
    pub fn in_guest(&self) -> bool {
        self.state.link.in_guest()
    }

    /// Requests pending now; check at every access boundary in guest mode.
    #[inline]
    pub fn pending_requests(&self) -> u32 {
        self.state.link.pending::<F::Clock>()
    }

    /// Services pending requests: calls `flush_tlb` for a TLB flush, then acknowledges.
    #[inline]
    pub fn service_requests(&self, flush_tlb: impl FnOnce()) -> u32 {
        self.vm
            .mmu
            .flush
            .service::<F::Clock>(&self.state.link, flush_tlb)
    }

    /// Resolves a fault from a context outside guest mode (a vCPU without a TLB of its own:
    /// tests, tools): the fast path in guest mode (if eligible and enabled), then the slow
    /// path outside it. Flush requests that arrive meanwhile are acknowledged.
    pub fn handle_fault(&mut self, fault: Fault) -> FaultOutcome {
        let guest = self.enter_guest();
        let fast = self.fast_page_fault(&guest, fault);
        self.service_requests(|| {});
        drop(guest);
        if let Some(o) = fast {
            return o;
        }
        self.slow_page_fault(fault)
    }

    /// The lock-free fast path (invariant 5). Fixes only (a) write faults on leaves
    /// write-protected for dirty logging (MMU-writable set, W clear) and (b) access-tracked
    /// leaves; returns `None` when the slow path must run.
    ///
    /// It runs in guest mode, proved by `guest` (this vCPU's token; another vCPU's token makes
    /// it return `None`): a remote flush then waits for the fix to finish, which is what keeps
    /// the table pages it walks allocated without an epoch pin, and makes the dirty mark
    /// visible to any harvest that could have missed it (see the comment at the CAS). It never
    /// blocks.
    pub fn fast_page_fault(
        &mut self,
        guest: &GuestMode<F::Clock>,
        fault: Fault,
    ) -> Option<FaultOutcome> {
        if !Arc::ptr_eq(&guest.link, &self.state.link) {
            return None;
        }
        fast_page_fault(&self.vm.mmu, &self.vm.slots, &mut self.state, fault)
    }

    /// The slow path, under the MMU lock in read mode (exclusive with the mutex variant).
    /// Outside guest mode only: with a [`GuestMode`] token of this vCPU alive, or when the
    /// calling thread holds another vCPU of the VM in guest mode (or is an online host CPU of
    /// the slot's direct map, for a private fault), it returns [`FaultOutcome::InGuestMode`]
    /// and does nothing: the lock's holder or the fault's own flush could wait for this
    /// thread.
    pub fn slow_page_fault(&mut self, fault: Fault) -> FaultOutcome {
        if self.state.link.in_guest() || self.vm.mmu.flush.check_own::<F::Clock>().is_err() {
            return FaultOutcome::InGuestMode;
        }
        slow_page_fault(&self.vm.mmu, &self.vm.slots, &mut self.state, fault)
    }

    /// This vCPU's dirty ring is past its soft limit: it must exit to the VMM, which harvests
    /// and resets, before running guest code again (KVM_EXIT_DIRTY_RING_FULL).
    #[inline]
    pub fn dirty_ring_full(&self) -> bool {
        self.state.ring.as_ref().is_some_and(|r| r.soft_full())
    }

    /// This vCPU's dirty ring, if the VM uses rings.
    pub fn dirty_ring(&self) -> Option<&Arc<DirtyRing>> {
        self.state.ring.as_ref()
    }

    /// This vCPU's hardware walker set the Dirty bit of the leaf mapping `gfn` (a write
    /// through a leaf with D clear): with hardware-dirty tracking, log the page — what PML
    /// does, done at once (see `ARCHITECTURE.md`). Call it in guest mode (`guest`), before the
    /// write the walk allows: a harvest's flush then waits for the mark.
    #[inline]
    pub fn log_hardware_dirty(&mut self, guest: &GuestMode<F::Clock>, gfn: Gfn) {
        // A token of another vCPU proves nothing about this one's mode; marking is still
        // harmless (a spurious dirty page), so mark either way.
        let _ = guest;
        let s = &mut self.state;
        log_hardware_dirty::<F::Clock>(
            &self.vm.mmu.config,
            &self.vm.slots,
            &mut s.slot_hint,
            &s.counters,
            gfn.raw(),
        );
    }
}

impl<F: PteFormat> Drop for Vcpu<F> {
    fn drop(&mut self) {
        self.vm.mmu.flush.leave::<F::Clock>(&self.state.link);
        self.state.cache.drain(&self.vm.mmu.alloc);
    }
}
