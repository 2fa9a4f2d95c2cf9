//! `slat reproduce`: each seed thread's experiment as slat's own benchmarks, before and after
//! the thread's change, beside the numbers the thread published, with a verdict per row.
//!
//! The published numbers live in [`published`] with their file and line; the experiments
//! (benchmark, flags of the change, figure, and the size at the seed's scale, this host's and
//! `--quick`'s) in [`experiments`]; [`runner`] runs each command through the driver and
//! [`table`] prints, plots and serialises the result. `--clock real` runs at this host's
//! scale; `--clock virtual` runs the seed-scale commands on the benchmarks' virtual clock,
//! the rows whose benchmark has none yet noted as needing it; [`jobs`] runs its commands
//! several at a time, each in a process of its own.

mod experiments;
mod jobs;
pub mod published;
mod runner;
mod sensitivity;
mod table;

use crate::args::{check_writable, BackendArg};
use crate::error::{CliError, CliResult};
use crate::output::print_json;
use crate::report::quiet;
use clap::{Args, ValueEnum};
use experiments::{Bench, Experiment, Size, GET_SWEEP};
pub use jobs::{worker, WorkerArgs};
use published::{Seed, SEEDS};
use runner::{Reading, Runner, Virtual};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;
use table::{Cell, Row, SeedReport, Verdict};

/// Which seeds to reproduce.
#[derive(Debug, Clone)]
pub struct Which(pub Vec<&'static Seed>);

fn which(s: &str) -> Result<Which, String> {
    if s == "all" {
        return Ok(Which(SEEDS.iter().collect()));
    }
    published::seed(s)
        .map(|x| Which(vec![x]))
        .ok_or_else(|| format!("`{s}` is not a seed: give 000, 001, 002, 003, 004 or all"))
}

/// The clock the experiments run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ClockArg {
    /// Wall-clock time on this host, at this host's scale (1-2 vCPUs, sizes that fit).
    Real,
    /// Simulated time at each seed's own scale (the benchmarks' `--clock virtual`, phantom
    /// memory where this host is too small).
    Virtual,
}

/// Flags of `slat reproduce`.
#[derive(Debug, Clone, Args)]
#[command(after_long_help = "\
Each row runs one of slat's benchmarks twice, before and after the seed's change, and prints \
both commands so they can be run by hand. after/before is each side's ratio (below 1: the \
figure went down). direction: slat's ratio is on the same side of 1 as the published one. \
within 2x: slat's ratio is between half and twice the published one (n/a where the thread gives \
no figure). With --repeat, \"(in noise)\" after the direction: the before and after runs' ranges \
overlap. Rows with the same command share their runs. Exit status 1 if any run failed (its row \
says why); the other rows are still printed. With --clock virtual every command gains --clock \
virtual, --cost-profile of the seed's machine class (x86-server, or arm64-server for 001; printed \
with each table) and -s phantom where this host's memory is too small; a row whose benchmark has no \
virtual clock yet, or refuses these flags in virtual time, is not run and says \"needs virtual \
time on BENCHMARK\" (not a failure).")]
pub struct ReproduceArgs {
    /// The seed thread: 000 (fast page fault for the TDP MMU), 001 (arm64 stage-2 cache
    /// maintenance and block rebuild), 002 (lock-free write-protect through the reverse map),
    /// 003 (private memory and the host direct map), 004 (two dirty bitmaps), or all.
    #[arg(value_name = "SEED", value_parser = which)]
    pub seed: Which,
    /// `real`: wall-clock time at this host's scale. `virtual`: simulated time at the seeds'
    /// own scale; a row whose benchmark has no virtual clock yet says so instead of running.
    #[arg(long, value_enum, default_value = "real")]
    pub clock: ClockArg,
    /// With --clock virtual: the cost profile every command simulates with (passed to each
    /// benchmark's --cost-profile): a file, or a built-in name (host for this host's,
    /// x86-server, arm64-server). Without it, each seed's machine class: arm64-server for 001,
    /// x86-server for the others. No spaces in the path.
    #[arg(long = "cost-profile", value_name = "FILE|NAME")]
    pub cost_profile: Option<PathBuf>,
    /// The same experiments scaled down to seconds per seed (for CI), on either clock.
    #[arg(long)]
    pub quick: bool,
    /// With --clock virtual: every seed at its own scale, also where `reproduce` scales one
    /// down to keep `all` within 45 minutes on this host: 003's 128 vCPUs faulting in 640 GB
    /// (about 2 hours with two at once; without this flag they fault in 16 GiB) and 002's
    /// shadow-paging guest benchmark (about 18 minutes more); the scaled rows say so.
    #[arg(long)]
    pub full_scale: bool,
    /// Print one JSON document (schema: crates/slat-cli/schema/reproduce.json) instead of the
    /// tables.
    #[arg(long)]
    pub json: bool,
    /// Run every command N times, before and after alternately, and compare the medians
    /// (1-1000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000), default_value_t = 1)]
    pub repeat: u32,
    /// With --clock virtual: run every row again with each cost of its profile halved and
    /// doubled, one at a time, at --quick's scale, and print whether the direction verdict
    /// holds under all of them or which changes flip it.
    #[arg(long)]
    pub sensitivity: bool,
    /// Also draw each seed's after/before ratios, the thread's bar beside slat's for every row,
    /// into an SVG file (checked writable before anything runs).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// With --clock virtual: run up to N commands at once (1-64), each in a `slat` process of
    /// its own exactly as printed, so every figure is the one the command gives alone (a
    /// virtual-time run does not depend on the host's load). Default: this host's CPUs with
    /// --clock virtual; 1, the only value allowed, with --clock real (a real-time measurement
    /// must not share the host). Memory adds up: 002's seed-scale runs take about 6 GiB each.
    /// The commands start in the rows' order, across seeds, so a seed's time is how long its
    /// table took after the previous one.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub jobs: Option<u32>,
}

/// The JSON document.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    /// `real` or `virtual`.
    clock: &'static str,
    /// `host`, `seed` (virtual time) or `quick`.
    scale: Size,
    /// Runs per command (medians).
    repeat: u32,
    /// Commands run at once (`--jobs`).
    jobs: usize,
    seeds: &'a [SeedReport],
}

impl ReproduceArgs {
    fn size(&self) -> Size {
        match (self.quick || self.sensitivity, self.clock) {
            (true, _) => Size::Quick,
            (false, ClockArg::Real) => Size::Host,
            (false, ClockArg::Virtual) if self.full_scale => Size::Full,
            (false, ClockArg::Virtual) => Size::Seed,
        }
    }
}

impl ClockArg {
    fn name(self) -> &'static str {
        match self {
            ClockArg::Real => "real",
            ClockArg::Virtual => "virtual",
        }
    }
}

/// Runs `slat reproduce`.
pub fn run(a: &ReproduceArgs) -> CliResult {
    if let Some(p) = &a.plot {
        check_writable("--plot", p)?;
    }
    let profile = cost_profile(a)?;
    refuse_combinations(a)?;
    let jobs = jobs(a)?;
    let size = a.size();
    let ctx = Ctx {
        size,
        repeat: a.repeat as usize,
        quiet: quiet(a.json),
        virtual_time: a.clock == ClockArg::Virtual,
        explicit: profile,
    };
    let mut runner = Runner::new(jobs, ctx.quiet)?;
    check_all(a, &ctx, &runner)?;
    let t0 = Instant::now();
    runner.prefetch(jobs::plan(&a.seed.0, &ctx));
    let mut seeds = Vec::new();
    for seed in &a.seed.0 {
        let s = reproduce_seed(seed, &mut runner, &ctx, a.sensitivity)?;
        if !a.json {
            table::print(&s, a.clock.name(), size_name(size));
        }
        seeds.push(s);
    }
    if !a.json && jobs > 1 {
        println!(
            "all took {:.1} s, up to {jobs} commands at a time (--jobs {jobs})",
            t0.elapsed().as_secs_f64()
        );
    }
    if let Some(path) = &a.plot {
        table::plot(&seeds, path)?;
    }
    if a.json {
        let doc = Report {
            benchmark: "reproduce",
            clock: a.clock.name(),
            scale: size,
            repeat: a.repeat,
            jobs,
            seeds: &seeds,
        };
        print_json(&doc, &[BackendArg::Sim])?;
    }
    let failed = seeds.iter().flat_map(|s| &s.rows);
    match failed.filter(|r| r.slat.error.is_some()).count() {
        0 => Ok(()),
        n => Err(CliError::Runtime(format!("reproduce: {n} rows failed"))),
    }
}

/// Every command is checked before the first runs, as a sweep's rows are; the seed-scale
/// ones the table prints (for --clock virtual) at least parse.
fn check_all(a: &ReproduceArgs, ctx: &Ctx, runner: &Runner) -> CliResult {
    for seed in &a.seed.0 {
        for (bench, args) in commands(seed.id, ctx.size) {
            match ctx.virtual_time {
                true => Runner::virtualise(bench, &ctx.with_profile(seed.id, args)).map(drop)?,
                false => runner.check(bench, &args)?,
            }
        }
        for (bench, args) in commands(seed.id, Size::Full) {
            Runner::parses(bench, &ctx.seed_profile(seed.id, args))?;
        }
    }
    Ok(())
}

/// Seed `seed`'s table: its rows (and 004's grid), and `--sensitivity`'s.
fn reproduce_seed(
    seed: &'static Seed,
    runner: &mut Runner,
    ctx: &Ctx,
    sensitivity: bool,
) -> CliResult<SeedReport> {
    let t0 = Instant::now();
    let mut s = SeedReport {
        seed: *seed,
        cost_profile: ctx.used_profile(seed),
        rows: Vec::new(),
        sweep: Vec::new(),
        implied: None,
        sensitivity: None,
        wall_s: 0.0,
        pairs: Vec::new(),
    };
    if seed.id == GET_SWEEP.row.seed {
        get_sweep(runner, ctx, &mut s);
    }
    for e in experiments::of(seed.id) {
        let c = Commands::of(e, ctx);
        row(&mut s, runner, e, c, ctx, e.row.to_string());
    }
    if sensitivity {
        s.sensitivity = Some(sensitivity::run(runner, &s, ctx.quiet)?);
    }
    s.wall_s = t0.elapsed().as_secs_f64();
    Ok(s)
}

/// `--jobs`, or its default for the clock: one with real time, this host's CPUs with
/// virtual time.
fn jobs(a: &ReproduceArgs) -> CliResult<usize> {
    match (a.clock, a.jobs) {
        (ClockArg::Real, Some(n)) if n > 1 => Err(CliError::bad(format!(
            "--jobs {n} needs --clock virtual (real-time runs must not share the host): give --jobs 1"
        ))),
        (ClockArg::Real, _) => Ok(1),
        (ClockArg::Virtual, Some(n)) => Ok(n as usize),
        (ClockArg::Virtual, None) => {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            Ok(cpus.min(64))
        }
    }
}

/// Flags that need virtual time, and scales that exclude each other.
fn refuse_combinations(a: &ReproduceArgs) -> CliResult {
    if a.sensitivity && a.clock != ClockArg::Virtual {
        return Err(CliError::bad(
            "--sensitivity needs --clock virtual (it varies the cost profile's numbers)",
        ));
    }
    if a.full_scale && (a.clock != ClockArg::Virtual || a.quick || a.sensitivity) {
        return Err(CliError::bad(
            "--full-scale needs --clock virtual, without --quick or --sensitivity (it runs the seeds' own scale)",
        ));
    }
    Ok(())
}

fn size_name(s: Size) -> &'static str {
    match s {
        Size::Seed => "the seed's",
        Size::Full => "the seed's own (--full-scale)",
        Size::Host => "this host's",
        Size::Quick => "--quick",
    }
}

/// Every command seed `id` runs at `size`.
fn commands(id: &str, size: Size) -> Vec<(experiments::Bench, String)> {
    let mut out = Vec::new();
    for e in experiments::of(id) {
        out.push((e.bench, e.args(size, false)));
        out.push((e.bench, e.args(size, true)));
    }
    if id == GET_SWEEP.row.seed {
        for (s, d) in sweep_cells() {
            for after in [false, true] {
                out.push((GET_SWEEP.row.bench, sweep_args(s.flags(size), d, after)));
            }
        }
    }
    out
}

/// Run `round` (from 1) of `slat BENCH ARGS`, as progress lines name it.
fn what(bench: Bench, args: &str, round: usize, ctx: &Ctx) -> String {
    match ctx.repeat {
        1 => command(bench, args),
        n => format!("{} (run {round}/{n})", command(bench, args)),
    }
}

/// The words of `slat BENCH ARGS`.
fn command(bench: experiments::Bench, args: &str) -> String {
    format!("slat {} {args}", bench.name())
}

/// A row's commands (arguments after the subcommand) on the run's clock, and at the seed's
/// scale in virtual time.
struct Commands {
    here: [String; 2],
    seed: [String; 2],
    /// The size flags used here.
    scale: String,
    /// What the benchmark needs before these commands can run in virtual time.
    needs: Option<String>,
}

impl Commands {
    fn of(e: &Experiment, ctx: &Ctx) -> Commands {
        let args = |size| [false, true].map(|after| e.args(size, after));
        Commands::new(
            (e.seed, e.bench),
            args(ctx.size),
            args(Size::Full),
            e.scale.flags(ctx.size),
            ctx,
        )
    }

    fn new(
        (id, bench): (&str, Bench),
        here: [String; 2],
        seed: [String; 2],
        scale: &str,
        ctx: &Ctx,
    ) -> Commands {
        let mut needs = None;
        let here = here.map(|args| match ctx.virtual_time {
            false => args,
            // Checked before the first run: an error here is one a run would give.
            true => match Runner::virtualise(bench, &ctx.with_profile(id, args.clone())) {
                Ok(Virtual::Runs(a)) => a,
                Ok(Virtual::Needs(a, why)) => {
                    needs = Some(why);
                    a
                }
                Err(_) => args,
            },
        });
        Commands {
            here,
            seed: seed.map(|args| {
                match Runner::virtualise(bench, &ctx.seed_profile(id, args.clone())) {
                    Ok(Virtual::Runs(a) | Virtual::Needs(a, _)) => a,
                    Err(_) => format!("{args} --clock virtual"),
                }
            }),
            scale: scale.to_string(),
            needs,
        }
    }
}

/// How the experiments run.
struct Ctx {
    size: Size,
    /// Rounds of before and after.
    repeat: usize,
    quiet: bool,
    /// `--clock virtual`: the commands run with the benchmarks' virtual clock.
    virtual_time: bool,
    /// `--cost-profile`'s file or name.
    explicit: Option<String>,
}

impl Ctx {
    /// The profile seed `id`'s commands simulate with: `--cost-profile`, else the seed's
    /// machine class.
    fn profile_of(&self, id: &str) -> String {
        let class = published::seed(id).map_or("host", |s| s.cost_profile);
        self.explicit.clone().unwrap_or_else(|| class.to_string())
    }

    /// `args` with seed `id`'s cost profile when the run is in virtual time.
    fn with_profile(&self, id: &str, args: String) -> String {
        match self.virtual_time {
            true => self.seed_profile(id, args),
            false => args,
        }
    }

    /// `args` with seed `id`'s cost profile (for the seed-scale commands, virtual on any
    /// clock).
    fn seed_profile(&self, id: &str, args: String) -> String {
        format!("{args} --cost-profile {}", self.profile_of(id))
    }

    /// The profile seed `seed`'s virtual-time runs use, as reports name it.
    fn used_profile(&self, seed: &Seed) -> Option<table::UsedProfile> {
        if !self.virtual_time {
            return None;
        }
        let given = self.explicit.is_some();
        let name = self.profile_of(seed.id);
        let p = runner::load_profile(&name).ok()?;
        Some(table::UsedProfile {
            hash: p.hash(),
            name: p.name,
            given: name,
            why: match given {
                true => "--cost-profile",
                false => "the seed's machine class",
            },
        })
    }
}

/// `--cost-profile`, refused where the commands could not carry it.
fn cost_profile(a: &ReproduceArgs) -> CliResult<Option<String>> {
    let Some(p) = &a.cost_profile else {
        return Ok(None);
    };
    if a.clock != ClockArg::Virtual {
        return Err(CliError::bad(
            "--cost-profile needs --clock virtual (a real-time run has no cost profile)",
        ));
    }
    // The printed commands are words a user can copy; a path with spaces would split.
    let s = match p.to_str() {
        Some(s) if !s.is_empty() && !s.contains(char::is_whitespace) => s.to_string(),
        _ => {
            return Err(CliError::bad(format!(
                "--cost-profile {}: give a path without spaces",
                p.display()
            )))
        }
    };
    // Refused before anything runs, not by the first command minutes later.
    runner::load_profile(&s).map_err(|e| CliError::bad(format!("--cost-profile {s}: {e}")))?;
    Ok(Some(s))
}

/// More runs a real-time command gets when its figure came out of every run empty.
const EMPTY_RETRIES: usize = 3;

/// `before` and `after` run alternately, `ctx.repeat` rounds (so that a change in the host's
/// load falls on both sides), and their figures' medians.
fn pair(
    runner: &mut Runner,
    e: &Experiment,
    here: &[String; 2],
    ctx: &Ctx,
) -> [CliResult<Reading>; 2] {
    let mut ran = Ok(());
    'rounds: for round in 1..=ctx.repeat {
        for args in here {
            // A command an earlier row ran is not run again, so not announced again; a pool
            // announces its runs itself.
            if !ctx.quiet && !runner.pooled() && !runner.has(e.bench, args, round) {
                eprintln!(
                    "[slat] reproduce {}: {}",
                    e.seed,
                    what(e.bench, args, round, ctx)
                );
            }
            ran = runner.run(e.bench, args, round);
            if ran.is_err() {
                break 'rounds;
            }
        }
    }
    // In real time a figure can come out of every round empty (on a loaded host the vCPUs may
    // not have faulted once while the harvests ran): measured again, a bounded number of
    // times, rather than reported as missing. Virtual time gives the same result again.
    for args in here.iter().filter(|_| !ctx.virtual_time) {
        let mut runs = ctx.repeat;
        while ran.is_ok()
            && runs < ctx.repeat + EMPTY_RETRIES
            && runner.empty(e.bench, args, e.figure)
        {
            runs += 1;
            ran = runner.run(e.bench, args, runs);
        }
    }
    here.each_ref().map(|args| match &ran {
        Ok(()) => runner.read(e.bench, args, e.figure),
        Err(x) => Err(x.clone()),
    })
}

/// One row: both commands run (or taken from an earlier row's runs), and the verdict; added
/// to `s` with what it ran.
fn row(
    s: &mut SeedReport,
    runner: &mut Runner,
    e: &Experiment,
    c: Commands,
    ctx: &Ctx,
    label: String,
) {
    let ran = c.needs.is_none().then(|| sensitivity::Pair {
        bench: e.bench,
        figure: e.figure,
        args: c.here.clone(),
        claim: e.published,
    });
    s.pairs.push(ran);
    let [before, after] = match &c.needs {
        None => pair(runner, e, &c.here, ctx),
        Some(why) => [0, 1].map(|_| Err(CliError::Runtime(why.clone()))),
    };
    let (unit, error) = match (&before, &after) {
        (Ok(b), Ok(_)) => (Some(b.unit), None),
        // Not a failure: the row says what the benchmark needs.
        _ if c.needs.is_some() => (None, None),
        (Err(x), _) | (_, Err(x)) => (None, Some(x.message().to_string())),
    };
    let (b, a) = (value(&before), value(&after));
    let ratio = b.zip(a).map(|(b, a)| a / b);
    let range = |r: &CliResult<Reading>| r.as_ref().ok().map(|r| r.range);
    let (br, ar) = (range(&before), range(&after));
    let mut verdict = Verdict::of(e.published, ratio);
    if ctx.repeat > 1 {
        verdict.overlap = br.zip(ar).map(|(b, a)| b[0] <= a[1] && a[0] <= b[1]);
    }
    let metric = match e.figure.per_page {
        true => format!("{}, per page per vCPU", e.figure.metric),
        false => e.figure.metric.to_string(),
    };
    s.rows.push(Row {
        row: label,
        benchmark: e.bench.name(),
        published: table::Published {
            claim: e.published,
            ratio: e.published.ratio(),
            file: published::seed(e.seed).map_or("", |s| s.file),
        },
        slat: table::Measured {
            metric,
            unit,
            before: b,
            after: a,
            ratio,
            before_range: br,
            after_range: ar,
            commands: c.here.map(|x| command(e.bench, &x)),
            error,
        },
        scale: c.scale,
        // How the runs differ from the seed's: this host's, or a seed scale reduced for time.
        scale_note: e.scale.note(ctx.size),
        seed_scale: c.seed.map(|x| command(e.bench, &x)),
        needs_virtual_time: c.needs,
        verdict,
    });
}

fn value(r: &CliResult<Reading>) -> Option<f64> {
    r.as_ref().ok().map(|r| r.value)
}

/// 004's grid: each size with each density.
fn sweep_cells() -> impl Iterator<Item = (&'static experiments::Scale, &'static str)> {
    let sizes = GET_SWEEP.sizes.iter();
    sizes.flat_map(|s| GET_SWEEP.densities.iter().map(move |d| (s, *d)))
}

/// 004's before and after at grid cell (`sz`, `d`); `scale` as the row names it.
fn sweep_commands(sz: &experiments::Scale, d: &str, scale: &str, ctx: &Ctx) -> Commands {
    let e = &GET_SWEEP.row;
    let args = |size| [false, true].map(|after| sweep_args(size, d, after));
    let (here, seed) = (args(sz.flags(ctx.size)), args(sz.seed));
    Commands::new((e.seed, e.bench), here, seed, scale, ctx)
}

fn sweep_args(size: &str, density: &str, after: bool) -> String {
    let e = &GET_SWEEP.row;
    let change = if after { e.after } else { e.before };
    format!("{size} {} {density} {change}", e.fixed)
}

/// 004's GET over the grid; its rows are the cells where the two paths differ most and least.
fn get_sweep(runner: &mut Runner, ctx: &Ctx, s: &mut SeedReport) {
    let e = GET_SWEEP.row;
    for (sz, d) in sweep_cells() {
        let c = sweep_commands(sz, d, "", ctx);
        let [x, sw] = match c.needs {
            None => pair(runner, &e, &c.here, ctx).map(|r| r.ok().map(|r| r.value)),
            Some(_) => [None, None],
        };
        s.sweep.push(Cell {
            size: sz.flags(ctx.size),
            density: d,
            xchg_s: x,
            switch_s: sw,
            ratio: x.zip(sw).map(|(x, s)| s / x),
        });
    }
    // The difference between the two paths, whichever way: |ln(switch / xchg)|.
    let gap = |c: &Cell| c.ratio.filter(|r| *r > 0.0).map(|r| r.ln().abs());
    let cells: Vec<(usize, f64)> = (s.sweep.iter().enumerate())
        .filter_map(|(i, c)| Some((i, gap(c)?)))
        .collect();
    let most = cells.iter().max_by(|a, b| a.1.total_cmp(&b.1));
    let least = cells.iter().min_by(|a, b| a.1.total_cmp(&b.1));
    let picks = [("largest", most), ("smallest", least)];
    for (what, pick) in picks {
        // A failed grid still gets both rows (with the error), at its first cell.
        let i = pick.map_or(0, |p| p.0);
        let (sz, d) = sweep_cells()
            .nth(i)
            .unwrap_or((&GET_SWEEP.sizes[0], "-w 1"));
        let scale = format!("{} {d}", sz.flags(ctx.size));
        let c = sweep_commands(sz, d, &scale, ctx);
        let label = format!("GET_DIRTY_LOG, {what} difference ({})", c.scale);
        row(s, runner, &e, c, ctx, label);
    }
    s.implied = Some(implied(s, ctx.size));
}

/// What the thread's −50% implies, and the grid's cell closest to it.
fn implied(s: &SeedReport, size: Size) -> String {
    let big = GET_SWEEP.sizes[GET_SWEEP.sizes.len() - 1].flags(size);
    let sparse = GET_SWEEP.densities[0];
    let at = (s.sweep.iter())
        .find(|c| c.size == big && c.density == sparse)
        .and_then(|c| c.ratio);
    format!(
        "The thread's figure (-50%, a 16 GB guest with 32 vCPUs dirtying 8 Gbps) implies the sparse end of the grid: \
         the memset and the per-word exchange it removed were half of GET, which holds when the slot is large and few \
         of its pages are dirty per GET (per-word work over the whole slot, per-page work over only the dirty pages). \
         slat's closest cell ({big} {sparse}), KVM's two loops over the whole slot (xchg-full, switch-full): switch/xchg {}.",
        at.map_or("-".into(), |r| format!("{r:.3}x"))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command parses at every scale, and those this host runs pass the benchmarks'
    /// checks: a typo in the table would otherwise surface only when a row runs.
    #[test]
    fn every_command_parses_and_the_host_commands_pass_their_checks() {
        let runner = Runner::default();
        for seed in SEEDS {
            for size in [Size::Host, Size::Quick] {
                for (bench, args) in commands(seed.id, size) {
                    runner.check(bench, &args).unwrap();
                }
            }
            for size in [Size::Seed, Size::Full] {
                for (bench, args) in commands(seed.id, size) {
                    Runner::parses(bench, &args).unwrap();
                }
            }
        }
    }

    #[test]
    fn the_verdict_judges_direction_and_magnitude() {
        let claim = experiments::EXPERIMENTS[0].published; // 3.545 -> 0.315 s: 0.0889x
        let v = |r| {
            let v = Verdict::of(claim, Some(r));
            (v.direction, v.within_2x)
        };
        assert_eq!(v(0.09), (Some(true), Some(true)));
        assert_eq!(v(0.5), (Some(true), Some(false)));
        assert_eq!(v(0.05), (Some(true), Some(true)));
        assert_eq!(v(1.2), (Some(false), Some(false)));
        assert_eq!(Verdict::of(claim, None).direction, None);
        let worse = published::KERNEL_FLUSH;
        assert_eq!(Verdict::of(worse, Some(0.5)).direction, Some(true));
        assert_eq!(Verdict::of(worse, Some(1.1)).direction, Some(false));
        assert_eq!(Verdict::of(worse, Some(0.5)).within_2x, None);
    }

    /// 003's seed scale (and 002's shadow-paging benchmark row) is reduced by default and says
    /// how; `--full-scale` runs the seed's own, and every other row runs at its own scale
    /// either way.
    #[test]
    fn a_reduced_seed_scale_says_so_and_full_scale_runs_the_seeds_own() {
        let e = experiments::of("003").next().expect("003's rows");
        assert_eq!(e.scale.flags(Size::Seed), "-v 128 -b 128M --phantom");
        assert_eq!(e.scale.flags(Size::Full), "-v 128 -b 5G");
        assert!(e.scale.note(Size::Seed).contains("--full-scale"));
        assert_eq!(e.scale.note(Size::Full), "");
        let mut reduced = 0;
        for e in experiments::EXPERIMENTS.iter().filter(|e| e.seed != "003") {
            let [s, f] = [Size::Seed, Size::Full].map(|z| e.scale.flags(z));
            match e.scale.reduced {
                Some(_) => {
                    reduced += 1;
                    assert!(
                        e.scale.note(Size::Seed).contains("--full-scale"),
                        "{}",
                        e.row
                    );
                }
                None => assert_eq!(s, f, "{}", e.row),
            }
        }
        assert_eq!(reduced, 1, "002's shadow-paging benchmark row");
    }

    #[test]
    fn bad_seeds_are_refused_and_all_is_every_seed() {
        assert_eq!(which("all").unwrap().0.len(), 5);
        assert_eq!(which("002").unwrap().0[0].id, "002");
        for s in ["005", "", "2", "ALL", "000,001"] {
            assert!(which(s).unwrap_err().contains("is not a seed"), "{s}");
        }
    }
}
