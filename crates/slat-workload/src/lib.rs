//! What slat's two machines share: `slat-machine` (simulated hardware on slat's page tables)
//! and `slat-kvm` (real guests on `/dev/kvm`) run the same KVM-selftest workloads over the
//! same test region, and this crate holds that common ground once.
//!
//! | module | holds |
//! |---|---|
//! | [`backing`] | [`Backing`]: the selftests' `-s` kinds of host memory |
//! | [`cpus`] | `-c` CPU lists, [`cpus::PinPlan`], [`cpus::VcpuTids`]: pinning vCPU threads |
//! | [`guest_ram`] | [`GuestRam`]: one host mapping of a backing (hugetlb pool check, THP, prefault, [`GuestRam::thp_bytes`]) |
//! | [`size`] | [`parse_size`], [`format_size`], [`SizeError`] |
//! | [`layout`] | [`Layout`] of the test region, [`FIRST_SLOT`] (pages are `slat_addr::PAGE_SIZE`) |
//! | [`pattern`] | [`PassParams`], [`ParkMiller`], [`Pattern`], [`WriterPattern`], [`MEMSTRESS_PATTERN`], [`native_pass`] |
//! | [`pass`] | [`VcpuPass`], [`PassReport`] |
//! | [`rendezvous`] | [`Rendezvous`]: the host releases its vCPU threads with a job and waits for them to sync |
//! | [`native`] | [`native_baseline`] |
//! | [`dirty_config`] | [`DirtyConfig`], [`MANUAL_PROTECT_ENABLE`], [`INITIALLY_SET`] |
//! | [`uffd`] | demand paging through userfaultfd: [`uffd::UffdServer`] (MISSING / MINOR handler threads) |
//! | [`test_machine`] | [`TestMachine`], the trait both machines implement |
//! | [`dirty_oracle`] | the dirty-log oracle, one generic [`dirty_oracle::run`] |
//!
//! The patterns are the contract with the guest code `slat-kvm` assembles and with the
//! simulated vCPUs: both follow [`Pattern`] and [`WriterPattern`] exactly, and tests compare
//! guest memory with them.
//!
//! # The engine feature
//!
//! The simulated machine hands [`GuestRam`] to the engine as a memslot's host memory, which
//! needs `unsafe impl slat::HostMemory for GuestRam`. The orphan rule allows that impl only in
//! the crate of the trait or of the type; the engine must not know its users, so it lives here,
//! behind the `engine` feature: `slat-machine` turns it on, while `slat-kvm` — which runs real
//! guests and has no use for the engine — builds this crate without it and does not depend on
//! the engine at all.
//!
//! # Soundness
//!
//! Memory a machine touches enters through [`GuestRam`], which keeps it mapped until dropped
//! and never lends out references to its bytes, or through an `unsafe fn` ([`native_pass`])
//! whose `# Safety` section states the contract.

#![deny(missing_docs)]

pub mod backing;
mod barrier;
pub mod cpus;
pub mod dirty_config;
pub mod dirty_oracle;
pub mod error;
pub mod guest_ram;
pub mod latency;
pub mod layout;
pub mod native;
pub mod pass;
pub mod pattern;
pub mod rendezvous;
pub mod size;
pub mod test_machine;
pub mod uffd;

pub use backing::Backing;
pub use barrier::{Gate, ThreadBarrier};
pub use dirty_config::{DirtyConfig, INITIALLY_SET, MANUAL_PROTECT_ENABLE};
pub use error::WorkloadError;
pub use guest_ram::{GuestRam, RamError};
pub use latency::{latency_histogram, LatencyHistogram, WriteLatency};
pub use layout::{Layout, RegionSize, RegionSpec, TestRegion, FIRST_SLOT};
pub use native::native_baseline;
pub use pass::{PassReport, VcpuPass};
pub use pattern::{native_pass, ParkMiller, PassParams, Pattern, WriterPattern, MEMSTRESS_PATTERN};
pub use rendezvous::{Rendezvous, RendezvousError, MAX_RENDEZVOUS_VCPUS};
pub use size::{format_size, parse_size, SizeError};
pub use test_machine::{log_mode, log_slot_id, log_slots, TestMachine};
