//! A vCPU's software TLB: direct-mapped arrays of cached leaf translations per page size, and
//! a one-entry paging-structure cache.
//!
//! The translation arrays cache only leaves. The paging-structure cache remembers the last
//! leaf table the walker reached (x86's PDE cache, SDM 4.10.3), so a walk of a neighbouring
//! page reads one entry instead of four. Both are emptied by a flush, so a remote flush is
//! enough for unlinked tables to become unreachable to this vCPU (invariant 2: no table is
//! freed before the flush), and the walker drops the structure cache on every fault, as
//! hardware does, so a stale table never hides a fix made in a new one. A hit that lacks the
//! permission an access needs is treated as a miss (hardware re-walks before it reports a
//! fault), so a stale read-only entry never causes a spurious exit.

use slat::hw::pages_per_entry;
use slat::Level;

/// Default 4 KiB entries: the order of a modern x86 second-level TLB (1536–2048 entries).
pub const DEFAULT_TLB_ENTRIES: usize = 2048;
/// Most 4 KiB entries a TLB may have: 2^20 (16 MiB of entries per vCPU), far beyond any
/// hardware TLB, small enough that a vCPU per thread cannot exhaust memory by accident.
pub const MAX_TLB_ENTRIES: usize = 1 << 20;
const HUGE_2M_ENTRIES: usize = 32;
const HUGE_1G_ENTRIES: usize = 4;

const EMPTY: u64 = u64::MAX;
const WRITABLE: u64 = 1;
/// In a tag: the translation was made for private accesses (SNP tags TLB entries with the
/// C-bit, so a shared access never hits a private translation, nor the reverse). Above any
/// GFN, below bit 63, so no tag equals [`EMPTY`]; in the tag rather than beside it so a hit
/// costs one comparison, as before private memory existed.
const PRIVATE_TAG: u64 = 1 << 62;

/// The tag of `first_gfn`'s translation for accesses of this kind.
#[inline(always)]
fn key(first_gfn: u64, private: bool) -> u64 {
    first_gfn | (private as u64) << 62
}

#[derive(Clone, Copy)]
struct Entry {
    /// First GFN the entry covers (with [`PRIVATE_TAG`] for a private translation), or EMPTY.
    tag: u64,
    /// Host address of the page (aligned to its size), bit 0 = writable.
    host: u64,
}

const EMPTY_ENTRY: Entry = Entry {
    tag: EMPTY,
    host: 0,
};

/// Why a TLB could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TlbError {
    /// The entry count is not a power of two from 1 to [`MAX_TLB_ENTRIES`]: the index is the
    /// GFN masked by `entries - 1`.
    #[error("a TLB needs a power of two of 4 KiB entries from 1 to {MAX_TLB_ENTRIES}, not {0}")]
    Entries(usize),
    /// The entries could not be allocated.
    #[error("cannot allocate a TLB of {0} entries")]
    Alloc(usize),
}

/// The TLB.
pub struct Tlb {
    small: Box<[Entry]>,
    mid: [Entry; HUGE_2M_ENTRIES],
    large: [Entry; HUGE_1G_ENTRIES],
    mask: usize,
    /// A huge entry was inserted since the last flush (else skip those arrays on a miss).
    has_huge: bool,
    /// Paging-structure cache: (GFN >> 9, address of the leaf table mapping that 2 MiB).
    leaf_table: Option<(u64, u64)>,
    /// Lookups that missed.
    pub misses: u64,
    /// Full flushes performed.
    pub flushes: u64,
}

impl Tlb {
    /// A TLB with `entries` 4 KiB entries (a power of two from 1 to [`MAX_TLB_ENTRIES`]).
    pub fn new(entries: usize) -> Result<Tlb, TlbError> {
        Self::check_entries(entries)?;
        let mut small = Vec::new();
        small
            .try_reserve_exact(entries)
            .map_err(|_| TlbError::Alloc(entries))?;
        small.resize(entries, EMPTY_ENTRY);
        Ok(Tlb {
            small: small.into_boxed_slice(),
            mid: [EMPTY_ENTRY; HUGE_2M_ENTRIES],
            large: [EMPTY_ENTRY; HUGE_1G_ENTRIES],
            mask: entries - 1,
            has_huge: false,
            leaf_table: None,
            misses: 0,
            flushes: 0,
        })
    }

    /// Whether [`Tlb::new`] accepts `entries` (before anything is allocated for it).
    pub fn check_entries(entries: usize) -> Result<(), TlbError> {
        if !entries.is_power_of_two() || entries > MAX_TLB_ENTRIES {
            return Err(TlbError::Entries(entries));
        }
        Ok(())
    }

    /// Host address for `gfn` if cached with the needed permission, for an access of this
    /// kind (`private`).
    #[inline]
    pub fn lookup(&mut self, gfn: u64, write: bool, private: bool) -> Option<u64> {
        let e = self.small[(gfn as usize) & self.mask];
        if e.tag == key(gfn, private) && (!write || e.host & WRITABLE != 0) {
            return Some(e.host & !WRITABLE);
        }
        if self.has_huge {
            return self.lookup_huge(gfn, write, private);
        }
        self.misses += 1;
        None
    }

    #[inline]
    fn lookup_huge(&mut self, gfn: u64, write: bool, private: bool) -> Option<u64> {
        for (shift, arr) in [(9u32, &self.mid[..]), (18u32, &self.large[..])] {
            let base = gfn >> shift << shift;
            let e = arr[((gfn >> shift) as usize) & (arr.len() - 1)];
            if e.tag == key(base, private) && (!write || e.host & WRITABLE != 0) {
                return Some((e.host & !WRITABLE) + ((gfn - base) << 12));
            }
        }
        self.misses += 1;
        None
    }

    /// Caches a leaf at `level` mapping `gfn`'s page at host address `host` (aligned), for
    /// accesses of one kind (`private`).
    #[inline]
    pub fn insert(&mut self, gfn: u64, level: Level, host: u64, writable: bool, private: bool) {
        let n = pages_per_entry(level);
        let tag = gfn & !(n - 1);
        let e = Entry {
            tag: key(tag, private),
            host: host | if writable { WRITABLE } else { 0 },
        };
        self.has_huge |= level > 1;
        match level {
            1 => self.small[(gfn as usize) & self.mask] = e,
            2 => self.mid[((gfn / n) as usize) & (HUGE_2M_ENTRIES - 1)] = e,
            _ => self.large[((gfn / n) as usize) & (HUGE_1G_ENTRIES - 1)] = e,
        }
    }

    /// The cached leaf table covering `gfn`, if any.
    #[inline]
    pub fn leaf_table(&self, gfn: u64) -> Option<u64> {
        match self.leaf_table {
            Some((tag, t)) if tag == gfn >> 9 => Some(t),
            _ => None,
        }
    }

    /// Remembers that `table` is the leaf table mapping `gfn`'s 2 MiB.
    #[inline]
    pub fn insert_leaf_table(&mut self, gfn: u64, table: u64) {
        self.leaf_table = Some((gfn >> 9, table));
    }

    /// Forgets the paging-structure cache (on a fault, as hardware does).
    #[inline]
    pub fn drop_leaf_table(&mut self) {
        self.leaf_table = None;
    }

    /// Another entry of a different size also translates `gfn`: inserting a level-`level`
    /// entry for it now would make a lookup hit twice. Arm64 raises a TLB conflict abort for
    /// that (the reason break-before-make exists); x86 tolerates it. Checks only `gfn`'s own
    /// slots, so it costs a few loads.
    #[inline]
    pub fn conflicts(&self, gfn: u64, level: Level) -> bool {
        // A translation of either kind counts: the kind bit is stripped.
        let untag = |t: u64| if t == EMPTY { EMPTY } else { t & !PRIVATE_TAG };
        let small = level != 1 && untag(self.small[(gfn as usize) & self.mask].tag) == gfn;
        if small || !self.has_huge {
            return small;
        }
        [(2u8, 9u32, &self.mid[..]), (3, 18, &self.large[..])]
            .iter()
            .any(|&(l, shift, arr)| {
                l != level
                    && untag(arr[((gfn >> shift) as usize) & (arr.len() - 1)].tag)
                        == gfn >> shift << shift
            })
    }

    /// Drops every entry.
    pub fn flush(&mut self) {
        self.leaf_table = None;
        self.small.fill(EMPTY_ENTRY);
        self.mid = [EMPTY_ENTRY; HUGE_2M_ENTRIES];
        self.large = [EMPTY_ENTRY; HUGE_1G_ENTRIES];
        self.has_huge = false;
        self.flushes += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_counts_are_checked() {
        for bad in [0, 3, MAX_TLB_ENTRIES * 2, usize::MAX] {
            assert_eq!(Tlb::new(bad).err(), Some(TlbError::Entries(bad)));
        }
        let mut t = Tlb::new(1).unwrap();
        t.insert(5, 1, 0x1000_0000, false, false);
        assert_eq!(t.lookup(5, false, false), Some(0x1000_0000));
    }

    #[test]
    fn hit_miss_permissions_and_flush() {
        let mut t = Tlb::new(16).unwrap();
        assert_eq!(t.lookup(5, false, false), None);
        t.insert(5, 1, 0x1000_0000, false, false);
        assert_eq!(t.lookup(5, false, false), Some(0x1000_0000));
        assert_eq!(
            t.lookup(5, true, false),
            None,
            "read-only entry must not satisfy a write"
        );
        assert_eq!(
            t.lookup(21, false, false),
            None,
            "aliasing index must compare the tag"
        );
        t.insert(512 + 7, 2, 0x4000_0000, true, false);
        assert_eq!(t.lookup(512 + 9, true, false), Some(0x4000_0000 + 9 * 4096));
        t.flush();
        assert_eq!(t.lookup(5, false, false), None);
        assert_eq!(t.lookup(512 + 9, true, false), None);
    }

    #[test]
    fn a_translation_serves_only_accesses_of_its_kind() {
        let mut t = Tlb::new(16).unwrap();
        t.insert(5, 1, 0x1000_0000, true, true);
        assert_eq!(t.lookup(5, true, true), Some(0x1000_0000));
        assert_eq!(t.lookup(5, false, true), Some(0x1000_0000));
        assert_eq!(
            t.lookup(5, false, false),
            None,
            "shared read, private entry"
        );
        assert_eq!(
            t.lookup(5, true, false),
            None,
            "shared write, private entry"
        );
        t.insert(512 + 7, 2, 0x4000_0000, false, false);
        assert_eq!(
            t.lookup(512 + 9, false, true),
            None,
            "private read, shared entry"
        );
        assert_eq!(
            t.lookup(512 + 9, false, false),
            Some(0x4000_0000 + 9 * 4096)
        );
    }

    #[test]
    fn conflicts_are_entries_of_another_size_for_the_same_page() {
        let mut t = Tlb::new(16).unwrap();
        t.insert(512 + 7, 2, 0x4000_0000, false, false);
        assert!(
            t.conflicts(512 + 9, 1),
            "a 4 KiB entry under a cached 2 MiB one"
        );
        assert!(!t.conflicts(512 + 9, 2), "same size replaces, no conflict");
        assert!(!t.conflicts(1024 + 9, 1), "another 2 MiB");
        t.insert(5, 1, 0x1000_0000, false, false);
        assert!(t.conflicts(5, 2) && t.conflicts(5, 3));
        assert!(!t.conflicts(6, 2));
        t.flush();
        assert!(!t.conflicts(512 + 9, 1) && !t.conflicts(5, 2));
    }

    #[test]
    fn structure_cache_covers_one_leaf_table_until_flush_or_drop() {
        let mut t = Tlb::new(16).unwrap();
        t.insert_leaf_table(1024 + 3, 0x5000);
        assert_eq!(t.leaf_table(1024 + 511), Some(0x5000));
        assert_eq!(
            t.leaf_table(1024 + 512),
            None,
            "next 2 MiB is another table"
        );
        t.flush();
        assert_eq!(t.leaf_table(1024), None);
        t.insert_leaf_table(7, 0x6000);
        t.drop_leaf_table();
        assert_eq!(t.leaf_table(7), None);
    }
}
