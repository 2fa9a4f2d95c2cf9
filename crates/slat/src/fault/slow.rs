//! The slow path, under the MMU lock in read mode (exclusive with the mutex variant), in named
//! steps: [`plan`] (slot lookup and what to map, before any lock), the generation re-check,
//! then [`walk_to_goal`] from the root: [`link_table`] where an entry is empty,
//! [`split_in_the_way`] where a huge leaf is above the goal, [`install_at_goal`] at it.

use super::{Fault, FaultOutcome, VcpuState};
use crate::clock::{Clock, Cost};
use crate::cmo::{clean_new_mapping, invalidate_icache_for, skip_for_phantom};
use crate::config::{CmoPolicy, RecoverVariant, VmConfig};
use crate::direct_map::Acceptance;
use crate::dirty::{commit_mark, mark_for, prepare_mark, DirtyRing, Pushed};
use crate::format::{bytes_per_entry, Access, LeafPerms, Level, PteFormat};
use crate::memslot::{Memslot, MemslotSet, Memslots};
use crate::mmu::flush::PendingFlush;
use crate::mmu::lock::Shared;
use crate::mmu::table::PageCache;
use crate::mmu::walk::Walk;
use crate::mmu::Mmu;
use crate::stats::{Sink, Stat};
use crate::sync::Ordering;
use slat_addr::{Gfn, Hva, PAGE_SIZE};

/// What the slow path decided before taking the MMU lock.
struct Plan<'s> {
    slot: &'s Memslot,
    gfn: Gfn,
    /// The page is private: map it from the slot's private backing.
    private: bool,
    access: Access,
    /// The level of the leaf to install; lowered when a table already covers it.
    goal: Level,
    logging: bool,
    perms: LeafPerms,
    /// Read faults in a logged slot map read-only with MMU-writable kept, so the first
    /// write is seen and logged by the fast path (a read does not dirty the page).
    map_read_only_logged: bool,
    /// Cache maintenance happens in the install's break-before-make window.
    cmo_on_install: bool,
    /// The backing is phantom memory: cache maintenance is counted, not performed (always
    /// false for formats without cache maintenance).
    phantom: bool,
}

/// The slow path (see [`crate::Vcpu::slow_page_fault`]); the caller checked that `vcpu` is
/// outside guest mode.
pub(crate) fn slow_page_fault<F: PteFormat>(
    mmu: &Mmu<F>,
    slots: &Memslots,
    vcpu: &mut VcpuState,
    fault: Fault,
) -> FaultOutcome {
    F::Clock::charge(Cost::SlowFault, 1);
    // Allocate before any lock (a fault needs at most one page per level below the root).
    vcpu.cache
        .top_up::<F::Clock>(&mmu.alloc, F::ROOT_LEVEL as usize);
    let (set, hint) = slots.refresh::<F::Clock>(&mut vcpu.slot_hint);
    let gen = set.generation();
    let sink = Sink::Owned(&vcpu.counters);
    let mut plan = match plan::<F>(&mmu.config, set, hint, fault, sink) {
        Ok(p) => p,
        Err(exit) => return exit,
    };
    // `Always` cleans the range this fault would map before anything else, whether or not
    // another vCPU already mapped it (KVM arm64 in `user_mem_abort`, before its CMOs moved into
    // the fault handlers; permission faults skip it there too).
    if F::CACHE_MAINTENANCE && mmu.config.cmo == CmoPolicy::Always && !fault.present {
        let len = bytes_per_entry(plan.goal);
        let hva = plan.hva() & !(len - 1);
        let exec = fault.access == Access::Exec;
        if plan.phantom {
            skip_for_phantom::<F::Clock>(len, exec, false, sink);
        } else {
            clean_new_mapping::<F::Clock>(hva, len, exec, sink);
        }
    }

    // Acceptance may flush the direct map's host CPUs: not from one of them (the vCPU's own
    // host CPU goes offline with guest mode; this refuses another one kept online).
    if plan.private && plan.slot.check_accept_flush().is_err() {
        return FaultOutcome::InGuestMode;
    }
    let lock = mmu.lock.read::<F::Clock>();
    // A memslot change published after our lookup: what we computed may be stale.
    if slots.generation() != gen {
        drop(lock);
        sink.inc::<F::Clock>(Stat::PfRetry);
        return FaultOutcome::Retry;
    }
    // Lazy acceptance, under the lock after the re-check: a conversion back to shared waits
    // out lock holders before it releases pages, so it never misses one accepted here, and
    // no fault accepts after it looked (`memslot/attributes.rs`, step 4).
    if plan.private
        && plan.slot.accept_private::<F::Clock>(plan.gfn.raw()) == Acceptance::InProgress
    {
        drop(lock);
        sink.inc::<F::Clock>(Stat::PfRetry);
        return FaultOutcome::Retry;
    }
    let mut pending = PendingFlush::none();
    let ring = vcpu.ring.as_deref();
    let w = mmu.lock.shared(&lock);
    let outcome = walk_to_goal(mmu, w, &mut plan, &mut vcpu.cache, ring, sink, &mut pending);
    drop(lock);
    mmu.complete_flush(pending);
    sink.inc::<F::Clock>(match outcome {
        FaultOutcome::Fixed => Stat::PfFixed,
        FaultOutcome::Spurious => Stat::PfSpurious,
        FaultOutcome::DirtyRingFull => Stat::PfRingFull,
        _ => Stat::PfRetry,
    });
    outcome
}

impl Plan<'_> {
    /// Host address of the page to map, in the backing the attribute selected.
    fn hva(&self) -> u64 {
        self.slot.hva_for(self.gfn.raw(), self.private)
    }
}

/// Finds the slot and decides what to map, or the exit the fault is (`NoSlot`, `ReadOnly`,
/// `MemoryFault`, or `Retry` while the slot moves).
fn plan<'s, F: PteFormat>(
    config: &VmConfig,
    set: &'s MemslotSet,
    hint: &mut usize,
    fault: Fault,
    sink: Sink<'_>,
) -> Result<Plan<'s>, FaultOutcome> {
    let gfn = fault.gpa.gfn().raw();
    let Some((i, slot)) = set.find_raw(gfn, *hint) else {
        sink.inc::<F::Clock>(Stat::PfNoSlot);
        return Err(FaultOutcome::NoSlot);
    };
    *hint = i;
    if slot.is_invalid() {
        // Moving away (see `Vm::move_memslot`): re-execute until the move completes.
        sink.inc::<F::Clock>(Stat::PfRetry);
        return Err(FaultOutcome::Retry);
    }
    if fault.access == Access::Write && slot.is_readonly() {
        sink.inc::<F::Clock>(Stat::PfReadOnly);
        return Err(FaultOutcome::ReadOnly);
    }
    // Read after the generation (`refresh`), re-checked under the MMU lock: see
    // `memslot/attributes.rs` for why a racing conversion cannot leave a leaf of this kind.
    let private = slot.is_private(slat_addr::Gfn::new(gfn));
    if private != fault.private {
        return Err(FaultOutcome::MemoryFault {
            gpa: slat_addr::Gpa::new(fault.gpa.raw() & !(PAGE_SIZE - 1)),
            size: PAGE_SIZE,
            private: fault.private,
        });
    }
    let logging = slot.is_logging();
    let perms = LeafPerms {
        host_writable: !slot.is_readonly(),
        writable: !slot.is_readonly(),
        // x86 KVM maps guest RAM executable up front; arm64 only for an instruction fetch,
        // since an executable mapping costs an instruction-cache invalidation (a later
        // fetch adds X through a permission fault).
        exec: !F::CACHE_MAINTENANCE || fault.access == Access::Exec,
        ad_bits: config.ad_bits,
    };
    Ok(Plan {
        slot,
        gfn: Gfn::new(gfn),
        private,
        access: fault.access,
        goal: slot.max_level_raw::<F>(gfn),
        logging,
        perms,
        map_read_only_logged: logging && perms.writable && fault.access != Access::Write,
        // `OnInstall` leaves cache maintenance to the fault that installs the leaf, inside
        // the break-before-make window.
        cmo_on_install: F::CACHE_MAINTENANCE && config.cmo == CmoPolicy::OnInstall,
        // Only cache maintenance asks, so formats without it never look.
        phantom: F::CACHE_MAINTENANCE && slot.is_phantom(private),
    })
}

/// Walks from the root to the plan's goal level, linking and splitting on the way, and
/// installs the leaf there. Any lost race is `Retry`: the vCPU re-executes the access.
fn walk_to_goal<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    plan: &mut Plan<'_>,
    cache: &mut PageCache,
    ring: Option<&DirtyRing>,
    sink: Sink<'_>,
    pending: &mut PendingFlush,
) -> FaultOutcome {
    let guard = crate::sync::pin_c::<F::Clock>();
    let mut it = Walk::<F>::new(
        &guard,
        mmu.root(),
        1,
        plan.gfn,
        Gfn::new(plan.gfn.raw() + 1),
    );
    loop {
        if !it.valid() {
            return FaultOutcome::Retry;
        }
        it.as_seen_by_handler();
        let old = it.old;
        if old == F::FROZEN {
            return FaultOutcome::Retry;
        }
        if it.level == plan.goal {
            match install_at_goal(mmu, w, plan, &mut it, ring, sink, pending) {
                Some(outcome) => return outcome,
                None => {
                    it.next(); // the goal moved one level down: map inside the table
                    continue;
                }
            }
        }
        let linked = if !F::is_present(old) {
            link_table(mmu, w, &mut it, cache, sink, pending)
        } else if F::is_leaf(old, it.level) {
            split_in_the_way(mmu, w, &mut it, cache, sink, pending)
        } else {
            true
        };
        if !linked {
            return FaultOutcome::Retry;
        }
        it.next();
    }
}

/// At the goal level: installs the leaf (or upgrades the present one), marking the page in
/// a logged slot around the update. `None` if a table covers the goal and is to be mapped
/// inside rather than collapsed (`plan.goal` is lowered).
fn install_at_goal<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    plan: &mut Plan<'_>,
    it: &mut Walk<'_, F>,
    ring: Option<&DirtyRing>,
    sink: Sink<'_>,
    pending: &mut PendingFlush,
) -> Option<FaultOutcome> {
    let old = it.old;
    let goal = plan.goal;
    let rebuild = F::is_present(old) && !F::is_leaf(old, it.level);
    if rebuild && (plan.logging || mmu.config.recover != RecoverVariant::OnFault) {
        // A table already covers this range (left by dirty logging, say): map inside it
        // rather than collapse it here; recovery collapses tables.
        plan.goal -= 1;
        return None;
    }
    // Only a *leaf* that permits the access makes the fault spurious. A table entry may
    // carry permission bits of its own (EPT sets R/W/X on non-leaf entries), but the leaf
    // below it is what faulted: taking the table's bits for the leaf's answered `Spurious`
    // forever while the access kept faulting.
    if !rebuild && F::is_present(old) && F::permits(old, plan.access) {
        return Some(FaultOutcome::Spurious);
    }
    let hva = plan.hva() & !(bytes_per_entry(goal) - 1);
    if F::is_present(old) && !rebuild && F::output_addr(old) != Hva::new(hva) {
        // A leaf of the other kind that a conversion has not zapped yet (its zap yields the
        // lock now and then): never upgrade it into this backing, wait for the zap.
        return Some(FaultOutcome::Retry);
    }
    let mut perms = plan.perms;
    if F::is_present(old) && !rebuild && F::permits(old, Access::Exec) {
        perms.exec = true; // an upgrade never takes a permission away
    }
    let new = if plan.map_read_only_logged {
        // Writable as far as the MMU is concerned, W clear: the first write is a fast-path
        // fault that logs it.
        F::write_protect(F::make_leaf(Hva::new(hva), goal, perms))
    } else {
        F::make_leaf(Hva::new(hva), goal, perms)
    };
    let mark = if F::is_writable(new) {
        mark_for(plan.slot, ring)
    } else {
        None
    };
    let mut pushed = Pushed::default();
    if let Some(m) = mark {
        if !prepare_mark::<F::Clock>(m, ring, plan.gfn.raw(), sink, &mut pushed) {
            return Some(FaultOutcome::DirtyRingFull);
        }
    }
    if !update_leaf(mmu, w, plan, it, new, rebuild, hva, sink, pending) {
        return Some(FaultOutcome::Retry);
    }
    if let Some(m) = mark {
        commit_mark::<F::Clock>(m, ring, plan.gfn.raw(), sink, pushed);
    }
    if rebuild {
        sink.inc::<F::Clock>(Stat::Recoveries);
    }
    Some(FaultOutcome::Fixed)
}

/// Writes the goal's new entry: a new leaf where there was none, or a block rebuilt over a
/// table, changes what the entry maps (break-before-make where the format needs it); an
/// existing leaf only gains permissions. False on a lost race. Cache maintenance of phantom
/// memory is counted, not performed.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_leaf<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    plan: &Plan<'_>,
    it: &mut Walk<'_, F>,
    new: u64,
    rebuild: bool,
    hva: u64,
    sink: Sink<'_>,
    pending: &mut PendingFlush,
) -> bool {
    let (old, len) = (it.old, bytes_per_entry(plan.goal));
    if F::is_present(old) && !rebuild {
        if F::CACHE_MAINTENANCE && F::permits(new, Access::Exec) && !F::permits(old, Access::Exec) {
            // Adding X to a live leaf: invalidate the instruction cache first (KVM's
            // stage2_attr_walker), no data-cache clean needed.
            if plan.phantom {
                skip_for_phantom::<F::Clock>(len, true, true, sink);
            } else {
                invalidate_icache_for::<F::Clock>(hva, len, sink);
            }
        }
        return mmu.set_spte(it, new, w, sink, pending).is_ok();
    }
    let cmo = plan.cmo_on_install && !plan.phantom;
    let ok = mmu.replace_spte(it, new, cmo, w, sink, pending).is_ok();
    if ok && plan.cmo_on_install && plan.phantom {
        skip_for_phantom::<F::Clock>(len, F::permits(new, Access::Exec), false, sink);
    }
    ok
}

/// An empty entry above the goal gets a table from the vCPU's cache: nothing to break,
/// nothing cached to flush. False if another fault linked one first.
fn link_table<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    it: &mut Walk<'_, F>,
    cache: &mut PageCache,
    sink: Sink<'_>,
    pending: &mut PendingFlush,
) -> bool {
    let child = cache.take().expect("page cache topped up before the lock");
    let new = F::make_table(child.addr());
    match mmu.set_spte(it, new, w, sink, pending) {
        Ok(()) => {
            child.into_linked();
            true
        }
        Err(_) => {
            cache.put_back(child);
            false
        }
    }
}

/// A huge leaf above the level we may map (dirty logging, or a smaller host page): split it.
/// Where both translations may coexist, into an equivalent table with one compare-and-swap
/// and no flush. Under break-before-make the block must be invalidated and flushed anyway,
/// and the new table is left empty but for what this fault maps, as KVM arm64 does
/// ("accesses beyond 'end' ... are mapped lazily"): the rest of the block faults back in at
/// 4 KiB, read-only where logging wants it. False if the entry changed first.
fn split_in_the_way<F: PteFormat>(
    mmu: &Mmu<F>,
    w: Shared<'_>,
    it: &mut Walk<'_, F>,
    cache: &mut PageCache,
    sink: Sink<'_>,
    pending: &mut PendingFlush,
) -> bool {
    let old = it.old;
    let child = cache.take().expect("page cache topped up before the lock");
    if !F::BREAK_BEFORE_MAKE {
        for (idx, e) in child.page().entries.iter().enumerate() {
            e.store(F::split_child(old, it.level, idx), Ordering::Relaxed);
        }
    }
    let new = F::make_table(child.addr());
    match mmu.replace_spte(it, new, false, w, sink, pending) {
        Ok(()) => {
            child.into_linked();
            sink.inc::<F::Clock>(Stat::Splits);
            true
        }
        Err(_) => {
            for e in child.page().entries.iter() {
                e.store(F::NON_PRESENT, Ordering::Relaxed);
            }
            cache.put_back(child);
            false
        }
    }
}
