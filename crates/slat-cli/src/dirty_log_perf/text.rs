//! dirty-log-perf's text report: the selftest's lines, then slat's.

use super::*;

/// The selftest's text report of one run, then slat's machine lines.
pub(super) fn print_text(r: &Report) {
    let c = &r.config;
    let total = c.bytes_per_vcpu * c.vcpus as u64;
    println!("Test iterations: {}", c.iterations);
    println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
    println!("{}", r.format_header);
    println!(
        "guest physical test memory: [0x{:x}, 0x{:x})",
        r.gpa,
        r.gpa + total
    );
    println!("Populate memory time: {}", ts(r.populate));
    println!(
        "Populate native memory time: {} (guest/native {:.2}x)",
        ts(r.populate_native),
        ratio(r.populate, r.populate_native)
    );
    println!("Enabling dirty logging time: {}", ts(r.enable));
    println!();
    for it in &r.iterations {
        print_iteration(it);
    }
    println!("Disabling dirty logging time: {}", ts(r.disable));
    println!();
    print_totals(r);
    if let Some(c) = &r.concurrent {
        println!();
        for l in c.lines() {
            println!("{l}");
        }
        println!();
    }
    for l in &r.machine_lines {
        println!("{l}");
    }
}

pub(super) fn print_iteration(it: &Iteration) {
    let i = it.iteration;
    println!("Iteration {i} dirty memory time: {}", ts(it.dirty));
    println!("Iteration {i} get dirty log time: {}", ts(it.harvest.get));
    if let Some(c) = it.harvest.reset {
        println!("Iteration {i} reset dirty rings time: {}", ts(c));
    }
    if let Some(c) = it.harvest.clear {
        println!("Iteration {i} clear dirty log time: {}", ts(c));
    }
    println!(
        "Iteration {i} native memory time: {} (guest/native {:.2}x)",
        ts(it.native),
        it.ratio_guest_over_native
    );
}

pub(super) fn print_totals(r: &Report) {
    let n = r.config.iterations;
    println!(
        "Get dirty log over {n} iterations took {}. (Avg {}/iteration)",
        ts(r.get_total),
        ts(r.get_total / n)
    );
    if let Some(c) = r.clear_total {
        let what = if r.ring() {
            "Reset dirty rings"
        } else {
            "Clear dirty log"
        };
        println!(
            "{what} over {n} iterations took {}. (Avg {}/iteration)",
            ts(c),
            ts(c / n)
        );
    }
    println!();
    let dirty_pages: Vec<String> = r
        .iterations
        .iter()
        .map(|i| i.harvest.dirty_pages.to_string())
        .collect();
    println!(
        "Dirty pages harvested per iteration: {}",
        dirty_pages.join(", ")
    );
    if r.ring() {
        let exits: u64 = r.iterations.iter().map(|i| i.ring_full_exits).sum();
        println!("Dirty ring full exits during the dirty passes: {exits}");
    }
}

pub(super) fn log_kind(a: &DirtyLogPerfArgs, manual: bool) -> &'static str {
    if a.log.dirty_ring.is_some() {
        "dirty ring"
    } else if manual {
        "manual protect (get + clear)"
    } else {
        "get clears"
    }
}

/// The simulated engine's counters and settings, after the selftest's lines.
pub(super) fn engine_lines(a: &DirtyLogPerfArgs, m: &dyn Sim, cfg: &Spec) -> Vec<String> {
    let stats = m.engine_stats();
    let mut lines = vec![
        format!(
            "Engine: {} slow faults, {} fast faults, {} spurious, {} retried; {} splits, {} recoveries; remote flushes {}/{} requested",
            stats.pf_fixed,
            stats.pf_fast,
            stats.pf_spurious,
            stats.pf_retry,
            stats.splits,
            stats.recoveries,
            stats.remote_tlb_flush,
            stats.remote_tlb_flush_requests
        ),
        format!(
            "Leaves now: {} x 4K, {} x 2M, {} x 1G; page tables: {} pages ({})",
            stats.leaves_4k,
            stats.leaves_2m,
            stats.leaves_1g,
            stats.table_pages,
            format_size(stats.table_bytes)
        ),
    ];
    lines.extend(bbm_cmo_line(cfg.format, &stats));
    lines.push(format!(
        "Machine: {} vCPU(s) on {} physical CPU(s); format {}, mmu lock {}, fast page fault {}, log {}, get-dirty-log {}, dirty tracking {}, eager split {}, recover {}, wrprot {}",
        a.work.vcpus,
        m.pcpus(),
        cfg.format.name(),
        cfg.vm.mmu_lock.name(),
        on_off(cfg.vm.fast_pf),
        log_kind(a, cfg.manual_protect()),
        cfg.vm.get_log.name(),
        cfg.vm.dirty_track.name(),
        on_off(cfg.vm.eager_split),
        cfg.vm.recover.name(),
        cfg.vm.wrprot.name()
    ));
    lines
}

/// KVM's counters and the run's settings, after the selftest's lines.
pub(super) fn kvm_lines(
    a: &DirtyLogPerfArgs,
    stats: &serde_json::Value,
    manual: bool,
) -> Vec<String> {
    vec![
        kvm_stats_line(stats),
        format!(
            "Machine: {} vCPU(s) on the host's /dev/kvm; log {}",
            a.work.vcpus,
            log_kind(a, manual)
        ),
    ]
}

pub(super) fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// The flags beside -v/-b/-i that shape what a table shows, as the user typed them.
pub(super) fn run_flags(a: &DirtyLogPerfArgs) -> String {
    let mut f = String::new();
    if let Some(n) = a.log.dirty_ring {
        f += &format!(" --dirty-ring {n}");
    } else if a.log.no_manual {
        f += " -g";
    }
    if a.log.clear_chunk != ClearChunk::Slot {
        f += &format!(" --clear-chunk {}", a.log.clear_chunk.name());
    }
    if a.random {
        f += " -a";
    }
    if a.write_percent != 100 {
        f += &format!(" -w {}", a.write_percent);
    }
    if a.concurrent {
        f += " --concurrent";
        if let Some(ms) = a.harvest_interval {
            f += &format!(" --harvest-interval {ms}");
        }
    }
    f
}
