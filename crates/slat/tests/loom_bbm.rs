//! Loom model of break-before-make on stage-2, run on the real engine compiled against loom
//! (`RUSTFLAGS="--cfg loom" cargo test -p slat --test loom_bbm --release`).
//!
//! The property (arm64's rule, whose violation is a TLB conflict abort): while any vCPU may
//! still use a cached translation of an address, no translation of *another size* for that
//! address may become visible to its walker. A translation stops being usable only when the
//! vCPU acknowledges a flush requested after the entry was broken.
//!
//! The model: a 2 MiB block is mapped and write-protected for dirty logging (eager split off,
//! so the block stays). vCPU A is in guest mode with the block in its "TLB" and, at every step,
//! either services a pending flush (emptying its TLB) or walks the table as its hardware would
//! and checks that it finds no 4 KiB leaf while the block is cached. Concurrently the host zaps
//! one page of the block (the whole block goes) and vCPU B write-faults another page of it,
//! which with logging on installs a table and a 4 KiB leaf. Before the fix the zap released
//! the MMU lock before its flush, and B's leaf could appear while A still cached the block.
#![cfg(loom)]

#[path = "common/loom_thread.rs"]
mod thread;
use slat::{
    Access, Fault, FaultOutcome, GuestMode, HostBuffer, HostRange, MemslotFlags, Stage2, Vcpu, Vm,
    VmConfig,
};
use slat_addr::Gfn;
use slat_addr::Gpa;
use std::sync::Arc;

const GPA: u64 = 64 << 20;
const MIB2: u64 = 2 << 20;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.max_branches = 200_000;
    // The model's own thread has loom's default stack: run the body on one with more room.
    let f = std::sync::Arc::new(f);
    b.check(move || {
        let f = std::sync::Arc::clone(&f);
        thread::spawn(move || f()).join().expect("model body");
    });
}

#[test]
fn zap_and_fault_never_show_a_second_size_to_a_vcpu_caching_the_block() {
    model(|| {
        let vm = Vm::<Stage2>::new(VmConfig {
            eager_split: false,
            ..VmConfig::default()
        });
        let buf = HostBuffer::new(MIB2, MIB2).unwrap().with_page_size(MIB2);
        let host = HostRange::new(Arc::new(buf)).unwrap();
        vm.add_memslot(1, Gpa::new(GPA), MIB2, host, MemslotFlags::empty())
            .unwrap();
        let base = GPA >> 12;
        let mut a = vm.create_vcpu(0);
        let mut b = vm.create_vcpu(1);
        let read = Fault {
            private: false,
            gpa: Gpa::new(GPA),
            access: Access::Read,
            present: false,
        };
        assert_eq!(a.handle_fault(read), FaultOutcome::Fixed);
        vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
            .unwrap();
        assert_eq!(vm.lookup(Gfn::new(base + 7)).map(|(_, l)| l), Some(2));

        // A enters guest mode holding the block in its TLB.
        let guest = a.enter_guest();
        a.service_requests(|| {});
        let vcpu_a = {
            let vm = vm.clone();
            thread::spawn(move || vcpu_caching_the_block(&vm, a, guest, base))
        };
        let zapper = {
            let vm = vm.clone();
            thread::spawn(move || vm.zap_gfn_range(Gfn::new(base + 5), Gfn::new(base + 6)))
        };
        let write = Fault {
            private: false,
            gpa: Gpa::new(GPA + 7 * 4096),
            access: Access::Write,
            present: false,
        };
        for _ in 0..2 {
            match b.handle_fault(write) {
                FaultOutcome::Fixed | FaultOutcome::Spurious => break,
                _ => thread::yield_now(),
            }
        }
        zapper
            .join()
            .unwrap()
            .expect("not refused: the zapper holds no vCPU in guest mode");
        let conflict = vcpu_a.join().unwrap();
        assert_eq!(
            conflict, None,
            "a leaf of another level was visible while vCPU A cached the 2 MiB block: \
             break-before-make violated"
        );
        drop(b);
    });
}

/// vCPU A in guest mode with the 2 MiB block in its TLB: a few access boundaries (servicing a
/// flush request drops the cached block), then a VM exit. Returns the level of a leaf of another
/// size seen for the cached block's page while the block was still cached.
fn vcpu_caching_the_block(
    vm: &Vm<Stage2>,
    a: Vcpu<Stage2>,
    guest: GuestMode,
    base: u64,
) -> Option<u8> {
    // A few access boundaries, then a VM exit (leaving guest mode also releases
    // a flusher still waiting for this vCPU). Bounded, so every execution is short.
    for _ in 0..3 {
        let mut tlb_block = true;
        if a.pending_requests() != 0 {
            a.service_requests(|| tlb_block = false);
        }
        if !tlb_block {
            break;
        }
        // The hardware walker, for another page of the cached block. A second size
        // is reported after the execution (a panic inside a model thread would
        // leave the others spinning).
        if let Some((_, level)) = vm.lookup(Gfn::new(base + 7)) {
            if level != 2 {
                drop(guest);
                return Some(level);
            }
        }
        thread::yield_now();
    }
    drop(guest);
    drop(a);
    None
}
