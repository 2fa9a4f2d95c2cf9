//! Dirty-log ioctls `kvm-ioctls` lacks (or only offers with an allocation per call), and the
//! per-vCPU dirty ring.
//!
//! What KVM reads and writes through the pointers these calls pass, and how each call makes
//! sure the memory is there:
//!
//! - `KVM_GET_DIRTY_LOG` writes the slot's whole bitmap, `ceil(npages / 64)` u64 words, to
//!   the address given, whatever the caller allocated. [`get_dirty_log`] takes the slot as a
//!   [`Memslot`] (which knows `npages`) and refuses any bitmap that is not exactly that long;
//!   [`get_dirty_log_unchecked`] is the raw form, `unsafe`, for slots this crate did not
//!   register.
//! - `KVM_CLEAR_DIRTY_LOG` reads `ceil(num_pages / 64)` words. [`clear_dirty_log`] checks the
//!   range as KVM does (first page a multiple of 64, length a multiple of 64 unless the range
//!   ends the slot, inside the slot) and the bitmap's length exactly.
//! - The dirty ring is `entries × 16` bytes that KVM maps at `KVM_DIRTY_LOG_PAGE_OFFSET` of a
//!   vCPU fd; `KVM_CAP_DIRTY_LOG_RING` takes the size in *bytes*. [`RingSize`] holds a
//!   validated size and converts; [`DirtyRing::map`] checks that the vCPU's ring is exactly
//!   that size before using it, and masks every index into it.
//!
//! Every call takes the `kvm-ioctls` fd type of the object it acts on (`VmFd`, `VcpuFd`, or a
//! [`Memslot`], which holds its `VmFd`), never a raw fd: an arbitrary fd would make the ioctl
//! act on whatever object it is.
//!
//! ```no_run
//! # fn main() -> Result<(), slat_dirty::Error> {
//! use slat_dirty::log::{self as dirty, DirtyRing};
//! let vm = kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap();
//! let size = dirty::RingSize::from_entries(4096)?; // 64 KiB: the cap is given bytes
//! dirty::enable_dirty_ring(&vm, size, false)?;
//! let vcpu = vm.create_vcpu(0).unwrap();
//! let mut ring = DirtyRing::map(&vcpu, size)?; // checks KVM's ring is 4096 entries
//! ring.harvest(|slot, offset| println!("{slot} {offset}"));
//! dirty::reset_dirty_rings(&vm)?;
//! # Ok(()) }
//! ```
//!
//! What the raw-fd forms allowed no longer compiles. A file is no vCPU:
//!
//! ```compile_fail,E0308
//! # fn main() -> Result<(), slat_dirty::Error> {
//! let f = std::fs::File::open("/dev/zero").unwrap();
//! let size = slat_dirty::log::RingSize::from_entries(4096)?;
//! let _ring = slat_dirty::log::DirtyRing::map(&f, size)?;
//! # Ok(()) }
//! ```
//!
//! nor a VM:
//!
//! ```compile_fail,E0308
//! let f = std::fs::File::open("/dev/zero").unwrap();
//! slat_dirty::log::reset_dirty_rings(&f).unwrap();
//! ```
//!
//! and GET takes a [`Memslot`], not a VM fd with a slot number whose size nobody checked:
//!
//! ```compile_fail,E0308
//! let vm = kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap();
//! let mut bitmap = [0u64; 1];
//! slat_dirty::log::get_dirty_log(&vm, &mut bitmap).unwrap();
//! ```

use crate::error::Error;
use crate::memslot::{bitmap_words, Memslot};
use kvm_bindings::{
    kvm_clear_dirty_log, kvm_dirty_gfn, kvm_dirty_log, kvm_enable_cap, KVM_CAP_DIRTY_LOG_RING,
    KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_DIRTY_LOG_PAGE_OFFSET,
};
use kvm_ioctls::{VcpuFd, VmFd};
use slat_addr::{PageIndex, PAGE_SIZE};
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref};

/// The request numbers (`_IOW`/`_IOWR`/`_IO` of `KVMIO`), as in `linux/kvm.h`.
mod nr {
    #![allow(missing_docs)]
    use kvm_bindings::{kvm_clear_dirty_log, kvm_dirty_log, KVMIO};
    use vmm_sys_util::{ioctl_io_nr, ioctl_iow_nr, ioctl_iowr_nr};

    ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
    ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
    ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);
}
use nr::{KVM_CLEAR_DIRTY_LOG, KVM_GET_DIRTY_LOG, KVM_RESET_DIRTY_RINGS};

/// Entry flag set by KVM when it publishes an entry.
pub const KVM_DIRTY_GFN_F_DIRTY: u32 = 1 << 0;
/// Entry flag set by user space when it has collected an entry.
pub const KVM_DIRTY_GFN_F_RESET: u32 = 1 << 1;

fn last_err(op: &'static str) -> Error {
    Error::Ioctl {
        op,
        source: io::Error::last_os_error(),
    }
}

/// `KVM_GET_DIRTY_LOG` of `slot` into `bitmap` (bit `p` = page `p` of the slot).
///
/// `bitmap` must be exactly [`Memslot::bitmap_words`] long — the words KVM writes — or the call
/// is refused with [`Error::BitmapLength`]: shorter would let KVM write past it, longer
/// would leave words KVM never writes looking like a result.
pub fn get_dirty_log(slot: &Memslot, bitmap: &mut [u64]) -> Result<(), Error> {
    let expected = slot.bitmap_words();
    if u64::try_from(bitmap.len()) != Ok(expected) {
        return Err(Error::BitmapLength {
            op: "KVM_GET_DIRTY_LOG",
            slot: slot.id(),
            pages: slot.pages(),
            expected,
            got: bitmap.len(),
        });
    }
    // SAFETY: `bitmap` is exactly `ceil(npages / 64)` words of the slot (checked above).
    // `npages` is what KVM gave the slot when `Memslot::register` created it on this very VM
    // (the handle carries the VM fd), and KVM cannot change it while the slot exists: it
    // refuses to resize a live slot, and the contract of `register` forbids deleting it while
    // a handle lives.
    unsafe { get_dirty_log_unchecked(slot.vm(), slot.id(), bitmap) }
}

/// `KVM_GET_DIRTY_LOG` of memslot `slot` of `vm` into `bitmap`, trusting the caller for its
/// length: the raw form of [`get_dirty_log`], for slots not registered through [`Memslot`].
///
/// # Safety
///
/// `bitmap` must hold at least `ceil(npages / 64)` words, where `npages` is the page count of
/// memslot `slot` of `vm` when KVM runs the ioctl. KVM copies the slot's whole dirty bitmap,
/// rounded up to a multiple of 64 bits, to `bitmap`'s address whatever its length; a shorter
/// slice is overwritten past its end.
pub unsafe fn get_dirty_log_unchecked(
    vm: &VmFd,
    slot: u32,
    bitmap: &mut [u64],
) -> Result<(), Error> {
    let mut log = kvm_dirty_log {
        slot,
        ..Default::default()
    };
    log.__bindgen_anon_1.dirty_bitmap = bitmap.as_mut_ptr().cast();
    // SAFETY: KVM reads `log` (alive for the call) and writes `ceil(npages / 64)` words
    // through the pointer, which the caller guarantees `bitmap` holds; `bitmap` is borrowed
    // mutably for the call, so nothing else accesses it meanwhile. `vm` is a VM fd, so the
    // request number means KVM_GET_DIRTY_LOG to the object it reaches.
    let r = unsafe { ioctl_with_ref(vm, KVM_GET_DIRTY_LOG(), &log) };
    if r < 0 {
        return Err(last_err("KVM_GET_DIRTY_LOG"));
    }
    Ok(())
}

/// `KVM_CLEAR_DIRTY_LOG` (manual protect) of `num_pages` pages of `slot` from `first_page`:
/// clears and re-protects the pages whose bits are set in `bitmap` (bit 0 = `first_page`).
///
/// Refused before the ioctl, as KVM would refuse them ([`Error::ClearRange`]): a
/// `first_page` that is not a multiple of 64, a range that does not fit the slot, a
/// `num_pages` that is not a multiple of 64 unless the range ends at the slot's end. `bitmap`
/// must be exactly `ceil(num_pages / 64)` words, the words KVM reads
/// ([`Error::BitmapLength`]).
pub fn clear_dirty_log(
    slot: &Memslot,
    first_page: PageIndex,
    num_pages: u64,
    bitmap: &[u64],
) -> Result<(), Error> {
    let first = first_page.raw();
    let pages = slot.pages();
    let refuse = |reason| {
        Err(Error::ClearRange {
            slot: slot.id(),
            first_page,
            num_pages,
            slot_pages: pages,
            reason,
        })
    };
    if first % 64 != 0 {
        return refuse("the first page must be a multiple of 64");
    }
    let Some(rest) = pages.checked_sub(first) else {
        return refuse("the first page is past the end of the slot");
    };
    if num_pages > rest {
        return refuse("the range runs past the end of the slot");
    }
    if num_pages % 64 != 0 && num_pages != rest {
        return refuse("the length must be a multiple of 64 unless the range ends the slot");
    }
    let Ok(num_pages_u32) = u32::try_from(num_pages) else {
        return refuse("KVM takes at most 2^32 - 1 pages per call");
    };
    let expected = bitmap_words(num_pages);
    if u64::try_from(bitmap.len()) != Ok(expected) {
        return Err(Error::BitmapLength {
            op: "KVM_CLEAR_DIRTY_LOG",
            slot: slot.id(),
            pages: num_pages,
            expected,
            got: bitmap.len(),
        });
    }
    let mut c = kvm_clear_dirty_log {
        slot: slot.id(),
        num_pages: num_pages_u32,
        first_page: first,
        ..Default::default()
    };
    // KVM only reads through this pointer (`copy_from_user`); the field is `*mut` in the ABI.
    c.__bindgen_anon_1.dirty_bitmap = bitmap.as_ptr().cast_mut().cast();
    // SAFETY: KVM reads `c` and `ALIGN(num_pages, 64) / 8` bytes through the pointer, which is
    // exactly `bitmap` (its length is checked above); it writes nothing through it. Both
    // outlive the call. The fd is the slot's VM.
    let r = unsafe { ioctl_with_ref(slot.vm(), KVM_CLEAR_DIRTY_LOG(), &c) };
    if r < 0 {
        return Err(last_err("KVM_CLEAR_DIRTY_LOG"));
    }
    Ok(())
}

/// `KVM_RESET_DIRTY_RINGS`: re-protects every entry flagged RESET; returns how many.
pub fn reset_dirty_rings(vm: &VmFd) -> Result<u64, Error> {
    // SAFETY: the ioctl takes no argument and touches only KVM state and the rings' memory,
    // which KVM owns (user space only flags entries, atomically). `vm` is a VM fd, so the
    // request means KVM_RESET_DIRTY_RINGS to the object it reaches.
    let r = unsafe { ioctl(vm, KVM_RESET_DIRTY_RINGS()) };
    if r < 0 {
        return Err(last_err("KVM_RESET_DIRTY_RINGS"));
    }
    Ok(r as u64)
}

/// The size of a dirty ring: a power of two number of entries between [`RingSize::MIN_ENTRIES`]
/// and [`RingSize::MAX_ENTRIES`].
///
/// KVM speaks of the ring in two units: `KVM_CAP_DIRTY_LOG_RING` takes its size in *bytes*,
/// the mapping is `entries × sizeof(struct kvm_dirty_gfn)` (16) bytes, and the index wraps at
/// `entries`. This type holds the one validated value and converts, so the units cannot be
/// mixed up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RingSize {
    entries: u32,
}

impl RingSize {
    /// Bytes per entry: `sizeof(struct kvm_dirty_gfn)`.
    pub const ENTRY_BYTES: u32 = std::mem::size_of::<kvm_dirty_gfn>() as u32;
    /// The smallest ring KVM accepts is one page (it may demand more: 64 reserved entries,
    /// plus the PML buffer's 512 on hosts with PML; it says `EINVAL` when enabling).
    pub const MIN_ENTRIES: u32 = PAGE_SIZE as u32 / Self::ENTRY_BYTES;
    /// KVM's `KVM_DIRTY_RING_MAX_ENTRIES`.
    pub const MAX_ENTRIES: u32 = 65536;

    /// A ring of `entries` entries.
    pub fn from_entries(entries: u32) -> Result<Self, Error> {
        let refuse = |reason: String| {
            Err(Error::RingSize {
                entries: entries.into(),
                reason,
            })
        };
        if !entries.is_power_of_two() {
            return refuse("the number of entries must be a power of two".into());
        }
        if entries < Self::MIN_ENTRIES {
            return refuse(format!(
                "KVM's smallest ring is one page, {} entries",
                Self::MIN_ENTRIES
            ));
        }
        if entries > Self::MAX_ENTRIES {
            return refuse(format!(
                "KVM's largest ring is {} entries ({} bytes)",
                Self::MAX_ENTRIES,
                Self::MAX_ENTRIES as u64 * Self::ENTRY_BYTES as u64
            ));
        }
        Ok(RingSize { entries })
    }

    /// A ring of `bytes` bytes (what `KVM_CAP_DIRTY_LOG_RING` takes): a whole number of
    /// entries, otherwise as [`RingSize::from_entries`].
    pub fn from_bytes(bytes: u64) -> Result<Self, Error> {
        let entries = bytes / Self::ENTRY_BYTES as u64;
        if bytes % Self::ENTRY_BYTES as u64 != 0 {
            return Err(Error::RingSize {
                entries,
                reason: format!(
                    "{bytes} bytes is not a whole number of {}-byte entries",
                    Self::ENTRY_BYTES
                ),
            });
        }
        match u32::try_from(entries) {
            Ok(e) => Self::from_entries(e),
            Err(_) => Err(Error::RingSize {
                entries,
                reason: format!("KVM's largest ring is {} entries", Self::MAX_ENTRIES),
            }),
        }
    }

    /// Entries in the ring.
    pub fn entries(self) -> u32 {
        self.entries
    }

    /// Bytes of the ring: what `KVM_CAP_DIRTY_LOG_RING` takes, and the length of the mapping.
    pub fn bytes(self) -> u32 {
        // At most 65536 × 16 = 2^20: no overflow.
        self.entries * Self::ENTRY_BYTES
    }
}

/// Enables the per-vCPU dirty ring on `vm` with `size` (`KVM_ENABLE_CAP` of
/// `KVM_CAP_DIRTY_LOG_RING_ACQ_REL` if `acq_rel`, else `KVM_CAP_DIRTY_LOG_RING`, with the
/// size in bytes). KVM accepts this once, before any vCPU exists.
///
/// Checked first: the capability ([`Error::Unsupported`]) and the largest ring it reports
/// ([`Error::RingSize`]). KVM's own refusals (a vCPU already exists, the ring was already
/// enabled, a size below what the host needs) are [`Error::RingEnable`].
pub fn enable_dirty_ring(vm: &VmFd, size: RingSize, acq_rel: bool) -> Result<(), Error> {
    let (cap_nr, name) = if acq_rel {
        (
            KVM_CAP_DIRTY_LOG_RING_ACQ_REL,
            "KVM_CAP_DIRTY_LOG_RING_ACQ_REL",
        )
    } else {
        (KVM_CAP_DIRTY_LOG_RING, "KVM_CAP_DIRTY_LOG_RING")
    };
    // The capability answers the largest ring in bytes (0: none).
    let max = vm.check_extension_raw(cap_nr.into());
    if max <= 0 {
        return Err(Error::Unsupported {
            capability: name,
            detail: String::new(),
        });
    }
    if u64::from(size.bytes()) > max as u64 {
        return Err(Error::RingSize {
            entries: size.entries().into(),
            reason: format!("this host's largest ring is {max} bytes"),
        });
    }
    let mut cap = kvm_enable_cap {
        cap: if acq_rel {
            KVM_CAP_DIRTY_LOG_RING_ACQ_REL
        } else {
            KVM_CAP_DIRTY_LOG_RING
        },
        ..Default::default()
    };
    cap.args[0] = size.bytes().into();
    vm.enable_cap(&cap).map_err(|e| Error::RingEnable {
        bytes: size.bytes(),
        source: io::Error::from_raw_os_error(e.errno()),
    })
}

/// Enables manual dirty-log protection on `vm` (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` with
/// `KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE`, plus `KVM_DIRTY_LOG_INITIALLY_SET` if
/// `initially_set`): GET then only copies the bitmap, and pages are re-protected by
/// [`clear_dirty_log`]. With `initially_set`, enabling logging on a slot sets every bit and
/// protects nothing until the first CLEAR (no write-protect storm when logging starts).
///
/// Answers [`Error::Unsupported`] if the kernel lacks the capability (or `INITIALLY_SET`).
pub fn enable_manual_protect(vm: &VmFd, initially_set: bool) -> Result<(), Error> {
    let have = vm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into());
    let want = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE
        | if initially_set {
            KVM_DIRTY_LOG_INITIALLY_SET
        } else {
            0
        };
    // The capability answers the set of flags it supports (0: none).
    if have <= 0 || (have as u64) & u64::from(want) != u64::from(want) {
        return Err(Error::Unsupported {
            capability: "KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2",
            detail: if initially_set && have > 0 {
                " (with KVM_DIRTY_LOG_INITIALLY_SET)".into()
            } else {
                String::new()
            },
        });
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
        ..Default::default()
    };
    cap.args[0] = want.into();
    vm.enable_cap(&cap)
        .map_err(|e| Error::ioctl("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)", e))
}

/// One vCPU's dirty ring, mapped from the vCPU fd at `KVM_DIRTY_LOG_PAGE_OFFSET`, and the
/// index of the next entry to collect.
///
/// What keeps the mapping valid: a mapping holds its own reference to the file it maps, so
/// the vCPU fd's file — and with it the vCPU, its VM and the ring's pages, which KVM frees
/// only when the VM is destroyed — lives until this value unmaps it on drop, even if every
/// `VcpuFd` and `VmFd` of the VM has been closed before. (A ring therefore also keeps its VM
/// alive: drop it with the machine.)
#[derive(Debug)]
pub struct DirtyRing {
    entries: NonNull<kvm_dirty_gfn>,
    size: RingSize,
    /// Free-running index of the next entry to collect.
    fetch: u32,
}

// SAFETY: the mapping is owned by this value (unmapped on drop) and shared only with KVM, with
// which it synchronises through the entries' flags (acquire/release); `harvest` takes `&mut`.
unsafe impl Send for DirtyRing {}

/// `KVM_DIRTY_LOG_PAGE_OFFSET` in bytes: where a vCPU fd's ring starts.
const RING_OFFSET: libc::off_t =
    KVM_DIRTY_LOG_PAGE_OFFSET as libc::off_t * PAGE_SIZE as libc::off_t;

/// Faults in `[addr, addr + len)` of our own mapping for reading without touching it from user
/// space: where the mapping has no memory behind it, the kernel reports `EFAULT` instead of
/// raising SIGBUS.
fn populate(addr: *mut libc::c_void, len: usize) -> io::Result<()> {
    // SAFETY: the range lies in a mapping this module created; MADV_POPULATE_READ only faults
    // pages in and changes no contents.
    let r = unsafe { libc::madvise(addr, len, libc::MADV_POPULATE_READ) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl DirtyRing {
    /// Maps the dirty ring of `vcpu`, which must be exactly `size`: what its VM enabled with
    /// [`enable_dirty_ring`] (`KVM_CAP_DIRTY_LOG_RING`).
    ///
    /// The size is checked against KVM: every page of the ring must be backed and the page
    /// after it must not be (`MADV_POPULATE_READ` of each, which fails with `EFAULT` where KVM
    /// has no ring page). A VM without a ring, or with one of another size, is refused with
    /// [`Error::RingSize`]; a kernel older than 5.14 cannot check and answers
    /// [`Error::Unsupported`] (see [`DirtyRing::map_unchecked`]).
    pub fn map(vcpu: &VcpuFd, size: RingSize) -> Result<Self, Error> {
        let len = size.bytes() as usize;
        let page = PAGE_SIZE as usize;
        // The ring and one page past it, to look at both.
        let p = Self::mmap(vcpu, len + page)?;
        let ring = populate(p.as_ptr().cast(), len);
        // SAFETY: `len` is inside the `len + page` bytes just mapped.
        let past = unsafe { p.as_ptr().cast::<u8>().add(len) };
        let after = populate(past.cast(), page);
        // SAFETY: the last page of the mapping just created; nothing refers to it.
        unsafe { libc::munmap(past.cast(), page) };
        // From here the value owns `[p, p + len)` and unmaps it on every return.
        let this = DirtyRing {
            entries: p,
            size,
            fetch: 0,
        };
        let bytes = size.bytes();
        let wrong = |reason: String| {
            Err(Error::RingSize {
                entries: size.entries().into(),
                reason,
            })
        };
        match (ring, after) {
            (Ok(()), Err(e)) if e.raw_os_error() == Some(libc::EFAULT) => Ok(this),
            (Ok(()), Ok(())) => wrong(format!(
                "the vCPU's ring is larger: its VM enabled KVM_CAP_DIRTY_LOG_RING with more than \
                 {bytes} bytes"
            )),
            (Err(e), _) if e.raw_os_error() == Some(libc::EFAULT) => wrong(format!(
                "the vCPU has no ring of {bytes} bytes: its VM did not enable \
                 KVM_CAP_DIRTY_LOG_RING, or enabled a smaller one"
            )),
            (Err(e), _) if e.raw_os_error() == Some(libc::EINVAL) => Err(Error::Unsupported {
                capability: "MADV_POPULATE_READ",
                detail: " (Linux 5.14): the dirty ring's size cannot be checked".into(),
            }),
            (Err(source), _) | (Ok(()), Err(source)) => Err(Error::Mmap {
                what: "the vCPU dirty ring (populating it)".into(),
                len: len as u64,
                source,
                hint: "",
            }),
        }
    }

    /// Maps the dirty ring of `vcpu` without checking its size against KVM (for kernels older
    /// than 5.14, where [`DirtyRing::map`] cannot).
    ///
    /// # Safety
    ///
    /// `size` must be the size the VM of `vcpu` enabled with `KVM_CAP_DIRTY_LOG_RING` (or its
    /// `_ACQ_REL` variant). KVM backs exactly that many bytes at `KVM_DIRTY_LOG_PAGE_OFFSET`:
    /// with a larger `size` the mapping reaches pages with no memory behind them, and
    /// [`DirtyRing::harvest`] would read them (SIGBUS); with a smaller one the harvest reads
    /// the wrong entries.
    pub unsafe fn map_unchecked(vcpu: &VcpuFd, size: RingSize) -> Result<Self, Error> {
        Ok(DirtyRing {
            entries: Self::mmap(vcpu, size.bytes() as usize)?,
            size,
            fetch: 0,
        })
    }

    fn mmap(vcpu: &VcpuFd, len: usize) -> Result<NonNull<kvm_dirty_gfn>, Error> {
        // SAFETY: a new shared mapping at an address the kernel chooses, so no existing memory
        // is affected; `vcpu` is a vCPU fd, whose pages at this offset are the ring (or, past
        // it, no memory at all: accesses fault, and `map` only probes them with madvise).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu.as_raw_fd(),
                RING_OFFSET,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Mmap {
                what: "the vCPU dirty ring".into(),
                len: len as u64,
                source: io::Error::last_os_error(),
                hint: "",
            });
        }
        NonNull::new(p.cast()).ok_or_else(|| Error::Mmap {
            what: "the vCPU dirty ring".into(),
            len: len as u64,
            source: io::Error::other("mmap returned address 0"),
            hint: "",
        })
    }

    /// Collects every published entry in order: reads it after an acquire load of its flags
    /// shows DIRTY, calls `f(slot, offset)`, then hands it back with a release store of RESET
    /// (so KVM's reset reads the flags after our reads of the entry). Returns how many.
    pub fn harvest(&mut self, mut f: impl FnMut(u32, PageIndex)) -> u32 {
        // `entries` is a power of two (RingSize), so the mask keeps every index inside the
        // mapping of `entries` entries, whatever the free-running counter holds.
        let mask = self.size.entries() - 1;
        let mut n = 0;
        loop {
            let i = (self.fetch & mask) as usize;
            // SAFETY: `i <= mask < entries`: inside the mapping of `entries` entries.
            let e = unsafe { self.entries.as_ptr().add(i) };
            // SAFETY: `flags` is a u32 at offset 0 of an 8-byte-aligned entry (the mapping is
            // page aligned, entries are 16 bytes) that KVM updates concurrently: access it
            // atomically only. The mapping outlives the reference (it lives in this loop).
            let flags = unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).flags)) };
            if flags.load(Ordering::Acquire) & KVM_DIRTY_GFN_F_DIRTY == 0 {
                break;
            }
            // SAFETY: DIRTY is set, so KVM wrote slot and offset before its release of the
            // flags, and does not touch the entry again until we hand it back.
            let (slot, offset) = unsafe {
                (
                    std::ptr::addr_of!((*e).slot).read_volatile(),
                    std::ptr::addr_of!((*e).offset).read_volatile(),
                )
            };
            f(slot, PageIndex::new(offset));
            flags.store(KVM_DIRTY_GFN_F_RESET, Ordering::Release);
            self.fetch = self.fetch.wrapping_add(1);
            n += 1;
        }
        n
    }

    /// Entries in the ring.
    pub fn count(&self) -> u32 {
        self.size.entries()
    }

    /// The ring's size.
    pub fn size(&self) -> RingSize {
        self.size
    }
}

impl Drop for DirtyRing {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping `map`/`map_unchecked` created (`size.bytes()` bytes;
        // `map` already unmapped its probe page); nothing uses it after this.
        unsafe {
            libc::munmap(self.entries.as_ptr().cast(), self.size.bytes() as usize);
        }
    }
}
