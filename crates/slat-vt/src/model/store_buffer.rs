//! A CPU's store buffer (docs/design/virtual-time.md §3, "Stores"): a plain store retires
//! into it and the CPU goes on; the line's transfer completes behind it. A locked
//! instruction, a fence or a lock waits until every buffered store has completed, and a full
//! buffer stalls the next store until its oldest entry has.
//!
//! The buffered stores complete one after another: a store's write to its line starts when
//! the store before it has completed. Real cores overlap a few of those transfers; the model
//! claims none of that parallelism, which no calibrated number measures (`line_transfer` is
//! one transfer alone), so stores issued back to back cost what they cost before the buffer,
//! and only the CPU's other work overlaps them.
//!
//! Pure bookkeeping over virtual times, in ps.

use std::collections::VecDeque;

/// Stores a CPU can have outstanding. The smallest store queue of the cores the profiles
/// describe and this host: AMD Zen 2's 48 entries (Zen 3 and 4 have 64, Intel's server cores
/// 56 to 114; a larger buffer only stalls later, never earlier).
pub(crate) const ENTRIES: usize = 48;

/// The completion times of one CPU's outstanding stores, oldest first.
#[derive(Debug, Default, Clone)]
pub(crate) struct StoreBuffer {
    pending: VecDeque<u64>,
}

impl StoreBuffer {
    /// A store issued at `t`: when the CPU can go on (`t`, or once the oldest entry has
    /// completed if the buffer is full), and when the store's write to its line starts (once
    /// the store before it has completed).
    pub(crate) fn issue(&mut self, t: u64) -> (u64, u64) {
        self.retire(t);
        let mut go = t;
        if self.pending.len() >= ENTRIES {
            go = self.pending.pop_front().map_or(t, |oldest| t.max(oldest));
        }
        let after = self.pending.back().copied().unwrap_or(0);
        (go, go.max(after))
    }

    /// The store whose line write completes at `end` is in the buffer (`end` is no earlier
    /// than the start [`issue`](Self::issue) gave, so the buffer stays in order).
    pub(crate) fn push(&mut self, end: u64) {
        self.pending.push_back(end);
    }

    /// A locked instruction, fence or lock at `t`: when every buffered store has completed
    /// (`t` if none is outstanding then); the buffer is empty after.
    pub(crate) fn drain(&mut self, t: u64) -> u64 {
        let last = self.pending.back().copied().unwrap_or(0);
        self.pending.clear();
        t.max(last)
    }

    /// Forgets the stores completed by `t`.
    fn retire(&mut self, t: u64) {
        while self.pending.front().is_some_and(|&e| e <= t) {
            self.pending.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_does_not_stall_until_a_drain() {
        let mut sb = StoreBuffer::default();
        assert_eq!(sb.issue(100), (100, 100));
        sb.push(130);
        // The CPU goes on; the second store's write waits for the first's.
        assert_eq!(sb.issue(110), (110, 130));
        sb.push(160);
        assert_eq!(sb.drain(115), 160);
        assert_eq!(sb.drain(170), 170, "empty after a drain");
        // A store issued after the last completed starts at once.
        assert_eq!(sb.issue(200), (200, 200));
    }

    #[test]
    fn completed_stores_leave_and_a_full_buffer_stalls() {
        let mut sb = StoreBuffer::default();
        // Stores issued back to back, each a transfer of 1000: they complete one after
        // another, at 1000, 2000, ..., without stalling the CPU.
        for i in 0..ENTRIES as u64 {
            let (go, start) = sb.issue(i);
            assert_eq!((go, start), (i, (i * 1000).max(i)));
            sb.push(start + 1000);
        }
        let last = ENTRIES as u64 * 1000;
        // Full: the next store waits for the oldest (done at 1000) and starts after the last.
        assert_eq!(sb.issue(60), (1000, last));
        sb.push(last + 1000);
        // By then all but the last have completed: room again, behind the last.
        assert_eq!(sb.issue(last + 500), (last + 500, last + 1000));
        sb.push(last + 2000);
        assert_eq!(sb.drain(last + 500), last + 2000);
    }
}
