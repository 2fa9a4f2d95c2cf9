//! Private guest memory (`Vm::set_memory_attributes`, `Vm::add_memslot_with_private`,
//! `FaultOutcome::MemoryFault`): faults map the backing the attribute selects, an access of
//! the wrong kind exits, a conversion zaps and flushes, bad input changes nothing, and a
//! conversion oracle under concurrency (KVM's `private_mem_conversions_test`): vCPUs stamp
//! pages through their translations while a thread converts ranges back and forth, and no
//! vCPU ever reaches the private backing through a translation it may use as shared, or the
//! reverse. With the conversion's zap skipped (`inject::SKIP_CONVERSION_ZAP`, feature
//! `test-hooks`) the oracle fails.
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::{
    Access, Fault, FaultOutcome, HostBuffer, HostMemory, HostRange, MemoryAttributeError,
    MemoryAttributes, MemslotError, MemslotFlags, PteFormat, Vcpu, Vm, VmConfig, WrprotVariant,
};
use slat_addr::{Gfn, Gpa, PAGE_SHIFT, PAGE_SIZE};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const PRIVATE: MemoryAttributes = MemoryAttributes::PRIVATE;
const SHARED: MemoryAttributes = MemoryAttributes::empty();
/// The slot under test: 2 MiB at 1 GiB.
const GPA: u64 = 1 << 30;
const BASE_GFN: u64 = GPA >> PAGE_SHIFT;
const SIZE: u64 = 2 * MIB;

both_formats! {
    faults_map_the_backing_the_attribute_selects,
    an_access_of_the_wrong_kind_exits_with_its_page,
    conversion_zaps_and_waits_for_the_flush,
    unchanged_attributes_zap_nothing,
    bad_input_is_refused_and_changes_nothing,
    private_slots_refuse_dirty_logging_and_readonly,
    shared_slots_keep_dirty_logging,
    conversions_racing_vcpus_never_cross_backings,
}

/// A VM that keeps an rmap (so `audit_rmap` checks it across conversions) with one slot of
/// [`SIZE`] at [`GPA`] backed by `shared` and `private`.
fn vm_with_private_slot<F: PteFormat>(shared: HostRange, private: HostRange) -> Arc<Vm<F>> {
    let vm = Vm::<F>::new(VmConfig {
        wrprot: WrprotVariant::Rmap,
        ..VmConfig::default()
    });
    vm.add_memslot_with_private(
        0,
        Gpa::new(GPA),
        SIZE,
        shared,
        private,
        MemslotFlags::empty(),
    )
    .expect("slot");
    vm
}

fn fault_kind<F: PteFormat>(v: &mut Vcpu<F>, gfn: u64, private: bool) -> FaultOutcome {
    v.handle_fault(Fault {
        gpa: Gpa::new((gfn << PAGE_SHIFT) + 0x18),
        access: Access::Write,
        present: false,
        private,
    })
}

/// The host address `gfn` translates to now, if mapped.
fn hva_of<F: PteFormat>(vm: &Vm<F>, gfn: u64) -> Option<u64> {
    vm.lookup(Gfn::new(gfn))
        .map(|(leaf, level)| leaf_hva::<F>(leaf, level, gfn))
}

fn check_rmap<F: PteFormat>(vm: &Vm<F>, ctx: &str) {
    check_audit(vm, ctx);
    if let Err(e) = vm.audit_rmap() {
        panic!("{ctx}: rmap not exact: {e}");
    }
}

fn faults_map_the_backing_the_attribute_selects<F: PteFormat>() {
    let (shared, private) = (HostMem::new(SIZE), HostMem::new(SIZE));
    let vm = vm_with_private_slot::<F>(shared.range(PAGE_SIZE), private.range(PAGE_SIZE));
    let mut v = vm.create_vcpu(0);
    let g = BASE_GFN + 5;
    assert_eq!(fault_kind(&mut v, g, false), FaultOutcome::Fixed);
    assert_eq!(hva_of(&vm, g), Some(shared.addr() + 5 * PAGE_SIZE));
    vm.set_memory_attributes(Gfn::new(g), 4, PRIVATE).unwrap();
    assert!(vm.memslots().slots()[0].is_private(Gfn::new(g)));
    assert_eq!(hva_of(&vm, g), None, "the conversion zaps the shared leaf");
    assert_eq!(fault_kind(&mut v, g, true), FaultOutcome::Fixed);
    assert_eq!(hva_of(&vm, g), Some(private.addr() + 5 * PAGE_SIZE));
    // A neighbour outside the converted range is still shared.
    assert_eq!(fault_kind(&mut v, g + 4, false), FaultOutcome::Fixed);
    assert_eq!(hva_of(&vm, g + 4), Some(shared.addr() + 9 * PAGE_SIZE));
    check_rmap(&vm, "after private faults");
    vm.set_memory_attributes(Gfn::new(g), 4, SHARED).unwrap();
    assert_eq!(
        hva_of(&vm, g),
        None,
        "converting back zaps the private leaf"
    );
    assert_eq!(hva_of(&vm, g + 4), Some(shared.addr() + 9 * PAGE_SIZE));
    assert_eq!(fault_kind(&mut v, g, false), FaultOutcome::Fixed);
    assert_eq!(hva_of(&vm, g), Some(shared.addr() + 5 * PAGE_SIZE));
    check_rmap(&vm, "after converting back");
    teardown(vm, [v]);
}

fn an_access_of_the_wrong_kind_exits_with_its_page<F: PteFormat>() {
    let (shared, private) = (HostMem::new(SIZE), HostMem::new(SIZE));
    let vm = vm_with_private_slot::<F>(shared.range(PAGE_SIZE), private.range(PAGE_SIZE));
    let mut v = vm.create_vcpu(0);
    let g = BASE_GFN + 7;
    let exit = |private| FaultOutcome::MemoryFault {
        gpa: Gpa::new(g << PAGE_SHIFT),
        size: PAGE_SIZE,
        private,
    };
    assert_eq!(
        fault_kind(&mut v, g, true),
        exit(true),
        "private access, shared page"
    );
    assert_eq!(hva_of(&vm, g), None, "nothing mapped on an exit");
    vm.set_memory_attributes(Gfn::new(g), 1, PRIVATE).unwrap();
    assert_eq!(
        fault_kind(&mut v, g, false),
        exit(false),
        "shared access, private page"
    );
    assert_eq!(hva_of(&vm, g), None);
    // Even with a private leaf present, a shared access gets the exit, not the fast path.
    assert_eq!(fault_kind(&mut v, g, true), FaultOutcome::Fixed);
    let present = v.handle_fault(Fault {
        gpa: Gpa::new((g << PAGE_SHIFT) + 8),
        access: Access::Write,
        present: true,
        private: false,
    });
    assert_eq!(present, exit(false));
    assert_eq!(hva_of(&vm, g), Some(private.addr() + 7 * PAGE_SIZE));
    teardown(vm, [v]);
}

fn conversion_zaps_and_waits_for_the_flush<F: PteFormat>() {
    let (shared, private) = (HostMem::new(SIZE), HostMem::new(SIZE));
    let vm = vm_with_private_slot::<F>(shared.range(PAGE_SIZE), private.range(PAGE_SIZE));
    let mut v = vm.create_vcpu(0);
    for i in 0..64 {
        assert_eq!(fault_kind(&mut v, BASE_GFN + i, false), FaultOutcome::Fixed);
    }
    let tables = vm.stats().table_pages;
    // A vCPU in guest mode that may cache the shared translations: the conversion must not
    // return before it acknowledged the flush.
    let guest = v.enter_guest();
    let done = Arc::new(AtomicBool::new(false));
    let t = {
        let (vm, done) = (vm.clone(), done.clone());
        std::thread::spawn(move || {
            vm.set_memory_attributes(Gfn::new(BASE_GFN), 64, PRIVATE)
                .unwrap();
            done.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !done.load(Ordering::SeqCst),
        "the conversion returned before the vCPU in guest mode acknowledged its flush"
    );
    let flushed = AtomicBool::new(false);
    while !done.load(Ordering::SeqCst) {
        v.service_requests(|| flushed.store(true, Ordering::SeqCst));
        std::hint::spin_loop();
    }
    drop(guest);
    t.join().unwrap();
    assert!(
        flushed.load(Ordering::SeqCst),
        "no TLB flush reached the vCPU"
    );
    for i in 0..64 {
        assert_eq!(hva_of(&vm, BASE_GFN + i), None, "gfn +{i} still mapped");
    }
    assert!(
        vm.stats().table_pages <= tables,
        "a conversion adds no tables"
    );
    check_rmap(&vm, "after the conversion");
    teardown(vm, [v]);
}

fn unchanged_attributes_zap_nothing<F: PteFormat>() {
    let (shared, private) = (HostMem::new(SIZE), HostMem::new(SIZE));
    let vm = vm_with_private_slot::<F>(shared.range(PAGE_SIZE), private.range(PAGE_SIZE));
    let mut v = vm.create_vcpu(0);
    assert_eq!(fault_kind(&mut v, BASE_GFN, false), FaultOutcome::Fixed);
    let flushes = vm.stats().remote_tlb_flush;
    vm.set_memory_attributes(Gfn::new(BASE_GFN), 512, SHARED)
        .unwrap();
    assert!(
        hva_of(&vm, BASE_GFN).is_some(),
        "shared → shared zapped the page"
    );
    assert_eq!(vm.stats().remote_tlb_flush, flushes);
    teardown(vm, [v]);
}

/// Everything the attributes and mappings look like, to compare before and after an error.
fn snapshot<F: PteFormat>(vm: &Vm<F>) -> (Vec<bool>, Vec<Option<u64>>, u64) {
    let set = vm.memslots();
    let slot = &set.slots()[0];
    let gfns = BASE_GFN..BASE_GFN + (SIZE >> PAGE_SHIFT);
    let attrs = gfns.clone().map(|g| slot.is_private(Gfn::new(g))).collect();
    let maps = gfns.map(|g| hva_of(vm, g)).collect();
    (attrs, maps, set.generation())
}

/// (first gfn, pages, attributes, expected error) of a refused `set_memory_attributes`.
type AttrCase = (u64, u64, MemoryAttributes, MemoryAttributeError);

/// The refused attribute changes around the private slot, the shared-only slot after it and the
/// hole at `hole_gfn`: a data table, one case per refusal, so longer than a function should be.
fn refused_attribute_cases(hole_gfn: u64) -> [AttrCase; 6] {
    [
        (
            BASE_GFN,
            0,
            PRIVATE,
            MemoryAttributeError::Empty {
                first_gfn: Gfn::new(BASE_GFN),
            },
        ),
        (
            u64::MAX - 1,
            4,
            PRIVATE,
            MemoryAttributeError::Overflow {
                first_gfn: Gfn::new(u64::MAX - 1),
                npages: 4,
            },
        ),
        (
            BASE_GFN - 1,
            2,
            PRIVATE,
            MemoryAttributeError::OutsideMemslots {
                gfn: Gfn::new(BASE_GFN - 1),
            },
        ),
        // Covers the private slot, then the shared-only one: refused as a whole.
        (
            BASE_GFN + 500,
            20,
            PRIVATE,
            MemoryAttributeError::NoPrivateBacking { id: 1 },
        ),
        // Runs past the last slot into the hole.
        (
            BASE_GFN,
            (hole_gfn - BASE_GFN) + 1,
            SHARED,
            MemoryAttributeError::OutsideMemslots {
                gfn: Gfn::new(hole_gfn),
            },
        ),
        (
            BASE_GFN,
            1,
            MemoryAttributes::from_bits_retain(1),
            MemoryAttributeError::UnknownAttributes { bits: 1 },
        ),
    ]
}

fn bad_input_is_refused_and_changes_nothing<F: PteFormat>() {
    let (shared, private) = (HostMem::new(SIZE), HostMem::new(SIZE));
    let vm = vm_with_private_slot::<F>(shared.range(PAGE_SIZE), private.range(PAGE_SIZE));
    // A shared-only slot right after it, and a hole after that.
    let plain = HostMem::new(SIZE);
    vm.add_memslot(
        1,
        Gpa::new(GPA + SIZE),
        SIZE,
        plain.range(PAGE_SIZE),
        MemslotFlags::empty(),
    )
    .unwrap();
    let plain_gfn = BASE_GFN + (SIZE >> PAGE_SHIFT);
    let hole_gfn = plain_gfn + (SIZE >> PAGE_SHIFT);
    let mut v = vm.create_vcpu(0);
    for i in [0, 100, 511] {
        assert_eq!(fault_kind(&mut v, BASE_GFN + i, false), FaultOutcome::Fixed);
    }
    vm.set_memory_attributes(Gfn::new(BASE_GFN + 100), 1, PRIVATE)
        .unwrap();
    let before = snapshot(&vm);
    for (first, n, attrs, want) in refused_attribute_cases(hole_gfn) {
        assert_eq!(
            vm.set_memory_attributes(Gfn::new(first), n, attrs),
            Err(want.clone()),
            "gfn {first:#x} +{n}"
        );
        assert_eq!(snapshot(&vm), before, "{want}: something changed");
    }
    // Shared over a shared-only slot is fine (nothing to do).
    vm.set_memory_attributes(Gfn::new(plain_gfn), 4, SHARED)
        .unwrap();
    assert_eq!(snapshot(&vm), before);
    // A private backing that is too small, or unmappable flags, refuse the slot.
    let small = HostMem::new(SIZE / 2);
    assert_eq!(
        vm.add_memslot_with_private(
            2,
            Gpa::new(4 * GPA),
            SIZE,
            plain.range(PAGE_SIZE),
            small.range(PAGE_SIZE),
            MemslotFlags::empty()
        ),
        Err(MemslotError::HostRangeTooSmall {
            id: 2,
            need: SIZE,
            have: SIZE / 2
        })
    );
    assert_eq!(vm.memslots().slots().len(), 2);
    check_rmap(&vm, "after refused requests");
    teardown(vm, [v]);
}

fn private_slots_refuse_dirty_logging_and_readonly<F: PteFormat>() {
    let (shared, private) = (HostMem::new(SIZE), HostMem::new(SIZE));
    let vm = vm_with_private_slot::<F>(shared.range(PAGE_SIZE), private.range(PAGE_SIZE));
    for flags in [MemslotFlags::LOG_DIRTY_PAGES, MemslotFlags::READONLY] {
        assert_eq!(
            vm.add_memslot_with_private(
                1,
                Gpa::new(4 * GPA),
                SIZE,
                shared.range(PAGE_SIZE),
                private.range(PAGE_SIZE),
                flags
            ),
            Err(MemslotError::PrivateIncompatibleFlags {
                id: 1,
                bits: flags.bits()
            })
        );
    }
    assert_eq!(
        vm.set_memslot_flags(0, MemslotFlags::LOG_DIRTY_PAGES),
        Err(MemslotError::PrivateIncompatibleFlags { id: 0, bits: 1 })
    );
    assert!(!vm.memslots().slots()[0].is_logging());
    teardown(vm, []);
}

/// A shared slot next to a private-capable one logs exactly as before, across conversions of
/// its neighbour.
fn shared_slots_keep_dirty_logging<F: PteFormat>() {
    let (shared, private) = (HostMem::new(SIZE), HostMem::new(SIZE));
    let vm = vm_with_private_slot::<F>(shared.range(PAGE_SIZE), private.range(PAGE_SIZE));
    let logged = HostMem::new(SIZE);
    let log_gfn = BASE_GFN + (SIZE >> PAGE_SHIFT);
    vm.add_memslot(
        1,
        Gpa::new(GPA + SIZE),
        SIZE,
        logged.range(PAGE_SIZE),
        MemslotFlags::LOG_DIRTY_PAGES,
    )
    .unwrap();
    let mut v = vm.create_vcpu(0);
    for i in [3, 64, 511] {
        assert_eq!(fault_kind(&mut v, log_gfn + i, false), FaultOutcome::Fixed);
    }
    vm.set_memory_attributes(Gfn::new(BASE_GFN), 512, PRIVATE)
        .unwrap();
    assert_eq!(fault_kind(&mut v, BASE_GFN, true), FaultOutcome::Fixed);
    let mut words = vec![0u64; bitmap_words(512)];
    vm.get_dirty_log(1, &mut words).unwrap();
    assert_eq!(
        bitmap_gfns(log_gfn, &words),
        vec![log_gfn + 3, log_gfn + 64, log_gfn + 511]
    );
    check_rmap(&vm, "logged neighbour");
    teardown(vm, [v]);
}

// ---------------------------------------------------------------------------------------------
// The conversion oracle.

/// Pages of the oracle's slot that are converted (the slot is larger: 4 KiB leaves only).
const ORACLE_PAGES: u64 = 64;
const SHARED_TAG: u64 = 0x5a5a << 48;
const PRIVATE_TAG: u64 = 0xa5a5 << 48;
const TAG_MASK: u64 = 0xffff << 48;
const GFN_MASK: u64 = 0xffff_ffff;

/// What the converter publishes per page: `ver` odd while a conversion of the page is in
/// progress, even once settled (`private` is then the settled kind).
struct PageState {
    ver: AtomicU64,
    private: AtomicBool,
}

struct Oracle {
    seed: u64,
    shared: Arc<HostBuffer>,
    private: Arc<HostBuffer>,
    pages: Vec<PageState>,
    stop: AtomicBool,
    failure: Mutex<Option<String>>,
    checked: AtomicU64,
    exits: AtomicU64,
}

impl Oracle {
    fn fail(&self, msg: String) {
        self.failure.lock().unwrap().get_or_insert(msg);
        self.stop.store(true, Ordering::SeqCst);
    }
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
    /// Which backing `hva` is in, and the offset there.
    fn backing(&self, hva: u64) -> Option<(bool, u64)> {
        for (private, b) in [(false, &self.shared), (true, &self.private)] {
            let base = b.host_addr();
            if hva.wrapping_sub(base.raw()) < b.len() {
                return Some((private, hva - base.raw()));
            }
        }
        None
    }
    fn buffer(&self, private: bool) -> &HostBuffer {
        if private {
            &self.private
        } else {
            &self.shared
        }
    }
}

fn tag(private: bool) -> u64 {
    if private {
        PRIVATE_TAG
    } else {
        SHARED_TAG
    }
}

/// Runs the oracle for `duration`; `Err` is the first violation (with the seed).
fn run_oracle<F: PteFormat>(seed: u64, duration: Duration, bugs: u32) -> Result<String, String> {
    let len = 2 * MIB;
    let shared = Arc::new(HostBuffer::new(len, 2 * MIB).unwrap());
    let private = Arc::new(HostBuffer::new(len, 2 * MIB).unwrap());
    // Every page of each backing starts stamped with its kind and gfn.
    for i in 0..(len >> PAGE_SHIFT) {
        shared.store_u64(i << PAGE_SHIFT, SHARED_TAG | (BASE_GFN + i));
        private.store_u64(i << PAGE_SHIFT, PRIVATE_TAG | (BASE_GFN + i));
    }
    let vm = vm_with_private_slot::<F>(
        HostRange::new(shared.clone()).unwrap(),
        HostRange::new(private.clone()).unwrap(),
    );
    // Deliberate engine bugs exist only with the feature (the sabotage check).
    #[cfg(feature = "test-hooks")]
    vm.inject_bugs(bugs);
    #[cfg(not(feature = "test-hooks"))]
    assert_eq!(bugs, 0, "bugs can only be injected with feature test-hooks");
    let oracle = Arc::new(Oracle {
        seed,
        shared,
        private,
        pages: (0..ORACLE_PAGES)
            .map(|_| PageState {
                ver: AtomicU64::new(0),
                private: AtomicBool::new(false),
            })
            .collect(),
        stop: AtomicBool::new(false),
        failure: Mutex::new(None),
        checked: AtomicU64::new(0),
        exits: AtomicU64::new(0),
    });
    let deadline = Instant::now() + duration;
    let vcpus: Vec<_> = (0..3u32)
        .map(|id| {
            let (o, v) = (oracle.clone(), vm.create_vcpu(id));
            std::thread::spawn(move || vcpu_loop(&o, v, seed ^ ((u64::from(id) + 1) * 0x9e37)))
        })
        .collect();
    let conversions = converter(&vm, &oracle, seed, deadline);
    oracle.stop.store(true, Ordering::SeqCst);
    let vcpus: Vec<Vcpu<F>> = vcpus.into_iter().map(|t| t.join().unwrap()).collect();
    if let Some(msg) = oracle.failure.lock().unwrap().take() {
        teardown(vm, vcpus);
        return Err(msg);
    }
    check_rmap(&vm, &format!("seed {seed:#x}: after the oracle"));
    let summary = format!(
        "seed {seed:#x}: {conversions} conversions, {} checked accesses, {} memory-fault exits",
        oracle.checked.load(Ordering::Relaxed),
        oracle.exits.load(Ordering::Relaxed)
    );
    teardown(vm, vcpus);
    Ok(summary)
}

/// Converts random ranges back and forth until `deadline`, publishing each page's state
/// around the call. Returns the number of conversions.
fn converter<F: PteFormat>(vm: &Vm<F>, o: &Oracle, seed: u64, deadline: Instant) -> u64 {
    let mut rng = Rng::new(seed);
    let mut n = 0;
    while Instant::now() < deadline && !o.stopped() {
        let first = rng.below(ORACLE_PAGES);
        let count = rng.range(1, 9).min(ORACLE_PAGES - first);
        let private = rng.chance(1, 2);
        let pages = &o.pages[first as usize..(first + count) as usize];
        for p in pages {
            p.ver.fetch_add(1, Ordering::SeqCst); // odd: converting
        }
        let attrs = if private { PRIVATE } else { SHARED };
        if let Err(e) = vm.set_memory_attributes(Gfn::new(BASE_GFN + first), count, attrs) {
            o.fail(format!("seed {:#x}: conversion refused: {e}", o.seed));
        }
        for p in pages {
            p.private.store(private, Ordering::SeqCst);
            p.ver.fetch_add(1, Ordering::SeqCst); // even: settled
        }
        n += 1;
        std::thread::yield_now();
    }
    n
}

/// A vCPU: in guest mode, with a small TLB emptied only by flush requests, it accesses random
/// pages as the kind it last knew them to be settled as, and checks (when no conversion of
/// the page overlapped the access) that the translation reached that kind's backing, whose
/// stamp it reads and renews.
fn vcpu_loop<F: PteFormat>(o: &Oracle, mut v: Vcpu<F>, seed: u64) -> Vcpu<F> {
    let mut cpu = SimCpu {
        rng: Rng::new(seed),
        tlb: vec![None; ORACLE_PAGES as usize],
        stamp: 0,
    };
    while !o.stopped() {
        match cpu.stint(o, &mut v) {
            Stint::Exit { gfn, private } => fault_outside_guest(o, &mut v, gfn, private),
            Stint::Done => {}
            Stint::Failed => break,
        }
        // Outside guest mode now and then (a VM exit): on an overcommitted host, a flush would
        // otherwise wait a scheduler slice for a descheduled vCPU in guest mode.
        std::thread::yield_now();
    }
    v
}

/// How a run of accesses in guest mode ended.
enum Stint {
    /// A translation was missing: fault outside guest mode with this kind.
    Exit {
        gfn: u64,
        private: bool,
    },
    Done,
    Failed,
}

/// A vCPU's own state: its random stream, its TLB (gfn index → host address) and its stamps.
struct SimCpu {
    rng: Rng,
    tlb: Vec<Option<u64>>,
    stamp: u64,
}

impl SimCpu {
    /// Up to 16 accesses in guest mode, servicing requests at every access boundary.
    fn stint<F: PteFormat>(&mut self, o: &Oracle, v: &mut Vcpu<F>) -> Stint {
        let _guest = v.enter_guest();
        for _ in 0..16 {
            v.service_requests(|| self.tlb.fill(None));
            let i = self.rng.below(ORACLE_PAGES);
            let gfn = BASE_GFN + i;
            let page = &o.pages[i as usize];
            let v1 = page.ver.load(Ordering::SeqCst);
            let kind = page.private.load(Ordering::SeqCst);
            let hva = match self.tlb[i as usize].or_else(|| hva_of(v.vm(), gfn)) {
                Some(h) => h,
                None => return Stint::Exit { gfn, private: kind },
            };
            self.tlb[i as usize] = Some(hva);
            let Some((backing, off)) = o.backing(hva) else {
                o.fail(format!(
                    "seed {:#x}: gfn {gfn:#x} translates to {hva:#x}, in neither backing",
                    o.seed
                ));
                return Stint::Failed;
            };
            let word = o.buffer(backing).load_u64(off).unwrap();
            let v2 = page.ver.load(Ordering::SeqCst);
            if v1 != v2 || v1 % 2 == 1 {
                continue; // a conversion overlapped: either kind may be legitimately mapped
            }
            if backing != kind || word & TAG_MASK != tag(kind) || word & GFN_MASK != gfn {
                o.fail(format!(
                    "seed {:#x}: gfn {gfn:#x} settled {} (ver {v1}) but the vCPU's translation \
                     reached the {} backing and read {word:#x}",
                    o.seed,
                    if kind { "private" } else { "shared" },
                    if backing { "private" } else { "shared" },
                ));
                return Stint::Failed;
            }
            self.stamp += 1;
            let val = tag(kind) | ((self.stamp & 0xffff) << 32) | gfn;
            o.buffer(backing).store_u64(off, val);
            o.checked.fetch_add(1, Ordering::Relaxed);
        }
        Stint::Done
    }
}

/// A not-present fault of the kind the vCPU believes the page is, outside guest mode: the
/// slow path only (the fast path fixes no not-present fault with A/D bits on), because
/// `handle_fault` acknowledges flush requests for a vCPU without a TLB, and this one has one.
fn fault_outside_guest<F: PteFormat>(o: &Oracle, v: &mut Vcpu<F>, gfn: u64, private: bool) {
    let f = Fault {
        gpa: Gpa::new(gfn << PAGE_SHIFT),
        access: Access::Write,
        present: false,
        private,
    };
    match v.slow_page_fault(f) {
        FaultOutcome::MemoryFault {
            gpa,
            size,
            private: p,
        } => {
            // The page changed kind since we looked; check the exit describes the access.
            if gpa != Gpa::new(gfn << PAGE_SHIFT) || size != PAGE_SIZE || p != private {
                o.fail(format!(
                    "seed {:#x}: bad memory-fault exit {gpa:#x}+{size:#x} private {p}",
                    o.seed
                ));
            }
            o.exits.fetch_add(1, Ordering::Relaxed);
        }
        FaultOutcome::Fixed | FaultOutcome::Spurious | FaultOutcome::Retry => {}
        other => o.fail(format!(
            "seed {:#x}: unexpected fault outcome {other:?}",
            o.seed
        )),
    }
}

fn oracle_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    seed_from_env(t | 1)
}

fn conversions_racing_vcpus_never_cross_backings<F: PteFormat>() {
    let seed = oracle_seed();
    match run_oracle::<F>(seed, Duration::from_secs(3), 0) {
        Ok(summary) => eprintln!("{summary}"),
        Err(msg) => panic!("{msg} (rerun with SLAT_TEST_SEED={seed:#x})"),
    }
}

/// The oracle fails when a conversion skips its zap (and so its flush): leaves and cached
/// translations of the old kind survive the conversion.
#[cfg(feature = "test-hooks")]
mod sabotage {
    use super::*;
    use slat::dirty::inject;

    fn oracle_catches_a_conversion_that_skips_its_zap<F: PteFormat>() {
        let seed = oracle_seed();
        match run_oracle::<F>(seed, Duration::from_secs(5), inject::SKIP_CONVERSION_ZAP) {
            Ok(summary) => panic!("the oracle missed the skipped zap: {summary}"),
            Err(msg) => eprintln!("caught, as it should: {msg}"),
        }
    }

    both_formats! {
        oracle_catches_a_conversion_that_skips_its_zap,
    }
}
