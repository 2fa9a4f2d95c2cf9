//! The dirty-log capabilities (KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_CAP_DIRTY_LOG_RING):
//! how the VM logs, fixed while no slot logs.

use super::ring::{RING_MAX_ENTRIES, RING_MIN_ENTRIES};
use super::{DirtyLog, DirtyLogError, DirtyTrack, INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use crate::format::PteFormat;
use crate::memslot::Memslots;
use crate::mmu::Mmu;
use crate::sync;

impl DirtyLog {
    /// Sets manual dirty-log protection (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`): `flags` is a
    /// combination of [`MANUAL_PROTECT_ENABLE`] and [`INITIALLY_SET`], or 0 to turn it off.
    /// Refused while a slot logs, because it changes what GET and enabling logging mean.
    pub(crate) fn set_manual_protect<C: crate::clock::Clock>(
        &self,
        slots: &Memslots,
        flags: u32,
    ) -> Result<(), DirtyLogError> {
        let _s = slots.lock::<C>();
        let unknown = flags & !(MANUAL_PROTECT_ENABLE | INITIALLY_SET);
        if unknown != 0 {
            return Err(DirtyLogError::UnknownFlags { bits: unknown });
        }
        if flags & INITIALLY_SET != 0 && flags & MANUAL_PROTECT_ENABLE == 0 {
            return Err(DirtyLogError::InitiallySetWithoutManual);
        }
        refuse_if_logging(slots)?;
        sync::lock(&self.mode).manual = flags;
        Ok(())
    }

    /// Enables per-vCPU dirty rings of `entries` entries (`KVM_CAP_DIRTY_LOG_RING`). Must come
    /// before any vCPU exists and while no slot logs. Without `with_bitmap` the slots get no
    /// bitmap and GET/CLEAR are refused; with it (`KVM_CAP_DIRTY_LOG_RING_WITH_BITMAP`) the
    /// bitmap collects marks made without a vCPU ([`crate::Vm::mark_page_dirty`]).
    pub(crate) fn enable_ring<F: PteFormat>(
        &self,
        mmu: &Mmu<F>,
        slots: &Memslots,
        entries: u32,
        with_bitmap: bool,
    ) -> Result<(), DirtyLogError> {
        let _s = slots.lock::<F::Clock>();
        if !entries.is_power_of_two() || !(RING_MIN_ENTRIES..=RING_MAX_ENTRIES).contains(&entries) {
            return Err(DirtyLogError::RingSize { entries });
        }
        let mut mode = sync::lock(&self.mode);
        if mode.ring_entries != 0 {
            return Err(DirtyLogError::RingAlreadyEnabled {
                entries: mode.ring_entries,
            });
        }
        let vcpus = mmu.flush.len();
        if vcpus != 0 {
            return Err(DirtyLogError::VcpusExist { vcpus });
        }
        if mmu.config.dirty_track == DirtyTrack::HardwareDirty {
            return Err(DirtyLogError::RingWithHardwareDirty);
        }
        refuse_if_logging(slots)?;
        mode.ring_entries = entries;
        mode.ring_with_bitmap = with_bitmap;
        Ok(())
    }
}

/// Capabilities change what a log means: refused while any slot logs.
fn refuse_if_logging(slots: &Memslots) -> Result<(), DirtyLogError> {
    match slots.load().slots().iter().find(|s| s.is_logging()) {
        Some(s) => Err(DirtyLogError::LoggingActive { id: s.id }),
        None => Ok(()),
    }
}
