//! The lock model: one queue per lock address, readers–writer rules, and the hand-off policy.
//!
//! The head writer gets a lock alone; consecutive readers at the head enter together; a
//! waiting writer stops later readers. The model grants a lock only when its holders allow it,
//! so the real acquire that follows a grant never blocks. Times are virtual (ps).

use std::collections::{HashMap, VecDeque};

use slat::clock::LockMode;

use super::calendar::Calendar;
use super::FastHash;
use crate::profile::LockPolicy;

#[derive(Debug, Clone, Copy)]
struct Waiter {
    cpu: usize,
    mode: LockMode,
    /// Under `barging`: woken by a release, runnable at this time, not yet holding the lock.
    woken_at: Option<u64>,
    /// When it asked.
    arrived: u64,
}

#[derive(Debug, Default)]
struct Lock {
    writer: Option<usize>,
    /// Holders in shared mode (a CPU may appear more than once: recursive read locks).
    readers: Vec<usize>,
    queue: VecDeque<Waiter>,
    /// The latest release.
    released_at: u64,
    /// When the first holder of the current busy period asked for the lock.
    busy_from: u64,
    /// A writer held the lock in the current busy period.
    busy_writer: bool,
    /// Recent busy periods: a CPU that arrives at a free lock at a time inside one (it ran
    /// late within the lookahead) was, in virtual time, a waiter that period's release handed
    /// over to, unless both were readers; one that arrives in a gap went first.
    past: Calendar,
    /// The last fair hand-off (`barging` only).
    last_fair: u64,
    /// Who released at `released_at`.
    last_releaser: Option<usize>,
}

impl Lock {
    fn free(&self) -> bool {
        self.writer.is_none() && self.readers.is_empty()
    }

    fn compatible(&self, mode: LockMode) -> bool {
        match mode {
            LockMode::Exclusive => self.free(),
            LockMode::Shared => self.writer.is_none(),
        }
    }

    fn hold(&mut self, cpu: usize, mode: LockMode, asked: u64) {
        let exclusive = mode == LockMode::Exclusive;
        if self.free() {
            self.busy_from = asked;
            self.busy_writer = exclusive;
        } else {
            self.busy_from = self.busy_from.min(asked);
            self.busy_writer |= exclusive;
        }
        match mode {
            LockMode::Exclusive => self.writer = Some(cpu),
            LockMode::Shared => self.readers.push(cpu),
        }
    }

    /// How many waiters at the head enter together: a writer alone, or consecutive readers.
    fn head_group(&self) -> usize {
        match self.queue.front() {
            None => 0,
            Some(w) if w.mode == LockMode::Exclusive => 1,
            Some(_) => self
                .queue
                .iter()
                .take_while(|w| w.mode == LockMode::Shared)
                .count(),
        }
    }

    fn writer_waits(&self) -> bool {
        self.queue.iter().any(|w| w.mode == LockMode::Exclusive)
    }
}

/// What an acquire gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Acquire {
    /// The lock, now.
    Now,
    /// The lock, at this later time (the caller arrived before the last release).
    At(u64),
    /// Nothing yet: the caller is queued and must wait for a [`Handover`].
    Queued,
}

/// A waiter a release lets go: runnable at `at`, holding the lock if `granted` (a direct
/// hand-off), else to retry (woken under `barging`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handover {
    pub cpu: usize,
    pub at: u64,
    pub granted: bool,
}

/// Counters of the lock model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LockStats {
    /// Acquires granted.
    pub acquires: u64,
    /// Acquires that had to queue.
    pub queued: u64,
    /// Acquires that took a free lock ahead of a woken waiter (`barging`).
    pub barged: u64,
    /// Releases of a lock the CPU did not hold in the model (ignored).
    pub stray_releases: u64,
    /// Busy periods dropped that a late request could still have met (see
    /// [`LineStats::calendar_evictions`](super::line::LineStats)); 0 in a faithful run.
    pub calendar_evictions: u64,
}

/// Every lock the simulated CPUs took.
#[derive(Debug)]
pub(crate) struct Locks {
    map: HashMap<usize, Lock, FastHash>,
    policy: LockPolicy,
    handoff: u64,
    fair_every: u64,
    retention: u64,
    next_sweep: u64,
    stats: LockStats,
    /// The scheduler's floor: no CPU can request before it (calendar.rs).
    floor: u64,
}

impl Locks {
    /// `handoff` is the policy's: the line transfer for `fifo`, the wake-up for `barging`.
    pub(crate) fn new(policy: LockPolicy, handoff: u64, fair_every: u64, retention: u64) -> Locks {
        Locks {
            map: HashMap::default(),
            policy,
            handoff,
            fair_every,
            retention,
            next_sweep: retention,
            stats: LockStats::default(),
            floor: 0,
        }
    }

    /// Forgets the idle locks in the freed block `[addr, addr + size)`: a lock made there
    /// next has no past busy periods (`freed.rs`). A held or waited-for lock is kept: freeing
    /// it would be the program's bug, and the model must still hand it over.
    pub(crate) fn forget(&mut self, addr: usize, size: usize) {
        let end = addr.saturating_add(size);
        self.map
            .retain(|&a, l| a < addr || a >= end || !(l.free() && l.queue.is_empty()));
    }

    /// Forgets every idle lock (`freed.rs`: more blocks freed than were recorded).
    pub(crate) fn forget_idle(&mut self) {
        self.map.retain(|_, l| !(l.free() && l.queue.is_empty()));
    }

    /// Raises the floor: no CPU will request before `floor` (the lowest clock of every CPU).
    pub(crate) fn set_floor(&mut self, floor: u64) {
        self.floor = self.floor.max(floor);
    }

    /// `cpu` asks for the lock at `addr` at `t` (a first request or, under `barging`, a woken
    /// waiter's retry). Waiters it hands the lock to (a bump, below) are appended to `out`.
    pub(crate) fn acquire(
        &mut self,
        cpu: usize,
        addr: usize,
        mode: LockMode,
        t: u64,
        out: &mut Vec<Handover>,
    ) -> Acquire {
        self.sweep(t);
        self.bump(cpu, addr, t, out);
        let policy = self.policy;
        let handoff = self.handoff;
        let l = self.map.entry(addr).or_default();
        if let Some(p) = l.queue.iter().position(|w| w.cpu == cpu) {
            // A woken waiter retries; readers still yield to a writer ahead of them.
            let writer_ahead = l
                .queue
                .iter()
                .take(p)
                .any(|w| w.mode == LockMode::Exclusive);
            if l.compatible(mode) && !(mode == LockMode::Shared && writer_ahead) {
                let arrived = l.queue.get(p).map_or(t, |w| w.arrived);
                l.queue.remove(p);
                l.hold(cpu, mode, arrived);
                self.stats.acquires += 1;
                return Acquire::Now;
            }
            if let Some(w) = l.queue.get_mut(p) {
                w.woken_at = None;
            }
            return Acquire::Queued;
        }
        let may_enter = match (policy, l.queue.front()) {
            (_, None) => true,
            (LockPolicy::Fifo, Some(_)) => false,
            // parking_lot: a running CPU takes a free lock before the woken head wakes, but a
            // reader never passes a waiting writer (task-fair readers).
            (LockPolicy::Barging, Some(head)) => {
                head.woken_at.is_some_and(|w| t < w)
                    && t >= l.released_at
                    && (mode == LockMode::Exclusive || !l.writer_waits())
            }
        };
        if !(may_enter && l.compatible(mode)) {
            l.queue.push_back(Waiter {
                cpu,
                mode,
                woken_at: None,
                arrived: t,
            });
            self.stats.queued += 1;
            return Acquire::Queued;
        }
        self.stats.acquires += 1;
        if !l.queue.is_empty() {
            self.stats.barged += 1;
        }
        let at = if l.free() {
            l.past.fit(t, 0, mode == LockMode::Exclusive, handoff)
        } else {
            t
        };
        l.hold(cpu, mode, t);
        if at > t {
            Acquire::At(at)
        } else {
            Acquire::Now
        }
    }

    /// A re-acquire by the CPU that released at this very time, under `barging`, is
    /// `parking_lot`'s `bump` (an `unlock_fair` and a lock, the only way the engine releases
    /// and re-takes with nothing in between): the woken head gets the lock at its wake-up, and
    /// the bumping CPU queues behind it instead of barging.
    fn bump(&mut self, cpu: usize, addr: usize, t: u64, out: &mut Vec<Handover>) {
        let Some(l) = self.map.get_mut(&addr) else {
            return;
        };
        let woken_head = l.queue.front().is_some_and(|w| w.woken_at.is_some());
        if self.policy != LockPolicy::Barging
            || l.last_releaser != Some(cpu)
            || t != l.released_at
            || !l.free()
            || !woken_head
        {
            return;
        }
        l.last_releaser = None;
        while let Some(&Waiter {
            cpu: w,
            mode,
            woken_at: Some(at),
            arrived,
        }) = l.queue.front()
        {
            if !l.compatible(mode) {
                break;
            }
            l.queue.pop_front();
            l.hold(w, mode, arrived);
            self.stats.acquires += 1;
            out.push(Handover {
                cpu: w,
                at,
                granted: true,
            });
        }
    }

    /// `cpu` released the lock at `t`; the waiters it lets go are appended to `out`.
    pub(crate) fn release(
        &mut self,
        cpu: usize,
        addr: usize,
        mode: LockMode,
        t: u64,
        out: &mut Vec<Handover>,
    ) {
        let Some(l) = self.map.get_mut(&addr) else {
            self.stats.stray_releases += 1;
            return;
        };
        let held = match mode {
            LockMode::Exclusive if l.writer == Some(cpu) => {
                l.writer = None;
                true
            }
            LockMode::Exclusive => false,
            LockMode::Shared => match l.readers.iter().position(|&r| r == cpu) {
                Some(i) => {
                    l.readers.swap_remove(i);
                    true
                }
                None => false,
            },
        };
        if !held {
            self.stats.stray_releases += 1;
            return;
        }
        l.released_at = l.released_at.max(t);
        l.last_releaser = Some(cpu);
        if l.free() {
            let floor = self.floor;
            self.stats.calendar_evictions += l.past.insert(l.busy_from, t, l.busy_writer, floor);
        }
        if !l.free() || l.queue.is_empty() {
            return;
        }
        let fair = match self.policy {
            LockPolicy::Fifo => true,
            LockPolicy::Barging => t >= l.last_fair.saturating_add(self.fair_every),
        };
        let at = t.saturating_add(self.handoff);
        let n = l.head_group();
        if fair {
            if self.policy == LockPolicy::Barging {
                l.last_fair = t;
            }
            for _ in 0..n {
                if let Some(w) = l.queue.pop_front() {
                    l.hold(w.cpu, w.mode, w.arrived);
                    self.stats.acquires += 1;
                    out.push(Handover {
                        cpu: w.cpu,
                        at,
                        granted: true,
                    });
                }
            }
        } else {
            for w in l.queue.iter_mut().take(n) {
                if w.woken_at.is_none() {
                    w.woken_at = Some(at);
                    out.push(Handover {
                        cpu: w.cpu,
                        at,
                        granted: false,
                    });
                }
            }
        }
    }

    /// Removes an exited CPU from every queue (it will never take those locks).
    pub(crate) fn forget_cpu(&mut self, cpu: usize) {
        for l in self.map.values_mut() {
            l.queue.retain(|w| w.cpu != cpu);
        }
    }

    /// Who holds the lock at `addr` and how many wait, for deadlock reports.
    pub(crate) fn describe(&self, addr: usize) -> String {
        match self.map.get(&addr) {
            None => "not held".to_string(),
            Some(l) => format!(
                "writer {:?}, readers {:?}, {} queued",
                l.writer,
                l.readers,
                l.queue.len()
            ),
        }
    }

    pub(crate) fn stats(&self) -> LockStats {
        self.stats
    }

    /// Forgets free, unqueued locks released more than `retention` ago (bounded memory for
    /// code that takes many short-lived locks).
    fn sweep(&mut self, now: u64) {
        if now < self.next_sweep {
            return;
        }
        let keep_after = now.saturating_sub(self.retention);
        self.map
            .retain(|_, l| !(l.free() && l.queue.is_empty() && l.released_at < keep_after));
        self.next_sweep = now.saturating_add(self.retention);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LockMode::{Exclusive as X, Shared as S};

    fn fifo() -> Locks {
        Locks::new(LockPolicy::Fifo, 50, 500_000, 1_000_000_000)
    }

    #[test]
    fn fifo_hands_over_in_order() {
        let mut m = fifo();
        let mut out = Vec::new();
        assert_eq!(m.acquire(0, 8, X, 0, &mut out), Acquire::Now);
        assert_eq!(m.acquire(1, 8, X, 1, &mut out), Acquire::Queued);
        assert_eq!(m.acquire(2, 8, X, 2, &mut out), Acquire::Queued);
        m.release(0, 8, X, 100, &mut out);
        assert_eq!(
            out,
            [Handover {
                cpu: 1,
                at: 150,
                granted: true
            }]
        );
        out.clear();
        m.release(1, 8, X, 200, &mut out);
        assert_eq!(
            out,
            [Handover {
                cpu: 2,
                at: 250,
                granted: true
            }]
        );
    }

    #[test]
    fn readers_enter_together_and_a_waiting_writer_blocks_later_readers() {
        let mut m = fifo();
        let mut out = Vec::new();
        assert_eq!(m.acquire(0, 8, S, 0, &mut out), Acquire::Now);
        assert_eq!(m.acquire(1, 8, S, 1, &mut out), Acquire::Now);
        assert_eq!(m.acquire(2, 8, X, 2, &mut out), Acquire::Queued);
        assert_eq!(m.acquire(3, 8, S, 3, &mut out), Acquire::Queued);
        assert_eq!(m.acquire(4, 8, S, 4, &mut out), Acquire::Queued);
        m.release(0, 8, S, 10, &mut out);
        assert!(out.is_empty());
        m.release(1, 8, S, 20, &mut out);
        assert_eq!(
            out,
            [Handover {
                cpu: 2,
                at: 70,
                granted: true
            }]
        );
        out.clear();
        m.release(2, 8, X, 100, &mut out);
        let cpus: Vec<_> = out.iter().map(|h| h.cpu).collect();
        assert_eq!(cpus, [3, 4]);
    }

    #[test]
    fn a_late_arrival_waits_for_the_release_it_preceded() {
        let mut m = fifo();
        let mut out = Vec::new();
        assert_eq!(m.acquire(0, 8, X, 0, &mut out), Acquire::Now);
        m.release(0, 8, X, 100, &mut out);
        assert_eq!(m.acquire(1, 8, X, 40, &mut out), Acquire::At(150));
    }

    #[test]
    fn an_arrival_before_the_busy_period_went_first() {
        let mut m = fifo();
        let mut out = Vec::new();
        assert_eq!(m.acquire(0, 8, X, 1000, &mut out), Acquire::Now);
        m.release(0, 8, X, 1100, &mut out);
        assert_eq!(m.acquire(1, 8, X, 10, &mut out), Acquire::Now);
    }

    #[test]
    fn a_late_reader_after_readers_did_not_wait() {
        let mut m = fifo();
        let mut out = Vec::new();
        assert_eq!(m.acquire(0, 8, S, 0, &mut out), Acquire::Now);
        m.release(0, 8, S, 100, &mut out);
        assert_eq!(m.acquire(1, 8, S, 40, &mut out), Acquire::Now);
        m.release(1, 8, S, 140, &mut out);
        assert_eq!(m.acquire(2, 8, X, 40, &mut out), Acquire::At(190));
    }

    #[test]
    fn barging_lets_a_running_cpu_overtake_a_woken_waiter() {
        let mut m = Locks::new(LockPolicy::Barging, 1000, 500_000, 1_000_000_000);
        let mut out = Vec::new();
        assert_eq!(m.acquire(0, 8, X, 0, &mut out), Acquire::Now);
        assert_eq!(m.acquire(1, 8, X, 10, &mut out), Acquire::Queued);
        // The first release after start is fair only once fair_every has passed.
        m.release(0, 8, X, 100, &mut out);
        assert_eq!(
            out,
            [Handover {
                cpu: 1,
                at: 1100,
                granted: false
            }]
        );
        assert_eq!(m.acquire(0, 8, X, 200, &mut out), Acquire::Now); // barges
        assert_eq!(m.acquire(1, 8, X, 1100, &mut out), Acquire::Queued); // retry fails
        out.clear();
        m.release(0, 8, X, 600_000, &mut out); // fair: direct hand-off
        assert_eq!(
            out,
            [Handover {
                cpu: 1,
                at: 601_000,
                granted: true
            }]
        );
        assert_eq!(m.stats().barged, 1);
    }

    #[test]
    fn a_bump_under_barging_hands_over_fairly() {
        let mut m = Locks::new(LockPolicy::Barging, 1000, 500_000, 1_000_000_000);
        let mut out = Vec::new();
        assert_eq!(m.acquire(0, 8, X, 0, &mut out), Acquire::Now);
        assert_eq!(m.acquire(1, 8, X, 10, &mut out), Acquire::Queued);
        m.release(0, 8, X, 100, &mut out);
        out.clear();
        // Re-taken at the release's own time: a bump, not a barge.
        assert_eq!(m.acquire(0, 8, X, 100, &mut out), Acquire::Queued);
        assert_eq!(
            out,
            [Handover {
                cpu: 1,
                at: 1100,
                granted: true
            }]
        );
        out.clear();
        m.release(1, 8, X, 2000, &mut out);
        assert_eq!(
            out,
            [Handover {
                cpu: 0,
                at: 3000,
                granted: false
            }]
        );
    }

    #[test]
    fn stray_releases_are_counted_not_fatal() {
        let mut m = fifo();
        let mut out = Vec::new();
        m.release(3, 8, X, 0, &mut out);
        assert_eq!(m.acquire(0, 8, S, 0, &mut out), Acquire::Now);
        m.release(1, 8, S, 0, &mut out);
        assert_eq!(m.stats().stray_releases, 2);
        assert!(out.is_empty());
    }
}
