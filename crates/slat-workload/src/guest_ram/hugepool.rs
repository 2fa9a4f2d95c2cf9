//! The hugetlb pool: how many huge pages of a size are free, and which file reserves more.

use super::RamError;
use crate::backing::Backing;
use crate::size::KIB;
use std::fs;
use std::path::Path;

/// Where the kernel describes each supported huge page size.
pub(super) const HUGEPAGES_SYSFS: &str = "/sys/kernel/mm/hugepages";

/// The knob that reserves pages of the *default* huge page size.
const DEFAULT_NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// What sysfs says about the hugetlb pool of one page size.
pub(super) struct HugePool {
    /// Free pages not already promised to other mappings, if readable.
    pub(super) available: Option<u64>,
    /// Whether `/sys/kernel/mm/hugepages/hugepages-<kB>kB` exists.
    dir_exists: bool,
    /// The `nr_hugepages` file to write, or the missing directory.
    pub(super) hint: String,
}

impl HugePool {
    pub(super) fn probe(backing: Backing) -> HugePool {
        let kb = backing.page_size() / KIB;
        let dir = format!("{HUGEPAGES_SYSFS}/hugepages-{kb}kB");
        let dir_exists = Path::new(&dir).is_dir();
        if !dir_exists {
            return HugePool {
                available: None,
                dir_exists,
                hint: dir,
            };
        }
        let read = |file: &str| -> Option<u64> {
            fs::read_to_string(format!("{dir}/{file}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        let available = read("free_hugepages")
            .map(|free| free.saturating_sub(read("resv_hugepages").unwrap_or(0)));
        // /proc/sys/vm/nr_hugepages controls the default huge page size only.
        let hint = if default_hugepage_kb() == Some(kb) {
            DEFAULT_NR_HUGEPAGES.to_owned()
        } else {
            format!("{dir}/nr_hugepages")
        };
        HugePool {
            available,
            dir_exists,
            hint,
        }
    }
}

/// `Hugepagesize` from /proc/meminfo, in kB.
fn default_hugepage_kb() -> Option<u64> {
    let meminfo = fs::read_to_string("/proc/meminfo").ok()?;
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("Hugepagesize:")?;
        rest.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

/// Fails with [`RamError::HugetlbNotReserved`] if fewer than `needed` huge
/// pages of the backing's size are free. If sysfs is not mounted at all the
/// check is skipped and `mmap` decides.
pub(super) fn check_hugetlb(backing: Backing, needed: u64) -> Result<(), RamError> {
    if !Path::new(HUGEPAGES_SYSFS).is_dir() {
        return Ok(());
    }
    let pool = HugePool::probe(backing);
    let free = match (pool.dir_exists, pool.available) {
        (false, _) => 0,
        (true, Some(free)) => free,
        // Unreadable counters: let mmap decide.
        (true, None) => return Ok(()),
    };
    if !pool.dir_exists || free < needed {
        return Err(RamError::HugetlbNotReserved {
            backing: backing.name(),
            needed,
            free,
            sysfs: pool.hint,
        });
    }
    Ok(())
}
