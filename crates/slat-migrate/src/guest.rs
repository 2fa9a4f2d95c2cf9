//! The guest a migration moves: a machine (simulated, or real on `/dev/kvm`) with its test
//! region of guest RAM, a workload running on its vCPUs, and its dirty log.
//!
//! [`Guest`] is what the two ends need and nothing more: the shape, the host address of the
//! test region, start/pause of the workload, a throttle, dirty logging on/off and the
//! machine's dirty log as a [`GuestHarvester`] — `slat_dirty`'s transactional harvester, the
//! one a VMM uses on its own KVM VM, over `slat_snapshot::MachineLog` (either machine). (`slat-cli` has a wider `Backend` trait; a library crate cannot
//! depend on the binary's, and migration needs a running workload with a run-time dirty-rate
//! control, which that trait does not have.)
//!
//! The source's vCPUs run the paced memstress of `slat-machine` (every write a new value, at
//! a write rate and throttle changed while it runs). The KVM guest's code has no such control,
//! so a driver thread runs its dirty-log writer in bursts, kicking the vCPUs out between them
//! as QEMU's CPU throttle does: the length of each burst follows the measured write speed so
//! that the average rate matches the one asked for.

use crate::error::{Cause, GuestError, MemoryError, ShapeError};
use crate::stream::{Shape, WorkSpec, PAGE_SIZE};
use slat::{Ept, PteFormat, Stage2, VmConfig};
use slat_dirty::{DirtyLogSource, Harvester, SlotInfo};
use slat_machine::{Backing, Machine, MachineConfig, PacedParams, Pacer, PassParams, Workload};
use slat_workload::{DirtyConfig, RegionSpec, TestMachine, INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Which machine runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The simulated machine on slat's page tables.
    Sim,
    /// A real guest on the host's `/dev/kvm`.
    Kvm,
}

impl BackendKind {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Sim => "sim",
            BackendKind::Kvm => "kvm",
        }
    }
}

/// How the source harvests dirty pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogMode {
    /// GET_DIRTY_LOG clears and re-protects.
    Get,
    /// Manual protect with INITIALLY_SET: GET copies, CLEAR clears and re-protects.
    Clear,
    /// Per-vCPU dirty rings: collect, then reset.
    Ring,
}

impl LogMode {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            LogMode::Get => "get",
            LogMode::Clear => "clear",
            LogMode::Ring => "ring",
        }
    }
}

/// What to build.
#[derive(Debug, Clone, Copy)]
pub struct GuestSpec {
    /// The machine.
    pub backend: BackendKind,
    /// vCPUs, memory, memslots.
    pub shape: Shape,
    /// Host memory behind guest RAM.
    pub backing: Backing,
    /// The dirty log the source harvests (irrelevant on a destination).
    pub log: LogMode,
    /// Dirty ring entries per vCPU with [`LogMode::Ring`].
    pub ring_entries: u32,
    /// Engine switches (simulated machine only).
    pub vm: VmConfig,
    /// Second-stage page-table format (simulated machine only). Memory contents and the stream
    /// do not depend on it, so a guest may move between formats.
    pub stage2: bool,
    /// Software TLB entries per vCPU (simulated machine only).
    pub tlb_entries: usize,
    /// Physical CPUs for the vCPUs, 0 = all (simulated machine only).
    pub pcpus: usize,
    /// Populate host memory at set-up.
    pub prefault: bool,
}

impl GuestSpec {
    /// A simulated guest of `shape` with default switches, logging in `log` mode.
    pub fn sim(shape: Shape, log: LogMode) -> GuestSpec {
        GuestSpec {
            backend: BackendKind::Sim,
            shape,
            backing: Backing::Anonymous,
            log,
            ring_entries: 65536,
            vm: VmConfig::default(),
            stage2: false,
            tlb_entries: slat_machine::tlb::DEFAULT_TLB_ENTRIES,
            pcpus: 0,
            prefault: true,
        }
    }
}

/// What a migration needs from a machine.
///
/// # Safety
///
/// [`Memory`] reads and writes guest memory through [`Guest::host_base`] without further
/// checks, so an implementor guarantees: `[host_base(), host_base() + pages() * 4 KiB)` is
/// mapped readable and writable, 8-byte aligned, and stays so for as long as the guest lives;
/// the guest's own code accesses its bytes only atomically (or, for a KVM vCPU, by hardware
/// outside the program) and never lends them out as references, so [`Memory`]'s atomic
/// accesses race with nothing; and [`Guest::running`] is true whenever any vCPU may write that
/// memory.
pub unsafe trait Guest: Send + Sync {
    /// The machine kind.
    fn backend(&self) -> BackendKind;
    /// vCPUs, memory and memslots.
    fn shape(&self) -> Shape;
    /// The log mode harvests use.
    fn log_mode(&self) -> LogMode;
    /// Host address of the test region: [`Guest::pages`] pages, contiguous, mapped as long
    /// as the guest lives.
    fn host_base(&self) -> u64;
    /// Pages of the test region as the machine mapped them: the bound every page index is
    /// checked against before guest memory is read or written.
    fn pages(&self) -> u64;
    /// Turns dirty logging on or off on every test memslot.
    fn set_dirty_logging(&self, on: bool) -> Result<(), GuestError>;
    /// A harvester of the test region's dirty log (one tracked slot per memslot, in
    /// guest-address order, covering [`Guest::pages`] together), in the machine's log mode.
    /// Its takes re-arm the log before they return; a set dropped uncommitted is owed again.
    fn dirty_log(&self) -> Result<GuestHarvester, GuestError>;
    /// Starts `work` on every vCPU (returns at once).
    fn start(&self, work: WorkSpec) -> Result<(), GuestError>;
    /// Stops the vCPUs (out of guest mode) and waits for them.
    fn pause(&self) -> Result<(), GuestError>;
    /// Whether a workload is running.
    fn running(&self) -> bool;
    /// Sets the throttle: percent of time the vCPUs are kept out of the guest.
    fn set_throttle(&self, percent: u32);
    /// The throttle now.
    fn throttle(&self) -> u32;
    /// vCPU time spent asleep because of the throttle, summed over vCPUs, since creation.
    fn throttled(&self) -> Duration;
    /// Guest writes since creation (a little behind while running).
    fn writes(&self) -> u64;
    /// One sequential write pass over every page (maps guest memory, as a booted guest has).
    fn populate(&self) -> Result<(), GuestError>;
}

/// Builds the machine `spec` asks for.
///
/// The shape is checked first ([`Shape::check`]: vCPU and memslot counts, checked products,
/// the guest physical address space), so a machine is only ever built — and memory only ever
/// mapped — for a shape whose sizes add up.
pub fn build(spec: &GuestSpec) -> Result<Arc<dyn Guest>, GuestError> {
    let s = spec.shape;
    let pages = s.check()?;
    let dirty = match spec.log {
        LogMode::Get => DirtyConfig::default(),
        LogMode::Clear => DirtyConfig {
            manual_protect: MANUAL_PROTECT_ENABLE | INITIALLY_SET,
            ..DirtyConfig::default()
        },
        LogMode::Ring => DirtyConfig {
            ring_entries: spec.ring_entries,
            ..DirtyConfig::default()
        },
    };
    let region = RegionSpec {
        backing: spec.backing,
        vcpus: s.vcpus as usize,
        bytes_per_vcpu: s.bytes_per_vcpu,
        slots: s.slots as usize,
        overlap: s.overlap,
        prefault: spec.prefault,
        dirty,
    };
    match spec.backend {
        BackendKind::Sim => {
            let config = MachineConfig {
                vm: spec.vm,
                region,
                tlb_entries: spec.tlb_entries,
                pcpus: spec.pcpus,
                ..MachineConfig::default()
            };
            if spec.stage2 {
                sim_guest::<Stage2>(config, s, pages, spec.log)
            } else {
                sim_guest::<Ept>(config, s, pages, spec.log)
            }
        }
        BackendKind::Kvm => {
            let m = slat_kvm::KvmMachine::new(slat_kvm::KvmConfig {
                region,
                ..slat_kvm::KvmConfig::default()
            })
            .map_err(GuestError::machine)?;
            let l = m.layout();
            let mapped = l.bytes_per_vcpu.checked_mul(l.vcpus as u64);
            if mapped != Some(pages * PAGE_SIZE as u64) {
                return Err(MemoryError::Mapped { pages, mapped }.into());
            }
            Ok(Arc::new(MachineGuest {
                m: Arc::new(m),
                shape: s,
                pages,
                log: spec.log,
                driver: BurstDriver::default(),
            }))
        }
    }
}

/// A guest's dirty log as the source harvests it: any machine's, errors as [`GuestError`].
pub type GuestLog = Box<dyn DirtyLogSource<Error = GuestError> + Send>;

/// The transactional harvester of a guest's dirty log ([`Guest::dirty_log`]).
pub type GuestHarvester = Harvester<GuestLog>;

/// A dirty-log source whose errors become [`GuestError`]s, so every machine's log has the one
/// type [`GuestLog`].
struct GuestErrors<S>(S);

impl<S> DirtyLogSource for GuestErrors<S>
where
    S: DirtyLogSource,
    S::Error: std::error::Error + Send + Sync + 'static,
{
    type Error = GuestError;

    fn slots(&self) -> Vec<SlotInfo> {
        self.0.slots()
    }
    fn mode(&self) -> slat_dirty::LogMode {
        self.0.mode()
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), GuestError> {
        self.0.get_log(slot, bitmap).map_err(GuestError::machine)
    }
    fn clear_log(
        &mut self,
        slot: usize,
        first_page: u64,
        pages: u64,
        bitmap: &[u64],
    ) -> Result<(), GuestError> {
        self.0
            .clear_log(slot, first_page, pages, bitmap)
            .map_err(GuestError::machine)
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, u64)) -> Result<u64, GuestError> {
        self.0.collect_ring(f).map_err(GuestError::machine)
    }
    fn reset_rings(&mut self) -> Result<u64, GuestError> {
        self.0.reset_rings().map_err(GuestError::machine)
    }
}

fn sim_guest<F: PteFormat>(
    config: MachineConfig,
    shape: Shape,
    pages: u64,
    log: LogMode,
) -> Result<Arc<dyn Guest>, GuestError> {
    // `Shape::check` bounded the memory by a 48-bit space; a format with fewer bits would
    // place the region below address 0.
    let fits = pages < 1u64 << (F::MAX_PHYS_BITS - crate::stream::PAGE_SIZE.trailing_zeros());
    if !fits {
        return Err(ShapeError::AddressSpace {
            pages,
            format: F::NAME,
            bits: F::MAX_PHYS_BITS,
        }
        .into());
    }
    let m = Machine::<F>::new(config).map_err(GuestError::machine)?;
    // Every index is checked against `pages`; make sure the mapping really holds them.
    if m.ram().len() < pages * PAGE_SIZE as u64 {
        return Err(MemoryError::Mapped {
            pages,
            mapped: Some(m.ram().len()),
        }
        .into());
    }
    Ok(Arc::new(MachineGuest {
        m: Arc::new(m),
        pages,
        shape,
        log,
        driver: PacedDriver {
            pacer: Pacer::new(0),
            running: AtomicBool::new(false),
        },
    }))
}

/// A machine running a migration's workload: what both machines share, over
/// [`TestMachine`]; `D` runs the workload the way the machine can.
struct MachineGuest<M, D: Driver<M>> {
    m: Arc<M>,
    pages: u64,
    shape: Shape,
    log: LogMode,
    driver: D,
}

/// How a guest's workload runs on machine `M`: the part of [`Guest`] the two machines do
/// differently.
trait Driver<M>: Send + Sync {
    /// The machine kind.
    const BACKEND: BackendKind;
    /// Starts `work` on `m`'s vCPUs (returns at once).
    fn start(&self, m: &Arc<M>, shape: Shape, work: WorkSpec) -> Result<(), GuestError>;
    /// Stops the vCPUs and waits for them.
    fn pause(&self, m: &M) -> Result<(), GuestError>;
    /// Whether a workload is running.
    fn running(&self) -> bool;
    /// The throttle and write count of the workload.
    fn pacing(&self) -> &dyn Pacing;
}

/// The controls and counters of a running migration workload.
trait Pacing: Send + Sync {
    /// Sets the throttle (percent of time kept out of the guest).
    fn set_throttle(&self, percent: u32);
    /// The throttle now.
    fn throttle(&self) -> u32;
    /// vCPU time spent asleep because of the throttle, summed over vCPUs.
    fn throttled(&self) -> Duration;
    /// Guest writes since creation.
    fn writes(&self) -> u64;
}

impl Pacing for Pacer {
    fn set_throttle(&self, percent: u32) {
        Pacer::set_throttle(self, percent)
    }
    fn throttle(&self) -> u32 {
        Pacer::throttle(self)
    }
    fn throttled(&self) -> Duration {
        Pacer::throttled(self)
    }
    fn writes(&self) -> u64 {
        Pacer::writes(self)
    }
}

/// A [`TestMachine`] whose test region is memory it owns for as long as it lives.
///
/// # Safety
///
/// `[layout().host, layout().host + layout().total_pages() * 4 KiB)` is a read/write mapping,
/// page aligned, owned by the machine and mapped until it is dropped, whose bytes are never
/// lent out as references; and no vCPU writes it unless a workload started through the machine
/// is running.
unsafe trait OwnsTestRegion: TestMachine {}

// SAFETY: the test region is the machine's `GuestRam` (mapped, page aligned, never lent out as
// references), owned by the machine and unmapped only when it drops; the vCPU threads run only
// between a start and the halt that collects it.
unsafe impl<F: PteFormat> OwnsTestRegion for Machine<F> {}

// SAFETY: the test region is the KVM machine's own `GuestRam` mapping, unmapped only after its
// vCPU threads are joined and the VM closed; the guest runs only between a start and the halt
// that collects it.
unsafe impl OwnsTestRegion for slat_kvm::KvmMachine {}

// SAFETY: `host_base` and `pages` describe the machine's own test region (`OwnsTestRegion`;
// `build` checked that the mapping holds `pages` pages), which lives as long as this guest
// holds the machine; `running` is true whenever the driver has a workload running.
unsafe impl<M, D> Guest for MachineGuest<M, D>
where
    M: OwnsTestRegion + Send + Sync + 'static,
    D: Driver<M>,
{
    fn backend(&self) -> BackendKind {
        D::BACKEND
    }
    fn shape(&self) -> Shape {
        self.shape
    }
    fn log_mode(&self) -> LogMode {
        self.log
    }
    fn host_base(&self) -> u64 {
        self.m.layout().host
    }
    fn pages(&self) -> u64 {
        self.pages
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), GuestError> {
        TestMachine::set_dirty_logging(&*self.m, on).map_err(GuestError::machine)
    }
    fn dirty_log(&self) -> Result<GuestHarvester, GuestError> {
        let log = slat_snapshot::MachineLog::new(self.m.clone());
        // `build` chose the machine's dirty configuration from `self.log`, so the log's mode
        // is that one.
        Harvester::from_source(Box::new(GuestErrors(log)) as GuestLog).map_err(GuestError::harvest)
    }
    fn start(&self, work: WorkSpec) -> Result<(), GuestError> {
        self.driver.start(&self.m, self.shape, work)
    }
    fn pause(&self) -> Result<(), GuestError> {
        self.driver.pause(&self.m)
    }
    fn running(&self) -> bool {
        self.driver.running()
    }
    fn set_throttle(&self, percent: u32) {
        self.driver.pacing().set_throttle(percent)
    }
    fn throttle(&self) -> u32 {
        self.driver.pacing().throttle()
    }
    fn throttled(&self) -> Duration {
        self.driver.pacing().throttled()
    }
    fn writes(&self) -> u64 {
        self.driver.pacing().writes()
    }
    fn populate(&self) -> Result<(), GuestError> {
        TestMachine::run_pass(&*self.m, PassParams::default())
            .map(drop)
            .map_err(GuestError::machine)
    }
}

impl<M, D: Driver<M>> Drop for MachineGuest<M, D> {
    fn drop(&mut self) {
        let _ = self.driver.pause(&self.m);
    }
}

/// The simulated machine's vCPUs run the paced memstress, whose rate and throttle the host
/// changes while it runs.
struct PacedDriver {
    pacer: Arc<Pacer>,
    running: AtomicBool,
}

impl<F: PteFormat> Driver<Machine<F>> for PacedDriver {
    const BACKEND: BackendKind = BackendKind::Sim;

    fn start(&self, m: &Arc<Machine<F>>, _shape: Shape, work: WorkSpec) -> Result<(), GuestError> {
        self.pacer.set_rate(work.rate);
        m.start(Workload::Paced(PacedParams {
            pass: PassParams {
                write_percent: work.write_percent,
                random: work.random,
                seed: work.seed,
                timed: false,
            },
            pacer: self.pacer.clone(),
        }))
        .map_err(GuestError::machine)?;
        self.running.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn pause(&self, m: &Machine<F>) -> Result<(), GuestError> {
        if !self.running.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        m.halt().map(drop).map_err(GuestError::machine)
    }
    fn running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }
    fn pacing(&self) -> &dyn Pacing {
        &*self.pacer
    }
}

impl Pacing for BurstControl {
    fn set_throttle(&self, percent: u32) {
        self.throttle.store(percent.min(99), Ordering::Relaxed);
    }
    fn throttle(&self) -> u32 {
        self.throttle.load(Ordering::Relaxed)
    }
    fn throttled(&self) -> Duration {
        Duration::from_nanos(self.throttled_ns.load(Ordering::Relaxed))
    }
    fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }
}

/// Controls shared with the KVM burst driver.
#[derive(Debug, Default)]
struct BurstControl {
    /// Writes per second per vCPU (0: unlimited).
    rate: AtomicU64,
    throttle: AtomicU32,
    stop: AtomicBool,
    writes: AtomicU64,
    throttled_ns: AtomicU64,
    error: Mutex<Option<slat_kvm::KvmError>>,
}

/// A real guest on `/dev/kvm`: the guest's code has no rate control, so a driver thread runs
/// its writer in bursts.
#[derive(Default)]
struct BurstDriver {
    ctl: Arc<BurstControl>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The driver's cycle under a throttle without a rate limit.
const BURST_PERIOD: Duration = Duration::from_millis(20);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl BurstDriver {
    /// Runs the writer in bursts until told to stop.
    ///
    /// Without a rate limit or throttle the guest simply runs. Under a throttle alone, each
    /// 20 ms period runs the guest for (100 - t)% of it. Under a rate limit the driver keeps
    /// an allowance (rate × vCPUs × the unthrottled share, accrued over time) and runs a burst
    /// only while the guest has written less than it; a burst is as long as the deficit at
    /// the measured write speed. On this kind of host the guest writes ~10^8 pages/s and one
    /// start/stop cycle costs 0.2–7 ms, so the smallest burst is already 10^4-10^6 writes:
    /// writes come in lumps, and a low rate is exceeded (see the bound on the debt below).
    fn drive(m: Arc<slat_kvm::KvmMachine>, ctl: Arc<BurstControl>, seed: u32, vcpus: u64) {
        let mut burst = 0u64;
        // Writes per second of all vCPUs while they run (learnt from each burst).
        let mut speed: f64 = 0.0;
        let mut allowance: f64 = 0.0;
        let mut last = Instant::now();
        let mut r = || -> Result<(), slat_kvm::KvmError> {
            let mut run = |on: Duration| -> Result<(u64, Duration), slat_kvm::KvmError> {
                burst += 1;
                // Each burst stamps a value no burst wrote before, so rewriting a page
                // changes it.
                let t0 = Instant::now();
                m.start(slat_kvm::Workload::Writer {
                    seed: seed.wrapping_add((burst as u32).wrapping_mul(0x9e37_79b9)),
                    iteration: (0x4b << 56) | burst,
                })?;
                if on.is_zero() {
                    // Unpaced: run until something changes.
                    while !ctl.stop.load(Ordering::Relaxed)
                        && ctl.rate.load(Ordering::Relaxed) == 0
                        && ctl.throttle.load(Ordering::Relaxed) == 0
                    {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                } else {
                    std::thread::sleep(on.saturating_sub(t0.elapsed()));
                }
                let w: u64 = m.halt()?.vcpus.iter().map(|v| v.pages).sum();
                ctl.writes.fetch_add(w, Ordering::Relaxed);
                Ok((w, t0.elapsed()))
            };
            while !ctl.stop.load(Ordering::Relaxed) {
                let rate = ctl.rate.load(Ordering::Relaxed);
                let throttle = ctl.throttle.load(Ordering::Relaxed).min(99);
                let now = Instant::now();
                let dt = now.duration_since(last);
                last = now;
                if throttle != 0 {
                    ctl.throttled_ns.fetch_add(
                        (dt.as_nanos() as u64 * throttle as u64 / 100) * vcpus,
                        Ordering::Relaxed,
                    );
                }
                if rate == 0 && throttle == 0 {
                    run(Duration::ZERO)?;
                    allowance = 0.0;
                    continue;
                }
                if rate == 0 {
                    let t0 = Instant::now();
                    run(BURST_PERIOD * (100 - throttle) / 100)?;
                    nap(&ctl, BURST_PERIOD.saturating_sub(t0.elapsed()));
                    continue;
                }
                // The throttle slows the guest: it earns that share less of its writes.
                allowance +=
                    rate as f64 * vcpus as f64 * dt.as_secs_f64() * (100 - throttle) as f64 / 100.0;
                // Do not bank more than a second of writes (e.g. across a long pause).
                allowance = allowance.min(rate as f64 * vcpus as f64);
                if allowance < 1.0 {
                    let wait = (1.0 - allowance) / (rate as f64 * vcpus as f64);
                    nap(&ctl, Duration::from_secs_f64(wait.min(0.002)));
                    continue;
                }
                let on = if speed > 0.0 {
                    Duration::from_secs_f64(allowance / speed).min(BURST_PERIOD)
                } else {
                    // First burst: as short as possible, to learn the speed.
                    Duration::from_micros(1)
                };
                let (w, ran) = run(on.max(Duration::from_micros(1)))?;
                // A lump (a slow cycle, e.g. the first entry into a fresh guest, can let
                // 10^5-10^6 writes through) is paid back for at most 250 ms: the guest does
                // not stall for seconds, at the price of a higher average than asked when
                // every cycle overshoots. The reports measure the rate the guest really had.
                allowance = (allowance - w as f64).max(-0.25 * rate as f64 * vcpus as f64);
                if w > 0 {
                    let s = w as f64 / ran.as_secs_f64();
                    speed = if speed <= 0.0 {
                        s
                    } else {
                        0.7 * speed + 0.3 * s
                    };
                }
            }
            Ok(())
        };
        if let Err(e) = r() {
            *lock(&ctl.error) = Some(e);
        }
    }
}

/// Sleeps `d` in short steps, ending early when the driver is told to stop.
fn nap(ctl: &BurstControl, d: Duration) {
    let end = Instant::now() + d;
    while !ctl.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= end {
            break;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(2)));
    }
}

impl Driver<slat_kvm::KvmMachine> for BurstDriver {
    const BACKEND: BackendKind = BackendKind::Kvm;

    fn start(
        &self,
        m: &Arc<slat_kvm::KvmMachine>,
        shape: Shape,
        work: WorkSpec,
    ) -> Result<(), GuestError> {
        let mut d = lock(&self.thread);
        if d.is_some() {
            return Err(GuestError::AlreadyRunning);
        }
        if work.write_percent != 100 {
            return Err(GuestError::KvmReads);
        }
        self.ctl.rate.store(work.rate, Ordering::Relaxed);
        self.ctl.stop.store(false, Ordering::Relaxed);
        *lock(&self.ctl.error) = None;
        let (m, ctl) = (m.clone(), self.ctl.clone());
        let vcpus = shape.vcpus as u64;
        let seed = work.seed;
        let h = std::thread::Builder::new()
            .name("kvm-burst".into())
            .spawn(move || BurstDriver::drive(m, ctl, seed, vcpus))
            .map_err(|e| GuestError::DriverThread(Cause::new(e)))?;
        *d = Some(h);
        Ok(())
    }
    fn pause(&self, _m: &slat_kvm::KvmMachine) -> Result<(), GuestError> {
        let Some(h) = lock(&self.thread).take() else {
            return Ok(());
        };
        self.ctl.stop.store(true, Ordering::Relaxed);
        if h.join().is_err() {
            return Err(GuestError::DriverPanicked);
        }
        match lock(&self.ctl.error).take() {
            Some(e) => Err(GuestError::machine(e)),
            None => Ok(()),
        }
    }
    fn running(&self) -> bool {
        lock(&self.thread).is_some()
    }
    fn pacing(&self) -> &dyn Pacing {
        &*self.ctl
    }
}

/// Guest RAM of the test region, read and written by the host.
///
/// Every access goes through relaxed atomic loads and stores of aligned 8-byte words, and
/// nothing here hands out a reference into guest memory. That is what keeps it sound from
/// safe code: a vCPU storing to a page (atomically, as [`Guest`]'s contract requires), or
/// another thread's `Memory` writing it, races with nothing here in the language's sense;
/// at worst a copy holds a mix of old and new words, which the dirty log (during pre-copy)
/// and the verification (at switch-over) account for.
///
/// The `stopped_*` methods also check that no vCPU runs: not for soundness but for meaning
/// (a hash or a received page is only right for memory that does not change meanwhile).
///
/// Why copy out rather than lend `&[u8]` over guest memory: a slice would need the guest to
/// stay stopped, and no other writer to run, for as long as it lives. A `running()` check when
/// it is made does not ensure that (another holder of the `Arc<dyn Guest>` can start the vCPUs
/// a moment later, and a data race on memory behind a shared reference is undefined
/// behaviour); a guard blocking `Guest::start` would put a lock into every machine and a
/// deadlock into any caller that forgot to drop it; an `unsafe fn` would move the problem to
/// every caller. A copy of one verification range (256 KiB, reused) costs a cache-resident
/// memcpy beside the BLAKE3 hash of the same bytes, and misuse is then impossible.
pub struct Memory<'g> {
    guest: &'g dyn Guest,
    base: u64,
    pages: u64,
}

impl<'g> Memory<'g> {
    /// The test region of `guest`: as many pages as its machine mapped ([`Guest::pages`]).
    pub fn new(guest: &'g dyn Guest) -> Memory<'g> {
        Memory {
            guest,
            base: guest.host_base(),
            pages: guest.pages(),
        }
    }

    /// Pages in the region.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Host address of page `first`, for an access to pages `first..end`, or why there is
    /// none.
    fn page_addr(&self, first: u64, end: u64) -> Result<u64, MemoryError> {
        if first > end || end > self.pages {
            return Err(MemoryError::OutOfRange {
                first,
                end,
                pages: self.pages,
            });
        }
        // `first <= pages`, and `pages` pages are mapped at `base`: no overflow.
        Ok(self.base + first * PAGE_SIZE as u64)
    }

    /// Copies pages `first..end` into `out` (exactly their size) word by word, whether or not
    /// vCPUs run.
    fn load_pages(&self, first: u64, end: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        let addr = self.page_addr(first, end)?;
        // `first <= end <= pages`, whose bytes fit the 48-bit guest space: no overflow.
        let want = (end - first) * PAGE_SIZE as u64;
        if out.len() as u64 != want {
            return Err(MemoryError::RangeBuffer {
                len: out.len(),
                want,
            });
        }
        let src = addr as *const u64;
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            // SAFETY: `[addr, addr + out.len())` is pages `first..end` of the test region
            // (checked above against the pages the machine mapped), which stays mapped while
            // the guest (borrowed by `self`) lives; `addr` is page aligned and
            // `i * 8 < out.len()`, so the word is aligned and inside it. Every other access
            // to guest memory is atomic (the vCPUs', by `Guest`'s contract, and this type's
            // stores), so an atomic load races with nothing.
            let v = unsafe { AtomicU64::from_ptr(src.add(i) as *mut u64) }.load(Ordering::Relaxed);
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        Ok(())
    }

    /// Copies page `p` into `out` (one page) while vCPUs may be writing it.
    pub fn read_page(&self, p: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        if out.len() != PAGE_SIZE {
            return Err(MemoryError::Buffer { len: out.len() });
        }
        self.load_pages(p, p.saturating_add(1), out)
    }

    /// Copies pages `first..end` into `out` (exactly their size), while the vCPUs are stopped.
    pub fn stopped_read(&self, first: u64, end: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        if self.guest.running() {
            return Err(MemoryError::Running("read as a whole"));
        }
        self.load_pages(first, end, out)
    }

    /// Pages `first..end`, copied out while the vCPUs are stopped.
    pub fn stopped_range(&self, first: u64, end: u64) -> Result<Vec<u8>, MemoryError> {
        self.page_addr(first, end)?;
        let want = (end - first) * PAGE_SIZE as u64;
        let len = usize::try_from(want).map_err(|_| MemoryError::RangeBuffer { len: 0, want })?;
        let mut out = vec![0u8; len];
        self.stopped_read(first, end, &mut out)?;
        Ok(out)
    }

    /// Writes page `p` while the vCPUs are stopped (the destination, before switch-over).
    pub fn stopped_write_page(&self, p: u64, data: &[u8]) -> Result<(), MemoryError> {
        if self.guest.running() {
            return Err(MemoryError::Running("written"));
        }
        if data.len() != PAGE_SIZE {
            return Err(MemoryError::Buffer { len: data.len() });
        }
        let dst = self.page_addr(p, p.saturating_add(1))? as *const u64;
        for (i, chunk) in data.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            // SAFETY: page `p` is inside the mapped test region (checked above against the
            // pages the machine mapped), which stays mapped while the guest (borrowed by
            // `self`) lives; `i < 512`, so the word is inside the page, 8-byte aligned. The
            // store is atomic, like every other access to guest memory, so a vCPU started
            // meanwhile or another writer races with nothing.
            unsafe { AtomicU64::from_ptr(dst.add(i) as *mut u64) }
                .store(u64::from_ne_bytes(w), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Fills `percent` of the pages (chosen by `seed`) with pseudo-random bytes and zeroes
    /// the rest, while the vCPUs are stopped: a guest whose memory holds data, not only
    /// the 8-byte stamps of its workload, so pages cost their real size on the wire and a
    /// wrong byte anywhere shows in the hashes.
    pub fn stopped_fill(&self, percent: u32, seed: u64) -> Result<(), MemoryError> {
        let mut page = vec![0u8; PAGE_SIZE];
        for p in 0..self.pages {
            let mut x = splitmix(seed ^ p.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            if x % 100 < percent as u64 {
                for c in page.chunks_exact_mut(8) {
                    x = splitmix(x);
                    c.copy_from_slice(&x.to_ne_bytes());
                }
            } else {
                page.fill(0);
            }
            self.stopped_write_page(p, &page)?;
        }
        Ok(())
    }
}

/// SplitMix64: a fast, well-mixed step for filler bytes and seeded test schedules.
pub fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
