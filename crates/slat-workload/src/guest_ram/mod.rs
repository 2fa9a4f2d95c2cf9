//! Guest RAM: one contiguous, page-aligned host mapping of a [`Backing`], unmapped on drop.
//! Both machines map their test region with it (the simulated machine hands it to the engine
//! as a memslot's host memory, the KVM machine registers it as a memslot).
//!
//! Hugetlb backings check the free pool first and name the `nr_hugepages` file to write; THP
//! over-maps and trims to a 2 MiB-aligned start; `prefault` populates every host page so
//! guest accesses take no host page faults.

use crate::backing::{Backing, BACKING_NAMES, SMALL_PAGE};
use crate::size::{format_size, KIB};
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::{self, NonNull};

mod hugepool;
pub mod phantom;
use hugepool::{check_hugetlb, HugePool};

/// Errors from choosing a backing or mapping guest RAM.
#[derive(Debug, thiserror::Error)]
pub enum RamError {
    /// The backing source name is not one of [`Backing::ALL`]'s names.
    #[error("unknown backing source `{0}` (expected one of: {names})", names = BACKING_NAMES)]
    UnknownBacking(String),

    /// A zero-byte guest RAM was requested.
    #[error("guest RAM size must be greater than zero")]
    ZeroSize,

    /// The size is not a multiple of the backing's page size.
    #[error(
        "guest RAM size {} ({size} bytes) is not a multiple of the {} page size of backing source {backing}",
        format_size(*.size),
        format_size(*.page_size)
    )]
    Misaligned {
        /// Requested size in bytes.
        size: u64,
        /// The backing's page size in bytes.
        page_size: u64,
        /// The backing's selftest name.
        backing: &'static str,
    },

    /// Not enough hugetlb pages of the required size are reserved and free.
    ///
    /// The message is a single line telling the user how to reserve them.
    #[error("{}", hugetlb_message(.backing, *.needed, *.free, .sysfs))]
    HugetlbNotReserved {
        /// The backing's selftest name.
        backing: &'static str,
        /// Number of huge pages the mapping needs.
        needed: u64,
        /// Number of huge pages that were free (and not reserved by others).
        free: u64,
        /// The file to write to reserve pages of this size (ends in
        /// `nr_hugepages`). If the host has no huge pages of this size, it is
        /// instead the sysfs directory that does not exist.
        sysfs: String,
    },

    /// `mmap` (or the `memfd` setup preceding it) failed.
    #[error("failed to map {} of {backing} guest RAM: {source}", format_size(*.size))]
    Mmap {
        /// Requested size in bytes.
        size: u64,
        /// The backing's selftest name.
        backing: &'static str,
        /// The OS error.
        source: io::Error,
    },

    /// `madvise(MADV_HUGEPAGE)` failed.
    #[error("madvise(MADV_HUGEPAGE) on guest RAM failed: {source}")]
    Madvise {
        /// The OS error.
        source: io::Error,
    },
}

/// Builds the one-line [`RamError::HugetlbNotReserved`] message.
fn hugetlb_message(backing: &str, needed: u64, free: u64, sysfs: &str) -> String {
    let page = Backing::parse(backing)
        .map(|b| format_size(b.page_size()))
        .unwrap_or_else(|_| "huge".to_owned());
    if sysfs.ends_with("nr_hugepages") {
        let missing = needed.saturating_sub(free);
        format!(
            "{backing} needs {needed} free {page} huge pages but {free} are free; \
             reserve them with: echo {needed} > {sysfs} \
             (or raise its current value by {missing} if other {page} huge pages are in use)"
        )
    } else {
        format!(
            "{backing} needs {needed} {page} huge pages but this host has no {page} huge page size \
             ({sysfs} does not exist, so there is no nr_hugepages to reserve them with); \
             choose another backing source"
        )
    }
}

/// A contiguous, page-aligned host mapping used as guest RAM. Unmapped on drop.
#[derive(Debug)]
pub struct GuestRam {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// A phantom backing's pool of data frames ([`phantom`]); `ptr..ptr+len` is then an
    /// inaccessible reservation.
    pool: Option<NonNull<u8>>,
}

// SAFETY: `GuestRam` exclusively owns its mapping; the pointer is never
// aliased by another owner and is only unmapped in `Drop`, which runs once on
// whichever thread owns the value. Moving that ownership between threads is
// therefore sound.
unsafe impl Send for GuestRam {}

// SAFETY: all `&self` methods only read the immutable `ptr`/`len`/`backing`
// fields (or read /proc); no method mutates the mapping through `&self`.
// Any access to guest memory through `as_ptr()` happens in the caller's own
// `unsafe` code, which is responsible for synchronising it.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// Map `size` bytes of guest RAM with the given backing.
    ///
    /// The start address is aligned to the backing's page size. For THP the
    /// region is over-mapped by 2 MiB and trimmed so the kernel can use
    /// 2 MiB pages, then advised with `MADV_HUGEPAGE`. Hugetlb backings use
    /// `MAP_HUGETLB` with `MAP_HUGE_2MB`/`MAP_HUGE_1GB` after checking the
    /// free page count in `/sys/kernel/mm/hugepages`. Shmem uses a shared
    /// `memfd` mapping.
    ///
    /// With `prefault`, every host page is populated (`MAP_POPULATE` for
    /// anonymous and hugetlb, a zero write per 4 KiB page for THP and shmem)
    /// so later guest accesses do not take host page faults.
    ///
    /// # Errors
    ///
    /// [`RamError::ZeroSize`], [`RamError::Misaligned`] (size not a multiple
    /// of [`Backing::page_size`]), [`RamError::HugetlbNotReserved`],
    /// [`RamError::Mmap`] or [`RamError::Madvise`].
    pub fn new(backing: Backing, size: u64, prefault: bool) -> Result<GuestRam, RamError> {
        if size == 0 {
            return Err(RamError::ZeroSize);
        }
        let page_size = backing.page_size();
        // Page sizes are powers of two.
        if size & (page_size - 1) != 0 {
            return Err(RamError::Misaligned {
                size,
                page_size,
                backing: backing.name(),
            });
        }
        let mmap_err = |source: io::Error| RamError::Mmap {
            size,
            backing: backing.name(),
            source,
        };
        let len = usize::try_from(size).map_err(|_| {
            mmap_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "size exceeds the host address space",
            ))
        })?;
        let populate = if prefault { libc::MAP_POPULATE } else { 0 };
        let private_anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;

        match backing {
            Backing::Anonymous => {
                let ptr = mmap_rw(len, private_anon | populate, -1).map_err(mmap_err)?;
                Ok(GuestRam {
                    ptr,
                    len,
                    backing,
                    pool: None,
                })
            }
            Backing::AnonymousThp => Self::new_thp(len, page_size, prefault, &mmap_err),
            Backing::AnonymousHugetlb2M | Backing::AnonymousHugetlb1G => {
                Self::new_hugetlb(backing, size, len, populate, &mmap_err)
            }
            Backing::Phantom | Backing::PhantomThp | Backing::PhantomHugetlb1G => {
                Self::new_phantom(backing, len, &mmap_err)
            }
            Backing::Shmem => {
                let ptr = mmap_shmem(size, len).map_err(mmap_err)?;
                let ram = GuestRam {
                    ptr,
                    len,
                    backing,
                    pool: None,
                };
                if prefault {
                    ram.touch_pages(SMALL_PAGE as usize);
                }
                Ok(ram)
            }
        }
    }

    /// [`Backing::AnonymousThp`]: an aligned anonymous mapping advised for huge pages.
    fn new_thp(
        len: usize,
        page_size: u64,
        prefault: bool,
        mmap_err: &dyn Fn(io::Error) -> RamError,
    ) -> Result<GuestRam, RamError> {
        let backing = Backing::AnonymousThp;
        let align = usize::try_from(page_size).map_err(|_| {
            mmap_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "page size exceeds the host address space",
            ))
        })?;
        let ptr = mmap_aligned(len, align).map_err(mmap_err)?;
        // From here on, dropping `ram` unmaps the region on error.
        let ram = GuestRam {
            ptr,
            len,
            backing,
            pool: None,
        };
        // SAFETY: `ptr..ptr+len` is a mapping we own; MADV_HUGEPAGE
        // only changes the kernel's page-size policy for it and does
        // not alter its contents or validity.
        let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            return Err(RamError::Madvise {
                source: io::Error::last_os_error(),
            });
        }
        if prefault {
            ram.touch_pages(SMALL_PAGE as usize);
        }
        Ok(ram)
    }

    /// The hugetlb backings: refused with the pool's state when it has too few pages.
    fn new_hugetlb(
        backing: Backing,
        size: u64,
        len: usize,
        populate: i32,
        mmap_err: &dyn Fn(io::Error) -> RamError,
    ) -> Result<GuestRam, RamError> {
        let page_size = backing.page_size();
        let private_anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let needed = size / page_size;
        check_hugetlb(backing, needed)?;
        let flags =
            private_anon | libc::MAP_HUGETLB | backing.hugetlb_flag().unwrap_or(0) | populate;
        match mmap_rw(len, flags, -1) {
            Ok(ptr) => Ok(GuestRam {
                ptr,
                len,
                backing,
                pool: None,
            }),
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                let pool = HugePool::probe(backing);
                Err(RamError::HugetlbNotReserved {
                    backing: backing.name(),
                    needed,
                    free: pool.available.unwrap_or(0),
                    sysfs: pool.hint,
                })
            }
            Err(e) => Err(mmap_err(e)),
        }
    }

    /// Start of the mapping as a raw pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Start of the mapping as an integer host address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the mapping is empty (never true for a successfully created one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backing this mapping was created with.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// The backing's host page size ([`Backing::page_size`]).
    pub fn page_size(&self) -> u64 {
        self.backing.page_size()
    }

    /// Bytes of this mapping backed by transparent huge pages.
    ///
    /// For [`Backing::AnonymousThp`], sums the `AnonHugePages` lines of
    /// `/proc/self/smaps` over the VMAs overlapping this mapping (a VMA the
    /// kernel merged with a neighbouring THP region is counted whole).
    /// Returns `None` for other backings or if smaps is unavailable.
    pub fn thp_bytes(&self) -> Option<u64> {
        if self.backing != Backing::AnonymousThp {
            return None;
        }
        let smaps = fs::read_to_string("/proc/self/smaps").ok()?;
        let start = self.addr();
        anon_huge_bytes(&smaps, start, start.saturating_add(self.len()))
    }

    /// Writes a zero byte every `stride` bytes so each page is faulted in.
    fn touch_pages(&self, stride: usize) {
        let mut off = 0;
        while off < self.len {
            // SAFETY: `off < self.len`, so the byte lies inside our
            // read/write mapping. The mapping is freshly created and not yet
            // shared, so nothing else accesses it; it is zero-filled, so
            // writing zero does not change its contents.
            unsafe { self.ptr.as_ptr().add(off).write_volatile(0) };
            off += stride;
        }
    }
}

// SAFETY: the mapping is read/write, page aligned (its address and length are multiples of
// the backing's page size, at least 4 KiB) and stays mapped at a fixed address until `Drop`;
// `GuestRam` hands out only its address, never references to its bytes. A phantom backing's
// range is a reservation that stays reserved (nothing else can be mapped there) until `Drop`,
// and its pool, named by `phantom_pool`, is read/write and lives as long.
#[cfg(feature = "engine")]
unsafe impl slat::HostMemory for GuestRam {
    fn host_addr(&self) -> slat_addr::Hva {
        slat_addr::Hva::new(self.addr())
    }
    fn len(&self) -> u64 {
        self.len as u64
    }
    fn page_size(&self) -> u64 {
        self.backing.page_size()
    }
    fn phantom_pool(&self) -> Option<slat_addr::Hva> {
        GuestRam::phantom_pool(self).map(slat_addr::Hva::new)
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping created in `new` and
        // owned by `self`, as is the pool; no references into them can outlive `self`.
        // Failure would only leak the mapping, so the result is ignored.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
            if let Some(pool) = self.pool {
                libc::munmap(pool.as_ptr().cast(), phantom::POOL_BYTES);
            }
        }
    }
}

/// `mmap(NULL, len, PROT_READ | PROT_WRITE, flags, fd, 0)`.
fn mmap_rw(len: usize, flags: libc::c_int, fd: libc::c_int) -> io::Result<NonNull<u8>> {
    // SAFETY: a null address hint lets the kernel pick an unused range, so no
    // existing memory is replaced; the result is checked before use.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned a null mapping"))
}

/// `munmap` of a range we own; returns the OS error on failure.
fn munmap_range(p: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: callers pass only (sub)ranges of mappings created by `mmap_rw`
    // that no one else references.
    let rc = unsafe { libc::munmap(p.cast(), len) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Maps `len` private anonymous bytes starting at an `align`-aligned address
/// by over-mapping `align` extra bytes and unmapping the slack on both sides.
fn mmap_aligned(len: usize, align: usize) -> io::Result<NonNull<u8>> {
    let map_len = len
        .checked_add(align)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "size too large to align"))?;
    let raw = mmap_rw(map_len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)?;
    let start = raw.as_ptr() as usize;
    // `align` is a power of two and `map_len` leaves room for the round-up.
    let head = start.wrapping_neg() & (align - 1);
    let tail = map_len - head - len;
    let aligned = raw.as_ptr().wrapping_add(head);
    let trim = || -> io::Result<()> {
        if head > 0 {
            munmap_range(raw.as_ptr(), head)?;
        }
        if tail > 0 {
            munmap_range(aligned.wrapping_add(len), tail)?;
        }
        Ok(())
    };
    if let Err(e) = trim() {
        // Unmapping the whole original range also covers already-trimmed parts.
        let _ = munmap_range(raw.as_ptr(), map_len);
        return Err(e);
    }
    NonNull::new(aligned).ok_or_else(|| io::Error::other("aligned mapping is null"))
}

/// Maps `len` bytes of shared memory backed by a memfd (falling back to
/// `MAP_SHARED | MAP_ANONYMOUS` if memfds are unsupported).
fn mmap_shmem(size: u64, len: usize) -> io::Result<NonNull<u8>> {
    // SAFETY: the name is a valid NUL-terminated C string literal.
    let fd = unsafe { libc::memfd_create(c"slat-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOSYS) {
            return mmap_rw(len, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1);
        }
        return Err(err);
    }
    // SAFETY: `fd` was just returned by memfd_create, is valid and owned by
    // nobody else, so `OwnedFd` may take ownership (and close it on drop).
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let off = libc::off_t::try_from(size)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size exceeds off_t"))?;
    // SAFETY: `fd` is a valid memfd we own; ftruncate only sets its size.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), off) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // The mapping keeps the memfd's memory alive after `fd` is closed.
    mmap_rw(len, libc::MAP_SHARED, fd.as_raw_fd())
}

/// Parses a `/proc/<pid>/smaps` text and sums `AnonHugePages` (in bytes) over
/// the VMAs overlapping `[start, end)`. `None` if no such VMA reports it.
fn anon_huge_bytes(smaps: &str, start: u64, end: u64) -> Option<u64> {
    let mut in_range = false;
    let mut total: Option<u64> = None;
    for line in smaps.lines() {
        if let Some((lo, hi)) = vma_header_range(line) {
            in_range = lo < end && start < hi;
            continue;
        }
        if !in_range {
            continue;
        }
        if let Some(rest) = line.strip_prefix("AnonHugePages:") {
            let kb: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            total = Some(total.unwrap_or(0).saturating_add(kb.saturating_mul(KIB)));
        }
    }
    total
}

/// If `line` is an smaps VMA header (`lo-hi perms ...`), its address range.
fn vma_header_range(line: &str) -> Option<(u64, u64)> {
    let first = line.split_whitespace().next()?;
    let (lo, hi) = first.split_once('-')?;
    let lo = u64::from_str_radix(lo, 16).ok()?;
    let hi = u64::from_str_radix(hi, 16).ok()?;
    Some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::hugepool::HUGEPAGES_SYSFS;
    use super::*;
    use crate::size::{GIB, MIB};
    use std::path::Path;

    /// Writes a distinct value to the first and last byte of every 4 KiB page,
    /// then reads them all back.
    fn write_read_every_page(ram: &GuestRam) {
        let len = usize::try_from(ram.len()).expect("fits usize");
        let base = ram.as_ptr();
        let pages = len / SMALL_PAGE as usize;
        for i in 0..pages {
            let off = i * SMALL_PAGE as usize;
            // SAFETY: both offsets are < len, inside the mapping, which this
            // test owns exclusively.
            unsafe {
                base.add(off).write_volatile(i as u8 ^ 0x5a);
                base.add(off + SMALL_PAGE as usize - 1)
                    .write_volatile(i as u8);
            }
        }
        for i in 0..pages {
            let off = i * SMALL_PAGE as usize;
            // SAFETY: as above.
            let (a, b) = unsafe {
                (
                    base.add(off).read_volatile(),
                    base.add(off + SMALL_PAGE as usize - 1).read_volatile(),
                )
            };
            assert_eq!((a, b), (i as u8 ^ 0x5a, i as u8), "page {i}");
        }
    }

    fn assert_zeroed(ram: &GuestRam) {
        let len = usize::try_from(ram.len()).expect("fits usize");
        // SAFETY: the mapping is `len` readable bytes owned by this test and
        // not written concurrently.
        let bytes = unsafe { std::slice::from_raw_parts(ram.as_ptr(), len) };
        assert!(bytes.iter().all(|&b| b == 0), "fresh guest RAM not zeroed");
    }

    #[test]
    fn anonymous_map_with_and_without_prefault() {
        for prefault in [false, true] {
            let ram = GuestRam::new(Backing::Anonymous, 8 * MIB, prefault).expect("map 8 MiB");
            assert_eq!(ram.len(), 8 * MIB);
            assert!(!ram.is_empty());
            assert_eq!(ram.backing(), Backing::Anonymous);
            assert_eq!(ram.page_size(), 4096);
            assert_eq!(ram.addr() % 4096, 0);
            assert_eq!(ram.addr(), ram.as_ptr() as u64);
            assert_eq!(ram.thp_bytes(), None);
            assert_zeroed(&ram);
            write_read_every_page(&ram);
        }
    }

    #[test]
    fn shmem_map() {
        for prefault in [false, true] {
            let ram = GuestRam::new(Backing::Shmem, 8 * MIB, prefault).expect("map shmem");
            assert_eq!(ram.len(), 8 * MIB);
            assert_eq!(ram.addr() % 4096, 0);
            assert_eq!(ram.backing(), Backing::Shmem);
            assert_zeroed(&ram);
            write_read_every_page(&ram);
            assert_eq!(ram.thp_bytes(), None);
        }
    }

    #[test]
    fn shmem_mapping_is_shared() {
        let ram = GuestRam::new(Backing::Shmem, 2 * MIB, false).expect("map shmem");
        let maps = fs::read_to_string("/proc/self/maps").expect("read maps");
        let start = format!("{:x}-", ram.addr());
        let line = maps
            .lines()
            .find(|l| l.starts_with(&start))
            .expect("mapping listed in /proc/self/maps");
        let perms = line.split_whitespace().nth(1).expect("perms column");
        assert_eq!(perms, "rw-s", "{line}");
    }

    #[test]
    fn thp_mapping_is_aligned() {
        for prefault in [false, true] {
            let ram = GuestRam::new(Backing::AnonymousThp, 8 * MIB, prefault).expect("map THP");
            assert_eq!(ram.addr() % (2 * MIB), 0, "addr {:#x}", ram.addr());
            assert_eq!(ram.len(), 8 * MIB);
            assert_eq!(ram.page_size(), 2 * MIB);
            assert_zeroed(&ram);
            write_read_every_page(&ram);
            let thp = ram.thp_bytes();
            assert!(thp.is_some(), "smaps has no AnonHugePages for the mapping");
            eprintln!(
                "THP prefault={prefault}: {:?} of 8 MiB",
                thp.map(format_size)
            );
        }
    }

    #[test]
    fn thp_mapping_is_madvised() {
        let ram = GuestRam::new(Backing::AnonymousThp, 4 * MIB, false).expect("map THP");
        let smaps = fs::read_to_string("/proc/self/smaps").expect("read smaps");
        let mut in_vma = false;
        let mut flags = None;
        for line in smaps.lines() {
            if let Some((lo, hi)) = vma_header_range(line) {
                in_vma = lo <= ram.addr() && ram.addr() < hi;
            } else if in_vma {
                if let Some(f) = line.strip_prefix("VmFlags:") {
                    flags = Some(f.to_owned());
                }
            }
        }
        let flags = flags.expect("VmFlags for the mapping");
        assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
    }

    #[test]
    fn misaligned_sizes() {
        for (backing, size) in [
            (Backing::AnonymousThp, 3 * MIB),
            (Backing::AnonymousHugetlb2M, 3 * MIB),
            (Backing::AnonymousHugetlb1G, 2 * MIB),
            (Backing::Anonymous, 4097),
            (Backing::Shmem, 100),
        ] {
            match GuestRam::new(backing, size, false) {
                Err(RamError::Misaligned {
                    size: s,
                    page_size,
                    backing: name,
                }) => {
                    assert_eq!(s, size);
                    assert_eq!(page_size, backing.page_size());
                    assert_eq!(name, backing.name());
                }
                other => panic!("{backing} {size}: expected Misaligned, got {other:?}"),
            }
        }
        let msg = GuestRam::new(Backing::AnonymousHugetlb2M, 3 * MIB, false)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("anonymous_hugetlb"), "{msg}");
        assert!(msg.contains("2 MiB"), "{msg}");
    }

    #[test]
    fn zero_size() {
        for b in Backing::ALL {
            assert!(matches!(GuestRam::new(b, 0, true), Err(RamError::ZeroSize)));
        }
    }

    fn free_hugepages(kb: u64) -> Option<u64> {
        fs::read_to_string(format!("{HUGEPAGES_SYSFS}/hugepages-{kb}kB/free_hugepages"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    #[test]
    fn hugetlb_2m() {
        let free = free_hugepages(2048).unwrap_or(0);
        if free >= 1 {
            let ram = GuestRam::new(Backing::AnonymousHugetlb2M, 2 * MIB, true)
                .expect("free 2 MiB huge page available");
            assert_eq!(ram.addr() % (2 * MIB), 0);
            assert_eq!(ram.len(), 2 * MIB);
            write_read_every_page(&ram);
            return;
        }
        let err = GuestRam::new(Backing::AnonymousHugetlb2M, 2 * MIB, true)
            .expect_err("no free 2 MiB huge pages");
        match &err {
            RamError::HugetlbNotReserved {
                backing,
                needed,
                free,
                ..
            } => {
                assert_eq!(*backing, "anonymous_hugetlb");
                assert_eq!(*needed, 1);
                assert_eq!(*free, 0);
            }
            other => panic!("expected HugetlbNotReserved, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("nr_hugepages"), "{msg}");
        assert!(msg.contains("echo 1 > "), "{msg}");
        assert!(msg.contains("2 MiB"), "{msg}");
    }

    #[test]
    fn hugetlb_1g_not_reserved() {
        if free_hugepages(1_048_576).unwrap_or(0) > 0 {
            // Do not grab a real 1 GiB page in a unit test.
            return;
        }
        let err = GuestRam::new(Backing::AnonymousHugetlb1G, GIB, false)
            .expect_err("no free 1 GiB huge pages");
        assert!(
            matches!(
                err,
                RamError::HugetlbNotReserved {
                    needed: 1,
                    free: 0,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("1 GiB"), "{msg}");
        if Path::new("/sys/kernel/mm/hugepages/hugepages-1048576kB").is_dir() {
            assert!(
                msg.contains("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages"),
                "{msg}"
            );
        } else {
            assert!(msg.contains("does not exist"), "{msg}");
        }
    }

    #[test]
    fn hugetlb_messages() {
        let msg = hugetlb_message("anonymous_hugetlb", 512, 0, "/proc/sys/vm/nr_hugepages");
        assert!(
            msg.starts_with(
                "anonymous_hugetlb needs 512 free 2 MiB huge pages but 0 are free; \
                 reserve them with: echo 512 > /proc/sys/vm/nr_hugepages"
            ),
            "{msg}"
        );
        let msg = hugetlb_message(
            "anonymous_hugetlb_1gb",
            2,
            0,
            "/sys/kernel/mm/hugepages/hugepages-1048576kB",
        );
        assert!(msg.contains("no 1 GiB huge page size"), "{msg}");
        assert!(msg.contains("does not exist"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn smaps_parsing() {
        let smaps = "\
00400000-00600000 r-xp 00000000 08:01 123 /bin/x
Size:               2048 kB
AnonHugePages:      9999 kB
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      2048 kB
VmFlags: rd wr mr mw me ac hg
7f0000400000-7f0000800000 rw-p 00000000 00:00 0
AnonHugePages:      4096 kB
7f0000800000-7f0000a00000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
";
        let start = 0x7f00_0000_0000;
        assert_eq!(
            anon_huge_bytes(smaps, start, start + 8 * MIB),
            Some(6 * MIB)
        );
        assert_eq!(
            anon_huge_bytes(smaps, start, start + 4 * MIB),
            Some(2 * MIB)
        );
        assert_eq!(anon_huge_bytes(smaps, 0x1000, 0x2000), None);
        assert_eq!(vma_header_range("Size: 4 kB"), None);
    }
}
