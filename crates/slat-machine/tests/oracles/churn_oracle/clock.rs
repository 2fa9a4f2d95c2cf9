//! The round's clock: the format's (`F::Clock`). With `slat::Ept` or `slat::Stage2` the
//! round runs in real time, as it always did; with `Timed<F, slat_vt::Virtual>` the same code
//! runs in virtual time (docs/design/virtual-time.md): the host, every vCPU and the churn
//! thread are simulated CPUs of one simulation per round, one running at a time, and each
//! wait of the oracle is a timer wait on the waiting CPU's clock. Guest memory stays real.

use super::*;
use slat::clock::{addr_of, Clock, LockMode};
use slat_vt::{CpuHandle, Entry, Profile, Sim};
use std::ops::{Deref, DerefMut};

/// How many times shorter a round is in virtual time: its length and every pause of the host
/// and the churn thread are divided by this, so the pauses stay the same fraction of a round
/// as in real time and a round takes about a real round's wall time (a virtual millisecond of
/// the oracle takes 20–45 ms of wall time here).
pub(crate) const VIRTUAL_PACE: u32 = 50;

/// How long a simulated vCPU waits before retrying an access to a checked slot that is moving
/// (the real-time oracle yields the host CPU instead): the churn CPU runs meanwhile.
const RETRY_WAIT: Duration = Duration::from_nanos(200);

/// The divisor of a round's times (1 in real time).
pub(crate) fn pace<F: PteFormat>() -> u32 {
    match F::Clock::VIRTUAL {
        true => VIRTUAL_PACE,
        false => 1,
    }
}

/// `F`'s clock: `real` or `virtual`.
pub(crate) fn clock_name<F: PteFormat>() -> &'static str {
    match F::Clock::VIRTUAL {
        true => "virtual",
        false => "real",
    }
}

/// Now on `F`'s clock, ns: the calling simulated CPU's clock in virtual time, the host's
/// monotonic clock in real time.
pub(crate) fn now_ns<F: PteFormat>() -> u64 {
    F::Clock::now_ns()
}

/// `d` from now on `F`'s clock, ns.
pub(crate) fn after<F: PteFormat>(d: Duration) -> u64 {
    now_ns::<F>().saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Waits `d`: in virtual time a timer's wait (the calling CPU's clock moves on by `d` and the
/// others run meanwhile), in real time a sleep.
pub(crate) fn pause<F: PteFormat>(d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    if !(F::Clock::VIRTUAL && slat_vt::sleep_current(ns)) {
        std::thread::sleep(d);
    }
}

/// Lets the CPU being waited for run before a retry: a short timer wait in virtual time, the
/// host CPU given away in real time.
pub(crate) fn yield_now<F: PteFormat>() {
    let ns = RETRY_WAIT.as_nanos() as u64;
    if !(F::Clock::VIRTUAL && slat_vt::sleep_current(ns)) {
        std::thread::yield_now();
    }
}

/// `m` locked, after `C`'s lock model granted it: a simulated CPU that finds it held waits
/// in virtual time for the holder (which may itself be waiting in a hook, the flush of
/// `reset_dirty_rings`), never in the operating system with the baton. Free in real time.
pub(crate) fn lock_clocked<C: Clock, T>(m: &Mutex<T>) -> ClockedGuard<'_, C, T> {
    C::lock(addr_of(m), LockMode::Exclusive);
    ClockedGuard {
        guard: Some(lock(m)),
        addr: addr_of(m),
        _clock: std::marker::PhantomData,
    }
}

pub(crate) struct ClockedGuard<'a, C: Clock, T> {
    guard: Option<MutexGuard<'a, T>>,
    addr: usize,
    _clock: std::marker::PhantomData<C>,
}

impl<C: Clock, T> Deref for ClockedGuard<'_, C, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_deref().expect("held until dropped")
    }
}

impl<C: Clock, T> DerefMut for ClockedGuard<'_, C, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_deref_mut().expect("held until dropped")
    }
}

impl<C: Clock, T> Drop for ClockedGuard<'_, C, T> {
    fn drop(&mut self) {
        // The real release first: the next holder the model picks finds the mutex free.
        drop(self.guard.take());
        C::unlock(self.addr, LockMode::Exclusive);
    }
}

/// What a round's simulation did (all zero in real time): the same seed must give the same.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SimOut {
    /// Virtual time the round took (the latest CPU clock), ns.
    pub(crate) virtual_ns: u64,
    pub(crate) hooks: u64,
    pub(crate) switches: u64,
}

impl SimOut {
    pub(crate) fn add(&mut self, o: &SimOut) {
        self.virtual_ns += o.virtual_ns;
        self.hooks += o.hooks;
        self.switches += o.switches;
    }
}

/// A round's simulation in virtual time, nothing in real time. The calling thread (the host)
/// is its CPU 0 from [`start`](Self::start) to [`finish`](Self::finish); the vCPUs (by index)
/// and then the churn thread register as they are spawned.
pub(crate) struct RoundSim {
    sim: Option<(Sim, CpuHandle)>,
}

impl RoundSim {
    /// The simulation of round `cfg` (its seed also permutes the tie order), on this host's
    /// cost profile, the calling thread attached as the host.
    pub(crate) fn start<F: PteFormat>(cfg: &RoundCfg) -> Result<RoundSim, Failure> {
        if !F::Clock::VIRTUAL {
            return Ok(RoundSim { sim: None });
        }
        let mut profile = Profile::host_default();
        if !cfg.lookahead.is_zero() {
            let ns = cfg.lookahead.as_nanos() as f64;
            profile.model.lookahead = Entry::new(ns, "the churn oracle's round");
        }
        let sim = Sim::new(profile, cfg.seed).map_err(other)?;
        let host = sim.register("host").map_err(other)?;
        host.attach().map_err(other)?;
        Ok(RoundSim {
            sim: Some((sim, host)),
        })
    }

    /// Registers the thread about to be spawned as `name` (right before the spawn, from the
    /// host): its ticket, which it attaches first and drops at its end.
    pub(crate) fn register(&self, name: &str) -> Result<Option<CpuHandle>, Failure> {
        self.sim
            .as_ref()
            .map(|(sim, _)| sim.register(name).map_err(other))
            .transpose()
    }

    /// Runs `f`, a join of simulated threads, outside the simulation: the host stops
    /// holding the baton so the joined threads can run to their end.
    pub(crate) fn outside<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.sim.is_none() {
            return f();
        }
        // Only misuse (the calling thread runs no CPU) fails, and then there is nothing to
        // leave; `finish` reports a simulation that failed.
        let _ = slat_vt::detach_current();
        let r = f();
        let _ = slat_vt::attach_current();
        r
    }

    /// Ends the host's part and the simulation: what it did, or why it failed (a deadlock,
    /// the watchdog, a hook from a thread that was no simulated CPU).
    pub(crate) fn finish(self) -> Result<SimOut, Failure> {
        let Some((sim, host)) = self.sim else {
            return Ok(SimOut::default());
        };
        host.exit();
        let stats = sim
            .finish()
            .map_err(|e| other(format!("the simulation failed: {e}")))?;
        Ok(SimOut {
            virtual_ns: sim.elapsed_ns(),
            hooks: stats.hooks,
            switches: stats.switches,
        })
    }
}

/// Runs `f` on a new thread named `name`, as the simulated CPU `cpu` in virtual time.
pub(crate) fn spawn<T: Send + 'static>(
    name: String,
    cpu: Option<CpuHandle>,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>, Failure> {
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            // A failed simulation lets the thread run in real time; `RoundSim::finish` says so.
            let _attached = cpu.inspect(|c| drop(c.attach()));
            f()
        })
        .map_err(|e| other(format!("spawn: {e}")))
}
