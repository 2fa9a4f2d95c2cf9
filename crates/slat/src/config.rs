//! A VM's runtime configuration ([`VmConfig`]) and the design variants it chooses between.
//!
//! Every variant enum has a command-line spelling: [`std::fmt::Display`] prints it and
//! [`std::str::FromStr`] parses it back (the same words the `slat` binary accepts, e.g.
//! `on-fault`, `install-first`, `d-bit`).

use std::fmt;
use std::str::FromStr;

/// A variant name that is not one of the spellings its enum accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{given}` (expected one of: {})", expected.join(", "))]
pub struct ParseVariantError {
    /// What was being parsed ("MMU lock", "recovery variant", ...).
    pub what: &'static str,
    /// The text given.
    pub given: String,
    /// The accepted spellings.
    pub expected: &'static [&'static str],
}

/// Declares a variant enum's spellings once: `name()`, `ALL`, `Display` and `FromStr` come
/// from the same table, so printing and parsing cannot drift apart.
macro_rules! spelled {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// Name used on the command line.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $ty {
            type Err = ParseVariantError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(ParseVariantError {
                        what: $what,
                        given: s.to_string(),
                        expected: &[$($name),+],
                    }),
                }
            }
        }
    };
}

/// Which lock serialises MMU operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MmuLockKind {
    /// Reader/writer lock: faults and range operations share it and update entries with
    /// compare-and-swap; zaps and harvest re-protection take it exclusively (KVM's TDP MMU).
    #[default]
    RwLock,
    /// One big mutex: every fault is exclusive (KVM's legacy MMU before parallel faults).
    Mutex,
}

spelled!(MmuLockKind, "MMU lock", { RwLock => "rwlock", Mutex => "mutex" });

/// How GET_DIRTY_LOG (without manual protection) snapshots and clears the bitmap.
///
/// `xchg` and `switch` read only the words the bitmap's summary levels name (slat's own:
/// O(dirty words)); `xchg-full` and `switch-full` do what KVM's loops do, over every word of
/// the slot's bitmap (O(slot)), so that the two KVM paths can be compared as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GetLogVariant {
    /// One atomic exchange per non-zero word, the words found through the summary levels.
    #[default]
    Xchg,
    /// Two bitmaps per slot: switch marks to the other one, wait for in-flight markers, then
    /// read and clear the old one without atomics (proposed upstream as "Use a new spinlock to
    /// avoid atomic operations in kvm_get_dirty_log_protect"), through the summary levels.
    Switch,
    /// KVM's `kvm_get_dirty_log_protect`: zero the second bitmap (a memset), then load every
    /// word of the bitmap and exchange each non-zero one with zero into the second bitmap.
    XchgFull,
    /// The bitmap switch as proposed upstream: switch, then load every word of the old bitmap
    /// and clear each non-zero one with a plain store (no memset, no atomics).
    SwitchFull,
}

spelled!(GetLogVariant, "GET_DIRTY_LOG variant", {
    Xchg => "xchg",
    Switch => "switch",
    XchgFull => "xchg-full",
    SwitchFull => "switch-full",
});

impl GetLogVariant {
    /// A slot keeps a second bitmap (the switch's other side, or the exchange's buffer).
    pub fn two_bitmaps(self) -> bool {
        self != GetLogVariant::Xchg
    }

    /// Marks go to the other bitmap at each GET.
    pub fn switches(self) -> bool {
        matches!(self, GetLogVariant::Switch | GetLogVariant::SwitchFull)
    }

    /// GET reads every word of the slot's bitmap, not only those the summary names.
    pub fn whole_slot(self) -> bool {
        matches!(self, GetLogVariant::XchgFull | GetLogVariant::SwitchFull)
    }
}

/// How huge mappings come back when logging stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoverVariant {
    /// Replace each table the backing allows with one huge leaf, in place (KVM 6.12+).
    #[default]
    InPlace,
    /// Zap the slot and let faults rebuild huge leaves (older KVM).
    Zap,
    /// Leave the tables; a fault that finds a table where the slot allows a huge leaf
    /// replaces the table with that leaf (KVM arm64: `stage2_map` coalesces on the next
    /// translation fault in the range, break-before-make, in the [`RebuildOrder`]).
    OnFault,
}

spelled!(RecoverVariant, "recovery variant", {
    InPlace => "inplace",
    Zap => "zap",
    OnFault => "on-fault",
});

/// How a logged slot learns that a page was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirtyTrack {
    /// Write-protect every page (W clear, MMU-writable kept): the first write after a harvest
    /// faults, and the lock-free fast path restores W and marks the page (KVM without PML).
    #[default]
    WriteProtect,
    /// Hardware dirty bits, PML-like: pages stay writable with D clear; the hardware walker
    /// sets D on the first write and logs the page to the engine in the same step
    /// ([`crate::Vcpu::log_hardware_dirty`]), so no write faults. Harvests clear D instead of
    /// W. Needs A/D bits (leaves without them fall back to write protection); not with dirty
    /// rings.
    HardwareDirty,
}

spelled!(DirtyTrack, "dirty tracking", {
    WriteProtect => "write-protect",
    HardwareDirty => "d-bit",
});

/// When the fault path performs cache maintenance for a new mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CmoPolicy {
    /// Every translation fault cleans the range it is about to map before doing anything
    /// else, even when another vCPU has already mapped it (KVM arm64 before its CMOs moved
    /// into the fault handlers: CMOs in `user_mem_abort`).
    Always,
    /// Only the fault that actually installs a new leaf cleans it, after locking the entry and
    /// before publishing it; concurrent faults on the same address find the entry locked or
    /// mapped and skip it (KVM arm64's "Move CMOs from user_mem_abort to the fault handlers":
    /// CMOs in the map path).
    #[default]
    OnInstall,
}

spelled!(CmoPolicy, "cache-maintenance policy", {
    Always => "always",
    OnInstall => "on-install",
});

/// In which order a table is replaced by a block when break-before-make applies (arm64): the
/// window in which other vCPUs fault on the locked entry is the difference (KVM arm64's "Install
/// the block entry before unmapping the page mappings").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RebuildOrder {
    /// Invalidate the table entry, flush, unmap and free the old sub-tables, then install the
    /// block (KVM arm64 before the patch): the entry stays invalid for the whole teardown.
    BreakFirst,
    /// Invalidate the table entry, flush, install the block, then unmap and free the old
    /// sub-tables (after the patch): the entry is invalid only across the flush.
    #[default]
    InstallFirst,
}

spelled!(RebuildOrder, "rebuild order", {
    BreakFirst => "break-first",
    InstallFirst => "install-first",
});

/// How harvests and enable-logging find the leaves they write-protect (the reverse-map variants
/// follow the lockless write-protect series).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WrprotVariant {
    /// The one walker from the root, under the MMU lock (exclusive for harvests, shared for
    /// enable-logging); no reverse map is kept (today's behaviour).
    #[default]
    Walk,
    /// Look pages up in the reverse map, under the same lock as `walk`: once per leaf table
    /// that holds dirty pages, the next pages of that table reached from it.
    Rmap,
    /// Look every dirty page up in the reverse map, under the same lock as `walk`: KVM's legacy
    /// MMU (`kvm_mmu_write_protect_pt_masked`: one rmap lookup per set bit), the locked side of
    /// the lock-free write-protect series, which does the same lookups without the lock. As
    /// that MMU's `mmu_spte_update`, it exchanges (a locked instruction) every writable leaf
    /// it changes under the lock, not only those a lock-free writer may change now.
    RmapEach,
    /// No MMU lock: epoch-pinned reverse-map lookups, the table header validated, W cleared
    /// with one compare-and-swap (huge leaves made read-only, not zapped), then the flush.
    RmapLockless,
}

spelled!(WrprotVariant, "write-protect variant", {
    Walk => "walk",
    Rmap => "rmap",
    RmapEach => "rmap-each",
    RmapLockless => "rmap-lockless",
});

impl WrprotVariant {
    /// The reverse map is kept (by the SPTE-update path).
    pub fn keeps_rmap(self) -> bool {
        self != WrprotVariant::Walk
    }
}

/// Runtime configuration of a VM (the design variants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmConfig {
    /// The MMU lock.
    pub mmu_lock: MmuLockKind,
    /// Fix write-protection and access-tracking faults without the MMU lock.
    pub fast_pf: bool,
    /// Hardware Accessed/Dirty bits in leaves (else access tracking clears permissions).
    pub ad_bits: bool,
    /// Split huge leaves when dirty logging is enabled (else lazily, at the first write fault).
    pub eager_split: bool,
    /// How GET_DIRTY_LOG snapshots the bitmap (without manual protection).
    pub get_log: GetLogVariant,
    /// How huge mappings come back when dirty logging stops.
    pub recover: RecoverVariant,
    /// How logged slots see writes: write protection, or hardware dirty bits (PML-like).
    pub dirty_track: DirtyTrack,
    /// When faults perform cache maintenance for new mappings (formats that need it).
    pub cmo: CmoPolicy,
    /// In which order a table is replaced by a block under break-before-make (formats that
    /// need it).
    pub rebuild: RebuildOrder,
    /// How write protection for dirty logging finds leaves (and whether a reverse map is kept).
    pub wrprot: WrprotVariant,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            mmu_lock: MmuLockKind::RwLock,
            fast_pf: true,
            ad_bits: true,
            eager_split: true,
            get_log: GetLogVariant::Xchg,
            recover: RecoverVariant::InPlace,
            dirty_track: DirtyTrack::WriteProtect,
            cmo: CmoPolicy::OnInstall,
            rebuild: RebuildOrder::InstallFirst,
            wrprot: WrprotVariant::Walk,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trips<T>(all: &[T])
    where
        T: Copy + fmt::Display + FromStr<Err = ParseVariantError> + PartialEq + fmt::Debug,
    {
        for &v in all {
            assert_eq!(v.to_string().parse::<T>(), Ok(v));
        }
        assert!("no-such-variant".parse::<T>().is_err());
    }

    #[test]
    fn every_variant_round_trips_through_its_cli_spelling() {
        round_trips(MmuLockKind::ALL);
        round_trips(GetLogVariant::ALL);
        round_trips(RecoverVariant::ALL);
        round_trips(DirtyTrack::ALL);
        round_trips(CmoPolicy::ALL);
        round_trips(RebuildOrder::ALL);
        round_trips(WrprotVariant::ALL);
    }

    #[test]
    fn spellings_are_the_ones_users_type() {
        assert_eq!("on-fault".parse(), Ok(RecoverVariant::OnFault));
        assert_eq!("install-first".parse(), Ok(RebuildOrder::InstallFirst));
        assert_eq!("d-bit".parse(), Ok(DirtyTrack::HardwareDirty));
        assert_eq!("on-install".parse(), Ok(CmoPolicy::OnInstall));
        assert_eq!("rwlock".parse(), Ok(MmuLockKind::RwLock));
        assert_eq!("xchg".parse(), Ok(GetLogVariant::Xchg));
        assert_eq!("rmap-lockless".parse(), Ok(WrprotVariant::RmapLockless));
    }
}

/// What the host kernel's direct map does when a pool page is given to a guest as private
/// memory (SNP; see `direct_map`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectMapPolicy {
    /// Start with the largest leaves (1 GiB / 2 MiB) and split on demand under the global
    /// lock, then remove the 4 KiB leaf (SNP today, the baseline upstream measured against).
    #[default]
    Split2M,
    /// Pre-split to 4 KiB at start; acceptance removes one 4 KiB leaf under the lock.
    Pre4K,
    /// Leave the direct map alone (TDX-style): acceptance only records the assignment.
    Untouched,
}

spelled!(DirectMapPolicy, "direct-map policy", {
    Split2M => "2m-split",
    Pre4K => "4k",
    Untouched => "none",
});
