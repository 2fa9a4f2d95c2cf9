//! How fast the simulation runs on this host: the baton's switch cost and hook rates.
//!
//! `cargo run --release -p slat-vt --example sim_speed`. Three runs:
//! - `switch`: two CPUs with lookahead 0, each fencing in a loop: every fence passes the
//!   baton, so wall time / switches is the cost of one switch (unpark + park + the
//!   scheduler's bookkeeping);
//! - `lock ping-pong`: two CPUs taking one mutex in turn (the host profile: `barging`,
//!   lookahead 1 µs), hooks and switches per wall second;
//! - `one cpu`: RMWs with nobody to switch to: the hook's own cost.

use std::time::Instant;

use slat::clock::{Clock, Cost, LockMode};
use slat_vt::{Entry, Profile, Sim, Virtual};

fn run(name: &str, profile: Profile, cpus: usize, body: fn(usize)) {
    let sim = Sim::new(profile, 0).expect("valid profile");
    let handles: Vec<_> = (0..cpus)
        .map(|i| sim.register(&format!("cpu{i}")).expect("register"))
        .collect();
    let start = Instant::now();
    std::thread::scope(|s| {
        for (i, h) in handles.into_iter().enumerate() {
            s.spawn(move || {
                if h.attach().is_ok() {
                    body(i);
                }
            });
        }
    });
    let wall = start.elapsed().as_secs_f64();
    match sim.finish() {
        Ok(st) => println!(
            "{name:16} {:>10} hooks {:>9} switches {:>8.2} M hooks/s {:>8} ns/switch  virtual {} µs",
            st.hooks,
            st.switches,
            st.hooks as f64 / wall / 1e6,
            if st.switches > 1 {
                format!("{:.0}", wall * 1e9 / st.switches as f64)
            } else {
                "-".to_string()
            },
            sim.elapsed_ns() / 1000
        ),
        Err(e) => println!("{name}: {e}"),
    }
}

const N: u64 = 200_000;
static LOCK: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

fn main() {
    let mut zero_l = Profile::host_default();
    zero_l.model.lookahead = Entry::new(0.0, "every fence switches");
    run("switch", zero_l, 2, |_| {
        for _ in 0..N {
            Virtual::charge(Cost::TlbHit, 1);
            Virtual::fence();
        }
    });
    run("lock ping-pong", Profile::host_default(), 2, |_| {
        let addr = slat::clock::addr_of(&LOCK);
        for _ in 0..N {
            Virtual::lock(addr, LockMode::Exclusive);
            let g = LOCK.lock();
            Virtual::charge(Cost::WalkStep, 20);
            drop(g);
            Virtual::unlock(addr, LockMode::Exclusive);
            Virtual::charge(Cost::GuestAccess, 4);
        }
    });
    run("one cpu", Profile::host_default(), 1, |_| {
        let x = 0u64;
        for _ in 0..5 * N {
            Virtual::rmw(slat::clock::addr_of(&x));
            Virtual::charge(Cost::TlbHit, 1);
        }
    });
}
