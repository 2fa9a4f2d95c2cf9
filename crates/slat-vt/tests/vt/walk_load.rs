//! `Clock::walk_load` calls the caller's load outside the simulation's lock: a load that
//! itself reports to the clock returns instead of waiting for the hook it runs in.

use slat::clock::Clock;
use slat_vt::Virtual;

use crate::common;

#[test]
fn a_walk_load_whose_load_calls_a_hook_returns() {
    let sim = common::sim(common::profile(), 0);
    let seen = std::sync::Mutex::new(None);
    common::run(&sim, 1, |_| {
        let r = Virtual::walk_load(64, || {
            Virtual::rmw(128);
            Virtual::entry_replaced(64, 3);
            5
        });
        *seen.lock().unwrap() = Some(r);
    });
    sim.finish().expect("finish");
    // The CPU's own write is never one it has not seen.
    assert_eq!(*seen.lock().unwrap(), Some((5, 5)));
}
