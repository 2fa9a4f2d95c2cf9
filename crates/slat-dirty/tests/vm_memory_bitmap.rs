//! `SummaryBitmap` as vm-memory uses it: `GuestMemoryMmap<SummaryBitmap>` built from regions,
//! writes through vm-memory's `Bytes` mark exactly their pages (oracle: a plain set, random
//! ranges crossing words and region ends), a harvest returns exactly them — straight into a
//! `Harvester` too — and marks concurrent with harvests are all taken exactly once.
//! `cargo test -p slat-dirty --features vm-memory --test vm_memory_bitmap`.

use proptest::prelude::*;
use slat_addr::PageIndex;
use slat_dirty::vm_memory::bitmap::Bitmap;
use slat_dirty::{DirtyLogSource, Error, Harvester, LogMode, SlotInfo, SummaryBitmap};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

const PAGE: usize = 4096;
/// Two adjacent regions (a write may cross from one into the other) and one apart; sizes not
/// multiples of 64 pages, so the last word of each is partial.
const REGIONS: [(u64, usize); 3] = [
    (0, 130 * PAGE),
    (130 * PAGE as u64, 70 * PAGE),
    (1 << 30, 4097 * PAGE),
];

fn memory() -> GuestMemoryMmap<SummaryBitmap> {
    let ranges: Vec<_> = REGIONS
        .iter()
        .map(|&(a, len)| (GuestAddress(a), len))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).expect("map guest memory")
}

/// The bitmap behind region `i` (the `MmapRegion`'s, not a slice of it).
fn bitmap(mem: &GuestMemoryMmap<SummaryBitmap>, i: usize) -> &SummaryBitmap {
    let r = mem.iter().nth(i).expect("region");
    (**r).bitmap()
}

/// `(region, page)` of every mark, taken (cleared) from every region's bitmap.
fn take_all(mem: &GuestMemoryMmap<SummaryBitmap>) -> BTreeSet<(usize, usize)> {
    let mut pages = BTreeSet::new();
    for i in 0..REGIONS.len() {
        bitmap(mem, i).take_words(|w, mut bits| {
            while bits != 0 {
                assert!(pages.insert((i, w * 64 + bits.trailing_zeros() as usize)));
                bits &= bits - 1;
            }
        });
    }
    pages
}

/// The pages a write of `len > 0` bytes at `addr` touches, as `(region, page)`.
fn oracle(addr: u64, len: usize, into: &mut BTreeSet<(usize, usize)>) {
    for (i, &(base, size)) in REGIONS.iter().enumerate() {
        let (start, end) = (addr.max(base), (addr + len as u64).min(base + size as u64));
        if start < end {
            let (first, last) = (
                (start - base) as usize / PAGE,
                (end - 1 - base) as usize / PAGE,
            );
            into.extend((first..=last).map(|p| (i, p)));
        }
    }
}

#[test]
fn write_slice_and_write_obj_mark_exactly_their_pages() {
    let mem = memory();
    let mut expect = BTreeSet::new();
    // Within one page; across a word (pages 63..65); across the adjacent regions' boundary.
    for (addr, len) in [
        (5 * PAGE as u64 + 9, 100),
        (63 * PAGE as u64 + 1, 2 * PAGE),
        (129 * PAGE as u64, 2 * PAGE),
    ] {
        mem.write_slice(&vec![7u8; len], GuestAddress(addr))
            .unwrap();
        oracle(addr, len, &mut expect);
    }
    let last = (1u64 << 30) + 4096 * PAGE as u64 + 4092;
    mem.write_obj(0xdead_beef_u32, GuestAddress(last)).unwrap();
    oracle(last, 4, &mut expect);
    assert!(
        bitmap(&mem, 0).is_bit_set(64)
            && mem
                .find_region(GuestAddress(last))
                .unwrap()
                .bitmap()
                .dirty_at(4096 * PAGE)
    );
    assert_eq!(take_all(&mem), expect);
    assert!(take_all(&mem).is_empty(), "a harvest clears what it took");
    let mut v = 0u32;
    mem.read_slice(bytemuck_u32(&mut v), GuestAddress(last))
        .unwrap();
    assert_eq!(v, 0xdead_beef);
}

fn bytemuck_u32(v: &mut u32) -> &mut [u8] {
    // SAFETY: a u32 is 4 initialised bytes, any of whose values is a valid u32.
    unsafe { std::slice::from_raw_parts_mut((v as *mut u32).cast(), 4) }
}

#[test]
fn out_of_range_marks_never_panic() {
    let mem = memory();
    let b = bitmap(&mem, 1);
    for (offset, len) in [
        (usize::MAX, usize::MAX),
        (70 * PAGE, 1),
        (69 * PAGE, usize::MAX),
        (0, 0),
    ] {
        b.mark_dirty(offset, len);
        b.slice_at(offset).mark_dirty(offset, len);
        assert!(!b.slice_at(usize::MAX).dirty_at(usize::MAX));
    }
    // Only page 69 (the last) was inside: twice from 69 * PAGE, and the slice at 69 * PAGE
    // wrapped round to offset 138 * PAGE, past the end.
    assert_eq!(take_all(&mem), BTreeSet::from([(1, 69)]));
    assert!(mem
        .write_slice(&[1; 8], GuestAddress(200 * PAGE as u64))
        .is_err());
    assert!(take_all(&mem).is_empty());
}

/// A log with nothing in it: the harvester's pages come only from the bitmaps merged.
struct NoLog(Vec<SlotInfo>);

impl DirtyLogSource for NoLog {
    type Error = Error;
    fn slots(&self) -> Vec<SlotInfo> {
        self.0.clone()
    }
    fn mode(&self) -> LogMode {
        LogMode::Get
    }
    fn get_log(&mut self, _: usize, _: &mut [u64]) -> Result<(), Error> {
        Ok(())
    }
    fn clear_log(&mut self, _: usize, _: PageIndex, _: u64, _: &[u64]) -> Result<(), Error> {
        Ok(())
    }
    fn collect_ring(&mut self, _: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Error> {
        Ok(0)
    }
    fn reset_rings(&mut self) -> Result<u64, Error> {
        Ok(0)
    }
}

fn harvester() -> Harvester<NoLog> {
    let slots = REGIONS
        .iter()
        .enumerate()
        .map(|(i, &(_, len))| SlotInfo {
            id: i as u32,
            pages: (len / PAGE) as u64,
        })
        .collect();
    Harvester::from_source(NoLog(slots)).unwrap()
}

#[test]
fn the_harvester_takes_the_marks_sparsely_and_refuses_a_bitmap_of_another_shape() {
    let mem = memory();
    let mut hv = harvester();
    mem.write_slice(&[1; 3 * PAGE], GuestAddress(128 * PAGE as u64))
        .unwrap();
    mem.write_obj(1u8, GuestAddress((1 << 30) + 4096 * PAGE as u64))
        .unwrap();
    // Region 0 is not slot 1's shape: refused, and the bitmap keeps its marks.
    assert!(matches!(
        hv.mark_summary_bitmap(1, bitmap(&mem, 0)),
        Err(Error::BitmapLength { .. })
    ));
    assert!(hv.mark_summary_bitmap(3, bitmap(&mem, 0)).is_err());
    let other_pages =
        SummaryBitmap::new(70 * PAGE, std::num::NonZeroUsize::MIN.saturating_add(8191)).unwrap();
    assert!(hv.mark_summary_bitmap(1, &other_pages).is_err());
    assert!(bitmap(&mem, 0).is_bit_set(128));
    let taken: Vec<u64> = (0..3)
        .map(|i| hv.mark_summary_bitmap(i, bitmap(&mem, i)).unwrap())
        .collect();
    assert_eq!(taken, [2, 1, 1]);
    let set = hv.take_owed();
    let runs: Vec<Vec<(u64, u64)>> = (0..3).map(|i| set.ranges(i).collect()).collect();
    assert_eq!(runs, [vec![(128, 2)], vec![(0, 1)], vec![(4096, 1)]]);
    set.commit();
    assert!(take_all(&mem).is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random writes (any length up to 300 pages, anywhere in or across the regions, some
    /// running past the end) mark exactly the oracle's pages; a harvest after each batch
    /// returns exactly them.
    #[test]
    fn random_writes_match_the_oracle(batches in prop::collection::vec(
        prop::collection::vec((0usize..3, 0u64..(4200 * PAGE as u64), 1usize..300 * PAGE), 1..12), 1..4)) {
        let mem = memory();
        for batch in batches {
            let mut expect = BTreeSet::new();
            for (region, off, len) in batch {
                let (base, size) = REGIONS[region];
                let off = off % size as u64;
                let addr = base + off;
                // vm-memory writes up to the end of the memory it finds contiguous.
                let written = mem.write(&vec![1u8; len], GuestAddress(addr)).unwrap();
                prop_assert!(written > 0);
                oracle(addr, written, &mut expect);
            }
            prop_assert_eq!(take_all(&mem), expect);
        }
    }

    /// `mark_dirty` of any range, cut at the bitmap's end, marks what the oracle says.
    #[test]
    fn mark_dirty_of_any_range_is_cut_at_the_end(offset in 0usize..(300 * PAGE), len in 1usize..(400 * PAGE)) {
        let b = SummaryBitmap::new(4097 * PAGE, slat_dirty::SUMMARY_BITMAP_PAGE).unwrap();
        b.mark_dirty(offset, len);
        let (first, last) = (offset / PAGE, ((offset + len - 1) / PAGE).min(4096));
        let mut got = Vec::new();
        b.take_words(|w, mut bits| while bits != 0 {
            got.push(w * 64 + bits.trailing_zeros() as usize);
            bits &= bits - 1;
        });
        prop_assert_eq!(got, (first..=last).collect::<Vec<_>>());
    }
}

/// Writer threads write and mark pages of the large region (each page once, runs crossing
/// words) while a harvester thread takes: every page is taken exactly once across the
/// harvests, and its data is there when it is taken.
#[test]
fn concurrent_writes_and_harvests_lose_nothing() {
    let mem = memory();
    let done = AtomicBool::new(false);
    const WRITERS: usize = 3;
    let region = mem.iter().nth(2).unwrap();
    let pages = region.len() as usize / PAGE;
    let seen = std::thread::scope(|s| {
        let harvest = s.spawn(|| {
            let mut seen = BTreeSet::new();
            let take = |seen: &mut BTreeSet<usize>| {
                bitmap(&mem, 2).take_words(|w, mut bits| {
                    while bits != 0 {
                        let p = w * 64 + bits.trailing_zeros() as usize;
                        let at = GuestAddress((1 << 30) + (p * PAGE) as u64);
                        let v: u8 = mem.read_obj(at).unwrap();
                        assert_eq!(
                            v,
                            1 + (p % WRITERS) as u8,
                            "page {p} taken before its write"
                        );
                        assert!(seen.insert(p), "page {p} taken twice");
                        bits &= bits - 1;
                    }
                });
            };
            while !done.load(Ordering::Acquire) {
                take(&mut seen);
            }
            take(&mut seen);
            seen
        });
        let writers: Vec<_> = (0..WRITERS)
            .map(|t| {
                let mem = &mem;
                s.spawn(move || {
                    // Writer t owns the pages p with p % WRITERS == t; each page's first byte
                    // becomes 1 + t.
                    for p in (t..pages).step_by(WRITERS) {
                        let at = GuestAddress((1 << 30) + (p * PAGE) as u64);
                        mem.write_obj(1 + t as u8, at).unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Release);
        harvest.join().unwrap()
    });
    assert_eq!(seen.len(), pages);
}
