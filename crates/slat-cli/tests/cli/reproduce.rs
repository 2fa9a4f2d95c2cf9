//! `slat reproduce`: every seed's table has all its rows, each with both sides' figures and a
//! verdict (not that the verdict is yes), in text and in JSON (checked against its schema);
//! `--plot` draws it; `--jobs` changes no figure; bad input is refused with one line. The
//! published numbers are checked against the seed threads by the unit tests of
//! `src/reproduce/published.rs`.

use crate::common;

use common::schema::{errors, validate};
use common::{json, ok, slat};

/// Rows per seed: 000's two selftests; 001's eight patch-1 and five patch-2 rows; 002's harvest
/// and guest benchmark, each with the vCPUs' write faults under the MMU lock and fixed by the
/// fast page fault; 003's fault-in and kernel flush; 004's two GET cells, the mark, and GET by
/// slat's summary levels.
const ROWS: [(&str, usize); 5] = [("000", 2), ("001", 13), ("002", 4), ("003", 2), ("004", 4)];

#[test]
fn every_seed_has_all_its_rows_and_a_verdict_in_json() {
    let d = json(&["reproduce", "all", "--quick"]);
    validate("reproduce.json", &d);
    assert_eq!(d["clock"], "real");
    assert_eq!(d["scale"], "quick");
    let seeds = d["seeds"].as_array().expect("seeds");
    assert_eq!(seeds.len(), ROWS.len(), "{d:#}");
    for (s, (id, n)) in seeds.iter().zip(ROWS) {
        assert_eq!(s["seed"]["id"], id);
        let rows = s["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), n, "seed {id}: {rows:#?}");
        for r in rows {
            let what = format!("seed {id}, {}", r["row"]);
            assert!(
                r["slat"]["before"].as_f64().is_some_and(|x| x > 0.0),
                "{what}: {r:#}"
            );
            assert!(
                r["slat"]["after"].as_f64().is_some_and(|x| x > 0.0),
                "{what}: {r:#}"
            );
            assert!(r["verdict"]["direction"].is_boolean(), "{what}: {r:#}");
            // A magnitude verdict wherever the thread gives figures.
            let figures = r["published"]["ratio"].is_number();
            assert_eq!(r["verdict"]["within_2x"].is_boolean(), figures, "{what}");
            for c in r["slat"]["commands"].as_array().unwrap() {
                assert!(c.as_str().unwrap().starts_with("slat "), "{what}");
            }
        }
        assert!(s["wall_s"].as_f64().is_some_and(|t| t >= 0.0));
    }
    // The schema holds every row to its verdict and its commands.
    let mut bad = d.clone();
    bad["seeds"][0]["rows"][0]
        .as_object_mut()
        .unwrap()
        .remove("verdict");
    let errs = errors("reproduce.json", &bad);
    assert!(errs.iter().any(|e| e.contains("verdict")), "{errs:?}");
    let sweep = seeds[4]["sweep"].as_array().expect("004's sweep");
    assert_eq!(sweep.len(), 6, "two sizes x three densities");
    assert!(seeds[4]["implied"]
        .as_str()
        .is_some_and(|s| s.contains("sparse")));
}

/// In virtual time every table has all its rows, each with a verdict or, where its benchmark
/// has no virtual clock yet, a note saying so; the commands carry `--clock virtual`.
#[test]
fn virtual_time_gives_every_row_a_verdict_or_says_what_it_needs() {
    let d = json(&["reproduce", "all", "--quick", "--clock", "virtual"]);
    validate("reproduce.json", &d);
    assert_eq!(d["clock"], "virtual");
    assert_eq!(d["scale"], "quick");
    let seeds = d["seeds"].as_array().expect("seeds");
    assert_eq!(seeds.len(), ROWS.len(), "{d:#}");
    let mut ran = 0;
    for (s, (id, n)) in seeds.iter().zip(ROWS) {
        let rows = s["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), n, "seed {id}: {rows:#?}");
        for r in rows {
            let what = format!("seed {id}, {}: {r:#}", r["row"]);
            assert!(
                r.get("error").is_none() && r["slat"].get("error").is_none(),
                "{what}"
            );
            for c in r["slat"]["commands"].as_array().unwrap() {
                assert!(c.as_str().unwrap().contains("--clock virtual"), "{what}");
            }
            match r["needs_virtual_time"].as_str() {
                Some(n) => assert!(n.contains(r["benchmark"].as_str().unwrap()), "{what}"),
                None => {
                    ran += 1;
                    assert!(r["verdict"]["direction"].is_boolean(), "{what}");
                    assert!(
                        r["slat"]["after"].as_f64().is_some_and(|x| x > 0.0),
                        "{what}"
                    );
                }
            }
        }
    }
    // dirty-log-perf, access-tracking-perf and page-table-test have a virtual clock: 000's,
    // 001's and 004's rows run.
    assert!(ran >= 18, "{d:#}");
    let out = ok(&["reproduce", "000", "--quick", "--clock", "virtual"]);
    assert!(out.contains("--clock virtual, --quick scale"), "{out}");
    assert!(
        out.contains("--fast-pf on --cost-profile x86-server --clock virtual"),
        "{out}"
    );
}

/// `--cost-profile` reaches every virtual-time command, and the user can copy it.
#[test]
fn the_cost_profile_is_passed_to_every_command() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../slat-vt/profiles");
    let profile = root.join("host-2core-nested.toml");
    let p = profile.to_str().unwrap();
    let d = json(&[
        "reproduce",
        "000",
        "--quick",
        "--clock",
        "virtual",
        "--cost-profile",
        p,
    ]);
    validate("reproduce.json", &d);
    for r in d["seeds"][0]["rows"].as_array().unwrap() {
        for c in r["slat"]["commands"].as_array().unwrap() {
            assert!(
                c.as_str().unwrap().contains(&format!("--cost-profile {p}")),
                "{r:#}"
            );
        }
    }
    assert!(
        d["seeds"][0]["rows"][0]["verdict"]["direction"].is_boolean(),
        "{d:#}"
    );
}

/// In virtual time each seed simulates its own machine class by default (x86-server, and
/// arm64-server for 001), says so, and every command carries it; `host` picks this host's.
#[test]
fn virtual_time_uses_the_seeds_machine_profile_unless_told() {
    let d = json(&["reproduce", "all", "--quick", "--clock", "virtual"]);
    for s in d["seeds"].as_array().unwrap() {
        let class = s["seed"]["cost_profile"].as_str().unwrap();
        let want = if s["seed"]["id"] == "001" {
            "arm64-server"
        } else {
            "x86-server"
        };
        assert_eq!(class, want);
        assert_eq!(s["cost_profile"]["name"], want, "{s:#}");
        assert_eq!(s["cost_profile"]["why"], "the seed's machine class");
        for r in s["rows"].as_array().unwrap() {
            let all = r["slat"]["commands"].as_array().unwrap().iter();
            for c in all.chain(r["seed_scale"].as_array().unwrap()) {
                let c = c.as_str().unwrap();
                assert!(c.contains(&format!("--cost-profile {want}")), "{c}");
            }
        }
    }
    let d = json(&[
        "reproduce",
        "000",
        "--quick",
        "--clock",
        "virtual",
        "--cost-profile",
        "host",
    ]);
    validate("reproduce.json", &d);
    assert_eq!(d["seeds"][0]["cost_profile"]["name"], "host-2core-nested");
    assert_eq!(d["seeds"][0]["cost_profile"]["why"], "--cost-profile");
    let out = ok(&["reproduce", "001", "--quick", "--clock", "virtual"]);
    assert!(out.contains("cost profile: arm64-server ("), "{out}");
}

/// `--sensitivity` runs every row again with each cost halved and doubled and says, per row,
/// whether the direction held or which changes flipped it.
#[test]
fn sensitivity_says_per_row_whether_the_direction_holds() {
    let d = json(&["reproduce", "000", "--clock", "virtual", "--sensitivity"]);
    validate("reproduce.json", &d);
    assert_eq!(d["scale"], "quick");
    let x = &d["seeds"][0]["sensitivity"];
    assert_eq!(x["profile"], "x86-server");
    // Every cost of the profile file, and the contention model's latencies (not its design
    // choices: lookahead, retention, fairness, policy).
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../slat-vt/profiles/x86-server.toml");
    let text = std::fs::read_to_string(&file).expect("the x86-server profile");
    let mut want: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("[costs.")?.strip_suffix(']'))
        .chain([
            "rmw_local",
            "line_transfer",
            "invalidate",
            "dram_miss",
            "handoff",
            "ipi_latency",
            "dram_stream",
        ])
        .map(str::to_string)
        .collect();
    want.sort();
    let mut got: Vec<String> = x["costs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().expect("a cost name").to_string())
        .collect();
    got.sort();
    assert_eq!(got, want, "{x:#}");
    let rows = x["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        let holds = r["holds"].as_bool().expect("ran");
        assert_eq!(holds, r["flips"].as_array().unwrap().is_empty(), "{r:#}");
        let [lo, hi] = [0, 1].map(|i| r["ratio_range"][i].as_f64().unwrap());
        assert!(lo <= hi, "{r:#}");
    }
    let out = ok(&["reproduce", "000", "--clock", "virtual", "--sensitivity"]);
    let each = format!("sensitivity: each of {} costs of x86-server", want.len());
    assert!(out.contains(&each), "{out}");
    assert!(out.contains("direction under the changes"), "{out}");
}

/// With `--repeat` every figure is a median inside its runs' range, and the verdict says
/// whether the before and after ranges overlap.
#[test]
fn repeat_gives_medians_ranges_and_whether_they_overlap() {
    let d = json(&["reproduce", "003", "--quick", "--repeat", "3"]);
    validate("reproduce.json", &d);
    for r in d["seeds"][0]["rows"].as_array().unwrap() {
        for side in ["before", "after"] {
            let m = r["slat"][side].as_f64().unwrap();
            let range = &r["slat"][format!("{side}_range")];
            let (lo, hi) = (range[0].as_f64().unwrap(), range[1].as_f64().unwrap());
            assert!(lo <= m && m <= hi, "{r:#}");
        }
        assert!(r["verdict"]["overlap"].is_boolean(), "{r:#}");
    }
    let one = json(&["reproduce", "003", "--quick"]);
    assert!(one["seeds"][0]["rows"][0]["verdict"]["overlap"].is_null());
}

/// `--jobs 2` runs each command in a worker process of its own, two at a time; the document
/// is the one `--jobs 1` gives in this process, but for the times and the host.
#[test]
fn jobs_give_the_figures_one_process_gives() {
    let run = |jobs| {
        let args = [
            "reproduce",
            "000",
            "--quick",
            "--clock",
            "virtual",
            "--repeat",
            "2",
        ];
        let mut d = json(&[&args[..], &["--jobs", jobs]].concat());
        validate("reproduce.json", &d);
        let m = d.as_object_mut().unwrap();
        assert_eq!(m.remove("jobs").and_then(|j| j.as_u64()), jobs.parse().ok());
        m.remove("host");
        for s in d["seeds"].as_array_mut().unwrap() {
            assert!(s.as_object_mut().unwrap().remove("wall_s").is_some());
        }
        d
    };
    let one = run("1");
    assert!(
        one["seeds"][0]["rows"][0]["slat"]["before"].is_number(),
        "{one:#}"
    );
    assert_eq!(run("2"), one);
    // The worker prints one JSON line: each figure's name, unit and value bits.
    let out = ok(&[
        "reproduce-worker",
        "dirty-log-perf",
        "--",
        "-v",
        "1",
        "-b",
        "16M",
        "--clock",
        "virtual",
    ]);
    assert_eq!(out.lines().count(), 1, "{out}");
    let w: serde_json::Value = serde_json::from_str(&out).expect("one JSON line");
    let figure = &w["runs"][0][0];
    assert!(figure[0].is_string() && figure[2].is_u64(), "{w:#}");
    assert_eq!(w["pages_per_vcpu"], 4096);
}

#[test]
fn the_text_prints_each_table_its_commands_and_its_wall_time() {
    let out = ok(&["reproduce", "003", "--quick"]);
    for needle in [
        "seed 003:",
        "../shared/seeds/003_",
        "published before -> after",
        "direction",
        "within 2x",
        "8.0 -> 12.9 GB/s",
        "\"completely cratered performance\"",
        "n/a (no figure)",
        "before: slat private-mem-perf",
        "after:  slat private-mem-perf",
        "seed's scale",
        "seed 003 took",
    ] {
        assert!(out.contains(needle), "{needle}:\n{out}");
    }
    // One row line per row, each ending in the two verdicts.
    let rows = out
        .lines()
        .filter(|l| l.starts_with('[') && l.contains(" | "));
    for l in rows.clone() {
        let v: Vec<&str> = l.rsplit(" | ").take(2).collect();
        assert!(["yes", "no"].contains(&v[1].trim()), "{l}");
    }
    assert_eq!(rows.count(), 2, "{out}");
}

#[test]
fn plot_draws_the_published_bars_beside_slats() {
    let dir = std::env::temp_dir().join(format!("slat-reproduce-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("r.svg");
    let svg_s = svg.to_str().unwrap();
    ok(&[
        "reproduce",
        "000",
        "--quick",
        "--repeat",
        "2",
        "--plot",
        svg_s,
    ]);
    let text = std::fs::read_to_string(&svg).expect("svg written");
    assert!(text.contains("1 pub") && text.contains("2 slat"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_is_refused_with_one_line() {
    for (args, needle) in [
        (&["reproduce", "005"][..], "`005` is not a seed"),
        (&["reproduce", "000", "--clock", "wall"], "--clock"),
        (
            &["reproduce", "000", "--cost-profile", "p.toml"],
            "--cost-profile needs --clock virtual",
        ),
        (&["reproduce"], "SEED"),
        (
            &["reproduce", "000", "--sensitivity"],
            "--sensitivity needs --clock virtual",
        ),
        (
            &[
                "reproduce",
                "000",
                "--clock",
                "virtual",
                "--cost-profile",
                "nope",
            ],
            "nor a built-in profile",
        ),
        (&["reproduce", "000", "--repeat", "0"], "--repeat"),
        (
            &["reproduce", "003", "--full-scale"],
            "--full-scale needs --clock virtual",
        ),
        (
            &[
                "reproduce",
                "003",
                "--full-scale",
                "--clock",
                "virtual",
                "--quick",
            ],
            "--full-scale needs --clock virtual, without --quick",
        ),
        (
            &["reproduce", "000", "--jobs", "2"],
            "--jobs 2 needs --clock virtual",
        ),
        (
            &["reproduce", "000", "--clock", "virtual", "--jobs", "0"],
            "--jobs",
        ),
        (
            &["reproduce", "000", "--clock", "virtual", "--jobs", "65"],
            "1..=64",
        ),
        (&["reproduce-worker", "migrate", "--"], "not a benchmark"),
        // Checked before anything runs, not after minutes of runs.
        (
            &["reproduce", "all", "--plot", "/nonexistent-slat-dir/r.svg"],
            "cannot write",
        ),
    ] {
        let (code, out, err) = slat(args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(out.is_empty(), "{args:?}: {out}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
