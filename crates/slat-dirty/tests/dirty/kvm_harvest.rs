//! Transactional harvests on the real `/dev/kvm`, in the three log modes: a harvest aborted at
//! any point (right after the take, or in the middle of the copy, with guest writes landing
//! mid-copy) loses no page. The oracle: every take reports exactly the pages written since the
//! last committed take plus the pages of every aborted set since, and a replica that copies
//! only from committed sets ends equal to guest memory.
//!
//! Skipped (visibly) without /dev/kvm.

use crate::common;

use common::{pass_with, Setup, TinyVm, SLOT_PAGES};
use std::collections::BTreeSet;

type Page = (usize, u64);

/// A small deterministic PRNG (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Pages to write: a few random ones, biased to word and slot edges, no duplicates.
fn some_pages(rng: &mut Rng, max: u64) -> Vec<Page> {
    let edges = |s: usize| {
        let last = SLOT_PAGES[s] - 1;
        [0, 63, 64, 127, 128, 511, 512, last - 1, last]
            .into_iter()
            .filter(move |&p| p <= last)
            .collect::<Vec<_>>()
    };
    let n = rng.below(max + 1);
    let mut set = BTreeSet::new();
    for _ in 0..n {
        let s = rng.below(2) as usize;
        let p = if rng.below(3) == 0 {
            let e = edges(s);
            e[rng.below(e.len() as u64) as usize]
        } else {
            rng.below(SLOT_PAGES[s])
        };
        set.insert((s, p));
    }
    set.into_iter().collect()
}

fn set_pages(set: &slat_dirty::DirtySet<'_>) -> BTreeSet<Page> {
    let mut out = BTreeSet::new();
    for i in 0..set.slots().len() {
        // Bitmaps are sized from the slot, whatever happened.
        assert_eq!(
            set.bitmap(i).unwrap().len() as u64,
            set.slots()[i].bitmap_words()
        );
        for (first, n) in set.ranges(i) {
            for p in first..first + n {
                out.insert((i, p));
            }
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Commit,
    AbortAfterTake,
    AbortMidCopy,
}

fn oracle(setup: Setup, rounds: u32, seed: u64) {
    let Some(mut vm) = TinyVm::new(setup) else {
        return;
    };
    let mut rng = Rng(seed);
    let control = vm.layout.control;
    // Pages written since the last committed take, plus the pages of aborted sets.
    let mut owed = initially_owed(setup);
    // Byte 0 of each page as copied by committed harvests (memory starts zeroed).
    let mut replica: Vec<Vec<u8>> = SLOT_PAGES.iter().map(|&n| vec![0; n as usize]).collect();
    let fates = [Fate::Commit, Fate::AbortAfterTake, Fate::AbortMidCopy];
    for round in 0..=rounds {
        let last = round == rounds;
        if !last {
            let w1 = some_pages(&mut rng, 120);
            vm.pass(&w1);
            owed.extend(w1);
        }
        let fate = if last {
            Fate::Commit
        } else {
            fates[rng.below(3) as usize]
        };
        let mut set = vm.harvester.take().unwrap();
        let got = set_pages(&set);
        assert_eq!(
            got, owed,
            "{setup:?} round {round} ({fate:?}): the take is not what was written and not \
             committed"
        );
        owed.clear();
        if fate == Fate::AbortAfterTake {
            set.abort();
            owed.extend(got);
            continue;
        }
        // Copy into a staging replica; it becomes the replica only if the set commits.
        let mut staged = replica.clone();
        let ranges: Vec<(usize, u64, u64)> = (0..2)
            .flat_map(|i| set.ranges(i).map(move |(f, n)| (i, f, n)))
            .collect();
        let half = ranges.len() / 2;
        for (k, &(i, first, n)) in ranges.iter().enumerate() {
            if k == half && !last {
                // Guest writes mid-copy, some to pages already copied, some to pages not yet.
                let mut w2 = some_pages(&mut rng, 40);
                if let Some(&(i0, f0, _)) = ranges.first() {
                    w2.push((i0, f0));
                }
                w2.sort();
                w2.dedup();
                pass_with(&mut vm.vcpu, &mut vm.low, control, &w2, || {
                    set.collect().unwrap();
                });
                owed.extend(w2);
                if fate == Fate::AbortMidCopy {
                    break;
                }
            }
            for p in first..first + n {
                staged[i][p as usize] = vm.slots[i].bytes()[p as usize * 4096];
            }
        }
        match fate {
            Fate::Commit => {
                set.commit();
                replica = staged;
            }
            _ => {
                drop(set); // an injected failure: `?` would drop it the same way
                owed.extend(got);
            }
        }
    }
    // The last take was committed with no write after it: the replica is guest memory.
    assert_replica_is_guest_memory(setup, &replica, &vm);
    assert_eq!(vm.harvester.owed_pages(), 0);
}

/// What the first take owes: every page with INITIALLY_SET, else none.
fn initially_owed(setup: Setup) -> BTreeSet<Page> {
    let all: BTreeSet<Page> = (0..2)
        .flat_map(|s| (0..SLOT_PAGES[s]).map(move |p| (s, p)))
        .collect();
    match setup {
        Setup::Manual {
            initially_set: true,
            ..
        } => all,
        _ => BTreeSet::new(),
    }
}

/// Byte 0 of every page of `replica` equals guest memory's.
fn assert_replica_is_guest_memory(setup: Setup, replica: &[Vec<u8>], vm: &TinyVm) {
    for s in 0..2 {
        for p in 0..SLOT_PAGES[s] {
            assert_eq!(
                replica[s][p as usize],
                vm.slots[s].bytes()[p as usize * 4096],
                "{setup:?}: slot {s} page {p} lost"
            );
        }
    }
}

#[test]
fn get_aborted_harvests_lose_no_page() {
    oracle(Setup::Get, 24, 1);
}

#[test]
fn manual_protect_in_64_page_chunks_aborted_harvests_lose_no_page() {
    oracle(
        Setup::Manual {
            chunk_pages: 64,
            initially_set: false,
        },
        24,
        2,
    );
}

#[test]
fn manual_protect_initially_set_in_large_chunks_loses_no_page() {
    oracle(
        Setup::Manual {
            chunk_pages: 256,
            initially_set: true,
        },
        24,
        3,
    );
}

#[test]
fn ring_aborted_harvests_lose_no_page() {
    oracle(Setup::Ring { entries: 4096 }, 24, 4);
}

#[test]
fn ring_full_mid_copy_and_between_takes_loses_no_entry() {
    // A 512-entry ring fills (KVM keeps 64 entries in reserve) within one 500-page pass.
    let Some(mut vm) = TinyVm::new(Setup::Ring { entries: 512 }) else {
        return;
    };
    let pages: Vec<Page> = (0..500).map(|p| (0, p)).collect();
    let full = vm.pass(&pages);
    assert!(full >= 1, "a 500-page pass must fill a 512-entry ring");
    let set = vm.harvester.take().unwrap();
    let got = set_pages(&set);
    assert_eq!(got, pages.iter().copied().collect());
    set.commit();
    // Full again while a set is out: the set collects, the entries stay owed.
    vm.pass(&[(1, 3)]);
    let mut set = vm.harvester.take().unwrap();
    let control = vm.layout.control;
    let n = pass_with(&mut vm.vcpu, &mut vm.low, control, &pages, || {
        set.collect().unwrap();
    });
    assert!(n >= 1);
    assert_eq!(set_pages(&set), [(1, 3)].into_iter().collect());
    set.commit();
    let set = vm.harvester.take().unwrap();
    assert_eq!(set_pages(&set), pages.iter().copied().collect());
    set.commit();
}

#[test]
fn vmm_writes_merge_into_the_take() {
    let Some(mut vm) = TinyVm::new(Setup::Get) else {
        return;
    };
    vm.pass(&[(0, 5)]);
    // A device wrote pages 64..=66 of slot 0 and the last page of slot 1.
    vm.harvester
        .mark_pages(0, slat_addr::PageIndex::new(64), 3)
        .unwrap();
    let mut words = vec![0u64; vm.harvester.slots()[1].bitmap_words() as usize];
    words[1] |= 1 << (69 - 64);
    vm.harvester.mark_words(1, &words).unwrap();
    let words0 = vm.harvester.slots()[0].bitmap_words() as usize;
    let mut set = vm.harvester.take().unwrap();
    // And one more, known only at copy time.
    let mut late = vec![0u64; words0];
    late[8] = 1; // page 512
    set.mark_words(0, &late).unwrap();
    let got = set_pages(&set);
    let want: BTreeSet<Page> = [(0, 5), (0, 64), (0, 65), (0, 66), (0, 512), (1, 69)]
        .into_iter()
        .collect();
    assert_eq!(got, want);
    drop(set);
    // Aborted: all of it, VMM writes included, comes back.
    let set = vm.harvester.take().unwrap();
    assert_eq!(set_pages(&set), want);
    set.commit();
    assert!(vm.harvester.take().unwrap().is_empty());
}
