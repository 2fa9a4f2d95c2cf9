//! The hooks of a running simulated CPU: each is a scheduling point (the CPU may yield first),
//! then an event of the contention model at the CPU's clock. None yields after its event, so
//! the real operation that follows a hook happens before any other CPU runs.

use slat::clock::LockMode;

use crate::model::line::Lines;
use crate::model::lock::{Acquire, Handover};
use crate::scheduler::{Bound, Inner, Shared, State, Wait};

impl Shared {
    /// An atomic RMW on `addr`'s line, once the CPU's buffered stores have completed (a
    /// locked instruction drains the store buffer); wakes the spinners watching it.
    pub(crate) fn rmw(&self, b: &Bound, addr: usize) {
        let Some(g) = self.enter(b) else { return };
        let Some(mut g) = self.yield_if_ahead(g, b) else {
            return;
        };
        let line = Lines::line_of(addr);
        if let Some(t) = g.drain_stores(b.idx) {
            let end = g.lines.rmw(b.idx, t, line);
            g.cpus[b.idx].clock = end;
            g.settle_late_transfers();
            g.wake_watchers(line, end, self.transfer);
        }
        self.leave(g, b);
    }

    /// A plain store to `addr`'s line: it retires into the CPU's store buffer, which the
    /// CPU's next locked instruction waits for; wakes the spinners watching it.
    pub(crate) fn store(&self, b: &Bound, addr: usize) {
        let Some(g) = self.enter(b) else { return };
        let Some(mut g) = self.yield_if_ahead(g, b) else {
            return;
        };
        let line = Lines::line_of(addr);
        if let Some(t) = g.issue_store(b.idx) {
            let end = g.lines.store(b.idx, t, line);
            g.cpus[b.idx].stores.push(end);
            g.settle_late_transfers();
            g.wake_watchers(line, end, self.transfer);
        }
        self.leave(g, b);
    }

    /// A scheduling point with no event (before a mutex the simulation does not model).
    pub(crate) fn schedule_point(&self, b: &Bound) {
        let Some(g) = self.enter(b) else { return };
        if let Some(g) = self.yield_if_ahead(g, b) {
            self.leave(g, b);
        }
    }

    /// A load of `addr`'s line, which other CPUs write.
    pub(crate) fn shared_load(&self, b: &Bound, addr: usize) {
        let Some(g) = self.enter(b) else { return };
        let Some(mut g) = self.yield_if_ahead(g, b) else {
            return;
        };
        if let Some(t) = g.cpus.get(b.idx).map(|c| c.clock) {
            let end = g.lines.load(b.idx, t, Lines::line_of(addr));
            g.cpus[b.idx].clock = end;
            g.settle_late_transfers();
        }
        self.leave(g, b);
    }

    /// After `b`'s write replaced `old` in the entry at `addr` (its clock already counts the
    /// write): kept for walks earlier in virtual time. Not a scheduling point.
    pub(crate) fn entry_replaced(&self, b: &Bound, addr: usize, old: u64) {
        let Some(mut g) = self.enter(b) else { return };
        if let Some(t) = g.cpus.get(b.idx).map(|c| c.clock) {
            let floor = g.lines.floor();
            g.versions.record(b.idx, t, addr, old, floor);
        }
        self.leave(g, b);
    }

    /// A hardware walk's load of the entry at `addr` by `b` (a
    /// [`shared_load`](Self::shared_load) of its line, then `load`): the value memory holds
    /// and the value `b` sees at its clock. If the simulation failed, `load`'s value twice.
    pub(crate) fn walk_load(
        &self,
        b: &Bound,
        addr: usize,
        load: impl FnOnce() -> u64,
    ) -> (u64, u64) {
        let Some(mut g) = self.enter(b).and_then(|g| self.yield_if_ahead(g, b)) else {
            let v = load();
            return (v, v);
        };
        let t = g.cpus.get(b.idx).map_or(0, |c| c.clock);
        let end = g.lines.load(b.idx, t, Lines::line_of(addr));
        if let Some(c) = g.cpus.get_mut(b.idx) {
            c.clock = end;
        }
        g.settle_late_transfers();
        let seen = g.versions.seen(b.idx, end, addr);
        if let (Some(at), Some(c)) = (seen.after, g.cpus.get_mut(b.idx)) {
            c.clock = c.clock.max(at);
        }
        self.leave(g, b);
        // Outside the state lock (`load` is the caller's: a hook inside it must not wait for
        // this one), and still before any other simulated CPU runs: this one holds the baton
        // until its next hook.
        let current = load();
        (current, seen.value_or(current))
    }

    /// A fault handler's read of the entry at `addr` by `b`, which holds `current`: what
    /// `b` sees at its clock (`Versions::seen_by_handler`). Not a scheduling point: the
    /// load it follows was one, and no other CPU has run since.
    pub(crate) fn entry_as_seen(&self, b: &Bound, addr: usize, current: u64) -> u64 {
        let Some(mut g) = self.enter(b) else {
            return current;
        };
        let t = g.cpus.get(b.idx).map_or(0, |c| c.clock);
        let seen = g.versions.seen_by_handler(b.idx, t, addr);
        if let (Some(at), Some(c)) = (seen.after, g.cpus.get_mut(b.idx)) {
            c.clock = c.clock.max(at);
        }
        self.leave(g, b);
        seen.value_or(current)
    }

    /// A guest data access to `addr`'s line in memory several vCPUs access: only the line's
    /// movement between CPUs is priced (the access itself is `Cost::GuestAccess`).
    pub(crate) fn data_access(&self, b: &Bound, addr: usize, write: bool) {
        let Some(g) = self.enter(b) else { return };
        let Some(mut g) = self.yield_if_ahead(g, b) else {
            return;
        };
        let line = Lines::line_of(addr);
        if write {
            // A store: into the store buffer, as `store`.
            if let Some(t) = g.issue_store(b.idx) {
                let end = g.lines.data_write(b.idx, t, line);
                g.cpus[b.idx].stores.push(end);
                g.settle_late_transfers();
                g.wake_watchers(line, end, self.transfer);
            }
        } else if let Some(t) = g.cpus.get(b.idx).map(|c| c.clock) {
            let end = g.lines.data_load(b.idx, t, line);
            g.cpus[b.idx].clock = end;
            g.settle_late_transfers();
        }
        self.leave(g, b);
    }

    /// A sequentially consistent fence: a scheduling point costing a local RMW (a locked
    /// instruction on x86), after the CPU's buffered stores have completed.
    pub(crate) fn fence(&self, b: &Bound) {
        let Some(g) = self.enter(b) else { return };
        let Some(mut g) = self.yield_if_ahead(g, b) else {
            return;
        };
        if let Some(t) = g.drain_stores(b.idx) {
            g.cpus[b.idx].clock = t.saturating_add(self.rmw_local);
        }
        self.leave(g, b);
    }

    /// Waits until the lock model grants the lock at `addr` (the real acquire that follows
    /// then finds it free). A grant at once is an RMW on the lock word's line.
    pub(crate) fn lock(&self, b: &Bound, addr: usize, mode: LockMode) {
        let Some(g) = self.enter(b) else { return };
        let Some(mut g) = self.yield_if_ahead(g, b) else {
            return;
        };
        let me = b.idx;
        let line = Lines::line_of(addr);
        g.drain_stores(me);
        while let Some(t) = g.cpus.get(me).map(|c| c.clock) {
            let mut out = std::mem::take(&mut g.handovers);
            let got = g.locks.acquire(me, addr, mode, t, &mut out);
            self.hand_over(&mut g, addr, &mut out);
            g.handovers = out;
            match got {
                Acquire::Now => {
                    let end = match mode {
                        LockMode::Exclusive => g.lines.rmw_lock_word(me, t, line),
                        LockMode::Shared => g.lines.rmw(me, t, line),
                    };
                    g.cpus[me].clock = end;
                    g.settle_late_transfers();
                    g.wake_watchers(line, end, self.transfer);
                    break;
                }
                Acquire::At(at) => {
                    g.lines.take(me, at, line);
                    g.cpus[me].clock = at.max(t);
                    g.settle_late_transfers();
                    break;
                }
                Acquire::Queued => {
                    g.cpus[me].granted = false;
                    g = match self.block(g, b, Wait::Lock { addr, mode }) {
                        Some(g) => g,
                        None => return,
                    };
                    if std::mem::take(&mut g.cpus[me].granted) {
                        break; // handed over directly, at the clock the release set
                    }
                }
            }
        }
        self.leave(g, b);
    }

    /// After the real release of the lock at `addr`: the release store, then the hand-over
    /// to the waiters the lock model lets go.
    pub(crate) fn unlock(&self, b: &Bound, addr: usize, mode: LockMode) {
        let Some(g) = self.enter(b) else { return };
        let Some(mut g) = self.yield_if_ahead(g, b) else {
            return;
        };
        let me = b.idx;
        let line = Lines::line_of(addr);
        let Some(t) = g.drain_stores(me) else {
            return;
        };
        let end = match mode {
            LockMode::Exclusive => g.lines.rmw_lock_word(me, t, line),
            LockMode::Shared => g.lines.rmw(me, t, line),
        };
        g.cpus[me].clock = end;
        g.settle_late_transfers();
        let mut out = std::mem::take(&mut g.handovers);
        g.locks.release(me, addr, mode, end, &mut out);
        self.hand_over(&mut g, addr, &mut out);
        g.handovers = out;
        g.wake_watchers(line, end, self.transfer);
        self.leave(g, b);
    }

    /// Lets go the waiters of the lock at `addr` the lock model released: each runnable at its
    /// time, holding the lock if it was handed over directly. A woken waiter that has not run
    /// yet (`barging`) may be granted the lock by a bump: it is runnable already.
    fn hand_over(&self, g: &mut Inner, addr: usize, out: &mut Vec<Handover>) {
        let line = Lines::line_of(addr);
        for h in out.drain(..) {
            let state = g.cpus.get(h.cpu).map(|c| &c.state);
            let blocked =
                matches!(state, Some(State::Blocked(Wait::Lock { addr: a, .. })) if *a == addr);
            let granted_early = h.granted && state == Some(&State::Runnable);
            if !(blocked || granted_early) {
                continue;
            }
            if h.granted {
                g.cpus[h.cpu].granted = true;
                g.lines.take(h.cpu, h.at, line);
                g.settle_late_transfers();
            }
            if blocked {
                g.make_ready(h.cpu, h.at);
            }
        }
    }

    /// Waits until `cond()`: evaluated now and after every RMW on a watched line, at the
    /// writer's completion plus a line transfer. Returns `false` if the simulation failed
    /// before `cond` held (the caller then waits in real time).
    pub(crate) fn spin_until(
        &self,
        b: &Bound,
        watch: &[usize],
        cond: &mut dyn FnMut() -> bool,
    ) -> bool {
        let Some(g) = self.enter(b) else { return false };
        let Some(g) = self.yield_if_ahead(g, b) else {
            return false;
        };
        self.leave(g, b);
        let mut lines: Vec<u64> = watch.iter().map(|&a| Lines::line_of(a)).collect();
        lines.sort_unstable();
        lines.dedup();
        loop {
            // No state lock is held while `cond` runs: it may call hooks itself.
            if cond() {
                self.settle(b, &lines);
                return true;
            }
            let Some(g) = self.enter(b) else { return false };
            let Some(g) = self.block(
                g,
                b,
                Wait::Spin {
                    lines: lines.clone(),
                },
            ) else {
                return false;
            };
            self.leave(g, b);
        }
    }

    /// After a spin wait's condition held: the CPU cannot have seen the watched lines' latest
    /// writes by other CPUs before they completed plus a transfer. The writer may have run
    /// past its write before this CPU ran again (within the lookahead, in real order), so
    /// the wake-up at an earlier write of the same line (or none, if the condition held at
    /// once) is not when the data arrived.
    fn settle(&self, b: &Bound, lines: &[u64]) {
        let Some(mut g) = self.enter(b) else { return };
        let seen = lines
            .iter()
            .filter_map(|&l| g.lines.written_by_other(b.idx, l))
            .max();
        if let (Some(w), Some(c)) = (seen, g.cpus.get_mut(b.idx)) {
            c.clock = c.clock.max(w.saturating_add(self.transfer));
        }
        // Its last load of each watched line brought a copy: a write next upgrades it.
        for &l in lines {
            g.lines.joined(b.idx, l);
        }
        self.leave(g, b);
    }

    /// Blocks on event `key` if `still()` (evaluated under the state lock, so a signal cannot
    /// slip between the test and the wait). Returns `false` if the simulation failed.
    pub(crate) fn wait_event(
        &self,
        b: &Bound,
        key: usize,
        what: &'static str,
        still: &dyn Fn() -> bool,
    ) -> bool {
        let Some(mut g) = self.enter(b) else {
            return false;
        };
        // A futex wait is a system call: the store buffer drains first.
        g.drain_stores(b.idx);
        if still() {
            g.events.entry(key).or_default().push_back(b.idx);
            g = match self.block(g, b, Wait::Event { key, what }) {
                Some(g) => g,
                None => return false,
            };
        }
        self.leave(g, b);
        true
    }

    /// Wakes up to `n` waiters of event `key` no earlier than the notifier's clock (`b`: a
    /// running CPU of this simulation; `None`: a thread outside it, whose time is 0). With
    /// `join`, the notifier's clock also moves to the latest waiter's (a barrier: everyone
    /// leaves at the last arrival). Returns how many were woken.
    pub(crate) fn signal(&self, b: Option<&Bound>, key: usize, n: usize, join: bool) -> usize {
        let mut g = self.inner.lock();
        if g.failed.is_some() {
            return 0;
        }
        let mut at = 0;
        if let Some(b) = b {
            g.calls += 1;
            // A wake is a system call: the store buffer drains first.
            at = g
                .cpus
                .get_mut(b.idx)
                .map_or(b.clock.get(), |c| c.stores.drain(b.clock.get()));
            b.clock.set(at);
        }
        let mut woken = Vec::new();
        if let Some(q) = g.events.get_mut(&key) {
            while woken.len() < n {
                let Some(w) = q.pop_front() else { break };
                woken.push(w);
            }
            if q.is_empty() {
                g.events.remove(&key);
            }
        }
        let woken: Vec<usize> = woken
            .into_iter()
            .filter(|&w| matches!(g.cpus.get(w).map(|c| &c.state), Some(State::Blocked(Wait::Event { key: k, .. })) if *k == key))
            .collect();
        if join {
            at = woken
                .iter()
                .filter_map(|&w| g.cpus.get(w))
                .fold(at, |a, c| a.max(c.clock));
            if let Some(b) = b {
                b.clock.set(at);
                g.cpus[b.idx].clock = at;
            }
        }
        for &w in &woken {
            g.make_ready(w, at);
        }
        let u = g.kick();
        drop(g);
        u.run();
        woken.len()
    }
}
