//! `--clock virtual`: the same command twice gives the same virtual times (the report apart
//! from wall time, the native baseline and host facts), reports say which clock, and what
//! the simulation cannot run is refused with one line.

use crate::common;
use serde_json::Value;

/// The report without what may differ between two runs of one virtual command: wall time,
/// the native baseline (real time on host threads) and host facts.
fn deterministic(mut r: Value) -> Value {
    let o = r.as_object_mut().expect("a report object");
    for k in [
        "sim_wall_s",
        "host",
        "native",
        "ratio_guest_over_native",
        "populate_native_time_s",
    ] {
        o.remove(k);
    }
    if let Some(its) = o.get_mut("iterations").and_then(Value::as_array_mut) {
        for it in its {
            if let Some(it) = it.as_object_mut() {
                it.remove("native_memory_time_s");
                it.remove("ratio_guest_over_native");
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
            "dirty-log-perf",
            "-b",
            "4M",
            "--concurrent",
            "--clock",
            "virtual",
        ],
    ] {
        let (code, out, err) = common::slat(args);
        assert_eq!(code, 2, "slat {}: {out}{err}", args.join(" "));
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--clock virtual"), "{err}");
    }
}
