//! `slat demand-paging`: KVM's demand_paging_test — one first-touch pass over all guest
//! memory, every page faulted in through the engine (or KVM), with `-u MISSING|MINOR` each
//! first touch of the host memory behind it served by userfaultfd handler threads — and, in
//! the same run, the same pattern on host memory as the native baseline.

use crate::args::{check_backends, BackendArg, MachineArgs, OutputArgs, PinArgs, Workload};
use crate::backend::{self, kvm_stats_line, Backend, Native, Pass, Spec};
use crate::driver::{Benchmark, Common};
use crate::error::{CliError, CliResult};
use crate::limits::{check_backing, GuestMemory};
use crate::output::{secs, Better, Metric, RunHead, VmSettings};
use crate::report::{
    bbm_cmo_line, format_header, pinned_line, quiet, ratio, sim_format, ts, Phase,
};
use clap::{Args, ValueEnum};
use serde::Serialize;
use serde_json::json;
use slat_workload::format_size;
use slat_workload::uffd::{self, UffdMode, UffdReport, UffdServer};
use slat_workload::PassParams;
use slat_workload::MEMSTRESS_PATTERN;
use slat_workload::{DirtyConfig, RegionSpec};
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
    pub out: OutputArgs,
}

const NAME: &str = "demand-paging";

/// The run's settings, as the report records them.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// Engine and machine settings.
    #[serde(flatten)]
    pub vm: VmSettings,
    /// `-v`.
    pub vcpus: u32,
    /// `-b`.
    pub bytes_per_vcpu: u64,
    /// `-s`.
    pub backing: &'static str,
    /// `-o`.
    pub overlap: bool,
    /// `-c`: vCPU i's thread was pinned to `pinned_cpus[i]` (read back from the kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_cpus: Option<Vec<usize>>,
}

/// The native baseline's figures.
#[derive(Debug, Clone, Serialize)]
pub struct NativeFigures {
    /// The same pattern by host threads on host memory.
    #[serde(rename = "total_time_s", serialize_with = "secs")]
    pub total: Duration,
    /// Its rate over every thread.
    #[serde(rename = "overall_rate_pgs_per_s")]
    pub overall_rate: f64,
}

/// What the userfaultfd handlers did (`-u`).
#[derive(Debug, Clone, Serialize)]
pub struct UffdFigures {
    /// `MISSING` or `MINOR`.
    pub mode: &'static str,
    /// `UFFDIO_COPY` or `UFFDIO_CONTINUE`.
    pub ioctl: &'static str,
    /// userfaultfds.
    pub uffds: usize,
    /// Handler threads per userfaultfd (`-r`).
    pub readers_per_uffd: usize,
    /// Bytes each fault paged in (the backing's page size).
    pub page_size: u64,
    /// `-d`.
    pub delay_us: u64,
    /// Faults the handlers resolved.
    pub pages_served: u64,
    /// Faults on pages already served (woken, `EEXIST`).
    pub already_present: u64,
    /// Each handler thread's resolved faults.
    pub per_handler_pages: Vec<u64>,
    /// 4 KiB guest pages checked after the pass: every one held the served 0xAB pattern
    /// (and the guest's write).
    pub pages_verified: u64,
}

/// Everything one run of demand-paging measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Which benchmark ran on which machine.
    #[serde(flatten)]
    pub head: RunHead,
    /// The settings.
    pub config: Config,
    /// The first-touch pass, all vCPUs.
    #[serde(rename = "total_guest_execution_time_s", serialize_with = "secs")]
    pub total: Duration,
    /// Pages per second per vCPU.
    #[serde(rename = "per_vcpu_demand_paging_rate_pgs_per_s")]
    pub per_vcpu_rate: f64,
    /// Pages per second over every vCPU.
    #[serde(rename = "overall_demand_paging_rate_pgs_per_s")]
    pub overall_rate: f64,
    /// Nanoseconds per page per vCPU.
    pub ns_per_page_per_vcpu: f64,
    /// Each vCPU's pass time.
    pub per_vcpu_time_s: Vec<f64>,
    /// The native baseline.
    pub native: NativeFigures,
    /// total / native total.
    pub ratio_guest_over_native: f64,
    /// The machine's counters.
    pub stats: serde_json::Value,
    /// `-u`: the userfaultfd handlers' figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uffd: Option<UffdFigures>,
    /// The lines describing the machine after the selftest's.
    #[serde(skip)]
    pub machine_lines: Vec<String>,
    /// The header line naming the page-table format.
    #[serde(skip)]
    pub format_header: String,
    /// Start of guest test memory.
    #[serde(skip)]
    pub gpa: u64,
}

/// The headline figures.
const METRICS: &[Metric<Report>] = &[
    Metric {
        name: "total guest execution time",
        unit: "s",
        better: Better::Lower,
        get: |r| Some(r.total.as_secs_f64()),
    },
    Metric {
        name: "native execution time",
        unit: "s",
        better: Better::Lower,
        get: |r| Some(r.native.total.as_secs_f64()),
    },
    Metric {
        name: "overall demand paging rate",
        unit: "pgs/s",
        better: Better::Higher,
        get: |r| Some(r.overall_rate),
    },
    Metric {
        name: "ns per page per vCPU",
        unit: "ns",
        better: Better::Lower,
        get: |r| Some(r.ns_per_page_per_vcpu),
    },
    Metric {
        name: "guest/native",
        unit: "x",
        better: Better::Lower,
        get: |r| Some(r.ratio_guest_over_native),
    },
];

impl Benchmark for DemandPagingArgs {
    type Report = Report;
    const NAME: &'static str = NAME;

    fn common(&self) -> Common<'_> {
        Common {
            backends: &self.backend,
            vary: &[],
            out: &self.out,
        }
    }

    fn check(&self) -> CliResult {
        self.machine
            .format
            .check_backends(&self.backend)
            .map_err(CliError::bad)?;
        check_backends(&self.backend, &self.machine.engine_only()).map_err(CliError::bad)?;
        check(self).map_err(CliError::bad)
    }

    fn measure(&self, kind: BackendArg) -> CliResult<Report> {
        measure(self, kind)
    }

    fn metrics(&self) -> Vec<Metric<Report>> {
        METRICS.to_vec()
    }

    fn print(&self, r: &Report) {
        print_text(r)
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

/// Sizes the machines can hold: `-v` × `-b` without overflow, in the guest physical address
/// space of each machine, on this host (the guest, then the native baseline, one at a time).
fn check(a: &DemandPagingArgs) -> Result<(), String> {
    check_backing(&a.backend, a.work.backing)?;
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
    let mem = GuestMemory::per_vcpu(a.work.vcpus, a.work.bytes)?;
    mem.fits_gpa(&a.backend, a.machine.format, None)?;
    mem.fits_host(a.work.backing, 1, a.machine.tlb_bytes(a.work.vcpus))
}

fn spec(a: &DemandPagingArgs) -> Spec {
    Spec {
        region: RegionSpec {
            backing: a.work.backing,
            vcpus: a.work.vcpus as usize,
            bytes_per_vcpu: a.work.bytes,
            slots: 1,
            overlap: a.work.overlap,
            // With -u the handlers must see every first touch: nothing is populated up front.
            prefault: !a.machine.no_prefault && a.uffd.is_none(),
            dirty: DirtyConfig::default(),
        },
        format: a.machine.format,
        vm: a.machine.vm_config(),
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
    }
}

/// One run on `kind`: the guest's first-touch pass, then the native baseline.
fn measure(a: &DemandPagingArgs, kind: BackendArg) -> CliResult<Report> {
    let q = quiet(a.out.json);
    let cfg = spec(a);
    let p = Phase::start(
        format!(
            "{}{}: mapping {} of {} guest RAM{}",
            kind.name(),
            sim_format(kind, a.machine.format),
            format_size(a.work.bytes * a.work.vcpus as u64),
            a.work.backing,
            if cfg.region.prefault {
                " (pre-faulting host pages)"
            } else {
                ""
            }
        ),
        q,
    );
    let m = backend::create(kind, &cfg)?;
    let pinned_cpus = backend::pin(m.as_ref(), &a.pin, a.work.vcpus)?;
    p.done();
    let layout = m.layout();
    let params = PassParams::default();
    let p = Phase::start(format!("first-touch pass on {} vCPU(s)", a.work.vcpus), q);
    let (guest, uffd) = first_touch(a, m.as_ref(), params)?;
    p.done();
    let stats = m.stats();
    let sim = m.sim().map(|s| (s.engine_stats(), s.pcpus()));
    drop(m);

    let p = Phase::start("native baseline: same pattern on host memory", q);
    // With -u the guest RAM was not pre-faulted, nor is the baseline's: both pay first touch.
    let native_ram = Native::new(kind, layout, a.work.backing, cfg.region.prefault)?;
    let native = native_ram.run(params)?;
    drop(native_ram);
    p.done();

    let per_vcpu = guest.vcpus[0].pages as f64 / guest.wall.as_secs_f64();
    let native_overall =
        native.vcpus[0].pages as f64 / native.wall.as_secs_f64() * a.work.vcpus as f64;
    let touched: u64 = guest.vcpus.iter().map(|v| v.pages).sum();
    let ns_per_page = guest.wall.as_nanos() as f64 / (touched as f64 / a.work.vcpus as f64);
    let mut machine_lines = match &sim {
        Some((s, pcpus)) => engine_lines(a, &cfg, s, *pcpus, ns_per_page),
        None => kvm_lines(a, &stats, ns_per_page),
    };
    machine_lines.extend(pinned_line(pinned_cpus.as_deref()));
    let vm = cfg.vm_settings(kind, sim.as_ref().map(|(_, p)| *p));
    Ok(Report {
        head: RunHead {
            benchmark: NAME,
            backend: kind.name(),
            format: vm.format,
        },
        config: Config {
            vm,
            vcpus: a.work.vcpus,
            bytes_per_vcpu: a.work.bytes,
            backing: a.work.backing.name(),
            overlap: a.work.overlap,
            pinned_cpus,
        },
        total: guest.wall,
        per_vcpu_rate: per_vcpu,
        overall_rate: per_vcpu * a.work.vcpus as f64,
        ns_per_page_per_vcpu: ns_per_page,
        per_vcpu_time_s: guest.vcpus.iter().map(|v| v.time.as_secs_f64()).collect(),
        native: NativeFigures {
            total: native.wall,
            overall_rate: native_overall,
        },
        ratio_guest_over_native: ratio(guest.wall, native.wall),
        stats,
        uffd,
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

/// The machine lines on KVM: its counters and the per-page time.
fn kvm_lines(a: &DemandPagingArgs, stats: &serde_json::Value, ns_per_page: f64) -> Vec<String> {
    vec![
        kvm_stats_line(stats),
        format!(
            "Machine: {} vCPU(s) on the host's /dev/kvm, {:.1} ns per page per vCPU",
            a.work.vcpus, ns_per_page
        ),
    ]
}

fn engine_lines(
    a: &DemandPagingArgs,
    cfg: &Spec,
    stats: &slat::Stats,
    pcpus: usize,
    ns_per_page: f64,
) -> Vec<String> {
    let faults = stats.pf_fixed + stats.pf_fast;
    let mut lines = vec![
        format!(
            "Engine: {faults} faults ({} slow, {} fast, {} spurious, {} retried), {:.1} ns per page per vCPU",
            stats.pf_fixed, stats.pf_fast, stats.pf_spurious, stats.pf_retry, ns_per_page
        ),
        format!(
            "Leaves: {} x 4K, {} x 2M, {} x 1G; page tables: {} pages ({}); remote flushes: {}/{} requested",
            stats.leaves_4k,
            stats.leaves_2m,
            stats.leaves_1g,
            stats.table_pages,
            format_size(stats.table_bytes),
            stats.remote_tlb_flush,
            stats.remote_tlb_flush_requests
        ),
    ];
    lines.extend(bbm_cmo_line(a.machine.format, stats));
    lines.push(format!(
        "Machine: {} vCPU(s) on {} physical CPU(s), format {}, mmu lock {}, fast page fault {}",
        a.work.vcpus,
        pcpus,
        a.machine.format.name(),
        cfg.vm.mmu_lock.name(),
        if cfg.vm.fast_pf { "on" } else { "off" }
    ));
    lines
}

/// The selftest's text report, then slat's native baseline and machine lines.
fn print_text(r: &Report) {
    let c = &r.config;
    let total = c.bytes_per_vcpu * c.vcpus as u64;
    println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
    println!("{}", r.format_header);
    println!(
        "guest physical test memory: [0x{:x}, 0x{:x})",
        r.gpa,
        r.gpa + total
    );
    if r.uffd.is_some() {
        println!("Finished creating vCPUs and starting uffd threads");
    } else {
        println!("Finished creating vCPUs");
    }
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
        println!(
            "userfaultfd: all {} guest pages verified to hold the served 0xAB pattern",
            u.pages_verified
        );
    }
    println!();
    println!(
        "Native baseline ({}, same pattern on host memory{}):",
        c.backing,
        if c.vm.prefault {
            ", pre-faulted"
        } else {
            ", with host faults"
        }
    );
    println!("Total native execution time:\t{}", ts(r.native.total));
    println!("Overall native rate:\t{:.6} pgs/sec", r.native.overall_rate);
    println!(
        "Ratio guest/native time:\t{:.2}x",
        r.ratio_guest_over_native
    );
    println!();
    for l in &r.machine_lines {
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

/// Every engine statistic as JSON.
pub fn stats_json(s: &slat::Stats) -> serde_json::Value {
    json!({
        "pf_fixed": s.pf_fixed, "pf_fast": s.pf_fast, "pf_spurious": s.pf_spurious,
        "pf_retry": s.pf_retry, "pf_no_slot": s.pf_no_slot, "pf_read_only": s.pf_read_only,
        "leaves_4k": s.leaves_4k, "leaves_2m": s.leaves_2m, "leaves_1g": s.leaves_1g,
        "table_pages": s.table_pages, "table_bytes": s.table_bytes,
        "table_pages_live": s.table_pages_live,
        "remote_tlb_flush_requests": s.remote_tlb_flush_requests,
        "remote_tlb_flush": s.remote_tlb_flush, "splits": s.splits,
        "recoveries": s.recoveries, "dirty_marked": s.dirty_marked,
        "pf_ring_full": s.pf_ring_full, "bbm_breaks": s.bbm_breaks,
        "cache_cleans": s.cache_cleans, "cache_clean_bytes": s.cache_clean_bytes,
    })
}
