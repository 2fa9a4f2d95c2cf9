//! The one SPTE-update path: every change of a table entry goes through
//! [`Mmu::update_spte`] (or its walker form [`Mmu::set_spte`]), or through
//! [`Mmu::replace_spte`] where break-before-make needs the entry locked first. The bookkeeping
//! of a change (leaf gauges, unlinked tables frozen and queued in the operation's
//! [`PendingFlush`], whether a flush is owed) happens here and nowhere else.

use super::flush::PendingFlush;
use super::lock::{Shared, SpteWriter};
use super::table::{OwnedTable, TablePage};
use super::walk::Walk;
use super::Mmu;
use crate::clock::addr_of;
use crate::cmo::clean_new_mapping;
use crate::config::RebuildOrder;
use crate::format::{bytes_per_entry, pages_per_entry, Access, FrameStep, Level, PteFormat};
use crate::stats::{leaf_stat, Sink, Stat};
use crate::sync::{self, AtomicU64, Ordering};
use slat_addr::{Gfn, Hva};

/// The entry changed under us; the caller re-reads and retries, or gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy;

impl<F: PteFormat> Mmu<F> {
    /// Replaces the walker's current entry with `new`. With a [`Shared`] writer this is a
    /// compare-and-swap against `it.old` (invariant 1): on failure `it.old` holds the value that
    /// won and the caller decides whether to retry. See [`Self::update_spte`].
    pub(crate) fn set_spte<W: SpteWriter>(
        &self,
        it: &mut Walk<'_, F>,
        new: u64,
        writer: W,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) -> Result<(), Busy> {
        let mut old = it.old;
        let r = self.update_spte(
            it.sptep(),
            it.level,
            it.gfn,
            &mut old,
            new,
            writer,
            sink,
            pending,
        );
        it.old = old;
        r
    }

    /// The one SPTE update every change goes through, for callers that hold the entry's
    /// address already (a harvest re-arming entries of one leaf table): `*old` is the value
    /// the caller read, `gfn` the first gfn the entry maps. The writer is the witness of how
    /// the MMU lock is held ([`super::lock`]): [`Shared`], a compare-and-swap, and on failure
    /// `*old` becomes the value that won; [`super::lock::Exclusive`], an exchange if lock-free
    /// writers may change the entry, else a plain store. Bookkeeping for what changed (leaf gauges, tables unlinked into `pending`,
    /// whether a flush is owed) happens here and nowhere else.
    // Always inlined: callers pass constant levels, and the writer's type is a constant too,
    // which prunes most of it (a harvest's re-arm is then a few instructions around one store).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn update_spte<W: SpteWriter>(
        &self,
        sptep: &AtomicU64,
        level: Level,
        gfn: Gfn,
        old: &mut u64,
        new: u64,
        writer: W,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) -> Result<(), Busy> {
        debug_assert!(*old != F::FROZEN || W::EXCLUSIVE);
        let table = table_of(sptep);
        let links_table = level > 1
            && F::is_present(new)
            && !F::is_leaf(new, level)
            && !(F::is_present(*old)
                && !F::is_leaf(*old, level)
                && F::output_addr(*old) == F::output_addr(new));
        if links_table {
            self.before_publishing_table(gfn, level, *old, new, !W::EXCLUSIVE);
        }
        // A leaf appears here: into the rmap *before* it is published, so whoever can see the leaf
        // (a vCPU that then makes it writable and marks the page, a harvest that consumed that
        // mark) can also see the rmap entry — a stronger form of the lockless write-protect series'
        // order "make writable → entry in the rmap → dirty bit". (A permission change of a leaf
        // keeps its entry: this is false for every harvest and fast-path update.)
        let adds_leaf = F::is_present(new)
            && F::is_leaf(new, level)
            && !(F::is_present(*old) && F::is_leaf(*old, level));
        if adds_leaf && self.rmap.enabled() {
            self.rmap_insert_leaf(gfn, level, table);
        }
        let prev = match writer.write::<F>(sptep, *old, new, level) {
            Ok(v) => v,
            Err(cur) => {
                if links_table {
                    self.unpublished_table_lost(gfn, level, *old, new);
                }
                if adds_leaf
                    && self.rmap.enabled()
                    && !(F::is_present(cur) && F::is_leaf(cur, level))
                {
                    // Undo, unless a leaf won the race here: its installer inserted the same
                    // table first. Anyone else racing to install a leaf expected the same old
                    // value and fails too.
                    self.rmap.remove::<F::Clock>(gfn, level, table);
                }
                *old = cur;
                return Err(Busy);
            }
        };
        if links_table && !W::EXCLUSIVE {
            self.split_published(gfn, level, prev, new);
        }
        *old = new;
        self.handle_changed_spte(gfn, table, prev, new, level, sink, pending);
        Ok(())
    }

    /// A table is about to be published at (`gfn`, `level`): record in its header what it maps, and
    /// if it replaces a leaf (a split, prefilled with the leaf's pages), put its leaves in the rmap
    /// now. Those leaves inherit W with no dirty mark after them, so they must be findable before
    /// anyone can write through them (the lockless write-protect series' order). The page is still
    /// ours alone: nothing else writes its header or its entries yet.
    ///
    /// `racing`: other splits of the same leaf may be doing the same with their own tables
    /// (a compare-and-swap publishes one of them). Then a slot is only *claimed* if empty
    /// (never overwriting a winner's), and the winner stores its tables again right after
    /// its compare-and-swap ([`Self::split_published`]). Without `racing` (the entry is
    /// locked by break-before-make) the slots are simply stored.
    #[cold]
    fn before_publishing_table(&self, gfn: Gfn, level: Level, old: u64, new: u64, racing: bool) {
        // SAFETY: `new` names a table page the caller owns and is about to link.
        let child = unsafe { TablePage::at(F::output_addr(new)) };
        child.meta().set(gfn, level - 1);
        if self.rmap.enabled() && F::is_present(old) && F::is_leaf(old, level) {
            self.insert_children(child, gfn, level - 1, racing);
        }
    }

    /// Puts the leaves of a split's table in the rmap (see [`Self::before_publishing_table`]).
    fn insert_children(&self, child: &TablePage, gfn: Gfn, level: Level, claim: bool) {
        if self
            .hooks
            .active(crate::test_hooks::inject::SKIP_RMAP_INSERT)
        {
            return;
        }
        let step = pages_per_entry(level);
        for (i, e) in child.entries.iter().enumerate() {
            let v = e.load(Ordering::Relaxed);
            if F::is_present(v) && F::is_leaf(v, level) {
                let g = gfn.plus(i as u64 * step);
                if claim {
                    self.rmap.claim::<F::Clock>(g, level, child.addr());
                } else {
                    self.rmap.insert::<F::Clock>(g, level, child.addr());
                }
            }
        }
    }

    /// A split's table won its compare-and-swap: store its leaves' slots (a losing split may
    /// have claimed them first and will clear only slots still naming its own table). Done
    /// before the old leaf's slot is removed, so a lock-free reader finds either the old
    /// slot (naming a table whose entry now leads to the new table) or the new ones.
    #[cold]
    fn split_published(&self, gfn: Gfn, level: Level, old: u64, new: u64) {
        if self.rmap.enabled() && F::is_present(old) && F::is_leaf(old, level) {
            // SAFETY: just linked by us; freeing it needs a flush and a grace period our
            // caller's pin (or lock) spans.
            let child = unsafe { TablePage::at(F::output_addr(new)) };
            self.insert_children(child, gfn, level - 1, false);
        }
    }

    /// Inserts a leaf about to be published (unless a test hook breaks the order on purpose).
    #[inline(never)]
    fn rmap_insert_leaf(&self, gfn: Gfn, level: Level, table: Hva) {
        if self
            .hooks
            .active(crate::test_hooks::inject::SKIP_RMAP_INSERT)
        {
            return;
        }
        self.rmap.insert::<F::Clock>(gfn, level, table);
    }

    /// Puts a leaf the caller found linked back in the rmap if its slot does not name its
    /// table (enabling logging, under the MMU lock in a slot that now maps 4 KiB only, so no
    /// shared-lock restructuring races it). Repairs what a race between two shared-lock
    /// restructurings may have left while the slot was not logged (ARCHITECTURE.md).
    pub(crate) fn rmap_reassert(&self, gfn: Gfn, level: Level, table: Hva) {
        if let Some(s) = self.rmap.find::<F::Clock>(gfn) {
            if let Some(slot) = s.slot(gfn, level) {
                if slot.load(Ordering::Relaxed) != table.raw() {
                    sync::store::<F::Clock, _>(slot, table.raw(), Ordering::Release);
                }
            }
        }
    }

    /// The compare-and-swap that would have published a split's table failed: take its leaves
    /// out of the rmap again (nobody else can have inserted this unpublished page).
    #[cold]
    fn unpublished_table_lost(&self, gfn: Gfn, level: Level, old: u64, new: u64) {
        if !(self.rmap.enabled() && F::is_present(old) && F::is_leaf(old, level)) {
            return;
        }
        let step = pages_per_entry(level - 1);
        let child = F::output_addr(new);
        for i in 0..crate::format::ENTRIES_PER_TABLE as u64 {
            self.rmap
                .remove::<F::Clock>(gfn.plus(i * step), level - 1, child);
        }
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
    ///    entry does it (KVM arm64's CMOs moved into the fault handlers);
    /// 4. *make*: publish `new` with a release store (a prefilled table's entries before it).
    ///
    /// An old table is torn down (entries frozen and accounted, pages queued for freeing) during
    /// the break with [`RebuildOrder::BreakFirst`], so other vCPUs fault on the locked entry for
    /// the whole teardown; after the make with [`RebuildOrder::InstallFirst`] (KVM arm64's
    /// "Install the block entry before unmapping the page mappings"). Either way the pages were
    /// unreachable before the flush of step 2, so they go to epoch reclamation without another
    /// flush, and `pending` is left untouched.
    ///
    /// The break and the make are the only entry writes outside [`Self::update_spte`]: the
    /// transient locked value is not a change of mapping, so the bookkeeping is done once for
    /// the whole old → new transition (or old → locked at a break-first teardown), here.
    ///
    /// The writer is a [`Shared`] one: the break is a compare-and-swap whatever the lock mode,
    /// and the make stores to an entry the break made ours.
    pub(crate) fn replace_spte(
        &self,
        it: &mut Walk<'_, F>,
        new: u64,
        cmo: bool,
        writer: Shared<'_>,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) -> Result<(), Busy> {
        if !F::BREAK_BEFORE_MAKE {
            return self.set_spte(it, new, writer, sink, pending);
        }
        let old = it.old;
        let level = it.level;
        let gfn = it.gfn;
        let sptep = it.sptep();
        let table = table_of(sptep);
        if let Err(cur) =
            sync::cas_entry::<F::Clock>(sptep, old, F::FROZEN, Ordering::AcqRel, Ordering::Acquire)
        {
            it.old = cur;
            return Err(Busy);
        }
        let old_valid = F::is_present(old);
        let old_table = old_valid && !F::is_leaf(old, level);
        let break_first = old_table && self.config.rebuild == RebuildOrder::BreakFirst;
        let mut teardown = PendingFlush::none();
        if break_first {
            self.handle_changed_spte(gfn, table, old, F::FROZEN, level, sink, &mut teardown);
        }
        if level > 1
            && F::is_present(new)
            && !F::is_leaf(new, level)
            && !(old_table && F::output_addr(old) == F::output_addr(new))
        {
            // The entry is locked: the make below is the publication.
            self.before_publishing_table(gfn, level, old, new, false);
        }
        if self.rmap.enabled()
            && F::is_present(new)
            && F::is_leaf(new, level)
            && !(old_valid && F::is_leaf(old, level))
        {
            // Before the make, as in `update_spte`.
            self.rmap_insert_leaf(gfn, level, table);
        }
        let flushed = self.flush_broken_and_clean(old_valid, new, level, cmo, sink);
        if !old_table {
            // Before publishing: a new table's leaves (a split's) are ours alone to count until
            // then; once it is visible, faults may add leaves of their own and count them.
            self.handle_changed_spte(gfn, table, old, new, level, sink, &mut teardown);
        }
        sync::store_entry::<F::Clock>(sptep, F::FROZEN, new, Ordering::Release);
        it.old = new;
        if break_first {
            self.handle_changed_spte(gfn, table, F::FROZEN, new, level, sink, &mut teardown);
        } else if old_table {
            self.handle_changed_spte(gfn, table, old, new, level, sink, &mut teardown);
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

    /// Steps 2 and 3 of [`Self::replace_spte`], with its entry locked: the remote flush if the
    /// old value was valid (returns whether one completed), then a new leaf's cache
    /// maintenance with `cmo`.
    #[inline(always)]
    fn flush_broken_and_clean(
        &self,
        old_valid: bool,
        new: u64,
        level: Level,
        cmo: bool,
        sink: Sink<'_>,
    ) -> bool {
        let mut flushed = false;
        if old_valid {
            sink.inc::<F::Clock>(Stat::Breaks);
            let skip = self.hooks.active(crate::test_hooks::inject::SKIP_BBM_FLUSH);
            // A flush refused (the calling thread holds a vCPU in guest mode: public entries
            // refuse that first) leaves the teardown to the caller's flush, as a skipped one.
            if !skip && self.flush_remote_tlbs().is_ok() {
                flushed = true;
            }
        }
        if cmo && F::is_present(new) && F::is_leaf(new, level) {
            clean_new_mapping::<F::Clock>(
                F::output_addr(new).raw(),
                bytes_per_entry(level),
                F::permits(new, Access::Exec),
                sink,
            );
        }
        flushed
    }

    /// Frees the pages of `p`'s graveyard, which were unreachable before a remote flush that
    /// has completed (a break-before-make break). Everything else frees through
    /// [`Self::complete_flush`].
    fn retire_flushed(&self, p: PendingFlush) {
        if p.graveyard.is_empty() {
            return;
        }
        super::rmap::Rmap::retire::<F::Clock>(&self.rmap, &self.alloc, p.graveyard);
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn handle_changed_spte(
        &self,
        gfn: Gfn,
        table: Hva,
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
        self.handle_changed_structure(gfn, table, old, new, level, sink, pending);
    }

    /// The rest of [`Self::handle_changed_spte`]: a leaf or table appeared or went away.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn handle_changed_structure(
        &self,
        gfn: Gfn,
        table: Hva,
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
                sink.dec::<F::Clock>(leaf_stat(level));
            }
            if new_leaf {
                sink.inc::<F::Clock>(leaf_stat(level));
            }
        }
        if self.rmap.enabled() {
            // After the compare-and-swap that published the leaf, before the caller's second
            // dirty mark (make writable → entry in the rmap → dirty bit). A leaf → leaf change
            // of the same level never gets here (`handle_changed_spte` returns first), and a
            // leaf replaced by another leaf of the same level keeps its slot.
            if old_leaf && !new_leaf {
                self.rmap.remove::<F::Clock>(gfn, level, table);
            }
            // Insertion happened before publication (`update_spte`, `replace_spte`).
        }
        let old_table = old_present && !old_leaf;
        let new_table = new_present && !new_leaf;
        if old_table && !(new_table && F::output_addr(new) == F::output_addr(old)) {
            // A table left the tree: its translations may be cached by hardware walkers.
            pending.require();
            self.unlink_table(F::output_addr(old), gfn, level - 1, sink, pending);
        }
        if new_table && !(old_table && F::output_addr(new) == F::output_addr(old)) {
            sink.inc::<F::Clock>(Stat::TablePages);
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
                sink.add::<F::Clock>(leaf_stat(level - 1), n);
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
    fn unlink_table(
        &self,
        addr: Hva,
        gfn: Gfn,
        level: Level,
        sink: Sink<'_>,
        pending: &mut PendingFlush,
    ) {
        // SAFETY: the table was reachable until our update, and its page is only freed through
        // `pending`, after this function returns.
        let t = unsafe { TablePage::at(addr) };
        let step = pages_per_entry(level);
        for (i, e) in t.entries.iter().enumerate() {
            let egfn = gfn.plus(i as u64 * step);
            let v = if F::BREAK_BEFORE_MAKE {
                freeze_after_make::<F>(e)
            } else {
                sync::swap_entry::<F::Clock>(e, F::FROZEN, Ordering::AcqRel)
            };
            if !F::is_present(v) {
                continue;
            }
            if F::is_leaf(v, level) {
                sink.dec::<F::Clock>(leaf_stat(level));
                if self.rmap.enabled() {
                    // After the freeze: a racing inserter of this leaf either already inserted
                    // (removed here) or is still pinned (cleared by `Rmap::retire`'s sweep).
                    self.rmap.remove::<F::Clock>(egfn, level, addr);
                }
            } else {
                self.unlink_table(F::output_addr(v), egfn, level - 1, sink, pending);
            }
        }
        sink.dec::<F::Clock>(Stat::TablePages);
        // SAFETY: unlinked above, and nobody else unlinks it (our update removed its only
        // parent entry).
        pending
            .graveyard
            .push(unsafe { OwnedTable::from_unlinked(addr) });
    }
}

/// Host address of the table page holding `sptep` (pages are 4 KiB-aligned arrays of entries).
#[inline(always)]
fn table_of(sptep: &AtomicU64) -> Hva {
    Hva::new(sptep as *const AtomicU64 as u64 & !(slat_addr::PAGE_SIZE - 1))
}

/// Freezes an entry of a table being unlinked, under break-before-make. A locked entry (the
/// value `F::FROZEN`) belongs to a breaker in [`Mmu::replace_spte`] whose make is a plain store:
/// swapping it to frozen now would let that store land in the dead table afterwards, and the
/// breaker would count a leaf nobody can ever unlink. So wait for the make, then freeze what it
/// published. The breaker is past its break, so it only has a flush (which never waits for us:
/// we are outside guest mode) and its cache maintenance left before it stores.
fn freeze_after_make<F: PteFormat>(e: &AtomicU64) -> u64 {
    loop {
        let mut v = e.load(Ordering::Acquire);
        if v == F::FROZEN {
            // The breaker's make is the only write that ends the wait.
            sync::spin_until::<F::Clock>(&[addr_of(e)], || {
                v = e.load(Ordering::Acquire);
                v != F::FROZEN
            });
        }
        if sync::cas_entry::<F::Clock>(e, v, F::FROZEN, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            return v;
        }
    }
}
