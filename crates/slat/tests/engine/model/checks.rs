//! The run's checks of the engine's state against the model: one GFN, a range, a slot, the audit.

use super::*;

impl<F: PteFormat> Run<'_, F> {
    pub(crate) fn ctx(&self) -> String {
        format!(
            "{} seed {:#x} op {} ({}) [SLAT_TEST_SEED={:#x}]",
            F::NAME,
            self.seed,
            self.op,
            self.what,
            self.seed
        )
    }

    pub(crate) fn slot_of(&self, g: u64) -> Option<&SlotM> {
        self.slots.values().find(|s| s.contains(g))
    }

    /// Everything the model knows about one GFN.
    pub(crate) fn check_gfn(&self, g: u64) {
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

    pub(crate) fn check_range(&self, s: u64, e: u64, samples: u64) {
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
    pub(crate) fn check_slot(&self, id: u32, full: bool) {
        if let Some(s) = self.slots.get(&id) {
            let samples = if full && self.tpls[s.tpl].small {
                1 << 13
            } else {
                256
            };
            self.check_range(s.base, s.end(), samples);
        }
    }

    pub(crate) fn audit(&self) {
        check_audit(&self.vm, &self.ctx());
    }

    pub(crate) fn sweep(&self) {
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
}
