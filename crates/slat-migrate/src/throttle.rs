//! Auto-converge: slow the vCPUs down when the guest dirties memory faster than the link
//! carries it, so that pre-copy still ends.
//!
//! The policy is QEMU's (`migration_trigger_throttle` and `mig_throttle_guest_down`): after
//! each round compare the pages the guest dirtied during the round with the pages the round
//! sent; each time the guest dirtied more than half as much as was sent, a counter goes up,
//! and when it reaches two the throttle rises (first to `initial`, then by `increment`, at
//! most [`MAX_THROTTLE`]%) and the counter starts again. QEMU does not reset the counter on a
//! cool round, and neither does this. With `tailslow` (QEMU's `cpu-throttle-tailslow`) a
//! later step is only what the measured rates ask for: the run share that would bring the
//! dirtied pages down to the threshold, `run · threshold / dirtied`, at most `increment`, so
//! the tail of the schedule does not overshoot into a guest that barely runs. The throttle
//! keeps each vCPU out of the guest for that share of every 10 ms slice; it is lifted when
//! the migration ends, whether it succeeded or not.

/// QEMU's auto-converge schedule (`cpu-throttle-initial`, `cpu-throttle-increment`,
/// `cpu-throttle-tailslow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// First throttle, percent (1-99).
    pub initial: u32,
    /// Each later step, percent (at least 1).
    pub increment: u32,
    /// Later steps only as large as the measured dirty rate asks for.
    pub tailslow: bool,
}

impl Default for Schedule {
    /// QEMU's defaults: 20%, then +10%, tailslow off.
    fn default() -> Self {
        Schedule {
            initial: 20,
            increment: 10,
            tailslow: false,
        }
    }
}

/// The auto-converge state of one migration attempt.
#[derive(Debug, Clone)]
pub struct AutoConverge {
    enabled: bool,
    sched: Schedule,
    high: u32,
    now: u32,
    /// (round, throttle percent) at each change.
    pub changes: Vec<(u32, u32)>,
}

/// Highest throttle (a guest that never runs makes no progress at all).
pub const MAX_THROTTLE: u32 = 99;

impl AutoConverge {
    /// A policy starting at `initial`% and stepping by `step`%; off when `enabled` is false.
    pub fn new(enabled: bool, initial: u32, step: u32) -> AutoConverge {
        AutoConverge::with_schedule(
            enabled,
            Schedule {
                initial,
                increment: step,
                tailslow: false,
            },
        )
    }

    /// A policy following `sched` (its values clamped to 1-99%); off when `enabled` is false.
    pub fn with_schedule(enabled: bool, sched: Schedule) -> AutoConverge {
        AutoConverge {
            enabled,
            sched: Schedule {
                initial: sched.initial.clamp(1, MAX_THROTTLE),
                increment: sched.increment.clamp(1, MAX_THROTTLE),
                tailslow: sched.tailslow,
            },
            high: 0,
            now: 0,
            changes: Vec::new(),
        }
    }

    /// The throttle now.
    pub fn percent(&self) -> u32 {
        self.now
    }

    /// The highest throttle reached.
    pub fn max(&self) -> u32 {
        self.changes.iter().map(|c| c.1).max().unwrap_or(0)
    }

    /// After round `round`, which sent `sent` pages while the guest dirtied `dirtied`: the new
    /// throttle if it changes.
    pub fn after_round(&mut self, round: u32, dirtied: u64, sent: u64) -> Option<u32> {
        if !self.enabled {
            return None;
        }
        // QEMU's throttle-trigger-threshold: half of what the period sent.
        let threshold = sent / 2;
        if dirtied > threshold {
            self.high += 1;
        }
        if self.high < 2 || self.now >= MAX_THROTTLE {
            return None;
        }
        self.high = 0;
        let step = if self.sched.tailslow {
            // The run share that would dirty `threshold` pages, if dirtying scales with it.
            let run = (100 - self.now) as f64;
            let ideal = run * threshold as f64 / dirtied.max(1) as f64;
            ((run - ideal).ceil() as u32).clamp(1, self.sched.increment)
        } else {
            self.sched.increment
        };
        self.now = if self.now == 0 {
            self.sched.initial
        } else {
            (self.now + step).min(MAX_THROTTLE)
        };
        self.changes.push((round, self.now));
        Some(self.now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raises_after_two_hot_rounds_and_stops_at_99() {
        let mut a = AutoConverge::new(true, 20, 30);
        assert_eq!(a.after_round(1, 100, 100), None);
        assert_eq!(a.after_round(2, 100, 100), Some(20));
        assert_eq!(a.after_round(3, 10, 100), None);
        assert_eq!(a.after_round(4, 100, 100), None);
        assert_eq!(a.after_round(5, 100, 100), Some(50));
        a.after_round(6, 100, 100);
        assert_eq!(a.after_round(7, 100, 100), Some(80));
        a.after_round(8, 100, 100);
        assert_eq!(a.after_round(9, 100, 100), Some(99));
        a.after_round(10, 100, 100);
        assert_eq!(a.after_round(11, 100, 100), None);
        assert_eq!(a.max(), 99);
        let mut off = AutoConverge::new(false, 20, 10);
        assert_eq!(off.after_round(1, 100, 1), None);
        assert_eq!(off.after_round(2, 100, 1), None);
    }

    #[test]
    fn a_cool_round_does_not_reset_the_count_as_in_qemu() {
        let mut a = AutoConverge::new(true, 30, 10);
        assert_eq!(a.after_round(1, 100, 100), None);
        assert_eq!(a.after_round(2, 1, 100), None);
        assert_eq!(a.after_round(3, 100, 100), Some(30));
    }

    #[test]
    fn tailslow_steps_only_as_far_as_the_rates_ask() {
        let sched = Schedule {
            initial: 20,
            increment: 10,
            tailslow: true,
        };
        let mut a = AutoConverge::with_schedule(true, sched);
        a.after_round(1, 200, 100);
        assert_eq!(a.after_round(2, 200, 100), Some(20));
        // Dirtied 60 against a threshold of 50: the run share 80% should become 66.7%, a
        // step of 14 capped at the increment, 10.
        a.after_round(3, 60, 100);
        assert_eq!(a.after_round(4, 60, 100), Some(30));
        // Dirtied 52: 70% · 50 / 52 = 67.3%, a step of 3 (rounded up).
        a.after_round(5, 52, 100);
        assert_eq!(a.after_round(6, 52, 100), Some(33));
        let mut plain = AutoConverge::with_schedule(
            true,
            Schedule {
                tailslow: false,
                ..sched
            },
        );
        for r in 1..=6 {
            plain.after_round(r, [200, 200, 60, 60, 52, 52][r as usize - 1], 100);
        }
        assert_eq!(plain.percent(), 40);
    }
}
