//! The simulated machine surfaces private memory's exit: its accesses are shared, so a page
//! made `PRIVATE` (`Vm::set_memory_attributes`) faults with `Exit::MemoryFault` (KVM's
//! `KVM_EXIT_MEMORY_FAULT`), and after the VMM converts it back the access runs, through the
//! shared backing, even if the vCPU had cached the translation before both conversions.

#[macro_use]
mod common;

use slat::format::{PAGE_SHIFT, PAGE_SIZE};
use slat::{HostRange, MemoryAttributes, MemslotFlags, PteFormat, Vm, VmConfig};
use slat_machine::sched::PcpuPool;
use slat_machine::{Backing, Cpu, Exit, GuestRam};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GPA: u64 = 64 * MIB;

both_formats! {
    a_shared_access_to_a_private_page_exits_to_the_vmm,
}

fn a_shared_access_to_a_private_page_exits_to_the_vmm<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, 4 * MIB, true).unwrap());
    let shared = HostRange::slice(ram.clone(), 0, 2 * MIB).unwrap();
    let private = HostRange::slice(ram.clone(), 2 * MIB, 2 * MIB).unwrap();
    vm.add_memslot_with_private(1, GPA, 2 * MIB, shared, private, MemslotFlags::empty())
        .unwrap();
    let mut cpu = Cpu::new(vm.clone(), 0, 64, Arc::new(PcpuPool::new(1)));
    cpu.enter();
    let gpa = GPA + 3 * PAGE_SIZE + 16;
    cpu.write_u64(gpa, 0x1234).unwrap();
    cpu.exit();
    // The VMM converts the page while the vCPU is out (its TLB still holds the translation).
    vm.set_memory_attributes(gpa >> PAGE_SHIFT, 1, MemoryAttributes::PRIVATE)
        .unwrap();
    cpu.enter();
    let exit = Exit::MemoryFault {
        gpa: gpa & !(PAGE_SIZE - 1),
        size: PAGE_SIZE,
        private: false,
    };
    assert_eq!(
        cpu.read_u64(gpa),
        Err(exit),
        "the stale translation was used"
    );
    cpu.exit();
    vm.set_memory_attributes(gpa >> PAGE_SHIFT, 1, MemoryAttributes::empty())
        .unwrap();
    cpu.enter();
    assert_eq!(
        cpu.read_u64(gpa),
        Ok(0x1234),
        "the shared backing, as written"
    );
    cpu.exit();
    cpu.destroy();
}
