//! The host kernel's own counters of direct-map work, read from procfs: the direct-map split
//! counters of `/proc/vmstat`, the `DirectMap*` sizes of `/proc/meminfo` and the TLB shootdown
//! row of `/proc/interrupts`. A kernel without a counter (or a file that cannot be read) gives
//! `None` — `null` in JSON, `-` in text — never a failure: the fill timings stand on their own.

use serde::Serialize;

/// Direct-map sizes from `/proc/meminfo`, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DirectMap {
    /// `DirectMap4k`: direct map covered by 4 KiB entries.
    #[serde(rename = "direct_map_4k_kib")]
    pub k4: Option<u64>,
    /// `DirectMap2M`: covered by 2 MiB leaves.
    #[serde(rename = "direct_map_2m_kib")]
    pub m2: Option<u64>,
    /// `DirectMap1G`: covered by 1 GiB leaves.
    #[serde(rename = "direct_map_1g_kib")]
    pub g1: Option<u64>,
}

/// How the direct map's coverage changed, in KiB (signed: a split moves coverage from a larger
/// leaf size to a smaller one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DirectMapDelta {
    /// Change of `DirectMap4k`.
    #[serde(rename = "direct_map_4k_kib")]
    pub k4: Option<i64>,
    /// Change of `DirectMap2M`.
    #[serde(rename = "direct_map_2m_kib")]
    pub m2: Option<i64>,
    /// Change of `DirectMap1G`.
    #[serde(rename = "direct_map_1g_kib")]
    pub g1: Option<i64>,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    /// `direct_map_level2_splits`: 2 MiB leaves split into 4 KiB entries.
    pub level2_splits: Option<u64>,
    /// `direct_map_level3_splits`: 1 GiB leaves split into 2 MiB entries.
    pub level3_splits: Option<u64>,
    /// `direct_map_level2_collapses` (kernels that can rebuild 2 MiB leaves).
    pub level2_collapses: Option<u64>,
    /// `direct_map_level3_collapses`.
    pub level3_collapses: Option<u64>,
    /// TLB shootdown interrupts, summed over every CPU.
    pub tlb_shootdowns: Option<u64>,
    /// Function-call interrupts (`CAL`), summed over every CPU.
    pub function_calls: Option<u64>,
    /// Direct-map coverage.
    pub direct_map: DirectMap,
}

/// Counter increments between two snapshots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Deltas {
    /// New 2 MiB → 4 KiB splits.
    pub level2_splits: Option<u64>,
    /// New 1 GiB → 2 MiB splits.
    pub level3_splits: Option<u64>,
    /// New 2 MiB collapses.
    pub level2_collapses: Option<u64>,
    /// New 1 GiB collapses.
    pub level3_collapses: Option<u64>,
    /// TLB shootdown interrupts received by all CPUs (user-address flushes: x86 counts
    /// them in `flush_tlb_func`).
    pub tlb_shootdowns: Option<u64>,
    /// Function-call interrupts received by all CPUs: a kernel-range flush such as the one
    /// after a direct-map change runs on every CPU through these, not the `TLB` row.
    pub function_call_irqs: Option<u64>,
}

impl Snapshot {
    /// Reads every counter now.
    pub fn read() -> Snapshot {
        let vm = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
        let mi = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let irq = std::fs::read_to_string("/proc/interrupts").unwrap_or_default();
        Snapshot {
            level2_splits: vmstat_field(&vm, "direct_map_level2_splits"),
            level3_splits: vmstat_field(&vm, "direct_map_level3_splits"),
            level2_collapses: vmstat_field(&vm, "direct_map_level2_collapses"),
            level3_collapses: vmstat_field(&vm, "direct_map_level3_collapses"),
            tlb_shootdowns: irq_row(&irq, "TLB:"),
            function_calls: irq_row(&irq, "CAL:"),
            direct_map: DirectMap {
                k4: meminfo_kib(&mi, "DirectMap4k"),
                m2: meminfo_kib(&mi, "DirectMap2M"),
                g1: meminfo_kib(&mi, "DirectMap1G"),
            },
        }
    }

    /// What the counters did from `self` to `later`.
    pub fn until(&self, later: &Snapshot) -> Deltas {
        Deltas {
            level2_splits: grew(self.level2_splits, later.level2_splits),
            level3_splits: grew(self.level3_splits, later.level3_splits),
            level2_collapses: grew(self.level2_collapses, later.level2_collapses),
            level3_collapses: grew(self.level3_collapses, later.level3_collapses),
            tlb_shootdowns: grew(self.tlb_shootdowns, later.tlb_shootdowns),
            function_call_irqs: grew(self.function_calls, later.function_calls),
        }
    }
}

impl DirectMap {
    /// The change from `self` to `later`.
    pub fn until(&self, later: &DirectMap) -> DirectMapDelta {
        DirectMapDelta {
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

/// A `name value` line of `/proc/vmstat`.
fn vmstat_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == name).then(|| it.next()?.parse().ok())?
    })
}

/// A `Name:   123 kB` line of `/proc/meminfo`, in KiB.
fn meminfo_kib(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, rest) = l.split_once(':')?;
        if k.trim() != name {
            return None;
        }
        let mut it = rest.split_whitespace();
        let v: u64 = it.next()?.parse().ok()?;
        match it.next() {
            None | Some("kB") => Some(v),
            Some(_) => None,
        }
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
        assert_eq!(vmstat_field(vm, "direct_map_level2_splits"), Some(3));
        assert_eq!(vmstat_field(vm, "direct_map_level3_splits"), None);
        assert_eq!(vmstat_field(vm, "direct_map_level2_collapses"), None);
        assert_eq!(vmstat_field("", "nr_free_pages"), None);
        let mi = "DirectMap4k:       26624 kB\nDirectMap2M:     2070528 kB\nDirectMap1G: bad\n";
        assert_eq!(meminfo_kib(mi, "DirectMap4k"), Some(26624));
        assert_eq!(meminfo_kib(mi, "DirectMap2M"), Some(2070528));
        assert_eq!(meminfo_kib(mi, "DirectMap1G"), None);
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
