//! The KVM guest's dirty log as `slat_dirty`'s [`DirtyLogSource`]: the test memslots' GET and
//! CLEAR (sized from the slot handles) and the vCPUs' rings, with the misuse KVM would refuse
//! or mis-handle (logging off, CLEAR without manual protect, rings on a VM without them)
//! refused first.

use super::{lock, KvmMachine};
use crate::error::KvmError;
use slat_addr::PageIndex;
use slat_dirty::log as dirty;
use slat_dirty::{DirtyLogSource, LogMode, SlotInfo};
use slat_workload::{TestMachine, MANUAL_PROTECT_ENABLE};

/// The KVM guest's dirty log ([`TestMachine::dirty_log`]): tracked slot `i` is test memslot
/// `FIRST_SLOT + i`.
pub struct KvmMachineLog<'a> {
    pub(super) m: &'a KvmMachine,
}

impl KvmMachineLog<'_> {
    fn id(&self, slot: usize) -> Result<u32, KvmError> {
        Ok(slat_workload::log_slot_id(slot, self.m.slot_count())?)
    }
}

impl DirtyLogSource for KvmMachineLog<'_> {
    type Error = KvmError;

    fn slots(&self) -> Vec<SlotInfo> {
        slat_workload::log_slots(self.m.slot_count(), self.m.pages_per_slot())
    }
    fn mode(&self) -> LogMode {
        slat_workload::log_mode(self.m.dirty_config(), self.m.pages_per_slot())
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), KvmError> {
        self.m.get_dirty_log(self.id(slot)?, bitmap)
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), KvmError> {
        self.m.clear_dirty_log(self.id(slot)?, first, pages, bitmap)
    }
    /// One CLEAR per run of the harvested chunks ([`slat_dirty::clear_harvested_chunks`]),
    /// not one over the whole slot: the kernel walks only what it is given.
    fn clear_log_words(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        scratch: &mut [u64],
    ) -> Result<(), KvmError> {
        let id = self.id(slot)?;
        slat_dirty::clear_harvested_chunks(first, pages, words, scratch, |f, n, b| {
            self.m.clear_dirty_log(id, f, n, b)
        })
        .map(drop)
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, KvmError> {
        Ok(self.m.collect_dirty_rings(f))
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, KvmError> {
        Ok(self.m.collect_dirty_rings_by_vcpu(f))
    }
    fn reset_rings(&mut self) -> Result<u64, KvmError> {
        self.m.reset_dirty_rings()
    }
}

impl KvmMachine {
    /// `KVM_GET_DIRTY_LOG` of `slot` into `bitmap` (bit `p` = page `p` of the slot). Without
    /// manual protect this also clears the log and write-protects the pages; with it, it
    /// copies.
    ///
    /// `bitmap` must be exactly `pages_per_slot().div_ceil(64)` words, the words KVM writes
    /// ([`KvmError::Dirty`] otherwise).
    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), KvmError> {
        let s = self.bitmap_slot(slot, "KVM_GET_DIRTY_LOG")?;
        if !self.dirty_logging() {
            return Err(KvmError::DirtyLog(
                "KVM_GET_DIRTY_LOG: dirty logging is off".into(),
            ));
        }
        dirty::get_dirty_log(s, bitmap).map_err(KvmError::from)
    }

    /// `KVM_CLEAR_DIRTY_LOG` (manual protect): clears and re-protects the pages of
    /// `[first_page, first_page + num_pages)` of `slot` whose bits are set in `bitmap` (bit 0
    /// = `first_page`). `first_page` must be a multiple of 64, and so must `num_pages` unless
    /// the range reaches the end of the slot ([`KvmError::Dirty`]); `bitmap` must be
    /// exactly `num_pages.div_ceil(64)` words, the words KVM reads
    /// ([`KvmError::Dirty`]).
    fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: PageIndex,
        num_pages: u64,
        bitmap: &[u64],
    ) -> Result<(), KvmError> {
        let s = self.bitmap_slot(slot, "KVM_CLEAR_DIRTY_LOG")?;
        if self.config.region.dirty.manual_protect & MANUAL_PROTECT_ENABLE == 0 {
            return Err(KvmError::DirtyLog(
                "KVM_CLEAR_DIRTY_LOG needs manual protect (KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)"
                    .into(),
            ));
        }
        if !self.dirty_logging() {
            return Err(KvmError::DirtyLog(
                "KVM_CLEAR_DIRTY_LOG: dirty logging is off".into(),
            ));
        }
        dirty::clear_dirty_log(s, first_page, num_pages, bitmap).map_err(KvmError::from)
    }

    /// Takes every dirty-ring entry not yet collected: first those the vCPUs reaped on
    /// ring-full exits, then each ring's (acquire of DIRTY, release of RESET). Calls
    /// `f(slot, offset)` per entry (slot is `as_id << 16 | id`; address space 0 here); returns
    /// how many. Follow with [`Self::reset_dirty_rings`] before reading the pages.
    fn collect_dirty_rings(&self, f: &mut dyn FnMut(u32, PageIndex)) -> u64 {
        let mut r = lock(&self.rings);
        let reaped = std::mem::take(&mut r.reaped);
        let mut n = reaped.len() as u64;
        for (_, s, o) in reaped {
            f(s, o);
        }
        for ring in r.rings.iter_mut() {
            n += ring.harvest(&mut *f) as u64;
        }
        n
    }

    /// [`Self::collect_dirty_rings`] naming each entry's vCPU, also of those reaped on
    /// ring-full exits (the reaper records whose ring each came from).
    fn collect_dirty_rings_by_vcpu(&self, f: &mut dyn FnMut(Option<usize>, u32, PageIndex)) -> u64 {
        let mut r = lock(&self.rings);
        let reaped = std::mem::take(&mut r.reaped);
        let mut n = reaped.len() as u64;
        for (i, s, o) in reaped {
            f(Some(i), s, o);
        }
        // One ring per vCPU, created in vCPU order (`create_vcpus`): ring i is vCPU i's.
        for (i, ring) in r.rings.iter_mut().enumerate() {
            n += ring.harvest(|s, o| f(Some(i), s, o)) as u64;
        }
        n
    }

    /// `KVM_RESET_DIRTY_RINGS`: re-protects the pages of every collected entry; returns how
    /// many entries KVM reset.
    fn reset_dirty_rings(&self) -> Result<u64, KvmError> {
        if self.config.region.dirty.ring_entries == 0 {
            return Err(KvmError::DirtyLog(
                "KVM_RESET_DIRTY_RINGS: the VM has no dirty rings".into(),
            ));
        }
        let _r = lock(&self.rings);
        dirty::reset_dirty_rings(&self.vm).map_err(KvmError::from)
    }
}
