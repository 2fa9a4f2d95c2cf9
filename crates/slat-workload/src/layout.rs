//! Where the test region is in guest physical and host memory, and which part of it each vCPU
//! accesses (KVM memstress's layout).

/// The guest page size both machines use for the test region (x86-64 and 4 KiB stage-2).
pub const PAGE_SIZE: u64 = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;

/// The first memslot id of the test region on both machines (KVM's
/// `MEMSTRESS_MEM_SLOT_INDEX`).
pub const FIRST_SLOT: u32 = 1;

/// Where the test region is, and which part of it vCPU `i` accesses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Guest physical address of the test region.
    pub gpa: u64,
    /// Host address of the test region.
    pub host: u64,
    /// Bytes per vCPU.
    pub bytes_per_vcpu: u64,
    /// vCPUs.
    pub vcpus: usize,
    /// Whole-region access.
    pub overlap: bool,
}

impl Layout {
    /// Pages in the test region. The machines check at construction that the region's size
    /// does not overflow; a hand-made layout that does saturates instead of wrapping.
    pub fn total_pages(&self) -> u64 {
        self.bytes_per_vcpu.saturating_mul(self.vcpus as u64) >> PAGE_SHIFT
    }

    /// (gpa, host, pages) of vCPU `i`'s region.
    pub fn region(&self, i: usize) -> (u64, u64, u64) {
        if self.overlap {
            (self.gpa, self.host, self.total_pages())
        } else {
            let off = self.bytes_per_vcpu * i as u64;
            (
                self.gpa + off,
                self.host + off,
                self.bytes_per_vcpu >> PAGE_SHIFT,
            )
        }
    }
}
