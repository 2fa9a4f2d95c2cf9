//! `slat dirty-log-perf`: KVM's dirty_log_perf_test on the simulated machine — populate, enable
//! logging, N iterations of (dirty memory, get dirty log, clear dirty log), disable logging —
//! with, for every guest pass, the same pass on host memory in the same run and the ratio.

use crate::args::{
    backing, check_backends, check_kvm_ring, guest_size, refuse, ring_size, BackendArg, DirtyArgs,
    MachineArgs,
};
use crate::backend::{
    self, comparison_json, kvm_stats_line, print_comparison, Native, Pass, Row, Sim, Spec,
};
use crate::limits::{check_backing, GuestMemory};
use crate::report::{
    bbm_cmo_line, format_header, format_json, quiet, ratio, sim_format, ts, Phase,
};
use crate::sweep::{check_distinct, combinations, enum_value, parse_vary, print_table, Key, Vary};
use clap::Args;
use serde_json::json;
use slat_machine::ram::{format_size, Backing};
use slat_machine::PassParams;
use std::time::{Duration, Instant};

/// Flags of `slat dirty-log-perf` (the selftest's, plus slat's variant switches).
#[derive(Debug, Clone, Args)]
pub struct DirtyLogPerfArgs {
    /// Access pages in pseudo-random order instead of sequentially.
    #[arg(short = 'a')]
    pub random: bool,
    /// Guest memory per vCPU (k/m/g/t suffixes, powers of 1024; a multiple of 4 KiB).
    #[arg(short = 'b', value_parser = guest_size, default_value = "1G")]
    pub bytes: u64,
    /// Keep the vCPUs dirtying memory while dirty logging is disabled ("evil" mode).
    #[arg(short = 'e')]
    pub evil: bool,
    /// Do not enable manual dirty-log protection: GET_DIRTY_LOG clears and re-protects, and
    /// there is no CLEAR step.
    #[arg(short = 'g')]
    pub no_manual: bool,
    /// Iterations of dirtying memory and harvesting the log (at least 2).
    #[arg(short = 'i', value_parser = clap::value_parser!(u32).range(2..=100_000), default_value_t = 2)]
    pub iterations: u32,
    /// Overlap: every vCPU accesses all of guest memory instead of its own partition.
    #[arg(short = 'o')]
    pub overlap: bool,
    /// Seed of the guest's pseudo-random generator (vCPU i uses seed + i).
    #[arg(short = 'r', default_value_t = 1)]
    pub seed: u32,
    /// Host memory behind guest RAM: anonymous, anonymous_thp, anonymous_hugetlb (2 MiB),
    /// anonymous_hugetlb_1gb, shmem.
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// vCPUs.
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub vcpus: u32,
    /// Percentage of accesses in the dirty passes that are writes (0-100).
    #[arg(short = 'w', value_parser = clap::value_parser!(u32).range(0..=100), default_value_t = 100)]
    pub write_percent: u32,
    /// Memslots the guest memory is split into (must divide its pages evenly).
    #[arg(short = 'x', value_parser = clap::value_parser!(u32).range(1..=32_000), default_value_t = 1)]
    pub slots: u32,
    /// Log into per-vCPU dirty rings of N entries (a power of two, 128-65536) instead of
    /// bitmaps: "get dirty log" harvests the rings, "reset dirty rings" re-protects.
    #[arg(long = "dirty-ring", value_parser = ring_size)]
    pub dirty_ring: Option<u32>,
    /// The machine(s) to run on: `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` to run both
    /// in this process and print one table comparing them.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    /// Print one JSON document with every figure instead of the text report.
    #[arg(long)]
    pub json: bool,
    /// Run the benchmark once per combination of the listed settings, in this process, and
    /// print one table (KEY=V1,V2,...; repeat for more keys; keys: vcpus, format, fast-pf,
    /// mmu-lock, ad-bits, cmo, get-dirty-log, dirty-tracking, eager-split, recover, rebuild).
    /// Seed 000's table: `--vary vcpus=1,2 --vary fast-pf=on,off --vary mmu-lock=rwlock,mutex`;
    /// seed 004's: `-g --vary get-dirty-log=xchg,switch`; both formats: `--vary
    /// format=ept,stage2`.
    #[arg(long = "vary", value_parser = parse_vary, value_name = "KEY=V1,V2")]
    pub vary: Vec<Vary>,
    #[command(flatten)]
    pub dirty: DirtyArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
}

#[derive(Default)]
struct Iteration {
    dirty: Duration,
    native: Duration,
    get: Duration,
    clear: Option<Duration>,
    dirty_pages: u64,
    ring_full_exits: u64,
}

/// Runs the benchmark (or the sweep `--vary` asks for).
pub fn run(a: &DirtyLogPerfArgs) -> Result<(), String> {
    let mut engine_only = a.machine.engine_only();
    engine_only.extend(a.dirty.engine_only());
    if !a.vary.is_empty() {
        engine_only.push("--vary");
    }
    a.machine
        .format
        .check_backends(&a.backend)
        .unwrap_or_else(|e| refuse(e));
    check_backends(&a.backend, &engine_only).unwrap_or_else(|e| refuse(e));
    if let [first, second] = a.backend[..] {
        check(a).unwrap_or_else(|e| refuse(e));
        return side_by_side(a, [first, second]);
    }
    if !a.vary.is_empty() {
        return sweep(a);
    }
    check(a).unwrap_or_else(|e| refuse(e));
    let doc = measure(a, a.backend[0])?;
    if a.json {
        println!("{doc:#}");
    }
    Ok(())
}

/// Refuses settings the engine cannot run together (before anything is built), and sizes the
/// machines cannot hold: `-v` × `-b` without overflow, split evenly by `-x`, in the guest
/// physical address space of each machine, on this host together with the native baseline
/// (both are mapped at once).
fn check(a: &DirtyLogPerfArgs) -> Result<(), String> {
    let vm_config = a.dirty.apply(a.machine.vm_config());
    a.dirty
        .check(&vm_config, a.machine.format, a.dirty_ring.is_some())?;
    check_backing(&a.backend, a.backing)?;
    if let Some(ring) = a.dirty_ring {
        check_kvm_ring(&a.backend, ring, "--dirty-ring")?;
    }
    let mem = GuestMemory::per_vcpu(a.vcpus, a.bytes)?;
    mem.slots_divide(a.slots)?;
    mem.fits_gpa(&a.backend, a.machine.format, None)?;
    mem.fits_host(a.backing, 2, a.machine.tlb_bytes(a.vcpus))
}

/// One run; prints the text report unless `a.json`, and returns every figure as JSON.
fn measure(a: &DirtyLogPerfArgs, kind: BackendArg) -> Result<serde_json::Value, String> {
    let q = quiet(a.json);
    let prefault = !a.machine.no_prefault;
    let manual = a.dirty_ring.is_none() && !a.no_manual;
    let vm_config = a.dirty.apply(a.machine.vm_config());
    check(a)?;
    let cfg = Spec {
        format: a.machine.format,
        vm: vm_config,
        backing: a.backing,
        vcpus: a.vcpus as usize,
        bytes_per_vcpu: a.bytes,
        slots: a.slots as usize,
        overlap: a.overlap,
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
        prefault,
        manual_protect: manual,
        ring_entries: a.dirty_ring.unwrap_or(0),
    };
    let total = a.bytes * a.vcpus as u64;
    let p = Phase::start(
        format!(
            "{}{}: mapping {} of {} guest RAM and as much host memory for the native baseline",
            kind.name(),
            sim_format(kind, a.machine.format),
            format_size(total),
            a.backing
        ),
        q,
    );
    let m = backend::create(kind, &cfg)?;
    let layout = m.layout();
    let native_ram = Native::new(kind, layout, a.backing, prefault)?;
    p.done();
    let native = |params: PassParams| native_ram.run(params);
    let text = !a.json;
    if text {
        println!("Test iterations: {}", a.iterations);
        println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
        println!("{}", format_header(kind, a.machine.format, &cfg.vm));
        println!(
            "guest physical test memory: [0x{:x}, 0x{:x})",
            layout.gpa,
            layout.gpa + total
        );
    }
    // Populate: every vCPU writes its memory once, sequentially.
    let populate_params = PassParams {
        write_percent: 100,
        random: false,
        seed: a.seed,
    };
    let populate = m.run_pass(populate_params)?;
    let populate_native = native(populate_params)?;
    if text {
        println!("Populate memory time: {}", ts(populate.wall));
        print_native("Populate", &populate, &populate_native);
    }

    let t0 = Instant::now();
    m.set_dirty_logging(true)?;
    let enable = t0.elapsed();
    if text {
        println!("Enabling dirty logging time: {}", ts(enable));
        println!();
    }

    let params = PassParams {
        write_percent: a.write_percent,
        random: a.random,
        seed: a.seed,
    };
    let pps = m.pages_per_slot();
    let slots = m.slot_ids();
    let mut bitmaps: Vec<Vec<u64>> = slots
        .iter()
        .map(|_| vec![0u64; pps.div_ceil(64) as usize])
        .collect();
    let mut iters = Vec::new();
    for i in 1..=a.iterations {
        let mut it = Iteration::default();
        let pass = m.run_pass(params)?;
        it.dirty = pass.wall;
        it.ring_full_exits = pass.vcpus.iter().map(|v| v.ring_full_exits).sum();
        if text {
            println!("Iteration {i} dirty memory time: {}", ts(pass.wall));
        }
        if a.dirty_ring.is_some() {
            let t0 = Instant::now();
            it.dirty_pages = m.collect_dirty_rings();
            it.get = t0.elapsed();
            let t0 = Instant::now();
            m.reset_dirty_rings()?;
            it.clear = Some(t0.elapsed());
            if text {
                println!("Iteration {i} get dirty log time: {}", ts(it.get));
                println!(
                    "Iteration {i} reset dirty rings time: {}",
                    ts(it.clear.unwrap_or_default())
                );
            }
        } else {
            let t0 = Instant::now();
            for (&id, b) in slots.iter().zip(bitmaps.iter_mut()) {
                it.dirty_pages += m.get_dirty_log(id, b)?;
            }
            it.get = t0.elapsed();
            if text {
                println!("Iteration {i} get dirty log time: {}", ts(it.get));
            }
            if manual {
                let t0 = Instant::now();
                for (&id, b) in slots.iter().zip(bitmaps.iter()) {
                    m.clear_dirty_log(id, 0, pps, b)?;
                }
                let c = t0.elapsed();
                it.clear = Some(c);
                if text {
                    println!("Iteration {i} clear dirty log time: {}", ts(c));
                }
            }
        }
        // The native pass runs after the harvest, not between the guest pass and it: it
        // touches every page of another gigabyte and would evict the page tables and bitmap
        // the harvest reads, which a VMM's harvest right after the guest ran finds warm.
        let nat = native(params)?;
        it.native = nat.wall;
        if text {
            println!(
                "Iteration {i} native memory time: {} (guest/native {:.2}x)",
                ts(nat.wall),
                ratio(pass.wall, nat.wall)
            );
        }
        iters.push(it);
    }

    // Disable, with the vCPUs still dirtying memory under -e.
    if a.evil {
        m.start_loop(params)?;
    }
    let t0 = Instant::now();
    m.set_dirty_logging(false)?;
    let disable = t0.elapsed();
    if a.evil {
        m.halt()?;
    }
    let stats = m.stats();
    let pcpus = m.sim().map(|s| s.pcpus());
    let get_total: Duration = iters.iter().map(|i| i.get).sum();
    let clear_total: Option<Duration> = iters.iter().map(|i| i.clear).sum();
    let n = a.iterations;
    let ring = a.dirty_ring.is_some();
    if text {
        println!("Disabling dirty logging time: {}", ts(disable));
        println!();
        println!(
            "Get dirty log over {n} iterations took {}. (Avg {}/iteration)",
            ts(get_total),
            ts(get_total / n)
        );
        if let Some(c) = clear_total {
            let what = if ring {
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
        let dirty_pages: Vec<String> = iters.iter().map(|i| i.dirty_pages.to_string()).collect();
        println!(
            "Dirty pages harvested per iteration: {}",
            dirty_pages.join(", ")
        );
        if ring {
            let exits: u64 = iters.iter().map(|i| i.ring_full_exits).sum();
            println!("Dirty ring full exits during the dirty passes: {exits}");
        }
        match m.sim() {
            Some(sim) => print_engine(a, sim, &cfg, manual),
            None => print_kvm(a, &stats, manual),
        }
    }
    let doc = json!({
        "benchmark": "dirty-log-perf",
        "backend": kind.name(),
        "format": format_json(kind, a.machine.format),
        "config": {
            "format": format_json(kind, a.machine.format),
            "vcpus": a.vcpus, "bytes_per_vcpu": a.bytes, "backing": a.backing.name(),
            "iterations": n, "random": a.random, "overlap": a.overlap, "evil": a.evil,
            "write_percent": a.write_percent, "slots": a.slots, "seed": a.seed,
            "manual_protect": manual, "dirty_ring": a.dirty_ring,
            "mmu_lock": cfg.vm.mmu_lock.name(), "fast_pf": cfg.vm.fast_pf,
            "ad_bits": cfg.vm.ad_bits, "get_dirty_log": cfg.vm.get_log.name(),
            "dirty_tracking": cfg.vm.dirty_track.name(),
            "eager_split": cfg.vm.eager_split, "recover": cfg.vm.recover.name(),
            "cmo": cfg.vm.cmo.name(), "rebuild": cfg.vm.rebuild.name(),
            "tlb_entries": cfg.tlb_entries, "pcpus": pcpus, "prefault": prefault,
        },
        "populate_memory_time_s": populate.wall.as_secs_f64(),
        "populate_native_time_s": populate_native.wall.as_secs_f64(),
        "enabling_dirty_logging_time_s": enable.as_secs_f64(),
        "iterations": iters.iter().enumerate().map(|(k, i)| json!({
            "iteration": k + 1,
            "dirty_memory_time_s": i.dirty.as_secs_f64(),
            "native_memory_time_s": i.native.as_secs_f64(),
            "ratio_guest_over_native": ratio(i.dirty, i.native),
            "get_dirty_log_time_s": i.get.as_secs_f64(),
            "clear_dirty_log_time_s": if ring { None } else { i.clear.map(|c| c.as_secs_f64()) },
            "reset_dirty_rings_time_s": if ring { i.clear.map(|c| c.as_secs_f64()) } else { None },
            "dirty_pages": i.dirty_pages,
            "ring_full_exits": i.ring_full_exits,
        })).collect::<Vec<_>>(),
        "disabling_dirty_logging_time_s": disable.as_secs_f64(),
        "get_dirty_log_total_s": get_total.as_secs_f64(),
        "clear_dirty_log_total_s": clear_total.map(|c| c.as_secs_f64()),
        "stats": stats,
    });
    drop(native_ram);
    Ok(doc)
}

/// The simulated engine's counters and settings, after the selftest's lines.
fn print_engine(a: &DirtyLogPerfArgs, m: &dyn Sim, cfg: &Spec, manual: bool) {
    let stats = m.engine_stats();
    let ring = a.dirty_ring.is_some();
    {
        println!(
            "Engine: {} slow faults, {} fast faults, {} spurious, {} retried; {} splits, {} recoveries; remote flushes {}/{} requested",
            stats.pf_fixed,
            stats.pf_fast,
            stats.pf_spurious,
            stats.pf_retry,
            stats.splits,
            stats.recoveries,
            stats.remote_tlb_flush,
            stats.remote_tlb_flush_requests
        );
        println!(
            "Leaves now: {} x 4K, {} x 2M, {} x 1G; page tables: {} pages ({})",
            stats.leaves_4k,
            stats.leaves_2m,
            stats.leaves_1g,
            stats.table_pages,
            format_size(stats.table_bytes)
        );
        if let Some(line) = bbm_cmo_line(cfg.format, &stats) {
            println!("{line}");
        }
        println!(
            "Machine: {} vCPU(s) on {} physical CPU(s); format {}, mmu lock {}, fast page fault {}, log {}, get-dirty-log {}, dirty tracking {}, eager split {}, recover {}",
            a.vcpus,
            m.pcpus(),
            cfg.format.name(),
            cfg.vm.mmu_lock.name(),
            on_off(cfg.vm.fast_pf),
            if ring {
                "dirty ring"
            } else if manual {
                "manual protect (get + clear)"
            } else {
                "get clears"
            },
            cfg.vm.get_log.name(),
            cfg.vm.dirty_track.name(),
            on_off(cfg.vm.eager_split),
            cfg.vm.recover.name()
        );
    }
}

/// KVM's counters and the run's settings, after the selftest's lines.
fn print_kvm(a: &DirtyLogPerfArgs, stats: &serde_json::Value, manual: bool) {
    println!("{}", kvm_stats_line(stats));
    println!(
        "Machine: {} vCPU(s) on the host's /dev/kvm; log {}",
        a.vcpus,
        if a.dirty_ring.is_some() {
            "dirty ring"
        } else if manual {
            "manual protect (get + clear)"
        } else {
            "get clears"
        }
    );
}

fn print_native(what: &str, guest: &Pass, native: &Pass) {
    println!(
        "{what} native memory time: {} (guest/native {:.2}x)",
        ts(native.wall),
        ratio(guest.wall, native.wall)
    );
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// `--vary`: one run per combination, one table.
fn sweep(a: &DirtyLogPerfArgs) -> Result<(), String> {
    check_distinct(&a.vary).unwrap_or_else(|e| refuse(e));
    let combos = combinations(&a.vary);
    // Every combination's settings, checked before the first run: a refusal at row 5 after
    // minutes of measuring would waste them.
    let mut runs = Vec::new();
    for combo in &combos {
        let mut b = a.clone();
        b.vary.clear();
        b.json = true;
        for (key, v) in combo {
            match key {
                Key::Vcpus => {
                    b.vcpus = v
                        .parse()
                        .unwrap_or_else(|_| refuse(format!("--vary vcpus: bad count `{v}`")))
                }
                Key::Format => b.machine.format = enum_value(v),
                Key::FastPf => b.machine.fast_pf = enum_value(v),
                Key::MmuLock => b.machine.mmu_lock = enum_value(v),
                Key::AdBits => b.machine.ad_bits = enum_value(v),
                Key::Cmo => b.machine.cmo = enum_value(v),
                Key::GetDirtyLog => b.dirty.get_log = enum_value(v),
                Key::DirtyTracking => b.dirty.tracking = enum_value(v),
                Key::EagerSplit => b.dirty.eager_split = enum_value(v),
                Key::Recover => b.dirty.recover = enum_value(v),
                Key::Rebuild => b.dirty.rebuild = enum_value(v),
            }
        }
        let label: Vec<String> = combo
            .iter()
            .map(|(k, v)| format!("{}={v}", k.name()))
            .collect();
        if let Err(e) = check(&b) {
            refuse(format!("--vary row {}: {e}", label.join(" ")));
        }
        runs.push((b, label));
    }
    let mut rows = Vec::new();
    let mut docs = Vec::new();
    for (n, ((b, label), combo)) in runs.iter().zip(&combos).enumerate() {
        if !quiet(a.json) {
            eprintln!(
                "[slat] sweep {}/{}: {}",
                n + 1,
                combos.len(),
                label.join(" ")
            );
        }
        let doc = measure(b, a.backend[0])?;
        let m = metrics(&doc, a.dirty_ring.is_some());
        let secs = |x: Option<f64>| x.map(|x| format!("{x:.6}")).unwrap_or("-".into());
        let mut row: Vec<String> = combo.iter().map(|(_, v)| v.clone()).collect();
        row.extend([
            secs(m.populate),
            secs(m.enable),
            secs(m.dirty2),
            secs(m.native2),
            m.ratio2.map(|r| format!("{r:.2}x")).unwrap_or("-".into()),
            secs(m.get_avg),
            secs(m.clear_avg),
            secs(m.disable),
        ]);
        rows.push(row);
        docs.push(json!({ "settings": label, "result": doc }));
    }
    if a.json {
        println!(
            "{:#}",
            json!({ "benchmark": "dirty-log-perf", "sweep": docs })
        );
        return Ok(());
    }
    let format = if a.vary.iter().any(|v| v.key == Key::Format) {
        String::new()
    } else {
        format!(" --format {}", a.machine.format.name())
    };
    println!(
        "dirty-log-perf sweep:{format} -b {} -i {}{}{}{}, one run per row, all in this process",
        format_size(a.bytes),
        a.iterations,
        if a.no_manual { " -g" } else { "" },
        if a.random { " -a" } else { "" },
        if a.write_percent != 100 {
            format!(" -w {}", a.write_percent)
        } else {
            String::new()
        },
    );
    let mut head: Vec<String> = a.vary.iter().map(|v| v.key.name().to_string()).collect();
    let clear = if a.dirty_ring.is_some() {
        "reset rings avg (s)"
    } else {
        "clear avg (s)"
    };
    head.extend(
        [
            "populate (s)",
            "enable (s)",
            "iter 2 dirty (s)",
            "iter 2 native (s)",
            "guest/native",
            "get avg (s)",
            clear,
            "disable (s)",
        ]
        .map(String::from),
    );
    print_table(&head, &rows);
    Ok(())
}

/// The figures a table row shows, from one run's JSON document.
struct Metrics {
    populate: Option<f64>,
    enable: Option<f64>,
    dirty2: Option<f64>,
    native2: Option<f64>,
    ratio2: Option<f64>,
    get_avg: Option<f64>,
    clear_avg: Option<f64>,
    disable: Option<f64>,
}

fn metrics(doc: &serde_json::Value, ring: bool) -> Metrics {
    let iters = doc["iterations"].as_array().cloned().unwrap_or_default();
    // Iteration 2 is the selftest's steady state (iteration 1 may still split or fault).
    let it2 = iters
        .get(1.min(iters.len().saturating_sub(1)))
        .cloned()
        .unwrap_or_default();
    let avg = |field: &str| {
        let xs: Vec<f64> = iters.iter().filter_map(|i| i[field].as_f64()).collect();
        (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
    };
    Metrics {
        populate: doc["populate_memory_time_s"].as_f64(),
        enable: doc["enabling_dirty_logging_time_s"].as_f64(),
        dirty2: it2["dirty_memory_time_s"].as_f64(),
        native2: it2["native_memory_time_s"].as_f64(),
        ratio2: it2["ratio_guest_over_native"].as_f64(),
        get_avg: avg("get_dirty_log_time_s"),
        clear_avg: avg(if ring {
            "reset_dirty_rings_time_s"
        } else {
            "clear_dirty_log_time_s"
        }),
        disable: doc["disabling_dirty_logging_time_s"].as_f64(),
    }
}

/// `--backend sim,kvm`: the same run on both machines, one after the other in this process,
/// and one table of every phase with the ratio of the first to the second.
fn side_by_side(a: &DirtyLogPerfArgs, kinds: [BackendArg; 2]) -> Result<(), String> {
    let mut docs = Vec::new();
    for kind in kinds {
        let mut b = a.clone();
        b.json = true;
        if !quiet(a.json) {
            eprintln!("[slat] running on {}", kind.name());
        }
        docs.push(measure(&b, kind)?);
    }
    let ring = a.dirty_ring.is_some();
    let [x, y] = [0, 1].map(|k| metrics(&docs[k], ring));
    let rows: Vec<Row> = vec![
        ("populate memory", x.populate, y.populate),
        ("enable dirty logging", x.enable, y.enable),
        ("iteration 2 dirty memory", x.dirty2, y.dirty2),
        ("iteration 2 native memory", x.native2, y.native2),
        ("get dirty log avg", x.get_avg, y.get_avg),
        (
            if ring {
                "reset dirty rings avg"
            } else {
                "clear dirty log avg"
            },
            x.clear_avg,
            y.clear_avg,
        ),
        ("disable dirty logging", x.disable, y.disable),
    ];
    let (n0, n1) = (kinds[0].name(), kinds[1].name());
    if a.json {
        let [d0, d1] = [docs.remove(0), docs.remove(0)];
        let doc = comparison_json("dirty-log-perf", [n0, n1], &rows, [d0, d1]);
        println!("{doc:#}");
        return Ok(());
    }
    println!(
        "dirty-log-perf on {n0} and {n1}: --format {} (sim) -v {} -b {} -i {}{}{}{}, one run each, in this process; times in seconds",
        a.machine.format.name(),
        a.vcpus,
        format_size(a.bytes),
        a.iterations,
        if ring {
            " --dirty-ring"
        } else if a.no_manual {
            " -g"
        } else {
            ""
        },
        if a.random { " -a" } else { "" },
        if a.write_percent != 100 {
            format!(" -w {}", a.write_percent)
        } else {
            String::new()
        },
    );
    print_comparison([n0, n1], &rows);
    println!(
        "guest/native at iteration 2: {n0} {}, {n1} {}",
        x.ratio2.map(|r| format!("{r:.2}x")).unwrap_or("-".into()),
        y.ratio2.map(|r| format!("{r:.2}x")).unwrap_or("-".into())
    );
    Ok(())
}
