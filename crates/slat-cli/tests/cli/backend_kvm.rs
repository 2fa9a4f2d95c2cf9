//! `--backend kvm` and `--backend sim,kvm` through the `slat` binary, with small sizes. Skipped
//! (with a message) when the host has no usable /dev/kvm.

use crate::common;

use common::slat;

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
fn engine_only_flag_with_kvm_is_one_line_naming_it() {
    let (code, out, err) = slat(&["dirty-log-perf", "--backend", "kvm", "--fast-pf", "off"]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--fast-pf"), "{err}");
    let (code, _, err) = slat(&["demand-paging", "--backend", "foo"]);
    assert_eq!(code, 2);
    assert!(err.contains("foo"), "{err}");
}

#[test]
fn dirty_log_test_on_kvm_passes() {
    if kvm_unavailable() {
        return;
    }
    let (code, out, err) = slat(&[
        "dirty-log-test",
        "--backend",
        "kvm",
        "-M",
        "all",
        "-b",
        "4M",
        "-i",
        "2",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    for mode in ["dirty-log", "clear-log", "dirty-ring"] {
        assert!(out.contains(&format!("Log mode '{mode}': PASS")), "{out}");
    }
}

#[test]
fn dirty_log_perf_side_by_side_prints_one_table() {
    if kvm_unavailable() {
        return;
    }
    let (code, out, err) = slat(&["dirty-log-perf", "--backend", "sim,kvm", "-b", "8M"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("sim/kvm"), "{out}");
    for metric in [
        "populate memory",
        "iteration 2 dirty memory",
        "clear dirty log avg",
    ] {
        assert!(out.contains(metric), "{out}");
    }
    let (code, out, err) = slat(&["dirty-log-perf", "--backend", "kvm", "-b", "8M", "-g"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("Iteration 2 get dirty log time:"), "{out}");
    assert!(!out.contains("clear dirty log time"), "{out}");
}
