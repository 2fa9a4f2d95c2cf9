//! A call that would wait for the calling thread itself is refused with a typed error: a
//! flush waits for every vCPU in guest mode (and every online host CPU of a direct map) to
//! acknowledge between its accesses, so a thread that holds one of them and flushes would
//! wait for ever. Each test runs its calls on a thread of its own and fails if they do not
//! return in time (the code before the check hung there).
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::direct_map::{DirectMap, DirectMapConfig, DirectMapError};
use slat::dirty::DirtyLogError;
use slat::DirectMapPolicy;
use slat::{
    Access, AgeFlush, Ept, Fault, FaultOutcome, FlushError, IdleBitmap, MemoryAttributeError,
    MemoryAttributes, MemslotError, MemslotFlags, Vm, VmConfig,
};
use slat_addr::{Gfn, Gpa, Hva, PageIndex, PAGE_SHIFT, PAGE_SIZE};
use std::sync::mpsc;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const OWN: FlushError = FlushError::OwnGuestMode;

/// Runs `f` on a new thread; fails if it panics or has not returned after 30 s (it is left
/// behind, waiting).
fn returns_in_time(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(()) => t.join().expect("test thread"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(t.join().expect_err("the thread ended without sending"))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("the call waited for its own thread (no answer in 30 s)")
        }
    }
}

/// Every engine call that may flush, from a thread whose own vCPU is in guest mode: each is
/// refused and changes nothing; after the token is dropped the same calls go through.
#[test]
fn engine_calls_that_flush_refuse_a_thread_holding_a_guest_mode_token() {
    returns_in_time(|| {
        let mem = HostMem::new(4 * MIB);
        let vm = Vm::<Ept>::new(VmConfig::default());
        vm.add_memslot(
            1,
            Gpa::new(0),
            4 * MIB,
            mem.range(PAGE_SIZE),
            MemslotFlags::empty(),
        )
        .unwrap();
        let mut v = vm.create_vcpu(0);
        assert_eq!(
            fault(&vm, &mut v, 0, Access::Write, false),
            FaultOutcome::Fixed
        );
        let guest = v.enter_guest();

        assert_eq!(vm.zap_gfn_range(Gfn::new(0), Gfn::new(1024)), Err(OWN));
        assert!(vm.lookup(Gfn::new(0)).is_some(), "a refused zap zapped");
        assert_eq!(vm.flush_remote_tlbs(), Err(OWN));
        dirty_log_and_memslot_calls_refuse(&vm);
        assert_eq!(
            vm.set_memory_attributes(Gfn::new(0), 1, MemoryAttributes::empty()),
            Err(MemoryAttributeError::Flush(OWN))
        );
        assert_eq!(
            vm.clear_flush_young(Gfn::new(0), Gfn::new(1024), |_, _| {}),
            Err(OWN)
        );
        let mut idle = IdleBitmap::new::<Ept>(Gfn::new(0), 1024).unwrap();
        assert_eq!(
            vm.mark_idle(&mut idle, AgeFlush::Flush, |_, _| {}),
            Err(OWN)
        );
        // Aging without a flush waits for nobody.
        assert!(vm
            .age_gfn_range(Gfn::new(0), Gfn::new(1024), AgeFlush::NoFlush, |_, _| {})
            .is_ok());
        // Another vCPU's slow path from this thread could wait for it too (the lock's holder
        // flushing, or its own break-before-make flush).
        let mut w = vm.create_vcpu(1);
        let f = Fault {
            private: false,
            gpa: Gpa::new(8 * PAGE_SIZE),
            access: Access::Write,
            present: false,
        };
        assert_eq!(w.slow_page_fault(f), FaultOutcome::InGuestMode);
        assert!(vm.lookup(Gfn::new(8)).is_none(), "a refused fault mapped");
        assert!(!vm.memslots().slots()[0].is_logging());

        drop(guest);
        assert_eq!(w.slow_page_fault(f), FaultOutcome::Fixed);
        vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
            .unwrap();
        vm.get_dirty_log(1, &mut [0u64; 16]).unwrap();
        vm.zap_gfn_range(Gfn::new(0), Gfn::new(1024)).unwrap();
        assert!(vm.lookup(Gfn::new(0)).is_none());
        vm.flush_remote_tlbs().unwrap();
        teardown(vm, [v, w]);
    });
}

/// The dirty-log and memslot calls that flush, from a thread whose own vCPU is in guest mode:
/// each refused with the own-thread error.
fn dirty_log_and_memslot_calls_refuse(vm: &Vm<Ept>) {
    let mut words = vec![0u64; 16];
    assert_eq!(
        vm.get_dirty_log(1, &mut words),
        Err(DirtyLogError::Flush(OWN))
    );
    assert_eq!(
        vm.clear_dirty_log(1, PageIndex::new(0), 64, &[0]),
        Err(DirtyLogError::Flush(OWN))
    );
    assert_eq!(vm.reset_dirty_rings(), Err(DirtyLogError::Flush(OWN)));
    let logging = MemslotFlags::LOG_DIRTY_PAGES;
    assert_eq!(
        vm.set_memslot_flags(1, logging),
        Err(MemslotError::Flush(OWN))
    );
    assert_eq!(
        vm.move_memslot(1, Gpa::new(1 << 30)),
        Err(MemslotError::Flush(OWN))
    );
    assert_eq!(vm.delete_memslot(1), Err(MemslotError::Flush(OWN)));
}

/// A direct map's acceptance, release and audit from a thread that is one of its online host
/// CPUs: refused (the kernel TLB flush would wait for it); offline, they go through.
#[test]
fn direct_map_calls_refuse_an_online_host_cpu() {
    returns_in_time(|| {
        let mem = HostMem::new(2 * MIB);
        let cfg = DirectMapConfig {
            policy: DirectMapPolicy::Pre4K,
            kernel_flush: true,
            collapse: false,
        };
        let map = DirectMap::new(mem.range(PAGE_SIZE), cfg).unwrap();
        let mut cpu = map.host_cpu();
        let online = cpu.online();
        let own = DirectMapError::Flush(OWN);
        assert_eq!(map.accept(Hva::new(mem.addr())), Err(own.clone()));
        assert!(
            !map.is_assigned(Hva::new(mem.addr())).unwrap(),
            "a refused accept"
        );
        assert_eq!(map.release(Hva::new(mem.addr())), Err(own.clone()));
        assert_eq!(map.release_orphans(), Err(own.clone()));
        assert_eq!(map.audit().err(), Some(own));
        drop(online);
        map.accept(Hva::new(mem.addr())).unwrap();
        assert!(map.release(Hva::new(mem.addr())).unwrap());
        map.audit().unwrap();
        drop(cpu);
    });
}

/// A private fault on a slot bound to a direct map, from a thread that is an online host CPU
/// of that map: acceptance would flush it, so the slow path refuses.
#[test]
fn a_private_fault_refuses_an_online_host_cpu_of_its_direct_map() {
    returns_in_time(|| {
        let pool = HostMem::new(2 * MIB);
        let cfg = DirectMapConfig {
            policy: DirectMapPolicy::Pre4K,
            kernel_flush: true,
            collapse: false,
        };
        let map = DirectMap::new(pool.range(PAGE_SIZE), cfg).unwrap();
        let vm = Vm::<Ept>::new(VmConfig::default());
        let shared = HostMem::new(2 * MIB);
        let private = map.bind(0, 2 * MIB).unwrap();
        vm.add_memslot_with_private(
            1,
            Gpa::new(0),
            2 * MIB,
            shared.range(PAGE_SIZE),
            private,
            MemslotFlags::empty(),
        )
        .unwrap();
        vm.set_memory_attributes(Gfn::new(0), 512, MemoryAttributes::PRIVATE)
            .unwrap();
        let mut v = vm.create_vcpu(0);
        let f = Fault {
            private: true,
            gpa: Gpa::new(3 << PAGE_SHIFT),
            access: Access::Write,
            present: false,
        };
        let mut cpu = map.host_cpu();
        let online = cpu.online();
        assert_eq!(v.slow_page_fault(f), FaultOutcome::InGuestMode);
        assert!(!map
            .is_assigned(Hva::new(pool.addr() + 3 * PAGE_SIZE))
            .unwrap());
        // Memslot operations may release pages to the map (a kernel flush) too.
        assert_eq!(
            vm.set_memory_attributes(Gfn::new(0), 512, MemoryAttributes::empty()),
            Err(MemoryAttributeError::Flush(OWN))
        );
        assert_eq!(vm.delete_memslot(1), Err(MemslotError::Flush(OWN)));
        drop(online);
        assert_eq!(v.slow_page_fault(f), FaultOutcome::Fixed);
        assert!(map
            .is_assigned(Hva::new(pool.addr() + 3 * PAGE_SIZE))
            .unwrap());
        drop(cpu);
        teardown(vm, [v]);
    });
}
