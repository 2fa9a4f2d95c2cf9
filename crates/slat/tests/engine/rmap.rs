//! The reverse map (`VmConfig::wrprot`), audited against the tree after every step
//! of a life cycle that moves gfns between levels and tables: huge faults, eager and lazy
//! splits, harvests, recovery, zaps, a slot move and a delete; then no table page or rmap slot
//! is left behind (`teardown` waits for the two-grace-period retire of every unlinked page).
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::{Access, FaultOutcome, MemslotFlags, PteFormat, Vm, VmConfig, WrprotVariant};
use slat_addr::{Gfn, Gpa, PAGE_SIZE};

const MIB: u64 = 1 << 20;
const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;

both_formats! {
    rmap_follows_every_structural_change,
    walk_keeps_no_rmap,
}

fn audit<F: PteFormat>(vm: &Vm<F>, step: &str) -> u64 {
    match vm.audit_rmap() {
        Ok(n) => n,
        Err(e) => panic!("{} after {step}: {e}", vm.config().wrprot),
    }
}

fn rmap_follows_every_structural_change<F: PteFormat>() {
    for wrprot in [WrprotVariant::Rmap, WrprotVariant::RmapLockless] {
        for eager_split in [true, false] {
            life_cycle::<F>(VmConfig {
                wrprot,
                eager_split,
                ..VmConfig::default()
            });
        }
    }
}

fn life_cycle<F: PteFormat>(config: VmConfig) {
    let vm = Vm::<F>::new(config);
    let mut v = vm.create_vcpu(0);
    let base = 4 * MIB;
    let m = HostMem::new(4 * MIB);
    vm.add_memslot(
        1,
        Gpa::new(base),
        4 * MIB,
        m.range(HUGE_2M),
        MemslotFlags::empty(),
    )
    .unwrap();
    let w = |v: &mut slat::Vcpu<F>, gpa: u64, present: bool| {
        let mut o = fault(&vm, v, gpa, Access::Write, present);
        for _ in 0..4 {
            if o != FaultOutcome::Retry {
                break;
            }
            o = fault(&vm, v, gpa, Access::Write, present);
        }
        o
    };
    w(&mut v, base + 0x3000, false);
    w(&mut v, base + HUGE_2M + 0x7000, false);
    assert_eq!(vm.stats().leaves_2m, 2);
    assert_eq!(audit(&vm, "two huge faults"), 2);
    vm.set_memslot_flags(1, LOG).unwrap();
    audit(&vm, "enable logging");
    for gpa in [base + 0x3000, base + 0x9000, base + HUGE_2M + 0x7000] {
        w(&mut v, gpa, true);
        audit(&vm, "a write after enabling logging");
    }
    let mut words = vec![0u64; 16];
    assert_eq!(vm.get_dirty_log(1, &mut words), Ok(3));
    audit(&vm, "GET");
    for gpa in [base + 0x3000, base + 0x9000] {
        assert!(
            !F::is_writable(vm.lookup(Gfn::new(gpa / PAGE_SIZE)).unwrap().0),
            "{}: GET left {gpa:#x} writable",
            config.wrprot
        );
    }
    w(&mut v, base + 0x9000, true);
    vm.set_memslot_flags(1, MemslotFlags::empty()).unwrap();
    audit(&vm, "disable logging (recovery)");
    vm.zap_gfn_range(
        Gfn::new((base + HUGE_2M) / PAGE_SIZE),
        Gfn::new((base + HUGE_2M) / PAGE_SIZE + 1),
    )
    .expect("not refused: no CPU of this thread in guest mode");
    audit(&vm, "a partial zap");
    w(&mut v, base + HUGE_2M + 0x5000, false);
    audit(&vm, "a fault after the zap");
    vm.move_memslot(1, Gpa::new(64 * MIB)).unwrap();
    assert_eq!(audit(&vm, "a move"), 0, "the move left leaves");
    w(&mut v, 64 * MIB + 0x1000, false);
    assert!(audit(&vm, "a fault in the moved slot") > 0);
    vm.delete_memslot(1).unwrap();
    assert_eq!(audit(&vm, "delete"), 0);
    teardown(vm, [v]);
    drop(m);
}

/// `walk` keeps today's fault path: no rmap at all, and the audit says so.
fn walk_keeps_no_rmap<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig::default());
    let mut v = vm.create_vcpu(0);
    let m = HostMem::new(2 * MIB);
    vm.add_memslot(1, Gpa::new(4 * MIB), 2 * MIB, m.range(PAGE_SIZE), LOG)
        .unwrap();
    fault(&vm, &mut v, 4 * MIB, Access::Write, false);
    assert_eq!(vm.audit_rmap(), Ok(1));
    teardown(vm, [v]);
    drop(m);
}
