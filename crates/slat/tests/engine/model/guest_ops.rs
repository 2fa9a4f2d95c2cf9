//! Guest-side operations of a run: faults on random GFNs and zaps of random ranges.

use super::*;
use slat::Level;

impl<F: PteFormat> Run<'_, F> {
    pub(crate) fn random_gfn(&mut self) -> u64 {
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

    pub(crate) fn fault(&mut self) {
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
        assert_eq!(
            outcome_counter(o, &after),
            outcome_counter(o, &before) + 1,
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
                self.check_in_slot_outcome(o, pre, post, access, logging, &ctx);
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
                self.record_mapped(g, id, level, logging, access);
            }
        }
        if slot.is_some() {
            self.remember(g);
        }
        self.check_gfn(g);
        for d in [1u64, 511, 512] {
            self.check_gfn(g + d);
            self.check_gfn(g.saturating_sub(d));
        }
    }

    /// The expected outcome of a fault inside a slot, given what was mapped before: spurious
    /// if the leaf already permitted the access (bar a lazy split under break-before-make), else
    /// fixed, never retried.
    fn check_in_slot_outcome(
        &self,
        o: FaultOutcome,
        pre: Option<(u64, Level)>,
        post: Option<(u64, Level)>,
        access: Access,
        logging: bool,
        ctx: &str,
    ) {
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
    }

    /// Model bookkeeping for a GFN mapped by a fault: the leaf's range may be mapped, and in a
    /// logged slot the page counts as written or accessed.
    fn record_mapped(&mut self, g: u64, id: u32, level: Level, logging: bool, access: Access) {
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

    /// Keeps a faulted GFN among the recent ones (at most 64) for later faults to revisit.
    fn remember(&mut self, g: u64) {
        if self.recent.len() < 64 {
            self.recent.push(g);
        } else {
            let i = self.rng.below(64) as usize;
            self.recent[i] = g;
        }
    }

    pub(crate) fn zap(&mut self) {
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
}

/// The statistics counter a fault outcome increments.
fn outcome_counter(o: FaultOutcome, s: &slat::Stats) -> u64 {
    match o {
        FaultOutcome::Fixed => s.pf_fixed,
        FaultOutcome::FixedFast => s.pf_fast,
        FaultOutcome::Spurious => s.pf_spurious,
        FaultOutcome::Retry => s.pf_retry,
        FaultOutcome::NoSlot => s.pf_no_slot,
        FaultOutcome::ReadOnly => s.pf_read_only,
        FaultOutcome::DirtyRingFull => s.pf_ring_full,
        FaultOutcome::InGuestMode => unreachable!("checked above"),
        FaultOutcome::MemoryFault { .. } => unreachable!("the model has no private memory"),
    }
}
