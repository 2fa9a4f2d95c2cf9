//! The recent busy intervals of a line or a lock, in virtual time.
//!
//! CPUs run in virtual-time order only up to the lookahead, so a request can arrive, in real
//! order, after requests that are later in virtual time. Keeping the busy intervals lets such a
//! request take the gap it would have found in virtual time instead of queueing behind the
//! latest interval (which would move its clock forward by up to the lookahead) or ignoring the
//! intervals it overlaps (which would lose contention).
//!
//! Which intervals to keep: every one that a future request could still overlap. No CPU's
//! clock goes back, so nothing can arrive before the lowest clock of every CPU in the
//! simulation (the scheduler's *floor*, [`Calendar::insert`]'s `floor`): intervals that ended
//! by then are dropped, and only those. A fixed number of kept intervals is not enough: with
//! 64 CPUs, one CPU's run within the lookahead makes dozens of intervals on a hot lock word,
//! and a bound of eight lost the earlier ones, so the next CPU's requests found the line free
//! in virtual time where it had been saturated. Touching intervals of the same kind merge, so
//! a saturated line keeps one interval however many requests it serialised.

/// Intervals kept without a heap allocation (most lines are written once or twice).
const INLINE: usize = 4;

/// The most intervals kept: a defence against a floor held back (a CPU outside the simulation
/// for long); beyond it the earliest goes, and is counted ([`Calendar::insert`]'s result).
pub(crate) const MAX_KEPT: usize = 4096;

/// `[from, to)` and whether it excludes everyone (a write) or only writers (readers of a lock).
type Interval = (u64, u64, bool);

/// The kept busy intervals, sorted by `from`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Calendar {
    inline: [Interval; INLINE],
    /// Intervals in `inline` while `spill` is empty.
    len: u8,
    /// All the intervals, once more than [`INLINE`] were kept at once: `spill[head..]`.
    spill: Vec<Interval>,
    /// How many intervals at the front of `spill` have been dropped but not yet removed:
    /// removing them at once moved a hot line's whole calendar on every insert (the floor
    /// rises a little each time), which was a quarter of a 128-vCPU simulation's time.
    head: usize,
    /// A shared (reader) interval was inserted: intervals may overlap. While false, they are
    /// disjoint, so sorted by end as well as by start, and a hot line's calendar is searched
    /// by a doubling search from its end ([`from_back`]) instead of scanned.
    mixed: bool,
}

impl Calendar {
    fn intervals(&self) -> &[Interval] {
        if self.spill.is_empty() {
            &self.inline[..usize::from(self.len).min(INLINE)]
        } else {
            &self.spill[self.head.min(self.spill.len())..]
        }
    }

    /// Removes the dropped intervals from the front of `spill` once they are at least half of
    /// it, so each is moved a bounded number of times on average.
    fn compact(&mut self, force: bool) {
        let head = self.head.min(self.spill.len());
        if head > 0 && (force || head * 2 >= self.spill.len()) {
            self.spill.drain(..head);
            self.head = 0;
        }
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
        let all = self.intervals();
        // Disjoint: the intervals that end by `t` cannot conflict, and they are a prefix.
        let first = if self.mixed {
            0
        } else {
            from_back(all, |w| w.1 <= t)
        };
        for &(from, to, excl) in &all[first..] {
            if !self.mixed && from >= p.saturating_add(len.max(1)) {
                break; // every later interval starts later still
            }
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

    /// Records the busy interval `[from, to)` (empty ones are not kept), merged with the
    /// intervals of its kind it touches, after dropping those that ended by `floor` (the
    /// lowest clock any CPU can still request at). Returns how many intervals that could still
    /// matter were dropped to stay within [`MAX_KEPT`] (0 but for a floor held back).
    pub(crate) fn insert(&mut self, from: u64, to: u64, exclusive: bool, floor: u64) -> u64 {
        if to <= from {
            return 0;
        }
        let new = (from, to, exclusive);
        if self.spill.is_empty() {
            self.mixed |= !exclusive;
            // Inline: worked on a stack copy with room for one more, spilled only if it grows.
            let n = usize::from(self.len).min(INLINE);
            let mut buf = [(0, 0, false); INLINE + 1];
            buf[..n].copy_from_slice(&self.inline[..n]);
            let m = merge_in(&mut buf, n, new, floor);
            if m <= INLINE {
                self.inline[..m].copy_from_slice(&buf[..m]);
                self.len = m as u8;
            } else {
                self.len = 0;
                self.spill = buf[..m].to_vec();
            }
            return 0;
        }
        self.mixed |= !exclusive;
        if !self.mixed {
            return self.insert_disjoint(new, floor);
        }
        self.compact(true);
        let n = self.spill.len();
        self.spill.push(new); // room for the merge to insert into
        let m = merge_in(&mut self.spill, n, new, floor);
        self.spill.truncate(m);
        let evicted = m.saturating_sub(MAX_KEPT);
        self.spill.drain(..evicted);
        evicted as u64
    }

    /// [`insert`](Self::insert) into a spilled calendar of disjoint exclusive intervals, by
    /// searches ([`from_back`], [`from_front`]): those that ended by `floor` are a prefix, and
    /// those the new one touches or overlaps a contiguous run that becomes one interval.
    fn insert_disjoint(&mut self, (from, to, kind): Interval, floor: u64) -> u64 {
        self.head += from_front(self.intervals(), |w| w.1 <= floor);
        self.compact(false);
        let head = self.head;
        let v = &mut self.spill;
        let lo = head + from_back(&v[head..], |w| w.1 < from);
        let hi = (head + from_back(&v[head..], |w| w.0 <= to)).max(lo);
        let merged = (
            v.get(lo)
                .filter(|_| hi > lo)
                .map_or(from, |w| w.0.min(from)),
            v.get(hi.wrapping_sub(1))
                .filter(|_| hi > lo)
                .map_or(to, |w| w.1.max(to)),
            kind,
        );
        v.splice(lo..hi, [merged]);
        let evicted = (v.len() - head).saturating_sub(MAX_KEPT);
        self.head += evicted;
        self.compact(false);
        evicted as u64
    }

    /// The end of the latest interval (0 if none).
    pub(crate) fn last_end(&self) -> u64 {
        let all = self.intervals();
        if self.mixed {
            all.iter().map(|w| w.1).max().unwrap_or(0)
        } else {
            // Disjoint intervals sorted by start are sorted by end: a scan here was half of a
            // 128-vCPU simulation's time (a hot line keeps thousands).
            all.last().map_or(0, |w| w.1)
        }
    }
}

/// `v.partition_point(pred)`, searched from the end in doubling steps: a request lands near
/// the latest intervals of a hot calendar (within the lookahead of the others), so this
/// touches a few of its thousands of intervals where a bisection over all of them missed the
/// cache at every step.
fn from_back<T>(v: &[T], pred: impl Fn(&T) -> bool) -> usize {
    let mut hi = v.len(); // every index from `hi` on is known false
    let mut step = 1;
    while hi > 0 {
        let probe = hi.saturating_sub(step);
        if pred(&v[probe]) {
            return probe + 1 + v[probe + 1..hi].partition_point(&pred);
        }
        hi = probe;
        step = step.saturating_mul(2);
    }
    0
}

/// `v.partition_point(pred)`, searched from the start in doubling steps: the intervals that
/// ended by the floor are few, at the front.
fn from_front<T>(v: &[T], pred: impl Fn(&T) -> bool) -> usize {
    let mut lo = 0; // every index below `lo` is known true
    let mut step = 1;
    while lo < v.len() {
        let probe = lo.saturating_add(step - 1).min(v.len() - 1);
        if !pred(&v[probe]) {
            return lo + v[lo..probe].partition_point(&pred);
        }
        lo = probe + 1;
        step = step.saturating_mul(2);
    }
    v.len()
}

/// Drops from `buf[..n]` (sorted by start) the intervals that ended by `floor`, merges `new`
/// with the intervals of its kind it touches or overlaps, and inserts it in order; returns the
/// new length. `buf` has room for `n + 1` intervals.
fn merge_in(buf: &mut [Interval], n: usize, new: Interval, floor: u64) -> usize {
    let (mut from, mut to, kind) = new;
    let mut m = 0;
    for i in 0..n {
        let (f, t, e) = buf[i];
        if t <= floor {
            continue;
        }
        if e == kind && f <= to && t >= from {
            from = from.min(f);
            to = to.max(t);
            continue;
        }
        buf[m] = buf[i];
        m += 1;
    }
    let at = buf[..m].partition_point(|w| w.0 <= from);
    buf.copy_within(at..m, at + 1);
    buf[at] = (from, to, kind);
    m + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_in_gaps_and_after_conflicts() {
        let mut c = Calendar::default();
        c.insert(100, 110, true, 0);
        c.insert(200, 210, true, 0);
        assert_eq!(c.fit(50, 10, true, 0), 50); // before both
        assert_eq!(c.fit(95, 10, true, 0), 110); // overlaps the first
        assert_eq!(c.fit(105, 100, true, 0), 210); // does not fit the gap
        assert_eq!(c.fit(105, 0, true, 5), 115); // a point inside: after it plus the gap
        c.insert(300, 310, false, 0);
        assert_eq!(c.fit(305, 0, false, 5), 305); // readers do not conflict
        assert_eq!(c.fit(305, 0, true, 5), 315);
        assert_eq!(c.last_end(), 310);
    }

    #[test]
    fn keeps_every_interval_after_the_floor_and_drops_the_rest() {
        let mut c = Calendar::default();
        for i in 0..20u64 {
            assert_eq!(c.insert(i * 10, i * 10 + 5, true, 0), 0);
        }
        // The earliest interval is still there: a late request in its time waits for it.
        assert_eq!(c.fit(2, 1, true, 0), 5);
        assert_eq!(c.fit(192, 1, true, 0), 195);
        c.insert(7, 7, true, 0); // empty: ignored
        assert_eq!(c.intervals().len(), 20);
        // Nothing can arrive before 100 any more: what ended by then goes.
        c.insert(500, 505, true, 100);
        assert_eq!(c.intervals().len(), 11);
        assert_eq!(c.fit(2, 1, true, 0), 2);
    }

    /// The bug this calendar fixes: 64 CPUs' serialised RMWs arriving out of virtual-time
    /// order (each CPU runs ahead within the lookahead) must still serialise. With eight kept
    /// intervals most requests found the line free.
    #[test]
    fn out_of_order_requests_still_serialise() {
        let mut c = Calendar::default();
        let (cpus, per_cpu, cost) = (64u64, 16u64, 40u64);
        let mut busy = 0;
        // CPU k asks at times k + 100 * j (j-th request), all CPUs nearly in step, but the
        // simulation runs each CPU's requests before the next CPU's.
        for k in 0..cpus {
            for j in 0..per_cpu {
                let t = k + 100 * j;
                let start = c.fit(t, cost, true, 0);
                c.insert(start, start + cost, true, 0);
                busy += cost;
            }
        }
        // Serialised: the last request ends no earlier than the total busy time.
        assert!(c.last_end() >= busy, "{} < {busy}", c.last_end());
        // And a saturated line keeps few intervals, however many requests it served.
        assert!(c.intervals().len() < 64, "{}", c.intervals().len());
    }

    #[test]
    fn merges_touching_intervals_of_a_kind_only() {
        let mut c = Calendar::default();
        c.insert(0, 10, true, 0);
        c.insert(10, 20, true, 0);
        c.insert(20, 30, false, 0);
        c.insert(25, 40, false, 0);
        assert_eq!(c.intervals(), &[(0, 20, true), (20, 40, false)]);
    }

    #[test]
    fn bounded_when_the_floor_is_held_back() {
        let mut c = Calendar::default();
        let mut evicted = 0;
        for i in 0..(MAX_KEPT as u64 + 10) {
            evicted += c.insert(i * 10, i * 10 + 5, true, 0);
        }
        assert_eq!(evicted, 10);
        assert_eq!(c.intervals().len(), MAX_KEPT);
    }

    #[test]
    fn searches_from_either_end_find_the_partition_point() {
        for n in 0..70usize {
            let v: Vec<usize> = (0..n).collect();
            for cut in 0..=n {
                let pred = |x: &usize| *x < cut;
                assert_eq!(from_back(&v, pred), cut, "from_back n={n} cut={cut}");
                assert_eq!(from_front(&v, pred), cut, "from_front n={n} cut={cut}");
            }
        }
    }

    /// The bisection paths against a plain list that keeps and scans everything: the same
    /// start for every request, in random (out-of-order) request times.
    #[test]
    fn bisection_agrees_with_a_full_scan() {
        let mut c = Calendar::default();
        let mut all: Vec<(u64, u64)> = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let t = (x >> 33) % 20_000;
            let len = (x >> 20) % 50;
            let mut p = t;
            loop {
                let hit = all.iter().find(|w| w.0 < p + len.max(1) && w.1 > p);
                match hit {
                    Some(w) => p = w.1,
                    None => break,
                }
            }
            let got = c.fit(t, len, true, 0);
            assert_eq!(got, p, "request at {t} for {len}");
            c.insert(got, got + len, true, 0);
            if len > 0 {
                all.push((got, got + len));
            }
        }
        assert!(!c.spill.is_empty());
    }
}
