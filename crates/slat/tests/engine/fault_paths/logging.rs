//! Dirty logging on the fault path: eager and lazy splits, the fast path, GET re-protection,
//! huge leaves coming back when logging stops, and the table cost of 4 KiB mappings.

use super::*;

/// Enables logging on a slot holding two writable 2 MiB leaves and checks the eager split.
pub(crate) fn logged_two_huge_leaves<F: PteFormat>(
    config: VmConfig,
) -> (Arc<Vm<F>>, Vcpu<F>, HostMem, u64) {
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

pub(crate) fn enabling_dirty_logging_splits_write_protects_and_the_fast_path_logs<F: PteFormat>() {
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

pub(crate) fn without_the_fast_path_the_slow_path_fixes_and_logs<F: PteFormat>() {
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

pub(crate) fn get_dirty_log_reprotects_exactly_the_returned_pages<F: PteFormat>() {
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
    check_exactly_written_reprotected::<F>(&before, &after, &written);
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

/// The harvest write-protected exactly the written pages (same level, W cleared, MMU-writable
/// kept) and changed no other leaf.
fn check_exactly_written_reprotected<F: PteFormat>(
    before: &[Option<(u64, Level)>],
    after: &[Option<(u64, Level)>],
    written: &[u64],
) {
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
}

pub(crate) fn read_fault_in_logged_slot_leaves_the_first_write_to_the_fast_path<F: PteFormat>() {
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

pub(crate) fn read_then_write_in_logged_slot_is_logged<F: PteFormat>() {
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

pub(crate) fn lazy_split_write_protects_huge_leaves_and_splits_on_the_first_write<F: PteFormat>() {
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

pub(crate) fn disabling_dirty_logging_brings_huge_leaves_back<F: PteFormat>() {
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

pub(crate) fn enabling_logging_splits_1g_leaves_down_to_4k<F: PteFormat>() {
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

pub(crate) fn one_gib_mapped_at_4k_needs_at_most_2_1_mib_of_tables<F: PteFormat>() {
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
