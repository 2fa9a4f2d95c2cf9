//! Randomised map / zap / fault / memslot / dirty-log sequences checked against a reference
//! model after every operation.
//!
//! The model does not predict the engine's page-table shape (leaf sizes depend on tables left
//! behind by earlier zaps, and zapping a straddling huge leaf removes more than was asked). It
//! keeps what must hold whatever the shape:
//! - `maybe`: GFNs that may be mapped — the ranges of leaves installed by faults since the last
//!   zap / delete / move covering them. A mapped GFN outside it is a stale translation (zap or
//!   memslot change that did not remove it); every mapped GFN must lie in a slot and translate
//!   to that slot's host page; a GFN just faulted must be mapped.
//! - leaf size: never above what the host page size, the slot's edges and guest/host
//!   congruence allow; 4 KiB only in dirty-logged slots (invariant 7).
//! - permissions: W ⇒ MMU-writable ⇒ host-writable, nothing writable in a read-only slot
//!   (invariant 6), and in a logged slot every writable page is one the guest wrote (or at
//!   least accessed) since the last harvest (invariant 3).
//! - dirty logs: a harvest returns every page written since the last one (and only pages
//!   accessed since), moves included (a moved slot keeps its log), and leaves nothing writable
//!   in the slot (invariant 4).
//! - bookkeeping: the tree audit equals the statistics, nothing is frozen, fault counters move
//!   by one per fault, anything that removes translations flushes.
//!
//! `SLAT_TEST_SEED=<n>` runs one seed (the failure message prints it); `SLAT_TEST_OPS=<n>`
//! changes the number of operations per seed.
#![cfg(not(loom))]

#[macro_use]
mod common;

use common::*;
use slat::hw::{bytes_per_entry, pages_per_entry};
use slat::{
    Access, Fault, FaultOutcome, GetLogVariant, HostRange, MemslotError, MemslotFlags, MmuLockKind,
    PteFormat, RecoverVariant, Vcpu, Vm, VmConfig, WrprotVariant,
};
use slat_addr::{Gfn, Gpa, PAGE_SHIFT, PAGE_SIZE};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;
const RO: MemslotFlags = MemslotFlags::READONLY;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Guest physical space the test plays in.
const GUEST_SPACE: u64 = 16 * GIB;

both_formats! {
    random_operations_match_the_model,
}

/// Disjoint half-open GFN ranges.
#[derive(Debug, Default)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn insert(&mut self, mut s: u64, mut e: u64) {
        let hit: Vec<(u64, u64)> = self
            .0
            .range(..=e)
            .rev()
            .take_while(|(_, &end)| end >= s)
            .map(|(&k, &v)| (k, v))
            .collect();
        for (k, v) in hit {
            self.0.remove(&k);
            s = s.min(k);
            e = e.max(v);
        }
        self.0.insert(s, e);
    }

    fn remove(&mut self, s: u64, e: u64) {
        let hit: Vec<(u64, u64)> = self
            .0
            .range(..e)
            .rev()
            .take_while(|(_, &end)| end > s)
            .map(|(&k, &v)| (k, v))
            .collect();
        for (k, v) in hit {
            self.0.remove(&k);
            if k < s {
                self.0.insert(k, s);
            }
            if v > e {
                self.0.insert(e, v);
            }
        }
    }

    fn contains(&self, g: u64) -> bool {
        self.0
            .range(..=g)
            .next_back()
            .is_some_and(|(_, &end)| end > g)
    }
}

/// A memslot the test can place: fixed host memory, a list of guest positions.
struct Template {
    id: u32,
    /// The host memory; the slot is `[offset, offset + size)` of it.
    mem: HostMem,
    offset: u64,
    size: u64,
    page_size: u64,
    positions: Vec<u64>,
    can_log: bool,
    /// Small enough to check every page in a sweep.
    small: bool,
}

impl Template {
    /// Host address of the slot's first byte.
    fn host(&self) -> u64 {
        self.mem.addr() + self.offset
    }

    /// The slot's host memory, which the memslot keeps alive.
    fn range(&self) -> HostRange {
        self.mem.sub_range(self.offset, self.size, self.page_size)
    }

    /// The model of a new slot (template `tpl`, this one) at `gpa`.
    fn slot_model(&self, tpl: usize, gpa: u64, flags: MemslotFlags) -> SlotM {
        SlotM {
            tpl,
            id: self.id,
            base: gpa >> PAGE_SHIFT,
            npages: self.size >> PAGE_SHIFT,
            host: self.host(),
            page_size: self.page_size,
            flags,
            written: BTreeSet::new(),
            accessed: BTreeSet::new(),
        }
    }
}

#[derive(Debug)]
struct SlotM {
    tpl: usize,
    id: u32,
    base: u64,
    npages: u64,
    host: u64,
    page_size: u64,
    flags: MemslotFlags,
    /// Pages written (write faults resolved) since logging started or the last harvest.
    written: BTreeSet<u64>,
    /// Pages read or executed in that time.
    accessed: BTreeSet<u64>,
}

impl SlotM {
    fn end(&self) -> u64 {
        self.base + self.npages
    }
    fn contains(&self, g: u64) -> bool {
        g >= self.base && g < self.end()
    }
    fn hva(&self, g: u64) -> u64 {
        self.host + ((g - self.base) << PAGE_SHIFT)
    }
    fn ro(&self) -> bool {
        self.flags.contains(RO)
    }
    fn logging(&self) -> bool {
        logs(self.flags)
    }
    /// The largest leaf the backing allows at `g`, ignoring dirty logging.
    fn max_level(&self, g: u64) -> u8 {
        for level in [3u8, 2] {
            let pages = pages_per_entry(level);
            let first = g & !(pages - 1);
            if self.page_size >= bytes_per_entry(level)
                && first >= self.base
                && first + pages <= self.end()
                && ((self.hva(g) >> PAGE_SHIFT) & (pages - 1)) == (g & (pages - 1))
            {
                return level;
            }
        }
        1
    }
}

fn logs(flags: MemslotFlags) -> bool {
    flags.contains(LOG) && !flags.contains(RO)
}

/// What the runs exercised, summed over seeds (so the test cannot pass vacuously).
#[derive(Default)]
struct Coverage {
    leaves_seen: [AtomicU64; 3],
    outcomes: [AtomicU64; 7],
    harvested: AtomicU64,
    refused: AtomicU64,
    zapped: AtomicU64,
    moved: AtomicU64,
}

fn outcome_index(o: FaultOutcome) -> usize {
    match o {
        FaultOutcome::Fixed => 0,
        FaultOutcome::FixedFast => 1,
        FaultOutcome::Spurious => 2,
        FaultOutcome::Retry => 3,
        FaultOutcome::NoSlot => 4,
        FaultOutcome::ReadOnly => 5,
        FaultOutcome::DirtyRingFull => 6,
        FaultOutcome::InGuestMode => unreachable!("checked by the caller"),
        FaultOutcome::MemoryFault { .. } => unreachable!("the model has no private memory"),
    }
}

struct Run<'a, F: PteFormat> {
    seed: u64,
    op: usize,
    what: String,
    cfg: VmConfig,
    vm: Arc<Vm<F>>,
    vcpus: Vec<Vcpu<F>>,
    rng: Rng,
    tpls: &'a [Template],
    slots: BTreeMap<u32, SlotM>,
    maybe: Ranges,
    /// Recently faulted GFNs: faults revisit them (permission upgrades, spurious faults, the
    /// fast path, pages written twice between harvests).
    recent: Vec<u64>,
    cov: &'a Coverage,
}

impl<F: PteFormat> Run<'_, F> {
    fn ctx(&self) -> String {
        format!(
            "{} seed {:#x} op {} ({}) [SLAT_TEST_SEED={:#x}]",
            F::NAME,
            self.seed,
            self.op,
            self.what,
            self.seed
        )
    }

    fn slot_of(&self, g: u64) -> Option<&SlotM> {
        self.slots.values().find(|s| s.contains(g))
    }

    /// Everything the model knows about one GFN.
    fn check_gfn(&self, g: u64) {
        let Some((leaf, level)) = self.vm.lookup(Gfn::new(g)) else {
            return;
        };
        self.cov.leaves_seen[level as usize - 1].fetch_add(1, Ordering::Relaxed);
        let ctx = || format!("{}: gfn {g:#x} leaf {leaf:#x} level {level}", self.ctx());
        let slot = self
            .slot_of(g)
            .unwrap_or_else(|| panic!("{}: mapped outside every memslot", ctx()));
        assert!(
            self.maybe.contains(g),
            "{}: mapped, but not faulted since the last zap/delete/move/read-only covering it",
            ctx()
        );
        assert_eq!(
            leaf_hva::<F>(leaf, level, g),
            slot.hva(g),
            "{}: wrong host page for slot {}",
            ctx(),
            slot.id
        );
        let pages = pages_per_entry(level);
        let first = g & !(pages - 1);
        assert!(
            first >= slot.base && first + pages <= slot.end(),
            "{}: leaf sticks out of slot {} [{:#x}, {:#x})",
            ctx(),
            slot.id,
            slot.base,
            slot.end()
        );
        assert!(
            level <= slot.max_level(g),
            "{}: larger than the backing allows ({})",
            ctx(),
            slot.max_level(g)
        );
        assert!(
            F::permits(leaf, Access::Read),
            "{}: present leaf not readable",
            ctx()
        );
        check_write_chain::<F>(leaf, &ctx());
        if slot.ro() {
            assert!(
                !F::is_writable(leaf) && !F::is_mmu_writable(leaf),
                "{}: writable (or MMU-writable) in read-only slot {}",
                ctx(),
                slot.id
            );
        }
        if slot.logging() {
            if self.cfg.eager_split {
                assert_eq!(level, 1, "{}: huge leaf in logged slot {}", ctx(), slot.id);
            } else {
                assert!(
                    level == 1 || !F::is_writable(leaf),
                    "{}: writable huge leaf in logged slot {}",
                    ctx(),
                    slot.id
                );
            }
            if F::is_writable(leaf) {
                assert!(
                    slot.written.contains(&g) || slot.accessed.contains(&g),
                    "{}: writable in logged slot {} but not accessed since the last harvest",
                    ctx(),
                    slot.id
                );
            }
        }
    }

    fn check_range(&self, s: u64, e: u64, samples: u64) {
        if e - s <= samples {
            for g in s..e {
                self.check_gfn(g);
            }
        } else {
            let mut r = Rng::new(self.seed ^ self.op as u64 ^ s);
            self.check_gfn(s);
            self.check_gfn(e - 1);
            for _ in 0..samples {
                self.check_gfn(r.range(s, e));
            }
        }
    }

    /// Checks a slot: every page if it is small and `full`, else a sample.
    fn check_slot(&self, id: u32, full: bool) {
        if let Some(s) = self.slots.get(&id) {
            let samples = if full && self.tpls[s.tpl].small {
                1 << 13
            } else {
                256
            };
            self.check_range(s.base, s.end(), samples);
        }
    }

    fn audit(&self) {
        check_audit(&self.vm, &self.ctx());
    }

    fn sweep(&self) {
        self.audit();
        for s in self.slots.values() {
            self.check_slot(s.id, true);
            for g in [s.base.saturating_sub(1), s.end()] {
                self.check_gfn(g);
            }
        }
        let mut r = Rng::new(self.seed ^ (self.op as u64).rotate_left(32));
        for _ in 0..256 {
            self.check_gfn(r.below(GUEST_SPACE >> PAGE_SHIFT));
        }
    }

    fn random_gfn(&mut self) -> u64 {
        if !self.recent.is_empty() && self.rng.chance(1, 3) {
            return *self.rng.pick(&self.recent);
        }
        let ids: Vec<u32> = self.slots.keys().copied().collect();
        if !ids.is_empty() && self.rng.chance(17, 20) {
            let s = &self.slots[self.rng.pick(&ids)];
            if self.rng.chance(1, 10) {
                // Right at or just past an edge.
                return *self
                    .rng
                    .pick(&[s.base, s.end() - 1, s.end(), s.base.saturating_sub(1)]);
            }
            return s.base + self.rng.below(s.npages);
        }
        self.rng.below(GUEST_SPACE >> PAGE_SHIFT)
    }

    fn fault(&mut self) {
        let g = self.random_gfn();
        let access = match self.rng.below(20) {
            0 => Access::Exec,
            1..=9 => Access::Read,
            _ => Access::Write,
        };
        let pre = self.vm.lookup(Gfn::new(g));
        // What the hardware would report, with some noise (stale TLB views).
        let present = pre.is_some() != self.rng.chance(1, 10);
        let gpa = (g << PAGE_SHIFT) | self.rng.below(PAGE_SIZE);
        let vi = self.rng.below(self.vcpus.len() as u64) as usize;
        self.what = format!("fault gpa {gpa:#x} {access:?} present={present} vcpu {vi}");
        let before = self.vm.stats();
        let f = Fault {
            private: false,
            gpa: Gpa::new(gpa),
            access,
            present,
        };
        let o = self.vcpus[vi].handle_fault(f);
        assert_ne!(
            o,
            FaultOutcome::InGuestMode,
            "{}: handle_fault runs the slow path outside guest mode",
            self.ctx()
        );
        let after = self.vm.stats();
        let post = self.vm.lookup(Gfn::new(g));
        self.cov.outcomes[outcome_index(o)].fetch_add(1, Ordering::Relaxed);
        let ctx = format!(
            "{}: outcome {o:?}, pre {pre:x?}, post {post:x?}",
            self.ctx()
        );
        let counter = |s: &slat::Stats| match o {
            FaultOutcome::Fixed => s.pf_fixed,
            FaultOutcome::FixedFast => s.pf_fast,
            FaultOutcome::Spurious => s.pf_spurious,
            FaultOutcome::Retry => s.pf_retry,
            FaultOutcome::NoSlot => s.pf_no_slot,
            FaultOutcome::ReadOnly => s.pf_read_only,
            FaultOutcome::DirtyRingFull => s.pf_ring_full,
            FaultOutcome::InGuestMode => unreachable!("checked above"),
            FaultOutcome::MemoryFault { .. } => unreachable!("the model has no private memory"),
        };
        assert_eq!(
            counter(&after),
            counter(&before) + 1,
            "{ctx}: its counter did not move by one"
        );
        let slot = self.slot_of(g).map(|s| (s.id, s.ro(), s.logging()));
        match slot {
            None => {
                assert_eq!(o, FaultOutcome::NoSlot, "{ctx}");
                assert_eq!(post, pre, "{ctx}: an MMIO exit changed the tree");
            }
            Some((_, true, _)) if access == Access::Write => {
                assert_eq!(o, FaultOutcome::ReadOnly, "{ctx}");
                assert_eq!(post, pre, "{ctx}: a refused write changed the tree");
            }
            Some((id, _, logging)) => {
                let permitted = pre.is_some_and(|(l, _)| F::permits(l, access));
                // With lazy splitting a stale-TLB fault on a huge leaf in a logged slot splits
                // it on the way: same translation, different shape.
                let splits = !self.cfg.eager_split && logging && pre.is_some_and(|(_, l)| l > 1);
                if permitted && splits && F::BREAK_BEFORE_MAKE {
                    // Format difference: under break-before-make the lazy split leaves an
                    // empty table (KVM arm64), so this fault maps its page anew.
                    assert_eq!(o, FaultOutcome::Fixed, "{ctx}: lazy split under BBM");
                } else if permitted {
                    assert_eq!(o, FaultOutcome::Spurious, "{ctx}");
                    if !splits {
                        assert_eq!(post, pre, "{ctx}: a spurious fault changed the leaf");
                    }
                } else {
                    assert!(
                        matches!(o, FaultOutcome::Fixed | FaultOutcome::FixedFast),
                        "{ctx}: single-threaded faults never retry"
                    );
                }
                if o == FaultOutcome::FixedFast {
                    let eligible = self.cfg.fast_pf
                        && pre.is_some()
                        && ((present && access == Access::Write) || !self.cfg.ad_bits);
                    assert!(eligible, "{ctx}: fast path fixed an ineligible fault");
                }
                let (leaf, level) = post.unwrap_or_else(|| panic!("{ctx}: not mapped after"));
                assert!(F::permits(leaf, access), "{ctx}: leaf does not allow it");
                if logging && pre.is_none() {
                    assert_eq!(level, 1, "{ctx}: new huge leaf in a logged slot");
                }
                let pages = pages_per_entry(level);
                self.maybe
                    .insert(g & !(pages - 1), (g & !(pages - 1)) + pages);
                let s = self.slots.get_mut(&id).unwrap();
                if logging {
                    if access == Access::Write {
                        s.written.insert(g);
                    } else {
                        s.accessed.insert(g);
                    }
                }
            }
        }
        if slot.is_none() {
            // Not worth revisiting.
        } else if self.recent.len() < 64 {
            self.recent.push(g);
        } else {
            let i = self.rng.below(64) as usize;
            self.recent[i] = g;
        }
        self.check_gfn(g);
        for d in [1u64, 511, 512] {
            self.check_gfn(g + d);
            self.check_gfn(g.saturating_sub(d));
        }
    }

    fn zap(&mut self) {
        let ids: Vec<u32> = self.slots.keys().copied().collect();
        let (s, e) = match self.rng.below(10) {
            0..=5 if !ids.is_empty() => {
                let sl = &self.slots[self.rng.pick(&ids)];
                let s = sl.base + self.rng.below(sl.npages);
                let max = if self.rng.chance(1, 4) { 1 << 12 } else { 64 };
                let len = 1 + self.rng.below(max);
                (s, s + len)
            }
            6..=7 if !ids.is_empty() => {
                // Across a slot edge.
                let sl = &self.slots[self.rng.pick(&ids)];
                let edge = if self.rng.chance(1, 2) {
                    sl.base
                } else {
                    sl.end()
                };
                let s = edge.saturating_sub(self.rng.below(600));
                (s, edge + 1 + self.rng.below(600))
            }
            _ => {
                let s = self.rng.below(GUEST_SPACE >> PAGE_SHIFT);
                (s, s + 1 + self.rng.below(1 << 19))
            }
        };
        self.what = format!("zap [{s:#x}, {e:#x})");
        let before = self.vm.stats();
        self.vm
            .zap_gfn_range(Gfn::new(s), Gfn::new(e))
            .expect("not refused: no CPU of this thread in guest mode");
        let after = self.vm.stats();
        self.maybe.remove(s, e);
        let removed = (
            before.leaves_4k,
            before.leaves_2m,
            before.leaves_1g,
            before.table_pages,
        ) != (
            after.leaves_4k,
            after.leaves_2m,
            after.leaves_1g,
            after.table_pages,
        );
        if removed {
            self.cov.zapped.fetch_add(1, Ordering::Relaxed);
            assert!(
                after.remote_tlb_flush_requests > before.remote_tlb_flush_requests,
                "{}: translations removed without a remote flush",
                self.ctx()
            );
        }
        self.check_range(s, e, 256);
        self.check_gfn(s.saturating_sub(1));
        self.check_gfn(e);
        self.audit();
    }

    fn free_template(&mut self) -> Option<usize> {
        let free: Vec<usize> = (0..self.tpls.len())
            .filter(|&i| !self.slots.contains_key(&self.tpls[i].id))
            .collect();
        (!free.is_empty()).then(|| *self.rng.pick(&free))
    }

    fn overlap(&self, base: u64, npages: u64, ignore: u32) -> Vec<u32> {
        self.slots
            .values()
            .filter(|s| s.id != ignore && base < s.end() && s.base < base + npages)
            .map(|s| s.id)
            .collect()
    }

    fn random_flags(&mut self, can_log: bool) -> MemslotFlags {
        let f = match self.rng.below(8) {
            0..=2 => MemslotFlags::empty(),
            3..=5 => LOG,
            6 => RO,
            _ => LOG | RO,
        };
        if can_log {
            f
        } else {
            f & !LOG
        }
    }

    fn add(&mut self) {
        let Some(ti) = self.free_template() else {
            return self.delete();
        };
        let t = &self.tpls[ti];
        let gpa = *self.rng.pick(&t.positions);
        let flags = self.random_flags(t.can_log);
        self.what = format!("add slot {} at {gpa:#x} flags {flags:?}", t.id);
        let clash = self.overlap(gpa >> PAGE_SHIFT, t.size >> PAGE_SHIFT, u32::MAX);
        let gen = self.vm.memslots().generation();
        let r = self
            .vm
            .add_memslot(t.id, Gpa::new(gpa), t.size, t.range(), flags);
        if clash.is_empty() {
            r.unwrap_or_else(|e| panic!("{}: refused: {e}", self.ctx()));
            self.slots.insert(t.id, t.slot_model(ti, gpa, flags));
        } else {
            self.cov.refused.fetch_add(1, Ordering::Relaxed);
            assert!(
                matches!(r, Err(MemslotError::Overlap { id, other, .. }) if id == t.id && clash.contains(&other)),
                "{}: expected an overlap with {clash:?}, got {r:?}",
                self.ctx()
            );
            assert_eq!(self.vm.memslots().generation(), gen, "{}", self.ctx());
        }
        self.check_slot(t.id, false);
        self.audit();
    }

    fn delete(&mut self) {
        let ids: Vec<u32> = self.slots.keys().copied().collect();
        if ids.is_empty() || self.rng.chance(1, 20) {
            let id = 1000 + self.rng.below(10) as u32;
            self.what = format!("delete unknown slot {id}");
            let r = self.vm.delete_memslot(id);
            assert!(
                matches!(r, Err(MemslotError::UnknownSlot { id: i }) if i == id),
                "{}: {r:?}",
                self.ctx()
            );
            self.cov.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let id = *self.rng.pick(&ids);
        self.what = format!("delete slot {id}");
        self.vm
            .delete_memslot(id)
            .unwrap_or_else(|e| panic!("{}: {e}", self.ctx()));
        let s = self.slots.remove(&id).unwrap();
        self.maybe.remove(s.base, s.end());
        self.check_range(s.base, s.end(), 256);
        self.audit();
    }

    fn mov(&mut self) {
        let ids: Vec<u32> = self.slots.keys().copied().collect();
        if ids.is_empty() {
            return self.add();
        }
        let id = *self.rng.pick(&ids);
        let (tpl, old_base, npages) = {
            let s = &self.slots[&id];
            (s.tpl, s.base, s.npages)
        };
        let gpa = *self.rng.pick(&self.tpls[tpl].positions);
        self.what = format!(
            "move slot {id} from {:#x} to {gpa:#x}",
            old_base << PAGE_SHIFT
        );
        let clash = self.overlap(gpa >> PAGE_SHIFT, npages, id);
        let gen = self.vm.memslots().generation();
        let r = self.vm.move_memslot(id, Gpa::new(gpa));
        if clash.is_empty() {
            r.unwrap_or_else(|e| panic!("{}: refused: {e}", self.ctx()));
            self.cov.moved.fetch_add(1, Ordering::Relaxed);
            self.maybe.remove(old_base, old_base + npages);
            let s = self.slots.get_mut(&id).unwrap();
            s.base = gpa >> PAGE_SHIFT;
            // The log survives the move (as in KVM): pages written before it and not yet
            // harvested are still owed, at the same slot-relative offsets.
            let rebase = |set: &BTreeSet<u64>| -> BTreeSet<u64> {
                set.iter().map(|g| g - old_base + s.base).collect()
            };
            s.written = rebase(&s.written);
            s.accessed = rebase(&s.accessed);
            self.check_range(old_base, old_base + npages, 256);
            self.check_slot(id, false);
        } else {
            self.cov.refused.fetch_add(1, Ordering::Relaxed);
            assert!(
                matches!(r, Err(MemslotError::Overlap { id: i, other, .. }) if i == id && clash.contains(&other)),
                "{}: expected an overlap with {clash:?}, got {r:?}",
                self.ctx()
            );
            assert_eq!(self.vm.memslots().generation(), gen, "{}", self.ctx());
            assert_eq!(
                self.vm.memslots().by_id(id).unwrap().base_gfn,
                Gfn::new(old_base)
            );
        }
        self.audit();
    }

    fn set_flags(&mut self) {
        let ids: Vec<u32> = self.slots.keys().copied().collect();
        if ids.is_empty() {
            return self.add();
        }
        let id = *self.rng.pick(&ids);
        let can_log = self.tpls[self.slots[&id].tpl].can_log;
        let flags = self.random_flags(can_log);
        let old = self.slots[&id].flags;
        self.what = format!("set slot {id} flags {old:?} -> {flags:?}");
        let gen = self.vm.memslots().generation();
        let before = self.vm.stats();
        let r = self.vm.set_memslot_flags(id, flags);
        let after = self.vm.stats();
        if (flags ^ old).contains(RO) {
            // Documented: READONLY cannot change on an existing slot. Refused, nothing changes.
            assert_eq!(
                r,
                Err(MemslotError::ReadonlyChange { id }),
                "{}",
                self.ctx()
            );
            assert_eq!(self.vm.memslots().generation(), gen, "{}", self.ctx());
            assert_eq!(
                self.vm.memslots().by_id(id).unwrap().flags,
                old,
                "{}",
                self.ctx()
            );
            assert_eq!(
                after.remote_tlb_flush_requests,
                before.remote_tlb_flush_requests,
                "{}: a refused flag change flushed",
                self.ctx()
            );
            self.cov.refused.fetch_add(1, Ordering::Relaxed);
            self.check_slot(id, false);
            // What a VMM does instead: delete the slot and add it back with the new flags.
            return self.readd(id, flags);
        }
        r.unwrap_or_else(|e| panic!("{}: {e}", self.ctx()));
        let s = self.slots.get_mut(&id).unwrap();
        s.flags = flags;
        let (base, end) = (s.base, s.end());
        if flags != old {
            if logs(old) && !logs(flags) && self.cfg.recover == RecoverVariant::InPlace {
                // Documented: in-place recovery maps the whole huge range of any table that
                // held a leaf (the memslot backs all of it).
                let hit: Vec<(u64, u64)> = self
                    .maybe
                    .0
                    .range(..end)
                    .filter(|(_, &e)| e > base)
                    .map(|(&a, &b)| (a.max(base), b.min(end)))
                    .collect();
                let slot = &self.slots[&id];
                let mut grow = Vec::new();
                for (a, b) in hit {
                    let mut g = a;
                    while g < b {
                        let p = pages_per_entry(slot.max_level(g));
                        let first = g & !(p - 1);
                        if p > 1 {
                            grow.push((first, first + p));
                        }
                        g = first + p;
                    }
                }
                for (a, b) in grow {
                    self.maybe.insert(a, b);
                }
            }
            let s = self.slots.get_mut(&id).unwrap();
            if logs(flags) != logs(old) {
                // A fresh log (or none).
                s.written.clear();
                s.accessed.clear();
            }
            if logs(flags) && !logs(old) {
                assert!(
                    after.remote_tlb_flush_requests > before.remote_tlb_flush_requests,
                    "{}: logging enabled without a flush",
                    self.ctx()
                );
            }
        } else {
            assert_eq!(
                after.remote_tlb_flush_requests,
                before.remote_tlb_flush_requests,
                "{}: a no-op flag change flushed",
                self.ctx()
            );
        }
        self.check_slot(id, flags != old);
        self.audit();
    }

    /// Deletes slot `id` and adds it back at the same place with `flags` (a fresh slot: no
    /// mappings, a fresh log).
    fn readd(&mut self, id: u32, flags: MemslotFlags) {
        let (ti, base, npages) = {
            let s = &self.slots[&id];
            (s.tpl, s.base, s.npages)
        };
        self.what = format!("re-add slot {id} with flags {flags:?}");
        let before = self.vm.stats();
        self.vm
            .delete_memslot(id)
            .unwrap_or_else(|e| panic!("{}: delete: {e}", self.ctx()));
        let after = self.vm.stats();
        if (after.leaves_4k, after.leaves_2m, after.leaves_1g)
            != (before.leaves_4k, before.leaves_2m, before.leaves_1g)
        {
            assert!(
                after.remote_tlb_flush_requests > before.remote_tlb_flush_requests,
                "{}: delete removed translations without a remote flush",
                self.ctx()
            );
        }
        self.slots.remove(&id);
        self.maybe.remove(base, base + npages);
        self.check_range(base, base + npages, 256);
        let t = &self.tpls[ti];
        let gpa = base << PAGE_SHIFT;
        self.vm
            .add_memslot(id, Gpa::new(gpa), t.size, t.range(), flags)
            .unwrap_or_else(|e| panic!("{}: re-add: {e}", self.ctx()));
        self.slots.insert(id, t.slot_model(ti, gpa, flags));
        self.check_slot(id, true);
        self.audit();
    }

    fn harvest(&mut self) {
        let ids: Vec<u32> = self.slots.keys().copied().collect();
        if ids.is_empty() {
            return self.add();
        }
        let id = *self.rng.pick(&ids);
        let (logging, base, npages) = {
            let s = &self.slots[&id];
            (s.logging(), s.base, s.npages)
        };
        self.what = format!("get_dirty_log slot {id}");
        let need = bitmap_words(npages);
        let mut words = vec![0u64; need + self.rng.below(2) as usize];
        let before = self.vm.stats();
        let r = self.vm.get_dirty_log(id, &mut words);
        let after = self.vm.stats();
        if !logging {
            assert!(
                matches!(r, Err(slat::dirty::DirtyLogError::NotLogging { id: i }) if i == id),
                "{}: {r:?}",
                self.ctx()
            );
            self.cov.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let n = r.unwrap_or_else(|e| panic!("{}: {e}", self.ctx()));
        let got: BTreeSet<u64> = bitmap_gfns(base, &words[..need]).into_iter().collect();
        assert_eq!(n, got.len() as u64, "{}: count vs bitmap", self.ctx());
        let s = self.slots.get_mut(&id).unwrap();
        let missing: Vec<_> = s.written.difference(&got).collect();
        assert!(
            missing.is_empty(),
            "seed {:#x} op {}: slot {id}: written pages missing from the log: {missing:x?}",
            self.seed,
            self.op
        );
        let extra: Vec<_> = got
            .iter()
            .filter(|g| !s.written.contains(g) && !s.accessed.contains(g))
            .collect();
        assert!(
            extra.is_empty(),
            "seed {:#x} op {}: slot {id}: pages logged that were not accessed: {extra:x?}",
            self.seed,
            self.op
        );
        s.written.clear();
        s.accessed.clear();
        self.cov.harvested.fetch_add(n, Ordering::Relaxed);
        if n > 0 {
            assert!(
                after.remote_tlb_flush_requests > before.remote_tlb_flush_requests,
                "{}: harvest returned without a flush",
                self.ctx()
            );
        }
        // Nothing in the slot may be writable now (check_gfn: W needs an access since the
        // harvest, and the sets were just cleared).
        self.check_slot(id, true);
        self.audit();
    }

    fn step(&mut self) {
        match self.rng.below(100) {
            0..=61 => self.fault(),
            62..=71 => self.zap(),
            72..=75 => self.add(),
            76..=78 => self.delete(),
            79..=82 => self.mov(),
            83..=91 => self.set_flags(),
            _ => self.harvest(),
        }
    }
}

/// 2 GiB of reserved, 1 GiB-aligned host memory for template 5, shared by every seed and
/// never written (only mapped: stage-2 cache maintenance reads what a fault maps, so each seed
/// would otherwise pay for faulting in 2 GiB of zero pages again). Lives until the process
/// exits.
fn gib_backing() -> HostMem {
    static MEM: std::sync::OnceLock<HostMem> = std::sync::OnceLock::new();
    MEM.get_or_init(|| HostMem::reserve(2 * GIB, HUGE_1G))
        .clone()
}

/// The templates of a seed; each holds its host memory (and each memslot over it, its part).
struct Backing {
    tpls: Vec<Template>,
}

fn templates() -> Backing {
    let huge = HostMem::new(8 * MIB);
    let small = HostMem::new(6 * MIB);
    let skew = HostMem::new(4 * MIB + PAGE_SIZE);
    let edges = HostMem::new(6 * MIB);
    let tiny = HostMem::new(130 * PAGE_SIZE);
    let tpls = vec![
        // 2 MiB host pages, aligned guest positions: 2 MiB leaves.
        Template {
            id: 1,
            mem: huge,
            offset: 0,
            size: 8 * MIB,
            page_size: HUGE_2M,
            positions: vec![0, 16 * MIB, GIB, GIB + 8 * MIB, 3 * GIB - 2 * MIB],
            can_log: true,
            small: true,
        },
        // 4 KiB host pages; an odd page count (partial last bitmap word); one position
        // straddles a 1 GiB boundary, one overlaps slot 1's positions.
        Template {
            id: 2,
            mem: small,
            offset: 0,
            size: 6 * MIB - 3 * PAGE_SIZE,
            page_size: PAGE_SIZE,
            positions: vec![8 * MIB, 16 * MIB + 0x3000, 4 * GIB - MIB, 64 * MIB],
            can_log: true,
            small: true,
        },
        // 2 MiB host pages, but the host address is 4 KiB off a 2 MiB boundary while every
        // guest position is aligned: never congruent, always 4 KiB.
        Template {
            id: 3,
            mem: skew,
            offset: PAGE_SIZE,
            size: 4 * MIB,
            page_size: HUGE_2M,
            positions: vec![32 * MIB, GIB + 2 * MIB, 128 * MIB],
            can_log: true,
            small: true,
        },
        // 2 MiB host pages, congruent, but starting 4 KiB into a frame and ending 4 KiB short:
        // only the middle frame can be huge.
        Template {
            id: 4,
            mem: edges,
            offset: PAGE_SIZE,
            size: 6 * MIB - 2 * PAGE_SIZE,
            page_size: HUGE_2M,
            positions: vec![
                40 * MIB + PAGE_SIZE,
                GIB + 16 * MIB + PAGE_SIZE,
                36 * MIB + PAGE_SIZE,
            ],
            can_log: true,
            small: true,
        },
        // Reserved 1 GiB-paged host memory (never written): 1 GiB leaves at aligned positions,
        // 2 MiB leaves at the 2 MiB-congruent one. Not logged (a split is 262144 leaves).
        Template {
            id: 5,
            mem: gib_backing(),
            offset: 0,
            size: 2 * GIB,
            page_size: HUGE_1G,
            positions: vec![4 * GIB, 8 * GIB, 12 * GIB + 2 * MIB, 3 * GIB],
            can_log: false,
            small: false,
        },
        Template {
            id: 6,
            mem: tiny,
            offset: 0,
            size: 130 * PAGE_SIZE,
            page_size: PAGE_SIZE,
            positions: vec![20 * MIB, 48 * MIB - 64 * PAGE_SIZE, GIB - PAGE_SIZE * 130],
            can_log: true,
            small: true,
        },
    ];
    Backing { tpls }
}

fn config_for(seed: u64) -> VmConfig {
    // The write-protect variant cycles independently of the rest (every 7 seeds), so each
    // variant meets each other configuration across the 20 seeds.
    let d = VmConfig {
        wrprot: WrprotVariant::ALL[(seed / 7 % 3) as usize],
        ..VmConfig::default()
    };
    match seed % 7 {
        5 => VmConfig {
            recover: RecoverVariant::Zap,
            ..d
        },
        6 => VmConfig {
            get_log: GetLogVariant::Switch,
            ..d
        },
        0 => d,
        1 => VmConfig {
            fast_pf: false,
            ..d
        },
        2 => VmConfig {
            eager_split: false,
            ..d
        },
        3 => VmConfig {
            mmu_lock: MmuLockKind::Mutex,
            ..d
        },
        _ => VmConfig {
            ad_bits: false,
            ..d
        },
    }
}

fn run_seed<F: PteFormat>(seed: u64, ops: usize, cov: &Coverage) {
    let backing = templates();
    let cfg = config_for(seed);
    let vm = Vm::<F>::new(cfg);
    let vcpus = vec![vm.create_vcpu(0), vm.create_vcpu(1)];
    let mut run = Run {
        seed,
        op: 0,
        what: "start".into(),
        cfg,
        vm,
        vcpus,
        rng: Rng::new(seed),
        tpls: &backing.tpls,
        slots: BTreeMap::new(),
        maybe: Ranges::default(),
        recent: Vec::new(),
        cov,
    };
    // Start with a few slots so the first faults land somewhere.
    for _ in 0..4 {
        run.add();
    }
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for i in 0..ops {
            run.op = i;
            run.step();
            // The reverse map against the tree after every operation (every leaf in it with
            // its table, nothing else; empty with `walk`).
            if let Err(e) = run.vm.audit_rmap() {
                panic!("rmap audit after {}: {e}", run.what);
            }
            if i % 64 == 0 {
                run.audit();
            }
            if i % 500 == 499 {
                run.what = "sweep".into();
                run.sweep();
            }
        }
        run.what = "final sweep".into();
        run.sweep();
    }));
    if let Err(e) = outcome {
        eprintln!(
            "model test ({}) failed at seed {seed:#x}, op {} ({}); rerun with SLAT_TEST_SEED={seed:#x}",
            F::NAME, run.op, run.what
        );
        std::panic::resume_unwind(e);
    }
    let Run { vm, vcpus, .. } = run;
    teardown(vm, vcpus);
    drop(backing);
}

fn random_operations_match_the_model<F: PteFormat>() {
    let ops: usize = std::env::var("SLAT_TEST_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000);
    // Stage-2 cleans the caches over every new mapping, and a 1 GiB leaf of template 5 is
    // 16 Mi cache-line operations (twice for an instruction fetch): a seed costs ~25 times
    // what it costs on EPT. Seven seeds there: each `config_for` variant once (it cycles
    // every 7 seeds).
    let nseeds = if F::CACHE_MAINTENANCE { 7 } else { 20 };
    let seeds: Vec<u64> = match std::env::var("SLAT_TEST_SEED") {
        Ok(_) => vec![seed_from_env(0)],
        Err(_) => (0..nseeds).map(|i| 0x51a7_0000 + i).collect(),
    };
    let cov = Coverage::default();
    let next = AtomicU64::new(0);
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .min(seeds.len());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&seed) = seeds.get(i) else { break };
                run_seed::<F>(seed, ops, &cov);
            });
        }
    });
    let l = |i: usize| cov.leaves_seen[i].load(Ordering::Relaxed);
    let o = |i: usize| cov.outcomes[i].load(Ordering::Relaxed);
    eprintln!(
        "model coverage ({}): leaves seen 4K/2M/1G {}/{}/{}, outcomes fixed {} fast {} spurious {} \
         retry {} noslot {} readonly {}, harvested {}, refused {}, zaps {}, moves {}",
        F::NAME,
        l(0),
        l(1),
        l(2),
        o(0),
        o(1),
        o(2),
        o(3),
        o(4),
        o(5),
        cov.harvested.load(Ordering::Relaxed),
        cov.refused.load(Ordering::Relaxed),
        cov.zapped.load(Ordering::Relaxed),
        cov.moved.load(Ordering::Relaxed),
    );
    if seeds.len() > 1 && ops >= 1000 {
        for (what, n) in [
            ("4 KiB leaves", l(0)),
            ("2 MiB leaves", l(1)),
            ("1 GiB leaves", l(2)),
            ("Fixed", o(0)),
            ("FixedFast", o(1)),
            ("Spurious", o(2)),
            ("NoSlot", o(4)),
            ("ReadOnly", o(5)),
            ("harvested pages", cov.harvested.load(Ordering::Relaxed)),
            ("refused requests", cov.refused.load(Ordering::Relaxed)),
            (
                "zaps that removed something",
                cov.zapped.load(Ordering::Relaxed),
            ),
            ("moves", cov.moved.load(Ordering::Relaxed)),
        ] {
            assert!(n > 0, "the random runs never produced {what}");
        }
    }
}

// Tests the test's own range model: no page table, no format.
#[test]
fn ranges_model_merges_and_splits() {
    let mut r = Ranges::default();
    r.insert(10, 20);
    r.insert(20, 30);
    r.insert(40, 50);
    assert_eq!(
        r.0.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(10, 30), (40, 50)]
    );
    r.remove(15, 45);
    assert_eq!(
        r.0.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(10, 15), (45, 50)]
    );
    assert!(r.contains(10) && r.contains(14) && !r.contains(15) && !r.contains(44));
    assert!(r.contains(49) && !r.contains(50) && !r.contains(9));
    r.insert(0, 100);
    r.remove(0, 1);
    assert_eq!(
        r.0.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(1, 100)]
    );
}
