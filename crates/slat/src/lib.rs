//! slat: a concurrent, user-space second-stage MMU (x86 EPT, arm64 stage-2) for hypervisors.
//!
//! A [`Vm`] owns a second-stage page table that maps guest physical memory onto host memory
//! through [`memslot`]s. Host memory enters through a [`HostRange`] that keeps it alive (over
//! any [`HostMemory`], such as [`HostBuffer`]) or through the `unsafe` [`HostRange::from_raw`].
//! vCPUs ([`Vcpu`], bound to their VM) resolve their faults with [`Vcpu::handle_fault`]: a
//! lock-free fast path for write-protection and access-tracking faults, which needs the
//! vCPU's [`GuestMode`] token, and a slow path that installs mappings with compare-and-swap
//! under the MMU lock held for read, so faults on different vCPUs proceed in parallel.
//! Operations that remove or restrict translations complete a remote TLB flush (see
//! [`flush`]) before they return.
//!
//! ```
//! use slat::{Access, Fault, FaultOutcome, HostBuffer, HostRange, MemslotFlags, Vm, VmConfig};
//! use slat::format::Ept;
//! use std::sync::Arc;
//!
//! let vm = Vm::<Ept>::new(VmConfig::default());
//! let host = HostRange::new(Arc::new(HostBuffer::new(4096, 4096)?))?;
//! vm.add_memslot(1, 0x10_0000, 4096, host, MemslotFlags::empty())?;
//! let mut vcpu = vm.create_vcpu(0);
//! let f = Fault { gpa: 0x10_0000, access: Access::Write, present: false, private: false };
//! assert_eq!(vcpu.handle_fault(f), FaultOutcome::Fixed);
//! assert_eq!(vm.stats().leaves_4k, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Layout
//!
//! One concept per module, in layers; a module uses only modules below it (the allowed graph
//! is spelled out and checked by `tests/layering.rs`):
//!
//! | layer | modules |
//! |---|---|
//! | base | `sync` (std/loom switch), [`config`] ([`VmConfig`], variant enums), [`format`](mod@format), [`stats`], [`host_memory`], `test_hooks` |
//! | cache maintenance | [`cmo`] |
//! | page table | `mmu`: `table`, `walk` (the one walker), `lock`, `spte` (the one SPTE-update path), [`flush`] (`PendingFlush`), `zap`, `inspect` |
//! | memslots | `dirty::bitmap` (a slot's bitmap), [`memslot`] (the set, publishing, operations), `dirty::ring` |
//! | features | [`huge_page`] (split, recovery), [`direct_map`] (the host kernel's direct map over a private pool, lazy acceptance), [`dirty`] (mark, capabilities, enable, re-arm, harvest), [`age`], `fault` (fast and slow path) |
//! | facade | [`Vm`] (holds the page table, the memslots and the dirty log; its methods hand each module the parts it needs), [`Vcpu`] |
//! | hardware | [`hw`]: what a hardware walker and TLB need (the root, table entries, guest mode) |

#![deny(missing_docs)]

pub mod age;
pub mod cmo;
pub mod config;
pub mod direct_map;
pub mod dirty;
mod fault;
pub mod format;
pub mod host_memory;
pub mod huge_page;
pub mod hw;
pub mod memslot;
mod mmu;
pub mod stats;
mod sync;
mod test_hooks;
mod vcpu;
mod vm;

pub use mmu::flush;

pub use age::{AgeFlush, AgeReport, IdleBitmap, IdleError, WorkingSet};
pub use config::{
    CmoPolicy, DirectMapPolicy, DirtyTrack, GetLogVariant, MmuLockKind, ParseVariantError,
    RebuildOrder, RecoverVariant, VmConfig, WrprotVariant,
};
pub use dirty::DirtyLogError;
pub use fault::{Fault, FaultOutcome};
pub use flush::{FlushError, GuestMode};
pub use format::{Access, Ept, Level, PteFormat, Stage2};
pub use host_memory::{HostBuffer, HostBufferError, HostMemory, HostRangeError};
pub use memslot::{
    HostRange, MemoryAttributeError, MemoryAttributes, Memslot, MemslotError, MemslotFlags,
    MemslotSet, SlotId,
};
pub use mmu::inspect::Audit;
pub use stats::Stats;
pub use vcpu::Vcpu;
pub use vm::Vm;
