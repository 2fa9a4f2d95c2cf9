//! The memstress workload's parameters and its reference model, shared by both machines.
//!
//! The guest code `slat-kvm` assembles (`slat_kvm::guest`) implements exactly this model, and
//! `slat-machine`'s simulated vCPUs walk these iterators: per pass each vCPU touches each page of its region once —
//! or only its first [`PassParams::touches`] accesses, so a large region can take a small
//! pass — in order, or at pages drawn from a Park–Miller generator seeded with `seed + vcpu index`,
//! restarted at every pass — writing [`MEMSTRESS_PATTERN`] to the first 8 bytes with
//! probability `write_percent` (one more draw per access when it is strictly between 0 and
//! 100), else reading them. The tests run the guest and compare memory with this model.

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
    /// Record each vCPU's write latencies into [`crate::PassReport::latency`] (what a machine
    /// can time: [`crate::WriteLatency`]). Costs a clock read per write (or per fault).
    pub timed: bool,
    /// Accesses per vCPU per pass: `None` is one per page of the vCPU's region; `Some(n)`
    /// stops after `min(n, pages)` (the first n pages in order, or n draws over the whole
    /// region), so a pass can dirty k pages of a large guest.
    pub touches: Option<u64>,
}

impl Default for PassParams {
    fn default() -> Self {
        PassParams {
            write_percent: 100,
            random: false,
            seed: 1,
            timed: false,
            touches: None,
        }
    }
}

/// The Park–Miller "minimal standard" generator of KVM's selftests
/// (`seed = seed * 48271 mod (2^31 - 1)`).
#[derive(Debug, Clone, Copy)]
pub struct ParkMiller(u32);

impl ParkMiller {
    /// The modulus, 2^31 - 1.
    pub const MODULUS: u32 = 0x7fff_ffff;
    /// The multiplier.
    pub const MULTIPLIER: u32 = 48271;

    /// A generator with this seed (0 and multiples of the modulus would stick at 0, so they
    /// are mapped to 1).
    pub fn new(seed: u32) -> Self {
        ParkMiller(Self::normalize(seed))
    }

    /// The state a seed starts from: `seed mod (2^31 - 1)`, or 1 if that is 0.
    pub fn normalize(seed: u32) -> u32 {
        let s = seed % Self::MODULUS;
        if s == 0 {
            1
        } else {
            s
        }
    }

    /// The next value in `[1, 2^31 - 1)`.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        self.0 = ((self.0 as u64 * Self::MULTIPLIER as u64) % Self::MODULUS as u64) as u32;
        self.0
    }
}

/// The page sequence of one pass: which page each access touches and whether it writes.
#[derive(Debug, Clone, Copy)]
pub struct Pattern {
    rng: ParkMiller,
    pages: u64,
    /// Accesses in the pass (at most `pages`).
    count: u64,
    params: PassParams,
    i: u64,
}

impl Pattern {
    /// The pattern of vCPU `vcpu_idx` over `pages` pages.
    pub fn new(params: PassParams, vcpu_idx: u32, pages: u64) -> Self {
        Pattern {
            rng: ParkMiller::new(params.seed.wrapping_add(vcpu_idx)),
            pages,
            count: params.touches.map_or(pages, |n| n.min(pages)),
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
        if self.i >= self.count {
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

/// The page sequence of the dirty-log writer of vCPU `vcpu_idx` over `pages` pages: each page
/// index takes two draws (`(a << 31 | b) % pages`, so pages beyond 2^31 stay reachable).
/// Endless, except over zero pages: then empty.
#[derive(Debug, Clone, Copy)]
pub struct WriterPattern {
    rng: ParkMiller,
    pages: u64,
}

impl WriterPattern {
    /// The writer of vCPU `vcpu_idx` seeded with `seed + vcpu_idx`.
    pub fn new(seed: u32, vcpu_idx: u32, pages: u64) -> Self {
        WriterPattern {
            rng: ParkMiller::new(seed.wrapping_add(vcpu_idx)),
            pages,
        }
    }
}

impl Iterator for WriterPattern {
    type Item = u64;
    #[inline]
    fn next(&mut self) -> Option<u64> {
        // No page to pick from zero pages (the modulo would divide by zero).
        if self.pages == 0 {
            return None;
        }
        let hi = self.rng.next_u32() as u64;
        let lo = self.rng.next_u32() as u64;
        Some(((hi << 31) | lo) % self.pages)
    }
}

/// One pass of vCPU `vcpu_idx`'s pattern straight on host memory at `host` (the native
/// baseline).
///
/// # Safety
///
/// `host` must be 8-byte aligned (the words are accessed as `AtomicU64`) and the start of a
/// mapped, writable range of at least `pages` 4 KiB pages that stays mapped for the call;
/// other threads may access it only atomically.
pub unsafe fn native_pass(host: u64, pages: u64, params: PassParams, vcpu_idx: u32) {
    // SAFETY: the caller's contract.
    unsafe { pass_at(|off| host + off, pages, params, vcpu_idx) }
}

/// [`native_pass`] over phantom memory at `host` whose data lives in the pool at `pool`
/// ([`crate::guest_ram::phantom`]): the same accesses, each at its pool address.
///
/// # Safety
///
/// `pool` must be the start of a mapped, writable pool of
/// [`crate::guest_ram::phantom::POOL_FRAMES`] frames that stays mapped for the call, and
/// `host` 4 KiB aligned; other threads may access the pool only atomically.
pub unsafe fn native_phantom_pass(
    pool: u64,
    host: u64,
    pages: u64,
    params: PassParams,
    vcpu_idx: u32,
) {
    use crate::guest_ram::phantom::data_addr;
    // SAFETY: every address is inside the pool, page aligned plus a multiple of 8 below
    // 4096, by the caller's contract.
    unsafe { pass_at(|off| data_addr(pool, host + off), pages, params, vcpu_idx) }
}

/// The pattern's accesses at `addr(page offset)`.
///
/// # Safety
///
/// `addr(page * 4096)` for every `page < pages` must be 8-byte aligned, mapped and writable
/// for the call, and accessed by other threads only atomically.
#[inline(always)]
unsafe fn pass_at(addr: impl Fn(u64) -> u64, pages: u64, params: PassParams, vcpu_idx: u32) {
    use std::sync::atomic::{AtomicU64, Ordering};
    for (page, write) in Pattern::new(params, vcpu_idx, pages) {
        // SAFETY: `page < pages`, so valid by the caller's contract; atomic because other
        // threads may touch the same page (overlap).
        let a = unsafe { AtomicU64::from_ptr(addr(page * slat_addr::PAGE_SIZE) as *mut u64) };
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
        let mut r = ParkMiller::new(1);
        assert_eq!(r.next_u32(), 48271);
        assert_eq!(r.next_u32(), ((48271u64 * 48271) % 0x7fff_ffff) as u32);
        // The 10000th value from seed 1 of the multiplier-48271 generator (Park, Miller and
        // Stockmeyer 1993).
        let mut r = ParkMiller::new(1);
        let v = (0..10_000).map(|_| r.next_u32()).last();
        assert_eq!(v, Some(399_268_537));
    }

    #[test]
    fn zero_seed_is_mapped_to_one() {
        assert_eq!(ParkMiller::normalize(0), 1);
        assert_eq!(ParkMiller::normalize(0x7fff_ffff), 1);
        assert_eq!(ParkMiller::normalize(u32::MAX), 0x8000_0000 % 0x7fff_ffff);
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
            timed: false,
            touches: None,
        };
        let n = 100_000;
        let writes = Pattern::new(params, 3, n).filter(|&(_, w)| w).count() as f64;
        assert!((writes / n as f64 - 0.3).abs() < 0.02, "{writes}");
        assert!(Pattern::new(params, 3, n).all(|(p, _)| p < n));
    }
}
