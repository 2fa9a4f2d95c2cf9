//! [`MachineSnapshot`]: one snapshot-and-reset driver over any [`TestMachine`].

use crate::machine_log::{LogTimes, MachineHarvester, MachineLog};
use slat_addr::PAGE_SIZE;
use slat_dirty::{ChildSnapshot, DirtyPages, GuestRegion, ResetStats, Snapshot, SnapshotError};
use slat_workload::{GuestRam, TestMachine};
use std::time::Duration;

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
    /// The RAM given is phantom memory (`Backing::Phantom*`): it keeps no data to copy.
    #[error("the guest RAM is phantom memory, which keeps no data to snapshot")]
    Phantom,
}

/// What one reset did, and where its time went, on the machine's clock
/// ([`TestMachine::now_ns`]: the host's, or in virtual time the host's simulated CPU's, which
/// the reset's page copies and zeroings are charged to through
/// [`TestMachine::charge_host_pages`]).
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
    /// Of `pages`, those written back by zeroing (all zero in the snapshot).
    pub zeroed: u64,
    /// Whether the reset copied the whole snapshot back: the dirty pages were at least the
    /// snapshot's crossover ([`Snapshot::crossover_pages`]), or [`MachineSnapshot::reset_all`].
    pub full: bool,
    /// 64-page chunks the log re-armed (CLEAR) or ring entries it reset; 0 when GET re-armed.
    pub rearmed: u64,
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
    /// Pages where guest memory differs from the snapshot that the log does not list: a
    /// child's own pages while memory last equalled that child ([`MachineChild`]). Every
    /// reset to the base copies them back too, then empties the set.
    owed: DirtyPages,
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
        if ram.is_phantom() {
            return Err(ResetError::Phantom);
        }
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
        // Re-arm, then copy (`slat-dirty`'s `snapshot.rs` module docs): what the log held is
        // discarded, as guest memory is about to equal the snapshot.
        log.take().map_err(ResetError::Machine)?.commit();
        let snap = Snapshot::take(regions)?;
        Ok(MachineSnapshot {
            machine,
            log,
            dirty: snap.dirty_pages(),
            owed: snap.dirty_pages(),
            snap,
        })
    }

    /// Resets the test region to the snapshot: takes the dirty set (the take re-arms the
    /// log), copies back each of its pages once — with the own pages of a dropped
    /// [`MachineChild`] if memory last equalled that child — and commits the set.
    ///
    /// If the copy fails the set is aborted: its pages are owed again, so the next reset
    /// copies them with whatever was dirtied since. A failed take leaves what it had collected
    /// owed in the same way: no error loses a page.
    pub fn reset(&mut self) -> Res<ResetReport, M> {
        let (machine, regions, total) =
            (self.machine, self.machine.slot_count(), self.snap.pages());
        let MachineSnapshot {
            log,
            dirty,
            owed,
            snap,
            ..
        } = self;
        let (report, _) = reset_with(machine, log, dirty, total, |dirty| {
            add_all(dirty, owed, regions)?;
            let stats = snap.reset(dirty)?;
            owed.clear();
            Ok(stats)
        })?;
        Ok(report)
    }

    /// Resets by copying the whole test region back (what a reset costs without dirty
    /// tracking); the log is harvested and re-armed first, untimed, so the next
    /// [`Self::reset`] starts from a clean log.
    pub fn reset_all(&mut self) -> Res<ResetReport, M> {
        let set = self.log.take().map_err(ResetError::Machine)?;
        let t = self.machine.now_ns();
        let ResetStats {
            pages,
            zeroed,
            full,
            ..
        } = self.snap.reset_all();
        charge_written(self.machine, self.snap.pages(), pages, zeroed, full);
        let copy = since(self.machine, t);
        // Every page, the set's and the owed ones included, is the snapshot's again.
        self.owed.clear();
        set.commit();
        Ok(ResetReport {
            pages,
            copy,
            zeroed,
            full,
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

    /// The snapshot, to set its crossover ([`Snapshot::set_crossover_pages`]).
    pub fn snapshot_mut(&mut self) -> &mut Snapshot {
        &mut self.snap
    }

    /// The machine.
    pub fn machine(&self) -> &'m M {
        self.machine
    }

    /// Takes an incremental snapshot of the test region as it is now, over this one (as Nyx
    /// does, and Hyperlight's proposal): takes the dirty set (re-arming the log), copies only
    /// the pages written since memory last equalled this snapshot, and commits the set. The
    /// child holds `self` mutably: reset to it with [`MachineChild::reset`], back to this
    /// snapshot with [`MachineChild::reset_to_base`]; once it is dropped, [`Self::reset`]
    /// returns to this snapshot from whichever of the two memory last equalled.
    ///
    /// The contract of [`Self::take`] covers the child: no workload runs while it is taken,
    /// reset or verified.
    pub fn take_child(&mut self) -> Res<MachineChild<'_, 'm, M>, M> {
        let MachineSnapshot {
            machine,
            log,
            dirty,
            owed,
            snap,
        } = self;
        let snap: &Snapshot = snap;
        log.source().take_times();
        let set = log.take().map_err(ResetError::Machine)?;
        dirty.clear();
        // On `?` the set drops uncommitted: aborted, its pages owed again.
        dirty.add_dirty_set(&set)?;
        add_all(dirty, owed, machine.slot_count())?;
        let child = snap.child(dirty)?;
        set.commit();
        log.source().take_times();
        // Memory equals the child now: it differs from the base at the child's own pages,
        // which the log no longer lists.
        std::mem::swap(dirty, owed);
        dirty.clear();
        let own = owed.clone();
        Ok(MachineChild {
            machine: *machine,
            own,
            log,
            dirty,
            owed,
            child,
            at_child: true,
        })
    }
}

/// Adds every page of `from` to `to`, both sized for the same `regions` regions.
fn add_all(to: &mut DirtyPages, from: &DirtyPages, regions: usize) -> Result<(), SnapshotError> {
    for region in 0..regions {
        for &p in from.pages(region) {
            to.add_page(region, slat_addr::PageIndex::new(p))?;
        }
    }
    Ok(())
}

/// Charges the machine's clock for the pages a reset wrote (nothing in real time): a full
/// copy writes all `total` pages, one page by page the `pages` listed; `zeroed` of them are
/// zeroed, the rest copied.
fn charge_written<M: TestMachine + ?Sized>(
    machine: &M,
    total: u64,
    pages: u64,
    zeroed: u64,
    full: bool,
) {
    let written = if full { total.max(pages) } else { pages };
    machine.charge_host_pages(written.saturating_sub(zeroed), zeroed);
}

/// Time on `machine`'s clock since `t0` (its `now_ns`).
fn since<M: TestMachine + ?Sized>(machine: &M, t0: u64) -> Duration {
    Duration::from_nanos(machine.now_ns().saturating_sub(t0))
}

/// One reset: takes the dirty set (re-arming the log), adds its pages to `dirty`, lets `copy`
/// copy them back (it empties `dirty`), commits the set. A failed take, add or copy leaves the
/// set's pages owed again (the set drops uncommitted: aborted), so no error loses a page.
///
/// `machine` is the log's (its clock times the copy); `total` is the snapshot's pages, what a
/// full copy writes.
fn reset_with<M: TestMachine + ?Sized>(
    machine: &M,
    log: &mut MachineHarvester<&M>,
    dirty: &mut DirtyPages,
    total: u64,
    copy: impl FnOnce(&mut DirtyPages) -> Result<ResetStats, SnapshotError>,
) -> Res<(ResetReport, ResetStats), M> {
    // Whatever an earlier failed take spent is not this reset's.
    log.source().take_times();
    let set = log.take().map_err(ResetError::Machine)?;
    // What a failed reset left here is only pages copied once more: harmless, but not this
    // reset's count.
    dirty.clear();
    dirty.add_dirty_set(&set)?;
    let t = machine.now_ns();
    let stats = copy(dirty)?;
    charge_written(machine, total, stats.pages, stats.zeroed, stats.full);
    let copy = since(machine, t);
    set.commit();
    let LogTimes {
        read,
        rearm,
        rearmed,
    } = log.source().take_times();
    let report = ResetReport {
        pages: stats.pages,
        harvest: read,
        rearm,
        copy,
        zeroed: stats.zeroed,
        full: stats.full,
        rearmed,
    };
    Ok((report, stats))
}

/// An incremental snapshot of a machine's test region over a [`MachineSnapshot`]
/// ([`MachineSnapshot::take_child`]): the pages written between the base and the child,
/// the base for every other page. Resets copy back only the pages dirtied since memory last
/// equalled the child (or the base), plus — when switching between the two — the child's own
/// pages.
pub struct MachineChild<'a, 'm, M: TestMachine + ?Sized> {
    machine: &'m M,
    log: &'a mut MachineHarvester<&'m M>,
    /// The parent's work list.
    dirty: &'a mut DirtyPages,
    /// The parent's owed pages: the child's own pages while memory last equalled the child,
    /// empty while it last equalled the base.
    owed: &'a mut DirtyPages,
    /// The child's own pages.
    own: DirtyPages,
    child: ChildSnapshot<'a>,
    /// Whether memory last equalled the child (else the base).
    at_child: bool,
}

impl<'m, M: TestMachine + ?Sized> MachineChild<'_, 'm, M> {
    /// Resets the test region to the child: takes the dirty set (re-arming the log), copies
    /// back its pages (and the child's own pages if memory last equalled the base), commits
    /// the set. Errors leave the set's pages owed, as [`MachineSnapshot::reset`] does.
    pub fn reset(&mut self) -> Res<ResetReport, M> {
        let (machine, regions) = (self.machine, self.machine.slot_count());
        let total = self.child.base().pages();
        let MachineChild {
            log,
            dirty,
            owed,
            own,
            child,
            at_child,
            ..
        } = self;
        let (report, _) = reset_with(machine, log, dirty, total, |dirty| {
            if !*at_child {
                add_all(dirty, own, regions)?;
            }
            let stats = child.reset(dirty)?;
            if !*at_child {
                add_all(owed, own, regions)?;
                *at_child = true;
            }
            Ok(stats)
        })?;
        Ok(report)
    }

    /// Resets the test region to the base snapshot: takes the dirty set (re-arming the log),
    /// copies back its pages and the child's own pages if memory last equalled the child,
    /// commits the set. The child stays usable: a later [`Self::reset`] returns to it.
    pub fn reset_to_base(&mut self) -> Res<ResetReport, M> {
        let (machine, regions) = (self.machine, self.machine.slot_count());
        let total = self.child.base().pages();
        let MachineChild {
            log,
            dirty,
            owed,
            child,
            at_child,
            ..
        } = self;
        let (report, _) = reset_with(machine, log, dirty, total, |dirty| {
            add_all(dirty, owed, regions)?;
            let stats = child.base().reset(dirty)?;
            owed.clear();
            *at_child = false;
            Ok(stats)
        })?;
        Ok(report)
    }

    /// Compares the test region with the child (its own pages, the base's elsewhere) byte
    /// for byte.
    pub fn verify(&self) -> Result<(), SnapshotError> {
        self.child.verify()
    }

    /// Compares the test region with the base snapshot byte for byte.
    pub fn verify_base(&self) -> Result<(), SnapshotError> {
        self.child.base().verify()
    }

    /// Pages the child holds itself (written between the base and the child).
    pub fn own_pages(&self) -> u64 {
        self.child.own_pages()
    }

    /// The machine.
    pub fn machine(&self) -> &'m M {
        self.machine
    }
}
