//! What the five seed threads published, as data: every figure as it is written in the thread,
//! with the file under `../shared/seeds/` and the line it is on, so a test can read the thread
//! and find it there (`tests/cli/reproduce.rs`).

use serde::Serialize;

/// A seed thread: its number, the mechanism it proposes and its file.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Seed {
    /// `000` … `004`.
    pub id: &'static str,
    /// The mechanism, in words.
    pub title: &'static str,
    /// The thread, under `../shared/seeds/`.
    pub file: &'static str,
    /// The machine the thread measured on.
    pub machine: &'static str,
    /// The built-in cost profile of that machine's class (`--clock virtual`'s default).
    pub cost_profile: &'static str,
}

/// One published number: its text exactly as the thread writes it, and its line (1-based).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Figure {
    pub text: &'static str,
    pub line: u32,
}

impl Figure {
    /// The number (thousands separators dropped).
    pub fn value(self) -> Option<f64> {
        self.text.replace(',', "").parse().ok()
    }
}

/// What a thread claims for one row.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Claim {
    /// A before and an after figure.
    Figures {
        before: Figure,
        after: Figure,
        unit: &'static str,
    },
    /// No figure, only that the change made things worse (a quoted phrase).
    Worse { quote: Figure },
}

impl Claim {
    /// after / before, when the thread gives both figures.
    pub fn ratio(self) -> Option<f64> {
        match self {
            Claim::Figures { before, after, .. } => Some(after.value()? / before.value()?),
            Claim::Worse { .. } => None,
        }
    }

    /// The figures and quotes this claim rests on.
    #[cfg(test)]
    pub fn cited(self) -> Vec<Figure> {
        match self {
            Claim::Figures { before, after, .. } => vec![before, after],
            Claim::Worse { quote } => vec![quote],
        }
    }
}

const fn fig(text: &'static str, line: u32) -> Figure {
    Figure { text, line }
}

const fn figures(unit: &'static str, before: Figure, after: Figure) -> Claim {
    Claim::Figures {
        before,
        after,
        unit,
    }
}

/// The five threads.
pub const SEEDS: [Seed; 5] = [
    Seed {
        id: "000",
        title: "fast page fault for the TDP MMU (x86 EPT): write-protection and access-tracking faults fixed without the MMU lock",
        file: "000_15ab5c5901639a85.txt",
        machine: "x86 host, 64 vCPUs, 1 GiB per vCPU (selftest defaults)",
        cost_profile: "x86-server",
    },
    Seed {
        id: "001",
        title: "arm64 stage-2: cache maintenance moved into the fault handlers (patch 1); the block installed before the old tables are unmapped (patch 2)",
        file: "001_e7449def3cea68c6.txt",
        machine: "HiSilicon Kunpeng920, Linux v5.12-rc2, 20-80 vCPUs, 1-20 GiB",
        cost_profile: "arm64-server",
    },
    Seed {
        id: "002",
        title: "lock-free write-protect through the reverse map: harvests without the MMU lock",
        file: "002_6858392bcb074408.txt",
        machine: "Xeon X5690 x 12, 36 GB; EPT and shadow paging",
        cost_profile: "x86-server",
    },
    Seed {
        id: "003",
        title: "private memory and the host direct map: pre-split to 4K against 2M + split on acceptance",
        file: "003_2466dece929b0812.txt",
        machine: "one 1 TB SNP guest, 128 vCPUs",
        cost_profile: "x86-server",
    },
    Seed {
        id: "004",
        title: "two dirty bitmaps: GET_DIRTY_LOG by bitmap switch instead of a per-word exchange",
        file: "004_3ecfd554e0753192.txt",
        machine: "x86_64 VM, 32 vCPUs, 16 GB, dirtying 8 Gbps",
        cost_profile: "x86-server",
    },
];

// 000: "Metric | tdp_mmu=Y before | tdp_mmu=Y after".
pub const DIRTY_MEMORY_TIME: Claim = figures("s", fig("3.545234984", 79), fig("0.315209625", 79));
pub const WRITING_TO_IDLE: Claim = figures("s", fig("3.249645416", 80), fig("0.301676189", 80));

// 001, patch 1 (CMOs in the fault handlers): "KVM_…: before Xs -> after Ys".
pub const P1_ANON_CREATE: Claim = figures("s", fig("104.63", 51), fig("97.30", 51));
pub const P1_ANON_UPDATE: Claim = figures("s", fig("78.47", 52), fig("77.18", 52));
pub const P1_THP_CREATE: Claim = figures("s", fig("15.70", 56), fig("7.36", 56));
pub const P1_THP_UPDATE: Claim = figures("s", fig("161.00", 57), fig("135.03", 57));
pub const P1_THP_REBUILD: Claim = figures("s", fig("170.49", 58), fig("145.46", 58));
pub const P1_1G_CREATE: Claim = figures("s", fig("104.55", 62), fig("3.69", 62));
pub const P1_1G_UPDATE: Claim = figures("s", fig("160.67", 63), fig("130.65", 63));
pub const P1_1G_REBUILD: Claim = figures("s", fig("103.95", 64), fig("2.96", 64));

// 001, patch 2 (install the block first): "KVM_REBUILD_BLOCKS: before Xs -> after Ys".
pub const P2_THP_V20: Claim = figures("s", fig("73.64", 99), fig("57.75", 99));
pub const P2_THP_V40: Claim = figures("s", fig("145.4", 103), fig("130.8", 103));
pub const P2_1G_1G_V80: Claim = figures("s", fig("0.166", 107), fig("0.035", 107));
pub const P2_1G_V20: Claim = figures("s", fig("2.875", 111), fig("0.282", 111));
pub const P2_1G_V40: Claim = figures("s", fig("2.965", 115), fig("0.359", 115));

// 002: "Base: Run 20 times, Avg time:24813809 ns." / "After the patch: … 8371577 ns."
// The thread does not say whether migrate-perf ran with EPT or shadow paging; both of slat's
// rows compare with this figure (experiments.rs says which faults take the lock in each).
pub const GET_DIRTY_PAGE: Claim = figures("ns", fig("24813809", 107), fig("8371577", 108));
// 002, 3.2 (12 vCPUs, 25 GB), EPT, the "Benchmark (ns)" column, baseline and after.
pub const GUEST_BENCHMARK: Claim = figures("ns", fig("1278228350", 140), fig("1266581587", 142));
// 002, 3.2, shadow paging (EPT disabled): "Shadow | Baseline | 74198 | 1323180090" and
// "After | 64948 +14.2% | 1299283302 +1.8%".
pub const GUEST_BENCHMARK_SHADOW: Claim =
    figures("ns", fig("1323180090", 144), fig("1299283302", 146));

// 003: "DirectMap2M+split 8.0 | 8.9" (before) and "DirectMap4K 12.9 | 12.1" (after), unpinned.
pub const FAULT_IN: Claim = figures("GB/s", fig("8.0", 68), fig("12.9", 66));
// 003: the kernel TLB flush after each direct-map removal.
pub const KERNEL_FLUSH: Claim = Claim::Worse {
    quote: fig("completely cratered performance", 106),
};

// 004: "goes from 13608798 to 6734244" and "goes from 462 to 471" (clock cycles).
pub const GET_DIRTY_LOG: Claim = figures("cycles", fig("13608798", 45), fig("6734244", 45));
pub const MARK_PAGE_DIRTY: Claim = figures("cycles", fig("462", 47), fig("471", 47));

/// The seed `id`.
pub fn seed(id: &str) -> Option<&'static Seed> {
    SEEDS.iter().find(|s| s.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reproduce::experiments::{EXPERIMENTS, GET_SWEEP};
    use std::path::PathBuf;

    /// `shared/seeds` beside the repository (`../shared/seeds` from its root), found from this
    /// crate upwards so that it works from any checkout.
    fn seeds_dir() -> Option<PathBuf> {
        let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        here.ancestors()
            .map(|a| a.join("shared/seeds"))
            .find(|d| d.is_dir())
    }

    /// Every figure in the code is on the line of the thread it cites, as written there.
    #[test]
    fn published_numbers_match_the_seed_threads() {
        let Some(dir) = seeds_dir() else {
            eprintln!(
                "skipped: no shared/seeds directory above {}",
                env!("CARGO_MANIFEST_DIR")
            );
            return;
        };
        let rows = EXPERIMENTS.iter().chain([&GET_SWEEP.row]);
        let mut checked = 0;
        for e in rows {
            let seed = seed(e.seed).expect("a seed of the table");
            let text = std::fs::read_to_string(dir.join(seed.file))
                .unwrap_or_else(|e| panic!("{}: {e}", seed.file));
            let lines: Vec<&str> = text.lines().collect();
            for f in e.published.cited() {
                let line = lines.get(f.line as usize - 1).copied().unwrap_or_default();
                assert!(
                    line.contains(f.text),
                    "{} line {}: `{}` not in {line:?} (row {})",
                    seed.file,
                    f.line,
                    f.text,
                    e.row
                );
                checked += 1;
            }
        }
        assert!(checked >= 40, "{checked}");
    }

    /// A figure that is not on its line fails the check above: the check reads the line.
    #[test]
    fn a_wrong_line_is_caught() {
        let Some(dir) = seeds_dir() else {
            eprintln!("skipped: no shared/seeds directory");
            return;
        };
        let text = std::fs::read_to_string(dir.join(SEEDS[0].file)).unwrap();
        let line = text.lines().nth(79).unwrap_or_default();
        assert!(!line.contains("3.545234984"), "{line}");
    }

    #[test]
    fn every_figure_parses_and_every_ratio_is_positive() {
        for e in EXPERIMENTS.iter().chain([&GET_SWEEP.row]) {
            if let Claim::Figures { before, after, .. } = e.published {
                assert!(
                    before.value().is_some() && after.value().is_some(),
                    "{}",
                    e.row
                );
                assert!(e.published.ratio().is_some_and(|r| r > 0.0), "{}", e.row);
            }
        }
    }
}
