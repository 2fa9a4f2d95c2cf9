//! Statistics: counters cheap enough to leave on.
//!
//! Fault-path counters live in per-vCPU blocks written only by their vCPU thread (a plain
//! load + store, no locked instruction, no shared cache line); operations run by the host use
//! one VM-wide block with atomic adds. A [`Stats`] snapshot sums the blocks. Gauges such as
//! "leaves mapped" are kept as wrapping deltas in every block, so a zap on the host that removes
//! leaves a vCPU installed still sums to the right value.

use crate::clock::Clock;
use crate::sync::{AtomicU64, Ordering};

/// Every counter the engine keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Stat {
    /// Faults fixed by the slow path (a new or upgraded mapping installed).
    PfFixed,
    /// Faults fixed by the lock-free fast path.
    PfFast,
    /// Faults that found the translation already fixed (by another vCPU, or a stale TLB entry).
    PfSpurious,
    /// Faults that lost a race and were retried by re-running the access.
    PfRetry,
    /// Faults on GPAs outside every memslot (MMIO exits).
    PfNoSlot,
    /// Write faults on read-only memslots.
    PfReadOnly,
    /// 4 KiB leaves mapped (gauge).
    Leaves4K,
    /// 2 MiB leaves mapped (gauge).
    Leaves2M,
    /// 1 GiB leaves mapped (gauge).
    Leaves1G,
    /// Table pages linked into the tree, root included (gauge).
    TablePages,
    /// Remote TLB flushes requested.
    FlushRequests,
    /// Remote TLB flushes performed (at least one vCPU had to be asked).
    Flushes,
    /// Huge leaves split into tables.
    Splits,
    /// Tables replaced by huge leaves.
    Recoveries,
    /// Pages marked dirty.
    DirtyMarked,
    /// Write faults refused because the vCPU's dirty ring was full.
    PfRingFull,
    /// Valid entries broken (invalidated and flushed) to change their output address or
    /// size (break-before-make).
    Breaks,
    /// Cache-maintenance passes over new mappings (data-cache clean, instruction-cache
    /// invalidate).
    CacheCleans,
    /// Bytes those passes covered.
    CacheCleanBytes,
    /// Dirty-bitmap words (summary levels included) that harvests loaded or exchanged.
    DirtyWordsRead,
}

const NSTATS: usize = Stat::DirtyWordsRead as usize + 1;

/// A block of counters, padded so two blocks never share a cache line.
#[repr(align(128))]
#[derive(Debug)]
pub struct Counters {
    v: [AtomicU64; NSTATS],
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            v: std::array::from_fn(|_| crate::sync::atomic_u64(0)),
        }
    }
}

impl Counters {
    /// Adds `delta` (two's complement for decrements) from any thread.
    #[inline]
    pub fn add_shared(&self, s: Stat, delta: u64) {
        self.add_shared_c::<crate::clock::RealTime>(s, delta)
    }

    /// [`Self::add_shared`], reported to clock `C` (a read-modify-write of a shared line).
    #[inline(always)]
    pub(crate) fn add_shared_c<C: Clock>(&self, s: Stat, delta: u64) {
        crate::sync::fetch_add::<C, _>(&self.v[s as usize], delta, Ordering::Relaxed);
    }

    /// Adds `delta` from the block's only writer: no locked instruction.
    #[inline]
    pub fn add_owned(&self, s: Stat, delta: u64) {
        let c = &self.v[s as usize];
        c.store(
            c.load(Ordering::Relaxed).wrapping_add(delta),
            Ordering::Relaxed,
        );
    }
}

/// Where an operation's bookkeeping goes: a vCPU's own block or the VM-wide block.
#[derive(Clone, Copy)]
pub(crate) enum Sink<'a> {
    Owned(&'a Counters),
    Shared(&'a Counters),
}

impl Sink<'_> {
    /// Adds `delta`; a shared block's add is reported to clock `C` (an owned block's is a
    /// plain store to the vCPU's own line).
    #[inline]
    pub(crate) fn add<C: Clock>(self, s: Stat, delta: u64) {
        match self {
            Sink::Owned(c) => c.add_owned(s, delta),
            Sink::Shared(c) => c.add_shared_c::<C>(s, delta),
        }
    }
    #[inline]
    pub(crate) fn inc<C: Clock>(self, s: Stat) {
        self.add::<C>(s, 1)
    }
    #[inline]
    pub(crate) fn dec<C: Clock>(self, s: Stat) {
        self.add::<C>(s, u64::MAX)
    }
}

/// The gauge for leaves at `level`.
pub(crate) fn leaf_stat(level: crate::format::Level) -> Stat {
    match level {
        1 => Stat::Leaves4K,
        2 => Stat::Leaves2M,
        _ => Stat::Leaves1G,
    }
}

/// A snapshot of a VM's statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Faults fixed by the slow path.
    pub pf_fixed: u64,
    /// Faults fixed by the lock-free fast path.
    pub pf_fast: u64,
    /// Faults that were already fixed.
    pub pf_spurious: u64,
    /// Faults retried after losing a race.
    pub pf_retry: u64,
    /// Faults outside every memslot.
    pub pf_no_slot: u64,
    /// Write faults on read-only memslots.
    pub pf_read_only: u64,
    /// 4 KiB leaves mapped.
    pub leaves_4k: u64,
    /// 2 MiB leaves mapped.
    pub leaves_2m: u64,
    /// 1 GiB leaves mapped.
    pub leaves_1g: u64,
    /// Table pages linked into the tree (root included).
    pub table_pages: u64,
    /// Bytes of linked table pages.
    pub table_bytes: u64,
    /// Table pages allocated and not freed: linked, cached per vCPU, or awaiting reclamation.
    pub table_pages_live: u64,
    /// Remote TLB flushes requested.
    pub remote_tlb_flush_requests: u64,
    /// Remote TLB flushes performed.
    pub remote_tlb_flush: u64,
    /// Huge leaves split.
    pub splits: u64,
    /// Tables collapsed into huge leaves.
    pub recoveries: u64,
    /// Pages marked dirty.
    pub dirty_marked: u64,
    /// Write faults refused because the vCPU's dirty ring was full.
    pub pf_ring_full: u64,
    /// Valid entries broken to change their output address or size (break-before-make).
    pub bbm_breaks: u64,
    /// Cache-maintenance passes over new mappings.
    pub cache_cleans: u64,
    /// Bytes those passes covered.
    pub cache_clean_bytes: u64,
    /// Dirty-bitmap words (summary levels included) that GET and CLEAR loaded or exchanged:
    /// what a harvest's cost in the bitmap follows (the dirty words, not the slot's size).
    pub dirty_words_read: u64,
}

impl Stats {
    pub(crate) fn sum<'a>(blocks: impl Iterator<Item = &'a Counters>, live: u64) -> Stats {
        let mut t = [0u64; NSTATS];
        for b in blocks {
            for (i, slot) in t.iter_mut().enumerate() {
                *slot = slot.wrapping_add(b.v[i].load(Ordering::Relaxed));
            }
        }
        let g = |s: Stat| t[s as usize];
        Stats {
            pf_fixed: g(Stat::PfFixed),
            pf_fast: g(Stat::PfFast),
            pf_spurious: g(Stat::PfSpurious),
            pf_retry: g(Stat::PfRetry),
            pf_no_slot: g(Stat::PfNoSlot),
            pf_read_only: g(Stat::PfReadOnly),
            leaves_4k: g(Stat::Leaves4K),
            leaves_2m: g(Stat::Leaves2M),
            leaves_1g: g(Stat::Leaves1G),
            table_pages: g(Stat::TablePages),
            table_bytes: g(Stat::TablePages) * slat_addr::PAGE_SIZE,
            table_pages_live: live,
            remote_tlb_flush_requests: g(Stat::FlushRequests),
            remote_tlb_flush: g(Stat::Flushes),
            splits: g(Stat::Splits),
            recoveries: g(Stat::Recoveries),
            dirty_marked: g(Stat::DirtyMarked),
            pf_ring_full: g(Stat::PfRingFull),
            bbm_breaks: g(Stat::Breaks),
            cache_cleans: g(Stat::CacheCleans),
            cache_clean_bytes: g(Stat::CacheCleanBytes),
            dirty_words_read: g(Stat::DirtyWordsRead),
        }
    }
}
