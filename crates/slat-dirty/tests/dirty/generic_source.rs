//! The transactional core over a source that is not KVM: an in-memory log with KVM's GET
//! semantics that can fail a chosen call, before or after it consumed the bits. No /dev/kvm.

use slat_addr::PageIndex;
use slat_dirty::{DirtyLogSource, Error, Harvester, LogMode, SlotInfo};
use std::collections::BTreeSet;

/// Per slot, the pages written since the last GET; ring entries waiting to be collected.
struct MemLog {
    slots: Vec<SlotInfo>,
    mode: LogMode,
    dirty: Vec<BTreeSet<u64>>,
    ring: Vec<(u32, u64)>,
    /// Fail the call with this number (1-based); `after`: once the work is done.
    fail_at: u64,
    after: bool,
    calls: u64,
}

#[derive(Debug, PartialEq)]
struct Injected;

impl MemLog {
    fn new(pages: &[u64], mode: LogMode) -> Self {
        MemLog {
            slots: (0..)
                .zip(pages)
                .map(|(id, &pages)| SlotInfo { id: 10 + id, pages })
                .collect(),
            mode,
            dirty: vec![BTreeSet::new(); pages.len()],
            ring: Vec::new(),
            fail_at: 0,
            after: false,
            calls: 0,
        }
    }

    fn write(&mut self, slot: usize, page: u64) {
        self.dirty[slot].insert(page);
        self.ring.push((self.slots[slot].id, page));
    }

    /// Runs `work` as the next call, failing it as planned.
    fn call<T>(&mut self, work: impl FnOnce(&mut Self) -> T) -> Result<T, Injected> {
        self.calls += 1;
        let fail = self.calls == self.fail_at;
        if fail && !self.after {
            return Err(Injected);
        }
        let r = work(self);
        if fail {
            Err(Injected)
        } else {
            Ok(r)
        }
    }
}

impl DirtyLogSource for MemLog {
    type Error = Injected;

    fn slots(&self) -> Vec<SlotInfo> {
        self.slots.clone()
    }
    fn mode(&self) -> LogMode {
        self.mode
    }
    fn get_log(&mut self, slot: usize, bitmap: &mut [u64]) -> Result<(), Injected> {
        self.call(|l| {
            // GET clears as it reads (no manual protect here), like KVM's.
            for p in std::mem::take(&mut l.dirty[slot]) {
                bitmap[(p / 64) as usize] |= 1 << (p % 64);
            }
            // A sloppy source: a bit past the slot's end, which must not become a page.
            if let Some(w) = bitmap.last_mut() {
                *w |= 1 << 63;
            }
        })
    }
    fn clear_log(&mut self, _: usize, _: PageIndex, _: u64, _: &[u64]) -> Result<(), Injected> {
        self.call(|_| ())
    }
    fn collect_ring(&mut self, f: &mut dyn FnMut(u32, PageIndex)) -> Result<u64, Injected> {
        self.call(|l| {
            let n = l.ring.len() as u64;
            l.ring.drain(..).for_each(|(s, o)| f(s, PageIndex::new(o)));
            // An entry of a slot nobody tracks, and one past a slot's end.
            f(99, PageIndex::ZERO);
            f(10, PageIndex::new(1 << 40));
            n
        })
    }
    fn reset_rings(&mut self) -> Result<u64, Injected> {
        self.call(|_| 0)
    }
}

fn pages<S: DirtyLogSource>(set: &slat_dirty::DirtySet<'_, S>) -> BTreeSet<(usize, u64)> {
    (0..set.slot_info().len())
        .flat_map(|i| {
            set.ranges(i)
                .flat_map(move |(f, n)| (f..f + n).map(move |p| (i, p)))
        })
        .collect()
}

#[test]
fn failures_at_every_call_lose_nothing() {
    // A take makes 3 calls in Get mode (one GET per slot), 2 with the ring (collect, reset);
    // 0 fails none, and the set is aborted instead.
    for (mode, calls) in [(LogMode::Get, 3), (LogMode::Ring, 2)] {
        for fail_at in 0..=calls {
            for after in [false, true] {
                let want: BTreeSet<(usize, u64)> =
                    [(0, 0), (0, 99), (1, 69), (2, 63), (1, 5)].into();
                let mut log = MemLog::new(&[100, 70, 64], mode);
                for &(s, p) in &want {
                    log.write(s, p);
                }
                log.fail_at = fail_at;
                log.after = after;
                let mut h = Harvester::from_source(log).unwrap();
                match h.take() {
                    Err(Injected) => {}
                    Ok(set) => set.abort(),
                }
                let set = h.take().expect("no failure planned any more");
                assert_eq!(pages(&set), want, "{mode:?}, call {fail_at}, after {after}");
                set.commit();
                assert_eq!(h.owed_pages(), 0);
                if mode == LogMode::Ring {
                    assert!(h.foreign_entries() >= 2);
                }
            }
        }
    }
}

#[test]
fn sources_a_harvester_cannot_use_are_refused() {
    let refused = |pages: &[u64], mode| {
        matches!(
            Harvester::from_source(MemLog::new(pages, mode)),
            Err(Error::Harvest(_))
        )
    };
    assert!(refused(&[], LogMode::Get));
    assert!(refused(&[64], LogMode::ManualProtect { chunk_pages: 0 }));
    assert!(refused(&[64], LogMode::ManualProtect { chunk_pages: 100 }));
    // A safe source may claim any size: one no host can hold is an error, not an abort.
    let unholdable = |pages: &[u64]| {
        matches!(
            Harvester::from_source(MemLog::new(pages, LogMode::Get)),
            Err(Error::Alloc { .. })
        )
    };
    assert!(unholdable(&[u64::MAX]));
    assert!(unholdable(&[64, 1 << 62]));
    let mut twice = MemLog::new(&[64, 64], LogMode::Get);
    twice.slots[1].id = twice.slots[0].id;
    assert!(matches!(
        Harvester::from_source(twice),
        Err(Error::Harvest(_))
    ));
}

#[test]
fn marks_and_partial_commits_are_checked_against_the_slot() {
    let mut h = Harvester::from_source(MemLog::new(&[70], LogMode::Get)).unwrap();
    assert!(h.mark_pages(0, PageIndex::new(60), 11).is_err());
    assert!(h.mark_pages(1, PageIndex::new(0), 1).is_err());
    assert!(h.mark_pages(0, PageIndex::new(u64::MAX), 2).is_err());
    assert!(h.mark_words(0, &[0; 3]).is_err());
    h.mark_words(0, &[u64::MAX, u64::MAX]).unwrap();
    assert_eq!(h.owed_pages(), 70, "bits past the slot are no pages");
    let mut set = h.take_owed();
    assert_eq!(set.collected(), 0);
    assert!(set.commit_pages(0, PageIndex::new(69), 2).is_err());
    set.commit_pages(0, PageIndex::new(0), 69).unwrap();
    set.abort();
    assert_eq!(h.owed_pages(), 1);
    h.mark_all();
    assert_eq!(h.owed_pages(), 70);
}
