//! `--backend sim`: the host-direct-map benchmark on the simulated machine. N vCPUs of a
//! confidential guest fault in all of their private memory (one write per page, the patch
//! series' `stress --vm N --vm-bytes .. --vm-keep`); each first touch accepts its page
//! lazily, removing it from the simulated host direct map (`slat::direct_map`) under the
//! chosen policy. One row per variant, a native floor (the same writes on fresh host memory)
//! from the same run, samples of the fault-in rate, and the conversion back to shared.

use super::{
    coarsened, metric, per_s, readings, runtime, sim_variants, table, Column, Document,
    PrivateMemPerfArgs, Readings, NAME,
};
use crate::error::{CliError, CliResult};
use crate::output::{ratio_cell, summarize, Better, Metric, MetricSummary};
use crate::report::{quiet, Phase};
use crate::virtual_time::{self, ClockReport, Stopwatch};
use serde::Serialize;
use slat::direct_map::{DirectMap, DirectMapConfig, DirectMapStats};
use slat::{DirectMapPolicy, Ept, MemoryAttributes, PteFormat, Timed};
use slat_addr::{Gfn, PAGE_SHIFT, PAGE_SIZE};
use slat_machine::vtime::SimThreads;
use slat_machine::{Machine, MachineConfig, MachineError};
use slat_vt::Virtual;
use slat_workload::{format_size, Backing, GuestRam, PassParams, RegionSpec};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Once};
use std::time::{Duration, Instant};

type AnyRun = super::Run;

const GIB: f64 = (1u64 << 30) as f64;

/// Whose cost the figures are.
const WHOSE: &str = "a simulated confidential guest's fault-in of its private memory through slat's engine: lazy acceptance of each page, which removes it from a simulated host direct map (slat's x86 page table) under the chosen policy; not this host kernel's cost (see --backend host)";

const PATTERN: &str = "one write per 4 KiB page, in order, each vCPU its own share; every page private and unaccepted at the start";

const NOTE: &str = "x native: time per page over the native floor's (the same writes on fresh host memory, no engine). splits: huge direct-map leaves split (each flushes every host CPU under the global lock, as Linux does). lock wait: time vCPUs waited for the global lock, summed. flushes: kernel TLB flushes requested (splits, plus one per page with flush=on); acks: acknowledgements by online vCPU threads. to-shared: the whole faulted-in region converted back to shared (guest mappings zapped, every page scrubbed and mapped into the direct map again, with --collapse 2 MiB leaves rebuilt); the way back to private is not timed, as it only zaps (acceptance is lazy).";

/// One variant: a direct-map policy and whether each removal flushes every host CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    pub policy: DirectMapPolicy,
    pub kernel_flush: bool,
}

/// One sample of a fault-in.
#[derive(Debug, Clone, Serialize)]
pub struct SimSample {
    /// End of the interval, seconds from the start of the fault-in.
    t_s: f64,
    /// Pages accepted in the interval, as 10^9 bytes per second.
    gb_per_s: f64,
    splits: u64,
    /// Global-lock wait, summed over vCPUs.
    lock_wait_ms: f64,
}

/// One variant's fault-in and conversion back to shared.
#[derive(Debug, Clone, Serialize)]
pub struct SimRow {
    direct_map: &'static str,
    kernel_flush: bool,
    /// Private bytes faulted in (all vCPUs).
    bytes: u64,
    /// From the pass's start to the last vCPU's last page.
    fault_in_s: f64,
    gb_per_s: f64,
    /// Time per page per vCPU.
    ns_per_page: f64,
    /// Time per page over the native floor's (higher is slower).
    ratio_over_native: Option<f64>,
    /// Pages accepted (every page, once).
    accepted: u64,
    /// Huge direct-map leaves split.
    splits: u64,
    lock_acquisitions: u64,
    /// Global-lock wait, summed over vCPUs.
    lock_wait_ms: f64,
    /// Kernel TLB flushes requested (splits, and each removal with `--kernel-flush on`).
    kernel_flushes: u64,
    /// Acknowledgements of those flushes by the vCPU threads (the host CPUs).
    kernel_flush_acks: u64,
    /// Direct-map leaves after the fault-in: 4 KiB, 2 MiB, 1 GiB.
    leaves_after: [u64; 3],
    /// Converting the whole region to shared (releases every page: scrub, map again, and
    /// with --collapse rebuild 2 MiB leaves).
    to_shared_s: f64,
    to_shared_gib_per_s: f64,
    /// 2 MiB leaves rebuilt by that conversion.
    collapses: u64,
    samples: Vec<SimSample>,
    /// Virtual time: what the contention model did in this variant's simulation (the
    /// conversion to shared included).
    #[serde(skip_serializing_if = "Option::is_none")]
    sim_model: Option<serde_json::Value>,
}

/// `POLICY flush=on|off`.
fn label(policy: impl std::fmt::Display, flush: bool) -> String {
    format!("{policy} flush={}", if flush { "on" } else { "off" })
}

impl SimRow {
    /// `POLICY flush=on|off`.
    pub fn label(&self) -> String {
        label(self.direct_map, self.kernel_flush)
    }
}

/// The native floor: the same writes on fresh host memory, no engine, no direct map.
#[derive(Debug, Clone, Serialize)]
pub struct NativeRow {
    bytes: u64,
    fill_s: f64,
    gb_per_s: f64,
    /// Time per page per vCPU.
    ns_per_page: f64,
}

/// One run over every variant.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    native: NativeRow,
    pub rows: Vec<SimRow>,
    /// Whose time the rows' times are (under `--clock virtual`, each variant is a simulation
    /// of its own; the speed figures are their sums).
    #[serde(flatten)]
    pub clock: Box<ClockReport>,
}

#[derive(Serialize)]
struct Config {
    vcpus: u32,
    bytes_per_vcpu: u64,
    total_bytes: u64,
    samples_ms: u64,
    collapse: bool,
    /// `--phantom`: guest memory and the private pool keep no data.
    phantom: bool,
    pattern: &'static str,
}

/// A headline figure of one variant over the runs.
#[derive(Serialize)]
struct VariantSummary {
    variant: String,
    #[serde(flatten)]
    summary: MetricSummary,
}

/// Variant `v` of a run.
pub fn row<'a>(r: &'a AnyRun, v: &str) -> Option<&'a SimRow> {
    match r {
        AnyRun::Sim(r) => r.rows.iter().find(|x| x.label() == v),
        AnyRun::Host(_) => None,
    }
}

/// A configuration the machine refuses is the flags' fault (exit 2); the rest is a failure.
pub(crate) fn machine_error(e: MachineError) -> CliError {
    match e {
        MachineError::Config(m) => CliError::bad(m),
        e => runtime(e),
    }
}

/// Every variant, then the native floor (last, so that it runs on a host whose allocator is
/// as warm as for the variants).
pub fn measure(a: &PrivateMemPerfArgs) -> CliResult<Run> {
    static HEAD: Once = Once::new();
    if !a.out.json {
        HEAD.call_once(|| print_head(a));
    }
    let mut rows = Vec::new();
    let mut clock: Option<ClockReport> = None;
    for v in sim_variants(a).map_err(CliError::bad)? {
        let (row, c) = timed_variant(a, v)?;
        rows.push(row);
        clock = Some(match clock {
            Some(prev) => prev.merged(&c),
            None => c,
        });
    }
    let phase = Phase::start("native fill", quiet(a.out.json));
    let native = native(a)?;
    phase.done();
    for row in &mut rows {
        row.ratio_over_native =
            (native.ns_per_page > 0.0).then(|| row.ns_per_page / native.ns_per_page);
    }
    let clock = Box::new(clock.unwrap_or_else(ClockReport::real));
    Ok(Run {
        native,
        rows,
        clock,
    })
}

/// One variant on the clock the flags ask for: in virtual time, a simulation of its own
/// (the main thread its host CPU, the vCPUs — the direct map's host CPUs — and the sampler
/// its other CPUs), so no variant's cache-line or lock state reaches the next.
fn timed_variant(a: &PrivateMemPerfArgs, v: Variant) -> CliResult<(SimRow, ClockReport)> {
    let vt = a.clock.start()?;
    let (row, stats) = match &vt {
        None => one_variant::<Ept>(a, v, None)?,
        Some(run) => one_variant::<Timed<Ept, Virtual>>(a, v, Some(run.threads()))?,
    };
    let mut clock = virtual_time::finish(vt)?;
    clock.count_faults(&stats);
    let row = SimRow {
        sim_model: clock.sim_model.clone(),
        ..row
    };
    Ok((row, clock))
}

/// The floor: each vCPU's share written once per page on fresh memory of the pool's kind.
fn native(a: &PrivateMemPerfArgs) -> CliResult<NativeRow> {
    let total = a.total();
    let len = total.div_ceil(2 << 20) * (2 << 20);
    let backing = match a.phantom {
        true => Backing::PhantomThp,
        false => Backing::AnonymousThp,
    };
    let mem = GuestRam::new(backing, len, false).map_err(runtime)?;
    let layout = slat_workload::Layout {
        gpa: 0,
        host: mem.addr(),
        bytes_per_vcpu: a.bytes,
        vcpus: a.threads as usize,
        overlap: false,
    };
    let r = slat_workload::native_baseline::<slat_machine::CpuCounters>(
        layout,
        &mem,
        PassParams::default(),
    )
    .map_err(runtime)?;
    Ok(NativeRow {
        bytes: total,
        fill_s: r.wall.as_secs_f64(),
        gb_per_s: per_s(total, r.wall, 1e9),
        ns_per_page: r.wall.as_nanos() as f64 / (a.bytes >> PAGE_SHIFT).max(1) as f64,
    })
}

/// The samples of a fault-in from the direct map's counters (each read at its time since the
/// first); a last interval that accepted nothing (the pass ended just after a sample) is left
/// out.
fn samples(r: &[(Duration, DirectMapStats)]) -> Vec<SimSample> {
    let mut out: Vec<SimSample> = r
        .windows(2)
        .map(|w| {
            let ((t, a), (u, b)) = (&w[0], &w[1]);
            SimSample {
                t_s: u.as_secs_f64(),
                gb_per_s: per_s(
                    (b.accepted - a.accepted) * PAGE_SIZE,
                    u.saturating_sub(*t),
                    1e9,
                ),
                splits: b.splits - a.splits,
                lock_wait_ms: (b.lock_wait_ns - a.lock_wait_ns) as f64 / 1e6,
            }
        })
        .collect();
    if out.len() > 1 && out.last().is_some_and(|s| s.gb_per_s == 0.0) {
        out.pop();
    }
    out
}

/// One variant's confidential guest, its vCPUs (the direct map's host CPUs) registered with
/// `sim` in virtual time.
fn machine<F: PteFormat>(
    a: &PrivateMemPerfArgs,
    v: Variant,
    sim: Option<Arc<dyn SimThreads>>,
) -> CliResult<Machine<F>> {
    let config = MachineConfig {
        region: RegionSpec {
            vcpus: a.threads as usize,
            bytes_per_vcpu: a.bytes,
            // The pool's host pages are populated up front (and the native floor's): what is
            // measured is acceptance through the engine and the direct map, not this host's
            // page allocator, whose cost on a fresh process varies tenfold run to run here.
            // Phantom memory has none to populate.
            prefault: !a.phantom,
            backing: match a.phantom {
                true => Backing::Phantom,
                false => Backing::Anonymous,
            },
            ..RegionSpec::default()
        },
        private: Some(DirectMapConfig {
            policy: v.policy,
            kernel_flush: v.kernel_flush,
            collapse: a.collapse,
        }),
        ..MachineConfig::default()
    };
    // In virtual time every vCPU has a physical CPU: the simulation schedules them, and the
    // machine's token pool must never block a simulated thread.
    let pcpus = match sim {
        Some(_) => a.threads as usize,
        None => config.pcpus,
    };
    // Building a pre-split direct map of a large pool takes the host CPU seconds of real
    // time with no scheduler call: the simulation's watchdog must not take it for a hang.
    virtual_time::outside(|| Machine::<F>::with_sim(MachineConfig { pcpus, ..config }, sim))
        .map_err(machine_error)
}

/// One variant's fault-in and conversion on a machine of format `F` (`sim`: the simulation
/// its threads join, in virtual time); the row and the engine's counters.
fn one_variant<F: PteFormat>(
    a: &PrivateMemPerfArgs,
    v: Variant,
    sim: Option<Arc<dyn SimThreads>>,
) -> CliResult<(SimRow, serde_json::Value)> {
    let m = machine::<F>(a, v, sim.clone())?;
    let map = m
        .direct_map()
        .ok_or_else(|| runtime("the machine has no direct map"))?
        .clone();
    let total = m.layout().total_pages() * PAGE_SIZE;
    let before = map.stats();
    let every = Duration::from_millis(a.samples_ms);
    let name = label(v.policy, v.kernel_flush);
    let phase = Phase::start(format!("{name} fault-in"), quiet(a.out.json));
    let (pass, stats) = match &sim {
        Some(sim) => sampled_virtual(&m, &map, sim.as_ref(), every)?,
        None => sampled_real(&m, &map, every)?,
    };
    let stats = stats.map_err(|_| runtime("the sampler thread panicked"))?;
    let pass = pass.map_err(machine_error)?;
    phase.done();
    let after = map.stats();
    let acks = pass
        .vcpus
        .iter()
        .map(|c| c.counters.kernel_tlb_flushes)
        .sum();
    // One call over the whole region: no progress inside it, but a line before (at 1 TiB in
    // virtual time it takes minutes of wall time).
    let phase = Phase::start(format!("{name} to-shared"), quiet(a.out.json));
    let (to_shared, collapses) = to_shared(&m, &map)?;
    phase.done();
    let engine = crate::backend::stats_json(&m.vm().stats());
    drop(m);
    let row = SimRow {
        direct_map: v.policy.name(),
        kernel_flush: v.kernel_flush,
        bytes: total,
        fault_in_s: pass.wall.as_secs_f64(),
        gb_per_s: per_s(total, pass.wall, 1e9),
        ns_per_page: pass.wall.as_nanos() as f64 / (a.bytes >> PAGE_SHIFT).max(1) as f64,
        ratio_over_native: None,
        accepted: after.accepted - before.accepted,
        splits: after.splits - before.splits,
        lock_acquisitions: after.lock_acquisitions - before.lock_acquisitions,
        lock_wait_ms: (after.lock_wait_ns - before.lock_wait_ns) as f64 / 1e6,
        kernel_flushes: after.flush_requests - before.flush_requests,
        kernel_flush_acks: acks,
        leaves_after: after.leaves,
        to_shared_s: to_shared.as_secs_f64(),
        to_shared_gib_per_s: per_s(total, to_shared, GIB),
        collapses,
        samples: samples(&stats),
        sim_model: None,
    };
    Ok((row, engine))
}

/// What a fault-in pass and its sampler return.
type Sampled = (
    Result<slat_machine::PassReport, MachineError>,
    std::thread::Result<Vec<(Duration, DirectMapStats)>>,
);

/// The fault-in pass, sampled every `every` by a host thread in real time.
fn sampled_real<F: PteFormat>(
    m: &Machine<F>,
    map: &DirectMap,
    every: Duration,
) -> CliResult<Sampled> {
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let first = (Instant::now(), map.stats());
        // The only thread: a failed start leaves none behind.
        let sampler = std::thread::Builder::new()
            .name("sampler".into())
            .spawn_scoped(s, move || {
                let r = readings(every, stopped, first, || map.stats());
                let t0 = r.first().map(|x| x.0);
                (r.into_iter())
                    .map(|(t, x)| (t0.map_or(Duration::ZERO, |t0| t - t0), x))
                    .collect()
            })
            .map_err(|e| runtime(format!("cannot start the sampler: {e}")))?;
        let pass = m.run_pass(PassParams::default());
        drop(stop);
        Ok((pass, sampler.join()))
    })
}

/// A line on stderr every ten seconds of wall time while a simulated fault-in runs (a
/// 1 TiB one takes over half an hour).
struct Progress {
    pages: u64,
    wall: Instant,
    next: Duration,
}

impl Progress {
    const EVERY: Duration = Duration::from_secs(10);

    fn new(pages: u64) -> Progress {
        Progress {
            pages,
            wall: Instant::now(),
            next: Progress::EVERY,
        }
    }

    fn tick(&mut self, virtual_elapsed: Duration, accepted: u64) {
        let wall = self.wall.elapsed();
        if wall < self.next {
            return;
        }
        self.next = wall + Progress::EVERY;
        eprintln!(
            "[slat] fault-in: {accepted} of {} pages accepted, {:.2} s of virtual time, {:.0} s of wall time",
            self.pages,
            virtual_elapsed.as_secs_f64(),
            wall.as_secs_f64()
        );
    }
}

/// The fault-in pass in virtual time, sampled by a timer: a simulated CPU of its own that
/// sleeps `every` of virtual time between readings (so sampling costs the vCPUs nothing and
/// the samples are the same every run).
fn sampled_virtual<F: PteFormat>(
    m: &Machine<F>,
    map: &DirectMap,
    sim: &dyn SimThreads,
    every: Duration,
) -> CliResult<Sampled> {
    // An observer: it only reads the map's counters, so a deadlock of the vCPUs is one.
    let mut token = sim.register_observer("sampler").map_err(runtime)?;
    let stop = AtomicBool::new(false);
    let start = Stopwatch::start();
    let first = map.stats();
    let mut progress = Progress::new(m.layout().total_pages());
    std::thread::scope(|s| {
        let stop = &stop;
        // The only thread: a failed start leaves none behind (its token is dropped with it).
        let sampler = std::thread::Builder::new()
            .name("sampler".into())
            .spawn_scoped(s, move || {
                token.attach();
                let mut out = Readings::new(every, (Duration::ZERO, first));
                // A tick after the pass ended reads nothing: the host reads the last sample at
                // the end.
                loop {
                    virtual_time::sleep(out.every());
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    out.push((start.elapsed(), map.stats()));
                    progress.tick(start.elapsed(), map.stats().accepted);
                }
                drop(token);
                out.finish(None)
            })
            .map_err(|e| runtime(format!("cannot start the sampler: {e}")))?;
        let pass = m.run_pass(PassParams::default());
        let last = (start.elapsed(), map.stats());
        stop.store(true, Ordering::Release);
        // The join waits outside the simulation; the sampler runs meanwhile.
        sim.step_out();
        let r = sampler.join().map(|mut out| {
            if out.last().is_some_and(|x| x.0 < last.0) {
                out.push(last);
            }
            out
        });
        sim.step_in();
        Ok((pass, r))
    })
}

/// Converts the whole (faulted-in) region to shared, timed: the conversion that involves
/// the direct map (every page released). The way back to private is only a zap of nothing
/// mapped (acceptance is lazy), so it is not measured.
fn to_shared<F: PteFormat>(m: &Machine<F>, map: &DirectMap) -> CliResult<(Duration, u64)> {
    let gfn = Gfn::new(m.layout().gpa >> PAGE_SHIFT);
    let c0 = map.stats().collapses;
    let t0 = Stopwatch::start();
    m.vm()
        .set_memory_attributes(gfn, m.layout().total_pages(), MemoryAttributes::empty())
        .map_err(runtime)?;
    Ok((t0.elapsed(), map.stats().collapses - c0))
}

/// The headline figures of a row, summarized per variant over `--repeat`.
pub const ROW_METRICS: [Metric<SimRow>; 2] = [
    metric("fault-in GB/s", "GB/s", Better::Higher, |r| {
        Some(r.gb_per_s)
    }),
    metric("to-shared GiB/s", "GiB/s", Better::Higher, |r| {
        Some(r.to_shared_gib_per_s)
    }),
];

/// The document of every run, or the note and summary under the runs' text.
pub fn finish(a: &PrivateMemPerfArgs, runs: Vec<AnyRun>) -> CliResult {
    let sims: Vec<&Run> = (runs.iter())
        .filter_map(|r| match r {
            AnyRun::Sim(r) => Some(r),
            AnyRun::Host(_) => None,
        })
        .collect();
    let mut summary = Vec::new();
    for (i, v) in sims.first().map_or(&[][..], |r| &r.rows).iter().enumerate() {
        let rows: Vec<SimRow> = sims.iter().filter_map(|r| r.rows.get(i).cloned()).collect();
        summary.extend(ROW_METRICS.iter().map(|m| VariantSummary {
            variant: v.label(),
            summary: summarize(m, &rows),
        }));
    }
    Document {
        benchmark: NAME,
        backend: "sim",
        measures: WHOSE,
        config: Config {
            vcpus: a.threads,
            bytes_per_vcpu: a.bytes,
            total_bytes: a.total(),
            samples_ms: a.samples_ms,
            collapse: a.collapse,
            phantom: a.phantom,
            pattern: PATTERN,
        },
        probes: None,
        repeat: runs.len(),
        summary,
        runs,
    }
    .print(a.out.json, NOTE, |s| (Some(s.variant.clone()), &s.summary))
}

fn print_head(a: &PrivateMemPerfArgs) {
    println!("Backend: sim. This is {WHOSE}.");
    println!(
        "vCPUs: {}, {} per vCPU ({} total), {PATTERN}; direct-map collapse {}",
        a.threads,
        format_size(a.bytes),
        format_size(a.total()),
        if a.collapse { "on" } else { "off" }
    );
}

const COLUMNS: &[Column<SimRow>] = &[
    ("variant", SimRow::label),
    ("GB/s", |x| format!("{:.3}", x.gb_per_s)),
    ("ns/page", |x| format!("{:.0}", x.ns_per_page)),
    ("x native", |x| ratio_cell(x.ratio_over_native)),
    ("splits", |x| x.splits.to_string()),
    ("lock wait ms", |x| format!("{:.1}", x.lock_wait_ms)),
    ("flushes", |x| x.kernel_flushes.to_string()),
    ("acks", |x| x.kernel_flush_acks.to_string()),
    ("4K/2M/1G leaves", |x| {
        let [k, m, g] = x.leaves_after;
        format!("{k}/{m}/{g}")
    }),
    ("to-shared GiB/s", |x| {
        format!("{:.2}", x.to_shared_gib_per_s)
    }),
    ("collapses", |x| x.collapses.to_string()),
];

/// One run's table (the native floor first) and samples.
pub fn print_run(run: &Run, samples_ms: u64) {
    let n = &run.native;
    let mut native = vec!["native".into(), format!("{:.3}", n.gb_per_s)];
    native.extend([format!("{:.0}", n.ns_per_page), "1.00x".into()]);
    native.resize(COLUMNS.len(), "-".into());
    table(COLUMNS, &run.rows, Some(native));
    if let Some(l) = run.clock.line() {
        println!("{l}");
    }
    println!("Samples every {samples_ms} ms (fault-in GB/s, splits):");
    for x in &run.rows {
        let s = x
            .samples
            .iter()
            .map(|s| format!("{:.2}/{}", s.gb_per_s, s.splits));
        let ends: Vec<f64> = x.samples.iter().take(2).map(|s| s.t_s).collect();
        let note = coarsened(&ends, samples_ms);
        println!(
            "  {:>22}: {}{note}",
            x.label(),
            s.collect::<Vec<_>>().join(" ")
        );
    }
}
