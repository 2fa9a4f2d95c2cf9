//! The dirty-log oracle on the simulated machine: zero lost or spurious pages in every harvest
//! mode, with several vCPUs, for engine variants and huge backings, while other memslots are
//! added, deleted, moved and switched in and out of logging; and a deliberately broken harvest
//! (no TLB flush) is caught.

use slat::dirty::inject;
use slat::{
    Access, DirtyTrack, Fault, GetLogVariant, HostRange, MemslotFlags, PteFormat, RecoverVariant,
    VmConfig, WrprotVariant,
};
use slat_addr::{Gfn, Gpa};
use slat_machine::{Machine, MachineConfig};
use slat_workload::dirty_oracle::{self, LogMode, OracleConfig, OracleReport};
use slat_workload::{Backing, GuestRam, RegionSpec};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

both_formats! {
    every_mode_with_four_vcpus_is_exact,
    variants_and_huge_backings_are_exact,
    // D bits: stage-2 has no hardware dirty bit (HardwareDirty falls back to write
    // protection there, which every other test here covers).
    #[ept_only]
    hardware_dirty_tracking_is_exact,
    exact_while_logging_is_toggled_on_the_checked_slot,
    exact_while_other_slots_churn,
    a_harvest_without_its_flush_is_caught,
    a_lockless_wrprot_without_its_cas_is_caught,
    an_rmap_missing_new_leaves_is_caught,
}

fn seed() -> u32 {
    std::env::var("SLAT_TEST_SEED")
        .ok()
        .and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0x0d1e)
}

fn machine<F: PteFormat>(
    mode: LogMode,
    vm: VmConfig,
    backing: Backing,
    vcpus: usize,
    bytes: u64,
) -> Machine<F> {
    Machine::<F>::new(MachineConfig {
        vm,
        region: RegionSpec {
            backing,
            vcpus,
            bytes_per_vcpu: bytes,
            // A small ring, so vCPUs take ring-full exits all the time.
            dirty: mode.dirty_config(512),
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .expect("machine")
}

fn oracle<F: PteFormat>(m: &Machine<F>, mode: LogMode, iterations: u32, seed: u32) -> OracleReport {
    oracle_toggling(m, mode, iterations, seed, 0)
}

fn oracle_toggling<F: PteFormat>(
    m: &Machine<F>,
    mode: LogMode,
    iterations: u32,
    seed: u32,
    toggle_every: u32,
) -> OracleReport {
    let cfg = OracleConfig {
        mode,
        iterations,
        interval: Duration::from_millis(10),
        seed,
        toggle_every,
    };
    dirty_oracle::run(m, cfg, |_| {}).expect("oracle run")
}

fn assert_exact(r: &OracleReport, what: &str, seed: u32) {
    assert!(
        r.mismatches() == 0,
        "{what}: {} mismatches (rerun with SLAT_TEST_SEED={seed:#x}):\n{}",
        r.mismatches(),
        r.errors.join("\n")
    );
    let writes: u64 = r.iterations.iter().map(|i| i.writes).sum();
    assert!(
        writes > 0 && r.total_dirty() > 0,
        "{what}: nothing was written"
    );
}

fn every_mode_with_four_vcpus_is_exact<F: PteFormat>() {
    let s = seed();
    for (i, mode) in LogMode::ALL.into_iter().enumerate() {
        // Every mode with every write-protect variant, one variant per mode and seed, rotating:
        // over three seeds each pair is covered.
        let wrprot = WrprotVariant::ALL[(s as usize + i) % WrprotVariant::ALL.len()];
        let vm = VmConfig {
            wrprot,
            ..VmConfig::default()
        };
        let m = machine::<F>(mode, vm, Backing::Anonymous, 4, 8 * MIB);
        let r = oracle(&m, mode, 8, s);
        assert_exact(&r, &format!("{} wrprot {wrprot}", mode.name()), s);
        if let Err(e) = m.vm().audit_rmap() {
            panic!("{} wrprot {wrprot}: rmap audit: {e}", mode.name());
        }
        if mode == LogMode::DirtyRing {
            assert!(r.ring_full_exits > 0, "a 512-entry ring never filled");
        }
        assert_eq!(m.vm().audit().frozen, 0);
    }
}

fn variants_and_huge_backings_are_exact<F: PteFormat>() {
    let s = seed().wrapping_add(1);
    let d = VmConfig::default();
    let cases = [
        (
            LogMode::DirtyLog,
            VmConfig {
                get_log: GetLogVariant::Switch,
                ..d
            },
            Backing::Anonymous,
        ),
        (
            LogMode::DirtyLog,
            VmConfig {
                fast_pf: false,
                ..d
            },
            Backing::AnonymousThp,
        ),
        (
            LogMode::ClearLog,
            VmConfig {
                eager_split: false,
                ..d
            },
            Backing::AnonymousThp,
        ),
        (LogMode::ClearLog, d, Backing::AnonymousThp),
        (
            LogMode::DirtyRing,
            VmConfig {
                recover: RecoverVariant::Zap,
                ..d
            },
            Backing::AnonymousThp,
        ),
        (
            LogMode::DirtyLog,
            VmConfig {
                mmu_lock: slat::MmuLockKind::Mutex,
                ad_bits: false,
                ..d
            },
            Backing::Anonymous,
        ),
    ];
    for (mode, vm, backing) in cases {
        let m = machine::<F>(mode, vm, backing, 2, 8 * MIB);
        // Map huge first, so enabling logging has something to split.
        m.run_pass(Default::default()).expect("populate");
        let r = oracle(&m, mode, 6, s);
        assert_exact(&r, &format!("{} {vm:?} {backing}", mode.name()), s);
        let st = m.vm().stats();
        if backing != Backing::Anonymous {
            assert!(st.splits > 0, "{vm:?}: huge backing but nothing was split");
        }
    }
}

/// Hardware-dirty (PML-like) tracking: pages stay writable, the walker logs D transitions,
/// harvests clear D. Exact in both bitmap modes, with the switch GET too, and over THP.
fn hardware_dirty_tracking_is_exact<F: PteFormat>() {
    let s = seed().wrapping_add(4);
    let d = VmConfig {
        dirty_track: DirtyTrack::HardwareDirty,
        ..VmConfig::default()
    };
    let cases = [
        (LogMode::DirtyLog, d, Backing::Anonymous),
        (LogMode::ClearLog, d, Backing::AnonymousThp),
        (
            LogMode::DirtyLog,
            VmConfig {
                get_log: GetLogVariant::Switch,
                eager_split: false,
                ..d
            },
            Backing::AnonymousThp,
        ),
    ];
    for (mode, vm, backing) in cases {
        let m = machine::<F>(mode, vm, backing, 3, 8 * MIB);
        m.run_pass(Default::default()).expect("populate");
        let r = oracle(&m, mode, 8, s);
        assert_exact(&r, &format!("d-bit {} {vm:?} {backing}", mode.name()), s);
        // The walker, not the fast path, logged the writes of 4 KiB leaves.
        let st = m.vm().stats();
        assert!(
            st.dirty_marked > st.pf_fast,
            "d-bit: marks {} should mostly come from the walker, not fast faults {}",
            st.dirty_marked,
            st.pf_fast
        );
    }
    // And the broken harvest is caught in this mode too: without the flush, TLB entries that
    // cache "dirty" keep writing without setting D.
    let m = machine::<F>(LogMode::DirtyLog, d, Backing::Anonymous, 1, 4 * MIB);
    m.vm().inject_bugs(inject::SKIP_HARVEST_FLUSH);
    let r = oracle(&m, LogMode::DirtyLog, 12, s);
    assert!(
        r.iterations.iter().any(|i| i.lost > 0),
        "d-bit: the oracle missed a harvest without a flush (seed {s:#x})"
    );
}

/// Logging on the oracle's own slot is turned off and on again in the middle of iterations
/// while the guest writes (huge-page recovery and eager split race the writers): every page
/// written after the re-enable is reported, in every mode, and later iterations stay exact.
fn exact_while_logging_is_toggled_on_the_checked_slot<F: PteFormat>() {
    let s = seed().wrapping_add(5);
    for mode in LogMode::ALL {
        for backing in [Backing::Anonymous, Backing::AnonymousThp] {
            let m = machine::<F>(mode, VmConfig::default(), backing, 3, 8 * MIB);
            m.run_pass(Default::default()).expect("populate");
            let r = oracle_toggling(&m, mode, 9, s, 2);
            let what = format!("{} {backing} toggled", mode.name());
            assert_exact(&r, &what, s);
            assert_eq!(
                r.iterations.iter().filter(|i| i.toggled).count(),
                4,
                "{what}"
            );
            if backing == Backing::AnonymousThp {
                let st = m.vm().stats();
                assert!(st.recoveries > 0, "{what}: nothing was recovered");
            }
        }
    }
}

/// Other memslots churn while the oracle runs: added, faulted, switched into and out of
/// logging, moved, deleted; and the oracle's own region is zapped now and then.
fn exact_while_other_slots_churn<F: PteFormat>() {
    let s = seed().wrapping_add(2);
    for mode in LogMode::ALL {
        let m = machine::<F>(mode, VmConfig::default(), Backing::AnonymousThp, 3, 8 * MIB);
        m.run_pass(Default::default()).expect("populate");
        let vm = m.vm().clone();
        let layout = m.layout();
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let churn = {
            let (vm, stop, rounds) = (vm.clone(), stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                // Shared with the memslots over it, which keep it mapped while they exist.
                let ram =
                    Arc::new(GuestRam::new(Backing::AnonymousThp, 8 * MIB, true).expect("ram"));
                let mut vcpu = vm.create_vcpu(99);
                let log = MemslotFlags::LOG_DIRTY_PAGES;
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let gpa = (1 + i % 3) * 64 * MIB;
                    // All of it, mapped with 2 MiB (THP) pages.
                    let host = HostRange::new(ram.clone()).expect("host range");
                    assert_eq!(host.page_size(), 2 * MIB);
                    vm.add_memslot(100, Gpa::new(gpa), 4 * MIB, host, MemslotFlags::empty())
                        .expect("add");
                    for p in (0..4 * MIB).step_by(64 << 10) {
                        let f = Fault {
                            private: false,
                            gpa: Gpa::new(gpa + p),
                            access: Access::Write,
                            present: false,
                        };
                        vcpu.handle_fault(f);
                    }
                    vm.set_memslot_flags(100, log).expect("log on");
                    for p in (0..4 * MIB).step_by(128 << 10) {
                        let f = Fault {
                            private: false,
                            gpa: Gpa::new(gpa + p),
                            access: Access::Write,
                            present: true,
                        };
                        vcpu.handle_fault(f);
                    }
                    vm.move_memslot(100, Gpa::new(gpa + 16 * MIB))
                        .expect("move");
                    vm.set_memslot_flags(100, MemslotFlags::empty())
                        .expect("log off");
                    vm.delete_memslot(100).expect("delete");
                    if i % 4 == 0 {
                        let start = layout.gpa >> 12;
                        vm.zap_gfn_range(Gfn::new(start), Gfn::new(start + layout.total_pages()))
                            .expect("not refused: no CPU of this thread in guest mode");
                    }
                    i += 1;
                    rounds.store(i, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_micros(300));
                }
                drop(vcpu);
            })
        };
        let r = oracle(&m, mode, 10, s);
        stop.store(true, Ordering::Relaxed);
        churn.join().expect("churn thread");
        assert_exact(&r, &format!("{} with churn", mode.name()), s);
        assert!(rounds.load(Ordering::Relaxed) > 0, "the churn never ran");
        let a = vm.audit();
        assert_eq!(a.frozen, 0);
    }
}

/// The oracle is not vacuous: a harvest that write-protects but skips the TLB flush lets
/// vCPUs keep writing through stale writable TLB entries, and the oracle sees those pages lost.
fn a_harvest_without_its_flush_is_caught<F: PteFormat>() {
    let s = seed().wrapping_add(3);
    for mode in LogMode::ALL {
        let m = machine::<F>(mode, VmConfig::default(), Backing::Anonymous, 1, 4 * MIB);
        m.vm().inject_bugs(inject::SKIP_HARVEST_FLUSH);
        let r = oracle(&m, mode, 12, s);
        assert!(
            r.iterations.iter().any(|i| i.lost > 0),
            "{}: the oracle missed a harvest without a flush (seed {s:#x})",
            mode.name()
        );
    }
}

/// The oracle sees a broken lock-free write-protect: with `rmap-lockless` finding
/// each harvested page's leaf in the rmap and then skipping the compare-and-swap, pages stay
/// writable after their bit was consumed and later writes go unreported.
fn a_lockless_wrprot_without_its_cas_is_caught<F: PteFormat>() {
    let s = seed().wrapping_add(5);
    for mode in LogMode::ALL {
        let vm = VmConfig {
            wrprot: WrprotVariant::RmapLockless,
            ..VmConfig::default()
        };
        let m = machine::<F>(mode, vm, Backing::Anonymous, 1, 4 * MIB);
        m.vm().inject_bugs(inject::SKIP_LOCKLESS_CAS);
        let r = oracle(&m, mode, 12, s);
        assert!(
            r.iterations.iter().any(|i| i.lost > 0),
            "{}: the oracle missed a lock-free write-protect without its CAS (seed {s:#x})",
            mode.name()
        );
    }
}

/// The lockless write-protect series' ordering (writable → rmap → dirty bit), the other way
/// round: if new leaves never enter the rmap (what an insert after the dirty bit amounts to for a
/// harvest that runs in between), the rmap variants find nothing to protect and the oracle sees
/// pages lost. This also shows the rmap is load-bearing: a miss is trusted, there is no fallback
/// walk.
fn an_rmap_missing_new_leaves_is_caught<F: PteFormat>() {
    let s = seed().wrapping_add(7);
    for wrprot in [WrprotVariant::Rmap, WrprotVariant::RmapLockless] {
        let vm = VmConfig {
            wrprot,
            ..VmConfig::default()
        };
        let m = machine::<F>(LogMode::DirtyLog, vm, Backing::Anonymous, 1, 4 * MIB);
        m.vm().inject_bugs(inject::SKIP_RMAP_INSERT);
        let r = oracle(&m, LogMode::DirtyLog, 12, s);
        assert!(
            r.iterations.iter().any(|i| i.lost > 0),
            "{wrprot}: the oracle missed leaves absent from the rmap (seed {s:#x})"
        );
    }
}
