//! Demand paging through userfaultfd, as demand_paging_test's `-u MISSING|MINOR` does it:
//! guest RAM is registered with one userfaultfd per vCPU region (or one for all of it), and
//! handler threads serve every first touch — `UFFDIO_COPY` of a page filled with
//! [`UFFD_PATTERN`] (MISSING, memory not populated yet), or `UFFDIO_CONTINUE` of a page
//! already in the page cache (MINOR, shared memory whose page tables were dropped) — after an
//! optional delay per fault (`-d`).
//!
//! Whoever touches the registered memory first — a simulated vCPU thread's load or store, or
//! KVM resolving a guest fault on the host mapping — blocks in the kernel until a handler
//! thread has served the page. A [`UffdServer`] borrows the [`GuestRam`] it serves, and its
//! [`UffdServer::stop`] (or drop) joins every handler thread, so they never outlive the
//! mapping; closing the userfaultfds ends the registration.

use crate::backing::Backing;
use crate::guest_ram::GuestRam;
use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The byte every served page is filled with (the selftest's source pattern).
pub const UFFD_PATTERN: u8 = 0xAB;

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: u64 = 0xC018_AA3F;
const UFFDIO_REGISTER: u64 = 0xC020_AA00;
const UFFDIO_WAKE: u64 = 0x8010_AA02;
const UFFDIO_UNREGISTER: u64 = 0x8010_AA01;
const UFFDIO_COPY: u64 = 0xC028_AA03;
const UFFDIO_CONTINUE: u64 = 0xC020_AA07;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFDIO_REGISTER_MODE_MINOR: u64 = 1 << 2;
const UFFD_FEATURE_MISSING_HUGETLBFS: u64 = 1 << 4;
const UFFD_FEATURE_MISSING_SHMEM: u64 = 1 << 5;
const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// `sizeof(struct uffd_msg)`.
const MSG_SIZE: usize = 32;

#[repr(C)]
#[derive(Default)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
#[derive(Default)]
struct UffdioContinue {
    range: UffdioRange,
    mode: u64,
    mapped: i64,
}

/// How faults are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UffdMode {
    /// Missing pages: the handler copies a pattern page in (`UFFDIO_COPY`).
    Missing,
    /// Pages already in the page cache but not mapped: the handler maps them
    /// (`UFFDIO_CONTINUE`). Needs shared memory.
    Minor,
}

impl UffdMode {
    /// `MISSING` or `MINOR`, as the selftest spells them.
    pub fn name(self) -> &'static str {
        match self {
            UffdMode::Missing => "MISSING",
            UffdMode::Minor => "MINOR",
        }
    }

    /// The ioctl that resolves a fault.
    pub fn ioctl_name(self) -> &'static str {
        match self {
            UffdMode::Missing => "UFFDIO_COPY",
            UffdMode::Minor => "UFFDIO_CONTINUE",
        }
    }

    /// The kernel feature bits the backing needs in this mode, or why it cannot be used.
    fn features(self, backing: Backing) -> Result<u64, UffdError> {
        match (self, backing) {
            (_, b) if b.is_phantom() => Err(UffdError::Phantom { backing: b.name() }),
            (UffdMode::Missing, Backing::Anonymous | Backing::AnonymousThp) => Ok(0),
            (UffdMode::Missing, Backing::AnonymousHugetlb2M | Backing::AnonymousHugetlb1G) => {
                Ok(UFFD_FEATURE_MISSING_HUGETLBFS)
            }
            (UffdMode::Missing, Backing::Shmem) => Ok(UFFD_FEATURE_MISSING_SHMEM),
            (UffdMode::Minor, Backing::Shmem) => Ok(UFFD_FEATURE_MINOR_SHMEM),
            (UffdMode::Minor, b) => Err(UffdError::MinorNeedsShmem { backing: b.name() }),
            (UffdMode::Missing, b) => Err(UffdError::Phantom { backing: b.name() }),
        }
    }
}

/// Names of feature bits, for messages.
fn feature_name(bits: u64) -> &'static str {
    match bits {
        UFFD_FEATURE_MISSING_HUGETLBFS => "UFFD_FEATURE_MISSING_HUGETLBFS",
        UFFD_FEATURE_MISSING_SHMEM => "UFFD_FEATURE_MISSING_SHMEM",
        UFFD_FEATURE_MINOR_SHMEM => "UFFD_FEATURE_MINOR_SHMEM (Linux 5.14+)",
        _ => "userfaultfd features",
    }
}

/// A new userfaultfd (non-blocking, close-on-exec) after the API handshake asking for
/// `features`; the kernel's supported features are returned with it.
fn open_uffd(features: u64) -> io::Result<(OwnedFd, u64)> {
    // SAFETY: the userfaultfd syscall takes one integer flags argument and returns a new fd
    // or -1; nothing is passed by pointer.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api`, which `api` is
    // (`#[repr(C)]`, three u64), and lives across the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((fd, api.features))
}

/// Whether this host can serve `backing` memory in `mode`: userfaultfd is available to this
/// process and the kernel has the features the mode needs. One line saying why not.
pub fn check_support(mode: UffdMode, backing: Backing) -> Result<(), UffdError> {
    let need = mode.features(backing)?;
    let (_, have) = open_uffd(0).map_err(|source| {
        let knob = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|_| "?".into());
        UffdError::Unavailable { source, knob }
    })?;
    if have & need != need {
        return Err(UffdError::MissingFeature {
            mode: mode.name(),
            feature: feature_name(need),
            backing: backing.name(),
        });
    }
    Ok(())
}

/// Why userfaultfd cannot serve this run (messages name the selftest's `-u` and `-s`).
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// MINOR faults need page-cache pages.
    #[error("-u MINOR needs shared memory already in the page cache, which -s {backing} is not: use -s shmem")]
    MinorNeedsShmem {
        /// The backing asked for.
        backing: &'static str,
    },
    /// Phantom memory keeps no data, so there is nothing for a handler to copy in.
    #[error(
        "-u needs guest memory that keeps its data, which -s {backing} does not: use -s anonymous"
    )]
    Phantom {
        /// The backing asked for.
        backing: &'static str,
    },
    /// No userfaultfd at all.
    #[error("-u: cannot create a userfaultfd ({source}); /proc/sys/vm/unprivileged_userfaultfd is {knob} (1 lets unprivileged processes use it; root always can)")]
    Unavailable {
        /// The syscall's error.
        source: io::Error,
        /// The sysctl's value.
        knob: String,
    },
    /// The kernel lacks a feature this backing needs.
    #[error("-u {mode}: this kernel's userfaultfd lacks {feature} for -s {backing}")]
    MissingFeature {
        /// MISSING or MINOR.
        mode: &'static str,
        /// The feature.
        feature: &'static str,
        /// The backing.
        backing: &'static str,
    },
}

/// What one handler thread did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HandlerStats {
    /// Faults it resolved with a copy or continue.
    pub pages: u64,
    /// Faults on pages another thread had already served (`EEXIST`: woken instead).
    pub eexist: u64,
    /// Faults it could not serve (the copy or continue failed): the page was unregistered so
    /// the access completes without the handler, and the page-content check then fails.
    pub failed: u64,
    /// Time from the first fault it took to the last one it served.
    pub busy: Duration,
}

/// What the server did, from start to [`UffdServer::stop`].
#[derive(Debug, Clone, PartialEq)]
pub struct UffdReport {
    /// The mode.
    pub mode: UffdMode,
    /// userfaultfds (one per vCPU region, or one).
    pub uffds: usize,
    /// Handler (reader) threads per userfaultfd.
    pub readers: usize,
    /// Bytes each fault pages in (the backing's page size).
    pub page_size: u64,
    /// Delay before serving each fault.
    pub delay: Duration,
    /// Each handler thread's figures, userfaultfd by userfaultfd.
    pub handlers: Vec<HandlerStats>,
}

impl UffdReport {
    /// Faults served over every handler.
    pub fn pages(&self) -> u64 {
        self.handlers.iter().map(|h| h.pages).sum()
    }
    /// Faults found already served.
    pub fn eexist(&self) -> u64 {
        self.handlers.iter().map(|h| h.eexist).sum()
    }
    /// Faults the handlers could not serve.
    pub fn failed(&self) -> u64 {
        self.handlers.iter().map(|h| h.failed).sum()
    }
}

/// Handler threads serving faults on a [`GuestRam`] they borrow.
pub struct UffdServer<'a> {
    mode: UffdMode,
    uffds: usize,
    readers: usize,
    page_size: u64,
    delay: Duration,
    stop: Option<OwnedFd>,
    threads: Vec<JoinHandle<HandlerStats>>,
    _ram: PhantomData<&'a GuestRam>,
}

/// Handler thread's view: its userfaultfd, the stop eventfd, the source page.
struct Handler {
    uffd: Arc<OwnedFd>,
    stop: RawFd,
    mode: UffdMode,
    page_size: u64,
    delay: Duration,
    src: Arc<Vec<u8>>,
}

/// Refuses a region that is empty, not page-aligned, or not inside guest RAM of `ram_len`
/// bytes.
fn check_regions(regions: &[(u64, u64)], psize: u64, ram_len: u64) -> io::Result<()> {
    for &(off, len) in regions {
        let end = off.checked_add(len);
        if len == 0 || off % psize != 0 || len % psize != 0 || end.is_none_or(|e| e > ram_len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "userfaultfd region {off:#x}+{len:#x} is not page-aligned inside guest RAM"
                ),
            ));
        }
    }
    Ok(())
}

/// The eventfd that tells the handler threads to stop.
fn stop_eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes two integers and returns a new fd or -1.
    let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if stop < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `stop` is a new descriptor owned by nobody else.
    let stop = unsafe { OwnedFd::from_raw_fd(stop) };
    Ok(stop)
}

impl<'a> UffdServer<'a> {
    /// Registers `ram` (whole, or as `regions` — `(offset, len)` pairs within it, each a
    /// multiple of the backing's page size) with one userfaultfd each and starts `readers`
    /// handler threads per userfaultfd. With [`UffdMode::Minor`], first fills every page with
    /// [`UFFD_PATTERN`] and drops the mapping's page tables, so each first touch is a minor
    /// fault on a page-cache page.
    ///
    /// # Safety
    ///
    /// Nothing else may access `ram` while this runs (MINOR writes into it); and no page of
    /// it may have been touched yet for MISSING to see every first touch (not a safety
    /// matter: such pages are simply never faulted).
    pub unsafe fn start(
        ram: &'a GuestRam,
        regions: &[(u64, u64)],
        mode: UffdMode,
        readers: usize,
        delay: Duration,
    ) -> io::Result<UffdServer<'a>> {
        let features = mode.features(ram.backing()).map_err(io::Error::other)?;
        let psize = ram.page_size();
        let whole = [(0, ram.len())];
        let regions = if regions.is_empty() {
            &whole[..]
        } else {
            regions
        };
        check_regions(regions, psize, ram.len())?;
        if mode == UffdMode::Minor {
            prepare_minor(ram)?;
        }
        let plen = usize::try_from(psize).map_err(io::Error::other)?;
        let src = Arc::new(vec![UFFD_PATTERN; plen]);
        let stop = stop_eventfd()?;
        let mut server = UffdServer {
            mode,
            uffds: regions.len(),
            readers: readers.max(1),
            page_size: psize,
            delay,
            stop: Some(stop),
            threads: Vec::new(),
            _ram: PhantomData,
        };
        for (i, &(off, len)) in regions.iter().enumerate() {
            let (fd, _) = open_uffd(features)?;
            let mut reg = UffdioRegister {
                range: UffdioRange {
                    start: ram.addr() + off,
                    len,
                },
                mode: match mode {
                    UffdMode::Missing => UFFDIO_REGISTER_MODE_MISSING,
                    UffdMode::Minor => UFFDIO_REGISTER_MODE_MINOR,
                },
                ioctls: 0,
            };
            // SAFETY: UFFDIO_REGISTER reads and writes one `struct uffdio_register` (`reg`,
            // `#[repr(C)]`); the range lies inside `ram`'s mapping (checked above), which
            // outlives the server.
            if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER as _, &mut reg) } != 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = Arc::new(fd);
            for r in 0..server.readers {
                let h = Handler {
                    uffd: fd.clone(),
                    stop: server.stop.as_ref().map_or(-1, |s| s.as_raw_fd()),
                    mode,
                    page_size: psize,
                    delay,
                    src: src.clone(),
                };
                let t = std::thread::Builder::new()
                    .name(format!("uffd{i}.{r}"))
                    .spawn(move || h.run())?;
                server.threads.push(t);
            }
        }
        Ok(server)
    }

    /// Stops and joins every handler thread and closes the userfaultfds (ending the
    /// registration); returns what they did.
    pub fn stop(mut self) -> UffdReport {
        let handlers = self.shutdown();
        UffdReport {
            mode: self.mode,
            uffds: self.uffds,
            readers: self.readers,
            page_size: self.page_size,
            delay: self.delay,
            handlers,
        }
    }

    fn shutdown(&mut self) -> Vec<HandlerStats> {
        if let Some(stop) = &self.stop {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from `one` to the eventfd, as eventfd(2) requires.
            unsafe { libc::write(stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        let stats = self
            .threads
            .drain(..)
            .map(|t| t.join().unwrap_or_default())
            .collect();
        // The threads are gone: the stop fd can close now.
        self.stop = None;
        stats
    }
}

impl Drop for UffdServer<'_> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Handler {
    fn run(self) -> HandlerStats {
        let mut st = HandlerStats::default();
        let mut first: Option<Instant> = None;
        let mut last = Instant::now();
        let mut buf = [0u8; MSG_SIZE * 16];
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.stop,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: `fds` is an array of two pollfd structs that lives across the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if rc < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                break;
            }
            if fds[1].revents != 0 {
                break;
            }
            if fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                break;
            }
            // SAFETY: reads at most `buf.len()` bytes into `buf`.
            let n =
                unsafe { libc::read(self.uffd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                // EAGAIN: another reader took the message.
                continue;
            }
            for msg in buf[..n as usize].chunks_exact(MSG_SIZE) {
                if msg[0] != UFFD_EVENT_PAGEFAULT {
                    continue;
                }
                let mut a = [0u8; 8];
                a.copy_from_slice(&msg[16..24]);
                let addr = u64::from_ne_bytes(a) & !(self.page_size - 1);
                first.get_or_insert_with(Instant::now);
                if !self.delay.is_zero() {
                    std::thread::sleep(self.delay);
                }
                match self.serve(addr) {
                    Ok(true) => st.pages += 1,
                    Ok(false) => st.eexist += 1,
                    Err(_) => {
                        // A failure that persists would make the faulting thread fault again
                        // forever: take the page out of userfaultfd's hands (its access then
                        // completes as an ordinary fault), count it, and let the page check
                        // report it.
                        st.failed += 1;
                        self.unregister(addr);
                        self.wake(addr);
                    }
                }
                last = Instant::now();
            }
        }
        if let Some(f) = first {
            st.busy = last.saturating_duration_since(f);
        }
        st
    }

    /// Resolves the fault at `addr`: `Ok(true)` served, `Ok(false)` already present (woken).
    fn serve(&self, addr: u64) -> io::Result<bool> {
        loop {
            let rc = match self.mode {
                UffdMode::Missing => {
                    let mut c = UffdioCopy {
                        dst: addr,
                        src: self.src.as_ptr() as u64,
                        len: self.page_size,
                        mode: 0,
                        copy: 0,
                    };
                    // SAFETY: UFFDIO_COPY reads `page_size` bytes from `src` (a live buffer of
                    // exactly that many bytes) and writes into the registered range, which the
                    // kernel validates; `c` is the `#[repr(C)]` struct it reads and writes.
                    unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_COPY as _, &mut c) }
                }
                UffdMode::Minor => {
                    let mut c = UffdioContinue {
                        range: UffdioRange {
                            start: addr,
                            len: self.page_size,
                        },
                        mode: 0,
                        mapped: 0,
                    };
                    // SAFETY: UFFDIO_CONTINUE reads and writes one `struct uffdio_continue`
                    // (`c`); the kernel validates the range against the registration.
                    unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_CONTINUE as _, &mut c) }
                }
            };
            if rc == 0 {
                return Ok(true);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EEXIST) => {
                    self.wake(addr);
                    return Ok(false);
                }
                Some(libc::EAGAIN) | Some(libc::EINTR) => continue,
                _ => return Err(e),
            }
        }
    }

    fn unregister(&self, addr: u64) {
        let mut r = UffdioRange {
            start: addr,
            len: self.page_size,
        };
        // SAFETY: UFFDIO_UNREGISTER reads one `struct uffdio_range` (`r`); the kernel checks
        // the range against this userfaultfd's registrations.
        unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_UNREGISTER as _, &mut r) };
    }

    fn wake(&self, addr: u64) {
        let mut r = UffdioRange {
            start: addr,
            len: self.page_size,
        };
        // SAFETY: UFFDIO_WAKE reads one `struct uffdio_range` (`r`).
        unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_WAKE as _, &mut r) };
    }
}

/// MINOR's set-up: every page of `ram` in the page cache holding [`UFFD_PATTERN`], with no
/// page-table entries in this mapping (so the first touch is a minor fault).
///
/// # Safety
///
/// Nothing else accesses `ram` meanwhile.
unsafe fn prepare_minor(ram: &GuestRam) -> io::Result<()> {
    let len = usize::try_from(ram.len()).map_err(io::Error::other)?;
    // SAFETY: `ram` maps `len` writable bytes, and the caller guarantees no one else accesses
    // them while this runs.
    unsafe { std::ptr::write_bytes(ram.as_ptr(), UFFD_PATTERN, len) };
    // SAFETY: drops this process's page-table entries for a shared mapping it owns; the
    // shared memory's pages stay in the page cache, and later accesses fault them back in.
    if unsafe { libc::madvise(ram.as_ptr().cast(), len, libc::MADV_DONTNEED) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Counts the 4 KiB pages of `ram[..len]` that do not hold what a served page should after
/// a memstress pass: [`UFFD_PATTERN`] everywhere except the first 8 bytes, which hold either
/// the pattern or `written` (the guest's write). Returns (pages checked, bad pages).
pub fn verify_served(ram: &GuestRam, len: u64, written: u64) -> (u64, u64) {
    let len = len.min(ram.len());
    let pat = u64::from_ne_bytes([UFFD_PATTERN; 8]);
    let pages = len / 4096;
    let mut bad = 0;
    for p in 0..pages {
        let base = ram.addr() + p * 4096;
        let word = |i: u64| {
            // SAFETY: `base + 8 * i` with i < 512 lies inside page `p` < len / 4096 of `ram`,
            // which `ram` keeps mapped; it is 8-byte aligned, and read atomically because
            // vCPU threads may still write guest memory.
            unsafe { AtomicU64::from_ptr((base + 8 * i) as *mut u64) }.load(Ordering::Relaxed)
        };
        let w0 = word(0);
        if (w0 != pat && w0 != written) || (1..512).any(|i| word(i) != pat) {
            bad += 1;
        }
    }
    (pages, bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU8;

    fn touch_all(ram: &GuestRam, threads: usize) {
        let pages = ram.len() / 4096;
        std::thread::scope(|s| {
            for t in 0..threads as u64 {
                s.spawn(move || {
                    let mut p = t;
                    while p < pages {
                        // SAFETY: inside the mapping; atomic because threads share it.
                        let v =
                            unsafe { AtomicU8::from_ptr((ram.addr() + p * 4096 + 100) as *mut u8) }
                                .load(Ordering::Relaxed);
                        assert_eq!(v, UFFD_PATTERN);
                        p += threads as u64;
                    }
                });
            }
        });
    }

    #[test]
    fn missing_serves_every_page() {
        check_support(UffdMode::Missing, Backing::Anonymous).expect("userfaultfd");
        let ram = GuestRam::new(Backing::Anonymous, 4 << 20, false).unwrap();
        // SAFETY: nothing else touches `ram`.
        let s = unsafe {
            UffdServer::start(
                &ram,
                &[(0, 2 << 20), (2 << 20, 2 << 20)],
                UffdMode::Missing,
                2,
                Duration::ZERO,
            )
        }
        .unwrap();
        touch_all(&ram, 3);
        let r = s.stop();
        assert_eq!(r.pages(), 1024);
        assert_eq!(r.handlers.len(), 4);
        assert_eq!(verify_served(&ram, ram.len(), 0), (1024, 0));
    }

    #[test]
    fn minor_serves_every_page() {
        if check_support(UffdMode::Minor, Backing::Shmem).is_err() {
            eprintln!("no UFFD_FEATURE_MINOR_SHMEM: skipped");
            return;
        }
        let ram = GuestRam::new(Backing::Shmem, 2 << 20, false).unwrap();
        // SAFETY: nothing else touches `ram`.
        let s =
            unsafe { UffdServer::start(&ram, &[], UffdMode::Minor, 1, Duration::from_micros(10)) }
                .unwrap();
        touch_all(&ram, 2);
        let r = s.stop();
        assert_eq!(r.pages(), 512);
        assert_eq!(verify_served(&ram, ram.len(), 0), (512, 0));
    }

    #[test]
    fn minor_needs_shared_memory() {
        let e = check_support(UffdMode::Minor, Backing::Anonymous)
            .unwrap_err()
            .to_string();
        assert!(e.contains("-s shmem"), "{e}");
    }
}
