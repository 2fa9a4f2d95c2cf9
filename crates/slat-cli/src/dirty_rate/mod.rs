//! `slat dirty-rate`: how fast a running guest dirties its memory, measured from the dirty log
//! alone and without migrating anything (QEMU's `calc-dirty-rate` / `query-dirty-rate`).
//!
//! The measurement is `slat_dirty::dirty_rate::DirtyRate` over the machine's log
//! (`slat_harness::MachineLog`); this file builds the machine, runs a guest whose dirty rate
//! is known where the machine can pace one, and renders the typed report (text, or `--json`
//! through `output.rs`).
//!
//! **The known rate** (the flags' long help says how it is known): the simulated machine paces
//! its guest (`slat_machine::paced`). The KVM guest's code has no rate control (migration's
//! burst driver only gets the *write* count right on average, and writes pseudo-random pages,
//! so its distinct-page rate is not known either): there the report has no expectation.

mod text;
use text::{print_head, print_run, print_summary, sample_line};

use crate::args::{
    backing, check_kvm_ring, guest_size, ring_size, BackendArg, DirtyArgs, MachineArgs, OutputArgs,
    Workload as WorkArgs, DEFAULT_RING_ENTRIES,
};
use crate::backend::{self, dirty_config, CliMachine, OnMachine, Spec};
use crate::driver::Benchmark;
use crate::error::{CliError, CliResult};
use crate::output::{
    format_name, print_json, summarize, AllRuns, Metric, MetricSummary, VmSettings, WorkSettings,
};
use crate::report::{per, quiet, runtime};
use clap::{Args, ValueEnum};
use serde::Serialize;
use slat_addr::PAGE_SIZE;
use slat_dirty::dirty_rate::{Attribution, DirtyRate, Measurement, Sample, SampleWindow};
use slat_harness::MachineLog;
use slat_workload::{format_size, Backing, PassParams, TestMachine};
use std::io::Write;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

const NAME: &str = "dirty-rate";

/// Most writes per second per vCPU `--write-rate` takes: far beyond what a vCPU writes, and
/// far from the arithmetic limits of the pacing.
const MAX_WRITE_RATE: u64 = 1_000_000_000;

/// How long the guest runs before the first window: the pacer's bucket and the vCPUs' first
/// faults settle.
const WARMUP: Duration = Duration::from_millis(100);

/// Per-vCPU columns in the text table of samples (more vCPUs: the per-vCPU table only).
const MAX_SAMPLE_COLUMNS: usize = 8;

/// Flags of `slat dirty-rate`.
#[derive(Debug, Clone, Args)]
#[command(after_long_help = "\
What is measured: DISTINCT pages dirtied per second. Each sample window re-arms the dirty log \
and counts the pages it reports at the window's end, so a page written many times in a window \
counts once (the log has one bit, or one ring entry, per page) - the pages a migration would \
have to send again. A guest rewriting a small hot set has a low dirty rate whatever its store \
rate.

The expected column: on --backend sim the guest is a paced sequential writer, each vCPU \
writing its own region at --write-rate pages per second, one write per page per pass; while a \
pass does not wrap within a window, distinct pages per second = the write rate. With -b too \
small for a window's writes the expectation is capped at the region's pages per window. The \
kvm guest has no rate control: it runs memstress passes as fast as it can, and the report has \
no expected column.

Per vCPU: in ring mode each ring entry names its vCPU (a page is credited to the first vCPU \
that logged it in the window; entries a source cannot attribute are counted as unattributed). \
In bitmap mode a bitmap does not say who wrote a page; the figures come from the \
layout, since each vCPU writes only its own region here.")]
pub struct DirtyRateArgs {
    /// The machine(s): `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` (one after the other).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    /// How the log is read: `bitmap` (GET_DIRTY_LOG + CLEAR_DIRTY_LOG with manual protect,
    /// counting set bits) or `ring` (per-vCPU dirty rings: collect, count distinct pages per
    /// vCPU, reset).
    #[arg(long, value_enum, default_value = "bitmap")]
    pub mode: RateMode,
    /// Length of one sample window in milliseconds (10-60000).
    #[arg(long = "sample-ms", value_name = "MS", value_parser = sample_ms, default_value = "1000")]
    pub sample: SampleWindow,
    /// Sample windows, back to back (1-1000); the rate is their pages over their time.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000), default_value_t = 3)]
    pub samples: u32,
    /// vCPUs, each writing its own region of guest memory (1-512).
    #[arg(short = 'v', long = "vcpus", value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub vcpus: u32,
    /// Guest memory per vCPU: bytes with an optional k/m/g/t suffix (powers of 1024), a
    /// multiple of 4 KiB. Make it at least the write rate x the window x 4 KiB, or the
    /// writer wraps within a window and the expectation is capped.
    #[arg(short = 'b', value_parser = guest_size, default_value = "256M")]
    pub bytes: u64,
    /// Host memory behind guest RAM: anonymous, anonymous_thp, anonymous_hugetlb,
    /// anonymous_hugetlb_1gb, shmem;
    /// phantom, phantom_thp, phantom_hugetlb_1gb (sim only: an address range with no memory
    /// behind it, leaves as anonymous, anonymous_thp, anonymous_hugetlb_1gb; data goes to 64
    /// shared frames and is not kept, so guests beyond the host's memory fit; commands that
    /// read data back refuse it).
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// The guest's writes per second per vCPU (k/m suffixes, at most 10^9) or `unlimited`.
    /// Default: 10k on sim. The kvm guest has no rate control: only `unlimited` there (the
    /// default).
    #[arg(long = "write-rate", value_name = "PAGES_PER_S", value_parser = write_rate)]
    pub write_rate: Option<WriteRate>,
    /// Entries per vCPU dirty ring in ring mode (a power of two, 128-65536; kvm: at least
    /// 256). Default 4096. A ring that fills within a window makes the vCPU exit and the
    /// machine reap every ring (the entries keep their vCPU).
    #[arg(long = "dirty-ring", value_name = "N", value_parser = ring_size)]
    pub dirty_ring: Option<u32>,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub dirty: DirtyArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// How the log is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RateMode {
    /// Dirty bitmaps: GET + CLEAR (manual protect).
    Bitmap,
    /// Per-vCPU dirty rings.
    Ring,
}

impl RateMode {
    fn name(self) -> &'static str {
        match self {
            RateMode::Bitmap => "bitmap",
            RateMode::Ring => "ring",
        }
    }
}

/// `--write-rate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteRate {
    /// As fast as the guest writes.
    Unlimited,
    /// Writes per second per vCPU (1 to [`MAX_WRITE_RATE`]).
    PerSecond(u64),
}

/// Parses `--sample-ms`.
fn sample_ms(s: &str) -> Result<SampleWindow, String> {
    let ms: u64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of milliseconds"))?;
    SampleWindow::from_millis(ms).map_err(|e| e.to_string())
}

/// Parses `--write-rate`: `unlimited` or a positive count with an optional k/m suffix.
fn write_rate(s: &str) -> Result<WriteRate, String> {
    let t = s.trim().to_ascii_lowercase();
    if t == "unlimited" {
        return Ok(WriteRate::Unlimited);
    }
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1_000u64),
        Some('m') => (&t[..t.len() - 1], 1_000_000),
        _ => (&t[..], 1),
    };
    match num.parse::<u64>().ok().and_then(|n| n.checked_mul(mul)) {
        Some(n) if (1..=MAX_WRITE_RATE).contains(&n) => Ok(WriteRate::PerSecond(n)),
        _ => Err(format!(
            "`{s}`: writes per second per vCPU are 1 to 10^9 (k and m suffixes), or `unlimited`"
        )),
    }
}

/// The sim guest's default rate: low enough for a 2-core host to sustain with the host thread
/// beside it, high enough to dirty thousands of pages per window.
const DEFAULT_SIM_RATE: u64 = 10_000;

impl DirtyRateArgs {
    /// The writer's rate on `kind`: writes per second per vCPU, `None` for unlimited.
    fn rate_on(&self, kind: BackendArg) -> Option<u64> {
        match (self.write_rate, kind) {
            (Some(WriteRate::PerSecond(n)), _) => Some(n),
            (Some(WriteRate::Unlimited), _) | (None, BackendArg::Kvm) => None,
            (None, BackendArg::Sim) => Some(DEFAULT_SIM_RATE),
        }
    }

    fn ring_entries(&self) -> u32 {
        match self.mode {
            RateMode::Ring => self.dirty_ring.unwrap_or(DEFAULT_RING_ENTRIES),
            RateMode::Bitmap => 0,
        }
    }
}

/// The run's settings, as the report records them.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    #[serde(flatten)]
    pub vm: VmSettings,
    #[serde(flatten)]
    pub work: WorkSettings,
    pub mode: &'static str,
    /// How the log was read: `get+clear` (manual protect) or `ring`.
    pub log: &'static str,
    /// Ring entries per vCPU (`null` in bitmap mode).
    pub ring_entries: Option<u32>,
    pub sample_ms: u64,
    pub samples: u32,
    /// The writer's rate per vCPU (`null`: unlimited).
    pub write_rate_per_vcpu: Option<u64>,
}

/// The guest that ran, and whether its dirty rate is known.
#[derive(Debug, Clone, Serialize)]
pub struct GuestWorkload {
    /// `paced-sequential` (sim) or `memstress-loop` (kvm).
    pub kind: &'static str,
    pub known_rate: bool,
    /// Why the rate is or is not known, in words.
    pub note: String,
}

/// One window.
#[derive(Debug, Clone, Serialize)]
pub struct SampleRow {
    pub index: usize,
    pub window_s: f64,
    pub pages: u64,
    pub pages_per_s: f64,
    pub mib_per_s: f64,
    /// Each vCPU's pages per second (empty without per-vCPU figures).
    pub vcpu_pages_per_s: Vec<f64>,
    pub unattributed_pages: u64,
}

/// One vCPU's rate over the measurement.
#[derive(Debug, Clone, Serialize)]
pub struct VcpuRate {
    pub vcpu: usize,
    pub pages_per_s: f64,
    /// What the workload should show (`null`: not known).
    pub expected_pages_per_s: Option<f64>,
    pub ratio: Option<f64>,
}

/// One run on one machine.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub backend: &'static str,
    /// The page-table format (`null` on kvm).
    pub format: Option<&'static str>,
    pub config: Config,
    pub workload: GuestWorkload,
    /// Where the per-vCPU figures come from: `ring` (entries name their vCPU) or `region`
    /// (bitmap mode: each vCPU writes only its own region).
    pub per_vcpu_by: &'static str,
    /// The windows, in order.
    pub samples: Vec<SampleRow>,
    /// Distinct pages per second over all windows (their pages over their time).
    pub pages_per_s: f64,
    pub mib_per_s: f64,
    pub min_sample_pages_per_s: f64,
    pub max_sample_pages_per_s: f64,
    /// What the workload should show, all vCPUs (`null`: not known).
    pub expected_pages_per_s: Option<f64>,
    pub ratio_measured_over_expected: Option<f64>,
    /// The expectation is capped: the region is smaller than a window's writes.
    pub expected_capped: bool,
    /// The guest's own count of writes per second over its whole run (every write, not
    /// distinct pages).
    pub guest_writes_per_s: Option<f64>,
    /// Pages credited to no vCPU, over all windows.
    pub unattributed_pages: u64,
    /// Every window saw every page of guest memory dirty: the guest dirties memory at least
    /// this fast, perhaps faster (a larger -b or a shorter --sample-ms tells).
    pub saturated: bool,
    pub per_vcpu: Vec<VcpuRate>,
}

/// The headline over `--repeat` runs, per machine.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub backend: &'static str,
    pub pages_per_s: MetricSummary,
    pub ratio_measured_over_expected: MetricSummary,
}

/// The document: every run (backends × repeats) and the summary.
pub type Report = AllRuns<Run, Summary>;

const RATE: Metric<Run> = Metric::higher("dirty rate", "pages/s", |r| Some(r.pages_per_s));
const RATIO: Metric<Run> =
    Metric::higher("measured/expected", "x", |r| r.ratio_measured_over_expected);

impl Benchmark for DirtyRateArgs {
    type Report = Run;
    const NAME: &'static str = NAME;
    crate::forward_benchmark! { vary: no, check: check, measure: on_machine, print: print_run }

    fn metrics(&self) -> Vec<Metric<Run>> {
        vec![RATE, RATIO]
    }

    fn own_output(&self) -> Option<fn(&Self, Vec<(BackendArg, Vec<Run>)>) -> CliResult> {
        Some(finish)
    }
}

/// The one document of every machine's runs, or the summary under the runs' text.
fn finish(a: &DirtyRateArgs, all: Vec<(BackendArg, Vec<Run>)>) -> CliResult {
    let summarize_each = |all: &[(BackendArg, Vec<Run>)]| {
        let each = all.iter().map(|(b, mine)| Summary {
            backend: b.name(),
            pages_per_s: summarize(&RATE, mine),
            ratio_measured_over_expected: summarize(&RATIO, mine),
        });
        each.collect()
    };
    let report = Report::new(NAME, &a.out, all, summarize_each);
    if a.out.json {
        return print_json(&report, &a.backend);
    }
    if report.runs.len() > 1 {
        print_summary(&report);
    }
    Ok(())
}

/// Refuses what cannot run, with the flag to change (exit status 2).
fn check(a: &DirtyRateArgs) -> Result<(), String> {
    a.machine
        .check_backends(&a.backend, &a.dirty.engine_only())?;
    let vm = a.dirty.apply(a.machine.vm_config());
    a.dirty
        .check(&vm, a.machine.format, a.mode == RateMode::Ring)
        .map_err(|e| format!("--mode {}: {e}", a.mode.name()))?;
    if a.dirty_ring.is_some() && a.mode != RateMode::Ring {
        return Err(
            "--dirty-ring sizes the rings of --mode ring: drop it, or add --mode ring".into(),
        );
    }
    if a.mode == RateMode::Ring {
        check_kvm_ring(&a.backend, a.ring_entries(), "--dirty-ring")?;
    }
    if let Some(WriteRate::PerSecond(_)) = a.write_rate {
        if a.backend.contains(&BackendArg::Kvm) {
            return Err("--write-rate: the kvm guest has no write-rate control (it runs memstress passes as fast as it can); drop --write-rate to measure it anyway, with no expected rate".into());
        }
    }
    a.work().check_fits(&a.backend, &a.machine, 0, 1).map(drop)
}

impl DirtyRateArgs {
    /// `-v`, `-b` and `-s` as the shared flags: each vCPU writes its own region.
    fn work(&self) -> WorkArgs {
        let (vcpus, bytes, backing) = (self.vcpus, self.bytes, self.backing);
        WorkArgs {
            vcpus,
            bytes,
            backing,
            overlap: false,
        }
    }
}

/// Builds machine `kind` and measures it.
fn on_machine(a: &DirtyRateArgs, kind: BackendArg) -> CliResult<Run> {
    let dirty = dirty_config(a.mode == RateMode::Bitmap, a.ring_entries());
    let region = a.work().region(&a.machine, dirty);
    let spec = Spec::new(&a.machine, region, a.dirty.apply(a.machine.vm_config()));
    let rate = a.rate_on(kind);
    let workload = match (kind, rate) {
        (BackendArg::Kvm, _) => GuestWorkload {
            kind: "memstress-loop",
            known_rate: false,
            note: "the kvm guest has no write-rate control: it runs memstress passes back to back as fast as it can, so no expected rate".into(),
        },
        (BackendArg::Sim, Some(r)) => GuestWorkload {
            kind: "paced-sequential",
            known_rate: true,
            note: format!("paced sequential writer, {r} writes/s per vCPU, one write per page per pass: distinct pages/s = the write rate while a pass does not wrap within a window"),
        },
        (BackendArg::Sim, None) => GuestWorkload {
            kind: "paced-sequential",
            known_rate: false,
            note: "paced sequential writer, unlimited: as fast as the simulated vCPUs write, so no expected rate".into(),
        },
    };
    backend::visit(
        kind,
        &spec,
        Bench {
            a,
            kind,
            workload,
            rate,
        },
    )
}

/// Pages per second as MiB per second.
fn mib(pages_per_s: f64) -> f64 {
    pages_per_s * PAGE_SIZE as f64 / (1u64 << 20) as f64
}

/// One machine's measurement: the guest `workload`, paced at `rate` writes per second per
/// vCPU where it is paced.
struct Bench<'a> {
    a: &'a DirtyRateArgs,
    kind: BackendArg,
    workload: GuestWorkload,
    rate: Option<u64>,
}

/// The guest's passes: every page written once, in order.
const WRITE_ALL: PassParams = PassParams {
    write_percent: 100,
    random: false,
    seed: 1,
    timed: false,
    touches: None,
};

impl OnMachine for Bench<'_> {
    type Out = Run;

    /// Populates the region, turns logging on, starts the guest, measures, stops the guest
    /// (also when the measurement failed) and builds the report.
    fn run<M: TestMachine + CliMachine>(self, m: &M) -> CliResult<Run> {
        let (a, rate, workload) = (self.a, self.rate, &self.workload);
        let l = m.layout();
        // First touch outside the measurement: windows then see write-protection faults of
        // mapped pages, the steady state of a running guest. Then dirty logging goes on.
        m.run_pass(WRITE_ALL).map_err(runtime)?;
        m.set_dirty_logging(true).map_err(runtime)?;
        if !a.out.json {
            print_head(a, self.kind, workload);
        }
        let t0 = Instant::now();
        CliMachine::start_writer(m, WRITE_ALL, rate)?;
        let measured = measure(a, m);
        // Stop the guest whatever happened; its report counts the guest's own writes.
        let halted = m.halt().map_err(runtime);
        let ran = t0.elapsed().as_secs_f64();
        let _ = m.set_dirty_logging(false);
        let (measurement, halted) = (measured?, halted?);
        let writes_per_s = (ran > 0.0).then(|| halted.pages() as f64 / ran);

        let window = a.sample.duration().as_secs_f64();
        let pages_per_vcpu = l.bytes_per_vcpu / PAGE_SIZE;
        // A window of writes beyond the region wraps: every page once per window.
        let capped = rate.is_some_and(|r| r as f64 * window > pages_per_vcpu as f64);
        let vcpu_expected = rate.map(|r| (r as f64).min(pages_per_vcpu as f64 / window));
        let expected = vcpu_expected.map(|e| e * a.vcpus as f64);
        let per_vcpu_by = match measurement.attribution {
            Attribution::Ring => "ring",
            Attribution::Regions => "region",
            Attribution::None => "none",
        };
        let pages_per_s = measurement.pages_per_s();
        let rates: Vec<f64> = measurement
            .samples
            .iter()
            .map(Sample::pages_per_s)
            .collect();
        let per_vcpu = measurement
            .vcpu_pages_per_s()
            .into_iter()
            .enumerate()
            .map(|(vcpu, p)| VcpuRate {
                vcpu,
                pages_per_s: p,
                expected_pages_per_s: vcpu_expected,
                ratio: vcpu_expected.and_then(|e| per(p, e)),
            })
            .collect();
        Ok(Run {
            backend: self.kind.name(),
            format: format_name(self.kind, a.machine.format),
            config: config(a, self.kind, rate),
            workload: self.workload,
            per_vcpu_by,
            samples: measurement
                .samples
                .iter()
                .enumerate()
                .map(|(i, s)| sample_row(i, s))
                .collect(),
            pages_per_s,
            mib_per_s: mib(pages_per_s),
            min_sample_pages_per_s: rates.iter().copied().fold(f64::INFINITY, f64::min),
            max_sample_pages_per_s: rates.iter().copied().fold(0.0, f64::max),
            expected_pages_per_s: expected,
            ratio_measured_over_expected: expected.and_then(|e| per(pages_per_s, e)),
            expected_capped: capped,
            guest_writes_per_s: writes_per_s,
            unattributed_pages: measurement.unattributed(),
            saturated: !measurement.samples.is_empty()
                && measurement
                    .samples
                    .iter()
                    .all(|s| s.pages >= l.total_pages()),
            per_vcpu,
        })
    }

    fn kvm_error(&self, e: slat_kvm::KvmError) -> CliError {
        match e {
            // The host cannot log this way: the flags cannot run here (exit 2).
            slat_kvm::KvmError::Unsupported { .. } => {
                CliError::BadInput(format!("--mode {} on kvm: {e}", self.a.mode.name()))
            }
            e => CliError::Runtime(e.to_string()),
        }
    }
}

/// The configuration a run reports; `rate` is the guest's paced writes per vCPU.
fn config(a: &DirtyRateArgs, kind: BackendArg, rate: Option<u64>) -> Config {
    let vm = a.dirty.apply(a.machine.vm_config());
    Config {
        vm: VmSettings::of_machine(kind, &a.machine, &vm),
        work: WorkSettings {
            overlap: None,
            ..a.work().settings()
        },
        mode: a.mode.name(),
        log: match a.mode {
            RateMode::Bitmap => "get+clear",
            RateMode::Ring => "ring",
        },
        ring_entries: (a.mode == RateMode::Ring).then(|| a.ring_entries()),
        sample_ms: a.sample.duration().as_millis() as u64,
        samples: a.samples,
        write_rate_per_vcpu: rate,
    }
}

/// The windows, each printed as it completes (text: on stdout, part of the report; JSON:
/// progress on stderr).
fn measure<M: TestMachine>(a: &DirtyRateArgs, m: &M) -> CliResult<Measurement> {
    std::thread::sleep(WARMUP);
    let mut rate = DirtyRate::new(MachineLog::new(m)).map_err(runtime)?;
    rate = match a.mode {
        RateMode::Ring => rate.with_vcpus(a.vcpus as usize),
        RateMode::Bitmap => {
            // Each vCPU writes only its own region: its pages are its own.
            let l = m.layout();
            let regions = (0..l.vcpus)
                .map(|i| {
                    let (gpa, _, pages) = l.region(i);
                    let first = (gpa - l.gpa) / PAGE_SIZE;
                    first..first + pages
                })
                .collect();
            rate.with_regions(regions).map_err(runtime)?
        }
    };
    let samples = NonZeroU32::new(a.samples).ok_or("--samples is at least 1")?;
    let (json, silent) = (a.out.json, quiet(a.out.json));
    rate.measure(a.sample, samples, |i, s| {
        let line = sample_line(i, a.samples, s);
        if !json {
            println!("{line}");
            let _ = std::io::stdout().flush();
        } else if !silent {
            eprintln!("[slat] {line}");
        }
    })
    .map_err(runtime)
}

fn sample_row(i: usize, s: &Sample) -> SampleRow {
    let p = s.pages_per_s();
    SampleRow {
        index: i + 1,
        window_s: s.window.as_secs_f64(),
        pages: s.pages,
        pages_per_s: p,
        mib_per_s: mib(p),
        vcpu_pages_per_s: (0..s.per_vcpu.len())
            .filter_map(|v| s.vcpu_pages_per_s(v))
            .collect(),
        unattributed_pages: s.unattributed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_rates_parse_and_are_bounded() {
        assert_eq!(write_rate("unlimited"), Ok(WriteRate::Unlimited));
        assert_eq!(write_rate("5k"), Ok(WriteRate::PerSecond(5000)));
        assert_eq!(write_rate("2M"), Ok(WriteRate::PerSecond(2_000_000)));
        assert_eq!(
            write_rate("1000000000"),
            Ok(WriteRate::PerSecond(MAX_WRITE_RATE))
        );
        for bad in [
            "0",
            "",
            "k",
            "-5",
            "1000000001",
            "99999999999999999999k",
            "2g",
        ] {
            assert!(write_rate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sample_times_are_bounded() {
        assert!(sample_ms("1000").is_ok());
        for bad in ["0", "9", "60001", "-1", "x", "18446744073709551616"] {
            let e = sample_ms(bad).unwrap_err();
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
