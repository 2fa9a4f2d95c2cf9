//! `slat dirty-log-perf`: KVM's dirty_log_perf_test on the simulated machine — populate, enable
//! logging, N iterations of (dirty memory, get dirty log, clear dirty log), disable logging —
//! with, for every guest pass, the same pass on host memory in the same run and the ratio.

mod text;
mod vary;

use self::vary::{BOTH_MACHINES, EXAMPLES, VARY};
use crate::args::{
    check_kvm_ring, BackendArg, DirtyArgs, LogArgs, MachineArgs, OutputArgs, PinArgs, Workload,
};
use crate::backend::{self, dirty_config, Backend, Native, Pass, Spec};
use crate::concurrent_harvest::{self, ConcurrentReport, QuietPasses};
use crate::driver::chart::SeriesOf;
use crate::driver::{self, Benchmark, Lines};
use crate::error::{CliError, CliResult};
use crate::harvest::{Harvest, HarvestTimes};
use crate::latency::LatencySummary;
use crate::mmu_memory::MmuMemoryFigures;
use crate::output::{opt_secs, secs, Metric, RunHead, VmSettings, WorkSettings};
use crate::report::{format_header, quiet, ratio, Phase};
use crate::virtual_time::{self, ClockArgs, ClockReport, Stopwatch, VirtualRun};
use clap::Args;
use serde::Serialize;
use slat_workload::format_size;
use slat_workload::PassParams;
use std::time::Duration;
use text::{print_text, run_flags};

/// Flags of `slat dirty-log-perf` (the selftest's, plus slat's variant switches).
#[derive(Debug, Clone, Args)]
pub struct DirtyLogPerfArgs {
    #[command(flatten)]
    pub work: Workload,
    /// Access pages in pseudo-random order instead of sequentially.
    #[arg(short = 'a')]
    pub random: bool,
    /// Keep the vCPUs dirtying memory while dirty logging is disabled ("evil" mode).
    #[arg(short = 'e')]
    pub evil: bool,
    /// Iterations of dirtying memory and harvesting the log (at least 2).
    #[arg(short = 'i', value_parser = clap::value_parser!(u32).range(2..=100_000), default_value_t = 2)]
    pub iterations: u32,
    /// Seed of the guest's pseudo-random generator (vCPU i uses seed + i).
    #[arg(short = 'r', default_value_t = 1)]
    pub seed: u32,
    /// Percentage of accesses in the dirty passes that are writes (0-100).
    #[arg(short = 'w', value_parser = clap::value_parser!(u32).range(0..=100), default_value_t = 100)]
    pub write_percent: u32,
    /// Memslots the guest memory is split into (must divide its pages evenly).
    #[arg(short = 'x', value_parser = clap::value_parser!(u32).range(1..=32_000), default_value_t = 1)]
    pub slots: u32,
    #[command(flatten)]
    pub log: LogArgs,
    /// After the iterations, keep every vCPU writing in a loop while the host harvests the log
    /// -i more times (migrate-perf's shape in the lockless reverse-map write-protect series), and report harvest time, guest write
    /// throughput and per-vCPU write latency percentiles with and without harvests running.
    /// The iterations are then timed too (their passes are the "no harvest running" side).
    #[arg(long)]
    pub concurrent: bool,
    /// With --concurrent: milliseconds the vCPUs write before each harvest (0: harvests back
    /// to back). Default: the mean time of one dirty pass of the iterations, so each
    /// concurrent harvest finds about as many dirty pages as a stopped one.
    #[arg(long = "harvest-interval", value_name = "MS", requires = "concurrent", value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub harvest_interval: Option<u64>,
    /// The machine(s) to run on: `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` to run both
    /// in this process and print one table comparing them.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    /// Run once per combination of settings, one table (the keys: --help).
    #[arg(long = "vary", value_parser = driver::vary::parser(VARY), value_name = "KEY=V1,V2", long_help = driver::vary::help(VARY, EXAMPLES))]
    pub vary: Vec<driver::vary::Vary>,
    #[command(flatten)]
    pub pin: PinArgs,
    #[command(flatten)]
    pub dirty: DirtyArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub clock: ClockArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// The benchmark's name in reports.
const NAME: &str = "dirty-log-perf";

/// The run's settings, as the report records them.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    #[serde(flatten)]
    pub vm: VmSettings,
    #[serde(flatten)]
    pub work: WorkSettings,
    pub iterations: u32,
    pub random: bool,
    pub evil: bool,
    pub write_percent: u32,
    pub slots: u32,
    pub seed: u32,
    /// Manual dirty-log protection (GET then CLEAR; off with `-g` or a dirty ring).
    pub manual_protect: bool,
    pub dirty_ring: Option<u32>,
    /// `--clear-chunk`: pages per CLEAR_DIRTY_LOG call (`slot`: one per memslot).
    pub clear_chunk: String,
    pub concurrent: bool,
    /// `-c`: vCPU i's thread was pinned to `pinned_cpus[i]` (read back from the kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_cpus: Option<Vec<usize>>,
}

/// One iteration of dirtying memory and harvesting the log.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Iteration {
    pub iteration: u32,
    #[serde(rename = "dirty_memory_time_s", serialize_with = "secs")]
    pub dirty: Duration,
    /// The same pass by host threads on host memory.
    #[serde(rename = "native_memory_time_s", serialize_with = "secs")]
    pub native: Duration,
    pub ratio_guest_over_native: f64,
    #[serde(flatten)]
    pub harvest: HarvestTimes,
    pub ring_full_exits: u64,
}

/// Everything one run of dirty-log-perf measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub head: RunHead,
    pub config: Config,
    #[serde(rename = "populate_memory_time_s", serialize_with = "secs")]
    pub populate: Duration,
    #[serde(rename = "populate_native_time_s", serialize_with = "secs")]
    pub populate_native: Duration,
    #[serde(rename = "enabling_dirty_logging_time_s", serialize_with = "secs")]
    pub enable: Duration,
    pub iterations: Vec<Iteration>,
    /// Disabling dirty logging (huge pages recovered).
    #[serde(rename = "disabling_dirty_logging_time_s", serialize_with = "secs")]
    pub disable: Duration,
    #[serde(rename = "get_dirty_log_total_s", serialize_with = "secs")]
    pub get_total: Duration,
    /// Sum of the clear (or ring reset) times; `null` when there is no such step.
    #[serde(rename = "clear_dirty_log_total_s", serialize_with = "opt_secs")]
    pub clear_total: Option<Duration>,
    /// `--concurrent`: harvests while the vCPUs write, against harvests while they are stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrent: Option<ConcurrentReport>,
    /// The machine's counters (the engine's on sim, KVM's VM statistics on kvm).
    pub stats: serde_json::Value,
    /// The engine's own memory after the last iteration, logging still on (sim; `null` on
    /// kvm).
    pub mmu_memory: Option<MmuMemoryFigures>,
    /// Whose time the report's times are.
    #[serde(flatten)]
    pub clock: ClockReport,
    /// The lines describing the machine after the selftest's (engine counters, settings).
    #[serde(skip)]
    pub machine_lines: Vec<String>,
    /// The header line naming the page-table format.
    #[serde(skip)]
    pub format_header: String,
    #[serde(skip)]
    pub gpa: u64,
}

impl Report {
    /// Iteration 2, the selftest's steady state (iteration 1 may still split or fault); the
    /// last iteration when there is only one.
    fn steady(&self) -> Option<&Iteration> {
        self.iterations.get(1).or_else(|| self.iterations.last())
    }

    fn avg(&self, f: impl Fn(&Iteration) -> Option<Duration>) -> Option<f64> {
        let xs: Vec<f64> = self
            .iterations
            .iter()
            .filter_map(|i| f(i).map(|d| d.as_secs_f64()))
            .collect();
        (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
    }

    fn ring(&self) -> bool {
        self.config.dirty_ring.is_some()
    }

    fn contrast(&self) -> Option<&ConcurrentReport> {
        self.concurrent.as_ref()
    }
}

/// The headline figures, for the comparison, sweep and repeat tables.
pub const METRICS: &[Metric<Report>] = &[
    Metric::lower("populate memory", "s", |r| Some(r.populate.as_secs_f64())),
    Metric::lower("enable dirty logging", "s", |r| {
        Some(r.enable.as_secs_f64())
    }),
    Metric::lower("iteration 2 dirty memory", "s", |r| {
        r.steady().map(|i| i.dirty.as_secs_f64())
    }),
    Metric::lower("iteration 2 native memory", "s", |r| {
        r.steady().map(|i| i.native.as_secs_f64())
    }),
    Metric::lower("iteration 2 guest/native", "x", |r| {
        r.steady().map(|i| i.ratio_guest_over_native)
    }),
    Metric::lower("get dirty log avg", "s", |r| r.avg(|i| Some(i.harvest.get))),
    Metric::lower("clear dirty log avg", "s", |r| r.avg(|i| i.harvest.clear)),
    Metric::lower("reset dirty rings avg", "s", |r| r.avg(|i| i.harvest.reset)),
    Metric::lower("disable dirty logging", "s", |r| {
        Some(r.disable.as_secs_f64())
    }),
];

/// The headline figures of `--concurrent`: the reverse-map write-protect series' table
/// (harvest time under concurrent writers against stopped ones, guest write throughput, vCPU
/// write latency).
pub const CONCURRENT_METRICS: &[Metric<Report>] = &[
    Metric::lower("harvest avg, vCPUs stopped", "s", |r| {
        r.contrast().map(|c| c.quiet.harvest_avg.as_secs_f64())
    }),
    Metric::lower("harvest avg, vCPUs writing", "s", |r| {
        r.contrast().map(|c| c.concurrent.harvest_avg.as_secs_f64())
    }),
    Metric::higher("guest writes during harvests", "pages/s", |r| {
        r.contrast().map(|c| c.concurrent.guest_pages_per_s)
    }),
    Metric::lower("write p99, no harvest", "us", |r| {
        r.contrast()
            .and_then(|c| us(&c.quiet.write_latency, |l| l.p99_ns))
    }),
    Metric::lower("write p99, during harvests", "us", |r| {
        r.contrast()
            .and_then(|c| us(&c.concurrent.write_latency, |l| l.p99_ns))
    }),
    Metric::lower("write max, during harvests", "us", |r| {
        r.contrast()
            .and_then(|c| us(&c.concurrent.write_latency, |l| l.max_ns))
    }),
];

/// A percentile of `l` in µs; none when no write was recorded (in real time a phase can
/// end before any write faulted: that is no figure, not 0).
fn us(l: &LatencySummary, f: impl Fn(&LatencySummary) -> u64) -> Option<f64> {
    (l.count > 0).then(|| f(l) as f64 / 1e3)
}

/// The metrics of a run: the concurrent contrast with `--concurrent`; otherwise the
/// selftest's phases, with the clear step or the ring reset.
fn metrics(a: &DirtyLogPerfArgs) -> Vec<Metric<Report>> {
    if a.concurrent {
        return CONCURRENT_METRICS.to_vec();
    }
    let skip = if a.log.dirty_ring.is_some() {
        "clear dirty log avg"
    } else {
        "reset dirty rings avg"
    };
    METRICS.iter().filter(|m| m.name != skip).copied().collect()
}

impl Benchmark for DirtyLogPerfArgs {
    type Report = Report;
    const NAME: &'static str = NAME;
    crate::forward_benchmark! { vary: yes, check: check, measure: measure, print: print_text }

    fn vary_table() -> &'static [driver::vary::Key<Self>] {
        VARY
    }

    fn metrics(&self) -> Vec<Metric<Report>> {
        metrics(self)
    }

    fn headline(&self) -> Vec<&'static str> {
        if self.concurrent {
            return vec!["harvest avg, vCPUs writing", "write p99, during harvests"];
        }
        vec!["iteration 2 dirty memory", "get dirty log avg"]
    }

    fn lines(&self, r: &Report) -> Vec<Lines<Report>> {
        vec![lines(r)]
    }

    fn comparison_title(&self, [k0, k1]: [BackendArg; 2]) -> String {
        format!(
            "dirty-log-perf on {} and {}: --format {} (sim) -v {} -b {} -i {}{}, one run each, in this process",
            k0.name(),
            k1.name(),
            self.machine.format.name(),
            self.work.vcpus,
            format_size(self.work.bytes),
            self.iterations,
            run_flags(self)
        )
    }

    fn sweep_title(&self, kind: BackendArg) -> String {
        let format = if self.vary.iter().any(|v| v.key == "format") || kind != BackendArg::Sim {
            String::new()
        } else {
            format!(" --format {}", self.machine.format.name())
        };
        format!(
            "dirty-log-perf sweep on {}:{format} -b {} -i {}{}, one run per row, all in this process",
            kind.name(),
            format_size(self.work.bytes),
            self.iterations,
            run_flags(self)
        )
    }
}

/// Refuses settings the engine cannot run together (before anything is built), and sizes the
/// machines cannot hold, split evenly by `-x`, together with the native baseline (both are
/// mapped at once).
fn check(a: &DirtyLogPerfArgs) -> Result<(), String> {
    let mut engine_only = a.dirty.engine_only();
    if a.vary.iter().any(|v| !BOTH_MACHINES.contains(&v.key)) {
        engine_only.push("--vary (of an engine setting)");
    }
    a.machine.check_backends(&a.backend, &engine_only)?;
    a.log.check()?;
    let vm_config = a.dirty.apply(a.machine.vm_config());
    a.dirty
        .check(&vm_config, a.machine.format, a.log.dirty_ring.is_some())?;
    if let Some(ring) = a.log.dirty_ring {
        check_kvm_ring(&a.backend, ring, "--dirty-ring")?;
    }
    a.pin.plan(a.work.vcpus)?;
    if a.clock.is_virtual() && a.backend.contains(&BackendArg::Kvm) {
        return Err("--clock virtual runs only on the simulated machine (--backend sim)".into());
    }
    a.work
        .check_fits(&a.backend, &a.machine, 0, 2)?
        .slots_divide(a.slots)
}

/// The machine spec the flags describe.
fn spec(a: &DirtyLogPerfArgs) -> Spec {
    let l = &a.log;
    let dirty = dirty_config(
        l.dirty_ring.is_none() && !l.no_manual,
        l.dirty_ring.unwrap_or(0),
    );
    let slots = a.slots as usize;
    let region = slat_workload::RegionSpec {
        slots,
        ..a.work.region(&a.machine, dirty)
    };
    Spec::new(&a.machine, region, a.dirty.apply(a.machine.vm_config()))
}

/// One iteration: the guest dirties memory, the host harvests the log; its native pass is
/// filled in later ([`native_passes`]). Returns the guest pass too (its latencies, when timed).
fn iterate(
    m: &dyn Backend,
    harvest: &mut Harvest,
    spec: &Spec,
    params: PassParams,
    i: u32,
) -> CliResult<(Iteration, Pass)> {
    let pass = m.run_pass(params)?;
    let h = harvest.run(m, spec)?;
    let it = Iteration {
        iteration: i,
        dirty: pass.wall,
        native: Duration::ZERO,
        ratio_guest_over_native: 0.0,
        harvest: h,
        ring_full_exits: pass.ring_full_exits(),
    };
    Ok((it, pass))
}

/// The native baselines, after every guest pass and harvest: populate's (returned), then one
/// per iteration, filled into `iterations`. One run between two guest passes went over as
/// much other host memory and evicted from the host's caches what the next pass and harvest
/// find there (the page tables, the bitmap, the host's own), which a VMM's vCPUs and harvest
/// find warm; in virtual time native baselines run outside the simulation.
fn native_passes(
    native: &Native,
    populate: PassParams,
    params: PassParams,
    iterations: &mut [Iteration],
    a: &DirtyLogPerfArgs,
) -> CliResult<Pass> {
    let phase = Phase::start(crate::report::NATIVE_PHASE, quiet(a.out.json));
    // Real time on host threads: outside the simulation under --clock virtual.
    let populate = virtual_time::outside(|| native.run(populate))?;
    let params = PassParams {
        timed: false,
        ..params
    };
    for it in iterations {
        let nat: Pass = virtual_time::outside(|| native.run(params))?;
        it.native = nat.wall;
        it.ratio_guest_over_native = ratio(it.dirty, nat.wall);
    }
    phase.done();
    Ok(populate)
}

/// The time the vCPUs write before each concurrent harvest: `--harvest-interval`, or the mean
/// dirty pass of the iterations.
fn interval(a: &DirtyLogPerfArgs, iterations: &[Iteration]) -> Duration {
    match a.harvest_interval {
        Some(ms) => Duration::from_millis(ms),
        None => {
            let n = iterations.len().max(1) as u32;
            iterations.iter().map(|i| i.dirty).sum::<Duration>() / n
        }
    }
}

/// Disables dirty logging, with the vCPUs still dirtying memory under `-e`.
fn disable(m: &dyn Backend, evil: bool, params: PassParams) -> CliResult<Duration> {
    if evil {
        m.start_loop(params)?;
    }
    let t0 = Stopwatch::start();
    m.set_dirty_logging(false)?;
    let d = t0.elapsed();
    if evil {
        m.halt()?;
    }
    Ok(d)
}

impl Config {
    /// The configuration a run reports: the flags, as `cfg` applied them.
    fn new(
        a: &DirtyLogPerfArgs,
        cfg: &Spec,
        vm: VmSettings,
        pinned_cpus: Option<Vec<usize>>,
    ) -> Config {
        Config {
            vm,
            work: a.work.settings(),
            iterations: a.iterations,
            random: a.random,
            evil: a.evil,
            write_percent: a.write_percent,
            slots: a.slots,
            seed: a.seed,
            manual_protect: cfg.manual_protect(),
            dirty_ring: a.log.dirty_ring,
            clear_chunk: a.log.clear_chunk.name(),
            concurrent: a.concurrent,
            pinned_cpus,
        }
    }
}

/// One run on `kind`: populate, enable logging, the iterations, disable logging.
fn measure(a: &DirtyLogPerfArgs, kind: BackendArg) -> CliResult<Report> {
    check(a).map_err(CliError::bad)?;
    let cfg = spec(a);
    let what = backend::native_note(a.work.backing);
    let vt = a.clock.start()?;
    let sim = vt.as_ref().map(VirtualRun::threads);
    let (m, p) = backend::start_with(kind, &cfg, what, quiet(a.out.json), sim)?;
    let native = Native::new(kind, m.layout(), a.work.backing, cfg.region.prefault)?;
    p.done();
    let pinned_cpus = backend::pin(m.as_ref(), &a.pin, a.work.vcpus)?;
    // Populate: every vCPU writes its memory once, sequentially, on the machine and natively.
    let populate_params = PassParams {
        write_percent: 100,
        random: false,
        seed: a.seed,
        timed: false,
        touches: None,
    };
    let populate = m.run_pass(populate_params)?;
    let t0 = Stopwatch::start();
    m.set_dirty_logging(true)?;
    let enable = t0.elapsed();
    let params = PassParams {
        write_percent: a.write_percent,
        random: a.random,
        seed: a.seed,
        timed: a.concurrent,
        touches: None,
    };
    let mut harvest = Harvest::new(m.as_ref(), a.log.clear_chunk);
    let mut quiet_passes = QuietPasses::default();
    let mut iterations = Vec::new();
    for i in 1..=a.iterations {
        let (it, pass) = iterate(m.as_ref(), &mut harvest, &cfg, params, i)?;
        quiet_passes.keep(i, pass, it.harvest);
        iterations.push(it);
    }
    let concurrent = match a.concurrent {
        true => Some(run_concurrent(
            a,
            m.as_ref(),
            &cfg,
            &mut harvest,
            params,
            &iterations,
            &quiet_passes,
        )?),
        false => None,
    };
    let guest_bytes = a.work.bytes.saturating_mul(a.work.vcpus as u64);
    let mmu_memory = MmuMemoryFigures::of(m.as_ref(), guest_bytes);
    let disable = disable(m.as_ref(), a.evil, params)?;
    let populate_native = native_passes(&native, populate_params, params, &mut iterations, a)?;
    let pcpus = m.sim().map(|s| s.pcpus());
    let (settings, log) = text::settings(a, &cfg);
    let machine_lines =
        backend::machine_lines(m.as_ref(), &cfg, &settings, &log, pinned_cpus.as_deref());
    let get_total = iterations.iter().map(|i| i.harvest.get).sum();
    let clear_total = iterations
        .iter()
        .map(|i| i.harvest.clear.or(i.harvest.reset))
        .sum();
    let vm = cfg.vm_settings(kind, pcpus);
    let (stats, gpa, clock) = end_run(m, vt)?;
    Ok(Report {
        head: RunHead::new(NAME, kind, a.machine.format),
        config: Config::new(a, &cfg, vm, pinned_cpus),
        populate: populate.wall,
        populate_native: populate_native.wall,
        enable,
        iterations,
        disable,
        get_total,
        clear_total,
        concurrent,
        stats,
        mmu_memory,
        clock,
        machine_lines,
        format_header: format_header(kind, a.machine.format, &cfg.vm),
        gpa,
    })
}

/// The machine's counters and test-region address, then the machine gone and, in virtual
/// time, the simulation ended (its clock report; a failed simulation fails the run).
fn end_run(
    m: Box<dyn Backend>,
    vt: Option<VirtualRun>,
) -> CliResult<(serde_json::Value, u64, ClockReport)> {
    let (stats, gpa) = (m.stats(), m.layout().gpa);
    drop(m);
    let mut clock = virtual_time::finish(vt)?;
    clock.count_faults(&stats);
    Ok((stats, gpa, clock))
}

/// `--concurrent`: the harvests while the vCPUs write, after the iterations.
fn run_concurrent(
    a: &DirtyLogPerfArgs,
    m: &dyn Backend,
    cfg: &Spec,
    harvest: &mut Harvest,
    params: PassParams,
    iterations: &[Iteration],
    quiet_passes: &QuietPasses,
) -> CliResult<concurrent_harvest::ConcurrentReport> {
    let what = format!(
        "concurrent harvest: {} harvests while the vCPUs write",
        a.iterations
    );
    let p = Phase::start(what, quiet(a.out.json));
    let r = concurrent_harvest::run(
        m,
        cfg,
        harvest,
        params,
        a.iterations,
        interval(a, iterations),
        quiet_passes,
    )?;
    p.done();
    Ok(r)
}

/// `--plot`: the dirty, harvest and native times of every iteration.
fn lines(r: &Report) -> Lines<Report> {
    fn line(name: &str, f: fn(&Iteration) -> Option<Duration>) -> (String, SeriesOf<Report>) {
        let points = move |r: &Report| {
            r.iterations
                .iter()
                .map(|i| {
                    let x = i.iteration as f64 - 1.0;
                    (x, f(i).map(|d| d.as_secs_f64() * 1e3))
                })
                .collect()
        };
        (name.to_string(), Box::new(points))
    }
    let mut series = vec![
        line("dirty memory (guest pass)", |i| Some(i.dirty)),
        line("get dirty log (harvest)", |i| Some(i.harvest.get)),
    ];
    if r.iterations.iter().any(|i| i.harvest.clear.is_some()) {
        series.push(line("clear dirty log", |i| i.harvest.clear));
    }
    if r.iterations.iter().any(|i| i.harvest.reset.is_some()) {
        series.push(line("reset dirty rings", |i| i.harvest.reset));
    }
    series.push(line("native memory (host pass)", |i| Some(i.native)));
    Lines {
        title: format!(
            "dirty-log-perf on {}: -v {} -b {}",
            r.head.backend,
            r.config.work.vcpus,
            format_size(r.config.work.bytes_per_vcpu)
        ),
        x_desc: "iteration",
        y_desc: "time (ms, lower is better)",
        series,
        x_names: Some(
            r.iterations
                .iter()
                .map(|i| i.iteration.to_string())
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A phase in which no write faulted has no latency figure; it used to report 0 µs, which
    /// `slat reproduce` then compared as a measurement.
    #[test]
    fn no_recorded_write_is_no_figure() {
        let none = LatencySummary::default();
        assert_eq!(us(&none, |l| l.p99_ns), None);
        let one = LatencySummary {
            count: 1,
            p99_ns: 1500,
            ..LatencySummary::default()
        };
        assert_eq!(us(&one, |l| l.p99_ns), Some(1.5));
    }
}
