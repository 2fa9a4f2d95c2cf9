//! `-s phantom` through the binary: a terabyte guest is refused with one line (exit 2) by what
//! reads guest data back (dirty-log-test's oracle, snapshot-perf, migration) and by the kvm
//! machine; demand-paging and dirty-log-perf run on phantom guests and report the MMU's own
//! memory, which grows with what was touched; the reverse map is allocated only when the
//! write-protect variant uses it. A stray access to the reservation would kill the child with
//! SIGSEGV, so a run that exits 0 touched only the pool.

use crate::common;

use common::schema;
use common::{json, slat};
use serde_json::Value;

/// Exit 2, one line naming phantom memory.
fn refused(args: &[&str], why: &str) {
    let (code, out, err) = slat(args);
    assert_eq!(code, 2, "{args:?}: stdout {out}\nstderr {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: {err}");
    assert!(
        lines[0].contains("phantom") && lines[0].contains(why),
        "{args:?}: {err}"
    );
}

#[test]
fn a_terabyte_phantom_guest_is_refused_where_data_is_read_back() {
    refused(
        &["dirty-log-test", "-s", "phantom", "-b", "1T", "-v", "1"],
        "dirty-log-test's oracle reads guest data back",
    );
    refused(
        &["snapshot-perf", "-s", "phantom", "-b", "1T"],
        "snapshots copy guest memory",
    );
    refused(
        &[
            "demand-paging",
            "-s",
            "phantom",
            "-b",
            "1T",
            "--backend",
            "kvm",
        ],
        "only on the simulated machine",
    );
}

/// `args --json` on the simulated machine, validated against `file`.
fn report(file: &str, args: &[&str]) -> Value {
    let d = json(args);
    schema::validate(file, &d);
    d
}

fn mmu_total(d: &Value) -> u64 {
    d["mmu_memory"]["total_bytes"]
        .as_u64()
        .expect("mmu_memory.total_bytes")
}

#[test]
fn demand_paging_on_a_phantom_guest_reports_the_mmu_memory_it_touched() {
    let small = report(
        "demand-paging.json",
        &["demand-paging", "-s", "phantom", "-v", "2", "-b", "512M"],
    );
    let big = report(
        "demand-paging.json",
        &["demand-paging", "-s", "phantom", "-v", "2", "-b", "4G"],
    );
    assert_eq!(big["config"]["backing"], "phantom");
    let (s, b) = (mmu_total(&small), mmu_total(&big));
    // 8 GiB touched at 4K: 4096 leaf tables of 8 KiB, 32 MiB, eight times the 1 GiB run's.
    assert!(b > 7 * s && b < 9 * s, "{s} {b}");
    assert!((32 << 20..34 << 20).contains(&b), "{b}");
    let per_gib = big["mmu_memory"]["bytes_per_gib_of_guest"]
        .as_f64()
        .unwrap();
    assert!((4.0e6..4.5e6).contains(&per_gib), "{per_gib}");
    assert_eq!(big["mmu_memory"]["rmap_bytes"], 0);
}

#[test]
fn the_rmap_is_allocated_only_for_the_write_protect_variants_that_use_it() {
    let run = |wrprot: &str| {
        report(
            "dirty-log-perf.json",
            &[
                "dirty-log-perf",
                "-s",
                "phantom",
                "-v",
                "1",
                "-b",
                "64M",
                "-i",
                "2",
                "--wrprot",
                wrprot,
            ],
        )
    };
    let walk = run("walk");
    assert_eq!(walk["mmu_memory"]["rmap_bytes"], 0, "{walk:#}");
    assert!(walk["mmu_memory"]["bitmap_bytes"].as_u64().unwrap() > 0);
    for v in ["rmap", "rmap-lockless"] {
        let r = run(v);
        // One 8-byte slot per 4 KiB page at least.
        let rmap = r["mmu_memory"]["rmap_bytes"].as_u64().unwrap();
        assert!(rmap >= (64 << 20) / 4096 * 8, "{v}: {rmap}");
    }
}

#[test]
fn private_mem_perf_faults_in_a_phantom_confidential_guest() {
    let d = report(
        "private-mem-perf.json",
        &[
            "private-mem-perf",
            "--backend",
            "sim",
            "--phantom",
            "-v",
            "2",
            "-b",
            "64M",
            "--direct-map",
            "4k",
            "--kernel-flush",
            "off",
        ],
    );
    assert_eq!(d["config"]["phantom"], true, "{d:#}");
    let (code, _, err) = slat(&["private-mem-perf", "--phantom", "-b", "1T"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--phantom configures the simulated direct map"),
        "{err}"
    );
}
