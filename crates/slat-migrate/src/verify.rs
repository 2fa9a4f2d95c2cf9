//! Switch-over verification: BLAKE3 hashes of fixed ranges of guest memory.
//!
//! The source hashes all of its memory *after* its vCPUs stopped and the destination compares
//! each hash with its own memory, so the check is independent of the dirty log: a page the
//! log failed to report, a page lost with a broken connection, or a page corrupted on the way
//! all show up as a differing range. A range is [`RANGE_PAGES`] pages: per-page hashes would
//! cost 8 MiB of stream per GiB, while 256 KiB ranges cost 128 KiB and hash at BLAKE3's
//! multi-chunk speed. Each hash is keyed by the range index, so a range landing at the wrong
//! place cannot match by accident.

/// Pages per verification range.
pub const RANGE_PAGES: u32 = 64;

/// The hash of range `index` with contents `bytes`.
pub fn hash_range(index: u64, bytes: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&index.to_le_bytes());
    h.update(bytes);
    *h.finalize().as_bytes()
}

/// Ranges covering `pages` pages.
pub fn ranges(pages: u64, range_pages: u32) -> u64 {
    pages.div_ceil(range_pages.max(1) as u64)
}

/// Pages `first..end` of range `index`, clipped to `pages` (an index past the end gives an
/// empty range at `pages`).
pub fn range_pages(index: u64, range_pages: u32, pages: u64) -> (u64, u64) {
    let first = index.saturating_mul(range_pages as u64).min(pages);
    (first, first.saturating_add(range_pages as u64).min(pages))
}

/// The outcome the destination reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Ranges compared.
    pub ranges: u64,
    /// Pages per range.
    pub range_pages: u32,
    /// Ranges that differed, or for which no hash arrived.
    pub mismatched: u64,
    /// The first differing ranges.
    pub first: Vec<u64>,
}

impl VerifyReport {
    /// Every range matched.
    pub fn ok(&self) -> bool {
        self.mismatched == 0 && self.ranges != 0
    }

    /// "pages a..b, c..d" of the first differing ranges.
    pub fn describe_first(&self) -> String {
        if self.first.is_empty() {
            return String::new();
        }
        let v: Vec<String> = self
            .first
            .iter()
            .map(|&r| {
                // The indexes may come from the peer: no overflow whatever they are.
                let a = r.saturating_mul(self.range_pages as u64);
                format!("pages {a}..{}", a.saturating_add(self.range_pages as u64))
            })
            .collect();
        format!(" (first: {})", v.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_depend_on_index_and_contents() {
        let a = vec![0u8; 4096];
        let mut b = a.clone();
        b[4095] = 1;
        assert_ne!(hash_range(0, &a), hash_range(1, &a));
        assert_ne!(hash_range(0, &a), hash_range(0, &b));
        assert_eq!(hash_range(3, &b), hash_range(3, &b));
        assert_eq!(ranges(130, 64), 3);
        assert_eq!(range_pages(2, 64, 130), (128, 130));
        assert_eq!(range_pages(u64::MAX, 64, 130), (130, 130));
    }

    #[test]
    fn describing_hostile_range_indexes_does_not_overflow() {
        let v = VerifyReport {
            ranges: 1,
            range_pages: RANGE_PAGES,
            mismatched: 1,
            first: vec![u64::MAX, 1 << 60],
        };
        assert!(v.describe_first().contains(&u64::MAX.to_string()));
    }
}
