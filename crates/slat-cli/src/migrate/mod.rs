//! `slat migrate`, `slat migrate-listen` and `slat migrate-perf`: live migration of a guest
//! under write load (`slat-migrate`), with the figures of the reverse-map write-protect
//! series' `migrate-perf`: total migration time, downtime, rounds, dirty rate, bandwidth,
//! throttling, verification. All three run on the driver.

mod guest;
mod listen;
mod parse;
mod perf;
mod progress;
mod text;

pub use guest::{GuestArgs, MigrationArgs};
pub use listen::{Listen, ListenArgs};
pub use perf::MigratePerfArgs;

use crate::args::{check_backends, BackendArg, MachineArgs, OutputArgs};
use crate::driver::{Benchmark, Common, Lines};
use crate::error::{CliError, CliResult};
use crate::limits::check_backing;
use crate::migrate_report::Migration;
use crate::output::Metric;
use crate::report::quiet;
use clap::{Args, ValueEnum};
use parse::claim_fd;
use progress::{on_event, progress};
use slat_harness::migrate::{self as bench, BenchGuest, LogMode};
use slat_migrate::transport::{Channel, Endpoint};
use slat_migrate::{Faults, Memory, MigrationReport, Source};
use slat_workload::Backing;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The dirty log the source harvests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogArg {
    /// GET_DIRTY_LOG clears and re-protects.
    Get,
    /// Manual protect with INITIALLY_SET: GET copies, CLEAR re-protects.
    Clear,
    /// Per-vCPU dirty rings: collect, then reset.
    Ring,
}

impl LogArg {
    pub fn mode(self) -> LogMode {
        match self {
            LogArg::Get => LogMode::Get,
            LogArg::Clear => LogMode::Clear,
            LogArg::Ring => LogMode::Ring,
        }
    }
}

/// Compression of page data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CompressArg {
    /// Raw pages.
    None,
    /// LZ4 blocks where smaller.
    Lz4,
}

/// How the switch-over verifies memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VerifyArg {
    /// Digests of every page as it is sent and received; only the final round is hashed
    /// while the guest is paused (trusts the dirty log to report every write).
    Sent,
    /// Hash all memory on both sides while the guest is paused (independent of the dirty
    /// log; the downtime grows with memory).
    Full,
}

/// Deliberately broken sources, to watch verification fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BreakArg {
    /// Skip the harvest after the vCPUs stop (and let the guest run 100 ms past the last
    /// pre-copy harvest, so there is something only that harvest would have found).
    SkipFinalHarvest,
    /// Count pages as delivered when queued, not when acknowledged.
    SkipMergeBack,
}

/// How pre-copy converges (`--converge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConvergeArg {
    /// Auto-converge (if --auto-converge is on).
    Auto,
    /// Per-vCPU dirty limit on the dirty ring.
    DirtyLimit,
    /// Neither.
    None,
}

impl ConvergeArg {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            ConvergeArg::Auto => "auto",
            ConvergeArg::DirtyLimit => "dirty-limit",
            ConvergeArg::None => "none",
        }
    }
}

/// How the source reports its progress on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressArg {
    /// `[slat] ...` lines (none with --json).
    Text,
    /// One JSON object per line for every event (also with --json): connected, round,
    /// throttle, paused, and a progress line after every harvest with the round, pages sent
    /// and remaining, bandwidth, expected downtime and throttle.
    Json,
}

/// An injected fault (first attempt only).
#[derive(Debug, Clone, Copy)]
pub enum Inject {
    CutAfter(u64),
    CorruptAt(u64),
    Version(u32),
}

/// Most guest writes per second per vCPU `--dirty-rate` takes (0 is unlimited): a billion,
/// beyond what any vCPU writes, and far from the arithmetic limits of the pacing.
pub const MAX_DIRTY_RATE: u64 = 1_000_000_000;
const _: () = assert!(slat_migrate::dirty_limit::MAX_LIMIT == MAX_DIRTY_RATE);
/// Longest `--timeout`: a day.
const MAX_TIMEOUT_S: u64 = 86_400;
/// Longest `--warmup`, `--resume-ms` and `--retry-delay`, in milliseconds: ten minutes (each
/// is a sleep of the command; a longer one is a typo, not a measurement).
pub const MAX_WAIT_MS: u64 = 600_000;
/// Longest `--max-downtime`, in milliseconds: an hour.
pub const MAX_DOWNTIME_MS: u64 = 3_600_000;
/// Most `--retries` (of `migrate` and of `migrate-listen`).
pub const MAX_RETRIES: u32 = 1000;
/// Largest `--bandwidth`: MiB per second whose bytes per second fit 64 bits.
const MAX_BANDWIDTH_MIB: u64 = u64::MAX >> 20;

/// Flags of `slat migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// The destination, as QEMU writes it: tcp:HOST:PORT (or HOST:PORT) and unix:PATH
    /// (where `slat migrate-listen` runs), fd:N (an inherited socket, pipe or file: one
    /// attempt), or file:PATH (a snapshot: the whole migration into a file, which
    /// `migrate-listen --listen file:PATH` restores).
    #[arg(long)]
    pub to: Endpoint,
    /// Attempts after a failed one (the guest keeps running on the source meanwhile; 0-1000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=MAX_RETRIES as i64), default_value_t = 0)]
    pub retries: u32,
    /// Milliseconds between attempts (0-600000).
    #[arg(long = "retry-delay", value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_MS), default_value_t = 1000)]
    pub retry_delay: u64,
    // `--json`; `--repeat N` migrates N freshly built guests one after the other (the
    // destination must take N: `slat migrate-listen --repeat N`); `--plot FILE.svg` draws the
    // (first) migration's convergence.
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub migration: MigrationArgs,
}

/// The guest's write rate during the warm-up, per second: in all, and per vCPU (where counted).
pub type Before = (f64, Vec<f64>);

/// A source ready to migrate: the guest, the source, and the guest's write rate during the
/// warm-up (per second, in all and per vCPU).
type Prepared = (Arc<dyn BenchGuest>, Source, Before);

/// Builds, populates and fills the source guest; starts its workload and lets it warm up.
fn prepare_source(g: &GuestArgs, m: &MigrationArgs, q: bool) -> CliResult<Prepared> {
    progress(
        q,
        &format!(
            "source: mapping {} of {} guest RAM on {}, populating and filling {}%",
            slat_workload::format_size(g.work.bytes * g.work.vcpus as u64),
            g.work.backing,
            g.backend.name(),
            g.fill
        ),
    );
    let guest = bench::build(&g.spec()).map_err(failed)?;
    guest.populate().map_err(failed)?;
    let mem = Memory::new(guest.as_dyn()).map_err(failed)?;
    mem.stopped_fill(g.fill, g.seed as u64).map_err(failed)?;
    guest.start(g.work()).map_err(failed)?;
    if let Some(r) = g.dirty_rate_vcpu0 {
        guest.set_vcpu_rate(0, r);
    }
    let src = Source::new(guest.clone().as_guest(), m.config());
    let (w0, v0, t0) = (guest.writes(), guest.vcpu_activity(), Instant::now());
    std::thread::sleep(Duration::from_millis(m.warmup));
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    let all = guest.writes().saturating_sub(w0) as f64 / secs;
    let per_vcpu = (guest.vcpu_activity().iter())
        .zip(v0.iter().chain(std::iter::repeat(&0)))
        .map(|(a, b)| a.saturating_sub(*b) as f64 / secs)
        .collect();
    Ok((guest, src, (all, per_vcpu)))
}

/// `s` when `on`, else nothing.
fn when(on: bool, s: &str) -> &str {
    if on {
        s
    } else {
        ""
    }
}

/// Refuses a machine the flags cannot run on: its page-table format, engine-only flags (the
/// machine's and `extra`) and the host memory behind guest RAM.
fn check_machine(
    m: &MachineArgs,
    b: BackendArg,
    backing: Backing,
    extra: &[&'static str],
) -> CliResult {
    crate::limits::refuse_phantom(backing, "migration").map_err(bad)?;
    m.format.check_backends(&[b]).map_err(bad)?;
    let engine_only = [m.engine_only(), extra.to_vec()].concat();
    check_backends(&[b], &engine_only).map_err(bad)?;
    check_backing(&[b], backing).map_err(bad)
}

/// A refusal of the flags (exit status 2).
fn bad(why: impl std::fmt::Display) -> CliError {
    CliError::bad(why)
}

/// A failure while running (exit status 1).
fn failed(why: impl std::fmt::Display) -> CliError {
    CliError::Runtime(why.to_string())
}

impl Benchmark for MigrateArgs {
    type Report = Migration;
    const NAME: &'static str = "migrate";

    fn common(&self) -> Common<'_> {
        Common {
            backends: std::slice::from_ref(&self.guest.backend),
            vary: &[],
            out: &self.out,
        }
    }

    fn check(&self) -> CliResult {
        self.guest.check(1)?;
        self.migration.check(&self.guest)?;
        if matches!(self.to, Endpoint::Fd(_)) && (self.out.repeat > 1 || self.retries > 0) {
            return Err(bad(
                "--to fd:N carries one migration: --repeat and --retries need tcp: or unix:",
            ));
        }
        let streams = matches!(self.to, Endpoint::Tcp(_) | Endpoint::Unix(_));
        if self.migration.connections > 1 && !streams {
            return Err(bad(
                "--connections N opens more connections to the endpoint: it needs --to tcp: or unix:",
            ));
        }
        Ok(())
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Migration> {
        let (r, before, failed_attempts) = migrate_once(self, quiet(self.out.json))?;
        let (guest, migration) = (self.guest.clone(), self.migration.clone());
        Ok(Migration {
            benchmark: Self::NAME,
            guest,
            migration,
            failed_attempts,
            r,
            before,
            destination: None,
        })
    }

    fn metrics(&self) -> Vec<Metric<Migration>> {
        perf::METRICS.to_vec()
    }

    fn print(&self, m: &Migration) {
        text::print_report(m)
    }

    fn lines(&self, first: &Migration) -> Vec<Lines<Migration>> {
        perf::convergence(first)
    }
}

/// Builds a source guest and migrates it to `--to`, retrying as `--retries` allows. Returns
/// the report, the guest's write rates before the migration and why earlier attempts failed.
fn migrate_once(a: &MigrateArgs, q: bool) -> CliResult<(MigrationReport, Before, Vec<String>)> {
    let mut fd = match &a.to {
        Endpoint::Fd(n) => Some(claim_fd(&a.to, *n)?),
        _ => None,
    };
    let (guest, mut src, before) = prepare_source(&a.guest, &a.migration, q)?;
    let mut failures = Vec::new();
    loop {
        let attempt = src.attempts() + 1;
        progress(q, &format!("migrating to {} (attempt {attempt})", a.to));
        let mut events = on_event(q, a.migration.progress);
        let r = match (&a.to, fd.take()) {
            (Endpoint::Fd(_), Some(fd)) => {
                let c = Channel::fd(fd, Duration::from_secs(a.migration.timeout), true)
                    .map_err(|e| failed(format!("{}: {e}", a.to)))?;
                src.migrate_over(c, &mut events)
            }
            (Endpoint::Fd(_), None) => {
                let why = "the descriptor carried the first attempt";
                return Err(failed(format!("{}: {why}", a.to)));
            }
            (to, _) => src.migrate_to(to, &mut events),
        };
        let err = match r {
            Ok(r) => return Ok((r, before, failures)),
            Err(e) => e,
        };
        failures.push(err.to_string());
        // Inject faults into the first attempt only: a retry shows the recovery.
        let faults = &mut src.config_mut().faults;
        *faults = Faults {
            skip_final_harvest: faults.skip_final_harvest,
            skip_merge_back: faults.skip_merge_back,
            ..Faults::default()
        };
        if failures.len() as u32 > a.retries {
            let after = match failures.len() {
                1 => String::new(),
                n => format!(" after {n} attempts"),
            };
            return Err(failed(format!(
                "migration to {} failed{after}: {err}; the guest keeps running on the source ({} writes so far, {} pages still owed)",
                a.to, guest.writes(), src.owed()
            )));
        }
        progress(
            q,
            &format!(
                "attempt {} failed: {err}; the guest keeps running here; retrying in {} ms",
                failures.len(),
                a.retry_delay
            ),
        );
        std::thread::sleep(Duration::from_millis(a.retry_delay));
    }
}
