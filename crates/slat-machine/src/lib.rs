//! Simulated hardware for the slat engine: guest RAM backed by host mappings, vCPU threads
//! with a software TLB and a hardware page walker that reads the real PTE format, physical-CPU
//! scheduling, and KVM's guest workloads.

#![deny(missing_docs)]

pub mod conversion;
pub mod cpu;
/// The dirty-log oracle, shared with the KVM machine ([`Machine`] is a [`TestMachine`]).
pub mod dirty_oracle {
    pub use slat_workload::dirty_oracle::*;
}
pub mod machine;
pub mod memstress;
pub mod paced;
pub mod page_table_stage;
pub mod ram;
pub mod sched;
pub mod tlb;

pub use cpu::{Cpu, CpuCounters, Exit, RingFullHandler};
pub use machine::{
    DirtyConfig, Layout, Machine, MachineConfig, MachineError, PassReport, VcpuPass, Workload,
};
pub use memstress::PassParams;
pub use paced::{PacedParams, Pacer, PacerError, MAX_PACED_VCPUS};
pub use ram::{Backing, GuestRam, RamError};
pub use slat_workload::{native_baseline, RegionSpec, TestMachine, FIRST_SLOT};
