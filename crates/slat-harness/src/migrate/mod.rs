//! slat's own benchmark guests: the simulated machine or a `/dev/kvm` guest, with the
//! synthetic workload the `migrate` benchmarks run on them.
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

mod driver;

use crate::error::{BenchError, ShapeError};
use driver::{BurstDriver, MachineGuest, PacedDriver};
use slat::{Ept, PteFormat, Stage2, VmConfig};
use slat_addr::{Gpa, PAGE_SIZE};
use slat_machine::{Machine, MachineConfig, Pacer};
use slat_migrate::stream::{Region, MAX_GUEST_BYTES, MAX_REGIONS};
use slat_migrate::{Guest, GuestError, HelloError, StateBlob};
use slat_workload::Backing;
use slat_workload::{DirtyConfig, RegionSpec, TestMachine, INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// Most vCPUs in a benchmark guest (as the command line allows; each is a thread on a
/// destination).
pub const MAX_VCPUS: u32 = 512;
/// Most memslots in a benchmark guest: one region of the memory map each.
pub const MAX_SLOTS: u32 = MAX_REGIONS;

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
        if self.bytes_per_vcpu == 0 || self.bytes_per_vcpu % PAGE_SIZE != 0 {
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
        let pages = bytes / PAGE_SIZE;
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
        self.total_pages() * PAGE_SIZE
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
                gpa: Gpa::new(s * pps * PAGE_SIZE),
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
pub fn factory(spec: GuestSpec) -> slat_migrate::Factory {
    Box::new(move |regions: &[Region], machine: &[u8]| {
        let shape = Shape::decode(machine).map_err(HelloError::Machine)?;
        if shape.regions() != regions {
            return Err(HelloError::Mismatch {
                theirs: regions.to_vec(),
                ours: shape.regions(),
            });
        }
        let g = build(&GuestSpec { shape, ..spec }).map_err(HelloError::Build)?;
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
                sim_guest::<Stage2>(config, s, pages, spec)
            } else {
                sim_guest::<Ept>(config, s, pages, spec)
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
            if mapped != Some(pages * PAGE_SIZE) {
                return Err(BenchError::Mapped { pages, mapped }.into());
            }
            Ok(Arc::new(MachineGuest {
                m: Arc::new(m),
                shape: s,
                log: spec.log,
                driver: BurstDriver::default(),
                work: Mutex::new(None),
                demand_paged: spec.backing == Backing::Anonymous,
            }))
        }
    }
}

fn sim_guest<F: PteFormat>(
    config: MachineConfig,
    shape: Shape,
    pages: u64,
    spec: &GuestSpec,
) -> Result<Arc<dyn BenchGuest>, GuestError> {
    let log = spec.log;
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
    if m.ram().len() < pages * PAGE_SIZE {
        return Err(BenchError::Mapped {
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
        demand_paged: spec.backing == Backing::Anonymous,
    }))
}
