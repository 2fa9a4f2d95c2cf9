//! The one benchmark driver. A benchmark is one type implementing [`Benchmark`]: its flags
//! (the clap `Args` it is), its `--vary` table, how to run once on a machine, its metrics and
//! how to print a run. [`run`] does the rest the same way for every benchmark: `--backend
//! sim|kvm|sim,kvm`, `--vary`, `--repeat`, `--json`, `--plot`, progress lines, and the checks
//! of every output path before any work starts.

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
    /// `--backend` (one or two machines; `[sim]` for a benchmark without the flag).
    pub backends: &'a [BackendArg],
    /// `--vary` (empty for a benchmark without the flag).
    pub vary: &'a [vary::Vary],
    /// `--json`, `--repeat`, `--plot`.
    pub out: &'a OutputArgs,
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
    /// The shared flags.
    fn common(&self) -> Common<'_>;
    /// Refuses flags that cannot run, before anything is measured (exit status 2). Called
    /// for the flags as given and for every `--vary` row.
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
    fn comparison_title(&self, kinds: [BackendArg; 2]) -> String {
        format!(
            "{} on {} and {}, in this process",
            Self::NAME,
            kinds[0].name(),
            kinds[1].name()
        )
    }
    /// The line above the `--vary` table.
    fn sweep_title(&self, kind: BackendArg) -> String {
        format!(
            "{} sweep on {}, one row per combination, all in this process",
            Self::NAME,
            kind.name()
        )
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
    /// Whether `--repeat` with several backends or `--vary` can run (a benchmark whose runs
    /// are not comparable across repeats says why not).
    fn refuse(&self) -> Option<String> {
        None
    }
}

/// Checks that `--plot` can be written before anything runs: a path that cannot be created
/// is bad input, found now rather than after minutes of measuring.
pub fn check_output(path: Option<&std::path::Path>) -> CliResult {
    let Some(p) = path else { return Ok(()) };
    let existed = p.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(p)
        .map_err(|e| CliError::bad(format!("--plot {}: cannot write it: {e}", p.display())))?;
    if !existed {
        // Leave no empty file behind if the run fails before drawing.
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// Runs benchmark `b` as its flags ask.
pub fn run<B: Benchmark>(b: &B) -> CliResult {
    let c = b.common();
    check_output(c.out.plot.as_deref())?;
    crate::args::check_backends(c.backends, &[]).map_err(CliError::bad)?;
    if let Some(why) = b.refuse() {
        return Err(CliError::bad(why));
    }
    // A benchmark without --backend runs on the simulated machine.
    let kinds = match c.backends {
        [] => &[BackendArg::Sim][..],
        k => k,
    };
    if let (Some(finish), true) = (b.own_output(), c.vary.is_empty()) {
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
                chart::bars(b, &groups, &b.metrics(), "backend", path)?;
            }
        }
        return finish(b, all);
    }
    match (kinds, c.vary.is_empty()) {
        ([kind], true) => {
            b.check()?;
            single(b, *kind)
        }
        ([k0, k1], true) => {
            b.check()?;
            compare(b, [*k0, *k1])
        }
        ([kind], false) => sweep(b, *kind),
        _ => Err(CliError::bad(
            "--vary runs one machine: give one --backend, or drop --vary",
        )),
    }
}

fn repeat(b: &impl Benchmark) -> usize {
    b.common().out.repeat as usize
}

/// `--repeat` runs of one configuration on `kind`, each printed unless `text` is off.
fn runs<B: Benchmark>(b: &B, kind: BackendArg, text: bool) -> CliResult<Vec<B::Report>> {
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

fn compare<B: Benchmark>(b: &B, kinds: [BackendArg; 2]) -> CliResult {
    let out = b.common().out;
    let metrics = b.metrics();
    let mut both = Vec::new();
    for kind in kinds {
        if !quiet(out.json) {
            eprintln!("[slat] running on {}", kind.name());
        }
        both.push(Runs::new(B::NAME, &metrics, runs(b, kind, false)?));
    }
    let names = [kinds[0].name(), kinds[1].name()];
    let cmp = Comparison::new(B::NAME, names, &metrics, [&both[0], &both[1]]);
    if let Some(path) = &out.plot {
        let groups: Vec<(String, &[B::Report])> = names
            .iter()
            .zip(&both)
            .map(|(n, r)| (n.to_string(), r.all()))
            .collect();
        chart::bars(b, &groups, &metrics, "backend", path)?;
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

fn sweep<B: Benchmark>(b: &B, kind: BackendArg) -> CliResult {
    let c = b.common();
    let rows = vary::rows(b, c.vary, B::vary_table()).map_err(CliError::bad)?;
    // Every row is checked before the first runs: a refusal at row 5 after minutes of
    // measuring would waste them.
    for row in &rows {
        row.args
            .check()
            .map_err(|e| CliError::bad(format!("--vary row {}: {e}", row.settings.join(" "))))?;
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
        done.push(FallibleRow {
            settings: row.settings.clone(),
            outcome,
        });
    }
    let sweep = Sweep {
        benchmark: B::NAME,
        varied: c.vary.iter().map(|v| v.key).collect(),
        sweep: done,
    };
    if let Some(path) = &c.out.plot {
        let groups: Vec<(String, &[B::Report])> = sweep
            .sweep
            .iter()
            .map(|r| match &r.outcome {
                RowOutcome::Done(runs) => (r.settings.join(" "), runs.all()),
                RowOutcome::Failed(_) => (r.settings.join(" "), &[][..]),
            })
            .collect();
        chart::bars(b, &groups, &metrics, "settings", path)?;
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
    let failed = sweep
        .sweep
        .iter()
        .filter(|r| matches!(r.outcome, RowOutcome::Failed(_)))
        .count();
    if failed > 0 {
        return Err(CliError::Runtime(format!(
            "--vary: {failed} of {} rows failed",
            sweep.sweep.len()
        )));
    }
    Ok(())
}
