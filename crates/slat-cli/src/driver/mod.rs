//! The one benchmark driver. A benchmark is one type implementing [`Benchmark`]: its flags
//! (the clap `Args` it is), its `--vary` table, how to run once on a machine, its metrics and
//! how to print a run. [`run`] does the rest the same way for every benchmark: `--backend
//! sim|kvm|sim,kvm`, `--vary`, `--repeat`, `--json`, `--plot`, progress lines, and the checks
//! of every output path before any work starts.

pub mod chart;
pub mod vary;

use crate::args::{BackendArg, OutputArgs};
use crate::error::{CliError, CliResult};
use crate::output::{print_json, Comparison, Metric, Repeated, Runs, Sweep, SweepRow};
use crate::report::quiet;
use serde::Serialize;

pub use chart::Lines;

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
    let metrics = b.metrics();
    let mut done = Vec::new();
    for (n, row) in rows.iter().enumerate() {
        if !quiet(c.out.json) {
            eprintln!(
                "[slat] sweep {}/{}: {}",
                n + 1,
                rows.len(),
                row.settings.join(" ")
            );
        }
        let r = runs(&row.args, kind, false)?;
        done.push(SweepRow {
            settings: row.settings.clone(),
            result: Runs::new(B::NAME, &metrics, r),
        });
    }
    let sweep = Sweep {
        benchmark: B::NAME,
        sweep: done,
    };
    if let Some(path) = &c.out.plot {
        let groups: Vec<(String, &[B::Report])> = sweep
            .sweep
            .iter()
            .map(|r| (r.settings.join(" "), r.result.all()))
            .collect();
        chart::bars(b, &groups, &metrics, "settings", path)?;
    }
    if c.out.json {
        return print_json(&sweep, c.backends);
    }
    println!("{}", b.sweep_title(kind));
    if repeat(b) > 1 {
        println!("(medians of {} runs per row)", repeat(b));
    }
    let keys: Vec<&str> = c.vary.iter().map(|v| v.key).collect();
    sweep.print(&keys, &metrics);
    Ok(())
}
