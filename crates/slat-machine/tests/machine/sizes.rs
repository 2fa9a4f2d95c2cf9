//! Sizes and counts from a caller never panic or abort: every public constructor of this crate
//! that takes one answers with a typed error or a value. The allocation-heavy ones run again in
//! a child process under `prlimit --as` (an address-space limit), where an allocation that
//! fails aborts only the child and the parent reports it.
//!
//! Constructors covered (each with 0, 1, `u64::MAX`, `usize::MAX`, powers of two and their
//! neighbours, and random values):
//! - `Tlb::new(entries)`
//! - `Cpu::new(vm, id, tlb_entries, pool)` (and a first access through it)
//! - `Pacer::for_vcpus(rate, vcpus)`, `Pacer::new(rate)`
//! - `PcpuPool::new(n)` (and a release without an acquire)
//! - `Machine::new(MachineConfig { region: { vcpus, bytes_per_vcpu, slots }, tlb_entries,
//!   pcpus, gpa })`

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use slat::{Ept, Vm, VmConfig};
use slat_machine::sched::PcpuPool;
use slat_machine::tlb::{Tlb, TlbError, MAX_TLB_ENTRIES};
use slat_machine::{Cpu, Machine, MachineConfig, Pacer, PacerError};
use slat_workload::RegionSpec;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[path = "../../../test-support/as_limit.rs"]
pub(crate) mod as_limit;
use as_limit::{rerun_under_as_limit, rerun_with_thread_stacks, size, threads_of_this_process};

const AS_LIMIT: u64 = 2 << 30;
/// The vCPU threads' stacks in the children of the tests whose machines start threads until
/// the address space runs out (see `rerun_with_thread_stacks`).
pub(crate) const THREAD_STACK: u64 = 64 << 20;

fn pool() -> Arc<PcpuPool> {
    Arc::new(PcpuPool::new(1))
}

/// A CPU with a TLB of 0 entries masked every GFN with `0 - 1` and indexed an empty array
/// on its first access; now the count is refused, with no vCPU left behind in the VM.
#[test]
fn a_cpu_with_a_tlb_of_zero_entries_is_refused() {
    let vm = Vm::<Ept>::new(VmConfig::default());
    assert_eq!(
        Cpu::new(vm.clone(), 0, 0, pool()).err(),
        Some(TlbError::Entries(0))
    );
    assert_eq!(Tlb::new(0).err(), Some(TlbError::Entries(0)));
    assert!(Cpu::new(vm, 0, 1, pool()).is_ok(), "one entry is a TLB");
}

/// Entry and vCPU counts too large to allocate panicked (capacity overflow) or aborted.
#[test]
fn huge_tlb_and_pacer_counts_are_refused() {
    for n in [usize::MAX, 1 << 40, MAX_TLB_ENTRIES * 2] {
        assert_eq!(Tlb::new(n).err(), Some(TlbError::Entries(n)));
        let vm = Vm::<Ept>::new(VmConfig::default());
        assert_eq!(Cpu::new(vm, 0, n, pool()).err(), Some(TlbError::Entries(n)));
        assert_eq!(
            Pacer::for_vcpus(0, n).err(),
            Some(PacerError::TooManyVcpus(n))
        );
    }
}

/// TLBs, CPUs, pacers and CPU pools of any size: typed errors or values, and a value works
/// (under the address-space limit, in a child).
#[test]
fn cpus_tlbs_pacers_and_pools_of_any_size() {
    if rerun_under_as_limit(
        module_path!(),
        "cpus_tlbs_pacers_and_pools_of_any_size",
        AS_LIMIT,
    ) {
        return;
    }
    let cfg = Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    };
    let vm = Vm::<Ept>::new(VmConfig::default());
    TestRunner::new(cfg)
        .run(&(size(), size()), |(n, rate)| {
            let n = n as usize;
            if let Ok(mut t) = Tlb::new(n) {
                t.insert(5, 1, 0x1000, false, false);
                prop_assert_eq!(t.lookup(5, false, false), Some(0x1000));
            }
            if let Ok(mut cpu) = Cpu::new(vm.clone(), 0, n, pool()) {
                cpu.enter();
                // No memslot: an MMIO exit, not a panic.
                prop_assert!(cpu.write_u64(0, 1).is_err());
                cpu.exit();
            }
            if let Ok(p) = Pacer::for_vcpus(rate, n) {
                p.set_vcpu_throttle_ppm(n, 5_000);
                p.set_vcpu_rate(n.wrapping_sub(1), rate);
                prop_assert_eq!(p.vcpus(), n);
            }
            let _ = Pacer::new(rate);
            let p = PcpuPool::new(n);
            p.release();
            p.acquire();
            p.release();
            Ok(())
        })
        .unwrap();
}

/// Machines of any shape: a typed error or a machine (under the address-space limit, in a
/// child, where guest RAM beyond the limit cannot be mapped).
#[test]
fn machines_of_any_shape() {
    if rerun_with_thread_stacks(
        module_path!(),
        "machines_of_any_shape",
        AS_LIMIT,
        None,
        THREAD_STACK,
    ) {
        return;
    }
    let cfg = Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    };
    let small = prop_oneof![Just(0u64), Just(1), Just(2), Just(4), size()];
    // Mostly whole pages, so that many shapes get as far as mapping guest RAM.
    let bytes = prop_oneof![
        Just(4096u64),
        Just(1 << 20),
        size().prop_map(|b| b & !0xfff),
        size()
    ];
    let tlb = prop_oneof![Just(64u64), size()];
    let built = AtomicUsize::new(0);
    TestRunner::new(cfg)
        .run(
            &(small.clone(), bytes, small, tlb, size(), any::<bool>()),
            |(vcpus, bytes, slots, tlb, pcpus, gpa)| {
                let config = MachineConfig {
                    region: RegionSpec {
                        vcpus: vcpus as usize,
                        bytes_per_vcpu: bytes,
                        slots: slots as usize,
                        ..RegionSpec::default()
                    },
                    tlb_entries: tlb as usize,
                    pcpus: (pcpus % 64) as usize,
                    gpa: gpa.then_some(bytes),
                    ..MachineConfig::default()
                };
                if Machine::<Ept>::new(config).is_ok() {
                    built.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            },
        )
        .unwrap();
    // Not every shape is refused: a small one builds (and is torn down).
    let small = MachineConfig {
        region: RegionSpec {
            vcpus: 1,
            bytes_per_vcpu: 1 << 20,
            slots: 1,
            ..RegionSpec::default()
        },
        tlb_entries: 64,
        ..MachineConfig::default()
    };
    Machine::<Ept>::new(small).expect("a 1 MiB, 1-vCPU machine");
    eprintln!("{} random shapes built", built.load(Ordering::Relaxed));
}

/// A machine whose k-th vCPU thread cannot start (its stack does not fit under the
/// address-space limit) used to leave the k threads already started waiting at the start
/// barrier for ever, with their stacks and arenas: a process that went on after the error (a
/// sweep over shapes) ran out of address space. Now they are released and joined.
#[test]
fn a_machine_whose_threads_cannot_all_start_leaves_no_thread_behind() {
    if rerun_with_thread_stacks(
        module_path!(),
        "a_machine_whose_threads_cannot_all_start_leaves_no_thread_behind",
        AS_LIMIT,
        None,
        THREAD_STACK,
    ) {
        return;
    }
    let before = threads_of_this_process();
    // 4096 stacks of 64 MiB: the spawns fail part-way under the 2 GiB limit.
    let config = MachineConfig {
        region: RegionSpec {
            vcpus: 4096,
            bytes_per_vcpu: 4096,
            slots: 1,
            ..RegionSpec::default()
        },
        tlb_entries: 16,
        ..MachineConfig::default()
    };
    for round in 0..3 {
        let e = Machine::<Ept>::new(config).err();
        assert!(
            matches!(e, Some(slat_machine::MachineError::Thread(_))),
            "round {round}: {e:?}"
        );
        assert_eq!(threads_of_this_process(), before, "round {round}");
    }
    Machine::<Ept>::new(MachineConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 1 << 20,
            slots: 1,
            ..RegionSpec::default()
        },
        tlb_entries: 64,
        ..MachineConfig::default()
    })
    .expect("a 2-vCPU machine after the failed ones");
}
