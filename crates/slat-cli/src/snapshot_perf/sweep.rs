//! `slat snapshot-perf --vary KEY=V1,V2,...`: one full run over the `-k` list per combination
//! of the listed settings (the cross product of `crate::sweep`), in this process, and one
//! table whose rows are combination × k.

use super::{check, f1, k_list, measure, rx, Run, SnapshotPerfArgs, NAME};
use crate::args::{BackendArg, LogKind};
use crate::error::{CliError, CliResult};
use crate::output::{print_json, print_table, FallibleRow, RowOutcome};
use crate::report::quiet;
use serde::Serialize;

/// A setting snapshot-perf's `--vary` can sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VaryKey {
    /// `-v`.
    Vcpus,
    /// The harvest: `-g` (get), manual protect (clear), `--dirty-ring` (ring).
    Log,
    /// `-a` (random) or not (seq).
    Order,
    /// `--backend` (one machine per row).
    Backend,
}

/// The keys, by name, as `--vary` spells them.
const KEYS: [(&str, VaryKey); 4] = [
    ("vcpus", VaryKey::Vcpus),
    ("log", VaryKey::Log),
    ("order", VaryKey::Order),
    ("backend", VaryKey::Backend),
];

impl VaryKey {
    /// The key as written in `--vary`.
    pub fn name(self) -> &'static str {
        KEYS.iter()
            .find(|(_, k)| *k == self)
            .map_or("?", |(n, _)| *n)
    }
}

/// One value of a varied setting, parsed once when the flag is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapSetting {
    /// `vcpus=N`.
    Vcpus(u32),
    /// `log=get|clear|ring`.
    Log(LogKind),
    /// `order=seq|random` (true: random).
    Random(bool),
    /// `backend=sim|kvm`.
    Backend(BackendArg),
}

impl SnapSetting {
    /// The value as written on the command line.
    fn value(self) -> String {
        match self {
            SnapSetting::Vcpus(n) => n.to_string(),
            SnapSetting::Log(LogKind::Get) => "get".into(),
            SnapSetting::Log(LogKind::Clear) => "clear".into(),
            SnapSetting::Log(LogKind::Ring) => "ring".into(),
            SnapSetting::Random(false) => "seq".into(),
            SnapSetting::Random(true) => "random".into(),
            SnapSetting::Backend(b) => b.name().into(),
        }
    }

    fn key(self) -> VaryKey {
        match self {
            SnapSetting::Vcpus(_) => VaryKey::Vcpus,
            SnapSetting::Log(_) => VaryKey::Log,
            SnapSetting::Random(_) => VaryKey::Order,
            SnapSetting::Backend(_) => VaryKey::Backend,
        }
    }

    /// `key=value`.
    fn label(self) -> String {
        format!("{}={}", self.key().name(), self.value())
    }

    /// Applies the setting to a row's flags.
    fn apply(self, a: &mut SnapshotPerfArgs) {
        match self {
            SnapSetting::Vcpus(n) => a.work.vcpus = n,
            SnapSetting::Log(k) => a.log.set_kind(k),
            SnapSetting::Random(r) => a.random = r,
            SnapSetting::Backend(b) => a.backend = vec![b],
        }
    }
}

fn one_of<T: Copy>(key: &str, v: &str, names: &[(&str, T)]) -> Result<T, String> {
    names
        .iter()
        .find(|(n, _)| *n == v)
        .map(|(_, t)| *t)
        .ok_or_else(|| {
            let all: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
            format!("--vary {key}: `{v}` is not one of {}", all.join(", "))
        })
}

fn parse_value(key: VaryKey, k: &str, v: &str) -> Result<SnapSetting, String> {
    Ok(match key {
        VaryKey::Vcpus => match v.parse::<u32>() {
            Ok(n) if (1..=512).contains(&n) => SnapSetting::Vcpus(n),
            _ => return Err(format!("--vary {k}: `{v}` is not a count from 1 to 512")),
        },
        VaryKey::Log => SnapSetting::Log(one_of(
            k,
            v,
            &[
                ("get", LogKind::Get),
                ("clear", LogKind::Clear),
                ("ring", LogKind::Ring),
            ],
        )?),
        VaryKey::Order => SnapSetting::Random(one_of(k, v, &[("seq", false), ("random", true)])?),
        VaryKey::Backend => SnapSetting::Backend(one_of(
            k,
            v,
            &[("sim", BackendArg::Sim), ("kvm", BackendArg::Kvm)],
        )?),
    })
}

/// Parses `--vary KEY=V1,V2,...` with the shared parser of `crate::sweep`.
pub fn parse_vary(s: &str) -> Result<(VaryKey, Vec<SnapSetting>), String> {
    crate::sweep::parse_keyed(s, &KEYS, parse_value)
}

/// The `--vary` JSON document.
#[derive(Serialize)]
struct SweepDoc {
    benchmark: &'static str,
    /// The varied keys, in the order given (the first varies slowest).
    varied: Vec<&'static str>,
    sweep: Vec<FallibleRow<Run>>,
}

/// Every row's flags and label, each checked before the first run: a refusal at row 5 after
/// minutes of measuring would waste them.
fn rows(
    a: &SnapshotPerfArgs,
    combos: &[Vec<SnapSetting>],
) -> CliResult<Vec<(SnapshotPerfArgs, Vec<String>)>> {
    let mut out = Vec::new();
    for combo in combos {
        let mut b = a.clone();
        b.vary.clear();
        for v in combo {
            v.apply(&mut b);
        }
        let label: Vec<String> = combo.iter().map(|v| v.label()).collect();
        check(&b).map_err(|e| CliError::bad(format!("--vary row {}: {e}", label.join(" "))))?;
        out.push((b, label));
    }
    Ok(out)
}

/// `--vary`: one run over the `-k` list per combination, one table.
pub fn run(a: &SnapshotPerfArgs) -> CliResult {
    if a.out.repeat > 1 {
        return Err(CliError::bad(
            "--repeat with --vary: a sweep runs each row once; drop one of them",
        ));
    }
    if a.backend.len() > 1 {
        return Err(CliError::bad(
            "--backend with two machines and --vary: vary the machine with --vary backend=sim,kvm",
        ));
    }
    if a.out.plot.is_some() {
        return Err(CliError::bad(
            "--plot: snapshot-perf has no series to draw; drop --plot",
        ));
    }
    let keys: Vec<VaryKey> = a.vary.iter().map(|(k, _)| *k).collect();
    let names: Vec<&'static str> = keys.iter().map(|k| k.name()).collect();
    crate::sweep::check_distinct_names(&names).map_err(CliError::bad)?;
    let axes: Vec<&[SnapSetting]> = a.vary.iter().map(|(_, v)| &v[..]).collect();
    let combos = crate::driver::vary::cross(&axes);
    let runs = rows(a, &combos)?;
    let q = quiet(a.out.json);
    let mut table = Vec::new();
    let mut docs = Vec::new();
    let mut backends = Vec::new();
    let mut failed = 0;
    for (n, ((b, label), combo)) in runs.into_iter().zip(&combos).enumerate() {
        if !q {
            eprintln!(
                "[slat] sweep {}/{}: {}",
                n + 1,
                combos.len(),
                label.join(" ")
            );
        }
        let kind = b.backend[0];
        if !backends.contains(&kind) {
            backends.push(kind);
        }
        let settings: Vec<String> = combo.iter().map(|v| v.value()).collect();
        let outcome = match measure(&b, kind, &k_list(&b)) {
            Ok(r) => {
                for k in &r.rows {
                    let mut row = settings.clone();
                    row.extend([
                        k.k_per_vcpu.to_string(),
                        f1(k.dirty_pages),
                        f1(k.reset_p50_us),
                        f1(k.reset_p99_us),
                        rx(k.ratio_reset_over_floor),
                        rx(k.ratio_full_over_reset),
                    ]);
                    table.push(row);
                }
                RowOutcome::Done(Box::new(r))
            }
            Err(e) => {
                failed += 1;
                if !q {
                    eprintln!("[slat] sweep {}/{} failed: {e}", n + 1, combos.len());
                }
                let mut row = settings.clone();
                row.extend(std::iter::repeat_n("-".to_string(), 5));
                row.push("FAILED".into());
                table.push(row);
                RowOutcome::Failed(e.to_string())
            }
        };
        docs.push(FallibleRow {
            settings: label,
            outcome,
        });
    }
    if a.out.json {
        let doc = SweepDoc {
            benchmark: NAME,
            varied: names,
            sweep: docs,
        };
        print_json(&doc, &backends)?;
    } else {
        print_sweep(a, &names, &table);
    }
    if failed > 0 {
        return Err(CliError::Runtime(format!(
            "--vary: {failed} of {} rows failed",
            combos.len()
        )));
    }
    Ok(())
}

fn print_sweep(a: &SnapshotPerfArgs, varied: &[&str], rows: &[Vec<String>]) {
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
    print_table(&head, rows);
    println!("Each k runs on a machine of k pages per vCPU; floor = memcpy of as many pages between two host buffers; full/reset = full-copy reset p50 over this reset's p50.");
}
