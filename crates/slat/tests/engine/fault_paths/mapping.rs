//! Faults and leaf sizes: spurious faults, faults outside every slot, read-only slots, and the
//! host-page and alignment conditions for 2 MiB and 1 GiB leaves.

use super::*;

pub(crate) fn second_vcpu_faulting_the_same_page_is_spurious<F: PteFormat>() {
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

pub(crate) fn faults_outside_every_slot_are_no_slot_and_map_nothing<F: PteFormat>() {
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

pub(crate) fn readonly_slot_maps_reads_without_write_permission_and_refuses_writes<F: PteFormat>() {
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

    readonly_changes_take_a_delete_and_readd(&vm, &mut v, &mem, base, gpa);
    check_audit(&vm, "read-only slot");
    teardown(vm, [v]);
}

/// READONLY changes on slot 7 (`base`, read-only, `gpa` mapped): a delete and re-add without
/// it lets writes through; setting it is refused; a delete and re-add with it protects again.
fn readonly_changes_take_a_delete_and_readd<F: PteFormat>(
    vm: &Vm<F>,
    v: &mut Vcpu<F>,
    mem: &HostMem,
    base: u64,
    gpa: u64,
) {
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
    assert_eq!(fault(vm, v, gpa, Access::Write, false), FaultOutcome::Fixed);
    let (leaf, level) = expect_mapped(vm, gpa, mem.addr() + 0x3000);
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
        fault(vm, v, gpa, Access::Write, false),
        FaultOutcome::ReadOnly
    );
}

pub(crate) fn two_mib_leaves_need_2m_host_pages_and_congruent_addresses<F: PteFormat>() {
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

pub(crate) fn slot_edges_limit_huge_leaves<F: PteFormat>() {
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

pub(crate) fn one_gib_leaves_for_1g_host_pages<F: PteFormat>() {
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
