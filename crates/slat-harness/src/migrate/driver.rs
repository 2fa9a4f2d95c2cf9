//! The machine under a benchmark guest and the drivers that run its workload: paced vCPUs
//! on the simulated machine, write bursts on the KVM guest.

use super::{BackendKind, BenchGuest, LogMode, Shape, WorkSpec, WORKLOAD_STATE};
use crate::error::BenchError;
use crate::machine_log::MachineLog;
use slat::PteFormat;
use slat_addr::Hva;
use slat_dirty::{DirtyLogSource, Harvester};
use slat_machine::{Machine, PacedParams, Pacer, Workload};
use slat_migrate::{Guest, GuestError, GuestHarvester, GuestLog, GuestRegion, StateBlob};
use slat_workload::PassParams;
use slat_workload::TestMachine;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A machine running a migration's workload: what both machines share, over
/// [`TestMachine`]; `D` runs the workload the way the machine can.
pub(super) struct MachineGuest<M, D: Driver<M>> {
    pub(super) m: Arc<M>,
    pub(super) shape: Shape,
    pub(super) log: LogMode,
    pub(super) driver: D,
    /// The workload `resume` runs: the last started, or the one restored from the source.
    pub(super) work: Mutex<Option<WorkSpec>>,
    /// Guest memory is private anonymous memory (`Backing::Anonymous`): a post-copy
    /// destination may fill it on demand.
    pub(super) demand_paged: bool,
}

/// How a guest's workload runs on machine `M`: the part of [`Guest`] the two machines do
/// differently.
pub(super) trait Driver<M>: Send + Sync {
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
pub(super) trait Pacing: Send + Sync {
    /// Sets the throttle (percent of time kept out of the guest).
    fn set_throttle(&self, percent: u32);
    /// The throttle now.
    fn throttle(&self) -> u32;
    /// vCPU time spent asleep because of the throttle, summed over vCPUs.
    fn throttled(&self) -> Duration;
    /// Guest writes since creation.
    fn writes(&self) -> u64;
    /// vCPUs with a throttle of their own (dirty-limit); 0: none (the KVM burst driver runs
    /// all vCPUs in one burst, so it cannot slow one of them alone).
    fn limitable_vcpus(&self) -> usize {
        0
    }
    /// Sets vCPU `i`'s own throttle, parts per million.
    fn set_vcpu_throttle_ppm(&self, _i: usize, _ppm: u32) {}
    /// Writes per vCPU (empty: not counted so).
    fn vcpu_writes(&self) -> Vec<u64> {
        Vec::new()
    }
    /// Sets vCPU `i`'s own write rate (0: the workload's).
    fn set_vcpu_rate(&self, _i: usize, _rate: u64) {}
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
    fn limitable_vcpus(&self) -> usize {
        Pacer::vcpus(self)
    }
    fn set_vcpu_throttle_ppm(&self, i: usize, ppm: u32) {
        Pacer::set_vcpu_throttle_ppm(self, i, ppm)
    }
    fn vcpu_writes(&self) -> Vec<u64> {
        Pacer::vcpu_writes(self)
    }
    fn set_vcpu_rate(&self, i: usize, rate: u64) {
        Pacer::set_vcpu_rate(self, i, rate)
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

// SAFETY: `regions` describes the machine's own test region (`OwnsTestRegion`; `build`
// checked that the mapping holds `pages` pages), which lives as long as this guest holds the
// machine, split at memslot boundaries; `running` is true whenever the driver has a workload
// running. With `demand_paged` (set only for `Backing::Anonymous`, a `MAP_PRIVATE |
// MAP_ANONYMOUS` mapping of 4 KiB pages with no userfaultfd of the machine's own), the test
// region may be discarded and registered by a post-copy destination: the only accesses while
// the guest runs are its vCPU threads' (simulated) or KVM's on their behalf, which wait for a
// missing page in the kernel.
unsafe impl<M, D> Guest for MachineGuest<M, D>
where
    M: OwnsTestRegion + Send + Sync + 'static,
    D: Driver<M>,
{
    fn kind(&self) -> &str {
        D::BACKEND.name()
    }
    fn regions(&self) -> Vec<GuestRegion> {
        let host = self.m.layout().host;
        self.shape
            .regions()
            .into_iter()
            .map(|region| GuestRegion {
                region,
                // The regions start at guest-physical 0 of the test region: the offset. The
                // machine maps all of them (checked when it was built); `MemoryMap::new`
                // checks the sum again.
                host: Hva::new(host.wrapping_add(region.gpa.raw())),
            })
            .collect()
    }
    fn machine(&self) -> Vec<u8> {
        self.shape.encode()
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), GuestError> {
        TestMachine::set_dirty_logging(&*self.m, on).map_err(GuestError::machine)
    }
    fn dirty_log(&self) -> Result<GuestHarvester, GuestError> {
        let log = MachineLog::new(self.m.clone());
        // `build` chose the machine's dirty configuration from `self.log`, so the log's mode
        // is that one; its slots are the test region's memslots, the regions of the map.
        Harvester::from_source(Box::new(log.map_err(GuestError::machine)) as GuestLog)
            .map_err(GuestError::harvest)
    }
    fn pause(&self) -> Result<(), GuestError> {
        self.driver.pause(&self.m)
    }
    fn resume(&self) -> Result<(), GuestError> {
        if self.driver.running() {
            return Ok(());
        }
        let work = lock(&self.work).ok_or(GuestError::NothingToResume)?;
        self.driver.start(&self.m, self.shape, work)
    }
    fn running(&self) -> bool {
        self.driver.running()
    }
    fn save_state(&self) -> Result<Vec<StateBlob>, GuestError> {
        Ok(lock(&self.work).iter().map(WorkSpec::to_blob).collect())
    }
    fn restore_state(&self, blobs: Vec<StateBlob>) -> Result<(), GuestError> {
        for b in blobs {
            if b.id != WORKLOAD_STATE {
                return Err(GuestError::State {
                    id: b.id,
                    version: b.version,
                    why: "not a slat benchmark guest's state".into(),
                });
            }
            let mut w = WorkSpec::from_blob(&b)?;
            if D::BACKEND == BackendKind::Kvm {
                // The KVM guest's writer only writes; a simulated source's read share has no
                // equivalent there, and refusing would strand the guest.
                w.write_percent = 100;
            }
            *lock(&self.work) = Some(w);
        }
        Ok(())
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
    fn activity(&self) -> Option<u64> {
        Some(self.driver.pacing().writes())
    }
    fn limitable_vcpus(&self) -> usize {
        self.driver.pacing().limitable_vcpus()
    }
    fn set_vcpu_throttle_ppm(&self, vcpu: usize, ppm: u32) {
        self.driver.pacing().set_vcpu_throttle_ppm(vcpu, ppm)
    }
    fn vcpu_activity(&self) -> Vec<u64> {
        self.driver.pacing().vcpu_writes()
    }
    fn demand_paged(&self) -> bool {
        self.demand_paged
    }
}

impl<M, D> BenchGuest for MachineGuest<M, D>
where
    M: OwnsTestRegion + Send + Sync + 'static,
    D: Driver<M> + 'static,
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
    fn start(&self, work: WorkSpec) -> Result<(), GuestError> {
        self.driver.start(&self.m, self.shape, work)?;
        *lock(&self.work) = Some(work);
        Ok(())
    }
    fn writes(&self) -> u64 {
        self.driver.pacing().writes()
    }
    fn populate(&self) -> Result<(), GuestError> {
        TestMachine::run_pass(&*self.m, PassParams::default())
            .map(drop)
            .map_err(GuestError::machine)
    }
    fn as_guest(self: Arc<Self>) -> Arc<dyn Guest> {
        self
    }
    fn as_dyn(&self) -> &dyn Guest {
        self
    }
    fn set_vcpu_rate(&self, vcpu: usize, rate: u64) {
        self.driver.pacing().set_vcpu_rate(vcpu, rate)
    }
}

impl<M, D: Driver<M>> Drop for MachineGuest<M, D> {
    fn drop(&mut self) {
        let _ = self.driver.pause(&self.m);
    }
}

/// The simulated machine's vCPUs run the paced memstress, whose rate and throttle the host
/// changes while it runs.
pub(super) struct PacedDriver {
    pub(super) pacer: Arc<Pacer>,
    pub(super) running: AtomicBool,
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
                touches: None,
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
pub(super) struct BurstDriver {
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
            let mut run = |on: Duration| {
                burst += 1;
                run_burst(&m, &ctl, seed, burst, on)
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

/// Runs burst number `burst` of the writer for `on` (zero: until the pacing changes or the
/// driver stops); returns the pages written and how long the burst took.
fn run_burst(
    m: &slat_kvm::KvmMachine,
    ctl: &BurstControl,
    seed: u32,
    burst: u64,
    on: Duration,
) -> Result<(u64, Duration), slat_kvm::KvmError> {
    // Each burst stamps a value no burst wrote before, so rewriting a page changes it.
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
            return Err(BenchError::AlreadyRunning.into());
        }
        if work.write_percent != 100 {
            return Err(BenchError::KvmReads.into());
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
            .map_err(|e| GuestError::from(BenchError::DriverThread(e)))?;
        *d = Some(h);
        Ok(())
    }
    fn pause(&self, _m: &slat_kvm::KvmMachine) -> Result<(), GuestError> {
        let Some(h) = lock(&self.thread).take() else {
            return Ok(());
        };
        self.ctl.stop.store(true, Ordering::Relaxed);
        if h.join().is_err() {
            return Err(BenchError::DriverPanicked.into());
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
