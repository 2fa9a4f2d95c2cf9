//! Slots deleted or moved while logging, and huge-page recovery when logging stops.

use super::*;

pub(crate) fn slots_deleted_or_moved_while_logging<F: PteFormat>() {
    each_wrprot(slots_deleted_or_moved_while_logging_one::<F>)
}

pub(crate) fn slots_deleted_or_moved_while_logging_one<F: PteFormat>() {
    slots_deleted_or_moved_while_bitmap_logging::<F>();
    slots_deleted_while_ring_logging::<F>();
}

/// Bitmap mode: a deleted slot has no log and no mappings; a moved slot keeps its log and
/// logs at its new place; nothing leaks.
fn slots_deleted_or_moved_while_bitmap_logging<F: PteFormat>() {
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

/// Ring mode: entries of a deleted slot are harvested and reset, and a stale entry for a
/// re-used id is dropped.
fn slots_deleted_while_ring_logging<F: PteFormat>() {
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
pub(crate) fn huge_log_cycle<F: PteFormat>(
    config: VmConfig,
) -> (Arc<Vm<F>>, Vcpu<F>, HostMem, u64) {
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

pub(crate) fn huge_pages_recovered_in_place_or_zapped<F: PteFormat>() {
    each_wrprot(huge_pages_recovered_in_place_or_zapped_one::<F>)
}

pub(crate) fn huge_pages_recovered_in_place_or_zapped_one<F: PteFormat>() {
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
