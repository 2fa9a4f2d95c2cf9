//! The KVM machine: a VM with the memstress layout, one thread per vCPU, workload passes, and
//! the dirty-log operations (bitmap GET/CLEAR and per-vCPU rings).

mod log;
mod setup;
mod vcpu;
pub use log::KvmMachineLog;
use setup::{
    caps_of, check_config, check_host, create_vcpus, create_vm, map_memory, open, place_region,
    register_slots, tsc_khz_of,
};
use vcpu::{vcpu_thread, VcpuContext};

use crate::error::KvmError;
use crate::guest::{self, control, param, GuestMode, LowLayout};
use crate::histogram;
use crate::stats::{Stat, StatsFd};
use kvm_bindings::{
    KVM_DIRTY_LOG_INITIALLY_SET, KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{VcpuFd, VmFd};
use slat_addr::{PageIndex, PAGE_SIZE};
use slat_dirty::log::DirtyRing;
use slat_dirty::Memslot;
use slat_workload::cpus::VcpuTids;
use slat_workload::{
    GuestRam, LatencyHistogram, ParkMiller, PassParams, RegionSpec, Rendezvous, TestMachine,
    TestRegion, FIRST_SLOT, INITIALLY_SET, MANUAL_PROTECT_ENABLE,
};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// The memslot id of the low slot (code, parameters, page tables, stacks).
pub const LOW_SLOT: u32 = 0;
/// The default KVM device.
pub const DEFAULT_DEVICE: &str = "/dev/kvm";
/// The highest guest physical address bit the test region may use: everything then lies under
/// the first entry of the guest's level-4 table (one level-3 table maps it all), and it is
/// below the 39 physical-address bits of the smallest x86-64 hosts, so the guest's page tables
/// never hold an address with reserved bits set, whether KVM runs them with TDP or shadows
/// them.
pub const MAX_GPA_BITS: u32 = 39;

// `slat-workload` spells KVM's dirty-log flags without depending on KVM's headers.
const _: () = assert!(
    MANUAL_PROTECT_ENABLE == KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE
        && INITIALLY_SET == KVM_DIRTY_LOG_INITIALLY_SET
);

/// What to build.
#[derive(Debug, Clone)]
pub struct KvmConfig {
    /// The test region: its shape, the host memory behind it, whether it is pre-faulted and how
    /// it logs dirty pages.
    pub region: RegionSpec,
    /// The privilege level the guest workload runs at.
    pub guest_mode: GuestMode,
    /// The KVM device to open.
    pub device: String,
}

impl Default for KvmConfig {
    fn default() -> Self {
        KvmConfig {
            region: RegionSpec::default(),
            guest_mode: GuestMode::default(),
            device: DEFAULT_DEVICE.to_string(),
        }
    }
}

/// What the host's KVM offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCaps {
    /// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`: the flags it accepts (0 = unsupported).
    pub manual_protect: u32,
    /// Largest dirty ring in bytes (0 = no dirty ring).
    pub dirty_ring_max_bytes: u32,
    /// The ring offers the acquire/release variant (`KVM_CAP_DIRTY_LOG_RING_ACQ_REL`).
    pub dirty_ring_acq_rel: bool,
    /// Most vCPUs per VM.
    pub max_vcpus: usize,
    /// Memslots per address space.
    pub memslots: usize,
    /// Guest physical address bits (CPUID 0x80000008).
    pub phys_bits: u32,
}

/// Opens `device` and reports what its KVM offers.
pub fn host_caps(device: &str) -> Result<HostCaps, KvmError> {
    let kvm = open(device)?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| KvmError::ioctl("KVM_GET_SUPPORTED_CPUID", e))?;
    caps_of(&kvm, &cpuid)
}

/// What the vCPUs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// One memstress pass, then sync (what [`KvmMachine::run_pass`] runs).
    Pass(PassParams),
    /// Memstress passes back to back until halted (dirty_log_perf_test's `-e`).
    Loop(PassParams),
    /// dirty_log_test's guest: until halted, write `iteration` into the first 8 bytes of
    /// pseudo-random pages of the vCPU's region (vCPU `i` seeds with `seed + i`; see
    /// [`slat_workload::WriterPattern`]). The guest reads the value from the control page
    /// before every write, so [`TestMachine::set_writer_value`] changes it while it runs.
    Writer {
        /// PRNG seed.
        seed: u32,
        /// The value written.
        iteration: u64,
    },
}

/// What KVM counts per vCPU beside the shared fields of [`VcpuPass`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvmCounters {
    /// `KVM_RUN` calls (1 + exits handled inside the pass).
    pub entries: u64,
}

/// One vCPU's part of a pass: from its first `KVM_RUN` of the pass to its sync exit; its
/// `ring_full_exits` counts `KVM_EXIT_DIRTY_RING_FULL` exits handled.
pub type VcpuPass = slat_workload::VcpuPass<KvmCounters>;

/// A completed pass.
pub type PassReport = slat_workload::PassReport<KvmCounters>;

/// The host's rendezvous with the vCPU threads. The job itself is in the guest's parameter
/// blocks, written before the release.
type Control = Rendezvous<(), VcpuPass, String>;

/// Rings of every vCPU, and entries taken by vCPUs on ring-full exits that the host has not
/// collected yet. One lock: a ring is harvested by one thread at a time.
struct Rings {
    rings: Vec<DirtyRing>,
    /// (index of the ring = the vCPU, slot, offset).
    reaped: Vec<(usize, u32, PageIndex)>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A VM on `/dev/kvm` laid out like KVM's memstress, with one thread per vCPU.
///
/// Like `slat_machine::Machine`, it is a [`TestMachine`], so one benchmark (and the dirty-log
/// oracle) drives either.
pub struct KvmMachine {
    threads: Vec<JoinHandle<()>>,
    ctl: Arc<Control>,
    rings: Arc<Mutex<Rings>>,
    vm: Arc<VmFd>,
    /// The test region's memslots (ids `FIRST_SLOT..`), as registered: the dirty-log calls
    /// size their bitmaps from these.
    slots: Vec<Memslot>,
    region: TestRegion,
    low_layout: LowLayout,
    config: KvmConfig,
    caps: HostCaps,
    logging: Mutex<bool>,
    /// The vCPU threads' kernel ids, for pinning.
    tids: Arc<VcpuTids>,
    /// Statistics fds of the VM and of each vCPU (`None` on kernels without them).
    stats: Option<(StatsFd, Vec<StatsFd>)>,
    /// The guest's TSC frequency, to convert timed writes to nanoseconds; why not, if unknown.
    tsc_khz: Result<NonZeroU32, String>,
    /// The running workload times its writes (set by `start`, read when collecting it).
    timed: AtomicBool,
    // Memory goes last: it is unmapped after the vCPU threads are joined and the VM closed.
    low: GuestRam,
    ram: GuestRam,
}

impl KvmMachine {
    /// Opens KVM, maps guest memory, creates the VM, its memslots and vCPUs (long mode, identity
    /// paging), and starts idle vCPU threads.
    pub fn new(config: KvmConfig) -> Result<Self, KvmError> {
        let size = check_config(&config)?;
        let kvm = open(&config.device)?;
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| KvmError::ioctl("KVM_GET_SUPPORTED_CPUID", e))?;
        let caps = caps_of(&kvm, &cpuid)?;
        let ring_size = check_host(&config, &caps)?;
        let (gpa, low_layout) = place_region(&config, &caps, size.total)?;
        let (ram, low) = map_memory(&config, &low_layout, gpa, size.total)?;
        let vm = Arc::new(create_vm(
            &kvm,
            config.region.dirty.manual_protect,
            ring_size,
            &caps,
        )?);
        // SAFETY: `ram` and `low` end up in the machine built below, which unmaps them last:
        // after joining the vCPU threads (which own the vCPU fds) and dropping the VM fd, the
        // rings (mappings of vCPU fds) and the memslot handles, its fields declared before
        // `low` and `ram`; if the machine is leaked instead, so are they. Nothing deletes the
        // slots. `size.total <= ram.len()` (`map_memory` rounds it up).
        let slots = unsafe { register_slots(&vm, &low, &ram, gpa, &size) }?;
        let layout = size.layout(gpa, ram.addr(), config.region.overlap);
        let (vcpus, rings, stats) = create_vcpus(&vm, &cpuid, &low_layout, &config, ring_size)?;
        let tids = Arc::new(VcpuTids::new(config.region.vcpus)?);
        let tsc_khz = tsc_khz_of(&vcpus);
        let m = KvmMachine {
            threads: Vec::new(),
            ctl: Arc::new(Control::new(config.region.vcpus)?),
            rings: Arc::new(Mutex::new(Rings {
                rings,
                reaped: Vec::new(),
            })),
            vm,
            slots,
            region: TestRegion {
                layout,
                slots: config.region.slots,
                dirty: config.region.dirty,
            },
            low_layout,
            config,
            caps,
            logging: Mutex::new(false),
            tids,
            stats,
            tsc_khz,
            timed: AtomicBool::new(false),
            low,
            ram,
        };
        m.write_params_static();
        m.start_vcpu_threads(vcpus)
    }

    /// Starts one thread per vCPU, each owning its vCPU fd, idle until the first job.
    fn start_vcpu_threads(mut self, vcpus: Vec<VcpuFd>) -> Result<Self, KvmError> {
        for (i, v) in vcpus.into_iter().enumerate() {
            let ctx = VcpuContext {
                idx: i,
                vcpu: v,
                ctl: self.ctl.clone(),
                rings: self.rings.clone(),
                vm: self.vm.clone(),
                block: self.low.addr() + self.low_layout.param_block(i),
                regs: guest::initial_regs(&self.low_layout, i, self.config.guest_mode),
            };
            let tids = self.tids.clone();
            let t = std::thread::Builder::new()
                .name(format!("kvm-vcpu{i}"))
                .spawn(move || {
                    tids.publish(i);
                    vcpu_thread(ctx)
                });
            match t {
                Ok(h) => self.threads.push(h),
                Err(e) => {
                    // The threads already started wait at the start barrier for a party that
                    // never arrives: release them for good and join them. Each closes its vCPU
                    // fd as it exits, so the machine (its memslots' memory last) drops after.
                    self.ctl.abandon();
                    for t in std::mem::take(&mut self.threads) {
                        let _ = t.join();
                    }
                    return Err(KvmError::Thread(e));
                }
            }
        }
        Ok(self)
    }

    /// The configuration.
    pub fn config(&self) -> &KvmConfig {
        &self.config
    }

    /// The test region's guest RAM (registered with KVM as the test memslots), e.g. to serve
    /// its first touches through userfaultfd.
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// What the host's KVM offers.
    pub fn caps(&self) -> HostCaps {
        self.caps
    }

    /// Where the code, parameters and page tables are in the low slot.
    pub fn low_layout(&self) -> LowLayout {
        self.low_layout
    }

    /// The VM fd, for ioctls this crate does not wrap.
    ///
    /// # Safety
    ///
    /// The caller must not delete, re-create or move the machine's memslots through it (e.g.
    /// with `VmFd::set_user_memory_region`, whose own contract does not cover this), nor
    /// change its dirty-log or dirty-ring configuration: the machine's dirty-log calls size
    /// the bitmaps KVM writes from the slots as it registered them, and a slot deleted and
    /// created again with another size would let KVM write past them. `VmFd::get_dirty_log`
    /// of `kvm-ioctls` trusts its `memory_size` argument in the same way.
    ///
    /// Without `unsafe` this does not compile:
    ///
    /// ```compile_fail,E0133
    /// fn delete_slot_1(m: &slat_kvm::KvmMachine) {
    ///     let vm = m.vm_fd();
    /// }
    /// ```
    pub unsafe fn vm_fd(&self) -> &VmFd {
        &self.vm
    }

    /// KVM's counters for the VM (e.g. `remote_tlb_flush`, `pages_4k`, `mmu_shadow_zapped`).
    /// Errors if the kernel has no binary statistics (`KVM_CAP_BINARY_STATS_FD`, Linux 5.14).
    pub fn vm_stats(&self) -> Result<Vec<Stat>, KvmError> {
        match &self.stats {
            Some((vm, _)) => vm.read(),
            None => Err(KvmError::unsupported("KVM_CAP_BINARY_STATS_FD")),
        }
    }

    /// KVM's counters for vCPU `i` (e.g. `exits`, `pf_fixed`, `pf_emulate`,
    /// `insn_emulation`), or for all vCPUs summed when `i` is `None`.
    pub fn vcpu_stats(&self, i: Option<usize>) -> Result<Vec<Stat>, KvmError> {
        let Some((_, vcpus)) = &self.stats else {
            return Err(KvmError::unsupported("KVM_CAP_BINARY_STATS_FD"));
        };
        match i {
            Some(i) => vcpus
                .get(i)
                .ok_or_else(|| KvmError::Config(format!("no vCPU {i}")))?
                .read(),
            None => {
                let mut sum: Vec<Stat> = Vec::new();
                for v in vcpus {
                    for s in v.read()? {
                        match sum.iter_mut().find(|t| t.name == s.name) {
                            Some(t) if s.peak => t.value = t.value.max(s.value),
                            Some(t) => t.value = t.value.wrapping_add(s.value),
                            None => sum.push(s),
                        }
                    }
                }
                Ok(sum)
            }
        }
    }

    /// The ids of the test region's memslots, in guest-address order.
    pub fn slot_ids(&self) -> impl Iterator<Item = u32> {
        FIRST_SLOT..FIRST_SLOT + self.config.region.slots as u32
    }

    /// Sets the first 8 bytes of page `page` of the test region from the host (not logged:
    /// KVM logs guest writes only). `false` past the end.
    pub fn set_page_value(&self, page: u64, value: u64) -> bool {
        if page >= self.region.layout.total_pages() {
            return false;
        }
        // SAFETY: as in `page_value`.
        unsafe { AtomicU64::from_ptr((self.ram.addr() + page * PAGE_SIZE) as *mut u64) }
            .store(value, Ordering::Relaxed);
        true
    }

    fn low_u64(&self, at: u64) -> &AtomicU64 {
        // Offsets come from `low_layout`, never from callers; check anyway, the SAFETY
        // argument below rests on it.
        assert!(at % 8 == 0 && at.checked_add(8).is_some_and(|e| e <= self.low.len()));
        // SAFETY: `at` is an aligned offset inside the low mapping, which lives as long as
        // `self`; the guest shares these words, so they are only accessed atomically.
        unsafe { AtomicU64::from_ptr((self.low.addr() + at) as *mut u64) }
    }

    /// Parameter block fields that never change.
    fn write_params_static(&self) {
        for i in 0..self.config.region.vcpus {
            let b = self.low_layout.param_block(i);
            let (gpa, _, pages) = self.region.layout.region(i);
            self.low_u64(b + param::BASE).store(gpa, Ordering::Relaxed);
            self.low_u64(b + param::PAGES)
                .store(pages, Ordering::Relaxed);
            self.low_u64(b + param::CONTROL)
                .store(self.low_layout.control, Ordering::Relaxed);
            self.low_u64(b + param::HUNDRED)
                .store(100, Ordering::Relaxed);
            self.low_u64(b + param::HIST)
                .store(self.low_layout.hist_page(i), Ordering::Relaxed);
        }
    }

    /// The guest's TSC frequency in kHz (`KVM_GET_TSC_KHZ`), which timed passes need;
    /// [`KvmError::Unsupported`] if KVM did not report one.
    pub fn tsc_khz(&self) -> Result<NonZeroU32, KvmError> {
        self.tsc_khz.clone().map_err(|why| KvmError::Unsupported {
            capability: "KVM_CAP_GET_TSC_KHZ",
            detail: format!(": {why}; timed passes need the guest's TSC frequency"),
        })
    }

    /// Zeroes every vCPU's histogram page before a timed workload.
    fn clear_histograms(&self) {
        for i in 0..self.config.region.vcpus {
            let page = self.low_layout.hist_page(i);
            for at in (0..histogram::USED).step_by(8) {
                self.low_u64(page + at).store(0, Ordering::Relaxed);
            }
        }
    }

    /// vCPU `i`'s in-guest histogram as the guest left it: the counter of each
    /// [`histogram::bucket`] of TSC cycles, and the most cycles one write took (`None` for a
    /// vCPU the machine does not have). Meaningful after a timed workload, until the next one
    /// starts.
    pub fn guest_histogram(&self, i: usize) -> Option<(Vec<u64>, u64)> {
        if i >= self.config.region.vcpus {
            return None;
        }
        let page = self.low_layout.hist_page(i);
        let word = |at: u64| self.low_u64(page + at).load(Ordering::Relaxed);
        let counts = (0..histogram::BUCKETS as u64)
            .map(|b| word(histogram::COUNTS + b * 8))
            .collect();
        Some((counts, word(histogram::MAX)))
    }

    /// vCPU `i`'s histogram in nanoseconds, read once the vCPU is out of guest mode.
    fn read_histogram(&self, i: usize, tsc_khz: NonZeroU32) -> LatencyHistogram {
        let (counts, max) = self.guest_histogram(i).unwrap_or_default();
        histogram::to_latency(&counts, max, tsc_khz)
    }

    /// Refuses a workload the guest cannot run as asked; whether it is timed.
    fn check_workload(&self, w: &Workload) -> Result<bool, KvmError> {
        let (Workload::Pass(p) | Workload::Loop(p)) = w else {
            return Ok(false);
        };
        if p.write_percent > 100 {
            return Err(KvmError::Config(format!(
                "write percent {} is not in 0..=100",
                p.write_percent
            )));
        }
        if p.timed {
            // Refuse before running anything: without the TSC frequency the cycles could
            // only become guessed nanoseconds.
            self.tsc_khz()?;
        }
        Ok(p.timed)
    }

    /// The parameter block fields of one workload, on every vCPU.
    fn write_params_job(&self, mode: u64, p: PassParams) {
        for i in 0..self.config.region.vcpus {
            let b = self.low_layout.param_block(i);
            let pages = self.region.layout.region(i).2;
            self.low_u64(b + param::COUNT)
                .store(p.touches.map_or(pages, |n| n.min(pages)), Ordering::Relaxed);
            let (seed, wp, random, timed) = (p.seed, p.write_percent, p.random, p.timed);
            let s = ParkMiller::normalize(seed.wrapping_add(i as u32));
            self.low_u64(b + param::SEED)
                .store(s as u64, Ordering::Relaxed);
            self.low_u64(b + param::WRITE_PERCENT)
                .store(wp as u64, Ordering::Relaxed);
            self.low_u64(b + param::RANDOM)
                .store(random as u64, Ordering::Relaxed);
            self.low_u64(b + param::MODE).store(mode, Ordering::Relaxed);
            self.low_u64(b + param::TIMED)
                .store(u64::from(timed), Ordering::Relaxed);
        }
    }

    /// Starts `w` on every vCPU and returns at once; [`Self::halt`] stops it (a `Pass` also
    /// ends by itself, and `halt` then just collects it).
    pub fn start(&self, w: Workload) -> Result<(), KvmError> {
        let timed = self.check_workload(&w)?;
        if !self.ctl.claim() {
            return Err(KvmError::Busy("a workload is already running"));
        }
        self.timed.store(timed, Ordering::Relaxed);
        if timed {
            self.clear_histograms();
        }
        let (mode, p) = match w {
            Workload::Pass(p) => (guest::MODE_PASS, p),
            Workload::Loop(p) => (guest::MODE_LOOP, p),
            Workload::Writer { seed, iteration } => {
                self.low_u64(self.low_layout.control + control::ITERATION)
                    .store(iteration, Ordering::Relaxed);
                let p = PassParams {
                    write_percent: 100,
                    random: true,
                    seed,
                    timed: false,
                    touches: None,
                };
                (guest::MODE_WRITER, p)
            }
        };
        self.write_params_job(mode, PassParams { timed, ..p });
        self.low_u64(self.low_layout.control + control::HALT)
            .store(0, Ordering::SeqCst);
        // The release orders the stores above before the vCPU threads' KVM_RUN.
        self.ctl.release(());
        Ok(())
    }

    fn wait(&self, t0: Instant) -> Result<PassReport, KvmError> {
        let (wall, results) = self.ctl.collect(t0);
        let vcpus = results.map_err(|(vcpu, exit)| KvmError::UnexpectedExit { vcpu, exit })?;
        // Every vCPU has synced (the barrier in `collect` orders its guest's stores before
        // these loads), so its histogram is final.
        let latency = match (self.timed.load(Ordering::Relaxed), self.tsc_khz.as_ref()) {
            (true, Ok(&khz)) => (0..vcpus.len())
                .map(|i| self.read_histogram(i, khz))
                .collect(),
            _ => Vec::new(),
        };
        Ok(PassReport {
            wall,
            vcpus,
            latency,
        })
    }

    /// Whether dirty logging is on.
    pub fn dirty_logging(&self) -> bool {
        *lock(&self.logging)
    }

    /// The test memslot `slot`, for a bitmap operation.
    fn bitmap_slot(&self, slot: u32, op: &str) -> Result<&Memslot, KvmError> {
        if self.config.region.dirty.ring_entries != 0 {
            return Err(KvmError::DirtyLog(format!(
                "{op}: the VM logs to dirty rings, which replace the bitmaps"
            )));
        }
        self.slots
            .iter()
            .find(|s| s.id() == slot)
            .ok_or_else(|| KvmError::DirtyLog(format!("{op}: slot {slot} is not a test memslot")))
    }
}

impl Drop for KvmMachine {
    fn drop(&mut self) {
        let threads = std::mem::take(&mut self.threads);
        self.ctl.shut_down(threads, || drop(self.halt()));
    }
}

impl TestMachine for KvmMachine {
    type Error = KvmError;
    type Counters = KvmCounters;
    type Log<'a> = KvmMachineLog<'a>;

    fn region(&self) -> &TestRegion {
        &self.region
    }
    fn write_latency(&self) -> slat_workload::WriteLatency {
        slat_workload::WriteLatency::AllWrites
    }

    /// Runs one memstress pass on every vCPU and waits for all of them (GUEST_SYNC).
    fn run_pass(&self, params: PassParams) -> Result<PassReport, KvmError> {
        let t0 = Instant::now();
        self.start(Workload::Pass(params))?;
        self.wait(t0)
    }

    fn start_loop(&self, params: PassParams) -> Result<(), KvmError> {
        self.start(Workload::Loop(params))
    }
    fn start_writer(&self, seed: u32, value: u64) -> Result<(), KvmError> {
        self.start(Workload::Writer {
            seed,
            iteration: value,
        })
    }

    /// Changes the value a running [`Workload::Writer`] writes: the guest reads it from the
    /// control page before every write.
    fn set_writer_value(&self, value: u64) {
        self.low_u64(self.low_layout.control + control::ITERATION)
            .store(value, Ordering::Relaxed);
    }

    /// Asks the running workload to stop at the vCPUs' next check and waits for every vCPU to
    /// sync.
    fn halt(&self) -> Result<PassReport, KvmError> {
        if !self.ctl.running() {
            return Err(KvmError::Busy("no workload is running"));
        }
        let t0 = Instant::now();
        self.low_u64(self.low_layout.control + control::HALT)
            .store(1, Ordering::SeqCst);
        self.wait(t0)
    }

    /// Turns dirty logging (`KVM_MEM_LOG_DIRTY_PAGES`) on or off on every memslot of the test
    /// region (a flags-only `KVM_SET_USER_MEMORY_REGION`).
    fn set_dirty_logging(&self, on: bool) -> Result<(), KvmError> {
        let mut logging = lock(&self.logging);
        for slot in &self.slots {
            slot.set_dirty_logging(on)?;
        }
        *logging = on;
        Ok(())
    }

    fn dirty_log(&self) -> KvmMachineLog<'_> {
        KvmMachineLog { m: self }
    }

    /// The first 8 bytes of page `page` of the test region (atomically; vCPUs may be writing).
    /// `None` past the end.
    fn page_value(&self, page: u64) -> Option<u64> {
        (page < self.region.layout.total_pages()).then(|| {
            // SAFETY: `page < total_pages`, and `ram` maps at least the test region's
            // `total_pages * 4 KiB` bytes (its length is that, rounded up to the backing's page
            // size) for as long as `self` lives; the address is page aligned, and the word is
            // accessed atomically because vCPUs may write it.
            unsafe { AtomicU64::from_ptr((self.ram.addr() + page * PAGE_SIZE) as *mut u64) }
                .load(Ordering::Relaxed)
        })
    }

    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, KvmError> {
        self.tids.pin(cpus).map_err(KvmError::Thread)
    }
}
