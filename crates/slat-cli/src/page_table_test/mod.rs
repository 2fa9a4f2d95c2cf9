//! `slat page-table-test`: KVM's `kvm_page_table_test` (the arm64 stage-2 patches: cache maintenance only by the installing fault, install-first block rebuild). Every vCPU walks the same
//! region in three timed stages — create mappings, update them with dirty logging on (block
//! splits, read-only → read-write), adjust them with logging off (blocks rebuilt) — so the
//! figures are dominated by concurrent faults on the same addresses: what cache maintenance
//! "only by the installing fault" and the "install first" block rebuild improve on arm64.
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

use crate::args::{backing, guest_size, variant, MachineArgs, OutputArgs, Switch};
use crate::args::{BackendArg, FormatArg};
use crate::driver::{Benchmark, Common};
use crate::error::{CliError, CliResult};
use crate::limits::GuestMemory;
use crate::output::{Better, Metric};
use crate::report::{format_header, quiet, ratio, ts, Phase};
use clap::Args;
use serde_json::json;
use slat::{CmoPolicy, PteFormat, RebuildOrder, RecoverVariant, Stats, VmConfig};
use slat_addr::PAGE_SIZE;
use slat_machine::page_table_stage::{native_stage_baseline, Stage, StageParams};
use slat_machine::{Machine, MachineConfig, Workload};
use slat_workload::RegionSpec;
use slat_workload::{format_size, Backing, GuestRam, Layout};
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
    /// anonymous_hugetlb_1gb, shmem. Hugetlb needs pages reserved first, e.g.
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
    /// always|on-install` × `--rebuild break-first|install-first` (other flags as given), then
    /// one table with the relative improvement of `--cmo on-install` and of `--rebuild
    /// install-first`. Needs --format stage2.
    #[arg(long)]
    pub compare: bool,
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

/// One stage's figures.
#[derive(Clone)]
struct StageFigures {
    stage: Stage,
    time: Duration,
    native: Duration,
    faults: u64,
    stats: Stats,
    /// Time to switch logging before the stage (enable before update, disable before adjust).
    logging_switch: Option<Duration>,
}

/// Refuses a guest mode the model does not implement.
fn check_mode(a: &PageTableTestArgs) -> CliResult {
    if a.mode < GUEST_MODES.len() {
        return Ok(());
    }
    Err(CliError::bad(format!(
        "guest mode {} is not implemented; -m takes {}",
        a.mode,
        GUEST_MODES
            .iter()
            .enumerate()
            .map(|(i, m)| format!(
                "{i} ({})",
                m.split_whitespace().collect::<Vec<_>>().join(" ")
            ))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// Runs the benchmark: `--compare`'s four configurations, or the driver's runs.
pub fn run(a: &PageTableTestArgs) -> CliResult {
    if !a.compare {
        return crate::driver::run(a);
    }
    crate::driver::check_output(a.out.plot.as_deref())?;
    a.check()?;
    if a.machine.format != FormatArg::Stage2 {
        return Err(CliError::bad("--compare varies cache maintenance and the rebuild order, which only --format stage2 has"));
    }
    if a.out.repeat > 1 {
        return Err(CliError::bad(
            "--repeat with --compare: the comparison already runs every configuration; drop one of them",
        ));
    }
    let base = vm_config(a);
    let mut runs = Vec::new();
    for rebuild in [RebuildOrder::BreakFirst, RebuildOrder::InstallFirst] {
        for cmo in [CmoPolicy::Always, CmoPolicy::OnInstall] {
            let vm = VmConfig {
                cmo,
                rebuild,
                ..base
            };
            runs.push((vm, run_format(a, vm, false)?));
        }
    }
    if !a.out.json {
        print_comparison(a, &runs);
        return Ok(());
    }
    let docs: Vec<_> = runs.iter().map(|(vm, r)| to_json(a, vm, r)).collect();
    let doc = json!({ "benchmark": "page-table-test", "compare": docs });
    crate::output::print_json(&doc, &[])
}

fn run_format(a: &PageTableTestArgs, vm: VmConfig, text: bool) -> CliResult<Run> {
    Ok(match a.machine.format {
        FormatArg::Ept => run_on::<slat::Ept>(a, vm, text)?,
        FormatArg::Stage2 => run_on::<slat::Stage2>(a, vm, text)?,
    })
}

/// One run: its figures and its JSON.
pub struct Ran {
    run: Run,
    json: Report,
}

impl serde::Serialize for Ran {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.json.serialize(s)
    }
}

impl Benchmark for PageTableTestArgs {
    type Report = Ran;
    const NAME: &'static str = "page-table-test";

    fn common(&self) -> Common<'_> {
        Common {
            backends: &[],
            vary: &[],
            out: &self.out,
        }
    }

    fn check(&self) -> CliResult {
        check_mode(self)?;
        check(self).map_err(CliError::bad)
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Ran> {
        let vm = vm_config(self);
        let run = run_format(self, vm, !self.out.json)?;
        let json = to_json(self, &vm, &run);
        Ok(Ran { run, json })
    }

    fn metrics(&self) -> Vec<Metric<Ran>> {
        METRICS.to_vec()
    }

    fn print(&self, _r: &Ran) {}
}

/// The test memory (`-b` aligned up to the backing page size) and what the machine maps for
/// it: one partition per vCPU, each rounded up to whole pages. Checked arithmetic.
fn sizes(a: &PageTableTestArgs) -> Result<(u64, u64, u64), String> {
    let large = a.backing.page_size().max(PAGE_SIZE);
    let overflow = || {
        format!(
            "-b {} -v {}: the test memory overflows 64 bits",
            a.bytes, a.vcpus
        )
    };
    let bytes = a
        .bytes
        .div_ceil(large)
        .checked_mul(large)
        .ok_or_else(overflow)?;
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
    if let Some(g) = a.gpa {
        if g % align != 0 {
            return Err(format!(
                "-p {g:#x}: the guest physical offset is not aligned to the backing page size ({align:#x}, -s {})",
                a.backing.name()
            ));
        }
    }
    let mem = GuestMemory {
        flags: format!("-b {} -v {}", a.bytes, a.vcpus),
        bytes: total,
    };
    mem.fits_gpa(&[BackendArg::Sim], a.machine.format, a.gpa)?;
    mem.fits_host(a.backing, 2, a.machine.tlb_bytes(a.vcpus))
}

/// One configuration's run.
#[derive(Clone)]
struct Run {
    bytes: u64,
    large: u64,
    gpa: u64,
    stages: Vec<StageFigures>,
}

/// The `--compare` table: stage times per configuration (cache maintenance policy × block
/// rebuild order), and each patch's improvement.
fn print_comparison(a: &PageTableTestArgs, runs: &[(VmConfig, Run)]) {
    let time = |cmo, rebuild, stage| stage_of(runs, cmo, rebuild, stage);
    println!(
        "page-table-test --compare: -s {} -b {} -v {} --format stage2, eager split {}, recover {}",
        a.backing.name(),
        format_size(runs[0].1.bytes),
        a.vcpus,
        if a.eager_split.on() { "on" } else { "off" },
        runs[0].0.recover.name()
    );
    println!(
        "{:<22} {:>14} {:>14} {:>14} {:>14}",
        "stage", "always+brk1st", "oninst+brk1st", "always+inst1st", "oninst+inst1st"
    );
    for stage in Stage::ALL {
        println!(
            "{:<22} {:>13.6}s {:>13.6}s {:>13.6}s {:>13.6}s",
            stage.name(),
            time(CmoPolicy::Always, RebuildOrder::BreakFirst, stage).as_secs_f64(),
            time(CmoPolicy::OnInstall, RebuildOrder::BreakFirst, stage).as_secs_f64(),
            time(CmoPolicy::Always, RebuildOrder::InstallFirst, stage).as_secs_f64(),
            time(CmoPolicy::OnInstall, RebuildOrder::InstallFirst, stage).as_secs_f64(),
        );
    }
    println!();
    print_patches(runs);
}

/// A stage's time in the configuration `cmo` × `rebuild` (zero if it did not run).
fn stage_of(
    runs: &[(VmConfig, Run)],
    cmo: CmoPolicy,
    rebuild: RebuildOrder,
    stage: Stage,
) -> Duration {
    runs.iter()
        .find(|(vm, _)| vm.cmo == cmo && vm.rebuild == rebuild)
        .and_then(|(_, r)| r.stages.iter().find(|f| f.stage == stage))
        .map_or(Duration::ZERO, |f| f.time)
}

/// How much shorter `after` is than `before`, in percent.
fn gain(before: Duration, after: Duration) -> f64 {
    if before.is_zero() {
        0.0
    } else {
        100.0 * (before.as_secs_f64() - after.as_secs_f64()) / before.as_secs_f64()
    }
}

/// Each patch's improvement, stage by stage.
fn print_patches(runs: &[(VmConfig, Run)]) {
    let time = |cmo, rebuild, stage| stage_of(runs, cmo, rebuild, stage);
    println!(
        "Patch 1 (CMOs only by the installing fault), always -> on-install, rebuild break-first:"
    );
    for stage in Stage::ALL {
        let (b, af) = (
            time(CmoPolicy::Always, RebuildOrder::BreakFirst, stage),
            time(CmoPolicy::OnInstall, RebuildOrder::BreakFirst, stage),
        );
        println!(
            "  {}: before {} -> after {}  {:+.2}%",
            stage.name(),
            ts(b),
            ts(af),
            gain(b, af)
        );
    }
    println!("Patch 2 (install the block first), break-first -> install-first, cmo on-install:");
    let (b, af) = (
        time(
            CmoPolicy::OnInstall,
            RebuildOrder::BreakFirst,
            Stage::AdjustMappings,
        ),
        time(
            CmoPolicy::OnInstall,
            RebuildOrder::InstallFirst,
            Stage::AdjustMappings,
        ),
    );
    println!(
        "  {}: before {} -> after {}  {:+.2}%",
        Stage::AdjustMappings.name(),
        ts(b),
        ts(af),
        gain(b, af)
    );
    let faults = |rebuild: RebuildOrder| {
        runs.iter()
            .find(|(vm, _)| vm.cmo == CmoPolicy::OnInstall && vm.rebuild == rebuild)
            .and_then(|(_, r)| r.stages.iter().find(|f| f.stage == Stage::AdjustMappings))
            .map_or(0, |f| f.faults)
    };
    println!(
        "  faults taken during {}: break-first {}, install-first {}",
        Stage::AdjustMappings.name(),
        faults(RebuildOrder::BreakFirst),
        faults(RebuildOrder::InstallFirst)
    );
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

fn run_on<F: PteFormat>(a: &PageTableTestArgs, vm: VmConfig, text: bool) -> Result<Run, String> {
    let q = quiet(a.out.json);
    let large = a.backing.page_size().max(PAGE_SIZE);
    let vcpus = a.vcpus as usize;
    // The machine gives each vCPU a partition; the test shares one region, so the partitions
    // only size it (rounded up to whole pages) and the stages run over its first `bytes`.
    let (bytes, per_vcpu, _) = sizes(a)?;
    let prefault = !a.machine.no_prefault;
    let p = Phase::start(
        format!(
            "sim ({}, cmo {}, rebuild {}): mapping {} of {} guest RAM and as much host memory for the native baseline",
            a.machine.format.name(),
            vm.cmo.name(),
            vm.rebuild.name(),
            format_size(bytes),
            a.backing.name()
        ),
        q,
    );
    let m = Machine::<F>::new(MachineConfig {
        vm,
        region: RegionSpec {
            backing: a.backing,
            vcpus,
            bytes_per_vcpu: per_vcpu,
            overlap: true,
            prefault,
            ..RegionSpec::default()
        },
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
        gpa: a.gpa,
        private: None,
    })
    .map_err(|e| e.to_string())?;
    let native_ram = GuestRam::new(a.backing, bytes, prefault).map_err(|e| e.to_string())?;
    p.done();
    let layout = m.layout();
    if text {
        print_header(a, &vm, bytes, &layout);
    }
    let mut figures = Vec::new();
    for stage in Stage::ALL {
        let f = run_stage(&m, &native_ram, stage, large, bytes, a)?;
        if text {
            print_stage(&f, a.machine.format);
        }
        figures.push(f);
    }
    Ok(Run {
        bytes,
        large,
        gpa: layout.gpa,
        stages: figures,
    })
}

/// The text header, in the kernel selftest's words.
fn print_header(a: &PageTableTestArgs, vm: &VmConfig, bytes: u64, layout: &Layout) {
    let large = a.backing.page_size().max(PAGE_SIZE);
    let vcpus = a.vcpus as usize;
    println!("Testing guest mode: {}", GUEST_MODES[a.mode]);
    println!("Testing memory backing src type: {}", a.backing.name());
    println!("Testing memory backing src granularity: {large:#x}");
    println!("Testing memory size(aligned): {bytes:#x}");
    println!("Guest physical test memory offset: {:#x}", layout.gpa);
    println!("Host  virtual  test memory offset: {:#x}", layout.host);
    println!("Number of testing vCPUs: {vcpus}");
    println!("{}", format_header(BackendArg::Sim, a.machine.format, vm));
    println!(
        "Dirty logging: eager split {}, blocks recovered {}",
        if vm.eager_split { "on" } else { "off" },
        vm.recover.name()
    );
    println!("Started all vCPUs successfully");
}

/// Runs one stage on `m` (switching dirty logging first where the stage needs it) and the
/// native baseline of the same stage on `native_ram`.
fn run_stage<F: PteFormat>(
    m: &Machine<F>,
    native_ram: &GuestRam,
    stage: Stage,
    large: u64,
    bytes: u64,
    a: &PageTableTestArgs,
) -> Result<StageFigures, String> {
    let q = quiet(a.out.json);
    let vcpus = a.vcpus as usize;
    // Counted from before the logging switch: recovering blocks when logging stops is
    // part of what the adjust stage measures.
    let before = m.vm().stats();
    let logging_switch = match stage {
        Stage::CreateMappings => None,
        Stage::UpdateMappings | Stage::AdjustMappings => {
            let on = stage == Stage::UpdateMappings;
            let t0 = std::time::Instant::now();
            m.set_dirty_logging(on).map_err(|e| e.to_string())?;
            Some(t0.elapsed())
        }
    };
    let params = StageParams {
        stage,
        large_page: large,
        bytes,
    };
    let p = Phase::start(format!("{} on {vcpus} vCPU(s)", stage.name()), q);
    let run = m.run(Workload::Stage(params)).map_err(|e| e.to_string())?;
    let after = m.vm().stats();
    p.done();
    let native = native_stage_baseline(native_ram, params, vcpus)
        .ok_or("the native baseline's memory is smaller than the test region")?;
    Ok(StageFigures {
        stage,
        time: run.wall,
        native,
        faults: run.vcpus.iter().map(|v| v.counters.faults).sum(),
        stats: delta(&before, &after),
        logging_switch,
    })
}

/// Counters that moved during a stage.
fn delta(b: &Stats, a: &Stats) -> Stats {
    Stats {
        pf_fixed: a.pf_fixed - b.pf_fixed,
        pf_fast: a.pf_fast - b.pf_fast,
        pf_spurious: a.pf_spurious - b.pf_spurious,
        pf_retry: a.pf_retry - b.pf_retry,
        remote_tlb_flush: a.remote_tlb_flush - b.remote_tlb_flush,
        splits: a.splits - b.splits,
        recoveries: a.recoveries - b.recoveries,
        bbm_breaks: a.bbm_breaks - b.bbm_breaks,
        cache_cleans: a.cache_cleans - b.cache_cleans,
        cache_clean_bytes: a.cache_clean_bytes - b.cache_clean_bytes,
        ..*a
    }
}

fn print_stage(f: &StageFigures, format: FormatArg) {
    if let Some(d) = f.logging_switch {
        let what = if f.stage == Stage::UpdateMappings {
            "Enabling"
        } else {
            "Disabling"
        };
        println!("{what} dirty logging time: {}", ts(d));
    }
    println!("{}: total execution time: {}", f.stage.name(), ts(f.time));
    let s = &f.stats;
    println!(
        "  faults taken: {} (slow path fixed {}, fast path {}, spurious {}, retried {})",
        f.faults, s.pf_fixed, s.pf_fast, s.pf_spurious, s.pf_retry
    );
    println!(
        "  blocks split: {}, rebuilt: {}; remote TLB flushes: {}",
        s.splits, s.recoveries, s.remote_tlb_flush
    );
    let i = format.info();
    if i.break_before_make || i.cache_maintenance {
        println!(
            "  break-before-make: {} entries broken; cache maintenance: {} passes over {}",
            s.bbm_breaks,
            s.cache_cleans,
            format_size(s.cache_clean_bytes)
        );
    }
    println!(
        "  native: {} (guest/native {:.2}x)",
        ts(f.native),
        ratio(f.time, f.native)
    );
    println!();
}

/// One stage's figures, as the report records them.
#[derive(serde::Serialize)]
struct StageRow {
    stage: &'static str,
    time_s: f64,
    native_time_s: f64,
    ratio: f64,
    logging_switch_time_s: Option<f64>,
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
}

/// One configuration's run, as its JSON document carries it (the settings at the top level,
/// as the page-table test always had them).
#[derive(serde::Serialize)]
struct Report {
    benchmark: &'static str,
    backend: &'static str,
    #[serde(flatten)]
    vm: crate::output::VmSettings,
    guest_mode: &'static str,
    backing: &'static str,
    granularity: u64,
    bytes: u64,
    gpa: u64,
    vcpus: u32,
    stages: Vec<StageRow>,
}

/// The report of one run, for JSON.
fn to_json(a: &PageTableTestArgs, vm: &VmConfig, r: &Run) -> Report {
    let stages = r
        .stages
        .iter()
        .map(|f| {
            let s = &f.stats;
            StageRow {
                stage: f.stage.name(),
                time_s: f.time.as_secs_f64(),
                native_time_s: f.native.as_secs_f64(),
                ratio: ratio(f.time, f.native),
                logging_switch_time_s: f.logging_switch.map(|d| d.as_secs_f64()),
                faults: f.faults,
                pf_fixed: s.pf_fixed,
                pf_fast: s.pf_fast,
                pf_spurious: s.pf_spurious,
                pf_retry: s.pf_retry,
                splits: s.splits,
                rebuilds: s.recoveries,
                remote_tlb_flushes: s.remote_tlb_flush,
                bbm_breaks: s.bbm_breaks,
                cache_cleans: s.cache_cleans,
                cache_clean_bytes: s.cache_clean_bytes,
            }
        })
        .collect();
    Report {
        benchmark: "page-table-test",
        backend: "sim",
        vm: crate::output::VmSettings::new(
            crate::args::BackendArg::Sim,
            a.machine.format,
            vm,
            a.machine.tlb_entries,
            a.machine.pcpus,
            !a.machine.no_prefault,
        ),
        guest_mode: GUEST_MODES[a.mode],
        backing: a.backing.name(),
        granularity: r.large,
        bytes: r.bytes,
        gpa: r.gpa,
        vcpus: a.vcpus,
        stages,
    }
}

fn stage_time(r: &Run, stage: Stage) -> Option<f64> {
    r.stages
        .iter()
        .find(|f| f.stage == stage)
        .map(|f| f.time.as_secs_f64())
}

/// The figures `--repeat` summarizes: each stage's time.
const METRICS: &[Metric<Ran>] = &[
    Metric {
        name: "create mappings",
        unit: "s",
        better: Better::Lower,
        get: |r| stage_time(&r.run, Stage::CreateMappings),
    },
    Metric {
        name: "update mappings",
        unit: "s",
        better: Better::Lower,
        get: |r| stage_time(&r.run, Stage::UpdateMappings),
    },
    Metric {
        name: "adjust mappings",
        unit: "s",
        better: Better::Lower,
        get: |r| stage_time(&r.run, Stage::AdjustMappings),
    },
];
