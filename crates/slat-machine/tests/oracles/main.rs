//! The ring and churn oracles, one binary without other tests: each runs its rounds for a fixed
//! time and wants every core for its vCPUs, so its tests run one at a time (`SERIAL`) and no
//! test of another file shares the process's CPUs with them. (The churn oracle's virtual-time
//! rounds need no core of their own, but share `SERIAL` so no real-time round competes with
//! them for the host either.)

use std::sync::Mutex;

#[macro_use]
#[path = "../machine/common/mod.rs"]
mod common;

mod churn_oracle;
mod ring_oracle;

/// Line-aligned allocations while a simulation exists (the churn oracle in virtual time), as in
/// the `slat` binary: the cache-line model then sees the same layout in every run of a seed,
/// whatever the heap's history (docs/design/virtual-time.md §5). Without a simulation it is
/// the system allocator.
#[global_allocator]
static ALLOC: slat_vt::LineAligned = slat_vt::LineAligned;

/// Held by every test of both oracles for its whole run.
static SERIAL: Mutex<()> = Mutex::new(());
