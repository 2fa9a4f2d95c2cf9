//! The page table and what changes it: the tree of table pages ([`table`]), the one walker
//! ([`walk`]), the MMU lock ([`lock`]), the one SPTE-update path ([`spte`]), zaps ([`zap`]),
//! inspection ([`inspect`]) and the remote TLB flush protocol ([`flush`]).
//!
//! [`Mmu`] owns the root, the lock, the table allocator, the shared counters, the vCPUs' flush
//! links and the configuration; everything above it (memslots, dirty logging, aging, huge
//! pages, faults) works through it and never reaches into a table page by other means.

pub mod flush;
pub(crate) mod inspect;
pub(crate) mod lock;
pub(crate) mod rmap;
pub(crate) mod split;
pub(crate) mod spte;
pub mod table;
pub(crate) mod walk;
pub(crate) mod zap;

use crate::clock::Clock;
use crate::config::VmConfig;
use crate::format::{Level, PteFormat};
use crate::stats::{Counters, Sink, Stat};
use crate::sync::{Arc, Ordering};
use crate::test_hooks::Hooks;
use flush::{FlushDomain, FlushError, PendingFlush};
use lock::MmuLock;
use rmap::Rmap;
use slat_addr::Gfn;
use slat_addr::Hva;
use std::marker::PhantomData;
use table::{OwnedTable, TableAlloc, TablePage};

/// A second-stage page table and its lock, allocator and flush protocol.
pub(crate) struct Mmu<F: PteFormat> {
    pub(crate) config: VmConfig,
    /// Host address of the root table page (owned here, freed on drop).
    root: Hva,
    pub(crate) lock: MmuLock,
    pub(crate) alloc: Arc<TableAlloc>,
    /// Counters of operations without a vCPU (vCPUs count in blocks of their own).
    pub(crate) counters: Counters,
    /// Every vCPU's flush link: a remote flush waits for each one in guest mode.
    pub(crate) flush: FlushDomain,
    /// Deliberate protocol bugs (feature `test-hooks`), for tests of the oracles.
    pub(crate) hooks: Hooks,
    /// The reverse map (kept only with `VmConfig::wrprot` `rmap` / `rmap-each` / `rmap-lockless`).
    pub(crate) rmap: Arc<Rmap>,
    /// Flushes refused because the calling thread held a vCPU in guest mode
    /// ([`FlushError::OwnGuestMode`]): owed still, their pages kept until a flush completes.
    /// `std` types even under loom: the models never flush from a thread in guest mode, so
    /// nothing is ever deferred there, and the common path only loads the flag.
    deferred: std::sync::Mutex<PendingFlush>,
    /// `deferred` may hold pages (set under its lock).
    has_deferred: std::sync::atomic::AtomicBool,
    _format: PhantomData<F>,
}

impl<F: PteFormat> Mmu<F> {
    pub(crate) fn new(config: VmConfig) -> Self {
        let alloc = Arc::new(TableAlloc::new());
        let root_page = alloc.alloc_with::<F::Clock>();
        root_page.page().meta().set(Gfn::new(0), F::ROOT_LEVEL);
        let root = root_page.into_linked();
        let counters = Counters::default();
        counters.add_shared(Stat::TablePages, 1);
        Mmu {
            config,
            root,
            lock: MmuLock::new(
                config.mmu_lock,
                config.wrprot == crate::config::WrprotVariant::RmapLockless,
                config.wrprot == crate::config::WrprotVariant::RmapEach,
            ),
            alloc,
            counters,
            flush: FlushDomain::new(),
            hooks: Hooks::new(),
            rmap: Arc::new(Rmap::new(config.wrprot.keeps_rmap())),
            deferred: std::sync::Mutex::new(PendingFlush::none()),
            has_deferred: std::sync::atomic::AtomicBool::new(false),
            _format: PhantomData,
        }
    }

    /// Host address of the root table.
    pub(crate) fn root_addr(&self) -> Hva {
        self.root
    }

    pub(crate) fn root(&self) -> &TablePage {
        // SAFETY: the root page lives as long as the MMU.
        unsafe { TablePage::at(self.root) }
    }

    pub(crate) fn sink(&self) -> Sink<'_> {
        Sink::Shared(&self.counters)
    }

    /// Flushes every vCPU's TLB and waits for the acknowledgements; refused if the calling
    /// thread holds a vCPU in guest mode (it would wait for itself).
    #[inline(always)]
    pub fn flush_remote_tlbs(&self) -> Result<(), FlushError> {
        self.flush_remote_tlbs_with::<F::Clock>()
    }

    /// [`Self::flush_remote_tlbs`] reported to clock `C` (the direct map's host CPUs run on
    /// the caller's clock, not on its table's format's).
    pub(crate) fn flush_remote_tlbs_with<C: Clock>(&self) -> Result<(), FlushError> {
        self.counters.add_shared_c::<C>(Stat::FlushRequests, 1);
        if self.flush.flush_all::<C>()? {
            self.counters.add_shared_c::<C>(Stat::Flushes, 1);
        }
        Ok(())
    }

    /// Performs the flush an operation owes, then hands its unlinked table pages (and those
    /// of flushes deferred before) to epoch reclamation. The only way to free table pages.
    /// Refused if the calling thread holds a vCPU in guest mode: then the flush is deferred,
    /// its pages kept until a later flush completes.
    #[inline(always)]
    pub fn try_complete_flush(&self, pending: PendingFlush) -> Result<(), FlushError> {
        self.try_complete_flush_with::<F::Clock>(pending)
    }

    /// [`Self::try_complete_flush`] reported to clock `C`.
    pub(crate) fn try_complete_flush_with<C: Clock>(
        &self,
        mut pending: PendingFlush,
    ) -> Result<(), FlushError> {
        if !pending.is_needed() {
            return Ok(());
        }
        // Deferred pages are taken *before* this flush: they were unlinked before they were
        // deferred, so this flush, which starts after, covers them.
        if self.has_deferred.load(std::sync::atomic::Ordering::Acquire) {
            let mut d = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
            pending.merge(std::mem::take(&mut *d));
            self.has_deferred
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        if let Err(e) = self.flush_remote_tlbs_with::<C>() {
            let mut d = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
            d.merge(pending);
            self.has_deferred
                .store(true, std::sync::atomic::Ordering::Release);
            return Err(e);
        }
        Rmap::retire::<C>(&self.rmap, &self.alloc, pending.graveyard);
        Ok(())
    }

    /// [`Self::try_complete_flush`] for an operation whose public entry checked that the
    /// calling thread holds no vCPU in guest mode ([`FlushDomain::check_own`]). Should it hold
    /// one anyway (a caller's callback entered guest mode and kept the token), the flush is
    /// deferred rather than waited for: no page is freed before a flush, nothing deadlocks.
    #[inline(always)]
    pub fn complete_flush(&self, pending: PendingFlush) {
        self.complete_flush_with::<F::Clock>(pending)
    }

    /// [`Self::complete_flush`] reported to clock `C`.
    #[inline(always)]
    pub(crate) fn complete_flush_with<C: Clock>(&self, pending: PendingFlush) {
        // Most operations owe nothing (a fault that filled an empty entry): no call at all.
        if pending.is_needed() {
            let _deferred_if_refused = self.try_complete_flush_with::<C>(pending);
        }
    }

    /// Frees every table under the root. Exclusive access: no vCPU can run.
    fn free_all(&mut self) {
        fn free_rec<F: PteFormat>(alloc: &TableAlloc, addr: Hva, level: Level, root: bool) {
            // SAFETY: `&mut Mmu` means no walker or vCPU is left; every linked page is live.
            let t = unsafe { TablePage::at(addr) };
            if level > 1 {
                for e in t.entries.iter() {
                    let v = e.load(Ordering::Relaxed);
                    if F::is_present(v) && !F::is_leaf(v, level) {
                        free_rec::<F>(alloc, F::output_addr(v), level - 1, false);
                    }
                }
            }
            if !root {
                // SAFETY: reachable only from the tree being torn down.
                alloc.free_now(unsafe { OwnedTable::from_unlinked(addr) });
            }
        }
        free_rec::<F>(&self.alloc, self.root, F::ROOT_LEVEL, true);
        for e in self.root().entries.iter() {
            e.store(F::NON_PRESENT, Ordering::Relaxed);
        }
    }
}

impl<F: PteFormat> Drop for Mmu<F> {
    fn drop(&mut self) {
        self.free_all();
        // Deferred flushes: no vCPU is left to flush, and their pages are unreachable.
        let deferred = self.deferred.get_mut().unwrap_or_else(|e| e.into_inner());
        for t in std::mem::take(&mut deferred.graveyard) {
            self.alloc.free_now(t);
        }
        // SAFETY: the root was allocated by `alloc` in `new` and is reachable from nothing else.
        self.alloc
            .free_now(unsafe { OwnedTable::from_unlinked(self.root) });
    }
}
