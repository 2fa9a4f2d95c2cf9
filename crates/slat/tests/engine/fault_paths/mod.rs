//! Fault handling, leaf sizes, dirty logging and flush bookkeeping, one behaviour per test.
//!
//! Several tests give memslots *reserved* host memory (allocated, never written): the engine
//! only stores host addresses in leaves and never dereferences guest memory (`Vm::slow_page_fault`
//! computes `slot.hva(gfn)` and encodes it with `make_leaf`; splits only add offsets), so a
//! 1 GiB-paged or multi-GiB slot costs little but its page tables. (On stage-2 the fault path's
//! cache maintenance reads the lines it maps, which is why the memory must be mapped at all.)

#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::hw::pages_per_entry;
use slat::hw::REQ_TLB_FLUSH;
use slat::{
    Access, FaultOutcome, Level, MemslotError, MemslotFlags, MmuLockKind, PteFormat, Vcpu, Vm,
    VmConfig,
};
use slat_addr::{Gfn, Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod logging;
mod mapping;
mod zap_flush;
use logging::*;
use mapping::*;
use zap_flush::*;

const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;
const RO: MemslotFlags = MemslotFlags::READONLY;

both_formats! {
    second_vcpu_faulting_the_same_page_is_spurious,
    faults_outside_every_slot_are_no_slot_and_map_nothing,
    readonly_slot_maps_reads_without_write_permission_and_refuses_writes,
    two_mib_leaves_need_2m_host_pages_and_congruent_addresses,
    slot_edges_limit_huge_leaves,
    one_gib_leaves_for_1g_host_pages,
    enabling_dirty_logging_splits_write_protects_and_the_fast_path_logs,
    without_the_fast_path_the_slow_path_fixes_and_logs,
    get_dirty_log_reprotects_exactly_the_returned_pages,
    read_fault_in_logged_slot_leaves_the_first_write_to_the_fast_path,
    read_then_write_in_logged_slot_is_logged,
    lazy_split_write_protects_huge_leaves_and_splits_on_the_first_write,
    disabling_dirty_logging_brings_huge_leaves_back,
    enabling_logging_splits_1g_leaves_down_to_4k,
    one_gib_mapped_at_4k_needs_at_most_2_1_mib_of_tables,
    zap_flushes_remote_tlbs_frees_tables_and_an_empty_zap_flushes_nothing,
    zap_of_a_straddling_huge_leaf_removes_the_whole_leaf,
    lookup_beyond_the_guest_physical_width_finds_nothing,
    zap_beyond_the_guest_physical_width_touches_nothing,
    remote_flush_waits_for_an_in_guest_vcpu_to_acknowledge,
    table_pages_live_covers_linked_tables_and_vcpu_caches,
    mutex_variant_faults_zaps_and_logs,
    faults_racing_with_enable_logging_never_leave_huge_leaves,
}

/// The leaf for `gpa`, checked to translate to `hva`; returns (entry, level).
fn expect_mapped<F: PteFormat>(vm: &Vm<F>, gpa: u64, hva: u64) -> (u64, Level) {
    let gfn = gpa >> PAGE_SHIFT;
    let (leaf, level) = vm
        .lookup(Gfn::new(gfn))
        .unwrap_or_else(|| panic!("gpa {gpa:#x} is not mapped"));
    assert_eq!(
        leaf_hva::<F>(leaf, level, gfn),
        hva & !(PAGE_SIZE - 1),
        "gpa {gpa:#x} translates to the wrong host page (leaf {leaf:#x}, level {level})"
    );
    check_write_chain::<F>(leaf, &format!("gpa {gpa:#x}"));
    (leaf, level)
}

fn dirty_gfns<F: PteFormat>(vm: &Vm<F>, id: u32) -> Vec<u64> {
    let slot = vm.memslots().by_id(id).expect("slot").clone();
    let mut words = vec![0u64; bitmap_words(slot.npages)];
    let n = vm.get_dirty_log(id, &mut words).expect("get_dirty_log");
    let gfns = bitmap_gfns(slot.base_gfn.raw(), &words);
    assert_eq!(
        n,
        gfns.len() as u64,
        "returned count disagrees with the bitmap"
    );
    gfns
}
