//! slat's own benchmark guests: the simulated machine or a `/dev/kvm` guest, with the
//! synthetic workload the `migrate` benchmarks run on them (cargo feature `machines`).
//!
//! A [`BenchGuest`] is a [`Guest`] plus what only a benchmark wants: start a workload
//! ([`WorkSpec`]), populate memory, count writes. Its memory map is the machine's test
//! region, one region per memslot, addressed from guest-physical 0 (the two machines place
//! the region at different addresses, and a guest may move between them). The workload
//! travels as the device-state blob [`WORKLOAD_STATE`], so the destination resumes the same
//! one; the machine's shape travels as the hello's machine description ([`Shape::encode`]),
//! so a destination can build a machine to fit ([`factory`]).
//!
//! The source's vCPUs run the paced memstress of `slat-machine` (every write a new value, at
//! a write rate and throttle changed while it runs). The KVM guest's code has no such control,
//! so a driver thread runs its dirty-log writer in bursts, kicking the vCPUs out between them
//! as QEMU's CPU throttle does: the length of each burst follows the measured write speed so
//! that the average rate matches the one asked for. (`slat-cli` has a wider `Backend` trait; a
//! library crate cannot depend on the binary's, and migration needs a running workload with a
//! run-time dirty-rate control, which that trait does not have.)

use crate::error::{Cause, GuestError, MemoryError, ShapeError};
use crate::guest::{Guest, GuestErrors, GuestHarvester, GuestLog, GuestRegion};
use crate::state::StateBlob;
use crate::stream::{Region, MAX_GUEST_BYTES, MAX_SLOTS, MAX_VCPUS, PAGE_SIZE};
use slat::{Ept, PteFormat, Stage2, VmConfig};
use slat_dirty::Harvester;
use slat_machine::{Backing, Machine, MachineConfig, PacedParams, Pacer, PassParams, Workload};
use slat_workload::{DirtyConfig, RegionSpec, TestMachine, INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The benchmark guest's shape: vCPUs, memory and memslots of its test region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory per vCPU in bytes.
    pub bytes_per_vcpu: u64,
    /// Memslots the test region is split into (equal sizes, consecutive).
    pub slots: u32,
    /// Every vCPU works on the whole region.
    pub overlap: bool,
}

impl Shape {
    /// Checks the shape with checked arithmetic: 1 to [`MAX_VCPUS`] vCPUs, a non-zero whole
    /// number of pages per vCPU, vCPUs × memory within [`MAX_GUEST_BYTES`], and 1 to
    /// [`MAX_SLOTS`] memslots that split the pages evenly. Returns the pages in the test region.
    pub fn check(&self) -> Result<u64, ShapeError> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(ShapeError::Vcpus { vcpus: self.vcpus });
        }
        if self.bytes_per_vcpu == 0 || self.bytes_per_vcpu % PAGE_SIZE as u64 != 0 {
            return Err(ShapeError::BytesPerVcpu {
                bytes: self.bytes_per_vcpu,
            });
        }
        let bytes =
            self.bytes_per_vcpu
                .checked_mul(self.vcpus as u64)
                .ok_or(ShapeError::Overflow {
                    vcpus: self.vcpus,
                    bytes_per_vcpu: self.bytes_per_vcpu,
                })?;
        if bytes > MAX_GUEST_BYTES {
            return Err(ShapeError::TooBig { bytes });
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(ShapeError::Slots { slots: self.slots });
        }
        let pages = bytes / PAGE_SIZE as u64;
        if pages % self.slots as u64 != 0 {
            return Err(ShapeError::UnevenSlots {
                slots: self.slots,
                pages,
            });
        }
        Ok(pages)
    }
    /// Bytes in the test region (0 for a shape that fails [`Shape::check`]).
    pub fn total_bytes(&self) -> u64 {
        self.total_pages() * PAGE_SIZE as u64
    }
    /// Pages in the test region (0 for a shape that fails [`Shape::check`]).
    pub fn total_pages(&self) -> u64 {
        self.check().unwrap_or(0)
    }
    /// The memory map: one region per memslot, from guest-physical 0 (empty for a shape that
    /// fails [`Shape::check`]).
    pub fn regions(&self) -> Vec<Region> {
        let Ok(pages) = self.check() else {
            return Vec::new();
        };
        let pps = pages / self.slots as u64;
        (0..self.slots as u64)
            .map(|s| Region {
                gpa: s * pps * PAGE_SIZE as u64,
                pages: pps,
                read_only: false,
            })
            .collect()
    }
    /// The hello's machine description: `vcpus u32 | bytes_per_vcpu u64 | slots u32 |
    /// overlap u8`, little-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(17);
        v.extend_from_slice(&self.vcpus.to_le_bytes());
        v.extend_from_slice(&self.bytes_per_vcpu.to_le_bytes());
        v.extend_from_slice(&self.slots.to_le_bytes());
        v.push(self.overlap as u8);
        v
    }
    /// Reads [`Shape::encode`]'s bytes (checked with [`Shape::check`]).
    pub fn decode(b: &[u8]) -> Result<Shape, String> {
        if b.len() != 17 || b[16] > 1 {
            return Err(format!(
                "{} bytes that are not a slat benchmark guest's shape",
                b.len()
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[4..12]);
        let s = Shape {
            vcpus: u32_at(0),
            bytes_per_vcpu: u64::from_le_bytes(w),
            slots: u32_at(12),
            overlap: b[16] == 1,
        };
        s.check().map_err(|e| e.to_string())?;
        Ok(s)
    }
}

/// The guest workload, so the destination resumes the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkSpec {
    /// Percentage of accesses that write.
    pub write_percent: u32,
    /// Pseudo-random page order.
    pub random: bool,
    /// PRNG seed.
    pub seed: u32,
    /// Writes per second per vCPU (0: unlimited).
    pub rate: u64,
}

/// The id of the device-state blob carrying the benchmark's workload.
pub const WORKLOAD_STATE: &str = "slat.workload";

impl WorkSpec {
    /// As a device-state blob (version 1: `write_percent u32 | random u8 | seed u32 |
    /// rate u64`).
    pub fn to_blob(&self) -> StateBlob {
        let mut data = Vec::with_capacity(17);
        data.extend_from_slice(&self.write_percent.to_le_bytes());
        data.push(self.random as u8);
        data.extend_from_slice(&self.seed.to_le_bytes());
        data.extend_from_slice(&self.rate.to_le_bytes());
        StateBlob {
            id: WORKLOAD_STATE.into(),
            version: 1,
            data,
        }
    }
    /// Reads [`WorkSpec::to_blob`]'s blob.
    pub fn from_blob(b: &StateBlob) -> Result<WorkSpec, GuestError> {
        let bad = |why: &str| GuestError::State {
            id: b.id.clone(),
            version: b.version,
            why: why.into(),
        };
        if b.version != 1 {
            return Err(bad("this side reads version 1"));
        }
        let d = &b.data;
        if d.len() != 17 || d[4] > 1 {
            return Err(bad("malformed"));
        }
        let write_percent = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
        if write_percent > 100 {
            return Err(bad("a write share over 100%"));
        }
        let mut r = [0u8; 8];
        r.copy_from_slice(&d[9..17]);
        Ok(WorkSpec {
            write_percent,
            random: d[4] == 1,
            seed: u32::from_le_bytes([d[5], d[6], d[7], d[8]]),
            rate: u64::from_le_bytes(r),
        })
    }
}

/// A benchmark guest: a [`Guest`] with a synthetic workload.
pub trait BenchGuest: Guest {
    /// The machine kind.
    fn backend(&self) -> BackendKind;
    /// vCPUs, memory and memslots.
    fn shape(&self) -> Shape;
    /// The log mode harvests use.
    fn log_mode(&self) -> LogMode;
    /// Starts `work` on every vCPU (returns at once); [`Guest::resume`] runs it again.
    fn start(&self, work: WorkSpec) -> Result<(), GuestError>;
    /// Guest writes since creation (a little behind while running).
    fn writes(&self) -> u64;
    /// One sequential write pass over every page (maps guest memory, as a booted guest has).
    fn populate(&self) -> Result<(), GuestError>;
    /// This guest as a plain [`Guest`].
    fn as_guest(self: Arc<Self>) -> Arc<dyn Guest>;
    /// This guest as a plain [`Guest`], borrowed.
    fn as_dyn(&self) -> &dyn Guest;
    /// Gives vCPU `vcpu` a write rate of its own (0: the workload's), e.g. one heavy vCPU
    /// among light ones; a machine without per-vCPU pacing ignores it.
    fn set_vcpu_rate(&self, _vcpu: usize, _rate: u64) {}
}

/// A destination factory building machines like `spec` (its shape replaced by the one the
/// source describes; its log mode irrelevant on a destination).
pub fn factory(spec: GuestSpec) -> crate::Factory {
    Box::new(move |regions: &[Region], machine: &[u8]| {
        let shape = Shape::decode(machine).map_err(crate::error::HelloError::Machine)?;
        if shape.regions() != regions {
            return Err(crate::error::HelloError::Mismatch {
                theirs: regions.to_vec(),
                ours: shape.regions(),
            });
        }
        let g = build(&GuestSpec { shape, ..spec }).map_err(crate::error::HelloError::Build)?;
        Ok(g.as_guest())
    })
}

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

/// Builds the machine `spec` asks for.
///
/// The shape is checked first ([`Shape::check`]: vCPU and memslot counts, checked products,
/// the guest physical address space), so a machine is only ever built — and memory only ever
/// mapped — for a shape whose sizes add up.
pub fn build(spec: &GuestSpec) -> Result<Arc<dyn BenchGuest>, GuestError> {
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
                log: spec.log,
                driver: BurstDriver::default(),
                work: Mutex::new(None),
            }))
        }
    }
}

fn sim_guest<F: PteFormat>(
    config: MachineConfig,
    shape: Shape,
    pages: u64,
    log: LogMode,
) -> Result<Arc<dyn BenchGuest>, GuestError> {
    // `Shape::check` bounded the memory by a 48-bit space; a format with fewer bits would
    // place the region below address 0.
    let fits = pages < 1u64 << (F::MAX_PHYS_BITS - PAGE_SIZE.trailing_zeros());
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
        shape,
        log,
        driver: PacedDriver {
            pacer: Pacer::for_vcpus(0, shape.vcpus as usize).map_err(GuestError::machine)?,
            running: AtomicBool::new(false),
        },
        work: Mutex::new(None),
    }))
}

/// A machine running a migration's workload: what both machines share, over
/// [`TestMachine`]; `D` runs the workload the way the machine can.
struct MachineGuest<M, D: Driver<M>> {
    m: Arc<M>,
    shape: Shape,
    log: LogMode,
    driver: D,
    /// The workload `resume` runs: the last started, or the one restored from the source.
    work: Mutex<Option<WorkSpec>>,
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
    /// vCPUs with a throttle of their own (dirty-limit); 0: none (the KVM burst driver runs
    /// all vCPUs in one burst, so it cannot slow one of them alone).
    fn limitable_vcpus(&self) -> usize {
        0
    }
    /// Sets vCPU `i`'s own throttle, per mille.
    fn set_vcpu_throttle(&self, _i: usize, _permille: u32) {}
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
    fn set_vcpu_throttle(&self, i: usize, permille: u32) {
        Pacer::set_vcpu_throttle(self, i, permille)
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
// running.
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
                // The regions start at guest-physical 0 of the test region: the offset.
                host: host + region.gpa,
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
        let log = slat_snapshot::MachineLog::new(self.m.clone());
        // `build` chose the machine's dirty configuration from `self.log`, so the log's mode
        // is that one; its slots are the test region's memslots, the regions of the map.
        Harvester::from_source(Box::new(GuestErrors(log)) as GuestLog).map_err(GuestError::harvest)
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
    fn set_vcpu_throttle(&self, vcpu: usize, permille: u32) {
        self.driver.pacing().set_vcpu_throttle(vcpu, permille)
    }
    fn vcpu_activity(&self) -> Vec<u64> {
        self.driver.pacing().vcpu_writes()
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
