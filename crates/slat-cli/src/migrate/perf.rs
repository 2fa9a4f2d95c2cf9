//! `slat migrate-perf`: both ends of a live migration in one process over loopback, on the
//! driver; its `--vary` table and sweep table, and the convergence plot `migrate` shares.

use super::{
    on_event, prepare_source, progress, quiet, CompressArg, ConvergeArg, DestinationDoc, GuestArgs,
    LogArg, Migrated, Migration, MigrationArgs, RunError, VerifyArg, MAX_WAIT_MS,
};
use crate::args::{BackendArg, OutputArgs, Switch};
use crate::driver::chart::SeriesOf;
use crate::driver::vary::{names, pick, variants, Key, Values};
use crate::driver::{self, Benchmark, Common, Lines};
use crate::error::CliResult;
use crate::output::{print_table, Better, Metric, RowOutcome, Sweep};
use crate::vary_key;
use clap::Args;
use slat_harness::migrate::{self as bench, GuestSpec, LogMode};
use slat_migrate::{DestConfig, DestReport, Destination, MigrationReport};
use slat_workload::format_size;
use std::net::TcpListener;
use std::time::Duration;

/// Flags of `slat migrate-perf`.
#[derive(Debug, Clone, Args)]
pub struct MigratePerfArgs {
    /// Milliseconds the guest runs on the destination after the switch-over (0-600000).
    #[arg(long = "resume-ms", value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_MS), default_value_t = 200)]
    pub resume_ms: u64,
    /// Run once per combination of settings, one table (the keys: --help).
    #[arg(long = "vary", value_parser = driver::vary::parser(VARY), value_name = "KEY=V1,V2", long_help = driver::vary::help(VARY, EXAMPLES))]
    pub vary: Vec<driver::vary::Vary>,
    // `--json`; `--repeat N` migrates N times in this process (not with --vary); `--plot
    // FILE.svg` draws the migration's convergence (pages sent and pages still owed per round,
    // and the throttle per round; with --repeat, the first run's), or with --vary the total
    // migration time and downtime of every row.
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

fn text(f: fn(&str) -> Result<u64, super::FlagError>) -> impl Fn(&str) -> Result<u64, String> {
    move |v| f(v).map_err(|e| e.to_string())
}

/// migrate-perf's `--vary` table.
pub const VARY: &[Key<MigratePerfArgs>] = &[
    vary_key!("log", "--log", Values::OneOf(names::<LogArg>), |a, v| a
        .guest
        .log =
        pick(v)?),
    vary_key!(
        "dirty-rate",
        "--dirty-rate",
        Values::Text("pages/s per vCPU (k/m suffixes)", |v| text(
            super::dirty_rate
        )(v)
        .map(drop)),
        |a, v| a.guest.dirty_rate = text(super::dirty_rate)(v)?
    ),
    vary_key!(
        "fast-pf",
        "--fast-pf",
        Values::OneOf(names::<Switch>),
        |a, v| { a.guest.machine.fast_pf = pick(v)? }
    ),
    vary_key!(
        "backend",
        "--backend",
        Values::OneOf(names::<BackendArg>),
        |a, v| { a.guest.backend = pick(v)? }
    ),
    vary_key!(
        "max-downtime",
        "--max-downtime",
        Values::Text("milliseconds", |v| text(super::max_downtime)(v).map(drop)),
        |a, v| a.migration.max_downtime = text(super::max_downtime)(v)?
    ),
    vary_key!(
        "compress",
        "--compress",
        Values::OneOf(names::<CompressArg>),
        |a, v| { a.migration.compress = pick(v)? }
    ),
    vary_key!(
        "auto-converge",
        "--auto-converge",
        Values::OneOf(names::<Switch>),
        |a, v| { a.migration.auto_converge = pick(v)? }
    ),
    vary_key!(
        "wrprot",
        "--wrprot",
        Values::OneOf(variants::<slat::WrprotVariant>),
        |a, v| { a.guest.wrprot = crate::driver::vary::engine(v)? }
    ),
    vary_key!(
        "verify",
        "--verify",
        Values::OneOf(names::<VerifyArg>),
        |a, v| { a.migration.verify = pick(v)? }
    ),
    vary_key!(
        "converge",
        "--converge",
        Values::OneOf(names::<ConvergeArg>),
        |a, v| { a.migration.converge = pick(v)? }
    ),
];

impl Benchmark for MigratePerfArgs {
    type Report = Migrated;
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
        self.migration.check(&self.guest)?;
        Ok(())
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Migrated> {
        let (r, d, baseline, per_vcpu) = perf_once(self)?;
        let mut doc = Migration::new(
            "migrate-perf",
            &self.guest,
            &self.migration,
            &r,
            baseline,
            &[],
        );
        doc.destination = Some(DestinationDoc::new(&d));
        doc.set_vcpu_before(per_vcpu);
        Ok(Migrated { r, baseline, doc })
    }

    fn metrics(&self) -> Vec<Metric<Migrated>> {
        METRICS.to_vec()
    }

    fn headline(&self) -> Vec<&'static str> {
        vec!["total migration time", "downtime"]
    }

    fn print(&self, m: &Migrated) {
        super::print_report(&self.guest, &self.migration, &m.r, m.baseline)
    }

    fn lines(&self, first: &Migrated) -> Vec<Lines<Migrated>> {
        convergence(&first.r)
    }

    fn print_sweep(&self, sweep: &Sweep<Migrated>) -> bool {
        print_sweep(self, sweep);
        true
    }
}

/// One migration between two machines of this process over loopback.
/// Returns the source's and the destination's reports and the guest's write rate before the
/// migration, in all and per vCPU.
type PerfRun = (MigrationReport, DestReport, f64, Vec<f64>);

fn perf_once(a: &MigratePerfArgs) -> Result<PerfRun, RunError> {
    let q = quiet(a.out.json);
    let (_guest, mut src, baseline, per_vcpu) = prepare_source(&a.guest, &a.migration, q)?;
    progress(q, "destination: mapping the same guest memory");
    let dspec = GuestSpec {
        log: LogMode::Get,
        ..a.guest.spec()
    };
    let dguest = bench::build(&dspec)?.as_guest();
    let loopback = |err| RunError::Listen {
        addr: "loopback".into(),
        err,
    };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(loopback)?;
    let addr = listener.local_addr().map_err(loopback)?.to_string();
    let cfg = DestConfig {
        resume_for: Duration::from_millis(a.resume_ms),
        timeout: Duration::from_secs(a.migration.timeout),
        max_memory: 0,
    };
    let dest = std::thread::spawn(move || Destination::with_guest(dguest, cfg).accept(&listener));
    let r = src.migrate(&addr, &mut on_event(q, a.migration.progress));
    let d = dest.join().map_err(|_| RunError::DestinationPanicked)?;
    match (r, d) {
        (Ok(r), Ok(d)) => Ok((r, d, baseline, per_vcpu)),
        (Err(source_end), Err(destination)) => Err(RunError::BothEnds {
            source_end: Box::new(source_end),
            destination: Box::new(destination),
        }),
        (Err(e), Ok(_)) => Err(e.into()),
        (Ok(_), Err(de)) => Err(RunError::Destination(de)),
    }
}

/// The figures `--repeat` summarizes, from a migration's report and the guest's write rate
/// before it.
pub const METRICS: &[Metric<Migrated>] = &[
    Metric {
        name: "total migration time",
        unit: "s",
        better: Better::Lower,
        get: |Migrated { r, .. }| Some(r.total.as_secs_f64()),
    },
    Metric {
        name: "downtime",
        unit: "s",
        better: Better::Lower,
        get: |Migrated { r, .. }| Some(r.downtime.as_secs_f64()),
    },
    Metric {
        name: "rounds",
        unit: "rounds",
        better: Better::Lower,
        get: |Migrated { r, .. }| Some(r.rounds.len() as f64),
    },
    Metric {
        name: "bandwidth",
        unit: "bytes/s",
        better: Better::Higher,
        get: |Migrated { r, .. }| Some(r.bandwidth()),
    },
    Metric {
        name: "guest writes during migration",
        unit: "writes/s",
        better: Better::Higher,
        get: |Migrated { r, .. }| Some(r.write_rate()),
    },
];

/// Cells of a sweep row after the settings (and the run number).
const SWEEP_CELLS: usize = 13;

/// A successful row's figures, in the order of [`print_sweep`]'s columns.
fn sweep_cells(r: &MigrationReport, doc: &Migration) -> [String; SWEEP_CELLS] {
    let baseline = doc.guest_writes_per_s_before;
    let rounds: Vec<String> = r.rounds.iter().map(|x| x.pages.to_string()).collect();
    let pct = |x: &Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0}%"));
    let per_vcpu: Vec<String> = doc
        .vcpu_throughput_lost_percent
        .iter()
        .map(|v| format!("{v:.0}%"))
        .collect();
    let throttle = match &r.dirty_limit {
        Some(d) => {
            let v: Vec<String> = d
                .max_permille
                .iter()
                .map(|t| format!("{:.0}%", *t as f64 / 10.0))
                .collect();
            format!("dl {}", v.join("/"))
        }
        None => format!("{}%", r.throttle_max),
    };
    [
        format!("{:.3}", r.total.as_secs_f64()),
        format!("{:.1}", r.downtime.as_secs_f64() * 1e3),
        format!(
            "{:.1}",
            (r.final_harvest + r.final_send).as_secs_f64() * 1e3
        ),
        format!("{}", r.rounds.len()),
        rounds.join("/"),
        format!("{:.0}", r.dirty_rate()),
        format!("{:.0}", r.bandwidth() / (1 << 20) as f64),
        throttle,
        format!("{:.0}/{:.0}", baseline, r.write_rate()),
        pct(&doc.guest_throughput_lost_percent),
        format!("{:.2}", doc.guest_writes_lost / 1e6),
        if per_vcpu.is_empty() {
            "-".to_string()
        } else {
            per_vcpu.join("/")
        },
        "ok".to_string(),
    ]
}

/// The sweep's title and table.
fn print_sweep(a: &MigratePerfArgs, sweep: &Sweep<Migrated>) {
    let varied = &sweep.varied;
    let rows = sweep_table(sweep, a.out.repeat > 1);
    println!(
        "migrate-perf sweep: {} vCPU(s), {} guest memory, {}% filled; base settings {}, max downtime {} ms; varied: {}; {} per combination, all in this process",
        a.guest.work.vcpus,
        format_size(a.guest.work.bytes * a.guest.work.vcpus as u64),
        a.guest.fill,
        a.guest.describe(),
        a.migration.max_downtime,
        varied.join(", "),
        if a.out.repeat > 1 {
            format!("{} runs and their mean", a.out.repeat)
        } else {
            "one run".to_string()
        }
    );
    let mut head: Vec<String> = varied.iter().map(|k| k.to_string()).collect();
    if a.out.repeat > 1 {
        head.push("run".into());
    }
    head.extend(
        [
            "total (s)",
            "downtime (ms)",
            "of which copy (ms)",
            "rounds",
            "pages per round",
            "dirty pages/s",
            "MiB/s",
            "throttle (max)",
            "guest writes/s before/during",
            "throughput lost",
            "writes lost (M)",
            "lost per vCPU",
            "verified",
        ]
        .map(String::from),
    );
    print_table(&head, &rows);
}

/// `--plot` of a migration: pages sent and pages dirtied meanwhile (owed to the next round)
/// per round, and the throttle per round.
pub fn convergence(r: &MigrationReport) -> Vec<Lines<Migrated>> {
    fn per_round(
        name: &str,
        f: fn(&slat_migrate::RoundReport) -> f64,
    ) -> (String, SeriesOf<Migrated>) {
        let points = move |m: &Migrated| {
            m.r.rounds
                .iter()
                .map(|p| (p.round as f64, Some(f(p))))
                .collect()
        };
        (name.to_string(), Box::new(points))
    }
    let rounds: Vec<String> = r.rounds.iter().map(|p| p.round.to_string()).collect();
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

/// The sweep's rows: each run's cells (with `--repeat`, a row per run, then their mean); a
/// failed combination is one row of `-` and FAILED.
fn sweep_table(sweep: &Sweep<Migrated>, repeated: bool) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    for row in &sweep.sweep {
        let settings: Vec<String> = row
            .settings
            .iter()
            .map(|s| s.split_once('=').map_or(s.as_str(), |(_, v)| v).to_string())
            .collect();
        let runs = match &row.outcome {
            RowOutcome::Done(runs) => runs.all(),
            RowOutcome::Failed(_) => {
                let mut cells = settings.clone();
                if repeated {
                    cells.push("-".into());
                }
                cells.extend(std::iter::repeat_n("-".to_string(), SWEEP_CELLS - 1));
                cells.push("FAILED".into());
                rows.push(cells);
                continue;
            }
        };
        let mut done: Vec<[f64; 4]> = Vec::new();
        for (k, m) in runs.iter().enumerate() {
            let mut cells = settings.clone();
            if repeated {
                cells.push(format!("{}", k + 1));
            }
            cells.extend(sweep_cells(&m.r, &m.doc));
            done.push([
                m.r.total.as_secs_f64(),
                m.r.downtime.as_secs_f64() * 1e3,
                m.doc.guest_throughput_lost_percent.unwrap_or(0.0),
                m.doc.guest_writes_lost / 1e6,
            ]);
            rows.push(cells);
        }
        if repeated && !done.is_empty() {
            let mean = |i: usize| done.iter().map(|x| x[i]).sum::<f64>() / done.len() as f64;
            let mut cells = settings.clone();
            cells.push("mean".into());
            cells.push(format!("{:.3}", mean(0)));
            cells.push(format!("{:.1}", mean(1)));
            cells.extend(std::iter::repeat_n(String::new(), 7));
            cells.push(format!("{:.0}%", mean(2)));
            cells.push(format!("{:.2}", mean(3)));
            cells.extend(std::iter::repeat_n(String::new(), SWEEP_CELLS - 11));
            rows.push(cells);
        }
    }
    rows
}
