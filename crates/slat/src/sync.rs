//! Synchronisation primitives the engine is written against.
//!
//! Normal builds use `std` atomics, `parking_lot` locks, `arc-swap` publication and
//! `crossbeam-epoch` reclamation. Under `--cfg loom` the same names resolve to `loom`'s
//! model-checked versions so the install and fast-path protocols can be explored exhaustively
//! (`RUSTFLAGS="--cfg loom" cargo test -p slat --test loom --release`). Keeping every atomic
//! behind this module is what makes that possible: engine code never names `std::sync::atomic`.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

/// Creates a zero-valued atomic (std atomics are const-constructible, loom's are not).
pub(crate) fn atomic_u64(v: u64) -> AtomicU64 {
    AtomicU64::new(v)
}

/// Busy-wait hint used while waiting for flush acknowledgements.
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
}

pub(crate) use locks::*;

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

#[cfg(loom)]
pub(crate) struct Guard;

#[cfg(loom)]
pub(crate) fn pin() -> Guard {
    Guard
}

/// See the non-loom version.
#[cfg(loom)]
pub(crate) unsafe fn guest_mode_guard() -> Guard {
    Guard
}

#[cfg(loom)]
impl Guard {
    // Loom does not model reclamation; deferred frees run when the model's VM is dropped, via the
    // allocator's graveyard, which is the most conservative schedule possible.
    pub(crate) fn defer<F: FnOnce() + Send + 'static>(&self, f: F) {
        LOOM_DEFERRED.with(|d| d.borrow_mut().push(Box::new(f)));
    }
    pub(crate) fn flush(&self) {
        let fs: Vec<_> = LOOM_DEFERRED.with(|d| std::mem::take(&mut *d.borrow_mut()));
        for f in fs {
            f();
        }
    }
}

#[cfg(loom)]
type Deferred = Box<dyn FnOnce() + Send>;

#[cfg(loom)]
std::thread_local! {
    static LOOM_DEFERRED: std::cell::RefCell<Vec<Deferred>> = const { std::cell::RefCell::new(Vec::new()) };
}
