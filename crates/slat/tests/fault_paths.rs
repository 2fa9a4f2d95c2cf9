//! Fault handling, leaf sizes, dirty logging and flush bookkeeping, one behaviour per test.
//!
//! Several tests give memslots *reserved* host memory (allocated, never written): the engine
//! only stores host addresses in leaves and never dereferences guest memory (`Vm::slow_page_fault`
//! computes `slot.hva(gfn)` and encodes it with `make_leaf`; splits only add offsets), so a
//! 1 GiB-paged or multi-GiB slot costs little but its page tables. (On stage-2 the fault path's
//! cache maintenance reads the lines it maps, which is why the memory must be mapped at all.)

#![cfg(not(loom))]

#[macro_use]
mod common;

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

fn second_vcpu_faulting_the_same_page_is_spurious<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mem = HostMem::new(16 * PAGE_SIZE);
    let gpa = 0x10_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        mem.len(),
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut a = vm.create_vcpu(0);
    let mut b = vm.create_vcpu(1);
    let target = gpa + 5 * PAGE_SIZE + 0x123;

    assert_eq!(
        fault(&vm, &mut a, target, Access::Write, false),
        FaultOutcome::Fixed
    );
    let (leaf, level) = expect_mapped(&vm, target, mem.addr() + 5 * PAGE_SIZE);
    assert_eq!(level, 1);
    assert!(F::is_writable(leaf));
    // The second vCPU had a stale (empty) TLB: its identical fault finds the work done.
    assert_eq!(
        fault(&vm, &mut b, target, Access::Write, false),
        FaultOutcome::Spurious
    );
    assert_eq!(
        fault(&vm, &mut b, target, Access::Read, false),
        FaultOutcome::Spurious
    );
    assert_eq!(vm.lookup(Gpa::new(target).gfn()), Some((leaf, level)));
    let s = vm.stats();
    assert_eq!((s.pf_fixed, s.pf_spurious), (1, 2), "{s:?}");
    assert_eq!(s.leaves_4k, 1);
    check_audit(&vm, "after the spurious faults");
    teardown(vm, [a, b]);
}

fn faults_outside_every_slot_are_no_slot_and_map_nothing<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let m1 = HostMem::new(1 << 20);
    let m2 = HostMem::new(1 << 20);
    vm.add_memslot(
        1,
        Gpa::new(1 << 20),
        1 << 20,
        m1.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    vm.add_memslot(
        2,
        Gpa::new(3 << 20),
        1 << 20,
        m2.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut v = vm.create_vcpu(0);
    let outside = [
        0,
        (1 << 20) - 1,
        2 << 20, // one past slot 1
        (5 << 19) + 0x42,
        4 << 20, // one past slot 2
        (1 << 48) - PAGE_SIZE,
        1 << 48, // beyond the guest physical width
        !(PAGE_SIZE - 1),
    ];
    for (i, &gpa) in outside.iter().enumerate() {
        for access in [Access::Read, Access::Write, Access::Exec] {
            assert_eq!(
                fault(&vm, &mut v, gpa, access, false),
                FaultOutcome::NoSlot,
                "gpa {gpa:#x} {access:?}"
            );
        }
        assert_eq!(vm.stats().pf_no_slot, 3 * (i as u64 + 1));
        if gpa < 1 << 48 {
            assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), None, "gpa {gpa:#x}");
        }
    }
    let a = check_audit(&vm, "after MMIO exits");
    assert_eq!(a.leaves, [0, 0, 0]);
    assert_eq!(a.tables, 1, "an MMIO exit must not build tables");
    // The pages around the gaps still fault in normally.
    for gpa in [1 << 20, (2 << 20) - PAGE_SIZE, 3 << 20, (4 << 20) - 1] {
        assert_eq!(
            fault(&vm, &mut v, gpa, Access::Read, false),
            FaultOutcome::Fixed
        );
    }
    assert_eq!(vm.stats().leaves_4k, 4);
    teardown(vm, [v]);
}

fn readonly_slot_maps_reads_without_write_permission_and_refuses_writes<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mem = HostMem::new(4 << 20);
    let base = 0x4000_0000;
    vm.add_memslot(7, Gpa::new(base), 4 << 20, mem.range(HUGE_2M), RO)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    let gpa = base + 0x3000;

    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, false),
        FaultOutcome::ReadOnly
    );
    assert_eq!(
        vm.lookup(Gpa::new(gpa).gfn()),
        None,
        "a refused write mapped"
    );
    assert_eq!(vm.stats().pf_read_only, 1);

    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Read, false),
        FaultOutcome::Fixed
    );
    let (leaf, level) = expect_mapped(&vm, gpa, mem.addr() + 0x3000);
    assert_eq!(level, 2, "read-only memory backed by 2 MiB pages maps huge");
    assert!(F::permits(leaf, Access::Read));
    assert!(!F::is_writable(leaf) && !F::permits(leaf, Access::Write));
    assert!(
        !F::is_mmu_writable(leaf),
        "fast path could make it writable"
    );
    assert!(!F::is_host_writable(leaf));

    // The permission fault the hardware raises next: still an exit, entry untouched, and the
    // fast path does not get to set W either.
    assert!(vm.config().fast_pf);
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, true),
        FaultOutcome::ReadOnly
    );
    assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), Some((leaf, level)));
    assert_eq!(vm.stats().pf_read_only, 2);
    assert_eq!(vm.stats().pf_fast, 0);

    // READONLY cannot be lifted on an existing slot (KVM refuses it too): the request is
    // refused and changes nothing; the write still exits.
    let before = vm.stats();
    assert_eq!(
        vm.set_memslot_flags(7, MemslotFlags::empty()),
        Err(MemslotError::ReadonlyChange { id: 7 })
    );
    assert_eq!(vm.memslots().by_id(7).expect("slot 7").flags, RO);
    assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), Some((leaf, level)));
    assert_eq!(
        vm.stats().remote_tlb_flush_requests,
        before.remote_tlb_flush_requests,
        "a refused flag change flushed"
    );
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, true),
        FaultOutcome::ReadOnly
    );

    // Deleting the slot and re-adding it without READONLY lets the write through, with the
    // full W ⇒ MMU-W ⇒ host-W chain.
    vm.delete_memslot(7).unwrap();
    assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), None);
    vm.add_memslot(
        7,
        Gpa::new(base),
        4 << 20,
        mem.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, false),
        FaultOutcome::Fixed
    );
    let (leaf, level) = expect_mapped(&vm, gpa, mem.addr() + 0x3000);
    assert!(F::is_writable(leaf) && F::is_host_writable(leaf));

    // Nor can READONLY be set on it: refused, and the writable mapping stays.
    assert_eq!(
        vm.set_memslot_flags(7, RO),
        Err(MemslotError::ReadonlyChange { id: 7 })
    );
    assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), Some((leaf, level)));

    // Making the range read-only again takes a delete, which zaps (with a flush) so no
    // writable translation survives, and a re-add with READONLY.
    let before = vm.stats();
    vm.delete_memslot(7).unwrap();
    vm.add_memslot(7, Gpa::new(base), 4 << 20, mem.range(HUGE_2M), RO)
        .unwrap();
    assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), None);
    assert!(vm.stats().remote_tlb_flush > before.remote_tlb_flush);
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, false),
        FaultOutcome::ReadOnly
    );
    check_audit(&vm, "read-only slot");
    teardown(vm, [v]);
}

fn two_mib_leaves_need_2m_host_pages_and_congruent_addresses<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let m_huge = HostMem::new(4 << 20);
    let m_small = HostMem::new(4 << 20);
    let m_skew = HostMem::new(6 << 20);

    // A: 2 MiB host pages, guest and host 2 MiB aligned.
    let a = 0x1_0000_0000;
    vm.add_memslot(
        1,
        Gpa::new(a),
        4 << 20,
        m_huge.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    // B: the same but the host maps with 4 KiB pages.
    let b = 0x2_0000_0000;
    vm.add_memslot(
        2,
        Gpa::new(b),
        4 << 20,
        m_small.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    // C: 2 MiB host pages, but the host address is 4 KiB past a 2 MiB boundary while the guest
    // address is aligned: no 2 MiB guest frame lines up with a 2 MiB host page.
    let c = 0x3_0000_0000;
    vm.add_memslot(
        3,
        Gpa::new(c),
        4 << 20,
        m_skew.sub_range(PAGE_SIZE, 4 << 20, HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();

    for (i, off) in [0x1234u64, (2 << 20) + 5 * PAGE_SIZE]
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            fault(&vm, &mut v, a + off, Access::Write, false),
            FaultOutcome::Fixed
        );
        let (_, level) = expect_mapped(&vm, a + off, m_huge.addr() + off);
        assert_eq!(level, 2, "slot A offset {off:#x}");
        assert_eq!(vm.stats().leaves_2m, i as u64 + 1);
        // Every page of the huge leaf now translates.
        for probe in [0, 511] {
            let g = (a + off) & !(HUGE_2M - 1);
            let p = g + probe * PAGE_SIZE;
            expect_mapped(&vm, p, m_huge.addr() + (p - a));
        }
    }
    for (slot_gpa, host, what) in [
        (b, m_small.addr(), "4 KiB host pages"),
        (c, m_skew.addr() + PAGE_SIZE, "incongruent addresses"),
    ] {
        for off in [0u64, (2 << 20) + 0x7000] {
            assert_eq!(
                fault(&vm, &mut v, slot_gpa + off, Access::Read, false),
                FaultOutcome::Fixed
            );
            let (_, level) = expect_mapped(&vm, slot_gpa + off, host + off);
            assert_eq!(level, 1, "{what}, offset {off:#x}");
            // Only that page: its neighbour is not mapped.
            assert_eq!(
                vm.lookup(Gfn::new(((slot_gpa + off) >> PAGE_SHIFT) + 1)),
                None
            );
        }
    }
    let s = vm.stats();
    assert_eq!((s.leaves_4k, s.leaves_2m, s.leaves_1g), (4, 2, 0));
    check_audit(&vm, "mixed leaf sizes");
    teardown(vm, [v]);
}

fn slot_edges_limit_huge_leaves<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(8 << 20);
    // Starts 4 KiB into a 2 MiB frame (host too, so they stay congruent) and ends 4 KiB short of
    // the third: only the middle 2 MiB frame lies wholly inside the slot.
    let gpa = (64 << 20) + PAGE_SIZE;
    let size = (6 << 20) - 2 * PAGE_SIZE;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        size,
        mem.sub_range(PAGE_SIZE, size, HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    let host = mem.addr() + PAGE_SIZE;
    let cases = [
        (gpa, 1),                             // first page: partial first frame
        (gpa + (2 << 20) - 2 * PAGE_SIZE, 1), // last page of the first frame
        (66 << 20, 2),                        // the whole middle frame
        ((68 << 20) - PAGE_SIZE, 2),          // its last page: already mapped by the same leaf
        (68 << 20, 1),                        // partial last frame
        (gpa + size - PAGE_SIZE, 1),          // last page of the slot
    ];
    for (g, want) in cases {
        let o = fault(&vm, &mut v, g, Access::Write, false);
        assert!(
            matches!(o, FaultOutcome::Fixed | FaultOutcome::Spurious),
            "{g:#x}: {o:?}"
        );
        let (_, level) = expect_mapped(&vm, g, host + (g - gpa));
        assert_eq!(level, want, "gpa {g:#x}");
    }
    // Just outside either edge: nothing.
    assert_eq!(
        fault(&vm, &mut v, gpa - 1, Access::Read, false),
        FaultOutcome::NoSlot
    );
    assert_eq!(
        fault(&vm, &mut v, gpa + size, Access::Read, false),
        FaultOutcome::NoSlot
    );
    let s = vm.stats();
    assert_eq!((s.leaves_4k, s.leaves_2m), (4, 1));
    check_audit(&vm, "slot edges");
    teardown(vm, [v]);
}

fn one_gib_leaves_for_1g_host_pages<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    // Reserved host memory: 1 GiB aligned, never written.
    let mem = HostMem::reserve(2 << 30, HUGE_1G);
    let host = mem.addr();
    let gpa = 1 << 30;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        2 << 30,
        mem.range(HUGE_1G),
        MemslotFlags::empty(),
    )
    .unwrap();
    // 1 GiB host pages but the guest address only 2 MiB-congruent: 2 MiB leaves at most.
    let mem2 = HostMem::reserve(HUGE_1G + HUGE_2M, HUGE_1G);
    let host2 = mem2.addr() + HUGE_2M;
    let gpa2 = 8 << 30;
    vm.add_memslot(
        2,
        Gpa::new(gpa2),
        1 << 30,
        mem2.sub_range(HUGE_2M, 1 << 30, HUGE_1G),
        MemslotFlags::empty(),
    )
    .unwrap();

    for (i, off) in [0x1234_5678u64, (1 << 30) + 0x20_0000]
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            fault(&vm, &mut v, gpa + off, Access::Write, false),
            FaultOutcome::Fixed
        );
        let (leaf, level) = expect_mapped(&vm, gpa + off, host + off);
        assert_eq!(level, 3, "offset {off:#x}");
        assert_eq!(
            F::output_addr(leaf),
            Hva::new(host + (off & !(HUGE_1G - 1)))
        );
        assert_eq!(vm.stats().leaves_1g, i as u64 + 1);
    }
    // The far corners of the first GiB translate through the one leaf.
    expect_mapped(&vm, gpa, host);
    expect_mapped(&vm, gpa + HUGE_1G - PAGE_SIZE, host + HUGE_1G - PAGE_SIZE);

    assert_eq!(
        fault(&vm, &mut v, gpa2 + 0x30_1000, Access::Read, false),
        FaultOutcome::Fixed
    );
    let (_, level) = expect_mapped(&vm, gpa2 + 0x30_1000, host2 + 0x30_1000);
    assert_eq!(level, 2);
    let s = vm.stats();
    assert_eq!((s.leaves_4k, s.leaves_2m, s.leaves_1g), (0, 1, 2));
    // root, one level-3 table for the 1 GiB leaves (same 512 GiB), one level-2 table for slot 2.
    assert_eq!(s.table_pages, 3);
    check_audit(&vm, "1 GiB leaves");
    teardown(vm, [v]);
}

/// Enables logging on a slot holding two writable 2 MiB leaves and checks the eager split.
fn logged_two_huge_leaves<F: PteFormat>(config: VmConfig) -> (Arc<Vm<F>>, Vcpu<F>, HostMem, u64) {
    let vm = Vm::<F>::new(config);
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(4 << 20);
    let gpa = 0x1000_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        4 << 20,
        mem.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    for off in [0, 2 << 20] {
        assert_eq!(
            fault(&vm, &mut v, gpa + off, Access::Write, false),
            FaultOutcome::Fixed
        );
    }
    assert_eq!(vm.stats().leaves_2m, 2);
    let before = vm.stats();

    vm.set_memslot_flags(1, LOG).unwrap();

    let s = vm.stats();
    assert_eq!((s.leaves_4k, s.leaves_2m), (1024, 0), "{s:?}");
    assert_eq!(s.splits - before.splits, 2);
    // Format difference: under break-before-make each block is invalidated (and flushed)
    // before its table goes in; elsewhere one compare-and-swap replaces it.
    let breaks = if F::BREAK_BEFORE_MAKE { 2 } else { 0 };
    assert_eq!(s.bbm_breaks - before.bbm_breaks, breaks, "{s:?}");
    for i in 0..1024u64 {
        let g = gpa + i * PAGE_SIZE;
        let (leaf, level) = expect_mapped(&vm, g, mem.addr() + i * PAGE_SIZE);
        assert_eq!(level, 1, "gpa {g:#x}");
        assert!(!F::is_writable(leaf), "gpa {g:#x} still writable");
        assert!(F::is_mmu_writable(leaf), "gpa {g:#x} lost MMU-writable");
        assert!(F::permits(leaf, Access::Read));
    }
    check_audit(&vm, "after the eager split");
    assert!(
        dirty_gfns(&vm, 1).is_empty(),
        "enabling logging dirtied pages"
    );
    (vm, v, mem, gpa)
}

fn enabling_dirty_logging_splits_write_protects_and_the_fast_path_logs<F: PteFormat>() {
    let (vm, mut v, mem, gpa) = logged_two_huge_leaves::<F>(VmConfig::default());
    let before = vm.stats();
    let target = gpa + (2 << 20) + 7 * PAGE_SIZE;
    assert_eq!(
        fault(&vm, &mut v, target, Access::Write, true),
        FaultOutcome::FixedFast
    );
    let after = vm.stats();
    assert_eq!(after.pf_fast, before.pf_fast + 1);
    assert_eq!(after.pf_fixed, before.pf_fixed, "the slow path ran");
    let (leaf, level) = expect_mapped(&vm, target, mem.addr() + (2 << 20) + 7 * PAGE_SIZE);
    assert_eq!(level, 1);
    assert!(F::is_writable(leaf));
    // Its neighbour stays protected.
    let (n, _) = expect_mapped(
        &vm,
        target + PAGE_SIZE,
        mem.addr() + (2 << 20) + 8 * PAGE_SIZE,
    );
    assert!(!F::is_writable(n));

    assert_eq!(dirty_gfns(&vm, 1), vec![target >> PAGE_SHIFT]);
    let (leaf, _) = expect_mapped(&vm, target, mem.addr() + (2 << 20) + 7 * PAGE_SIZE);
    assert!(!F::is_writable(leaf), "harvest did not re-protect");
    assert!(F::is_mmu_writable(leaf));
    assert!(dirty_gfns(&vm, 1).is_empty());
    // The next write is caught again.
    assert_eq!(
        fault(&vm, &mut v, target, Access::Write, true),
        FaultOutcome::FixedFast
    );
    assert_eq!(dirty_gfns(&vm, 1), vec![target >> PAGE_SHIFT]);
    check_audit(&vm, "fast path");
    teardown(vm, [v]);
}

fn without_the_fast_path_the_slow_path_fixes_and_logs<F: PteFormat>() {
    let config = VmConfig {
        fast_pf: false,
        ..VmConfig::default()
    };
    let (vm, mut v, mem, gpa) = logged_two_huge_leaves::<F>(config);
    let before = vm.stats();
    let target = gpa + 3 * PAGE_SIZE;
    assert_eq!(
        fault(&vm, &mut v, target, Access::Write, true),
        FaultOutcome::Fixed
    );
    let after = vm.stats();
    assert_eq!(after.pf_fast, 0);
    assert_eq!(after.pf_fixed, before.pf_fixed + 1);
    let (leaf, level) = expect_mapped(&vm, target, mem.addr() + 3 * PAGE_SIZE);
    assert_eq!(level, 1, "the slow path mapped huge in a logged slot");
    assert!(F::is_writable(leaf));
    assert_eq!(dirty_gfns(&vm, 1), vec![target >> PAGE_SHIFT]);
    assert!(dirty_gfns(&vm, 1).is_empty());
    check_audit(&vm, "slow path");
    teardown(vm, [v]);
}

fn get_dirty_log_reprotects_exactly_the_returned_pages<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(256 * PAGE_SIZE);
    let other = HostMem::new(16 * PAGE_SIZE);
    let gpa = 0x20_0000;
    let ogpa = 0x80_0000;
    vm.add_memslot(1, Gpa::new(gpa), 256 * PAGE_SIZE, mem.range(PAGE_SIZE), LOG)
        .unwrap();
    vm.add_memslot(
        2,
        Gpa::new(ogpa),
        16 * PAGE_SIZE,
        other.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let written = [1u64, 63, 64, 130, 255];
    for p in written {
        assert_eq!(
            fault(&vm, &mut v, gpa + p * PAGE_SIZE, Access::Write, false),
            FaultOutcome::Fixed
        );
    }
    for p in [2u64, 65] {
        assert_eq!(
            fault(&vm, &mut v, gpa + p * PAGE_SIZE, Access::Read, false),
            FaultOutcome::Fixed
        );
    }
    // A writable page in a slot that does not log.
    assert_eq!(
        fault(&vm, &mut v, ogpa, Access::Write, false),
        FaultOutcome::Fixed
    );
    let snapshot = |vm: &Vm<F>| -> Vec<Option<(u64, Level)>> {
        (0..256)
            .map(|p| vm.lookup(Gfn::new((gpa >> PAGE_SHIFT) + p)))
            .chain(std::iter::once(vm.lookup(Gpa::new(ogpa).gfn())))
            .collect()
    };
    let before = snapshot(&vm);
    for p in written {
        let (leaf, _) = before[p as usize].unwrap();
        assert!(
            F::is_writable(leaf),
            "page {p} not writable after a write fault"
        );
    }
    let flushes = vm.stats().remote_tlb_flush;

    let got = dirty_gfns(&vm, 1);
    let want: Vec<u64> = written.iter().map(|p| (gpa >> PAGE_SHIFT) + p).collect();
    assert_eq!(got, want);
    assert!(
        vm.stats().remote_tlb_flush > flushes,
        "harvest returned without a remote flush"
    );
    let after = snapshot(&vm);
    for (i, (b, a)) in before.iter().zip(after.iter()).enumerate() {
        if written.contains(&(i as u64)) {
            let (bl, blevel) = b.unwrap();
            let (al, alevel) = a.unwrap_or_else(|| panic!("page {i} unmapped by the harvest"));
            assert_eq!(alevel, blevel);
            assert_eq!(
                al,
                F::write_protect(bl),
                "page {i}: not exactly write-protected"
            );
            assert!(F::is_mmu_writable(al));
        } else {
            assert_eq!(a, b, "page {i} was not returned but changed");
        }
    }
    // A second harvest finds nothing and changes nothing.
    let flushes = vm.stats().remote_tlb_flush;
    let mut words = vec![u64::MAX; 4];
    assert_eq!(vm.get_dirty_log(1, &mut words).unwrap(), 0);
    assert_eq!(words, vec![0; 4]);
    assert_eq!(snapshot(&vm), after);
    assert_eq!(
        vm.stats().remote_tlb_flush,
        flushes,
        "an empty harvest owes no flush"
    );
    check_audit(&vm, "harvest");
    teardown(vm, [v]);
}

fn read_fault_in_logged_slot_leaves_the_first_write_to_the_fast_path<F: PteFormat>() {
    // fault.rs: "Read faults in a logged slot map read-only (MMU-writable kept) so the first
    // write is seen and logged by the fast path."
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(64 * PAGE_SIZE);
    let gpa = 0x40_0000;
    vm.add_memslot(1, Gpa::new(gpa), 64 * PAGE_SIZE, mem.range(PAGE_SIZE), LOG)
        .unwrap();
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Read, false),
        FaultOutcome::Fixed
    );
    let (leaf, _) = expect_mapped(&vm, gpa, mem.addr());
    assert!(!F::is_writable(leaf), "a read in a logged slot mapped W");
    assert!(dirty_gfns(&vm, 1).is_empty(), "a read dirtied the page");
    assert!(
        F::is_mmu_writable(leaf),
        "read fault in a logged slot dropped MMU-writable: {leaf:#x}"
    );
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, true),
        FaultOutcome::FixedFast
    );
    assert_eq!(dirty_gfns(&vm, 1), vec![gpa >> PAGE_SHIFT]);
    teardown(vm, [v]);
}

fn read_then_write_in_logged_slot_is_logged<F: PteFormat>() {
    // Whatever path fixes it, the write after a read fault must reach the log.
    for fast_pf in [true, false] {
        let vm = Vm::<F>::new(VmConfig {
            fast_pf,
            ..VmConfig::default()
        });
        let mut v = vm.create_vcpu(0);
        let mem = HostMem::new(64 * PAGE_SIZE);
        let gpa = 0x40_0000;
        vm.add_memslot(1, Gpa::new(gpa), 64 * PAGE_SIZE, mem.range(PAGE_SIZE), LOG)
            .unwrap();
        assert_eq!(
            fault(&vm, &mut v, gpa + PAGE_SIZE, Access::Read, false),
            FaultOutcome::Fixed
        );
        assert!(dirty_gfns(&vm, 1).is_empty(), "a read dirtied the page");
        let o = fault(&vm, &mut v, gpa + PAGE_SIZE, Access::Write, true);
        assert!(
            matches!(o, FaultOutcome::Fixed | FaultOutcome::FixedFast),
            "{o:?}"
        );
        let (leaf, _) = expect_mapped(&vm, gpa + PAGE_SIZE, mem.addr() + PAGE_SIZE);
        assert!(F::is_writable(leaf));
        assert_eq!(dirty_gfns(&vm, 1), vec![(gpa >> PAGE_SHIFT) + 1]);
        teardown(vm, [v]);
    }
}

fn lazy_split_write_protects_huge_leaves_and_splits_on_the_first_write<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig {
        eager_split: false,
        ..VmConfig::default()
    });
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(2 << 20);
    let gpa = 0x20_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        2 << 20,
        mem.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, false),
        FaultOutcome::Fixed
    );
    vm.set_memslot_flags(1, LOG).unwrap();
    let (leaf, level) = expect_mapped(&vm, gpa + 3 * PAGE_SIZE, mem.addr() + 3 * PAGE_SIZE);
    assert_eq!(level, 2, "eager_split off split anyway");
    assert!(!F::is_writable(leaf) && F::is_mmu_writable(leaf));

    // The huge leaf cannot be logged per page: the write splits it, then maps one page W.
    let o = fault(&vm, &mut v, gpa + 3 * PAGE_SIZE, Access::Write, true);
    assert_eq!(o, FaultOutcome::Fixed);
    let (leaf, level) = expect_mapped(&vm, gpa + 3 * PAGE_SIZE, mem.addr() + 3 * PAGE_SIZE);
    assert_eq!(level, 1);
    assert!(F::is_writable(leaf));
    let neighbour = gpa + 4 * PAGE_SIZE;
    let s = vm.stats();
    if F::BREAK_BEFORE_MAKE {
        // Format difference: under break-before-make the block is invalidated and flushed
        // anyway, and the table replacing it holds only the page this fault mapped (KVM arm64
        // maps the rest lazily); the neighbour faults back in at 4 KiB, write-protected.
        assert_eq!(
            vm.lookup(Gpa::new(neighbour).gfn()),
            None,
            "lazy split filled the table"
        );
        assert_eq!((s.leaves_4k, s.leaves_2m, s.bbm_breaks), (1, 0, 1));
        assert_eq!(
            fault(&vm, &mut v, neighbour, Access::Read, false),
            FaultOutcome::Fixed
        );
    } else {
        // One compare-and-swap installs a table of 512 equivalent (write-protected) leaves.
        assert_eq!((s.leaves_4k, s.leaves_2m), (512, 0));
    }
    let (n, nlevel) = expect_mapped(&vm, neighbour, mem.addr() + 4 * PAGE_SIZE);
    assert_eq!(nlevel, 1);
    assert!(!F::is_writable(n) && F::is_mmu_writable(n));
    assert_eq!(dirty_gfns(&vm, 1), vec![(gpa >> PAGE_SHIFT) + 3]);
    check_audit(&vm, "lazy split");
    teardown(vm, [v]);
}

fn disabling_dirty_logging_brings_huge_leaves_back<F: PteFormat>() {
    let (vm, mut v, mem, gpa) = logged_two_huge_leaves::<F>(VmConfig::default());
    assert_eq!(
        fault(&vm, &mut v, gpa + PAGE_SIZE, Access::Write, true),
        FaultOutcome::FixedFast
    );
    let before = vm.stats();
    vm.set_memslot_flags(1, MemslotFlags::empty()).unwrap();
    // Format difference: each table rebuilt as a block is a break-before-make.
    let breaks = if F::BREAK_BEFORE_MAKE { 2 } else { 0 };
    assert_eq!(vm.stats().bbm_breaks - before.bbm_breaks, breaks);
    assert!(matches!(
        vm.get_dirty_log(1, &mut [0; 16]),
        Err(slat::dirty::DirtyLogError::NotLogging { id: 1 })
    ));
    for off in [PAGE_SIZE, (2 << 20) + 9 * PAGE_SIZE] {
        let o = fault(&vm, &mut v, gpa + off, Access::Write, false);
        assert!(
            matches!(o, FaultOutcome::Fixed | FaultOutcome::Spurious),
            "{o:?}"
        );
        let (leaf, level) = expect_mapped(&vm, gpa + off, mem.addr() + off);
        assert_eq!(level, 2, "offset {off:#x}: huge page not recovered");
        assert!(F::is_writable(leaf));
    }
    let s = vm.stats();
    assert_eq!((s.leaves_4k, s.leaves_2m), (0, 2), "{s:?}");
    check_audit(&vm, "after logging off");
    teardown(vm, [v]);
}

fn enabling_logging_splits_1g_leaves_down_to_4k<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let gpa = 1 << 30;
    let mem = HostMem::reserve(HUGE_1G, HUGE_1G);
    let host = mem.addr();
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        1 << 30,
        mem.range(HUGE_1G),
        MemslotFlags::empty(),
    )
    .unwrap();
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, false),
        FaultOutcome::Fixed
    );
    assert_eq!(vm.stats().leaves_1g, 1);
    vm.set_memslot_flags(1, LOG).unwrap();
    let s = vm.stats();
    assert_eq!((s.leaves_4k, s.leaves_2m, s.leaves_1g), (1 << 18, 0, 0));
    for p in [0u64, 1, 511, 512, 123_456, (1 << 18) - 1] {
        let (leaf, level) = expect_mapped(&vm, gpa + p * PAGE_SIZE, host + p * PAGE_SIZE);
        assert_eq!(level, 1);
        assert!(!F::is_writable(leaf) && F::is_mmu_writable(leaf));
    }
    check_audit(&vm, "1 GiB split");
    teardown(vm, [v]);
}

fn one_gib_mapped_at_4k_needs_at_most_2_1_mib_of_tables<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::reserve(HUGE_1G, PAGE_SIZE);
    let host = mem.addr();
    let gpa = 0;
    let npages = (1u64 << 30) / PAGE_SIZE;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        1 << 30,
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    for p in 0..npages {
        let o = fault(&vm, &mut v, gpa + p * PAGE_SIZE, Access::Write, false);
        if o != FaultOutcome::Fixed {
            panic!("page {p}: {o:?}");
        }
    }
    let s = vm.stats();
    assert_eq!(s.leaves_4k, npages);
    assert!(
        s.table_bytes * 10 <= 21 << 20,
        "{} bytes of tables for 1 GiB at 4 KiB ({} pages)",
        s.table_bytes,
        s.table_pages
    );
    // Root, one level-3, one level-2 and 512 leaf tables.
    assert_eq!(s.table_pages, 515);
    check_audit(&vm, "1 GiB at 4 KiB");
    for p in [0, npages / 2 + 3, npages - 1] {
        expect_mapped(&vm, gpa + p * PAGE_SIZE, host + p * PAGE_SIZE);
    }
    teardown(vm, [v]);
}

fn zap_flushes_remote_tlbs_frees_tables_and_an_empty_zap_flushes_nothing<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(4 << 20);
    let gpa = 0x4000_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        4 << 20,
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    // Map the first 2 MiB frame at 4 KiB (one leaf table) and a page in the second.
    for p in (0..512).chain([600]) {
        assert_eq!(
            fault(&vm, &mut v, gpa + p * PAGE_SIZE, Access::Write, false),
            FaultOutcome::Fixed
        );
    }
    let s0 = vm.stats();
    assert_eq!(s0.table_pages, 5, "{s0:?}"); // root, L3, L2, two L1
    let alloc = slat::hw::table_alloc(&vm).clone();
    let live0 = alloc.live_pages();

    // Zap the whole first frame: its leaf table leaves the tree and is eventually freed.
    vm.zap_gfn_range(Gpa::new(gpa).gfn(), Gfn::new((gpa + HUGE_2M) >> PAGE_SHIFT))
        .expect("not refused: no CPU of this thread in guest mode");
    let s1 = vm.stats();
    assert!(s1.remote_tlb_flush_requests > s0.remote_tlb_flush_requests);
    assert!(
        s1.remote_tlb_flush > s0.remote_tlb_flush,
        "a vCPU exists, so the flush must reach it"
    );
    assert_eq!(s1.leaves_4k, 1);
    assert_eq!(s1.table_pages, 4);
    assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), None);
    expect_mapped(&vm, gpa + 600 * PAGE_SIZE, mem.addr() + 600 * PAGE_SIZE);
    assert!(
        v.pending_requests() & REQ_TLB_FLUSH != 0,
        "the vCPU outside guest mode was not asked to flush"
    );
    v.service_requests(|| {});
    wait_for_reclaim(&alloc, live0 - 1);
    check_audit(&vm, "after zap");

    // Nothing mapped there any more: no flush owed.
    vm.zap_gfn_range(Gpa::new(gpa).gfn(), Gfn::new((gpa + HUGE_2M) >> PAGE_SHIFT))
        .expect("not refused: no CPU of this thread in guest mode");
    let s2 = vm.stats();
    assert_eq!(s2.remote_tlb_flush_requests, s1.remote_tlb_flush_requests);
    assert_eq!(s2.remote_tlb_flush, s1.remote_tlb_flush);
    assert_eq!(v.pending_requests(), 0);

    // A partial zap of a 4 KiB-mapped frame removes exactly the range.
    vm.zap_gfn_range(
        Gfn::new((gpa >> PAGE_SHIFT) + 600),
        Gfn::new((gpa >> PAGE_SHIFT) + 601),
    )
    .expect("not refused: no CPU of this thread in guest mode");
    assert_eq!(vm.stats().leaves_4k, 0);
    assert!(vm.stats().remote_tlb_flush > s2.remote_tlb_flush);
    check_audit(&vm, "after the last zap");
    teardown(vm, [v]);
}

fn zap_of_a_straddling_huge_leaf_removes_the_whole_leaf<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(4 << 20);
    let gpa = 0x4000_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        4 << 20,
        mem.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    for off in [0, 2 << 20] {
        assert_eq!(
            fault(&vm, &mut v, gpa + off, Access::Read, false),
            FaultOutcome::Fixed
        );
    }
    let g = gpa >> PAGE_SHIFT;
    // One page in the middle of the first leaf.
    vm.zap_gfn_range(Gfn::new(g + 100), Gfn::new(g + 101))
        .expect("not refused: no CPU of this thread in guest mode");
    assert_eq!(vm.lookup(Gfn::new(g)), None);
    assert_eq!(vm.lookup(Gfn::new(g + 511)), None);
    assert_eq!(vm.lookup(Gfn::new(g + 512)).map(|(_, l)| l), Some(2));
    assert_eq!(vm.stats().leaves_2m, 1);
    check_audit(&vm, "straddling zap");
    teardown(vm, [v]);
}

/// A VM with gfns 0..4 mapped, for the out-of-range tests.
fn low_pages_mapped<F: PteFormat>() -> (Arc<Vm<F>>, Vcpu<F>, HostMem) {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(64 * PAGE_SIZE);
    vm.add_memslot(
        1,
        Gpa::new(0),
        64 * PAGE_SIZE,
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    for p in 0..4 {
        assert_eq!(
            fault(&vm, &mut v, p * PAGE_SIZE, Access::Write, false),
            FaultOutcome::Fixed
        );
    }
    (vm, v, mem)
}

/// The first GFN neither format can translate (48-bit guest physical addresses).
const GFN_LIMIT: u64 = 1 << (48 - PAGE_SHIFT);

fn lookup_beyond_the_guest_physical_width_finds_nothing<F: PteFormat>() {
    let (vm, v, _mem) = low_pages_mapped::<F>();
    for g in [GFN_LIMIT, GFN_LIMIT + 2, 3 * GFN_LIMIT + 1] {
        assert_eq!(
            vm.lookup(Gfn::new(g)),
            None,
            "lookup({g:#x}) aliases gfn {:#x}",
            g % GFN_LIMIT
        );
    }
    teardown(vm, [v]);
}

fn zap_beyond_the_guest_physical_width_touches_nothing<F: PteFormat>() {
    let (vm, v, mem) = low_pages_mapped::<F>();
    vm.zap_gfn_range(Gfn::new(GFN_LIMIT), Gfn::new(GFN_LIMIT + 4))
        .expect("not refused: no CPU of this thread in guest mode");
    for p in 0..4 {
        assert!(
            vm.lookup(Gfn::new(p)).is_some(),
            "zap of [{GFN_LIMIT:#x}, +4) unmapped gfn {p}"
        );
        expect_mapped(&vm, p * PAGE_SIZE, mem.addr() + p * PAGE_SIZE);
    }
    assert_eq!(vm.stats().leaves_4k, 4);
    check_audit(&vm, "zap beyond the width");
    teardown(vm, [v]);
}

fn remote_flush_waits_for_an_in_guest_vcpu_to_acknowledge<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(16 * PAGE_SIZE);
    let gpa = 0x10_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        mem.len(),
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, false),
        FaultOutcome::Fixed
    );
    let guest = v.enter_guest();
    if guest.requests_at_entry() != 0 {
        v.service_requests(|| {});
    }
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let zapper = s.spawn(|| {
            vm.zap_gfn_range(Gpa::new(gpa).gfn(), Gfn::new((gpa >> PAGE_SHIFT) + 1))
                .expect("not refused: no CPU of this thread in guest mode");
            done.store(true, Ordering::SeqCst);
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while v.pending_requests() & REQ_TLB_FLUSH == 0 {
            assert!(Instant::now() < deadline, "no flush request arrived");
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !done.load(Ordering::SeqCst),
            "zap returned before the in-guest vCPU acknowledged the flush"
        );
        let mut flushed = false;
        let reqs = v.service_requests(|| flushed = true);
        assert!(flushed && reqs & REQ_TLB_FLUSH != 0);
        zapper.join().unwrap();
    });
    assert!(done.load(Ordering::SeqCst));
    drop(guest);
    assert!(!v.in_guest());
    assert_eq!(vm.lookup(Gpa::new(gpa).gfn()), None);
    teardown(vm, [v]);
}

fn table_pages_live_covers_linked_tables_and_vcpu_caches<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut vcpus: Vec<Vcpu<F>> = (0..3).map(|i| vm.create_vcpu(i)).collect();
    let mem = HostMem::new(8 << 20);
    let gpa = 0x8000_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        8 << 20,
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let s = vm.stats();
    assert_eq!((s.table_pages, s.table_pages_live), (1, 1), "{s:?}");
    for (i, v) in vcpus.iter_mut().enumerate() {
        for p in 0..40u64 {
            let g = gpa + (i as u64 * 600 + p * 7) * PAGE_SIZE;
            let o = fault(&vm, v, g, Access::Write, false);
            assert!(matches!(o, FaultOutcome::Fixed | FaultOutcome::Spurious));
            let s = vm.stats();
            assert!(
                s.table_pages_live >= s.table_pages,
                "live {} < linked {}",
                s.table_pages_live,
                s.table_pages
            );
        }
    }
    check_audit(&vm, "three vCPUs");
    // Destroying a vCPU returns its cached pages.
    let alloc = slat::hw::table_alloc(&vm).clone();
    let linked = vm.stats().table_pages;
    for v in vcpus.drain(..) {
        drop(v);
    }
    assert_eq!(alloc.live_pages(), linked, "vCPU page caches not returned");
    teardown(vm, []);
}

fn mutex_variant_faults_zaps_and_logs<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig {
        mmu_lock: MmuLockKind::Mutex,
        ..VmConfig::default()
    });
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::new(4 << 20);
    let gpa = 0x20_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        4 << 20,
        mem.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    assert_eq!(
        fault(&vm, &mut v, gpa + 0x5000, Access::Write, false),
        FaultOutcome::Fixed
    );
    assert_eq!(expect_mapped(&vm, gpa + 0x5000, mem.addr() + 0x5000).1, 2);
    vm.set_memslot_flags(1, LOG).unwrap();
    assert_eq!(
        fault(&vm, &mut v, gpa + 0x5000, Access::Write, true),
        FaultOutcome::FixedFast
    );
    assert_eq!(dirty_gfns(&vm, 1), vec![(gpa + 0x5000) >> PAGE_SHIFT]);
    vm.zap_gfn_range(
        Gpa::new(gpa).gfn(),
        Gfn::new((gpa >> PAGE_SHIFT) + pages_per_entry(2)),
    )
    .expect("not refused: no CPU of this thread in guest mode");
    assert_eq!(vm.lookup(Gfn::new((gpa + 0x5000) >> PAGE_SHIFT)), None);
    check_audit(&vm, "mutex variant");
    teardown(vm, [v]);
}

/// Invariant 7 under concurrency: a slow-path fault that validated the memslot generation
/// before logging was enabled must not install a huge (or writable, unlogged) leaf after
/// `set_memslot_flags(LOG)` returned. Faulting vCPUs race with enable/disable cycles; after each
/// enable, no leaf of the slot may be larger than 4 KiB.
fn faults_racing_with_enable_logging_never_leave_huge_leaves<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let slot_bytes = 256u64 << 20;
    let mem = HostMem::reserve(slot_bytes, HUGE_2M);
    let gpa = 0x1_0000_0000u64;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        slot_bytes,
        mem.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    let frames = slot_bytes / HUGE_2M;
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_millis(1500);
    let mut violations = 0u64;
    let mut rounds = 0u64;
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let vm = &vm;
            let stop = &stop;
            s.spawn(move || {
                let mut v = vm.create_vcpu(t as u32);
                let mut rng = Rng::new(t);
                while !stop.load(Ordering::Relaxed) {
                    let f = rng.below(frames);
                    let g = gpa + f * HUGE_2M + rng.below(512) * PAGE_SIZE;
                    let _ = fault(vm, &mut v, g, Access::Write, false);
                }
                drop(v);
            });
        }
        while Instant::now() < deadline && violations == 0 {
            rounds += 1;
            vm.set_memslot_flags(1, LOG).unwrap();
            for f in 0..frames {
                if let Some((_, level)) = vm.lookup(Gfn::new((gpa >> PAGE_SHIFT) + f * 512)) {
                    if level > 1 {
                        violations += 1;
                    }
                }
            }
            vm.set_memslot_flags(1, MemslotFlags::empty()).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(
        violations, 0,
        "huge leaves in a dirty-logged slot after {rounds} enable rounds"
    );
    teardown(vm, []);
}
