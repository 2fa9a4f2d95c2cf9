//! Snapshot and reset of a [`TestMachine`]'s test region — the simulated machine
//! (`slat_machine::Machine`) and real KVM guests (`slat_kvm::KvmMachine`) through one code
//! path, as `slat_workload::dirty_oracle` drives either.
//!
//! [`MachineLog`] is a machine's dirty log as a [`slat_dirty::DirtyLogSource`], so both
//! machines are harvested by `slat_dirty`'s transactional [`slat_dirty::Harvester`] — the one
//! a VMM uses on its own VM, and the one `slat-migrate` uses.
//!
//! [`MachineSnapshot`] copies the test region (one [`slat_dirty::GuestRegion`] per memslot, so
//! a slot's dirty bitmap is its region's), and [`MachineSnapshot::reset`] takes a dirty set
//! from the harvester — GET_DIRTY_LOG, GET + CLEAR with manual protect, or the dirty rings,
//! **re-armed before** the take returns (the ordering argument is in
//! [`slat_dirty::snapshot`]) — copies its pages back and commits it (or aborts it if the copy
//! fails). The snapshot itself is `slat_dirty`'s: no ioctl of its own.
//!
//! [`MachineSnapshot::take_child`] takes an incremental snapshot over it ([`MachineChild`],
//! over `slat_dirty`'s [`ChildSnapshot`]): only the pages written since the base; resets go to
//! the child or back to the base, each copying only what changed.

#![deny(missing_docs)]

mod machine_log;
mod machine_snapshot;

pub use machine_log::{LogTimes, MachineHarvester, MachineLog};

pub use machine_snapshot::{MachineChild, MachineSnapshot, ResetError, ResetReport};
pub use slat_dirty::snapshot::{ChildSnapshot, DirtyPages, Snapshot, SnapshotError};
#[doc(no_inline)]
pub use slat_workload::TestMachine;
