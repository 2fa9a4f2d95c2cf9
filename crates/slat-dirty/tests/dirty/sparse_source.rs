//! The harvester over a source that lists its dirty words (`get_log_words`,
//! `clear_log_words`), as slat's simulated machine does: a take hands over exactly the pages
//! written, CLEARs exactly what GET listed in the caller's chunks, aborts owe the set again,
//! and what a sloppy source lists past the slot is dropped. Also the trait's default word
//! methods over a whole-slot GET and CLEAR, and a snapshot's page set fed from a set's words.
//! No /dev/kvm.

use slat_addr::{PageIndex, PAGE_SIZE};
use slat_dirty::{DirtyLogSource, GuestRegion, Harvester, LogMode, SlotInfo, Snapshot};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;

/// A CLEAR as the source received it: first page, pages, words.
type Clear = (u64, u64, Vec<(usize, u64)>);

/// What the test and the source share: pages written since the last GET, CLEARs received,
/// calls of the whole-slot forms.
#[derive(Default)]
struct State {
    dirty: BTreeSet<u64>,
    clears: Vec<Clear>,
    dense_calls: u64,
}

/// One slot of `pages` pages that lists its words, sloppily.
struct Sparse {
    pages: u64,
    mode: LogMode,
    s: Rc<RefCell<State>>,
}

impl DirtyLogSource for Sparse {
    type Error = String;

    fn slots(&self) -> Vec<SlotInfo> {
        vec![SlotInfo {
            id: 3,
            pages: self.pages,
        }]
    }
    fn mode(&self) -> LogMode {
        self.mode
    }
    fn get_log(&mut self, _: usize, _: &mut [u64]) -> Result<(), String> {
        self.s.borrow_mut().dense_calls += 1;
        Err("the harvester must use the word list".into())
    }
    fn clear_log(&mut self, _: usize, _: PageIndex, _: u64, _: &[u64]) -> Result<(), String> {
        self.s.borrow_mut().dense_calls += 1;
        Err("the harvester must use the word list".into())
    }
    fn get_log_words(
        &mut self,
        _: usize,
        _: &mut [u64],
        words: &mut Vec<(usize, u64)>,
    ) -> Result<(), String> {
        words.clear();
        for p in std::mem::take(&mut self.s.borrow_mut().dirty) {
            let i = (p / 64) as usize;
            match words.last_mut() {
                Some((j, w)) if *j == i => *w |= 1 << (p % 64),
                _ => words.push((i, 1 << (p % 64))),
            }
        }
        // Sloppy: out of order, a bit past the slot's end, a word past the slot.
        words.reverse();
        words.push(((self.pages.div_ceil(64) - 1) as usize, 1 << 63));
        words.push((usize::MAX, 1));
        Ok(())
    }
    fn clear_log_words(
        &mut self,
        _: usize,
        first: PageIndex,
        pages: u64,
        words: &[(usize, u64)],
        _: &mut [u64],
    ) -> Result<(), String> {
        let c = (first.raw(), pages, words.to_vec());
        self.s.borrow_mut().clears.push(c);
        Ok(())
    }
    fn collect_ring(&mut self, _: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, String> {
        Err("no ring".into())
    }
    fn reset_rings(&mut self) -> Result<u64, String> {
        Err("no ring".into())
    }
}

fn set_pages<S: DirtyLogSource>(set: &slat_dirty::DirtySet<'_, S>) -> BTreeSet<u64> {
    let mut v = BTreeSet::new();
    for (w, mut bits) in set.words(0) {
        while bits != 0 {
            v.insert(w as u64 * 64 + u64::from(bits.trailing_zeros()));
            bits &= bits - 1;
        }
    }
    v
}

#[test]
fn takes_follow_the_listed_words() {
    const PAGES: u64 = (1 << 20) + 5;
    let s = Rc::new(RefCell::new(State::default()));
    let mode = LogMode::ManualProtect { chunk_pages: 4096 };
    let src = Sparse {
        pages: PAGES,
        mode,
        s: s.clone(),
    };
    let mut h = Harvester::from_source(src).unwrap();
    let first: BTreeSet<u64> = [0, 1, 63, 4095, 4096, 70_000, PAGES - 1].into();
    let second: BTreeSet<u64> = [5, 70_001].into();
    s.borrow_mut().dirty.extend(&first);
    let set = h.take().unwrap();
    assert_eq!(set_pages(&set), first, "bits past the slot are no pages");
    assert_eq!(set.pages(), first.len() as u64);
    set.abort();
    assert_eq!(h.owed_pages(), first.len() as u64);
    {
        let st = s.borrow();
        assert_eq!(st.dense_calls, 0);
        // One CLEAR per 4096-page chunk holding a dirty word, with exactly its words.
        let chunks: Vec<u64> = st.clears.iter().map(|c| c.0).collect();
        let last = PAGES - PAGES % 4096;
        assert_eq!(chunks, [0, 4096, 69_632, last]);
        let word0 = (0, (1 << 63) | 0b11);
        assert_eq!(st.clears[0], (0, 4096, vec![word0, (63, 1 << 63)]));
        assert_eq!(st.clears[1], (4096, 4096, vec![(64, 1)]));
        assert_eq!(st.clears[3], (last, 5, vec![(16384, 1 << 4)]));
    }
    s.borrow_mut().dirty.extend(&second);
    let set = h.take().unwrap();
    let both: BTreeSet<u64> = first.union(&second).copied().collect();
    assert_eq!(set_pages(&set), both, "the aborted set is owed again");
    // Only the newly listed words were cleared.
    assert_eq!(s.borrow().clears.len(), 6);
    set.commit();
    assert_eq!(h.owed_pages(), 0);
    let set = h.take().unwrap();
    assert!(set.is_empty());
    assert_eq!(set.words(0).count(), 0);
    assert_eq!(set.words(1).count(), 0, "past the last slot");
}

/// A source with only the whole-slot forms: the defaults go through them.
#[derive(Default)]
struct Dense {
    got: Vec<u64>,
    cleared: Vec<(u64, u64, Vec<u64>)>,
}

impl DirtyLogSource for Dense {
    type Error = String;

    fn slots(&self) -> Vec<SlotInfo> {
        vec![SlotInfo { id: 0, pages: 200 }]
    }
    fn mode(&self) -> LogMode {
        LogMode::ManualProtect { chunk_pages: 128 }
    }
    fn get_log(&mut self, _: usize, bitmap: &mut [u64]) -> Result<(), String> {
        bitmap.copy_from_slice(&self.got);
        Ok(())
    }
    fn clear_log(&mut self, _: usize, f: PageIndex, n: u64, b: &[u64]) -> Result<(), String> {
        self.cleared.push((f.raw(), n, b.to_vec()));
        Ok(())
    }
    fn collect_ring(&mut self, _: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, String> {
        Ok(0)
    }
    fn reset_rings(&mut self) -> Result<u64, String> {
        Ok(0)
    }
}

#[test]
fn default_word_methods_use_the_whole_slot_forms() {
    let mut d = Dense {
        got: vec![0, 6, 0, 1 << 7],
        ..Dense::default()
    };
    let mut scratch = vec![!0u64; 4];
    let mut words = vec![(9, 9)];
    d.get_log_words(0, &mut scratch, &mut words).unwrap();
    assert_eq!(words, [(1, 6), (3, 1 << 7)]);
    // The chunk's bitmap in the scratch; words outside the range ignored.
    d.clear_log_words(0, PageIndex::new(128), 72, &words, &mut scratch)
        .unwrap();
    assert_eq!(d.cleared, [(128, 72, vec![0, 1 << 7])]);
    // A scratch too short for the range: one CLEAR per word, none larger than the range.
    d.cleared.clear();
    d.clear_log_words(0, PageIndex::ZERO, 200, &words, &mut [])
        .unwrap();
    assert_eq!(d.cleared, [(64, 64, vec![6]), (192, 8, vec![1 << 7])]);
    d.cleared.clear();
    d.clear_log_words(0, PageIndex::ZERO, 64, &[(usize::MAX, 1)], &mut [])
        .unwrap();
    assert!(d.cleared.is_empty());
}

#[test]
fn a_snapshot_page_set_takes_a_sets_words() {
    const PAGES: u64 = 200;
    let mut mem = vec![0u8; (PAGES * PAGE_SIZE) as usize];
    // SAFETY: `mem` is mapped, readable and writable, outlives the snapshot, and nothing else
    // writes it.
    let region = unsafe { GuestRegion::new(mem.as_mut_ptr(), PAGES * PAGE_SIZE) }.unwrap();
    let snap = Snapshot::take(vec![region]).unwrap();
    let s = Rc::new(RefCell::new(State::default()));
    let src = Sparse {
        pages: PAGES,
        mode: LogMode::Get,
        s: s.clone(),
    };
    let mut h = Harvester::from_source(src).unwrap();
    s.borrow_mut().dirty.extend([3, 64, 199]);
    let set = h.take().unwrap();
    let mut dirty = snap.dirty_pages();
    dirty.add_dirty_set(&set).unwrap();
    let mut listed = dirty.pages(0).to_vec();
    listed.sort_unstable();
    assert_eq!(listed, [3, 64, 199]);
    set.commit();
    // A set of a larger slot than the region, with a page past it: refused, nothing added.
    let big = Sparse {
        pages: PAGES + 64,
        mode: LogMode::Get,
        s: s.clone(),
    };
    let mut h = Harvester::from_source(big).unwrap();
    s.borrow_mut().dirty.extend([5, PAGES + 1]);
    let set = h.take().unwrap();
    let mut dirty = snap.dirty_pages();
    assert!(dirty.add_dirty_set(&set).is_err());
    assert!(dirty.is_empty());
    drop(snap);
}
