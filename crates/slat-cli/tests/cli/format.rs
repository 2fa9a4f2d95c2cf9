//! `--format ept|stage2` through the `slat` binary: every simulated-machine subcommand runs on
//! arm64 stage-2 and says so in its header and JSON, the stage-2 switches reach the engine, and
//! combinations that cannot work are refused with one line and exit status 2. Small sizes, so
//! the whole file runs in about a second.

use crate::common;

use common::{json, ok, slat};
use serde_json::Value;

const STAGE2_HEADER: &str = "Page table format: stage2 (arm64-stage2; break-before-make";

#[test]
fn demand_paging_runs_on_stage2() {
    let out = ok(&["demand-paging", "-b", "16M", "--format", "stage2"]);
    assert!(out.contains(STAGE2_HEADER), "{out}");
    assert!(out.contains("format stage2"), "{out}");
    assert!(out.contains("cache maintenance: "), "{out}");
    let d = json(&["demand-paging", "-b", "16M", "--format", "stage2"]);
    assert_eq!(d["format"], "stage2");
    assert_eq!(d["config"]["format"], "stage2");
    assert_eq!(d["config"]["cmo"], "on-install");
    // Every new stage-2 leaf is cleaned before the guest sees it.
    assert!(d["stats"]["cache_cleans"].as_u64().unwrap() >= 4096, "{d}");
    assert!(d["stats"]["cache_clean_bytes"].as_u64().unwrap() >= 16 << 20);
}

#[test]
fn dirty_log_perf_runs_on_stage2_with_its_switches() {
    let out = ok(&["dirty-log-perf", "-b", "16M", "--format", "stage2"]);
    assert!(out.contains(STAGE2_HEADER), "{out}");
    assert!(out.contains("Iteration 2 clear dirty log time:"), "{out}");
    assert!(out.contains("format stage2"), "{out}");
    let d = json(&[
        "dirty-log-perf",
        "-b",
        "16M",
        "--format",
        "stage2",
        "--cmo",
        "always",
        "--rebuild",
        "break-first",
        "--recover",
        "on-fault",
    ]);
    assert_eq!(d["format"], "stage2");
    let c = &d["config"];
    assert_eq!(
        (&c["format"], &c["cmo"], &c["rebuild"], &c["recover"]),
        (
            &Value::from("stage2"),
            &Value::from("always"),
            &Value::from("break-first"),
            &Value::from("on-fault")
        )
    );
    for k in ["bbm_breaks", "cache_cleans", "cache_clean_bytes"] {
        assert!(d["stats"][k].is_u64(), "stats.{k} missing: {d}");
    }
    assert_eq!(d["iterations"][1]["dirty_pages"], 4096);
}

#[test]
fn ept_stays_the_default_and_says_so() {
    let d = json(&["dirty-log-perf", "-b", "16M"]);
    assert_eq!(d["format"], "ept");
    assert_eq!(d["config"]["format"], "ept");
    let out = ok(&["demand-paging", "-b", "16M"]);
    assert!(out.contains("Page table format: ept (x86-ept)"), "{out}");
    // The stage-2 switches are accepted on ept and do nothing there (no break-before-make,
    // no cache maintenance), so a sweep can hold them fixed across both formats.
    let d = json(&[
        "dirty-log-perf",
        "-b",
        "16M",
        "--cmo",
        "always",
        "--rebuild",
        "break-first",
    ]);
    assert_eq!(d["stats"]["cache_cleans"], 0);
    assert_eq!(d["stats"]["bbm_breaks"], 0);
}

#[test]
fn dirty_log_test_passes_on_stage2() {
    let out = ok(&[
        "dirty-log-test",
        "-b",
        "4M",
        "-i",
        "2",
        "-I",
        "5",
        "--format",
        "stage2",
    ]);
    assert!(out.contains(STAGE2_HEADER), "{out}");
    for mode in ["dirty-log", "clear-log", "dirty-ring"] {
        assert!(out.contains(&format!("Log mode '{mode}': PASS")), "{out}");
    }
    let d = json(&[
        "dirty-log-test",
        "-M",
        "clear-log",
        "-b",
        "4M",
        "-i",
        "2",
        "-I",
        "5",
        "--format",
        "stage2",
    ]);
    assert_eq!(d["format"], "stage2");
    assert_eq!(d["modes"][0]["pass"], true);
}

#[test]
fn access_tracking_perf_runs_on_stage2() {
    for ad in ["on", "off"] {
        let out = ok(&[
            "access-tracking-perf",
            "-b",
            "16M",
            "--format",
            "stage2",
            "--ad-bits",
            ad,
        ]);
        assert!(out.contains(STAGE2_HEADER), "{out}");
        assert!(out.contains("Reading from idle memory"), "{out}");
        assert!(out.contains("format stage2"), "{out}");
    }
    let d = json(&["access-tracking-perf", "-b", "16M", "--format", "stage2"]);
    assert_eq!(d["format"], "stage2");
    assert_eq!(d["config"]["format"], "stage2");
}

#[test]
fn vary_format_runs_both_in_one_table() {
    let out = ok(&["dirty-log-perf", "-b", "16M", "--vary", "format=ept,stage2"]);
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("| ")).collect();
    assert_eq!(rows.len(), 3, "{out}");
    assert!(rows[0].contains("format"), "{out}");
    assert!(rows[1].contains(" ept "), "{out}");
    assert!(rows[2].contains(" stage2 "), "{out}");
    let (code, _, err) = slat(&["dirty-log-perf", "--vary", "format=ept,arm"]);
    assert_eq!(code, 2);
    assert!(err.contains("ept, stage2"), "{err}");
}

/// Combinations no machine can run, and a word the one-line refusal must hold. A data
/// table (one row per case), longer than a function may be.
const IMPOSSIBLE: &[(&[&str], &str)] = &[
    (
        &[
            "dirty-log-perf",
            "--format",
            "stage2",
            "--dirty-tracking",
            "d-bit",
        ],
        "hardware dirty bit",
    ),
    (
        &[
            "dirty-log-test",
            "--format",
            "stage2",
            "--dirty-tracking",
            "d-bit",
        ],
        "hardware dirty bit",
    ),
    (
        &[
            "dirty-log-perf",
            "--dirty-tracking",
            "d-bit",
            "--vary",
            "format=ept,stage2",
        ],
        "format=stage2",
    ),
    (
        &["demand-paging", "--format", "stage2", "--backend", "kvm"],
        "--format stage2",
    ),
    (
        &["dirty-log-perf", "--format", "stage2", "--backend", "kvm"],
        "--format stage2",
    ),
    (
        &[
            "dirty-log-perf",
            "--format",
            "stage2",
            "--backend",
            "sim,kvm",
        ],
        "--format stage2",
    ),
    (
        &["dirty-log-test", "--format", "stage2", "--backend", "kvm"],
        "--format stage2",
    ),
    (
        &[
            "access-tracking-perf",
            "--format",
            "stage2",
            "--backend",
            "kvm",
        ],
        "--format stage2",
    ),
    (
        &["demand-paging", "--cmo", "always", "--backend", "kvm"],
        "--cmo",
    ),
    (
        &[
            "dirty-log-perf",
            "--rebuild",
            "break-first",
            "--backend",
            "kvm",
        ],
        "--rebuild",
    ),
    (
        &[
            "dirty-log-perf",
            "--recover",
            "on-fault",
            "--backend",
            "kvm",
        ],
        "--recover",
    ),
    (&["demand-paging", "--format", "arm"], "--format"),
    (&["demand-paging", "--rebuild", "break-first"], "--rebuild"),
];

#[test]
fn impossible_combinations_are_refused_with_one_line_and_exit_2() {
    for (args, needle) in IMPOSSIBLE {
        let (code, out, err) = slat(args);
        let cmd = args.join(" ");
        assert_eq!(code, 2, "slat {cmd}: {err}");
        assert!(out.is_empty(), "slat {cmd} printed: {out}");
        assert_eq!(err.lines().count(), 1, "slat {cmd}: {err}");
        assert!(err.contains(needle), "slat {cmd}: {err}");
        assert!(!err.contains("panicked"), "slat {cmd}: {err}");
    }
}

#[test]
fn live_migration_runs_on_stage2_and_verifies() {
    let out = ok(&[
        "migrate-perf",
        "-v",
        "2",
        "-b",
        "16M",
        "-s",
        "anonymous_thp",
        "--format",
        "stage2",
        "--log",
        "ring",
    ]);
    assert!(out.contains("Verification: OK"), "{out}");
    let (code, _, err) = slat(&[
        "migrate-perf",
        "-b",
        "16M",
        "--format",
        "stage2",
        "--backend",
        "kvm",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--format stage2"), "{err}");
}
