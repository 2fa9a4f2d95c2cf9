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

use crate::config::VmConfig;
use crate::format::{Level, PteFormat};
use crate::stats::{Counters, Sink, Stat};
use crate::sync::{Arc, Ordering};
use crate::test_hooks::Hooks;
use flush::{FlushDomain, PendingFlush};
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
    /// The reverse map (kept only with `VmConfig::wrprot` `rmap` / `rmap-lockless`).
    pub(crate) rmap: Arc<Rmap>,
    _format: PhantomData<F>,
}

impl<F: PteFormat> Mmu<F> {
    pub(crate) fn new(config: VmConfig) -> Self {
        let alloc = Arc::new(TableAlloc::new());
        let root_page = alloc.alloc();
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
            ),
            alloc,
            counters,
            flush: FlushDomain::new(),
            hooks: Hooks::new(),
            rmap: Arc::new(Rmap::new(config.wrprot.keeps_rmap())),
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

    /// Flushes every vCPU's TLB and waits for the acknowledgements.
    pub fn flush_remote_tlbs(&self) {
        self.counters.add_shared(Stat::FlushRequests, 1);
        if self.flush.flush_all() {
            self.counters.add_shared(Stat::Flushes, 1);
        }
    }

    /// Performs the flush an operation owes, then hands its unlinked table pages to epoch
    /// reclamation. The only way to free table pages.
    pub fn complete_flush(&self, pending: PendingFlush) {
        if !pending.is_needed() {
            return;
        }
        self.flush_remote_tlbs();
        Rmap::retire(&self.rmap, &self.alloc, pending.graveyard);
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
        // SAFETY: the root was allocated by `alloc` in `new` and is reachable from nothing else.
        self.alloc
            .free_now(unsafe { OwnedTable::from_unlinked(self.root) });
    }
}
