//! Loom models of the engine's races, run on the real engine code compiled against loom's
//! atomics, locks and Arc (`crates/slat/src/sync.rs`):
//! `RUSTFLAGS="--cfg loom" cargo test -p slat --test loom --release`.
//! Each memslot is backed by a real (zeroed, 4 KiB) [`HostBuffer`], although the engine never
//! dereferences guest memory on EPT.
#![cfg(loom)]

#[path = "common/loom_thread.rs"]
mod thread;
use slat::{Access, Ept, Fault, FaultOutcome, HostBuffer, HostRange, MemslotFlags, Vm, VmConfig};
use slat_addr::Gfn;
use slat_addr::Gpa;
use std::sync::Arc;

const GPA: u64 = 0x10_0000;

/// One page of host memory for the memslot at [`GPA`].
fn host_page() -> HostRange {
    let buf = HostBuffer::new(4096, 4096).expect("allocate a host page");
    HostRange::new(Arc::new(buf)).expect("host range")
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    // Linking a table scans its 512 entries and the checks walk the tree: many loads.
    b.max_branches = 1_000_000;
    // The model's own thread has loom's default stack: run the body on one with more room.
    let f = std::sync::Arc::new(f);
    b.check(move || {
        let f = std::sync::Arc::clone(&f);
        thread::spawn(move || f()).join().expect("model body");
    });
}

fn vm_with_page(config: VmConfig) -> Arc<Vm<Ept>> {
    let vm = Vm::<Ept>::new(config);
    vm.add_memslot(1, Gpa::new(GPA), 4096, host_page(), MemslotFlags::empty())
        .unwrap();
    vm
}

/// Invariant 1: two vCPUs faulting the same page on an empty table do the work once; the
/// loser sees Spurious or retries; the loser's table pages go back to its cache (no leak).
#[test]
fn install_race_installs_once() {
    model(|| {
        let vm = vm_with_page(VmConfig::default());
        let alloc = slat::hw::table_alloc(&vm).clone();
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let vm = vm.clone();
                thread::spawn(move || {
                    let mut v = vm.create_vcpu(i);
                    let f = Fault {
                        private: false,
                        gpa: Gpa::new(GPA),
                        access: Access::Write,
                        present: false,
                    };
                    let mut outcomes = Vec::new();
                    loop {
                        let o = v.handle_fault(f);
                        outcomes.push(o);
                        if o != FaultOutcome::Retry {
                            break;
                        }
                    }
                    drop(v);
                    outcomes
                })
            })
            .collect();
        let all: Vec<FaultOutcome> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
        let fixed = all.iter().filter(|o| **o == FaultOutcome::Fixed).count();
        assert_eq!(fixed, 1, "exactly one install: {all:?}");
        let s = vm.stats();
        assert_eq!(s.leaves_4k, 1);
        assert_eq!(s.table_pages, 4, "root + one table per level");
        assert!(vm.lookup(Gfn::new(GPA >> 12)).is_some());
        drop(vm);
        assert_eq!(alloc.live_pages(), 0, "table pages leaked");
    });
}

/// A vCPU fixes a write-protection fault on the fast path while the host harvests: the page
/// must be reported by that harvest or the next one (invariants 3 and 4).
fn fast_path_write_vs_harvest(config: VmConfig) {
    let vm = vm_with_page(config);
    let mut v = vm.create_vcpu(0);
    let f = Fault {
        private: false,
        gpa: Gpa::new(GPA),
        access: Access::Write,
        present: false,
    };
    assert_eq!(v.handle_fault(f), FaultOutcome::Fixed);
    vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
        .unwrap();
    let writer = {
        // The vCPU holds its VM.
        thread::spawn(move || {
            let f = Fault {
                private: false,
                gpa: Gpa::new(GPA),
                access: Access::Write,
                present: true,
            };
            let o = v.handle_fault(f);
            drop(v);
            o
        })
    };
    let mut first = [0u64; 1];
    vm.get_dirty_log(1, &mut first).unwrap();
    let o = writer.join().unwrap();
    assert!(
        matches!(o, FaultOutcome::FixedFast | FaultOutcome::Fixed),
        "{o:?}"
    );
    let mut second = [0u64; 1];
    vm.get_dirty_log(1, &mut second).unwrap();
    let st = vm.stats();
    assert_eq!(
        (first[0] | second[0]) & 1,
        1,
        "the write fix was reported by neither harvest: {o:?} {st:?}"
    );
}

/// The per-word exchange harvest (KVM today).
#[test]
fn fast_path_write_is_never_lost_to_a_harvest() {
    model(|| fast_path_write_vs_harvest(VmConfig::default()));
}

/// The bitmap-switch harvest (`GetLogVariant::Switch`): flip bitmaps, drain markers, read the old
/// one without atomics.
#[test]
fn fast_path_write_is_never_lost_to_a_switch_harvest() {
    model(|| {
        fast_path_write_vs_harvest(VmConfig {
            get_log: slat::GetLogVariant::Switch,
            ..VmConfig::default()
        })
    });
}

/// A VM logging into dirty rings whose page at [`GPA`] is mapped, harvested and reset (so
/// write-protected), and its vCPU.
fn ring_vm_with_protected_page(config: VmConfig) -> (Arc<Vm<Ept>>, slat::Vcpu<Ept>) {
    let vm = Vm::<Ept>::new(config);
    vm.enable_dirty_ring(128, false).unwrap();
    vm.add_memslot(
        1,
        Gpa::new(GPA),
        4096,
        host_page(),
        MemslotFlags::LOG_DIRTY_PAGES,
    )
    .unwrap();
    let mut v = vm.create_vcpu(0);
    let f = Fault {
        private: false,
        gpa: Gpa::new(GPA),
        access: Access::Write,
        present: false,
    };
    assert_eq!(v.handle_fault(f), FaultOutcome::Fixed);
    let ring = v.dirty_ring().unwrap().clone();
    // Harvest the install's entry and re-protect the page.
    assert_eq!(ring.harvest(|_, _| {}), 1);
    assert_eq!(vm.reset_dirty_rings().unwrap(), 1);
    (vm, v)
}

/// A write fault on the protected page; drops the vCPU (which holds its VM).
fn write_fix(mut v: slat::Vcpu<Ept>) -> FaultOutcome {
    let f = Fault {
        private: false,
        gpa: Gpa::new(GPA),
        access: Access::Write,
        present: true,
    };
    let o = v.handle_fault(f);
    drop(v);
    o
}

fn spte_writable(vm: &Vm<Ept>) -> bool {
    use slat::PteFormat;
    let (spte, _) = vm.lookup(Gfn::new(GPA >> 12)).unwrap();
    Ept::is_writable(spte)
}

/// The dirty ring against a concurrent harvest + reset: the write fix pushes its entry before
/// the SPTE becomes writable and, if the harvest took it before the update, pushes another
/// that the reset waits for (its flush for the fast path; the MMU lock for a slow path under
/// `rmap-lockless`). So a writable page always has an entry not yet reset, and the fix is
/// reported once or twice, never zero times. Run with either side on the spawned thread: loom
/// explores the spawned thread's steps between the other's far more thoroughly.
fn ring_write_vs_harvest_and_reset(config: VmConfig, spawn_harvester: bool) {
    let (vm, v) = ring_vm_with_protected_page(config);
    let ring = v.dirty_ring().unwrap().clone();
    // Harvest and reset, then (the reset having returned) look at the page: if it is
    // writable, its entry — the first, or the one pushed again — is there to collect.
    let harvest_and_reset = {
        let (vm, ring) = (vm.clone(), ring.clone());
        move || {
            let first = ring.harvest(|_, _| {});
            vm.reset_dirty_rings().unwrap();
            let writable = spte_writable(&vm);
            let second = ring.harvest(|_, _| {});
            assert!(
                !writable || second >= 1,
                "writable after the reset returned, but no entry to collect"
            );
            (first, second)
        }
    };
    let (o, (first, second)) = if spawn_harvester {
        let h = thread::spawn(harvest_and_reset);
        let o = write_fix(v);
        (o, h.join().unwrap())
    } else {
        let w = thread::spawn(move || write_fix(v));
        let seen = harvest_and_reset();
        (w.join().unwrap(), seen)
    };
    assert!(
        matches!(o, FaultOutcome::FixedFast | FaultOutcome::Fixed),
        "{o:?}"
    );
    let pending = ring.harvest(|_, _| {});
    let seen = first + second + pending;
    assert!(
        (1..=2).contains(&seen),
        "the write fix was logged {seen} times"
    );
    // Entries of `second` and `pending` are harvested but not reset.
    assert!(
        !spte_writable(&vm) || second + pending >= 1,
        "the page is writable but its entry was already reset"
    );
}

/// The bitmap's slow path under `rmap-lockless`: a GET that consumed the first mark and
/// re-armed without the MMU lock before the fix's update must wait for the fix's second mark
/// (taking the lock once) before it returns, or a write through the new W completed before the
/// next GET is missing from it.
#[test]
fn slow_path_second_mark_lands_before_a_lockless_get_returns() {
    model(|| {
        let vm = vm_with_page(VmConfig {
            fast_pf: false,
            wrprot: slat::WrprotVariant::RmapLockless,
            ..VmConfig::default()
        });
        let mut v = vm.create_vcpu(0);
        let install = Fault {
            private: false,
            gpa: Gpa::new(GPA),
            access: Access::Write,
            present: false,
        };
        assert_eq!(v.handle_fault(install), FaultOutcome::Fixed);
        vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
            .unwrap();
        let harvester = {
            let vm = vm.clone();
            thread::spawn(move || {
                let mut first = [0u64; 1];
                vm.get_dirty_log(1, &mut first).unwrap();
                let writable = spte_writable(&vm);
                let mut second = [0u64; 1];
                vm.get_dirty_log(1, &mut second).unwrap();
                assert!(
                    !writable || second[0] & 1 == 1,
                    "writable after a GET returned, but the next GET does not report it"
                );
            })
        };
        let o = write_fix(v);
        assert_eq!(o, FaultOutcome::Fixed);
        harvester.join().unwrap();
    });
}

/// The fast path (in guest mode: the reset's flush waits for it).
#[test]
fn fast_path_write_is_never_lost_to_a_ring_reset() {
    model(|| ring_write_vs_harvest_and_reset(VmConfig::default(), false));
    model(|| ring_write_vs_harvest_and_reset(VmConfig::default(), true));
}

/// The slow path with `rmap-lockless`, whose reset re-protects without the MMU lock and
/// takes it once before returning.
#[test]
fn slow_path_write_is_never_lost_to_a_lockless_ring_reset() {
    let config = VmConfig {
        fast_pf: false,
        wrprot: slat::WrprotVariant::RmapLockless,
        ..VmConfig::default()
    };
    model(move || ring_write_vs_harvest_and_reset(config, false));
    model(move || ring_write_vs_harvest_and_reset(config, true));
}

/// Invariant 3 for rings: the entry is visible before the page is writable, so a harvest
/// that starts after another vCPU could have written the page (it sees W) collects it. Pushing
/// after the update (as KVM's fast path does) fails this: the page arrives a harvest late.
/// (The harvester is the spawned thread: loom then explores it running between the vCPU's
/// update and its push.)
fn ring_entry_precedes_write_permission(config: VmConfig) {
    let (vm, v) = ring_vm_with_protected_page(config);
    let ring = v.dirty_ring().unwrap().clone();
    let harvester = {
        let vm = vm.clone();
        thread::spawn(move || {
            let writable = spte_writable(&vm);
            let collected = ring.harvest(|_, _| {});
            assert!(
                !writable || collected >= 1,
                "a harvest that started after the page became writable did not collect its entry"
            );
        })
    };
    let o = write_fix(v);
    assert!(
        matches!(o, FaultOutcome::FixedFast | FaultOutcome::Fixed),
        "{o:?}"
    );
    harvester.join().unwrap();
}

#[test]
fn fast_path_ring_entry_precedes_write_permission() {
    model(|| ring_entry_precedes_write_permission(VmConfig::default()));
}

#[test]
fn slow_path_ring_entry_precedes_write_permission() {
    model(|| {
        ring_entry_precedes_write_permission(VmConfig {
            fast_pf: false,
            ..VmConfig::default()
        })
    });
}
