//! Sizes and counts from the command line, checked where the flags are validated, before
//! anything is mapped: products and sums with checked arithmetic, bounded by what the host can
//! hold (RAM and swap) and by the guest physical address space the machine lays memory out in,
//! and memslot counts that divide the memory. A combination that cannot run is refused with
//! one line naming the flags (exit status 2, through `args::refuse`), never found out at run
//! time as a misleading failure.

use crate::args::{BackendArg, FormatArg};
use slat::{Ept, PteFormat, Stage2};
use slat_workload::{format_size, Backing};

/// The guest page size.
const PAGE: u64 = 4096;

/// The guest memory of a run, described by the flags that size it.
#[derive(Debug, Clone)]
pub struct GuestMemory {
    /// The flags, as the user would recognise them (`-v 4 x -b 1G`).
    pub flags: String,
    /// Bytes of guest memory (checked product).
    pub bytes: u64,
}

impl GuestMemory {
    /// `vcpus` × `bytes` (`-v` × `-b`), checked.
    pub fn per_vcpu(vcpus: u32, bytes: u64) -> Result<GuestMemory, String> {
        GuestMemory::per_vcpu_plus(vcpus, bytes, 0)
    }

    /// `vcpus` × (`bytes` + `extra`): a run that adds `extra` bytes to each vCPU's memory.
    pub fn per_vcpu_plus(vcpus: u32, bytes: u64, extra: u64) -> Result<GuestMemory, String> {
        let flags = format!("-v {vcpus} x -b {bytes}");
        let total = bytes
            .checked_add(extra)
            .and_then(|b| b.checked_mul(vcpus as u64))
            .ok_or_else(|| format!("{flags}: the guest memory overflows 64 bits"))?;
        Ok(GuestMemory {
            flags,
            bytes: total,
        })
    }

    /// `bytes` shared by every vCPU (`-b`).
    #[cfg(test)]
    pub fn shared(bytes: u64) -> GuestMemory {
        GuestMemory {
            flags: format!("-b {bytes}"),
            bytes,
        }
    }

    /// Pages of guest memory.
    pub fn pages(&self) -> u64 {
        self.bytes / PAGE
    }

    /// Checks that the host can hold `copies` mappings of this memory at once (the guest and,
    /// for benchmarks with one, its native baseline), each rounded up to `backing`'s page size,
    /// plus `extra` bytes the machine allocates beside it (the vCPUs' TLBs). Phantom memory
    /// holds no data: what must fit is the MMU's own structures ([`phantom_mmu_bytes`]).
    pub fn fits_host(&self, backing: Backing, copies: u64, extra: u64) -> Result<(), String> {
        let Some(host) = slat_migrate::limits::host_memory() else {
            return Ok(());
        };
        if backing.is_phantom() {
            return self.phantom_fits(backing, host, extra);
        }
        let psize = backing.page_size().max(PAGE);
        let mapped = self
            .bytes
            .div_ceil(psize)
            .checked_mul(psize)
            .and_then(|b| b.checked_mul(copies))
            .and_then(|b| b.checked_add(extra));
        match mapped {
            Some(m) if m <= host => Ok(()),
            _ => Err(format!(
                "{}: {} of guest memory{} is more than this host's {} of RAM and swap",
                self.flags,
                format_size(self.bytes),
                if copies > 1 {
                    format!(
                        " ({copies} mappings of it at once: the guest and {})",
                        if copies == 2 {
                            "the native baseline"
                        } else {
                            "more"
                        }
                    )
                } else {
                    String::new()
                },
                format_size(host)
            )),
        }
    }

    /// [`Self::fits_host`] for phantom memory: its MMU structures and `extra` within `host`.
    fn phantom_fits(&self, backing: Backing, host: u64, extra: u64) -> Result<(), String> {
        let need = phantom_mmu_bytes(self.bytes).saturating_add(extra);
        if need <= host {
            return Ok(());
        }
        Err(format!(
            "{}: -s {} keeps no guest data, but the MMU's own structures for {} of guest memory take up to {} (4 KiB leaves everywhere, dirty bitmaps, a reverse map), more than this host's {} of RAM and swap",
            self.flags,
            backing.name(),
            format_size(self.bytes),
            format_size(need),
            format_size(host)
        ))
    }

    /// Checks that the memory fits the guest physical address space of every machine in
    /// `backends`: the simulated machine puts it one page below the top of its format's
    /// space (starting at `gpa` if given), a KVM guest below 2^39 with a page to spare.
    pub fn fits_gpa(
        &self,
        backends: &[BackendArg],
        format: FormatArg,
        gpa: Option<u64>,
    ) -> Result<(), String> {
        for b in backends {
            let (bits, whose) = match (b, format) {
                (BackendArg::Sim, FormatArg::Ept) => (Ept::MAX_PHYS_BITS, "--format ept"),
                (BackendArg::Sim, FormatArg::Stage2) => (Stage2::MAX_PHYS_BITS, "--format stage2"),
                (BackendArg::Kvm, _) => (slat_kvm::MAX_GPA_BITS, "a kvm guest"),
            };
            let space = 1u64 << bits;
            let fits = match gpa {
                // The region sits below the top page (the selftests' layout).
                None => self.bytes.checked_add(PAGE).is_some_and(|e| e <= space),
                Some(g) => g.checked_add(self.bytes).is_some_and(|e| e <= space),
            };
            if !fits {
                return Err(format!(
                    "{}{}: {} of guest memory exceeds the {bits}-bit guest physical address space of {whose}",
                    match gpa {
                        Some(g) => format!("-p {g:#x} + "),
                        None => String::new(),
                    },
                    self.flags,
                    format_size(self.bytes),
                ));
            }
        }
        Ok(())
    }

    /// Checks that `slots` memslots (`-x`) split the pages evenly.
    pub fn slots_divide(&self, slots: u32) -> Result<(), String> {
        let pages = self.pages();
        if slots == 0 || pages % slots as u64 != 0 {
            return Err(format!(
                "-x {slots} does not divide the {pages} page{} of guest memory ({}) evenly",
                if pages == 1 { "" } else { "s" },
                self.flags
            ));
        }
        Ok(())
    }
}

/// Bytes the MMU's own structures take at most for `bytes` of phantom guest memory: every
/// page mapped at 4 KiB (a table page per 512 pages, and the levels above), two dirty bitmaps
/// with their summaries, and a reverse-map slot per page (kept by `--wrprot rmap*` only), plus
/// the data pool. A bound, not a forecast: what a run allocates grows with what it touches
/// (its report gives the figure).
pub fn phantom_mmu_bytes(bytes: u64) -> u64 {
    // A table page and its header are 8 KiB aligned to 4 KiB, which the allocator serves from
    // 12 KiB of resident memory (measured: 525,318 tables of a 1 TiB guest, 6.0 GiB RSS).
    const TABLE_FRAME: u64 = 12 << 10;
    let pages = bytes.div_ceil(PAGE);
    let leaf_tables = pages.div_ceil(512);
    // Each level above has 512 times fewer tables, and at least the root.
    let upper = leaf_tables.div_ceil(511) + 4;
    let tables = (leaf_tables + upper).saturating_mul(TABLE_FRAME);
    let bitmaps = pages.div_ceil(8).saturating_mul(2).saturating_mul(2);
    let rmap = pages
        .saturating_mul(8)
        .saturating_add(pages.div_ceil(512) * 16);
    let pool = slat::PHANTOM_POOL_FRAMES * PAGE;
    tables
        .saturating_add(bitmaps)
        .saturating_add(rmap)
        .saturating_add(pool)
}

/// Refuses phantom memory where `what` reads guest data back: it is not kept.
pub fn refuse_phantom(backing: Backing, what: &str) -> Result<(), String> {
    if backing.is_phantom() {
        return Err(format!(
            "-s {}: {what} reads guest data back, which phantom memory does not keep; use -s anonymous (or another backing that keeps data)",
            backing.name()
        ));
    }
    Ok(())
}

/// Refuses `-s shmem` with a KVM machine (slat-kvm maps only anonymous memory), and phantom
/// memory (the simulated machine's only).
pub fn check_backing(backends: &[BackendArg], backing: Backing) -> Result<(), String> {
    if backing.is_phantom() && backends.contains(&BackendArg::Kvm) {
        return Err(format!(
            "-s {} runs only on the simulated machine (--backend sim): a kvm guest needs memory behind its addresses",
            backing.name()
        ));
    }
    if backing == Backing::Shmem && backends.contains(&BackendArg::Kvm) {
        return Err(
            "-s shmem is not supported by the kvm backend (use anonymous, anonymous_thp or anonymous_hugetlb)"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_overflow_into_an_error_naming_the_flags() {
        let e = GuestMemory::per_vcpu(4, 4_611_686_018_427_392_000).unwrap_err();
        assert!(e.contains("-v 4 x -b 4611686018427392000") && e.contains("overflows"));
        let e = GuestMemory::per_vcpu_plus(1, u64::MAX - 4096, 3 * 4096).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
        assert_eq!(GuestMemory::per_vcpu(2, 1 << 20).unwrap().bytes, 2 << 20);
    }

    #[test]
    fn memory_is_bounded_by_the_host_and_the_address_space() {
        let big = GuestMemory::per_vcpu(512, 1 << 40).unwrap();
        assert!(big.fits_host(Backing::Anonymous, 1, 0).is_err());
        let e = big
            .fits_gpa(&[BackendArg::Sim], FormatArg::Ept, None)
            .unwrap_err();
        assert!(e.contains("48-bit"), "{e}");
        let small = GuestMemory::per_vcpu(1, 1 << 20).unwrap();
        small.fits_host(Backing::Anonymous, 2, 0).unwrap();
        assert!(small.fits_host(Backing::Anonymous, 1, u64::MAX).is_err());
        small
            .fits_gpa(&[BackendArg::Sim, BackendArg::Kvm], FormatArg::Ept, None)
            .unwrap();
        let top = GuestMemory::shared(1 << 48);
        assert!(top
            .fits_gpa(&[BackendArg::Sim], FormatArg::Stage2, None)
            .is_err());
        let at = GuestMemory::shared(8 << 20);
        assert!(at
            .fits_gpa(&[BackendArg::Sim], FormatArg::Ept, Some(u64::MAX - 4095))
            .is_err());
        at.fits_gpa(&[BackendArg::Sim], FormatArg::Ept, Some(1 << 30))
            .unwrap();
    }

    #[test]
    fn phantom_needs_only_the_mmus_memory() {
        let tib = GuestMemory::per_vcpu(1, 1 << 40).unwrap();
        let need = phantom_mmu_bytes(1 << 40);
        // Tables (6 GiB resident), the rmap (2 GiB), bitmaps (128 MiB): about 8.1 GiB.
        assert!(need > 8 << 30 && need < (8 << 30) + (256 << 20), "{need}");
        match slat_migrate::limits::host_memory() {
            Some(h) if h >= need => tib.fits_host(Backing::Phantom, 2, 0).unwrap(),
            _ => {}
        }
        let huge = GuestMemory::per_vcpu(512, 1 << 40).unwrap();
        let e = huge.fits_host(Backing::PhantomThp, 1, 0).unwrap_err();
        assert!(e.contains("-s phantom_thp keeps no guest data"), "{e}");
        assert!(check_backing(&[BackendArg::Kvm], Backing::Phantom).is_err());
        check_backing(&[BackendArg::Sim], Backing::Phantom).unwrap();
        let e = refuse_phantom(Backing::PhantomHugetlb1G, "the oracle").unwrap_err();
        assert!(
            e.starts_with("-s phantom_hugetlb_1gb: the oracle reads"),
            "{e}"
        );
        refuse_phantom(Backing::Anonymous, "the oracle").unwrap();
    }

    #[test]
    fn slots_must_divide_the_pages() {
        let one = GuestMemory::per_vcpu(1, 4096).unwrap();
        let e = one.slots_divide(3).unwrap_err();
        assert!(e.starts_with("-x 3 does not divide the 1 page of"), "{e}");
        one.slots_divide(1).unwrap();
    }
}
