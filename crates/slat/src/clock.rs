//! Where time passes: the hooks through which a simulated clock observes the engine.
//!
//! Every place the engine or the simulated machine synchronises with another CPU (an atomic
//! read-modify-write, a fence, a lock, a spin wait) or does work whose cost a model needs (a
//! walk step, a table page zeroed, a TLB hit) calls one of [`Clock`]'s functions. The clock
//! is a *type*, reached as [`PteFormat::Clock`](crate::PteFormat::Clock), so
//! [`RealTime`] — every function empty and inlined — compiles to exactly the code there was
//! before the hooks, and a virtual-time build of the same engine is a second
//! monomorphisation chosen at run time (`Timed<Ept, Virtual>`), not a branch on every atomic
//! (docs/design/virtual-time.md §1).
//!
//! The virtual implementation lives outside the engine (`slat-vt`); the engine only calls the
//! hooks. Hooks are called with the address of the synchronising object (a cache line is
//! `addr >> 6`), never dereference it, and never change what the engine does: a hook may make
//! the calling thread wait (in virtual time, one simulated CPU runs at a time), but the
//! engine's own synchronisation stays the real one.

/// How a lock is taken, for the lock model (readers enter together, a writer alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// Shared: readers of a readers–writer lock.
    Shared,
    /// Exclusive: a writer, or a mutex.
    Exclusive,
}

/// Fixed costs a clock charges where no other CPU is involved.
///
/// What each costs is the clock's business (a cost profile in `slat-vt`); [`RealTime`] ignores
/// them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Cost {
    /// One step of the engine's software walk down a level (a table entry read and decoded).
    WalkStep,
    /// One step of the simulated hardware's page walk.
    HwWalkStep,
    /// A translation found in the simulated TLB.
    TlbHit,
    /// A translation missed in the simulated TLB (the walk is charged by its steps).
    TlbMiss,
    /// A simulated TLB flush (local invalidation of every entry).
    TlbFlush,
    /// Allocating a table page (not counting the zeroing).
    TableAlloc,
    /// Zeroing one 4 KiB page.
    ZeroPage,
    /// Entering an epoch-reclamation read-side section (crossbeam's pin: a locked operation).
    EpochPin,
    /// Queueing a deferred free.
    Defer,
    /// Reading the published memslot set.
    PublishedLoad,
    /// Cleaning or invalidating one 64-byte cache line to the point of coherency / unification.
    CmoLine,
    /// One guest data access (load or store) that reaches memory.
    GuestAccess,
    /// A VM exit (guest → host).
    VmExit,
    /// A VM entry (host → guest).
    VmEntry,
    /// Servicing an inter-processor interrupt on the target CPU.
    IpiHandler,
    /// Sending one inter-processor interrupt.
    IpiSend,
    /// A fault taken by the lock-free fast path: its own software work (decoding the fault,
    /// the checks, the dirty mark's bookkeeping), apart from what other hooks charge.
    FastFault,
    /// A fault taken by the slow path: its own software work (the memslot lookup, the plan,
    /// the install's bookkeeping), apart from what other hooks charge. It and
    /// [`Cost::FastFault`] are charged first on their paths, so a profile may make them
    /// negative: an overlap credit the path's later charges use up (`slat-vt`).
    SlowFault,
    /// One step of the engine's walk to the next entry of the same table (a range walk).
    WalkSide,
    /// The exit to the hypervisor and the entry back around a fault the fast path resolves.
    /// On hardware every stage-2 fault is a VM exit, whichever path handles it; the simulated
    /// machine's fast path runs inside the access without leaving guest mode, so this is
    /// charged there instead (its slow path pays `VmExit` + `VmEntry` when it leaves guest
    /// mode). Zero for the simulated machine itself; a hardware round trip for a real one.
    FastFaultExit,
    /// Copying one 4 KiB page of host memory into guest memory (a snapshot reset writing a
    /// dirty page back; its zeroing is [`Cost::ZeroPage`]).
    PageCopy,
    /// A VM exit and entry the guest does not see, around a retried fault or an interrupt
    /// taken in guest mode: the vCPU leaves and re-enters before its access goes on. The
    /// simulated machine stands in for it with a PAUSE loop in real time (so a vCPU that lost
    /// a race does not re-fault at once on the entry another holds), which a simulated clock
    /// charges as this instead.
    GuestRoundTrip,
}

impl Cost {
    /// Every cost, in declaration order (profiles list them in this order).
    pub const ALL: [Cost; 22] = [
        Cost::WalkStep,
        Cost::HwWalkStep,
        Cost::TlbHit,
        Cost::TlbMiss,
        Cost::TlbFlush,
        Cost::TableAlloc,
        Cost::ZeroPage,
        Cost::EpochPin,
        Cost::Defer,
        Cost::PublishedLoad,
        Cost::CmoLine,
        Cost::GuestAccess,
        Cost::VmExit,
        Cost::VmEntry,
        Cost::IpiHandler,
        Cost::IpiSend,
        Cost::FastFault,
        Cost::SlowFault,
        Cost::WalkSide,
        Cost::FastFaultExit,
        Cost::PageCopy,
        Cost::GuestRoundTrip,
    ];
}

/// A clock the engine reports its synchronisation and work to.
///
/// Functions take no `self`: a clock is chosen by type, and a virtual clock finds the
/// simulated CPU it runs on from the calling thread.
///
/// # Safety
///
/// The engine relies on a clock not changing what it does: a hook must not touch the engine's
/// state, must return (it may wait for other simulated CPUs, never for the caller itself), and
/// `spin_until` must return only once `cond` has returned `true`. `lock` is called before the
/// real acquire and `unlock` after the real release of the same lock, with the same mode, on
/// the same thread; a clock that makes `lock` return while another thread holds the real lock
/// in a conflicting mode only costs real waiting, never correctness. `entry_as_seen` (and
/// `walk_load`'s second value) must be the entry's current value or one it held before, and
/// a CPU that reads the entry again must come to see the current one: the engine never
/// follows such a value as a table pointer, but a handler retries for as long as it sees an
/// older one.
pub unsafe trait Clock: Send + Sync + 'static {
    /// `true` for a simulated clock: code that must differ in virtual time (a sampler thread,
    /// a data access redirected to phantom memory) tests this constant, which folds away.
    const VIRTUAL: bool;
    /// An atomic read-modify-write, compare-and-swap, exchange or store on the cache line of
    /// `addr`: the line is made exclusive to the caller.
    fn rmw(addr: usize);
    /// A plain store to the line of `addr`, which other CPUs read: the line is made exclusive
    /// to the caller, but unlike an RMW the store is not a locked instruction (it retires
    /// into the store buffer). A clock that does not tell them apart prices it as an RMW.
    #[inline(always)]
    fn store(addr: usize) {
        Self::rmw(addr);
    }
    /// A load of a line other CPUs write (a page-table entry, a request word).
    fn shared_load(addr: usize);
    /// A guest data access (`write` or read) to the host line of `addr`, in memory other
    /// vCPUs access too. Its own cost (a cache or DRAM access) is [`Cost::GuestAccess`],
    /// charged separately; a clock that models coherence adds only what moving the line
    /// between CPUs costs. Empty by default.
    #[inline(always)]
    fn data_access(addr: usize, write: bool) {
        let _ = (addr, write);
    }
    /// After a write replaced `old` in the page-table entry at `addr` (the writer's clock
    /// already counts it). A clock that runs CPUs out of virtual-time order keeps it for
    /// [`walk_load`](Self::walk_load). Empty by default.
    #[inline(always)]
    fn entry_replaced(addr: usize, old: u64) {
        let _ = (addr, old);
    }
    /// A fault handler's read of the page-table entry at `addr`, which holds `current`: the
    /// value the calling CPU sees at its clock. It differs from `current` only under a clock
    /// that lets one CPU run ahead in virtual time ([`walk_load`](Self::walk_load)), and the
    /// handler acts on it only through compare-and-swap, which then fails as it would have
    /// against the write it did not see (`Walk::as_seen_by_handler` in `mmu/walk.rs`). By
    /// default `current`.
    #[inline(always)]
    fn entry_as_seen(addr: usize, current: u64) -> u64 {
        let _ = addr;
        current
    }
    /// A hardware walk's load of the page-table entry at `addr`: the value memory holds, and the
    /// value the calling CPU sees at its clock. They differ only under a clock that lets one
    /// CPU run ahead in virtual time: the second is then the value from before writes other
    /// CPUs made later in virtual time than the caller's clock, though earlier in real order.
    /// By default a [`shared_load`](Self::shared_load) of the entry and its value, twice.
    ///
    /// `load` reads the entry at `addr`; a clock calls it exactly once, and must not hold
    /// anything `load` could wait for.
    #[inline(always)]
    fn walk_load(addr: usize, load: impl FnOnce() -> u64) -> (u64, u64) {
        Self::shared_load(addr);
        let v = load();
        (v, v)
    }
    /// A sequentially consistent fence.
    fn fence();
    /// Before the real acquire of the lock at `addr`: waits until the lock model grants it.
    fn lock(addr: usize, mode: LockMode);
    /// After the real release of the lock at `addr`: hands it to the next waiter.
    fn unlock(addr: usize, mode: LockMode);
    /// Waits until `cond()` is true. `watch` lists the addresses whose writes can make it
    /// true: a virtual clock re-evaluates `cond` only after one of them was written, so the
    /// wait advances time instead of burning it.
    fn spin_until(watch: &[usize], cond: &mut dyn FnMut() -> bool);
    /// Charges `n` times the fixed cost `cost`.
    fn charge(cost: Cost, n: u64);
    /// Now, in nanoseconds since an arbitrary start (the caller's simulated CPU's clock for a
    /// virtual clock, a monotonic host clock for [`RealTime`]).
    fn now_ns() -> u64;
}

/// The host's own time: every hook is empty, `spin_until` is the engine's spin-then-yield
/// loop, and `now_ns` reads the monotonic clock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RealTime;

// SAFETY: no hook touches engine state; `spin_until` loops until `cond` holds.
unsafe impl Clock for RealTime {
    const VIRTUAL: bool = false;
    #[inline(always)]
    fn rmw(_addr: usize) {}
    #[inline(always)]
    fn store(_addr: usize) {}
    #[inline(always)]
    fn shared_load(_addr: usize) {}
    #[inline(always)]
    fn fence() {}
    #[inline(always)]
    fn lock(_addr: usize, _mode: LockMode) {}
    #[inline(always)]
    fn unlock(_addr: usize, _mode: LockMode) {}
    #[inline]
    fn spin_until(_watch: &[usize], cond: &mut dyn FnMut() -> bool) {
        // Spin briefly (the other side is usually a running vCPU about to reach a boundary),
        // then give the CPU away: the CPU we wait for may need it.
        let mut spins = 0u32;
        while !cond() {
            if spins < 64 {
                spins += 1;
                spin_hint();
            } else {
                yield_now();
            }
        }
    }
    #[inline(always)]
    fn charge(_cost: Cost, _n: u64) {}
    #[inline]
    fn now_ns() -> u64 {
        real_now_ns()
    }
}

/// Busy-wait hint used while waiting (a flush acknowledgement, another CPU's store).
#[inline]
pub(crate) fn spin_hint() {
    #[cfg(not(loom))]
    std::hint::spin_loop();
    #[cfg(loom)]
    loom::thread::yield_now();
}

/// Gives the CPU away after spinning has not helped (a vCPU we wait for may need it).
#[inline]
pub(crate) fn yield_now() {
    #[cfg(not(loom))]
    std::thread::yield_now();
    #[cfg(loom)]
    loom::thread::yield_now();
}

/// Nanoseconds of the host's monotonic clock since the first call in this process.
fn real_now_ns() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The address hooks take for `v`: the location of the synchronising object.
#[inline(always)]
pub fn addr_of<T: ?Sized>(v: &T) -> usize {
    (v as *const T).cast::<u8>() as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_time_spin_until_returns_once_true() {
        let mut n = 0;
        RealTime::spin_until(&[], &mut || {
            n += 1;
            n == 100
        });
        assert_eq!(n, 100);
    }

    #[test]
    fn real_time_now_is_monotonic() {
        let a = RealTime::now_ns();
        let b = RealTime::now_ns();
        assert!(b >= a);
    }

    #[test]
    fn cost_all_lists_each_once() {
        let mut v = Cost::ALL.to_vec();
        v.sort();
        v.dedup();
        assert_eq!(v.len(), Cost::ALL.len());
    }
}
