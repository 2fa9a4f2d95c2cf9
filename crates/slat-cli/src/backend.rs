//! The one interface the benchmarks drive, [`Backend`], and its two machines: the simulated
//! machine of `slat-machine` (vCPU threads through slat's page tables) and real guests on the
//! host's `/dev/kvm` (`slat-kvm`). A benchmark builds a machine with [`create`] and runs the
//! same phases on either, so the two can be compared side by side in one process.
//!
//! Both machines implement `slat_workload::TestMachine` and share its types (layout, pass
//! reports, the dirty-log oracle), so [`Backend`] is that trait made object-safe for a
//! `Box<dyn Backend>` (machine errors become the one-line messages the CLI prints) plus what
//! only the CLI needs ([`CliMachine`]: statistics as JSON and the simulated engine's extras).

use crate::args::{BackendArg, FormatArg, PinArgs};
use crate::error::{CliError, CliResult};
use crate::output::VmSettings;
use serde_json::{json, Value};
use slat::{Ept, PteFormat, Stage2, VmConfig};
use slat_addr::PAGE_SIZE;
use slat_dirty::DirtyLogSource;
use slat_machine::{Machine, MachineConfig};
use slat_workload::dirty_oracle::{self, LogMode, OracleConfig, OracleReport};
use slat_workload::{
    native_baseline, DirtyConfig, Layout, PassParams, RegionSpec, TestMachine, WriteLatency,
    INITIALLY_SET, MANUAL_PROTECT_ENABLE,
};
use slat_workload::{Backing, GuestRam};
use std::ops::Range;

/// A completed pass, without either machine's own counters.
pub type Pass = slat_workload::PassReport;

/// What to build, on either machine.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The test region: shape, host memory, prefault, dirty logging (both machines).
    pub region: RegionSpec,
    /// Second-stage page-table format (the simulated machine only).
    pub format: FormatArg,
    /// Engine switches (the simulated machine only).
    pub vm: VmConfig,
    /// Software TLB entries per vCPU (the simulated machine only).
    pub tlb_entries: usize,
    /// Physical CPUs for the vCPU threads, 0 = all (the simulated machine only).
    pub pcpus: usize,
}

impl Spec {
    /// Manual dirty-log protect (GET copies, CLEAR re-protects).
    pub fn manual_protect(&self) -> bool {
        self.region.dirty.manual_protect != 0
    }

    /// The settings a run of this spec on `kind` reports; `pcpus` is the simulated machine's.
    pub fn vm_settings(&self, kind: BackendArg, pcpus: Option<usize>) -> VmSettings {
        VmSettings::new(
            kind,
            self.format,
            &self.vm,
            self.tlb_entries,
            pcpus,
            self.region.prefault,
        )
    }
}

/// How the CLI's benchmarks log: manual protect with INITIALLY_SET (GET copies, CLEAR
/// re-protects), or `ring_entries` per vCPU (0: bitmaps).
pub fn dirty_config(manual_protect: bool, ring_entries: u32) -> DirtyConfig {
    DirtyConfig {
        manual_protect: if manual_protect {
            MANUAL_PROTECT_ENABLE | INITIALLY_SET
        } else {
            0
        },
        ring_entries,
        ..DirtyConfig::default()
    }
}

/// What benchmarks drive: [`TestMachine`] behind a `dyn`, with its errors as one-line
/// messages, plus [`CliMachine`]. Every [`TestMachine`] that is a [`CliMachine`] is one.
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
    /// Stops the vCPUs; reports what they did since [`Backend::start_loop`].
    fn halt(&self) -> Result<Pass, String>;
    /// What the machine records as a write's latency in a timed pass.
    fn write_latency(&self) -> WriteLatency;
    /// Dirty logging on every test memslot.
    fn set_dirty_logging(&self, on: bool) -> Result<(), String>;
    /// The test region's dirty log (GET, CLEAR, the rings), as every harvest drives it.
    fn dirty_log(&self) -> Box<dyn DirtyLogSource<Error = String> + '_>;
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
    /// Pins vCPU i's thread to `cpus[i]`; returns each thread's affinity read back.
    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, String>;
    /// The test region's guest RAM.
    fn guest_ram(&self) -> &GuestRam;
}

/// What only the CLI asks of a machine, beside [`TestMachine`].
pub trait CliMachine {
    /// The machine's counters as JSON (engine statistics, or KVM's binary VM stats).
    fn stats(&self) -> Value;
    /// The simulated machine, for its engine-only reports and switches.
    fn sim(&self) -> Option<&dyn Sim>;
    /// The test region's guest RAM.
    fn guest_ram(&self) -> &GuestRam;
}

/// The simulated machine's engine-only reports and switches, whatever its page-table format.
pub trait Sim {
    /// The engine's statistics.
    fn engine_stats(&self) -> slat::Stats;
    /// Physical CPUs the vCPU threads are scheduled on.
    fn pcpus(&self) -> usize;
    /// Deliberately breaks the engine (`slat::dirty::inject`), to see the oracle fail.
    #[cfg(feature = "broken-engine")]
    fn inject_bugs(&self, bits: u32);
}

impl<F: PteFormat> Sim for Machine<F> {
    fn engine_stats(&self) -> slat::Stats {
        self.vm().stats()
    }
    fn pcpus(&self) -> usize {
        Machine::pcpus(self)
    }
    #[cfg(feature = "broken-engine")]
    fn inject_bugs(&self, bits: u32) {
        self.vm().inject_bugs(bits)
    }
}

impl<F: PteFormat> CliMachine for Machine<F> {
    fn stats(&self) -> Value {
        crate::demand_paging::stats_json(&self.vm().stats())
    }
    fn sim(&self) -> Option<&dyn Sim> {
        Some(self)
    }
    fn guest_ram(&self) -> &GuestRam {
        self.ram()
    }
}

impl CliMachine for slat_kvm::KvmMachine {
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
    fn sim(&self) -> Option<&dyn Sim> {
        None
    }
    fn guest_ram(&self) -> &GuestRam {
        self.ram()
    }
}

fn text<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

impl<M: TestMachine + CliMachine> Backend for M {
    fn layout(&self) -> Layout {
        TestMachine::layout(self)
    }
    fn slot_ids(&self) -> Vec<u32> {
        let slots: Range<u32> = self.test_slots();
        slots.collect()
    }
    fn pages_per_slot(&self) -> u64 {
        TestMachine::pages_per_slot(self)
    }
    fn run_pass(&self, p: PassParams) -> Result<Pass, String> {
        TestMachine::run_pass(self, p)
            .map(|r| r.without_counters())
            .map_err(text)
    }
    fn start_loop(&self, p: PassParams) -> Result<(), String> {
        TestMachine::start_loop(self, p).map_err(text)
    }
    fn halt(&self) -> Result<Pass, String> {
        TestMachine::halt(self)
            .map(|r| r.without_counters())
            .map_err(text)
    }
    fn write_latency(&self) -> WriteLatency {
        TestMachine::write_latency(self)
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), String> {
        TestMachine::set_dirty_logging(self, on).map_err(text)
    }
    fn dirty_log(&self) -> Box<dyn DirtyLogSource<Error = String> + '_> {
        Box::new(TestMachine::dirty_log(self).map_err(text::<M::Error>))
    }
    fn stats(&self) -> Value {
        CliMachine::stats(self)
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
        CliMachine::sim(self)
    }
    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, String> {
        TestMachine::pin_vcpus(self, cpus).map_err(text)
    }
    fn guest_ram(&self) -> &GuestRam {
        CliMachine::guest_ram(self)
    }
}

/// `-c`: checks the list for `vcpus` vCPUs (refused as bad input) and pins `m`'s threads;
/// returns the vCPUs' CPUs, `None` without `-c`.
pub fn pin(m: &dyn Backend, pin: &PinArgs, vcpus: u32) -> CliResult<Option<Vec<usize>>> {
    let plan = pin.plan(vcpus).map_err(CliError::bad)?;
    Ok(apply_pinning(m, plan.as_ref())?)
}

/// Applies a `-c` plan to a machine's vCPU threads (and the calling thread, if the plan has
/// a CPU for it) and checks with `sched_getaffinity` that each thread now runs on exactly its
/// CPU. Returns the vCPUs' CPUs as the kernel reports them.
pub fn apply_pinning(
    m: &dyn Backend,
    plan: Option<&slat_workload::cpus::PinPlan>,
) -> Result<Option<Vec<usize>>, String> {
    let Some(plan) = plan else { return Ok(None) };
    let got = m
        .pin_vcpus(&plan.vcpus)
        .map_err(|e| format!("-c: cannot pin the vCPU threads: {e}"))?;
    check_pinned(&plan.vcpus, &got)?;
    if let Some(cpu) = plan.main {
        slat_workload::cpus::pin_thread(0, cpu)
            .map_err(|e| format!("-c: cannot pin the main thread to CPU {cpu}: {e}"))?;
    }
    Ok(Some(plan.vcpus.clone()))
}

/// Errors unless thread i's affinity is exactly `[want[i]]`.
pub fn check_pinned(want: &[usize], got: &[Vec<usize>]) -> Result<(), String> {
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        if g.as_slice() != [*w] {
            return Err(format!(
                "-c: vCPU {i}'s thread runs on CPUs {} after pinning it to CPU {w}",
                slat_workload::cpus::format_cpu_list(g)
            ));
        }
    }
    Ok(())
}

/// The simulated machine with page-table format `F`.
fn sim_machine<F: PteFormat>(spec: &Spec) -> Result<Box<dyn Backend>, String> {
    let m = Machine::<F>::new(MachineConfig {
        vm: spec.vm,
        region: spec.region,
        tlb_entries: spec.tlb_entries,
        pcpus: spec.pcpus,
        ..MachineConfig::default()
    })
    .map_err(text)?;
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
            let m = slat_kvm::KvmMachine::new(slat_kvm::KvmConfig {
                region: spec.region,
                ..slat_kvm::KvmConfig::default()
            })
            .map_err(text)?;
            Ok(Box::new(m))
        }
    }
}

/// Host memory the size of a test region, for the native baseline: the same memstress pattern
/// run by plain host threads (one implementation, whichever machine it is compared with).
pub struct Native {
    layout: Layout,
    ram: GuestRam,
}

impl Native {
    /// Maps (and, with `prefault`, populates) the memory for `layout`, with a backing the
    /// machine `kind` accepts.
    pub fn new(
        kind: BackendArg,
        layout: Layout,
        backing: Backing,
        prefault: bool,
    ) -> Result<Native, String> {
        if kind == BackendArg::Kvm && backing == Backing::Shmem {
            // Checked with the other flags; a backstop, so both sides of a comparison match.
            return Err("-s shmem is not supported by the kvm backend (use anonymous, anonymous_thp or anonymous_hugetlb)".into());
        }
        let total = layout
            .bytes_per_vcpu
            .checked_mul(layout.vcpus as u64)
            .ok_or("the native baseline's region size overflows")?;
        let psize = backing.page_size().max(PAGE_SIZE);
        let len = total
            .div_ceil(psize)
            .checked_mul(psize)
            .ok_or("the native baseline's region size overflows")?;
        let ram = GuestRam::new(backing, len, prefault).map_err(text)?;
        Ok(Native { layout, ram })
    }

    /// One pass of the pattern on host memory.
    pub fn run(&self, p: PassParams) -> Result<Pass, String> {
        native_baseline(self.layout, &self.ram, p).map_err(text)
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
