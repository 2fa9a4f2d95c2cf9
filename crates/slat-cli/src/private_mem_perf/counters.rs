//! The host kernel's own counters of direct-map work, read from procfs: the direct-map split
//! counters of `/proc/vmstat`, the `DirectMap*` sizes of `/proc/meminfo` and the TLB shootdown
//! and function-call rows of `/proc/interrupts`. A kernel without a counter (or a file that
//! cannot be read) gives `None` — `null` in JSON, `-` in text — never a failure: the fill
//! timings stand on their own.

use serde::Serialize;

/// Direct-map coverage from `/proc/meminfo` in KiB (`u64`), or its change (`i64`: a split
/// moves coverage from a larger leaf size to a smaller one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Sizes<T> {
    /// Covered by 4 KiB entries.
    #[serde(rename = "direct_map_4k_kib")]
    pub k4: Option<T>,
    #[serde(rename = "direct_map_2m_kib")]
    pub m2: Option<T>,
    #[serde(rename = "direct_map_1g_kib")]
    pub g1: Option<T>,
}

/// Kernel counters: readings, or the increments between two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// `direct_map_level2_splits`: 2 MiB leaves split into 4 KiB entries.
    pub level2_splits: Option<u64>,
    /// 1 GiB leaves split into 2 MiB entries.
    pub level3_splits: Option<u64>,
    /// Kernels that can rebuild 2 MiB or 1 GiB leaves count these.
    pub level2_collapses: Option<u64>,
    pub level3_collapses: Option<u64>,
    /// TLB shootdown interrupts over every CPU (user-address flushes: x86 counts them in
    /// `flush_tlb_func`).
    pub tlb_shootdowns: Option<u64>,
    /// Function-call interrupts (`CAL`) over every CPU: a kernel-range flush such as the one
    /// after a direct-map change reaches the other CPUs through these, not the `TLB` row.
    pub function_call_irqs: Option<u64>,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    counts: Counts,
    pub direct_map: Sizes<u64>,
}

impl Snapshot {
    /// Reads every counter now.
    pub fn read() -> Snapshot {
        let read = |p| std::fs::read_to_string(p).unwrap_or_default();
        let (vm, mi, irq) = (
            read("/proc/vmstat"),
            read("/proc/meminfo"),
            read("/proc/interrupts"),
        );
        let (vm, kib) = (|name| field(&vm, name), |name| field(&mi, name));
        Snapshot {
            counts: Counts {
                level2_splits: vm("direct_map_level2_splits"),
                level3_splits: vm("direct_map_level3_splits"),
                level2_collapses: vm("direct_map_level2_collapses"),
                level3_collapses: vm("direct_map_level3_collapses"),
                tlb_shootdowns: irq_row(&irq, "TLB:"),
                function_call_irqs: irq_row(&irq, "CAL:"),
            },
            direct_map: Sizes {
                k4: kib("DirectMap4k"),
                m2: kib("DirectMap2M"),
                g1: kib("DirectMap1G"),
            },
        }
    }

    /// What the counters did from `self` to `later`.
    pub fn until(&self, later: &Snapshot) -> Counts {
        let (a, b) = (&self.counts, &later.counts);
        Counts {
            level2_splits: grew(a.level2_splits, b.level2_splits),
            level3_splits: grew(a.level3_splits, b.level3_splits),
            level2_collapses: grew(a.level2_collapses, b.level2_collapses),
            level3_collapses: grew(a.level3_collapses, b.level3_collapses),
            tlb_shootdowns: grew(a.tlb_shootdowns, b.tlb_shootdowns),
            function_call_irqs: grew(a.function_call_irqs, b.function_call_irqs),
        }
    }
}

impl Sizes<u64> {
    /// The change from `self` to `later`.
    pub fn until(&self, later: &Sizes<u64>) -> Sizes<i64> {
        Sizes {
            k4: signed(self.k4, later.k4),
            m2: signed(self.m2, later.m2),
            g1: signed(self.g1, later.g1),
        }
    }
}

/// The increment of a monotonic counter; `None` if either reading is missing or the counter
/// went backwards (a wrapped or reset counter has no meaningful delta).
fn grew(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    b?.checked_sub(a?)
}

fn signed(a: Option<u64>, b: Option<u64>) -> Option<i64> {
    let (a, b) = (i64::try_from(a?).ok()?, i64::try_from(b?).ok()?);
    b.checked_sub(a)
}

/// A `name value` line of `/proc/vmstat`, or a `Name:   123 kB` line of `/proc/meminfo`.
fn field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let mut it = rest.strip_prefix(':').unwrap_or(rest).split_whitespace();
        let v = it.next()?.parse().ok()?;
        matches!(it.next(), None | Some("kB")).then_some(v)
    })
}

/// A row of `/proc/interrupts` (`TLB:`, `CAL:`): one count per CPU, then the description;
/// summed.
fn irq_row(text: &str, row: &str) -> Option<u64> {
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(row))?;
    let counts: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map_while(|t| t.parse().ok())
        .collect();
    if counts.is_empty() {
        return None;
    }
    counts.iter().try_fold(0u64, |s, c| s.checked_add(*c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_files_and_tolerates_missing_fields() {
        let vm = "nr_free_pages 5\ndirect_map_level2_splits 3\ndirect_map_level3_splits x\n";
        assert_eq!(field(vm, "direct_map_level2_splits"), Some(3));
        assert_eq!(field(vm, "direct_map_level3_splits"), None);
        assert_eq!(field(vm, "direct_map_level2_collapses"), None);
        assert_eq!(field("", "nr_free_pages"), None);
        let mi = "DirectMap4k:       26624 kB\nDirectMap2M:     2070528 kB\nDirectMap1G: bad\n";
        assert_eq!(field(mi, "DirectMap4k"), Some(26624));
        assert_eq!(field(mi, "DirectMap2M"), Some(2070528));
        assert_eq!(field(mi, "DirectMap1G"), None);
        let irq = "           CPU0       CPU1\n NMI:  0 0 Non-maskable\n TLB:    1478074    1432175   TLB shootdowns\n";
        assert_eq!(irq_row(irq, "TLB:"), Some(2_910_249));
        assert_eq!(irq_row(irq, "CAL:"), None);
        assert_eq!(irq_row(" TLB: TLB shootdowns\n", "TLB:"), None);
        assert_eq!(irq_row("garbage", "TLB:"), None);
    }

    #[test]
    fn deltas_are_none_when_a_side_is_missing_or_goes_backwards() {
        assert_eq!(grew(Some(3), Some(10)), Some(7));
        assert_eq!(grew(None, Some(10)), None);
        assert_eq!(grew(Some(10), Some(3)), None);
        assert_eq!(signed(Some(10), Some(3)), Some(-7));
        assert_eq!(signed(Some(u64::MAX), Some(3)), None);
    }
}
