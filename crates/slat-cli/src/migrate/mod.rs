//! `slat migrate`, `slat migrate-listen` and `slat migrate-perf`: live migration of a guest
//! under write load over TCP (`slat-migrate`), with the figures of the reverse-map write-protect series' `migrate-perf`:
//! total migration time, downtime, rounds, dirty rate, bandwidth, throttling, verification.

mod guest;
use guest::kind;
pub use guest::{GuestArgs, MigrationArgs};

mod progress;
use progress::{on_event, progress};

mod parse;
use parse::{claim_fd, dirty_limit, dirty_rate, endpoint, inject, max_downtime};

mod listen;
pub use listen::run_listen;

mod perf;
mod text;

use crate::args::{
    backing, check_backends, check_kvm_ring, ring_size, BackendArg, FormatArg, MachineArgs,
    OutputArgs, Switch, Workload,
};
use crate::driver::{Benchmark, Common, Lines};
use crate::error::{CliError, CliResult};
use crate::limits::{check_backing, GuestMemory};
use crate::migrate_report::{DestinationDoc, Migration};
use crate::output::{print_json, Better, Metric, Repeated};
use crate::report::quiet;
use clap::{Args, ValueEnum};
pub use perf::MigratePerfArgs;
use serde::Serialize;
use slat_harness::migrate::{
    self as bench, BackendKind, BenchGuest, GuestSpec, LogMode, Shape, WorkSpec,
};
use slat_migrate::dirty_limit::DirtyLimitConfig;
use slat_migrate::stream::Compression;
use slat_migrate::transport::{self, Channel, Endpoint, Listener};
use slat_migrate::verify::VerifyMode;
use slat_migrate::{
    DestConfig, DestReport, Destination, Event, Faults, GuestError, MapError, Memory, MemoryError,
    MigrateError, MigrationReport, Source, SourceConfig,
};
use slat_workload::{format_size, parse_size, Backing};
use std::sync::Arc;
use std::time::{Duration, Instant};
use text::{print_dest, print_report};

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

/// An injected fault.
#[derive(Debug, Clone, Copy)]
pub enum Inject {
    /// Cut the connection after this many bytes.
    CutAfter(u64),
    /// Flip the byte at this offset.
    CorruptAt(u64),
    /// Send this protocol version.
    Version(u32),
}

/// Why a value of a migrate command's flag is refused (clap prints it on one line and exits
/// with status 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// `--inject` without `=`.
    #[error("`{0}`: expected KEY=VALUE")]
    NotKeyValue(String),
    /// Not a decimal number.
    #[error("`{0}` is not a number")]
    NotNumber(String),
    /// `--inject version=` past 32 bits.
    #[error("`{0}` is not a 32-bit version")]
    Version(String),
    /// An `--inject` key that does not exist.
    #[error("`{0}`: one of cut-after, corrupt-at, version")]
    InjectKey(String),
    /// Not a count with an optional k/m suffix.
    #[error("`{0}` is not a count (e.g. 5000, 20k, 1m)")]
    NotCount(String),
    /// A `--dirty-rate` over [`MAX_DIRTY_RATE`].
    #[error("`{0}`: at most {MAX_DIRTY_RATE} writes per second per vCPU (1000m)")]
    DirtyRate(String),
    /// A `--dirty-limit` of 0 or over the library's maximum.
    #[error("`{0}`: a dirty limit is 1 to 1000000000 pages per second per vCPU (1000m)")]
    DirtyLimit(String),
    /// A `--max-downtime` of `--vary` that is not 0 to [`MAX_DOWNTIME_MS`].
    #[error("`{0}` is not a number of milliseconds from 0 to {MAX_DOWNTIME_MS}")]
    MaxDowntime(String),
}

/// Most guest writes per second per vCPU `--dirty-rate` takes (0 is unlimited): a billion,
/// beyond what any vCPU writes, and far from the arithmetic limits of the pacing.
pub const MAX_DIRTY_RATE: u64 = 1_000_000_000;

const _: () = assert!(slat_migrate::dirty_limit::MAX_LIMIT == 1_000_000_000);

/// Flags of `slat migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// The destination, as QEMU writes it: tcp:HOST:PORT (or HOST:PORT) and unix:PATH
    /// (where `slat migrate-listen` runs), fd:N (an inherited socket, pipe or file: one
    /// attempt), or file:PATH (a snapshot: the whole migration into a file, which
    /// `migrate-listen --listen file:PATH` restores).
    #[arg(long, value_parser = endpoint)]
    pub to: Endpoint,
    /// Attempts after a failed one (the guest keeps running on the source meanwhile; 0-1000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=MAX_RETRIES as i64), default_value_t = 0)]
    pub retries: u32,
    /// Milliseconds between attempts (0-600000).
    #[arg(long = "retry-delay", value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_MS), default_value_t = 1000)]
    pub retry_delay: u64,
    // `--json`; `--repeat N` migrates N freshly built guests one after the other (the
    // destination must take N: `slat migrate-listen --repeat N`); `--plot FILE.svg` draws the
    // (first) migration's convergence: pages sent and pages the guest dirtied meanwhile (still
    // owed) per round, and the auto-converge throttle per round.
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub migration: MigrationArgs,
}

/// Flags of `slat migrate-listen`.
#[derive(Debug, Clone, Args)]
pub struct ListenArgs {
    /// Where migrations come from: tcp:HOST:PORT or HOST:PORT (port 0: any free port,
    /// printed), unix:PATH (created; must not exist), fd:N (an inherited connected socket,
    /// pipe or file: one migration) or file:PATH (restore a snapshot `slat migrate --to
    /// file:PATH` wrote).
    #[arg(long, value_parser = endpoint)]
    pub listen: Endpoint,
    /// The machine incoming guests run on.
    #[arg(long, value_enum, default_value = "sim")]
    pub backend: BackendArg,
    /// Host memory behind guest RAM (as for the source).
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// Milliseconds the guest runs here after the switch-over (0: leave it stopped;
    /// at most 600000).
    #[arg(long = "resume-ms", value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_MS), default_value_t = 200)]
    pub resume_ms: u64,
    /// Failed incoming migrations to survive, keeping the guest's memory so the source can
    /// reconnect and resume (0-1000; with --repeat, per migration).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=MAX_RETRIES as i64), default_value_t = 0)]
    pub retries: u32,
    /// Seconds without data from a connected source before the incoming migration fails
    /// (1-86400; there is no "never": 0 is refused, so a silent source cannot hold the
    /// destination forever). Waiting for a source to connect has no time limit.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_S), default_value_t = 30)]
    pub timeout: u64,
    /// Largest guest accepted (k/m/g/t suffixes; default: the host's RAM and swap, which
    /// bound a larger value too).
    #[arg(long = "max-memory", value_parser = parse_size)]
    pub max_memory: Option<u64>,
    // `--json`; `--repeat N` receives N migrations one after the other (from `slat migrate
    // --repeat N`), each into a machine of its own; `--plot` is refused (the source draws the
    // migration).
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
}

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

impl GuestArgs {
    /// Refuses flags that cannot run together and sizes that cannot be held: `-v` × `-b`
    /// without overflow, split evenly by `-x`, in the machine's guest physical address space,
    /// and `copies` guests of it at once on this host (the source, and for `migrate-perf` the
    /// destination in the same process).
    fn check(&self, copies: u64) -> CliResult {
        let backends = [self.backend];
        self.machine
            .format
            .check_backends(&backends)
            .map_err(CliError::bad)?;
        let mut engine_only = self.machine.engine_only();
        if self.wrprot != slat::WrprotVariant::Walk {
            engine_only.push("--wrprot");
        }
        check_backends(&backends, &engine_only).map_err(CliError::bad)?;
        check_backing(&backends, self.work.backing).map_err(CliError::bad)?;
        if self.backend == BackendArg::Kvm && self.write_percent != 100 {
            return Err(CliError::bad(
                "-w applies to --backend sim only: the kvm guest's writer writes on every access",
            ));
        }
        if self.dirty_rate_vcpu0.is_some() && self.backend != BackendArg::Sim {
            return Err(CliError::bad(
                "--dirty-rate-vcpu0 applies to --backend sim only: the kvm guest's writer paces all vCPUs together",
            ));
        }
        if self.dirty_rate_vcpu0 == Some(0) {
            return Err(CliError::bad(
                "--dirty-rate-vcpu0 0: give vCPU 0 a rate (omit the flag for --dirty-rate's)",
            ));
        }
        if self.log == LogArg::Ring {
            check_kvm_ring(&backends, self.ring_entries, "--dirty-ring").map_err(CliError::bad)?;
        }
        let mem = GuestMemory::per_vcpu(self.work.vcpus, self.work.bytes).map_err(CliError::bad)?;
        mem.slots_divide(self.slots).map_err(CliError::bad)?;
        mem.fits_gpa(&backends, self.machine.format, None)
            .map_err(CliError::bad)?;
        let tlb = self
            .machine
            .tlb_bytes(self.work.vcpus)
            .saturating_mul(copies);
        mem.fits_host(self.work.backing, copies, tlb)
            .map_err(CliError::bad)?;
        // The library's own check of the shape it will send (and a destination will check).
        self.shape().check().map_err(CliError::bad)?;
        Ok(())
    }

    fn shape(&self) -> Shape {
        Shape {
            vcpus: self.work.vcpus,
            bytes_per_vcpu: self.work.bytes,
            slots: self.slots,
            overlap: self.work.overlap,
        }
    }

    fn spec(&self) -> GuestSpec {
        GuestSpec {
            backend: kind(self.backend),
            shape: self.shape(),
            backing: self.work.backing,
            log: self.log.mode(),
            ring_entries: self.ring_entries,
            vm: slat::VmConfig {
                wrprot: self.wrprot,
                ..self.machine.vm_config()
            },
            stage2: self.machine.format == FormatArg::Stage2,
            tlb_entries: self.machine.tlb_entries,
            pcpus: self.machine.pcpus.unwrap_or(0),
            prefault: !self.machine.no_prefault,
        }
    }

    fn work(&self) -> WorkSpec {
        WorkSpec {
            write_percent: self.write_percent,
            random: self.random,
            seed: self.seed,
            rate: self.dirty_rate,
        }
    }

    fn describe(&self) -> String {
        format!(
            "{}, {} vCPU(s), {} guest memory, log {}, dirty rate {}, {}% filled",
            self.backend.name(),
            self.work.vcpus,
            format_size(self.work.bytes * self.work.vcpus as u64),
            self.log.mode().name(),
            match (self.dirty_rate, self.dirty_rate_vcpu0) {
                (0, None) => "unlimited".to_string(),
                (r, None) => format!("{r} writes/s per vCPU"),
                (r, Some(v0)) => format!("{v0} writes/s on vCPU 0, {r} on the others"),
            },
            self.fill
        )
    }
}

impl MigrationArgs {
    /// Refuses settings that cannot run with the guest `g`.
    fn check(&self, g: &GuestArgs) -> CliResult {
        if self.converge != ConvergeArg::DirtyLimit {
            return Ok(());
        }
        if g.log != LogArg::Ring {
            return Err(CliError::bad(
                "--converge dirty-limit needs --log ring: it measures each vCPU's dirty rate from its dirty ring",
            ));
        }
        if g.backend != BackendArg::Sim {
            return Err(CliError::bad(
                "--converge dirty-limit needs --backend sim: the kvm guest's driver runs all vCPUs in one burst and cannot slow one alone",
            ));
        }
        Ok(())
    }

    fn config(&self) -> SourceConfig {
        let mut faults = Faults::default();
        match self.break_ {
            Some(BreakArg::SkipFinalHarvest) => {
                faults.skip_final_harvest = true;
                faults.pause_delay = Some(Duration::from_millis(100));
            }
            Some(BreakArg::SkipMergeBack) => faults.skip_merge_back = true,
            None => {}
        }
        for i in &self.inject {
            match *i {
                Inject::CutAfter(n) => faults.cut_after = Some(n),
                Inject::CorruptAt(n) => faults.corrupt_at = Some(n),
                Inject::Version(v) => faults.version = Some(v),
            }
        }
        SourceConfig {
            max_downtime: Duration::from_millis(self.max_downtime),
            max_rounds: self.max_rounds,
            // At most MAX_BANDWIDTH_MIB: the bytes per second fit.
            bandwidth: self.bandwidth.unwrap_or(0) << 20,
            verify: match self.verify {
                VerifyArg::Sent => VerifyMode::Sent,
                VerifyArg::Full => VerifyMode::Full,
            },
            compression: match self.compress {
                CompressArg::None => Compression::None,
                CompressArg::Lz4 => Compression::Lz4,
            },
            auto_converge: self.auto_converge.on() && self.converge == ConvergeArg::Auto,
            dirty_limit: (self.converge == ConvergeArg::DirtyLimit).then(|| DirtyLimitConfig {
                limit: self.dirty_limit,
                period: Duration::from_millis(self.dirty_limit_period),
            }),
            timeout: Duration::from_secs(self.timeout),
            faults,
            ..SourceConfig::default()
        }
    }
}

/// A source ready to migrate: the guest, the source, its write rate before (all, per vCPU).
type Prepared = (Arc<dyn BenchGuest>, Source, f64, Vec<f64>);

/// Builds, populates and fills the source guest; starts its workload and lets it warm up.
/// Returns the guest, the source, and the guest's write rate during the warm-up (per second),
/// in all and per vCPU.
fn prepare_source(g: &GuestArgs, m: &MigrationArgs, q: bool) -> Result<Prepared, RunError> {
    let total = g.work.bytes * g.work.vcpus as u64;
    progress(
        q,
        &format!(
            "source: mapping {} of {} guest RAM on {}, populating and filling {}%",
            format_size(total),
            g.work.backing,
            g.backend.name(),
            g.fill
        ),
    );
    let guest = bench::build(&g.spec())?;
    guest.populate()?;
    Memory::new(guest.as_dyn())?.stopped_fill(g.fill, g.seed as u64)?;
    guest.start(g.work())?;
    if let Some(r) = g.dirty_rate_vcpu0 {
        guest.set_vcpu_rate(0, r);
    }
    let src = Source::new(guest.clone().as_guest(), m.config());
    let w0 = guest.writes();
    let v0 = guest.vcpu_activity();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(m.warmup));
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    let baseline = guest.writes().saturating_sub(w0) as f64 / secs;
    let per_vcpu = guest
        .vcpu_activity()
        .iter()
        .zip(v0.iter().chain(std::iter::repeat(&0)))
        .map(|(a, b)| a.saturating_sub(*b) as f64 / secs)
        .collect();
    Ok((guest, src, baseline, per_vcpu))
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

/// One line of `--progress json`.
#[derive(Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum ProgressLine<'a> {
    /// The destination answered.
    Connected { resume: bool, backend: &'a str },
    /// A round finished.
    Round {
        round: u32,
        stop_and_copy: bool,
        pages: u64,
        zero_pages: u64,
        bytes: u64,
        seconds: f64,
        bytes_per_second: f64,
        throttle_percent: u32,
    },
    /// The throttle changed.
    Throttle { percent: u32 },
    /// The vCPUs stopped.
    Paused { pages_to_send: u64 },
    /// Where the migration stands.
    Progress {
        round: u32,
        pages_sent: u64,
        pages_remaining: u64,
        dirtied_pages: u64,
        bytes_per_second: f64,
        expected_downtime_seconds: f64,
        throttle_percent: u32,
        #[serde(skip_serializing_if = "<[u32]>::is_empty")]
        vcpu_throttle_permille: &'a [u32],
        paused: bool,
        elapsed_seconds: f64,
    },
    /// Dirty-limit measured the vCPUs and set their throttles.
    DirtyLimit {
        limit_pages_per_s: u64,
        vcpu_dirty_pages_per_s: &'a [f64],
        vcpu_throttle_permille: &'a [u32],
    },
}

impl<'a> ProgressLine<'a> {
    fn of(e: &'a Event<'a>) -> ProgressLine<'a> {
        match *e {
            Event::Connected { resume, backend } => ProgressLine::Connected { resume, backend },
            Event::DirtyLimit {
                limit,
                rates,
                throttles,
            } => ProgressLine::DirtyLimit {
                limit_pages_per_s: limit,
                vcpu_dirty_pages_per_s: rates,
                vcpu_throttle_permille: throttles,
            },
            Event::Round(r) => ProgressLine::Round {
                round: r.round,
                stop_and_copy: r.stop_and_copy,
                pages: r.pages,
                zero_pages: r.zero_pages,
                bytes: r.bytes,
                seconds: r.time.as_secs_f64(),
                bytes_per_second: r.bandwidth(),
                throttle_percent: r.throttle,
            },
            Event::Throttle(percent) => ProgressLine::Throttle { percent },
            Event::Paused(pages_to_send) => ProgressLine::Paused { pages_to_send },
            Event::Progress(ref p) => ProgressLine::Progress {
                round: p.round,
                pages_sent: p.pages_sent,
                pages_remaining: p.pages_remaining,
                dirtied_pages: p.dirtied,
                bytes_per_second: p.bandwidth,
                expected_downtime_seconds: p.expected_downtime.as_secs_f64(),
                throttle_percent: p.throttle,
                vcpu_throttle_permille: &p.vcpu_throttle_permille,
                paused: p.paused,
                elapsed_seconds: p.elapsed.as_secs_f64(),
            },
        }
    }
}

/// Why a migrate command failed while it ran: exit status 1 (flags it refuses are
/// [`CliError::BadInput`], exit status 2, before anything runs).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The migration failed.
    #[error(transparent)]
    Migrate(#[from] MigrateError),
    /// The guest machine failed.
    #[error(transparent)]
    Guest(#[from] GuestError),
    /// Guest memory could not be filled.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The guest's memory map is unusable.
    #[error(transparent)]
    Map(#[from] MapError),
    /// The listening socket could not be opened.
    #[error("cannot listen on {addr}: {err}")]
    Listen {
        /// Where.
        addr: String,
        /// The socket error.
        #[source]
        err: std::io::Error,
    },
    /// A connection could not be accepted.
    #[error("accepting on {addr}: {err}")]
    Accept {
        /// The listening address.
        addr: String,
        /// Why.
        #[source]
        err: MigrateError,
    },
    /// An inherited descriptor cannot be used.
    #[error("{0}: {1}")]
    Fd(Endpoint, std::io::Error),
    /// migrate-perf's destination thread panicked.
    #[error("the destination thread panicked")]
    DestinationPanicked,
    /// Both ends of migrate-perf failed.
    #[error("{source_end} (destination: {destination})")]
    BothEnds {
        /// The source's error.
        source_end: Box<MigrateError>,
        /// The destination's.
        destination: Box<MigrateError>,
    },
    /// migrate-perf's destination failed after the source succeeded.
    #[error("destination: {0}")]
    Destination(MigrateError),
    /// `slat migrate` used up its attempts.
    #[error(
        "migration to {to} failed{}: {err}; the guest keeps running on the source ({writes} writes so far, {owed} pages still owed)",
        after_attempts(*attempts)
    )]
    GaveUp {
        /// The destination.
        to: String,
        /// Attempts made.
        attempts: usize,
        /// The last attempt's error.
        err: Box<MigrateError>,
        /// Guest writes so far.
        writes: u64,
        /// Pages still owed to the destination.
        owed: u64,
    },
    /// `slat migrate-listen` used up its retries.
    #[error("incoming migration from {peer} failed: {err}")]
    Incoming {
        /// The source's address.
        peer: String,
        /// Why.
        err: MigrateError,
    },
}

fn after_attempts(n: usize) -> String {
    if n > 1 {
        format!(" after {n} attempts")
    } else {
        String::new()
    }
}

/// A failed run is a runtime failure: exit status 1.
impl From<RunError> for CliError {
    fn from(e: RunError) -> CliError {
        CliError::Runtime(e.to_string())
    }
}

/// One migration of `slat migrate` or `slat migrate-perf`: the source's report, the guest's
/// write rate before it, and its JSON.
pub struct Migrated {
    r: MigrationReport,
    baseline: f64,
    doc: Migration,
}

impl Serialize for Migrated {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.doc.serialize(s)
    }
}

impl Benchmark for MigrateArgs {
    type Report = Migrated;
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
            return Err(CliError::bad(
                "--to fd:N carries one migration: --repeat and --retries need tcp: or unix:",
            ));
        }
        Ok(())
    }

    fn measure(&self, _kind: BackendArg) -> CliResult<Migrated> {
        let (r, baseline, failures) = migrate_once(self, quiet(self.out.json))?;
        let doc = Migration::new(
            "migrate",
            &self.guest,
            &self.migration,
            &r,
            baseline,
            &failures,
        );
        Ok(Migrated { r, baseline, doc })
    }

    fn metrics(&self) -> Vec<Metric<Migrated>> {
        perf::METRICS.to_vec()
    }

    fn print(&self, m: &Migrated) {
        text::print_report(&self.guest, &self.migration, &m.r, m.baseline)
    }

    fn lines(&self, first: &Migrated) -> Vec<Lines<Migrated>> {
        perf::convergence(&first.r)
    }
}

/// Builds a source guest and migrates it to `--to`, retrying as `--retries` allows. Returns
/// the report, the guest's write rate before the migration and why earlier attempts failed.
fn migrate_once(a: &MigrateArgs, q: bool) -> Result<(MigrationReport, f64, Vec<String>), RunError> {
    let mut fd = match &a.to {
        Endpoint::Fd(n) => Some(claim_fd(&a.to, *n)?),
        _ => None,
    };
    let (guest, mut src, baseline, _) = prepare_source(&a.guest, &a.migration, q)?;
    let mut failures = Vec::new();
    loop {
        progress(
            q,
            &format!("migrating to {} (attempt {})", a.to, src.attempts() + 1),
        );
        let r = match &a.to {
            Endpoint::Fd(_) => match fd.take() {
                Some(fd) => Channel::fd(fd, Duration::from_secs(a.migration.timeout), true)
                    .map_err(|e| RunError::Fd(a.to.clone(), e))
                    .and_then(|c| {
                        src.migrate_over(c, &mut on_event(q, a.migration.progress))
                            .map_err(RunError::from)
                    }),
                None => Err(RunError::Fd(
                    a.to.clone(),
                    std::io::Error::other("the descriptor carried the first attempt"),
                )),
            },
            to => src
                .migrate_to(to, &mut on_event(q, a.migration.progress))
                .map_err(RunError::from),
        };
        let err = match r {
            Ok(r) => return Ok((r, baseline, failures)),
            Err(RunError::Migrate(e)) => e,
            Err(e) => return Err(e),
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
            return Err(RunError::GaveUp {
                to: a.to.to_string(),
                attempts: failures.len(),
                err: Box::new(err),
                writes: guest.writes(),
                owed: src.owed(),
            });
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
