//! The experiments: each seed's rows as one of slat's own benchmarks, the flags of the change
//! (before → after), the figure read from its report, and its size at three scales — the
//! seed's own (for `--clock virtual`), this host's (`--clock real`) and `--quick`'s.

use super::published::{self as p, Claim};
use serde::Serialize;

/// The benchmark an experiment runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bench {
    DirtyLogPerf,
    AccessTrackingPerf,
    PageTableTest,
    PrivateMemPerf,
}

impl Bench {
    /// Every benchmark an experiment can run.
    pub const ALL: [Bench; 4] = [
        Bench::DirtyLogPerf,
        Bench::AccessTrackingPerf,
        Bench::PageTableTest,
        Bench::PrivateMemPerf,
    ];

    /// Its subcommand.
    pub fn name(self) -> &'static str {
        match self {
            Bench::DirtyLogPerf => "dirty-log-perf",
            Bench::AccessTrackingPerf => "access-tracking-perf",
            Bench::PageTableTest => "page-table-test",
            Bench::PrivateMemPerf => "private-mem-perf",
        }
    }
}

/// The size of a run at each scale (flags).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Scale {
    /// The seed's own machine: vCPUs and memory as the thread measured.
    pub seed: &'static str,
    /// This host: 1-2 vCPUs, memory that fits beside the native baselines.
    pub host: &'static str,
    /// `--quick`: seconds per seed.
    pub quick: &'static str,
    /// Why the host's run differs from the seed's beyond size ("" if only in size).
    pub note: &'static str,
    /// What `--clock virtual` runs instead of `seed` unless `--full-scale` is given: the
    /// seed's own scale does not fit `reproduce all`'s time budget.
    pub reduced: Option<Reduced>,
}

/// A smaller seed scale for `--clock virtual`, and why.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Reduced {
    pub flags: &'static str,
    /// What was scaled, why the ratio still means what the seed's does, and the full scale's
    /// time (printed with the row).
    pub note: &'static str,
}

/// Which scale a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Size {
    /// The seed's scale, or its [`Reduced`] one where it has one.
    Seed,
    /// The seed's own scale everywhere (`--full-scale`).
    Full,
    Host,
    Quick,
}

impl Scale {
    pub fn flags(&self, s: Size) -> &'static str {
        match (s, self.reduced) {
            (Size::Seed, Some(r)) => r.flags,
            (Size::Seed | Size::Full, _) => self.seed,
            (Size::Host, _) => self.host,
            (Size::Quick, _) => self.quick,
        }
    }

    /// How the runs at `s` differ from the seed's beyond size ("" if they do not).
    pub fn note(&self, s: Size) -> &'static str {
        match (s, self.reduced) {
            (Size::Seed, Some(r)) => r.note,
            (Size::Seed | Size::Full, _) => "",
            (Size::Host | Size::Quick, _) => self.note,
        }
    }
}

/// What one row reads from the report.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Figure {
    /// The metric's name in the benchmark's `metrics()`.
    pub metric: &'static str,
    /// Divided by the guest's 4 KiB pages and shown in ns per page.
    pub per_page: bool,
}

/// One row of a seed's table.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Experiment {
    pub seed: &'static str,
    /// The row as the thread names it.
    pub row: &'static str,
    pub bench: Bench,
    /// Flags at every scale.
    pub fixed: &'static str,
    pub scale: Scale,
    /// The change: flags before and after.
    pub before: &'static str,
    pub after: &'static str,
    pub figure: Figure,
    pub published: Claim,
}

impl Experiment {
    /// The benchmark's arguments (without the subcommand) before or after the change.
    pub fn args(&self, size: Size, after: bool) -> String {
        let change = if after { self.after } else { self.before };
        let parts = [self.scale.flags(size), self.fixed, change];
        parts
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ")
    }
}

const fn metric(metric: &'static str) -> Figure {
    Figure {
        metric,
        per_page: false,
    }
}

const FAST_PF: (&str, &str) = ("--fast-pf off", "--fast-pf on");
const CMO: (&str, &str) = (
    "--cmo always --rebuild break-first",
    "--cmo on-install --rebuild break-first",
);
const REBUILD: (&str, &str) = (
    "--cmo on-install --rebuild break-first",
    "--cmo on-install --rebuild install-first",
);
// 002's kernel (3.11, 2013) had no TDP MMU: its GET write-protected each dirty page through
// the reverse map under `mmu_lock` ("How to locklessly walk rmap?", line 34; "we need to hold
// mmu-lock", line 24), one rmap lookup per dirty page (`kvm_mmu_write_protect_pt_masked`), so
// the change is `rmap-each` (those lookups, under the lock) to `rmap-lockless` (the same
// lookups without it), not the page-table walk of today's TDP MMU. Both clear W with a locked
// instruction: `rmap-each` exchanges each writable entry, as that kernel's `mmu_spte_update`
// did for every entry fast page fault could change ("Always atomicly update spte if it can be
// updated out of mmu-lock", its `spte_has_volatile_bits`), `rmap-lockless` compare-and-swaps.
const WRPROT: (&str, &str) = ("--wrprot rmap-each", "--wrprot rmap-lockless");
// 004's two kernels, as its commit message describes them: before, "Memset the
// 'second_dirty_bitmap' with zeros - Get KVM_MMU_LOCK to scan the whole bitmap for dirty-bits
// - If there is long with a dirty-bit, xchg() it into second_dirty_bitmap" (lines 19-21);
// after, switch bitmaps, then "scan the bitmap copied, and both protect the page and clean
// the dirty bits in the same loop" (lines 28-35, and its diff, lines 242-256: every word
// loaded, a plain store for the non-zero ones). Both scan every word of the slot: slat's
// `xchg-full` and `switch-full`. (slat's own `xchg` and `switch` read only the words its
// summary levels name, so there is no whole-slot work for the switch to remove; the extra row
// shows them.)
const GET: (&str, &str) = ("--get-dirty-log xchg-full", "--get-dirty-log switch-full");
const GET_SUMMARY: (&str, &str) = ("--get-dirty-log xchg", "--get-dirty-log switch");

/// This host has no 1 GiB pages reserved (nor 2 MiB hugetlb pages): the host's runs of the
/// seed's 1 GiB hugetlb rows map 2 MiB THP blocks.
const NO_1G: &str = "no 1 GiB pages on this host: 2 MiB THP blocks";

#[allow(clippy::too_many_arguments)]
const fn row(
    seed: &'static str,
    row: &'static str,
    bench: Bench,
    fixed: &'static str,
    scale: Scale,
    change: (&'static str, &'static str),
    figure: Figure,
    published: Claim,
) -> Experiment {
    Experiment {
        seed,
        row,
        bench,
        fixed,
        scale,
        before: change.0,
        after: change.1,
        figure,
        published,
    }
}

const fn scale(seed: &'static str, host: &'static str, quick: &'static str) -> Scale {
    Scale {
        seed,
        host,
        quick,
        note: "",
        reduced: None,
    }
}

const fn scale_note(
    seed: &'static str,
    host: &'static str,
    quick: &'static str,
    note: &'static str,
) -> Scale {
    Scale {
        seed,
        host,
        quick,
        note,
        reduced: None,
    }
}

use Bench::*;

const S000: Scale = scale("-v 64 -b 1G", "-v 2 -b 512M", "-v 1 -b 16M");
const S000_AT: Scale = scale("-v 64 -b 1G", "-v 2 -b 256M", "-v 1 -b 16M");

// 001: the thread's `-m 4` is a guest mode slat's model does not have (it has -m 0 only);
// the stage-2 table's shape is the same.
const ANON: Scale = scale(
    "-s anonymous -b 1G -v 80",
    "-s anonymous -b 256M -v 2",
    "-s anonymous -b 16M -v 2",
);
const THP_V40: Scale = scale(
    "-s anonymous_thp -b 20G -v 40",
    "-s anonymous_thp -b 1G -v 2",
    "-s anonymous_thp -b 32M -v 2",
);
const THP_V20: Scale = scale(
    "-s anonymous_thp -b 20G -v 20",
    "-s anonymous_thp -b 1G -v 1",
    "-s anonymous_thp -b 32M -v 1",
);
const G1_V40: Scale = scale_note(
    "-s anonymous_hugetlb_1gb -b 20G -v 40",
    "-s anonymous_thp -b 1G -v 2",
    "-s anonymous_thp -b 32M -v 2",
    NO_1G,
);
const G1_V20: Scale = scale_note(
    "-s anonymous_hugetlb_1gb -b 20G -v 20",
    "-s anonymous_thp -b 1G -v 1",
    "-s anonymous_thp -b 32M -v 1",
    NO_1G,
);
const G1_1G_V80: Scale = scale_note(
    "-s anonymous_hugetlb_1gb -b 1G -v 80",
    "-s anonymous_thp -b 256M -v 2",
    "-s anonymous_thp -b 16M -v 2",
    NO_1G,
);

// 002: migrate-perf -c 12 -m 3000 -t 20 (12 vCPUs writing 3000 MB, 20 harvests); 3.2's guest
// wrote 15000 MB with 12 vCPUs over 30 rounds.
const S002: Scale = scale_note(
    "-v 12 -b 250M -i 20",
    "-v 2 -b 512M -i 10",
    "-v 1 -b 16M -i 4",
    "2 vCPUs: with 1 nothing waits for the harvest's lock",
);
const S002_BENCH: Scale = scale_note(
    "-v 12 -b 1250M -i 30",
    "-v 2 -b 512M -i 10",
    "-v 1 -b 16M -i 4",
    "the guest's fault latency, not mmtest's total time",
);

// 002's shadow-paging guest benchmark: with every write fault under the one lock, 3.2's
// `-v 12 -b 1250M -i 30` pair takes about 18 minutes here (2,099 s for 002's eight commands),
// past `reproduce all`'s 45 minutes: by default it reads the harvest rows' runs (the same 12
// vCPUs writing while the host harvests, 3 GB over 20 harvests, the seed's migrate-perf).
const S002_BENCH_SHADOW: Scale = Scale {
    reduced: Some(Reduced {
        flags: "-v 12 -b 250M -i 20",
        note: "scaled for reproduce all's 45 minutes: the harvest rows' runs, 12 vCPUs x 250 MiB over 20 harvests, instead of 3.2's 12 x 1250 MiB over 30 (every write fault under the one lock makes that pair about 18 minutes); --full-scale runs it",
    }),
    ..S002_BENCH
};

// 003: stress --vm 128 --vm-bytes 5G in a 1 TB guest. At 640 GB the three commands take
// over 1.5 hours here (one 1 TiB fault-in: 34 minutes of wall time, docs/benchmarks.md), past
// `reproduce all`'s 45 minutes: by default the 128 vCPUs each fault in 128 MiB. Each vCPU
// still accepts its own range 2 MiB region by region, so every region pays the same split (or
// flush) while the other 127 vCPUs do the same; only the number of regions per vCPU (64
// against 2,560) shrinks, which changes how long the run is, not what each region costs.
const S003: Scale = Scale {
    reduced: Some(Reduced {
        // Phantom memory although 16 GiB would pass the benchmark's check: that much real
        // memory (17 GB resident) is most of this shared host's.
        flags: "-v 128 -b 128M --phantom",
        note: "scaled for reproduce all's 45 minutes: the seed's 128 vCPUs, each faulting in 128 MiB instead of 5 GiB (16 GiB of phantom memory instead of 640 GB); --full-scale runs -v 128 -b 5G, about 2 hours",
    }),
    ..scale("-v 128 -b 5G", "-v 2 -b 512M", "-v 1 -b 32M")
};

// 004: a 16 GB guest with 32 vCPUs.
const S004_MARK: Scale = scale_note(
    "-v 32 -b 512M",
    "-v 1 -b 256M",
    "-v 1 -b 16M",
    "a write fault's whole cost per page, the mark inside it",
);

// 002's MMU: one `mmu_lock` that every fault fixed under it takes alone (a spinlock then, KVM's
// legacy MMU: `--mmu-lock mutex`), "also required by vcpu to fix its page table fault"
// (lines 24-25). Which faults take it is what decides the gain, and the thread names both
// cases: with shadow paging every write-protection fault does (KVM's fast page fault then
// fixed only direct, i.e. TDP, mappings); with EPT "only the first time guest writes memory
// need take mmu-lock ... Other writes ... are fixed by fast page fault which need not take
// mmu-lock" (lines 167-171). PML did not exist (the X5690 predates it), so every first write
// after a harvest faulted. The thread does not say which MMU its migrate-perf ran on: the
// first row is the case the series was written for (the faults take the lock), the second
// the EPT case.
const LOCKED_FAULTS: &str = "-g --concurrent --mmu-lock mutex --fast-pf off";
const EPT_FAST_PF: &str = "-g --concurrent --mmu-lock mutex --fast-pf on";

const DLP_GET: &str = "-g -i 3";

// 004's cell the thread's figure implies (the sweep's largest size, sparsest density).
const S004_IMPLIED: Scale = scale_note(
    "-v 32 -b 512M -w 1",
    "-v 1 -b 1G -w 1",
    "-v 1 -b 64M -w 1",
    "the sweep's largest size at its lowest density",
);

/// Every row of every seed but 004's GET rows (which come from [`GET_SWEEP`]).
#[rustfmt::skip]
pub const EXPERIMENTS: &[Experiment] = &[
    row("000", "Iteration 2 dirty memory time", DirtyLogPerf, "", S000, FAST_PF, metric("iteration 2 dirty memory"), p::DIRTY_MEMORY_TIME),
    row("000", "Writing to idle memory", AccessTrackingPerf, "--ad-bits off --idle-check warn", S000_AT, FAST_PF, metric("writing to idle memory"), p::WRITING_TO_IDLE),
    row("001", "patch 1: 4K, -v 80, CREATE", PageTableTest, "--format stage2", ANON, CMO, metric("create mappings"), p::P1_ANON_CREATE),
    row("001", "patch 1: 4K, -v 80, UPDATE", PageTableTest, "--format stage2", ANON, CMO, metric("update mappings"), p::P1_ANON_UPDATE),
    row("001", "patch 1: THP, -v 40, CREATE", PageTableTest, "--format stage2", THP_V40, CMO, metric("create mappings"), p::P1_THP_CREATE),
    row("001", "patch 1: THP, -v 40, UPDATE", PageTableTest, "--format stage2", THP_V40, CMO, metric("update mappings"), p::P1_THP_UPDATE),
    row("001", "patch 1: THP, -v 40, REBUILD", PageTableTest, "--format stage2", THP_V40, CMO, metric("adjust mappings"), p::P1_THP_REBUILD),
    row("001", "patch 1: 1G, -v 40, CREATE", PageTableTest, "--format stage2", G1_V40, CMO, metric("create mappings"), p::P1_1G_CREATE),
    row("001", "patch 1: 1G, -v 40, UPDATE", PageTableTest, "--format stage2", G1_V40, CMO, metric("update mappings"), p::P1_1G_UPDATE),
    row("001", "patch 1: 1G, -v 40, REBUILD", PageTableTest, "--format stage2", G1_V40, CMO, metric("adjust mappings"), p::P1_1G_REBUILD),
    row("001", "patch 2: THP, -v 20, REBUILD", PageTableTest, "--format stage2", THP_V20, REBUILD, metric("adjust mappings"), p::P2_THP_V20),
    row("001", "patch 2: THP, -v 40, REBUILD", PageTableTest, "--format stage2", THP_V40, REBUILD, metric("adjust mappings"), p::P2_THP_V40),
    row("001", "patch 2: 1G -b 1G, -v 80, REBUILD", PageTableTest, "--format stage2", G1_1G_V80, REBUILD, metric("adjust mappings"), p::P2_1G_1G_V80),
    row("001", "patch 2: 1G, -v 20, REBUILD", PageTableTest, "--format stage2", G1_V20, REBUILD, metric("adjust mappings"), p::P2_1G_V20),
    row("001", "patch 2: 1G, -v 40, REBUILD", PageTableTest, "--format stage2", G1_V40, REBUILD, metric("adjust mappings"), p::P2_1G_V40),
    row("002", "get dirty page (avg), write faults under mmu_lock", DirtyLogPerf, LOCKED_FAULTS, S002, WRPROT, metric("harvest avg, vCPUs writing"), p::GET_DIRTY_PAGE),
    row("002", "get dirty page (avg), EPT: write faults fixed by fast page fault", DirtyLogPerf, EPT_FAST_PF, S002, WRPROT, metric("harvest avg, vCPUs writing"), p::GET_DIRTY_PAGE),
    row("002", "guest benchmark during migration (3.2, EPT)", DirtyLogPerf, EPT_FAST_PF, S002_BENCH, WRPROT, metric("write p99, during harvests"), p::GUEST_BENCHMARK),
    row("002", "guest benchmark during migration (3.2, shadow)", DirtyLogPerf, LOCKED_FAULTS, S002_BENCH_SHADOW, WRPROT, metric("write p99, during harvests"), p::GUEST_BENCHMARK_SHADOW),
    row("003", "fault-in rate, 4K pre-split vs 2M+split", PrivateMemPerf, "--backend sim", S003, ("--direct-map 2m-split --kernel-flush off", "--direct-map 4k --kernel-flush off"), metric("fault-in GB/s"), p::FAULT_IN),
    row("003", "kernel TLB flush after each removal", PrivateMemPerf, "--backend sim --direct-map 2m-split", S003, ("--kernel-flush off", "--kernel-flush on"), metric("fault-in GB/s"), p::KERNEL_FLUSH),
    row("004", "mark_page_dirty_in_slot", DirtyLogPerf, DLP_GET, S004_MARK, GET, Figure { metric: "iteration 2 dirty memory", per_page: true }, p::MARK_PAGE_DIRTY),
    row("004", "GET_DIRTY_LOG, slat's summary-level paths (xchg -> switch)", DirtyLogPerf, DLP_GET, S004_IMPLIED, GET_SUMMARY, metric("get dirty log avg"), p::GET_DIRTY_LOG),
];

/// 004's GET rows: the thread does not give the guest's size or how many pages were dirty per
/// GET, so GET runs over a grid of sizes and dirty densities (`-w`, the share of pages each
/// pass writes) and the table shows where the two paths differ most and least.
pub struct Sweep {
    pub row: Experiment,
    /// Guest sizes at each scale (one entry per size).
    pub sizes: [Scale; 2],
    /// Dirty densities (`-w`), the same at every scale.
    pub densities: &'static [&'static str],
}

/// The GET sweep.
pub const GET_SWEEP: Sweep = Sweep {
    row: row(
        "004",
        "GET_DIRTY_LOG",
        DirtyLogPerf,
        DLP_GET,
        scale("", "", ""),
        GET,
        metric("get dirty log avg"),
        p::GET_DIRTY_LOG,
    ),
    sizes: [
        scale("-v 32 -b 32M", "-v 1 -b 64M", "-v 1 -b 8M"),
        scale("-v 32 -b 512M", "-v 1 -b 1G", "-v 1 -b 64M"),
    ],
    densities: &["-w 1", "-w 10", "-w 100"],
};

/// The rows of seed `id` (004's GET rows aside).
pub fn of(id: &str) -> impl Iterator<Item = &'static Experiment> + '_ {
    EXPERIMENTS.iter().filter(move |e| e.seed == id)
}
