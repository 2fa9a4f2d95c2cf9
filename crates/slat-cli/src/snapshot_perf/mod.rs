//! `slat snapshot-perf`: what a snapshot fuzzer's or sandbox's reset costs when it copies back
//! only the dirty pages (`slat_harness::MachineSnapshot` over `slat_dirty::Snapshot`), against
//! the floor for the same work (the same page copies between two warm host buffers, measured
//! in the same run) and against a full-copy reset of all guest RAM.
//!
//! **k dirty pages of a `-b` guest.** The machine has `-b` bytes per vCPU, not pre-faulted;
//! each pass makes k accesses per vCPU (`PassParams::touches`): the first k pages of its
//! region in order (exactly k dirty pages), or k draws over all of it with `-a` (the distinct
//! pages they hit). Every reset's page count is checked against the shared memstress model (a
//! mismatch fails the run). So the parts of a reset that grow with the guest — the harvest's
//! bitmap, CLEAR, the snapshot's size — are measured at the guest's size. The snapshot holds
//! only the pages that are not all zero, so a 16 GiB guest that touched little costs little
//! host memory (each row reports the process's RSS).
//!
//! One **execution** is what a snapshot fuzzer does per input: a guest run dirtying k pages
//! and a reset; executions per second count both. Every reset copies page by page or, when
//! the dirty pages reach the snapshot's measured crossover, copies everything back (counted
//! in `full_resets`). The full-copy reset row (`full_copy`) copies all guest RAM back, which
//! faults in every page: it runs only on guests of at most [`FULL_COPY_MAX`] bytes.
//!
//! `--clock virtual` (docs/design/virtual-time.md §7): the main thread is the simulation's
//! host CPU, so the harvest and re-arm run through the engine on its clock, with the vCPUs'
//! faults contending as they would; the page copies and zeroings a reset (and the floor) does
//! in host memory are charged per page (`page_copy`, `zero_page`) through
//! `TestMachine::charge_host_pages`. The profile prices a full copy's pages as a per-page
//! reset's, so the crossover is 1 (never).
//!
//! `--vary KEY=V1,V2` (`vary.rs`): one such run per combination of vCPU count, harvest,
//! order, machine, k and guest size, in this process, and one table.

mod floor;
mod text;
mod vary;

use self::vary::VARY;
use crate::args::{
    check_kvm_ring, BackendArg, ClearChunk, LogArgs, MachineArgs, OutputArgs, PinArgs, Workload,
};
use crate::backend::{self, dirty_config, CliMachine, OnMachine, Spec};
use crate::driver::{self, Benchmark};
use crate::error::{CliError, CliResult};
use crate::output::{
    format_name, print_json, summarize, AllRuns, Metric, MetricSummary, Sweep, VmSettings,
    WorkSettings,
};
use crate::report::{per, quiet, runtime, Phase};
use crate::virtual_time::{self, ClockArgs, ClockReport, Stopwatch, VirtualRun};
use clap::Args;
use floor::Floor;
use hdrhistogram::Histogram;
use serde::Serialize;
use slat_addr::PAGE_SIZE;
use slat_harness::{MachineSnapshot, ResetReport};
use slat_workload::{GuestRam, PassParams, Pattern, TestMachine};
use std::time::Duration;
use text::{print_comparison, print_run, print_summary};

/// Largest guest (all vCPUs) the full-copy reset runs on: it writes every page, so it faults
/// in all guest RAM, which a per-page reset never does.
pub const FULL_COPY_MAX: u64 = 4 << 30;

/// Flags of `slat snapshot-perf`.
#[derive(Debug, Clone, Args)]
pub struct SnapshotPerfArgs {
    #[command(flatten)]
    pub work: Workload,
    /// Pages each vCPU dirties per iteration: a comma-separated list of page counts and `all`
    /// (every page of -b). Every k runs on the one machine of -b per vCPU: a pass writes the
    /// first k pages of each vCPU's region (k random draws over all of it with -a). Default:
    /// 1, 4, 16, 64, ... up to -b, and all.
    #[arg(short = 'k', value_name = "PAGES,...", value_delimiter = ',', value_parser = k_value)]
    pub k: Vec<KValue>,
    /// Dirty pages in pseudo-random order (each vCPU draws k pages with repetition, so fewer
    /// than k distinct pages are dirtied) instead of sequentially (exactly k).
    #[arg(short = 'a')]
    pub random: bool,
    /// Iterations (one pass and one reset each) per k (1-1000000).
    #[arg(short = 'i', value_parser = clap::value_parser!(u32).range(1..=1_000_000), default_value_t = 100)]
    pub iterations: u32,
    /// After every reset, compare all of guest memory with the snapshot byte for byte; a
    /// difference fails the run (exit status 1). Not timed.
    #[arg(long)]
    pub verify: bool,
    #[command(flatten)]
    pub log: LogArgs,
    /// The machine(s) to run on: `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` to run both
    /// in this process and print a table comparing their reset times.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub pin: PinArgs,
    #[command(flatten)]
    pub clock: ClockArgs,
    /// Run once per combination of settings, one table of combination x k (the keys: --help).
    #[arg(long = "vary", value_parser = driver::vary::parser(VARY), value_name = "KEY=V1,V2", long_help = driver::vary::help(VARY, vary::EXAMPLES))]
    pub vary: Vec<driver::vary::Vary>,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// One `-k` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KValue {
    /// This many pages per vCPU.
    Pages(u64),
    /// Every page of -b.
    All,
}

/// Parses a `-k` value: a positive page count or `all`.
fn k_value(s: &str) -> Result<KValue, String> {
    if s == "all" {
        return Ok(KValue::All);
    }
    match s.parse::<u64>() {
        Ok(0) | Err(_) => Err(format!(
            "`{s}` is not a page count (a positive integer) or `all`"
        )),
        Ok(n) => Ok(KValue::Pages(n)),
    }
}

const NAME: &str = "snapshot-perf";

/// The run's settings, as the report records them.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    #[serde(flatten)]
    pub vm: VmSettings,
    #[serde(flatten)]
    pub work: WorkSettings,
    pub random: bool,
    pub iterations: u32,
    /// `get` (GET clears), `clear` (GET + CLEAR) or `ring`.
    pub log: &'static str,
    /// How the log is re-armed after a harvest: `get` (GET_DIRTY_LOG re-arms as it reads),
    /// `clear-chunks` (CLEAR_DIRTY_LOG of exactly the harvested 64-page chunks, coalesced
    /// into runs where one call costs less than several) or `ring-reset`.
    pub rearm: &'static str,
    /// Full copy over per-page copy, per page, measured once in this process: a reset of at
    /// least this fraction of the guest copies everything back.
    pub crossover_fraction: f64,
    pub verify: bool,
    /// `-c`: vCPU i's thread was pinned to `pinned_cpus[i]` (read back from the kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_cpus: Option<Vec<usize>>,
}

/// Figures of one k.
#[derive(Debug, Clone, Serialize)]
pub struct KRow {
    /// Pages each vCPU's pass writes (accesses, with -a).
    pub k_per_vcpu: u64,
    /// Pages of the machine's test region (`-b × vCPUs` / 4 KiB).
    pub ram_pages: u64,
    /// Mean pages copied back per reset (each dirty page once).
    pub dirty_pages: f64,
    pub resets: u64,
    /// Resets per second of reset time (harvest + re-arm + copy).
    pub resets_per_s: f64,
    pub reset_p50_us: f64,
    pub reset_p99_us: f64,
    pub reset_mean_us: f64,
    pub us_per_dirty_page: f64,
    /// Mean time reading the log (GET_DIRTY_LOG, or collecting ring entries), µs.
    pub harvest_mean_us: f64,
    /// Mean time re-arming it separately (CLEAR_DIRTY_LOG, RESET_DIRTY_RINGS), µs; 0 when GET
    /// re-armed.
    pub rearm_mean_us: f64,
    pub copy_mean_us: f64,
    /// Median memcpy of as many pages between two host buffers (the floor), µs.
    pub floor_p50_us: f64,
    pub floor_p99_us: f64,
    pub ratio_reset_over_floor: Option<f64>,
    /// full-copy reset p50 / this reset p50: how much the dirty log saves.
    pub ratio_full_over_reset: Option<f64>,
    /// Resets checked byte for byte (`--verify`).
    pub verified: u64,
    /// Executions per second: one guest pass dirtying the k pages plus its reset.
    pub execs_per_s: f64,
    /// Mean guest pass (the run that dirties the pages), µs.
    pub pass_mean_us: f64,
    /// Mean pages a reset wrote back by zeroing (all zero in the snapshot).
    pub zeroed_pages: f64,
    /// Resets that copied the whole snapshot back (dirty pages at or over the crossover).
    pub full_resets: u64,
    /// The snapshot's crossover: a reset of at least this many pages copies everything.
    pub crossover_pages: u64,
    /// Mean 64-page chunks CLEAR re-armed, or ring entries reset, per reset (0 for GET).
    pub rearmed_mean: f64,
    /// Pages the snapshot holds (the non-zero ones).
    pub snapshot_held_pages: u64,
    /// This process's resident memory after the row, MiB (`null` where unreadable).
    pub rss_mib: Option<f64>,
}

/// The full-copy reset: all of the `-b` machine's RAM copied back.
#[derive(Debug, Clone, Serialize)]
pub struct FullCopy {
    pub pages: u64,
    pub resets: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

/// One run on one machine.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub backend: &'static str,
    /// The page-table format (`null` on kvm).
    pub format: Option<&'static str>,
    pub config: Config,
    /// One per k, in `-k` order.
    pub rows: Vec<KRow>,
    /// `null` on guests over [`FULL_COPY_MAX`] bytes (it would fault in all their RAM).
    pub full_copy: Option<FullCopy>,
    /// Whose time the report's times are.
    #[serde(flatten)]
    pub clock: ClockReport,
}

/// One reset-p50 summary over `--repeat` runs.
#[derive(Debug, Clone, Serialize)]
pub struct KSummary {
    pub backend: &'static str,
    pub k_per_vcpu: u64,
    pub reset_p50_us: MetricSummary,
}

/// The document: every run (backends × repeats) and, per backend and k, the reset p50 over
/// the repeats.
pub type Report = AllRuns<Run, KSummary>;

impl Benchmark for SnapshotPerfArgs {
    type Report = Run;
    const NAME: &'static str = NAME;
    crate::forward_benchmark! { vary: yes, check: check, measure: measure, print: print_run }

    fn vary_table() -> &'static [driver::vary::Key<Self>] {
        VARY
    }

    fn metrics(&self) -> Vec<Metric<Run>> {
        METRICS.to_vec()
    }

    fn own_output(&self) -> Option<fn(&Self, Vec<(BackendArg, Vec<Run>)>) -> CliResult> {
        Some(finish)
    }

    fn print_sweep(&self, sweep: &Sweep<Run>) -> bool {
        text::print_sweep(self, sweep);
        true
    }

    fn refuse(&self) -> Option<String> {
        if self.vary.is_empty() {
            return None;
        }
        if self.out.repeat > 1 {
            return Some(
                "--repeat with --vary: a sweep runs each row once; drop one of them".into(),
            );
        }
        if self.backend.len() > 1 {
            return Some("--backend with two machines and --vary: vary the machine with --vary backend=sim,kvm".into());
        }
        None
    }
}

/// The headline figures (the bars of `--plot`): the reset at the smallest and largest k, and
/// the full copy.
const METRICS: &[Metric<Run>] = &[
    Metric::lower("reset p50, smallest k", "us", |r| {
        r.rows.first().map(|k| k.reset_p50_us)
    }),
    Metric::lower("reset p50, largest k", "us", |r| {
        r.rows.last().map(|k| k.reset_p50_us)
    }),
    Metric::lower("full-copy reset p50", "us", |r| {
        r.full_copy.as_ref().map(|f| f.p50_us)
    }),
];

/// The one document of every machine's runs, or the summaries under the runs' text.
fn finish(a: &SnapshotPerfArgs, all: Vec<(BackendArg, Vec<Run>)>) -> CliResult {
    let report = Report::new(NAME, &a.out, all, summary);
    if a.out.json {
        return print_json(&report, &a.backend);
    }
    if a.out.repeat > 1 {
        print_summary(&report);
    }
    if a.backend.len() == 2 {
        print_comparison(&report);
    }
    Ok(())
}

/// Refuses what cannot run, with the flag to change (exit status 2).
fn check(a: &SnapshotPerfArgs) -> Result<(), String> {
    crate::limits::refuse_phantom(
        a.work.backing,
        "snapshot-perf (its snapshots copy guest memory)",
    )?;
    if a.clock.is_virtual() && a.backend.contains(&BackendArg::Kvm) {
        return Err("--clock virtual runs only on the simulated machine (--backend sim)".into());
    }
    a.machine.check_backends(&a.backend, &[])?;
    a.pin.plan(a.work.vcpus)?;
    if a.log.clear_chunk != ClearChunk::Slot {
        return Err(
            "--clear-chunk: snapshot-perf re-arms a whole memslot per CLEAR; drop --clear-chunk"
                .into(),
        );
    }
    if a.log.dirty_ring.is_some() && a.log.no_manual {
        return Err("-g selects GET that clears, --dirty-ring the rings: give one".into());
    }
    if let Some(ring) = a.log.dirty_ring {
        check_kvm_ring(&a.backend, ring, "--dirty-ring")?;
    }
    // The machine; the snapshot holds its non-zero pages and the floor's buffers the dirty
    // ones, both at most the guest's touched memory.
    a.work.check_fits(&a.backend, &a.machine, 0, 1)?;
    let all = a.work.bytes / PAGE_SIZE;
    if let Some(KValue::Pages(k)) =
        a.k.iter()
            .find(|k| matches!(k, KValue::Pages(p) if *p > all))
    {
        return Err(format!(
            "-k {k}: more pages than -b gives each vCPU ({all}); use at most {all}, or `all`"
        ));
    }
    Ok(())
}

/// The k of each row, in pages per vCPU: `-k`, or powers of 4 up to -b and all of it.
fn k_list(a: &SnapshotPerfArgs) -> Vec<u64> {
    let all = a.work.bytes / PAGE_SIZE;
    if a.k.is_empty() {
        let mut v: Vec<u64> = std::iter::successors(Some(1u64), |k| k.checked_mul(4))
            .take_while(|&k| k < all)
            .collect();
        v.push(all);
        return v;
    }
    a.k.iter()
        .map(|k| match k {
            KValue::Pages(p) => *p,
            KValue::All => all,
        })
        .collect()
}

fn log_name(a: &SnapshotPerfArgs) -> &'static str {
    match (a.log.dirty_ring, a.log.no_manual) {
        (Some(_), _) => "ring",
        (None, true) => "get",
        (None, false) => "clear",
    }
}

fn rearm_name(a: &SnapshotPerfArgs) -> &'static str {
    match log_name(a) {
        "ring" => "ring-reset",
        "get" => "get",
        _ => "clear-chunks",
    }
}

/// Every k on the machine `kind` of -b per vCPU, then the full-copy reset.
fn measure(a: &SnapshotPerfArgs, kind: BackendArg) -> CliResult<Run> {
    let l = &a.log;
    let dirty = dirty_config(
        l.dirty_ring.is_none() && !l.no_manual,
        l.dirty_ring.unwrap_or(0),
    );
    let mut region = a.work.region(&a.machine, dirty);
    // A fuzzer's guest is mostly untouched: fault in only what the passes write.
    region.prefault = false;
    let spec = Spec::new(&a.machine, region, a.machine.vm_config());
    // In virtual time the calling thread is the host CPU that harvests, re-arms and copies.
    let vt = a.clock.start()?;
    let sim = vt.as_ref().map(VirtualRun::threads);
    let (rows, full, stats, pinned_cpus) = backend::visit_in(kind, &spec, sim, OnK { a, kind })?;
    // The machine is gone: the simulation can end.
    let mut clock = virtual_time::finish(vt)?;
    clock.count_faults(&stats);
    let vm = a.machine.vm_config();
    Ok(Run {
        backend: kind.name(),
        format: format_name(kind, a.machine.format),
        config: Config {
            vm: VmSettings::of_machine(kind, &a.machine, &vm),
            work: a.work.settings(),
            random: a.random,
            iterations: a.iterations,
            log: log_name(a),
            rearm: rearm_name(a),
            crossover_fraction: crossover_fraction(a),
            verify: a.verify,
            pinned_cpus,
        },
        rows,
        full_copy: full,
        clock,
    })
}

/// The full copy's crossover (a fraction of the guest): measured in this process in real
/// time; 1 (never) in virtual time, where the cost profile prices a page of a full copy as
/// one copied or zeroed alone, so a full copy never costs less than the dirty pages' copies.
fn crossover_fraction(a: &SnapshotPerfArgs) -> f64 {
    if a.clock.is_virtual() {
        1.0
    } else {
        slat_dirty::crossover_fraction()
    }
}

/// One machine's measurement, on a machine of any type.
struct OnK<'a> {
    a: &'a SnapshotPerfArgs,
    kind: BackendArg,
}

impl OnMachine for OnK<'_> {
    /// The rows, the full copy, the machine's counters and where `-c` pinned the vCPUs.
    type Out = (
        Vec<KRow>,
        Option<FullCopy>,
        serde_json::Value,
        Option<Vec<usize>>,
    );
    fn run<M: TestMachine + CliMachine>(self, m: &M) -> CliResult<Self::Out> {
        let pinned = backend::pin(m, &self.a.pin, self.a.work.vcpus)?;
        let ram = m.guest_ram();
        let (rows, full) = Bench {
            a: self.a,
            kind: self.kind,
            m,
            ram,
        }
        .run()?;
        Ok((rows, full, m.stats(), pinned))
    }
}

/// One machine's measurement.
struct Bench<'a, M: TestMachine> {
    a: &'a SnapshotPerfArgs,
    kind: BackendArg,
    m: &'a M,
    ram: &'a GuestRam,
}

/// Nanoseconds from 1 ns to an hour, 3 significant digits.
fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds and precision")
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Sums of a reset's parts.
#[derive(Default)]
struct Split {
    pages: u64,
    zeroed: u64,
    full: u64,
    rearmed: u64,
    harvest: Duration,
    rearm: Duration,
    copy: Duration,
    pass: Duration,
}

impl Split {
    fn add(&mut self, r: &ResetReport, pass: Duration) {
        self.pages += r.pages;
        self.zeroed += r.zeroed;
        self.full += u64::from(r.full);
        self.rearmed += r.rearmed;
        self.harvest += r.harvest;
        self.rearm += r.rearm;
        self.copy += r.copy;
        self.pass += pass;
    }
}

impl<'a, M: TestMachine> Bench<'a, M> {
    /// Iteration `i`'s pass of `k` accesses per vCPU: a new seed each time, so random passes
    /// dirty other pages.
    fn params(&self, i: u32, k: u64) -> PassParams {
        PassParams {
            write_percent: 100,
            random: self.a.random,
            seed: i.wrapping_add(2),
            timed: false,
            touches: Some(k),
        }
    }

    /// Distinct pages the memstress model writes in a pass with `p`: O(accesses), not
    /// O(guest).
    fn model_pages(&self, p: PassParams) -> u64 {
        let l = self.m.layout();
        let mut hit = Vec::new();
        for i in 0..l.vcpus {
            let (gpa, _, pages) = l.region(i);
            let first = (gpa - l.gpa) / PAGE_SIZE;
            hit.extend(
                Pattern::new(p, i as u32, pages)
                    .filter(|&(_, write)| write)
                    .map(|(page, _)| first + page),
            );
        }
        hit.sort_unstable();
        hit.dedup();
        hit.len() as u64
    }

    /// Runs a pass; returns its parameters and how long it took (on the host CPU's clock).
    fn pass(&self, i: u32, k: u64) -> CliResult<(PassParams, Duration)> {
        let p = self.params(i, k);
        let t = Stopwatch::start();
        self.m.run_pass(p).map_err(runtime)?;
        Ok((p, t.elapsed()))
    }

    fn verify(&self, snap: &MachineSnapshot<'_, M>, what: &str, i: u32) -> CliResult<bool> {
        if !self.a.verify {
            return Ok(false);
        }
        snap.verify()
            .map_err(|e| CliError::Runtime(format!("--verify: after {what} {i}: {e}")))?;
        Ok(true)
    }

    /// A pass over the largest k's pages (first touch, outside the measurement: resets then
    /// meet steady-state mappings), the snapshot, every k's iterations, then the full-copy
    /// resets on a guest small enough.
    fn run(&self) -> CliResult<(Vec<KRow>, Option<FullCopy>)> {
        let l = self.m.layout();
        let ram_pages = l.total_pages();
        let ks = k_list(self.a);
        let most = ks.iter().copied().max().unwrap_or(1);
        self.pass(u32::MAX - 2, most)?;
        // SAFETY: `ram` is `m`'s guest RAM (both from the same machine, in `OnK::run`), and
        // the guest runs only through `run_pass`, which returns with every vCPU stopped, so
        // nothing writes the RAM during take, reset or verify.
        let mut snap = unsafe { MachineSnapshot::take(self.m, self.ram) }.map_err(runtime)?;
        if self.a.clock.is_virtual() {
            snap.snapshot_mut().set_crossover_pages(u64::MAX);
        }
        let mut rows = Vec::new();
        for &k in &ks {
            let phase = Phase::start(
                format!("{}: k = {k} pages per vCPU", self.kind.name()),
                quiet(self.a.out.json),
            );
            rows.push(self.k_row(&mut snap, k, ram_pages)?);
            phase.done();
        }
        let guest = ram_pages * PAGE_SIZE;
        if guest > FULL_COPY_MAX {
            return Ok((rows, None));
        }
        let phase = Phase::start(
            format!("{}: full-copy reset of {ram_pages} pages", self.kind.name()),
            quiet(self.a.out.json),
        );
        let full = self.full_copy(&mut snap, ram_pages, most)?;
        phase.done();
        for r in &mut rows {
            r.ratio_full_over_reset = per(full.p50_us, r.reset_p50_us);
        }
        Ok((rows, Some(full)))
    }

    /// `-i` executions dirtying `k` pages per vCPU, each reset timed beside its floor.
    fn k_row(&self, snap: &mut MachineSnapshot<'_, M>, k: u64, ram_pages: u64) -> CliResult<KRow> {
        let vcpus = self.m.layout().vcpus as u64;
        let mut floor = Floor::new(k.saturating_mul(vcpus).min(ram_pages)).map_err(runtime)?;
        let (mut h, mut fh, mut split) = (hist(), hist(), Split::default());
        let mut verified = 0;
        for i in 0..self.a.iterations {
            let (p, pass) = self.pass(i, k)?;
            let r = snap.reset().map_err(runtime)?;
            let want = self.model_pages(p);
            if r.pages != want {
                return Err(CliError::Runtime(format!(
                    "reset {i}: the dirty log listed {} pages, the pass wrote {want}",
                    r.pages
                )));
            }
            record(&mut h, r.total());
            split.add(&r, pass);
            record(&mut fh, floor.copy(self.m, r.pages - r.zeroed, r.zeroed));
            verified += u64::from(self.verify(snap, "reset", i)?);
        }
        let mut row = self.row(&h, &fh, &split, ram_pages, verified);
        row.k_per_vcpu = k;
        row.crossover_pages = snap.snapshot().crossover_pages();
        row.snapshot_held_pages = snap.snapshot().held_pages();
        Ok(row)
    }

    /// `-i` full-copy resets, each after a pass of `k` pages per vCPU.
    fn full_copy(
        &self,
        snap: &mut MachineSnapshot<'_, M>,
        pages: u64,
        k: u64,
    ) -> CliResult<FullCopy> {
        let mut h = hist();
        for i in 0..self.a.iterations {
            self.pass(i, k)?;
            let r = snap.reset_all().map_err(runtime)?;
            record(&mut h, r.copy);
            self.verify(snap, "full-copy reset", i)?;
        }
        Ok(FullCopy {
            pages,
            resets: h.len(),
            p50_us: us(&h, 0.5),
            p99_us: us(&h, 0.99),
            mean_us: h.mean() / 1000.0,
        })
    }

    fn row(
        &self,
        h: &Histogram<u64>,
        fh: &Histogram<u64>,
        s: &Split,
        ram_pages: u64,
        verified: u64,
    ) -> KRow {
        let n = h.len().max(1) as f64;
        let total = (s.harvest + s.rearm + s.copy).as_secs_f64();
        let execs = total + s.pass.as_secs_f64();
        let mean_us = h.mean() / 1000.0;
        let dirty = s.pages as f64 / n;
        let mean = |d: Duration| d.as_secs_f64() * 1e6 / n;
        KRow {
            k_per_vcpu: 0,
            ram_pages,
            dirty_pages: dirty,
            resets: h.len(),
            resets_per_s: if total > 0.0 { n / total } else { 0.0 },
            reset_p50_us: us(h, 0.5),
            reset_p99_us: us(h, 0.99),
            reset_mean_us: mean_us,
            us_per_dirty_page: per(mean_us, dirty).unwrap_or(0.0),
            harvest_mean_us: mean(s.harvest),
            rearm_mean_us: mean(s.rearm),
            copy_mean_us: mean(s.copy),
            floor_p50_us: us(fh, 0.5),
            floor_p99_us: us(fh, 0.99),
            ratio_reset_over_floor: per(us(h, 0.5), us(fh, 0.5)),
            ratio_full_over_reset: None,
            verified,
            execs_per_s: if execs > 0.0 { n / execs } else { 0.0 },
            pass_mean_us: mean(s.pass),
            zeroed_pages: s.zeroed as f64 / n,
            full_resets: s.full,
            crossover_pages: 0,
            rearmed_mean: s.rearmed as f64 / n,
            snapshot_held_pages: 0,
            rss_mib: rss_mib(),
        }
    }
}

/// This process's resident memory (VmRSS), MiB.
fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

fn record(h: &mut Histogram<u64>, d: Duration) {
    // A duration past the histogram's range (an hour) is clamped, never dropped; 0 ns counts
    // as the lowest bucket.
    h.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1));
}

/// Per backend and k, the reset p50 over the repeats.
fn summary(all: &[(BackendArg, Vec<Run>)]) -> Vec<KSummary> {
    const P50: Metric<f64> = Metric::lower("reset p50", "us", |x| Some(*x));
    let mut out = Vec::new();
    for (_, group) in all {
        let Some(first) = group.first() else { continue };
        for (j, row) in first.rows.iter().enumerate() {
            let xs: Vec<f64> = group.iter().map(|r| r.rows[j].reset_p50_us).collect();
            out.push(KSummary {
                backend: first.backend,
                k_per_vcpu: row.k_per_vcpu,
                reset_p50_us: summarize(&P50, &xs),
            });
        }
    }
    out
}
