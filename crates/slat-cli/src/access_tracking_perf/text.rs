//! access-tracking-perf's text and JSON reports and its --compare table.

use super::*;

/// The selftest's header lines, the test memory, and how the idle check will judge.
pub(super) fn print_header(
    a: &AccessTrackingPerfArgs,
    vm_cfg: &VmConfig,
    layout: &Layout,
    total: u64,
) {
    println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
    println!("{}", a.machine.format.header(vm_cfg));
    println!(
        "guest physical test memory: [0x{:x}, 0x{:x})",
        layout.gpa,
        layout.gpa + total
    );
    let (c, why) = a.idle_check();
    println!(
        "Idle page check: {}{}",
        idle_check_name(c),
        why.map(|w| format!(" ({w})")).unwrap_or_default()
    );
}

pub(super) fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// The figures after the selftest's lines.
pub(super) fn summary(a: &AccessTrackingPerfArgs, r: &RunResult) {
    let s = &r.stats;
    println!();
    for (i, m) in r.marks.iter().enumerate() {
        println!(
            "Mark memory idle #{}: {:.3} ms per GiB; {} leaves aged ({} pages young), {} pages reported dirty{}",
            i + 1,
            m.ms_per_gib(),
            m.report.aged_leaves,
            m.report.young_pages,
            m.report.dirty_pages,
            if m.report.flushed { ", TLBs flushed" } else { "" }
        );
    }
    for name in ["Writing to idle memory", "Reading from idle memory"] {
        if let Some(p) = r.pass(name) {
            println!(
                "{name}: {} faults ({:.2}x native)",
                p.faults(),
                ratio(p.guest.wall, p.native.wall)
            );
        }
    }
    println!(
        "Engine: {} slow faults, {} fast faults, {} spurious, {} retried; remote flushes {}/{} requested",
        s.pf_fixed, s.pf_fast, s.pf_spurious, s.pf_retry, s.remote_tlb_flush, s.remote_tlb_flush_requests
    );
    println!(
        "Leaves: {} x 4K, {} x 2M, {} x 1G",
        s.leaves_4k, s.leaves_2m, s.leaves_1g
    );
    if let Some(line) = bbm_cmo_line(a.machine.format, s) {
        println!("{line}");
    }
    if let Some(line) = pinned_line(r.pinned.as_deref()) {
        println!("{line}");
    }
    println!(
        "Machine: {} vCPU(s) on {} physical CPU(s); {}, format {}, mmu lock {}, A/D bits {}, fast page fault {}, marking with {}",
        r.vcpus,
        r.pcpus,
        a.work.backing,
        a.machine.format.name(),
        a.machine.vm_config().mmu_lock.name(),
        on_off(a.machine.ad_bits.on()),
        on_off(r.fast_pf),
        flush_mode(a).name()
    );
}

pub(super) fn run_json(a: &AccessTrackingPerfArgs, r: &RunResult) -> RunJson {
    let (check, why) = a.idle_check();
    RunJson {
        benchmark: "access-tracking-perf",
        backend: "sim",
        format: a.machine.format.name(),
        config: Config {
            vm: VmSettings::new(
                BackendArg::Sim,
                a.machine.format,
                &machine_config(a, r.vcpus, r.fast_pf).vm,
                a.machine.tlb_entries,
                Some(r.pcpus),
                !a.machine.no_prefault,
            ),
            vcpus: r.vcpus,
            bytes_per_vcpu: a.work.bytes,
            backing: a.work.backing.name(),
            overlap: a.work.overlap,
            age_flush: a.age_flush.on(),
            idle_check: idle_check_name(check),
            idle_check_reason: why,
            pinned_cpus: r.pinned.clone(),
        },
        passes: r.passes.iter().map(Pass::json).collect(),
        mark_memory_idle: r.marks.iter().map(Mark::json).collect(),
        still_idle: r
            .idle
            .iter()
            .map(|i| IdleJson {
                after: i.pass,
                pages: i.pages,
                still_idle: i.still_idle,
                fraction: i.fraction(),
            })
            .collect(),
        warnings: r.warnings.clone(),
        stats: stats_json(&r.stats),
    }
}

/// The fast-page-fault-for-the-TDP-MMU table from one process: fast PF on/off × -v 1/-v 2.
pub(super) fn compare(a: &AccessTrackingPerfArgs) -> crate::error::CliResult {
    let q = quiet(a.out.json);
    let mut runs = Vec::new();
    for vcpus in [1u32, 2] {
        for fast_pf in [true, false] {
            let p = Phase::start(
                format!("run: -v {vcpus}, fast page fault {}", on_off(fast_pf)),
                q,
            );
            runs.push(run_one(a, vcpus, fast_pf, false)?);
            p.done();
        }
    }
    if a.out.json {
        let doc = CompareJson {
            benchmark: "access-tracking-perf",
            compare: runs.iter().map(|r| run_json(a, r)).collect(),
        };
        return crate::output::print_json(&doc, &a.backend);
    }
    println!(
        "access-tracking-perf --compare: --format {}, -b {} per vCPU, {}{}, A/D bits {}, marking with {}",
        a.machine.format.name(),
        format_size(a.work.bytes),
        a.work.backing,
        if a.work.overlap { ", -o" } else { "" },
        on_off(a.machine.ad_bits.on()),
        flush_mode(a).name()
    );
    if a.machine.ad_bits.on() {
        println!(
            "(A/D bits on: idle memory takes no faults, so fast PF hardly matters; compare with --ad-bits off to see it)"
        );
    }
    println!();
    print_compare_table(&runs);
    Ok(())
}

/// The `--compare` table, then every run's warnings.
fn print_compare_table(runs: &[RunResult]) {
    println!(
        "| {:<22} | {:>16} | {:>22} | {:>12} | {:>7} | {:>24} | {:>7} | {:>8} |",
        "variant",
        "Mark memory idle",
        "Writing to idle memory",
        "native",
        "ratio",
        "Reading from idle memory",
        "ratio",
        "faults"
    );
    println!(
        "|{:-<24}|{:-<18}|{:-<24}|{:-<14}|{:-<9}|{:-<26}|{:-<9}|{:-<10}|",
        "", "", "", "", "", "", "", ""
    );
    for r in runs {
        let w = r.pass("Writing to idle memory");
        let rd = r.pass("Reading from idle memory");
        let mark = r.marks.first().map(|m| m.time).unwrap_or_default();
        let cell = |p: Option<&Pass>| p.map(|p| ts(p.guest.wall)).unwrap_or_default();
        let rat = |p: Option<&Pass>| {
            p.map(|p| format!("{:.2}x", ratio(p.guest.wall, p.native.wall)))
                .unwrap_or_default()
        };
        println!(
            "| {:<22} | {:>16} | {:>22} | {:>12} | {:>7} | {:>24} | {:>7} | {:>8} |",
            format!("-v {} fast PF {}", r.vcpus, on_off(r.fast_pf)),
            ts(mark),
            cell(w),
            w.map(|p| ts(p.native.wall)).unwrap_or_default(),
            rat(w),
            cell(rd),
            rat(rd),
            w.map(|p| p.faults()).unwrap_or_default()
        );
    }
    for r in runs {
        for w in &r.warnings {
            println!(
                "warning (-v {}, fast PF {}): {w}",
                r.vcpus,
                on_off(r.fast_pf)
            );
        }
    }
}
