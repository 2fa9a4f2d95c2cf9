//! Micro-benchmarks of the host itself: atomics on one line and between the two cores, a
//! DRAM miss, a lock hand-off, zeroing a page, crossbeam's epoch pin and defer, a line of
//! cache maintenance. None of them runs the engine's fault path or a benchmark: calibration
//! never looks at a benchmark's result.

use super::timing::{keep, per_op, pin_to, Line};
use super::{Measured, Plan};
use crate::error::{CliError, CliResult};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// An uncontended compare-and-swap on a line the thread owns.
pub fn rmw_local(p: &Plan) -> Measured {
    let line = Line::default();
    let iters = p.iters(2_000_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            let v = line.0.load(Ordering::Relaxed);
            keep(
                line.0
                    .compare_exchange(v, v + 1, Ordering::AcqRel, Ordering::Relaxed),
            )
            .ok();
        }
    });
    p.measured(
        "rmw_local",
        ns,
        format!("compare_exchange loop on one cache line, one thread ({iters} CASes per batch)"),
    )
}

/// Waits until `cond` holds, spinning briefly and then yielding (the other thread may need
/// this CPU), or until `deadline`. Returns whether `cond` held.
fn wait_for(deadline: Instant, mut cond: impl FnMut() -> bool) -> bool {
    let mut spins = 0u32;
    while !cond() {
        spins += 1;
        if spins % 256 == 0 {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    true
}

/// Runs `partner` on host CPU 1 until `a` (on CPU 0, timed by [`per_op`]) is done; both
/// pinned where the host allows. Timing starts once the partner runs; a partner must poll
/// `stop`.
fn on_two_cores(
    p: &Plan,
    iters: u64,
    a: impl FnMut(u64) + Send,
    partner: impl FnOnce(&AtomicBool) + Send,
) -> CliResult<(f64, bool)> {
    let stop = AtomicBool::new(false);
    let ready = AtomicBool::new(false);
    let mut pinned = true;
    let ns: CliResult<f64> = std::thread::scope(|s| {
        let (stop, ready) = (&stop, &ready);
        // The only thread: a failed start leaves none behind (and nothing is timed).
        let h = std::thread::Builder::new()
            .name("partner".into())
            .spawn_scoped(s, move || {
                let ok = pin_to(1);
                ready.store(true, Ordering::Release);
                partner(stop);
                ok
            })
            .map_err(no_partner)?;
        pinned &= pin_to(0);
        wait_for(Instant::now() + p.limit(), || ready.load(Ordering::Acquire));
        let ns = per_op(p.repeat, iters, a);
        stop.store(true, Ordering::Release);
        pinned &= h.join().unwrap_or(false);
        Ok(ns)
    });
    // The main thread goes back to every CPU.
    unpin(p.cpus);
    Ok((ns?, pinned))
}

/// A partner thread that could not be started: a failure of the run (exit 1).
fn no_partner(e: std::io::Error) -> CliError {
    CliError::Runtime(format!("cannot start a benchmark's partner thread: {e}"))
}

/// Lets the calling thread run on every host CPU again.
fn unpin(cpus: usize) {
    // SAFETY: as in `pin_to`: a bitmask initialised by the libc macros, read by the call.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for cpu in 0..cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Takes `n` turns on `line` with the thread on the other core, starting at count `from`:
/// a turn moves the count from `from` to `from + 1`, and the other side's turn then makes it
/// `from + 2`. With `poll_by_cas` a side polls with the compare-and-swap itself, so each poll
/// takes the line exclusive and never holds a shared copy; otherwise it spins on loads (a
/// shared copy of the other side's write) and then swaps. Returns early at `limit` or once
/// `stop` is set.
fn take_turns(
    line: &Line,
    from: &mut u64,
    n: u64,
    poll_by_cas: bool,
    limit: Instant,
    stop: &AtomicBool,
) {
    for _ in 0..n {
        let f = *from;
        let stopped = || stop.load(Ordering::Relaxed);
        if !poll_by_cas && !wait_for(limit, || line.0.load(Ordering::Acquire) == f || stopped()) {
            return;
        }
        let cas = || {
            line.0
                .compare_exchange(f, f + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        };
        if !wait_for(limit, || cas() || stopped()) || stopped() {
            return;
        }
        *from += 2;
    }
}

/// Half the round trip of two threads taking turns on one line ([`take_turns`]), and
/// whether both were pinned.
fn turns_half_round(p: &Plan, poll_by_cas: bool) -> CliResult<(f64, bool)> {
    let line = Line::default();
    // Short batches: on a shared host, a batch the scheduler interrupts is an outlier the
    // median drops, and a short one is interrupted less often.
    let iters = p.iters(2_000);
    let limit = Instant::now() + p.limit();
    let never = AtomicBool::new(false);
    let mut from = 0;
    let (rt, pinned) = on_two_cores(
        p,
        iters,
        |n| take_turns(&line, &mut from, n, poll_by_cas, limit, &never),
        |stop| {
            let mut from = 1;
            take_turns(&line, &mut from, u64::MAX, poll_by_cas, limit, stop);
        },
    )?;
    Ok((rt / 2.0, pinned))
}

/// A line bounced between the two cores by compare-and-swap polls: each turn fetches the
/// line exclusive from the other core's modified copy, one transfer per half round trip.
pub fn line_transfer(p: &Plan) -> CliResult<Measured> {
    let (ns, pinned) = turns_half_round(p, true)?;
    Ok(p.measured(
        "line_transfer",
        ns,
        format!(
            "half the round trip of two threads{} taking turns on one line, each polling with compare_exchange (a turn fetches the other core's modified line exclusive: one transfer; {} round trips per batch)",
            pinned_note(pinned),
            p.iters(2_000)
        ),
    ))
}

fn pinned_note(pinned: bool) -> &'static str {
    if pinned {
        " pinned to host CPUs 0 and 1"
    } else {
        " (pinning refused: wherever the scheduler put them)"
    }
}

/// The same turns, each side spinning on loads before its compare-and-swap: a transfer into
/// a shared copy, then an upgrade that invalidates the other core's copy. Minus
/// `line_transfer`, what the upgrade costs.
pub fn invalidate(p: &Plan, line_transfer: f64) -> CliResult<Measured> {
    let (ns, pinned) = turns_half_round(p, false)?;
    Ok(p.measured(
        "invalidate",
        (ns - line_transfer).max(0.0),
        format!(
            "half the round trip of two threads{} taking turns on one line, each spinning on loads and then swapping with compare_exchange ({ns:.1} ns: a transfer into a shared copy and an upgrade), minus line_transfer ({} round trips per batch)",
            pinned_note(pinned),
            p.iters(2_000)
        ),
    ))
}

/// Sattolo's shuffle of `0..n` into one cycle, from a fixed linear congruential sequence
/// (the same chain every run).
fn one_cycle(n: usize) -> Vec<u32> {
    let mut perm: Vec<u32> = (0..n as u32).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..n).rev() {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = ((x >> 33) as usize) % i;
        perm.swap(i, j);
    }
    perm
}

/// A dependent load chain through a buffer much larger than the caches: one miss per load.
pub fn dram_miss(p: &Plan) -> Measured {
    let lines = p.big_bytes() / 64;
    let order = one_cycle(lines);
    // One u64 per line, 8 words a line: next[line * 8] = the following line's index.
    let mut next = vec![0u64; lines * 8];
    for w in 0..lines {
        let (from, to) = (order[w] as usize, order[(w + 1) % lines] as usize);
        next[from * 8] = to as u64;
    }
    drop(order);
    let iters = p.iters(2_000_000).min(lines as u64);
    let mut at = 0usize;
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            at = keep(next[at * 8]) as usize;
        }
    });
    p.measured(
        "dram_miss",
        ns,
        format!(
            "dependent loads along a random cycle through {} MiB, one line each (host TLB misses included, as a guest's first touch of a page has them; {iters} loads per batch)",
            p.big_bytes() >> 20
        ),
    )
}

/// Loads walking a buffer much larger than the caches line after line, as the engine walks a
/// table or a bitmap: the hardware prefetcher streams the lines in, so this is the
/// bandwidth cost of a line, not its latency.
pub fn dram_stream(p: &Plan) -> Measured {
    let words = p.big_bytes() / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let lines = words / 8;
    let iters = lines as u64;
    let ns = per_op(p.repeat, iters, |n| {
        let mut sum = 0u64;
        for l in 0..(n as usize).min(lines) {
            sum = sum.wrapping_add(buf[l * 8]);
        }
        keep(sum);
    });
    p.measured(
        "dram_stream",
        ns,
        format!(
            "loads of one word per line along {} MiB in address order (the prefetcher streams them; {iters} loads per batch)",
            p.big_bytes() >> 20
        ),
    )
}

/// Half the round trip of two threads handing a `parking_lot` mutex back and forth through a
/// condition variable: each hand-off wakes a parked waiter. Untimed waits (a timed one would
/// add a timer's cost, which is large in a nested VM); `DONE` ends the partner.
pub fn handoff(p: &Plan) -> CliResult<Measured> {
    const DONE: u64 = u64::MAX;
    let turn = parking_lot::Mutex::new(0u64);
    let cv = parking_lot::Condvar::new();
    let iters = p.iters(5_000);
    let mut pinned = true;
    let rt = std::thread::scope(|s| {
        let (turn, cv) = (&turn, &cv);
        // The only thread: a failed start leaves none behind (the ping-pong never begins).
        let h = std::thread::Builder::new()
            .name("partner".into())
            .spawn_scoped(s, move || {
                let ok = pin_to(1);
                let mut t = turn.lock();
                while *t != DONE {
                    if *t % 2 == 1 {
                        *t += 1;
                        cv.notify_one();
                    }
                    cv.wait(&mut t);
                }
                ok
            })
            .map_err(no_partner)?;
        pinned &= pin_to(0);
        let rt = per_op(p.repeat, iters, |n| {
            for _ in 0..n {
                let mut t = turn.lock();
                while *t % 2 == 1 {
                    cv.wait(&mut t);
                }
                *t += 1;
                cv.notify_one();
            }
        });
        // The partner answers every odd turn, so it is waiting now; DONE wakes it for good.
        let mut t = turn.lock();
        while *t % 2 == 1 {
            cv.wait(&mut t);
        }
        *t = DONE;
        cv.notify_all();
        drop(t);
        pinned &= h.join().unwrap_or(false);
        Ok::<_, CliError>(rt)
    })?;
    unpin(p.cpus);
    Ok(p.measured(
        "handoff",
        rt / 2.0,
        format!(
            "half the round trip of a parking_lot Mutex + Condvar ping-pong between two threads{} (a release waking a parked waiter; {iters} round trips per batch)",
            pinned_note(pinned)
        ),
    ))
}

/// Zeroing one 4 KiB page in cache.
pub fn zero_page(p: &Plan) -> Measured {
    let mut page = vec![0u8; 4096];
    let iters = p.iters(200_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            page.fill(0);
            keep(&mut page);
        }
    });
    p.measured(
        "zero_page",
        ns,
        format!("filling a cached 4 KiB page with zeros ({iters} pages per batch)"),
    )
}

/// Pages of each buffer [`page_copy`] copies between: 4 MiB, a reset's working set of a few
/// hundred dirty pages and its snapshot pages, inside a typical L3.
const COPY_PAGES: usize = 1024;

/// Copying one 4 KiB page from one page-aligned buffer into another, as a snapshot reset
/// writes a dirty page back: both buffers warm, the pages in a scattered order (stride 7,
/// coprime with the page count) as a dirty set's, so the prefetcher does not stream them.
pub fn page_copy(p: &Plan) -> Measured {
    const PS: usize = 4096;
    let len = COPY_PAGES * PS;
    // One page more than needed, so each buffer can start on a page boundary as guest pages
    // and the snapshot's held pages do (a straddling copy is measurably slower).
    let (mut src, mut dst) = (vec![0x5au8; len + PS], vec![0xa5u8; len + PS]);
    let (s0, d0) = (
        src.as_ptr().align_offset(PS).min(PS),
        dst.as_ptr().align_offset(PS).min(PS),
    );
    let (src, dst) = (&mut src[s0..s0 + len], &mut dst[d0..d0 + len]);
    src[1] = 1;
    let iters = p.iters(200_000);
    let ns = per_op(p.repeat, iters, |n| {
        let mut page = 0usize;
        for _ in 0..n {
            page = (page + 7) % COPY_PAGES;
            let at = page * PS;
            dst[at..at + PS].copy_from_slice(&src[at..at + PS]);
            keep(&mut *dst);
        }
    });
    p.measured(
        "page_copy",
        ns,
        format!(
            "copying a 4 KiB page between two warm, page-aligned {} MiB buffers, pages in a scattered order (stride 7) as a dirty set's ({iters} pages per batch)",
            len >> 20
        ),
    )
}

/// crossbeam-epoch's pin and unpin (no guard held around it, so every pin is a full one).
pub fn epoch_pin(p: &Plan) -> Measured {
    let iters = p.iters(2_000_000);
    let ns = per_op(p.repeat, iters, |n| {
        for _ in 0..n {
            drop(keep(crossbeam_epoch::pin()));
        }
    });
    p.measured(
        "epoch_pin",
        ns,
        format!("crossbeam_epoch::pin() and drop in a loop ({iters} pins per batch)"),
    )
}

/// Queueing a no-op deferred function on a pinned guard (its bag moves to the global queue
/// every 64).
pub fn defer(p: &Plan) -> Measured {
    let iters = p.iters(1_000_000);
    let ns = per_op(p.repeat, iters, |n| {
        let guard = crossbeam_epoch::pin();
        for _ in 0..n {
            guard.defer(|| ());
        }
        drop(guard);
    });
    p.measured(
        "defer",
        ns,
        format!("Guard::defer of a no-op under one pin ({iters} defers per batch)"),
    )
}

/// One line of `slat::cmo`'s data-cache clean (`clflushopt` here), over a buffer larger than
/// the caches.
pub fn cmo_line(p: &Plan) -> Measured {
    let bytes = if p.quick { 8 << 20 } else { 64 << 20 };
    let mut buf = vec![0u8; bytes];
    // Touch every page so the pass flushes resident lines, not zero-page mappings.
    for i in (0..bytes).step_by(4096) {
        buf[i] = 1;
    }
    let lines = (bytes / 64) as u64;
    let ns = per_op(p.repeat, lines, |_| {
        slat::cmo::clean_dcache_over(keep(&buf))
    });
    p.measured(
        "cmo_line",
        ns,
        format!(
            "slat::cmo::clean_dcache_over, one pass over {} MiB, per 64-byte line",
            bytes >> 20
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_cycle_visits_every_element() {
        let n = 1000;
        let p = one_cycle(n);
        let (mut at, mut seen) = (0usize, vec![false; n]);
        for _ in 0..n {
            assert!(!seen[at]);
            seen[at] = true;
            at = p[at] as usize;
        }
        assert_eq!(at, 0);
        assert!(seen.iter().all(|s| *s));
    }
}
