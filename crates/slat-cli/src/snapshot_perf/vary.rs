//! snapshot-perf's `--vary` table (one full run over the `-k` list per combination, one table
//! whose rows are combination × k).

use super::{f1, rx, Run, SnapshotPerfArgs};
use crate::args::{BackendArg, LogKind};
use crate::driver::vary::{count_in, names, pick, Key, Values};
use crate::output::{print_table, RowOutcome, Sweep};
use crate::vary_key;

/// The table.
pub const VARY: &[Key<SnapshotPerfArgs>] = &[
    vary_key!(
        "vcpus",
        "-v",
        Values::Text("1-512", |v| count_in(v, 1, 512).map(drop)),
        |a, v| { a.work.vcpus = count_in(v, 1, 512)? as u32 }
    ),
    vary_key!(
        "log",
        "-g, --dirty-ring, manual protect",
        Values::OneOf(names::<LogKind>),
        |a, v| { a.log.set_kind(pick(v)?) }
    ),
    vary_key!(
        "order",
        "-a",
        Values::OneOf(|| vec!["seq".into(), "random".into()]),
        |a, v| { a.random = v == "random" }
    ),
    vary_key!(
        "backend",
        "--backend",
        Values::OneOf(names::<BackendArg>),
        |a, v| { a.backend = vec![pick(v)?] }
    ),
];

/// Examples under the keys in `--help`.
pub const EXAMPLES: &str = "Each row is a full run over the -k list; not with --repeat. For \
example: --vary log=get,clear,ring --vary vcpus=1,2.";

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
                        ]);
                        table.push(cells);
                    }
                }
            }
            RowOutcome::Failed(_) => {
                let mut cells = settings.clone();
                cells.extend(std::iter::repeat_n("-".to_string(), 5));
                cells.push("FAILED".into());
                table.push(cells);
            }
        }
    }
    table
}

/// The sweep's table: one row per combination and k.
pub fn print_sweep(a: &SnapshotPerfArgs, sweep: &Sweep<Run>) {
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
        ]
        .map(String::from),
    );
    print_table(&head, &rows);
    println!("Each k runs on a machine of k pages per vCPU; floor = memcpy of as many pages between two host buffers; full/reset = full-copy reset p50 over this reset's p50.");
}
