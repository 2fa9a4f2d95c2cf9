//! Manual dirty-log protection: refused CLEARs consume nothing, CLEAR re-protects exactly the bits
//! it cleared, and INITIALLY_SET protects nothing until the first CLEAR.

use super::*;
use slat::Stats;

/// (what, slot, first_page, num_pages, bitmap, expected error) of a refused CLEAR.
pub(crate) type ClearCase = (&'static str, u32, u64, u64, Vec<u64>, DirtyLogError);

pub(crate) fn clear_errors_consume_nothing<F: PteFormat>() {
    each_wrprot(clear_errors_consume_nothing_one::<F>)
}

pub(crate) fn clear_errors_consume_nothing_one<F: PteFormat>() {
    clear_without_manual_protection_is_refused::<F>();

    let vm = Vm::<F>::new(config());
    vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    let base = MIB;
    let m1 = HostMem::new(130 * PAGE_SIZE);
    let m2 = HostMem::new(64 * PAGE_SIZE);
    vm.add_memslot(1, Gpa::new(base), 130 * PAGE_SIZE, m1.range(PAGE_SIZE), LOG)
        .unwrap();
    vm.add_memslot(
        2,
        Gpa::new(4 * MIB),
        64 * PAGE_SIZE,
        m2.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let dirty = [3u64, 70, 128, 129];
    for p in dirty {
        write_new(&vm, &mut v, base + p * PAGE_SIZE);
    }
    assert_eq!(dirty_pages(&vm, 1), dirty.to_vec(), "initial GET");
    for case in refused_clear_cases() {
        check_refused_clear(&vm, case, base, &dirty);
    }
    clears_after_refusals(&vm, base, &dirty);
    teardown(vm, [v]);
    drop((m1, m2));
}

/// Without manual protection CLEAR is refused and GET still returns (and consumes) the bits.
fn clear_without_manual_protection_is_refused<F: PteFormat>() {
    let vm = Vm::<F>::new(config());
    let mut v = vm.create_vcpu(0);
    let m = HostMem::new(130 * PAGE_SIZE);
    vm.add_memslot(1, Gpa::new(MIB), 130 * PAGE_SIZE, m.range(PAGE_SIZE), LOG)
        .unwrap();
    write_new(&vm, &mut v, MIB + 3 * PAGE_SIZE);
    let e = vm
        .clear_dirty_log(1, PageIndex::new(0), 130, &[!0, !0, !0])
        .unwrap_err();
    assert_eq!(e, DirtyLogError::ManualProtectOff, "CLEAR without manual");
    assert!(
        writable(&vm, MIB + 3 * PAGE_SIZE),
        "refused CLEAR protected a page"
    );
    assert_eq!(dirty_pages(&vm, 1), vec![3], "refused CLEAR consumed a bit");
    assert!(
        !writable(&vm, MIB + 3 * PAGE_SIZE),
        "GET without manual protection did not re-protect"
    );
    check_audit(&vm, "not manual");
    teardown(vm, [v]);
}

/// The refused CLEARs, against slot 1 (130 pages, logging) and slot 2 (64 pages, not logging).
/// A data table, one case per refusal reason and edge, so longer than a function should be.
fn refused_clear_cases() -> Vec<ClearCase> {
    vec![
        (
            "unknown slot",
            9,
            0,
            64,
            vec![!0],
            DirtyLogError::UnknownSlot { id: 9 },
        ),
        (
            "slot not logging",
            2,
            0,
            64,
            vec![!0],
            DirtyLogError::NotLogging { id: 2 },
        ),
        (
            "first_page 1",
            1,
            1,
            64,
            vec![!0],
            DirtyLogError::ClearUnaligned {
                id: 1,
                first_page: PageIndex::new(1),
            },
        ),
        (
            "first_page 70",
            1,
            70,
            60,
            vec![!0],
            DirtyLogError::ClearUnaligned {
                id: 1,
                first_page: PageIndex::new(70),
            },
        ),
        (
            "one page past the end",
            1,
            0,
            131,
            vec![!0; 3],
            DirtyLogError::ClearRange {
                id: 1,
                first_page: PageIndex::new(0),
                num_pages: 131,
                npages: 130,
            },
        ),
        (
            "past the end from 64",
            1,
            64,
            67,
            vec![!0; 2],
            DirtyLogError::ClearRange {
                id: 1,
                first_page: PageIndex::new(64),
                num_pages: 67,
                npages: 130,
            },
        ),
        (
            "from 128, 3 pages",
            1,
            128,
            3,
            vec![!0],
            DirtyLogError::ClearRange {
                id: 1,
                first_page: PageIndex::new(128),
                num_pages: 3,
                npages: 130,
            },
        ),
        (
            "first_page beyond the slot",
            1,
            192,
            0,
            vec![!0],
            DirtyLogError::ClearRange {
                id: 1,
                first_page: PageIndex::new(192),
                num_pages: 0,
                npages: 130,
            },
        ),
        (
            "65 pages not ending the slot",
            1,
            0,
            65,
            vec![!0; 2],
            DirtyLogError::ClearRange {
                id: 1,
                first_page: PageIndex::new(0),
                num_pages: 65,
                npages: 130,
            },
        ),
        (
            "2 pages not ending the slot",
            1,
            64,
            2,
            vec![!0],
            DirtyLogError::ClearRange {
                id: 1,
                first_page: PageIndex::new(64),
                num_pages: 2,
                npages: 130,
            },
        ),
        (
            "bitmap of 1 word for 128 pages",
            1,
            0,
            128,
            vec![!0],
            DirtyLogError::BitmapTooSmall {
                id: 1,
                need: 2,
                have: 1,
            },
        ),
        (
            "bitmap of 1 word for the last 66 pages",
            1,
            64,
            66,
            vec![!0],
            DirtyLogError::BitmapTooSmall {
                id: 1,
                need: 2,
                have: 1,
            },
        ),
        (
            "empty bitmap for the whole slot",
            1,
            0,
            130,
            vec![],
            DirtyLogError::BitmapTooSmall {
                id: 1,
                need: 3,
                have: 0,
            },
        ),
    ]
}

/// One refused CLEAR: the right error with a one-line message, and no bit consumed, no page
/// protected, no flush.
fn check_refused_clear<F: PteFormat>(vm: &Vm<F>, case: ClearCase, base: u64, dirty: &[u64]) {
    let (what, id, first, num, bitmap, want) = case;
    let flushes = vm.stats().remote_tlb_flush_requests;
    let e = vm
        .clear_dirty_log(id, PageIndex::new(first), num, &bitmap)
        .expect_err(what);
    assert_eq!(e, want, "{what}: wrong error");
    let msg = e.to_string();
    assert!(
        !msg.is_empty() && !msg.contains('\n'),
        "{what}: message {msg:?}"
    );
    assert_eq!(
        dirty_pages(vm, 1),
        dirty.to_vec(),
        "{what}: refused CLEAR consumed bits"
    );
    for &p in dirty {
        assert!(
            writable(vm, base + p * PAGE_SIZE),
            "{what}: refused CLEAR protected page {p}"
        );
    }
    assert_eq!(
        vm.stats().remote_tlb_flush_requests,
        flushes,
        "{what}: refused CLEAR flushed"
    );
}

/// Valid requests after all the refusals: an empty range, then the tail (bits past num_pages
/// are ignored), then the rest; clearing again clears nothing.
fn clears_after_refusals<F: PteFormat>(vm: &Vm<F>, base: u64, dirty: &[u64]) {
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 0, &[]),
        Ok(0),
        "empty CLEAR"
    );
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(128), 2, &[!0]),
        Ok(2),
        "CLEAR of the last two pages (ends the slot)"
    );
    assert_eq!(dirty_pages(vm, 1), vec![3, 70], "after clearing the tail");
    assert!(!writable(vm, base + 128 * PAGE_SIZE), "page 128 still W");
    assert!(!writable(vm, base + 129 * PAGE_SIZE), "page 129 still W");
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 128, &[!0, !0]),
        Ok(2),
        "CLEAR of the first 128 pages"
    );
    assert_eq!(dirty_pages(vm, 1), Vec::<u64>::new(), "after clearing all");
    for &p in dirty {
        assert!(
            !writable(vm, base + p * PAGE_SIZE),
            "page {p} still writable after CLEAR"
        );
    }
    // Clearing again clears nothing.
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 130, &[!0; 3]),
        Ok(0),
        "second CLEAR"
    );
    check_audit(vm, "clear errors");
}

pub(crate) fn clear_reprotects_exactly_the_bits_cleared<F: PteFormat>() {
    each_wrprot(clear_reprotects_exactly_the_bits_cleared_one::<F>)
}

pub(crate) fn clear_reprotects_exactly_the_bits_cleared_one<F: PteFormat>() {
    let vm = Vm::<F>::new(config());
    vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    let base = 2 * MIB;
    let m = HostMem::new(256 * PAGE_SIZE);
    vm.add_memslot(
        1,
        Gpa::new(base),
        256 * PAGE_SIZE,
        m.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    // Mapped writable before logging: enabling write-protects it.
    write_new(&vm, &mut v, base + 100 * PAGE_SIZE);
    assert!(writable(&vm, base + 100 * PAGE_SIZE));
    vm.set_memslot_flags(1, LOG).unwrap();
    assert!(
        !writable(&vm, base + 100 * PAGE_SIZE),
        "enabling logging (no INITIALLY_SET) must write-protect"
    );
    assert_eq!(dirty_pages(&vm, 1), Vec::<u64>::new(), "fresh log");

    write_new(&vm, &mut v, base + 3 * PAGE_SIZE);
    write_new(&vm, &mut v, base + 70 * PAGE_SIZE);
    assert_eq!(dirty_pages(&vm, 1), vec![3, 70], "GET after two writes");
    // GET in manual mode only copies: still dirty, still writable.
    assert_eq!(dirty_pages(&vm, 1), vec![3, 70], "second GET");
    assert!(writable(&vm, base + 3 * PAGE_SIZE), "GET protected page 3");
    assert!(
        writable(&vm, base + 70 * PAGE_SIZE),
        "GET protected page 70"
    );

    // Bit 5 is asked for but was never set: not counted, and page 5 stays unmapped.
    let flushes = vm.stats().remote_tlb_flush_requests;
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 64, &[1 << 3 | 1 << 5]),
        Ok(1),
        "CLEAR of bits 3 and 5 clears one"
    );
    assert!(
        vm.stats().remote_tlb_flush_requests > flushes,
        "CLEAR that protected a page did not flush"
    );
    assert!(!writable(&vm, base + 3 * PAGE_SIZE), "page 3 still W");
    assert!(
        F::is_mmu_writable(leaf(&vm, base + 3 * PAGE_SIZE).0),
        "page 3 lost MMU-writable"
    );
    assert!(writable(&vm, base + 70 * PAGE_SIZE), "page 70 protected");
    assert_eq!(
        vm.lookup(Gfn::new((base >> PAGE_SHIFT) + 5)),
        None,
        "page 5 mapped"
    );
    assert_eq!(dirty_pages(&vm, 1), vec![70], "GET after CLEAR of page 3");

    // The next write to page 3 is logged again by the fast path.
    write_protected(&vm, &mut v, base + 3 * PAGE_SIZE);
    assert_eq!(dirty_pages(&vm, 1), vec![3, 70], "after rewriting page 3");
    // CLEAR of page 70 through a window starting at 64.
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(64), 64, &[1 << 6]),
        Ok(1)
    );
    assert!(!writable(&vm, base + 70 * PAGE_SIZE), "page 70 still W");
    assert!(writable(&vm, base + 3 * PAGE_SIZE), "page 3 protected");
    assert_eq!(dirty_pages(&vm, 1), vec![3]);
    check_audit(&vm, "clear exact");
    teardown(vm, [v]);
    drop(m);
}

pub(crate) fn initially_set_protects_nothing_until_clear<F: PteFormat>() {
    each_wrprot(initially_set_protects_nothing_until_clear_one::<F>)
}

pub(crate) fn initially_set_protects_nothing_until_clear_one<F: PteFormat>() {
    let vm = Vm::<F>::new(config());
    vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE | INITIALLY_SET)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    // Slot 1: 2 MiB at 2 MiB, backed by 2 MiB host pages. Slot 2: 100 4 KiB pages.
    let base1 = 2 * MIB;
    let base2 = 8 * MIB;
    let m1 = HostMem::with_align(HUGE_2M, HUGE_2M);
    let m2 = HostMem::new(100 * PAGE_SIZE);
    vm.add_memslot(
        1,
        Gpa::new(base1),
        HUGE_2M,
        m1.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    vm.add_memslot(
        2,
        Gpa::new(base2),
        100 * PAGE_SIZE,
        m2.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    write_new(&vm, &mut v, base1 + 0x5000);
    write_new(&vm, &mut v, base2 + 7 * PAGE_SIZE);
    let (huge, level) = leaf(&vm, base1);
    assert_eq!(level, 2, "2 MiB-backed slot not mapped by a huge leaf");
    assert!(F::is_writable(huge));
    let small = leaf(&vm, base2 + 7 * PAGE_SIZE);
    let before = vm.stats();

    vm.set_memslot_flags(1, LOG).unwrap();
    vm.set_memslot_flags(2, LOG).unwrap();
    assert_eq!(
        leaf(&vm, base1),
        (huge, 2),
        "INITIALLY_SET: enabling logging touched the huge leaf"
    );
    assert_eq!(
        leaf(&vm, base2 + 7 * PAGE_SIZE),
        small,
        "INITIALLY_SET: enabling logging touched a 4 KiB leaf"
    );
    assert_eq!(vm.stats().splits, before.splits, "enabling logging split");
    assert_eq!(
        dirty_pages(&vm, 1),
        (0..512).collect::<Vec<_>>(),
        "slot 1 log not initially all set"
    );
    assert_eq!(
        dirty_pages(&vm, 2),
        (0..100).collect::<Vec<_>>(),
        "slot 2 log not initially all set (or tail bits past npages set)"
    );

    clear_splits_and_protects_the_huge_leaf(&vm, &mut v, base1, &m1, &before);

    // Slot 2: CLEAR only the first 64 pages; page 7 gets protected, the tail stays dirty.
    assert_eq!(vm.clear_dirty_log(2, PageIndex::new(0), 64, &[!0]), Ok(64));
    assert!(!writable(&vm, base2 + 7 * PAGE_SIZE), "page 7 still W");
    assert_eq!(dirty_pages(&vm, 2), (64..100).collect::<Vec<_>>());
    // Writes are logged again.
    write_protected(&vm, &mut v, base2 + 7 * PAGE_SIZE);
    if vm.lookup(Gfn::new((base1 >> PAGE_SHIFT) + 5)).is_some() {
        write_protected(&vm, &mut v, base1 + 5 * PAGE_SIZE);
    } else {
        write_new(&vm, &mut v, base1 + 5 * PAGE_SIZE);
    }
    assert_eq!(dirty_pages(&vm, 1), vec![5]);
    assert_eq!(dirty_pages(&vm, 2)[0], 7);
    check_audit(&vm, "initially set");
    teardown(vm, [v]);
    drop((m1, m2));
}

/// CLEAR everything of slot 1 (one 2 MiB leaf, every bit initially set): the huge leaf is
/// split and every mapped page protected, its translation unchanged.
fn clear_splits_and_protects_the_huge_leaf<F: PteFormat>(
    vm: &Vm<F>,
    v: &mut Vcpu<F>,
    base1: u64,
    m1: &HostMem,
    before: &Stats,
) {
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 512, &[!0; 8]),
        Ok(512),
        "CLEAR of slot 1"
    );
    let after = vm.stats();
    if config().wrprot == WrprotVariant::RmapLockless {
        // Without the MMU lock a huge leaf is made read-only, never split or zapped (as in the
        // lockless write-protect series): the first write to it faults and the slow path splits it.
        assert_eq!(after.splits, before.splits, "a lock-free CLEAR split");
        assert_eq!(after.leaves_2m, 1, "the huge leaf went away");
        let (l, lvl) = leaf(vm, base1);
        assert!(lvl > 1 && !F::is_writable(l), "huge leaf still writable");
        write_new(vm, v, base1 + 3 * PAGE_SIZE);
        assert!(vm.stats().splits > before.splits, "the write did not split");
        assert_eq!(dirty_pages(vm, 1), vec![3], "the write was not logged");
        assert_eq!(
            vm.clear_dirty_log(1, PageIndex::new(0), 64, &[1 << 3]),
            Ok(1)
        );
    } else {
        assert!(
            after.splits > before.splits,
            "CLEAR over a huge leaf did not split it"
        );
    }
    assert_eq!(vm.stats().leaves_2m, 0, "huge leaf left after CLEAR");
    for p in [0u64, 3, 5, 511] {
        if p != 3
            && config().wrprot == WrprotVariant::RmapLockless
            && vm.lookup(Gfn::new((base1 >> PAGE_SHIFT) + p)).is_none()
        {
            // The lazy split of stage-2 installs an empty table: only the written page is
            // mapped (EPT's lazy split prefills, read-only).
            continue;
        }
        let (l, lvl) = leaf(vm, base1 + p * PAGE_SIZE);
        assert_eq!(lvl, 1, "page {p} of slot 1 not mapped at 4 KiB after CLEAR");
        assert!(
            !F::is_writable(l),
            "page {p} of slot 1 writable after CLEAR"
        );
        assert!(F::is_mmu_writable(l), "page {p} lost MMU-writable");
        assert_eq!(
            leaf_hva::<F>(l, lvl, (base1 >> PAGE_SHIFT) + p),
            m1.addr() + p * PAGE_SIZE,
            "split changed the translation of page {p}"
        );
    }
    assert_eq!(dirty_pages(vm, 1), Vec::<u64>::new(), "slot 1 after CLEAR");
}
