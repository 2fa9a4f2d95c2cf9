//! The memory a host fill faults in — a `memfd_secret(2)` file (each page the kernel allocates
//! for it is removed from the kernel's direct map, splitting a 2 MiB or 1 GiB leaf first), a
//! plain `memfd_create(2)` file (the same shared-file fault path without the direct-map work)
//! or anonymous memory — and the timed, sampled fill of it by N threads.

use super::counters::Snapshot;
use super::{per_s, readings};
use serde::Serialize;
use slat_workload::{Gate, ThreadBarrier};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// The page the fill writes once each (and the only page size memfd_secret has).
pub const PAGE: usize = slat_addr::PAGE_SIZE as usize;

/// Pages a thread writes between two updates of the shared progress counter: often enough for
/// 100 ms samples, rare enough that the counter's cache line does not slow the fill.
const PROGRESS_PAGES: usize = 64;

/// What backs a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `memfd_create`: shared memory, in the direct map.
    Memfd,
    /// `memfd_secret`: shared memory removed from the direct map page by page.
    Secret,
    /// Private anonymous memory (the guest_memfd comparison).
    Anon,
}

/// Why a region could not be set up.
#[derive(Debug, Error)]
pub enum MemError {
    /// The kernel has no memfd_secret, or refuses it to this process.
    #[error("memfd_secret(2) is unavailable here: {0}")]
    SecretUnavailable(String),
    /// Creating, sizing or mapping the memory failed.
    #[error("{what} failed: {err}{hint}")]
    Failed {
        what: String,
        err: io::Error,
        hint: &'static str,
    },
    /// A fill thread (or the sampler) could not be started.
    #[error("cannot start a fill thread: {0}")]
    Thread(io::Error),
}

/// Opens a memfd_secret file: the probe and every secret region use this.
pub fn secret_fd() -> Result<File, MemError> {
    // SAFETY: memfd_secret takes one flags argument and returns a new descriptor or -1; no
    // memory of this process is passed to the kernel.
    let fd = unsafe { libc::syscall(libc::SYS_memfd_secret, libc::O_CLOEXEC) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        return Err(MemError::SecretUnavailable(match err.raw_os_error() {
            Some(libc::ENOSYS) => format!("{err} (ENOSYS: the kernel is built without CONFIG_SECRETMEM, or it is disabled — boot with secretmem.enable=1 — or it cannot change its direct map)"),
            Some(libc::EPERM) => format!("{err} (EPERM: a seccomp filter or security module forbids the syscall)"),
            _ => err.to_string(),
        }));
    }
    // SAFETY: the syscall just returned this descriptor, which nothing else owns; the File
    // closes it on every path.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

/// A mapped region: unmapped, and its file closed, when dropped.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    // Closed after the unmapping (fields drop after `Drop::drop` runs).
    _file: Option<File>,
}

impl Region {
    /// Creates and maps `len` bytes (a non-zero multiple of [`PAGE`]) of `kind`, unpopulated.
    pub fn new(kind: Kind, len: usize) -> Result<Region, MemError> {
        let name = match kind {
            Kind::Memfd => "memfd",
            Kind::Secret => "memfd_secret",
            Kind::Anon => "anonymous",
        };
        let file = match kind {
            Kind::Secret => Some(secret_fd()?),
            Kind::Anon => None,
            Kind::Memfd => {
                // SAFETY: the name is a NUL-terminated literal; memfd_create returns a new
                // descriptor or -1.
                let fd =
                    unsafe { libc::memfd_create(c"slat-private-mem".as_ptr(), libc::MFD_CLOEXEC) };
                if fd < 0 {
                    let err = io::Error::last_os_error();
                    let what = "memfd_create".into();
                    return Err(MemError::Failed {
                        what,
                        err,
                        hint: "",
                    });
                }
                // SAFETY: a descriptor just returned by memfd_create, owned by nothing else.
                Some(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
            }
        };
        if let Some(f) = &file {
            f.set_len(len as u64).map_err(|err| MemError::Failed {
                what: format!("ftruncate of the {name} file to {len} bytes"),
                err,
                hint: "",
            })?;
        }
        let (flags, fd) = match &file {
            Some(f) => (libc::MAP_SHARED, f.as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
        };
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh mapping at an address the kernel chooses, of a file this function
        // owns (or anonymous memory); nothing else in the process refers to it.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
        if p == libc::MAP_FAILED {
            let err = io::Error::last_os_error();
            let hint = match (kind, err.raw_os_error()) {
                (Kind::Secret, Some(libc::EAGAIN)) => {
                    " (secret memory is locked memory: RLIMIT_MEMLOCK is too small)"
                }
                _ => "",
            };
            let what = format!("mmap of {len} bytes of {name}");
            return Err(MemError::Failed { what, err, hint });
        }
        Ok(Region {
            ptr: p.cast(),
            len,
            _file: file,
        })
    }

    /// The whole region, for the fill threads to split.
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` readable and writable bytes for as long as `self` lives, and
        // the `&mut self` borrow makes this the only reference to them.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` created; no slice of it outlives `self`
        // (`bytes` borrows `self`). A failure would leave the mapping until exit: nothing to do.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// One sampling interval of a fill: its counters are the increments within it.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// End of the interval, seconds from the start of the fill.
    pub t_s: f64,
    /// Length of the interval (the last one is usually shorter).
    interval_s: f64,
    /// Bytes faulted in during the interval.
    pub bytes: u64,
    pub gb_per_s: f64,
    /// 2 MiB → 4 KiB direct-map splits.
    pub level2_splits: Option<u64>,
    /// 1 GiB → 2 MiB direct-map splits.
    level3_splits: Option<u64>,
    tlb_shootdowns: Option<u64>,
    /// Kernel-range TLB flushes reach other CPUs as these.
    function_call_irqs: Option<u64>,
}

/// A timed fill.
pub struct Fill {
    /// From the start barrier to the last thread's last page.
    pub elapsed: Duration,
    /// Each thread's time over its share.
    pub per_thread: Vec<Duration>,
    pub samples: Vec<Sample>,
}

/// Writes one byte in every page of `region`, split evenly over `threads` threads, while a
/// sampler records the progress and the direct-map counters every `every`.
/// [`MemError::Thread`] if a thread could not be started (the ones started are joined).
pub fn fill(region: &mut Region, threads: usize, every: Duration) -> Result<Fill, MemError> {
    let share = (region.len / threads.max(1)).max(PAGE);
    let done = AtomicU64::new(0);
    // Every worker and this thread; a deadlock if it did not count the chunks exactly.
    // Abandonable: a worker that cannot start leaves the others waiting for a party that
    // never comes.
    let start = ThreadBarrier::new(region.len.div_ceil(share) + 1);
    let (stop, stopped) = mpsc::channel::<()>();
    let (done, start) = (&done, &start);
    std::thread::scope(|s| {
        let mut workers = Vec::new();
        for (i, part) in region.bytes().chunks_mut(share).enumerate() {
            let t = std::thread::Builder::new()
                .name(format!("fill{i}"))
                .spawn_scoped(s, move || touch(part, done, start));
            match t {
                Ok(h) => workers.push(h),
                Err(e) => {
                    // The released workers return without touching; the scope joins them.
                    start.abandon();
                    return Err(MemError::Thread(e));
                }
            }
        }
        // The first reading is the counters before the fill, timed when the threads start.
        let counters = Snapshot::read();
        let read = || (done.load(Ordering::Relaxed), Snapshot::read());
        start.wait();
        let t0 = Instant::now();
        // Should it not start, the workers (running by now) finish and the scope joins them.
        let sampler = std::thread::Builder::new()
            .name("fill-sampler".into())
            .spawn_scoped(s, move || {
                readings(every, stopped, (t0, (0, counters)), read)
            })
            .map_err(MemError::Thread)?;
        let per_thread: Vec<Duration> = workers
            .into_iter()
            .map(|w| w.join().expect("a fill thread panicked"))
            .collect();
        let elapsed = t0.elapsed();
        drop(stop);
        let r = sampler.join().expect("the sampler panicked");
        let samples = r.windows(2).map(|w| interval(r[0].0, &w[0], &w[1]));
        Ok(Fill {
            elapsed,
            per_thread,
            samples: samples.collect(),
        })
    })
}

/// One thread's share: one write per page, as `stress --vm-keep` does (none if the start is
/// abandoned).
fn touch(part: &mut [u8], done: &AtomicU64, start: &ThreadBarrier) -> Duration {
    if !start.wait() {
        return Duration::ZERO;
    }
    let t0 = Instant::now();
    for chunk in part.chunks_mut(PAGE * PROGRESS_PAGES) {
        for page in chunk.chunks_mut(PAGE) {
            page[0] = 1;
        }
        done.fetch_add(chunk.len() as u64, Ordering::Relaxed);
    }
    // The writes are the benchmark: keep the compiler from proving them unobserved.
    std::hint::black_box(&*part);
    t0.elapsed()
}

type Reading = (Instant, (u64, Snapshot));

fn interval(t0: Instant, a: &Reading, b: &Reading) -> Sample {
    let d = b.0.duration_since(a.0);
    let bytes = b.1 .0.saturating_sub(a.1 .0);
    let c = a.1 .1.until(&b.1 .1);
    Sample {
        t_s: b.0.duration_since(t0).as_secs_f64(),
        interval_s: d.as_secs_f64(),
        bytes,
        gb_per_s: per_s(bytes, d, 1e9),
        level2_splits: c.level2_splits,
        level3_splits: c.level3_splits,
        tlb_shootdowns: c.tlb_shootdowns,
        function_call_irqs: c.function_call_irqs,
    }
}
