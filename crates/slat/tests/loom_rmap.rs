//! Loom models of the lock-free write-protect through the reverse map
//! (`VmConfig::wrprot = rmap-lockless`), on the real engine code:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p slat --test loom_rmap --release`.
//!
//! The harvest takes no MMU lock: it is pinned in the epoch, finds the leaf through the rmap
//! and clears W with one compare-and-swap, racing vCPUs that make the same entry writable.
//! Threads return what they saw; the assertions run in the main thread.
//!
//! The last models race that harvest with a zap that unlinks and retires the leaf table the
//! rmap names. Under loom, reclamation is modelled adversarially (`crate::sync::epoch_model`:
//! a deferred free runs as soon as the guards alive at its deferral are gone) and freed table
//! pages are poisoned, so a lock-free reader reaching a freed page fails the model with "use
//! after free of table page".
#![cfg(loom)]

#[path = "common/loom_thread.rs"]
mod thread;
use slat::{
    Access, Ept, Fault, FaultOutcome, HostBuffer, HostRange, MemslotFlags, PteFormat, Vm, VmConfig,
    WrprotVariant,
};
use slat_addr::Gfn;
use slat_addr::Gpa;
use slat_addr::PageIndex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

const GPA: u64 = 0x10_0000;

fn host_page() -> HostRange {
    let buf = HostBuffer::new(4096, 4096).expect("allocate a host page");
    HostRange::new(Arc::new(buf)).expect("host range")
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.max_branches = 1_000_000;
    // The model's own thread has loom's default stack: run the body on one with more room.
    let f = std::sync::Arc::new(f);
    b.check(move || {
        let f = std::sync::Arc::clone(&f);
        thread::spawn(move || f()).join().expect("model body");
    });
}

fn lockless() -> VmConfig {
    VmConfig {
        wrprot: WrprotVariant::RmapLockless,
        ..VmConfig::default()
    }
}

fn write(present: bool) -> Fault {
    Fault {
        private: false,
        gpa: Gpa::new(GPA),
        access: Access::Write,
        present,
    }
}

/// After the writer is done and a last harvest ran, the page must have been reported by one of
/// the two harvests, and the last harvest must have left it write-protected (otherwise a later
/// write would go unreported: the lost dirty page the write-protect series' ordering prevents).
fn check(vm: &Vm<Ept>, first: u64, o: FaultOutcome) {
    assert!(
        matches!(o, FaultOutcome::FixedFast | FaultOutcome::Fixed),
        "{o:?}"
    );
    let mut second = [0u64; 1];
    vm.get_dirty_log(1, &mut second).unwrap();
    assert_eq!(
        (first | second[0]) & 1,
        1,
        "the write was reported by neither harvest: {o:?}"
    );
    let (spte, _) = vm.lookup(Gfn::new(GPA >> 12)).expect("mapped");
    assert!(
        !Ept::is_writable(spte),
        "writable after a harvest that reported nothing pending: {o:?} first {first:#x} second {:#x} spte {spte:#x} rmap {:?}", second[0], vm.audit_rmap()
    );
    assert_eq!(vm.audit_rmap(), Ok(1), "rmap out of step with the tree");
}

/// A fault that *installs* a writable leaf in a logged slot (slow path: rmap entry, then the
/// compare-and-swap, then the second mark) racing a lock-free GET.
#[test]
fn lockless_wrprot_vs_a_fault_installing_the_writable_leaf() {
    model(|| {
        let vm = Vm::<Ept>::new(lockless());
        vm.add_memslot(
            1,
            Gpa::new(GPA),
            4096,
            host_page(),
            MemslotFlags::LOG_DIRTY_PAGES,
        )
        .unwrap();
        let mut v = vm.create_vcpu(0);
        let writer = thread::spawn(move || {
            let mut o = v.handle_fault(write(false));
            // A bounded number of retries (a lost race re-executes the access).
            for _ in 0..2 {
                if o != FaultOutcome::Retry {
                    break;
                }
                o = v.handle_fault(write(false));
            }
            drop(v);
            o
        });
        let mut first = [0u64; 1];
        vm.get_dirty_log(1, &mut first).unwrap();
        let o = writer.join().unwrap();
        check(&vm, first[0], o);
    });
}

/// The fast path making a write-protected leaf writable (mark, CAS W 0→1, mark) racing a
/// lock-free GET that write-protects it through the rmap.
#[test]
fn lockless_wrprot_vs_the_fast_path_making_the_leaf_writable() {
    model(|| {
        let vm = Vm::<Ept>::new(lockless());
        vm.add_memslot(1, Gpa::new(GPA), 4096, host_page(), MemslotFlags::empty())
            .unwrap();
        let mut v = vm.create_vcpu(0);
        assert_eq!(v.handle_fault(write(false)), FaultOutcome::Fixed);
        vm.set_memslot_flags(1, MemslotFlags::LOG_DIRTY_PAGES)
            .unwrap();
        let writer = thread::spawn(move || {
            let o = v.handle_fault(write(true));
            drop(v);
            o
        });
        let mut first = [0u64; 1];
        vm.get_dirty_log(1, &mut first).unwrap();
        let o = writer.join().unwrap();
        check(&vm, first[0], o);
    });
}

// ---------------------------------------------------------------------------------------------
// Reclamation: the lock-free write-protect racing a zap that unlinks and frees the leaf table.
//
// Under loom, `crate::sync` models an ideal grace period (a deferred free runs as soon as every
// guard alive at its deferral is gone) and a freed table page is poisoned, not deallocated:
// reaching it through `TablePage::at` is recorded as a use after free, which the main thread
// reports (`TablePage::loom_use_after_free`).

/// Every gfn of the 2 MiB region whose leaf table maps [`GPA`]: zapping it unlinks that table.
const REGION: (u64, u64) = ((GPA >> 12) & !511, ((GPA >> 12) & !511) + 512);

fn host_pages(n: u64) -> HostRange {
    let buf = HostBuffer::new(4096 * n, 4096).expect("allocate host pages");
    HostRange::new(Arc::new(buf)).expect("host range")
}

fn write_at(gpa: u64) -> Fault {
    Fault {
        private: false,
        gpa: Gpa::new(gpa),
        access: Access::Write,
        present: false,
    }
}

fn no_use_after_free() {
    if let Some(m) = slat::hw::TablePage::loom_use_after_free() {
        panic!("{m}");
    }
}

/// A logged slot of `pages` pages (with manual protect if `manual`), each written once (dirty, writable leaves in one leaf
/// table). Returns the VM, the vCPU and the number of table pages then live.
fn dirty_pages(pages: u64, manual: bool) -> (std::sync::Arc<Vm<Ept>>, slat::Vcpu<Ept>, u64) {
    let vm = Vm::<Ept>::new(lockless());
    if manual {
        vm.set_manual_dirty_log_protect(slat::dirty::MANUAL_PROTECT_ENABLE)
            .unwrap();
    }
    vm.add_memslot(
        1,
        Gpa::new(GPA),
        4096 * pages,
        host_pages(pages),
        MemslotFlags::LOG_DIRTY_PAGES,
    )
    .unwrap();
    let mut v = vm.create_vcpu(0);
    for i in 0..pages {
        assert_eq!(
            v.handle_fault(write_at(GPA + 4096 * i)),
            FaultOutcome::Fixed
        );
    }
    assert_eq!(vm.audit_rmap(), Ok(pages));
    let live = slat::hw::table_alloc(&vm).live_pages();
    (vm, v, live)
}

/// After the zap settled (`manual`: the slot's page count, with manual protect): the leaf table was retired and freed (no guard is left), the rmap
/// names nothing, and a write after the zap refaults and is reported by the next harvest.
fn after_zap(
    vm: std::sync::Arc<Vm<Ept>>,
    mut v: slat::Vcpu<Ept>,
    live_before: u64,
    manual: Option<u64>,
) {
    let alloc = slat::hw::table_alloc(&vm).clone();
    assert_eq!(
        vm.lookup(Gfn::new(GPA >> 12)),
        None,
        "the zap left the page mapped"
    );
    assert_eq!(vm.stats().table_pages, 3, "the leaf table was not unlinked");
    assert_eq!(
        alloc.live_pages(),
        live_before - 1,
        "the unlinked leaf table was not freed once nobody was pinned"
    );
    assert_eq!(vm.audit_rmap(), Ok(0), "rmap out of step after the zap");
    // The vCPU writes again: it refaults, and the next harvest must report the page.
    assert_eq!(v.handle_fault(write_at(GPA)), FaultOutcome::Fixed);
    let mut log = [0u64; 1];
    vm.get_dirty_log(1, &mut log).unwrap();
    assert_eq!(log[0] & 1, 1, "the write after the zap was lost");
    if let Some(npages) = manual {
        // Manual protect: GET only copied; CLEAR re-protects.
        assert_eq!(
            vm.clear_dirty_log(1, PageIndex::new(0), npages, &log),
            Ok(1)
        );
    }
    let (spte, _) = vm.lookup(Gfn::new(GPA >> 12)).expect("mapped again");
    assert!(!Ept::is_writable(spte), "writable after the harvest");
    assert_eq!(vm.audit_rmap(), Ok(1), "rmap out of step after the refault");
    drop(v);
    drop(vm);
    no_use_after_free();
    assert_eq!(alloc.live_pages(), 0, "table pages leaked");
}

/// GET_DIRTY_LOG's lock-free write-protect (pinned, through the rmap, no MMU lock) racing a
/// zap of the whole 2 MiB region, which unlinks the leaf table the rmap names and retires it.
/// No use after free, the table is freed once the VM settles, nothing leaks, and a write
/// after the zap is reported.
#[test]
fn lockless_wrprot_vs_a_zap_freeing_the_leaf_table() {
    model(|| {
        let (vm, v, live) = dirty_pages(1, false);
        let harvester = {
            let vm = vm.clone();
            thread::spawn(move || {
                let mut log = [0u64; 1];
                let r = vm.get_dirty_log(1, &mut log);
                (r, log[0])
            })
        };
        vm.zap_gfn_range(Gfn::new(REGION.0), Gfn::new(REGION.1))
            .expect("not refused: no CPU of this thread in guest mode");
        let (r, first) = harvester.join().unwrap();
        no_use_after_free();
        assert_eq!((r, first), (Ok(1), 1), "the setup write was not reported");
        after_zap(vm, v, live, None);
    });
}

static HELD_BACK: AtomicU64 = AtomicU64::new(0);
static READS_UNLINKED: AtomicU64 = AtomicU64::new(0);

/// CLEAR_DIRTY_LOG (manual protect) re-arms two pages of one leaf table under a single pin,
/// racing the zap that unlinks that table: the harvest can hold the table's address, from
/// the rmap, across the whole zap and its retire. The free must wait for its unpin. Coverage
/// (over all executions): some execution had the harvest reach the unlinked table while
/// pinned, and some had its pin hold the retire's grace period back.
#[test]
fn a_pinned_lockless_clear_holds_the_zapped_table_until_it_unpins() {
    model(|| {
        let (vm, v, live) = dirty_pages(2, true);
        let mut log = [0u64; 1];
        vm.get_dirty_log(1, &mut log).unwrap();
        assert_eq!(log[0], 0b11);
        let harvester = {
            let vm = vm.clone();
            thread::spawn(move || vm.clear_dirty_log(1, PageIndex::new(0), 2, &[0b11]))
        };
        vm.zap_gfn_range(Gfn::new(REGION.0), Gfn::new(REGION.1))
            .expect("not refused: no CPU of this thread in guest mode");
        let r = harvester.join().unwrap();
        no_use_after_free();
        assert_eq!(r, Ok(2), "CLEAR did not clear both bits");
        let (unlinked, _) = slat::hw::TablePage::loom_reads_of_retiring_pages();
        READS_UNLINKED.fetch_add(unlinked, Relaxed);
        HELD_BACK.fetch_add(slat::hw::TablePage::loom_frees_held_back(), Relaxed);
        after_zap(vm, v, live, Some(2));
    });
    assert!(
        READS_UNLINKED.load(Relaxed) > 0,
        "no execution had the pinned harvest reach the unlinked table"
    );
    assert!(
        HELD_BACK.load(Relaxed) > 0,
        "no execution had the harvest's pin hold the free back"
    );
}

/// A fault writing page 0 of the leaf table (under the shared MMU lock: it installs a leaf
/// and inserts it in the rmap, or finds the table frozen and retries) racing the zap that
/// unlinks that table, followed in the zapping thread by a lock-free harvest of page 0, which
/// races the fault's insert and the retire of the table. No use after free, the write is
/// reported (or the page is write-protected), the rmap matches the tree, nothing leaks.
///
/// Not reachable here: an rmap insert naming the table *after* the zap's unlink (what
/// retire's sweep and second grace period are for). Faults hold the MMU lock shared and zaps
/// exclusive, so the fault's insert-then-compare-and-swap never straddles the unlink; that
/// window needs an unlinker under the shared lock (a table replaced by a block).
#[test]
fn a_fault_and_a_lockless_harvest_vs_the_zap_of_their_leaf_table() {
    model(|| {
        let (vm, mut v, _) = dirty_pages(2, false);
        vm.zap_gfn_range(Gfn::new(GPA >> 12), Gfn::new((GPA >> 12) + 1))
            .expect("not refused: no CPU of this thread in guest mode");
        let mut log = [0u64; 1];
        vm.get_dirty_log(1, &mut log).unwrap();
        // Page 0's bit is set, so the harvest looks page 0 up in the rmap.
        vm.mark_page_dirty(Gpa::new(GPA)).unwrap();
        let vcpu = thread::spawn(move || {
            let o = v.handle_fault(write_at(GPA));
            (o, v)
        });
        vm.zap_gfn_range(Gfn::new(REGION.0), Gfn::new(REGION.1))
            .expect("not refused: no CPU of this thread in guest mode");
        let first = vm.get_dirty_log(1, &mut log).map(|_| log[0]);
        let (mut o, mut v) = vcpu.join().unwrap();
        no_use_after_free();
        assert_eq!(first.map(|w| w & 1), Ok(1));
        let refaulted = o == FaultOutcome::Retry;
        if refaulted {
            o = v.handle_fault(write_at(GPA));
        }
        assert!(
            matches!(o, FaultOutcome::Fixed | FaultOutcome::FixedFast),
            "{o:?}"
        );
        vm.get_dirty_log(1, &mut log).unwrap();
        no_use_after_free();
        // The racing write was reported by the first harvest (whose bit was set anyway) or by
        // this one; either way the page is write-protected now, so its next write is seen.
        assert!(
            !refaulted || log[0] & 1 == 1,
            "the write after the zap was lost"
        );
        if let Some((spte, _)) = vm.lookup(Gfn::new(GPA >> 12)) {
            assert!(
                !Ept::is_writable(spte),
                "writable after the last harvest: {o:?}"
            );
        }
        let leaves = vm.stats().leaves_4k;
        assert_eq!(vm.audit_rmap(), Ok(leaves), "rmap out of step: {o:?}");
        let alloc = slat::hw::table_alloc(&vm).clone();
        drop(v);
        drop(vm);
        no_use_after_free();
        assert_eq!(alloc.live_pages(), 0, "table pages leaked");
    });
}
