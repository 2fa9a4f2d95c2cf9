//! How a machine logs dirty pages, in KVM's terms (both machines take the same values).

/// `KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE`: GET copies the bitmap; CLEAR clears and re-protects.
/// The engine's `slat::dirty::MANUAL_PROTECT_ENABLE` has the same value.
pub const MANUAL_PROTECT_ENABLE: u32 = 1 << 0;
/// `KVM_DIRTY_LOG_INITIALLY_SET`: enabling logging sets every bit and protects nothing.
pub const INITIALLY_SET: u32 = 1 << 1;

/// How the VM logs dirty pages; applied when the machine is built, before vCPUs exist.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirtyConfig {
    /// Manual dirty-log protection flags ([`MANUAL_PROTECT_ENABLE`] | [`INITIALLY_SET`];
    /// 0 = GET clears and re-protects).
    pub manual_protect: u32,
    /// Dirty ring entries per vCPU (0 = bitmaps).
    pub ring_entries: u32,
    /// Keep bitmaps beside the rings (the simulated machine only; KVM refuses it).
    pub ring_with_bitmap: bool,
}
