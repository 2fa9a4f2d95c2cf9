//! Dirty logging: which guest pages were written since the last harvest.
//!
//! Enabling logging on a memslot splits its huge leaves (eagerly, by default) and
//! write-protects every leaf while keeping MMU-writable, so the first write to each page takes
//! a fault that the lock-free fast path fixes and logs. Marks go to the slot's bitmap
//! ([`SlotBitmap`]) or, with the dirty ring, to the faulting vCPU's ring ([`DirtyRing`]).
//!
//! A harvest follows invariant 4: snapshot-and-clear → write-protect exactly the pages it
//! returned → complete a remote flush → return. Its three forms, as in KVM:
//! - [`crate::Vm::get_dirty_log`] without manual protection: per-word exchange, or the two-bitmap
//!   switch proposed upstream to avoid the atomics ([`GetLogVariant`]);
//! - with manual protection (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`), `get_dirty_log` only copies
//!   and [`crate::Vm::clear_dirty_log`] clears and re-protects what the VMM has dealt with;
//! - the dirty ring: [`DirtyRing::harvest`], then [`crate::Vm::reset_dirty_rings`].
//!
//! Each costs in proportion to the dirty pages: a bitmap harvest reads only the words its
//! summary levels name (`bitmap.rs`), and re-protection walks only the leaf tables that hold
//! set bits. [`crate::Vm::get_dirty_log_sparse`] and [`crate::Vm::clear_dirty_log_sparse`]
//! take and give the non-zero words only, so the caller need not hold a slot-sized buffer.
//!
//! Files: `bitmap.rs` and `ring.rs` (the logs), `mark.rs` (marking, invariant 3),
//! `capability.rs` (manual protect, rings), `enable.rs` (logging on and off), `rearm.rs`
//! (write-protect or clear D again), `harvest.rs` (GET, CLEAR, ring reset). `DirtyLog` is
//! the VM's dirty-log state; the page table and memslots are passed in by the facade.

mod capability;
mod enable;
mod harvest;
mod mark;
mod rearm;

pub(crate) mod bitmap;
pub(crate) mod ring;

pub use bitmap::{DirtyBitmap, SlotBitmap};
pub use ring::{
    DirtyGfn, DirtyRing, DIRTY_GFN_DIRTY, DIRTY_GFN_RESET, RING_MAX_ENTRIES, RING_MIN_ENTRIES,
    RING_RESERVED_ENTRIES,
};

pub(crate) use enable::disable_logging;
pub(crate) use harvest::LogOut;
pub(crate) use mark::{
    commit_mark, log_hardware_dirty, mark_for, mark_page_dirty, prepare_mark, Pushed,
};

use crate::memslot::{logs, MemslotFlags, SlotId};
use crate::sync::{self, Arc, Mutex};
use slat_addr::PageIndex;

/// `KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE`: GET only copies; CLEAR re-protects.
pub const MANUAL_PROTECT_ENABLE: u32 = 1 << 0;
/// `KVM_DIRTY_LOG_INITIALLY_SET`: bitmaps start all ones and enabling logging protects
/// nothing; CLEAR protects gradually. Requires [`MANUAL_PROTECT_ENABLE`].
pub const INITIALLY_SET: u32 = 1 << 1;

/// Deliberate protocol bugs for oracle tests (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use crate::test_hooks::inject;

use crate::config::{DirtyTrack, GetLogVariant};

/// Why a dirty-log request was refused. Nothing changes when an error is returned: no bit is
/// consumed, no page protected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirtyLogError {
    /// The call may flush, and the calling thread holds a CPU the flush would wait for in
    /// guest mode (or online): it would wait for itself. Nothing changed.
    #[error(transparent)]
    Flush(#[from] crate::mmu::flush::FlushError),
    /// No slot with this id.
    #[error("memslot {id} does not exist")]
    UnknownSlot {
        /// The id asked for.
        id: SlotId,
    },
    /// The slot does not log (no LOG_DIRTY_PAGES, or read-only).
    #[error("memslot {id} is not logging dirty pages")]
    NotLogging {
        /// The slot.
        id: SlotId,
    },
    /// The VM logs into dirty rings without a bitmap.
    #[error("memslot {id} has no dirty bitmap: the VM logs into dirty rings (harvest the rings, or enable the ring with a bitmap)")]
    NoBitmap {
        /// The slot.
        id: SlotId,
    },
    /// A caller-supplied bitmap buffer is too short.
    #[error("memslot {id}: bitmap buffer holds {have} words but {need} are needed")]
    BitmapTooSmall {
        /// The slot.
        id: SlotId,
        /// Words needed.
        need: usize,
        /// Words given.
        have: usize,
    },
    /// A word index past the slot's bitmap in a sparse CLEAR.
    #[error("memslot {id}: bitmap word {word} is past its {nwords} words")]
    WordOutOfRange {
        /// The slot.
        id: SlotId,
        /// The index given.
        word: usize,
        /// The slot's bitmap words.
        nwords: usize,
    },
    /// CLEAR_DIRTY_LOG without manual protection.
    #[error("clearing the dirty log needs manual dirty-log protection (MANUAL_PROTECT_ENABLE)")]
    ManualProtectOff,
    /// CLEAR's first page is not a multiple of 64.
    #[error("memslot {id}: first_page {} is not a multiple of 64", first_page.raw())]
    ClearUnaligned {
        /// The slot.
        id: SlotId,
        /// The value given.
        first_page: PageIndex,
    },
    /// CLEAR's range leaves the slot, or its length is not a multiple of 64 and does not end
    /// the slot.
    #[error("memslot {id}: pages [{}, +{num_pages}) are not a valid range of its {npages} pages (inside the slot, length a multiple of 64 unless it ends the slot)", first_page.raw())]
    ClearRange {
        /// The slot.
        id: SlotId,
        /// First page.
        first_page: PageIndex,
        /// Pages.
        num_pages: u64,
        /// The slot's pages.
        npages: u64,
    },
    /// Flag bits this engine does not know.
    #[error("unknown manual dirty-log protect flags {bits:#x} (known: MANUAL_PROTECT_ENABLE=0x1, INITIALLY_SET=0x2)")]
    UnknownFlags {
        /// The unknown bits.
        bits: u32,
    },
    /// INITIALLY_SET without MANUAL_PROTECT_ENABLE.
    #[error("INITIALLY_SET needs MANUAL_PROTECT_ENABLE")]
    InitiallySetWithoutManual,
    /// The change would alter the meaning of a log in progress.
    #[error("memslot {id} is logging dirty pages: turn logging off first")]
    LoggingActive {
        /// A slot that logs.
        id: SlotId,
    },
    /// A ring size that is not a power of two in the allowed range.
    #[error("dirty ring size {entries} must be a power of two between {RING_MIN_ENTRIES} and {RING_MAX_ENTRIES} entries")]
    RingSize {
        /// The size asked for.
        entries: u32,
    },
    /// The dirty ring must be enabled before any vCPU exists.
    #[error("the dirty ring must be enabled before vCPUs are created ({vcpus} exist)")]
    VcpusExist {
        /// vCPUs that exist.
        vcpus: usize,
    },
    /// The dirty ring is already enabled.
    #[error("the dirty ring is already enabled ({entries} entries)")]
    RingAlreadyEnabled {
        /// Its size.
        entries: u32,
    },
    /// A ring operation on a VM without dirty rings.
    #[error("the dirty ring is not enabled on this VM")]
    RingOff,
    /// Hardware-dirty tracking logs into bitmaps only.
    #[error("the dirty ring cannot be combined with hardware-dirty (D-bit) tracking: use write-protect tracking")]
    RingWithHardwareDirty,
}

/// How a VM logs, fixed by the capability calls below.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DirtyMode {
    /// MANUAL_PROTECT_ENABLE / INITIALLY_SET bits.
    pub(crate) manual: u32,
    /// Ring entries per vCPU (0: no ring).
    pub(crate) ring_entries: u32,
    /// Keep bitmaps next to the rings.
    pub(crate) ring_with_bitmap: bool,
}

impl DirtyMode {
    pub(crate) fn manual(&self) -> bool {
        self.manual & MANUAL_PROTECT_ENABLE != 0
    }
    pub(crate) fn initially_set(&self) -> bool {
        self.manual & INITIALLY_SET != 0
    }
    pub(crate) fn uses_bitmap(&self) -> bool {
        self.ring_entries == 0 || self.ring_with_bitmap
    }
}

/// A VM's dirty-log state: how it logs, and every vCPU's ring.
pub(crate) struct DirtyLog {
    mode: Mutex<DirtyMode>,
    rings: Mutex<Vec<Arc<DirtyRing>>>,
}

impl DirtyLog {
    pub(crate) fn new() -> Self {
        DirtyLog {
            mode: Mutex::new(DirtyMode::default()),
            rings: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn mode(&self) -> DirtyMode {
        *sync::lock(&self.mode)
    }

    /// Every vCPU's dirty ring, in vCPU creation order (empty without the ring).
    pub(crate) fn rings<C: crate::clock::Clock>(&self) -> Vec<Arc<DirtyRing>> {
        sync::lock_c::<C, _>(&self.rings).clone()
    }

    /// Creates the ring of a new vCPU, if the VM logs into rings.
    pub(crate) fn new_vcpu_ring(&self) -> Option<Arc<DirtyRing>> {
        let entries = self.mode().ring_entries;
        (entries != 0).then(|| {
            let r = Arc::new(DirtyRing::new(entries));
            sync::lock(&self.rings).push(r.clone());
            r
        })
    }

    /// The bitmap a slot with `flags` and `npages` pages gets, if any.
    pub(crate) fn new_bitmap(
        &self,
        get_log: GetLogVariant,
        flags: MemslotFlags,
        npages: u64,
    ) -> Option<Arc<SlotBitmap>> {
        let mode = self.mode();
        let switch = get_log.two_bitmaps() && !mode.manual();
        (logs(flags) && mode.uses_bitmap()).then(|| {
            Arc::new(SlotBitmap::new(
                npages,
                mode.manual() && mode.initially_set(),
                switch,
            ))
        })
    }
}
