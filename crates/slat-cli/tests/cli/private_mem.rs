//! `slat private-mem-perf --backend host` through the binary: its `--json` validates against
//! `schema/private-mem-perf.json` (the validator refuses a broken document), the figures hang
//! together (four fills, rates above zero, samples that add up to the fill, counter deltas that
//! match the before/after readings), `--repeat` summarizes, the text says whose cost it is,
//! and bad input exits 2 with one line. Small sizes: a memfd_secret fill runs at a few hundred
//! MB/s on a nested host.
//!
//! A host without memfd_secret (a kernel without CONFIG_SECRETMEM, or with it disabled) must
//! fail the run with status 1 and one line saying so; the figure checks then have nothing to
//! check and say so on stderr.

use crate::common;

use common::schema;
use common::slat;
use serde_json::Value;

const FILE: &str = "private-mem-perf.json";

/// Runs with `--json`; `None` (after checking the one-line refusal) where memfd_secret is
/// unavailable.
fn run(args: &[&str]) -> Option<Value> {
    let mut v = vec!["private-mem-perf", "--backend", "host"];
    v.extend_from_slice(args);
    v.push("--json");
    let (code, out, err) = slat(&v);
    if code == 1 && err.contains("memfd_secret(2) is unavailable") {
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        eprintln!("memfd_secret is unavailable on this host, nothing measured: {err}");
        return None;
    }
    assert_eq!(code, 0, "slat {}:\n{out}\n{err}", v.join(" "));
    Some(serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}\n{out}")))
}

fn n(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// `after - before == delta` wherever all three are known.
fn direct_map_adds_up(row: &Value) {
    for k in [
        "direct_map_4k_kib",
        "direct_map_2m_kib",
        "direct_map_1g_kib",
    ] {
        let (b, a, d) = (
            &row["direct_map_before"][k],
            &row["direct_map_after"][k],
            &row["direct_map_delta"][k],
        );
        if let (Some(b), Some(a), Some(d)) = (b.as_i64(), a.as_i64(), d.as_i64()) {
            assert_eq!(a - b, d, "{k}: {row:#}");
        }
    }
}

fn row_hangs_together(row: &Value, threads: usize, bytes: u64) {
    assert_eq!(row["bytes"], bytes);
    assert!(n(&row["gb_per_s"]) > 0.0, "{row:#}");
    assert!(n(&row["fill_s"]) > 0.0);
    let per_thread = row["per_thread_gb_per_s"].as_array().unwrap();
    assert_eq!(per_thread.len(), threads);
    assert!(per_thread.iter().all(|r| n(r) > 0.0));
    // Counters are non-negative or null (the schema's `minimum: 0` on integers).
    let c = &row["counters"];
    for k in ["level2_splits", "level3_splits", "tlb_shootdowns"] {
        assert!(c[k].is_null() || c[k].as_u64().is_some(), "{k}: {c}");
    }
    // Every byte the threads wrote lands in exactly one sample, and there is at least one.
    let samples = row["samples"].as_array().unwrap();
    assert!(!samples.is_empty(), "{row:#}");
    let sampled: u64 = samples.iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
    assert_eq!(sampled, bytes, "{row:#}");
    let times: Vec<f64> = samples.iter().map(|s| n(&s["t_s"])).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    direct_map_adds_up(row);
}

#[test]
fn json_matches_its_schema_and_the_figures_hang_together() {
    let Some(d) = run(&["-v", "2", "-b", "8M"]) else {
        return;
    };
    schema::validate(FILE, &d);
    assert_eq!(d["backend"], "host");
    assert!(d["measures"].as_str().unwrap().contains("host kernel"));
    assert!(d["measures"].as_str().unwrap().contains("not a guest"));
    assert_eq!(d["config"]["total_bytes"], 16u64 << 20);
    assert_eq!(d["probes"]["memfd_secret"], true);
    let gmem = &d["probes"]["guest_memfd"];
    // A populate timing only where guest_memfd was created.
    if gmem["supported"] == false {
        assert!(gmem["timing"].is_null(), "{gmem:#}");
    }
    assert!(!gmem["detail"].as_str().unwrap().is_empty());
    let rows = d["runs"][0]["rows"].as_array().unwrap();
    let variants: Vec<&str> = rows
        .iter()
        .map(|r| r["variant"].as_str().unwrap())
        .collect();
    assert_eq!(
        variants,
        ["memfd", "secret-first", "secret-second", "memfd-after"]
    );
    for r in rows {
        row_hangs_together(r, 2, 16 << 20);
    }
    assert_eq!(n(&rows[0]["ratio_over_memfd"]), 1.0);
    for r in &rows[1..] {
        let ratio = n(&r["ratio_over_memfd"]);
        let expect = n(&rows[0]["gb_per_s"]) / n(&r["gb_per_s"]);
        assert!((ratio / expect - 1.0).abs() < 1e-6, "{ratio} vs {expect}");
    }
    // Plain memfd pages stay in the direct map: the memfd fill splits nothing of its own (other
    // processes could, but nothing else on a test host removes pages from the direct map).
    assert_eq!(
        rows[0]["counters"]["level2_splits"].as_u64().unwrap_or(0),
        0
    );
}

#[test]
fn repeat_summarizes_every_headline_figure() {
    let Some(d) = run(&["-b", "4M", "--repeat", "2", "--samples-ms", "1000"]) else {
        return;
    };
    schema::validate(FILE, &d);
    assert_eq!(d["repeat"], 2);
    assert_eq!(d["runs"].as_array().unwrap().len(), 2);
    let summary = d["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 8);
    for m in summary {
        if m["runs"] == 0 {
            continue;
        }
        assert!(
            n(&m["min"]) <= n(&m["median"]) && n(&m["median"]) <= n(&m["max"]),
            "{m}"
        );
    }
    assert_eq!(summary[0]["metric"], "memfd GB/s");
    assert_eq!(summary[0]["runs"], 2);
}

#[test]
fn the_validator_rejects_a_broken_document() {
    let Some(d) = run(&["-b", "4M"]) else {
        return;
    };
    let mut bad = d.clone();
    bad["runs"][0]["rows"][0]["gb_per_s"] = Value::from("fast");
    assert!(schema::errors(FILE, &bad)
        .iter()
        .any(|e| e.contains("gb_per_s")));
    let mut bad = d.clone();
    bad["runs"][0]["rows"][1]["counters"]["level2_splits"] = Value::from(-1);
    assert!(schema::errors(FILE, &bad)
        .iter()
        .any(|e| e.contains("level2_splits")));
    let mut bad = d.clone();
    bad["backend"] = Value::from("sim");
    assert!(schema::errors(FILE, &bad)
        .iter()
        .any(|e| e.contains("backend")));
    let mut bad = d;
    bad.as_object_mut().unwrap().remove("measures");
    assert!(schema::errors(FILE, &bad)
        .iter()
        .any(|e| e.contains("measures")));
}

#[test]
fn the_text_says_whose_cost_it_is() {
    let (code, out, err) = slat(&["private-mem-perf", "-b", "4M"]);
    if code == 1 && err.contains("unavailable") {
        return;
    }
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("host kernel's cost"), "{out}");
    assert!(out.contains("not a guest's"), "{out}");
    for needle in [
        "memfd_secret:",
        "guest_memfd:",
        "secret-first",
        "secret-second",
        "Samples every 100 ms",
    ] {
        assert!(out.contains(needle), "{needle}: {out}");
    }
}

/// Refused command lines, and a word the one-line refusal must name. A data table (one row
/// per case), longer than a function may be.
const BAD_INPUT: &[(&[&str], &str)] = &[
    (&["private-mem-perf", "--direct-map", "4k"], "--backend sim"),
    (
        &["private-mem-perf", "--kernel-flush", "on"],
        "--backend sim",
    ),
    (&["private-mem-perf", "--collapse"], "--backend sim"),
    (
        &["private-mem-perf", "--vary", "direct-map=4k"],
        "--backend sim",
    ),
    (
        &["private-mem-perf", "--backend", "sim", "--direct-map", "3m"],
        "2m-split",
    ),
    (
        &[
            "private-mem-perf",
            "--backend",
            "sim",
            "--kernel-flush",
            "maybe",
        ],
        "--kernel-flush",
    ),
    (
        &["private-mem-perf", "--backend", "sim", "--vary", "tlb=1"],
        "unknown key",
    ),
    (
        &[
            "private-mem-perf",
            "--backend",
            "sim",
            "--vary",
            "direct-map",
        ],
        "KEY=V1,V2",
    ),
    (
        &[
            "private-mem-perf",
            "--backend",
            "sim",
            "--vary",
            "kernel-flush=on,sometimes",
        ],
        "sometimes",
    ),
    (
        &[
            "private-mem-perf",
            "--backend",
            "sim",
            "--vary",
            "direct-map=4k,5k",
        ],
        "5k",
    ),
    (
        &[
            "private-mem-perf",
            "--backend",
            "sim",
            "-v",
            "512",
            "-b",
            "64T",
        ],
        "more than this host",
    ),
    (&["private-mem-perf", "--backend", "kvm"], "kvm"),
    (&["private-mem-perf", "-b", "0"], "greater than zero"),
    (&["private-mem-perf", "-b", "5000"], "4 KiB"),
    (&["private-mem-perf", "-b", "12Q"], "12Q"),
    (&["private-mem-perf", "-v", "0"], "-v"),
    (&["private-mem-perf", "-v", "513"], "-v"),
    (&["private-mem-perf", "--samples-ms", "50"], "--samples-ms"),
    (
        &["private-mem-perf", "--samples-ms", "1001"],
        "--samples-ms",
    ),
    (&["private-mem-perf", "--repeat", "0"], "--repeat"),
    (
        &["private-mem-perf", "--plot", "/nonexistent-dir/x.svg"],
        "--plot",
    ),
    // 4 x (2^62 - 16 KiB) wraps to 16 KiB in 64 bits.
    (
        &["private-mem-perf", "-v", "4", "-b", "4611686018427392000"],
        "overflows",
    ),
    // 32 PiB: more than the host holds.
    (
        &["private-mem-perf", "-v", "512", "-b", "64T"],
        "more than this host",
    ),
];

#[test]
fn bad_input_exits_2_with_one_line() {
    for (args, needle) in BAD_INPUT {
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
    let (code, out, _) = slat(&["private-mem-perf", "--help"]);
    assert_eq!(code, 0);
    for flag in [
        "-v",
        "-b",
        "--samples-ms",
        "--backend",
        "--repeat",
        "--json",
        "--direct-map",
        "--kernel-flush",
        "--collapse",
        "--vary",
    ] {
        assert!(out.contains(flag), "{flag}: {out}");
    }
}

/// `--backend sim --json`: one document over every variant by default, valid against the
/// schema, with figures that hang together: every page accepted once, one split per 2 MiB
/// block under `2m-split` only, `none` leaving the 2 MiB leaves, flushes per page with
/// `--kernel-flush on` and acknowledged by the other vCPU, and the conversion back to shared
/// releasing every page.
#[test]
fn sim_json_matches_its_schema_and_the_figures_hang_together() {
    let (code, out, err) = slat(&[
        "private-mem-perf",
        "--backend",
        "sim",
        "-v",
        "2",
        "-b",
        "8M",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let d: Value = serde_json::from_str(&out).unwrap();
    schema::validate(FILE, &d);
    assert_eq!(d["backend"], "sim");
    let pages = 2 * 8 * 256u64;
    let blocks = 2 * 8 / 2u64;
    let rows = d["runs"][0]["rows"].as_array().unwrap();
    let names: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{}/{}",
                r["direct_map"].as_str().unwrap(),
                r["kernel_flush"]
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            "2m-split/false",
            "2m-split/true",
            "4k/false",
            "4k/true",
            "none/false",
            "none/true"
        ]
    );
    assert!(n(&d["runs"][0]["native"]["gb_per_s"]) > 0.0);
    for r in rows {
        assert_eq!(r["accepted"], pages, "{r:#}");
        assert!(
            n(&r["gb_per_s"]) > 0.0 && n(&r["to_shared_gib_per_s"]) > 0.0,
            "{r:#}"
        );
        assert!(n(&r["ratio_over_native"]) > 0.0, "{r:#}");
        let (policy, flush) = (r["direct_map"].as_str().unwrap(), r["kernel_flush"] == true);
        let splits = r["splits"].as_u64().unwrap();
        let flushes = r["kernel_flushes"].as_u64().unwrap();
        match policy {
            "2m-split" => assert_eq!(splits, blocks, "{r:#}"),
            _ => assert_eq!(splits, 0, "{r:#}"),
        }
        match policy {
            "none" => {
                assert_eq!(r["leaves_after"][1], blocks, "{r:#}");
                assert_eq!(flushes, 0, "{r:#}");
            }
            _ => {
                assert_eq!(r["leaves_after"][0], 0, "every page removed: {r:#}");
                let want = if flush { pages + splits } else { splits };
                assert_eq!(flushes, want, "{r:#}");
                if flush {
                    assert!(r["kernel_flush_acks"].as_u64().unwrap() > 0, "{r:#}");
                }
            }
        }
        let accepted: f64 = r["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| n(&s["gb_per_s"]))
            .sum();
        assert!(accepted > 0.0, "no sample saw a page accepted: {r:#}");
    }
}

/// `--vary` picks the rows; `--collapse` rebuilds the 2 MiB leaves on the way back to shared;
/// `--repeat` summarizes each variant; the text says whose cost it is.
#[test]
fn sim_vary_collapse_repeat_and_text() {
    let (code, out, err) = slat(&[
        "private-mem-perf",
        "--backend",
        "sim",
        "-v",
        "2",
        "-b",
        "4M",
        "--collapse",
        "--vary",
        "direct-map=2m-split",
        "--vary",
        "kernel-flush=on",
        "--repeat",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let d: Value = serde_json::from_str(&out).unwrap();
    schema::validate(FILE, &d);
    assert_eq!(d["repeat"], 2);
    for run in d["runs"].as_array().unwrap() {
        let rows = run["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0]["kernel_flush"], true);
        assert_eq!(rows[0]["collapses"], 4, "{:#}", rows[0]);
    }
    let s = d["summary"].as_array().unwrap();
    assert!(s
        .iter()
        .all(|x| x["runs"] == 2 && x["variant"] == "2m-split flush=on"));
    let (code, out, err) = slat(&[
        "private-mem-perf",
        "--backend",
        "sim",
        "-b",
        "4M",
        "--direct-map",
        "4k",
        "--kernel-flush",
        "off",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("not this host kernel's cost"), "{out}");
    assert!(
        out.contains("native") && out.contains("4k flush=off"),
        "{out}"
    );
    assert!(!out.contains("2m-split flush"), "one row only: {out}");
}

/// `--plot` (from the driver): a bar per variant of its fault-in and to-shared rates, with
/// `--repeat` the median and error bars from the minimum to the maximum.
#[test]
fn sim_plot_draws_each_variant_with_its_spread() {
    let p = std::env::temp_dir().join(format!("slat-pmp-plot-{}.svg", std::process::id()));
    let (code, out, err) = slat(&[
        "private-mem-perf",
        "--backend",
        "sim",
        "-b",
        "4M",
        "--kernel-flush",
        "off",
        "--repeat",
        "2",
        "--plot",
        p.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let svg = std::fs::read_to_string(&p).unwrap();
    let _ = std::fs::remove_file(&p);
    assert!(
        svg.contains("median of 2 runs, error bars min to max"),
        "{svg}"
    );
    for text in [
        "fault-in GB/s",
        "to-shared GiB/s",
        "2m-split flush=off",
        "4k flush=off",
        "none flush=off",
    ] {
        assert!(svg.contains(text), "{text}: {svg}");
    }
}

/// A profile whose every cost and model time is `ns`: the built-in host profile's numbers
/// replaced, so that every entry it needs is there.
fn profile_with_every_cost(ns: &str, name: &str) -> std::path::PathBuf {
    let builtin = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../slat-vt/profiles/host-2core-nested.toml"
    );
    let text = std::fs::read_to_string(builtin).expect("the built-in profile");
    let out: Vec<String> = (text.lines())
        .map(|l| match l.starts_with("ns = ") {
            true => format!("ns = {ns}"),
            false => l.to_string(),
        })
        .collect();
    let path = std::env::temp_dir().join(format!("slat-pmp-{}-{name}.toml", std::process::id()));
    std::fs::write(&path, out.join("\n")).expect("write the profile");
    path
}

/// The sampler reads every 100 ms of virtual time, and a profile may make a fault-in last
/// hours of it (every cost 1 s here): the samples must stay bounded, evenly coarsened, not
/// grow until the allocation aborts the process (as they did, with every cost at the
/// largest value a profile allows).
#[test]
fn sim_samples_stay_bounded_however_long_the_virtual_fault_in() {
    let path = profile_with_every_cost("1e9", "slow");
    let p = path.to_str().expect("utf-8 temp path");
    let args = [
        "private-mem-perf",
        "--backend",
        "sim",
        "-b",
        "1M",
        "-v",
        "1",
    ];
    let more = ["--clock", "virtual", "--cost-profile", p];
    let doc = common::json(&[&args[..], &more[..]].concat());
    schema::validate(FILE, &doc);
    for row in doc["runs"][0]["rows"].as_array().expect("rows") {
        let s = row["samples"].as_array().expect("samples");
        assert!((2..=1024).contains(&s.len()), "{} samples", s.len());
        let t: Vec<f64> = s.iter().map(|x| n(&x["t_s"])).collect();
        // Coarsened (the spacing is `Readings`' unit test: with 1 s costs a reading is taken
        // whenever the sampler next runs after its sleep, seconds late).
        assert!(t[0] > 0.1, "first interval {} s: not coarsened", t[0]);
        assert!(t.windows(2).all(|w| w[1] > w[0]), "{t:?}");
    }
    let (code, out, err) = slat(&[&args[..], &more[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("at most 1024 readings are kept"), "{out}");
    let _ = std::fs::remove_file(path);
}
