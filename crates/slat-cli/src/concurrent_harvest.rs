//! `dirty-log-perf --concurrent`: the `migrate-perf -c -m -t` shape of the lockless reverse-map write-protect series. The vCPUs keep
//! writing while the host harvests the log `-i` times in a loop; the report sets harvest time,
//! guest write throughput and per-vCPU write latency against the same figures with no harvest
//! running (the iterations before it, where the vCPUs are stopped during each harvest).

use crate::backend::{Backend, Pass, Spec};
use crate::error::CliResult;
use crate::harvest::{Harvest, HarvestTimes};
use crate::latency::LatencySummary;
use crate::output::secs;
use crate::report::per;
use crate::virtual_time::{self, Stopwatch};
use serde::Serialize;
use slat_workload::latency::{latency_histogram, merged, record_latency_n};
use slat_workload::{LatencyHistogram, PassParams, WriteLatency};
use std::time::Duration;

/// Writes at least this slow left the guest (an exit on this host costs microseconds, a write
/// that stays in the guest nanoseconds): a real guest's "stalls" are the writes above it.
pub const STALL_NS: u64 = 1_000;

/// One side of the contrast: the vCPUs writing with or without harvests running.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseFigures {
    pub harvests: usize,
    /// Mean harvest time (get plus clear or ring reset).
    #[serde(rename = "harvest_avg_s", serialize_with = "secs")]
    pub harvest_avg: Duration,
    #[serde(rename = "harvest_max_s", serialize_with = "secs")]
    pub harvest_max: Duration,
    pub pages_touched: u64,
    /// Pages touched per second of guest time: `pages_touched` over the vCPUs' wall time.
    pub guest_pages_per_s: f64,
    /// Every vCPU's recorded write latencies (what is recorded: `latency_recorded`).
    pub write_latency: LatencySummary,
    pub write_latency_per_vcpu: Vec<LatencySummary>,
    /// Recorded writes of at least [`STALL_NS`] (a real guest's exits); `null` on a machine
    /// that records only faulting writes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stalls: Option<LatencySummary>,
}

/// What `--concurrent` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrentReport {
    /// The vCPUs' writing time before each harvest (`--harvest-interval`, or one mean pass).
    #[serde(rename = "harvest_interval_s", serialize_with = "secs")]
    pub harvest_interval: Duration,
    /// What the latencies are of (`faulting writes`, or every write timed in-guest).
    pub latency_recorded: &'static str,
    /// The iterations after the first (the vCPUs stopped during each harvest).
    pub quiet: PhaseFigures,
    /// The vCPUs writing in a loop while the host harvested.
    pub concurrent: PhaseFigures,
    /// Every concurrent harvest, in order.
    pub concurrent_harvests: Vec<HarvestTimes>,
}

/// Timed passes of the iterations, kept for the quiet side of the contrast.
#[derive(Default)]
pub struct QuietPasses {
    passes: Vec<(Pass, HarvestTimes)>,
}

impl QuietPasses {
    /// Keeps iteration `i`'s pass and harvest (iteration 1 may still split huge pages or fault
    /// in tables, which the concurrent phase no longer does: it is left out).
    pub fn keep(&mut self, i: u32, pass: Pass, h: HarvestTimes) {
        if i > 1 {
            self.passes.push((pass, h));
        }
    }

    fn figures(&self, kind: WriteLatency) -> PhaseFigures {
        let harvests: Vec<HarvestTimes> = self.passes.iter().map(|(_, h)| *h).collect();
        let wall: Duration = self.passes.iter().map(|(p, _)| p.wall).sum();
        let pages = self.passes.iter().map(|(p, _)| p.pages()).sum();
        let per_vcpu = per_vcpu_merge(self.passes.iter().map(|(p, _)| &p.latency));
        figures(&harvests, pages, wall, &per_vcpu, kind)
    }
}

/// Merges each vCPU's histograms over several passes.
fn per_vcpu_merge<'a>(
    passes: impl Iterator<Item = &'a Vec<LatencyHistogram>>,
) -> Vec<LatencyHistogram> {
    let mut out: Vec<LatencyHistogram> = Vec::new();
    for lat in passes {
        if out.len() < lat.len() {
            out.resize_with(lat.len(), latency_histogram);
        }
        for (acc, h) in out.iter_mut().zip(lat) {
            // Same bounds on both sides: adding cannot fail.
            let _ = acc.add(h);
        }
    }
    out
}

fn figures(
    harvests: &[HarvestTimes],
    pages: u64,
    wall: Duration,
    per_vcpu: &[LatencyHistogram],
    kind: WriteLatency,
) -> PhaseFigures {
    let totals: Vec<Duration> = harvests.iter().map(HarvestTimes::total).collect();
    let all = merged(per_vcpu);
    PhaseFigures {
        harvests: harvests.len(),
        harvest_avg: mean(&totals),
        harvest_max: totals.iter().copied().max().unwrap_or_default(),
        pages_touched: pages,
        guest_pages_per_s: per(pages as f64, wall.as_secs_f64()).unwrap_or(0.0),
        write_latency: LatencySummary::of(&all),
        write_latency_per_vcpu: per_vcpu.iter().map(LatencySummary::of).collect(),
        stalls: (kind == WriteLatency::AllWrites).then(|| stalls(&all)),
    }
}

/// The summary of the recorded values of at least [`STALL_NS`].
fn stalls(h: &LatencyHistogram) -> LatencySummary {
    let mut slow = latency_histogram();
    for v in h.iter_recorded() {
        let value = h.median_equivalent(v.value_iterated_to());
        if value >= STALL_NS {
            record_latency_n(&mut slow, value, v.count_at_value());
        }
    }
    LatencySummary::of(&slow)
}

fn mean(xs: &[Duration]) -> Duration {
    match xs.len() {
        0 => Duration::ZERO,
        n => xs.iter().sum::<Duration>() / n as u32,
    }
}

/// The concurrent phase: the vCPUs loop over their memory (timed) while the host harvests
/// `iterations` times, `interval` apart; then the contrast with the quiet iterations.
pub fn run(
    m: &dyn Backend,
    spec: &Spec,
    harvest: &mut Harvest,
    params: PassParams,
    iterations: u32,
    interval: Duration,
    quiet: &QuietPasses,
) -> CliResult<ConcurrentReport> {
    let params = PassParams {
        timed: true,
        ..params
    };
    // The host's clock: a simulated CPU's under --clock virtual, where the harvests below run
    // on host CPU 0 against the vCPUs' simulated CPUs.
    let t0 = Stopwatch::start();
    m.start_loop(params)?;
    let harvests = harvest_loop(m, spec, harvest, iterations, interval);
    // Halt even when a harvest failed, so no vCPU is left running; the harvest's error wins.
    let halted = m.halt();
    let wall = t0.elapsed();
    let harvests = harvests?;
    let pass = halted?;
    let kind = m.write_latency();
    let concurrent = figures(&harvests, pass.pages(), wall, &pass.latency, kind);
    Ok(ConcurrentReport {
        harvest_interval: interval,
        latency_recorded: kind.describe(),
        quiet: quiet.figures(kind),
        concurrent,
        concurrent_harvests: harvests,
    })
}

fn harvest_loop(
    m: &dyn Backend,
    spec: &Spec,
    harvest: &mut Harvest,
    iterations: u32,
    interval: Duration,
) -> CliResult<Vec<HarvestTimes>> {
    let mut out = Vec::with_capacity(iterations as usize);
    for _ in 0..iterations {
        if !interval.is_zero() {
            virtual_time::sleep(interval);
        }
        out.push(harvest.run(m, spec)?);
    }
    Ok(out)
}

impl ConcurrentReport {
    /// The text lines after the selftest's report.
    pub fn lines(&self) -> Vec<String> {
        let (q, c) = (&self.quiet, &self.concurrent);
        let mut v = vec![
            format!(
                "Concurrent harvest: {} harvests, each after {:.6}s of writing, while every vCPU kept writing",
                c.harvests,
                self.harvest_interval.as_secs_f64()
            ),
            format!(
                "Harvest time avg/max: {:.6}s/{:.6}s with the vCPUs writing, {:.6}s/{:.6}s with them stopped ({:.2}x)",
                c.harvest_avg.as_secs_f64(),
                c.harvest_max.as_secs_f64(),
                q.harvest_avg.as_secs_f64(),
                q.harvest_max.as_secs_f64(),
                per(c.harvest_avg.as_secs_f64(), q.harvest_avg.as_secs_f64()).unwrap_or(0.0),
            ),
            format!(
                "Guest writes: {:.0} pages/s during harvests, {:.0} pages/s in the passes between stopped harvests",
                c.guest_pages_per_s, q.guest_pages_per_s
            ),
            format!(
                "Write latency ({}), no harvest running: {}",
                self.latency_recorded,
                q.write_latency.line()
            ),
            format!(
                "Write latency ({}), during harvests: {}",
                self.latency_recorded,
                c.write_latency.line()
            ),
        ];
        if let (Some(qs), Some(cs)) = (&q.stalls, &c.stalls) {
            v.push(format!(
                "Stalls (writes >= {} ns, i.e. exits), no harvest running: {}",
                STALL_NS,
                qs.line()
            ));
            v.push(format!(
                "Stalls (writes >= {} ns, i.e. exits), during harvests: {}",
                STALL_NS,
                cs.line()
            ));
        }
        v
    }
}
