//! The host: harvests, logging toggles, and the oracle.

use super::*;

/// What the host checked.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HostOut {
    pub(crate) harvests: u64,
    pub(crate) reported: u64,
    /// Writes whose harvest deadline passed and which were checked against the reports.
    pub(crate) obligations: u64,
    /// Reported pages checked against the writes.
    pub(crate) reports_checked: u64,
    /// Page words compared with the VMM's copy at the end of the round.
    pub(crate) shadow_words: u64,
    pub(crate) toggles: u64,
}

pub(crate) struct Host<'a, F: PteFormat> {
    pub(crate) vm: &'a Arc<Vm<F>>,
    pub(crate) sh: &'a Shared,
    pub(crate) cfg: &'a RoundCfg,
    pub(crate) rams: &'a [Arc<GuestRam>],
    pub(crate) rng: Rng,
    /// The epoch at the start and the end of harvest `h` (index `h - 1`).
    pub(crate) hs: Vec<u32>,
    pub(crate) he: Vec<u32>,
    /// Per checked slot: (epoch, logging on) at each change, in order.
    pub(crate) toggles: [Vec<(u32, bool)>; CHECKED],
    /// Per checked page: the last harvest that reported it (0: none).
    pub(crate) last_rep: Vec<u32>,
    /// Per checked page: the record already checked.
    pub(crate) seen: Vec<u64>,
    /// Per checked page and vCPU word: the VMM's copy (a migration's destination).
    pub(crate) shadow: Vec<u64>,
    /// Slot's next harvest reports every page (INITIALLY_SET, after logging was turned on).
    pub(crate) all_set: [bool; CHECKED],
    pub(crate) out: HostOut,
}

impl<'a, F: PteFormat> Host<'a, F> {
    pub(crate) fn new(
        vm: &'a Arc<Vm<F>>,
        sh: &'a Shared,
        cfg: &'a RoundCfg,
        rams: &'a [Arc<GuestRam>],
    ) -> Self {
        Host {
            vm,
            sh,
            cfg,
            rams,
            rng: Rng::new(cfg.seed ^ 0x4057),
            hs: Vec::new(),
            he: Vec::new(),
            toggles: std::array::from_fn(|_| Vec::new()),
            last_rep: vec![0; TOTAL],
            seen: vec![0; TOTAL],
            shadow: vec![0; TOTAL * cfg.vcpus],
            all_set: [false; CHECKED],
            out: HostOut::default(),
        }
    }

    /// Advances the epoch and returns its new value. The fence pairs with the one a vCPU
    /// runs between a write and reading `c`: either the harvest that follows sees the write's
    /// mark (or ring entry), or the vCPU reads at least this value.
    pub(crate) fn bump(&mut self) -> u32 {
        let e = self.sh.epoch.load(Ordering::Relaxed) + 1;
        self.sh.epoch.store(e, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        e
    }

    pub(crate) fn logging(&self, s: usize) -> bool {
        self.toggles[s].last().is_some_and(|t| t.1)
    }

    /// The round: let vCPUs map memory (huge where the backing allows) with logging off, so
    /// enabling it splits and protects under running writers; then harvest at random
    /// intervals, sometimes turning logging off and on, until `until` (ns on `F`'s clock).
    pub(crate) fn drive(&mut self, until: u64) -> Result<(), Failure> {
        pause::<F>(self.rng.upto(self.cfg.settle));
        for s in 0..CHECKED {
            self.enable(s)?;
        }
        while now_ns::<F>() < until {
            if let Some(f) = self.sh.failure() {
                return Err(Failure::Other(f));
            }
            pause::<F>(self.rng.upto(self.cfg.harvest_gap));
            if self.cfg.churn.toggle && self.rng.chance(15) {
                let s = self.rng.below(CHECKED as u64) as usize;
                self.toggle(s)?;
            } else {
                self.harvest()?;
            }
        }
        Ok(())
    }

    /// Logging off and on again on slot `s`. Turning it off ends the log, so harvest first;
    /// writes until it is on again are owed nothing, and the VMM copies the whole slot again.
    pub(crate) fn toggle(&mut self, s: usize) -> Result<(), Failure> {
        self.harvest()?;
        let e = self.bump();
        self.toggles[s].push((e, false));
        self.vm
            .set_memslot_flags(checked_id(s), MemslotFlags::empty())
            .map_err(other)?;
        pause::<F>(self.rng.upto(self.cfg.toggle_gap));
        self.enable(s)?;
        self.out.toggles += 1;
        Ok(())
    }

    /// Turns logging on; writes that begin afterwards (epoch at least `e`) are owed a report.
    pub(crate) fn enable(&mut self, s: usize) -> Result<(), Failure> {
        self.vm
            .set_memslot_flags(checked_id(s), MemslotFlags::LOG_DIRTY_PAGES)
            .map_err(other)?;
        let e = self.bump();
        self.toggles[s].push((e, true));
        self.all_set[s] = matches!(
            self.cfg.log,
            LogMode::Clear {
                initially_set: true
            }
        );
        for p in 0..PAGES {
            self.copy_page(s * PAGES as usize + p as usize);
        }
        Ok(())
    }

    pub(crate) fn copy_page(&mut self, idx: usize) {
        let (s, p) = (idx / PAGES as usize, idx as u64 % PAGES);
        let n = self.cfg.vcpus;
        for v in 0..n {
            self.shadow[idx * n + v] = word(&self.rams[s], p, v).load(Ordering::SeqCst);
        }
    }

    /// One harvest of every checked slot that logs, then the checks.
    pub(crate) fn harvest(&mut self) -> Result<(), Failure> {
        let hs = self.bump();
        self.hs.push(hs);
        let h = self.hs.len();
        let exempt = self.all_set;
        let reported = self.collect()?;
        let he = self.bump();
        self.he.push(he);
        self.out.harvests += 1;
        self.out.reported += reported.len() as u64;
        for s in 0..CHECKED {
            self.all_set[s] &= !self.logging(s);
        }
        self.check_reports(h, &reported, exempt)?;
        self.check_obligations(h)
    }

    /// Reported checked pages (indices), each once, in the round's log mode.
    pub(crate) fn collect(&mut self) -> Result<Vec<usize>, Failure> {
        let mut seen = vec![false; TOTAL];
        let mut out = Vec::new();
        let mut add = |slot: SlotId, off: u64| {
            // Rings also carry the auxiliary slot's entries: not ours to check.
            if let Some(s) = checked_index(slot).filter(|_| off < PAGES) {
                let idx = s * PAGES as usize + off as usize;
                if !std::mem::replace(&mut seen[idx], true) {
                    out.push(idx);
                }
            }
        };
        if let LogMode::Ring { .. } = self.cfg.log {
            let mut reaped = lock_clocked::<F::Clock, _>(&self.sh.reaped);
            for r in self.vm.dirty_rings() {
                r.harvest(|s, o| add(s, o.raw()));
            }
            self.vm
                .reset_dirty_rings()
                .map_err(|e| other(format!("reset_dirty_rings: {e}")))?;
            for (s, o) in reaped.drain(..) {
                add(s, o);
            }
            return Ok(out);
        }
        let mut buf = vec![0u64; PAGES.div_ceil(64) as usize];
        for s in (0..CHECKED).filter(|&s| self.logging(s)) {
            let id = checked_id(s);
            self.vm
                .get_dirty_log(id, &mut buf)
                .map_err(|e| other(format!("get_dirty_log({id}): {e}")))?;
            if self.cfg.manual() {
                self.vm
                    .clear_dirty_log(id, PageIndex::new(0), PAGES, &buf)
                    .map_err(|e| other(format!("clear_dirty_log({id}): {e}")))?;
            }
            for (w, &bits) in buf.iter().enumerate() {
                let mut b = bits;
                while b != 0 {
                    add(id, w as u64 * 64 + u64::from(b.trailing_zeros()));
                    b &= b - 1;
                }
            }
        }
        Ok(out)
    }

    /// Every page reported by harvest `h` was written: a write in flight now, or one that
    /// completed after the previous harvest began (its mark cannot be older). Also the VMM's
    /// part: note the report and copy the page.
    pub(crate) fn check_reports(
        &mut self,
        h: usize,
        reported: &[usize],
        exempt: [bool; CHECKED],
    ) -> Result<(), Failure> {
        // In-flight first: a write that is no longer in flight has its record already.
        let inflight: HashSet<u64> = self
            .sh
            .inflight
            .iter()
            .map(|a| a.load(Ordering::SeqCst))
            .collect();
        let prev_start = if h >= 2 { self.hs[h - 2] } else { 0 };
        let mut bad = Vec::new();
        for &idx in reported {
            self.last_rep[idx] = h as u32;
            self.copy_page(idx);
            if exempt[idx / PAGES as usize] {
                continue;
            }
            self.out.reports_checked += 1;
            if inflight.contains(&(idx as u64 + 1)) {
                continue;
            }
            let rec = self.sh.rec[idx].load(Ordering::SeqCst);
            let tried = self.sh.abandoned[idx].load(Ordering::SeqCst);
            let recent = |r: u64| unpack(r).is_some_and(|(_, c)| c >= prev_start);
            if !recent(rec) && !recent(tried) {
                bad.push(format!(
                    "{} reported by harvest {h} (previous harvest began at epoch {prev_start}), \
                     last write {}",
                    self.page_name(idx),
                    describe(rec)
                ));
            }
        }
        match bad.len() {
            0 => Ok(()),
            n => Err(Failure::Spurious(summarise(n, &bad))),
        }
    }

    /// Every write that completed before harvest `h` began, while logging was on on its slot
    /// throughout, was reported by a harvest that ended after the write began.
    pub(crate) fn check_obligations(&mut self, h: usize) -> Result<(), Failure> {
        let start = self.hs[h - 1];
        let mut bad = Vec::new();
        for idx in 0..TOTAL {
            let rec = self.sh.rec[idx].load(Ordering::SeqCst);
            let Some((b, c)) = unpack(rec).filter(|_| rec != self.seen[idx]) else {
                continue;
            };
            if c >= start {
                continue; // due by a later harvest
            }
            self.seen[idx] = rec;
            // The first harvest that began after the write completed: its deadline.
            let due = self.hs.partition_point(|&e| e <= c) + 1;
            if !self.logged_throughout(idx / PAGES as usize, b, self.hs[due - 1]) {
                continue;
            }
            self.out.obligations += 1;
            // The first harvest that ended after the write began: the earliest that covers it.
            let from = self.he.partition_point(|&e| e <= b) + 1;
            if (self.last_rep[idx] as usize) < from {
                bad.push(format!(
                    "{} written between epochs {b} and {c}, due by harvest {due} (epochs {}..{}), \
                     coverable from harvest {from}, last reported by harvest {}{}",
                    self.page_name(idx),
                    self.hs[due - 1],
                    self.he.get(due - 1).copied().unwrap_or(u32::MAX),
                    self.last_rep[idx],
                    self.write_context(idx, b, c)
                ));
            }
        }
        match bad.len() {
            0 => Ok(()),
            n => Err(Failure::Lost(summarise(n, &bad))),
        }
    }

    /// Logging was on on slot `s` when the epoch was `b` and stayed on until epoch `until`.
    pub(crate) fn logged_throughout(&self, s: usize, b: u32, until: u32) -> bool {
        let t = &self.toggles[s];
        let i = t.partition_point(|&(e, _)| e <= b);
        i > 0 && t[i - 1].1 && t.get(i).is_none_or(|&(e, _)| e > until)
    }

    /// With the vCPUs stopped: a last harvest, then the VMM's copy must equal guest memory.
    pub(crate) fn finish(&mut self) -> Result<(), Failure> {
        self.harvest()?;
        let n = self.cfg.vcpus;
        let mut bad = Vec::new();
        for idx in 0..TOTAL {
            let (s, p) = (idx / PAGES as usize, idx as u64 % PAGES);
            for v in 0..n {
                let mem = word(&self.rams[s], p, v).load(Ordering::SeqCst);
                let copy = self.shadow[idx * n + v];
                if mem != copy {
                    bad.push(format!(
                        "{}: vCPU {v}'s word holds {mem:#x}, the VMM's copy {copy:#x} (last \
                         write {}, last reported by harvest {} of {})",
                        self.page_name(idx),
                        describe(self.sh.rec[idx].load(Ordering::SeqCst)),
                        self.last_rep[idx],
                        self.hs.len()
                    ));
                }
            }
        }
        self.out.shadow_words += (TOTAL * n) as u64;
        match bad.len() {
            0 => Ok(()),
            k => Err(Failure::Lost(format!(
                "after the final harvest, {}",
                summarise(k, &bad)
            ))),
        }
    }

    /// Where the page's last write went, and the moves of its slot around epochs `[b, c]`.
    pub(crate) fn write_context(&self, idx: usize, b: u32, c: u32) -> String {
        let s = idx / PAGES as usize;
        let at = self.sh.wrote_at[idx].load(Ordering::Relaxed);
        let moves: Vec<String> = lock(&self.sh.moves)
            .iter()
            .filter(|m| m.slot == s && m.before <= c && m.after >= b)
            .map(|m| {
                let (from, to) = (m.from, m.to);
                format!(
                    "{from:#x} -> {to:#x} during epochs {}..{}",
                    m.before, m.after
                )
            })
            .collect();
        let moves = match moves.len() {
            0 => "none".to_string(),
            _ => moves.join(", "),
        };
        format!("; last written at gpa {at:#x}; moves of its slot meanwhile: {moves}")
    }

    pub(crate) fn page_name(&self, idx: usize) -> String {
        let (s, p) = (idx / PAGES as usize, idx as u64 % PAGES);
        let gpa = self.sh.checked_gpa[s].load(Ordering::SeqCst) + p * PAGE_SIZE;
        format!("page {p} of memslot {} (now gpa {gpa:#x})", checked_id(s))
    }
}

pub(crate) fn describe(rec: u64) -> String {
    match unpack(rec) {
        Some((b, c)) => format!("between epochs {b} and {c}"),
        None => "none".into(),
    }
}

/// `n` problems, the first few of them spelled out.
pub(crate) fn summarise(n: usize, lines: &[String]) -> String {
    let shown: Vec<&str> = lines.iter().take(8).map(String::as_str).collect();
    format!("{n} page(s):\n    {}", shown.join("\n    "))
}
