//! The MMU's own memory in a report: table pages, per-page bitmaps and the reverse map of the
//! simulated machine's engine, and that per GiB of guest memory — what a guest costs the
//! host beside its data, and all that a phantom guest (`-s phantom`) costs it.

use crate::backend::Backend;
use serde::Serialize;
use slat_workload::format_size;

/// Bytes in a GiB.
const GIB: f64 = (1u64 << 30) as f64;

/// The engine's [`slat::MmuMemory`] at one point of a run, and per GiB of guest memory.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MmuMemoryFigures {
    /// Table pages allocated and not freed, at their allocation size (page and header).
    pub table_bytes: u64,
    /// Dirty-log and memory-attribute bitmaps.
    pub bitmap_bytes: u64,
    /// The reverse map (0 unless `--wrprot rmap*` keeps one).
    pub rmap_bytes: u64,
    /// Their sum.
    pub total_bytes: u64,
    /// Bytes of guest memory the figures are for.
    pub guest_bytes: u64,
    /// `total_bytes` per GiB of guest memory.
    pub bytes_per_gib_of_guest: f64,
}

impl MmuMemoryFigures {
    /// The figures of `m`'s engine now, for `guest_bytes` of guest memory; `None` on a KVM
    /// machine, whose MMU is the kernel's.
    pub fn of(m: &dyn Backend, guest_bytes: u64) -> Option<MmuMemoryFigures> {
        let mem = m.sim()?.mmu_memory();
        let total = mem.total();
        Some(MmuMemoryFigures {
            table_bytes: mem.table_bytes,
            bitmap_bytes: mem.bitmap_bytes,
            rmap_bytes: mem.rmap_bytes,
            total_bytes: total,
            guest_bytes,
            bytes_per_gib_of_guest: total as f64 / (guest_bytes.max(1) as f64 / GIB),
        })
    }

    /// The text report's line.
    pub fn line(&self, when: &str) -> String {
        format!(
            "MMU memory {when}: {} ({} per GiB of guest memory): tables {}, bitmaps {}, rmap {}",
            format_size(self.total_bytes),
            format_size(self.bytes_per_gib_of_guest.round() as u64),
            format_size(self.table_bytes),
            format_size(self.bitmap_bytes),
            format_size(self.rmap_bytes)
        )
    }
}
