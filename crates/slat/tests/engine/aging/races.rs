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
            fault_race_round::<F>(seed, ad, huge);
        }
    }
}

/// One run of the race above: A/D bits on or off, the slot backed by 4 KiB or 2 MiB host pages.
fn fault_race_round<F: PteFormat>(seed: u64, ad: bool, huge: bool) {
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
            std::thread::spawn(move || ager(&vm, &stop, &reported, seed ^ (0xa6e + k), g, npages))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_millis(400);
    let workers: Vec<_> = (0..3u32)
        .map(|t| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                hw_writer(
                    &vm,
                    seed.wrapping_add(t as u64 + 1),
                    t,
                    gpa,
                    npages,
                    deadline,
                )
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
    check_written_pages(&vm, &written, &reported.lock().unwrap(), ad, &ctx);
    check_audit(&vm, &ctx);
    teardown(vm, vcpus);
}

/// No dirty state was lost: with A/D bits every written page's leaf has D; without them it is
/// still writable or was reported to `on_dirty`.
fn check_written_pages<F: PteFormat>(
    vm: &Vm<F>,
    written: &HashSet<u64>,
    reported: &HashSet<u64>,
    ad: bool,
    ctx: &str,
) {
    for &gfn in written {
        let (l, _) = vm.lookup(Gfn::new(gfn)).expect("written page unmapped");
        check_write_chain::<F>(l, ctx);
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
}

/// One ager thread: random `clear_flush_young` / `test_young` / `clear_young` passes over the
/// slot until `stop`, recording reported dirty GFNs. Returns (passes, leaves aged).
fn ager<F: PteFormat>(
    vm: &Vm<F>,
    stop: &AtomicBool,
    reported: &Mutex<HashSet<u64>>,
    seed: u64,
    g: u64,
    npages: u64,
) -> (u64, u64) {
    let mut rng = Rng::new(seed);
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
}

/// One vCPU whose hardware walker sets A/D: random reads and writes until `deadline`. Returns
/// the vCPU, the GFNs it wrote and how many fast-path restores it made.
fn hw_writer<F: PteFormat>(
    vm: &Arc<Vm<F>>,
    seed: u64,
    t: u32,
    gpa: u64,
    npages: u64,
    deadline: Instant,
) -> (Vcpu<F>, HashSet<u64>, u64) {
    let mut rng = Rng::new(seed);
    let g = gpa >> PAGE_SHIFT;
    let mut cpu = HwCpu::new(vm, t);
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
        harvest_race_round::<F>(seed, ad);
    }
}

/// One run of the race above, with or without A/D bits.
fn harvest_race_round<F: PteFormat>(seed: u64, ad: bool) {
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
        std::thread::spawn(move || young_ager(&vm, &stop, g, npages))
    };
    // Harvests completed so far; harvest k (from 1) is the k-th to return.
    let completed = Arc::new(AtomicU64::new(0));
    let harvester = {
        let (vm, stop, completed) = (vm.clone(), stop.clone(), completed.clone());
        std::thread::spawn(move || harvester(&vm, &stop, &completed, g, npages))
    };
    // 400 ms of writes, and at least 12 harvests during them (a loaded host schedules the
    // harvester rarely), capped at 20 s.
    let deadline = Instant::now() + Duration::from_millis(400);
    let cap = Instant::now() + Duration::from_secs(20);
    let more = move |c: &AtomicU64| {
        let now = Instant::now();
        now < cap && (now < deadline || c.load(Ordering::SeqCst) < 12)
    };
    let workers: Vec<_> = (0..2u32)
        .map(|t| {
            let (vm, completed) = (vm.clone(), completed.clone());
            let seed = seed.wrapping_add(t as u64 * 77 + 1);
            std::thread::spawn(move || logged_writer(&vm, &completed, seed, t, gpa, npages, more))
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

/// The ager thread: `clear_young` over the whole slot until `stop`. Returns the leaves aged.
fn young_ager<F: PteFormat>(vm: &Vm<F>, stop: &AtomicBool, g: u64, npages: u64) -> u64 {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += vm
            .clear_young(Gfn::new(g), Gfn::new(g + npages), |_, _| {})
            .aged_leaves;
    }
    n
}

/// The harvester thread: GET every 200 µs until `stop`, publishing each completed harvest's
/// number. Returns, per page, the last harvest that reported it.
fn harvester<F: PteFormat>(
    vm: &Vm<F>,
    stop: &AtomicBool,
    completed: &AtomicU64,
    g: u64,
    npages: u64,
) -> Vec<u64> {
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
}

/// One vCPU writing (and reading) random pages of the logged slot while `more` says so.
/// Returns the vCPU and, per written page, the harvests completed before its last write began.
fn logged_writer<F: PteFormat>(
    vm: &Arc<Vm<F>>,
    completed: &AtomicU64,
    seed: u64,
    t: u32,
    gpa: u64,
    npages: u64,
    more: impl Fn(&AtomicU64) -> bool,
) -> (Vcpu<F>, std::collections::HashMap<u64, u64>) {
    let mut rng = Rng::new(seed);
    let mut cpu = HwCpu::new(vm, t);
    // Per page: harvests completed before its last write began.
    let mut written = std::collections::HashMap::new();
    while more(completed) {
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
}
