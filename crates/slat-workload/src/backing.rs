//! Kinds of host memory behind guest RAM, named as the `-s` backing source flag of the Linux
//! KVM selftests (`anonymous`, `anonymous_thp`, `anonymous_hugetlb`, `anonymous_hugetlb_1gb`,
//! `shmem`), plus the simulated machine's phantom kinds (`phantom`, `phantom_thp`,
//! `phantom_hugetlb_1gb`): a reservation with no memory behind it whose guest data lives in a
//! small pool of shared frames, so a guest far larger than the host can be mapped (issue 27).
//! Both machines map every kind through [`crate::GuestRam`].

use crate::guest_ram::RamError;
use crate::size::{GIB, MIB};
use std::fmt;
use std::str::FromStr;

/// Base (small) host page size assumed for non-huge backings.
pub(crate) const SMALL_PAGE: u64 = 4096;

/// Valid backing names, quoted in [`RamError::UnknownBacking`] messages.
/// Kept in sync with [`Backing::ALL`] by a unit test.
pub(crate) const BACKING_NAMES: &str =
    "anonymous, anonymous_thp, anonymous_hugetlb, anonymous_hugetlb_1gb, shmem, phantom, \
     phantom_thp, phantom_hugetlb_1gb";

/// Kinds of host memory that can back guest RAM (KVM selftests' `-s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backing {
    /// Private anonymous memory with normal (4 KiB) pages.
    #[default]
    Anonymous,
    /// Private anonymous memory advised with `MADV_HUGEPAGE` so that
    /// transparent huge pages (2 MiB) can back it.
    AnonymousThp,
    /// Private anonymous hugetlbfs memory with 2 MiB pages (`MAP_HUGETLB`).
    AnonymousHugetlb2M,
    /// Private anonymous hugetlbfs memory with 1 GiB pages (`MAP_HUGETLB`).
    AnonymousHugetlb1G,
    /// Shared memory (a `memfd`) with normal (4 KiB) pages.
    Shmem,
    /// Phantom memory mapped like [`Backing::Anonymous`] (4 KiB leaves): an inaccessible
    /// reservation whose data accesses go to a pool of a few shared frames (the data is not
    /// kept). Only the simulated machine runs it.
    Phantom,
    /// Phantom memory mapped like [`Backing::AnonymousThp`] (2 MiB leaves).
    PhantomThp,
    /// Phantom memory mapped like [`Backing::AnonymousHugetlb1G`] (1 GiB leaves).
    PhantomHugetlb1G,
}

impl Backing {
    /// All kinds, in the order `--help` lists them.
    pub const ALL: [Backing; 8] = [
        Backing::Anonymous,
        Backing::AnonymousThp,
        Backing::AnonymousHugetlb2M,
        Backing::AnonymousHugetlb1G,
        Backing::Shmem,
        Backing::Phantom,
        Backing::PhantomThp,
        Backing::PhantomHugetlb1G,
    ];

    /// The selftest name: "anonymous", "anonymous_thp", "anonymous_hugetlb"
    /// (2 MiB), "anonymous_hugetlb_1gb", "shmem".
    pub fn name(self) -> &'static str {
        match self {
            Backing::Anonymous => "anonymous",
            Backing::AnonymousThp => "anonymous_thp",
            Backing::AnonymousHugetlb2M => "anonymous_hugetlb",
            Backing::AnonymousHugetlb1G => "anonymous_hugetlb_1gb",
            Backing::Shmem => "shmem",
            Backing::Phantom => "phantom",
            Backing::PhantomThp => "phantom_thp",
            Backing::PhantomHugetlb1G => "phantom_hugetlb_1gb",
        }
    }

    /// Whether guest data is not kept ([`Backing::Phantom`] and its twins): whatever reads
    /// guest data back (oracles, migration, snapshots) must refuse it.
    pub fn is_phantom(self) -> bool {
        matches!(
            self,
            Backing::Phantom | Backing::PhantomThp | Backing::PhantomHugetlb1G
        )
    }

    /// Parse a selftest name; also accepts "anonymous_hugetlb_2mb" as an
    /// alias of [`Backing::AnonymousHugetlb2M`].
    ///
    /// # Errors
    ///
    /// [`RamError::UnknownBacking`] (listing the valid names) for anything else.
    pub fn parse(s: &str) -> Result<Backing, RamError> {
        if s == "anonymous_hugetlb_2mb" {
            return Ok(Backing::AnonymousHugetlb2M);
        }
        Backing::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| RamError::UnknownBacking(s.to_owned()))
    }

    /// The host page size this backing maps with: 4096, 2 MiB for THP and
    /// hugetlb 2M, 1 GiB for hugetlb_1gb, 4096 for shmem; a phantom kind reports its twin's,
    /// so the engine installs the same leaf levels.
    pub fn page_size(self) -> u64 {
        match self {
            Backing::Anonymous | Backing::Shmem | Backing::Phantom => SMALL_PAGE,
            Backing::AnonymousThp | Backing::AnonymousHugetlb2M | Backing::PhantomThp => 2 * MIB,
            Backing::AnonymousHugetlb1G | Backing::PhantomHugetlb1G => GIB,
        }
    }

    /// `MAP_HUGE_*` size flag for hugetlb backings, `None` otherwise.
    pub(crate) fn hugetlb_flag(self) -> Option<libc::c_int> {
        match self {
            Backing::AnonymousHugetlb2M => Some(libc::MAP_HUGE_2MB),
            Backing::AnonymousHugetlb1G => Some(libc::MAP_HUGE_1GB),
            _ => None,
        }
    }
}

impl FromStr for Backing {
    type Err = RamError;

    fn from_str(s: &str) -> Result<Backing, RamError> {
        Backing::parse(s)
    }
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backing_names_round_trip() {
        for b in Backing::ALL {
            assert_eq!(Backing::parse(b.name()).expect("known name"), b);
            assert_eq!(b.name().parse::<Backing>().expect("known name"), b);
            assert_eq!(b.to_string(), b.name());
        }
        let listed: Vec<&str> = Backing::ALL.iter().map(|b| b.name()).collect();
        assert_eq!(listed.join(", "), BACKING_NAMES);
        assert_eq!(
            Backing::parse("anonymous_hugetlb_2mb").expect("alias"),
            Backing::AnonymousHugetlb2M
        );
    }

    #[test]
    fn backing_unknown_name() {
        let err = Backing::parse("hugetlbfs").unwrap_err();
        assert!(matches!(&err, RamError::UnknownBacking(s) if s == "hugetlbfs"));
        let msg = err.to_string();
        assert!(msg.contains("`hugetlbfs`"), "{msg}");
        for b in Backing::ALL {
            assert!(msg.contains(b.name()), "{msg}");
        }
        assert!(matches!(
            "".parse::<Backing>(),
            Err(RamError::UnknownBacking(_))
        ));
    }

    #[test]
    fn backing_page_sizes() {
        assert_eq!(Backing::Anonymous.page_size(), 4096);
        assert_eq!(Backing::AnonymousThp.page_size(), 2 * MIB);
        assert_eq!(Backing::AnonymousHugetlb2M.page_size(), 2 * MIB);
        assert_eq!(Backing::AnonymousHugetlb1G.page_size(), GIB);
        assert_eq!(Backing::Shmem.page_size(), 4096);
        assert_eq!(Backing::Phantom.page_size(), 4096);
        assert_eq!(Backing::PhantomThp.page_size(), 2 * MIB);
        assert_eq!(Backing::PhantomHugetlb1G.page_size(), GIB);
        let phantom: Vec<_> = Backing::ALL
            .into_iter()
            .filter(|b| b.is_phantom())
            .collect();
        assert_eq!(phantom.len(), 3);
        assert!(phantom.iter().all(|b| b.name().starts_with("phantom")));
    }
}
