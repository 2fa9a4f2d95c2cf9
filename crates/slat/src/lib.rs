//! slat: a concurrent, user-space second-stage MMU (x86 EPT, arm64 stage-2) for hypervisors.
//!
//! A [`Vm`] owns a second-stage page table that maps guest physical memory onto host memory
//! through [`memslot`]s. vCPUs ([`Vcpu`]) resolve their faults with [`Vm::handle_fault`]:
//! a lock-free fast path for write-protection and access-tracking faults, and a slow path
//! that installs mappings with compare-and-swap under the MMU lock held for read, so faults on
//! different vCPUs proceed in parallel. Operations that remove or restrict translations
//! complete a remote TLB flush (see [`flush`]) before they return.
//!
//! ```
//! use slat::{Access, Fault, FaultOutcome, HostRange, Vm, VmConfig};
//! use slat::format::Ept;
//!
//! let vm = Vm::<Ept>::new(VmConfig::default());
//! let mut host = vec![0u8; 3 * 4096];
//! let addr = (host.as_mut_ptr() as u64 + 4095) & !4095; // a 4 KiB-aligned host page
//! vm.add_memslot(1, 0x10_0000, 4096, HostRange { addr, len: 4096, page_size: 4096 }, 0)
//!     .unwrap();
//! let mut vcpu = vm.create_vcpu(0);
//! let f = Fault { gpa: 0x10_0000, access: Access::Write, present: false };
//! assert_eq!(vm.handle_fault(&mut vcpu, f), FaultOutcome::Fixed);
//! assert_eq!(vm.stats().leaves_4k, 1);
//! vm.destroy_vcpu(vcpu);
//! ```

#![deny(missing_docs)]

pub mod age;
pub mod cmo;
pub mod dirty;
mod fault;
pub mod flush;
pub mod format;
pub mod huge_page;
pub mod memslot;
pub mod stats;
mod sync;
pub mod table;
mod vm;
pub(crate) mod walk;

pub use age::{AgeFlush, AgeReport, IdleBitmap, IdleError, WorkingSet};
pub use cmo::CmoPolicy;
pub use dirty::{DirtyLogError, DirtyTrack, GetLogVariant, RecoverVariant};
pub use fault::{Fault, FaultOutcome};
pub use format::{Access, Ept, Level, PteFormat, Stage2};
pub use huge_page::RebuildOrder;
pub use memslot::{HostRange, Memslot, MemslotError, MemslotFlags, MemslotSet, SlotId};
pub use stats::Stats;
pub use vm::{Audit, MmuLockKind, Vcpu, Vm, VmConfig};
