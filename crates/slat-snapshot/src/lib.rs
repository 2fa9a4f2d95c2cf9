//! Snapshot and reset of a [`TestMachine`]'s test region — the simulated machine
//! (`slat_machine::Machine`) and real KVM guests (`slat_kvm::KvmMachine`) through one code
//! path, as `slat_workload::dirty_oracle` drives either.
//!
//! [`MachineSnapshot`] copies the test region (one [`slat_dirty::GuestRegion`] per memslot, so
//! a slot's dirty bitmap is its region's), and [`MachineSnapshot::reset`] harvests the
//! machine's dirty log — GET_DIRTY_LOG, GET + CLEAR with manual protect, or the dirty rings —
//! **re-arming it before** it copies the dirty pages back (the ordering argument is in
//! [`slat_dirty::snapshot`]). The snapshot itself is `slat_dirty`'s: no ioctl of its own.

#![deny(missing_docs)]

mod machine_snapshot;

pub use machine_snapshot::{MachineSnapshot, ResetError, ResetReport};
pub use slat_dirty::snapshot::{DirtyPages, Snapshot, SnapshotError};
#[doc(no_inline)]
pub use slat_workload::TestMachine;
