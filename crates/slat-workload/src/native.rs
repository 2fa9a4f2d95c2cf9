//! The native baseline: the memstress pattern of a layout run by plain host threads on host
//! memory, to compare a guest pass with.

use crate::error::WorkloadError;
use crate::guest_ram::GuestRam;
use crate::layout::Layout;
use crate::pass::{PassReport, VcpuPass};
use crate::pattern::{native_pass, native_phantom_pass, PassParams};
use slat_addr::PAGE_SIZE;
use std::sync::RwLock;
use std::time::{Duration, Instant};

/// Runs the memstress pattern of `layout` natively on `mem` (at least as large as the test
/// region) with one thread per vCPU: the native baseline of a pass. On phantom memory each
/// access goes to its pool frame, as a phantom guest's does. The wall time is the
/// slowest thread's own time (the spawning thread may not run again until the workers finish).
/// With more threads than this process may run on at once, a thread's own time is its CPU
/// time instead: its elapsed time there is mostly other threads' turns (128 threads on two
/// cores made a 10 ns page look like a 1 µs one), and the baseline stands for one host CPU
/// per vCPU, as a virtual-time run simulates.
///
/// Only `bytes_per_vcpu`, `vcpus` and `overlap` of `layout` matter (vCPU `i` works on
/// `mem[i * bytes_per_vcpu..]`, or all of it with overlap). Refused with
/// [`WorkloadError::Config`]: `bytes_per_vcpu` zero or not a multiple of 4 KiB, a region size
/// that overflows, or `mem` smaller than the region.
pub fn native_baseline<C: Default + Send>(
    layout: Layout,
    mem: &GuestRam,
    params: PassParams,
) -> Result<PassReport<C>, WorkloadError> {
    checked_total(layout, mem)?;
    let region = |i: usize| region_in_mem(layout, i);
    let base = mem.addr();
    let pool = mem.phantom_pool();
    let oversubscribed =
        std::thread::available_parallelism().map_or(true, |n| layout.vcpus > n.get());
    // The workers start together when the gate opens (the write lock is released); if a
    // thread cannot be started, the gate opens with `true` and the started ones return.
    let gate = RwLock::new(false);
    let mut abort = gate.write().unwrap_or_else(|e| e.into_inner());
    let vcpus = std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(layout.vcpus);
        let mut failed = None;
        for i in 0..layout.vcpus {
            let gate = &gate;
            let (off, pages) = region(i);
            let worker = move || {
                if *gate.read().unwrap_or_else(|e| e.into_inner()) {
                    return None;
                }
                let t0 = Instant::now();
                let cpu0 = thread_cpu_ns();
                // SAFETY: `[base + off, base + off + pages * 4 KiB)` lies in `mem`: `off +
                // pages * 4 KiB <= total <= mem.len()` (checked above), and `mem` is borrowed
                // for the scope. `base` and `off` are page aligned. Other workers access the
                // range only atomically, and `GuestRam` lends out no references to its bytes.
                // Phantom memory's data lives in its pool, which `mem` keeps mapped.
                unsafe {
                    match pool {
                        None => native_pass(base + off, pages, params, i as u32),
                        Some(pool) => {
                            native_phantom_pass(pool, base + off, pages, params, i as u32)
                        }
                    }
                }
                Some(VcpuPass {
                    time: own_time(oversubscribed, t0, cpu0),
                    pages,
                    passes: 1,
                    ..VcpuPass::default()
                })
            };
            match std::thread::Builder::new().spawn_scoped(s, worker) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        *abort = failed.is_some();
        drop(abort);
        let done: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().ok().flatten().unwrap_or_default())
            .collect();
        match failed {
            Some(e) => Err(WorkloadError::Thread(e)),
            None => Ok(done),
        }
    })?;
    let wall = vcpus.iter().map(|v| v.time).max().unwrap_or_default();
    // Host memory never faults on the engine's tables: the baseline is not timed per write.
    Ok(PassReport {
        wall,
        vcpus,
        latency: Vec::new(),
    })
}

/// (offset in the memory, pages) of vCPU `i`'s region: the layout's own region, counted from
/// the memory's start (inside the region `checked_total` checked).
fn region_in_mem(layout: Layout, i: usize) -> (u64, u64) {
    let from_zero = Layout {
        gpa: 0,
        host: 0,
        ..layout
    };
    let (_, off, pages) = from_zero.region(i);
    (off, pages)
}

/// The calling thread's time since `t0` (elapsed) and `cpu0` (its CPU time then): the CPU
/// time if `oversubscribed` and the clock could be read.
fn own_time(oversubscribed: bool, t0: Instant, cpu0: Option<u64>) -> Duration {
    let elapsed = t0.elapsed();
    match (oversubscribed, cpu0, thread_cpu_ns()) {
        (true, Some(a), Some(b)) => Duration::from_nanos(b.saturating_sub(a)),
        _ => elapsed,
    }
}

/// The calling thread's CPU time, ns (`None` if the clock cannot be read).
fn thread_cpu_ns() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid place to write; CLOCK_THREAD_CPUTIME_ID names the calling thread.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u64::try_from(ts.tv_nsec).ok()?;
    (rc == 0).then(|| secs.saturating_mul(1_000_000_000).saturating_add(nanos))
}

/// The region's size in bytes, after the checks `native_baseline` documents.
fn checked_total(layout: Layout, mem: &GuestRam) -> Result<u64, WorkloadError> {
    let bytes = layout.bytes_per_vcpu;
    if bytes == 0 || bytes % PAGE_SIZE != 0 {
        return Err(WorkloadError::Config(format!(
            "native baseline: memory per vCPU ({bytes} bytes) must be a non-zero multiple of 4 KiB"
        )));
    }
    let total = u64::try_from(layout.vcpus)
        .ok()
        .and_then(|v| bytes.checked_mul(v))
        .ok_or_else(|| WorkloadError::Config("native baseline: region size overflows".into()))?;
    if mem.len() < total {
        return Err(WorkloadError::Config(format!(
            "native baseline needs {total} bytes of host memory, got {}",
            mem.len()
        )));
    }
    Ok(total)
}
