//! The simulated machine surfaces private memory's exit: its accesses are shared, so a page
//! made `PRIVATE` (`Vm::set_memory_attributes`) faults with `Exit::MemoryFault` (KVM's
//! `KVM_EXIT_MEMORY_FAULT`), and after the VMM converts it back the access runs, through the
//! shared backing, even if the vCPU had cached the translation before both conversions.

use slat::{HostRange, MemoryAttributes, MemslotFlags, PteFormat, Vm, VmConfig};
use slat_addr::{Gfn, Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use slat_machine::sched::PcpuPool;
use slat_machine::{Cpu, Exit};
use slat_workload::{Backing, GuestRam};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GPA: u64 = 64 * MIB;

both_formats! {
    a_shared_access_to_a_private_page_exits_to_the_vmm,
    a_shared_access_never_uses_a_private_translation,
}

fn a_shared_access_to_a_private_page_exits_to_the_vmm<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, 4 * MIB, true).unwrap());
    let shared = HostRange::slice(ram.clone(), 0, 2 * MIB).unwrap();
    let private = HostRange::slice(ram.clone(), 2 * MIB, 2 * MIB).unwrap();
    vm.add_memslot_with_private(
        1,
        Gpa::new(GPA),
        2 * MIB,
        shared,
        private,
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut cpu = Cpu::new(vm.clone(), 0, 64, Arc::new(PcpuPool::new(1))).unwrap();
    cpu.enter();
    let gpa = GPA + 3 * PAGE_SIZE + 16;
    cpu.write_u64(gpa, 0x1234).unwrap();
    cpu.exit();
    // The VMM converts the page while the vCPU is out (its TLB still holds the translation).
    vm.set_memory_attributes(Gpa::new(gpa).gfn(), 1, MemoryAttributes::PRIVATE)
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
    vm.set_memory_attributes(Gpa::new(gpa).gfn(), 1, MemoryAttributes::empty())
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

/// A confidential guest (`MachineConfig::private`): one memstress pass accepts every page it
/// touches, lazily, through the direct map; the private writes never reach the shared RAM;
/// with `kernel_flush` the other vCPU acknowledges kernel TLB flushes.
#[test]
fn a_confidential_guest_accepts_every_page_it_touches() {
    use slat::direct_map::DirectMapConfig;
    use slat::DirectMapPolicy;
    use slat_machine::{Machine, MachineConfig};
    use slat_workload::{PassParams, RegionSpec};
    for policy in DirectMapPolicy::ALL.iter().copied() {
        let m = Machine::<slat::Ept>::new(MachineConfig {
            region: RegionSpec {
                vcpus: 2,
                bytes_per_vcpu: 8 * MIB,
                ..RegionSpec::default()
            },
            private: Some(DirectMapConfig {
                policy,
                kernel_flush: true,
                collapse: false,
            }),
            ..MachineConfig::default()
        })
        .unwrap();
        let map = m.direct_map().unwrap().clone();
        assert_eq!(map.stats().accepted, 0, "{policy}: acceptance is lazy");
        let r = m.run_pass(PassParams::default()).unwrap();
        let pages = m.layout().total_pages();
        let s = map.stats();
        assert_eq!(s.accepted, pages, "{policy}");
        assert_eq!(s.assigned, pages, "{policy}");
        match policy {
            DirectMapPolicy::Split2M => assert_eq!(s.splits, 16 * MIB / (2 * MIB), "{policy}"),
            _ => assert_eq!(s.splits, 0, "{policy}"),
        }
        let pool = map.pool().addr();
        for p in 0..pages {
            let hva = pool.raw() + p * PAGE_SIZE;
            let expect = if policy == DirectMapPolicy::Untouched {
                Some(hva)
            } else {
                None
            };
            assert_eq!(
                map.translate(Hva::new(hva)).unwrap().map(|t| t.0.raw()),
                expect,
                "{policy} page {p}"
            );
            assert_eq!(
                m.page_value(p),
                Some(0),
                "{policy}: a private write reached shared RAM"
            );
        }
        if policy != DirectMapPolicy::Untouched {
            let acks: u64 = r.vcpus.iter().map(|v| v.counters.kernel_tlb_flushes).sum();
            assert!(s.flush_requests >= pages, "{policy}: {s:?}");
            assert!(
                acks > 0,
                "{policy}: no vCPU acknowledged a kernel TLB flush"
            );
        }
        // Converting the guest's memory back to shared returns every page to the direct map.
        let gfn = m.layout().gpa >> PAGE_SHIFT;
        m.vm()
            .set_memory_attributes(Gfn::new(gfn), pages, MemoryAttributes::empty())
            .unwrap();
        let s = map.stats();
        assert_eq!((s.assigned, s.released), (0, pages), "{policy}");
        // Now the guest's private accesses disagree with the memory: a memory-fault exit.
        match m.run_pass(PassParams::default()) {
            Err(slat_machine::MachineError::UnexpectedExit {
                exit: Exit::MemoryFault { private: true, .. },
                ..
            }) => {}
            other => panic!("{policy}: {other:?}"),
        }
    }
}

/// The RMP check: once a page is mapped privately, a shared access to it (from the TLB or
/// through the walker) exits instead of reading the private page, and the reverse.
fn a_shared_access_never_uses_a_private_translation<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, 4 * MIB, true).unwrap());
    let shared = HostRange::slice(ram.clone(), 0, 2 * MIB).unwrap();
    let private = HostRange::slice(ram.clone(), 2 * MIB, 2 * MIB).unwrap();
    vm.add_memslot_with_private(
        1,
        Gpa::new(GPA),
        2 * MIB,
        shared,
        private,
        MemslotFlags::empty(),
    )
    .unwrap();
    vm.set_memory_attributes(Gpa::new(GPA).gfn(), 1, MemoryAttributes::PRIVATE)
        .unwrap();
    let mut cpu = Cpu::new(vm.clone(), 0, 64, Arc::new(PcpuPool::new(1))).unwrap();
    cpu.set_private_pool(ram.addr() + 2 * MIB, ram.addr() + 4 * MIB);
    cpu.enter();
    cpu.write_u64_as(GPA, 0x5ec2e7, true).unwrap();
    let exit = Exit::MemoryFault {
        gpa: GPA,
        size: PAGE_SIZE,
        private: false,
    };
    assert_eq!(
        cpu.read_u64_as(GPA, false),
        Err(exit),
        "TLB hit across kinds"
    );
    assert_eq!(cpu.write_u64_as(GPA + 8, 1, false), Err(exit));
    assert_eq!(cpu.read_u64_as(GPA, true), Ok(0x5ec2e7));
    // A shared page, read shared (cached), then accessed privately.
    let g2 = GPA + PAGE_SIZE;
    assert_eq!(cpu.read_u64_as(g2, false), Ok(0));
    assert_eq!(
        cpu.read_u64_as(g2, true),
        Err(Exit::MemoryFault {
            gpa: g2,
            size: PAGE_SIZE,
            private: true
        })
    );
    cpu.exit();
    cpu.destroy();
}
