//! [`TestMachine`]: what both machines offer a workload driver — the test region, passes and
//! workloads run until halted, and the dirty log — so the dirty-log oracle, migration's
//! harvest and the CLI's benchmarks are written once.

use crate::dirty_config::DirtyConfig;
use crate::error::WorkloadError;
use crate::latency::WriteLatency;
use crate::layout::{Layout, TestRegion, FIRST_SLOT};
use crate::pass::PassReport;
use crate::pattern::PassParams;
use std::ops::Range;

/// A machine running KVM-selftest-style workloads over a test region of `slot_ids().len()`
/// equal memslots: `slat_machine::Machine` (simulated hardware on slat's page tables) and
/// `slat_kvm::KvmMachine` (real guests on `/dev/kvm`).
///
/// Slot ids are as the machine's dirty log reports them (KVM: `as_id << 16 | id`, address
/// space 0 here); page offsets are relative to the slot.
pub trait TestMachine {
    /// Why an operation failed. It can say what this crate refuses (the oracle's checks).
    type Error: std::error::Error + From<WorkloadError> + Send + Sync + 'static;
    /// The machine's own per-vCPU counters in a [`PassReport`].
    type Counters: Copy + Default + std::fmt::Debug;

    /// The test region: layout, memslots and dirty logging, as the machine was built.
    fn region(&self) -> &TestRegion;
    /// Where the test region is.
    fn layout(&self) -> Layout {
        self.region().layout
    }
    /// How the machine logs dirty pages (fixed when it was built).
    fn dirty_config(&self) -> DirtyConfig {
        self.region().dirty
    }
    /// Memslots the test region is split into (equal, ids [`FIRST_SLOT`]`..`).
    fn slot_count(&self) -> usize {
        self.region().slots
    }
    /// The ids of the test region's memslots, in guest-address order.
    fn test_slots(&self) -> Range<u32> {
        FIRST_SLOT..FIRST_SLOT + self.slot_count() as u32
    }
    /// Pages per memslot.
    fn pages_per_slot(&self) -> u64 {
        self.layout().total_pages() / self.slot_count().max(1) as u64
    }

    /// What this machine records as a write's latency in a timed pass
    /// ([`PassParams::timed`]).
    fn write_latency(&self) -> WriteLatency;

    /// Runs one memstress pass on every vCPU and waits for all of them (GUEST_SYNC).
    fn run_pass(&self, params: PassParams) -> Result<PassReport<Self::Counters>, Self::Error>;
    /// Starts memstress passes back to back on every vCPU until [`TestMachine::halt`].
    fn start_loop(&self, params: PassParams) -> Result<(), Self::Error>;
    /// Starts dirty_log_test's writer on every vCPU (vCPU `i` seeded with `seed + i`), which
    /// writes `value` into the first 8 bytes of pseudo-random pages until halted.
    fn start_writer(&self, seed: u32, value: u64) -> Result<(), Self::Error>;
    /// Changes the value the running writer writes from its next write on.
    fn set_writer_value(&self, value: u64);
    /// Stops the running workload at the vCPUs' next check and waits for every vCPU to leave
    /// the guest.
    fn halt(&self) -> Result<PassReport<Self::Counters>, Self::Error>;

    /// Turns dirty logging on or off on every test memslot.
    fn set_dirty_logging(&self, on: bool) -> Result<(), Self::Error>;
    /// GET_DIRTY_LOG of `slot` into `bitmap` (bit `p` = page `p` of the slot; exactly
    /// `pages_per_slot().div_ceil(64)` words). Without manual protect it also clears and
    /// re-protects; with it, it copies.
    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), Self::Error>;
    /// CLEAR_DIRTY_LOG (manual protect): clears and re-protects the pages of
    /// `[first, first + num)` of `slot` whose bits are set in `bitmap` (bit 0 = `first`).
    fn clear_dirty_log(
        &self,
        slot: u32,
        first: u64,
        num: u64,
        bitmap: &[u64],
    ) -> Result<(), Self::Error>;
    /// Takes every dirty-ring entry not yet collected (those vCPUs reaped on ring-full exits
    /// first), calling `f(slot, offset)` per entry; returns how many. Follow with
    /// [`TestMachine::reset_dirty_rings`] before reading the pages.
    fn collect_dirty_rings(&self, f: impl FnMut(u32, u64)) -> u64;
    /// [`TestMachine::collect_dirty_rings`] that also names the vCPU whose ring held each
    /// entry: `f(vcpu, slot, offset)`, `None` for entries the machine cannot attribute (by
    /// default all of them; both machines attribute every entry, also those their vCPUs
    /// reaped on ring-full exits). For per-vCPU dirty rates.
    fn collect_dirty_rings_by_vcpu(&self, mut f: impl FnMut(Option<usize>, u32, u64)) -> u64 {
        self.collect_dirty_rings(|slot, offset| f(None, slot, offset))
    }
    /// RESET_DIRTY_RINGS: re-protects the pages of every collected entry; returns how many
    /// entries were reset.
    fn reset_dirty_rings(&self) -> Result<u64, Self::Error>;

    /// Pins vCPU `i`'s thread to host CPU `cpus[i]` (`sched_setaffinity`, one CPU per vCPU)
    /// and returns each thread's affinity as the kernel reports it afterwards.
    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, Self::Error>;

    /// The first 8 bytes of page `page` of the test region (read atomically: vCPUs may be
    /// writing). `None` past the end.
    fn page_value(&self, page: u64) -> Option<u64>;
}
