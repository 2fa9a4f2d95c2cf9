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
use text::{compare, print_header, run_json, summary};

use crate::args::{BackendArg, FormatArg, MachineArgs, OutputArgs, PinArgs, Switch, Workload};
use crate::demand_paging::stats_json;
use crate::driver::{Benchmark, Common};
use crate::error::CliError;
use crate::error::CliResult;
use crate::limits::GuestMemory;
use crate::output::{Better, Metric, VmSettings};
use crate::report::{bbm_cmo_line, pinned_line, quiet, ratio, ts, Phase};
use clap::{Args, ValueEnum};
use serde::Serialize;
use serde_json::Value;
use slat::{AgeFlush, AgeReport, Ept, IdleBitmap, PteFormat, Stage2, Vm, VmConfig};
use slat_addr::{Gpa, PAGE_SHIFT, PAGE_SIZE};
use slat_machine::{Machine, MachineConfig, PassReport};
use slat_workload::TestMachine;
use slat_workload::{format_size, GuestRam};
use slat_workload::{native_baseline, Layout, PassParams, RegionSpec};
use std::time::{Duration, Instant};

/// The selftest's limit: at least 90% of the pages must be seen accessed after an access pass.
const MAX_STILL_IDLE: f64 = 0.10;

/// What to do when too many pages are still idle after an access pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
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

/// What `--idle-check auto` decided, and why.
fn auto_idle_check() -> (IdleCheck, String) {
    let vm = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| {
            c.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "hypervisor"))
        })
        .unwrap_or(false);
    let numa = std::fs::read_to_string("/proc/sys/kernel/numa_balancing")
        .map(|v| v.trim() != "0")
        .unwrap_or(false);
    match (vm, numa) {
        (true, _) => (
            IdleCheck::Warn,
            "auto: this host is a virtual machine (hypervisor CPU flag), so too many idle pages only warn".into(),
        ),
        (false, true) => (
            IdleCheck::Warn,
            "auto: NUMA balancing is on (/proc/sys/kernel/numa_balancing), so too many idle pages only warn".into(),
        ),
        (false, false) => (
            IdleCheck::Fail,
            "auto: not a virtual machine and no NUMA balancing, so too many idle pages fail".into(),
        ),
    }
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
        match asked {
            IdleCheck::Auto => {
                let (c, why) = auto_idle_check();
                (c, Some(why))
            }
            c => (c, None),
        }
    }
}

fn idle_check_name(c: IdleCheck) -> &'static str {
    match c {
        IdleCheck::Fail => "fail",
        IdleCheck::Warn => "warn",
        IdleCheck::Auto => "auto",
    }
}

/// Flags of `slat access-tracking-perf` (the selftest's, plus slat's variant switches).
#[derive(Debug, Clone, Args)]
#[command(after_long_help = "\
Lines, as the selftest prints them (`%-30s: %ld.%09lds`): Populating memory, Writing to \
populated memory, Reading from populated memory, Mark memory idle, Writing to idle memory, \
Mark memory idle, Reading from idle memory. After each guest pass a `native baseline` line \
gives the same pass on host memory and the ratio; after each pass over idle memory a \
`still idle` line gives the pages aging did not see accessed.

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
    /// Run a comparison instead of one configuration: fast page fault on and off,
    /// each with -v 1 and -v 2 (the given -b, -s, -o and --ad-bits), one table at the end.
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
}

/// One guest pass and its native twin.
struct Pass {
    name: &'static str,
    guest: PassReport,
    native: PassReport,
}

impl Pass {
    fn faults(&self) -> u64 {
        self.guest.vcpus.iter().map(|v| v.counters.faults).sum()
    }
    fn json(&self) -> PassJson {
        PassJson {
            name: self.name,
            time_s: self.guest.wall.as_secs_f64(),
            native_time_s: self.native.wall.as_secs_f64(),
            ratio_guest_over_native: ratio(self.guest.wall, self.native.wall),
            faults: self.faults(),
            walks: self.guest.vcpus.iter().map(|v| v.counters.walks).sum(),
            ad_updates: self.guest.vcpus.iter().map(|v| v.counters.ad_updates).sum(),
        }
    }
}

/// One guest pass in the JSON report.
#[derive(Serialize)]
struct PassJson {
    /// The selftest's line.
    name: &'static str,
    /// The guest pass.
    time_s: f64,
    /// The same pass on host memory.
    native_time_s: f64,
    /// time_s / native_time_s.
    ratio_guest_over_native: f64,
    /// Faults the vCPUs took.
    faults: u64,
    /// Page-table walks.
    walks: u64,
    /// Accessed/Dirty bit updates by the walker.
    ad_updates: u64,
}

/// One marking in the JSON report.
#[derive(Serialize)]
struct MarkJson {
    /// The marking.
    time_s: f64,
    /// Its cost per GiB marked.
    ms_per_gib: f64,
    /// Pages marked.
    pages: u64,
    /// Pages found young.
    young_pages: u64,
    /// Leaves aged.
    aged_leaves: u64,
    /// Pages reported dirty.
    dirty_pages: u64,
    /// Leaves another thread was changing.
    contended_leaves: u64,
    /// TLBs were flushed.
    flushed: bool,
}

/// Pages still idle after an access pass, in the JSON report.
#[derive(Serialize)]
struct IdleJson {
    /// The access pass.
    after: &'static str,
    /// Pages checked.
    pages: u64,
    /// Pages aging did not see accessed.
    still_idle: u64,
    /// still_idle / pages.
    fraction: f64,
}

/// One marking of all guest memory as idle.
struct Mark {
    time: Duration,
    report: AgeReport,
    pages: u64,
}

impl Mark {
    fn ms_per_gib(&self) -> f64 {
        let gib = (self.pages << PAGE_SHIFT) as f64 / (1u64 << 30) as f64;
        self.time.as_secs_f64() * 1e3 / gib
    }
    fn json(&self) -> MarkJson {
        MarkJson {
            time_s: self.time.as_secs_f64(),
            ms_per_gib: self.ms_per_gib(),
            pages: self.pages,
            young_pages: self.report.young_pages,
            aged_leaves: self.report.aged_leaves,
            dirty_pages: self.report.dirty_pages,
            contended_leaves: self.report.contended_leaves,
            flushed: self.report.flushed,
        }
    }
}

/// Pages still idle after an access pass.
struct IdleAfter {
    pass: &'static str,
    still_idle: u64,
    pages: u64,
}

impl IdleAfter {
    fn fraction(&self) -> f64 {
        self.still_idle as f64 / self.pages.max(1) as f64
    }
}

/// Everything one configuration measured.
struct RunResult {
    vcpus: u32,
    fast_pf: bool,
    passes: Vec<Pass>,
    marks: Vec<Mark>,
    idle: Vec<IdleAfter>,
    stats: slat::Stats,
    pcpus: usize,
    warnings: Vec<String>,
    pinned: Option<Vec<usize>>,
}

impl RunResult {
    fn pass(&self, name: &str) -> Option<&Pass> {
        self.passes.iter().find(|p| p.name == name)
    }
}

/// Runs the benchmark: `--compare`'s four configurations, or the driver's runs.
pub fn run(a: &AccessTrackingPerfArgs) -> CliResult {
    if !a.compare {
        return crate::driver::run(a);
    }
    crate::driver::check_output(a.out.plot.as_deref())?;
    a.check()?;
    if a.pin.cpus.is_some() {
        return Err(CliError::bad(
            "-c: --compare runs -v 1 and -v 2, which need different CPU lists; drop -c or --compare",
        ));
    }
    compare(a)
}

/// One run: the selftest's lines (printed as it goes) and its JSON.
pub struct Run {
    result: RunResult,
    json: RunJson,
}

impl serde::Serialize for Run {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.json.serialize(s)
    }
}

impl Benchmark for AccessTrackingPerfArgs {
    type Report = Run;
    const NAME: &'static str = "access-tracking-perf";

    fn common(&self) -> Common<'_> {
        Common {
            backends: &self.backend,
            vary: &[],
            out: &self.out,
        }
    }

    fn check(&self) -> CliResult {
        self.machine
            .format
            .check_backends(&self.backend)
            .map_err(CliError::bad)?;
        if self.backend.contains(&BackendArg::Kvm) {
            // KVM ages guest memory only through the host's page_idle interface (the
            // selftest's route), which slat does not drive: no host can run this, so it is
            // bad input.
            const PAGE_IDLE: &str = "/sys/kernel/mm/page_idle/bitmap";
            if !std::path::Path::new(PAGE_IDLE).exists() {
                return Err(CliError::bad(format!(
                    "access-tracking-perf --backend kvm needs {PAGE_IDLE} (a kernel built with CONFIG_IDLE_PAGE_TRACKING), which this host lacks; use --backend sim"
                )));
            }
            return Err(CliError::bad(format!(
                "access-tracking-perf --backend kvm is not built yet (this host has {PAGE_IDLE}, but slat does not drive it); use --backend sim"
            )));
        }
        check(self).map_err(CliError::bad)
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Run> {
        let result = run_one(
            self,
            self.work.vcpus,
            self.machine.fast_pf.on(),
            !self.out.json,
        )?;
        let json = run_json(self, &result);
        Ok(Run { result, json })
    }

    fn metrics(&self) -> Vec<Metric<Run>> {
        METRICS.to_vec()
    }

    fn print(&self, r: &Run) {
        summary(self, &r.result)
    }
}

fn pass_time(r: &RunResult, name: &str) -> Option<f64> {
    r.pass(name).map(|p| p.guest.wall.as_secs_f64())
}

fn pass_ratio(r: &RunResult, name: &str) -> Option<f64> {
    r.pass(name).map(|p| ratio(p.guest.wall, p.native.wall))
}

/// The headline figures `--repeat` summarizes.
const METRICS: &[Metric<Run>] = &[
    Metric {
        name: "populating memory",
        unit: "s",
        better: Better::Lower,
        get: |r| pass_time(&r.result, "Populating memory"),
    },
    Metric {
        name: "writing to idle memory",
        unit: "s",
        better: Better::Lower,
        get: |r| pass_time(&r.result, "Writing to idle memory"),
    },
    Metric {
        name: "writing to idle memory guest/native",
        unit: "x",
        better: Better::Lower,
        get: |r| pass_ratio(&r.result, "Writing to idle memory"),
    },
    Metric {
        name: "reading from idle memory",
        unit: "s",
        better: Better::Lower,
        get: |r| pass_time(&r.result, "Reading from idle memory"),
    },
    Metric {
        name: "mark memory idle (first)",
        unit: "s",
        better: Better::Lower,
        get: |r| r.result.marks.first().map(|m| m.time.as_secs_f64()),
    },
];

/// Sizes the machine can hold: `-v` × `-b` without overflow (`--compare` runs up to 2 vCPUs),
/// in the format's guest physical address space, on this host together with the native
/// baseline (both are mapped at once).
fn check(a: &AccessTrackingPerfArgs) -> Result<(), String> {
    let vcpus = if a.compare { 2 } else { a.work.vcpus };
    if !a.compare {
        a.pin.plan(vcpus)?;
    }
    let mem = GuestMemory::per_vcpu(vcpus, a.work.bytes)?;
    mem.fits_gpa(&[BackendArg::Sim], a.machine.format, None)?;
    mem.fits_host(a.work.backing, 2, a.machine.tlb_bytes(vcpus))
}

fn flush_mode(a: &AccessTrackingPerfArgs) -> AgeFlush {
    if a.age_flush.on() {
        AgeFlush::Flush
    } else {
        AgeFlush::NoFlush
    }
}

/// One configuration, start to end, on the format `--format` selects. Prints the selftest's
/// lines as it goes when `text`.
fn run_one(
    a: &AccessTrackingPerfArgs,
    vcpus: u32,
    fast_pf: bool,
    text: bool,
) -> Result<RunResult, String> {
    match a.machine.format {
        FormatArg::Ept => run_format::<Ept>(a, vcpus, fast_pf, text),
        FormatArg::Stage2 => run_format::<Stage2>(a, vcpus, fast_pf, text),
    }
}

/// The simulated machine for one configuration.
fn machine_config(a: &AccessTrackingPerfArgs, vcpus: u32, fast_pf: bool) -> MachineConfig {
    let mut vm = a.machine.vm_config();
    vm.fast_pf = fast_pf;
    MachineConfig {
        vm,
        region: RegionSpec {
            backing: a.work.backing,
            vcpus: vcpus as usize,
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

/// Whether too many pages stayed idle after an access pass: an error under `--idle-check
/// fail`, a warning recorded in `r` under `warn`.
fn idle_verdict(
    a: &AccessTrackingPerfArgs,
    quiet: bool,
    idle: &IdleAfter,
    r: &mut RunResult,
) -> Result<(), String> {
    let f = idle.fraction();
    if f < MAX_STILL_IDLE {
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
        100.0 * f,
        idle.pass,
        100.0 * MAX_STILL_IDLE,
    );
    match a.idle_check().0 {
        IdleCheck::Fail | IdleCheck::Auto => Err(msg),
        IdleCheck::Warn => {
            if !quiet {
                eprintln!("slat: warning: {msg}");
            }
            r.warnings.push(msg);
            Ok(())
        }
    }
}

/// One bitmap per marking thread: each vCPU's partition, or everything for vCPU 0 (-o).
fn idle_bitmaps<F: PteFormat>(
    a: &AccessTrackingPerfArgs,
    vcpus: u32,
    layout: &slat_workload::Layout,
) -> Result<Vec<IdleBitmap>, String> {
    let regions = if a.work.overlap { 1 } else { vcpus as usize };
    (0..regions)
        .map(|i| {
            let (gpa, _, pages) = layout.region(i);
            IdleBitmap::new::<F>(Gpa::new(gpa).gfn(), pages).map_err(|e| e.to_string())
        })
        .collect()
}

impl RunResult {
    fn new(vcpus: u32, fast_pf: bool, pcpus: usize) -> RunResult {
        RunResult {
            vcpus,
            fast_pf,
            passes: Vec::new(),
            marks: Vec::new(),
            idle: Vec::new(),
            stats: slat::Stats::default(),
            pcpus,
            warnings: Vec::new(),
            pinned: None,
        }
    }
}

fn run_format<F: PteFormat>(
    a: &AccessTrackingPerfArgs,
    vcpus: u32,
    fast_pf: bool,
    text: bool,
) -> Result<RunResult, String> {
    let q = quiet(a.out.json);
    let cfg = machine_config(a, vcpus, fast_pf);
    let (vm_cfg, prefault) = (cfg.vm, cfg.region.prefault);
    let total = a.work.bytes * vcpus as u64;
    let p = Phase::start(
        format!(
            "mapping {} of {} guest RAM ({}) and as much host memory for the native baseline",
            format_size(total),
            a.work.backing,
            a.machine.format.name()
        ),
        q,
    );
    let m = Machine::<F>::new(cfg).map_err(|e| e.to_string())?;
    let pinned = pin(a, &m, vcpus)?;
    let psize = a.work.backing.page_size().max(PAGE_SIZE);
    let native_ram = GuestRam::new(a.work.backing, total.div_ceil(psize) * psize, prefault)
        .map_err(|e| e.to_string())?;
    p.done();
    let layout = m.layout();
    if text {
        print_header(a, &vm_cfg, &layout, total);
    }
    let mut bitmaps = idle_bitmaps::<F>(a, vcpus, &layout)?;
    let mut r = RunResult::new(vcpus, fast_pf, m.pcpus());
    r.pinned = pinned;
    let write = PassParams {
        write_percent: 100,
        ..PassParams::default()
    };
    let read = PassParams {
        write_percent: 0,
        ..PassParams::default()
    };
    let vm = m.vm().clone();
    let steps = Steps {
        a,
        m: &m,
        native_ram: &native_ram,
        layout,
        vm: &vm,
        flush: flush_mode(a),
        text,
    };
    steps.access("Populating memory", write, &mut r)?;
    steps.access("Writing to populated memory", write, &mut r)?;
    steps.access("Reading from populated memory", read, &mut r)?;
    steps.mark(&mut bitmaps, &mut r)?;
    steps.access("Writing to idle memory", write, &mut r)?;
    steps.check("Writing to idle memory", &mut bitmaps, &mut r)?;
    steps.mark(&mut bitmaps, &mut r)?;
    steps.access("Reading from idle memory", read, &mut r)?;
    steps.check("Reading from idle memory", &mut bitmaps, &mut r)?;
    r.stats = vm.stats();
    drop(m);
    drop(native_ram);
    Ok(r)
}

/// The three steps of a run: an access pass (with its native baseline), marking the region
/// idle, and counting what stayed idle.
struct Steps<'a, F: PteFormat> {
    a: &'a AccessTrackingPerfArgs,
    m: &'a Machine<F>,
    native_ram: &'a GuestRam,
    layout: Layout,
    vm: &'a Vm<F>,
    flush: AgeFlush,
    text: bool,
}

impl<F: PteFormat> Steps<'_, F> {
    fn access(
        &self,
        name: &'static str,
        params: PassParams,
        r: &mut RunResult,
    ) -> Result<(), String> {
        let guest = self.m.run_pass(params).map_err(|e| e.to_string())?;
        let native =
            native_baseline(self.layout, self.native_ram, params).map_err(|e| e.to_string())?;
        if self.text {
            println!("{:<30}: {}", name, ts(guest.wall));
            println!(
                "{:<30}: {} (guest/native {:.2}x)",
                "  native baseline",
                ts(native.wall),
                ratio(guest.wall, native.wall)
            );
        }
        r.passes.push(Pass {
            name,
            guest,
            native,
        });
        Ok(())
    }

    fn mark(&self, bitmaps: &mut [IdleBitmap], r: &mut RunResult) -> Result<(), String> {
        let m = mark_idle(self.vm, bitmaps, self.flush)?;
        if self.text {
            println!("{:<30}: {}", "Mark memory idle", ts(m.time));
        }
        r.marks.push(m);
        Ok(())
    }

    fn check(
        &self,
        name: &'static str,
        bitmaps: &mut [IdleBitmap],
        r: &mut RunResult,
    ) -> Result<(), String> {
        let still_idle: u64 = bitmaps.iter_mut().map(|b| self.vm.read_idle(b)).sum();
        let pages: u64 = bitmaps.iter().map(|b| b.npages()).sum();
        let idle = IdleAfter {
            pass: name,
            still_idle,
            pages,
        };
        if self.text {
            println!(
                "{:<30}: {} of {} pages ({:.2}%)",
                "  still idle",
                idle.still_idle,
                idle.pages,
                100.0 * idle.fraction()
            );
        }
        let verdict = idle_verdict(self.a, quiet(self.a.out.json), &idle, r);
        r.idle.push(idle);
        verdict
    }
}

/// `-c`: pins the vCPU threads (and the main thread if the list names one more CPU).
fn pin<F: PteFormat>(
    a: &AccessTrackingPerfArgs,
    m: &Machine<F>,
    vcpus: u32,
) -> Result<Option<Vec<usize>>, String> {
    let Some(plan) = a.pin.plan(vcpus)? else {
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
fn mark_idle<F: PteFormat>(
    vm: &Vm<F>,
    bitmaps: &mut [IdleBitmap],
    flush: AgeFlush,
) -> Result<Mark, String> {
    let pages = bitmaps.iter().map(|b| b.npages()).sum();
    let t0 = Instant::now();
    let reports: Vec<AgeReport> = if bitmaps.len() == 1 {
        bitmaps
            .iter_mut()
            .map(|b| vm.mark_idle(b, flush, |_, _| {}))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?
    } else {
        std::thread::scope(|s| {
            let hs: Vec<_> = bitmaps
                .iter_mut()
                .map(|b| s.spawn(move || vm.mark_idle(b, flush, |_, _| {})))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(Ok(AgeReport::default())))
                .collect::<Result<_, _>>()
        })
        .map_err(|e| e.to_string())?
    };
    let time = t0.elapsed();
    let mut report = AgeReport::default();
    for x in reports {
        report.young_pages += x.young_pages;
        report.aged_leaves += x.aged_leaves;
        report.dirty_pages += x.dirty_pages;
        report.contended_leaves += x.contended_leaves;
        report.flushed |= x.flushed;
    }
    Ok(Mark {
        time,
        report,
        pages,
    })
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
    /// The idle-page check in force: `fail` or `warn` (`auto` resolved).
    idle_check: &'static str,
    /// Why, when `auto` chose it.
    #[serde(skip_serializing_if = "Option::is_none")]
    idle_check_reason: Option<String>,
    /// `-c`: vCPU i's thread was pinned to `pinned_cpus[i]` (read back from the kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pinned_cpus: Option<Vec<usize>>,
}

/// One configuration's JSON report.
#[derive(Serialize)]
struct RunJson {
    benchmark: &'static str,
    backend: &'static str,
    format: &'static str,
    config: Config,
    passes: Vec<PassJson>,
    mark_memory_idle: Vec<MarkJson>,
    still_idle: Vec<IdleJson>,
    warnings: Vec<String>,
    stats: Value,
}

/// `--compare --json`.
#[derive(Serialize)]
struct CompareJson {
    benchmark: &'static str,
    compare: Vec<RunJson>,
}
