//! Phantom guest RAM (`-s phantom`, `phantom_thp`, `phantom_hugetlb_1gb`): the whole size is
//! reserved `PROT_NONE | MAP_NORESERVE`, which gives real, stable host addresses for the
//! engine's leaves at no host memory, and guest data accesses go to a pool of
//! [`POOL_FRAMES`] real 4 KiB frames instead (the engine's `slat::phantom_addr`: `pool +
//! (hva / 4 KiB % POOL_FRAMES) * 4 KiB + hva % 4 KiB`). The data is not kept; everything the
//! MMU owns stays real. A stray access to the reservation itself raises SIGSEGV, so a run that
//! completes touched only the pool.

use super::{GuestRam, RamError};
use crate::backing::Backing;
use std::io;
use std::ptr::{self, NonNull};

/// Real 4 KiB frames behind every phantom mapping, whatever its size.
pub const POOL_FRAMES: u64 = 64;

// The engine redirects into a pool of its own idea of this size (`HostMemory::phantom_pool`).
#[cfg(feature = "engine")]
const _: () = assert!(POOL_FRAMES == slat::PHANTOM_POOL_FRAMES);

/// Where the data of `hva`, an address of a phantom mapping whose pool is at `pool`, lives
/// (the engine's `slat::phantom_addr`, for code that does not link the engine).
#[inline(always)]
pub fn data_addr(pool: u64, hva: u64) -> u64 {
    pool + (((hva >> 12) % POOL_FRAMES) << 12) + (hva & 0xfff)
}

/// Bytes of the pool.
pub(super) const POOL_BYTES: usize = (POOL_FRAMES * 4096) as usize;

/// Reserves `len` bytes of address space aligned to `align` (a power of two), inaccessible
/// and with no memory committed: over-reserves by `align` and trims both ends.
pub(super) fn reserve(len: usize, align: usize) -> io::Result<NonNull<u8>> {
    let map_len = len
        .checked_add(align)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "size too large to align"))?;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a null hint lets the kernel pick an unused range, so nothing is replaced; the
    // result is checked before use.
    let raw = unsafe { libc::mmap(ptr::null_mut(), map_len, libc::PROT_NONE, flags, -1, 0) };
    if raw == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let start = raw as usize;
    let head = start.wrapping_neg() & (align - 1);
    let tail = map_len - head - len;
    let raw = raw.cast::<u8>();
    let aligned = raw.wrapping_add(head);
    // SAFETY (both): sub-ranges of the reservation just made, which nothing else references.
    // A failed trim only leaves a little more address space reserved.
    unsafe {
        if head > 0 {
            libc::munmap(raw.cast(), head);
        }
        if tail > 0 {
            libc::munmap(aligned.wrapping_add(len).cast(), tail);
        }
    }
    NonNull::new(aligned).ok_or_else(|| io::Error::other("reservation is null"))
}

/// Maps the pool: [`POOL_FRAMES`] zeroed, populated, read/write frames.
pub(super) fn pool() -> io::Result<NonNull<u8>> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: as in `reserve`.
    let p = unsafe { libc::mmap(ptr::null_mut(), POOL_BYTES, prot, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("pool mapping is null"))
}

impl GuestRam {
    /// A phantom backing: the reservation, aligned to the twin's page size, and its pool.
    /// `prefault` does not apply: there is nothing to populate.
    pub(super) fn new_phantom(
        backing: Backing,
        len: usize,
        mmap_err: &dyn Fn(io::Error) -> RamError,
    ) -> Result<GuestRam, RamError> {
        let align = usize::try_from(backing.page_size()).map_err(|_| {
            mmap_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "page size exceeds the host address space",
            ))
        })?;
        let ptr = reserve(len, align).map_err(mmap_err)?;
        // From here on, dropping `ram` unmaps the reservation (and the pool, once set).
        let mut ram = GuestRam {
            ptr,
            len,
            backing,
            pool: None,
        };
        ram.pool = Some(pool().map_err(mmap_err)?);
        Ok(ram)
    }

    /// For a phantom backing, the address of the pool its data accesses go to
    /// (`slat::phantom_addr`); `None` for memory that keeps its data.
    pub fn phantom_pool(&self) -> Option<u64> {
        self.pool.map(|p| p.as_ptr() as usize as u64)
    }

    /// Whether guest data is not kept (a phantom backing).
    pub fn is_phantom(&self) -> bool {
        self.pool.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "engine")]
    #[test]
    fn data_addr_is_the_engines() {
        use slat_addr::Hva;
        let pool = 0x7f00_0000_0000;
        for hva in (0..200u64).map(|i| i * 0x1238 + (1 << 40)) {
            let engine = slat::phantom_addr(Hva::new(pool), Hva::new(hva)).raw();
            assert_eq!(data_addr(pool, hva), engine);
        }
    }

    #[test]
    fn a_terabyte_reserves_without_memory() {
        let len = 1usize << 40;
        let p = reserve(len, 1 << 30).expect("reserve 1 TiB of address space");
        assert_eq!(p.as_ptr() as usize % (1 << 30), 0);
        // SAFETY: the reservation just made, unmapped once.
        unsafe { libc::munmap(p.as_ptr().cast(), len) };
    }
}
