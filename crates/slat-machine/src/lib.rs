//! Simulated hardware for the slat engine: guest RAM backed by host mappings, vCPU threads
//! with a software TLB and a hardware page walker that reads the real PTE format, physical-CPU
//! scheduling, and KVM's guest workloads.

#![deny(missing_docs)]

pub mod conversion;
pub mod cpu;
pub mod machine;
pub mod memstress;
pub mod paced;
pub mod page_table_stage;
pub mod sched;
pub mod tlb;
pub mod vtime;

pub use cpu::{guest_round_trip_stand_in, Cpu, CpuCounters, Exit, RingFullHandler};
pub use machine::{Machine, MachineConfig, MachineError, PassReport, VcpuPass, Workload};
pub use paced::{PacedParams, Pacer, PacerError, MAX_PACED_VCPUS};
