//! `slat private-mem-perf --backend sim`: the host-direct-map-for-private-memory benchmark on the simulated machine. N
//! vCPUs of a confidential guest fault in all of their private memory (one write per page,
//! the patch series' `stress --vm N --vm-bytes .. --vm-keep`); each first touch accepts its page
//! lazily, removing it from the simulated host direct map (`slat::direct_map`) under the
//! chosen policy. One table over the variants, a native floor (the same writes on fresh
//! host memory) from the same run, per-second-style samples of the fault-in rate, and the
//! conversion throughput (the whole region back to shared, then private again).

use super::NAME;
use crate::error::{CliError, CliResult};
use crate::output::{cell, print_table, ratio_cell, summarize, Better, Metric};
use crate::report::{quiet, Phase};
use serde::Serialize;
use slat::direct_map::{DirectMap, DirectMapConfig, DirectMapStats};
use slat::{DirectMapPolicy, Ept, MemoryAttributes};
use slat_addr::{Gfn, PAGE_SHIFT, PAGE_SIZE};
use slat_machine::{Machine, MachineConfig};
use slat_workload::format_size;
use slat_workload::{Backing, GuestRam, PassParams, RegionSpec};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whose cost the figures are.
const WHOSE: &str = "a simulated confidential guest's fault-in of its private memory through slat's engine: lazy acceptance of each page, which removes it from a simulated host direct map (slat's x86 page table) under the chosen policy; not this host kernel's cost (see --backend host)";

/// One variant: a direct-map policy and whether each removal flushes every host CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// `--direct-map`.
    pub policy: DirectMapPolicy,
    /// `--kernel-flush`.
    pub kernel_flush: bool,
}

/// What the sim backend runs.
#[derive(Debug, Clone)]
pub struct SimPlan {
    /// vCPUs.
    pub vcpus: u32,
    /// Private memory per vCPU.
    pub bytes: u64,
    /// Sample interval.
    pub samples: Duration,
    /// The rows, in order.
    pub variants: Vec<Variant>,
    /// `--collapse`.
    pub collapse: bool,
    /// `--repeat`.
    pub repeat: u32,
    /// `--json`.
    pub json: bool,
}

/// One sample of a fault-in.
#[derive(Debug, Clone, Serialize)]
pub struct SimSample {
    /// End of the interval, seconds from the start of the fault-in.
    pub t_s: f64,
    /// Pages accepted in the interval, as 10^9 bytes per second.
    pub gb_per_s: f64,
    /// Direct-map splits in the interval.
    pub splits: u64,
    /// Global-lock wait in the interval, milliseconds summed over vCPUs.
    pub lock_wait_ms: f64,
}

/// One variant's fault-in and conversions.
#[derive(Debug, Clone, Serialize)]
pub struct SimRow {
    /// `--direct-map`.
    pub direct_map: &'static str,
    /// `--kernel-flush`.
    pub kernel_flush: bool,
    /// Private bytes faulted in (all vCPUs).
    pub bytes: u64,
    /// From the pass's start to the last vCPU's last page.
    pub fault_in_s: f64,
    /// Fault-in rate, 10^9 bytes per second.
    pub gb_per_s: f64,
    /// Time per page per vCPU.
    pub ns_per_page: f64,
    /// Time per page over the native floor's (higher is slower).
    pub ratio_over_native: Option<f64>,
    /// Pages accepted (every page, once).
    pub accepted: u64,
    /// Huge direct-map leaves split.
    pub splits: u64,
    /// Global-lock acquisitions.
    pub lock_acquisitions: u64,
    /// Global-lock wait, milliseconds summed over vCPUs.
    pub lock_wait_ms: f64,
    /// Kernel TLB flushes requested (splits, and each removal with `--kernel-flush on`).
    pub kernel_flushes: u64,
    /// Acknowledgements of those flushes by the vCPU threads (the host CPUs).
    pub kernel_flush_acks: u64,
    /// Direct-map leaves after the fault-in: 4 KiB, 2 MiB, 1 GiB.
    pub leaves_after: [u64; 3],
    /// Converting the whole region to shared (releases every page: scrub, map again, and
    /// with --collapse rebuild 2 MiB leaves), seconds.
    pub to_shared_s: f64,
    /// Bytes converted to shared per second, GiB/s.
    pub to_shared_gib_per_s: f64,
    /// 2 MiB leaves rebuilt by that conversion.
    pub collapses: u64,
    /// The sampler's intervals.
    pub samples: Vec<SimSample>,
}

/// The native floor: the same writes on fresh host memory, no engine, no direct map.
#[derive(Debug, Clone, Serialize)]
pub struct NativeRow {
    /// Bytes written.
    pub bytes: u64,
    /// Wall time.
    pub fill_s: f64,
    /// 10^9 bytes per second.
    pub gb_per_s: f64,
    /// Time per page per vCPU.
    pub ns_per_page: f64,
}

/// One run over every variant.
#[derive(Debug, Clone, Serialize)]
pub struct SimRun {
    /// The floor.
    pub native: NativeRow,
    /// One per variant.
    pub rows: Vec<SimRow>,
}

/// The settings.
#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    /// vCPUs.
    pub vcpus: u32,
    /// Bytes per vCPU.
    pub bytes_per_vcpu: u64,
    /// All vCPUs.
    pub total_bytes: u64,
    /// Sample interval.
    pub samples_ms: u64,
    /// `--collapse`.
    pub collapse: bool,
    /// The access pattern.
    pub pattern: &'static str,
}

/// A headline figure of one variant over the runs.
#[derive(Debug, Clone, Serialize)]
pub struct VariantSummary {
    /// `POLICY flush=on|off`.
    pub variant: String,
    /// The figure's summary.
    #[serde(flatten)]
    pub summary: crate::output::MetricSummary,
}

/// The document.
#[derive(Serialize)]
pub struct SimReport {
    /// `private-mem-perf`.
    pub benchmark: &'static str,
    /// `sim`.
    pub backend: &'static str,
    /// Whose cost this is.
    pub measures: &'static str,
    /// The settings.
    pub config: SimConfig,
    /// `--repeat`.
    pub repeat: usize,
    /// The runs.
    pub runs: Vec<SimRun>,
    /// Median, min, max and spread of each variant's headline figures over the runs.
    pub summary: Vec<VariantSummary>,
}

fn label(v: &Variant) -> String {
    format!(
        "{} flush={}",
        v.policy,
        if v.kernel_flush { "on" } else { "off" }
    )
}

/// Runs the sim backend.
pub fn run(p: &SimPlan) -> CliResult {
    let mut runs = Vec::new();
    for n in 0..p.repeat {
        if p.repeat > 1 && !quiet(p.json) {
            eprintln!("[slat] run {}/{}", n + 1, p.repeat);
        }
        runs.push(measure(p)?);
    }
    let summary = summaries(p, &runs);
    let report = SimReport {
        benchmark: NAME,
        backend: "sim",
        measures: WHOSE,
        config: SimConfig {
            vcpus: p.vcpus,
            bytes_per_vcpu: p.bytes,
            total_bytes: p.bytes * u64::from(p.vcpus),
            samples_ms: p.samples.as_millis() as u64,
            collapse: p.collapse,
            pattern: "one write per 4 KiB page, in order, each vCPU its own share; every page private and unaccepted at the start",
        },
        repeat: runs.len(),
        runs,
        summary,
    };
    if p.json {
        crate::output::print_json(&report, &[])
    } else {
        print_text(&report);
        Ok(())
    }
}

fn measure(p: &SimPlan) -> CliResult<SimRun> {
    let mut rows = Vec::new();
    for v in &p.variants {
        let phase = Phase::start(format!("{} fault-in", label(v)), quiet(p.json));
        rows.push(one_variant(p, *v)?);
        phase.done();
    }
    // Last, so it runs on a host whose allocator is as warm as for the variants.
    let phase = Phase::start("native fill", quiet(p.json));
    let native = native(p)?;
    phase.done();
    for row in &mut rows {
        row.ratio_over_native =
            (native.ns_per_page > 0.0).then(|| row.ns_per_page / native.ns_per_page);
    }
    Ok(SimRun { native, rows })
}

/// A configuration the machine refuses is the flags' fault (exit 2); the rest is a failure.
fn machine_error(e: slat_machine::MachineError) -> CliError {
    match e {
        slat_machine::MachineError::Config(m) => CliError::bad(m),
        e => CliError::Runtime(e.to_string()),
    }
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    match d.as_secs_f64() {
        s if s > 0.0 => bytes as f64 / s / 1e9,
        _ => 0.0,
    }
}

fn gibps(bytes: u64, d: Duration) -> f64 {
    match d.as_secs_f64() {
        s if s > 0.0 => bytes as f64 / s / (1u64 << 30) as f64,
        _ => 0.0,
    }
}

fn machine_config(p: &SimPlan, v: Variant) -> MachineConfig {
    MachineConfig {
        region: RegionSpec {
            vcpus: p.vcpus as usize,
            bytes_per_vcpu: p.bytes,
            // The pool's host pages are populated up front (and the native floor's): what is
            // measured is acceptance through the engine and the direct map, not this host's
            // page allocator, whose cost on a fresh process varies tenfold run to run here.
            prefault: true,
            ..RegionSpec::default()
        },
        private: Some(DirectMapConfig {
            policy: v.policy,
            kernel_flush: v.kernel_flush,
            collapse: p.collapse,
        }),
        ..MachineConfig::default()
    }
}

/// The floor: each vCPU's share written once per page on fresh memory of the pool's kind.
fn native(p: &SimPlan) -> CliResult<NativeRow> {
    let total = p.bytes * u64::from(p.vcpus);
    let mem = GuestRam::new(
        Backing::AnonymousThp,
        total.div_ceil(2 << 20) * (2 << 20),
        false,
    )
    .map_err(|e| CliError::Runtime(e.to_string()))?;
    let layout = slat_workload::Layout {
        gpa: 0,
        host: mem.addr(),
        bytes_per_vcpu: p.bytes,
        vcpus: p.vcpus as usize,
        overlap: false,
    };
    let r = slat_workload::native_baseline::<slat_machine::CpuCounters>(
        layout,
        &mem,
        PassParams::default(),
    )
    .map_err(|e| CliError::Runtime(e.to_string()))?;
    let pages = (p.bytes >> PAGE_SHIFT).max(1);
    Ok(NativeRow {
        bytes: total,
        fill_s: r.wall.as_secs_f64(),
        gb_per_s: gbps(total, r.wall),
        ns_per_page: r.wall.as_nanos() as f64 / pages as f64,
    })
}

/// Samples the direct map's counters every `every` until `stop`.
/// `start` is read before the pass begins, so a pass that ends before the thread runs is
/// still one sample.
fn sampler(
    map: Arc<DirectMap>,
    every: Duration,
    stop: Arc<AtomicBool>,
    start: (Instant, DirectMapStats),
) -> std::thread::JoinHandle<Vec<SimSample>> {
    std::thread::spawn(move || {
        let t0 = start.0;
        let mut last = start;
        let mut out = Vec::new();
        loop {
            let done = stop.load(Ordering::Acquire);
            if !done {
                std::thread::sleep(every.min(Duration::from_millis(20)));
                if last.0.elapsed() < every {
                    continue;
                }
            }
            let (now, s) = (Instant::now(), map.stats());
            if s.accepted > last.1.accepted || !done {
                out.push(sample(t0, &last, now, &s));
            }
            last = (now, s);
            if done {
                return out;
            }
        }
    })
}

fn sample(
    t0: Instant,
    last: &(Instant, DirectMapStats),
    now: Instant,
    s: &DirectMapStats,
) -> SimSample {
    let pages = s.accepted - last.1.accepted;
    SimSample {
        t_s: (now - t0).as_secs_f64(),
        gb_per_s: gbps(pages * PAGE_SIZE, now - last.0),
        splits: s.splits - last.1.splits,
        lock_wait_ms: (s.lock_wait_ns - last.1.lock_wait_ns) as f64 / 1e6,
    }
}

fn one_variant(p: &SimPlan, v: Variant) -> CliResult<SimRow> {
    let m = Machine::<Ept>::new(machine_config(p, v)).map_err(machine_error)?;
    let map = m
        .direct_map()
        .ok_or_else(|| CliError::Runtime("the machine has no direct map".into()))?
        .clone();
    let total = m.layout().total_pages() * PAGE_SIZE;
    let before = map.stats();
    let stop = Arc::new(AtomicBool::new(false));
    let samples = sampler(
        map.clone(),
        p.samples,
        stop.clone(),
        (Instant::now(), before),
    );
    let pass = m.run_pass(PassParams::default());
    stop.store(true, Ordering::Release);
    let samples = samples
        .join()
        .map_err(|_| CliError::Runtime("the sampler thread panicked".into()))?;
    let pass = pass.map_err(machine_error)?;
    let after = map.stats();
    let acks = pass
        .vcpus
        .iter()
        .map(|c| c.counters.kernel_tlb_flushes)
        .sum();
    let (to_shared, collapses) = to_shared(&m, &map)?;
    let pages = (p.bytes >> PAGE_SHIFT).max(1);
    Ok(SimRow {
        direct_map: v.policy.name(),
        kernel_flush: v.kernel_flush,
        bytes: total,
        fault_in_s: pass.wall.as_secs_f64(),
        gb_per_s: gbps(total, pass.wall),
        ns_per_page: pass.wall.as_nanos() as f64 / pages as f64,
        ratio_over_native: None,
        accepted: after.accepted - before.accepted,
        splits: after.splits - before.splits,
        lock_acquisitions: after.lock_acquisitions - before.lock_acquisitions,
        lock_wait_ms: (after.lock_wait_ns - before.lock_wait_ns) as f64 / 1e6,
        kernel_flushes: after.flush_requests - before.flush_requests,
        kernel_flush_acks: acks,
        leaves_after: after.leaves,
        to_shared_s: to_shared.as_secs_f64(),
        to_shared_gib_per_s: gibps(total, to_shared),
        collapses,
        samples,
    })
}

/// Converts the whole (faulted-in) region to shared, timed: the conversion that involves
/// the direct map (every page released). The way back to private is only a zap of nothing
/// mapped (acceptance is lazy), so it is not measured.
fn to_shared(m: &Machine<Ept>, map: &DirectMap) -> CliResult<(Duration, u64)> {
    let gfn = m.layout().gpa >> PAGE_SHIFT;
    let pages = m.layout().total_pages();
    let c0 = map.stats().collapses;
    let t0 = Instant::now();
    m.vm()
        .set_memory_attributes(Gfn::new(gfn), pages, MemoryAttributes::empty())
        .map_err(|e| CliError::Runtime(e.to_string()))?;
    Ok((t0.elapsed(), map.stats().collapses - c0))
}

/// A headline figure of a row: name, unit, which way is better, and how to read it.
type RowMetric = (&'static str, &'static str, Better, fn(&SimRow) -> f64);

const ROW_METRICS: [RowMetric; 2] = [
    ("fault-in GB/s", "GB/s", Better::Higher, |r| r.gb_per_s),
    ("to-shared GiB/s", "GiB/s", Better::Higher, |r| {
        r.to_shared_gib_per_s
    }),
];

fn summaries(p: &SimPlan, runs: &[SimRun]) -> Vec<VariantSummary> {
    let mut out = Vec::new();
    for (i, v) in p.variants.iter().enumerate() {
        for (name, unit, better, get) in ROW_METRICS {
            let values: Vec<f64> = runs.iter().filter_map(|r| r.rows.get(i).map(get)).collect();
            let m = Metric::<f64> {
                name,
                unit,
                better,
                get: |x| Some(*x),
            };
            out.push(VariantSummary {
                variant: label(v),
                summary: summarize(&m, &values),
            });
        }
    }
    out
}

fn print_text(r: &SimReport) {
    println!("Backend: sim. This is {WHOSE}.");
    println!(
        "vCPUs: {}, {} per vCPU ({} total), {}; direct-map collapse {}",
        r.config.vcpus,
        format_size(r.config.bytes_per_vcpu),
        format_size(r.config.total_bytes),
        r.config.pattern,
        if r.config.collapse { "on" } else { "off" }
    );
    for (i, run) in r.runs.iter().enumerate() {
        if r.repeat > 1 {
            println!("\nRun {}/{}:", i + 1, r.repeat);
        }
        print_run(run, r.config.samples_ms);
    }
    println!("\nx native: time per page over the native floor's (the same writes on fresh host memory, no engine). splits: huge direct-map leaves split (each flushes every host CPU under the global lock, as Linux does). lock wait: time vCPUs waited for the global lock, summed. flushes: kernel TLB flushes requested (splits, plus one per page with flush=on); acks: acknowledgements by online vCPU threads. to-shared: the whole faulted-in region converted back to shared (guest mappings zapped, every page scrubbed and mapped into the direct map again, with --collapse 2 MiB leaves rebuilt); the way back to private is not timed, as it only zaps (acceptance is lazy).");
    if r.repeat > 1 {
        println!(
            "\nSummary over {} runs (spread = (max - min) / median):",
            r.repeat
        );
        let head: Vec<String> = ["variant", "metric", "median", "min", "max", "spread"]
            .map(String::from)
            .to_vec();
        let rows: Vec<Vec<String>> = r
            .summary
            .iter()
            .map(|s| {
                let m = &s.summary;
                vec![
                    s.variant.clone(),
                    m.metric.to_string(),
                    cell(m.median),
                    cell(m.min),
                    cell(m.max),
                    ratio_cell(m.spread),
                ]
            })
            .collect();
        print_table(&head, &rows);
    }
}

fn print_run(run: &SimRun, samples_ms: u64) {
    let head: Vec<String> = [
        "variant",
        "GB/s",
        "ns/page",
        "x native",
        "splits",
        "lock wait ms",
        "flushes",
        "acks",
        "4K/2M/1G leaves",
        "to-shared GiB/s",
        "collapses",
    ]
    .map(String::from)
    .to_vec();
    let mut rows = vec![vec![
        "native".to_string(),
        format!("{:.3}", run.native.gb_per_s),
        format!("{:.0}", run.native.ns_per_page),
        "1.00x".into(),
        "-".into(),
        "-".into(),
        "-".into(),
        "-".into(),
        "-".into(),
        "-".into(),
        "-".into(),
    ]];
    for x in &run.rows {
        rows.push(vec![
            format!(
                "{} flush={}",
                x.direct_map,
                if x.kernel_flush { "on" } else { "off" }
            ),
            format!("{:.3}", x.gb_per_s),
            format!("{:.0}", x.ns_per_page),
            ratio_cell(x.ratio_over_native),
            x.splits.to_string(),
            format!("{:.1}", x.lock_wait_ms),
            x.kernel_flushes.to_string(),
            x.kernel_flush_acks.to_string(),
            format!(
                "{}/{}/{}",
                x.leaves_after[0], x.leaves_after[1], x.leaves_after[2]
            ),
            format!("{:.2}", x.to_shared_gib_per_s),
            x.collapses.to_string(),
        ]);
    }
    print_table(&head, &rows);
    println!("Samples every {samples_ms} ms (fault-in GB/s, splits):");
    for x in &run.rows {
        let s: Vec<String> = x
            .samples
            .iter()
            .map(|s| format!("{:.2}/{}", s.gb_per_s, s.splits))
            .collect();
        println!(
            "  {:>22}: {}",
            format!(
                "{} flush={}",
                x.direct_map,
                if x.kernel_flush { "on" } else { "off" }
            ),
            s.join(" ")
        );
    }
}
