//! Create a VM, add a memslot over host memory, fault pages in from a vCPU, enable dirty
//! logging, take a write-protection fault on the fast path, harvest, and print statistics.
//!
//! `cargo run --release -p slat --example basic`

use slat::{
    Access, Ept, Fault, FaultOutcome, HostBuffer, HostRange, MemslotFlags, PteFormat, Vm, VmConfig,
};
use slat_addr::{Gfn, Gpa};
use std::sync::Arc;

fn main() {
    const SIZE: u64 = 4 << 20; // 4 MiB of guest RAM
    const GPA: u64 = 0x1_0000_0000;
    // Zeroed host memory, 2 MiB aligned; the memslot keeps it alive and it is freed when the
    // last memslot over it is gone.
    let host = HostBuffer::new(SIZE, 2 << 20)
        .expect("allocate guest RAM")
        .with_page_size(2 << 20); // pretend the host maps it with 2 MiB pages: huge leaves
    let range = HostRange::new(Arc::new(host)).expect("host range");

    let vm = Vm::<Ept>::new(VmConfig::default());
    vm.add_memslot(1, Gpa::new(GPA), SIZE, range, MemslotFlags::empty())
        .expect("add memslot");
    let mut vcpu = vm.create_vcpu(0);

    let write = |gpa, present| Fault {
        private: false,
        gpa,
        access: Access::Write,
        present,
    };
    for gpa in (GPA..GPA + SIZE).step_by(4096) {
        match vcpu.handle_fault(write(Gpa::new(gpa), false)) {
            FaultOutcome::Fixed | FaultOutcome::Spurious => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let (leaf, level) = vm.lookup(Gfn::new(GPA >> 12)).expect("mapped");
    println!(
        "after first touch: leaf at level {level} maps host {:#x}; {:?}",
        Ept::output_addr(leaf),
        vm.stats()
    );

    // Dirty logging splits the huge leaves and write-protects every 4 KiB leaf.
    vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
        .expect("enable logging");
    let o = vcpu.handle_fault(write(Gpa::new(GPA + 5 * 4096), true));
    println!("write to a write-protected page: {o:?}");
    let mut bitmap = vec![0u64; (SIZE / 4096 / 64) as usize];
    let dirty = vm.get_dirty_log(1, &mut bitmap).expect("get dirty log");
    println!("harvested {dirty} dirty page(s): word 0 = {:#x}", bitmap[0]);
    println!("stats: {:?}", vm.stats());

    drop(vcpu);
    vm.delete_memslot(1).expect("delete"); // the last owner of the host memory: freed here
    drop(vm);
}
