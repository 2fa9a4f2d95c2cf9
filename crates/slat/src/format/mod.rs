//! Page-table entry formats.
//!
//! The walker, the fault handler and every table operation are written against [`PteFormat`]
//! only; they never look at a bit position. A format owns the encoding of leaves and tables,
//! the software bits KVM keeps in SPTEs (MMU-present, host-writable, MMU-writable, saved
//! permissions for access tracking) and the sentinel values (non-present, frozen).
//!
//! Level numbering follows KVM: level 1 holds 4 KiB leaves, level 2 covers 2 MiB per entry,
//! level 3 covers 1 GiB, and the root table sits at [`PteFormat::ROOT_LEVEL`].

pub mod ept;
pub mod stage2;
mod timed;

use slat_addr::{Gfn, Hva, PAGE_SIZE};

pub use ept::Ept;
pub use stage2::Stage2;
pub use timed::Timed;

/// A page-table level, 1 (4 KiB entries) up to the format's root level.
pub type Level = u8;

/// Entries per table page.
pub const ENTRIES_PER_TABLE: usize = 512;
/// Index bits per level.
pub const LEVEL_BITS: u32 = 9;
/// The deepest root level any format uses (sizes fixed-length walk paths).
pub const MAX_LEVELS: usize = 5;

/// Number of 4 KiB pages one entry at `level` covers.
#[inline]
pub const fn pages_per_entry(level: Level) -> u64 {
    1u64 << (LEVEL_BITS * (level as u32 - 1))
}

/// Bytes one entry at `level` covers.
#[inline]
pub const fn bytes_per_entry(level: Level) -> u64 {
    PAGE_SIZE << (LEVEL_BITS * (level as u32 - 1))
}

/// Frame arithmetic inside the engine. Every frame it computes with lies below a format's
/// address width (2^52 at most: memslots are validated against it, walks and aging passes are
/// clamped to it), so adding a table's span, or the pages of a slot, cannot overflow: the
/// operations are unchecked, and the hot paths compile as they did with plain integers.
pub(crate) trait FrameStep: Copy {
    /// `self + pages`.
    fn plus(self, pages: u64) -> Gfn;
}

impl FrameStep for Gfn {
    #[inline(always)]
    fn plus(self, pages: u64) -> Gfn {
        Gfn::new(self.raw() + pages)
    }
}

/// Index of `gfn` in the table at `level`.
#[inline]
pub const fn table_index(gfn: Gfn, level: Level) -> usize {
    ((gfn.raw() >> (LEVEL_BITS * (level as u32 - 1))) as usize) & (ENTRIES_PER_TABLE - 1)
}

/// The kind of guest memory access that faulted or is being translated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// A data read.
    Read,
    /// A data write.
    Write,
    /// An instruction fetch.
    Exec,
}

/// What a new leaf may allow, decided by the fault handler from the memslot and the access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LeafPerms {
    /// The host mapping may be written (clear for read-only memslots).
    pub host_writable: bool,
    /// The MMU allows making the leaf writable (set W and MMU-writable).
    pub writable: bool,
    /// Instruction fetches allowed.
    pub exec: bool,
    /// Hardware Accessed/Dirty bits are in use for this leaf (else access tracking by
    /// clearing permissions, KVM's "A/D disabled" mode).
    pub ad_bits: bool,
}

/// An encoding of second-stage page-table entries.
///
/// Implementations are zero-sized markers; all functions are pure bit manipulation on `u64`.
/// Invariants every implementation keeps (checked by the engine's tests):
/// - W ⇒ MMU-writable ⇒ host-writable;
/// - [`Self::NON_PRESENT`] and [`Self::FROZEN`] are not present to software or hardware;
/// - a table entry is never a leaf and vice versa at levels that allow both.
///
/// # Safety
///
/// The engine and the simulated hardware dereference what these functions decode, so an
/// implementation must be exact about addresses and structure: [`Self::output_addr`] of
/// [`Self::make_table`]`(a)` is `a`, and of a leaf made by [`Self::make_leaf`],
/// [`Self::make_huge`] or [`Self::split_child`] the address it was given (or computed from
/// the huge leaf), unchanged by every permission, A/D or access-tracking transform;
/// `is_present`/`is_leaf`/`hw_is_table` classify exactly the values these functions make
/// (and [`Self::NON_PRESENT`] and [`Self::FROZEN`] as not present), so no table entry is ever
/// read as a leaf or a leaf as a table; and `MAX_PHYS_BITS`, `ROOT_LEVEL` and
/// `MAX_LEAF_LEVEL` describe the walk the table indices follow. A format that breaks this
/// makes the engine read and write memory that is not a table page.
pub unsafe trait PteFormat: Send + Sync + 'static + Sized {
    /// Name shown in reports.
    const NAME: &'static str;
    /// Level of the root table.
    const ROOT_LEVEL: Level;
    /// Largest level at which a leaf (huge page) may be installed.
    const MAX_LEAF_LEVEL: Level;
    /// Guest physical address bits the format can translate.
    const MAX_PHYS_BITS: u32;
    /// The value of an empty entry (tables start zeroed, so this must be 0).
    const NON_PRESENT: u64;
    /// The sentinel for an entry in the middle of a multi-step update: whoever reads it backs
    /// off (a fault retries) until the owner writes the final value.
    const FROZEN: u64;
    /// Changing a valid entry's output address or size (a block split into a table, a table
    /// rebuilt as a block) must go through an invalid entry and a TLB invalidation first
    /// (arm64 break-before-make); otherwise one compare-and-swap suffices (x86 may cache both
    /// translations at once, and they are equivalent).
    const BREAK_BEFORE_MAKE: bool;
    /// New mappings need the data cache cleaned to the point of coherency (and the
    /// instruction cache invalidated for executable ones) before the guest may use them: the
    /// guest may run with its caches off (arm64). x86 caches are coherent.
    const CACHE_MAINTENANCE: bool;
    /// Hardware records writes in the entry (a Dirty bit), so dirty logging may keep pages
    /// writable and clear D instead of W. Without it, hardware-dirty tracking falls back to
    /// write protection.
    const HARDWARE_DIRTY: bool;

    /// The clock the engine reports synchronisation and work to when it runs with this
    /// format: [`RealTime`](crate::clock::RealTime) for the architecture formats (every hook
    /// compiles away), a simulated clock through the [`Timed`] adapter.
    type Clock: crate::clock::Clock;
    /// The architecture format under any adapters (`Self` for [`Ept`] and [`Stage2`]): for
    /// code that asks which encoding it runs, whatever the clock.
    type Inner: PteFormat;

    /// Software view: the entry maps something (a table or a leaf), even if hardware
    /// permissions are currently removed for access tracking.
    fn is_present(pte: u64) -> bool;
    /// The entry is a leaf at `level` (always true at level 1 for present entries).
    fn is_leaf(pte: u64, level: Level) -> bool;
    /// Host address of the child table or of the mapped (huge) page.
    fn output_addr(pte: u64) -> Hva;
    /// A non-leaf entry pointing at a child table at host address `child`.
    fn make_table(child: Hva) -> u64;
    /// A leaf mapping host address `addr` (aligned to the level's size) at `level`.
    fn make_leaf(addr: Hva, level: Level, perms: LeafPerms) -> u64;

    /// Hardware may write through this leaf.
    fn is_writable(pte: u64) -> bool;
    /// The MMU allows the leaf to become writable without the slow path (dirty-log
    /// write protection keeps this set while clearing W).
    fn is_mmu_writable(pte: u64) -> bool;
    /// The host mapping allows writes.
    fn is_host_writable(pte: u64) -> bool;
    /// `pte` with W cleared and MMU-writable kept (write protection for dirty logging).
    fn write_protect(pte: u64) -> u64;
    /// `pte` with W set (and Dirty where A/D bits are in use). Caller checks MMU-writable.
    fn make_writable(pte: u64) -> u64;

    /// Hardware A/D bits are in use for this leaf.
    fn ad_enabled(pte: u64) -> bool;
    /// The leaf was accessed since it was last aged.
    fn is_accessed(pte: u64) -> bool;
    /// `pte` with hardware permissions removed and saved in software bits (A/D disabled) or
    /// with the Accessed bit cleared (A/D enabled).
    fn mark_access_tracked(pte: u64) -> u64;
    /// The leaf's permissions are parked in software bits awaiting a fast-path restore.
    fn is_access_tracked(pte: u64) -> bool;
    /// Undo [`Self::mark_access_tracked`] (restore saved permissions).
    fn restore_access_tracked(pte: u64) -> u64;
    /// `pte` with the Accessed bit set, and Dirty too for a write (what the hardware walker
    /// does on a translation). Returns `pte` unchanged when A/D bits are not in use.
    fn set_accessed_dirty(pte: u64, access: Access) -> u64;
    /// Hardware recorded a write through this leaf (the Dirty bit). Without A/D bits nothing
    /// is recorded and every writable leaf counts as dirty.
    fn is_dirty(pte: u64) -> bool;
    /// `pte` with the Dirty bit cleared, so hardware sets it (and, in hardware-dirty logging,
    /// logs the page) on the next write. Unchanged without A/D bits.
    fn clear_dirty(pte: u64) -> u64;
    /// Someone other than the holder of the exclusive MMU lock may change this entry right now:
    /// hardware setting A or D, or the lock-free fast path restoring W or access. Such an entry
    /// is updated with an atomic exchange even under the exclusive lock; any other entry with a
    /// plain store (KVM's `spte_needs_atomic_update`), which is what makes re-protecting a
    /// fully dirty slot cheap: its leaves are accessed, dirty and writable, so nobody else may
    /// touch them.
    fn needs_atomic_update(pte: u64, level: Level) -> bool;

    /// Hardware check: a translation through this leaf allows `access`.
    fn permits(pte: u64, access: Access) -> bool;
    /// Hardware check: the entry is a valid table pointer at `level` (hardware follows it).
    fn hw_is_table(pte: u64, level: Level) -> bool;

    /// The `index`-th child of huge leaf `huge` at `level`, as a leaf at `level - 1` mapping the
    /// same host memory with the same permissions (eager or lazy split).
    fn split_child(huge: u64, level: Level, index: usize) -> u64;
    /// A huge leaf at `level` built from `child`, one of the leaves under the table it replaces
    /// (in-place huge-page recovery). The output address is aligned down to the level size.
    fn make_huge(child: u64, level: Level) -> u64;
}
