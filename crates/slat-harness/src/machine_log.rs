//! [`MachineLog`]: the dirty log of any [`TestMachine`] as a [`DirtyLogSource`], so slat's
//! benchmark machines (simulated and KVM) are harvested by the same transactional
//! [`Harvester`] a VMM uses on its own VM.

use slat_dirty::{DirtyLogSource, Harvester, LogMode, SlotInfo};
use slat_workload::{TestMachine, WorkloadError};
use std::cell::Cell;
use std::ops::Deref;
use std::time::{Duration, Instant};

/// A [`Harvester`] of a machine's test region (`R` holds the machine: `&M`, `Arc<M>`, …).
pub type MachineHarvester<R> = Harvester<MachineLog<R>>;

/// The dirty log of the test region of the machine `R` points to: one tracked slot per test
/// memslot (index `i` = slot `FIRST_SLOT + i`), in the machine's log mode (GET; GET + CLEAR of
/// the whole slot with manual protect; the dirty rings). Ring entries of other slots (the KVM
/// guest's low memory) are not the test region's: the harvester counts them as foreign.
///
/// It also times the calls, for reports that split reading the log from re-arming it.
#[derive(Debug)]
pub struct MachineLog<R> {
    machine: R,
    slots: Vec<SlotInfo>,
    mode: LogMode,
    /// Time in GET and ring collection since the last [`MachineLog::take_times`].
    read: Cell<Duration>,
    /// Time in CLEAR and ring reset since the last [`MachineLog::take_times`].
    rearm: Cell<Duration>,
}

/// Time spent reading the log and, separately, re-arming it (CLEAR or RESET; zero when GET
/// re-armed as it read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogTimes {
    /// GET_DIRTY_LOG, or collecting the ring entries.
    pub read: Duration,
    /// CLEAR_DIRTY_LOG or RESET_DIRTY_RINGS.
    pub rearm: Duration,
}

impl<R: Deref> MachineLog<R>
where
    R::Target: TestMachine,
{
    /// The log of `machine`'s test region, in the mode the machine was built with.
    pub fn new(machine: R) -> Self {
        let pages = machine.pages_per_slot();
        let slots = machine
            .test_slots()
            .map(|id| SlotInfo { id, pages })
            .collect();
        let d = machine.dirty_config();
        let mode = if d.ring_entries != 0 {
            LogMode::Ring
        } else if d.manual_protect != 0 {
            // One CLEAR per slot: a chunk of the whole slot (KVM accepts a chunk that ends at
            // the slot's end whatever its length).
            LogMode::ManualProtect {
                chunk_pages: pages.div_ceil(64).max(1) * 64,
            }
        } else {
            LogMode::Get
        };
        MachineLog {
            machine,
            slots,
            mode,
            read: Cell::new(Duration::ZERO),
            rearm: Cell::new(Duration::ZERO),
        }
    }

    /// A harvester of the log (dirty logging is not switched on here).
    pub fn harvester(machine: R) -> Result<MachineHarvester<R>, slat_dirty::Error> {
        Harvester::from_source(Self::new(machine))
    }

    /// The machine.
    pub fn machine(&self) -> &R::Target {
        &self.machine
    }

    /// The time spent since the last call, and restarts the count.
    pub fn take_times(&self) -> LogTimes {
        LogTimes {
            read: self.read.take(),
            rearm: self.rearm.take(),
        }
    }

    /// Memslot id of tracked slot `i`, or a refusal.
    fn id(&self, i: usize) -> Result<u32, <R::Target as TestMachine>::Error> {
        match self.slots.get(i) {
            Some(s) => Ok(s.id),
            None => Err(WorkloadError::Config(format!(
                "slot index {i}: the test region has {} memslots",
                self.slots.len()
            ))
            .into()),
        }
    }
}

/// Runs `f`, adding its time to `into`.
fn timed<T>(into: &Cell<Duration>, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    into.set(into.get() + t.elapsed());
    r
}

impl<R: Deref> DirtyLogSource for MachineLog<R>
where
    R::Target: TestMachine,
{
    type Error = <R::Target as TestMachine>::Error;

    fn slots(&self) -> Vec<SlotInfo> {
        self.slots.clone()
    }
    fn mode(&self) -> LogMode {
        self.mode
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), Self::Error> {
        let id = self.id(slot)?;
        timed(&self.read, || self.machine.get_dirty_log(id, bitmap))
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first_page: u64,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), Self::Error> {
        let id = self.id(slot)?;
        timed(&self.rearm, || {
            self.machine.clear_dirty_log(id, first_page, pages, bitmap)
        })
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, u64)) -> Result<u64, Self::Error> {
        Ok(timed(&self.read, || self.machine.collect_dirty_rings(f)))
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, u64),
    ) -> Result<u64, Self::Error> {
        Ok(timed(&self.read, || {
            self.machine.collect_dirty_rings_by_vcpu(f)
        }))
    }
    fn reset_rings(&mut self) -> Result<u64, Self::Error> {
        timed(&self.rearm, || self.machine.reset_dirty_rings())
    }
}
