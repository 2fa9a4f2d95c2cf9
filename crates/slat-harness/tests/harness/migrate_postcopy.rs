//! Post-copy on the simulated machine and on KVM: the destination runs the guest before its
//! memory has arrived, faults pull pages over the preempt channel, every page is verified;
//! a link cut pauses both ends and a reconnect recovers; a source that never comes back is
//! a clear error at the destination.

use crate::common;

use common::*;
use slat_harness::migrate::{BackendKind, BenchGuest, LogMode, WorkSpec};
use slat_migrate::postcopy::{PostcopyError, PostcopyTrigger};
use slat_migrate::{Destination, MigrateError, SourceConfig};
use std::sync::Arc;

/// A workload that only reads (its pages stay as the source left them).
fn reads() -> WorkSpec {
    WorkSpec {
        write_percent: 0,
        ..work(0)
    }
}

fn postcopy_config(trigger: PostcopyTrigger) -> SourceConfig {
    SourceConfig {
        postcopy: Some(trigger),
        auto_converge: false,
        // Pre-copy never converges (unless nothing is owed): the switch is post-copy's.
        max_downtime: std::time::Duration::ZERO,
        ..source_config()
    }
}

fn kvm_unavailable() -> bool {
    match slat_kvm::host_caps(slat_kvm::DEFAULT_DEVICE) {
        Ok(_) => false,
        Err(e) => {
            eprintln!("skipping: /dev/kvm unavailable: {e}");
            true
        }
    }
}

/// Migrates a guest running `w` in post-copy to a fresh destination on `backend`; checks
/// the reports and returns the destination.
fn postcopy_once(
    g: &Arc<dyn BenchGuest>,
    backend: BackendKind,
    w: WorkSpec,
    t: PostcopyTrigger,
) -> Destination {
    let mut src = start_source(g, w, postcopy_config(t));
    std::thread::sleep(std::time::Duration::from_millis(20));
    let (r, d, dest) = migrate_once(&mut src, backend);
    let r = r.unwrap_or_else(|e| panic!("post-copy: {e}"));
    let d = d.into_iter().last().unwrap().unwrap();
    let p = r
        .postcopy
        .clone()
        .expect("the migration switched in post-copy");
    let dp = d
        .postcopy
        .clone()
        .expect("the destination ran in post-copy");
    eprintln!("{backend:?}: source {p:?}\ndestination {dp:?}");
    assert!(d.verify.ok(), "every page's digest matches");
    assert_eq!(
        p.background_pages + p.preempt_pages,
        p.discarded,
        "each page sent once"
    );
    assert_eq!(
        dp.background_pages + dp.preempt_pages,
        p.discarded,
        "each page placed once"
    );
    assert_eq!(dp.duplicates, 0);
    if let PostcopyTrigger::After(0) = t {
        assert_eq!(
            p.discarded,
            g.shape().total_pages(),
            "pure post-copy sends all memory"
        );
        assert!(r.rounds.is_empty());
    }
    dest
}

#[test]
fn postcopy_sim_reading_guest_arrives_byte_for_byte() {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Get);
    let dest = postcopy_once(&g, BackendKind::Sim, reads(), PostcopyTrigger::After(0));
    assert_same_memory(g.as_dyn(), &**dest.guest().unwrap());
}

#[test]
fn postcopy_after_one_round_sim_writing_guest_verifies() {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Clear);
    postcopy_once(&g, BackendKind::Sim, work(0), PostcopyTrigger::After(1));
}

#[test]
fn pure_postcopy_sim_writing_guest_verifies() {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Get);
    postcopy_once(&g, BackendKind::Sim, work(0), PostcopyTrigger::After(0));
}

#[test]
fn stalled_precopy_switches_to_postcopy() {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Clear);
    postcopy_once(&g, BackendKind::Sim, work(0), PostcopyTrigger::Stalled);
}

#[test]
fn postcopy_kvm_guest_verifies() {
    if kvm_unavailable() {
        return;
    }
    // The KVM guest's writer has no read-only mode: the digests verify every page.
    let g = source_guest(BackendKind::Kvm, shape(8), LogMode::Get);
    postcopy_once(&g, BackendKind::Kvm, work(0), PostcopyTrigger::After(1));
    let g = source_guest(BackendKind::Kvm, shape(8), LogMode::Get);
    postcopy_once(&g, BackendKind::Kvm, work(0), PostcopyTrigger::After(0));
}

/// A seed from the clock, printed so a failure can be replayed.
fn seed() -> u64 {
    let s = std::env::var("POSTCOPY_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("POSTCOPY_SEED={s}");
    s
}

/// Pure post-copy whose main link is cut `cut` bytes in; returns the source, the first
/// attempt's error and the destination thread.
fn cut_postcopy(
    g: &Arc<dyn BenchGuest>,
    cut: u64,
    conns: usize,
) -> (
    slat_migrate::Source,
    MigrateError,
    String,
    std::thread::JoinHandle<Served>,
) {
    let mut cfg = postcopy_config(PostcopyTrigger::After(0));
    cfg.faults.cut_after = Some(cut);
    let mut src = start_source(g, work(0), cfg);
    let (addr, h) = spawn_dest(
        Destination::new(factory(BackendKind::Sim), dest_config()),
        conns,
    );
    let e = src
        .migrate(&addr, &mut |_| {})
        .expect_err("the cut breaks the first attempt");
    assert!(src.in_postcopy(), "the guest runs on the destination: {e}");
    assert!(!g.running(), "the source never runs the guest again");
    (src, e, addr, h)
}

#[test]
fn link_cut_in_postcopy_pauses_and_recovers() {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Get);
    let s = seed();
    for i in 0..3u64 {
        let total = g.shape().total_bytes();
        // Somewhere past the switch's frames, before the last page.
        let cut = 64 * 1024 + slat_migrate::splitmix(s + i) % (total - 64 * 1024);
        eprintln!("cut after {cut} bytes");
        let (mut src, e, addr, h) = cut_postcopy(&g, cut, 2);
        assert!(
            matches!(e, MigrateError::Postcopy(PostcopyError::Paused { .. })),
            "{e}"
        );
        src.config_mut().faults.cut_after = None;
        let r = src
            .migrate(&addr, &mut |_| {})
            .unwrap_or_else(|e| panic!("recovery: {e}"));
        let (results, _dest) = h.join().unwrap();
        assert!(
            matches!(
                results[0],
                Err(MigrateError::Postcopy(PostcopyError::Paused { .. }))
            ),
            "{:?}",
            results[0]
        );
        let d = results.last().unwrap().as_ref().unwrap();
        assert!(d.verify.ok());
        let p = r.postcopy.unwrap();
        assert_eq!(p.recoveries, 1);
        assert_eq!(d.postcopy.as_ref().unwrap().duplicates, 0);
    }
}

#[test]
fn source_lost_in_postcopy_is_a_clear_error_at_the_destination() {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Get);
    let cut = 64 * 1024 + slat_migrate::splitmix(seed()) % (g.shape().total_bytes() / 2);
    let (src, _e, _addr, h) = cut_postcopy(&g, cut, 1);
    drop(src);
    let (results, mut dest) = h.join().unwrap();
    assert!(matches!(
        results[0],
        Err(MigrateError::Postcopy(PostcopyError::Paused { .. }))
    ));
    let missing = dest.postcopy_missing().expect("post-copy paused");
    assert!(missing > 0);
    let e = dest.abandon_postcopy().expect("a paused post-copy");
    let text = e.to_string();
    assert!(text.contains("cannot run on partial memory"), "{text}");
    assert!(dest.guest().is_none(), "no guest is handed out");
}

/// The preempt channel cut while it carries a random-access guest's faulted pages: the
/// requested pages in flight are lacking at the destination and come again after recovery.
#[test]
fn preempt_channel_cut_pauses_and_recovers() {
    let g = source_guest(BackendKind::Sim, shape(8), LogMode::Get);
    let random_reads = WorkSpec {
        random: true,
        ..reads()
    };
    let mut cfg = postcopy_config(PostcopyTrigger::After(0));
    // The background stream capped (16 MiB take 0.5 s), so faults go ahead of it on the
    // preempt channel, which is cut a few pages in.
    cfg.bandwidth = 32 << 20;
    cfg.faults.cut_preempt_after = Some(2_000 + slat_migrate::splitmix(seed()) % 40_000);
    let mut src = start_source(&g, random_reads, cfg);
    let (addr, h) = spawn_dest(
        Destination::new(factory(BackendKind::Sim), dest_config()),
        2,
    );
    let first = src.migrate(&addr, &mut |_| {});
    let Err(e) = first else {
        // The guest needed fewer pages on demand than the cut point: nothing to recover.
        eprintln!("the preempt channel carried less than the cut point");
        let (results, _) = h.join().unwrap();
        assert!(results.last().unwrap().is_ok());
        return;
    };
    assert!(
        matches!(e, MigrateError::Postcopy(PostcopyError::Paused { .. })),
        "{e}"
    );
    src.config_mut().faults.cut_preempt_after = None;
    let r = src
        .migrate(&addr, &mut |_| {})
        .unwrap_or_else(|e| panic!("recovery: {e}"));
    let (results, dest) = h.join().unwrap();
    let d = results.last().unwrap().as_ref().unwrap();
    assert!(d.verify.ok());
    assert_eq!(r.postcopy.unwrap().recoveries, 1);
    assert_same_memory(g.as_dyn(), &**dest.guest().unwrap());
}
