//! Arm64 stage-2 descriptors (VMSAv8-64, 4 KiB granule, 48-bit IPA, start level 0), with the
//! software bits the engine keeps in them.
//!
//! | bits  | meaning |
//! |-------|---------|
//! | 0     | valid |
//! | 1     | type: 1 = table (levels 0–2) or page (level 3); 0 = block (levels 1–2) |
//! | 5:2   | MemAttr (0b1111: normal, inner/outer write-back) |
//! | 6 / 7 | S2AP read / write |
//! | 9:8   | SH (0b11: inner shareable) |
//! | 10    | AF, the access flag |
//! | 47:12 | output address (page, block or next-level table) |
//! | 54    | XN, execute never |
//! | 55    | software: host-writable (memslot and host mapping allow writes) |
//! | 56    | software: MMU-writable (S2AP W may be set without the slow path) |
//! | 57    | software: hardware updates AF for this leaf (FEAT_HAFDBS with VTCR_EL2.HA) |
//!
//! Arm numbers levels from the root down (0–3, 3 holds pages); the engine numbers them from the
//! leaves up (1–4, KVM x86 style), so engine level `l` is Arm level `4 - l`.
//!
//! What differs from EPT and why the engine cares:
//! - There is no hardware dirty bit (DBM is not used, as in upstream KVM), so dirty logging is
//!   always by write protection, and [`PteFormat::HARDWARE_DIRTY`] is false.
//! - Without hardware AF updates, a leaf with AF clear takes an access-flag fault on any access;
//!   that is how access tracking works here (no permissions are parked in software bits), and the
//!   fault is fixed by setting AF (KVM's `relax_perms(PROT_AF)`).
//! - Changing a valid entry's output address or size needs break-before-make
//!   ([`PteFormat::BREAK_BEFORE_MAKE`]): the entry goes through the invalid [`Stage2::FROZEN`]
//!   value (KVM's `KVM_INVALID_PTE_LOCKED`) and a TLB invalidation before the new value.
//! - New mappings need data-cache maintenance ([`PteFormat::CACHE_MAINTENANCE`]): a guest
//!   running with its caches off must see what the host wrote through its cacheable alias.

use super::{bytes_per_entry, Access, LeafPerms, Level, PteFormat};
use bitflags::bitflags;
use slat_addr::Hva;

bitflags! {
    /// Bits of a stage-2 descriptor (the output-address field excluded).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Stage2Bits: u64 {
        /// Valid descriptor.
        const VALID = 1 << 0;
        /// Table (levels 0–2) or page (level 3); clear for a block.
        const TYPE = 1 << 1;
        /// MemAttr = normal memory, write-back cacheable (0b1111 in bits 5:2).
        const MEMATTR_NORMAL = 0xf << 2;
        /// S2AP: reads allowed.
        const S2AP_R = 1 << 6;
        /// S2AP: writes allowed.
        const S2AP_W = 1 << 7;
        /// Inner shareable (0b11 in bits 9:8).
        const SH_INNER = 3 << 8;
        /// Access flag.
        const AF = 1 << 10;
        /// Execute never.
        const XN = 1 << 54;
        /// Software (SW0): host mapping writable.
        const HOST_WRITABLE = 1 << 55;
        /// Software (SW1): the MMU allows S2AP W.
        const MMU_WRITABLE = 1 << 56;
        /// Software (SW2): hardware sets AF on access for this leaf.
        const HW_AF = 1 << 57;
    }
}

/// Output-address field (bits 47:12).
pub const ADDR_MASK: u64 = 0x0000_ffff_ffff_f000;

const VALID: u64 = Stage2Bits::VALID.bits();
const TYPE: u64 = Stage2Bits::TYPE.bits();
const AF: u64 = Stage2Bits::AF.bits();

/// The arm64 stage-2 format: 4 levels, 4 KiB pages, 2 MiB and 1 GiB blocks, 48-bit IPAs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stage2;

// SAFETY: the encoding round-trips addresses and classifies entries exactly; the unit tests
// below check each transform against the architecture's layout.
unsafe impl PteFormat for Stage2 {
    const NAME: &'static str = "arm64-stage2";
    const ROOT_LEVEL: Level = 4;
    const MAX_LEAF_LEVEL: Level = 3;
    const MAX_PHYS_BITS: u32 = 48;
    const NON_PRESENT: u64 = 0;
    // KVM_INVALID_PTE_LOCKED: invalid (bit 0 clear), so hardware faults on it, with bit 10 set
    // so software can tell it from an empty entry.
    const FROZEN: u64 = 1 << 10;
    const BREAK_BEFORE_MAKE: bool = true;
    const CACHE_MAINTENANCE: bool = true;
    const HARDWARE_DIRTY: bool = false;
    type Clock = crate::clock::RealTime;
    type Inner = Self;

    #[inline]
    fn is_present(pte: u64) -> bool {
        pte & VALID != 0
    }

    #[inline]
    fn is_leaf(pte: u64, level: Level) -> bool {
        level == 1 || pte & TYPE == 0
    }

    #[inline]
    fn output_addr(pte: u64) -> Hva {
        Hva::new(pte & ADDR_MASK)
    }

    #[inline]
    fn make_table(child: Hva) -> u64 {
        let child = child.raw();
        debug_assert_eq!(child & !ADDR_MASK, 0, "table page not 4 KiB aligned");
        child | VALID | TYPE
    }

    #[inline]
    fn make_leaf(addr: Hva, level: Level, perms: LeafPerms) -> u64 {
        let addr = addr.raw();
        debug_assert_eq!(addr % bytes_per_entry(level), 0, "leaf address misaligned");
        debug_assert_eq!(addr & !ADDR_MASK, 0, "leaf address outside the OA field");
        debug_assert!(
            !perms.writable || perms.host_writable,
            "W without host-writable"
        );
        // AF is set at map time, as KVM's stage2_set_prot_attr does: the fault is an access.
        let mut b = Stage2Bits::VALID
            | Stage2Bits::MEMATTR_NORMAL
            | Stage2Bits::SH_INNER
            | Stage2Bits::AF
            | Stage2Bits::S2AP_R;
        if level == 1 {
            b |= Stage2Bits::TYPE; // a page descriptor at Arm level 3
        }
        if !perms.exec {
            b |= Stage2Bits::XN;
        }
        if perms.host_writable {
            b |= Stage2Bits::HOST_WRITABLE;
        }
        if perms.writable {
            b |= Stage2Bits::S2AP_W | Stage2Bits::MMU_WRITABLE;
        }
        if perms.ad_bits {
            b |= Stage2Bits::HW_AF;
        }
        addr | b.bits()
    }

    #[inline]
    fn is_writable(pte: u64) -> bool {
        pte & Stage2Bits::S2AP_W.bits() != 0
    }

    #[inline]
    fn is_mmu_writable(pte: u64) -> bool {
        pte & Stage2Bits::MMU_WRITABLE.bits() != 0
    }

    #[inline]
    fn is_host_writable(pte: u64) -> bool {
        pte & Stage2Bits::HOST_WRITABLE.bits() != 0
    }

    #[inline]
    fn write_protect(pte: u64) -> u64 {
        pte & !Stage2Bits::S2AP_W.bits()
    }

    #[inline]
    fn make_writable(pte: u64) -> u64 {
        debug_assert!(Self::is_mmu_writable(pte));
        pte | Stage2Bits::S2AP_W.bits()
    }

    #[inline]
    fn ad_enabled(pte: u64) -> bool {
        pte & Stage2Bits::HW_AF.bits() != 0
    }

    #[inline]
    fn is_accessed(pte: u64) -> bool {
        pte & AF != 0
    }

    #[inline]
    fn mark_access_tracked(pte: u64) -> u64 {
        // Both modes clear AF: with hardware AF updates the next access sets it again, without
        // them the next access takes an access-flag fault.
        pte & !AF
    }

    #[inline]
    fn is_access_tracked(pte: u64) -> bool {
        Self::is_present(pte) && !Self::ad_enabled(pte) && pte & AF == 0
    }

    #[inline]
    fn restore_access_tracked(pte: u64) -> u64 {
        pte | AF
    }

    #[inline]
    fn set_accessed_dirty(pte: u64, _access: Access) -> u64 {
        if Self::ad_enabled(pte) {
            pte | AF
        } else {
            pte
        }
    }

    #[inline]
    fn is_dirty(_pte: u64) -> bool {
        // No dirty bit: every writable leaf may have been written.
        true
    }

    #[inline]
    fn clear_dirty(pte: u64) -> u64 {
        pte
    }

    #[inline]
    fn needs_atomic_update(pte: u64, level: Level) -> bool {
        if !Self::is_present(pte) || !Self::is_leaf(pte, level) {
            // Tables, empty and locked entries change only under the MMU lock (a locked entry
            // only while its owner holds the lock for read, which excludes exclusive holders).
            return false;
        }
        if Self::is_access_tracked(pte) || (Self::is_mmu_writable(pte) && !Self::is_writable(pte)) {
            return true; // the fast path may set AF or S2AP W
        }
        // Hardware sets AF on access when HA is on.
        Self::ad_enabled(pte) && pte & AF == 0
    }

    #[inline]
    fn permits(pte: u64, access: Access) -> bool {
        if pte & VALID == 0 || (pte & AF == 0 && !Self::ad_enabled(pte)) {
            return false; // translation fault, or access-flag fault
        }
        match access {
            Access::Read => pte & Stage2Bits::S2AP_R.bits() != 0,
            Access::Write => pte & Stage2Bits::S2AP_W.bits() != 0,
            Access::Exec => {
                pte & Stage2Bits::S2AP_R.bits() != 0 && pte & Stage2Bits::XN.bits() == 0
            }
        }
    }

    #[inline]
    fn hw_is_table(pte: u64, level: Level) -> bool {
        level > 1 && pte & (VALID | TYPE) == VALID | TYPE
    }

    #[inline]
    fn split_child(huge: u64, level: Level, index: usize) -> u64 {
        debug_assert!(level > 1 && Self::is_leaf(huge, level));
        let child_level = level - 1;
        let addr = Self::output_addr(huge).raw() + index as u64 * bytes_per_entry(child_level);
        let mut flags = huge & !ADDR_MASK;
        if child_level == 1 {
            flags |= TYPE; // blocks become pages at Arm level 3
        }
        addr | flags
    }

    #[inline]
    fn make_huge(child: u64, level: Level) -> u64 {
        debug_assert!(level > 1);
        let addr = Self::output_addr(child).raw() & !(bytes_per_entry(level) - 1);
        addr | (child & !ADDR_MASK & !TYPE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST_1G: u64 = 0x7f00_4000_0000;

    fn perms(writable: bool, exec: bool, ad: bool) -> LeafPerms {
        LeafPerms {
            host_writable: true,
            writable,
            exec,
            ad_bits: ad,
        }
    }

    // The expected values below are written from the Arm ARM's stage-2 descriptor layout
    // (D8.3 in DDI 0487), not from the bitflags above, so a wrong constant fails here.
    const ARM_VALID: u64 = 0b1;
    const ARM_TABLE_OR_PAGE: u64 = 0b10;
    const ARM_MEMATTR_NORMAL_WB: u64 = 0b1111 << 2;
    const ARM_S2AP_RO: u64 = 0b01 << 6;
    const ARM_S2AP_RW: u64 = 0b11 << 6;
    const ARM_SH_INNER: u64 = 0b11 << 8;
    const ARM_AF: u64 = 1 << 10;
    const ARM_XN: u64 = 1 << 54;

    #[test]
    fn page_descriptor_matches_the_architecture() {
        let addr = HOST_1G + 0x5000;
        let pte = Stage2::make_leaf(Hva::new(addr), 1, perms(true, false, false));
        let arch = addr
            | ARM_VALID
            | ARM_TABLE_OR_PAGE
            | ARM_MEMATTR_NORMAL_WB
            | ARM_S2AP_RW
            | ARM_SH_INNER
            | ARM_AF
            | ARM_XN;
        // Only software bits (58:55) may differ from the architectural encoding.
        assert_eq!(pte & !(0xf << 55), arch);
        assert_eq!(Stage2::output_addr(pte), Hva::new(addr));
        assert!(Stage2::is_leaf(pte, 1) && !Stage2::hw_is_table(pte, 1));
    }

    #[test]
    fn block_descriptors_have_type_clear() {
        for level in [2u8, 3] {
            let addr = HOST_1G; // 1 GiB aligned, so 2 MiB aligned too
            let pte = Stage2::make_leaf(Hva::new(addr), level, perms(false, true, true));
            let arch =
                addr | ARM_VALID | ARM_MEMATTR_NORMAL_WB | ARM_S2AP_RO | ARM_SH_INNER | ARM_AF;
            assert_eq!(pte & !(0xf << 55), arch, "level {level}");
            assert!(Stage2::is_leaf(pte, level) && !Stage2::hw_is_table(pte, level));
        }
    }

    #[test]
    fn table_descriptor_matches_the_architecture() {
        let child = 0x1234_5000;
        let t = Stage2::make_table(Hva::new(child));
        assert_eq!(t, child | ARM_VALID | ARM_TABLE_OR_PAGE);
        for level in 2..=4u8 {
            assert!(Stage2::hw_is_table(t, level) && !Stage2::is_leaf(t, level));
        }
        assert_eq!(Stage2::output_addr(t), Hva::new(child));
    }

    #[test]
    fn locked_and_empty_entries_fault_and_are_not_present() {
        assert_eq!(Stage2::FROZEN, 1 << 10, "KVM_INVALID_PTE_LOCKED");
        for v in [Stage2::NON_PRESENT, Stage2::FROZEN] {
            assert!(!Stage2::is_present(v));
            for a in [Access::Read, Access::Write, Access::Exec] {
                assert!(!Stage2::permits(v, a));
            }
            for level in 1..=4u8 {
                assert!(!Stage2::hw_is_table(v, level));
            }
            assert!(!Stage2::needs_atomic_update(v, 1));
        }
    }

    #[test]
    fn s2ap_and_xn_decide_permissions() {
        let ro = Stage2::make_leaf(Hva::new(HOST_1G), 1, perms(false, false, false));
        assert!(Stage2::permits(ro, Access::Read));
        assert!(!Stage2::permits(ro, Access::Write) && !Stage2::permits(ro, Access::Exec));
        let rwx = Stage2::make_leaf(Hva::new(HOST_1G), 1, perms(true, true, false));
        for a in [Access::Read, Access::Write, Access::Exec] {
            assert!(Stage2::permits(rwx, a));
        }
    }

    #[test]
    fn write_protection_is_permission_only() {
        let leaf = Stage2::make_leaf(Hva::new(HOST_1G), 1, perms(true, false, true));
        let wp = Stage2::write_protect(leaf);
        assert_eq!(leaf ^ wp, 1 << 7, "only S2AP W changes");
        assert!(Stage2::is_mmu_writable(wp) && Stage2::is_host_writable(wp));
        assert!(
            Stage2::needs_atomic_update(wp, 1),
            "the fast path may relax it"
        );
        assert_eq!(Stage2::make_writable(wp), leaf);
        let ro = Stage2::make_leaf(Hva::new(HOST_1G), 1, LeafPerms::default());
        assert!(!Stage2::is_mmu_writable(ro) && !Stage2::is_host_writable(ro));
    }

    #[test]
    fn access_flag_tracking_with_and_without_hardware_updates() {
        // Without HA: AF clear is an access-flag fault until the fast path sets it.
        let leaf = Stage2::make_leaf(Hva::new(HOST_1G), 1, perms(true, false, false));
        assert!(Stage2::is_accessed(leaf));
        let old = Stage2::mark_access_tracked(leaf);
        assert_eq!(leaf ^ old, 1 << 10);
        assert!(Stage2::is_access_tracked(old) && !Stage2::is_accessed(old));
        assert!(Stage2::is_present(old) && !Stage2::permits(old, Access::Read));
        assert_eq!(Stage2::set_accessed_dirty(old, Access::Read), old);
        assert_eq!(Stage2::restore_access_tracked(old), leaf);
        // With HA: hardware sets AF; no fault, no fast path.
        let leaf = Stage2::make_leaf(Hva::new(HOST_1G), 1, perms(true, false, true));
        let old = Stage2::mark_access_tracked(leaf);
        assert!(!Stage2::is_access_tracked(old) && Stage2::permits(old, Access::Write));
        assert!(Stage2::needs_atomic_update(old, 1));
        assert_eq!(Stage2::set_accessed_dirty(old, Access::Write), leaf);
        assert!(!Stage2::needs_atomic_update(leaf, 1));
    }

    #[test]
    fn no_hardware_dirty_bit() {
        let leaf = Stage2::make_leaf(Hva::new(HOST_1G), 1, perms(true, false, true));
        assert!(Stage2::is_dirty(leaf) && Stage2::clear_dirty(leaf) == leaf);
        assert_eq!(Stage2::set_accessed_dirty(leaf, Access::Write), leaf);
    }

    #[test]
    fn split_then_make_huge_round_trips() {
        for level in [2u8, 3] {
            let huge = Stage2::make_leaf(Hva::new(HOST_1G), level, perms(true, false, true));
            for i in [0usize, 1, 511] {
                let c = Stage2::split_child(huge, level, i);
                assert!(Stage2::is_leaf(c, level - 1) && !Stage2::hw_is_table(c, level - 1));
                assert_eq!(
                    Stage2::output_addr(c),
                    Hva::new(HOST_1G + i as u64 * bytes_per_entry(level - 1))
                );
                // The child is exactly what mapping its address at its level would give.
                let direct = Stage2::make_leaf(
                    Hva::new(HOST_1G + i as u64 * bytes_per_entry(level - 1)),
                    level - 1,
                    perms(true, false, true),
                );
                assert_eq!(c, direct);
                assert_eq!(Stage2::make_huge(c, level), huge);
            }
        }
    }
}
