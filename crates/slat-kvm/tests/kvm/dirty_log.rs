//! Dirty logging on real KVM: GET (clearing and manual), CLEAR, INITIALLY_SET, and the dirty
//! ring (harvest, reset, ring-full exits).

use crate::common;

use common::{expected_writes, get_region_log, machine_or_skip, pages_of, to_bitmap};
use slat_dirty::DirtyLogSource;
use slat_dirty::Error;
use slat_kvm::{KvmConfig, KvmError, KvmMachine};
use slat_workload::TestMachine;
use slat_workload::{
    DirtyConfig, PassParams, RegionSpec, FIRST_SLOT, INITIALLY_SET, MANUAL_PROTECT_ENABLE,
};
use std::collections::BTreeSet;

const HALF_RANDOM: PassParams = PassParams {
    write_percent: 50,
    random: true,
    seed: 11,
    timed: false,
    touches: None,
};

fn config(dirty: DirtyConfig) -> KvmConfig {
    KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 2 << 20,
            slots: 2,
            dirty,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }
}

/// Maps every page (first touch outside the measured part), then turns logging on.
fn populated(m: &KvmMachine) {
    m.run_pass(PassParams::default()).unwrap();
    m.set_dirty_logging(true).unwrap();
}

fn assert_same(got: &[u64], want: &[u64], what: &str) {
    if got != want {
        let g: BTreeSet<u64> = pages_of(got).into_iter().collect();
        let w: BTreeSet<u64> = pages_of(want).into_iter().collect();
        let lost: Vec<_> = w.difference(&g).take(8).collect();
        let extra: Vec<_> = g.difference(&w).take(8).collect();
        panic!(
            "{what}: {} pages logged, {} expected; missing {lost:?}, unexpected {extra:?}",
            g.len(),
            w.len()
        );
    }
}

#[test]
fn get_dirty_log_reports_exactly_the_written_pages_and_clears() {
    let Some(m) = machine_or_skip(config(DirtyConfig::default())) else {
        return;
    };
    populated(&m);
    m.run_pass(HALF_RANDOM).unwrap();
    let want = to_bitmap(&expected_writes(&m.layout(), HALF_RANDOM));
    assert!(!pages_of(&want).is_empty());
    assert_same(&get_region_log(&m), &want, "first GET");
    // GET cleared the log and re-protected the pages.
    assert_same(&get_region_log(&m), &vec![0; want.len()], "second GET");
    // Reads do not dirty pages.
    m.run_pass(PassParams {
        write_percent: 0,
        ..HALF_RANDOM
    })
    .unwrap();
    assert_same(
        &get_region_log(&m),
        &vec![0; want.len()],
        "after a read pass",
    );
    // The re-protected pages are logged again when written again.
    m.run_pass(HALF_RANDOM).unwrap();
    assert_same(&get_region_log(&m), &want, "after writing again");
    // Off: no more log.
    m.set_dirty_logging(false).unwrap();
    let mut buf = vec![0u64; m.pages_per_slot().div_ceil(64) as usize];
    assert!(matches!(
        m.dirty_log().get_log(0, &mut buf),
        Err(KvmError::DirtyLog(_))
    ));
}

#[test]
fn manual_protect_get_copies_and_clear_clears_only_its_range() {
    let Some(m) = machine_or_skip(config(DirtyConfig {
        manual_protect: MANUAL_PROTECT_ENABLE,
        ring_entries: 0,
        ..DirtyConfig::default()
    })) else {
        return;
    };
    populated(&m);
    m.run_pass(HALF_RANDOM).unwrap();
    let want = to_bitmap(&expected_writes(&m.layout(), HALF_RANDOM));
    assert_same(&get_region_log(&m), &want, "first GET");
    // With manual protect GET only copies.
    assert_same(&get_region_log(&m), &want, "second GET");

    // CLEAR the first 128 pages of slot 1 (as reported) and nothing else.
    let pps = m.pages_per_slot();
    assert!(pps > 128);
    let mut slot_log = vec![0u64; pps.div_ceil(64) as usize];
    m.dirty_log().get_log(0, &mut slot_log).unwrap();
    m.dirty_log()
        .clear_log(0, slat_addr::PageIndex::new(0), 128, &slot_log[..2])
        .unwrap();
    let mut after = want.clone();
    after[0] = 0;
    after[1] = 0;
    assert_same(&get_region_log(&m), &after, "after a partial CLEAR");

    // CLEAR everything; a write pass then logs exactly its pages (the cleared pages were
    // write-protected again).
    for id in m.slot_ids() {
        m.dirty_log()
            .get_log((id - slat_workload::FIRST_SLOT) as usize, &mut slot_log)
            .unwrap();
        m.dirty_log()
            .clear_log(
                (id - slat_workload::FIRST_SLOT) as usize,
                slat_addr::PageIndex::new(0),
                pps,
                &slot_log,
            )
            .unwrap();
    }
    assert_same(
        &get_region_log(&m),
        &vec![0; want.len()],
        "after CLEAR of all",
    );
    let seq = PassParams {
        write_percent: 100,
        random: false,
        seed: 1,
        timed: false,
        touches: None,
    };
    m.run_pass(seq).unwrap();
    let all = to_bitmap(&expected_writes(&m.layout(), seq));
    assert_same(&get_region_log(&m), &all, "after a full write pass");

    // CLEAR checks its range like KVM does (with a bitmap of the right length for it).
    for (first, n) in [(1, 64), (0, 65), (0, pps + 64), (pps + 64, 0), (64, pps)] {
        let bits = vec![u64::MAX; n.div_ceil(64) as usize];
        assert!(
            matches!(
                m.dirty_log()
                    .clear_log(0, slat_addr::PageIndex::new(first), n, &bits),
                Err(KvmError::Dirty(Error::ClearRange { .. }))
            ),
            "first {first} n {n}"
        );
    }
}

#[test]
fn initially_set_reports_every_page_until_cleared() {
    let Some(m) = machine_or_skip(config(DirtyConfig {
        manual_protect: MANUAL_PROTECT_ENABLE | INITIALLY_SET,
        ring_entries: 0,
        ..DirtyConfig::default()
    })) else {
        return;
    };
    populated(&m);
    let total = m.layout().total_pages();
    let all = to_bitmap(&vec![true; total as usize]);
    assert_same(&get_region_log(&m), &all, "INITIALLY_SET");
    let pps = m.pages_per_slot();
    let ones = vec![u64::MAX; pps.div_ceil(64) as usize];
    for id in m.slot_ids() {
        m.dirty_log()
            .clear_log(
                (id - slat_workload::FIRST_SLOT) as usize,
                slat_addr::PageIndex::new(0),
                pps,
                &ones,
            )
            .unwrap();
    }
    assert_same(&get_region_log(&m), &vec![0; all.len()], "after CLEAR");
    m.run_pass(HALF_RANDOM).unwrap();
    let want = to_bitmap(&expected_writes(&m.layout(), HALF_RANDOM));
    assert_same(&get_region_log(&m), &want, "after a write pass");
}

/// Collects the rings into a region bitmap (checking slot and offset of every entry).
fn collect_rings(m: &KvmMachine) -> (Vec<u64>, u64) {
    let pps = m.pages_per_slot();
    let total = m.layout().total_pages();
    let mut b = vec![0u64; total.div_ceil(64) as usize];
    let mut bad = Vec::new();
    let n = m
        .dirty_log()
        .collect_ring(&mut |slot, offset| {
            let offset = offset.raw();
            let ok = m.slot_ids().any(|s| s == slot) && offset < pps;
            if !ok {
                bad.push((slot, offset));
                return;
            }
            let p = (slot - FIRST_SLOT) as u64 * pps + offset;
            b[(p / 64) as usize] |= 1 << (p % 64);
        })
        .unwrap();
    assert!(bad.is_empty(), "entries outside the test slots: {bad:?}");
    (b, n)
}

#[test]
fn dirty_ring_harvest_and_reset() {
    let Some(m) = machine_or_skip(config(DirtyConfig {
        manual_protect: 0,
        ring_entries: 4096,
        ..DirtyConfig::default()
    })) else {
        return;
    };
    populated(&m);
    m.run_pass(HALF_RANDOM).unwrap();
    let want = to_bitmap(&expected_writes(&m.layout(), HALF_RANDOM));
    let (got, n) = collect_rings(&m);
    assert_same(&got, &want, "ring harvest");
    // At least one entry per written page. The ring is a log of write faults, not a set:
    // KVM may push a page more than once (on this project's shadow-paging host every write
    // of a random pass pushed one, repeats included), so only the lower bound is KVM's
    // contract.
    assert!(n >= pages_of(&want).len() as u64, "{n} entries");
    // The reset consumes every collected entry.
    assert_eq!(m.dirty_log().reset_rings().unwrap(), n);
    // Nothing new until the guest writes again.
    assert_eq!(collect_rings(&m).1, 0);
    assert_eq!(m.dirty_log().reset_rings().unwrap(), 0);
    m.run_pass(HALF_RANDOM).unwrap();
    let (again, _) = collect_rings(&m);
    assert_same(&again, &want, "after reset and a second pass");
    m.dirty_log().reset_rings().unwrap();
    // Bitmap operations are refused with rings.
    let mut buf = vec![0u64; m.pages_per_slot().div_ceil(64) as usize];
    assert!(matches!(
        m.dirty_log().get_log(0, &mut buf),
        Err(KvmError::DirtyLog(_))
    ));
}

#[test]
fn full_ring_exits_are_handled_and_nothing_is_lost() {
    // 256 entries: KVM reserves 64, so a vCPU writing 512 pages must exit on a full ring.
    let Some(m) = machine_or_skip(config(DirtyConfig {
        manual_protect: 0,
        ring_entries: 256,
        ..DirtyConfig::default()
    })) else {
        return;
    };
    populated(&m);
    let seq = PassParams::default();
    let r = m.run_pass(seq).unwrap();
    let exits: u64 = r.vcpus.iter().map(|v| v.ring_full_exits).sum();
    assert!(exits >= 2, "{r:?}");
    let (got, _) = collect_rings(&m);
    let want = to_bitmap(&expected_writes(&m.layout(), seq));
    assert_same(&got, &want, "ring-full harvests plus the final one");
    m.dirty_log().reset_rings().unwrap();
}

#[test]
fn logging_toggles_while_vcpus_keep_running() {
    // dirty_log_perf_test -e: the vCPUs keep writing while logging is switched on and off.
    let Some(m) = machine_or_skip(config(DirtyConfig::default())) else {
        return;
    };
    populated(&m);
    m.start(slat_kvm::Workload::Loop(PassParams::default()))
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let log = get_region_log(&m);
    m.set_dirty_logging(false).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    m.set_dirty_logging(true).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let r = m.halt().unwrap();
    let log2 = get_region_log(&m);
    assert!(r.vcpus.iter().all(|v| v.passes >= 1), "{r:?}");
    // Sequential writers that completed passes dirtied every page, before and after the
    // toggle.
    let total = m.layout().total_pages() as usize;
    assert_eq!(pages_of(&log).len(), total);
    assert_eq!(pages_of(&log2).len(), total);
}
