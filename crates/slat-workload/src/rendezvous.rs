//! The host's rendezvous with its vCPU threads, as both machines run them: the host hands out
//! a job and releases every vCPU thread at once, each runs it and reports, and the host waits
//! until all of them have synced (KVM selftests' GUEST_SYNC).

use crate::barrier::{Gate, ThreadBarrier};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most vCPU threads a [`Rendezvous`] serves (KVM's `KVM_MAX_VCPUS` on x86).
pub const MAX_RENDEZVOUS_VCPUS: usize = 4096;

/// Why a rendezvous could not be built or a report was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// No vCPU, or more than [`MAX_RENDEZVOUS_VCPUS`].
    #[error("a rendezvous needs 1 to {MAX_RENDEZVOUS_VCPUS} vCPU threads, not {0}")]
    Vcpus(usize),
    /// The result slots could not be allocated.
    #[error("cannot allocate results for {0} vCPU threads")]
    Alloc(usize),
    /// A report from a vCPU index the rendezvous does not have.
    #[error("vCPU {idx} reported to a rendezvous of {vcpus} vCPUs")]
    NoSuchVcpu {
        /// The index reported.
        idx: usize,
        /// vCPUs of the rendezvous.
        vcpus: usize,
    },
}

/// The host side and the vCPU-thread side of one machine's passes. `J` is the job every vCPU
/// runs, `R` a vCPU's result, `E` why a vCPU failed and `G` the barrier they sync with.
pub struct Rendezvous<J, R, E, G: Gate = ThreadBarrier> {
    start: G,
    done: G,
    /// `None` tells the vCPU threads to exit.
    job: Mutex<Option<J>>,
    results: Mutex<Vec<Result<R, E>>>,
    /// A started job has not been collected yet.
    running: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<J: Clone, R: Clone + Default, E: Clone, G: Gate> Rendezvous<J, R, E, G> {
    /// The rendezvous of `vcpus` vCPU threads (1 to [`MAX_RENDEZVOUS_VCPUS`]) with the host.
    pub fn new(vcpus: usize) -> Result<Self, RendezvousError> {
        if vcpus == 0 || vcpus > MAX_RENDEZVOUS_VCPUS {
            return Err(RendezvousError::Vcpus(vcpus));
        }
        let mut results = Vec::new();
        results
            .try_reserve_exact(vcpus)
            .map_err(|_| RendezvousError::Alloc(vcpus))?;
        results.resize(vcpus, Ok(R::default()));
        Ok(Rendezvous {
            start: G::with_parties(vcpus + 1),
            done: G::with_parties(vcpus + 1),
            job: Mutex::new(None),
            results: Mutex::new(results),
            running: AtomicBool::new(false),
        })
    }

    /// Host: claims the vCPUs for a job; `false` if one is running and not yet collected.
    pub fn claim(&self) -> bool {
        !self.running.swap(true, Ordering::SeqCst)
    }

    /// Host: whether a claimed job has not been collected yet.
    pub fn running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// Host, after [`Rendezvous::claim`]: releases every vCPU thread with `job`. The barrier
    /// orders the host's stores before it ahead of the vCPU threads' run.
    pub fn release(&self, job: J) {
        *lock(&self.job) = Some(job);
        self.start.wait();
    }

    /// Host: waits for every vCPU thread to report; returns the time from `t0` to the last
    /// one's sync and every result, or the first failed vCPU and why.
    pub fn collect(&self, t0: Instant) -> (Duration, Result<Vec<R>, (usize, E)>) {
        let (r, wall) = self.collect_with(|| t0.elapsed());
        (wall, r)
    }

    /// Host: as [`Rendezvous::collect`], timed by `elapsed` (called at the last sync; a
    /// machine in virtual time reads its own clock).
    pub fn collect_with<T>(&self, elapsed: impl FnOnce() -> T) -> (Result<Vec<R>, (usize, E)>, T) {
        self.done.wait();
        let wall = elapsed();
        self.running.store(false, Ordering::SeqCst);
        let results = lock(&self.results).clone();
        let mut out = Vec::with_capacity(results.len());
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Ok(v) => out.push(v),
                Err(e) => return (Err((i, e)), wall),
            }
        }
        (Ok(out), wall)
    }

    /// Host, when the machine goes away: stops a running job with `halt` (which collects
    /// it), tells the vCPU threads to exit, releases them and joins `threads`.
    pub fn shut_down(&self, threads: Vec<JoinHandle<()>>, halt: impl FnOnce()) {
        if threads.is_empty() {
            return;
        }
        self.stop(halt);
        for t in threads {
            let _ = t.join();
        }
    }

    /// Host: [`Rendezvous::shut_down`] without the joins (for a host that must step out of a
    /// simulation before it blocks in a join): the vCPU threads are released to exit.
    pub fn stop(&self, halt: impl FnOnce()) {
        if self.running() {
            halt();
        }
        *lock(&self.job) = None;
        self.start.wait();
    }

    /// Host, when a vCPU thread could not be started: the threads already started wait for
    /// parties that never arrive. Releases them for good (both barriers are abandoned and the
    /// job is `None`), so they exit and the host can join them; the rendezvous is unusable
    /// afterwards.
    pub fn abandon(&self) {
        *lock(&self.job) = None;
        self.start.abandon();
        self.done.abandon();
    }

    /// vCPU thread: waits to be released; the job to run, or `None` to exit.
    pub fn next_job(&self) -> Option<J> {
        if !self.start.wait() {
            return None;
        }
        lock(&self.job).clone()
    }

    /// vCPU thread `idx`: reports the job's result and syncs with the host. An index past the
    /// vCPU count is refused ([`RendezvousError::NoSuchVcpu`], the result dropped) after the
    /// sync, so the host is not left waiting for this thread.
    pub fn report(&self, idx: usize, r: Result<R, E>) -> Result<(), RendezvousError> {
        let stored = {
            let mut results = lock(&self.results);
            let vcpus = results.len();
            match results.get_mut(idx) {
                Some(slot) => {
                    *slot = r;
                    Ok(())
                }
                None => Err(RendezvousError::NoSuchVcpu { idx, vcpus }),
            }
        };
        self.done.wait();
        stored
    }

    /// vCPU threads of this rendezvous.
    pub fn vcpus(&self) -> usize {
        lock(&self.results).len()
    }
}
