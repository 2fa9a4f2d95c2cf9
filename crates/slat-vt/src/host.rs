//! The built-in profile: this host's costs as `slat calibrate` measured them
//! (`profiles/host-2core-nested.toml`, each number with how it was measured), and the rough
//! estimates that came before it (`host_estimates`, which calibration starts from for the
//! model's design choices: lookahead, retention, fairness, lock policy).
//!
//! "Measured" numbers come from `examples/host_costs.rs` on the development host (a 2-vCPU
//! VM shared with builds: load average 11–22 during the runs, so they are rough); the rest are
//! estimates for a recent x86 server core, labelled as such.

use slat::clock::Cost;

use crate::profile::{Entry, LockPolicy, Model, PolicyEntry, Profile};

const CAS: &str =
    "measured: uncontended compare-and-swap loop, 6.8-10.6 ns (examples/host_costs.rs, load 11-22)";
const EST: &str = "estimate for a recent x86 core, not measured (slat calibrate will measure it)";
const EST_NESTED: &str = "estimate: this host is a nested VM where exits and IPIs cannot be measured in isolation; typical KVM figures";

/// This host's calibrated profile, as `slat calibrate` wrote it.
const CALIBRATED: &str = include_str!("../profiles/host-2core-nested.toml");

impl Profile {
    /// This host's calibrated costs (`profiles/host-2core-nested.toml`); each entry's
    /// `source` says how it was measured. The shipped file is checked by a test, so the
    /// fallback to [`Profile::host_estimates`] is never taken in a tested build.
    pub fn host_default() -> Profile {
        Profile::from_toml(CALIBRATED).unwrap_or_else(|_| Profile::host_estimates())
    }

    /// This host's rough costs before calibration; each entry's `source` says whether it was
    /// measured (and how) or estimated.
    pub fn host_estimates() -> Profile {
        let mut p = Profile {
            name: "host-default".into(),
            costs: Default::default(),
            model: Model {
                rmw_local: Entry::new(8.0, CAS),
                line_transfer: Entry::new(
                    70.0,
                    "estimate: same-socket core-to-core latency; the two-thread ping-pong of examples/host_costs.rs measured 5-17 us here, which is descheduling on the loaded 2-vCPU VM, not the line",
                ),
                invalidate: Entry::new(30.0, EST),
                dram_miss: Entry::new(90.0, EST),
                dram_stream: None,
                handoff: Entry::new(
                    6_000.0,
                    "measured: half a thread park/unpark round trip, 12.5-21 us (examples/host_costs.rs, load 11-22): a parking_lot waiter's futex wake-up",
                ),
                fair_every: Entry::new(
                    500_000.0,
                    "parking_lot's eventual fairness: a fair unlock about every 0.5 ms",
                ),
                retention: Entry::new(
                    1_000_000.0,
                    "design choice (docs/design/virtual-time.md section 3): 1 ms of virtual time",
                ),
                ipi_latency: Entry::new(2_000.0, EST_NESTED),
                lookahead: Entry::new(
                    10_000.0,
                    "design choice (docs/design/virtual-time.md section 2; docs/benchmarks.md, virtual time at scale): 10 us, a few faults; 1 us moved dirty-log-perf -v 64's virtual times by under 8% and ran up to 7x more baton switches",
                ),
                lock_policy: PolicyEntry {
                    policy: LockPolicy::Barging,
                    source: "slat's MMU lock is parking_lot's (unfair unlock, eventual fairness)"
                        .into(),
                },
            },
        };
        for (cost, ns, source) in COSTS {
            p.set_cost(cost, Entry::new(ns, source));
        }
        p
    }
}

const COSTS: [(Cost, f64, &str); 22] = [
    (Cost::WalkStep, 2.0, EST),
    (Cost::HwWalkStep, 2.0, EST),
    (Cost::TlbHit, 1.0, EST),
    (Cost::TlbMiss, 2.0, EST),
    (Cost::TlbFlush, 30.0, EST),
    (Cost::TableAlloc, 40.0, EST),
    (
        Cost::ZeroPage,
        150.0,
        "measured: write_bytes over 4 KiB pages in cache, 122-168 ns (examples/host_costs.rs, load 11-22)",
    ),
    (Cost::EpochPin, 8.0, CAS),
    (Cost::Defer, 20.0, EST),
    (Cost::PublishedLoad, 3.0, EST),
    (Cost::CmoLine, 15.0, EST),
    (
        Cost::GuestAccess,
        90.0,
        "estimate: a DRAM miss (memstress touches a new page each time)",
    ),
    (Cost::VmExit, 1_500.0, EST_NESTED),
    (Cost::VmEntry, 1_500.0, EST_NESTED),
    (Cost::IpiHandler, 1_000.0, EST_NESTED),
    (Cost::IpiSend, 500.0, EST_NESTED),
    (
        Cost::FastFault,
        0.0,
        "estimate: not charged (this profile predates the fault paths' own costs)",
    ),
    (
        Cost::SlowFault,
        0.0,
        "estimate: not charged (this profile predates the fault paths' own costs)",
    ),
    (Cost::WalkSide, 2.0, EST),
    (Cost::FastFaultExit, 3_000.0, EST_NESTED),
    (
        Cost::PageCopy,
        300.0,
        "estimate: about twice zero_page (4 KiB read and 4 KiB written), not measured",
    ),
    (
        Cost::GuestRoundTrip,
        1_500.0,
        "estimate: the simulated machine's PAUSE loop, 64 PAUSEs of about 25 ns",
    ),
];
