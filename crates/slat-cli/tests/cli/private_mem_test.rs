//! `slat private-mem-test` through the binary: every policy passes and says so, the JSON
//! carries the result, bad input exits 2 with one line.

use crate::common;

use common::slat;
use serde_json::Value;

#[test]
fn every_policy_passes() {
    for policy in ["2m-split", "4k", "none"] {
        for flush in ["on", "off"] {
            let (code, out, err) = slat(&[
                "private-mem-test",
                "-v",
                "2",
                "-b",
                "4M",
                "-i",
                "2",
                "--direct-map",
                policy,
                "--kernel-flush",
                flush,
                "--collapse",
                "--json",
            ]);
            assert_eq!(code, 0, "{policy} {flush}:\n{out}\n{err}");
            let d: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(d["benchmark"], "private-mem-test");
            assert_eq!(d["passed"], true);
            let r = &d["result"];
            assert_eq!(r["violations"], 0, "{r:#}");
            assert!(r["accesses_checked"].as_u64().unwrap() > 4000, "{r:#}");
            assert_eq!(r["accepted"], 2 * 2 * 1024, "{r:#}");
            assert_eq!(r["host_isolation_checked"], policy != "none");
        }
    }
    let (code, out, _) = slat(&["private-mem-test", "-b", "4M", "-i", "1"]);
    assert_eq!(code, 0);
    assert!(out.contains("PASS"), "{out}");
}

#[test]
fn bad_input_exits_2_with_one_line() {
    for (args, needle) in [
        (&["private-mem-test", "-b", "0"][..], "greater than zero"),
        (&["private-mem-test", "-b", "5000"], "4 KiB"),
        (&["private-mem-test", "-b", "5G"], "4 GiB"),
        (&["private-mem-test", "-v", "0"], "-v"),
        (
            &["private-mem-test", "-v", "64", "-b", "4G"],
            "more than this host",
        ),
        (&["private-mem-test", "-i", "0"], "rounds"),
        (&["private-mem-test", "--direct-map", "1g"], "2m-split"),
        (
            &["private-mem-test", "--kernel-flush", "yes"],
            "--kernel-flush",
        ),
        (&["private-mem-test", "--seed", "x"], "--seed"),
    ] {
        let (code, out, err) = slat(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains(needle),
            "{args:?}: {err:?} does not name {needle:?}"
        );
        assert!(out.is_empty(), "{args:?}: {out}");
    }
}

#[test]
fn help_explains_every_flag() {
    let (code, out, _) = slat(&["private-mem-test", "--help"]);
    assert_eq!(code, 0);
    for flag in [
        "-v",
        "-b",
        "--rounds",
        "--seed",
        "--direct-map",
        "--kernel-flush",
        "--collapse",
        "--json",
    ] {
        assert!(out.contains(flag), "{flag}: {out}");
    }
}
