//! A format with a different clock: the same encoding, reported to another [`Clock`].

use core::marker::PhantomData;

use slat_addr::Hva;

use super::{Access, LeafPerms, Level, PteFormat};
use crate::clock::Clock;

/// Format `F`'s encoding with clock `C`: `Machine<Timed<Ept, Virtual>>` runs the x86 engine in
/// virtual time. Every item delegates to `F`, so the encoding, the walk and the invariants are
/// `F`'s own; only [`PteFormat::Clock`] differs (docs/design/virtual-time.md §1).
pub struct Timed<F, C>(PhantomData<fn() -> (F, C)>);

impl<F, C> core::fmt::Debug for Timed<F, C> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Timed")
    }
}

// SAFETY: every function and constant is `F`'s, so `F`'s exactness carries over unchanged.
unsafe impl<F: PteFormat, C: Clock> PteFormat for Timed<F, C> {
    const NAME: &'static str = F::NAME;
    const ROOT_LEVEL: Level = F::ROOT_LEVEL;
    const MAX_LEAF_LEVEL: Level = F::MAX_LEAF_LEVEL;
    const MAX_PHYS_BITS: u32 = F::MAX_PHYS_BITS;
    const NON_PRESENT: u64 = F::NON_PRESENT;
    const FROZEN: u64 = F::FROZEN;
    const BREAK_BEFORE_MAKE: bool = F::BREAK_BEFORE_MAKE;
    const CACHE_MAINTENANCE: bool = F::CACHE_MAINTENANCE;
    const HARDWARE_DIRTY: bool = F::HARDWARE_DIRTY;
    type Clock = C;
    type Inner = F::Inner;

    #[inline(always)]
    fn is_present(pte: u64) -> bool {
        F::is_present(pte)
    }
    #[inline(always)]
    fn is_leaf(pte: u64, level: Level) -> bool {
        F::is_leaf(pte, level)
    }
    #[inline(always)]
    fn output_addr(pte: u64) -> Hva {
        F::output_addr(pte)
    }
    #[inline(always)]
    fn make_table(child: Hva) -> u64 {
        F::make_table(child)
    }
    #[inline(always)]
    fn make_leaf(addr: Hva, level: Level, perms: LeafPerms) -> u64 {
        F::make_leaf(addr, level, perms)
    }
    #[inline(always)]
    fn is_writable(pte: u64) -> bool {
        F::is_writable(pte)
    }
    #[inline(always)]
    fn is_mmu_writable(pte: u64) -> bool {
        F::is_mmu_writable(pte)
    }
    #[inline(always)]
    fn is_host_writable(pte: u64) -> bool {
        F::is_host_writable(pte)
    }
    #[inline(always)]
    fn write_protect(pte: u64) -> u64 {
        F::write_protect(pte)
    }
    #[inline(always)]
    fn make_writable(pte: u64) -> u64 {
        F::make_writable(pte)
    }
    #[inline(always)]
    fn ad_enabled(pte: u64) -> bool {
        F::ad_enabled(pte)
    }
    #[inline(always)]
    fn is_accessed(pte: u64) -> bool {
        F::is_accessed(pte)
    }
    #[inline(always)]
    fn mark_access_tracked(pte: u64) -> u64 {
        F::mark_access_tracked(pte)
    }
    #[inline(always)]
    fn is_access_tracked(pte: u64) -> bool {
        F::is_access_tracked(pte)
    }
    #[inline(always)]
    fn restore_access_tracked(pte: u64) -> u64 {
        F::restore_access_tracked(pte)
    }
    #[inline(always)]
    fn set_accessed_dirty(pte: u64, access: Access) -> u64 {
        F::set_accessed_dirty(pte, access)
    }
    #[inline(always)]
    fn is_dirty(pte: u64) -> bool {
        F::is_dirty(pte)
    }
    #[inline(always)]
    fn clear_dirty(pte: u64) -> u64 {
        F::clear_dirty(pte)
    }
    #[inline(always)]
    fn needs_atomic_update(pte: u64, level: Level) -> bool {
        F::needs_atomic_update(pte, level)
    }
    #[inline(always)]
    fn permits(pte: u64, access: Access) -> bool {
        F::permits(pte, access)
    }
    #[inline(always)]
    fn hw_is_table(pte: u64, level: Level) -> bool {
        F::hw_is_table(pte, level)
    }
    #[inline(always)]
    fn split_child(huge: u64, level: Level, index: usize) -> u64 {
        F::split_child(huge, level, index)
    }
    #[inline(always)]
    fn make_huge(child: u64, level: Level) -> u64 {
        F::make_huge(child, level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::RealTime;
    use crate::format::{Ept, Stage2};

    fn same_encoding<F: PteFormat>() {
        type T<F> = Timed<F, RealTime>;
        let perms = LeafPerms {
            host_writable: true,
            writable: true,
            exec: false,
            ad_bits: true,
        };
        let leaf = F::make_leaf(Hva::new(0x20_0000), 2, perms);
        assert_eq!(T::<F>::make_leaf(Hva::new(0x20_0000), 2, perms), leaf);
        assert_eq!(T::<F>::write_protect(leaf), F::write_protect(leaf));
        assert_eq!(T::<F>::split_child(leaf, 2, 3), F::split_child(leaf, 2, 3));
        assert_eq!(T::<F>::NAME, F::NAME);
        assert_eq!(
            core::any::TypeId::of::<<T<F> as PteFormat>::Inner>(),
            core::any::TypeId::of::<F>()
        );
    }

    #[test]
    fn timed_delegates_every_item() {
        same_encoding::<Ept>();
        same_encoding::<Stage2>();
    }
}
