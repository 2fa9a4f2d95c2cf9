//! Second-stage page faults: the lock-free fast path and the slow path under the MMU lock.

use crate::cmo::CmoPolicy;
use crate::dirty::RecoverVariant;
use crate::flush::GuestMode;
use crate::flush::PendingFlush;
use crate::format::{bytes_per_entry, Access, LeafPerms, PteFormat, PAGE_SHIFT};
use crate::memslot::MemslotSet;
use crate::stats::{Sink, Stat};
use crate::sync::Arc;
use crate::sync::{guest_mode_guard, pin, Ordering};
use crate::vm::{SlotHint, UpdateMode, Vcpu, VcpuState, Vm};
use crate::walk::Walk;

/// What the hardware walker saw when the access faulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Guest physical address of the access.
    pub gpa: u64,
    /// The access.
    pub access: Access,
    /// A leaf with some hardware permission was present (a permission fault, like an EPT
    /// violation with R, W or X set in the qualification); false for a not-present fault.
    pub present: bool,
}

/// How a fault was resolved. The caller re-executes the access in every case but `NoSlot` and
/// `ReadOnly`, which are exits to the VMM (MMIO).
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
    /// The slow path was called while this vCPU is in guest mode (a [`GuestMode`] token of
    /// it is alive). Nothing was done: the slow path may block on the MMU lock, whose holder
    /// may be waiting for this vCPU to acknowledge a flush. Drop the token and call again.
    InGuestMode,
    /// The vCPU's dirty ring has no room for the entry this write fix needs: exit to the
    /// VMM, which harvests and resets the rings, then re-execute the access.
    DirtyRingFull,
}

/// Bounded retries of the fast path's compare-and-swap before it defers to the slow path.
const FAST_PF_RETRIES: usize = 4;

impl<F: PteFormat> Vcpu<F> {
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
    pub fn fast_page_fault(&mut self, guest: &GuestMode, fault: Fault) -> Option<FaultOutcome> {
        if !Arc::ptr_eq(&guest.link, &self.state.link) {
            return None;
        }
        self.vm.fast_page_fault(&mut self.state, fault)
    }

    /// The slow path, under the MMU lock in read mode (exclusive with the mutex variant).
    /// Outside guest mode only: with a [`GuestMode`] token of this vCPU alive it returns
    /// [`FaultOutcome::InGuestMode`] and does nothing.
    pub fn slow_page_fault(&mut self, fault: Fault) -> FaultOutcome {
        if self.state.link.in_guest() {
            return FaultOutcome::InGuestMode;
        }
        self.vm.slow_page_fault(&mut self.state, fault)
    }
}

impl<F: PteFormat> Vm<F> {
    /// See [`Vcpu::fast_page_fault`]; the caller checked that `vcpu` is in guest mode.
    fn fast_page_fault(&self, vcpu: &mut VcpuState, fault: Fault) -> Option<FaultOutcome> {
        let eligible = self.config.fast_pf
            && ((fault.present && fault.access == Access::Write)
                || (!fault.present && !self.config.ad_bits));
        if !eligible {
            return None;
        }
        let gfn = fault.gpa >> PAGE_SHIFT;
        let sink = Sink::Owned(&vcpu.counters);
        // SAFETY: `Vcpu::fast_page_fault` checked that a token of this vCPU is alive, so it is
        // in guest mode until we return; it holds `&mut Vcpu`, so it cannot acknowledge a
        // flush (that needs the vCPU) before we return.
        let guard = unsafe { guest_mode_guard() };
        for _ in 0..FAST_PF_RETRIES {
            let mut it = Walk::<F>::to_leaf(&guard, self.root(), gfn);
            if !it.valid() || !F::is_present(it.old) {
                return None;
            }
            let old = it.old;
            if F::permits(old, fault.access) {
                sink.inc(Stat::PfSpurious);
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
                let (set, hint) = refresh_hint(self, &mut vcpu.slot_hint);
                let (i, slot) = set.find(gfn, *hint)?;
                *hint = i;
                if slot.is_invalid() {
                    return None; // a move is in progress: the slow path retries
                }
                mark = self.mark_for(slot, vcpu.ring.as_deref());
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
                if !self.prepare_mark(m, ring, gfn, sink) {
                    return None; // ring full: the slow path reports it
                }
            }
            let mut pending = PendingFlush::none();
            let r = self.set_spte(&mut it, new, UpdateMode::Shared, sink, &mut pending);
            self.complete_flush(pending);
            if r.is_ok() {
                if let Some(m) = mark {
                    self.commit_mark(m, ring, gfn, sink);
                }
                sink.inc(Stat::PfFast);
                return Some(FaultOutcome::FixedFast);
            }
        }
        None
    }

    /// See [`Vcpu::slow_page_fault`]; the caller checked that `vcpu` is outside guest mode.
    fn slow_page_fault(&self, vcpu: &mut VcpuState, fault: Fault) -> FaultOutcome {
        let gfn = fault.gpa >> PAGE_SHIFT;
        // Allocate before any lock (a fault needs at most one page per level below the root).
        vcpu.cache.top_up(&self.alloc, F::ROOT_LEVEL as usize);
        let (set, hint) = refresh_hint(self, &mut vcpu.slot_hint);
        let gen = set.generation();
        let sink = Sink::Owned(&vcpu.counters);
        let Some((i, slot)) = set.find(gfn, *hint) else {
            sink.inc(Stat::PfNoSlot);
            return FaultOutcome::NoSlot;
        };
        *hint = i;
        if slot.is_invalid() {
            // Moving away (see `Vm::move_memslot`): re-execute until the move completes.
            sink.inc(Stat::PfRetry);
            return FaultOutcome::Retry;
        }
        if fault.access == Access::Write && slot.is_readonly() {
            sink.inc(Stat::PfReadOnly);
            return FaultOutcome::ReadOnly;
        }
        let logging = slot.is_logging();
        let mut goal = slot.max_level::<F>(gfn);
        let perms = LeafPerms {
            host_writable: !slot.is_readonly(),
            writable: !slot.is_readonly(),
            // x86 KVM maps guest RAM executable up front; arm64 only for an instruction fetch,
            // since an executable mapping costs an instruction-cache invalidation (a later
            // fetch adds X through a permission fault).
            exec: !F::CACHE_MAINTENANCE || fault.access == Access::Exec,
            ad_bits: self.config.ad_bits,
        };
        // Read faults in a logged slot map read-only with MMU-writable kept, so the first
        // write is seen and logged by the fast path (a read does not dirty the page).
        let map_read_only_logged = logging && perms.writable && fault.access != Access::Write;
        // Cache maintenance (formats that need it). `Always` cleans the range this fault
        // would map before anything else, whether or not another vCPU already mapped it (KVM
        // arm64 before seed 001 patch 1, in `user_mem_abort`; permission faults skip it there
        // too); `OnInstall` leaves it to the fault that installs the leaf, inside the
        // break-before-make window.
        let cmo_on_install = F::CACHE_MAINTENANCE && self.config.cmo == CmoPolicy::OnInstall;
        if F::CACHE_MAINTENANCE && self.config.cmo == CmoPolicy::Always && !fault.present {
            let len = bytes_per_entry(goal);
            let hva = slot.hva(gfn) & !(len - 1);
            self.clean_new_mapping(hva, len, fault.access == Access::Exec, sink);
        }

        let lock = self.mmu_lock.read();
        // A memslot change published after our lookup: what we computed may be stale.
        if self.slots_gen.load(Ordering::Relaxed) != gen {
            drop(lock);
            sink.inc(Stat::PfRetry);
            return FaultOutcome::Retry;
        }
        let guard = pin();
        let mut pending = PendingFlush::none();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, gfn, gfn + 1);
        let cache = &mut vcpu.cache;
        let ring = vcpu.ring.as_deref();
        let outcome = loop {
            if !it.valid() {
                break FaultOutcome::Retry;
            }
            let old = it.old;
            if old == F::FROZEN {
                break FaultOutcome::Retry;
            }
            if it.level == goal {
                let rebuild = F::is_present(old) && !F::is_leaf(old, it.level);
                if rebuild && (logging || self.config.recover != RecoverVariant::OnFault) {
                    // A table already covers this range (left by dirty logging, say): map
                    // inside it rather than collapse it here; recovery collapses tables.
                    goal -= 1;
                    it.next();
                    continue;
                }
                // Only a *leaf* that permits the access makes the fault spurious. A table entry
                // may carry permission bits of its own (EPT sets R/W/X on non-leaf entries), but
                // the leaf below it is what faulted: taking the table's bits for the leaf's
                // answered `Spurious` forever while the access kept faulting.
                if !rebuild && F::is_present(old) && F::permits(old, fault.access) {
                    break FaultOutcome::Spurious;
                }
                let hva = slot.hva(gfn) & !(bytes_per_entry(goal) - 1);
                debug_assert!(!F::is_present(old) || F::output_addr(old) == hva);
                let mut perms = perms;
                if F::is_present(old) && !rebuild && F::permits(old, Access::Exec) {
                    perms.exec = true; // an upgrade never takes a permission away
                }
                let new = if map_read_only_logged {
                    // Writable as far as the MMU is concerned, W clear: the first write is a
                    // fast-path fault that logs it.
                    F::write_protect(F::make_leaf(hva, goal, perms))
                } else {
                    F::make_leaf(hva, goal, perms)
                };
                let mark = if F::is_writable(new) {
                    self.mark_for(slot, ring)
                } else {
                    None
                };
                if let Some(m) = mark {
                    if !self.prepare_mark(m, ring, gfn, sink) {
                        break FaultOutcome::DirtyRingFull;
                    }
                }
                // A new leaf where there was none, or a block rebuilt over a table, changes
                // what the entry maps (break-before-make where the format needs it); an
                // existing leaf only gains permissions.
                let r = if F::is_present(old) && !rebuild {
                    if F::CACHE_MAINTENANCE
                        && F::permits(new, Access::Exec)
                        && !F::permits(old, Access::Exec)
                    {
                        // Adding X to a live leaf: invalidate the instruction cache first
                        // (KVM's stage2_attr_walker), no data-cache clean needed.
                        self.invalidate_icache_for(hva, bytes_per_entry(goal), sink);
                    }
                    self.set_spte(&mut it, new, UpdateMode::Shared, sink, &mut pending)
                } else {
                    self.replace_spte(&mut it, new, cmo_on_install, sink, &mut pending)
                };
                match r {
                    Ok(()) => {
                        if let Some(m) = mark {
                            self.commit_mark(m, ring, gfn, sink);
                        }
                        if rebuild {
                            sink.inc(Stat::Recoveries);
                        }
                        break FaultOutcome::Fixed;
                    }
                    Err(_) => break FaultOutcome::Retry,
                }
            }
            if !F::is_present(old) {
                let child = cache.take().expect("page cache topped up before the lock");
                let new = F::make_table(child.addr());
                // An empty entry becoming a table: nothing to break, nothing cached to flush.
                match self.set_spte(&mut it, new, UpdateMode::Shared, sink, &mut pending) {
                    Ok(()) => {
                        child.into_linked();
                    }
                    Err(_) => {
                        cache.put_back(child);
                        break FaultOutcome::Retry;
                    }
                }
            } else if F::is_leaf(old, it.level) {
                // A huge leaf above the level we may map (dirty logging, or a smaller host
                // page): split it. Where both translations may coexist, into an equivalent
                // table with one compare-and-swap and no flush. Under break-before-make the
                // block must be invalidated and flushed anyway, and the new table is left
                // empty but for what this fault maps, as KVM arm64 does ("accesses beyond
                // 'end' ... are mapped lazily"): the rest of the block faults back in at
                // 4 KiB, read-only where logging wants it.
                let child = cache.take().expect("page cache topped up before the lock");
                if !F::BREAK_BEFORE_MAKE {
                    for (idx, e) in child.page().entries.iter().enumerate() {
                        e.store(F::split_child(old, it.level, idx), Ordering::Relaxed);
                    }
                }
                let new = F::make_table(child.addr());
                match self.replace_spte(&mut it, new, false, sink, &mut pending) {
                    Ok(()) => {
                        child.into_linked();
                        sink.inc(Stat::Splits);
                    }
                    Err(_) => {
                        for e in child.page().entries.iter() {
                            e.store(F::NON_PRESENT, Ordering::Relaxed);
                        }
                        cache.put_back(child);
                        break FaultOutcome::Retry;
                    }
                }
            }
            it.next();
        };
        drop(guard);
        drop(lock);
        self.complete_flush(pending);
        sink.inc(match outcome {
            FaultOutcome::Fixed => Stat::PfFixed,
            FaultOutcome::Spurious => Stat::PfSpurious,
            FaultOutcome::DirtyRingFull => Stat::PfRingFull,
            _ => Stat::PfRetry,
        });
        outcome
    }
}

/// The vCPU's memslot snapshot, refreshed if a newer set was published, and its slot hint.
#[inline]
pub(crate) fn refresh_hint<'v, F: PteFormat>(
    vm: &Vm<F>,
    h: &'v mut SlotHint,
) -> (&'v MemslotSet, &'v mut usize) {
    let gen = vm.slots_gen.load(Ordering::Acquire);
    if h.set.generation() != gen {
        h.set = vm.slots.load_full();
    }
    (&h.set, &mut h.index)
}
