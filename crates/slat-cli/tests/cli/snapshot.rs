//! `slat snapshot-perf` through the binary: its `--json` validates against
//! `schema/snapshot-perf.json` on both machines (the validator refuses a broken document), the
//! figures hang together, `--verify` runs, and bad input exits 2 with one line; `--vary` runs
//! every combination in one process, one table and one sweep document.

use crate::common;

use common::schema;
use common::{json, slat};
use serde_json::Value;

const FILE: &str = "snapshot-perf.json";

/// Errors of `doc` against one branch of the schema (`report` or `sweep`): the whole file's
/// `oneOf` reports only that no branch matched, the branch names the field.
fn branch_errors(def: &str, doc: &Value) -> Vec<String> {
    schema::def_errors(FILE, def, doc)
}

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
    assert!(!schema::errors(FILE, &bad).is_empty());
    assert!(branch_errors("report", &bad)
        .iter()
        .any(|e| e.contains("reset_p50_us")));
    let mut bad = d.clone();
    bad["runs"][0]["rows"][0]["surprise"] = Value::from(1);
    assert!(!schema::errors(FILE, &bad).is_empty());
    assert!(branch_errors("report", &bad)
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
        &["snapshot-perf", "--plot", "/nonexistent-dir/x.svg"],
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

fn vary(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "snapshot-perf",
        "-b",
        "256K",
        "-k",
        "1,16,all",
        "-i",
        "10",
        "--verify",
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

#[test]
fn vary_runs_every_combination_in_one_document() {
    let args = vary(&[
        "--vary",
        "log=get,clear,ring",
        "--vary",
        "vcpus=1,2",
        "--vary",
        "backend=sim,kvm",
        "--vary",
        "order=seq,random",
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let d = json(&args);
    schema::validate(FILE, &d);
    assert!(!branch_errors("report", &d).is_empty());
    assert_eq!(d["benchmark"], "snapshot-perf");
    assert_eq!(
        d["varied"],
        serde_json::json!(["log", "vcpus", "backend", "order"])
    );
    let rows = d["sweep"].as_array().unwrap();
    assert_eq!(rows.len(), 3 * 2 * 2 * 2);
    // The first key varies slowest.
    assert_eq!(
        rows[0]["settings"],
        serde_json::json!(["log=get", "vcpus=1", "backend=sim", "order=seq"])
    );
    assert_eq!(
        rows[23]["settings"],
        serde_json::json!(["log=ring", "vcpus=2", "backend=kvm", "order=random"])
    );
    for (i, row) in rows.iter().enumerate() {
        let settings: Vec<&str> = row["settings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect();
        let r = &row["result"];
        let c = &r["config"];
        let vcpus = if settings.contains(&"vcpus=1") { 1 } else { 2 };
        let random = settings.contains(&"order=random");
        assert_eq!(c["log"], settings[0].trim_start_matches("log="), "row {i}");
        assert_eq!(c["vcpus"], vcpus, "row {i}");
        assert_eq!(r["backend"], settings[2].trim_start_matches("backend="));
        assert_eq!(c["random"], random, "row {i}");
        let ks = r["rows"].as_array().unwrap();
        assert_eq!(ks.len(), 3, "row {i}");
        for (k, want) in ks.iter().zip([1u64, 16, 64]) {
            assert_eq!(k["k_per_vcpu"], want);
            assert_eq!(k["verified"], 10);
            if !random {
                assert_eq!(k["dirty_pages"].as_f64(), Some((vcpus * want) as f64));
            }
        }
        assert_eq!(r["full_copy"]["pages"], 64 * vcpus);
    }
    // A broken sweep is refused, by the sweep branch by name.
    let mut bad = d.clone();
    bad["sweep"][1]["surprise"] = Value::from(1);
    assert!(!schema::errors(FILE, &bad).is_empty());
    let mut bad = d.clone();
    bad["sweep"][0]["result"]["rows"][0]["reset_p50_us"] = Value::from("fast");
    assert!(!schema::errors(FILE, &bad).is_empty());
    let mut bad = d;
    bad["varied"][0] = Value::from("speed");
    assert!(branch_errors("sweep", &bad)
        .iter()
        .any(|e| e.contains("varied")));
}

#[test]
fn vary_prints_one_table_of_combination_by_k() {
    let args = vary(&["--vary", "log=get,ring", "--vary", "vcpus=1,2"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = common::ok(&args);
    let table: Vec<&str> = out.lines().filter(|l| l.starts_with('|')).collect();
    // Header, rule, then 2 logs x 2 vCPU counts x 3 k.
    assert_eq!(table.len(), 2 + 12, "{out}");
    for col in [
        "log",
        "vcpus",
        "k/vCPU",
        "reset p50 us",
        "p99 us",
        "reset/floor",
        "full/reset",
    ] {
        assert!(table[0].contains(col), "{col}: {out}");
    }
    assert!(
        table[2].contains(" get ") && table[13].contains(" ring "),
        "{out}"
    );
}

#[test]
fn help_documents_the_vary_keys() {
    let out = common::ok(&["snapshot-perf", "--help"]);
    let at = out.find("--vary").expect("--vary in --help");
    let text = &out[at..];
    for key in [
        "vcpus",
        "log",
        "order",
        "backend",
        "seq, random",
        "get,",
        "ring",
        "--repeat",
    ] {
        assert!(text.contains(key), "{key}: {out}");
    }
}

#[test]
fn bad_vary_exits_2_with_one_line() {
    for (args, says) in [
        (&["snapshot-perf", "--vary", "speed=1"][..], "unknown key"),
        (&["snapshot-perf", "--vary", "log"], "KEY=V1"),
        (
            &["snapshot-perf", "--vary", "log=bitmap"],
            "get, clear, ring",
        ),
        (
            &["snapshot-perf", "--vary", "order=backwards"],
            "seq, random",
        ),
        (&["snapshot-perf", "--vary", "backend=xen"], "sim, kvm"),
        (&["snapshot-perf", "--vary", "vcpus=0"], "1 to 512"),
        (&["snapshot-perf", "--vary", "vcpus=1,,2"], "empty"),
        (
            &["snapshot-perf", "--vary", "vcpus=1", "--vary", "vcpus=2"],
            "twice",
        ),
        (
            &["snapshot-perf", "--vary", "vcpus=1,2", "--repeat", "2"],
            "--repeat",
        ),
        (
            &[
                "snapshot-perf",
                "--vary",
                "vcpus=1,2",
                "--backend",
                "sim,kvm",
            ],
            "backend=sim,kvm",
        ),
        (
            &[
                "snapshot-perf",
                "--vary",
                "backend=sim,kvm",
                "--format",
                "stage2",
            ],
            "--vary row backend=kvm",
        ),
        (
            &[
                "snapshot-perf",
                "-b",
                "64K",
                "-k",
                "17",
                "--vary",
                "log=get",
            ],
            "-k 17",
        ),
    ] {
        let (code, out, err) = slat(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
    }
}

/// k dirty pages of a 1 GiB guest, every reset verified byte for byte, in every log mode on
/// both machines: the counts match the model, the snapshot holds only the touched pages, and
/// the process stays near the memory the guest touched (the guest is not pre-faulted).
#[test]
fn verify_on_one_gib_guests_in_every_log_mode_on_both_machines() {
    for backend in ["sim", "kvm"] {
        let d = json(&[
            "snapshot-perf",
            "-b",
            "1G",
            "-k",
            "4,16",
            "-i",
            "3",
            "--verify",
            "--backend",
            backend,
            "--vary",
            "log=get,clear,ring",
        ]);
        schema::validate(FILE, &d);
        let rows = d["sweep"].as_array().unwrap();
        assert_eq!(rows.len(), 3, "{backend}");
        for (row, (log, rearm)) in rows.iter().zip([
            ("get", "get"),
            ("clear", "clear-chunks"),
            ("ring", "ring-reset"),
        ]) {
            let r = &row["result"];
            assert_eq!(r["config"]["log"], log, "{backend}");
            assert_eq!(r["config"]["rearm"], rearm, "{backend} {log}");
            for (k, want) in r["rows"].as_array().unwrap().iter().zip([4u64, 16]) {
                assert_eq!(k["ram_pages"], 1u64 << 18, "{backend} {log}");
                assert_eq!(k["dirty_pages"].as_f64(), Some(want as f64));
                assert_eq!(k["verified"], 3, "{backend} {log}");
                assert_eq!(k["full_resets"], 0);
                // The warm-up pass wrote the 16 pages the largest k writes; nothing else.
                assert_eq!(k["snapshot_held_pages"], 16, "{backend} {log}");
                let rss = k["rss_mib"].as_f64().unwrap();
                assert!(rss < 256.0, "{backend} {log}: {rss} MiB resident");
                if log == "get" {
                    assert_eq!(k["rearmed_mean"].as_f64(), Some(0.0));
                } else {
                    assert!(k["rearmed_mean"].as_f64().unwrap() >= 1.0, "{k:#}");
                }
            }
            assert_eq!(r["full_copy"]["pages"], 1u64 << 18);
        }
    }
}

/// Over 4 GiB the full-copy reset (which faults in all guest RAM) is skipped, and recorded
/// as skipped.
#[test]
fn a_large_guest_skips_the_full_copy() {
    let d = json(&["snapshot-perf", "-b", "5G", "-k", "1", "-i", "2"]);
    schema::validate(FILE, &d);
    let run = &d["runs"][0];
    assert!(run["full_copy"].is_null());
    let k = &run["rows"][0];
    assert_eq!(k["ram_pages"], 5u64 << 18);
    assert!(k["rss_mib"].as_f64().unwrap() < 256.0, "{k:#}");
}
