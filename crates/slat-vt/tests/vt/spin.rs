//! Spin waits advance virtual time instead of burning it.

use std::sync::atomic::{AtomicBool, Ordering};

use slat::clock::{addr_of, Clock, Cost};
use slat_vt::Virtual;

use crate::common::{self, DRAM, LT, STEP};

#[test]
fn spin_until_wakes_at_the_write_plus_a_line_transfer() {
    let sim = common::sim(common::profile(), 0);
    let flag = AtomicBool::new(false);
    let times = parking_lot::Mutex::new([0u64; 2]);
    common::run(&sim, 2, |i| {
        let addr = addr_of(&flag);
        if i == 0 {
            Virtual::spin_until(&[addr], &mut || flag.load(Ordering::Acquire));
        } else {
            Virtual::charge(Cost::VmExit, 3);
            // The hook first, then the real store: the waiter cannot run in between.
            Virtual::rmw(addr);
            flag.store(true, Ordering::Release);
        }
        times.lock()[i] = Virtual::now_ns();
    });
    sim.finish().expect("clean run");
    let [waiter, writer] = times.into_inner();
    assert_eq!(
        writer,
        3 * STEP + DRAM,
        "a first touch of the line is a miss"
    );
    assert_eq!(waiter, writer + LT);
}

#[test]
fn a_false_wake_up_waits_again() {
    let sim = common::sim(common::profile(), 0);
    let n = std::sync::atomic::AtomicU64::new(0);
    let woke = parking_lot::Mutex::new(0u64);
    common::run(&sim, 2, |i| {
        let addr = addr_of(&n);
        if i == 0 {
            Virtual::spin_until(&[addr], &mut || n.load(Ordering::Acquire) == 3);
            *woke.lock() = Virtual::now_ns();
        } else {
            for _ in 0..3 {
                Virtual::charge(Cost::VmExit, 1);
                Virtual::rmw(addr);
                n.fetch_add(1, Ordering::Release);
            }
        }
    });
    sim.finish().expect("clean run");
    // Third RMW: 3 steps, a miss on the first; the writer owns the line after that.
    assert_eq!(*woke.lock(), 3 * STEP + DRAM + LT);
}
