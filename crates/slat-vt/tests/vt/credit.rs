//! A fault path's negative cost (an overlap credit: docs/design/virtual-time.md, "Overlap
//! credit"): charging it advances nothing and sets the CPU's credit, which the charges after
//! it use up; a clock never moves back, and a second fault replaces the credit instead of
//! banking more.

use slat::clock::{Clock, Cost};
use slat_vt::{Entry, Virtual};

use crate::common::{self, S, STEP};

/// The fault path's credit, ns.
const CREDIT: u64 = 300;

/// CPU 0's final clock (ns) after `charges`, with `slow_fault` at `slow_ns`.
fn clock_after(slow_ns: f64, charges: &[(Cost, u64)]) -> u64 {
    let mut p = common::profile();
    p.set_cost(Cost::SlowFault, Entry::new(slow_ns, "test"));
    let sim = common::sim(p, 0);
    common::run(&sim, 1, |_| {
        for &(c, n) in charges {
            Virtual::charge(c, n);
        }
    });
    let clocks = common::clocks(&sim);
    sim.finish().expect("finish");
    clocks[0] / 1000
}

#[test]
fn a_credit_is_used_up_by_the_charges_after_it() {
    let c = -(CREDIT as f64);
    // The next charge pays what the credit does not cover.
    let one = [(Cost::SlowFault, 1), (Cost::VmExit, 1)];
    assert_eq!(clock_after(c, &one), STEP - CREDIT);
    // Used up: later charges pay in full.
    let two = [(Cost::SlowFault, 1), (Cost::VmExit, 1), (Cost::VmExit, 1)];
    assert_eq!(clock_after(c, &two), 2 * STEP - CREDIT);
    // A credit larger than the next charge carries over to the one after it.
    let big = -((STEP + 200) as f64);
    let carried = [(Cost::SlowFault, 1), (Cost::VmExit, 1), (Cost::ZeroPage, 1)];
    assert_eq!(clock_after(big, &carried), S - 200);
    // Nothing to use it on: the clock stays where it was, never below.
    assert_eq!(clock_after(c, &[(Cost::SlowFault, 1)]), 0);
}

#[test]
fn a_second_fault_replaces_the_credit_instead_of_adding_to_it() {
    let c = -(CREDIT as f64);
    let twice = [
        (Cost::SlowFault, 1),
        (Cost::SlowFault, 1),
        (Cost::VmExit, 1),
    ];
    assert_eq!(clock_after(c, &twice), STEP - CREDIT);
    // Zero and positive fault costs charge as any other cost and leave no credit.
    assert_eq!(clock_after(0.0, &one_fault_one_step()), STEP);
    assert_eq!(
        clock_after(CREDIT as f64, &one_fault_one_step()),
        STEP + CREDIT
    );
}

fn one_fault_one_step() -> [(Cost, u64); 2] {
    [(Cost::SlowFault, 1), (Cost::VmExit, 1)]
}
