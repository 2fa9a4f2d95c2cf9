//! Aging and idle-page tracking one operation at a time: every hardware mode and leaf size,
//! flush behaviour, dirty-log interplay, idle-bitmap bookkeeping and range checks.

use super::*;

pub(crate) fn age_and_test_age_with_ad_bits_at_every_leaf_size<F: PteFormat>() {
    for level in [1u8, 2, 3] {
        let (vm, _mem, gpa, _) = vm_with_leaf_size::<F>(true, level);
        let mut cpu = HwCpu::new(&vm, 0);
        cpu.access(gpa, Access::Write);
        let (l0, lv) = leaf(&vm, gpa);
        assert_eq!(lv, level);
        let pages = pages_per_entry(level);
        let (g0, g1) = (gpa >> PAGE_SHIFT, (gpa >> PAGE_SHIFT) + pages);
        assert!(
            F::is_accessed(l0) && d_bit::<F>(l0),
            "level {level}: fresh leaf {l0:#x}"
        );

        // Testing does not clear: twice young, leaf unchanged.
        for _ in 0..2 {
            let t = vm.test_young(Gfn::new(g0), Gfn::new(g1));
            assert_eq!(
                (t.young_pages, t.young_leaves, t.aged_leaves),
                (pages, 1, 0)
            );
            assert_eq!(t.mapped_pages, pages);
            assert_eq!(
                leaf(&vm, gpa).0,
                l0,
                "level {level}: test_young changed the leaf"
            );
        }

        let mut dirty = Vec::new();
        let r = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |g, n| dirty.push((g, n)));
        assert_eq!(
            (r.young_pages, r.aged_leaves, r.dirty_pages),
            (pages, 1, pages)
        );
        assert!(!r.flushed);
        assert_eq!(
            dirty,
            vec![(Gfn::new(g0), pages)],
            "level {level}: dirty leaf not reported"
        );
        let (l1, _) = leaf(&vm, gpa);
        assert!(!F::is_accessed(l1), "level {level}: A still set: {l1:#x}");
        assert!(d_bit::<F>(l1), "level {level}: aging cleared D: {l1:#x}");
        assert!(
            F::permits(l1, Access::Write),
            "A/D mode must keep permissions"
        );
        assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, 0);
        // Aging an old leaf changes nothing.
        let again = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |_, _| {
            panic!("old leaf reported dirty")
        });
        assert_eq!((again.young_pages, again.aged_leaves), (0, 0));

        // The hardware walker sets A again on a read anywhere in the leaf; no fault.
        let faults = cpu.faults;
        cpu.access(gpa + (pages - 1) * PAGE_SIZE, Access::Read);
        assert_eq!(
            cpu.faults, faults,
            "an A/D-mode access to an aged leaf faulted"
        );
        assert!(F::is_accessed(leaf(&vm, gpa).0));
        assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, pages);
        check_audit(&vm, "ad aging");
        teardown(vm, [cpu.finish()]);
    }
}

pub(crate) fn age_and_test_age_without_ad_bits_at_every_leaf_size<F: PteFormat>() {
    for level in [1u8, 2, 3] {
        for first in [Access::Read, Access::Write] {
            let ctx = format!("level {level}, {first:?} after aging");
            let (vm, _mem, gpa, _) = vm_with_leaf_size::<F>(false, level);
            let mut cpu = HwCpu::new(&vm, 0);
            cpu.access(gpa, Access::Write);
            let (l0, _) = leaf(&vm, gpa);
            let pages = pages_per_entry(level);
            let (g0, g1) = (gpa >> PAGE_SHIFT, (gpa >> PAGE_SHIFT) + pages);
            assert!(F::is_writable(l0) && F::is_accessed(l0));
            let t = vm.test_young(Gfn::new(g0), Gfn::new(g1));
            assert_eq!((t.young_pages, t.aged_leaves), (pages, 0));
            assert_eq!(leaf(&vm, gpa).0, l0, "{ctx}: test_young changed the leaf");

            // A writable leaf is dirty: reported before aging (which drops W on EPT).
            let mut dirty = Vec::new();
            let r = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |g, n| dirty.push((g, n)));
            assert_eq!((r.aged_leaves, r.dirty_pages), (1, pages), "{ctx}");
            assert_eq!(
                dirty,
                vec![(Gfn::new(g0), pages)],
                "{ctx}: the dirty page was dropped"
            );
            let (l1, lv1) = leaf(&vm, gpa);
            assert_eq!(lv1, level);
            assert!(
                F::is_present(l1) && F::is_access_tracked(l1),
                "{ctx}: {l1:#x}"
            );
            for a in [Access::Read, Access::Write, Access::Exec] {
                assert!(!F::permits(l1, a), "{ctx}: tracked leaf permits {a:?}");
            }
            assert_eq!(F::output_addr(l1), F::output_addr(l0));
            assert!(F::is_mmu_writable(l1), "{ctx}: aging lost MMU-writable");
            assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, 0);
            assert_eq!(
                vm.stats().leaves_4k + vm.stats().leaves_2m + vm.stats().leaves_1g,
                1
            );

            // The next access faults; the fast path restores without the MMU lock.
            let fast = cpu.fast;
            cpu.access(gpa + (pages - 1) * PAGE_SIZE, first);
            assert_eq!(cpu.fast, fast + 1, "{ctx}: not fixed by the fast path");
            let (l2, _) = leaf(&vm, gpa);
            assert!(!F::is_access_tracked(l2), "{ctx}: {l2:#x}");
            assert!(F::permits(l2, Access::Read));
            // Format difference: stage-2 maps X only for an instruction fetch (an executable
            // mapping costs an instruction-cache invalidation), and this leaf was mapped by a
            // write; EPT maps guest RAM executable up front.
            assert_eq!(
                F::permits(l2, Access::Exec),
                !F::CACHE_MAINTENANCE,
                "{ctx}: X after restore {l2:#x}"
            );
            // Format difference: EPT access tracking parks R/X in software bits and drops W,
            // which only a write brings back; stage-2 access tracking clears only AF, so the
            // restore gives back the writable leaf it aged.
            let writable = first == Access::Write || !is_ept::<F>();
            if !is_ept::<F>() {
                assert_eq!(l2, l0, "{ctx}: restore is not the leaf that was aged");
            }
            assert_eq!(
                F::is_writable(l2),
                writable,
                "{ctx}: W after restore {l2:#x}"
            );
            assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, pages);
            // A read-restored leaf is clean (not writable): the next aging reports nothing
            // dirty.
            let r = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |_, _| {});
            assert_eq!(r.dirty_pages, if writable { pages } else { 0 }, "{ctx}");
            check_audit(&vm, &ctx);
            teardown(vm, [cpu.finish()]);
        }
    }
}

pub(crate) fn without_the_fast_path_the_slow_path_restores_tracked_leaves<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig {
        ad_bits: false,
        fast_pf: false,
        ..VmConfig::default()
    });
    let mem = HostMem::new(8 * PAGE_SIZE);
    let gpa = 0x10_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        mem.len(),
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut cpu = HwCpu::new(&vm, 0);
    cpu.access(gpa, Access::Write);
    let g = gpa >> PAGE_SHIFT;
    assert_eq!(
        vm.clear_young(Gfn::new(g), Gfn::new(g + 8), |_, _| {})
            .aged_leaves,
        1
    );
    let before = vm.stats().pf_fixed;
    cpu.access(gpa, Access::Write);
    assert_eq!(cpu.fast, 0);
    assert_eq!(
        vm.stats().pf_fixed,
        before + 1,
        "the slow path did not fix it"
    );
    let (l, _) = leaf(&vm, gpa);
    assert!(F::is_writable(l) && F::is_accessed(l));
    check_audit(&vm, "slow restore");
    teardown(vm, [cpu.finish()]);
}

pub(crate) fn huge_leaf_straddling_the_range_counts_only_pages_inside<F: PteFormat>() {
    for ad in [true, false] {
        let (vm, _mem, gpa, _) = vm_with_leaf_size::<F>(ad, 2);
        let mut cpu = HwCpu::new(&vm, 0);
        cpu.access(gpa, Access::Read);
        let g = gpa >> PAGE_SHIFT;
        // 100 pages from the middle of the 2 MiB leaf: the whole leaf ages (one Accessed
        // state), only the 100 pages count as young, but the dirty report covers the whole
        // leaf (its W, without A/D bits, is gone for all 512 pages).
        let mut dirty = Vec::new();
        let r = vm.clear_young(Gfn::new(g + 300), Gfn::new(g + 400), |f, n| {
            dirty.push((f, n))
        });
        assert_eq!(
            dirty,
            vec![(Gfn::new(g), 512)],
            "ad {ad}: dirty report of a straddling leaf"
        );
        assert_eq!(r.dirty_pages, 512);
        assert_eq!(
            (r.young_pages, r.mapped_pages, r.aged_leaves),
            (100, 100, 1)
        );
        assert_eq!(
            vm.test_young(Gfn::new(g), Gfn::new(g + 512)).young_pages,
            0,
            "ad {ad}"
        );
        // A range across chunk edges and beyond the slot still sees the leaf once.
        cpu.access(gpa, Access::Read);
        let r = vm.test_young(
            Gfn::new(g.saturating_sub(5 * slat::AGE_CHUNK_PAGES)),
            Gfn::new(g + 1024),
        );
        assert_eq!((r.young_leaves, r.young_pages), (1, 512), "ad {ad}");
        teardown(vm, [cpu.finish()]);
    }
}

pub(crate) fn clear_flush_young_flushes_and_clear_young_does_not<F: PteFormat>() {
    for ad in [true, false] {
        let vm = Vm::<F>::new(config(ad));
        let mem = HostMem::new(16 * PAGE_SIZE);
        let gpa = 0x20_0000;
        vm.add_memslot(
            1,
            Gpa::new(gpa),
            mem.len(),
            mem.range(PAGE_SIZE),
            MemslotFlags::empty(),
        )
        .unwrap();
        let mut cpu = HwCpu::new(&vm, 0);
        let g = gpa >> PAGE_SHIFT;
        for p in 0..16 {
            cpu.access(gpa + p * PAGE_SIZE, Access::Write);
        }
        let req = |vm: &Vm<F>| vm.stats().remote_tlb_flush_requests;
        // Without A/D bits this clears W on 16 writable leaves (EPT), which would owe a flush
        // anywhere else: clear_young still does not flush.
        let r0 = req(&vm);
        let r = vm.clear_young(Gfn::new(g), Gfn::new(g + 16), |_, _| {});
        assert_eq!(r.aged_leaves, 16);
        assert_eq!(req(&vm), r0, "ad {ad}: clear_young flushed");
        for p in 0..16 {
            cpu.access(gpa + p * PAGE_SIZE, Access::Read);
        }
        let r = vm
            .clear_flush_young(Gfn::new(g), Gfn::new(g + 16), |_, _| {})
            .unwrap();
        assert!(r.flushed && r.aged_leaves == 16);
        assert_eq!(
            req(&vm),
            r0 + 1,
            "ad {ad}: clear_flush_young did not flush once"
        );
        // Nothing young but something mapped: still one flush (translations cached since
        // the clear_young above must not survive).
        let r = vm
            .clear_flush_young(Gfn::new(g), Gfn::new(g + 16), |_, _| {})
            .unwrap();
        assert!(r.flushed && r.aged_leaves == 0);
        assert_eq!(req(&vm), r0 + 2);
        // Nothing mapped: nothing to flush.
        let r = vm
            .clear_flush_young(Gfn::new(g + 16), Gfn::new(g + 1024), |_, _| {})
            .unwrap();
        assert!(!r.flushed && r.mapped_pages == 0);
        assert_eq!(req(&vm), r0 + 2);
        teardown(vm, [cpu.finish()]);
    }
}

pub(crate) fn aging_a_logged_slot_keeps_every_dirty_page_in_the_log<F: PteFormat>() {
    for ad in [true, false] {
        let vm = Vm::<F>::new(config(ad));
        let mem = HostMem::new(64 * PAGE_SIZE);
        let gpa = 0x40_0000;
        let npages = 64;
        vm.add_memslot(1, Gpa::new(gpa), mem.len(), mem.range(PAGE_SIZE), LOG)
            .unwrap();
        let g = gpa >> PAGE_SHIFT;
        let mut cpu = HwCpu::new(&vm, 0);
        let harvest = |vm: &Vm<F>| {
            let mut w = vec![0u64; 1];
            vm.get_dirty_log(1, &mut w).unwrap();
            bitmap_gfns(g, &w)
        };
        // Write the even pages, read the odd ones.
        for p in 0..npages {
            let a = if p % 2 == 0 {
                Access::Write
            } else {
                Access::Read
            };
            cpu.access(gpa + p * PAGE_SIZE, a);
        }
        let mut reported = HashSet::new();
        let r = vm.clear_young(Gfn::new(g), Gfn::new(g + npages), |first, n| {
            reported.extend(first.raw()..first.raw() + n);
        });
        assert_eq!(r.aged_leaves, npages, "ad {ad}");
        let evens: HashSet<u64> = (0..npages).filter(|p| p % 2 == 0).map(|p| g + p).collect();
        if ad {
            // D is "may have been written": the slow path pre-sets it on every leaf it builds
            // MMU-writable, the read-only leaves of a logged slot included (a read fault there
            // is write_protect(make_leaf(writable))), so the report may over-approximate.
            assert!(
                reported.is_superset(&evens),
                "ad: a written page was not reported dirty"
            );
        } else {
            // Without A/D bits, dirty is W, which only writes set: exact.
            assert_eq!(
                reported, evens,
                "dirty report differs from the pages written"
            );
        }
        // Aging neither consumed nor added log marks.
        let h: HashSet<u64> = harvest(&vm).into_iter().collect();
        assert_eq!(
            h, evens,
            "ad {ad}: the log lost or gained pages through aging"
        );
        // After the harvest, write every page: each write after aging is logged again.
        vm.clear_young(Gfn::new(g), Gfn::new(g + npages), |_, _| {});
        for p in 0..npages {
            cpu.access(gpa + p * PAGE_SIZE, Access::Write);
        }
        let h = harvest(&vm);
        assert_eq!(
            h.len() as u64,
            npages,
            "ad {ad}: writes after aging were not logged"
        );
        for p in 0..npages {
            check_write_chain::<F>(leaf(&vm, gpa + p * PAGE_SIZE).0, "logged");
        }
        check_audit(&vm, "logged aging");
        teardown(vm, [cpu.finish()]);
    }
}

pub(crate) fn idle_bitmap_tracks_exactly_the_pages_touched_since_marking<F: PteFormat>() {
    let seed = seed_from_env(0xa6e1);
    eprintln!("seed {seed:#x} (SLAT_TEST_SEED reruns it)");
    for ad in [true, false] {
        let vm = Vm::<F>::new(config(ad));
        // 200 pages, not a multiple of 64; the last 20 never mapped.
        let npages = 200u64;
        let mem = HostMem::new(npages * PAGE_SIZE);
        let gpa = 0x80_0000;
        vm.add_memslot(
            1,
            Gpa::new(gpa),
            npages * PAGE_SIZE,
            mem.range(PAGE_SIZE),
            MemslotFlags::empty(),
        )
        .unwrap();
        let g = gpa >> PAGE_SHIFT;
        let mut cpu = HwCpu::new(&vm, 0);
        for p in 0..180 {
            cpu.access(gpa + p * PAGE_SIZE, Access::Write);
        }
        let mut b = IdleBitmap::new::<F>(Gfn::new(g), npages).unwrap();
        assert_eq!(b.idle_pages(), 0);
        // Flush, so the test's TLB-less vCPU and a real one would agree.
        let r = vm
            .mark_idle(&mut b, AgeFlush::Flush, |_, _| {})
            .expect("host thread");
        assert_eq!(r.aged_leaves, 180);
        assert_eq!(b.idle_pages(), npages);
        assert_eq!(
            vm.read_idle(&mut b),
            npages,
            "ad {ad}: nothing was accessed yet"
        );
        let mut rng = Rng::new(seed ^ ad as u64);
        let mut touched = HashSet::new();
        for _ in 0..120 {
            let p = rng.below(npages);
            let a = *rng.pick(&[Access::Read, Access::Write]);
            cpu.access(gpa + p * PAGE_SIZE, a);
            touched.insert(p);
        }
        let idle = vm.read_idle(&mut b);
        assert_eq!(
            idle,
            npages - touched.len() as u64,
            "ad {ad} seed {seed:#x}"
        );
        for p in 0..npages {
            assert_eq!(
                b.is_idle(Gfn::new(g + p)),
                Some(!touched.contains(&p)),
                "ad {ad} seed {seed:#x}: page {p}"
            );
        }
        assert_eq!(b.is_idle(Gfn::new(g + npages)), None);
        assert_eq!(b.is_idle(Gfn::new(g - 1)), None);
        // Reading changes nothing.
        assert_eq!(vm.read_idle(&mut b), idle);
        let ws = vm.working_set(&mut b);
        assert_eq!(ws.touched_pages, touched.len() as u64);
        assert!((ws.fraction() - touched.len() as f64 / npages as f64).abs() < 1e-12);
        // Marking again makes everything idle again.
        vm.mark_idle(&mut b, AgeFlush::NoFlush, |_, _| {})
            .expect("host thread");
        assert_eq!(vm.read_idle(&mut b), npages);
        teardown(vm, [cpu.finish()]);
    }
}

pub(crate) fn idle_bitmap_rejects_bad_ranges<F: PteFormat>() {
    assert_eq!(IdleBitmap::new::<F>(Gfn::new(0), 0), Err(IdleError::Empty));
    let max = 1u64 << (48 - 12);
    assert!(matches!(
        IdleBitmap::new::<F>(Gfn::new(max - 1), 2),
        Err(IdleError::OutOfRange { .. })
    ));
    assert!(matches!(
        IdleBitmap::new::<F>(Gfn::new(u64::MAX), 1),
        Err(IdleError::OutOfRange { .. })
    ));
    assert!(IdleBitmap::new::<F>(Gfn::new(max - 1), 1).is_ok());
    // Aging ranges beyond the format, empty or reversed, are no-ops, not panics.
    let vm = Vm::<F>::new(VmConfig::default());
    assert_eq!(
        vm.clear_young(Gfn::new(u64::MAX - 5), Gfn::new(u64::MAX), |_, _| {})
            .mapped_pages,
        0
    );
    assert_eq!(vm.test_young(Gfn::new(10), Gfn::new(5)).mapped_pages, 0);
    assert_eq!(
        vm.clear_flush_young(Gfn::new(0), Gfn::new(max), |_, _| {})
            .unwrap()
            .aged_leaves,
        0
    );
}
