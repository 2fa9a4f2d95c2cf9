//! `slat page-table-test` through the binary: the selftest's lines in order, per-stage figures
//! that show what each stage did (blocks created, split, rebuilt; break-before-make and cache
//! maintenance on stage2), `--compare`, JSON, and one-line refusals of bad input.

use crate::common;

use common::schema::validate;
use serde_json::Value;
use std::process::Command;

fn slat(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_slat"))
        .arg("page-table-test")
        .args(args)
        .output()
        .expect("run slat");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(args: &[&str]) -> Value {
    let mut v = args.to_vec();
    v.push("--json");
    let (code, out, err) = slat(&v);
    assert_eq!(code, 0, "{v:?}:\n{out}\n{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{v:?}: {e}\n{out}"))
}

fn stage<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .find(|s| s["stage"] == name)
        .unwrap_or_else(|| panic!("no {name} in {doc}"))
}

#[test]
fn prints_the_selftest_lines_in_order() {
    let (code, out, err) = slat(&["-b", "8M", "-v", "2", "--format", "stage2"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let expected = [
        "Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages",
        "Testing memory backing src type: anonymous",
        "Testing memory backing src granularity: 0x1000",
        "Testing memory size(aligned): 0x800000",
        "Guest physical test memory offset: 0x",
        "Host  virtual  test memory offset: 0x",
        "Number of testing vCPUs: 2",
        "Started all vCPUs successfully",
        "KVM_CREATE_MAPPINGS: total execution time: ",
        "KVM_UPDATE_MAPPINGS: total execution time: ",
        "KVM_ADJUST_MAPPINGS: total execution time: ",
    ];
    let mut lines = out.lines();
    for e in expected {
        assert!(
            lines.any(|l| l.starts_with(e)),
            "missing or out of order: {e:?}\n{out}"
        );
    }
}

#[test]
fn thp_blocks_are_split_by_update_and_rebuilt_by_adjust_on_stage2() {
    for rebuild in ["break-first", "install-first"] {
        let d = json(&[
            "-b",
            "16M",
            "-v",
            "2",
            "-s",
            "anonymous_thp",
            "--format",
            "stage2",
            "--rebuild",
            rebuild,
        ]);
        assert_eq!(d["granularity"], 2 << 20);
        let (c, u, a) = (
            stage(&d, "KVM_CREATE_MAPPINGS"),
            stage(&d, "KVM_UPDATE_MAPPINGS"),
            stage(&d, "KVM_ADJUST_MAPPINGS"),
        );
        // Eight 2 MiB blocks: one fault each to create, a break-before-make split each when
        // written with logging on, a rebuild each when read with logging off.
        assert_eq!(c["pf_fixed"], 8, "{d}");
        assert_eq!(u["splits"], 8, "{d}");
        assert_eq!(a["rebuilds"], 8, "{d}");
        assert!(u["bbm_breaks"].as_u64() >= Some(8) && a["bbm_breaks"].as_u64() >= Some(8));
        // On-install: each new leaf is cleaned once (blocks, then the pages the update maps).
        assert_eq!(c["cache_clean_bytes"], 16 << 20, "{d}");
        assert_eq!(d["rebuild"], rebuild);
    }
}

#[test]
fn cmo_always_cleans_on_every_translation_fault() {
    let d = json(&[
        "-b",
        "4M",
        "-v",
        "1",
        "-s",
        "anonymous_thp",
        "--format",
        "stage2",
        "--cmo",
        "always",
    ]);
    let u = stage(&d, "KVM_UPDATE_MAPPINGS");
    // The two write faults on blocks are permission faults (no clean); each of the 2 × 256
    // reads of the second halves is a translation fault that cleans its page.
    assert_eq!(u["cache_cleans"], 512, "{d}");
    assert_eq!(d["cmo"], "always");
}

#[test]
fn ept_needs_no_break_before_make_or_cache_maintenance() {
    let d = json(&["-b", "8M", "-s", "anonymous_thp"]);
    assert_eq!(d["format"], "ept");
    for s in d["stages"].as_array().unwrap() {
        assert_eq!(s["bbm_breaks"], 0, "{d}");
        assert_eq!(s["cache_cleans"], 0, "{d}");
    }
    assert_eq!(stage(&d, "KVM_ADJUST_MAPPINGS")["rebuilds"], 4, "{d}");
}

#[test]
fn compare_runs_four_configurations_in_one_table() {
    let args = [
        "-b",
        "4M",
        "-v",
        "2",
        "-s",
        "anonymous_thp",
        "--format",
        "stage2",
        "--compare",
    ];
    let (code, out, err) = slat(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    for row in [
        "|   break-first |     always |",
        "|   break-first | on-install |",
        "| install-first |     always |",
        "| install-first | on-install |",
    ] {
        assert!(out.contains(row), "{row}: {out}");
    }
    assert!(
        out.contains("Patch 1 (CMOs only by the installing fault)"),
        "{out}"
    );
    assert!(out.contains("Patch 2 (install the block first)"), "{out}");
    // Patch 1's three stages, patch 2's adjust stage and its faults line.
    assert_eq!(out.matches("KVM_ADJUST_MAPPINGS").count(), 3, "{out}");
    assert_eq!(out.matches(": before 0.").count(), 4, "{out}");
}

/// `--compare --json` is the driver's sweep document: a row per configuration, each row's
/// result the full one-configuration report (with `--repeat`, its summary and runs).
#[test]
fn compare_json_carries_every_configuration_report() {
    let d = json(&[
        "-b",
        "4M",
        "--format",
        "stage2",
        "--compare",
        "--repeat",
        "2",
    ]);
    validate("sweep.json", &d);
    assert_eq!(d["varied"], serde_json::json!(["rebuild", "cmo"]));
    let rows = d["sweep"].as_array().expect("rows");
    let configs: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            let run = &r["result"]["runs"][1];
            validate("page-table-test.json", &with_envelope(&d, run));
            assert_eq!(r["result"]["repeat"], 2, "{r}");
            (run["rebuild"].to_string(), run["cmo"].to_string())
        })
        .collect();
    let want = [
        ("break-first", "always"),
        ("break-first", "on-install"),
        ("install-first", "always"),
        ("install-first", "on-install"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(r, c)| (format!("{r:?}"), format!("{c:?}")))
        .collect();
    assert_eq!(configs, want);
    let at = common::json(&[
        "access-tracking-perf",
        "-b",
        "1M",
        "--idle-check",
        "warn",
        "--compare",
    ]);
    validate("sweep.json", &at);
    let settings: Vec<_> = at["sweep"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            validate(
                "access-tracking-perf.json",
                &with_envelope(&at, &r["result"]),
            );
            let c = &r["result"]["config"];
            format!("{} {}", c["vcpus"], c["fast_pf"])
        })
        .collect();
    assert_eq!(settings, ["1 true", "1 false", "2 true", "2 false"]);
    assert_eq!(
        at["sweep"][3]["settings"],
        serde_json::json!(["vcpus=2", "fast-pf=off"])
    );
}

/// `--compare --repeat 3 --plot`: a panel per stage, a bar per configuration, each with its
/// min-max error bar (a path of six points); one run draws the bars without error bars.
#[test]
fn compare_plots_bars_with_error_bars() {
    let p = std::env::temp_dir().join(format!("slat-ptt-{}.svg", std::process::id()));
    let plot = p.to_str().expect("utf-8 path");
    let whiskers = |repeat: &str| {
        let args = [
            "-b",
            "4M",
            "--format",
            "stage2",
            "--compare",
            "--repeat",
            repeat,
        ];
        let (code, out, err) = slat(&[&args[..], &["--plot", plot]].concat());
        assert_eq!(code, 0, "{out}\n{err}");
        let svg = std::fs::read_to_string(&p).expect("svg");
        for label in [
            "create mappings",
            "adjust mappings",
            "rebuild=install-first cmo=on-install",
        ] {
            assert!(svg.contains(label), "{label} missing:\n{svg}");
        }
        let polylines = svg.split("<polyline ").skip(1);
        polylines
            .filter(|l| {
                l.split("points=\"").nth(1).map_or(0, |pts| {
                    pts.split('"')
                        .next()
                        .unwrap_or("")
                        .split_whitespace()
                        .count()
                }) == 6
            })
            .count()
    };
    assert_eq!(whiskers("3"), 12);
    assert_eq!(whiskers("1"), 0);
    let _ = std::fs::remove_file(&p);
}

/// A report inside a sweep, given the sweep's envelope so it validates on its own.
fn with_envelope(doc: &Value, inner: &Value) -> Value {
    let mut v = inner.clone();
    for k in ["schema_version", "slat_version", "host"] {
        v[k] = doc[k].clone();
    }
    v
}

#[test]
fn bad_input_is_refused_with_one_line() {
    for (args, needle) in [
        (vec!["-m", "7"], "guest mode 7 is not implemented"),
        (vec!["--compare"], "--compare"),
        (
            vec!["--compare", "--format", "stage2", "-m", "3"],
            "--compare row",
        ),
        (vec!["-b", "3x"], "-b"),
        (vec!["-p", "0x1001", "-b", "8M"], "not aligned"),
        (vec!["-p", "0xffffffffffff0000", "-b", "8M"], "exceeds"),
        (vec!["-v", "0"], "-v"),
    ] {
        let (code, out, err) = slat(&args);
        assert_ne!(code, 0, "{args:?} was accepted:\n{out}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let lines = err.trim().lines().filter(|l| !l.starts_with("[slat]"));
        assert!(lines.count() <= 3, "{args:?}: {err}");
    }
}

/// The position of the first stderr line of `err` that contains `what`.
fn line_of(err: &str, what: &str) -> usize {
    err.lines()
        .position(|l| l.contains(what))
        .unwrap_or_else(|| panic!("no line with {what:?} in:\n{err}"))
}

/// A benchmark's native baselines run after its last guest phase: one run between two guest
/// phases evicted from the host's caches what the next phase found there (page-table-test's
/// ADJUST stage measured 3.3-4.5 ms after UPDATE's baseline, 2.4-3.0 without).
#[test]
fn native_baselines_run_after_the_last_guest_phase() {
    let native = "[slat] native baselines";
    let (code, out, err) = slat(&["-b", "4M", "-v", "2"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        line_of(&err, "KVM_ADJUST_MAPPINGS on") < line_of(&err, native),
        "{err}"
    );
    assert_eq!(err.matches(native).count(), 1, "{err}");
    // Its idle passes warn (4 MiB fits the TLB); the baselines come after the last of them.
    let (code, out, err) = common::slat(&["access-tracking-perf", "-b", "4M", "-v", "1"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        line_of(&err, "after `Reading from idle memory`") < line_of(&err, native),
        "{err}"
    );
    assert_eq!(err.matches(native).count(), 1, "{err}");
    // Each pass's baseline line is filled in, below its pass.
    let lines: Vec<&str> = out.lines().collect();
    let pass_names = [
        "Populating memory",
        "Writing to populated memory",
        "Reading from populated memory",
        "Writing to idle memory",
        "Reading from idle memory",
    ];
    for name in pass_names {
        let head = format!("{name:<30}:");
        let at = lines.iter().position(|l| l.starts_with(&head));
        let next = at
            .and_then(|i| lines.get(i + 1))
            .copied()
            .unwrap_or_default();
        assert!(
            next.starts_with("  native baseline") && next.contains("guest/native"),
            "{name}:\n{out}"
        );
    }
    let (code, out, err) = common::slat(&["dirty-log-perf", "-b", "4M", "-i", "2", "-v", "1"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(err.matches(native).count(), 1, "{err}");
    assert!(out.contains("native"), "{out}");
}
