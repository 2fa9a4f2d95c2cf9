//! `slat private-mem-perf`: what it costs the *host kernel* to fault in private memory (host
//! direct map for private memory). Confidential guests' private pages are removed from the host's direct map; where the
//! direct map covers a page with a 2 MiB or 1 GiB leaf, the leaf is split to 4 KiB entries
//! first (under a global lock, with a TLB flush). `memfd_secret(2)` does exactly that for
//! every page it faults in, so `--backend host` fills memfd_secret memory and, as the native
//! floor, plain memfd memory of the same size with the same access pattern, and reads the
//! kernel's own counters (direct-map splits, DirectMap sizes, TLB shootdowns) around each.
//!
//! The secret memory is filled twice: first into the direct map as this host has it, then —
//! after unmapping and closing it, which returns its pages to the allocator with 4 KiB
//! direct-map entries that are not merged back — again, which mostly gets those pages back
//! and so finds them already split. The split counters say how much of each fill split. A last
//! memfd fill then runs over pages the secret fills left split: what a fragmented direct map
//! costs ordinary faults (the kernel zeroes each new page through it).
//!
//! `--backend sim` runs the host-direct-map benchmark on the simulated machine instead ([`sim`]): a
//! confidential guest faulting in its private memory through slat's engine and a simulated
//! host direct map, one row per direct-map variant.

mod counters;
mod gmem;
mod mem;
mod memlock;
pub mod sim;

use crate::args::{guest_size, OutputArgs, Switch};
use crate::driver::vary::{engine, names, pick, variants, Key, Values};
use crate::driver::{self};
use crate::error::{CliError, CliResult};
use crate::output::{cell, print_table, ratio_cell, summarize, Better, Metric, MetricSummary};
use crate::report::quiet;
use crate::vary_key;
use clap::{Args, ValueEnum};
use counters::{Deltas, DirectMap, DirectMapDelta, Snapshot};
use mem::{Fill, Kind, Region, Sample};
use serde::Serialize;
use slat::DirectMapPolicy;
use slat_workload::format_size;
use std::time::{Duration, Instant};

const NAME: &str = "private-mem-perf";

/// What the figures are the cost of: said in the text and in JSON.
const WHOSE: &str = "the host kernel's cost of faulting in memory removed from its own direct map (memfd_secret), measured by host threads: not a guest's fault-in cost";

/// `--backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrivBackend {
    /// This host's kernel: memfd_secret against memfd.
    Host,
    /// The simulated machine: a confidential guest's vCPUs fault in private memory through
    /// slat's engine and a simulated host direct map.
    Sim,
}

/// Flags of `slat private-mem-perf`.
#[derive(Debug, Args)]
pub struct PrivateMemPerfArgs {
    /// Threads (host) or vCPUs (sim), each faulting in its own share of the memory (1-512).
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub threads: u32,
    /// Memory per thread or vCPU: bytes with an optional k/m/g/t suffix (powers of 1024), a
    /// non-zero multiple of 4 KiB. Each fill maps threads x this at once.
    #[arg(short = 'b', value_parser = guest_size, default_value = "256M")]
    pub bytes: u64,
    /// Milliseconds between two samples of the fill rate and the direct-map counters
    /// (100-1000); the last sample of a fill is the shorter remainder.
    #[arg(long = "samples-ms", value_name = "MS", value_parser = clap::value_parser!(u64).range(100..=1000), default_value_t = 100)]
    pub samples_ms: u64,
    /// The machine: `host` (this host's kernel, memfd_secret; the direct-map entries it splits
    /// stay split after the run, as the kernel does not merge them back, so later first fills
    /// on this host split less). `sim` (a simulated confidential guest and host direct map,
    /// one row per variant, by default every --direct-map policy with --kernel-flush off and
    /// on).
    #[arg(long, value_enum, default_value = "host")]
    pub backend: PrivBackend,
    /// sim: the host direct map's policy. `2m-split`: huge leaves, each split on demand under
    /// one global lock with a flush of every host CPU (the patch series' baseline); `4k`: pre-split
    /// to 4 KiB at start; `none`: left alone (TDX-style). Without it and without --vary, the
    /// run covers all three.
    #[arg(long = "direct-map", value_name = "POLICY", value_parser = parse_policy)]
    pub direct_map: Option<DirectMapPolicy>,
    /// sim: after each page leaves the direct map, flush every host CPU's kernel TLB and wait
    /// for each vCPU thread to acknowledge (what "cratered performance" in the patch series). Without
    /// it and without --vary, the run covers off and on.
    #[arg(long = "kernel-flush", value_enum, value_name = "on|off")]
    pub kernel_flush: Option<Switch>,
    /// sim: when a whole 2 MiB block of the direct map is back (the conversion to shared), put
    /// the 2 MiB leaf back (2m-split only).
    #[arg(long)]
    pub collapse: bool,
    /// sim: one row per combination; a key given here overrides its flag (the keys: --help).
    #[arg(long, value_name = "KEY=V1,V2,...", value_parser = driver::vary::parser(VARY), long_help = driver::vary::help(VARY, "sim only: every combination is a row of each run (--repeat runs them all N times)."))]
    pub vary: Vec<driver::vary::Vary>,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// One fill of one kind of memory.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `memfd`, `secret-first`, `secret-second` or `memfd-after`.
    pub variant: &'static str,
    /// What the fill measured.
    pub description: &'static str,
    /// Bytes filled (all threads).
    pub bytes: u64,
    /// memfd_create/memfd_secret, ftruncate and mmap.
    pub setup_s: f64,
    /// From the start barrier to the last thread's last page.
    pub fill_s: f64,
    /// Fault-in rate over all threads, 10^9 bytes per second.
    pub gb_per_s: f64,
    /// Fill time per page per thread.
    pub ns_per_page: f64,
    /// Each thread's rate.
    pub per_thread_gb_per_s: Vec<f64>,
    /// Time per page over the memfd floor's (1.00 for memfd; higher is slower).
    pub ratio_over_memfd: Option<f64>,
    /// munmap and close (secret pages go back into the direct map here).
    pub teardown_s: f64,
    /// Kernel counters across the fill.
    pub counters: Deltas,
    /// DirectMap sizes before the fill.
    pub direct_map_before: DirectMap,
    /// DirectMap sizes after it.
    pub direct_map_after: DirectMap,
    /// After − before.
    pub direct_map_delta: DirectMapDelta,
    /// The sampler's intervals.
    pub samples: Vec<Sample>,
}

/// One run: the four fills.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// `host`.
    pub backend: &'static str,
    /// memfd, memfd_secret twice, memfd again.
    pub rows: Vec<Row>,
}

/// The probes, made once per process.
#[derive(Debug, Clone, Serialize)]
pub struct Probes {
    /// memfd_secret answered (a run that gets this far always has it).
    pub memfd_secret: bool,
    /// `RLIMIT_MEMLOCK` and what was done about it.
    pub memlock: memlock::Memlock,
    /// guest_memfd on this host's /dev/kvm.
    pub guest_memfd: gmem::GmemProbe,
}

/// The settings.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// `-v`.
    pub threads: u32,
    /// `-b`.
    pub bytes_per_thread: u64,
    /// `-v` x `-b`.
    pub total_bytes: u64,
    /// `--samples-ms`.
    pub samples_ms: u64,
    /// The access pattern.
    pub pattern: &'static str,
}

/// The document: every run and the summary of the headline figures.
#[derive(Serialize)]
pub struct Report {
    /// `private-mem-perf`.
    pub benchmark: &'static str,
    /// `host`.
    pub backend: &'static str,
    /// Whose cost this is: the host kernel's, not a guest's.
    pub measures: &'static str,
    /// The settings.
    pub config: Config,
    /// memfd_secret, memlock and guest_memfd probes.
    pub probes: Probes,
    /// `--repeat`.
    pub repeat: usize,
    /// The runs.
    pub runs: Vec<Run>,
    /// Median, min, max and spread of each headline figure over the runs.
    pub summary: Vec<MetricSummary>,
}

fn row<'a>(r: &'a Run, v: &str) -> Option<&'a Row> {
    r.rows.iter().find(|x| x.variant == v)
}

const METRICS: &[Metric<Run>] = &[
    Metric {
        name: "memfd GB/s",
        unit: "GB/s",
        better: Better::Higher,
        get: |r| row(r, "memfd").map(|x| x.gb_per_s),
    },
    Metric {
        name: "memfd_secret first fill GB/s",
        unit: "GB/s",
        better: Better::Higher,
        get: |r| row(r, "secret-first").map(|x| x.gb_per_s),
    },
    Metric {
        name: "memfd_secret second fill GB/s",
        unit: "GB/s",
        better: Better::Higher,
        get: |r| row(r, "secret-second").map(|x| x.gb_per_s),
    },
    Metric {
        name: "first fill / memfd",
        unit: "x",
        better: Better::Lower,
        get: |r| row(r, "secret-first").and_then(|x| x.ratio_over_memfd),
    },
    Metric {
        name: "second fill / memfd",
        unit: "x",
        better: Better::Lower,
        get: |r| row(r, "secret-second").and_then(|x| x.ratio_over_memfd),
    },
    Metric {
        name: "memfd after / memfd",
        unit: "x",
        better: Better::Lower,
        get: |r| row(r, "memfd-after").and_then(|x| x.ratio_over_memfd),
    },
    Metric {
        name: "first fill 2M splits",
        unit: "splits",
        better: Better::Lower,
        get: |r| {
            row(r, "secret-first")
                .and_then(|x| x.counters.level2_splits)
                .map(|n| n as f64)
        },
    },
    Metric {
        name: "first fill function-call irqs",
        unit: "irqs",
        better: Better::Lower,
        get: |r| {
            row(r, "secret-first")
                .and_then(|x| x.counters.function_call_irqs)
                .map(|n| n as f64)
        },
    },
];

fn parse_policy(s: &str) -> Result<DirectMapPolicy, String> {
    s.parse()
        .map_err(|e: slat::ParseVariantError| e.to_string())
}

/// private-mem-perf's `--vary` keys: each sets one field of a simulated variant.
pub const VARY: &[Key<sim::Variant>] = &[
    vary_key!(
        "direct-map",
        "--direct-map",
        Values::OneOf(variants::<DirectMapPolicy>),
        |v, x| { v.policy = engine(x)? }
    ),
    vary_key!(
        "kernel-flush",
        "--kernel-flush",
        Values::OneOf(names::<Switch>),
        |v, x| { v.kernel_flush = pick::<Switch>(x)?.on() }
    ),
];

/// The sim backend's plan: the flags and `--vary` resolved into rows. Without either, every
/// policy with the kernel flush off and on.
fn sim_plan(a: &PrivateMemPerfArgs, total: u64) -> Result<sim::SimPlan, String> {
    let base = sim::Variant {
        policy: a.direct_map.unwrap_or_default(),
        kernel_flush: a.kernel_flush.is_some_and(Switch::on),
    };
    let mut variants: Vec<sim::Variant> = Vec::new();
    let rows: Vec<sim::Variant> = match (&a.vary[..], a.direct_map, a.kernel_flush) {
        ([], None, None) => DirectMapPolicy::ALL
            .iter()
            .flat_map(|&policy| {
                [false, true].map(|kernel_flush| sim::Variant {
                    policy,
                    kernel_flush,
                })
            })
            .collect(),
        ([], None, Some(_)) => DirectMapPolicy::ALL
            .iter()
            .map(|&policy| sim::Variant { policy, ..base })
            .collect(),
        ([], Some(_), None) => [false, true]
            .map(|kernel_flush| sim::Variant {
                kernel_flush,
                ..base
            })
            .to_vec(),
        (vary, _, _) => driver::vary::rows(&base, vary, VARY)?
            .into_iter()
            .map(|r| r.args)
            .collect(),
    };
    for v in rows {
        if !variants.contains(&v) {
            variants.push(v);
        }
    }
    let _ = total;
    Ok(sim::SimPlan {
        vcpus: a.threads,
        bytes: a.bytes,
        samples: Duration::from_millis(a.samples_ms),
        variants,
        collapse: a.collapse,
        repeat: a.out.repeat,
        json: a.out.json,
    })
}

/// Runs `slat private-mem-perf`.
pub fn run(a: &PrivateMemPerfArgs) -> CliResult {
    let total = check(a).map_err(CliError::bad)?;
    if a.backend == PrivBackend::Sim {
        let plan = sim_plan(a, total).map_err(CliError::bad)?;
        return sim::run(&plan);
    }
    mem::secret_fd().map_err(|e| CliError::Runtime(e.to_string()))?;
    let memlock = memlock::prepare(total).map_err(CliError::Runtime)?;
    let len = usize::try_from(total).map_err(|_| CliError::bad("-v x -b overflows usize"))?;
    let probes = Probes {
        memfd_secret: true,
        memlock,
        guest_memfd: gmem::probe(total),
    };
    let mut runs = Vec::new();
    for n in 0..a.out.repeat {
        if a.out.repeat > 1 && !quiet(a.out.json) {
            eprintln!("[slat] run {}/{}", n + 1, a.out.repeat);
        }
        runs.push(measure(a, len)?);
    }
    let summary = METRICS.iter().map(|m| summarize(m, &runs)).collect();
    let report = Report {
        benchmark: NAME,
        backend: "host",
        measures: WHOSE,
        config: Config {
            threads: a.threads,
            bytes_per_thread: a.bytes,
            total_bytes: total,
            samples_ms: a.samples_ms,
            pattern: "one write per 4 KiB page, each thread its own contiguous share of one shared mapping",
        },
        probes,
        repeat: runs.len(),
        runs,
        summary,
    };
    if a.out.json {
        crate::output::print_json(&report, &[])
    } else {
        print_text(&report);
        Ok(())
    }
}

/// Refuses what cannot run; returns the total bytes.
fn check(a: &PrivateMemPerfArgs) -> Result<u64, String> {
    if a.backend == PrivBackend::Host {
        let sim_only = [
            ("--direct-map", a.direct_map.is_some()),
            ("--kernel-flush", a.kernel_flush.is_some()),
            ("--collapse", a.collapse),
            ("--vary", !a.vary.is_empty()),
        ];
        if let Some((flag, _)) = sim_only.iter().find(|(_, given)| *given) {
            return Err(format!(
                "{flag} configures the simulated direct map: add --backend sim (the host kernel's direct map is what it is)"
            ));
        }
    }
    if a.out.plot.is_some() {
        return Err(
            "--plot: private-mem-perf has no plot yet (the samples are in --json); drop --plot"
                .into(),
        );
    }
    let flags = format!("-v {} x -b {}", a.threads, a.bytes);
    let total = a
        .bytes
        .checked_mul(u64::from(a.threads))
        .ok_or_else(|| format!("{flags}: the memory overflows 64 bits"))?;
    // One fill's memory is mapped at a time (each is unmapped before the next).
    match slat_migrate::limits::host_memory() {
        Some(host) if total > host => Err(format!(
            "{flags}: {} of memory is more than this host's {} of RAM and swap",
            format_size(total),
            format_size(host)
        )),
        _ => Ok(total),
    }
}

/// The four fills of one run.
fn measure(a: &PrivateMemPerfArgs, len: usize) -> CliResult<Run> {
    let every = Duration::from_millis(a.samples_ms);
    let threads = a.threads as usize;
    let mut rows = Vec::new();
    for (variant, kind) in [
        ("memfd", Kind::Memfd),
        ("secret-first", Kind::Secret),
        ("secret-second", Kind::Secret),
        ("memfd-after", Kind::Memfd),
    ] {
        let phase = crate::report::Phase::start(format!("{variant} fill"), quiet(a.out.json));
        rows.push(one_fill(variant, kind, len, threads, every)?);
        phase.done();
    }
    let floor = rows[0].ns_per_page;
    for r in &mut rows {
        r.ratio_over_memfd = (floor > 0.0).then(|| r.ns_per_page / floor);
    }
    Ok(Run {
        backend: "host",
        rows,
    })
}

fn describe(variant: &str) -> &'static str {
    match variant {
        "memfd" => "native floor: plain memfd_create memory, the same shared-file fault path, pages stay in the direct map",
        "secret-first" => "memfd_secret, first fill: each page is removed from the direct map as this host has it, splitting any 2M/1G leaf that covers it",
        "secret-second" => "memfd_secret, second fill after munmap+close and re-create: freed pages keep 4 KiB direct-map entries, so this fill mostly finds its pages already split",
        _ => "plain memfd again, after the secret fills: its pages now mostly have 4 KiB direct-map entries, so this is what a split direct map costs ordinary faults (the kernel zeroes each page through the direct map)",
    }
}

/// Maps, fills (counters read around the fill only) and unmaps one region.
fn one_fill(
    variant: &'static str,
    kind: Kind,
    len: usize,
    threads: usize,
    every: Duration,
) -> CliResult<Row> {
    let t0 = Instant::now();
    let mut region = Region::new(kind, len).map_err(|e| CliError::Runtime(e.to_string()))?;
    let setup = t0.elapsed();
    let before = Snapshot::read();
    let f = mem::fill(&mut region, threads, every);
    let after = Snapshot::read();
    let t1 = Instant::now();
    drop(region);
    let teardown = t1.elapsed();
    Ok(make_row(
        variant, len as u64, &f, setup, teardown, &before, &after,
    ))
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    match d.as_secs_f64() {
        s if s > 0.0 => bytes as f64 / s / 1e9,
        _ => 0.0,
    }
}

fn make_row(
    variant: &'static str,
    bytes: u64,
    f: &Fill,
    setup: Duration,
    teardown: Duration,
    before: &Snapshot,
    after: &Snapshot,
) -> Row {
    let threads = f.per_thread.len().max(1) as u64;
    let share = bytes / threads;
    let pages_per_thread = (share / mem::PAGE as u64).max(1);
    Row {
        variant,
        description: describe(variant),
        bytes,
        setup_s: setup.as_secs_f64(),
        fill_s: f.elapsed.as_secs_f64(),
        gb_per_s: gbps(bytes, f.elapsed),
        ns_per_page: f.elapsed.as_nanos() as f64 / pages_per_thread as f64,
        per_thread_gb_per_s: f.per_thread.iter().map(|d| gbps(share, *d)).collect(),
        ratio_over_memfd: None,
        teardown_s: teardown.as_secs_f64(),
        counters: before.until(after),
        direct_map_before: before.direct_map,
        direct_map_after: after.direct_map,
        direct_map_delta: before.direct_map.until(&after.direct_map),
        samples: f.samples.clone(),
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or("-".into(), |x| x.to_string())
}

fn print_text(r: &Report) {
    println!("Backend: host. This is {WHOSE}.");
    println!(
        "Threads: {}, {} per thread ({} total), {}",
        r.config.threads,
        format_size(r.config.bytes_per_thread),
        format_size(r.config.total_bytes),
        r.config.pattern
    );
    print_probes(&r.probes);
    for (i, run) in r.runs.iter().enumerate() {
        if r.repeat > 1 {
            println!("\nRun {}/{}:", i + 1, r.repeat);
        }
        print_run(run, r.config.samples_ms);
    }
    println!("\nfirst fill: the direct map as this host had it; second fill: after munmap, close and re-create, over pages whose direct-map entries the first fill already split to 4 KiB. The split columns say how much each fill split: the kernel does not merge a split direct map back, so a first fill that splits little ran over pages an earlier run (or process) had already split. memfd-after: plain memfd again, over pages the secret fills left with a split direct map. x memfd: time per page over the first memfd fill's. TLB shootdowns counts user-address flushes only; the kernel-range flush after each direct-map change reaches the other CPUs as function-call interrupts (CAL).");
    if r.repeat > 1 {
        print_summary(&r.summary, r.repeat);
    }
}

fn print_probes(p: &Probes) {
    let m = &p.memlock;
    println!(
        "memfd_secret: available; RLIMIT_MEMLOCK {} (hard {}), {} locked at once: {}{}",
        m.soft_before.map_or("unlimited".into(), format_size),
        m.hard.map_or("unlimited".into(), format_size),
        format_size(m.needed_bytes),
        m.action,
        match (m.action, m.soft_after) {
            ("raised-soft-limit", Some(s)) => format!(" to {}", format_size(s)),
            _ => String::new(),
        }
    );
    let g = &p.guest_memfd;
    println!(
        "guest_memfd: KVM_CAP_GUEST_MEMFD /dev/kvm={} vm={}, KVM_CAP_GUEST_MEMFD_FLAGS not defined in kvm-bindings (not probed); {}",
        opt(g.cap_guest_memfd_system),
        opt(g.cap_guest_memfd_vm),
        g.detail
    );
    if let Some(t) = &g.timing {
        println!(
            "guest_memfd: fallocate {} in {:.6}s ({:.2} GB/s; direct-map 2M splits {}, TLB shootdowns {}, CAL irqs {}) vs anonymous fill {:.6}s ({:.2} GB/s)",
            format_size(t.bytes),
            t.guest_memfd_fallocate_s,
            t.guest_memfd_gb_per_s,
            opt(t.guest_memfd_counters.level2_splits),
            opt(t.guest_memfd_counters.tlb_shootdowns),
            opt(t.guest_memfd_counters.function_call_irqs),
            t.anonymous_fill_s,
            t.anonymous_gb_per_s
        );
    }
}

fn print_run(run: &Run, samples_ms: u64) {
    let head: Vec<String> = [
        "fill",
        "GB/s",
        "ns/page",
        "x memfd",
        "2M splits",
        "1G splits",
        "TLB shootdowns",
        "CAL irqs",
        "DirectMap4k",
        "DirectMap2M",
        "DirectMap1G",
        "setup s",
        "teardown s",
    ]
    .map(String::from)
    .to_vec();
    let kib = |v: Option<i64>| v.map_or("-".into(), |k| format!("{k:+} kB"));
    let rows: Vec<Vec<String>> = run
        .rows
        .iter()
        .map(|x| {
            vec![
                x.variant.to_string(),
                format!("{:.3}", x.gb_per_s),
                format!("{:.0}", x.ns_per_page),
                ratio_cell(x.ratio_over_memfd),
                opt(x.counters.level2_splits),
                opt(x.counters.level3_splits),
                opt(x.counters.tlb_shootdowns),
                opt(x.counters.function_call_irqs),
                kib(x.direct_map_delta.k4),
                kib(x.direct_map_delta.m2),
                kib(x.direct_map_delta.g1),
                cell(Some(x.setup_s)),
                cell(Some(x.teardown_s)),
            ]
        })
        .collect();
    print_table(&head, &rows);
    println!("Samples every {samples_ms} ms (GB/s, new 2M splits):");
    for x in &run.rows {
        let s: Vec<String> = x
            .samples
            .iter()
            .map(|s| format!("{:.2}/{}", s.gb_per_s, opt(s.level2_splits)))
            .collect();
        println!("  {:>13}: {}", x.variant, s.join(" "));
    }
}

fn print_summary(summary: &[MetricSummary], repeat: usize) {
    println!("\nSummary over {repeat} runs (spread = (max - min) / median):");
    let head: Vec<String> = ["metric", "median", "min", "max", "spread", "better"]
        .map(String::from)
        .to_vec();
    let rows: Vec<Vec<String>> = summary
        .iter()
        .map(|s| {
            let f = |x| {
                if s.unit == "x" {
                    ratio_cell(x)
                } else {
                    cell(x)
                }
            };
            vec![
                format!("{} ({})", s.metric, s.unit),
                f(s.median),
                f(s.min),
                f(s.max),
                ratio_cell(s.spread),
                match s.better {
                    Better::Lower => "lower".into(),
                    Better::Higher => "higher".into(),
                },
            ]
        })
        .collect();
    print_table(&head, &rows);
}
