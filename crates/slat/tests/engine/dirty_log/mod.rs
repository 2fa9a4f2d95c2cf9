//! Dirty-log protocols end to end: manual protection (GET copies, CLEAR re-protects exactly what
//! it cleared, INITIALLY_SET), capability errors, the per-vCPU dirty ring (push, harvest, reset,
//! full), slots deleted or moved while logging, and huge-page recovery when logging stops.
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::dirty::DirtyLogError;
use slat::dirty::{INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use slat::{
    Access, FaultOutcome, Level, MemslotFlags, PteFormat, Vcpu, Vm, VmConfig, WrprotVariant,
};
use slat_addr::{Gfn, Gpa, PageIndex, PAGE_SHIFT, PAGE_SIZE};
use std::sync::Arc;

mod manual_protect;
mod ring;
mod slots;
mod sparse;
use manual_protect::*;
use ring::*;
use slots::*;
use sparse::*;

const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;
const MIB: u64 = 1 << 20;

both_formats! {
    clear_errors_consume_nothing,
    clear_reprotects_exactly_the_bits_cleared,
    initially_set_protects_nothing_until_clear,
    capability_errors,
    ring_push_harvest_reset,
    ring_full_refuses_the_write_until_reset,
    slots_deleted_or_moved_while_logging,
    huge_pages_recovered_in_place_or_zapped,
    #[ept_only] get_reads_only_dirty_words,
    #[ept_only] get_full_reads_every_word_and_returns_exactly_the_marks,
    #[ept_only] manual_get_and_clear_read_only_dirty_words,
    #[ept_only] sparse_get_and_clear_read_only_dirty_words,
}

thread_local! {
    static WRPROT: std::cell::Cell<WrprotVariant> = const { std::cell::Cell::new(WrprotVariant::Walk) };
}

/// Runs a test once per write-protect variant (`WrprotVariant`): every protocol here must hold
/// whether harvests walk, look pages up in the rmap, or do so without the MMU lock.
fn each_wrprot(test: fn()) {
    for &w in WrprotVariant::ALL {
        WRPROT.with(|c| c.set(w));
        test();
    }
    WRPROT.with(|c| c.set(WrprotVariant::Walk));
}

/// The default configuration with the write-protect variant under test.
fn config() -> VmConfig {
    VmConfig {
        wrprot: WRPROT.with(|c| c.get()),
        ..VmConfig::default()
    }
}

/// A first write to an unmapped page: the slow path maps it writable.
fn write_new<F: PteFormat>(vm: &Vm<F>, vcpu: &mut Vcpu<F>, gpa: u64) {
    let o = fault(vm, vcpu, gpa, Access::Write, false);
    assert_eq!(o, FaultOutcome::Fixed, "first write to gpa {gpa:#x}");
}

/// A write to a mapped, write-protected page: the fast path makes it writable and logs it.
fn write_protected<F: PteFormat>(vm: &Vm<F>, vcpu: &mut Vcpu<F>, gpa: u64) {
    let o = fault(vm, vcpu, gpa, Access::Write, true);
    assert_eq!(
        o,
        FaultOutcome::FixedFast,
        "write to write-protected gpa {gpa:#x}"
    );
}

/// The leaf mapping `gpa`, panicking if there is none.
fn leaf<F: PteFormat>(vm: &Vm<F>, gpa: u64) -> (u64, Level) {
    vm.lookup(Gpa::new(gpa).gfn())
        .unwrap_or_else(|| panic!("gpa {gpa:#x} is not mapped"))
}

fn writable<F: PteFormat>(vm: &Vm<F>, gpa: u64) -> bool {
    vm.lookup(Gpa::new(gpa).gfn())
        .is_some_and(|(l, _)| F::is_writable(l))
}

/// The slot-relative dirty pages GET reports (in manual mode this only copies).
fn dirty_pages<F: PteFormat>(vm: &Vm<F>, id: u32) -> Vec<u64> {
    let npages = vm.memslots().by_id(id).expect("slot").npages;
    let mut words = vec![0u64; bitmap_words(npages)];
    let n = vm.get_dirty_log(id, &mut words).expect("get_dirty_log");
    let pages = bitmap_gfns(0, &words);
    assert_eq!(
        n,
        pages.len() as u64,
        "GET's count disagrees with its bitmap"
    );
    pages
}

/// Everything the ring of `vcpu` has that was not yet harvested.
fn harvest<F: PteFormat>(vcpu: &Vcpu<F>) -> Vec<(u32, u64)> {
    let ring = vcpu.dirty_ring().expect("the VM uses dirty rings");
    let mut got = Vec::new();
    let n = ring.harvest(|s, o| got.push((s, o.raw())));
    assert_eq!(
        n as usize,
        got.len(),
        "harvest count disagrees with entries"
    );
    got
}
