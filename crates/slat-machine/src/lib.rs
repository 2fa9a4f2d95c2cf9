//! Simulated hardware for the slat engine: guest RAM backed by host mappings, vCPU threads
//! with a software TLB and a hardware page walker that reads the real PTE format, physical-CPU
//! scheduling, and KVM's guest workloads.

#![deny(missing_docs)]

pub mod cpu;
pub mod machine;
pub mod memstress;
pub mod ram;
pub mod sched;
pub mod tlb;

pub use cpu::{Cpu, CpuCounters, Exit};
pub use machine::{
    native_baseline, Layout, Machine, MachineConfig, MachineError, PassReport, VcpuPass,
};
pub use memstress::PassParams;
pub use ram::{Backing, GuestRam, RamError};
