//! [`MachineSnapshot`]: one snapshot-and-reset driver over any [`TestMachine`].

use crate::machine_log::{LogTimes, MachineHarvester, MachineLog};
use slat_dirty::snapshot::{DirtyPages, GuestRegion, ResetStats, Snapshot, SnapshotError};
use slat_workload::{GuestRam, TestMachine, PAGE_SIZE};
use std::time::{Duration, Instant};

/// Why a snapshot or a reset of a machine failed.
#[derive(Debug, thiserror::Error)]
pub enum ResetError<E: std::error::Error + 'static> {
    /// The machine refused a dirty-log call.
    #[error(transparent)]
    Machine(E),
    /// The snapshot refused the harvest (a page past its slot) or found a difference.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// No harvester can track the machine's test region (no memslot, say).
    #[error(transparent)]
    Harvest(slat_dirty::Error),
    /// The RAM given is not where the machine's test region is.
    #[error("the test region at {host:#x} ({len} bytes) is not inside the guest RAM given ({ram_addr:#x}, {ram_len} bytes)")]
    NotTheMachinesRam {
        /// Host address of the test region.
        host: u64,
        /// Its bytes.
        len: u64,
        /// Host address of the RAM given.
        ram_addr: u64,
        /// Its bytes.
        ram_len: u64,
    },
}

/// What one reset did, and where its time went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResetReport {
    /// Pages copied back (each dirty page once).
    pub pages: u64,
    /// Reading the log: GET_DIRTY_LOG of every slot (which also re-arms without manual
    /// protect), or collecting the ring entries.
    pub harvest: Duration,
    /// Re-arming the log separately: CLEAR_DIRTY_LOG (manual protect) or RESET_DIRTY_RINGS;
    /// zero when GET re-armed.
    pub rearm: Duration,
    /// Copying the pages back.
    pub copy: Duration,
}

impl ResetReport {
    /// Harvest, re-arm and copy.
    pub fn total(&self) -> Duration {
        self.harvest + self.rearm + self.copy
    }
}

/// A snapshot of a machine's test region, reset from the machine's dirty log.
///
/// Region `i` of the snapshot is memslot `FIRST_SLOT + i`, so a slot's bitmap is its region's
/// page set. Dirty logging stays on while the snapshot is used.
pub struct MachineSnapshot<'m, M: TestMachine + ?Sized> {
    machine: &'m M,
    /// The machine's log, harvested transactionally: a failed copy leaves its pages owed.
    log: MachineHarvester<&'m M>,
    /// The pages of one harvest, per region (= memslot).
    dirty: DirtyPages,
    snap: Snapshot,
}

type Res<T, M> = Result<T, ResetError<<M as TestMachine>::Error>>;

impl<'m, M: TestMachine + ?Sized> MachineSnapshot<'m, M> {
    /// Turns dirty logging on, re-arms it (discarding what it held, INITIALLY_SET's bits
    /// included: the copy that follows is what a reset returns to), then copies the test
    /// region.
    ///
    /// # Safety
    ///
    /// `ram` must be `machine`'s guest RAM (the mapping its test region lives in; checked
    /// only to hold the region's address range). No workload may run on `machine` — no pass,
    /// loop or writer started, nothing else writing the RAM — while this snapshot is taken,
    /// [reset](Self::reset), [reset in full](Self::reset_all) or [verified](Self::verify):
    /// run passes with [`TestMachine::run_pass`] (which returns with the vCPUs stopped), or
    /// [`TestMachine::halt`] a loop first.
    pub unsafe fn take(machine: &'m M, ram: &'m GuestRam) -> Res<Self, M> {
        let layout = machine.layout();
        let len = layout.total_pages() * PAGE_SIZE;
        let inside = layout.host >= ram.addr()
            && layout
                .host
                .checked_add(len)
                .is_some_and(|end| end <= ram.addr() + ram.len());
        if !inside {
            return Err(ResetError::NotTheMachinesRam {
                host: layout.host,
                len,
                ram_addr: ram.addr(),
                ram_len: ram.len(),
            });
        }
        let slot_bytes = machine.pages_per_slot() * PAGE_SIZE;
        let regions = (0..machine.slot_count() as u64)
            .map(|i| {
                let addr = (layout.host + i * slot_bytes) as *mut u8;
                // SAFETY: the slot lies inside `ram` (checked above: slots split the region
                // evenly), which is mapped and writable and outlives `'m`, and so `Self`;
                // nobody writes it during take, reset or verify, by this function's contract.
                unsafe { GuestRegion::new(addr, slot_bytes) }
            })
            .collect::<Result<Vec<_>, _>>()?;
        machine
            .set_dirty_logging(true)
            .map_err(ResetError::Machine)?;
        let mut log = MachineLog::harvester(machine).map_err(ResetError::Harvest)?;
        // Re-arm, then copy (`slat_dirty::snapshot`'s module docs): what the log held is
        // discarded, as guest memory is about to equal the snapshot.
        log.take().map_err(ResetError::Machine)?.commit();
        let snap = Snapshot::take(regions)?;
        Ok(MachineSnapshot {
            machine,
            log,
            dirty: DirtyPages::new(&vec![machine.pages_per_slot(); machine.slot_count()]),
            snap,
        })
    }

    /// Resets the test region to the snapshot: takes the dirty set (the take re-arms the
    /// log), copies back each of its pages once, and commits the set.
    ///
    /// If the copy fails the set is aborted: its pages are owed again, so the next reset
    /// copies them with whatever was dirtied since. A failed take leaves what it had collected
    /// owed in the same way: no error loses a page.
    pub fn reset(&mut self) -> Res<ResetReport, M> {
        // Whatever an earlier failed take spent is not this reset's.
        self.log.source().take_times();
        let set = self.log.take().map_err(ResetError::Machine)?;
        self.dirty.clear();
        // On `?` the set drops uncommitted: aborted.
        self.dirty.add_dirty_set(&set)?;
        let t = Instant::now();
        let ResetStats { pages, .. } = self.snap.reset(&mut self.dirty)?;
        let copy = t.elapsed();
        set.commit();
        let LogTimes { read, rearm } = self.log.source().take_times();
        Ok(ResetReport {
            pages,
            harvest: read,
            rearm,
            copy,
        })
    }

    /// Resets by copying the whole test region back (what a reset costs without dirty
    /// tracking); the log is harvested and re-armed first, untimed, so the next
    /// [`Self::reset`] starts from a clean log.
    pub fn reset_all(&mut self) -> Res<ResetReport, M> {
        let set = self.log.take().map_err(ResetError::Machine)?;
        let t = Instant::now();
        let ResetStats { pages, .. } = self.snap.reset_all();
        let copy = t.elapsed();
        // Every page, the set's included, is the snapshot's again.
        set.commit();
        Ok(ResetReport {
            pages,
            copy,
            ..ResetReport::default()
        })
    }

    /// Compares the test region with the snapshot byte for byte.
    pub fn verify(&self) -> Result<(), SnapshotError> {
        self.snap.verify()
    }

    /// The snapshot.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snap
    }

    /// The machine.
    pub fn machine(&self) -> &'m M {
        self.machine
    }
}
