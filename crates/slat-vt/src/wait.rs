//! Scheduler-aware waits for code that runs on simulated CPUs: a [`Condvar`] for
//! `parking_lot::Mutex` and a [`Barrier`]. A simulated waiter blocks in the scheduler (the
//! baton passes on) and resumes at `max(own clock, notifier's clock)`, which carries
//! causality, provided the state they wait for changes under the mutex taken with
//! [`Condvar::lock`] (a scheduling point). A thread outside the simulation, or any thread after the simulation failed,
//! waits in real time; notifications reach both kinds of waiter.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::MutexGuard;

use crate::scheduler::{Mode, Shared};
use crate::sim::Sim;
use crate::virtual_clock::bound_to;

/// Event keys: unique per primitive for the process's life.
static NEXT_KEY: AtomicUsize = AtomicUsize::new(1);

fn next_key() -> usize {
    NEXT_KEY.fetch_add(1, Ordering::Relaxed)
}

/// A condition variable whose simulated waiters wait in virtual time.
#[derive(Debug)]
pub struct Condvar {
    shared: Arc<Shared>,
    key: usize,
    /// Notifications so far: a waiter blocks only if none came since it tested its condition.
    seq: AtomicU64,
    real: parking_lot::Condvar,
}

impl Condvar {
    /// A condition variable of `sim`.
    pub fn new(sim: &Sim) -> Condvar {
        Condvar {
            shared: Arc::clone(sim.shared()),
            key: next_key(),
            seq: AtomicU64::new(0),
            real: parking_lot::Condvar::new(),
        }
    }

    /// Locks `m`, the mutex this condition variable waits with, at a scheduling point: a CPU
    /// more than the lookahead ahead yields first, so no CPU sees state that another changed
    /// later in virtual time. Lock the mutex only through this on simulated CPUs.
    pub fn lock<'a, T>(&self, m: &'a parking_lot::Mutex<T>) -> MutexGuard<'a, T> {
        if let Some(b) = bound_to(&self.shared).filter(|b| b.mode.get() == Mode::Running) {
            self.shared.schedule_point(&b);
        }
        m.lock()
    }

    /// Releases `guard`'s mutex, waits for a notification, and re-locks it. As with any
    /// condition variable, wake-ups may be spurious: test the condition in a loop.
    pub fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
        let seen = self.seq.load(Ordering::SeqCst);
        let b = bound_to(&self.shared).filter(|b| b.mode.get() == Mode::Running);
        match b {
            Some(b) => {
                // Returns early (a spurious wake-up) if the simulation fails meanwhile; the
                // caller's next wait is then a real one.
                MutexGuard::unlocked(guard, || {
                    self.shared.wait_event(&b, self.key, "condvar", &|| {
                        self.seq.load(Ordering::SeqCst) == seen
                    })
                });
            }
            None => self.real.wait(guard),
        }
    }

    /// Wakes one waiter; `true` if a simulated one was woken.
    pub fn notify_one(&self) -> bool {
        self.seq.fetch_add(1, Ordering::SeqCst);
        let b = bound_to(&self.shared).filter(|b| b.mode.get() == Mode::Running);
        let n = self.shared.signal(b.as_deref(), self.key, 1, false);
        if n == 0 {
            self.real.notify_one();
        }
        n > 0
    }

    /// Wakes every waiter; returns how many simulated ones were woken.
    pub fn notify_all(&self) -> usize {
        self.seq.fetch_add(1, Ordering::SeqCst);
        let b = bound_to(&self.shared).filter(|b| b.mode.get() == Mode::Running);
        let n = self
            .shared
            .signal(b.as_deref(), self.key, usize::MAX, false);
        self.real.notify_all();
        n
    }
}

/// A barrier for `n` threads; simulated ones leave at the latest arrival's clock.
#[derive(Debug)]
pub struct Barrier {
    shared: Arc<Shared>,
    key: usize,
    n: usize,
    /// Arrivals in the current generation, and the generation.
    state: parking_lot::Mutex<(usize, u64)>,
    generation: AtomicU64,
    real: parking_lot::Condvar,
}

impl Barrier {
    /// A barrier of `sim` for `n` threads (0 counts as 1).
    pub fn new(sim: &Sim, n: usize) -> Barrier {
        Barrier {
            shared: Arc::clone(sim.shared()),
            key: next_key(),
            n: n.max(1),
            state: parking_lot::Mutex::new((0, 0)),
            generation: AtomicU64::new(0),
            real: parking_lot::Condvar::new(),
        }
    }

    /// Waits until `n` threads have called `wait`; returns `true` on exactly one of them
    /// (the last to arrive).
    pub fn wait(&self) -> bool {
        let b = bound_to(&self.shared).filter(|b| b.mode.get() == Mode::Running);
        let mut st = self.state.lock();
        let gen = st.1;
        st.0 += 1;
        if st.0 >= self.n {
            st.0 = 0;
            st.1 += 1;
            self.generation.store(st.1, Ordering::SeqCst);
            drop(st);
            self.shared.signal(b.as_deref(), self.key, usize::MAX, true);
            self.real.notify_all();
            return true;
        }
        if let Some(b) = b {
            drop(st);
            let done = self.shared.wait_event(&b, self.key, "barrier", &|| {
                self.generation.load(Ordering::SeqCst) == gen
            });
            if done {
                return false;
            }
            // The simulation failed: finish the wait in real time.
            st = self.state.lock();
        }
        while st.1 == gen {
            self.real.wait(&mut st);
        }
        false
    }
}
