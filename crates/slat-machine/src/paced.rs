//! A memstress guest whose dirty rate the host controls while it runs: live migration's
//! workload.
//!
//! Each vCPU runs memstress passes back to back over its region (sequential or pseudo-random
//! pages, `write_percent` of the accesses writes) until halted, with two host controls read
//! at run time through a shared [`Pacer`]:
//!
//! - a **rate limit** on writes per second per vCPU (a token bucket), so a migration can be
//!   measured at a light or a heavy dirty rate;
//! - a **throttle**, the fraction of each 10 ms slice the vCPU spends outside guest mode,
//!   as QEMU's auto-converge puts vCPU threads to sleep when the guest dirties memory faster
//!   than the link sends it;
//! - a **per-vCPU throttle** in parts per million of the same slice, and a per-vCPU rate override,
//!   for QEMU's dirty-limit: only the vCPUs that dirty too fast are slowed (the larger of the
//!   two throttles applies), and a test can give one vCPU a heavier rate than another.
//!
//! Unlike memstress, every write stores a value never written before (the vCPU index in the
//! top byte and a per-vCPU counter below), so a page written twice changes twice: a migration
//! that loses a write leaves a page that differs from the source, and verification sees it.
//!
//! Waiting happens outside guest mode, with the physical-CPU token given back: a vCPU asleep
//! in guest mode would stall every remote flush (a harvest's among them) for its nap.

use crate::cpu::{Cpu, Exit};
use crate::memstress::{ParkMiller, PassParams};
use slat::PteFormat;
use slat_addr::PAGE_SIZE;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Accesses between looks at the clock, the halt flag and the pacer.
const CHECK_EVERY: u64 = 64;
/// The same while throttled: a 999 per mille throttle leaves 10 µs of a slice, about 70
/// writes of a flat-out simulated vCPU (~7 M writes/s); checking every 8 overruns it by at
/// most ~1 µs, where every 64 would nearly double the run and the floor with it.
const THROTTLED_CHECK_EVERY: u64 = 8;
/// The throttle's time slice (QEMU's CPU throttle uses 10 ms too).
const SLICE: Duration = Duration::from_millis(10);
/// Longest single nap: a halt is noticed within this much.
const MAX_NAP: Duration = Duration::from_millis(2);
/// Highest throttle accepted: a vCPU that never runs would never finish a pass.
pub const MAX_THROTTLE_PERCENT: u32 = 99;
/// Highest per-vCPU throttle, parts per million: 10 µs of each 10 ms slice in the guest. Its
/// floor is about a thousandth of the vCPU's unthrottled rate (a flat-out simulated vCPU
/// writes ~7.5 M/s and is held at ~4k/s, the naps overshooting), so dirty-limit can hold even
/// that vCPU near a limit of 8k pages/s; at the former 99% the floor was ~75k writes/s.
/// Parts per million, not per mille: near the floor one per mille is a factor of two in the
/// rate, and a controller on that grid swings between the two sides of its limit.
/// Auto-converge keeps QEMU's 99% ([`MAX_THROTTLE_PERCENT`]).
pub const MAX_VCPU_THROTTLE_PPM: u32 = 999_000;

/// A throttle's whole slice, in its parts per million.
const PPM: u32 = 1_000_000;

/// Most vCPUs a [`Pacer`] gives controls of their own (KVM's `KVM_MAX_VCPUS` on x86).
pub const MAX_PACED_VCPUS: usize = 4096;

/// Why a [`Pacer`] could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PacerError {
    /// More vCPUs than [`MAX_PACED_VCPUS`].
    #[error("a pacer has per-vCPU controls for at most {MAX_PACED_VCPUS} vCPUs, not {0}")]
    TooManyVcpus(usize),
    /// The per-vCPU controls could not be allocated.
    #[error("cannot allocate pacer controls for {0} vCPUs")]
    Alloc(usize),
}

/// One vCPU's own controls and counters (see [`Pacer::for_vcpus`]).
#[derive(Debug, Default)]
struct VcpuPace {
    /// Parts per million of each slice this vCPU spends outside guest mode (dirty-limit).
    throttle: AtomicU32,
    /// Writes per second of this vCPU (0: the pacer's rate).
    rate: AtomicU64,
    /// Writes this vCPU completed (updated every [`CHECK_EVERY`] accesses).
    writes: AtomicU64,
}

/// Host controls of a running [`Workload::Paced`](crate::Workload::Paced), and what the
/// vCPUs report back through it.
#[derive(Debug, Default)]
pub struct Pacer {
    /// Writes per second per vCPU (0: unlimited).
    rate: AtomicU64,
    /// Percent of each slice spent outside guest mode (0: none).
    throttle: AtomicU32,
    /// Nanoseconds the vCPUs spent asleep because of the throttle, summed over vCPUs.
    throttled_ns: AtomicU64,
    /// Nanoseconds the vCPUs spent asleep because of the rate limit, summed over vCPUs.
    paced_ns: AtomicU64,
    /// Writes completed, summed over vCPUs (updated every [`CHECK_EVERY`] accesses).
    writes: AtomicU64,
    /// Per-vCPU controls (empty: none; vCPUs past the end have none).
    vcpus: Box<[VcpuPace]>,
}

impl Pacer {
    /// A pacer limiting each vCPU to `rate` writes per second (0: unlimited), unthrottled.
    pub fn new(rate: u64) -> Arc<Pacer> {
        let p = Pacer::default();
        p.rate.store(rate, Ordering::Relaxed);
        Arc::new(p)
    }
    /// A pacer like [`Pacer::new`] with per-vCPU controls for `vcpus` vCPUs (at most
    /// [`MAX_PACED_VCPUS`]).
    pub fn for_vcpus(rate: u64, vcpus: usize) -> Result<Arc<Pacer>, PacerError> {
        if vcpus > MAX_PACED_VCPUS {
            return Err(PacerError::TooManyVcpus(vcpus));
        }
        let mut controls = Vec::new();
        controls
            .try_reserve_exact(vcpus)
            .map_err(|_| PacerError::Alloc(vcpus))?;
        controls.resize_with(vcpus, VcpuPace::default);
        let p = Pacer {
            vcpus: controls.into_boxed_slice(),
            ..Pacer::default()
        };
        p.rate.store(rate, Ordering::Relaxed);
        Ok(Arc::new(p))
    }
    /// vCPUs with controls of their own.
    pub fn vcpus(&self) -> usize {
        self.vcpus.len()
    }
    /// Sets vCPU `i`'s own throttle in parts per million, clamped to
    /// [`MAX_VCPU_THROTTLE_PPM`] (ignored for a vCPU without controls).
    pub fn set_vcpu_throttle_ppm(&self, i: usize, ppm: u32) {
        if let Some(v) = self.vcpus.get(i) {
            v.throttle
                .store(ppm.min(MAX_VCPU_THROTTLE_PPM), Ordering::Relaxed);
        }
    }
    /// Every vCPU's own throttle, parts per million.
    pub fn vcpu_throttles_ppm(&self) -> Vec<u32> {
        self.vcpus
            .iter()
            .map(|v| v.throttle.load(Ordering::Relaxed))
            .collect()
    }
    /// Sets vCPU `i`'s own write rate (0: the pacer's).
    pub fn set_vcpu_rate(&self, i: usize, rate: u64) {
        if let Some(v) = self.vcpus.get(i) {
            v.rate.store(rate, Ordering::Relaxed);
        }
    }
    /// Writes per vCPU so far (a little behind while the vCPUs run).
    pub fn vcpu_writes(&self) -> Vec<u64> {
        self.vcpus
            .iter()
            .map(|v| v.writes.load(Ordering::Relaxed))
            .collect()
    }
    /// Sets the per-vCPU write rate limit (0: unlimited); running vCPUs follow it at once.
    pub fn set_rate(&self, rate: u64) {
        self.rate.store(rate, Ordering::Relaxed);
    }
    /// The per-vCPU write rate limit.
    pub fn rate(&self) -> u64 {
        self.rate.load(Ordering::Relaxed)
    }
    /// Sets the throttle, clamped to [`MAX_THROTTLE_PERCENT`].
    pub fn set_throttle(&self, percent: u32) {
        self.throttle
            .store(percent.min(MAX_THROTTLE_PERCENT), Ordering::Relaxed);
    }
    /// The throttle in percent.
    pub fn throttle(&self) -> u32 {
        self.throttle.load(Ordering::Relaxed)
    }
    /// Time the vCPUs spent asleep because of the throttle (summed over vCPUs).
    pub fn throttled(&self) -> Duration {
        Duration::from_nanos(self.throttled_ns.load(Ordering::Relaxed))
    }
    /// Time the vCPUs spent waiting for the rate limit (summed over vCPUs).
    pub fn paced(&self) -> Duration {
        Duration::from_nanos(self.paced_ns.load(Ordering::Relaxed))
    }
    /// Writes so far, summed over vCPUs (a little behind while the vCPUs run).
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }
}

/// Parameters of a paced run.
#[derive(Debug, Clone)]
pub struct PacedParams {
    /// Page order, write percentage and seed of each pass (a random order draws a new
    /// sequence every pass, so passes do not repeat).
    pub pass: PassParams,
    /// Host controls.
    pub pacer: Arc<Pacer>,
}

/// Runs the paced workload of vCPU `idx` over `pages` pages at `gpa` until `halt` is set.
/// Returns (pages touched, full passes). With `params.pass.timed`, times the faulting writes
/// (the caller started the vCPU's timing).
pub(crate) fn run<F: PteFormat>(
    cpu: &mut Cpu<F>,
    params: &PacedParams,
    gpa: u64,
    pages: u64,
    idx: u32,
    halt: &AtomicBool,
) -> Result<(u64, u64), Exit> {
    // Chosen once per run, so an untimed run's loop does not test it per write.
    if params.pass.timed {
        run_paced::<F, true>(cpu, params, gpa, pages, idx, halt)
    } else {
        run_paced::<F, false>(cpu, params, gpa, pages, idx, halt)
    }
}

fn run_paced<F: PteFormat, const TIMED: bool>(
    cpu: &mut Cpu<F>,
    params: &PacedParams,
    gpa: u64,
    pages: u64,
    idx: u32,
    halt: &AtomicBool,
) -> Result<(u64, u64), Exit> {
    let pacer = &*params.pacer;
    let own = pacer.vcpus.get(idx as usize);
    let p = params.pass;
    let mut value = (idx as u64) << 56;
    let (mut touched, mut passes, mut unreported) = (0u64, 0u64, 0u64);
    // Accesses until the next check (0: check now).
    let mut until_check = 0u64;
    let mut bucket = Bucket::new(Instant::now());
    let mut slice_start = Instant::now();
    for pass in 0u32.. {
        // A new sequence per pass for random order; the first pass is memstress's own.
        let mut rng = ParkMiller::new(
            p.seed
                .wrapping_add(idx)
                .wrapping_add(pass.wrapping_mul(0x9e37_79b9)),
        );
        for i in 0..pages {
            if until_check == 0 {
                pacer.writes.fetch_add(unreported, Ordering::Relaxed);
                if let Some(v) = own {
                    v.writes.fetch_add(unreported, Ordering::Relaxed);
                }
                unreported = 0;
                if halt.load(Ordering::Relaxed) {
                    return Ok((touched, passes));
                }
                match throttle_and_pace(cpu, pacer, own, halt, &mut bucket, &mut slice_start) {
                    Some(n) => until_check = n,
                    None => return Ok((touched, passes)),
                }
            }
            let page = if p.random {
                // Two draws: pages beyond 2^31 stay reachable.
                (((rng.next_u32() as u64) << 31) | rng.next_u32() as u64) % pages
            } else {
                i
            };
            let write = match p.write_percent {
                100 => true,
                0 => false,
                w => rng.next_u32() % 100 < w,
            };
            let a = gpa + page * PAGE_SIZE;
            if write {
                value += 1;
                if TIMED {
                    cpu.write_u64_timed(a, value)?;
                } else {
                    cpu.write_u64(a, value)?;
                }
                unreported += 1;
                bucket.take();
            } else {
                std::hint::black_box(cpu.read_u64(a)?);
            }
            touched += 1;
            until_check -= 1;
        }
        passes += 1;
    }
    Ok((touched, passes))
}

/// The throttle and the rate limit, applied at a check: naps outside guest mode for this
/// vCPU's share of the slice, then waits for a token. Returns the accesses until the next
/// check, or `None` once `halt` is set.
fn throttle_and_pace<F: PteFormat>(
    cpu: &mut Cpu<F>,
    pacer: &Pacer,
    own: Option<&VcpuPace>,
    halt: &AtomicBool,
    bucket: &mut Bucket,
    slice_start: &mut Instant,
) -> Option<u64> {
    let now = Instant::now();
    // Throttle, parts per million: the global one (auto-converge) or this vCPU's own
    // (dirty-limit), whichever is larger. After running (1e6 - t) ppm of a slice,
    // sleep t ppm of it.
    let global = pacer
        .throttle
        .load(Ordering::Relaxed)
        .min(MAX_THROTTLE_PERCENT)
        * 10_000;
    let t = own
        .map_or(0, |v| v.throttle.load(Ordering::Relaxed))
        .min(MAX_VCPU_THROTTLE_PPM)
        .max(global);
    let until_check = if t != 0 {
        THROTTLED_CHECK_EVERY
    } else {
        CHECK_EVERY
    };
    if t != 0 && now.duration_since(*slice_start) >= SLICE * (PPM - t) / PPM {
        let nap = SLICE * t / PPM;
        nap_outside_guest(cpu, nap, halt);
        pacer
            .throttled_ns
            .fetch_add(nap.as_nanos() as u64, Ordering::Relaxed);
        *slice_start = Instant::now();
        // A throttled vCPU is a slower vCPU: the nap earns no writes, so the
        // throttle cuts a rate-limited guest's rate by the same share.
        bucket.last = *slice_start;
    } else if t == 0 {
        *slice_start = now;
    }
    // Rate limit: wait until the bucket holds a token for the next write.
    let rate = match own.map_or(0, |v| v.rate.load(Ordering::Relaxed)) {
        0 => pacer.rate.load(Ordering::Relaxed),
        r => r,
    };
    while let Some(wait) = bucket.wait(rate, Instant::now()) {
        if halt.load(Ordering::Relaxed) {
            return None;
        }
        let nap = wait.min(MAX_NAP);
        let t0 = Instant::now();
        nap_outside_guest(cpu, nap, halt);
        pacer
            .paced_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    Some(until_check)
}

/// Leaves guest mode (giving the physical CPU back), sleeps, comes back; the sleep ends early
/// in steps of [`MAX_NAP`] once `halt` is set.
fn nap_outside_guest<F: PteFormat>(cpu: &mut Cpu<F>, d: Duration, halt: &AtomicBool) {
    cpu.exit();
    let end = Instant::now() + d;
    loop {
        let now = Instant::now();
        if now >= end || halt.load(Ordering::Relaxed) {
            break;
        }
        std::thread::sleep((end - now).min(MAX_NAP));
    }
    cpu.enter();
}

/// A token bucket of writes: refilled at the current rate, holding at most 10 ms of it (at
/// least [`CHECK_EVERY`] tokens, since writes are only checked that often).
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(now: Instant) -> Bucket {
        Bucket {
            tokens: 0.0,
            last: now,
        }
    }

    /// How long to wait before the next write may go, or `None` if it may go now.
    fn wait(&mut self, rate: u64, now: Instant) -> Option<Duration> {
        if rate == 0 {
            self.tokens = 0.0;
            self.last = now;
            return None;
        }
        let cap = (rate as f64 / 100.0).max(CHECK_EVERY as f64);
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * rate as f64).min(cap);
        if self.tokens >= 1.0 {
            None
        } else {
            Some(Duration::from_secs_f64((1.0 - self.tokens) / rate as f64))
        }
    }

    fn take(&mut self) {
        self.tokens -= 1.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_lets_the_rate_through_and_no_more() {
        let t0 = Instant::now();
        let mut b = Bucket::new(t0);
        // Over one simulated second at 1000/s, about 1000 writes pass (plus the burst cap).
        let mut passed = 0u64;
        let mut now = t0;
        while now.duration_since(t0) < Duration::from_secs(1) {
            match b.wait(1000, now) {
                None => {
                    b.take();
                    passed += 1;
                }
                Some(w) => now += w,
            }
        }
        assert!((990..=1000 + CHECK_EVERY).contains(&passed), "{passed}");
        assert!(b.wait(0, now).is_none());
    }

    #[test]
    fn throttle_is_clamped() {
        let p = Pacer::new(0);
        p.set_throttle(150);
        assert_eq!(p.throttle(), MAX_THROTTLE_PERCENT);
        let v = Pacer::for_vcpus(0, 2).unwrap();
        v.set_vcpu_throttle_ppm(1, 5_000_000);
        v.set_vcpu_throttle_ppm(7, 100);
        assert_eq!(v.vcpu_throttles_ppm(), vec![0, MAX_VCPU_THROTTLE_PPM]);
    }
}
