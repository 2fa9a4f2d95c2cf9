//! The clock hooks are wired: a machine of format `Timed<Ept, Counting>` runs the real engine
//! and simulated hardware, and a clock that counts its hooks per kind (per thread) sees every
//! kind of charge point of docs/design/virtual-time.md §1 — walk steps, the compare-and-swap
//! that installs a leaf (at that leaf's own address), MMU-lock acquisitions each with its
//! release, the guest-mode fence, TLB hits and misses, data accesses, VM exits and entries,
//! the timed pass's clock reads, and a remote flush's wait for a vCPU in guest mode. Removing
//! a hook from the engine or the machine makes one of these counts zero.

use slat::clock::{Clock, Cost, LockMode, RealTime};
use slat::hw::{self, table_index, TablePage};
use slat::{Ept, HostRange, MemslotFlags, PteFormat, Timed, Vm, VmConfig};
use slat_addr::{Gfn, Gpa};
use slat_machine::sched::PcpuPool;
use slat_machine::Cpu;
use slat_workload::{Backing, GuestRam};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Every hook call of the calling thread, by kind.
#[derive(Debug, Default, Clone)]
struct Counts {
    rmw: Vec<usize>,
    shared_loads: u64,
    fences: u64,
    locks: HashMap<(usize, bool), i64>,
    lock_calls: [u64; 2],
    unlock_calls: [u64; 2],
    spins: u64,
    charges: HashMap<Cost, u64>,
    now: u64,
}

impl Counts {
    fn charged(&self, c: Cost) -> u64 {
        self.charges.get(&c).copied().unwrap_or(0)
    }
}

std::thread_local! {
    static COUNTS: RefCell<Counts> = RefCell::new(Counts::default());
}

/// A remote flush is waiting in `spin_until` (the vCPU it waits for may now acknowledge).
static SPINNING: AtomicBool = AtomicBool::new(false);

fn take_counts() -> Counts {
    COUNTS.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

fn mode_index(m: LockMode) -> usize {
    match m {
        LockMode::Shared => 0,
        LockMode::Exclusive => 1,
    }
}

/// Counts each hook on the calling thread; otherwise the host's time, as [`RealTime`].
struct Counting;

// SAFETY: every hook only touches the thread-local counts (and `SPINNING`); `spin_until` is
// `RealTime`'s loop, which returns once `cond` holds.
unsafe impl Clock for Counting {
    const VIRTUAL: bool = false;
    fn rmw(addr: usize) {
        COUNTS.with(|c| c.borrow_mut().rmw.push(addr));
    }
    fn shared_load(_addr: usize) {
        COUNTS.with(|c| c.borrow_mut().shared_loads += 1);
    }
    fn fence() {
        COUNTS.with(|c| c.borrow_mut().fences += 1);
    }
    fn lock(addr: usize, mode: LockMode) {
        COUNTS.with(|c| {
            let mut c = c.borrow_mut();
            c.lock_calls[mode_index(mode)] += 1;
            *c.locks.entry((addr, mode == LockMode::Shared)).or_default() += 1;
        });
    }
    fn unlock(addr: usize, mode: LockMode) {
        COUNTS.with(|c| {
            let mut c = c.borrow_mut();
            c.unlock_calls[mode_index(mode)] += 1;
            *c.locks.entry((addr, mode == LockMode::Shared)).or_default() -= 1;
        });
    }
    fn spin_until(watch: &[usize], cond: &mut dyn FnMut() -> bool) {
        assert!(!watch.is_empty(), "a wait names what ends it");
        COUNTS.with(|c| c.borrow_mut().spins += 1);
        SPINNING.store(true, Ordering::SeqCst);
        RealTime::spin_until(watch, cond);
    }
    fn charge(cost: Cost, n: u64) {
        COUNTS.with(|c| *c.borrow_mut().charges.entry(cost).or_default() += n);
    }
    fn now_ns() -> u64 {
        COUNTS.with(|c| c.borrow_mut().now += 1);
        RealTime::now_ns()
    }
}

type T = Timed<Ept, Counting>;

const GPA: u64 = 1 << 30;
const PAGES: u64 = 16;

/// The address of the level-1 entry that maps `gpa` (walked with the format's decoding).
fn leaf_entry_addr(vm: &Vm<T>, gpa: u64) -> usize {
    let gfn = Gfn::new(gpa >> 12);
    let mut table = hw::root_addr(vm);
    let mut level = T::ROOT_LEVEL;
    loop {
        // SAFETY: the root and tables reached through present entries; nothing unmaps them
        // while this test's only vCPU is stopped.
        let t = unsafe { TablePage::at(table) };
        let e = &t.entries[table_index(gfn, level)];
        if level == 1 {
            return e as *const _ as usize;
        }
        let v = e.load(Ordering::Acquire);
        assert!(
            T::is_present(v) && !T::is_leaf(v, level),
            "mapped by 4 KiB leaves"
        );
        table = T::output_addr(v);
        level -= 1;
    }
}

fn assert_locks_balance(c: &Counts) {
    for (&(addr, shared), &n) in &c.locks {
        assert_eq!(
            n, 0,
            "lock at {addr:#x} (shared: {shared}) taken and released unevenly"
        );
    }
    assert_eq!(
        c.lock_calls, c.unlock_calls,
        "every lock has its unlock, per mode"
    );
}

/// One vCPU faults pages in, reads them back through its TLB, and a timed write records its
/// fault: every kind of hook on the fault and access paths is called.
fn fault_and_access_paths_report(vm: &Arc<Vm<T>>) -> Cpu<T> {
    let mut cpu = Cpu::new(vm.clone(), 0, 64, Arc::new(PcpuPool::new(1))).unwrap();
    take_counts();
    cpu.enter();
    for p in 0..PAGES {
        cpu.write_u64(GPA + p * 4096, p).unwrap();
    }
    for p in 0..PAGES {
        assert_eq!(cpu.read_u64(GPA + p * 4096).unwrap(), p);
    }
    cpu.start_timing();
    cpu.write_u64_timed(GPA + PAGES * 4096, 1).unwrap();
    assert_eq!(cpu.take_latency().map(|h| h.len()), Some(1));
    cpu.exit();
    let c = take_counts();
    let faults = cpu.counters.faults;
    assert!(faults > PAGES, "every first write faulted: {faults}");
    assert!(
        c.charged(Cost::WalkStep) >= faults,
        "engine walk steps: {c:?}"
    );
    assert!(
        c.charged(Cost::HwWalkStep) >= PAGES,
        "hardware walk steps: {c:?}"
    );
    assert!(c.charged(Cost::TlbMiss) >= PAGES && c.charged(Cost::TlbHit) >= PAGES);
    assert_eq!(c.charged(Cost::GuestAccess), cpu.counters.accesses);
    assert!(c.charged(Cost::VmExit) >= PAGES && c.charged(Cost::VmEntry) > PAGES);
    assert!(c.charged(Cost::TableAlloc) >= 1 && c.charged(Cost::ZeroPage) >= 1);
    assert!(
        c.charged(Cost::EpochPin) >= PAGES,
        "the slow path pins: {c:?}"
    );
    assert!(c.fences >= PAGES, "each guest entry fences: {}", c.fences);
    assert!(c.shared_loads > PAGES, "request polls and entry reads");
    assert!(
        c.now >= 2,
        "the timed write reads the clock at its fault and its end"
    );
    assert!(
        c.lock_calls[0] >= PAGES,
        "the slow path takes the MMU lock shared"
    );
    assert_locks_balance(&c);
    for p in 0..PAGES {
        let spte = leaf_entry_addr(vm, GPA + p * 4096);
        assert!(
            c.rmw.contains(&spte),
            "the install of page {p} is a read-modify-write of its entry"
        );
    }
    assert_eq!(c.spins, 0, "no flush waited for another CPU");
    cpu
}

/// A remote flush while the vCPU sits in guest mode between accesses waits in `spin_until`
/// (after an interrupt charged to the flusher) until the vCPU's next access acknowledges it.
fn a_remote_flush_waits_for_a_vcpu_in_guest_mode(vm: &Arc<Vm<T>>, mut cpu: Cpu<T>) {
    SPINNING.store(false, Ordering::SeqCst);
    cpu.enter();
    take_counts();
    let flusher = {
        let vm = vm.clone();
        std::thread::spawn(move || {
            vm.flush_remote_tlbs().unwrap();
            take_counts()
        })
    };
    while !SPINNING.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    cpu.read_u64(GPA).unwrap();
    let f = flusher.join().unwrap();
    cpu.exit();
    let v = take_counts();
    assert_eq!(f.spins, 1, "the flusher waited once: {f:?}");
    assert_eq!(
        f.charged(Cost::IpiSend),
        1,
        "one interrupt to the vCPU in guest mode"
    );
    assert!(
        f.fences >= 1 && f.rmw.len() >= 2,
        "request bit and generation: {f:?}"
    );
    assert_locks_balance(&f);
    assert!(
        v.charged(Cost::TlbFlush) >= 1,
        "the vCPU flushed its TLB: {v:?}"
    );
    assert!(v.rmw.len() >= 2, "took the request and acknowledged: {v:?}");
    assert_locks_balance(&v);
}

#[test]
fn every_charge_point_reports_to_the_format_clock() {
    let vm = Vm::<T>::new(VmConfig::default());
    let len = (PAGES + 1) * 4096;
    let ram = Arc::new(GuestRam::new(Backing::Anonymous, 2 << 20, true).unwrap());
    let host = HostRange::slice(ram.clone(), 0, len).unwrap();
    vm.add_memslot(1, Gpa::new(GPA), len, host, MemslotFlags::empty())
        .unwrap();
    let cpu = fault_and_access_paths_report(&vm);
    a_remote_flush_waits_for_a_vcpu_in_guest_mode(&vm, cpu);
}
