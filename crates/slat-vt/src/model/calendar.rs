//! The recent busy intervals of a line or a lock, in virtual time.
//!
//! CPUs run in virtual-time order only up to the lookahead, so a request can arrive, in real
//! order, after requests that are later in virtual time. Keeping the last few busy intervals
//! lets such a request take the gap it would have found in virtual time instead of queueing
//! behind the latest interval (which would move its clock forward by up to the lookahead) or
//! ignoring the intervals it overlaps (which would lose contention).

/// Intervals kept per line or lock.
const KEPT: usize = 8;

/// Up to [`KEPT`] busy intervals `[from, to)`, sorted by `from`, each with whether it excludes
/// everyone (a write) or only writers (readers of a lock).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Calendar {
    busy: [(u64, u64, bool); KEPT],
    len: u8,
}

impl Calendar {
    fn intervals(&self) -> &[(u64, u64, bool)] {
        &self.busy[..usize::from(self.len).min(KEPT)]
    }

    /// The earliest `start >= t` such that `[start, start + len)` (a point for `len` 0)
    /// overlaps no interval that conflicts (`exclusive`: every interval; else only the
    /// exclusive ones). A request that had to wait starts `gap` after the last conflicting
    /// interval it waited for ends (a hand-off). One pass over the intervals sorted by start
    /// suffices: the waiting point only grows, and once it is before an interval it is before
    /// every later one.
    pub(crate) fn fit(&self, t: u64, len: u64, exclusive: bool, gap: u64) -> u64 {
        let mut p = t;
        let mut waited = false;
        for &(from, to, excl) in self.intervals() {
            if (exclusive || excl) && from < p.saturating_add(len.max(1)) && to > p {
                p = to;
                waited = true;
            }
        }
        if waited {
            p.saturating_add(gap)
        } else {
            t
        }
    }

    /// Records the busy interval `[from, to)` (empty ones are not kept); the earliest goes
    /// when the calendar is full.
    pub(crate) fn insert(&mut self, from: u64, to: u64, exclusive: bool) {
        if to <= from {
            return;
        }
        let mut n = usize::from(self.len).min(KEPT);
        let mut at = self.busy[..n].partition_point(|w| w.0 <= from);
        if n == KEPT {
            if at == 0 {
                return; // earlier than everything kept: it would be the one to go
            }
            self.busy.copy_within(1..n, 0);
            n -= 1;
            at -= 1;
        }
        self.busy.copy_within(at..n, at + 1);
        self.busy[at] = (from, to, exclusive);
        self.len = (n + 1) as u8;
    }

    /// The end of the latest interval (0 if none).
    pub(crate) fn last_end(&self) -> u64 {
        self.intervals().iter().map(|w| w.1).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_in_gaps_and_after_conflicts() {
        let mut c = Calendar::default();
        c.insert(100, 110, true);
        c.insert(200, 210, true);
        assert_eq!(c.fit(50, 10, true, 0), 50); // before both
        assert_eq!(c.fit(95, 10, true, 0), 110); // overlaps the first
        assert_eq!(c.fit(105, 100, true, 0), 210); // does not fit the gap
        assert_eq!(c.fit(105, 0, true, 5), 115); // a point inside: after it plus the gap
        c.insert(300, 310, false);
        assert_eq!(c.fit(305, 0, false, 5), 305); // readers do not conflict
        assert_eq!(c.fit(305, 0, true, 5), 315);
        assert_eq!(c.last_end(), 310);
    }

    #[test]
    fn keeps_the_latest_intervals() {
        let mut c = Calendar::default();
        for i in 0..20u64 {
            c.insert(i * 10, i * 10 + 5, true);
        }
        assert_eq!(c.fit(2, 1, true, 0), 2); // forgotten
        assert_eq!(c.fit(192, 1, true, 0), 195);
        c.insert(7, 7, true); // empty: ignored
        assert_eq!(c.intervals().len(), KEPT);
    }
}
