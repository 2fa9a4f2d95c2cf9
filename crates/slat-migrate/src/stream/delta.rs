//! The delta encoding of a page ([`Encoding::Delta`](super::Encoding::Delta)): the runs of
//! bytes that differ from the copy the destination already holds (QEMU's XBZRLE idea, with
//! an encoding of slat's own).
//!
//! ```text
//! delta  run*            (at least one)
//! run    skip u16 | len u16 | bytes[len]
//! ```
//!
//! `skip` counts the unchanged bytes since the end of the previous run (or the start of the
//! page), `len` the changed bytes that follow (at least one). A run that would reach past the
//! page, a zero-length run and a run header cut short are [`DeltaError`]s: the page is left
//! as far as the runs before it got, and the caller discards the batch.
//!
//! A guest that writes a word into a page sends 4 bytes of run header and the word's changed
//! bytes instead of 4096: the transfer of such a page costs its read and compare on the
//! source and its patch on the destination, not a page through the kernel's socket copies.

use super::PAGE_BYTES;

/// Bytes of a run header.
const RUN_HEAD: usize = 4;
/// Bytes compared at once before looking for the differing words inside: equal blocks are
/// the common case, and a block compare is a vectorised `memcmp`.
const BLOCK: usize = 256;
/// A gap of unchanged bytes shorter than a run header costs less sent as part of one run.
const MERGE_GAP: usize = RUN_HEAD;

/// Why a delta cannot be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    /// A run header is cut short by the end of the entry.
    #[error("a run header at byte {at} is cut short")]
    Truncated {
        /// Where in the entry.
        at: usize,
    },
    /// A run with no bytes (which would let a frame carry headers without end).
    #[error("an empty run at byte {at}")]
    EmptyRun {
        /// Where in the entry.
        at: usize,
    },
    /// A run that ends past the page, or whose bytes are not all in the entry.
    #[error("a run of {len} bytes at page offset {offset} runs past the page or the entry")]
    PastPage {
        /// Page offset it starts at.
        offset: usize,
        /// Its length.
        len: usize,
    },
    /// An entry without a run.
    #[error("a delta without a run")]
    Empty,
    /// The base page is not one page.
    #[error("a base page of {len} bytes")]
    Base {
        /// Its length.
        len: usize,
    },
    /// A delta where no copy of the page is kept to apply it to (page streams and post-copy
    /// carry whole pages only).
    #[error("a delta where only whole pages may come")]
    NoBase,
    /// A delta the destination did not accept in its welcome.
    #[error("a delta, which this destination did not accept")]
    NotOffered,
}

/// Applies `delta` to `page` (the copy it was encoded against, one page long).
pub fn apply(delta: &[u8], page: &mut [u8]) -> Result<(), DeltaError> {
    if page.len() != PAGE_BYTES {
        return Err(DeltaError::Base { len: page.len() });
    }
    if delta.is_empty() {
        return Err(DeltaError::Empty);
    }
    let (mut at, mut pos) = (0usize, 0usize);
    while at < delta.len() {
        let Some(h) = delta.get(at..at + RUN_HEAD) else {
            return Err(DeltaError::Truncated { at });
        };
        let skip = u16::from_le_bytes([h[0], h[1]]) as usize;
        let len = u16::from_le_bytes([h[2], h[3]]) as usize;
        if len == 0 {
            return Err(DeltaError::EmptyRun { at });
        }
        // `pos <= PAGE_BYTES` and both u16s: no overflow.
        let offset = pos + skip;
        let bytes = delta.get(at + RUN_HEAD..at + RUN_HEAD + len);
        let (Some(bytes), Some(dst)) = (bytes, page.get_mut(offset..offset + len)) else {
            return Err(DeltaError::PastPage { offset, len });
        };
        dst.copy_from_slice(bytes);
        pos = offset + len;
        at += RUN_HEAD + len;
    }
    Ok(())
}

/// The page byte ranges of a delta's runs, up to the first malformed one (all of them, for a
/// delta [`apply`] accepted): what a patch wrote.
pub fn runs(delta: &[u8]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let (mut at, mut pos) = (0usize, 0usize);
    std::iter::from_fn(move || {
        let h = delta.get(at..at + RUN_HEAD)?;
        let skip = u16::from_le_bytes([h[0], h[1]]) as usize;
        let len = u16::from_le_bytes([h[2], h[3]]) as usize;
        let offset = pos + skip;
        if len == 0 || offset + len > PAGE_BYTES || at + RUN_HEAD + len > delta.len() {
            return None;
        }
        pos = offset + len;
        at += RUN_HEAD + len;
        Some(offset..pos)
    })
}

/// Encodes `page` against `base` (both one page) into `out`; returns the bytes written, or
/// `None` when the delta would not fit `out` (the page is then worth sending whole). An
/// unchanged page (the harvest said it was written, so it is sent) is one run rewriting its
/// first byte.
pub fn encode(base: &[u8], page: &[u8], out: &mut [u8]) -> Option<usize> {
    if base.len() != PAGE_BYTES || page.len() != PAGE_BYTES {
        return None;
    }
    let mut w = 0usize;
    // End of the last run written (page offset), and the run being grown: (start, end).
    let mut last_end = 0usize;
    let mut run: Option<(usize, usize)> = None;
    for (bi, (b, p)) in base
        .chunks_exact(BLOCK)
        .zip(page.chunks_exact(BLOCK))
        .enumerate()
    {
        if b == p {
            continue;
        }
        let words = b.chunks_exact(8).zip(p.chunks_exact(8)).enumerate();
        for (wi, (x, y)) in words.filter(|(_, (x, y))| x != y) {
            for (i, _) in x.iter().zip(y).enumerate().filter(|(_, (a, b))| a != b) {
                let o = bi * BLOCK + wi * 8 + i;
                run = match run {
                    Some((s, e)) if o - e < MERGE_GAP => Some((s, o + 1)),
                    Some((s, e)) => {
                        w = put_run(out, w, last_end, (s, e), page)?;
                        last_end = e;
                        Some((o, o + 1))
                    }
                    None => Some((o, o + 1)),
                };
            }
        }
    }
    let (s, e) = run.unwrap_or((0, 1));
    put_run(out, w, last_end, (s, e), page)
}

/// Writes the run `start..end` of `page` at `out[w..]`, `last_end` being where the previous
/// run ended; the new write position, or `None` if it does not fit.
fn put_run(
    out: &mut [u8],
    w: usize,
    last_end: usize,
    (start, end): (usize, usize),
    page: &[u8],
) -> Option<usize> {
    let len = end - start;
    let dst = out.get_mut(w..w + RUN_HEAD + len)?;
    // Both below a page (4096): they fit u16.
    dst[..2].copy_from_slice(&((start - last_end) as u16).to_le_bytes());
    dst[2..4].copy_from_slice(&(len as u16).to_le_bytes());
    dst[RUN_HEAD..].copy_from_slice(page.get(start..end)?);
    Some(w + RUN_HEAD + len)
}

#[cfg(test)]
mod tests {
    use super::super::{BatchBuilder, Compression, Encoding, FrameReader, Msg, DELTA_MAX};
    use super::*;
    use crate::error::PageError;
    use crate::source::cache::DeltaCache;
    use slat_addr::PageIndex;
    use std::time::Duration;

    fn noise(seed: u64) -> Vec<u8> {
        (0..PAGE_BYTES as u64)
            .map(|i| crate::guest::splitmix(i ^ (seed << 20)) as u8)
            .collect()
    }

    fn roundtrip(base: &[u8], page: &[u8]) -> Option<usize> {
        let mut out = vec![0u8; DELTA_MAX];
        let n = encode(base, page, &mut out)?;
        let mut got = base.to_vec();
        apply(&out[..n], &mut got).unwrap();
        assert_eq!(got, page, "the delta rebuilds the page");
        // The runs name every changed byte: storing only them rebuilds the page too.
        let mut stored = base.to_vec();
        for r in runs(&out[..n]) {
            stored[r.clone()].copy_from_slice(&page[r]);
        }
        assert_eq!(stored, page, "the runs cover the changes");
        Some(n)
    }

    #[test]
    fn a_page_changed_in_several_places_rebuilds_exactly() {
        let base = noise(1);
        let mut page = base.clone();
        // First and last byte, a word in a block, two bytes closer than a run header (one
        // run), two runs in one block, a whole block.
        for o in [0, 4095, 1000, 1001, 1002, 1003, 2048, 2051, 2060, 2100] {
            page[o] ^= 0x5a;
        }
        page[3072..3328].iter_mut().for_each(|b| *b = !*b);
        let n = roundtrip(&base, &page).unwrap();
        assert!(n < 400, "{n} bytes");
        // Unchanged: one run of the first byte.
        assert_eq!(roundtrip(&base, &base), Some(RUN_HEAD + 1));
        // Everything changed: too large for a delta.
        assert_eq!(roundtrip(&base, &noise(2)), None);
        for o in (0..PAGE_BYTES).step_by(97) {
            let mut one = base.clone();
            one[o] = one[o].wrapping_add(1);
            assert_eq!(roundtrip(&base, &one), Some(RUN_HEAD + 1), "offset {o}");
        }
    }

    #[test]
    fn hostile_deltas_are_typed_errors() {
        let mut page = vec![7u8; PAGE_BYTES];
        let run = |skip: u16, len: u16, n: usize| {
            let mut d = skip.to_le_bytes().to_vec();
            d.extend(len.to_le_bytes());
            d.extend(std::iter::repeat_n(1u8, n));
            d
        };
        let past = run(4095, 2, 2);
        assert_eq!(
            apply(&past, &mut page),
            Err(DeltaError::PastPage {
                offset: 4095,
                len: 2
            })
        );
        // The second run starts past the page: the skips add up.
        let mut two = run(4000, 1, 1);
        two.extend(run(u16::MAX, 1, 1));
        assert!(matches!(
            apply(&two, &mut page),
            Err(DeltaError::PastPage { .. })
        ));
        assert_eq!(
            apply(&run(0, 0, 0), &mut page),
            Err(DeltaError::EmptyRun { at: 0 })
        );
        assert_eq!(
            apply(&run(0, 8, 3), &mut page),
            Err(DeltaError::PastPage { offset: 0, len: 8 })
        );
        assert_eq!(
            apply(&[1, 0, 1], &mut page),
            Err(DeltaError::Truncated { at: 0 })
        );
        assert_eq!(apply(&[], &mut page), Err(DeltaError::Empty));
        assert_eq!(
            apply(&run(0, 1, 1), &mut [0u8; 8]),
            Err(DeltaError::Base { len: 8 })
        );
    }

    fn decode(frame: &[u8]) -> super::super::Batch {
        match FrameReader::new(frame, Duration::from_secs(1)).read_msg("test") {
            Ok(Msg::Pages(b)) => b,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn batches_send_deltas_against_the_cache_and_whole_pages_on_a_miss() {
        // Two slots for four pages: pages 0 and 2 share one.
        let mut cache = DeltaCache::new(2 * PAGE_BYTES as u64, 4);
        let mut b = BatchBuilder::new(Compression::None);
        let mut dest = [
            vec![0u8; PAGE_BYTES],
            vec![0u8; PAGE_BYTES],
            vec![0u8; PAGE_BYTES],
        ];
        // Each call is a round of its own.
        let mut round = 0u32;
        let mut send = |b: &mut BatchBuilder, pages: &[(u64, Vec<u8>)], want: &[Encoding]| {
            b.start(0, round);
            round += 1;
            for (p, data) in pages {
                let fill = |out: &mut [u8]| {
                    out.copy_from_slice(data);
                    Ok::<bool, ()>(data.iter().all(|&x| x == 0))
                };
                b.push_cached(PageIndex::new(*p), fill, |_, _| {}, &mut cache)
                    .unwrap();
            }
            let batch = decode(b.frame());
            let encs: Vec<Encoding> = batch.entries.iter().map(|e| e.1).collect();
            assert_eq!(encs, want);
            for (i, (p, data)) in pages.iter().enumerate() {
                let out = &mut dest[*p as usize];
                batch.patch_into(i, out).unwrap();
                assert_eq!(out, data, "page {p}");
            }
        };
        let (a, z) = (noise(3), vec![0u8; PAGE_BYTES]);
        let mut a2 = a.clone();
        a2[17] ^= 1;
        a2[900] ^= 2;
        let mut z2 = z.clone();
        z2[8] = 1;
        use Encoding::{Delta, Raw, Zero};
        send(&mut b, &[(0, a.clone()), (1, z.clone())], &[Raw, Zero]);
        send(&mut b, &[(0, a2.clone()), (1, z2.clone())], &[Delta, Delta]);
        // Page 2 evicts page 0's copy; page 0 then goes whole and takes it back.
        send(&mut b, &[(2, a.clone())], &[Raw]);
        send(&mut b, &[(0, a.clone())], &[Raw]);
        send(&mut b, &[(0, a2.clone())], &[Delta]);
        // In one round, the page sent first keeps the slot: page 2 goes whole and leaves
        // page 0's copy, which the next round still sends a delta against.
        send(&mut b, &[(0, a.clone()), (2, a2.clone())], &[Delta, Raw]);
        send(&mut b, &[(0, a2.clone())], &[Delta]);
        assert!(cache.hits == 5 && cache.misses == 4, "{cache:?}");
    }

    #[test]
    fn a_delta_without_a_base_is_refused_by_page_into() {
        let mut cache = DeltaCache::new(PAGE_BYTES as u64, 1);
        let mut b = BatchBuilder::new(Compression::None);
        let page = noise(4);
        for _ in 0..2 {
            b.start(0, 0);
            let fill = |out: &mut [u8]| {
                out.copy_from_slice(&page);
                Ok::<bool, ()>(false)
            };
            b.push_cached(PageIndex::new(0), fill, |_, _| {}, &mut cache)
                .unwrap();
        }
        let batch = decode(b.frame());
        let mut out = vec![0u8; PAGE_BYTES];
        assert_eq!(
            batch.page_into(0, &mut out),
            Err(PageError::Delta {
                page: 0,
                err: DeltaError::NoBase
            })
        );
    }
}
