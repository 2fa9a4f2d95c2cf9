//! The VM: page-table root, MMU lock, memslots, vCPU registry, and the one SPTE-update path.

use crate::cmo::{clean_dcache_to_poc, invalidate_icache_to_pou};
use crate::config::{MmuLockKind, RebuildOrder, VmConfig};
use crate::dirty::{DirtyMode, DirtyRing, GetLogVariant, SlotBitmap};
use crate::flush::{FlushGen, GuestMode, PendingFlush, VcpuLink};
use crate::format::{bytes_per_entry, Access, Level, PteFormat, PAGE_SHIFT};
use crate::memslot::{
    validate_flags, validate_host, validate_range, HostRange, Memslot, MemslotError, MemslotFlags,
    MemslotSet, SlotId,
};
use crate::stats::{leaf_stat, Counters, Sink, Stat, Stats};
use crate::sync::{self, pin, Arc, AtomicU64, Mutex, Ordering, Published, RwLock};
use crate::table::{OwnedTable, PageCache, TableAlloc, TablePage};
use crate::walk::Walk;
use std::marker::PhantomData;

pub(crate) enum MmuLock {
    Rw(RwLock<()>),
    Mutex(Mutex<()>),
}

/// Held for a "read" (shared) MMU operation; exclusive under the mutex variant.
#[allow(dead_code)]
pub(crate) enum ReadGuard<'a> {
    Rw(sync::RwLockReadGuard<'a, ()>),
    Mutex(sync::MutexGuard<'a, ()>),
}

/// Held for an exclusive MMU operation.
pub(crate) enum WriteGuard<'a> {
    Rw(sync::RwLockWriteGuard<'a, ()>),
    Mutex(sync::MutexGuard<'a, ()>),
}

impl WriteGuard<'_> {
    /// Lets waiting faults run, then re-takes the lock.
    pub(crate) fn bump(&mut self) {
        match self {
            WriteGuard::Rw(g) => sync::bump_write(g),
            WriteGuard::Mutex(g) => sync::bump_mutex(g),
        }
    }
}

impl MmuLock {
    pub(crate) fn read(&self) -> ReadGuard<'_> {
        match self {
            MmuLock::Rw(l) => ReadGuard::Rw(sync::read(l)),
            MmuLock::Mutex(m) => ReadGuard::Mutex(sync::lock(m)),
        }
    }
    pub(crate) fn write(&self) -> WriteGuard<'_> {
        match self {
            MmuLock::Rw(l) => WriteGuard::Rw(sync::write(l)),
            MmuLock::Mutex(m) => WriteGuard::Mutex(sync::lock(m)),
        }
    }
}

/// How an entry update may race with others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpdateMode {
    /// MMU lock held shared (or none): compare-and-swap against the walker's snapshot.
    Shared,
    /// MMU lock held exclusively: only lock-free fixers and hardware race with us, so an
    /// exchange (never lost, never retried) suffices for entries they may change, and a
    /// plain store for the rest ([`PteFormat::needs_atomic_update`]).
    Exclusive,
}

/// The entry changed under us; the caller re-reads and retries, or gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy;

/// A guest's second-stage MMU.
pub struct Vm<F: PteFormat = crate::format::Ept> {
    pub(crate) config: VmConfig,
    /// Host address of the root table page (owned by the VM, freed on drop).
    pub(crate) root: u64,
    pub(crate) mmu_lock: MmuLock,
    pub(crate) slots_lock: Mutex<()>,
    pub(crate) slots: Published<MemslotSet>,
    pub(crate) slots_gen: AtomicU64,
    pub(crate) alloc: Arc<TableAlloc>,
    pub(crate) counters: Counters,
    pub(crate) vcpus: RwLock<Vec<Arc<VcpuLink>>>,
    pub(crate) vcpu_counters: Mutex<Vec<Arc<Counters>>>,
    pub(crate) flush_gen: Arc<FlushGen>,
    pub(crate) dirty_mode: Mutex<DirtyMode>,
    pub(crate) rings: Mutex<Vec<Arc<DirtyRing>>>,
    /// Deliberate protocol bugs (feature `test-hooks`), for tests of the oracles.
    pub(crate) hooks: crate::test_hooks::Hooks,
    _format: PhantomData<F>,
}

/// A vCPU of one VM: its table-page cache, memslot hint, counters and flush link, and the VM
/// it belongs to. The fault handlers are its methods, so a vCPU can only ever fault on, mark
/// dirty pages in and be flushed by its own VM. Dropping it removes it from the VM's flush
/// protocol (its dirty ring stays with the VM: unharvested entries are still owed).
pub struct Vcpu<F: PteFormat = crate::format::Ept> {
    pub(crate) vm: std::sync::Arc<Vm<F>>,
    pub(crate) state: VcpuState,
}

/// What the fault handlers change on a vCPU, apart from the VM it belongs to.
pub(crate) struct VcpuState {
    pub(crate) id: u32,
    pub(crate) cache: PageCache,
    pub(crate) slot_hint: SlotHint,
    pub(crate) counters: Arc<Counters>,
    pub(crate) link: Arc<VcpuLink>,
    pub(crate) ring: Option<Arc<DirtyRing>>,
}

pub(crate) struct SlotHint {
    pub(crate) set: Arc<MemslotSet>,
    pub(crate) index: usize,
}

impl<F: PteFormat> Vcpu<F> {
    /// The vCPU index.
    pub fn id(&self) -> u32 {
        self.state.id
    }

    /// The VM this vCPU belongs to.
    pub fn vm(&self) -> &std::sync::Arc<Vm<F>> {
        &self.vm
    }

    /// Enters guest mode: from now until the returned token (and any other token of this
    /// vCPU) is dropped, every remote flush waits for this vCPU to acknowledge it, which it
    /// does in [`Self::service_requests`] between accesses. Service
    /// [`GuestMode::requests_at_entry`] before the first access.
    #[inline]
    pub fn enter_guest(&mut self) -> GuestMode {
        VcpuLink::enter_guest(&self.state.link)
    }

    /// True while a [`GuestMode`] token of this vCPU lives.
    #[inline]
    pub fn in_guest(&self) -> bool {
        self.state.link.in_guest()
    }

    /// Requests pending now; check at every access boundary in guest mode.
    #[inline]
    pub fn pending_requests(&self) -> u32 {
        self.state.link.pending()
    }

    /// Services pending requests: calls `flush_tlb` for a TLB flush, then acknowledges.
    #[inline]
    pub fn service_requests(&self, flush_tlb: impl FnOnce()) -> u32 {
        self.state
            .link
            .service_requests(&self.vm.flush_gen.0, flush_tlb)
    }
}

impl<F: PteFormat> Drop for Vcpu<F> {
    fn drop(&mut self) {
        sync::write(&self.vm.vcpus).retain(|l| !Arc::ptr_eq(l, &self.state.link));
        self.state.cache.drain(&self.vm.alloc);
    }
}

impl<F: PteFormat> Vm<F> {
    /// Creates a VM with an empty page table and no memslots.
    pub fn new(config: VmConfig) -> std::sync::Arc<Self> {
        let alloc = Arc::new(TableAlloc::new());
        let root = alloc.alloc().into_linked();
        let counters = Counters::default();
        counters.add_shared(Stat::TablePages, 1);
        std::sync::Arc::new(Vm {
            config,
            root,
            mmu_lock: match config.mmu_lock {
                MmuLockKind::RwLock => MmuLock::Rw(RwLock::new(())),
                MmuLockKind::Mutex => MmuLock::Mutex(Mutex::new(())),
            },
            slots_lock: Mutex::new(()),
            slots: Published::new(MemslotSet::default()),
            slots_gen: AtomicU64::new(0),
            alloc,
            counters,
            vcpus: RwLock::new(Vec::new()),
            vcpu_counters: Mutex::new(Vec::new()),
            flush_gen: Arc::new(FlushGen(AtomicU64::new(0))),
            dirty_mode: Mutex::new(DirtyMode::default()),
            rings: Mutex::new(Vec::new()),
            hooks: crate::test_hooks::Hooks::new(),
            _format: PhantomData,
        })
    }

    /// The configuration the VM was created with.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Creates a vCPU of this VM. Flushes from now on wait for it whenever it is in guest
    /// mode; dropping it removes it.
    pub fn create_vcpu(self: &std::sync::Arc<Self>, id: u32) -> Vcpu<F> {
        let ring = self.new_vcpu_ring();
        let link = Arc::new(VcpuLink::new());
        let counters = Arc::new(Counters::default());
        sync::write(&self.vcpus).push(link.clone());
        sync::lock(&self.vcpu_counters).push(counters.clone());
        Vcpu {
            vm: self.clone(),
            state: VcpuState {
                id,
                cache: PageCache::default(),
                slot_hint: SlotHint {
                    set: self.slots.load_full(),
                    index: 0,
                },
                counters,
                link,
                ring,
            },
        }
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> Stats {
        let blocks = sync::lock(&self.vcpu_counters);
        Stats::sum(
            std::iter::once(&self.counters).chain(blocks.iter().map(|c| &**c)),
            self.alloc.live_pages(),
        )
    }

    /// The table-page allocator (for leak accounting).
    pub fn table_alloc(&self) -> &Arc<TableAlloc> {
        &self.alloc
    }

    /// Host address of the root table (what the hardware walker starts from).
    pub fn root_addr(&self) -> u64 {
        self.root
    }

    /// The current memslot set.
    pub fn memslots(&self) -> Arc<MemslotSet> {
        self.slots.load_full()
    }

    pub(crate) fn root(&self) -> &TablePage {
        // SAFETY: the root page lives as long as the VM.
        unsafe { TablePage::at(self.root) }
    }

    pub(crate) fn sink(&self) -> Sink<'_> {
        Sink::Shared(&self.counters)
    }

    // -----------------------------------------------------------------------------------------
    // The one SPTE-update path.

    /// Replaces the walker's current entry with `new`. Under [`UpdateMode::Shared`] this is a
    /// compare-and-swap against `it.old` (invariant 1): on failure `it.old` holds the value that
    /// won and the caller decides whether to retry. See [`Self::update_spte`].
    pub(crate) fn set_spte(
        &self,
        it: &mut Walk<'_, F>,
        new: u64,
        mode: UpdateMode,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) -> Result<(), Busy> {
        let mut old = it.old;
        let r = self.update_spte(it.sptep(), it.level, &mut old, new, mode, sink, pending);
        it.old = old;
        r
    }

    /// The one SPTE update every change goes through, for callers that hold the entry's
    /// address already (a harvest re-arming entries of one leaf table): `*old` is the value
    /// the caller read. Shared mode: compare-and-swap, and on failure `*old` becomes the value
    /// that won. Exclusive mode: an exchange if others may change the entry, else a plain
    /// store. Bookkeeping for what changed (leaf gauges, tables unlinked into `pending`,
    /// whether a flush is owed) happens here and nowhere else.
    // Always inlined: callers pass constant levels and modes, which prunes most of it (a
    // harvest's re-arm is then a few instructions around one store).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn update_spte(
        &self,
        sptep: &AtomicU64,
        level: Level,
        old: &mut u64,
        new: u64,
        mode: UpdateMode,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) -> Result<(), Busy> {
        debug_assert!(*old != F::FROZEN || mode == UpdateMode::Exclusive);
        let prev = match mode {
            UpdateMode::Shared => {
                match sptep.compare_exchange(*old, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(v) => v,
                    Err(cur) => {
                        *old = cur;
                        return Err(Busy);
                    }
                }
            }
            UpdateMode::Exclusive if F::needs_atomic_update(*old, level) => {
                sptep.swap(new, Ordering::AcqRel)
            }
            UpdateMode::Exclusive => {
                // Nobody else may write this entry while we hold the lock exclusively, so
                // `*old` is still its value and a plain store suffices (no locked RMW).
                debug_assert_eq!(sptep.load(Ordering::Relaxed), *old);
                sptep.store(new, Ordering::Release);
                *old
            }
        };
        *old = new;
        self.handle_changed_spte(prev, new, level, sink, pending);
        Ok(())
    }

    /// Replaces the walker's current entry with `new` where that changes what the entry maps:
    /// an empty entry gets a leaf, a block becomes a table, a table becomes a block. (Changes of
    /// permissions or A/D go through [`Self::set_spte`].)
    ///
    /// Without break-before-make this is one compare-and-swap; the caller's `pending` owes the
    /// flush. With it (arm64), the entry is never seen with two different valid values:
    /// 1. *break*: compare-and-swap the entry to `F::FROZEN` (KVM's `KVM_INVALID_PTE_LOCKED`),
    ///    which every other walker treats as a fault to retry and no other writer touches, so
    ///    the entry is ours until step 4;
    /// 2. if the old value was valid, a completed remote TLB flush: no vCPU still translates
    ///    through it, so the old and new translations never coexist (a TLB conflict);
    /// 3. with `cmo`, cache maintenance over a new leaf's range: only the fault that owns the
    ///    entry does it (seed 001 patch 1);
    /// 4. *make*: publish `new` with a release store (a prefilled table's entries before it).
    ///
    /// An old table is torn down (entries frozen and accounted, pages queued for freeing)
    /// during the break with [`RebuildOrder::BreakFirst`], so other vCPUs fault on the locked
    /// entry for the whole teardown; after the make with [`RebuildOrder::InstallFirst`] (seed
    /// 001 patch 2). Either way the pages were unreachable before the flush of step 2, so they
    /// go to epoch reclamation without another flush, and `pending` is left untouched.
    ///
    /// The break and the make are the only entry writes outside [`Self::update_spte`]: the
    /// transient locked value is not a change of mapping, so the bookkeeping is done once for
    /// the whole old → new transition (or old → locked at a break-first teardown), here.
    pub(crate) fn replace_spte(
        &self,
        it: &mut Walk<'_, F>,
        new: u64,
        cmo: bool,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) -> Result<(), Busy> {
        if !F::BREAK_BEFORE_MAKE {
            return self.set_spte(it, new, UpdateMode::Shared, sink, pending);
        }
        let old = it.old;
        let level = it.level;
        let sptep = it.sptep();
        if let Err(cur) =
            sptep.compare_exchange(old, F::FROZEN, Ordering::AcqRel, Ordering::Acquire)
        {
            it.old = cur;
            return Err(Busy);
        }
        let old_valid = F::is_present(old);
        let old_table = old_valid && !F::is_leaf(old, level);
        let break_first = old_table && self.config.rebuild == RebuildOrder::BreakFirst;
        let mut teardown = PendingFlush::none();
        if break_first {
            self.handle_changed_spte(old, F::FROZEN, level, sink, &mut teardown);
        }
        let mut flushed = false;
        if old_valid {
            sink.inc(Stat::Breaks);
            let skip = self.hooks.active(crate::test_hooks::inject::SKIP_BBM_FLUSH);
            if !skip {
                self.flush_remote_tlbs();
                flushed = true;
            }
        }
        if cmo && F::is_present(new) && F::is_leaf(new, level) {
            self.clean_new_mapping(
                F::output_addr(new),
                bytes_per_entry(level),
                F::permits(new, Access::Exec),
                sink,
            );
        }
        if !old_table {
            // Before publishing: a new table's leaves (a split's) are ours alone to count until
            // then; once it is visible, faults may add leaves of their own and count them.
            self.handle_changed_spte(old, new, level, sink, &mut teardown);
        }
        sptep.store(new, Ordering::Release);
        it.old = new;
        if break_first {
            self.handle_changed_spte(F::FROZEN, new, level, sink, &mut teardown);
        } else if old_table {
            self.handle_changed_spte(old, new, level, sink, &mut teardown);
        }
        if flushed {
            self.retire_flushed(teardown);
        } else {
            // Nothing was flushed (an empty entry was filled, or a test skipped the flush):
            // whatever was unlinked waits for the caller's flush.
            pending.merge(teardown);
        }
        Ok(())
    }

    /// Cache maintenance for a mapping about to be published: clean the data cache over it,
    /// and invalidate the instruction cache too if it is executable.
    pub(crate) fn clean_new_mapping(&self, addr: u64, len: u64, exec: bool, sink: Sink<'_>) {
        clean_dcache_to_poc(addr, len);
        sink.inc(Stat::CacheCleans);
        sink.add(Stat::CacheCleanBytes, len);
        if exec {
            self.invalidate_icache_for(addr, len, sink);
        }
    }

    /// Instruction-cache invalidation for a live mapping that becomes executable.
    pub(crate) fn invalidate_icache_for(&self, addr: u64, len: u64, sink: Sink<'_>) {
        invalidate_icache_to_pou(addr, len);
        sink.inc(Stat::CacheCleans);
        sink.add(Stat::CacheCleanBytes, len);
    }

    /// Hands table pages to epoch reclamation without a flush of their own: only for pages
    /// that were unreachable before a remote flush that has completed (a break-before-make
    /// break). Everything else frees through [`Self::complete_flush`].
    fn retire_flushed(&self, p: PendingFlush) {
        if p.graveyard.is_empty() {
            return;
        }
        let guard = pin();
        TableAlloc::free_deferred(&self.alloc, &guard, p.graveyard);
        guard.flush();
    }

    #[inline(always)]
    fn handle_changed_spte(
        &self,
        old: u64,
        new: u64,
        level: Level,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) {
        if F::is_present(old)
            && F::is_leaf(old, level)
            && F::is_present(new)
            && F::is_leaf(new, level)
        {
            // A permission or A/D change of one leaf (write protection, the fast path): no
            // gauge moves, no table leaves; a flush is owed only if W was taken away, or D
            // (a TLB entry caches "dirty": writes through it would not set D again).
            if (F::is_writable(old) && !F::is_writable(new))
                || (F::is_dirty(old) && !F::is_dirty(new))
            {
                pending.require();
            }
            return;
        }
        self.handle_changed_structure(old, new, level, sink, pending);
    }

    /// The rest of [`Self::handle_changed_spte`]: a leaf or table appeared or went away.
    #[inline(never)]
    fn handle_changed_structure(
        &self,
        old: u64,
        new: u64,
        level: Level,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) {
        let old_present = F::is_present(old);
        let new_present = F::is_present(new);
        let old_leaf = old_present && F::is_leaf(old, level);
        let new_leaf = new_present && F::is_leaf(new, level);
        if old_leaf != new_leaf || (old_present != new_present) {
            if old_leaf {
                sink.dec(leaf_stat(level));
            }
            if new_leaf {
                sink.inc(leaf_stat(level));
            }
        }
        let old_table = old_present && !old_leaf;
        let new_table = new_present && !new_leaf;
        if old_table && !(new_table && F::output_addr(new) == F::output_addr(old)) {
            // A table left the tree: its translations may be cached by hardware walkers.
            pending.require();
            self.unlink_table(F::output_addr(old), level - 1, sink, pending);
        }
        if new_table && !(old_table && F::output_addr(new) == F::output_addr(old)) {
            sink.inc(Stat::TablePages);
            // A prefilled table (split) brings its leaves into the tree with it.
            // SAFETY: the table was just linked by us and cannot have been freed: freeing needs
            // a flush and a grace period that our caller's guard spans.
            let t = unsafe { TablePage::at(F::output_addr(new)) };
            // Only a split brings leaves along; a fresh table may already hold leaves other
            // vCPUs installed (and counted) since we linked it.
            let n = if !old_leaf {
                0
            } else {
                t.entries
                    .iter()
                    .filter(|e| F::is_present(e.load(Ordering::Relaxed)))
                    .count() as u64
            };
            if n > 0 {
                sink.add(leaf_stat(level - 1), n);
            }
        }
        if old_present
            && (!new_present || (old_leaf && !F::is_writable(new) && F::is_writable(old)))
        {
            pending.require();
        }
    }

    /// Takes a table out of the tree: freezes each entry (so a lock-free fixer racing on it
    /// fails its CAS and re-walks), accounts and recurses, and queues the page for freeing.
    fn unlink_table(&self, addr: u64, level: Level, sink: Sink<'_>, pending: &mut PendingFlush) {
        // SAFETY: the table was reachable until our update, and its page is only freed through
        // `pending`, after this function returns.
        let t = unsafe { TablePage::at(addr) };
        for e in t.entries.iter() {
            let v = if F::BREAK_BEFORE_MAKE {
                freeze_after_make::<F>(e)
            } else {
                e.swap(F::FROZEN, Ordering::AcqRel)
            };
            if !F::is_present(v) {
                continue;
            }
            if F::is_leaf(v, level) {
                sink.dec(leaf_stat(level));
            } else {
                self.unlink_table(F::output_addr(v), level - 1, sink, pending);
            }
        }
        sink.dec(Stat::TablePages);
        // SAFETY: unlinked above, and nobody else unlinks it (our update removed its only
        // parent entry).
        pending
            .graveyard
            .push(unsafe { OwnedTable::from_unlinked(addr) });
    }

    // -----------------------------------------------------------------------------------------
    // Flushes.

    /// Flushes every vCPU's TLB and waits for the acknowledgements.
    pub fn flush_remote_tlbs(&self) {
        self.counters.add_shared(Stat::FlushRequests, 1);
        let vcpus = sync::read(&self.vcpus);
        if self.flush_gen.flush_all(&vcpus) {
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
        let guard = pin();
        TableAlloc::free_deferred(&self.alloc, &guard, pending.graveyard);
        guard.flush();
    }

    // -----------------------------------------------------------------------------------------
    // Zap.

    /// Unmaps `[start_gfn, end_gfn)` under the exclusive MMU lock with one batched flush.
    /// Tables wholly inside the range are freed; a huge leaf that straddles an edge is zapped
    /// whole (it is only a cache of the memslot, the next fault rebuilds what is still needed).
    ///
    /// The flush completes *before* the lock is released, as in KVM's `kvm_zap_gfn_range`. A
    /// zapped entry is empty, and a fault that fills an empty entry owes no flush; if the
    /// lock were released first, a fault could install a mapping of another size over the
    /// range (a 4 KiB leaf where a 2 MiB leaf was, with logging on) while some vCPU still
    /// caches the old one: two translations of one address, which arm64 forbids (a TLB
    /// conflict abort; break-before-make's "break" is only complete after the flush). Faults
    /// do not wait for vCPUs in guest mode, and vCPUs do not need the lock to acknowledge,
    /// so flushing under the lock cannot deadlock.
    pub fn zap_gfn_range(&self, start_gfn: u64, end_gfn: u64) {
        let mut lock = self.mmu_lock.write();
        let pending = self.zap_locked(&mut lock, start_gfn, end_gfn);
        self.complete_flush(pending);
        drop(lock);
    }

    pub(crate) fn zap_locked(
        &self,
        lock: &mut WriteGuard<'_>,
        start: u64,
        end: u64,
    ) -> PendingFlush {
        const YIELD_EVERY: u32 = 4096;
        let mut pending = PendingFlush::none();
        let guard = pin();
        let root = self.root;
        // SAFETY: the root lives as long as the VM.
        let mut it = Walk::<F>::new(&guard, unsafe { TablePage::at(root) }, 1, start, end);
        let mut visited = 0u32;
        while it.valid() {
            visited += 1;
            if visited % YIELD_EVERY == 0 && it.can_yield() {
                // Flush before letting faults in, as KVM does, so no vCPU keeps using a
                // translation of memory the caller is about to release.
                let p = std::mem::take(&mut pending);
                self.complete_flush(p);
                lock.bump();
                // Entries on the saved path may have been freed meanwhile: restart from the
                // root at the first GFN not yet visited.
                it.mark_yielded();
                it.next();
                continue;
            }
            let old = it.old;
            if F::is_present(old)
                && (F::is_leaf(old, it.level) || (it.gfn >= start && it.entry_end() <= end))
            {
                let _ = self.set_spte(
                    &mut it,
                    F::NON_PRESENT,
                    UpdateMode::Exclusive,
                    self.sink(),
                    &mut pending,
                );
            }
            it.next();
        }
        pending
    }

    /// Walks the whole table and counts leaves per level and linked tables (tests and
    /// debugging: compare with [`Self::stats`]). Takes the MMU lock exclusively.
    pub fn audit(&self) -> Audit {
        let _lock = self.mmu_lock.write();
        let guard = pin();
        let mut a = Audit {
            tables: 1,
            ..Audit::default()
        };
        let mut it = Walk::<F>::new(
            &guard,
            self.root(),
            1,
            0,
            1u64 << (F::MAX_PHYS_BITS - PAGE_SHIFT),
        );
        while it.valid() {
            let v = it.old;
            if F::is_present(v) {
                if F::is_leaf(v, it.level) {
                    a.leaves[it.level as usize - 1] += 1;
                } else {
                    a.tables += 1;
                }
            } else if v == F::FROZEN {
                a.frozen += 1;
            }
            it.next();
        }
        a
    }

    /// The leaf mapping `gfn`, if any: (entry value, level). Lock-free read for tests and tools.
    pub fn lookup(&self, gfn: u64) -> Option<(u64, Level)> {
        let guard = pin();
        let mut it = Walk::<F>::new(&guard, self.root(), 1, gfn, gfn + 1);
        while it.valid() {
            let v = it.old;
            if !F::is_present(v) {
                return None;
            }
            if F::is_leaf(v, it.level) {
                return Some((v, it.level));
            }
            it.next();
        }
        None
    }

    // -----------------------------------------------------------------------------------------
    // Memslots.

    fn publish(&self, change: impl FnOnce(&mut Vec<Arc<Memslot>>)) {
        let cur = self.slots.load_full();
        let gen = cur.generation() + 1;
        self.slots.store(Arc::new(cur.with(gen, change)));
        // After the new set: a fault that reads this generation finds the new set; a fault that
        // read an older one fails its re-check under the MMU lock.
        self.slots_gen.store(gen, Ordering::SeqCst);
        // Wait out faults that passed their generation check against the old set and still
        // hold the MMU lock: after this, every fault that installs anything saw the new set
        // (KVM's synchronize_srcu after a memslot swap). Without it, a fault could install a
        // huge writable leaf behind the split/write-protect walk of enabling dirty logging.
        drop(self.mmu_lock.write());
    }

    /// Adds a memslot mapping `[gpa, gpa + size)` onto the first `size` bytes of `host`,
    /// which the slot keeps alive (see [`crate::host_memory`]).
    pub fn add_memslot(
        &self,
        id: SlotId,
        gpa: u64,
        size: u64,
        host: HostRange,
        flags: MemslotFlags,
    ) -> Result<(), MemslotError> {
        let _s = sync::lock(&self.slots_lock);
        let flags = validate_flags(id, flags)?;
        let cur = self.slots.load_full();
        if cur.by_id(id).is_some() {
            return Err(MemslotError::DuplicateId { id });
        }
        validate_range::<F>(&cur, id, gpa, size, None)?;
        validate_host::<F>(id, size, &host)?;
        let npages = size >> PAGE_SHIFT;
        let slot = Memslot {
            id,
            base_gfn: gpa >> PAGE_SHIFT,
            npages,
            host_addr: host.addr(),
            host_page_size: host.page_size(),
            host,
            flags,
            dirty: self.new_bitmap(flags, npages),
            invalid: false,
        };
        self.publish(|v| v.push(Arc::new(slot)));
        Ok(())
    }

    /// Deletes a memslot; its mappings are zapped and flushed before this returns, so the host
    /// memory may be released afterwards.
    pub fn delete_memslot(&self, id: SlotId) -> Result<(), MemslotError> {
        let _s = sync::lock(&self.slots_lock);
        let cur = self.slots.load_full();
        let slot = cur
            .by_id(id)
            .ok_or(MemslotError::UnknownSlot { id })?
            .clone();
        self.publish(|v| v.retain(|s| s.id != id));
        self.zap_gfn_range(slot.base_gfn, slot.end_gfn());
        Ok(())
    }

    /// Moves a memslot to a new guest address (same host memory). The old range is zapped and
    /// flushed before this returns; while the move runs, neither range maps (faults on the old
    /// one retry, on the new one exit as MMIO, as in KVM).
    pub fn move_memslot(&self, id: SlotId, new_gpa: u64) -> Result<(), MemslotError> {
        let _s = sync::lock(&self.slots_lock);
        let cur = self.slots.load_full();
        let slot = cur
            .by_id(id)
            .ok_or(MemslotError::UnknownSlot { id })?
            .clone();
        validate_range::<F>(&cur, id, new_gpa, slot.size(), Some(id))?;
        // Step 1: the old range stays published, invalid (KVM's `kvm_invalidate_memslot`).
        // A vCPU may still write through a leaf of the old range until the zap below has
        // flushed; with hardware-dirty tracking it logs that write by looking the gfn up, and
        // an invalid copy there is what it finds. Publishing the new range at once instead
        // dropped such marks (found by the churn oracle).
        let invalid = Arc::new(Memslot {
            invalid: true,
            ..(*slot).clone()
        });
        self.publish(|v| {
            v.retain(|s| s.id != id);
            v.push(invalid);
        });
        // Step 2: zap and flush under the MMU lock: afterwards no vCPU holds or walks a leaf
        // of the old range, so nothing can mark through it any more.
        self.zap_gfn_range(slot.base_gfn, slot.end_gfn());
        // Step 3: the new range. The log survives the move, as in KVM
        // (`kvm_prepare_memory_region` hands the old bitmap to the new slot): its bits are
        // slot-relative, and a page written before the move and not yet harvested must still
        // be reported after it.
        let moved = Arc::new(Memslot {
            base_gfn: new_gpa >> PAGE_SHIFT,
            ..(*slot).clone()
        });
        self.publish(|v| {
            v.retain(|s| s.id != id);
            v.push(moved);
        });
        Ok(())
    }

    /// Changes a memslot's flags: turning dirty logging on write-protects the slot (after an
    /// eager split, unless configured off); turning it off ends the log (its unharvested bits
    /// are dropped, as KVM frees the bitmap: harvest first) and recovers huge mappings.
    /// `READONLY` cannot change on an existing slot (KVM refuses it too): a read-only slot
    /// does not log, so the toggle would silently end and restart the log, losing the pages
    /// written before it. Delete and re-add the slot instead.
    pub fn set_memslot_flags(&self, id: SlotId, flags: MemslotFlags) -> Result<(), MemslotError> {
        let _s = sync::lock(&self.slots_lock);
        let flags = validate_flags(id, flags)?;
        let cur = self.slots.load_full();
        let slot = cur
            .by_id(id)
            .ok_or(MemslotError::UnknownSlot { id })?
            .clone();
        if flags == slot.flags {
            return Ok(());
        }
        if (flags ^ slot.flags).contains(MemslotFlags::READONLY) {
            return Err(MemslotError::ReadonlyChange { id });
        }
        let was_logging = slot.is_logging();
        let dirty = if was_logging && Self::logs(flags) {
            slot.dirty.clone()
        } else {
            self.new_bitmap(flags, slot.npages)
        };
        let updated = Arc::new(Memslot {
            flags,
            dirty,
            ..(*slot).clone()
        });
        self.publish(|v| {
            v.retain(|s| s.id != id);
            v.push(updated.clone());
        });
        if updated.is_logging() && !was_logging {
            self.enable_dirty_logging(&updated);
        } else if was_logging && !updated.is_logging() {
            self.disable_dirty_logging(&updated);
        }
        Ok(())
    }

    fn logs(flags: MemslotFlags) -> bool {
        flags.contains(MemslotFlags::LOG_DIRTY_PAGES) && !flags.contains(MemslotFlags::READONLY)
    }

    fn new_bitmap(&self, flags: MemslotFlags, npages: u64) -> Option<Arc<SlotBitmap>> {
        let mode = self.dirty_mode();
        let switch = self.config.get_log == GetLogVariant::Switch && !mode.manual();
        (Self::logs(flags) && mode.uses_bitmap()).then(|| {
            Arc::new(SlotBitmap::new(
                npages,
                mode.manual() && mode.initially_set(),
                switch,
            ))
        })
    }

    /// Frees every table under the root. Exclusive access: no vCPU can run.
    fn free_all(&mut self) {
        fn free_rec<F: PteFormat>(alloc: &TableAlloc, addr: u64, level: Level, root: bool) {
            // SAFETY: `&mut Vm` means no walker or vCPU is left; every linked page is live.
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

impl<F: PteFormat> Drop for Vm<F> {
    fn drop(&mut self) {
        self.free_all();
        // SAFETY: the root was allocated by `alloc` in `new` and is reachable from nothing else.
        self.alloc
            .free_now(unsafe { OwnedTable::from_unlinked(self.root) });
    }
}

/// What [`Vm::audit`] found in the tree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Audit {
    /// Leaves per level (index 0 = 4 KiB).
    pub leaves: [u64; 3],
    /// Table pages, root included.
    pub tables: u64,
    /// Frozen entries (must be 0 when no operation is in flight).
    pub frozen: u64,
}

/// Freezes an entry of a table being unlinked, under break-before-make. A locked entry (the
/// value `F::FROZEN`) belongs to a breaker in [`Vm::replace_spte`] whose make is a plain store:
/// swapping it to frozen now would let that store land in the dead table afterwards, and the
/// breaker would count a leaf nobody can ever unlink. So wait for the make, then freeze what it
/// published. The breaker is past its break, so it only has a flush (which never waits for us:
/// we are outside guest mode) and its cache maintenance left before it stores.
fn freeze_after_make<F: PteFormat>(e: &AtomicU64) -> u64 {
    loop {
        let v = e.load(Ordering::Acquire);
        if v == F::FROZEN {
            sync::spin_hint();
            continue;
        }
        if e.compare_exchange(v, F::FROZEN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return v;
        }
    }
}
