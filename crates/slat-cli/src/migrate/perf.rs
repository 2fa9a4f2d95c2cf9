//! `slat migrate-perf`: both ends of a live migration in one process over loopback, on the
//! driver; its `--vary` table and sweep table, and the convergence plot `migrate` shares.

use super::guest::GuestArgs;
use super::parse::{dirty_limit, dirty_rate, max_downtime, postcopy_after, throttle_percent};
use super::*;
use crate::args::Switch;
use crate::driver::chart::SeriesOf;
use crate::driver::vary::{engine, names, pick, variants, Key, Values};
use crate::driver::{self, Lines};
use crate::migrate_report::Dest;
use crate::output::{print_table, Better, RowOutcome, Sweep};
use crate::vary_key;
use slat_migrate::RoundReport;
use slat_migrate::{DestConfig, Destination};
use std::net::TcpListener;

/// Flags of `slat migrate-perf`.
#[derive(Debug, Clone, Args)]
pub struct MigratePerfArgs {
    /// Milliseconds the guest runs on the destination after the switch-over (0-600000).
    #[arg(long = "resume-ms", value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_MS), default_value_t = 200)]
    pub resume_ms: u64,
    /// Run once per combination of settings, one table (the keys: --help).
    #[arg(long = "vary", value_parser = driver::vary::parser(VARY), value_name = "KEY=V1,V2", long_help = driver::vary::help(VARY, EXAMPLES))]
    pub vary: Vec<driver::vary::Vary>,
    // `--json`; `--repeat N` migrates N times in this process; `--plot FILE.svg` draws the
    // migration's convergence, or with --vary the total migration time and downtime of
    // every row.
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub migration: MigrationArgs,
}

/// Examples under the keys in `--help`.
const EXAMPLES: &str = "--repeat N runs every combination N times. For example, dirty rate x log x fast page fault: --vary \
dirty-rate=2k,50k --vary log=get,clear,ring --vary fast-pf=on,off; dirty-limit against \
auto-converge: --log ring --dirty-limit 2k --vary converge=auto,dirty-limit.";

/// A `--vary` key of a clap value enum: `key!(name, flag, Enum, |a| the field it sets)`.
macro_rules! key {
    ($name:literal, $sets:literal, $e:ty, |$a:ident| $field:expr) => {
        vary_key!($name, $sets, Values::OneOf(names::<$e>), |$a, v| $field =
            pick(v)?)
    };
}

/// migrate-perf's `--vary` table.
#[rustfmt::skip]
pub const VARY: &[Key<MigratePerfArgs>] = &[
    key!("log", "--log", LogArg, |a| a.guest.log),
    vary_key!("dirty-rate", "--dirty-rate",
        Values::Text("pages/s per vCPU (k/m suffixes)", |v| dirty_rate(v).map(drop)),
        |a, v| a.guest.dirty_rate = dirty_rate(v)?),
    key!("fast-pf", "--fast-pf", Switch, |a| a.guest.machine.fast_pf),
    key!("backend", "--backend", BackendArg, |a| a.guest.backend),
    vary_key!("max-downtime", "--max-downtime",
        Values::Text("milliseconds", |v| max_downtime(v).map(drop)),
        |a, v| a.migration.max_downtime = max_downtime(v)?),
    key!("compress", "--compress", CompressArg, |a| a.migration.compress),
    vary_key!("connections", "--connections",
        Values::Text("page streams (1-16)", |v| super::parse::connections(v).map(drop)),
        |a, v| a.migration.connections = super::parse::connections(v)?),
    key!("delta", "--delta", Switch, |a| a.migration.delta),
    vary_key!("delta-cache", "--delta-cache",
        Values::Text("bytes (k/m/g suffixes)", |v| super::parse::delta_cache(v).map(drop)),
        |a, v| a.migration.delta_cache = super::parse::delta_cache(v)?),
    key!("auto-converge", "--auto-converge", Switch, |a| a.migration.auto_converge),
    vary_key!("cpu-throttle-initial", "--cpu-throttle-initial",
        Values::Text("percent (1-99)", |v| throttle_percent(v).map(drop)),
        |a, v| a.migration.throttle_initial = throttle_percent(v)?),
    vary_key!("cpu-throttle-increment", "--cpu-throttle-increment",
        Values::Text("percent (1-99)", |v| throttle_percent(v).map(drop)),
        |a, v| a.migration.throttle_increment = throttle_percent(v)?),
    key!("cpu-throttle-tailslow", "--cpu-throttle-tailslow", Switch,
        |a| a.migration.throttle_tailslow),
    vary_key!("dirty-limit", "--dirty-limit",
        Values::Text("pages/s per vCPU (k/m suffixes)", |v| dirty_limit(v).map(drop)),
        |a, v| a.migration.dirty_limit = dirty_limit(v)?),
    vary_key!("wrprot", "--wrprot", Values::OneOf(variants::<slat::WrprotVariant>),
        |a, v| a.guest.wrprot = engine(v)?),
    key!("verify", "--verify", VerifyArg, |a| a.migration.verify),
    key!("converge", "--converge", ConvergeArg, |a| a.migration.converge),
    vary_key!("postcopy-after", "--postcopy-after",
        Values::Text("pre-copy rounds before post-copy (0-1000), or off", |v| postcopy_after(v).map(drop)),
        |a, v| a.migration.postcopy_after = postcopy_after(v)?),
];

impl Benchmark for MigratePerfArgs {
    type Report = Migration;
    const NAME: &'static str = "migrate-perf";

    fn vary_table() -> &'static [Key<Self>] {
        VARY
    }

    fn common(&self) -> Common<'_> {
        Common {
            backends: std::slice::from_ref(&self.guest.backend),
            vary: &self.vary,
            out: &self.out,
        }
    }

    fn check(&self) -> CliResult {
        self.guest.check(2)?;
        self.migration.check(&self.guest)
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Migration> {
        let (r, d, before) = perf_once(self)?;
        let (guest, migration) = (self.guest.clone(), self.migration.clone());
        Ok(Migration {
            benchmark: Self::NAME,
            guest,
            migration,
            failed_attempts: Vec::new(),
            r,
            before,
            destination: Some(Dest(d)),
        })
    }

    fn metrics(&self) -> Vec<Metric<Migration>> {
        METRICS.to_vec()
    }

    fn headline(&self) -> Vec<&'static str> {
        vec!["total migration time", "downtime"]
    }

    fn print(&self, m: &Migration) {
        text::print_report(m)
    }

    fn lines(&self, first: &Migration) -> Vec<Lines<Migration>> {
        convergence(first)
    }

    fn print_sweep(&self, sweep: &Sweep<Migration>) -> bool {
        print_sweep(self, sweep);
        true
    }
}

/// One migration between two machines of this process over loopback: the source's and the
/// destination's reports and the guest's write rates before the migration.
fn perf_once(
    a: &MigratePerfArgs,
) -> CliResult<(MigrationReport, slat_migrate::DestReport, Before)> {
    let q = quiet(a.out.json);
    let (_guest, mut src, before) = prepare_source(&a.guest, &a.migration, q)?;
    progress(q, "destination: mapping the same guest memory");
    let mut dspec = a.guest.spec();
    dspec.log = LogMode::Get;
    let dguest = bench::build(&dspec).map_err(failed)?.as_guest();
    let loopback = |e| failed(format!("cannot listen on loopback: {e}"));
    let listener = TcpListener::bind("127.0.0.1:0").map_err(loopback)?;
    let addr = listener.local_addr().map_err(loopback)?.to_string();
    let cfg = DestConfig {
        resume_for: Duration::from_millis(a.resume_ms),
        timeout: Duration::from_secs(a.migration.timeout),
        max_memory: 0,
        max_streams: a.migration.connections,
        delta: true,
    };
    // Before the source starts: a destination that cannot start leaves nothing running.
    let dest = std::thread::Builder::new()
        .name("destination".into())
        .spawn(move || Destination::with_guest(dguest, cfg).accept(&listener))
        .map_err(|e| failed(format!("cannot start the destination's thread: {e}")))?;
    let r = src.migrate(&addr, &mut on_event(q, a.migration.progress));
    let d = (dest.join()).map_err(|_| failed("the destination thread panicked"))?;
    match (r, d) {
        (Ok(r), Ok(d)) => Ok((r, d, before)),
        (Err(s), Err(d)) => Err(failed(format!("{s} (destination: {d})"))),
        (Err(s), Ok(_)) => Err(failed(s)),
        (Ok(_), Err(d)) => Err(failed(format!("destination: {d}"))),
    }
}

/// The figures `--repeat` summarizes.
#[rustfmt::skip]
pub const METRICS: &[Metric<Migration>] = &[
    Metric { name: "total migration time", unit: "s", better: Better::Lower, get: |m| Some(m.r.total.as_secs_f64()) },
    Metric { name: "downtime", unit: "s", better: Better::Lower, get: |m| Some(m.r.downtime.as_secs_f64()) },
    Metric { name: "rounds", unit: "rounds", better: Better::Lower, get: |m| Some(m.r.rounds.len() as f64) },
    Metric { name: "bandwidth", unit: "bytes/s", better: Better::Higher, get: |m| Some(m.r.bandwidth()) },
    Metric {
        name: "guest writes during migration", unit: "writes/s", better: Better::Higher,
        get: |m| Some(m.r.write_rate()),
    },
];

/// A cell of the sweep table: a figure with its decimals (and whether `--repeat`'s row shows
/// its mean), a percentage (`-` without one; the mean counts none as 0), or text.
enum Cell {
    Num(fn(&Migration) -> f64, usize, bool),
    Pct(fn(&Migration) -> Option<f64>),
    Text(fn(&Migration) -> String),
}
use Cell::{Num, Pct, Text};

fn pct(x: f64) -> String {
    format!("{x:.0}%")
}

/// `xs` shown by `f`, joined by `/` (`-` for none).
fn joined<T>(xs: &[T], f: impl Fn(&T) -> String) -> String {
    match xs {
        [] => "-".into(),
        _ => xs.iter().map(f).collect::<Vec<_>>().join("/"),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn throttle(m: &Migration) -> String {
    match &m.r.dirty_limit {
        Some(d) => format!("dl {}", joined(&d.max_permille, |t| pct(*t as f64 / 10.0))),
        None => format!("{}%", m.r.throttle_max),
    }
}

#[rustfmt::skip]
const COLUMNS: &[(&str, Cell)] = &[
    ("total (s)", Num(|m| m.r.total.as_secs_f64(), 3, true)),
    ("downtime (ms)", Num(|m| ms(m.r.downtime), 1, true)),
    ("of which copy (ms)", Num(|m| ms(m.r.final_harvest + m.r.final_send), 1, false)),
    ("rounds", Num(|m| m.r.rounds.len() as f64, 0, false)),
    ("pages per round", Text(|m| joined(&m.r.rounds, |x| x.pages.to_string()))),
    ("dirty pages/s", Num(|m| m.r.dirty_rate(), 0, false)),
    ("MiB/s", Num(|m| m.r.bandwidth() / (1 << 20) as f64, 0, false)),
    ("throttle (max)", Text(throttle)),
    ("guest writes/s before/during", Text(|m| format!("{:.0}/{:.0}", m.before.0, m.r.write_rate()))),
    ("throughput lost", Pct(Migration::throughput_lost)),
    ("writes lost (M)", Num(|m| m.writes_lost() / 1e6, 2, true)),
    ("lost per vCPU", Text(|m| joined(&m.vcpu_lost(), |v| pct(*v)))),
    ("sent (GiB)", Num(|m| m.r.bytes() as f64 / (1u64 << 30) as f64, 2, true)),
    ("post-copy pages bg/preempt", Text(|m| m.r.postcopy.as_ref()
        .map_or("-".into(), |p| format!("{}/{}", p.background_pages, p.preempt_pages)))),
    ("fault p50/p99/max (ms)", Text(|m| m.destination.as_ref().and_then(|d| d.0.postcopy.as_ref())
        .map_or("-".into(), |p| format!("{:.2}/{:.2}/{:.1}", ms(p.blocktime.p50), ms(p.blocktime.p99), ms(p.blocktime.max))))),
    ("verified", Text(|_| "ok".into())),
];

impl Cell {
    fn of(&self, m: &Migration) -> String {
        match self {
            Num(f, d, _) => format!("{:.*}", d, f(m)),
            Pct(f) => f(m).map_or("-".into(), pct),
            Text(f) => f(m),
        }
    }

    /// The mean row's cell (empty where a mean says nothing).
    fn mean(&self, runs: &[Migration]) -> String {
        let mean =
            |f: &dyn Fn(&Migration) -> f64| runs.iter().map(f).sum::<f64>() / runs.len() as f64;
        match self {
            Num(f, d, true) => format!("{:.*}", d, mean(f)),
            Pct(f) => pct(mean(&|m| f(m).unwrap_or(0.0))),
            _ => String::new(),
        }
    }
}

/// The sweep's title and table: each run's row (with `--repeat`, a row per run, then their
/// mean); a failed combination is one row of `-` and FAILED.
fn print_sweep(a: &MigratePerfArgs, sweep: &Sweep<Migration>) {
    let (g, repeated) = (&a.guest, a.out.repeat > 1);
    println!(
        "migrate-perf sweep: base settings {}, max downtime {} ms; varied: {}; {} per combination, all in this process",
        g.describe(),
        a.migration.max_downtime,
        sweep.varied.join(", "),
        if repeated { format!("{} runs and their mean", a.out.repeat) } else { "one run".into() }
    );
    let mut head: Vec<String> = sweep.varied.iter().map(|k| k.to_string()).collect();
    head.extend(repeated.then(|| "run".to_string()));
    head.extend(COLUMNS.iter().map(|c| c.0.to_string()));
    let mut rows = Vec::new();
    for row in &sweep.sweep {
        let settings = row
            .settings
            .iter()
            .map(|s| s.split_once('=').map_or(s.as_str(), |(_, v)| v).to_string());
        let row_of = |run: String, cells: Vec<String>| {
            settings
                .clone()
                .chain(repeated.then_some(run))
                .chain(cells)
                .collect::<Vec<_>>()
        };
        let runs = match &row.outcome {
            RowOutcome::Done(runs) => runs.all(),
            RowOutcome::Failed(_) => {
                let mut cells = vec!["-".to_string(); COLUMNS.len() - 1];
                cells.push("FAILED".into());
                rows.push(row_of("-".into(), cells));
                continue;
            }
        };
        for (k, m) in runs.iter().enumerate() {
            rows.push(row_of(
                (k + 1).to_string(),
                COLUMNS.iter().map(|c| c.1.of(m)).collect(),
            ));
        }
        if repeated && !runs.is_empty() {
            rows.push(row_of(
                "mean".into(),
                COLUMNS.iter().map(|c| c.1.mean(runs)).collect(),
            ));
        }
    }
    print_table(&head, &rows);
}

/// `--plot` of a migration: pages sent and pages dirtied meanwhile (owed to the next round)
/// per round, and the throttle per round.
pub fn convergence(r: &Migration) -> Vec<Lines<Migration>> {
    fn per_round(name: &str, f: fn(&RoundReport) -> f64) -> (String, SeriesOf<Migration>) {
        let points = move |m: &Migration| {
            m.r.rounds
                .iter()
                .map(|p| (p.round as f64, Some(f(p))))
                .collect()
        };
        (name.to_string(), Box::new(points))
    }
    let rounds: Vec<String> = r.r.rounds.iter().map(|p| p.round.to_string()).collect();
    vec![
        Lines {
            title: "migration convergence".to_string(),
            x_desc: "round (0: full copy; the last: stop-and-copy)",
            y_desc: "pages",
            series: vec![
                per_round("pages sent in the round", |p| p.pages as f64),
                per_round("pages owed after the round (dirtied while it ran)", |p| {
                    p.dirtied as f64
                }),
            ],
            x_names: Some(rounds.clone()),
        },
        Lines {
            title: "auto-converge throttle".to_string(),
            x_desc: "round",
            y_desc: "vCPU throttle (%)",
            series: vec![per_round("throttle while the round ran (%)", |p| {
                p.throttle as f64
            })],
            x_names: Some(rounds),
        },
    ]
}
