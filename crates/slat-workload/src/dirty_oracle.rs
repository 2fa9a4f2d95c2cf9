//! The dirty-log oracle (KVM's `dirty_log_test`, for several vCPUs), one function over any
//! [`TestMachine`]: guest writers stamp
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
//! The vCPUs are stopped (out of guest mode; on KVM, synced out of `KVM_RUN`) for the final
//! harvest and the check, so the checked memory is stable and every write they made has been
//! logged. Values only grow, and iteration `k` starts after iteration
//! `k - 1` was fully harvested, so "holds `k`'s stamp" is exactly "written since the last
//! check".
//!
//! With [`OracleConfig::toggle_every`], some iterations also turn logging off and on again in
//! the middle, with the writers running (recovery and eager split racing the writes). Turning
//! logging off ends what the log promises — a VMM resends everything after that — so writes
//! from before the re-enable are not checked: the host switches the writers to a second stamp
//! once logging is on again, and every page holding the second stamp must be reported.

use crate::dirty_config::{DirtyConfig, INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use crate::error::WorkloadError;
use crate::pattern::ParkMiller;
use crate::test_machine::TestMachine;
use slat_addr::PageIndex;
use slat_addr::PAGE_SIZE;
use slat_dirty::DirtyLogSource;
use std::time::Duration;

/// How the log is harvested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogMode {
    /// GET_DIRTY_LOG clears and re-protects.
    DirtyLog,
    /// Manual protect with INITIALLY_SET: GET copies, CLEAR clears and re-protects.
    ClearLog,
    /// Per-vCPU dirty rings: collect, then reset.
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// Pages lost over all iterations.
    pub fn lost(&self) -> u64 {
        self.iterations.iter().map(|i| i.lost).sum()
    }
    /// Lost plus spurious pages.
    pub fn mismatches(&self) -> u64 {
        self.iterations.iter().map(|i| i.lost + i.spurious).sum()
    }
}

impl LogMode {
    /// Whether a machine logging with `d` can be harvested in this mode.
    pub fn fits(self, d: DirtyConfig) -> bool {
        match self {
            LogMode::DirtyLog => d.ring_entries == 0 && d.manual_protect == 0,
            LogMode::ClearLog => {
                d.ring_entries == 0 && d.manual_protect == MANUAL_PROTECT_ENABLE | INITIALLY_SET
            }
            LogMode::DirtyRing => d.ring_entries != 0,
        }
    }
}

/// Runs the oracle on `m`, which must have been built with `cfg.mode.dirty_config(..)`
/// (refused with [`WorkloadError::Config`] otherwise); calls `progress` after each iteration.
/// Dirty logging is on for the run and off after it, also after a failure.
pub fn run<M: TestMachine + ?Sized>(
    m: &M,
    cfg: OracleConfig,
    mut progress: impl FnMut(&IterationReport),
) -> Result<OracleReport, M::Error> {
    if cfg.iterations == 0 {
        return Err(WorkloadError::Config("at least one iteration is needed".into()).into());
    }
    let d = m.dirty_config();
    if !cfg.mode.fits(d) {
        return Err(WorkloadError::Config(format!(
            "the machine's dirty configuration {d:?} does not match mode {}",
            cfg.mode.name()
        ))
        .into());
    }
    let total = m.layout().total_pages();
    let mut dirty = vec![0u64; total.div_ceil(64) as usize];
    let mut report = OracleReport::default();
    let mut rng = ParkMiller::new(cfg.seed ^ 0x5eed);
    m.set_dirty_logging(true)?;
    let result = (|| -> Result<(), M::Error> {
        for k in 1..=cfg.iterations {
            let it = iteration(m, &cfg, k, &mut rng, &mut dirty, &mut report)?;
            dirty.iter_mut().for_each(|w| *w = 0);
            progress(&it);
            report.iterations.push(it);
        }
        Ok(())
    })();
    // Turn logging off even after a failure, but report the first error.
    let off = m.set_dirty_logging(false);
    result?;
    off?;
    Ok(report)
}

/// Iteration `k`: run the writers with a harvest in the middle, halt them, harvest again and
/// check every page.
fn iteration<M: TestMachine + ?Sized>(
    m: &M,
    cfg: &OracleConfig,
    k: u32,
    rng: &mut ParkMiller,
    dirty: &mut [u64],
    report: &mut OracleReport,
) -> Result<IterationReport, M::Error> {
    // Stamps: 2k while the log covers the whole iteration, 2k + 1 after a re-enable.
    let stamp = 2 * k as u64;
    let toggled = cfg.toggle_every != 0 && k % cfg.toggle_every == 0;
    // The machine's clock: the host's, or its simulated CPU's in virtual time.
    let t0 = m.now_ns();
    let elapsed = || Duration::from_nanos(m.now_ns().saturating_sub(t0));
    m.start_writer(cfg.seed, stamp)?;
    // Harvest once at a random point in the middle of the iteration, with writers running.
    let interval_us = cfg.interval.as_micros().clamp(1, u64::MAX as u128) as u64;
    let reap = Duration::from_micros(rng.next_u32() as u64 % interval_us);
    m.sleep(reap.saturating_sub(elapsed()));
    let mid = (|| {
        collect(m, cfg.mode, dirty)?;
        if toggled {
            m.set_dirty_logging(false)?;
            m.set_dirty_logging(true)?;
            // Only from now on does the log promise anything again.
            m.set_writer_value(stamp + 1);
        }
        Ok::<_, M::Error>(())
    })();
    // Halt the writers even after a failed harvest, then report the harvest's error.
    if mid.is_ok() {
        m.sleep(cfg.interval.saturating_sub(elapsed()));
    }
    let run = m.halt()?;
    mid?;
    collect(m, cfg.mode, dirty)?;
    let mut it = IterationReport {
        iteration: k,
        writes: run.pages(),
        toggled,
        ..IterationReport::default()
    };
    report.ring_full_exits += run.ring_full_exits();
    check(m, cfg.mode, k, stamp, toggled, dirty, &mut it, report);
    Ok(it)
}

/// Checks every page of the test region against the harvested bits of iteration `k`.
#[allow(clippy::too_many_arguments)]
fn check<M: TestMachine + ?Sized>(
    m: &M,
    mode: LogMode,
    k: u32,
    stamp: u64,
    toggled: bool,
    dirty: &[u64],
    it: &mut IterationReport,
    report: &mut OracleReport,
) {
    let gpa = m.layout().gpa;
    // INITIALLY_SET bitmaps start (and restart, after a toggle) all set.
    let all_set = mode == LogMode::ClearLog && (k == 1 || toggled);
    let checked = if toggled { stamp + 1 } else { stamp };
    for p in 0..m.layout().total_pages() {
        let v = m.page_value(p).unwrap_or(0);
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
                    gpa + p * PAGE_SIZE,
                    if toggled { " after logging was re-enabled" } else { "" }
                ));
            }
        } else if reported && !written && !all_set {
            it.spurious += 1;
            if report.errors.len() < 16 {
                report.errors.push(format!(
                    "iteration {k}: page {p} (gpa {:#x}) was reported dirty but holds {v} (not written in this iteration)",
                    gpa + p * PAGE_SIZE
                ));
            }
        }
    }
}

/// One harvest of every test slot into `dirty` (bit = page index in the test region).
fn collect<M: TestMachine + ?Sized>(
    m: &M,
    mode: LogMode,
    dirty: &mut [u64],
) -> Result<(), M::Error> {
    let slots = m.test_slots();
    let pps = m.pages_per_slot();
    let first = slots.start;
    let mut set = |slot: u32, offset: u64| {
        // Rings also log slots beside the test region (the VMM's, KVM's low slot): not ours to
        // check.
        if !slots.contains(&slot) || offset >= pps {
            return;
        }
        let p = (slot - first) as u64 * pps + offset;
        dirty[(p / 64) as usize] |= 1 << (p % 64);
    };
    let mut log = m.dirty_log();
    match mode {
        LogMode::DirtyLog | LogMode::ClearLog => {
            let mut buf = vec![0u64; pps.div_ceil(64) as usize];
            for (i, id) in m.test_slots().enumerate() {
                log.get_log(i, &mut buf)?;
                for (w, &bits) in buf.iter().enumerate() {
                    let mut b = bits;
                    while b != 0 {
                        set(id, w as u64 * 64 + b.trailing_zeros() as u64);
                        b &= b - 1;
                    }
                }
                if mode == LogMode::ClearLog {
                    log.clear_log(i, PageIndex::ZERO, pps, &buf)?;
                }
            }
        }
        LogMode::DirtyRing => {
            log.collect_ring(&mut |slot, offset: PageIndex| set(slot, offset.raw()))?;
            log.reset_rings()?;
        }
    }
    Ok(())
}
