//! Flags shared by the benchmark subcommands and their value parsers.

pub mod keys;

use crate::driver::{vary::Vary, Common};
use crate::limits::{check_backing, GuestMemory};
use clap::{Args, ValueEnum};
use slat::{
    CmoPolicy, DirectMapPolicy, DirtyTrack, Ept, GetLogVariant, MmuLockKind, PteFormat,
    RebuildOrder, RecoverVariant, Stage2, VmConfig, WrprotVariant,
};
use slat_machine::tlb::DEFAULT_TLB_ENTRIES;
use slat_workload::{parse_size, Backing, DirtyConfig, RegionSpec};

/// Parses a KVM-selftest size (`1G`, `512M`, `4096`) that must be a multiple of 4 KiB.
pub fn guest_size(s: &str) -> Result<u64, String> {
    let v = parse_size(s).map_err(|e| e.to_string())?;
    if v % 4096 != 0 {
        return Err(format!(
            "`{s}` is not a multiple of 4 KiB (the guest page size)"
        ));
    }
    Ok(v)
}

/// Parses a backing source name.
pub fn backing(s: &str) -> Result<Backing, String> {
    Backing::parse(s).map_err(|e| e.to_string())
}

/// Most software TLB entries per vCPU: 16 MiB of entries each (a real TLB has a few thousand).
pub const MAX_TLB_ENTRIES: usize = 1 << 20;

/// Parses a TLB size: a power of two from 1 to [`MAX_TLB_ENTRIES`] (each vCPU allocates that
/// many entries, so the count is bounded here, not found out by a failed allocation).
pub fn tlb_entries(s: &str) -> Result<usize, String> {
    let v: usize = s
        .parse()
        .map_err(|_| format!("`{s}` is not a positive integer"))?;
    if v == 0 || !v.is_power_of_two() || v > MAX_TLB_ENTRIES {
        return Err(format!(
            "`{s}` must be a power of two from 1 to {MAX_TLB_ENTRIES}"
        ));
    }
    Ok(v)
}

/// An engine variant enum as a flag value: its spellings (the engine's `config.rs`) are the
/// possible values clap lists and checks, and the enum's own `FromStr` parses them, so the choices
/// are declared once, in the engine.
pub trait Variant: Copy + Send + Sync + std::str::FromStr + 'static {
    /// Every variant.
    const ALL: &'static [Self];
    /// Its spelling.
    fn name(self) -> &'static str;
}

macro_rules! variant {
    ($($ty:ty),+) => {$(
        impl Variant for $ty {
            const ALL: &'static [Self] = <$ty>::ALL;
            fn name(self) -> &'static str {
                <$ty>::name(self)
            }
        }
    )+};
}
variant!(
    DirectMapPolicy,
    MmuLockKind,
    CmoPolicy,
    RebuildOrder,
    GetLogVariant,
    RecoverVariant,
    DirtyTrack,
    WrprotVariant
);

/// The clap value parser of an engine variant enum (see [`Variant`]).
pub fn variant<T: Variant>() -> impl clap::builder::TypedValueParser<Value = T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(T::ALL.iter().map(|v| v.name()))
        .try_map(|s| s.parse::<T>())
}

/// On or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

impl Switch {
    /// As a bool.
    pub fn on(self) -> bool {
        self == Switch::On
    }
}

/// The second-stage page-table format of a simulated VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// x86 EPT: hardware Accessed/Dirty bits, one compare-and-swap per change of mapping,
    /// coherent caches.
    Ept,
    /// arm64 stage-2 (4 KiB granule): break-before-make when a block becomes a table or back,
    /// data-cache maintenance for new mappings, no hardware dirty bit.
    #[value(name = "stage2")]
    Stage2,
}

/// What the reports say about a format, read from its [`PteFormat`] implementation.
#[derive(Debug, Clone, Copy)]
pub struct FormatInfo {
    /// The engine's name for it (`x86-ept`, `arm64-stage2`).
    pub engine_name: &'static str,
    /// Hardware records writes in the entry (a Dirty bit).
    pub hardware_dirty: bool,
    /// Changes of output address or size go through an invalid entry and a flush.
    pub break_before_make: bool,
    /// New mappings need cache maintenance.
    pub cache_maintenance: bool,
}

fn info<F: PteFormat>() -> FormatInfo {
    FormatInfo {
        engine_name: F::NAME,
        hardware_dirty: F::HARDWARE_DIRTY,
        break_before_make: F::BREAK_BEFORE_MAKE,
        cache_maintenance: F::CACHE_MAINTENANCE,
    }
}

impl FormatArg {
    /// The name `--format` takes.
    pub fn name(self) -> &'static str {
        match self {
            FormatArg::Ept => "ept",
            FormatArg::Stage2 => "stage2",
        }
    }

    /// The format's properties.
    pub fn info(self) -> FormatInfo {
        match self {
            FormatArg::Ept => info::<Ept>(),
            FormatArg::Stage2 => info::<Stage2>(),
        }
    }

    /// The report's header line naming the format and, where they apply, the switches that
    /// only it uses.
    pub fn header(self, c: &VmConfig) -> String {
        let i = self.info();
        let mut extra = Vec::new();
        if i.break_before_make {
            extra.push(format!("break-before-make, rebuild {}", c.rebuild.name()));
        }
        if i.cache_maintenance {
            extra.push(format!("cache maintenance {}", c.cmo.name()));
        }
        if !i.hardware_dirty {
            extra.push("no hardware dirty bit".to_string());
        }
        if extra.is_empty() {
            format!("Page table format: {} ({})", self.name(), i.engine_name)
        } else {
            format!(
                "Page table format: {} ({}; {})",
                self.name(),
                i.engine_name,
                extra.join(", ")
            )
        }
    }

    /// Refuses `--format stage2` on a list of machines that includes KVM.
    pub fn check_backends(self, list: &[BackendArg]) -> Result<(), String> {
        if self != FormatArg::Ept && list.contains(&BackendArg::Kvm) {
            return Err(format!(
                "--format {} needs the simulated machine: the kvm backend runs x86 guests on this host's KVM, whose page tables are not slat's (drop --format {0}, or use --backend sim)",
                self.name()
            ));
        }
        Ok(())
    }
}

/// Engine and machine variant switches common to every simulated benchmark.
#[derive(Debug, Clone, Args)]
pub struct MachineArgs {
    /// Second-stage page-table format of the VM: `ept` (x86 EPT) or `stage2` (arm64 stage-2:
    /// break-before-make, cache maintenance of new mappings, no hardware dirty bit, so not
    /// with --dirty-tracking d-bit). Simulated machine only: the kvm backend runs x86 guests.
    #[arg(long = "format", value_enum, default_value = "ept")]
    pub format: FormatArg,
    /// Cache maintenance of new mappings: `always` (every translation fault cleans the range
    /// first) or `on-install` (only the fault that installs the leaf). Only stage2 does cache
    /// maintenance; no effect with --format ept.
    #[arg(long = "cmo", value_parser = variant::<CmoPolicy>(), default_value = "on-install")]
    pub cmo: CmoPolicy,
    /// MMU lock: `rwlock` lets faults run in parallel; `mutex` makes every fault exclusive.
    #[arg(long = "mmu-lock", value_parser = variant::<MmuLockKind>(), default_value = "rwlock")]
    pub mmu_lock: MmuLockKind,
    /// Lock-free fast page fault for write-protection and access-tracking faults.
    #[arg(long = "fast-pf", value_enum, default_value = "on")]
    pub fast_pf: Switch,
    /// Hardware Accessed/Dirty bits in EPT leaves, hardware Access-flag updates in stage2
    /// leaves (off: access tracking clears permissions on ept, the Access flag on stage2).
    #[arg(long = "ad-bits", value_enum, default_value = "on")]
    pub ad_bits: Switch,
    /// 4 KiB entries in each vCPU's software TLB (a power of two, at most 1048576).
    #[arg(long = "tlb-entries", value_parser = tlb_entries, default_value_t = DEFAULT_TLB_ENTRIES)]
    pub tlb_entries: usize,
    /// Physical CPUs the vCPU threads are scheduled on (default: all host CPUs). More vCPUs
    /// than this take turns, like an overcommitted host.
    #[arg(long = "pcpus")]
    pub pcpus: Option<usize>,
    /// Include host page faults: do not pre-fault guest RAM and baseline memory (host
    /// first-touch is very slow on a nested host, so it is pre-faulted by default).
    #[arg(long = "no-prefault")]
    pub no_prefault: bool,
}

impl MachineArgs {
    /// Bytes the simulated machine allocates for `vcpus` vCPUs' TLBs (16 bytes an entry).
    pub fn tlb_bytes(&self, vcpus: u32) -> u64 {
        // Both factors are bounded (512 vCPUs, MAX_TLB_ENTRIES): no overflow.
        vcpus as u64 * self.tlb_entries as u64 * 16
    }

    /// The engine configuration these flags select.
    pub fn vm_config(&self) -> VmConfig {
        VmConfig {
            mmu_lock: self.mmu_lock,
            fast_pf: self.fast_pf.on(),
            ad_bits: self.ad_bits.on(),
            cmo: self.cmo,
            ..VmConfig::default()
        }
    }
}

/// Dirty-logging variant switches.
#[derive(Debug, Clone, Args)]
pub struct DirtyArgs {
    /// How GET_DIRTY_LOG snapshots the bitmap when it clears it (with `-g`): per-word `xchg`,
    /// or `switch` (swap in a second bitmap, then read the old one without atomics), both
    /// reading only the words slat's summary levels name; `xchg-full` and `switch-full` read
    /// every word of the slot as KVM's loops do (`xchg-full` also zeroes the second bitmap
    /// first, KVM's memset).
    #[arg(long = "get-dirty-log", value_parser = variant::<GetLogVariant>(), default_value = "xchg")]
    pub get_log: GetLogVariant,
    /// Split huge leaves when logging is enabled (off: split lazily at the first write).
    #[arg(long = "eager-split", value_enum, default_value = "on")]
    pub eager_split: Switch,
    /// How huge leaves come back when logging is disabled: `inplace` (each table replaced by
    /// a huge leaf), `zap` (faults rebuild them), or `on-fault` (tables stay; a later
    /// translation fault in the range rebuilds the huge leaf).
    #[arg(long = "recover", value_parser = variant::<RecoverVariant>(), default_value = "inplace")]
    pub recover: RecoverVariant,
    /// Order of a table-to-block rebuild under break-before-make (--recover inplace or
    /// on-fault): `break-first` (the entry stays invalid while the old tables are freed) or
    /// `install-first` (invalid only across the flush). Only stage2 breaks before make; no
    /// effect with --format ept.
    #[arg(long = "rebuild", value_parser = variant::<RebuildOrder>(), default_value = "install-first")]
    pub rebuild: RebuildOrder,
    /// How logged slots see writes: `write-protect` (a fault per first write) or `d-bit`
    /// (hardware dirty bits, PML-like).
    #[arg(long = "dirty-tracking", value_parser = variant::<DirtyTrack>(), default_value = "write-protect")]
    pub tracking: DirtyTrack,
    /// How harvests and enable-logging find the pages they write-protect (lockless write-protect through the reverse map): `walk`
    /// (the page-table walk under the MMU lock), `rmap` (reverse-map lookups, same lock, one per
    /// leaf table), `rmap-each` (one reverse-map lookup per page, same lock: KVM's legacy MMU) or
    /// `rmap-lockless` (reverse-map lookups and one compare-and-swap each, no MMU lock).
    #[arg(long = "wrprot", value_parser = variant::<WrprotVariant>(), default_value = "walk")]
    pub wrprot: WrprotVariant,
}

impl DirtyArgs {
    /// Applies these switches to an engine configuration.
    pub fn apply(&self, c: VmConfig) -> VmConfig {
        VmConfig {
            get_log: self.get_log,
            eager_split: self.eager_split.on(),
            recover: self.recover,
            rebuild: self.rebuild,
            dirty_track: self.tracking,
            wrprot: self.wrprot,
            ..c
        }
    }

    /// Refuses combinations the engine cannot run, with the flag to change.
    pub fn check(&self, c: &VmConfig, format: FormatArg, dirty_ring: bool) -> Result<(), String> {
        if self.tracking == DirtyTrack::HardwareDirty && !format.info().hardware_dirty {
            // The engine would quietly write-protect instead; a d-bit figure would be a lie.
            return Err(format!(
                "--dirty-tracking d-bit needs a hardware dirty bit, which --format {} does not have (use --dirty-tracking write-protect, or --format ept)",
                format.name()
            ));
        }
        if self.tracking == DirtyTrack::HardwareDirty && !c.ad_bits {
            return Err(
                "--dirty-tracking d-bit needs hardware dirty bits: drop --ad-bits off".into(),
            );
        }
        if self.tracking == DirtyTrack::HardwareDirty && dirty_ring {
            return Err("--dirty-tracking d-bit logs into bitmaps only: drop --dirty-ring or use --dirty-tracking write-protect".into());
        }
        Ok(())
    }
}

/// The machine a benchmark runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The simulated machine: vCPU threads through slat's page tables.
    Sim,
    /// The host's /dev/kvm: the same workload as real guests (slat-kvm).
    Kvm,
}

impl BackendArg {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendArg::Sim => "sim",
            BackendArg::Kvm => "kvm",
        }
    }
}

/// Checks a `--backend` list (each machine at most once) and, when it includes `kvm`, that no
/// engine-only flag in `engine_only` (the flags set to a non-default value) was given.
pub fn check_backends(list: &[BackendArg], engine_only: &[&str]) -> Result<(), String> {
    for (i, b) in list.iter().enumerate() {
        if list[..i].contains(b) {
            return Err(format!("--backend lists `{}` twice", b.name()));
        }
    }
    if list.contains(&BackendArg::Kvm) && !engine_only.is_empty() {
        let (flags, verb, it) = match engine_only {
            [one] => (one.to_string(), "applies", "it"),
            many => (many.join(", "), "apply", "them"),
        };
        return Err(format!(
            "{flags} {verb} only to the simulated engine, which --backend kvm does not run (drop {it}, or use --backend sim)"
        ));
    }
    Ok(())
}

impl MachineArgs {
    /// Refuses a `--backend` list these flags cannot run on: a machine twice, `--format
    /// stage2` with kvm, or kvm with any engine-only flag of this group or of `more`.
    pub fn check_backends(&self, list: &[BackendArg], more: &[&'static str]) -> Result<(), String> {
        self.format.check_backends(list)?;
        let mut engine_only = self.engine_only();
        engine_only.extend(more);
        check_backends(list, &engine_only)
    }

    /// The engine-only flags of this group set to a non-default value.
    pub fn engine_only(&self) -> Vec<&'static str> {
        given(&[
            (self.mmu_lock != MmuLockKind::RwLock, "--mmu-lock"),
            (!self.fast_pf.on(), "--fast-pf"),
            (!self.ad_bits.on(), "--ad-bits"),
            (self.tlb_entries != DEFAULT_TLB_ENTRIES, "--tlb-entries"),
            (self.pcpus.is_some(), "--pcpus"),
            (self.cmo != CmoPolicy::OnInstall, "--cmo"),
        ])
    }
}

impl DirtyArgs {
    /// The engine-only flags of this group set to a non-default value.
    pub fn engine_only(&self) -> Vec<&'static str> {
        given(&[
            (self.get_log != GetLogVariant::Xchg, "--get-dirty-log"),
            (!self.eager_split.on(), "--eager-split"),
            (self.recover != RecoverVariant::InPlace, "--recover"),
            (
                self.tracking != DirtyTrack::WriteProtect,
                "--dirty-tracking",
            ),
            (self.rebuild != RebuildOrder::InstallFirst, "--rebuild"),
            (self.wrprot != WrprotVariant::Walk, "--wrprot"),
        ])
    }
}

/// The flags of `flags` that were given.
fn given(flags: &[(bool, &'static str)]) -> Vec<&'static str> {
    flags
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, f)| *f)
        .collect()
}

/// Refuses a dirty ring the KVM machine cannot have: KVM's ring is at least one page of
/// 16-byte entries (256). `flag` names where the size came from.
pub fn check_kvm_ring(backends: &[BackendArg], entries: u32, flag: &str) -> Result<(), String> {
    if backends.contains(&BackendArg::Kvm) && entries < 256 {
        return Err(format!(
            "{flag}: a kvm dirty ring has at least 256 entries (one page), not {entries}"
        ));
    }
    Ok(())
}

/// Parses a dirty ring size: a power of two from 128 to 65536 entries.
pub fn ring_size(s: &str) -> Result<u32, String> {
    let v: u32 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a positive integer"))?;
    if !v.is_power_of_two() || !(128..=65536).contains(&v) {
        return Err(format!(
            "`{s}`: a dirty ring holds a power of two from 128 to 65536 entries"
        ));
    }
    Ok(v)
}

/// How a benchmark's results are reported: shared by every benchmark subcommand.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Print one JSON document with every figure instead of the text report (with the schema
    /// version, the slat version and the host facts the numbers depend on).
    #[arg(long)]
    pub json: bool,
    /// Run the benchmark N times in this process (each --vary row and each --backend machine
    /// N times) and add the median, minimum, maximum and spread ((max - min) / median) of every
    /// headline figure, in text and JSON (1-1000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000), default_value_t = 1)]
    pub repeat: u32,
    /// Also draw the figures into an SVG file (checked writable before the run starts). One
    /// configuration: its lines (dirty-log-perf: the dirty, harvest and native time of every
    /// iteration; migrate and migrate-perf: pages sent and still owed, and the throttle, per
    /// round), with --repeat the median and a band from the minimum to the maximum; a benchmark
    /// without lines draws bars of its headline figures (private-mem-perf: per fill or
    /// variant). --vary and --backend sim,kvm: bars of the headline figures per row or machine,
    /// with min-max error bars over the --repeat runs. dirty-log-test (a correctness check) and
    /// migrate-listen refuse it.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
}

impl OutputArgs {
    /// The flags the driver reads, with a benchmark's `--backend` and `--vary`.
    pub fn common<'a>(&'a self, backends: &'a [BackendArg], vary: &'a [Vary]) -> Common<'a> {
        Common {
            backends,
            vary,
            out: self,
        }
    }

    /// Refuses a `--plot` file this process cannot write, before the benchmark runs (the
    /// plot is drawn at the end: a bad path would throw the whole run away).
    pub fn check_paths(&self) -> crate::error::CliResult {
        match &self.plot {
            Some(p) => check_writable("--plot", p),
            None => Ok(()),
        }
    }
}

/// Refuses (exit status 2) an output file `flag` names that cannot be opened for writing.
/// Opens it without truncating, and removes it again if this check created it, so a run
/// refused later leaves no empty file behind and an existing one keeps its contents.
pub fn check_writable(flag: &str, path: &std::path::Path) -> crate::error::CliResult {
    let existed = std::fs::symlink_metadata(path).is_ok();
    let opened = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path);
    match opened {
        Ok(_) => {
            if !existed {
                let _ = std::fs::remove_file(path);
            }
            Ok(())
        }
        Err(e) => Err(crate::error::CliError::bad(format!(
            "{flag}: cannot write {}: {e}",
            path.display()
        ))),
    }
}

/// The guest and its memory: flags shared by every benchmark that runs vCPUs over a
/// partitioned guest memory (page-table-test has its own: there all vCPUs share one region).
#[derive(Debug, Clone, Args)]
pub struct Workload {
    /// vCPUs, each a thread working on its own partition of guest memory (all of it with -o).
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub vcpus: u32,
    /// Guest memory per vCPU: bytes with an optional k/m/g/t suffix (powers of 1024), a
    /// multiple of 4 KiB.
    #[arg(short = 'b', value_parser = guest_size, default_value = "1G")]
    pub bytes: u64,
    /// Host memory behind guest RAM: anonymous, anonymous_thp, anonymous_hugetlb (2 MiB pages),
    /// anonymous_hugetlb_1gb, shmem;
    /// phantom, phantom_thp, phantom_hugetlb_1gb (sim only: an address range with no memory
    /// behind it, leaves as anonymous, anonymous_thp, anonymous_hugetlb_1gb; data goes to 64
    /// shared frames and is not kept, so guests beyond the host's memory fit; commands that
    /// read data back refuse it).
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// Overlap: every vCPU works on all of guest memory instead of its own partition.
    #[arg(short = 'o')]
    pub overlap: bool,
}

impl Workload {
    /// Sizes the machines on `backends` can hold: `-v` × (`-b` + `extra` bytes) without
    /// overflow, in the guest physical address space of each machine, and `copies` mappings
    /// of it at once on this host (the guest, a baseline, a snapshot); `-s` on each machine.
    pub fn check_fits(
        &self,
        backends: &[BackendArg],
        machine: &MachineArgs,
        extra: u64,
        copies: u64,
    ) -> Result<GuestMemory, String> {
        check_backing(backends, self.backing)?;
        let mem = GuestMemory::per_vcpu_plus(self.vcpus, self.bytes, extra)?;
        mem.fits_gpa(backends, machine.format, None)?;
        mem.fits_host(self.backing, copies, machine.tlb_bytes(self.vcpus))?;
        Ok(mem)
    }

    /// These flags as a report's `config` records them.
    pub fn settings(&self) -> crate::output::WorkSettings {
        crate::output::WorkSettings {
            vcpus: self.vcpus,
            bytes_per_vcpu: self.bytes,
            backing: self.backing.name(),
            overlap: Some(self.overlap),
        }
    }

    /// The test region of these flags: one memslot, pre-faulted unless `--no-prefault`.
    pub fn region(&self, machine: &MachineArgs, dirty: DirtyConfig) -> RegionSpec {
        RegionSpec {
            backing: self.backing,
            vcpus: self.vcpus as usize,
            bytes_per_vcpu: self.bytes,
            slots: 1,
            overlap: self.overlap,
            // Phantom memory has nothing to populate.
            prefault: !machine.no_prefault && !self.backing.is_phantom(),
            dirty,
        }
    }
}

/// A `-c` CPU list as given (`0,1,3-5`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

/// Parses a `-c` CPU list.
pub fn cpu_list(s: &str) -> Result<CpuList, String> {
    slat_workload::cpus::parse_cpu_list(s)
        .map(CpuList)
        .map_err(|e| e.to_string())
}

/// vCPU pinning (the selftests' `-c`).
#[derive(Debug, Clone, Args)]
pub struct PinArgs {
    /// Pin vCPU i's thread to the i-th host CPU of this list with sched_setaffinity, as the
    /// selftests' -c: CPU numbers and inclusive ranges (`0,1,3-5`), one per vCPU; one more
    /// entry pins the main (benchmark-driving) thread too. Each CPU must be online and allowed
    /// for this process. Pins the vCPU threads of either machine (`sim`: the threads that run
    /// the simulated vCPUs, which still share --pcpus simulated physical CPUs; `kvm`: the
    /// threads that enter the guest with KVM_RUN).
    #[arg(short = 'c', value_name = "CPU_LIST", value_parser = cpu_list)]
    pub cpus: Option<CpuList>,
    /// Guest mode, numbered as the selftests' -m: only 0 (PA-bits:48, VA-bits:48, 4K pages),
    /// the one mode the selftests run on x86; their other modes are arm64 guests, which
    /// neither machine runs (--format stage2 is slat's arm64 page-table format, not a guest
    /// mode).
    #[arg(short = 'm', value_name = "MODE", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=0))]
    pub mode: u32,
}

impl PinArgs {
    /// Checks the list for `vcpus` vCPUs against this host.
    pub fn plan(&self, vcpus: u32) -> Result<Option<slat_workload::cpus::PinPlan>, String> {
        self.cpus
            .as_ref()
            .map(|l| slat_workload::cpus::PinPlan::new(&l.0, vcpus as usize))
            .transpose()
            .map_err(|e| e.to_string())
    }
}

/// How dirty-log-perf logs and harvests: GET that clears, GET + CLEAR (manual protect) in
/// chunks, or per-vCPU dirty rings.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Do not enable manual dirty-log protection: GET_DIRTY_LOG clears and re-protects, and
    /// there is no CLEAR step.
    #[arg(short = 'g')]
    pub no_manual: bool,
    /// Log into per-vCPU dirty rings of N entries (a power of two, 128-65536) instead of
    /// bitmaps: "get dirty log" harvests the rings, "reset dirty rings" re-protects.
    #[arg(long = "dirty-ring", value_parser = ring_size)]
    pub dirty_ring: Option<u32>,
    /// Pages per CLEAR_DIRTY_LOG call under manual protect: a power of two from 64 (KVM's
    /// unit: CLEAR takes whole 64-page words) or `slot` for one call per memslot. A migration
    /// that re-protects a chunk just before copying it clears in small chunks.
    #[arg(long = "clear-chunk", value_parser = clear_chunk, default_value = "slot")]
    pub clear_chunk: ClearChunk,
}

/// Pages per CLEAR_DIRTY_LOG call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearChunk {
    /// One call per memslot.
    Slot,
    /// This many pages per call (a power of two, at least 64).
    Pages(u64),
}

impl ClearChunk {
    /// As written on the command line.
    pub fn name(self) -> String {
        match self {
            ClearChunk::Slot => "slot".into(),
            ClearChunk::Pages(n) => n.to_string(),
        }
    }

    /// Pages per call for a slot of `pages_per_slot` pages (at least 1).
    pub fn pages(self, pages_per_slot: u64) -> u64 {
        match self {
            ClearChunk::Slot => pages_per_slot.max(1),
            ClearChunk::Pages(n) => n.min(pages_per_slot).max(1),
        }
    }
}

/// The largest chunk accepted: 2^40 pages (4 PiB) is past any slot either machine holds.
const MAX_CLEAR_CHUNK: u64 = 1 << 40;

/// Parses `--clear-chunk`.
pub fn clear_chunk(s: &str) -> Result<ClearChunk, String> {
    if s == "slot" {
        return Ok(ClearChunk::Slot);
    }
    match s.parse::<u64>() {
        Ok(n) if n.is_power_of_two() && (64..=MAX_CLEAR_CHUNK).contains(&n) => {
            Ok(ClearChunk::Pages(n))
        }
        _ => Err(format!(
            "`{s}`: pages per CLEAR_DIRTY_LOG are a power of two from 64 to 2^40, or `slot`"
        )),
    }
}

/// How the log is harvested, as one choice (`--vary log=get,clear,ring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogKind {
    /// GET_DIRTY_LOG clears and re-protects (`-g`).
    Get,
    /// Manual protect: GET copies, CLEAR re-protects (in `--clear-chunk` pages).
    Clear,
    /// Per-vCPU dirty rings (`--dirty-ring`, 4096 entries unless given).
    Ring,
}

/// Ring entries when `--vary log=ring` is asked for without `--dirty-ring`.
pub const DEFAULT_RING_ENTRIES: u32 = 4096;

impl LogArgs {
    /// The harvest these flags select.
    pub fn kind(&self) -> LogKind {
        match (self.dirty_ring, self.no_manual) {
            (Some(_), _) => LogKind::Ring,
            (None, true) => LogKind::Get,
            (None, false) => LogKind::Clear,
        }
    }

    /// Selects a harvest, keeping the ring size and chunk given.
    pub fn set_kind(&mut self, k: LogKind) {
        match k {
            LogKind::Get => (self.no_manual, self.dirty_ring) = (true, None),
            LogKind::Clear => (self.no_manual, self.dirty_ring) = (false, None),
            LogKind::Ring => {
                self.no_manual = false;
                self.dirty_ring = Some(self.dirty_ring.unwrap_or(DEFAULT_RING_ENTRIES));
            }
        }
    }

    /// Refuses a chunk size where there is no CLEAR step.
    pub fn check(&self) -> Result<(), String> {
        if self.clear_chunk != ClearChunk::Slot && self.kind() != LogKind::Clear {
            return Err("--clear-chunk sizes CLEAR_DIRTY_LOG calls, which only manual protect makes: drop it, or drop -g / --dirty-ring".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod log_tests {
    use super::*;

    #[test]
    fn clear_chunks_parse_and_clamp() {
        assert_eq!(clear_chunk("slot"), Ok(ClearChunk::Slot));
        assert_eq!(clear_chunk("64"), Ok(ClearChunk::Pages(64)));
        for bad in ["0", "32", "100", "-64", "x", "", "2199023255552"] {
            assert!(clear_chunk(bad).is_err(), "{bad}");
        }
        assert_eq!(ClearChunk::Pages(4096).pages(512), 512);
        assert_eq!(ClearChunk::Slot.pages(0), 1);
    }

    #[test]
    fn log_kinds_round_trip() {
        let mut l = LogArgs {
            no_manual: false,
            dirty_ring: Some(256),
            clear_chunk: ClearChunk::Slot,
        };
        for k in [LogKind::Get, LogKind::Clear, LogKind::Ring] {
            l.set_kind(k);
            assert_eq!(l.kind(), k);
        }
        assert_eq!(l.dirty_ring, Some(DEFAULT_RING_ENTRIES));
        l.clear_chunk = ClearChunk::Pages(64);
        assert!(l.check().is_err());
        l.set_kind(LogKind::Clear);
        assert!(l.check().is_ok());
    }
}
