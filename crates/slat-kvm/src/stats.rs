//! KVM's binary statistics (`KVM_GET_STATS_FD`, Linux 5.14+): the counters debugfs shows
//! (`exits`, `pf_fixed`, `pf_emulate`, `insn_emulation`, ...), read per VM or per vCPU
//! without debugfs.

use crate::error::KvmError;
use kvm_bindings::{kvm_stats_header, KVM_STATS_TYPE_MASK, KVM_STATS_TYPE_PEAK};
use kvm_ioctls::{VcpuFd, VmFd};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use vmm_sys_util::ioctl::ioctl;

mod nr {
    #![allow(missing_docs)]
    use kvm_bindings::KVMIO;
    use vmm_sys_util::ioctl_io_nr;
    ioctl_io_nr!(KVM_GET_STATS_FD, KVMIO, 0xce);
}

/// One counter: name, and its value (a scalar statistic's first element).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// KVM's name, e.g. `exits`.
    pub name: String,
    /// The value.
    pub value: u64,
    /// A peak value (not a running count): differences of two reads mean nothing.
    pub peak: bool,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for kvm_ioctls::VmFd {}
    impl Sealed for kvm_ioctls::VcpuFd {}
}

/// A KVM object with binary statistics: a VM ([`VmFd`]) or a vCPU ([`VcpuFd`]).
///
/// Sealed: `KVM_GET_STATS_FD` on any other fd would be whatever that fd's driver does with the
/// request number, and its return value would be taken as a new fd this crate owns.
///
/// ```no_run
/// let vm = kvm_ioctls::Kvm::new().unwrap().create_vm().unwrap();
/// let stats = slat_kvm::stats::StatsFd::open(&vm);
/// ```
///
/// ```compile_fail,E0277
/// let f = std::fs::File::open("/dev/zero").unwrap();
/// let stats = slat_kvm::stats::StatsFd::open(&f);
/// ```
pub trait StatsSource: sealed::Sealed + AsRawFd {}
impl StatsSource for VmFd {}
impl StatsSource for VcpuFd {}

/// Most descriptor bytes a statistics fd may announce (KVM's are a few KiB); a header that
/// claims more is refused rather than allocated.
const MAX_DESC_BYTES: usize = 1 << 20;

/// An open statistics fd and its descriptors.
#[derive(Debug)]
pub struct StatsFd {
    file: File,
    /// (name, byte offset of the value in the file, peak?)
    descs: Vec<(String, u64, bool)>,
}

impl StatsFd {
    /// Opens the statistics of a VM or vCPU fd.
    pub fn open(fd: &impl StatsSource) -> Result<Self, KvmError> {
        // SAFETY: `fd` is a KVM VM or vCPU fd (the sealed trait), for which this request takes
        // no argument and returns a new fd (or -1).
        let r = unsafe { ioctl(fd, nr::KVM_GET_STATS_FD()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOTTY) || e.raw_os_error() == Some(libc::EINVAL) {
                return Err(KvmError::unsupported("KVM_CAP_BINARY_STATS_FD"));
            }
            return Err(KvmError::Ioctl {
                op: "KVM_GET_STATS_FD",
                source: e,
            });
        }
        // SAFETY: `r` is the fresh fd KVM_GET_STATS_FD of a KVM object just returned; nothing
        // else owns it.
        let file = unsafe { File::from_raw_fd(r) };
        let io_err = |source| KvmError::Ioctl {
            op: "read(KVM stats fd)",
            source,
        };
        let mut h = [0u8; std::mem::size_of::<kvm_stats_header>()];
        file.read_exact_at(&mut h, 0).map_err(io_err)?;
        let word = |b: &[u8], i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (name_size, num_desc) = (word(&h, 4) as usize, word(&h, 8) as usize);
        let (desc_offset, data_offset) = (word(&h, 16) as u64, word(&h, 20) as u64);
        // Each descriptor: flags u32, exponent i16, size u16, offset u32, bucket_size u32,
        // then the name.
        let desc_size = name_size.checked_add(16);
        let total = desc_size.and_then(|d| d.checked_mul(num_desc));
        let (Some(desc_size), Some(total)) = (desc_size, total.filter(|&t| t <= MAX_DESC_BYTES))
        else {
            return Err(KvmError::Ioctl {
                op: "read(KVM stats fd)",
                source: io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{num_desc} descriptors with {name_size}-byte names is implausible"),
                ),
            });
        };
        let mut d = vec![0u8; total];
        file.read_exact_at(&mut d, desc_offset).map_err(io_err)?;
        let mut descs = Vec::with_capacity(num_desc);
        for c in d.chunks_exact(desc_size) {
            let flags = word(c, 0);
            let size = u16::from_ne_bytes([c[6], c[7]]);
            let offset = word(c, 8) as u64;
            let raw = &c[16..];
            let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
            if size == 0 {
                continue;
            }
            descs.push((
                String::from_utf8_lossy(&raw[..end]).into_owned(),
                data_offset.saturating_add(offset),
                flags & KVM_STATS_TYPE_MASK == KVM_STATS_TYPE_PEAK,
            ));
        }
        Ok(StatsFd { file, descs })
    }

    /// Reads every counter now.
    pub fn read(&self) -> Result<Vec<Stat>, KvmError> {
        let mut out = Vec::with_capacity(self.descs.len());
        for (name, off, peak) in &self.descs {
            let mut v = [0u8; 8];
            self.file
                .read_exact_at(&mut v, *off)
                .map_err(|source| KvmError::Ioctl {
                    op: "read(KVM stats fd)",
                    source,
                })?;
            out.push(Stat {
                name: name.clone(),
                value: u64::from_ne_bytes(v),
                peak: *peak,
            });
        }
        Ok(out)
    }
}

/// `after - before` per counter (peaks keep their latest value), for counters present in both.
pub fn delta(before: &[Stat], after: &[Stat]) -> Vec<Stat> {
    after
        .iter()
        .map(|a| {
            let b = before
                .iter()
                .find(|b| b.name == a.name)
                .map_or(0, |b| b.value);
            Stat {
                name: a.name.clone(),
                value: if a.peak {
                    a.value
                } else {
                    a.value.wrapping_sub(b)
                },
                peak: a.peak,
            }
        })
        .collect()
}
