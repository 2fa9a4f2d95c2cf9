//! `slat demand-paging`: KVM's demand_paging_test — one first-touch pass over all guest
//! memory, every page faulted in through the engine (or KVM), with `-u MISSING|MINOR` each
//! first touch of the host memory behind it served by userfaultfd handler threads — and, in
//! the same run, the same pattern on host memory as the native baseline.

use crate::args::{BackendArg, MachineArgs, OutputArgs, PinArgs, Workload};
pub use crate::backend::stats_json;
use crate::backend::{self, Backend, Native, Pass, Spec};
use crate::driver::Benchmark;
use crate::error::CliResult;
use crate::mmu_memory::MmuMemoryFigures;
use crate::output::{secs, Metric, RunHead, VmSettings, WorkSettings};
use crate::report::{format_header, quiet, ratio, ts, Phase};
use crate::virtual_time::{self, ClockArgs, ClockReport, VirtualRun};
use clap::{Args, ValueEnum};
use serde::Serialize;
use slat_workload::format_size;
use slat_workload::uffd::{self, UffdMode, UffdReport, UffdServer};
use slat_workload::{DirtyConfig, PassParams, MEMSTRESS_PATTERN};
use std::time::Duration;

/// `-u`: how userfaultfd resolves first touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UffdArg {
    /// Guest RAM starts unpopulated; each first touch is a missing-page fault the handler
    /// resolves by copying in a page of 0xAB bytes (UFFDIO_COPY).
    #[value(name = "MISSING")]
    Missing,
    /// Guest RAM (shared memory, -s shmem) is filled with 0xAB bytes in the page cache first,
    /// with no page-table entries; each first touch is a minor fault the handler resolves by
    /// mapping the cached page (UFFDIO_CONTINUE).
    #[value(name = "MINOR")]
    Minor,
}

impl UffdArg {
    fn mode(self) -> UffdMode {
        match self {
            UffdArg::Missing => UffdMode::Missing,
            UffdArg::Minor => UffdMode::Minor,
        }
    }
}

/// Flags of `slat demand-paging`.
#[derive(Debug, Clone, Args)]
pub struct DemandPagingArgs {
    #[command(flatten)]
    pub work: Workload,
    /// Serve guest RAM's first touches through userfaultfd (demand_paging_test's -u): guest
    /// RAM is registered with one userfaultfd per vCPU's memory, and handler threads resolve
    /// each fault of the vCPUs (sim) or of KVM (kvm) one backing page at a time. MISSING or
    /// MINOR (MINOR needs -s shmem). Guest RAM is not pre-faulted with -u.
    #[arg(short = 'u', value_enum, ignore_case = true, value_name = "MODE")]
    pub uffd: Option<UffdArg>,
    /// Microseconds each userfaultfd handler waits before serving a fault (needs -u; at most
    /// 1000000).
    #[arg(short = 'd', value_name = "DELAY_US", value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub delay_us: Option<u64>,
    /// One userfaultfd for all of guest memory instead of one per vCPU (needs -u; implied by
    /// -o).
    #[arg(short = 'a')]
    pub single_uffd: bool,
    /// Handler threads reading each userfaultfd (needs -u; 1-64).
    #[arg(short = 'r', value_name = "READERS", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub readers: Option<u32>,
    /// The machine(s) to run on: `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` to run both
    /// in this process and print one table comparing them.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    #[command(flatten)]
    pub pin: PinArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub clock: ClockArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

const NAME: &str = "demand-paging";

/// The run's settings, as the report records them.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    #[serde(flatten)]
    pub vm: VmSettings,
    #[serde(flatten)]
    pub work: WorkSettings,
    /// `-c`: vCPU i's thread was pinned to `pinned_cpus[i]` (read back from the kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_cpus: Option<Vec<usize>>,
}

/// The native baseline: the same pattern by host threads on host memory.
#[derive(Debug, Clone, Serialize)]
pub struct NativeFigures {
    #[serde(rename = "total_time_s", serialize_with = "secs")]
    pub total: Duration,
    #[serde(rename = "overall_rate_pgs_per_s")]
    pub overall_rate: f64,
}

/// What the userfaultfd handlers did (`-u`).
#[derive(Debug, Clone, Serialize)]
pub struct UffdFigures {
    pub mode: &'static str,
    pub ioctl: &'static str,
    pub uffds: usize,
    pub readers_per_uffd: usize,
    /// Bytes each fault paged in (the backing's page size).
    pub page_size: u64,
    pub delay_us: u64,
    pub pages_served: u64,
    /// Faults on pages already served (woken, `EEXIST`).
    pub already_present: u64,
    pub per_handler_pages: Vec<u64>,
    /// 4 KiB guest pages checked after the pass: every one held the served 0xAB pattern
    /// (and the guest's write).
    pub pages_verified: u64,
}

/// Everything one run of demand-paging measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub head: RunHead,
    pub config: Config,
    #[serde(rename = "total_guest_execution_time_s", serialize_with = "secs")]
    pub total: Duration,
    #[serde(rename = "per_vcpu_demand_paging_rate_pgs_per_s")]
    pub per_vcpu_rate: f64,
    #[serde(rename = "overall_demand_paging_rate_pgs_per_s")]
    pub overall_rate: f64,
    pub ns_per_page_per_vcpu: f64,
    pub per_vcpu_time_s: Vec<f64>,
    pub native: NativeFigures,
    pub ratio_guest_over_native: f64,
    pub stats: serde_json::Value,
    /// The engine's own memory after the pass (sim; `null` on kvm).
    pub mmu_memory: Option<MmuMemoryFigures>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uffd: Option<UffdFigures>,
    /// Whose time the report's times are.
    #[serde(flatten)]
    pub clock: ClockReport,
    /// The lines describing the machine after the selftest's.
    #[serde(skip)]
    pub machine_lines: Vec<String>,
    #[serde(skip)]
    pub format_header: String,
    #[serde(skip)]
    pub gpa: u64,
}

const METRICS: &[Metric<Report>] = &[
    Metric::lower("total guest execution time", "s", |r| {
        Some(r.total.as_secs_f64())
    }),
    Metric::lower("native execution time", "s", |r| {
        Some(r.native.total.as_secs_f64())
    }),
    Metric::higher("overall demand paging rate", "pgs/s", |r| {
        Some(r.overall_rate)
    }),
    Metric::lower("ns per page per vCPU", "ns", |r| {
        Some(r.ns_per_page_per_vcpu)
    }),
    Metric::lower("guest/native", "x", |r| Some(r.ratio_guest_over_native)),
];

impl Benchmark for DemandPagingArgs {
    type Report = Report;
    const NAME: &'static str = NAME;
    crate::forward_benchmark! { vary: no, check: check, measure: measure, print: print_text }

    fn metrics(&self) -> Vec<Metric<Report>> {
        METRICS.to_vec()
    }

    fn comparison_title(&self, [k0, k1]: [BackendArg; 2]) -> String {
        format!(
            "demand-paging on {} and {}: -v {} -b {}, one run each, in this process; format {} on sim",
            k0.name(),
            k1.name(),
            self.work.vcpus,
            format_size(self.work.bytes),
            self.machine.format.name()
        )
    }
}

/// Refuses flags that cannot run together and sizes the machines cannot hold (the guest, then
/// the native baseline, one at a time).
fn check(a: &DemandPagingArgs) -> Result<(), String> {
    a.machine.check_backends(&a.backend, &[])?;
    if a.clock.is_virtual() {
        if a.uffd.is_some() {
            return Err("--clock virtual cannot simulate -u: its handler threads wait in the kernel, outside the simulation".into());
        }
        if a.backend.contains(&BackendArg::Kvm) {
            return Err(
                "--clock virtual runs only on the simulated machine (--backend sim)".into(),
            );
        }
    }
    a.pin.plan(a.work.vcpus)?;
    match a.uffd {
        None => {
            let given = [
                (a.delay_us.is_some(), "-d"),
                (a.single_uffd, "-a"),
                (a.readers.is_some(), "-r"),
            ];
            if let Some((_, f)) = given.iter().find(|(g, _)| *g) {
                return Err(format!(
                    "{f} configures userfaultfd handlers, which run only with -u MISSING or -u MINOR"
                ));
            }
        }
        Some(u) => uffd::check_support(u.mode(), a.work.backing).map_err(|e| e.to_string())?,
    }
    a.work.check_fits(&a.backend, &a.machine, 0, 1).map(drop)
}

/// One run on `kind`: the guest's first-touch pass, then the native baseline.
fn measure(a: &DemandPagingArgs, kind: BackendArg) -> CliResult<Report> {
    let q = quiet(a.out.json);
    let mut region = a.work.region(&a.machine, DirtyConfig::default());
    // With -u the handlers must see every first touch: nothing is populated up front.
    region.prefault &= a.uffd.is_none();
    let cfg = Spec::new(&a.machine, region, a.machine.vm_config());
    let what = if region.prefault {
        " (pre-faulting host pages)"
    } else {
        ""
    };
    let vt = a.clock.start()?;
    let (m, p) = backend::start_with(kind, &cfg, what, q, vt.as_ref().map(VirtualRun::threads))?;
    let pinned_cpus = backend::pin(m.as_ref(), &a.pin, a.work.vcpus)?;
    p.done();
    let layout = m.layout();
    let params = PassParams::default();
    let p = Phase::start(format!("first-touch pass on {} vCPU(s)", a.work.vcpus), q);
    let (guest, uffd) = first_touch(a, m.as_ref(), params)?;
    p.done();
    let vcpus = a.work.vcpus as f64;
    let touched: u64 = guest.vcpus.iter().map(|v| v.pages).sum();
    let ns_per_page = guest.wall.as_nanos() as f64 / (touched as f64 / vcpus);
    let extra = format!(", {ns_per_page:.1} ns per page per vCPU");
    let machine_lines =
        backend::machine_lines(m.as_ref(), &cfg, "", &extra, pinned_cpus.as_deref());
    let (stats, pcpus) = (m.stats(), m.sim().map(|s| s.pcpus()));
    let guest_bytes = a.work.bytes.saturating_mul(a.work.vcpus as u64);
    let mmu_memory = MmuMemoryFigures::of(m.as_ref(), guest_bytes);
    drop(m);
    // The simulation ends with the machine: the native baseline runs in real time.
    let mut clock = virtual_time::finish(vt)?;
    clock.count_faults(&stats);

    let p = Phase::start("native baseline: same pattern on host memory", q);
    // With -u the guest RAM was not pre-faulted, nor is the baseline's: both pay first touch.
    let native = Native::new(kind, layout, a.work.backing, region.prefault)?.run(params)?;
    p.done();

    let per_vcpu = guest.vcpus[0].pages as f64 / guest.wall.as_secs_f64();
    let vm = cfg.vm_settings(kind, pcpus);
    Ok(Report {
        head: RunHead::new(NAME, kind, a.machine.format),
        config: Config {
            vm,
            work: a.work.settings(),
            pinned_cpus,
        },
        total: guest.wall,
        per_vcpu_rate: per_vcpu,
        overall_rate: per_vcpu * vcpus,
        ns_per_page_per_vcpu: ns_per_page,
        per_vcpu_time_s: guest.vcpus.iter().map(|v| v.time.as_secs_f64()).collect(),
        native: NativeFigures {
            total: native.wall,
            overall_rate: native.vcpus[0].pages as f64 / native.wall.as_secs_f64() * vcpus,
        },
        ratio_guest_over_native: ratio(guest.wall, native.wall),
        stats,
        mmu_memory,
        uffd,
        clock,
        machine_lines,
        format_header: format_header(kind, a.machine.format, &cfg.vm),
        gpa: layout.gpa,
    })
}

/// The first-touch pass, served by a userfaultfd server under `-u`.
fn first_touch(
    a: &DemandPagingArgs,
    m: &dyn Backend,
    params: PassParams,
) -> CliResult<(Pass, Option<UffdFigures>)> {
    let Some(u) = a.uffd else {
        return Ok((m.run_pass(params)?, None));
    };
    let ram = m.guest_ram();
    let regions = uffd_regions(a, ram.len(), ram.page_size());
    let delay = Duration::from_micros(a.delay_us.unwrap_or(0));
    let readers = a.readers.unwrap_or(1) as usize;
    // SAFETY: the vCPU threads are idle until `run_pass` (nothing else accesses guest
    // RAM while the server starts), and the server borrows `ram`, so it is stopped
    // (its threads joined) before the machine can unmap it.
    let server = unsafe { UffdServer::start(ram, &regions, u.mode(), readers, delay) }
        .map_err(|e| format!("-u {}: {e}", u.mode().name()))?;
    let pass = m.run_pass(params);
    let report = server.stop();
    let pass = pass?;
    let figures = uffd_figures(a, &report, ram)?;
    Ok((pass, Some(figures)))
}

/// The selftest's text report, then slat's native baseline and machine lines.
fn print_text(r: &Report) {
    let c = &r.config;
    let end = r.gpa + c.work.bytes_per_vcpu * c.work.vcpus as u64;
    println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
    println!("{}", r.format_header);
    println!("guest physical test memory: [0x{:x}, 0x{end:x})", r.gpa);
    let uffd = if r.uffd.is_some() {
        " and starting uffd threads"
    } else {
        ""
    };
    println!("Finished creating vCPUs{uffd}");
    println!("Started all vCPUs");
    println!("All vCPU threads joined");
    println!("Total guest execution time:\t{}", ts(r.total));
    println!(
        "Per-vcpu demand paging rate:\t{:.6} pgs/sec/vcpu",
        r.per_vcpu_rate
    );
    println!("Overall demand paging rate:\t{:.6} pgs/sec", r.overall_rate);
    if let Some(u) = &r.uffd {
        println!(
            "userfaultfd -u {}: {} pages served with {} ({} each) by {} handler thread(s) on {} userfaultfd(s), {} already present, delay {} us",
            u.mode,
            u.pages_served,
            u.ioctl,
            format_size(u.page_size),
            u.per_handler_pages.len(),
            u.uffds,
            u.already_present,
            u.delay_us
        );
        let n = u.pages_verified;
        println!("userfaultfd: all {n} guest pages verified to hold the served 0xAB pattern");
    }
    let faults = if c.work.backing.starts_with("phantom") {
        "its data in the 64-frame phantom pool, as the guest's"
    } else if c.vm.prefault {
        "pre-faulted"
    } else {
        "with host faults"
    };
    println!(
        "\nNative baseline ({}, same pattern on host memory, {faults}):",
        c.work.backing
    );
    println!("Total native execution time:\t{}", ts(r.native.total));
    println!("Overall native rate:\t{:.6} pgs/sec", r.native.overall_rate);
    println!(
        "Ratio guest/native time:\t{:.2}x\n",
        r.ratio_guest_over_native
    );
    for l in &r.machine_lines {
        println!("{l}");
    }
    if let Some(mm) = &r.mmu_memory {
        println!("{}", mm.line("after the pass"));
    }
    if let Some(l) = r.clock.line() {
        println!("{l}");
    }
}

/// The ranges of guest RAM with a userfaultfd each: one per vCPU's memory, or one for all
/// of it with -a, -o, or when a vCPU's memory is not a whole number of backing pages.
fn uffd_regions(a: &DemandPagingArgs, ram_len: u64, psize: u64) -> Vec<(u64, u64)> {
    let b = a.work.bytes;
    if a.single_uffd || a.work.overlap || a.work.vcpus == 1 || b % psize != 0 {
        return vec![(0, ram_len)];
    }
    (0..a.work.vcpus as u64).map(|i| (i * b, b)).collect()
}

/// The handlers' figures, after checking that every guest page was served.
fn uffd_figures(
    a: &DemandPagingArgs,
    r: &UffdReport,
    ram: &slat_workload::GuestRam,
) -> Result<UffdFigures, String> {
    let total = a.work.bytes * a.work.vcpus as u64;
    if r.failed() != 0 {
        return Err(format!(
            "-u {}: the handlers could not {} {} page(s)",
            r.mode.name(),
            r.mode.ioctl_name(),
            r.failed()
        ));
    }
    let (checked, bad) = uffd::verify_served(ram, total, MEMSTRESS_PATTERN);
    if bad != 0 {
        return Err(format!(
            "-u {}: {bad} of {checked} guest pages do not hold the pattern the userfaultfd handlers serve: they were not paged in by the handlers",
            r.mode.name()
        ));
    }
    Ok(UffdFigures {
        mode: r.mode.name(),
        ioctl: r.mode.ioctl_name(),
        uffds: r.uffds,
        readers_per_uffd: r.readers,
        page_size: r.page_size,
        delay_us: r.delay.as_micros() as u64,
        pages_served: r.pages(),
        already_present: r.eexist(),
        per_handler_pages: r.handlers.iter().map(|h| h.pages).collect(),
        pages_verified: checked,
    })
}
