//! `slat snapshot-perf`: what a snapshot fuzzer's or sandbox's reset costs when it copies back
//! only the dirty pages (`slat_harness::MachineSnapshot` over `slat_dirty::Snapshot`), against
//! the floor for the same work (memcpy of as many pages between two host buffers, measured in
//! the same run) and against a full-copy reset of all guest RAM.
//!
//! **How the guest dirties exactly k pages.** Each machine's memstress pass touches every page
//! of each vCPU's region once. So for each k the benchmark builds the machine with a region of
//! **k pages per vCPU**: a sequential pass then writes exactly `k × vCPUs` pages (a random
//! pass, `-a`, the distinct pages its draws hit), and every reset's page count is checked
//! against the shared memstress model (a mismatch fails the run). The full-copy reset is
//! measured on the machine of the full `-b` per vCPU (the `all` row), so it copies all the
//! RAM `-v` × `-b` describes. What this choice costs: a harvest on a k-page machine reads a
//! k-page bitmap, where a guest of `-b` per vCPU with k dirty pages reads a `-b` bitmap — the
//! harvest column of small k is a lower bound for a large guest (dirty rings do not have this
//! term). Each row's RAM is in its `ram_pages`.
//!
//! `--vary KEY=V1,V2` (`vary.rs`): one such run per combination of vCPU count, harvest,
//! order and machine, in this process, and one table.

mod text;
mod vary;

use self::vary::VARY;
use crate::args::{
    check_kvm_ring, BackendArg, ClearChunk, LogArgs, MachineArgs, OutputArgs, Workload,
};
use crate::backend::{self, dirty_config, CliMachine, OnMachine, Spec};
use crate::driver::{self, Benchmark};
use crate::error::{CliError, CliResult};
use crate::output::{
    format_name, print_json, summarize, AllRuns, Metric, MetricSummary, Sweep, VmSettings,
    WorkSettings,
};
use crate::report::{per, quiet, runtime, Phase};
use clap::Args;
use hdrhistogram::Histogram;
use serde::Serialize;
use slat_addr::PAGE_SIZE;
use slat_harness::{MachineSnapshot, ResetReport};
use slat_workload::{GuestRam, PassParams, Pattern, TestMachine};
use std::time::{Duration, Instant};
use text::{print_comparison, print_run, print_summary};

/// Flags of `slat snapshot-perf`.
#[derive(Debug, Clone, Args)]
pub struct SnapshotPerfArgs {
    #[command(flatten)]
    pub work: Workload,
    /// Pages each vCPU dirties per iteration: a comma-separated list of page counts and `all`
    /// (every page of -b). Each k runs on a machine whose region is k pages per vCPU (a pass
    /// covers each page of a vCPU's region once, so it dirties exactly k pages; the full-copy
    /// reset runs on the machine of all of -b). Default: 1, 4, 16, 64, ...
    /// up to -b, and all.
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
    pub verify: bool,
}

/// Figures of one k.
#[derive(Debug, Clone, Serialize)]
pub struct KRow {
    /// Pages per vCPU the machine's region has (each vCPU's pass covers them).
    pub k_per_vcpu: u64,
    /// Pages of the machine's test region (`k × vCPUs`).
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
    pub full_copy: FullCopy,
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
    Metric::lower("full-copy reset p50", "us", |r| Some(r.full_copy.p50_us)),
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
    a.machine.check_backends(&a.backend, &[])?;
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
    // The machine, the snapshot and the floor's two buffers.
    a.work.check_fits(&a.backend, &a.machine, 0, 4)?;
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

/// Every k on machine `kind`, then the full-copy reset on the machine of all of -b.
fn measure(a: &SnapshotPerfArgs, kind: BackendArg) -> CliResult<Run> {
    let all = a.work.bytes / PAGE_SIZE;
    let mut rows = Vec::new();
    for k in k_list(a) {
        let phase = Phase::start(
            format!("{}: k = {k} pages per vCPU", kind.name()),
            quiet(a.out.json),
        );
        let (row, _) = on_machine(a, kind, k, false)?;
        rows.push(row);
        phase.done();
    }
    let phase = Phase::start(
        format!("{}: full-copy reset of {all} pages per vCPU", kind.name()),
        quiet(a.out.json),
    );
    let (_, full) = on_machine(a, kind, all, true)?;
    phase.done();
    let full = full.ok_or("the full-copy reset did not run")?;
    for r in &mut rows {
        r.ratio_full_over_reset = per(full.p50_us, r.reset_p50_us);
    }
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
            verify: a.verify,
        },
        rows,
        full_copy: full,
    })
}

/// Builds machine `kind` with `k` pages per vCPU and measures it.
fn on_machine(
    a: &SnapshotPerfArgs,
    kind: BackendArg,
    k: u64,
    full: bool,
) -> CliResult<(KRow, Option<FullCopy>)> {
    let l = &a.log;
    let dirty = dirty_config(
        l.dirty_ring.is_none() && !l.no_manual,
        l.dirty_ring.unwrap_or(0),
    );
    let mut region = a.work.region(&a.machine, dirty);
    region.bytes_per_vcpu = k * PAGE_SIZE;
    let spec = Spec::new(&a.machine, region, a.machine.vm_config());
    backend::visit(kind, &spec, OnK { a, full })
}

/// One machine's measurement, on a machine of any type.
struct OnK<'a> {
    a: &'a SnapshotPerfArgs,
    full: bool,
}

impl OnMachine for OnK<'_> {
    type Out = (KRow, Option<FullCopy>);
    fn run<M: TestMachine + CliMachine>(self, m: &M) -> CliResult<Self::Out> {
        let ram = m.guest_ram();
        Bench { a: self.a, m, ram }.run(self.full)
    }
}

/// One machine's measurement.
struct Bench<'a, M: TestMachine> {
    a: &'a SnapshotPerfArgs,
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
    harvest: Duration,
    rearm: Duration,
    copy: Duration,
}

impl Split {
    fn add(&mut self, r: &ResetReport) {
        self.pages += r.pages;
        self.harvest += r.harvest;
        self.rearm += r.rearm;
        self.copy += r.copy;
    }
}

impl<'a, M: TestMachine> Bench<'a, M> {
    /// Iteration `i`'s pass: a new seed each time, so random passes dirty other pages.
    fn params(&self, i: u32) -> PassParams {
        PassParams {
            write_percent: 100,
            random: self.a.random,
            seed: i.wrapping_add(2),
            timed: false,
            touches: None,
        }
    }

    /// Distinct pages the memstress model writes in a pass with `p`.
    fn model_pages(&self, p: PassParams) -> u64 {
        let l = self.m.layout();
        let mut hit = vec![false; l.total_pages() as usize];
        for i in 0..l.vcpus {
            let (gpa, _, pages) = l.region(i);
            let first = (gpa - l.gpa) / PAGE_SIZE;
            for (page, write) in Pattern::new(p, i as u32, pages) {
                hit[(first + page) as usize] |= write;
            }
        }
        hit.iter().filter(|&&h| h).count() as u64
    }

    fn pass(&self, i: u32) -> CliResult<PassParams> {
        let p = self.params(i);
        self.m.run_pass(p).map_err(runtime)?;
        Ok(p)
    }

    fn verify(&self, snap: &MachineSnapshot<'_, M>, what: &str, i: u32) -> CliResult<bool> {
        if !self.a.verify {
            return Ok(false);
        }
        snap.verify()
            .map_err(|e| CliError::Runtime(format!("--verify: after {what} {i}: {e}")))?;
        Ok(true)
    }

    /// A pass to populate the mappings, the snapshot, then the iterations (and the full-copy
    /// resets when `full`).
    fn run(&self, full: bool) -> CliResult<(KRow, Option<FullCopy>)> {
        let l = self.m.layout();
        let ram_pages = l.total_pages();
        // First touch outside the measurement: resets then meet steady-state mappings.
        self.pass(u32::MAX - 2)?;
        // SAFETY: `ram` is `m`'s guest RAM (both from the same machine, in `on_machine`), and
        // the guest runs only through `run_pass`, which returns with every vCPU stopped, so
        // nothing writes the RAM during take, reset or verify.
        let mut snap = unsafe { MachineSnapshot::take(self.m, self.ram) }.map_err(runtime)?;
        let mut floor = Floor::new(ram_pages);
        let (mut h, mut fh, mut split) = (hist(), hist(), Split::default());
        let mut verified = 0;
        for i in 0..self.a.iterations {
            let p = self.pass(i)?;
            let r = snap.reset().map_err(runtime)?;
            let want = self.model_pages(p);
            if r.pages != want {
                return Err(CliError::Runtime(format!(
                    "reset {i}: the dirty log listed {} pages, the pass wrote {want}",
                    r.pages
                )));
            }
            record(&mut h, r.total());
            split.add(&r);
            record(&mut fh, floor.copy(r.pages));
            verified += u64::from(self.verify(&snap, "reset", i)?);
        }
        let full = if full {
            Some(self.full_copy(&mut snap, ram_pages)?)
        } else {
            None
        };
        Ok((self.row(&h, &fh, &split, ram_pages, verified), full))
    }

    /// `-i` full-copy resets, each after a pass.
    fn full_copy(&self, snap: &mut MachineSnapshot<'_, M>, pages: u64) -> CliResult<FullCopy> {
        let mut h = hist();
        for i in 0..self.a.iterations {
            self.pass(i)?;
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
        let mean_us = h.mean() / 1000.0;
        let dirty = s.pages as f64 / n;
        let mean = |d: Duration| d.as_secs_f64() * 1e6 / n;
        KRow {
            k_per_vcpu: ram_pages / self.m.layout().vcpus as u64,
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
        }
    }
}

fn record(h: &mut Histogram<u64>, d: Duration) {
    // A duration past the histogram's range (an hour) is clamped, never dropped; 0 ns counts
    // as the lowest bucket.
    h.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1));
}

/// The floor: the same number of 4 KiB copies between two host buffers of the machine's RAM
/// size, page by page (a reset copies pages, not one contiguous run).
struct Floor {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Floor {
    fn new(pages: u64) -> Self {
        let n = (pages * PAGE_SIZE) as usize;
        // Non-zero, so neither buffer is the shared zero page.
        Floor {
            src: vec![0xa5; n],
            dst: vec![0x5a; n],
        }
    }

    /// Copies `pages` pages (at most the buffers'), timed.
    fn copy(&mut self, pages: u64) -> Duration {
        let ps = PAGE_SIZE as usize;
        let t = Instant::now();
        for (d, s) in self
            .dst
            .chunks_exact_mut(ps)
            .zip(self.src.chunks_exact(ps))
            .take(pages as usize)
        {
            d.copy_from_slice(s);
        }
        std::hint::black_box(&mut self.dst);
        t.elapsed()
    }
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
