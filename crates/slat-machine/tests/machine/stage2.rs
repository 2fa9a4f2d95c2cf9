//! The arm64 stage-2 format on the simulated machine: the dirty-log oracle in every harvest
//! mode (anonymous and THP backings, eager and lazy split, every recovery), and
//! break-before-make under fire — vCPUs checking every translation's data while the host
//! splits and rebuilds blocks under them.

use slat::{CmoPolicy, RebuildOrder, RecoverVariant, Stage2, VmConfig};
use slat_addr::Gfn;
use slat_machine::{Machine, MachineConfig, Workload};
use slat_workload::dirty_oracle::{self, LogMode, OracleConfig, OracleReport};
use slat_workload::{Backing, PassParams, RegionSpec};
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn seed() -> u32 {
    std::env::var("SLAT_TEST_SEED")
        .ok()
        .and_then(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0x5e2)
}

fn machine(mode: LogMode, vm: VmConfig, backing: Backing, vcpus: usize) -> Machine<Stage2> {
    Machine::<Stage2>::new(MachineConfig {
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

fn oracle(m: &Machine<Stage2>, mode: LogMode, seed: u32, toggle_every: u32) -> OracleReport {
    let cfg = OracleConfig {
        mode,
        iterations: 8,
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
    assert!(r.total_dirty() > 0, "{what}: nothing was written");
}

#[test]
fn oracle_is_exact_on_stage2_in_every_mode() {
    let s = seed();
    let d = VmConfig::default();
    let cases = [
        (d, Backing::Anonymous, 0),
        (d, Backing::AnonymousThp, 0),
        (
            VmConfig {
                eager_split: false,
                recover: RecoverVariant::OnFault,
                rebuild: RebuildOrder::BreakFirst,
                cmo: CmoPolicy::Always,
                ..d
            },
            Backing::AnonymousThp,
            3,
        ),
        (
            VmConfig {
                eager_split: false,
                recover: RecoverVariant::OnFault,
                ad_bits: false,
                ..d
            },
            Backing::AnonymousThp,
            2,
        ),
        (
            VmConfig {
                fast_pf: false,
                recover: RecoverVariant::Zap,
                ..d
            },
            Backing::AnonymousThp,
            2,
        ),
    ];
    for (i, (vm, backing, toggle)) in cases.into_iter().enumerate() {
        for mode in LogMode::ALL {
            let m = machine(mode, vm, backing, 3);
            populate(&m);
            let r = oracle(&m, mode, s.wrapping_add(i as u32), toggle);
            assert_exact(&r, &format!("case {i} {} {:?}", mode.name(), vm), s);
            let a = m.vm().audit();
            assert_eq!(a.frozen, 0, "case {i}: a locked entry was left behind");
        }
    }
}

/// Blocks mapped first (logging off), so that logging has blocks to write-protect and split.
fn populate(m: &Machine<Stage2>) {
    m.run_pass(PassParams {
        write_percent: 0,
        ..PassParams::default()
    })
    .expect("populate");
}

/// Several vCPUs (more than host cores) run memstress over one shared region while the host
/// turns logging on and off under them, so blocks are split (eagerly or by write faults) and
/// rebuilt (by faults or in place) while other vCPUs translate through them. The walker turns a
/// TLB conflict (a block and a page translation of the same address cached at once, which only
/// a broken break-before-make allows) into an exit that fails the run.
fn churn(vm: VmConfig, rounds: u32, seed: u32) -> Result<(), String> {
    let m = Machine::<Stage2>::new(MachineConfig {
        vm,
        region: RegionSpec {
            backing: Backing::AnonymousThp,
            vcpus: 4,
            bytes_per_vcpu: 4 * MIB,
            overlap: true,
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .map_err(|e| e.to_string())?;
    m.vm().inject_bugs(INJECTED.with(|b| *b.borrow()));
    populate(&m);
    let params = PassParams {
        write_percent: 50,
        random: true,
        seed,
        timed: false,
        touches: None,
    };
    for _ in 0..rounds {
        m.start(Workload::Loop(params)).map_err(|e| e.to_string())?;
        for on in [true, false] {
            std::thread::sleep(Duration::from_millis(3));
            m.set_dirty_logging(on).map_err(|e| e.to_string())?;
        }
        std::thread::sleep(Duration::from_millis(3));
        m.halt().map_err(|e| e.to_string())?;
    }
    // And one round whose splits and rebuilds do not depend on timing: a whole pass with
    // logging on (writes split blocks), then one with it off (faults or the disable rebuild).
    for on in [true, false] {
        m.set_dirty_logging(on).map_err(|e| e.to_string())?;
        if !on {
            // Logging may have mapped every page at 4 KiB already, and a rebuild on fault
            // needs a translation fault: unmap one page per 2 MiB so the pass takes some.
            let l = m.layout();
            let first = l.gpa >> 12;
            for gfn in (first..first + l.total_pages()).step_by(512) {
                m.vm()
                    .zap_gfn_range(Gfn::new(gfn + 1), Gfn::new(gfn + 2))
                    .expect("not refused: no CPU of this thread in guest mode");
            }
        }
        m.run_pass(PassParams {
            write_percent: 50,
            random: true,
            seed,
            timed: false,
            touches: None,
        })
        .map_err(|e| e.to_string())?;
    }
    let st = m.vm().stats();
    let what = format!("{vm:?}");
    assert!(st.bbm_breaks > 0, "{what}: no block was broken: {st:?}");
    assert!(st.splits > 0 && st.recoveries > 0, "{what}: {st:?}");
    assert!(st.cache_cleans > 0, "{what}: no cache maintenance: {st:?}");
    assert_eq!(m.vm().audit().frozen, 0, "{what}: a locked entry was left");
    Ok(())
}

thread_local! {
    static INJECTED: std::cell::RefCell<u32> = const { std::cell::RefCell::new(0) };
}

#[test]
fn break_before_make_never_lets_a_vcpu_see_a_mixed_translation() {
    let s = seed();
    let d = VmConfig::default();
    for rebuild in [RebuildOrder::BreakFirst, RebuildOrder::InstallFirst] {
        for (cmo, eager_split, recover) in [
            (CmoPolicy::Always, false, RecoverVariant::OnFault),
            (CmoPolicy::OnInstall, false, RecoverVariant::OnFault),
            (CmoPolicy::OnInstall, true, RecoverVariant::InPlace),
        ] {
            let vm = VmConfig {
                rebuild,
                cmo,
                eager_split,
                recover,
                ..d
            };
            if let Err(e) = churn(vm, 6, s) {
                panic!("{vm:?}: {e} (SLAT_TEST_SEED={s:#x})");
            }
        }
    }
}

#[test]
fn skipping_the_invalidation_between_break_and_make_is_caught() {
    let s = seed();
    INJECTED.with(|b| *b.borrow_mut() = slat::dirty::inject::SKIP_BBM_FLUSH);
    let vm = VmConfig {
        eager_split: false,
        recover: RecoverVariant::OnFault,
        ..VmConfig::default()
    };
    let r = churn(vm, 6, s);
    INJECTED.with(|b| *b.borrow_mut() = 0);
    match r {
        Err(e) => assert!(
            e.contains("TlbConflict"),
            "caught, but not as a conflict: {e}"
        ),
        Ok(()) => {
            panic!("a missing break-before-make flush went unnoticed (SLAT_TEST_SEED={s:#x})")
        }
    }
}
