//! The guest and migration flags of the migration commands, checked and turned into the
//! library's settings.

use super::parse::{connections, delta_cache, dirty_limit, dirty_rate, inject};
use super::*;
use crate::args::{check_kvm_ring, ring_size, FormatArg};
use crate::args::{Switch, Workload};
use crate::limits::GuestMemory;
use slat_harness::migrate::{BackendKind, GuestSpec, Shape, WorkSpec};
use slat_migrate::dirty_limit::DirtyLimitConfig;
use slat_migrate::postcopy::PostcopyTrigger;
use slat_migrate::stream::Compression;
use slat_migrate::verify::VerifyMode;
use slat_migrate::SourceConfig;
use slat_workload::format_size;

/// The machine settings both ends share.
pub(super) fn machine_spec(m: &MachineArgs, backend: BackendArg) -> GuestSpec {
    GuestSpec {
        backend: match backend {
            BackendArg::Sim => BackendKind::Sim,
            BackendArg::Kvm => BackendKind::Kvm,
        },
        // The destination takes the shape from the source's hello; the source sets its own.
        shape: Shape {
            vcpus: 1,
            bytes_per_vcpu: 4096,
            slots: 1,
            overlap: false,
        },
        backing: slat_workload::Backing::Anonymous,
        log: LogMode::Get,
        ring_entries: 65536,
        vm: m.vm_config(),
        stage2: m.format == FormatArg::Stage2,
        tlb_entries: m.tlb_entries,
        pcpus: m.pcpus.unwrap_or(0),
        prefault: !m.no_prefault,
    }
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
    /// Page streams (1-16): 1 sends the pages over the one connection; N opens N more
    /// connections to the same tcp: or unix: endpoint beside it and stripes the pages across
    /// them, each read, hashed and compressed on a thread of its own (QEMU's multifd).
    #[arg(long, value_name = "N", value_parser = connections, default_value_t = 1)]
    pub connections: u32,
    /// Send a page dirtied again as the bytes that changed since it was last sent (a delta
    /// against the source's cache of sent pages, QEMU's XBZRLE idea), where the destination
    /// accepts and the pages go over one stream; `off` sends every page whole.
    #[arg(long, value_enum, default_value = "on")]
    pub delta: Switch,
    /// Most memory the source's cache of sent pages takes (k/m/g suffixes; at least 4 KiB, at
    /// most 1 TiB; never more than the guest). In a cache smaller than the guest the pages
    /// sent first in a round keep their slots, and a page without a copy goes whole.
    #[arg(long = "delta-cache", value_name = "SIZE", value_parser = delta_cache, default_value = "1G")]
    pub delta_cache: u64,
    /// Verification at the switch-over: `sent` (every page's digest kept as it is sent and
    /// received, so only the final round is hashed while the guest is paused) or `full` (all
    /// memory hashed on both sides while paused, independent of the dirty log). Always on.
    #[arg(long, value_enum, default_value = "sent")]
    pub verify: VerifyArg,
    /// Progress on stderr: `text` lines, or `json` — one JSON object per line (round, pages
    /// sent and remaining, bandwidth, expected downtime, throttle), also with --json.
    #[arg(long, value_enum, default_value = "text")]
    pub progress: ProgressArg,
    /// Throttle the vCPUs (QEMU's schedule: --cpu-throttle-initial, then
    /// --cpu-throttle-increment steps) when the guest dirties memory faster than the link
    /// sends it.
    #[arg(long = "auto-converge", value_enum, default_value = "on")]
    pub auto_converge: Switch,
    /// Auto-converge's first throttle, percent of each vCPU's time (1-99; QEMU's
    /// cpu-throttle-initial).
    #[arg(long = "cpu-throttle-initial", value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(1..=99), default_value_t = 20)]
    pub throttle_initial: u32,
    /// Auto-converge's later steps, percent (1-99; QEMU's cpu-throttle-increment).
    #[arg(long = "cpu-throttle-increment", value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(1..=99), default_value_t = 10)]
    pub throttle_increment: u32,
    /// Auto-converge's later steps only as large as the measured dirty rate asks for, at most
    /// --cpu-throttle-increment (QEMU's cpu-throttle-tailslow).
    #[arg(
        long = "cpu-throttle-tailslow",
        value_name = "CPU_THROTTLE_TAILSLOW",
        value_enum,
        default_value = "off"
    )]
    pub throttle_tailslow: Switch,
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
    /// Switch to post-copy when pre-copy stops converging: a round that leaves more than 80%
    /// of the pages the round before it left (or the last of --max-rounds). The guest then
    /// runs on the destination at once and its missing pages follow on demand.
    #[arg(long)]
    pub postcopy: bool,
    /// Switch to post-copy after this many pre-copy rounds instead (0: pure post-copy, no
    /// pre-copy at all; 0-1000; implies --postcopy).
    #[arg(long = "postcopy-after", value_name = "ROUNDS", value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub postcopy_after: Option<u32>,
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

impl GuestArgs {
    /// Refuses flags that cannot run together and sizes that cannot be held: `-v` × `-b`
    /// without overflow, split evenly by `-x`, in the machine's guest physical address space,
    /// and `copies` guests of it at once on this host (the source, and for `migrate-perf` the
    /// destination in the same process).
    pub(super) fn check(&self, copies: u64) -> CliResult {
        let wrprot = self.wrprot != slat::WrprotVariant::Walk;
        let extra: &[&str] = if wrprot { &["--wrprot"] } else { &[] };
        check_machine(&self.machine, self.backend, self.work.backing, extra)?;
        let backends = [self.backend];
        let sim = self.backend == BackendArg::Sim;
        if !sim && self.write_percent != 100 {
            return Err(bad(
                "-w applies to --backend sim only: the kvm guest's writer writes on every access",
            ));
        }
        if self.dirty_rate_vcpu0.is_some() && !sim {
            return Err(bad("--dirty-rate-vcpu0 applies to --backend sim only: the kvm guest's writer paces all vCPUs together"));
        }
        if self.dirty_rate_vcpu0 == Some(0) {
            return Err(bad(
                "--dirty-rate-vcpu0 0: give vCPU 0 a rate (omit the flag for --dirty-rate's)",
            ));
        }
        if self.log == LogArg::Ring {
            check_kvm_ring(&backends, self.ring_entries, "--dirty-ring").map_err(bad)?;
        }
        let mem = GuestMemory::per_vcpu(self.work.vcpus, self.work.bytes).map_err(bad)?;
        mem.slots_divide(self.slots).map_err(bad)?;
        (mem.fits_gpa(&backends, self.machine.format, None)).map_err(bad)?;
        let tlb = self
            .machine
            .tlb_bytes(self.work.vcpus)
            .saturating_mul(copies);
        (mem.fits_host(self.work.backing, copies, tlb)).map_err(bad)?;
        // The library's own check of the shape it will send (and a destination will check).
        self.spec().shape.check().map_err(bad)?;
        Ok(())
    }

    pub(super) fn spec(&self) -> GuestSpec {
        let mut spec = machine_spec(&self.machine, self.backend);
        spec.shape = Shape {
            vcpus: self.work.vcpus,
            bytes_per_vcpu: self.work.bytes,
            slots: self.slots,
            overlap: self.work.overlap,
        };
        spec.backing = self.work.backing;
        spec.log = self.log.mode();
        spec.ring_entries = self.ring_entries;
        spec.vm.wrprot = self.wrprot;
        spec
    }

    pub(super) fn work(&self) -> WorkSpec {
        WorkSpec {
            write_percent: self.write_percent,
            random: self.random,
            seed: self.seed,
            rate: self.dirty_rate,
        }
    }

    pub(super) fn describe(&self) -> String {
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
    pub(super) fn check(&self, g: &GuestArgs) -> CliResult {
        if self.postcopy_trigger().is_some() && self.verify == VerifyArg::Full {
            return Err(bad("--postcopy needs --verify sent: full verification reads memory the destination may still lack"));
        }
        if self.converge != ConvergeArg::DirtyLimit {
            Ok(())
        } else if g.log != LogArg::Ring {
            Err(bad("--converge dirty-limit needs --log ring: it measures each vCPU's dirty rate from its dirty ring"))
        } else if g.backend != BackendArg::Sim {
            Err(bad("--converge dirty-limit needs --backend sim: the kvm guest's driver runs all vCPUs in one burst and cannot slow one alone"))
        } else {
            Ok(())
        }
    }

    pub(super) fn config(&self) -> SourceConfig {
        let mut faults = Faults {
            skip_final_harvest: self.break_ == Some(BreakArg::SkipFinalHarvest),
            skip_merge_back: self.break_ == Some(BreakArg::SkipMergeBack),
            ..Faults::default()
        };
        if faults.skip_final_harvest {
            faults.pause_delay = Some(Duration::from_millis(100));
        }
        for i in &self.inject {
            match *i {
                Inject::CutAfter(n) => faults.cut_after = Some(n),
                Inject::CorruptAt(n) => faults.corrupt_at = Some(n),
                Inject::Version(v) => faults.version = Some(v),
            }
        }
        let dirty_limit = self.converge == ConvergeArg::DirtyLimit;
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
            throttle_initial: self.throttle_initial,
            throttle_step: self.throttle_increment,
            throttle_tailslow: self.throttle_tailslow.on(),
            dirty_limit: dirty_limit.then(|| DirtyLimitConfig {
                limit: self.dirty_limit,
                period: Duration::from_millis(self.dirty_limit_period),
            }),
            timeout: Duration::from_secs(self.timeout),
            connections: self.connections,
            delta_cache: if self.delta.on() { self.delta_cache } else { 0 },
            postcopy: self.postcopy_trigger(),
            faults,
            ..SourceConfig::default()
        }
    }

    /// When to switch to post-copy (`None`: pre-copy only).
    pub(crate) fn postcopy_trigger(&self) -> Option<PostcopyTrigger> {
        match (self.postcopy, self.postcopy_after) {
            (_, Some(n)) => Some(PostcopyTrigger::After(n)),
            (true, None) => Some(PostcopyTrigger::Stalled),
            (false, None) => None,
        }
    }
}
