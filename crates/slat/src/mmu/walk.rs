//! The one software walker: a pre-order iterator over the entries covering a GFN range, down to
//! a minimum level, with a position that survives dropping the MMU lock.
//!
//! Every table operation (fault install, zap, write-protect, split, recover, age) is a loop over
//! this iterator. The iterator only ever steps *down* into an entry it has just re-read, so an
//! operation that links a new table at the current position walks into it on the next step, and
//! one that unlinks a table steps over it. After [`Walk::mark_yielded`] the next step restarts
//! from the root at the first GFN not yet visited, because the tables on the saved path may have
//! been freed while the lock was dropped.

use crate::clock::{Clock, Cost};
use crate::format::{pages_per_entry, table_index, Level, PteFormat, MAX_LEVELS};
use crate::mmu::table::TablePage;
use crate::sync::{self, AtomicU64, Guard, Ordering};
use slat_addr::{Gfn, Hva};
use std::marker::PhantomData;

/// A position in a walk of `[start, end)` (GFNs).
pub struct Walk<'g, F: PteFormat> {
    path: [Hva; MAX_LEVELS + 1],
    root: Hva,
    min_level: Level,
    end: Gfn,
    /// The lowest GFN not yet fully visited; where a restart resumes.
    next_gfn: Gfn,
    yielded_gfn: Gfn,
    /// First GFN covered by the current entry.
    pub gfn: Gfn,
    /// Level of the current entry.
    pub level: Level,
    /// The value of the current entry when it was last read (refreshed by failed updates).
    pub old: u64,
    valid: bool,
    yielded: bool,
    _guard: PhantomData<(&'g Guard, F)>,
}

impl<'g, F: PteFormat> Walk<'g, F> {
    /// Starts a walk over `[start, end)` of the table rooted at `root`, visiting entries at
    /// levels `>= min_level`. The guard keeps every page the walk reaches allocated.
    pub fn new(
        _guard: &'g Guard,
        root: &TablePage,
        min_level: Level,
        start: Gfn,
        end: Gfn,
    ) -> Self {
        debug_assert!(min_level >= 1 && min_level <= F::ROOT_LEVEL);
        // Table indices wrap above the format's width: never walk beyond it.
        let end = end.min(max_gfn::<F>());
        let mut w = Walk {
            path: [Hva::ZERO; MAX_LEVELS + 1],
            root: root.addr(),
            min_level,
            end,
            next_gfn: start,
            yielded_gfn: start,
            gfn: Gfn::ZERO,
            level: F::ROOT_LEVEL,
            old: 0,
            valid: start < end,
            yielded: false,
            _guard: PhantomData,
        };
        w.restart();
        w
    }

    /// A walk of the single GFN `gfn`, already positioned at the deepest entry on its path:
    /// the leaf, or the first entry that is not present (the lock-free fast path's descent,
    /// without the general iterator's side steps).
    #[inline]
    pub fn to_leaf(guard: &'g Guard, root: &TablePage, gfn: Gfn) -> Self {
        let valid = gfn < max_gfn::<F>();
        let mut w = Walk {
            path: [Hva::ZERO; MAX_LEVELS + 1],
            root: root.addr(),
            min_level: 1,
            // Below the format's width when valid, so `+ 1` cannot overflow.
            end: if valid { Gfn::new(gfn.raw() + 1) } else { gfn },
            next_gfn: gfn,
            yielded_gfn: gfn,
            gfn: round_down(gfn, pages_per_entry(F::ROOT_LEVEL)),
            level: F::ROOT_LEVEL,
            old: 0,
            valid,
            yielded: false,
            _guard: PhantomData,
        };
        let _ = guard;
        if !w.valid {
            return w;
        }
        w.path[w.level as usize] = w.root;
        loop {
            let e = w.refresh();
            if w.level == 1 || !F::is_present(e) || F::is_leaf(e, w.level) {
                return w;
            }
            w.level -= 1;
            w.path[w.level as usize] = F::output_addr(e);
            w.gfn = round_down(gfn, pages_per_entry(w.level));
        }
    }

    /// Address of the table holding the current entry.
    #[inline]
    pub fn table(&self) -> Hva {
        self.path[self.level as usize]
    }

    /// The walk still has a current entry.
    #[inline]
    pub fn valid(&self) -> bool {
        self.valid
    }

    /// The current entry.
    #[inline]
    pub fn sptep(&self) -> &'g AtomicU64 {
        // SAFETY: path[level] is a table reached from the root during this walk (or since the
        // last restart) while the guard `'g` is held, so it has not been freed.
        let t = unsafe { TablePage::at(self.path[self.level as usize]) };
        &t.entries[table_index(self.gfn, self.level)]
    }

    /// In a fault handler, after reading the current entry: [`Self::old`] becomes the value
    /// the calling CPU sees at its clock ([`Clock::entry_as_seen`]), unless that is a table
    /// pointer (a table unlinked since may be freed: the walk never steps into an older
    /// one). Only the handlers call it, and they change an entry only by compare-and-swap
    /// against `old`: an older value makes that fail as it would have against the write the
    /// CPU did not see yet, and the handler retries (the fast path re-reads; the slow path
    /// returns `Retry`). A no-op in real time. Code that acts on an entry's value without a
    /// compare-and-swap (a harvest reading W under the lock) must not call it.
    #[inline(always)]
    pub fn as_seen_by_handler(&mut self) {
        // Compiled out of real time: the entry's address alone cost real-time faults 0.7%
        // more instructions (callgrind, demand-paging -b 64M -v 1).
        if !F::Clock::VIRTUAL || !self.valid {
            return;
        }
        let addr = crate::clock::addr_of(self.sptep());
        let seen = F::Clock::entry_as_seen(addr, self.old);
        let table = F::is_present(seen) && !F::is_leaf(seen, self.level);
        if seen != self.old && !table {
            self.old = seen;
        }
    }

    /// Re-reads the current entry into [`Self::old`].
    #[inline]
    pub fn refresh(&mut self) -> u64 {
        // Every step of the walk reads its entry here: one walk step for the clock (a step to
        // the next entry of the same table is charged by `try_step_side`).
        F::Clock::charge(Cost::WalkStep, 1);
        self.read()
    }

    /// Reads the current entry into [`Self::old`], charging nothing.
    #[inline]
    fn read(&mut self) -> u64 {
        self.old = sync::load::<F::Clock, _>(self.sptep(), Ordering::Acquire);
        self.old
    }

    /// One past the last GFN the current entry covers.
    #[inline]
    pub fn entry_end(&self) -> Gfn {
        // The current entry lies below the format's width (`max_gfn`).
        Gfn::new(self.gfn.raw() + pages_per_entry(self.level))
    }

    /// The caller dropped (or is about to drop) the lock or guard protecting the path; the next
    /// step restarts from the root.
    pub fn mark_yielded(&mut self) {
        self.yielded = true;
        self.yielded_gfn = self.next_gfn;
    }

    /// True if yielding now would make progress (something was visited since the last yield).
    pub fn can_yield(&self) -> bool {
        self.next_gfn != self.yielded_gfn
    }

    /// Moves to the next entry in pre-order.
    pub fn next(&mut self) {
        if !self.valid {
            return;
        }
        if self.yielded {
            self.restart();
            return;
        }
        if self.try_step_down() {
            return;
        }
        loop {
            if self.try_step_side() {
                return;
            }
            if !self.try_step_up() {
                self.valid = false;
                return;
            }
        }
    }

    fn restart(&mut self) {
        self.yielded = false;
        self.level = F::ROOT_LEVEL;
        self.path[self.level as usize] = self.root;
        self.gfn = round_down(self.next_gfn, pages_per_entry(self.level));
        self.valid = self.next_gfn < self.end;
        if self.valid {
            self.refresh();
        }
    }

    fn try_step_down(&mut self) -> bool {
        if self.level == self.min_level {
            return false;
        }
        // Re-read: the visitor may have just linked a table here (walk into it) or removed one.
        let e = sync::load::<F::Clock, _>(self.sptep(), Ordering::Acquire);
        if !F::is_present(e) || F::is_leaf(e, self.level) {
            return false;
        }
        self.level -= 1;
        self.path[self.level as usize] = F::output_addr(e);
        self.gfn = round_down(self.next_gfn, pages_per_entry(self.level));
        self.refresh();
        true
    }

    fn try_step_side(&mut self) -> bool {
        if table_index(self.gfn, self.level) == crate::format::ENTRIES_PER_TABLE - 1 {
            return false;
        }
        self.gfn = self.entry_end();
        self.next_gfn = self.gfn;
        if self.gfn >= self.end {
            self.valid = false;
            return true;
        }
        F::Clock::charge(Cost::WalkSide, 1);
        self.read();
        true
    }

    fn try_step_up(&mut self) -> bool {
        if self.level == F::ROOT_LEVEL {
            return false;
        }
        self.level += 1;
        self.gfn = round_down(self.gfn, pages_per_entry(self.level));
        true
    }
}

#[inline]
pub(crate) const fn round_down(v: Gfn, align: u64) -> Gfn {
    Gfn::new(v.raw() & !(align - 1))
}

/// One past the last frame the format translates: walks never go beyond it.
#[inline]
const fn max_gfn<F: PteFormat>() -> Gfn {
    Gfn::new(1u64 << (F::MAX_PHYS_BITS - slat_addr::PAGE_SHIFT))
}
