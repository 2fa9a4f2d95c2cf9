//! `--backend host`: this host's kernel faulting in memfd_secret memory against memfd memory,
//! four fills per run, with the kernel's direct-map counters read around each.

use super::counters::{Counts, Sizes, Snapshot};
use super::mem::{self, Kind, Region, Sample};
use super::{
    coarsened, gmem, memlock, metric, opt, per_s, runtime, table, Column, Document,
    PrivateMemPerfArgs, NAME,
};
use crate::error::{CliError, CliResult};
use crate::output::{ratio_cell, summarize, Better, Metric};
use crate::report::{quiet, Phase};
use serde::Serialize;
use slat_workload::format_size;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use Better::{Higher as HI, Lower as LO};

type AnyRun = super::Run;

/// What the figures are the cost of: said in the text and in JSON.
const WHOSE: &str = "the host kernel's cost of faulting in memory removed from its own direct map (memfd_secret), measured by host threads: not a guest's fault-in cost";

const PATTERN: &str =
    "one write per 4 KiB page, each thread its own contiguous share of one shared mapping";

/// The fills of a run, in order: name, memory and what the fill measures.
const FILLS: [(&str, Kind, &str); 4] = [
    ("memfd", Kind::Memfd, "native floor: plain memfd_create memory, the same shared-file fault path, pages stay in the direct map"),
    ("secret-first", Kind::Secret, "memfd_secret, first fill: each page is removed from the direct map as this host has it, splitting any 2M/1G leaf that covers it"),
    ("secret-second", Kind::Secret, "memfd_secret, second fill after munmap+close and re-create: freed pages keep 4 KiB direct-map entries, so this fill mostly finds its pages already split"),
    ("memfd-after", Kind::Memfd, "plain memfd again, after the secret fills: its pages now mostly have 4 KiB direct-map entries, so this is what a split direct map costs ordinary faults (the kernel zeroes each page through the direct map)"),
];

const NOTE: &str = "first fill: the direct map as this host had it; second fill: after munmap, close and re-create, over pages whose direct-map entries the first fill already split to 4 KiB. The split columns say how much each fill split: the kernel does not merge a split direct map back, so a first fill that splits little ran over pages an earlier run (or process) had already split. memfd-after: plain memfd again, over pages the secret fills left with a split direct map. x memfd: time per page over the first memfd fill's. TLB shootdowns counts user-address flushes only; the kernel-range flush after each direct-map change reaches the other CPUs as function-call interrupts (CAL).";

/// One fill of one kind of memory.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `memfd`, `secret-first`, `secret-second` or `memfd-after`.
    pub variant: &'static str,
    description: &'static str,
    /// All threads.
    bytes: u64,
    /// memfd_create/memfd_secret, ftruncate and mmap.
    setup_s: f64,
    /// From the start barrier to the last thread's last page.
    fill_s: f64,
    gb_per_s: f64,
    /// Fill time per page per thread.
    ns_per_page: f64,
    per_thread_gb_per_s: Vec<f64>,
    /// Time per page over the memfd floor's (1.00 for memfd; higher is slower).
    ratio_over_memfd: Option<f64>,
    /// munmap and close (secret pages go back into the direct map here).
    teardown_s: f64,
    /// Kernel counters across the fill.
    counters: Counts,
    direct_map_before: Sizes<u64>,
    direct_map_after: Sizes<u64>,
    direct_map_delta: Sizes<i64>,
    samples: Vec<Sample>,
}

/// One run: the four fills.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    backend: &'static str,
    /// [`FILLS`], in order.
    pub rows: Vec<Row>,
}

/// The probes, made once per process (before the first fill: the memlock limit is raised).
#[derive(Debug, Clone, Serialize)]
pub struct Probes {
    /// memfd_secret answered (a run that gets this far always has it).
    memfd_secret: bool,
    memlock: memlock::Memlock,
    guest_memfd: gmem::GmemProbe,
}

static PROBES: OnceLock<Probes> = OnceLock::new();

#[derive(Serialize)]
struct Config {
    threads: u32,
    bytes_per_thread: u64,
    total_bytes: u64,
    samples_ms: u64,
    pattern: &'static str,
}

/// Fill `v` of a run.
pub fn row<'a>(r: &'a AnyRun, v: &str) -> Option<&'a Row> {
    match r {
        AnyRun::Host(r) => r.rows.iter().find(|x| x.variant == v),
        AnyRun::Sim(_) => None,
    }
}

/// The headline figures, summarized over `--repeat`.
pub const METRICS: &[Metric<AnyRun>] = &[
    metric("memfd GB/s", "GB/s", HI, |r| {
        Some(row(r, "memfd")?.gb_per_s)
    }),
    metric("memfd_secret first fill GB/s", "GB/s", HI, |r| {
        Some(row(r, "secret-first")?.gb_per_s)
    }),
    metric("memfd_secret second fill GB/s", "GB/s", HI, |r| {
        Some(row(r, "secret-second")?.gb_per_s)
    }),
    metric("first fill / memfd", "x", LO, |r| {
        row(r, "secret-first")?.ratio_over_memfd
    }),
    metric("second fill / memfd", "x", LO, |r| {
        row(r, "secret-second")?.ratio_over_memfd
    }),
    metric("memfd after / memfd", "x", LO, |r| {
        row(r, "memfd-after")?.ratio_over_memfd
    }),
    metric("first fill 2M splits", "splits", LO, |r| {
        Some(row(r, "secret-first")?.counters.level2_splits? as f64)
    }),
    metric("first fill function-call irqs", "irqs", LO, |r| {
        Some(row(r, "secret-first")?.counters.function_call_irqs? as f64)
    }),
];

/// A fill's rate, drawn by `--plot`.
pub const RATE: Metric<Row> = metric("fill rate", "GB/s", Better::Higher, |x| Some(x.gb_per_s));

/// The probes, made by the first run, which also prints the text's heading.
fn probes(a: &PrivateMemPerfArgs, total: u64) -> CliResult<&'static Probes> {
    if let Some(p) = PROBES.get() {
        return Ok(p);
    }
    mem::secret_fd().map_err(runtime)?;
    let p = Probes {
        memfd_secret: true,
        memlock: memlock::prepare(total).map_err(CliError::Runtime)?,
        guest_memfd: gmem::probe(total),
    };
    if !a.out.json {
        print_head(a, total, &p);
    }
    Ok(PROBES.get_or_init(|| p))
}

/// The four fills of one run.
pub fn measure(a: &PrivateMemPerfArgs) -> CliResult<Run> {
    let total = a.total();
    probes(a, total)?;
    let len = usize::try_from(total).map_err(|_| CliError::bad("-v x -b overflows usize"))?;
    let mut rows = Vec::new();
    for (variant, kind, description) in FILLS {
        let phase = Phase::start(format!("{variant} fill"), quiet(a.out.json));
        let every = Duration::from_millis(a.samples_ms);
        let mut r = fill(kind, len, a.threads as usize, every)?;
        (r.variant, r.description) = (variant, description);
        rows.push(r);
        phase.done();
    }
    let floor = rows.first().map_or(0.0, |r| r.ns_per_page);
    for r in &mut rows {
        r.ratio_over_memfd = (floor > 0.0).then(|| r.ns_per_page / floor);
    }
    Ok(Run {
        backend: "host",
        rows,
    })
}

/// Maps, fills (counters read around the fill only) and unmaps one region.
fn fill(kind: Kind, len: usize, threads: usize, every: Duration) -> CliResult<Row> {
    let t0 = Instant::now();
    let mut region = Region::new(kind, len).map_err(runtime)?;
    let setup = t0.elapsed();
    let before = Snapshot::read();
    let f = mem::fill(&mut region, threads, every).map_err(runtime)?;
    let after = Snapshot::read();
    let t1 = Instant::now();
    drop(region);
    let teardown = t1.elapsed();
    let bytes = len as u64;
    let share = bytes / f.per_thread.len().max(1) as u64;
    let pages_per_thread = (share / mem::PAGE as u64).max(1);
    Ok(Row {
        variant: "",
        description: "",
        bytes,
        setup_s: setup.as_secs_f64(),
        fill_s: f.elapsed.as_secs_f64(),
        gb_per_s: per_s(bytes, f.elapsed, 1e9),
        ns_per_page: f.elapsed.as_nanos() as f64 / pages_per_thread as f64,
        per_thread_gb_per_s: f.per_thread.iter().map(|d| per_s(share, *d, 1e9)).collect(),
        ratio_over_memfd: None,
        teardown_s: teardown.as_secs_f64(),
        counters: before.until(&after),
        direct_map_before: before.direct_map,
        direct_map_after: after.direct_map,
        direct_map_delta: before.direct_map.until(&after.direct_map),
        samples: f.samples,
    })
}

/// The document of every run, or the note and summary under the runs' text.
pub fn finish(a: &PrivateMemPerfArgs, runs: Vec<AnyRun>) -> CliResult {
    Document {
        benchmark: NAME,
        backend: "host",
        measures: WHOSE,
        config: Config {
            threads: a.threads,
            bytes_per_thread: a.bytes,
            total_bytes: a.total(),
            samples_ms: a.samples_ms,
            pattern: PATTERN,
        },
        probes: PROBES.get().cloned(),
        repeat: runs.len(),
        summary: METRICS.iter().map(|m| summarize(m, &runs)).collect(),
        runs,
    }
    .print(a.out.json, NOTE, |s| (None, s))
}

fn print_head(a: &PrivateMemPerfArgs, total: u64, p: &Probes) {
    println!("Backend: host. This is {WHOSE}.");
    println!(
        "Threads: {}, {} per thread ({} total), {PATTERN}",
        a.threads,
        format_size(a.bytes),
        format_size(total),
    );
    let m = &p.memlock;
    let raised = match (m.action, m.soft_after) {
        ("raised-soft-limit", Some(s)) => format!(" to {}", format_size(s)),
        _ => String::new(),
    };
    println!(
        "memfd_secret: available; RLIMIT_MEMLOCK {} (hard {}), {} locked at once: {}{raised}",
        m.soft_before.map_or("unlimited".into(), format_size),
        m.hard.map_or("unlimited".into(), format_size),
        format_size(m.needed_bytes),
        m.action,
    );
    let g = &p.guest_memfd;
    println!(
        "guest_memfd: KVM_CAP_GUEST_MEMFD /dev/kvm={} vm={}, KVM_CAP_GUEST_MEMFD_FLAGS not defined in kvm-bindings (not probed); {}",
        opt(g.cap_guest_memfd_system),
        opt(g.cap_guest_memfd_vm),
        g.detail
    );
    if let Some(t) = &g.timing {
        let c = &t.guest_memfd_counters;
        println!(
            "guest_memfd: fallocate {} in {:.6}s ({:.2} GB/s; direct-map 2M splits {}, TLB shootdowns {}, CAL irqs {}) vs anonymous fill {:.6}s ({:.2} GB/s)",
            format_size(t.bytes),
            t.guest_memfd_fallocate_s,
            t.guest_memfd_gb_per_s,
            opt(c.level2_splits),
            opt(c.tlb_shootdowns),
            opt(c.function_call_irqs),
            t.anonymous_fill_s,
            t.anonymous_gb_per_s
        );
    }
}

fn kib(v: Option<i64>) -> String {
    v.map_or("-".into(), |k| format!("{k:+} kB"))
}

const COLUMNS: &[Column<Row>] = &[
    ("fill", |x| x.variant.into()),
    ("GB/s", |x| format!("{:.3}", x.gb_per_s)),
    ("ns/page", |x| format!("{:.0}", x.ns_per_page)),
    ("x memfd", |x| ratio_cell(x.ratio_over_memfd)),
    ("2M splits", |x| opt(x.counters.level2_splits)),
    ("1G splits", |x| opt(x.counters.level3_splits)),
    ("TLB shootdowns", |x| opt(x.counters.tlb_shootdowns)),
    ("CAL irqs", |x| opt(x.counters.function_call_irqs)),
    ("DirectMap4k", |x| kib(x.direct_map_delta.k4)),
    ("DirectMap2M", |x| kib(x.direct_map_delta.m2)),
    ("DirectMap1G", |x| kib(x.direct_map_delta.g1)),
    ("setup s", |x| format!("{:.6}", x.setup_s)),
    ("teardown s", |x| format!("{:.6}", x.teardown_s)),
];

/// One run's table and samples.
pub fn print_run(run: &Run, samples_ms: u64) {
    table(COLUMNS, &run.rows, None);
    println!("Samples every {samples_ms} ms (GB/s, new 2M splits):");
    for x in &run.rows {
        let s = (x.samples.iter()).map(|s| format!("{:.2}/{}", s.gb_per_s, opt(s.level2_splits)));
        let ends: Vec<f64> = x.samples.iter().take(2).map(|s| s.t_s).collect();
        let note = coarsened(&ends, samples_ms);
        println!(
            "  {:>13}: {}{note}",
            x.variant,
            s.collect::<Vec<_>>().join(" ")
        );
    }
}
