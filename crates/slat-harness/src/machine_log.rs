//! [`MachineLog`]: a [`TestMachine`] owned (`Arc<M>`) or borrowed, with its dirty log
//! ([`TestMachine::dirty_log`], a [`DirtyLogSource`]) timed: reports split reading the log
//! from re-arming it. Both benchmark machines are harvested by the same transactional
//! [`Harvester`] a VMM uses on its own VM.

use slat_addr::PageIndex;
use slat_dirty::{DirtyLogSource, Harvester, LogMode, SlotInfo};
use slat_workload::TestMachine;
use std::cell::Cell;
use std::ops::Deref;
use std::time::Duration;

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
    /// 64-page chunks CLEAR was given with a bit set, and ring entries reset, since then.
    rearmed: Cell<u64>,
}

/// Time spent reading the log and, separately, re-arming it (CLEAR or RESET; zero when GET
/// re-armed as it read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogTimes {
    /// GET_DIRTY_LOG, or collecting the ring entries.
    pub read: Duration,
    /// CLEAR_DIRTY_LOG or RESET_DIRTY_RINGS.
    pub rearm: Duration,
    /// What the re-arm covered: 64-page chunks with a bit set given to CLEAR (only the
    /// harvested ones, when the harvest passes exactly those), or ring entries reset.
    pub rearmed: u64,
}

impl<R: Deref> MachineLog<R>
where
    R::Target: TestMachine,
{
    /// The log of `machine`'s test region, in the mode the machine was built with.
    pub fn new(machine: R) -> Self {
        let (slots, mode) = {
            let log = machine.dirty_log();
            (log.slots(), log.mode())
        };
        MachineLog {
            machine,
            slots,
            mode,
            read: Cell::new(Duration::ZERO),
            rearm: Cell::new(Duration::ZERO),
            rearmed: Cell::new(0),
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
            rearmed: self.rearmed.take(),
        }
    }
}

/// Runs `f`, adding its time to `into`, on `machine`'s clock (the host's, or in virtual time
/// the host's simulated CPU's).
fn timed<M: TestMachine + ?Sized, T>(
    machine: &M,
    into: &Cell<Duration>,
    f: impl FnOnce() -> T,
) -> T {
    let t = machine.now_ns();
    let r = f();
    let ns = machine.now_ns().saturating_sub(t);
    into.set(into.get() + Duration::from_nanos(ns));
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
        timed(&*self.machine, &self.read, || {
            self.machine.dirty_log().get_log(slot, bitmap)
        })
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), Self::Error> {
        let chunks = bitmap.iter().filter(|&&w| w != 0).count() as u64;
        self.rearmed.set(self.rearmed.get() + chunks);
        timed(&*self.machine, &self.rearm, || {
            self.machine
                .dirty_log()
                .clear_log(slot, first, pages, bitmap)
        })
    }
    fn get_log_words(
        &mut self,
        slot: usize,
        scratch: &mut [u64],
        words: &mut Vec<(usize, u64)>,
    ) -> Result<(), Self::Error> {
        timed(&*self.machine, &self.read, || {
            self.machine.dirty_log().get_log_words(slot, scratch, words)
        })
    }
    fn clear_log_words(
        &mut self,
        slot: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        scratch: &mut [u64],
    ) -> Result<(), Self::Error> {
        let chunks = words.iter().filter(|&&(_, w)| w != 0).count() as u64;
        self.rearmed.set(self.rearmed.get() + chunks);
        timed(&*self.machine, &self.rearm, || {
            self.machine
                .dirty_log()
                .clear_log_words(slot, first, pages, words, scratch)
        })
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Self::Error> {
        timed(&*self.machine, &self.read, || {
            self.machine.dirty_log().collect_ring(f)
        })
    }
    fn collect_ring_by_vcpu(
        &mut self,
        f: &mut dyn FnMut(Option<usize>, u32, PageIndex),
    ) -> Result<u64, Self::Error> {
        timed(&*self.machine, &self.read, || {
            self.machine.dirty_log().collect_ring_by_vcpu(f)
        })
    }
    fn reset_rings(&mut self) -> Result<u64, Self::Error> {
        let n = timed(&*self.machine, &self.rearm, || {
            self.machine.dirty_log().reset_rings()
        });
        if let Ok(n) = n {
            self.rearmed.set(self.rearmed.get() + n);
        }
        n
    }
}
