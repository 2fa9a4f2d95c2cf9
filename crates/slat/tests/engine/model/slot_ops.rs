//! Memslot and dirty-log operations of a run (add, delete, move, set flags, harvest) and the
//! random choice of the next operation.

use super::*;

impl<F: PteFormat> Run<'_, F> {
    pub(crate) fn free_template(&mut self) -> Option<usize> {
        let free: Vec<usize> = (0..self.tpls.len())
            .filter(|&i| !self.slots.contains_key(&self.tpls[i].id))
            .collect();
        (!free.is_empty()).then(|| *self.rng.pick(&free))
    }

    pub(crate) fn overlap(&self, base: u64, npages: u64, ignore: u32) -> Vec<u32> {
        self.slots
            .values()
            .filter(|s| s.id != ignore && base < s.end() && s.base < base + npages)
            .map(|s| s.id)
            .collect()
    }

    pub(crate) fn random_flags(&mut self, can_log: bool) -> MemslotFlags {
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

    pub(crate) fn add(&mut self) {
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

    pub(crate) fn delete(&mut self) {
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

    pub(crate) fn mov(&mut self) {
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

    pub(crate) fn set_flags(&mut self) {
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
                self.grow_maybe_for_in_place_recovery(id, base, end);
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

    /// Documented: in-place recovery maps the whole huge range of any table that
    /// held a leaf (the memslot backs all of it).
    fn grow_maybe_for_in_place_recovery(&mut self, id: u32, base: u64, end: u64) {
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

    /// Deletes slot `id` and adds it back at the same place with `flags` (a fresh slot: no
    /// mappings, a fresh log).
    pub(crate) fn readd(&mut self, id: u32, flags: MemslotFlags) {
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

    pub(crate) fn harvest(&mut self) {
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

    pub(crate) fn step(&mut self) {
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
