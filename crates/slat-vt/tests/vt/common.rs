//! Running N simulated CPUs on real threads, and a profile with round numbers.

use slat::clock::Cost;
use slat_vt::{CpuHandle, Entry, LockPolicy, Profile, Sim};

/// A critical section's cost, ns (charged as one `ZeroPage`).
pub const S: u64 = 5_000;
/// A step of work, ns (charged as one `VmExit`).
pub const STEP: u64 = 1_000;
/// The line transfer, ns (also the `fifo` hand-off).
pub const LT: u64 = 100;
/// The `barging` hand-off, ns.
pub const HANDOFF: u64 = 2_000;
/// A DRAM miss, ns.
pub const DRAM: u64 = 80;

/// Round numbers, `fifo` locks, free local RMWs (so sections measure exactly).
pub fn profile() -> Profile {
    let mut p = Profile::host_default();
    let m = &mut p.model;
    m.rmw_local = Entry::new(0.0, "test");
    m.line_transfer = Entry::new(LT as f64, "test");
    m.invalidate = Entry::new(10.0, "test");
    m.dram_miss = Entry::new(DRAM as f64, "test");
    m.handoff = Entry::new(HANDOFF as f64, "test");
    m.lookahead = Entry::new(1_000.0, "test");
    m.lock_policy.policy = LockPolicy::Fifo;
    p.set_cost(Cost::ZeroPage, Entry::new(S as f64, "test"));
    p.set_cost(Cost::VmExit, Entry::new(STEP as f64, "test"));
    p
}

pub fn sim(p: Profile, seed: u64) -> Sim {
    Sim::new(p, seed).expect("valid profile")
}

/// Registers `n` CPUs `cpu0..` (all before any thread starts: a fixed order), runs `f(i)` on
/// each from its own thread, and returns once all have exited.
pub fn run<F: Fn(usize) + Sync>(sim: &Sim, n: usize, f: F) {
    let handles: Vec<CpuHandle> = (0..n)
        .map(|i| sim.register(&format!("cpu{i}")).expect("register"))
        .collect();
    std::thread::scope(|s| {
        for (i, h) in handles.into_iter().enumerate() {
            let f = &f;
            s.spawn(move || {
                h.attach().expect("attach");
                f(i);
                drop(h);
            });
        }
    });
}

/// Each CPU's final clock, ps.
pub fn clocks(sim: &Sim) -> Vec<u64> {
    sim.cpus().iter().map(|c| c.clock_ps).collect()
}
