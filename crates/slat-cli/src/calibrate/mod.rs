//! `slat calibrate`: measures this host's costs with micro-benchmarks and writes a cost
//! profile for `--clock virtual` (docs/design/virtual-time.md, "Calibration").
//!
//! Every number comes from a loop over one operation (an atomic, a page zeroed, a simulated
//! TLB hit, an engine walk step), the median of `--repeat` batches, and its `source` says
//! which loop, how many iterations and the load while it ran. No number is fitted to a
//! benchmark's or a seed's result: whole benchmarks are what the profile is validated
//! against, so they must not feed it. What this nested VM cannot measure (a VM exit, an
//! IPI) is a proxy, labelled "proxy" in its source.

mod engine_bench;
mod host_bench;
mod timing;

use crate::error::{CliError, CliResult};
use clap::Args;
use serde::Serialize;
use slat::clock::Cost;
use slat_vt::{Entry, Profile};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `slat calibrate`'s flags.
#[derive(Debug, Clone, Args)]
pub struct CalibrateArgs {
    /// Write the profile (TOML) to FILE instead of stdout.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Short runs for CI: fewer iterations and smaller buffers (rougher numbers).
    #[arg(long)]
    pub quick: bool,
    /// Batches per micro-benchmark: each number is their median.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
    /// Print a JSON summary (every number, its source, the load) on stdout; needs -o.
    #[arg(long, requires = "output")]
    pub json: bool,
    /// The profile's name (reports print it beside the profile's hash).
    #[arg(long, default_value = "host-calibrated")]
    pub name: String,
}

/// How long and how often to run each micro-benchmark.
pub struct Plan {
    quick: bool,
    /// Host CPUs online, taken before any pinning.
    cpus: usize,
    repeat: u32,
    load: [f64; 3],
}

impl Plan {
    /// `full` iterations, or a twentieth of them with `--quick`.
    fn iters(&self, full: u64) -> u64 {
        if self.quick {
            (full / 20).max(1)
        } else {
            full
        }
    }

    /// The buffer of the memory benchmarks: well beyond the caches.
    fn big_bytes(&self) -> usize {
        if self.quick {
            64 << 20
        } else {
            256 << 20
        }
    }

    /// How long a two-thread benchmark may wait for its partner in all.
    fn limit(&self) -> Duration {
        Duration::from_secs(if self.quick { 10 } else { 60 })
    }

    /// A number with its source: the loop, then how the median was taken and the load.
    fn measured(&self, key: &'static str, ns: f64, how: String) -> Measured {
        let mode = if self.quick { ", --quick" } else { "" };
        Measured {
            key,
            ns: (ns * 1000.0).round() / 1000.0,
            source: format!(
                "slat calibrate: {how}; median of {} batches{mode}; load {:.2} {:.2} {:.2}",
                self.repeat, self.load[0], self.load[1], self.load[2]
            ),
        }
    }
}

/// One calibrated number.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    /// Its profile key (`rmw_local`, `walk_step`, …).
    pub key: &'static str,
    /// Nanoseconds.
    pub ns: f64,
    /// How it was obtained.
    pub source: String,
}

/// The `--json` summary.
#[derive(Debug, Serialize)]
struct Summary<'a> {
    name: &'a str,
    hash: String,
    output: String,
    quick: bool,
    repeat: u32,
    load_before: [f64; 3],
    load_after: [f64; 3],
    wall_s: f64,
    measured: &'a [Measured],
}

/// Runs the micro-benchmarks and writes the profile.
pub fn run(a: &CalibrateArgs) -> CliResult {
    // Open the output first: a bad path fails before minutes of measuring.
    let mut out: Box<dyn Write> = match &a.output {
        Some(p) => Box::new(std::fs::File::create(p).map_err(|e| {
            CliError::Runtime(format!("cannot write the profile to {}: {e}", p.display()))
        })?),
        None => Box::new(std::io::stdout()),
    };
    let wall = Instant::now();
    let plan = Plan {
        quick: a.quick,
        cpus: timing::host_cpus(),
        repeat: a.repeat,
        load: timing::load_average(),
    };
    let measured = measure_all(&plan)?;
    let profile = assemble(&a.name, &measured)?;
    let text = profile
        .to_toml()
        .map_err(|e| CliError::Runtime(e.to_string()))?;
    out.write_all(header(&plan).as_bytes())
        .and_then(|()| out.write_all(text.as_bytes()))
        .and_then(|()| out.flush())
        .map_err(|e| CliError::Runtime(format!("cannot write the profile: {e}")))?;
    if a.json {
        let s = Summary {
            name: &profile.name,
            hash: profile.hash(),
            output: a
                .output
                .as_ref()
                .map_or_else(String::new, |p| p.display().to_string()),
            quick: a.quick,
            repeat: a.repeat,
            load_before: plan.load,
            load_after: timing::load_average(),
            wall_s: wall.elapsed().as_secs_f64(),
            measured: &measured,
        };
        let j = serde_json::to_string_pretty(&s).map_err(|e| CliError::Runtime(e.to_string()))?;
        println!("{j}");
    }
    Ok(())
}

/// The comment at the top of a written profile.
fn header(plan: &Plan) -> String {
    format!(
        "# Cost profile of this host, written by `slat calibrate{}` (micro-benchmarks only;\n# never fitted to a benchmark's result). Host CPUs: {}; load before: {:.2} {:.2} {:.2}.\n",
        if plan.quick { " --quick" } else { "" },
        timing::host_cpus(),
        plan.load[0],
        plan.load[1],
        plan.load[2]
    )
}

/// Every micro-benchmark, in an order where each finds the numbers it subtracts.
fn measure_all(p: &Plan) -> CliResult<Vec<Measured>> {
    let mut all: Vec<Measured> = Vec::new();
    let total = 24;
    let note = |m: Measured, all: &mut Vec<Measured>| {
        eprintln!(
            "calibrate: [{:>2}/{total}] {:<15} {:>10.3} ns",
            all.len() + 1,
            m.key,
            m.ns
        );
        all.push(m);
    };
    note(host_bench::rmw_local(p), &mut all);
    let lt = host_bench::line_transfer(p)?;
    let lt_ns = lt.ns;
    note(lt, &mut all);
    note(host_bench::invalidate(p, lt_ns)?, &mut all);
    note(host_bench::dram_miss(p), &mut all);
    note(host_bench::dram_stream(p), &mut all);
    note(host_bench::handoff(p)?, &mut all);
    let zero = host_bench::zero_page(p);
    let zero_ns = zero.ns;
    note(zero, &mut all);
    note(engine_bench::table_alloc(p, zero_ns), &mut all);
    note(host_bench::page_copy(p), &mut all);
    note(host_bench::epoch_pin(p), &mut all);
    note(host_bench::defer(p), &mut all);
    note(engine_bench::published_load(p)?, &mut all);
    note(engine_bench::walk_step(p)?, &mut all);
    let side = engine_bench::walk_side(p, &all)?;
    note(side, &mut all);
    for m in engine_bench::tlb(p)? {
        note(m, &mut all);
    }
    note(engine_bench::tlb_flush(p)?, &mut all);
    note(host_bench::cmo_line(p), &mut all);
    note(engine_bench::guest_round_trip(p), &mut all);
    let access = engine_bench::guest_access(p, &all)?;
    note(access, &mut all);
    let (rt, how) = engine_bench::guest_mode_round_trip(p, &all)?;
    note(
        p.measured(
            "vm_exit",
            rt / 2.0,
            format!(
                "proxy: half the simulated vCPU's guest-mode exit + entry round trip ({how}), which is what a fault's exit costs slat in real time; a hardware VM exit cannot be measured in this nested VM"
            ),
        ),
        &mut all,
    );
    // The VM exit and entry are among what a fault's pass charges otherwise.
    let mut known = all.clone();
    if let Some(e) = all.iter().find(|m| m.key == "vm_exit") {
        known.push(Measured {
            key: "vm_entry",
            ..e.clone()
        });
    }
    for m in engine_bench::faults(p, &known)? {
        note(m, &mut all);
    }
    Ok(all)
}

/// The value of `key` among `m` (0 if absent).
fn ns_of(m: &[Measured], key: &str) -> f64 {
    m.iter().find(|x| x.key == key).map_or(0.0, |x| x.ns)
}

/// The profile: the measured numbers, the proxies derived from them, and the design choices
/// (fair_every, retention, lookahead, lock policy) of the built-in profile.
fn assemble(name: &str, m: &[Measured]) -> CliResult<Profile> {
    let mut p = Profile::host_estimates();
    p.name = name.to_string();
    let entry = |key: &str| {
        m.iter()
            .find(|x| x.key == key)
            .map(|x| Entry::new(x.ns, x.source.clone()))
            .ok_or_else(|| CliError::Runtime(format!("calibrate: `{key}` was not measured")))
    };
    p.model.rmw_local = entry("rmw_local")?;
    p.model.line_transfer = entry("line_transfer")?;
    p.model.invalidate = entry("invalidate")?;
    p.model.dram_miss = entry("dram_miss")?;
    p.model.dram_stream = Some(entry("dram_stream")?);
    p.model.handoff = entry("handoff")?;
    let lt = ns_of(m, "line_transfer");
    p.model.ipi_latency = Entry::new(
        lt,
        "proxy: = line_transfer (measured here); slat's remote flush is a request word the target sees at its next access boundary, one line transfer after the request; a hardware IPI cannot be measured in this nested VM",
    );
    for (cost, key) in [
        (Cost::WalkStep, "walk_step"),
        (Cost::WalkSide, "walk_side"),
        (Cost::HwWalkStep, "hw_walk_step"),
        (Cost::TlbHit, "tlb_hit"),
        (Cost::TlbMiss, "tlb_miss"),
        (Cost::TlbFlush, "tlb_flush"),
        (Cost::TableAlloc, "table_alloc"),
        (Cost::ZeroPage, "zero_page"),
        (Cost::PageCopy, "page_copy"),
        (Cost::GuestRoundTrip, "guest_round_trip"),
        (Cost::EpochPin, "epoch_pin"),
        (Cost::Defer, "defer"),
        (Cost::PublishedLoad, "published_load"),
        (Cost::CmoLine, "cmo_line"),
        (Cost::GuestAccess, "guest_access"),
        (Cost::VmExit, "vm_exit"),
        (Cost::FastFault, "fast_fault"),
        (Cost::SlowFault, "slow_fault"),
    ] {
        p.set_cost(cost, entry(key)?);
    }
    let exit = entry("vm_exit")?;
    p.set_cost(
        Cost::VmEntry,
        Entry::new(exit.ns, exit.source.replace("vm_exit", "vm_entry")),
    );
    p.set_cost(Cost::FastFaultExit, Entry::new(0.0, "slat calibrate: structural: the simulated machine's fast path resolves a fault inside the access, in guest mode, with no exit to charge (its slow path's exit and entry are vm_exit and vm_entry)"));
    p.set_cost(Cost::IpiSend, Entry::new(lt, "proxy: = line_transfer (measured here): slat's flush request is an RMW on the target's request word; a hardware IPI cannot be measured in this nested VM"));
    let rmw = ns_of(m, "rmw_local");
    p.set_cost(Cost::IpiHandler, Entry::new(rmw, "proxy: = rmw_local (measured here): servicing a flush request is the acknowledgement's RMW (the TLB flush is charged as tlb_flush); a hardware IPI handler cannot be measured in this nested VM"));
    p.validate().map_err(|e| CliError::Runtime(e.to_string()))?;
    Ok(p)
}
