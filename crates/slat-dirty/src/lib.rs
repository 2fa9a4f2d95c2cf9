//! Dirty-page tracking for any KVM virtual machine, on the caller's own `kvm-ioctls` `VmFd`,
//! `VcpuFd`s and guest memory.
//!
//! - [`log`]: the dirty-log ioctls `kvm-ioctls` lacks or wraps with an allocation per call —
//!   `KVM_GET_DIRTY_LOG` into a caller's buffer, `KVM_CLEAR_DIRTY_LOG` (manual protect) in any
//!   chunk KVM accepts, [`enable_manual_protect`] (with or without `INITIALLY_SET`), and the
//!   per-vCPU dirty ring ([`RingSize`], [`enable_dirty_ring`], [`DirtyRing`],
//!   [`reset_dirty_rings`]) with KVM's rules checked: size a power of two in KVM's bounds, given
//!   in bytes to the capability, mapped only if the vCPU's ring really is that size.
//! - [`Memslot`]: a slot handle that knows its page count, so every bitmap KVM reads or writes
//!   is sized from the slot, never from a length the caller claims. A slot is created through
//!   [`Memslot::register`] or, if the caller already registered it, described with
//!   [`Memslot::adopt`]; both are `unsafe` and state what the caller promises.
//! - [`ranges`](mod@ranges): bitmap → `(first_page, pages)` runs, a word at a time, skipping zero words.
//! - [`harvest`]: one transactional harvest over the three log modes, generic over where the
//!   log comes from ([`DirtyLogSource`]: a VMM's own VM through [`KvmLog`], the default, or
//!   any other source, e.g. slat's benchmark machines): [`Harvester::take`]
//!   returns a [`DirtySet`] to copy; [`DirtySet::commit`] when the copy succeeded; abort (or
//!   drop) and every page of the set is reported again by the next take. Writes the VMM made
//!   itself (devices, `vm-memory`'s `AtomicBitmap::get_and_reset`) are merged with
//!   [`Harvester::mark_words`] / [`Harvester::mark_pages`], or, with the `vm-memory` feature,
//!   straight from the `AtomicBitmap` (`Harvester::mark_atomic_bitmap`).
//! - [`dirty_rate`]: how fast the guest dirties memory, without migrating (QEMU's
//!   `calc-dirty-rate`): [`DirtyRate`] samples any [`DirtyLogSource`] for distinct pages per
//!   second, overall and per vCPU (ring entries name their vCPU; bitmaps need per-vCPU
//!   regions).
//! - [`snapshot`]: snapshot and reset of guest memory for fuzzers and sandboxes — copy back
//!   only the dirty pages ([`Snapshot`], [`DirtyPages`]), incremental snapshots
//!   ([`ChildSnapshot`]), byte-exact verification; re-arm the log before the copy.
//!
//! No safe function of this crate lets KVM (or this crate) write outside a buffer or a
//! mapping: bitmap lengths come from the slot, ring indices are masked into a mapping whose
//! size was checked against KVM, and sizes from callers go through checked arithmetic.
//! Errors are [`Error`].

#![deny(missing_docs)]

pub mod dirty_rate;
pub mod error;
pub mod harvest;
pub mod log;
pub mod memslot;
pub mod ranges;
pub mod snapshot;
pub mod source;

pub use dirty_rate::{Attribution, DirtyRate, Measurement, Sample, SampleWindow, WindowError};
pub use error::Error;
pub use harvest::{DirtySet, Harvester, LogMode};
pub use log::{
    clear_dirty_log, enable_dirty_ring, enable_manual_protect, get_dirty_log,
    get_dirty_log_unchecked, reset_dirty_rings, DirtyRing, RingSize, KVM_DIRTY_GFN_F_DIRTY,
    KVM_DIRTY_GFN_F_RESET,
};
pub use memslot::{bitmap_words, Memslot};
pub use ranges::{ranges, Ranges};
pub use snapshot::{ChildSnapshot, DirtyPages, GuestRegion, ResetStats, Snapshot, SnapshotError};
pub use source::{DirtyLogSource, KvmLog, SlotInfo};
/// The `vm-memory` this crate was built with (feature `vm-memory`), for its `AtomicBitmap`.
#[cfg(feature = "vm-memory")]
pub use vm_memory;

/// log2 of the page size KVM's dirty logs count in (x86-64: 4 KiB).
pub const PAGE_SHIFT: u32 = 12;
/// The page size KVM's dirty logs count in.
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
