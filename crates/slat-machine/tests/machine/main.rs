//! The simulated machine's integration tests as one binary: each file under tests/machine/ is
//! a module, so the engine and machine are instantiated and linked once rather than once per
//! file.

#[macro_use]
mod common;

mod aging_oracle;
mod churn_oracle;
mod conversion;
mod dirty_oracle;
mod overcommit;
mod pinning;
mod private_memory;
mod ring_oracle;
mod sizes;
mod stage2;
mod timed_pass;
mod trust;
