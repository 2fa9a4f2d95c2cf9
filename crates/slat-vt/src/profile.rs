//! Cost profiles: what every hook costs in virtual time, with where each number came from.
//!
//! A profile is a TOML file: a `name`, a `[costs]` table with one entry per
//! [`Cost`](slat::clock::Cost) and a `[model]` table with the contention model's numbers, each
//! entry `{ ns = …, source = "…" }`. Numbers are nanoseconds (fractions allowed); internally
//! the simulation counts integer picoseconds, so sub-nanosecond costs add up exactly.
//! [`Profile::hash`] covers the values only (names and sources excluded): two profiles that
//! simulate identically hash the same.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use slat::clock::Cost;

use crate::error::ProfileError;

/// The largest accepted number, in ns (1000 s): picoseconds of it still fit `u64` many times.
const MAX_NS: f64 = 1e12;
/// The largest profile file [`Profile::load`] reads: a calibrated profile with a source per
/// entry is about 10 KiB.
pub const MAX_PROFILE_BYTES: u64 = 1 << 20;

/// The costs that may be negative: a fault path's own cost is what the whole path measured
/// less what its parts charge, and parts each measured in a hot loop can add up to more than
/// the whole, whose memory accesses overlap. A negative one is an *overlap credit*: charging
/// it sets the CPU's credit, which the charges after it (the rest of the fault) use up, so
/// the path costs what it measured and no clock ever moves back
/// (docs/design/virtual-time.md, "Overlap credit").
const SIGNED_COSTS: [&str; 2] = ["fast_fault", "slow_fault"];

/// The profile names of [`Cost::ALL`], in the same order.
const COST_NAMES: [&str; Cost::ALL.len()] = [
    "walk_step",
    "hw_walk_step",
    "tlb_hit",
    "tlb_miss",
    "tlb_flush",
    "table_alloc",
    "zero_page",
    "epoch_pin",
    "defer",
    "published_load",
    "cmo_line",
    "guest_access",
    "vm_exit",
    "vm_entry",
    "ipi_handler",
    "ipi_send",
    "fast_fault",
    "slow_fault",
    "walk_side",
    "fast_fault_exit",
    "page_copy",
    "guest_round_trip",
];

/// The index of `cost` in [`Cost::ALL`]; `None` for a cost this crate does not know yet.
#[inline]
pub(crate) fn cost_index(cost: Cost) -> Option<usize> {
    // A match, not a search of `Cost::ALL`: `charge` is the hottest hook.
    Some(match cost {
        Cost::WalkStep => 0,
        Cost::HwWalkStep => 1,
        Cost::TlbHit => 2,
        Cost::TlbMiss => 3,
        Cost::TlbFlush => 4,
        Cost::TableAlloc => 5,
        Cost::ZeroPage => 6,
        Cost::EpochPin => 7,
        Cost::Defer => 8,
        Cost::PublishedLoad => 9,
        Cost::CmoLine => 10,
        Cost::GuestAccess => 11,
        Cost::VmExit => 12,
        Cost::VmEntry => 13,
        Cost::IpiHandler => 14,
        Cost::IpiSend => 15,
        Cost::FastFault => 16,
        Cost::SlowFault => 17,
        Cost::WalkSide => 18,
        Cost::FastFaultExit => 19,
        Cost::PageCopy => 20,
        Cost::GuestRoundTrip => 21,
        _ => return None,
    })
}

/// The profile name of `cost` (`walk_step`, `tlb_hit`, …).
pub fn cost_name(cost: Cost) -> Option<&'static str> {
    cost_index(cost).map(|i| COST_NAMES[i])
}

/// One number of a profile and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Nanoseconds.
    pub ns: f64,
    /// How the number was obtained (a measurement, a citation, an estimate).
    pub source: String,
}

impl Entry {
    /// An entry of `ns` nanoseconds from `source`.
    pub fn new(ns: f64, source: impl Into<String>) -> Entry {
        Entry {
            ns,
            source: source.into(),
        }
    }

    /// The value in picoseconds (valid entries only: [`Profile::validate`] ran); 0 for a
    /// negative one (an overlap credit: [`Entry::credit_ps`]).
    pub(crate) fn ps(&self) -> u64 {
        // Validated to [-MAX_NS, MAX_NS]: the product is finite and below 2^60 in magnitude;
        // `as` saturates a negative one to 0.
        (self.ns * 1000.0).round() as u64
    }

    /// A negative value's magnitude in picoseconds (0 for a non-negative one).
    pub(crate) fn credit_ps(&self) -> u64 {
        (-self.ns * 1000.0).round() as u64
    }

    /// The value in signed picoseconds (valid entries only).
    fn signed_ps(&self) -> i64 {
        (self.ns * 1000.0).round() as i64
    }
}

/// How a lock hands over to its waiters (docs/design/virtual-time.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LockPolicy {
    /// Queued locks (qspinlock / qrwlock): the head of the queue takes the lock at release +
    /// the line transfer, and nobody overtakes it.
    Fifo,
    /// `parking_lot`: the release wakes the head, which takes the lock `handoff` later unless a
    /// running CPU takes it first; every `fair_every` the release hands over directly.
    Barging,
}

impl LockPolicy {
    fn as_str(self) -> &'static str {
        match self {
            LockPolicy::Fifo => "fifo",
            LockPolicy::Barging => "barging",
        }
    }
}

/// The lock policy and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyEntry {
    /// The policy.
    pub policy: LockPolicy,
    /// Why this policy (which lock the simulated code uses).
    pub source: String,
}

/// The contention model's numbers (docs/design/virtual-time.md §2–§3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// An atomic read-modify-write on a line the CPU owns exclusively (also a fence).
    pub rmw_local: Entry,
    /// Moving a line from the CPU that last wrote it.
    pub line_transfer: Entry,
    /// Invalidating one other sharer's copy, per sharer.
    pub invalidate: Entry,
    /// A line not in any cache (never touched, or untouched for `retention`).
    pub dram_miss: Entry,
    /// A line not in any cache whose predecessor in the same 4 KiB page is in the model: a
    /// sequential stream the hardware prefetcher fetches ahead (a walk over a table, a
    /// bitmap), which costs memory bandwidth, not latency. A profile without it charges
    /// `dram_miss` (no prefetch) and keeps the hash it had before this entry existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dram_stream: Option<Entry>,
    /// Release to a woken waiter's acquire under the `barging` policy (`fifo` uses
    /// `line_transfer`).
    pub handoff: Entry,
    /// Under `barging`, a release at least this long after the last fair one hands over
    /// directly.
    pub fair_every: Entry,
    /// A line untouched for this long (virtual time) has left the caches.
    pub retention: Entry,
    /// From an IPI's send to its handler on the target.
    pub ipi_latency: Entry,
    /// How far the running CPU may run ahead of the lowest runnable clock before it yields.
    pub lookahead: Entry,
    /// How locks hand over.
    pub lock_policy: PolicyEntry,
}

impl Model {
    /// The timed entries, named, in a fixed order (for validation and the hash).
    fn entries(&self) -> [(&'static str, &Entry); 9] {
        [
            ("rmw_local", &self.rmw_local),
            ("line_transfer", &self.line_transfer),
            ("invalidate", &self.invalidate),
            ("dram_miss", &self.dram_miss),
            ("handoff", &self.handoff),
            ("fair_every", &self.fair_every),
            ("retention", &self.retention),
            ("ipi_latency", &self.ipi_latency),
            ("lookahead", &self.lookahead),
        ]
    }
}

/// A cost profile: every [`Cost`] and the model's numbers, each with its source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The profile's name (reports print it beside the hash).
    pub name: String,
    /// One entry per [`Cost`], keyed by [`cost_name`].
    pub costs: BTreeMap<String, Entry>,
    /// The contention model.
    pub model: Model,
}

impl Profile {
    /// The entry of `cost`, if the profile has it.
    pub fn cost(&self, cost: Cost) -> Option<&Entry> {
        cost_name(cost).and_then(|n| self.costs.get(n))
    }

    /// Sets `cost` to `entry` (a cost this crate does not know is ignored).
    pub fn set_cost(&mut self, cost: Cost, entry: Entry) {
        if let Some(n) = cost_name(cost) {
            self.costs.insert(n.to_string(), entry);
        }
    }

    /// Checks that every cost is present, no unknown one is, and every number is finite and
    /// within [0, 10^12] ns (`fast_fault` and `slow_fault` within ±10^12: overlap credits;
    /// `retention` and `fair_every` above zero).
    pub fn validate(&self) -> Result<(), ProfileError> {
        for name in COST_NAMES {
            let e = self.costs.get(name).ok_or(ProfileError::Missing(name))?;
            if SIGNED_COSTS.contains(&name) {
                check_signed(name, e)?;
            } else {
                check_value(name, e)?;
            }
        }
        if let Some(unknown) = self
            .costs
            .keys()
            .find(|k| !COST_NAMES.contains(&k.as_str()))
        {
            return Err(ProfileError::Unknown(unknown.clone()));
        }
        for (name, e) in self.model.entries() {
            check_value(name, e)?;
        }
        if let Some(e) = &self.model.dram_stream {
            check_value("dram_stream", e)?;
        }
        for (name, e) in [
            ("retention", &self.model.retention),
            ("fair_every", &self.model.fair_every),
        ] {
            if e.ps() == 0 {
                return Err(ProfileError::BadValue { name, value: e.ns });
            }
        }
        Ok(())
    }

    /// Every cost in picoseconds, indexed like [`Cost::ALL`] (valid profiles only).
    pub(crate) fn cost_table(&self) -> [u64; Cost::ALL.len()] {
        let mut t = [0u64; Cost::ALL.len()];
        for (slot, name) in t.iter_mut().zip(COST_NAMES) {
            *slot = self.costs.get(name).map_or(0, Entry::ps);
        }
        t
    }

    /// Every cost's overlap credit in picoseconds (non-zero only for a negative
    /// [`SIGNED_COSTS`] entry), indexed like [`Cost::ALL`].
    pub(crate) fn credit_table(&self) -> [u64; Cost::ALL.len()] {
        let mut t = [0u64; Cost::ALL.len()];
        for (slot, name) in t.iter_mut().zip(COST_NAMES) {
            *slot = self.costs.get(name).map_or(0, Entry::credit_ps);
        }
        t
    }

    /// The canonical form the hash covers: every value as integer picoseconds, in a fixed
    /// order, then the policy. Names and sources are not part of it. (Signed: a credit hashes
    /// apart from a zero cost; a non-negative value prints as it always did.)
    pub fn canonical(&self) -> String {
        let mut s = String::new();
        for name in COST_NAMES {
            let ps = self.costs.get(name).map_or(0, Entry::signed_ps);
            s.push_str(&format!("costs.{name}={ps}\n"));
        }
        for (name, e) in self.model.entries() {
            s.push_str(&format!("model.{name}={}\n", e.ps()));
        }
        // Only when present: profiles written before it keep their hashes.
        if let Some(e) = &self.model.dram_stream {
            s.push_str(&format!("model.dram_stream={}\n", e.ps()));
        }
        s.push_str(&format!(
            "model.lock_policy={}\n",
            self.model.lock_policy.policy.as_str()
        ));
        s
    }

    /// The xxh3 hash of [`canonical`](Self::canonical), as 16 hex digits.
    pub fn hash(&self) -> String {
        format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(self.canonical().as_bytes())
        )
    }

    /// Parses and validates a profile.
    pub fn from_toml(text: &str) -> Result<Profile, ProfileError> {
        let p: Profile = toml::from_str(text).map_err(|e| ProfileError::Parse(e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    /// The profile as TOML (costs in name order, then the model).
    pub fn to_toml(&self) -> Result<String, ProfileError> {
        toml::to_string_pretty(self).map_err(|e| ProfileError::Serialize(e.to_string()))
    }

    /// Reads and validates the profile at `path`. At most [`MAX_PROFILE_BYTES`] are read: a
    /// path naming a device (`/dev/zero`) or a huge file is refused, not read into memory.
    pub fn load(path: &Path) -> Result<Profile, ProfileError> {
        use std::io::Read;
        let io = |e: std::io::Error| ProfileError::Io {
            path: path.display().to_string(),
            error: e.to_string(),
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .map_err(io)?
            .take(MAX_PROFILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        // The size first: a cut through a multi-byte character must not pass for bad UTF-8.
        if bytes.len() as u64 > MAX_PROFILE_BYTES {
            return Err(ProfileError::TooLarge {
                path: path.display().to_string(),
                limit: MAX_PROFILE_BYTES,
            });
        }
        let text = String::from_utf8(bytes).map_err(|e| ProfileError::Io {
            path: path.display().to_string(),
            error: format!("not UTF-8 text ({})", e.utf8_error()),
        })?;
        Profile::from_toml(&text)
    }

    /// Writes the profile to `path`.
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        std::fs::write(path, self.to_toml()?).map_err(|e| ProfileError::Io {
            path: path.display().to_string(),
            error: e.to_string(),
        })
    }
}

fn check_value(name: &'static str, e: &Entry) -> Result<(), ProfileError> {
    check_from(name, e, 0.0)
}

fn check_signed(name: &'static str, e: &Entry) -> Result<(), ProfileError> {
    check_from(name, e, -MAX_NS)
}

/// `e` is finite and within [`lowest`, `MAX_NS`].
fn check_from(name: &'static str, e: &Entry, lowest: f64) -> Result<(), ProfileError> {
    if e.ns.is_finite() && (lowest..=MAX_NS).contains(&e.ns) {
        Ok(())
    } else {
        Err(ProfileError::BadValue { name, value: e.ns })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_round_trips_through_toml() {
        let p = Profile::host_default();
        p.validate().unwrap();
        let text = p.to_toml().unwrap();
        let q = Profile::from_toml(&text).unwrap();
        assert_eq!(p, q);
        assert_eq!(p.hash(), q.hash());
    }

    #[test]
    fn save_and_load_a_file() {
        let path =
            std::env::temp_dir().join(format!("slat-vt-profile-{}.toml", std::process::id()));
        let mut p = Profile::host_default();
        p.name = "saved".into();
        p.save(&path).unwrap();
        let q = Profile::load(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(p, q);
        assert!(matches!(Profile::load(&path), Err(ProfileError::Io { .. })));
    }

    #[test]
    fn hash_covers_values_not_sources() {
        let p = Profile::host_default();
        let mut q = p.clone();
        q.name = "renamed".into();
        q.model.handoff.source = "elsewhere".into();
        assert_eq!(p.hash(), q.hash());
        q.model.handoff.ns += 1.0;
        assert_ne!(p.hash(), q.hash());
        let mut r = p.clone();
        r.model.lock_policy.policy = LockPolicy::Fifo;
        assert_ne!(p.hash(), r.hash());
    }

    #[test]
    fn bad_profiles_are_typed_errors() {
        let mut p = Profile::host_default();
        p.costs.remove("tlb_hit");
        assert!(matches!(
            p.validate(),
            Err(ProfileError::Missing("tlb_hit"))
        ));
        let mut p = Profile::host_default();
        p.costs.insert("warp_drive".into(), Entry::new(1.0, "x"));
        assert!(matches!(p.validate(), Err(ProfileError::Unknown(_))));
        let mut p = Profile::host_default();
        p.model.lookahead.ns = f64::NAN;
        assert!(matches!(p.validate(), Err(ProfileError::BadValue { .. })));
        let mut p = Profile::host_default();
        p.model.retention.ns = 0.0;
        assert!(matches!(p.validate(), Err(ProfileError::BadValue { .. })));
        assert!(matches!(
            Profile::from_toml("name = 3"),
            Err(ProfileError::Parse(_))
        ));
    }

    #[test]
    fn only_the_fault_paths_may_be_negative() {
        let mut p = Profile::host_default();
        p.set_cost(Cost::SlowFault, Entry::new(0.0, "x"));
        let zero = p.hash();
        p.set_cost(Cost::SlowFault, Entry::new(-31.8, "x"));
        p.set_cost(Cost::FastFault, Entry::new(-17.8, "x"));
        p.validate().unwrap();
        assert_ne!(p.hash(), zero, "a credit must not hash like a zero cost");
        assert_eq!(p.cost_table()[cost_index(Cost::SlowFault).unwrap()], 0);
        assert_eq!(
            p.credit_table()[cost_index(Cost::SlowFault).unwrap()],
            31_800
        );
        assert_eq!(
            p.credit_table()[cost_index(Cost::FastFault).unwrap()],
            17_800
        );
        assert_eq!(p.credit_table().iter().filter(|c| **c > 0).count(), 2);
        let q = Profile::from_toml(&p.to_toml().unwrap()).unwrap();
        assert_eq!(p.hash(), q.hash());
        for bad in [-1e13, f64::NEG_INFINITY, f64::NAN] {
            let mut r = p.clone();
            r.set_cost(Cost::SlowFault, Entry::new(bad, "x"));
            assert!(matches!(r.validate(), Err(ProfileError::BadValue { .. })));
        }
        let mut r = p.clone();
        r.set_cost(Cost::TlbHit, Entry::new(-1.0, "x"));
        assert!(matches!(
            r.validate(),
            Err(ProfileError::BadValue {
                name: "tlb_hit",
                ..
            })
        ));
        r.model.dram_miss.ns = -1.0;
        r.set_cost(Cost::TlbHit, Entry::new(1.0, "x"));
        assert!(matches!(r.validate(), Err(ProfileError::BadValue { .. })));
    }

    #[test]
    fn every_cost_has_a_name_and_index() {
        for (i, c) in Cost::ALL.iter().enumerate() {
            assert_eq!(cost_index(*c), Some(i));
            assert_eq!(cost_name(*c), Some(COST_NAMES[i]));
        }
    }
}
