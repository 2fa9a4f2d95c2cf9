//! `slat calibrate`: a quick run writes a profile that loads and validates, with a source
//! beside every number; where it cannot write fails with one line; `--cost-profile` loads
//! such a file and refuses a bad one with one line naming it.

use crate::common;
use slat_vt::Profile;

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("slat-calibrate-{}-{name}", std::process::id()))
}

#[test]
fn a_quick_calibration_writes_a_valid_profile() {
    let path = temp("quick.toml");
    let p = path.to_str().expect("utf-8 temp path");
    let out = common::json(&[
        "calibrate",
        "--quick",
        "--repeat",
        "3",
        "--name",
        "ci",
        "-o",
        p,
    ]);
    let profile = Profile::load(&path).expect("the written profile loads and validates");
    let _ = std::fs::remove_file(&path);
    assert_eq!(profile.name, "ci");
    assert_eq!(out["hash"], profile.hash().as_str());
    for (name, e) in &profile.costs {
        assert!(!e.source.trim().is_empty(), "{name} has no source");
    }
    let measured = out["measured"].as_array().expect("measured");
    assert!(measured.len() >= 18, "{out}");
    for m in measured {
        assert!(m["source"].as_str().unwrap().starts_with("slat calibrate:"));
        // Only a fault path's own cost may be negative (an overlap credit).
        let signed = matches!(m["key"].as_str(), Some("slow_fault" | "fast_fault"));
        let ns = m["ns"].as_f64().unwrap();
        assert!(ns.is_finite() && (signed || ns >= 0.0), "{m}");
    }
}

#[test]
fn an_unwritable_output_fails_with_one_line() {
    let (code, out, err) = common::slat(&[
        "calibrate",
        "--quick",
        "-o",
        "/nonexistent-dir/profile.toml",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent-dir/profile.toml"), "{err}");
    assert!(out.is_empty(), "{out}");
}

#[test]
fn json_needs_an_output_file() {
    let (code, _, err) = common::slat(&["calibrate", "--quick", "--json"]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn cost_profile_loads_a_file_and_refuses_a_bad_one() {
    let good = temp("good.toml");
    std::fs::write(
        &good,
        include_str!("../../../slat-vt/profiles/host-2core-nested.toml"),
    )
    .unwrap();
    let g = good.to_str().unwrap();
    let r = common::json(&[
        "demand-paging",
        "-b",
        "4M",
        "--clock",
        "virtual",
        "--cost-profile",
        g,
    ]);
    assert_eq!(r["clock_profile"], "host-2core-nested");
    // A built-in profile by name, when no file of that name exists.
    for (name, loaded) in [
        ("x86-server", "x86-server"),
        ("arm64-server", "arm64-server"),
        ("host", "host-2core-nested"),
    ] {
        let args = ["demand-paging", "-b", "4M", "--clock", "virtual"];
        let r = common::json(&[&args[..], &["--cost-profile", name]].concat());
        assert_eq!(r["clock_profile"], loaded, "{name}");
    }
    let bad = temp("bad.toml");
    std::fs::write(&bad, "name = 3\n").unwrap();
    let missing = temp("missing.toml");
    let binary = temp("binary.toml");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x80]).unwrap();
    // A device is refused after a bounded read, not read until memory runs out.
    let zero = std::path::PathBuf::from("/dev/zero");
    let dir = std::env::temp_dir();
    let cases = [
        (&bad, "virtual"),
        (&missing, "virtual"),
        (&binary, "virtual"),
        (&zero, "virtual"),
        (&dir, "virtual"),
        (&good, "real"),
    ];
    for (file, clock) in cases {
        let f = file.to_str().unwrap();
        let args = [
            "demand-paging",
            "-b",
            "4M",
            "--clock",
            clock,
            "--cost-profile",
            f,
        ];
        let (code, out, err) = common::slat(&args);
        assert_eq!(code, 2, "slat {}: {out}{err}", args.join(" "));
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--cost-profile"), "{err}");
        if clock == "virtual" {
            assert!(err.contains(f), "{err}");
        }
        if file == &zero {
            assert!(err.contains("larger than"), "refused unread: {err}");
        }
    }
    let _ = std::fs::remove_file(&good);
    let _ = std::fs::remove_file(&bad);
    let _ = std::fs::remove_file(&binary);
}
