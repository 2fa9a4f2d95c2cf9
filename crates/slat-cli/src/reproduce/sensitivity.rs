//! `slat reproduce --sensitivity`: does a row's predicted direction rest on one cost of the
//! profile? Every row that ran is run again with each cost of its profile halved and doubled
//! (one cost at a time, every other cost as in the profile), and the table says whether the
//! direction verdict held under all of them or which changes flip it.
//!
//! The model's design choices (`fair_every`, `retention`, `lookahead`) and the lock policy
//! are not costs of a machine and are not varied.

use super::experiments::{Bench, Figure};
use super::jobs::Want;
use super::published::Claim;
use super::runner::{load_profile, Runner};
use super::table::{SeedReport, Verdict};
use crate::error::{CliError, CliResult};
use serde::Serialize;
use slat_vt::{Entry, Profile};
use std::path::{Path, PathBuf};

/// The factors every cost is multiplied by.
pub const FACTORS: [f64; 2] = [0.5, 2.0];

/// The contention model's numbers that are machine costs (the others are design choices).
const MODEL_COSTS: [&str; 6] = [
    "rmw_local",
    "line_transfer",
    "invalidate",
    "dram_miss",
    "handoff",
    "ipi_latency",
];

/// What a row ran: enough to run it again with another profile.
#[derive(Debug, Clone)]
pub struct Pair {
    pub bench: Bench,
    pub figure: Figure,
    /// Before and after, as run (with `--cost-profile`).
    pub args: [String; 2],
    pub claim: Claim,
}

/// One changed cost that turned a row's direction verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Flip {
    pub cost: String,
    pub factor: f64,
    /// slat's after/before with the change.
    pub ratio: Option<f64>,
}

/// One row under every change.
#[derive(Debug, Clone, Serialize)]
pub struct SensitivityRow {
    pub row: String,
    /// The thread's after/before (`null`: it gives no figure, only "worse").
    pub published_ratio: Option<f64>,
    /// slat's after/before with the profile as it is, and its direction verdict.
    pub ratio: Option<f64>,
    pub direction: Option<bool>,
    /// Whether the direction verdict is the same under every change (`null`: not run).
    pub holds: Option<bool>,
    /// The smallest and largest after/before over every change.
    pub ratio_range: Option<[f64; 2]>,
    /// The changes under which the direction verdict differs.
    pub flips: Vec<Flip>,
    /// Why the row was not run (a benchmark without virtual time, a failed run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_run: Option<String>,
}

/// A seed's sensitivity table.
#[derive(Debug, Clone, Serialize)]
pub struct Sensitivity {
    /// The profile varied.
    pub profile: String,
    pub factors: [f64; 2],
    /// The costs varied, one at a time.
    pub costs: Vec<String>,
    pub rows: Vec<SensitivityRow>,
}

/// Every cost of `p` that is varied, by its profile name.
fn varied(p: &Profile) -> Vec<String> {
    let mut v: Vec<String> = p.costs.keys().cloned().collect();
    v.extend(MODEL_COSTS.iter().map(|s| s.to_string()));
    // Optional in a profile (older ones charge `dram_miss` instead); varied when present.
    if p.model.dram_stream.is_some() {
        v.push("dram_stream".to_string());
    }
    v
}

/// The entry of `p` called `name`, among the varied costs.
fn entry<'a>(p: &'a mut Profile, name: &str) -> Option<&'a mut Entry> {
    let m = &mut p.model;
    Some(match name {
        "rmw_local" => &mut m.rmw_local,
        "line_transfer" => &mut m.line_transfer,
        "invalidate" => &mut m.invalidate,
        "dram_miss" => &mut m.dram_miss,
        "handoff" => &mut m.handoff,
        "ipi_latency" => &mut m.ipi_latency,
        "dram_stream" => return m.dram_stream.as_mut(),
        _ => return p.costs.get_mut(name),
    })
}

/// `args` with the word after `--cost-profile` replaced by `path`.
fn with_profile(args: &str, path: &str) -> String {
    let mut words: Vec<&str> = args.split_whitespace().collect();
    if let Some(i) = words.iter().position(|w| *w == "--cost-profile") {
        if i + 1 < words.len() {
            words[i + 1] = path;
        }
    }
    words.join(" ")
}

/// The profile every row of `s` ran with (the word after `--cost-profile`).
fn profile_given(s: &SeedReport) -> Option<String> {
    let p = s.pairs.iter().flatten().next()?;
    let mut words = p.args[0].split_whitespace();
    words.find(|w| *w == "--cost-profile")?;
    words.next().map(str::to_string)
}

/// A temporary directory for the changed profiles, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `base` with `cost` multiplied by `factor` into `dir`; its path.
fn variant(base: &Profile, cost: &str, factor: f64, dir: &Path) -> CliResult<String> {
    let mut p = base.clone();
    if let Some(e) = entry(&mut p, cost) {
        e.source = format!(
            "slat reproduce --sensitivity: x{factor} of {}'s {} ns",
            base.name, e.ns
        );
        e.ns *= factor;
    }
    p.name = format!("{}-{cost}-x{factor}", base.name);
    let path = dir.join(format!("{}.toml", p.name));
    p.save(&path)
        .map_err(|e| CliError::Runtime(format!("--sensitivity: {e}")))?;
    path.to_str()
        .map(str::to_string)
        .ok_or_else(|| CliError::Runtime("--sensitivity: temporary path is not UTF-8".into()))
}

/// after/before of `pair` run with the profile at `path`.
fn ratio(runner: &mut Runner, pair: &Pair, path: &str) -> Option<f64> {
    let [b, a] = pair.args.each_ref().map(|x| with_profile(x, path));
    for args in [&b, &a] {
        runner.run(pair.bench, args, 1).ok()?;
    }
    let read = |args: &str| runner.read(pair.bench, args, pair.figure).ok();
    Some(read(&a)?.value / read(&b)?.value)
}

/// Runs seed `s`'s rows again with each cost of their profile halved and doubled.
pub fn run(runner: &mut Runner, s: &SeedReport, quiet: bool) -> CliResult<Sensitivity> {
    let given = profile_given(s).unwrap_or_else(|| s.seed.cost_profile.to_string());
    let base = load_profile(&given).map_err(|e| CliError::Runtime(format!("{given}: {e}")))?;
    let dir = std::env::temp_dir().join(format!(
        "slat-sensitivity-{}-{}",
        std::process::id(),
        s.seed.id
    ));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::Runtime(format!("--sensitivity: {}: {e}", dir.display())))?;
    let scratch = Scratch(dir);
    let costs = varied(&base);
    let mut rows: Vec<SensitivityRow> = (s.rows.iter())
        .map(|r| SensitivityRow {
            row: r.row.clone(),
            published_ratio: r.published.ratio,
            ratio: r.slat.ratio,
            direction: r.verdict.direction,
            holds: None,
            ratio_range: None,
            flips: Vec::new(),
            not_run: r.needs_virtual_time.clone().or(r.slat.error.clone()),
        })
        .collect();
    let mut variants = Vec::new();
    for cost in &costs {
        for factor in FACTORS {
            variants.push((cost, factor, variant(&base, cost, factor, &scratch.0)?));
        }
    }
    let ran = |row: &SensitivityRow| row.not_run.is_none();
    let pairs: Vec<&Pair> = (rows.iter().zip(&s.pairs))
        .filter_map(|(row, pair)| pair.as_ref().filter(|_| ran(row)))
        .collect();
    // With --jobs, every run is started ahead, the variants' files written first.
    runner.prefetch(wants(&pairs, variants.iter().map(|v| v.2.as_str())));
    for (cost, factor, path) in &variants {
        if !quiet {
            eprintln!(
                "[slat] reproduce {} --sensitivity: {cost} x{factor}",
                s.seed.id
            );
        }
        for (row, pair) in rows.iter_mut().zip(&s.pairs) {
            let Some(pair) = pair.as_ref().filter(|_| row.not_run.is_none()) else {
                continue;
            };
            let r = ratio(runner, pair, path);
            record(row, pair.claim, cost, *factor, r);
        }
    }
    Ok(Sensitivity {
        profile: base.name,
        factors: FACTORS,
        costs,
        rows,
    })
}

/// The runs [`ratio`] makes of every pair with every profile in `paths`, silent (the variants
/// are announced as they are read).
fn wants<'a>(pairs: &[&Pair], paths: impl Iterator<Item = &'a str>) -> Vec<Want> {
    let mut out = Vec::new();
    for path in paths {
        for pair in pairs {
            for args in &pair.args {
                out.push(Want {
                    bench: pair.bench,
                    args: with_profile(args, path),
                    round: 0,
                    say: None,
                });
            }
        }
    }
    out
}

/// Adds one change's result to `row`.
fn record(row: &mut SensitivityRow, claim: Claim, cost: &str, factor: f64, r: Option<f64>) {
    let direction = Verdict::of(claim, r).direction;
    if let Some(x) = r {
        let [lo, hi] = row.ratio_range.unwrap_or([x, x]);
        row.ratio_range = Some([lo.min(x), hi.max(x)]);
    }
    let same = direction.is_some() && direction == row.direction;
    row.holds = Some(row.holds.unwrap_or(true) && same);
    if !same {
        row.flips.push(Flip {
            cost: cost.to_string(),
            factor,
            ratio: r,
        });
    }
}

fn num(x: f64) -> String {
    format!("{x:.3}x")
}

/// The text of a seed's sensitivity table.
pub fn print(x: &Sensitivity) {
    println!(
        "sensitivity: each of {} costs of {} halved and doubled, one at a time (fair_every, retention, lookahead and the lock policy, the model's design choices, not varied):",
        x.costs.len(),
        x.profile
    );
    let rows: Vec<Vec<String>> = (x.rows.iter().enumerate())
        .map(|(i, r)| {
            let range = r
                .ratio_range
                .map_or("-".into(), |[a, b]| format!("{} .. {}", num(a), num(b)));
            let flips: Vec<String> = (r.flips.iter())
                .map(|f| match f.ratio {
                    Some(x) => format!("{} x{} ({})", f.cost, f.factor, num(x)),
                    None => format!("{} x{} (failed)", f.cost, f.factor),
                })
                .collect();
            let verdict = match (r.holds, &r.not_run) {
                (_, Some(why)) => format!("not run: {why}"),
                (Some(true), _) => "holds under every change".into(),
                (Some(false), _) => format!("flipped by {}", flips.join(", ")),
                (None, _) => "-".into(),
            };
            vec![
                format!("[{}] {}", i + 1, r.row),
                r.published_ratio.map_or("worse".into(), num),
                r.ratio.map_or("-".into(), num),
                match r.direction {
                    Some(true) => "yes".into(),
                    Some(false) => "no".into(),
                    None => "-".into(),
                },
                range,
                verdict,
            ]
        })
        .collect();
    super::table::print_table(
        &[
            "row",
            "published",
            "slat",
            "direction",
            "slat over the changes",
            "direction under the changes",
        ],
        &rows,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_word_is_replaced_and_every_cost_is_varied() {
        let a = "-v 1 -b 16M --cost-profile x86-server --clock virtual";
        assert_eq!(
            with_profile(a, "/tmp/p.toml"),
            "-v 1 -b 16M --cost-profile /tmp/p.toml --clock virtual"
        );
        let p = Profile::builtin("x86-server").unwrap();
        let costs = varied(&p);
        let stream = usize::from(p.model.dram_stream.is_some());
        assert_eq!(costs.len(), p.costs.len() + MODEL_COSTS.len() + stream);
        assert_eq!(stream, 1, "the seeds' profiles carry dram_stream");
        let mut q = p.clone();
        for c in &costs {
            assert!(entry(&mut q, c).is_some(), "{c}");
        }
    }
}
