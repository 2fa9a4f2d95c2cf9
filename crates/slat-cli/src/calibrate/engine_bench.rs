//! Micro-benchmarks through the real engine and simulated machine: table pages, the engine's
//! walk, the memslot snapshot, the simulated TLB and hardware walk, a guest-mode round trip.
//! Each loop runs twice: once on `Ept` (real time) for its time, once on
//! `Timed<Ept, Counting>` for how many walk steps or TLB misses it charged, so a time is
//! divided by the operations the engine really did.

use super::timing::{keep, median, per_op, Counting};
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
use std::time::Instant;

/// Where the benchmarks' memslot starts.
const BASE: u64 = 1 << 32;
/// Pages every pass touches (fits the 64-entry TLB of the hit pass).
const PAGES: u64 = 32;
/// The simulated machine's default TLB, for passes over more memory than it maps.
const GUEST_TLB: usize = 2048;

type Counted = Timed<Ept, Counting>;

/// A VM with one memslot of `bytes` and a vCPU with a TLB of `tlb` entries, in guest mode.
fn machine<F: PteFormat>(bytes: u64, tlb: usize) -> CliResult<(Arc<Vm<F>>, Cpu<F>)> {
    let vm = Vm::<F>::new(VmConfig::default());
    // Pre-faulted, as the benchmarks' guest RAM is: a first touch is the engine's fault only.
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, bytes, true).map_err(runtime)?);
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

/// What the counted hooks since the last [`Counting::reset`] cost by the numbers measured so
/// far (`known`), leaving out the costs in `except` (the one being measured): the part of a
/// loop's time a virtual run charges through other costs and the line model, which the loop's
/// own cost must not charge again. Returns the total and a note of what it was.
fn charged_by_others(known: &[Measured], except: &[Cost]) -> (f64, String) {
    let ns = |key: &str| known.iter().find(|m| m.key == key).map_or(0.0, |m| m.ns);
    let mut total = 0.0;
    let mut parts = Vec::new();
    for c in Cost::ALL.iter().filter(|c| !except.contains(c)) {
        let n = Counting::count(*c);
        if let (true, Some(name)) = (n > 0, slat_vt::cost_name(*c)) {
            total += n as f64 * ns(name);
            parts.push(format!("{n} {name}"));
        }
    }
    let rmws = Counting::local_rmws();
    if rmws > 0 {
        total += rmws as f64 * ns("rmw_local");
        parts.push(format!(
            "{rmws} rmw_local (RMWs, fences, lock grants and releases)"
        ));
    }
    let note = if parts.is_empty() {
        "nothing".to_string()
    } else {
        parts.join(", ")
    };
    (total, note)
}

/// The per-lookup time of `Vm::lookup` over `gfns` (real time) and the walk steps it charges
/// per lookup (counted), both on a VM whose first `n` pages are faulted in.
fn lookups(p: &Plan, n: u64, gfns: &[Gfn]) -> CliResult<(f64, f64)> {
    let gpas = pages(n, 4096);
    let (vm, mut cpu) = machine::<Ept>(n * 4096, 64)?;
    pass(&mut cpu, &gpas)?;
    cpu.exit();
    let per = gfns.len() as u64;
    let rounds = (p.iters(400_000) / per).max(1);
    let ns = per_op(p.repeat, rounds * per, |k| {
        for _ in 0..k / per {
            for g in gfns {
                keep(vm.lookup(*g));
            }
        }
    });
    let (cvm, mut counted) = machine::<Counted>(n * 4096, 64)?;
    pass(&mut counted, &gpas)?;
    counted.exit();
    Counting::reset();
    for g in gfns {
        keep(cvm.lookup(*g));
    }
    Ok((ns, Counting::count(Cost::WalkStep) as f64 / per as f64))
}

/// The engine's software walk, per step: `Vm::lookup` of every populated page (a walk to the
/// leaf) against lookups of addresses 512 GiB away, whose walk ends at the root's empty entry;
/// the difference over the difference of counted steps (as hw_walk_step), so the lookup's
/// own entry and exit (its epoch pin, the result) are not counted as walking.
pub fn walk_step(p: &Plan) -> CliResult<Measured> {
    let n = if p.quick { 256 } else { 4096 };
    let near: Vec<Gfn> = pages(n, 4096).iter().map(|g| Gfn::new(g >> 12)).collect();
    let far: Vec<Gfn> = pages(n, 4096)
        .iter()
        .map(|g| Gfn::new((g + (1 << 39)) >> 12))
        .collect();
    let (t_near, k_near) = lookups(p, n, &near)?;
    let (t_far, k_far) = lookups(p, n, &far)?;
    let steps = k_near - k_far;
    let step = if steps > 0.0 {
        ((t_near - t_far) / steps).max(0.0)
    } else {
        0.0
    };
    Ok(p.measured(
        "walk_step",
        step,
        format!(
            "Vm::lookup of each of {n} populated 4 KiB pages ({t_near:.1} ns/lookup, {k_near:.2} walk steps) against lookups 512 GiB away ({t_far:.1} ns/lookup, {k_far:.2} steps), per extra step (steps counted through Timed<Ept, counting clock>)"
        ),
    ))
}

/// The engine's walk to the next entry of a table: `Vm::audit` (a walk of the whole tree under
/// the write lock, counting leaves) over a VM with every page of `big_bytes` faulted in, less
/// its steps down (walk_step, `known`) and the other costs it charges, per sideways step.
pub fn walk_side(p: &Plan, known: &[Measured]) -> CliResult<Measured> {
    let bytes = p.big_bytes() as u64;
    let gpas = pages(bytes / 4096, 4096);
    let (vm, mut cpu) = machine::<Ept>(bytes, GUEST_TLB)?;
    pass(&mut cpu, &gpas)?;
    cpu.exit();
    let ns = per_op(p.repeat, 1, |k| {
        for _ in 0..k {
            keep(vm.audit());
        }
    });
    drop(vm);
    let (cvm, mut counted) = machine::<Counted>(bytes, GUEST_TLB)?;
    pass(&mut counted, &gpas)?;
    counted.exit();
    Counting::reset();
    keep(cvm.audit());
    let sides = Counting::count(Cost::WalkSide) as f64;
    let (others, what) = charged_by_others(known, &[Cost::WalkSide]);
    let side = if sides > 0.0 {
        ((ns - others) / sides).max(0.0)
    } else {
        0.0
    };
    Ok(p.measured(
        "walk_side",
        side,
        format!(
            "Vm::audit of a tree mapping all {} pages of {} MiB ({:.1} us per audit) minus what it charges otherwise ({:.1} us: {what}), over its {sides} sideways steps (counted through Timed<Ept, counting clock>)",
            gpas.len(),
            bytes >> 20,
            ns / 1e3,
            others / 1e3
        ),
    ))
}

/// A guest data access to memory the caches do not hold, as memstress makes them: passes of
/// the simulated `Cpu::write_u64` over every page of a region far larger than the caches and
/// the TLB (faulted in first), per access, less what the pass charges otherwise (its TLB
/// misses, hardware walk steps, RMWs: counted, priced with `known`). What is left is the
/// store itself and what it costs the host: a cache miss and a host TLB miss per page.
pub fn guest_access(p: &Plan, known: &[Measured]) -> CliResult<Measured> {
    const TLB: usize = GUEST_TLB;
    let bytes = p.big_bytes() as u64;
    let gpas = pages(bytes / 4096, 4096);
    let n = gpas.len() as u64;
    let (_vm, mut cpu) = machine::<Ept>(bytes, TLB)?;
    pass(&mut cpu, &gpas)?;
    let mut failed = None;
    let ns = per_op(p.repeat, n, |k| {
        for _ in 0..(k / n).max(1) {
            if let Err(e) = pass(&mut cpu, &gpas) {
                failed = Some(e);
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    cpu.exit();
    drop(_vm);
    let (_cvm, mut counted) = machine::<Counted>(bytes, TLB)?;
    pass(&mut counted, &gpas)?;
    Counting::reset();
    pass(&mut counted, &gpas)?;
    let (others, what) = charged_by_others(known, &[Cost::GuestAccess]);
    counted.exit();
    let others = others / n as f64;
    Ok(p.measured(
        "guest_access",
        (ns - others).max(0.0),
        format!(
            "simulated Cpu::write_u64 passes over all {n} faulted-in pages of {} MiB with a {TLB}-entry TLB ({ns:.1} ns/access), minus what a pass charges otherwise ({others:.1} ns/access: {what} per pass, counted through Timed<Ept, counting clock>)",
            bytes >> 20
        ),
    ))
}

/// The per-access time of the first pass over all of `gpas` on a fresh machine, `batches`
/// times (each its own machine: a first touch happens once): their median.
fn first_passes(batches: u32, bytes: u64, gpas: &[u64]) -> CliResult<f64> {
    let mut v = Vec::new();
    for _ in 0..batches.max(1) {
        let (_vm, mut cpu) = machine::<Ept>(bytes, GUEST_TLB)?;
        let t0 = Instant::now();
        pass(&mut cpu, gpas)?;
        v.push(t0.elapsed().as_nanos() as f64 / gpas.len() as f64);
        cpu.exit();
    }
    Ok(median(&mut v))
}

/// Write-protects every page of memslot 1 again (dirty logging off, then on) with the vCPU
/// outside guest mode: the next write to each page is a fast-path fault.
fn write_protect<F: PteFormat>(vm: &Vm<F>, cpu: &mut Cpu<F>) -> CliResult {
    cpu.exit();
    vm.set_memslot_flags(1, MemslotFlags::empty())
        .and_then(|()| vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES))
        .map_err(runtime)?;
    cpu.enter();
    Ok(())
}

/// The per-access time of a pass over all of `gpas` after write-protecting them, `batches`
/// times on one machine: their median.
fn protected_passes(batches: u32, bytes: u64, gpas: &[u64]) -> CliResult<f64> {
    let (vm, mut cpu) = machine::<Ept>(bytes, GUEST_TLB)?;
    pass(&mut cpu, gpas)?;
    let mut v = Vec::new();
    for _ in 0..batches.max(1) {
        write_protect(&vm, &mut cpu)?;
        let t0 = Instant::now();
        pass(&mut cpu, gpas)?;
        v.push(t0.elapsed().as_nanos() as f64 / gpas.len() as f64);
    }
    cpu.exit();
    Ok(median(&mut v))
}

/// A fault's own software work on each path: passes of the simulated `Cpu::write_u64` over
/// every page of a region far larger than the caches, as memstress makes them — the first
/// pass on a fresh machine (a slow-path fault per page), and passes after write-protecting
/// every page (a fast-path fault per page) — per fault, less what the pass charges through
/// every other cost and the line model (its walks, TLB misses, table pages, the guest
/// accesses, the VM exits, its RMWs: counted, priced with `known`). Returns `slow_fault`,
/// `fast_fault`.
pub fn faults(p: &Plan, known: &[Measured]) -> CliResult<[Measured; 2]> {
    let bytes = p.big_bytes() as u64;
    let gpas = pages(bytes / 4096, 4096);
    let n = gpas.len() as f64;
    let slow = first_passes(p.repeat, bytes, &gpas)?;
    let fast = protected_passes(p.repeat, bytes, &gpas)?;
    // The same passes through the counting clock: how many faults, and what else they charge.
    let (cvm, mut counted) = machine::<Counted>(bytes, GUEST_TLB)?;
    Counting::reset();
    pass(&mut counted, &gpas)?;
    let slow_n = Counting::count(Cost::SlowFault) as f64;
    let (slow_others, slow_what) = charged_by_others(known, &[Cost::SlowFault]);
    write_protect(&cvm, &mut counted)?;
    Counting::reset();
    pass(&mut counted, &gpas)?;
    let fast_n = Counting::count(Cost::FastFault) as f64;
    let (fast_others, fast_what) = charged_by_others(known, &[Cost::FastFault]);
    counted.exit();
    if slow_n < n || fast_n < n {
        return Err(runtime(format!(
            "fault benchmark: {slow_n} slow and {fast_n} fast faults over {n} pages (expected one each per page)"
        )));
    }
    // Signed: where the parts add up to more than the whole (their memory accesses overlap
    // in the pipeline), the difference is an overlap credit the rest of the fault uses up.
    let per_fault = |ns: f64, others: f64, faults: f64| (ns * n - others) / faults;
    let how = |path: &str, ns: f64, others: f64, what: &str| {
        format!(
            "simulated Cpu::write_u64 over all {n} pages of {} MiB ({path}; {ns:.1} ns/access), minus what the pass charges otherwise ({:.1} ns/access: {what}, counted through Timed<Ept, counting clock>), per fault",
            bytes >> 20,
            others / n
        )
    };
    Ok([
        p.measured(
            "slow_fault",
            per_fault(slow, slow_others, slow_n),
            how(
                "the first pass on a fresh machine, one slow-path fault per page",
                slow,
                slow_others,
                &slow_what,
            ),
        ),
        p.measured(
            "fast_fault",
            per_fault(fast, fast_others, fast_n),
            how(
                "a pass after write-protecting every page, one fast-path fault per page",
                fast,
                fast_others,
                &fast_what,
            ),
        ),
    ])
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

/// A guest-mode exit and entry of the simulated vCPU (`Cpu::exit` + `Cpu::enter`), less
/// what they charge through the line model (the guest-mode word's stores and the fence:
/// counted, priced with `known`): the proxy for a VM exit and entry, as a real one cannot be
/// measured in this nested VM. Returns the round trip's residual and how it was obtained.
pub fn guest_mode_round_trip(p: &Plan, known: &[Measured]) -> CliResult<(f64, String)> {
    let (_vm, mut cpu) = machine::<Ept>(4096, 64)?;
    let iters = p.iters(500_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            cpu.exit();
            cpu.enter();
        }
    });
    cpu.exit();
    let (_cvm, mut counted) = machine::<Counted>(4096, 64)?;
    const TRIPS: u64 = 1000;
    Counting::reset();
    for _ in 0..TRIPS {
        counted.exit();
        counted.enter();
    }
    let (others, what) = charged_by_others(known, &[Cost::VmExit, Cost::VmEntry]);
    counted.exit();
    let others = others / TRIPS as f64;
    let rt = (ns - others).max(0.0);
    Ok((
        rt,
        format!(
            "Cpu::exit + Cpu::enter, {ns:.1} ns, minus what the line model charges for them ({others:.1} ns: {what} over {TRIPS} round trips, counted through Timed<Ept, counting clock>)"
        ),
    ))
}

/// The simulated machine's real-time stand-in for a guest exit and entry around a retried
/// fault or an interrupt in guest mode (its PAUSE loop), timed as the machine runs it: what
/// `guest_round_trip` costs the real-time machine on this host.
pub fn guest_round_trip(p: &Plan) -> Measured {
    let iters = p.iters(20_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            slat_machine::guest_round_trip_stand_in();
        }
    });
    p.measured(
        "guest_round_trip",
        ns,
        format!(
            "slat_machine::guest_round_trip_stand_in, the simulated machine's PAUSE loop after a retried fault or an interrupt taken in guest mode ({iters} loops per batch)"
        ),
    )
}
