//! How `slat calibrate` times things: batches of a loop, the median of their per-operation
//! times, threads pinned to the host's cores, and a clock that counts the engine's charges
//! (so a loop's time is divided by the operations it really performed).

use slat::clock::{Clock, Cost, LockMode};
use std::cell::Cell;
use std::hint::black_box;
use std::time::Instant;

/// The median of `v` (0 for an empty slice); sorts `v`.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs `body(iters)` `repeat` times (after one unmeasured warm-up batch) and returns the
/// median time per iteration, ns. `body` does `iters` operations.
pub fn per_op(repeat: u32, iters: u64, mut body: impl FnMut(u64)) -> f64 {
    body(iters.div_ceil(4).max(1));
    let mut v: Vec<f64> = (0..repeat.max(1))
        .map(|_| {
            let t0 = Instant::now();
            body(iters);
            t0.elapsed().as_nanos() as f64 / iters.max(1) as f64
        })
        .collect();
    median(&mut v)
}

/// Pins the calling thread to host CPU `cpu` (best effort: a host with fewer CPUs, or a
/// refused affinity, leaves the thread where the scheduler puts it). Returns whether it held.
pub fn pin_to(cpu: usize) -> bool {
    // SAFETY: `set` is a plain bitmask the libc macros initialise; sched_setaffinity only reads
    // it, for the calling thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Host CPUs online (not this thread's affinity, which pinning narrows).
pub fn host_cpus() -> usize {
    // SAFETY: sysconf only reads a system value.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).map_or(1, |n| n.max(1))
}

/// The load averages of the last 1, 5 and 15 minutes (zeros where unreadable).
pub fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut out = [0.0; 3];
    for (slot, word) in out.iter_mut().zip(text.split_whitespace()) {
        *slot = word.parse().unwrap_or(0.0);
    }
    out
}

/// A cache-line-aligned word, so two of them never share a line.
#[repr(align(128))]
#[derive(Default)]
pub struct Line(pub std::sync::atomic::AtomicU64);

thread_local! {
    static COUNTS: Cell<[u64; Cost::ALL.len()]> = const { Cell::new([0; Cost::ALL.len()]) };
    static HOOKS: Cell<[u64; HOOK_KINDS]> = const { Cell::new([0; HOOK_KINDS]) };
}

/// The synchronising hooks [`Counting`] counts besides the fixed costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncHook {
    /// `rmw`: an atomic read-modify-write or a store to a shared line.
    Rmw,
    /// `fence`.
    Fence,
    /// `lock` (its grant is an RMW of the lock word).
    Lock,
    /// `unlock` (the release store).
    Unlock,
    /// `store`: a plain store to a shared line (free on a line the CPU owns).
    Store,
}

const HOOK_KINDS: usize = 5;

fn bump_hook(h: SyncHook) {
    HOOKS.with(|c| {
        let mut a = c.get();
        a[h as usize] += 1;
        c.set(a);
    });
}

/// A clock that only counts, on the calling thread, the fixed costs charged and the
/// synchronising hooks called (every hook otherwise behaves as real time's): run a loop
/// through `Timed<Ept, Counting>` to learn how many walk steps or TLB misses it performed,
/// and which of its time the line model already charges (its RMWs and fences).
#[derive(Debug, Clone, Copy, Default)]
pub struct Counting;

impl Counting {
    /// Clears this thread's counts.
    pub fn reset() {
        COUNTS.with(|c| c.set([0; Cost::ALL.len()]));
        HOOKS.with(|c| c.set([0; HOOK_KINDS]));
    }

    /// How many times hook `h` ran on this thread since the last reset.
    pub fn hooks(h: SyncHook) -> u64 {
        HOOKS.with(|c| c.get()[h as usize])
    }

    /// The hooks since the last reset that the line model prices at `rmw_local` each when
    /// nobody else touches the line: RMWs, fences, and a lock's grant and release.
    pub fn local_rmws() -> u64 {
        [
            SyncHook::Rmw,
            SyncHook::Fence,
            SyncHook::Lock,
            SyncHook::Unlock,
        ]
        .iter()
        .map(|h| Counting::hooks(*h))
        .sum()
    }

    /// How many times `cost` was charged on this thread since the last reset.
    pub fn count(cost: Cost) -> u64 {
        let i = Cost::ALL.iter().position(|c| *c == cost).unwrap_or(0);
        COUNTS.with(|c| c.get()[i])
    }
}

// SAFETY: no hook touches engine state; `spin_until` loops until `cond` holds, as real time's.
unsafe impl Clock for Counting {
    const VIRTUAL: bool = false;
    fn rmw(_addr: usize) {
        bump_hook(SyncHook::Rmw);
    }
    fn store(_addr: usize) {
        bump_hook(SyncHook::Store);
    }
    fn shared_load(_addr: usize) {}
    fn fence() {
        bump_hook(SyncHook::Fence);
    }
    fn lock(_addr: usize, _mode: LockMode) {
        bump_hook(SyncHook::Lock);
    }
    fn unlock(_addr: usize, _mode: LockMode) {
        bump_hook(SyncHook::Unlock);
    }
    fn spin_until(watch: &[usize], cond: &mut dyn FnMut() -> bool) {
        slat::clock::RealTime::spin_until(watch, cond)
    }
    fn charge(cost: Cost, n: u64) {
        if let Some(i) = Cost::ALL.iter().position(|c| *c == cost) {
            COUNTS.with(|c| {
                let mut a = c.get();
                a[i] += n;
                c.set(a);
            });
        }
    }
    fn now_ns() -> u64 {
        slat::clock::RealTime::now_ns()
    }
}

/// Keeps `v` alive in the optimiser's eyes (re-exported so benchmarks share one spelling).
#[inline(always)]
pub fn keep<T>(v: T) -> T {
    black_box(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn counting_clock_counts_per_thread() {
        Counting::reset();
        Counting::charge(Cost::WalkStep, 3);
        Counting::charge(Cost::TlbMiss, 1);
        assert_eq!(Counting::count(Cost::WalkStep), 3);
        assert_eq!(Counting::count(Cost::TlbMiss), 1);
        std::thread::spawn(|| assert_eq!(Counting::count(Cost::WalkStep), 0))
            .join()
            .unwrap();
    }
}
