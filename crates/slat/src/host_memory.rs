//! Host memory that backs memslots, and the rule that keeps it alive.
//!
//! The engine writes host addresses into leaves, and both it (cache maintenance on stage-2)
//! and the hardware that walks the table (the simulated machine's vCPUs) then touch that
//! memory. So memory enters the engine only in a form that guarantees it stays mapped for as
//! long as anything can reach it:
//! - a [`HostRange`] over a [`HostMemory`] object (safe): the memslot holds an `Arc` of it,
//!   and every memslot set that lists the slot holds the memslot. A deleted or moved slot's
//!   leaves are zapped and flushed before the call that removed it returns, and that call
//!   holds the slot until then; a vCPU's memslot snapshot holds it until the vCPU sees a newer
//!   set. The memory is released only after the last of these.
//! - [`HostRange::from_raw`] (`unsafe`): the caller states the same lifetime contract for
//!   memory the engine cannot own (a VMM's own mappings).
//!
//! Guest memory is shared with guest vCPUs that write it at any time, so it is never exposed
//! as `&[u8]` or `&mut [u8]`: readers and writers use raw pointers or atomics.
//!
//! **Phantom memory** ([`HostMemory::phantom_pool`]) is a reservation with no memory behind
//! it, for guests larger than the host: its addresses are real and stable, so leaves and
//! tables are as usual, but its bytes are inaccessible. Whatever touches its data goes to
//! [`phantom_addr`] in a small pool instead, and cache maintenance skips it.

use slat_addr::{Hva, PAGE_SIZE};
use std::alloc::Layout;
use std::fmt;
use std::sync::Arc;

/// Real 4 KiB frames in a phantom memory's pool ([`HostMemory::phantom_pool`]).
pub const PHANTOM_POOL_FRAMES: u64 = 64;

/// Where the data of `hva`, an address of phantom memory whose pool is at `pool`, lives:
/// `pool + (hva / 4 KiB % PHANTOM_POOL_FRAMES) * 4 KiB + hva % 4 KiB`. The same offset
/// within a page, so an 8-byte-aligned access stays inside one pool frame.
#[inline(always)]
pub fn phantom_addr(pool: Hva, hva: Hva) -> Hva {
    let (pool, hva) = (pool.raw(), hva.raw());
    Hva::new(pool + (((hva >> 12) % PHANTOM_POOL_FRAMES) << 12) + (hva & 0xfff))
}

/// Host memory that can back memslots.
///
/// # Safety
///
/// An implementor guarantees, for as long as the value lives (it is held in an `Arc` and
/// never moved out of it by the engine):
/// - `[host_addr(), host_addr() + len())` is mapped readable and writable in this process,
///   and does not move; or, if [`Self::phantom_pool`] returns a pool, it is reserved (nothing
///   else is mapped there) and the pool's [`PHANTOM_POOL_FRAMES`] frames are mapped readable
///   and writable and do not move;
/// - it may be read and written at any time by other threads (guest vCPUs) through raw
///   pointers and atomics, so the implementor never hands out `&`/`&mut` references to its
///   bytes while it may back a memslot;
/// - `host_addr()` is a multiple of 4 KiB, `len()` is a multiple of 4 KiB, and both methods
///   return the same values on every call.
pub unsafe trait HostMemory: Send + Sync + 'static {
    /// Host virtual address of the first byte.
    fn host_addr(&self) -> Hva;
    /// Bytes mapped from [`Self::host_addr`].
    fn len(&self) -> u64;
    /// The page size the host maps this memory with (4 KiB, 2 MiB or 1 GiB): leaves are never
    /// larger. It is a promise about contiguity, not about safety: the engine only ever maps
    /// bytes inside the range.
    fn page_size(&self) -> u64 {
        PAGE_SIZE
    }
    /// True if the memory holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Phantom memory: the 4 KiB-aligned address of the pool its data lives in
    /// ([`phantom_addr`]), the range itself being inaccessible. `None` (the default) for
    /// memory that is mapped and keeps its data.
    fn phantom_pool(&self) -> Option<Hva> {
        None
    }
}

/// Why a [`HostRange`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostRangeError {
    /// The sub-range does not lie inside the memory.
    #[error("host range [{offset:#x}, +{len:#x}) is outside the {size:#x} bytes of its memory")]
    OutOfBounds {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Bytes the memory holds.
        size: u64,
    },
    /// Offset or length not a multiple of 4 KiB.
    #[error("host range offset {offset:#x} and length {len:#x} must be multiples of 4 KiB")]
    Misaligned {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
    },
    /// The memory object broke its contract (unaligned address or length).
    #[error("host memory at {addr:#x} (+{len:#x}) is not 4 KiB aligned")]
    BadMemory {
        /// Its address.
        addr: Hva,
        /// Its length.
        len: u64,
    },
}

/// Host memory backing one memslot: a part of a [`HostMemory`] object, kept alive by this
/// value, or a raw range whose lifetime the caller vouched for ([`Self::from_raw`]).
#[derive(Clone)]
pub struct HostRange {
    owner: Option<Arc<dyn HostMemory>>,
    addr: Hva,
    len: u64,
    page_size: u64,
    /// The pool of phantom memory ([`HostMemory::phantom_pool`]).
    phantom: Option<Hva>,
}

impl fmt::Debug for HostRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRange")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &format_args!("{:#x}", self.len))
            .field("page_size", &format_args!("{:#x}", self.page_size))
            .field("owned", &self.owner.is_some())
            .field("phantom", &self.phantom.is_some())
            .finish()
    }
}

impl HostRange {
    /// All of `mem`.
    pub fn new(mem: Arc<dyn HostMemory>) -> Result<Self, HostRangeError> {
        let len = mem.len();
        Self::slice(mem, 0, len)
    }

    /// `[offset, offset + len)` of `mem` (both multiples of 4 KiB).
    pub fn slice(mem: Arc<dyn HostMemory>, offset: u64, len: u64) -> Result<Self, HostRangeError> {
        let (base, size) = (mem.host_addr(), mem.len());
        if !base.is_aligned(PAGE_SIZE) || size % PAGE_SIZE != 0 || base.checked_add(size).is_none()
        {
            return Err(HostRangeError::BadMemory {
                addr: base,
                len: size,
            });
        }
        if offset % PAGE_SIZE != 0 || len % PAGE_SIZE != 0 {
            return Err(HostRangeError::Misaligned { offset, len });
        }
        match offset.checked_add(len) {
            Some(end) if end <= size => {}
            _ => return Err(HostRangeError::OutOfBounds { offset, len, size }),
        }
        let phantom = mem.phantom_pool();
        if phantom.is_some_and(|p| !p.is_aligned(PAGE_SIZE)) {
            return Err(HostRangeError::BadMemory {
                addr: base,
                len: size,
            });
        }
        Ok(HostRange {
            phantom,
            page_size: mem.page_size(),
            // In bounds: `base + size` does not overflow and `offset + len <= size`.
            addr: Hva::new(base.raw() + offset),
            len,
            owner: Some(mem),
        })
    }

    /// A raw host range the engine does not own: `len` bytes at `addr`, mapped by the host
    /// with `page_size` pages.
    ///
    /// # Safety
    ///
    /// From the moment a memslot is added over this range until the VM is dropped or the call
    /// that deletes (or moves, or replaces) that memslot has returned, `[addr, addr + len)`
    /// must stay mapped readable and writable in this process, and the caller must not hold
    /// `&`/`&mut` references to those bytes while vCPUs run: the engine (cache maintenance)
    /// and the vCPUs' hardware walker read and write them at any time. A range that is
    /// refused by `add_memslot` is never touched.
    pub unsafe fn from_raw(addr: Hva, len: u64, page_size: u64) -> Self {
        HostRange {
            owner: None,
            addr,
            len,
            page_size,
            phantom: None,
        }
    }

    /// `[offset, offset + len)` of this range (both multiples of 4 KiB), kept alive the same
    /// way (a raw range's sub-range carries the same caller guarantee).
    pub fn subrange(&self, offset: u64, len: u64) -> Result<Self, HostRangeError> {
        if offset % PAGE_SIZE != 0 || len % PAGE_SIZE != 0 {
            return Err(HostRangeError::Misaligned { offset, len });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(HostRangeError::OutOfBounds {
                    offset,
                    len,
                    size: self.len,
                })
            }
        }
        Ok(HostRange {
            owner: self.owner.clone(),
            // Inside this range, whose end the caller (or `slice`) vouched for.
            addr: Hva::new(self.addr.raw() + offset),
            len,
            page_size: self.page_size,
            phantom: self.phantom,
        })
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> Hva {
        self.addr
    }
    /// Bytes in the range.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// True if the range holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The page size the host maps the range with.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }
    /// The pool of phantom memory ([`HostMemory::phantom_pool`]): its bytes are not
    /// accessible, only [`phantom_addr`]s in the pool are.
    pub fn phantom_pool(&self) -> Option<Hva> {
        self.phantom
    }
    /// Whether the range is phantom memory.
    pub fn is_phantom(&self) -> bool {
        self.phantom.is_some()
    }
    /// The same range, declared as mapped with `page_size` pages (e.g. an allocation aligned
    /// to 2 MiB that the host backs with huge pages). Only leaf sizes depend on it.
    pub fn with_page_size(mut self, page_size: u64) -> Self {
        self.page_size = page_size;
        self
    }
}

/// Zeroed host memory from the global allocator, aligned to `align`, owned and freed on drop:
/// the simplest safe backing for memslots (tests, examples, small VMs).
pub struct HostBuffer {
    ptr: std::ptr::NonNull<u8>,
    layout: Layout,
    page_size: u64,
}

// SAFETY: HostBuffer uniquely owns its allocation and never hands out references to its bytes;
// concurrent access goes through raw pointers and atomics (the `HostMemory` contract).
unsafe impl Send for HostBuffer {}
// SAFETY: as above; `&HostBuffer` only exposes the address, the length and atomic accessors.
unsafe impl Sync for HostBuffer {}

/// Why a [`HostBuffer`] could not be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostBufferError {
    /// Zero bytes, an alignment that is not a power of two of at least 4 KiB, or a size the
    /// allocator cannot describe.
    #[error("cannot allocate {len:#x} bytes aligned to {align:#x} (need len > 0, align a power of two >= 4 KiB)")]
    BadLayout {
        /// Bytes asked for.
        len: u64,
        /// Alignment asked for.
        align: u64,
    },
    /// The allocator had no memory.
    #[error("out of memory allocating {len:#x} bytes")]
    OutOfMemory {
        /// Bytes asked for.
        len: u64,
    },
}

impl HostBuffer {
    /// `len` bytes (rounded up to 4 KiB), zeroed, aligned to `align`. The host page size it
    /// reports is 4 KiB; see [`Self::with_page_size`].
    pub fn new(len: u64, align: u64) -> Result<Self, HostBufferError> {
        let bad = HostBufferError::BadLayout { len, align };
        if len == 0 || !align.is_power_of_two() || align < PAGE_SIZE {
            return Err(bad);
        }
        let rounded = len.checked_next_multiple_of(PAGE_SIZE).ok_or(bad.clone())?;
        let size = usize::try_from(rounded).map_err(|_| bad.clone())?;
        let layout = Layout::from_size_align(size, align as usize).map_err(|_| bad)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).ok_or(HostBufferError::OutOfMemory { len })?;
        Ok(HostBuffer {
            ptr,
            layout,
            page_size: PAGE_SIZE,
        })
    }

    /// Declares the page size the host maps this buffer with, so that memslots over it may
    /// use leaves that large (the buffer should be aligned to it for that to happen).
    pub fn with_page_size(mut self, page_size: u64) -> Self {
        self.page_size = page_size;
        self
    }

    /// Reads the 8 bytes at `offset` atomically; `None` if `offset` is not 8-byte aligned
    /// or not inside the buffer.
    pub fn load_u64(&self, offset: u64) -> Option<u64> {
        Some(
            self.atomic_at(offset)?
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Writes the 8 bytes at `offset` atomically; false if `offset` is not 8-byte aligned or
    /// not inside the buffer.
    pub fn store_u64(&self, offset: u64, val: u64) -> bool {
        match self.atomic_at(offset) {
            Some(a) => {
                a.store(val, std::sync::atomic::Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    fn atomic_at(&self, offset: u64) -> Option<&std::sync::atomic::AtomicU64> {
        if offset % 8 != 0 || offset.checked_add(8)? > self.layout.size() as u64 {
            return None;
        }
        // SAFETY: in bounds and 8-byte aligned (the base is at least 4 KiB aligned), inside an
        // allocation that lives as long as `&self`; every access to these bytes from Rust is
        // atomic (the vCPUs' too), so sharing them as an `AtomicU64` is sound.
        Some(unsafe {
            std::sync::atomic::AtomicU64::from_ptr(self.ptr.as_ptr().add(offset as usize).cast())
        })
    }
}

// SAFETY: the allocation is mapped read/write and never moves or is freed before drop; its
// address and length are 4 KiB multiples (the layout's alignment and rounded size) and fixed;
// no references to its bytes are handed out.
unsafe impl HostMemory for HostBuffer {
    fn host_addr(&self) -> Hva {
        Hva::from_ptr(self.ptr.as_ptr())
    }
    fn len(&self) -> u64 {
        self.layout.size() as u64
    }
    fn page_size(&self) -> u64 {
        self.page_size
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.host_addr()))
            .field("len", &format_args!("{:#x}", self.layout.size()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phantom_addresses_stay_in_the_pool_and_keep_the_offset() {
        let pool = Hva::new(0x7000_0000_0000);
        let end = pool.raw() + PHANTOM_POOL_FRAMES * PAGE_SIZE;
        for hva in [0u64, 0xff8, 0x1000, 63 << 12, 64 << 12, (1 << 40) + 0x1238] {
            let r = phantom_addr(pool, Hva::new(hva)).raw();
            assert!(r >= pool.raw() && r < end, "{hva:#x}");
            assert_eq!(r & 0xfff, hva & 0xfff);
        }
        assert_eq!(
            phantom_addr(pool, Hva::new(65 << 12)).raw(),
            pool.raw() + 0x1000
        );
    }
}
