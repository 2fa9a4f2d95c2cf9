//! slat's benchmark harness: everything that exists only to benchmark and drive slat's own
//! machines (the simulated machine of `slat-machine` and the `/dev/kvm` guest of `slat-kvm`)
//! as clients of the libraries. The libraries (`slat`, `slat-dirty`, `slat-migrate`) never
//! depend on this crate; `slat-cli` does.
//!
//! - [`MachineLog`]: a `slat_workload::TestMachine`'s dirty log as a [`slat_dirty::DirtyLogSource`], so
//!   both machines are harvested by `slat_dirty`'s transactional [`slat_dirty::Harvester`] —
//!   the one a VMM uses on its own VM, and the one `slat-migrate` uses.
//! - [`MachineSnapshot`]: snapshot and reset of either machine's test region over
//!   `slat_dirty`'s [`slat_dirty::Snapshot`]; [`MachineSnapshot::reset`] takes a dirty set from the
//!   harvester (re-armed before the take returns: the ordering argument is in
//!   [`slat_dirty::Snapshot`]), copies its pages back and commits it (or aborts it if the copy
//!   fails). [`MachineSnapshot::take_child`] takes an incremental snapshot over it
//!   ([`MachineChild`]).
//! - [`migrate`]: the benchmark guests `slat migrate` moves — a [`migrate::BenchGuest`] is a
//!   `slat_migrate::Guest` over either machine with a synthetic workload.
//! - [`error`]: the benchmark guests' own errors.

#![deny(missing_docs)]

pub mod error;
mod machine_log;
mod machine_snapshot;
pub mod migrate;

pub use error::{BenchError, ShapeError};
pub use machine_log::{LogTimes, MachineHarvester, MachineLog};
pub use machine_snapshot::{MachineChild, MachineSnapshot, ResetError, ResetReport};
