//! slat-harness's integration tests as one binary (one link instead of one per file). Three
//! files stay binaries of their own because they assert on rates in wall-clock time, which
//! CPU-heavy neighbours from other files would skew: tests/migrate_dirty_limit.rs (dirtying
//! rates against the limit), tests/migrate_faults.rs (the source guest's progress within
//! 30 ms) and tests/migrate_loopback.rs (a guest outrunning the link gets throttled).

#[path = "../common/mod.rs"]
mod common;

mod harvest_abort;
mod migrate_fuzz;
mod migrate_hostile;
mod migrate_kvm;
mod migrate_postcopy;
mod migrate_streams;
mod migrate_transports;
mod public_paths;
mod snapshot_machines;
