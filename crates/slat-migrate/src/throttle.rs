//! Auto-converge: slow the vCPUs down when the guest dirties memory faster than the link
//! carries it, so that pre-copy still ends.
//!
//! The policy follows QEMU's: after each round compare the pages the guest dirtied during
//! the round with the pages the round sent; when the guest dirtied more than half as much as
//! was sent in two rounds running, raise the throttle (first to `initial`, then by `step`, at
//! most 99%). The throttle keeps each vCPU out of the guest for that share of every 10 ms
//! slice; it is lifted when the migration ends, whether it succeeded or not.

/// The auto-converge state of one migration attempt.
#[derive(Debug, Clone)]
pub struct AutoConverge {
    enabled: bool,
    initial: u32,
    step: u32,
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
        AutoConverge {
            enabled,
            initial: initial.clamp(1, MAX_THROTTLE),
            step: step.max(1),
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
        if dirtied.saturating_mul(2) > sent {
            self.high += 1;
        } else {
            self.high = 0;
        }
        if self.high < 2 || self.now >= MAX_THROTTLE {
            return None;
        }
        self.high = 0;
        self.now = if self.now == 0 {
            self.initial
        } else {
            (self.now + self.step).min(MAX_THROTTLE)
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
}
