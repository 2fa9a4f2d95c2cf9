//! Second-stage page faults: the lock-free fast path (here) and the slow path under the MMU
//! lock ([`slow`]). The public entry points are methods of [`crate::Vcpu`].

mod slow;

pub(crate) use slow::slow_page_fault;

use crate::clock::{Clock, Cost};
use crate::dirty::{commit_mark, mark_for, prepare_mark, DirtyRing, Pushed};
use crate::format::{Access, PteFormat};
use crate::memslot::{Memslots, SlotHint};
use crate::mmu::flush::{PendingFlush, VcpuLink};
use crate::mmu::lock::Shared;
use crate::mmu::table::PageCache;
use crate::mmu::walk::Walk;
use crate::mmu::Mmu;
use crate::stats::{Counters, Sink, Stat};
use crate::sync::{guest_mode_guard, Arc};
use slat_addr::Gfn;
use slat_addr::Gpa;

/// What the hardware walker saw when the access faulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Guest physical address of the access.
    pub gpa: Gpa,
    /// The access.
    pub access: Access,
    /// A leaf with some hardware permission was present (a permission fault, like an EPT
    /// violation with R, W or X set in the qualification); false for a not-present fault.
    pub present: bool,
    /// The access is private (a confidential guest's encrypted access: KVM's
    /// `PFERR_PRIVATE_ACCESS` / `fault->is_private`). It must agree with the page's
    /// [`crate::MemoryAttributes`], or the fault exits with [`FaultOutcome::MemoryFault`].
    pub private: bool,
}

/// How a fault was resolved. The caller re-executes the access in every case but `NoSlot` and
/// `ReadOnly`, which are exits to the VMM (MMIO), and `MemoryFault`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOutcome {
    /// The slow path installed or upgraded a mapping.
    Fixed,
    /// The lock-free fast path fixed the entry (write protection or access tracking).
    FixedFast,
    /// Nothing to do: another vCPU fixed it, or the TLB entry was stale.
    Spurious,
    /// Lost a race (entry changed or frozen, memslots changed); re-execute the access.
    Retry,
    /// No memslot contains the address: an MMIO exit.
    NoSlot,
    /// A write to a read-only memslot: an MMIO exit.
    ReadOnly,
    /// The slow path was called while this vCPU is in guest mode (a [`crate::GuestMode`] token of
    /// it is alive), or from a thread that holds another vCPU of the VM in guest mode (or, for
    /// a private fault, is an online host CPU of the slot's direct map). Nothing was done: the
    /// slow path may block on the MMU lock, whose holder may be waiting for this thread to
    /// acknowledge a flush, or flush itself. Drop the token and call again.
    InGuestMode,
    /// The vCPU's dirty ring has no room for the entry this write fix needs: exit to the
    /// VMM, which harvests and resets the rings, then re-execute the access.
    DirtyRingFull,
    /// The access's kind (private or shared) disagrees with the page's memory attribute:
    /// nothing was mapped. An exit to the VMM (KVM_EXIT_MEMORY_FAULT), which converts the
    /// range with `Vm::set_memory_attributes` (or kills the guest) and re-executes the access.
    MemoryFault {
        /// Guest physical address of the faulting page (4 KiB aligned).
        gpa: Gpa,
        /// Bytes covered (one 4 KiB page).
        size: u64,
        /// The access was private (the page is shared), or shared (the page is private).
        private: bool,
    },
}

/// What the fault handlers change on a vCPU, apart from the VM it belongs to.
pub(crate) struct VcpuState {
    pub(crate) id: u32,
    /// Table pages topped up outside the MMU lock, so a fault never allocates under it.
    pub(crate) cache: PageCache,
    pub(crate) slot_hint: SlotHint,
    pub(crate) counters: Arc<Counters>,
    pub(crate) link: Arc<VcpuLink>,
    pub(crate) ring: Option<Arc<DirtyRing>>,
}

/// Bounded retries of the fast path's compare-and-swap before it defers to the slow path.
const FAST_PF_RETRIES: usize = 4;

/// The lock-free fast path (see [`crate::Vcpu::fast_page_fault`]); the caller checked that
/// `vcpu` is in guest mode.
pub(crate) fn fast_page_fault<F: PteFormat>(
    mmu: &Mmu<F>,
    slots: &Memslots,
    vcpu: &mut VcpuState,
    fault: Fault,
) -> Option<FaultOutcome> {
    let eligible = mmu.config.fast_pf
        && ((fault.present && fault.access == Access::Write)
            || (!fault.present && !mmu.config.ad_bits));
    if !eligible {
        return None;
    }
    F::Clock::charge(Cost::FastFault, 1);
    let gfn = fault.gpa.gfn().raw();
    if in_private_capable_slot::<F::Clock>(slots, vcpu, gfn, fault) {
        return None;
    }
    let sink = Sink::Owned(&vcpu.counters);
    // SAFETY: `Vcpu::fast_page_fault` checked that a token of this vCPU is alive, so it is
    // in guest mode until we return; it holds `&mut Vcpu`, so it cannot acknowledge a
    // flush (that needs the vCPU) before we return.
    let guard = unsafe { guest_mode_guard() };
    let mut pushed = Pushed::default();
    for _ in 0..FAST_PF_RETRIES {
        let mut it = Walk::<F>::to_leaf(&guard, mmu.root(), Gfn::new(gfn));
        it.as_seen_by_handler();
        if !it.valid() || !F::is_present(it.old) {
            return None;
        }
        let old = it.old;
        if F::permits(old, fault.access) {
            sink.inc::<F::Clock>(Stat::PfSpurious);
            return Some(FaultOutcome::Spurious);
        }
        let mut new = old;
        if F::is_access_tracked(new) {
            new = F::restore_access_tracked(new);
        }
        let mut mark = None;
        if fault.access == Access::Write && !F::is_writable(new) {
            if !F::is_mmu_writable(new) {
                return None;
            }
            // Read the memslots only after the entry: enabling logging publishes the
            // bitmap before write-protecting, so seeing the protection implies seeing the
            // bitmap.
            let (set, hint) = slots.refresh::<F::Clock>(&mut vcpu.slot_hint);
            let (i, slot) = set.find_raw(gfn, *hint)?;
            *hint = i;
            if slot.is_invalid() {
                return None; // a move is in progress: the slow path retries
            }
            mark = mark_for(slot, vcpu.ring.as_deref());
            // One huge leaf cannot be logged per 4 KiB page: split it in the slow path.
            if mark.is_some() && it.level > 1 {
                return None;
            }
            new = F::make_writable(new);
        }
        if new == old || !F::permits(new, fault.access) {
            return None;
        }
        // Invariant 3 (see `prepare_mark` / `commit_mark` for the bitmap and ring orders).
        let ring = vcpu.ring.as_deref();
        if let Some(m) = mark {
            if !prepare_mark::<F::Clock>(m, ring, gfn, sink, &mut pushed) {
                return None; // ring full: the slow path reports it
            }
        }
        let mut pending = PendingFlush::none();
        let r = mmu.set_spte(&mut it, new, Shared::lockless(&guard), sink, &mut pending);
        mmu.complete_flush(pending);
        if r.is_ok() {
            if let Some(m) = mark {
                commit_mark::<F::Clock>(m, ring, gfn, sink, pushed);
            }
            sink.inc::<F::Clock>(Stat::PfFast);
            return Some(FaultOutcome::FixedFast);
        }
    }
    None
}

/// The fast path leaves faults in slots with a private backing (and every private access) to
/// the slow path, which checks the access against the page's attribute: restoring an
/// access-tracked leaf here would let an access of the wrong kind through without that check.
/// Such slots never log dirty pages, so only access-tracking fixes are given up.
#[inline]
fn in_private_capable_slot<C: crate::clock::Clock>(
    slots: &Memslots,
    vcpu: &mut VcpuState,
    gfn: u64,
    fault: Fault,
) -> bool {
    if fault.private {
        return true;
    }
    let (set, hint) = slots.refresh::<C>(&mut vcpu.slot_hint);
    match set.find_raw(gfn, *hint) {
        Some((i, slot)) => {
            *hint = i;
            slot.has_private_backing()
        }
        None => false,
    }
}
