//! `slat snapshot-perf --clock virtual`: the host CPU that harvests and resets is a simulated
//! CPU, a reset's page copies and zeroings are charged from the cost profile, so the same
//! command twice gives the same report (apart from wall time and host facts), and a reset's
//! virtual time follows the dirty pages, not the guest's size.

use crate::common;
use serde_json::Value;

/// The report without what may differ between two runs of one virtual command: host facts,
/// wall time and the simulation's speed, and each row's resident memory.
fn deterministic(mut r: Value) -> Value {
    let o = r.as_object_mut().expect("a report object");
    o.remove("host");
    for run in o
        .get_mut("runs")
        .and_then(Value::as_array_mut)
        .expect("runs")
    {
        let run = run.as_object_mut().expect("a run object");
        for k in ["sim_wall_s", "sim_accesses_per_s", "sim_faults_per_s"] {
            assert!(run.remove(k).is_some(), "a virtual run reports {k}");
        }
        for row in run
            .get_mut("rows")
            .and_then(Value::as_array_mut)
            .expect("rows")
        {
            row.as_object_mut().expect("a row").remove("rss_mib");
        }
    }
    r
}

fn run_of(r: &Value) -> &Value {
    &r["runs"][0]
}

/// The row of `k` pages per vCPU.
fn row(r: &Value, k: u64) -> &Value {
    run_of(r)["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|x| x["k_per_vcpu"] == k)
        .expect("a row per -k")
}

fn num(v: &Value) -> f64 {
    v.as_f64().expect("a number")
}

#[test]
fn snapshot_perf_in_virtual_time_is_deterministic() {
    let args = [
        "snapshot-perf",
        "-v",
        "2",
        "-b",
        "2M",
        "-k",
        "1,16,all",
        "-i",
        "5",
        "--verify",
        "--clock",
        "virtual",
    ];
    let (a, b) = (common::json(&args), common::json(&args));
    common::schema::validate("snapshot-perf.json", &a);
    let (a, b) = (deterministic(a), deterministic(b));
    assert_eq!(a, b, "slat {} twice", args.join(" "));
    let run = run_of(&a);
    assert_eq!(run["clock"], "virtual");
    assert_eq!(run["clock_profile"], "host-2core-nested");
    assert!(run["sim_accesses"].as_u64().unwrap() > 0);
    // The profile prices a full copy per page: it never beats the dirty pages' copies.
    assert_eq!(run["config"]["crossover_fraction"], 1.0);
    for r in run["rows"].as_array().unwrap() {
        assert_eq!(r["full_resets"], 0, "{r}");
        assert_eq!(r["verified"], 5, "{r}");
        assert!(num(&r["reset_p50_us"]) > 0.0 && num(&r["pass_mean_us"]) > 0.0);
    }
    assert!(num(&run["full_copy"]["p50_us"]) > num(&row(&a, 16)["reset_p50_us"]));
}

/// A reset's virtual time grows with the pages dirtied and stays put when the guest grows:
/// the copies are charged per dirty page, and the harvest and re-arm run through the engine,
/// whose dirty log finds the dirty pages without scanning the guest.
#[test]
fn a_virtual_reset_follows_the_dirty_pages_not_the_guest_size() {
    let at = |size: &str| {
        common::json(&[
            "snapshot-perf",
            "-v",
            "2",
            "-b",
            size,
            "-k",
            "1,256",
            "-i",
            "3",
            "--clock",
            "virtual",
        ])
    };
    let (small, big) = (at("2M"), at("32M"));
    let reset = |r: &Value, k| num(&row(r, k)["reset_mean_us"]);
    let copy = |r: &Value, k| num(&row(r, k)["copy_mean_us"]);
    // 256 times the dirty pages: 256 times the copying (to the clock's whole nanoseconds),
    // and most of the reset.
    let c = copy(&small, 256) / copy(&small, 1);
    assert!(
        (c - 256.0).abs() < 2.56,
        "copy time x{c} for 256x the pages"
    );
    let grown = reset(&small, 256) - reset(&small, 1);
    assert!(
        reset(&small, 256) > 64.0 * reset(&small, 1),
        "reset {} us at k=256 against {} us at k=1",
        reset(&small, 256),
        reset(&small, 1)
    );
    // A guest 16 times larger: each reset moves by under 1% of what the dirty pages added.
    for k in [1, 256] {
        let d = (reset(&big, k) - reset(&small, k)).abs();
        assert!(
            d < grown / 100.0,
            "k={k}: reset {} us on 32M against {} us on 2M",
            reset(&big, k),
            reset(&small, k)
        );
    }
}

/// Phantom memory keeps no data to snapshot: refused before the clock is looked at, and the
/// KVM machine is refused in virtual time (one line, exit status 2).
#[test]
fn what_a_virtual_snapshot_cannot_run_is_refused() {
    for (args, says) in [
        (
            &[
                "snapshot-perf",
                "-s",
                "phantom",
                "-b",
                "1T",
                "--clock",
                "virtual",
            ][..],
            "snapshots copy guest memory",
        ),
        (
            &[
                "snapshot-perf",
                "-b",
                "4M",
                "--backend",
                "sim,kvm",
                "--clock",
                "virtual",
            ],
            "--clock virtual",
        ),
    ] {
        let (code, out, err) = common::slat(args);
        assert_eq!(code, 2, "slat {}: {out}{err}", args.join(" "));
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(says), "{err}");
    }
}
