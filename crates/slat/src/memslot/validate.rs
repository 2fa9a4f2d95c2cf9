//! Checks of a memslot request before anything changes: range, flags, host memory.

use super::{HostRange, MemslotError, MemslotFlags, MemslotSet, SlotId};
use crate::format::PteFormat;
use slat_addr::{Gpa, Hva, PAGE_SIZE};

/// Validates a new slot placement; `ignore` is the slot being moved.
pub(crate) fn validate_range<F: PteFormat>(
    set: &MemslotSet,
    id: SlotId,
    gpa: Gpa,
    size: u64,
    ignore: Option<SlotId>,
) -> Result<(), MemslotError> {
    if size == 0 {
        return Err(MemslotError::ZeroSize { id });
    }
    if !gpa.is_page_aligned() {
        return Err(MemslotError::Misaligned {
            id,
            what: "guest physical address",
            value: gpa.raw(),
        });
    }
    if size % PAGE_SIZE != 0 {
        return Err(MemslotError::Misaligned {
            id,
            what: "size",
            value: size,
        });
    }
    let limit = 1u64 << F::MAX_PHYS_BITS;
    if gpa.raw() >= limit || size > limit - gpa.raw() {
        return Err(MemslotError::BeyondPhysWidth {
            id,
            gpa,
            size,
            bits: F::MAX_PHYS_BITS,
        });
    }
    // Below the address width (checked above, for this range and every published one).
    let end = gpa.raw() + size;
    for s in set.slots.iter().filter(|s| Some(s.id) != ignore) {
        let other_end = s.gpa().raw() + s.size();
        if gpa.raw() < other_end && s.gpa().raw() < end {
            return Err(MemslotError::Overlap {
                id,
                gpa,
                end: Gpa::new(end),
                other: s.id,
                other_gpa: s.gpa(),
                other_end: Gpa::new(other_end),
            });
        }
    }
    Ok(())
}

/// Refuses bits this engine does not know (a value built with `from_bits_retain`).
pub(crate) fn validate_flags(
    id: SlotId,
    flags: MemslotFlags,
) -> Result<MemslotFlags, MemslotError> {
    let unknown = flags.bits() & !MemslotFlags::all().bits();
    if unknown != 0 {
        return Err(MemslotError::UnknownFlags { id, bits: unknown });
    }
    Ok(flags)
}

/// A slot with a private backing neither logs nor is read-only (KVM's
/// `check_memory_region_flags` refuses both with `KVM_MEM_GUEST_MEMFD`).
pub(crate) fn validate_private_flags(id: SlotId, flags: MemslotFlags) -> Result<(), MemslotError> {
    let refused = flags & (MemslotFlags::LOG_DIRTY_PAGES | MemslotFlags::READONLY);
    if refused.is_empty() {
        Ok(())
    } else {
        Err(MemslotError::PrivateIncompatibleFlags {
            id,
            bits: refused.bits(),
        })
    }
}

pub(crate) fn validate_host<F: PteFormat>(
    id: SlotId,
    size: u64,
    host: &HostRange,
) -> Result<(), MemslotError> {
    if !host.addr().is_aligned(PAGE_SIZE) {
        return Err(MemslotError::Misaligned {
            id,
            what: "host address",
            value: host.addr().raw(),
        });
    }
    // The PTE address field must hold every host address of the slot.
    let fits = |a: u64| F::output_addr(a) == Hva::new(a);
    match host.addr().checked_add(size).map(Hva::raw) {
        Some(end) if fits(host.addr().raw()) && fits(end - PAGE_SIZE) => {}
        _ => {
            return Err(MemslotError::HostAddressUnmappable {
                id,
                addr: host.addr(),
                size,
            })
        }
    }
    if ![PAGE_SIZE, 2 << 20, 1 << 30].contains(&host.page_size()) {
        return Err(MemslotError::BadHostPageSize {
            id,
            page_size: host.page_size(),
        });
    }
    if host.len() < size {
        return Err(MemslotError::HostRangeTooSmall {
            id,
            need: size,
            have: host.len(),
        });
    }
    Ok(())
}
