//! Failures: a deadlock and a CPU blocked outside the simulation end the run with a readable
//! reason, and every thread gets back to its caller.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use slat::clock::{addr_of, Clock};
use slat_vt::{Sim, SimError, Virtual};

use crate::common;

/// Polls until the simulation has failed (at most 20 s).
fn wait_failure(sim: &Sim) -> SimError {
    let start = Instant::now();
    loop {
        if let Some(e) = sim.failure() {
            return e;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no failure");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Two CPUs spinning on lines nobody writes, with or without an observer beside them that
/// reads one of the lines every 100 µs of virtual time: a deadlock either way, reported with
/// both spinners' waits.
fn spinners_deadlock(observer: bool) {
    let sim = common::sim(common::profile(), 0);
    let lines = [AtomicU64::new(0), AtomicU64::new(0)];
    let stop = AtomicBool::new(false);
    let handles: Vec<_> = (0..2)
        .map(|i| sim.register(&format!("cpu{i}")).unwrap())
        .collect();
    let sampler = observer.then(|| sim.register_observer("sampler").unwrap());
    std::thread::scope(|s| {
        let (lines, stop) = (&lines, &stop);
        for (i, h) in handles.into_iter().enumerate() {
            s.spawn(move || {
                h.attach().unwrap();
                // After the failure this spins in real time until the test stops it.
                Virtual::spin_until(&[addr_of(&lines[i])], &mut || stop.load(Ordering::Acquire));
            });
        }
        if let Some(h) = sampler {
            s.spawn(move || {
                h.attach().unwrap();
                // After the failure this sleeps in real time: a few ticks until the test stops.
                while !stop.load(Ordering::Acquire) {
                    slat_vt::sleep_current(100_000);
                    std::hint::black_box(lines[0].load(Ordering::Relaxed));
                }
            });
        }
        let e = wait_failure(&sim);
        let msg = e.to_string();
        assert!(matches!(e, SimError::Deadlock { .. }), "{msg}");
        assert!(msg.contains("deadlock"), "{msg}");
        for name in ["`cpu0`", "`cpu1`"] {
            assert!(msg.contains(name), "{msg}");
        }
        assert_eq!(msg.matches("spinning until").count(), 2, "{msg}");
        stop.store(true, Ordering::Release);
    });
    assert!(matches!(sim.finish(), Err(SimError::Deadlock { .. })));
}

#[test]
fn two_cpus_spinning_on_lines_nobody_writes_deadlock() {
    spinners_deadlock(false);
}

/// The observer could tick on through virtual time forever, but nothing it does can wake the
/// others, so the simulation is deadlocked all the same (a fault-in's sampler kept 128
/// deadlocked vCPUs' simulation running for hours).
#[test]
fn an_observer_ticking_on_does_not_hide_a_deadlock() {
    spinners_deadlock(true);
}

#[test]
fn a_lock_never_released_is_a_deadlock() {
    let sim = common::sim(common::profile(), 0);
    let word = AtomicU64::new(0);
    common::run(&sim, 2, |i| {
        let addr = addr_of(&word);
        if i == 0 {
            // Takes the lock and waits for cpu1, which waits for the lock.
            Virtual::lock(addr, slat::clock::LockMode::Exclusive);
            Virtual::spin_until(&[addr_of(&sim)], &mut || word.load(Ordering::Acquire) == 1);
        } else {
            Virtual::lock(addr, slat::clock::LockMode::Exclusive);
            word.store(1, Ordering::Release);
            Virtual::rmw(addr_of(&sim));
        }
    });
    let e = sim.finish().unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("blocked on lock"), "{msg}");
    assert!(msg.contains("writer Some(0)"), "{msg}");
}

#[test]
fn the_watchdog_catches_a_cpu_blocked_in_the_os() {
    let sim = Sim::with_watchdog(common::profile(), 0, Some(Duration::from_millis(200))).unwrap();
    common::run(&sim, 2, |i| {
        Virtual::fence();
        if i == 0 {
            // Holding the baton, blocked outside the simulation.
            std::thread::sleep(Duration::from_millis(1200));
        }
        Virtual::fence();
    });
    let e = sim.finish().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SimError::Watchdog { .. }), "{msg}");
    assert!(msg.contains("holds the baton"), "{msg}");
}

#[test]
fn the_watchdog_lets_a_working_cpu_work() {
    // Real work longer than the period while holding the baton (mapping guest memory on a
    // loaded host): its thread's CPU time advances, so it is not a block.
    let sim = Sim::with_watchdog(common::profile(), 0, Some(Duration::from_millis(300))).unwrap();
    common::run(&sim, 2, |i| {
        Virtual::fence();
        if i == 0 {
            let t0 = Instant::now();
            let mut x = 0u64;
            while t0.elapsed() < Duration::from_millis(1500) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        Virtual::fence();
    });
    sim.finish().expect("working is not blocking");
}

#[test]
fn registering_more_than_the_limit_is_an_error() {
    let sim = common::sim(common::profile(), 0);
    let handles: Vec<_> = (0..slat_vt::MAX_CPUS)
        .map(|i| sim.register(&i.to_string()).unwrap())
        .collect();
    assert!(matches!(
        sim.register("one too many"),
        Err(SimError::TooManyCpus { max: 256 })
    ));
    drop(handles);
    sim.finish().expect("registered and exited without running");
}

/// A profile that makes the simulated work free (here: an RMW on a line the CPU holds, with
/// `rmw_local` 0) lets a CPU that waits for virtual time to pass (a sampler, a harvest
/// interval) wait forever while the others run at time 0: the simulation fails instead, with
/// every CPU's state, and the threads get back to their callers.
#[test]
fn virtual_time_standing_still_fails_instead_of_running_forever() {
    let sim = common::sim(common::profile(), 0);
    let word = AtomicU64::new(0);
    let woke = AtomicBool::new(false);
    common::run(&sim, 2, |i| {
        if i == 0 {
            assert!(slat_vt::sleep_current(1_000_000));
            woke.store(true, Ordering::Release);
        } else {
            // Free work until the sleeper wakes: in virtual time it never does.
            while !woke.load(Ordering::Acquire) {
                Virtual::rmw(addr_of(&word));
            }
        }
    });
    let e = sim.finish().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SimError::Stalled { .. }), "{msg}");
    assert!(msg.contains("`cpu0`") && msg.contains("`cpu1`"), "{msg}");
}
