//! dirty-rate's text report.

use super::*;
use crate::output::{print_table, ratio_cell, spread_cell, unit_cell};

/// `Sample 2/3: 1.000412 s, 10004 pages, 9999.9 pages/s (39.06 MiB/s); vCPU 0 5000, vCPU 1 5000`
pub(super) fn sample_line(i: usize, of: u32, s: &Sample) -> String {
    let p = s.pages_per_s();
    let mut line = format!(
        "Sample {}/{of}: {:.6} s, {} pages, {:.1} pages/s ({:.2} MiB/s)",
        i + 1,
        s.window.as_secs_f64(),
        s.pages,
        p,
        mib(p)
    );
    if !s.per_vcpu.is_empty() && s.per_vcpu.len() <= MAX_SAMPLE_COLUMNS {
        let each: Vec<String> = (0..s.per_vcpu.len())
            .map(|v| format!("vCPU {v} {:.1}", s.vcpu_pages_per_s(v).unwrap_or(0.0)))
            .collect();
        line.push_str(&format!("; {}", each.join(", ")));
    }
    if s.unattributed != 0 {
        line.push_str(&format!("; {} pages unattributed", s.unattributed));
    }
    line
}

pub(super) fn opt(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

/// The run's first lines, printed before the windows.
pub(super) fn print_head(a: &DirtyRateArgs, kind: BackendArg, w: &GuestWorkload) {
    println!(
        "Dirty rate ({}{}): {} vCPU{} x {}, {}, {} window{} of {} ms",
        kind.name(),
        format_name(kind, a.machine.format)
            .map(|f| format!(", {f}"))
            .unwrap_or_default(),
        a.vcpus,
        if a.vcpus == 1 { "" } else { "s" },
        format_size(a.bytes),
        match a.mode {
            RateMode::Ring => format!(
                "ring mode (dirty rings of {} entries per vCPU)",
                a.ring_entries()
            ),
            RateMode::Bitmap => "bitmap mode (GET + CLEAR, manual protect)".into(),
        },
        a.samples,
        if a.samples == 1 { "" } else { "s" },
        a.sample.duration().as_millis(),
    );
    println!("Workload: {}", w.note);
    println!(
        "Counted: distinct pages dirtied per window (a page rewritten within a window counts once)"
    );
    let _ = std::io::stdout().flush();
}

pub(super) fn print_run(r: &Run) {
    println!(
        "Dirty rate: {:.1} pages/s ({:.2} MiB/s); windows from {:.1} to {:.1} pages/s",
        r.pages_per_s, r.mib_per_s, r.min_sample_pages_per_s, r.max_sample_pages_per_s
    );
    match r.expected_pages_per_s {
        Some(e) => println!(
            "Expected: {e:.1} pages/s{}; measured/expected {}",
            if r.expected_capped {
                " (capped: -b is smaller than a window's writes, every page is dirtied once per window)"
            } else {
                ""
            },
            ratio_cell(r.ratio_measured_over_expected)
        ),
        None => println!("Expected: not known ({})", r.workload.kind),
    }
    if r.saturated {
        println!("Saturated: every page of guest memory was dirty in every window, so the guest dirties at least this rate (a larger -b or a shorter --sample-ms measures more)");
    }
    if let Some(w) = r.guest_writes_per_s {
        println!("Guest writes (the guest's own count over its run, every write): {w:.1} writes/s");
    }
    let by = match r.per_vcpu_by {
        "ring" => "from the dirty rings: each entry names its vCPU",
        "region" => "from the layout: in bitmap mode each vCPU writes only its own region",
        _ => "none",
    };
    println!("Per vCPU ({by}):");
    let head = ["vCPU", "pages/s", "expected", "measured/expected"];
    let rows: Vec<Vec<String>> = r
        .per_vcpu
        .iter()
        .map(|v| {
            vec![
                v.vcpu.to_string(),
                format!("{:.1}", v.pages_per_s),
                opt(v.expected_pages_per_s),
                ratio_cell(v.ratio),
            ]
        })
        .collect();
    print_table(&head, &rows);
    if r.unattributed_pages != 0 {
        println!(
            "{} pages were logged by no vCPU the log could name: not in the per-vCPU figures",
            r.unattributed_pages
        );
    }
    println!();
}

pub(super) fn print_summary(r: &Report) {
    println!(
        "Summary over {} run{} (spread = (max - min) / median):",
        r.runs.len(),
        if r.runs.len() == 1 { "" } else { "s" }
    );
    let head = ["backend", "metric", "median", "min", "max", "spread"];
    let mut rows = Vec::new();
    for s in &r.summary {
        for m in [&s.pages_per_s, &s.ratio_measured_over_expected] {
            let f = |x| unit_cell(m.unit, x);
            let metric = format!("{} ({})", m.metric, m.unit);
            let (md, lo, hi) = (f(m.median), f(m.min), f(m.max));
            rows.push(vec![
                s.backend.to_string(),
                metric,
                md,
                lo,
                hi,
                spread_cell(m.spread),
            ]);
        }
    }
    print_table(&head, &rows);
}
