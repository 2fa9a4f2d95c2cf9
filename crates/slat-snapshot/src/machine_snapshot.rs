//! [`MachineSnapshot`]: one snapshot-and-reset driver over any [`TestMachine`].

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
    log: Log<'m, M>,
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
        let pps = machine.pages_per_slot();
        let mut log = Log {
            machine,
            dirty: DirtyPages::new(&vec![pps; regions.len()]),
            bitmap: vec![0; pps.div_ceil(64) as usize],
        };
        // Re-arm, then copy (`slat_dirty::snapshot`'s module docs): what the log held is
        // discarded, as guest memory is about to equal the snapshot.
        log.harvest()?;
        log.dirty.clear();
        let snap = Snapshot::take(regions)?;
        Ok(MachineSnapshot { log, snap })
    }

    /// Resets the test region to the snapshot: harvests the dirty log (re-arming it), then
    /// copies back each dirty page once.
    ///
    /// After an error, pages the failed harvest had taken may be in neither the log nor the
    /// snapshot's page set any more: [`Self::reset_all`] restores the region whatever was
    /// lost.
    pub fn reset(&mut self) -> Res<ResetReport, M> {
        let (harvest, rearm) = self.log.harvest()?;
        let t = Instant::now();
        let ResetStats { pages, .. } = self.snap.reset(&mut self.log.dirty)?;
        Ok(ResetReport {
            pages,
            harvest,
            rearm,
            copy: t.elapsed(),
        })
    }

    /// Resets by copying the whole test region back (what a reset costs without dirty
    /// tracking); the log is harvested and re-armed first, untimed, so the next
    /// [`Self::reset`] starts from a clean log.
    pub fn reset_all(&mut self) -> Res<ResetReport, M> {
        self.log.harvest()?;
        self.log.dirty.clear();
        let t = Instant::now();
        let ResetStats { pages, .. } = self.snap.reset_all();
        Ok(ResetReport {
            pages,
            copy: t.elapsed(),
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
        self.log.machine
    }
}

/// The machine's dirty log, harvested into a page set per memslot.
struct Log<'m, M: TestMachine + ?Sized> {
    machine: &'m M,
    dirty: DirtyPages,
    /// One slot's GET_DIRTY_LOG bitmap.
    bitmap: Vec<u64>,
}

impl<M: TestMachine + ?Sized> Log<'_, M> {
    /// Adds every page the log holds to `dirty` and re-arms the log; returns the time spent
    /// reading and, separately, re-arming.
    fn harvest(&mut self) -> Res<(Duration, Duration), M> {
        let d = self.machine.dirty_config();
        if d.ring_entries != 0 {
            self.harvest_rings()
        } else {
            self.harvest_bitmaps(d.manual_protect != 0)
        }
    }

    /// GET (which re-arms) or, with manual protect, GET then CLEAR of the same bits.
    fn harvest_bitmaps(&mut self, manual: bool) -> Res<(Duration, Duration), M> {
        let m = self.machine;
        let (mut read, mut rearm) = (Duration::ZERO, Duration::ZERO);
        for (i, slot) in m.test_slots().enumerate() {
            let t = Instant::now();
            m.get_dirty_log(slot, &mut self.bitmap)
                .map_err(ResetError::Machine)?;
            self.dirty.add_bitmap(i, 0, &self.bitmap)?;
            read += t.elapsed();
            if manual {
                let t = Instant::now();
                m.clear_dirty_log(slot, 0, m.pages_per_slot(), &self.bitmap)
                    .map_err(ResetError::Machine)?;
                rearm += t.elapsed();
            }
        }
        Ok((read, rearm))
    }

    /// Collects the ring entries of the test slots, then RESET_DIRTY_RINGS. Entries of other
    /// slots (KVM's and the VMM's own) are not the test region's; an offset past a test slot
    /// is refused.
    fn harvest_rings(&mut self) -> Res<(Duration, Duration), M> {
        let m = self.machine;
        let slots = m.test_slots();
        let mut bad = None;
        let t = Instant::now();
        let dirty = &mut self.dirty;
        m.collect_dirty_rings(|slot, offset| {
            if slots.contains(&slot) && bad.is_none() {
                bad = dirty.add_page((slot - slots.start) as usize, offset).err();
            }
        });
        let read = t.elapsed();
        let t = Instant::now();
        m.reset_dirty_rings().map_err(ResetError::Machine)?;
        let rearm = t.elapsed();
        match bad {
            Some(e) => Err(e.into()),
            None => Ok((read, rearm)),
        }
    }
}
