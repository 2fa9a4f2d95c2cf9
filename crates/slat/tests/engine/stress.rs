//! Concurrency stress: vCPU threads fault overlapping ranges (following the guest-mode and
//! flush-acknowledge protocol) while a host thread zaps ranges, moves a slot back and forth,
//! toggles dirty logging and harvests. Afterwards the tables must match the statistics, every
//! mapping must be a current slot's host page, logged slots must be 4 KiB only, and no table
//! page may leak. The seed comes from SLAT_TEST_SEED and is printed on failure.
#![cfg(not(loom))]

use crate::common;

use common::HostMem;
use slat::hw::{bytes_per_entry, pages_per_entry};
use slat::{Access, Fault, FaultOutcome, MemslotFlags, PteFormat, Vm, VmConfig};
use slat_addr::{Gfn, Gpa, Hva};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLOT_BYTES: u64 = 8 << 20;
const A: u64 = 0x4000_0000; // slot 1 lives here or at B
const B: u64 = 0x8000_0000;
const C: u64 = 0xc000_0000; // slot 2, 2 MiB pages

both_formats! {
    // On stage2 this caught a fault's install (entry locked across the cache clean, then a
    // plain store) racing with in-place recovery unlinking its table: the leaf landed in the
    // dead table and the 4 KiB gauge stayed above the tree. `unlink_table` now waits for the
    // make (`freeze_after_make`).
    rwlock_fast_pf,
    mutex_no_fast_pf,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn seed() -> u64 {
    std::env::var("SLAT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_1234)
}

fn run<F: PteFormat>(config: VmConfig, seed: u64) {
    // Zeroed, 2 MiB aligned; the memslots keep it alive until the VM is gone.
    let mem = HostMem::new(2 * SLOT_BYTES);
    let vm = Vm::<F>::new(config);
    let r = |offset| mem.sub_range(offset, SLOT_BYTES, 2 << 20);
    vm.add_memslot(1, Gpa::new(A), SLOT_BYTES, r(0), MemslotFlags::empty())
        .unwrap();
    vm.add_memslot(
        2,
        Gpa::new(C),
        SLOT_BYTES,
        r(SLOT_BYTES),
        MemslotFlags::empty(),
    )
    .unwrap();
    let alloc = slat::hw::table_alloc(&vm).clone();
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_millis(1500);

    let workers: Vec<_> = (0..3u32)
        .map(|t| {
            let vm = vm.clone();
            let stop = stop.clone();
            std::thread::spawn(move || vcpu_worker(&vm, &stop, seed, t))
        })
        .collect();
    mutate_until(&vm, seed, deadline);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }

    let ctx = format!("{} seed {seed} config {config:?}", F::NAME);
    check_final_state(&vm, &ctx);
    drop(vm);
    let t0 = Instant::now();
    while alloc.live_pages() != 0 && t0.elapsed() < Duration::from_secs(5) {
        // Deferred frees run when the epoch advances; short-lived pinned threads help it along.
        std::thread::spawn(|| ()).join().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(alloc.live_pages(), 0, "{ctx}: table pages leaked");
    drop(mem);
}

/// One vCPU thread: random reads and writes over the three slot positions until `stop`, taking
/// the fast path in guest mode and leaving guest mode for the slow path.
fn vcpu_worker<F: PteFormat>(vm: &Arc<Vm<F>>, stop: &AtomicBool, seed: u64, t: u32) {
    let mut rng = Rng(seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut vcpu = vm.create_vcpu(t);
    let npages = SLOT_BYTES / 4096;
    while !stop.load(Ordering::Relaxed) {
        let mut guest = vcpu.enter_guest();
        if guest.requests_at_entry() != 0 {
            vcpu.service_requests(|| {});
        }
        for _ in 0..64 {
            if vcpu.pending_requests() != 0 {
                vcpu.service_requests(|| {});
            }
            let base = [A, B, C][(rng.next() % 3) as usize];
            let gpa = base + (rng.next() % npages) * 4096;
            let access = if rng.next() % 3 == 0 {
                Access::Read
            } else {
                Access::Write
            };
            let present = vm
                .lookup(Gfn::new(gpa >> 12))
                .is_some_and(|(e, _)| F::permits(e, Access::Read));
            let f = Fault {
                private: false,
                gpa: Gpa::new(gpa),
                access,
                present,
            };
            if vcpu.fast_page_fault(&guest, f).is_none() {
                // Leave guest mode for the slow path (it may block on the MMU lock).
                drop(guest);
                let o = vcpu.slow_page_fault(f);
                assert_ne!(o, FaultOutcome::InGuestMode, "slow path in guest mode");
                guest = vcpu.enter_guest();
                if guest.requests_at_entry() != 0 {
                    vcpu.service_requests(|| {});
                }
            }
        }
        drop(guest);
    }
    drop(vcpu);
}

/// The host thread until `deadline`: random zaps, moves of slot 1, logging toggles on slot 2 and
/// harvests.
fn mutate_until<F: PteFormat>(vm: &Vm<F>, seed: u64, deadline: Instant) {
    let mut rng = Rng(seed);
    let mut at_a = true;
    let mut logging = false;
    let mut bitmap = vec![0u64; (SLOT_BYTES / 4096 / 64) as usize];
    while Instant::now() < deadline {
        match rng.next() % 5 {
            0 => {
                let base = [A, B, C][(rng.next() % 3) as usize] >> 12;
                let s = base + rng.next() % 2048;
                vm.zap_gfn_range(Gfn::new(s), Gfn::new(s + 1 + rng.next() % 1024))
                    .expect("not refused: no CPU of this thread in guest mode");
            }
            1 => {
                vm.move_memslot(1, if at_a { Gpa::new(B) } else { Gpa::new(A) })
                    .unwrap();
                at_a = !at_a;
            }
            2 => {
                logging = !logging;
                let f = if logging {
                    MemslotFlags::LOG_DIRTY_PAGES
                } else {
                    MemslotFlags::empty()
                };
                vm.set_memslot_flags(2, f).unwrap();
            }
            _ => {
                if logging {
                    vm.get_dirty_log(2, &mut bitmap).unwrap();
                }
            }
        }
    }
}

/// After the run: the audit matches the statistics, every leaf translates to its slot's host
/// page, invariant 6 holds, and logged slots hold only 4 KiB leaves.
fn check_final_state<F: PteFormat>(vm: &Vm<F>, ctx: &str) {
    let audit = vm.audit();
    let stats = vm.stats();
    assert_eq!(audit.frozen, 0, "{ctx}");
    assert_eq!(audit.tables, stats.table_pages, "{ctx}");
    assert_eq!(
        audit.leaves,
        [stats.leaves_4k, stats.leaves_2m, stats.leaves_1g],
        "{ctx}"
    );
    let slots = vm.memslots();
    for base in [A, B, C] {
        let mut gfn = base >> 12;
        while gfn < (base + SLOT_BYTES) >> 12 {
            let Some((e, level)) = vm.lookup(Gfn::new(gfn)) else {
                gfn += 1;
                continue;
            };
            let slot = slots
                .slots()
                .iter()
                .find(|s| s.contains(Gfn::new(gfn)))
                .unwrap_or_else(|| panic!("{ctx}: gfn {gfn:#x} mapped outside every slot"));
            let off = (gfn & (pages_per_entry(level) - 1)) * 4096;
            assert_eq!(
                Some(Hva::new(F::output_addr(e).raw() + off)),
                slot.hva(Gfn::new(gfn)),
                "{ctx}: gfn {gfn:#x}"
            );
            assert!(
                !F::is_writable(e) || (F::is_mmu_writable(e) && F::is_host_writable(e)),
                "{ctx}: invariant 6 at gfn {gfn:#x}"
            );
            if slot.is_logging() {
                assert_eq!(level, 1, "{ctx}: huge leaf in a logged slot at {gfn:#x}");
            }
            gfn += (bytes_per_entry(level) >> 12) - (gfn & (pages_per_entry(level) - 1));
        }
    }
}

fn rwlock_fast_pf<F: PteFormat>() {
    run::<F>(VmConfig::default(), seed());
}

fn mutex_no_fast_pf<F: PteFormat>() {
    run::<F>(
        VmConfig {
            mmu_lock: slat::MmuLockKind::Mutex,
            fast_pf: false,
            ..VmConfig::default()
        },
        seed() + 1,
    );
}
