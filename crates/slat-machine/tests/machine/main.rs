//! The simulated machine's integration tests as one binary: each file under tests/machine/ is
//! a module, so the engine and machine are instantiated and linked once rather than once per
//! file. Two kinds stay out: the time-boxed oracles that want every core (tests/oracles/), and
//! the pinning test (tests/pinning.rs), which finds its vCPU threads by name among all of the
//! process's threads, where other tests' machines have vCPU threads of the same names.

#[macro_use]
mod common;

mod aging_oracle;
mod clock_hooks;
mod conversion;
mod dirty_oracle;
mod host_cpu_flush;
mod overcommit;
mod phantom;
mod private_memory;
mod sizes;
mod spawn_failure;
mod stage2;
mod timed_pass;
mod trust;
