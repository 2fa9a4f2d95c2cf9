//! What a page-table entry held before its latest writes, for walks that run earlier in
//! virtual time than those writes but later in the simulation's real order.
//!
//! The scheduler lets a CPU run up to `lookahead` past the lowest clock, so a vCPU may write an
//! entry at virtual time 5 µs before another vCPU, at 1 µs, walks it. Real memory only holds
//! the newest value; the walker at 1 µs must not see it, or two vCPUs touching the same pages
//! never collide in their faults as real ones do (docs/design/virtual-time.md §3, "What a walk
//! sees"). Each write through the engine's entry-update functions reports the value it
//! replaced; a walk asks for the value at its own clock. Keyed by address identity only, and
//! dropped once no CPU can be behind their writes (the floor), or when the memory is freed.

use std::collections::HashMap;

use super::FastHash;

/// One write: it completed at `at` (ps) on `cpu` and replaced `old`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Version {
    at: u64,
    cpu: usize,
    old: u64,
}

/// An entry's latest two writes, oldest first in real order (`[1]` may be empty).
type History = [Option<Version>; 2];

/// What a walk sees in an entry ([`Versions::seen`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    /// The value from before a write not seen yet; `None`: the value memory holds.
    pub old: Option<u64>,
    /// The virtual time the reader's clock moves to, if later than its own.
    pub after: Option<u64>,
}

impl Seen {
    /// The value seen in an entry that holds `current`.
    pub(crate) fn value_or(self, current: u64) -> u64 {
        self.old.unwrap_or(current)
    }
}

/// Counters of the version model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct VersionStats {
    /// Entry writes recorded.
    pub writes: u64,
    /// Walk reads that saw an older value than memory held (a write later in virtual time).
    pub stale_reads: u64,
    /// Fault handlers' reads that saw an older value than memory held: their
    /// compare-and-swap then lost to that write.
    pub handler_stale_reads: u64,
    /// Entries with a recorded write now. (a gauge: not in reports, which give counts)
    #[serde(skip)]
    pub entries: u64,
}

/// The recent writes of every entry some CPU may still be behind ([`Versions::sweep`]).
#[derive(Debug)]
pub(crate) struct Versions {
    map: HashMap<usize, History, FastHash>,
    /// Per CPU, the entry its latest stale read was of and when the write it did not see
    /// completed.
    faulted_on: HashMap<usize, (usize, u64), FastHash>,
    /// Per CPU, the entry its fault handler's latest older read was of and when the write it
    /// did not see completed ([`Versions::seen_by_handler`]).
    handler_saw: HashMap<usize, (usize, u64), FastHash>,
    retention: u64,
    next_sweep: u64,
    stats: VersionStats,
}

impl Versions {
    pub(crate) fn new(retention: u64) -> Versions {
        Versions {
            map: HashMap::default(),
            faulted_on: HashMap::default(),
            handler_saw: HashMap::default(),
            retention,
            next_sweep: retention / 64,
            stats: VersionStats::default(),
        }
    }

    /// `cpu`'s write to the entry at `addr`, completed at `at`, replaced `old`. Writes arrive
    /// in real order. The oldest write still in some CPU's future (`at` above `floor`, the
    /// lowest clock) keeps its place before the new one, so a CPU behind both sees the value
    /// before both; of three such writes the middle one is dropped (a CPU between the first
    /// two then sees the value before the third: rare, and only ever an older value).
    pub(crate) fn record(&mut self, cpu: usize, at: u64, addr: usize, old: u64, floor: u64) {
        self.sweep(at, floor);
        self.stats.writes += 1;
        let new = Some(Version { at, cpu, old });
        let h = self.map.entry(addr).or_default();
        *h = match *h {
            [Some(a), _] if a.at > floor => [Some(a), new],
            [Some(_), Some(b)] if b.at > floor => [Some(b), new],
            _ => [new, None],
        };
    }

    /// What `cpu`, at virtual time `t`, sees in the entry at `addr`: the value before the
    /// first write (in real order) that another CPU completed after `t`, or the value memory
    /// holds if there is none. (Asked without that value, so the caller loads it outside the
    /// simulation's lock.)
    ///
    /// A walk that faulted on such a value and walks the same entry again has had its fault
    /// handled, and the handler read the entry as memory holds it: that CPU cannot be before
    /// the write any more. So the second read sees memory's value and returns, as
    /// [`Seen::after`], the write's completion for the caller's clock to move to. One fault
    /// per write not seen, as on a real machine, where the handler would find the entry fixed.
    pub(crate) fn seen(&mut self, cpu: usize, t: u64, addr: usize) -> Seen {
        let unseen = self.map.get(&addr).and_then(|h| {
            h.iter()
                .flatten()
                .find(|v| v.at > t && v.cpu != cpu)
                .copied()
        });
        let Some(v) = unseen else {
            if self.faulted_on.get(&cpu).is_some_and(|&(a, _)| a == addr) {
                self.faulted_on.remove(&cpu);
            }
            return Seen {
                old: None,
                after: None,
            };
        };
        match self.faulted_on.get(&cpu) {
            Some(&(a, at)) if a == addr => {
                self.faulted_on.remove(&cpu);
                Seen {
                    old: None,
                    after: Some(at),
                }
            }
            _ => {
                let latest = self.map.get(&addr).map_or(v.at, |h| {
                    h.iter().flatten().map(|v| v.at).max().unwrap_or(v.at)
                });
                self.faulted_on.insert(cpu, (addr, latest));
                self.stats.stale_reads += 1;
                Seen {
                    old: Some(v.old),
                    after: None,
                }
            }
        }
    }

    /// What `cpu`'s fault handler, at virtual time `t`, sees in the entry at `addr` (the same
    /// value [`seen`](Self::seen) gives a walk). The real handler of a collision read the entry
    /// before the other CPU's write and lost the compare-and-swap that followed: so the first
    /// read sees the older value, and the handler's next read of the entry (after that failed
    /// compare-and-swap brought the line) sees memory, with the write's completion as
    /// [`Seen::after`]. Without this the handler always found the entry fixed: a collision
    /// cost a spurious fault and no lost compare-and-swap, and the slow path never retried.
    pub(crate) fn seen_by_handler(&mut self, cpu: usize, t: u64, addr: usize) -> Seen {
        if let Some(&(a, at)) = self.handler_saw.get(&cpu) {
            if a == addr {
                self.handler_saw.remove(&cpu);
                return Seen {
                    old: None,
                    after: Some(at),
                };
            }
        }
        let Some(h) = self.map.get(&addr) else {
            return Seen {
                old: None,
                after: None,
            };
        };
        let Some(v) = h
            .iter()
            .flatten()
            .find(|v| v.at > t && v.cpu != cpu)
            .copied()
        else {
            return Seen {
                old: None,
                after: None,
            };
        };
        let latest = h.iter().flatten().map(|v| v.at).max().unwrap_or(v.at);
        self.handler_saw.insert(cpu, (addr, latest));
        self.stats.handler_stale_reads += 1;
        Seen {
            old: Some(v.old),
            after: None,
        }
    }

    /// Forgets the entries in the freed block `[addr, addr + size)`: a table allocated there
    /// next has no history.
    pub(crate) fn forget(&mut self, addr: usize, size: usize) {
        // Entries live in table pages, allocated a page or more at a time: a smaller block
        // holds none (most frees are small, and each is forgotten here).
        if size < 4096 || self.map.is_empty() {
            return;
        }
        let end = addr.saturating_add(size);
        if size / 8 > self.map.len() {
            self.map.retain(|&a, _| a < addr || a >= end);
        } else {
            for a in (addr..end).step_by(8) {
                self.map.remove(&a);
            }
        }
    }

    /// Forgets every entry whose writes no CPU can still be behind (`floor`: the lowest
    /// clock), for the scheduler's "forget everything idle" (`freed.rs`).
    pub(crate) fn forget_idle(&mut self, floor: u64) {
        self.map
            .retain(|_, h| h.iter().flatten().any(|v| v.at > floor));
    }

    /// Forgets the entries whose writes no CPU can still be behind: completed by the floor
    /// (every CPU that runs or will rejoin is past it, and a blocked one wakes at a time a
    /// running CPU set), or more than a sixteenth of `retention` (62.5 µs by default, six
    /// lookaheads) before `now`. The floor alone is not enough: it rises only at a baton
    /// switch, and a thread detached for a whole phase holds it back, so with `retention`
    /// as the bound the table held a millisecond of every entry write (675 against 280 MiB
    /// for `dirty-log-perf -v 64 -b 128M -s phantom`). A CPU further behind than that, one
    /// that rejoins late, sees the entry as memory holds it. Runs every 64th of `retention`.
    fn sweep(&mut self, now: u64, floor: u64) {
        if now < self.next_sweep {
            return;
        }
        let keep_after = now.saturating_sub(self.retention / 16).max(floor);
        self.map
            .retain(|_, h| h.iter().flatten().any(|v| v.at > keep_after));
        self.next_sweep = now.saturating_add(self.retention / 64);
    }

    pub(crate) fn stats(&self) -> VersionStats {
        VersionStats {
            entries: self.map.len() as u64,
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000_000;

    /// A first read's value (each call from a CPU of its own, so no retry rule applies).
    fn first_read(v: &mut Versions, t: u64, addr: usize, current: u64) -> u64 {
        let cpu = 10 + v.stats.writes as usize + v.faulted_on.len();
        v.seen(cpu, t, addr).value_or(current)
    }

    #[test]
    fn a_walk_before_another_cpus_write_sees_the_old_value() {
        let mut v = Versions::new(MS);
        v.record(0, 5_000, 0x1000, 0, 0);
        assert_eq!(first_read(&mut v, 1_000, 0x1000, 7), 0, "before the write");
        assert_eq!(first_read(&mut v, 5_000, 0x1000, 7), 7, "at its completion");
        assert_eq!(
            v.seen(0, 1_000, 0x1000).value_or(7),
            7,
            "the writer sees its own"
        );
        assert_eq!(first_read(&mut v, 1_000, 0x2000, 9), 9, "another entry");
        assert_eq!(v.stats().stale_reads, 1);
    }

    #[test]
    fn the_read_after_a_fault_on_an_old_value_sees_the_write_and_waits_for_it() {
        let mut v = Versions::new(MS);
        v.record(0, 5_000, 0x1000, 0, 0);
        v.record(0, 6_000, 0x1000, 3, 0);
        let first = v.seen(1, 1_000, 0x1000);
        assert_eq!((first.value_or(7), first.after), (0, None));
        // The walk retried after its fault, still before the write in virtual time.
        let again = v.seen(1, 2_000, 0x1000);
        assert_eq!((again.value_or(7), again.after), (7, Some(6_000)));
        // The walk from the root reads other entries first.
        assert_eq!(v.seen(1, 1_000, 0x1000).value_or(7), 0);
        assert_eq!(v.seen(1, 1_000, 0x2000).value_or(9), 9);
        assert_eq!(v.seen(1, 1_000, 0x1000).after, Some(6_000));
        // A stale read of another entry starts over.
        v.record(0, 5_000, 0x3000, 0, 0);
        assert_eq!(v.seen(1, 1_000, 0x1000).value_or(7), 0);
        assert_eq!(v.seen(1, 1_000, 0x3000).value_or(7), 0);
        assert_eq!(v.seen(1, 1_000, 0x1000).value_or(7), 0);
        assert_eq!(v.stats().stale_reads, 5);
    }

    #[test]
    fn two_writes_ahead_show_the_value_before_both() {
        let mut v = Versions::new(MS);
        v.record(0, 5_000, 0x1000, 0, 0);
        v.record(0, 6_000, 0x1000, 3, 0);
        assert_eq!(first_read(&mut v, 1_000, 0x1000, 7), 0);
        assert_eq!(first_read(&mut v, 5_500, 0x1000, 7), 3);
        assert_eq!(first_read(&mut v, 6_000, 0x1000, 7), 7);
    }

    #[test]
    fn of_three_writes_ahead_the_first_is_kept() {
        let mut v = Versions::new(MS);
        v.record(0, 5_000, 0x1000, 0, 0);
        v.record(0, 6_000, 0x1000, 3, 0);
        v.record(0, 7_000, 0x1000, 4, 0);
        assert_eq!(first_read(&mut v, 1_000, 0x1000, 9), 0);
        assert_eq!(first_read(&mut v, 6_500, 0x1000, 9), 4);
        assert_eq!(first_read(&mut v, 7_000, 0x1000, 9), 9);
    }

    #[test]
    fn writes_every_cpu_is_past_are_dropped_first() {
        let mut v = Versions::new(MS);
        v.record(0, 5_000, 0x1000, 0, 0);
        v.record(0, 6_000, 0x1000, 3, 5_500);
        v.record(0, 7_000, 0x1000, 4, 5_500);
        // The first write is behind the floor: the two kept are the later ones.
        assert_eq!(first_read(&mut v, 5_600, 0x1000, 7), 3);
        assert_eq!(first_read(&mut v, 6_500, 0x1000, 7), 4);
    }

    #[test]
    fn freed_and_old_entries_are_forgotten() {
        let mut v = Versions::new(MS);
        v.record(0, 5_000, 0x1000, 0, 0);
        v.record(0, 5_000, 0x1ff8, 0, 0);
        v.record(0, 5_000, 0x2000, 0, 0);
        v.forget(0x2000, 64);
        v.forget(0x1000, 4096);
        assert_eq!(first_read(&mut v, 0, 0x1000, 7), 7);
        assert_eq!(first_read(&mut v, 0, 0x1ff8, 7), 7);
        assert_eq!(first_read(&mut v, 0, 0x2000, 7), 0);
        v.record(0, 3 * MS, 0x3000, 0, 0);
        assert_eq!(v.stats().entries, 1, "swept by age");
        v.record(0, 3 * MS + 10, 0x4000, 0, 0);
        v.record(0, 3 * MS + MS / 32, 0x5000, 0, 3 * MS + 20);
        assert_eq!(v.stats().entries, 1, "swept by the floor");
        v.record(0, 3 * MS + MS / 32 + MS / 16 + 1, 0x6000, 0, 0);
        assert_eq!(v.stats().entries, 1, "swept by age, the floor held back");
        v.forget_idle(4 * MS);
        assert_eq!(v.stats().entries, 0);
    }
}
