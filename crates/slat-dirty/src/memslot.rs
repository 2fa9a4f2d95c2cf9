//! Memslots registered by this crate: handles that know the page count KVM gave the slot, so
//! the dirty-log calls ([`crate::log`]) can size the bitmap KVM writes from something the
//! crate controls instead of from the caller's word.

use crate::error::Error;
use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY};
use kvm_ioctls::VmFd;
use slat_addr::{Gpa, Hva, PAGE_SHIFT, PAGE_SIZE};
use std::fmt;
use std::sync::Arc;

/// A memslot of a VM, registered through [`Memslot::register`], with the number of pages KVM
/// gave it.
///
/// `KVM_GET_DIRTY_LOG` copies the slot's whole bitmap — its page count rounded up to a
/// multiple of 64 bits — to whatever address it is given, so the bitmap's size has to come
/// from the slot, not from the caller. A `Memslot` carries both the VM fd and that count:
/// [`crate::log::get_dirty_log`] and [`crate::log::clear_dirty_log`] take one instead of
/// an fd and a slot number, and refuse a bitmap of any other length.
///
/// The count stays right while the handle lives: KVM refuses to change the size of an
/// existing slot (`KVM_SET_USER_MEMORY_REGION` with another size for a live slot id is
/// `EINVAL`), so only deleting the slot and creating it again could, and nothing in this
/// crate deletes a slot (see the contract of [`Memslot::register`]).
///
/// A handle keeps the VM fd open (an `Arc<VmFd>`); it gives no access to it.
#[derive(Clone)]
pub struct Memslot {
    vm: Arc<VmFd>,
    /// The region as registered, without `KVM_MEM_LOG_DIRTY_PAGES`.
    region: kvm_userspace_memory_region,
    /// `memory_size / 4 KiB`: KVM's `npages` for the slot.
    pages: u64,
}

impl fmt::Debug for Memslot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Memslot")
            .field("slot", &self.region.slot)
            .field("guest_phys_addr", &self.region.guest_phys_addr)
            .field("pages", &self.pages)
            .field("userspace_addr", &self.region.userspace_addr)
            .finish()
    }
}

/// Words of a dirty bitmap covering `pages` pages: what KVM transfers, `pages` rounded up to a
/// multiple of 64 bits (`ALIGN(npages, BITS_PER_LONG) / 8` bytes on x86-64).
pub fn bitmap_words(pages: u64) -> u64 {
    pages.div_ceil(64)
}

/// The checks [`Memslot::register`] and [`Memslot::adopt`] make before trusting `region`.
fn check(region: &kvm_userspace_memory_region) -> Result<(), Error> {
    let refuse = |reason| {
        Err(Error::Memslot {
            slot: region.slot,
            reason,
        })
    };
    if region.memory_size == 0 {
        return refuse("a size of 0 would delete the slot; registration never deletes");
    }
    if region.memory_size % PAGE_SIZE != 0
        || region.guest_phys_addr % PAGE_SIZE != 0
        || region.userspace_addr % PAGE_SIZE != 0
    {
        return refuse("size, guest address and host address must be multiples of 4 KiB");
    }
    if region
        .guest_phys_addr
        .checked_add(region.memory_size)
        .is_none()
        || region
            .userspace_addr
            .checked_add(region.memory_size)
            .is_none()
    {
        return refuse("the guest or host range wraps around the address space");
    }
    if region.flags & !(KVM_MEM_LOG_DIRTY_PAGES | KVM_MEM_READONLY) != 0 {
        return refuse("only KVM_MEM_LOG_DIRTY_PAGES and KVM_MEM_READONLY are supported");
    }
    Ok(())
}

impl Memslot {
    /// Creates memslot `region.slot` of `vm` (`KVM_SET_USER_MEMORY_REGION`) and returns its
    /// handle. `region.flags` may hold `KVM_MEM_LOG_DIRTY_PAGES` and `KVM_MEM_READONLY` only.
    ///
    /// Refused before the ioctl (typed [`Error::Memslot`]): a size of 0 (that would delete
    /// the slot), a size, guest address or host address that is not a multiple of 4 KiB, a
    /// range that wraps, other flags. If the slot already exists KVM accepts only a change of
    /// flags or guest address with the same size, so a handle's page count is KVM's either way.
    ///
    /// # Safety
    ///
    /// - `[region.userspace_addr, region.userspace_addr + region.memory_size)` must be mapped
    ///   memory of this process that stays mapped, and holds nothing but guest memory (the
    ///   guest and KVM read and write it at any time), for as long as the VM can reach it
    ///   through this slot: until the slot is deleted or the VM is destroyed. The VM lives while
    ///   any fd of it or of its vCPUs, any mapping of a vCPU fd (e.g. a
    ///   [`crate::log::DirtyRing`]) or any `Memslot` handle of it is alive.
    /// - While a handle of this slot is alive, the slot must not be deleted (a
    ///   `KVM_SET_USER_MEMORY_REGION` of size 0 through the `VmFd`, whose own contract does not
    ///   mention this): created again with another size, it would make the dirty-log calls let
    ///   KVM write past the bitmap sized from the handle. This crate never deletes a slot.
    pub unsafe fn register(
        vm: &Arc<VmFd>,
        region: kvm_userspace_memory_region,
    ) -> Result<Memslot, Error> {
        check(&region)?;
        // SAFETY: the host range is valid guest memory for as long as the VM can reach it
        // (this function's contract), which is what `set_user_memory_region` requires.
        unsafe { vm.set_user_memory_region(region) }
            .map_err(|e| Error::ioctl("KVM_SET_USER_MEMORY_REGION", e))?;
        Ok(Memslot {
            vm: Arc::clone(vm),
            region: kvm_userspace_memory_region {
                flags: region.flags & !KVM_MEM_LOG_DIRTY_PAGES,
                ..region
            },
            pages: region.memory_size >> PAGE_SHIFT,
        })
    }

    /// Describes memslot `region.slot` of `vm`, which the caller already created with exactly
    /// `region` (through its own `VmFd::set_user_memory_region`), without any ioctl. The
    /// handle's page count is `region.memory_size / 4 KiB`; the dirty-log calls size the
    /// bitmaps KVM writes from it.
    ///
    /// Refused (typed [`Error::Memslot`]) as [`Memslot::register`] refuses: a size of 0, sizes
    /// or addresses not multiples of 4 KiB, a wrapping range, other flags.
    ///
    /// # Safety
    ///
    /// - Memslot `region.slot` of `vm` must exist now with exactly `region.memory_size` bytes
    ///   (KVM writes a bitmap of the slot's real size whatever this handle says: a smaller size
    ///   here would let it write past the buffer), and
    /// - it must not be deleted, nor deleted and created again with another size, while a
    ///   handle of it is alive; and its host range must stay guest memory as
    ///   [`Memslot::register`] requires (the handle may re-register the same region with the
    ///   logging flag toggled, [`Memslot::set_dirty_logging`]).
    pub unsafe fn adopt(
        vm: &Arc<VmFd>,
        region: kvm_userspace_memory_region,
    ) -> Result<Memslot, Error> {
        check(&region)?;
        Ok(Memslot {
            vm: Arc::clone(vm),
            region: kvm_userspace_memory_region {
                flags: region.flags & !KVM_MEM_LOG_DIRTY_PAGES,
                ..region
            },
            pages: region.memory_size >> PAGE_SHIFT,
        })
    }

    /// True if both handles hold the same `Arc<VmFd>` (handles made from one `Arc`).
    pub fn same_vm(&self, other: &Memslot) -> bool {
        Arc::ptr_eq(&self.vm, &other.vm)
    }

    /// The slot number (`as_id << 16 | id`), as the ioctls take it.
    pub fn id(&self) -> u32 {
        self.region.slot
    }

    /// Pages in the slot (KVM's `npages`).
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Guest physical address of the first page.
    pub fn guest_phys_addr(&self) -> Gpa {
        Gpa::new(self.region.guest_phys_addr)
    }

    /// Host address of the first page.
    pub fn userspace_addr(&self) -> Hva {
        Hva::new(self.region.userspace_addr)
    }

    /// Length of a `KVM_GET_DIRTY_LOG` bitmap of this slot in u64 words: `ceil(pages / 64)`.
    pub fn bitmap_words(&self) -> u64 {
        bitmap_words(self.pages)
    }

    /// Turns dirty logging (`KVM_MEM_LOG_DIRTY_PAGES`) on or off: a flags-only
    /// `KVM_SET_USER_MEMORY_REGION` with the registered range.
    pub fn set_dirty_logging(&self, on: bool) -> Result<(), Error> {
        let mut r = self.region;
        if on {
            r.flags |= KVM_MEM_LOG_DIRTY_PAGES;
        }
        // SAFETY: the slot, size, guest address and host range are those `register` was given,
        // under its contract that the host range stays valid guest memory while the VM can
        // reach it; only the logging flag differs, which changes no memory the VM can reach.
        unsafe { self.vm.set_user_memory_region(r) }
            .map_err(|e| Error::ioctl("KVM_SET_USER_MEMORY_REGION", e))
    }

    /// The VM the slot belongs to (for the dirty-log ioctls of this crate; never handed out,
    /// since a `&VmFd` can delete the slot).
    pub(crate) fn vm(&self) -> &VmFd {
        &self.vm
    }
}
