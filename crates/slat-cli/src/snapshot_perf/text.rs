//! snapshot-perf's text report.

use super::*;
use crate::output::{print_table, spread_cell, RowOutcome};

pub(super) fn f1(x: f64) -> String {
    format!("{x:.1}")
}

pub(super) fn f2(x: f64) -> String {
    format!("{x:.2}")
}

pub(super) fn rx(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
}

pub(super) fn print_run(r: &Run) {
    let c = &r.config;
    println!(
        "snapshot-perf on {}{}: {} vCPUs of {} each, log {} (re-arm: {}), {} order, {} iterations per k{}",
        r.backend,
        r.format.map_or(String::new(), |f| format!(" ({f})")),
        c.work.vcpus,
        slat_workload::format_size(c.work.bytes_per_vcpu),
        c.log,
        c.rearm,
        if c.random { "random" } else { "sequential" },
        c.iterations,
        if c.verify {
            ", every reset verified byte for byte"
        } else {
            ""
        }
    );
    let rows: Vec<Vec<String>> = r.rows.iter().map(cells).collect();
    print_table(COLUMNS, &rows);
    print_snapshot_lines(r);
    if let Some(l) = crate::report::pinned_line(c.pinned_cpus.as_deref()) {
        println!("{l}");
    }
    println!("{FOOTNOTE}");
    if let Some(l) = r.clock.line() {
        println!("{VIRTUAL_NOTE}");
        println!("{l}");
    }
    println!();
}

/// How a virtual-time run prices a reset, under its table.
const VIRTUAL_NOTE: &str = "Virtual time: the host CPU harvests and re-arms through the engine (its locks, walks and write-protects charged as the vCPUs' faults are); a reset's and the floor's page copies cost the profile's page_copy each, their zeroings zero_page; pass = the vCPUs' run on the host CPU's clock.";

/// The per-k table's columns.
const COLUMNS: &[&str] = &[
    "k/vCPU",
    "dirty pages",
    "resets/s",
    "reset p50 us",
    "p99 us",
    "us/page",
    "harvest us",
    "re-arm us",
    "copy us",
    "floor p50 us",
    "floor p99 us",
    "reset/floor",
    "full/reset",
    "execs/s",
    "pass us",
    "zeroed",
    "full resets",
    "re-armed",
    "RSS MiB",
];

/// One k's cells, in [`COLUMNS`]' order.
fn cells(k: &KRow) -> Vec<String> {
    vec![
        k.k_per_vcpu.to_string(),
        f1(k.dirty_pages),
        format!("{:.0}", k.resets_per_s),
        f1(k.reset_p50_us),
        f1(k.reset_p99_us),
        format!("{:.3}", k.us_per_dirty_page),
        f2(k.harvest_mean_us),
        f2(k.rearm_mean_us),
        f2(k.copy_mean_us),
        f1(k.floor_p50_us),
        f1(k.floor_p99_us),
        rx(k.ratio_reset_over_floor),
        rx(k.ratio_full_over_reset),
        format!("{:.0}", k.execs_per_s),
        f1(k.pass_mean_us),
        f1(k.zeroed_pages),
        k.full_resets.to_string(),
        f1(k.rearmed_mean),
        k.rss_mib.map_or_else(|| "-".into(), |m| format!("{m:.0}")),
    ]
}

/// The full-copy reset and the snapshot's size, under the table.
fn print_snapshot_lines(r: &Run) {
    let c = &r.config;
    match &r.full_copy {
        Some(f) => println!(
            "Full-copy reset of all {} pages: p50 {} us, p99 {} us, mean {} us ({} resets).",
            f.pages,
            f1(f.p50_us),
            f1(f.p99_us),
            f1(f.mean_us),
            f.resets
        ),
        None => println!(
            "Full-copy reset skipped: the guest is over {} and a full copy would fault in all of it.",
            slat_workload::format_size(FULL_COPY_MAX)
        ),
    }
    let cross = r.rows.first().map_or(0, |k| k.crossover_pages);
    let how = match r.clock.line() {
        Some(_) => "the cost profile prices every page of a full copy as a copied or zeroed page, so it never wins",
        None => "measured in this process",
    };
    println!(
        "Snapshot: {} of {} pages held (the rest were zero); a reset of at least {} pages copies everything back (crossover {:.2} of the guest, {how}).",
        r.rows.first().map_or(0, |k| k.snapshot_held_pages),
        r.rows.first().map_or(0, |k| k.ram_pages),
        if cross == u64::MAX { "-".to_string() } else { cross.to_string() },
        c.crossover_fraction
    );
}

/// What the columns mean, under each table.
const FOOTNOTE: &str = "Every k runs on the one machine of -b per vCPU (a pass writes k pages of each vCPU's region); floor = the same page copies and zeroings between two warm host buffers, the destination written first as the guest writes it; execs/s = one pass plus its reset; full/reset = full-copy reset p50 over this reset's p50; re-armed = 64-page chunks CLEAR re-armed (or ring entries reset) per reset.";

pub(super) fn print_summary(rep: &Report) {
    println!(
        "Reset p50 over {} runs (spread = (max - min) / median):",
        rep.repeat
    );
    let head = [
        "backend",
        "k/vCPU",
        "median us",
        "min us",
        "max us",
        "spread",
    ];
    let opt = |x: Option<f64>| x.map_or_else(|| "-".into(), f1);
    let rows: Vec<Vec<String>> = rep
        .summary
        .iter()
        .map(|s| {
            let m = &s.reset_p50_us;
            vec![
                s.backend.to_string(),
                s.k_per_vcpu.to_string(),
                opt(m.median),
                opt(m.min),
                opt(m.max),
                spread_cell(m.spread),
            ]
        })
        .collect();
    print_table(&head, &rows);
}

/// `--backend A,B`: reset p50 per k on each machine and their ratio (first runs only).
pub(super) fn print_comparison(rep: &Report) {
    let repeat = rep.repeat.max(1) as usize;
    let (a, b) = (&rep.runs[0], &rep.runs[repeat]);
    println!("Reset p50 (us), {} vs {}:", a.backend, b.backend);
    let head: Vec<String> = vec![
        "k/vCPU".into(),
        a.backend.into(),
        b.backend.into(),
        format!("{}/{}", a.backend, b.backend),
    ];
    let rows: Vec<Vec<String>> = a
        .rows
        .iter()
        .zip(&b.rows)
        .map(|(x, y)| {
            vec![
                x.k_per_vcpu.to_string(),
                f1(x.reset_p50_us),
                f1(y.reset_p50_us),
                rx(per(x.reset_p50_us, y.reset_p50_us)),
            ]
        })
        .collect();
    print_table(&head, &rows);
}

/// Cells of every combination × k; a failed combination is one row of `-` and FAILED.
fn table(sweep: &Sweep<Run>) -> Vec<Vec<String>> {
    let mut table = Vec::new();
    for row in &sweep.sweep {
        let settings: Vec<String> = row
            .settings
            .iter()
            .map(|s| s.split_once('=').map_or(s.as_str(), |(_, v)| v).to_string())
            .collect();
        match &row.outcome {
            RowOutcome::Done(runs) => {
                for r in runs.all() {
                    for k in &r.rows {
                        let mut cells = settings.clone();
                        cells.extend([
                            k.k_per_vcpu.to_string(),
                            f1(k.dirty_pages),
                            f1(k.reset_p50_us),
                            f1(k.reset_p99_us),
                            rx(k.ratio_reset_over_floor),
                            rx(k.ratio_full_over_reset),
                            format!("{:.0}", k.execs_per_s),
                            f2(k.harvest_mean_us),
                            f2(k.rearm_mean_us),
                            f2(k.copy_mean_us),
                        ]);
                        table.push(cells);
                    }
                }
            }
            RowOutcome::Failed(_) => {
                let mut cells = settings.clone();
                cells.extend(std::iter::repeat_n("-".to_string(), 9));
                cells.push("FAILED".into());
                table.push(cells);
            }
        }
    }
    table
}

/// The sweep's table: one row per combination and k.
pub(super) fn print_sweep(a: &SnapshotPerfArgs, sweep: &Sweep<Run>) {
    let varied = &sweep.varied;
    let rows = table(sweep);
    println!(
        "snapshot-perf sweep: {} per vCPU, {} iterations per k; varied: {}; one run per combination, all in this process",
        slat_workload::format_size(a.work.bytes),
        a.iterations,
        varied.join(", ")
    );
    let mut head: Vec<String> = varied.iter().map(|k| k.to_string()).collect();
    head.extend(
        [
            "k/vCPU",
            "dirty pages",
            "reset p50 us",
            "p99 us",
            "reset/floor",
            "full/reset",
            "execs/s",
            "harvest us",
            "re-arm us",
            "copy us",
        ]
        .map(String::from),
    );
    print_table(&head, &rows);
    println!("{FOOTNOTE}");
}
