//! A set of guest pages (one bit per 4 KiB page of the test region), as the source's record of
//! what the destination does not have yet.

/// Pages `0..len` of the test region, one bit each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageSet {
    words: Vec<u64>,
    len: u64,
}

impl PageSet {
    /// The empty set over `len` pages.
    pub fn new(len: u64) -> PageSet {
        PageSet {
            words: vec![0; len.div_ceil(64) as usize],
            len,
        }
    }

    /// Every page.
    pub fn full(len: u64) -> PageSet {
        let mut s = PageSet::new(len);
        s.set_all();
        s
    }

    /// Pages the set ranges over.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// No page in range (a set over zero pages).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds every page.
    pub fn set_all(&mut self) {
        self.words.iter_mut().for_each(|w| *w = !0);
        self.trim();
    }

    /// Removes every page.
    pub fn clear_all(&mut self) {
        self.words.iter_mut().for_each(|w| *w = 0);
    }

    /// Adds page `p` (ignored past the end).
    #[inline]
    pub fn insert(&mut self, p: u64) {
        if p < self.len {
            self.words[(p / 64) as usize] |= 1 << (p % 64);
        }
    }

    /// Removes page `p`.
    #[inline]
    pub fn remove(&mut self, p: u64) {
        if p < self.len {
            self.words[(p / 64) as usize] &= !(1 << (p % 64));
        }
    }

    /// Whether page `p` is in the set.
    #[inline]
    pub fn contains(&self, p: u64) -> bool {
        p < self.len && self.words[(p / 64) as usize] & (1 << (p % 64)) != 0
    }

    /// Pages in the set.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// Adds the pages of a dirty bitmap whose bit 0 is page `first` (a multiple of 64, as the
    /// memslots' first pages are); returns how many bits were set in it.
    pub fn or_bitmap(&mut self, first: u64, bitmap: &[u64]) -> u64 {
        debug_assert_eq!(first % 64, 0);
        let base = (first / 64) as usize;
        let mut n = 0;
        let last = self.words.len().saturating_sub(1);
        let tail = self.len % 64;
        for (i, &w) in bitmap.iter().enumerate() {
            let k = base + i;
            // Bits past the end of the region are not pages.
            let w = if k == last && tail != 0 {
                w & ((1u64 << tail) - 1)
            } else {
                w
            };
            if w != 0 {
                if let Some(d) = self.words.get_mut(k) {
                    *d |= w;
                    n += w.count_ones() as u64;
                }
            }
        }
        n
    }

    /// Removes every page of `other` from this set.
    pub fn subtract(&mut self, other: &PageSet) {
        for (d, s) in self.words.iter_mut().zip(&other.words) {
            *d &= !s;
        }
    }

    /// Adds every page of `other`.
    pub fn union(&mut self, other: &PageSet) {
        for (d, s) in self.words.iter_mut().zip(&other.words) {
            *d |= s;
        }
        self.trim();
    }

    /// The pages in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut b = w;
            std::iter::from_fn(move || {
                if b == 0 {
                    return None;
                }
                let p = i as u64 * 64 + b.trailing_zeros() as u64;
                b &= b - 1;
                Some(p)
            })
        })
    }

    /// Clears the bits past `len` in the last word.
    fn trim(&mut self) {
        let tail = self.len % 64;
        if tail != 0 {
            if let Some(w) = self.words.last_mut() {
                *w &= (1u64 << tail) - 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_operations() {
        let mut s = PageSet::full(130);
        assert_eq!(s.count(), 130);
        s.remove(0);
        s.remove(129);
        s.remove(500);
        assert_eq!(s.count(), 128);
        assert!(!s.contains(0) && s.contains(1) && !s.contains(129) && !s.contains(130));
        let mut t = PageSet::new(130);
        assert_eq!(t.or_bitmap(64, &[0b101, !0]), 2 + 2);
        assert_eq!(t.iter().collect::<Vec<_>>(), vec![64, 66, 128, 129]);
        s.subtract(&t);
        assert_eq!(s.count(), 125);
        t.union(&s);
        assert_eq!(t.count(), 129);
        t.clear_all();
        assert_eq!(t.iter().count(), 0);
    }
}
