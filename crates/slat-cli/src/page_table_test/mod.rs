//! `slat page-table-test`: KVM's `kvm_page_table_test` (the arm64 stage-2 patches: cache
//! maintenance only by the installing fault, install-first block rebuild). Every vCPU walks the
//! same region in three timed stages — create mappings, update them with dirty logging on
//! (block splits, read-only → read-write), adjust them with logging off (blocks rebuilt) — so
//! the figures are dominated by concurrent faults on the same addresses, which is what those
//! two patches improve on arm64.
//!
//! Departures from the selftest, on purpose:
//! - `-m` accepts only the guest modes the model implements (one: 48-bit IPA, 4 KiB granule);
//! - each stage also reports the faults it took, the engine's break-before-make and
//!   cache-maintenance work, and a native baseline of the same accesses with the ratio;
//! - defaults follow KVM: dirty logging splits blocks lazily (`--eager-split off`, both
//!   architectures' default), and blocks come back on the next fault after logging stops on
//!   stage2 (`--recover on-fault`, arm64) or all at once when it stops on ept (`inplace`, x86);
//! - the stage figures count the logging switch before the stage (in-place recovery happens
//!   there), and its time is printed on its own line.

use crate::args::Switch;
use crate::args::{backing, cpu_list, guest_size, variant, CpuList, MachineArgs, OutputArgs};
use crate::args::{BackendArg, FormatArg};
use crate::driver::{lower, Benchmark, Common, Preset};
use crate::error::{CliError, CliResult};
use crate::limits::GuestMemory;
use crate::output::{opt_secs, secs, Metric, RowOutcome, Sweep, VmSettings};
use crate::report::{format_header, quiet, ratio, ts, Phase};
use crate::virtual_time::{self, ClockArgs, ClockReport, Stopwatch, VirtualRun};
use clap::Args;
use serde::Serialize;
use slat::{CmoPolicy, PteFormat, RebuildOrder, RecoverVariant, Stats, Timed, VmConfig};
use slat_addr::PAGE_SIZE;
use slat_machine::page_table_stage::{native_stage_baseline, Stage, StageParams};
use slat_machine::vtime::SimThreads;
use slat_machine::{Machine, MachineConfig, Workload};
use slat_vt::Virtual;
use slat_workload::cpus::PinPlan;
use slat_workload::{format_size, Backing, GuestRam, RegionSpec, TestMachine};
use std::sync::Arc;
use std::time::Duration;

/// Guest modes the model implements, as `-m` numbers them.
const GUEST_MODES: [&str; 1] = ["PA-bits:48,  VA-bits:48,  4K pages"];

/// Flags of `slat page-table-test`.
#[derive(Debug, Clone, Args)]
pub struct PageTableTestArgs {
    /// Guest physical test memory offset (hex with 0x, or a size with a k/m/g/t suffix);
    /// default: the top of the guest physical address space. Must be aligned to the backing
    /// page size.
    #[arg(short = 'p', value_parser = address)]
    pub gpa: Option<u64>,
    /// Guest mode: 0 = PA-bits:48, VA-bits:48, 4K pages (the only one the model implements).
    #[arg(short = 'm', default_value_t = 0)]
    pub mode: usize,
    /// Test memory size, shared by all vCPUs: bytes with an optional k/m/g/t suffix (powers
    /// of 1024), aligned up to the backing page size.
    #[arg(short = 'b', value_parser = guest_size, default_value = "1G")]
    pub bytes: u64,
    /// vCPUs; all access the whole test memory (even ones write in the create stage, odd
    /// ones read).
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub vcpus: u32,
    /// Host memory behind guest RAM: anonymous, anonymous_thp, anonymous_hugetlb (2 MiB),
    /// anonymous_hugetlb_1gb, shmem;
    /// phantom, phantom_thp, phantom_hugetlb_1gb (sim only: an address range with no memory
    /// behind it, leaves as anonymous, anonymous_thp, anonymous_hugetlb_1gb; data goes to 64
    /// shared frames and is not kept, so guests beyond the host's memory fit; commands that
    /// read data back refuse it).
    /// Hugetlb needs pages reserved first, e.g.
    /// `echo 600 > /proc/sys/vm/nr_hugepages` for 1 GiB of 2 MiB pages plus the baseline's.
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// Split blocks when logging is enabled (`off`, KVM arm64's default: the first write to a
    /// block splits it, and the rest of the block faults back in page by page).
    #[arg(long = "eager-split", value_enum, default_value = "off")]
    pub eager_split: Switch,
    /// How blocks come back when logging stops: `on-fault` (the next translation fault in the
    /// range rebuilds the block; KVM arm64, the default with --format stage2), `inplace` (every
    /// table is rebuilt as a block when logging is disabled; KVM x86 6.12+, the default with
    /// --format ept), or `zap` (the slot is unmapped and faults rebuild blocks).
    #[arg(long = "recover", value_parser = variant::<RecoverVariant>())]
    pub recover: Option<RecoverVariant>,
    /// Order of a table-to-block rebuild under break-before-make: `break-first` (the entry
    /// stays invalid while the old tables are unmapped and freed, so other vCPUs fault on it)
    /// or `install-first` (the block goes in right after the invalidation; the old tables are
    /// freed afterwards). Only stage2 breaks before make; no effect with --format ept.
    #[arg(long = "rebuild", value_parser = variant::<RebuildOrder>(), default_value = "install-first")]
    pub rebuild: RebuildOrder,
    /// Run a comparison in one process: the three stages for each of `--cmo
    /// always|on-install` × `--rebuild break-first|install-first` (other flags as given; with
    /// --repeat each row N times, with --plot bars per row), then one table with the relative
    /// improvement of `--cmo on-install` and of `--rebuild install-first`. Needs --format
    /// stage2.
    #[arg(long)]
    pub compare: bool,
    /// Pin vCPU i's thread to the i-th host CPU of this list with sched_setaffinity, as the
    /// other selftests' -c: CPU numbers and inclusive ranges (`0,1,3-5`), one per vCPU; one
    /// more entry pins the main thread too. Each CPU must be online and allowed for this
    /// process. Pins the threads that run the simulated vCPUs (which still share --pcpus
    /// simulated physical CPUs); the native baseline's threads are not pinned.
    #[arg(short = 'c', value_name = "CPU_LIST", value_parser = cpu_list)]
    pub cpus: Option<CpuList>,
    #[command(flatten)]
    pub clock: ClockArgs,
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
}

/// `-p`: hex (`0x...`) or a size.
fn address(s: &str) -> Result<u64, String> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).map_err(|e| format!("bad hex address {s:?}: {e}")),
        None => slat_workload::parse_size(s).map_err(|e| e.to_string()),
    }
}

/// `--compare`: cache maintenance policy × block rebuild order, rebuild order slowest.
#[rustfmt::skip]
const COMPARE: &[Preset<PageTableTestArgs>] = &[
    Preset { settings: &["rebuild=break-first", "cmo=always"], apply: |a| (a.rebuild, a.machine.cmo) = (RebuildOrder::BreakFirst, CmoPolicy::Always) },
    Preset { settings: &["rebuild=break-first", "cmo=on-install"], apply: |a| (a.rebuild, a.machine.cmo) = (RebuildOrder::BreakFirst, CmoPolicy::OnInstall) },
    Preset { settings: &["rebuild=install-first", "cmo=always"], apply: |a| (a.rebuild, a.machine.cmo) = (RebuildOrder::InstallFirst, CmoPolicy::Always) },
    Preset { settings: &["rebuild=install-first", "cmo=on-install"], apply: |a| (a.rebuild, a.machine.cmo) = (RebuildOrder::InstallFirst, CmoPolicy::OnInstall) },
];

/// One stage's figures.
#[derive(Serialize)]
struct StageRow {
    stage: &'static str,
    #[serde(rename = "time_s", serialize_with = "secs")]
    time: Duration,
    #[serde(rename = "native_time_s", serialize_with = "secs")]
    native: Duration,
    ratio: f64,
    /// Switching logging before the stage (enable before update, disable before adjust).
    #[serde(rename = "logging_switch_time_s", serialize_with = "opt_secs")]
    logging_switch: Option<Duration>,
    faults: u64,
    pf_fixed: u64,
    pf_fast: u64,
    pf_spurious: u64,
    pf_retry: u64,
    splits: u64,
    rebuilds: u64,
    remote_tlb_flushes: u64,
    bbm_breaks: u64,
    cache_cleans: u64,
    cache_clean_bytes: u64,
    /// Virtual time: what the contention model did in this stage (its logging switch
    /// included), as the report's `sim_model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    sim_model: Option<serde_json::Value>,
}

/// One run (the engine settings at the top level of its JSON, as they always were).
#[derive(Serialize)]
pub struct Report {
    benchmark: &'static str,
    backend: &'static str,
    #[serde(flatten)]
    vm: VmSettings,
    guest_mode: &'static str,
    backing: &'static str,
    granularity: u64,
    bytes: u64,
    gpa: u64,
    vcpus: u32,
    /// `-c`: vCPU i's thread was pinned to `pinned_cpus[i]` (read back from the kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pinned_cpus: Option<Vec<usize>>,
    stages: Vec<StageRow>,
    /// Whose time the stages' times are.
    #[serde(flatten)]
    clock: ClockReport,
    #[serde(skip)]
    host: u64,
    #[serde(skip)]
    cfg: VmConfig,
}

impl Benchmark for PageTableTestArgs {
    type Report = Report;
    const NAME: &'static str = "page-table-test";

    const PRESETS: &'static [Preset<Self>] = COMPARE;

    fn compare(&self) -> bool {
        self.compare
    }

    fn common(&self) -> Common<'_> {
        Common::of(&[], &self.out)
    }

    fn refuse(&self) -> Option<String> {
        (self.compare && self.machine.format != FormatArg::Stage2).then(|| {
            "--compare varies cache maintenance and the rebuild order, which only --format stage2 has".into()
        })
    }

    fn check(&self) -> CliResult {
        if self.mode >= GUEST_MODES.len() {
            let modes = GUEST_MODES.iter().enumerate().map(|(i, m)| {
                format!(
                    "{i} ({})",
                    m.split_whitespace().collect::<Vec<_>>().join(" ")
                )
            });
            let modes = modes.collect::<Vec<_>>().join(", ");
            let m = self.mode;
            return Err(CliError::bad(format!(
                "guest mode {m} is not implemented; -m takes {modes}"
            )));
        }
        self.pin_plan().map_err(CliError::bad)?;
        check(self).map_err(CliError::bad)
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Report> {
        let vt = self.clock.start()?;
        let sim = vt.as_ref().map(VirtualRun::threads);
        // The machine is gone when `run_on` returns, so the simulation can end.
        let mut r = match (self.machine.format, sim) {
            (FormatArg::Ept, None) => run_on::<slat::Ept>(self, None)?,
            (FormatArg::Stage2, None) => run_on::<slat::Stage2>(self, None)?,
            (FormatArg::Ept, sim) => run_on::<Timed<slat::Ept, Virtual>>(self, sim)?,
            (FormatArg::Stage2, sim) => run_on::<Timed<slat::Stage2, Virtual>>(self, sim)?,
        };
        r.clock = virtual_time::finish(vt)?;
        Ok(r)
    }

    fn metrics(&self) -> Vec<Metric<Report>> {
        METRICS.to_vec()
    }

    fn headline(&self) -> Vec<&'static str> {
        METRICS[..3].iter().map(|m| m.name).collect()
    }

    fn print(&self, r: &Report) {
        print_run(self, r)
    }

    fn print_sweep(&self, sweep: &Sweep<Report>) -> bool {
        print_comparison(self, sweep);
        true
    }
}

impl PageTableTestArgs {
    /// `-c` checked against this host and `-v`.
    fn pin_plan(&self) -> Result<Option<PinPlan>, String> {
        let plan = self
            .cpus
            .as_ref()
            .map(|l| PinPlan::new(&l.0, self.vcpus as usize));
        plan.transpose().map_err(|e| e.to_string())
    }
}

/// Pins `m`'s vCPU threads (and the main thread, if the plan names a CPU for it) as `-c` says
/// and checks the kernel's answer; the vCPUs' CPUs, `None` without `-c`.
fn pin<F: PteFormat>(m: &Machine<F>, a: &PageTableTestArgs) -> Result<Option<Vec<usize>>, String> {
    let pin_vcpus = |cpus: &[usize]| TestMachine::pin_vcpus(m, cpus).map_err(|e| e.to_string());
    crate::backend::apply_pinning_with(pin_vcpus, a.pin_plan()?.as_ref())
}

fn stage_time(r: &Report, stage: Stage) -> Option<f64> {
    let f = r.stages.iter().find(|f| f.stage == stage.name());
    f.map(|f| f.time.as_secs_f64())
}

/// The headline figures: each stage's time, and the faults the adjust stage took (fewer with
/// an install-first rebuild).
#[rustfmt::skip]
const METRICS: &[Metric<Report>] = &[
    lower("create mappings", "s", |r| stage_time(r, Stage::CreateMappings)),
    lower("update mappings", "s", |r| stage_time(r, Stage::UpdateMappings)),
    lower("adjust mappings", "s", |r| stage_time(r, Stage::AdjustMappings)),
    lower("adjust mappings faults", "count", |r| r.stages.get(2).map(|f| f.faults as f64)),
];

/// The test memory (`-b` aligned up to the backing page size) and what the machine maps for
/// it: one partition per vCPU, each rounded up to whole pages. Checked arithmetic.
fn sizes(a: &PageTableTestArgs) -> Result<(u64, u64, u64), String> {
    let large = a.backing.page_size().max(PAGE_SIZE);
    let overflow = || {
        let (b, v) = (a.bytes, a.vcpus);
        format!("-b {b} -v {v}: the test memory overflows 64 bits")
    };
    let bytes = a.bytes.div_ceil(large).checked_mul(large);
    let bytes = bytes.ok_or_else(overflow)?;
    let per_vcpu = (bytes / a.vcpus as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE;
    let total = per_vcpu.checked_mul(a.vcpus as u64).ok_or_else(overflow)?;
    Ok((bytes, per_vcpu, total))
}

/// Sizes and addresses the machine can hold: the memory without overflow, `-p` aligned to the
/// backing page size and with the memory inside the format's guest physical address space,
/// on this host together with the native baseline (both are mapped at once).
fn check(a: &PageTableTestArgs) -> Result<(), String> {
    let (_, _, total) = sizes(a)?;
    let align = a.backing.page_size().max(PAGE_SIZE);
    if let Some(g) = a.gpa.filter(|g| g % align != 0) {
        return Err(format!(
            "-p {g:#x}: the guest physical offset is not aligned to the backing page size ({align:#x}, -s {})",
            a.backing.name()
        ));
    }
    let mem = GuestMemory {
        flags: format!("-b {} -v {}", a.bytes, a.vcpus),
        bytes: total,
    };
    mem.fits_gpa(&[BackendArg::Sim], a.machine.format, a.gpa)?;
    mem.fits_host(a.backing, 2, a.machine.tlb_bytes(a.vcpus))
}

fn vm_config(a: &PageTableTestArgs) -> VmConfig {
    VmConfig {
        eager_split: a.eager_split.on(),
        recover: match a.recover {
            Some(r) => r,
            // Each architecture's KVM: x86 rebuilds huge pages when logging stops (and splits
            // by filling a table, so no fault would come to rebuild them), arm64 on the next
            // fault.
            None if a.machine.format == FormatArg::Ept => RecoverVariant::InPlace,
            None => RecoverVariant::OnFault,
        },
        rebuild: a.rebuild,
        ..a.machine.vm_config()
    }
}

/// One run on format `F`, its vCPUs registered with `sim` in virtual time (`F` timed).
fn run_on<F: PteFormat>(
    a: &PageTableTestArgs,
    sim: Option<Arc<dyn SimThreads>>,
) -> Result<Report, String> {
    let cfg = vm_config(a);
    let large = a.backing.page_size().max(PAGE_SIZE);
    // The machine gives each vCPU a partition; the test shares one region, so the partitions
    // only size it (rounded up to whole pages) and the stages run over its first `bytes`.
    let (bytes, per_vcpu, _) = sizes(a)?;
    let prefault = !a.machine.no_prefault;
    let p = mapping_phase(a, &cfg, bytes);
    // In virtual time one physical CPU per vCPU: the simulation schedules them, and the
    // token pool must never block a simulated thread.
    let pcpus = match sim {
        Some(_) => a.vcpus as usize,
        None => a.machine.pcpus.unwrap_or(0),
    };
    let m = Machine::<F>::with_sim(
        MachineConfig {
            vm: cfg,
            region: RegionSpec {
                backing: a.backing,
                vcpus: a.vcpus as usize,
                bytes_per_vcpu: per_vcpu,
                overlap: true,
                prefault,
                ..RegionSpec::default()
            },
            tlb_entries: a.machine.tlb_entries,
            pcpus,
            gpa: a.gpa,
            private: None,
        },
        sim,
    )
    .map_err(|e| e.to_string())?;
    let native_ram = GuestRam::new(a.backing, bytes, prefault).map_err(|e| e.to_string())?;
    let pinned_cpus = pin(&m, a)?;
    p.done();
    let params = |stage| StageParams {
        stage,
        large_page: large,
        bytes,
    };
    let guest = Stage::ALL.map(|s| run_stage(&m, params(s), a));
    let stages = with_natives(guest, &native_ram, params, a);
    let layout = m.layout();
    Ok(Report {
        benchmark: "page-table-test",
        backend: "sim",
        vm: VmSettings::new(
            BackendArg::Sim,
            a.machine.format,
            &cfg,
            a.machine.tlb_entries,
            a.machine.pcpus,
            prefault,
        ),
        guest_mode: GUEST_MODES[a.mode],
        backing: a.backing.name(),
        granularity: large,
        bytes,
        gpa: layout.gpa,
        vcpus: a.vcpus,
        pinned_cpus,
        stages: stages?,
        clock: ClockReport::real(),
        host: layout.host,
        cfg,
    })
}

/// Every stage's native baseline, filled into its row, after the last stage: one run between
/// two stages passed over as much other host memory, which evicted from the host's caches what
/// the next stage would have found there (its page tables' and the host's own), and made that
/// stage slower in real time than in the simulation, whose native baselines run outside it
/// (KVM_ADJUST_MAPPINGS at `-v 1`: 3.3-4.5 ms after UPDATE's baseline, 2.4-3.0 ms without).
fn with_natives(
    guest: [Result<StageRow, String>; 3],
    native_ram: &GuestRam,
    params: impl Fn(Stage) -> StageParams,
    a: &PageTableTestArgs,
) -> Result<Vec<StageRow>, String> {
    let natives = Phase::start(crate::report::NATIVE_PHASE, quiet(a.out.json));
    let rows = Stage::ALL.iter().zip(guest).map(|(&s, row)| {
        let mut row = row?;
        // Real time on host threads: outside the simulation under --clock virtual.
        let native = virtual_time::outside(|| {
            native_stage_baseline(native_ram, params(s), a.vcpus as usize)
        })
        .map_err(|e| e.to_string())?;
        row.native = native;
        row.ratio = ratio(row.time, native);
        Ok(row)
    });
    let rows = rows.collect();
    natives.done();
    rows
}

/// The progress line of the machine's set-up.
fn mapping_phase(a: &PageTableTestArgs, cfg: &VmConfig, bytes: u64) -> Phase {
    Phase::start(
        format!(
            "sim ({}, cmo {}, rebuild {}): mapping {} of {} guest RAM{}",
            a.machine.format.name(),
            cfg.cmo.name(),
            cfg.rebuild.name(),
            format_size(bytes),
            a.backing.name(),
            crate::backend::native_note(a.backing)
        ),
        quiet(a.out.json),
    )
}

/// Runs one stage on `m` (switching dirty logging first where the stage needs it); its native
/// baseline is left for the caller to fill in.
fn run_stage<F: PteFormat>(
    m: &Machine<F>,
    params: StageParams,
    a: &PageTableTestArgs,
) -> Result<StageRow, String> {
    let (stage, vcpus) = (params.stage, a.vcpus as usize);
    // Counted from before the logging switch: recovering blocks when logging stops is
    // part of what the adjust stage measures.
    let before = m.vm().stats();
    let model_before = virtual_time::model_now();
    let logging_switch = match stage {
        Stage::CreateMappings => None,
        Stage::UpdateMappings | Stage::AdjustMappings => {
            let t0 = Stopwatch::start();
            let on = stage == Stage::UpdateMappings;
            m.set_dirty_logging(on).map_err(|e| e.to_string())?;
            Some(t0.elapsed())
        }
    };
    let p = Phase::start(
        format!("{} on {vcpus} vCPU(s)", stage.name()),
        quiet(a.out.json),
    );
    let run = m.run(Workload::Stage(params)).map_err(|e| e.to_string())?;
    let after = m.vm().stats();
    let sim_model = virtual_time::model_now()
        .zip(model_before)
        .map(|(a, b)| virtual_time::model_since(&a, &b));
    p.done();
    let d = |f: fn(&Stats) -> u64| f(&after).saturating_sub(f(&before));
    Ok(StageRow {
        stage: stage.name(),
        time: run.wall,
        native: Duration::ZERO,
        ratio: 0.0,
        logging_switch,
        faults: run.vcpus.iter().map(|v| v.counters.faults).sum(),
        pf_fixed: d(|s| s.pf_fixed),
        pf_fast: d(|s| s.pf_fast),
        pf_spurious: d(|s| s.pf_spurious),
        pf_retry: d(|s| s.pf_retry),
        splits: d(|s| s.splits),
        rebuilds: d(|s| s.recoveries),
        remote_tlb_flushes: d(|s| s.remote_tlb_flush),
        bbm_breaks: d(|s| s.bbm_breaks),
        cache_cleans: d(|s| s.cache_cleans),
        cache_clean_bytes: d(|s| s.cache_clean_bytes),
        sim_model,
    })
}

/// The selftest's lines, then each stage's figures.
fn print_run(a: &PageTableTestArgs, r: &Report) {
    let on_off = |b: bool| if b { "on" } else { "off" };
    println!("Testing guest mode: {}", r.guest_mode);
    println!("Testing memory backing src type: {}", r.backing);
    println!(
        "Testing memory backing src granularity: {:#x}",
        r.granularity
    );
    println!("Testing memory size(aligned): {:#x}", r.bytes);
    println!("Guest physical test memory offset: {:#x}", r.gpa);
    println!("Host  virtual  test memory offset: {:#x}", r.host);
    println!("Number of testing vCPUs: {}", r.vcpus);
    if let Some(line) = crate::report::pinned_line(r.pinned_cpus.as_deref()) {
        println!("{line}");
    }
    println!(
        "{}",
        format_header(BackendArg::Sim, a.machine.format, &r.cfg)
    );
    println!(
        "Dirty logging: eager split {}, blocks recovered {}",
        on_off(r.cfg.eager_split),
        r.cfg.recover.name()
    );
    println!("Started all vCPUs successfully");
    let i = a.machine.format.info();
    for f in &r.stages {
        if let Some(d) = f.logging_switch {
            let on = f.stage == Stage::UpdateMappings.name();
            let what = if on { "Enabling" } else { "Disabling" };
            println!("{what} dirty logging time: {}", ts(d));
        }
        println!("{}: total execution time: {}", f.stage, ts(f.time));
        println!(
            "  faults taken: {} (slow path fixed {}, fast path {}, spurious {}, retried {})",
            f.faults, f.pf_fixed, f.pf_fast, f.pf_spurious, f.pf_retry
        );
        println!(
            "  blocks split: {}, rebuilt: {}; remote TLB flushes: {}",
            f.splits, f.rebuilds, f.remote_tlb_flushes
        );
        if i.break_before_make || i.cache_maintenance {
            println!(
                "  break-before-make: {} entries broken; cache maintenance: {} passes over {}",
                f.bbm_breaks,
                f.cache_cleans,
                format_size(f.cache_clean_bytes)
            );
        }
        if let Some(m) = f.sim_model.as_ref().and_then(virtual_time::model_line) {
            println!("  {m}");
        }
        println!("  native: {} (guest/native {:.2}x)", ts(f.native), f.ratio);
        println!();
    }
    if let Some(l) = r.clock.line() {
        println!("{l}");
    }
}

/// `--compare`'s table (a row per configuration), then each patch's improvement: patch 1
/// is rows 0 → 1 (cmo always → on-install), patch 2 rows 1 → 3 (break-first → install-first).
fn print_comparison(a: &PageTableTestArgs, sweep: &Sweep<Report>) {
    let cfg = vm_config(a);
    let bytes = sizes(a).map_or(a.bytes, |s| s.0);
    println!(
        "page-table-test --compare: -s {} -b {} -v {} --format stage2, eager split {}, recover {}{}",
        a.backing.name(),
        format_size(bytes),
        a.vcpus,
        if cfg.eager_split { "on" } else { "off" },
        cfg.recover.name(),
        match a.out.repeat {
            1 => String::new(),
            n => format!(" (medians of {n} runs per row)"),
        }
    );
    sweep.print(METRICS);
    let t = |row: usize, m: usize| match sweep.sweep.get(row).map(|r| &r.outcome) {
        Some(RowOutcome::Done(r)) => r.median(&METRICS[m]),
        _ => None,
    };
    let gain = |stage: Stage, before: usize, after: usize| {
        let m = stage as usize;
        let (b, af) = (t(before, m), t(after, m));
        let pct = match (b, af) {
            (Some(b), Some(af)) if b > 0.0 => format!("{:+.2}%", 100.0 * (b - af) / b),
            _ => "-".into(),
        };
        let s = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.9}s"));
        println!(
            "  {}: before {} -> after {}  {pct}",
            stage.name(),
            s(b),
            s(af)
        );
    };
    println!();
    println!(
        "Patch 1 (CMOs only by the installing fault), always -> on-install, rebuild break-first:"
    );
    for stage in Stage::ALL {
        gain(stage, 0, 1);
    }
    println!("Patch 2 (install the block first), break-first -> install-first, cmo on-install:");
    gain(Stage::AdjustMappings, 1, 3);
    let faults = |row| t(row, 3).map_or("-".into(), |f| format!("{f:.0}"));
    println!(
        "  faults taken during {}: break-first {}, install-first {}",
        Stage::AdjustMappings.name(),
        faults(1),
        faults(3)
    );
}
