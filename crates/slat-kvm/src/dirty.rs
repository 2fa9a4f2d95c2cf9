//! Dirty-log ioctls `kvm-ioctls` lacks (or only offers with an allocation per call), and the
//! per-vCPU dirty ring.

use crate::error::KvmError;
use kvm_bindings::{kvm_clear_dirty_log, kvm_dirty_gfn, kvm_dirty_log};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
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

fn last_err(op: &'static str) -> KvmError {
    KvmError::Ioctl {
        op,
        source: io::Error::last_os_error(),
    }
}

/// `KVM_GET_DIRTY_LOG` of `slot` into `bitmap` (one bit per page; the caller sized it for the
/// slot, rounded up to 64 pages).
pub fn get_dirty_log(vm: &impl AsRawFd, slot: u32, bitmap: &mut [u64]) -> Result<(), KvmError> {
    let mut log = kvm_dirty_log {
        slot,
        ..Default::default()
    };
    log.__bindgen_anon_1.dirty_bitmap = bitmap.as_mut_ptr().cast();
    // SAFETY: the ioctl reads `log` and writes at most the slot's bitmap size (which the caller
    // checked `bitmap` holds) through the pointer; `bitmap` outlives the call.
    let r = unsafe { ioctl_with_ref(vm, KVM_GET_DIRTY_LOG(), &log) };
    if r < 0 {
        return Err(last_err("KVM_GET_DIRTY_LOG"));
    }
    Ok(())
}

/// `KVM_CLEAR_DIRTY_LOG` of `num_pages` pages of `slot` from `first_page`, for the pages whose
/// bits are set in `bitmap` (bit 0 = `first_page`).
pub fn clear_dirty_log(
    vm: &impl AsRawFd,
    slot: u32,
    first_page: u64,
    num_pages: u32,
    bitmap: &[u64],
) -> Result<(), KvmError> {
    let mut c = kvm_clear_dirty_log {
        slot,
        num_pages,
        first_page,
        ..Default::default()
    };
    c.__bindgen_anon_1.dirty_bitmap = bitmap.as_ptr() as *mut libc::c_void;
    // SAFETY: the kernel only reads `num_pages` bits of the bitmap (the caller checked that
    // `bitmap` holds them) and `c`; both outlive the call.
    let r = unsafe { ioctl_with_ref(vm, KVM_CLEAR_DIRTY_LOG(), &c) };
    if r < 0 {
        return Err(last_err("KVM_CLEAR_DIRTY_LOG"));
    }
    Ok(())
}

/// `KVM_RESET_DIRTY_RINGS`: re-protects every entry flagged RESET; returns how many.
pub fn reset_dirty_rings(vm: &impl AsRawFd) -> Result<u64, KvmError> {
    // SAFETY: the ioctl takes no argument and touches only KVM state and the rings' memory,
    // which KVM owns.
    let r = unsafe { ioctl(vm, KVM_RESET_DIRTY_RINGS()) };
    if r < 0 {
        return Err(last_err("KVM_RESET_DIRTY_RINGS"));
    }
    Ok(r as u64)
}

/// One vCPU's dirty ring, mapped from the vCPU fd at `KVM_DIRTY_LOG_PAGE_OFFSET`, and the
/// index of the next entry to collect.
#[derive(Debug)]
pub struct DirtyRing {
    entries: *mut kvm_dirty_gfn,
    count: u32,
    /// Free-running index of the next entry to collect.
    fetch: u32,
}

// SAFETY: the mapping is owned by this value (unmapped on drop) and shared only with KVM, with
// which it synchronises through the entries' flags (acquire/release).
unsafe impl Send for DirtyRing {}

impl DirtyRing {
    /// Maps the ring of `count` entries of the vCPU `fd`.
    pub fn map(fd: RawFd, count: u32) -> Result<Self, KvmError> {
        let len = count as usize * std::mem::size_of::<kvm_dirty_gfn>();
        // SAFETY: the kernel owns the pages behind this offset of a vCPU fd; we map them
        // shared, at an address it chooses, and access them only through this value.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                kvm_bindings::KVM_DIRTY_LOG_PAGE_OFFSET as i64 * 4096,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(KvmError::Mmap {
                what: "the vCPU dirty ring".into(),
                len: len as u64,
                source: io::Error::last_os_error(),
                hint: "",
            });
        }
        Ok(DirtyRing {
            entries: p.cast(),
            count,
            fetch: 0,
        })
    }

    /// Collects every published entry in order: reads it after an acquire load of its flags
    /// shows DIRTY, calls `f(slot, offset)`, then hands it back with a release store of RESET
    /// (so KVM's reset reads the flags after our reads of the entry). Returns how many.
    pub fn harvest(&mut self, mut f: impl FnMut(u32, u64)) -> u32 {
        let mut n = 0;
        loop {
            let i = (self.fetch & (self.count - 1)) as usize;
            // SAFETY: `i < count`, inside the mapping.
            let e = unsafe { self.entries.add(i) };
            // SAFETY: `flags` is a u32 at offset 0 of an 8-byte-aligned entry that KVM updates
            // concurrently: access it atomically only.
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
            f(slot, offset);
            flags.store(KVM_DIRTY_GFN_F_RESET, Ordering::Release);
            self.fetch = self.fetch.wrapping_add(1);
            n += 1;
        }
        n
    }

    /// Entries in the ring.
    pub fn count(&self) -> u32 {
        self.count
    }
}

impl Drop for DirtyRing {
    fn drop(&mut self) {
        let len = self.count as usize * std::mem::size_of::<kvm_dirty_gfn>();
        // SAFETY: exactly the mapping `map` created; nothing uses it after this.
        unsafe {
            libc::munmap(self.entries.cast(), len);
        }
    }
}
