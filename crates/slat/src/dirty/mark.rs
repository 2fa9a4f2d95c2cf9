//! Marking a page dirty: the two halves of a write fix in a logged slot (invariant 3), marks
//! from outside any vCPU, and hardware-dirty (PML-like) marks.

use super::{DirtyLogError, DirtyRing, DirtyTrack};
use crate::clock::Clock;
use crate::config::VmConfig;
use crate::format::PteFormat;
use crate::memslot::{Memslot, Memslots, SlotHint, SlotId};
use crate::mmu::Mmu;
use crate::stats::{Counters, Sink, Stat};
use crate::sync::{self, Ordering};

/// A write fix in a logged slot in two steps around the SPTE update that sets W
/// ([`prepare_mark`], then [`commit_mark`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mark<'s> {
    /// Set the bitmap bit (done before the update, redone after it).
    Bitmap(&'s Memslot),
    /// Push to the vCPU's ring (before the update, and again after it if a harvest took
    /// the first entry meanwhile).
    Ring(&'s Memslot),
}

/// How a write fix to `slot` is logged, if it is.
#[inline]
pub(crate) fn mark_for<'s>(slot: &'s Memslot, ring: Option<&DirtyRing>) -> Option<Mark<'s>> {
    if !slot.is_logging() {
        None
    } else if ring.is_some() {
        Some(Mark::Ring(slot))
    } else {
        Some(Mark::Bitmap(slot))
    }
}

/// The ring entry [`prepare_mark`] pushed (index, slot, offset), for [`commit_mark`] to look
/// at again. Kept across a fast-path fix's retries, so a retry for the same slot and page
/// whose entry is still unharvested pushes no other.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Pushed(Option<(u32, SlotId, u64)>);

/// First half of logging a write fix: called before the update that sets W. With a bitmap
/// the bit is set now (invariant 3: a write by another vCPU can follow the update at
/// once). With a ring the entry is pushed now, for the same reason (see `dirty/ring.rs`),
/// if the ring has room for it and for the second entry [`commit_mark`] may push: `false`
/// means it has not and W must not be set.
#[inline]
pub(crate) fn prepare_mark<C: Clock>(
    mark: Mark<'_>,
    ring: Option<&DirtyRing>,
    gfn: u64,
    sink: Sink<'_>,
    pushed: &mut Pushed,
) -> bool {
    match mark {
        Mark::Bitmap(slot) => {
            if slot.mark_dirty::<C>(gfn) {
                sink.inc::<C>(Stat::DirtyMarked);
            }
            true
        }
        Mark::Ring(slot) => {
            ring.is_some_and(|r| push_before_update::<C>(r, slot, gfn, sink, pushed))
        }
    }
}

/// [`prepare_mark`] for a ring. Out of line, as [`push_again_if_harvested`]: both are
/// inlined into every fault path otherwise, and the bitmap and unlogged paths paid for
/// their size (measured with callgrind on demand paging, which logs nothing).
#[inline(never)]
fn push_before_update<C: Clock>(
    r: &DirtyRing,
    slot: &Memslot,
    gfn: u64,
    sink: Sink<'_>,
    pushed: &mut Pushed,
) -> bool {
    let offset = gfn - slot.base_gfn.raw();
    if pushed
        .0
        .is_some_and(|(i, s, o)| (s, o) == (slot.id, offset) && r.unharvested::<C>(i))
    {
        return true;
    }
    if !r.has_room_for(2) {
        return false;
    }
    pushed.0 = Some((r.push::<C>(slot.id, offset), slot.id, offset));
    sink.inc::<C>(Stat::DirtyMarked);
    true
}

/// [`commit_mark`] for a ring: the fence pairs with the one in `reset_rings`.
#[inline(never)]
fn push_again_if_harvested<C: Clock>(
    r: &DirtyRing,
    slot: &Memslot,
    gfn: u64,
    sink: Sink<'_>,
    i: u32,
) {
    sync::fence_c::<C>(Ordering::SeqCst);
    if !r.unharvested::<C>(i) {
        r.push::<C>(slot.id, gfn - slot.base_gfn.raw());
        sink.inc::<C>(Stat::DirtyMarked);
    }
}

/// Second half, after the update that set W succeeded. Bitmap: mark again — a harvest may
/// have consumed the first mark and found nothing to protect before the update; its flush
/// waits for this vCPU (the fast path runs in guest mode), so the second mark lands
/// before that harvest returns and the page is in the next one. Ring: the same, but only if
/// a harvest took the entry pushed before the update (a second entry per fix would halve
/// the ring); the fence pairs with the one in `reset_rings`, so a reset that read the SPTE
/// before the update is seen here as the entry's RESET flag (or its freeing).
#[inline]
pub(crate) fn commit_mark<C: Clock>(
    mark: Mark<'_>,
    ring: Option<&DirtyRing>,
    gfn: u64,
    sink: Sink<'_>,
    pushed: Pushed,
) {
    match mark {
        Mark::Bitmap(slot) => {
            slot.mark_dirty_after_update::<C>(gfn);
        }
        Mark::Ring(slot) => {
            if let (Some(r), Some((i, _, _))) = (ring, pushed.0) {
                push_again_if_harvested::<C>(r, slot, gfn, sink, i);
            }
        }
    }
}

/// Marks the page at `gpa` dirty from outside any vCPU (a VMM or device write into guest
/// memory), in the slot's bitmap. Returns whether the slot logs; refused without a bitmap.
pub(crate) fn mark_page_dirty<F: PteFormat>(
    mmu: &Mmu<F>,
    slots: &Memslots,
    gpa: slat_addr::Gpa,
) -> Result<bool, DirtyLogError> {
    // Shared MMU lock: a bitmap-switch harvest holds it exclusively from the switch to the
    // read of the old bitmap, so this mark lands in a bitmap that harvest, or a later one,
    // reads (vCPU marks are ordered by guest mode instead).
    let _lock = mmu.lock.read::<F::Clock>();
    let set = slots.load();
    let gfn = gpa.gfn().raw();
    let Some((_, slot)) = set.find_raw(gfn, 0) else {
        return Ok(false);
    };
    if !slot.is_logging() {
        return Ok(false);
    }
    if !slot.mark_dirty::<F::Clock>(gfn) {
        return Err(DirtyLogError::NoBitmap { id: slot.id });
    }
    mmu.counters.add_shared_c::<F::Clock>(Stat::DirtyMarked, 1);
    Ok(true)
}

/// A vCPU's hardware walker set the Dirty bit of the leaf mapping `gfn` (a write through a
/// writable leaf whose D was clear): with [`DirtyTrack::HardwareDirty`], log the page, as PML
/// would. Called in guest mode, after the D update and before the write it allows, so a
/// harvest that missed the mark waits for it in its flush and the page is in the next
/// harvest; any other mode ignores it. `hint` and `counters` are the vCPU's.
#[inline]
pub(crate) fn log_hardware_dirty<C: Clock>(
    config: &VmConfig,
    slots: &Memslots,
    hint: &mut SlotHint,
    counters: &Counters,
    gfn: u64,
) {
    if config.dirty_track != DirtyTrack::HardwareDirty {
        return;
    }
    let (set, hint) = slots.refresh::<C>(hint);
    let Some((i, slot)) = set.find_raw(gfn, *hint) else {
        return;
    };
    *hint = i;
    if slot.is_logging() && slot.mark_dirty::<C>(gfn) {
        Sink::Owned(counters).inc::<C>(Stat::DirtyMarked);
    }
}
