//! The host kernel's direct map over a pool of private memory, and lazy acceptance.
//!
//! A confidential guest's private pages must not stay in the host kernel's *direct map* (the
//! kernel's own linear mapping of all RAM): on SNP each page the guest accepts is removed from it,
//! and where a 1 GiB or 2 MiB leaf covers the page that leaf is first split, under the one global
//! `cpa_lock`, with a kernel TLB flush to every CPU in question. What that costs, and pre-splitting
//! the direct map instead, is the upstream SNP discussion "x86/sev: Invalidate pages from the
//! direct map when adding them to the RMP table".
//!
//! [`DirectMap`] is that kernel page table, over one pool of host memory (a guest_memfd-like
//! [`HostRange`]), built from the engine's own parts: an `Mmu` of the x86 format, the one
//! walker, the one SPTE-update path, `split_huge_pages`' atomic split, and the remote flush
//! protocol, which every [`HostCpu`] acknowledges. It maps each pool page at its own host
//! address (virtual = physical, as if `PAGE_OFFSET` were 0), with the largest leaf the
//! alignment allows (x86 only: the kernel's direct map is an x86 structure in that discussion).
//!
//! **Acceptance** ([`DirectMap::accept`]): the first private fault on a page claims its frame
//! (`frames.rs`), clears it through the direct map (the page allocator zeroing a new page),
//! removes it from the direct map according to the [`DirectMapPolicy`], optionally flushes
//! every host CPU's kernel TLB, and marks it assigned; only then does the fault map it into
//! the guest. **Release** ([`DirectMap::release`], a conversion back to shared or the end of
//! the binding) scrubs the page, so no guest secret is ever readable through the direct map,
//! maps it again and, with `collapse`, puts a 2 MiB leaf back once no page of its block is
//! claimed. Invariant, whenever no acceptance or release is in flight: the direct map maps
//! exactly the pool frames that are not assigned (`tests/engine/direct_map.rs` checks it after
//! random sequences, with leak accounting of the table pages).
//!
//! **Concurrency.** Writers of the table (acceptance, release, collapse) hold the global
//! `cpa_lock` (as Linux's `__change_page_attr_set_clr`), so their compare-and-swaps never
//! lose to each other; readers ([`DirectMap::translate`]) walk lock-free under an epoch pin.
//! A split replaces a huge leaf with a table already filled with the equivalent small leaves,
//! in one compare-and-swap, so a reader sees either the huge leaf or the full table, never a
//! hole. The `none` policy (TDX-style: the direct map is left alone) takes no lock at all.

mod frames;
mod host_cpu;
mod private;

use crate::clock::{addr_of, Clock, Cost, RealTime};
use crate::config::DirectMapPolicy;
pub use host_cpu::{HostCpu, Online};
pub use private::{PoolLease, PrivateMemory};

use crate::config::VmConfig;
use crate::format::{pages_per_entry, Ept, LeafPerms, Level, PteFormat};
use crate::host_memory::HostRange;
use crate::mmu::flush::PendingFlush;
use crate::mmu::lock::Shared;
use crate::mmu::split::split_huge_pages;
use crate::mmu::table::TablePage;
use crate::mmu::walk::Walk;
use crate::mmu::Mmu;
use crate::stats::{Stat, Stats};
use crate::sync::{self, pin, AtomicBool, AtomicU64, Mutex, Ordering};
use frames::FrameStates;
use slat_addr::Hva;
use slat_addr::{Gfn, PAGE_SHIFT, PAGE_SIZE};
use std::fmt;
use std::sync::Arc;

/// The kernel's direct map is an x86 page table.
type Kf = Ept;

const BLOCK_PAGES: u64 = pages_per_entry(2);

/// How a [`DirectMap`] behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DirectMapConfig {
    /// What acceptance does to the direct map.
    pub policy: DirectMapPolicy,
    /// After removing a page, flush every host CPU's kernel TLB and wait for each to
    /// acknowledge (what "completely cratered performance" when SNP tried it).
    pub kernel_flush: bool,
    /// On release, put a 2 MiB leaf back once no page of its block is claimed (only with
    /// [`DirectMapPolicy::Split2M`]; always flushed, since it frees a table page).
    pub collapse: bool,
}

/// Why a direct map could not be built or an address was refused. Nothing changes on error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirectMapError {
    /// The call may flush the host CPUs' kernel TLBs, and the calling thread is one of them,
    /// online: it would wait for itself. Nothing changed.
    #[error(transparent)]
    Flush(#[from] crate::mmu::flush::FlushError),
    /// The pool is empty.
    #[error("the private pool is empty")]
    EmptyPool,
    /// The pool does not fit the x86 direct map's 48-bit address space.
    #[error("the private pool at {addr:#x} (+{len:#x}) is beyond the direct map's 48-bit range")]
    PoolOutOfRange {
        /// Pool start.
        addr: Hva,
        /// Pool length.
        len: u64,
    },
    /// An address outside the pool.
    #[error("host address {hva:#x} is not in the private pool [{start:#x}, {end:#x})")]
    NotInPool {
        /// The address.
        hva: Hva,
        /// Pool start.
        start: Hva,
        /// Pool end.
        end: Hva,
    },
    /// A range of the pool that is not 4 KiB aligned, empty, or does not fit.
    #[error("pool range at offset {offset:#x} (+{len:#x}) is empty, unaligned or outside the {size:#x}-byte pool")]
    BadRange {
        /// Offset into the pool.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Pool size.
        size: u64,
    },
    /// The page belongs to a range bound to a memslot: the engine accepts and releases it (on
    /// private faults and conversions), so a caller cannot pull it from under a guest.
    #[error("host address {hva:#x} is in a pool range bound to a memslot: the engine accepts and releases its pages")]
    Bound {
        /// The address.
        hva: Hva,
    },
    /// The range overlaps one already bound to a memslot (a guest_memfd range binds once).
    #[error("pool range at offset {offset:#x} (+{len:#x}) overlaps a range already bound")]
    AlreadyBound {
        /// Offset into the pool.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

/// What [`DirectMap::accept`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acceptance {
    /// The frame was assigned already.
    Already,
    /// Another CPU is accepting it right now: retry.
    InProgress,
    /// This call accepted it; `split` says whether a huge leaf had to be split first.
    Accepted {
        /// A 1 GiB or 2 MiB leaf was split.
        split: bool,
    },
}

/// Counters of a [`DirectMap`] (monotonic, except the gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectMapStats {
    /// Frames accepted (removed from the direct map for a guest).
    pub accepted: u64,
    /// Frames released (mapped again).
    pub released: u64,
    /// Frames assigned now.
    pub assigned: u64,
    /// Huge leaves split (a 1 GiB leaf counts once, and each 2 MiB leaf split from it again).
    pub splits: u64,
    /// Tables collapsed back into 2 MiB leaves.
    pub collapses: u64,
    /// Kernel TLB flushes that had host CPUs to wait for.
    pub flushes: u64,
    /// Kernel TLB flushes requested (with or without a CPU online).
    pub flush_requests: u64,
    /// Acquisitions of the global lock.
    pub lock_acquisitions: u64,
    /// Nanoseconds spent waiting for the global lock, summed over CPUs.
    pub lock_wait_ns: u64,
    /// Leaves by size now: 4 KiB, 2 MiB, 1 GiB.
    pub leaves: [u64; 3],
    /// Table pages now (root included).
    pub tables: u64,
}

/// The host kernel's direct map over one private pool.
pub struct DirectMap {
    mmu: Mmu<Kf>,
    pool: HostRange,
    first_frame: u64,
    frames: u64,
    config: DirectMapConfig,
    /// Linux's `cpa_lock`: one lock for every change of the direct map.
    cpa_lock: Mutex<()>,
    states: FrameStates,
    /// Pool ranges bound to memslots, as (first frame, frames).
    bound: Mutex<Vec<(u64, u64)>>,
    /// Ranges whose lease was dropped with pages still assigned, as (first frame, frames):
    /// released by the next operation that may wait for the lock and a flush (a lease may be
    /// dropped on an online CPU, which must not block on the lock: a holder may be flushing).
    orphans: Mutex<Vec<(u64, u64)>>,
    /// `orphans` may be non-empty: acceptance checks this flag, not the mutex, so the `none`
    /// policy takes no lock and no policy adds one to the fault path.
    has_orphans: AtomicBool,
    accepted: AtomicU64,
    released: AtomicU64,
    collapses: AtomicU64,
    lock_acquisitions: AtomicU64,
    lock_wait_ns: AtomicU64,
}

impl fmt::Debug for DirectMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirectMap")
            .field("pool", &self.pool)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl DirectMap {
    /// Builds the direct map over all of `pool`, every page mapped: with 4 KiB leaves under
    /// [`DirectMapPolicy::Pre4K`], else with the largest leaf each part's alignment allows.
    pub fn new(pool: HostRange, config: DirectMapConfig) -> Result<Arc<Self>, DirectMapError> {
        if pool.is_empty() {
            return Err(DirectMapError::EmptyPool);
        }
        let limit = 1u64 << Kf::MAX_PHYS_BITS;
        if pool
            .addr()
            .checked_add(pool.len())
            .is_none_or(|e| e.raw() > limit)
        {
            return Err(DirectMapError::PoolOutOfRange {
                addr: pool.addr(),
                len: pool.len(),
            });
        }
        let frames = pool.len() >> PAGE_SHIFT;
        let map = DirectMap {
            mmu: Mmu::new(VmConfig::default()),
            first_frame: pool.addr().raw() >> PAGE_SHIFT,
            frames,
            pool,
            config,
            cpa_lock: Mutex::new(()),
            states: FrameStates::new(frames),
            bound: Mutex::new(Vec::new()),
            orphans: Mutex::new(Vec::new()),
            has_orphans: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            released: AtomicU64::new(0),
            collapses: AtomicU64::new(0),
            lock_acquisitions: AtomicU64::new(0),
            lock_wait_ns: AtomicU64::new(0),
        };
        map.populate();
        Ok(Arc::new(map))
    }

    /// The pool.
    pub fn pool(&self) -> &HostRange {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> DirectMapConfig {
        self.config
    }

    /// Maps every frame with the largest leaf allowed.
    fn populate(&self) {
        let max = match self.config.policy {
            DirectMapPolicy::Pre4K => 1,
            _ => Kf::MAX_LEAF_LEVEL,
        };
        let (mut gfn, end) = (self.first_frame, self.first_frame + self.frames);
        let mut pending = PendingFlush::none();
        while gfn < end {
            let level = (1..=max)
                .rev()
                .find(|&l| gfn % pages_per_entry(l) == 0 && gfn + pages_per_entry(l) <= end)
                .unwrap_or(1);
            self.map_leaf::<RealTime>(gfn, level, &mut pending);
            gfn += pages_per_entry(level);
        }
        // Nothing was mapped before, so nothing is cached and nothing was unlinked.
        debug_assert!(pending.graveyard.is_empty());
    }

    /// The frame number of `hva` if it is a pool address.
    fn frame_of(&self, hva: Hva) -> Result<u64, DirectMapError> {
        let start = self.pool.addr();
        // Checked in `new`: the pool ends below the direct map's address limit.
        let end = Hva::new(start.raw() + self.pool.len());
        if hva < start || hva >= end {
            return Err(DirectMapError::NotInPool { hva, start, end });
        }
        Ok((hva.raw() - start.raw()) >> PAGE_SHIFT)
    }

    /// What a kernel access to `hva` translates to now: the host page address and the leaf
    /// level, or `None` where the direct map has no leaf (an access would oops). Lock-free.
    pub fn translate(&self, hva: Hva) -> Result<Option<(Hva, Level)>, DirectMapError> {
        self.frame_of(hva)?;
        let frame = hva.raw() >> PAGE_SHIFT;
        Ok(self.lookup::<RealTime>(frame).map(|(e, level)| {
            let off = (frame & (pages_per_entry(level) - 1)) << PAGE_SHIFT;
            (Hva::new(Kf::output_addr(e).raw() + off), level)
        }))
    }

    /// The leaf mapping `gfn`, lock-free. A walk that reaches a frozen entry went through a
    /// table a collapse just unlinked (its entries are frozen as it leaves the tree): the
    /// mapping is not gone, it moved up a level, so walk again from the root.
    fn lookup<C: Clock>(&self, gfn: u64) -> Option<(u64, Level)> {
        let walk = || {
            let guard = sync::pin_c::<C>();
            let it = Walk::<Kf>::to_leaf(&guard, self.mmu.root(), Gfn::new(gfn));
            (it.old, it.level)
        };
        let (mut old, mut level) = walk();
        if old == Kf::FROZEN {
            // Only the collapse's store to the 2 MiB entry above ends the wait.
            let parent = self.block_entry_addr(gfn);
            sync::spin_until::<C>(&[parent], || {
                (old, level) = walk();
                old != Kf::FROZEN
            });
        }
        (Kf::is_present(old) && Kf::is_leaf(old, level)).then_some((old, level))
    }

    /// Address of the level-2 entry above `gfn` (what a collapse writes), for a clock's wait;
    /// 0 if there is none.
    fn block_entry_addr(&self, gfn: u64) -> usize {
        let guard = pin();
        let mut it = Walk::<Kf>::new(&guard, self.mmu.root(), 2, Gfn::new(gfn), Gfn::new(gfn + 1));
        while it.valid() && it.level > 2 {
            it.next();
        }
        if it.valid() {
            addr_of(it.sptep())
        } else {
            0
        }
    }

    /// A kernel read of the 8 bytes at `hva` (8-byte aligned) through the direct map:
    /// `None` where it has no leaf, which is where the host must not look.
    pub fn read_u64(&self, hva: Hva) -> Result<Option<u64>, DirectMapError> {
        let page = Hva::new(hva.raw() & !(PAGE_SIZE - 1));
        let Some((host, _)) = self.translate(page)? else {
            return Ok(None);
        };
        let addr = host.raw() + ((hva.raw() & (PAGE_SIZE - 1)) & !7);
        // SAFETY: `addr` is inside the pool (the leaf maps pool pages onto themselves and
        // `frame_of` checked `hva`), which `self.pool` keeps mapped read/write; 8-byte aligned
        // and atomic, since guests and other CPUs may write the page concurrently.
        Ok(Some(
            unsafe { std::sync::atomic::AtomicU64::from_ptr(addr as *mut u64) }
                .load(std::sync::atomic::Ordering::Relaxed),
        ))
    }

    /// Whether the frame at `hva` is assigned to a guest.
    pub fn is_assigned(&self, hva: Hva) -> Result<bool, DirectMapError> {
        Ok(self.states.is_assigned::<RealTime>(self.frame_of(hva)?))
    }

    /// Lazy acceptance of the pool page at `hva` (any address in it), for a page no memslot
    /// binds (bound pages are the engine's): see the module comment.
    /// Refused ([`DirectMapError::Flush`]) from an online host CPU of this map: acceptance
    /// may flush, and the flush would wait for the caller.
    pub fn accept(&self, hva: Hva) -> Result<Acceptance, DirectMapError> {
        self.accept_with::<RealTime>(hva)
    }

    /// [`Self::accept`] on the simulated CPU of clock `C`.
    pub fn accept_with<C: Clock>(&self, hva: Hva) -> Result<Acceptance, DirectMapError> {
        self.check_flush()?;
        Ok(self.accept_frame::<C>(self.unbound_frame::<C>(hva)?))
    }

    /// [`crate::mmu::flush::FlushError::OwnGuestMode`] if the calling thread is an online
    /// [`HostCpu`] of this map: a kernel TLB flush would wait for it.
    pub(crate) fn check_flush(&self) -> Result<(), crate::mmu::flush::FlushError> {
        self.mmu.flush.check_own::<crate::clock::RealTime>()
    }

    /// The frame of `hva` if it is a pool page outside every bound range.
    fn unbound_frame<C: Clock>(&self, hva: Hva) -> Result<u64, DirectMapError> {
        let f = self.frame_of(hva)?;
        let bound = sync::lock_c::<C, _>(&self.bound);
        if bound
            .iter()
            .any(|&(first, n)| (first..first + n).contains(&f))
        {
            return Err(DirectMapError::Bound { hva });
        }
        Ok(f)
    }

    pub(crate) fn accept_frame<C: Clock>(&self, f: u64) -> Acceptance {
        self.release_orphans_unchecked::<C>();
        if self.states.is_assigned::<C>(f) {
            return Acceptance::Already;
        }
        if !self.states.claim::<C>(f) {
            return if self.states.is_assigned::<C>(f) {
                Acceptance::Already
            } else {
                Acceptance::InProgress
            };
        }
        let hva = (self.first_frame + f) << PAGE_SHIFT;
        // The page allocator clears a new page through the direct map, before the page leaves
        // it (a claimed frame is still mapped: only its claimer removes it).
        let mapped = self.lookup::<C>(hva >> PAGE_SHIFT).is_some();
        debug_assert!(
            mapped || self.config.policy == DirectMapPolicy::Untouched,
            "claimed frame {f} is not in the direct map"
        );
        self.clear_page::<C>(hva);
        let split = match self.config.policy {
            DirectMapPolicy::Untouched => false,
            _ => self.unmap_frame::<C>(hva >> PAGE_SHIFT),
        };
        self.states.assign::<C>(f);
        sync::fetch_add::<C, _>(&self.accepted, 1, Ordering::Relaxed);
        Acceptance::Accepted { split }
    }

    /// Gives the page at `hva` back to the host: waits for an acceptance in flight, scrubs it,
    /// maps it again. Returns whether it was assigned. Only for pages no memslot binds (the
    /// engine releases bound pages on conversions to shared and slot deletion).
    /// Refused as [`Self::accept`] is.
    pub fn release(&self, hva: Hva) -> Result<bool, DirectMapError> {
        self.release_with::<RealTime>(hva)
    }

    /// [`Self::release`] on the simulated CPU of clock `C`.
    pub fn release_with<C: Clock>(&self, hva: Hva) -> Result<bool, DirectMapError> {
        self.check_flush()?;
        // Orphans first: releasing them may unbind the range `hva` is in.
        self.release_orphans_unchecked::<C>();
        Ok(self.release_frame::<C>(self.unbound_frame::<C>(hva)?, true))
    }

    /// Releases what dropped leases left assigned (acceptance and release do it too).
    /// Refused ([`DirectMapError::Flush`]) from an online [`HostCpu`] of this map.
    pub fn release_orphans(&self) -> Result<(), DirectMapError> {
        self.release_orphans_with::<RealTime>()
    }

    /// [`Self::release_orphans`] on the simulated CPU of clock `C`.
    pub fn release_orphans_with<C: Clock>(&self) -> Result<(), DirectMapError> {
        self.check_flush()?;
        self.release_orphans_unchecked::<C>();
        Ok(())
    }

    /// [`Self::release_orphans`] for callers that checked, or run where no host CPU of this
    /// thread can be online (the engine's slow path and memslot operations).
    fn release_orphans_unchecked<C: Clock>(&self) {
        // Cleared before the list is taken: a lease dropped meanwhile sets it again after
        // pushing, so its range is never left behind unflagged.
        C::rmw(addr_of(&self.has_orphans));
        if !self.has_orphans.swap(false, Ordering::AcqRel) {
            return;
        }
        let ranges = {
            let mut o = sync::lock_c::<C, _>(&self.orphans);
            if o.is_empty() {
                return;
            }
            std::mem::take(&mut *o)
        };
        for (first, frames) in ranges {
            for f in first..first + frames {
                if self.states.is_claimed::<C>(f) {
                    self.release_frame::<C>(f, true);
                }
            }
            // Bindable again only now that nothing of it is assigned.
            sync::lock_c::<C, _>(&self.bound).retain(|&r| r != (first, frames));
        }
    }

    /// Releases frame `f`; `may_collapse` is false where the caller cannot wait for a flush
    /// (a lease dropped on whatever thread held its last copy).
    pub(crate) fn release_frame<C: Clock>(&self, f: u64, may_collapse: bool) -> bool {
        if !self.states.is_assigned::<C>(f) {
            if !self.states.is_claimed::<C>(f) {
                return false;
            }
            // An acceptance is between its claim and its assignment (bounded: a page clear,
            // one locked update and maybe a flush): its assignment, or an unclaim, ends it.
            let mut claimed = true;
            sync::spin_until::<C>(&self.states.watch(f), || {
                claimed = self.states.is_claimed::<RealTime>(f);
                self.states.is_assigned::<RealTime>(f) || !claimed
            });
            if !self.states.is_assigned::<RealTime>(f) && !claimed {
                return false;
            }
        }
        let gfn = self.first_frame + f;
        // No guest maps the page any more (the caller zapped and flushed): nothing races.
        self.clear_page::<C>(gfn << PAGE_SHIFT);
        let mut pending = PendingFlush::none();
        if self.config.policy != DirectMapPolicy::Untouched {
            let _lock = self.lock_cpa::<C>();
            self.map_leaf::<C>(gfn, 1, &mut pending);
            debug_assert!(!pending.is_needed(), "mapping an empty entry owes no flush");
            self.states.unassign::<C>(f);
            let collapse = self.config.collapse && self.config.policy == DirectMapPolicy::Split2M;
            if collapse && may_collapse {
                self.try_collapse::<C>(gfn, &mut pending);
            }
        } else {
            self.states.unassign::<C>(f);
        }
        // After the lock: a flusher never holds it, so CPUs blocked on it cannot stall a flush.
        self.mmu.complete_flush_with::<C>(pending);
        sync::fetch_add::<C, _>(&self.released, 1, Ordering::Relaxed);
        true
    }

    /// Zeroes the page at `hva` (a pool page) with atomic stores: the host, a guest or a
    /// reader of the direct map may look at it concurrently.
    fn clear_page<C: Clock>(&self, hva: u64) {
        C::charge(Cost::ZeroPage, 1);
        for off in (0..PAGE_SIZE).step_by(8) {
            // SAFETY: `hva` is the start of a pool page (callers derive it from a frame
            // number below `frames`), which `self.pool` keeps mapped read/write; aligned.
            unsafe { std::sync::atomic::AtomicU64::from_ptr((hva + off) as *mut u64) }
                .store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Takes the global lock, timing the wait.
    fn lock_cpa<C: Clock>(&self) -> sync::MutexHeld<'_, (), C> {
        let t0 = C::now_ns();
        let g = sync::lock_c::<C, _>(&self.cpa_lock);
        let waited = C::now_ns().saturating_sub(t0);
        sync::fetch_add::<C, _>(&self.lock_wait_ns, waited, Ordering::Relaxed);
        sync::fetch_add::<C, _>(&self.lock_acquisitions, 1, Ordering::Relaxed);
        g
    }

    /// Removes the 4 KiB leaf of `gfn`, splitting a huge leaf over it first; flushes after
    /// the lock is dropped when configured. Returns whether it split.
    ///
    /// A split flushes every host CPU *under the lock*, as Linux's `__split_large_page` does
    /// (`flush_tlb_all`): the leaf changed size, and x86 must not keep a 2 MiB and a 4 KiB
    /// translation of one address. That flush is the cost a pre-split direct map avoids.
    fn unmap_frame<C: Clock>(&self, gfn: u64) -> bool {
        let mut pending = PendingFlush::none();
        let split = {
            let _lock = self.lock_cpa::<C>();
            let block = gfn & !(BLOCK_PAGES - 1);
            let mut split = PendingFlush::none();
            // Under `cpa_lock`, not the MMU lock: every writer serialises on it and writes by
            // compare-and-swap, so the split is a lock-free writer as far as the MMU knows.
            let guard = sync::pin_c::<C>();
            let w = Shared::lockless(&guard);
            let splits = split_huge_pages(
                &self.mmu,
                w,
                Gfn::new(block),
                Gfn::new(block + BLOCK_PAGES),
                &mut split,
            );
            if splits != 0 {
                split.require();
                self.mmu.complete_flush_with::<C>(split);
            }
            self.clear_leaf::<C>(gfn, &mut pending);
            splits != 0
        };
        if self.config.kernel_flush {
            self.mmu.complete_flush_with::<C>(pending);
        } else {
            // Without the flush other CPUs may keep a stale translation of the page (the
            // risk SNP upstream accepts by not flushing). A removal frees no table page.
            debug_assert!(pending.graveyard.is_empty());
        }
        split
    }

    /// Sets the 4 KiB leaf of `gfn` non-present (under the lock: no other writer).
    fn clear_leaf<C: Clock>(&self, gfn: u64, pending: &mut PendingFlush) {
        let guard = sync::pin_c::<C>();
        let mut it = Walk::<Kf>::to_leaf(&guard, self.mmu.root(), Gfn::new(gfn));
        debug_assert!(it.level == 1 && Kf::is_present(it.old), "no 4 KiB leaf");
        while it.level == 1 && Kf::is_present(it.old) {
            let sink = self.mmu.sink();
            if self
                .mmu
                .set_spte(
                    &mut it,
                    Kf::NON_PRESENT,
                    Shared::lockless(&guard),
                    sink,
                    pending,
                )
                .is_ok()
            {
                return;
            }
        }
    }

    /// Maps `gfn` with a leaf of `level` (aligned), linking tables on the way; the entry
    /// there must be empty. Callers hold the lock or own the map exclusively.
    fn map_leaf<C: Clock>(&self, gfn: u64, level: Level, pending: &mut PendingFlush) {
        let guard = sync::pin_c::<C>();
        let sink = self.mmu.sink();
        let mut it = Walk::<Kf>::new(
            &guard,
            self.mmu.root(),
            level,
            Gfn::new(gfn),
            Gfn::new(gfn + 1),
        );
        while it.valid() {
            if it.level == level {
                let leaf = Kf::make_leaf(Hva::new(gfn << PAGE_SHIFT), level, KERNEL_PERMS);
                debug_assert!(!Kf::is_present(it.old), "mapping over a present entry");
                while self
                    .mmu
                    .set_spte(&mut it, leaf, Shared::lockless(&guard), sink, pending)
                    .is_err()
                {}
                return;
            }
            if !Kf::is_present(it.old) {
                let child = self.mmu.alloc.alloc_with::<C>();
                let table = Kf::make_table(child.addr());
                if self
                    .mmu
                    .set_spte(&mut it, table, Shared::lockless(&guard), sink, pending)
                    .is_ok()
                {
                    child.into_linked();
                } else {
                    self.mmu.alloc.free_now(child);
                    continue;
                }
            }
            it.next();
        }
    }

    /// Replaces the table mapping `gfn`'s 2 MiB block with one 2 MiB leaf if every page of the
    /// block is mapped and none is claimed (under the lock). The table goes to `pending`.
    fn try_collapse<C: Clock>(&self, gfn: u64, pending: &mut PendingFlush) {
        let block = gfn & !(BLOCK_PAGES - 1);
        let first = self.first_frame;
        if block < first || block + BLOCK_PAGES > first + self.frames {
            return; // the block is not wholly in the pool: it never had a 2 MiB leaf
        }
        if !self.states.none_claimed(block - first, BLOCK_PAGES) {
            return;
        }
        let guard = sync::pin_c::<C>();
        let mut it = Walk::<Kf>::new(
            &guard,
            self.mmu.root(),
            2,
            Gfn::new(block),
            Gfn::new(block + 1),
        );
        while it.valid() && it.level > 2 {
            it.next();
        }
        let old = it.old;
        if !it.valid() || !Kf::is_present(old) || Kf::is_leaf(old, 2) {
            return;
        }
        // SAFETY: a present table entry read under the epoch pin; writers hold the lock.
        let t = unsafe { TablePage::at(Kf::output_addr(old)) };
        let full = t.entries.iter().all(|e| {
            let v = e.load(Ordering::Acquire);
            Kf::is_present(v) && Kf::is_leaf(v, 1)
        });
        if !full {
            return;
        }
        let huge = Kf::make_leaf(Hva::new(block << PAGE_SHIFT), 2, KERNEL_PERMS);
        let sink = self.mmu.sink();
        if self
            .mmu
            .set_spte(&mut it, huge, Shared::lockless(&guard), sink, pending)
            .is_ok()
        {
            sink.inc::<C>(Stat::Recoveries);
            sync::fetch_add::<C, _>(&self.collapses, 1, Ordering::Relaxed);
        }
    }

    /// A CPU of the host that may cache direct-map translations: a kernel TLB flush waits for
    /// it while it is [`HostCpu::online`].
    pub fn host_cpu(self: &Arc<Self>) -> HostCpu {
        HostCpu::join(self.clone())
    }

    /// Binds `[offset, offset + len)` of the pool as a memslot's private memory (a
    /// guest_memfd range bound to one slot). Refused if it overlaps a bound range.
    pub fn bind(self: &Arc<Self>, offset: u64, len: u64) -> Result<PrivateMemory, DirectMapError> {
        PrivateMemory::bind(self, offset, len)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DirectMapStats {
        let s: Stats = Stats::sum(
            std::iter::once(&self.mmu.counters),
            self.mmu.alloc.live_pages(),
        );
        DirectMapStats {
            accepted: self.accepted.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            assigned: self.states.count_assigned(),
            splits: s.splits,
            collapses: self.collapses.load(Ordering::Relaxed),
            flushes: s.remote_tlb_flush,
            flush_requests: s.remote_tlb_flush_requests,
            lock_acquisitions: self.lock_acquisitions.load(Ordering::Relaxed),
            lock_wait_ns: self.lock_wait_ns.load(Ordering::Relaxed),
            leaves: [s.leaves_4k, s.leaves_2m, s.leaves_1g],
            tables: s.table_pages,
        }
    }

    /// Walks the whole table (taking the lock, so no change is in flight): leaves per level,
    /// linked tables, and whether the live table pages are exactly the linked ones. Refused
    /// as [`Self::accept`] is: it releases orphans (which may flush) and waits for the lock,
    /// whose holder may be waiting for the caller's acknowledgement.
    pub fn audit(&self) -> Result<DirectMapAudit, DirectMapError> {
        self.release_orphans()?;
        let _lock = sync::lock_c::<RealTime, _>(&self.cpa_lock);
        let a = self.mmu.audit();
        Ok(DirectMapAudit {
            leaves: a.leaves,
            tables: a.tables,
            live_table_pages: self.mmu.alloc.live_pages(),
        })
    }

    /// The table-page allocator, to check for leaks (live pages settle to the linked ones
    /// once epoch reclamation has run).
    pub fn table_alloc(&self) -> &crate::sync::Arc<crate::mmu::table::TableAlloc> {
        &self.mmu.alloc
    }
}

/// What [`DirectMap::audit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectMapAudit {
    /// Leaves per level (index 0 = 4 KiB).
    pub leaves: [u64; 3],
    /// Linked table pages, root included.
    pub tables: u64,
    /// Table pages allocated and not yet freed (settles to `tables` once epoch reclamation
    /// has run; more means a leak).
    pub live_table_pages: u64,
}

/// Kernel mappings are read/write, no execute (the direct map is NX), A/D in use.
const KERNEL_PERMS: LeafPerms = LeafPerms {
    host_writable: true,
    writable: true,
    exec: false,
    ad_bits: true,
};
