//! Memslots: which guest-physical ranges are backed by which host memory.
//!
//! The set is immutable once published; changes build a new set under the slots lock and
//! publish it with a new generation. The fault path reads the current set without a lock
//! (a per-vCPU cached `Arc` revalidated by one atomic load of the generation, plus a last-slot
//! hint) and re-checks the generation under the MMU lock before installing anything, so a
//! translation computed from a slot that has since been deleted or moved is never installed.
//!
//! Files: this one (a slot, the set, flags, errors), `published.rs` (`Memslots`: the slots
//! lock, the published set and its generation, vCPU snapshots), `ops.rs` (add, delete, move,
//! change flags), `validate.rs` (checks before anything changes).

use crate::direct_map::{Acceptance, PoolLease};
use crate::dirty::bitmap::SlotBitmap;
use crate::format::{bytes_per_entry, pages_per_entry, Level, PteFormat};
pub(crate) use crate::host_memory::HostRange;
use crate::sync::Arc;
use bitflags::bitflags;
use slat_addr::{Gfn, Gpa, Hva, PageIndex, PAGE_SHIFT};

mod attributes;
mod ops;
mod published;
mod validate;

pub(crate) use attributes::AttributeBitmap;
pub use attributes::{MemoryAttributeError, MemoryAttributes};
pub(crate) use ops::logs;
pub(crate) use published::{Memslots, SlotHint};

/// A memslot identifier chosen by the VMM.
pub type SlotId = u32;

bitflags! {
    /// Memslot flags, with KVM's values.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct MemslotFlags: u32 {
        /// Log writes in a dirty bitmap (or dirty ring); map at 4 KiB only.
        const LOG_DIRTY_PAGES = 1 << 0;
        /// Guest writes exit to the VMM; nothing is ever mapped writable.
        const READONLY = 1 << 1;
    }
}

/// Why a memslot request was refused. Nothing changes when an error is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemslotError {
    /// The call may flush, and the calling thread holds a CPU the flush would wait for in
    /// guest mode (or online): it would wait for itself. Nothing changed.
    #[error(transparent)]
    Flush(#[from] crate::mmu::flush::FlushError),
    /// The new range overlaps an existing slot.
    #[error("memslot {id}: guest range [{gpa:#x}, {end:#x}) overlaps memslot {other} [{other_gpa:#x}, {other_end:#x})")]
    Overlap {
        /// The slot being added or moved.
        id: SlotId,
        /// Its start.
        gpa: Gpa,
        /// Its end (exclusive).
        end: Gpa,
        /// The slot it collides with.
        other: SlotId,
        /// That slot's start.
        other_gpa: Gpa,
        /// That slot's end (exclusive).
        other_end: Gpa,
    },
    /// A guest address, size or host address is not a multiple of 4 KiB.
    #[error("memslot {id}: {what} {value:#x} is not 4 KiB aligned")]
    Misaligned {
        /// The slot.
        id: SlotId,
        /// Which value: "guest physical address", "size" or "host address".
        what: &'static str,
        /// The value.
        value: u64,
    },
    /// The slot would be empty.
    #[error("memslot {id}: size is zero")]
    ZeroSize {
        /// The slot.
        id: SlotId,
    },
    /// The range ends beyond what the page-table format can translate.
    #[error("memslot {id}: guest range [{gpa:#x}, +{size:#x}) exceeds the {bits}-bit guest physical address width")]
    BeyondPhysWidth {
        /// The slot.
        id: SlotId,
        /// Start.
        gpa: Gpa,
        /// Size.
        size: u64,
        /// Address width in bits.
        bits: u32,
    },
    /// Flag bits this engine does not know.
    #[error(
        "memslot {id}: unknown flag bits {bits:#x} (known: LOG_DIRTY_PAGES=0x1, READONLY=0x2)"
    )]
    UnknownFlags {
        /// The slot.
        id: SlotId,
        /// The unknown bits.
        bits: u32,
    },
    /// READONLY was asked to change on an existing slot.
    #[error("memslot {id}: READONLY cannot be changed on an existing slot (delete and re-add it)")]
    ReadonlyChange {
        /// The slot.
        id: SlotId,
    },
    /// No slot with this id.
    #[error("memslot {id} does not exist")]
    UnknownSlot {
        /// The id asked for.
        id: SlotId,
    },
    /// A slot with this id already exists.
    #[error("memslot {id} already exists")]
    DuplicateId {
        /// The id.
        id: SlotId,
    },
    /// The host range is shorter than the slot.
    #[error("memslot {id}: host range holds {have:#x} bytes but the slot needs {need:#x}")]
    HostRangeTooSmall {
        /// The slot.
        id: SlotId,
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// The host range does not fit the page-table format's output-address field.
    #[error("memslot {id}: host range [{addr:#x}, +{size:#x}) cannot be mapped by the page-table format's address field")]
    HostAddressUnmappable {
        /// The slot.
        id: SlotId,
        /// Host start.
        addr: Hva,
        /// Size.
        size: u64,
    },
    /// A slot with a private backing cannot log dirty pages or be read-only (KVM refuses
    /// both on guest_memfd slots: the host cannot read private memory, so a log of it is
    /// useless, and private memory has no read-only mode).
    #[error("memslot {id}: a slot with a private backing cannot have flags {bits:#x} (LOG_DIRTY_PAGES or READONLY)")]
    PrivateIncompatibleFlags {
        /// The slot.
        id: SlotId,
        /// The refused flags.
        bits: u32,
    },
    /// The private backing is a direct-map pool range another memslot already took (a
    /// guest_memfd range binds to one slot, else two guest pages would share a frame).
    #[error("memslot {id}: its private pool range is already bound to another memslot")]
    PrivateAlreadyBound {
        /// The slot.
        id: SlotId,
    },
    /// The host page size is not 4 KiB, 2 MiB or 1 GiB.
    #[error("memslot {id}: host page size {page_size:#x} is not 4 KiB, 2 MiB or 1 GiB")]
    BadHostPageSize {
        /// The slot.
        id: SlotId,
        /// The size given.
        page_size: u64,
    },
}

/// One memslot as published to the fault path.
#[derive(Debug, Clone)]
pub struct Memslot {
    /// Identifier.
    pub id: SlotId,
    /// First guest frame.
    pub base_gfn: Gfn,
    /// Number of 4 KiB pages.
    pub npages: u64,
    /// Host address of the first page.
    pub host_addr: Hva,
    /// Host page size of the backing.
    pub host_page_size: u64,
    /// The backing, held so that the host memory outlives every use of the slot (never read:
    /// the fault path uses `host_addr`; holding it is the point).
    #[allow(dead_code)]
    pub(crate) host: HostRange,
    /// Current flags.
    pub flags: MemslotFlags,
    /// The dirty bitmap (logging slots, unless the VM logs into rings only).
    pub(crate) dirty: Option<Arc<SlotBitmap>>,
    /// The slot is leaving this guest range (a move in progress; KVM's
    /// `KVM_MEMSLOT_INVALID`). Faults refuse it and retry, so nothing new is mapped, but
    /// dirty marks still find it: a vCPU that set D through a leaf the move has not yet
    /// zapped logs that write in the slot's (shared) log instead of dropping it.
    pub(crate) invalid: bool,
    /// The private (guest_memfd-like) backing and the per-page attributes choosing between
    /// it and `host`; `None` for a slot that is shared everywhere.
    pub(crate) private: Option<PrivateBacking>,
}

/// A memslot's second backing, for pages whose attribute is `PRIVATE`.
#[derive(Debug, Clone)]
pub(crate) struct PrivateBacking {
    /// Host address of the private page of the slot's first gfn.
    pub(crate) host_addr: u64,
    /// Held so the private memory outlives every use of the slot (as `Memslot::host`).
    #[allow(dead_code)]
    pub(crate) host: HostRange,
    /// The direct-map pool range the pages come from, if any: private faults accept pages
    /// through it, conversions to shared release them.
    pub(crate) lease: Option<std::sync::Arc<PoolLease>>,
    /// One bit per page: private or shared. Shared by every published copy of the slot.
    pub(crate) attrs: Arc<AttributeBitmap>,
}

impl Memslot {
    // A published slot was validated (`validate.rs`): its guest range ends inside the
    // format's address width and its host range inside the address space, so the unchecked
    // arithmetic below cannot overflow.

    /// Guest physical address of the first byte.
    pub fn gpa(&self) -> Gpa {
        Gpa::new(self.base_gfn.raw() << PAGE_SHIFT)
    }
    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.npages << PAGE_SHIFT
    }
    /// One past the last guest frame.
    pub fn end_gfn(&self) -> Gfn {
        Gfn::new(self.base_gfn.raw() + self.npages)
    }
    /// The slot contains `gfn`.
    #[inline]
    pub fn contains(&self, gfn: Gfn) -> bool {
        self.contains_raw(gfn.raw())
    }
    #[inline]
    pub(crate) fn contains_raw(&self, gfn: u64) -> bool {
        gfn.wrapping_sub(self.base_gfn.raw()) < self.npages
    }
    /// Host address backing `gfn`, or `None` outside the slot.
    #[inline]
    pub fn hva(&self, gfn: Gfn) -> Option<Hva> {
        self.contains(gfn)
            .then(|| Hva::new(self.hva_raw(gfn.raw())))
    }
    /// Host address backing `gfn` (in the slot: callers found the slot by it).
    #[inline]
    pub(crate) fn hva_raw(&self, gfn: u64) -> u64 {
        self.host_addr.raw() + (gfn.wrapping_sub(self.base_gfn.raw()) << PAGE_SHIFT)
    }
    /// The slot has a private backing (pages may be made `PRIVATE`).
    #[inline]
    pub fn has_private_backing(&self) -> bool {
        self.private.is_some()
    }
    /// `gfn` is currently private (false outside the slot). Faults read it after the memslot
    /// generation (see `memslot/attributes.rs` for the order against conversions).
    #[inline]
    pub fn is_private(&self, gfn: Gfn) -> bool {
        self.contains(gfn)
            && self
                .private
                .as_ref()
                .is_some_and(|p| p.attrs.is_private(gfn.raw() - self.base_gfn.raw()))
    }
    /// Host address backing `gfn` for an access of this kind: the private pool or the shared
    /// range (`private` without a private backing falls back to the shared range; callers
    /// check the attribute first).
    #[inline]
    pub(crate) fn hva_for(&self, gfn: u64, private: bool) -> u64 {
        match &self.private {
            Some(p) if private => {
                p.host_addr + (gfn.wrapping_sub(self.base_gfn.raw()) << PAGE_SHIFT)
            }
            _ => self.hva_raw(gfn),
        }
    }
    /// Whether acceptance through this slot's direct map would wait for the calling thread
    /// (an online host CPU of it: acceptance may flush the kernel TLBs).
    pub(crate) fn check_accept_flush(&self) -> Result<(), crate::mmu::flush::FlushError> {
        match self.private.as_ref().and_then(|p| p.lease.as_ref()) {
            Some(lease) => lease.direct_map().check_flush(),
            None => Ok(()),
        }
    }

    /// Lazy acceptance of `gfn`'s private page (in the slot, private) before it is mapped:
    /// `Already` when the backing has no direct map.
    pub(crate) fn accept_private<C: crate::clock::Clock>(&self, gfn: u64) -> Acceptance {
        match self.private.as_ref().and_then(|p| p.lease.as_ref()) {
            Some(lease) => lease.accept::<C>(gfn - self.base_gfn.raw()),
            None => Acceptance::Already,
        }
    }
    pub(crate) fn attrs(&self) -> Option<&AttributeBitmap> {
        self.private.as_ref().map(|p| &*p.attrs)
    }
    /// Dirty logging is on (and meaningful: read-only slots are never written).
    #[inline]
    pub fn is_logging(&self) -> bool {
        self.flags.contains(MemslotFlags::LOG_DIRTY_PAGES) && !self.is_readonly()
    }
    /// A move of this slot is in progress and this copy marks its old range; faults retry.
    #[inline]
    pub fn is_invalid(&self) -> bool {
        self.invalid
    }
    /// Read-only slot.
    #[inline]
    pub fn is_readonly(&self) -> bool {
        self.flags.contains(MemslotFlags::READONLY)
    }

    /// The largest leaf level that may map `gfn`: limited by the host page size, by the slot's
    /// edges (the whole huge range must be inside the slot) and by the guest and host addresses
    /// being congruent modulo the huge size. Dirty-logged slots map at 4 KiB (invariant 7).
    /// 1 for a frame outside the slot.
    #[inline]
    pub fn max_level<F: PteFormat>(&self, gfn: Gfn) -> Level {
        self.max_level_raw::<F>(gfn.raw())
    }
    #[inline]
    pub(crate) fn max_level_raw<F: PteFormat>(&self, gfn: u64) -> Level {
        // A slot with a private backing maps at 4 KiB: a huge leaf would cover pages of both
        // kinds after a partial conversion (KVM tracks mixed ranges per huge page instead;
        // not done here).
        if self.is_logging() || self.private.is_some() {
            return 1;
        }
        let mut level = F::MAX_LEAF_LEVEL;
        while level > 1 {
            let pages = pages_per_entry(level);
            let first = gfn & !(pages - 1);
            if self.host_page_size >= bytes_per_entry(level)
                && first >= self.base_gfn.raw()
                && first
                    .checked_add(pages)
                    .is_some_and(|e| e <= self.end_gfn().raw())
                && ((self.hva_raw(gfn) >> PAGE_SHIFT) & (pages - 1)) == (gfn & (pages - 1))
            {
                return level;
            }
            level -= 1;
        }
        1
    }

    /// Sets `gfn`'s bit in the slot's bitmap; false if the slot has none.
    #[inline]
    pub(crate) fn mark_dirty<C: crate::clock::Clock>(&self, gfn: u64) -> bool {
        match &self.dirty {
            Some(b) => {
                b.set_c::<C>(PageIndex::new(gfn - self.base_gfn.raw()));
                true
            }
            None => false,
        }
    }

    /// Marks `gfn` again after the update that made it writable (see
    /// [`crate::dirty::bitmap::SlotBitmap::set_after_update`]).
    pub(crate) fn mark_dirty_after_update<C: crate::clock::Clock>(&self, gfn: u64) {
        if let Some(b) = &self.dirty {
            b.set_after_update_c::<C>(PageIndex::new(gfn - self.base_gfn.raw()));
        }
    }
}

/// An immutable, sorted set of memslots.
#[derive(Debug, Default)]
pub struct MemslotSet {
    slots: Vec<Arc<Memslot>>,
    generation: u64,
}

impl MemslotSet {
    /// The generation this set was published with.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// Slots sorted by guest address.
    pub fn slots(&self) -> &[Arc<Memslot>] {
        &self.slots
    }
    /// The slot with this id.
    pub fn by_id(&self, id: SlotId) -> Option<&Arc<Memslot>> {
        self.slots.iter().find(|s| s.id == id)
    }
    /// The slot containing `gfn`, trying index `hint` first; returns its index too.
    #[inline]
    pub fn find(&self, gfn: Gfn, hint: usize) -> Option<(usize, &Arc<Memslot>)> {
        self.find_raw(gfn.raw(), hint)
    }
    #[inline]
    pub(crate) fn find_raw(&self, gfn: u64, hint: usize) -> Option<(usize, &Arc<Memslot>)> {
        if let Some(s) = self.slots.get(hint) {
            if s.contains_raw(gfn) {
                return Some((hint, s));
            }
        }
        let i = self.slots.partition_point(|s| s.end_gfn().raw() <= gfn);
        match self.slots.get(i) {
            Some(s) if s.contains_raw(gfn) => Some((i, s)),
            _ => None,
        }
    }

    pub(crate) fn with(
        &self,
        generation: u64,
        change: impl FnOnce(&mut Vec<Arc<Memslot>>),
    ) -> Self {
        let mut slots = self.slots.clone();
        change(&mut slots);
        slots.sort_by_key(|s| s.base_gfn);
        MemslotSet { slots, generation }
    }
}
