//! `slat migrate`, `slat migrate-listen` and `slat migrate-perf`: live migration of a guest
//! under write load over TCP (`slat-migrate`), with the figures of the reverse-map write-protect series' `migrate-perf`:
//! total migration time, downtime, rounds, dirty rate, bandwidth, throttling, verification.

mod perf;
mod text;

pub use perf::MigratePerfArgs;
use crate::driver::{Benchmark, Common, Lines};
use text::{print_dest, print_report};
use crate::args::{
    backing, check_backends, check_kvm_ring, ring_size, BackendArg, FormatArg, MachineArgs,
    OutputArgs, Switch, Workload,
};
use crate::error::{CliError, CliResult};
use crate::limits::{check_backing, GuestMemory};
use crate::migrate_report::{DestinationDoc, Migration};
use crate::output::{print_json, Better, Metric, Repeated};
use crate::report::quiet;
use clap::{Args, ValueEnum};
use serde::Serialize;
use slat_machine::ram::{format_size, parse_size, Backing};
use slat_migrate::bench::{self, BackendKind, BenchGuest, GuestSpec, LogMode, Shape, WorkSpec};
use slat_migrate::stream::Compression;
use slat_migrate::transport::{self, Channel, Endpoint, Listener};
use slat_migrate::verify::VerifyMode;
use slat_migrate::{
    DestConfig, DestReport, Destination, DirtyLimitConfig, Event, Faults, GuestError, MapError,
    Memory, MemoryError, MigrateError, MigrationReport, Source, SourceConfig,
};
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

/// The guest on the source and its workload.
#[derive(Debug, Clone, Args)]
pub struct GuestArgs {
    #[command(flatten)]
    pub work: Workload,
    /// Write pseudo-random pages instead of sweeping them in order.
    #[arg(short = 'a')]
    pub random: bool,
    /// Seed of the guest's pseudo-random generator.
    #[arg(short = 'r', default_value_t = 1)]
    pub seed: u32,
    /// Percentage of the guest's accesses that are writes (0-100).
    #[arg(short = 'w', value_parser = clap::value_parser!(u32).range(0..=100), default_value_t = 100)]
    pub write_percent: u32,
    /// Memslots the guest memory is split into (must divide its pages evenly).
    #[arg(short = 'x', value_parser = clap::value_parser!(u32).range(1..=32_000), default_value_t = 1)]
    pub slots: u32,
    /// Guest writes per second per vCPU while it is migrated (k/m suffixes; 0: as fast as
    /// it can; at most 1000m). Every write stores a new value, so each is a real change.
    #[arg(long = "dirty-rate", value_parser = dirty_rate, default_value = "10k")]
    pub dirty_rate: u64,
    /// vCPU 0's own writes per second, overriding --dirty-rate for it on the source (`sim`
    /// only; k/m suffixes, 1 to 1000m): one heavy vCPU among lighter ones, where dirty-limit
    /// slows only the heavy one.
    #[arg(long = "dirty-rate-vcpu0", value_parser = dirty_rate)]
    pub dirty_rate_vcpu0: Option<u64>,
    /// Percent of guest pages filled with pseudo-random data before the run (the rest are
    /// zero, and travel as zero-page markers until the guest writes them).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100), default_value_t = 50)]
    pub fill: u32,
    /// How the source harvests dirty pages: `get` (GET_DIRTY_LOG clears), `clear` (manual
    /// protect with INITIALLY_SET: GET copies, CLEAR re-protects) or `ring` (dirty rings).
    #[arg(long = "log", value_enum, default_value = "clear")]
    pub log: LogArg,
    /// Dirty ring entries per vCPU with `--log ring` (a power of two, 128-65536).
    #[arg(long = "dirty-ring", value_parser = ring_size, default_value = "65536")]
    pub ring_entries: u32,
    /// The machine: `sim` (slat's engine under simulated hardware) or `kvm` (/dev/kvm).
    #[arg(long, value_enum, default_value = "sim")]
    pub backend: BackendArg,
    /// How the source's harvests find the pages they write-protect (lockless write-protect through the reverse map; `--backend sim`
    /// only): `walk` (page-table walk under the MMU lock), `rmap` (reverse-map lookups, same
    /// lock) or `rmap-lockless` (reverse-map lookups and one compare-and-swap each, no lock).
    #[arg(long = "wrprot", value_parser = crate::args::variant::<slat::WrprotVariant>(), default_value = "walk")]
    pub wrprot: slat::WrprotVariant,
    #[command(flatten)]
    pub machine: MachineArgs,
}

/// How the source migrates.
#[derive(Debug, Clone, Args)]
pub struct MigrationArgs {
    /// Longest acceptable stop-and-copy transfer in milliseconds: pre-copy ends once the
    /// remaining dirty pages could be sent in this time at the measured bandwidth
    /// (0-3600000).
    #[arg(long = "max-downtime", value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=MAX_DOWNTIME_MS), default_value_t = 300)]
    pub max_downtime: u64,
    /// Pre-copy rounds after the full copy before stopping regardless (0-1000000).
    #[arg(long = "max-rounds", value_parser = clap::value_parser!(u32).range(0..=1_000_000), default_value_t = 30)]
    pub max_rounds: u32,
    /// Cap on the stream, in MiB per second (at least 1; default: none).
    #[arg(long, value_name = "MIB_PER_S", value_parser = clap::value_parser!(u64).range(1..=MAX_BANDWIDTH_MIB))]
    pub bandwidth: Option<u64>,
    /// Page compression: none, or lz4 where it makes a page smaller.
    #[arg(long, value_enum, default_value = "none")]
    pub compress: CompressArg,
    /// Verification at the switch-over: `sent` (every page's digest kept as it is sent and
    /// received, so only the final round is hashed while the guest is paused) or `full` (all
    /// memory hashed on both sides while paused, independent of the dirty log). Always on.
    #[arg(long, value_enum, default_value = "sent")]
    pub verify: VerifyArg,
    /// Progress on stderr: `text` lines, or `json` — one JSON object per line (round, pages
    /// sent and remaining, bandwidth, expected downtime, throttle), also with --json.
    #[arg(long, value_enum, default_value = "text")]
    pub progress: ProgressArg,
    /// Throttle the vCPUs (QEMU-style, 20% then +10% steps) when the guest dirties memory
    /// faster than the link sends it.
    #[arg(long = "auto-converge", value_enum, default_value = "on")]
    pub auto_converge: Switch,
    /// How pre-copy is made to converge when the guest outruns the link: `auto`
    /// (auto-converge, as --auto-converge says: every vCPU loses the same time slice),
    /// `dirty-limit` (QEMU's dirty-limit: each vCPU's dirty rate is measured from its dirty
    /// ring every --dirty-limit-period, and only the vCPUs above --dirty-limit are slowed;
    /// needs --log ring and --backend sim) or `none`.
    #[arg(long, value_enum, default_value = "auto")]
    pub converge: ConvergeArg,
    /// Dirty pages per second per vCPU that dirty-limit allows (k/m suffixes; 1 to 1000m).
    /// The default, 8k (31 MiB/s), is well under a loopback link and slows a heavy writer
    /// within seconds; QEMU's 1 MB/s would stall a benchmark guest.
    #[arg(long = "dirty-limit", value_name = "PAGES_PER_S", value_parser = dirty_limit, default_value = "8k")]
    pub dirty_limit: u64,
    /// How often dirty-limit measures each vCPU and adjusts its throttle, in milliseconds
    /// (100-60000; QEMU's default is 1000).
    #[arg(long = "dirty-limit-period", value_name = "MS", value_parser = clap::value_parser!(u64).range(100..=60_000), default_value_t = 1000)]
    pub dirty_limit_period: u64,
    /// How long the guest runs before migration starts, in milliseconds (its write rate then
    /// is the baseline the migration is compared with; 0-600000).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=MAX_WAIT_MS), default_value_t = 500)]
    pub warmup: u64,
    /// Seconds without data from the destination before an attempt fails (1-86400; there is
    /// no "never": 0 is refused).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_S), default_value_t = 30)]
    pub timeout: u64,
    /// A deliberately broken source (verification must catch it).
    #[arg(long = "break", value_enum, hide = true)]
    pub break_: Option<BreakArg>,
    /// Faults for tests: cut-after=BYTES, corrupt-at=BYTES, version=N (first attempt only).
    #[arg(long, hide = true, value_parser = inject)]
    pub inject: Vec<Inject>,
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

/// Parses `--to` and `--listen` (QEMU's URI forms; a bare HOST:PORT is TCP).
fn endpoint(s: &str) -> Result<Endpoint, transport::EndpointError> {
    s.parse()
}

/// Takes inherited descriptor `n` of `ep` (`fd:N`).
fn claim_fd(ep: &Endpoint, n: i32) -> Result<std::os::fd::OwnedFd, RunError> {
    // SAFETY: `fd:N` names a descriptor this process inherited for the migration (N > 2, so
    // not stdin, stdout or stderr); nothing else in the process opens, uses or closes it.
    unsafe { transport::inherited_fd(n) }.map_err(|e| RunError::Fd(ep.clone(), e))
}

fn inject(s: &str) -> Result<Inject, FlagError> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| FlagError::NotKeyValue(s.into()))?;
    let n: u64 = v.parse().map_err(|_| FlagError::NotNumber(v.into()))?;
    match k {
        "cut-after" => Ok(Inject::CutAfter(n)),
        "corrupt-at" => Ok(Inject::CorruptAt(n)),
        "version" => u32::try_from(n)
            .map(Inject::Version)
            .map_err(|_| FlagError::Version(v.into())),
        _ => Err(FlagError::InjectKey(k.into())),
    }
}

/// A count with an optional k/m suffix (powers of 1000).
fn count(s: &str) -> Result<u64, FlagError> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1_000),
        Some('m') => (&t[..t.len() - 1], 1_000_000),
        _ => (&t[..], 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| FlagError::NotCount(s.into()))
}

/// Most guest writes per second per vCPU `--dirty-rate` takes (0 is unlimited): a billion,
/// beyond what any vCPU writes, and far from the arithmetic limits of the pacing.
pub const MAX_DIRTY_RATE: u64 = 1_000_000_000;

/// Parses `--dirty-rate` (a count, at most [`MAX_DIRTY_RATE`]).
fn dirty_rate(s: &str) -> Result<u64, FlagError> {
    let n = count(s)?;
    if n > MAX_DIRTY_RATE {
        return Err(FlagError::DirtyRate(s.into()));
    }
    Ok(n)
}

const _: () = assert!(slat_migrate::dirty_limit::MAX_LIMIT == 1_000_000_000);

/// Parses `--dirty-limit` (a count, 1 to the library's maximum).
fn dirty_limit(s: &str) -> Result<u64, FlagError> {
    match count(s)? {
        n if n == 0 || n > slat_migrate::dirty_limit::MAX_LIMIT => {
            Err(FlagError::DirtyLimit(s.into()))
        }
        n => Ok(n),
    }
}

/// Parses a `--max-downtime` of `--vary` (milliseconds, at most [`MAX_DOWNTIME_MS`]).
fn max_downtime(s: &str) -> Result<u64, FlagError> {
    match s.parse::<u64>() {
        Ok(n) if n <= MAX_DOWNTIME_MS => Ok(n),
        _ => Err(FlagError::MaxDowntime(s.into())),
    }
}

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

fn kind(b: BackendArg) -> BackendKind {
    match b {
        BackendArg::Sim => BackendKind::Sim,
        BackendArg::Kvm => BackendKind::Kvm,
    }
}

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

fn progress(q: bool, s: &str) {
    if !q {
        eprintln!("[slat] {s}");
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

/// Progress lines for the source's events.
fn on_event(q: bool, mode: ProgressArg) -> impl FnMut(Event<'_>) {
    move |e| {
        if mode == ProgressArg::Json {
            // A line that cannot be serialised has nothing in it to lose; none can fail.
            if let Ok(line) = serde_json::to_string(&ProgressLine::of(&e)) {
                eprintln!("{line}");
            }
            return;
        }
        if q {
            return;
        }
        match e {
            Event::Connected { resume, backend } => eprintln!(
                "[slat] connected to a {backend} destination{}",
                if resume {
                    " that kept this guest's memory: resuming"
                } else {
                    ""
                }
            ),
            Event::Round(r) => eprintln!(
                "[slat] {} {}: {} pages ({} zero), {} in {:.3}s ({:.0} MiB/s), throttle {}%",
                if r.stop_and_copy {
                    "stop-and-copy"
                } else {
                    "round"
                },
                r.round,
                r.pages,
                r.zero_pages,
                format_size(r.bytes),
                r.time.as_secs_f64(),
                r.bandwidth() / (1 << 20) as f64,
                r.throttle
            ),
            Event::Throttle(t) => eprintln!("[slat] auto-converge: throttle {t}%"),
            Event::DirtyLimit {
                limit,
                rates,
                throttles,
            } => {
                let v: Vec<String> = rates
                    .iter()
                    .zip(throttles)
                    .map(|(r, t)| format!("{r:.0}/s -> {:.1}%", *t as f64 / 10.0))
                    .collect();
                eprintln!(
                    "[slat] dirty-limit {limit} pages/s per vCPU: {}",
                    v.join(", ")
                )
            }
            Event::Paused(n) => eprintln!("[slat] vCPUs paused; {n} pages to send"),
            // The text lines above already say where the migration stands.
            Event::Progress(_) => {}
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
        let doc = Migration::new("migrate", &self.guest, &self.migration, &r, baseline, &failures);
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

/// `slat migrate-listen`: receives one migration, or `--repeat N` one after the other.
pub fn run_listen(a: &ListenArgs) -> CliResult {
    a.machine
        .format
        .check_backends(&[a.backend])
        .map_err(CliError::bad)?;
    check_backends(&[a.backend], &a.machine.engine_only()).map_err(CliError::bad)?;
    check_backing(&[a.backend], a.backing).map_err(CliError::bad)?;
    if a.out.plot.is_some() {
        return Err(CliError::bad(
            "--plot: migrate-listen has nothing to draw (the source's `slat migrate --plot` draws the migration)",
        ));
    }
    if matches!(a.listen, Endpoint::Fd(_)) && (a.out.repeat > 1 || a.retries > 0) {
        return Err(CliError::bad(
            "--listen fd:N carries one migration: --repeat and --retries need tcp: or unix:",
        ));
    }
    let q = quiet(a.out.json);
    let mut listener = match &a.listen {
        Endpoint::Fd(n) => Listener::Fd(Some(claim_fd(&a.listen, *n)?)),
        at => Listener::bind(at).map_err(|err| RunError::Listen {
            addr: a.listen.to_string(),
            err,
        })?,
    };
    let local = listener.describe();
    progress(
        q,
        &format!(
            "listening on {local} for a migration ({} machine)",
            a.backend.name()
        ),
    );
    let mut docs = Vec::new();
    for n in 0..a.out.repeat {
        if a.out.repeat > 1 {
            progress(q, &format!("migration {}/{}", n + 1, a.out.repeat));
        }
        let r = receive_one(a, &mut listener, &local, q)?;
        if !a.out.json {
            print_dest(&r);
        }
        docs.push(DestinationDoc::new(&r));
    }
    if docs.len() > 1 {
        let rep = Repeated::new("migrate-listen", DEST_METRICS, docs);
        if a.out.json {
            return print_json(&rep, &[a.backend]);
        }
        rep.print();
        return Ok(());
    }
    if a.out.json {
        print_json(&docs[0], &[a.backend])?;
    }
    Ok(())
}

/// Serves connections on `listener` until one migration completes, into a destination of its
/// own, surviving `--retries` failed ones.
fn receive_one(
    a: &ListenArgs,
    listener: &mut Listener,
    local: &str,
    q: bool,
) -> Result<DestReport, RunError> {
    let cfg = DestConfig {
        resume_for: Duration::from_millis(a.resume_ms),
        timeout: Duration::from_secs(a.timeout),
        max_memory: a.max_memory.unwrap_or(0),
    };
    let mut dest = Destination::new(factory(a), cfg);
    let mut failures = 0;
    loop {
        let c = listener
            .accept(Duration::from_secs(a.timeout))
            .map_err(|err| RunError::Accept {
                addr: local.to_string(),
                err,
            })?;
        let peer = c.peer.clone();
        progress(q, &format!("incoming migration from {peer}"));
        let err = match dest.serve_channel(c) {
            Ok(r) => return Ok(r),
            Err(err) => err,
        };
        failures += 1;
        if failures > a.retries {
            return Err(RunError::Incoming { peer, err });
        }
        progress(q, &format!(
            "incoming migration from {peer} failed: {err}; {} waiting for the source to retry ({failures} of {})",
            if dest.holds_session() { "keeping the guest's memory and" } else { "" },
            a.retries
        ));
    }
}

/// Builds a machine of each incoming guest's shape with migrate-listen's settings.
fn factory(a: &ListenArgs) -> slat_migrate::Factory {
    // The shape is the source's (from the hello's machine description); the rest is ours.
    bench::factory(GuestSpec {
        backend: kind(a.backend),
        shape: Shape {
            vcpus: 1,
            bytes_per_vcpu: 4096,
            slots: 1,
            overlap: false,
        },
        backing: a.backing,
        log: LogMode::Get,
        ring_entries: 65536,
        vm: a.machine.vm_config(),
        stage2: a.machine.format == FormatArg::Stage2,
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
        prefault: !a.machine.no_prefault,
    })
}

/// The figures `migrate-listen --repeat` summarizes, from the destination's report.
const DEST_METRICS: &[Metric<DestinationDoc>] = &[
    Metric {
        name: "total migration time",
        unit: "s",
        better: Better::Lower,
        get: |d| Some(d.total.as_secs_f64()),
    },
    Metric {
        name: "setup",
        unit: "s",
        better: Better::Lower,
        get: |d| Some(d.setup.as_secs_f64()),
    },
    Metric {
        name: "verification hashing",
        unit: "s",
        better: Better::Lower,
        get: |d| Some(d.verify_time.as_secs_f64()),
    },
    Metric {
        name: "stream received",
        unit: "bytes",
        better: Better::Lower,
        get: |d| Some(d.bytes as f64),
    },
];

