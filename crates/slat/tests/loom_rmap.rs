//! Loom models of seed 002's lock-free write-protect through the reverse map
//! (`VmConfig::wrprot = rmap-lockless`), on the real engine code:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p slat --test loom_rmap --release`.
//!
//! The harvest takes no MMU lock: it is pinned in the epoch, finds the leaf through the rmap
//! and clears W with one compare-and-swap, racing vCPUs that make the same entry writable.
//! Threads return what they saw; the assertions run in the main thread.
#![cfg(loom)]

use loom::thread;
use slat::{
    Access, Ept, Fault, FaultOutcome, HostBuffer, HostRange, MemslotFlags, PteFormat, Vm, VmConfig,
    WrprotVariant,
};
use std::sync::Arc;

const GPA: u64 = 0x10_0000;

fn host_page() -> HostRange {
    let buf = HostBuffer::new(4096, 4096).expect("allocate a host page");
    HostRange::new(Arc::new(buf)).expect("host range")
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.max_branches = 1_000_000;
    b.check(f);
}

fn lockless() -> VmConfig {
    VmConfig {
        wrprot: WrprotVariant::RmapLockless,
        ..VmConfig::default()
    }
}

fn write(present: bool) -> Fault {
    Fault {
        gpa: GPA,
        access: Access::Write,
        present,
    }
}

/// After the writer is done and a last harvest ran, the page must have been reported by one
/// of the two harvests, and the last harvest must have left it write-protected (otherwise a
/// later write would go unreported: the lost dirty page the seed's ordering prevents).
fn check(vm: &Vm<Ept>, first: u64, o: FaultOutcome) {
    assert!(
        matches!(o, FaultOutcome::FixedFast | FaultOutcome::Fixed),
        "{o:?}"
    );
    let mut second = [0u64; 1];
    vm.get_dirty_log(1, &mut second).unwrap();
    assert_eq!(
        (first | second[0]) & 1,
        1,
        "the write was reported by neither harvest: {o:?}"
    );
    let (spte, _) = vm.lookup(GPA >> 12).expect("mapped");
    assert!(
        !Ept::is_writable(spte),
        "writable after a harvest that reported nothing pending: {o:?} first {first:#x} second {:#x} spte {spte:#x} rmap {:?}", second[0], vm.audit_rmap()
    );
    assert_eq!(vm.audit_rmap(), Ok(1), "rmap out of step with the tree");
}

/// A fault that *installs* a writable leaf in a logged slot (slow path: rmap entry, then the
/// compare-and-swap, then the second mark) racing a lock-free GET.
#[test]
fn lockless_wrprot_vs_a_fault_installing_the_writable_leaf() {
    model(|| {
        let vm = Vm::<Ept>::new(lockless());
        vm.add_memslot(1, GPA, 4096, host_page(), MemslotFlags::LOG_DIRTY_PAGES)
            .unwrap();
        let mut v = vm.create_vcpu(0);
        let writer = thread::spawn(move || {
            let mut o = v.handle_fault(write(false));
            // A bounded number of retries (a lost race re-executes the access).
            for _ in 0..2 {
                if o != FaultOutcome::Retry {
                    break;
                }
                o = v.handle_fault(write(false));
            }
            drop(v);
            o
        });
        let mut first = [0u64; 1];
        vm.get_dirty_log(1, &mut first).unwrap();
        let o = writer.join().unwrap();
        check(&vm, first[0], o);
    });
}

/// The fast path making a write-protected leaf writable (mark, CAS W 0→1, mark) racing a
/// lock-free GET that write-protects it through the rmap.
#[test]
fn lockless_wrprot_vs_the_fast_path_making_the_leaf_writable() {
    model(|| {
        let vm = Vm::<Ept>::new(lockless());
        vm.add_memslot(1, GPA, 4096, host_page(), MemslotFlags::empty())
            .unwrap();
        let mut v = vm.create_vcpu(0);
        assert_eq!(v.handle_fault(write(false)), FaultOutcome::Fixed);
        vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
            .unwrap();
        let writer = thread::spawn(move || {
            let o = v.handle_fault(write(true));
            drop(v);
            o
        });
        let mut first = [0u64; 1];
        vm.get_dirty_log(1, &mut first).unwrap();
        let o = writer.join().unwrap();
        check(&vm, first[0], o);
    });
}
