//! Aging on the simulated machine: the dirty-log oracle stays exact (no lost and no spurious
//! page) while a host thread ages the checked region over and over — clearing A bits, or, with
//! A/D bits off, access-tracking leaves that the vCPUs' lock-free fast path then restores —
//! in every harvest mode, with hardware-dirty tracking, without the fast path, over THP while
//! logging is toggled; and idle page tracking reports exactly the pages a guest pass touched.

use slat::{AgeFlush, DirtyTrack, IdleBitmap, PteFormat, VmConfig};
use slat_addr::{Gfn, Gpa, PAGE_SHIFT, PAGE_SIZE};
use slat_machine::{Machine, MachineConfig};
use slat_workload::dirty_oracle::{self, LogMode, OracleConfig, OracleReport};
use slat_workload::Pattern;
use slat_workload::{Backing, PassParams, RegionSpec};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

both_formats! {
    every_mode_is_exact_while_aging_with_and_without_ad_bits,
    variants_are_exact_while_aging,
    exact_while_logging_is_toggled_and_aging_runs,
    idle_tracking_sees_exactly_the_pages_a_pass_touched,
    clear_young_misses_accesses_through_cached_translations,
}

fn seed() -> u32 {
    std::env::var("SLAT_TEST_SEED")
        .ok()
        .and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0xa9e0)
}

fn machine<F: PteFormat>(
    mode: LogMode,
    vm: VmConfig,
    backing: Backing,
    vcpus: usize,
) -> Machine<F> {
    Machine::<F>::new(MachineConfig {
        vm,
        region: RegionSpec {
            backing,
            vcpus,
            bytes_per_vcpu: 8 * MIB,
            dirty: mode.dirty_config(512),
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .expect("machine")
}

/// What the background ager did.
#[derive(Debug, Default)]
struct AgerReport {
    passes: u64,
    aged_leaves: u64,
    /// Young pages found by passes after the first: nonzero means vCPUs made aged pages young
    /// again (A/D bits: the walker set A; without: the fast path restored access).
    young_again: u64,
}

/// Runs the oracle on `m` while a host thread ages the test region with every form of aging
/// (clear_young mostly, clear_flush_young, test_young, mark_idle/read_idle).
fn oracle_with_aging<F: PteFormat>(
    m: &Machine<F>,
    mode: LogMode,
    iterations: u32,
    seed: u32,
    toggle_every: u32,
) -> (OracleReport, AgerReport) {
    let vm = m.vm().clone();
    let layout = m.layout();
    let (g0, npages) = (layout.gpa >> PAGE_SHIFT, layout.total_pages());
    let stop = Arc::new(AtomicBool::new(false));
    let ager = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut a = AgerReport::default();
            let mut idle = IdleBitmap::new::<F>(Gfn::new(g0), npages).expect("bitmap");
            while !stop.load(Ordering::Relaxed) {
                let r = match a.passes % 8 {
                    3 => vm
                        .clear_flush_young(Gfn::new(g0), Gfn::new(g0 + npages), |_, _| {})
                        .expect("host thread"),
                    5 => vm.test_young(Gfn::new(g0), Gfn::new(g0 + npages)),
                    7 => {
                        vm.read_idle(&mut idle);
                        vm.mark_idle(&mut idle, AgeFlush::NoFlush, |_, _| {})
                            .expect("host thread")
                    }
                    _ => vm.clear_young(Gfn::new(g0), Gfn::new(g0 + npages), |_, _| {}),
                };
                if a.passes > 0 {
                    a.young_again += r.young_pages;
                }
                a.aged_leaves += r.aged_leaves;
                a.passes += 1;
                std::thread::sleep(Duration::from_micros(300));
            }
            a
        })
    };
    let cfg = OracleConfig {
        mode,
        iterations,
        interval: Duration::from_millis(10),
        seed,
        toggle_every,
    };
    let r = dirty_oracle::run(m, cfg, |_| {});
    stop.store(true, Ordering::Relaxed);
    let a = ager.join().expect("ager thread");
    (r.expect("oracle run"), a)
}

fn assert_exact(r: &OracleReport, a: &AgerReport, what: &str, seed: u32) {
    assert!(
        r.mismatches() == 0,
        "{what}: {} mismatches with aging in the background (rerun with SLAT_TEST_SEED={seed:#x}):\n{}",
        r.mismatches(),
        r.errors.join("\n")
    );
    assert!(r.total_dirty() > 0, "{what}: nothing was written");
    assert!(
        a.passes > 1 && a.aged_leaves > 0,
        "{what}: the ager never aged anything ({a:?})"
    );
    assert!(
        a.young_again > 0,
        "{what}: no aged page was accessed again ({a:?})"
    );
}

fn every_mode_is_exact_while_aging_with_and_without_ad_bits<F: PteFormat>() {
    let s = seed();
    for ad_bits in [false, true] {
        for mode in LogMode::ALL {
            let vm = VmConfig {
                ad_bits,
                ..VmConfig::default()
            };
            let m = machine::<F>(mode, vm, Backing::Anonymous, 3);
            let (r, a) = oracle_with_aging(&m, mode, 8, s, 0);
            let what = format!("{} ad_bits {ad_bits}", mode.name());
            assert_exact(&r, &a, &what, s);
            if !ad_bits {
                // Writes to access-tracked pages were restored by the fast path.
                assert!(m.vm().stats().pf_fast > 0, "{what}: no fast-path fault");
            }
            assert_eq!(m.vm().audit().frozen, 0);
        }
    }
}

fn variants_are_exact_while_aging<F: PteFormat>() {
    let s = seed().wrapping_add(1);
    let d = VmConfig::default();
    let cases = [
        // The slow path restores access-tracked leaves.
        (
            LogMode::DirtyLog,
            VmConfig {
                ad_bits: false,
                fast_pf: false,
                ..d
            },
            Backing::Anonymous,
        ),
        // Hardware-dirty logging: aging clears A, never the D bits the log relies on. (Stage-2
        // has no D bit: this runs its write-protection fallback, which must be exact too.)
        (
            LogMode::DirtyLog,
            VmConfig {
                dirty_track: DirtyTrack::HardwareDirty,
                ..d
            },
            Backing::Anonymous,
        ),
        (
            LogMode::ClearLog,
            VmConfig {
                dirty_track: DirtyTrack::HardwareDirty,
                ..d
            },
            Backing::AnonymousThp,
        ),
        // Huge leaves aged before logging starts, split while access-tracked.
        (
            LogMode::ClearLog,
            VmConfig {
                ad_bits: false,
                ..d
            },
            Backing::AnonymousThp,
        ),
        (
            LogMode::DirtyLog,
            VmConfig {
                ad_bits: false,
                mmu_lock: slat::MmuLockKind::Mutex,
                ..d
            },
            Backing::Anonymous,
        ),
    ];
    for (mode, vm, backing) in cases {
        let m = machine::<F>(mode, vm, backing, 2);
        m.run_pass(PassParams::default()).expect("populate");
        let g0 = m.layout().gpa >> PAGE_SHIFT;
        m.vm().clear_young(
            Gfn::new(g0),
            Gfn::new(g0 + m.layout().total_pages()),
            |_, _| {},
        );
        let (r, a) = oracle_with_aging(&m, mode, 6, s, 0);
        assert_exact(&r, &a, &format!("{} {vm:?} {backing}", mode.name()), s);
    }
}

/// Logging toggled off and on in the middle of iterations over THP (huge-page recovery from
/// leaves that may be access-tracked, eager split of huge leaves that may be) while aging runs.
fn exact_while_logging_is_toggled_and_aging_runs<F: PteFormat>() {
    let s = seed().wrapping_add(2);
    for ad_bits in [false, true] {
        for mode in [LogMode::DirtyLog, LogMode::DirtyRing] {
            let vm = VmConfig {
                ad_bits,
                ..VmConfig::default()
            };
            let m = machine::<F>(mode, vm, Backing::AnonymousThp, 2);
            m.run_pass(PassParams::default()).expect("populate");
            let (r, a) = oracle_with_aging(&m, mode, 7, s, 2);
            assert_exact(
                &r,
                &a,
                &format!("{} ad_bits {ad_bits} toggled", mode.name()),
                s,
            );
        }
    }
}

/// The pages one memstress pass of vCPU `i` touches, as indices into its region.
fn touched(params: PassParams, vcpu: u32, pages: u64) -> HashSet<u64> {
    Pattern::new(params, vcpu, pages).map(|(p, _)| p).collect()
}

/// Marked idle with a flush, every access afterwards is seen: the idle bitmap is exactly the
/// complement of the pages a random pass touched, in both hardware modes, per vCPU region.
fn idle_tracking_sees_exactly_the_pages_a_pass_touched<F: PteFormat>() {
    let s = seed().wrapping_add(3);
    for ad_bits in [true, false] {
        let m = Machine::<F>::new(MachineConfig {
            vm: VmConfig {
                ad_bits,
                ..VmConfig::default()
            },
            region: RegionSpec {
                vcpus: 2,
                bytes_per_vcpu: 4 * MIB,
                ..RegionSpec::default()
            },
            ..MachineConfig::default()
        })
        .expect("machine");
        m.run_pass(PassParams::default()).expect("populate");
        let layout = m.layout();
        let vm = m.vm();
        let mut bitmaps: Vec<IdleBitmap> = (0..2)
            .map(|i| {
                let (gpa, _, pages) = layout.region(i);
                IdleBitmap::new::<F>(Gpa::new(gpa).gfn(), pages).expect("bitmap")
            })
            .collect();
        for b in bitmaps.iter_mut() {
            let r = vm
                .mark_idle(b, AgeFlush::Flush, |_, _| {})
                .expect("host thread");
            assert_eq!(r.aged_leaves, b.npages(), "ad_bits {ad_bits}");
            assert_eq!(vm.read_idle(b), b.npages());
        }
        let params = PassParams {
            write_percent: 50,
            random: true,
            seed: s,
            timed: false,
            touches: None,
        };
        m.run_pass(params).expect("random pass");
        for (i, b) in bitmaps.iter_mut().enumerate() {
            let want = touched(params, i as u32, b.npages());
            let idle = vm.read_idle(b);
            assert_eq!(
                idle,
                b.npages() - want.len() as u64,
                "ad_bits {ad_bits} vCPU {i} seed {s:#x}"
            );
            for p in 0..b.npages() {
                assert_eq!(
                    b.is_idle(Gfn::new(b.start_gfn().raw() + p)),
                    Some(!want.contains(&p)),
                    "ad_bits {ad_bits} vCPU {i} page {p} seed {s:#x}"
                );
            }
            let ws = vm.working_set(b);
            assert_eq!(ws.touched_pages, want.len() as u64);
        }
    }
}

/// What clear_young without a flush means: translations the vCPU cached before the marking
/// keep working without setting A (or faulting), so a region within TLB reach looks idle after
/// a pass over it; with clear_flush_young it does not.
fn clear_young_misses_accesses_through_cached_translations<F: PteFormat>() {
    for ad_bits in [true, false] {
        let m = Machine::<F>::new(MachineConfig {
            vm: VmConfig {
                ad_bits,
                ..VmConfig::default()
            },
            region: RegionSpec {
                vcpus: 1,
                // 256 pages: all fit in the 2048-entry TLB, without conflicts.
                bytes_per_vcpu: 256 * PAGE_SIZE,
                ..RegionSpec::default()
            },
            ..MachineConfig::default()
        })
        .expect("machine");
        m.run_pass(PassParams::default()).expect("populate");
        let layout = m.layout();
        let vm = m.vm();
        let mut b = IdleBitmap::new::<F>(Gpa::new(layout.gpa).gfn(), 256).expect("bitmap");
        let read = PassParams {
            write_percent: 0,
            ..PassParams::default()
        };
        for flush in [AgeFlush::Flush, AgeFlush::NoFlush, AgeFlush::Flush] {
            m.run_pass(read).expect("fill the TLB");
            vm.mark_idle(&mut b, flush, |_, _| {}).expect("host thread");
            let pass = m.run_pass(read).expect("pass");
            let faults: u64 = pass.vcpus.iter().map(|v| v.counters.faults).sum();
            let idle = vm.read_idle(&mut b);
            match flush {
                AgeFlush::NoFlush => {
                    assert_eq!(
                        idle, 256,
                        "ad_bits {ad_bits}: cached translations were seen"
                    );
                    assert_eq!(faults, 0);
                }
                AgeFlush::Flush => {
                    assert_eq!(idle, 0, "ad_bits {ad_bits}: accesses after a flush missed");
                    assert_eq!(faults, if ad_bits { 0 } else { 256 });
                }
            }
        }
    }
}
