//! Intel EPT entries, with the software bits KVM's TDP MMU keeps in them.
//!
//! | bits  | meaning |
//! |-------|---------|
//! | 0/1/2 | R / W / X (hardware permissions) |
//! | 5:3   | memory type (write-back for guest RAM) |
//! | 7     | leaf at level 2 or 3 (huge page) |
//! | 8 / 9 | Accessed / Dirty (hardware A/D, when enabled) |
//! | 11    | MMU-present (software: entry maps something; frozen entries do not) |
//! | 51:12 | host address of the page or child table |
//! | 52    | A/D disabled for this leaf (access tracking by clearing RWX) |
//! | 54/56 | saved R / X while access-tracked (W is never saved; it comes back through the fast path) |
//! | 57    | host-writable (memslot and host mapping allow writes) |
//! | 58    | MMU-writable (W may be set without the slow path) |

use super::{bytes_per_entry, Access, LeafPerms, Level, PteFormat};
use bitflags::bitflags;
use slat_addr::Hva;

bitflags! {
    /// Bits of an EPT entry (the address field excluded).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct EptBits: u64 {
        /// Readable.
        const R = 1 << 0;
        /// Writable.
        const W = 1 << 1;
        /// Executable.
        const X = 1 << 2;
        /// Write-back memory type (6 in bits 5:3).
        const MEMTYPE_WB = 6 << 3;
        /// Leaf above level 1.
        const LARGE = 1 << 7;
        /// Hardware Accessed.
        const A = 1 << 8;
        /// Hardware Dirty.
        const D = 1 << 9;
        /// Software: the entry maps something.
        const MMU_PRESENT = 1 << 11;
        /// Software: A/D bits not in use for this leaf.
        const AD_DISABLED = 1 << 52;
        /// Software: saved R while access-tracked.
        const SAVED_R = 1 << 54;
        /// Software: saved X while access-tracked.
        const SAVED_X = 1 << 56;
        /// Software: host mapping writable.
        const HOST_WRITABLE = 1 << 57;
        /// Software: MMU allows W.
        const MMU_WRITABLE = 1 << 58;
    }
}

/// Host-address field (bits 51:12).
pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const RWX: u64 = EptBits::R.bits() | EptBits::W.bits() | EptBits::X.bits();

/// The x86 EPT format: 4 levels, 4 KiB / 2 MiB / 1 GiB leaves, 48-bit guest physical addresses.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ept;

// SAFETY: the encoding round-trips addresses and classifies entries exactly; the unit tests
// below check each transform against the architecture's layout.
unsafe impl PteFormat for Ept {
    const NAME: &'static str = "x86-ept";
    const ROOT_LEVEL: Level = 4;
    const MAX_LEAF_LEVEL: Level = 3;
    const MAX_PHYS_BITS: u32 = 48;
    const NON_PRESENT: u64 = 0;
    // No RWX (hardware faults on it), no MMU-present (software treats it as busy), no A/D
    // (nothing propagates from it); bit 10 is otherwise unused, which makes it easy to spot.
    const FROZEN: u64 = 0x410;
    const BREAK_BEFORE_MAKE: bool = false;
    const CACHE_MAINTENANCE: bool = false;
    const HARDWARE_DIRTY: bool = true;
    type Clock = crate::clock::RealTime;
    type Inner = Self;

    #[inline]
    fn is_present(pte: u64) -> bool {
        pte & EptBits::MMU_PRESENT.bits() != 0
    }

    #[inline]
    fn is_leaf(pte: u64, level: Level) -> bool {
        level == 1 || pte & EptBits::LARGE.bits() != 0
    }

    #[inline]
    fn output_addr(pte: u64) -> Hva {
        Hva::new(pte & ADDR_MASK)
    }

    #[inline]
    fn make_table(child: Hva) -> u64 {
        let child = child.raw();
        debug_assert_eq!(child & !ADDR_MASK, 0, "table page not 4 KiB aligned");
        child | RWX | EptBits::MMU_PRESENT.bits()
    }

    #[inline]
    fn make_leaf(addr: Hva, level: Level, perms: LeafPerms) -> u64 {
        let addr = addr.raw();
        debug_assert_eq!(addr % bytes_per_entry(level), 0, "leaf address misaligned");
        debug_assert!(
            !perms.writable || perms.host_writable,
            "W without host-writable"
        );
        let mut b = EptBits::MMU_PRESENT | EptBits::R | EptBits::MEMTYPE_WB;
        if level > 1 {
            b |= EptBits::LARGE;
        }
        if perms.exec {
            b |= EptBits::X;
        }
        if perms.host_writable {
            b |= EptBits::HOST_WRITABLE;
        }
        if perms.writable {
            b |= EptBits::W | EptBits::MMU_WRITABLE;
        }
        if perms.ad_bits {
            // The fault is an access: pre-set A (and D for a writable leaf), as KVM's make_spte
            // does, so the hardware walker does not have to set them right away.
            b |= EptBits::A;
            if perms.writable {
                b |= EptBits::D;
            }
        } else {
            b |= EptBits::AD_DISABLED;
        }
        addr | b.bits()
    }

    #[inline]
    fn is_writable(pte: u64) -> bool {
        pte & EptBits::W.bits() != 0
    }

    #[inline]
    fn is_mmu_writable(pte: u64) -> bool {
        pte & EptBits::MMU_WRITABLE.bits() != 0
    }

    #[inline]
    fn is_host_writable(pte: u64) -> bool {
        pte & EptBits::HOST_WRITABLE.bits() != 0
    }

    #[inline]
    fn write_protect(pte: u64) -> u64 {
        pte & !EptBits::W.bits()
    }

    #[inline]
    fn make_writable(pte: u64) -> u64 {
        debug_assert!(Self::is_mmu_writable(pte));
        let mut v = pte | EptBits::W.bits();
        if Self::ad_enabled(pte) {
            v |= EptBits::D.bits();
        }
        v
    }

    #[inline]
    fn ad_enabled(pte: u64) -> bool {
        pte & EptBits::AD_DISABLED.bits() == 0
    }

    #[inline]
    fn is_accessed(pte: u64) -> bool {
        if Self::ad_enabled(pte) {
            pte & EptBits::A.bits() != 0
        } else {
            !Self::is_access_tracked(pte)
        }
    }

    #[inline]
    fn mark_access_tracked(pte: u64) -> u64 {
        if Self::ad_enabled(pte) {
            return pte & !EptBits::A.bits();
        }
        if Self::is_access_tracked(pte) {
            return pte;
        }
        let mut v = pte & !RWX;
        if pte & EptBits::R.bits() != 0 {
            v |= EptBits::SAVED_R.bits();
        }
        if pte & EptBits::X.bits() != 0 {
            v |= EptBits::SAVED_X.bits();
        }
        v
    }

    #[inline]
    fn is_access_tracked(pte: u64) -> bool {
        !Self::ad_enabled(pte) && Self::is_present(pte) && pte & RWX == 0
    }

    #[inline]
    fn restore_access_tracked(pte: u64) -> u64 {
        let mut v = pte & !(EptBits::SAVED_R.bits() | EptBits::SAVED_X.bits());
        if pte & EptBits::SAVED_R.bits() != 0 {
            v |= EptBits::R.bits();
        }
        if pte & EptBits::SAVED_X.bits() != 0 {
            v |= EptBits::X.bits();
        }
        v
    }

    #[inline]
    fn set_accessed_dirty(pte: u64, access: Access) -> u64 {
        if !Self::ad_enabled(pte) {
            return pte;
        }
        let mut v = pte | EptBits::A.bits();
        if access == Access::Write {
            v |= EptBits::D.bits();
        }
        v
    }

    #[inline]
    fn is_dirty(pte: u64) -> bool {
        !Self::ad_enabled(pte) || pte & EptBits::D.bits() != 0
    }

    #[inline]
    fn clear_dirty(pte: u64) -> u64 {
        if Self::ad_enabled(pte) {
            pte & !EptBits::D.bits()
        } else {
            pte
        }
    }

    #[inline]
    fn needs_atomic_update(pte: u64, level: Level) -> bool {
        if !Self::is_present(pte) || !Self::is_leaf(pte, level) {
            // Tables and empty entries change only under the MMU lock (hardware sets no A/D on
            // table entries in this model, and the fast path never touches them).
            return false;
        }
        if Self::is_access_tracked(pte) || (Self::is_mmu_writable(pte) && !Self::is_writable(pte)) {
            return true; // the fast path may restore access or W
        }
        // Hardware sets A on any access and D on a write through W.
        Self::ad_enabled(pte)
            && (pte & EptBits::A.bits() == 0
                || (Self::is_writable(pte) && pte & EptBits::D.bits() == 0))
    }

    #[inline]
    fn permits(pte: u64, access: Access) -> bool {
        let need = match access {
            Access::Read => EptBits::R.bits(),
            Access::Write => EptBits::R.bits() | EptBits::W.bits(),
            Access::Exec => EptBits::X.bits(),
        };
        pte & need == need
    }

    #[inline]
    fn hw_is_table(pte: u64, level: Level) -> bool {
        level > 1 && pte & RWX != 0 && pte & EptBits::LARGE.bits() == 0
    }

    #[inline]
    fn split_child(huge: u64, level: Level, index: usize) -> u64 {
        debug_assert!(level > 1 && Self::is_leaf(huge, level));
        let child_level = level - 1;
        let addr = Self::output_addr(huge).raw() + index as u64 * bytes_per_entry(child_level);
        let mut flags = huge & !ADDR_MASK;
        if child_level == 1 {
            flags &= !EptBits::LARGE.bits();
        }
        addr | flags
    }

    #[inline]
    fn make_huge(child: u64, level: Level) -> u64 {
        debug_assert!(level > 1);
        let addr = Self::output_addr(child).raw() & !(bytes_per_entry(level) - 1);
        addr | (child & !ADDR_MASK) | EptBits::LARGE.bits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: u64 = 0x7f12_3450_0000;

    fn rw(ad: bool) -> LeafPerms {
        LeafPerms {
            host_writable: true,
            writable: true,
            exec: false,
            ad_bits: ad,
        }
    }

    #[test]
    fn leaf_and_table_encodings_are_distinct() {
        let leaf = Ept::make_leaf(Hva::new(HOST), 1, rw(true));
        assert!(Ept::is_present(leaf) && Ept::is_leaf(leaf, 1));
        assert_eq!(Ept::output_addr(leaf), Hva::new(HOST));
        let table = Ept::make_table(Hva::new(0x1000_0000));
        assert!(Ept::is_present(table) && !Ept::is_leaf(table, 2));
        assert!(Ept::hw_is_table(table, 2));
        let huge = Ept::make_leaf(Hva::new(HOST & !0x1f_ffff), 2, rw(true));
        assert!(Ept::is_leaf(huge, 2) && !Ept::hw_is_table(huge, 2));
    }

    #[test]
    fn sentinels_are_not_present_to_anyone() {
        for v in [Ept::NON_PRESENT, Ept::FROZEN] {
            assert!(!Ept::is_present(v));
            for a in [Access::Read, Access::Write, Access::Exec] {
                assert!(!Ept::permits(v, a));
            }
            assert!(!Ept::hw_is_table(v, 2));
        }
        assert_ne!(Ept::FROZEN, Ept::NON_PRESENT);
    }

    #[test]
    fn write_protection_keeps_mmu_writable_and_fast_path_restores() {
        let leaf = Ept::make_leaf(Hva::new(HOST), 1, rw(false));
        let wp = Ept::write_protect(leaf);
        assert!(!Ept::is_writable(wp) && Ept::is_mmu_writable(wp) && Ept::is_host_writable(wp));
        assert!(Ept::permits(wp, Access::Read) && !Ept::permits(wp, Access::Write));
        assert_eq!(Ept::make_writable(wp), leaf);
    }

    #[test]
    fn readonly_leaf_has_no_writable_bits() {
        let ro = Ept::make_leaf(Hva::new(HOST), 1, LeafPerms::default());
        assert!(!Ept::is_writable(ro) && !Ept::is_mmu_writable(ro) && !Ept::is_host_writable(ro));
    }

    #[test]
    fn access_tracking_round_trips_without_ad_bits() {
        let mut p = rw(false);
        p.exec = true;
        let leaf = Ept::make_leaf(Hva::new(HOST), 1, p);
        assert!(Ept::is_accessed(leaf));
        let t = Ept::mark_access_tracked(leaf);
        assert!(Ept::is_access_tracked(t) && !Ept::is_accessed(t) && Ept::is_present(t));
        assert!(!Ept::permits(t, Access::Read));
        // W is not saved: the restore gives R|X back and the fast path re-adds W.
        let r = Ept::restore_access_tracked(t);
        assert!(Ept::permits(r, Access::Read) && Ept::permits(r, Access::Exec));
        assert!(!Ept::is_writable(r) && Ept::is_mmu_writable(r));
        assert_eq!(Ept::make_writable(r), leaf);
    }

    #[test]
    fn access_tracking_with_ad_bits_clears_accessed_only() {
        let leaf = Ept::make_leaf(Hva::new(HOST), 1, rw(true));
        let t = Ept::mark_access_tracked(leaf);
        assert!(!Ept::is_accessed(t) && Ept::permits(t, Access::Write));
        assert!(Ept::is_accessed(Ept::set_accessed_dirty(t, Access::Read)));
    }

    #[test]
    fn only_entries_others_may_change_need_atomic_updates() {
        let dirty = Ept::make_leaf(Hva::new(HOST), 1, rw(true));
        assert!(Ept::is_dirty(dirty));
        // Accessed, dirty, writable: neither hardware nor the fast path will touch it.
        assert!(!Ept::needs_atomic_update(dirty, 1));
        // Write-protected for logging: the fast path may set W.
        assert!(Ept::needs_atomic_update(Ept::write_protect(dirty), 1));
        // Writable and clean: hardware sets D on the next write.
        let clean = Ept::clear_dirty(dirty);
        assert!(!Ept::is_dirty(clean) && Ept::needs_atomic_update(clean, 1));
        // Not accessed: hardware sets A.
        assert!(Ept::needs_atomic_update(Ept::mark_access_tracked(dirty), 1));
        // A/D disabled: only access tracking and write protection are volatile.
        let noad = Ept::make_leaf(Hva::new(HOST), 1, rw(false));
        assert!(Ept::is_dirty(noad) && !Ept::needs_atomic_update(noad, 1));
        assert_eq!(Ept::clear_dirty(noad), noad);
        assert!(Ept::needs_atomic_update(Ept::mark_access_tracked(noad), 1));
        assert!(!Ept::needs_atomic_update(
            Ept::make_table(Hva::new(0x1000_0000)),
            2
        ));
        assert!(!Ept::needs_atomic_update(Ept::NON_PRESENT, 1));
        assert!(!Ept::needs_atomic_update(Ept::FROZEN, 1));
    }

    #[test]
    fn split_then_make_huge_round_trips() {
        for level in [2u8, 3] {
            let base = HOST & !(bytes_per_entry(level) - 1);
            let huge = Ept::make_leaf(Hva::new(base), level, rw(true));
            for i in [0usize, 1, 511] {
                let c = Ept::split_child(huge, level, i);
                assert!(Ept::is_leaf(c, level - 1));
                assert_eq!(
                    Ept::output_addr(c),
                    Hva::new(base + i as u64 * bytes_per_entry(level - 1))
                );
                assert_eq!(Ept::make_huge(c, level), huge);
            }
        }
    }
}
