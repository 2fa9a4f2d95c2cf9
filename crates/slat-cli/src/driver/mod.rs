//! The one benchmark driver. A benchmark is one type implementing [`Benchmark`]: its flags
//! (the clap `Args` it is), its `--vary` table or `--compare` rows, how to run once on a
//! machine, its metrics and how to print a run. [`run`] does the rest the same way for every
//! benchmark: `--backend sim|kvm|sim,kvm`, `--vary`, `--compare`, `--repeat`, `--json`,
//! `--plot` and progress lines, with every output path checked before any work starts.

pub mod chart;
pub mod vary;

use crate::args::{BackendArg, OutputArgs};
use crate::error::{CliError, CliResult};
use crate::output::{
    print_json, Comparison, FallibleRow, Metric, Repeated, RowOutcome, Runs, Sweep,
};
use crate::report::quiet;
use serde::Serialize;

pub use chart::{Bars, Lines};

/// The flags every benchmark shares, as the driver reads them.
pub struct Common<'a> {
    /// `--backend` (one or two machines; empty: the simulated machine).
    pub backends: &'a [BackendArg],
    /// `--vary` (empty for a benchmark without the flag).
    pub vary: &'a [vary::Vary],
    pub out: &'a OutputArgs,
}

impl<'a> Common<'a> {
    /// The flags of a benchmark without `--vary`.
    pub fn of(backends: &'a [BackendArg], out: &'a OutputArgs) -> Self {
        Common {
            backends,
            vary: &[],
            out,
        }
    }
}

/// A row of `--compare`: its `key=value` settings, and what they set on a copy of the flags.
pub struct Preset<A> {
    pub settings: &'static [&'static str],
    pub apply: fn(&mut A),
}

/// A metric where lower is better (a time, a ratio over native, a count of faults).
pub const fn lower<R>(
    name: &'static str,
    unit: &'static str,
    get: fn(&R) -> Option<f64>,
) -> Metric<R> {
    let better = crate::output::Better::Lower;
    Metric {
        name,
        unit,
        better,
        get,
    }
}

/// A benchmark subcommand.
pub trait Benchmark: Clone + Sized + 'static {
    /// What one run measured.
    type Report: Serialize;
    /// The subcommand's name, as reports carry it.
    const NAME: &'static str;

    /// The `--vary` table (empty: the benchmark has no `--vary`).
    fn vary_table() -> &'static [vary::Key<Self>] {
        &[]
    }
    /// `--compare`'s fixed rows, which the driver runs as a `--vary` sweep when [`compare`]
    /// says so: each row checked first, `--repeat`, JSON, bars.
    ///
    /// [`compare`]: Benchmark::compare
    const PRESETS: &'static [Preset<Self>] = &[];
    /// `--compare` was given.
    fn compare(&self) -> bool {
        false
    }
    fn common(&self) -> Common<'_>;
    /// Refuses flags that cannot run, before anything is measured (exit status 2). Called
    /// for the flags as given, or for every `--vary` or `--compare` row instead.
    fn check(&self) -> CliResult;
    /// One run on `kind`.
    fn measure(&self, kind: BackendArg) -> CliResult<Self::Report>;
    /// The headline figures (tables, summaries, bar charts).
    fn metrics(&self) -> Vec<Metric<Self::Report>>;
    /// The text report of one run.
    fn print(&self, r: &Self::Report);
    /// The line charts `--plot` draws of a configuration's runs, laid out from the first
    /// run (none: bars of the metrics instead).
    fn lines(&self, _first: &Self::Report) -> Vec<Lines<Self::Report>> {
        Vec::new()
    }
    /// The bar panels `--plot` draws of a configuration's runs when the figures are named at
    /// run time (a bar per variant a run covers), laid out from the first run (none: the lines,
    /// or bars of the metrics).
    fn bars(&self, _first: &Self::Report) -> Vec<Bars<Self::Report>> {
        Vec::new()
    }
    /// The metrics `--plot` draws as bars (a panel each) for a sweep or a comparison: the
    /// first metric unless the benchmark names others.
    fn headline(&self) -> Vec<&'static str> {
        self.metrics().first().map(|m| m.name).into_iter().collect()
    }
    /// The line above the `--backend A,B` table.
    fn comparison_title(&self, [k0, k1]: [BackendArg; 2]) -> String {
        let (n, a, b) = (Self::NAME, k0.name(), k1.name());
        format!("{n} on {a} and {b}, in this process")
    }
    /// The line above the `--vary` or `--compare` table.
    fn sweep_title(&self, kind: BackendArg) -> String {
        let (n, k) = (Self::NAME, kind.name());
        format!("{n} sweep on {k}, one row per combination, all in this process")
    }
    /// A benchmark whose JSON document predates the driver (its schema is kept) prints it
    /// itself: given every machine's runs (each printed as it ran), it prints the text
    /// summary or the one JSON document. `None`: the driver's report, comparison or summary.
    #[allow(clippy::type_complexity)]
    fn own_output(&self) -> Option<fn(&Self, Vec<(BackendArg, Vec<Self::Report>)>) -> CliResult> {
        None
    }
    /// Prints a sweep's table itself (true), or leaves it to the driver (false).
    fn print_sweep(&self, _sweep: &Sweep<Self::Report>) -> bool {
        false
    }
    /// Refuses a combination of flags before anything runs (why, as one line).
    fn refuse(&self) -> Option<String> {
        None
    }
}

/// Runs benchmark `b` as its flags ask.
pub fn run<B: Benchmark>(b: &B) -> CliResult {
    let c = b.common();
    c.out.check_paths()?;
    crate::args::check_backends(c.backends, &[]).map_err(CliError::bad)?;
    if let Some(why) = b.refuse() {
        return Err(CliError::bad(why));
    }
    if b.compare() && !c.vary.is_empty() {
        return Err(CliError::bad("--compare runs its own rows: drop --vary"));
    }
    let kinds = match c.backends {
        [] => &[BackendArg::Sim][..],
        k => k,
    };
    let swept = !c.vary.is_empty() || b.compare();
    if let (Some(finish), false) = (b.own_output(), swept) {
        b.check()?;
        let mut all = Vec::new();
        for &kind in kinds {
            all.push((kind, runs(b, kind, !c.out.json)?));
        }
        match (&c.out.plot, &all[..]) {
            (None, _) => {}
            // One machine with lines or bars of its own: those, as for a run the driver prints.
            (Some(path), [(_, one)])
                if one
                    .first()
                    .is_some_and(|f| !b.lines(f).is_empty() || !b.bars(f).is_empty()) =>
            {
                chart::runs(b, one, &b.metrics(), path)?
            }
            (Some(path), _) => {
                let groups: Vec<(String, &[B::Report])> = all
                    .iter()
                    .map(|(k, r)| (k.name().to_string(), &r[..]))
                    .collect();
                chart::bars(b, &groups, "backend", path)?;
            }
        }
        return finish(b, all);
    }
    match (kinds, swept) {
        ([kind], false) => b.check().and_then(|()| single(b, *kind)),
        ([k0, k1], false) => b.check().and_then(|()| side_by_side(b, [*k0, *k1])),
        ([kind], true) => sweep(b, *kind),
        _ if c.vary.is_empty() => Err(CliError::bad(
            "--compare runs one machine: give one --backend, or drop --compare",
        )),
        _ => Err(CliError::bad(
            "--vary runs one machine: give one --backend, or drop --vary",
        )),
    }
}

fn repeat(b: &impl Benchmark) -> usize {
    b.common().out.repeat as usize
}

/// `--repeat` runs of one configuration on `kind`, each printed if `text`.
pub(crate) fn runs<B: Benchmark>(b: &B, kind: BackendArg, text: bool) -> CliResult<Vec<B::Report>> {
    let (n, q) = (repeat(b), quiet(b.common().out.json));
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if n > 1 && !q {
            eprintln!("[slat] run {}/{n}", i + 1);
        }
        let r = b.measure(kind)?;
        if text {
            b.print(&r);
        }
        out.push(r);
    }
    Ok(out)
}

fn single<B: Benchmark>(b: &B, kind: BackendArg) -> CliResult {
    let out = b.common().out;
    let runs = runs(b, kind, !out.json)?;
    let metrics = b.metrics();
    if let Some(path) = &out.plot {
        chart::runs(b, &runs, &metrics, path)?;
    }
    let backends = b.common().backends;
    match runs.len() {
        1 if out.json => print_json(&runs[0], backends),
        1 => Ok(()),
        _ => {
            let rep = Repeated::new(B::NAME, &metrics, runs);
            if out.json {
                return print_json(&rep, backends);
            }
            rep.print();
            Ok(())
        }
    }
}

fn side_by_side<B: Benchmark>(b: &B, kinds: [BackendArg; 2]) -> CliResult {
    let out = b.common().out;
    let metrics = b.metrics();
    let mut both = Vec::new();
    for kind in kinds {
        if !quiet(out.json) {
            eprintln!("[slat] running on {}", kind.name());
        }
        both.push(Runs::new(B::NAME, &metrics, runs(b, kind, false)?));
    }
    let names = kinds.map(BackendArg::name);
    let cmp = Comparison::new(B::NAME, names, &metrics, [&both[0], &both[1]]);
    if let Some(path) = &out.plot {
        let groups = names
            .iter()
            .zip(&both)
            .map(|(n, r)| (n.to_string(), r.all()));
        chart::bars(b, &groups.collect::<Vec<_>>(), "backend", path)?;
    }
    if out.json {
        return print_json(&cmp, b.common().backends);
    }
    println!("{}", b.comparison_title(kinds));
    if repeat(b) > 1 {
        println!("(medians of {} runs on each machine)", repeat(b));
    }
    cmp.print();
    Ok(())
}

/// The varied keys and the rows of `--compare` (if asked) or `--vary`.
fn sweep_rows<B: Benchmark>(b: &B) -> CliResult<(Vec<&'static str>, Vec<vary::Row<B>>)> {
    let vary = b.common().vary;
    let Some(first) = B::PRESETS.first().filter(|_| b.compare()) else {
        let rows = vary::rows(b, vary, B::vary_table()).map_err(CliError::bad)?;
        return Ok((vary.iter().map(|v| v.key).collect(), rows));
    };
    let keys = first.settings.iter();
    let keys = keys
        .map(|s| s.split_once('=').map_or(*s, |kv| kv.0))
        .collect();
    let rows = B::PRESETS.iter().map(|p| {
        let mut args = b.clone();
        (p.apply)(&mut args);
        let settings = p.settings.iter().map(|s| s.to_string()).collect();
        vary::Row { settings, args }
    });
    Ok((keys, rows.collect()))
}

fn sweep<B: Benchmark>(b: &B, kind: BackendArg) -> CliResult {
    let c = b.common();
    let (varied, rows) = sweep_rows(b)?;
    let flag = if b.compare() { "--compare" } else { "--vary" };
    // Every row is checked before the first runs: a refusal at row 5 after minutes of
    // measuring would waste them.
    for row in &rows {
        let label = row.settings.join(" ");
        row.args
            .check()
            .map_err(|e| CliError::bad(format!("{flag} row {label}: {e}")))?;
    }
    let (metrics, q) = (b.metrics(), quiet(c.out.json));
    let mut done = Vec::new();
    let mut machines: Vec<BackendArg> = Vec::new();
    for (n, row) in rows.iter().enumerate() {
        let label = row.settings.join(" ");
        if !q {
            eprintln!("[slat] sweep {}/{}: {label}", n + 1, rows.len());
        }
        // A table may vary the machine (`backend=sim,kvm`): the row's own flags say which.
        let kind = row.args.common().backends.first().copied().unwrap_or(kind);
        if !machines.contains(&kind) {
            machines.push(kind);
        }
        let outcome = match runs(&row.args, kind, false) {
            Ok(r) => RowOutcome::Done(Box::new(Runs::new(B::NAME, &metrics, r))),
            Err(e) => {
                if !q {
                    eprintln!("[slat] sweep {}/{} failed: {e}", n + 1, rows.len());
                }
                RowOutcome::Failed(e.to_string())
            }
        };
        let settings = row.settings.clone();
        done.push(FallibleRow { settings, outcome });
    }
    let sweep = Sweep {
        benchmark: B::NAME,
        varied,
        sweep: done,
    };
    if let Some(path) = &c.out.plot {
        let groups = sweep.sweep.iter().map(|r| match &r.outcome {
            RowOutcome::Done(runs) => (r.settings.join(" "), runs.all()),
            RowOutcome::Failed(_) => (r.settings.join(" "), &[][..]),
        });
        chart::bars(b, &groups.collect::<Vec<_>>(), "settings", path)?;
    }
    if c.out.json {
        print_json(&sweep, &machines)?;
    } else if !b.print_sweep(&sweep) {
        println!("{}", b.sweep_title(kind));
        if repeat(b) > 1 {
            println!("(medians of {} runs per row)", repeat(b));
        }
        sweep.print(&metrics);
    }
    let failed = sweep.sweep.iter();
    let failed = failed.filter(|r| matches!(r.outcome, RowOutcome::Failed(_)));
    match failed.count() {
        0 => Ok(()),
        n => Err(CliError::Runtime(format!(
            "{flag}: {n} of {} rows failed",
            sweep.sweep.len()
        ))),
    }
}
