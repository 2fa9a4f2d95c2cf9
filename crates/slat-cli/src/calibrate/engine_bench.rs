//! Micro-benchmarks through the real engine and simulated machine: table pages, the engine's
//! walk, the memslot snapshot, the simulated TLB and hardware walk, a guest-mode round trip.
//! Each loop runs twice: once on `Ept` (real time) for its time, once on
//! `Timed<Ept, Counting>` for how many walk steps or TLB misses it charged, so a time is
//! divided by the operations the engine really did.

use super::timing::{keep, per_op, Counting};
use super::{Measured, Plan};
use crate::error::{CliError, CliResult};
use slat::clock::Cost;
use slat::hw::TableAlloc;
use slat::{Ept, HostRange, MemslotFlags, PteFormat, Timed, Vm, VmConfig};
use slat_addr::{Gfn, Gpa};
use slat_machine::sched::PcpuPool;
use slat_machine::tlb::Tlb;
use slat_machine::Cpu;
use slat_workload::{Backing, GuestRam};
use std::sync::Arc;

/// Where the benchmarks' memslot starts.
const BASE: u64 = 1 << 32;
/// Pages every pass touches (fits the 64-entry TLB of the hit pass).
const PAGES: u64 = 32;

type Counted = Timed<Ept, Counting>;

/// A VM with one memslot of `bytes` and a vCPU with a TLB of `tlb` entries, in guest mode.
fn machine<F: PteFormat>(bytes: u64, tlb: usize) -> CliResult<(Arc<Vm<F>>, Cpu<F>)> {
    let vm = Vm::<F>::new(VmConfig::default());
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, bytes, false).map_err(runtime)?);
    let host = HostRange::new(ram).map_err(runtime)?;
    vm.add_memslot(1, Gpa::new(BASE), bytes, host, MemslotFlags::empty())
        .map_err(runtime)?;
    let mut cpu = Cpu::new(vm.clone(), 0, tlb, Arc::new(PcpuPool::new(1))).map_err(runtime)?;
    cpu.enter();
    Ok((vm, cpu))
}

fn runtime(e: impl std::fmt::Display) -> CliError {
    CliError::Runtime(format!("calibrate: {e}"))
}

/// Writes each of `gpas` once (faulting them in the first time).
fn pass<F: PteFormat>(cpu: &mut Cpu<F>, gpas: &[u64]) -> CliResult {
    for &g in gpas {
        cpu.write_u64(g, keep(g))
            .map_err(|e| runtime(format!("{e:?}")))?;
    }
    Ok(())
}

/// Per access: the time of a pass over `gpas` (real time) and the charges of `cost` per access
/// (counted), with a TLB of `tlb` entries; the memory is faulted in before either is taken.
fn access_pass(p: &Plan, gpas: &[u64], span: u64, tlb: usize) -> CliResult<(f64, [f64; 2])> {
    let (_vm, mut cpu) = machine::<Ept>(span, tlb)?;
    pass(&mut cpu, gpas)?;
    let rounds = p.iters(20_000) / gpas.len() as u64;
    let mut failed = None;
    let ns = per_op(p.repeat, rounds.max(1) * gpas.len() as u64, |n| {
        for _ in 0..n / gpas.len() as u64 {
            if let Err(e) = pass(&mut cpu, gpas) {
                failed = Some(e);
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    cpu.exit();
    let (_vm, mut counted) = machine::<Counted>(span, tlb)?;
    pass(&mut counted, gpas)?;
    Counting::reset();
    pass(&mut counted, gpas)?;
    let per = |c: Cost| Counting::count(c) as f64 / gpas.len() as f64;
    let counts = [per(Cost::HwWalkStep), per(Cost::TlbMiss)];
    counted.exit();
    Ok((ns, counts))
}

/// `n` pages `stride` apart from `BASE`.
fn pages(n: u64, stride: u64) -> Vec<u64> {
    (0..n).map(|i| BASE + i * stride).collect()
}

/// The simulated TLB: a hit pass, then passes with a one-entry TLB over pages in one leaf
/// table (the walk resumes from the cached leaf table) and pages 2 MiB apart (full walks).
/// Returns `tlb_hit`, `tlb_miss`, `hw_walk_step`.
pub fn tlb(p: &Plan) -> CliResult<[Measured; 3]> {
    let near = pages(PAGES, 4096);
    let far = pages(PAGES, 2 << 20);
    let (hit, hit_counts) = access_pass(p, &near, PAGES * 4096, 64)?;
    let (t_near, k_near) = access_pass(p, &near, PAGES * 4096, 1)?;
    let (t_far, k_far) = access_pass(p, &far, PAGES * (2 << 20), 1)?;
    let steps = k_far[0] - k_near[0];
    let step = if steps > 0.0 {
        ((t_far - t_near) / steps).max(0.0)
    } else {
        0.0
    };
    let miss = (t_near - hit - k_near[0] * step).max(0.0);
    let how = |what: &str| {
        format!(
            "simulated Cpu::write_u64 passes over {PAGES} faulted-in pages: {what}; walk steps and misses per access counted through Timed<Ept, counting clock> (hit pass {:.2} misses/access, one-entry TLB {:.2} and {:.2} steps/access)",
            hit_counts[1], k_near[0], k_far[0]
        )
    };
    Ok([
        p.measured(
            "tlb_hit",
            hit,
            how("a 64-entry TLB, per access (translation, boundary and a cached store)"),
        ),
        p.measured(
            "tlb_miss",
            miss,
            how(&format!(
                "one-entry TLB over pages of one leaf table ({t_near:.1} ns/access) minus the hit pass and its walk steps"
            )),
        ),
        p.measured(
            "hw_walk_step",
            step,
            how(&format!(
                "one-entry TLB, pages 2 MiB apart ({t_far:.1} ns/access) against pages of one leaf table, per extra walk step"
            )),
        ),
    ])
}

/// The engine's software walk: `Vm::lookup` of every populated page, per step (the lookup's
/// epoch pin, measured separately, taken off).
pub fn walk_step(p: &Plan, epoch_pin: f64) -> CliResult<Measured> {
    let n = if p.quick { 256 } else { 4096 };
    let gpas = pages(n, 4096);
    let gfns: Vec<Gfn> = gpas.iter().map(|g| Gfn::new(g >> 12)).collect();
    let (vm, mut cpu) = machine::<Ept>(n * 4096, 64)?;
    pass(&mut cpu, &gpas)?;
    cpu.exit();
    let rounds = (p.iters(400_000) / n).max(1);
    let ns = per_op(p.repeat, rounds * n, |k| {
        for _ in 0..k / n {
            for g in &gfns {
                keep(vm.lookup(*g));
            }
        }
    });
    let (cvm, mut counted) = machine::<Counted>(n * 4096, 64)?;
    pass(&mut counted, &gpas)?;
    counted.exit();
    Counting::reset();
    for g in &gfns {
        keep(cvm.lookup(*g));
    }
    let steps = Counting::count(Cost::WalkStep) as f64 / n as f64;
    let step = if steps > 0.0 {
        ((ns - epoch_pin) / steps).max(0.0)
    } else {
        0.0
    };
    Ok(p.measured(
        "walk_step",
        step,
        format!(
            "Vm::lookup of each of {n} populated 4 KiB pages ({ns:.1} ns/lookup) minus epoch_pin, over {steps:.2} walk steps per lookup (counted through Timed<Ept, counting clock>)"
        ),
    ))
}

/// `TableAlloc::alloc` (which zeroes the page) and `free_now`, minus zeroing a page.
pub fn table_alloc(p: &Plan, zero_page: f64) -> Measured {
    let alloc = TableAlloc::new();
    let iters = p.iters(200_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            let t = alloc.alloc();
            alloc.free_now(keep(t));
        }
    });
    p.measured(
        "table_alloc",
        (ns - zero_page).max(0.0),
        format!(
            "slat::hw::TableAlloc alloc + free_now ({ns:.1} ns/page) minus zero_page ({iters} pages per batch)"
        ),
    )
}

/// Reading the published memslot set (`Vm::memslots`, an arc-swap load).
pub fn published_load(p: &Plan) -> CliResult<Measured> {
    let (vm, mut cpu) = machine::<Ept>(4096, 64)?;
    cpu.exit();
    let iters = p.iters(2_000_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            drop(keep(vm.memslots()));
        }
    });
    Ok(p.measured(
        "published_load",
        ns,
        format!("Vm::memslots() and drop in a loop ({iters} loads per batch)"),
    ))
}

/// Flushing a full simulated TLB (`Tlb::flush` after 64 inserts, minus the inserts).
pub fn tlb_flush(p: &Plan) -> CliResult<Measured> {
    let mut tlb = Tlb::new(64).map_err(runtime)?;
    let iters = p.iters(100_000);
    let fill = |tlb: &mut Tlb| {
        for g in 0..64u64 {
            tlb.insert(keep(g), 1, g << 12, true, false);
        }
    };
    let both = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            fill(&mut tlb);
            tlb.flush();
        }
    });
    let inserts = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            fill(&mut tlb);
        }
    });
    Ok(p.measured(
        "tlb_flush",
        (both - inserts).max(0.0),
        format!(
            "slat_machine::tlb::Tlb::flush of a 64-entry TLB after 64 inserts ({both:.1} ns) minus the inserts alone ({inserts:.1} ns)"
        ),
    ))
}

/// A guest-mode exit and entry of the simulated vCPU (`Cpu::exit` + `Cpu::enter`): the
/// proxy for a VM exit and entry, half each, as a real one cannot be measured in this
/// nested VM.
pub fn guest_mode_round_trip(p: &Plan) -> CliResult<f64> {
    let (_vm, mut cpu) = machine::<Ept>(4096, 64)?;
    let iters = p.iters(500_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            cpu.exit();
            cpu.enter();
        }
    });
    cpu.exit();
    Ok(ns)
}
