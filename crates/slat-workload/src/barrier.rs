//! The barriers a host and its threads sync with, and why they can be abandoned.
//!
//! A host that spawns N threads which first wait at a barrier of N + 1 parties cannot finish
//! the barrier when the k-th spawn fails (the operating system is out of threads or address
//! space for a stack): with `std`'s barrier the k threads already started would wait for
//! ever, holding their stacks, their allocator arenas and whatever they own — a leak in a
//! process that goes on, a hang in a `thread::scope` that joins them. Every barrier here can
//! therefore be *abandoned*: every party waiting now, and every later one, returns at once
//! with `false`, and the host joins the threads it started.

use std::sync::{Condvar, Mutex, MutexGuard};

/// A barrier a [`Rendezvous`](crate::Rendezvous) syncs its parties with: [`ThreadBarrier`] in
/// real time, or one that waits in a machine's virtual time (the simulated machine's
/// `--clock virtual`).
pub trait Gate: Send + Sync {
    /// A barrier for `parties` threads.
    fn with_parties(parties: usize) -> Self;
    /// Waits until every party has called `wait` (`true`) or the barrier is abandoned
    /// (`false`, at once if it already was).
    fn wait(&self) -> bool;
    /// Releases every waiting party and every later one with `false`: a party will never
    /// arrive. Idempotent.
    fn abandon(&self);
}

/// `std::sync::Barrier` that can be [abandoned](Gate::abandon).
#[derive(Debug)]
pub struct ThreadBarrier {
    parties: usize,
    state: Mutex<BarrierState>,
    turned: Condvar,
}

#[derive(Debug, Default)]
struct BarrierState {
    arrived: usize,
    /// Bumped each time the last party arrives: a waiter leaves when it changes.
    generation: u64,
    abandoned: bool,
}

impl ThreadBarrier {
    /// A barrier for `parties` threads (0 counts as 1: every wait returns at once).
    pub fn new(parties: usize) -> ThreadBarrier {
        ThreadBarrier {
            parties: parties.max(1),
            state: Mutex::new(BarrierState::default()),
            turned: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BarrierState> {
        // Nothing panics while holding it; plain counters either way.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Gate for ThreadBarrier {
    fn with_parties(parties: usize) -> Self {
        ThreadBarrier::new(parties)
    }

    fn wait(&self) -> bool {
        let mut s = self.lock();
        if s.abandoned {
            return false;
        }
        s.arrived += 1;
        if s.arrived >= self.parties {
            s.arrived = 0;
            s.generation = s.generation.wrapping_add(1);
            self.turned.notify_all();
            return true;
        }
        let generation = s.generation;
        while s.generation == generation && !s.abandoned {
            s = self.turned.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.generation != generation
    }

    fn abandon(&self) {
        self.lock().abandoned = true;
        self.turned.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn every_party_leaves_together_again_and_again() {
        let b = ThreadBarrier::new(3);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| s.spawn(|| (0..100).all(|_| b.wait())))
                .collect();
            assert!((0..100).all(|_| b.wait()));
            assert!(hs.into_iter().all(|h| h.join().unwrap()));
        });
    }

    /// The leak this type exists for: two of three parties started, the third never comes.
    #[test]
    fn abandoning_releases_the_parties_already_waiting_and_later_ones() {
        let b = ThreadBarrier::new(4);
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            for _ in 0..2 {
                let tx = tx.clone();
                let b = &b;
                s.spawn(move || tx.send(b.wait()).unwrap());
            }
            std::thread::sleep(Duration::from_millis(20));
            b.abandon();
            for _ in 0..2 {
                let left = rx.recv_timeout(Duration::from_secs(10));
                assert_eq!(left, Ok(false), "a waiter was not released");
            }
        });
        assert!(!b.wait(), "a wait after the abandonment returns at once");
    }

    #[test]
    fn a_barrier_of_no_parties_never_waits() {
        assert!(ThreadBarrier::new(0).wait());
    }
}
