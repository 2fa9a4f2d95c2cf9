//! `slat snapshot-perf` through the binary: its `--json` validates against
//! `schema/snapshot-perf.json` on both machines (the validator refuses a broken document), the
//! figures hang together, `--verify` runs, and bad input exits 2 with one line.

mod common;

use common::schema;
use common::{json, slat};
use serde_json::Value;

const FILE: &str = "snapshot-perf.json";

fn small(backend: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "snapshot-perf",
        "-v",
        "2",
        "-b",
        "256K",
        "-k",
        "1,16,all",
        "-i",
        "20",
        "--backend",
        backend,
    ];
    args.extend_from_slice(extra);
    json(&args)
}

#[test]
fn json_matches_its_schema_on_both_machines() {
    for backend in ["sim", "kvm"] {
        let d = small(backend, &["--verify"]);
        schema::validate(FILE, &d);
        let run = &d["runs"][0];
        assert_eq!(run["backend"], backend);
        let rows = run["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 3);
        for (row, k) in rows.iter().zip([1u64, 16, 64]) {
            assert_eq!(row["k_per_vcpu"], k);
            // Sequential passes dirty exactly k pages per vCPU, all copied back, all verified.
            assert_eq!(row["dirty_pages"].as_f64(), Some((2 * k) as f64), "{row:#}");
            assert_eq!(row["verified"], 20);
            assert!(row["reset_p99_us"].as_f64() >= row["reset_p50_us"].as_f64());
        }
        assert_eq!(run["full_copy"]["pages"], 128);
    }
}

#[test]
fn repeat_and_two_backends_share_one_document() {
    let d = small("sim,kvm", &["--repeat", "2", "-a", "-g"]);
    schema::validate(FILE, &d);
    assert_eq!(d["runs"].as_array().unwrap().len(), 4);
    let summary = d["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 6);
    for s in summary {
        let m = &s["reset_p50_us"];
        assert_eq!(m["runs"], 2);
        assert!(m["min"].as_f64() <= m["median"].as_f64());
        assert!(m["median"].as_f64() <= m["max"].as_f64());
    }
    assert_eq!(d["runs"][0]["config"]["log"], "get");
    assert_eq!(d["runs"][0]["config"]["random"], true);
}

#[test]
fn dirty_rings_are_harvested_too() {
    let d = small("sim,kvm", &["--dirty-ring", "256", "--verify"]);
    schema::validate(FILE, &d);
    assert_eq!(d["runs"][1]["config"]["log"], "ring");
}

#[test]
fn the_validator_rejects_a_broken_document() {
    let d = small("sim", &[]);
    let mut bad = d.clone();
    bad["runs"][0]["rows"][0]["reset_p50_us"] = Value::from("fast");
    assert!(schema::errors(FILE, &bad)
        .iter()
        .any(|e| e.contains("reset_p50_us")));
    let mut bad = d.clone();
    bad["runs"][0]["rows"][0]["surprise"] = Value::from(1);
    assert!(schema::errors(FILE, &bad)
        .iter()
        .any(|e| e.contains("surprise")));
    let mut bad = d;
    bad.as_object_mut().unwrap().remove("host");
    assert!(schema::errors(FILE, &bad)
        .iter()
        .any(|e| e.contains("host")));
}

#[test]
fn bad_input_exits_2_with_one_line() {
    for args in [
        &["snapshot-perf", "-k", "0"][..],
        &["snapshot-perf", "-k", "many"],
        &["snapshot-perf", "-b", "64K", "-k", "17"],
        &["snapshot-perf", "-i", "0"],
        &["snapshot-perf", "--clear-chunk", "64"],
        &["snapshot-perf", "--plot", "x.svg"],
        &["snapshot-perf", "-g", "--dirty-ring", "256"],
        &["snapshot-perf", "--backend", "kvm", "--format", "stage2"],
        &["snapshot-perf", "--backend", "sim,sim"],
        // 4 x (2^62 - 16 KiB) wraps to 16 KiB in 64 bits.
        &["snapshot-perf", "-v", "4", "-b", "4611686018427392000"],
        // 32 PiB: more than the host and a 48-bit guest physical space.
        &["snapshot-perf", "-v", "512", "-b", "64T"],
    ] {
        let (code, out, err) = slat(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
    }
}
