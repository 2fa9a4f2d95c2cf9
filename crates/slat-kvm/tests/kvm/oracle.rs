//! The dirty-log oracle on real KVM: every mode, two vCPUs, no lost or spurious pages.

use crate::common;

use common::machine_or_skip;
use slat_kvm::{KvmConfig, KvmError};
use slat_workload::dirty_oracle::{run, LogMode, OracleConfig};
use slat_workload::RegionSpec;
use slat_workload::TestMachine;
use std::time::Duration;

fn oracle(mode: LogMode, slots: usize, ring_entries: u32) {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 4 << 20,
            slots,
            dirty: mode.dirty_config(ring_entries),
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let cfg = OracleConfig {
        mode,
        iterations: 8,
        interval: Duration::from_millis(30),
        seed: 42,
        toggle_every: 0,
    };
    let mut seen = 0;
    let r = run(&m, cfg, |it| {
        seen += 1;
        assert_eq!(it.iteration, seen);
    })
    .expect("oracle run");
    assert_eq!(r.iterations.len(), 8);
    assert!(r.errors.is_empty(), "{}: {:#?}", mode.name(), r.errors);
    assert_eq!(r.lost(), 0);
    assert_eq!(r.mismatches(), 0);
    let total = m.layout().total_pages();
    // The guests did write, and what they wrote was reported: an oracle that checks nothing
    // would pass trivially. (Per iteration a loaded host may halt a writer before its first
    // write, so this is over the run.)
    let writes: u64 = r.iterations.iter().map(|i| i.writes).sum();
    assert!(writes > 0 && r.total_dirty() > 0, "{}: {r:?}", mode.name());
    for it in &r.iterations {
        assert_eq!(it.dirty + it.clean, total);
        // Outside clear-log's first iteration (all bits set), every reported page was
        // written at least once.
        if !(mode == LogMode::ClearLog && it.iteration == 1) {
            assert!(it.dirty <= it.writes, "{it:?}");
        }
    }
    eprintln!(
        "{}: dirty {} clean {} writes {} ring-full exits {}",
        mode.name(),
        r.total_dirty(),
        r.total_clean(),
        r.iterations.iter().map(|i| i.writes).sum::<u64>(),
        r.ring_full_exits
    );
    // Logging is off again.
    assert!(!m.dirty_logging());
}

#[test]
fn oracle_dirty_log() {
    oracle(LogMode::DirtyLog, 1, 0);
}

#[test]
fn oracle_clear_log() {
    oracle(LogMode::ClearLog, 2, 0);
}

#[test]
fn oracle_dirty_ring() {
    // A ring larger than a vCPU's pages: only the host harvests and resets (a missing or
    // broken reset shows up as lost pages).
    oracle(LogMode::DirtyRing, 2, 4096);
}

#[test]
fn oracle_dirty_ring_small() {
    // A small ring, so vCPUs also take ring-full exits and harvest on their own.
    oracle(LogMode::DirtyRing, 2, 512);
}

#[test]
fn oracle_refuses_a_machine_built_for_another_mode() {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 1,
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let cfg = OracleConfig {
        mode: LogMode::DirtyRing,
        iterations: 1,
        interval: Duration::from_millis(1),
        seed: 1,
        toggle_every: 0,
    };
    assert!(matches!(run(&m, cfg, |_| {}), Err(KvmError::Config(_))));
    let cfg = OracleConfig {
        mode: LogMode::DirtyLog,
        iterations: 0,
        ..cfg
    };
    assert!(matches!(run(&m, cfg, |_| {}), Err(KvmError::Config(_))));
}
