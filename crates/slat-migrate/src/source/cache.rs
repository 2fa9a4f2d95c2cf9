//! The source's cache of sent pages, the base of each delta ([`crate::stream::delta`]).
//!
//! Direct-mapped: page `p` lives in slot `p % slots`, so a cache as large as the guest never
//! evicts. In a smaller one a page sent whole takes its slot unless the page there was
//! already sent in the same round: a guest sweeping more memory than the cache then keeps
//! the pages it reaches first as deltas round after round, where replacing on every miss
//! (QEMU's XBZRLE cache) would evict each copy before it is used and send every page whole.
//! A page whose copy was evicted goes whole. Its memory is bounded by the configured size
//! and allocated a chunk at a time as pages first arrive, fallibly: where the host cannot give
//! a chunk, its pages are not cached and go whole. A zero page is remembered by its tag alone.
//!
//! The cache lives for one attempt: a new attempt (whose destination may hold other copies)
//! starts it empty, so every base is a page this attempt's destination acknowledged or will
//! receive, in order, before the delta against it.

use crate::stream::PAGE_BYTES;

/// Pages per allocated chunk (2 MiB).
const CHUNK_PAGES: usize = 512;
/// A slot that holds nothing.
const EMPTY: u64 = u64::MAX;
/// Tag bit of a slot whose page was all zero (no bytes kept).
const ZERO: u64 = 1 << 62;

/// What the cache holds for a page.
pub(crate) enum Base<'a> {
    /// Nothing: the page goes whole.
    Miss,
    /// The page was sent all zero.
    Zero,
    /// The page as last sent.
    Page(&'a [u8]),
}

/// Sent pages by slot, with what became of the lookups ([`BatchBuilder::push_cached`]
/// encodes against it).
///
/// [`BatchBuilder::push_cached`]: crate::stream::BatchBuilder::push_cached
#[derive(Debug, Default)]
pub struct DeltaCache {
    /// Per slot: the page it holds (`EMPTY`, or the index with `ZERO` for a zero page).
    tags: Vec<u64>,
    /// Per slot: the round its page was last sent in.
    used: Vec<u32>,
    /// Per chunk of slots: their bytes, once allocated.
    chunks: Vec<Vec<u8>>,
    /// Chunks the host refused.
    pub refused: u64,
    /// Pages sent as deltas.
    pub hits: u64,
    /// Non-zero pages sent whole (not cached, evicted, or a delta no smaller).
    pub misses: u64,
}

impl DeltaCache {
    /// A cache of at most `bytes` of page copies for a guest of `pages` pages (no slots if
    /// either is too small for one page, or the host cannot give the slot table).
    pub fn new(bytes: u64, pages: u64) -> DeltaCache {
        let slots = (bytes / PAGE_BYTES as u64).min(pages);
        let slots = usize::try_from(slots).unwrap_or(0);
        let mut tags = Vec::new();
        if tags.try_reserve_exact(slots).is_err() {
            return DeltaCache::default();
        }
        tags.resize(slots, EMPTY);
        let mut used = Vec::new();
        if used.try_reserve_exact(slots).is_err() {
            return DeltaCache::default();
        }
        used.resize(slots, 0);
        let mut chunks = Vec::new();
        let n = slots.div_ceil(CHUNK_PAGES);
        if chunks.try_reserve_exact(n).is_err() {
            return DeltaCache::default();
        }
        chunks.resize_with(n, Vec::new);
        DeltaCache {
            tags,
            used,
            chunks,
            ..DeltaCache::default()
        }
    }

    /// Slots (0: the cache is off).
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.tags.len()
    }

    /// Bytes of page copies allocated so far.
    pub fn allocated(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }

    fn slot(&self, page: u64) -> Option<usize> {
        let n = self.tags.len() as u64;
        (n > 0).then(|| (page % n) as usize)
    }

    /// Bytes of slot `s`, if its chunk is allocated.
    fn bytes(&self, s: usize) -> Option<&[u8]> {
        let c = self.chunks.get(s / CHUNK_PAGES)?;
        let at = (s % CHUNK_PAGES) * PAGE_BYTES;
        c.get(at..at + PAGE_BYTES)
    }

    /// Bytes of slot `s`, allocating its chunk on first use (`None` if the host refuses).
    fn bytes_mut(&mut self, s: usize) -> Option<&mut [u8]> {
        let ci = s / CHUNK_PAGES;
        let slots = self.tags.len();
        let c = self.chunks.get_mut(ci)?;
        if c.is_empty() {
            // The last chunk holds only the slots left.
            let len = (slots - ci * CHUNK_PAGES).min(CHUNK_PAGES) * PAGE_BYTES;
            if c.try_reserve_exact(len).is_err() {
                self.refused += 1;
                return None;
            }
            c.resize(len, 0);
        }
        let at = (s % CHUNK_PAGES) * PAGE_BYTES;
        c.get_mut(at..at + PAGE_BYTES)
    }

    /// What the cache holds for `page`.
    pub(crate) fn base(&self, page: u64) -> Base<'_> {
        let Some(s) = self.slot(page) else {
            return Base::Miss;
        };
        match self.tags[s] {
            t if t == page => self.bytes(s).map_or(Base::Miss, Base::Page),
            t if t == page | ZERO => Base::Zero,
            _ => Base::Miss,
        }
    }

    /// `page` was sent whole as `data` in `round` (one page; `zero`: all zero bytes): it
    /// becomes the base of its next delta, evicting whatever held its slot unless that is
    /// another page sent in this round (then the slot is left as it is).
    pub(crate) fn put(&mut self, page: u64, data: &[u8], zero: bool, round: u32) {
        let Some(s) = self.slot(page) else {
            return;
        };
        let t = self.tags[s];
        if t != EMPTY && t & !ZERO != page && self.used[s] == round {
            return;
        }
        self.used[s] = round;
        if zero {
            self.tags[s] = page | ZERO;
            return;
        }
        self.tags[s] = EMPTY;
        if let Some(b) = self.bytes_mut(s) {
            if b.len() == data.len() {
                b.copy_from_slice(data);
                self.tags[s] = page;
            }
        }
    }

    /// `page` was sent in `round` as `delta` against its cached copy: the copy is patched to
    /// match (only the changed runs are written). A zero base is materialised first.
    pub(crate) fn patch(&mut self, page: u64, delta: &[u8], round: u32) {
        let Some(s) = self.slot(page) else {
            return;
        };
        self.used[s] = round;
        let was_zero = self.tags[s] == page | ZERO;
        self.tags[s] = EMPTY;
        let Some(b) = self.bytes_mut(s) else {
            return;
        };
        if was_zero {
            b.fill(0);
        }
        // The delta was just encoded against this copy: it applies.
        if crate::stream::delta::apply(delta, b).is_ok() {
            self.tags[s] = page;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_smaller_cache_evicts_by_slot() {
        let mut c = DeltaCache::new(2 * PAGE_BYTES as u64, 10);
        assert_eq!(c.slots(), 2);
        let a = vec![1u8; PAGE_BYTES];
        c.put(0, &a, false, 0);
        assert!(matches!(c.base(0), Base::Page(p) if p == &a[..]));
        c.put(2, &a, false, 0);
        assert!(
            matches!(c.base(0), Base::Page(_)),
            "page 0 was sent in this round"
        );
        assert!(matches!(c.base(2), Base::Miss));
        c.put(2, &a, false, 1);
        assert!(matches!(c.base(0), Base::Miss), "page 2 took page 0's slot");
        assert!(matches!(c.base(2), Base::Page(_)));
        // The same page sent whole again always replaces its copy.
        let b = vec![2u8; PAGE_BYTES];
        c.put(2, &b, false, 1);
        assert!(matches!(c.base(2), Base::Page(p) if p == &b[..]));
        c.put(3, &a, true, 1);
        assert!(matches!(c.base(3), Base::Zero));
        assert!(matches!(c.base(1), Base::Miss));
    }

    #[test]
    fn patch_of_a_zero_base_materialises_it() {
        let mut c = DeltaCache::new(PAGE_BYTES as u64 * 4, 4);
        c.put(1, &[0u8; PAGE_BYTES], true, 0);
        let mut page = vec![0u8; PAGE_BYTES];
        page[100] = 7;
        let mut d = vec![0u8; 64];
        let n = crate::stream::delta::encode(&[0u8; PAGE_BYTES], &page, &mut d).unwrap();
        c.patch(1, &d[..n], 1);
        assert!(matches!(c.base(1), Base::Page(p) if p == &page[..]));
        assert_eq!(c.allocated(), 4 * PAGE_BYTES as u64);
    }

    #[test]
    fn no_room_means_no_slots() {
        assert_eq!(DeltaCache::new(PAGE_BYTES as u64 - 1, 10).slots(), 0);
        assert_eq!(DeltaCache::new(1 << 30, 0).slots(), 0);
        let mut c = DeltaCache::new(0, 10);
        c.put(3, &[1u8; PAGE_BYTES], false, 0);
        assert!(matches!(c.base(3), Base::Miss));
    }
}
