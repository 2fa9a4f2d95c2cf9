//! The line model prices the calibration's own micro-benchmarks as they measure: two CPUs
//! taking turns on one line, each spinning on loads until its turn and then swapping, cost a
//! transfer (the load's, into a shared copy) plus an upgrade (the swap invalidating the other
//! copy) per turn, `line_transfer + invalidate`, which is what `slat calibrate` measures as
//! that pattern's half round trip. The model charged the swap a second transfer before (and a
//! load after the spin a third): 2× and 3× the measured turn.

use std::sync::atomic::{AtomicU64, Ordering};

use slat::clock::{addr_of, Clock};
use slat_vt::Virtual;

use crate::common::{self, DRAM, LT};

/// `invalidate` in [`common::profile`], ns.
const INV: u64 = 10;
const TURNS: u64 = 100;

#[repr(align(64))]
struct Own<T>(T);

/// Two CPUs take `TURNS` turns each on one line: CPU `i` waits (a spin on loads) for the
/// count to be `2k + i`, optionally loads it once more, and swaps it to `2k + i + 1`.
/// Returns the later CPU's final clock, ns.
fn turns(load_after_spin: bool) -> u64 {
    let sim = common::sim(common::profile(), 0);
    let line = Own(AtomicU64::new(0));
    let line = &line.0;
    let end = parking_lot::Mutex::new(0u64);
    common::run(&sim, 2, |i| {
        let addr = addr_of(line);
        for k in 0..TURNS {
            let from = 2 * k + i as u64;
            Virtual::spin_until(&[addr], &mut || line.load(Ordering::Acquire) == from);
            if load_after_spin {
                Virtual::shared_load(addr);
            }
            Virtual::rmw(addr);
            let swapped =
                line.compare_exchange(from, from + 1, Ordering::AcqRel, Ordering::Relaxed);
            assert!(swapped.is_ok(), "turn {k} of CPU {i}");
        }
        let mut e = end.lock();
        *e = (*e).max(Virtual::now_ns());
    });
    sim.finish().expect("clean run");
    let e = *end.lock();
    e
}

#[test]
fn a_turn_after_a_spin_costs_a_transfer_and_an_upgrade() {
    // The first swap misses (the line was in no cache); each of the other 2 × TURNS − 1
    // turns is a spin that sees the other CPU's swap a transfer after it, then an upgrade.
    let per_turn = LT + INV;
    for load_after_spin in [false, true] {
        assert_eq!(
            turns(load_after_spin),
            DRAM + (2 * TURNS - 1) * per_turn,
            "load after the spin: {load_after_spin}"
        );
    }
}
