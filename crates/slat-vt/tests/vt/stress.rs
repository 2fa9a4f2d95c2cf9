//! Many CPUs, every kind of wait at once: no deadlock, the same result twice, and a lock
//! waiter behind a holder that spins for a third CPU completes.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};
use slat::clock::{addr_of, Clock, Cost, LockMode};
use slat_vt::{Barrier, LockPolicy, Virtual};

use crate::common;

/// 32 CPUs: a readers–writer lock (every fourth CPU writes), a counter every CPU bumps, a
/// barrier per round, and a spin wait for the round's last bump. Returns the final clocks.
fn mixed(seed: u64, policy: LockPolicy) -> Vec<u64> {
    const N: usize = 32;
    const ROUNDS: u64 = 8;
    let mut p = common::profile();
    p.model.lock_policy.policy = policy;
    let sim = common::sim(p, seed);
    let lock = RwLock::new(0u64);
    let counter = AtomicU64::new(0);
    let barrier = Barrier::new(&sim, N);
    common::run(&sim, N, |i| {
        for r in 0..ROUNDS {
            Virtual::charge(Cost::TlbMiss, 1 + (i as u64 * 7 + r) % 5);
            let mode = if i % 4 == 0 {
                LockMode::Exclusive
            } else {
                LockMode::Shared
            };
            Virtual::lock(addr_of(&lock), mode);
            if mode == LockMode::Exclusive {
                *lock.try_write().expect("granted locks are free") += 1;
            } else {
                assert!(lock.try_read().is_some(), "granted locks are free");
            }
            Virtual::charge(Cost::WalkStep, 4);
            Virtual::unlock(addr_of(&lock), mode);
            Virtual::rmw(addr_of(&counter));
            counter.fetch_add(1, Ordering::AcqRel);
            let goal = (r + 1) * N as u64;
            Virtual::spin_until(&[addr_of(&counter)], &mut || {
                counter.load(Ordering::Acquire) >= goal
            });
            barrier.wait();
        }
    });
    sim.finish().expect("no deadlock, no foreign call");
    assert_eq!(*lock.read(), ROUNDS * (N as u64 / 4));
    common::clocks(&sim)
}

#[test]
fn thirty_two_cpus_mixing_every_wait_are_deterministic() {
    for policy in [LockPolicy::Fifo, LockPolicy::Barging] {
        for seed in [0, 7] {
            let a = mixed(seed, policy);
            assert_eq!(a, mixed(seed, policy), "{policy:?}, seed {seed}");
            // Everyone leaves the last barrier together.
            assert!(a.windows(2).all(|w| w[0] == w[1]), "{a:?}");
        }
    }
}

#[test]
fn a_lock_waiter_behind_a_spinning_holder_completes() {
    let sim = common::sim(common::profile(), 0);
    let lock = Mutex::new(());
    let flag = AtomicU64::new(0);
    let done = Mutex::new(Vec::new());
    common::run(&sim, 3, |i| {
        let addr = addr_of(&lock);
        match i {
            // Holds the lock while it waits for cpu2.
            0 => {
                Virtual::lock(addr, LockMode::Exclusive);
                Virtual::spin_until(&[addr_of(&flag)], &mut || flag.load(Ordering::Acquire) == 1);
                Virtual::unlock(addr, LockMode::Exclusive);
            }
            // Waits for the lock.
            1 => {
                Virtual::charge(Cost::VmExit, 1);
                Virtual::lock(addr, LockMode::Exclusive);
                Virtual::unlock(addr, LockMode::Exclusive);
            }
            // Works, then sets the flag.
            _ => {
                Virtual::charge(Cost::VmExit, 10);
                Virtual::rmw(addr_of(&flag));
                flag.store(1, Ordering::Release);
            }
        }
        done.lock().push(i);
    });
    sim.finish().expect("completes");
    assert_eq!(*done.lock(), [2, 0, 1]);
}
