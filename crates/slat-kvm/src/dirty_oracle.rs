//! The dirty-log oracle on KVM (KVM's `dirty_log_test`, for several vCPUs): guest writers
//! stamp pseudo-random pages with the current iteration number while the host harvests the log
//! in the middle of the iteration and again after stopping the vCPUs; then every page of the
//! test region is checked against what the harvests reported:
//!
//! - a page holding this iteration's number was written in this iteration, so it must have
//!   been reported (otherwise a dirty page was *lost*);
//! - a page reported dirty must hold this iteration's number (otherwise the report was
//!   *spurious*), except in the first iteration of `clear-log`, whose bitmap starts all set.
//!
//! The vCPUs have synced (left `KVM_RUN`) before the final harvest and the check, so the checked
//! memory is stable and every write they made has been logged. Values only grow, and iteration
//! `k` starts after iteration `k - 1` was fully harvested, so "holds `k`" is exactly "written
//! since the last check". The same checks as `slat_machine::dirty_oracle`, on real KVM.

use crate::error::KvmError;
use crate::machine::{DirtyConfig, KvmMachine, Workload, FIRST_SLOT, INITIALLY_SET};
use crate::machine::{PassReport, MANUAL_PROTECT_ENABLE};
use crate::mem::PAGE_SIZE;
use crate::memstress::ParkMiller;
use std::time::{Duration, Instant};

/// How the log is harvested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogMode {
    /// `KVM_GET_DIRTY_LOG` clears and re-protects.
    DirtyLog,
    /// Manual protect with INITIALLY_SET: GET copies, `KVM_CLEAR_DIRTY_LOG` clears and
    /// re-protects.
    ClearLog,
    /// Per-vCPU dirty rings: collect, then `KVM_RESET_DIRTY_RINGS`.
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
}

/// A whole run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OracleReport {
    /// Per iteration.
    pub iterations: Vec<IterationReport>,
    /// Up to 16 readable descriptions of the first mismatches.
    pub errors: Vec<String>,
    /// `KVM_EXIT_DIRTY_RING_FULL` exits taken by the vCPUs.
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

/// Runs the oracle on `m`, which must have been built with `cfg.mode.dirty_config(..)`; calls
/// `progress` after each iteration. Dirty logging is on for the run and off after it.
pub fn run(
    m: &KvmMachine,
    cfg: OracleConfig,
    mut progress: impl FnMut(&IterationReport),
) -> Result<OracleReport, KvmError> {
    if cfg.iterations == 0 {
        return Err(KvmError::Config("at least one iteration is needed".into()));
    }
    let d = m.config().dirty;
    let fits = match cfg.mode {
        LogMode::DirtyLog => d.ring_entries == 0 && d.manual_protect == 0,
        LogMode::ClearLog => {
            d.ring_entries == 0 && d.manual_protect == MANUAL_PROTECT_ENABLE | INITIALLY_SET
        }
        LogMode::DirtyRing => d.ring_entries != 0,
    };
    if !fits {
        return Err(KvmError::Config(format!(
            "the machine's dirty configuration {d:?} does not match mode {}",
            cfg.mode.name()
        )));
    }
    let layout = m.layout();
    let total = layout.total_pages();
    let pps = m.pages_per_slot();
    let mut dirty = vec![0u64; total.div_ceil(64) as usize];
    let mut buf = vec![0u64; pps.div_ceil(64) as usize];
    let mut report = OracleReport::default();
    let mut rng = ParkMiller::new(cfg.seed ^ 0x5eed);
    m.set_dirty_logging(true)?;
    let result = (|| {
        for k in 1..=cfg.iterations {
            let t0 = Instant::now();
            m.start(Workload::Writer {
                seed: cfg.seed,
                iteration: k as u64,
            })?;
            // Harvest once at a random point in the middle of the iteration, writers running.
            let interval_us = cfg.interval.as_micros().clamp(1, u64::MAX as u128) as u64;
            let reap = Duration::from_micros(rng.next_u32() as u64 % interval_us);
            std::thread::sleep(reap.saturating_sub(t0.elapsed()));
            let mid = collect(m, cfg.mode, pps, &mut dirty, &mut buf);
            std::thread::sleep(cfg.interval.saturating_sub(t0.elapsed()));
            let run: PassReport = m.halt()?;
            mid?;
            collect(m, cfg.mode, pps, &mut dirty, &mut buf)?;
            let mut it = IterationReport {
                iteration: k,
                writes: run.vcpus.iter().map(|v| v.pages).sum(),
                ..IterationReport::default()
            };
            report.ring_full_exits += run.vcpus.iter().map(|v| v.ring_full_exits).sum::<u64>();
            let initially_all_set = cfg.mode == LogMode::ClearLog && k == 1;
            for p in 0..total {
                let v = m.page_value(p).unwrap_or(0);
                let reported = dirty[(p / 64) as usize] & (1 << (p % 64)) != 0;
                if reported {
                    it.dirty += 1;
                } else {
                    it.clean += 1;
                }
                let written = v == k as u64;
                if written && !reported {
                    it.lost += 1;
                    if report.errors.len() < 16 {
                        report.errors.push(format!(
                            "iteration {k}: page {p} (gpa {:#x}) was written in this iteration \
                             but not reported dirty",
                            layout.gpa + p * PAGE_SIZE
                        ));
                    }
                } else if reported && !written && !initially_all_set {
                    it.spurious += 1;
                    if report.errors.len() < 16 {
                        report.errors.push(format!(
                            "iteration {k}: page {p} (gpa {:#x}) was reported dirty but holds \
                             {v} (not written in this iteration)",
                            layout.gpa + p * PAGE_SIZE
                        ));
                    }
                }
            }
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

/// One harvest of every test slot into `dirty` (bit = page index in the test region).
fn collect(
    m: &KvmMachine,
    mode: LogMode,
    pps: u64,
    dirty: &mut [u64],
    buf: &mut [u64],
) -> Result<(), KvmError> {
    let nslots = m.config().slots as u32;
    let mut set = |slot: u32, offset: u64| {
        // Only address space 0 and the test slots are ours to check.
        if !(FIRST_SLOT..FIRST_SLOT + nslots).contains(&slot) || offset >= pps {
            return;
        }
        let p = (slot - FIRST_SLOT) as u64 * pps + offset;
        dirty[(p / 64) as usize] |= 1 << (p % 64);
    };
    match mode {
        LogMode::DirtyLog | LogMode::ClearLog => {
            for id in m.slot_ids() {
                m.get_dirty_log(id, buf)?;
                for (w, &bits) in buf.iter().enumerate() {
                    let mut b = bits;
                    while b != 0 {
                        set(id, w as u64 * 64 + b.trailing_zeros() as u64);
                        b &= b - 1;
                    }
                }
                if mode == LogMode::ClearLog {
                    m.clear_dirty_log(id, 0, pps, buf)?;
                }
            }
        }
        LogMode::DirtyRing => {
            m.collect_dirty_rings(&mut set);
            m.reset_dirty_rings()?;
        }
    }
    Ok(())
}
