//! Which pool frames a guest holds as private memory (the software analogue of SNP's RMP
//! "assigned" state): two bits per frame.
//!
//! `claimed` is set by the one CPU that wins the right to accept a frame (so two vCPUs
//! faulting the same private page never both remove it from the direct map); `assigned` is
//! set once the frame is out of the direct map and may be mapped into the guest. A frame
//! that is claimed but not yet assigned is *in flight*: faults retry, and a release waits.

use crate::clock::{addr_of, Clock};
use crate::sync;
use crate::sync::{AtomicU64, Ordering};

/// Per-frame claim and assignment bits.
#[derive(Debug)]
pub(crate) struct FrameStates {
    claimed: Box<[AtomicU64]>,
    assigned: Box<[AtomicU64]>,
}

fn words(frames: u64) -> Box<[AtomicU64]> {
    (0..frames.div_ceil(64))
        .map(|_| AtomicU64::new(0))
        .collect()
}

#[inline]
fn bit(f: u64) -> (usize, u64) {
    ((f / 64) as usize, 1 << (f % 64))
}

impl FrameStates {
    /// `frames` frames, none claimed.
    pub(crate) fn new(frames: u64) -> Self {
        FrameStates {
            claimed: words(frames),
            assigned: words(frames),
        }
    }

    /// The frame is out of the direct map and the guest's. `Acquire`: pairs with
    /// [`Self::assign`], so whoever sees the bit sees the removal.
    #[inline]
    pub(crate) fn is_assigned<C: Clock>(&self, f: u64) -> bool {
        let (w, m) = bit(f);
        sync::load::<C, _>(&self.assigned[w], Ordering::Acquire) & m != 0
    }

    /// Someone claimed the frame (it is assigned, or being accepted).
    #[inline]
    pub(crate) fn is_claimed<C: Clock>(&self, f: u64) -> bool {
        let (w, m) = bit(f);
        sync::load::<C, _>(&self.claimed[w], Ordering::Acquire) & m != 0
    }

    /// The words whose writes change `f`'s state (for a clock's wait on it).
    pub(crate) fn watch(&self, f: u64) -> [usize; 2] {
        let (w, _) = bit(f);
        [addr_of(&self.claimed[w]), addr_of(&self.assigned[w])]
    }

    /// Takes the right to accept `f`; false if another CPU has it.
    pub(crate) fn claim<C: Clock>(&self, f: u64) -> bool {
        let (w, m) = bit(f);
        sync::fetch_or::<C, _>(&self.claimed[w], m, Ordering::AcqRel) & m == 0
    }

    /// The claimer finished removing `f` from the direct map. `Release`: the removal (and the
    /// cleared page) happen-before any fault that then maps the frame.
    pub(crate) fn assign<C: Clock>(&self, f: u64) {
        let (w, m) = bit(f);
        sync::fetch_or::<C, _>(&self.assigned[w], m, Ordering::Release);
    }

    /// `f` is back in the direct map: neither assigned nor claimed.
    pub(crate) fn unassign<C: Clock>(&self, f: u64) {
        let (w, m) = bit(f);
        sync::fetch_and::<C, _>(&self.assigned[w], !m, Ordering::Release);
        sync::fetch_and::<C, _>(&self.claimed[w], !m, Ordering::Release);
    }

    /// No frame of `[first, first + n)` is claimed (`first` and `n` multiples of 64).
    pub(crate) fn none_claimed(&self, first: u64, n: u64) -> bool {
        debug_assert!(first % 64 == 0 && n % 64 == 0);
        let (lo, hi) = ((first / 64) as usize, ((first + n) / 64) as usize);
        self.claimed[lo..hi]
            .iter()
            .all(|w| w.load(Ordering::Acquire) == 0)
    }

    /// Frames assigned now (a snapshot; for statistics and tests).
    pub(crate) fn count_assigned(&self) -> u64 {
        self.assigned
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_claim_wins_and_release_clears_both_bits() {
        let s = FrameStates::new(130);
        assert!(s.claim::<crate::clock::RealTime>(129));
        assert!(
            !s.claim::<crate::clock::RealTime>(129),
            "a second claim loses"
        );
        assert!(
            s.is_claimed::<crate::clock::RealTime>(129)
                && !s.is_assigned::<crate::clock::RealTime>(129)
        );
        s.assign::<crate::clock::RealTime>(129);
        assert!(s.is_assigned::<crate::clock::RealTime>(129));
        assert_eq!(s.count_assigned(), 1);
        assert!(!s.none_claimed(128, 64));
        s.unassign::<crate::clock::RealTime>(129);
        assert!(
            !s.is_claimed::<crate::clock::RealTime>(129)
                && !s.is_assigned::<crate::clock::RealTime>(129)
        );
        assert!(s.none_claimed(128, 64));
        assert!(s.claim::<crate::clock::RealTime>(129), "free again");
    }
}
