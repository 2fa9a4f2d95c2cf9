//! The simulated machine: guest RAM, memslots laid out like KVM's memstress, and persistent
//! vCPU threads that run one workload pass per host request.

use crate::cpu::{Cpu, CpuCounters, Exit, RingFullHandler};
use crate::memstress::{guest_pass, PassParams, WriterPattern};
use crate::page_table_stage::{guest_stage, StageParams};
use crate::sched::PcpuPool;
use crate::tlb::{Tlb, TlbError, DEFAULT_TLB_ENTRIES};
use crate::vtime::{ClockGate, SimThreads};
use slat::clock::{Clock, Cost};

mod sim_log;
use parking_lot::Mutex;
pub use sim_log::SimLog;
use slat::direct_map::{DirectMap, DirectMapConfig, DirectMapError};
use slat::dirty::DirtyLogError;
use slat::{
    Ept, HostRange, HostRangeError, MemoryAttributeError, MemoryAttributes, MemslotError,
    MemslotFlags, PteFormat, SlotId, Vm, VmConfig,
};
use slat_addr::{Gpa, PAGE_SHIFT, PAGE_SIZE};
use slat_workload::cpus::VcpuTids;
use slat_workload::latency::LatencyHistogram;
use slat_workload::{GuestRam, RamError};
use slat_workload::{Layout, FIRST_SLOT};
use slat_workload::{RegionSize, RegionSpec, Rendezvous, TestMachine, TestRegion, WorkloadError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// What to build.
#[derive(Debug, Clone, Copy)]
pub struct MachineConfig {
    /// Engine variant switches.
    pub vm: VmConfig,
    /// The test region: its shape, the host memory behind it, whether it is pre-faulted and how
    /// it logs dirty pages.
    pub region: RegionSpec,
    /// 4 KiB TLB entries per vCPU (power of two).
    pub tlb_entries: usize,
    /// Physical CPUs vCPUs are scheduled on (0 = the host's available parallelism).
    pub pcpus: usize,
    /// Guest physical address of the test region (`None`: the top of the guest physical
    /// address space, as KVM's selftests place it). Must be aligned to the backing page size.
    pub gpa: Option<u64>,
    /// A confidential guest (SNP-like): the test region is private memory from a pool under a
    /// host direct map of this configuration. Every page starts `PRIVATE` and unaccepted, the
    /// vCPUs' accesses are private, and each first touch accepts its page lazily.
    pub private: Option<DirectMapConfig>,
}

impl Default for MachineConfig {
    fn default() -> Self {
        MachineConfig {
            vm: VmConfig::default(),
            region: RegionSpec::default(),
            tlb_entries: DEFAULT_TLB_ENTRIES,
            pcpus: 0,
            gpa: None,
            private: None,
        }
    }
}

/// Why the machine could not be built or a pass failed.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// Guest RAM could not be mapped.
    #[error(transparent)]
    Ram(#[from] RamError),
    /// The engine refused a memslot.
    #[error(transparent)]
    Memslot(#[from] MemslotError),
    /// Guest RAM could not be cut into memslot ranges.
    #[error(transparent)]
    HostRange(#[from] HostRangeError),
    /// A configuration value is out of range.
    #[error("{0}")]
    Config(String),
    /// A vCPU exited to the VMM during a workload (MMIO or read-only write).
    #[error("vCPU {vcpu} exited unexpectedly: {exit:?}")]
    UnexpectedExit {
        /// The vCPU.
        vcpu: usize,
        /// The exit.
        exit: Exit,
    },
    /// A vCPU thread could not be started.
    #[error("cannot start vCPU thread: {0}")]
    Thread(std::io::Error),
    /// The engine refused a dirty-log request.
    #[error(transparent)]
    DirtyLog(#[from] DirtyLogError),
    /// The private pool's direct map could not be built or bound.
    #[error(transparent)]
    DirectMap(#[from] DirectMapError),
    /// The engine refused a memory-attribute change.
    #[error(transparent)]
    MemoryAttributes(#[from] MemoryAttributeError),
    /// The TLB size was refused or could not be allocated.
    #[error(transparent)]
    Tlb(#[from] TlbError),
    /// The host's rendezvous with the vCPU threads refused the vCPU count.
    #[error(transparent)]
    Rendezvous(#[from] slat_workload::RendezvousError),
    /// A workload is already running (or none is, for a halt).
    #[error("{0}")]
    Busy(&'static str),
}

impl From<WorkloadError> for MachineError {
    /// A refusal of the shared workload code is a configuration error here too.
    fn from(e: WorkloadError) -> Self {
        match e {
            WorkloadError::Config(m) => MachineError::Config(m),
            WorkloadError::Thread(e) => MachineError::Thread(e),
        }
    }
}

/// One vCPU's part of a pass (or of a workload run until halted), with the simulated
/// hardware's counters accumulated during it.
pub type VcpuPass = slat_workload::VcpuPass<CpuCounters>;

/// A completed pass.
pub type PassReport = slat_workload::PassReport<CpuCounters>;

/// What the vCPUs run.
#[derive(Debug, Clone)]
pub enum Workload {
    /// One memstress pass, then sync (what [`Machine::run_pass`] runs).
    Pass(PassParams),
    /// Memstress passes back to back until halted (dirty_log_perf_test's `-e`).
    Loop(PassParams),
    /// dirty_log_test's guest: until halted, write the current `iteration` into the first
    /// 8 bytes of pseudo-random pages of the vCPU's region (vCPU `i` seeds with `seed + i`).
    Writer {
        /// PRNG seed.
        seed: u32,
        /// The value written (the host bumps it between iterations).
        iteration: Arc<AtomicU64>,
    },
    /// One stage of kvm_page_table_test over the vCPU's region (the whole region with
    /// `overlap`, as that test runs), then sync.
    Stage(StageParams),
    /// Live migration's guest ([`crate::paced`]): memstress passes until halted, every write a
    /// new value, at a write rate and throttle the host changes while it runs.
    Paced(crate::paced::PacedParams),
}

impl Workload {
    /// Whether the vCPUs time their faulting writes ([`PassParams::timed`]); the dirty-log
    /// writer and the page-table stages have no pass parameters and are never timed.
    fn timed(&self) -> bool {
        match self {
            Workload::Pass(p) | Workload::Loop(p) => p.timed,
            Workload::Paced(p) => p.pass.timed,
            Workload::Writer { .. } | Workload::Stage(_) => false,
        }
    }
}

/// What a vCPU thread reports: its part of the workload and, when it was timed, its faulting
/// writes' latencies (kept apart because [`VcpuPass`] is `Copy`).
#[derive(Debug, Clone, Default)]
struct VcpuResult {
    pass: VcpuPass,
    latency: Option<LatencyHistogram>,
}

/// The host's rendezvous with the vCPU threads: every vCPU runs the same workload.
type Control<C> = Rendezvous<Workload, VcpuResult, Exit, ClockGate<C>>;

/// The simulated machine.
pub struct Machine<F: PteFormat = Ept> {
    vm: Arc<Vm<F>>,
    ram: Arc<GuestRam>,
    region: TestRegion,
    config: MachineConfig,
    ctl: Arc<Control<F::Clock>>,
    /// The simulation the machine's threads run in (virtual time), if any.
    sim: Option<Arc<dyn SimThreads>>,
    /// Asks running vCPUs to finish at their next check.
    halt: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    pool: Arc<PcpuPool>,
    /// Ring entries reaped by vCPUs on ring-full exits, not yet collected by the host.
    /// (index of the ring = the vCPU, slot, offset).
    reaped: Arc<Mutex<Vec<(usize, SlotId, u64)>>>,
    /// The value [`TestMachine::start_writer`]'s writers write (changed while they run).
    writer_value: Arc<AtomicU64>,
    /// The vCPU threads' kernel ids, for pinning.
    tids: Arc<VcpuTids>,
    /// The private pool's direct map (a confidential guest).
    direct_map: Option<Arc<DirectMap>>,
}

impl<F: PteFormat> Machine<F> {
    /// Maps guest RAM, creates the VM and its memslots, and starts idle vCPU threads.
    pub fn new(config: MachineConfig) -> Result<Self, MachineError> {
        Machine::with_sim(config, None)
    }

    /// [`Machine::new`] whose vCPU threads run in a simulation (`F::Clock` virtual): each is
    /// registered with `sim` before it starts. Call it on a thread that is itself registered
    /// (the host CPU).
    pub fn with_sim(
        config: MachineConfig,
        sim: Option<Arc<dyn SimThreads>>,
    ) -> Result<Self, MachineError> {
        Tlb::check_entries(config.tlb_entries)?;
        let size = RegionSize::new(
            config.region.vcpus,
            config.region.bytes_per_vcpu,
            config.region.slots,
        )?;
        let (total, per_slot) = (size.total, size.per_slot);
        let pages = total >> PAGE_SHIFT;
        let psize = config.region.backing.page_size();
        let ram_len = total.div_ceil(psize).checked_mul(psize).ok_or_else(|| {
            MachineError::Config(format!("{total:#x} bytes of guest memory overflow 64 bits"))
        })?;
        // A confidential guest's pages come from its private pool (prefaulted instead): the
        // shared RAM is only touched by shared accesses.
        let ram = Arc::new(GuestRam::new(
            config.region.backing,
            ram_len,
            config.region.prefault && config.private.is_none(),
        )?);
        // KVM's memstress puts the test region at the top of the guest physical address space,
        // aligned down to the backing page size.
        let gpa = region_gpa::<F>(config.gpa, psize, pages, total)?;
        let vm = Vm::<F>::new(config.vm);
        vm.set_manual_dirty_log_protect(config.region.dirty.manual_protect)?;
        if config.region.dirty.ring_entries != 0 {
            vm.enable_dirty_ring(
                config.region.dirty.ring_entries,
                config.region.dirty.ring_with_bitmap,
            )?;
        }
        let phantom = config.region.backing.is_phantom();
        let private = |dm| private_pool(dm, ram_len, config.region.prefault, phantom);
        let direct_map = config.private.map(private).transpose()?;
        add_slots(
            &vm,
            &ram,
            direct_map.as_ref(),
            gpa,
            config.region.slots,
            per_slot,
        )?;
        if direct_map.is_some() {
            // A confidential guest starts with all of its memory private and unaccepted.
            vm.set_memory_attributes(Gpa::new(gpa).gfn(), pages, MemoryAttributes::PRIVATE)?;
        }
        let layout = size.layout(gpa, ram.addr(), config.region.overlap);
        let pcpus = if config.pcpus == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            config.pcpus
        };
        let pool = Arc::new(PcpuPool::new(pcpus));
        let ctl = Arc::new(Control::<F::Clock>::new(config.region.vcpus)?);
        let mut m = Machine {
            vm,
            ram,
            region: TestRegion {
                layout,
                slots: config.region.slots,
                dirty: config.region.dirty,
            },
            config,
            ctl,
            halt: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
            pool,
            reaped: Arc::new(Mutex::new(Vec::new())),
            writer_value: Arc::new(AtomicU64::new(0)),
            tids: Arc::new(VcpuTids::new(config.region.vcpus)?),
            direct_map,
            sim,
        };
        m.start_vcpus()?;
        Ok(m)
    }

    /// Starts one thread per vCPU; they wait at the start barrier. On an error the threads
    /// already started are released and joined ([`Machine::abandon_started`]).
    fn start_vcpus(&mut self) -> Result<(), MachineError> {
        for i in 0..self.config.region.vcpus {
            if let Err(e) = self.start_vcpu(i) {
                self.abandon_started();
                return Err(e);
            }
        }
        Ok(())
    }

    /// The start barrier can never fill once a vCPU thread cannot be started: abandon it, so
    /// the threads already waiting there exit, and join them. Leaving them would keep their
    /// stacks and arenas for the life of the process (which a caller that goes on after the
    /// error, such as a sweep, runs out of).
    fn abandon_started(&mut self) {
        self.ctl.abandon();
        self.join_vcpu_threads();
    }

    /// Joins the vCPU threads, told to exit. A simulated host steps out while it joins: the
    /// exiting threads need turns.
    fn join_vcpu_threads(&mut self) {
        let threads = std::mem::take(&mut self.threads);
        if let Some(sim) = &self.sim {
            sim.step_out();
        }
        for t in threads {
            let _ = t.join();
        }
        if let Some(sim) = &self.sim {
            sim.step_in();
        }
    }

    /// Builds vCPU `i` and spawns its thread.
    fn start_vcpu(&mut self, i: usize) -> Result<(), MachineError> {
        let config = self.config;
        let layout = self.region.layout;
        let mut cpu = Cpu::new(
            self.vm.clone(),
            i as u32,
            config.tlb_entries,
            self.pool.clone(),
        )?;
        if self.ram.is_phantom() {
            cpu.set_phantom(HostRange::new(self.ram.clone())?);
        }
        if let Some(map) = &self.direct_map {
            let pool = map.pool();
            cpu.set_private(true);
            cpu.set_private_pool(pool.addr().raw(), pool.addr().raw() + pool.len());
            cpu.attach_host_cpu(map.host_cpu());
        }
        if config.region.dirty.ring_entries != 0 {
            cpu.set_ring_full_handler(self.ring_full_handler());
        }
        let (ctl, halt, tids) = (self.ctl.clone(), self.halt.clone(), self.tids.clone());
        // Registered right before the spawn, in vCPU order (the simulation's tie order).
        let mut token = match &self.sim {
            Some(sim) => Some(
                sim.register(&format!("vcpu{i}"))
                    .map_err(MachineError::Config)?,
            ),
            None => None,
        };
        let h = std::thread::Builder::new()
            .name(format!("vcpu{i}"))
            .spawn(move || {
                if let Some(t) = token.as_mut() {
                    t.attach();
                }
                tids.publish(i);
                vcpu_thread(cpu, i, layout, &ctl, &halt);
                drop(token);
            })
            .map_err(MachineError::Thread)?;
        self.threads.push(h);
        Ok(())
    }

    /// The engine.
    pub fn vm(&self) -> &Arc<Vm<F>> {
        &self.vm
    }

    /// The host direct map over the private pool, for a confidential guest
    /// ([`MachineConfig::private`]).
    pub fn direct_map(&self) -> Option<&Arc<DirectMap>> {
        self.direct_map.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &MachineConfig {
        &self.config
    }

    /// Where the test region is.
    pub fn layout(&self) -> Layout {
        self.region.layout
    }

    /// Guest RAM.
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// The first 8 bytes of page `page` of the test region (atomically; vCPUs may be
    /// writing). `None` past the end, and for phantom memory, which keeps no data (whatever
    /// checks data refuses it first: [`GuestRam::is_phantom`]).
    pub fn page_value(&self, page: u64) -> Option<u64> {
        let off = page.checked_mul(PAGE_SIZE)?;
        let real = !self.ram.is_phantom();
        (real && page < self.region.layout.total_pages() && off < self.ram.len()).then(|| {
            // SAFETY: `off` lies inside guest RAM (checked above), which `self` keeps mapped;
            // the address is page aligned, and the word is accessed atomically because vCPUs
            // may write it.
            unsafe { AtomicU64::from_ptr((self.ram.addr() + off) as *mut u64) }
                .load(Ordering::Relaxed)
        })
    }

    /// Physical CPUs vCPUs are scheduled on.
    pub fn pcpus(&self) -> usize {
        self.pool.total()
    }

    /// Runs one memstress pass on every vCPU and waits for all of them (GUEST_SYNC).
    pub fn run_pass(&self, params: PassParams) -> Result<PassReport, MachineError> {
        self.run(Workload::Pass(params))
    }

    /// Runs a workload that ends by itself (a pass, a page-table-test stage) on every vCPU and
    /// waits for all of them.
    pub fn run(&self, w: Workload) -> Result<PassReport, MachineError> {
        let t0 = F::Clock::now_ns();
        self.start(w)?;
        self.wait(t0)
    }

    /// Starts `w` on every vCPU and returns at once; [`Self::halt`] stops it (a `Pass` also
    /// ends by itself, and `halt` then just collects it).
    pub fn start(&self, w: Workload) -> Result<(), MachineError> {
        if !self.ctl.claim() {
            return Err(MachineError::Busy("a workload is already running"));
        }
        self.halt.store(false, Ordering::SeqCst);
        self.ctl.release(w);
        Ok(())
    }

    /// Asks the running workload to stop at the vCPUs' next check and waits for every vCPU to
    /// leave guest mode.
    pub fn halt(&self) -> Result<PassReport, MachineError> {
        if !self.ctl.running() {
            return Err(MachineError::Busy("no workload is running"));
        }
        let t0 = F::Clock::now_ns();
        self.halt.store(true, Ordering::SeqCst);
        self.wait(t0)
    }

    /// Collects the running workload; its time runs from `t0` (`F::Clock::now_ns`: the host's
    /// clock in real time, the host CPU's in virtual time).
    fn wait(&self, t0: u64) -> Result<PassReport, MachineError> {
        let (results, wall) = self
            .ctl
            .collect_with(|| Duration::from_nanos(F::Clock::now_ns().saturating_sub(t0)));
        let mut results =
            results.map_err(|(vcpu, exit)| MachineError::UnexpectedExit { vcpu, exit })?;
        // Every vCPU ran the same workload: all timed (one histogram each, in vCPU order) or
        // none (an empty Vec, which allocates nothing).
        let latency = results
            .iter_mut()
            .filter_map(|r| r.latency.take())
            .collect();
        Ok(PassReport {
            wall,
            vcpus: results.iter().map(|r| r.pass).collect(),
            latency,
        })
    }

    /// The ids of the test region's memslots, in guest-address order.
    pub fn slot_ids(&self) -> impl Iterator<Item = SlotId> {
        FIRST_SLOT..FIRST_SLOT + self.config.region.slots as u32
    }

    /// Pages per memslot.
    pub fn pages_per_slot(&self) -> u64 {
        self.region.layout.total_pages() / self.config.region.slots as u64
    }

    /// Turns dirty logging on or off on every memslot of the test region.
    pub fn set_dirty_logging(&self, on: bool) -> Result<(), MachineError> {
        let flags = if on {
            MemslotFlags::LOG_DIRTY_PAGES
        } else {
            MemslotFlags::empty()
        };
        for id in self.slot_ids() {
            self.vm.set_memslot_flags(id, flags)?;
        }
        Ok(())
    }

    /// Takes every dirty-ring entry not yet collected: first those vCPUs reaped on ring-full
    /// exits, then each ring's. Calls `f(slot, offset)` per entry; returns how many. Follow
    /// with `vm().reset_dirty_rings()` before reading the pages.
    pub fn collect_dirty_rings(&self, mut f: impl FnMut(SlotId, u64)) -> u64 {
        // The reaped list's lock is held until every ring is harvested: an exit handler that
        // took entries between our take and our harvest would leave them for the next collect.
        let mut reaped = self.reaped.lock();
        let mut n = reaped.len() as u64;
        for (_, s, o) in reaped.drain(..) {
            f(s, o);
        }
        for r in self.vm.dirty_rings() {
            n += r.harvest(|s, o| f(s, o.raw())) as u64;
        }
        n
    }

    /// What a vCPU does on a ring-full exit, like QEMU's vCPU thread when the reaper lags:
    /// harvest every ring into the machine's reaped list and reset them, holding the list's
    /// lock throughout (see [`Machine::collect_dirty_rings`]).
    fn ring_full_handler(&self) -> RingFullHandler {
        let vm = self.vm.clone();
        let reaped = self.reaped.clone();
        Arc::new(move || {
            let mut out = reaped.lock();
            for (i, r) in vm.dirty_rings().iter().enumerate() {
                r.harvest(|s, o| out.push((i, s, o.raw())));
            }
            // The ring is enabled (we were installed because it is): cannot be RingOff.
            let _ = vm.reset_dirty_rings();
        })
    }
}

impl<F: PteFormat> Drop for Machine<F> {
    fn drop(&mut self) {
        if self.threads.is_empty() {
            return;
        }
        self.ctl.stop(|| drop(self.halt()));
        self.join_vcpu_threads();
    }
}

fn vcpu_thread<F: PteFormat>(
    mut cpu: Cpu<F>,
    idx: usize,
    layout: Layout,
    ctl: &Control<F::Clock>,
    halt: &AtomicBool,
) {
    while let Some(w) = ctl.next_job() {
        let (gpa, _, pages) = layout.region(idx);
        let before = cpu.counters;
        if w.timed() {
            // Allocated here, on the vCPU thread that fills it, before the clock starts.
            cpu.start_timing();
        }
        let t0 = F::Clock::now_ns();
        cpu.enter();
        let r = run_workload(&mut cpu, &w, gpa, pages, idx as u32, halt);
        cpu.exit();
        let time = Duration::from_nanos(F::Clock::now_ns().saturating_sub(t0));
        let latency = cpu.take_latency();
        let c = cpu.counters;
        let r = r.map(|(touched, passes)| VcpuResult {
            pass: pass_of(time, touched, passes, before, c),
            latency,
        });
        // `idx` is this thread's own index, below the count the rendezvous was built for.
        let _ = ctl.report(idx, r);
    }
    cpu.destroy();
}

/// A vCPU's part of a workload: what it did and its counters' growth from `before` to `c`.
fn pass_of(
    time: Duration,
    touched: u64,
    passes: u64,
    before: CpuCounters,
    c: CpuCounters,
) -> VcpuPass {
    VcpuPass {
        time,
        pages: touched,
        passes,
        ring_full_exits: c.ring_full_exits - before.ring_full_exits,
        counters: CpuCounters {
            accesses: c.accesses - before.accesses,
            walks: c.walks - before.walks,
            faults: c.faults - before.faults,
            tlb_flushes: c.tlb_flushes - before.tlb_flushes,
            ad_updates: c.ad_updates - before.ad_updates,
            ring_full_exits: c.ring_full_exits - before.ring_full_exits,
            stale_walks: c.stale_walks - before.stale_walks,
            tlb_conflicts: c.tlb_conflicts - before.tlb_conflicts,
            kernel_tlb_flushes: c.kernel_tlb_flushes - before.kernel_tlb_flushes,
        },
    }
}

/// Runs one workload on a vCPU in guest mode; returns (pages touched, full passes).
fn run_workload<F: PteFormat>(
    cpu: &mut Cpu<F>,
    w: &Workload,
    gpa: u64,
    pages: u64,
    idx: u32,
    halt: &AtomicBool,
) -> Result<(u64, u64), Exit> {
    match w {
        Workload::Pass(p) => {
            guest_pass(cpu, gpa, pages, *p, idx, None)?;
            Ok((pages, 1))
        }
        Workload::Loop(p) => {
            let (mut touched, mut passes) = (0, 0);
            while !halt.load(Ordering::Relaxed) {
                let n = guest_pass(cpu, gpa, pages, *p, idx, Some(halt))?;
                touched += n;
                passes += (n == pages) as u64;
            }
            Ok((touched, passes))
        }
        Workload::Stage(p) => {
            if p.bytes > pages * PAGE_SIZE {
                return Err(Exit::Mmio {
                    gpa: gpa + pages * PAGE_SIZE,
                });
            }
            // The one workload whose vCPUs all access the same data.
            cpu.set_shared_data(true);
            let r = guest_stage(cpu, gpa, *p, idx);
            cpu.set_shared_data(false);
            Ok((r?, 1))
        }
        Workload::Writer { seed, iteration } => {
            let mut writer = WriterPattern::new(*seed, idx, pages);
            let mut writes = 0u64;
            loop {
                if writes % 64 == 0 && halt.load(Ordering::Relaxed) {
                    return Ok((writes, 0));
                }
                let Some(page) = writer.next() else {
                    return Ok((writes, 0));
                };
                cpu.write_u64(gpa + page * PAGE_SIZE, iteration.load(Ordering::Relaxed))?;
                writes += 1;
            }
        }
        Workload::Paced(p) => crate::paced::run(cpu, p, gpa, pages, idx, halt),
    }
}

impl<F: PteFormat> TestMachine for Machine<F> {
    type Error = MachineError;
    type Counters = CpuCounters;
    type Log<'a> = SimLog<'a, F>;

    fn region(&self) -> &TestRegion {
        &self.region
    }
    fn write_latency(&self) -> slat_workload::WriteLatency {
        slat_workload::WriteLatency::Faults
    }
    fn run_pass(&self, params: PassParams) -> Result<PassReport, MachineError> {
        Machine::run_pass(self, params)
    }
    fn start_loop(&self, params: PassParams) -> Result<(), MachineError> {
        self.start(Workload::Loop(params))
    }
    fn start_writer(&self, seed: u32, value: u64) -> Result<(), MachineError> {
        self.writer_value.store(value, Ordering::SeqCst);
        self.start(Workload::Writer {
            seed,
            iteration: self.writer_value.clone(),
        })
    }
    fn set_writer_value(&self, value: u64) {
        self.writer_value.store(value, Ordering::SeqCst);
    }
    fn halt(&self) -> Result<PassReport, MachineError> {
        Machine::halt(self)
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), MachineError> {
        Machine::set_dirty_logging(self, on)
    }
    fn dirty_log(&self) -> SimLog<'_, F> {
        SimLog { m: self }
    }
    fn page_value(&self, page: u64) -> Option<u64> {
        Machine::page_value(self, page)
    }
    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, MachineError> {
        self.tids.pin(cpus).map_err(MachineError::Thread)
    }
    fn now_ns(&self) -> u64 {
        F::Clock::now_ns()
    }
    fn sleep(&self, d: Duration) {
        match &self.sim {
            Some(sim) => sim.sleep(d),
            None => std::thread::sleep(d),
        }
    }
    fn charge_host_pages(&self, copied: u64, zeroed: u64) {
        // Empty in real time (`RealTime::charge` folds away).
        F::Clock::charge(Cost::PageCopy, copied);
        F::Clock::charge(Cost::ZeroPage, zeroed);
    }
}

/// The private pool of a confidential guest (as big as its RAM, 2 MiB aligned so the direct
/// map can start with huge leaves; phantom too when the guest's RAM is) and the direct map
/// over it.
fn private_pool(
    config: DirectMapConfig,
    len: u64,
    prefault: bool,
    phantom: bool,
) -> Result<Arc<DirectMap>, MachineError> {
    const HUGE: u64 = 2 << 20;
    let len = len.div_ceil(HUGE).checked_mul(HUGE).ok_or_else(|| {
        MachineError::Config(format!("a {len:#x}-byte private pool overflows 64 bits"))
    })?;
    let backing = if phantom {
        slat_workload::Backing::PhantomThp
    } else {
        slat_workload::Backing::AnonymousThp
    };
    let pool = Arc::new(GuestRam::new(backing, len, prefault)?);
    Ok(DirectMap::new(HostRange::new(pool)?, config)?)
}

/// Where the test region starts in guest physical memory: `gpa` if given (checked), else as
/// KVM's memstress puts it.
fn region_gpa<F: PteFormat>(
    gpa: Option<u64>,
    psize: u64,
    pages: u64,
    total: u64,
) -> Result<u64, MachineError> {
    let max_gfn = (1u64 << (F::MAX_PHYS_BITS - PAGE_SHIFT)) - 1;
    let align = psize.max(PAGE_SIZE);
    let gpa = match gpa {
        None => ((max_gfn + 1 - pages - 1) << PAGE_SHIFT) & !(align - 1),
        Some(g) if g % align != 0 => {
            return Err(MachineError::Config(format!(
                "guest physical offset {g:#x} is not aligned to the backing page size \
                 ({align:#x})"
            )))
        }
        Some(g) if (g >> PAGE_SHIFT).saturating_add(pages) > max_gfn + 1 => {
            return Err(MachineError::Config(format!(
                "guest physical offset {g:#x} + {total:#x} bytes exceeds the {}-bit guest \
                 physical address space of {}",
                F::MAX_PHYS_BITS,
                F::NAME
            )))
        }
        Some(g) => g,
    };
    Ok(gpa)
}

/// Adds the region's memslots, each over its share of `ram` (and of the private pool of a
/// confidential guest).
fn add_slots<F: PteFormat>(
    vm: &Vm<F>,
    ram: &Arc<GuestRam>,
    direct_map: Option<&Arc<DirectMap>>,
    gpa: u64,
    slots: usize,
    per_slot: u64,
) -> Result<(), MachineError> {
    for s in 0..slots as u64 {
        let offset = s * per_slot;
        let host = HostRange::slice(ram.clone(), offset, ram.len() - offset)?;
        let id = FIRST_SLOT + s as u32;
        match direct_map {
            Some(map) => {
                let private = map.bind(offset, per_slot)?;
                let flags = MemslotFlags::empty();
                vm.add_memslot_with_private(
                    id,
                    Gpa::new(gpa + offset),
                    per_slot,
                    host,
                    private,
                    flags,
                )?
            }
            None => vm.add_memslot(
                id,
                Gpa::new(gpa + offset),
                per_slot,
                host,
                MemslotFlags::empty(),
            )?,
        }
    }
    Ok(())
}
