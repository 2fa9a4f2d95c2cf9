//! Capability errors and the per-vCPU dirty ring: push, harvest, reset, and a full ring.

use super::*;

pub(crate) fn capability_errors<F: PteFormat>() {
    each_wrprot(capability_errors_one::<F>)
}

pub(crate) fn capability_errors_one<F: PteFormat>() {
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

    ring_after_a_vcpu_exists_is_refused::<F>();
    ring_with_a_bitmap_keeps_get::<F>(&m);
    drop(m);
}

/// Ring after a vCPU exists: refused, and the vCPU has no ring.
fn ring_after_a_vcpu_exists_is_refused<F: PteFormat>() {
    let vm = Vm::<F>::new(config());
    let v = vm.create_vcpu(0);
    assert!(v.dirty_ring().is_none());
    assert_eq!(
        vm.enable_dirty_ring(128, false),
        Err(DirtyLogError::VcpusExist { vcpus: 1 })
    );
    assert!(!v.dirty_ring_full());
    teardown(vm, [v]);
}

/// Ring with a bitmap: GET works next to the ring.
fn ring_with_a_bitmap_keeps_get<F: PteFormat>(m: &HostMem) {
    let vm = Vm::<F>::new(config());
    assert_eq!(vm.enable_dirty_ring(65536, true), Ok(()));
    vm.add_memslot(3, Gpa::new(MIB), 64 * PAGE_SIZE, m.range(PAGE_SIZE), LOG)
        .unwrap();
    assert_eq!(vm.mark_page_dirty(Gpa::new(MIB + 2 * PAGE_SIZE)), Ok(true));
    assert_eq!(dirty_pages(&vm, 3), vec![2], "ring-with-bitmap GET");
    teardown(vm, std::iter::empty());
}

pub(crate) fn ring_push_harvest_reset<F: PteFormat>() {
    each_wrprot(ring_push_harvest_reset_one::<F>)
}

pub(crate) fn ring_push_harvest_reset_one<F: PteFormat>() {
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

pub(crate) fn ring_full_refuses_the_write_until_reset<F: PteFormat>() {
    each_wrprot(ring_full_refuses_the_write_until_reset_one::<F>)
}

pub(crate) fn ring_full_refuses_the_write_until_reset_one<F: PteFormat>() {
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
