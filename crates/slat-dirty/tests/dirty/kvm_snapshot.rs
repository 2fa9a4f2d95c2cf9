//! Snapshot and reset of a VMM's own KVM guest (the tiny VM of `common`), in the three log
//! modes: the reset harvests with `Harvester::take` (which re-arms the log) before copying the
//! `DirtySet`'s pages back, commits, and after every round guest memory equals the snapshot
//! byte for byte; pages the guest wrote after a reset are caught by the next one.

use crate::common;

use common::{Setup, TinyVm, SLOT_PAGES};
use slat_dirty::{GuestRegion, Snapshot};

/// A few pages of both slots, different each round.
fn pages(round: u64) -> Vec<(usize, u64)> {
    let mut v: Vec<(usize, u64)> = (0..7)
        .map(|j| {
            let s = ((round + j) % 2) as usize;
            (s, (round * 37 + j * 101) % SLOT_PAGES[s])
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

fn reset_rounds(setup: Setup) {
    let Some(mut vm) = TinyVm::new(setup) else {
        return;
    };
    // The state to return to: a first pass, harvested and committed, then the snapshot.
    vm.pass(&pages(99));
    vm.harvester.take().unwrap().commit();
    let regions = vm
        .slots
        .iter()
        .map(|m| {
            // SAFETY: the slot's mapping lives as long as `vm`, which outlives `snap` (declared
            // after it); the vCPU runs only inside `vm.pass`, never during a snapshot call.
            unsafe { GuestRegion::new(m.ptr, m.len as u64) }.unwrap()
        })
        .collect();
    let snap = Snapshot::take(regions).unwrap();
    let original: Vec<Vec<u8>> = vm.slots.iter().map(|m| m.bytes().to_vec()).collect();
    let mut dirty = snap.dirty_pages();
    for round in 0..20 {
        let written = pages(round);
        vm.pass(&written);
        assert!(
            snap.verify().is_err(),
            "{setup:?} round {round}: nothing written"
        );
        // Re-arm (take), then copy, then commit.
        let set = vm.harvester.take().unwrap();
        dirty.add_dirty_set(&set).unwrap();
        assert_eq!(dirty.len(), written.len() as u64, "{setup:?} round {round}");
        snap.reset(&mut dirty).unwrap();
        set.commit();
        snap.verify()
            .unwrap_or_else(|e| panic!("{setup:?} round {round}: {e}"));
        for (m, o) in vm.slots.iter().zip(&original) {
            assert!(m.bytes() == o.as_slice(), "{setup:?} round {round}");
        }
    }
}

#[test]
fn get_resets_are_exact() {
    reset_rounds(Setup::Get)
}

#[test]
fn manual_protect_resets_are_exact() {
    reset_rounds(Setup::Manual {
        chunk_pages: 64,
        initially_set: true,
    })
}

#[test]
fn ring_resets_are_exact() {
    reset_rounds(Setup::Ring { entries: 4096 })
}
