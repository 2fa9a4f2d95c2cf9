//! Runs an experiment's command through the driver: the flags are parsed by the benchmark's
//! own clap definition (so the command printed is one the user can run), checked, measured
//! `--repeat` times by [`driver::runs`], and the medians of its metrics kept. Rows that share a
//! command (a page-table-test run gives three stages) share its run.

use super::experiments::{Bench, Figure};
use crate::access_tracking_perf::AccessTrackingPerfArgs;
use crate::args::BackendArg;
use crate::dirty_log_perf::DirtyLogPerfArgs;
use crate::driver::{self, Benchmark};
use crate::error::{CliError, CliResult};
use crate::page_table_test::PageTableTestArgs;
use crate::private_mem_perf::{self, PrivateMemPerfArgs};
use std::collections::HashMap;

/// One metric's median over the runs.
#[derive(Debug, Clone)]
struct Value {
    name: &'static str,
    unit: &'static str,
    median: Option<f64>,
}

/// A command's figures, and the guest pages per vCPU when the benchmark has them.
#[derive(Debug, Clone)]
struct Measured {
    values: Vec<Value>,
    pages_per_vcpu: Option<u64>,
}

/// A figure read from a run, in its unit.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    pub value: f64,
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
    /// Guest pages each vCPU works on (for figures per page).
    fn pages_per_vcpu(&self) -> Option<u64> {
        None
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
}

/// The flags `args` (words, without the subcommand) as benchmark `B` parses them, quiet and
/// repeated `repeat` times.
fn parse<B: Source>(args: &str, repeat: u32) -> CliResult<B> {
    let rep = repeat.to_string();
    let mut argv: Vec<&str> = args.split_whitespace().collect();
    // JSON only silences the benchmark's own text: the report is read, not printed.
    argv.extend(["--json", "--repeat", &rep]);
    let cmd = B::augment_args(clap::Command::new(B::NAME).no_binary_name(true));
    let bad = |e: String| CliError::bad(format!("slat {} {args}: {e}", B::NAME));
    let m = cmd
        .try_get_matches_from(argv)
        .map_err(|e| bad(crate::one_line(&e.render().to_string())))?;
    let b = B::from_arg_matches(&m).map_err(|e| bad(crate::one_line(&e.to_string())))?;
    if let Some(why) = b.refuse() {
        return Err(bad(why));
    }
    b.check().map_err(|e| bad(e.to_string()))?;
    Ok(b)
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

fn measure<B: Source>(args: &str, repeat: u32) -> CliResult<Measured> {
    let b = parse::<B>(args, repeat)?;
    let runs = driver::runs(&b, BackendArg::Sim, false)?;
    let per_run: Vec<_> = runs.iter().map(|r| b.values(r)).collect();
    let names = per_run.first().cloned().unwrap_or_default();
    let values = names
        .iter()
        .enumerate()
        .map(|(i, &(name, unit, _))| {
            let xs = per_run.iter().filter_map(|v| v.get(i).and_then(|x| x.2));
            let median = median(xs.collect());
            Value { name, unit, median }
        })
        .collect();
    Ok(Measured {
        values,
        pages_per_vcpu: b.pages_per_vcpu(),
    })
}

/// Runs commands, each once per distinct command line.
pub struct Runner {
    repeat: u32,
    memo: HashMap<String, Measured>,
}

impl Runner {
    pub fn new(repeat: u32) -> Self {
        Runner {
            repeat,
            memo: HashMap::new(),
        }
    }

    /// Refuses flags benchmark `bench` would refuse, without running anything.
    pub fn check(&self, bench: Bench, args: &str) -> CliResult {
        match bench {
            Bench::DirtyLogPerf => parse::<DirtyLogPerfArgs>(args, 1).map(drop),
            Bench::AccessTrackingPerf => parse::<AccessTrackingPerfArgs>(args, 1).map(drop),
            Bench::PageTableTest => parse::<PageTableTestArgs>(args, 1).map(drop),
            Bench::PrivateMemPerf => parse::<PrivateMemPerfArgs>(args, 1).map(drop),
        }
    }

    /// `fig` of `slat BENCH ARGS`, run now unless the same command already ran.
    pub fn read(&mut self, bench: Bench, args: &str, fig: Figure) -> CliResult<Reading> {
        let key = format!("{} {args}", bench.name());
        if !self.memo.contains_key(&key) {
            let r = self.repeat;
            let m = match bench {
                Bench::DirtyLogPerf => measure::<DirtyLogPerfArgs>(args, r),
                Bench::AccessTrackingPerf => measure::<AccessTrackingPerfArgs>(args, r),
                Bench::PageTableTest => measure::<PageTableTestArgs>(args, r),
                Bench::PrivateMemPerf => measure::<PrivateMemPerfArgs>(args, r),
            }?;
            self.memo.insert(key.clone(), m);
        }
        let m = &self.memo[&key];
        let missing = || CliError::Runtime(format!("slat {key}: no `{}` figure", fig.metric));
        let v = m.values.iter().find(|v| v.name == fig.metric);
        let (value, unit) = v
            .and_then(|v| Some((v.median?, v.unit)))
            .ok_or_else(missing)?;
        match (fig.per_page, m.pages_per_vcpu) {
            (false, _) => Ok(Reading { value, unit }),
            (true, Some(pages)) if pages > 0 && unit == "s" => Ok(Reading {
                value: value * 1e9 / pages as f64,
                unit: "ns/page",
            }),
            (true, _) => Err(missing()),
        }
    }
}
