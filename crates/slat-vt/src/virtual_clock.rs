//! [`Virtual`]: the [`Clock`] whose hooks drive the simulation of the calling thread's CPU.
//!
//! A thread finds its simulated CPU through a thread-local binding set by
//! [`CpuHandle::attach`](crate::CpuHandle::attach). A hook from a thread with no running CPU
//! (never attached, detached, or exited) is a *foreign* call: it does nothing simulated
//! (`spin_until` spins in real time, `now_ns` reads the host clock), and it is counted, so a
//! run can fail loudly ([`Sim::finish`](crate::Sim::finish)) instead of silently mixing real
//! and virtual time. After a simulation failed, its threads' hooks behave as real time and
//! are not counted.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use slat::clock::{Clock, Cost, LockMode, RealTime};

use crate::profile::{cost_index, cost_name};
use crate::scheduler::{Bound, Mode, Shared};

thread_local! {
    static BOUND: RefCell<Option<Rc<Bound>>> = const { RefCell::new(None) };
}

/// Which hook a foreign call was (the first is kept for the error message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// [`Clock::rmw`].
    Rmw,
    /// [`Clock::store`].
    Store,
    /// [`Clock::shared_load`].
    SharedLoad,
    /// [`Clock::data_access`].
    DataAccess,
    /// [`Clock::entry_replaced`].
    EntryReplaced,
    /// [`Clock::walk_load`].
    WalkLoad,
    /// [`Clock::entry_as_seen`].
    EntryAsSeen,
    /// [`Clock::fence`].
    Fence,
    /// [`Clock::lock`].
    Lock,
    /// [`Clock::unlock`].
    Unlock,
    /// [`Clock::spin_until`].
    SpinUntil,
    /// [`Clock::charge`] of this cost.
    Charge(Cost),
    /// [`Clock::now_ns`].
    NowNs,
}

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hook::Charge(c) => write!(f, "charge({})", cost_name(*c).unwrap_or("?")),
            other => write!(f, "{other:?}"),
        }
    }
}

static FOREIGN: AtomicU64 = AtomicU64::new(0);
static FIRST_FOREIGN: OnceLock<Hook> = OnceLock::new();

/// Foreign hook calls in this process so far, and the first one's kind.
pub fn foreign_ops() -> (u64, Option<Hook>) {
    (
        FOREIGN.load(Ordering::Relaxed),
        FIRST_FOREIGN.get().copied(),
    )
}

fn foreign(h: Hook) {
    FOREIGN.fetch_add(1, Ordering::Relaxed);
    let _ = FIRST_FOREIGN.set(h);
}

/// The calling thread's binding if its CPU runs; counts a foreign call `h` if it has none.
/// `Err(())`: the simulation failed (real time, not counted).
#[inline]
fn running(h: Hook) -> Result<Option<Rc<Bound>>, ()> {
    let b = BOUND
        .try_with(|c| c.try_borrow().ok().and_then(|b| b.clone()))
        .ok()
        .flatten();
    match b {
        Some(b) if b.mode.get() == Mode::Running => Ok(Some(b)),
        Some(b) if b.mode.get() == Mode::Failed => Err(()),
        _ => {
            foreign(h);
            Ok(None)
        }
    }
}

/// Binds the calling thread to `b`. Fails with the CPU the thread is bound to already
/// (`None`: the thread is exiting).
pub(crate) fn bind(b: Rc<Bound>) -> Result<(), Option<(Arc<Shared>, usize)>> {
    BOUND
        .try_with(|c| {
            let mut c = c.try_borrow_mut().map_err(|_| None)?;
            if let Some(old) = c.as_ref() {
                return Err(Some((Arc::clone(&old.shared), old.idx)));
            }
            *c = Some(b);
            Ok(())
        })
        .unwrap_or(Err(None))
}

/// Unbinds the calling thread if it is bound to CPU `idx` of `shared`.
pub(crate) fn unbind(shared: &Arc<Shared>, idx: usize) {
    let _ = BOUND.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            if c.as_ref()
                .is_some_and(|b| Arc::ptr_eq(&b.shared, shared) && b.idx == idx)
            {
                *c = None;
            }
        }
    });
}

/// The calling thread's virtual time, ns, if it runs a simulated CPU (`None` otherwise; never
/// counted as a foreign call): for timers that serve both clocks.
pub fn simulated_now_ns() -> Option<u64> {
    current()
        .filter(|b| b.mode.get() == Mode::Running)
        .map(|b| b.clock.get() / 1000)
}

/// The calling thread's binding, whatever its mode and simulation.
pub(crate) fn current() -> Option<Rc<Bound>> {
    BOUND
        .try_with(|c| c.try_borrow().ok().and_then(|b| b.clone()))
        .ok()
        .flatten()
}

/// The calling thread's binding, whatever its mode, if it belongs to `shared`.
pub(crate) fn bound_to(shared: &Arc<Shared>) -> Option<Rc<Bound>> {
    BOUND
        .try_with(|c| c.try_borrow().ok().and_then(|b| b.clone()))
        .ok()
        .flatten()
        .filter(|b| Arc::ptr_eq(&b.shared, shared))
}

/// The virtual clock: time is the calling simulated CPU's, and synchronisation is modelled
/// (docs/design/virtual-time.md §2–§3). Use it as `Timed<Ept, Virtual>`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Virtual;

// SAFETY: no hook touches engine state (they read and write the simulation's own state only).
// Every hook returns: a wait ends when another CPU's hook wakes this one, or when the
// simulation fails (deadlock, watchdog), after which hooks are real time. `spin_until`
// returns only after `cond` returned `true`: the simulated arm re-evaluates it after every
// wake-up and falls back to `RealTime::spin_until` if the simulation failed. `lock` returns
// only when the lock model grants the lock, which it does only when no other simulated CPU
// holds it in a conflicting mode.
unsafe impl Clock for Virtual {
    const VIRTUAL: bool = true;

    fn rmw(addr: usize) {
        if let Ok(Some(b)) = running(Hook::Rmw) {
            b.shared.rmw(&b, addr);
        }
    }

    fn store(addr: usize) {
        if let Ok(Some(b)) = running(Hook::Store) {
            b.shared.store(&b, addr);
        }
    }

    fn shared_load(addr: usize) {
        if let Ok(Some(b)) = running(Hook::SharedLoad) {
            b.shared.shared_load(&b, addr);
        }
    }

    fn data_access(addr: usize, write: bool) {
        if let Ok(Some(b)) = running(Hook::DataAccess) {
            b.shared.data_access(&b, addr, write);
        }
    }

    fn entry_replaced(addr: usize, old: u64) {
        if let Ok(Some(b)) = running(Hook::EntryReplaced) {
            b.shared.entry_replaced(&b, addr, old);
        }
    }

    fn entry_as_seen(addr: usize, current: u64) -> u64 {
        match running(Hook::EntryAsSeen) {
            Ok(Some(b)) => b.shared.entry_as_seen(&b, addr, current),
            _ => current,
        }
    }

    fn walk_load(addr: usize, load: impl FnOnce() -> u64) -> (u64, u64) {
        match running(Hook::WalkLoad) {
            Ok(Some(b)) => b.shared.walk_load(&b, addr, load),
            _ => {
                let v = load();
                (v, v)
            }
        }
    }

    fn fence() {
        if let Ok(Some(b)) = running(Hook::Fence) {
            b.shared.fence(&b);
        }
    }

    fn lock(addr: usize, mode: LockMode) {
        if let Ok(Some(b)) = running(Hook::Lock) {
            b.shared.lock(&b, addr, mode);
        }
    }

    fn unlock(addr: usize, mode: LockMode) {
        if let Ok(Some(b)) = running(Hook::Unlock) {
            b.shared.unlock(&b, addr, mode);
        }
    }

    fn spin_until(watch: &[usize], cond: &mut dyn FnMut() -> bool) {
        if let Ok(Some(b)) = running(Hook::SpinUntil) {
            if b.shared.spin_until(&b, watch, cond) {
                return;
            }
        }
        RealTime::spin_until(watch, cond);
    }

    #[inline]
    fn charge(cost: Cost, n: u64) {
        let done = BOUND
            .try_with(|c| {
                let Ok(c) = c.try_borrow() else { return false };
                match c.as_ref() {
                    Some(b) if b.mode.get() == Mode::Running => {
                        if let Some(i) = cost_index(cost) {
                            let ps = b.shared.costs[i].saturating_mul(n);
                            b.clock.set(b.clock.get().saturating_add(pay(b, i, n, ps)));
                            if let Some(k) = b.charges.get(i) {
                                k.set(k.get().wrapping_add(n));
                            }
                        }
                        true
                    }
                    Some(b) => b.mode.get() == Mode::Failed,
                    None => false,
                }
            })
            .unwrap_or(false);
        if !done {
            foreign(Hook::Charge(cost));
        }
    }

    fn now_ns() -> u64 {
        match running(Hook::NowNs) {
            Ok(Some(b)) => b.clock.get() / 1000,
            _ => RealTime::now_ns(),
        }
    }
}

/// What a charge of `ps` (cost index `i`, `n` times) advances `b`'s clock by: a fault path's
/// negative cost sets the CPU's overlap credit (and advances nothing); any other charge first
/// uses up what credit is left. The credit is set, not added: one fault's credit at most, so
/// a path with too few charges after it cannot bank credit against later work.
#[inline]
fn pay(b: &Bound, i: usize, n: u64, ps: u64) -> u64 {
    let credit = b.shared.credits[i];
    if credit > 0 {
        b.credit.set(credit.saturating_mul(n));
        return 0;
    }
    let left = b.credit.get();
    if left == 0 {
        return ps;
    }
    b.credit.set(left.saturating_sub(ps));
    ps.saturating_sub(left)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Profile, Sim, SimError};

    // The only test that makes foreign calls: the counter is process-wide, so a simulation
    // alive in a parallel test of this binary would see them (integration tests make none).
    #[test]
    fn foreign_calls_are_counted_and_fail_the_run() {
        let sim = Sim::new(Profile::host_default(), 0).unwrap();
        let (before, _) = foreign_ops();
        std::thread::spawn(|| {
            Virtual::charge(Cost::TlbHit, 1);
            Virtual::rmw(64);
            let mut n = 0;
            Virtual::spin_until(&[64], &mut || {
                n += 1;
                n > 3
            });
            let _ = Virtual::now_ns();
        })
        .join()
        .unwrap();
        let (after, first) = foreign_ops();
        assert!(after >= before + 4);
        assert!(first.is_some());
        match sim.finish() {
            Err(SimError::Foreign { count, first }) => {
                assert!(count >= 4);
                assert!(!first.is_empty());
            }
            other => panic!("expected a foreign-call error, got {other:?}"),
        }
    }
}
