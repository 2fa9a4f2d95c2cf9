//! The reports through the `slat` binary: every benchmark's `--json` document validates
//! against its schema in `crates/slat-cli/schema/`, `--repeat` adds consistent medians, minima
//! and maxima, and `--plot` writes an SVG with the expected series. Small sizes, so the file
//! runs in a few seconds.
//!
//! The schemas are checked with the `jsonschema` crate (`common/schema.rs`).

use crate::common;

use common::schema::{def_errors, errors, validate};
use common::{json, ok, slat};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
fn the_validator_rejects_what_it_should() {
    let doc = json(&["dirty-log-perf", "-v", "1", "-b", "4M", "-i", "2"]);
    let mut bad = doc.clone();
    bad["iterations"][0]["dirty_pages"] = Value::from("many");
    let errs = errors("dirty-log-perf.json", &bad);
    assert!(errs.iter().any(|e| e.contains("dirty_pages")), "{errs:?}");
    let mut bad = doc;
    bad.as_object_mut().unwrap().remove("host");
    let errs = errors("dirty-log-perf.json", &bad);
    assert!(errs.iter().any(|e| e.contains("host")), "{errs:?}");
}

#[test]
fn dirty_log_perf_json_matches_its_schema_on_both_machines() {
    for backend in ["sim", "kvm"] {
        let d = json(&[
            "dirty-log-perf",
            "-v",
            "1",
            "-b",
            "4M",
            "-i",
            "2",
            "--backend",
            backend,
        ]);
        validate("dirty-log-perf.json", &d);
        assert_eq!(d["schema_version"], 1);
        let privilege = &d["host"]["kvm_guest_privilege"];
        assert_eq!(privilege.is_null(), backend == "sim", "{d:#}");
    }
    let d = json(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "--dirty-ring",
        "256",
        "--backend",
        "kvm",
    ]);
    validate("dirty-log-perf.json", &d);
    assert!(d["iterations"][0]["reset_dirty_rings_time_s"].is_number());
}

#[test]
fn concurrent_harvest_json_matches_its_schema_on_both_machines() {
    for backend in ["sim", "kvm"] {
        for log in [
            &["-g"][..],
            &["--clear-chunk", "64"],
            &["--dirty-ring", "256"],
        ] {
            let mut args = vec![
                "dirty-log-perf",
                "-b",
                "4M",
                "-i",
                "3",
                "--concurrent",
                "--harvest-interval",
                "1",
                "--backend",
                backend,
            ];
            args.extend_from_slice(log);
            let d = json(&args);
            validate("dirty-log-perf.json", &d);
            let c = &d["concurrent"];
            assert_eq!(c["concurrent_harvests"].as_array().map(Vec::len), Some(3));
            assert_eq!(c["quiet"]["harvests"], 2, "{d:#}");
            // The quiet passes were timed: every machine records something in them (every
            // page's first write after a harvest faults, or exits).
            assert!(
                c["quiet"]["write_latency"]["count"].as_u64() > Some(0),
                "{d:#}"
            );
            assert_eq!(c["quiet"]["stalls"].is_object(), backend == "kvm", "{d:#}");
            // Every pass writes all 1024 pages once; a harvest (a chunked CLEAR too) that
            // failed to re-protect some would see them missing from the next one. (A ring may
            // hold a page twice: entries reaped on a ring-full exit are counted too.)
            for it in d["iterations"].as_array().expect("iterations") {
                let n = it["dirty_pages"].as_u64().unwrap_or(0);
                let ring = log[0] == "--dirty-ring";
                assert!(
                    n == 1024 || (ring && n > 1024),
                    "{log:?} on {backend}: {it:#}"
                );
            }
        }
    }
}

#[test]
fn a_kvm_sweep_varies_the_harvest() {
    let d = json(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "-i",
        "2",
        "--backend",
        "kvm",
        "--vary",
        "log=get,clear,ring",
        "--vary",
        "vcpus=1,2",
    ]);
    validate("sweep.json", &d);
    let rows = d["sweep"].as_array().expect("rows");
    assert_eq!(rows.len(), 6);
    assert_eq!(
        rows[4]["settings"],
        serde_json::json!(["log=ring", "vcpus=1"])
    );
    assert!(rows[4]["result"]["config"]["dirty_ring"].is_u64());
    assert_eq!(rows[0]["result"]["config"]["manual_protect"], false);
}

#[test]
fn demand_paging_json_matches_its_schema() {
    validate("demand-paging.json", &json(&["demand-paging", "-b", "4M"]));
    validate(
        "demand-paging.json",
        &json(&["demand-paging", "-b", "4M", "--backend", "kvm"]),
    );
}

#[test]
fn uffd_and_pinning_reports_match_their_schemas() {
    let d = json(&["demand-paging", "-b", "4M", "-u", "MISSING", "-c", "0"]);
    assert!(d["uffd"].is_object());
    validate("demand-paging.json", &d);
    let d = json(&["demand-paging", "-b", "4M", "-u", "MINOR", "-s", "shmem"]);
    validate("demand-paging.json", &d);
    validate(
        "dirty-log-perf.json",
        &json(&["dirty-log-perf", "-b", "4M", "-c", "0"]),
    );
    validate(
        "access-tracking-perf.json",
        &json(&["access-tracking-perf", "-b", "4M", "-c", "0", "-w", "1"]),
    );
}

#[test]
fn dirty_log_test_prints_one_document_for_two_machines() {
    let args = [
        "dirty-log-test",
        "-b",
        "4M",
        "-i",
        "2",
        "-I",
        "5",
        "-M",
        "clear-log",
    ];
    validate("dirty-log-test.json", &json(&args));
    let mut both = args.to_vec();
    both.extend(["--backend", "sim,kvm"]);
    let d = json(&both);
    validate("dirty-log-test.json", &d);
    assert_eq!(d["runs"].as_array().map(Vec::len), Some(2), "{d:#}");
    assert_eq!(d["pass"], true);
}

#[test]
fn comparison_and_sweep_json_match_their_schemas() {
    let d = json(&["dirty-log-perf", "-b", "4M", "--backend", "sim,kvm"]);
    validate("comparison.json", &d);
    for run in d["runs"].as_array().unwrap() {
        // The runs inside carry no envelope of their own: check the report part.
        let e = def_errors("dirty-log-perf.json", "report", run);
        assert!(e.is_empty(), "{e:?}");
    }
    let rows: Vec<&str> = d["comparison"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["metric"].as_str().unwrap())
        .collect();
    assert!(rows.contains(&"iteration 2 dirty memory"), "{rows:?}");
    validate(
        "comparison.json",
        &json(&["demand-paging", "-b", "4M", "--backend", "sim,kvm"]),
    );
    let d = json(&["dirty-log-perf", "-b", "4M", "--vary", "fast-pf=on,off"]);
    validate("sweep.json", &d);
    assert_eq!(d["sweep"][1]["settings"][0], "fast-pf=off");
}

#[test]
fn the_other_benchmarks_json_match_their_schemas() {
    validate(
        "access-tracking-perf.json",
        &json(&["access-tracking-perf", "-b", "4M", "--idle-check", "warn"]),
    );
    validate(
        "page-table-test.json",
        &json(&["page-table-test", "-b", "4M"]),
    );
    let d = json(&[
        "migrate-perf",
        "-v",
        "1",
        "-b",
        "4M",
        "--warmup",
        "20",
        "--resume-ms",
        "0",
    ]);
    validate("migrate.json", &d);
    assert_eq!(d["benchmark"], "migrate-perf");
    assert!(d["destination"]["verification"]["ok"].as_bool().unwrap());
    // Pure post-copy: both sides' post-copy figures, every page sent once.
    let d = json(&[
        "migrate-perf",
        "-v",
        "1",
        "-b",
        "4M",
        "--warmup",
        "20",
        "--resume-ms",
        "0",
        "--postcopy-after",
        "0",
    ]);
    validate("migrate.json", &d);
    let (p, dp) = (&d["postcopy"], &d["destination"]["postcopy"]);
    assert_eq!(p["discarded_pages"], 1024, "{d:#}");
    let sent = p["background_pages"].as_u64().unwrap() + p["preempt_pages"].as_u64().unwrap();
    assert_eq!(sent, 1024);
    assert!(dp["blocktime_p99_s"].as_f64().is_some());
    assert!(d["destination"]["verification"]["ok"].as_bool().unwrap());
}

fn summary<'a>(d: &'a Value, metric: &str) -> &'a Value {
    d["summary"]
        .as_array()
        .expect("summary")
        .iter()
        .find(|s| s["metric"] == metric)
        .unwrap_or_else(|| panic!("no {metric} in {d:#}"))
}

#[test]
fn repeat_reports_consistent_medians() {
    let d = json(&["dirty-log-perf", "-b", "4M", "-i", "3", "--repeat", "3"]);
    validate("repeated.json", &d);
    assert_eq!(d["repeat"], 3);
    assert_eq!(d["runs"].as_array().map(Vec::len), Some(3));
    for s in d["summary"].as_array().unwrap() {
        if s["runs"] == 0 {
            continue;
        }
        let (lo, md, hi) = (
            s["min"].as_f64().unwrap(),
            s["median"].as_f64().unwrap(),
            s["max"].as_f64().unwrap(),
        );
        assert!(lo <= md && md <= hi, "{s}");
    }
    // The median is the middle of the three runs' own figures.
    let s = summary(&d, "populate memory");
    let mut xs: Vec<f64> = d["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["populate_memory_time_s"].as_f64().unwrap())
        .collect();
    xs.sort_by(f64::total_cmp);
    assert_eq!(s["median"].as_f64(), Some(xs[1]));
    assert_eq!(s["min"].as_f64(), Some(xs[0]));
    assert_eq!(s["max"].as_f64(), Some(xs[2]));
    assert_eq!(s["better"], "lower");

    let d = json(&["demand-paging", "-b", "4M", "--repeat", "2"]);
    validate("repeated.json", &d);
    assert_eq!(
        summary(&d, "overall demand paging rate")["better"],
        "higher"
    );

    let out = ok(&["dirty-log-perf", "-b", "4M", "--repeat", "2"]);
    assert_eq!(
        out.matches("Iteration 2 dirty memory time:").count(),
        2,
        "{out}"
    );
    for line in [
        "Summary over 2 runs",
        "median",
        "spread",
        "lower",
        "1.00x is native speed",
    ] {
        assert!(out.contains(line), "{line}\n{out}");
    }
}

fn temp_svg(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("slat-plot-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn read_svg(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert!(
        s.trim_start().starts_with("<svg") && s.trim_end().ends_with("</svg>"),
        "{s}"
    );
    s
}

#[test]
fn plot_writes_the_iteration_series() {
    let p = temp_svg("dlp.svg");
    let out = ok(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "-i",
        "3",
        "--plot",
        p.to_str().unwrap(),
    ]);
    assert!(out.contains("Iteration 3 dirty memory time:"), "{out}");
    let svg = read_svg(&p);
    for series in [
        "dirty memory (guest pass)",
        "get dirty log (harvest)",
        "clear dirty log",
        "native memory (host pass)",
    ] {
        assert!(svg.contains(series), "{series} missing");
    }
    // One line per series.
    assert!(svg.matches("<polyline").count() >= 4, "{svg}");
}

#[test]
fn plot_writes_a_sweep_and_a_migration() {
    let p = temp_svg("sweep.svg");
    ok(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "--vary",
        "vcpus=1,2",
        "--plot",
        p.to_str().unwrap(),
    ]);
    let svg = read_svg(&p);
    for label in [
        "vcpus=1",
        "vcpus=2",
        "iteration 2 dirty memory",
        "get dirty log avg",
    ] {
        assert!(svg.contains(label), "{label} missing");
    }
    let p = temp_svg("migrate.svg");
    ok(&[
        "migrate-perf",
        "-v",
        "1",
        "-b",
        "4M",
        "--warmup",
        "20",
        "--resume-ms",
        "0",
        "--plot",
        p.to_str().unwrap(),
    ]);
    let svg = read_svg(&p);
    for series in ["pages owed", "throttle"] {
        assert!(svg.contains(series), "{series} missing");
    }
}

#[test]
fn repeat_works_on_the_other_benchmarks() {
    let d = json(&[
        "access-tracking-perf",
        "-b",
        "4M",
        "--idle-check",
        "warn",
        "--repeat",
        "2",
    ]);
    validate("repeated.json", &d);
    assert_eq!(summary(&d, "writing to idle memory")["runs"], 2);
    let d = json(&["page-table-test", "-b", "4M", "--repeat", "2"]);
    validate("repeated.json", &d);
    assert_eq!(summary(&d, "create mappings")["runs"], 2);
    let d = json(&[
        "migrate-perf",
        "-v",
        "1",
        "-b",
        "4M",
        "--warmup",
        "20",
        "--resume-ms",
        "0",
        "--repeat",
        "2",
    ]);
    validate("repeated.json", &d);
    assert_eq!(summary(&d, "bandwidth")["better"], "higher");
    let d = json(&[
        "dirty-log-test",
        "-b",
        "4M",
        "-i",
        "2",
        "-I",
        "5",
        "-M",
        "dirty-log",
        "--repeat",
        "2",
    ]);
    validate("repeated.json", &d);
    assert_eq!(summary(&d, "lost pages")["max"], 0.0);
}

#[test]
fn repeat_and_plot_refuse_what_they_cannot_do() {
    for args in [
        vec!["dirty-log-test", "-b", "4M", "--plot", "x.svg"],
        vec!["dirty-log-perf", "-b", "4M", "--repeat", "0"],
        vec![
            "dirty-log-perf",
            "-b",
            "4M",
            "--backend",
            "sim,kvm",
            "--vary",
            "vcpus=1,2",
        ],
    ] {
        let (code, out, err) = slat(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
}

/// `--repeat` runs every `--vary` row and every `--backend` machine N times: each row's and
/// each machine's result is then that configuration's summary and runs.
#[test]
fn repeat_applies_to_every_row_and_every_machine() {
    let d = json(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "--repeat",
        "2",
        "--vary",
        "fast-pf=on,off",
    ]);
    validate("sweep.json", &d);
    let rows = d["sweep"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    for row in rows {
        assert_eq!(row["result"]["repeat"], 2, "{row:#}");
        assert_eq!(row["result"]["runs"].as_array().map(Vec::len), Some(2));
    }
    let d = json(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "--repeat",
        "2",
        "--backend",
        "sim,kvm",
    ]);
    validate("comparison.json", &d);
    for run in d["runs"].as_array().expect("runs") {
        validate("repeated.json", &with_envelope(&d, run));
    }
}

/// A run inside a document, with the document's envelope, to check it as a document.
fn with_envelope(doc: &Value, inner: &Value) -> Value {
    let mut v = inner.clone();
    for k in ["schema_version", "slat_version", "host"] {
        v[k] = doc[k].clone();
    }
    v
}

#[test]
fn an_unwritable_plot_is_refused_before_the_run() {
    let (code, out, err) = slat(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "--plot",
        "/nonexistent-dir/x.svg",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--plot"), "{err}");
}

/// The `points` attribute of every `tag` element, as (x, y) pairs.
fn shapes(svg: &str, tag: &str) -> Vec<Vec<(f64, f64)>> {
    svg.split(&format!("<{tag} "))
        .skip(1)
        .filter_map(|el| {
            let pts = el.split("points=\"").nth(1)?.split('"').next()?;
            Some(
                pts.split_whitespace()
                    .filter_map(|p| {
                        let (x, y) = p.split_once(',')?;
                        Some((x.parse().ok()?, y.parse().ok()?))
                    })
                    .collect(),
            )
        })
        .collect()
}

/// `--repeat 3 --plot`: every line is the median of the runs and carries a band from the
/// minimum to the maximum, and the median lies inside its band.
#[test]
fn a_repeated_plot_draws_the_spread() {
    let p = temp_svg("spread.svg");
    ok(&[
        "dirty-log-perf",
        "-b",
        "4M",
        "-i",
        "3",
        "--repeat",
        "3",
        "--plot",
        p.to_str().unwrap(),
    ]);
    let svg = read_svg(&p);
    assert!(svg.contains("median of 3 runs"), "{svg}");
    let bands = shapes(&svg, "polygon");
    // The series' lines (the legend's marks are paths, not polylines).
    let lines: Vec<_> = shapes(&svg, "polyline")
        .into_iter()
        .filter(|l| l.len() == 3)
        .collect();
    assert_eq!(bands.len(), 4, "one band per series:\n{svg}");
    assert_eq!(lines.len(), 4, "one line per series:\n{svg}");
    let mut wide = 0;
    for (band, line) in bands.iter().zip(&lines) {
        for &(x, y) in line {
            let ys: Vec<f64> = band
                .iter()
                .filter(|p| (p.0 - x).abs() < 1.0)
                .map(|p| p.1)
                .collect();
            assert_eq!(ys.len(), 2, "band has its min and max at x={x}: {band:?}");
            let (lo, hi) = (ys[0].min(ys[1]), ys[0].max(ys[1]));
            assert!(
                lo - 1.0 <= y && y <= hi + 1.0,
                "median {y} outside [{lo}, {hi}]"
            );
            if hi - lo > 0.5 {
                wide += 1;
            }
        }
    }
    // Three timed runs are never identical everywhere: some band has a height.
    assert!(wide > 0, "every band is flat:\n{svg}");
}

/// `--vary` and `--backend sim,kvm` draw bars of the headline metrics with error bars.
#[test]
fn sweeps_and_comparisons_plot_bars_with_error_bars() {
    let p = temp_svg("bars.svg");
    ok(&[
        "demand-paging",
        "-b",
        "4M",
        "--backend",
        "sim,kvm",
        "--repeat",
        "2",
        "--plot",
        p.to_str().unwrap(),
    ]);
    let svg = read_svg(&p);
    for label in ["sim", "kvm", "total guest execution time", "min to max"] {
        assert!(svg.contains(label), "{label} missing:\n{svg}");
    }
    // Two bars, each with an error bar (a path of six points).
    let whiskers = shapes(&svg, "polyline")
        .into_iter()
        .filter(|l| l.len() == 6)
        .count();
    assert_eq!(whiskers, 2, "{svg}");
}

#[test]
fn migrate_repeat_json_matches_the_schemas() {
    use std::io::BufRead;
    let mut dest = Command::new(env!("CARGO_BIN_EXE_slat"))
        .args([
            "migrate-listen",
            "--listen",
            "127.0.0.1:0",
            "--resume-ms",
            "0",
            "--repeat",
            "2",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run slat migrate-listen");
    let mut err = std::io::BufReader::new(dest.stderr.take().expect("stderr"));
    let mut line = String::new();
    err.read_line(&mut line).expect("first line");
    let addr = line
        .split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let d = json(&[
        "migrate", "--to", &addr, "-b", "4M", "--warmup", "20", "--repeat", "2",
    ]);
    validate("repeated.json", &d);
    assert_eq!(d["benchmark"], "migrate");
    for run in d["runs"].as_array().expect("runs") {
        let errs = def_errors("migrate.json", "migration", run);
        assert!(errs.is_empty(), "{}\n{run:#}", errs.join("\n"));
    }
    // (Its progress lines, which name the port, are quiet under --json: read as text.)
    let out = dest.wait_with_output().expect("migrate-listen");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("Verification: OK").count(), 2, "{text}");
    assert!(text.contains("Summary over 2 runs"), "{text}");
}
