//! access-tracking-perf's text report.

use super::*;

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// The selftest's header lines, the test memory, and how the idle check will judge.
pub(super) fn header(
    a: &AccessTrackingPerfArgs,
    vm_cfg: &slat::VmConfig,
    layout: &Layout,
    total: u64,
) -> Vec<String> {
    let (c, why) = a.idle_check();
    vec![
        "Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages".into(),
        a.machine.format.header(vm_cfg),
        format!(
            "guest physical test memory: [0x{:x}, 0x{:x})",
            layout.gpa,
            layout.gpa + total
        ),
        format!(
            "Idle page check: {}{}",
            format!("{c:?}").to_lowercase(),
            why.map(|w| format!(" ({w})")).unwrap_or_default()
        ),
    ]
}

/// The selftest's lines, then the figures after them.
pub(super) fn print_run(a: &AccessTrackingPerfArgs, r: &Report) {
    for l in &r.lines {
        println!("{l}");
    }
    println!();
    for (i, m) in r.mark_memory_idle.iter().enumerate() {
        println!(
            "Mark memory idle #{}: {:.3} ms per GiB; {} leaves aged ({} pages young), {} pages reported dirty{}",
            i + 1,
            m.ms_per_gib,
            m.aged_leaves,
            m.young_pages,
            m.dirty_pages,
            if m.flushed { ", TLBs flushed" } else { "" }
        );
    }
    for name in [WRITE, READ] {
        if let Some(p) = r.pass(name) {
            let (f, x) = (p.faults, p.ratio_guest_over_native);
            println!("{name}: {f} faults ({x:.2}x native)");
        }
    }
    let s = &r.engine;
    println!(
        "Engine: {} slow faults, {} fast faults, {} spurious, {} retried; remote flushes {}/{} requested",
        s.pf_fixed, s.pf_fast, s.pf_spurious, s.pf_retry, s.remote_tlb_flush, s.remote_tlb_flush_requests
    );
    let (l4, l2, l1) = (s.leaves_4k, s.leaves_2m, s.leaves_1g);
    println!("Leaves: {l4} x 4K, {l2} x 2M, {l1} x 1G");
    let more = crate::report::bbm_cmo_line(a.machine.format, s).into_iter();
    for line in more.chain(crate::report::pinned_line(r.config.pinned_cpus.as_deref())) {
        println!("{line}");
    }
    println!(
        "Machine: {} vCPU(s) on {} physical CPU(s); {}, format {}, mmu lock {}, A/D bits {}, fast page fault {}, marking with {}",
        r.config.vcpus,
        r.config.vm.pcpus.unwrap_or(0),
        a.work.backing,
        a.machine.format.name(),
        r.config.vm.mmu_lock,
        on_off(a.machine.ad_bits.on()),
        on_off(r.config.vm.fast_pf),
        flush_mode(a).name()
    );
    if let Some(l) = r.clock.line() {
        println!("{l}");
    }
}

/// The line above the `--compare` table.
pub(super) fn compare_title(a: &AccessTrackingPerfArgs) -> String {
    let ad = a.machine.ad_bits.on();
    format!(
        "access-tracking-perf --compare: --format {}, -b {} per vCPU, {}{}, A/D bits {}, marking with {}{}",
        a.machine.format.name(),
        format_size(a.work.bytes),
        a.work.backing,
        if a.work.overlap { ", -o" } else { "" },
        on_off(ad),
        flush_mode(a).name(),
        if ad {
            "\n(A/D bits on: idle memory takes no faults, so fast PF hardly matters; compare with --ad-bits off to see it)"
        } else {
            ""
        }
    )
}
