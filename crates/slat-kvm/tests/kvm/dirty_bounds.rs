//! The dirty-log calls never let KVM read or write outside the buffers they are given: bitmap
//! lengths are checked against the slot KVM registered (exactly), CLEAR ranges as KVM checks
//! them, ring sizes against KVM's bounds and against the ring the vCPU really has. Each
//! refusal is a typed error, and the accepted calls still do exactly what KVM does.
//!
//! These run on a bare VM built with `kvm-ioctls` (no vCPU needed for bitmaps) so that slots
//! can have page counts the machine never uses (1, 63, 65, 130 pages).

use crate::common;

use common::{kvm_unavailable, machine_or_skip};
use kvm_bindings::{
    kvm_enable_cap, kvm_userspace_memory_region, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_DIRTY_LOG_INITIALLY_SET, KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES,
};
use kvm_ioctls::{Kvm, VmFd};
use slat_addr::PageIndex;
use slat_dirty::log::RingSize;
use slat_dirty::log::{self, DirtyRing};
use slat_dirty::{DirtyLogSource, Error, Memslot};
use slat_kvm::{KvmConfig, KvmError};
use slat_workload::TestMachine;
use slat_workload::{Backing, GuestRam, Layout, PassParams, RegionSpec};
use std::sync::Arc;

/// A word KVM never writes into a bitmap of a slot with no dirty page.
const SENTINEL: u64 = 0x5a5a_5a5a_5a5a_5a5a;

/// A VM with no vCPU, and its host memory: one slot of `pages` pages per entry of `pages`
/// (ids 1.., one GiB apart), registered through `Memslot::register`. `manual` enables
/// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` with those flags first. `None` without /dev/kvm.
struct BareVm {
    // Dropped first: the handles hold the VM fd, which must close before the memory goes.
    slots: Vec<Memslot>,
    vm: Arc<VmFd>,
    _mem: Vec<GuestRam>,
}

fn bare_vm(pages: &[u64], manual: u32) -> Option<BareVm> {
    if kvm_unavailable() {
        return None;
    }
    let kvm = Kvm::new().expect("/dev/kvm");
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    if manual != 0 {
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            ..Default::default()
        };
        cap.args[0] = manual.into();
        vm.enable_cap(&cap).expect("manual protect");
    }
    let mut mem = Vec::new();
    let mut slots = Vec::new();
    for (i, &n) in pages.iter().enumerate() {
        let m = GuestRam::new(Backing::Anonymous, n * 4096, false).unwrap();
        let r = kvm_userspace_memory_region {
            slot: i as u32 + 1,
            flags: 0,
            guest_phys_addr: (i as u64 + 1) << 30,
            memory_size: n * 4096,
            userspace_addr: m.addr(),
        };
        // SAFETY: `m` is a fresh anonymous mapping of exactly this size, used for nothing
        // else, and it outlives the VM: `BareVm` drops the handles and the VM fd (the only
        // references to the VM; it never gets a vCPU) before the memory.
        slots.push(unsafe { Memslot::register(&vm, r) }.unwrap());
        mem.push(m);
    }
    Some(BareVm {
        slots,
        vm,
        _mem: mem,
    })
}

#[test]
fn get_writes_exactly_the_words_of_the_slot_and_refuses_other_lengths() {
    let sizes = [1u64, 63, 64, 65, 130];
    let Some(b) = bare_vm(&sizes, 0) else {
        return;
    };
    for (slot, &pages) in b.slots.iter().zip(&sizes) {
        let words = pages.div_ceil(64) as usize;
        assert_eq!(slot.pages(), pages);
        assert_eq!(slot.bitmap_words(), words as u64);
        slot.set_dirty_logging(true).unwrap();
        // One guard word past the bitmap, in the same allocation.
        let mut v = vec![SENTINEL; words + 1];
        log::get_dirty_log(slot, &mut v[..words]).unwrap();
        // KVM wrote every word of the bitmap (nothing is dirty: all zero) and nothing past it.
        assert!(v[..words].iter().all(|&w| w == 0), "{pages} pages: {v:x?}");
        assert_eq!(
            v[words], SENTINEL,
            "{pages} pages: KVM wrote past the bitmap"
        );

        // Any other length is refused before KVM sees it: nothing is written.
        for len in [0, words - 1, words + 1] {
            if len == words {
                continue;
            }
            let mut w = vec![SENTINEL; words + 1];
            match log::get_dirty_log(slot, &mut w[..len]) {
                Err(Error::BitmapLength {
                    op: "KVM_GET_DIRTY_LOG",
                    slot: id,
                    pages: p,
                    expected,
                    got,
                }) => {
                    assert_eq!(
                        (id, p, expected, got),
                        (slot.id(), pages, words as u64, len)
                    );
                }
                r => panic!("{pages} pages, {len} words: {r:?}"),
            }
            assert!(
                w.iter().all(|&x| x == SENTINEL),
                "{pages} pages, {len} words"
            );
        }
    }
}

#[test]
fn machine_get_refuses_a_bitmap_longer_or_shorter_than_the_slot() {
    // The old machine call accepted any bitmap at least as long as the slot's (KVM filled a
    // prefix and the rest looked like a result); the raw call in `dirty` accepted any length.
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    m.set_dirty_logging(true).unwrap();
    let words = m.pages_per_slot().div_ceil(64) as usize;
    for len in [0, 1, words - 1, words + 1, 2 * words] {
        let mut buf = vec![0u64; len];
        assert!(
            matches!(
                m.dirty_log().get_log(0, &mut buf),
                Err(KvmError::Dirty(Error::BitmapLength { expected, got, .. }))
                    if expected == words as u64 && got == len
            ),
            "{len} words"
        );
    }
    let mut buf = vec![0u64; words];
    m.dirty_log().get_log(0, &mut buf).unwrap();
}

/// Pages set in the GET bitmap of `slot`.
fn logged(slot: &Memslot) -> Vec<u64> {
    let mut v = vec![0u64; slot.bitmap_words() as usize];
    log::get_dirty_log(slot, &mut v).unwrap();
    (0..slot.pages())
        .filter(|&p| v[(p / 64) as usize] & (1 << (p % 64)) != 0)
        .collect()
}

#[test]
fn clear_checks_its_range_and_bitmap_like_kvm_and_clears_exactly() {
    let Some(b) = bare_vm(
        &[130],
        KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET,
    ) else {
        return;
    };
    let slot = &b.slots[0];
    // INITIALLY_SET: every page of the slot is reported, and only those (bits 130..191 of
    // the last word stay clear).
    slot.set_dirty_logging(true).unwrap();
    let all: Vec<u64> = (0..130).collect();
    assert_eq!(logged(slot), all);

    // Ranges KVM refuses (EINVAL), refused first with the rule they break.
    for (first, n, rule) in [
        (1, 64, "multiple of 64"),
        (63, 1, "multiple of 64"),
        (0, 65, "unless the range ends the slot"),
        (64, 1, "unless the range ends the slot"),
        (0, 131, "past the end"),
        (128, 3, "past the end"),
        (192, 0, "past the end"),
        (u64::MAX - 63, 64, "past the end"),
        (0, u64::MAX, "past the end"),
    ] {
        let bits = vec![u64::MAX; 3];
        match log::clear_dirty_log(slot, PageIndex::new(first), n, &bits) {
            Err(e @ Error::ClearRange { .. }) => {
                assert!(e.to_string().contains(rule), "{first}+{n}: {e}")
            }
            r => panic!("{first}+{n}: {r:?}"),
        }
    }
    // The bitmap must be exactly ceil(num_pages / 64) words: KVM reads that many.
    for (first, n, len) in [
        (0, 128, 1),
        (0, 128, 3),
        (128, 2, 0),
        (128, 2, 2),
        (0, 130, 2),
    ] {
        let bits = vec![u64::MAX; len];
        assert!(
            matches!(
                log::clear_dirty_log(slot, PageIndex::new(first), n, &bits),
                Err(Error::BitmapLength { op: "KVM_CLEAR_DIRTY_LOG", expected, got, .. })
                    if expected == n.div_ceil(64) && got == len
            ),
            "{first}+{n} with {len} words"
        );
    }
    // Nothing above reached KVM.
    assert_eq!(logged(slot), all);

    // Accepted ranges clear exactly their set bits: the tail (ends the slot, not a multiple
    // of 64), one bit of the first 64, an empty range.
    log::clear_dirty_log(slot, PageIndex::new(128), 2, &[0b10]).unwrap();
    log::clear_dirty_log(slot, PageIndex::new(0), 64, &[1 << 5]).unwrap();
    log::clear_dirty_log(slot, PageIndex::new(64), 0, &[]).unwrap();
    let want: Vec<u64> = (0..130).filter(|&p| p != 5 && p != 129).collect();
    assert_eq!(logged(slot), want);
    // A range from 64 to the end: 66 pages, two words.
    log::clear_dirty_log(slot, PageIndex::new(64), 66, &[u64::MAX, 0b11]).unwrap();
    let want: Vec<u64> = (0..64).filter(|&p| p != 5).collect();
    assert_eq!(logged(slot), want);
}

#[test]
fn memslot_registration_refuses_what_would_delete_or_misdescribe_a_slot() {
    let Some(b) = bare_vm(&[16], 0) else {
        return;
    };
    let mem = GuestRam::new(Backing::Anonymous, 16 * 4096, false).unwrap();
    let good = kvm_userspace_memory_region {
        slot: 9,
        flags: 0,
        guest_phys_addr: 16 << 30,
        memory_size: 16 * 4096,
        userspace_addr: mem.addr(),
    };
    for (r, what) in [
        (
            kvm_userspace_memory_region {
                memory_size: 0,
                ..good
            },
            "delete",
        ),
        (
            kvm_userspace_memory_region {
                memory_size: 4096 + 8,
                ..good
            },
            "4 KiB",
        ),
        (
            kvm_userspace_memory_region {
                userspace_addr: mem.addr() + 8,
                ..good
            },
            "4 KiB",
        ),
        (
            kvm_userspace_memory_region {
                guest_phys_addr: u64::MAX - 4095,
                ..good
            },
            "wraps",
        ),
        (
            kvm_userspace_memory_region { flags: 4, ..good },
            "KVM_MEM_READONLY",
        ),
    ] {
        // SAFETY: every one of these is refused before the ioctl (the test checks it); none
        // reaches KVM, so no memory is registered.
        match unsafe { Memslot::register(&b.vm, r) } {
            Err(e @ Error::Memslot { slot: 9, .. }) => {
                assert!(e.to_string().contains(what), "{e}")
            }
            other => panic!("{r:?}: {other:?}"),
        }
    }
    // KVM itself refuses to resize a live slot: the handle's page count cannot go stale
    // through registration.
    let resize = kvm_userspace_memory_region {
        slot: b.slots[0].id(),
        flags: KVM_MEM_LOG_DIRTY_PAGES,
        guest_phys_addr: b.slots[0].guest_phys_addr().raw(),
        memory_size: 8 * 4096,
        userspace_addr: b.slots[0].userspace_addr().raw(),
    };
    // SAFETY: the range is the first half of the slot's own memory, which `b` keeps mapped
    // for the VM's lifetime; KVM refuses the change anyway (checked).
    let r = unsafe { Memslot::register(&b.vm, resize) };
    assert!(matches!(r, Err(Error::Ioctl { .. })), "{r:?}");
    assert_eq!(b.slots[0].pages(), 16);
    drop(mem);
}

#[test]
fn ring_sizes_are_validated_and_convert_between_entries_and_bytes() {
    for bad in [0, 1, 3, 16, 100, 128, 255, 257, 3000, 1 << 17, u32::MAX] {
        assert!(
            matches!(RingSize::from_entries(bad), Err(Error::RingSize { .. })),
            "{bad} entries"
        );
    }
    for good in [256, 512, 4096, 65536] {
        let s = RingSize::from_entries(good).unwrap();
        assert_eq!(s.entries(), good);
        assert_eq!(s.bytes(), good * 16);
        assert_eq!(RingSize::from_bytes(u64::from(good) * 16).unwrap(), s);
    }
    // The entries/bytes mix-up: 4096 *bytes* is a 256-entry ring, not a 4096-entry one.
    assert_eq!(RingSize::from_bytes(4096).unwrap().entries(), 256);
    for bad in [0, 8, 4100, 4096 + 16, 1 << 21, u64::MAX] {
        assert!(
            matches!(RingSize::from_bytes(bad), Err(Error::RingSize { .. })),
            "{bad} bytes"
        );
    }
}

/// A VM with a dirty ring of `enabled` (or none) and one vCPU.
fn ring_vm(enabled: Option<RingSize>) -> Option<(VmFd, kvm_ioctls::VcpuFd)> {
    if kvm_unavailable() {
        return None;
    }
    let caps = slat_kvm::host_caps(slat_kvm::DEFAULT_DEVICE).unwrap();
    if caps.dirty_ring_max_bytes < 64 * 1024 {
        eprintln!("skipping: no dirty ring of 64 KiB on this host");
        return None;
    }
    let vm = Kvm::new().unwrap().create_vm().unwrap();
    if let Some(size) = enabled {
        log::enable_dirty_ring(&vm, size, caps.dirty_ring_acq_rel).unwrap();
    }
    let vcpu = vm.create_vcpu(0).unwrap();
    Some((vm, vcpu))
}

#[test]
fn ring_map_refuses_a_size_other_than_the_one_enabled() {
    let e = |n| RingSize::from_entries(n).unwrap();
    // Enabled with 2048 entries (32 KiB, what the cap is given): only 2048 maps.
    let Some((_vm, vcpu)) = ring_vm(Some(e(2048))) else {
        return;
    };
    for wrong in [256, 1024, 4096] {
        match DirtyRing::map(&vcpu, e(wrong)) {
            Err(Error::RingSize { entries, .. }) => assert_eq!(entries, u64::from(wrong)),
            r => panic!("{wrong} entries: {r:?}"),
        }
    }
    let mut ring = DirtyRing::map(&vcpu, e(2048)).unwrap();
    assert_eq!(ring.count(), 2048);
    assert_eq!(ring.harvest(|_, _| panic!("no vCPU ran")), 0);

    // No ring enabled at all.
    let (_vm2, vcpu2) = ring_vm(None).unwrap();
    let r = DirtyRing::map(&vcpu2, e(256));
    assert!(matches!(r, Err(Error::RingSize { .. })), "{r:?}");
}

#[test]
fn ring_mapping_stays_valid_after_the_fds_close() {
    let size = RingSize::from_entries(1024).unwrap();
    let Some((vm, vcpu)) = ring_vm(Some(size)) else {
        return;
    };
    let mut ring = DirtyRing::map(&vcpu, size).unwrap();
    // The mapping holds the vCPU's file, so the ring's pages outlive both fds.
    drop(vcpu);
    drop(vm);
    for _ in 0..3 {
        assert_eq!(ring.harvest(|_, _| panic!("nothing was logged")), 0);
    }
    drop(ring);
}

#[test]
fn native_baseline_refuses_layouts_that_do_not_fit_its_memory() {
    let mem = GuestRam::new(Backing::Anonymous, 4 << 20, false).unwrap();
    let layout = Layout {
        gpa: 1 << 30,
        host: mem.addr(),
        bytes_per_vcpu: 1 << 20,
        vcpus: 2,
        overlap: false,
    };
    let p = PassParams::default();
    slat_workload::native_baseline::<()>(layout, &mem, p).unwrap();
    for (bytes, vcpus, what) in [
        // Not a whole number of pages: vCPU 1's words would be misaligned. The old code ran
        // this (vCPUs = 1 here, so it wrote only aligned words) and returned Ok.
        (4100, 1, "multiple of 4 KiB"),
        (0, 2, "multiple of 4 KiB"),
        // 2^63 × 2 wraps to 0, which "fits" any memory: the old code then wrote 2^51 pages
        // past `mem` (not run against it, for that reason).
        (1 << 63, 2, "overflows"),
        (4 << 20, 2, "needs"),
    ] {
        let r = slat_workload::native_baseline::<()>(
            Layout {
                bytes_per_vcpu: bytes,
                vcpus,
                ..layout
            },
            &mem,
            p,
        )
        .map_err(KvmError::from);
        match r {
            Err(KvmError::Config(m)) => assert!(m.contains(what), "{m}"),
            r => panic!("{bytes} bytes x {vcpus}: {r:?}"),
        }
    }
}
