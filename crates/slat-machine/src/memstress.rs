//! KVM's memstress guest workload, and the same pattern run natively on host memory.
//!
//! Per pass each vCPU touches each page of its region once — in order, or at pseudo-random
//! pages drawn from a Park–Miller generator seeded with `seed + vcpu index` — writing
//! `0x0123456789ABCDEF` to the first 8 bytes with probability `write_percent`, else reading
//! them. The host waits until every vCPU has finished the pass (KVM's GUEST_SYNC).

use crate::cpu::{Cpu, Exit};
use slat::format::{PteFormat, PAGE_SIZE};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The value memstress writes.
pub const MEMSTRESS_PATTERN: u64 = 0x0123_4567_89ab_cdef;

/// One pass's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PassParams {
    /// Percentage of accesses that are writes (0–100).
    pub write_percent: u32,
    /// Random page order instead of sequential.
    pub random: bool,
    /// PRNG seed (vCPU `i` uses `seed + i`).
    pub seed: u32,
}

impl Default for PassParams {
    fn default() -> Self {
        PassParams {
            write_percent: 100,
            random: false,
            seed: 1,
        }
    }
}

/// KVM selftests' guest PRNG: the Park–Miller "minimal standard" generator.
#[derive(Debug, Clone, Copy)]
pub struct ParkMiller(u32);

impl ParkMiller {
    /// A generator with this seed (0 would stick at 0, so it is mapped to 1).
    pub fn new(seed: u32) -> Self {
        let s = seed % 0x7fff_ffff;
        ParkMiller(if s == 0 { 1 } else { s })
    }
    /// The next value in `[1, 2^31 - 1)`.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        self.0 = ((self.0 as u64 * 48271) % 0x7fff_ffff) as u32;
        self.0
    }
}

/// The page sequence of one pass: which page each access touches and whether it writes.
#[derive(Debug, Clone, Copy)]
pub struct Pattern {
    rng: ParkMiller,
    pages: u64,
    params: PassParams,
    i: u64,
}

impl Pattern {
    /// The pattern of vCPU `vcpu_idx` over `pages` pages.
    pub fn new(params: PassParams, vcpu_idx: u32, pages: u64) -> Self {
        Pattern {
            rng: ParkMiller::new(params.seed.wrapping_add(vcpu_idx)),
            pages,
            params,
            i: 0,
        }
    }
}

impl Iterator for Pattern {
    /// (page index, write?)
    type Item = (u64, bool);
    #[inline]
    fn next(&mut self) -> Option<(u64, bool)> {
        if self.i >= self.pages {
            return None;
        }
        let page = if self.params.random {
            self.rng.next_u32() as u64 % self.pages
        } else {
            self.i
        };
        self.i += 1;
        let write = match self.params.write_percent {
            100 => true,
            0 => false,
            p => self.rng.next_u32() % 100 < p,
        };
        Some((page, write))
    }
}

/// Runs one memstress pass of vCPU `vcpu_idx` over `pages` pages starting at `gpa`; with
/// `halt`, stops early once it is set (checked every 1024 pages). Returns the pages touched.
pub fn guest_pass<F: PteFormat>(
    cpu: &mut Cpu<F>,
    gpa: u64,
    pages: u64,
    params: PassParams,
    vcpu_idx: u32,
    halt: Option<&AtomicBool>,
) -> Result<u64, Exit> {
    for (n, (page, write)) in Pattern::new(params, vcpu_idx, pages).enumerate() {
        if n % 1024 == 1023 && halt.is_some_and(|h| h.load(Ordering::Relaxed)) {
            return Ok(n as u64);
        }
        let a = gpa + page * PAGE_SIZE;
        if write {
            cpu.write_u64(a, MEMSTRESS_PATTERN)?;
        } else {
            std::hint::black_box(cpu.read_u64(a)?);
        }
    }
    Ok(pages)
}

/// The same pass straight on host memory at `host` (the native baseline).
///
/// # Safety
///
/// `[host, host + pages * 4 KiB)` must be mapped readable and writable for the whole call,
/// `host` 8-byte aligned, and no `&`/`&mut` references to those bytes may exist meanwhile
/// (other threads may access them, atomically).
pub(crate) unsafe fn native_pass(host: u64, pages: u64, params: PassParams, vcpu_idx: u32) {
    for (page, write) in Pattern::new(params, vcpu_idx, pages) {
        let p = (host + page * PAGE_SIZE) as *mut u64;
        // SAFETY: `page < pages` (the pattern's range), so the address is inside the range the
        // caller vouched for, and 8-byte aligned. Atomic because other threads may touch the
        // same page (-o).
        let a = unsafe { AtomicU64::from_ptr(p) };
        if write {
            a.store(MEMSTRESS_PATTERN, Ordering::Relaxed);
        } else {
            std::hint::black_box(a.load(Ordering::Relaxed));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn park_miller_matches_the_minimal_standard() {
        // 48271^1 and 48271^2 mod (2^31 - 1), computed by hand.
        let mut r = ParkMiller::new(1);
        assert_eq!(r.next_u32(), 48271);
        assert_eq!(r.next_u32(), ((48271u64 * 48271) % 0x7fff_ffff) as u32);
    }

    #[test]
    fn sequential_pattern_touches_each_page_once() {
        let v: Vec<_> = Pattern::new(PassParams::default(), 0, 5).collect();
        assert_eq!(v, (0..5).map(|p| (p, true)).collect::<Vec<_>>());
    }

    #[test]
    fn write_percent_is_respected_roughly() {
        let params = PassParams {
            write_percent: 30,
            random: true,
            seed: 7,
        };
        let n = 100_000;
        let writes = Pattern::new(params, 3, n).filter(|&(_, w)| w).count() as f64;
        assert!((writes / n as f64 - 0.3).abs() < 0.02, "{writes}");
        assert!(Pattern::new(params, 3, n).all(|(p, _)| p < n));
    }
}
