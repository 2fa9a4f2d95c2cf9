//! Deliberate protocol bugs, so tests can prove that an oracle catches a broken engine.
//!
//! Compiled in only with the cargo feature `test-hooks` (off by default): without it
//! [`Hooks::active`] is a constant `false` and the break-before-make and harvest paths read
//! nothing. The constants are public as `slat::dirty::inject`.

/// The bugs, as bits for `Vm::inject_bugs`.
pub mod inject {
    /// Harvests (GET, CLEAR, ring reset) write-protect but skip the remote TLB flush.
    pub const SKIP_HARVEST_FLUSH: u32 = 1 << 0;
    /// Break-before-make skips the TLB invalidation between the break and the make.
    pub const SKIP_BBM_FLUSH: u32 = 1 << 1;
    /// The lock-free rmap write-protect (`wrprot` `rmap-lockless`) finds the leaf but skips
    /// its compare-and-swap.
    pub const SKIP_LOCKLESS_CAS: u32 = 1 << 2;
    /// The SPTE-update path does not put new leaves in the rmap (the broken order: the dirty
    /// bit is visible and the writable leaf cannot be found).
    pub const SKIP_RMAP_INSERT: u32 = 1 << 3;
    /// `set_memory_attributes` converts pages but skips the zap (and its flush), so leaves
    /// of the old kind survive the conversion.
    pub const SKIP_CONVERSION_ZAP: u32 = 1 << 4;
}

/// The bugs a VM was told to commit.
#[cfg(feature = "test-hooks")]
pub(crate) struct Hooks(crate::sync::AtomicU32);

#[cfg(feature = "test-hooks")]
impl Hooks {
    pub(crate) fn new() -> Self {
        Hooks(crate::sync::AtomicU32::new(0))
    }

    pub(crate) fn set(&self, bits: u32) {
        self.0.store(bits, crate::sync::Ordering::SeqCst);
    }

    /// Whether the bug `bit` is on.
    #[inline]
    pub(crate) fn active(&self, bit: u32) -> bool {
        self.0.load(crate::sync::Ordering::Relaxed) & bit != 0
    }
}

/// Without the feature: no state, and every bug is off at compile time.
#[cfg(not(feature = "test-hooks"))]
pub(crate) struct Hooks;

#[cfg(not(feature = "test-hooks"))]
impl Hooks {
    pub(crate) fn new() -> Self {
        Hooks
    }

    #[inline(always)]
    pub(crate) fn active(&self, _bit: u32) -> bool {
        false
    }
}
