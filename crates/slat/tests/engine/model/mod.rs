//! Randomised map / zap / fault / memslot / dirty-log sequences checked against a reference
//! model after every operation.
//!
//! The model does not predict the engine's page-table shape (leaf sizes depend on tables left
//! behind by earlier zaps, and zapping a straddling huge leaf removes more than was asked). It
//! keeps what must hold whatever the shape:
//! - `maybe`: GFNs that may be mapped — the ranges of leaves installed by faults since the last
//!   zap / delete / move covering them. A mapped GFN outside it is a stale translation (zap or
//!   memslot change that did not remove it); every mapped GFN must lie in a slot and translate
//!   to that slot's host page; a GFN just faulted must be mapped.
//! - leaf size: never above what the host page size, the slot's edges and guest/host
//!   congruence allow; 4 KiB only in dirty-logged slots (invariant 7).
//! - permissions: W ⇒ MMU-writable ⇒ host-writable, nothing writable in a read-only slot
//!   (invariant 6), and in a logged slot every writable page is one the guest wrote (or at
//!   least accessed) since the last harvest (invariant 3).
//! - dirty logs: a harvest returns every page written since the last one (and only pages
//!   accessed since), moves included (a moved slot keeps its log), and leaves nothing writable
//!   in the slot (invariant 4).
//! - bookkeeping: the tree audit equals the statistics, nothing is frozen, fault counters move
//!   by one per fault, anything that removes translations flushes.
//!
//! `SLAT_TEST_SEED=<n>` runs one seed (the failure message prints it); `SLAT_TEST_OPS=<n>`
//! changes the number of operations per seed.
#![cfg(not(loom))]

use crate::common;

use common::*;
use slat::hw::{bytes_per_entry, pages_per_entry};
use slat::{
    Access, Fault, FaultOutcome, GetLogVariant, HostRange, MemslotError, MemslotFlags, MmuLockKind,
    PteFormat, RecoverVariant, Vcpu, Vm, VmConfig, WrprotVariant,
};
use slat_addr::{Gfn, Gpa, PAGE_SHIFT, PAGE_SIZE};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod checks;
mod guest_ops;
mod slot_ops;

const LOG: MemslotFlags = MemslotFlags::LOG_DIRTY_PAGES;
const RO: MemslotFlags = MemslotFlags::READONLY;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Guest physical space the test plays in.
const GUEST_SPACE: u64 = 16 * GIB;

both_formats! {
    random_operations_match_the_model,
}

/// Disjoint half-open GFN ranges.
#[derive(Debug, Default)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn insert(&mut self, mut s: u64, mut e: u64) {
        let hit: Vec<(u64, u64)> = self
            .0
            .range(..=e)
            .rev()
            .take_while(|(_, &end)| end >= s)
            .map(|(&k, &v)| (k, v))
            .collect();
        for (k, v) in hit {
            self.0.remove(&k);
            s = s.min(k);
            e = e.max(v);
        }
        self.0.insert(s, e);
    }

    fn remove(&mut self, s: u64, e: u64) {
        let hit: Vec<(u64, u64)> = self
            .0
            .range(..e)
            .rev()
            .take_while(|(_, &end)| end > s)
            .map(|(&k, &v)| (k, v))
            .collect();
        for (k, v) in hit {
            self.0.remove(&k);
            if k < s {
                self.0.insert(k, s);
            }
            if v > e {
                self.0.insert(e, v);
            }
        }
    }

    fn contains(&self, g: u64) -> bool {
        self.0
            .range(..=g)
            .next_back()
            .is_some_and(|(_, &end)| end > g)
    }
}

/// A memslot the test can place: fixed host memory, a list of guest positions.
struct Template {
    id: u32,
    /// The host memory; the slot is `[offset, offset + size)` of it.
    mem: HostMem,
    offset: u64,
    size: u64,
    page_size: u64,
    positions: Vec<u64>,
    can_log: bool,
    /// Small enough to check every page in a sweep.
    small: bool,
}

impl Template {
    /// Host address of the slot's first byte.
    fn host(&self) -> u64 {
        self.mem.addr() + self.offset
    }

    /// The slot's host memory, which the memslot keeps alive.
    fn range(&self) -> HostRange {
        self.mem.sub_range(self.offset, self.size, self.page_size)
    }

    /// The model of a new slot (template `tpl`, this one) at `gpa`.
    fn slot_model(&self, tpl: usize, gpa: u64, flags: MemslotFlags) -> SlotM {
        SlotM {
            tpl,
            id: self.id,
            base: gpa >> PAGE_SHIFT,
            npages: self.size >> PAGE_SHIFT,
            host: self.host(),
            page_size: self.page_size,
            flags,
            written: BTreeSet::new(),
            accessed: BTreeSet::new(),
        }
    }
}

#[derive(Debug)]
struct SlotM {
    tpl: usize,
    id: u32,
    base: u64,
    npages: u64,
    host: u64,
    page_size: u64,
    flags: MemslotFlags,
    /// Pages written (write faults resolved) since logging started or the last harvest.
    written: BTreeSet<u64>,
    /// Pages read or executed in that time.
    accessed: BTreeSet<u64>,
}

impl SlotM {
    fn end(&self) -> u64 {
        self.base + self.npages
    }
    fn contains(&self, g: u64) -> bool {
        g >= self.base && g < self.end()
    }
    fn hva(&self, g: u64) -> u64 {
        self.host + ((g - self.base) << PAGE_SHIFT)
    }
    fn ro(&self) -> bool {
        self.flags.contains(RO)
    }
    fn logging(&self) -> bool {
        logs(self.flags)
    }
    /// The largest leaf the backing allows at `g`, ignoring dirty logging.
    fn max_level(&self, g: u64) -> u8 {
        for level in [3u8, 2] {
            let pages = pages_per_entry(level);
            let first = g & !(pages - 1);
            if self.page_size >= bytes_per_entry(level)
                && first >= self.base
                && first + pages <= self.end()
                && ((self.hva(g) >> PAGE_SHIFT) & (pages - 1)) == (g & (pages - 1))
            {
                return level;
            }
        }
        1
    }
}

fn logs(flags: MemslotFlags) -> bool {
    flags.contains(LOG) && !flags.contains(RO)
}

/// What the runs exercised, summed over seeds (so the test cannot pass vacuously).
#[derive(Default)]
struct Coverage {
    leaves_seen: [AtomicU64; 3],
    outcomes: [AtomicU64; 7],
    harvested: AtomicU64,
    refused: AtomicU64,
    zapped: AtomicU64,
    moved: AtomicU64,
}

fn outcome_index(o: FaultOutcome) -> usize {
    match o {
        FaultOutcome::Fixed => 0,
        FaultOutcome::FixedFast => 1,
        FaultOutcome::Spurious => 2,
        FaultOutcome::Retry => 3,
        FaultOutcome::NoSlot => 4,
        FaultOutcome::ReadOnly => 5,
        FaultOutcome::DirtyRingFull => 6,
        FaultOutcome::InGuestMode => unreachable!("checked by the caller"),
        FaultOutcome::MemoryFault { .. } => unreachable!("the model has no private memory"),
    }
}

struct Run<'a, F: PteFormat> {
    seed: u64,
    op: usize,
    what: String,
    cfg: VmConfig,
    vm: Arc<Vm<F>>,
    vcpus: Vec<Vcpu<F>>,
    rng: Rng,
    tpls: &'a [Template],
    slots: BTreeMap<u32, SlotM>,
    maybe: Ranges,
    /// Recently faulted GFNs: faults revisit them (permission upgrades, spurious faults, the
    /// fast path, pages written twice between harvests).
    recent: Vec<u64>,
    cov: &'a Coverage,
}

/// 2 GiB of reserved, 1 GiB-aligned host memory for template 5, shared by every seed and
/// never written (only mapped: stage-2 cache maintenance reads what a fault maps, so each seed
/// would otherwise pay for faulting in 2 GiB of zero pages again). Lives until the process
/// exits.
fn gib_backing() -> HostMem {
    static MEM: std::sync::OnceLock<HostMem> = std::sync::OnceLock::new();
    MEM.get_or_init(|| HostMem::reserve(2 * GIB, HUGE_1G))
        .clone()
}

/// The templates of a seed; each holds its host memory (and each memslot over it, its part).
struct Backing {
    tpls: Vec<Template>,
}

/// The memslot templates: a data table, one entry per host-memory shape the model exercises,
/// so longer than a function should be.
fn templates() -> Backing {
    let huge = HostMem::new(8 * MIB);
    let small = HostMem::new(6 * MIB);
    let skew = HostMem::new(4 * MIB + PAGE_SIZE);
    let edges = HostMem::new(6 * MIB);
    let tiny = HostMem::new(130 * PAGE_SIZE);
    let tpls = vec![
        // 2 MiB host pages, aligned guest positions: 2 MiB leaves.
        Template {
            id: 1,
            mem: huge,
            offset: 0,
            size: 8 * MIB,
            page_size: HUGE_2M,
            positions: vec![0, 16 * MIB, GIB, GIB + 8 * MIB, 3 * GIB - 2 * MIB],
            can_log: true,
            small: true,
        },
        // 4 KiB host pages; an odd page count (partial last bitmap word); one position
        // straddles a 1 GiB boundary, one overlaps slot 1's positions.
        Template {
            id: 2,
            mem: small,
            offset: 0,
            size: 6 * MIB - 3 * PAGE_SIZE,
            page_size: PAGE_SIZE,
            positions: vec![8 * MIB, 16 * MIB + 0x3000, 4 * GIB - MIB, 64 * MIB],
            can_log: true,
            small: true,
        },
        // 2 MiB host pages, but the host address is 4 KiB off a 2 MiB boundary while every
        // guest position is aligned: never congruent, always 4 KiB.
        Template {
            id: 3,
            mem: skew,
            offset: PAGE_SIZE,
            size: 4 * MIB,
            page_size: HUGE_2M,
            positions: vec![32 * MIB, GIB + 2 * MIB, 128 * MIB],
            can_log: true,
            small: true,
        },
        // 2 MiB host pages, congruent, but starting 4 KiB into a frame and ending 4 KiB short:
        // only the middle frame can be huge.
        Template {
            id: 4,
            mem: edges,
            offset: PAGE_SIZE,
            size: 6 * MIB - 2 * PAGE_SIZE,
            page_size: HUGE_2M,
            positions: vec![
                40 * MIB + PAGE_SIZE,
                GIB + 16 * MIB + PAGE_SIZE,
                36 * MIB + PAGE_SIZE,
            ],
            can_log: true,
            small: true,
        },
        // Reserved 1 GiB-paged host memory (never written): 1 GiB leaves at aligned positions,
        // 2 MiB leaves at the 2 MiB-congruent one. Not logged (a split is 262144 leaves).
        Template {
            id: 5,
            mem: gib_backing(),
            offset: 0,
            size: 2 * GIB,
            page_size: HUGE_1G,
            positions: vec![4 * GIB, 8 * GIB, 12 * GIB + 2 * MIB, 3 * GIB],
            can_log: false,
            small: false,
        },
        Template {
            id: 6,
            mem: tiny,
            offset: 0,
            size: 130 * PAGE_SIZE,
            page_size: PAGE_SIZE,
            positions: vec![20 * MIB, 48 * MIB - 64 * PAGE_SIZE, GIB - PAGE_SIZE * 130],
            can_log: true,
            small: true,
        },
    ];
    Backing { tpls }
}

fn config_for(seed: u64) -> VmConfig {
    // The write-protect variant changes every 7 seeds, the rest cycles every 7: seed mod 28
    // is (variant, configuration), so 28 consecutive seeds pair each of the four variants with
    // each configuration exactly once.
    let d = VmConfig {
        wrprot: WrprotVariant::ALL[(seed / 7) as usize % WrprotVariant::ALL.len()],
        ..VmConfig::default()
    };
    match seed % 7 {
        // KVM's whole-slot GET loops ride along with two other variants.
        5 => VmConfig {
            recover: RecoverVariant::Zap,
            get_log: GetLogVariant::XchgFull,
            ..d
        },
        6 => VmConfig {
            get_log: GetLogVariant::Switch,
            ..d
        },
        0 => d,
        1 => VmConfig {
            fast_pf: false,
            ..d
        },
        2 => VmConfig {
            eager_split: false,
            get_log: GetLogVariant::SwitchFull,
            ..d
        },
        3 => VmConfig {
            mmu_lock: MmuLockKind::Mutex,
            ..d
        },
        _ => VmConfig {
            ad_bits: false,
            ..d
        },
    }
}

fn run_seed<F: PteFormat>(seed: u64, ops: usize, cov: &Coverage) {
    let backing = templates();
    let cfg = config_for(seed);
    let vm = Vm::<F>::new(cfg);
    let vcpus = vec![vm.create_vcpu(0), vm.create_vcpu(1)];
    let mut run = Run {
        seed,
        op: 0,
        what: "start".into(),
        cfg,
        vm,
        vcpus,
        rng: Rng::new(seed),
        tpls: &backing.tpls,
        slots: BTreeMap::new(),
        maybe: Ranges::default(),
        recent: Vec::new(),
        cov,
    };
    // Start with a few slots so the first faults land somewhere.
    for _ in 0..4 {
        run.add();
    }
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for i in 0..ops {
            run.op = i;
            run.step();
            // The reverse map against the tree after every operation (every leaf in it with
            // its table, nothing else; empty with `walk`).
            if let Err(e) = run.vm.audit_rmap() {
                panic!("rmap audit after {}: {e}", run.what);
            }
            if i % 64 == 0 {
                run.audit();
            }
            if i % 500 == 499 {
                run.what = "sweep".into();
                run.sweep();
            }
        }
        run.what = "final sweep".into();
        run.sweep();
    }));
    if let Err(e) = outcome {
        eprintln!(
            "model test ({}) failed at seed {seed:#x}, op {} ({}); rerun with SLAT_TEST_SEED={seed:#x}",
            F::NAME, run.op, run.what
        );
        std::panic::resume_unwind(e);
    }
    let Run { vm, vcpus, .. } = run;
    teardown(vm, vcpus);
    drop(backing);
}

fn random_operations_match_the_model<F: PteFormat>() {
    let ops: usize = std::env::var("SLAT_TEST_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000);
    // Stage-2 cleans the caches over every new mapping, and a 1 GiB leaf of template 5 is
    // 16 Mi cache-line operations (twice for an instruction fetch): a seed costs ~25 times
    // what it costs on EPT. Seven seeds there: each `config_for` variant once (it cycles
    // every 7 seeds).
    let nseeds = if F::CACHE_MAINTENANCE {
        7
    } else {
        7 * WrprotVariant::ALL.len() as u64
    };
    let seeds: Vec<u64> = match std::env::var("SLAT_TEST_SEED") {
        Ok(_) => vec![seed_from_env(0)],
        Err(_) => (0..nseeds).map(|i| 0x51a7_0000 + i).collect(),
    };
    let cov = Coverage::default();
    let next = AtomicU64::new(0);
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .min(seeds.len());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&seed) = seeds.get(i) else { break };
                run_seed::<F>(seed, ops, &cov);
            });
        }
    });
    let l = |i: usize| cov.leaves_seen[i].load(Ordering::Relaxed);
    let o = |i: usize| cov.outcomes[i].load(Ordering::Relaxed);
    eprintln!(
        "model coverage ({}): leaves seen 4K/2M/1G {}/{}/{}, outcomes fixed {} fast {} spurious {} \
         retry {} noslot {} readonly {}, harvested {}, refused {}, zaps {}, moves {}",
        F::NAME,
        l(0),
        l(1),
        l(2),
        o(0),
        o(1),
        o(2),
        o(3),
        o(4),
        o(5),
        cov.harvested.load(Ordering::Relaxed),
        cov.refused.load(Ordering::Relaxed),
        cov.zapped.load(Ordering::Relaxed),
        cov.moved.load(Ordering::Relaxed),
    );
    if seeds.len() > 1 && ops >= 1000 {
        for (what, n) in [
            ("4 KiB leaves", l(0)),
            ("2 MiB leaves", l(1)),
            ("1 GiB leaves", l(2)),
            ("Fixed", o(0)),
            ("FixedFast", o(1)),
            ("Spurious", o(2)),
            ("NoSlot", o(4)),
            ("ReadOnly", o(5)),
            ("harvested pages", cov.harvested.load(Ordering::Relaxed)),
            ("refused requests", cov.refused.load(Ordering::Relaxed)),
            (
                "zaps that removed something",
                cov.zapped.load(Ordering::Relaxed),
            ),
            ("moves", cov.moved.load(Ordering::Relaxed)),
        ] {
            assert!(n > 0, "the random runs never produced {what}");
        }
    }
}

// Tests the test's own range model: no page table, no format.
#[test]
fn ranges_model_merges_and_splits() {
    let mut r = Ranges::default();
    r.insert(10, 20);
    r.insert(20, 30);
    r.insert(40, 50);
    assert_eq!(
        r.0.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(10, 30), (40, 50)]
    );
    r.remove(15, 45);
    assert_eq!(
        r.0.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(10, 15), (45, 50)]
    );
    assert!(r.contains(10) && r.contains(14) && !r.contains(15) && !r.contains(44));
    assert!(r.contains(49) && !r.contains(50) && !r.contains(9));
    r.insert(0, 100);
    r.remove(0, 1);
    assert_eq!(
        r.0.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(1, 100)]
    );
}
