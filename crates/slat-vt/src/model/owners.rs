//! Who owned a line when: the runs of writes by one CPU, in virtual time.
//!
//! A CPU runs up to the lookahead ahead of the others, so the writes to a line arrive in
//! simulation order, not in virtual-time order. Keeping only the latest writer lost the turns
//! two CPUs take on a line: CPU 0 wrote a lock word 100 times in its window and owned it
//! throughout; CPU 1's 100 writes, interleaved with those in virtual time, came afterwards and
//! found CPU 0 the owner each time. Each turn should cost both CPUs a transfer; the model
//! charged CPU 1's turns and none of CPU 0's, and two vCPUs faulting in memory cost what one
//! does (`demand-paging -v 2` 0.98 ms with the 10 µs lookahead, 1.49 ms with none).
//!
//! So a line keeps, for the time a late request can still land in (from the scheduler's
//! floor on), its *runs*: a CPU's consecutive writes, with the first and last write's time
//! and how many. A write by `c` that lands inside a run of another CPU `d` splits it, and `d`,
//! whose next write in that run was charged as its own line's, owes a transfer (the caller
//! adds it to `d`'s clock: `d` has run past it already). Where in the run `d`'s writes fell
//! is not kept, only their number: they are taken as evenly spread, which is exact for a
//! CPU that writes a line once per fault and bounded by the run otherwise.

use smallvec::SmallVec;

/// Writes by one CPU with no other CPU's write between them: `count` writes from `from` to
/// `last` (ps), completing. The CPU owns the line from `from` until the next run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    from: u64,
    last: u64,
    count: u64,
    cpu: usize,
}

impl Run {
    fn one(cpu: usize, at: u64) -> Run {
        Run {
            from: at,
            last: at,
            count: 1,
            cpu,
        }
    }
}

/// The most runs kept: a defence against a floor held back; beyond it the earliest go.
const MAX_RUNS: usize = 1024;

/// A line's runs of writes after the floor, sorted by `from`. Adjacent runs are by different
/// CPUs, except the halves of a run a read split ([`Owners::read`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct Owners {
    runs: SmallVec<[Run; 2]>,
}

impl Owners {
    /// The CPU that owned the line at `t`: the one whose run started last by `t`. `None` if
    /// no kept write is that early (the line was not written before `t`).
    pub(crate) fn at(&self, t: u64) -> Option<usize> {
        let i = self.runs.partition_point(|r| r.from <= t);
        i.checked_sub(1).map(|i| self.runs[i].cpu)
    }

    /// The CPU of the latest write in virtual time, if any.
    pub(crate) fn latest(&self) -> Option<usize> {
        self.runs.last().map(|r| r.cpu)
    }

    /// Records a write by `cpu` completing at `at`, after forgetting the runs no request can
    /// land in any more (all but the one holding the line at `floor`). Returns the CPU that
    /// owes a transfer (the one whose run this write splits) and when its next write, the one
    /// that pays it, completed.
    pub(crate) fn write(&mut self, cpu: usize, at: u64, floor: u64) -> Option<(usize, u64)> {
        self.prune(floor);
        let i = self.runs.partition_point(|r| r.from <= at);
        let Some(prev) = i.checked_sub(1) else {
            // Before every kept run.
            match self.runs.first_mut() {
                Some(r) if r.cpu == cpu => {
                    r.from = at;
                    r.count += 1;
                }
                _ => self.runs.insert(0, Run::one(cpu, at)),
            }
            return None;
        };
        let r = self.runs[prev];
        if r.cpu == cpu {
            let r = &mut self.runs[prev];
            r.last = r.last.max(at);
            r.count += 1;
            return None;
        }
        if at >= r.last {
            // After the other CPU's last write of its run: this CPU owns the line until the
            // next run, whose first write paid a transfer whoever owned it before.
            match self.runs.get_mut(i) {
                Some(n) if n.cpu == cpu => {
                    n.from = at;
                    n.count += 1;
                }
                _ => self.runs.insert(i, Run::one(cpu, at)),
            }
            return None;
        }
        // Inside the other CPU's run: it wrote again after `at`, as the line's owner.
        let (left, right) = split(r, at);
        self.runs[prev] = left;
        self.runs.insert(i, Run::one(cpu, at));
        self.runs.insert(i + 1, right);
        Some((r.cpu, right.from))
    }

    /// Records a read by `cpu` at `t`. A read inside another CPU's run lands between two of
    /// its writes in virtual time: the line went shared, and that CPU's next write, which was
    /// charged as its own line's, took it back. Splits the run there (its halves stay that
    /// CPU's, so a second read in the same gap charges nothing: nobody wrote between) and
    /// returns the CPU that owes the transfer and when the write that pays it completed.
    pub(crate) fn read(&mut self, cpu: usize, t: u64, floor: u64) -> Option<(usize, u64)> {
        // Most loads land after the latest run's last write: answer them without pruning.
        let inside = |runs: &[Run]| {
            let i = runs.partition_point(|r| r.from <= t);
            let r = *runs.get(i.checked_sub(1)?)?;
            (r.cpu != cpu && t < r.last).then_some((i, r))
        };
        inside(&self.runs)?;
        // The reader runs, so `t` is at or after the floor: pruning keeps the run holding `t`.
        self.prune(floor);
        let (i, r) = inside(&self.runs)?;
        let (left, right) = split(r, t);
        self.runs[i - 1] = left;
        self.runs.insert(i, right);
        Some((r.cpu, right.from))
    }

    fn prune(&mut self, floor: u64) {
        let holding = self.runs.partition_point(|r| r.from <= floor);
        let gone = holding
            .saturating_sub(1)
            .max(self.runs.len().saturating_sub(MAX_RUNS - 2));
        if gone > 0 {
            self.runs.drain(..gone);
        }
    }
}

/// Run `r` (at least two writes, `r.from <= at < r.last`) cut at `at`: its writes up to `at`,
/// and those after, taken as evenly spread over the run.
fn split(r: Run, at: u64) -> (Run, Run) {
    let span = u128::from(r.last - r.from);
    let gaps = u128::from(r.count.max(2) - 1);
    // The time of write `k` (from 0).
    let time_of = |k: u128| r.from + (k * span / gaps) as u64;
    // Writes at or before `at`: 1 ..= count - 1, as `at < last` leaves the last one after.
    let before = (1 + u128::from(at - r.from) * gaps / span).min(gaps);
    let left = Run {
        from: r.from,
        last: time_of(before - 1).min(at),
        count: before as u64,
        cpu: r.cpu,
    };
    let right = Run {
        from: time_of(before).clamp(at.saturating_add(1), r.last),
        last: r.last,
        count: r.count - before as u64,
        cpu: r.cpu,
    };
    (left, right)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_write_inside_another_cpus_run_splits_it_and_charges_that_cpu() {
        let mut o = Owners::default();
        // CPU 0 ran ahead: writes at 0, 100, ..., 900.
        for k in 0..10 {
            assert_eq!(o.write(0, k * 100, 0), None);
        }
        // CPU 1's writes, later in simulation order, fall between them in virtual time.
        for k in 0..10 {
            let at = k * 100 + 50;
            assert_eq!(o.at(at), Some(0), "CPU 0's write just before {at}");
            let owes = o.write(1, at, 0);
            // CPU 0's next write pays; after 900 it does not write again.
            let want = (k < 9).then_some((0, k * 100 + 100));
            assert_eq!(owes, want, "CPU 1's write at {at}");
        }
        assert_eq!(o.at(860), Some(1)); // CPU 1 wrote at 850, CPU 0 next at 900
        assert_eq!(o.at(910), Some(0));
        assert_eq!(o.at(950), Some(1));
        assert_eq!(o.latest(), Some(1));
    }

    #[test]
    fn a_cpus_own_writes_and_writes_after_a_run_charge_nobody() {
        let mut o = Owners::default();
        assert_eq!(o.write(0, 100, 0), None);
        assert_eq!(o.write(0, 200, 0), None);
        assert_eq!(o.write(1, 300, 0), None); // after CPU 0's last write
        assert_eq!(o.write(1, 250, 0), None); // in the gap CPU 1 owns from 300 on: its own
        assert_eq!(o.at(260), Some(1));
        assert_eq!(o.at(150), Some(0));
        assert_eq!(o.at(50), None);
        assert_eq!(o.write(2, 50, 0), None); // before every run
        assert_eq!(o.at(60), Some(2));
    }

    #[test]
    fn a_sparse_run_charges_once_for_many_landings() {
        let mut o = Owners::default();
        o.write(0, 0, 0);
        o.write(0, 1000, 0);
        // CPU 1 writes 50 times between CPU 0's two writes: one turn each way.
        let owed: Vec<_> = (1..=50).filter_map(|k| o.write(1, k * 10, 0)).collect();
        assert_eq!(owed, vec![(0, 1000)]);
        assert_eq!(o.at(999), Some(1));
        assert_eq!(o.at(1000), Some(0));
    }

    #[test]
    fn a_late_read_inside_another_cpus_run_charges_it_once_per_gap() {
        let mut o = Owners::default();
        for k in 0..10 {
            o.write(0, k * 100, 0);
        }
        // CPU 1 reads between CPU 0's writes, later in simulation order.
        assert_eq!(o.read(1, 150, 0), Some((0, 200)));
        assert_eq!(
            o.read(1, 160, 0),
            None,
            "same gap: no write since the last read"
        );
        assert_eq!(o.read(1, 450, 0), Some((0, 500)));
        assert_eq!(o.read(0, 550, 0), None, "its own line");
        assert_eq!(o.read(1, 950, 0), None, "after the run's last write");
        assert_eq!(o.read(1, 50, 0), Some((0, 100)));
        assert_eq!(o.at(460), Some(0), "a read does not take the line");
        // A write in a gap a read made owes nothing more.
        assert_eq!(o.write(1, 170, 0), None);
        assert_eq!(o.at(180), Some(1));
        assert_eq!(o.at(200), Some(0));
    }

    #[test]
    fn the_floor_keeps_the_run_holding_the_line_and_a_bound_holds() {
        let mut o = Owners::default();
        for k in 0..10 {
            o.write(k % 2, k as u64 * 100, 0);
        }
        o.write(0, 2000, 550);
        assert_eq!(o.at(550), Some(1)); // CPU 1's run from 500 holds the line at the floor
        assert_eq!(o.runs.len(), 6);
        for k in 0..5000u64 {
            o.write((k % 2) as usize, 3000 + k, 0);
        }
        assert!(o.runs.len() <= MAX_RUNS);
    }

    #[test]
    fn split_keeps_every_write_and_the_order() {
        for count in 2..40u64 {
            for at in [0, 1, 7, 500, 998] {
                let r = Run {
                    from: 0,
                    last: 999,
                    count,
                    cpu: 3,
                };
                let (a, b) = split(r, at);
                assert_eq!(a.count + b.count, count);
                assert!(a.count >= 1 && b.count >= 1);
                assert!(
                    a.last <= at && at < b.from && b.from <= b.last,
                    "{a:?} {b:?} {at}"
                );
            }
        }
    }
}
