//! Queueing: contended locks serialise exactly as the lock model says, and the real lock
//! that follows a grant is always free.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};
use slat::clock::{addr_of, Clock, Cost, LockMode};
use slat_vt::{LockPolicy, Virtual};

use crate::common::{self, DRAM, HANDOFF, LT, S, STEP};

/// Grant and release times (ns) of each CPU's critical section.
type Sections = Mutex<Vec<(usize, u64, u64)>>;

fn mutex_sections(policy: LockPolicy, n: usize) -> Vec<(usize, u64, u64)> {
    let mut p = common::profile();
    p.model.lock_policy.policy = policy;
    let sim = common::sim(p, 0);
    let lock = Mutex::new(());
    let out: Sections = Mutex::new(Vec::new());
    common::run(&sim, n, |i| {
        let addr = addr_of(&lock);
        Virtual::lock(addr, LockMode::Exclusive);
        let g = lock
            .try_lock()
            .expect("the model granted a lock the real one holds");
        let grant = Virtual::now_ns();
        Virtual::charge(Cost::ZeroPage, 1);
        drop(g);
        Virtual::unlock(addr, LockMode::Exclusive);
        out.lock().push((i, grant, Virtual::now_ns()));
    });
    sim.finish().expect("clean run");
    let mut v = out.into_inner();
    v.sort_by_key(|s| s.1);
    v
}

#[test]
fn fifo_mutex_serialises_exactly() {
    for n in [1, 2, 5, 16] {
        let v = mutex_sections(LockPolicy::Fifo, n);
        let total = v.last().unwrap().2 - v[0].1;
        let n64 = n as u64;
        assert_eq!(total, n64 * S + (n64 - 1) * LT, "n = {n}: {v:?}");
        for w in v.windows(2) {
            assert_eq!(w[1].1, w[0].2 + LT, "hand-off at release + LineTransfer");
        }
        // FIFO in rank order (seed 0: registration order).
        let order: Vec<usize> = v.iter().map(|s| s.0).collect();
        assert_eq!(order, (0..n).collect::<Vec<_>>());
    }
}

#[test]
fn barging_mutex_hands_over_after_the_wake_up() {
    let n = 6u64;
    let v = mutex_sections(LockPolicy::Barging, n as usize);
    let total = v.last().unwrap().2 - v[0].1;
    // The woken head retries at release + Handoff and pulls the lock word's line over.
    assert_eq!(total, n * S + (n - 1) * (HANDOFF + LT), "{v:?}");
}

#[test]
fn readers_enter_together() {
    let sim = common::sim(common::profile(), 0);
    let lock = RwLock::new(());
    let out: Sections = Mutex::new(Vec::new());
    common::run(&sim, 4, |i| {
        let addr = addr_of(&lock);
        Virtual::lock(addr, LockMode::Shared);
        let g = lock.try_read().expect("readers only");
        let grant = Virtual::now_ns();
        Virtual::charge(Cost::ZeroPage, 1);
        drop(g);
        Virtual::unlock(addr, LockMode::Shared);
        out.lock().push((i, grant, Virtual::now_ns()));
    });
    sim.finish().expect("clean run");
    let v = out.into_inner();
    let last_grant = v.iter().map(|s| s.1).max().unwrap();
    let first_release = v.iter().map(|s| s.2).min().unwrap();
    assert!(last_grant < first_release, "readers overlap: {v:?}");
    // Their acquires serialise on the lock word's line only: a miss, then transfers.
    assert_eq!(last_grant, DRAM + 3 * LT, "{v:?}");
}

#[test]
fn a_waiting_writer_blocks_later_readers() {
    let sim = common::sim(common::profile(), 0);
    let lock = RwLock::new(());
    let out: Sections = Mutex::new(Vec::new());
    // cpu0 reads from 0, cpu1 wants to write from 1 µs, cpu2 wants to read from 2 µs.
    common::run(&sim, 3, |i| {
        let addr = addr_of(&lock);
        Virtual::charge(Cost::VmExit, i as u64);
        let mode = if i == 1 {
            LockMode::Exclusive
        } else {
            LockMode::Shared
        };
        Virtual::lock(addr, mode);
        let ok = if i == 1 {
            lock.try_write().is_some()
        } else {
            lock.try_read().is_some()
        };
        assert!(ok, "the model granted a lock the real one holds");
        let grant = Virtual::now_ns();
        Virtual::charge(Cost::ZeroPage, 1);
        Virtual::unlock(addr, mode);
        out.lock().push((i, grant, Virtual::now_ns()));
    });
    sim.finish().expect("clean run");
    let mut v = out.into_inner();
    v.sort_by_key(|s| s.0);
    let (r0, w, r1) = (v[0], v[1], v[2]);
    assert!(w.1 >= r0.2, "the writer waits for the reader: {v:?}");
    assert!(
        r1.1 >= w.2,
        "the later reader waits for the waiting writer: {v:?}"
    );
    assert_eq!(w.1, r0.2 + LT);
    assert_eq!(r1.1, w.2 + LT);
    assert!(r1.1 > 2 * STEP + S, "not admitted beside the first reader");
}

/// Guest data in memory two vCPUs share: CPU 0 writes 8 lines at time 0, CPU 1 writes the
/// same lines after a step. A line nobody held costs nothing here (its `guest_access` is
/// charged apart), so CPU 0 ends at 0; each of CPU 1's writes takes a line CPU 0 owns: a
/// transfer apiece. The stores retire into CPU 1's store buffer, so CPU 1 goes on at once;
/// its fence waits for them, and they complete one after another (the model claims no
/// parallel transfers), so the fence ends eight transfers later.
#[test]
fn shared_guest_data_pays_for_each_line_that_moves() {
    let sim = common::sim(common::profile(), 0);
    let data = [0u64; 64];
    let line = |k: usize| addr_of(&data[k * 8]);
    let flag = AtomicU64::new(0);
    let issued = AtomicU64::new(0);
    common::run(&sim, 2, |i| {
        if i == 0 {
            (0..8).for_each(|k| Virtual::data_access(line(k), true));
            Virtual::rmw(addr_of(&flag));
            flag.store(1, Ordering::Release);
        } else {
            Virtual::charge(Cost::VmExit, 1);
            Virtual::spin_until(&[addr_of(&flag)], &mut || flag.load(Ordering::Acquire) == 1);
            (0..8).for_each(|k| Virtual::data_access(line(k), true));
            issued.store(Virtual::now_ns(), Ordering::Relaxed);
            Virtual::fence();
        }
    });
    sim.finish().expect("no deadlock, no foreign call");
    let c = common::clocks(&sim);
    // CPU 0: only the flag's miss (its stores went to lines nobody held). CPU 1: its step
    // (the flag was set long before, so the spin costs nothing), eight stores that do not
    // stall it, then the fence's wait for their transfers.
    assert_eq!(issued.into_inner(), STEP);
    assert_eq!(c, [DRAM * 1000, (STEP + 8 * LT) * 1000]);
    assert_eq!(sim.stats().lines.transfers, 8);
}
