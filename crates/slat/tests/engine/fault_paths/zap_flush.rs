//! Zaps, remote flushes and table bookkeeping, out-of-range requests, the mutex lock variant,
//! and faults racing with enabling dirty logging.

use super::*;

pub(crate) fn zap_flushes_remote_tlbs_frees_tables_and_an_empty_zap_flushes_nothing<
    F: PteFormat,
>() {
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

pub(crate) fn zap_of_a_straddling_huge_leaf_removes_the_whole_leaf<F: PteFormat>() {
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
pub(crate) fn low_pages_mapped<F: PteFormat>() -> (Arc<Vm<F>>, Vcpu<F>, HostMem) {
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
pub(crate) const GFN_LIMIT: u64 = 1 << (48 - PAGE_SHIFT);

pub(crate) fn lookup_beyond_the_guest_physical_width_finds_nothing<F: PteFormat>() {
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

pub(crate) fn zap_beyond_the_guest_physical_width_touches_nothing<F: PteFormat>() {
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

pub(crate) fn remote_flush_waits_for_an_in_guest_vcpu_to_acknowledge<F: PteFormat>() {
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

pub(crate) fn table_pages_live_covers_linked_tables_and_vcpu_caches<F: PteFormat>() {
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

pub(crate) fn mutex_variant_faults_zaps_and_logs<F: PteFormat>() {
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
pub(crate) fn faults_racing_with_enable_logging_never_leave_huge_leaves<F: PteFormat>() {
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
