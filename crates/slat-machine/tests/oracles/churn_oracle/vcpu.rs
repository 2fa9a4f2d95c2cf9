//! The vCPUs.

use super::*;

/// What one vCPU did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct VcpuOut {
    pub(crate) writes: u64,
    pub(crate) reads: u64,
    pub(crate) aux: u64,
    pub(crate) ro_exits: u64,
    pub(crate) ro_reads: u64,
    pub(crate) mmio_retries: u64,
    pub(crate) counters: CpuCounters,
}

/// A vCPU thread's state.
pub(crate) struct Guest<F: PteFormat> {
    pub(crate) cpu: Cpu<F>,
    pub(crate) v: usize,
    pub(crate) sh: Arc<Shared>,
    pub(crate) rng: Rng,
    pub(crate) seq: u64,
    /// What this vCPU last wrote into its word of each checked page.
    pub(crate) mine: Vec<u64>,
    pub(crate) out: VcpuOut,
}

impl<F: PteFormat> Guest<F> {
    pub(crate) fn run(mut self) -> VcpuOut {
        self.cpu.enter();
        'run: while !self.sh.stopped() {
            for _ in 0..64 {
                if let Err(e) = self.step() {
                    self.sh.fail(format!("vCPU {}: {e}", self.v));
                    break 'run;
                }
            }
        }
        self.cpu.exit();
        self.out.counters = self.cpu.counters;
        self.out
    }

    pub(crate) fn step(&mut self) -> Result<(), String> {
        match self.rng.below(100) {
            0..=64 => self.checked_write(),
            65..=79 => self.checked_read(),
            80..=89 => self.aux_access(),
            _ => self.ro_access(),
        }
    }

    /// A checked page: a quarter of the time one of the hot pages every vCPU writes.
    pub(crate) fn pick_checked(&mut self) -> usize {
        let s = self.rng.below(CHECKED as u64);
        let p = if self.rng.chance(25) {
            self.rng.below(HOT_PAGES)
        } else {
            self.rng.below(PAGES)
        };
        (s * PAGES + p) as usize
    }

    /// Runs `op` on this vCPU's word of checked page `idx`, again while the slot is being
    /// moved (an MMIO exit: the address was read before the move published the new one; no
    /// access happened). `None`: the round stopped first.
    pub(crate) fn at_checked<T>(
        &mut self,
        idx: usize,
        op: impl Fn(&mut Cpu<F>, u64) -> Result<T, Exit>,
    ) -> Result<Option<T>, String> {
        let (s, p) = (idx / PAGES as usize, idx as u64 % PAGES);
        let deadline = after::<F>(Duration::from_secs(10));
        loop {
            let gpa =
                self.sh.checked_gpa[s].load(Ordering::SeqCst) + p * PAGE_SIZE + self.v as u64 * 8;
            match op(&mut self.cpu, gpa) {
                Ok(t) => return Ok(Some(t)),
                Err(Exit::Mmio { .. }) if self.sh.stopped() => return Ok(None),
                Err(Exit::Mmio { .. }) if now_ns::<F>() < deadline => {
                    self.out.mmio_retries += 1;
                    yield_now::<F>();
                }
                Err(e) => {
                    return Err(format!(
                        "checked slot {} page {p} (gpa {gpa:#x}): {e:?}",
                        checked_id(s)
                    ))
                }
            }
        }
    }

    /// Writes a value never written before and records the write for the oracle.
    pub(crate) fn checked_write(&mut self) -> Result<(), String> {
        let idx = self.pick_checked();
        self.seq += 1;
        let val = (self.seq << 8) | self.v as u64;
        // In flight before `b` is read and before any mark the write's fault makes: a harvest
        // that reports the page before the record exists sees it here (x86 TSO orders it).
        self.sh.inflight[self.v].store(idx as u64 + 1, Ordering::SeqCst);
        let b = self.sh.epoch.load(Ordering::SeqCst);
        let wrote = self.at_checked(idx, |cpu, gpa| cpu.write_u64(gpa, val).map(|()| gpa))?;
        if let Some(gpa) = wrote {
            // The store, and the mark or ring entry of its fault, before `c` is read: with
            // the fence in `Host::bump`, either a harvest sees them or `c` reaches its start.
            fence(Ordering::SeqCst);
            let c = self.sh.epoch.load(Ordering::SeqCst);
            self.sh.rec[idx].fetch_max(pack(b, c), Ordering::SeqCst);
            self.mine[idx] = val;
            self.sh.wrote_at[idx].store(gpa, Ordering::Relaxed);
            self.out.writes += 1;
        } else {
            let c = self.sh.epoch.load(Ordering::SeqCst);
            self.sh.abandoned[idx].fetch_max(pack(b, c), Ordering::SeqCst);
        }
        self.sh.inflight[self.v].store(0, Ordering::SeqCst);
        Ok(())
    }

    /// Reads back this vCPU's word: a stale or wrong translation returns another value.
    pub(crate) fn checked_read(&mut self) -> Result<(), String> {
        let idx = self.pick_checked();
        let want = self.mine[idx];
        match self.at_checked(idx, |cpu, gpa| cpu.read_u64(gpa))? {
            Some(got) if got != want => Err(format!(
                "checked slot {} page {} read {got:#x}, but this vCPU last wrote {want:#x} there",
                checked_id(idx / PAGES as usize),
                idx as u64 % PAGES
            )),
            Some(_) => {
                self.out.reads += 1;
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// The auxiliary slot, which may be moving (MMIO) but is never read-only.
    pub(crate) fn aux_access(&mut self) -> Result<(), String> {
        let q = self.rng.below(AUX_BYTES / PAGE_SIZE);
        let gpa = self.sh.aux_gpa.load(Ordering::SeqCst) + q * PAGE_SIZE + self.v as u64 * 8;
        let r = if self.rng.chance(50) {
            self.cpu.write_u64(gpa, self.seq)
        } else {
            self.cpu.read_u64(gpa).map(|_| ())
        };
        match r {
            Ok(()) => {
                self.out.aux += 1;
                Ok(())
            }
            Err(Exit::Mmio { .. }) => Ok(()),
            Err(e) => Err(format!("auxiliary slot gpa {gpa:#x}: {e:?}")),
        }
    }

    /// A read-only slot, present or not: a write must exit (ReadOnly, or MMIO while absent),
    /// a read must return the slot's pattern.
    pub(crate) fn ro_access(&mut self) -> Result<(), String> {
        let i = self.rng.below(RO_SLOTS);
        let q = self.rng.below(RO_BYTES / PAGE_SIZE);
        let gpa = ro_gpa(i) + q * PAGE_SIZE;
        let id = RO_FIRST + i as SlotId;
        if self.rng.chance(50) {
            return match self.cpu.write_u64(gpa, 1) {
                Err(Exit::ReadOnly { .. }) => {
                    self.out.ro_exits += 1;
                    Ok(())
                }
                Err(Exit::Mmio { .. }) => Ok(()),
                Ok(()) => Err(format!(
                    "a write to read-only memslot {id} (gpa {gpa:#x}) went through"
                )),
                Err(e) => Err(format!("read-only memslot {id} write at {gpa:#x}: {e:?}")),
            };
        }
        match self.cpu.read_u64(gpa) {
            Ok(v) if v == ro_pattern(i, q) => {
                self.out.ro_reads += 1;
                Ok(())
            }
            Ok(v) => Err(format!(
                "read-only memslot {id} gpa {gpa:#x} read {v:#x}, want {:#x}",
                ro_pattern(i, q)
            )),
            Err(Exit::Mmio { .. }) => Ok(()),
            Err(e) => Err(format!("read-only memslot {id} read at {gpa:#x}: {e:?}")),
        }
    }
}

/// What a vCPU runs on a ring-full exit (as QEMU's vCPU thread when the reaper lags): harvest
/// every ring and reset them, holding `reaped` throughout (see [`Shared::reaped`]).
pub(crate) fn ring_full_handler<F: PteFormat>(
    vm: &Arc<Vm<F>>,
    sh: &Arc<Shared>,
) -> RingFullHandler {
    let (vm, sh) = (vm.clone(), sh.clone());
    Arc::new(move || {
        let mut out = lock_clocked::<F::Clock, _>(&sh.reaped);
        for r in vm.dirty_rings() {
            r.harvest(|s, o| out.push((s, o.raw())));
        }
        if let Err(e) = vm.reset_dirty_rings() {
            sh.fail(format!("ring-full exit: reset_dirty_rings: {e}"));
        }
    })
}
