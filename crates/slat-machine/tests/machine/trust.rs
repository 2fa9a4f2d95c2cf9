//! Regression tests for the simulated vCPU's public API (the "trust" issue): an 8-byte guest
//! access must not straddle two guest pages (which map to unrelated host pages: a write at the
//! last 4 bytes of a slot used to land in the next host page), accesses outside guest mode
//! are refused, and the machine's memory outlives every mapping of it.

use slat::{HostRange, MemslotFlags, PteFormat, Vm, VmConfig};
use slat_addr::Gpa;
use slat_machine::sched::PcpuPool;
use slat_machine::{Cpu, Exit};
use slat_workload::{Backing, GuestRam};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GPA: u64 = 64 * MIB;

both_formats! {
    unaligned_accesses_exit_instead_of_crossing_a_page,
    accesses_outside_guest_mode_are_refused,
    guest_ram_lives_as_long_as_its_memslots,
}

/// Two one-page slots side by side in the guest, backed by host pages far apart.
fn two_page_vm<F: PteFormat>() -> (Arc<Vm<F>>, Arc<GuestRam>) {
    let vm = Vm::<F>::new(VmConfig::default());
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, 4 * MIB, true).unwrap());
    let a = HostRange::slice(ram.clone(), 0, 4096).unwrap();
    let b = HostRange::slice(ram.clone(), 2 * MIB, 4096).unwrap();
    vm.add_memslot(1, Gpa::new(GPA), 4096, a, MemslotFlags::empty())
        .unwrap();
    vm.add_memslot(
        2,
        Gpa::new(GPA + 4096),
        4096,
        b,
        MemslotFlags::LOG_DIRTY_PAGES,
    )
    .unwrap();
    (vm, ram)
}

fn host_u64(ram: &GuestRam, offset: u64) -> u64 {
    assert!(offset % 8 == 0 && offset + 8 <= ram.len());
    // SAFETY: in bounds and aligned (checked); no vCPU runs; atomic like the vCPUs' accesses.
    unsafe {
        std::sync::atomic::AtomicU64::from_ptr(ram.as_ptr().add(offset as usize).cast())
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn unaligned_accesses_exit_instead_of_crossing_a_page<F: PteFormat>() {
    let (vm, ram) = two_page_vm::<F>();
    let mut cpu = Cpu::new(vm.clone(), 0, 64, Arc::new(PcpuPool::new(1))).unwrap();
    cpu.enter();
    let last = GPA + 4096 - 4;
    assert_eq!(
        cpu.write_u64(last, u64::MAX),
        Err(Exit::Unaligned { gpa: last }),
        "an 8-byte write at the last 4 bytes of a page"
    );
    assert_eq!(cpu.read_u64(last), Err(Exit::Unaligned { gpa: last }));
    assert_eq!(
        cpu.write_u64(GPA + 1, 1),
        Err(Exit::Unaligned { gpa: GPA + 1 })
    );
    // Nothing was written anywhere: not past the first host page, not into the second slot.
    assert_eq!(
        host_u64(&ram, 4096),
        0,
        "wrote into the host page after the slot"
    );
    assert_eq!(
        host_u64(&ram, 2 * MIB),
        0,
        "wrote into the next slot's page"
    );
    let mut bitmap = [0u64; 1];
    // A harvest may flush: not from the thread of a vCPU in guest mode.
    cpu.exit();
    vm.get_dirty_log(2, &mut bitmap).unwrap();
    cpu.enter();
    assert_eq!(bitmap[0], 0, "the logged slot was not written");
    // Aligned accesses still work, at both ends of the page.
    cpu.write_u64(GPA + 4096 - 8, 0xabcd).unwrap();
    assert_eq!(cpu.read_u64(GPA + 4096 - 8), Ok(0xabcd));
    assert_eq!(host_u64(&ram, 4096 - 8), 0xabcd);
    cpu.exit();
    cpu.destroy();
}

fn accesses_outside_guest_mode_are_refused<F: PteFormat>() {
    let (vm, _ram) = two_page_vm::<F>();
    let mut cpu = Cpu::new(vm, 0, 64, Arc::new(PcpuPool::new(1))).unwrap();
    assert_eq!(cpu.write_u64(GPA, 1), Err(Exit::NotInGuest));
    assert_eq!(cpu.read_u64(GPA), Err(Exit::NotInGuest));
    cpu.enter();
    cpu.enter(); // idempotent
    cpu.write_u64(GPA, 7).unwrap();
    cpu.exit();
    assert_eq!(cpu.read_u64(GPA), Err(Exit::NotInGuest));
}

/// The caller drops its handle to the RAM while the VM still maps it: the memslots keep it
/// mapped, so the vCPU's accesses stay inside live memory.
fn guest_ram_lives_as_long_as_its_memslots<F: PteFormat>() {
    let (vm, ram) = two_page_vm::<F>();
    let weak = Arc::downgrade(&ram);
    drop(ram);
    let mut cpu = Cpu::new(vm.clone(), 0, 64, Arc::new(PcpuPool::new(1))).unwrap();
    cpu.enter();
    cpu.write_u64(GPA + 8, 42).unwrap();
    assert_eq!(cpu.read_u64(GPA + 8), Ok(42));
    cpu.exit();
    assert!(weak.upgrade().is_some(), "slots hold the RAM");
    vm.delete_memslot(1).unwrap();
    vm.delete_memslot(2).unwrap();
    drop(cpu);
    assert!(
        weak.upgrade().is_none(),
        "RAM unmapped once no slot can reach it"
    );
}
