//! A seed's table: per row the published before and after, slat's, both after/before ratios
//! and the verdict; its text, and the bars `--plot` draws.

use super::published::{Claim, Seed};
use super::sensitivity::{Pair, Sensitivity};
use crate::error::CliResult;
use crate::plot::{draw_bars, BarPanel};
use serde::Serialize;
use std::path::Path;

/// Whether slat reproduces a published change.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Verdict {
    /// slat's after/before is on the same side of 1 as the thread's (`null`: a run failed).
    pub direction: Option<bool>,
    /// slat's after/before is within a factor of 2 of the thread's (`null`: the thread gives
    /// no figure, or a run failed).
    pub within_2x: Option<bool>,
    /// With `--repeat`: the before and after runs' ranges overlap, so the direction is within
    /// this host's noise (`null`: one run each).
    pub overlap: Option<bool>,
}

impl Verdict {
    /// The verdict on slat's ratio `ours` against the thread's claim.
    pub fn of(claim: Claim, ours: Option<f64>) -> Verdict {
        let Some(ours) = ours.filter(|r| r.is_finite() && *r > 0.0) else {
            return Verdict {
                direction: None,
                within_2x: None,
                overlap: None,
            };
        };
        match claim.ratio() {
            Some(theirs) => Verdict {
                direction: Some((theirs < 1.0 && ours < 1.0) || (theirs > 1.0 && ours > 1.0)),
                within_2x: Some((0.5..=2.0).contains(&(ours / theirs))),
                overlap: None,
            },
            // The claim is "after is worse"; for a rate (higher is better) that is a ratio
            // under 1. Only rates carry such a claim here.
            None => Verdict {
                direction: Some(ours < 1.0),
                within_2x: None,
                overlap: None,
            },
        }
    }
}

/// The thread's side of a row.
#[derive(Debug, Clone, Serialize)]
pub struct Published {
    pub claim: Claim,
    /// after / before.
    pub ratio: Option<f64>,
    pub file: &'static str,
}

/// slat's side of a row.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    pub metric: String,
    pub unit: Option<&'static str>,
    pub before: Option<f64>,
    pub after: Option<f64>,
    /// after / before.
    pub ratio: Option<f64>,
    /// The smallest and largest of the `--repeat` runs, before and after.
    pub before_range: Option<[f64; 2]>,
    pub after_range: Option<[f64; 2]>,
    /// The commands, as the user can run them.
    pub commands: [String; 2],
    /// Why a run failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One row of a seed's table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub row: String,
    pub benchmark: &'static str,
    pub published: Published,
    pub slat: Measured,
    /// The size flags of slat's runs, and how they differ from the seed's beyond size.
    pub scale: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub scale_note: &'static str,
    /// The commands at the seed's own scale in virtual time (what `--clock virtual` runs).
    pub seed_scale: [String; 2],
    /// Under `--clock virtual`: the row did not run, because its benchmark cannot run these
    /// commands in virtual time yet (which benchmark, and why).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub needs_virtual_time: Option<String>,
    pub verdict: Verdict,
}

/// One cell of 004's GET sweep.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub size: &'static str,
    pub density: &'static str,
    /// GET's time with the per-word exchange and with the bitmap switch, each over the whole
    /// slot as KVM's loops are (`xchg-full`, `switch-full`) (s).
    pub xchg_s: Option<f64>,
    pub switch_s: Option<f64>,
    /// switch / xchg.
    pub ratio: Option<f64>,
}

/// The cost profile a seed's virtual-time runs used.
#[derive(Debug, Clone, Serialize)]
pub struct UsedProfile {
    /// Its `name`, and the hash of its values.
    pub name: String,
    pub hash: String,
    /// As given to the benchmarks' `--cost-profile` (a built-in name or a file).
    pub given: String,
    /// `the seed's machine class` (the default) or `--cost-profile`.
    pub why: &'static str,
}

/// One seed's reproduction.
#[derive(Debug, Clone, Serialize)]
pub struct SeedReport {
    pub seed: Seed,
    /// Under `--clock virtual`: the cost profile its commands simulated with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_profile: Option<UsedProfile>,
    pub rows: Vec<Row>,
    /// 004: GET over sizes and dirty densities.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sweep: Vec<Cell>,
    /// 004: what the thread's figure implies about its guest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub implied: Option<String>,
    /// `--sensitivity`: whether each row's direction survives each cost halved and doubled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sensitivity: Option<Sensitivity>,
    /// Wall time from the previous seed's table (or the start) to this one's: with `--jobs`
    /// above 1 its commands may have started earlier, beside the previous seeds'.
    pub wall_s: f64,
    /// What each row ran, for `--sensitivity` to run again (parallel to `rows`).
    #[serde(skip)]
    pub pairs: Vec<Option<Pair>>,
}

/// A figure in 4 significant digits, or `-`.
fn num(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(v) if v == 0.0 || !v.is_finite() => format!("{v}"),
        Some(v) if v.abs() >= 1e5 => format!("{v:.0}"),
        Some(v) => {
            let digits = (3 - v.abs().log10().floor() as i32).clamp(0, 9) as usize;
            format!("{v:.digits$}")
        }
    }
}

/// Seconds in ms or µs when they are small: the unit to show and the factor to it.
fn readable(unit: &'static str, largest: Option<f64>) -> (&'static str, f64) {
    match (unit, largest) {
        ("s", Some(x)) if x < 1e-3 => ("us", 1e6),
        ("s", Some(x)) if x < 1.0 => ("ms", 1e3),
        _ => (unit, 1.0),
    }
}

fn yes(b: Option<bool>, none: &str) -> String {
    match b {
        Some(true) => "yes".into(),
        Some(false) => "no".into(),
        None => none.into(),
    }
}

fn published_cells(p: &Published) -> [String; 2] {
    match p.claim {
        Claim::Figures {
            before,
            after,
            unit,
        } => [
            format!("{} -> {} {unit}", before.text, after.text),
            format!("{}x", num(p.ratio)),
        ],
        Claim::Worse { quote } => [format!("\"{}\"", quote.text), "worse".into()],
    }
}

/// The table's cells of a row.
fn cells(n: usize, r: &Row) -> Vec<String> {
    let [pub_fig, pub_ratio] = published_cells(&r.published);
    let s = &r.slat;
    let ours = match s.unit {
        None if r.needs_virtual_time.is_some() => format!("needs virtual time on {}", r.benchmark),
        Some(u) => {
            let (u, k) = readable(u, s.before.into_iter().chain(s.after).reduce(f64::max));
            let at = |x: Option<f64>| num(x.map(|v| v * k));
            format!("{} -> {} {u}", at(s.before), at(s.after))
        }
        None => "failed".into(),
    };
    let within = if r.published.ratio.is_none() {
        "n/a (no figure)"
    } else {
        "-"
    };
    vec![
        format!("[{n}] {}", r.row),
        pub_fig,
        pub_ratio,
        ours,
        s.ratio.map_or("-".into(), |r| format!("{}x", num(Some(r)))),
        match (yes(r.verdict.direction, "-"), r.verdict.overlap) {
            (d, Some(true)) => format!("{d} (in noise)"),
            (d, _) => d,
        },
        yes(r.verdict.within_2x, within),
    ]
}

/// Prints rows as a table with aligned columns.
pub(super) fn print_table(head: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cs: Vec<&str>| {
        let padded: Vec<String> = cs.iter().zip(&w).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", padded.join(" | ").trim_end());
    };
    line(head.to_vec());
    let rule: Vec<String> = w.iter().map(|w| "-".repeat(*w)).collect();
    line(rule.iter().map(String::as_str).collect());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

/// The text of one seed.
pub fn print(s: &SeedReport, clock: &str, scale: &str) {
    let seed = &s.seed;
    println!("seed {}: {}", seed.id, seed.title);
    println!(
        "published: ../shared/seeds/{} ({}); slat: --clock {clock}, {scale} scale",
        seed.file, seed.machine
    );
    if let Some(p) = &s.cost_profile {
        println!(
            "cost profile: {} ({}; {}, --cost-profile {}; --cost-profile host for this host's)",
            p.name, p.hash, p.why, p.given
        );
    }
    let head = [
        "row",
        "published before -> after",
        "after/before",
        "slat before -> after",
        "after/before",
        "direction",
        "within 2x",
    ];
    let rows: Vec<Vec<String>> = (s.rows.iter().enumerate())
        .map(|(i, r)| cells(i + 1, r))
        .collect();
    print_table(&head, &rows);
    for (i, r) in s.rows.iter().enumerate() {
        let note = match r.scale_note {
            "" => String::new(),
            n => format!(" ({n})"),
        };
        println!("[{}] {}: {}{note}", i + 1, r.benchmark, r.slat.metric);
        println!("    before: {}", r.slat.commands[0]);
        println!("    after:  {}", r.slat.commands[1]);
        if r.seed_scale[0] != r.slat.commands[0] {
            println!(
                "    seed's scale (--clock virtual), before: {}",
                r.seed_scale[0]
            );
        }
        if let Some(n) = &r.needs_virtual_time {
            println!("    not run: {n}");
        }
        if let Some(e) = &r.slat.error {
            println!("    failed: {e}");
        }
    }
    print_sweep(s);
    if let Some(x) = &s.sensitivity {
        super::sensitivity::print(x);
    }
    println!("seed {} took {:.1} s", seed.id, s.wall_s);
    println!();
}

fn print_sweep(s: &SeedReport) {
    if s.sweep.is_empty() {
        return;
    }
    println!("GET_DIRTY_LOG over guest size and dirty density (-w: % of pages written per pass):");
    let rows: Vec<Vec<String>> = (s.sweep.iter())
        .map(|c| {
            let ms = |x: Option<f64>| num(x.map(|v| v * 1e3));
            vec![
                c.size.to_string(),
                c.density.to_string(),
                ms(c.xchg_s),
                ms(c.switch_s),
                format!("{}x", num(c.ratio)),
            ]
        })
        .collect();
    print_table(
        &[
            "size",
            "density",
            "xchg-full (ms)",
            "switch-full (ms)",
            "switch/xchg",
        ],
        &rows,
    );
    if let Some(i) = &s.implied {
        println!("{i}");
    }
}

/// `--plot`: a panel per seed, the thread's after/before beside slat's for every row.
pub fn plot(seeds: &[SeedReport], path: &Path) -> CliResult {
    let panels: Vec<BarPanel> = seeds
        .iter()
        .map(|s| {
            let mut groups = Vec::new();
            let mut values = Vec::new();
            for (i, r) in s.rows.iter().enumerate() {
                let one = |x: Option<f64>| x.map(|v| (v, v, v));
                groups.push(format!("{} pub", i + 1));
                values.push(one(r.published.ratio));
                groups.push(format!("{} slat", i + 1));
                values.push(one(r.slat.ratio));
            }
            BarPanel {
                title: format!(
                    "seed {}: after / before per row, the thread's (pub) beside slat's",
                    s.seed.id
                ),
                x_desc: "row (numbered as in the table)".into(),
                y_desc: "after / before".into(),
                groups,
                values,
            }
        })
        .collect();
    draw_bars(&panels, path)
}
