//! Whether this host's `/dev/kvm` gives out guest_memfd files (the kernel's own private-memory
//! backing for confidential guests), probed rather than assumed, and if it does, the time to
//! populate one with fallocate against the same size of anonymous memory faulted in.

use super::counters::{Counts, Snapshot};
use super::mem::{fill, Kind, Region};
use super::per_s;
use kvm_bindings::{kvm_create_guest_memfd, KVM_CAP_GUEST_MEMFD, KVM_X86_DEFAULT_VM};
use kvm_ioctls::Kvm;
use serde::Serialize;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// What the probe found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GmemProbe {
    /// `/dev/kvm` opened (`false`: no KVM here, or no permission).
    kvm_available: bool,
    /// `KVM_CHECK_EXTENSION(KVM_CAP_GUEST_MEMFD)` (234) on the `/dev/kvm` descriptor.
    pub cap_guest_memfd_system: Option<i32>,
    /// The same on a default (`KVM_X86_DEFAULT_VM`) VM, where the answer depends on the VM type.
    pub cap_guest_memfd_vm: Option<i32>,
    /// `KVM_CAP_GUEST_MEMFD_FLAGS` is not defined in the kvm-bindings this build uses, so it is
    /// not probed (`null`).
    cap_guest_memfd_flags: Option<i32>,
    /// `KVM_CREATE_GUEST_MEMFD` on that VM succeeded.
    supported: bool,
    /// What happened, in words.
    pub detail: String,
    /// The populate timing, when supported and it ran.
    pub timing: Option<GmemTiming>,
}

/// A guest_memfd populated by fallocate against anonymous memory faulted in.
#[derive(Debug, Clone, Serialize)]
pub struct GmemTiming {
    /// Bytes of each.
    pub bytes: u64,
    /// `fallocate(guest_memfd, FALLOC_FL_KEEP_SIZE, 0, bytes)` (the only allocating mode
    /// guest_memfd accepts).
    pub guest_memfd_fallocate_s: f64,
    pub guest_memfd_gb_per_s: f64,
    /// Direct-map counters across the fallocate: non-zero splits would mean this kernel's
    /// guest_memfd removes its pages from the direct map.
    pub guest_memfd_counters: Counts,
    /// One thread writing one byte per page of anonymous memory.
    pub anonymous_fill_s: f64,
    pub anonymous_gb_per_s: f64,
}

/// Probes `/dev/kvm`; if guest_memfd works, times `bytes` of it against anonymous memory.
pub fn probe(bytes: u64) -> GmemProbe {
    let mut p = GmemProbe::default();
    p.detail = match probe_into(&mut p, bytes) {
        Ok(d) | Err(d) => d,
    };
    p
}

/// Fills in what it finds; what happened, in words, either way.
fn probe_into(p: &mut GmemProbe, bytes: u64) -> Result<String, String> {
    let kvm =
        Kvm::new().map_err(|e| format!("/dev/kvm cannot be opened ({e}): not supported here"))?;
    p.kvm_available = true;
    p.cap_guest_memfd_system = Some(kvm.check_extension_raw(KVM_CAP_GUEST_MEMFD.into()));
    let vm = (kvm.create_vm_with_type(KVM_X86_DEFAULT_VM.into()))
        .map_err(|e| format!("KVM_CREATE_VM failed ({e}): guest_memfd not probed"))?;
    let cap = vm.check_extension_raw(KVM_CAP_GUEST_MEMFD.into());
    p.cap_guest_memfd_vm = Some(cap);
    let gmem = kvm_create_guest_memfd {
        size: bytes,
        flags: 0,
        reserved: [0; 6],
    };
    let fd = vm.create_guest_memfd(gmem).map_err(|e| {
        format!("KVM_CAP_GUEST_MEMFD = {cap}; KVM_CREATE_GUEST_MEMFD on a default VM failed ({e}): not supported here")
    })?;
    // SAFETY: the ioctl just returned this descriptor, owned by nothing else; the File closes
    // it on every path (before the VM, which it keeps a reference to anyway).
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    p.supported = true;
    let t = time(file, bytes).map_err(|e| format!("KVM_CREATE_GUEST_MEMFD works, but {e}"))?;
    p.timing = Some(t);
    Ok(format!("KVM_CAP_GUEST_MEMFD = {cap}; KVM_CREATE_GUEST_MEMFD works on a default VM; populated by fallocate"))
}

/// Times fallocate of the guest_memfd, closes it (so that only one of the two is held at a
/// time), then times a fill of anonymous memory of the same size.
fn time(file: File, bytes: u64) -> Result<GmemTiming, String> {
    let len = libc::off_t::try_from(bytes).map_err(|_| "the size overflows off_t".to_string())?;
    let before = Snapshot::read();
    let t0 = Instant::now();
    // guest_memfd refuses fallocate without KEEP_SIZE (its size is fixed at creation).
    // SAFETY: fallocate on a descriptor this function borrows, with no pointers.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, len) };
    let gmem = t0.elapsed();
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!("fallocate of it failed: {e}"));
    }
    let counters = before.until(&Snapshot::read());
    drop(file);
    let usize_len = usize::try_from(bytes).map_err(|_| "the size overflows usize".to_string())?;
    let mut anon = Region::new(Kind::Anon, usize_len).map_err(|e| e.to_string())?;
    let f = fill(&mut anon, 1, Duration::from_secs(1)).map_err(|e| e.to_string())?;
    Ok(GmemTiming {
        bytes,
        guest_memfd_fallocate_s: gmem.as_secs_f64(),
        guest_memfd_gb_per_s: per_s(bytes, gmem, 1e9),
        guest_memfd_counters: counters,
        anonymous_fill_s: f.elapsed.as_secs_f64(),
        anonymous_gb_per_s: per_s(bytes, f.elapsed, 1e9),
    })
}
