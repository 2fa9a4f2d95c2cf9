//! Aging racing with vCPUs (hardware walkers setting A/D bits, faults on both paths) and
//! with dirty-log harvests.

use super::*;

/// vCPUs write and read random pages (their walker setting A/D, their faults taking both
/// paths) while two host threads age random ranges over and over, with and without flushes, and
/// test them. Afterwards: the tree is consistent, and no dirty state was lost — with A/D bits
/// every written page's leaf still has D; without them every written page's leaf is still
/// writable or was reported to `on_dirty`.
pub(crate) fn aging_races_with_faults_fast_path_restores_and_hardware_ad_updates<F: PteFormat>() {
    let seed = seed_from_env(0xa9e5);
    eprintln!("seed {seed:#x} (SLAT_TEST_SEED reruns it)");
    for ad in [true, false] {
        for huge in [false, true] {
            let vm = Vm::<F>::new(config(ad));
            let size = 8 * HUGE_2M;
            let mem = HostMem::new(size);
            let gpa = 1u64 << 32;
            let psize = if huge { HUGE_2M } else { PAGE_SIZE };
            vm.add_memslot(
                1,
                Gpa::new(gpa),
                size,
                mem.range(psize),
                MemslotFlags::empty(),
            )
            .unwrap();
            let npages = size >> PAGE_SHIFT;
            let g = gpa >> PAGE_SHIFT;
            let stop = Arc::new(AtomicBool::new(false));
            let reported = Arc::new(Mutex::new(HashSet::new()));
            // Two agers, so passes also race each other on the same leaves.
            let agers: Vec<_> = (0..2u64)
                .map(|k| {
                    let (vm, stop, reported) = (vm.clone(), stop.clone(), reported.clone());
                    std::thread::spawn(move || {
                        let mut rng = Rng::new(seed ^ (0xa6e + k));
                        let (mut passes, mut aged) = (0u64, 0u64);
                        while !stop.load(Ordering::Relaxed) {
                            let lo = g + rng.below(npages);
                            let hi = lo + 1 + rng.below(g + npages - lo);
                            let mut rep = |f: Gfn, n: u64| {
                                let f = f.raw();
                                reported.lock().unwrap().extend(f..f + n);
                            };
                            let r = match rng.below(4) {
                                0 => vm
                                    .clear_flush_young(Gfn::new(lo), Gfn::new(hi), &mut rep)
                                    .unwrap(),
                                1 => vm.test_young(Gfn::new(lo), Gfn::new(hi)),
                                _ => vm.clear_young(Gfn::new(lo), Gfn::new(hi), &mut rep),
                            };
                            aged += r.aged_leaves;
                            passes += 1;
                        }
                        (passes, aged)
                    })
                })
                .collect();
            let deadline = Instant::now() + Duration::from_millis(400);
            let workers: Vec<_> = (0..3u32)
                .map(|t| {
                    let vm = vm.clone();
                    std::thread::spawn(move || {
                        let mut rng = Rng::new(seed.wrapping_add(t as u64 + 1));
                        let mut cpu = HwCpu::new(&vm, t);
                        let mut written = HashSet::new();
                        while Instant::now() < deadline {
                            for _ in 0..256 {
                                let p = rng.below(npages);
                                let a = if rng.chance(1, 2) {
                                    Access::Write
                                } else {
                                    Access::Read
                                };
                                cpu.access(gpa + p * PAGE_SIZE, a);
                                if a == Access::Write {
                                    written.insert(g + p);
                                }
                            }
                        }
                        let fast = cpu.fast;
                        (cpu.finish(), written, fast)
                    })
                })
                .collect();
            let mut vcpus = Vec::new();
            let mut written = HashSet::new();
            let mut fast = 0;
            for w in workers {
                let (v, wr, f) = w.join().expect("worker");
                vcpus.push(v);
                written.extend(wr);
                fast += f;
            }
            stop.store(true, Ordering::Relaxed);
            let (mut passes, mut aged) = (0, 0);
            for a in agers {
                let (p, n) = a.join().expect("ager");
                passes += p;
                aged += n;
            }
            let ctx = format!("ad {ad} huge {huge} seed {seed:#x}");
            assert!(
                passes > 0 && aged > 0,
                "{ctx}: the ager never aged anything"
            );
            if !ad {
                assert!(fast > 0, "{ctx}: no fast-path restore happened");
            }
            let reported = reported.lock().unwrap();
            for &gfn in &written {
                let (l, _) = vm.lookup(Gfn::new(gfn)).expect("written page unmapped");
                check_write_chain::<F>(l, &ctx);
                if ad {
                    assert!(
                        d_bit::<F>(l),
                        "{ctx}: gfn {gfn:#x} written but D clear: {l:#x}"
                    );
                } else {
                    assert!(
                        F::is_writable(l) || reported.contains(&gfn),
                        "{ctx}: gfn {gfn:#x} written, leaf {l:#x} not writable and never reported dirty"
                    );
                }
            }
            check_audit(&vm, &ctx);
            teardown(vm, vcpus);
        }
    }
}

/// In a logged slot, with and without A/D bits: vCPUs write while a host thread ages (no
/// flush) and another harvests the dirty log. Each page's last write must be reported by a
/// harvest that completed after that write began: the fast path restores access-tracked leaves
/// and logs the write, and a harvest after aging cleared W still flushes (its mark was
/// pending), so no write slips through unlogged. (A union of all harvests would hide a write
/// lost late in the run behind an earlier report of the same page.)
pub(crate) fn no_dirty_page_is_lost_when_aging_races_with_harvests<F: PteFormat>() {
    let seed = seed_from_env(0x10c);
    eprintln!("seed {seed:#x} (SLAT_TEST_SEED reruns it)");
    for ad in [false, true] {
        let vm = Vm::<F>::new(config(ad));
        let npages = 2048u64;
        let mem = HostMem::new(npages * PAGE_SIZE);
        let gpa = 1u64 << 31;
        vm.add_memslot(
            1,
            Gpa::new(gpa),
            npages * PAGE_SIZE,
            mem.range(PAGE_SIZE),
            LOG,
        )
        .unwrap();
        let g = gpa >> PAGE_SHIFT;
        let stop = Arc::new(AtomicBool::new(false));
        let ager = {
            let (vm, stop) = (vm.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += vm
                        .clear_young(Gfn::new(g), Gfn::new(g + npages), |_, _| {})
                        .aged_leaves;
                }
                n
            })
        };
        // Harvests completed so far; harvest k (from 1) is the k-th to return.
        let completed = Arc::new(AtomicU64::new(0));
        let harvester = {
            let (vm, stop, completed) = (vm.clone(), stop.clone(), completed.clone());
            std::thread::spawn(move || {
                // Per page, the last harvest that reported it.
                let mut last = vec![0u64; npages as usize];
                let mut w = vec![0u64; bitmap_words(npages)];
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    vm.get_dirty_log(1, &mut w).unwrap();
                    k += 1;
                    for gfn in bitmap_gfns(g, &w) {
                        last[(gfn - g) as usize] = k;
                    }
                    completed.store(k, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_micros(200));
                }
                last
            })
        };
        // 400 ms of writes, and at least 12 harvests during them (a loaded host schedules the
        // harvester rarely), capped at 20 s.
        let deadline = Instant::now() + Duration::from_millis(400);
        let cap = Instant::now() + Duration::from_secs(20);
        let workers: Vec<_> = (0..2u32)
            .map(|t| {
                let (vm, completed) = (vm.clone(), completed.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng::new(seed.wrapping_add(t as u64 * 77 + 1));
                    let mut cpu = HwCpu::new(&vm, t);
                    // Per page: harvests completed before its last write began.
                    let mut written = std::collections::HashMap::new();
                    let more = |c: &AtomicU64| {
                        let now = Instant::now();
                        now < cap && (now < deadline || c.load(Ordering::SeqCst) < 12)
                    };
                    while more(&completed) {
                        for _ in 0..128 {
                            let p = rng.below(npages);
                            let write = rng.chance(2, 3);
                            let before = completed.load(Ordering::SeqCst);
                            if write {
                                cpu.access(gpa + p * PAGE_SIZE, Access::Write);
                                written.insert(p, before);
                            } else {
                                cpu.access(gpa + p * PAGE_SIZE, Access::Read);
                            }
                        }
                    }
                    (cpu.finish(), written)
                })
            })
            .collect();
        let mut vcpus = Vec::new();
        let mut written = std::collections::HashMap::new();
        for w in workers {
            let (v, wr) = w.join().expect("worker");
            vcpus.push(v);
            for (p, b) in wr {
                let e = written.entry(p).or_insert(0);
                *e = (*e).max(b);
            }
        }
        stop.store(true, Ordering::Relaxed);
        let aged = ager.join().expect("ager");
        let mut last = harvester.join().expect("harvester");
        // The final harvest, vCPUs stopped.
        let k = completed.load(Ordering::SeqCst) + 1;
        let mut w = vec![0u64; bitmap_words(npages)];
        vm.get_dirty_log(1, &mut w).unwrap();
        for gfn in bitmap_gfns(g, &w) {
            last[(gfn - g) as usize] = k;
        }
        let lost: Vec<_> = written
            .iter()
            .filter(|&(&p, &before)| last[p as usize] <= before)
            .map(|(&p, _)| g + p)
            .collect();
        assert!(
            lost.is_empty(),
            "ad {ad} seed {seed:#x}: {} pages' last write was never harvested, e.g. {:x?}",
            lost.len(),
            &lost[..lost.len().min(8)]
        );
        assert!(aged > 0, "ad {ad}: the ager never aged anything");
        assert!(k > 10, "ad {ad}: only {k} harvests");
        check_audit(&vm, "aging + harvests");
        teardown(vm, vcpus);
    }
}
