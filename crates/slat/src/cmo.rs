//! Cache maintenance operations (CMOs) for formats whose guests may see memory without the
//! host's caches ([`PteFormat::CACHE_MAINTENANCE`], arm64 stage-2).
//!
//! Before a new mapping is published, KVM arm64 cleans the data cache over the mapped range to
//! the point of coherency (`dcache_clean_inval_poc`), so a guest running with its caches off
//! reads what the host wrote, and invalidates the instruction cache to the point of unification
//! for executable mappings (`icache_inval_pou`). Both walk the range a cache line at a time, so
//! their cost grows with the mapping: a 1 GiB block costs 16 Mi line operations. That cost is
//! what KVM arm64's "Move CMOs from user_mem_abort to the fault handlers" avoids repeating on
//! every concurrent fault.
//!
//! On this x86 host the model does the same work for real: the data-cache clean is `clflushopt`
//! over every line of the range (write back and invalidate, like `DC CIVAC`), and the
//! instruction-cache invalidation is a second such pass. The flushed lines are really gone
//! from the caches, so the guest's next accesses pay the misses too, as on hardware. Elsewhere
//! the passes are a line-by-line volatile read, which keeps the per-line cost shape.
//!
//! [`PteFormat::CACHE_MAINTENANCE`]: crate::format::PteFormat::CACHE_MAINTENANCE

/// Cache-line size the passes step by (64 bytes on every host this runs on).
pub const CACHE_LINE: u64 = 64;

use crate::clock::{Clock, Cost};
use crate::stats::{Sink, Stat};

/// Cache lines a pass over `[addr, addr + len)` touches.
#[inline(always)]
fn lines(addr: u64, len: u64) -> u64 {
    (addr + len - (addr & !(CACHE_LINE - 1))).div_ceil(CACHE_LINE)
}

/// Cache maintenance for a mapping about to be published: clean the data cache over it,
/// and invalidate the instruction cache too if it is executable. Charged to `C` per line.
pub(crate) fn clean_new_mapping<C: Clock>(addr: u64, len: u64, exec: bool, sink: Sink<'_>) {
    C::charge(Cost::CmoLine, lines(addr, len));
    clean_dcache_to_poc(addr, len);
    sink.inc::<C>(Stat::CacheCleans);
    sink.add::<C>(Stat::CacheCleanBytes, len);
    if exec {
        invalidate_icache_for::<C>(addr, len, sink);
    }
}

/// Instruction-cache invalidation for a live mapping that becomes executable.
pub(crate) fn invalidate_icache_for<C: Clock>(addr: u64, len: u64, sink: Sink<'_>) {
    C::charge(Cost::CmoLine, lines(addr, len));
    invalidate_icache_to_pou(addr, len);
    sink.inc::<C>(Stat::CacheCleans);
    sink.add::<C>(Stat::CacheCleanBytes, len);
}

/// What [`clean_new_mapping`] (`invalidate: false`) or [`invalidate_icache_for`]
/// (`invalidate: true`) would do for phantom memory, whose lines are not mapped (a `clflushopt`
/// there would fault): counted, not performed. Its data lives in a pool of a few shared frames,
/// so there is nothing a guest could read stale. Charged to `C` as if performed, so virtual
/// time sees the same cost as for real memory.
pub(crate) fn skip_for_phantom<C: Clock>(len: u64, exec: bool, invalidate: bool, sink: Sink<'_>) {
    let passes = if invalidate { 1 } else { 1 + exec as u64 };
    C::charge(Cost::CmoLine, len.div_ceil(CACHE_LINE) * passes);
    sink.add::<C>(Stat::CacheCleans, passes);
    sink.add::<C>(Stat::CacheCleanBytes, len * passes);
}

/// Cleans and invalidates the data cache over `buf`, one line at a time, as a new mapping's
/// clean does: the pass `slat calibrate` times to price a line of cache maintenance.
pub fn clean_dcache_over(buf: &[u8]) {
    if !buf.is_empty() {
        clean_dcache_to_poc(buf.as_ptr() as u64, buf.len() as u64);
    }
}

/// Cleans and invalidates the data cache over `[addr, addr + len)` to the point of coherency.
/// `addr` must be the start of host memory the caller maps (guest RAM): every line of the range
/// must be mapped in this process.
#[inline(never)]
pub(crate) fn clean_dcache_to_poc(addr: u64, len: u64) {
    flush_lines(addr, len);
}

/// Invalidates the instruction cache over `[addr, addr + len)` to the point of unification
/// (x86 instruction fetch is coherent with data, so the model repeats the line pass to charge
/// the cost the architecture would). Same contract as [`clean_dcache_to_poc`].
#[inline(never)]
pub(crate) fn invalidate_icache_to_pou(addr: u64, len: u64) {
    flush_lines(addr, len);
}

#[cfg(all(target_arch = "x86_64", not(loom)))]
fn flush_lines(addr: u64, len: u64) {
    use std::sync::OnceLock;
    static HAS_CLFLUSHOPT: OnceLock<bool> = OnceLock::new();
    // CPUID.(EAX=7, ECX=0):EBX bit 23 (std's feature detection does not know CLFLUSHOPT).
    let opt = *HAS_CLFLUSHOPT.get_or_init(|| {
        // An old CPU without leaf 7 returns zeros here, which reads as "no CLFLUSHOPT".
        let r = core::arch::x86_64::__cpuid_count(7, 0);
        r.ebx & (1 << 23) != 0
    });
    let start = addr & !(CACHE_LINE - 1);
    let end = addr + len;
    let mut p = start;
    while p < end {
        if opt {
            // SAFETY: CLFLUSHOPT was detected above; the caller guarantees the line is mapped
            // host memory (guest RAM), and flushing a line changes no value in it.
            unsafe {
                core::arch::asm!("clflushopt [{0}]", in(reg) p, options(nostack, preserves_flags))
            };
        } else {
            // SAFETY: CLFLUSH is in the x86-64 baseline; same contract as above.
            unsafe { core::arch::x86_64::_mm_clflush(p as *const u8) };
        }
        p += CACHE_LINE;
    }
    // CLFLUSHOPT is weakly ordered: fence so every flush completes before the mapping is
    // published (what the DSB after `DC CIVAC` does on arm64).
    // SAFETY: a fence has no memory-safety requirements.
    unsafe { core::arch::x86_64::_mm_mfence() };
}

#[cfg(any(not(target_arch = "x86_64"), loom))]
fn flush_lines(addr: u64, len: u64) {
    let start = addr & !(CACHE_LINE - 1);
    let end = addr + len;
    let mut p = start;
    while p < end {
        // SAFETY: the caller guarantees the line is mapped host memory (guest RAM); a read
        // changes nothing.
        unsafe { std::ptr::read_volatile(p as *const u8) };
        p += CACHE_LINE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_keep_memory_contents() {
        let mut buf = vec![0u8; 3 * 4096 + 100];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = i as u8;
        }
        let addr = buf.as_ptr() as u64;
        clean_dcache_to_poc(addr + 1, 3 * 4096 - 1);
        invalidate_icache_to_pou(addr, buf.len() as u64);
        assert!(buf.iter().enumerate().all(|(i, b)| *b == i as u8));
    }
}
