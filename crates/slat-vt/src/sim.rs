//! The public face of a simulation: [`Sim`] registers CPUs and reports; [`CpuHandle`] is one
//! simulated CPU, attached to the thread that runs it.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::SimError;
use crate::model::line::{LineStats, MAX_CPUS};
use crate::model::lock::LockStats;
use crate::model::versions::VersionStats;
use crate::profile::{cost_index, Profile};
use crate::scheduler::{Bound, Mode, Shared, State, Unpark};
use crate::virtual_clock::{bind, bound_to, current, foreign_ops, unbind};
use crate::watchdog::Watchdog;
use slat::clock::Cost;

/// The watchdog's default period: no scheduler call for this long while a CPU holds the
/// baton fails the run.
pub const WATCHDOG: Duration = Duration::from_secs(10);

/// A simulation: a set of simulated CPUs sharing one virtual timeline, a cost profile and a
/// seed.
///
/// # Lifecycle
///
/// 1. `Sim::new(profile, seed)`.
/// 2. The spawning thread registers every CPU in a fixed order ([`register`](Self::register)),
///    each immediately before spawning its thread (no hook in between); the main thread may
///    register itself first (host CPU 0) and [`attach`](CpuHandle::attach) at once.
/// 3. Each spawned thread calls [`CpuHandle::attach`] first; dropping the handle (or
///    [`CpuHandle::exit`]) at the end hands the baton on.
/// 4. A CPU that waits for a thread outside the simulation (a join, a socket) calls
///    [`CpuHandle::detach`] before and [`CpuHandle::attach_at`] after.
/// 5. [`finish`](Self::finish) gives the result: `Err` if the simulation deadlocked, the
///    watchdog fired, or foreign threads called hooks.
///
/// # Failure
///
/// A deadlock (no runnable CPU while some wait) or the watchdog (no scheduler call for
/// [`WATCHDOG`] while a CPU holds the baton) records the error, prints nothing, and wakes
/// every parked thread. From then on every hook of this simulation behaves as real time, so
/// the simulated threads run to their own end (the engine's protocols are correct in real
/// time) and return to their callers, who join them and report [`finish`](Self::finish)'s
/// error (the CLI exits 1). Code with long loops can poll [`failure`](Self::failure) to stop
/// early; a wait on a condition that only a simulated hook would have ended (a model bug)
/// needs such a poll in its condition.
#[derive(Debug)]
pub struct Sim {
    shared: Arc<Shared>,
    foreign_at_start: u64,
    watchdog: Option<(Arc<Watchdog>, JoinHandle<()>)>,
}

/// A simulated CPU's clock and state, for reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuReport {
    /// The name it was registered with.
    pub name: String,
    /// Its virtual time, ns.
    pub clock_ns: u64,
    /// Its virtual time, ps (the exact value).
    pub clock_ps: u64,
    /// `runnable`, `blocked`, `detached` or `exited`.
    pub state: &'static str,
}

/// Counters of a simulation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Scheduler calls (hooks that took the scheduler's lock).
    pub hooks: u64,
    /// Baton hand-overs between threads.
    pub switches: u64,
    /// The cache-line model.
    pub lines: LineStats,
    /// The lock model.
    pub locks: LockStats,
    /// The entry versions walks read (`model/versions.rs`).
    pub versions: VersionStats,
    /// Charges of each [`Cost`], by [`Cost::ALL`] index, up to each CPU's latest stop (a
    /// yield, block, detach or exit; the running CPU adds its own when it stops).
    pub charges: [u64; Cost::ALL.len()],
}

impl SimStats {
    /// How many times `cost` was charged (a charge of `n` units counts `n`).
    pub fn charged(&self, cost: Cost) -> u64 {
        cost_index(cost)
            .and_then(|i| self.charges.get(i).copied())
            .unwrap_or(0)
    }
}

impl Sim {
    /// A simulation with `profile` (validated) and `seed` (0: ties broken in registration
    /// order; otherwise a permutation of it drawn from the seed), watched by a watchdog of
    /// period [`WATCHDOG`].
    pub fn new(profile: Profile, seed: u64) -> Result<Sim, SimError> {
        Sim::with_watchdog(profile, seed, Some(WATCHDOG))
    }

    /// As [`new`](Self::new), with the watchdog's period (`None`: no watchdog).
    pub fn with_watchdog(
        profile: Profile,
        seed: u64,
        period: Option<Duration>,
    ) -> Result<Sim, SimError> {
        profile.validate()?;
        let shared = Arc::new(Shared::new(profile, seed));
        let watchdog = period.and_then(|p| Watchdog::spawn(&shared, p));
        crate::alloc::sim_started();
        Ok(Sim {
            shared,
            foreign_at_start: foreign_ops().0,
            watchdog,
        })
    }

    /// Registers a simulated CPU named `name`, runnable from now at the registering CPU's
    /// clock (0 from a thread outside the simulation). Call it on the spawning thread, in a
    /// fixed order, right before spawning the thread that will attach it.
    pub fn register(&self, name: &str) -> Result<CpuHandle, SimError> {
        let b = bound_to(&self.shared).filter(|b| b.mode.get() == Mode::Running);
        let mut g = self.shared.inner.lock();
        if g.failed.is_some() {
            return Err(SimError::Failed);
        }
        if g.cpus.len() >= MAX_CPUS {
            return Err(SimError::TooManyCpus { max: MAX_CPUS });
        }
        let clock = b.map_or(0, |b| b.clock.get());
        let idx = g.add_cpu(name.to_string(), self.shared.seed, clock);
        Ok(CpuHandle {
            shared: Arc::clone(&self.shared),
            idx,
            exited: Cell::new(false),
        })
    }

    /// [`register`](Self::register)s an observer: a CPU that only reads what the others
    /// write and sleeps (a sampler, a progress timer). It cannot wake a blocked CPU, so when
    /// every other CPU is blocked the simulation fails as deadlocked, where an ordinary
    /// sleeper would keep it running through virtual time forever. An observer that writes
    /// a line another CPU spins on, or releases a lock, breaks this contract: declare such a
    /// CPU with `register`.
    pub fn register_observer(&self, name: &str) -> Result<CpuHandle, SimError> {
        let h = self.register(name)?;
        if let Some(c) = self.shared.inner.lock().cpus.get_mut(h.idx) {
            c.observer = true;
        }
        Ok(h)
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The profile.
    pub fn profile(&self) -> &Profile {
        &self.shared.profile
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.shared.seed
    }

    /// Every CPU's clock and state, in registration order.
    pub fn cpus(&self) -> Vec<CpuReport> {
        let g = self.shared.inner.lock();
        g.cpus
            .iter()
            .map(|c| CpuReport {
                name: c.name.clone(),
                clock_ns: c.clock / 1000,
                clock_ps: c.clock,
                state: match c.state {
                    State::Runnable => "runnable",
                    State::Blocked(_) => "blocked",
                    State::Detached => "detached",
                    State::Exited => "exited",
                },
            })
            .collect()
    }

    /// The latest clock of any CPU, ns: the simulated run's length once all have exited.
    pub fn elapsed_ns(&self) -> u64 {
        let g = self.shared.inner.lock();
        g.cpus.iter().map(|c| c.clock).max().unwrap_or(0) / 1000
    }

    /// Counters so far. Charges count once their CPU stops running (blocks, yields the
    /// baton, detaches or exits); the calling thread's own CPU, if it runs in this
    /// simulation, adds its charges first.
    pub fn stats(&self) -> SimStats {
        let mut g = self.shared.inner.lock();
        if let Some(b) = bound_to(&self.shared).filter(|b| b.mode.get() == Mode::Running) {
            b.flush_charges(&mut g);
        }
        SimStats {
            hooks: g.calls,
            switches: g.switches,
            lines: g.lines.stats(),
            locks: g.locks.stats(),
            versions: g.versions.stats(),
            charges: g.charges,
        }
    }

    /// The failure, if the simulation failed.
    pub fn failure(&self) -> Option<SimError> {
        self.shared.inner.lock().failed.clone()
    }

    /// Every CPU's clock and state, one line each (what a deadlock report prints).
    pub fn report(&self) -> String {
        self.shared.inner.lock().report()
    }

    /// The run's result: its counters, or why it failed (a deadlock, the watchdog, or hook
    /// calls from threads that were not simulated CPUs while this simulation existed).
    pub fn finish(&self) -> Result<SimStats, SimError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let (now, first) = foreign_ops();
        if now > self.foreign_at_start {
            return Err(SimError::Foreign {
                count: now - self.foreign_at_start,
                first: first.map_or_else(|| "?".to_string(), |h| h.to_string()),
            });
        }
        Ok(self.stats())
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        crate::alloc::sim_ended();
        if let Some((w, h)) = self.watchdog.take() {
            w.stop();
            let _ = h.join();
        }
    }
}

impl Shared {
    /// The name of CPU `idx`.
    pub(crate) fn name_of(&self, idx: usize) -> String {
        let g = self.inner.lock();
        g.cpus.get(idx).map_or_else(String::new, |c| c.name.clone())
    }
}

/// One registered simulated CPU. Move it into the thread that runs the CPU and
/// [`attach`](Self::attach) there first; dropping it exits the CPU.
#[derive(Debug)]
pub struct CpuHandle {
    shared: Arc<Shared>,
    idx: usize,
    exited: Cell<bool>,
}

impl CpuHandle {
    /// The CPU's registration index.
    pub fn index(&self) -> usize {
        self.idx
    }

    /// Binds the calling thread to this CPU and waits until it holds the baton. If the
    /// simulation has failed, returns at once and the thread runs in real time.
    pub fn attach(&self) -> Result<(), SimError> {
        let b = Rc::new(Bound::new(Arc::clone(&self.shared), self.idx));
        {
            let mut g = self.shared.inner.lock();
            let fresh = g
                .cpus
                .get(self.idx)
                .is_some_and(|c| c.state == State::Runnable && c.thread.is_none());
            if !fresh {
                drop(g);
                return Err(self.misuse("attach", "already attached or exited"));
            }
            if let Err(old) = bind(Rc::clone(&b)) {
                drop(g);
                let name = old.map_or_else(String::new, |(s, i)| s.name_of(i));
                return Err(SimError::AlreadyAttached(name));
            }
            if let Some(c) = g.cpus.get_mut(self.idx) {
                c.thread = Some(std::thread::current());
                c.cpu_clock = crate::scheduler::thread_cpu_clock();
            }
            let failed = g.failed.is_some();
            let u = g.kick();
            drop(g);
            u.run();
            if failed {
                b.mode.set(Mode::Failed);
                return Ok(());
            }
        }
        if let Some(g) = self.shared.wait_baton(&b) {
            self.shared.leave(g, &b);
        }
        Ok(())
    }

    /// Leaves the simulation to wait for something outside it (another CPU runs meanwhile);
    /// hooks until [`attach_at`](Self::attach_at) are foreign calls.
    pub fn detach(&self) -> Result<(), SimError> {
        let b = self.running_here("detach")?;
        let Some(mut g) = self.shared.enter(&b) else {
            return Ok(());
        };
        b.flush_charges(&mut g);
        if let Some(c) = g.cpus.get_mut(self.idx) {
            c.state = State::Detached;
        }
        b.mode.set(Mode::Detached);
        let u = g.dispatch();
        drop(g);
        u.run();
        Ok(())
    }

    /// Rejoins the simulation after [`detach`](Self::detach), no earlier than `at_ns` (the
    /// CPU's own clock if later), and waits for the baton.
    pub fn attach_at(&self, at_ns: u64) -> Result<(), SimError> {
        let b = bound_to(&self.shared)
            .filter(|b| b.idx == self.idx && b.mode.get() != Mode::Running)
            .ok_or_else(|| self.misuse("attach_at", "not detached on this thread"))?;
        if b.mode.get() == Mode::Failed {
            return Ok(());
        }
        let mut g = self.shared.inner.lock();
        if g.failed.is_some() {
            b.mode.set(Mode::Failed);
            return Ok(());
        }
        g.make_ready_at(self.idx, at_ns.saturating_mul(1000));
        b.mode.set(Mode::Running);
        let u = g.kick();
        drop(g);
        u.run();
        if let Some(g) = self.shared.wait_baton(&b) {
            self.shared.leave(g, &b);
        }
        Ok(())
    }

    /// This CPU's clock, ns (its running value on its own thread).
    pub fn now_ns(&self) -> u64 {
        if let Some(b) = bound_to(&self.shared).filter(|b| b.idx == self.idx) {
            return b.clock.get() / 1000;
        }
        let g = self.shared.inner.lock();
        g.cpus.get(self.idx).map_or(0, |c| c.clock / 1000)
    }

    /// Exits the CPU: it never runs again, and the baton (if it holds it) passes on.
    pub fn exit(self) {
        self.do_exit();
    }

    fn do_exit(&self) {
        if self.exited.replace(true) {
            return;
        }
        let mut g = self.shared.inner.lock();
        if let Some(b) = bound_to(&self.shared).filter(|b| b.idx == self.idx) {
            b.flush_charges(&mut g);
            if let Some(c) = g.cpus.get_mut(self.idx) {
                if b.mode.get() == Mode::Running {
                    c.clock = b.clock.get();
                }
            }
            // Its last frees, before another CPU can be given that memory.
            g.forget_freed();
        }
        let u: Unpark = g.exit(self.idx);
        drop(g);
        u.run();
        unbind(&self.shared, self.idx);
    }

    fn running_here(&self, op: &'static str) -> Result<Rc<Bound>, SimError> {
        bound_to(&self.shared)
            .filter(|b| b.idx == self.idx && b.mode.get() != Mode::Detached)
            .ok_or_else(|| self.misuse(op, "not running on this thread"))
    }

    fn misuse(&self, op: &'static str, why: &'static str) -> SimError {
        SimError::Misuse {
            cpu: self.shared.name_of(self.idx),
            op,
            why,
        }
    }
}

impl Drop for CpuHandle {
    fn drop(&mut self) {
        self.do_exit();
    }
}

/// Detaches the calling thread's running simulated CPU (as [`CpuHandle::detach`], for code
/// that does not hold the handle). `Ok` without effect on a thread that runs none.
pub fn detach_current() -> Result<(), SimError> {
    let Some(b) = current() else { return Ok(()) };
    if b.mode.get() != Mode::Running {
        return Ok(());
    }
    let shared = Arc::clone(&b.shared);
    let Some(mut g) = shared.enter(&b) else {
        return Ok(());
    };
    b.flush_charges(&mut g);
    if let Some(c) = g.cpus.get_mut(b.idx) {
        c.state = State::Detached;
    }
    b.mode.set(Mode::Detached);
    let u = g.dispatch();
    drop(g);
    u.run();
    Ok(())
}

/// Rejoins the simulation after [`detach_current`], at the CPU's own clock.
pub fn attach_current() -> Result<(), SimError> {
    let Some(b) = current() else { return Ok(()) };
    if b.mode.get() != Mode::Detached {
        return Ok(());
    }
    let shared = Arc::clone(&b.shared);
    let mut g = shared.inner.lock();
    if g.failed.is_some() {
        b.mode.set(Mode::Failed);
        return Ok(());
    }
    g.make_ready_at(b.idx, 0);
    b.mode.set(Mode::Running);
    let u = g.kick();
    drop(g);
    u.run();
    if let Some(g) = shared.wait_baton(&b) {
        shared.leave(g, &b);
    }
    Ok(())
}

/// Lets `ns` of virtual time pass on the calling thread's running simulated CPU, as a timer
/// does: its clock moves on by `ns`, and it passes the baton at once if that puts it more
/// than the lookahead ahead of the lowest runnable CPU (the others run meanwhile; it runs
/// again in its turn). `false`, with nothing done, on a thread that runs no CPU.
pub fn sleep_current(ns: u64) -> bool {
    let Some(b) = current().filter(|b| b.mode.get() == Mode::Running) else {
        return false;
    };
    b.clock
        .set(b.clock.get().saturating_add(ns.saturating_mul(1000)));
    // One scheduling point, under the scheduler's lock with the new clock: which CPU runs
    // next depends only on the clocks, never on how fast this thread gets here.
    let shared = Arc::clone(&b.shared);
    shared.schedule_point(&b);
    true
}

/// Runs `f` while the calling thread's simulated CPU keeps the baton: no other simulated CPU
/// runs meanwhile, so the simulation stays deterministic, and the watchdog does not count the
/// time (for real-time work of the thread's own that touches no hook, such as a native
/// baseline that spawns and joins host threads). On a thread that runs no CPU, just runs `f`.
pub fn hold_while<R>(f: impl FnOnce() -> R) -> R {
    let b = current().filter(|b| b.mode.get() == Mode::Running);
    let set = |on: bool| {
        if let Some(b) = &b {
            b.shared.inner.lock().holding_outside = on;
        }
    };
    set(true);
    let r = f();
    set(false);
    r
}
