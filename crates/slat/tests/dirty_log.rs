//! Dirty-log protocols end to end: manual protection (GET copies, CLEAR re-protects exactly what
//! it cleared, INITIALLY_SET), capability errors, the per-vCPU dirty ring (push, harvest, reset,
//! full), slots deleted or moved while logging, and huge-page recovery when logging stops.
#![cfg(not(loom))]

#[macro_use]
mod common;

use common::*;
use slat::dirty::DirtyLogError;
use slat::dirty::{INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use slat::{
    Access, FaultOutcome, Level, MemslotFlags, PteFormat, Vcpu, Vm, VmConfig, WrprotVariant,
};
use slat_addr::{Gfn, Gpa, PageIndex, PAGE_SHIFT, PAGE_SIZE};
use std::sync::Arc;

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
}

thread_local! {
    static WRPROT: std::cell::Cell<WrprotVariant> = const { std::cell::Cell::new(WrprotVariant::Walk) };
}

/// Runs a test once per write-protect variant (seed 002): every protocol here must hold
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

/// (what, slot, first_page, num_pages, bitmap, expected error) of a refused CLEAR.
type ClearCase = (&'static str, u32, u64, u64, Vec<u64>, DirtyLogError);

fn clear_errors_consume_nothing<F: PteFormat>() {
    each_wrprot(clear_errors_consume_nothing_one::<F>)
}

fn clear_errors_consume_nothing_one<F: PteFormat>() {
    // Without manual protection CLEAR is refused and GET still returns (and consumes) the bits.
    {
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

    let cases: Vec<ClearCase> = vec![
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
    ];
    for (what, id, first, num, bitmap, want) in cases {
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
            dirty_pages(&vm, 1),
            dirty.to_vec(),
            "{what}: refused CLEAR consumed bits"
        );
        for p in dirty {
            assert!(
                writable(&vm, base + p * PAGE_SIZE),
                "{what}: refused CLEAR protected page {p}"
            );
        }
        assert_eq!(
            vm.stats().remote_tlb_flush_requests,
            flushes,
            "{what}: refused CLEAR flushed"
        );
    }

    // Valid requests after all that: an empty range, then the tail (bits past num_pages are
    // ignored), then the rest.
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
    assert_eq!(dirty_pages(&vm, 1), vec![3, 70], "after clearing the tail");
    assert!(!writable(&vm, base + 128 * PAGE_SIZE), "page 128 still W");
    assert!(!writable(&vm, base + 129 * PAGE_SIZE), "page 129 still W");
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 128, &[!0, !0]),
        Ok(2),
        "CLEAR of the first 128 pages"
    );
    assert_eq!(dirty_pages(&vm, 1), Vec::<u64>::new(), "after clearing all");
    for p in dirty {
        assert!(
            !writable(&vm, base + p * PAGE_SIZE),
            "page {p} still writable after CLEAR"
        );
    }
    // Clearing again clears nothing.
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 130, &[!0; 3]),
        Ok(0),
        "second CLEAR"
    );
    check_audit(&vm, "clear errors");
    teardown(vm, [v]);
    drop((m1, m2));
}

fn clear_reprotects_exactly_the_bits_cleared<F: PteFormat>() {
    each_wrprot(clear_reprotects_exactly_the_bits_cleared_one::<F>)
}

fn clear_reprotects_exactly_the_bits_cleared_one<F: PteFormat>() {
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

fn initially_set_protects_nothing_until_clear<F: PteFormat>() {
    each_wrprot(initially_set_protects_nothing_until_clear_one::<F>)
}

fn initially_set_protects_nothing_until_clear_one<F: PteFormat>() {
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

    // CLEAR everything of slot 1: the huge leaf is split and every mapped page protected.
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 512, &[!0; 8]),
        Ok(512),
        "CLEAR of slot 1"
    );
    let after = vm.stats();
    if config().wrprot == WrprotVariant::RmapLockless {
        // Without the MMU lock a huge leaf is made read-only, never split or zapped (seed
        // 002): the first write to it faults and the slow path splits it.
        assert_eq!(after.splits, before.splits, "a lock-free CLEAR split");
        assert_eq!(after.leaves_2m, 1, "the huge leaf went away");
        let (l, lvl) = leaf(&vm, base1);
        assert!(lvl > 1 && !F::is_writable(l), "huge leaf still writable");
        write_new(&vm, &mut v, base1 + 3 * PAGE_SIZE);
        assert!(vm.stats().splits > before.splits, "the write did not split");
        assert_eq!(dirty_pages(&vm, 1), vec![3], "the write was not logged");
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
        let (l, lvl) = leaf(&vm, base1 + p * PAGE_SIZE);
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
    assert_eq!(dirty_pages(&vm, 1), Vec::<u64>::new(), "slot 1 after CLEAR");

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

fn capability_errors<F: PteFormat>() {
    each_wrprot(capability_errors_one::<F>)
}

fn capability_errors_one<F: PteFormat>() {
    let vm = Vm::<F>::new(config());
    assert_eq!(
        vm.set_manual_dirty_log_protect(4 | MANUAL_PROTECT_ENABLE),
        Err(DirtyLogError::UnknownFlags { bits: 4 }),
        "unknown flag"
    );
    assert_eq!(
        vm.set_manual_dirty_log_protect(INITIALLY_SET),
        Err(DirtyLogError::InitiallySetWithoutManual)
    );
    assert_eq!(vm.set_manual_dirty_log_protect(0), Ok(()));
    assert_eq!(
        vm.reset_dirty_rings(),
        Err(DirtyLogError::RingOff),
        "reset without the ring"
    );
    for entries in [0u32, 100, 64, 127, 131072, 3 << 10] {
        assert_eq!(
            vm.enable_dirty_ring(entries, false),
            Err(DirtyLogError::RingSize { entries }),
            "ring of {entries} entries"
        );
    }
    // A logging slot blocks both capabilities.
    let m = HostMem::new(64 * PAGE_SIZE);
    vm.add_memslot(3, Gpa::new(MIB), 64 * PAGE_SIZE, m.range(PAGE_SIZE), LOG)
        .unwrap();
    assert_eq!(
        vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE),
        Err(DirtyLogError::LoggingActive { id: 3 })
    );
    assert_eq!(
        vm.enable_dirty_ring(128, false),
        Err(DirtyLogError::LoggingActive { id: 3 })
    );
    // The bitmap still works as before (not manual: CLEAR refused).
    assert_eq!(
        vm.clear_dirty_log(3, PageIndex::new(0), 64, &[!0]),
        Err(DirtyLogError::ManualProtectOff)
    );
    vm.set_memslot_flags(3, MemslotFlags::empty()).unwrap();
    assert_eq!(
        vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE),
        Ok(())
    );
    assert_eq!(vm.enable_dirty_ring(128, false), Ok(()));
    assert_eq!(
        vm.enable_dirty_ring(256, false),
        Err(DirtyLogError::RingAlreadyEnabled { entries: 128 })
    );
    assert_eq!(vm.reset_dirty_rings(), Ok(0), "reset of empty rings");
    // Ring-only mode: no bitmaps, GET and CLEAR refused.
    vm.set_memslot_flags(3, LOG).unwrap();
    let mut words = [0u64; 1];
    assert_eq!(
        vm.get_dirty_log(3, &mut words),
        Err(DirtyLogError::NoBitmap { id: 3 })
    );
    assert_eq!(
        vm.clear_dirty_log(3, PageIndex::new(0), 64, &[!0]),
        Err(DirtyLogError::NoBitmap { id: 3 })
    );
    assert_eq!(
        vm.mark_page_dirty(Gpa::new(MIB)),
        Err(DirtyLogError::NoBitmap { id: 3 })
    );
    let v = vm.create_vcpu(0);
    assert_eq!(v.dirty_ring().map(|r| r.size()), Some(128));
    assert_eq!(vm.dirty_rings().len(), 1);
    teardown(vm, [v]);

    // Ring after a vCPU exists.
    let vm = Vm::<F>::new(config());
    let v = vm.create_vcpu(0);
    assert!(v.dirty_ring().is_none());
    assert_eq!(
        vm.enable_dirty_ring(128, false),
        Err(DirtyLogError::VcpusExist { vcpus: 1 })
    );
    assert!(!v.dirty_ring_full());
    teardown(vm, [v]);

    // Ring with a bitmap: GET works next to the ring.
    let vm = Vm::<F>::new(config());
    assert_eq!(vm.enable_dirty_ring(65536, true), Ok(()));
    vm.add_memslot(3, Gpa::new(MIB), 64 * PAGE_SIZE, m.range(PAGE_SIZE), LOG)
        .unwrap();
    assert_eq!(vm.mark_page_dirty(Gpa::new(MIB + 2 * PAGE_SIZE)), Ok(true));
    assert_eq!(dirty_pages(&vm, 3), vec![2], "ring-with-bitmap GET");
    teardown(vm, std::iter::empty());
    drop(m);
}

fn ring_push_harvest_reset<F: PteFormat>() {
    each_wrprot(ring_push_harvest_reset_one::<F>)
}

fn ring_push_harvest_reset_one<F: PteFormat>() {
    let vm = Vm::<F>::new(config());
    vm.enable_dirty_ring(128, false).unwrap();
    let mut v = vm.create_vcpu(0);
    let base = 4 * MIB;
    let m = HostMem::new(256 * PAGE_SIZE);
    vm.add_memslot(7, Gpa::new(base), 256 * PAGE_SIZE, m.range(PAGE_SIZE), LOG)
        .unwrap();
    let pages = [0u64, 1, 2, 63, 64, 200, 5, 130, 255, 100];
    for &p in &pages {
        write_new(&vm, &mut v, base + p * PAGE_SIZE);
    }
    // A read maps without logging; a repeated write is spurious and pushes nothing.
    assert_eq!(
        fault(&vm, &mut v, base + 10 * PAGE_SIZE, Access::Read, false),
        FaultOutcome::Fixed
    );
    assert!(!writable(&vm, base + 10 * PAGE_SIZE), "read mapped W");
    assert_eq!(
        fault(&vm, &mut v, base, Access::Write, true),
        FaultOutcome::Spurious
    );
    let ring = v.dirty_ring().expect("ring").clone();
    assert_eq!(ring.used(), 10);
    let got = harvest(&v);
    assert_eq!(
        got,
        pages.iter().map(|&p| (7, p)).collect::<Vec<_>>(),
        "harvest order/content"
    );
    assert_eq!(harvest(&v), vec![], "harvested twice");
    for &p in &pages {
        assert!(
            writable(&vm, base + p * PAGE_SIZE),
            "page {p} protected before reset"
        );
    }
    assert_eq!(ring.used(), 10, "harvest freed entries");
    assert_eq!(vm.reset_dirty_rings(), Ok(10));
    assert_eq!(ring.used(), 0, "reset left entries in use");
    for &p in &pages {
        let (l, _) = leaf(&vm, base + p * PAGE_SIZE);
        assert!(!F::is_writable(l), "page {p} writable after reset");
        assert!(F::is_mmu_writable(l), "page {p} lost MMU-writable");
    }
    assert_eq!(vm.reset_dirty_rings(), Ok(0), "second reset");
    // A new write pushes a new entry; unharvested entries are not reset.
    write_protected(&vm, &mut v, base + 200 * PAGE_SIZE);
    write_protected(&vm, &mut v, base + 10 * PAGE_SIZE);
    assert_eq!(ring.used(), 2);
    assert_eq!(
        vm.reset_dirty_rings(),
        Ok(0),
        "reset of unharvested entries"
    );
    assert!(writable(&vm, base + 200 * PAGE_SIZE));
    assert_eq!(harvest(&v), vec![(7, 200), (7, 10)]);
    assert_eq!(vm.reset_dirty_rings(), Ok(2));
    assert!(!writable(&vm, base + 200 * PAGE_SIZE));
    assert!(!writable(&vm, base + 10 * PAGE_SIZE));
    check_audit(&vm, "ring");
    teardown(vm, [v]);
    drop(m);
}

fn ring_full_refuses_the_write_until_reset<F: PteFormat>() {
    each_wrprot(ring_full_refuses_the_write_until_reset_one::<F>)
}

fn ring_full_refuses_the_write_until_reset_one<F: PteFormat>() {
    let vm = Vm::<F>::new(config());
    vm.enable_dirty_ring(128, false).unwrap();
    let mut v = vm.create_vcpu(0);
    let base = 4 * MIB;
    let m = HostMem::new(256 * PAGE_SIZE);
    vm.add_memslot(1, Gpa::new(base), 256 * PAGE_SIZE, m.range(PAGE_SIZE), LOG)
        .unwrap();
    for p in 0..64u64 {
        assert!(!v.dirty_ring_full(), "soft full after {p} entries");
        write_new(&vm, &mut v, base + p * PAGE_SIZE);
    }
    assert!(v.dirty_ring_full(), "not soft full at 64 of 128 entries");
    // A write fix needs room for two entries (the one it pushes before making the page
    // writable, and another if a harvest takes that one meanwhile): the last stays free.
    for p in 64..127u64 {
        write_new(&vm, &mut v, base + p * PAGE_SIZE);
    }
    assert_eq!(v.dirty_ring().unwrap().used(), 127);
    assert_eq!(
        fault(&vm, &mut v, base + 127 * PAGE_SIZE, Access::Write, false),
        FaultOutcome::DirtyRingFull,
        "a write fix with room for one entry"
    );
    // Page 128 mapped read-only first (no push), then written: the ring has no room.
    let gpa = base + 128 * PAGE_SIZE;
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Read, false),
        FaultOutcome::Fixed
    );
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, true),
        FaultOutcome::DirtyRingFull,
        "write to a protected page with the ring full"
    );
    assert!(
        !writable(&vm, gpa),
        "ring full but the page became writable"
    );
    // An unmapped page: not mapped writable either.
    let gpa2 = base + 129 * PAGE_SIZE;
    assert_eq!(
        fault(&vm, &mut v, gpa2, Access::Write, false),
        FaultOutcome::DirtyRingFull,
        "first write with the ring full"
    );
    assert!(
        !writable(&vm, gpa2),
        "ring full but page 129 became writable"
    );
    assert!(vm.stats().pf_ring_full >= 2, "pf_ring_full not counted");
    assert_eq!(v.dirty_ring().unwrap().used(), 127, "ring overflowed");

    // Harvest + reset frees the ring; the write then succeeds.
    let got = harvest(&v);
    assert_eq!(got, (0..127u64).map(|p| (1, p)).collect::<Vec<_>>());
    assert_eq!(vm.reset_dirty_rings(), Ok(127));
    assert!(!v.dirty_ring_full(), "still soft full after reset");
    assert_eq!(
        fault(&vm, &mut v, gpa, Access::Write, true),
        FaultOutcome::FixedFast,
        "retry after reset"
    );
    assert!(writable(&vm, gpa));
    assert_eq!(
        fault(&vm, &mut v, gpa2, Access::Write, false),
        FaultOutcome::Fixed
    );
    assert_eq!(harvest(&v), vec![(1, 128), (1, 129)]);
    check_audit(&vm, "ring full");
    teardown(vm, [v]);
    drop(m);
}

fn slots_deleted_or_moved_while_logging<F: PteFormat>() {
    each_wrprot(slots_deleted_or_moved_while_logging_one::<F>)
}

fn slots_deleted_or_moved_while_logging_one<F: PteFormat>() {
    // Bitmap mode.
    {
        let vm = Vm::<F>::new(config());
        let alloc = slat::hw::table_alloc(&vm).clone();
        let mut v = vm.create_vcpu(0);
        let m1 = HostMem::new(128 * PAGE_SIZE);
        let m2 = HostMem::new(128 * PAGE_SIZE);
        vm.add_memslot(1, Gpa::new(MIB), 128 * PAGE_SIZE, m1.range(PAGE_SIZE), LOG)
            .unwrap();
        vm.add_memslot(
            2,
            Gpa::new(4 * MIB),
            128 * PAGE_SIZE,
            m2.range(PAGE_SIZE),
            LOG,
        )
        .unwrap();
        for p in [1u64, 50, 127] {
            write_new(&vm, &mut v, MIB + p * PAGE_SIZE);
            write_new(&vm, &mut v, 4 * MIB + p * PAGE_SIZE);
        }
        vm.delete_memslot(1).unwrap();
        let mut words = [0u64; 2];
        assert_eq!(
            vm.get_dirty_log(1, &mut words),
            Err(DirtyLogError::UnknownSlot { id: 1 })
        );
        assert_eq!(
            vm.lookup(Gfn::new((MIB >> PAGE_SHIFT) + 1)),
            None,
            "deleted slot mapped"
        );
        // Move slot 2: the log survives the move (as in KVM: its bits are slot-relative, and
        // pages written before the move and not yet harvested are still owed), and the old
        // range is unmapped.
        vm.move_memslot(2, Gpa::new(8 * MIB)).unwrap();
        assert_eq!(
            dirty_pages(&vm, 2),
            vec![1, 50, 127],
            "moved slot lost the unharvested part of its log"
        );
        assert_eq!(
            vm.lookup(Gfn::new(((4 * MIB) >> PAGE_SHIFT) + 1)),
            None,
            "old range mapped"
        );
        write_new(&vm, &mut v, 8 * MIB + 9 * PAGE_SIZE);
        assert_eq!(
            dirty_pages(&vm, 2),
            vec![9],
            "moved slot logs at its new place"
        );
        assert!(!writable(&vm, 8 * MIB + 9 * PAGE_SIZE));
        check_audit(&vm, "deleted (bitmap)");
        drop(v);
        assert_eq!(Arc::strong_count(&vm), 1);
        drop(vm);
        wait_for_reclaim(&alloc, 0);
        assert_eq!(alloc.live_pages(), 0, "table pages leaked");
        drop((m1, m2));
    }

    // Ring mode.
    let vm = Vm::<F>::new(config());
    vm.enable_dirty_ring(128, false).unwrap();
    let mut v = vm.create_vcpu(0);
    let m1 = HostMem::new(64 * PAGE_SIZE);
    let m2 = HostMem::new(64 * PAGE_SIZE);
    vm.add_memslot(1, Gpa::new(MIB), 64 * PAGE_SIZE, m1.range(PAGE_SIZE), LOG)
        .unwrap();
    vm.add_memslot(
        2,
        Gpa::new(4 * MIB),
        64 * PAGE_SIZE,
        m2.range(PAGE_SIZE),
        LOG,
    )
    .unwrap();
    for p in 0..6u64 {
        write_new(&vm, &mut v, MIB + p * PAGE_SIZE);
    }
    for p in [10u64, 20, 30] {
        write_new(&vm, &mut v, 4 * MIB + p * PAGE_SIZE);
    }
    write_new(&vm, &mut v, MIB + 40 * PAGE_SIZE);
    vm.delete_memslot(1).unwrap();
    let got = harvest(&v);
    assert_eq!(got.len(), 10, "harvest after delete: {got:?}");
    assert_eq!(got.iter().filter(|e| e.0 == 1).count(), 7);
    assert_eq!(
        vm.reset_dirty_rings(),
        Ok(10),
        "reset counts entries of the deleted slot too"
    );
    assert_eq!(v.dirty_ring().unwrap().used(), 0);
    for p in [10u64, 20, 30] {
        assert!(
            !writable(&vm, 4 * MIB + p * PAGE_SIZE),
            "page {p} of the live slot not re-protected"
        );
    }

    // A stale entry for an id re-used by a smaller slot (offset beyond it): dropped, no panic.
    write_protected(&vm, &mut v, 4 * MIB + 10 * PAGE_SIZE);
    assert_eq!(harvest(&v), vec![(2, 10)]);
    vm.delete_memslot(2).unwrap();
    vm.add_memslot(
        2,
        Gpa::new(4 * MIB),
        4 * PAGE_SIZE,
        m2.range(PAGE_SIZE),
        LOG,
    )
    .unwrap();
    assert_eq!(vm.reset_dirty_rings(), Ok(1), "reset of a stale entry");
    assert_eq!(v.dirty_ring().unwrap().used(), 0);
    write_new(&vm, &mut v, 4 * MIB + PAGE_SIZE);
    check_audit(&vm, "deleted (ring)");
    teardown(vm, [v]);
    drop((m1, m2));
}

/// A 4 MiB slot at 4 MiB with 2 MiB host pages and both halves mapped by huge leaves; logging is
/// turned on, a few pages written, logging turned off. Returns the VM, vCPU, memory and the
/// table count before logging.
fn huge_log_cycle<F: PteFormat>(config: VmConfig) -> (Arc<Vm<F>>, Vcpu<F>, HostMem, u64) {
    let vm = Vm::<F>::new(config);
    let mut v = vm.create_vcpu(0);
    let base = 4 * MIB;
    let m = HostMem::new(4 * MIB);
    vm.add_memslot(
        1,
        Gpa::new(base),
        4 * MIB,
        m.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    write_new(&vm, &mut v, base + 0x3000);
    write_new(&vm, &mut v, base + HUGE_2M + 0x7000);
    let s0 = vm.stats();
    assert_eq!(s0.leaves_2m, 2, "two huge leaves before logging");
    vm.set_memslot_flags(1, LOG).unwrap();
    let s1 = vm.stats();
    assert_eq!(s1.leaves_2m, 0, "eager split left huge leaves");
    assert_eq!(s1.leaves_4k, 1024, "split leaves");
    assert!(s1.splits >= 2, "splits {}", s1.splits);
    assert_eq!(s1.table_pages, s0.table_pages + 2);
    for gpa in [base + 0x3000, base + 0x9000, base + HUGE_2M + 0x7000] {
        write_protected(&vm, &mut v, gpa);
    }
    let mut words = vec![0u64; 16];
    assert_eq!(vm.get_dirty_log(1, &mut words), Ok(3));
    write_protected(&vm, &mut v, base + 0x9000);
    vm.set_memslot_flags(1, MemslotFlags::empty()).unwrap();
    (vm, v, m, s0.table_pages)
}

fn huge_pages_recovered_in_place_or_zapped<F: PteFormat>() {
    each_wrprot(huge_pages_recovered_in_place_or_zapped_one::<F>)
}

fn huge_pages_recovered_in_place_or_zapped_one<F: PteFormat>() {
    let base = 4 * MIB;
    let (vm, v, m, tables) = huge_log_cycle::<F>(config());
    let s = vm.stats();
    assert!(s.recoveries >= 2, "recoveries {}", s.recoveries);
    assert_eq!(s.leaves_2m, 2, "huge leaves not back: {s:?}");
    assert_eq!(s.leaves_4k, 0, "4 KiB leaves left: {s:?}");
    assert_eq!(
        s.table_pages, tables,
        "table pages not back to before logging"
    );
    for (gpa, off) in [
        (base + 0x3000, 0x3000),
        (base + HUGE_2M + 0x7000, HUGE_2M + 0x7000),
    ] {
        let (l, lvl) = leaf(&vm, gpa);
        assert_eq!(lvl, 2, "gpa {gpa:#x} not mapped huge after recovery");
        assert_eq!(
            leaf_hva::<F>(l, lvl, gpa >> PAGE_SHIFT),
            m.addr() + off,
            "recovered leaf translates gpa {gpa:#x} wrongly"
        );
        check_write_chain::<F>(l, "recovered");
    }
    check_audit(&vm, "recovered in place");
    teardown(vm, [v]);
    drop(m);

    let (vm, v, m, _) = huge_log_cycle::<F>(VmConfig {
        recover: slat::RecoverVariant::Zap,
        ..config()
    });
    let s = vm.stats();
    assert_eq!(s.recoveries, 0, "zap variant recovered in place");
    assert_eq!((s.leaves_4k, s.leaves_2m), (0, 0), "zap left leaves: {s:?}");
    assert_eq!(vm.lookup(Gpa::new(base).gfn()), None, "zap left a mapping");
    assert_eq!(vm.lookup(Gfn::new((base + HUGE_2M) >> PAGE_SHIFT)), None);
    check_audit(&vm, "zapped");
    // The next fault maps huge again.
    let mut v = v;
    write_new(&vm, &mut v, base + 0x3000);
    assert_eq!(leaf(&vm, base + 0x3000).1, 2, "fault after zap not huge");
    teardown(vm, [v]);
    drop(m);
}
