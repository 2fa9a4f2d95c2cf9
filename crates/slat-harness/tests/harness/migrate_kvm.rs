//! Migrations of real guests on `/dev/kvm` (the burst-driven writer), in each log mode, and
//! across machines (kvm to sim). Skipped, saying so, when the host has no usable /dev/kvm.

use crate::common;

use common::*;
use slat_harness::migrate::{BackendKind, LogMode};
use std::time::Duration;

fn kvm_unavailable() -> bool {
    match slat_kvm::host_caps(slat_kvm::DEFAULT_DEVICE) {
        Ok(_) => false,
        Err(e) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            true
        }
    }
}

fn migrate_kvm(log: LogMode, dest: BackendKind) {
    if kvm_unavailable() {
        return;
    }
    let g = source_guest(BackendKind::Kvm, shape(8), log);
    // The unlimited writer dirties pages as fast as KVM's write-protection faults let it
    // (through KVM's own dirty log), right up to the pause; what matters here is that
    // nothing is lost.
    let mut cfg = source_config();
    cfg.max_rounds = 3;
    cfg.auto_converge = false;
    let mut src = start_source(&g, work(0), cfg);
    std::thread::sleep(Duration::from_millis(20));
    let (r, d, dest) = migrate_once(&mut src, dest);
    let r = r.unwrap_or_else(|e| panic!("kvm {}: {e}", log.name()));
    d.into_iter().last().unwrap().unwrap();
    assert!(r.guest_writes > 0, "the KVM guest wrote during pre-copy");
    eprintln!(
        "kvm {}: rounds {:?}, downtime {:?}, {} guest writes during pre-copy",
        log.name(),
        r.rounds.iter().map(|r| r.pages).collect::<Vec<_>>(),
        r.downtime,
        r.guest_writes
    );
    assert_same_memory(g.as_dyn(), &**dest.guest().unwrap());
}

#[test]
fn kvm_get_mode_migrates_verified() {
    migrate_kvm(LogMode::Get, BackendKind::Kvm);
}

#[test]
fn kvm_clear_mode_migrates_verified() {
    migrate_kvm(LogMode::Clear, BackendKind::Kvm);
}

#[test]
fn kvm_ring_mode_migrates_verified() {
    migrate_kvm(LogMode::Ring, BackendKind::Kvm);
}

#[test]
fn kvm_guest_migrates_to_the_simulated_machine() {
    migrate_kvm(LogMode::Clear, BackendKind::Sim);
}

#[test]
fn kvm_rate_limit_holds_on_average() {
    if kvm_unavailable() {
        return;
    }
    let g = source_guest(BackendKind::Kvm, shape(8), LogMode::Get);
    // 2 vCPUs x 200k writes/s for 300 ms: 120k writes, in lumps of one start/stop cycle.
    let w0 = g.writes();
    g.start(work(200_000)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    g.pause().unwrap();
    let w = g.writes() - w0;
    // One lump can overshoot by what a slow start/stop cycle lets through; an unpaced
    // guest writes ~10^8 per second here.
    assert!(w > 0 && w < 10_000_000, "{w} writes");
}
