//! Snapshot and reset on plain host memory: exact resets, incremental snapshots, bounds, and
//! a seeded random test against a reference model (a full copy of what memory must hold).

use slat_addr::PageIndex;
use slat_addr::PAGE_SIZE;
use slat_dirty::{DirtyPages, GuestRegion, Snapshot, SnapshotError};

const PAGE: usize = PAGE_SIZE as usize;

/// Host memory the tests own, standing in for guest RAM. Every access (the test's "guest"
/// writes and the snapshot's) goes through the one raw pointer taken at allocation, as guest
/// memory is reached through a mapping's address.
struct Mem {
    base: *mut [u8; PAGE],
    pages: usize,
}

impl Mem {
    fn new(pages: usize, seed: u64) -> Self {
        let mut rng = XorShift(seed | 1);
        let v: Box<[[u8; PAGE]]> = (0..pages)
            .map(|_| {
                let mut p = [0u8; PAGE];
                p.iter_mut().for_each(|b| *b = rng.next() as u8);
                p
            })
            .collect();
        Mem {
            base: Box::into_raw(v).cast(),
            pages,
        }
    }

    /// A region over pages `[first, first + n)`.
    fn region(&mut self, first: usize, n: usize) -> GuestRegion {
        assert!(first + n <= self.pages);
        // SAFETY: the pages are ours (in bounds, asserted), mapped and writable, and outlive
        // every snapshot in these tests (declared before it, so dropped after it); only the
        // test thread writes them, never during a snapshot call.
        unsafe { GuestRegion::new(self.base.add(first).cast(), (n * PAGE) as u64) }.unwrap()
    }

    /// Writes `v` at byte `off` of page `p`, as a guest would.
    fn write(&mut self, p: usize, off: usize, v: u8) {
        assert!(p < self.pages && off < PAGE);
        // SAFETY: in bounds (asserted); no snapshot call runs during the write.
        unsafe { self.base.add(p).cast::<u8>().add(off).write(v) }
    }

    fn read(&self, p: usize, off: usize) -> u8 {
        assert!(p < self.pages && off < PAGE);
        // SAFETY: in bounds (asserted).
        unsafe { self.base.add(p).cast::<u8>().add(off).read() }
    }

    fn bytes(&self) -> Vec<u8> {
        // SAFETY: `pages` pages at `base` are ours; nothing writes them during the read.
        unsafe { std::slice::from_raw_parts(self.base.cast::<u8>(), self.pages * PAGE) }.to_vec()
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: `base` came from `Box::into_raw` of a boxed slice of `pages` pages.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.base, self.pages)) });
    }
}

/// A small PRNG with a printed seed, so a failure can be replayed.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn reset_restores_exactly_the_dirty_pages() {
    let mut mem = Mem::new(200, 7);
    let (r0, r1) = (mem.region(0, 130), mem.region(130, 70));
    let snap = Snapshot::take(vec![r0, r1]).unwrap();
    let original = mem.bytes();
    let mut dirty = snap.dirty_pages();
    for (p, region, page) in [(3, 0, 3), (129, 0, 129), (130, 1, 0), (199, 1, 69)] {
        mem.write(p, 100, 0xee);
        dirty.add_page(region, PageIndex::new(page)).unwrap();
        // Twice: deduplicated.
        dirty.add_page(region, PageIndex::new(page)).unwrap();
    }
    assert_eq!(dirty.len(), 4);
    assert!(snap.verify().is_err());
    let stats = snap.reset(&mut dirty).unwrap();
    assert_eq!(stats.pages, 4);
    assert!(dirty.is_empty());
    assert_eq!(mem.bytes(), original);
    snap.verify().unwrap();
}

#[test]
fn a_page_left_out_is_left_alone_and_verify_finds_it() {
    let mut mem = Mem::new(8, 3);
    let r = mem.region(0, 8);
    let snap = Snapshot::take(vec![r]).unwrap();
    mem.write(5, 17, !mem.read(5, 17));
    let mut dirty = snap.dirty_pages();
    snap.reset(&mut dirty).unwrap();
    assert_eq!(
        snap.verify(),
        Err(SnapshotError::Mismatch {
            region: 0,
            page: PageIndex::new(5),
            byte: 17
        })
    );
}

#[test]
fn bitmaps_are_bounds_checked_before_anything_is_added() {
    let mut mem = Mem::new(70, 1);
    let r = mem.region(0, 70);
    let snap = Snapshot::take(vec![r]).unwrap();
    let mut dirty = snap.dirty_pages();
    // Two words cover 128 pages; bit 70 is past the region.
    let err = dirty
        .add_bitmap(0, PageIndex::new(0), &[1, 1 << 6])
        .unwrap_err();
    assert_eq!(
        err,
        SnapshotError::PageOutOfRange {
            region: 0,
            page: PageIndex::new(70),
            pages: 70
        }
    );
    assert!(dirty.is_empty(), "nothing added from a refused bitmap");
    // Bits in the rounding of the last word are fine when clear; a third word is too long.
    dirty
        .add_bitmap(0, PageIndex::new(0), &[1, 1 << 5])
        .unwrap();
    assert_eq!(dirty.pages(0), &[0, 69]);
    assert!(matches!(
        dirty.add_bitmap(0, PageIndex::new(0), &[0, 0, 0]),
        Err(SnapshotError::BitmapLength { .. })
    ));
    // An offset bitmap: bit 0 = page 64.
    assert!(matches!(
        dirty.add_bitmap(0, PageIndex::new(64), &[1 << 6]),
        Err(SnapshotError::PageOutOfRange { page, .. }) if page == PageIndex::new(70)
    ));
    assert!(matches!(
        dirty.add_bitmap(0, PageIndex::new(71), &[]),
        Err(SnapshotError::BitmapLength { .. })
    ));
    dirty.add_bitmap(0, PageIndex::new(64), &[1 << 1]).unwrap();
    assert!(dirty.contains(0, PageIndex::new(65)));
}

#[test]
fn page_indices_are_bounds_checked_and_nothing_is_written() {
    let mut mem = Mem::new(10, 9);
    let r = mem.region(2, 4);
    let snap = Snapshot::take(vec![r]).unwrap();
    mem.write(3, 0, !mem.read(3, 0));
    let before = mem.bytes();
    let mut dirty = snap.dirty_pages();
    assert_eq!(
        dirty.add_page(0, PageIndex::new(4)),
        Err(SnapshotError::PageOutOfRange {
            region: 0,
            page: PageIndex::new(4),
            pages: 4
        })
    );
    assert!(matches!(
        dirty.add_page(1, PageIndex::new(0)),
        Err(SnapshotError::NoRegion { region: 1, .. })
    ));
    assert!(matches!(
        dirty.add_page(0, PageIndex::new(u64::MAX)),
        Err(SnapshotError::PageOutOfRange { .. })
    ));
    snap.reset(&mut dirty).unwrap();
    assert_eq!(mem.bytes(), before, "no page written");
    // A set sized for other regions is refused before anything is copied.
    let mut other_mem = Mem::new(5, 3);
    let other_snap = Snapshot::take(vec![other_mem.region(0, 5)]).unwrap();
    let mut other = other_snap.dirty_pages();
    other.add_page(0, PageIndex::new(1)).unwrap();
    assert!(matches!(
        snap.reset(&mut other),
        Err(SnapshotError::Shape(_))
    ));
    assert_eq!(mem.bytes(), before);
}

#[test]
fn regions_that_are_not_whole_pages_are_refused() {
    let mut buf = vec![0u8; 3 * PAGE];
    for len in [0, 100, PAGE as u64 + 1] {
        // SAFETY: the buffer is ours and outlives the (refused) region.
        let r = unsafe { GuestRegion::new(buf.as_mut_ptr(), len) };
        assert!(matches!(r, Err(SnapshotError::Region { .. })), "{len}");
    }
    // SAFETY: a null address is refused before anything is dereferenced.
    let r = unsafe { GuestRegion::new(std::ptr::null_mut(), PAGE_SIZE) };
    assert!(r.is_err());
    assert!(Snapshot::take(Vec::new()).is_err());
}

#[test]
fn incremental_snapshots_reset_to_the_child_and_to_the_base() {
    let mut mem = Mem::new(64, 11);
    let r = mem.region(0, 64);
    let base = Snapshot::take(vec![r]).unwrap();
    let at_base = mem.bytes();
    let mut dirty = base.dirty_pages();
    for p in [1, 9, 40] {
        mem.write(p, 5, 0x11);
        dirty.add_page(0, PageIndex::new(p as u64)).unwrap();
    }
    let child = base.child(&dirty).unwrap();
    assert_eq!(child.own_pages(), 3);
    let at_child = mem.bytes();
    dirty.clear();
    child.verify().unwrap();
    assert!(base.verify().is_err());

    // Write a child page and a base-only page, reset to the child.
    for p in [9, 20] {
        mem.write(p, 6, 0x22);
        dirty.add_page(0, PageIndex::new(p as u64)).unwrap();
    }
    let stats = child.reset(&mut dirty).unwrap();
    assert_eq!((stats.pages, stats.from_child), (2, 1));
    assert_eq!(mem.bytes(), at_child);

    // From the child, write again and go back to the base.
    mem.write(33, 0, 0x33);
    dirty.add_page(0, PageIndex::new(33)).unwrap();
    child.reset_to_base(&mut dirty).unwrap();
    assert_eq!(mem.bytes(), at_base);
    base.verify().unwrap();

    // From the base, write and go to the child.
    mem.write(50, 0, 0x44);
    dirty.add_page(0, PageIndex::new(50)).unwrap();
    child.reset_from_base(&mut dirty).unwrap();
    assert_eq!(mem.bytes(), at_child);
    child.verify().unwrap();
}

/// Random writes, random resets to base or child, against a reference copy of what memory
/// must hold after each reset.
#[test]
fn random_resets_match_the_reference_model() {
    let seed = std::env::var("SNAPSHOT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("seed {seed} (replay with SNAPSHOT_SEED={seed})");
    let mut rng = XorShift(seed | 1);
    let sizes = [1usize, 63, 64, 65, 7];
    let total: usize = sizes.iter().sum();
    let mut mem = Mem::new(total, seed ^ 0xabc);
    let mut first = 0;
    let regions: Vec<GuestRegion> = sizes
        .iter()
        .map(|&n| {
            let r = mem.region(first, n);
            first += n;
            r
        })
        .collect();
    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |s, &n| {
            let v = *s;
            *s += n;
            Some(v)
        })
        .collect();
    let base = Snapshot::take(regions).unwrap();
    let at_base = mem.bytes();
    let mut dirty = base.dirty_pages();
    let write_some = |mem: &mut Mem, dirty: &mut DirtyPages, rng: &mut XorShift| {
        for _ in 0..rng.below(40) {
            let region = rng.below(sizes.len() as u64) as usize;
            let page = rng.below(sizes[region] as u64);
            mem.write(
                starts[region] + page as usize,
                rng.below(PAGE as u64) as usize,
                rng.next() as u8,
            );
            dirty.add_page(region, PageIndex::new(page)).unwrap();
        }
    };
    write_some(&mut mem, &mut dirty, &mut rng);
    let child = base.child(&dirty).unwrap();
    let at_child = mem.bytes();
    dirty.clear();
    // Which snapshot memory last equalled.
    let mut at_child_now = true;
    for round in 0..300 {
        write_some(&mut mem, &mut dirty, &mut rng);
        let to_child = rng.below(2) == 0;
        match (at_child_now, to_child) {
            (true, true) => child.reset(&mut dirty),
            (true, false) => child.reset_to_base(&mut dirty),
            (false, true) => child.reset_from_base(&mut dirty),
            (false, false) => base.reset(&mut dirty),
        }
        .unwrap();
        at_child_now = to_child;
        let want = if to_child { &at_child } else { &at_base };
        assert!(
            mem.bytes() == *want,
            "seed {seed}, round {round}: memory differs from the model"
        );
        if to_child {
            child.verify().unwrap();
        } else {
            base.verify().unwrap();
        }
    }
}

/// Zero pages are not held, and come back as zeros from a per-page reset and a full one; a
/// reset of at least the crossover copies everything back and says so.
#[test]
fn zero_pages_are_not_held_and_crossover_switches_to_a_full_copy() {
    let mut mem = Mem::new(8, 3);
    for p in [1, 3, 6] {
        for off in 0..PAGE {
            mem.write(p, off, 0);
        }
    }
    let mut snap = Snapshot::take(vec![mem.region(0, 8)]).unwrap();
    assert_eq!(snap.held_pages(), 5);
    let want = mem.bytes();
    snap.set_crossover_pages(u64::MAX);
    let mut dirty = snap.dirty_pages();
    for p in [1usize, 2] {
        mem.write(p, 9, 0x77);
        dirty.add_page(0, PageIndex::new(p as u64)).unwrap();
    }
    let s = snap.reset(&mut dirty).unwrap();
    assert_eq!((s.pages, s.zeroed, s.full), (2, 1, false));
    assert_eq!(mem.bytes(), want);
    snap.set_crossover_pages(2);
    for p in [3usize, 4] {
        mem.write(p, 0, 0x11);
        dirty.add_page(0, PageIndex::new(p as u64)).unwrap();
    }
    let s = snap.reset(&mut dirty).unwrap();
    assert_eq!((s.pages, s.zeroed, s.full), (2, 3, true));
    assert_eq!(mem.bytes(), want);
    snap.verify().unwrap();
    assert!(snap.crossover_pages() == 2 && dirty.is_empty());
}
