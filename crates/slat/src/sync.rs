//! Synchronisation primitives the engine is written against.
//!
//! Normal builds use `std` atomics, `parking_lot` locks, `arc-swap` publication and
//! `crossbeam-epoch` reclamation. Under `--cfg loom` the same names resolve to `loom`'s
//! model-checked versions so the install and fast-path protocols can be explored exhaustively
//! (`RUSTFLAGS="--cfg loom" cargo test -p slat --test loom --release`). Keeping every atomic
//! behind this module is what makes that possible: engine code never names `std::sync::atomic`.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

/// Creates a zero-valued atomic (std atomics are const-constructible, loom's are not).
pub(crate) fn atomic_u64(v: u64) -> AtomicU64 {
    AtomicU64::new(v)
}

// ---------------------------------------------------------------------------------------------
// Locks.

#[cfg(not(loom))]
mod locks {
    pub(crate) type RwLock<T> = parking_lot::RwLock<T>;
    pub(crate) type RwLockReadGuard<'a, T> = parking_lot::RwLockReadGuard<'a, T>;
    pub(crate) type RwLockWriteGuard<'a, T> = parking_lot::RwLockWriteGuard<'a, T>;
    pub(crate) type Mutex<T> = parking_lot::Mutex<T>;
    pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;

    pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
        l.read()
    }
    pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
        l.write()
    }
    pub(crate) fn lock<T>(l: &Mutex<T>) -> MutexGuard<'_, T> {
        l.lock()
    }
    /// Lets waiters in if there are any (fair unlock + relock); the caller must treat every
    /// pointer it derived under the lock as stale afterwards.
    pub(crate) fn bump_write<T>(g: &mut RwLockWriteGuard<'_, T>) {
        RwLockWriteGuard::bump(g)
    }
    pub(crate) fn bump_mutex<T>(g: &mut MutexGuard<'_, T>) {
        MutexGuard::bump(g)
    }
    /// Runs `f` with the lock released (fairly: a waiter takes it first), then re-takes it.
    pub(crate) fn unlocked_write<T>(g: &mut RwLockWriteGuard<'_, T>, f: impl FnOnce()) {
        RwLockWriteGuard::unlocked_fair(g, f)
    }
    /// See [`unlocked_write`].
    pub(crate) fn unlocked_mutex<T>(g: &mut MutexGuard<'_, T>, f: impl FnOnce()) {
        MutexGuard::unlocked_fair(g, f)
    }
}

#[cfg(loom)]
mod locks {
    pub(crate) type RwLock<T> = loom::sync::RwLock<T>;
    pub(crate) type RwLockReadGuard<'a, T> = loom::sync::RwLockReadGuard<'a, T>;
    pub(crate) type RwLockWriteGuard<'a, T> = loom::sync::RwLockWriteGuard<'a, T>;
    pub(crate) type Mutex<T> = loom::sync::Mutex<T>;
    pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
        l.read().expect("loom lock poisoned")
    }
    pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
        l.write().expect("loom lock poisoned")
    }
    pub(crate) fn lock<T>(l: &Mutex<T>) -> MutexGuard<'_, T> {
        l.lock().expect("loom lock poisoned")
    }
    pub(crate) fn bump_write<T>(_g: &mut RwLockWriteGuard<'_, T>) {}
    pub(crate) fn bump_mutex<T>(_g: &mut MutexGuard<'_, T>) {}
    // Loom runs `RealTime` only, whose bumps never release (as `bump_*` here).
    pub(crate) fn unlocked_write<T>(_g: &mut RwLockWriteGuard<'_, T>, f: impl FnOnce()) {
        f()
    }
    pub(crate) fn unlocked_mutex<T>(_g: &mut MutexGuard<'_, T>, f: impl FnOnce()) {
        f()
    }
}

pub(crate) use locks::*;

// ---------------------------------------------------------------------------------------------
// The same operations, reported to a clock (docs/design/virtual-time.md §1).
//
// Every engine site that synchronises with another CPU goes through one of these with its
// format's clock (`F::Clock`), so a simulated clock sees it; with `RealTime` each hook is empty
// and inlined, and these compile to the bare operation. Loom builds use `RealTime` only.

use crate::clock::{addr_of, Clock, LockMode};

/// The atomics the clocked operations take: `std`'s (or loom's) `AtomicU64` and `AtomicU32`.
pub(crate) trait Atom {
    /// The value type.
    type V: Copy;
    fn cas(&self, old: Self::V, new: Self::V, s: Ordering, f: Ordering)
        -> Result<Self::V, Self::V>;
    fn swap(&self, v: Self::V, o: Ordering) -> Self::V;
    fn store(&self, v: Self::V, o: Ordering);
    fn load(&self, o: Ordering) -> Self::V;
    fn fetch_add(&self, v: Self::V, o: Ordering) -> Self::V;
    fn fetch_sub(&self, v: Self::V, o: Ordering) -> Self::V;
    fn fetch_or(&self, v: Self::V, o: Ordering) -> Self::V;
    fn fetch_and(&self, v: Self::V, o: Ordering) -> Self::V;
    fn fetch_max(&self, v: Self::V, o: Ordering) -> Self::V;
}

macro_rules! atom {
    ($a:ty, $v:ty) => {
        impl Atom for $a {
            type V = $v;
            #[inline(always)]
            fn cas(&self, old: $v, new: $v, s: Ordering, f: Ordering) -> Result<$v, $v> {
                self.compare_exchange(old, new, s, f)
            }
            #[inline(always)]
            fn swap(&self, v: $v, o: Ordering) -> $v {
                <$a>::swap(self, v, o)
            }
            #[inline(always)]
            fn store(&self, v: $v, o: Ordering) {
                <$a>::store(self, v, o)
            }
            #[inline(always)]
            fn load(&self, o: Ordering) -> $v {
                <$a>::load(self, o)
            }
            #[inline(always)]
            fn fetch_add(&self, v: $v, o: Ordering) -> $v {
                <$a>::fetch_add(self, v, o)
            }
            #[inline(always)]
            fn fetch_sub(&self, v: $v, o: Ordering) -> $v {
                <$a>::fetch_sub(self, v, o)
            }
            #[inline(always)]
            fn fetch_or(&self, v: $v, o: Ordering) -> $v {
                <$a>::fetch_or(self, v, o)
            }
            #[inline(always)]
            fn fetch_and(&self, v: $v, o: Ordering) -> $v {
                <$a>::fetch_and(self, v, o)
            }
            #[inline(always)]
            fn fetch_max(&self, v: $v, o: Ordering) -> $v {
                <$a>::fetch_max(self, v, o)
            }
        }
    };
}
atom!(AtomicU64, u64);
atom!(AtomicU32, u32);

/// Compare-and-swap, reported as a read-modify-write of `a`'s line.
#[inline(always)]
pub(crate) fn cas<C: Clock, A: Atom>(
    a: &A,
    old: A::V,
    new: A::V,
    s: Ordering,
    f: Ordering,
) -> Result<A::V, A::V> {
    C::rmw(addr_of(a));
    a.cas(old, new, s, f)
}

/// Exchange, reported as a read-modify-write.
#[inline(always)]
pub(crate) fn swap<C: Clock, A: Atom>(a: &A, v: A::V, o: Ordering) -> A::V {
    C::rmw(addr_of(a));
    a.swap(v, o)
}

/// A store to a line other CPUs read: it makes the line exclusive. A plain store is not a
/// locked instruction; a `SeqCst` one is (x86 compiles it to an exchange), so it is
/// reported as an RMW.
#[inline(always)]
pub(crate) fn store<C: Clock, A: Atom>(a: &A, v: A::V, o: Ordering) {
    if o == Ordering::SeqCst {
        C::rmw(addr_of(a));
    } else {
        C::store(addr_of(a));
    }
    a.store(v, o)
}

/// [`cas`] on a page-table entry: a successful write reports the value it replaced
/// ([`Clock::entry_replaced`]), for walks earlier in virtual time.
#[inline(always)]
pub(crate) fn cas_entry<C: Clock>(
    e: &AtomicU64,
    old: u64,
    new: u64,
    s: Ordering,
    f: Ordering,
) -> Result<u64, u64> {
    let r = cas::<C, _>(e, old, new, s, f);
    if let Ok(v) = r {
        C::entry_replaced(addr_of(e), v);
    }
    r
}

/// [`swap`] on a page-table entry, reported as [`cas_entry`] is.
#[inline(always)]
pub(crate) fn swap_entry<C: Clock>(e: &AtomicU64, v: u64, o: Ordering) -> u64 {
    let old = swap::<C, _>(e, v, o);
    C::entry_replaced(addr_of(e), old);
    old
}

/// [`store`] of `v` over `old` in a page-table entry nobody else writes meanwhile, reported
/// as [`cas_entry`] is.
#[inline(always)]
pub(crate) fn store_entry<C: Clock>(e: &AtomicU64, old: u64, v: u64, o: Ordering) {
    store::<C, _>(e, v, o);
    C::entry_replaced(addr_of(e), old);
}

/// A load of a line other CPUs write (an entry, a request word).
#[inline(always)]
pub(crate) fn load<C: Clock, A: Atom>(a: &A, o: Ordering) -> A::V {
    C::shared_load(addr_of(a));
    a.load(o)
}

/// `fetch_add`, reported as a read-modify-write.
#[inline(always)]
pub(crate) fn fetch_add<C: Clock, A: Atom>(a: &A, v: A::V, o: Ordering) -> A::V {
    C::rmw(addr_of(a));
    a.fetch_add(v, o)
}

/// `fetch_sub`, reported as a read-modify-write.
#[inline(always)]
pub(crate) fn fetch_sub<C: Clock, A: Atom>(a: &A, v: A::V, o: Ordering) -> A::V {
    C::rmw(addr_of(a));
    a.fetch_sub(v, o)
}

/// `fetch_or`, reported as a read-modify-write.
#[inline(always)]
pub(crate) fn fetch_or<C: Clock, A: Atom>(a: &A, v: A::V, o: Ordering) -> A::V {
    C::rmw(addr_of(a));
    a.fetch_or(v, o)
}

/// `fetch_and`, reported as a read-modify-write.
#[inline(always)]
pub(crate) fn fetch_and<C: Clock, A: Atom>(a: &A, v: A::V, o: Ordering) -> A::V {
    C::rmw(addr_of(a));
    a.fetch_and(v, o)
}

/// `fetch_max`, reported as a read-modify-write.
#[inline(always)]
pub(crate) fn fetch_max<C: Clock, A: Atom>(a: &A, v: A::V, o: Ordering) -> A::V {
    C::rmw(addr_of(a));
    a.fetch_max(v, o)
}

/// A fence, reported to the clock.
#[inline(always)]
pub(crate) fn fence_c<C: Clock>(o: Ordering) {
    C::fence();
    fence(o)
}

/// Waits until `cond()` holds; `watch` lists the addresses whose writes can make it true.
#[inline(always)]
pub(crate) fn spin_until<C: Clock>(watch: &[usize], mut cond: impl FnMut() -> bool) {
    // The first test inline: most waits are already satisfied.
    if !cond() {
        C::spin_until(watch, &mut cond);
    }
}

/// A lock guard that reports its release to the clock after the real release.
pub(crate) struct Held<G, C: Clock> {
    g: core::mem::ManuallyDrop<G>,
    addr: usize,
    mode: LockMode,
    _clock: core::marker::PhantomData<C>,
}

impl<G, C: Clock> Held<G, C> {
    /// Takes the lock at `addr` in `mode` with `acquire`, the clock's wait first.
    #[inline(always)]
    fn take(addr: usize, mode: LockMode, acquire: impl FnOnce() -> G) -> Self {
        C::lock(addr, mode);
        Held {
            g: core::mem::ManuallyDrop::new(acquire()),
            addr,
            mode,
            _clock: core::marker::PhantomData,
        }
    }
}

impl<G, C: Clock> Drop for Held<G, C> {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: dropped once, here, and never used again.
        unsafe { core::mem::ManuallyDrop::drop(&mut self.g) };
        C::unlock(self.addr, self.mode);
    }
}

impl<G: core::ops::Deref, C: Clock> core::ops::Deref for Held<G, C> {
    type Target = G::Target;
    #[inline(always)]
    fn deref(&self) -> &G::Target {
        &self.g
    }
}

impl<G: core::ops::DerefMut, C: Clock> core::ops::DerefMut for Held<G, C> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.g
    }
}

/// A read guard reported to clock `C`.
pub(crate) type ReadHeld<'a, T, C> = Held<RwLockReadGuard<'a, T>, C>;
/// A write guard reported to clock `C`.
pub(crate) type WriteHeld<'a, T, C> = Held<RwLockWriteGuard<'a, T>, C>;
/// A mutex guard reported to clock `C`.
pub(crate) type MutexHeld<'a, T, C> = Held<MutexGuard<'a, T>, C>;

/// [`read`], reported to `C`.
#[inline(always)]
pub(crate) fn read_c<C: Clock, T>(l: &RwLock<T>) -> ReadHeld<'_, T, C> {
    Held::take(addr_of(l), LockMode::Shared, || read(l))
}

/// [`write`], reported to `C`.
#[inline(always)]
pub(crate) fn write_c<C: Clock, T>(l: &RwLock<T>) -> WriteHeld<'_, T, C> {
    Held::take(addr_of(l), LockMode::Exclusive, || write(l))
}

/// [`lock`], reported to `C`.
#[inline(always)]
pub(crate) fn lock_c<C: Clock, T>(l: &Mutex<T>) -> MutexHeld<'_, T, C> {
    Held::take(addr_of(l), LockMode::Exclusive, || lock(l))
}

/// [`bump_write`], reported to `C`: in virtual time a release and an acquire at the tail of
/// the lock's queue, made while the real lock is released (the model may hand it over).
#[inline(always)]
pub(crate) fn bump_write_c<T, C: Clock>(g: &mut WriteHeld<'_, T, C>) {
    let addr = g.addr;
    if C::VIRTUAL {
        unlocked_write(&mut g.g, || {
            C::unlock(addr, LockMode::Exclusive);
            C::lock(addr, LockMode::Exclusive);
        });
    } else {
        bump_write(&mut g.g)
    }
}

/// [`bump_mutex`], reported to `C` (see [`bump_write_c`]).
#[inline(always)]
pub(crate) fn bump_mutex_c<T, C: Clock>(g: &mut MutexHeld<'_, T, C>) {
    let addr = g.addr;
    if C::VIRTUAL {
        unlocked_mutex(&mut g.g, || {
            C::unlock(addr, LockMode::Exclusive);
            C::lock(addr, LockMode::Exclusive);
        });
    } else {
        bump_mutex(&mut g.g)
    }
}

// ---------------------------------------------------------------------------------------------
// Publication of read-mostly snapshots (the memslot set).

/// A value replaced wholesale by writers and read lock-free by the fault path.
#[cfg(not(loom))]
pub(crate) struct Published<T>(arc_swap::ArcSwap<T>);

#[cfg(not(loom))]
impl<T> Published<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(arc_swap::ArcSwap::from_pointee(v))
    }
    pub(crate) fn load_full(&self) -> Arc<T> {
        self.0.load_full()
    }
    pub(crate) fn store(&self, v: Arc<T>) {
        self.0.store(v)
    }
    /// Runs `f` on the current value without touching its reference count in the common
    /// case (arc-swap's read guard): for hot paths that many threads take at once.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.0.load())
    }
}

#[cfg(loom)]
pub(crate) struct Published<T>(loom::sync::Mutex<Arc<T>>);

#[cfg(loom)]
impl<T> Published<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(loom::sync::Mutex::new(Arc::new(v)))
    }
    pub(crate) fn load_full(&self) -> Arc<T> {
        self.0.lock().expect("loom lock poisoned").clone()
    }
    pub(crate) fn store(&self, v: Arc<T>) {
        *self.0.lock().expect("loom lock poisoned") = v;
    }
    pub(crate) fn with<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.0.lock().expect("loom lock poisoned"))
    }
}

// ---------------------------------------------------------------------------------------------
// Fixed costs of the reclamation and publication libraries, whose atomics are their own.

/// [`pin`], charged to `C` as [`Cost::EpochPin`](crate::clock::Cost::EpochPin).
#[inline(always)]
pub(crate) fn pin_c<C: Clock>() -> Guard {
    C::charge(crate::clock::Cost::EpochPin, 1);
    pin()
}

impl Guard {
    /// [`Guard::defer`], charged to `C` as [`Cost::Defer`](crate::clock::Cost::Defer).
    #[inline(always)]
    pub(crate) fn defer_c<C: Clock, F: FnOnce() + Send + 'static>(&self, f: F) {
        C::charge(crate::clock::Cost::Defer, 1);
        self.defer(f)
    }
}

impl<T> Published<T> {
    /// [`Published::with`], charged to `C` as a published load.
    #[inline(always)]
    pub(crate) fn with_c<C: Clock, R>(&self, f: impl FnOnce(&T) -> R) -> R {
        C::charge(crate::clock::Cost::PublishedLoad, 1);
        self.with(f)
    }
    /// [`Published::load_full`], charged to `C` as a published load.
    #[inline(always)]
    pub(crate) fn load_full_c<C: Clock>(&self) -> Arc<T> {
        C::charge(crate::clock::Cost::PublishedLoad, 1);
        self.load_full()
    }
}

// ---------------------------------------------------------------------------------------------
// Epoch reclamation of unlinked table pages.

/// Proof that the current thread is inside a reclamation read-side section: table pages it can
/// reach stay allocated until the guard is dropped.
/// A vCPU in guest mode needs no pin: no page it can reach is freed before it acknowledges a
/// flush, which it only does between accesses (see [`guest_mode_guard`]).
#[cfg(not(loom))]
pub(crate) struct Guard(Option<crossbeam_epoch::Guard>);

#[cfg(not(loom))]
pub(crate) fn pin() -> Guard {
    Guard(Some(crossbeam_epoch::pin()))
}

/// The read-side protection of a vCPU in guest mode, for free.
///
/// # Safety
/// The caller is a vCPU in guest mode and stays in it (without acknowledging a flush request)
/// for as long as the guard lives: a table page is freed only after a remote flush completed,
/// which waits for that acknowledgement, and after it was unlinked, so a walk that starts later
/// cannot reach it.
#[cfg(not(loom))]
pub(crate) unsafe fn guest_mode_guard() -> Guard {
    Guard(None)
}

#[cfg(not(loom))]
impl Guard {
    /// Runs `f` once no thread pinned now can still be inside its section.
    pub(crate) fn defer<F: FnOnce() + Send + 'static>(&self, f: F) {
        match &self.0 {
            Some(g) => g.defer(f),
            None => crossbeam_epoch::pin().defer(f),
        }
    }
    /// Pushes this thread's deferred work to the global queue and tries to collect.
    pub(crate) fn flush(&self) {
        if let Some(g) = &self.0 {
            g.flush()
        }
    }
}

/// Under loom: the guard's id in the reclamation model ([`epoch_model`]), `None` for a vCPU in
/// guest mode (not registered: it is protected by the flush protocol, not by a pin).
#[cfg(loom)]
pub(crate) struct Guard(Option<u64>);

/// Pins the thread (registers a guard in [`epoch_model`]) and, as crossbeam's pin does, ends
/// with a `SeqCst` fence: a reader pinned after a deferral sees what the deferrer did before it.
#[cfg(loom)]
pub(crate) fn pin() -> Guard {
    let id = epoch_model::register();
    fence(Ordering::SeqCst);
    Guard(Some(id))
}

/// See the non-loom version.
#[cfg(loom)]
pub(crate) unsafe fn guest_mode_guard() -> Guard {
    Guard(None)
}

#[cfg(loom)]
impl Guard {
    /// Queues `f` until every guard alive now has been dropped (see [`epoch_model`]). The
    /// `SeqCst` fence stands for the one crossbeam issues when it seals deferred work with the
    /// current epoch; whoever runs `f` fences too, so `f` sees what preceded the deferral.
    pub(crate) fn defer<F: FnOnce() + Send + 'static>(&self, f: F) {
        fence(Ordering::SeqCst);
        epoch_model::defer(Box::new(f));
    }
    /// Runs deferred work that waits for no guard any more (deferred with nobody pinned).
    pub(crate) fn flush(&self) {
        epoch_model::collect(None);
    }
}

#[cfg(loom)]
impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(id) = self.0 {
            epoch_model::collect(Some(id));
        }
    }
}

/// The reclamation model under loom: an ideal grace period, the earliest any epoch scheme
/// could free. A deferred closure waits for exactly the guards alive when it was deferred
/// (including the deferrer's own) and runs, in the thread that drops the last of them, as soon
/// as they are all gone; guards taken after the deferral do not hold it back. Frees therefore
/// come as early as a correct scheme allows, and a reader that is not protected by a pin that
/// predates the deferral sees its page freed (`TablePage::at` checks, under loom).
///
/// The bookkeeping is plain data behind a `std` mutex, invisible to loom (all loom threads run
/// on one OS thread, and the lock is never held across a loom scheduling point), so it adds no
/// interleavings and no synchronisation to the model: the only loom-visible effects are the
/// `SeqCst` fences of pin, defer and run. The state is a `loom::lazy_static`, reset for every
/// execution; it is first touched when a VM is created ([`touch`]): a lazy static's first
/// access is a release that every later access acquires, and from the VM's creator, before it
/// shares the VM, that links no threads the model would otherwise leave unordered.
#[cfg(loom)]
pub(crate) mod epoch_model {
    use loom::sync::atomic::{fence, Ordering};

    type Deferred = Box<dyn FnOnce() + Send>;

    struct Waiting {
        /// Guards alive at the deferral that are still alive.
        on: Vec<u64>,
        /// The loom thread that deferred (for [`frees_held_back`]).
        by: loom::thread::ThreadId,
        f: Deferred,
    }

    #[derive(Default)]
    struct State {
        next_id: u64,
        /// Live guards: (id, loom thread).
        active: Vec<(u64, loom::thread::ThreadId)>,
        queue: Vec<Waiting>,
        /// Closures that became runnable when another thread than their deferrer unpinned:
        /// a reader's pin held a free back (coverage for the models).
        held_back: u64,
        /// Loom threads now running deferred work (one entry per nesting level).
        running: Vec<loom::thread::ThreadId>,
    }

    pub(crate) struct Epoch(std::sync::Mutex<State>);

    impl Drop for Epoch {
        fn drop(&mut self) {
            // End of an execution (outside it). Closures still queued (a guard was leaked, or
            // the execution failed) hold loom objects that cannot be dropped here: leak them;
            // on a passing execution loom's leak check then reports their `Arc`s.
            let st = self.0.get_mut().unwrap_or_else(|e| e.into_inner());
            for w in st.queue.drain(..) {
                std::mem::forget(w);
            }
        }
    }

    loom::lazy_static! {
        static ref EPOCH: Epoch = Epoch(std::sync::Mutex::new(State::default()));
    }

    fn state() -> std::sync::MutexGuard<'static, State> {
        EPOCH.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Initialises the model's state for this execution (called by the VM's creator, before it
    /// shares the VM with other threads).
    pub(crate) fn touch() {
        drop(state());
    }

    pub(super) fn register() -> u64 {
        let mut st = state();
        st.next_id += 1;
        let id = st.next_id;
        st.active.push((id, loom::thread::current().id()));
        id
    }

    pub(super) fn defer(f: Deferred) {
        let mut st = state();
        let on = st.active.iter().map(|&(id, _)| id).collect();
        let by = loom::thread::current().id();
        st.queue.push(Waiting { on, by, f });
    }

    /// Drops guard `id` (if any) and runs every closure that waits for no live guard any
    /// more. Closures run outside the lock; one that pins and defers (retire's first grace
    /// period) queues the next stage, which the drop of its own guard collects: the chain is
    /// as long as the retire's stages, so this is bounded.
    pub(super) fn collect(id: Option<u64>) {
        let me = loom::thread::current().id();
        let ready: Vec<Deferred> = {
            let mut st = state();
            if let Some(id) = id {
                st.active.retain(|&(g, _)| g != id);
                for w in st.queue.iter_mut() {
                    w.on.retain(|&g| g != id);
                }
            }
            if std::thread::panicking() {
                return; // the execution failed already; leave the work queued
            }
            let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut st.queue)
                .into_iter()
                .partition(|w| w.on.is_empty());
            st.queue = waiting;
            st.held_back += ready.iter().filter(|w| w.by != me).count() as u64;
            ready.into_iter().map(|w| w.f).collect()
        };
        for f in ready {
            // Whoever runs deferred work has synchronised with the deferral (crossbeam's
            // collector fences before it looks at the epoch).
            fence(Ordering::SeqCst);
            state().running.push(me);
            f();
            let mut st = state();
            if let Some(i) = st.running.iter().rposition(|&t| t == me) {
                st.running.remove(i);
            }
        }
    }

    /// The current loom thread is running deferred work (a retire's sweep, a free).
    pub(crate) fn in_deferred() -> bool {
        let me = loom::thread::current().id();
        state().running.contains(&me)
    }

    /// Deferred closures (this execution) freed by another thread than the one that deferred
    /// them, because that thread's pin held them back.
    pub(crate) fn frees_held_back() -> u64 {
        state().held_back
    }
}
