//! What `--plot` draws for the driver: a benchmark's per-run lines (with `--repeat`, the
//! median of every point and a band from the minimum to the maximum, never one run), or
//! bars of its headline metrics per run group (a `--vary` row, a `--backend` machine) with
//! min-max error bars.

use super::Benchmark;
use crate::error::CliResult;
use crate::output::{summarize, Metric};
use crate::plot::{draw_bars, draw_stacked, BarPanel, Chart, Series};
use std::path::Path;

/// A benchmark's line chart of one run: its title and axes, the names of x = 0, 1, 2, ...
/// (iterations, rounds) if any, and for each line its legend and its points in a report.
pub struct Lines<R> {
    pub title: String,
    pub x_desc: &'static str,
    pub y_desc: &'static str,
    pub x_names: Option<Vec<String>>,
    pub series: Vec<(String, SeriesOf<R>)>,
}

/// A line's points in one run's report.
pub type SeriesOf<R> = Box<dyn Fn(&R) -> Vec<(f64, Option<f64>)>>;

/// A metric of plain numbers, to summarize a line's points like a report's figures.
const UNIT: Metric<f64> = super::lower("", "", |y| Some(*y));

/// Bars of figures a benchmark names at run time (a bar per variant a run covers), one panel:
/// with `--repeat`, each bar is the median with error bars from the minimum to the maximum.
pub struct Bars<R> {
    /// Caption.
    pub title: String,
    /// What the bars are.
    pub x_desc: &'static str,
    /// What y is.
    pub y_desc: &'static str,
    /// (bar, its figure in a run).
    pub bars: Vec<(String, FigureOf<R>)>,
}

/// A figure in one run's report.
pub type FigureOf<R> = Box<dyn Fn(&R) -> Option<f64>>;

/// One line over `runs`: the median at every x the runs share, and its min-max band.
fn series<R>(name: &str, f: &SeriesOf<R>, runs: &[R]) -> Series {
    let all: Vec<Vec<(f64, Option<f64>)>> = runs.iter().map(f).collect();
    let xs: Vec<f64> = all
        .first()
        .map(|p| p.iter().map(|q| q.0).collect())
        .unwrap_or_default();
    let mut points = Vec::new();
    let mut band = Vec::new();
    for x in xs {
        let ys: Vec<f64> = all
            .iter()
            .filter_map(|pts| pts.iter().find(|p| p.0 == x).and_then(|p| p.1))
            .collect();
        let s = median_min_max(&UNIT, &ys, 1.0);
        points.push((x, s.map(|s| s.0)));
        if runs.len() > 1 {
            band.extend(s.map(|(_, lo, hi)| (x, lo, hi)));
        }
    }
    Series {
        name: name.to_string(),
        points,
        band,
    }
}

/// `--plot` of one configuration's runs: its lines, or bars of its metrics.
pub fn runs<B: Benchmark>(
    b: &B,
    runs: &[B::Report],
    metrics: &[Metric<B::Report>],
    path: &Path,
) -> CliResult {
    let Some(first) = runs.first() else {
        return Ok(());
    };
    let bars = b.bars(first);
    if !bars.is_empty() {
        let panels: Vec<BarPanel> = bars
            .iter()
            .map(|p| BarPanel {
                title: format!("{} ({})", p.title, of_runs(runs.len())),
                x_desc: p.x_desc.into(),
                y_desc: p.y_desc.into(),
                groups: p.bars.iter().map(|x| x.0.clone()).collect(),
                values: p
                    .bars
                    .iter()
                    .map(|(_, f)| {
                        let ys: Vec<f64> = runs.iter().filter_map(f).collect();
                        median_min_max(&UNIT, &ys, 1.0)
                    })
                    .collect(),
            })
            .collect();
        return draw_bars(&panels, path);
    }
    let lines = b.lines(first);
    if lines.is_empty() {
        return figures::<B>(runs, metrics, path);
    }
    let charts: Vec<Chart> = lines
        .iter()
        .map(|l| Chart {
            title: match runs.len() {
                1 => l.title.clone(),
                n => format!("{} (median of {n} runs; band: min to max)", l.title),
            },
            x_desc: l.x_desc,
            y_desc: l.y_desc,
            series: l.series.iter().map(|(n, f)| series(n, f, runs)).collect(),
            x_names: l.x_names.clone(),
        })
        .collect();
    draw_stacked(&charts, path)
}

/// One configuration without lines: a bar per metric that shares the first metric's unit.
fn figures<B: Benchmark>(
    runs: &[B::Report],
    metrics: &[Metric<B::Report>],
    path: &Path,
) -> CliResult {
    let Some(unit) = metrics.first().map(|m| m.unit) else {
        return Ok(());
    };
    let same: Vec<&Metric<B::Report>> = metrics.iter().filter(|m| m.unit == unit).collect();
    let (scale, shown) = scale(unit);
    let panel = BarPanel {
        title: format!("{} ({})", B::NAME, of_runs(runs.len())),
        x_desc: "figure".into(),
        y_desc: shown.to_string(),
        groups: same.iter().map(|m| m.name.to_string()).collect(),
        values: same
            .iter()
            .map(|m| median_min_max(m, runs, scale))
            .collect(),
    };
    draw_bars(&[panel], path)
}

fn of_runs(n: usize) -> String {
    match n {
        1 => String::from("one run"),
        n => format!("median of {n} runs, error bars min to max"),
    }
}

/// How a unit is drawn: seconds as milliseconds.
fn scale(unit: &str) -> (f64, &str) {
    match unit {
        "s" => (1e3, "ms"),
        "x" => (1.0, "guest/native"),
        u => (1.0, u),
    }
}

fn median_min_max<R>(m: &Metric<R>, runs: &[R], scale: f64) -> Option<(f64, f64, f64)> {
    let s = summarize(m, runs);
    Some((s.median? * scale, s.min? * scale, s.max? * scale))
}

/// Bars of the benchmark's headline metrics, a panel each, one bar per `(label, runs)`
/// group: the median, with error bars from the minimum to the maximum.
pub fn bars<B: Benchmark>(
    b: &B,
    groups: &[(String, &[B::Report])],
    x_desc: &str,
    path: &Path,
) -> CliResult {
    let (heads, metrics) = (b.headline(), b.metrics());
    let reps = groups.iter().map(|g| g.1.len()).max().unwrap_or(1);
    let of = match reps {
        1 => String::from("one run each"),
        n => format!("median of {n} runs, error bars min to max"),
    };
    let panels: Vec<BarPanel> = metrics
        .iter()
        .filter(|m| heads.contains(&m.name))
        .map(|m| {
            let (scale, unit) = scale(m.unit);
            let better = format!("{:?}", m.better).to_lowercase();
            BarPanel {
                title: format!("{}: {} ({of})", B::NAME, m.name),
                x_desc: x_desc.to_string(),
                y_desc: format!("{unit} ({better} is better)"),
                groups: groups.iter().map(|g| g.0.clone()).collect(),
                values: groups
                    .iter()
                    .map(|(_, runs)| median_min_max(m, runs, scale))
                    .collect(),
            }
        })
        .collect();
    draw_bars(&panels, path)
}
