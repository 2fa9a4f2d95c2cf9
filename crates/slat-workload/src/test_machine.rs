//! [`TestMachine`]: what both machines offer a workload driver — the test region, passes and
//! workloads run until halted, and the dirty log (a `slat_dirty::DirtyLogSource`) — so the dirty-log oracle, migration's
//! harvest and the CLI's benchmarks are written once.

use crate::dirty_config::DirtyConfig;
use crate::error::WorkloadError;
use crate::latency::WriteLatency;
use crate::layout::{Layout, TestRegion, FIRST_SLOT};
use crate::pass::PassReport;
use crate::pattern::PassParams;
use slat_dirty::{DirtyLogSource, LogMode, SlotInfo};
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
    /// A handle on the machine's dirty log ([`TestMachine::dirty_log`]).
    type Log<'a>: DirtyLogSource<Error = Self::Error>
    where
        Self: 'a;

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
    /// The test region's dirty log as `slat_dirty`'s one dirty-log abstraction: the tracked
    /// slots are the test memslots (index `i` = slot [`FIRST_SLOT`]` + i`), in the mode the
    /// machine was built with ([`log_mode`]). Harvests (`slat_dirty::Harvester`), the
    /// dirty-log oracle and the benchmarks' raw GET / CLEAR / ring calls all go through it.
    fn dirty_log(&self) -> Self::Log<'_>;

    /// Pins vCPU `i`'s thread to host CPU `cpus[i]` (`sched_setaffinity`, one CPU per vCPU)
    /// and returns each thread's affinity as the kernel reports it afterwards.
    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, Self::Error>;

    /// The first 8 bytes of page `page` of the test region (read atomically: vCPUs may be
    /// writing). `None` past the end.
    fn page_value(&self, page: u64) -> Option<u64>;

    /// Now on the clock the host's waits run on, ns since an arbitrary start: the host's
    /// monotonic clock, or the host's simulated CPU's in virtual time.
    fn now_ns(&self) -> u64 {
        real_now_ns()
    }

    /// Waits `d` on that clock while the vCPUs run (in virtual time, a timer's wait: the
    /// vCPUs' simulated CPUs run meanwhile).
    fn sleep(&self, d: std::time::Duration) {
        std::thread::sleep(d);
    }

    /// Accounts for host work on guest RAM that the caller did outside the machine, on the
    /// clock of [`Self::now_ns`]: `copied` 4 KiB pages copied in and `zeroed` pages zeroed (a
    /// snapshot reset). Nothing on the host's clock, where the work took its own time; the
    /// cost profile's price of the pages on the host's simulated CPU in virtual time.
    fn charge_host_pages(&self, copied: u64, zeroed: u64) {
        let _ = (copied, zeroed);
    }
}

/// Nanoseconds of the host's monotonic clock since its first reading in this process.
fn real_now_ns() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The log mode of a test region logged as `dirty` with `pages_per_slot` pages per slot: the
/// dirty ring if it has one, GET + CLEAR of the whole slot with manual protect (KVM accepts a
/// chunk that ends at the slot's end whatever its length), GET otherwise.
pub fn log_mode(dirty: DirtyConfig, pages_per_slot: u64) -> LogMode {
    if dirty.ring_entries != 0 {
        LogMode::Ring
    } else if dirty.manual_protect != 0 {
        LogMode::ManualProtect {
            chunk_pages: pages_per_slot.div_ceil(64).max(1) * 64,
        }
    } else {
        LogMode::Get
    }
}

/// The slots of a test region's dirty log: `slots` memslots of `pages` pages, ids from
/// [`FIRST_SLOT`].
pub fn log_slots(slots: usize, pages: u64) -> Vec<SlotInfo> {
    (0..slots as u32)
        .map(|i| SlotInfo {
            id: FIRST_SLOT + i,
            pages,
        })
        .collect()
}

/// The memslot id of tracked slot `index` of a test region of `slots` memslots, or a
/// refusal.
pub fn log_slot_id(index: usize, slots: usize) -> Result<u32, WorkloadError> {
    match u32::try_from(index) {
        Ok(i) if index < slots => Ok(FIRST_SLOT + i),
        _ => Err(WorkloadError::Config(format!(
            "slot index {index}: the test region has {slots} memslots"
        ))),
    }
}
