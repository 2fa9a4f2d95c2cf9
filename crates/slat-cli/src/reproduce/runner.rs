//! Runs an experiment's command through the driver: the flags are parsed by the benchmark's
//! own clap definition (so the command printed is one the user can run), checked, measured
//! once per round by [`driver::runs`], and the median of its figures read. Rows that share a
//! command (a page-table-test run gives three stages) share its runs. With `--jobs` above 1
//! every run is a `slat reproduce-worker` process of [`super::jobs`]'s pool instead, its
//! figures read back here by name.

use super::experiments::{Bench, Figure};
use super::jobs::{Outcome, Pool, Want};
use crate::access_tracking_perf::AccessTrackingPerfArgs;
use crate::args::BackendArg;
use crate::dirty_log_perf::DirtyLogPerfArgs;
use crate::driver::{self, Benchmark};
use crate::error::{CliError, CliResult};
use crate::page_table_test::PageTableTestArgs;
use crate::private_mem_perf::{self, PrivateMemPerfArgs};
use std::collections::HashMap;

/// One metric of one run.
#[derive(Debug, Clone)]
struct Value {
    name: &'static str,
    unit: &'static str,
    value: Option<f64>,
}

/// A command's runs so far, and the guest pages per vCPU when the benchmark has them.
#[derive(Debug, Clone, Default)]
struct Measured {
    runs: Vec<Vec<Value>>,
    pages_per_vcpu: Option<u64>,
    /// Times the driver was asked (each call is one round of `--repeat`).
    calls: usize,
}

/// `$f::<B>($args)` for benchmark `$bench`'s flags type `B`.
macro_rules! by_bench {
    ($bench:expr, $f:ident($($a:expr),*)) => {
        match $bench {
            Bench::DirtyLogPerf => $f::<DirtyLogPerfArgs>($($a),*),
            Bench::AccessTrackingPerf => $f::<AccessTrackingPerfArgs>($($a),*),
            Bench::PageTableTest => $f::<PageTableTestArgs>($($a),*),
            Bench::PrivateMemPerf => $f::<PrivateMemPerfArgs>($($a),*),
        }
    };
}

/// A figure read from a run, in its unit.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    /// The median over the runs.
    pub value: f64,
    /// The smallest and largest run.
    pub range: [f64; 2],
    pub unit: &'static str,
}

/// A benchmark an experiment can run: its flags parse from words, and its report gives the
/// figures by name.
trait Source: Benchmark + clap::Args + clap::FromArgMatches {
    /// Every figure of one run, by name.
    fn values(&self, r: &Self::Report) -> Vec<(&'static str, &'static str, Option<f64>)> {
        let ms = self.metrics();
        ms.iter().map(|m| (m.name, m.unit, (m.get)(r))).collect()
    }
    /// The name and unit of every figure [`Source::values`] gives.
    fn names(&self) -> Vec<(&'static str, &'static str)> {
        self.metrics().iter().map(|m| (m.name, m.unit)).collect()
    }
    /// Guest pages each vCPU works on (for figures per page).
    fn pages_per_vcpu(&self) -> Option<u64> {
        None
    }
    /// `args` with guest memory that keeps no data (the benchmark's own flag for it).
    fn phantom(args: &str) -> String {
        phantom(args)
    }
}

impl Source for DirtyLogPerfArgs {
    fn pages_per_vcpu(&self) -> Option<u64> {
        Some(self.work.bytes / slat_addr::PAGE_SIZE)
    }
}
impl Source for AccessTrackingPerfArgs {}
impl Source for PageTableTestArgs {}
impl Source for PrivateMemPerfArgs {
    /// The simulated machine's figures are per direct-map variant; an experiment names one
    /// variant, so its run has one row.
    fn values(&self, r: &Self::Report) -> Vec<(&'static str, &'static str, Option<f64>)> {
        let row = match r {
            private_mem_perf::Run::Sim(s) => s.rows.first(),
            private_mem_perf::Run::Host(_) => None,
        };
        let ms = private_mem_perf::sim::ROW_METRICS;
        ms.iter()
            .map(|m| (m.name, m.unit, row.and_then(|x| (m.get)(x))))
            .collect()
    }
    fn names(&self) -> Vec<(&'static str, &'static str)> {
        let ms = private_mem_perf::sim::ROW_METRICS;
        ms.iter().map(|m| (m.name, m.unit)).collect()
    }
    /// Its guest memory and private pool are phantom with `--phantom` (it has no `-s`).
    fn phantom(args: &str) -> String {
        format!("{args} --phantom")
    }
}

fn bad<B: Benchmark>(args: &str, e: impl std::fmt::Display) -> CliError {
    CliError::bad(format!("slat {} {args}: {e}", B::NAME))
}

/// The flags `args` (words, without the subcommand) as benchmark `B`'s clap definition parses
/// them, quiet.
fn flags<B: Source>(args: &str) -> CliResult<B> {
    let mut argv: Vec<&str> = args.split_whitespace().collect();
    // JSON only silences the benchmark's own text: the report is read, not printed.
    argv.push("--json");
    let cmd = B::augment_args(clap::Command::new(B::NAME).no_binary_name(true));
    let m = cmd
        .try_get_matches_from(argv)
        .map_err(|e| bad::<B>(args, crate::one_line(&e.render().to_string())))?;
    B::from_arg_matches(&m).map_err(|e| bad::<B>(args, crate::one_line(&e.to_string())))
}

/// [`flags`], refused as the benchmark refuses them (sizes this host cannot hold, say).
fn parse<B: Source>(args: &str) -> CliResult<B> {
    let b = flags::<B>(args)?;
    refusal(&b).map_err(|why| bad::<B>(args, why))?;
    Ok(b)
}

fn checks<B: Source>(args: &str) -> CliResult {
    parse::<B>(args).map(drop)
}

fn parses_as<B: Source>(args: &str) -> CliResult {
    flags::<B>(args).map(drop)
}

/// Why the benchmark refuses parsed flags `b`, in its own words.
fn refusal<B: Source>(b: &B) -> Result<(), String> {
    if let Some(why) = b.refuse() {
        return Err(why);
    }
    b.check().map_err(|e| e.to_string())
}

/// Whether benchmark `B` has a `--clock` flag: asked of its own flag definitions, so a
/// benchmark that gains virtual time is run in it without a change here.
fn has_clock<B: Source>() -> bool {
    let cmd = B::augment_args(clap::Command::new(B::NAME));
    let mut longs = cmd.get_arguments().filter_map(|a| a.get_long());
    longs.any(|l| l == "clock")
}

/// How a command runs in virtual time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Virtual {
    /// These arguments run (`--clock virtual`, and phantom memory where the host is too small).
    Runs(String),
    /// The benchmark cannot run these arguments in virtual time yet: the arguments it would
    /// run, and why not.
    Needs(String, String),
}

/// The guest-memory backing `-s` with the same page size and no host memory behind it.
fn phantom(args: &str) -> String {
    let mut words: Vec<&str> = args.split_whitespace().collect();
    match words.iter().position(|w| *w == "-s") {
        Some(i) if i + 1 < words.len() => {
            words[i + 1] = match words[i + 1] {
                "anonymous_thp" => "phantom_thp",
                "anonymous_hugetlb_1gb" => "phantom_hugetlb_1gb",
                _ => "phantom",
            };
        }
        _ => words.extend(["-s", "phantom"]),
    }
    words.join(" ")
}

/// `args` in virtual time as benchmark `B` takes them: with `--clock virtual`, with phantom
/// memory when the benchmark refuses the real memory, or what it needs first.
fn virtualise_as<B: Source>(args: &str) -> CliResult<Virtual> {
    let v = format!("{args} --clock virtual");
    if !has_clock::<B>() {
        return Ok(Virtual::Needs(
            v,
            format!("needs virtual time on {}", B::NAME),
        ));
    }
    // A hugetlb backing needs reserved huge pages, which the benchmark's checks cannot see
    // (the run finds out); in virtual time the phantom backing of the same page size runs
    // whatever this host has reserved.
    if v.split_whitespace().any(|w| w.contains("hugetlb")) {
        let p = phantom(&v);
        refusal(&flags::<B>(&p)?).map_err(|why| bad::<B>(&p, why))?;
        return Ok(Virtual::Runs(p));
    }
    let why = match refusal(&flags::<B>(&v)?) {
        Ok(()) => return Ok(Virtual::Runs(v)),
        Err(why) => why,
    };
    // The benchmark's refusal names its own flag when it is virtual time that it lacks.
    if why.contains("--clock virtual") {
        let needs = format!("needs virtual time on {} ({why})", B::NAME);
        return Ok(Virtual::Needs(v, needs));
    }
    let p = B::phantom(&v);
    match flags::<B>(&p).map(|b| refusal(&b)) {
        Ok(Ok(())) => Ok(Virtual::Runs(p)),
        _ => Err(bad::<B>(&v, why)),
    }
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(xs[n / 2]),
        _ => Some((xs[n / 2 - 1] + xs[n / 2]) / 2.0),
    }
}

/// One more run of `args` through the driver, its figures added to `m`.
fn measure<B: Source>(args: &str, m: &mut Measured) -> CliResult {
    let b = parse::<B>(args)?;
    for r in driver::runs(&b, BackendArg::Sim, false)? {
        let values = b.values(&r).into_iter();
        let values = values.map(|(name, unit, value)| Value { name, unit, value });
        m.runs.push(values.collect());
    }
    m.pages_per_vcpu = b.pages_per_vcpu();
    Ok(())
}

/// One round of `args` through the driver, in this process, as a worker reports it: each
/// figure by name, its value's bits (exact through JSON).
fn outcome<B: Source>(args: &str) -> CliResult<Outcome> {
    let b = parse::<B>(args)?;
    let runs = driver::runs(&b, BackendArg::Sim, false)?;
    let runs = runs.iter().map(|r| {
        let values = b.values(r).into_iter();
        let values = values.map(|(n, u, v)| (n.to_string(), u.to_string(), v.map(f64::to_bits)));
        values.collect()
    });
    Ok(Outcome {
        runs: runs.collect(),
        pages_per_vcpu: b.pages_per_vcpu(),
    })
}

/// A worker's round of `args` added to `m`, its figures named by benchmark `B`'s own names.
fn absorb<B: Source>(args: &str, o: Outcome, m: &mut Measured) -> CliResult {
    let names = flags::<B>(args)?.names();
    let fail = |why: String| CliError::Runtime(format!("slat {} {args}: worker: {why}", B::NAME));
    if o.runs.is_empty() {
        return Err(fail("no run reported".into()));
    }
    for run in o.runs {
        let mut values = Vec::with_capacity(run.len());
        for (name, unit, bits) in run {
            let known = names.iter().find(|(n, u)| *n == name && *u == unit);
            let &(name, unit) = known.ok_or_else(|| fail(format!("unknown figure `{name}`")))?;
            let value = bits.map(f64::from_bits);
            values.push(Value { name, unit, value });
        }
        m.runs.push(values);
    }
    m.pages_per_vcpu = o.pages_per_vcpu;
    Ok(())
}

/// Runs commands, each as many times as asked and no more: rows that share a command share
/// its runs. With a pool, each round is a worker process's, started ahead by
/// [`Runner::prefetch`] or when first asked for.
#[derive(Default)]
pub struct Runner {
    memo: HashMap<String, Measured>,
    pool: Option<Pool>,
}

impl Runner {
    /// A runner with `jobs` workers (1: every run in this process, one at a time); the pool
    /// prints when each run starts and ends unless `quiet`.
    pub fn new(jobs: usize, quiet: bool) -> CliResult<Runner> {
        let pool = match jobs {
            0 | 1 => None,
            n => Some(Pool::new(n, quiet)?),
        };
        Ok(Runner {
            memo: HashMap::new(),
            pool,
        })
    }

    /// Whether runs go to worker processes (which announce them).
    pub fn pooled(&self) -> bool {
        self.pool.is_some()
    }

    /// Starts `wants` on the pool's workers, in order, as they come free (nothing without a
    /// pool: each run then happens when asked for).
    pub fn prefetch(&self, wants: Vec<Want>) {
        if let Some(p) = &self.pool {
            p.prefetch(wants);
        }
    }

    /// The figures of one round of `slat BENCH ARGS`, for `slat reproduce-worker`.
    pub fn outcome(bench: Bench, args: &str) -> CliResult<Outcome> {
        by_bench!(bench, outcome(args))
    }

    /// Refuses flags benchmark `bench` would refuse, without running anything.
    pub fn check(&self, bench: Bench, args: &str) -> CliResult {
        by_bench!(bench, checks(args))
    }

    /// Refuses flags benchmark `bench`'s parser refuses (for commands at a scale this host
    /// cannot run, which only the parser can check).
    pub fn parses(bench: Bench, args: &str) -> CliResult {
        by_bench!(bench, parses_as(args))
    }

    /// `slat BENCH ARGS` in virtual time: what runs, or what the benchmark needs first.
    pub fn virtualise(bench: Bench, args: &str) -> CliResult<Virtual> {
        by_bench!(bench, virtualise_as(args))
    }

    /// Makes sure `slat BENCH ARGS` has run at least `runs` times (in order of rounds,
    /// whichever worker finished first).
    pub fn run(&mut self, bench: Bench, args: &str, runs: usize) -> CliResult {
        let m = self.memo.entry(key(bench, args)).or_default();
        while m.runs.len() < runs {
            match &self.pool {
                None => by_bench!(bench, measure(args, m))?,
                Some(p) => {
                    let o = p.take(bench, args, m.calls)?;
                    by_bench!(bench, absorb(args, o, m))?;
                }
            }
            m.calls += 1;
        }
        Ok(())
    }

    /// `slat BENCH ARGS` has run at least `runs` times (an earlier row's run is reused).
    pub fn has(&self, bench: Bench, args: &str, runs: usize) -> bool {
        self.memo
            .get(&key(bench, args))
            .is_some_and(|m| m.runs.len() >= runs)
    }

    /// `slat BENCH ARGS` ran, and `fig` has a value in none of its runs.
    pub fn empty(&self, bench: Bench, args: &str, fig: Figure) -> bool {
        self.memo.get(&key(bench, args)).is_some_and(|m| {
            !m.runs.is_empty()
                && m.runs
                    .iter()
                    .all(|r| r.iter().all(|v| v.name != fig.metric || v.value.is_none()))
        })
    }

    /// The median of `fig` over the runs of `slat BENCH ARGS` so far.
    pub fn read(&self, bench: Bench, args: &str, fig: Figure) -> CliResult<Reading> {
        let key = key(bench, args);
        let missing = || CliError::Runtime(format!("slat {key}: no `{}` figure", fig.metric));
        let m = self.memo.get(&key).ok_or_else(missing)?;
        let of = |run: &Vec<Value>| run.iter().find(|v| v.name == fig.metric).cloned();
        let unit = m.runs.first().and_then(of).ok_or_else(missing)?.unit;
        let xs: Vec<f64> = m.runs.iter().filter_map(|r| of(r)?.value).collect();
        let range = [
            xs.iter().copied().reduce(f64::min),
            xs.iter().copied().reduce(f64::max),
        ];
        let value = median(xs).ok_or_else(missing)?;
        let range = range.map(|x| x.unwrap_or(value));
        match (fig.per_page, m.pages_per_vcpu) {
            (false, _) => Ok(Reading { value, range, unit }),
            (true, Some(pages)) if pages > 0 && unit == "s" => {
                let per = |x: f64| x * 1e9 / pages as f64;
                Ok(Reading {
                    value: per(value),
                    range: range.map(per),
                    unit: "ns/page",
                })
            }
            (true, _) => Err(missing()),
        }
    }
}

/// The cost profile `--cost-profile NAME_OR_FILE` loads in a benchmark: the file when it
/// exists, else the built-in profile of that name.
pub fn load_profile(name_or_file: &str) -> Result<slat_vt::Profile, String> {
    let path = std::path::Path::new(name_or_file);
    match (path.exists(), slat_vt::Profile::builtin(name_or_file)) {
        (false, Some(p)) => Ok(p),
        (false, None) => Err(format!(
            "no such file, nor a built-in profile ({})",
            slat_vt::BUILTIN_PROFILES.join(", ")
        )),
        (true, _) => slat_vt::Profile::load(path).map_err(|e| crate::one_line(&e.to_string())),
    }
}

/// The memo's (and the pool's) name of `slat BENCH ARGS`.
pub fn key(bench: Bench, args: &str) -> String {
    format!("{} {args}", bench.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A figure with no value in any run is empty (and measured again in real time); one
    /// run with a value is enough.
    #[test]
    fn a_figure_no_run_gave_is_empty() {
        let fig = Figure {
            metric: "write p99, during harvests",
            per_page: false,
        };
        let (bench, args) = (Bench::DirtyLogPerf, "-v 1 -b 16M -g --concurrent");
        let value = |value| Value {
            name: fig.metric,
            unit: "us",
            value,
        };
        let mut r = Runner::default();
        assert!(!r.empty(bench, args, fig), "not run yet: nothing to say");
        let m = r.memo.entry(key(bench, args)).or_default();
        m.runs.push(vec![value(None)]);
        assert!(r.empty(bench, args, fig));
        assert!(r.read(bench, args, fig).is_err());
        r.memo
            .get_mut(&key(bench, args))
            .unwrap()
            .runs
            .push(vec![value(Some(2.0))]);
        assert!(!r.empty(bench, args, fig));
        assert_eq!(r.read(bench, args, fig).map(|x| x.value).ok(), Some(2.0));
    }

    #[test]
    fn phantom_memory_keeps_the_page_size() {
        assert_eq!(phantom("-v 64 -b 1G"), "-v 64 -b 1G -s phantom");
        assert_eq!(phantom("-s anonymous -b 1G"), "-s phantom -b 1G");
        assert_eq!(phantom("-s anonymous_thp -v 2"), "-s phantom_thp -v 2");
        let g = "-s anonymous_hugetlb_1gb -b 20G";
        assert_eq!(phantom(g), "-s phantom_hugetlb_1gb -b 20G");
        // Even where this host's memory would do: the huge pages are not reserved here.
        let small = Runner::virtualise(Bench::PageTableTest, "-s anonymous_hugetlb_1gb -b 1G -v 2");
        let want = "-s phantom_hugetlb_1gb -b 1G -v 2 --clock virtual".to_string();
        assert_eq!(small.unwrap(), Virtual::Runs(want));
    }

    /// A benchmark with a virtual clock runs in it (with phantom memory when the seed's guest
    /// does not fit here); one that refuses the flags in virtual time is noted, not failed.
    #[test]
    fn virtual_time_is_asked_of_the_benchmark() {
        assert!(has_clock::<DirtyLogPerfArgs>());
        let dlp = |a| Runner::virtualise(Bench::DirtyLogPerf, a).unwrap();
        let v = "-v 1 -b 16M --clock virtual".to_string();
        assert_eq!(dlp("-v 1 -b 16M"), Virtual::Runs(v));
        let big = "-v 64 -b 1G --clock virtual -s phantom".to_string();
        assert_eq!(dlp("-v 64 -b 1G"), Virtual::Runs(big));
        // The concurrent harvest runs too: its harvester is host CPU 0.
        let c = "-v 2 -b 16M -g --concurrent --clock virtual".to_string();
        assert_eq!(dlp("-v 2 -b 16M -g --concurrent"), Virtual::Runs(c));
        // private-mem-perf's phantom memory is its own flag.
        let pmp = |a| Runner::virtualise(Bench::PrivateMemPerf, a).unwrap();
        let big = "--backend sim -v 128 -b 5G --clock virtual --phantom".to_string();
        assert_eq!(pmp("--backend sim -v 128 -b 5G"), Virtual::Runs(big));
    }
}
