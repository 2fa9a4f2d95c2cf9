//! Aging (`clear_young`, `clear_flush_young`, `test_young`) and idle page tracking, in both
//! hardware modes and at every leaf size; and aging racing with vCPUs whose hardware walker
//! sets A/D bits, with the lock-free fast path restoring access-tracked leaves, and with
//! dirty-log harvests. Randomised tests print their seed (SLAT_TEST_SEED reruns one).
#![cfg(not(loom))]

use crate::common;

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

mod races;
mod semantics;
use races::*;
use semantics::*;

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
