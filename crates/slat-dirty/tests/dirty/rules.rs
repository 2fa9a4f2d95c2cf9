//! KVM's dirty-ring rules give typed errors (or the right behaviour), and the safe API cannot
//! be driven into letting KVM or the library write outside a buffer: every bitmap is sized
//! from the slot, every user-given range is checked. On the real `/dev/kvm`; skipped without.

use crate::common;

use common::{kvm_unavailable, Mapping, Setup, TinyVm};
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::Kvm;
use slat_addr::PageIndex;
use slat_dirty::log::{enable_dirty_ring, get_dirty_log, reset_dirty_rings, DirtyRing, RingSize};
use slat_dirty::{Error, Harvester, LogMode, Memslot};
use std::collections::BTreeSet;
use std::sync::Arc;

fn ring_cap() -> bool {
    let kvm = Kvm::new().unwrap();
    kvm.check_extension_raw(kvm_bindings::KVM_CAP_DIRTY_LOG_RING.into()) > 0
}

#[test]
fn ring_sizes_kvm_would_refuse_are_typed_errors() {
    for bad in [0, 1, 255, 1000, 4095, 1 << 17] {
        assert!(
            matches!(RingSize::from_entries(bad), Err(Error::RingSize { .. })),
            "{bad}"
        );
    }
    // Bytes that are not whole entries, and the units never mix.
    assert!(matches!(
        RingSize::from_bytes(4100),
        Err(Error::RingSize { .. })
    ));
    assert_eq!(RingSize::from_bytes(65536).unwrap().entries(), 4096);
    assert_eq!(RingSize::from_entries(4096).unwrap().bytes(), 65536);
}

#[test]
fn ring_enabled_after_a_vcpu_exists_or_twice_is_refused_clearly() {
    if kvm_unavailable() || !ring_cap() {
        return;
    }
    let size = RingSize::from_entries(4096).unwrap();
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    let _vcpu = vm.create_vcpu(0).unwrap();
    match enable_dirty_ring(&vm, size, false) {
        Err(e @ Error::RingEnable { .. }) => {
            assert!(e.to_string().contains("before any vCPU"), "{e}")
        }
        r => panic!("enable after a vCPU: {r:?}"),
    }
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    enable_dirty_ring(&vm, size, false).unwrap();
    assert!(matches!(
        enable_dirty_ring(&vm, size, false),
        Err(Error::RingEnable { .. })
    ));
}

#[test]
fn a_ring_of_the_wrong_size_is_not_mapped() {
    if kvm_unavailable() || !ring_cap() {
        return;
    }
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    enable_dirty_ring(&vm, RingSize::from_entries(1024).unwrap(), false).unwrap();
    let vcpu = vm.create_vcpu(0).unwrap();
    for wrong in [512, 2048, 65536] {
        let r = DirtyRing::map(&vcpu, RingSize::from_entries(wrong).unwrap());
        assert!(matches!(r, Err(Error::RingSize { .. })), "{wrong}: {r:?}");
    }
    DirtyRing::map(&vcpu, RingSize::from_entries(1024).unwrap()).unwrap();
    // A VM without a ring: nothing to map.
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    let vcpu = vm.create_vcpu(0).unwrap();
    let r = DirtyRing::map(&vcpu, RingSize::from_entries(1024).unwrap());
    assert!(matches!(r, Err(Error::RingSize { .. })), "{r:?}");
}

#[test]
fn reset_before_the_entries_are_read_loses_nothing() {
    let Some(mut vm) = TinyVm::new(Setup::Ring { entries: 4096 }) else {
        return;
    };
    let pages = [(0, 0), (0, 64), (0, 519), (1, 69)];
    vm.pass(&pages);
    // No entry was collected (flagged RESET), so a reset re-arms nothing and drops nothing.
    let vm_fd = Arc::clone(&vm.vm);
    assert_eq!(reset_dirty_rings(&vm_fd).unwrap(), 0);
    let set = vm.harvester.take().unwrap();
    let got: BTreeSet<_> = (0..2)
        .flat_map(|i| {
            set.ranges(i)
                .flat_map(move |(f, n)| (f..f + n).map(move |p| (i, p)))
        })
        .collect();
    assert_eq!(got, pages.into_iter().collect());
    set.commit();
    // And the take re-armed them: written again, reported again.
    vm.pass(&pages[..1]);
    let set = vm.harvester.take().unwrap();
    assert_eq!(set.pages(), 1);
    set.commit();
}

/// A VM with two slots registered here (no vCPU): `(vm, handles, memory)`.
fn two_slots() -> Option<(Arc<kvm_ioctls::VmFd>, Vec<Memslot>, Vec<Mapping>)> {
    if kvm_unavailable() {
        return None;
    }
    let vm = Arc::new(Kvm::new().unwrap().create_vm().unwrap());
    let mut maps = Vec::new();
    let mut slots = Vec::new();
    for (i, pages) in [65u64, 130].into_iter().enumerate() {
        let m = Mapping::new(pages as usize * 4096);
        let r = kvm_userspace_memory_region {
            slot: i as u32,
            flags: kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES,
            guest_phys_addr: (i as u64 + 1) << 30,
            memory_size: pages * 4096,
            userspace_addr: m.ptr as u64,
        };
        // SAFETY: the caller keeps `m` (returned with the handles) until after the VM and the
        // handles are dropped; the slot is never deleted.
        slots.push(unsafe { Memslot::register(&vm, r) }.unwrap());
        maps.push(m);
    }
    Some((vm, slots, maps))
}

#[test]
fn harvester_refuses_what_would_not_fit() {
    let Some((vm, slots, _mem)) = two_slots() else {
        return;
    };
    let h = |s: Vec<Memslot>, m| Harvester::new(s, m).map(|_| ());
    assert!(matches!(h(vec![], LogMode::Get), Err(Error::Harvest(_))));
    assert!(matches!(
        h(slots.clone(), LogMode::Ring),
        Err(Error::Harvest(_))
    ));
    for chunk in [0, 1, 63, 100] {
        let r = h(slots.clone(), LogMode::ManualProtect { chunk_pages: chunk });
        assert!(matches!(r, Err(Error::Harvest(_))), "{chunk}");
    }
    let twice = vec![slots[0].clone(), slots[0].clone()];
    assert!(matches!(h(twice, LogMode::Get), Err(Error::Harvest(_))));
    // Slots of two VMs.
    let (_vm2, other, _mem2) = two_slots().unwrap();
    let mixed = vec![slots[0].clone(), other[1].clone()];
    assert!(matches!(h(mixed, LogMode::Get), Err(Error::Harvest(_))));

    let mut hv = Harvester::new(slots.clone(), LogMode::Get).unwrap();
    // VMM bitmaps of the wrong length, ranges outside the slot, slots that do not exist.
    for len in [0, 1, 2, 4, 100] {
        assert!(matches!(
            hv.mark_words(1, &vec![u64::MAX; len]),
            Err(Error::BitmapLength { expected: 3, .. })
        ));
    }
    for (first, n) in [(0, 131), (130, 1), (u64::MAX, 2), (1, u64::MAX)] {
        assert!(
            matches!(
                hv.mark_pages(1, PageIndex::new(first), n),
                Err(Error::Harvest(_))
            ),
            "{first} {n}"
        );
    }
    assert!(matches!(
        hv.mark_pages(2, PageIndex::ZERO, 1),
        Err(Error::Harvest(_))
    ));
    assert!(matches!(
        hv.mark_words(usize::MAX, &[]),
        Err(Error::Harvest(_))
    ));
    assert!(hv.add_ring_is_refused_outside_ring_mode());
    // Bits past a slot's end in a VMM bitmap are dropped, not reported as pages.
    hv.mark_words(0, &[0, u64::MAX]).unwrap();
    let set = hv.take().unwrap();
    assert_eq!(set.ranges(0).collect::<Vec<_>>(), [(64, 1)]);
    for (i, s) in slots.iter().enumerate() {
        assert_eq!(set.bitmap(i).unwrap().len() as u64, s.bitmap_words());
    }
    assert!(set.bitmap(2).is_none());
    assert_eq!(set.ranges(7).count(), 0);
    set.commit();
    drop(hv);
    drop(slots);
    drop(vm);
}

trait AddRing {
    fn add_ring_is_refused_outside_ring_mode(&mut self) -> bool;
}
impl AddRing for Harvester {
    fn add_ring_is_refused_outside_ring_mode(&mut self) -> bool {
        // A ring needs a vCPU; build one on a ring VM just to hand it over.
        if !ring_cap() {
            return true;
        }
        let vm = Kvm::new().unwrap().create_vm().unwrap();
        let size = RingSize::from_entries(1024).unwrap();
        enable_dirty_ring(&vm, size, false).unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        let ring = DirtyRing::map(&vcpu, size).unwrap();
        matches!(self.add_ring(ring), Err(Error::Harvest(_)))
    }
}

#[test]
fn adopted_slots_are_checked_and_size_the_bitmaps() {
    let Some((vm, slots, mem)) = two_slots() else {
        return;
    };
    let region = |size: u64, addr: u64| kvm_userspace_memory_region {
        slot: 1,
        flags: 0,
        guest_phys_addr: 2 << 30,
        memory_size: size,
        userspace_addr: addr,
    };
    let addr = mem[1].ptr as u64;
    for (size, addr) in [(0, addr), (4095, addr), (4096, addr + 1), (4096, !4095)] {
        // SAFETY: each of these is refused before the handle exists (checked below), so no
        // handle ever describes a slot wrongly.
        let r = unsafe { Memslot::adopt(&vm, region(size, addr)) };
        assert!(
            matches!(r, Err(Error::Memslot { slot: 1, .. })),
            "{size} {addr:#x}: {r:?}"
        );
    }
    // SAFETY: slot 1 exists with exactly this region (registered by `two_slots`) and is
    // never deleted while the handle lives.
    let adopted = unsafe { Memslot::adopt(&vm, region(130 * 4096, addr)) }.unwrap();
    assert_eq!(adopted.pages(), 130);
    assert!(adopted.same_vm(&slots[1]));
    let mut bits = vec![0u64; 3];
    get_dirty_log(&adopted, &mut bits).unwrap();
    for len in [2, 4] {
        let mut b = vec![0u64; len];
        assert!(matches!(
            get_dirty_log(&adopted, &mut b),
            Err(Error::BitmapLength { expected: 3, .. })
        ));
    }
}

#[cfg(feature = "vm-memory")]
#[test]
fn a_vm_memory_atomic_bitmap_merges_into_the_take_and_is_reset() {
    use slat_dirty::vm_memory::bitmap::AtomicBitmap;
    use std::num::NonZeroUsize;
    let Some((_vm, slots, _mem)) = two_slots() else {
        return;
    };
    let mut hv = Harvester::new(slots, LogMode::Get).unwrap();
    let page = NonZeroUsize::new(4096).unwrap();
    // Slot 1 has 130 pages; a bitmap of another size is refused and left alone.
    let wrong = AtomicBitmap::new(129 * 4096, page);
    wrong.set_addr_range(0, 4096);
    assert!(matches!(
        hv.mark_atomic_bitmap(1, &wrong),
        Err(Error::BitmapLength { .. })
    ));
    assert!(wrong.is_bit_set(0));
    let b = AtomicBitmap::new(130 * 4096, page);
    b.set_addr_range(63 * 4096, 2 * 4096); // pages 63 and 64: across a word edge
    b.set_addr_range(129 * 4096, 1); // the last page
    hv.mark_atomic_bitmap(1, &b).unwrap();
    assert!(!b.is_bit_set(63) && !b.is_bit_set(129), "taken and reset");
    let set = hv.take().unwrap();
    assert_eq!(set.ranges(1).collect::<Vec<_>>(), [(63, 2), (129, 1)]);
    set.abort();
    // Aborted: still owed.
    assert_eq!(hv.take().unwrap().pages(), 3);
}
