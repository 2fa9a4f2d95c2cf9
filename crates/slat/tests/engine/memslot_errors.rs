//! Every memslot error, by kind, and "bad input loses nothing": after each refused request the
//! published slot set (generation and contents) and the mappings are exactly as before.
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::dirty::DirtyLogError;
use slat::{
    Access, Fault, FaultOutcome, HostRange, MemslotError, MemslotFlags, PteFormat, Vcpu, Vm,
    VmConfig,
};
use slat_addr::{Gfn, Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use std::sync::Arc;

const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;
const RO: MemslotFlags = MemslotFlags::READONLY;
const MIB: u64 = 1 << 20;

both_formats! {
    overlapping_ranges_are_refused_and_touching_ones_accepted,
    misaligned_guest_address_size_and_host_address,
    zero_size_is_refused,
    ranges_beyond_48_bits_are_refused_and_the_last_page_is_usable,
    unknown_flag_bits_are_refused,
    unknown_slot_for_delete_move_set_flags_and_get_dirty_log,
    duplicate_ids_are_refused,
    host_range_shorter_than_the_slot_is_refused,
    host_page_sizes_other_than_4k_2m_1g_are_refused,
    dirty_log_of_a_slot_that_does_not_log_is_refused,
    dirty_log_buffer_too_small_is_refused_and_loses_no_dirty_bits,
    refused_move_leaves_the_slot_in_place_and_mapped,
    setting_the_same_flags_publishes_nothing,
    host_addresses_beyond_the_pte_address_field_are_refused,
}

/// What a caller can observe of the slot set.
#[derive(Debug, PartialEq, Eq)]
struct SlotView {
    generation: u64,
    slots: Vec<(u32, u64, u64, u64, u64, u32, bool)>,
}

fn view<F: PteFormat>(vm: &Vm<F>) -> SlotView {
    let set = vm.memslots();
    SlotView {
        generation: set.generation(),
        slots: set
            .slots()
            .iter()
            .map(|s| {
                (
                    s.id,
                    s.gpa().raw(),
                    s.size(),
                    s.host_addr.raw(),
                    s.host_page_size,
                    s.flags.bits(),
                    s.is_logging(),
                )
            })
            .collect(),
    }
}

/// A VM with two slots, each with one page mapped, and the state to compare against.
struct Fixture<F: PteFormat> {
    vm: Arc<Vm<F>>,
    vcpu: Vcpu<F>,
    mem: Vec<HostMem>,
    /// (gfn, leaf) pairs that must survive every refused request.
    mapped: Vec<(u64, (u64, u8))>,
}

impl<F: PteFormat> Fixture<F> {
    /// Slot 1: [4 MiB, 8 MiB) with 2 MiB host pages and logging; slot 2: [16 MiB, 17 MiB).
    fn new() -> Self {
        let vm = Vm::<F>::new(VmConfig::default());
        let mut vcpu = vm.create_vcpu(0);
        let m1 = HostMem::new(4 * MIB);
        let m2 = HostMem::new(MIB);
        vm.add_memslot(1, Gpa::new(4 * MIB), 4 * MIB, m1.range(HUGE_2M), LOG)
            .unwrap();
        vm.add_memslot(
            2,
            Gpa::new(16 * MIB),
            MIB,
            m2.range(PAGE_SIZE),
            MemslotFlags::empty(),
        )
        .unwrap();
        let mut mapped = Vec::new();
        for gpa in [4 * MIB + 0x5000, 16 * MIB + 0x3000] {
            let f = Fault {
                private: false,
                gpa: Gpa::new(gpa),
                access: Access::Write,
                present: false,
            };
            assert_eq!(vcpu.handle_fault(f), FaultOutcome::Fixed);
            let gfn = gpa >> PAGE_SHIFT;
            mapped.push((gfn, vm.lookup(Gfn::new(gfn)).expect("just mapped")));
        }
        Fixture {
            vm,
            vcpu,
            mem: vec![m1, m2],
            mapped,
        }
    }

    /// Runs `op`, which must fail; checks nothing changed; returns the error.
    fn refused<E: std::fmt::Debug + std::fmt::Display>(
        &self,
        what: &str,
        op: impl FnOnce(&Vm<F>) -> Result<(), E>,
    ) -> E {
        let before = view(&self.vm);
        let stats = self.vm.stats();
        let err = match op(&self.vm) {
            Ok(()) => panic!("{what}: accepted"),
            Err(e) => e,
        };
        assert_eq!(
            view(&self.vm),
            before,
            "{what}: the slot set changed ({err})"
        );
        for &(gfn, leaf) in &self.mapped {
            assert_eq!(
                self.vm.lookup(Gfn::new(gfn)),
                Some(leaf),
                "{what}: the mapping of gfn {gfn:#x} changed ({err})"
            );
        }
        let after = self.vm.stats();
        assert_eq!(
            (after.leaves_4k, after.leaves_2m, after.table_pages),
            (stats.leaves_4k, stats.leaves_2m, stats.table_pages),
            "{what}: the tree changed ({err})"
        );
        assert_eq!(
            after.remote_tlb_flush_requests, stats.remote_tlb_flush_requests,
            "{what}: a refused request flushed"
        );
        let msg = err.to_string();
        assert!(
            !msg.is_empty() && !msg.contains('\n'),
            "{what}: message {msg:?}"
        );
        err
    }

    fn finish(self) {
        check_audit(&self.vm, "fixture");
        let Fixture { vm, vcpu, mem, .. } = self;
        teardown(vm, [vcpu]);
        drop(mem);
    }
}

fn host(mem: &HostMem) -> HostRange {
    mem.range(PAGE_SIZE)
}

fn overlapping_ranges_are_refused_and_touching_ones_accepted<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(16 * MIB);
    // Slot 1 is [4, 8) MiB.
    for (gpa, size) in [
        (2 * MIB, 4 * MIB),                   // over its start
        (6 * MIB, 4 * MIB),                   // over its end
        (5 * MIB, PAGE_SIZE),                 // inside
        (0, 12 * MIB),                        // around it
        (4 * MIB, 4 * MIB),                   // exactly it
        (8 * MIB - PAGE_SIZE, 2 * PAGE_SIZE), // its last page only
        (3 * MIB, MIB + PAGE_SIZE),           // its first page only
    ] {
        let e = f.refused(&format!("add [{gpa:#x}, +{size:#x})"), |vm| {
            vm.add_memslot(9, Gpa::new(gpa), size, host(&m), MemslotFlags::empty())
        });
        assert!(
            matches!(
                e,
                MemslotError::Overlap { id: 9, other: 1, gpa: g, end, other_gpa, other_end }
                    if g == Gpa::new(gpa) && end == Gpa::new(gpa + size) && other_gpa == Gpa::new(4 * MIB) && other_end == Gpa::new(8 * MIB)
            ),
            "{e:?}"
        );
    }
    // Overlapping slot 2 ([16, 17) MiB) names slot 2.
    let e = f.refused("add over slot 2", |vm| {
        vm.add_memslot(
            9,
            Gpa::new(16 * MIB + 0x1000),
            PAGE_SIZE,
            host(&m),
            MemslotFlags::empty(),
        )
    });
    assert!(matches!(e, MemslotError::Overlap { other: 2, .. }), "{e:?}");

    // Touching on either side is fine.
    let m3 = HostMem::new(4 * MIB);
    let m4 = HostMem::new(8 * MIB);
    f.vm.add_memslot(3, Gpa::new(0), 4 * MIB, host(&m3), MemslotFlags::empty())
        .unwrap();
    f.vm.add_memslot(
        4,
        Gpa::new(8 * MIB),
        8 * MIB,
        host(&m4),
        MemslotFlags::empty(),
    )
    .unwrap();
    let ids: Vec<u32> = f.vm.memslots().slots().iter().map(|s| s.id).collect();
    assert_eq!(ids, vec![3, 1, 4, 2], "slots not sorted by guest address");
    // The new neighbours fault in right up to the shared edges.
    let mut v = f.vm.create_vcpu(1);
    for gpa in [4 * MIB - PAGE_SIZE, 8 * MIB, 16 * MIB - PAGE_SIZE] {
        let o = v.handle_fault(Fault {
            private: false,
            gpa: Gpa::new(gpa),
            access: Access::Read,
            present: false,
        });
        assert_eq!(o, FaultOutcome::Fixed, "{gpa:#x}");
    }
    drop(v);
    f.vm.delete_memslot(3).unwrap();
    f.vm.delete_memslot(4).unwrap();
    f.finish();
}

fn misaligned_guest_address_size_and_host_address<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(4 * MIB);
    let e = f.refused("gpa", |vm| {
        vm.add_memslot(
            9,
            Gpa::new(0x1000_0800),
            MIB,
            host(&m),
            MemslotFlags::empty(),
        )
    });
    assert!(
        matches!(
            e,
            MemslotError::Misaligned {
                id: 9,
                what: "guest physical address",
                value: 0x1000_0800
            }
        ),
        "{e:?}"
    );
    let e = f.refused("size", |vm| {
        vm.add_memslot(
            9,
            Gpa::new(0x1000_0000),
            MIB + 1,
            host(&m),
            MemslotFlags::empty(),
        )
    });
    assert!(
        matches!(e, MemslotError::Misaligned { id: 9, what: "size", value } if value == MIB + 1),
        "{e:?}"
    );
    // A safe `HostRange` cannot be misaligned (`HostRange::slice` refuses it): only a raw
    // one can reach the engine's check.
    // SAFETY: the address is inside `m`, which outlives the call, and `add_memslot` refuses
    // the range, so nothing ever touches it.
    let bad_host = unsafe { HostRange::from_raw(Hva::new(m.addr() + 8), MIB, PAGE_SIZE) };
    let e = f.refused("host", |vm| {
        vm.add_memslot(
            9,
            Gpa::new(0x1000_0000),
            MIB,
            bad_host,
            MemslotFlags::empty(),
        )
    });
    assert!(
        matches!(e, MemslotError::Misaligned { id: 9, what: "host address", value } if value == m.addr() + 8),
        "{e:?}"
    );
    let e = f.refused("move to a misaligned gpa", |vm| {
        vm.move_memslot(2, Gpa::new(0x2000_0010))
    });
    assert!(
        matches!(
            e,
            MemslotError::Misaligned {
                id: 2,
                what: "guest physical address",
                ..
            }
        ),
        "{e:?}"
    );
    f.finish();
}

fn zero_size_is_refused<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(MIB);
    let e = f.refused("zero size", |vm| {
        vm.add_memslot(9, Gpa::new(0x1000_0000), 0, host(&m), MemslotFlags::empty())
    });
    assert!(matches!(e, MemslotError::ZeroSize { id: 9 }), "{e:?}");
    f.finish();
}

fn ranges_beyond_48_bits_are_refused_and_the_last_page_is_usable<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(MIB);
    let top = 1u64 << 48;
    for (gpa, size) in [
        (top, PAGE_SIZE),
        (top - PAGE_SIZE, 2 * PAGE_SIZE),
        (PAGE_SIZE, !(PAGE_SIZE - 1)), // would overflow gpa + size
        (!(PAGE_SIZE - 1), PAGE_SIZE),
    ] {
        let e = f.refused(&format!("[{gpa:#x}, +{size:#x})"), |vm| {
            vm.add_memslot(9, Gpa::new(gpa), size, host(&m), MemslotFlags::empty())
        });
        assert!(
            matches!(e, MemslotError::BeyondPhysWidth { id: 9, gpa: g, size: s, bits: 48 } if g == Gpa::new(gpa) && s == size),
            "{e:?}"
        );
    }
    let e = f.refused("move beyond", |vm| {
        vm.move_memslot(2, Gpa::new(top - PAGE_SIZE))
    });
    assert!(
        matches!(e, MemslotError::BeyondPhysWidth { id: 2, .. }),
        "{e:?}"
    );

    // The very last page is allowed, and faults in.
    f.vm.add_memslot(
        9,
        Gpa::new(top - 16 * PAGE_SIZE),
        16 * PAGE_SIZE,
        host(&m),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut v = f.vm.create_vcpu(1);
    let o = v.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(top - 1),
        access: Access::Write,
        present: false,
    });
    assert_eq!(o, FaultOutcome::Fixed);
    let (leaf, level) =
        f.vm.lookup(Gfn::new((top >> PAGE_SHIFT) - 1))
            .expect("last page mapped");
    assert_eq!(
        leaf_hva::<F>(leaf, level, (top >> PAGE_SHIFT) - 1),
        m.addr() + 15 * PAGE_SIZE
    );
    drop(v);
    f.vm.delete_memslot(9).unwrap();
    f.finish();
}

fn unknown_flag_bits_are_refused<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(MIB);
    for (bits, unknown) in [(0x4u32, 0x4u32), (0x7, 0x4), (0x8000_0001, 0x8000_0000)] {
        let flags = MemslotFlags::from_bits_retain(bits);
        let e = f.refused(&format!("add flags {bits:#x}"), |vm| {
            vm.add_memslot(9, Gpa::new(0x1000_0000), MIB, host(&m), flags)
        });
        assert!(
            matches!(e, MemslotError::UnknownFlags { id: 9, bits: b } if b == unknown),
            "{e:?}"
        );
        let e = f.refused(&format!("set flags {bits:#x}"), |vm| {
            vm.set_memslot_flags(2, flags)
        });
        assert!(
            matches!(e, MemslotError::UnknownFlags { id: 2, bits: b } if b == unknown),
            "{e:?}"
        );
    }
    f.finish();
}

fn unknown_slot_for_delete_move_set_flags_and_get_dirty_log<F: PteFormat>() {
    let mut f = Fixture::<F>::new();
    let e = f.refused("delete", |vm| vm.delete_memslot(42));
    assert!(matches!(e, MemslotError::UnknownSlot { id: 42 }), "{e:?}");
    let e = f.refused("move", |vm| vm.move_memslot(42, Gpa::new(0x4000_0000)));
    assert!(matches!(e, MemslotError::UnknownSlot { id: 42 }), "{e:?}");
    let e = f.refused("set flags", |vm| vm.set_memslot_flags(42, LOG));
    assert!(matches!(e, MemslotError::UnknownSlot { id: 42 }), "{e:?}");
    let mut words = [0u64; 64];
    let e = f.refused("get dirty log", |vm| {
        vm.get_dirty_log(42, &mut words).map(|_| ())
    });
    assert!(matches!(e, DirtyLogError::UnknownSlot { id: 42 }), "{e:?}");
    // A deleted slot is unknown too (and its mapping is gone).
    f.vm.delete_memslot(2).unwrap();
    let (gfn2, _) = f.mapped.pop().expect("slot 2's page");
    assert_eq!(f.vm.lookup(Gfn::new(gfn2)), None, "delete left a mapping");
    let e = f.refused("delete twice", |vm| vm.delete_memslot(2));
    assert!(matches!(e, MemslotError::UnknownSlot { id: 2 }), "{e:?}");
    let Fixture { vm, vcpu, mem, .. } = f;
    teardown(vm, [vcpu]);
    drop(mem);
}

fn duplicate_ids_are_refused<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(MIB);
    // A free range, so only the id is wrong.
    let e = f.refused("duplicate", |vm| {
        vm.add_memslot(
            2,
            Gpa::new(0x1000_0000),
            MIB,
            host(&m),
            MemslotFlags::empty(),
        )
    });
    assert!(matches!(e, MemslotError::DuplicateId { id: 2 }), "{e:?}");
    f.finish();
}

fn host_range_shorter_than_the_slot_is_refused<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(MIB);
    let short = m.sub_range(0, MIB - PAGE_SIZE, PAGE_SIZE);
    let e = f.refused("short host", |vm| {
        vm.add_memslot(9, Gpa::new(0x1000_0000), MIB, short, MemslotFlags::empty())
    });
    assert!(
        matches!(e, MemslotError::HostRangeTooSmall { id: 9, need, have } if need == MIB && have == MIB - PAGE_SIZE),
        "{e:?}"
    );
    f.finish();
}

fn host_page_sizes_other_than_4k_2m_1g_are_refused<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(4 * MIB);
    for ps in [
        0u64,
        512,
        8192,
        64 << 10,
        4 * MIB,
        HUGE_2M + PAGE_SIZE,
        512 << 30,
    ] {
        let r = m.range(ps);
        let e = f.refused(&format!("page size {ps:#x}"), |vm| {
            vm.add_memslot(9, Gpa::new(0x1000_0000), MIB, r, MemslotFlags::empty())
        });
        assert!(
            matches!(e, MemslotError::BadHostPageSize { id: 9, page_size } if page_size == ps),
            "{e:?}"
        );
    }
    f.finish();
}

fn dirty_log_of_a_slot_that_does_not_log_is_refused<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let mut words = [0u64; 64];
    let e = f.refused("not logging", |vm| {
        vm.get_dirty_log(2, &mut words).map(|_| ())
    });
    assert!(matches!(e, DirtyLogError::NotLogging { id: 2 }), "{e:?}");
    // LOG on a read-only slot logs nothing: still not logging.
    let m = HostMem::new(MIB);
    f.vm.add_memslot(9, Gpa::new(0x1000_0000), MIB, host(&m), LOG | RO)
        .unwrap();
    let e = f.refused("read-only logging", |vm| {
        vm.get_dirty_log(9, &mut words).map(|_| ())
    });
    assert!(matches!(e, DirtyLogError::NotLogging { id: 9 }), "{e:?}");
    f.vm.delete_memslot(9).unwrap();
    f.finish();
}

fn dirty_log_buffer_too_small_is_refused_and_loses_no_dirty_bits<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let m = HostMem::new(MIB);
    // 130 pages: three words.
    f.vm.add_memslot(9, Gpa::new(0x1000_0000), 130 * PAGE_SIZE, host(&m), LOG)
        .unwrap();
    let mut v = f.vm.create_vcpu(1);
    for p in [0u64, 129] {
        let o = v.handle_fault(Fault {
            private: false,
            gpa: Gpa::new(0x1000_0000 + p * PAGE_SIZE),
            access: Access::Write,
            present: false,
        });
        assert_eq!(o, FaultOutcome::Fixed);
    }
    let before = f.vm.lookup(Gfn::new((0x1000_0000 >> PAGE_SHIFT) + 129));
    for have in [0usize, 1, 2] {
        let mut words = vec![0u64; have];
        let e = f.refused(&format!("{have} words"), |vm| {
            vm.get_dirty_log(9, &mut words).map(|_| ())
        });
        assert!(
            matches!(e, DirtyLogError::BitmapTooSmall { id: 9, need: 3, have: h } if h == have),
            "{e:?}"
        );
        assert_eq!(
            f.vm.lookup(Gfn::new((0x1000_0000 >> PAGE_SHIFT) + 129)),
            before
        );
    }
    // The refused calls consumed nothing: the full buffer gets both pages.
    let mut words = vec![0u64; 5];
    assert_eq!(f.vm.get_dirty_log(9, &mut words).unwrap(), 2);
    assert_eq!(words, vec![1, 0, 1 << 1, 0, 0]);
    drop(v);
    f.vm.delete_memslot(9).unwrap();
    f.finish();
}

fn refused_move_leaves_the_slot_in_place_and_mapped<F: PteFormat>() {
    let f = Fixture::<F>::new();
    // Slot 2 is [16, 17) MiB with one page mapped; slot 1 is [4, 8) MiB.
    for to in [7 * MIB, 4 * MIB, 3 * MIB + PAGE_SIZE, 8 * MIB - PAGE_SIZE] {
        let e = f.refused(&format!("move to {to:#x}"), |vm| {
            vm.move_memslot(2, Gpa::new(to))
        });
        assert!(
            matches!(e, MemslotError::Overlap { id: 2, other: 1, gpa, end, .. } if gpa == Gpa::new(to) && end == Gpa::new(to + MIB)),
            "{e:?}"
        );
    }
    // A move that only overlaps the slot's own old range is fine; so is touching slot 1.
    let (gfn, _) = f.mapped[1];
    let host_addr = f.mem[1].addr() + 0x3000;
    f.vm.move_memslot(2, Gpa::new(16 * MIB + MIB / 2)).unwrap();
    assert_eq!(
        f.vm.lookup(Gfn::new(gfn)),
        None,
        "the old range was not zapped"
    );
    f.vm.move_memslot(2, Gpa::new(8 * MIB)).unwrap();
    let mut v = f.vm.create_vcpu(1);
    let gpa = 8 * MIB + 0x3000;
    let o = v.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(gpa),
        access: Access::Read,
        present: false,
    });
    assert_eq!(o, FaultOutcome::Fixed);
    let (leaf, level) = f.vm.lookup(Gpa::new(gpa).gfn()).unwrap();
    assert_eq!(
        leaf_hva::<F>(leaf, level, gpa >> PAGE_SHIFT),
        host_addr,
        "moved slot lost its host memory"
    );
    let o = v.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(16 * MIB + 0x3000),
        access: Access::Read,
        present: false,
    });
    assert_eq!(o, FaultOutcome::NoSlot, "the old range still resolves");
    drop(v);
    let Fixture { vm, vcpu, mem, .. } = f;
    check_audit(&vm, "after the moves");
    teardown(vm, [vcpu]);
    drop(mem);
}

fn setting_the_same_flags_publishes_nothing<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let before = view(&f.vm);
    f.vm.set_memslot_flags(1, LOG).unwrap();
    f.vm.set_memslot_flags(2, MemslotFlags::empty()).unwrap();
    assert_eq!(view(&f.vm), before);
    for &(gfn, leaf) in &f.mapped {
        assert_eq!(f.vm.lookup(Gfn::new(gfn)), Some(leaf));
    }
    f.finish();
}

/// A host address the PTE cannot hold (above the output-address field are software bits: the
/// leaf would come out MMU-writable or host-writable, or point somewhere else) is refused.
fn host_addresses_beyond_the_pte_address_field_are_refused<F: PteFormat>() {
    let f = Fixture::<F>::new();
    let len = 2 * PAGE_SIZE;
    // Format difference, from the architecture: EPT leaves hold 52-bit host addresses, stage-2
    // descriptors with 4 KiB granules (no FEAT_LPA) 48-bit ones.
    let oa_limit = 1u64 << if is_ept::<F>() { 52 } else { 48 };
    for (addr, flags) in [
        // EPT bit 58 is MMU-writable, bit 57 host-writable: a read-only slot would map
        // writable (stage-2 keeps its software bits at 55-58).
        (1u64 << 58, RO),
        (1u64 << 52, MemslotFlags::empty()),
        (oa_limit, MemslotFlags::empty()),
        // The last page crosses the limit.
        (oa_limit - PAGE_SIZE, MemslotFlags::empty()),
        // addr + size wraps around.
        (!(PAGE_SIZE - 1), MemslotFlags::empty()),
    ] {
        let e = f.refused(&format!("host {addr:#x}"), |vm| {
            vm.add_memslot(
                9,
                Gpa::new(0x1000_0000),
                len,
                fake_host(addr, len, PAGE_SIZE),
                flags,
            )
        });
        assert!(
            matches!(e, MemslotError::HostAddressUnmappable { id: 9, addr: a, size } if a == Hva::new(addr) && size == len),
            "{e:?}"
        );
    }
    // The highest range that fits is accepted, and maps where it says.
    let top = oa_limit - len;
    f.vm.add_memslot(
        9,
        Gpa::new(0x1000_0000),
        len,
        fake_host(top, len, PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    if F::CACHE_MAINTENANCE {
        // Format difference (test harness, not engine): a stage-2 fault cleans the data cache
        // over the page it maps, which must be memory this process maps (`slat::cmo`), and
        // the top of a 48-bit output space is not even a canonical x86-64 address. Nothing
        // to fault in here; acceptance is what this format can show.
        f.vm.delete_memslot(9).unwrap();
        f.finish();
        return;
    }
    let mut v = f.vm.create_vcpu(1);
    let o = v.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(0x1000_0000 + PAGE_SIZE),
        access: Access::Write,
        present: false,
    });
    assert_eq!(o, FaultOutcome::Fixed);
    let gfn = (0x1000_0000 >> PAGE_SHIFT) + 1;
    let (leaf, level) = f.vm.lookup(Gfn::new(gfn)).unwrap();
    assert_eq!(leaf_hva::<F>(leaf, level, gfn), top + PAGE_SIZE);
    drop(v);
    f.vm.delete_memslot(9).unwrap();
    f.finish();
}
