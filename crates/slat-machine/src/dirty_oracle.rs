//! The dirty-log oracle (KVM's `dirty_log_test`, for several vCPUs): guest writers stamp
//! pseudo-random pages with the current iteration number while the host harvests the log in
//! the middle of the iteration and again after stopping the vCPUs; then every page of guest
//! memory is checked against what the harvests reported:
//!
//! - a page holding this iteration's number was written in this iteration, so it must have
//!   been reported (otherwise a dirty page was *lost*: silent corruption after migration);
//! - a page reported dirty must hold this iteration's number (otherwise the report was
//!   *spurious*; the engine's protocol is exact, so this is an error too), except in the first
//!   iteration of `clear-log`, whose bitmap starts all set.
//!
//! The vCPUs are stopped (out of guest mode) for the final harvest and the check, so the
//! checked memory is stable. Values only grow, and iteration `k` starts after iteration
//! `k - 1` was fully harvested, so "holds `k`'s stamp" is exactly "written since the last
//! check".
//!
//! With [`OracleConfig::toggle_every`], some iterations also turn logging off and on again in
//! the middle, with the writers running (recovery and eager split racing the writes). Turning
//! logging off ends what the log promises — a VMM resends everything after that — so writes
//! from before the re-enable are not checked: the host switches the writers to a second stamp
//! once logging is on again, and every page holding the second stamp must be reported.

use crate::machine::{DirtyConfig, Machine, MachineError, Workload, FIRST_SLOT};
use slat::dirty::{INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use slat::format::{PteFormat, PAGE_SIZE};
use slat::SlotId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the log is harvested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogMode {
    /// GET_DIRTY_LOG clears and re-protects.
    DirtyLog,
    /// Manual protect with INITIALLY_SET: GET copies, CLEAR clears and re-protects.
    ClearLog,
    /// Per-vCPU dirty rings: harvest, then reset.
    DirtyRing,
}

impl LogMode {
    /// Every mode, in the selftest's order.
    pub const ALL: [LogMode; 3] = [LogMode::DirtyLog, LogMode::ClearLog, LogMode::DirtyRing];

    /// The selftest's name for the mode.
    pub fn name(self) -> &'static str {
        match self {
            LogMode::DirtyLog => "dirty-log",
            LogMode::ClearLog => "clear-log",
            LogMode::DirtyRing => "dirty-ring",
        }
    }

    /// The machine's dirty configuration for this mode.
    pub fn dirty_config(self, ring_entries: u32) -> DirtyConfig {
        match self {
            LogMode::DirtyLog => DirtyConfig::default(),
            LogMode::ClearLog => DirtyConfig {
                manual_protect: MANUAL_PROTECT_ENABLE | INITIALLY_SET,
                ..DirtyConfig::default()
            },
            LogMode::DirtyRing => DirtyConfig {
                ring_entries,
                ..DirtyConfig::default()
            },
        }
    }
}

/// Parameters of one oracle run.
#[derive(Debug, Clone, Copy)]
pub struct OracleConfig {
    /// The harvest protocol.
    pub mode: LogMode,
    /// Iterations (selftest: 32).
    pub iterations: u32,
    /// Length of each iteration (selftest: 10 ms).
    pub interval: Duration,
    /// Seed of the guest writers and of the host's mid-iteration harvest point.
    pub seed: u32,
    /// Every this many iterations (0: never), turn dirty logging off and on again in the
    /// middle of the iteration while the guest writes.
    pub toggle_every: u32,
}

/// One iteration's counts.
#[derive(Debug, Clone, Copy, Default)]
pub struct IterationReport {
    /// 1-based.
    pub iteration: u32,
    /// Pages reported dirty.
    pub dirty: u64,
    /// Pages not reported.
    pub clean: u64,
    /// Guest writes.
    pub writes: u64,
    /// Pages written this iteration but not reported.
    pub lost: u64,
    /// Pages reported but not written this iteration.
    pub spurious: u64,
    /// Logging was turned off and on again in this iteration.
    pub toggled: bool,
}

/// A whole run.
#[derive(Debug, Clone, Default)]
pub struct OracleReport {
    /// Per iteration.
    pub iterations: Vec<IterationReport>,
    /// Up to 16 readable descriptions of the first mismatches.
    pub errors: Vec<String>,
    /// Ring-full exits taken by the vCPUs.
    pub ring_full_exits: u64,
}

impl OracleReport {
    /// Pages reported dirty over all iterations.
    pub fn total_dirty(&self) -> u64 {
        self.iterations.iter().map(|i| i.dirty).sum()
    }
    /// Pages checked clean over all iterations.
    pub fn total_clean(&self) -> u64 {
        self.iterations.iter().map(|i| i.clean).sum()
    }
    /// Lost plus spurious pages.
    pub fn mismatches(&self) -> u64 {
        self.iterations.iter().map(|i| i.lost + i.spurious).sum()
    }
}

/// Runs the oracle on `m`, which must have been built with `cfg.mode.dirty_config(..)`;
/// calls `progress` after each iteration. Dirty logging is on for the run and off after it.
pub fn run<F: PteFormat>(
    m: &Machine<F>,
    cfg: OracleConfig,
    mut progress: impl FnMut(&IterationReport),
) -> Result<OracleReport, MachineError> {
    if cfg.iterations == 0 {
        return Err(MachineError::Config(
            "at least one iteration is needed".into(),
        ));
    }
    let layout = m.layout();
    let total = layout.total_pages();
    let pps = m.pages_per_slot();
    let mut dirty = vec![0u64; total.div_ceil(64) as usize];
    let mut report = OracleReport::default();
    let iteration = Arc::new(AtomicU64::new(0));
    let mut rng = crate::memstress::ParkMiller::new(cfg.seed ^ 0x5eed);
    m.set_dirty_logging(true)?;
    for k in 1..=cfg.iterations {
        // Stamps: 2k while the log covers the whole iteration, 2k + 1 after a re-enable.
        let stamp = 2 * k as u64;
        let toggled = cfg.toggle_every != 0 && k % cfg.toggle_every == 0;
        iteration.store(stamp, Ordering::SeqCst);
        let t0 = Instant::now();
        m.start(Workload::Writer {
            seed: cfg.seed,
            iteration: iteration.clone(),
        })?;
        // Harvest once at a random point in the middle of the iteration, with writers running.
        let interval_us = cfg.interval.as_micros().max(1) as u64;
        let reap = Duration::from_micros(rng.next_u32() as u64 % interval_us);
        std::thread::sleep(reap.saturating_sub(t0.elapsed()));
        collect(m, cfg.mode, pps, &mut dirty)?;
        if toggled {
            m.set_dirty_logging(false)?;
            m.set_dirty_logging(true)?;
            // Only from now on does the log promise anything again.
            iteration.store(stamp + 1, Ordering::SeqCst);
        }
        std::thread::sleep(cfg.interval.saturating_sub(t0.elapsed()));
        let run = m.halt()?;
        collect(m, cfg.mode, pps, &mut dirty)?;
        let mut it = IterationReport {
            iteration: k,
            writes: run.vcpus.iter().map(|v| v.pages).sum(),
            toggled,
            ..IterationReport::default()
        };
        report.ring_full_exits += run
            .vcpus
            .iter()
            .map(|v| v.counters.ring_full_exits)
            .sum::<u64>();
        // INITIALLY_SET bitmaps start (and restart, after a toggle) all set.
        let all_set = cfg.mode == LogMode::ClearLog && (k == 1 || toggled);
        let checked = if toggled { stamp + 1 } else { stamp };
        for p in 0..total {
            // SAFETY: the page lies in the test region of guest RAM, mapped while `m` lives;
            // the vCPUs are halted, and the read is 8-byte aligned and atomic.
            let v = unsafe { AtomicU64::from_ptr((layout.host + p * PAGE_SIZE) as *mut u64) }
                .load(Ordering::Relaxed);
            let reported = dirty[(p / 64) as usize] & (1 << (p % 64)) != 0;
            if reported {
                it.dirty += 1;
            } else {
                it.clean += 1;
            }
            let written = v == stamp || v == stamp + 1;
            if v == checked && !reported {
                it.lost += 1;
                if report.errors.len() < 16 {
                    report.errors.push(format!(
                        "iteration {k}: page {p} (gpa {:#x}) was written in this iteration{} but not reported dirty",
                        layout.gpa + p * PAGE_SIZE,
                        if toggled { " after logging was re-enabled" } else { "" }
                    ));
                }
            } else if reported && !written && !all_set {
                it.spurious += 1;
                if report.errors.len() < 16 {
                    report.errors.push(format!(
                        "iteration {k}: page {p} (gpa {:#x}) was reported dirty but holds {v} (not written in this iteration)",
                        layout.gpa + p * PAGE_SIZE
                    ));
                }
            }
        }
        dirty.iter_mut().for_each(|w| *w = 0);
        progress(&it);
        report.iterations.push(it);
    }
    m.set_dirty_logging(false)?;
    Ok(report)
}

/// One harvest of every slot into `dirty` (bit = page index in the test region).
fn collect<F: PteFormat>(
    m: &Machine<F>,
    mode: LogMode,
    pps: u64,
    dirty: &mut [u64],
) -> Result<(), MachineError> {
    let vm = m.vm();
    let nslots = m.config().slots as u32;
    let mut set = |slot: SlotId, offset: u64| {
        // Rings also log slots the VMM added beside the test region: not ours to check.
        if !(FIRST_SLOT..FIRST_SLOT + nslots).contains(&slot) || offset >= pps {
            return;
        }
        let p = (slot - FIRST_SLOT) as u64 * pps + offset;
        dirty[(p / 64) as usize] |= 1 << (p % 64);
    };
    match mode {
        LogMode::DirtyLog | LogMode::ClearLog => {
            let mut buf = vec![0u64; pps.div_ceil(64) as usize];
            for id in m.slot_ids() {
                vm.get_dirty_log(id, &mut buf)?;
                for (w, &bits) in buf.iter().enumerate() {
                    let mut b = bits;
                    while b != 0 {
                        set(id, w as u64 * 64 + b.trailing_zeros() as u64);
                        b &= b - 1;
                    }
                }
                if mode == LogMode::ClearLog {
                    vm.clear_dirty_log(id, 0, pps, &buf)?;
                }
            }
        }
        LogMode::DirtyRing => {
            m.collect_dirty_rings(&mut set);
            vm.reset_dirty_rings()?;
        }
    }
    Ok(())
}
