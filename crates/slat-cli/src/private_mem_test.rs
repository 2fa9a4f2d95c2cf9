//! `slat private-mem-test`: the private-memory conversion test (KVM's
//! `private_mem_conversions_test`; host direct map for private memory) on the simulated machine. vCPUs convert chunks of
//! their memory between shared and private while the others do the same and a host CPU reads
//! the private pool through the host direct map; every access is checked against the rules
//! (`slat_machine::conversion`). Exits 1 if any rule was broken.

use crate::args::{guest_size, variant, BackendArg, Switch};
use crate::error::{CliError, CliResult};
use crate::limits::GuestMemory;
use crate::output::print_json;
use crate::private_mem_perf::{table, Column};
use crate::report::{quiet, Phase};
use clap::Args;
use serde::Serialize;
use slat::direct_map::DirectMapConfig;
use slat::DirectMapPolicy;
use slat_machine::conversion::{run_conversion_test, ConversionParams, ConversionReport};
use slat_workload::{format_size, Backing};

/// Flags of `slat private-mem-test`.
#[derive(Debug, Args)]
pub struct PrivateMemTestArgs {
    /// vCPUs, each converting its own part of guest memory (1-64).
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=64), default_value_t = 2)]
    pub vcpus: u32,
    /// Memory per vCPU: bytes with an optional k/m/g/t suffix, a non-zero multiple of 4 KiB
    /// (at most 4 GiB).
    #[arg(short = 'b', value_parser = guest_size, default_value = "16M")]
    pub bytes: u64,
    /// Passes over each vCPU's memory; each pass converts every page to private and back.
    #[arg(short = 'i', long = "rounds", value_parser = clap::value_parser!(u32).range(1..=10000), default_value_t = 4)]
    pub rounds: u32,
    /// Seed of the values written (printed with every violation).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The host direct map: `2m-split` (huge leaves split on demand under one lock), `4k`
    /// (pre-split), `none` (left alone, TDX-style: the host can then read private pages, so
    /// that rule is not checked).
    #[arg(long = "direct-map", value_name = "POLICY", value_parser = variant::<DirectMapPolicy>(), default_value = "2m-split")]
    pub direct_map: DirectMapPolicy,
    /// Flush every host CPU's kernel TLB after a page leaves the direct map. With `off`, a host
    /// CPU may read a page through a stale translation after it became private: counted as
    /// stale reads (the risk that option takes), not as a violation.
    #[arg(
        long = "kernel-flush",
        value_enum,
        value_name = "on|off",
        default_value = "on"
    )]
    pub kernel_flush: Switch,
    /// Put 2 MiB direct-map leaves back when a whole block is shared again (2m-split).
    #[arg(long)]
    pub collapse: bool,
    /// Print one JSON document instead of the text report.
    #[arg(long)]
    pub json: bool,
}

/// The document: the settings and the result.
#[derive(Serialize)]
struct Report<'a> {
    benchmark: &'static str,
    backend: &'static str,
    vcpus: u32,
    bytes_per_vcpu: u64,
    rounds: u32,
    seed: u64,
    direct_map: &'static str,
    kernel_flush: bool,
    collapse: bool,
    passed: bool,
    result: &'a ConversionReport,
}

/// Runs `slat private-mem-test`.
pub fn run(a: &PrivateMemTestArgs) -> CliResult {
    if a.bytes > 4 << 30 {
        return Err(CliError::bad(format!(
            "-b {}: at most 4 GiB per vCPU (the test keeps two copies of guest memory)",
            format_size(a.bytes)
        )));
    }
    // The shared RAM and the private pool, both populated.
    GuestMemory::per_vcpu_plus(a.vcpus, a.bytes, a.bytes)
        .and_then(|m| m.fits_host(Backing::AnonymousThp, 1, 0))
        .map_err(CliError::bad)?;
    let p = ConversionParams {
        vcpus: a.vcpus as usize,
        bytes_per_vcpu: a.bytes,
        direct_map: DirectMapConfig {
            policy: a.direct_map,
            kernel_flush: a.kernel_flush.on(),
            collapse: a.collapse,
        },
        rounds: a.rounds,
        seed: a.seed,
    };
    let phase = Phase::start("conversions", quiet(a.json));
    let r = run_conversion_test(p).map_err(crate::private_mem_perf::machine_error)?;
    phase.done();
    let passed = r.violations == 0;
    let report = Report {
        benchmark: "private-mem-test",
        backend: "sim",
        vcpus: a.vcpus,
        bytes_per_vcpu: a.bytes,
        rounds: a.rounds,
        seed: a.seed,
        direct_map: a.direct_map.name(),
        kernel_flush: a.kernel_flush.on(),
        collapse: a.collapse,
        passed,
        result: &r,
    };
    if a.json {
        print_json(&report, &[BackendArg::Sim])?;
    } else {
        print_text(a, &r);
    }
    if passed {
        Ok(())
    } else {
        Err(CliError::Runtime(format!(
            "{} violation(s) of the private-memory rules (seed {:#x}); first: {}",
            r.violations,
            a.seed,
            r.first_violations.first().map_or("-", String::as_str)
        )))
    }
}

const COLUMNS: &[Column<ConversionReport>] = &[
    ("conversions", |r| (r.to_private + r.to_shared).to_string()),
    ("GiB converted", |r| {
        format!("{:.3}", r.bytes_converted as f64 / (1u64 << 30) as f64)
    }),
    ("convert GiB/s", |r| format!("{:.2}", r.convert_gib_per_s)),
    ("accesses checked", |r| r.accesses_checked.to_string()),
    ("memory-fault exits", |r| r.memory_fault_exits.to_string()),
    ("host reads (mapped)", |r| {
        format!("{} ({})", r.host_reads, r.host_reads_mapped)
    }),
    ("stale host reads", |r| r.stale_host_reads.to_string()),
    ("accepted", |r| r.accepted.to_string()),
    ("splits", |r| r.splits.to_string()),
    ("collapses", |r| r.collapses.to_string()),
    ("violations", |r| r.violations.to_string()),
];

fn print_text(a: &PrivateMemTestArgs, r: &ConversionReport) {
    let on = |b: bool| if b { "on" } else { "off" };
    println!(
        "private-mem-test on the simulated machine: {} vCPUs x {}, {} rounds, direct map {} (kernel flush {}, collapse {}), seed {:#x}",
        a.vcpus,
        format_size(a.bytes),
        a.rounds,
        a.direct_map,
        on(a.kernel_flush.on()),
        on(a.collapse),
        a.seed
    );
    table(COLUMNS, std::slice::from_ref(r), None);
    if !r.host_isolation_checked {
        println!("The host's isolation from private pages was not checked: with --direct-map none the direct map keeps them, as TDX's does.");
    }
    for v in &r.first_violations {
        println!("VIOLATION: {v}");
    }
    match r.violations {
        0 => println!("PASS: every access saw what the rules allow"),
        _ => println!("FAIL"),
    }
}
