//! Dirty-limit: slow down only the vCPUs that dirty memory faster than a per-vCPU limit, as
//! QEMU's `dirty-limit` migration capability does on the dirty ring — the alternative to
//! auto-converge ([`crate::throttle`]), which takes the same time slice from every vCPU.
//!
//! # Measurement
//!
//! With the dirty ring every entry names the vCPU whose ring held it, so the pages each vCPU
//! dirtied are counted where the source's harvester already reads the rings: [`RingMeter`]
//! wraps the guest's dirty log and counts each entry per vCPU as it passes it on, unchanged,
//! to the harvester. Nothing is consumed on the limiter's behalf that the migration does not
//! get: the counting happens inside the migration's own collect. During a round the source
//! collects every 10 ms (`DirtySet::collect`: the entries go to the pages owed for the next
//! round, as on a ring-full exit, and the rings are reset), so the counts are current and
//! count what the guest really dirties: a page counts once per 10 ms window, not once per
//! period. With one collect per period the count saturated at the guest's size for a guest
//! that sweeps all its memory within a period, and a flat-out guest held "at 8k pages/s"
//! still wrote about 2 M pages/s.
//!
//! # Control law
//!
//! Every period (default [`DEFAULT_PERIOD`], 1 s like QEMU's `x-vcpu-dirty-limit-period`;
//! the first after [`FIRST_PERIOD`], the [`SETTLE_PERIODS`] after it every [`SETTLE_PERIOD`],
//! so the first steps settle within the first rounds), for each vCPU `i`: measure `d_i` = its ring entries over the period / the period. Keep a
//! run share `r_i` (1 = unthrottled; the vCPU sleeps `1 - r_i` of each 10 ms slice). If
//! `d_i` is more than [`DEADBAND`] away from the limit `L`, set
//! `r_i ← clamp(r_i · s, MIN_RUN, 1)` with `s = L / d_i` when the rate is more than 2× off
//! (raising `r_i` by at most 2× per period) and `s = √(L / d_i)` within 2×. Far off, a
//! vCPU's dirty rate grows with its run share at most linearly (pages it dirties twice in a
//! window count once), so the full step lands on or short of the limit. Near the floor it
//! grows faster: each slice's nap overshoots and its exit and entry cost a fixed time, so a
//! share of 0.1% holds a flat-out simulated vCPU at ~4k writes/s and 0.2% at ~14k; full steps
//! there swung 4k ↔ 14k around an 8k limit, and the half step (in logarithm) settles in one
//! or two periods. A vCPU under the limit with `r_i = 1` is never touched. QEMU
//! instead adjusts a sleep per ring-full exit (`throttle_us_per_full`) by a percentage of
//! the gap; the sleep here sits in the vCPU thread between guest entries, which is the same
//! effect without needing a ring-full exit per adjustment.
//!
//! # Where it applies
//!
//! Through [`crate::Guest::set_vcpu_throttle_ppm`]: slat's simulated machine keeps each vCPU
//! out of the guest for that share of every 10 ms slice (`slat_machine::Pacer`), up to
//! [`MAX_PPM`] (99.9%): the lowest rate it can hold a vCPU to is about a thousandth of the
//! vCPU's unthrottled rate (a flat-out simulated vCPU writes ~7.5 M/s and is held at ~4k/s;
//! at the former 99% ceiling that floor was ~75k writes/s, ten times an 8k limit). The
//! throttle is set in parts per million: near the floor one per mille halves or doubles the
//! rate, and on that grid the law swung between ~4k and ~14k around an 8k limit. The KVM benchmark guest runs all vCPUs in one burst and has no
//! per-vCPU throttle (`limitable_vcpus() == 0`), so the source refuses dirty-limit there.

use crate::error::GuestError;
use crate::guest::GuestLog;
use slat_addr::PageIndex;
use slat_dirty::{DirtyLogSource, SlotInfo};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// QEMU's default measurement period.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(1);
/// Shortest period: below it a window holds too few entries to be a rate.
pub const MIN_PERIOD: Duration = Duration::from_millis(100);
/// Longest period.
pub const MAX_PERIOD: Duration = Duration::from_secs(60);
/// The first measurement's window (later ones use the configured period): two of the
/// meter's 10 ms collects. A flat-out guest dirties ~2 M pages/s unthrottled, so the window
/// is what it re-dirties before the limit holds: 100 ms was all of a 512 MiB guest (its
/// second pass another full copy, 1 GiB sent against QEMU's ~600 MiB), 20 ms about a third.
pub const FIRST_PERIOD: Duration = Duration::from_millis(20);
/// The windows after the first, [`SETTLE_PERIODS`] of them (or the period, if shorter): the
/// first step, set from an unthrottled rate a thousand times the limit, lands within a few
/// times of it (near the floor the rate grows faster than the run share), and at the 1 s
/// period the next correction would come after a 512 MiB migration sent with deltas is over.
/// 100 ms of a guest near an 8k limit is ~800 ring entries, a rate to ±15%.
pub const SETTLE_PERIOD: Duration = Duration::from_millis(100);
/// Windows of [`SETTLE_PERIOD`] after the first.
pub const SETTLE_PERIODS: u32 = 5;
/// A step that cuts a run share below this fraction of what it was is followed by a window
/// that only re-bases the meter: the vCPU takes a new throttle at its next 10 ms slice and
/// the meter collects every 10 ms, so the window right after such a step still holds up to
/// ~20 ms of the old rate — after the first step from an unthrottled flat-out guest, 400k
/// pages/s read at a share that holds it near 15k — and stepping on it drove the guest to
/// the floor (2–4k pages/s) for the next window.
pub const REBASE_BELOW: f64 = 0.1;
/// Default limit, dirty pages per second per vCPU: 8000 pages (31 MiB/s). QEMU's usual
/// 1 MB/s (256 pages/s) would stall a benchmark guest for minutes; 8k is a fifth of what
/// the heavy-dirty benchmark's vCPUs dirty and a small share of a loopback link, so a
/// limited guest converges in a few rounds.
pub const DEFAULT_LIMIT: u64 = 8000;
/// Highest limit accepted: a billion pages per second is 4 PB/s, no limit at all.
pub const MAX_LIMIT: u64 = 1_000_000_000;
/// Relative distance from the limit inside which a vCPU's throttle is left alone.
pub const DEADBAND: f64 = 0.05;
/// Highest throttle, parts per million of a vCPU's time kept out of the guest (99.9%).
pub const MAX_PPM: u32 = 999_000;
/// Smallest run share (a [`MAX_PPM`] throttle): a flat-out vCPU writes a thousand times an 8k
/// limit, so the share must reach 0.1% (auto-converge stops at QEMU's 99%).
pub const MIN_RUN: f64 = 1.0 - MAX_PPM as f64 / 1e6;
/// The most vCPUs a limiter tracks (KVM's `KVM_MAX_VCPUS` on x86 is 4096): a ring entry naming
/// a vCPU past it counts as unattributed, so a guest cannot make the limiter grow unbounded.
pub const MAX_LIMITED_VCPUS: usize = 4096;

/// The limit and period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirtyLimitConfig {
    /// Dirty pages per second per vCPU.
    pub limit: u64,
    /// How often each vCPU's rate is measured and its throttle adjusted.
    pub period: Duration,
}

impl Default for DirtyLimitConfig {
    fn default() -> Self {
        DirtyLimitConfig {
            limit: DEFAULT_LIMIT,
            period: DEFAULT_PERIOD,
        }
    }
}

/// A dirty-limit setting refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirtyLimitError {
    /// A limit of 0 or above [`MAX_LIMIT`].
    #[error("a dirty limit of {0} pages/s per vCPU: it must be 1 to {MAX_LIMIT}")]
    Limit(u64),
    /// A period outside [`MIN_PERIOD`]`..=`[`MAX_PERIOD`].
    #[error(
        "a dirty-limit period of {} ms: it must be {} to {} ms",
        .0.as_millis(),
        MIN_PERIOD.as_millis(),
        MAX_PERIOD.as_millis()
    )]
    Period(Duration),
}

impl DirtyLimitConfig {
    /// Checks the limit and period.
    pub fn check(&self) -> Result<(), DirtyLimitError> {
        if self.limit == 0 || self.limit > MAX_LIMIT {
            return Err(DirtyLimitError::Limit(self.limit));
        }
        if self.period < MIN_PERIOD || self.period > MAX_PERIOD {
            return Err(DirtyLimitError::Period(self.period));
        }
        Ok(())
    }
}

/// Ring entries per vCPU since the meter was made (index: vCPU), and entries no vCPU could be
/// credited with.
#[derive(Debug, Default)]
pub struct RingCounts {
    inner: Mutex<(Vec<u64>, u64)>,
}

impl RingCounts {
    /// The per-vCPU counts now.
    pub fn per_vcpu(&self) -> Vec<u64> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }
    /// Entries without a vCPU.
    pub fn unattributed(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

/// The guest's dirty log with every ring entry counted for the vCPU that logged it on its
/// way to the harvester (which still gets every entry).
pub struct RingMeter {
    inner: GuestLog,
    counts: Arc<RingCounts>,
}

impl RingMeter {
    /// Wraps `inner`, counting into `counts`.
    pub fn new(inner: GuestLog, counts: Arc<RingCounts>) -> RingMeter {
        RingMeter { inner, counts }
    }
}

impl DirtyLogSource for RingMeter {
    type Error = GuestError;

    fn slots(&self) -> Vec<SlotInfo> {
        self.inner.slots()
    }
    fn mode(&self) -> slat_dirty::LogMode {
        self.inner.mode()
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), GuestError> {
        self.inner.get_log(slot, bitmap)
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), GuestError> {
        self.inner.clear_log(slot, first, pages, bitmap)
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, GuestError> {
        self.collect_ring_by_vcpu(&mut |_, s, o| f(s, o))
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, GuestError> {
        let mut c = self.counts.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (per, none) = &mut *c;
        self.inner.collect_ring_by_vcpu(&mut |v, s, o| {
            match v {
                // An index no guest of this crate can have (a source's bug) is not trusted
                // with an allocation: its entry counts without a vCPU.
                Some(i) if i >= MAX_LIMITED_VCPUS => *none += 1,
                Some(i) => {
                    if per.len() <= i {
                        per.resize(i + 1, 0);
                    }
                    per[i] += 1;
                }
                None => *none += 1,
            }
            f(v, s, o)
        })
    }
    fn reset_rings(&mut self) -> Result<u64, GuestError> {
        self.inner.reset_rings()
    }
}

/// The per-vCPU controller ([module docs](self)).
#[derive(Debug, Clone)]
pub struct DirtyLimiter {
    cfg: DirtyLimitConfig,
    last: Instant,
    last_counts: Vec<u64>,
    run: Vec<f64>,
    /// Each vCPU's dirty rate over the last period, pages per second.
    pub rates: Vec<f64>,
    /// Periods measured.
    pub periods: u32,
    /// Highest throttle each vCPU reached, per mille.
    pub max_permille: Vec<u32>,
    /// The next window only re-bases the meter ([`REBASE_BELOW`]).
    rebase: bool,
}

impl DirtyLimiter {
    /// A limiter for `vcpus` vCPUs (at most [`MAX_LIMITED_VCPUS`]: vCPUs past it are never
    /// limited), all unthrottled, whose first period starts at `now` with the ring counts
    /// `counts`.
    pub fn new(cfg: DirtyLimitConfig, vcpus: usize, counts: &[u64], now: Instant) -> Self {
        let vcpus = vcpus.min(MAX_LIMITED_VCPUS);
        let mut last_counts = counts.iter().copied().take(vcpus).collect::<Vec<_>>();
        last_counts.resize(vcpus, 0);
        DirtyLimiter {
            cfg,
            last: now,
            last_counts,
            run: vec![1.0; vcpus],
            rates: vec![0.0; vcpus],
            periods: 0,
            max_permille: vec![0; vcpus],
            rebase: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> DirtyLimitConfig {
        self.cfg
    }

    /// A period has passed since the last update. The first measurement comes after
    /// [`FIRST_PERIOD`] (or the period, if shorter): the meter collects every 10 ms, so a
    /// short window is already a rate, and a guest left unthrottled for a whole first period
    /// re-dirties all its memory while a 512 MiB migration is nearly over. The next
    /// [`SETTLE_PERIODS`] come after [`SETTLE_PERIOD`] each, so the law's first steps settle
    /// while the rounds run.
    pub fn due(&self, now: Instant) -> bool {
        let period = match self.periods {
            0 => self.cfg.period.min(FIRST_PERIOD),
            n if n <= SETTLE_PERIODS => self.cfg.period.min(SETTLE_PERIOD),
            _ => self.cfg.period,
        };
        now.duration_since(self.last) >= period
    }

    /// Each vCPU's throttle now, per mille of its time kept out of the guest (for reports).
    pub fn throttles(&self) -> Vec<u32> {
        self.run.iter().map(|&r| permille(r)).collect()
    }

    /// Each vCPU's throttle now, parts per million (what the guest is told).
    pub fn throttles_ppm(&self) -> Vec<u32> {
        self.run.iter().map(|&r| ppm(r)).collect()
    }

    /// If a period has passed: measures each vCPU's rate from the cumulative ring `counts`
    /// and applies the control law; returns the new throttles (parts per million), else
    /// `None`.
    pub fn update(&mut self, counts: &[u64], now: Instant) -> Option<Vec<u32>> {
        if !self.due(now) {
            return None;
        }
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.periods = self.periods.saturating_add(1);
        let limit = self.cfg.limit as f64;
        let rebase = std::mem::take(&mut self.rebase);
        for i in 0..self.run.len() {
            let c = counts.get(i).copied().unwrap_or(0);
            let d = c.saturating_sub(self.last_counts[i]) as f64 / dt;
            self.last_counts[i] = c;
            self.rates[i] = d;
            let r = self.run[i];
            if rebase {
                continue;
            }
            let over = d > limit * (1.0 + DEADBAND);
            let under = d < limit * (1.0 - DEADBAND) && r < 1.0;
            if over || under {
                // d == 0 with r < 1: the vCPU idled; open up by the largest step.
                let ratio = if d > 0.0 { limit / d } else { 2.0 };
                let step = if (0.5..=2.0).contains(&ratio) {
                    ratio.sqrt()
                } else {
                    ratio.min(2.0)
                };
                self.run[i] = (r * step).clamp(MIN_RUN, 1.0);
                self.rebase |= step < REBASE_BELOW;
            }
            self.max_permille[i] = self.max_permille[i].max(permille(self.run[i]));
        }
        Some(self.throttles_ppm())
    }
}

/// A run share as a throttle, per mille.
fn permille(run: f64) -> u32 {
    ((1.0 - run) * 1000.0)
        .round()
        .clamp(0.0, (MAX_PPM / 1000) as f64) as u32
}

/// A run share as a throttle, parts per million.
fn ppm(run: f64) -> u32 {
    ((1.0 - run) * 1e6).round().clamp(0.0, MAX_PPM as f64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vCPU whose dirty rate is its run share times `full` (capped at `cap` distinct pages).
    fn model(full: f64, cap: f64, ppm: u32) -> f64 {
        (full * (1_000_000 - ppm) as f64 / 1e6).min(cap)
    }

    #[test]
    fn converges_on_the_limit_and_leaves_a_slow_vcpu_alone() {
        let cfg = DirtyLimitConfig {
            limit: 1000,
            period: Duration::from_secs(1),
        };
        let t0 = Instant::now();
        let mut l = DirtyLimiter::new(cfg, 2, &[0, 0], t0);
        let mut counts = [0u64; 2];
        let mut th = vec![0, 0];
        for k in 1..=8u64 {
            counts[0] += model(10_000.0, 1e9, th[0]) as u64;
            counts[1] += model(500.0, 1e9, th[1]) as u64;
            th = l.update(&counts, t0 + Duration::from_secs(k)).unwrap();
        }
        let last = model(10_000.0, 1e9, th[0]);
        assert!((750.0..=1250.0).contains(&last), "{last} {th:?}");
        assert_eq!(th[1], 0);
        assert!(l
            .update(&counts, t0 + Duration::from_millis(8500))
            .is_none());
    }

    #[test]
    fn the_window_after_a_deep_cut_only_rebases() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut l = DirtyLimiter::new(DirtyLimitConfig::default(), 1, &[0], t0);
        // 20 ms unthrottled at 3 M pages/s: a deep cut.
        l.update(&[60_000], t0 + ms(20)).unwrap();
        let cut = l.throttles_ppm()[0];
        assert!(cut > 990_000, "{cut}");
        // The next 100 ms still hold ~15 ms of the old rate: read, not acted on.
        l.update(&[60_000 + 46_000], t0 + ms(120)).unwrap();
        assert_eq!(l.throttles_ppm()[0], cut);
        assert!(l.rates[0] > 400_000.0);
        // Then a clean window at twice the limit: a step, and no re-base after it.
        l.update(&[106_000 + 1_600], t0 + ms(220)).unwrap();
        assert!(l.throttles_ppm()[0] > cut);
        assert!(!l.rebase);
    }

    #[test]
    fn opens_up_when_the_guest_slows_down() {
        let cfg = DirtyLimitConfig::default();
        let t0 = Instant::now();
        let mut l = DirtyLimiter::new(cfg, 1, &[0], t0);
        l.update(&[80_000], t0 + Duration::from_secs(1));
        assert!(l.throttles()[0] > 800);
        let mut c = 80_000;
        for k in 2..12u64 {
            c += 100;
            l.update(&[c], t0 + Duration::from_secs(k));
        }
        assert_eq!(l.throttles()[0], 0);
        assert!(l.max_permille[0] > 800);
    }

    #[test]
    fn refuses_bad_settings() {
        let ok = DirtyLimitConfig::default();
        assert!(ok.check().is_ok());
        for bad in [
            DirtyLimitConfig { limit: 0, ..ok },
            DirtyLimitConfig {
                limit: MAX_LIMIT + 1,
                ..ok
            },
            DirtyLimitConfig {
                period: Duration::from_millis(10),
                ..ok
            },
        ] {
            assert!(bad.check().is_err());
        }
    }
}
