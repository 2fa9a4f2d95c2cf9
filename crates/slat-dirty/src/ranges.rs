//! Dirty bitmap → runs of dirty pages, a word at a time.
//!
//! Bit `p` of the bitmap (bit `p % 64` of word `p / 64`, as KVM lays it out on x86-64) is page
//! `p`. [`ranges`] yields each maximal run of set bits as `(first_page, pages)`. It never looks
//! at a bit on its own: zero words are skipped eight at a time (an OR of eight words, which the
//! compiler turns into vector loads), a run is found with `trailing_zeros`/`trailing_ones` of
//! the current word, and a run that fills whole words is extended eight all-ones words at a
//! time. Scanning a clean bitmap therefore costs about one vector load per 64 bytes, and a
//! fully dirty one the same, yielding a single run.

/// An iterator over the runs of set bits of a bitmap: `(first_page, pages)`, in order,
/// maximal (two runs never touch), `pages ≥ 1`.
#[derive(Debug, Clone)]
pub struct Ranges<'a> {
    /// The words that cover pages `0..pages`, the last one masked when read.
    words: &'a [u64],
    /// Pages covered: bits at or past this index are ignored.
    pages: u64,
    /// Index of the word `cur` came from.
    idx: usize,
    /// The bits of `words[idx]` not yet reported (masked to `pages`).
    cur: u64,
}

/// The runs of set bits among the first `pages` bits of `words`. Bits past `pages` are
/// ignored; missing words (a `words` shorter than `ceil(pages / 64)`) count as zero.
pub fn ranges(words: &[u64], pages: u64) -> Ranges<'_> {
    let need = pages.div_ceil(64);
    let n = usize::try_from(need).unwrap_or(usize::MAX).min(words.len());
    let words = &words[..n];
    let mut r = Ranges {
        words,
        pages,
        idx: 0,
        cur: 0,
    };
    r.cur = r.word(0);
    r
}

impl Ranges<'_> {
    /// Word `i`, masked to the pages covered (0 past the end).
    #[inline]
    fn word(&self, i: usize) -> u64 {
        let Some(&w) = self.words.get(i) else {
            return 0;
        };
        // Bits of word i that are pages < self.pages.
        let first = (i as u64) * 64;
        let left = self.pages - first; // > 0: i < ceil(pages / 64)
        if left >= 64 {
            w
        } else {
            w & ((1u64 << left) - 1)
        }
    }

    /// Moves `idx` to the next word holding a set bit and loads it into `cur`; false if none.
    #[inline]
    fn next_nonzero(&mut self) -> bool {
        loop {
            if self.cur != 0 {
                return true;
            }
            let mut i = self.idx + 1;
            // Eight words at a time while all are zero.
            while let Some(chunk) = self.words.get(i..i + 8) {
                if chunk.iter().fold(0, |a, &w| a | w) != 0 {
                    break;
                }
                i += 8;
            }
            while i < self.words.len() && self.words[i] == 0 {
                i += 1;
            }
            if i >= self.words.len() {
                self.idx = self.words.len();
                return false;
            }
            self.idx = i;
            self.cur = self.word(i);
        }
    }
}

impl Iterator for Ranges<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        if !self.next_nonzero() {
            return None;
        }
        let t = self.cur.trailing_zeros();
        let start = self.idx as u64 * 64 + u64::from(t);
        // Ones from bit t upwards in this word.
        let ones = (self.cur >> t).trailing_ones();
        if t + ones < 64 {
            // The run ends inside this word: drop its bits and report it.
            let run = ((1u64 << ones) - 1) << t;
            self.cur &= !run;
            return Some((start, u64::from(ones)));
        }
        // The run reaches the top of the word: extend it over the words that follow.
        let mut i = self.idx + 1;
        while let Some(chunk) = self.words.get(i..i + 8) {
            if chunk.iter().fold(u64::MAX, |a, &w| a & w) != u64::MAX {
                break;
            }
            i += 8;
        }
        while i < self.words.len() && self.word(i) == u64::MAX {
            i += 1;
        }
        // Word i (if any) is not all ones (masked): the run ends in its low ones.
        let w = self.word(i);
        let low = w.trailing_ones();
        let end = i as u64 * 64 + u64::from(low);
        self.idx = i;
        self.cur = if low == 64 {
            0
        } else {
            w & !((1u64 << low) - 1)
        };
        // The masked last word may hold ones only below `pages`, so `end ≤ pages` unless the
        // all-ones chunk test passed a last word whose high bits lie past `pages`.
        let end = end.min(self.pages);
        Some((start, end - start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples() {
        assert_eq!(ranges(&[], 0).count(), 0);
        assert_eq!(ranges(&[u64::MAX], 0).count(), 0);
        assert_eq!(ranges(&[0b1011], 64).collect::<Vec<_>>(), [(0, 2), (3, 1)]);
        assert_eq!(ranges(&[u64::MAX, 1], 65).collect::<Vec<_>>(), [(0, 65)]);
        assert_eq!(
            ranges(&[u64::MAX, u64::MAX], 70).collect::<Vec<_>>(),
            [(0, 70)]
        );
        assert_eq!(ranges(&[1 << 63, 1], 128).collect::<Vec<_>>(), [(63, 2)]);
        assert_eq!(
            ranges(&[u64::MAX; 20], 1280).collect::<Vec<_>>(),
            [(0, 1280)]
        );
        assert_eq!(
            ranges(&[u64::MAX; 20], 1270).collect::<Vec<_>>(),
            [(0, 1270)]
        );
    }
}
