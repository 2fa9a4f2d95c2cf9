//! The benchmark guests' own errors: a shape that cannot be built, a machine that maps less
//! than its shape, a workload the machine cannot run. They reach a migration through the
//! library's `GuestError::Machine`, so `slat-migrate`'s error types name no benchmark.

use crate::migrate::{MAX_SLOTS, MAX_VCPUS};
use slat_addr::PAGE_SIZE;
use slat_migrate::stream::MAX_GUEST_BYTES;
use slat_migrate::GuestError;

/// Why a guest shape cannot be built: the checks every shape passes before a machine is
/// built for it or a page is addressed with it, whether a source announced it or a user
/// asked for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// No vCPU, or more than a guest may have.
    #[error("{vcpus} vCPUs (a guest has 1 to {MAX_VCPUS})")]
    Vcpus {
        /// vCPUs asked for.
        vcpus: u32,
    },
    /// Memory per vCPU that is zero or not whole pages.
    #[error("{bytes} bytes per vCPU (a non-zero multiple of {PAGE_SIZE})")]
    BytesPerVcpu {
        /// Bytes asked for.
        bytes: u64,
    },
    /// vCPUs × memory per vCPU does not fit 64 bits.
    #[error("{vcpus} vCPUs x {bytes_per_vcpu} bytes per vCPU overflows 64 bits")]
    Overflow {
        /// vCPUs.
        vcpus: u32,
        /// Bytes per vCPU.
        bytes_per_vcpu: u64,
    },
    /// More memory than the guest physical address space holds.
    #[error("{bytes} bytes of guest memory do not fit the {MAX_GUEST_BYTES}-byte guest physical address space")]
    TooBig {
        /// Bytes in total.
        bytes: u64,
    },
    /// No memslot, or more than a guest may have.
    #[error("{slots} memslots (a guest has 1 to {MAX_SLOTS})")]
    Slots {
        /// Memslots asked for.
        slots: u32,
    },
    /// More pages than the machine's page-table format addresses.
    #[error(
        "a guest of {pages} pages does not fit {format}'s {bits}-bit guest physical address space"
    )]
    AddressSpace {
        /// Pages in the guest.
        pages: u64,
        /// The format's name.
        format: &'static str,
        /// Its guest physical address bits.
        bits: u32,
    },
    /// Memslots that do not split the pages evenly.
    #[error("{slots} memslots cannot split {pages} pages evenly")]
    UnevenSlots {
        /// Memslots.
        slots: u32,
        /// Pages.
        pages: u64,
    },
}

/// Why a benchmark guest cannot be built or cannot run its workload.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The shape cannot be built.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A machine that maps less (or other) memory than its shape has.
    #[error("the machine maps {mapped:?} bytes for a guest of {pages} pages")]
    Mapped {
        /// Pages the shape has.
        pages: u64,
        /// Bytes the machine maps (`None`: its own size overflows).
        mapped: Option<u64>,
    },
    /// `start` while a workload runs.
    #[error("a workload is already running")]
    AlreadyRunning,
    /// A read share on the KVM guest, whose writer only writes.
    #[error("the kvm guest's writer writes on every access: -w applies to --backend sim only")]
    KvmReads,
    /// The KVM burst driver's thread could not be started.
    #[error("cannot start the burst driver: {0}")]
    DriverThread(std::io::Error),
    /// The KVM burst driver's thread panicked.
    #[error("the burst driver thread panicked")]
    DriverPanicked,
}

impl From<BenchError> for GuestError {
    fn from(e: BenchError) -> GuestError {
        GuestError::machine(e)
    }
}

impl From<ShapeError> for GuestError {
    fn from(e: ShapeError) -> GuestError {
        GuestError::machine(BenchError::Shape(e))
    }
}
