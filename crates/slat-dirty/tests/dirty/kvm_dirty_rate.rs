//! [`DirtyRate`] over a VMM's own KVM VM ([`slat_dirty::KvmLog`]): the tiny VM's writer
//! dirties exactly the pages the test lists, so every window's count is known. Skipped (with
//! the reason) without /dev/kvm.

use crate::common;

use common::long_mode::LowLayout;
use common::{pass_with, Mapping, Setup, TinyVm, SLOT_PAGES};
use kvm_ioctls::{VcpuFd, VmFd};
use slat_dirty::dirty_rate::{Attribution, DirtyRate};
use slat_dirty::KvmLog;
use std::sync::Arc;

/// The tiny VM with its log handed to a sampler. Field order is drop order: the sampler (slot
/// handles, ring mapping) and the vCPU before the VM fd, all of them before the memory.
struct Parts {
    rate: DirtyRate<KvmLog>,
    vcpu: VcpuFd,
    _vm: Arc<VmFd>,
    layout: LowLayout,
    low: Mapping,
    _slots: Vec<Mapping>,
}

fn sampler(setup: Setup) -> Option<Parts> {
    let TinyVm {
        harvester,
        vcpu,
        vm,
        layout,
        low,
        slots,
    } = TinyVm::new(setup)?;
    let rate = DirtyRate::new(harvester.into_source()).unwrap();
    let total = SLOT_PAGES[0] + SLOT_PAGES[1];
    let rate = match setup {
        // One vCPU: its ring names it.
        Setup::Ring { .. } => rate.with_vcpus(1),
        // "vCPU 0" owns slot 0, "vCPU 1" slot 1 (pages numbered across the slots).
        _ => rate
            .with_regions(vec![0..SLOT_PAGES[0], SLOT_PAGES[0]..total])
            .unwrap(),
    };
    Some(Parts {
        rate,
        vcpu,
        _vm: vm,
        layout,
        low,
        _slots: slots,
    })
}

fn pages() -> Vec<(usize, u64)> {
    // 300 pages of slot 0 (past its first word) and all 70 of slot 1.
    (0..300u64)
        .map(|p| (0, p))
        .chain((0..SLOT_PAGES[1]).map(|p| (1, p)))
        .collect()
}

fn check(setup: Setup) {
    let Some(mut vm) = sampler(setup) else {
        return;
    };
    let list = pages();
    let control = vm.layout.control;
    // Dirt from before the first window is discarded.
    pass_with(&mut vm.vcpu, &mut vm.low, control, &list, || {
        panic!("a 4096-entry ring holds a 370-page pass")
    });
    vm.rate.start().unwrap();
    // Three passes over the same pages: each page counts once in the window.
    for _ in 0..3 {
        pass_with(&mut vm.vcpu, &mut vm.low, control, &list, || {
            panic!("no ring-full exit expected")
        });
    }
    let s = vm.rate.sample().unwrap().expect("a window was open");
    assert_eq!(s.pages, list.len() as u64, "{setup:?}: {s:?}");
    assert_eq!((s.unattributed, s.foreign), (0, 0), "{setup:?}: {s:?}");
    match setup {
        Setup::Ring { .. } => {
            assert_eq!(vm.rate.attribution(), Attribution::Ring);
            assert_eq!(s.per_vcpu, vec![list.len() as u64]);
        }
        _ => {
            assert_eq!(vm.rate.attribution(), Attribution::Regions);
            assert_eq!(s.per_vcpu, vec![300, SLOT_PAGES[1]]);
        }
    }
    // The harvest re-armed the log: a quiet window counts nothing, one page counts one.
    let s = vm.rate.sample().unwrap().unwrap();
    assert_eq!(s.pages, 0, "{setup:?}");
    pass_with(&mut vm.vcpu, &mut vm.low, control, &[(1, 69)], || {});
    let s = vm.rate.sample().unwrap().unwrap();
    assert_eq!(s.pages, 1, "{setup:?}");
}

#[test]
fn get_counts_each_dirty_page_once_per_window() {
    check(Setup::Get);
}

#[test]
fn manual_protect_counts_each_dirty_page_once_per_window() {
    check(Setup::Manual {
        chunk_pages: 64,
        initially_set: true,
    });
}

#[test]
fn ring_counts_each_dirty_page_once_per_window_for_its_vcpu() {
    check(Setup::Ring { entries: 4096 });
}
