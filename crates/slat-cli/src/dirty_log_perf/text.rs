//! dirty-log-perf's text report: the selftest's lines, then slat's.

use super::*;
use crate::args::ClearChunk;
use crate::report::ts;

/// The selftest's text report of one run, then slat's machine lines.
pub(super) fn print_text(r: &Report) {
    let c = &r.config;
    let total = c.work.bytes_per_vcpu * c.work.vcpus as u64;
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
    if let Some(mm) = &r.mmu_memory {
        println!("{}", mm.line("after the last iteration"));
    }
    if let Some(l) = r.clock.line() {
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

/// The `Machine:` line's engine settings beyond the common ones, and the log both machines
/// keep.
pub(super) fn settings(a: &DirtyLogPerfArgs, cfg: &Spec) -> (String, String) {
    let log = if a.log.dirty_ring.is_some() {
        "dirty ring"
    } else if cfg.manual_protect() {
        "manual protect (get + clear)"
    } else {
        "get clears"
    };
    let vm = &cfg.vm;
    let settings = format!(
        ", get-dirty-log {}, dirty tracking {}, eager split {}, recover {}, wrprot {}",
        vm.get_log.name(),
        vm.dirty_track.name(),
        if vm.eager_split { "on" } else { "off" },
        vm.recover.name(),
        vm.wrprot.name()
    );
    (settings, format!(", log {log}"))
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
