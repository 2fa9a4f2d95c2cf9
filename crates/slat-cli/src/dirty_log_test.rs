//! `slat dirty-log-test`: KVM's dirty_log_test, the correctness oracle of dirty logging. Guest
//! writers stamp random pages with the iteration number; the host harvests mid-iteration and
//! after stopping the vCPUs, then checks every page: written ⇔ reported. Any mismatch is a
//! failure (exit status 1).

use crate::args::{
    backing, check_backends, check_kvm_ring, guest_size, ring_size, BackendArg, DirtyArgs,
    MachineArgs, TrackArg,
};
use crate::backend::{self, Spec};
use crate::limits::{check_backing, GuestMemory};
use crate::report::{format_header, format_json, quiet, sim_format, Phase};
use clap::{Args, ValueEnum};
use serde_json::json;
use slat::dirty::inject;
use slat_machine::dirty_oracle::{LogMode, OracleConfig};
use slat_machine::ram::{format_size, Backing};
use std::time::Duration;

/// `-M`: which harvest protocols to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// GET_DIRTY_LOG clears and re-protects.
    DirtyLog,
    /// Manual protect + INITIALLY_SET: GET copies, CLEAR_DIRTY_LOG re-protects.
    ClearLog,
    /// Per-vCPU dirty rings, harvest then reset.
    DirtyRing,
    /// All three, one after the other.
    All,
}

/// `--break`: a deliberately broken engine, to see the oracle fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BreakArg {
    /// Harvests write-protect but skip the remote TLB flush (invariant 4 broken).
    SkipHarvestFlush,
}

/// Flags of `slat dirty-log-test`.
#[derive(Debug, Args)]
pub struct DirtyLogTestArgs {
    /// Log mode: dirty-log, clear-log, dirty-ring, or all.
    #[arg(short = 'M', value_enum, default_value = "all")]
    pub mode: ModeArg,
    /// Iterations per mode.
    #[arg(short = 'i', value_parser = clap::value_parser!(u32).range(1..=100_000), default_value_t = 32)]
    pub iterations: u32,
    /// Milliseconds each iteration lets the guest write before the final harvest.
    #[arg(short = 'I', value_parser = clap::value_parser!(u64).range(1..=60_000), default_value_t = 10)]
    pub interval_ms: u64,
    /// Dirty ring entries per vCPU (dirty-ring mode): a power of two from 128 to 65536,
    /// lowered to the largest power of two not above the test's pages, as in the selftest.
    #[arg(short = 'c', value_parser = ring_size, default_value_t = 65536)]
    pub ring_entries: u32,
    /// Guest memory per vCPU (k/m/g/t suffixes, a multiple of 4 KiB); 3 pages are added so
    /// the memslot is not a multiple of 64 pages, as in the selftest.
    #[arg(short = 'b', value_parser = guest_size, default_value = "1G")]
    pub bytes: u64,
    /// vCPUs writing at once (the selftest uses 1).
    #[arg(short = 'v', value_parser = clap::value_parser!(u32).range(1..=512), default_value_t = 1)]
    pub vcpus: u32,
    /// Every vCPU writes anywhere in guest memory instead of its own partition.
    #[arg(short = 'o')]
    pub overlap: bool,
    /// Host memory behind guest RAM: anonymous, anonymous_thp, anonymous_hugetlb, ...
    #[arg(short = 's', value_parser = backing, default_value = "anonymous")]
    pub backing: Backing,
    /// Seed of the guest writers and of the host's harvest points.
    #[arg(short = 'r', default_value_t = 1)]
    pub seed: u32,
    /// Every N iterations (0: never), turn dirty logging off and on again in the middle of
    /// the iteration while the guest writes; pages written after the re-enable are checked.
    #[arg(long = "toggle-every", default_value_t = 0)]
    pub toggle_every: u32,
    /// Run with a deliberately broken engine and expect the oracle to fail.
    #[arg(long = "break", value_enum)]
    pub broken: Option<BreakArg>,
    /// The machine(s) to check: `sim`, `kvm` (the host's /dev/kvm), or `sim,kvm` (one after
    /// the other).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sim")]
    pub backend: Vec<BackendArg>,
    /// Print one JSON document instead of the text report.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub dirty: DirtyArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
}

/// Runs the test on every machine `--backend` lists; an error (or any mismatch) is a non-zero
/// exit.
pub fn run(a: &DirtyLogTestArgs) -> crate::error::CliResult {
    let mut engine_only = a.machine.engine_only();
    engine_only.extend(a.dirty.engine_only());
    if a.broken.is_some() {
        engine_only.push("--break");
    }
    if a.toggle_every != 0 {
        engine_only.push("--toggle-every");
    }
    a.machine
        .format
        .check_backends(&a.backend)
        .map_err(crate::error::CliError::bad)?;
    check_backends(&a.backend, &engine_only).map_err(crate::error::CliError::bad)?;
    let vm_config = a.dirty.apply(a.machine.vm_config());
    a.dirty
        .check(
            &vm_config,
            a.machine.format,
            modes(a).contains(&LogMode::DirtyRing),
        )
        .map_err(crate::error::CliError::bad)?;
    check(a).map_err(crate::error::CliError::bad)?;
    let mut errors = Vec::new();
    for &kind in &a.backend {
        if let Err(e) = run_on(a, kind) {
            errors.push(if a.backend.len() > 1 {
                format!("{}: {e}", kind.name())
            } else {
                e
            });
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; ").into())
    }
}

/// The selftest adds 3 pages to each vCPU's memory, so the memslot is not a multiple of 64
/// pages.
const EXTRA_BYTES: u64 = 3 * 4096;

/// Sizes the machines can hold: `-v` × (`-b` + 3 pages) without overflow, in the guest physical
/// address space of each machine, on this host; and a ring KVM can have.
fn check(a: &DirtyLogTestArgs) -> Result<(), String> {
    check_backing(&a.backend, a.backing)?;
    let mem = GuestMemory::per_vcpu_plus(a.vcpus, a.bytes, EXTRA_BYTES)?;
    mem.fits_gpa(&a.backend, a.machine.format, None)?;
    mem.fits_host(a.backing, 1, a.machine.tlb_bytes(a.vcpus))?;
    if modes(a).contains(&LogMode::DirtyRing) {
        check_kvm_ring(
            &a.backend,
            ring(a, mem.pages()),
            "-c (lowered to the test's pages)",
        )?;
    }
    Ok(())
}

/// The ring size: `-c`, clamped to the largest power of two not above the test's pages (as
/// the selftest does), at least 128.
fn ring(a: &DirtyLogTestArgs, pages: u64) -> u32 {
    let max_ring = 1u64 << (63 - pages.max(1).leading_zeros());
    (a.ring_entries as u64).min(max_ring).max(128) as u32
}

/// The log modes `-M` selects (without the ring under `-M all` with d-bit tracking, which
/// logs into bitmaps only).
fn modes(a: &DirtyLogTestArgs) -> Vec<LogMode> {
    let mut modes: Vec<LogMode> = match a.mode {
        ModeArg::DirtyLog => vec![LogMode::DirtyLog],
        ModeArg::ClearLog => vec![LogMode::ClearLog],
        ModeArg::DirtyRing => vec![LogMode::DirtyRing],
        ModeArg::All => LogMode::ALL.to_vec(),
    };
    if a.dirty.tracking == TrackArg::DBit && a.mode == ModeArg::All {
        modes.retain(|m| *m != LogMode::DirtyRing);
    }
    modes
}

fn run_on(a: &DirtyLogTestArgs, kind: BackendArg) -> Result<(), String> {
    let q = quiet(a.json);
    let modes = modes(a);
    let vm_config = a.dirty.apply(a.machine.vm_config());
    if a.dirty.tracking == TrackArg::DBit && a.mode == ModeArg::All && !a.json {
        // The ring is not a log d-bit tracking can fill; say so rather than skip silently.
        eprintln!("[slat] -M all with --dirty-tracking d-bit: checking dirty-log and clear-log (d-bit tracking logs into bitmaps, not rings)");
    }
    a.dirty.check(
        &vm_config,
        a.machine.format,
        modes.contains(&LogMode::DirtyRing),
    )?;
    // Checked by `check`: no overflow.
    let mem = GuestMemory::per_vcpu_plus(a.vcpus, a.bytes, EXTRA_BYTES)?;
    let bytes = a.bytes + EXTRA_BYTES;
    let ring = ring(a, mem.pages());
    let mut failed = Vec::new();
    let mut docs = Vec::new();
    for mode in modes {
        let dirty = mode.dirty_config(ring);
        let cfg = Spec {
            format: a.machine.format,
            vm: vm_config,
            backing: a.backing,
            vcpus: a.vcpus as usize,
            bytes_per_vcpu: bytes,
            slots: 1,
            overlap: a.overlap,
            tlb_entries: a.machine.tlb_entries,
            pcpus: a.machine.pcpus.unwrap_or(0),
            prefault: !a.machine.no_prefault,
            manual_protect: dirty.manual_protect != 0,
            ring_entries: dirty.ring_entries,
        };
        let p = Phase::start(
            format!(
                "{}{}: mapping {} of {} guest RAM",
                kind.name(),
                sim_format(kind, a.machine.format),
                format_size(bytes * a.vcpus as u64),
                a.backing
            ),
            q,
        );
        let m = backend::create(kind, &cfg)?;
        p.done();
        if let (Some(BreakArg::SkipHarvestFlush), Some(sim)) = (a.broken, m.sim()) {
            sim.inject_bugs(inject::SKIP_HARVEST_FLUSH);
        }
        let layout = m.layout();
        if !a.json {
            println!("Testing guest mode: PA-bits:48,  VA-bits:48,  4K pages");
            println!("{}", format_header(kind, a.machine.format, &vm_config));
            println!("guest physical test memory offset: 0x{:x}", layout.gpa);
            match mode {
                LogMode::DirtyRing => println!(
                    "Testing Log Mode '{}' (ring: {ring} entries per vCPU)",
                    mode.name()
                ),
                _ => println!("Testing Log Mode '{}'", mode.name()),
            }
        }
        let ocfg = OracleConfig {
            mode,
            iterations: a.iterations,
            interval: Duration::from_millis(a.interval_ms),
            seed: a.seed,
            toggle_every: a.toggle_every,
        };
        let json = a.json;
        let r = m.dirty_oracle(mode, ocfg, &mut |it| {
            if !json {
                println!(
                    "Iteration {:2}: dirty: {:<6} clean: {:<6} writes: {:<6}{}",
                    it.iteration,
                    it.dirty,
                    it.clean,
                    it.writes,
                    if it.toggled {
                        " (logging toggled mid-iteration)"
                    } else {
                        ""
                    }
                );
            }
        })?;
        let (lost, spurious): (u64, u64) = r
            .iterations
            .iter()
            .fold((0, 0), |(l, s), i| (l + i.lost, s + i.spurious));
        if !a.json {
            println!(
                "Total bits checked: dirty ({}), clear ({})",
                r.total_dirty(),
                r.total_clean()
            );
            if mode == LogMode::DirtyRing {
                println!("Dirty ring full exits: {}", r.ring_full_exits);
            }
            for e in &r.errors {
                println!("MISMATCH: {e}");
            }
            println!(
                "Log mode '{}': {} ({lost} lost, {spurious} spurious pages)",
                mode.name(),
                if r.mismatches() == 0 { "PASS" } else { "FAIL" }
            );
            println!();
        }
        docs.push(json!({
            "mode": mode.name(),
            "iterations": r.iterations.iter().map(|i| json!({
                "iteration": i.iteration, "dirty": i.dirty, "clean": i.clean,
                "writes": i.writes, "lost": i.lost, "spurious": i.spurious, "toggled": i.toggled,
            })).collect::<Vec<_>>(),
            "total_dirty": r.total_dirty(), "total_clean": r.total_clean(),
            "lost": lost, "spurious": spurious, "ring_full_exits": r.ring_full_exits,
            "errors": r.errors, "pass": r.mismatches() == 0,
        }));
        if r.mismatches() != 0 {
            failed.push(mode.name());
        }
    }
    if a.json {
        let doc = json!({
            "benchmark": "dirty-log-test", "backend": kind.name(),
            "format": format_json(kind, a.machine.format),
            "config": {
                "format": format_json(kind, a.machine.format),
                "cmo": vm_config.cmo.name(), "rebuild": vm_config.rebuild.name(),
                "recover": vm_config.recover.name(), "eager_split": vm_config.eager_split,
                "iterations": a.iterations, "interval_ms": a.interval_ms, "vcpus": a.vcpus,
                "bytes_per_vcpu": bytes, "backing": a.backing.name(), "seed": a.seed,
                "ring_entries": ring, "broken": a.broken.is_some(), "toggle_every": a.toggle_every,
                "get_dirty_log": vm_config.get_log.name(), "dirty_tracking": vm_config.dirty_track.name(),
                "fast_pf": vm_config.fast_pf, "mmu_lock": vm_config.mmu_lock.name(),
            },
            "modes": docs,
        });
        println!("{doc:#}");
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "dirty log mismatch in mode(s) {} (seed {}): pages were lost or misreported",
            failed.join(", "),
            a.seed
        ))
    }
}
