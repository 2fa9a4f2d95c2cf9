//! `slat private-mem-perf`: what it costs to fault in private memory that leaves the host's
//! direct map. Confidential guests' private pages are removed from the host direct map; where
//! a 2 MiB or 1 GiB leaf covers a page, the leaf is split to 4 KiB entries first (under a
//! global lock, with a TLB flush).
//!
//! `--backend host` ([`host`]) measures this host's kernel: `memfd_secret(2)` does exactly
//! that for every page it faults in, so it fills memfd_secret memory twice (the second fill
//! mostly gets back pages the first left split, as the kernel does not merge them back) against
//! plain memfd memory as the native floor, and once more memfd over the split direct map,
//! reading the kernel's own counters around each fill. `--backend sim` ([`sim`]) runs a
//! confidential guest on the simulated machine, faulting in its private memory through slat's
//! engine and a simulated host direct map, one row per direct-map variant.
//!
//! The driver runs it (`--repeat`, `--json`, `--plot`, exit codes); its own `--backend
//! host|sim` picks the machine, its `--vary` picks the sim variants of each run, and its
//! documents keep the schema they had before the driver.

mod counters;
mod gmem;
mod host;
mod mem;
mod memlock;
pub mod sim;

pub(crate) use sim::machine_error;

use crate::args::{guest_size, variant, BackendArg, OutputArgs, Switch};
use crate::driver::chart::FigureOf;
use crate::driver::vary::{engine, names, pick, variants, Key, Values, Vary};
use crate::driver::{self, Bars, Benchmark, Common};
use crate::error::{CliError, CliResult};
use crate::output::{cell, print_table, ratio_cell, Better, Metric, MetricSummary};
use crate::vary_key;
use crate::virtual_time::ClockArgs;
use clap::{Args, ValueEnum};
use serde::Serialize;
use slat::DirectMapPolicy;
use slat_workload::format_size;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

const NAME: &str = "private-mem-perf";

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrivBackend {
    /// This host's kernel: memfd_secret against memfd.
    Host,
    /// The simulated machine: a confidential guest's vCPUs fault in private memory through
    /// slat's engine and a simulated host direct map.
    Sim,
}

/// Flags of `slat private-mem-perf`.
#[derive(Debug, Clone, Args)]
pub struct PrivateMemPerfArgs {
    /// Threads (host) or vCPUs (sim), each faulting in its own share of the memory (1-512).
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub threads: u32,
    /// Memory per thread or vCPU: bytes with an optional k/m/g/t suffix (powers of 1024), a
    /// non-zero multiple of 4 KiB. Each fill maps threads x this at once.
    #[arg(short = 'b', value_parser = guest_size, default_value = "256M")]
    pub bytes: u64,
    /// Milliseconds between two samples of the fill rate and the direct-map counters
    /// (100-1000); the last sample of a fill is the shorter remainder. A fill longer than
    /// 1024 samples keeps every other one and doubles the interval, as often as needed (the
    /// text says so after the row).
    #[arg(long = "samples-ms", value_name = "MS", value_parser = clap::value_parser!(u64).range(100..=1000), default_value_t = 100)]
    pub samples_ms: u64,
    /// The machine: `host` (this host's kernel, memfd_secret; the direct-map entries it splits
    /// stay split after the run, as the kernel does not merge them back, so later first fills
    /// on this host split less). `sim` (a simulated confidential guest and host direct map,
    /// one row per variant, by default every --direct-map policy with --kernel-flush off and
    /// on).
    #[arg(long, value_enum, default_value = "host")]
    pub backend: PrivBackend,
    /// sim: the host direct map's policy. `2m-split`: huge leaves, each split on demand under
    /// one global lock with a flush of every host CPU (the patch series' baseline); `4k`:
    /// pre-split to 4 KiB at start; `none`: left alone (TDX-style). Without it and without
    /// --vary, the run covers all three.
    #[arg(long = "direct-map", value_name = "POLICY", value_parser = variant::<DirectMapPolicy>())]
    pub direct_map: Option<DirectMapPolicy>,
    /// sim: after each page leaves the direct map, flush every host CPU's kernel TLB and wait
    /// for each vCPU thread to acknowledge (what "cratered performance" in the patch series).
    /// Without it and without --vary, the run covers off and on.
    #[arg(long = "kernel-flush", value_enum, value_name = "on|off")]
    pub kernel_flush: Option<Switch>,
    /// sim: when a whole 2 MiB block of the direct map is back (the conversion to shared), put
    /// the 2 MiB leaf back (2m-split only).
    #[arg(long)]
    pub collapse: bool,
    /// sim: the guest's memory and its private pool are phantom (`-s phantom` of the other
    /// benchmarks: address ranges with no memory behind them, data in 64 shared frames), so a
    /// guest far beyond this host's memory fits; the page tables and the direct map are real.
    #[arg(long)]
    pub phantom: bool,
    /// sim: one row per combination; a key given here overrides its flag (the keys: --help).
    #[arg(long, value_name = "KEY=V1,V2,...", value_parser = driver::vary::parser(VARY), long_help = driver::vary::help(VARY, "sim only: every combination is a row of each run (--repeat runs them all N times)."))]
    pub vary: Vec<driver::vary::Vary>,
    #[command(flatten)]
    pub clock: ClockArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// One run on either machine (one document holds the runs of one).
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Run {
    /// `--backend host`: the four fills.
    Host(host::Run),
    /// `--backend sim`: the native floor and a row per variant.
    Sim(sim::Run),
}

/// A bar per row of `first` (a fill, a variant) of figure `m`, for `--plot`.
fn bars<T: 'static>(
    x_desc: &'static str,
    first: &Run,
    m: Metric<T>,
    row: for<'a> fn(&'a Run, &str) -> Option<&'a T>,
) -> Bars<Run> {
    let names: Vec<String> = match first {
        Run::Host(r) => r.rows.iter().map(|x| x.variant.into()).collect(),
        Run::Sim(r) => r.rows.iter().map(sim::SimRow::label).collect(),
    };
    let bar = |n: String| -> (String, FigureOf<Run>) {
        let k = n.clone();
        (n, Box::new(move |r| row(r, &k).and_then(m.get)))
    };
    Bars {
        title: format!("{NAME}: {}", m.name),
        x_desc,
        y_desc: m.unit,
        bars: names.into_iter().map(bar).collect(),
    }
}

/// private-mem-perf's `--vary` keys: each sets one field of a simulated variant.
pub const VARY: &[Key<sim::Variant>] = &[
    vary_key!(
        "direct-map",
        "--direct-map",
        Values::OneOf(variants::<DirectMapPolicy>),
        |v, x| { v.policy = engine(x)? }
    ),
    vary_key!(
        "kernel-flush",
        "--kernel-flush",
        Values::OneOf(names::<Switch>),
        |v, x| { v.kernel_flush = pick::<Switch>(x)?.on() }
    ),
];

impl Benchmark for PrivateMemPerfArgs {
    type Report = Run;
    const NAME: &'static str = NAME;

    fn common(&self) -> Common<'_> {
        // Its machines are not `sim|kvm` and its `--vary` picks rows within a run: both are
        // its own, so the driver sees one machine and no sweep.
        Common {
            backends: &[],
            vary: &[],
            out: &self.out,
        }
    }

    fn check(&self) -> CliResult {
        check(self).map_err(CliError::bad)
    }

    fn measure(&self, _: BackendArg) -> CliResult<Run> {
        match self.backend {
            PrivBackend::Host => host::measure(self).map(Run::Host),
            PrivBackend::Sim => sim::measure(self).map(Run::Sim),
        }
    }

    fn metrics(&self) -> Vec<Metric<Run>> {
        match self.backend {
            PrivBackend::Host => host::METRICS.to_vec(),
            // Its headline figures are per variant: `sim::finish` summarizes them.
            PrivBackend::Sim => Vec::new(),
        }
    }

    fn print(&self, r: &Run) {
        match r {
            Run::Host(r) => host::print_run(r, self.samples_ms),
            Run::Sim(r) => sim::print_run(r, self.samples_ms),
        }
    }

    fn bars(&self, first: &Run) -> Vec<Bars<Run>> {
        match first {
            Run::Host(_) => vec![bars("fill", first, host::RATE, host::row)],
            Run::Sim(_) => (sim::ROW_METRICS.iter())
                .map(|m| bars("variant", first, *m, sim::row))
                .collect(),
        }
    }

    fn own_output(&self) -> Option<fn(&Self, Vec<(BackendArg, Vec<Run>)>) -> CliResult> {
        Some(finish)
    }
}

/// The one document of every run, or the text under the runs.
fn finish(a: &PrivateMemPerfArgs, all: Vec<(BackendArg, Vec<Run>)>) -> CliResult {
    let runs: Vec<Run> = all.into_iter().flat_map(|(_, r)| r).collect();
    match a.backend {
        PrivBackend::Host => host::finish(a, runs),
        PrivBackend::Sim => sim::finish(a, runs),
    }
}

/// The JSON document of either machine: the settings, every run and the summary.
#[derive(Serialize)]
struct Document<C, R, S> {
    benchmark: &'static str,
    /// `host` or `sim`.
    backend: &'static str,
    /// Whose cost the figures are.
    measures: &'static str,
    config: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    probes: Option<host::Probes>,
    repeat: usize,
    runs: Vec<R>,
    /// Median, min, max and spread of each headline figure over the runs.
    summary: Vec<S>,
}

impl<C: Serialize, R: Serialize, S: Serialize> Document<C, R, S> {
    /// The document, or the `note` and the summary (`row` names a figure's variant).
    fn print(
        &self,
        json: bool,
        note: &str,
        row: fn(&S) -> (Option<String>, &MetricSummary),
    ) -> CliResult {
        if json {
            return crate::output::print_json(self, &[]);
        }
        println!("\n{note}");
        if self.repeat > 1 {
            let rows: Vec<_> = self.summary.iter().map(row).collect();
            print_summary(self.repeat, &rows);
        }
        Ok(())
    }
}

/// Refuses what cannot run.
fn check(a: &PrivateMemPerfArgs) -> Result<(), String> {
    if a.clock.is_virtual() && a.backend == PrivBackend::Host {
        return Err("--clock virtual runs only on the simulated machine (--backend sim)".into());
    }
    if a.backend == PrivBackend::Host {
        let sim_only = [
            ("--direct-map", a.direct_map.is_some()),
            ("--kernel-flush", a.kernel_flush.is_some()),
            ("--collapse", a.collapse),
            ("--vary", !a.vary.is_empty()),
            ("--phantom", a.phantom),
        ];
        if let Some((flag, _)) = sim_only.iter().find(|(_, given)| *given) {
            return Err(format!(
                "{flag} configures the simulated direct map: add --backend sim (the host kernel's direct map is what it is)"
            ));
        }
    } else {
        sim_variants(a)?;
    }
    let flags = format!("-v {} x -b {}", a.threads, a.bytes);
    let total = a
        .bytes
        .checked_mul(u64::from(a.threads))
        .ok_or_else(|| format!("{flags}: the memory overflows 64 bits"))?;
    if a.phantom {
        // The guest's MMU and the direct map over the pool, each at 4 KiB everywhere at most.
        let need = crate::limits::phantom_mmu_bytes(total).saturating_mul(2);
        return match slat_migrate::limits::host_memory() {
            Some(host) if need > host => Err(format!(
                "{flags} --phantom: the page tables and direct map of {} of guest memory take up to {}, more than this host's {} of RAM and swap",
                format_size(total),
                format_size(need),
                format_size(host)
            )),
            _ => Ok(()),
        };
    }
    // One fill's memory is mapped at a time (each is unmapped before the next).
    match slat_migrate::limits::host_memory() {
        Some(host) if total > host => Err(format!(
            "{flags}: {} of memory is more than this host's {} of RAM and swap",
            format_size(total),
            format_size(host)
        )),
        _ => Ok(()),
    }
}

/// The sim rows of each run, each once: `--vary`'s combinations, or without it every value
/// of the flags not given (all policies, the kernel flush off and on).
fn sim_variants(a: &PrivateMemPerfArgs) -> Result<Vec<sim::Variant>, String> {
    let base = sim::Variant {
        policy: a.direct_map.unwrap_or_default(),
        kernel_flush: a.kernel_flush.is_some_and(Switch::on),
    };
    let flushes = vec!["off".into(), "on".into()];
    let every = [
        (
            a.direct_map.is_none(),
            "direct-map",
            variants::<DirectMapPolicy>(),
        ),
        (a.kernel_flush.is_none(), "kernel-flush", flushes),
    ];
    let implicit: Vec<Vary> = (every.into_iter())
        .filter(|x| x.0)
        .map(|(_, key, values)| Vary { key, values })
        .collect();
    let vary = if a.vary.is_empty() {
        &implicit
    } else {
        &a.vary
    };
    let mut out = Vec::new();
    for r in driver::vary::rows(&base, vary, VARY)? {
        if !out.contains(&r.args) {
            out.push(r.args);
        }
    }
    Ok(out)
}

/// A headline figure.
const fn metric<R>(
    name: &'static str,
    unit: &'static str,
    better: Better,
    get: fn(&R) -> Option<f64>,
) -> Metric<R> {
    Metric {
        name,
        unit,
        better,
        get,
    }
}

fn runtime(e: impl ToString) -> CliError {
    CliError::Runtime(e.to_string())
}

impl PrivateMemPerfArgs {
    /// `-v` x `-b` (checked not to overflow before anything runs).
    fn total(&self) -> u64 {
        self.bytes.saturating_mul(u64::from(self.threads))
    }
}

/// 10^9 bytes per second (`unit` 1e9) or GiB per second (`unit` 2^30) over `d`.
fn per_s(bytes: u64, d: Duration, unit: f64) -> f64 {
    match d.as_secs_f64() {
        s if s > 0.0 => bytes as f64 / s / unit,
        _ => 0.0,
    }
}

/// At most this many readings of one pass are kept: past it, every other one is dropped
/// and the interval doubles. A pass has no length bound (in virtual time a cost profile may
/// make one fault take minutes), and readings kept at a fixed interval would grow with it
/// until the allocation failed.
pub(crate) const MAX_READINGS: usize = 1024;

/// Readings taken every `every` from a first one at time 0, coarsened past
/// [`MAX_READINGS`]: the kept ones stay evenly spaced, each with its own time.
pub(crate) struct Readings<D, T> {
    every: Duration,
    out: Vec<(D, T)>,
}

impl<D, T> Readings<D, T> {
    pub(crate) fn new(every: Duration, first: (D, T)) -> Self {
        Readings {
            every,
            out: vec![first],
        }
    }

    /// How long to wait before the next reading.
    pub(crate) fn every(&self) -> Duration {
        self.every
    }

    /// The reading due `every` after the last: past [`MAX_READINGS`] (one more, an odd
    /// count, so the latest has an even index and is kept; the next reading, due the doubled
    /// interval after it, falls on the doubled grid) the odd ones go and the interval doubles.
    pub(crate) fn push(&mut self, r: (D, T)) {
        self.out.push(r);
        if self.out.len() > MAX_READINGS {
            let mut i = 0;
            self.out.retain(|_| {
                i += 1;
                i % 2 == 1
            });
            self.every = self.every.saturating_mul(2);
        }
    }

    /// The readings, with `last` (taken off the grid, when the pass ended) after them.
    pub(crate) fn finish(mut self, last: Option<(D, T)>) -> Vec<(D, T)> {
        self.out.extend(last);
        self.out
    }
}

/// What a row's samples say after its label when they were coarsened ([`Readings`]): the
/// interval they were kept at, from the end of the first (readings start at time 0).
pub(crate) fn coarsened(first_two_ends: &[f64], samples_ms: u64) -> String {
    match first_two_ends {
        [t, _, ..] if (t * 1e3).round() as u64 > samples_ms => format!(
            " (every {:.0} ms: at most {MAX_READINGS} readings are kept)",
            t * 1e3
        ),
        _ => String::new(),
    }
}

/// Readings of `read` every `every` (coarsened as [`Readings`] says), after `first`, until
/// `stop` closes; then a last, shorter interval's, so that even a fill shorter than one
/// interval has one.
fn readings<T>(
    every: Duration,
    stop: mpsc::Receiver<()>,
    first: (Instant, T),
    mut read: impl FnMut() -> T,
) -> Vec<(Instant, T)> {
    let mut last = first.0;
    let mut out = Readings::new(every, first);
    loop {
        let wait = (last + out.every()).saturating_duration_since(Instant::now());
        let end = !matches!(stop.recv_timeout(wait), Err(RecvTimeoutError::Timeout));
        last = Instant::now();
        if end {
            return out.finish(Some((last, read())));
        }
        out.push((last, read()));
    }
}

/// A text table's column: its head and a row's cell.
pub(crate) type Column<T> = (&'static str, fn(&T) -> String);

/// Prints `rows` under `cols`, after a `first` row given as cells.
pub(crate) fn table<T>(cols: &[Column<T>], rows: &[T], first: Option<Vec<String>>) {
    let head: Vec<String> = cols.iter().map(|c| c.0.to_string()).collect();
    let cells = |r: &T| cols.iter().map(|c| (c.1)(r)).collect();
    let body: Vec<Vec<String>> = first.into_iter().chain(rows.iter().map(cells)).collect();
    print_table(&head, &body);
}

/// A counter in a table cell.
fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or("-".into(), |x| x.to_string())
}

/// The `--repeat` summary: one row per figure (of a variant, for sim).
fn print_summary(repeat: usize, rows: &[(Option<String>, &MetricSummary)]) {
    println!("\nSummary over {repeat} runs (spread = (max - min) / median):");
    let head = ["metric", "median", "min", "max", "spread", "better"].map(String::from);
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|(variant, s)| {
            let f = |x| {
                if s.unit == "x" {
                    ratio_cell(x)
                } else {
                    cell(x)
                }
            };
            let of = variant.as_ref().map_or(String::new(), |v| format!("{v}: "));
            vec![
                format!("{of}{} ({})", s.metric, s.unit),
                f(s.median),
                f(s.min),
                f(s.max),
                ratio_cell(s.spread),
                format!("{:?}", s.better).to_lowercase(),
            ]
        })
        .collect();
    print_table(&head, &rows);
}

#[cfg(test)]
mod readings_tests {
    use super::{coarsened, Readings, MAX_READINGS};
    use std::time::Duration;

    /// A reading every `every` (its index as its time, in units of the first interval), for
    /// any number of them: at most MAX_READINGS kept, evenly spaced on the doubled grid, the
    /// first, the latest and the off-grid last always kept.
    #[test]
    fn readings_stay_bounded_and_evenly_spaced() {
        // Each doubling takes MAX_READINGS / 2 readings, over twice the time of the last: 20
        // doublings are 10^5 times the first run's length.
        for n in [0u64, 1, 1023, 1024, 1025, 2048, 5000, 10_000] {
            let mut r = Readings::new(Duration::from_millis(100), (0u64, ()));
            let mut t = 0;
            for _ in 0..n {
                // The caller waits `every` before each reading.
                t += r.every().as_millis() as u64 / 100;
                r.push((t, ()));
            }
            let every = r.every().as_millis() as u64 / 100;
            let out = r.finish(Some((t * 10 + 7, ())));
            assert!(out.len() <= MAX_READINGS + 1, "{n}: {}", out.len());
            assert_eq!(out[0].0, 0, "{n}");
            assert_eq!(out.last().map(|x| x.0), Some(t * 10 + 7), "{n}");
            let grid = &out[..out.len() - 1];
            let step = grid.get(1).map_or(every, |x| x.0);
            assert!(grid.windows(2).all(|w| w[1].0 - w[0].0 == step), "{n}");
            assert_eq!(step, every, "{n}: the next reading is due on the kept grid");
            assert_eq!(
                grid.last().map(|x| x.0),
                Some(t),
                "{n}: the latest reading is kept"
            );
        }
    }

    #[test]
    fn a_coarsened_row_says_its_interval() {
        assert_eq!(coarsened(&[0.1, 0.2], 100), "");
        assert_eq!(coarsened(&[0.05], 100), "");
        assert!(coarsened(&[0.4, 0.8], 100).contains("every 400 ms"));
    }
}
