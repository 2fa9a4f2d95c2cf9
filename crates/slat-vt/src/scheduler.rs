//! The baton (docs/design/virtual-time.md §2): every simulated CPU is an OS thread with its own
//! clock, exactly one holds the baton and runs, and the next to run is the lowest
//! `(clock, rank)` runnable CPU.
//!
//! The state sits behind one mutex that the simulation does not model. A CPU gives the baton
//! away only inside a hook: when it is more than the lookahead ahead of the lowest runnable
//! clock (checked before the hook's event, so the event happens in virtual-time order up to
//! the lookahead), when it blocks, detaches or exits. It then unparks the next holder and
//! parks until it holds the baton again.

use std::cell::Cell;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Arc;
use std::thread::Thread;

use parking_lot::{Mutex, MutexGuard};
use slat::clock::{Cost, LockMode};

use crate::error::SimError;
use crate::model::line::{LineCosts, Lines};
use crate::model::lock::{Handover, Locks};
use crate::model::store_buffer::StoreBuffer;
use crate::model::versions::Versions;
use crate::model::FastHash;
use crate::profile::{LockPolicy, Profile};

/// What a blocked CPU waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Wait {
    /// The lock model to grant the lock at `addr`.
    Lock { addr: usize, mode: LockMode },
    /// A read-modify-write on one of these lines (none listed: on any line).
    Spin { lines: Vec<u64> },
    /// A signal on a condition variable or barrier.
    Event { key: usize, what: &'static str },
}

/// A simulated CPU's scheduling state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    Runnable,
    Blocked(Wait),
    Detached,
    Exited,
}

#[derive(Debug)]
pub(crate) struct Cpu {
    pub(crate) name: String,
    pub(crate) rank: u64,
    /// Virtual time in ps. While the CPU runs, its thread's [`Bound::clock`] is newer.
    pub(crate) clock: u64,
    pub(crate) state: State,
    pub(crate) thread: Option<Thread>,
    /// Its thread's CPU-time clock, once attached (the watchdog tells work from a block).
    pub(crate) cpu_clock: Option<libc::clockid_t>,
    /// A lock was handed to it directly while it waited.
    pub(crate) granted: bool,
    /// Late transfers it owes (ps), added to its clock at its own next hook: where it is in
    /// simulation order then is fixed, whatever it was doing in real time when it was found
    /// owing (a detached CPU re-attaches at a real moment).
    pub(crate) owed: u64,
    /// Its plain stores still completing (`model/store_buffer.rs`).
    pub(crate) stores: StoreBuffer,
    /// Its clock at its previous scheduler call (whether it advanced since).
    entered_at: u64,
    /// It only reads and sleeps ([`crate::Sim::register_observer`]): it can never wake a
    /// blocked CPU, so it does not keep a deadlock from being one.
    pub(crate) observer: bool,
}

/// Whom to unpark once the state's mutex is released.
#[must_use]
pub(crate) enum Unpark {
    None,
    One(Thread),
    All(Vec<Thread>),
}

impl Unpark {
    pub(crate) fn run(self) {
        match self {
            Unpark::None => {}
            Unpark::One(t) => t.unpark(),
            Unpark::All(ts) => ts.iter().for_each(Thread::unpark),
        }
    }
}

/// The scheduler's and models' state.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) cpus: Vec<Cpu>,
    /// Runnable CPUs other than the baton holder, by `(clock, rank, index)`.
    ready: BTreeSet<(u64, u64, usize)>,
    pub(crate) baton: Option<usize>,
    pub(crate) lines: Lines,
    pub(crate) locks: Locks,
    pub(crate) versions: Versions,
    watchers: HashMap<u64, Vec<usize>, FastHash>,
    /// Spinners that listed no line: any RMW wakes them.
    any_watchers: Vec<usize>,
    pub(crate) events: HashMap<usize, VecDeque<usize>, FastHash>,
    pub(crate) failed: Option<SimError>,
    /// Scheduler calls so far (the watchdog's heartbeat).
    pub(crate) calls: u64,
    pub(crate) switches: u64,
    /// [`Cost`] charges so far, by [`Cost::ALL`] index, of CPUs that stopped running (each
    /// running CPU counts its own in [`Bound::charges`] and adds them here when it stops).
    pub(crate) charges: [u64; Cost::ALL.len()],
    pub(crate) lookahead: u64,
    pub(crate) handovers: Vec<Handover>,
    /// The baton holder is blocked outside the simulation on purpose ([`crate::hold_while`]):
    /// the watchdog lets it be.
    pub(crate) holding_outside: bool,
    /// Scheduler calls in a row at which the calling CPU's clock had not advanced since its
    /// previous one ([`STILL_CALLS`]).
    still: u64,
}

/// Scheduler calls in a row without the calling CPU's clock advancing after which the
/// simulation fails ([`SimError::Stalled`]). Every cost of a real profile is charged on the
/// way between two calls, so only a profile that makes the simulated work free gets near
/// this (tens of millions of calls, seconds of wall time); with one, a wait for virtual
/// time (a harvest interval, a sampler) would never end.
pub(crate) const STILL_CALLS: u64 = 1 << 25;

/// One simulation's state, shared by its CPUs' threads, the `Sim` and the watchdog.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) inner: Mutex<Inner>,
    /// Every [`Cost`] in ps, indexed like [`Cost::ALL`].
    pub(crate) costs: [u64; Cost::ALL.len()],
    /// Every [`Cost`]'s overlap credit in ps (a negative fault-path cost), indexed likewise.
    pub(crate) credits: [u64; Cost::ALL.len()],
    pub(crate) profile: Profile,
    pub(crate) seed: u64,
    pub(crate) transfer: u64,
    pub(crate) rmw_local: u64,
}

/// How a thread bound to a CPU behaves in hooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// It holds the baton: hooks are simulated.
    Running,
    /// Outside the simulation (`detach`): hooks are foreign calls.
    Detached,
    /// The simulation failed: hooks behave as real time.
    Failed,
}

/// A thread's binding to its simulated CPU (thread-local, see `virtual_clock`).
#[derive(Debug)]
pub(crate) struct Bound {
    pub(crate) shared: Arc<Shared>,
    pub(crate) idx: usize,
    /// The CPU's clock while it runs: `charge` adds here without taking the mutex.
    pub(crate) clock: Cell<u64>,
    pub(crate) mode: Cell<Mode>,
    /// Charges since the CPU last stopped running, by [`Cost::ALL`] index (no lock taken).
    pub(crate) charges: [Cell<u64>; Cost::ALL.len()],
    /// Overlap credit left, ps: set by a fault path's negative cost, used up by the charges
    /// after it (`Virtual::charge`).
    pub(crate) credit: Cell<u64>,
}

impl Bound {
    /// A binding of CPU `idx` of `shared`, running.
    pub(crate) fn new(shared: Arc<Shared>, idx: usize) -> Bound {
        Bound {
            shared,
            idx,
            clock: Cell::new(0),
            mode: Cell::new(Mode::Running),
            charges: Default::default(),
            credit: Cell::new(0),
        }
    }

    /// Moves this CPU's charge counts into the simulation's (it stops running: yields, blocks,
    /// exits, detaches; or [`crate::Sim::stats`] asks on its thread).
    pub(crate) fn flush_charges(&self, g: &mut Inner) {
        for (total, c) in g.charges.iter_mut().zip(&self.charges) {
            *total = total.saturating_add(c.take());
        }
    }
}

/// The calling thread's CPU-time clock (user and system time).
pub(crate) fn thread_cpu_clock() -> Option<libc::clockid_t> {
    let mut id: libc::clockid_t = 0;
    // SAFETY: `pthread_self` is always valid for the calling thread; `id` is a valid place
    // to write.
    let rc = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
    (rc == 0).then_some(id)
}

/// The CPU time, ns, of the thread whose clock is `id` (alive: the caller makes sure).
pub(crate) fn cpu_time_ns(id: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid place to write; an invalid `id` is an error return, not UB.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let ns = u64::try_from(ts.tv_nsec).ok()?;
    (rc == 0).then(|| secs.saturating_mul(1_000_000_000).saturating_add(ns))
}

/// A bijective mix of 64 bits (xor-shift-multiply rounds): distinct indices get distinct
/// ranks under any seed.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 31;
    x = x.wrapping_mul(0x7fb5_d329_728e_a185);
    x ^= x >> 27;
    x = x.wrapping_mul(0x81da_def4_bc2d_d44d);
    x ^ (x >> 33)
}

/// The tie-break rank of the CPU registered `idx`-th: registration order for seed 0, a
/// seed-determined permutation of it otherwise.
pub(crate) fn rank(seed: u64, idx: usize) -> u64 {
    if seed == 0 {
        idx as u64
    } else {
        mix(idx as u64 ^ mix(seed))
    }
}

impl Shared {
    pub(crate) fn new(profile: Profile, seed: u64) -> Shared {
        let m = &profile.model;
        let policy = m.lock_policy.policy;
        let handoff = match policy {
            LockPolicy::Fifo => m.line_transfer.ps(),
            LockPolicy::Barging => m.handoff.ps(),
        };
        let lines = Lines::new(LineCosts {
            rmw_local: m.rmw_local.ps(),
            transfer: m.line_transfer.ps(),
            invalidate: m.invalidate.ps(),
            dram_miss: m.dram_miss.ps(),
            dram_stream: m.dram_stream.as_ref().map_or(m.dram_miss.ps(), |e| e.ps()),
            retention: m.retention.ps(),
        });
        let locks = Locks::new(policy, handoff, m.fair_every.ps(), m.retention.ps());
        let inner = Inner {
            cpus: Vec::new(),
            ready: BTreeSet::new(),
            baton: None,
            lines,
            locks,
            versions: Versions::new(m.retention.ps()),
            watchers: HashMap::default(),
            any_watchers: Vec::new(),
            events: HashMap::default(),
            failed: None,
            calls: 0,
            switches: 0,
            charges: [0; Cost::ALL.len()],
            lookahead: m.lookahead.ps(),
            handovers: Vec::new(),
            holding_outside: false,
            still: 0,
        };
        Shared {
            inner: Mutex::new(inner),
            costs: profile.cost_table(),
            credits: profile.credit_table(),
            transfer: m.line_transfer.ps(),
            rmw_local: m.rmw_local.ps(),
            profile,
            seed,
        }
    }

    /// Takes the state for a hook of the running CPU `b`, its clock written back; `None` if
    /// the simulation failed (the thread then behaves as real time).
    pub(crate) fn enter(&self, b: &Bound) -> Option<MutexGuard<'_, Inner>> {
        let mut g = self.inner.lock();
        if g.failed.is_some() {
            b.mode.set(Mode::Failed);
            return None;
        }
        g.calls += 1;
        if let Some(c) = g.cpus.get_mut(b.idx) {
            c.clock = b.clock.get().saturating_add(std::mem::take(&mut c.owed));
            let advanced = c.clock > c.entered_at;
            c.entered_at = c.clock;
            g.still = if advanced { 0 } else { g.still + 1 };
        }
        if g.still >= STILL_CALLS {
            let (calls, report) = (g.still, g.report());
            let u = g.fail(SimError::Stalled { calls, report });
            drop(g);
            u.run();
            b.mode.set(Mode::Failed);
            return None;
        }
        g.forget_freed();
        Some(g)
    }

    /// Ends a hook: the thread's clock takes the state's (a wait may have moved it).
    pub(crate) fn leave(&self, g: MutexGuard<'_, Inner>, b: &Bound) {
        if let Some(c) = g.cpus.get(b.idx) {
            b.clock.set(c.clock);
        }
    }

    /// Parks until `b`'s CPU holds the baton; `None` if the simulation failed meanwhile.
    pub(crate) fn wait_baton(&self, b: &Bound) -> Option<MutexGuard<'_, Inner>> {
        loop {
            let g = self.inner.lock();
            if g.failed.is_some() {
                b.mode.set(Mode::Failed);
                return None;
            }
            if g.baton == Some(b.idx) {
                if let Some(c) = g.cpus.get(b.idx) {
                    b.clock.set(c.clock);
                }
                return Some(g);
            }
            drop(g);
            std::thread::park();
        }
    }

    /// The scheduling point of every synchronising hook: gives the baton away if this CPU is
    /// more than the lookahead ahead of the lowest runnable clock.
    pub(crate) fn yield_if_ahead<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        b: &Bound,
    ) -> Option<MutexGuard<'a, Inner>> {
        let me = b.idx;
        let Some(cpu) = g.cpus.get(me) else {
            return Some(g);
        };
        let (t, rank) = (cpu.clock, cpu.rank);
        match g.ready.first() {
            Some(&(low, _, _)) if t > low.saturating_add(g.lookahead) => {}
            _ => return Some(g),
        }
        g.ready.insert((t, rank, me));
        b.flush_charges(&mut g);
        let next = g.dispatch();
        drop(g);
        next.run();
        self.wait_baton(b)
    }

    /// Blocks `b`'s CPU on `wait`, passes the baton, and returns once it holds it again.
    pub(crate) fn block<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        b: &Bound,
        wait: Wait,
    ) -> Option<MutexGuard<'a, Inner>> {
        if let Wait::Spin { lines } = &wait {
            g.watch(b.idx, lines);
        }
        if let Some(c) = g.cpus.get_mut(b.idx) {
            c.state = State::Blocked(wait);
        }
        b.flush_charges(&mut g);
        let next = g.dispatch();
        drop(g);
        next.run();
        self.wait_baton(b)
    }
}

impl Inner {
    /// Makes CPU `i` runnable no earlier than `at`, a time a simulated event set (a release,
    /// a write it waited for): the late transfers it owes were paid before it waited, so
    /// they delay it only past `at` if they took longer than the wait.
    pub(crate) fn make_ready(&mut self, i: usize, at: u64) {
        self.ready_cpu(i, at, true);
    }

    /// Makes CPU `i` runnable no earlier than `at`, a time from outside the simulation (a
    /// re-attach, whose real moment is not in simulation order): what it owes stays owed,
    /// added at its next hook, so the result does not depend on that moment.
    pub(crate) fn make_ready_at(&mut self, i: usize, at: u64) {
        self.ready_cpu(i, at, false);
    }

    /// [`make_ready`](Self::make_ready), paying what the CPU owes first if `pay`. The CPU's
    /// clock is its key in `ready`, so it leaves the queue before the clock moves.
    fn ready_cpu(&mut self, i: usize, at: u64, pay: bool) {
        let baton = self.baton;
        let Some(c) = self.cpus.get_mut(i) else {
            return;
        };
        if matches!(c.state, State::Exited) {
            return;
        }
        if c.state == State::Runnable && baton != Some(i) {
            self.ready.remove(&(c.clock, c.rank, i));
        }
        if pay {
            c.clock = c.clock.saturating_add(std::mem::take(&mut c.owed));
        }
        c.clock = c.clock.max(at);
        c.state = State::Runnable;
        if baton != Some(i) {
            self.ready.insert((c.clock, c.rank, i));
        }
    }

    /// Adds a CPU registered at `clock` (runnable from the start: a fixed order, whenever its
    /// thread attaches).
    pub(crate) fn add_cpu(&mut self, name: String, seed: u64, clock: u64) -> usize {
        let idx = self.cpus.len();
        let rank = rank(seed, idx);
        self.cpus.push(Cpu {
            name,
            rank,
            clock,
            state: State::Runnable,
            thread: None,
            cpu_clock: None,
            granted: false,
            owed: 0,
            stores: StoreBuffer::default(),
            entered_at: clock,
            observer: false,
        });
        self.ready.insert((clock, rank, idx));
        idx
    }

    /// The baton holder gives it up (it already is in `ready`, blocked, detached or exited):
    /// the lowest runnable CPU gets it. With none runnable, some blocked and none outside
    /// the simulation, nothing can ever run again: the simulation fails.
    pub(crate) fn dispatch(&mut self) -> Unpark {
        self.baton = None;
        self.raise_floor();
        if let Some((_, _, j)) = self.ready.pop_first() {
            if self.cpus.get(j).is_some_and(|c| c.observer) && self.only_observers_can_run() {
                let report = self.report();
                return self.fail(SimError::Deadlock { report });
            }
            self.baton = Some(j);
            self.switches += 1;
            return match self.cpus.get(j).and_then(|c| c.thread.clone()) {
                Some(t) => Unpark::One(t),
                None => Unpark::None, // not attached yet: `attach` finds the baton
            };
        }
        let blocked = self
            .cpus
            .iter()
            .any(|c| matches!(c.state, State::Blocked(_)));
        let outside = self.cpus.iter().any(|c| c.state == State::Detached);
        if blocked && !outside {
            let report = self.report();
            return self.fail(SimError::Deadlock { report });
        }
        Unpark::None
    }

    /// Every CPU but the observers is blocked or gone, some blocked, none outside the
    /// simulation: the observers would run on through virtual time (a sampler ticking
    /// forever) while nothing they do can wake the others.
    fn only_observers_can_run(&self) -> bool {
        let mut blocked = false;
        for c in self.cpus.iter().filter(|c| !c.observer) {
            match c.state {
                State::Blocked(_) => blocked = true,
                State::Runnable | State::Detached => return false,
                State::Exited => {}
            }
        }
        blocked
    }

    /// Makes the models forget the blocks the calling thread freed since its last hook
    /// (`freed.rs`), before any other CPU runs and can be given that memory.
    pub(crate) fn forget_freed(&mut self) {
        let Inner {
            lines,
            locks,
            versions,
            ..
        } = self;
        let all = crate::freed::take(|addr, size| {
            lines.forget(addr, size);
            locks.forget(addr, size);
            versions.forget(addr, size);
        });
        if all.is_err() {
            lines.forget_idle();
            locks.forget_idle();
            versions.forget_idle(lines.floor());
        }
    }

    /// A plain store of CPU `i` issues now: its clock moves only if its store buffer is full
    /// (to when the oldest entry completes). Returns when the store's line write starts,
    /// `None` for no such CPU.
    pub(crate) fn issue_store(&mut self, i: usize) -> Option<u64> {
        let c = self.cpus.get_mut(i)?;
        let (go, start) = c.stores.issue(c.clock);
        c.clock = go;
        Some(start)
    }

    /// CPU `i` executes a locked instruction, fence or lock operation: its clock moves to
    /// when its buffered stores have completed. Returns the clock, `None` for no such CPU.
    pub(crate) fn drain_stores(&mut self, i: usize) -> Option<u64> {
        let c = self.cpus.get_mut(i)?;
        c.clock = c.stores.drain(c.clock);
        Some(c.clock)
    }

    /// Records against each CPU the line model found owing a late transfer (a write that
    /// arrived after that CPU's later writes to the line, `model/owners.rs`) the transfer's
    /// cost. It has run past the write that owed it: the cost is added to its clock at its own
    /// next hook, or when a simulated event wakes it (`make_ready`), never here, where the
    /// CPU might be re-attaching at a real moment.
    pub(crate) fn settle_late_transfers(&mut self) {
        while let Some((i, cost)) = self.lines.pop_owed() {
            if let Some(c) = self.cpus.get_mut(i) {
                c.owed = c.owed.saturating_add(cost);
            }
        }
    }

    /// Tells the models the floor: the lowest clock of the CPUs that run or will rejoin on
    /// their own (runnable or detached). No clock goes back, a detached CPU rejoins at its own
    /// clock or later, and a blocked CPU wakes at a time a running CPU's release or write
    /// set, so no request can come before the floor (busy intervals that ended by then can
    /// go). Blocked CPUs are left out because one parked for a whole phase (a thread waiting
    /// for the vCPUs) would hold the floor back and every calendar would grow. Once per
    /// switch: a stale floor is lower, which only keeps more.
    fn raise_floor(&mut self) {
        let floor = self
            .cpus
            .iter()
            .filter(|c| matches!(c.state, State::Runnable | State::Detached))
            .map(|c| c.clock)
            .min();
        if let Some(f) = floor {
            self.lines.set_floor(f);
            self.locks.set_floor(f);
        }
    }

    /// Dispatches if nobody holds the baton (a CPU became runnable from outside a hook).
    pub(crate) fn kick(&mut self) -> Unpark {
        if self.baton.is_none() && self.failed.is_none() {
            self.dispatch()
        } else {
            Unpark::None
        }
    }

    /// Records the failure (the first one stays) and wakes every thread: their hooks then see
    /// it and behave as real time.
    pub(crate) fn fail(&mut self, e: SimError) -> Unpark {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
        self.baton = None;
        Unpark::All(self.cpus.iter().filter_map(|c| c.thread.clone()).collect())
    }

    /// CPU `i` leaves the simulation for good.
    pub(crate) fn exit(&mut self, i: usize) -> Unpark {
        let Some(c) = self.cpus.get_mut(i) else {
            return Unpark::None;
        };
        let old = std::mem::replace(&mut c.state, State::Exited);
        c.thread = None;
        c.cpu_clock = None;
        let key = (c.clock, c.rank, i);
        match old {
            State::Exited => return Unpark::None,
            State::Runnable => {
                self.ready.remove(&key);
            }
            State::Blocked(Wait::Spin { lines }) => self.unwatch(i, &lines),
            State::Blocked(Wait::Event { key, .. }) => {
                if let Some(q) = self.events.get_mut(&key) {
                    q.retain(|&w| w != i);
                }
            }
            State::Blocked(Wait::Lock { .. }) | State::Detached => {}
        }
        self.locks.forget_cpu(i);
        if self.baton == Some(i) {
            self.dispatch()
        } else {
            self.kick()
        }
    }

    fn watch(&mut self, i: usize, lines: &[u64]) {
        if lines.is_empty() {
            self.any_watchers.push(i);
        }
        for &l in lines {
            self.watchers.entry(l).or_default().push(i);
        }
    }

    fn unwatch(&mut self, i: usize, lines: &[u64]) {
        self.any_watchers.retain(|&w| w != i);
        for l in lines {
            if let Some(v) = self.watchers.get_mut(l) {
                v.retain(|&w| w != i);
                if v.is_empty() {
                    self.watchers.remove(l);
                }
            }
        }
    }

    /// A read-modify-write on `line` completed at `at`: spinners watching it re-evaluate
    /// their condition once the line has reached them.
    pub(crate) fn wake_watchers(&mut self, line: u64, at: u64, transfer: u64) {
        if self.any_watchers.is_empty() && !self.watchers.contains_key(&line) {
            return;
        }
        let mut woken = self.watchers.remove(&line).unwrap_or_default();
        woken.append(&mut self.any_watchers);
        for w in woken {
            let lines = match self.cpus.get_mut(w).map(|c| &mut c.state) {
                Some(State::Blocked(Wait::Spin { lines })) => std::mem::take(lines),
                _ => continue,
            };
            self.unwatch(w, &lines);
            self.make_ready(w, at.saturating_add(transfer));
        }
    }

    /// Every CPU's clock and state, one line each (deadlock and watchdog reports).
    pub(crate) fn report(&self) -> String {
        let mut s = String::new();
        for (i, c) in self.cpus.iter().enumerate() {
            let what = match &c.state {
                State::Runnable if self.baton == Some(i) => "running (holds the baton)".into(),
                State::Runnable => "runnable".into(),
                State::Detached => "detached (waiting outside the simulation)".into(),
                State::Exited => "exited".into(),
                State::Blocked(Wait::Lock { addr, mode }) => format!(
                    "blocked on lock {addr:#x} ({mode:?}; {})",
                    self.locks.describe(*addr)
                ),
                State::Blocked(Wait::Spin { lines }) if lines.is_empty() => {
                    "spinning until any line is written".into()
                }
                State::Blocked(Wait::Spin { lines }) => {
                    let addrs: Vec<String> =
                        lines.iter().map(|l| format!("{:#x}", l << 6)).collect();
                    format!(
                        "spinning until a line nobody has written since is written: {}",
                        addrs.join(", ")
                    )
                }
                State::Blocked(Wait::Event { key, what }) => format!("waiting on {what} #{key}"),
            };
            let _ = writeln!(
                s,
                "  cpu {i} `{}` at {}.{:03} ns: {what}",
                c.name,
                c.clock / 1000,
                c.clock % 1000
            );
        }
        s
    }
}
