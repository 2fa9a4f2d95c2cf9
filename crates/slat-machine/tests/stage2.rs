//! The arm64 stage-2 format on the simulated machine: the dirty-log oracle in every harvest
//! mode (anonymous and THP backings, eager and lazy split, every recovery), and
//! break-before-make under fire — vCPUs checking every translation's data while the host
//! splits and rebuilds blocks under them.

use slat::{CmoPolicy, RebuildOrder, RecoverVariant, Stage2, VmConfig};
use slat_machine::dirty_oracle::{self, LogMode, OracleConfig, OracleReport};
use slat_machine::{Backing, Machine, MachineConfig};
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
        backing,
        vcpus,
        bytes_per_vcpu: 8 * MIB,
        dirty: mode.dirty_config(512),
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
            let r = oracle(&m, mode, s.wrapping_add(i as u32), toggle);
            assert_exact(&r, &format!("case {i} {} {:?}", mode.name(), vm), s);
            let a = m.vm().audit();
            assert_eq!(a.frozen, 0, "case {i}: a locked entry was left behind");
        }
    }
}
