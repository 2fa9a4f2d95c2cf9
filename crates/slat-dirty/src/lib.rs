//! Dirty-page tracking for any KVM virtual machine, on the caller's own `kvm-ioctls` `VmFd`,
//! `VcpuFd`s and guest memory.
//!
//! - [`log`]: the dirty-log ioctls `kvm-ioctls` lacks or wraps with an allocation per call —
//!   `KVM_GET_DIRTY_LOG` into a caller's buffer, `KVM_CLEAR_DIRTY_LOG` (manual protect) in any
//!   chunk KVM accepts, [`log::enable_manual_protect`] (with or without `INITIALLY_SET`), and the
//!   per-vCPU dirty ring ([`log::RingSize`], [`log::enable_dirty_ring`], [`log::DirtyRing`],
//!   [`log::reset_dirty_rings`]) with KVM's rules checked: size a power of two in KVM's bounds,
//!   given in bytes to the capability, mapped only if the vCPU's ring really is that size.
//! - [`Memslot`]: a slot handle that knows its page count, so every bitmap KVM reads or writes
//!   is sized from the slot, never from a length the caller claims. A slot is created through
//!   [`Memslot::register`] or, if the caller already registered it, described with
//!   [`Memslot::adopt`]; both are `unsafe` and state what the caller promises.
//! - [`ranges()`]: bitmap → `(first_page, pages)` runs, a word at a time, skipping zero words.
//! - [`Harvester`]: one transactional harvest over the three log modes, generic over where the
//!   log comes from ([`DirtyLogSource`]: a VMM's own VM through [`KvmLog`], the default, or
//!   any other source, e.g. slat's benchmark machines): [`Harvester::take`]
//!   returns a [`DirtySet`] to copy; [`DirtySet::commit`] when the copy succeeded; abort (or
//!   drop) and every page of the set is reported again by the next take. Writes the VMM made
//!   itself (devices, `vm-memory`'s `AtomicBitmap::get_and_reset`) are merged with
//!   [`Harvester::mark_words`] / [`Harvester::mark_pages`], or, with the `vm-memory` feature,
//!   straight from the `AtomicBitmap` (`Harvester::mark_atomic_bitmap`).
//! - [`SummaryBitmap`]: a drop-in for that `AtomicBitmap` (with the `vm-memory` feature, a
//!   `vm-memory` `Bitmap` backend: `GuestMemoryMmap<SummaryBitmap>`) that marks a range with one
//!   atomic per word and is taken in O(dirty pages) through summary levels, straight into the
//!   harvester ([`Harvester::mark_summary_bitmap`]).
//! - [`dirty_rate`]: how fast the guest dirties memory, without migrating (QEMU's
//!   `calc-dirty-rate`): [`dirty_rate::DirtyRate`] samples any [`DirtyLogSource`] for distinct
//!   pages per second, overall and per vCPU (ring entries name their vCPU; bitmaps need per-vCPU
//!   regions).
//! - [`Snapshot`]: snapshot and reset of guest memory for fuzzers and sandboxes — copy back
//!   only the dirty pages ([`Snapshot`], [`DirtyPages`]), incremental snapshots
//!   ([`ChildSnapshot`]), byte-exact verification; re-arm the log before the copy.
//!
//! No safe function of this crate lets KVM (or this crate) write outside a buffer or a
//! mapping: bitmap lengths come from the slot, ring indices are masked into a mapping whose
//! size was checked against KVM, and sizes from callers go through checked arithmetic.
//! Errors are [`Error`].
//!
//! # Example: harvest a VM's dirty pages, reset it to a snapshot
//!
//! A VMM with a KVM VM of its own: one memslot of 64 pages, manual protect with
//! `INITIALLY_SET` (the first take is the full copy), a real-mode guest that writes two pages
//! and halts. Each take re-arms the log before it returns; the set is committed once its pages
//! are copied (dropping it instead owes them to the next take). Skipped where `/dev/kvm`
//! cannot be opened.
//!
//! ```
//! use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
//! use kvm_ioctls::{Kvm, VcpuExit};
//! use slat_dirty::{GuestRegion, Harvester, LogMode, Memslot, Snapshot};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let Ok(kvm) = Kvm::new() else {
//!     eprintln!("skipped: /dev/kvm cannot be opened");
//!     return Ok(());
//! };
//! let vm = std::sync::Arc::new(kvm.create_vm()?);
//! slat_dirty::log::enable_manual_protect(&vm, true)?;
//!
//! // Guest RAM: 64 pages at guest-physical 0, the VMM's own (page-aligned, never freed).
//! const PAGES: u64 = 64;
//! let len = (PAGES * slat_addr::PAGE_SIZE) as usize;
//! let layout = std::alloc::Layout::from_size_align(len, 4096)?;
//! // SAFETY: a non-zero size.
//! let ram = unsafe { std::alloc::alloc_zeroed(layout) };
//! assert!(!ram.is_null());
//! // The guest's code at 0x1000 (16-bit real mode): two byte stores, then `hlt`.
//! let code = [0xc6, 0x06, 0x00, 0x30, 0x01, 0xc6, 0x06, 0x00, 0x80, 0x01, 0xf4];
//! // SAFETY: inside the allocation; nothing runs in the guest yet.
//! unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), ram.add(0x1000), code.len()) };
//! // SAFETY: `ram` stays allocated for as long as the VM, and the slot is never deleted.
//! let slot = unsafe {
//!     Memslot::register(&vm, kvm_userspace_memory_region {
//!         slot: 0,
//!         flags: KVM_MEM_LOG_DIRTY_PAGES,
//!         guest_phys_addr: 0,
//!         memory_size: len as u64,
//!         userspace_addr: ram as u64,
//!     })
//! }?;
//! let mut harvester = Harvester::new(vec![slot], LogMode::ManualProtect { chunk_pages: 64 })?;
//!
//! // The initial copy: every page (INITIALLY_SET). Copy them, then commit.
//! let set = harvester.take()?;
//! assert_eq!(set.pages(), PAGES);
//! set.commit();
//!
//! // A snapshot of guest memory, taken while no vCPU runs.
//! // SAFETY: `ram` is mapped for `len` bytes for the rest of the program, and only the vCPU
//! // below writes it, never while the snapshot is taken, reset or verified.
//! let snap = Snapshot::take(vec![unsafe { GuestRegion::new(ram, len as u64)? }])?;
//! let mut dirty = snap.dirty_pages();
//!
//! // Run the guest once: it writes pages 3 and 8.
//! let vcpu = vm.create_vcpu(0)?;
//! let mut sregs = vcpu.get_sregs()?;
//! (sregs.cs.base, sregs.cs.selector) = (0, 0);
//! vcpu.set_sregs(&sregs)?;
//! let mut regs = vcpu.get_regs()?;
//! (regs.rip, regs.rflags) = (0x1000, 2);
//! vcpu.set_regs(&regs)?;
//! let mut vcpu = vcpu;
//! assert!(matches!(vcpu.run()?, VcpuExit::Hlt));
//!
//! // Harvest transactionally: exactly the two pages the guest wrote.
//! let set = harvester.take()?;
//! let runs: Vec<(u64, u64)> = set.ranges(0).collect();
//! assert_eq!(runs, [(3, 1), (8, 1)]);
//! // Reset to the snapshot: copy back only those pages, then commit the set.
//! dirty.add_dirty_set(&set)?;
//! let stats = snap.reset(&mut dirty)?;
//! set.commit();
//! assert_eq!(stats.pages, 2);
//! snap.verify()?;
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

// One public path per item (checked by slat-harness's `tests/harness/public_paths.rs`): the types a user
// names live in private modules and are re-exported here; the public modules (dirty-rate
// measurement, the raw KVM dirty-log calls) are cohesive groups whose items are not re-exported
// here.
pub mod dirty_rate;
pub mod log;

mod error;
mod harvest;
mod memslot;
mod ranges;
mod rearm;
mod snapshot;
mod snapshot_copy;
mod source;
mod summary_bitmap;

pub use error::Error;
pub use harvest::{DirtySet, Harvester, LogMode};
pub use memslot::{bitmap_words, Memslot};
pub use ranges::{ranges, Ranges};
pub use rearm::{clear_harvested_chunks, CLEAR_GAP_WORDS};
pub use snapshot::{ChildSnapshot, DirtyPages, GuestRegion, ResetStats, Snapshot, SnapshotError};
pub use snapshot_copy::crossover_fraction;
pub use source::{DirtyLogSource, KvmLog, MapErr, SlotInfo};
pub use summary_bitmap::{SummaryBitmap, SUMMARY_BITMAP_PAGE};
/// The `vm-memory` this crate was built with (feature `vm-memory`), for its `AtomicBitmap`.
// A re-export of a whole dependency, so a VMM can match its `vm-memory` version to ours; it
// is not a second path to one of this crate's items.
#[cfg(feature = "vm-memory")]
pub use vm_memory;
