//! The churn thread.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Zap,
    Age,
    MoveAux,
    ToggleAux,
    HarvestAux,
    MoveChecked,
    RoSlot,
}

/// What the churn thread did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ChurnOut {
    pub(crate) zaps: u64,
    pub(crate) aging: u64,
    pub(crate) aged_leaves: u64,
    pub(crate) aux_moves: u64,
    pub(crate) aux_toggles: u64,
    pub(crate) aux_harvests: u64,
    pub(crate) checked_moves: u64,
    pub(crate) ro_adds: u64,
    pub(crate) ro_deletes: u64,
    pub(crate) ro_refusals: u64,
}

impl ChurnOut {
    pub(crate) fn ops(&self) -> u64 {
        self.zaps
            + self.aging
            + self.aux_moves
            + self.aux_toggles
            + self.aux_harvests
            + self.checked_moves
            + self.ro_adds
            + self.ro_deletes
    }

    pub(crate) fn add(&mut self, o: &ChurnOut) {
        self.zaps += o.zaps;
        self.aging += o.aging;
        self.aged_leaves += o.aged_leaves;
        self.aux_moves += o.aux_moves;
        self.aux_toggles += o.aux_toggles;
        self.aux_harvests += o.aux_harvests;
        self.checked_moves += o.checked_moves;
        self.ro_adds += o.ro_adds;
        self.ro_deletes += o.ro_deletes;
        self.ro_refusals += o.ro_refusals;
    }
}

pub(crate) struct Churner<F: PteFormat> {
    pub(crate) vm: Arc<Vm<F>>,
    pub(crate) sh: Arc<Shared>,
    pub(crate) cfg: RoundCfg,
    pub(crate) rng: Rng,
    pub(crate) ro_rams: Vec<Arc<GuestRam>>,
    pub(crate) ro_present: [bool; RO_SLOTS as usize],
    pub(crate) aux_pos: u64,
    pub(crate) aux_logging: bool,
    pub(crate) checked_pos: [usize; CHECKED],
    pub(crate) out: ChurnOut,
}

impl<F: PteFormat> Churner<F> {
    pub(crate) fn ops(&self) -> Vec<Op> {
        let c = self.cfg.churn;
        let mut ops = Vec::new();
        let mut add = |on: bool, o: &[Op]| {
            if on {
                ops.extend_from_slice(o);
            }
        };
        add(c.zap, &[Op::Zap, Op::Zap]);
        add(c.age, &[Op::Age, Op::Age]);
        add(c.aux, &[Op::MoveAux, Op::ToggleAux, Op::HarvestAux]);
        add(c.move_checked, &[Op::MoveChecked]);
        add(c.ro_slots, &[Op::RoSlot]);
        ops
    }

    pub(crate) fn run(mut self) -> ChurnOut {
        let ops = self.ops();
        while !self.sh.stopped() {
            if !ops.is_empty() {
                let op = self.rng.pick(&ops);
                if let Err(e) = self.apply(op) {
                    self.sh.fail(format!("churn {op:?}: {e}"));
                    break;
                }
            }
            pause::<F>(self.rng.upto(self.cfg.churn_gap));
        }
        self.out
    }

    pub(crate) fn apply(&mut self, op: Op) -> Result<(), String> {
        match op {
            Op::Zap => self.zap(),
            Op::Age => self.age()?,
            Op::MoveAux => self.move_aux()?,
            Op::ToggleAux => self.toggle_aux()?,
            Op::HarvestAux => self.harvest_aux()?,
            Op::MoveChecked => self.move_checked()?,
            Op::RoSlot => self.ro_slot()?,
        }
        Ok(())
    }

    /// First GFN of checked slot `s` now (only this thread moves it).
    pub(crate) fn checked_gfn(&self, s: usize) -> u64 {
        self.sh.checked_gpa[s].load(Ordering::SeqCst) >> PAGE_SHIFT
    }

    /// Mostly a few pages inside what may be one huge mapping (the engine zaps the whole huge
    /// leaf, and faults rebuild it or map 4 KiB inside it), sometimes 2 MiB or the whole slot.
    pub(crate) fn zap(&mut self) {
        let s = self.rng.below(CHECKED as u64) as usize;
        let (first, len) = match self.rng.below(10) {
            0 => (0, PAGES),
            1 | 2 => (self.rng.below(PAGES / 512) * 512, 512),
            _ => {
                let p = self.rng.below(PAGES);
                (p, (1 + self.rng.below(8)).min(PAGES - p))
            }
        };
        let g = self.checked_gfn(s) + first;
        self.vm
            .zap_gfn_range(Gfn::new(g), Gfn::new(g + len))
            .expect("not refused: no CPU of this thread in guest mode");
        if self.rng.chance(20) {
            let a = self.sh.aux_gpa.load(Ordering::SeqCst) >> PAGE_SHIFT;
            let p = self.rng.below(AUX_BYTES / PAGE_SIZE - 8);
            self.vm
                .zap_gfn_range(Gfn::new(a + p), Gfn::new(a + p + 1 + self.rng.below(8)))
                .expect("not refused: no CPU of this thread in guest mode");
        }
        self.out.zaps += 1;
    }

    /// One aging pass over a checked slot, in one of the forms `age.rs` offers.
    pub(crate) fn age(&mut self) -> Result<(), String> {
        let s = self.rng.below(CHECKED as u64) as usize;
        let (start, end) = (self.checked_gfn(s), self.checked_gfn(s) + PAGES);
        let on_dirty = |_: Gfn, _: u64| {};
        let r: AgeReport = match self.rng.below(7) {
            0 | 1 => self
                .vm
                .clear_young(Gfn::new(start), Gfn::new(end), on_dirty),
            2 => self
                .vm
                .clear_flush_young(Gfn::new(start), Gfn::new(end), on_dirty)
                .expect("not refused: no CPU of this thread in guest mode"),
            3 => self
                .vm
                .age_gfn_range(Gfn::new(start), Gfn::new(end), AgeFlush::NoFlush, on_dirty)
                .expect("not refused: no CPU of this thread in guest mode"),
            4 => self
                .vm
                .age_gfn_range(Gfn::new(start), Gfn::new(end), AgeFlush::Flush, on_dirty)
                .expect("not refused: no CPU of this thread in guest mode"),
            5 => self.vm.test_young(Gfn::new(start), Gfn::new(end)),
            _ => {
                let mut idle =
                    IdleBitmap::new::<F>(Gfn::new(start), PAGES).map_err(|e| e.to_string())?;
                let flush = self.rng.pick(&[AgeFlush::NoFlush, AgeFlush::Flush]);
                let r = self
                    .vm
                    .mark_idle(&mut idle, flush, on_dirty)
                    .map_err(|e| e.to_string())?;
                self.vm.read_idle(&mut idle);
                r
            }
        };
        self.out.aging += 1;
        self.out.aged_leaves += r.aged_leaves;
        Ok(())
    }

    pub(crate) fn move_aux(&mut self) -> Result<(), String> {
        let k = (self.aux_pos + 1 + self.rng.below(AUX_POSITIONS - 1)) % AUX_POSITIONS;
        self.vm
            .move_memslot(AUX_ID, Gpa::new(aux_gpa(k)))
            .map_err(|e| e.to_string())?;
        self.sh.aux_gpa.store(aux_gpa(k), Ordering::SeqCst);
        self.aux_pos = k;
        self.out.aux_moves += 1;
        Ok(())
    }

    pub(crate) fn toggle_aux(&mut self) -> Result<(), String> {
        self.aux_logging = !self.aux_logging;
        let flags = if self.aux_logging {
            MemslotFlags::LOG_DIRTY_PAGES
        } else {
            MemslotFlags::empty()
        };
        self.vm
            .set_memslot_flags(AUX_ID, flags)
            .map_err(|e| e.to_string())?;
        self.out.aux_toggles += 1;
        Ok(())
    }

    /// A second harvester on another slot (bitmap modes; the host alone drains the rings).
    pub(crate) fn harvest_aux(&mut self) -> Result<(), String> {
        if !self.aux_logging || matches!(self.cfg.log, LogMode::Ring { .. }) {
            return Ok(());
        }
        let pages = AUX_BYTES / PAGE_SIZE;
        let mut buf = vec![0u64; pages.div_ceil(64) as usize];
        self.vm
            .get_dirty_log(AUX_ID, &mut buf)
            .map_err(|e| e.to_string())?;
        if self.cfg.manual() {
            self.vm
                .clear_dirty_log(AUX_ID, PageIndex::new(0), pages, &buf)
                .map_err(|e| e.to_string())?;
        }
        self.out.aux_harvests += 1;
        Ok(())
    }

    /// Moves a checked slot to its other position; vCPUs that still use the old address take
    /// MMIO exits and retry at the new one.
    pub(crate) fn move_checked(&mut self) -> Result<(), String> {
        let s = self.rng.below(CHECKED as u64) as usize;
        let k = 1 - self.checked_pos[s];
        let before = self.sh.epoch.load(Ordering::SeqCst);
        self.vm
            .move_memslot(checked_id(s), Gpa::new(checked_gpa(s, k)))
            .map_err(|e| e.to_string())?;
        self.sh.checked_gpa[s].store(checked_gpa(s, k), Ordering::SeqCst);
        let after = self.sh.epoch.load(Ordering::SeqCst);
        let from = checked_gpa(s, 1 - k);
        lock(&self.sh.moves).push(Move {
            slot: s,
            before,
            after,
            from,
            to: checked_gpa(s, k),
        });
        self.checked_pos[s] = k;
        self.out.checked_moves += 1;
        Ok(())
    }

    /// Adds or deletes a read-only slot; checks that READONLY cannot be toggled on it, nor
    /// on the writable slots (where accepting it would silently end their log).
    pub(crate) fn ro_slot(&mut self) -> Result<(), String> {
        let i = self.rng.below(RO_SLOTS) as usize;
        let id = RO_FIRST + i as SlotId;
        let log = if self.rng.chance(50) {
            MemslotFlags::LOG_DIRTY_PAGES
        } else {
            MemslotFlags::empty()
        };
        if self.ro_present[i] {
            self.refused(id, log)?;
            // The log bit of a read-only slot may change (it logs nothing either way).
            self.vm
                .set_memslot_flags(id, MemslotFlags::READONLY | log)
                .map_err(|e| format!("memslot {id}: {e}"))?;
            if self.rng.chance(60) {
                self.vm.delete_memslot(id).map_err(|e| e.to_string())?;
                self.ro_present[i] = false;
                self.out.ro_deletes += 1;
            }
        } else {
            let host = HostRange::new(self.ro_rams[i].clone()).map_err(|e| e.to_string())?;
            self.vm
                .add_memslot(
                    id,
                    Gpa::new(ro_gpa(i as u64)),
                    RO_BYTES,
                    host,
                    MemslotFlags::READONLY | log,
                )
                .map_err(|e| e.to_string())?;
            self.ro_present[i] = true;
            self.out.ro_adds += 1;
        }
        let s = self.rng.below(CHECKED as u64) as usize;
        let rw = MemslotFlags::READONLY | MemslotFlags::LOG_DIRTY_PAGES;
        self.refused(checked_id(s), rw)?;
        self.refused(AUX_ID, MemslotFlags::READONLY)
    }

    /// `set_memslot_flags(id, flags)` must be refused as a READONLY change.
    pub(crate) fn refused(&mut self, id: SlotId, flags: MemslotFlags) -> Result<(), String> {
        match self.vm.set_memslot_flags(id, flags) {
            Err(MemslotError::ReadonlyChange { id: got }) if got == id => {
                self.out.ro_refusals += 1;
                Ok(())
            }
            r => Err(format!(
                "memslot {id}: flags {flags:?} toggle READONLY, want ReadonlyChange, got {r:?}"
            )),
        }
    }
}
