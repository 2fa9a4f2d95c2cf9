//! `slat dirty-log-test`: KVM's dirty_log_test, the correctness oracle of dirty logging. Guest
//! writers stamp random pages with the iteration number; the host harvests mid-iteration and
//! after stopping the vCPUs, then checks every page: written ⇔ reported. Any mismatch is a
//! failure (exit status 1).

use crate::args::{
    check_kvm_ring, ring_size, BackendArg, DirtyArgs, MachineArgs, OutputArgs, Workload,
};
use crate::backend::{self, dirty_config, Spec};
use crate::driver::Benchmark;
use crate::error::{CliError, CliResult};
use crate::output::{print_json, Metric, Repeated, RunHead, VmSettings, WorkSettings};
use crate::report::{format_header, quiet};
use crate::virtual_time::{self, ClockArgs, ClockReport, VirtualRun};
use clap::{Args, ValueEnum};
use serde::Serialize;
#[cfg(feature = "broken-engine")]
use slat::dirty::inject;
use slat::DirtyTrack;
use slat_workload::dirty_oracle::{LogMode, OracleConfig};
use std::time::Duration;

/// `-M`: which harvest protocols to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// GET_DIRTY_LOG clears and re-protects.
    DirtyLog,
    /// Manual protect + INITIALLY_SET: GET copies, CLEAR_DIRTY_LOG re-protects.
    ClearLog,
    /// Per-vCPU dirty rings, harvest then reset.
    DirtyRing,
    /// All three, one after the other.
    All,
}

/// `--break`: a deliberately broken engine, to see the oracle fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BreakArg {
    /// Harvests write-protect pages but skip the remote TLB flush, so a vCPU can keep writing
    /// through a stale writable TLB entry without the page being logged.
    SkipHarvestFlush,
}

/// Flags of `slat dirty-log-test`.
#[derive(Debug, Clone, Args)]
pub struct DirtyLogTestArgs {
    #[command(flatten)]
    pub work: Workload,
    /// Log mode: dirty-log, clear-log, dirty-ring, or all.
    #[arg(short = 'M', value_enum, default_value = "all")]
    pub mode: ModeArg,
    /// Iterations per mode.
    #[arg(short = 'i', value_parser = clap::value_parser!(u32).range(1..=100_000), default_value_t = 32)]
    pub iterations: u32,
    /// Milliseconds each iteration lets the guest write before the final harvest.
    #[arg(short = 'I', value_parser = clap::value_parser!(u64).range(1..=60_000), default_value_t = 10)]
    pub interval_ms: u64,
    /// Dirty ring entries per vCPU (dirty-ring mode): a power of two from 128 to 65536,
    /// lowered to the largest power of two not above the test's pages, as in the selftest.
    #[arg(short = 'c', value_parser = ring_size, default_value_t = 65536)]
    pub ring_entries: u32,
    /// Seed of the guest writers and of the host's harvest points.
    #[arg(short = 'r', default_value_t = 1)]
    pub seed: u32,
    /// Every N iterations (0: never), turn dirty logging off and on again in the middle of
    /// the iteration while the guest writes; pages written after the re-enable are checked.
    #[arg(long = "toggle-every", default_value_t = 0)]
    pub toggle_every: u32,
    /// Run with a deliberately broken engine and expect the oracle to fail.
    #[arg(long = "break", value_enum)]
    pub broken: Option<BreakArg>,
    /// The machine(s) to check: `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` (one after
    /// the other).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    #[command(flatten)]
    pub dirty: DirtyArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub clock: ClockArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

impl Benchmark for DirtyLogTestArgs {
    type Report = Report;
    const NAME: &'static str = NAME;
    crate::forward_benchmark! { vary: no, check: check, measure: run_on, print: print_text }

    fn metrics(&self) -> Vec<Metric<Report>> {
        METRICS.to_vec()
    }

    fn own_output(&self) -> Option<fn(&Self, Vec<(BackendArg, Vec<Report>)>) -> CliResult> {
        Some(finish)
    }

    fn refuse(&self) -> Option<String> {
        self.out.plot.as_ref().map(|_| {
            "--plot: dirty-log-test has no time series to draw (it is a correctness check); drop --plot".to_string()
        })
    }
}

/// The summaries or the one JSON document; then any mismatch, on any machine, is a failure
/// (exit status 1).
fn finish(a: &DirtyLogTestArgs, all: Vec<(BackendArg, Vec<Report>)>) -> CliResult {
    let mut failed: Vec<String> = all
        .iter()
        .flat_map(|(_, runs)| runs)
        .filter(|r| !r.pass)
        .map(|r| r.failure(a.backend.len() > 1, a.seed))
        .collect();
    if a.out.json {
        emit_json(a, all)?;
    } else if a.out.repeat > 1 {
        for (kind, runs) in all {
            if a.backend.len() > 1 {
                println!("\n{}:", kind.name());
            }
            Repeated::new(NAME, METRICS, runs).print();
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    failed.dedup();
    Err(failed.join("; ").into())
}

/// The one JSON document: a run's report, a `--backend a,b` pair, or `--repeat` summaries.
fn emit_json(a: &DirtyLogTestArgs, all: Vec<(BackendArg, Vec<Report>)>) -> CliResult {
    let backends: Vec<&'static str> = a.backend.iter().map(|k| k.name()).collect();
    let mut per_backend: Vec<Vec<Report>> = all.into_iter().map(|(_, r)| r).collect();
    match (a.out.repeat, per_backend.len()) {
        (1, 1) => print_json(&per_backend[0][0], &a.backend),
        (1, _) => {
            let runs: Vec<Report> = per_backend.into_iter().flatten().collect();
            let doc = Both {
                benchmark: NAME,
                backends,
                pass: runs.iter().all(|r| r.pass),
                runs,
            };
            print_json(&doc, &a.backend)
        }
        (_, 1) => print_json(
            &Repeated::new(NAME, METRICS, per_backend.remove(0)),
            &a.backend,
        ),
        _ => {
            let doc = BothRepeated {
                benchmark: NAME,
                backends,
                repeated: per_backend
                    .into_iter()
                    .map(|runs| Repeated::new(NAME, METRICS, runs))
                    .collect(),
            };
            print_json(&doc, &a.backend)
        }
    }
}

/// `--backend a,b --json`: both machines' reports in one document.
#[derive(Serialize)]
struct Both {
    benchmark: &'static str,
    backends: Vec<&'static str>,
    /// Every mode passed on every machine.
    pass: bool,
    runs: Vec<Report>,
}

/// `--backend a,b --repeat N --json`.
#[derive(Serialize)]
struct BothRepeated {
    benchmark: &'static str,
    backends: Vec<&'static str>,
    repeated: Vec<Repeated<Report>>,
}

/// The selftest adds 3 pages to each vCPU's memory, so the memslot is not a multiple of 64
/// pages.
const EXTRA_BYTES: u64 = 3 * 4096;

/// Refuses flags that cannot run together, sizes the machines cannot hold (each vCPU's memory
/// with the selftest's 3 pages), and a ring KVM cannot have.
fn check(a: &DirtyLogTestArgs) -> Result<(), String> {
    crate::limits::refuse_phantom(a.work.backing, "dirty-log-test's oracle")?;
    let mut engine_only = a.dirty.engine_only();
    if a.broken.is_some() {
        if !cfg!(feature = "broken-engine") {
            return Err("--break needs an engine built with its deliberate bugs: \
                 cargo build --release -p slat-cli --features broken-engine"
                .into());
        }
        engine_only.push("--break");
    }
    if a.toggle_every != 0 {
        engine_only.push("--toggle-every");
    }
    a.machine.check_backends(&a.backend, &engine_only)?;
    if a.clock.is_virtual() && a.backend.contains(&BackendArg::Kvm) {
        return Err("--clock virtual runs only on the simulated machine (--backend sim)".into());
    }
    let ring_mode = modes(a).contains(&LogMode::DirtyRing);
    let vm_config = a.dirty.apply(a.machine.vm_config());
    a.dirty.check(&vm_config, a.machine.format, ring_mode)?;
    let mem = a.work.check_fits(&a.backend, &a.machine, EXTRA_BYTES, 1)?;
    if ring_mode {
        let lowered = "-c (lowered to the test's pages)";
        check_kvm_ring(&a.backend, ring(a, mem.pages()), lowered)?;
    }
    Ok(())
}

/// The ring size: `-c`, clamped to the largest power of two not above the test's pages (as
/// the selftest does), at least 128.
fn ring(a: &DirtyLogTestArgs, pages: u64) -> u32 {
    let max_ring = 1u64 << (63 - pages.max(1).leading_zeros());
    (a.ring_entries as u64).min(max_ring).max(128) as u32
}

/// The log modes `-M` selects (without the ring under `-M all` with d-bit tracking, which
/// logs into bitmaps only).
fn modes(a: &DirtyLogTestArgs) -> Vec<LogMode> {
    let mut modes: Vec<LogMode> = match a.mode {
        ModeArg::DirtyLog => vec![LogMode::DirtyLog],
        ModeArg::ClearLog => vec![LogMode::ClearLog],
        ModeArg::DirtyRing => vec![LogMode::DirtyRing],
        ModeArg::All => LogMode::ALL.to_vec(),
    };
    if a.dirty.tracking == DirtyTrack::HardwareDirty && a.mode == ModeArg::All {
        modes.retain(|m| *m != LogMode::DirtyRing);
    }
    modes
}

const NAME: &str = "dirty-log-test";

/// The run's settings, as the report records them.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    #[serde(flatten)]
    pub vm: VmSettings,
    #[serde(flatten)]
    pub work: WorkSettings,
    pub iterations: u32,
    pub interval_ms: u64,
    pub seed: u32,
    /// Ring entries per vCPU (dirty-ring mode), after lowering to the test's pages.
    pub ring_entries: u32,
    pub broken: bool,
    pub toggle_every: u32,
}

/// One iteration of the oracle.
#[derive(Debug, Clone, Serialize)]
pub struct IterationRow {
    pub iteration: u32,
    pub dirty: u64,
    pub clean: u64,
    pub writes: u64,
    pub lost: u64,
    pub spurious: u64,
    /// Logging was switched off and on in this iteration.
    pub toggled: bool,
}

/// One log mode's result.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// `dirty-log`, `clear-log` or `dirty-ring`.
    pub mode: &'static str,
    pub iterations: Vec<IterationRow>,
    /// Pages checked dirty over every iteration.
    pub total_dirty: u64,
    pub total_clean: u64,
    pub lost: u64,
    pub spurious: u64,
    pub ring_full_exits: u64,
    pub errors: Vec<String>,
    pub pass: bool,
    #[serde(skip)]
    pub gpa: u64,
}

/// Everything one run on one machine checked.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub head: RunHead,
    pub config: Config,
    pub modes: Vec<ModeReport>,
    pub pass: bool,
    /// Whose time the iterations' intervals ran on (under `--clock virtual`, each mode is a
    /// simulation of its own; the speed figures are their sums).
    #[serde(flatten)]
    pub clock: ClockReport,
    /// The header line naming the page-table format.
    #[serde(skip)]
    pub format_header: String,
}

impl Report {
    fn failure(&self, name_backend: bool, seed: u32) -> String {
        let failed: Vec<&str> = self
            .modes
            .iter()
            .filter(|m| !m.pass)
            .map(|m| m.mode)
            .collect();
        let msg = format!(
            "dirty log mismatch in mode(s) {} (seed {seed}): pages were lost or misreported",
            failed.join(", ")
        );
        if name_backend {
            format!("{}: {msg}", self.head.backend)
        } else {
            msg
        }
    }

    fn sum(&self, f: impl Fn(&ModeReport) -> u64) -> Option<f64> {
        Some(self.modes.iter().map(f).sum::<u64>() as f64)
    }
}

/// The figures `--repeat` summarizes.
const METRICS: &[Metric<Report>] = &[
    Metric::higher("dirty pages checked", "pages", |r| r.sum(|m| m.total_dirty)),
    Metric::lower("lost pages", "pages", |r| r.sum(|m| m.lost)),
    Metric::lower("spurious pages", "pages", |r| r.sum(|m| m.spurious)),
    Metric::lower("dirty ring full exits", "exits", |r| {
        r.sum(|m| m.ring_full_exits)
    }),
];

/// Checks one log mode on a fresh machine, in a simulation of its own under `--clock
/// virtual`: the mode's report and the clock's.
fn check_mode(
    a: &DirtyLogTestArgs,
    kind: BackendArg,
    vm: slat::VmConfig,
    mode: LogMode,
    ring: u32,
) -> CliResult<(ModeReport, ClockReport)> {
    let vt = a.clock.start()?;
    let sim = vt.as_ref().map(VirtualRun::threads);
    let (r, stats) = check_mode_on(a, kind, vm, mode, ring, sim)?;
    let mut clock = virtual_time::finish(vt)?;
    clock.count_faults(&stats);
    Ok((r, clock))
}

/// [`check_mode`] on a machine whose threads join `sim` (virtual time); the report and the
/// machine's counters, the machine gone.
fn check_mode_on(
    a: &DirtyLogTestArgs,
    kind: BackendArg,
    vm: slat::VmConfig,
    mode: LogMode,
    ring: u32,
    sim: Option<std::sync::Arc<dyn slat_machine::vtime::SimThreads>>,
) -> CliResult<(ModeReport, serde_json::Value)> {
    let dirty = mode.dirty_config(ring);
    let mut region = a.work.region(
        &a.machine,
        dirty_config(dirty.manual_protect != 0, dirty.ring_entries),
    );
    region.bytes_per_vcpu += EXTRA_BYTES;
    let (m, p) = backend::start_with(
        kind,
        &Spec::new(&a.machine, region, vm),
        "",
        quiet(a.out.json),
        sim,
    )?;
    p.done();
    #[cfg(feature = "broken-engine")]
    if let (Some(BreakArg::SkipHarvestFlush), Some(sim)) = (a.broken, m.sim()) {
        sim.inject_bugs(inject::SKIP_HARVEST_FLUSH);
    }
    let ocfg = OracleConfig {
        mode,
        iterations: a.iterations,
        interval: Duration::from_millis(a.interval_ms),
        seed: a.seed,
        toggle_every: a.toggle_every,
    };
    let r = m.dirty_oracle(mode, ocfg, &mut |_| {})?;
    let (lost, spurious): (u64, u64) = r
        .iterations
        .iter()
        .fold((0, 0), |(l, s), i| (l + i.lost, s + i.spurious));
    let gpa = m.layout().gpa;
    let stats = m.stats();
    drop(m);
    let report = ModeReport {
        mode: mode.name(),
        iterations: r
            .iterations
            .iter()
            .map(|i| IterationRow {
                iteration: i.iteration,
                dirty: i.dirty,
                clean: i.clean,
                writes: i.writes,
                lost: i.lost,
                spurious: i.spurious,
                toggled: i.toggled,
            })
            .collect(),
        total_dirty: r.total_dirty(),
        total_clean: r.total_clean(),
        lost,
        spurious,
        ring_full_exits: r.ring_full_exits,
        errors: r.errors.clone(),
        pass: r.mismatches() == 0,
        gpa,
    };
    Ok((report, stats))
}

/// Every log mode on `kind`.
fn run_on(a: &DirtyLogTestArgs, kind: BackendArg) -> CliResult<Report> {
    let modes = modes(a);
    let vm_config = a.dirty.apply(a.machine.vm_config());
    if a.dirty.tracking == DirtyTrack::HardwareDirty && a.mode == ModeArg::All && !a.out.json {
        // The ring is not a log d-bit tracking can fill; say so rather than skip silently.
        eprintln!("[slat] -M all with --dirty-tracking d-bit: checking dirty-log and clear-log (d-bit tracking logs into bitmaps, not rings)");
    }
    let mem = a
        .work
        .check_fits(&a.backend, &a.machine, EXTRA_BYTES, 1)
        .map_err(CliError::bad)?;
    let ring = ring(a, mem.pages());
    let mut reports = Vec::new();
    let mut clock: Option<ClockReport> = None;
    for &mode in &modes {
        let (r, c) = check_mode(a, kind, vm_config, mode, ring)?;
        reports.push(r);
        clock = Some(match clock {
            Some(prev) => prev.merged(&c),
            None => c,
        });
    }
    let vm = VmSettings::new(
        kind,
        a.machine.format,
        &vm_config,
        a.machine.tlb_entries,
        None,
        !a.machine.no_prefault,
    );
    Ok(Report {
        head: RunHead::new(NAME, kind, a.machine.format),
        config: Config {
            vm,
            iterations: a.iterations,
            interval_ms: a.interval_ms,
            // -b plus the selftest's 3 pages.
            work: WorkSettings {
                bytes_per_vcpu: a.work.bytes + EXTRA_BYTES,
                overlap: None,
                ..a.work.settings()
            },
            seed: a.seed,
            ring_entries: ring,
            broken: a.broken.is_some(),
            toggle_every: a.toggle_every,
        },
        pass: reports.iter().all(|m| m.pass),
        modes: reports,
        clock: clock.unwrap_or_else(ClockReport::real),
        format_header: format_header(kind, a.machine.format, &vm_config),
    })
}

/// The selftest's text report of one machine's run (and the clock's line, in virtual time).
fn print_text(r: &Report) {
    print_modes(r);
    if let Some(l) = r.clock.line() {
        println!("{l}");
    }
}

fn print_modes(r: &Report) {
    for m in &r.modes {
        println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
        println!("{}", r.format_header);
        println!("guest physical test memory offset: 0x{:x}", m.gpa);
        if m.mode == LogMode::DirtyRing.name() {
            println!(
                "Testing Log Mode '{}' (ring: {} entries per vCPU)",
                m.mode, r.config.ring_entries
            );
        } else {
            println!("Testing Log Mode '{}'", m.mode);
        }
        for it in &m.iterations {
            println!(
                "Iteration {:2}: dirty: {:<6} clean: {:<6} writes: {:<6}{}",
                it.iteration,
                it.dirty,
                it.clean,
                it.writes,
                if it.toggled {
                    " (logging toggled mid-iteration)"
                } else {
                    ""
                }
            );
        }
        println!(
            "Total bits checked: dirty ({}), clear ({})",
            m.total_dirty, m.total_clean
        );
        if m.mode == LogMode::DirtyRing.name() {
            println!("Dirty ring full exits: {}", m.ring_full_exits);
        }
        for e in &m.errors {
            println!("MISMATCH: {e}");
        }
        println!(
            "Log mode '{}': {} ({} lost, {} spurious pages)",
            m.mode,
            if m.pass { "PASS" } else { "FAIL" },
            m.lost,
            m.spurious
        );
        println!();
    }
}
