//! The dirty ring's per-harvest guarantee, checked harvest by harvest (not only the final
//! contents): *a write completed before a harvest starts is reported by that harvest*, unless
//! an earlier harvest that overlapped the write reported it (invariants 3 and 4 for rings).
//!
//! Several vCPU threads on the simulated hardware ([`Cpu`]) write random pages of a small
//! logged memslot, often so few that vCPUs fault on the same entries at once (one vCPU's
//! write fix racing another vCPU's write through the entry it just made writable),
//! while the host thread harvests (collects every ring, then resets) at random short intervals.
//! The rings are small, so vCPUs also take ring-full exits, whose handler harvests and resets
//! into a list the host's next harvest takes.
//!
//! The oracle: the host counts harvest starts (`started`) and ends (`ended`). A vCPU reads
//! `ended` (`b`) before a write and `started` (`c`) after it, then records `(b, c)` for the
//! page. The write began after harvest `b` returned and was complete before harvest `c + 1`
//! began, so one of harvests `b + 1 ..= c + 1` must report the page; with no harvest in
//! between (`b == c`), exactly harvest `b + 1`. The host checks every record as soon as the
//! harvests it names have returned.
//!
//! Control: `SLAT_TEST_SEED` (hex; random if unset; printed at the start and in every failure;
//! a round's own seed replays its configuration as round 0) and `SLAT_RING_ORACLE_SECS` (per
//! format and fast-path setting, default 8).
//!
//! ```text
//! SLAT_RING_ORACLE_SECS=120 cargo test --profile ci -p slat-machine --test oracles ring_oracle:: -- --nocapture
//! ```

use slat::MemslotFlags;
use slat::{HostRange, MmuLockKind, PteFormat, SlotId, Vm, VmConfig, WrprotVariant};
use slat_addr::PAGE_SIZE;
use slat_addr::{Gpa, PageIndex};
use slat_machine::sched::PcpuPool;
use slat_machine::{Cpu, RingFullHandler};
use slat_workload::{Backing, GuestRam};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

both_formats! {
    every_write_is_in_the_next_ring_harvest,
}

const SLOT: SlotId = 1;
const GPA: u64 = 1 << 30;
/// Pages of the logged slot: more than a small ring's soft limit, so rings fill up.
const PAGES: u64 = 512;
const WORDS: usize = (PAGES / 64) as usize;

/// `SLAT_TEST_SEED` (hex, `0x` optional), else a fresh one from the clock.
fn base_seed() -> u64 {
    if let Ok(s) = std::env::var("SLAT_TEST_SEED") {
        return u64::from_str_radix(s.trim().trim_start_matches("0x"), 16)
            .unwrap_or_else(|e| panic!("SLAT_TEST_SEED={s:?} is not hex: {e}"));
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    mix(t ^ u64::from(std::process::id()))
}

/// `SLAT_RING_ORACLE_SECS`, per format and fast-path setting.
fn run_secs() -> f64 {
    std::env::var("SLAT_RING_ORACLE_SECS")
        .ok()
        .map(|s| {
            s.trim()
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("SLAT_RING_ORACLE_SECS={s:?}: {e}"))
        })
        .unwrap_or(8.0)
}

// One test at a time across both oracles (`crate::SERIAL`).
use crate::SERIAL;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// splitmix64's finaliser.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xorshift64*: small and reproducible.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(mix(seed) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// One round's configuration, all drawn from its seed.
#[derive(Debug, Clone, Copy)]
struct RoundCfg {
    seed: u64,
    fast_pf: bool,
    vcpus: usize,
    ring_entries: u32,
    wrprot: WrprotVariant,
    mmu_lock: MmuLockKind,
    tlb_entries: usize,
    /// Longest pause between two harvests.
    max_gap_us: u64,
    /// The vCPUs write pages `0..span`, so that after each reset they fault on the same
    /// entries at once (small spans) or push more entries than a small ring holds (large).
    span: u64,
}

impl RoundCfg {
    fn draw(seed: u64, fast_pf: bool) -> Self {
        let mut r = Rng::new(seed);
        RoundCfg {
            seed,
            fast_pf,
            // More vCPUs than host CPUs too: a vCPU preempted inside a write fix widens
            // the window in which another one writes through the entry it just fixed.
            vcpus: 2 + r.below(3) as usize,
            ring_entries: r.pick(&[128, 256]),
            wrprot: r.pick(WrprotVariant::ALL),
            mmu_lock: r.pick(MmuLockKind::ALL),
            tlb_entries: r.pick(&[4, 64]),
            max_gap_us: r.pick(&[0, 0, 20, 200]),
            span: r.pick(&[16, 64, PAGES, PAGES, PAGES]),
        }
    }
}

/// What the vCPUs and the host share.
struct Shared {
    /// Harvests begun / returned (harvest `h` is the `h`-th, 1-based).
    started: AtomicU64,
    ended: AtomicU64,
    stop: AtomicBool,
    /// Per page, the latest write's `(b, c)` (`b << 32 | c`), and the latest write with no
    /// harvest during it (`b == c`, stored as `b + 1`; 0: none): a hot page's latest write
    /// usually overlaps a harvest, the second record keeps the exact case checked too.
    any: Vec<AtomicU64>,
    idle: Vec<AtomicU64>,
    writes: AtomicU64,
    failure: Mutex<Option<String>>,
    /// Ring entries taken by ring-full exits. Its lock is held across a whole collect and
    /// reset (by the host and by exit handlers), so the host never misses an entry an exit
    /// handler took from under it.
    reaped: Mutex<Vec<(SlotId, u64)>>,
}

impl Shared {
    fn fail(&self, msg: String) {
        lock(&self.failure).get_or_insert(msg);
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn ring_full_handler<F: PteFormat>(vm: &Arc<Vm<F>>, sh: &Arc<Shared>) -> RingFullHandler {
    let (vm, sh) = (vm.clone(), sh.clone());
    Arc::new(move || {
        let mut out = lock(&sh.reaped);
        for r in vm.dirty_rings() {
            r.harvest(|s, o| out.push((s, o.raw())));
        }
        if let Err(e) = vm.reset_dirty_rings() {
            sh.fail(format!("ring-full exit: reset_dirty_rings: {e}"));
        }
    })
}

/// A vCPU: writes pages and records each completed write's `(b, c)`.
fn vcpu_loop<F: PteFormat>(cpu: &mut Cpu<F>, sh: &Shared, span: u64, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut n = 0u64;
    cpu.enter();
    while !sh.stop.load(Ordering::Relaxed) {
        let page = rng.below(span);
        let b = sh.ended.load(Ordering::SeqCst);
        n += 1;
        if let Err(e) = cpu.write_u64(GPA + page * PAGE_SIZE, n) {
            sh.fail(format!("write of page {page}: {e:?}"));
            break;
        }
        let c = sh.started.load(Ordering::SeqCst);
        sh.any[page as usize].store(b << 32 | c, Ordering::SeqCst);
        if b == c {
            sh.idle[page as usize].fetch_max(b + 1, Ordering::SeqCst);
        }
    }
    sh.writes.fetch_add(n, Ordering::Relaxed);
    cpu.exit();
}

/// One harvest: collect every ring and the entries exits reaped, then reset.
fn harvest<F: PteFormat>(vm: &Vm<F>, sh: &Shared) -> Result<[u64; WORDS], String> {
    let mut set = [0u64; WORDS];
    let mut add = |s: SlotId, o: u64| {
        if s == SLOT && o < PAGES {
            set[(o / 64) as usize] |= 1 << (o % 64);
        }
    };
    let mut reaped = lock(&sh.reaped);
    for r in vm.dirty_rings() {
        r.harvest(|s, o: PageIndex| add(s, o.raw()));
    }
    for (s, o) in reaped.drain(..) {
        add(s, o);
    }
    vm.reset_dirty_rings()
        .map_err(|e| format!("reset_dirty_rings: {e}"))?;
    drop(reaped);
    Ok(set)
}

/// The host's checker: which records it has checked, and what every harvest reported.
struct Checker {
    sets: Vec<[u64; WORDS]>,
    any_seen: Vec<u64>,
    idle_seen: Vec<u64>,
    checks: u64,
}

impl Checker {
    fn reported(&self, h: u64, page: u64) -> bool {
        self.sets[(h - 1) as usize][(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    /// Checks every new record whose harvests have all returned (`h` is the last one).
    fn check(&mut self, sh: &Shared, h: u64) -> Result<(), String> {
        for p in 0..PAGES {
            let i = p as usize;
            let due = sh.idle[i].load(Ordering::SeqCst);
            if due != 0 && due <= h && due != self.idle_seen[i] {
                self.idle_seen[i] = due;
                self.checks += 1;
                if !self.reported(due, p) {
                    let later = (due + 1..=h).find(|&j| self.reported(j, p));
                    return Err(format!(
                        "page {p} was written between harvests {} and {due} (no harvest \
                         during the write) but harvest {due} did not report it (first \
                         reported by harvest {later:?}, last harvest {h})",
                        due - 1
                    ));
                }
            }
            let r = sh.any[i].load(Ordering::SeqCst);
            let (b, c) = (r >> 32, r & 0xffff_ffff);
            if r != self.any_seen[i] && c < h {
                self.any_seen[i] = r;
                self.checks += 1;
                if !(b + 1..=c + 1).any(|j| self.reported(j, p)) {
                    return Err(format!(
                        "page {p} was written after harvest {b} returned and before harvest \
                         {} began, but none of harvests {}..={} reported it",
                        c + 1,
                        b + 1,
                        c + 1
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A VM logging into rings of `cfg.ring_entries`, with the checked slot.
fn new_vm<F: PteFormat>(cfg: &RoundCfg) -> Result<Arc<Vm<F>>, String> {
    let vm = Vm::<F>::new(VmConfig {
        fast_pf: cfg.fast_pf,
        wrprot: cfg.wrprot,
        mmu_lock: cfg.mmu_lock,
        ..VmConfig::default()
    });
    vm.enable_dirty_ring(cfg.ring_entries, false)
        .map_err(|e| format!("enable_dirty_ring: {e}"))?;
    let ram = Arc::new(
        GuestRam::new(Backing::Anonymous, PAGES * PAGE_SIZE, true)
            .map_err(|e| format!("guest ram: {e}"))?,
    );
    let host = HostRange::new(ram).map_err(|e| format!("host range: {e}"))?;
    let log = MemslotFlags::LOG_DIRTY_PAGES;
    vm.add_memslot(SLOT, Gpa::new(GPA), PAGES * PAGE_SIZE, host, log)
        .map_err(|e| format!("add_memslot: {e}"))?;
    Ok(vm)
}

/// Starts the vCPU threads; each adds its ring-full exits to `exits` when it stops.
fn start_vcpus<F: PteFormat>(
    vm: &Arc<Vm<F>>,
    sh: &Arc<Shared>,
    cfg: &RoundCfg,
    exits: &Arc<AtomicU64>,
) -> Vec<std::thread::JoinHandle<()>> {
    let pcpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = Arc::new(PcpuPool::new(pcpus));
    (0..cfg.vcpus)
        .map(|v| {
            let mut cpu = Cpu::new(vm.clone(), v as u32, cfg.tlb_entries, pool.clone())
                .expect("a power-of-two TLB size");
            cpu.set_ring_full_handler(ring_full_handler(vm, sh));
            let (sh, exits) = (sh.clone(), exits.clone());
            let (span, seed) = (cfg.span, cfg.seed ^ mix(v as u64 + 1));
            std::thread::spawn(move || {
                let mut cpu = cpu;
                vcpu_loop(&mut cpu, &sh, span, seed);
                exits.fetch_add(cpu.counters.ring_full_exits, Ordering::Relaxed);
            })
        })
        .collect()
}

/// Runs one round for `secs`; returns (harvests, checks, writes, ring-full exits).
fn round<F: PteFormat>(cfg: RoundCfg, secs: f64) -> Result<(u64, u64, u64, u64), String> {
    let vm = new_vm::<F>(&cfg)?;
    let sh = Arc::new(Shared {
        started: AtomicU64::new(0),
        ended: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        any: (0..PAGES).map(|_| AtomicU64::new(0)).collect(),
        idle: (0..PAGES).map(|_| AtomicU64::new(0)).collect(),
        writes: AtomicU64::new(0),
        failure: Mutex::new(None),
        reaped: Mutex::new(Vec::new()),
    });
    let exits = Arc::new(AtomicU64::new(0));
    let threads = start_vcpus(&vm, &sh, &cfg, &exits);
    let mut chk = Checker {
        sets: Vec::new(),
        any_seen: vec![0; PAGES as usize],
        idle_seen: vec![0; PAGES as usize],
        checks: 0,
    };
    let mut rng = Rng::new(cfg.seed ^ 0x4057);
    let t0 = Instant::now();
    let mut h = 0;
    while t0.elapsed().as_secs_f64() < secs && !sh.stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_micros(rng.below(cfg.max_gap_us + 1)));
        h += 1;
        sh.started.store(h, Ordering::SeqCst);
        match harvest(&*vm, &sh) {
            Ok(set) => chk.sets.push(set),
            Err(e) => {
                sh.fail(e);
                break;
            }
        }
        // Before `ended` moves on: no write can yet record `b == h`, so none overwrites
        // an idle record due now before it is checked.
        if let Err(e) = chk.check(&sh, h) {
            sh.fail(e);
        }
        sh.ended.store(h, Ordering::SeqCst);
    }
    sh.stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().map_err(|_| "a vCPU thread panicked".to_string())?;
    }
    if let Some(f) = lock(&sh.failure).take() {
        return Err(f);
    }
    Ok((
        h,
        chk.checks,
        sh.writes.load(Ordering::Relaxed),
        exits.load(Ordering::Relaxed),
    ))
}

fn every_write_is_in_the_next_ring_harvest<F: PteFormat>() {
    let _serial = lock(&SERIAL);
    let base = base_seed();
    let secs = run_secs();
    let fmt = std::any::type_name::<F>();
    eprintln!("ring oracle {fmt}: SLAT_TEST_SEED={base:#x}, {secs} s per fast-path setting");
    let mut exits = 0;
    for fast_pf in [false, true] {
        let (mut rounds, mut harvests, mut checks, mut writes) = (0, 0, 0, 0);
        let exits_before = exits;
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < secs {
            let seed = if rounds == 0 {
                base
            } else {
                mix(base ^ rounds)
            };
            let cfg = RoundCfg::draw(seed, fast_pf);
            let left = secs - t0.elapsed().as_secs_f64();
            match round::<F>(cfg, left.min(0.5)) {
                Ok((h, c, w, x)) => {
                    harvests += h;
                    checks += c;
                    writes += w;
                    exits += x;
                }
                Err(e) => panic!(
                    "{fmt}: {e}\n  round {rounds}: {cfg:?}\n  replay: SLAT_TEST_SEED={seed:#x}"
                ),
            }
            rounds += 1;
        }
        eprintln!(
            "ring oracle {fmt} fast_pf={fast_pf}: {rounds} rounds, {harvests} harvests, \
             {checks} records checked, {writes} writes, {} ring-full exits",
            exits - exits_before
        );
        assert!(
            harvests > 0 && checks > 0 && writes > 0,
            "nothing was checked"
        );
    }
    assert!(exits > 0, "no vCPU ever took a ring-full exit");
}
