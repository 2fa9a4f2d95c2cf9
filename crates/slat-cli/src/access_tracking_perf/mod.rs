//! `slat access-tracking-perf`: KVM's access_tracking_perf_test on the simulated machine —
//! populate, write and read populated memory, mark it idle, write idle memory, mark it idle
//! again, read idle memory — with, for every guest pass, the same pass on host memory in the
//! same run and the ratio. Like the selftest it checks that after an access pass almost no page
//! is still idle (the accesses were seen by aging), and fails otherwise.
//!
//! Marking idle is the engine's idle page tracking ([`slat::Vm::mark_idle`]): one host thread
//! per vCPU marks that vCPU's pages (vCPU 0 marks everything with `-o`), as the selftest's
//! vCPU threads write page_idle for their own memory.

mod text;

use crate::args::{BackendArg, FormatArg, MachineArgs, OutputArgs, PinArgs, Switch, Workload};
use crate::driver::{lower, Benchmark, Common, Preset};
use crate::error::{CliError, CliResult};
use crate::limits::GuestMemory;
use crate::output::{secs, Metric, RunHead, VmSettings};
use crate::report::{quiet, ratio, ts, Phase};
use crate::virtual_time::{self, ClockArgs, ClockReport, Stopwatch, VirtualRun};
use clap::{Args, ValueEnum};
use serde::Serialize;
use slat::clock::Clock;
use slat::{AgeFlush, AgeReport, Ept, IdleBitmap, PteFormat, Stage2, Timed, Vm};
use slat_addr::{Gpa, PAGE_SHIFT, PAGE_SIZE};
use slat_machine::vtime::{ClockGate, SimThreads, ThreadToken};
use slat_machine::{Machine, MachineConfig, PassReport};
use slat_vt::Virtual;
use slat_workload::{format_size, native_baseline, GuestRam, Layout, PassParams, RegionSpec};
use slat_workload::{Gate, TestMachine};
use std::sync::Arc;
use std::time::Duration;

/// The selftest's limit: at least 90% of the pages must be seen accessed after an access pass.
const MAX_STILL_IDLE: f64 = 0.10;

/// What to do when too many pages are still idle after an access pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IdleCheck {
    /// Exit with an error (the selftest's `-w 0`).
    Fail,
    /// Print a warning and go on (the selftest's `-w 1`).
    Warn,
    /// The selftest's default (`-w -1`): warn when this host is itself a virtual machine
    /// (the `hypervisor` CPU flag) or NUMA balancing is on, where the selftest cannot trust
    /// the host's idle bits; fail otherwise.
    Auto,
}

impl AccessTrackingPerfArgs {
    /// The idle-page check in force (`-w` over `--idle-check`; `auto` resolved) and, for
    /// `auto`, why.
    fn idle_check(&self) -> (IdleCheck, Option<String>) {
        let asked = match self.idle_warn {
            Some(w) if w > 0 => IdleCheck::Warn,
            Some(0) => IdleCheck::Fail,
            Some(_) => IdleCheck::Auto,
            None => self.idle_check,
        };
        if asked != IdleCheck::Auto {
            return (asked, None);
        }
        let read = |p| std::fs::read_to_string(p).unwrap_or_default();
        let vm = read("/proc/cpuinfo")
            .lines()
            .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "hypervisor"));
        let numa = !matches!(read("/proc/sys/kernel/numa_balancing").trim(), "" | "0");
        let (c, why) = match (vm, numa) {
            (true, _) => (IdleCheck::Warn, "this host is a virtual machine (hypervisor CPU flag), so too many idle pages only warn"),
            (false, true) => (IdleCheck::Warn, "NUMA balancing is on (/proc/sys/kernel/numa_balancing), so too many idle pages only warn"),
            (false, false) => (IdleCheck::Fail, "not a virtual machine and no NUMA balancing, so too many idle pages fail"),
        };
        (c, Some(format!("auto: {why}")))
    }
}

/// Flags of `slat access-tracking-perf` (the selftest's, plus slat's variant switches).
#[derive(Debug, Clone, Args)]
#[command(after_long_help = "\
Lines, as the selftest prints them (`%-30s: %ld.%09lds`): Populating memory, Writing to \
populated memory, Reading from populated memory, Mark memory idle, Writing to idle memory, \
Mark memory idle, Reading from idle memory. After each guest pass a `native baseline` line \
gives the same pass on host memory and the ratio (every baseline runs after the last guest \
pass, so that none evicts from the host's caches what the next guest pass finds there); after \
each pass over idle memory a `still idle` line gives the pages aging did not see accessed. \
Mark memory idle is one host thread per vCPU's memory (as the selftest's vCPU threads mark \
their own), timed from all of them ready to the last one done; with -c, marking thread i runs \
on vCPU i's CPU.

The series fast page fault for the TDP MMU was measured on `Writing to idle memory` with A/D bits \
off, so that every access to idle memory takes an access-tracking fault:
  slat access-tracking-perf --compare --ad-bits off
runs fast PF on/off x -v 1/-v 2 in this one process and prints one table.")]
pub struct AccessTrackingPerfArgs {
    #[command(flatten)]
    pub work: Workload,
    /// Flush TLBs when marking idle (clear_flush_young). Off, like page_idle's clear_young:
    /// accesses through translations the vCPUs cached before the marking go unseen.
    #[arg(long = "age-flush", value_enum, default_value = "off")]
    pub age_flush: Switch,
    /// What happens when more than 10% of the pages are still idle after an access pass:
    /// `fail` (exit with an error), `warn` (print a warning and go on), or `auto` (the
    /// selftest's default: warn when this host is itself a virtual machine, seen from the
    /// `hypervisor` CPU flag, or NUMA balancing is on; fail otherwise).
    #[arg(long = "idle-check", value_enum, default_value = "auto")]
    pub idle_check: IdleCheck,
    /// The selftest's spelling of --idle-check: N > 0 warn, 0 fail, N < 0 auto.
    #[arg(
        short = 'w',
        value_name = "N",
        allow_negative_numbers = true,
        conflicts_with = "idle_check"
    )]
    pub idle_warn: Option<i64>,
    /// Run a comparison instead of one configuration: fast page fault on and off, each with
    /// -v 1 and -v 2 (the given -b, -s, -o and --ad-bits), one table at the end (with --repeat
    /// each row N times; with --plot bars per row).
    #[arg(long)]
    pub compare: bool,
    /// The machine: `sim` (the engine), or `kvm`, which needs the host's idle page tracking
    /// (`/sys/kernel/mm/page_idle/bitmap`, as the selftest does) and is refused with the reason
    /// when it is missing.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    #[command(flatten)]
    pub pin: PinArgs,
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub clock: ClockArgs,
}

/// `--compare`: fast page fault on and off, each with one and two vCPUs.
#[rustfmt::skip]
const COMPARE: &[Preset<AccessTrackingPerfArgs>] = &[
    Preset { settings: &["vcpus=1", "fast-pf=on"], apply: |a| (a.work.vcpus, a.machine.fast_pf) = (1, Switch::On) },
    Preset { settings: &["vcpus=1", "fast-pf=off"], apply: |a| (a.work.vcpus, a.machine.fast_pf) = (1, Switch::Off) },
    Preset { settings: &["vcpus=2", "fast-pf=on"], apply: |a| (a.work.vcpus, a.machine.fast_pf) = (2, Switch::On) },
    Preset { settings: &["vcpus=2", "fast-pf=off"], apply: |a| (a.work.vcpus, a.machine.fast_pf) = (2, Switch::Off) },
];

/// One guest pass and the same pass by host threads on host memory.
#[derive(Serialize)]
struct Pass {
    name: &'static str,
    #[serde(rename = "time_s", serialize_with = "secs")]
    time: Duration,
    #[serde(rename = "native_time_s", serialize_with = "secs")]
    native: Duration,
    ratio_guest_over_native: f64,
    faults: u64,
    walks: u64,
    /// Accessed/Dirty bit updates by the walker.
    ad_updates: u64,
}

/// One marking of all guest memory as idle.
#[derive(Serialize)]
struct Mark {
    #[serde(rename = "time_s", serialize_with = "secs")]
    time: Duration,
    ms_per_gib: f64,
    pages: u64,
    young_pages: u64,
    aged_leaves: u64,
    dirty_pages: u64,
    /// Leaves another thread was changing.
    contended_leaves: u64,
    /// TLBs were flushed.
    flushed: bool,
}

/// Pages aging did not see accessed after an access pass.
#[derive(Serialize)]
struct IdleAfter {
    after: &'static str,
    pages: u64,
    still_idle: u64,
    fraction: f64,
}

/// The run's settings, as the report records them.
#[derive(Serialize)]
struct Config {
    #[serde(flatten)]
    vm: VmSettings,
    vcpus: u32,
    bytes_per_vcpu: u64,
    backing: &'static str,
    overlap: bool,
    age_flush: bool,
    /// `fail` or `warn` (`auto` resolved).
    idle_check: IdleCheck,
    /// Why, when `auto` chose it.
    #[serde(skip_serializing_if = "Option::is_none")]
    idle_check_reason: Option<String>,
    /// `-c`: vCPU i's thread was pinned to `pinned_cpus[i]` (read back from the kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pinned_cpus: Option<Vec<usize>>,
}

/// One run: its JSON, the engine's counters and the selftest's lines for the text report.
#[derive(Serialize)]
pub struct Report {
    #[serde(flatten)]
    head: RunHead,
    config: Config,
    passes: Vec<Pass>,
    mark_memory_idle: Vec<Mark>,
    still_idle: Vec<IdleAfter>,
    warnings: Vec<String>,
    stats: serde_json::Value,
    /// Whose time the report's times are.
    #[serde(flatten)]
    clock: ClockReport,
    #[serde(skip)]
    engine: slat::Stats,
    #[serde(skip)]
    lines: Vec<String>,
}

impl Report {
    fn pass(&self, name: &str) -> Option<&Pass> {
        self.passes.iter().find(|p| p.name == name)
    }
}

impl Benchmark for AccessTrackingPerfArgs {
    type Report = Report;
    const NAME: &'static str = "access-tracking-perf";

    const PRESETS: &'static [Preset<Self>] = COMPARE;

    fn compare(&self) -> bool {
        self.compare
    }

    fn common(&self) -> Common<'_> {
        Common::of(&self.backend, &self.out)
    }

    fn refuse(&self) -> Option<String> {
        (self.compare && self.pin.cpus.is_some()).then(|| {
            "-c: --compare runs -v 1 and -v 2, which need different CPU lists; drop -c or --compare".into()
        })
    }

    fn check(&self) -> CliResult {
        let format = self.machine.format;
        format
            .check_backends(&self.backend)
            .map_err(CliError::bad)?;
        if self.backend.contains(&BackendArg::Kvm) {
            // KVM ages guest memory only through the host's page_idle interface (the
            // selftest's route), which slat does not drive: no host can run this, so it is
            // bad input.
            const PAGE_IDLE: &str = "/sys/kernel/mm/page_idle/bitmap";
            return Err(CliError::bad(if std::path::Path::new(PAGE_IDLE).exists() {
                format!("access-tracking-perf --backend kvm is not built yet (this host has {PAGE_IDLE}, but slat does not drive it); use --backend sim")
            } else {
                format!("access-tracking-perf --backend kvm needs {PAGE_IDLE} (a kernel built with CONFIG_IDLE_PAGE_TRACKING), which this host lacks; use --backend sim")
            }));
        }
        // Sizes the machine can hold, with the native baseline mapped beside it.
        let check = || {
            let vcpus = self.work.vcpus;
            self.pin.plan(vcpus)?;
            let mem = GuestMemory::per_vcpu(vcpus, self.work.bytes)?;
            mem.fits_gpa(&[BackendArg::Sim], format, None)?;
            mem.fits_host(self.work.backing, 2, self.machine.tlb_bytes(vcpus))
        };
        check().map_err(CliError::bad)
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Report> {
        let vt = self.clock.start()?;
        let sim = vt.as_ref().map(VirtualRun::threads);
        // The machine is gone when `run_format` returns, so the simulation can end.
        let mut r = match (self.machine.format, sim) {
            (FormatArg::Ept, None) => run_format::<Ept>(self, None)?,
            (FormatArg::Stage2, None) => run_format::<Stage2>(self, None)?,
            (FormatArg::Ept, sim) => run_format::<Timed<Ept, Virtual>>(self, sim)?,
            (FormatArg::Stage2, sim) => run_format::<Timed<Stage2, Virtual>>(self, sim)?,
        };
        r.clock = virtual_time::finish(vt)?;
        Ok(r)
    }

    fn metrics(&self) -> Vec<Metric<Report>> {
        METRICS.to_vec()
    }

    fn headline(&self) -> Vec<&'static str> {
        vec![METRICS[0].name, METRICS[1].name]
    }

    fn print(&self, r: &Report) {
        text::print_run(self, r)
    }

    fn sweep_title(&self, _kind: BackendArg) -> String {
        text::compare_title(self)
    }
}

fn pass_time(r: &Report, name: &str, native: bool) -> Option<f64> {
    let p = r.pass(name)?;
    Some(if native { p.native } else { p.time }.as_secs_f64())
}

const WRITE: &str = "Writing to idle memory";
const READ: &str = "Reading from idle memory";

/// The headline figures, in the order of the `--compare` table.
#[rustfmt::skip]
const METRICS: &[Metric<Report>] = &[
    lower("mark memory idle (first)", "s", |r| r.mark_memory_idle.first().map(|m| m.time.as_secs_f64())),
    lower("writing to idle memory", "s", |r| pass_time(r, WRITE, false)),
    lower("writing to idle memory native", "s", |r| pass_time(r, WRITE, true)),
    lower("writing to idle memory guest/native", "x", |r| r.pass(WRITE).map(|p| p.ratio_guest_over_native)),
    lower("reading from idle memory", "s", |r| pass_time(r, READ, false)),
    lower("reading from idle memory guest/native", "x", |r| r.pass(READ).map(|p| p.ratio_guest_over_native)),
    lower("writing to idle memory faults", "count", |r| r.pass(WRITE).map(|p| p.faults as f64)),
    lower("populating memory", "s", |r| pass_time(r, "Populating memory", false)),
];

fn flush_mode(a: &AccessTrackingPerfArgs) -> AgeFlush {
    if a.age_flush.on() {
        AgeFlush::Flush
    } else {
        AgeFlush::NoFlush
    }
}

fn machine_config(a: &AccessTrackingPerfArgs) -> MachineConfig {
    MachineConfig {
        vm: a.machine.vm_config(),
        region: RegionSpec {
            backing: a.work.backing,
            vcpus: a.work.vcpus as usize,
            bytes_per_vcpu: a.work.bytes,
            slots: 1,
            overlap: a.work.overlap,
            prefault: !a.machine.no_prefault,
            dirty: Default::default(),
        },
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
        gpa: None,
        private: None,
    }
}

/// Records too many pages still idle after an access pass: an error under `--idle-check
/// fail`, a warning under `warn`.
fn idle_verdict(
    a: &AccessTrackingPerfArgs,
    idle: &IdleAfter,
    r: &mut Report,
) -> Result<(), String> {
    if idle.fraction < MAX_STILL_IDLE {
        return Ok(());
    }
    let tlb = a.machine.tlb_entries;
    let msg = format!(
        "{} of {} pages ({:.1}%) are still idle after `{}`; at most {:.0}% may be. \
         With --age-flush off (clear_young, like page_idle) accesses through TLB entries cached \
         before the marking are not seen, and each vCPU's TLB holds {tlb} 4 KiB, 32 2 MiB and 4 1 GiB \
         translations: use more memory (-b), --age-flush on, or --idle-check warn",
        idle.still_idle,
        idle.pages,
        100.0 * idle.fraction,
        idle.after,
        100.0 * MAX_STILL_IDLE,
    );
    if r.config.idle_check != IdleCheck::Warn {
        return Err(msg);
    }
    if !quiet(a.out.json) {
        eprintln!("slat: warning: {msg}");
    }
    r.warnings.push(msg);
    Ok(())
}

/// The run on the simulated machine with format `F`, its text lines recorded in the report.
/// In virtual time (`sim` given, `F` timed) the vCPUs and the marking threads are simulated
/// CPUs.
fn run_format<F: PteFormat>(
    a: &AccessTrackingPerfArgs,
    sim: Option<Arc<dyn SimThreads>>,
) -> Result<Report, String> {
    let vcpus = a.work.vcpus;
    let mut cfg = machine_config(a);
    if sim.is_some() {
        // One physical CPU per vCPU: the token pool must never block a simulated thread.
        cfg.pcpus = vcpus as usize;
    }
    let (vm_cfg, prefault) = (cfg.vm, cfg.region.prefault);
    let total = a.work.bytes * vcpus as u64;
    let p = Phase::start(
        format!(
            "mapping {} of {} guest RAM ({}){}",
            format_size(total),
            a.work.backing,
            a.machine.format.name(),
            crate::backend::native_note(a.work.backing)
        ),
        quiet(a.out.json),
    );
    let m = Machine::<F>::with_sim(cfg, sim.clone()).map_err(|e| e.to_string())?;
    let pinned = pin(a, &m)?;
    let pinned_cpus = pinned.clone();
    let psize = a.work.backing.page_size().max(PAGE_SIZE);
    let native_ram = GuestRam::new(a.work.backing, total.div_ceil(psize) * psize, prefault)
        .map_err(|e| e.to_string())?;
    p.done();
    let layout = m.layout();
    // One bitmap per marking thread: each vCPU's partition, or everything for vCPU 0 (-o).
    let regions = if a.work.overlap { 1 } else { vcpus as usize };
    let mut bitmaps = (0..regions)
        .map(|i| {
            let (gpa, _, pages) = layout.region(i);
            IdleBitmap::new::<F>(Gpa::new(gpa).gfn(), pages).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut r = empty_report(a, &vm_cfg, prefault, m.pcpus(), pinned, &layout, total);
    let vm = m.vm().clone();
    let write = PassParams {
        write_percent: 100,
        ..PassParams::default()
    };
    let read = PassParams {
        write_percent: 0,
        ..PassParams::default()
    };
    let mut natives = Vec::new();
    let mut access = |name, params, r: &mut Report| {
        access_pass(&m, name, params, r)?;
        // The pass's native line is the last one, filled in by `native_passes`.
        natives.push((params, r.lines.len().saturating_sub(1)));
        Ok::<_, String>(())
    };
    let mark = |bitmaps: &mut [IdleBitmap], r: &mut Report| -> Result<(), String> {
        let m = mark_idle(
            &vm,
            bitmaps,
            flush_mode(a),
            sim.as_ref(),
            pinned_cpus.as_deref(),
        )?;
        r.lines
            .push(format!("{:<30}: {}", "Mark memory idle", ts(m.time)));
        r.mark_memory_idle.push(m);
        Ok(())
    };
    let still_idle = |after, bitmaps: &mut [IdleBitmap], r: &mut Report| {
        let still_idle: u64 = bitmaps.iter_mut().map(|b| vm.read_idle(b)).sum();
        let pages: u64 = bitmaps.iter().map(|b| b.npages()).sum();
        let fraction = still_idle as f64 / pages.max(1) as f64;
        r.lines.push(format!(
            "{:<30}: {still_idle} of {pages} pages ({:.2}%)",
            "  still idle",
            100.0 * fraction
        ));
        let idle = IdleAfter {
            after,
            pages,
            still_idle,
            fraction,
        };
        let verdict = idle_verdict(a, &idle, r);
        r.still_idle.push(idle);
        verdict
    };
    access("Populating memory", write, &mut r)?;
    access("Writing to populated memory", write, &mut r)?;
    access("Reading from populated memory", read, &mut r)?;
    mark(&mut bitmaps, &mut r)?;
    access(WRITE, write, &mut r)?;
    still_idle(WRITE, &mut bitmaps, &mut r)?;
    mark(&mut bitmaps, &mut r)?;
    access(READ, read, &mut r)?;
    still_idle(READ, &mut bitmaps, &mut r)?;
    let p = Phase::start(crate::report::NATIVE_PHASE, quiet(a.out.json));
    native_passes(layout, &native_ram, &natives, &mut r)?;
    p.done();
    r.engine = vm.stats();
    r.stats = crate::demand_paging::stats_json(&r.engine);
    Ok(r)
}

/// The report before any pass: settings and the selftest's header lines.
fn empty_report(
    a: &AccessTrackingPerfArgs,
    vm_cfg: &slat::VmConfig,
    prefault: bool,
    pcpus: usize,
    pinned: Option<Vec<usize>>,
    layout: &Layout,
    total: u64,
) -> Report {
    let (idle_check, idle_check_reason) = a.idle_check();
    let format = a.machine.format;
    Report {
        head: RunHead {
            benchmark: "access-tracking-perf",
            backend: "sim",
            format: Some(format.name()),
        },
        config: Config {
            vm: VmSettings::new(
                BackendArg::Sim,
                format,
                vm_cfg,
                a.machine.tlb_entries,
                Some(pcpus),
                prefault,
            ),
            vcpus: a.work.vcpus,
            bytes_per_vcpu: a.work.bytes,
            backing: a.work.backing.name(),
            overlap: a.work.overlap,
            age_flush: a.age_flush.on(),
            idle_check,
            idle_check_reason,
            pinned_cpus: pinned,
        },
        passes: Vec::new(),
        mark_memory_idle: Vec::new(),
        still_idle: Vec::new(),
        warnings: Vec::new(),
        stats: serde_json::Value::Null,
        clock: ClockReport::real(),
        engine: slat::Stats::default(),
        lines: text::header(a, vm_cfg, layout, total),
    }
}

/// One guest pass, recorded in `r`; its native baseline comes later ([`native_passes`]).
fn access_pass<F: PteFormat>(
    m: &Machine<F>,
    name: &'static str,
    params: PassParams,
    r: &mut Report,
) -> Result<(), String> {
    let guest = m.run_pass(params).map_err(|e| e.to_string())?;
    let c = guest.vcpus.iter().map(|v| &v.counters);
    let pass = Pass {
        name,
        time: guest.wall,
        native: Duration::ZERO,
        ratio_guest_over_native: 0.0,
        faults: c.clone().map(|c| c.faults).sum(),
        walks: c.clone().map(|c| c.walks).sum(),
        ad_updates: c.map(|c| c.ad_updates).sum(),
    };
    r.lines.push(format!("{name:<30}: {}", ts(pass.time)));
    // Its native baseline's line, written when that has run.
    r.lines.push(String::new());
    r.passes.push(pass);
    Ok(())
}

/// The native baseline of every guest pass (`params` and the index of its line, in the order
/// of `r.passes`), run after
/// the last guest pass: one run between two guest passes went over as much other host memory
/// and evicted from the host's caches what the next guest pass finds there (the simulated
/// page tables, the host's own), so the guest passes after the first measured slower in real
/// time than in virtual time, where native baselines run outside the simulation. Each fills
/// in its pass's figures and its line.
fn native_passes(
    layout: Layout,
    native_ram: &GuestRam,
    params: &[(PassParams, usize)],
    r: &mut Report,
) -> Result<(), String> {
    for (i, &(p, line_at)) in params.iter().enumerate() {
        // Real time on host threads: outside the simulation under --clock virtual.
        let native: PassReport = virtual_time::outside(|| native_baseline(layout, native_ram, p))
            .map_err(|e| e.to_string())?;
        let Some(pass) = r.passes.get_mut(i) else {
            continue;
        };
        pass.native = native.wall;
        pass.ratio_guest_over_native = ratio(pass.time, native.wall);
        let line = format!(
            "{:<30}: {} (guest/native {:.2}x)",
            "  native baseline",
            ts(pass.native),
            pass.ratio_guest_over_native
        );
        if let Some(slot) = r.lines.get_mut(line_at) {
            *slot = line;
        }
    }
    Ok(())
}

/// `-c`: pins the vCPU threads (and the main thread if the list names one more CPU).
fn pin<F: PteFormat>(
    a: &AccessTrackingPerfArgs,
    m: &Machine<F>,
) -> Result<Option<Vec<usize>>, String> {
    let Some(plan) = a.pin.plan(a.work.vcpus)? else {
        return Ok(None);
    };
    let got = m.pin_vcpus(&plan.vcpus).map_err(|e| format!("-c: {e}"))?;
    crate::backend::check_pinned(&plan.vcpus, &got)?;
    if let Some(cpu) = plan.main {
        slat_workload::cpus::pin_thread(0, cpu)
            .map_err(|e| format!("-c: cannot pin the main thread to CPU {cpu}: {e}"))?;
    }
    Ok(Some(plan.vcpus))
}

/// Marks every bitmap idle, one host thread per bitmap (the selftest's vCPU threads each mark
/// their own memory), and times the whole marking. (These host threads hold no vCPU in
/// guest mode, so the engine does not refuse the flush; its error is passed on all the same.)
/// In virtual time (`sim`) each marking thread is a simulated CPU, registered in bitmap order.
fn mark_idle<F: PteFormat>(
    vm: &Vm<F>,
    bitmaps: &mut [IdleBitmap],
    flush: AgeFlush,
    sim: Option<&Arc<dyn SimThreads>>,
    cpus: Option<&[usize]>,
) -> Result<Mark, String> {
    let pages: u64 = bitmaps.iter().map(|b| b.npages()).sum();
    let (reports, time): (Vec<_>, _) = match bitmaps {
        [one] => {
            let t0 = Stopwatch::start();
            let r = vm.mark_idle(one, flush, |_, _| {});
            (vec![r], t0.elapsed())
        }
        many => mark_in_parallel(vm, many, flush, sim, cpus)?,
    };
    let gib = (pages << PAGE_SHIFT) as f64 / (1u64 << 30) as f64;
    let mut m = Mark {
        time,
        ms_per_gib: time.as_secs_f64() * 1e3 / gib,
        pages,
        young_pages: 0,
        aged_leaves: 0,
        dirty_pages: 0,
        contended_leaves: 0,
        flushed: false,
    };
    for x in reports {
        let x = x.map_err(|e| e.to_string())?;
        m.young_pages += x.young_pages;
        m.aged_leaves += x.aged_leaves;
        m.dirty_pages += x.dirty_pages;
        m.contended_leaves += x.contended_leaves;
        m.flushed |= x.flushed;
    }
    Ok(m)
}

type AgeResult = Result<AgeReport, slat::FlushError>;

/// The parallel mark's three gates, on one page of their own: in virtual time the line model
/// prices a line's first touch by whether the line before it in its 4 KiB page is cached, so
/// gates on the stack, where a page boundary falls anywhere under address-space
/// randomization, made the mark's virtual time differ between two runs of one command.
#[repr(C, align(4096))]
struct MarkGates<C: Clock> {
    ready: ClockGate<C>,
    go: ClockGate<C>,
    done: ClockGate<C>,
}

impl<C: Clock> MarkGates<C> {
    fn new(parties: usize) -> Box<Self> {
        Box::new(MarkGates {
            ready: ClockGate::with_parties(parties),
            go: ClockGate::with_parties(parties),
            done: ClockGate::with_parties(parties),
        })
    }
}

/// One thread per bitmap, and the marking's time: from the moment every thread is ready
/// (a `ready` gate, after which the host reads its clock and opens the `go` gate) to the last
/// one's end (a `done` gate), all gates in the format's clock. (With one start gate, the host
/// sometimes woke from it after the markers had finished: 0.01 ms for 512 MiB.) The
/// selftest's vCPU threads mark their own memory, threads that exist already: timing the
/// spawns as well measured thread creation, which costs about half a millisecond here (a
/// nested VM with shadow paging traps the new stacks' mappings), and made a two-thread mark
/// of 512 MiB take 1.7-2.0 ms on one core against 0.73 ms for one thread marking it all.
/// Pinned (`-c`), marking thread i runs on vCPU i's CPU, as the selftest's vCPU threads mark
/// on theirs. In virtual time the host leaves the done gate at the last thread's clock; then
/// it steps out of the simulation while it joins them.
fn mark_in_parallel<F: PteFormat>(
    vm: &Vm<F>,
    bitmaps: &mut [IdleBitmap],
    flush: AgeFlush,
    sim: Option<&Arc<dyn SimThreads>>,
    cpus: Option<&[usize]>,
) -> Result<(Vec<AgeResult>, Duration), String> {
    let gates = MarkGates::<F::Clock>::new(bitmaps.len() + 1);
    let (ready, go, done) = (&gates.ready, &gates.go, &gates.done);
    // Registered before any thread starts, in bitmap order (the simulation's tie order), so
    // a failed registration leaves no thread waiting at the gate.
    let tokens = (0..bitmaps.len())
        .map(|i| match sim {
            Some(sim) => sim.register(&format!("mark{i}")).map(Some),
            None => Ok(None),
        })
        .collect::<Result<Vec<Option<Box<dyn ThreadToken>>>, String>>()?;
    std::thread::scope(|s| {
        let mut hs = Vec::with_capacity(bitmaps.len());
        let mut failed = None;
        for (i, (b, token)) in bitmaps.iter_mut().zip(tokens).enumerate() {
            let t = std::thread::Builder::new()
                .name(format!("mark{i}"))
                .spawn_scoped(s, move || {
                    let mut token = token;
                    if let Some(t) = token.as_mut() {
                        t.attach();
                    }
                    let pinned = match cpus.and_then(|c| c.get(i)) {
                        Some(&cpu) => slat_workload::cpus::pin_thread(0, cpu).map_err(|e| {
                            format!("-c: cannot pin marking thread {i} to CPU {cpu}: {e}")
                        }),
                        None => Ok(()),
                    };
                    // Abandoned: a later thread could not start, and the run fails.
                    let r = if ready.wait() && go.wait() {
                        vm.mark_idle(b, flush, |_, _| {})
                    } else {
                        Ok(AgeReport::default())
                    };
                    done.wait();
                    drop(token);
                    pinned.map(|()| r)
                });
            match t {
                Ok(h) => hs.push(h),
                Err(e) => {
                    // The gates can never fill: abandoned, they let the threads started leave
                    // (the tokens of those never started are dropped with their closures).
                    ready.abandon();
                    go.abandon();
                    done.abandon();
                    failed = Some(format!("cannot start a marking thread: {e}"));
                    break;
                }
            }
        }
        let mut time = Duration::ZERO;
        if failed.is_none() {
            ready.wait();
            let t0 = Stopwatch::start();
            go.wait();
            done.wait();
            time = t0.elapsed();
        }
        if let Some(sim) = sim {
            sim.step_out();
        }
        let joined: Result<Vec<AgeResult>, String> = hs
            .into_iter()
            .map(|h| h.join().unwrap_or(Ok(Ok(AgeReport::default()))))
            .collect();
        if let Some(sim) = sim {
            sim.step_in();
        }
        failed.map_or_else(|| joined.map(|j| (j, time)), Err)
    })
}

#[cfg(test)]
mod tests {
    use super::MarkGates;
    use slat::clock::RealTime;

    /// The gates' lines must not meet a page boundary wherever the box lands (see
    /// `MarkGates`): page-aligned, and all three within the page.
    #[test]
    fn the_mark_gates_fill_one_page_at_most() {
        assert_eq!(std::mem::align_of::<MarkGates<RealTime>>(), 4096);
        assert!(std::mem::size_of::<MarkGates<RealTime>>() <= 4096);
        let g = MarkGates::<RealTime>::new(2);
        assert_eq!(std::ptr::from_ref(&*g).addr() % 4096, 0);
    }
}
