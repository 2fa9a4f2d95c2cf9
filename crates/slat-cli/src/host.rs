//! Facts about the host that the numbers depend on, recorded in every JSON document: a figure
//! measured with THP off or on a shadow-paging KVM is not comparable with one measured
//! without.

use crate::args::BackendArg;
use serde::Serialize;

/// What the host was when the run was made.
#[derive(Debug, Clone, Serialize)]
pub struct HostFacts {
    pub cores: usize,
    /// `uname -r` (from `/proc/sys/kernel/osrelease`).
    pub kernel_release: Option<String>,
    /// Transparent huge pages mode: the selected word of
    /// `/sys/kernel/mm/transparent_hugepage/enabled` (`always`, `madvise` or `never`).
    pub thp: Option<String>,
    /// Whether the host KVM uses the two-dimensional-paging MMU (`tdp_mmu` parameter of the kvm
    /// module: `true` for hardware EPT/NPT through the TDP MMU, `false` for the legacy or
    /// shadow MMU); `null` when the kvm module is not loaded.
    pub kvm_tdp_mmu: Option<bool>,
    /// The privilege level the guest workload runs at on the kvm backend (`cpl3`: user mode,
    /// `cpl0`: kernel mode); `null` when no kvm machine ran.
    pub kvm_guest_privilege: Option<&'static str>,
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The bracketed choice of a sysfs multiple-choice file: `always [madvise] never` → `madvise`.
fn selected(s: &str) -> Option<String> {
    let start = s.find('[')? + 1;
    let end = start + s[start..].find(']')?;
    Some(s[start..end].to_string())
}

impl HostFacts {
    /// Reads the facts for a run on `backends`.
    pub fn collect(backends: &[BackendArg]) -> HostFacts {
        let tdp = read_trimmed("/sys/module/kvm/parameters/tdp_mmu").map(|v| v == "Y" || v == "1");
        let privilege = match slat_kvm::KvmConfig::default().guest_mode {
            slat_kvm::GuestMode::User => "cpl3",
            slat_kvm::GuestMode::Kernel => "cpl0",
        };
        HostFacts {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel_release: read_trimmed("/proc/sys/kernel/osrelease"),
            thp: read_trimmed("/sys/kernel/mm/transparent_hugepage/enabled")
                .and_then(|s| selected(&s)),
            kvm_tdp_mmu: tdp,
            kvm_guest_privilege: backends.contains(&BackendArg::Kvm).then_some(privilege),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_selected_word() {
        assert_eq!(
            super::selected("always [madvise] never").as_deref(),
            Some("madvise")
        );
        assert_eq!(super::selected("never"), None);
    }
}
