//! Bitmap → ranges against a bit-by-bit reference, on random bitmaps with runs that start and
//! end at word edges and at the slot's last page.

use proptest::prelude::*;
use slat_dirty::ranges;

/// The reference: look at every bit.
fn reference(words: &[u64], pages: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for p in 0..pages {
        let w = words.get((p / 64) as usize).copied().unwrap_or(0);
        if w >> (p % 64) & 1 == 1 {
            match out.last_mut() {
                Some((s, n)) if *s + *n == p => *n += 1,
                _ => out.push((p, 1)),
            }
        }
    }
    out
}

/// Words biased towards the interesting ones: all zero, all ones, single edge bits, random.
fn word() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => Just(0u64),
        3 => Just(u64::MAX),
        1 => Just(1u64),
        1 => Just(1u64 << 63),
        1 => Just(!1u64),
        1 => Just(!(1u64 << 63)),
        1 => (0u32..64).prop_map(|n| u64::MAX >> n),
        1 => (0u32..64).prop_map(|n| u64::MAX << n),
        2 => any::<u64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn matches_the_bit_by_bit_reference(
        words in prop::collection::vec(word(), 0..40),
        // Pages: anywhere from 0 to past the bitmap's end (missing words count as zero).
        extra in 0u64..200,
        cut in 0u64..64,
    ) {
        let full = words.len() as u64 * 64;
        // A slot ending inside the last word, at it, or beyond the words given.
        let pages = (full + extra).saturating_sub(cut);
        let got: Vec<_> = ranges(&words, pages).collect();
        prop_assert_eq!(&got, &reference(&words, pages));
        // Runs are maximal, non-empty, in order, inside the slot.
        for w in got.windows(2) {
            prop_assert!(w[0].0 + w[0].1 < w[1].0);
        }
        for &(s, n) in &got {
            prop_assert!(n > 0 && s + n <= pages);
        }
    }

    #[test]
    fn long_runs_over_many_words(start in 0u64..2000, len in 0u64..2000, pages in 0u64..4200) {
        let mut words = vec![0u64; 4096 / 64];
        for p in start..(start + len).min(4096) {
            words[(p / 64) as usize] |= 1 << (p % 64);
        }
        let got: Vec<_> = ranges(&words, pages).collect();
        prop_assert_eq!(got, reference(&words, pages));
    }
}
