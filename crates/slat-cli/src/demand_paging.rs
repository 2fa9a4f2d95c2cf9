//! `slat demand-paging`: KVM's demand_paging_test without userfaultfd — one first-touch pass
//! over all guest memory, every page faulted in through the engine — and, in the same run, the
//! same pattern on host memory as the native baseline.

use crate::args::{backing, guest_size, MachineArgs};
use crate::report::{quiet, ratio, ts, Phase};
use clap::Args;
use serde_json::json;
use slat::format::PAGE_SIZE;
use slat::Ept;
use slat_machine::ram::{format_size, Backing, GuestRam};
use slat_machine::{native_baseline, Machine, MachineConfig, PassParams};

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
    /// Print one JSON document with every figure instead of the text report.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub machine: MachineArgs,
}

/// Runs the benchmark.
pub fn run(a: &DemandPagingArgs) -> Result<(), String> {
    let q = quiet(a.json);
    let prefault = !a.machine.no_prefault;
    let cfg = MachineConfig {
        vm: a.machine.vm_config(),
        backing: a.backing,
        vcpus: a.vcpus as usize,
        bytes_per_vcpu: a.bytes,
        slots: 1,
        overlap: a.overlap,
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
        prefault,
        dirty: Default::default(),
    };
    let total = a.bytes * a.vcpus as u64;
    let p = Phase::start(
        format!(
            "mapping {} of {} guest RAM{}",
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
    let m = Machine::<Ept>::new(cfg).map_err(|e| e.to_string())?;
    p.done();
    let layout = m.layout();
    if !a.json {
        println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
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
    let guest = m.run_pass(params).map_err(|e| e.to_string())?;
    p.done();
    let stats = m.vm().stats();
    let pcpus = m.pcpus();
    drop(m);

    let p = Phase::start("native baseline: same pattern on host memory", q);
    let native_ram = GuestRam::new(a.backing, layout_len(total, a.backing), prefault)
        .map_err(|e| e.to_string())?;
    let native = native_baseline(layout, native_ram.addr(), params);
    drop(native_ram);
    p.done();

    let secs = guest.wall.as_secs_f64();
    let pages0 = guest.vcpus[0].pages;
    let per_vcpu = pages0 as f64 / secs;
    let overall = per_vcpu * a.vcpus as f64;
    let native_secs = native.wall.as_secs_f64();
    let native_overall = native.vcpus[0].pages as f64 / native_secs * a.vcpus as f64;
    let faults = stats.pf_fixed + stats.pf_fast;
    let touched: u64 = guest.vcpus.iter().map(|v| v.pages).sum();
    let ns_per_page = guest.wall.as_nanos() as f64 / (touched as f64 / a.vcpus as f64);
    let r = ratio(guest.wall, native.wall);
    if a.json {
        let doc = json!({
            "benchmark": "demand-paging",
            "backend": "sim",
            "config": {
                "vcpus": a.vcpus, "bytes_per_vcpu": a.bytes, "backing": a.backing.name(),
                "overlap": a.overlap, "prefault": prefault, "mmu_lock": cfg.vm.mmu_lock.name(),
                "fast_pf": cfg.vm.fast_pf, "ad_bits": cfg.vm.ad_bits,
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
            "stats": stats_json(&stats),
        });
        println!("{doc:#}");
    } else {
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
        println!(
            "Machine: {} vCPU(s) on {} physical CPU(s), mmu lock {}, fast page fault {}",
            a.vcpus,
            pcpus,
            cfg.vm.mmu_lock.name(),
            if cfg.vm.fast_pf { "on" } else { "off" }
        );
    }
    Ok(())
}

fn layout_len(total: u64, b: Backing) -> u64 {
    let ps = b.page_size().max(PAGE_SIZE);
    total.div_ceil(ps) * ps
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
    })
}
