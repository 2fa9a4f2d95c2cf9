//! Shared rendering of typed reports: the JSON document every run prints (one per run, with
//! the schema version, the slat version and the host facts), the metric tables that the
//! `--backend sim,kvm` comparison, the `--vary` sweep and the `--repeat` summary are drawn
//! from, and the VM settings every report carries.
//!
//! A benchmark's report is a plain `#[derive(Serialize)]` struct. Tables never read figures
//! back out of JSON: each benchmark lists its [`Metric`]s, each a name, a unit, which way is
//! better and a function from the report to the figure.

use crate::args::{BackendArg, FormatArg, MachineArgs};
use crate::error::{CliError, CliResult};
use crate::host::HostFacts;
use serde::{Serialize, Serializer};
use std::time::Duration;

/// Version of the JSON documents' layout; raised whenever a field is renamed, removed or
/// changes meaning (adding a field does not raise it).
pub const SCHEMA_VERSION: u32 = 1;

/// The document printed by `--json`: the envelope, then the body's fields at the top level.
#[derive(Serialize)]
pub struct Document<'a, B: Serialize> {
    pub schema_version: u32,
    pub slat_version: &'static str,
    pub host: HostFacts,
    #[serde(flatten)]
    pub body: &'a B,
}

/// Prints `body` as the run's one JSON document.
pub fn print_json<B: Serialize>(body: &B, backends: &[BackendArg]) -> CliResult {
    let doc = Document {
        schema_version: SCHEMA_VERSION,
        slat_version: env!("CARGO_PKG_VERSION"),
        host: HostFacts::collect(backends),
        body,
    };
    let text = serde_json::to_string_pretty(&doc)
        .map_err(|e| CliError::Runtime(format!("cannot encode the report as JSON: {e}")))?;
    println!("{text}");
    Ok(())
}

/// Serializes a duration as seconds (a float), the unit of every `*_s` field.
pub fn secs<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Serializes an optional duration as seconds or `null`.
pub fn opt_secs<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// The engine and machine settings of a run, as every report's `config` carries them. Built
/// in one place ([`VmSettings::new`]) from what the flags selected.
#[derive(Debug, Clone, Serialize)]
pub struct VmSettings {
    /// `--format` on the simulated machine; `null` on kvm (the host's own page tables).
    pub format: Option<&'static str>,
    pub mmu_lock: &'static str,
    pub fast_pf: bool,
    pub ad_bits: bool,
    pub get_dirty_log: &'static str,
    pub dirty_tracking: &'static str,
    pub eager_split: bool,
    pub recover: &'static str,
    pub cmo: &'static str,
    pub rebuild: &'static str,
    /// `--wrprot` (lockless write-protect through the reverse map).
    pub wrprot: &'static str,
    pub tlb_entries: usize,
    /// Physical CPUs the simulated vCPUs ran on (`null` on kvm).
    pub pcpus: Option<usize>,
    /// Guest RAM and baseline memory were pre-faulted (no `--no-prefault`).
    pub prefault: bool,
}

impl VmSettings {
    /// The settings of a run on `kind`.
    pub fn new(
        kind: BackendArg,
        format: FormatArg,
        vm: &slat::VmConfig,
        tlb_entries: usize,
        pcpus: Option<usize>,
        prefault: bool,
    ) -> VmSettings {
        VmSettings {
            format: format_name(kind, format),
            mmu_lock: vm.mmu_lock.name(),
            fast_pf: vm.fast_pf,
            ad_bits: vm.ad_bits,
            get_dirty_log: vm.get_log.name(),
            dirty_tracking: vm.dirty_track.name(),
            eager_split: vm.eager_split,
            recover: vm.recover.name(),
            cmo: vm.cmo.name(),
            rebuild: vm.rebuild.name(),
            wrprot: vm.wrprot.name(),
            tlb_entries,
            pcpus,
            prefault,
        }
    }

    /// The settings of a run on `kind` with engine switches `vm` and the rest of `machine`'s
    /// flags; the simulated machine's CPUs default to every host CPU.
    pub fn of_machine(kind: BackendArg, machine: &MachineArgs, vm: &slat::VmConfig) -> VmSettings {
        let sim_only = |x| (kind == BackendArg::Sim).then_some(x);
        VmSettings::new(
            kind,
            machine.format,
            vm,
            machine.tlb_entries,
            sim_only(
                machine
                    .pcpus
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from)),
            ),
            !machine.no_prefault,
        )
    }
}

/// The guest a run's `config` describes: `-v`, `-b`, `-s` and (where the run has it) `-o`.
#[derive(Debug, Clone, Serialize)]
pub struct WorkSettings {
    pub vcpus: u32,
    pub bytes_per_vcpu: u64,
    pub backing: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlap: Option<bool>,
}

/// The format a run used: the `--format` name on the simulated machine; `None` on KVM, whose
/// page tables are the host's own, not slat's.
pub fn format_name(kind: BackendArg, format: FormatArg) -> Option<&'static str> {
    match kind {
        BackendArg::Sim => Some(format.name()),
        BackendArg::Kvm => None,
    }
}

/// The one document of a benchmark that keeps its own (`own_output`): every run,
/// backend-major then repeat, and the benchmark's summary of them.
#[derive(Debug, Clone, Serialize)]
pub struct AllRuns<R, S> {
    pub benchmark: &'static str,
    pub repeat: u32,
    /// The machines, in the order run.
    pub backends: Vec<&'static str>,
    /// Backend-major, then repeat.
    pub runs: Vec<R>,
    pub summary: Vec<S>,
}

impl<R, S> AllRuns<R, S> {
    /// The runs of `all` and `summary` of them, with `--repeat` from `out`.
    pub fn new(
        benchmark: &'static str,
        out: &crate::args::OutputArgs,
        all: Vec<(BackendArg, Vec<R>)>,
        summary: impl FnOnce(&[(BackendArg, Vec<R>)]) -> Vec<S>,
    ) -> Self {
        AllRuns {
            benchmark,
            repeat: out.repeat,
            backends: all.iter().map(|(b, _)| b.name()).collect(),
            summary: summary(&all),
            runs: all.into_iter().flat_map(|(_, r)| r).collect(),
        }
    }
}

/// Which way a metric improves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    /// Times, ratios of guest over native time: smaller is better.
    Lower,
    /// Rates (pages or bytes per second): larger is better.
    Higher,
}

impl Better {
    fn word(self) -> &'static str {
        match self {
            Better::Lower => "lower",
            Better::Higher => "higher",
        }
    }
}

/// One figure of a report, addressed by a typed accessor.
pub struct Metric<R> {
    /// Its name in tables and JSON (`iteration 2 dirty memory`).
    pub name: &'static str,
    /// Its unit (`s`, `x` for a ratio, `pages/s`).
    pub unit: &'static str,
    /// Which way is better.
    pub better: Better,
    /// Reads it from a report (`None` when the run has no such figure).
    pub get: fn(&R) -> Option<f64>,
}

impl<R> Metric<R> {
    /// A figure that improves downwards (times, guest/native ratios).
    pub const fn lower(name: &'static str, unit: &'static str, get: fn(&R) -> Option<f64>) -> Self {
        let better = Better::Lower;
        Metric {
            name,
            unit,
            better,
            get,
        }
    }
    /// A figure that improves upwards (rates).
    pub const fn higher(
        name: &'static str,
        unit: &'static str,
        get: fn(&R) -> Option<f64>,
    ) -> Self {
        let better = Better::Higher;
        Metric {
            name,
            unit,
            better,
            get,
        }
    }
}

impl<R> Clone for Metric<R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for Metric<R> {}

/// A figure in a table cell: six decimals below 1000 (seconds resolve to the microsecond),
/// whole numbers above (rates), or `-` when the run has none.
pub fn cell(x: Option<f64>) -> String {
    match x {
        Some(x) if x.abs() >= 1000.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.6}"),
        None => "-".into(),
    }
}

/// A ratio in a table cell.
pub fn ratio_cell(r: Option<f64>) -> String {
    match r {
        Some(r) if r < 0.01 => format!("{r:.5}x"),
        Some(r) => format!("{r:.2}x"),
        None => "-".into(),
    }
}

/// A figure in a table cell, as its unit wants it (`x`: a ratio).
pub fn unit_cell(unit: &str, x: Option<f64>) -> String {
    if unit == "x" {
        ratio_cell(x)
    } else {
        cell(x)
    }
}

/// One row of a two-machine comparison.
#[derive(Debug, Clone, Serialize)]
pub struct CompareRow {
    pub metric: &'static str,
    pub unit: &'static str,
    /// Which way is better.
    pub better: Better,
    pub first: Option<f64>,
    pub second: Option<f64>,
    pub ratio_first_over_second: Option<f64>,
}

/// A `--backend A,B` run: both machines' runs in full and the table comparing them (the
/// medians, with `--repeat`).
#[derive(Serialize)]
pub struct Comparison<'a, R: Serialize> {
    pub benchmark: &'static str,
    /// The two machines, in the order run.
    pub backends: [&'static str; 2],
    pub comparison: Vec<CompareRow>,
    /// The two machines' runs, in the order of `backends`: a report each, or with
    /// `--repeat` each machine's summary and runs.
    pub runs: [&'a Runs<R>; 2],
}

impl<'a, R: Serialize> Comparison<'a, R> {
    /// Compares `runs` metric by metric (the medians of each machine's runs).
    pub fn new(
        benchmark: &'static str,
        backends: [&'static str; 2],
        metrics: &[Metric<R>],
        runs: [&'a Runs<R>; 2],
    ) -> Self {
        let comparison = metrics
            .iter()
            .map(|m| {
                let (p, q) = (runs[0].median(m), runs[1].median(m));
                CompareRow {
                    metric: m.name,
                    unit: m.unit,
                    better: m.better,
                    first: p,
                    second: q,
                    ratio_first_over_second: p.zip(q).and_then(|(p, q)| crate::report::per(p, q)),
                }
            })
            .collect();
        Comparison {
            benchmark,
            backends,
            comparison,
            runs,
        }
    }

    /// The table: metric, the value on each machine, and their ratio.
    pub fn print(&self) {
        let [n0, n1] = self.backends;
        let head: Vec<String> = vec!["metric".into(), n0.into(), n1.into(), format!("{n0}/{n1}")];
        let body: Vec<Vec<String>> = self
            .comparison
            .iter()
            .map(|r| {
                let f = |x| unit_cell(r.unit, x);
                let ratio = ratio_cell(r.ratio_first_over_second);
                vec![r.metric.to_string(), f(r.first), f(r.second), ratio]
            })
            .collect();
        print_table(&head, &body);
    }
}

/// A configuration's runs: one report, or with `--repeat` the summary and every run (the
/// JSON of a sweep row's `result` and of a comparison's `runs`).
#[derive(Serialize)]
#[serde(untagged)]
pub enum Runs<R: Serialize> {
    One(R),
    Many(Repeated<R>),
}

impl<R: Serialize> Runs<R> {
    /// One report, or the summary of several.
    pub fn new(name: &'static str, metrics: &[Metric<R>], mut runs: Vec<R>) -> Self {
        match runs.len() {
            1 => Runs::One(runs.remove(0)),
            _ => Runs::Many(Repeated::new(name, metrics, runs)),
        }
    }

    /// The runs.
    pub fn all(&self) -> &[R] {
        match self {
            Runs::One(r) => std::slice::from_ref(r),
            Runs::Many(m) => &m.runs,
        }
    }

    /// The median of `m` over the runs.
    pub fn median(&self, m: &Metric<R>) -> Option<f64> {
        summarize(m, self.all()).median
    }
}

/// A `--vary` sweep: every row's runs, or why the row failed (a failed row does not stop the
/// sweep).
#[derive(Serialize)]
pub struct Sweep<R: Serialize> {
    pub benchmark: &'static str,
    /// The varied keys, in the order given (the first varies slowest).
    pub varied: Vec<&'static str>,
    /// One per combination, first key slowest.
    pub sweep: Vec<FallibleRow<Runs<R>>>,
}

impl<R: Serialize> Sweep<R> {
    /// The table: the varied values, then every metric's figure (the median, with
    /// `--repeat`); a failed row's figures are `-`.
    pub fn print(&self, metrics: &[Metric<R>]) {
        let mut head: Vec<String> = self.varied.iter().map(|k| k.to_string()).collect();
        head.extend(metrics.iter().map(|m| unit_head(m.name, m.unit)));
        let rows: Vec<Vec<String>> = self
            .sweep
            .iter()
            .map(|row| {
                let mut cells: Vec<String> = row
                    .settings
                    .iter()
                    .map(|s| s.split_once('=').map_or(s.as_str(), |(_, v)| v).to_string())
                    .collect();
                cells.extend(metrics.iter().map(|m| match &row.outcome {
                    RowOutcome::Done(r) => unit_cell(m.unit, r.median(m)),
                    RowOutcome::Failed(_) => unit_cell(m.unit, None),
                }));
                cells
            })
            .collect();
        print_table(&head, &rows);
    }
}

fn unit_head(name: &str, unit: &str) -> String {
    if unit == "x" {
        name.to_string()
    } else {
        format!("{name} ({unit})")
    }
}

/// Median, minimum, maximum and spread of one metric over `--repeat` runs.
#[derive(Debug, Clone, Serialize)]
pub struct MetricSummary {
    pub metric: &'static str,
    pub unit: &'static str,
    /// Which way is better.
    pub better: Better,
    pub runs: usize,
    /// The median (the mean of the middle two for an even count).
    pub median: Option<f64>,
    pub min: Option<f64>,
    pub max: Option<f64>,
    /// (max - min) / median: how far apart the runs were, relative to the median.
    pub spread: Option<f64>,
}

/// Summarizes one metric over runs.
pub fn summarize<R>(m: &Metric<R>, runs: &[R]) -> MetricSummary {
    let mut xs: Vec<f64> = runs.iter().filter_map(|r| (m.get)(r)).collect();
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    let median = match n {
        0 => None,
        _ if n % 2 == 1 => Some(xs[n / 2]),
        _ => Some((xs[n / 2 - 1] + xs[n / 2]) / 2.0),
    };
    let (min, max) = (xs.first().copied(), xs.last().copied());
    let spread = match (median, min, max) {
        (Some(md), Some(lo), Some(hi)) if md > 0.0 => Some((hi - lo) / md),
        _ => None,
    };
    MetricSummary {
        metric: m.name,
        unit: m.unit,
        better: m.better,
        runs: n,
        median,
        min,
        max,
        spread,
    }
}

/// `--repeat N`: every run's report and the summary of each metric.
#[derive(Serialize)]
pub struct Repeated<R: Serialize> {
    pub benchmark: &'static str,
    pub repeat: usize,
    pub summary: Vec<MetricSummary>,
    /// The runs, in order.
    pub runs: Vec<R>,
}

impl<R: Serialize> Repeated<R> {
    /// Summarizes `runs`.
    pub fn new(benchmark: &'static str, metrics: &[Metric<R>], runs: Vec<R>) -> Self {
        Repeated {
            benchmark,
            repeat: runs.len(),
            summary: metrics.iter().map(|m| summarize(m, &runs)).collect(),
            runs,
        }
    }

    /// The summary table, and what its columns mean.
    pub fn print(&self) {
        println!();
        println!(
            "Summary over {} runs (spread = (max - min) / median; the better column says which way each figure improves):",
            self.repeat
        );
        let head = ["metric", "median", "min", "max", "spread", "better"];
        let rows: Vec<Vec<String>> = self
            .summary
            .iter()
            .map(|s| {
                let f = |x| unit_cell(s.unit, x);
                let (md, lo, hi, sp) = (f(s.median), f(s.min), f(s.max), spread_cell(s.spread));
                let better = s.better.word().to_string();
                vec![unit_head(s.metric, s.unit), md, lo, hi, sp, better]
            })
            .collect();
        print_table(&head, &rows);
        if self.summary.iter().any(|s| s.unit == "x") {
            println!("guest/native: the guest pass's time over the same pass by host threads on host memory; 1.00x is native speed, lower is better");
        }
    }
}

/// A spread in a table cell, as a percentage of the median.
pub fn spread_cell(spread: Option<f64>) -> String {
    spread.map_or_else(|| "-".into(), |p| format!("{:.1}%", p * 100.0))
}

/// Prints a Markdown table: `head` columns, then `rows`.
pub fn print_table<S: AsRef<str>>(head: &[S], rows: &[Vec<String>]) {
    let head: Vec<String> = head.iter().map(|h| h.as_ref().to_string()).collect();
    let widths: Vec<usize> = (0..head.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([head[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect();
        println!("| {} |", padded.join(" | "));
    };
    line(&head);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    println!("|-{}-|", rule.join("-|-"));
    for r in rows {
        line(r);
    }
}

/// One row of a `--vary` JSON document whose rows may fail: the `key=value` of every varied
/// key, and the row's report or why it failed (a failed row does not stop the sweep).
#[derive(Serialize)]
pub struct FallibleRow<T> {
    pub settings: Vec<String>,
    #[serde(flatten)]
    pub outcome: RowOutcome<T>,
}

/// A [`FallibleRow`]'s result.
#[derive(Serialize)]
pub enum RowOutcome<T> {
    #[serde(rename = "result")]
    Done(Box<T>),
    #[serde(rename = "error")]
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct R(Option<f64>);

    const M: Metric<R> = Metric {
        name: "x",
        unit: "s",
        better: Better::Lower,
        get: |r| r.0,
    };

    #[test]
    fn summary_of_odd_even_and_missing_runs() {
        let s = summarize(&M, &[R(Some(3.0)), R(Some(1.0)), R(Some(2.0))]);
        assert_eq!((s.median, s.min, s.max), (Some(2.0), Some(1.0), Some(3.0)));
        assert_eq!(s.spread, Some(1.0));
        let s = summarize(&M, &[R(Some(4.0)), R(None), R(Some(2.0))]);
        assert_eq!((s.runs, s.median), (2, Some(3.0)));
        let s = summarize(&M, &[R(None)]);
        assert_eq!((s.runs, s.median, s.spread), (0, None, None));
    }

    #[test]
    fn comparison_divides_first_by_second() {
        let (a, b) = (Runs::One(R(Some(1.0))), Runs::One(R(Some(4.0))));
        let c = Comparison::new("t", ["sim", "kvm"], &[M], [&a, &b]);
        assert_eq!(c.comparison[0].ratio_first_over_second, Some(0.25));
        let z = Runs::new("t", &[M], vec![R(Some(0.0)), R(Some(0.0))]);
        let c = Comparison::new("t", ["sim", "kvm"], &[M], [&a, &z]);
        assert_eq!(c.comparison[0].ratio_first_over_second, None);
    }
}

/// Which benchmark ran on which machine: the head of every single-run report (flattened into
/// its JSON, so the document keeps `benchmark`, `backend` and `format` at the top).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RunHead {
    pub benchmark: &'static str,
    pub backend: &'static str,
    /// The page-table format (`null` on kvm).
    pub format: Option<&'static str>,
}

impl RunHead {
    /// `benchmark` on `kind`, with the simulated machine's `format`.
    pub fn new(benchmark: &'static str, kind: BackendArg, format: FormatArg) -> RunHead {
        let (backend, format) = (kind.name(), format_name(kind, format));
        RunHead {
            benchmark,
            backend,
            format,
        }
    }
}

/// The [`Benchmark`](crate::driver::Benchmark) methods a benchmark forwards: its flags
/// (`--backend`, with `vary` its `--vary`, and `out`), `check` (refusals as bad input),
/// `measure` and `print` as functions of its module.
#[macro_export]
macro_rules! forward_benchmark {
    (vary: $vary:tt, check: $check:path, measure: $measure:path, print: $print:path) => {
        fn common(&self) -> $crate::driver::Common<'_> {
            self.out.common(&self.backend, $crate::forward_benchmark!(@vary self $vary))
        }
        fn check(&self) -> $crate::error::CliResult {
            $check(self).map_err($crate::error::CliError::bad)
        }
        fn measure(&self, kind: $crate::args::BackendArg) -> $crate::error::CliResult<Self::Report> {
            $measure(self, kind)
        }
        fn print(&self, r: &Self::Report) {
            $print(r)
        }
    };
    (@vary $s:ident yes) => { &$s.vary };
    (@vary $s:ident no) => { &[] };
}
