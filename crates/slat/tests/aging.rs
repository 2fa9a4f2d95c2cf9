//! Aging (`clear_young`, `clear_flush_young`, `test_young`) and idle page tracking, in both
//! hardware modes and at every leaf size; and aging racing with vCPUs whose hardware walker
//! sets A/D bits, with the lock-free fast path restoring access-tracked leaves, and with
//! dirty-log harvests. Randomised tests print their seed (SLAT_TEST_SEED reruns one).
#![cfg(not(loom))]

#[macro_use]
mod common;

use common::*;
use slat::hw::TablePage;
use slat::hw::{pages_per_entry, table_index};
use slat::{
    Access, AgeFlush, Fault, FaultOutcome, IdleBitmap, IdleError, Level, MemslotFlags, PteFormat,
    Vcpu, Vm, VmConfig,
};
use slat_addr::{Gfn, Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;

both_formats! {
    age_and_test_age_with_ad_bits_at_every_leaf_size,
    age_and_test_age_without_ad_bits_at_every_leaf_size,
    without_the_fast_path_the_slow_path_restores_tracked_leaves,
    huge_leaf_straddling_the_range_counts_only_pages_inside,
    clear_flush_young_flushes_and_clear_young_does_not,
    aging_a_logged_slot_keeps_every_dirty_page_in_the_log,
    idle_bitmap_tracks_exactly_the_pages_touched_since_marking,
    idle_bitmap_rejects_bad_ranges,
    aging_races_with_faults_fast_path_restores_and_hardware_ad_updates,
    no_dirty_page_is_lost_when_aging_races_with_harvests,
}

fn config(ad_bits: bool) -> VmConfig {
    VmConfig {
        ad_bits,
        ..VmConfig::default()
    }
}

/// The D bit of an A/D-enabled leaf (EPT bit 9). Format difference: stage-2 has no dirty bit
/// (no DBM, as in upstream KVM) and the engine counts every leaf as dirty there
/// (`PteFormat::is_dirty`), so "aging keeps D" holds trivially on stage-2.
fn d_bit<F: PteFormat>(leaf: u64) -> bool {
    if is_ept::<F>() {
        leaf & (1 << 9) != 0
    } else {
        F::is_dirty(leaf)
    }
}

/// A test vCPU without a TLB: every access walks the table the way `slat-machine`'s hardware
/// walker does (setting A, and D on a write, with a compare-and-swap), faults through the fast
/// path in guest mode and the slow path outside it, and acknowledges flushes only between
/// accesses, so table pages it walks cannot be freed under it.
struct HwCpu<F: PteFormat> {
    vcpu: Vcpu<F>,
    faults: u64,
    fast: u64,
}

impl<F: PteFormat> HwCpu<F> {
    fn new(vm: &Arc<Vm<F>>, id: u32) -> Self {
        HwCpu {
            vcpu: vm.create_vcpu(id),
            faults: 0,
            fast: 0,
        }
    }

    /// The VM this vCPU belongs to.
    fn vm(&self) -> &Arc<Vm<F>> {
        self.vcpu.vm()
    }

    /// One guest access to `gpa`, in guest mode from entry to completion (so the host's
    /// flushes wait for it only while it runs: single-threaded tests can flush between
    /// accesses).
    fn access(&mut self, gpa: u64, access: Access) {
        let mut guest = self.vcpu.enter_guest();
        if guest.requests_at_entry() != 0 {
            self.vcpu.service_requests(|| {});
        }
        loop {
            match self.walk(gpa, access) {
                // Dropping the token leaves guest mode.
                Ok(()) => return,
                Err(present) => {
                    self.faults += 1;
                    let f = Fault {
                        private: false,
                        gpa: Gpa::new(gpa),
                        access,
                        present,
                    };
                    let fast = self.vcpu.fast_page_fault(&guest, f);
                    let o = match fast {
                        Some(o) => o,
                        None => {
                            // The slow path runs outside guest mode.
                            drop(guest);
                            let o = self.vcpu.slow_page_fault(f);
                            guest = self.vcpu.enter_guest();
                            if guest.requests_at_entry() != 0 {
                                self.vcpu.service_requests(|| {});
                            }
                            o
                        }
                    };
                    if o == FaultOutcome::FixedFast {
                        self.fast += 1;
                    }
                    assert!(
                        !matches!(
                            o,
                            FaultOutcome::NoSlot
                                | FaultOutcome::ReadOnly
                                | FaultOutcome::InGuestMode
                        ),
                        "gpa {gpa:#x}: unexpected {o:?}"
                    );
                }
            }
            if self.vcpu.pending_requests() != 0 {
                self.vcpu.service_requests(|| {});
            }
        }
    }

    fn walk(&self, gpa: u64, access: Access) -> Result<(), bool> {
        let gfn = gpa >> PAGE_SHIFT;
        let mut table = slat::hw::root_addr(self.vm());
        let mut level: Level = F::ROOT_LEVEL;
        loop {
            // SAFETY: the root or a table reached through present entries during this access,
            // in guest mode: a table unlinked meanwhile is freed only after a flush this vCPU
            // acknowledges between accesses.
            let t = unsafe { TablePage::at(Hva::new(table.raw())) };
            let ep = &t.entries[table_index(Gfn::new(gfn), level)];
            let e = ep.load(Ordering::Acquire);
            if F::hw_is_table(e, level) {
                table = Hva::new(F::output_addr(e).raw());
                level -= 1;
                continue;
            }
            if !F::permits(e, access) {
                return Err(F::permits(e, Access::Read) || F::permits(e, Access::Exec));
            }
            let want = F::set_accessed_dirty(e, access);
            if want != e
                && ep
                    .compare_exchange(e, want, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                table = slat::hw::root_addr(self.vm());
                level = F::ROOT_LEVEL;
                continue;
            }
            return Ok(());
        }
    }

    fn finish(self) -> Vcpu<F> {
        self.vcpu
    }
}

/// A VM with one slot of `pages` 4 KiB pages at `gpa`, mapped by leaves of `level`.
fn vm_with_leaf_size<F: PteFormat>(
    ad_bits: bool,
    level: Level,
) -> (Arc<Vm<F>>, Option<HostMem>, u64, u64) {
    let vm = Vm::<F>::new(config(ad_bits));
    let gpa = 1u64 << 30;
    let (host, mem, size) = match level {
        1 => {
            let m = HostMem::new(64 * PAGE_SIZE);
            (m.range(PAGE_SIZE), Some(m), 64 * PAGE_SIZE)
        }
        2 => {
            let m = HostMem::new(2 * HUGE_2M);
            (m.range(HUGE_2M), Some(m), 2 * HUGE_2M)
        }
        // Reserved, never written: the engine and the test walker only read tables.
        _ => {
            let m = HostMem::reserve(HUGE_1G, HUGE_1G);
            (m.range(HUGE_1G), Some(m), HUGE_1G)
        }
    };
    vm.add_memslot(1, Gpa::new(gpa), size, host, MemslotFlags::empty())
        .unwrap();
    (vm, mem, gpa, size >> PAGE_SHIFT)
}

fn leaf<F: PteFormat>(vm: &Vm<F>, gpa: u64) -> (u64, Level) {
    vm.lookup(Gpa::new(gpa).gfn())
        .unwrap_or_else(|| panic!("gpa {gpa:#x} not mapped"))
}

fn age_and_test_age_with_ad_bits_at_every_leaf_size<F: PteFormat>() {
    for level in [1u8, 2, 3] {
        let (vm, _mem, gpa, _) = vm_with_leaf_size::<F>(true, level);
        let mut cpu = HwCpu::new(&vm, 0);
        cpu.access(gpa, Access::Write);
        let (l0, lv) = leaf(&vm, gpa);
        assert_eq!(lv, level);
        let pages = pages_per_entry(level);
        let (g0, g1) = (gpa >> PAGE_SHIFT, (gpa >> PAGE_SHIFT) + pages);
        assert!(
            F::is_accessed(l0) && d_bit::<F>(l0),
            "level {level}: fresh leaf {l0:#x}"
        );

        // Testing does not clear: twice young, leaf unchanged.
        for _ in 0..2 {
            let t = vm.test_young(Gfn::new(g0), Gfn::new(g1));
            assert_eq!(
                (t.young_pages, t.young_leaves, t.aged_leaves),
                (pages, 1, 0)
            );
            assert_eq!(t.mapped_pages, pages);
            assert_eq!(
                leaf(&vm, gpa).0,
                l0,
                "level {level}: test_young changed the leaf"
            );
        }

        let mut dirty = Vec::new();
        let r = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |g, n| dirty.push((g, n)));
        assert_eq!(
            (r.young_pages, r.aged_leaves, r.dirty_pages),
            (pages, 1, pages)
        );
        assert!(!r.flushed);
        assert_eq!(
            dirty,
            vec![(Gfn::new(g0), pages)],
            "level {level}: dirty leaf not reported"
        );
        let (l1, _) = leaf(&vm, gpa);
        assert!(!F::is_accessed(l1), "level {level}: A still set: {l1:#x}");
        assert!(d_bit::<F>(l1), "level {level}: aging cleared D: {l1:#x}");
        assert!(
            F::permits(l1, Access::Write),
            "A/D mode must keep permissions"
        );
        assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, 0);
        // Aging an old leaf changes nothing.
        let again = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |_, _| {
            panic!("old leaf reported dirty")
        });
        assert_eq!((again.young_pages, again.aged_leaves), (0, 0));

        // The hardware walker sets A again on a read anywhere in the leaf; no fault.
        let faults = cpu.faults;
        cpu.access(gpa + (pages - 1) * PAGE_SIZE, Access::Read);
        assert_eq!(
            cpu.faults, faults,
            "an A/D-mode access to an aged leaf faulted"
        );
        assert!(F::is_accessed(leaf(&vm, gpa).0));
        assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, pages);
        check_audit(&vm, "ad aging");
        teardown(vm, [cpu.finish()]);
    }
}

fn age_and_test_age_without_ad_bits_at_every_leaf_size<F: PteFormat>() {
    for level in [1u8, 2, 3] {
        for first in [Access::Read, Access::Write] {
            let ctx = format!("level {level}, {first:?} after aging");
            let (vm, _mem, gpa, _) = vm_with_leaf_size::<F>(false, level);
            let mut cpu = HwCpu::new(&vm, 0);
            cpu.access(gpa, Access::Write);
            let (l0, _) = leaf(&vm, gpa);
            let pages = pages_per_entry(level);
            let (g0, g1) = (gpa >> PAGE_SHIFT, (gpa >> PAGE_SHIFT) + pages);
            assert!(F::is_writable(l0) && F::is_accessed(l0));
            let t = vm.test_young(Gfn::new(g0), Gfn::new(g1));
            assert_eq!((t.young_pages, t.aged_leaves), (pages, 0));
            assert_eq!(leaf(&vm, gpa).0, l0, "{ctx}: test_young changed the leaf");

            // A writable leaf is dirty: reported before aging (which drops W on EPT).
            let mut dirty = Vec::new();
            let r = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |g, n| dirty.push((g, n)));
            assert_eq!((r.aged_leaves, r.dirty_pages), (1, pages), "{ctx}");
            assert_eq!(
                dirty,
                vec![(Gfn::new(g0), pages)],
                "{ctx}: the dirty page was dropped"
            );
            let (l1, lv1) = leaf(&vm, gpa);
            assert_eq!(lv1, level);
            assert!(
                F::is_present(l1) && F::is_access_tracked(l1),
                "{ctx}: {l1:#x}"
            );
            for a in [Access::Read, Access::Write, Access::Exec] {
                assert!(!F::permits(l1, a), "{ctx}: tracked leaf permits {a:?}");
            }
            assert_eq!(F::output_addr(l1), F::output_addr(l0));
            assert!(F::is_mmu_writable(l1), "{ctx}: aging lost MMU-writable");
            assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, 0);
            assert_eq!(
                vm.stats().leaves_4k + vm.stats().leaves_2m + vm.stats().leaves_1g,
                1
            );

            // The next access faults; the fast path restores without the MMU lock.
            let fast = cpu.fast;
            cpu.access(gpa + (pages - 1) * PAGE_SIZE, first);
            assert_eq!(cpu.fast, fast + 1, "{ctx}: not fixed by the fast path");
            let (l2, _) = leaf(&vm, gpa);
            assert!(!F::is_access_tracked(l2), "{ctx}: {l2:#x}");
            assert!(F::permits(l2, Access::Read));
            // Format difference: stage-2 maps X only for an instruction fetch (an executable
            // mapping costs an instruction-cache invalidation), and this leaf was mapped by a
            // write; EPT maps guest RAM executable up front.
            assert_eq!(
                F::permits(l2, Access::Exec),
                !F::CACHE_MAINTENANCE,
                "{ctx}: X after restore {l2:#x}"
            );
            // Format difference: EPT access tracking parks R/X in software bits and drops W,
            // which only a write brings back; stage-2 access tracking clears only AF, so the
            // restore gives back the writable leaf it aged.
            let writable = first == Access::Write || !is_ept::<F>();
            if !is_ept::<F>() {
                assert_eq!(l2, l0, "{ctx}: restore is not the leaf that was aged");
            }
            assert_eq!(
                F::is_writable(l2),
                writable,
                "{ctx}: W after restore {l2:#x}"
            );
            assert_eq!(vm.test_young(Gfn::new(g0), Gfn::new(g1)).young_pages, pages);
            // A read-restored leaf is clean (not writable): the next aging reports nothing
            // dirty.
            let r = vm.clear_young(Gfn::new(g0), Gfn::new(g1), |_, _| {});
            assert_eq!(r.dirty_pages, if writable { pages } else { 0 }, "{ctx}");
            check_audit(&vm, &ctx);
            teardown(vm, [cpu.finish()]);
        }
    }
}

fn without_the_fast_path_the_slow_path_restores_tracked_leaves<F: PteFormat>() {
    let vm = Vm::<F>::new(VmConfig {
        ad_bits: false,
        fast_pf: false,
        ..VmConfig::default()
    });
    let mem = HostMem::new(8 * PAGE_SIZE);
    let gpa = 0x10_0000;
    vm.add_memslot(
        1,
        Gpa::new(gpa),
        mem.len(),
        mem.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let mut cpu = HwCpu::new(&vm, 0);
    cpu.access(gpa, Access::Write);
    let g = gpa >> PAGE_SHIFT;
    assert_eq!(
        vm.clear_young(Gfn::new(g), Gfn::new(g + 8), |_, _| {})
            .aged_leaves,
        1
    );
    let before = vm.stats().pf_fixed;
    cpu.access(gpa, Access::Write);
    assert_eq!(cpu.fast, 0);
    assert_eq!(
        vm.stats().pf_fixed,
        before + 1,
        "the slow path did not fix it"
    );
    let (l, _) = leaf(&vm, gpa);
    assert!(F::is_writable(l) && F::is_accessed(l));
    check_audit(&vm, "slow restore");
    teardown(vm, [cpu.finish()]);
}

fn huge_leaf_straddling_the_range_counts_only_pages_inside<F: PteFormat>() {
    for ad in [true, false] {
        let (vm, _mem, gpa, _) = vm_with_leaf_size::<F>(ad, 2);
        let mut cpu = HwCpu::new(&vm, 0);
        cpu.access(gpa, Access::Read);
        let g = gpa >> PAGE_SHIFT;
        // 100 pages from the middle of the 2 MiB leaf: the whole leaf ages (one Accessed
        // state), only the 100 pages count as young, but the dirty report covers the whole
        // leaf (its W, without A/D bits, is gone for all 512 pages).
        let mut dirty = Vec::new();
        let r = vm.clear_young(Gfn::new(g + 300), Gfn::new(g + 400), |f, n| {
            dirty.push((f, n))
        });
        assert_eq!(
            dirty,
            vec![(Gfn::new(g), 512)],
            "ad {ad}: dirty report of a straddling leaf"
        );
        assert_eq!(r.dirty_pages, 512);
        assert_eq!(
            (r.young_pages, r.mapped_pages, r.aged_leaves),
            (100, 100, 1)
        );
        assert_eq!(
            vm.test_young(Gfn::new(g), Gfn::new(g + 512)).young_pages,
            0,
            "ad {ad}"
        );
        // A range across chunk edges and beyond the slot still sees the leaf once.
        cpu.access(gpa, Access::Read);
        let r = vm.test_young(
            Gfn::new(g.saturating_sub(5 * slat::AGE_CHUNK_PAGES)),
            Gfn::new(g + 1024),
        );
        assert_eq!((r.young_leaves, r.young_pages), (1, 512), "ad {ad}");
        teardown(vm, [cpu.finish()]);
    }
}

fn clear_flush_young_flushes_and_clear_young_does_not<F: PteFormat>() {
    for ad in [true, false] {
        let vm = Vm::<F>::new(config(ad));
        let mem = HostMem::new(16 * PAGE_SIZE);
        let gpa = 0x20_0000;
        vm.add_memslot(
            1,
            Gpa::new(gpa),
            mem.len(),
            mem.range(PAGE_SIZE),
            MemslotFlags::empty(),
        )
        .unwrap();
        let mut cpu = HwCpu::new(&vm, 0);
        let g = gpa >> PAGE_SHIFT;
        for p in 0..16 {
            cpu.access(gpa + p * PAGE_SIZE, Access::Write);
        }
        let req = |vm: &Vm<F>| vm.stats().remote_tlb_flush_requests;
        // Without A/D bits this clears W on 16 writable leaves (EPT), which would owe a flush
        // anywhere else: clear_young still does not flush.
        let r0 = req(&vm);
        let r = vm.clear_young(Gfn::new(g), Gfn::new(g + 16), |_, _| {});
        assert_eq!(r.aged_leaves, 16);
        assert_eq!(req(&vm), r0, "ad {ad}: clear_young flushed");
        for p in 0..16 {
            cpu.access(gpa + p * PAGE_SIZE, Access::Read);
        }
        let r = vm
            .clear_flush_young(Gfn::new(g), Gfn::new(g + 16), |_, _| {})
            .unwrap();
        assert!(r.flushed && r.aged_leaves == 16);
        assert_eq!(
            req(&vm),
            r0 + 1,
            "ad {ad}: clear_flush_young did not flush once"
        );
        // Nothing young but something mapped: still one flush (translations cached since
        // the clear_young above must not survive).
        let r = vm
            .clear_flush_young(Gfn::new(g), Gfn::new(g + 16), |_, _| {})
            .unwrap();
        assert!(r.flushed && r.aged_leaves == 0);
        assert_eq!(req(&vm), r0 + 2);
        // Nothing mapped: nothing to flush.
        let r = vm
            .clear_flush_young(Gfn::new(g + 16), Gfn::new(g + 1024), |_, _| {})
            .unwrap();
        assert!(!r.flushed && r.mapped_pages == 0);
        assert_eq!(req(&vm), r0 + 2);
        teardown(vm, [cpu.finish()]);
    }
}

fn aging_a_logged_slot_keeps_every_dirty_page_in_the_log<F: PteFormat>() {
    for ad in [true, false] {
        let vm = Vm::<F>::new(config(ad));
        let mem = HostMem::new(64 * PAGE_SIZE);
        let gpa = 0x40_0000;
        let npages = 64;
        vm.add_memslot(1, Gpa::new(gpa), mem.len(), mem.range(PAGE_SIZE), LOG)
            .unwrap();
        let g = gpa >> PAGE_SHIFT;
        let mut cpu = HwCpu::new(&vm, 0);
        let harvest = |vm: &Vm<F>| {
            let mut w = vec![0u64; 1];
            vm.get_dirty_log(1, &mut w).unwrap();
            bitmap_gfns(g, &w)
        };
        // Write the even pages, read the odd ones.
        for p in 0..npages {
            let a = if p % 2 == 0 {
                Access::Write
            } else {
                Access::Read
            };
            cpu.access(gpa + p * PAGE_SIZE, a);
        }
        let mut reported = HashSet::new();
        let r = vm.clear_young(Gfn::new(g), Gfn::new(g + npages), |first, n| {
            reported.extend(first.raw()..first.raw() + n);
        });
        assert_eq!(r.aged_leaves, npages, "ad {ad}");
        let evens: HashSet<u64> = (0..npages).filter(|p| p % 2 == 0).map(|p| g + p).collect();
        if ad {
            // D is "may have been written": the slow path pre-sets it on every leaf it builds
            // MMU-writable, the read-only leaves of a logged slot included (a read fault there
            // is write_protect(make_leaf(writable))), so the report may over-approximate.
            assert!(
                reported.is_superset(&evens),
                "ad: a written page was not reported dirty"
            );
        } else {
            // Without A/D bits, dirty is W, which only writes set: exact.
            assert_eq!(
                reported, evens,
                "dirty report differs from the pages written"
            );
        }
        // Aging neither consumed nor added log marks.
        let h: HashSet<u64> = harvest(&vm).into_iter().collect();
        assert_eq!(
            h, evens,
            "ad {ad}: the log lost or gained pages through aging"
        );
        // After the harvest, write every page: each write after aging is logged again.
        vm.clear_young(Gfn::new(g), Gfn::new(g + npages), |_, _| {});
        for p in 0..npages {
            cpu.access(gpa + p * PAGE_SIZE, Access::Write);
        }
        let h = harvest(&vm);
        assert_eq!(
            h.len() as u64,
            npages,
            "ad {ad}: writes after aging were not logged"
        );
        for p in 0..npages {
            check_write_chain::<F>(leaf(&vm, gpa + p * PAGE_SIZE).0, "logged");
        }
        check_audit(&vm, "logged aging");
        teardown(vm, [cpu.finish()]);
    }
}

fn idle_bitmap_tracks_exactly_the_pages_touched_since_marking<F: PteFormat>() {
    let seed = seed_from_env(0xa6e1);
    eprintln!("seed {seed:#x} (SLAT_TEST_SEED reruns it)");
    for ad in [true, false] {
        let vm = Vm::<F>::new(config(ad));
        // 200 pages, not a multiple of 64; the last 20 never mapped.
        let npages = 200u64;
        let mem = HostMem::new(npages * PAGE_SIZE);
        let gpa = 0x80_0000;
        vm.add_memslot(
            1,
            Gpa::new(gpa),
            npages * PAGE_SIZE,
            mem.range(PAGE_SIZE),
            MemslotFlags::empty(),
        )
        .unwrap();
        let g = gpa >> PAGE_SHIFT;
        let mut cpu = HwCpu::new(&vm, 0);
        for p in 0..180 {
            cpu.access(gpa + p * PAGE_SIZE, Access::Write);
        }
        let mut b = IdleBitmap::new::<F>(Gfn::new(g), npages).unwrap();
        assert_eq!(b.idle_pages(), 0);
        // Flush, so the test's TLB-less vCPU and a real one would agree.
        let r = vm
            .mark_idle(&mut b, AgeFlush::Flush, |_, _| {})
            .expect("host thread");
        assert_eq!(r.aged_leaves, 180);
        assert_eq!(b.idle_pages(), npages);
        assert_eq!(
            vm.read_idle(&mut b),
            npages,
            "ad {ad}: nothing was accessed yet"
        );
        let mut rng = Rng::new(seed ^ ad as u64);
        let mut touched = HashSet::new();
        for _ in 0..120 {
            let p = rng.below(npages);
            let a = *rng.pick(&[Access::Read, Access::Write]);
            cpu.access(gpa + p * PAGE_SIZE, a);
            touched.insert(p);
        }
        let idle = vm.read_idle(&mut b);
        assert_eq!(
            idle,
            npages - touched.len() as u64,
            "ad {ad} seed {seed:#x}"
        );
        for p in 0..npages {
            assert_eq!(
                b.is_idle(Gfn::new(g + p)),
                Some(!touched.contains(&p)),
                "ad {ad} seed {seed:#x}: page {p}"
            );
        }
        assert_eq!(b.is_idle(Gfn::new(g + npages)), None);
        assert_eq!(b.is_idle(Gfn::new(g - 1)), None);
        // Reading changes nothing.
        assert_eq!(vm.read_idle(&mut b), idle);
        let ws = vm.working_set(&mut b);
        assert_eq!(ws.touched_pages, touched.len() as u64);
        assert!((ws.fraction() - touched.len() as f64 / npages as f64).abs() < 1e-12);
        // Marking again makes everything idle again.
        vm.mark_idle(&mut b, AgeFlush::NoFlush, |_, _| {})
            .expect("host thread");
        assert_eq!(vm.read_idle(&mut b), npages);
        teardown(vm, [cpu.finish()]);
    }
}

fn idle_bitmap_rejects_bad_ranges<F: PteFormat>() {
    assert_eq!(IdleBitmap::new::<F>(Gfn::new(0), 0), Err(IdleError::Empty));
    let max = 1u64 << (48 - 12);
    assert!(matches!(
        IdleBitmap::new::<F>(Gfn::new(max - 1), 2),
        Err(IdleError::OutOfRange { .. })
    ));
    assert!(matches!(
        IdleBitmap::new::<F>(Gfn::new(u64::MAX), 1),
        Err(IdleError::OutOfRange { .. })
    ));
    assert!(IdleBitmap::new::<F>(Gfn::new(max - 1), 1).is_ok());
    // Aging ranges beyond the format, empty or reversed, are no-ops, not panics.
    let vm = Vm::<F>::new(VmConfig::default());
    assert_eq!(
        vm.clear_young(Gfn::new(u64::MAX - 5), Gfn::new(u64::MAX), |_, _| {})
            .mapped_pages,
        0
    );
    assert_eq!(vm.test_young(Gfn::new(10), Gfn::new(5)).mapped_pages, 0);
    assert_eq!(
        vm.clear_flush_young(Gfn::new(0), Gfn::new(max), |_, _| {})
            .unwrap()
            .aged_leaves,
        0
    );
}

/// vCPUs write and read random pages (their walker setting A/D, their faults taking both
/// paths) while two host threads age random ranges over and over, with and without flushes, and
/// test them. Afterwards: the tree is consistent, and no dirty state was lost — with A/D bits
/// every written page's leaf still has D; without them every written page's leaf is still
/// writable or was reported to `on_dirty`.
fn aging_races_with_faults_fast_path_restores_and_hardware_ad_updates<F: PteFormat>() {
    let seed = seed_from_env(0xa9e5);
    eprintln!("seed {seed:#x} (SLAT_TEST_SEED reruns it)");
    for ad in [true, false] {
        for huge in [false, true] {
            let vm = Vm::<F>::new(config(ad));
            let size = 8 * HUGE_2M;
            let mem = HostMem::new(size);
            let gpa = 1u64 << 32;
            let psize = if huge { HUGE_2M } else { PAGE_SIZE };
            vm.add_memslot(
                1,
                Gpa::new(gpa),
                size,
                mem.range(psize),
                MemslotFlags::empty(),
            )
            .unwrap();
            let npages = size >> PAGE_SHIFT;
            let g = gpa >> PAGE_SHIFT;
            let stop = Arc::new(AtomicBool::new(false));
            let reported = Arc::new(Mutex::new(HashSet::new()));
            // Two agers, so passes also race each other on the same leaves.
            let agers: Vec<_> = (0..2u64)
                .map(|k| {
                    let (vm, stop, reported) = (vm.clone(), stop.clone(), reported.clone());
                    std::thread::spawn(move || {
                        let mut rng = Rng::new(seed ^ (0xa6e + k));
                        let (mut passes, mut aged) = (0u64, 0u64);
                        while !stop.load(Ordering::Relaxed) {
                            let lo = g + rng.below(npages);
                            let hi = lo + 1 + rng.below(g + npages - lo);
                            let mut rep = |f: Gfn, n: u64| {
                                let f = f.raw();
                                reported.lock().unwrap().extend(f..f + n);
                            };
                            let r = match rng.below(4) {
                                0 => vm
                                    .clear_flush_young(Gfn::new(lo), Gfn::new(hi), &mut rep)
                                    .unwrap(),
                                1 => vm.test_young(Gfn::new(lo), Gfn::new(hi)),
                                _ => vm.clear_young(Gfn::new(lo), Gfn::new(hi), &mut rep),
                            };
                            aged += r.aged_leaves;
                            passes += 1;
                        }
                        (passes, aged)
                    })
                })
                .collect();
            let deadline = Instant::now() + Duration::from_millis(400);
            let workers: Vec<_> = (0..3u32)
                .map(|t| {
                    let vm = vm.clone();
                    std::thread::spawn(move || {
                        let mut rng = Rng::new(seed.wrapping_add(t as u64 + 1));
                        let mut cpu = HwCpu::new(&vm, t);
                        let mut written = HashSet::new();
                        while Instant::now() < deadline {
                            for _ in 0..256 {
                                let p = rng.below(npages);
                                let a = if rng.chance(1, 2) {
                                    Access::Write
                                } else {
                                    Access::Read
                                };
                                cpu.access(gpa + p * PAGE_SIZE, a);
                                if a == Access::Write {
                                    written.insert(g + p);
                                }
                            }
                        }
                        let fast = cpu.fast;
                        (cpu.finish(), written, fast)
                    })
                })
                .collect();
            let mut vcpus = Vec::new();
            let mut written = HashSet::new();
            let mut fast = 0;
            for w in workers {
                let (v, wr, f) = w.join().expect("worker");
                vcpus.push(v);
                written.extend(wr);
                fast += f;
            }
            stop.store(true, Ordering::Relaxed);
            let (mut passes, mut aged) = (0, 0);
            for a in agers {
                let (p, n) = a.join().expect("ager");
                passes += p;
                aged += n;
            }
            let ctx = format!("ad {ad} huge {huge} seed {seed:#x}");
            assert!(
                passes > 0 && aged > 0,
                "{ctx}: the ager never aged anything"
            );
            if !ad {
                assert!(fast > 0, "{ctx}: no fast-path restore happened");
            }
            let reported = reported.lock().unwrap();
            for &gfn in &written {
                let (l, _) = vm.lookup(Gfn::new(gfn)).expect("written page unmapped");
                check_write_chain::<F>(l, &ctx);
                if ad {
                    assert!(
                        d_bit::<F>(l),
                        "{ctx}: gfn {gfn:#x} written but D clear: {l:#x}"
                    );
                } else {
                    assert!(
                        F::is_writable(l) || reported.contains(&gfn),
                        "{ctx}: gfn {gfn:#x} written, leaf {l:#x} not writable and never reported dirty"
                    );
                }
            }
            check_audit(&vm, &ctx);
            teardown(vm, vcpus);
        }
    }
}

/// In a logged slot, with and without A/D bits: vCPUs write while a host thread ages (no
/// flush) and another harvests the dirty log. Each page's last write must be reported by a
/// harvest that completed after that write began: the fast path restores access-tracked leaves
/// and logs the write, and a harvest after aging cleared W still flushes (its mark was
/// pending), so no write slips through unlogged. (A union of all harvests would hide a write
/// lost late in the run behind an earlier report of the same page.)
fn no_dirty_page_is_lost_when_aging_races_with_harvests<F: PteFormat>() {
    let seed = seed_from_env(0x10c);
    eprintln!("seed {seed:#x} (SLAT_TEST_SEED reruns it)");
    for ad in [false, true] {
        let vm = Vm::<F>::new(config(ad));
        let npages = 2048u64;
        let mem = HostMem::new(npages * PAGE_SIZE);
        let gpa = 1u64 << 31;
        vm.add_memslot(
            1,
            Gpa::new(gpa),
            npages * PAGE_SIZE,
            mem.range(PAGE_SIZE),
            LOG,
        )
        .unwrap();
        let g = gpa >> PAGE_SHIFT;
        let stop = Arc::new(AtomicBool::new(false));
        let ager = {
            let (vm, stop) = (vm.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += vm
                        .clear_young(Gfn::new(g), Gfn::new(g + npages), |_, _| {})
                        .aged_leaves;
                }
                n
            })
        };
        // Harvests completed so far; harvest k (from 1) is the k-th to return.
        let completed = Arc::new(AtomicU64::new(0));
        let harvester = {
            let (vm, stop, completed) = (vm.clone(), stop.clone(), completed.clone());
            std::thread::spawn(move || {
                // Per page, the last harvest that reported it.
                let mut last = vec![0u64; npages as usize];
                let mut w = vec![0u64; bitmap_words(npages)];
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    vm.get_dirty_log(1, &mut w).unwrap();
                    k += 1;
                    for gfn in bitmap_gfns(g, &w) {
                        last[(gfn - g) as usize] = k;
                    }
                    completed.store(k, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_micros(200));
                }
                last
            })
        };
        // 400 ms of writes, and at least 12 harvests during them (a loaded host schedules the
        // harvester rarely), capped at 20 s.
        let deadline = Instant::now() + Duration::from_millis(400);
        let cap = Instant::now() + Duration::from_secs(20);
        let workers: Vec<_> = (0..2u32)
            .map(|t| {
                let (vm, completed) = (vm.clone(), completed.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng::new(seed.wrapping_add(t as u64 * 77 + 1));
                    let mut cpu = HwCpu::new(&vm, t);
                    // Per page: harvests completed before its last write began.
                    let mut written = std::collections::HashMap::new();
                    let more = |c: &AtomicU64| {
                        let now = Instant::now();
                        now < cap && (now < deadline || c.load(Ordering::SeqCst) < 12)
                    };
                    while more(&completed) {
                        for _ in 0..128 {
                            let p = rng.below(npages);
                            let write = rng.chance(2, 3);
                            let before = completed.load(Ordering::SeqCst);
                            if write {
                                cpu.access(gpa + p * PAGE_SIZE, Access::Write);
                                written.insert(p, before);
                            } else {
                                cpu.access(gpa + p * PAGE_SIZE, Access::Read);
                            }
                        }
                    }
                    (cpu.finish(), written)
                })
            })
            .collect();
        let mut vcpus = Vec::new();
        let mut written = std::collections::HashMap::new();
        for w in workers {
            let (v, wr) = w.join().expect("worker");
            vcpus.push(v);
            for (p, b) in wr {
                let e = written.entry(p).or_insert(0);
                *e = (*e).max(b);
            }
        }
        stop.store(true, Ordering::Relaxed);
        let aged = ager.join().expect("ager");
        let mut last = harvester.join().expect("harvester");
        // The final harvest, vCPUs stopped.
        let k = completed.load(Ordering::SeqCst) + 1;
        let mut w = vec![0u64; bitmap_words(npages)];
        vm.get_dirty_log(1, &mut w).unwrap();
        for gfn in bitmap_gfns(g, &w) {
            last[(gfn - g) as usize] = k;
        }
        let lost: Vec<_> = written
            .iter()
            .filter(|&(&p, &before)| last[p as usize] <= before)
            .map(|(&p, _)| g + p)
            .collect();
        assert!(
            lost.is_empty(),
            "ad {ad} seed {seed:#x}: {} pages' last write was never harvested, e.g. {:x?}",
            lost.len(),
            &lost[..lost.len().min(8)]
        );
        assert!(aged > 0, "ad {ad}: the ager never aged anything");
        assert!(k > 10, "ad {ad}: only {k} harvests");
        check_audit(&vm, "aging + harvests");
        teardown(vm, vcpus);
    }
}
