//! Create a VM, add a memslot over host memory, fault pages in from a vCPU, enable dirty
//! logging, take a write-protection fault on the fast path, harvest, and print statistics.
//!
//! `cargo run --release -p slat --example basic`

use slat::{Access, Ept, Fault, FaultOutcome, HostRange, MemslotFlags, PteFormat, Vm, VmConfig};
use std::alloc::{alloc_zeroed, dealloc, Layout};

fn main() {
    const SIZE: u64 = 4 << 20; // 4 MiB of guest RAM
    const GPA: u64 = 0x1_0000_0000;
    let layout = Layout::from_size_align(SIZE as usize, 2 << 20).expect("layout");
    // SAFETY: non-zero size; freed with the same layout at the end.
    let host = unsafe { alloc_zeroed(layout) };
    assert!(!host.is_null(), "out of memory");

    let vm = Vm::<Ept>::new(VmConfig::default());
    let range = HostRange {
        addr: host as u64,
        len: SIZE,
        page_size: 2 << 20, // pretend the host maps it with 2 MiB pages: huge leaves
    };
    vm.add_memslot(1, GPA, SIZE, range, 0).expect("add memslot");
    let mut vcpu = vm.create_vcpu(0);

    let write = |gpa, present| Fault {
        gpa,
        access: Access::Write,
        present,
    };
    for gpa in (GPA..GPA + SIZE).step_by(4096) {
        match vm.handle_fault(&mut vcpu, write(gpa, false)) {
            FaultOutcome::Fixed | FaultOutcome::Spurious => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let (leaf, level) = vm.lookup(GPA >> 12).expect("mapped");
    println!(
        "after first touch: leaf at level {level} maps host {:#x}; {:?}",
        Ept::output_addr(leaf),
        vm.stats()
    );

    // Dirty logging splits the huge leaves and write-protects every 4 KiB leaf.
    vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES.bits())
        .expect("enable logging");
    let o = vm.handle_fault(&mut vcpu, write(GPA + 5 * 4096, true));
    println!("write to a write-protected page: {o:?}");
    let mut bitmap = vec![0u64; (SIZE / 4096 / 64) as usize];
    let dirty = vm.get_dirty_log(1, &mut bitmap).expect("get dirty log");
    println!("harvested {dirty} dirty page(s): word 0 = {:#x}", bitmap[0]);
    println!("stats: {:?}", vm.stats());

    vm.destroy_vcpu(vcpu);
    vm.delete_memslot(1).expect("delete");
    drop(vm);
    // SAFETY: allocated above with this layout; no mapping refers to it any more.
    unsafe { dealloc(host, layout) };
}
