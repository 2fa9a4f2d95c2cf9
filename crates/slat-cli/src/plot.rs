//! `--plot FILE.svg`: line charts of a run's figures (with `--repeat`, the median and a band
//! from the minimum to the maximum) and bar charts of a sweep's or a comparison's figures
//! (with min-max error bars), drawn with plotters' SVG backend.

use crate::error::{CliError, CliResult};
use plotters::prelude::*;
use std::path::Path;

/// One line of a chart: its legend and its points.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (x, y) points, in x order; a `None` y leaves a gap (the point is skipped).
    pub points: Vec<(f64, Option<f64>)>,
    /// (x, min, max) of every point over `--repeat` runs: drawn as a band (empty: one run).
    pub band: Vec<(f64, f64, f64)>,
}

/// A chart: title, axis descriptions, the lines, and optional names for integer x positions
/// (a sweep's rows).
pub struct Chart<'a> {
    /// Caption above the plot.
    pub title: String,
    /// What x is.
    pub x_desc: &'a str,
    /// What y is.
    pub y_desc: &'a str,
    /// The lines.
    pub series: Vec<Series>,
    /// Labels of x = 0, 1, 2, ... instead of numbers.
    pub x_names: Option<Vec<String>>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn plot_err(path: &Path, e: impl std::fmt::Display) -> CliError {
    CliError::Runtime(format!("cannot draw the plot {}: {e}", path.display()))
}

/// The range of the values, widened so a flat line is not on the frame.
fn span(xs: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), x| {
        (l.min(x), h.max(x))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi > lo {
        (lo, hi)
    } else {
        (lo - 0.5, hi + 0.5)
    }
}

/// The label of x: the name of its group at whole x, nothing between groups.
fn name_at(names: &[String], x: f64) -> String {
    let i = x.round();
    match (x - i).abs() < 1e-6 && i >= 0.0 {
        true => names.get(i as usize).cloned().unwrap_or_default(),
        false => String::new(),
    }
}

/// Draws `charts` one above the other into `path`.
pub fn draw_stacked(charts: &[Chart], path: &Path) -> CliResult {
    let height = 420 * charts.len().max(1) as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    for (c, area) in charts.iter().zip(root.split_evenly((charts.len(), 1))) {
        c.draw_on(&area, path)?;
    }
    root.present().map_err(|e| plot_err(path, e))
}

impl Chart<'_> {
    fn draw_on(
        &self,
        root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
        path: &Path,
    ) -> CliResult {
        let points = || {
            self.series
                .iter()
                .flat_map(|s| s.points.iter().filter_map(|&(x, y)| y.map(|y| (x, y))))
        };
        let (x0, x1) = span(points().map(|p| p.0));
        let highs = self.series.iter().flat_map(|s| s.band.iter().map(|b| b.2));
        let (_, y1) = span(points().map(|p| p.1).chain(highs));
        let (x0, x1) = if self.x_names.is_some() {
            (x0 - 0.5, x1 + 0.5)
        } else {
            (x0, x1)
        };
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(80)
            // Headroom above the data for the legend (upper right), one row per series, so
            // it does not hide the highest points.
            .build_cartesian_2d(x0..x1, 0.0..y1 * (1.1 + 0.09 * self.series.len() as f64))
            .map_err(|e| plot_err(path, e))?;
        let names = self.x_names.clone();
        let x_fmt = move |x: &f64| match &names {
            Some(n) => name_at(n, *x),
            None => format!("{x}"),
        };
        let n_ticks = self.x_names.as_ref().map_or(10, |n| n.len() * 2 + 1);
        chart
            .configure_mesh()
            .x_desc(self.x_desc)
            .y_desc(self.y_desc)
            .x_labels(n_ticks)
            .x_label_formatter(&x_fmt)
            .draw()
            .map_err(|e| plot_err(path, e))?;
        for (i, s) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            if s.band.len() > 1 {
                let mut edge: Vec<(f64, f64)> = s.band.iter().map(|b| (b.0, b.2)).collect();
                edge.extend(s.band.iter().rev().map(|b| (b.0, b.1)));
                chart
                    .draw_series(std::iter::once(Polygon::new(edge, color.mix(0.2).filled())))
                    .map_err(|e| plot_err(path, e))?;
            }
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter_map(|&(x, y)| y.map(|y| (x, y)))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| plot_err(path, e))?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(|e| plot_err(path, e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot_err(path, e))?;
        Ok(())
    }
}

/// One panel of a bar chart: one metric, a bar per group (a `--vary` row, a machine, a run),
/// each the median with an error bar from the minimum to the maximum.
pub struct BarPanel {
    /// Caption above the panel.
    pub title: String,
    /// What the groups are.
    pub x_desc: String,
    /// What y is.
    pub y_desc: String,
    /// The groups' labels.
    pub groups: Vec<String>,
    /// (median, min, max) per group; `None` leaves the slot empty.
    pub values: Vec<Option<(f64, f64, f64)>>,
}

/// Draws `panels` one above the other into `path`.
pub fn draw_bars(panels: &[BarPanel], path: &Path) -> CliResult {
    let rows = |p: &BarPanel| p.groups.iter().map(|g| g.len() / 30 + 1).max().unwrap_or(1);
    let height: u32 = panels.iter().map(|p| 380 + 16 * rows(p) as u32).sum();
    let root = SVGBackend::new(path, (1000, height.max(380))).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let mut rest = root.clone();
    for p in panels {
        let (area, below) = rest.split_vertically(380 + 16 * rows(p) as u32);
        p.draw_on(&area, rows(p) as u32, path)?;
        rest = below;
    }
    root.present().map_err(|e| plot_err(path, e))
}

impl BarPanel {
    fn draw_on(
        &self,
        root: &DrawingArea<SVGBackend, plotters::coord::Shift>,
        rows: u32,
        path: &Path,
    ) -> CliResult {
        let n = self.groups.len().max(1);
        let top = self
            .values
            .iter()
            .flatten()
            .map(|v| v.2)
            .fold(0.0f64, f64::max);
        let top = if top > 0.0 { top * 1.15 } else { 1.0 };
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(40 + 16 * rows)
            .y_label_area_size(80)
            .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..top)
            .map_err(|e| plot_err(path, e))?;
        let names = self.groups.clone();
        let x_fmt = move |x: &f64| name_at(&names, *x);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc(&self.x_desc)
            .y_desc(&self.y_desc)
            .x_labels(n * 2 + 1)
            .x_label_formatter(&x_fmt)
            .draw()
            .map_err(|e| plot_err(path, e))?;
        let bars = self.values.iter().enumerate().filter_map(|(g, v)| {
            let (m, _, _) = (*v)?;
            let color = COLORS[g % COLORS.len()];
            Some(Rectangle::new(
                [(g as f64 - 0.3, 0.0), (g as f64 + 0.3, m)],
                color.filled(),
            ))
        });
        chart.draw_series(bars).map_err(|e| plot_err(path, e))?;
        let whiskers = self.values.iter().enumerate().filter_map(|(g, v)| {
            // One run (or identical runs) has no spread to show: no flat whisker on the bar.
            let (_, lo, hi) = (*v).filter(|v| v.2 > v.1)?;
            let (x, cap) = (g as f64, 0.08);
            Some(PathElement::new(
                vec![
                    (x - cap, lo),
                    (x + cap, lo),
                    (x, lo),
                    (x, hi),
                    (x - cap, hi),
                    (x + cap, hi),
                ],
                BLACK.stroke_width(2),
            ))
        });
        chart.draw_series(whiskers).map_err(|e| plot_err(path, e))?;
        Ok(())
    }
}
