//! The host direct map over a private pool (`slat::direct_map`, SNP's): its shape per
//! policy, lazy acceptance through private faults, release on conversion and deletion, the
//! invariant "maps exactly the unassigned frames" after random sequences (with table-page
//! leak accounting), a split that concurrent readers never see half done, the kernel TLB
//! flush reaching online host CPUs, and bad input.
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::direct_map::{Acceptance, DirectMap, DirectMapConfig, DirectMapError, PrivateMemory};
use slat::{
    Access, DirectMapPolicy, Ept, Fault, FaultOutcome, HostRange, MemoryAttributes, MemslotError,
    MemslotFlags, PteFormat, Vm, VmConfig,
};
use slat_addr::{Gfn, Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 512;

fn config(policy: DirectMapPolicy, kernel_flush: bool, collapse: bool) -> DirectMapConfig {
    DirectMapConfig {
        policy,
        kernel_flush,
        collapse,
    }
}

/// A pool of `len` bytes, 2 MiB aligned, and its direct map.
fn pool(len: u64, cfg: DirectMapConfig) -> (HostMem, Arc<DirectMap>) {
    let mem = HostMem::new(len);
    let map = DirectMap::new(mem.range(PAGE_SIZE), cfg).expect("direct map");
    (mem, map)
}

/// Every frame of the pool is mapped (at its own address) iff it is not assigned.
fn check_invariant(mem: &HostMem, map: &DirectMap, ctx: &str) {
    for f in 0..mem.len() / PAGE_SIZE {
        let hva = mem.addr() + f * PAGE_SIZE;
        let assigned = map.is_assigned(Hva::new(hva)).unwrap();
        let t = map.translate(Hva::new(hva)).unwrap();
        let policy = map.config().policy;
        match (policy, assigned, t) {
            (DirectMapPolicy::Untouched, _, Some((h, _))) => assert_eq!(h, Hva::new(hva), "{ctx}"),
            (_, false, Some((h, _))) => {
                assert_eq!(h, Hva::new(hva), "{ctx}: frame {f} maps elsewhere")
            }
            (_, true, None) => {}
            (p, a, t) => panic!("{ctx}: frame {f} assigned={a} translates to {t:?} ({p})"),
        }
    }
}

/// Live table pages settle to the linked ones: nothing leaked.
fn check_no_leak(map: &DirectMap, ctx: &str) {
    let a = map.audit().expect("audit");
    wait_for_reclaim(map.table_alloc(), a.tables);
    assert!(a.leaves.iter().sum::<u64>() > 0, "{ctx}: empty map");
}

#[test]
fn each_policy_builds_the_expected_leaves() {
    let len = 8 * MIB;
    for (policy, leaves) in [
        (DirectMapPolicy::Split2M, [0, 4, 0]),
        (DirectMapPolicy::Untouched, [0, 4, 0]),
        (DirectMapPolicy::Pre4K, [2048, 0, 0]),
    ] {
        let (mem, map) = pool(len, config(policy, false, false));
        let a = map.audit().expect("audit");
        assert_eq!(a.leaves, leaves, "{policy}");
        assert_eq!(
            map.stats().leaves,
            leaves,
            "{policy}: gauges agree with the walk"
        );
        check_invariant(&mem, &map, policy.name());
        check_no_leak(&map, policy.name());
    }
    // A pool that is not 2 MiB aligned gets 4 KiB leaves where 2 MiB ones cannot fit.
    let mem = HostMem::new(8 * MIB);
    let odd = mem.sub_range(PAGE_SIZE, 5 * MIB, PAGE_SIZE);
    let map = DirectMap::new(odd, DirectMapConfig::default()).unwrap();
    let a = map.audit().expect("audit");
    assert_eq!(a.leaves[1], 1, "one aligned 2 MiB block inside");
    assert_eq!(a.leaves[0], 5 * 256 - 512, "the rest at 4 KiB");
}

#[test]
fn acceptance_splits_once_per_block_and_removes_one_page() {
    let (mem, map) = pool(4 * MIB, config(DirectMapPolicy::Split2M, false, false));
    let hva = mem.addr() + 7 * PAGE_SIZE;
    // The page allocator cleared it through the direct map before it left.
    unsafe_write(hva, 0xdead);
    assert_eq!(
        map.accept(Hva::new(hva)),
        Ok(Acceptance::Accepted { split: true })
    );
    assert_eq!(map.accept(Hva::new(hva)), Ok(Acceptance::Already));
    assert_eq!(map.translate(Hva::new(hva)), Ok(None), "removed");
    assert_eq!(
        map.read_u64(Hva::new(hva)),
        Ok(None),
        "the host cannot read it"
    );
    assert_eq!(
        map.accept(Hva::new(hva + PAGE_SIZE)),
        Ok(Acceptance::Accepted { split: false }),
        "the block is split already"
    );
    let s = map.stats();
    assert_eq!((s.accepted, s.assigned, s.splits), (2, 2, 1));
    assert_eq!(s.leaves, [510, 1, 0]);
    // The other block is untouched.
    assert_eq!(
        map.translate(Hva::new(mem.addr() + 2 * MIB))
            .unwrap()
            .map(|t| t.1),
        Some(2)
    );
    check_invariant(&mem, &map, "after two acceptances");
    // Release scrubs: what the guest wrote never reaches the host's view.
    unsafe_write(hva, 0x5ec2e7);
    assert_eq!(map.release(Hva::new(hva)), Ok(true));
    assert_eq!(
        map.read_u64(Hva::new(hva)),
        Ok(Some(0)),
        "scrubbed on release"
    );
    assert_eq!(
        map.release(Hva::new(hva)),
        Ok(false),
        "not assigned any more"
    );
    check_invariant(&mem, &map, "after a release");
    check_no_leak(&map, "split");
}

#[test]
fn collapse_restores_the_2m_leaf_when_the_block_is_whole_again() {
    let (mem, map) = pool(2 * MIB, config(DirectMapPolicy::Split2M, false, true));
    let (a, b) = (mem.addr(), mem.addr() + 300 * PAGE_SIZE);
    map.accept(Hva::new(a)).unwrap();
    map.accept(Hva::new(b)).unwrap();
    let tables = map.audit().unwrap().tables;
    map.release(Hva::new(a)).unwrap();
    assert_eq!(map.stats().collapses, 0, "one page is still out");
    map.release(Hva::new(b)).unwrap();
    let s = map.stats();
    assert_eq!(s.collapses, 1);
    assert_eq!(map.audit().expect("audit").leaves, [0, 1, 0]);
    assert_eq!(
        map.audit().expect("audit").tables,
        tables - 1,
        "the leaf table left the tree"
    );
    assert!(s.flushes + s.flush_requests > 0, "freeing a table flushes");
    check_invariant(&mem, &map, "collapsed");
    check_no_leak(&map, "collapse");
}

/// Random sequences of acceptances and releases over every policy and switch: after each
/// step the direct map maps exactly the unassigned frames, and no table page leaks.
#[test]
fn random_sequences_keep_the_invariant_and_leak_nothing() {
    let seed = seed_from_env(0xd1ec7);
    for policy in DirectMapPolicy::ALL.iter().copied() {
        for collapse in [false, true] {
            let mut rng = Rng::new(seed ^ (policy as u64) << 8 ^ collapse as u64);
            let ctx = format!("seed {seed:#x} policy {policy} collapse {collapse}");
            let (mem, map) = pool(6 * MIB, config(policy, true, collapse));
            let frames = mem.len() / PAGE_SIZE;
            let mut assigned = vec![false; frames as usize];
            for step in 0..600 {
                // Work in one block at a time, mostly, so blocks fill and empty whole.
                let block = rng.below(frames / BLOCK);
                let span = if rng.chance(1, 2) { 4 } else { BLOCK };
                let f = block * BLOCK + rng.below(span);
                let hva = mem.addr() + f * PAGE_SIZE;
                if rng.chance(1, 2) {
                    let r = map.accept(Hva::new(hva)).unwrap();
                    assert_eq!(
                        matches!(r, Acceptance::Already),
                        assigned[f as usize],
                        "{ctx} step {step}"
                    );
                    assigned[f as usize] = true;
                } else {
                    assert_eq!(
                        map.release(Hva::new(hva)),
                        Ok(assigned[f as usize]),
                        "{ctx} {step}"
                    );
                    assigned[f as usize] = false;
                }
                if step % 50 == 0 {
                    check_invariant(&mem, &map, &format!("{ctx} step {step}"));
                }
            }
            // Give everything back: with collapse, only 2 MiB leaves remain.
            for f in 0..frames {
                map.release(Hva::new(mem.addr() + f * PAGE_SIZE)).unwrap();
            }
            check_invariant(&mem, &map, &ctx);
            if collapse && policy == DirectMapPolicy::Split2M {
                assert_eq!(map.audit().expect("audit").leaves, [0, 3, 0], "{ctx}");
            }
            check_no_leak(&map, &ctx);
        }
    }
}

/// Readers translate pages that are never accepted while a writer accepts and releases their
/// neighbours (splitting and collapsing their blocks): a split publishes a full table in one
/// step, so no reader ever finds such a page unmapped.
#[test]
fn a_split_is_atomic_to_concurrent_readers() {
    let seed = seed_from_env(0x5b117);
    let (mem, map) = pool(8 * MIB, config(DirectMapPolicy::Split2M, false, true));
    let base = mem.addr();
    let frames = mem.len() / PAGE_SIZE;
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    // Odd frames are the readers', even frames the writer's.
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (map, stop, reads) = (map.clone(), stop.clone(), reads.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed + r);
                while !stop.load(Ordering::Relaxed) {
                    let f = rng.below(frames / 2) * 2 + 1;
                    let hva = base + f * PAGE_SIZE;
                    let t = map.translate(Hva::new(hva)).unwrap();
                    assert_eq!(t.map(|t| t.0.raw()), Some(hva), "seed {seed:#x}: frame {f}");
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let mut rng = Rng::new(seed);
    let mut splits = 0;
    for _ in 0..4000 {
        let f = rng.below(frames / 2) * 2;
        let hva = base + f * PAGE_SIZE;
        if let Acceptance::Accepted { split: true } = map.accept(Hva::new(hva)).unwrap() {
            splits += 1;
        }
        if rng.chance(1, 3) {
            // Release the whole block's even frames, so it may collapse.
            let block = f / BLOCK * BLOCK;
            for g in (block..block + BLOCK).step_by(2) {
                map.release(Hva::new(base + g * PAGE_SIZE)).unwrap();
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("a reader saw a hole");
    }
    assert!(splits > 10, "seed {seed:#x}: only {splits} splits");
    assert!(map.stats().collapses > 10);
    assert!(reads.load(Ordering::Relaxed) > 1000);
    check_no_leak(&map, "concurrent");
}

/// With `kernel_flush`, a removal completes only after every online host CPU acknowledged;
/// an offline one is not waited for.
#[test]
fn kernel_flush_waits_for_online_host_cpus() {
    let (mem, map) = pool(2 * MIB, config(DirectMapPolicy::Pre4K, true, false));
    let mut cpu = map.host_cpu();
    // Returns although the CPU never acknowledges: it is offline.
    map.accept(Hva::new(mem.addr())).unwrap();
    assert_eq!(map.stats().flush_requests, 1);
    let stop = Arc::new(AtomicBool::new(false));
    let up = Arc::new(AtomicBool::new(false));
    let acks = Arc::new(AtomicU64::new(0));
    let t = {
        let (stop, up, acks) = (stop.clone(), up.clone(), acks.clone());
        std::thread::spawn(move || {
            let online = cpu.online();
            cpu.service(|| {});
            up.store(true, Ordering::Release);
            while !stop.load(Ordering::Relaxed) {
                if cpu.pending() != 0 {
                    cpu.service(|| {
                        acks.fetch_add(1, Ordering::Relaxed);
                    });
                }
                std::hint::spin_loop();
            }
            drop(online);
        })
    };
    while !up.load(Ordering::Acquire) {
        std::thread::yield_now();
    }
    for i in 1..=3 {
        map.accept(Hva::new(mem.addr() + i * PAGE_SIZE)).unwrap();
        assert_eq!(
            acks.load(Ordering::Relaxed),
            i,
            "the flush returned before the online CPU acknowledged"
        );
    }
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
}

/// The engine: a private fault in a slot bound to the pool accepts its page first; a
/// conversion to shared and the slot's deletion release it, scrubbed.
#[test]
fn private_faults_accept_and_conversions_release() {
    let (mem, map) = pool(4 * MIB, config(DirectMapPolicy::Split2M, false, true));
    let vm = Vm::<Ept>::new(VmConfig::default());
    let shared = HostMem::new(2 * MIB);
    let gpa = 1u64 << 30;
    let gfn = gpa >> PAGE_SHIFT;
    let private = map.bind(2 * MIB, 2 * MIB).unwrap();
    vm.add_memslot_with_private(
        1,
        Gpa::new(gpa),
        2 * MIB,
        shared.range(PAGE_SIZE),
        private.clone(),
        MemslotFlags::empty(),
    )
    .unwrap();
    vm.set_memory_attributes(Gfn::new(gfn), 512, MemoryAttributes::PRIVATE)
        .unwrap();
    assert_eq!(map.stats().accepted, 0, "acceptance is lazy");
    let mut v = vm.create_vcpu(0);
    let fault = |g: u64| Fault {
        gpa: Gpa::new(g << PAGE_SHIFT),
        access: Access::Write,
        present: false,
        private: true,
    };
    for i in [0, 5, 6] {
        assert_eq!(v.handle_fault(fault(gfn + i)), FaultOutcome::Fixed);
    }
    let page = |i: u64| mem.addr() + 2 * MIB + i * PAGE_SIZE;
    assert_eq!(map.stats().accepted, 3);
    assert_eq!(map.translate(Hva::new(page(5))), Ok(None));
    let (leaf, _) = vm.lookup(Gfn::new(gfn + 5)).unwrap();
    assert_eq!(
        <Ept as PteFormat>::output_addr(leaf),
        Hva::new(page(5)),
        "mapped privately"
    );
    // The guest writes a secret; converting page 5 to shared releases it, scrubbed.
    unsafe_write(page(5), 0x5ec2e7);
    vm.set_memory_attributes(Gfn::new(gfn + 5), 1, MemoryAttributes::empty())
        .unwrap();
    assert_eq!(map.read_u64(Hva::new(page(5))), Ok(Some(0)));
    assert_eq!(map.stats().released, 1);
    check_invariant(&mem, &map, "after conversion");
    // A second slot cannot take the same pool range; an overlapping bind is refused.
    assert_eq!(
        vm.add_memslot_with_private(
            2,
            Gpa::new(gpa + 4 * MIB),
            2 * MIB,
            shared.range(PAGE_SIZE),
            private,
            MemslotFlags::empty()
        ),
        Err(MemslotError::PrivateAlreadyBound { id: 2 })
    );
    bound_pages_refuse_the_caller(&map, page(6), page(7));
    // Deleting the slot gives every accepted page back (and the 2 MiB leaf, collapsed).
    vm.delete_memslot(1).unwrap();
    assert_eq!(map.stats().assigned, 0);
    check_invariant(&mem, &map, "after delete");
    assert_eq!(map.audit().expect("audit").leaves, [0, 2, 0]);
    drop(v);
    drop(vm);
    // The lease is gone with the slot: the range binds again.
    assert!(map.bind(2 * MIB, 2 * MIB).is_ok());
    check_no_leak(&map, "engine");
}

/// Bound pages are the engine's: a caller cannot release one from under the guest. The pool range of a
/// bound slot binds no second time either.
fn bound_pages_refuse_the_caller(map: &Arc<DirectMap>, page6: u64, page7: u64) {
    assert_eq!(
        map.release(Hva::new(page6)),
        Err(DirectMapError::Bound {
            hva: Hva::new(page6)
        })
    );
    assert_eq!(
        map.accept(Hva::new(page7)),
        Err(DirectMapError::Bound {
            hva: Hva::new(page7)
        })
    );
    assert_eq!(
        map.translate(Hva::new(page6)),
        Ok(None),
        "still the guest's"
    );
    assert_eq!(
        map.bind(3 * MIB, MIB).err(),
        Some(DirectMapError::AlreadyBound {
            offset: 3 * MIB,
            len: MIB
        })
    );
}

#[test]
fn bad_input_is_refused() {
    let (mem, map) = pool(2 * MIB, DirectMapConfig::default());
    let end = mem.addr() + mem.len();
    assert!(matches!(
        map.accept(Hva::new(end)),
        Err(DirectMapError::NotInPool { .. })
    ));
    assert!(matches!(
        map.release(Hva::new(mem.addr() - 1)),
        Err(DirectMapError::NotInPool { .. })
    ));
    assert!(map.translate(Hva::new(u64::MAX)).is_err());
    for (off, len) in [(0, 0), (1, PAGE_SIZE), (0, 3 * MIB), (!0xfff, PAGE_SIZE)] {
        assert!(
            matches!(map.bind(off, len), Err(DirectMapError::BadRange { .. })),
            "bind({off:#x}, {len:#x})"
        );
    }
    // SAFETY: never mapped or touched: refused before anything reads it.
    let beyond = unsafe { HostRange::from_raw(Hva::new(1 << 48), 2 * MIB, PAGE_SIZE) };
    assert!(matches!(
        DirectMap::new(beyond, DirectMapConfig::default()),
        Err(DirectMapError::PoolOutOfRange { .. })
    ));
    assert_eq!(map.stats().accepted, 0, "nothing changed");
    check_invariant(&mem, &map, "bad input");
    let _ = PrivateMemory::from(mem.range(PAGE_SIZE));
}

/// Stands in for a guest's (or a test's) write to pool memory.
fn unsafe_write(hva: u64, v: u64) {
    // SAFETY: `hva` is an 8-byte aligned address inside a live `HostMem` pool of the caller.
    unsafe { AtomicU64::from_ptr(hva as *mut u64) }.store(v, Ordering::Relaxed);
}

/// A VM dropped with private pages still accepted (no `delete_memslot`): its lease hands the
/// range to the map, which releases the pages at its next operation and only then lets the
/// range be bound again.
#[test]
fn a_dropped_binding_gives_its_pages_back() {
    let (mem, map) = pool(2 * MIB, config(DirectMapPolicy::Split2M, false, true));
    let vm = Vm::<Ept>::new(VmConfig::default());
    let shared = HostMem::new(2 * MIB);
    let gpa = 1u64 << 30;
    let private = map.bind(0, 2 * MIB).unwrap();
    vm.add_memslot_with_private(
        1,
        Gpa::new(gpa),
        2 * MIB,
        shared.range(PAGE_SIZE),
        private,
        MemslotFlags::empty(),
    )
    .unwrap();
    vm.set_memory_attributes(Gpa::new(gpa).gfn(), 512, MemoryAttributes::PRIVATE)
        .unwrap();
    let mut v = vm.create_vcpu(0);
    let f = Fault {
        gpa: Gpa::new(gpa),
        access: Access::Write,
        present: false,
        private: true,
    };
    assert_eq!(v.handle_fault(f), FaultOutcome::Fixed);
    assert_eq!(map.stats().assigned, 1);
    drop(v);
    drop(vm);
    assert!(
        matches!(
            map.bind(0, PAGE_SIZE),
            Err(DirectMapError::AlreadyBound { .. })
        ),
        "bindable only after its pages are back"
    );
    map.release_orphans()
        .expect("not refused: no CPU of this thread in guest mode");
    assert_eq!(map.stats().assigned, 0);
    check_invariant(&mem, &map, "orphans released");
    assert_eq!(
        map.audit().expect("audit").leaves,
        [0, 1, 0],
        "collapsed back"
    );
    assert!(map.bind(0, 2 * MIB).is_ok());
    check_no_leak(&map, "orphans");
}

/// Random conversions and private faults through the engine, for every policy: after each
/// step the direct map maps exactly the frames that are not assigned, and a frame is assigned
/// only while its page is private and was touched since it became private.
#[test]
fn random_conversions_keep_the_direct_map_exact() {
    let seed = seed_from_env(0xc0de);
    for policy in DirectMapPolicy::ALL.iter().copied() {
        let mut rng = Rng::new(seed ^ policy as u64);
        let ctx = format!("seed {seed:#x} policy {policy}");
        let (mem, map) = pool(4 * MIB, config(policy, true, true));
        let vm = Vm::<Ept>::new(VmConfig::default());
        let shared = HostMem::new(4 * MIB);
        let gpa = 1u64 << 30;
        let gfn0 = gpa >> PAGE_SHIFT;
        let pages = 1024;
        let private = map.bind(0, 4 * MIB).unwrap();
        vm.add_memslot_with_private(
            1,
            Gpa::new(gpa),
            4 * MIB,
            shared.range(PAGE_SIZE),
            private,
            MemslotFlags::empty(),
        )
        .unwrap();
        let mut v = vm.create_vcpu(0);
        let mut is_private = vec![false; pages];
        let mut touched = vec![false; pages];
        for step in 0..400 {
            if rng.chance(1, 3) {
                convert_random_range(&vm, &mut rng, gfn0, &mut is_private, &mut touched);
            } else {
                let p = rng.below(pages as u64);
                let f = Fault {
                    gpa: Gpa::new(gpa + p * PAGE_SIZE),
                    access: Access::Write,
                    present: false,
                    private: is_private[p as usize],
                };
                assert!(
                    matches!(
                        v.handle_fault(f),
                        FaultOutcome::Fixed | FaultOutcome::Spurious
                    ),
                    "{ctx} step {step}"
                );
                touched[p as usize] = true;
            }
            check_assigned_exactly(
                &map,
                mem.addr(),
                &is_private,
                &touched,
                &format!("{ctx} step {step}"),
            );
            if step % 40 == 0 {
                check_invariant(&mem, &map, &format!("{ctx} step {step}"));
            }
        }
        drop(v);
        vm.delete_memslot(1).unwrap();
        check_invariant(&mem, &map, &ctx);
        if policy == DirectMapPolicy::Split2M {
            assert_eq!(
                map.audit().expect("audit").leaves,
                [0, 2, 0],
                "{ctx}: collapsed back"
            );
        }
        check_no_leak(&map, &ctx);
    }
}

/// Converts a random range of up to 600 pages to private or shared, tracking the model:
/// a page whose attribute changes is untouched since.
fn convert_random_range(
    vm: &Vm<Ept>,
    rng: &mut Rng,
    gfn0: u64,
    is_private: &mut [bool],
    touched: &mut [bool],
) {
    let pages = is_private.len();
    let first = rng.below(pages as u64);
    let n = 1 + rng.below((pages as u64 - first).min(600));
    let to = rng.chance(1, 2);
    let attrs = if to {
        MemoryAttributes::PRIVATE
    } else {
        MemoryAttributes::empty()
    };
    vm.set_memory_attributes(Gfn::new(gfn0 + first), n, attrs)
        .unwrap();
    for p in first..first + n {
        if is_private[p as usize] != to {
            touched[p as usize] = false;
        }
        is_private[p as usize] = to;
    }
}

/// The direct map assigns exactly the frames of pages that are private and touched since.
fn check_assigned_exactly(
    map: &DirectMap,
    base: u64,
    is_private: &[bool],
    touched: &[bool],
    ctx: &str,
) {
    for p in 0..is_private.len() {
        let hva = base + p as u64 * PAGE_SIZE;
        let want = is_private[p] && touched[p];
        assert_eq!(
            map.is_assigned(Hva::new(hva)).unwrap(),
            want,
            "{ctx} page {p}"
        );
    }
}
