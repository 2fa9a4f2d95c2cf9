//! The MMU lock: a reader/writer lock (faults share it) or one mutex ([`MmuLockKind`]); and
//! the witnesses of how it is held, which the SPTE-update path takes ([`SpteWriter`]).
//!
//! A writer of table entries proves how it may write by the witness it hands to
//! `Mmu::update_spte` (as arm64's `kvm_pgtable_visit_ctx` knows shared from exclusive, and as
//! KVM's `lockdep_assert_held_write(&kvm->mmu_lock)` guards its plain stores):
//!
//! - [`Shared`]: a compare-and-swap against the walker's snapshot (invariant 1). Built from a
//!   [`ReadGuard`] ([`MmuLock::shared`]), from an [`Exclusive`] ([`Exclusive::cas`]: the holder
//!   of the exclusive lock may always compare-and-swap), or by a lock-free writer from its
//!   reclamation guard ([`Shared::lockless`]: the fast path in guest mode, the `rmap-lockless`
//!   write-protect, the direct map under its own lock).
//! - [`Exclusive`]: an exchange, or a plain store where no lock-free writer can change the
//!   entry. Built only from a [`WriteGuard`] ([`MmuLock::exclusive`]).
//!
//! **Why the type system enforces it.** The plain store is written once, in
//! `<Exclusive as SpteWriter>::write`. [`Exclusive`]'s fields are private to this module and
//! its one constructor, [`MmuLock::exclusive`], borrows a [`WriteGuard`], whose fields are
//! private too and which only [`MmuLock::write`] makes. So an `Exclusive` exists only while
//! an exclusive guard is held, and its lifetime ends before the guard can be dropped or
//! bumped (`WriteGuard::bump` takes `&mut`, which the witness's borrow excludes). A
//! [`ReadGuard`] or a reclamation guard yields only a [`Shared`], which has no path to the
//! plain store. (The witnesses are crate-private, so a `compile_fail` doctest, which compiles
//! against the public API, cannot show this; `Exclusive { .. }` outside this module, or
//! `MmuLock::exclusive(&read_guard)`, is a type error.) Debug builds also check that the
//! guard belongs to the lock it is presented to, as lockdep checks the lock, not just a lock.

use crate::clock::Clock;
use crate::config::MmuLockKind;
use crate::format::{Level, PteFormat};
use crate::sync::{self, AtomicU64, Guard, Mutex, Ordering, RwLock};
use std::marker::PhantomData;

pub(crate) struct MmuLock {
    inner: Inner,
    /// `rmap-lockless`: harvests write-protect leaves with compare-and-swaps and no lock, so
    /// an exclusive holder is not the only software writer of any leaf.
    lockless_wrprot: bool,
    /// `rmap-each`: the legacy MMU's rule for which entries an exclusive holder exchanges.
    exchange_writable: bool,
}

enum Inner {
    Rw(RwLock<()>),
    Mutex(Mutex<()>),
}

/// Held for a "read" (shared) MMU operation; exclusive under the mutex variant. Reports its
/// release to clock `C`.
pub(crate) struct ReadGuard<'a, C: Clock> {
    _held: ReadHeld<'a, C>,
    owner: &'a MmuLock,
}

#[allow(dead_code)] // held for its drop
enum ReadHeld<'a, C: Clock> {
    Rw(sync::ReadHeld<'a, (), C>),
    Mutex(sync::MutexHeld<'a, (), C>),
}

/// Held for an exclusive MMU operation. Reports its release to clock `C`.
pub(crate) struct WriteGuard<'a, C: Clock> {
    held: WriteHeld<'a, C>,
    owner: &'a MmuLock,
}

enum WriteHeld<'a, C: Clock> {
    Rw(sync::WriteHeld<'a, (), C>),
    Mutex(sync::MutexHeld<'a, (), C>),
}

impl<C: Clock> WriteGuard<'_, C> {
    /// Lets waiting faults run, then re-takes the lock.
    pub(crate) fn bump(&mut self) {
        match &mut self.held {
            WriteHeld::Rw(g) => sync::bump_write_c(g),
            WriteHeld::Mutex(g) => sync::bump_mutex_c(g),
        }
    }
}

impl MmuLock {
    /// `exchange_writable`: exclusive holders exchange every writable leaf too, not only the
    /// entries a lock-free writer can change now (the legacy MMU's `spte_has_volatile_bits`
    /// treated every entry the fast path could ever change, writable ones included, as
    /// volatile, for a stable W bit to decide the flush on).
    pub(crate) fn new(kind: MmuLockKind, lockless_wrprot: bool, exchange_writable: bool) -> Self {
        let inner = match kind {
            MmuLockKind::RwLock => Inner::Rw(RwLock::new(())),
            MmuLockKind::Mutex => Inner::Mutex(Mutex::new(())),
        };
        MmuLock {
            inner,
            lockless_wrprot,
            exchange_writable,
        }
    }

    #[inline]
    pub(crate) fn read<C: Clock>(&self) -> ReadGuard<'_, C> {
        let held = match &self.inner {
            Inner::Rw(l) => ReadHeld::Rw(sync::read_c(l)),
            Inner::Mutex(m) => ReadHeld::Mutex(sync::lock_c(m)),
        };
        ReadGuard {
            _held: held,
            owner: self,
        }
    }

    #[inline]
    pub(crate) fn write<C: Clock>(&self) -> WriteGuard<'_, C> {
        let held = match &self.inner {
            Inner::Rw(l) => WriteHeld::Rw(sync::write_c(l)),
            Inner::Mutex(m) => WriteHeld::Mutex(sync::lock_c(m)),
        };
        WriteGuard { held, owner: self }
    }

    /// The compare-and-swap writer of a holder of this lock in read mode.
    #[inline(always)]
    pub(crate) fn shared<'g, C: Clock>(&self, guard: &'g ReadGuard<'_, C>) -> Shared<'g> {
        debug_assert!(
            std::ptr::eq(guard.owner, self),
            "a guard of another MMU lock"
        );
        Shared { _held: PhantomData }
    }

    /// The exclusive writer of the holder of this lock in write mode.
    #[inline(always)]
    pub(crate) fn exclusive<'g, C: Clock>(&self, guard: &'g WriteGuard<'_, C>) -> Exclusive<'g> {
        debug_assert!(
            std::ptr::eq(guard.owner, self),
            "a guard of another MMU lock"
        );
        Exclusive {
            lockless_wrprot: self.lockless_wrprot,
            exchange_writable: self.exchange_writable,
            _held: PhantomData,
        }
    }
}

/// Proof that the caller may change entries by compare-and-swap (invariant 1): it holds the
/// MMU lock in some mode, or writes lock-free under a reclamation guard.
#[derive(Clone, Copy)]
pub(crate) struct Shared<'g> {
    _held: PhantomData<&'g ()>,
}

impl<'g> Shared<'g> {
    /// A lock-free writer: the fast path in guest mode (its guard from `guest_mode_guard`),
    /// the `rmap-lockless` write-protect pinned in the epoch, or the direct map, whose
    /// writers serialise on their own lock. The guard keeps the tables it walks alive; the
    /// writer changes nothing but by compare-and-swap.
    #[inline(always)]
    pub(crate) fn lockless(_guard: &'g Guard) -> Self {
        Shared { _held: PhantomData }
    }
}

/// Proof that the caller holds the MMU lock exclusively: no other lock holder writes entries,
/// so an entry no lock-free writer may change can be stored plainly.
#[derive(Clone, Copy)]
pub(crate) struct Exclusive<'g> {
    lockless_wrprot: bool,
    exchange_writable: bool,
    _held: PhantomData<&'g ()>,
}

impl<'g> Exclusive<'g> {
    /// The exclusive holder writing by compare-and-swap (splits, whose break-before-make and
    /// prefilled tables are written for racing writers).
    #[inline(always)]
    pub(crate) fn cas(self) -> Shared<'g> {
        Shared { _held: PhantomData }
    }
}

/// How an entry update is written, by the witness of how the MMU lock is held. Only
/// `Mmu::update_spte` calls [`SpteWriter::write`]; everything is inlined into it, so the
/// choice costs nothing at run time.
pub(crate) trait SpteWriter: Copy {
    /// The MMU lock is held exclusively (no other lock holder writes entries).
    const EXCLUSIVE: bool;

    /// Writes `new` over the entry the caller read as `old` (at `level`). `Ok` with the value
    /// replaced, or `Err` with the value that won a race (compare-and-swap writers only).
    fn write<F: PteFormat>(
        self,
        sptep: &AtomicU64,
        old: u64,
        new: u64,
        level: Level,
    ) -> Result<u64, u64>;
}

impl SpteWriter for Shared<'_> {
    const EXCLUSIVE: bool = false;

    #[inline(always)]
    fn write<F: PteFormat>(
        self,
        sptep: &AtomicU64,
        old: u64,
        new: u64,
        _level: Level,
    ) -> Result<u64, u64> {
        sync::cas_entry::<F::Clock>(sptep, old, new, Ordering::AcqRel, Ordering::Acquire)
    }
}

impl SpteWriter for Exclusive<'_> {
    const EXCLUSIVE: bool = true;

    #[inline(always)]
    fn write<F: PteFormat>(
        self,
        sptep: &AtomicU64,
        old: u64,
        new: u64,
        level: Level,
    ) -> Result<u64, u64> {
        // Lock-free writers (hardware A/D, the fast path, and with `rmap-lockless` a harvest
        // clearing W) may change some entries under us: exchange those, never lost, never
        // retried, and account for the value that was really there.
        let legacy = self.exchange_writable && F::is_leaf(old, level) && F::is_writable(old);
        if F::needs_atomic_update(old, level) || self.lockless_wrprot || legacy {
            return Ok(sync::swap_entry::<F::Clock>(sptep, new, Ordering::AcqRel));
        }
        // Nobody else may write this entry while we hold the lock exclusively, so `old` is
        // still its value and a plain store suffices (no locked read-modify-write).
        debug_assert_eq!(sptep.load(Ordering::Relaxed), old);
        sync::store_entry::<F::Clock>(sptep, old, new, Ordering::Release);
        Ok(old)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::clock::RealTime;
    use crate::format::{Ept, LeafPerms};
    use slat_addr::Hva;

    /// A writable 4 KiB leaf with hardware A/D bits, accessed and dirty: nothing a lock-free
    /// writer sets is missing, so today's rule stores it plainly.
    fn writable_leaf() -> u64 {
        let perms = LeafPerms {
            host_writable: true,
            writable: true,
            exec: false,
            ad_bits: true,
        };
        let leaf = Ept::make_leaf(Hva::new(0x4000), 1, perms);
        Ept::set_accessed_dirty(leaf, crate::format::Access::Write)
    }

    /// What an exclusive write of a writable leaf reports as replaced when the entry holds
    /// `actual` but the writer read `old`: an exchange reports `actual`, a plain store `old`.
    fn replaced(exchange_writable: bool, old: u64, actual: u64) -> u64 {
        let lock = MmuLock::new(MmuLockKind::Mutex, false, exchange_writable);
        let guard = lock.write::<RealTime>();
        let w = lock.exclusive(&guard);
        let sptep = AtomicU64::new(actual);
        let new = Ept::write_protect(old);
        let got = w
            .write::<Ept>(&sptep, old, new, 1)
            .expect("exclusive writes succeed");
        assert_eq!(sptep.load(Ordering::Relaxed), new);
        got
    }

    #[test]
    fn the_legacy_rule_exchanges_writable_leaves() {
        let leaf = writable_leaf();
        assert!(
            !Ept::needs_atomic_update(leaf, 1),
            "today's rule: a plain store"
        );
        assert_eq!(replaced(false, leaf, leaf), leaf);
        // An exchange returns what was really there (a bit another writer set is seen).
        let actual = leaf | (1 << 62);
        assert_eq!(replaced(true, leaf, actual), actual);
    }
}
