//! Dirty logging: which guest pages were written since the last harvest.
//!
//! Enabling logging on a memslot splits its huge leaves (eagerly, by default) and
//! write-protects every leaf while keeping MMU-writable, so the first write to each page takes
//! a fault that the lock-free fast path fixes and logs. Marks go to the slot's bitmap
//! ([`SlotBitmap`]) or, with the dirty ring, to the faulting vCPU's ring ([`DirtyRing`]).
//!
//! A harvest follows invariant 4: snapshot-and-clear → write-protect exactly the pages it
//! returned → complete a remote flush → return. Its three forms, as in KVM:
//! - [`Vm::get_dirty_log`] without manual protection: per-word exchange, or the two-bitmap
//!   switch of seed `004` ([`GetLogVariant`]);
//! - with manual protection (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`), `get_dirty_log` only copies
//!   and [`Vm::clear_dirty_log`] clears and re-protects what the VMM has dealt with;
//! - the dirty ring: [`DirtyRing::harvest`], then [`Vm::reset_dirty_rings`].
//!
//! Each costs in proportion to the dirty pages: zero words cost one load, and re-protection
//! walks only the leaf tables that hold set bits.

mod bitmap;
mod ring;

pub use bitmap::{DirtyBitmap, SlotBitmap};
pub use ring::{
    DirtyGfn, DirtyRing, DIRTY_GFN_DIRTY, DIRTY_GFN_RESET, RING_MAX_ENTRIES, RING_MIN_ENTRIES,
    RING_RESERVED_ENTRIES,
};

use crate::flush::GuestMode;
use crate::flush::PendingFlush;
use crate::format::{table_index, PteFormat, ENTRIES_PER_TABLE, PAGE_SIZE};
use crate::memslot::{Memslot, SlotId};
use crate::stats::{Sink, Stat};
use crate::sync::{self, pin, Arc, Ordering};
use crate::table::TablePage;
use crate::vm::{UpdateMode, Vcpu, VcpuState, Vm};
use crate::walk::Walk;
use ring::Coalesce;

/// `KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE`: GET only copies; CLEAR re-protects.
pub const MANUAL_PROTECT_ENABLE: u32 = 1 << 0;
/// `KVM_DIRTY_LOG_INITIALLY_SET`: bitmaps start all ones and enabling logging protects
/// nothing; CLEAR protects gradually. Requires [`MANUAL_PROTECT_ENABLE`].
pub const INITIALLY_SET: u32 = 1 << 1;

/// Deliberate protocol bugs for oracle tests (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use crate::test_hooks::inject;

pub use crate::config::{DirtyTrack, GetLogVariant, RecoverVariant};

/// Why a dirty-log request was refused. Nothing changes when an error is returned: no bit is
/// consumed, no page protected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirtyLogError {
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
    /// CLEAR_DIRTY_LOG without manual protection.
    #[error("clearing the dirty log needs manual dirty-log protection (MANUAL_PROTECT_ENABLE)")]
    ManualProtectOff,
    /// CLEAR's first page is not a multiple of 64.
    #[error("memslot {id}: first_page {first_page} is not a multiple of 64")]
    ClearUnaligned {
        /// The slot.
        id: SlotId,
        /// The value given.
        first_page: u64,
    },
    /// CLEAR's range leaves the slot, or its length is not a multiple of 64 and does not end
    /// the slot.
    #[error("memslot {id}: pages [{first_page}, +{num_pages}) are not a valid range of its {npages} pages (inside the slot, length a multiple of 64 unless it ends the slot)")]
    ClearRange {
        /// The slot.
        id: SlotId,
        /// First page.
        first_page: u64,
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

/// A write fix in a logged slot in two steps around the SPTE update that sets W
/// ([`Vm::prepare_mark`], then [`Vm::commit_mark`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mark<'s> {
    /// Set the bitmap bit (done before the update, redone after it).
    Bitmap(&'s Memslot),
    /// Push to the vCPU's ring (after the update).
    Ring(&'s Memslot),
}

impl<F: PteFormat> Vm<F> {
    // -----------------------------------------------------------------------------------------
    // Capabilities.

    /// Sets manual dirty-log protection (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`): `flags` is a
    /// combination of [`MANUAL_PROTECT_ENABLE`] and [`INITIALLY_SET`], or 0 to turn it off.
    /// Refused while a slot logs, because it changes what GET and enabling logging mean.
    pub fn set_manual_dirty_log_protect(&self, flags: u32) -> Result<(), DirtyLogError> {
        let _s = sync::lock(&self.slots_lock);
        let unknown = flags & !(MANUAL_PROTECT_ENABLE | INITIALLY_SET);
        if unknown != 0 {
            return Err(DirtyLogError::UnknownFlags { bits: unknown });
        }
        if flags & INITIALLY_SET != 0 && flags & MANUAL_PROTECT_ENABLE == 0 {
            return Err(DirtyLogError::InitiallySetWithoutManual);
        }
        self.refuse_if_logging()?;
        sync::lock(&self.dirty_mode).manual = flags;
        Ok(())
    }

    /// Enables per-vCPU dirty rings of `entries` entries (`KVM_CAP_DIRTY_LOG_RING`). Must come
    /// before any vCPU exists and while no slot logs. Without `with_bitmap` the slots get no
    /// bitmap and GET/CLEAR are refused; with it (`KVM_CAP_DIRTY_LOG_RING_WITH_BITMAP`) the
    /// bitmap collects marks made without a vCPU ([`Vm::mark_page_dirty`]).
    pub fn enable_dirty_ring(&self, entries: u32, with_bitmap: bool) -> Result<(), DirtyLogError> {
        let _s = sync::lock(&self.slots_lock);
        if !entries.is_power_of_two() || !(RING_MIN_ENTRIES..=RING_MAX_ENTRIES).contains(&entries) {
            return Err(DirtyLogError::RingSize { entries });
        }
        let mut mode = sync::lock(&self.dirty_mode);
        if mode.ring_entries != 0 {
            return Err(DirtyLogError::RingAlreadyEnabled {
                entries: mode.ring_entries,
            });
        }
        let vcpus = sync::read(&self.vcpus).len();
        if vcpus != 0 {
            return Err(DirtyLogError::VcpusExist { vcpus });
        }
        if self.config.dirty_track == DirtyTrack::HardwareDirty {
            return Err(DirtyLogError::RingWithHardwareDirty);
        }
        self.refuse_if_logging()?;
        mode.ring_entries = entries;
        mode.ring_with_bitmap = with_bitmap;
        Ok(())
    }

    fn refuse_if_logging(&self) -> Result<(), DirtyLogError> {
        match self
            .slots
            .load_full()
            .slots()
            .iter()
            .find(|s| s.is_logging())
        {
            Some(s) => Err(DirtyLogError::LoggingActive { id: s.id }),
            None => Ok(()),
        }
    }

    pub(crate) fn dirty_mode(&self) -> DirtyMode {
        *sync::lock(&self.dirty_mode)
    }

    /// Every vCPU's dirty ring, in vCPU creation order (empty without the ring).
    pub fn dirty_rings(&self) -> Vec<Arc<DirtyRing>> {
        sync::lock(&self.rings).clone()
    }

    /// Turns on the bugs in `bits` (see [`inject`]). For oracle tests only.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn inject_bugs(&self, bits: u32) {
        self.hooks.set(bits);
    }

    /// The flush that ends a harvest (invariant 4), unless a test injected its omission.
    fn complete_harvest(&self, pending: PendingFlush) {
        let skip = self
            .hooks
            .active(crate::test_hooks::inject::SKIP_HARVEST_FLUSH);
        if skip && pending.graveyard.is_empty() {
            return;
        }
        self.complete_flush(pending);
    }

    // -----------------------------------------------------------------------------------------
    // Marking.

    /// First half of logging a write fix: called before the update that sets W. With a bitmap
    /// the bit is set now (invariant 3: a write by another vCPU can follow the update at
    /// once). With a ring nothing is pushed yet, but the ring must have room for the push that
    /// follows: `false` means it has none and W must not be set.
    #[inline]
    pub(crate) fn prepare_mark(
        &self,
        mark: Mark<'_>,
        ring: Option<&DirtyRing>,
        gfn: u64,
        sink: Sink<'_>,
    ) -> bool {
        match mark {
            Mark::Bitmap(slot) => {
                if slot.mark_dirty(gfn) {
                    sink.inc(Stat::DirtyMarked);
                }
                true
            }
            Mark::Ring(_) => ring.is_some_and(|r| r.has_room()),
        }
    }

    /// Second half, after the update that set W succeeded. Bitmap: mark again — a harvest may
    /// have consumed the first mark and found nothing to protect before the update; its flush
    /// waits for this vCPU (the fast path runs in guest mode), so the second mark lands
    /// before that harvest returns and the page is in the next one. Ring: push the entry.
    #[inline]
    pub(crate) fn commit_mark(
        &self,
        mark: Mark<'_>,
        ring: Option<&DirtyRing>,
        gfn: u64,
        sink: Sink<'_>,
    ) {
        match mark {
            Mark::Bitmap(slot) => {
                slot.mark_dirty(gfn);
            }
            Mark::Ring(slot) => {
                if let Some(r) = ring {
                    r.push(slot.id, gfn - slot.base_gfn);
                    sink.inc(Stat::DirtyMarked);
                }
            }
        }
    }

    /// How a write fix to `slot` is logged, if it is.
    #[inline]
    pub(crate) fn mark_for<'s>(
        &self,
        slot: &'s Memslot,
        ring: Option<&DirtyRing>,
    ) -> Option<Mark<'s>> {
        if !slot.is_logging() {
            None
        } else if ring.is_some() {
            Some(Mark::Ring(slot))
        } else {
            Some(Mark::Bitmap(slot))
        }
    }

    /// Marks the page at `gpa` dirty from outside any vCPU (a VMM or device write into guest
    /// memory), in the slot's bitmap. Returns whether the slot logs; refused without a bitmap.
    pub fn mark_page_dirty(&self, gpa: u64) -> Result<bool, DirtyLogError> {
        // Shared MMU lock: a bitmap-switch harvest holds it exclusively from the switch to the
        // read of the old bitmap, so this mark lands in a bitmap that harvest, or a later one,
        // reads (vCPU marks are ordered by guest mode instead).
        let _lock = self.mmu_lock.read();
        let set = self.slots.load_full();
        let gfn = gpa >> crate::format::PAGE_SHIFT;
        let Some((_, slot)) = set.find(gfn, 0) else {
            return Ok(false);
        };
        if !slot.is_logging() {
            return Ok(false);
        }
        if !slot.mark_dirty(gfn) {
            return Err(DirtyLogError::NoBitmap { id: slot.id });
        }
        self.counters.add_shared(Stat::DirtyMarked, 1);
        Ok(true)
    }

    /// The hardware walker of `vcpu` set the Dirty bit of the leaf mapping `gfn` (a write
    /// through a writable leaf whose D was clear): with [`DirtyTrack::HardwareDirty`], log the
    /// page, as PML would. Called in guest mode, after the D update and before the write it
    /// allows, so a harvest that missed the mark waits for it in its flush and the page is in
    /// the next harvest; any other mode ignores it.
    #[inline]
    pub(crate) fn log_hardware_dirty(&self, vcpu: &mut VcpuState, gfn: u64) {
        if self.config.dirty_track != DirtyTrack::HardwareDirty {
            return;
        }
        let (set, hint) = crate::fault::refresh_hint(self, &mut vcpu.slot_hint);
        let Some((i, slot)) = set.find(gfn, *hint) else {
            return;
        };
        *hint = i;
        if slot.is_logging() && slot.mark_dirty(gfn) {
            Sink::Owned(&vcpu.counters).inc(Stat::DirtyMarked);
        }
    }

    /// The value that re-arms logging on the 4 KiB leaf `old` (so its next write is seen), or
    /// `None` if it is armed already: W cleared, or with hardware-dirty tracking D cleared.
    #[inline]
    fn rearmed(&self, old: u64) -> Option<u64> {
        if !F::is_writable(old) {
            return None;
        }
        if self.config.dirty_track == DirtyTrack::HardwareDirty
            && F::HARDWARE_DIRTY
            && F::ad_enabled(old)
        {
            return F::is_dirty(old).then(|| F::clear_dirty(old));
        }
        Some(F::write_protect(old))
    }

    // -----------------------------------------------------------------------------------------
    // Enable and disable.

    /// Called with the slots lock held after a slot with logging on was published.
    pub(crate) fn enable_dirty_logging(&self, slot: &Memslot) {
        let mode = self.dirty_mode();
        if mode.manual() && mode.initially_set() && mode.uses_bitmap() {
            // Every bit starts set: the VMM will send everything anyway, and CLEAR protects
            // the pages it has sent, gradually.
            return;
        }
        let (start, end) = (slot.base_gfn, slot.end_gfn());
        // Drain fast-path fixes that read the memslots before this slot logged: they would not
        // mark, and their W 0→1 could land after the write-protect walk below found the leaf
        // already protected (left so by an earlier logging round). They run in guest mode, so a
        // completed flush means they are done; later ones see the logging slot.
        self.flush_remote_tlbs();
        let mut pending = PendingFlush::none();
        {
            let _lock = self.mmu_lock.read();
            if self.config.eager_split {
                self.split_huge_pages(start, end, &mut pending);
            }
            self.rearm_range(start, end, &mut pending);
        }
        // One flush, outside the MMU lock: the VMM cannot read the log before we return.
        pending.require();
        self.complete_flush(pending);
    }

    /// Called with the slots lock held after a slot with logging off was published: the 4 KiB
    /// mappings logging forced become huge again where the backing allows.
    pub(crate) fn disable_dirty_logging(&self, slot: &Memslot) {
        if slot.host_page_size <= PAGE_SIZE {
            return; // nothing bigger than 4 KiB can map it
        }
        match self.config.recover {
            // Faults in the range rebuild huge leaves as they come.
            crate::dirty::RecoverVariant::OnFault => {}
            crate::dirty::RecoverVariant::Zap => self.zap_gfn_range(slot.base_gfn, slot.end_gfn()),
            crate::dirty::RecoverVariant::InPlace => {
                let mut pending = PendingFlush::none();
                {
                    let _lock = self.mmu_lock.read();
                    self.recover_huge_pages(slot, &mut pending);
                }
                self.complete_flush(pending);
            }
        }
    }

    /// Arms logging on every leaf in `[start, end)`: 4 KiB leaves as [`Self::rearmed`] says;
    /// huge leaves (left when eager splitting is off) are write-protected whole, so their first
    /// write faults and the slow path maps 4 KiB inside them.
    fn rearm_range(&self, start: u64, end: u64, pending: &mut PendingFlush) {
        let guard = pin();
        let sink = self.sink();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, start, end);
        while it.valid() {
            let old = it.old;
            let new = if !F::is_present(old) || !F::is_leaf(old, it.level) {
                None
            } else if it.level == 1 {
                self.rearmed(old)
            } else {
                F::is_writable(old).then(|| F::write_protect(old))
            };
            if let Some(new) = new {
                if self
                    .set_spte(&mut it, new, UpdateMode::Shared, sink, pending)
                    .is_err()
                {
                    continue; // lost a race: re-examine the entry that won
                }
            }
            it.next();
        }
    }

    /// Re-arms logging ([`Self::rearmed`]) on the 4 KiB pages `base_gfn + i` for each set bit
    /// `i` of `mask`, under the exclusive MMU lock. The leaf table holding them is found once
    /// and remembered in `cursor` across calls, so a harvest descends once per leaf table that
    /// holds dirty pages, and touches only the set bits' entries: the cost follows the dirty
    /// pages. A huge leaf over the window (manual protect with INITIALLY_SET keeps huge leaves
    /// until CLEAR) takes the general walk.
    fn rearm_masked(
        &self,
        cursor: &mut LeafCursor,
        base_gfn: u64,
        mask: u64,
        pending: &mut PendingFlush,
    ) {
        // The exclusive lock already keeps every table alive; the guard is what `Walk` asks for.
        let guard = pin();
        let sink = self.sink();
        let mut m = mask;
        while m != 0 {
            let gfn = base_gfn + m.trailing_zeros() as u64;
            m &= m - 1;
            let t = match cursor.0 {
                Some((first, t)) if gfn.wrapping_sub(first) < ENTRIES_PER_TABLE as u64 => t,
                _ => {
                    let it = Walk::<F>::to_leaf(&guard, self.root(), gfn);
                    if !it.valid() || it.level != 1 {
                        if it.valid() && F::is_present(it.old) {
                            self.rearm_huge(gfn, pending);
                        }
                        cursor.0 = None;
                        continue;
                    }
                    cursor.0 = Some((gfn & !(ENTRIES_PER_TABLE as u64 - 1), it.table()));
                    it.table()
                }
            };
            // SAFETY: `t` is a leaf table reached from the root under the exclusive MMU lock,
            // which this harvest holds throughout: nothing can unlink, let alone free, it.
            let sptep = &unsafe { TablePage::at(t) }.entries[table_index(gfn, 1)];
            let mut old = sptep.load(Ordering::Acquire);
            while F::is_present(old) {
                let Some(new) = self.rearmed(old) else {
                    break;
                };
                if self
                    .update_spte(
                        sptep,
                        1,
                        &mut old,
                        new,
                        UpdateMode::Exclusive,
                        sink,
                        pending,
                    )
                    .is_ok()
                {
                    break;
                }
            }
        }
    }

    /// A huge leaf covers `gfn` in a window being re-armed: split it (eager splitting) and
    /// re-arm the page, or write-protect the huge leaf whole.
    #[cold]
    fn rearm_huge(&self, gfn: u64, pending: &mut PendingFlush) {
        let guard = pin();
        let sink = self.sink();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, gfn, gfn + 1);
        while it.valid() {
            let old = it.old;
            if !F::is_present(old) || !F::is_leaf(old, it.level) {
                it.next();
                continue;
            }
            if it.level > 1 && self.config.eager_split {
                self.split_huge_pages(it.gfn, it.entry_end(), pending);
                it.refresh();
                continue; // now a table: walk into it
            }
            let new = if it.level == 1 {
                self.rearmed(old)
            } else {
                F::is_writable(old).then(|| F::write_protect(old))
            };
            if let Some(new) = new {
                if self
                    .set_spte(&mut it, new, UpdateMode::Exclusive, sink, pending)
                    .is_err()
                {
                    continue;
                }
            }
            it.next();
        }
    }

    fn logged_slot(&self, id: SlotId) -> Result<Arc<Memslot>, DirtyLogError> {
        let set = self.slots.load_full();
        let slot = set.by_id(id).ok_or(DirtyLogError::UnknownSlot { id })?;
        if !slot.is_logging() {
            return Err(DirtyLogError::NotLogging { id });
        }
        if slot.dirty.is_none() {
            return Err(DirtyLogError::NoBitmap { id });
        }
        Ok(slot.clone())
    }

    // -----------------------------------------------------------------------------------------
    // Harvests.

    /// KVM_GET_DIRTY_LOG: fills `out` with the slot's dirty bitmap (one bit per page,
    /// `ceil(npages / 64)` words) and returns the number of dirty pages.
    ///
    /// Without manual protection the bits are cleared, the pages they name write-protected and
    /// a remote flush completed before this returns (invariant 4), by per-word exchange or by
    /// the bitmap switch ([`GetLogVariant`]). With manual protection the bitmap is only copied;
    /// [`Self::clear_dirty_log`] does the rest.
    pub fn get_dirty_log(&self, id: SlotId, out: &mut [u64]) -> Result<u64, DirtyLogError> {
        let _s = sync::lock(&self.slots_lock);
        let slot = self.logged_slot(id)?;
        let Some(bitmap) = slot.dirty.as_deref() else {
            return Err(DirtyLogError::NoBitmap { id });
        };
        let need = bitmap.nwords();
        if out.len() < need {
            return Err(DirtyLogError::BitmapTooSmall {
                id,
                need,
                have: out.len(),
            });
        }
        let mut dirty = 0u64;
        if self.dirty_mode().manual() {
            let active = bitmap.active();
            for (i, o) in out.iter_mut().enumerate().take(need) {
                *o = active.word(i);
                dirty += o.count_ones() as u64;
            }
            return Ok(dirty);
        }
        let mut pending = PendingFlush::none();
        {
            let _lock = self.mmu_lock.write();
            let old = if self.config.get_log == GetLogVariant::Switch && bitmap.can_switch() {
                let old = bitmap.switch();
                // Markers that loaded the old side are either slow-path faults, which hold the
                // MMU lock we own exclusively, or fast-path fixes, which run in guest mode: a
                // completed flush waits them out, and afterwards nobody writes the old side.
                self.flush_remote_tlbs();
                Some(old)
            } else {
                None
            };
            let mut cursor = LeafCursor::default();
            for (i, o) in out.iter_mut().enumerate().take(need) {
                let mask = match old {
                    Some(b) => b.take_word_unshared(i),
                    None => bitmap.active().take_word(i),
                };
                *o = mask;
                if mask != 0 {
                    dirty += mask.count_ones() as u64;
                    let base = slot.base_gfn + 64 * i as u64;
                    self.rearm_masked(&mut cursor, base, mask, &mut pending);
                }
            }
        }
        if dirty > 0 {
            pending.require();
        }
        self.complete_harvest(pending);
        Ok(dirty)
    }

    /// KVM_CLEAR_DIRTY_LOG: for pages `first_page + i` with bit `i` of `bitmap` set, clears
    /// their dirty bits and write-protects those whose bit was actually set, then completes a
    /// remote flush. `first_page` must be a multiple of 64 and `num_pages` too unless the range
    /// ends the slot; bits beyond `num_pages` are ignored. Needs manual protection. Returns the
    /// number of bits cleared.
    pub fn clear_dirty_log(
        &self,
        id: SlotId,
        first_page: u64,
        num_pages: u64,
        bitmap: &[u64],
    ) -> Result<u64, DirtyLogError> {
        let _s = sync::lock(&self.slots_lock);
        if !self.dirty_mode().manual() {
            return Err(DirtyLogError::ManualProtectOff);
        }
        let slot = self.logged_slot(id)?;
        let Some(log) = slot.dirty.as_deref() else {
            return Err(DirtyLogError::NoBitmap { id });
        };
        if first_page % 64 != 0 {
            return Err(DirtyLogError::ClearUnaligned { id, first_page });
        }
        let npages = slot.npages;
        if first_page > npages
            || num_pages > npages - first_page
            || (num_pages < npages - first_page && num_pages % 64 != 0)
        {
            return Err(DirtyLogError::ClearRange {
                id,
                first_page,
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
        let active = log.active();
        let first_word = (first_page / 64) as usize;
        let mut cleared = 0;
        let mut pending = PendingFlush::none();
        let mut cursor = LeafCursor::default();
        {
            let _lock = self.mmu_lock.write();
            for (k, &want) in bitmap.iter().enumerate().take(words) {
                let left = num_pages - 64 * k as u64;
                let want = if left < 64 {
                    want & ((1u64 << left) - 1)
                } else {
                    want
                };
                if want == 0 {
                    continue;
                }
                let mask = active.clear_bits(first_word + k, want);
                if mask != 0 {
                    cleared += mask.count_ones() as u64;
                    let base = slot.base_gfn + first_page + 64 * k as u64;
                    self.rearm_masked(&mut cursor, base, mask, &mut pending);
                }
            }
        }
        if cleared > 0 {
            pending.require();
        }
        self.complete_harvest(pending);
        Ok(cleared)
    }

    /// KVM_RESET_DIRTY_RINGS: frees every harvested ring entry and write-protects its page
    /// (runs of entries in one 64-page window share one walk), then completes a remote flush.
    /// Entries of slots deleted or no longer logging since they were pushed are dropped.
    /// Returns the number of entries reset.
    pub fn reset_dirty_rings(&self) -> Result<u64, DirtyLogError> {
        let _s = sync::lock(&self.slots_lock);
        if self.dirty_mode().ring_entries == 0 {
            return Err(DirtyLogError::RingOff);
        }
        let rings = self.dirty_rings();
        let set = self.slots.load_full();
        let mut total = 0u64;
        let mut pending = PendingFlush::none();
        let mut cursor = LeafCursor::default();
        {
            let _lock = self.mmu_lock.write();
            let mut protect = |run: Option<(SlotId, u64, u64)>, pending: &mut PendingFlush| {
                let Some((id, offset, mask)) = run else {
                    return;
                };
                let Some(slot) = set.by_id(id) else { return };
                let last = offset + 63 - mask.leading_zeros() as u64;
                if !slot.is_logging() || last >= slot.npages {
                    return;
                }
                self.rearm_masked(&mut cursor, slot.base_gfn + offset, mask, pending);
            };
            for ring in &rings {
                let mut runs = Coalesce::default();
                total +=
                    ring.reset(|slot, offset| protect(runs.add(slot, offset), &mut pending)) as u64;
                protect(runs.finish(), &mut pending);
            }
        }
        if total > 0 {
            pending.require();
        }
        self.complete_harvest(pending);
        Ok(total)
    }

    /// Creates the ring of a new vCPU (called by `create_vcpu`).
    pub(crate) fn new_vcpu_ring(&self) -> Option<Arc<DirtyRing>> {
        let entries = self.dirty_mode().ring_entries;
        (entries != 0).then(|| {
            let r = Arc::new(DirtyRing::new(entries));
            sync::lock(&self.rings).push(r.clone());
            r
        })
    }
}

/// The leaf table a harvest last descended to: (first GFN it maps, table address). Valid only
/// under the exclusive MMU lock that the harvest holds throughout (no table can be unlinked).
#[derive(Default)]
struct LeafCursor(Option<(u64, u64)>);

impl<F: PteFormat> Vcpu<F> {
    /// This vCPU's dirty ring is past its soft limit: it must exit to the VMM, which harvests
    /// and resets, before running guest code again (KVM_EXIT_DIRTY_RING_FULL).
    #[inline]
    pub fn dirty_ring_full(&self) -> bool {
        self.state.ring.as_ref().is_some_and(|r| r.soft_full())
    }

    /// This vCPU's dirty ring, if the VM uses rings.
    pub fn dirty_ring(&self) -> Option<&Arc<DirtyRing>> {
        self.state.ring.as_ref()
    }

    /// This vCPU's hardware walker set the Dirty bit of the leaf mapping `gfn` (a write
    /// through a leaf with D clear): with hardware-dirty tracking, log the page — what PML
    /// does, done at once (see `ARCHITECTURE.md`). Call it in guest mode (`guest`), before the
    /// write the walk allows: a harvest's flush then waits for the mark.
    #[inline]
    pub fn log_hardware_dirty(&mut self, guest: &GuestMode, gfn: u64) {
        // A token of another vCPU proves nothing about this one's mode; marking is still
        // harmless (a spurious dirty page), so mark either way.
        let _ = guest;
        self.vm.log_hardware_dirty(&mut self.state, gfn);
    }
}
