//! Per-page memory attributes (KVM's `KVM_SET_MEMORY_ATTRIBUTES`): whether a guest page is
//! `PRIVATE` (backed by the slot's private pool, guest_memfd-like) or shared (the default,
//! backed by the slot's ordinary host range).
//!
//! **Where they live.** One bit per page in the memslot, in an [`AttributeBitmap`] shared by
//! every published copy of the slot (like the dirty bitmap), and only in slots that have a
//! private backing: a slot without one is shared everywhere. Faults read a bit with one
//! relaxed load, ordered by the memslot generation (below).
//!
//! **Departure from KVM.** KVM keeps attributes per VM in an xarray indexed by gfn, accepts
//! any page-aligned non-empty range (with or without memslots) and checks for a guest_memfd
//! only at fault time. Here a range must lie inside memslots with no hole, and `PRIVATE`
//! needs a private backing in every slot it touches, so a VMM mistake is an error at the
//! ioctl rather than a stream of memory-fault exits. Attributes are slot-relative: they go
//! away with the slot and move with it.
//!
//! **Ordering against racing faults** (KVM's `mmu_invalidate_seq` retry; here the memslot
//! generation). A conversion, under the slots lock: (1) writes the bits, (2) publishes the
//! same slots under a new generation (a `SeqCst` store after the bits) and waits out faults
//! holding the MMU lock, (3) zaps the range and completes its flush before returning.
//! A fault reads the generation (`Acquire`), then the bit, then re-checks the generation
//! under the MMU lock. If the fault read the old bit, it read the generation before (2) (a
//! fault that sees (2)'s value sees the bits written before it), so either it re-checks
//! before (2)'s wait — and whatever it installs exists before (3) zaps it — or after, and
//! the re-check fails and it retries. A fault that read the new bit may still find a leaf of
//! the old kind that (3) has not reached yet (the zap yields the lock every 4096 entries):
//! the slow path never upgrades a leaf whose host address differs from what it would map,
//! it retries until the zap has removed it. So after (3) no leaf of the old kind exists, and
//! its flush means no vCPU still caches one (invariant 4's order, for conversions).
//!
//! **Huge pages.** A slot with a private backing maps at 4 KiB only (`Memslot::max_level`),
//! so a leaf never covers pages of both kinds; KVM instead tracks mixed huge ranges per level
//! (`KVM_LPAGE_MIXED_FLAG`). The fast path leaves such slots to the slow path, which checks
//! the attribute (`fault/mod.rs`).
//!
//! **Dirty logging.** A slot with a private backing refuses `LOG_DIRTY_PAGES` (and
//! `READONLY`), at creation and later (`MemslotError::PrivateIncompatibleFlags`), as KVM's
//! `check_memory_region_flags` does for guest_memfd slots: the host cannot read private
//! memory, so logging it for migration is meaningless (confidential migration goes through
//! the platform's firmware), and a read-only private page has no meaning. Shared-only slots
//! log exactly as before, and a conversion never touches another slot's log.
//!
//! **Aging.** Unchanged and kind-blind: the aging calls take gfn ranges from the caller and
//! age whatever leaves are there. KVM's MMU notifiers age only shared mappings (private
//! memory is not on the host's LRU); a VMM here does the same by passing shared ranges. Aging
//! a private leaf is still safe: with A/D bits off the next access faults, and since the fast
//! path leaves private-capable slots alone, the slow path restores it after checking the
//! access against the attribute.

use super::ops::SlotsHeld;
use super::{Memslot, Memslots, SlotId};
use crate::format::PteFormat;
use crate::mmu::Mmu;
use crate::sync::{AtomicU64, Ordering};
use bitflags::bitflags;
use slat_addr::Gfn;

bitflags! {
    /// Memory attributes of a guest page, with KVM's values.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct MemoryAttributes: u64 {
        /// The page is private to the guest: faults map it from the memslot's private
        /// backing, and only private accesses may use it.
        const PRIVATE = 1 << 3;
    }
}

/// Why `set_memory_attributes` was refused. Nothing changes when an error is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryAttributeError {
    /// The call may flush, and the calling thread holds a CPU the flush would wait for in
    /// guest mode (or online): it would wait for itself. Nothing changed.
    #[error(transparent)]
    Flush(#[from] crate::mmu::flush::FlushError),
    /// Attribute bits this engine does not know.
    #[error("unknown memory attribute bits {bits:#x} (known: PRIVATE=0x8)")]
    UnknownAttributes {
        /// The unknown bits.
        bits: u64,
    },
    /// The range is empty.
    #[error("memory attribute range at gfn {first_gfn:#x} is empty")]
    Empty {
        /// Its first page.
        first_gfn: Gfn,
    },
    /// `first_gfn + npages` overflows.
    #[error("memory attribute range gfn {first_gfn:#x} + {npages:#x} pages overflows")]
    Overflow {
        /// First page.
        first_gfn: Gfn,
        /// Pages.
        npages: u64,
    },
    /// A page of the range is in no memslot.
    #[error("gfn {gfn:#x} of the memory attribute range is in no memslot")]
    OutsideMemslots {
        /// The first such page.
        gfn: Gfn,
    },
    /// `PRIVATE` was asked for on a slot that has no private backing.
    #[error("memslot {id} has no private backing, so its pages cannot be made private")]
    NoPrivateBacking {
        /// The slot.
        id: SlotId,
    },
}

/// One attribute bit (`PRIVATE`) per page of a memslot with a private backing.
#[derive(Debug)]
pub(crate) struct AttributeBitmap {
    words: Box<[AtomicU64]>,
}

impl AttributeBitmap {
    /// All pages shared.
    pub(crate) fn new(npages: u64) -> Self {
        let words = (0..npages.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        AttributeBitmap { words }
    }

    /// Page `rel` (slot-relative, in range) is private. `Relaxed`: the caller's `Acquire`
    /// load of the memslot generation orders it (see the module comment).
    #[inline]
    pub(crate) fn is_private(&self, rel: u64) -> bool {
        self.words[(rel / 64) as usize].load(Ordering::Relaxed) & (1 << (rel % 64)) != 0
    }

    /// Whether every page of `[lo, hi)` is already `private`.
    fn all_equal(&self, lo: u64, hi: u64, private: bool) -> bool {
        word_masks(lo, hi).all(|(w, mask)| {
            let v = self.words[w].load(Ordering::Relaxed) & mask;
            v == if private { mask } else { 0 }
        })
    }

    /// Sets `[lo, hi)` to `private`, a word at a time. Only the slots-lock holder writes;
    /// `Relaxed` because the generation store that follows publishes them.
    fn set_range<C: crate::clock::Clock>(&self, lo: u64, hi: u64, private: bool) {
        for (w, mask) in word_masks(lo, hi) {
            if private {
                crate::sync::fetch_or::<C, _>(&self.words[w], mask, Ordering::Relaxed);
            } else {
                crate::sync::fetch_and::<C, _>(&self.words[w], !mask, Ordering::Relaxed);
            }
        }
    }
}

/// The words of `[lo, hi)` (page indexes, `lo < hi`) and the bits of each inside the range.
fn word_masks(lo: u64, hi: u64) -> impl Iterator<Item = (usize, u64)> {
    let (first, last) = (lo / 64, (hi - 1) / 64);
    (first..=last).map(move |w| {
        let from = if w == first { lo % 64 } else { 0 };
        let to = if w == last { (hi - 1) % 64 } else { 63 };
        let mask = (u64::MAX >> (63 - to)) & (u64::MAX << from);
        (w as usize, mask)
    })
}

/// One slot's share of a checked attribute range: slot-relative `[lo, hi)`.
struct Piece<'s> {
    slot: &'s Memslot,
    lo: u64,
    hi: u64,
}

impl Memslots {
    /// `KVM_SET_MEMORY_ATTRIBUTES` on `[first_gfn, first_gfn + npages)`: checks everything
    /// first (nothing changes on error); if any page changes kind, converts and zaps the
    /// range, flushed before returning (see the module comment for the order).
    pub(crate) fn set_attributes<F: PteFormat>(
        &self,
        _held: &SlotsHeld<'_, F::Clock>,
        mmu: &Mmu<F>,
        first_gfn: u64,
        npages: u64,
        attrs: MemoryAttributes,
    ) -> Result<(), MemoryAttributeError> {
        let unknown = attrs.bits() & !MemoryAttributes::all().bits();
        if unknown != 0 {
            return Err(MemoryAttributeError::UnknownAttributes { bits: unknown });
        }
        let private = attrs.contains(MemoryAttributes::PRIVATE);
        let set = self.load();
        let pieces = pieces(set.slots(), first_gfn, npages, private)?;
        let unchanged = pieces.iter().all(|p| match p.slot.attrs() {
            Some(a) => a.all_equal(p.lo, p.hi, private),
            None => !private, // validated: a slot without a private pool is shared
        });
        if unchanged {
            return Ok(()); // as KVM: nothing to convert, nothing to zap
        }
        for p in &pieces {
            if let Some(a) = p.slot.attrs() {
                a.set_range::<F::Clock>(p.lo, p.hi, private);
            }
        }
        // (2): same slots, new generation; faults that looked at the old bits retry.
        self.publish(mmu, |_| {});
        // (3): no leaf of the old kind survives, and no vCPU caches one, once this returns.
        if !mmu
            .hooks
            .active(crate::test_hooks::inject::SKIP_CONVERSION_ZAP)
        {
            mmu.zap_gfn_range(Gfn::new(first_gfn), Gfn::new(first_gfn + npages));
        }
        // (4): back to shared, no guest maps the private pages any more: the host gets them
        // back in its direct map (scrubbed). Acceptances in flight finished under the MMU
        // lock before (2)'s wait returned, so none is missed (see `direct_map`).
        if !private {
            for p in &pieces {
                if let Some(lease) = p.slot.private.as_ref().and_then(|b| b.lease.as_ref()) {
                    lease.release_range::<F::Clock>(p.lo, p.hi);
                }
            }
        }
        Ok(())
    }
}

/// Splits `[first_gfn, first_gfn + npages)` into per-slot pieces, refusing empty and
/// overflowing ranges, holes, and `private` on a slot without a private backing.
fn pieces<'s>(
    slots: &'s [crate::sync::Arc<Memslot>],
    first_gfn: u64,
    npages: u64,
    private: bool,
) -> Result<Vec<Piece<'s>>, MemoryAttributeError> {
    if npages == 0 {
        return Err(MemoryAttributeError::Empty {
            first_gfn: Gfn::new(first_gfn),
        });
    }
    let end = first_gfn
        .checked_add(npages)
        .ok_or(MemoryAttributeError::Overflow {
            first_gfn: Gfn::new(first_gfn),
            npages,
        })?;
    let mut out = Vec::new();
    let mut gfn = first_gfn;
    while gfn < end {
        // Slots are sorted and never overlap: the one containing `gfn`, if any.
        let i = slots.partition_point(|s| s.end_gfn().raw() <= gfn);
        let slot = match slots.get(i) {
            Some(s) if s.contains_raw(gfn) => &**s,
            _ => return Err(MemoryAttributeError::OutsideMemslots { gfn: Gfn::new(gfn) }),
        };
        if private && slot.attrs().is_none() {
            return Err(MemoryAttributeError::NoPrivateBacking { id: slot.id });
        }
        let stop = end.min(slot.end_gfn().raw());
        out.push(Piece {
            slot,
            lo: gfn - slot.base_gfn.raw(),
            hi: stop - slot.base_gfn.raw(),
        });
        gfn = stop;
    }
    Ok(out)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Word-at-a-time updates agree with a page-at-a-time model on every range of 200 pages.
    #[test]
    fn word_masks_cover_exactly_the_range() {
        let n = 200;
        for lo in 0..n {
            for hi in lo + 1..=n {
                let b = AttributeBitmap::new(n);
                b.set_range::<crate::clock::RealTime>(0, n, true);
                b.set_range::<crate::clock::RealTime>(lo, hi, false);
                for rel in 0..n {
                    assert_eq!(
                        b.is_private(rel),
                        !(lo..hi).contains(&rel),
                        "[{lo},{hi}) {rel}"
                    );
                }
                assert!(b.all_equal(lo, hi, false));
                assert_eq!(b.all_equal(0, n, false), lo == 0 && hi == n);
            }
        }
    }
}
