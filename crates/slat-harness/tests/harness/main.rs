//! slat-harness's integration tests as one binary (one link instead of one per file). The
//! dirty-limit tests (tests/migrate_dirty_limit.rs) stay a binary of their own: they measure
//! dirtying rates against wall-clock windows, which CPU-heavy neighbours would skew.

#[path = "../common/mod.rs"]
mod common;

mod harvest_abort;
mod migrate_faults;
mod migrate_fuzz;
mod migrate_hostile;
mod migrate_kvm;
mod migrate_loopback;
mod migrate_transports;
mod public_paths;
mod snapshot_machines;
