//! The one interface the benchmarks drive, [`Backend`], and its two machines: the simulated
//! machine of `slat-machine` (vCPU threads through slat's page tables) and real guests on the
//! host's `/dev/kvm` (`slat-kvm`). A benchmark builds a machine with [`create`] and runs the
//! same phases on either, so the two can be compared side by side in one process.

use crate::args::{BackendArg, FormatArg};
use serde_json::{json, Value};
use slat::dirty::{INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use slat::format::PAGE_SIZE;
use slat::{Ept, PteFormat, Stage2, VmConfig};
use slat_machine::dirty_oracle::{self, LogMode, OracleConfig, OracleReport};
use slat_machine::ram::{Backing, GuestRam};
use slat_machine::{DirtyConfig, Layout, Machine, MachineConfig, PassParams, Workload};
use std::time::Duration;

/// What to build, on either machine.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Host memory behind guest RAM.
    pub backing: Backing,
    /// vCPUs.
    pub vcpus: usize,
    /// Guest memory per vCPU (bytes, a multiple of 4 KiB).
    pub bytes_per_vcpu: u64,
    /// Memslots the test region is split into.
    pub slots: usize,
    /// Every vCPU accesses the whole region.
    pub overlap: bool,
    /// Pre-fault host memory.
    pub prefault: bool,
    /// Manual dirty-log protect with INITIALLY_SET (GET copies, CLEAR re-protects).
    pub manual_protect: bool,
    /// Dirty ring entries per vCPU (0: bitmaps).
    pub ring_entries: u32,
    /// Second-stage page-table format (the simulated machine only).
    pub format: FormatArg,
    /// Engine switches (the simulated machine only).
    pub vm: VmConfig,
    /// Software TLB entries per vCPU (the simulated machine only).
    pub tlb_entries: usize,
    /// Physical CPUs for the vCPU threads, 0 = all (the simulated machine only).
    pub pcpus: usize,
}

/// One vCPU's part of a pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct VcpuPass {
    /// The vCPU's own time.
    pub time: Duration,
    /// Pages touched.
    pub pages: u64,
    /// Dirty-ring-full exits taken.
    pub ring_full_exits: u64,
}

/// A completed pass.
#[derive(Debug, Clone, Default)]
pub struct Pass {
    /// From releasing the vCPUs to the last one's sync.
    pub wall: Duration,
    /// Per vCPU.
    pub vcpus: Vec<VcpuPass>,
}

/// What benchmarks drive: a VM with memslots over a test region, vCPUs running memstress
/// passes, and the dirty log (bitmaps or rings).
pub trait Backend {
    /// Where the test region is.
    fn layout(&self) -> Layout;
    /// The test region's memslot ids.
    fn slot_ids(&self) -> Vec<u32>;
    /// Pages per memslot.
    fn pages_per_slot(&self) -> u64;
    /// One memstress pass on every vCPU.
    fn run_pass(&self, p: PassParams) -> Result<Pass, String>;
    /// Memstress passes back to back until [`Backend::halt`].
    fn start_loop(&self, p: PassParams) -> Result<(), String>;
    /// Stops the vCPUs.
    fn halt(&self) -> Result<(), String>;
    /// Dirty logging on every test memslot.
    fn set_dirty_logging(&self, on: bool) -> Result<(), String>;
    /// GET_DIRTY_LOG of `slot` into `bitmap`; returns the pages reported.
    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<u64, String>;
    /// CLEAR_DIRTY_LOG of `num` pages of `slot` from `first`.
    fn clear_dirty_log(
        &self,
        slot: u32,
        first: u64,
        num: u64,
        bitmap: &[u64],
    ) -> Result<(), String>;
    /// Collects every dirty-ring entry; returns how many.
    fn collect_dirty_rings(&self) -> u64;
    /// RESET_DIRTY_RINGS.
    fn reset_dirty_rings(&self) -> Result<(), String>;
    /// The machine's counters as JSON (engine statistics, or KVM's binary VM stats).
    fn stats(&self) -> Value;
    /// The dirty-log oracle in `mode` (the machine must have been built for it).
    fn dirty_oracle(
        &self,
        mode: LogMode,
        cfg: OracleConfig,
        progress: &mut dyn FnMut(&dirty_oracle::IterationReport),
    ) -> Result<OracleReport, String>;
    /// The simulated machine, for its engine-only reports and switches.
    fn sim(&self) -> Option<&dyn Sim>;
}

/// The simulated machine's engine-only reports and switches, whatever its page-table format.
pub trait Sim {
    /// The engine's statistics.
    fn engine_stats(&self) -> slat::Stats;
    /// Physical CPUs the vCPU threads are scheduled on.
    fn pcpus(&self) -> usize;
    /// Deliberately breaks the engine (`slat::dirty::inject`), to see the oracle fail.
    fn inject_bugs(&self, bits: u32);
}

impl<F: PteFormat> Sim for Machine<F> {
    fn engine_stats(&self) -> slat::Stats {
        self.vm().stats()
    }
    fn pcpus(&self) -> usize {
        Machine::pcpus(self)
    }
    fn inject_bugs(&self, bits: u32) {
        self.vm().inject_bugs(bits)
    }
}

/// The simulated machine with page-table format `F`.
fn sim_machine<F: PteFormat>(spec: &Spec) -> Result<Box<dyn Backend>, String> {
    let dirty = DirtyConfig {
        manual_protect: if spec.manual_protect {
            MANUAL_PROTECT_ENABLE | INITIALLY_SET
        } else {
            0
        },
        ring_entries: spec.ring_entries,
        ..DirtyConfig::default()
    };
    let m = Machine::<F>::new(MachineConfig {
        vm: spec.vm,
        backing: spec.backing,
        vcpus: spec.vcpus,
        bytes_per_vcpu: spec.bytes_per_vcpu,
        slots: spec.slots,
        overlap: spec.overlap,
        tlb_entries: spec.tlb_entries,
        pcpus: spec.pcpus,
        prefault: spec.prefault,
        dirty,
        gpa: None,
    })
    .map_err(|e| e.to_string())?;
    Ok(Box::new(m))
}

/// Builds the machine `kind` selects (on the simulated machine, with `spec.format`).
pub fn create(kind: BackendArg, spec: &Spec) -> Result<Box<dyn Backend>, String> {
    match kind {
        BackendArg::Sim => match spec.format {
            FormatArg::Ept => sim_machine::<Ept>(spec),
            FormatArg::Stage2 => sim_machine::<Stage2>(spec),
        },
        BackendArg::Kvm => {
            // Checked with the other flags; a backstop for a caller that forgot.
            spec.format.check_backends(&[kind])?;
            let dirty = slat_kvm::DirtyConfig {
                manual_protect: if spec.manual_protect {
                    slat_kvm::MANUAL_PROTECT_ENABLE | slat_kvm::INITIALLY_SET
                } else {
                    0
                },
                ring_entries: spec.ring_entries,
            };
            let m = slat_kvm::KvmMachine::new(slat_kvm::KvmConfig {
                backing: kvm_backing(spec.backing)?,
                vcpus: spec.vcpus,
                bytes_per_vcpu: spec.bytes_per_vcpu,
                slots: spec.slots,
                overlap: spec.overlap,
                prefault: spec.prefault,
                dirty,
                ..slat_kvm::KvmConfig::default()
            })
            .map_err(|e| e.to_string())?;
            Ok(Box::new(m))
        }
    }
}

fn kvm_backing(b: Backing) -> Result<slat_kvm::Backing, String> {
    Ok(match b {
        Backing::Anonymous => slat_kvm::Backing::Anonymous,
        Backing::AnonymousThp => slat_kvm::Backing::AnonymousThp,
        Backing::AnonymousHugetlb2M => slat_kvm::Backing::AnonymousHugetlb2M,
        Backing::AnonymousHugetlb1G => slat_kvm::Backing::AnonymousHugetlb1G,
        Backing::Shmem => {
            return Err("-s shmem is not supported by the kvm backend (use anonymous, anonymous_thp or anonymous_hugetlb)".into())
        }
    })
}

/// Host memory the size of a test region, for the native baseline: the same memstress pattern
/// run by plain host threads, with the implementation of the backend it is compared with.
pub enum Native {
    /// slat-machine's baseline.
    Sim(Layout, GuestRam),
    /// slat-kvm's baseline.
    Kvm(slat_kvm::Layout, slat_kvm::HostMemory),
}

impl Native {
    /// Maps (and, with `prefault`, populates) the memory for `layout`.
    pub fn new(
        kind: BackendArg,
        layout: Layout,
        backing: Backing,
        prefault: bool,
    ) -> Result<Native, String> {
        let total = layout.bytes_per_vcpu * layout.vcpus as u64;
        let psize = backing.page_size().max(PAGE_SIZE);
        let len = total.div_ceil(psize) * psize;
        Ok(match kind {
            BackendArg::Sim => Native::Sim(
                layout,
                GuestRam::new(backing, len, prefault).map_err(|e| e.to_string())?,
            ),
            BackendArg::Kvm => Native::Kvm(
                slat_kvm::Layout {
                    gpa: layout.gpa,
                    host: layout.host,
                    bytes_per_vcpu: layout.bytes_per_vcpu,
                    vcpus: layout.vcpus,
                    overlap: layout.overlap,
                },
                slat_kvm::HostMemory::new(kvm_backing(backing)?, len, prefault)
                    .map_err(|e| e.to_string())?,
            ),
        })
    }

    /// One pass of the pattern on host memory.
    pub fn run(&self, p: PassParams) -> Result<Pass, String> {
        match self {
            Native::Sim(layout, ram) => slat_machine::native_baseline(*layout, ram, p)
                .map(sim_pass)
                .map_err(|e| e.to_string()),
            Native::Kvm(layout, mem) => slat_kvm::native_baseline(*layout, mem, kvm_params(p))
                .map(kvm_pass)
                .map_err(|e| e.to_string()),
        }
    }
}

fn sim_pass(r: slat_machine::PassReport) -> Pass {
    Pass {
        wall: r.wall,
        vcpus: r
            .vcpus
            .iter()
            .map(|v| VcpuPass {
                time: v.time,
                pages: v.pages,
                ring_full_exits: v.counters.ring_full_exits,
            })
            .collect(),
    }
}

fn kvm_pass(r: slat_kvm::PassReport) -> Pass {
    Pass {
        wall: r.wall,
        vcpus: r
            .vcpus
            .iter()
            .map(|v| VcpuPass {
                time: v.time,
                pages: v.pages,
                ring_full_exits: v.ring_full_exits,
            })
            .collect(),
    }
}

fn kvm_params(p: PassParams) -> slat_kvm::PassParams {
    slat_kvm::PassParams {
        write_percent: p.write_percent,
        random: p.random,
        seed: p.seed,
    }
}

fn text<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

impl<F: PteFormat> Backend for Machine<F> {
    fn layout(&self) -> Layout {
        Machine::layout(self)
    }
    fn slot_ids(&self) -> Vec<u32> {
        Machine::slot_ids(self).collect()
    }
    fn pages_per_slot(&self) -> u64 {
        Machine::pages_per_slot(self)
    }
    fn run_pass(&self, p: PassParams) -> Result<Pass, String> {
        Machine::run_pass(self, p).map(sim_pass).map_err(text)
    }
    fn start_loop(&self, p: PassParams) -> Result<(), String> {
        self.start(Workload::Loop(p)).map_err(text)
    }
    fn halt(&self) -> Result<(), String> {
        Machine::halt(self).map(drop).map_err(text)
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), String> {
        Machine::set_dirty_logging(self, on).map_err(text)
    }
    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<u64, String> {
        self.vm().get_dirty_log(slot, bitmap).map_err(text)
    }
    fn clear_dirty_log(
        &self,
        slot: u32,
        first: u64,
        num: u64,
        bitmap: &[u64],
    ) -> Result<(), String> {
        self.vm()
            .clear_dirty_log(slot, first, num, bitmap)
            .map(drop)
            .map_err(text)
    }
    fn collect_dirty_rings(&self) -> u64 {
        Machine::collect_dirty_rings(self, |_, _| {})
    }
    fn reset_dirty_rings(&self) -> Result<(), String> {
        self.vm().reset_dirty_rings().map(drop).map_err(text)
    }
    fn stats(&self) -> Value {
        crate::demand_paging::stats_json(&self.vm().stats())
    }
    fn dirty_oracle(
        &self,
        _mode: LogMode,
        cfg: OracleConfig,
        progress: &mut dyn FnMut(&dirty_oracle::IterationReport),
    ) -> Result<OracleReport, String> {
        dirty_oracle::run(self, cfg, progress).map_err(text)
    }
    fn sim(&self) -> Option<&dyn Sim> {
        Some(self)
    }
}

impl Backend for slat_kvm::KvmMachine {
    fn layout(&self) -> Layout {
        let l = slat_kvm::KvmMachine::layout(self);
        Layout {
            gpa: l.gpa,
            host: l.host,
            bytes_per_vcpu: l.bytes_per_vcpu,
            vcpus: l.vcpus,
            overlap: l.overlap,
        }
    }
    fn slot_ids(&self) -> Vec<u32> {
        slat_kvm::KvmMachine::slot_ids(self).collect()
    }
    fn pages_per_slot(&self) -> u64 {
        slat_kvm::KvmMachine::pages_per_slot(self)
    }
    fn run_pass(&self, p: PassParams) -> Result<Pass, String> {
        slat_kvm::KvmMachine::run_pass(self, kvm_params(p))
            .map(kvm_pass)
            .map_err(text)
    }
    fn start_loop(&self, p: PassParams) -> Result<(), String> {
        self.start(slat_kvm::Workload::Loop(kvm_params(p)))
            .map_err(text)
    }
    fn halt(&self) -> Result<(), String> {
        slat_kvm::KvmMachine::halt(self).map(drop).map_err(text)
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), String> {
        slat_kvm::KvmMachine::set_dirty_logging(self, on).map_err(text)
    }
    fn get_dirty_log(&self, slot: u32, bitmap: &mut [u64]) -> Result<u64, String> {
        slat_kvm::KvmMachine::get_dirty_log(self, slot, bitmap).map_err(text)?;
        Ok(bitmap.iter().map(|w| w.count_ones() as u64).sum())
    }
    fn clear_dirty_log(
        &self,
        slot: u32,
        first: u64,
        num: u64,
        bitmap: &[u64],
    ) -> Result<(), String> {
        slat_kvm::KvmMachine::clear_dirty_log(self, slot, first, num, bitmap).map_err(text)
    }
    fn collect_dirty_rings(&self) -> u64 {
        slat_kvm::KvmMachine::collect_dirty_rings(self, |_, _| {})
    }
    fn reset_dirty_rings(&self) -> Result<(), String> {
        slat_kvm::KvmMachine::reset_dirty_rings(self)
            .map(drop)
            .map_err(text)
    }
    fn stats(&self) -> Value {
        match self.vm_stats() {
            Ok(stats) => Value::Object(
                stats
                    .into_iter()
                    .map(|s| (s.name, json!(s.value)))
                    .collect(),
            ),
            Err(e) => json!({ "unavailable": e.to_string() }),
        }
    }
    fn dirty_oracle(
        &self,
        mode: LogMode,
        cfg: OracleConfig,
        progress: &mut dyn FnMut(&dirty_oracle::IterationReport),
    ) -> Result<OracleReport, String> {
        if cfg.toggle_every != 0 {
            return Err("--toggle-every is a check of the simulated engine; the kvm backend cannot apply it (drop it, or use --backend sim)".into());
        }
        let mode = match mode {
            LogMode::DirtyLog => slat_kvm::dirty_oracle::LogMode::DirtyLog,
            LogMode::ClearLog => slat_kvm::dirty_oracle::LogMode::ClearLog,
            LogMode::DirtyRing => slat_kvm::dirty_oracle::LogMode::DirtyRing,
        };
        let kcfg = slat_kvm::dirty_oracle::OracleConfig {
            mode,
            iterations: cfg.iterations,
            interval: cfg.interval,
            seed: cfg.seed,
        };
        let convert = |i: &slat_kvm::dirty_oracle::IterationReport| dirty_oracle::IterationReport {
            iteration: i.iteration,
            dirty: i.dirty,
            clean: i.clean,
            writes: i.writes,
            lost: i.lost,
            spurious: i.spurious,
            toggled: false,
        };
        let r = slat_kvm::dirty_oracle::run(self, kcfg, |i| progress(&convert(i))).map_err(text)?;
        Ok(OracleReport {
            iterations: r.iterations.iter().map(convert).collect(),
            errors: r.errors,
            ring_full_exits: r.ring_full_exits,
        })
    }
    fn sim(&self) -> Option<&dyn Sim> {
        None
    }
}

/// A one-line summary of KVM's VM statistics in `stats` (from [`Backend::stats`]), naming the
/// counters this host's KVM reports.
pub fn kvm_stats_line(stats: &Value) -> String {
    let names = [
        "pages_4k",
        "pages_2m",
        "pages_1g",
        "remote_tlb_flush",
        "remote_tlb_flush_requests",
        "mmu_shadow_zapped",
        "mmu_pte_write",
    ];
    let parts: Vec<String> = names
        .iter()
        .filter_map(|n| stats.get(*n).map(|v| format!("{n} {v}")))
        .collect();
    if parts.is_empty() {
        "KVM: no VM statistics available".to_string()
    } else {
        format!("KVM VM statistics: {}", parts.join(", "))
    }
}
