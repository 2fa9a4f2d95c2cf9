//! Where the test region is in guest physical and host memory, and which part of it each vCPU
//! accesses (KVM memstress's layout).

use crate::error::WorkloadError;
// The guest page size both machines use for the test region (x86-64 and 4 KiB stage-2) is
// `slat_addr`'s, the one every crate shares.
use slat_addr::{PAGE_SHIFT, PAGE_SIZE};

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

/// The test region's size, checked as both machines need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionSize {
    /// vCPUs.
    pub vcpus: usize,
    /// Bytes per vCPU.
    pub bytes_per_vcpu: u64,
    /// Memslots.
    pub slots: usize,
    /// Bytes in the test region (`vcpus * bytes_per_vcpu`).
    pub total: u64,
    /// Bytes per memslot.
    pub per_slot: u64,
}

impl RegionSize {
    /// The region of `vcpus` × `bytes_per_vcpu` split into `slots` equal memslots. Refused:
    /// no vCPU, memory per vCPU zero or not a multiple of 4 KiB, a total that overflows, or
    /// pages that `slots` cannot split evenly.
    pub fn new(vcpus: usize, bytes_per_vcpu: u64, slots: usize) -> Result<Self, WorkloadError> {
        if vcpus == 0 {
            return Err(WorkloadError::Config("at least one vCPU is needed".into()));
        }
        if bytes_per_vcpu == 0 || bytes_per_vcpu % PAGE_SIZE != 0 {
            return Err(WorkloadError::Config(format!(
                "guest memory per vCPU ({bytes_per_vcpu} bytes) must be a non-zero multiple of \
                 4 KiB"
            )));
        }
        let total = u64::try_from(vcpus)
            .ok()
            .and_then(|v| bytes_per_vcpu.checked_mul(v))
            .ok_or_else(|| {
                WorkloadError::Config(format!(
                    "{vcpus} vCPUs x {bytes_per_vcpu:#x} bytes per vCPU overflows 64 bits"
                ))
            })?;
        let pages = total >> PAGE_SHIFT;
        if slots == 0 || pages % slots as u64 != 0 {
            return Err(WorkloadError::Config(format!(
                "{slots} memslots cannot split {pages} guest pages evenly"
            )));
        }
        Ok(RegionSize {
            vcpus,
            bytes_per_vcpu,
            slots,
            total,
            per_slot: total / slots as u64,
        })
    }

    /// The layout of this region at guest physical address `gpa` and host address `host`.
    pub fn layout(&self, gpa: u64, host: u64, overlap: bool) -> Layout {
        Layout {
            gpa,
            host,
            bytes_per_vcpu: self.bytes_per_vcpu,
            vcpus: self.vcpus,
            overlap,
        }
    }
}

/// What to build on either machine: the test region's shape, the host memory behind it and
/// how it logs dirty pages. `slat_machine::MachineConfig` and `slat_kvm::KvmConfig` hold it as
/// their `region`, so a caller that drives both machines (the CLI, migration) describes the
/// region once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionSpec {
    /// Host memory behind the region.
    pub backing: crate::Backing,
    /// vCPUs (one thread each).
    pub vcpus: usize,
    /// Memory per vCPU (bytes, a multiple of 4 KiB).
    pub bytes_per_vcpu: u64,
    /// Memslots the region is split into (ids [`FIRST_SLOT`]`..`).
    pub slots: usize,
    /// Every vCPU accesses the whole region instead of its own partition (`-o`).
    pub overlap: bool,
    /// Populate host memory at set-up, so guest accesses take no host page faults.
    pub prefault: bool,
    /// How the memslots log dirty pages.
    pub dirty: crate::DirtyConfig,
}

impl Default for RegionSpec {
    fn default() -> Self {
        RegionSpec {
            backing: crate::Backing::Anonymous,
            vcpus: 1,
            bytes_per_vcpu: 1 << 30,
            slots: 1,
            overlap: false,
            prefault: true,
            dirty: crate::DirtyConfig::default(),
        }
    }
}

/// What a machine's test region is: where it is, how many memslots it is split into, and how
/// they log dirty pages. Fixed when the machine is built; [`crate::TestMachine`] derives its
/// shape queries from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestRegion {
    /// Where the region is, and which part of it each vCPU accesses.
    pub layout: Layout,
    /// Memslots the region is split into (equal, ids [`FIRST_SLOT`]`..`).
    pub slots: usize,
    /// How the memslots log dirty pages.
    pub dirty: crate::DirtyConfig,
}
