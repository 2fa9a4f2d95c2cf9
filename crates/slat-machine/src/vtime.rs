//! What the machine needs to run in virtual time (docs/design/virtual-time.md §2), without
//! depending on the simulation that provides it: a way to register its threads
//! ([`SimThreads`], implemented by the caller that owns the simulation) and a barrier that
//! waits in the format's clock ([`ClockGate`]).

use slat::clock::{addr_of, Clock};
use slat_workload::{Gate, ThreadBarrier};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// How the machine's threads join a simulation. The machine calls [`register`] on the
/// spawning thread right before spawning each of its threads, in a fixed order (the vCPUs by
/// index); the new thread calls [`ThreadToken::attach`] first and drops the token when it ends.
///
/// [`register`]: SimThreads::register
pub trait SimThreads: Send + Sync {
    /// Registers the thread about to be spawned as `name`.
    fn register(&self, name: &str) -> Result<Box<dyn ThreadToken>, String>;
    /// Registers a thread that only reads and sleeps (a sampler): it cannot wake a blocked
    /// thread, so it must not keep a deadlock of the others running. By default an ordinary
    /// [`register`](Self::register).
    fn register_observer(&self, name: &str) -> Result<Box<dyn ThreadToken>, String> {
        self.register(name)
    }
    /// The calling (registered) thread leaves the simulation to block on something outside
    /// it: a join.
    fn step_out(&self);
    /// ... and rejoins it.
    fn step_in(&self);
    /// The calling (registered) thread waits `d` of its simulated time, as a timer: the
    /// other threads run meanwhile.
    fn sleep(&self, d: std::time::Duration);
}

/// A registered thread's ticket into the simulation; dropping it ends the thread's part.
pub trait ThreadToken: Send {
    /// Binds the calling (new) thread to its simulated CPU and waits for its turn.
    fn attach(&mut self);
}

/// A barrier in clock `C`: [`ThreadBarrier`] in real time; in virtual time arrivals are
/// read-modify-writes and the waiters wait in [`Clock::spin_until`] for the last one's (or an
/// abandonment's) write, so they leave at its clock and no thread blocks in the operating
/// system.
///
/// Aligned to a cache line: in virtual time whether its counters share a line with each
/// other and with their neighbours is part of the simulated cost, which must not depend on
/// where the stack frame or the allocation holding the gate happens to land (16-byte
/// granular under address-space randomization).
#[repr(align(64))]
pub struct ClockGate<C: Clock> {
    parties: usize,
    real: ThreadBarrier,
    arrived: AtomicUsize,
    generation: AtomicU64,
    abandoned: AtomicBool,
    _clock: PhantomData<C>,
}

impl<C: Clock> Gate for ClockGate<C> {
    fn with_parties(parties: usize) -> Self {
        ClockGate {
            parties: parties.max(1),
            real: ThreadBarrier::new(if C::VIRTUAL { 1 } else { parties }),
            arrived: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            abandoned: AtomicBool::new(false),
            _clock: PhantomData,
        }
    }

    fn wait(&self) -> bool {
        if !C::VIRTUAL {
            return self.real.wait();
        }
        C::shared_load(addr_of(&self.generation));
        let generation = self.generation.load(Ordering::Acquire);
        if self.abandoned.load(Ordering::Acquire) {
            return false;
        }
        C::rmw(addr_of(&self.arrived));
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 >= self.parties {
            self.arrived.store(0, Ordering::Relaxed);
            C::rmw(addr_of(&self.generation));
            self.generation.fetch_add(1, Ordering::Release);
            true
        } else {
            C::spin_until(&[addr_of(&self.generation)], &mut || {
                self.generation.load(Ordering::Acquire) != generation
            });
            !self.abandoned.load(Ordering::Acquire)
        }
    }

    fn abandon(&self) {
        if !C::VIRTUAL {
            self.real.abandon();
            return;
        }
        // Set before the generation moves, so a waiter the move wakes sees it.
        self.abandoned.store(true, Ordering::Release);
        C::rmw(addr_of(&self.generation));
        self.generation.fetch_add(1, Ordering::Release);
    }
}
