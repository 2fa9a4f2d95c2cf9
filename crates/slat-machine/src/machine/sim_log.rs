//! The simulated machine's dirty log as a `slat_dirty` source.

use super::{Machine, MachineError};
use slat::{PteFormat, SlotId};
use slat_addr::PageIndex;
use slat_dirty::{DirtyLogSource, LogMode, SlotInfo};
use slat_workload::TestMachine;

/// The simulated machine's dirty log, as `slat_dirty`'s [`DirtyLogSource`] over the engine's
/// dirty-log calls ([`slat_workload::TestMachine::dirty_log`]).
pub struct SimLog<'a, F: PteFormat> {
    pub(super) m: &'a Machine<F>,
}

impl<F: PteFormat> SimLog<'_, F> {
    fn id(&self, slot: usize) -> Result<SlotId, MachineError> {
        Ok(slat_workload::log_slot_id(slot, self.m.slot_count())?)
    }
}

impl<F: PteFormat> DirtyLogSource for SimLog<'_, F> {
    type Error = MachineError;

    fn slots(&self) -> Vec<SlotInfo> {
        slat_workload::log_slots(self.m.slot_count(), self.m.pages_per_slot())
    }
    fn mode(&self) -> LogMode {
        slat_workload::log_mode(self.m.dirty_config(), self.m.pages_per_slot())
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), MachineError> {
        self.m.vm.get_dirty_log(self.id(slot)?, bitmap)?;
        Ok(())
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), MachineError> {
        let id = self.id(slot)?;
        self.m.vm.clear_dirty_log(id, first, pages, bitmap)?;
        Ok(())
    }
    fn get_log_words(
        &mut self,
        slot: usize,
        _: &mut [u64],
        words: &mut Vec<(usize, u64)>,
    ) -> Result<(), MachineError> {
        // The engine's sparse GET reads only the words its summary names.
        self.m.vm.get_dirty_log_sparse(self.id(slot)?, words)?;
        Ok(())
    }
    fn clear_log_words(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        _: &mut [u64],
    ) -> Result<(), MachineError> {
        let id = self.id(slot)?;
        let range = first.raw() / 64..first.raw().saturating_add(pages).div_ceil(64);
        let inside = |w: &&(usize, u64)| range.contains(&(w.0 as u64));
        // One engine CLEAR, one flush, for the chunk; words outside it are not this call's
        // (the harvester passes none).
        if words.iter().all(|w| inside(&w)) {
            self.m.vm.clear_dirty_log_sparse(id, words)?;
        } else {
            for &w in words.iter().filter(inside) {
                self.m.vm.clear_dirty_log_sparse(id, &[w])?;
            }
        }
        Ok(())
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, MachineError> {
        Ok(self.m.collect_dirty_rings(|s, o| f(s, PageIndex::new(o))))
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, MachineError> {
        // Entries reaped on ring-full exits carry the index of the ring they came from. The
        // lock is held across the rings' harvests too (see `Machine::collect_dirty_rings`).
        let mut reaped = self.m.reaped.lock();
        let mut n = reaped.len() as u64;
        for (i, s, o) in reaped.drain(..) {
            f(Some(i), s, PageIndex::new(o));
        }
        // `dirty_rings()` is in vCPU creation order: ring i is vCPU i's.
        for (i, r) in self.m.vm.dirty_rings().iter().enumerate() {
            n += r.harvest(|s, o| f(Some(i), s, o)) as u64;
        }
        Ok(n)
    }
    fn reset_rings(&mut self) -> Result<u64, MachineError> {
        Ok(self.m.vm.reset_dirty_rings()?)
    }
}
