//! slat: a concurrent, user-space second-stage MMU (x86 EPT, arm64 stage-2) for hypervisors.
//!
//! A [`Vm`] owns a second-stage page table that maps guest physical memory onto host memory
//! through [`Memslot`]s. Host memory enters through a [`HostRange`] that keeps it alive (over
//! any [`HostMemory`], such as [`HostBuffer`]) or through the `unsafe` [`HostRange::from_raw`].
//! vCPUs ([`Vcpu`], bound to their VM) resolve their faults with [`Vcpu::handle_fault`]: a
//! lock-free fast path for write-protection and access-tracking faults, which needs the
//! vCPU's [`GuestMode`] token, and a slow path that installs mappings with compare-and-swap
//! under the MMU lock held for read, so faults on different vCPUs proceed in parallel.
//! Operations that remove or restrict translations complete a remote TLB flush (see
//! [`PendingFlush`]) before they return.
//!
//! Addresses are typed with the units of the `slat-addr` crate (guest physical address
//! `Gpa`, frame `Gfn`, host address `Hva`, page index in a slot `PageIndex`); slat does not
//! re-export them.
//!
//! ```
//! use slat::{Access, Fault, FaultOutcome, HostBuffer, HostRange, MemslotFlags, PteFormat};
//! use slat::{Vm, VmConfig};
//! use slat::Ept;
//! use slat_addr::Gpa;
//! use std::sync::Arc;
//!
//! let vm = Vm::<Ept>::new(VmConfig::default());
//! let host = HostRange::new(Arc::new(HostBuffer::new(4096, 4096)?))?;
//! let gpa = Gpa::new(0x10_0000);
//! vm.add_memslot(1, gpa, 4096, host.clone(), MemslotFlags::empty())?;
//! let mut vcpu = vm.create_vcpu(0);
//! let f = Fault { gpa, access: Access::Write, present: false, private: false };
//! assert_eq!(vcpu.handle_fault(f), FaultOutcome::Fixed);
//! assert_eq!(vm.stats().leaves_4k, 1);
//! // The leaf maps the frame onto the slot's host page.
//! let (entry, level) = vm.lookup(gpa.gfn()).expect("mapped");
//! assert_eq!((Ept::output_addr(entry), level), (host.addr(), 1));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A frame number is not an address: passing a `Gfn` where a `Gpa` is wanted does not compile.
//!
//! ```compile_fail,E0308
//! use slat::{HostBuffer, HostRange, MemslotFlags, Vm, VmConfig};
//! use slat::Ept;
//! use slat_addr::Gpa;
//! use std::sync::Arc;
//!
//! let vm = Vm::<Ept>::new(VmConfig::default());
//! let host = HostRange::new(Arc::new(HostBuffer::new(4096, 4096).unwrap())).unwrap();
//! let gpa = Gpa::new(0x10_0000);
//! vm.add_memslot(1, gpa.gfn(), 4096, host, MemslotFlags::empty()).unwrap();
//! ```
//!
//! # Layout
//!
//! One concept per module, in layers; a module uses only modules below it (the allowed graph
//! is spelled out and checked by `tests/engine/layering.rs`):
//!
//! | layer | modules |
//! |---|---|
//! | base | `sync` (std/loom switch), `config` ([`VmConfig`], variant enums), `format` ([`PteFormat`]), `stats` ([`Stats`]), `host_memory` ([`HostMemory`]), `test_hooks` |
//! | cache maintenance | [`cmo`] |
//! | page table | `mmu`: `table`, `walk` (the one walker), `lock`, `spte` (the one SPTE-update path), `flush` ([`GuestMode`], [`PendingFlush`]), `zap`, `inspect` |
//! | memslots | `dirty::bitmap` (a slot's bitmap), `memslot` (the set, publishing, operations), `dirty::ring` |
//! | features | `huge_page` (split, recovery), [`direct_map`] (the host kernel's direct map over a private pool, lazy acceptance), [`dirty`] (mark, capabilities, enable, re-arm, harvest), `age` ([`IdleBitmap`], [`WorkingSet`]), `fault` (fast and slow path) |
//! | facade | [`Vm`] (holds the page table, the memslots and the dirty log; its methods hand each module the parts it needs), [`Vcpu`] |
//! | hardware | [`hw`]: what a hardware walker and TLB need (the root, table entries, guest mode) |

#![deny(missing_docs)]

// One public path per item (checked by slat-harness's `tests/harness/public_paths.rs`): the types a user
// names live in private modules and are re-exported here; the public modules are cohesive groups
// whose items are not re-exported here.
pub mod clock;
pub mod cmo;
pub mod direct_map;
pub mod dirty;
pub mod hw;

mod age;
mod config;
mod fault;
mod format;
mod host_memory;
mod huge_page;
mod memslot;
mod mmu;
mod stats;
mod sync;
mod test_hooks;
mod vcpu;
mod vm;

pub use age::{
    AgeFlush, AgeReport, IdleBitmap, IdleError, WorkingSet, CHUNK_PAGES as AGE_CHUNK_PAGES,
};
pub use config::{
    CmoPolicy, DirectMapPolicy, DirtyTrack, GetLogVariant, MmuLockKind, ParseVariantError,
    RebuildOrder, RecoverVariant, VmConfig, WrprotVariant,
};
pub use fault::{Fault, FaultOutcome};
pub use format::{Access, Ept, LeafPerms, Level, PteFormat, Stage2, Timed};
pub use host_memory::{
    phantom_addr, HostBuffer, HostBufferError, HostMemory, HostRange, HostRangeError,
    PHANTOM_POOL_FRAMES,
};
pub use memslot::{
    MemoryAttributeError, MemoryAttributes, Memslot, MemslotError, MemslotFlags, MemslotSet, SlotId,
};
pub use mmu::flush::{FlushError, GuestMode, PendingFlush};
pub use mmu::inspect::Audit;
pub use stats::{MmuMemory, Stats};
pub use vcpu::Vcpu;
pub use vm::Vm;
