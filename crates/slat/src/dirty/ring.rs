//! The per-vCPU dirty ring (KVM's `KVM_CAP_DIRTY_LOG_RING`): instead of a bitmap, each vCPU
//! pushes `{slot, offset}` of every page it makes writable in a logged slot.
//!
//! Each entry moves through three states, owned alternately by the vCPU and the host:
//! `0` (free, the vCPU's) → `DIRTY` (pushed, the harvester's) → `DIRTY | RESET` (harvested,
//! waiting for [`crate::Vm::reset_dirty_rings`]) → `0`. The vCPU pushes only while fewer than
//! `size - 1` entries are in use (a write fix may push twice, below), and asks to exit to the
//! VMM ("ring full") once `soft_limit` are, so a ring never overflows: the reserve between the
//! two absorbs the entries a vCPU can push before it reaches its next exit point.
//!
//! **The guarantee** (invariants 3 and 4, as with a bitmap): a write fix pushes its entry
//! *before* the SPTE update that sets W, so a write that completed before a harvest started
//! (by this vCPU or any other, through the entry the fix made writable) is in that harvest's
//! collect; and a page a harvest's reset re-protected is written again only after a fault
//! pushed a new entry. Pushing first has one hazard: a harvest can collect the entry and
//! its reset find nothing to protect while the update is still to come, leaving the page
//! writable with its entry gone. So after the update the vCPU looks at its entry again
//! ([`DirtyRing::unharvested`]) and, if a harvest took it meanwhile, pushes a second one.
//! That second entry is visible before the reset returns: a fast-path fix runs in guest
//! mode, which the reset's flush waits out; a slow-path fix holds the MMU lock, which the
//! reset takes exclusively (with `rmap-lockless`, which re-protects without it, the reset takes
//! it once before returning). A SeqCst fence on each side (after the update here, before a
//! reset reads the SPTE there) makes "the reset missed W" imply "the vCPU sees its entry
//! harvested". A page can therefore be reported by two consecutive harvests for one write
//! fix, never by neither. (KVM pushes after the update on its fast path, so a write by
//! another vCPU in between can reach userspace one harvest late there.)
//!
//! The host must copy a harvested page only after the reset that re-protects it has
//! returned.

use crate::clock::{Clock, RealTime};
use crate::memslot::SlotId;
use crate::sync::{self, AtomicU32, AtomicU64, Mutex, Ordering};
use slat_addr::PageIndex;

/// Entry flag: pushed by the vCPU, not yet harvested.
pub const DIRTY_GFN_DIRTY: u32 = 1 << 0;
/// Entry flag: harvested by the host, waiting for a reset.
pub const DIRTY_GFN_RESET: u32 = 1 << 1;
/// Entries kept in reserve above the soft limit (KVM_DIRTY_RING_RSVD_ENTRIES).
pub const RING_RESERVED_ENTRIES: u32 = 64;
/// Smallest ring: twice the reserve, so the soft limit leaves room to work.
pub const RING_MIN_ENTRIES: u32 = 2 * RING_RESERVED_ENTRIES;
/// Largest ring (KVM_DIRTY_RING_MAX_ENTRIES).
pub const RING_MAX_ENTRIES: u32 = 65536;

/// One ring entry (`struct kvm_dirty_gfn`).
#[derive(Debug, Default)]
#[repr(C)]
pub struct DirtyGfn {
    flags: AtomicU32,
    slot: AtomicU32,
    offset: AtomicU64,
}

/// A vCPU's dirty ring.
///
/// What a harvest ([`DirtyRing::harvest`] of every ring, then
/// [`crate::Vm::reset_dirty_rings`]) guarantees: every page written (by any vCPU) before the
/// harvest began is collected by it, unless an earlier harvest that overlapped the write
/// collected it. A write fault pushes its entry before it makes the page writable, and a
/// second one if a harvest took the first meanwhile, so one fault may be collected by two
/// consecutive harvests, never by none; and a fault needs room for two entries. Copy a page
/// only after the reset has returned.
#[derive(Debug)]
pub struct DirtyRing {
    entries: Box<[DirtyGfn]>,
    soft_limit: u32,
    /// Next entry the vCPU fills (free running; written only by the owning vCPU).
    dirty_index: AtomicU32,
    /// Next entry a reset frees (free running; written only under the slots lock).
    reset_index: AtomicU32,
    /// Next entry the host harvests (free running).
    fetch_index: Mutex<u32>,
}

impl DirtyRing {
    pub(crate) fn new(size: u32) -> Self {
        debug_assert!(size.is_power_of_two() && size >= RING_MIN_ENTRIES);
        DirtyRing {
            entries: (0..size).map(|_| DirtyGfn::default()).collect(),
            soft_limit: size - RING_RESERVED_ENTRIES,
            dirty_index: AtomicU32::new(0),
            reset_index: AtomicU32::new(0),
            fetch_index: Mutex::new(0),
        }
    }

    /// Entries in the ring.
    pub fn size(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Entries in use: pushed and not yet reset.
    pub fn used(&self) -> u32 {
        self.dirty_index
            .load(Ordering::Acquire)
            .wrapping_sub(self.reset_index.load(Ordering::Acquire))
    }

    /// The vCPU must exit to the VMM before running on: the VMM harvests and resets.
    #[inline]
    pub fn soft_full(&self) -> bool {
        self.used() >= self.soft_limit
    }

    /// The owning vCPU can push one more entry.
    #[inline]
    pub(crate) fn has_room(&self) -> bool {
        self.has_room_for(1)
    }

    /// The owning vCPU can push `n` more entries (`n` at most [`RING_RESERVED_ENTRIES`]).
    #[inline]
    pub(crate) fn has_room_for(&self, n: u32) -> bool {
        self.used() <= self.size() - n
    }

    #[inline]
    fn entry(&self, index: u32) -> &DirtyGfn {
        &self.entries[(index & (self.size() - 1)) as usize]
    }

    /// Pushes `{slot, offset}` and returns the entry's index. Only the owning vCPU calls this
    /// (it holds `&mut Vcpu`), after checking [`Self::has_room`]: nobody else frees entries
    /// faster than it could fill them.
    pub(crate) fn push<C: Clock>(&self, slot: SlotId, offset: u64) -> u32 {
        let i = self.dirty_index.load(Ordering::Relaxed);
        debug_assert!(self.has_room(), "dirty ring overflow");
        let e = self.entry(i);
        debug_assert_eq!(e.flags.load(Ordering::Relaxed), 0);
        e.slot.store(slot, Ordering::Relaxed);
        e.offset.store(offset, Ordering::Relaxed);
        // Release: a harvester that sees DIRTY sees the slot and offset.
        sync::store::<C, _>(&e.flags, DIRTY_GFN_DIRTY, Ordering::Release);
        sync::store::<C, _>(&self.dirty_index, i.wrapping_add(1), Ordering::Release);
        i
    }

    /// The entry pushed at `index` is still waiting for a harvest. Asked by the owning vCPU
    /// within the fault that pushed it, so the entry cannot have been freed and pushed again.
    #[inline]
    pub(crate) fn unharvested<C: Clock>(&self, index: u32) -> bool {
        sync::load::<C, _>(&self.entry(index).flags, Ordering::Acquire) == DIRTY_GFN_DIRTY
    }

    /// Harvests, in order, every entry pushed since the last harvest: calls `f(slot, offset)`
    /// and flags the entry for reset. Returns how many were harvested. Entries are freed (and
    /// their pages re-protected) only by the next [`crate::Vm::reset_dirty_rings`].
    pub fn harvest(&self, f: impl FnMut(SlotId, PageIndex)) -> u32 {
        self.harvest_c::<RealTime>(f)
    }

    /// [`Self::harvest`], reported to clock `C`.
    pub(crate) fn harvest_c<C: Clock>(&self, mut f: impl FnMut(SlotId, PageIndex)) -> u32 {
        let mut fetch = sync::lock_c::<C, _>(&self.fetch_index);
        let mut n = 0;
        loop {
            let e = self.entry(*fetch);
            // Acquire: pairs with the push's release of DIRTY.
            if sync::load::<C, _>(&e.flags, Ordering::Acquire) != DIRTY_GFN_DIRTY {
                break;
            }
            f(
                e.slot.load(Ordering::Relaxed),
                PageIndex::new(e.offset.load(Ordering::Relaxed)),
            );
            // Release: the reset that sees RESET sees the entry as we read it.
            sync::store::<C, _>(
                &e.flags,
                DIRTY_GFN_DIRTY | DIRTY_GFN_RESET,
                Ordering::Release,
            );
            *fetch = fetch.wrapping_add(1);
            n += 1;
        }
        n
    }

    /// Frees the harvested entries, in order, calling `f(slot, offset)` for each; stops at the
    /// first entry not yet harvested. Called under the slots lock (one resetter at a time).
    pub(crate) fn reset<C: Clock>(&self, mut f: impl FnMut(SlotId, u64)) -> u32 {
        let mut i = self.reset_index.load(Ordering::Relaxed);
        let mut n = 0;
        // Follow the flags only: a harvester that saw an entry DIRTY may not yet see the
        // vCPU's `dirty_index` move past it (the index is stored after the flags), and an
        // entry it flagged for reset must be re-protected now, not at some later reset.
        while n < self.size() {
            let e = self.entry(i);
            if sync::load::<C, _>(&e.flags, Ordering::Acquire) & DIRTY_GFN_RESET == 0 {
                break;
            }
            f(
                e.slot.load(Ordering::Relaxed),
                e.offset.load(Ordering::Relaxed),
            );
            sync::store::<C, _>(&e.flags, 0, Ordering::Release);
            i = i.wrapping_add(1);
            // Release: the vCPU that sees the new index sees the entry free.
            sync::store::<C, _>(&self.reset_index, i, Ordering::Release);
            n += 1;
        }
        n
    }
}

/// Folds a stream of `(slot, offset)` into runs of `(slot, base offset, 64-bit mask)`, as a
/// reset coalesces entries before re-protecting (forward or backward within 64 pages).
#[derive(Debug, Default)]
pub(crate) struct Coalesce {
    cur: Option<(SlotId, u64, u64)>,
}

impl Coalesce {
    /// Adds one entry; returns a finished run when it does not fit the current one.
    pub(crate) fn add(&mut self, slot: SlotId, offset: u64) -> Option<(SlotId, u64, u64)> {
        if let Some((s, base, mask)) = &mut self.cur {
            if *s == slot {
                if offset >= *base && offset - *base < 64 {
                    *mask |= 1 << (offset - *base);
                    return None;
                }
                if offset < *base {
                    let shift = *base - offset;
                    if shift < 64 && mask.leading_zeros() as u64 >= shift {
                        *mask = (*mask << shift) | 1;
                        *base = offset;
                        return None;
                    }
                }
            }
        }
        self.cur.replace((slot, offset, 1))
    }

    /// The last run.
    pub(crate) fn finish(&mut self) -> Option<(SlotId, u64, u64)> {
        self.cur.take()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn push_harvest_reset_cycle() {
        let r = DirtyRing::new(RING_MIN_ENTRIES);
        for i in 0..10 {
            assert!(r.has_room());
            r.push::<crate::clock::RealTime>(1, i);
        }
        assert_eq!(r.used(), 10);
        // Nothing harvested: a reset frees nothing.
        assert_eq!(
            r.reset::<crate::clock::RealTime>(|_, _| panic!("reset an unharvested entry")),
            0
        );
        let mut got = Vec::new();
        assert_eq!(r.harvest(|s, o| got.push((s, o.raw()))), 10);
        assert_eq!(got, (0..10).map(|i| (1, i)).collect::<Vec<_>>());
        assert_eq!(r.harvest(|_, _| panic!("harvested twice")), 0);
        let mut freed = 0;
        assert_eq!(r.reset::<crate::clock::RealTime>(|_, _| freed += 1), 10);
        assert_eq!((freed, r.used()), (10, 0));
    }

    #[test]
    fn soft_limit_leaves_the_reserve() {
        let r = DirtyRing::new(RING_MIN_ENTRIES);
        let soft = RING_MIN_ENTRIES - RING_RESERVED_ENTRIES;
        for i in 0..soft {
            assert!(!r.soft_full(), "soft full after {i}");
            r.push::<crate::clock::RealTime>(2, i as u64);
        }
        assert!(r.soft_full());
        for i in soft..RING_MIN_ENTRIES {
            assert!(r.has_room());
            r.push::<crate::clock::RealTime>(2, i as u64);
        }
        assert!(!r.has_room());
        r.harvest(|_, _| {});
        r.reset::<crate::clock::RealTime>(|_, _| {});
        assert!(r.has_room() && !r.soft_full());
        // Indices wrap around the ring.
        r.push::<crate::clock::RealTime>(2, 7);
        let mut got = Vec::new();
        r.harvest(|s, o| got.push((s, o.raw())));
        assert_eq!(got, vec![(2, 7)]);
    }

    #[test]
    fn coalesce_forward_backward_and_breaks() {
        let mut c = Coalesce::default();
        assert_eq!(c.add(1, 100), None);
        assert_eq!(c.add(1, 163), None);
        assert_eq!(c.add(1, 101), None);
        // 164 is 64 past the base: a new run.
        assert_eq!(c.add(1, 164), Some((1, 100, 1 | 2 | 1 << 63)));
        // Backward within the window of the run at 164 (its mask only has bit 0).
        assert_eq!(c.add(1, 130), None);
        assert_eq!(c.finish(), Some((1, 130, 1 | 1 << 34)));
        // Another slot always breaks a run.
        assert_eq!(c.add(1, 5), None);
        assert_eq!(c.add(2, 5), Some((1, 5, 1)));
        // Backward too far for the mask: a new run.
        assert_eq!(c.add(2, 69), Some((2, 5, 1)));
        assert_eq!(c.add(2, 74), None);
        assert_eq!(c.add(2, 6), Some((2, 69, 1 | 1 << 5)));
        assert_eq!(c.finish(), Some((2, 6, 1)));
    }
}
