//! The one interface the benchmarks drive, [`Backend`], and its two machines: the simulated
//! machine of `slat-machine` (vCPU threads through slat's page tables) and real guests on the
//! host's `/dev/kvm` (`slat-kvm`). A benchmark builds a machine with [`create`] and runs the
//! same phases on either, so the two can be compared side by side in one process.
//!
//! Both machines implement `slat_workload::TestMachine` and share its types (layout, pass
//! reports, the dirty-log oracle), so [`Backend`] is that trait made object-safe for a
//! `Box<dyn Backend>` (machine errors become the one-line messages the CLI prints) plus what
//! only the CLI needs ([`CliMachine`]: statistics as JSON and the simulated engine's extras).

use crate::args::{BackendArg, FormatArg, MachineArgs, PinArgs};
use crate::error::{CliError, CliResult};
use crate::output::VmSettings;
use crate::report::{bbm_cmo_line, pinned_line, sim_format, Phase};
use serde_json::{json, Value};
use slat::{Ept, PteFormat, Stage2, Timed, VmConfig};
use slat_addr::PAGE_SIZE;
use slat_dirty::DirtyLogSource;
use slat_machine::vtime::SimThreads;
use slat_machine::{Machine, MachineConfig};
use slat_vt::Virtual;
use slat_workload::dirty_oracle::{self, LogMode, OracleConfig, OracleReport};
use slat_workload::{
    native_baseline, DirtyConfig, Layout, PassParams, RegionSpec, TestMachine, WriteLatency,
    INITIALLY_SET, MANUAL_PROTECT_ENABLE,
};
use slat_workload::{Backing, GuestRam};
use std::ops::Range;
use std::sync::Arc;

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
    /// The machine `machine`'s flags describe, around `region`, with engine switches `vm`.
    pub fn new(machine: &MachineArgs, region: RegionSpec, vm: VmConfig) -> Spec {
        Spec {
            region,
            format: machine.format,
            vm,
            tlb_entries: machine.tlb_entries,
            pcpus: machine.pcpus.unwrap_or(0),
        }
    }

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
/// What the native baseline maps beside guest RAM, for a set-up progress line: as much host
/// memory again, or nothing more for phantom memory (its baseline runs in the frame pool).
pub fn native_note(backing: Backing) -> &'static str {
    if backing.is_phantom() {
        " (the native baseline runs in phantom memory's frame pool)"
    } else {
        " and as much host memory for the native baseline"
    }
}

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
pub trait Backend: CliMachine {
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
    /// The dirty-log oracle in `mode` (the machine must have been built for it).
    fn dirty_oracle(
        &self,
        mode: LogMode,
        cfg: OracleConfig,
        progress: &mut dyn FnMut(&dirty_oracle::IterationReport),
    ) -> Result<OracleReport, String>;
    /// Pins vCPU i's thread to `cpus[i]`; returns each thread's affinity read back.
    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, String>;
}

/// What only the CLI asks of a machine, beside [`TestMachine`].
pub trait CliMachine {
    /// The machine's counters as JSON (engine statistics, or KVM's binary VM stats).
    fn stats(&self) -> Value;
    /// The simulated machine, for its engine-only reports and switches.
    fn sim(&self) -> Option<&dyn Sim>;
    /// The test region's guest RAM.
    fn guest_ram(&self) -> &GuestRam;
    /// Starts every vCPU writing its region sequentially in a loop until `halt`: paced at
    /// `rate` writes per second per vCPU where the machine can pace a guest (the simulated
    /// one), as fast as it can otherwise.
    fn start_writer(&self, pass: PassParams, rate: Option<u64>) -> Result<(), String>;
}

/// The simulated machine's engine-only reports and switches, whatever its page-table format.
pub trait Sim {
    /// The engine's statistics.
    fn engine_stats(&self) -> slat::Stats;
    /// Physical CPUs the vCPU threads are scheduled on.
    fn pcpus(&self) -> usize;
    /// The memory the engine's MMU holds for itself now.
    fn mmu_memory(&self) -> slat::MmuMemory;
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
    fn mmu_memory(&self) -> slat::MmuMemory {
        self.vm().mmu_memory()
    }
    #[cfg(feature = "broken-engine")]
    fn inject_bugs(&self, bits: u32) {
        self.vm().inject_bugs(bits)
    }
}

impl<F: PteFormat> CliMachine for Machine<F> {
    fn stats(&self) -> Value {
        stats_json(&self.vm().stats())
    }
    fn sim(&self) -> Option<&dyn Sim> {
        Some(self)
    }
    fn guest_ram(&self) -> &GuestRam {
        self.ram()
    }
    fn start_writer(&self, pass: PassParams, rate: Option<u64>) -> Result<(), String> {
        let pacer = slat_machine::Pacer::new(rate.unwrap_or(0));
        let paced = slat_machine::PacedParams { pass, pacer };
        self.start(slat_machine::Workload::Paced(paced))
            .map_err(text)
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
    fn start_writer(&self, pass: PassParams, _rate: Option<u64>) -> Result<(), String> {
        TestMachine::start_loop(self, pass).map_err(text)
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
    fn dirty_oracle(
        &self,
        _mode: LogMode,
        cfg: OracleConfig,
        progress: &mut dyn FnMut(&dirty_oracle::IterationReport),
    ) -> Result<OracleReport, String> {
        if self.guest_ram().is_phantom() {
            return Err(
                "the dirty-log oracle reads guest data back, which phantom memory does not keep"
                    .into(),
            );
        }
        dirty_oracle::run(self, cfg, progress).map_err(text)
    }
    fn pin_vcpus(&self, cpus: &[usize]) -> Result<Vec<Vec<usize>>, String> {
        TestMachine::pin_vcpus(self, cpus).map_err(text)
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
    apply_pinning_with(|cpus| m.pin_vcpus(cpus), plan)
}

/// [`apply_pinning`] for a machine that is not a [`Backend`] (page-table-test's own machine):
/// `pin_vcpus` pins the vCPU threads and returns their affinities.
pub fn apply_pinning_with(
    pin_vcpus: impl FnOnce(&[usize]) -> Result<Vec<Vec<usize>>, String>,
    plan: Option<&slat_workload::cpus::PinPlan>,
) -> Result<Option<Vec<usize>>, String> {
    let Some(plan) = plan else { return Ok(None) };
    let got =
        pin_vcpus(&plan.vcpus).map_err(|e| format!("-c: cannot pin the vCPU threads: {e}"))?;
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

fn machine_config(spec: &Spec) -> MachineConfig {
    MachineConfig {
        vm: spec.vm,
        region: spec.region,
        tlb_entries: spec.tlb_entries,
        pcpus: spec.pcpus,
        ..MachineConfig::default()
    }
}

fn kvm_machine(spec: &Spec) -> Result<slat_kvm::KvmMachine, slat_kvm::KvmError> {
    let region = spec.region;
    slat_kvm::KvmMachine::new(slat_kvm::KvmConfig {
        region,
        ..slat_kvm::KvmConfig::default()
    })
}

/// Work on a machine of its own type, for benchmarks that need more than [`Backend`] (a
/// snapshot, a paced writer): [`visit`] builds the machine and hands it over.
pub trait OnMachine {
    /// What the work returns.
    type Out;
    /// The work.
    fn run<M: TestMachine + CliMachine>(self, m: &M) -> CliResult<Self::Out>;
    /// The error of a KVM machine that could not be built.
    fn kvm_error(&self, e: slat_kvm::KvmError) -> CliError {
        CliError::Runtime(e.to_string())
    }
}

/// Builds machine `kind` from `spec` and runs `work` on it.
pub fn visit<V: OnMachine>(kind: BackendArg, spec: &Spec, work: V) -> CliResult<V::Out> {
    fn sim<F: PteFormat, V: OnMachine>(spec: &Spec, work: V) -> CliResult<V::Out> {
        work.run(&Machine::<F>::new(machine_config(spec)).map_err(text)?)
    }
    match (kind, spec.format) {
        (BackendArg::Sim, FormatArg::Ept) => sim::<Ept, V>(spec, work),
        (BackendArg::Sim, FormatArg::Stage2) => sim::<Stage2, V>(spec, work),
        (BackendArg::Kvm, _) => match kvm_machine(spec) {
            Ok(m) => work.run(&m),
            Err(e) => Err(work.kvm_error(e)),
        },
    }
}

/// [`visit`], in virtual time when `sim` is given (`--clock virtual`: the machine is
/// `Timed<F, Virtual>` with one physical CPU per vCPU, as [`start_with`] builds it; the calling
/// thread must be the simulation's host CPU).
pub fn visit_in<V: OnMachine>(
    kind: BackendArg,
    spec: &Spec,
    sim: Option<Arc<dyn SimThreads>>,
    work: V,
) -> CliResult<V::Out> {
    fn timed<F: PteFormat, V: OnMachine>(
        spec: &Spec,
        sim: Arc<dyn SimThreads>,
        work: V,
    ) -> CliResult<V::Out> {
        let config = MachineConfig {
            pcpus: spec.region.vcpus,
            ..machine_config(spec)
        };
        work.run(&Machine::<Timed<F, Virtual>>::with_sim(config, Some(sim)).map_err(text)?)
    }
    let Some(sim) = sim else {
        return visit(kind, spec, work);
    };
    match (kind, spec.format) {
        (BackendArg::Sim, FormatArg::Ept) => timed::<Ept, V>(spec, sim, work),
        (BackendArg::Sim, FormatArg::Stage2) => timed::<Stage2, V>(spec, sim, work),
        // Refused with the other flags; a backstop for a caller that forgot.
        (BackendArg::Kvm, _) => Err(CliError::bad(
            "--clock virtual runs only on the simulated machine (--backend sim)",
        )),
    }
}

/// Builds machine `kind` as a progress phase (`mapping ... guest RAM{what}`), which the
/// caller ends once the rest of its set-up (pinning, a baseline) is done; in virtual time
/// when `sim` is given (`--clock virtual`: the simulated machine's threads are registered
/// with it; the calling thread must be its host CPU).
pub fn start_with(
    kind: BackendArg,
    spec: &Spec,
    what: &str,
    quiet: bool,
    sim: Option<Arc<dyn SimThreads>>,
) -> CliResult<(Box<dyn Backend>, Phase)> {
    let r = &spec.region;
    let size = slat_workload::format_size(r.bytes_per_vcpu * r.vcpus as u64);
    let format = sim_format(kind, spec.format);
    let name = format!(
        "{}{format}: mapping {size} of {} guest RAM{what}",
        kind.name(),
        r.backing
    );
    let p = Phase::start(name, quiet);
    let m = match sim {
        Some(sim) => create_virtual(kind, spec, sim)?,
        None => create(kind, spec)?,
    };
    Ok((m, p))
}

/// The simulated machine in virtual time: format `Timed<F, Virtual>`, one physical CPU per
/// vCPU (the simulation schedules them; the token pool must never block a simulated thread).
fn create_virtual(
    kind: BackendArg,
    spec: &Spec,
    sim: Arc<dyn SimThreads>,
) -> Result<Box<dyn Backend>, String> {
    let config = MachineConfig {
        pcpus: spec.region.vcpus,
        ..machine_config(spec)
    };
    match (kind, spec.format) {
        (BackendArg::Sim, FormatArg::Ept) => Ok(Box::new(
            Machine::<Timed<Ept, Virtual>>::with_sim(config, Some(sim)).map_err(text)?,
        )),
        (BackendArg::Sim, FormatArg::Stage2) => Ok(Box::new(
            Machine::<Timed<Stage2, Virtual>>::with_sim(config, Some(sim)).map_err(text)?,
        )),
        // Refused with the other flags; a backstop for a caller that forgot.
        (BackendArg::Kvm, _) => Err("--clock virtual runs only on the simulated machine".into()),
    }
}

/// The lines after a selftest's report: the machine's counters, then a `Machine:` line of
/// what it was (`sim_settings`: the engine's switches beyond the format, MMU lock and fast
/// page fault) and how the run went (`extra`), then where `-c` pinned the vCPUs.
pub fn machine_lines(
    m: &dyn Backend,
    spec: &Spec,
    sim_settings: &str,
    extra: &str,
    pinned: Option<&[usize]>,
) -> Vec<String> {
    let vcpus = spec.region.vcpus;
    let mut lines = match m.sim() {
        Some(sim) => {
            let s = sim.engine_stats();
            let mut l = vec![
                format!(
                    "Engine: {} slow faults, {} fast faults, {} spurious, {} retried; {} splits, {} recoveries; remote flushes {}/{} requested",
                    s.pf_fixed, s.pf_fast, s.pf_spurious, s.pf_retry, s.splits, s.recoveries,
                    s.remote_tlb_flush, s.remote_tlb_flush_requests
                ),
                format!(
                    "Leaves now: {} x 4K, {} x 2M, {} x 1G; page tables: {} pages ({})",
                    s.leaves_4k, s.leaves_2m, s.leaves_1g, s.table_pages,
                    slat_workload::format_size(s.table_bytes)
                ),
            ];
            l.extend(bbm_cmo_line(spec.format, &s));
            let fast = if spec.vm.fast_pf { "on" } else { "off" };
            l.push(format!(
                "Machine: {vcpus} vCPU(s) on {} physical CPU(s); format {}, mmu lock {}, fast page fault {fast}{extra}{sim_settings}",
                sim.pcpus(),
                spec.format.name(),
                spec.vm.mmu_lock.name(),
            ));
            l
        }
        None => vec![
            kvm_stats_line(&m.stats()),
            format!("Machine: {vcpus} vCPU(s) on the host's /dev/kvm{extra}"),
        ],
    };
    lines.extend(pinned_line(pinned));
    lines
}

/// Every engine statistic as JSON.
pub fn stats_json(s: &slat::Stats) -> Value {
    json!({
        "pf_fixed": s.pf_fixed, "pf_fast": s.pf_fast, "pf_spurious": s.pf_spurious,
        "pf_retry": s.pf_retry, "pf_no_slot": s.pf_no_slot, "pf_read_only": s.pf_read_only,
        "leaves_4k": s.leaves_4k, "leaves_2m": s.leaves_2m, "leaves_1g": s.leaves_1g,
        "table_pages": s.table_pages, "table_bytes": s.table_bytes,
        "table_pages_live": s.table_pages_live,
        "remote_tlb_flush_requests": s.remote_tlb_flush_requests,
        "remote_tlb_flush": s.remote_tlb_flush, "splits": s.splits,
        "recoveries": s.recoveries, "dirty_marked": s.dirty_marked,
        "pf_ring_full": s.pf_ring_full, "bbm_breaks": s.bbm_breaks,
        "cache_cleans": s.cache_cleans, "cache_clean_bytes": s.cache_clean_bytes,
    })
}

/// Builds the machine `kind` selects (on the simulated machine, with `spec.format`).
pub fn create(kind: BackendArg, spec: &Spec) -> Result<Box<dyn Backend>, String> {
    match kind {
        BackendArg::Sim => match spec.format {
            FormatArg::Ept => Ok(Box::new(
                Machine::<Ept>::new(machine_config(spec)).map_err(text)?,
            )),
            FormatArg::Stage2 => Ok(Box::new(
                Machine::<Stage2>::new(machine_config(spec)).map_err(text)?,
            )),
        },
        BackendArg::Kvm => {
            // Checked with the other flags; a backstop for a caller that forgot.
            spec.format.check_backends(&[kind])?;
            Ok(Box::new(kvm_machine(spec).map_err(text)?))
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
