//! Regression tests for defects an adversarial review found (the "trust" issue): each fails on
//! the engine before its fix.
//! - a READONLY toggle on a logged slot lost unharvested dirty pages; so did a slot move;
//! - EPT with on-fault recovery answered `Spurious` forever to a fault under a table whose
//!   entry carries R/W/X (a livelock);
//! - a zap released the MMU lock before its flush, so a fault could install a translation of
//!   another size while a vCPU still cached the zapped one (a stage-2 TLB conflict);
//! - the API now binds vCPUs to their VM and makes guest mode a token.
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::dirty::{INITIALLY_SET, MANUAL_PROTECT_ENABLE};
use slat::{
    Access, Fault, FaultOutcome, MemslotError, MemslotFlags, PteFormat, RecoverVariant, Vm,
    VmConfig,
};
use slat_addr::{Gfn, Gpa, PageIndex, PAGE_SHIFT, PAGE_SIZE};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;
const RO: MemslotFlags = MemslotFlags::READONLY;
const MIB: u64 = 1 << 20;
const GPA: u64 = 64 * MIB;

both_formats! {
    readonly_toggle_on_a_logged_slot_is_refused_and_loses_no_mark,
    readonly_toggle_refused_in_manual_protect_mode,
    moving_a_logged_slot_keeps_its_unharvested_marks,
    fault_under_a_leftover_table_rebuilds_the_block_with_on_fault_recovery,
    zap_flushes_before_a_fault_can_install_another_size,
    guest_mode_token_of_another_vcpu_is_refused,
    slow_path_in_guest_mode_does_nothing,
    vcpu_keeps_its_vm_alive_and_host_memory_outlives_the_slot,
}

fn write<F: PteFormat>(vcpu: &mut slat::Vcpu<F>, gpa: u64, present: bool) -> FaultOutcome {
    vcpu.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(gpa),
        access: Access::Write,
        present,
    })
}

fn dirty_pages<F: PteFormat>(vm: &Vm<F>, id: u32) -> Vec<u64> {
    let npages = vm.memslots().by_id(id).expect("slot").npages;
    let mut words = vec![0u64; bitmap_words(npages)];
    vm.get_dirty_log(id, &mut words).expect("GET");
    bitmap_gfns(0, &words)
}

/// LOG -> LOG|READONLY -> LOG used to be accepted and drop the bitmap in between: a page
/// written before the toggle was never reported. Now the toggle is refused and nothing changes.
fn readonly_toggle_on_a_logged_slot_is_refused_and_loses_no_mark<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mem = HostMem::new(2 * MIB);
    vm.add_memslot(1, Gpa::new(GPA), 2 * MIB, mem.range(PAGE_SIZE), LOG)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    assert_eq!(
        write(&mut v, GPA + 3 * PAGE_SIZE, false),
        FaultOutcome::Fixed
    );
    assert_eq!(
        vm.set_memslot_flags(1, LOG | RO),
        Err(MemslotError::ReadonlyChange { id: 1 }),
        "READONLY must not change on an existing slot"
    );
    assert_eq!(vm.memslots().by_id(1).unwrap().flags, LOG, "flags changed");
    // Setting the same flags again is a no-op, and the log still holds the write.
    vm.set_memslot_flags(1, LOG).unwrap();
    assert_eq!(
        dirty_pages(&vm, 1),
        vec![3],
        "the write before the toggle was lost"
    );
    // A read-only slot cannot become writable either.
    vm.add_memslot(
        2,
        Gpa::new(GPA + 2 * MIB),
        2 * MIB,
        mem.range(PAGE_SIZE),
        RO,
    )
    .unwrap();
    assert_eq!(
        vm.set_memslot_flags(2, MemslotFlags::empty()),
        Err(MemslotError::ReadonlyChange { id: 2 })
    );
    assert_eq!(
        write(&mut v, GPA + 2 * MIB, false),
        FaultOutcome::ReadOnly,
        "the read-only slot stayed read-only"
    );
    teardown(vm, [v]);
}

fn readonly_toggle_refused_in_manual_protect_mode<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE | INITIALLY_SET)
        .unwrap();
    let mem = HostMem::new(2 * MIB);
    vm.add_memslot(1, Gpa::new(GPA), 2 * MIB, mem.range(PAGE_SIZE), LOG)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    // Clear everything INITIALLY_SET reported, then write one page.
    let words = vec![!0u64; bitmap_words(512)];
    vm.clear_dirty_log(1, PageIndex::new(0), 512, &words)
        .unwrap();
    assert_eq!(
        write(&mut v, GPA + 9 * PAGE_SIZE, false),
        FaultOutcome::Fixed
    );
    assert_eq!(
        vm.set_memslot_flags(1, LOG | RO),
        Err(MemslotError::ReadonlyChange { id: 1 })
    );
    assert_eq!(dirty_pages(&vm, 1), vec![9]);
    teardown(vm, [v]);
}

/// KVM hands the old bitmap to the moved slot; slat used to start a fresh one, losing the
/// pages written before the move.
fn moving_a_logged_slot_keeps_its_unharvested_marks<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mem = HostMem::new(2 * MIB);
    vm.add_memslot(1, Gpa::new(GPA), 2 * MIB, mem.range(PAGE_SIZE), LOG)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    assert_eq!(
        write(&mut v, GPA + 5 * PAGE_SIZE, false),
        FaultOutcome::Fixed
    );
    vm.move_memslot(1, Gpa::new(GPA + 16 * MIB)).unwrap();
    assert_eq!(
        write(&mut v, GPA + 16 * MIB + 7 * PAGE_SIZE, false),
        FaultOutcome::Fixed
    );
    assert_eq!(
        dirty_pages(&vm, 1),
        vec![5, 7],
        "a page written before the move is missing"
    );
    assert!(vm
        .lookup(Gfn::new((GPA + 5 * PAGE_SIZE) >> PAGE_SHIFT))
        .is_none());
    teardown(vm, [v]);
}

/// After logging stops with on-fault recovery, the 4 KiB tables stay. A fault whose slot
/// allows a 2 MiB leaf finds the table entry at level 2; on EPT that entry has R/W/X set, and
/// the slow path took it for a leaf that permits the access: `Spurious` forever while the
/// access kept faulting. It must rebuild the block (or map the page) instead.
fn fault_under_a_leftover_table_rebuilds_the_block_with_on_fault_recovery<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig {
        recover: RecoverVariant::OnFault,
        ..VmConfig::default()
    });
    let mem = HostMem::new(2 * MIB);
    vm.add_memslot(
        1,
        Gpa::new(GPA),
        2 * MIB,
        mem.range(2 * MIB),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut v = vm.create_vcpu(0);
    assert_eq!(write(&mut v, GPA, false), FaultOutcome::Fixed);
    assert_eq!(vm.lookup(Gpa::new(GPA).gfn()).unwrap().1, 2);
    vm.set_memslot_flags(1, LOG).unwrap(); // eager split: a table of 4 KiB leaves
    vm.set_memslot_flags(1, MemslotFlags::empty()).unwrap(); // tables stay
    let target = GPA + 17 * PAGE_SIZE;
    vm.zap_gfn_range(Gpa::new(target).gfn(), Gfn::new((target >> PAGE_SHIFT) + 1))
        .expect("not refused: no CPU of this thread in guest mode");
    assert!(vm.lookup(Gpa::new(target).gfn()).is_none());
    // A vCPU retries a `Retry` or `Spurious` fault; bound the retries.
    let mut outcomes = Vec::new();
    for _ in 0..8 {
        let o = v.handle_fault(Fault {
            private: false,
            gpa: Gpa::new(target),
            access: Access::Read,
            present: false,
        });
        outcomes.push(o);
        if vm.lookup(Gpa::new(target).gfn()).is_some() {
            break;
        }
    }
    let (leaf, level) = vm
        .lookup(Gpa::new(target).gfn())
        .unwrap_or_else(|| panic!("the page never got mapped; outcomes {outcomes:?}"));
    assert!(F::permits(leaf, Access::Read));
    assert_eq!(level, 2, "on-fault recovery rebuilds the block");
    assert_eq!(outcomes.last(), Some(&FaultOutcome::Fixed), "{outcomes:?}");
    check_audit(&vm, "after the rebuild");
    teardown(vm, [v]);
}

/// vCPU A holds a 2 MiB translation (in guest mode, not yet acknowledging). A partial zap
/// removes the block; its flush must complete before any fault can install a 4 KiB leaf in
/// that range, or A and the new leaf are two translations of one page (a TLB conflict abort
/// on arm64). The zap used to drop the MMU lock first and flush afterwards.
fn zap_flushes_before_a_fault_can_install_another_size<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig {
        eager_split: false,
        ..VmConfig::default()
    });
    let mem = HostMem::new(2 * MIB);
    vm.add_memslot(
        1,
        Gpa::new(GPA),
        2 * MIB,
        mem.range(2 * MIB),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut a = vm.create_vcpu(0);
    let mut b = vm.create_vcpu(1);
    let base = GPA >> PAGE_SHIFT;
    assert_eq!(
        a.handle_fault(Fault {
            private: false,
            gpa: Gpa::new(GPA),
            access: Access::Read,
            present: false
        }),
        FaultOutcome::Fixed
    );
    vm.set_memslot_flags(1, LOG).unwrap(); // lazy split: the block stays, write-protected
    assert_eq!(vm.lookup(Gfn::new(base + 7)).unwrap().1, 2);

    // A is in guest mode with the block cached: it acknowledges nothing until we say so.
    let guest = a.enter_guest();
    a.service_requests(|| {});
    let zap_done = Arc::new(AtomicBool::new(false));
    let fault_done = Arc::new(AtomicBool::new(false));
    std::thread::scope(|s| {
        let (vm2, zd) = (vm.clone(), zap_done.clone());
        s.spawn(move || {
            vm2.zap_gfn_range(Gfn::new(base + 5), Gfn::new(base + 6))
                .expect("not refused: no CPU of this thread in guest mode");
            zd.store(true, Ordering::SeqCst);
        });
        // Wait for the zap's flush request to reach A.
        let deadline = Instant::now() + Duration::from_secs(10);
        while a.pending_requests() == 0 {
            assert!(Instant::now() < deadline, "the zap never asked for a flush");
            std::thread::yield_now();
        }
        let fd = fault_done.clone();
        let b = &mut b;
        s.spawn(move || {
            write_fault_until_fixed(b, GPA + 7 * PAGE_SIZE);
            fd.store(true, Ordering::SeqCst);
        });
        // Give B every chance to install while A has not acknowledged the zap's flush.
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until && !fault_done.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let installed = vm.lookup(Gfn::new(base + 7));
        assert!(
            !zap_done.load(Ordering::SeqCst),
            "the zap returned before A acknowledged its flush"
        );
        assert!(
            installed.is_none(),
            "a {:?}-level leaf was installed over the zapped block while vCPU A still \
             caches the 2 MiB translation (the zap's flush was not complete)",
            installed.map(|(_, l)| l)
        );
        // Now A acknowledges; the zap completes and B's fault goes through.
        a.service_requests(|| {});
        drop(guest);
    });
    assert!(zap_done.load(Ordering::SeqCst) && fault_done.load(Ordering::SeqCst));
    assert_eq!(vm.lookup(Gfn::new(base + 7)).map(|(_, l)| l), Some(1));
    check_audit(&vm, "after the zap and the fault");
    teardown(vm, [a, b]);
}

/// Write-faults `gpa` on `b` until the fault is fixed (or 20 s pass).
fn write_fault_until_fixed<F: PteFormat>(b: &mut slat::Vcpu<F>, gpa: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = b.handle_fault(Fault {
            private: false,
            gpa: Gpa::new(gpa),
            access: Access::Write,
            present: false,
        });
        if o == FaultOutcome::Fixed || Instant::now() > deadline {
            break;
        }
    }
}

/// The fast path trusts the token to prove guest mode: a token of another vCPU proves nothing
/// about this one, so the fast path declines (the slow path then does the work).
fn guest_mode_token_of_another_vcpu_is_refused<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mem = HostMem::new(2 * MIB);
    vm.add_memslot(1, Gpa::new(GPA), 2 * MIB, mem.range(PAGE_SIZE), LOG)
        .unwrap();
    let mut a = vm.create_vcpu(0);
    let mut b = vm.create_vcpu(1);
    assert_eq!(
        a.handle_fault(Fault {
            private: false,
            gpa: Gpa::new(GPA),
            access: Access::Read,
            present: false
        }),
        FaultOutcome::Fixed
    );
    let f = Fault {
        private: false,
        gpa: Gpa::new(GPA),
        access: Access::Write,
        present: true,
    };
    let token_b = b.enter_guest();
    assert!(b.in_guest() && !a.in_guest());
    assert_eq!(a.fast_page_fault(&token_b, f), None, "another vCPU's token");
    drop(token_b);
    assert!(!b.in_guest());
    let token_a = a.enter_guest();
    assert_eq!(
        a.fast_page_fault(&token_a, f),
        Some(FaultOutcome::FixedFast)
    );
    drop(token_a);
    teardown(vm, [a, b]);
}

/// Nested tokens keep the vCPU in guest mode until the last is dropped, and the slow path
/// refuses to run (it could block on a lock whose holder waits for this vCPU).
fn slow_path_in_guest_mode_does_nothing<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mem = HostMem::new(2 * MIB);
    vm.add_memslot(
        1,
        Gpa::new(GPA),
        2 * MIB,
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut v = vm.create_vcpu(0);
    let f = Fault {
        private: false,
        gpa: Gpa::new(GPA),
        access: Access::Read,
        present: false,
    };
    let t1 = v.enter_guest();
    let t2 = v.enter_guest();
    drop(t1);
    assert!(v.in_guest(), "a live token keeps the vCPU in guest mode");
    assert_eq!(v.slow_page_fault(f), FaultOutcome::InGuestMode);
    assert!(
        vm.lookup(Gpa::new(GPA).gfn()).is_none(),
        "nothing was mapped"
    );
    assert_eq!(v.handle_fault(f), FaultOutcome::InGuestMode);
    drop(t2);
    assert!(!v.in_guest());
    assert_eq!(v.slow_page_fault(f), FaultOutcome::Fixed);
    teardown(vm, [v]);
}

/// The slot owns its host memory: dropping the caller's handle does not free it while the
/// slot (or a vCPU's snapshot of the slot set) can still reach it. A stage-2 fault cleans the
/// cache over the range it maps, so a freed range would be touched here.
fn vcpu_keeps_its_vm_alive_and_host_memory_outlives_the_slot<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let buf = Arc::new(
        slat::HostBuffer::new(4 * MIB, 2 * MIB)
            .unwrap()
            .with_page_size(2 * MIB),
    );
    let weak = Arc::downgrade(&buf);
    let range = slat::HostRange::new(buf).unwrap();
    vm.add_memslot(1, Gpa::new(GPA), 4 * MIB, range, MemslotFlags::empty())
        .unwrap();
    let mut v = vm.create_vcpu(0);
    let alloc = slat::hw::table_alloc(&vm).clone();
    drop(vm); // the vCPU holds the VM
    assert!(weak.upgrade().is_some(), "the slot holds the memory");
    let o = v.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(GPA + 2 * MIB),
        access: Access::Write,
        present: false,
    });
    assert_eq!(o, FaultOutcome::Fixed);
    let vm = v.vm().clone();
    vm.delete_memslot(1).unwrap();
    // The vCPU's memslot snapshot may still list the slot until it faults again.
    let _ = v.handle_fault(Fault {
        private: false,
        gpa: Gpa::new(GPA),
        access: Access::Read,
        present: false,
    });
    assert!(
        weak.upgrade().is_none(),
        "memory freed once no set lists the slot"
    );
    drop(v);
    drop(vm);
    wait_for_reclaim(&alloc, 0);
}
