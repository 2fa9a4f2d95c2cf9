//! The backend's error type.

use std::io;

/// Why the KVM machine could not be built, or an operation on it failed.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    /// The KVM device could not be opened.
    #[error("cannot open {device}: {source}; {hint}")]
    DeviceUnavailable {
        /// The device path tried (normally `/dev/kvm`).
        device: String,
        /// What `open(2)` said.
        source: io::Error,
        /// What to do about it.
        hint: &'static str,
    },
    /// The host kernel lacks a capability the requested configuration needs.
    #[error("{capability} not supported by this host kernel{detail}")]
    Unsupported {
        /// The capability, e.g. `KVM_CAP_DIRTY_LOG_RING`.
        capability: &'static str,
        /// More detail (empty, or starting with `: `).
        detail: String,
    },
    /// A configuration value is out of range.
    #[error("{0}")]
    Config(String),
    /// A KVM ioctl failed.
    #[error("{op} failed: {source}")]
    Ioctl {
        /// The ioctl, e.g. `KVM_SET_USER_MEMORY_REGION`.
        op: &'static str,
        /// The error number the kernel returned.
        source: io::Error,
    },
    /// Guest or ring memory could not be mapped.
    #[error("cannot map {len} bytes of {what}: {source}{hint}")]
    Mmap {
        /// What was being mapped.
        what: String,
        /// Bytes.
        len: u64,
        /// What `mmap(2)` (or `madvise(2)`) said.
        source: io::Error,
        /// How to fix it (empty, or starting with `; `).
        hint: &'static str,
    },
    /// The guest code could not be assembled (a bug in this crate).
    #[error("cannot assemble the guest code: {0}")]
    Assembler(String),
    /// A vCPU left the guest for a reason the workload never causes.
    #[error("vCPU {vcpu} exited unexpectedly: {exit}")]
    UnexpectedExit {
        /// The vCPU.
        vcpu: usize,
        /// The exit, with the guest's RIP when it could be read.
        exit: String,
    },
    /// A vCPU thread could not be started.
    #[error("cannot start vCPU thread: {0}")]
    Thread(io::Error),
    /// A workload is already running (or none is, for a halt).
    #[error("{0}")]
    Busy(&'static str),
    /// A dirty-log request that does not fit the VM's configuration or the slot.
    #[error("{0}")]
    DirtyLog(String),
    /// A dirty-log refusal of `slat-dirty` (bitmap length, CLEAR range, ring size, memslot).
    #[error(transparent)]
    Dirty(slat_dirty::Error),
    /// Guest memory could not be mapped (or the hugetlb pool is short).
    #[error(transparent)]
    Ram(#[from] slat_workload::RamError),
    /// The host's rendezvous with the vCPU threads refused the vCPU count.
    #[error(transparent)]
    Rendezvous(#[from] slat_workload::RendezvousError),
}

impl From<slat_workload::WorkloadError> for KvmError {
    /// A refusal of the shared workload code is a configuration error here too.
    fn from(e: slat_workload::WorkloadError) -> Self {
        match e {
            slat_workload::WorkloadError::Config(m) => KvmError::Config(m),
            slat_workload::WorkloadError::Thread(e) => KvmError::Thread(e),
        }
    }
}

impl From<slat_dirty::Error> for KvmError {
    /// The dirty-log library's errors are the same variants here.
    fn from(e: slat_dirty::Error) -> Self {
        use slat_dirty::Error as E;
        match e {
            E::Unsupported { capability, detail } => KvmError::Unsupported { capability, detail },
            E::Ioctl { op, source } => KvmError::Ioctl { op, source },
            E::Mmap {
                what,
                len,
                source,
                hint,
            } => KvmError::Mmap {
                what,
                len,
                source,
                hint,
            },
            E::RingEnable { source, .. } => KvmError::Ioctl {
                op: "KVM_ENABLE_CAP(DIRTY_LOG_RING)",
                source,
            },
            E::Harvest(m) => KvmError::DirtyLog(m),
            e => KvmError::Dirty(e),
        }
    }
}

impl KvmError {
    /// An ioctl error from `kvm-ioctls` / `vmm-sys-util`.
    pub(crate) fn ioctl(op: &'static str, e: vmm_sys_util::errno::Error) -> Self {
        KvmError::Ioctl {
            op,
            source: io::Error::from_raw_os_error(e.errno()),
        }
    }

    /// The host kernel lacks `capability`.
    pub(crate) fn unsupported(capability: &'static str) -> Self {
        KvmError::Unsupported {
            capability,
            detail: String::new(),
        }
    }

    /// `open(device)` failed with `e`: say why in words a user can act on.
    pub(crate) fn device(device: &str, e: vmm_sys_util::errno::Error) -> Self {
        let hint = match e.errno() {
            libc::ENOENT | libc::ENODEV | libc::ENXIO => {
                "load the KVM module (modprobe kvm_intel or modprobe kvm_amd) on a host with \
                 hardware virtualization enabled, or run where /dev/kvm exists"
            }
            libc::EACCES | libc::EPERM => {
                "add your user to the kvm group (usermod -aG kvm $USER, then log in again) or \
                 run as root"
            }
            libc::EBUSY => "another hypervisor holds the virtualization extensions",
            _ => "check that KVM works on this host",
        };
        KvmError::DeviceUnavailable {
            device: device.to_string(),
            source: io::Error::from_raw_os_error(e.errno()),
            hint,
        }
    }
}
