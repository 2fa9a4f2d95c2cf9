//! Switch-over verification: 256-bit XXH3-based hashes of fixed ranges of guest memory, in
//! one of two modes ([`VerifyMode`]).
//!
//! **`Sent` (the default): off the paused path.** Each side keeps a digest per page of what
//! crossed the wire: the source of the bytes it put into a batch (copied out of guest memory,
//! hashed as they are sent), the destination of the bytes it wrote into guest memory
//! (hashed as they arrive). Pre-copy does this hashing while the guest runs, and both
//! sides fold the digests into range hashes ([`hash_digests`]) at the end of every round
//! ([`Digests`] caches them); at the switch-over only the final round's pages and the ranges
//! they touched are hashed, then all range hashes are compared. A page never sent
//! has the digest [`NEVER_SENT`] on the source and [`NEVER_RECEIVED`] on the destination, so it
//! differs.
//!
//! *The guarantee.* If every range matches, every page of the destination holds exactly the
//! bytes of the source's last send of that page (no page lost, corrupted, misplaced, left
//! over from a broken attempt, or forgotten by the merge-back). And the last send of each
//! page equals the source's memory at the pause: a page read for sending while the guest ran
//! was write-protected by the harvest before the read (invariant 4), so any write that lands
//! after the read — or during it, tearing the copy — is in the dirty log and the page is sent
//! again by a later round, at the latest the stop-and-copy round after the final harvest,
//! which reads it with the vCPUs stopped. Read-only regions cannot be written by the guest.
//! This leans on the dirty log; `Full` does not.
//!
//! **`Full`: independent of the dirty log.** The source hashes all of its memory *after* its
//! vCPUs stopped and the destination compares each hash with its own memory: a page the log
//! failed to report shows up too (a broken harvest, `Faults::skip_final_harvest`), at the price
//! of hashing all memory on both sides while the guest is paused.
//!
//! A range is [`RANGE_PAGES`] pages: per-page hashes on the wire would cost 8 MiB of stream
//! per GiB, while 256 KiB ranges cost 128 KiB. Each hash is keyed by the range index, so a
//! range landing at the wrong place cannot match by accident.

/// How the switch-over verifies memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VerifyMode {
    /// Hash all memory on both sides with the vCPUs paused (independent of the dirty log).
    Full,
    /// Hash pages as they are sent and received; compare digests at the switch-over.
    #[default]
    Sent,
}

impl VerifyMode {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            VerifyMode::Full => "full",
            VerifyMode::Sent => "sent",
        }
    }
}

/// A page's digest (XXH3-128: 16 bytes per 4 KiB page).
pub type PageDigest = [u8; 16];

/// The source's digest of a page it has not sent.
pub const NEVER_SENT: PageDigest = [0; 16];
/// The destination's digest of a page it has not received.
pub const NEVER_RECEIVED: PageDigest = [0xff; 16];

/// The digest of one page's bytes: XXH3-128. The per-page digests are computed on the send
/// and receive paths of every page, so their cost is migration bandwidth: on this project's
/// 2-core host BLAKE3 hashes 4 KiB pages at 2.8 GB/s and XXH3-128 at 17 GB/s, and with BLAKE3
/// pre-copy ran at a quarter of the link's speed. What they guard against is a page lost,
/// misplaced or corrupted by a bug or the link, not an adversary (the stream is not
/// authenticated; `--verify full` hashes all of memory while paused), and an
/// accidental 128-bit collision is as unlikely as a cryptographic one. The range hashes over
/// the digests are XXH3 too ([`hash_digests`]). A zero page — half of a typical guest —
/// costs an OR-reduce instead of a hash.
pub fn page_digest(bytes: &[u8]) -> PageDigest {
    // OR-reduce rather than an early-exit scan: it vectorises.
    let zero =
        bytes.len() == crate::stream::PAGE_BYTES && bytes.iter().fold(0u8, |a, &b| a | b) == 0;
    page_digest_known(bytes, zero)
}

/// [`page_digest`] of a page whose zeroness the caller found while copying it (`zero`: one
/// page of zero bytes), so the send and receive paths do not scan it again. A wrong `zero`
/// gives a wrong digest, which verification reports as a mismatch.
pub fn page_digest_known(bytes: &[u8], zero: bool) -> PageDigest {
    static ZERO: std::sync::OnceLock<PageDigest> = std::sync::OnceLock::new();
    let hash = |b: &[u8]| xxhash_rust::xxh3::xxh3_128(b).to_le_bytes();
    if zero {
        return *ZERO.get_or_init(|| hash(&[0u8; crate::stream::PAGE_BYTES]));
    }
    hash(bytes)
}

/// 256 bits from two XXH3-128 streams with different seeds over the same input. Like the page
/// digests these guard against bugs and a faulty link, not an adversary (the stream is not
/// authenticated), so a cryptographic hash would buy nothing; XXH3 keeps the library's
/// dependencies to the one hash crate the page digests already need.
fn hash256(parts: &[&[u8]]) -> [u8; 32] {
    use xxhash_rust::xxh3::Xxh3;
    const SEEDS: [u64; 2] = [0x736c_6174_7665_7231, 0x736c_6174_7665_7232];
    let mut out = [0u8; 32];
    for (half, seed) in out.chunks_exact_mut(16).zip(SEEDS) {
        let mut h = Xxh3::with_seed(seed);
        for p in parts {
            h.update(p);
        }
        half.copy_from_slice(&h.digest128().to_le_bytes());
    }
    out
}

/// The hash of range `index` from its pages' digests.
pub fn hash_digests(index: u64, digests: &[PageDigest]) -> [u8; 32] {
    // One contiguous input (tag, index, digests) so the result does not depend on how it is
    // split into updates.
    let mut buf = Vec::with_capacity(12 + std::mem::size_of_val(digests));
    buf.extend_from_slice(b"sent");
    buf.extend_from_slice(&index.to_le_bytes());
    for d in digests {
        buf.extend_from_slice(d);
    }
    hash256(&[&buf])
}

/// Pages per verification range.
pub const RANGE_PAGES: u32 = 64;

/// The hash of range `index` with contents `bytes`.
pub fn hash_range(index: u64, bytes: &[u8]) -> [u8; 32] {
    hash256(&[&index.to_le_bytes(), bytes])
}

/// Page digests of a guest, with their range hashes cached: a range is re-hashed only after
/// one of its pages changed, so refreshing at the end of every round (the guest running)
/// leaves the switch-over only the ranges the final round touched.
#[derive(Debug, Clone, Default)]
pub struct Digests {
    pages: Vec<PageDigest>,
    ranges: Vec<[u8; 32]>,
    stale: Vec<bool>,
}

impl Digests {
    /// `pages` digests of `fill`, every range to be hashed. Crate-only: sized from guest
    /// memory that exists (the source's map, or the destination's, checked against the
    /// host's memory before), never from a bare count.
    pub(crate) fn new(pages: usize, fill: PageDigest) -> Digests {
        let n = pages.div_ceil(RANGE_PAGES as usize);
        Digests {
            pages: vec![fill; pages],
            ranges: vec![[0; 32]; n],
            stale: vec![true; n],
        }
    }

    /// Pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// No pages.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Page `p`'s digest (`None` past the end).
    pub fn get(&self, p: u64) -> Option<PageDigest> {
        self.pages.get(usize::try_from(p).ok()?).copied()
    }

    /// Sets page `p`'s digest (a page past the end is ignored: callers check indexes first).
    pub fn set(&mut self, p: u64, d: PageDigest) {
        if let Some(x) = self.pages.get_mut(p as usize) {
            *x = d;
            self.stale[p as usize / RANGE_PAGES as usize] = true;
        }
    }

    /// Hashes every range whose pages changed; returns how many.
    pub fn refresh(&mut self) -> usize {
        let mut n = 0;
        for (i, stale) in self.stale.iter_mut().enumerate().filter(|(_, s)| **s) {
            let a = i * RANGE_PAGES as usize;
            let b = (a + RANGE_PAGES as usize).min(self.pages.len());
            self.ranges[i] = hash_digests(i as u64, &self.pages[a..b]);
            *stale = false;
            n += 1;
        }
        n
    }

    /// The hash of range `i` (refreshed first if needed), `None` past the end.
    pub fn range(&mut self, i: u64) -> Option<[u8; 32]> {
        let i = usize::try_from(i).ok().filter(|&i| i < self.ranges.len())?;
        if self.stale[i] {
            let a = i * RANGE_PAGES as usize;
            let b = (a + RANGE_PAGES as usize).min(self.pages.len());
            self.ranges[i] = hash_digests(i as u64, &self.pages[a..b]);
            self.stale[i] = false;
        }
        Some(self.ranges[i])
    }
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
    fn page_digests_of_zero_pages_are_the_hash_of_zeros() {
        let z = vec![0u8; 4096];
        let mut one = z.clone();
        one[4095] = 1;
        assert_eq!(
            page_digest(&z),
            xxhash_rust::xxh3::xxh3_128(&z).to_le_bytes()
        );
        assert_ne!(page_digest(&z), page_digest(&one));
        assert_ne!(page_digest(&z), NEVER_SENT);
        assert_ne!(page_digest(&z), NEVER_RECEIVED);
        assert_ne!(
            hash_digests(0, &[NEVER_SENT]),
            hash_digests(0, &[NEVER_RECEIVED])
        );
    }

    #[test]
    fn cached_range_hashes_follow_their_pages() {
        let mut d = Digests::new(130, NEVER_SENT);
        let fresh = |d: &Digests, i: u64| {
            let (a, b) = range_pages(i, RANGE_PAGES, 130);
            hash_digests(i, &d.pages[a as usize..b as usize])
        };
        assert_eq!(d.refresh(), 3);
        assert_eq!(d.refresh(), 0);
        d.set(129, [7; 16]);
        d.set(1000, [7; 16]);
        assert_eq!(d.range(2), Some(fresh(&d, 2)));
        assert_eq!(d.refresh(), 0, "range() refreshed it");
        d.set(5, [1; 16]);
        assert_eq!(d.refresh(), 1);
        for i in 0..3 {
            assert_eq!(d.range(i), Some(fresh(&d, i)));
        }
        assert_eq!(d.range(3), None);
        assert_eq!(d.range(u64::MAX), None);
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
