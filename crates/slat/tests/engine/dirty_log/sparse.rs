//! Harvest cost follows the dirty pages, not the slot's size: GET (exchange and switch), the
//! manual GET and CLEAR, dense and sparse, load only the bitmap words that hold marks and the
//! summary words above them (counted by `Stats::dirty_words_read`). A harvest that scans the
//! slot's bitmap reads 16384 words here; these bounds allow a few per dirty page. KVM's own
//! loops (`xchg-full`, `switch-full`) do scan it, and read exactly that.

use super::*;
use slat::GetLogVariant;

/// 4 GiB of address space, never touched by EPT (the engine stores leaf addresses only).
const BIG: u64 = 4 << 30;
/// Dirty pages per harvest.
const K: u64 = 16;

/// The most words a harvest of `k` dirty words may read: each dirty word, one summary word
/// per level above it, and the top.
fn bound(k: u64) -> u64 {
    4 * k + 8
}

/// `K` pages spread over the slot, each in its own bitmap word and summary word.
fn spread(npages: u64) -> Vec<u64> {
    (0..K).map(|i| i * (npages / K) + i % 64).collect()
}

fn words_read<F: PteFormat>(vm: &Vm<F>) -> u64 {
    vm.stats().dirty_words_read
}

/// A VM with one logged slot of [`BIG`] bytes at 4 GiB, the [`spread`] pages written.
fn big_dirty_vm<F: PteFormat>(config: VmConfig, manual: bool) -> (Arc<Vm<F>>, Vcpu<F>, HostMem) {
    let vm = Vm::<F>::new(config);
    if manual {
        vm.set_manual_dirty_log_protect(MANUAL_PROTECT_ENABLE)
            .unwrap();
    }
    let mut v = vm.create_vcpu(0);
    let mem = HostMem::reserve(BIG, HUGE_2M);
    vm.add_memslot(1, Gpa::new(BIG), BIG, mem.range(PAGE_SIZE), LOG)
        .unwrap();
    for p in spread(BIG / PAGE_SIZE) {
        write_new(&vm, &mut v, BIG + p * PAGE_SIZE);
    }
    (vm, v, mem)
}

/// Runs `harvest` and returns the words it read, failing past [`bound`] of `k` words.
fn within_bound<F: PteFormat>(vm: &Vm<F>, what: &str, k: u64, harvest: impl FnOnce()) {
    let before = words_read(vm);
    harvest();
    let read = words_read(vm) - before;
    assert!(
        read <= bound(k),
        "{what}: read {read} bitmap words for {k} dirty words (at most {} allowed)",
        bound(k)
    );
}

/// GET without manual protection, by exchange and by the bitmap switch: the first returns the
/// pages reading O(K) words, the second finds nothing reading O(1).
pub(crate) fn get_reads_only_dirty_words<F: PteFormat>() {
    for get_log in [GetLogVariant::Xchg, GetLogVariant::Switch] {
        let config = VmConfig {
            get_log,
            ..VmConfig::default()
        };
        let (vm, v, mem) = big_dirty_vm::<F>(config, false);
        let npages = BIG / PAGE_SIZE;
        let mut words = vec![0u64; bitmap_words(npages)];
        within_bound(&vm, "first GET", K, || {
            vm.get_dirty_log(1, &mut words).unwrap();
        });
        assert_eq!(bitmap_gfns(0, &words), spread(npages), "{get_log:?}");
        within_bound(&vm, "second GET", 0, || {
            vm.get_dirty_log(1, &mut words).unwrap();
        });
        assert!(words.iter().all(|&w| w == 0), "{get_log:?}: marks twice");
        teardown(vm, [v]);
        drop(mem);
    }
}

/// KVM's two GET loops (`xchg-full`, `switch-full`) read every word of the slot, whatever is
/// dirty, and still return exactly the marked pages and re-protect them; pages written again
/// after a GET are returned by the next one (the switch's other side, whose summary bits an
/// earlier full scan left set, included), under every write-protect variant.
pub(crate) fn get_full_reads_every_word_and_returns_exactly_the_marks<F: PteFormat>() {
    for get_log in [GetLogVariant::XchgFull, GetLogVariant::SwitchFull] {
        for &wrprot in WrprotVariant::ALL {
            let config = VmConfig {
                get_log,
                wrprot,
                ..VmConfig::default()
            };
            let (vm, mut v, mem) = big_dirty_vm::<F>(config, false);
            let npages = BIG / PAGE_SIZE;
            let nwords = bitmap_words(npages) as u64;
            let mut words = vec![0u64; nwords as usize];
            let what = format!("{get_log} {wrprot}");
            let get = |words: &mut Vec<u64>| {
                let before = words_read(&vm);
                vm.get_dirty_log(1, words).unwrap();
                assert_eq!(words_read(&vm) - before, nwords, "{what}: the whole slot");
            };
            get(&mut words);
            assert_eq!(bitmap_gfns(0, &words), spread(npages), "{what}");
            for p in spread(npages) {
                assert!(!writable(&vm, BIG + p * PAGE_SIZE), "{what}: page {p}");
            }
            let again: Vec<u64> = spread(npages).into_iter().step_by(5).collect();
            for &p in &again {
                let o = fault(&vm, &mut v, BIG + p * PAGE_SIZE, Access::Write, false);
                assert_eq!(o, FaultOutcome::Fixed, "{what}: page {p}");
            }
            for round in 0..3 {
                get(&mut words);
                let want = if round == 0 { again.clone() } else { vec![] };
                assert_eq!(bitmap_gfns(0, &words), want, "{what}: GET {}", round + 2);
            }
            teardown(vm, [v]);
            drop(mem);
        }
    }
}

/// Manual protection: GET copies, CLEAR of what it returned re-protects; then GET finds
/// nothing. Every step reads O(K) words (CLEAR's re-checks included).
pub(crate) fn manual_get_and_clear_read_only_dirty_words<F: PteFormat>() {
    let (vm, v, mem) = big_dirty_vm::<F>(VmConfig::default(), true);
    let npages = BIG / PAGE_SIZE;
    let mut words = vec![0u64; bitmap_words(npages)];
    within_bound(&vm, "manual GET", K, || {
        vm.get_dirty_log(1, &mut words).unwrap();
    });
    assert_eq!(bitmap_gfns(0, &words), spread(npages));
    within_bound(&vm, "CLEAR", 2 * K, || {
        let n = vm
            .clear_dirty_log(1, PageIndex::new(0), npages, &words)
            .unwrap();
        assert_eq!(n, K);
    });
    for p in spread(npages) {
        assert!(!writable(&vm, BIG + p * PAGE_SIZE), "page {p} after CLEAR");
    }
    within_bound(&vm, "GET after CLEAR", 0, || {
        vm.get_dirty_log(1, &mut words).unwrap();
    });
    assert!(words.iter().all(|&w| w == 0), "CLEAR left marks");
    teardown(vm, [v]);
    drop(mem);
}

/// The pages named by `(word, bits)` pairs.
fn pages_of(words: &[(usize, u64)]) -> Vec<u64> {
    let mut v = Vec::new();
    for &(i, w) in words {
        v.extend(bitmap_gfns(64 * i as u64, &[w]));
    }
    v
}

/// The sparse forms: GET gives the dirty words only, CLEAR takes them; an index past the
/// slot is refused before anything is cleared; the costs are the dense forms'.
pub(crate) fn sparse_get_and_clear_read_only_dirty_words<F: PteFormat>() {
    let npages = BIG / PAGE_SIZE;
    let (vm, v, mem) = big_dirty_vm::<F>(VmConfig::default(), false);
    let mut words = vec![(7, 7)];
    within_bound(&vm, "sparse GET", K, || {
        assert_eq!(vm.get_dirty_log_sparse(1, &mut words).unwrap(), K);
    });
    assert_eq!(pages_of(&words), spread(npages));
    let e = vm.clear_dirty_log_sparse(1, &words).unwrap_err();
    assert_eq!(e, DirtyLogError::ManualProtectOff);
    teardown(vm, [v]);
    drop(mem);

    let (vm, v, mem) = big_dirty_vm::<F>(VmConfig::default(), true);
    within_bound(&vm, "sparse manual GET", K, || {
        vm.get_dirty_log_sparse(1, &mut words).unwrap();
    });
    assert_eq!(pages_of(&words), spread(npages));
    let nwords = bitmap_words(npages);
    let mut bad = words.clone();
    bad.push((nwords, 1));
    let e = vm.clear_dirty_log_sparse(1, &bad).unwrap_err();
    let expect = DirtyLogError::WordOutOfRange {
        id: 1,
        word: nwords,
        nwords,
    };
    assert_eq!(e, expect);
    let mut again = Vec::new();
    vm.get_dirty_log_sparse(1, &mut again).unwrap();
    assert_eq!(again, words, "a refused CLEAR consumed marks");
    let flushes = vm.stats().remote_tlb_flush_requests;
    within_bound(&vm, "sparse CLEAR", 2 * K, || {
        assert_eq!(vm.clear_dirty_log_sparse(1, &words).unwrap(), K);
    });
    assert_eq!(
        vm.stats().remote_tlb_flush_requests,
        flushes + 1,
        "one flush"
    );
    for p in spread(npages) {
        assert!(!writable(&vm, BIG + p * PAGE_SIZE), "page {p} after CLEAR");
    }
    within_bound(&vm, "sparse GET after CLEAR", 0, || {
        assert_eq!(vm.get_dirty_log_sparse(1, &mut again).unwrap(), 0);
    });
    assert!(again.is_empty());
    assert_eq!(
        vm.clear_dirty_log_sparse(1, &[(usize::MAX, !0)])
            .unwrap_err(),
        {
            DirtyLogError::WordOutOfRange {
                id: 1,
                word: usize::MAX,
                nwords,
            }
        }
    );
    teardown(vm, [v]);
    drop(mem);
}
