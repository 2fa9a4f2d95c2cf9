//! Building a VM: checks of the configuration against the host, the memory mappings and
//! memslots, and the vCPUs.

use super::{HostCaps, KvmConfig, LOW_SLOT, MAX_GPA_BITS};
use crate::error::KvmError;
use crate::guest::{self, LowLayout};
use crate::stats::StatsFd;
use kvm_bindings::{
    kvm_enable_cap, kvm_userspace_memory_region, CpuId, KVM_CAP_DIRTY_LOG_RING,
    KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use slat_addr::{PAGE_SHIFT, PAGE_SIZE};
use slat_dirty::log::{self as dirty, DirtyRing, RingSize};
use slat_dirty::Memslot;
use slat_workload::{
    Backing, GuestRam, RegionSize, FIRST_SLOT, INITIALLY_SET, MANUAL_PROTECT_ENABLE,
};
use std::ffi::CString;
use std::num::NonZeroU32;
use std::sync::Arc;

/// The checks of `config` that need no host: the region's size, and a dirty-log
/// configuration KVM could accept.
pub(super) fn check_config(config: &KvmConfig) -> Result<RegionSize, KvmError> {
    let size = RegionSize::new(
        config.region.vcpus,
        config.region.bytes_per_vcpu,
        config.region.slots,
    )?;
    let per_slot = size.per_slot;
    if per_slot >> PAGE_SHIFT > u32::MAX as u64 {
        return Err(KvmError::Config(format!(
            "{per_slot} bytes per memslot is more than KVM's 2^32 pages"
        )));
    }
    if config.region.backing == Backing::Shmem {
        return Err(KvmError::Config(
            "-s shmem is not supported by the kvm backend (use anonymous, anonymous_thp or \
             anonymous_hugetlb)"
                .into(),
        ));
    }
    if config.region.dirty.ring_with_bitmap {
        return Err(KvmError::Config(
            "dirty rings with bitmaps beside them are a switch of the simulated engine".into(),
        ));
    }
    let ring = config.region.dirty.ring_entries;
    if ring != 0 && (!ring.is_power_of_two() || ring < 256) {
        return Err(KvmError::Config(format!(
            "dirty ring entries ({ring}) must be a power of two of at least 256 (one page)"
        )));
    }
    let mp = config.region.dirty.manual_protect;
    if mp & !(MANUAL_PROTECT_ENABLE | INITIALLY_SET) != 0
        || (mp & INITIALLY_SET != 0 && mp & MANUAL_PROTECT_ENABLE == 0)
    {
        return Err(KvmError::Config(format!(
            "manual protect flags {mp:#x}: only MANUAL_PROTECT_ENABLE (1), optionally with \
             INITIALLY_SET (2), are valid"
        )));
    }
    if ring != 0 && mp != 0 {
        return Err(KvmError::Config(
            "the dirty ring replaces the bitmap: manual protect does not apply to it".into(),
        ));
    }

    Ok(size)
}

/// The checks of `config` against what the host's KVM offers; the dirty ring's size, if any.
pub(super) fn check_host(
    config: &KvmConfig,
    caps: &HostCaps,
) -> Result<Option<RingSize>, KvmError> {
    let (ring, mp) = (
        config.region.dirty.ring_entries,
        config.region.dirty.manual_protect,
    );
    if config.region.vcpus > caps.max_vcpus {
        return Err(KvmError::Config(format!(
            "{} vCPUs requested; this host's KVM allows at most {}",
            config.region.vcpus, caps.max_vcpus
        )));
    }
    if config.region.slots + 1 > caps.memslots {
        return Err(KvmError::Config(format!(
            "{} memslots requested (plus the low slot); this host's KVM allows {}",
            config.region.slots, caps.memslots
        )));
    }
    if mp != 0 && caps.manual_protect & mp != mp {
        return Err(KvmError::Unsupported {
            capability: "KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2",
            detail: if caps.manual_protect == 0 {
                String::new()
            } else {
                format!(
                    ": flags {mp:#x} requested, the host accepts {:#x}",
                    caps.manual_protect
                )
            },
        });
    }
    let entry = RingSize::ENTRY_BYTES;
    let ring_size = if ring == 0 {
        None
    } else {
        if caps.dirty_ring_max_bytes == 0 {
            return Err(KvmError::unsupported("KVM_CAP_DIRTY_LOG_RING"));
        }
        // KVM's cap counts bytes, the configuration entries.
        let bytes = u64::from(ring) * u64::from(entry);
        if bytes > caps.dirty_ring_max_bytes as u64 {
            return Err(KvmError::Unsupported {
                capability: "KVM_CAP_DIRTY_LOG_RING",
                detail: format!(
                    ": a ring of {ring} entries ({bytes} bytes) is larger than the host's \
                     maximum of {} bytes ({} entries)",
                    caps.dirty_ring_max_bytes,
                    caps.dirty_ring_max_bytes / entry
                ),
            });
        }
        Some(RingSize::from_entries(ring).map_err(|e| KvmError::Config(e.to_string()))?)
    };
    Ok(ring_size)
}

/// Where the test region of `total` bytes goes in guest physical memory, and the low slot's
/// layout below it.
pub(super) fn place_region(
    config: &KvmConfig,
    caps: &HostCaps,
    total: u64,
) -> Result<(u64, LowLayout), KvmError> {
    // Guest physical layout: the test region at the top of a 2^39 (or smaller, if the host
    // has fewer bits) space, one page below the top like memstress, aligned down to the
    // backing page size and to 2 MiB (the guest maps it with 2 MiB pages).
    let gpa_bits = caps.phys_bits.min(MAX_GPA_BITS);
    let top = 1u64 << gpa_bits;
    let align = config.region.backing.page_size().max(2 << 20);
    let probe_low = LowLayout::new(config.region.vcpus as u64, 0, 1)?;
    let too_big = || {
        KvmError::Config(format!(
            "{total} bytes of test memory do not fit below the guest's 2^{gpa_bits} physical \
             address limit"
        ))
    };
    let gpa = top
        .checked_sub(total + PAGE_SIZE)
        .map(|g| g & !(align - 1))
        .ok_or_else(too_big)?;
    let low_layout = LowLayout::new(config.region.vcpus as u64, gpa, gpa + total)?;
    if gpa < low_layout.size.max(probe_low.size) {
        return Err(too_big());
    }
    Ok((gpa, low_layout))
}

/// Maps the test region (`total` bytes rounded up to the backing's page size) and the low
/// slot, and writes the GDT, page tables and guest code into the low slot.
pub(super) fn map_memory(
    config: &KvmConfig,
    low_layout: &LowLayout,
    gpa: u64,
    total: u64,
) -> Result<(GuestRam, GuestRam), KvmError> {
    let ram_len =
        total.div_ceil(config.region.backing.page_size()) * config.region.backing.page_size();
    let ram = GuestRam::new(config.region.backing, ram_len, config.region.prefault)?;
    let low = GuestRam::new(Backing::Anonymous, low_layout.size, true)?;
    {
        // SAFETY: `low` is a fresh private mapping of `size` bytes that nothing else uses
        // until the vCPUs exist.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(low.addr() as *mut u8, low.len() as usize) };
        guest::build_gdt(bytes, low_layout)?;
        guest::build_page_tables(bytes, low_layout, gpa, gpa + total)?;
        let code = guest::assemble(low_layout.code)?;
        if code.len() as u64 > low_layout.code_len {
            return Err(KvmError::Assembler(format!(
                "guest code is {} bytes; {} are reserved",
                code.len(),
                low_layout.code_len
            )));
        }
        let at = low_layout.code as usize;
        bytes[at..at + code.len()].copy_from_slice(&code);
    }
    Ok((ram, low))
}

/// Creates the VM with its dirty-log configuration: manual protect flags `mp`, the dirty
/// ring of `ring_size`.
pub(super) fn create_vm(
    kvm: &Kvm,
    mp: u32,
    ring_size: Option<RingSize>,
    caps: &HostCaps,
) -> Result<VmFd, KvmError> {
    let vm = kvm
        .create_vm()
        .map_err(|e| KvmError::ioctl("KVM_CREATE_VM", e))?;
    // Intel without unrestricted guest needs a TSS region for real mode; harmless elsewhere.
    // Placed just below 4 GiB, far from both slots.
    let _ = vm.set_tss_address(0xfffb_d000);
    if mp != 0 {
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            ..Default::default()
        };
        cap.args[0] = mp as u64;
        vm.enable_cap(&cap)
            .map_err(|e| KvmError::ioctl("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)", e))?;
    }
    if let Some(size) = ring_size {
        dirty::enable_dirty_ring(&vm, size, caps.dirty_ring_acq_rel)?;
    }
    Ok(vm)
}

/// Registers the low slot over `low` and the test region's slots over `ram` at `gpa`.
///
/// # Safety
///
/// `low` and `ram` must stay mapped for as long as the VM can reach them: until the VM fd,
/// every vCPU fd and ring mapping, and the returned memslot handles are gone. `ram` must hold
/// `size.total` bytes.
pub(super) unsafe fn register_slots(
    vm: &Arc<VmFd>,
    low: &GuestRam,
    ram: &GuestRam,
    gpa: u64,
    size: &RegionSize,
) -> Result<Vec<Memslot>, KvmError> {
    let (per_slot, nslots) = (size.per_slot, size.slots as u64);
    let region = |slot: u32, gpa: u64, len: u64, host: u64| kvm_userspace_memory_region {
        slot,
        flags: 0,
        guest_phys_addr: gpa,
        memory_size: len,
        userspace_addr: host,
    };
    // SAFETY: the low mapping is guest memory only and stays mapped while the VM can reach
    // it (the caller's contract). Nothing deletes the slot.
    unsafe {
        Memslot::register(vm, region(LOW_SLOT, 0, low.len(), low.addr()))?;
    }
    let mut slots = Vec::with_capacity(nslots as usize);
    for s in 0..nslots {
        let r = region(
            FIRST_SLOT + s as u32,
            gpa + s * per_slot,
            per_slot,
            ram.addr() + s * per_slot,
        );
        // SAFETY: as above, for the test region mapping `ram`; the slots do not overlap, and
        // each lies inside `ram` (`slots * per_slot = total <= ram.len()`, the caller's
        // contract).
        slots.push(unsafe { Memslot::register(vm, r)? });
    }
    Ok(slots)
}

/// The vCPU fds, their dirty rings, and the statistics fds of the VM and each vCPU.
type VcpuParts = (Vec<VcpuFd>, Vec<DirtyRing>, Option<(StatsFd, Vec<StatsFd>)>);

/// Creates the vCPUs in long mode at the guest's entry point, maps their dirty rings, and
/// opens the statistics fds (`None` if the kernel lacks them).
pub(super) fn create_vcpus(
    vm: &VmFd,
    cpuid: &CpuId,
    low_layout: &LowLayout,
    config: &KvmConfig,
    ring_size: Option<RingSize>,
) -> Result<VcpuParts, KvmError> {
    let mut vcpus = Vec::with_capacity(config.region.vcpus);
    let mut rings = Vec::new();
    let mut vm_stats = StatsFd::open(vm).ok();
    let mut vcpu_stats = Vec::new();
    for i in 0..config.region.vcpus {
        let v = vm
            .create_vcpu(i as u64)
            .map_err(|e| KvmError::ioctl("KVM_CREATE_VCPU", e))?;
        v.set_cpuid2(cpuid)
            .map_err(|e| KvmError::ioctl("KVM_SET_CPUID2", e))?;
        let mut sregs = v
            .get_sregs()
            .map_err(|e| KvmError::ioctl("KVM_GET_SREGS", e))?;
        guest::setup_long_mode(&mut sregs, low_layout, config.guest_mode);
        v.set_sregs(&sregs)
            .map_err(|e| KvmError::ioctl("KVM_SET_SREGS", e))?;
        v.set_regs(&guest::initial_regs(low_layout, i, config.guest_mode))
            .map_err(|e| KvmError::ioctl("KVM_SET_REGS", e))?;
        if let Some(size) = ring_size {
            let r = match DirtyRing::map(&v, size) {
                Err(slat_dirty::Error::Unsupported { .. }) => {
                    // SAFETY: this machine enabled the ring on this VM with exactly `size`
                    // above, before creating any vCPU (KVM accepts the cap once): the
                    // size the kernel (too old to let `map` check it) backs.
                    unsafe { DirtyRing::map_unchecked(&v, size) }
                }
                r => r,
            }?;
            rings.push(r);
        }
        if vm_stats.is_some() {
            match StatsFd::open(&v) {
                Ok(s) => vcpu_stats.push(s),
                Err(_) => vm_stats = None,
            }
        }
        vcpus.push(v);
    }
    Ok((vcpus, rings, vm_stats.map(|v| (v, vcpu_stats))))
}

/// The guest's TSC frequency (`KVM_GET_TSC_KHZ` of vCPU 0), or why it is unknown. Every vCPU
/// has the VM's default frequency: this crate never calls `KVM_SET_TSC_KHZ`.
pub(super) fn tsc_khz_of(vcpus: &[VcpuFd]) -> Result<NonZeroU32, String> {
    let v = vcpus.first().ok_or("the VM has no vCPU")?;
    let khz = v
        .get_tsc_khz()
        .map_err(|e| format!("KVM_GET_TSC_KHZ failed: {e}"))?;
    NonZeroU32::new(khz).ok_or_else(|| "KVM_GET_TSC_KHZ reports 0 kHz".to_string())
}

pub(super) fn open(device: &str) -> Result<Kvm, KvmError> {
    let path = CString::new(device)
        .map_err(|_| KvmError::Config(format!("device path {device:?} contains a NUL byte")))?;
    Kvm::new_with_path(&path).map_err(|e| KvmError::device(device, e))
}

pub(super) fn caps_of(kvm: &Kvm, cpuid: &CpuId) -> Result<HostCaps, KvmError> {
    let raw = |c: u32| kvm.check_extension_raw(c as libc::c_ulong).max(0);
    let acq_rel = raw(KVM_CAP_DIRTY_LOG_RING_ACQ_REL);
    let plain = raw(KVM_CAP_DIRTY_LOG_RING);
    let phys_bits = cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == 0x8000_0008)
        .map_or(36, |e| e.eax & 0xff);
    Ok(HostCaps {
        manual_protect: raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2) as u32,
        dirty_ring_max_bytes: acq_rel.max(plain) as u32,
        dirty_ring_acq_rel: acq_rel > 0,
        max_vcpus: kvm.get_max_vcpus(),
        memslots: kvm.get_nr_memslots(),
        phys_bits,
    })
}
