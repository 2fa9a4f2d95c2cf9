//! Selftest parity flags: `-c` pins vCPU threads (bad lists exit 2 with one line),
//! `demand-paging -u MISSING|MINOR` serves every first touch through userfaultfd, and
//! access-tracking-perf's `--idle-check auto` / `-w`.

use crate::common;

use common::{json, ok, slat};
use serde_json::Value;

/// Exit 2, nothing on stdout, one line on stderr containing `needle`.
fn refused(args: &[&str], needle: &str) {
    let (code, out, err) = slat(args);
    let cmd = args.join(" ");
    assert_eq!(code, 2, "slat {cmd}: status {code}\n{out}\n{err}");
    assert!(out.is_empty(), "slat {cmd} printed: {out}");
    assert_eq!(err.lines().count(), 1, "slat {cmd}: {err}");
    assert!(err.contains(needle), "slat {cmd}: {err:?} lacks {needle:?}");
    assert!(!err.contains("panicked"), "{err}");
}

/// This process's allowed CPUs (the CLI checks against the same set).
fn cpus() -> Vec<usize> {
    slat_workload::cpus::allowed_cpus().expect("affinity")
}

#[test]
fn bad_cpu_lists_exit_2() {
    for bench in [
        "demand-paging",
        "dirty-log-perf",
        "access-tracking-perf",
        "snapshot-perf",
        "page-table-test",
    ] {
        refused(&[bench, "-b", "1M", "-c", "abc"], "CPU list");
        refused(&[bench, "-b", "1M", "-c", "3-1"], "backwards");
        refused(&[bench, "-b", "1M", "-c", "0,"], "CPU list");
        refused(&[bench, "-b", "1M", "-c", "1000"], "not online");
        refused(
            &[bench, "-b", "1M", "-v", "2", "-c", "0"],
            "one CPU per vCPU",
        );
        refused(&[bench, "-b", "1M", "-c", "0,0,0"], "at most one per vCPU");
    }
    refused(
        &["access-tracking-perf", "-b", "1M", "-c", "0", "--compare"],
        "--compare",
    );
    refused(
        &[
            "dirty-log-perf",
            "-b",
            "1M",
            "-c",
            "0",
            "--vary",
            "vcpus=1,2",
        ],
        "one CPU per vCPU",
    );
}

#[test]
fn good_cpu_list_pins_every_vcpu() {
    let c = cpus();
    let (a, b) = (*c.last().unwrap(), c[0]);
    let list = format!("{a},{b}");
    for bench in ["demand-paging", "dirty-log-perf"] {
        let d = json(&[bench, "-b", "1M", "-v", "2", "-c", &list]);
        let got: Vec<u64> = d["config"]["pinned_cpus"]
            .as_array()
            .unwrap_or_else(|| panic!("{bench}: no pinned_cpus in {}", d["config"]))
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(got, vec![a as u64, b as u64], "{bench}");
        let out = ok(&[bench, "-b", "1M", "-v", "2", "-c", &list]);
        assert!(
            out.contains(&format!("vCPU 0 on CPU {a}, vCPU 1 on CPU {b}")),
            "{out}"
        );
    }
    // snapshot-perf's runs are in an envelope.
    let args = [
        "snapshot-perf",
        "-b",
        "1M",
        "-v",
        "2",
        "-k",
        "1",
        "-i",
        "3",
        "-c",
        &list,
    ];
    let d = json(&args);
    let want = serde_json::json!([a, b]);
    assert_eq!(d["runs"][0]["config"]["pinned_cpus"], want);
    let out = ok(&args);
    assert!(
        out.contains(&format!("vCPU 0 on CPU {a}, vCPU 1 on CPU {b}")),
        "{out}"
    );
    // page-table-test's vCPUs share one region; its report has the field at the top.
    let args = ["page-table-test", "-b", "1M", "-v", "2", "-c", &list];
    let d = json(&args);
    assert_eq!(d["pinned_cpus"], want);
    let out = ok(&args);
    assert!(
        out.contains(&format!("vCPU 0 on CPU {a}, vCPU 1 on CPU {b}")),
        "{out}"
    );
    // One more CPU pins the main thread too.
    let list = format!("{a},{b}");
    let d = json(&["access-tracking-perf", "-b", "4M", "-c", &list]);
    assert_eq!(d["config"]["pinned_cpus"], serde_json::json!([a]));
    // Without -c there is no pinning field.
    let d = json(&["demand-paging", "-b", "1M"]);
    assert!(d["config"].get("pinned_cpus").is_none());
}

#[test]
fn kvm_vcpu_threads_are_pinned_too() {
    if !std::path::Path::new("/dev/kvm").exists() {
        eprintln!("no /dev/kvm: skipped");
        return;
    }
    let a = *cpus().last().unwrap();
    let d = json(&[
        "demand-paging",
        "-b",
        "1M",
        "--backend",
        "kvm",
        "-c",
        &a.to_string(),
    ]);
    assert_eq!(d["config"]["pinned_cpus"], serde_json::json!([a]));
}

#[test]
fn idle_check_auto_and_w() {
    let vm = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "hypervisor"));
    let numa = std::fs::read_to_string("/proc/sys/kernel/numa_balancing")
        .map(|v| v.trim() != "0")
        .unwrap_or(false);
    let d = json(&["access-tracking-perf", "-b", "4M"]);
    let expect = if vm || numa { "warn" } else { "fail" };
    assert_eq!(d["config"]["idle_check"], expect, "{}", d["config"]);
    assert!(d["config"]["idle_check_reason"]
        .as_str()
        .unwrap()
        .starts_with("auto:"));
    let d = json(&["access-tracking-perf", "-b", "4M", "-w", "1"]);
    assert_eq!(d["config"]["idle_check"], "warn");
    assert!(d["config"].get("idle_check_reason").is_none());
    let d = json(&["access-tracking-perf", "-b", "4M", "-w", "-1"]);
    assert_eq!(d["config"]["idle_check"], expect);
    let d = json(&["access-tracking-perf", "-b", "4M", "--idle-check", "warn"]);
    assert_eq!(d["config"]["idle_check"], "warn");
    let (code, _, err) = slat(&[
        "access-tracking-perf",
        "-b",
        "4M",
        "-w",
        "0",
        "--idle-check",
        "warn",
    ]);
    assert_eq!(code, 2, "{err}");
}

/// The run's `uffd` figures, checked: every page served once and verified.
fn served(d: &Value, pages_4k: u64, page_size: u64) {
    let u = &d["uffd"];
    assert_eq!(u["page_size"], page_size, "{u}");
    assert_eq!(u["pages_served"], pages_4k * 4096 / page_size, "{u}");
    assert_eq!(u["pages_verified"], pages_4k, "{u}");
    let per: u64 = u["per_handler_pages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(per, u["pages_served"].as_u64().unwrap(), "{u}");
}

#[test]
fn uffd_missing_serves_every_page() {
    let d = json(&["demand-paging", "-u", "MISSING", "-v", "2", "-b", "8M"]);
    served(&d, 4096, 4096);
    assert_eq!(d["uffd"]["mode"], "MISSING");
    assert_eq!(d["uffd"]["ioctl"], "UFFDIO_COPY");
    assert_eq!(d["uffd"]["uffds"], 2);
    assert_eq!(d["config"]["prefault"], false);
    let out = ok(&[
        "demand-paging",
        "-u",
        "MISSING",
        "-b",
        "4M",
        "-d",
        "1",
        "-r",
        "2",
    ]);
    assert!(
        out.contains("Finished creating vCPUs and starting uffd threads"),
        "{out}"
    );
    assert!(
        out.contains("userfaultfd -u MISSING: 1024 pages served with UFFDIO_COPY"),
        "{out}"
    );
    assert!(
        out.contains("by 2 handler thread(s) on 1 userfaultfd(s)"),
        "{out}"
    );
    assert!(out.contains("delay 1 us"), "{out}");
    // 2 MiB pages: one copy per huge page, one userfaultfd with -a.
    let d = json(&[
        "demand-paging",
        "-u",
        "MISSING",
        "-v",
        "2",
        "-b",
        "4M",
        "-s",
        "anonymous_thp",
        "-a",
    ]);
    served(&d, 2048, 2 << 20);
    assert_eq!(d["uffd"]["uffds"], 1);
}

#[test]
fn uffd_minor_serves_every_page() {
    let d = json(&[
        "demand-paging",
        "-u",
        "MINOR",
        "-v",
        "2",
        "-b",
        "8M",
        "-s",
        "shmem",
    ]);
    served(&d, 4096, 4096);
    assert_eq!(d["uffd"]["ioctl"], "UFFDIO_CONTINUE");
}

#[test]
fn uffd_on_kvm_serves_every_page() {
    if !std::path::Path::new("/dev/kvm").exists() {
        eprintln!("no /dev/kvm: skipped");
        return;
    }
    let d = json(&[
        "demand-paging",
        "-u",
        "MISSING",
        "-v",
        "2",
        "-b",
        "4M",
        "--backend",
        "kvm",
    ]);
    served(&d, 2048, 4096);
}

#[test]
fn no_uffd_no_uffd_line() {
    let out = ok(&["demand-paging", "-b", "1M"]);
    assert!(!out.contains("uffd"), "{out}");
    assert!(out.contains("Finished creating vCPUs\n"), "{out}");
    let d = json(&["demand-paging", "-b", "1M"]);
    assert!(d.get("uffd").is_none());
}

#[test]
fn uffd_bad_input_exits_2() {
    refused(&["demand-paging", "-b", "1M", "-u", "MINOR"], "-s shmem");
    refused(&["demand-paging", "-b", "1M", "-u", "SOMETIMES"], "-u");
    refused(&["demand-paging", "-b", "1M", "-d", "10"], "-d");
    refused(&["demand-paging", "-b", "1M", "-a"], "-a");
    refused(&["demand-paging", "-b", "1M", "-r", "2"], "-r");
    refused(
        &[
            "demand-paging",
            "-b",
            "1M",
            "-u",
            "MISSING",
            "-d",
            "2000000",
        ],
        "-d",
    );
    refused(
        &["demand-paging", "-b", "1M", "-u", "MISSING", "-r", "0"],
        "-r",
    );
    refused(
        &[
            "demand-paging",
            "-b",
            "1M",
            "-u",
            "MINOR",
            "-s",
            "shmem",
            "--backend",
            "kvm",
        ],
        "shmem",
    );
}

#[test]
fn guest_mode_is_the_one_x86_mode() {
    for bench in ["demand-paging", "dirty-log-perf", "access-tracking-perf"] {
        refused(&[bench, "-b", "1M", "-m", "1"], "-m");
    }
    ok(&["demand-paging", "-b", "1M", "-m", "0"]);
}
