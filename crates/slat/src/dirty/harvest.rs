//! Harvests (invariant 4: snapshot-and-clear, re-arm exactly what was returned, flush,
//! return): GET_DIRTY_LOG, CLEAR_DIRTY_LOG, RESET_DIRTY_RINGS.

use super::bitmap::{DirtyBitmap, Read, SlotBitmap};
use super::rearm::{rearm_masked, LeafCursor};
use super::ring::Coalesce;
use super::{DirtyLog, DirtyLogError};
use crate::config::{GetLogVariant, WrprotVariant};
use crate::format::{FrameStep, PteFormat};
use crate::memslot::{Memslot, Memslots, SlotId};
use crate::mmu::flush::PendingFlush;
use crate::mmu::Mmu;
use crate::stats::Stat;
use crate::sync::{self, Arc, Ordering};
use slat_addr::PageIndex;

impl DirtyLog {
    // -----------------------------------------------------------------------------------------
    // Harvests.

    /// KVM_GET_DIRTY_LOG into `out`: the slot's bitmap (one bit per page, `ceil(npages / 64)`
    /// words, clean words written as zeros), or its non-zero words as `(index, bits)`. Returns
    /// the number of dirty pages.
    ///
    /// Without manual protection the bits are cleared, the pages they name write-protected and
    /// a remote flush completed before this returns (invariant 4), by per-word exchange or by
    /// the bitmap switch ([`GetLogVariant`]). With manual protection the bitmap is only copied;
    /// [`crate::Vm::clear_dirty_log`] does the rest. Either way only the words the summary
    /// names are read (`dirty/bitmap.rs`), except with `xchg-full` and `switch-full`, which read
    /// every word of the slot as KVM does.
    pub(crate) fn get_dirty_log<F: PteFormat>(
        &self,
        mmu: &Mmu<F>,
        slots: &Memslots,
        id: SlotId,
        mut out: LogOut<'_>,
    ) -> Result<u64, DirtyLogError> {
        let _s = slots.lock::<F::Clock>();
        let slot = logged_slot(slots, id)?;
        let Some(bitmap) = slot.dirty.as_deref() else {
            return Err(DirtyLogError::NoBitmap { id });
        };
        out.begin(id, bitmap.nwords())?;
        let mut dirty = 0u64;
        if self.mode().manual() {
            let reads = bitmap
                .active()
                .harvest::<F::Clock>(Read::Copy, &mut |i, mask| {
                    dirty += mask.count_ones() as u64;
                    out.word(i, mask);
                });
            mmu.counters
                .add_shared_c::<F::Clock>(Stat::DirtyWordsRead, reads);
            return Ok(dirty);
        }
        let variant = mmu.config.get_log;
        let two = bitmap.can_switch();
        if variant == GetLogVariant::XchgFull && two {
            // KVM zeroes its second bitmap before it takes the MMU lock.
            bitmap.other::<F::Clock>().zero_all::<F::Clock>();
        }
        let mut pending = PendingFlush::none();
        {
            let lock = harvest_lock(mmu);
            let old = (variant.switches() && two).then(|| switch_sides(mmu, bitmap, &lock));
            let mut cursor = LeafCursor::default();
            let mut take = |i: usize, mask: u64| {
                out.word(i, mask);
                dirty += mask.count_ones() as u64;
                let base = slot.base_gfn.plus(64 * i as u64);
                rearm_masked(mmu, lock.as_ref(), &mut cursor, base, mask, &mut pending);
            };
            let reads = match (old, variant) {
                (Some(b), GetLogVariant::SwitchFull) => {
                    b.scan_all::<F::Clock>(Read::TakeUnshared, &mut take)
                }
                (Some(b), _) => b.harvest::<F::Clock>(Read::TakeUnshared, &mut take),
                (None, GetLogVariant::XchgFull) if two => {
                    // Each taken word goes to the second bitmap, which the copy reads.
                    let buffer = bitmap.other::<F::Clock>();
                    let mut keep = |i: usize, mask: u64| {
                        buffer.put::<F::Clock>(i, mask);
                        take(i, mask);
                    };
                    bitmap.active().scan_all::<F::Clock>(Read::Take, &mut keep)
                }
                (None, _) => bitmap.active().harvest::<F::Clock>(Read::Take, &mut take),
            };
            mmu.counters
                .add_shared_c::<F::Clock>(Stat::DirtyWordsRead, reads);
        }
        if dirty > 0 {
            pending.require();
        }
        complete_harvest(mmu, pending);
        Ok(dirty)
    }

    /// KVM_CLEAR_DIRTY_LOG: for pages `first_page + i` with bit `i` of `bitmap` set, clears
    /// their dirty bits and write-protects those whose bit was actually set, then completes a
    /// remote flush. `first_page` must be a multiple of 64 and `num_pages` too unless the range
    /// ends the slot; bits beyond `num_pages` are ignored. Needs manual protection. Returns the
    /// number of bits cleared.
    pub(crate) fn clear_dirty_log<F: PteFormat>(
        &self,
        mmu: &Mmu<F>,
        slots: &Memslots,
        id: SlotId,
        first: PageIndex,
        num_pages: u64,
        bitmap: &[u64],
    ) -> Result<u64, DirtyLogError> {
        let first_page = first.raw();
        let _s = slots.lock::<F::Clock>();
        let (slot, log) = manual_slot(self, slots, id)?;
        if first_page % 64 != 0 {
            return Err(DirtyLogError::ClearUnaligned {
                id,
                first_page: first,
            });
        }
        let npages = slot.npages;
        if first_page > npages
            || num_pages > npages - first_page
            || (num_pages < npages - first_page && num_pages % 64 != 0)
        {
            return Err(DirtyLogError::ClearRange {
                id,
                first_page: first,
                num_pages,
                npages,
            });
        }
        let words = num_pages.div_ceil(64) as usize;
        if bitmap.len() < words {
            return Err(DirtyLogError::BitmapTooSmall {
                id,
                need: words,
                have: bitmap.len(),
            });
        }
        let first_word = (first_page / 64) as usize;
        let wanted = bitmap.iter().enumerate().take(words).map(|(k, &want)| {
            let left = num_pages - 64 * k as u64;
            let want = if left < 64 {
                want & ((1u64 << left) - 1)
            } else {
                want
            };
            (first_word + k, want)
        });
        Ok(clear_words(mmu, &slot, log.active(), wanted))
    }

    /// CLEAR of the words `(index, bits)` of the slot's bitmap: every index is checked first
    /// (one past the slot's words is refused, nothing cleared), bits past the slot's last page
    /// are ignored, then as [`Self::clear_dirty_log`] with one flush for the whole list.
    pub(crate) fn clear_dirty_log_words<F: PteFormat>(
        &self,
        mmu: &Mmu<F>,
        slots: &Memslots,
        id: SlotId,
        words: &[(usize, u64)],
    ) -> Result<u64, DirtyLogError> {
        let _s = slots.lock::<F::Clock>();
        let (slot, log) = manual_slot(self, slots, id)?;
        let nwords = log.nwords();
        if let Some(&(word, _)) = words.iter().find(|&&(i, _)| i >= nwords) {
            return Err(DirtyLogError::WordOutOfRange { id, word, nwords });
        }
        let npages = slot.npages;
        let wanted = words.iter().map(|&(i, want)| {
            let left = npages - 64 * i as u64;
            let want = if left < 64 {
                want & ((1u64 << left) - 1)
            } else {
                want
            };
            (i, want)
        });
        Ok(clear_words(mmu, &slot, log.active(), wanted))
    }

    /// KVM_RESET_DIRTY_RINGS: frees every harvested ring entry and write-protects its page
    /// (runs of entries in one 64-page window share one walk), then completes a remote flush.
    /// Entries of slots deleted or no longer logging since they were pushed are dropped.
    /// Returns the number of entries reset.
    pub(crate) fn reset_rings<F: PteFormat>(
        &self,
        mmu: &Mmu<F>,
        slots: &Memslots,
    ) -> Result<u64, DirtyLogError> {
        let _s = slots.lock::<F::Clock>();
        if self.mode().ring_entries == 0 {
            return Err(DirtyLogError::RingOff);
        }
        let rings = self.rings::<F::Clock>();
        let set = slots.load();
        let mut total = 0u64;
        let mut pending = PendingFlush::none();
        let mut cursor = LeafCursor::default();
        {
            let lock = harvest_lock(mmu);
            let mut protect = |run: Option<(SlotId, u64, u64)>, pending: &mut PendingFlush| {
                let Some((id, offset, mask)) = run else {
                    return;
                };
                let Some(slot) = set.by_id(id) else { return };
                let last = offset + 63 - mask.leading_zeros() as u64;
                if !slot.is_logging() || last >= slot.npages {
                    return;
                }
                // Between reading the entries' RESET flags and reading their SPTEs: pairs
                // with the write fix's fence in `commit_mark`, so a fix whose update this
                // re-arm misses sees its entry harvested and pushes another (`ring.rs`).
                sync::fence_c::<F::Clock>(Ordering::SeqCst);
                let base = slot.base_gfn.plus(offset);
                rearm_masked(mmu, lock.as_ref(), &mut cursor, base, mask, pending);
            };
            for ring in &rings {
                let mut runs = Coalesce::default();
                total += ring
                    .reset::<F::Clock>(|slot, offset| protect(runs.add(slot, offset), &mut pending))
                    as u64;
                protect(runs.finish(), &mut pending);
            }
        }
        if total > 0 {
            pending.require();
        }
        complete_harvest(mmu, pending);
        Ok(total)
    }
}

/// Where GET writes what it read: the caller's whole bitmap, or a list of non-zero words.
pub(crate) enum LogOut<'a> {
    /// One word per 64 pages; clean words are written as zeros.
    Dense(&'a mut [u64]),
    /// `(word index, bits)` of each non-zero word, in index order; emptied first.
    Sparse(&'a mut Vec<(usize, u64)>),
}

impl LogOut<'_> {
    /// Checks the buffer against the slot's `nwords` and clears it, before anything is read.
    fn begin(&mut self, id: SlotId, nwords: usize) -> Result<(), DirtyLogError> {
        match self {
            LogOut::Dense(out) => {
                let Some(head) = out.get_mut(..nwords) else {
                    return Err(DirtyLogError::BitmapTooSmall {
                        id,
                        need: nwords,
                        have: out.len(),
                    });
                };
                // A fill, not a scan of the bitmap: the caller's memory, written once.
                head.fill(0);
            }
            LogOut::Sparse(v) => v.clear(),
        }
        Ok(())
    }

    #[inline]
    fn word(&mut self, i: usize, mask: u64) {
        match self {
            LogOut::Dense(out) => {
                if let Some(o) = out.get_mut(i) {
                    *o = mask;
                }
            }
            LogOut::Sparse(v) => v.push((i, mask)),
        }
    }
}

/// The slot `id` for a CLEAR: manual protection on, the slot logging into a bitmap.
fn manual_slot(
    log: &DirtyLog,
    slots: &Memslots,
    id: SlotId,
) -> Result<(Arc<Memslot>, Arc<SlotBitmap>), DirtyLogError> {
    if !log.mode().manual() {
        return Err(DirtyLogError::ManualProtectOff);
    }
    let slot = logged_slot(slots, id)?;
    let bitmap = slot.dirty.clone().ok_or(DirtyLogError::NoBitmap { id })?;
    Ok((slot, bitmap))
}

/// Clears `(word, bits)` of `bitmap` (the active side of `slot`'s log), write-protects the
/// pages whose bits were set, completes one flush. Returns the bits cleared.
fn clear_words<F: PteFormat>(
    mmu: &Mmu<F>,
    slot: &Memslot,
    bitmap: &DirtyBitmap,
    words: impl Iterator<Item = (usize, u64)>,
) -> u64 {
    let mut cleared = 0;
    let mut reads = 0;
    let mut pending = PendingFlush::none();
    let mut cursor = LeafCursor::default();
    {
        let lock = harvest_lock(mmu);
        for (i, want) in words {
            if want == 0 {
                continue;
            }
            let mask = bitmap.clear_bits::<F::Clock>(i, want, &mut reads);
            if mask != 0 {
                cleared += mask.count_ones() as u64;
                let base = slot.base_gfn.plus(64 * i as u64);
                rearm_masked(mmu, lock.as_ref(), &mut cursor, base, mask, &mut pending);
            }
        }
    }
    mmu.counters
        .add_shared_c::<F::Clock>(Stat::DirtyWordsRead, reads);
    if cleared > 0 {
        pending.require();
    }
    complete_harvest(mmu, pending);
    cleared
}

/// The bitmap switch: marks go to the other side from now on; returns the old side once no
/// marker can still write to it.
fn switch_sides<'a, F: PteFormat>(
    mmu: &Mmu<F>,
    bitmap: &'a SlotBitmap,
    lock: &Option<crate::mmu::lock::WriteGuard<'_, F::Clock>>,
) -> &'a DirtyBitmap {
    let old = bitmap.switch::<F::Clock>();
    // Markers that loaded the old side are either slow-path faults, which hold the MMU lock we
    // own exclusively, or fast-path fixes, which run in guest mode: a completed flush waits
    // them out, and afterwards nobody writes the old side. Without the lock
    // (`rmap-lockless`), taking it once waits the slow paths out.
    if lock.is_none() {
        drop(mmu.lock.write::<F::Clock>());
    }
    // Refused only from a thread in guest mode, which the public entry refused.
    let _checked_at_entry = mmu.flush_remote_tlbs();
    old
}

/// The MMU lock a harvest holds while it re-arms pages: exclusive, except with `rmap-lockless`,
/// which takes none (it re-arms with compare-and-swaps, pinned in the epoch).
fn harvest_lock<F: PteFormat>(mmu: &Mmu<F>) -> Option<crate::mmu::lock::WriteGuard<'_, F::Clock>> {
    (mmu.config.wrprot != WrprotVariant::RmapLockless).then(|| mmu.lock.write::<F::Clock>())
}

/// What ends a harvest (invariant 4): with `rmap-lockless`, which re-armed without the MMU
/// lock, first take the lock once — a slow-path write fix holds it shared from its first
/// mark to its second (bitmap) or its re-push (ring), and either may be owed for a page this
/// re-arm found still read-only, so waiting it out lands that mark before we return (the
/// fast path's is waited out by the flush). Then the flush, unless a test injected its
/// omission.
fn complete_harvest<F: PteFormat>(mmu: &Mmu<F>, pending: PendingFlush) {
    if mmu.config.wrprot == WrprotVariant::RmapLockless {
        drop(mmu.lock.write::<F::Clock>());
    }
    let skip = mmu
        .hooks
        .active(crate::test_hooks::inject::SKIP_HARVEST_FLUSH);
    if skip && pending.graveyard.is_empty() {
        return;
    }
    mmu.complete_flush(pending);
}

fn logged_slot(slots: &Memslots, id: SlotId) -> Result<Arc<Memslot>, DirtyLogError> {
    let set = slots.load();
    let slot = set.by_id(id).ok_or(DirtyLogError::UnknownSlot { id })?;
    if !slot.is_logging() {
        return Err(DirtyLogError::NotLogging { id });
    }
    if slot.dirty.is_none() {
        return Err(DirtyLogError::NoBitmap { id });
    }
    Ok(slot.clone())
}
