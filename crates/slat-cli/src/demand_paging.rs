//! `slat demand-paging`: KVM's demand_paging_test without userfaultfd — one first-touch pass
//! over all guest memory, every page faulted in through the engine — and, in the same run, the
//! same pattern on host memory as the native baseline.

use crate::args::{backing, check_backends, guest_size, BackendArg, MachineArgs};
use crate::backend::{self, comparison_json, kvm_stats_line, print_comparison, Native, Row, Spec};
use crate::limits::{check_backing, GuestMemory};
use crate::report::{
    bbm_cmo_line, format_header, format_json, quiet, ratio, sim_format, ts, Phase,
};
use clap::Args;
use serde_json::json;
use slat_machine::ram::{format_size, Backing};
use slat_machine::PassParams;

/// Flags of `slat demand-paging`.
#[derive(Debug, Args)]
pub struct DemandPagingArgs {
    /// vCPUs, each a thread touching its own partition of guest memory.
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub vcpus: u32,
    /// Guest memory per vCPU: bytes with an optional k/m/g/t suffix (powers of 1024), a
    /// multiple of 4 KiB.
    #[arg(short = 'b', value_parser = guest_size, default_value = "1G")]
    pub bytes: u64,
    /// Host memory behind guest RAM: anonymous, anonymous_thp, anonymous_hugetlb (2 MiB),
    /// anonymous_hugetlb_1gb, shmem.
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// Overlap: every vCPU touches all of guest memory instead of its own partition.
    #[arg(short = 'o')]
    pub overlap: bool,
    /// The machine(s) to run on: `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` to run both
    /// in this process and print one table comparing them.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    /// Print one JSON document with every figure instead of the text report.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub machine: MachineArgs,
}

/// Runs the benchmark (on each machine `--backend` lists).
pub fn run(a: &DemandPagingArgs) -> crate::error::CliResult {
    a.machine
        .format
        .check_backends(&a.backend)
        .map_err(crate::error::CliError::bad)?;
    check_backends(&a.backend, &a.machine.engine_only()).map_err(crate::error::CliError::bad)?;
    check(a).map_err(crate::error::CliError::bad)?;
    if let [first, second] = a.backend[..] {
        return side_by_side(a, [first, second]);
    }
    let doc = measure(a, a.backend[0], !a.json)?;
    if a.json {
        println!("{doc:#}");
    }
    Ok(())
}

/// Sizes the machines can hold: `-v` × `-b` without overflow, in the guest physical address
/// space of each machine, on this host (the guest, then the native baseline, one at a time).
fn check(a: &DemandPagingArgs) -> Result<(), String> {
    check_backing(&a.backend, a.backing)?;
    let mem = GuestMemory::per_vcpu(a.vcpus, a.bytes)?;
    mem.fits_gpa(&a.backend, a.machine.format, None)?;
    mem.fits_host(a.backing, 1, a.machine.tlb_bytes(a.vcpus))
}

/// One run on `kind`; prints the text report when `text`, and returns every figure as JSON.
fn measure(
    a: &DemandPagingArgs,
    kind: BackendArg,
    text: bool,
) -> Result<serde_json::Value, String> {
    let q = quiet(a.json);
    let prefault = !a.machine.no_prefault;
    let cfg = Spec {
        format: a.machine.format,
        vm: a.machine.vm_config(),
        backing: a.backing,
        vcpus: a.vcpus as usize,
        bytes_per_vcpu: a.bytes,
        slots: 1,
        overlap: a.overlap,
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
        prefault,
        manual_protect: false,
        ring_entries: 0,
    };
    let total = a.bytes * a.vcpus as u64;
    let p = Phase::start(
        format!(
            "{}{}: mapping {} of {} guest RAM{}",
            kind.name(),
            sim_format(kind, a.machine.format),
            format_size(total),
            a.backing,
            if prefault {
                " (pre-faulting host pages)"
            } else {
                ""
            }
        ),
        q,
    );
    let m = backend::create(kind, &cfg)?;
    p.done();
    let layout = m.layout();
    if text {
        println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
        println!("{}", format_header(kind, a.machine.format, &cfg.vm));
        println!(
            "guest physical test memory: [0x{:x}, 0x{:x})",
            layout.gpa,
            layout.gpa + total
        );
        println!("Finished creating vCPUs and starting uffd threads");
        println!("Started all vCPUs");
    }
    let params = PassParams::default();
    let p = Phase::start(format!("first-touch pass on {} vCPU(s)", a.vcpus), q);
    let guest = m.run_pass(params)?;
    p.done();
    let stats_doc = m.stats();
    let sim = m.sim().map(|s| (s.engine_stats(), s.pcpus()));
    let pcpus = sim.as_ref().map(|(_, p)| *p);
    drop(m);

    let p = Phase::start("native baseline: same pattern on host memory", q);
    let native_ram = Native::new(kind, layout, a.backing, prefault)?;
    let native = native_ram.run(params)?;
    drop(native_ram);
    p.done();

    let secs = guest.wall.as_secs_f64();
    let pages0 = guest.vcpus[0].pages;
    let per_vcpu = pages0 as f64 / secs;
    let overall = per_vcpu * a.vcpus as f64;
    let native_secs = native.wall.as_secs_f64();
    let native_overall = native.vcpus[0].pages as f64 / native_secs * a.vcpus as f64;
    let touched: u64 = guest.vcpus.iter().map(|v| v.pages).sum();
    let ns_per_page = guest.wall.as_nanos() as f64 / (touched as f64 / a.vcpus as f64);
    let r = ratio(guest.wall, native.wall);
    let doc = json!({
        "benchmark": "demand-paging",
        "backend": kind.name(),
        "format": format_json(kind, a.machine.format),
        "config": {
            "vcpus": a.vcpus, "bytes_per_vcpu": a.bytes, "backing": a.backing.name(),
            "overlap": a.overlap, "prefault": prefault, "mmu_lock": cfg.vm.mmu_lock.name(),
            "fast_pf": cfg.vm.fast_pf, "ad_bits": cfg.vm.ad_bits,
            "format": format_json(kind, a.machine.format), "cmo": cfg.vm.cmo.name(),
            "tlb_entries": cfg.tlb_entries, "pcpus": pcpus,
        },
        "total_guest_execution_time_s": secs,
        "per_vcpu_demand_paging_rate_pgs_per_s": per_vcpu,
        "overall_demand_paging_rate_pgs_per_s": overall,
        "ns_per_page_per_vcpu": ns_per_page,
        "per_vcpu_time_s": guest.vcpus.iter().map(|v| v.time.as_secs_f64()).collect::<Vec<_>>(),
        "native": {
            "total_time_s": native_secs,
            "overall_rate_pgs_per_s": native_overall,
        },
        "ratio_guest_over_native": r,
        "stats": stats_doc,
    });
    if text {
        println!("All vCPU threads joined");
        println!("Total guest execution time:\t{}", ts(guest.wall));
        println!("Per-vcpu demand paging rate:\t{per_vcpu:.6} pgs/sec/vcpu");
        println!("Overall demand paging rate:\t{overall:.6} pgs/sec");
        println!();
        println!(
            "Native baseline ({}, same pattern on host memory{}):",
            a.backing,
            if prefault {
                ", pre-faulted"
            } else {
                ", with host faults"
            }
        );
        println!("Total native execution time:\t{}", ts(native.wall));
        println!("Overall native rate:\t{native_overall:.6} pgs/sec");
        println!("Ratio guest/native time:\t{r:.2}x");
        println!();
        let Some((stats, pcpus)) = sim else {
            println!("{}", kvm_stats_line(&stats_doc));
            println!(
                "Machine: {} vCPU(s) on the host's /dev/kvm, {:.1} ns per page per vCPU",
                a.vcpus, ns_per_page
            );
            return Ok(doc);
        };
        let faults = stats.pf_fixed + stats.pf_fast;
        println!(
            "Engine: {faults} faults ({} slow, {} fast, {} spurious, {} retried), {:.1} ns per page per vCPU",
            stats.pf_fixed, stats.pf_fast, stats.pf_spurious, stats.pf_retry, ns_per_page
        );
        println!(
            "Leaves: {} x 4K, {} x 2M, {} x 1G; page tables: {} pages ({}); remote flushes: {}/{} requested",
            stats.leaves_4k,
            stats.leaves_2m,
            stats.leaves_1g,
            stats.table_pages,
            format_size(stats.table_bytes),
            stats.remote_tlb_flush,
            stats.remote_tlb_flush_requests
        );
        if let Some(line) = bbm_cmo_line(a.machine.format, &stats) {
            println!("{line}");
        }
        println!(
            "Machine: {} vCPU(s) on {} physical CPU(s), format {}, mmu lock {}, fast page fault {}",
            a.vcpus,
            pcpus,
            a.machine.format.name(),
            cfg.vm.mmu_lock.name(),
            if cfg.vm.fast_pf { "on" } else { "off" }
        );
    }
    Ok(doc)
}

/// `--backend sim,kvm`: the pass on both machines, one after the other, and one table.
fn side_by_side(a: &DemandPagingArgs, kinds: [BackendArg; 2]) -> crate::error::CliResult {
    let docs = [measure(a, kinds[0], false)?, measure(a, kinds[1], false)?];
    let (n0, n1) = (kinds[0].name(), kinds[1].name());
    let rows = [
        (
            "total guest execution time (s)",
            "/total_guest_execution_time_s",
        ),
        ("native execution time (s)", "/native/total_time_s"),
        (
            "overall demand paging rate (pgs/s)",
            "/overall_demand_paging_rate_pgs_per_s",
        ),
        ("ns per page per vCPU", "/ns_per_page_per_vcpu"),
        ("guest/native", "/ratio_guest_over_native"),
    ];
    let table: Vec<Row> = rows
        .iter()
        .map(|(name, ptr)| {
            (
                *name,
                docs[0].pointer(ptr).and_then(|v| v.as_f64()),
                docs[1].pointer(ptr).and_then(|v| v.as_f64()),
            )
        })
        .collect();
    if a.json {
        let doc = comparison_json("demand-paging", [n0, n1], &table, docs);
        println!("{doc:#}");
        return Ok(());
    }
    println!(
        "demand-paging on {n0} and {n1}: -v {} -b {}, one run each, in this process; format {} on sim",
        a.vcpus,
        format_size(a.bytes),
        a.machine.format.name()
    );
    print_comparison([n0, n1], &table);
    Ok(())
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
