//! The crate's error type.

use slat_addr::PageIndex;
use std::io;

/// Why a dirty-log call or a harvest was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The host kernel lacks a capability the call needs.
    #[error("{capability} not supported by this host kernel{detail}")]
    Unsupported {
        /// The capability, e.g. `KVM_CAP_DIRTY_LOG_RING`.
        capability: &'static str,
        /// More detail (empty, or starting with `: ` or ` (`).
        detail: String,
    },
    /// A KVM ioctl failed.
    #[error("{op} failed: {source}")]
    Ioctl {
        /// The ioctl, e.g. `KVM_GET_DIRTY_LOG`.
        op: &'static str,
        /// The error number the kernel returned.
        source: io::Error,
    },
    /// Ring memory could not be mapped.
    #[error("cannot map {len} bytes of {what}: {source}{hint}")]
    Mmap {
        /// What was being mapped.
        what: String,
        /// Bytes.
        len: u64,
        /// What `mmap(2)` (or `madvise(2)`) said.
        source: io::Error,
        /// How to fix it (empty, or starting with `; `).
        hint: &'static str,
    },
    /// A dirty bitmap whose length is not the number of words the ioctl reads or writes.
    #[error(
        "{op}: {pages} pages of slot {slot} need a bitmap of exactly {expected} u64 words, \
         got {got}"
    )]
    BitmapLength {
        /// `KVM_GET_DIRTY_LOG`, `KVM_CLEAR_DIRTY_LOG`, or the library call.
        op: &'static str,
        /// The memslot (`as_id << 16 | id`).
        slot: u32,
        /// Pages the bitmap covers: the whole slot for GET, the range for CLEAR.
        pages: u64,
        /// Words KVM transfers: `pages` rounded up to a multiple of 64, over 64.
        expected: u64,
        /// Words given.
        got: usize,
    },
    /// A `KVM_CLEAR_DIRTY_LOG` range KVM would refuse.
    #[error(
        "KVM_CLEAR_DIRTY_LOG: {num_pages} pages from page {first_page} of slot {slot} \
         ({slot_pages} pages): {reason}"
    )]
    ClearRange {
        /// The memslot.
        slot: u32,
        /// First page of the range.
        first_page: PageIndex,
        /// Pages in the range.
        num_pages: u64,
        /// Pages in the slot.
        slot_pages: u64,
        /// Which rule the range breaks.
        reason: &'static str,
    },
    /// A dirty ring size KVM would refuse, or one that is not the size of the vCPU's ring.
    #[error("dirty ring of {entries} entries: {reason}")]
    RingSize {
        /// Entries asked for.
        entries: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// KVM refused to enable the dirty ring.
    #[error(
        "KVM_ENABLE_CAP(DIRTY_LOG_RING) of {bytes} bytes failed: {source} (KVM enables the ring \
         once per VM, before any vCPU is created, and only with a size it supports)"
    )]
    RingEnable {
        /// The size asked for, in bytes (what the capability takes).
        bytes: u32,
        /// What KVM said.
        source: io::Error,
    },
    /// A memslot this crate will not register or adopt.
    #[error("memslot {slot}: {reason}")]
    Memslot {
        /// The memslot (`as_id << 16 | id`).
        slot: u32,
        /// Why.
        reason: &'static str,
    },
    /// A harvest request that does not fit the harvester (unknown slot, wrong mode, bad chunk).
    #[error("harvest: {0}")]
    Harvest(String),
    /// Memory sized by the caller (a bitmap for a slot's pages, a snapshot's copy) could not
    /// be allocated: a typed error rather than an abort.
    #[error("cannot allocate {bytes} bytes for {what}")]
    Alloc {
        /// What it was for.
        what: String,
        /// Bytes asked for (saturated at `u64::MAX`).
        bytes: u64,
    },
}

/// `n` copies of `v` in a vector allocated fallibly: the count comes from a caller (a slot's
/// page count, a region's length), and an infallible allocation aborts the process when it
/// fails. `what` names the allocation in the error.
pub(crate) fn try_filled<T: Clone>(
    n: usize,
    v: T,
    what: impl FnOnce() -> String,
) -> Result<Vec<T>, Error> {
    let mut out = Vec::new();
    if out.try_reserve_exact(n).is_err() {
        let bytes = (n as u128 * std::mem::size_of::<T>() as u128).min(u64::MAX as u128) as u64;
        return Err(Error::Alloc {
            what: what(),
            bytes,
        });
    }
    out.resize(n, v);
    Ok(out)
}

impl Error {
    /// An ioctl error from `kvm-ioctls` / `vmm-sys-util`.
    pub(crate) fn ioctl(op: &'static str, e: vmm_sys_util::errno::Error) -> Self {
        Error::Ioctl {
            op,
            source: io::Error::from_raw_os_error(e.errno()),
        }
    }
}
