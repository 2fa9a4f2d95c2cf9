//! `slat dirty-rate` through the binary: on the simulated machine the measured dirty rate is
//! within 10% of the paced guest's known rate in both modes, overall and per vCPU; a guest
//! that rewrites its pages within a window counts each page once; `--json` validates against
//! `schema/dirty-rate.json`; bad input exits 2 with one line; on `/dev/kvm` (skipped with the
//! reason when absent) the rate is measured with no expectation.

use crate::common;

use common::schema;
use common::{json, ok, slat};
use serde_json::Value;

const FILE: &str = "dirty-rate.json";

/// Runs `dirty-rate args --json`, checks the schema, returns the document and the command
/// line (for failure messages: every parameter of the run).
fn measure(args: &[&str]) -> (Value, String) {
    let mut v = vec!["dirty-rate"];
    v.extend_from_slice(args);
    let d = json(&v);
    schema::validate(FILE, &d);
    (d, format!("slat {} --json", v.join(" ")))
}

/// Asserts `x` is within 10% of `want`, naming the run on failure.
fn within_10pct(what: &str, x: f64, want: f64, cmd: &str, run: &Value) {
    assert!(
        (x - want).abs() <= 0.10 * want,
        "{what}: measured {x:.1} pages/s, expected {want:.1} (more than 10% apart)\n\
         command: {cmd}\nrun: {run:#}"
    );
}

/// The paced guest's rate, measured in `mode`: within 10% overall and per vCPU.
fn known_rate_is_measured(mode: &str, by: &str) {
    // 2 vCPUs x 5000 writes/s: light enough for a loaded 2-core host. 500 ms windows are
    // 2500 writes per vCPU (the pacer hands out writes 64 at a time: < 3% quantization), in
    // 16384-page regions, so a pass never wraps within a window.
    let (d, cmd) = measure(&[
        "--mode",
        mode,
        "-v",
        "2",
        "-b",
        "64M",
        "--write-rate",
        "5k",
        "--sample-ms",
        "500",
        "--samples",
        "3",
    ]);
    let run = &d["runs"][0];
    assert_eq!(run["per_vcpu_by"], by, "{cmd}");
    assert_eq!(run["config"]["mode"], mode);
    assert_eq!(run["workload"]["known_rate"], true);
    assert_eq!(run["expected_capped"], false);
    assert_eq!(run["saturated"], false);
    assert_eq!(run["expected_pages_per_s"].as_f64(), Some(10_000.0));
    assert_eq!(run["samples"].as_array().unwrap().len(), 3);
    assert_eq!(run["unattributed_pages"], 0, "{cmd}\n{run:#}");
    within_10pct(
        "overall",
        run["pages_per_s"].as_f64().unwrap(),
        10_000.0,
        &cmd,
        run,
    );
    let vcpus = run["per_vcpu"].as_array().unwrap();
    assert_eq!(vcpus.len(), 2);
    for v in vcpus {
        within_10pct(
            &format!("vCPU {}", v["vcpu"]),
            v["pages_per_s"].as_f64().unwrap(),
            5_000.0,
            &cmd,
            run,
        );
    }
    for s in run["samples"].as_array().unwrap() {
        let sum: f64 = s["vcpu_pages_per_s"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .sum();
        let total = s["pages_per_s"].as_f64().unwrap();
        assert!((sum - total).abs() < 1e-6 * total.max(1.0), "{s:#}");
    }
    let mib = run["mib_per_s"].as_f64().unwrap();
    let pages = run["pages_per_s"].as_f64().unwrap();
    assert!((mib - pages * 4096.0 / 1048576.0).abs() < 1e-6, "{run:#}");
}

#[test]
fn bitmap_mode_measures_the_known_rate_within_10_percent() {
    known_rate_is_measured("bitmap", "region");
}

#[test]
fn ring_mode_measures_the_known_rate_within_10_percent() {
    known_rate_is_measured("ring", "ring");
}

#[test]
fn ring_full_exits_keep_each_entry_with_its_vcpu() {
    // 128-entry rings at 5000 writes/s fill every ~25 ms: most entries of a 500 ms window are
    // reaped by the vCPUs on ring-full exits, and still credited to the vCPU whose ring held
    // them.
    let (d, cmd) = measure(&[
        "--mode",
        "ring",
        "--dirty-ring",
        "128",
        "-v",
        "2",
        "-b",
        "64M",
        "--write-rate",
        "5k",
        "--sample-ms",
        "500",
        "--samples",
        "2",
    ]);
    let run = &d["runs"][0];
    assert_eq!(run["config"]["ring_entries"], 128);
    assert_eq!(run["unattributed_pages"], 0, "{cmd}\n{run:#}");
    within_10pct(
        "overall",
        run["pages_per_s"].as_f64().unwrap(),
        10_000.0,
        &cmd,
        run,
    );
    for v in run["per_vcpu"].as_array().unwrap() {
        within_10pct(
            &format!("vCPU {}", v["vcpu"]),
            v["pages_per_s"].as_f64().unwrap(),
            5_000.0,
            &cmd,
            run,
        );
    }
}

#[test]
fn a_page_rewritten_within_a_window_counts_once() {
    // 256 pages per vCPU at 5000 writes/s: each window of 500 ms rewrites every page about
    // ten times, and the log shows each once: 256 pages per window, 512 pages/s per vCPU.
    let (d, cmd) = measure(&[
        "--vcpus",
        "1",
        "-b",
        "1M",
        "--write-rate",
        "5k",
        "--sample-ms",
        "500",
        "--samples",
        "2",
        "--mode",
        "ring",
    ]);
    let run = &d["runs"][0];
    assert_eq!(run["expected_capped"], true, "{cmd}");
    assert_eq!(run["saturated"], true, "{cmd}");
    assert_eq!(run["expected_pages_per_s"].as_f64(), Some(512.0));
    within_10pct(
        "overall",
        run["pages_per_s"].as_f64().unwrap(),
        512.0,
        &cmd,
        run,
    );
    for s in run["samples"].as_array().unwrap() {
        assert_eq!(s["pages"], 256, "{cmd}\n{s:#}");
    }
    // The guest itself wrote far more than it dirtied.
    assert!(
        run["guest_writes_per_s"].as_f64().unwrap() > 2000.0,
        "{run:#}"
    );
}

#[test]
fn text_report_prints_samples_expected_and_per_vcpu() {
    let out = ok(&[
        "dirty-rate",
        "-v",
        "2",
        "-b",
        "16M",
        "--write-rate",
        "2k",
        "--sample-ms",
        "200",
        "--samples",
        "2",
        "--repeat",
        "2",
    ]);
    for want in [
        "Sample 1/2:",
        "Sample 2/2:",
        "Counted: distinct pages dirtied per window",
        "Expected: 4000.0 pages/s",
        "measured/expected",
        "Per vCPU (from the layout: in bitmap mode each vCPU writes only its own region):",
        "Summary over 2 runs",
    ] {
        assert!(out.contains(want), "missing {want:?}:\n{out}");
    }
}

#[test]
fn repeat_summarizes_each_backend() {
    let (d, _) = measure(&[
        "-b",
        "16M",
        "--write-rate",
        "2k",
        "--sample-ms",
        "100",
        "--samples",
        "1",
        "--repeat",
        "2",
    ]);
    assert_eq!(d["runs"].as_array().unwrap().len(), 2);
    let s = &d["summary"][0];
    assert_eq!(s["backend"], "sim");
    assert_eq!(s["pages_per_s"]["runs"], 2);
    assert_eq!(s["ratio_measured_over_expected"]["runs"], 2);
}

#[test]
fn the_validator_rejects_a_broken_document() {
    let (mut d, _) = measure(&[
        "-b",
        "16M",
        "--sample-ms",
        "50",
        "--samples",
        "1",
        "--write-rate",
        "unlimited",
    ]);
    let run = &d["runs"][0];
    assert_eq!(run["workload"]["known_rate"], false);
    assert!(run["expected_pages_per_s"].is_null());
    assert!(run["config"]["write_rate_per_vcpu"].is_null());
    d["runs"][0]["per_vcpu_by"] = "guess".into();
    assert!(!schema::errors(FILE, &d).is_empty());
    d["runs"][0]["per_vcpu_by"] = "ring".into();
    d["runs"][0].as_object_mut().unwrap().remove("pages_per_s");
    assert!(!schema::errors(FILE, &d).is_empty());
}

#[test]
fn help_explains_distinct_pages() {
    // Clap wraps the text to the terminal: compare with the line breaks folded.
    let out = ok(&["dirty-rate", "--help"])
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for want in [
        "DISTINCT pages",
        "counts once",
        "--write-rate",
        "--sample-ms",
        "--mode",
    ] {
        assert!(out.contains(want), "missing {want:?}:\n{out}");
    }
}

#[test]
fn bad_input_exits_2_with_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (&["--sample-ms", "0"], "--sample-ms"),
        (&["--sample-ms", "600000"], "60000"),
        (&["--sample-ms", "x"], "milliseconds"),
        (&["--samples", "0"], "--samples"),
        (&["--write-rate", "0"], "unlimited"),
        (&["--write-rate", "2000000000"], "10^9"),
        (
            &["--mode", "ring", "--dirty-tracking", "d-bit"],
            "--mode ring",
        ),
        (&["--mode", "rings"], "bitmap"),
        (&["--dirty-ring", "256"], "--mode ring"),
        (&["--mode", "ring", "--dirty-ring", "100"], "power of two"),
        (&["--backend", "kvm", "--write-rate", "5k"], "--write-rate"),
        (
            &["--backend", "kvm", "--mode", "ring", "--dirty-ring", "128"],
            "256",
        ),
        (&["--backend", "kvm", "--format", "stage2"], "--format"),
        (&["--backend", "kvm", "--fast-pf", "off"], "--fast-pf"),
        (&["-v", "0"], "-v"),
        (&["-b", "12Q"], "-b"),
        (&["-v", "512", "-b", "64T"], "-b"),
        (&["--plot", "/nonexistent-dir/x.svg"], "--plot"),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["dirty-rate"];
        args.extend_from_slice(extra);
        let (code, out, err) = slat(&args);
        assert_eq!(code, 2, "slat {}: {out}{err}", args.join(" "));
        assert!(out.is_empty(), "slat {}: {out}", args.join(" "));
        assert_eq!(err.lines().count(), 1, "slat {}: {err}", args.join(" "));
        assert!(err.contains(needle), "slat {}: {err}", args.join(" "));
    }
}

fn kvm_unavailable() -> bool {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        eprintln!("skipping: /dev/kvm cannot be opened on this host");
        return true;
    }
    false
}

#[test]
fn kvm_is_measured_without_an_expected_rate() {
    if kvm_unavailable() {
        return;
    }
    for mode in ["bitmap", "ring"] {
        let (d, cmd) = measure(&[
            "--backend",
            "kvm",
            "--mode",
            mode,
            "-v",
            "2",
            "-b",
            "16M",
            "--sample-ms",
            "100",
            "--samples",
            "2",
        ]);
        let run = &d["runs"][0];
        assert_eq!(run["backend"], "kvm");
        assert!(run["format"].is_null());
        assert_eq!(run["workload"]["kind"], "memstress-loop");
        assert_eq!(run["workload"]["known_rate"], false);
        assert!(run["expected_pages_per_s"].is_null(), "{cmd}");
        assert!(run["pages_per_s"].as_f64().unwrap() > 0.0, "{cmd}\n{run:#}");
        assert_eq!(run["per_vcpu"].as_array().unwrap().len(), 2);
        assert_eq!(run["unattributed_pages"], 0, "{cmd}\n{run:#}");
    }
    // Both machines in one document, one summary each.
    let (d, _) = measure(&[
        "--backend",
        "sim,kvm",
        "-b",
        "16M",
        "--sample-ms",
        "50",
        "--samples",
        "1",
    ]);
    assert_eq!(d["backends"], serde_json::json!(["sim", "kvm"]));
    assert_eq!(d["runs"][0]["backend"], "sim");
    assert_eq!(d["runs"][1]["backend"], "kvm");
    assert_eq!(d["summary"].as_array().unwrap().len(), 2);
    // The sim guest paced at the default rate; the kvm guest unpaced.
    assert_eq!(d["runs"][0]["config"]["write_rate_per_vcpu"], 10_000);
    assert!(d["runs"][1]["config"]["write_rate_per_vcpu"].is_null());
}
