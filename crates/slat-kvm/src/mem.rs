//! Host memory behind guest RAM: a small anonymous mapping of our own (this crate does not
//! depend on `slat-machine`, whose `GuestRam` does the same for the simulated machine).

use crate::error::KvmError;
use std::io;

/// The host page size this crate assumes (x86-64).
pub const PAGE_SIZE: u64 = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;

/// Host memory behind the test region (the selftests' `-s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backing {
    /// Private anonymous memory with 4 KiB pages.
    #[default]
    Anonymous,
    /// Private anonymous memory advised with `MADV_HUGEPAGE` (transparent huge pages).
    AnonymousThp,
    /// Private anonymous hugetlbfs memory with 2 MiB pages (needs reserved huge pages).
    AnonymousHugetlb2M,
    /// Private anonymous hugetlbfs memory with 1 GiB pages (needs reserved huge pages).
    AnonymousHugetlb1G,
}

impl Backing {
    /// Every kind.
    pub const ALL: [Backing; 4] = [
        Backing::Anonymous,
        Backing::AnonymousThp,
        Backing::AnonymousHugetlb2M,
        Backing::AnonymousHugetlb1G,
    ];

    /// The selftests' name.
    pub fn name(self) -> &'static str {
        match self {
            Backing::Anonymous => "anonymous",
            Backing::AnonymousThp => "anonymous_thp",
            Backing::AnonymousHugetlb2M => "anonymous_hugetlb",
            Backing::AnonymousHugetlb1G => "anonymous_hugetlb_1gb",
        }
    }

    /// The page size of the mapping (THP counts as 2 MiB: that is the alignment that lets
    /// huge pages back it).
    pub fn page_size(self) -> u64 {
        match self {
            Backing::Anonymous => PAGE_SIZE,
            Backing::AnonymousThp | Backing::AnonymousHugetlb2M => 2 << 20,
            Backing::AnonymousHugetlb1G => 1 << 30,
        }
    }
}

/// One private anonymous mapping, unmapped on drop.
#[derive(Debug)]
pub struct HostMemory {
    addr: *mut u8,
    len: u64,
    backing: Backing,
}

// SAFETY: the mapping is plain memory owned by this value; it is only unmapped by `Drop`, and
// every access through the raw address is the caller's (atomic or vCPU-exclusive) business.
unsafe impl Send for HostMemory {}
// SAFETY: as above; `&HostMemory` hands out only the address.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Maps `len` bytes (a multiple of the backing's page size) of `backing`; with `prefault`,
    /// populates it writable so guest accesses do not take host page faults.
    pub fn new(backing: Backing, len: u64, prefault: bool) -> Result<Self, KvmError> {
        let psize = backing.page_size();
        if len == 0 || len % psize != 0 {
            return Err(KvmError::Config(format!(
                "mapping length {len} is not a non-zero multiple of the {} page size",
                backing.name()
            )));
        }
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        match backing {
            Backing::AnonymousHugetlb2M => flags |= libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
            Backing::AnonymousHugetlb1G => flags |= libc::MAP_HUGETLB | libc::MAP_HUGE_1GB,
            _ => {}
        }
        let hugetlb = matches!(
            backing,
            Backing::AnonymousHugetlb2M | Backing::AnonymousHugetlb1G
        );
        if hugetlb && prefault {
            // hugetlb pages must be reserved anyway; populating reports a shortage here, at
            // set-up, instead of as a SIGBUS in the middle of a pass.
            flags |= libc::MAP_POPULATE;
            flags &= !libc::MAP_NORESERVE;
        }
        let map_err = |source: io::Error| KvmError::Mmap {
            what: format!("{} guest memory", backing.name()),
            len,
            source,
            hint: if hugetlb {
                "; reserve huge pages first, e.g. echo N > /proc/sys/vm/nr_hugepages \
                 (or /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages for 1 GiB)"
            } else {
                ""
            },
        };
        // THP needs a 2 MiB-aligned start: over-allocate and trim.
        let extra = if backing == Backing::AnonymousThp {
            psize
        } else {
            0
        };
        let total = len
            .checked_add(extra)
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| KvmError::Config(format!("mapping length {len} is too large")))?;
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses; no existing
        // memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(map_err(io::Error::last_os_error()));
        }
        let mut addr = p as u64;
        if extra != 0 {
            let aligned = addr.next_multiple_of(psize);
            let head = aligned - addr;
            let tail = extra - head;
            // SAFETY: both ranges lie inside the mapping just created and are not used.
            unsafe {
                if head != 0 {
                    libc::munmap(p, head as usize);
                }
                if tail != 0 {
                    libc::munmap((aligned + len) as *mut libc::c_void, tail as usize);
                }
            }
            addr = aligned;
        }
        let mem = HostMemory {
            addr: addr as *mut u8,
            len,
            backing,
        };
        if backing == Backing::AnonymousThp {
            // SAFETY: the range is our mapping; madvise only changes its paging policy.
            let r = unsafe {
                libc::madvise(
                    mem.addr as *mut libc::c_void,
                    len as usize,
                    libc::MADV_HUGEPAGE,
                )
            };
            if r != 0 {
                return Err(map_err(io::Error::last_os_error()));
            }
        }
        if prefault && !hugetlb {
            mem.prefault();
        }
        Ok(mem)
    }

    /// Populates every page writable (`MADV_POPULATE_WRITE`, or one write per page on kernels
    /// older than 5.14).
    fn prefault(&self) {
        // SAFETY: the range is our mapping; populating does not change its contents (zero).
        let r = unsafe {
            libc::madvise(
                self.addr as *mut libc::c_void,
                self.len as usize,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            let mut off = 0;
            while off < self.len {
                // SAFETY: in bounds of our writable mapping; nothing else uses it yet.
                unsafe { self.addr.add(off as usize).write_volatile(0) };
                off += PAGE_SIZE;
            }
        }
    }

    /// Host address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: a mapping has at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The kind of memory.
    pub fn backing(&self) -> Backing {
        self.backing
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `new` with exactly this address and length and is
        // no longer registered with KVM (memslots are deleted with the VM, which the owner
        // drops first).
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len as usize);
        }
    }
}
