//! `--clock virtual`: the same command twice gives the same virtual times (the report apart
//! from wall time, the native baseline and host facts), reports say which clock, and what
//! the simulation cannot run is refused with one line.

use crate::common;
use serde_json::Value;

/// The report without what may differ between two runs of one virtual command: wall time,
/// the native baseline (real time on host threads) and host facts.
/// `page-table-test -v 2 -b BYTES --clock virtual`: two vCPUs writing one shared region.
fn two_vcpus_on_one_region(bytes: &str) -> [&str; 7] {
    [
        "page-table-test",
        "-v",
        "2",
        "-b",
        bytes,
        "--clock",
        "virtual",
    ]
}

fn deterministic(mut r: Value) -> Value {
    let o = r.as_object_mut().expect("a report object");
    for k in [
        "sim_wall_s",
        "sim_accesses_per_s",
        "sim_faults_per_s",
        "host",
        "native",
        "ratio_guest_over_native",
        "populate_native_time_s",
    ] {
        o.remove(k);
    }
    // Per-pass and per-stage native baselines (real time on host threads).
    for list in ["iterations", "passes", "stages"] {
        if let Some(its) = o.get_mut(list).and_then(Value::as_array_mut) {
            for it in its {
                if let Some(it) = it.as_object_mut() {
                    for k in [
                        "native_memory_time_s",
                        "native_time_s",
                        "ratio_guest_over_native",
                        "ratio",
                    ] {
                        it.remove(k);
                    }
                }
            }
        }
    }
    r
}

fn twice(args: &[&str]) -> Value {
    let a = deterministic(common::json(args));
    let b = deterministic(common::json(args));
    assert_eq!(a, b, "slat {} twice", args.join(" "));
    a
}

#[test]
fn demand_paging_in_virtual_time_is_deterministic() {
    let args = ["demand-paging", "-v", "4", "-b", "8M", "--clock", "virtual"];
    let r = twice(&args);
    assert_eq!(r["clock"], "virtual");
    assert_eq!(r["clock_profile"], "host-2core-nested");
    assert!(r["total_guest_execution_time_s"].as_f64().unwrap() > 0.0);
    // The speed figures: every page touched once, each a fault, plus the faults retried
    // (two vCPUs linking the same upper-level table together: the later one's
    // compare-and-swap loses).
    assert_eq!(r["sim_accesses"], 4 * 2048);
    assert_eq!(r["stats"]["pf_fixed"], 4 * 2048);
    let retried = r["stats"]["pf_retry"].as_u64().unwrap();
    assert_eq!(r["sim_faults"].as_u64().unwrap(), 4 * 2048 + retried);
    assert!(r["sim_lookahead_ns"].as_f64().unwrap() > 0.0);
    common::schema::validate("demand-paging.json", &common::json(&args));
}

#[test]
fn dirty_log_perf_in_virtual_time_is_deterministic() {
    let args = [
        "dirty-log-perf",
        "-v",
        "3",
        "-b",
        "8M",
        "-i",
        "2",
        "--clock",
        "virtual",
    ];
    let r = twice(&args);
    assert_eq!(r["clock"], "virtual");
    assert!(r["iterations"][1]["dirty_memory_time_s"].as_f64().unwrap() > 0.0);
    common::schema::validate("dirty-log-perf.json", &common::json(&args));
}

/// The concurrent harvest: the host harvests on its own simulated CPU (host CPU 0) while the
/// vCPUs keep writing, between harvests a timer's sleep in virtual time.
#[test]
fn concurrent_harvest_in_virtual_time_is_deterministic() {
    for wrprot in ["walk", "rmap-lockless"] {
        let args = [
            "dirty-log-perf",
            "-v",
            "3",
            "-b",
            "4M",
            "-i",
            "3",
            "-g",
            "--concurrent",
            "--wrprot",
            wrprot,
            "--clock",
            "virtual",
        ];
        let r = twice(&args);
        assert_eq!(r["clock"], "virtual");
        let c = &r["concurrent"];
        assert_eq!(c["concurrent"]["harvests"], 3);
        assert!(c["concurrent"]["harvest_avg_s"].as_f64().unwrap() > 0.0);
        assert!(c["concurrent"]["write_latency"]["count"].as_u64().unwrap() > 0);
        // The vCPUs wrote for the interval before each harvest: a harvest finds pages.
        let h = c["concurrent_harvests"].as_array().unwrap();
        assert!(h.iter().all(|h| h["dirty_pages"].as_u64().unwrap() > 0));
        common::schema::validate("dirty-log-perf.json", &common::json(&args));
    }
}

/// The simulated direct map: the vCPUs (the direct map's host CPUs) and the sampler are
/// simulated CPUs, each variant a simulation of its own.
#[test]
fn private_mem_perf_in_virtual_time_is_deterministic() {
    let args = [
        "private-mem-perf",
        "--backend",
        "sim",
        "-v",
        "4",
        "-b",
        "4M",
        "--vary",
        "direct-map=2m-split,4k",
        "--kernel-flush",
        "off",
        "--clock",
        "virtual",
    ];
    // Without host facts, the native floor (real time on host threads) and the wall-time
    // figures of each run's simulations.
    let strip = |mut r: Value| {
        r.as_object_mut().unwrap().remove("host");
        for run in r["runs"].as_array_mut().unwrap() {
            let run = run.as_object_mut().unwrap();
            for k in [
                "native",
                "sim_wall_s",
                "sim_accesses_per_s",
                "sim_faults_per_s",
            ] {
                run.remove(k);
            }
            for row in run["rows"].as_array_mut().unwrap() {
                row.as_object_mut().unwrap().remove("ratio_over_native");
            }
        }
        r
    };
    let (a, b) = (strip(common::json(&args)), strip(common::json(&args)));
    assert_eq!(a, b, "slat {} twice", args.join(" "));
    let run = &a["runs"][0];
    assert_eq!(run["clock"], "virtual");
    // Two variants, each faulting in every page once.
    assert_eq!(run["sim_faults"], 2 * 4 * 1024);
    let rows = run["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for row in rows {
        assert_eq!(row["accepted"], 4 * 1024);
        assert!(row["fault_in_s"].as_f64().unwrap() > 0.0);
        assert!(!row["samples"].as_array().unwrap().is_empty());
    }
    common::schema::validate("private-mem-perf.json", &common::json(&args));
}

/// The dirty-log oracle with real memory in virtual time: every mode passes, the writers
/// run while the host's timer waits, and the same seed checks the same pages.
#[test]
fn dirty_log_test_passes_in_virtual_time_deterministically() {
    let args = [
        "dirty-log-test",
        "-v",
        "2",
        "-b",
        "16M",
        "-i",
        "3",
        "-I",
        "1",
        "--toggle-every",
        "2",
        "--clock",
        "virtual",
    ];
    let r = twice(&args);
    assert_eq!(r["clock"], "virtual");
    assert_eq!(r["pass"], true);
    let modes = r["modes"].as_array().unwrap();
    assert_eq!(modes.len(), 3);
    for m in modes {
        assert_eq!(m["pass"], true, "{m}");
        assert_eq!(m["lost"], 0);
        // Some pages written, some not: the oracle checks both directions.
        assert!(m["total_dirty"].as_u64().unwrap() > 0, "{m}");
        assert!(m["total_clean"].as_u64().unwrap() > 0, "{m}");
    }
    common::schema::validate("dirty-log-test.json", &common::json(&args));
}

#[test]
fn page_table_test_in_virtual_time_is_deterministic() {
    for format in ["ept", "stage2"] {
        let args = [
            "page-table-test",
            "-v",
            "2",
            "-b",
            "8M",
            "--format",
            format,
            "--clock",
            "virtual",
        ];
        let r = twice(&args);
        assert_eq!(r["clock"], "virtual");
        assert!(r["stages"][0]["time_s"].as_f64().unwrap() > 0.0);
        common::schema::validate("page-table-test.json", &common::json(&args));
    }
}

/// Two vCPUs writing the same pages in the same order fault on many of them together, as
/// real ones do (the later handler finds the entry fixed: a spurious fault). A vCPU running
/// ahead within the lookahead writes entries before the other walks them in real order but
/// after it in virtual time; walks that saw those writes early took almost no fault together
/// (15 and 8 spurious faults of 4,096 pages, against 477 and 1,613 once walks see entries as
/// they were at their own virtual time).
#[test]
fn vcpus_on_shared_pages_fault_together_in_virtual_time() {
    let args = two_vcpus_on_one_region("16M");
    let r = common::json(&args);
    let stages = r["stages"].as_array().expect("stages");
    let field = |i: usize, k: &str| stages[i][k].as_u64().unwrap_or(0);
    let pages = field(0, "pf_fixed");
    assert_eq!(pages, 4096, "{r}");
    let together = field(0, "pf_spurious") + field(1, "pf_spurious");
    assert!(
        together * 10 >= 2 * pages,
        "{together} spurious faults in create and update, of {pages} pages each"
    );
}

/// Runs after the first in one process (`--repeat`, as `slat reproduce` runs its rows) find
/// the heap in another state: their reports must not change with it. Two vCPUs writing every
/// page of one shared region (page-table-test's update stage) were enough for the line model
/// to see objects on other line boundaries (other transfers, other spurious faults).
#[test]
fn repeats_in_one_process_are_identical() {
    let args = [
        "page-table-test",
        "-v",
        "2",
        "-b",
        "8M",
        "--format",
        "stage2",
        "--clock",
        "virtual",
        "--repeat",
        "3",
    ];
    let r = common::json(&args);
    let runs: Vec<Value> = r["runs"]
        .as_array()
        .expect("--repeat reports its runs")
        .iter()
        .cloned()
        .map(deterministic)
        .collect();
    assert_eq!(runs.len(), 3);
    for (i, run) in runs.iter().enumerate().skip(1) {
        assert_eq!(run, &runs[0], "run {i} of slat {}", args.join(" "));
    }
    // ... and a run alone in its process is the same run (its report without the envelope
    // that --repeat puts around the runs).
    let mut alone = deterministic(common::json(&args[..args.len() - 2]));
    if let Some(o) = alone.as_object_mut() {
        o.remove("schema_version");
        o.remove("slat_version");
    }
    assert_eq!(alone, runs[0], "slat {} alone", args.join(" "));
}

#[test]
fn access_tracking_perf_in_virtual_time_is_deterministic() {
    // Two vCPUs without -o: two marking threads, simulated CPUs of their own.
    let args = [
        "access-tracking-perf",
        "-v",
        "2",
        "-b",
        "4M",
        "--clock",
        "virtual",
    ];
    let r = twice(&args);
    assert_eq!(r["clock"], "virtual");
    assert!(r["mark_memory_idle"][0]["time_s"].as_f64().unwrap() > 0.0);
    common::schema::validate("access-tracking-perf.json", &common::json(&args));
}

#[test]
fn real_time_reports_say_so() {
    let r = common::json(&["demand-paging", "-v", "1", "-b", "4M"]);
    assert_eq!(r["clock"], "real");
    assert!(r.get("clock_profile").is_none());
}

#[test]
fn what_the_simulation_cannot_run_is_refused() {
    for args in [
        &[
            "demand-paging",
            "-b",
            "4M",
            "-u",
            "MISSING",
            "--clock",
            "virtual",
        ][..],
        &[
            "demand-paging",
            "-b",
            "4M",
            "--backend",
            "kvm",
            "--clock",
            "virtual",
        ],
        &[
            "snapshot-perf",
            "-b",
            "4M",
            "--backend",
            "kvm",
            "--clock",
            "virtual",
        ],
        &[
            "dirty-log-test",
            "-b",
            "4M",
            "--backend",
            "kvm",
            "--clock",
            "virtual",
        ],
        &["private-mem-perf", "-b", "4M", "--clock", "virtual"],
    ] {
        let (code, out, err) = common::slat(args);
        assert_eq!(code, 2, "slat {}: {out}{err}", args.join(" "));
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--clock virtual"), "{err}");
    }
}

#[test]
fn the_lookahead_is_a_flag_of_virtual_runs() {
    let base = ["demand-paging", "-v", "4", "-b", "4M", "--clock", "virtual"];
    let with = |l: &str| {
        let mut a = base.to_vec();
        a.extend(["--lookahead", l]);
        common::json(&a)
    };
    let (a, b) = (with("0"), with("50000"));
    assert_eq!(a["sim_lookahead_ns"], 0.0);
    assert_eq!(b["sim_lookahead_ns"], 50000.0);
    assert_ne!(a["clock_profile_hash"], b["clock_profile_hash"]);
    // A longer lookahead passes the baton less often.
    assert!(b["sim_switches"].as_u64() < a["sim_switches"].as_u64());
    for args in [
        &["demand-paging", "-b", "4M", "--lookahead", "1000"][..],
        &base
            .iter()
            .copied()
            .chain(["--lookahead=-1"])
            .collect::<Vec<_>>(),
    ] {
        let (code, out, err) = common::slat(args);
        assert_eq!(code, 2, "slat {}: {out}{err}", args.join(" "));
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--lookahead"), "{err}");
    }
}

/// A retried fault costs the profile's `guest_round_trip`, what the real-time machine spends
/// in its PAUSE loop there. Stage-2 with a clean on every fault and break-first rebuilds
/// retries in CREATE at four vCPUs on one region; with the round trip at 100 µs instead of
/// the host's 1.5 µs the stage takes longer. (Before the cost existed a retry charged an exit
/// and an entry, and the two runs took the same time.)
#[test]
fn a_retried_fault_costs_the_profiles_guest_round_trip() {
    let host = include_str!("../../../slat-vt/profiles/host-2core-nested.toml");
    let key = "[costs.guest_round_trip]\nns = ";
    let at = host.find(key).expect("the entry") + key.len();
    let end = at + host[at..].find('\n').expect("its line");
    let dear = format!("{}100000.0{}", &host[..at], &host[end..]);
    let path = std::env::temp_dir().join(format!("slat-grt-{}.toml", std::process::id()));
    std::fs::write(&path, dear).unwrap();
    let create = |profile: &str| {
        let r = common::json(&[
            "page-table-test",
            "-b",
            "16M",
            "-v",
            "4",
            "--format",
            "stage2",
            "--cmo",
            "always",
            "--rebuild",
            "break-first",
            "--clock",
            "virtual",
            "--cost-profile",
            profile,
        ]);
        let s = &r["stages"][0];
        (
            s["time_s"].as_f64().unwrap(),
            s["pf_retry"].as_u64().unwrap(),
        )
    };
    let (base, retries) = create("host");
    let (dear, dear_retries) = create(path.to_str().unwrap());
    let _ = std::fs::remove_file(&path);
    assert!(
        retries > 0 && dear_retries > 0,
        "no retry: {retries}, {dear_retries}"
    );
    assert!(
        dear > base + 50e-6,
        "{dear_retries} retries at 100 µs: {dear} s against {base} s"
    );
}

/// A virtual report says what the contention model did (`sim_model`), per stage where the
/// benchmark has stages, and its counts are the run's: every fault is one fault-path charge,
/// every guest access one `guest_access`, a run's counters at least its stages' sum, and a
/// benchmark that runs each variant in a simulation of its own reports their sum.
#[test]
fn virtual_reports_say_what_the_model_charged() {
    let args = two_vcpus_on_one_region("16M");
    let r = common::json(&args);
    let n = |v: &Value, a: &str, b: &str| v[a][b].as_u64().unwrap_or(0);
    let run = &r["sim_model"];
    let mut transfers = 0;
    for s in r["stages"].as_array().expect("stages") {
        let m = &s["sim_model"];
        assert!(m.is_object(), "stage without sim_model: {s}");
        let faults = n(m, "charges", "fast_fault") + n(m, "charges", "slow_fault");
        assert_eq!(faults, s["faults"].as_u64().unwrap(), "{s}");
        assert_eq!(n(m, "charges", "guest_access"), 2 * 4096, "{s}");
        transfers += n(m, "lines", "transfers");
    }
    assert!(transfers > 0, "two vCPUs on one region moved no line: {r}");
    assert!(n(run, "lines", "transfers") >= transfers, "{run}");
    common::schema::validate("page-table-test.json", &r);
    let text = common::ok(&args);
    assert!(text.contains("Model: "), "{text}");

    let real = common::json(&["page-table-test", "-v", "2", "-b", "16M"]);
    assert!(real.get("sim_model").is_none());
    assert!(real["stages"][0].get("sim_model").is_none());

    let pmp = common::json(&[
        "private-mem-perf",
        "--backend",
        "sim",
        "-v",
        "2",
        "-b",
        "4M",
        "--vary",
        "direct-map=2m-split,4k",
        "--clock",
        "virtual",
    ]);
    let run = &pmp["runs"][0];
    let rows = run["rows"].as_array().expect("rows");
    let sum: u64 = rows
        .iter()
        .map(|row| n(&row["sim_model"], "lines", "rmws"))
        .sum();
    assert!(sum > 0, "{run}");
    assert_eq!(n(&run["sim_model"], "lines", "rmws"), sum, "{run}");
    common::schema::validate("private-mem-perf.json", &pmp);
}

/// A guest store retires into its CPU's store buffer: the vCPU goes on while the line comes
/// from the other vCPU. Two vCPUs writing the same pages in the update stage then keep pace
/// and fault on the same page together, as real ones do (82–90% of pages on this host, the
/// later handler finding the entry fixed). When each store stalled its vCPU for the
/// transfer, the vCPU behind paid one per page that the one ahead did not, never caught up,
/// and collided on 13% of the pages (2,158 of 16,384; 47% with the store buffer, 32% once
/// a collision's handler could also lose its compare-and-swap).
#[test]
fn vcpus_writing_together_keep_pace_through_their_store_buffers() {
    let r = common::json(&two_vcpus_on_one_region("64M"));
    let update = &r["stages"][1];
    assert_eq!(update["stage"], "KVM_UPDATE_MAPPINGS");
    let (pages, together) = (
        update["pf_fast"].as_u64().unwrap(),
        update["pf_spurious"].as_u64().unwrap(),
    );
    assert_eq!(pages, 16384, "{update}");
    assert!(
        together * 4 >= pages,
        "{together} of {pages} pages faulted on together in the update stage"
    );
}

/// Two vCPUs faulting on one page together: the handler that read the entry before the other
/// vCPU's install completed (in virtual time) loses its compare-and-swap, and the slow path
/// retries, as real ones do (5–8 thousand retried faults of 262,144 pages in the create stage
/// of `-b 1G -v 2` on this host). The handler used to read the entry as memory held it, found
/// it fixed, and no fault was ever retried (0 at `-b 16M`, 22 now).
#[test]
fn a_collisions_handler_that_read_first_loses_its_compare_and_swap() {
    let r = common::json(&two_vcpus_on_one_region("16M"));
    let create = &r["stages"][0];
    assert_eq!(create["stage"], "KVM_CREATE_MAPPINGS");
    let retried = create["pf_retry"].as_u64().unwrap();
    assert!(retried > 0, "no fault retried: {create}");
    let lost = create["sim_model"]["versions"]["handler_stale_reads"]
        .as_u64()
        .unwrap();
    assert!(lost >= retried, "{lost} older reads for {retried} retries");
    assert_eq!(
        create["pf_fixed"], 4096,
        "every page installed once: {create}"
    );
}
